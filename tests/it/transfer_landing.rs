//! A landing that fails fails closed: whichever transfer path the bytes take and wherever the copy
//! into the pool fails (an error or a panic, on any page), nothing of the import is readable
//! afterwards, a `landing_failed` violation names the page, the receiving request is not
//! quarantined for it, and the rest of the table is exactly as it was.

use kvguard::transfer::{
    ExpectedTransfer, LandError, Manifest, Receiver, SenderId, TransferError, TransferHeader, page_checksum,
};
use kvguard::{OwnershipTable, PageId, PageInfo, PageRef, PoolConfig, RequestId, RequestInfo, TenantId, ViolationKind};
use proptest::prelude::*;
use std::panic::{AssertUnwindSafe, catch_unwind};

const PAGE_SIZE: u32 = 4;
const SLOT_BYTES: u32 = 8;
const PAGES: u32 = 32;
const RECEIVER: RequestId = RequestId(11);
const BYSTANDER: RequestId = RequestId(12);

/// How the copy into the pool fails.
#[derive(Clone, Copy, Debug)]
enum Failure {
    /// `land` returns an error.
    Error,
    /// `land` panics (a C++ exception or a Rust panic in the copy).
    Panic,
}

/// The transfer paths that land bytes through a caller's `land`.
#[derive(Clone, Copy, Debug)]
enum Path {
    /// `Receiver::accept`: pin, check, land, record in one call.
    Accept,
    /// `Receiver::pin`, then `PinnedImport::accept` (NIXL's shape: pinned before any byte).
    Pinned,
    /// `PinnedImport::accept_checksummed`, CRCs taken as the bytes landed.
    PinnedChecksummed,
}

/// A decode pool with a receiving request (pages allocated for its prompt) and a bystander of
/// another tenant that wrote and reads its own pages.
struct Pool {
    table: OwnershipTable,
    prompt: Vec<u32>,
    refs: Vec<PageRef>,
    pages: Vec<Vec<u8>>,
    bystander: Vec<PageId>,
}

fn pool(prompt_len: u32) -> Pool {
    let table = OwnershipTable::new(PoolConfig::new(PAGES, PAGE_SIZE, 64).with_reserved([PageId(0)])).unwrap();
    table.admit(BYSTANDER, TenantId(4), 8, 0).unwrap();
    let bystander: Vec<PageId> = table.allocate(BYSTANDER, 2).unwrap().iter().map(|r| r.page).collect();
    table.record_write_tokens(BYSTANDER, &bystander, 0..8).unwrap();
    table.admit(RECEIVER, TenantId(3), u64::from(prompt_len), 4).unwrap();
    let refs = table.allocate(RECEIVER, prompt_len.div_ceil(PAGE_SIZE)).unwrap();
    let prompt: Vec<u32> = (0..prompt_len).map(|i| 500 + i).collect();
    let pages = prompt
        .chunks(PAGE_SIZE as usize)
        .map(|c| c.iter().flat_map(|t| [t.to_le_bytes(), [0x5a; 4]].concat()).collect())
        .collect();
    Pool { table, prompt, refs, pages, bystander }
}

/// Everything the table says about its pages and requests, but the violation counts.
#[derive(Debug, PartialEq)]
struct State {
    pages: Vec<Option<PageInfo>>,
    receiver: Option<RequestInfo>,
    bystander: Option<RequestInfo>,
}

fn state(table: &OwnershipTable) -> State {
    State {
        pages: (0..PAGES).map(|p| table.page_info(PageId(p))).collect(),
        receiver: table.request_info(RECEIVER),
        bystander: table.request_info(BYSTANDER),
    }
}

