//! The transfer manifest: wire format robustness and the receiver's fail-closed checks.

use kvguard::transfer::wire::{HEADER_LEN, PAGE_ENTRY_LEN, TRAILER_LEN};
use kvguard::transfer::{
    DecodeError, ExpectedTransfer, Manifest, Receiver, SenderId, TransferError, TransferHeader, page_checksum,
};
use kvguard::{OwnershipTable, PageId, PageRef, PoolConfig, RequestId, TenantId, ViolationKind};
use proptest::prelude::*;

const PAGE_SIZE: u32 = 4;
const SLOT_BYTES: u32 = 8;

/// A decode pool, one admitted request with pages for its full prompt, and the KV prefill made.
struct Fixture {
    table: OwnershipTable,
    req: RequestId,
    tenant: TenantId,
    prompt: Vec<u32>,
    refs: Vec<PageRef>,
    pages: Vec<Vec<u8>>,
}

fn kv_pages(prompt: &[u32], salt: u8) -> Vec<Vec<u8>> {
    prompt
        .chunks(PAGE_SIZE as usize)
        .map(|c| c.iter().flat_map(|t| [t.to_le_bytes(), [salt; 4]].concat()).collect())
        .collect()
}

fn fixture(prompt_len: u32) -> Fixture {
    let table = OwnershipTable::new(PoolConfig::new(64, PAGE_SIZE, 128).with_reserved([PageId(0)])).unwrap();
    let (req, tenant) = (RequestId(11), TenantId(3));
    let prompt: Vec<u32> = (0..prompt_len).map(|i| 1000 + i).collect();
    table.admit(req, tenant, u64::from(prompt_len), 4).unwrap();
    let refs = table.allocate(req, prompt_len.div_ceil(PAGE_SIZE)).unwrap();
    let pages = kv_pages(&prompt, 0xab);
    Fixture { table, req, tenant, prompt, refs, pages }
}

impl Fixture {
    fn header(&self) -> TransferHeader {
        TransferHeader {
            request: self.req,
            tenant: self.tenant,
            sender: SenderId(5),
            page_size: PAGE_SIZE,
            slot_bytes: SLOT_BYTES,
        }
    }
    fn manifest(&self) -> Manifest {
        Manifest::build(self.header(), &self.prompt, &self.refs, &self.pages).unwrap()
    }
    fn expected(&self) -> ExpectedTransfer<'_> {
        ExpectedTransfer::for_prompt(self.req, self.tenant, &self.prompt, &self.refs, PAGE_SIZE, SLOT_BYTES)
    }
    fn block_table(&self) -> Vec<PageId> {
        self.refs.iter().map(|r| r.page).collect()
    }
    /// Tries to land `manifest_bytes` + `pages`; returns the outcome and how many pages were landed.
    fn land(&self, manifest_bytes: &[u8], pages: &[Vec<u8>]) -> (Result<u64, TransferError>, usize) {
        let mut landed = 0;
        let out = Receiver::new(&self.table)
            .accept(&self.expected(), manifest_bytes, pages, |_, _, _| {
                landed += 1;
                Ok(())
            })
            .map(|a| a.tokens());
        (out, landed)
    }
    /// The refusal left no trace: nothing landed, no coverage recorded, one violation of `kind`.
    fn assert_refused(&self, outcome: (Result<u64, TransferError>, usize), kind: ViolationKind) -> TransferError {
        let (result, landed) = outcome;
        let err = result.expect_err("transfer accepted");
        assert_eq!(err.kind(), kind, "{err}");
        assert_eq!(landed, 0, "refused transfer landed pages");
        self.assert_no_coverage();
        assert_eq!(self.table.counters().get(kind), 1, "violation not reported as {kind:?}");
        err
    }
    /// No slot of the offered incarnations is recorded as written (checked on the table itself:
    /// a quarantined request's reads are refused whatever its coverage).
    fn assert_no_coverage(&self) {
        for r in &self.refs {
            if let Some(info) = self.table.page_info(r.page)
                && info.generation == r.generation
            {
                assert_eq!(info.written_slots, 0, "refused transfer recorded coverage in {}", r.page);
            }
        }
    }
}

