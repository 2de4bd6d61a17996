//! The device data layout: `#[repr(C)]` mirrors of the structs in `kernels/kvguard.cuh`, the
//! violation kinds the kernels record, the canary function, and the ring-buffer drain.
//!
//! Everything here is safe, plain Rust: it compiles and is tested without CUDA. The byte
//! encodings (`to_bytes`/`from_bytes`) are explicit little-endian field by field, so the tests
//! that exchange them with the host-compiled kernels also check that the two layouts agree.

use crate::ids::{Generation, PageId, RequestId, TenantId};
use crate::le;
pub use crate::table::DeviceTag;
use crate::table::{PageInfo, PageState};
use crate::violation::{Op, Violation, ViolationKind};

impl DeviceTag {
    /// The device tag of a page the host table describes.
    pub fn from_page_info(info: &PageInfo) -> DeviceTag {
        DeviceTag {
            owner: info.owner.map_or(0, |r| r.0),
            tenant: info.tenant.map_or(0, |t| t.0),
            generation: info.generation.0,
            written: info.written_prefix,
            state: info.state as u32,
            flags: if info.shared_across_tenants { Self::FLAG_SHARED_ACROSS_TENANTS } else { 0 },
        }
    }

    /// The tag's little-endian bytes, in `kvg_tag` order.
    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[0..8].copy_from_slice(&self.owner.to_le_bytes());
        b[8..16].copy_from_slice(&self.tenant.to_le_bytes());
        b[16..20].copy_from_slice(&self.generation.to_le_bytes());
        b[20..24].copy_from_slice(&self.written.to_le_bytes());
        b[24..28].copy_from_slice(&self.state.to_le_bytes());
        b[28..32].copy_from_slice(&self.flags.to_le_bytes());
        b
    }

    /// A tag from the first [`SIZE`](Self::SIZE) bytes of `b`, its `kvg_tag` bytes; `None` if
    /// `b` is shorter.
    pub fn from_bytes(b: &[u8]) -> Option<DeviceTag> {
        Some(DeviceTag {
            owner: le::u64_at(b, 0)?,
            tenant: le::u64_at(b, 8)?,
            generation: le::u32_at(b, 16)?,
            written: le::u32_at(b, 20)?,
            state: le::u32_at(b, 24)?,
            flags: le::u32_at(b, 28)?,
        })
    }

    /// The page state, if the discriminant is a known one.
    pub fn page_state(&self) -> Option<PageState> {
        Some(match self.state {
            0 => PageState::Free,
            1 => PageState::Owned,
            2 => PageState::Shared,
            3 => PageState::Reserved,
            4 => PageState::Retired,
            5 => PageState::AwaitingScrub,
            _ => return None,
        })
    }
}

/// Who reads (or writes) through one sequence of a step (`kvg_reader`): 16 bytes.
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DeviceReader {
    /// The request.
    pub request: u64,
    /// Its tenant.
    pub tenant: u64,
}

impl DeviceReader {
    /// Bytes per reader.
    pub const SIZE: usize = 16;

    /// The reader for `request` of `tenant`.
    pub fn new(request: RequestId, tenant: TenantId) -> DeviceReader {
        DeviceReader { request: request.0, tenant: tenant.0 }
    }

    /// Its little-endian bytes, in `kvg_reader` order.
    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[0..8].copy_from_slice(&self.request.to_le_bytes());
        b[8..16].copy_from_slice(&self.tenant.to_le_bytes());
        b
    }
}

/// What the device found wrong (`KVG_KIND_*`); bit `code` of a sequence's status word.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
#[non_exhaustive]
pub enum DeviceKind {
    /// A page id below 0 or beyond the pool.
    PageOutOfRange = 1,
    /// The null/padding page.
    ReservedPage = 2,
    /// A free, retired or awaiting-scrub page.
    FreedPage = 3,
    /// Another request's page, or another tenant's prefix (unless shared across tenants).
    ForeignPage = 4,
    /// A generation other than the one the engine recorded.
    StalePage = 5,
    /// Slots the tag says the current incarnation never wrote.
    UnwrittenSlots = 6,
    /// More tokens than the block table has pages for.
    BlockTableTooShort = 7,
    /// A slot whose canary the current incarnation did not stamp.
    CanaryMismatch = 8,
    /// A KV store into a read-only prefix page.
    WriteToShared = 9,
    /// A malformed step (`kv_last_page_len` or `kv_indptr` out of range, negative length).
    BadLayout = 10,
}

