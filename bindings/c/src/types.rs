//! The C values: enums, the structs that carry their own size, and their conversions from the
//! core's values. Nothing here decides anything; it only converts.
#![allow(non_camel_case_types)]

use crate::raw::SizedStruct;
use kvguard::{Op, PageRef, PageState, PoolSnapshot, Violation, ViolationKind};
use std::ffi::{CString, c_char};
use std::mem::size_of;
use std::sync::OnceLock;

/// Bytes of `kvg_violation_info.message`, its NUL included; a longer line is cut at a character
/// boundary.
pub const KVG_MESSAGE_CAPACITY: usize = 256;

/// `kvg_violation_info.fields`: `request` (and `tenant`, if its bit is set too) is known.
pub const KVG_FIELD_REQUEST: u32 = 1 << 0;
/// `kvg_violation_info.fields`: `tenant` is known.
pub const KVG_FIELD_TENANT: u32 = 1 << 1;
/// `kvg_violation_info.fields`: `page` is known.
pub const KVG_FIELD_PAGE: u32 = 1 << 2;
/// `kvg_violation_info.fields`: `generation` is known.
pub const KVG_FIELD_GENERATION: u32 = 1 << 3;
/// `kvg_violation_info.fields`: `block_index` is known.
pub const KVG_FIELD_BLOCK_INDEX: u32 = 1 << 4;
/// `kvg_violation_info.fields`: `owner` and `owner_tenant` are known (`kvg_page_info.fields`:
/// `owner` and `tenant`).
pub const KVG_FIELD_OWNER: u32 = 1 << 5;
/// `kvg_violation_info.fields`: `expected_generation` is known.
pub const KVG_FIELD_EXPECTED_GENERATION: u32 = 1 << 6;
/// `kvg_violation_info.fields`: `slot_start` and `slot_end` are known.
pub const KVG_FIELD_SLOTS: u32 = 1 << 7;
/// `kvg_violation_info.fields` / `kvg_page_info.fields`: `prefix` is known.
pub const KVG_FIELD_PREFIX: u32 = 1 << 8;
/// `kvg_violation_info.fields`: `found` and `limit` are known.
pub const KVG_FIELD_AMOUNTS: u32 = 1 << 9;
/// `kvg_violation_info.fields`: `row` is known (the violation refused one row of a step call).
pub const KVG_FIELD_ROW: u32 = 1 << 10;

/// What a pool does with a violation.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvg_policy {
    /// Refuse, and quarantine the offending request (the production setting).
    Enforce = 0,
    /// Record and continue (shadow roll-out): reads that violate are counted and logged but let
    /// through; mutations that would break ownership are still refused.
    Report = 1,
}

/// What rule a violation broke; the names are the core's (`kvg_violation_kind_name`). Values
/// follow the core's declaration order from 1, so a zeroed struct reads as no kind.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvg_violation_kind {
    /// The pool cannot hold one max-context request.
    PoolTooSmall = 1,
    /// Prompt + max new tokens exceed the model's max context.
    ExceedsMaxContext,
    /// The request needs more pages than the pool can ever give.
    ExceedsPool,
    /// A request id that is already live.
    DuplicateRequest,
    /// A request id that was never admitted (or ended long ago).
    UnknownRequest,
    /// A release of a page or request already released.
    DoubleFree,
    /// A claim of a page that is not free.
    PageNotFree,
    /// A page id beyond the pool (or negative).
    PageOutOfRange,
    /// The null/padding page.
    ReservedPage,
    /// A page another request owns (or another tenant's prefix).
    ForeignPage,
    /// A page that is free, awaiting a scrub, or retired.
    FreedPage,
    /// Slots the page's current incarnation never wrote.
    UnwrittenSlots,
    /// Slots beyond the page.
    SlotOutOfRange,
    /// A write into a read-only shared page.
    WriteToShared,
    /// A prefix key already published.
    DuplicatePrefix,
    /// A prefix key not published (or not held).
    UnknownPrefix,
    /// Another tenant's prefix, without its permission.
    CrossTenantShare,
    /// An eviction of a prefix some request holds.
    EvictInUse,
    /// A transfer of another token count than expected.
    TokenCountMismatch,
    /// A page ref to an incarnation that ended.
    StalePage,
    /// A read by a quarantined request.
    Quarantined,
    /// A read of more tokens than the block table has pages for.
    BlockTableTooShort,
    /// A release or publish of a page in a shared prefix.
    PageShared,
    /// A transfer manifest for another request, tenant or sender.
    TransferMisrouted,
    /// A transfer manifest naming other pages or sizes.
    TransferPagesMismatch,
    /// A transferred prompt with another digest.
    PromptDigestMismatch,
    /// A transferred page whose CRC32 does not match.
    PageChecksumMismatch,
    /// A transferred page of the wrong length.
    PageLengthMismatch,
    /// A transfer manifest with a missing checksum.
    MissingChecksum,
    /// Transfer manifest bytes that do not decode.
    ManifestCorrupt,
    /// A KV slot whose canary does not bind it to the reader.
    CanaryMismatch,
    /// A transfer into a page another transfer is still landing in.
    ImportInFlight,
    /// A write of tokens `start..end` with `start` after `end`.
    TokenRangeReversed,
    /// A transfer whose bytes could not be landed (the land callback failed): the import was
    /// abandoned and its pages made unreadable; it does not quarantine the request.
    LandingFailed,
}

