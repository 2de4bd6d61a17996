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
/// in words of 64 pages, and above them one bit per word that may have a page marked.
///
/// Marking a page is an OR into its word (and one into the word's summary), whatever it was
/// before, so a page changed several times is taken once, and a batch loop marks with no test and
/// no length kept in memory (see [`Marking`]). Taking visits only the words the summary flags
/// (one summary word per 4,096 pages of the pool: a step that changed a few pages of a large pool
/// does not scan it) and hands the pages back in id order, each once, clearing as it goes. The
/// map costs a bit per page and a bit per 64, where a list cost four bytes per page.
#[derive(Debug)]
pub(crate) struct ChangedPages {
    words: Vec<u64>,
    /// Bit `w % 64` of `summary[w / 64]`: `words[w]` may be non-zero (it is, unless all its
    /// marks were given as zero bits).
    summary: Vec<u64>,
}

impl ChangedPages {
    /// Pages per word, and words per summary word.
    pub const WORD: usize = 64;

    /// No page marked, in a pool of `pages` pages; `None` if memory runs out.
    pub fn new(pages: usize) -> Option<ChangedPages> {
        let zeroed = |n: usize| {
            let mut v = Vec::new();
            v.try_reserve_exact(n).ok()?;
            v.resize(n, 0u64);
            Some(v)
        };
        let words = zeroed(pages.div_ceil(Self::WORD))?;
        let summary = zeroed(words.len().div_ceil(Self::WORD))?;
        Some(ChangedPages { words, summary })
    }

    /// Marks `page` changed. `page` is in the pool: every caller has just indexed its tag (past
    /// the pool's last word nothing is marked).
    #[inline(always)]
    pub fn mark(&mut self, page: PageId) {
        self.mark_word(page.0 as usize / Self::WORD, 1 << (page.0 as usize % Self::WORD));
    }

    /// A [`Marking`] for a batch loop's pages (create it inside the loop's function, so its
    /// fields stay in registers).
    #[inline(always)]
    pub fn marking(&mut self) -> Marking<'_> {
        Marking { map: self, word: usize::MAX, bits: 0 }
    }

    /// Marks the pages `bits` of word `w` (none if `w` is past the pool).
    #[inline(always)]
    fn mark_word(&mut self, w: usize, bits: u64) {
        if let Some(word) = self.words.get_mut(w) {
            *word |= bits;
            // `summary` has a bit for every word.
            if let Some(summary) = self.summary.get_mut(w / Self::WORD) {
                *summary |= 1 << (w % Self::WORD);
            }
        }
    }

    /// [`mark_word`](Self::mark_word) for a [`Marking`] moving to another word: out of the
    /// marking loop, so the loop keeps its registers.
    #[inline(never)]
    fn store_word(&mut self, w: usize, bits: u64) {
        self.mark_word(w, bits);
    }

    /// Marks every page of a pool of `pages` pages changed.
    pub fn mark_all(&mut self, pages: usize) {
        let ones = |n: usize| if n.is_multiple_of(Self::WORD) { u64::MAX } else { (1 << (n % Self::WORD)) - 1 };
        self.words.fill(u64::MAX);
        if let Some(last) = self.words.last_mut() {
            *last = ones(pages);
        }
        self.summary.fill(u64::MAX);
        let words = self.words.len();
        if let Some(last) = self.summary.last_mut() {
            *last = ones(words);
        }
    }

    /// Unmarks every marked page, calling `f` once for each word that had some: with the word's
    /// first page and its bits (page `first + b` was marked if bit `b` is set), in page order.
    #[inline(always)]
    pub fn take_words(&mut self, mut f: impl FnMut(u32, u64)) {
        for (s, summary) in self.summary.iter_mut().enumerate() {
            if *summary == 0 {
                continue; // 4,096 pages unchanged: read, never written
            }
            let mut flagged = std::mem::take(summary);
            while flagged != 0 {
                let w = s * Self::WORD + flagged.trailing_zeros() as usize;
                flagged &= flagged - 1;
                // A flagged word is in the pool; a pool's page ids fit in a `u32`, and so does
                // the first page of each of its words.
                if let Some(word) = self.words.get_mut(w)
                    && *word != 0
                {
                    f((w * Self::WORD) as u32, std::mem::take(word));
                }
            }
        }
    }

    /// Unmarks every marked page and appends it to `out`, in id order.
    pub fn take_into(&mut self, out: &mut Vec<PageId>) {
        self.take_words(|first, mut bits| {
            while bits != 0 {
                out.push(PageId(first + bits.trailing_zeros()));
                bits &= bits - 1;
            }
        });
    }
}

/// Marks the pages of one batch loop (allocate, write, release) in a [`ChangedPages`] map, as the
/// loop reaches them: consecutive pages of one word are gathered in a register and stored
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
            self.map.store_word(self.word, self.bits);
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// Takes `map`'s pages both ways it hands them out (the words, and the page list) and
    /// checks them against `reference`, which is then cleared as the map is.
    fn taken(map: &mut ChangedPages, reference: &mut BTreeSet<u32>, by_words: bool) {
        let mut pages = Vec::new();
        if by_words {
            map.take_words(|first, mut bits| {
                assert_ne!(bits, 0, "a word with no page marked is not handed out");
                while bits != 0 {
                    pages.push(first + bits.trailing_zeros());
                    bits &= bits - 1;
                }
            });
        } else {
            let mut ids = Vec::new();
            map.take_into(&mut ids);
            pages = ids.into_iter().map(|p| p.0).collect();
        }
        assert_eq!(pages, reference.iter().copied().collect::<Vec<_>>(), "taken once each, in page order");
        reference.clear();
        let mut again = Vec::new();
        map.take_into(&mut again);
        assert!(again.is_empty(), "a take leaves nothing marked");
    }

    #[test]
    fn marked_pages_are_taken_once_each_in_page_order_as_a_set_would_give_them() {
        // Pools on both sides of a word's and of a summary word's width.
        for pool in [1usize, 63, 64, 65, 4095, 4096, 4097, 10_000] {
            let mut map = ChangedPages::new(pool).expect("fits");
            let mut reference = BTreeSet::new();
            let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ pool as u64;
            let mut next = move || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            for round in 0..40 {
                // Scattered pages one at a time, runs of neighbours and random lists as a batch
                // (repeats included), then a take.
                for _ in 0..next() % 20 {
                    let p = (next() % pool as u64) as u32;
                    map.mark(PageId(p));
                    reference.insert(p);
                }
                let start = next() % pool as u64;
                let run: Vec<PageId> =
                    (start..(start + next() % 200).min(pool as u64)).map(|p| PageId(p as u32)).collect();
                let mut marking = map.marking();
                run.iter().for_each(|&p| marking.mark(p));
                drop(marking);
                reference.extend(run.iter().map(|p| p.0));
                let list: Vec<PageId> = (0..next() % 50).map(|_| PageId((next() % pool as u64) as u32)).collect();
                let mut marking = map.marking();
                list.iter().for_each(|&p| marking.mark(p));
                drop(marking);
                reference.extend(list.iter().map(|p| p.0));
                if round % 7 == 3 {
                    map.mark_all(pool);
                    reference.extend(0..pool as u32);
                }
                taken(&mut map, &mut reference, round % 2 == 0);
            }
        }
    }
}
