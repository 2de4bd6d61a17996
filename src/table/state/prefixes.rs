//! Prefixes as the table keeps them: a prefix's handle in the prefix store, its record, and the
//! prefixes one request holds.

use super::id_map::IdHash;
use crate::ids::{PageId, PrefixKey, RequestId, TenantId};
use slotmap::{Key, KeyData};
use std::collections::HashMap;

slotmap::new_key_type! {
    /// A prefix's handle in the prefix store: a slot and its version. A handle kept past its
    /// prefix's end no longer matches once the slot holds another prefix, so it is caught rather
    /// than trusted. (A slot's version wraps after 2^31 reuses; a handle would have to outlive
    /// that many prefixes in one slot to match again.)
    pub(crate) struct PrefixSlot;
}

impl PrefixSlot {
    /// The handle as the 64 bits a page tag keeps.
    #[inline(always)]
    pub(super) fn to_bits(self) -> u64 {
        self.data().as_ffi()
    }
    /// The handle's slot index, unique among live prefixes: a shared page's holder in its
    /// [`HotWord`].
    ///
    /// [`HotWord`]: crate::table::hot::HotWord
    #[inline(always)]
    pub fn index(self) -> u32 {
        self.to_bits() as u32 // `KeyData::as_ffi` keeps the index in the low 32 bits
    }
    /// The handle from the 64 bits [`to_bits`](Self::to_bits) gave.
    #[inline(always)]
    pub(super) fn from_bits(bits: u64) -> PrefixSlot {
        KeyData::from_ffi(bits).into()
    }
}

/// The prefixes one request holds, in the order it took them: a short list scanned in place,
/// and past [`HeldPrefixes::INLINE`] a list with a hash index beside it, so the membership test,
/// adding a hold and dropping one stay O(1) however many prefixes (one per cached block, in
/// vLLM's style) a request holds, and in whatever order it takes them. (A sorted list cost a
/// shift per insert: 400,000 holds taken in descending order were quadratic.) Dropping a hold
/// moves the last one into its place.
///
/// The order is what a read's prefix run follows ([`in_order`](Self::in_order)): an engine that
/// takes one prefix per cached block takes them in the order its block table lists them.
///
/// The indexed form is boxed, so that a request's record stays small (the hash index alone is
/// 32 bytes): a claim looks its record up, and a record of 128 bytes spread over three cache
/// lines where one of 88 spreads over two.
#[derive(Clone, Debug)]
pub(crate) enum HeldPrefixes {
    Few(Vec<PrefixSlot>),
    Many(Box<ManyHeld>),
}

/// [`HeldPrefixes`] past [`HeldPrefixes::INLINE`].
#[derive(Clone, Debug)]
pub(crate) struct ManyHeld {
    order: Vec<PrefixSlot>,
    /// Each held slot's place in `order`.
    at: HashMap<PrefixSlot, u32, IdHash>,
}

impl Default for HeldPrefixes {
    fn default() -> Self {
        HeldPrefixes::Few(Vec::new())
    }
}

impl HeldPrefixes {
    /// Holds kept in a plain list before the list gets an index.
    pub const INLINE: usize = 8;

    #[inline]
    pub fn contains(&self, slot: PrefixSlot) -> bool {
        self.position(slot).is_some()
    }
    /// Where `slot` is in [`in_order`](Self::in_order), if held.
    #[inline]
    pub fn position(&self, slot: PrefixSlot) -> Option<usize> {
        match self {
            HeldPrefixes::Few(list) => list.iter().position(|&s| s == slot),
            HeldPrefixes::Many(m) => m.at.get(&slot).map(|&i| i as usize),
        }
    }
    /// The held slots, in the order they were taken (but where a dropped hold's place went to
    /// the last one).
    #[inline]
    pub fn in_order(&self) -> &[PrefixSlot] {
        match self {
            HeldPrefixes::Few(list) => list,
            HeldPrefixes::Many(m) => &m.order,
        }
    }
    /// Adds `slot`; false if it was already held.
    pub fn insert(&mut self, slot: PrefixSlot) -> bool {
        match self {
            HeldPrefixes::Few(list) if list.contains(&slot) => false,
            HeldPrefixes::Few(list) if list.len() < Self::INLINE => {
                list.push(slot);
                true
            }
            HeldPrefixes::Few(list) => {
                let mut order = std::mem::take(list);
                order.push(slot);
                let at = order.iter().enumerate().map(|(i, &s)| (s, i as u32)).collect();
                *self = HeldPrefixes::Many(Box::new(ManyHeld { order, at }));
                true
            }
            HeldPrefixes::Many(m) => {
                let ManyHeld { order, at } = &mut **m;
                if at.contains_key(&slot) {
                    return false;
                }
                // A request's holds fit in u32: each is a live prefix, and slot indices are u32.
                at.insert(slot, order.len() as u32);
                order.push(slot);
                true
            }
        }
    }
    /// Drops `slot`; false if it was not held.
    pub fn remove(&mut self, slot: PrefixSlot) -> bool {
        match self {
            HeldPrefixes::Few(list) => match list.iter().position(|&s| s == slot) {
                Some(i) => {
                    list.swap_remove(i);
                    true
                }
                None => false,
            },
            HeldPrefixes::Many(m) => match m.at.remove(&slot) {
                Some(i) => {
                    let ManyHeld { order, at } = &mut **m;
                    order.swap_remove(i as usize);
                    if let Some(&moved) = order.get(i as usize) {
                        at.insert(moved, i);
                    }
                    true
                }
                None => false,
            },
        }
    }
    pub fn iter(&self) -> impl Iterator<Item = PrefixSlot> + '_ {
        self.in_order().iter().copied()
    }
}

pub(crate) struct PrefixRecord {
    /// `None` for the anonymous prefix a fork creates; it goes when its last holder does.
    pub key: Option<PrefixKey>,
    pub tenant: TenantId,
    pub publisher: RequestId,
    pub pages: Vec<PageId>,
    pub holders: u32,
    /// A request of another tenant attached to it (under the publisher tenant's
    /// cross-tenant grant). Set on that attach (its pages are marked changed, so a device mirror
    /// re-syncs) and kept until the prefix goes: the device check, which cannot see holders,
    /// then lets any tenant read its pages.
    pub cross_tenant: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::table::info::PageState;
    use crate::table::state::PageTag;
    use slotmap::SlotMap;

    #[test]
    fn a_prefix_handle_kept_past_its_prefix_matches_nothing() {
        let record = || PrefixRecord {
            key: None,
            tenant: TenantId(1),
            publisher: RequestId(1),
            pages: vec![],
            holders: 1,
            cross_tenant: false,
        };
        let mut store: SlotMap<PrefixSlot, PrefixRecord> = SlotMap::with_key();
        let old = store.insert(record());
        let mut held = HeldPrefixes::default();
        held.insert(old);
        store.remove(old);
        let new = store.insert(record()); // the same slot, a new version
        assert_ne!(old, new);
        assert!(store.get(old).is_none() && !held.contains(new));
        // A page tag carries the handle whole.
        let mut tag = PageTag::new(PageState::Shared, 1);
        tag.set_prefix(new);
        assert_eq!(tag.prefix(), new);
        assert!(!held.contains(tag.prefix()));
    }
}
