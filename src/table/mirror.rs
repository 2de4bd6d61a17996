//! The tag a device mirror of the table keeps for each page, in the byte layout of `kvg_tag` in
//! `kernels/kvguard.cuh`: the table writes changed tags straight into a mirror's upload buffer
//! ([`OwnershipTable::take_changed_tags_into`](super::OwnershipTable::take_changed_tags_into)).
//! The table knows the layout, nothing of CUDA; the byte encoding and the conversion from a
//! [`PageInfo`](super::PageInfo) live with the rest of the device layout in `cuda::layout`.

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
