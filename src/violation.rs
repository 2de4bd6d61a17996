//! Violations: reads, writes, releases and transfers that would break page ownership.
//!
//! A [`Violation`] is cheap to move (one pointer) and prints as one line a person can act on:
//! what kind, who did it, which page, who owns it, which incarnation, which slots.

use crate::ids::{Generation, PageId, PrefixKey, RequestId, TenantId, grouped};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! violation_kinds {
    ($( $(#[$doc:meta])* $variant:ident => $name:literal, )*) => {
        /// What rule a [`Violation`] broke. The `as_str` names are stable: traces, logs and the
        /// command line print them.
        #[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, Serialize, Deserialize)]
        #[serde(rename_all = "snake_case")]
        #[non_exhaustive]
        pub enum ViolationKind {
            $( $(#[$doc])* $variant, )*
        }

        impl ViolationKind {
            /// Every kind, in counter order.
            pub const ALL: &'static [ViolationKind] = &[$(ViolationKind::$variant,)*];

            /// The stable snake_case name (`"foreign_page"`).
            pub fn as_str(self) -> &'static str {
                match self {
                    $(ViolationKind::$variant => $name,)*
                }
            }

            /// The kind with this stable name, if any.
            pub fn from_name(name: &str) -> Option<ViolationKind> {
                match name {
                    $($name => Some(ViolationKind::$variant),)*
                    _ => None,
                }
            }
        }
    };
}

violation_kinds! {
    /// The pool cannot hold one max-context request.
    PoolTooSmall => "pool_too_small",
    /// Prompt plus new tokens exceed the model's max context.
    ExceedsMaxContext => "exceeds_max_context",
    /// The request needs more pages than the pool can ever give.
    ExceedsPool => "exceeds_pool",
    /// A request id that is already live was admitted again.
    DuplicateRequest => "duplicate_request",
    /// An operation named a request that is not admitted (never, refused, or already ended).
    UnknownRequest => "unknown_request",
    /// A request that already ended, or a page that is already free, was released again.
    DoubleFree => "double_free",
    /// A page handed to a request (shadow `claim`) was not free.
    PageNotFree => "page_not_free",
    /// A page id beyond the pool.
    PageOutOfRange => "page_out_of_range",
    /// A reserved page (null/padding page) was allocated, written or read.
    ReservedPage => "reserved_page",
    /// A page owned by another request, and not a prefix the reader holds.
    ForeignPage => "foreign_page",
    /// A page read or written while free (released, awaiting scrub, or retired).
    FreedPage => "freed_page",
    /// A read of slots the page's current incarnation never wrote.
    UnwrittenSlots => "unwritten_slots",
    /// A slot range outside the page, or reversed.
    SlotOutOfRange => "slot_out_of_range",
    /// A write to a page that is shared read-only (a prefix, or a forked request's pages).
    WriteToShared => "write_to_shared",
    /// A prefix key that is already published.
    DuplicatePrefix => "duplicate_prefix",
    /// A prefix key that is not published (never, or evicted), or not held by the request.
    UnknownPrefix => "unknown_prefix",
    /// An attach to another tenant's prefix that the tenant did not open for sharing.
    CrossTenantShare => "cross_tenant_share",
    /// An eviction of a prefix that requests still hold.
    EvictInUse => "evict_in_use",
    /// A transfer or import carried a different number of tokens than the receiver expected.
    TokenCountMismatch => "token_count_mismatch",
    /// A `PageRef` whose generation is not the page's current one: the incarnation it names ended.
    StalePage => "stale_page",
    /// A read by a request quarantined after an earlier violation (enforce policy).
    Quarantined => "quarantined",
    /// A read of more tokens than its block table has pages for.
    BlockTableTooShort => "block_table_too_short",
    /// A release or publish of a page that belongs to a shared prefix (drop the hold instead).
    PageShared => "page_shared",
    /// A KV transfer whose manifest names another request, tenant or sender than the receiver expects.
    TransferMisrouted => "transfer_misrouted",
    /// A KV transfer whose manifest names other pages, page size or slot size than the receiver offered.
    TransferPagesMismatch => "transfer_pages_mismatch",
    /// A KV transfer of a prompt whose digest differs from the prompt the receiver holds.
    PromptDigestMismatch => "prompt_digest_mismatch",
    /// A transferred page whose bytes do not match the manifest's CRC32.
    PageChecksumMismatch => "page_checksum_mismatch",
    /// A transferred page of another length than its token count implies (truncated or padded).
    PageLengthMismatch => "page_length_mismatch",
    /// A transfer manifest with a missing (zero) page checksum: a failure, never a pass.
    MissingChecksum => "missing_checksum",
    /// Transfer manifest bytes that do not decode (truncated, corrupt, wrong magic or version).
    ManifestCorrupt => "manifest_corrupt",
    /// A KV slot whose canary does not bind it to the reading request's page incarnation and slot.
    CanaryMismatch => "canary_mismatch",
    /// A KV transfer into a page that another transfer is still landing in.
    ImportInFlight => "import_in_flight",
    /// A write of tokens `start..end` with `start` after `end` (its amounts are the two ends).
    TokenRangeReversed => "token_range_reversed",
    /// A KV transfer whose bytes could not be landed in the pool (the caller's copy failed,
    /// raised or panicked): the import was abandoned, its pages' coverage revoked, so they are
    /// unreadable until the request writes them itself. Counted against the transfer, not the
    /// request: it does not quarantine.
    LandingFailed => "landing_failed",
}

impl ViolationKind {
    /// Whether a violation of this kind quarantines the request it names under
    /// [`Policy::Enforce`]: every kind does but [`LandingFailed`](ViolationKind::LandingFailed),
    /// a failure of the receiver's own copy that the request did nothing to cause (its pages are
    /// made unreadable instead).
    pub fn quarantines(self) -> bool {
        !matches!(self, ViolationKind::LandingFailed)
    }
}

/// What the table does when it sees a violation.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Refuse the operation and quarantine the offending request: its later reads are refused
    /// until it is released. The production setting.
    #[default]
    Enforce,
    /// Record and continue, for shadow roll-out: reads that violate are counted and logged but
    /// succeed; mutations the table cannot represent (claiming a page another request owns, say)
    /// are still refused, counted and logged, and nobody is quarantined.
    Report,
}

/// The operation a violation happened in, for the one-line message.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum Op {
    /// Pool configuration / start-up audit.
    Configure,
    /// Admission of a request.
    Admit,
    /// Allocator-mode allocation.
    Allocate,
    /// Shadow-mode claim of engine-chosen pages.
    Claim,
    /// A KV store into page slots.
    Write,
    /// An attention read through a block table.
    Read,
    /// Release of a request or of some of its pages.
    Release,
    /// Publishing pages as a prefix.
    Publish,
    /// Attaching to a prefix.
    Attach,
    /// Letting go of a prefix.
    Detach,
    /// Evicting a prefix.
    Evict,
    /// Forking a request.
    Fork,
    /// A KV transfer landing in a request's pages.
    Import,
    /// Confirming that released pages were scrubbed.
    Scrub,
}

impl Op {
    fn verb(self) -> &'static str {
        match self {
            Op::Configure => "configured",
            Op::Admit => "admitted",
            Op::Allocate => "allocated",
            Op::Claim => "claimed",
            Op::Write => "wrote",
            Op::Read => "read",
            Op::Release => "released",
            Op::Publish => "published",
            Op::Attach => "attached",
            Op::Detach => "detached",
            Op::Evict => "evicted",
            Op::Fork => "forked",
            Op::Import => "imported",
            Op::Scrub => "scrubbed",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Detail {
    kind: ViolationKind,
    op: Op,
    request: Option<RequestId>,
    tenant: Option<TenantId>,
    page: Option<PageId>,
    block_index: Option<u32>,
    owner: Option<RequestId>,
    owner_tenant: Option<TenantId>,
    generation: Option<Generation>,
    expected_generation: Option<Generation>,
    slots: Option<(u32, u32)>,
    prefix: Option<PrefixKey>,
    found: Option<u64>,
    limit: Option<u64>,
}

/// A read, write, release or transfer that would break ownership.
///
/// Opaque and one pointer wide; the accessors give the parts, [`Display`](fmt::Display) gives one
/// line:
///
/// ```
/// use kvguard::{PoolConfig, OwnershipTable, RequestId, TenantId, ViolationKind};
/// let table = OwnershipTable::new(PoolConfig::new(8, 16, 64))?;
/// table.admit(RequestId(1), TenantId(1), 16, 0)?;
/// table.admit(RequestId(2), TenantId(2), 16, 0)?;
/// let pages = table.allocate(RequestId(1), 1)?;
/// let err = table.verify_read(RequestId(2), &[pages[0].page], 16).unwrap_err();
/// let v = err.violation().unwrap();
/// assert_eq!(v.kind(), ViolationKind::ForeignPage);
/// assert_eq!(v.owner(), Some(RequestId(1)));
/// println!("{v}"); // foreign_page: req 2 (tenant 2) read page 0 gen 1, block 0, owned by req 1 (tenant 1), slots 0..16
/// # Ok::<(), kvguard::Error>(())
/// ```
#[derive(Clone, PartialEq, Eq)]
pub struct Violation(Box<Detail>);

impl Violation {
    /// A violation of `kind` during `op`; add the parts with the `with_*` methods.
    pub fn new(kind: ViolationKind, op: Op) -> Violation {
        Violation(Box::new(Detail {
            kind,
            op,
            request: None,
            tenant: None,
            page: None,
            block_index: None,
            owner: None,
            owner_tenant: None,
            generation: None,
            expected_generation: None,
            slots: None,
            prefix: None,
            found: None,
            limit: None,
        }))
    }

    /// The request that performed the operation, and its tenant if known.
    pub fn with_request(mut self, request: RequestId, tenant: Option<TenantId>) -> Self {
        self.0.request = Some(request);
        self.0.tenant = tenant;
        self
    }
    /// The page concerned, and the generation it has now.
    pub fn with_page(mut self, page: PageId, generation: Option<Generation>) -> Self {
        self.0.page = Some(page);
        self.0.generation = generation;
        self
    }
    /// The position of the page in the block table read or written.
    pub fn with_block_index(mut self, index: u32) -> Self {
        self.0.block_index = Some(index);
        self
    }
    /// The page's current owner (or the prefix's publisher) and its tenant.
    pub fn with_owner(mut self, owner: RequestId, tenant: TenantId) -> Self {
        self.0.owner = Some(owner);
        self.0.owner_tenant = Some(tenant);
        self
    }
    /// The generation the caller's reference named.
    pub fn with_expected_generation(mut self, generation: Generation) -> Self {
        self.0.expected_generation = Some(generation);
        self
    }
    /// The slot range `[start, end)` within the page.
    pub fn with_slots(mut self, start: u32, end: u32) -> Self {
        self.0.slots = Some((start, end));
        self
    }
    /// The prefix concerned.
    pub fn with_prefix(mut self, prefix: PrefixKey) -> Self {
        self.0.prefix = Some(prefix);
        self
    }
    /// A count that broke a limit: tokens asked vs allowed, tokens sent vs expected, holders left.
    pub fn with_amounts(mut self, found: u64, limit: u64) -> Self {
        self.0.found = Some(found);
        self.0.limit = Some(limit);
        self
    }

    /// What rule was broken.
    pub fn kind(&self) -> ViolationKind {
        self.0.kind
    }
    /// The operation it happened in.
    pub fn op(&self) -> Op {
        self.0.op
    }
    /// The request that performed the operation.
    pub fn request(&self) -> Option<RequestId> {
        self.0.request
    }
    /// That request's tenant.
    pub fn tenant(&self) -> Option<TenantId> {
        self.0.tenant
    }
    /// The page concerned.
    pub fn page(&self) -> Option<PageId> {
        self.0.page
    }
    /// The page's position in the block table.
    pub fn block_index(&self) -> Option<u32> {
        self.0.block_index
    }
    /// The page's owner (or prefix publisher) at the time.
    pub fn owner(&self) -> Option<RequestId> {
        self.0.owner
    }
    /// The owner's tenant.
    pub fn owner_tenant(&self) -> Option<TenantId> {
        self.0.owner_tenant
    }
    /// The page's generation at the time.
    pub fn generation(&self) -> Option<Generation> {
        self.0.generation
    }
    /// The generation the caller named, for [`ViolationKind::StalePage`].
    pub fn expected_generation(&self) -> Option<Generation> {
        self.0.expected_generation
    }
    /// The slot range `[start, end)` concerned.
    pub fn slots(&self) -> Option<(u32, u32)> {
        self.0.slots
    }
    /// The prefix concerned.
    pub fn prefix(&self) -> Option<PrefixKey> {
        self.0.prefix
    }
    /// The count that broke a limit, and the limit: `(found, limit)`; for
    /// [`ViolationKind::TokenRangeReversed`], the range's `(start, end)`.
    pub fn amounts(&self) -> Option<(u64, u64)> {
        match (self.0.found, self.0.limit) {
            (Some(f), Some(l)) => Some((f, l)),
            _ => None,
        }
    }
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = &*self.0;
        write!(f, "{}:", d.kind.as_str())?;
        match d.request {
            Some(r) => {
                write!(f, " {r}")?;
                if let Some(t) = d.tenant {
                    write!(f, " ({t})")?;
                }
                write!(f, " {}", d.op.verb())?;
            }
            None => write!(f, " {}", d.op.verb())?,
        }
        if let Some(p) = d.page {
            write!(f, " {p}")?;
            if let Some(g) = d.generation {
                write!(f, " {g}")?;
            }
        }
        if let Some(g) = d.expected_generation {
            write!(f, " through a ref to {g}")?;
        }
        if let Some(i) = d.block_index {
            write!(f, ", block {i}")?;
        }
        if let Some(o) = d.owner {
            write!(f, ", owned by {o}")?;
            if let Some(t) = d.owner_tenant {
                write!(f, " ({t})")?;
            }
        }
        if let Some((a, b)) = d.slots {
            write!(f, ", slots {a}..{b}")?;
        }
        if let Some(k) = d.prefix {
            write!(f, ", {k}")?;
        }
        if let (ViolationKind::TokenRangeReversed, Some(start), Some(end)) = (d.kind, d.found, d.limit) {
            return write!(f, ", tokens {}..{} (start after end)", grouped(start), grouped(end));
        }
        if let (Some(found), Some(limit)) = (d.found, d.limit) {
            let (what, bound) = match d.kind {
                ViolationKind::ExceedsMaxContext => ("tokens", "max context"),
                ViolationKind::ExceedsPool => ("pages needed", "pages the pool can give"),
                ViolationKind::PoolTooSmall => ("tokens the pool holds", "max context"),
                ViolationKind::TokenCountMismatch => ("tokens", "expected"),
                ViolationKind::EvictInUse => ("holders", "allowed"),
                ViolationKind::BlockTableTooShort => ("tokens", "block table covers"),
                _ => ("found", "limit"),
            };
            write!(f, ", {} {what} vs {bound} {}", grouped(found), grouped(limit))?;
        }
        Ok(())
    }
}

impl fmt::Debug for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Violation({self})")
    }
}