/// Rewrites the manifest's trailing CRC after a deliberate edit, so the edit reaches the checks
/// behind it.
fn reseal(bytes: &mut [u8]) {
    let body = bytes.len() - TRAILER_LEN;
    let crc = crc32fast::hash(&bytes[..body]);
    bytes[body..].copy_from_slice(&crc.to_le_bytes());
}

#[test]
fn a_clean_transfer_lands_and_records_coverage() {
    let f = fixture(10);
    let mut landed = Vec::new();
    let accepted = Receiver::new(&f.table)
        .accept(&f.expected(), &f.manifest().encode(), &f.pages, |i, r, b| {
            landed.push((i, r, b.len()));
            Ok(())
        })
        .unwrap();
    assert_eq!(accepted.tokens(), 10);
    assert_eq!(accepted.pages(), 3);
    assert_eq!(landed, vec![(0, f.refs[0], 32), (1, f.refs[1], 32), (2, f.refs[2], 16)]);
    f.table.verify_read_refs(f.req, &f.refs, 10).unwrap();
    // Coverage is exactly the prompt: slot 10 was never written.
    let err = f.table.verify_read(f.req, &f.block_table(), 11).unwrap_err();
    assert_eq!(err.violation_kind(), Some(ViolationKind::UnwrittenSlots));
    assert_eq!(f.table.counters().total(), 1);
}

#[test]
fn every_bit_flip_of_a_valid_manifest_is_refused() {
    let f = fixture(10);
    let bytes = f.manifest().encode();
    assert_eq!(bytes.len(), HEADER_LEN + 3 * PAGE_ENTRY_LEN + TRAILER_LEN);
    for bit in 0..bytes.len() * 8 {
        let mut flipped = bytes.clone();
        flipped[bit / 8] ^= 1 << (bit % 8);
        let err = Manifest::decode(&flipped).expect_err(&format!("bit {bit} flipped and accepted"));
        // The first eight bytes are checked before the checksum; every other flip breaks it.
        if bit >= 64 {
            assert!(
                matches!(
                    err,
                    DecodeError::ChecksumMismatch { .. }
                        | DecodeError::TooManyPages(_)
                        | DecodeError::Truncated { .. }
                        | DecodeError::TrailingBytes { .. }
                ),
                "bit {bit}: {err}"
            );
        }
        let (result, landed) = f.land(&flipped, &f.pages);
        assert!(matches!(result, Err(TransferError::Decode(_))), "bit {bit}");
        assert_eq!(landed, 0);
    }
    let flips = bytes.len() as u64 * 8;
    assert_eq!(f.table.counters().get(ViolationKind::ManifestCorrupt), flips);
    f.assert_no_coverage();
    f.table.verify_read_refs(f.req, &f.refs, 1).unwrap_err();
}

#[test]
fn every_bit_flip_of_a_page_is_refused() {
    let f = fixture(6);
    let bytes = f.manifest().encode();
    for page in 0..f.pages.len() {
        for bit in 0..f.pages[page].len() * 8 {
            let mut pages = f.pages.clone();
            pages[page][bit / 8] ^= 1 << (bit % 8);
            let (result, landed) = f.land(&bytes, &pages);
            assert!(matches!(result, Err(TransferError::PageChecksum { index, .. }) if index == page));
            assert_eq!(landed, 0);
        }
    }
    f.assert_no_coverage();
}