impl kvg_violation_kind {
    /// The C value of a core kind: its position in [`ViolationKind::ALL`], from 1 (0 for a kind
    /// newer than the core this was built with, which cannot happen in one build).
    pub(crate) fn value(kind: ViolationKind) -> u32 {
        ViolationKind::ALL.iter().position(|&k| k == kind).map_or(0, |i| i as u32 + 1)
    }
}

/// The operation a violation happened in.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvg_operation {
    /// An operation newer than this binding.
    Unknown = 0,
    /// Pool configuration.
    Configure,
    /// Admission.
    Admit,
    /// Allocator-mode allocation.
    Allocate,
    /// Shadow-mode claim.
    Claim,
    /// A KV write.
    Write,
    /// An attention read.
    Read,
    /// A release.
    Release,
    /// A prefix publish.
    Publish,
    /// A prefix attach.
    Attach,
    /// A prefix detach.
    Detach,
    /// A prefix eviction.
    Evict,
    /// A fork.
    Fork,
    /// A KV transfer landing.
    Import,
    /// A scrub confirmation.
    Scrub,
}

impl kvg_operation {
    fn from_core(op: Op) -> kvg_operation {
        match op {
            Op::Configure => kvg_operation::Configure,
            Op::Admit => kvg_operation::Admit,
            Op::Allocate => kvg_operation::Allocate,
            Op::Claim => kvg_operation::Claim,
            Op::Write => kvg_operation::Write,
            Op::Read => kvg_operation::Read,
            Op::Release => kvg_operation::Release,
            Op::Publish => kvg_operation::Publish,
            Op::Attach => kvg_operation::Attach,
            Op::Detach => kvg_operation::Detach,
            Op::Evict => kvg_operation::Evict,
            Op::Fork => kvg_operation::Fork,
            Op::Import => kvg_operation::Import,
            Op::Scrub => kvg_operation::Scrub,
            _ => kvg_operation::Unknown,
        }
    }
}

/// Where a page is in its life (the core's `PageState`, same values).
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum kvg_page_state {
    /// Free: nobody may read or write it.
    Free = 0,
    /// Owned by one request.
    Owned = 1,
    /// In a read-only prefix.
    Shared = 2,
    /// Never allocatable, never readable.
    Reserved = 3,
    /// Its generation reached the limit: never handed out again.
    Retired = 4,
    /// Released, waiting for `kvg_confirm_scrubbed`.
    AwaitingScrub = 5,
}

impl kvg_page_state {
    fn from_core(state: PageState) -> kvg_page_state {
        match state {
            PageState::Free => kvg_page_state::Free,
            PageState::Owned => kvg_page_state::Owned,
            PageState::Shared => kvg_page_state::Shared,
            PageState::Reserved => kvg_page_state::Reserved,
            PageState::Retired => kvg_page_state::Retired,
            PageState::AwaitingScrub => kvg_page_state::AwaitingScrub,
        }
    }
}

