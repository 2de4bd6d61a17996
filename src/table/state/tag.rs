//! A page's tag: who holds it, its incarnation (generation and coverage watermark) and its place
//! (state, flags, owner slot hint and link), in 24 bytes.

use super::prefixes::PrefixSlot;
use crate::ids::RequestId;
use crate::table::info::PageState;

/// One page's tag: 24 bytes, plus `page_size` bits of coverage elsewhere.
///
/// Coverage is the page's [`HotWord`] FULL bit, a watermark and a bitmap: slot `s` is written iff
/// the page is whole ([`HotWord::is_full`]), or `s < watermark`, or its bit is set. Writes in order
/// (prefill chunks, decode appends) only move the watermark (and set FULL when it reaches the
/// page's end); a write of whole pages only sets their FULL bits (the watermark is left behind,
/// and later appends may move it: a whole page's written prefix is its size whatever the
/// watermark says); the bitmap is touched only by writes that leave a gap (`sparse`), and
/// cleared on release only if it was.
/// Read the written prefix through [`TableState::written_prefix`], never the field.
///
/// [`HotWord`]: crate::table::hot::HotWord
/// [`HotWord::is_full`]: crate::table::hot::HotWord::is_full
/// [`TableState::written_prefix`]: super::TableState::written_prefix
#[derive(Clone, Copy, Debug)]
pub(crate) struct PageTag {
    /// Owned: the owner's id. Shared: its prefix's handle ([`PrefixSlot`]; the publisher is in
    /// the prefix). Free: the last owner's id (for diagnosis only). Read it through
    /// [`owner`](Self::owner) and [`prefix`](Self::prefix). The tenant is not stored: it is the
    /// owner's (owned) or the prefix's (shared).
    pub holder: u64,
    /// The incarnation in one word, so ending it is one store: the generation in the low 32
    /// bits, the watermark above ([`generation`](Self::generation),
    /// [`watermark`](Self::watermark)).
    incarnation: u64,
    /// Where the page is, in one word, so a page changes hands in one store: the flags `SPARSE`
    /// and `PINNED` in the low bits, its state in bits 8 to 15, a hint of its owner's request
    /// slot in bits 16 to 31, its link in the high 32 bits ([`link`](Self::link),
    /// [`state`](Self::state), [`sparse`](Self::sparse), [`pinned`](Self::pinned),
    /// [`owner_slot_hint`](Self::owner_slot_hint)).
    place: u64,
}

impl PageTag {
    // The flags lowest, so a test or change of one is an instruction with a byte immediate.
    pub const SPARSE: u64 = 1;
    pub const PINNED: u64 = 1 << 1;
    const STATE_SHIFT: u32 = 8;
    const SLOT_SHIFT: u32 = 16;
    const SLOT_BITS: u64 = 0xffff << Self::SLOT_SHIFT;
    const LINK_SHIFT: u32 = 32;
    /// Added to a place, the same place at the next link.
    pub const NEXT_LINK: u64 = 1 << Self::LINK_SHIFT;