#[test]
fn a_one_token_dummy_for_the_real_prompt_is_refused() {
    let f = fixture(10);
    // What the incident's prefill did: prefill one dummy token, send one page.
    let dummy = Manifest::build(f.header(), &[0], &f.refs[..1], &kv_pages(&[0], 0)).unwrap();
    let err = f.assert_refused(f.land(&dummy.encode(), &kv_pages(&[0], 0)), ViolationKind::TokenCountMismatch);
    assert!(matches!(err, TransferError::TokenCount { expected: 10, found: 1 }));
    assert!(err.to_string().contains("1 tokens, the request's prompt has 10"), "{err}");
    // The request reads nothing it did not get: not one slot is recorded as written (its reads
    // are refused anyway, as it is quarantined now).
    f.assert_no_coverage();
    f.table.verify_read_refs(f.req, &f.refs, 10).unwrap_err();
}

#[test]
fn a_different_prompt_of_the_same_length_is_refused_by_its_digest() {
    let f = fixture(10);
    let mut other = f.prompt.clone();
    other[7] += 1;
    let pages = kv_pages(&other, 0xab);
    let m = Manifest::build(f.header(), &other, &f.refs, &pages).unwrap();
    f.assert_refused(f.land(&m.encode(), &pages), ViolationKind::PromptDigestMismatch);
}

#[test]
fn a_transfer_for_another_request_or_tenant_is_refused() {
    let f = fixture(10);
    let m =
        Manifest::build(TransferHeader { request: RequestId(12), ..f.header() }, &f.prompt, &f.refs, &f.pages).unwrap();
    let err = f.assert_refused(f.land(&m.encode(), &f.pages), ViolationKind::TransferMisrouted);
    assert!(matches!(err, TransferError::WrongRequest { found: RequestId(12), .. }));

    let g = fixture(10);
    let m =
        Manifest::build(TransferHeader { tenant: TenantId(4), ..g.header() }, &g.prompt, &g.refs, &g.pages).unwrap();
    let err = g.assert_refused(g.land(&m.encode(), &g.pages), ViolationKind::TransferMisrouted);
    assert!(matches!(err, TransferError::WrongTenant { .. }));

    let h = fixture(10);
    let expected = h.expected().from_sender(SenderId(6));
    let err =
        Receiver::new(&h.table).accept(&expected, &h.manifest().encode(), &h.pages, |_, _, _| Ok(())).unwrap_err();
    assert!(matches!(err, TransferError::WrongSender { .. }));
}

#[test]
fn a_truncated_page_is_refused() {
    let f = fixture(10);
    let mut pages = f.pages.clone();
    pages[1].truncate(24);
    let err = f.assert_refused(f.land(&f.manifest().encode(), &pages), ViolationKind::PageLengthMismatch);
    assert!(matches!(err, TransferError::PageLength { index: 1, expected: 32, found: 24 }));
}

#[test]
fn a_missing_page_or_extra_page_buffer_is_refused() {
    let f = fixture(10);
    let (result, landed) = f.land(&f.manifest().encode(), &f.pages[..2]);
    assert!(matches!(result, Err(TransferError::BufferCount { expected: 3, found: 2 })));
    assert_eq!(landed, 0);
}

#[test]
fn a_zero_page_checksum_is_a_failure_not_a_pass() {
    let f = fixture(10);
    let mut bytes = f.manifest().encode();
    let crc_at = HEADER_LEN + PAGE_ENTRY_LEN + 12;
    bytes[crc_at..crc_at + 4].fill(0);
    reseal(&mut bytes);
    let err = f.assert_refused(f.land(&bytes, &f.pages), ViolationKind::MissingChecksum);
    assert!(matches!(err, TransferError::Decode(DecodeError::MissingChecksum { index: 1 })));
}

#[test]
fn a_late_transfer_after_release_is_refused() {
    let f = fixture(10);
    let late = f.manifest().encode();
    f.table.release(f.req).unwrap();
    let (result, landed) = f.land(&late, &f.pages);
    let err = result.unwrap_err();
    assert_eq!(landed, 0);
    assert!(matches!(err, TransferError::NotHeld(_)), "{err}");
    assert_eq!(err.kind(), ViolationKind::UnknownRequest);
}