/// The static, NUL-terminated name of violation kind `value` (`"foreign_page"`), or `"unknown"`.
#[unsafe(no_mangle)]
pub extern "C" fn kvg_violation_kind_name(kind: u32) -> *const c_char {
    static NAMES: OnceLock<Vec<CString>> = OnceLock::new();
    std::panic::catch_unwind(|| {
        let names = NAMES
            .get_or_init(|| ViolationKind::ALL.iter().map(|k| CString::new(k.as_str()).unwrap_or_default()).collect());
        match (kind as usize).checked_sub(1).and_then(|i| names.get(i)) {
            Some(name) => name.as_ptr(),
            None => c"unknown".as_ptr(),
        }
    })
    .unwrap_or(c"unknown".as_ptr())
}

/// One incarnation of a page: the page and the generation it had when handed out.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvg_page_ref {
    /// The page (an `int32` like a block table entry; a negative one names no page).
    pub page: i32,
    /// Its incarnation.
    pub generation: u32,
}

impl kvg_page_ref {
    pub(crate) fn from_core(r: PageRef) -> kvg_page_ref {
        // A page id is below `MAX_PAGES` (2^26), so it fits an `int32`.
        kvg_page_ref { page: r.page.0 as i32, generation: r.generation.0 }
    }

    pub(crate) fn to_core(self) -> PageRef {
        PageRef { page: crate::raw::page(self.page), generation: kvguard::Generation(self.generation) }
    }
}

/// The engine's KV pool, for `kvg_table_new` and `kvg_pool_config_audit`. Start from
/// `kvg_pool_config_init`, which sets `struct_size` and the defaults.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvg_pool_config {
    /// `sizeof(kvg_pool_config)` as the caller compiled it.
    pub struct_size: usize,
    /// Pages in the pool, ids `0..num_pages`.
    pub num_pages: u32,
    /// Token slots per page.
    pub page_size: u32,
    /// The most tokens (prompt + generated) one request may have.
    pub max_context_tokens: u64,
    /// Pages never allocated and never readable (the null/padding page), or NULL.
    pub reserved: *const i32,
    /// Entries of `reserved`.
    pub num_reserved: usize,
    /// A `kvg_policy` (default `KVG_POLICY_ENFORCE`).
    pub policy: u32,
    /// Non-zero: released pages must be scrubbed and confirmed before reuse (default 0).
    pub scrub_on_release: u32,
    /// The generation at which a page retires; 0 for the default (`UINT32_MAX`). Lower only to
    /// test retirement.
    pub generation_limit: u32,
}

/// Counts of a pool's pages by state, and a few totals; filled by `kvg_snapshot`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvg_pool_snapshot {
    /// `sizeof(kvg_pool_snapshot)` as the caller compiled it.
    pub struct_size: usize,
    /// Pages in the pool.
    pub total_pages: u64,
    /// Free pages.
    pub free: u64,
    /// Pages owned by one request.
    pub owned: u64,
    /// Pages in read-only prefixes.
    pub shared: u64,
    /// Reserved pages.
    pub reserved: u64,
    /// Retired pages.
    pub retired: u64,
    /// Released pages waiting for a scrub confirmation.
    pub awaiting_scrub: u64,
    /// Admitted requests.
    pub requests: u64,
    /// Admitted requests that are quarantined.
    pub quarantined: u64,
    /// Live prefixes.
    pub prefixes: u64,
    /// Violations seen in all.
    pub violations: u64,
    /// Violations dropped from the log because nobody drained it.
    pub violations_dropped: u64,
    /// Released pages a transfer still lands in.
    pub in_flight: u64,
}

impl kvg_pool_snapshot {
    pub(crate) fn from_core(s: PoolSnapshot) -> kvg_pool_snapshot {
        kvg_pool_snapshot {
            struct_size: size_of::<Self>(),
            total_pages: s.total_pages,
            free: s.free,
            owned: s.owned,
            shared: s.shared,
            reserved: s.reserved,
            retired: s.retired,
            awaiting_scrub: s.awaiting_scrub,
            requests: s.requests,
            quarantined: s.quarantined,
            prefixes: s.prefixes,
            violations: s.violations,
            violations_dropped: s.violations_dropped,
            in_flight: s.in_flight,
        }
    }
}

