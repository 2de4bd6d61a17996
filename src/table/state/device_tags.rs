//! The pages changed since a device mirror last took them, taken as page ids or as the device
//! tags the mirror copies.

use super::TableState;
use super::prefixes::{PrefixRecord, PrefixSlot};
use super::requests::Requests;
use super::tag::PageTag;
use crate::ids::{PageId, RequestId};
use crate::table::hot::HotWord;
use crate::table::info::PageState;
use crate::table::mirror::{ChangedPages, DeviceTag};
use slotmap::SlotMap;

impl TableState {
    /// Counts a take (so no request's pages count as marked any more), first starting to track
    /// changes if nobody did yet (every page then counts as changed: a new mirror has none of
    /// the tags).
    fn start_take(&mut self) {
        if !self.tracking_changes {
            self.tracking_changes = true;
            self.changed.mark_all(self.tags.len());
        }
        self.takes += 1;
    }

    /// Appends the device tag of every changed page to `out`, in page order, and unmarks them
    /// (see [`take_changed`](Self::take_changed)); returns how many it appended.
    pub fn take_changed_tags_into(&mut self, out: &mut Vec<(u32, DeviceTag)>) -> usize {
        self.start_take();
        let before = out.len();
        let TableState { tags, hot, changed, requests, prefixes, page_size, .. } = self;
        let holders = Holders { requests, prefixes, last_owner: None };
        device_tags_into(tags, hot, changed, *page_size, holders, out);
        out.len() - before
    }

    /// The pages changed since the last call, in page order, each once, and unmarks them; the
    /// first call returns the whole pool and starts the tracking.
    pub fn take_changed(&mut self) -> Vec<PageId> {
        self.start_take();
        let mut pages = Vec::new();
        self.changed.take_into(&mut pages);
        pages
    }
}

/// What a device tag names of a held page's holder, looked up by
/// [`device_tags_into`] off its loop.
struct Holders<'a> {
    requests: &'a Requests,
    prefixes: &'a SlotMap<PrefixSlot, PrefixRecord>,
    /// The last owner looked up and its tenant: changed pages come in runs of one owner.
    last_owner: Option<(u64, u64)>,
}

/// The device tag of a page nobody holds (its tag `tag`, its hot word `word`): no holder, and
/// its watermark is its written prefix (the FULL bit went with its last incarnation).
#[inline(always)]
fn unheld_device_tag(tag: &PageTag, word: HotWord) -> DeviceTag {
    let incarnation = tag.incarnation();
    // The word's holder, 0 for a page nobody holds: a zero from memory, not a constant, so the
    // compiler writes the fields one by one instead of copying a zeroed template through the
    // stack (a 16-byte load of a just-stored, misaligned 16 bytes: a stall per page).
    let nobody = u64::from(word.holder());
    DeviceTag {
        owner: nobody,
        tenant: nobody,
        generation: PageTag::generation_of(incarnation),
        written: PageTag::watermark_of(incarnation),
        state: u32::from(tag.state_bits()),
        flags: 0,
    }
}

impl Holders<'_> {
    /// The device tag of a page whose tag is `tag`; `full` tells whether a held page is whole
    /// (its hot word's FULL bit, read only for a held page).
    #[inline(always)]
    fn device_tag(&mut self, tag: &PageTag, full: impl FnOnce() -> bool, page_size: u32) -> DeviceTag {
        // As a page nobody holds: no holder, its watermark its written prefix (the FULL bit went
        // with its last incarnation).
        let state = tag.state_bits();
        let (mut owner, mut tenant, mut flags, mut incarnation) = (0, 0, 0, tag.incarnation());
        if PageState::held_bits(state) {
            // Held: its holder's, and whole if its FULL bit says so.
            if state == PageState::Owned as u8 {
                (owner, tenant) = (tag.holder, self.owner_tenant(tag.holder));
            } else {
                (owner, tenant, flags) = self.prefix(tag.holder);
            }
            if full() {
                incarnation = tag.with_watermark(page_size);
            }
        }
        // Generation and written prefix from one word: stored as one.
        DeviceTag {
            owner,
            tenant,
            generation: PageTag::generation_of(incarnation),
            written: PageTag::watermark_of(incarnation),
            state: u32::from(state),
            flags,
        }
    }

    /// The tenant of the owner `holder` of an owned page.
    #[inline(always)]
    fn owner_tenant(&mut self, holder: u64) -> u64 {
        match self.last_owner {
            Some((owner, tenant)) if owner == holder => tenant,
            _ => self.look_up_owner(holder),
        }
    }
    #[cold]
    #[inline(never)]
    fn look_up_owner(&mut self, holder: u64) -> u64 {
        let tenant = self.requests.get(&RequestId(holder)).map_or(0, |r| r.tenant.0);
        self.last_owner = Some((holder, tenant));
        tenant
    }
    /// A shared page's publisher, tenant and device flags, from its prefix handle `holder`.
    #[cold]
    #[inline(never)]
    fn prefix(&self, holder: u64) -> (u64, u64, u32) {
        match self.prefixes.get(PrefixSlot::from_bits(holder)) {
            Some(p) => {
                (p.publisher.0, p.tenant.0, if p.cross_tenant { DeviceTag::FLAG_SHARED_ACROSS_TENANTS } else { 0 })
            }
            None => (0, 0, 0),
        }
    }
}

/// [`TableState::take_changed_tags_into`]'s loop: appends the device tag of each page marked in
/// `changed` to `out`, in page order, and unmarks them.
///
/// Word by word, each word's tags appended by an `extend` whose length is known (room made once
/// per word, no capacity test or length in memory per page); the holders of held pages looked up
/// off the loop.
#[inline(never)] // apart, so only the loop's own values compete for registers
fn device_tags_into(
    tags: &[PageTag],
    hot: &[HotWord],
    changed: &mut ChangedPages,
    page_size: u32,
    mut holders: Holders<'_>,
    out: &mut Vec<(u32, DeviceTag)>,
) {
    // As long as `tags`, so a page in range of one needs no second bounds check.
    let hot = &hot[..tags.len()];
    changed.take_words(|first, mut bits| {
        let holders = &mut holders;
        let (from, to) = (first as usize, first as usize + ChangedPages::WORD);
        if bits == u64::MAX
            && let (Some(run), Some(words)) = (tags.get(from..to), hot.get(from..to))
        {
            if words.iter().all(|w| !w.is_held()) {
                // And nobody holds any (a batch released): no holder to look up, no call in
                // the loop, so its values stay in registers.
                out.extend(
                    run.iter().zip(words).zip(first..).map(|((tag, &word), page)| (page, unheld_device_tag(tag, word))),
                );
                return;
            }
            // All 64 pages of the word changed (a batch of neighbours): their tags as one slice,
            // no bit scan and one bounds check. `extend` over zipped slices knows its length.
            out.extend(
                run.iter()
                    .zip(words)
                    .zip(first..)
                    .map(|((tag, word), page)| (page, holders.device_tag(tag, || word.is_full(), page_size))),
            );
            return;
        }
        // `extend` over a range's map knows its length: room for the word's pages is made once,
        // and each tag written in place. The word's bits moved into the closure, so they stay in
        // a register.
        out.extend((0..bits.count_ones()).map(move |_| {
            let page = first + bits.trailing_zeros();
            bits &= bits - 1;
            // A marked page is in the pool; past it, one would be listed retired (fail closed).
            let tag = tags.get(page as usize).copied().unwrap_or(PageTag::new(PageState::Retired, 0));
            (page, holders.device_tag(&tag, || hot[page as usize].is_full(), page_size))
        }));
    });
}