#[test]
fn a_late_transfer_landing_on_a_retry_of_the_request_is_refused_as_stale() {
    let f = fixture(10);
    let first_attempt = f.manifest().encode();
    // Decode gives up on the first attempt, retries the same request: same pages, new incarnations.
    f.table.release(f.req).unwrap();
    f.table.admit(f.req, f.tenant, 10, 4).unwrap();
    let retry_refs = f.table.allocate(f.req, 3).unwrap();
    let mut retry_pages: Vec<PageId> = retry_refs.iter().map(|r| r.page).collect();
    retry_pages.sort_unstable();
    assert_eq!(retry_pages, f.block_table(), "the retry reuses the same pages");
    let expected = ExpectedTransfer::for_prompt(f.req, f.tenant, &f.prompt, &retry_refs, PAGE_SIZE, SLOT_BYTES);
    let err = Receiver::new(&f.table).accept(&expected, &first_attempt, &f.pages, |_, _, _| panic!()).unwrap_err();
    assert!(matches!(err, TransferError::Stale { .. }), "{err}");
    assert_eq!(err.kind(), ViolationKind::StalePage);
    assert!(f.table.drain_violations().iter().any(|v| v.kind() == ViolationKind::StalePage));
}

#[test]
fn a_transfer_into_pages_reused_by_another_request_is_refused() {
    let f = fixture(10);
    let old = f.expected();
    let bytes = f.manifest().encode();
    f.table.release(f.req).unwrap();
    f.table.admit(RequestId(99), TenantId(4), 10, 0).unwrap();
    f.table.allocate(RequestId(99), 3).unwrap();
    // The receiver (wrongly) still uses the old request's expectations.
    f.table.admit(f.req, f.tenant, 10, 4).unwrap();
    let err = Receiver::new(&f.table).accept(&old, &bytes, &f.pages, |_, _, _| panic!()).unwrap_err();
    assert_eq!(err.kind(), ViolationKind::ForeignPage, "{err}");
    assert!(err.to_string().contains("owned by req 99"), "{err}");
}