/// What the table knows of one page; filled by `kvg_get_page_info`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvg_page_info {
    /// `sizeof(kvg_page_info)` as the caller compiled it.
    pub struct_size: usize,
    /// A `kvg_page_state`.
    pub state: u32,
    /// Its current incarnation.
    pub generation: u32,
    /// `KVG_FIELD_OWNER`, `KVG_FIELD_PREFIX`: which of the fields below are known.
    pub fields: u32,
    /// Slots `0..written_prefix` are all written by the current incarnation.
    pub written_prefix: u32,
    /// Slots written by the current incarnation, in all.
    pub written_slots: u32,
    /// Owner (or prefix publisher) while owned or shared.
    pub owner: u64,
    /// The owner's tenant.
    pub tenant: u64,
    /// The table's id of the prefix it belongs to (see `kvg_violation_info.prefix`).
    pub prefix: u64,
}

impl kvg_page_info {
    pub(crate) fn from_core(p: kvguard::PageInfo) -> kvg_page_info {
        let mut fields = 0;
        if p.owner.is_some() {
            fields |= KVG_FIELD_OWNER;
        }
        if p.prefix.is_some() {
            fields |= KVG_FIELD_PREFIX;
        }
        kvg_page_info {
            struct_size: size_of::<Self>(),
            state: kvg_page_state::from_core(p.state) as u32,
            generation: p.generation.0,
            fields,
            written_prefix: p.written_prefix,
            written_slots: p.written_slots,
            owner: p.owner.map_or(0, |r| r.0),
            tenant: p.tenant.map_or(0, |t| t.0),
            prefix: p.prefix.map_or(0, |k| k.0),
        }
    }
}

/// What the table knows of one admitted request; filled by `kvg_get_request_info`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvg_request_info {
    /// `sizeof(kvg_request_info)` as the caller compiled it.
    pub struct_size: usize,
    /// Its tenant.
    pub tenant: u64,
    /// Prompt tokens it was admitted with.
    pub prompt_tokens: u64,
    /// New tokens it may generate.
    pub max_new_tokens: u64,
    /// Pages it owns exclusively.
    pub owned_pages: u64,
    /// Named prefixes it holds.
    pub prefixes: u64,
    /// Non-zero: quarantined by an enforced violation.
    pub quarantined: u32,
}

/// What a release handed back (`kvg_release`, `kvg_release_pages`, `kvg_preempt`,
/// `kvg_detach_prefix`, `kvg_evict_prefix`). The caller sets `struct_size`, and `scrub` and
/// `scrub_capacity` when the pool scrubs on release; kvguard fills `ended` and `scrub_len` and
/// leaves `struct_size` as the caller set it (the struct may be passed again).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvg_released {
    /// `sizeof(kvg_released)` as the caller compiled it.
    pub struct_size: usize,
    /// Out: how many page incarnations ended.
    pub ended: u64,
    /// In: room for the pages to scrub (pool with `scrub_on_release`), or NULL.
    pub scrub: *mut kvg_page_ref,
    /// In: entries `scrub` has room for.
    pub scrub_capacity: usize,
    /// Out: pages the engine must scrub then pass to `kvg_confirm_scrubbed`. More than
    /// `scrub_capacity` means the list was cut (`KVG_STATUS_BUFFER_TOO_SMALL`; the release is
    /// done, and the pages missing from the list read `KVG_PAGE_STATE_AWAITING_SCRUB` in
    /// `kvg_get_page_info`, their ref's generation one below the page's).
    pub scrub_len: usize,
}