impl DeviceKind {
    /// Every kind, in code order.
    pub const ALL: [DeviceKind; 10] = [
        DeviceKind::PageOutOfRange,
        DeviceKind::ReservedPage,
        DeviceKind::FreedPage,
        DeviceKind::ForeignPage,
        DeviceKind::StalePage,
        DeviceKind::UnwrittenSlots,
        DeviceKind::BlockTableTooShort,
        DeviceKind::CanaryMismatch,
        DeviceKind::WriteToShared,
        DeviceKind::BadLayout,
    ];

    /// The kind with this `KVG_KIND_*` code.
    pub fn from_code(code: u32) -> Option<DeviceKind> {
        DeviceKind::ALL.get(code.checked_sub(1)? as usize).copied()
    }

    /// The `KVG_KIND_*` code.
    pub fn code(self) -> u32 {
        self as u32
    }

    /// The host table's name for it. A canary mismatch is KV the current incarnation never
    /// wrote, so it is [`ViolationKind::UnwrittenSlots`]; a malformed step is
    /// [`ViolationKind::SlotOutOfRange`].
    pub fn violation_kind(self) -> ViolationKind {
        match self {
            DeviceKind::PageOutOfRange => ViolationKind::PageOutOfRange,
            DeviceKind::ReservedPage => ViolationKind::ReservedPage,
            DeviceKind::FreedPage => ViolationKind::FreedPage,
            DeviceKind::ForeignPage => ViolationKind::ForeignPage,
            DeviceKind::StalePage => ViolationKind::StalePage,
            DeviceKind::UnwrittenSlots | DeviceKind::CanaryMismatch => ViolationKind::UnwrittenSlots,
            DeviceKind::BlockTableTooShort => ViolationKind::BlockTableTooShort,
            DeviceKind::WriteToShared => ViolationKind::WriteToShared,
            DeviceKind::BadLayout => ViolationKind::SlotOutOfRange,
        }
    }

    /// The kinds set in a sequence's status word, in code order.
    pub fn from_status(status: u32) -> Vec<DeviceKind> {
        DeviceKind::ALL.iter().copied().filter(|k| status & (1 << k.code()) != 0).collect()
    }
}

/// `KVG_OP_READ`.
pub const OP_READ: u32 = 1;
/// `KVG_OP_WRITE`.
pub const OP_WRITE: u32 = 2;

/// One violation record of the device ring (`kvg_violation`): 96 bytes.
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct DeviceViolation {
    /// A `KVG_KIND_*` code.
    pub kind: u32,
    /// [`OP_READ`] or [`OP_WRITE`].
    pub op: u32,
    /// The sequence's index in the step (the token's index for stores).
    pub seq: u32,
    /// The page's index in the sequence's block table.
    pub block: u32,
    /// The page id as the block table gave it (-1 for step-level faults).
    pub page: i32,
    /// First slot concerned; for step-level faults, the tokens asked.
    pub slot_start: u32,
    /// One past the last slot concerned; for step-level faults, the limit.
    pub slot_end: u32,
    /// The generation the engine recorded for the entry; 0 if none was given.
    pub expected_generation: u32,
    /// The reader or writer.
    pub request: u64,
    /// Its tenant.
    pub tenant: u64,
    /// The page's tag as the device saw it.
    pub found: DeviceTag,
    /// Ring position + 1, written last.
    pub sequence_no: u64,
    /// Reserved.
    pub reserved: u64,
}

impl DeviceViolation {
    /// Bytes per record.
    pub const SIZE: usize = 96;

    /// A record from the first [`SIZE`](Self::SIZE) bytes of `b`, its `kvg_violation` bytes;
    /// `None` if `b` is shorter.
    pub fn from_bytes(b: &[u8]) -> Option<DeviceViolation> {
        Some(DeviceViolation {
            kind: le::u32_at(b, 0)?,
            op: le::u32_at(b, 4)?,
            seq: le::u32_at(b, 8)?,
            block: le::u32_at(b, 12)?,
            page: le::u32_at(b, 16)? as i32,
            slot_start: le::u32_at(b, 20)?,
            slot_end: le::u32_at(b, 24)?,
            expected_generation: le::u32_at(b, 28)?,
            request: le::u64_at(b, 32)?,
            tenant: le::u64_at(b, 40)?,
            found: DeviceTag::from_bytes(b.get(48..)?)?,
            sequence_no: le::u64_at(b, 80)?,
            reserved: le::u64_at(b, 88)?,
        })
    }

