//! An engine step (`OwnershipTable::engine_step`) beside the calls it stands for, one by one: what
//! the proptest `an_engine_step_judges_as_its_calls_one_by_one` (tests/it/step_engine.rs) and
//! the fuzz target `engine_step` check. After each step, the same rows as token slots (SGLang's
//! layout) go through one `decode_forward` on the first table and through `record_step_writes`
//! and `check_slot_rows` on the second; then each row writes its next token against a plugin's
//! mirror of the pool (`write_decode_rows` beside its claims one by one: `model::mirror`).

use kvguard::step::{Counts, DecodeForward, DecodeOutcome, EngineStep, EventBatch, SlotRead};
use kvguard::{
    BlockRows, OwnershipTable, PageId, Policy, PoolConfig, PrefixKey, RequestId, RowCache, SeqRead, SeqWrite,
    StepVerdict, TenantId,
};

/// Page size.
pub const PS: u32 = 4;
/// Pages in the pool.
pub const PAGES: u32 = 24;
/// Entries per row.
pub const WIDTH: usize = 6;

pub fn table(policy: Policy) -> OwnershipTable {
    OwnershipTable::new(PoolConfig::new(PAGES, PS, 64).with_reserved([PageId(0)]).with_policy(policy))
        .expect("the test pool passes its audit")
}

/// A step as the proptest draws it (or the fuzzer makes it).
#[derive(Clone, Debug)]
#[cfg_attr(fuzzing, derive(arbitrary::Arbitrary))]
pub struct Drawn {
    /// Events before the forward.
    pub early: Vec<Ev>,
    /// Per request slot (at most 4 are used): its row's entries and (computed, scheduled).
    pub rows: Vec<([i32; WIDTH], u8, u8)>,
    /// Events after the writes.
    pub late: Vec<Ev>,
}

/// One event, its ids small.
#[derive(Clone, Debug)]
#[cfg_attr(fuzzing, derive(arbitrary::Arbitrary))]
#[allow(missing_docs)]
pub enum Ev {
    Admit(u8, u8, u8),
    Claim(u8, Vec<u32>),
    Release(u8),
    Preempt(u8),
    Publish(u8, u8, Vec<u32>),
    Attach(u8, u8),
    Detach(u8, u8),
    Evict(u8),
    ReleasePages(u8, Vec<u32>),
}

pub fn req(r: u8) -> RequestId {
    RequestId(u64::from(r % 4) + 1)
}

fn pages(p: &[u32]) -> Vec<PageId> {
    p.iter().map(|&p| PageId(p)).collect()
}

fn batch(events: &[Ev]) -> EventBatch {
    let mut b = EventBatch::new();
    for e in events {
        match e {
            Ev::Admit(r, t, p) => b.admit(req(*r), TenantId(u64::from(*t)), u64::from(*p), 8),
            Ev::Claim(r, p) => b.claim(req(*r), &pages(p)),
            Ev::Release(r) => b.release(req(*r)),
            Ev::Preempt(r) => b.preempt(req(*r)),
            Ev::Publish(r, k, p) => b.publish(req(*r), PrefixKey(u64::from(*k)), &pages(p)),
            Ev::Attach(r, k) => b.attach(req(*r), PrefixKey(u64::from(*k))),
            Ev::Detach(r, k) => b.detach(req(*r), PrefixKey(u64::from(*k))),
            Ev::Evict(k) => b.evict(PrefixKey(u64::from(*k))),
            Ev::ReleasePages(r, p) => b.release_pages(req(*r), &pages(p)),
        };
    }
    b
}

/// Each event through its own call: `(index, kind)` of the refused ones.
fn one_by_one(t: &OwnershipTable, events: &[Ev]) -> Vec<(usize, kvguard::ViolationKind)> {
    let mut refused = Vec::new();
    for (i, e) in events.iter().enumerate() {
        let out = match e {
            Ev::Admit(r, tn, p) => t.admit(req(*r), TenantId(u64::from(*tn)), u64::from(*p), 8),
            Ev::Claim(r, p) => t.claim(req(*r), &pages(p)).map(drop),
            Ev::Release(r) => t.release(req(*r)).map(drop),
            Ev::Preempt(r) => t.preempt(req(*r)).map(drop),
            Ev::Publish(r, k, p) => t.publish_prefix(req(*r), PrefixKey(u64::from(*k)), &pages(p)),
            Ev::Attach(r, k) => t.attach_prefix(req(*r), PrefixKey(u64::from(*k))).map(drop),
            Ev::Detach(r, k) => t.detach_prefix(req(*r), PrefixKey(u64::from(*k))).map(drop),
            Ev::Evict(k) => t.evict_prefix(PrefixKey(u64::from(*k))).map(drop),
            Ev::ReleasePages(r, p) => t.release_pages(req(*r), &pages(p)).map(drop),
        };
        if let Err(e) = out {
            refused.push((i, e.violation_kind().expect("these events fail only with violations")));
        }
    }
    refused
}

