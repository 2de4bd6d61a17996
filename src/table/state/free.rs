//! The free list: the free pages allocator mode hands out, with room reserved up front.

use super::tag::PageTag;
use crate::ids::PageId;
use crate::table::info::PageState;

/// The free pages allocator mode hands out: a stack, the most recently freed on top, each free
/// page's tag linking to its entry. A page claimed by id (shadow mode: the engine chose it, as
/// SGLang and vLLM do for every page) is not looked for here: its entry goes stale where it lies
/// ([`take`](Self::take)), which saves a claim two scattered lines (this list's, and the tag of
/// the entry a removal would move into its place). An entry at `i` is live while its page is
/// free, not pinned and linked to `i`; [`top`](Self::top) drops the stale ones it meets on its
/// way down. When stale entries would overflow the room (twice the pool's pages, reserved up
/// front) the entries are dropped, all at once ([`make_room`](Self::make_room)), and the next
/// [`top`](Self::top) lists the free pages again from the tags, in one pass in page order: an
/// engine that only claims by id never pays for that pass, one that allocates too pays it at
/// most once for every pool's worth of claims by id.
#[derive(Debug)]
pub(crate) struct FreeList {
    entries: Vec<PageId>,
    /// Free pages not pinned, whether listed or not.
    live: usize,
    /// The entries were dropped: some live pages are not listed.
    dropped: bool,
}

impl FreeList {
    /// An empty list with room for `2 * pages` entries; `None` if the memory is not there.
    pub(super) fn with_room(pages: usize) -> Option<FreeList> {
        let mut entries = Vec::new();
        entries.try_reserve_exact(pages.checked_mul(2)?).ok()?;
        Some(FreeList { entries, live: 0, dropped: false })
    }

    /// Free pages not pinned: what allocate can hand out.
    pub fn len(&self) -> usize {
        self.live
    }

    fn is_live(tags: &[PageTag], at: usize, page: PageId) -> bool {
        let tag = &tags[page.0 as usize];
        tag.state() == PageState::Free && !tag.pinned() && tag.link() as usize == at
    }

    /// Room for `more` entries: the entries dropped if stale ones fill it.
    pub fn make_room(&mut self, more: usize) {
        if self.entries.len() + more > self.entries.capacity() {
            self.entries.clear();
            self.dropped = true;
        }
        debug_assert!(more <= self.entries.capacity(), "the room is twice the pool");
    }

    /// Lists every free page not pinned, the lowest ids on top (as a fresh pool hands them out).
    #[cold]
    #[inline(never)]
    pub(super) fn list_free(&mut self, tags: &mut [PageTag]) {
        self.entries.clear();
        for (p, tag) in tags.iter_mut().enumerate().rev() {
            if tag.state() == PageState::Free && !tag.pinned() {
                // The pool's size is a `u32`.
                tag.set_link(self.entries.len() as u32);
                self.entries.push(PageId(p as u32));
            }
        }
        self.live = self.entries.len();
        self.dropped = false;
    }

    /// The link the next entry gets (the first of a run that [`extend`](Self::extend) adds).
    pub fn next_link(&self) -> u32 {
        self.entries.len() as u32
    }

    /// Lists `page` (free, not pinned), after [`make_room`](Self::make_room).
    pub fn push(&mut self, tags: &mut [PageTag], page: PageId) {
        debug_assert!(self.entries.len() < self.entries.capacity(), "make_room first");
        tags[page.0 as usize].set_link(self.next_link());
        self.entries.push(page);
        self.live += 1;
    }

    /// Lists `pages` (free, not pinned), their tags linked from [`next_link`](Self::next_link)
    /// up already, after [`make_room`](Self::make_room).
    pub fn extend(&mut self, pages: &[PageId]) {
        debug_assert!(self.entries.len() + pages.len() <= self.entries.capacity(), "make_room first");
        self.entries.extend_from_slice(pages);
        self.live += pages.len();
    }

    /// A live page taken by id: its entry, if any, stays, stale.
    pub fn take(&mut self) {
        self.live -= 1;
    }

    /// The top `n` live entries (`n` at most [`len`](Self::len)), the stale ones above and among
    /// them dropped, for allocate to hand out and then [`pop`](Self::pop); the free pages listed
    /// again first if the entries were dropped. `None` only if the live count was off (a bug):
    /// the free pages are listed again, and the caller refuses the allocation.
    pub fn top(&mut self, tags: &mut [PageTag], n: usize) -> Option<&[PageId]> {
        if self.dropped {
            let live = self.live;
            self.list_free(tags);
            debug_assert_eq!(self.live, live, "the live count was off");
        }
        let len = self.entries.len();
        // Live entries packed up from the top as they are met; `read` walks down.
        let (mut read, mut write) = (len, len);
        while len - write < n {
            if read == 0 {
                self.list_free(tags);
                return None;
            }
            read -= 1;
            let page = self.entries[read];
            if Self::is_live(tags, read, page) {
                write -= 1;
                self.entries[write] = page;
            }
        }
        self.entries.drain(read..write);
        Some(&self.entries[self.entries.len() - n..])
    }

    /// Removes the top `n` entries (live, as [`top`](Self::top) left them): handed out.
    pub fn pop(&mut self, n: usize) {
        self.entries.truncate(self.entries.len() - n);
        self.live -= n;
    }
}