    /// The device kind, if the code is known.
    pub fn device_kind(&self) -> Option<DeviceKind> {
        DeviceKind::from_code(self.kind)
    }

    /// The record as a host [`Violation`], in the table's vocabulary (`None` for an unknown code).
    pub fn to_violation(&self) -> Option<Violation> {
        let kind = self.device_kind()?;
        let op = if self.op == OP_WRITE { Op::Write } else { Op::Read };
        let mut v = Violation::new(kind.violation_kind(), op)
            .with_request(RequestId(self.request), Some(TenantId(self.tenant)));
        match kind {
            DeviceKind::BlockTableTooShort | DeviceKind::BadLayout => {
                return Some(v.with_amounts(u64::from(self.slot_start), u64::from(self.slot_end)));
            }
            _ => {}
        }
        if self.page >= 0 {
            let generation = (kind != DeviceKind::PageOutOfRange).then_some(Generation(self.found.generation));
            v = v.with_page(PageId(self.page as u32), generation);
        }
        if op == Op::Read {
            v = v.with_block_index(self.block);
        }
        if matches!(self.found.page_state(), Some(PageState::Owned | PageState::Shared)) {
            v = v.with_owner(RequestId(self.found.owner), TenantId(self.found.tenant));
        }
        if self.expected_generation != 0 {
            v = v.with_expected_generation(Generation(self.expected_generation));
        }
        if self.slot_end > self.slot_start {
            v = v.with_slots(self.slot_start, self.slot_end);
        }
        Some(v)
    }
}

/// The ring header (`kvg_ring`): 32 bytes, followed in the same allocation by `capacity` records.
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct RingHeader {
    /// Records ever reserved by the device.
    pub head: u64,
    /// Records dropped: the ring was full, or (a sequence's further findings, which only
    /// describe) half full.
    pub dropped: u64,
    /// Records the host has drained.
    pub consumed: u64,
    /// Records that fit.
    pub capacity: u32,
    /// Of the records dropped, those that were a sequence's first finding of a step: the
    /// request each named is unknown to the host (it wraps at `u32::MAX`).
    pub lost: u32,
}

impl RingHeader {
    /// Bytes of the header.
    pub const SIZE: usize = 32;

    /// The header from the first [`SIZE`](Self::SIZE) bytes of `b`, its `kvg_ring` bytes;
    /// `None` if `b` is shorter.
    pub fn from_bytes(b: &[u8]) -> Option<RingHeader> {
        Some(RingHeader {
            head: le::u64_at(b, 0)?,
            dropped: le::u64_at(b, 8)?,
            consumed: le::u64_at(b, 16)?,
            capacity: le::u32_at(b, 24)?,
            lost: le::u32_at(b, 28)?,
        })
    }

    /// The header's bytes.
    pub fn to_bytes(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[0..8].copy_from_slice(&self.head.to_le_bytes());
        b[8..16].copy_from_slice(&self.dropped.to_le_bytes());
        b[16..24].copy_from_slice(&self.consumed.to_le_bytes());
        b[24..28].copy_from_slice(&self.capacity.to_le_bytes());
        b[28..32].copy_from_slice(&self.lost.to_le_bytes());
        b
    }

    /// Bytes of a ring of `capacity` records, header included.
    pub fn ring_bytes(capacity: u32) -> usize {
        Self::SIZE + capacity as usize * DeviceViolation::SIZE
    }
}

/// What one drain of the ring found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RingDrain {
    /// Complete records, oldest first.
    pub records: Vec<DeviceViolation>,
    /// Records the device dropped (ring full, or half full for a sequence's further findings)
    /// since the ring was created.
    pub dropped_total: u64,
    /// Of those, a sequence's first finding of a step (the one a refusal needs), since the ring
    /// was created (the device's count wraps at `u32::MAX`).
    pub first_findings_dropped: u32,
    /// Records reserved but not complete when copied (a kernel still running): lost to this drain.
    pub incomplete: u64,
    /// The new `consumed` value to write back to the device.
    pub consumed: u64,
}

