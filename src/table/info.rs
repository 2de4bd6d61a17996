//! What the table tells about itself: page states, snapshots, page and request infos, and what a
//! release handed back. Plain values, copied out from under the lock.

use crate::ids::{Generation, PageRef, PrefixKey, RequestId, TenantId};
use serde::{Deserialize, Serialize};

/// Where a page is in its life.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[repr(u8)]
pub enum PageState {
    /// In the free list (or free in shadow mode): nobody may read or write it.
    Free = 0,
    /// Owned by one request, which alone may write and read it.
    Owned = 1,
    /// Part of a read-only prefix: readable by the requests that hold it, writable by none.
    Shared = 2,
    /// Never allocatable, never readable (null/padding page).
    Reserved = 3,
    /// Its generation reached the limit: never handed out again.
    Retired = 4,
    /// Released, waiting for the engine to confirm it was poisoned or zeroed.
    AwaitingScrub = 5,
}

impl PageState {
    pub(crate) const COUNT: usize = 6;

    /// Whether the state whose discriminant is `bits` has a live holder (owned or shared): one
    /// unsigned compare, as Owned is 1 and Shared 2.
    #[inline(always)]
    pub(crate) fn held_bits(bits: u8) -> bool {
        bits.wrapping_sub(PageState::Owned as u8) <= PageState::Shared as u8 - PageState::Owned as u8
    }

    /// The state whose discriminant is `bits`; any other value reads as [`Retired`](Self::Retired),
    /// which nobody may use (fail closed). One load from a table, no branch.
    #[inline(always)]
    pub(crate) fn from_bits(bits: u8) -> PageState {
        const STATES: [PageState; 256] = {
            let mut states = [PageState::Retired; 256];
            states[PageState::Free as usize] = PageState::Free;
            states[PageState::Owned as usize] = PageState::Owned;
            states[PageState::Shared as usize] = PageState::Shared;
            states[PageState::Reserved as usize] = PageState::Reserved;
            states[PageState::AwaitingScrub as usize] = PageState::AwaitingScrub;
            states
        };
        STATES[bits as usize]
    }
}

/// What a release handed back.
///
/// Only the count of ended incarnations comes back, not their list: the engine knows which pages
/// it released, and building a list it does not need cost a third of a release.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Released {
    /// How many page incarnations ended (pages freed, retired or awaiting a scrub).
    pub ended: u64,
    /// With `scrub_on_release`: the pages the engine must poison or zero, then pass to
    /// [`OwnershipTable::confirm_scrubbed`](crate::OwnershipTable::confirm_scrubbed); until then
    /// they are not handed out again. Empty otherwise.
    pub scrub: Vec<PageRef>,
}

/// Page counts by state, and a few totals; `free + owned + shared + reserved + retired +
/// awaiting_scrub == total_pages` always.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolSnapshot {
    /// Pages in the pool.
    pub total_pages: u64,
    /// Free pages.
    pub free: u64,
    /// Pages owned by one request.
    pub owned: u64,
    /// Pages in read-only prefixes (published, or shared by a fork).
    pub shared: u64,
    /// Reserved pages.
    pub reserved: u64,
    /// Pages retired because their generation reached the limit.
    pub retired: u64,
    /// Released pages waiting for a scrub confirmation.
    pub awaiting_scrub: u64,
    /// Admitted requests.
    pub requests: u64,
    /// Admitted requests that are quarantined.
    pub quarantined: u64,
    /// Live prefixes (named and fork-shared).
    pub prefixes: u64,
    /// Violations seen in all.
    pub violations: u64,
    /// Violations dropped from the log because nobody drained it.
    pub violations_dropped: u64,
    /// Released pages (counted in `free` or `awaiting_scrub`) that a transfer still lands in:
    /// not allocatable until its ticket ends.
    pub in_flight: u64,
}

/// What the table knows about one page.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PageInfo {
    /// Where the page is in its life.
    pub state: PageState,
    /// Its current incarnation.
    pub generation: Generation,
    /// Owner (or prefix publisher) while owned or shared.
    pub owner: Option<RequestId>,
    /// The owner's tenant.
    pub tenant: Option<TenantId>,
    /// The prefix it belongs to, if published under a key.
    pub prefix: Option<PrefixKey>,
    /// Slots `0..written_prefix` are all written by the current incarnation.
    pub written_prefix: u32,
    /// Slots written by the current incarnation, in all.
    pub written_slots: u32,
    /// Shared pages only: a request of another tenant attached to the prefix (under its
    /// tenant's [cross-tenant grant](crate::OwnershipTable::allow_cross_tenant_sharing)), so
    /// readers are not all of the prefix's tenant. Set by that attach, kept until the prefix goes;
    /// the device check, which cannot see holders, then lets any tenant read the page.
    #[serde(default)]
    pub shared_across_tenants: bool,
}

/// What the table knows about one admitted request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestInfo {
    /// Its tenant.
    pub tenant: TenantId,
    /// Prompt tokens it was admitted with.
    pub prompt_tokens: u64,
    /// New tokens it may generate.
    pub max_new_tokens: u64,
    /// Pages it owns exclusively, in no particular order.
    pub owned_pages: Vec<PageRef>,
    /// Named prefixes it holds.
    pub prefixes: Vec<PrefixKey>,
    /// Quarantined by an enforced violation.
    pub quarantined: bool,
}