fn said(v: &StepVerdict) -> Vec<(usize, kvguard::ViolationKind, Option<u32>, Option<PageId>)> {
    v.refused.iter().map(|(i, v)| (*i, v.kind(), v.block_index(), v.page())).collect()
}

fn kinds(r: &[(usize, kvguard::Violation)]) -> Vec<(usize, kvguard::ViolationKind)> {
    r.iter().map(|(i, v)| (*i, v.kind())).collect()
}

/// Runs `steps` through `engine_step` on one table and one call at a time on another, and
/// requires the same verdict at every stage and the same pages after every step.
pub fn same_as_one_by_one(steps: &[Drawn], policy: Policy) {
    let (stepped, single) = (table(policy), table(policy));
    let mut cache = RowCache::new();
    for (n, s) in steps.iter().enumerate() {
        // Any input: at most 4 rows, entries a page of the pool, one past it or -1, small counts.
        let s = &Drawn {
            rows: s
                .rows
                .iter()
                .take(4)
                .map(|(row, c, k)| (row.map(|e| if e < 0 { -1 } else { e % (PAGES as i32 + 2) }), c % 12, k % 6))
                .collect(),
            ..s.clone()
        };
        let requests: Vec<RequestId> = (0..s.rows.len() as u8).map(req).collect();
        let entries: Vec<i32> = s.rows.iter().flat_map(|(row, _, _)| *row).collect();
        let computed: Vec<u64> = s.rows.iter().map(|r| u64::from(r.1)).collect();
        let scheduled: Vec<u64> = s.rows.iter().map(|r| u64::from(r.2)).collect();
        // The engine's own arrays as it keeps them: int32 (vLLM's) on odd steps, read in place.
        let (computed32, scheduled32): (Vec<i32>, Vec<i32>) =
            s.rows.iter().map(|r| (i32::from(r.1), i32::from(r.2))).unzip();
        let (counts, counts_scheduled) = if n % 2 == 1 {
            (
                Counts::from_i32(&computed32).expect("non-negative"),
                Counts::from_i32(&scheduled32).expect("non-negative"),
            )
        } else {
            ((&computed).into(), (&scheduled).into())
        };
        let (early, late) = (batch(&s.early), batch(&s.late));
        let step = EngineStep {
            early: early.events(),
            requests: &requests,
            rows: BlockRows::new(&entries, WIDTH).expect("whole rows"),
            computed: counts,
            scheduled: counts_scheduled,
            late: late.events(),
        };
        let outcome = stepped.engine_step(&mut cache, &step).expect("the step's shape is right");
        assert!(outcome.early.completed() && outcome.late.completed());

        // The same, one call at a time.
        assert_eq!(kinds(&outcome.early.refused), one_by_one(&single, &s.early), "step {n}: early events");
        let slots: Vec<Vec<i64>> = s
            .rows
            .iter()
            .map(|(row, c, k)| {
                (u64::from(*c)..u64::from(*c) + u64::from(*k))
                    .map(|p| {
                        let col = ((p / u64::from(PS)) as usize).min(WIDTH - 1);
                        // A negative entry names no page: its slot is none a pool has.
                        if row[col] < 0 {
                            i64::MIN
                        } else {
                            i64::from(row[col]) * i64::from(PS) + (p % u64::from(PS)) as i64
                        }
                    })
                    .collect()
            })
            .collect();
        let writes: Vec<SeqWrite<'_>> =
            requests.iter().zip(&slots).map(|(&request, s)| SeqWrite { request, slots: s }).collect();
        let written = single.record_step_writes(&writes);
        assert_eq!(said(outcome.writes.as_ref().unwrap()), said(&written), "step {n}: writes");
        assert_eq!(kinds(&outcome.late.refused), one_by_one(&single, &s.late), "step {n}: late events");
        let tables: Vec<Vec<PageId>> =
            s.rows.iter().map(|(row, _, _)| row.map(|e| PageId(e as u32)).to_vec()).collect();
        let reads: Vec<SeqRead<'_>> = (0..s.rows.len())
            .map(|i| SeqRead { request: requests[i], block_table: &tables[i], tokens: computed[i] + scheduled[i] })
            .collect();
        assert_eq!(said(outcome.reads.as_ref().unwrap()), said(&single.verify_step(&reads)), "step {n}: reads");
        for p in 0..PAGES {
            assert_eq!(stepped.page_info(PageId(p)), single.page_info(PageId(p)), "step {n}: page {p}");
        }
        assert_eq!(stepped.snapshot(), single.snapshot(), "step {n}");
        decode_forward_as_its_calls(&stepped, &single, s, &requests, n);
        mirror_row_write(&stepped, &single, s, &requests, n);
    }
}