#[test]
fn a_request_released_while_its_bytes_land_cannot_pass_its_pages_on() {
    // The race: `land` runs with no lock held, so another thread may end the request and
    // the engine hand its pages to the next one while the bytes are still landing.
    // Five pages: the reserved page 0, three for a's prompt, one spare.
    let table = OwnershipTable::new(PoolConfig::new(5, PAGE_SIZE, 12).with_reserved([PageId(0)])).unwrap();
    let (a, b, c) = (RequestId(1), RequestId(2), RequestId(3));
    let prompt: Vec<u32> = (0..10).map(|i| 1000 + i).collect();
    table.admit(a, TenantId(1), 10, 0).unwrap();
    table.admit(b, TenantId(2), 8, 0).unwrap();
    table.admit(c, TenantId(2), 4, 0).unwrap();
    let refs = table.allocate(a, 3).unwrap();
    let a_pages: Vec<PageId> = refs.iter().map(|r| r.page).collect();
    let bytes = kv_pages(&prompt, 0xaa);
    let header = TransferHeader {
        request: a,
        tenant: TenantId(1),
        sender: SenderId(1),
        page_size: PAGE_SIZE,
        slot_bytes: SLOT_BYTES,
    };
    let manifest = Manifest::build(header, &prompt, &refs, &bytes).unwrap().encode();
    let expected = ExpectedTransfer::for_prompt(a, TenantId(1), &prompt, &refs, PAGE_SIZE, SLOT_BYTES);
    // The decode pool's KV, one buffer per page; b's own KV is all 0xbb.
    let page_bytes = (PAGE_SIZE * SLOT_BYTES) as usize;
    let mut pool = vec![vec![0u8; page_bytes]; 5];
    let mut b_page = None;
    let result = Receiver::new(&table).accept(&expected, &manifest, &bytes, |index, page, data| {
        if index == 0 {
            table.release(a).unwrap();
            // a's pages are free now, but none can be handed out while the transfer is in flight.
            for &p in &a_pages {
                let err = table.claim(c, &[p]).unwrap_err();
                assert_eq!(err.violation_kind(), Some(ViolationKind::PageNotFree), "{err}");
            }
            assert!(matches!(table.allocate(b, 2), Err(kvguard::Error::OutOfPages { .. })));
            let got = table.allocate(b, 1).unwrap()[0];
            assert!(!a_pages.contains(&got.page), "b got {} while a's bytes land in it", got.page);
            pool[got.page.0 as usize].fill(0xbb);
            table.record_write_tokens(b, &[got.page], 0..u64::from(PAGE_SIZE)).unwrap();
            b_page = Some(got);
        }
        pool[page.page.0 as usize][..data.len()].copy_from_slice(data);
        Ok(())
    });
    let err = result.expect_err("a transfer for a released request was accepted");
    assert!(matches!(err, TransferError::Table(_)), "{err}");
    assert_eq!(err.kind(), ViolationKind::UnknownRequest);
    // b's own page kept b's KV, and b reads it cleanly.
    let b_page = b_page.expect("land ran");
    assert!(pool[b_page.page.0 as usize].iter().all(|&x| x == 0xbb), "a's bytes landed in b's page");
    table.verify_read_refs(b, &[b_page], u64::from(PAGE_SIZE)).unwrap();
    // Now that the transfer is over a's pages are free again, with nothing recorded as written:
    // b may get one, in a new incarnation, and cannot read a's bytes through it.
    for &p in &a_pages {
        let info = table.page_info(p).unwrap();
        assert_eq!(info.state, kvguard::PageState::Free, "{p}");
        assert_eq!(info.written_slots, 0, "{p}");
    }
    let reused = table.claim(b, &[a_pages[0]]).unwrap()[0];
    assert_ne!(reused, refs[0]);
    assert_eq!(table.page_info(reused.page).unwrap().written_slots, 0);
    let read = table.verify_read_refs(b, &[b_page, reused], u64::from(PAGE_SIZE) + 1).unwrap_err();
    assert_eq!(read.violation_kind(), Some(ViolationKind::UnwrittenSlots), "{read}");
}

#[test]
fn a_second_transfer_into_pages_still_landing_is_refused() {
    let f = fixture(10);
    let bytes = f.manifest().encode();
    let mut second = None;
    let first = Receiver::new(&f.table).accept(&f.expected(), &bytes, &f.pages, |index, _, _| {
        if index == 0 {
            second = Some(f.land(&bytes, &f.pages));
        }
        Ok(())
    });
    let (result, landed) = second.expect("land ran");
    let err = result.expect_err("two transfers landed in the same pages at once");
    assert!(matches!(err, TransferError::NotHeld(_)), "{err}");
    assert_eq!(err.kind(), ViolationKind::ImportInFlight);
    assert_eq!(landed, 0);
    assert_eq!(f.table.counters().get(ViolationKind::ImportInFlight), 1);
    // The first transfer still ends, and unpins its pages.
    drop(first);
    let ticket = f.table.begin_import(f.req, &f.refs).unwrap();
    ticket.abort();
}

#[test]
fn a_refused_or_panicking_transfer_unpins_its_pages() {
    let f = fixture(10);
    let bytes = f.manifest().encode();
    let mut bad = f.pages.clone();
    bad[2][0] ^= 1;
    let (result, _) = f.land(&bytes, &bad);
    assert!(matches!(result, Err(TransferError::PageChecksum { index: 2, .. })));
    // A copy into the pool that panics midway: the pages are unpinned on the way out.
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Receiver::new(&f.table).accept(&f.expected(), &bytes, &f.pages, |_, _, _| panic!("device copy failed"))
    }));
    assert!(panicked.is_err());
    f.assert_no_coverage();
    // Nothing is left pinned: released pages go straight back to the free list.
    f.table.release(f.req).unwrap();
    f.table.admit(RequestId(12), TenantId(3), 10, 0).unwrap();
    let refs = f.table.claim(RequestId(12), &f.block_table()).unwrap();
    assert_eq!(refs.len(), 3);
}