impl Pool {
    fn expected(&self) -> ExpectedTransfer<'_> {
        ExpectedTransfer::for_prompt(RECEIVER, TenantId(3), &self.prompt, &self.refs, PAGE_SIZE, SLOT_BYTES)
    }

    fn manifest(&self) -> Vec<u8> {
        let header = TransferHeader {
            request: RECEIVER,
            tenant: TenantId(3),
            sender: SenderId(1),
            page_size: PAGE_SIZE,
            slot_bytes: SLOT_BYTES,
        };
        Manifest::build(header, &self.prompt, &self.refs, &self.pages).unwrap().encode()
    }

    /// Lands the transfer on `path`, the copy of entry `fail_at` failing as `failure`: the
    /// outcome (`None` for a panic, which goes on unwinding) and the entries `land` was called for.
    fn land(&self, path: Path, fail_at: usize, failure: Failure) -> (Option<TransferError>, Vec<usize>) {
        let (expected, manifest) = (self.expected(), self.manifest());
        let mut called = Vec::new();
        let land = |index: usize, _: PageRef, _: &[u8]| -> Result<(), LandError> {
            called.push(index);
            match (index == fail_at, failure) {
                (false, _) => Ok(()),
                (true, Failure::Error) => Err("cudaMemcpyAsync: an illegal memory access".into()),
                (true, Failure::Panic) => panic!("the copy kernel faulted"),
            }
        };
        let receiver = Receiver::new(&self.table);
        let checksums: Vec<Option<u32>> = self.pages.iter().map(|p| Some(page_checksum(p))).collect();
        let outcome = catch_unwind(AssertUnwindSafe(|| match path {
            Path::Accept => receiver.accept(&expected, &manifest, &self.pages, land),
            Path::Pinned => receiver.pin(&expected).unwrap().accept(&expected, &manifest, &self.pages, land),
            Path::PinnedChecksummed => {
                receiver.pin(&expected).unwrap().accept_checksummed(&expected, &manifest, &self.pages, &checksums, land)
            }
        }));
        let outcome = outcome.ok().map(|r| r.expect_err("a failed landing is never accepted"));
        (outcome, called)
    }

    fn receiving_pages(&self) -> Vec<PageId> {
        self.refs.iter().map(|r| r.page).collect()
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn a_failed_landing_leaves_nothing_readable_and_the_table_as_it_was(
        prompt_len in 1u32..=24,
        fail_frac in 0.0f64..1.0,
        panics in any::<bool>(),
        path in prop_oneof![Just(Path::Accept), Just(Path::Pinned), Just(Path::PinnedChecksummed)],
    ) {
        let p = pool(prompt_len);
        let fail_at = ((p.refs.len() as f64) * fail_frac) as usize;
        let failure = if panics { Failure::Panic } else { Failure::Error };
        let before = state(&p.table);

        let (outcome, called) = p.land(path, fail_at, failure);

        // Landing stopped at the failing page.
        prop_assert_eq!(called, (0..=fail_at).collect::<Vec<_>>());
        match (failure, &outcome) {
            (Failure::Error, Some(TransferError::Landing { index, page, source })) => {
                prop_assert_eq!(*index, fail_at);
                prop_assert_eq!(*page, p.refs[fail_at]);
                prop_assert!(source.to_string().contains("illegal memory access"));
            }
            (Failure::Panic, None) => {}
            (_, other) => prop_assert!(false, "{failure:?} ended as {other:?}"),
        }
        // One violation, of its own kind, naming the page; the receiver is not quarantined.
        prop_assert_eq!(p.table.counters().total(), 1);
        let v = p.table.drain_violations().pop().unwrap();
        prop_assert_eq!(v.kind(), ViolationKind::LandingFailed);
        prop_assert_eq!((v.request(), v.page(), v.block_index()), (Some(RECEIVER), Some(p.refs[fail_at].page), Some(fail_at as u32)));
        // Every page, request and prefix is exactly as before: nothing recorded as written,
        // nothing left pinned, nobody quarantined.
        prop_assert_eq!(state(&p.table), before);
        prop_assert_eq!(p.table.snapshot().in_flight, 0);
        // None of the receiving pages reads; the bystander reads its own as before.
        let read = p.table.check_read(RECEIVER, &p.receiving_pages(), u64::from(prompt_len));
        prop_assert_eq!(read.map_err(|v| v.kind()), Err(ViolationKind::UnwrittenSlots));
        prop_assert!(p.table.check_read(BYSTANDER, &p.bystander, 8).is_ok());
        // The pages can take the retry: nothing pins them.
        p.table.begin_import(RECEIVER, &p.refs).unwrap().abort();
    }
}

#[test]
fn a_failed_landing_revokes_what_the_receiving_pages_held_before() {
    // Bytes may have landed in any of the pages before the copy failed: slots the request had
    // written itself are no longer what it wrote, so they are unreadable too.
    let p = pool(8);
    p.table.record_write_tokens_refs(RECEIVER, &p.refs, 0..6).unwrap();
    p.table.check_read(RECEIVER, &p.receiving_pages(), 6).unwrap();
    let ticket = p.table.begin_import(RECEIVER, &p.refs).unwrap();
    let v = ticket.fail(0);
    assert_eq!(v.kind(), ViolationKind::LandingFailed);
    for r in &p.refs {
        let info = p.table.page_info(r.page).unwrap();
        assert_eq!((info.owner, info.generation, info.written_slots), (Some(RECEIVER), r.generation, 0));
    }
    let read = p.table.check_read(RECEIVER, &p.receiving_pages(), 1).unwrap_err();
    assert_eq!(read.kind(), ViolationKind::UnwrittenSlots);
    // The request recomputes what it lost: its own writes make the pages readable again.
    p.table.record_write_tokens_refs(RECEIVER, &p.refs, 0..8).unwrap();
    p.table.check_read(RECEIVER, &p.receiving_pages(), 8).unwrap();
    assert!(!p.table.request_info(RECEIVER).unwrap().quarantined);
}

#[test]
fn a_landing_that_fails_after_its_request_was_released_hands_the_next_owner_nothing() {
    // The request is released while its bytes land (another thread); the copy then fails. The
    // pages left the request, stayed out of the free list while pinned, and come back unwritten.
    let p = pool(8);
    let (expected, manifest) = (p.expected(), p.manifest());
    let err = Receiver::new(&p.table)
        .accept(&expected, &manifest, &p.pages, |index, _, _| {
            if index == 0 {
                p.table.release(RECEIVER).unwrap();
            }
            Err("the device went away".into())
        })
        .unwrap_err();
    assert!(matches!(err, TransferError::Landing { index: 0, .. }), "{err}");
    assert_eq!(p.table.counters().get(ViolationKind::LandingFailed), 1);
    assert_eq!(p.table.snapshot().in_flight, 0);
    p.table.admit(RequestId(13), TenantId(5), 8, 0).unwrap();
    let next = p.table.claim(RequestId(13), &p.receiving_pages()).unwrap();
    assert!(next.iter().zip(&p.refs).all(|(n, old)| n.generation > old.generation));
    let read = p.table.check_read(RequestId(13), &p.receiving_pages(), 1).unwrap_err();
    assert_eq!(read.kind(), ViolationKind::UnwrittenSlots);
}

#[test]
fn a_landing_failure_is_its_own_violation_kind_and_does_not_quarantine() {
    assert_eq!(ViolationKind::from_name("landing_failed"), Some(ViolationKind::LandingFailed));
    assert!(!ViolationKind::LandingFailed.quarantines());
    assert!(ViolationKind::ALL.iter().filter(|k| **k != ViolationKind::LandingFailed).all(|k| k.quarantines()));
}