/// The step's rows as token slots (each page id `p` as slots `p * PS ..`, a negative entry as -1,
/// a row's first request's entry 1 bent to another page's slot when its count is odd), each
/// request writing the slot of its token `computed` and reading from that token on, through
/// `decode_forward` on `stepped` and through its calls on `single`: the same verdicts, the
/// same pages after.
fn decode_forward_as_its_calls(
    stepped: &OwnershipTable,
    single: &OwnershipTable,
    s: &Drawn,
    requests: &[RequestId],
    n: usize,
) {
    let ps = PS as usize;
    let mut entries: Vec<i32> = Vec::with_capacity(s.rows.len() * WIDTH * ps);
    for (row, c, _) in &s.rows {
        let start = entries.len();
        entries
            .extend(row.iter().flat_map(|&e| (0..PS as i32).map(move |k| if e < 0 { -1 } else { e * PS as i32 + k })));
        if c % 2 == 1 {
            entries[start + 1] = entries[start + 1].wrapping_add(PS as i32 * 3);
        }
    }
    let rows = BlockRows::new(&entries, WIDTH * ps).expect("whole rows");
    let reads: Vec<SlotRead> = s
        .rows
        .iter()
        .enumerate()
        .map(|(i, (_, c, k))| SlotRead {
            request: requests[i],
            row: i as u32,
            from: u64::from(*c),
            tokens: u64::from(*c) + u64::from(*k).max(1),
        })
        .collect();
    let slots: Vec<i64> = reads
        .iter()
        .map(|r| entries.get(r.row as usize * WIDTH * ps + r.from as usize).map_or(i64::MIN, |&e| i64::from(e)))
        .collect();
    let outcome = stepped.decode_forward(&DecodeForward { reads: &reads, slots: &slots, rows }).expect("its shape");
    let writes: Vec<SeqWrite<'_>> =
        reads.iter().zip(slots.chunks(1)).map(|(r, slot)| SeqWrite { request: r.request, slots: slot }).collect();
    let written = single.record_step_writes(&writes);
    match outcome {
        DecodeOutcome::Writes(v) => assert_eq!(said(&v), said(&written), "step {n}: decode writes"),
        DecodeOutcome::Clean => {
            assert!(written.is_clean(), "step {n}: decode writes");
            assert!(single.check_slot_rows(rows, &reads).expect("rows").is_clean(), "step {n}: decode reads");
        }
        DecodeOutcome::Window(v) => {
            assert!(written.is_clean(), "step {n}: decode writes");
            assert_eq!(said(&v), said(&single.check_slot_rows(rows, &reads).expect("rows")), "step {n}: decode reads");
        }
    }
    for p in 0..PAGES {
        assert_eq!(stepped.page_info(PageId(p)), single.page_info(PageId(p)), "step {n}: page {p} after decoding");
    }
}

/// The step's rows written once more against a plugin's mirror of the pool: each row's request
/// claiming unless it scheduled nothing, each page's owner and prefix as the table says, except a
/// row's first page forgotten where its computed count is odd (a stale mirror); each row writes
/// the slot of its token `computed + scheduled`. `write_decode_rows` on `stepped`, the rule one
/// claim at a time on `single` (`model::mirror`).
fn mirror_row_write(stepped: &OwnershipTable, single: &OwnershipTable, s: &Drawn, requests: &[RequestId], n: usize) {
    let pages = PAGES as usize;
    let (mut owner, mut prefix) = (vec![0i64; pages + 1], vec![0i64; pages + 1]);
    for p in 0..pages {
        let info = stepped.page_info(PageId(p as u32)).expect("a page of the pool");
        owner[p] = info.owner.map_or(0, |r| r.0 as i64);
        prefix[p] = i64::from(info.prefix.is_some());
    }
    let mut positions = Vec::new();
    for (i, (row, c, k)) in s.rows.iter().enumerate() {
        if c % 2 == 1 && (0..PAGES as i32).contains(&row[0]) {
            owner[row[0] as usize] = 0;
        }
        let token = u64::from(*c) + u64::from(*k);
        let entry = row[((token / u64::from(PS)) as usize).min(WIDTH - 1)];
        let slot = if entry < 0 { -1 } else { i64::from(entry) * i64::from(PS) + (token % u64::from(PS)) as i64 };
        positions.push((i as u64, token as i64 - i64::from(*k % 2) * 9, slot));
    }
    let m = super::mirror::Mirror {
        keys: requests.iter().map(|r| r.0 as i64).collect(),
        claimants: s.rows.iter().map(|(_, _, k)| i64::from(*k != 0)).collect(),
        prefix,
        owner,
        checked: s.rows.iter().map(|(_, c, _)| i64::from(*c)).collect(),
        positions,
    };
    super::mirror::row_write_as_its_claims(stepped, single, &m, &format!("step {n}: row write"));
}
