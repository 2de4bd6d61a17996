//! The table used from several threads at once, as an engine uses it: scheduler threads admit,
//! allocate, write, verify and release; a transfer thread lands KV imports while a reaper thread
//! ends some of those requests mid-transfer; a monitor snapshots throughout. Every thread checks
//! ownership as it goes; at the end every page is back and the counters hold exactly the
//! violations that were provoked.

use kvguard::{Error, OwnershipTable, PageId, PageState, PoolConfig, RequestId, SeqRead, TenantId, ViolationKind};
use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread;

const SCHEDULERS: u64 = 3;
const ROUNDS: u64 = 2000;
const TRANSFERS: u64 = 2000;
const PAGE_SIZE: u32 = 16;

fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

#[test]
fn concurrent_schedulers_and_transfers_keep_every_invariant() {
    let table =
        Arc::new(OwnershipTable::new(PoolConfig::new(4096, PAGE_SIZE, 4096).with_reserved([PageId(0)])).unwrap());
    let provoked = Arc::new(AtomicU64::new(0));
    // Pages some scheduler owned recently, for the others to probe.
    let recent: Arc<Mutex<Vec<(RequestId, PageId)>>> = Arc::new(Mutex::new(Vec::new()));
    let mut workers = Vec::new();

    for t in 0..SCHEDULERS {
        let (table, provoked, recent) = (Arc::clone(&table), Arc::clone(&provoked), Arc::clone(&recent));
        workers.push(thread::spawn(move || {
            let mut next = xorshift(t + 1);
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
                // Chunked prefill, a read before the second chunk (refused), then a clean step.
                let mid = next() % tokens;
                table.record_write_tokens(req, &pages, 0..mid).unwrap();
                assert_eq!(table.check_read(req, &pages, tokens).unwrap_err().kind(), ViolationKind::UnwrittenSlots);
                table.record_write_tokens(req, &pages, mid..tokens).unwrap();
                let verdict = table.verify_step(&[SeqRead { request: req, block_table: &pages, tokens }]);
                assert!(verdict.is_clean(), "{:?}", verdict.refused);
                // A page another scheduler owned a moment ago: free now, someone else's, or — if
                // it came back to us — ours; readable only in the last case.
                let probe = {
                    let recent = recent.lock();
                    recent.iter().rev().find(|(owner, _)| owner.0 / 1_000_000 != t).copied()
                };
                if let Some((_, page)) = probe
                    && table.check_read(req, &[page], 1).is_ok()
                {
                    assert!(pages.contains(&page), "{req} read {page}, which it does not own");
                }
                if round % 7 == 0 {
                    // A provoked violation, counted by the table.
                    let intruder = RequestId(u64::MAX - t);
                    table.admit(intruder, TenantId(99), 1, 0).unwrap();
                    assert!(table.verify_read(intruder, &pages[..1], 1).is_err());
                    provoked.fetch_add(1, Ordering::Relaxed);
                    table.release(intruder).unwrap();
                }
                {
                    let mut recent = recent.lock();
                    recent.push((req, pages[0]));
                    if recent.len() > 64 {
                        recent.remove(0);
                    }
                }
                assert_eq!(table.release(req).unwrap().ended, pages.len() as u64);
            }
            0
        }));
    }

    // A transfer thread lands imports; a reaper ends half of those requests mid-flight.
    let (to_reaper, reaper_in) = mpsc::channel::<RequestId>();
    let (to_transfer, transfer_in) = mpsc::channel::<bool>();
    {
        let table = Arc::clone(&table);
        workers.push(thread::spawn(move || {
            let mut next = xorshift(77);
            for req in reaper_in {
                let reap = next().is_multiple_of(2);
                if reap {
                    table.release(req).unwrap();
                }
                to_transfer.send(reap).unwrap();
            }
            0
        }));
    }
    {
        let table = Arc::clone(&table);
        workers.push(thread::spawn(move || {
            let mut next = xorshift(99);
            let (mut landed, mut refused) = (0, 0);
            for i in 0..TRANSFERS {
                let req = RequestId(9_000_000 + i);
                let tokens = 1 + next() % 200;
                table.admit(req, TenantId(7), tokens, 0).unwrap();
                let refs = table.allocate(req, tokens.div_ceil(u64::from(PAGE_SIZE)) as u32).unwrap();
                let ticket = table.begin_import(req, &refs).unwrap();
                to_reaper.send(req).unwrap();
                let reaped = transfer_in.recv().unwrap();
                if reaped {
                    // Ended mid-flight: the pages left the request, but nobody else may have them.
                    for r in &refs {
                        assert_eq!(table.page_info(r.page).unwrap().state, PageState::Free, "{r} handed out in flight");
                    }
                }
                match ticket.finish(tokens, tokens) {
                    Ok(()) => {
                        assert!(!reaped);
                        table.verify_read_refs(req, &refs, tokens).unwrap();
                        table.release(req).unwrap();
                        landed += 1;
                    }
                    Err(Error::Violation(v)) => {
                        assert!(reaped, "{v}");
                        assert_eq!(v.kind(), ViolationKind::UnknownRequest);
                        refused += 1;
                    }
                    Err(e) => panic!("{e}"),
                }
            }
            drop(to_reaper);
            assert!(landed > 0 && refused > 0, "both outcomes exercised: {landed} landed, {refused} refused");
            refused
        }));
    }

    // A monitor: page states always add up.
    {
        let table = Arc::clone(&table);
        workers.push(thread::spawn(move || {
            for _ in 0..2000 {
                let s = table.snapshot();
                assert_eq!(s.free + s.owned + s.shared + s.reserved + s.retired + s.awaiting_scrub, s.total_pages);
            }
            0
        }));
    }

    // Every thread returns how many imports it saw refused: only the transfer thread sees any.
    let refused_imports: u64 =
        workers.into_iter().map(|w| w.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).sum();
    let s = table.snapshot();
    assert_eq!((s.free, s.owned, s.shared, s.requests), (4095, 0, 0, 0), "{s:?}");
    let provoked = provoked.load(Ordering::Relaxed);
    assert_eq!(table.counters().get(ViolationKind::ForeignPage), provoked);
    assert_eq!(table.counters().get(ViolationKind::UnknownRequest), refused_imports);
    assert_eq!(table.counters().total(), provoked + refused_imports);
    for p in 1..4096 {
        assert_eq!(table.page_info(PageId(p)).unwrap().state, PageState::Free);
    }
}