#[test]
fn a_receiver_page_size_other_than_the_tables_is_refused() {
    // A receiver configured with 8-slot pages over a table of 16-slot pages would land 8 tokens
    // per page and record 16 as written: slots 8..15 would read the previous owner's KV.
    let table = OwnershipTable::new(PoolConfig::new(8, 16, 64)).unwrap();
    let (req, tenant) = (RequestId(1), TenantId(1));
    let prompt: Vec<u32> = (0..16).collect();
    table.admit(req, tenant, 16, 0).unwrap();
    let refs = table.allocate(req, 2).unwrap();
    let pages: Vec<Vec<u8>> = prompt.chunks(8).map(|c| vec![0x5a; c.len() * SLOT_BYTES as usize]).collect();
    let header = TransferHeader { request: req, tenant, sender: SenderId(1), page_size: 8, slot_bytes: SLOT_BYTES };
    let manifest = Manifest::build(header, &prompt, &refs, &pages).unwrap().encode();
    let expected = ExpectedTransfer::for_prompt(req, tenant, &prompt, &refs, 8, SLOT_BYTES);
    let mut landed = 0;
    let err = Receiver::new(&table)
        .accept(&expected, &manifest, &pages, |_, _, _| {
            landed += 1;
            Ok(())
        })
        .unwrap_err();
    assert!(matches!(err, TransferError::TablePageSize { expected: 8, table: 16 }), "{err}");
    assert_eq!(err.kind(), ViolationKind::TransferPagesMismatch);
    assert_eq!(landed, 0);
    for r in &refs {
        assert_eq!(table.page_info(r.page).unwrap().written_slots, 0, "coverage recorded in {}", r.page);
    }
    assert_eq!(table.counters().get(ViolationKind::TransferPagesMismatch), 1);
}

#[test]
fn a_receiver_expecting_another_tenant_than_the_table_is_refused() {
    let f = fixture(10);
    // Manifest and receiver agree on tenant 4; the table admitted the request for tenant 3.
    let header = TransferHeader { tenant: TenantId(4), ..f.header() };
    let manifest = Manifest::build(header, &f.prompt, &f.refs, &f.pages).unwrap().encode();
    let expected = ExpectedTransfer::for_prompt(f.req, TenantId(4), &f.prompt, &f.refs, PAGE_SIZE, SLOT_BYTES);
    let mut landed = 0;
    let err = Receiver::new(&f.table)
        .accept(&expected, &manifest, &f.pages, |_, _, _| {
            landed += 1;
            Ok(())
        })
        .unwrap_err();
    assert!(matches!(err, TransferError::TableTenant { expected: TenantId(4), table: TenantId(3), .. }), "{err}");
    assert_eq!(err.kind(), ViolationKind::TransferMisrouted);
    assert_eq!(landed, 0);
    f.assert_no_coverage();
    assert_eq!(f.table.counters().get(ViolationKind::TransferMisrouted), 1);
    let v = f.table.drain_violations();
    assert_eq!(v.len(), 1);
    assert_eq!(v[0].tenant(), Some(TenantId(3)), "{}", v[0]);
}

#[test]
fn a_manifest_naming_other_pages_is_refused() {
    let f = fixture(10);
    let mut refs = f.refs.clone();
    refs.swap(0, 1);
    let m = Manifest::build(f.header(), &f.prompt, &refs, &f.pages).unwrap();
    let err = f.assert_refused(f.land(&m.encode(), &f.pages), ViolationKind::TransferPagesMismatch);
    assert!(matches!(err, TransferError::Pages { index: Some(0), .. }));
}