/// A violation, field by field; `fields` says which are known. Filled by `kvg_last_violation`
/// and `kvg_drain_violation`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct kvg_violation_info {
    /// `sizeof(kvg_violation_info)` as the caller compiled it.
    pub struct_size: usize,
    /// A `kvg_violation_kind`.
    pub kind: u32,
    /// A `kvg_operation`.
    pub operation: u32,
    /// `KVG_FIELD_*` bits: which fields below are known.
    pub fields: u32,
    /// The page's position in the block table read or written.
    pub block_index: u32,
    /// The page concerned (a negative id passed in reads as 2^32 + id).
    pub page: u32,
    /// The page's generation at the time.
    pub generation: u32,
    /// The generation the caller's page ref named.
    pub expected_generation: u32,
    /// First slot concerned.
    pub slot_start: u32,
    /// One past the last slot concerned.
    pub slot_end: u32,
    /// The request that performed the operation.
    pub request: u64,
    /// That request's tenant.
    pub tenant: u64,
    /// The page's owner (or the prefix's publisher).
    pub owner: u64,
    /// The owner's tenant.
    pub owner_tenant: u64,
    /// The table's id of the prefix concerned: prefix keys are byte strings interned per table
    /// in publish order from 1, never hashed.
    pub prefix: u64,
    /// The count that broke a limit (tokens, pages, holders); for `token_range_reversed`, the
    /// range's start.
    pub found: u64,
    /// The limit; for `token_range_reversed`, the range's end.
    pub limit: u64,
    /// For a step call: the refused row.
    pub row: u64,
    /// The violation in one line, NUL-terminated (cut at a character boundary if longer).
    pub message: [c_char; KVG_MESSAGE_CAPACITY],
}

impl kvg_violation_info {
    pub(crate) fn from_violation(v: &Violation, row: Option<usize>) -> kvg_violation_info {
        let mut info = kvg_violation_info {
            struct_size: size_of::<Self>(),
            kind: kvg_violation_kind::value(v.kind()),
            operation: kvg_operation::from_core(v.op()) as u32,
            fields: 0,
            block_index: 0,
            page: 0,
            generation: 0,
            expected_generation: 0,
            slot_start: 0,
            slot_end: 0,
            request: 0,
            tenant: 0,
            owner: 0,
            owner_tenant: 0,
            prefix: 0,
            found: 0,
            limit: 0,
            row: 0,
            message: [0; KVG_MESSAGE_CAPACITY],
        };
        let mut set = |bit: u32| info.fields |= bit;
        let request = v.request().inspect(|_| set(KVG_FIELD_REQUEST));
        let tenant = v.tenant().inspect(|_| set(KVG_FIELD_TENANT));
        let page = v.page().inspect(|_| set(KVG_FIELD_PAGE));
        let generation = v.generation().inspect(|_| set(KVG_FIELD_GENERATION));
        let block = v.block_index().inspect(|_| set(KVG_FIELD_BLOCK_INDEX));
        let owner = v.owner().inspect(|_| set(KVG_FIELD_OWNER));
        let expected = v.expected_generation().inspect(|_| set(KVG_FIELD_EXPECTED_GENERATION));
        let slots = v.slots().inspect(|_| set(KVG_FIELD_SLOTS));
        let prefix = v.prefix().inspect(|_| set(KVG_FIELD_PREFIX));
        let amounts = v.amounts().inspect(|_| set(KVG_FIELD_AMOUNTS));
        let row = row.inspect(|_| set(KVG_FIELD_ROW));
        info.request = request.map_or(0, |r| r.0);
        info.tenant = tenant.map_or(0, |t| t.0);
        info.page = page.map_or(0, |p| p.0);
        info.generation = generation.map_or(0, |g| g.0);
        info.block_index = block.unwrap_or(0);
        info.owner = owner.map_or(0, |r| r.0);
        info.owner_tenant = v.owner_tenant().map_or(0, |t| t.0);
        info.expected_generation = expected.map_or(0, |g| g.0);
        (info.slot_start, info.slot_end) = slots.unwrap_or((0, 0));
        info.prefix = prefix.map_or(0, |k| k.0);
        (info.found, info.limit) = amounts.unwrap_or((0, 0));
        info.row = row.map_or(0, |r| r as u64);
        let line = v.to_string();
        let mut end = line.len().min(KVG_MESSAGE_CAPACITY - 1);
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        for (dst, &src) in info.message.iter_mut().zip(&line.as_bytes()[..end]) {
            *dst = src as c_char;
        }
        info
    }
}