impl std::error::Error for Violation {}

/// Violation counts per kind; lock-free, shared by every thread that uses a table.
#[derive(Debug)]
pub struct ViolationCounters {
    counts: Vec<AtomicU64>,
}

impl Default for ViolationCounters {
    fn default() -> Self {
        ViolationCounters { counts: ViolationKind::ALL.iter().map(|_| AtomicU64::new(0)).collect() }
    }
}

impl ViolationCounters {
    fn index(kind: ViolationKind) -> usize {
        // Variants carry no explicit discriminants and `ALL` lists them in declaration order.
        kind as usize
    }

    /// Counts one violation of `kind`.
    pub fn record(&self, kind: ViolationKind) {
        self.counts[Self::index(kind)].fetch_add(1, Ordering::Relaxed);
    }

    /// How many violations of `kind` were counted.
    pub fn get(&self, kind: ViolationKind) -> u64 {
        self.counts[Self::index(kind)].load(Ordering::Relaxed)
    }

    /// All violations counted.
    pub fn total(&self) -> u64 {
        self.counts.iter().map(|c| c.load(Ordering::Relaxed)).sum()
    }

    /// The non-zero counts, in [`ViolationKind::ALL`] order.
    pub fn nonzero(&self) -> Vec<(ViolationKind, u64)> {
        ViolationKind::ALL
            .iter()
            .zip(&self.counts)
            .map(|(&k, c)| (k, c.load(Ordering::Relaxed)))
            .filter(|&(_, n)| n > 0)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_round_trips_through_its_name() {
        for &k in ViolationKind::ALL {
            assert_eq!(ViolationKind::from_name(k.as_str()), Some(k));
            let json = serde_json::to_string(&k).unwrap();
            assert_eq!(json, format!("\"{}\"", k.as_str()));
        }
        assert_eq!(ViolationKind::from_name("no_such_kind"), None);
    }

    #[test]
    fn a_violation_prints_as_one_line_naming_every_part() {
        let v = Violation::new(ViolationKind::UnwrittenSlots, Op::Read)
            .with_request(RequestId(9), Some(TenantId(2)))
            .with_page(PageId(40), Some(Generation(3)))
            .with_block_index(5)
            .with_owner(RequestId(9), TenantId(2))
            .with_slots(4, 16);
        let line = v.to_string();
        assert_eq!(
            line,
            "unwritten_slots: req 9 (tenant 2) read page 40 gen 3, block 5, owned by req 9 (tenant 2), slots 4..16"
        );
        assert!(!line.contains('\n'));
    }

    #[test]
    fn amounts_print_with_their_meaning() {
        let v = Violation::new(ViolationKind::ExceedsMaxContext, Op::Admit)
            .with_request(RequestId(1), None)
            .with_amounts(1_048_577, 1_048_576);
        assert_eq!(v.to_string(), "exceeds_max_context: req 1 admitted, 1,048,577 tokens vs max context 1,048,576");
        assert_eq!(v.amounts(), Some((1_048_577, 1_048_576)));
    }

    #[test]
    fn counters_count_per_kind() {
        let c = ViolationCounters::default();
        c.record(ViolationKind::ForeignPage);
        c.record(ViolationKind::ForeignPage);
        c.record(ViolationKind::StalePage);
        assert_eq!(c.get(ViolationKind::ForeignPage), 2);
        assert_eq!(c.get(ViolationKind::DoubleFree), 0);
        assert_eq!(c.total(), 3);
        assert_eq!(c.nonzero(), vec![(ViolationKind::ForeignPage, 2), (ViolationKind::StalePage, 1)]);
    }

    #[test]
    fn a_violation_is_one_pointer_wide() {
        assert_eq!(std::mem::size_of::<Violation>(), std::mem::size_of::<usize>());
    }
}
