//! The tag a device mirror of the table keeps for each page, in the byte layout of `kvg_tag` in
//! `kernels/kvguard.cuh`: the table writes changed tags straight into a mirror's upload buffer
//! ([`OwnershipTable::take_changed_tags_into`](super::OwnershipTable::take_changed_tags_into)).
//! The table knows the layout, nothing of CUDA; the byte encoding and the conversion from a
//! [`PageInfo`](super::PageInfo) live with the rest of the device layout in `cuda::layout`.
//! Which pages changed is kept in a [`ChangedPages`] map.

use crate::ids::PageId;

/// A page's tag as the kernels see it (`kvg_tag`): 32 bytes, 16-byte aligned.
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DeviceTag {
    /// Owned: the owning request. Shared: the publisher. Otherwise 0.
    pub owner: u64,
    /// The owner's tenant (owned or shared pages), otherwise 0.
    pub tenant: u64,
    /// The page's incarnation; 0 never names a live one (zeroed device memory).
    pub generation: u32,
    /// Slots `0..written` are written by the current incarnation.
    pub written: u32,
    /// The [`PageState`](super::PageState) discriminant.
    pub state: u32,
    /// `KVG_FLAG_*` bits: [`FLAG_SHARED_ACROSS_TENANTS`](Self::FLAG_SHARED_ACROSS_TENANTS); the
    /// other bits are reserved, 0.
    pub flags: u32,
}

impl DeviceTag {
    /// Bytes per tag.
    pub const SIZE: usize = 32;

    /// `KVG_FLAG_SHARED_ACROSS_TENANTS`: a shared page that a request of another tenant reads
    /// under a cross-tenant grant
    /// ([`PageInfo::shared_across_tenants`](super::PageInfo::shared_across_tenants)). The device
    /// check then lets a reader of any tenant read it, as the host lets that holder.
    pub const FLAG_SHARED_ACROSS_TENANTS: u32 = 1;
}

/// The pages whose device tags changed since a device mirror last took them: one bit per page,
/// in words of 64 pages.
///
/// Marking a page is an OR into its word, whatever it was before, so a page changed several
/// times is taken once, and a batch loop marks with no test and no length kept in memory (see
/// [`Marking`]). Taking scans the words (one per 64 pages of the pool, most of them zero between
/// two steps) and hands the pages back in id order, each once, clearing as it goes. The map
/// costs one bit per page, where a list cost four bytes.
#[derive(Debug)]
pub(crate) struct ChangedPages {
    words: Vec<u64>,
}

impl ChangedPages {
    /// Pages per word.
    pub const WORD: usize = 64;

    /// No page marked, in a pool of `pages` pages; `None` if memory runs out.
    pub fn new(pages: usize) -> Option<ChangedPages> {
        let mut words = Vec::new();
        words.try_reserve_exact(pages.div_ceil(Self::WORD)).ok()?;
        words.resize(pages.div_ceil(Self::WORD), 0);
        Some(ChangedPages { words })
    }

    /// Marks `page` changed. `page` is in the pool: every caller has just indexed its tag (past
    /// the pool's last word nothing is marked).
    #[inline(always)]
    pub fn mark(&mut self, page: PageId) {
        if let Some(word) = self.words.get_mut(page.0 as usize / Self::WORD) {
            *word |= 1 << (page.0 as usize % Self::WORD);
        }
    }

    /// A [`Marking`] for a batch loop's pages.
    #[inline(always)]
    pub fn marking(&mut self) -> Marking<'_> {
        Marking { map: self, word: usize::MAX, bits: 0 }
    }

    /// Marks the pages `bits` of word `w` (none if `w` is past the pool).
    #[inline(always)]
    fn mark_word(&mut self, w: usize, bits: u64) {
        if let Some(word) = self.words.get_mut(w) {
            *word |= bits;
        }
    }

    /// Marks every page of a pool of `pages` pages changed.
    pub fn mark_all(&mut self, pages: usize) {
        self.words.fill(u64::MAX);
        if let Some(last) = self.words.last_mut()
            && !pages.is_multiple_of(Self::WORD)
        {
            *last = (1 << (pages % Self::WORD)) - 1;
        }
    }

    /// How many pages are marked.
    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The words that have a page marked, each with its first page: page `first + b` is marked
    /// if bit `b` of the word is set. For a loop that takes the pages itself (and clears each
    /// word it takes).
    #[inline(always)]
    pub fn words_mut(&mut self) -> impl Iterator<Item = (u32, &mut u64)> {
        // A pool's page ids fit in a `u32`, and so does the first page of each of its words.
        self.words.iter_mut().enumerate().filter(|(_, w)| **w != 0).map(|(i, w)| ((i * Self::WORD) as u32, w))
    }

    /// Unmarks every marked page and appends it to `out`, in id order.
    pub fn take_into(&mut self, out: &mut Vec<PageId>) {
        for (first, word) in self.words_mut() {
            let mut bits = std::mem::take(word);
            while bits != 0 {
                out.push(PageId(first + bits.trailing_zeros()));
                bits &= bits - 1;
            }
        }
    }
}

/// Marks the pages of one batch loop (allocate, write, release) in a [`ChangedPages`] map, as
/// the loop reaches them: consecutive pages of one word are gathered in a register and stored
/// together (when the loop moves to another word, and when the marking is dropped), so a run of
/// neighbouring pages costs a shift and an OR per page, not a load and a store each waiting for
/// the last.
#[derive(Debug)]
pub(crate) struct Marking<'a> {
    map: &'a mut ChangedPages,
    /// The word `bits` belong to (`usize::MAX`: none yet).
    word: usize,
    /// The pages of that word marked and not yet stored.
    bits: u64,
}

impl Marking<'_> {
    /// Marks `page` changed.
    #[inline(always)]
    pub fn mark(&mut self, page: PageId) {
        let w = page.0 as usize / ChangedPages::WORD;
        if w != self.word {
            self.map.mark_word(self.word, self.bits);
            (self.word, self.bits) = (w, 0);
        }
        self.bits |= 1 << (page.0 as usize % ChangedPages::WORD);
    }
}

impl Drop for Marking<'_> {
    #[inline(always)]
    fn drop(&mut self) {
        self.map.mark_word(self.word, self.bits);
    }
}