/// Who a KV transfer is for and the shape of its pages, for `kvg_manifest_build` (the sender's
/// side; the rest of the manifest comes from the prompt and the page bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvg_transfer_header {
    /// `sizeof(kvg_transfer_header)` as the caller compiled it.
    pub struct_size: usize,
    /// The request whose KV this is (the receiver's id for it).
    pub request: u64,
    /// Its tenant.
    pub tenant: u64,
    /// The sending instance (a prefill worker's id).
    pub sender: u64,
    /// Token slots per page (the same on both sides).
    pub page_size: u32,
    /// Bytes of KV per token slot: a page carrying `t` tokens sends `t * slot_bytes` bytes.
    pub slot_bytes: u32,
}

/// What a manifest says, filled by `kvg_manifest_get_info`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvg_manifest_info {
    /// `sizeof(kvg_manifest_info)` as the caller compiled it.
    pub struct_size: usize,
    /// The request whose KV this is.
    pub request: u64,
    /// Its tenant.
    pub tenant: u64,
    /// The sending instance.
    pub sender: u64,
    /// Tokens prefilled.
    pub prompt_tokens: u64,
    /// The digest of the prompt prefilled (`kvg_prompt_digest`).
    pub prompt_digest: u64,
    /// Token slots per page.
    pub page_size: u32,
    /// Bytes per token slot.
    pub slot_bytes: u32,
    /// Pages listed (`kvg_manifest_get_pages`).
    pub num_pages: u64,
}

/// One page of a manifest: where it lands, how many tokens it carries, its bytes' CRC32.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct kvg_manifest_page {
    /// The receiving page, in the incarnation the receiver offered.
    pub dest: kvg_page_ref,
    /// Token slots it carries, from slot 0.
    pub tokens: u32,
    /// CRC32 of its bytes, 0 folded into 1 (`kvg_page_checksum`).
    pub crc32: u32,
}

/// What the receiver expects of a transfer, from its own copy of the request, for
/// `kvg_accept_transfer`. The caller owns the arrays it points to for the call.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct kvg_expected_transfer {
    /// `sizeof(kvg_expected_transfer)` as the caller compiled it.
    pub struct_size: usize,
    /// The receiving request.
    pub request: u64,
    /// Its tenant.
    pub tenant: u64,
    /// The sender asked, checked only when `check_sender` is non-zero.
    pub sender: u64,
    /// Non-zero: the transfer must come from `sender`.
    pub check_sender: u32,
    /// Token slots per page: the table's page size.
    pub page_size: u32,
    /// Bytes per token slot.
    pub slot_bytes: u32,
    /// Entries of `prompt`.
    pub prompt_len: usize,
    /// The receiver's copy of the prompt's token ids (each read as its 32 bits).
    pub prompt: *const i32,
    /// Entries of `pages`.
    pub num_pages: usize,
    /// The receiving pages in token order, in the incarnations offered to the sender: exactly the
    /// pages the prompt lands in.
    pub pages: *const kvg_page_ref,
}

/// What an accepted transfer recorded, filled by `kvg_accept_transfer`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct kvg_accepted {
    /// `sizeof(kvg_accepted)` as the caller compiled it.
    pub struct_size: usize,
    /// Tokens recorded as written for the receiving request.
    pub tokens: u64,
    /// Pages landed.
    pub pages: u64,
}

/// Copies one accepted page into the engine's pool: called by `kvg_accept_transfer` for page
/// `index` (landing in `page`) with its `len` bytes, only once every check passed. `user` is the
/// pointer given to `kvg_accept_transfer`. Returns 0 when the bytes landed; any other value (a
/// `cudaError_t`, an errno) says the copy failed, which fails the import at that page: nothing
/// recorded as written, the receiving pages' coverage revoked, `landing_failed` recorded, and
/// `kvg_accept_transfer` returns `KVG_STATUS_VIOLATION` with the value in its message. It must not
/// unwind (no C++ exception may leave it). Since ABI version 2 (`KVG_ABI_VERSION`); in version 1
/// it returned `void` and could not report a failed copy.
pub type kvg_land_fn = Option<
    unsafe extern "C" fn(
        user: *mut std::ffi::c_void,
        index: usize,
        page: kvg_page_ref,
        bytes: *const u8,
        len: usize,
    ) -> std::ffi::c_int,
>;