#[test]
fn another_page_shape_is_refused() {
    let f = fixture(8);
    let pages: Vec<Vec<u8>> = f.pages.iter().map(|p| p.iter().step_by(2).copied().collect()).collect();
    let m = Manifest::build(TransferHeader { slot_bytes: 4, ..f.header() }, &f.prompt, &f.refs, &pages).unwrap();
    f.assert_refused(f.land(&m.encode(), &pages), ViolationKind::TransferPagesMismatch);
}

#[test]
fn page_checksum_is_crc32fast_bit_exact() {
    let bytes: Vec<u8> = (0..4096u32).map(|i| (i * 31 % 251) as u8).collect();
    assert_eq!(page_checksum(&bytes), crc32fast::hash(&bytes));
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
        let _ = Manifest::decode(&bytes);
    }

    #[test]
    fn arbitrary_bytes_after_a_valid_header_never_panic(tail in proptest::collection::vec(any::<u8>(), 0..200), count in any::<u32>()) {
        let f = fixture(10);
        let mut bytes = f.manifest().encode();
        bytes[56..60].copy_from_slice(&count.to_le_bytes());
        bytes.truncate(HEADER_LEN);
        bytes.extend_from_slice(&tail);
        let _ = Manifest::decode(&bytes);
        reseal(&mut bytes);
        let _ = Manifest::decode(&bytes);
    }

    #[test]
    fn build_encode_decode_round_trips(
        len in 0u32..200,
        page_size in 1u32..17,
        slot_bytes in 1u32..9,
        request in any::<u64>(),
        tenant in any::<u64>(),
    ) {
        let prompt: Vec<u32> = (0..len).map(|i| i.wrapping_mul(2_654_435_761)).collect();
        let n = len.div_ceil(page_size);
        let refs: Vec<PageRef> = (0..n).map(|i| PageRef { page: PageId(i * 3), generation: kvguard::Generation(i + 1) }).collect();
        let pages: Vec<Vec<u8>> = (0..n)
            .map(|i| vec![i as u8; ((len - i * page_size).min(page_size) * slot_bytes) as usize])
            .collect();
        let header = TransferHeader { request: RequestId(request), tenant: TenantId(tenant), sender: SenderId(1), page_size, slot_bytes };
        let m = Manifest::build(header, &prompt, &refs, &pages).unwrap();
        prop_assert_eq!(Manifest::decode(&m.encode()).unwrap(), m.clone());
        let expected = ExpectedTransfer::for_prompt(RequestId(request), TenantId(tenant), &prompt, &refs, page_size, slot_bytes);
        prop_assert!(kvguard::transfer::verify(&expected, &m, &pages).is_ok());
    }
}

#[test]
fn under_report_policy_a_bad_transfer_is_still_refused_but_nobody_is_quarantined() {
    let table = OwnershipTable::new(PoolConfig::new(16, PAGE_SIZE, 64).with_policy(kvguard::Policy::Report)).unwrap();
    let (req, tenant) = (RequestId(1), TenantId(1));
    let prompt: Vec<u32> = (0..8).collect();
    table.admit(req, tenant, 8, 0).unwrap();
    let refs = table.allocate(req, 2).unwrap();
    let header =
        TransferHeader { request: req, tenant, sender: SenderId(1), page_size: PAGE_SIZE, slot_bytes: SLOT_BYTES };
    let dummy = Manifest::build(header, &[0], &refs[..1], &kv_pages(&[0], 0)).unwrap();
    let expected = ExpectedTransfer::for_prompt(req, tenant, &prompt, &refs, PAGE_SIZE, SLOT_BYTES);
    let err = Receiver::new(&table).accept(&expected, &dummy.encode(), &kv_pages(&[0], 0), |_, _, _| panic!());
    assert!(matches!(err, Err(TransferError::TokenCount { .. })), "a transfer is refused under every policy");
    assert_eq!(table.counters().get(ViolationKind::TokenCountMismatch), 1);
    assert!(!table.request_info(req).unwrap().quarantined);
}