impl RingDrain {
    /// Reads a copy of the whole ring (header and records). Positions `consumed..head` are taken
    /// (at most `capacity` of them; the rest were dropped on the device and are counted there).
    pub fn parse(ring: &[u8]) -> Option<RingDrain> {
        let h = RingHeader::from_bytes(ring)?;
        if h.capacity == 0 || ring.len() < RingHeader::ring_bytes(h.capacity) {
            return None;
        }
        let mut out = RingDrain {
            dropped_total: h.dropped,
            first_findings_dropped: h.lost,
            consumed: h.head,
            ..RingDrain::default()
        };
        let end = h.head.min(h.consumed.saturating_add(u64::from(h.capacity)));
        for pos in h.consumed..end {
            let at = RingHeader::SIZE + (pos % u64::from(h.capacity)) as usize * DeviceViolation::SIZE;
            let rec = DeviceViolation::from_bytes(ring.get(at..)?)?;
            if rec.sequence_no == pos + 1 {
                out.records.push(rec);
            } else {
                out.incomplete += 1;
            }
        }
        Some(out)
    }
}

/// The canary of `slot` of `page` written by `owner` in incarnation `generation`; bit-exact with
/// `kvg_canary` in `kvguard.cuh`. Never 0, so zeroed canary memory never passes.
pub fn canary(owner: u64, generation: u32, page: u32, slot: u32) -> u32 {
    fn mix64(mut h: u64) -> u64 {
        h ^= h >> 33;
        h = h.wrapping_mul(0xff51afd7ed558ccd);
        h ^= h >> 33;
        h = h.wrapping_mul(0xc4ceb9fe1a85ec53);
        h ^= h >> 33;
        h
    }
    let page_hash = mix64(mix64(owner ^ 0x9e3779b97f4a7c15) ^ ((u64::from(generation) << 32) | u64::from(page)));
    let c = (mix64(page_hash ^ 0x632be59bd9b4e019u64.wrapping_mul(u64::from(slot) + 1)) >> 32) as u32;
    if c != 0 { c } else { 1 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{align_of, size_of};

    #[test]
    fn sizes_are_the_documented_ones() {
        assert_eq!(size_of::<DeviceTag>(), DeviceTag::SIZE);
        assert_eq!(align_of::<DeviceTag>(), 16);
        assert_eq!(size_of::<DeviceReader>(), DeviceReader::SIZE);
        assert_eq!(size_of::<DeviceViolation>(), DeviceViolation::SIZE);
        assert_eq!(size_of::<RingHeader>(), RingHeader::SIZE);
    }

    #[test]
    fn a_tag_round_trips_through_its_bytes() {
        let t = DeviceTag { owner: 1 << 40 | 7, tenant: 3, generation: 9, written: 16, state: 2, flags: 0 };
        assert_eq!(DeviceTag::from_bytes(&t.to_bytes()), Some(t));
        assert_eq!(DeviceTag::from_bytes(&t.to_bytes()[..DeviceTag::SIZE - 1]), None);
    }

    #[test]
    fn kinds_round_trip_through_codes_and_status_words() {
        for k in DeviceKind::ALL {
            assert_eq!(DeviceKind::from_code(k.code()), Some(k));
        }
        assert_eq!(DeviceKind::from_code(0), None);
        assert_eq!(DeviceKind::from_code(11), None);
        let status = (1 << DeviceKind::ForeignPage.code()) | (1 << DeviceKind::CanaryMismatch.code());
        assert_eq!(DeviceKind::from_status(status), vec![DeviceKind::ForeignPage, DeviceKind::CanaryMismatch]);
    }

    #[test]
    fn canaries_differ_by_owner_generation_page_and_slot() {
        let c = canary(5, 2, 10, 3);
        assert_ne!(c, 0);
        assert_ne!(c, canary(6, 2, 10, 3));
        assert_ne!(c, canary(5, 3, 10, 3));
        assert_ne!(c, canary(5, 2, 11, 3));
        assert_ne!(c, canary(5, 2, 10, 4));
    }
}