    /// A page in `state`, never written, linked at 0, in generation `generation`.
    pub fn new(state: PageState, generation: u32) -> PageTag {
        PageTag { holder: 0, incarnation: Self::incarnation_of(generation), place: Self::place_of(0, state) }
    }
    /// The [`incarnation`](Self::incarnation) word of generation `generation`, nothing written.
    #[inline(always)]
    pub fn incarnation_of(generation: u32) -> u64 {
        u64::from(generation)
    }
    /// The `place` word of a page at `link` in `state`, no flag set.
    #[inline(always)]
    pub fn place_of(link: u32, state: PageState) -> u64 {
        u64::from(link) << Self::LINK_SHIFT | (state as u64) << Self::STATE_SHIFT
    }
    /// The incarnation word: generation and watermark, as one value.
    #[inline(always)]
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }
    /// The incarnation word with the watermark `watermark`.
    #[inline(always)]
    pub fn with_watermark(&self, watermark: u32) -> u64 {
        u64::from(self.generation()) | u64::from(watermark) << 32
    }
    /// The generation of an incarnation word.
    #[inline(always)]
    pub fn generation_of(incarnation: u64) -> u32 {
        incarnation as u32
    }
    /// The watermark of an incarnation word.
    #[inline(always)]
    pub fn watermark_of(incarnation: u64) -> u32 {
        (incarnation >> 32) as u32
    }
    /// Sets generation and watermark at once (see [`incarnation_of`](Self::incarnation_of)).
    #[inline(always)]
    pub fn set_incarnation(&mut self, incarnation: u64) {
        self.incarnation = incarnation;
    }
    /// The place word: link, state and flags, as one value.
    #[inline(always)]
    pub fn place(&self) -> u64 {
        self.place
    }
    /// Sets link, state and flags at once (see [`place_of`](Self::place_of) and the flag
    /// constants).
    #[inline(always)]
    pub fn set_place(&mut self, place: u64) {
        self.place = place;
    }
    /// The page's incarnation.
    #[inline(always)]
    pub fn generation(&self) -> u32 {
        Self::generation_of(self.incarnation)
    }
    #[inline(always)]
    pub fn set_generation(&mut self, generation: u32) {
        self.incarnation = (self.incarnation & !u64::from(u32::MAX)) | u64::from(generation);
    }
    /// Slots `0..watermark` are all written by the current incarnation (the coverage watermark),
    /// unless the page is whole: then every slot is, and this may lag behind (see
    /// [`TableState::written_prefix`]).
    ///
    /// [`TableState::written_prefix`]: super::TableState::written_prefix
    #[inline(always)]
    pub fn watermark(&self) -> u32 {
        Self::watermark_of(self.incarnation)
    }
    #[inline(always)]
    pub fn set_watermark(&mut self, watermark: u32) {
        self.incarnation = self.with_watermark(watermark);
    }
    /// Owned: index in the owner's page list. Free: index in the free list. Shared: unused.
    #[inline(always)]
    pub fn link(&self) -> u32 {
        (self.place >> Self::LINK_SHIFT) as u32
    }
    #[inline(always)]
    pub fn set_link(&mut self, link: u32) {
        self.place = (self.place & u64::from(u32::MAX)) | u64::from(link) << Self::LINK_SHIFT;
    }
    #[inline(always)]
    pub fn state(&self) -> PageState {
        PageState::from_bits(self.state_bits())
    }
    /// The state's discriminant (`state() as u8`, without decoding it).
    #[inline(always)]
    pub fn state_bits(&self) -> u8 {
        (self.place >> Self::STATE_SHIFT) as u8
    }
    #[inline(always)]
    pub fn set_state(&mut self, state: PageState) {
        self.place = (self.place & !(0xff << Self::STATE_SHIFT)) | (state as u64) << Self::STATE_SHIFT;
    }
    /// The request slot its owner had when the page was given to it, if below `0xffff`: a hint,
    /// never an answer. A read of an owned page finds its owner's epoch word through it without
    /// the page's [`HotWord`], after [`RequestEpochs::word_of`] says the slot is its owner's
    /// ([`TableState::owner_word`]). Set where a page is given to a request
    /// ([`place_with_slot`](Self::place_with_slot)); any other change leaves it as it was, or
    /// clears it.
    ///
    /// [`HotWord`]: crate::table::hot::HotWord
    /// [`RequestEpochs::word_of`]: super::RequestEpochs::word_of
    /// [`TableState::owner_word`]: super::TableState::owner_word
    #[inline(always)]
    pub fn owner_slot_hint(&self) -> Option<u32> {
        let hint = ((self.place & Self::SLOT_BITS) >> Self::SLOT_SHIFT) as u32;
        hint.checked_sub(1)
    }
    /// `place` with `slot` as its owner slot hint (none if `slot` does not fit in it).
    #[inline(always)]
    pub fn place_with_slot(place: u64, slot: u32) -> u64 {
        let hint = if slot < 0xffff { u64::from(slot + 1) << Self::SLOT_SHIFT } else { 0 };
        (place & !Self::SLOT_BITS) | hint
    }
    /// Some coverage bit of this incarnation may be set.
    #[inline(always)]
    pub fn sparse(&self) -> bool {
        self.place & Self::SPARSE != 0
    }
    #[inline(always)]
    pub fn set_sparse(&mut self, sparse: bool) {
        self.set_flag(Self::SPARSE, sparse);
    }
    /// A KV transfer into this page is in flight ([`TableState::pin`]): if the page is released
    /// meanwhile it stays out of the free list until the transfer is finished or aborted, so the
    /// bytes still landing can never reach a next owner.
    ///
    /// [`TableState::pin`]: super::TableState::pin
    #[inline(always)]
    pub fn pinned(&self) -> bool {
        self.place & Self::PINNED != 0
    }
    #[inline(always)]
    pub fn set_pinned(&mut self, pinned: bool) {
        self.set_flag(Self::PINNED, pinned);
    }
    #[inline(always)]
    fn set_flag(&mut self, flag: u64, on: bool) {
        self.place = if on { self.place | flag } else { self.place & !flag };
    }
}

impl PageTag {
    /// The owner (owned), or the last owner (free).
    #[inline(always)]
    pub fn owner(&self) -> RequestId {
        RequestId(self.holder)
    }
    /// Owned by `req`.
    #[inline(always)]
    pub fn owned_by(&self, req: RequestId) -> bool {
        self.state() == PageState::Owned && self.holder == req.0
    }
    /// The prefix a shared page belongs to.
    #[inline(always)]
    pub fn prefix(&self) -> PrefixSlot {
        PrefixSlot::from_bits(self.holder)
    }
    /// Makes the page owned by `req` (the caller sets the state).
    #[inline(always)]
    pub fn set_owner(&mut self, req: RequestId) {
        self.holder = req.0;
    }
    /// Makes the page part of `prefix` (the caller sets the state).
    #[inline(always)]
    pub fn set_prefix(&mut self, prefix: PrefixSlot) {
        self.holder = prefix.to_bits();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::hot::HotWord;

    #[test]
    fn a_page_tag_is_24_bytes() {
        // The memory figure in the table's docs and the README depends on it.
        assert_eq!(std::mem::size_of::<PageTag>(), 24);
        assert_eq!(std::mem::size_of::<HotWord>(), 8);
    }
}