// SAFETY (each impl): `#[repr(C)]`, the first field is `struct_size: usize`, and every field is an
// integer, a raw pointer or an array of integers, so every bit pattern is valid.
unsafe impl SizedStruct for kvg_pool_config {
    const MIN_SIZE: usize = size_of::<Self>();
}
// SAFETY: as above.
unsafe impl SizedStruct for kvg_pool_snapshot {
    const MIN_SIZE: usize = size_of::<Self>();
}
// SAFETY: as above.
unsafe impl SizedStruct for kvg_page_info {
    const MIN_SIZE: usize = size_of::<Self>();
}
// SAFETY: as above.
unsafe impl SizedStruct for kvg_request_info {
    const MIN_SIZE: usize = size_of::<Self>();
}
// SAFETY: as above.
unsafe impl SizedStruct for kvg_released {
    const MIN_SIZE: usize = size_of::<Self>();
}
// SAFETY: as above.
unsafe impl SizedStruct for kvg_violation_info {
    const MIN_SIZE: usize = size_of::<Self>();
}
// SAFETY: as above.
unsafe impl SizedStruct for kvg_transfer_header {
    const MIN_SIZE: usize = size_of::<Self>();
}
// SAFETY: as above.
unsafe impl SizedStruct for kvg_manifest_info {
    const MIN_SIZE: usize = size_of::<Self>();
}
// SAFETY: as above.
unsafe impl SizedStruct for kvg_expected_transfer {
    const MIN_SIZE: usize = size_of::<Self>();
}
// SAFETY: as above.
unsafe impl SizedStruct for kvg_accepted {
    const MIN_SIZE: usize = size_of::<Self>();
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `ForeignPage` → `foreign_page`.
    fn snake(name: &str) -> String {
        let mut out = String::new();
        for (i, c) in name.chars().enumerate() {
            if c.is_ascii_uppercase() && i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        }
        out
    }

    #[test]
    fn the_c_kinds_are_the_core_kinds_in_order() {
        use kvg_violation_kind as K;
        let c_kinds = [
            K::PoolTooSmall,
            K::ExceedsMaxContext,
            K::ExceedsPool,
            K::DuplicateRequest,
            K::UnknownRequest,
            K::DoubleFree,
            K::PageNotFree,
            K::PageOutOfRange,
            K::ReservedPage,
            K::ForeignPage,
            K::FreedPage,
            K::UnwrittenSlots,
            K::SlotOutOfRange,
            K::WriteToShared,
            K::DuplicatePrefix,
            K::UnknownPrefix,
            K::CrossTenantShare,
            K::EvictInUse,
            K::TokenCountMismatch,
            K::StalePage,
            K::Quarantined,
            K::BlockTableTooShort,
            K::PageShared,
            K::TransferMisrouted,
            K::TransferPagesMismatch,
            K::PromptDigestMismatch,
            K::PageChecksumMismatch,
            K::PageLengthMismatch,
            K::MissingChecksum,
            K::ManifestCorrupt,
            K::CanaryMismatch,
            K::ImportInFlight,
            K::TokenRangeReversed,
            K::LandingFailed,
        ];
        assert_eq!(c_kinds.len(), ViolationKind::ALL.len(), "a core kind is missing from kvg_violation_kind");
        for (c, &core) in c_kinds.iter().zip(ViolationKind::ALL) {
            assert_eq!(snake(&format!("{c:?}")), core.as_str());
            assert_eq!(*c as u32, kvg_violation_kind::value(core));
        }
    }

    #[test]
    fn a_long_message_is_cut_at_a_character_boundary() {
        let v = Violation::new(ViolationKind::ForeignPage, Op::Read)
            .with_request(kvguard::RequestId(u64::MAX), Some(kvguard::TenantId(u64::MAX)))
            .with_owner(kvguard::RequestId(u64::MAX), kvguard::TenantId(u64::MAX))
            .with_prefix(kvguard::PrefixKey(u64::MAX))
            .with_amounts(u64::MAX, u64::MAX)
            .with_slots(0, 16);
        let info = kvg_violation_info::from_violation(&v, Some(3));
        assert_eq!(info.message[KVG_MESSAGE_CAPACITY - 1], 0);
        assert_eq!(info.row, 3);
        assert_ne!(info.fields & KVG_FIELD_ROW, 0);
    }
}
