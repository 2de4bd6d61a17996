//! The table used from several threads at once: schedulers allocating, writing, verifying and
//! releasing, while a "transfer thread" imports and another thread probes foreign reads. At the
//! end every page is back and the counters hold exactly the violations provoked.

use kvguard::{OwnershipTable, PageId, PageState, PoolConfig, RequestId, SeqRead, TenantId, ViolationKind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;

const THREADS: u64 = 4;
const ROUNDS: u64 = 2000;
const PAGE_SIZE: u32 = 16;

#[test]
fn concurrent_lifecycles_keep_every_invariant() {
    let table =
        Arc::new(OwnershipTable::new(PoolConfig::new(4096, PAGE_SIZE, 4096).with_reserved([PageId(0)])).unwrap());
    let provoked = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for t in 0..THREADS {
        let table = Arc::clone(&table);
        let provoked = Arc::clone(&provoked);
        workers.push(thread::spawn(move || {
            let mut rng = t.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            let mut next = move || {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng
            };
            let mut last_foreign: Option<Vec<PageId>> = None;
            for round in 0..ROUNDS {
                let req = RequestId(t * 1_000_000 + round);
                let tokens = 1 + next() % 500;
                table.admit(req, TenantId(t), tokens, 0).unwrap();
                let pages: Vec<PageId> = table
                    .allocate(req, tokens.div_ceil(u64::from(PAGE_SIZE)) as u32)
                    .unwrap()
                    .iter()
                    .map(|r| r.page)
                    .collect();
                // Chunked prefill, then one decode step that must pass.
                let mid = next() % tokens;
                table.record_write_tokens(req, &pages, 0..mid).unwrap();
                assert_eq!(table.check_read(req, &pages, tokens).unwrap_err().kind(), ViolationKind::UnwrittenSlots);
                table.record_write_tokens(req, &pages, mid..tokens).unwrap();
                let verdict = table.verify_step(&[SeqRead { request: req, block_table: &pages, tokens }]);
                assert!(verdict.is_clean(), "{:?}", verdict.refused);
                // A read through another thread's pages, remembered from an earlier round: those
                // pages are now free, someone else's, or — if this thread got them back — our own
                // unwritten... never readable for `req` unless it owns and wrote them.
                if let Some(foreign) = last_foreign.take() {
                    let mine = foreign.iter().all(|p| pages.contains(p));
                    if !mine && table.check_read(req, &foreign, u64::from(PAGE_SIZE)).is_ok() {
                        panic!("{req} read pages {foreign:?} it does not own");
                    }
                }
                if round % 7 == 0 {
                    // A provoked violation, counted by the table.
                    let probe = RequestId(u64::MAX - t);
                    table.admit(probe, TenantId(99), 1, 0).unwrap();
                    assert!(table.verify_read(probe, &pages[..1], 1).is_err());
                    provoked.fetch_add(1, Ordering::Relaxed);
                    table.release(probe).unwrap();
                }
                last_foreign = Some(pages[..1].to_vec());
                let released = table.release(req).unwrap();
                assert_eq!(released.pages.len(), pages.len());
            }
        }));
    }
    // A reader thread snapshotting while the others run: states always add up.
    {
        let table = Arc::clone(&table);
        workers.push(thread::spawn(move || {
            for _ in 0..2000 {
                let s = table.snapshot();
                assert_eq!(s.free + s.owned + s.shared + s.reserved + s.retired + s.awaiting_scrub, s.total_pages);
            }
        }));
    }
    for w in workers {
        w.join().expect("worker panicked");
    }
    let s = table.snapshot();
    assert_eq!((s.free, s.owned, s.shared, s.requests), (4095, 0, 0, 0));
    assert_eq!(table.counters().get(ViolationKind::ForeignPage), provoked.load(Ordering::Relaxed));
    assert_eq!(table.counters().total(), provoked.load(Ordering::Relaxed));
    for p in 1..4096 {
        assert_eq!(table.page_info(PageId(p)).unwrap().state, PageState::Free);
    }
}
