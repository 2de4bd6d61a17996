//! A tiny reference model of the ownership table, and an op-sequence driver that checks the real
//! table against it after every step. Shared by the proptest suite (`tests/table_model.rs`) and the
//! fuzz target (`fuzz/fuzz_targets/table_ops.rs`, via `#[path]`).
//!
//! The model is deliberately naive: per-slot booleans, sets, linear scans. It decides from first
//! principles whether each operation may succeed; the table must agree, and its pages must match
//! the model's after every operation.

#![allow(dead_code)]

pub mod mirror;
pub mod step;

use kvguard::cuda::layout::DeviceTag;
use kvguard::{
    BlockRows, Error, HeldBlockTable, OwnershipTable, PageId, PageState, PoolConfig, PrefixKey, RequestId, RowCache,
    RowRead, SeqRead, TenantId,
};
use std::collections::{BTreeMap, BTreeSet};

pub const PAGES: u32 = 10;
pub const PAGE_SIZE: u32 = 4;
pub const MAX_CONTEXT: u64 = 24;
pub const REQUESTS: u8 = 6;
pub const TENANTS: u8 = 2;
pub const KEYS: u8 = 3;
/// Low, so retirement happens within a test.
pub const GENERATION_LIMIT: u32 = 6;

/// One operation on the table; small fields, mapped onto the model's id spaces.
#[derive(Clone, Debug)]
#[cfg_attr(fuzzing, derive(arbitrary::Arbitrary))]
pub enum Op {
    Admit {
        req: u8,
        tenant: u8,
        prompt: u8,
        max_new: u8,
    },
    Allocate {
        req: u8,
        n: u8,
    },
    Claim {
        req: u8,
        pages: Vec<u8>,
    },
    /// Write slots `a..b` of the request's `index`-th readable page (or of raw page `index` when
    /// `raw`).
    Write {
        req: u8,
        index: u8,
        raw: bool,
        a: u8,
        b: u8,
    },
    /// Read `tokens` through the request's own view, with entry `swap_at` replaced by page `swap`
    /// when `swap_at` is in range.
    Read {
        req: u8,
        tokens: u8,
        swap_at: u8,
        swap: u8,
    },
    Release {
        req: u8,
    },
    ReleasePages {
        req: u8,
        indices: Vec<u8>,
    },
    Preempt {
        req: u8,
    },
    Publish {
        req: u8,
        key: u8,
        count: u8,
    },
    Attach {
        req: u8,
        key: u8,
    },
    Detach {
        req: u8,
        key: u8,
    },
    Evict {
        key: u8,
    },
    Fork {
        parent: u8,
        child: u8,
    },
    AllowSharing {
        tenant: u8,
        allow: bool,
    },
    /// Write tokens `start..start + len` through the request's own view.
    WriteTokens {
        req: u8,
        start: u8,
        len: u8,
    },
    /// A KV transfer into the request's owned pages: `begin_import`, optionally the request's
    /// release while the bytes are in flight, then `ImportTicket::finish` of `tokens` (`expected` wanted).
    Import {
        req: u8,
        tokens: u8,
        expected: u8,
        release_midway: bool,
    },
    /// The device mirror takes the changed tags ([`run_syncing`]: only here; [`run`]: after
    /// every operation anyway).
    Sync,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum MState {
    Free,
    Owned(u8),
    Shared(usize),
    Reserved,
    Retired,
}

#[derive(Clone, Debug)]
struct MPage {
    state: MState,
    generation: u32,
    written: Vec<bool>,
}

#[derive(Clone, Debug)]
struct MRequest {
    tenant: u8,
    /// Owned pages, in the order they were given.
    owned: Vec<u32>,
    /// Prefix ids held.
    held: BTreeSet<usize>,
    quarantined: bool,
}

#[derive(Clone, Debug)]
struct MPrefix {
    key: Option<u8>,
    tenant: u8,
    pages: Vec<u32>,
    holders: usize,
}

/// The reference model.
#[derive(Clone, Debug)]
pub struct Model {
    pages: Vec<MPage>,
    requests: BTreeMap<u8, MRequest>,
    prefixes: BTreeMap<usize, MPrefix>,
    next_prefix: usize,
    sharing: BTreeSet<u8>,
}

pub fn config() -> PoolConfig {
    PoolConfig::new(PAGES, PAGE_SIZE, MAX_CONTEXT).with_reserved([PageId(0)]).with_generation_limit(GENERATION_LIMIT)
}

fn req_id(r: u8) -> RequestId {
    RequestId(u64::from(r % REQUESTS))
}
fn tenant_id(t: u8) -> TenantId {
    TenantId(u64::from(t % TENANTS))
}
fn key_id(k: u8) -> PrefixKey {
    PrefixKey(u64::from(k % KEYS))
}

impl Model {
    pub fn new() -> Model {
        let pages = (0..PAGES)
            .map(|p| MPage {
                state: if p == 0 { MState::Reserved } else { MState::Free },
                generation: 1,
                written: vec![false; PAGE_SIZE as usize],
            })
            .collect();
        Model { pages, requests: BTreeMap::new(), prefixes: BTreeMap::new(), next_prefix: 0, sharing: BTreeSet::new() }
    }

    /// Pages `r` may read, in block-table order: held prefixes' pages, then its own.
    fn view(&self, r: u8) -> Vec<u32> {
        let Some(rec) = self.requests.get(&r) else { return Vec::new() };
        let mut v: Vec<u32> = rec.held.iter().flat_map(|id| self.prefixes[id].pages.iter().copied()).collect();
        v.extend(&rec.owned);
        v
    }

    fn free_count(&self) -> usize {
        self.pages.iter().filter(|p| p.state == MState::Free).count()
    }

    fn end_incarnation(&mut self, p: u32) {
        let page = &mut self.pages[p as usize];
        page.written.iter_mut().for_each(|w| *w = false);
        if page.generation >= GENERATION_LIMIT {
            page.state = MState::Retired;
        } else {
            page.generation += 1;
            page.state = MState::Free;
        }
    }

    fn drop_hold(&mut self, id: usize) {
        let prefix = self.prefixes.get_mut(&id).expect("held prefixes exist");
        prefix.holders -= 1;
        if prefix.holders == 0 && prefix.key.is_none() {
            let prefix = self.prefixes.remove(&id).expect("exists");
            for p in prefix.pages {
                self.end_incarnation(p);
            }
        }
    }

    fn key_slot(&self, k: u8) -> Option<usize> {
        self.prefixes.iter().find(|(_, p)| p.key == Some(k)).map(|(&id, _)| id)
    }

    fn quarantine(&mut self, r: u8) {
        if let Some(rec) = self.requests.get_mut(&r) {
            rec.quarantined = true;
        }
    }

    fn owns(&self, r: u8, p: u32) -> bool {
        self.pages.get(p as usize).is_some_and(|pg| pg.state == MState::Owned(r))
    }

    /// Applies `op` to the model; returns whether it must succeed, and which request a refusal
    /// quarantines.
    fn apply(&mut self, op: &Op) -> (bool, Option<u8>) {
        let ps = u64::from(PAGE_SIZE);
        match *op {
            Op::Admit { req, tenant, prompt, max_new } => {
                let (r, t) = (req % REQUESTS, tenant % TENANTS);
                let total = u64::from(prompt) + u64::from(max_new);
                let obtainable =
                    self.pages.iter().filter(|p| !matches!(p.state, MState::Reserved | MState::Retired)).count();
                if self.requests.contains_key(&r) {
                    return (false, Some(r));
                }
                if total > MAX_CONTEXT || total.div_ceil(ps) > obtainable as u64 {
                    return (false, None);
                }
                self.requests
                    .insert(r, MRequest { tenant: t, owned: Vec::new(), held: BTreeSet::new(), quarantined: false });
                (true, None)
            }
            Op::Allocate { req, n } => {
                let (r, n) = (req % REQUESTS, usize::from(n % 5));
                if !self.requests.contains_key(&r) || n > self.free_count() {
                    return (false, None);
                }
                // The table's choice of pages is its own; the driver tells the model which.
                (true, None)
            }
            Op::Claim { req, ref pages } => {
                let r = req % REQUESTS;
                let pages: Vec<u32> = pages.iter().map(|&p| u32::from(p) % (PAGES + 2)).collect();
                if !self.requests.contains_key(&r) {
                    return (false, None);
                }
                let distinct: BTreeSet<_> = pages.iter().collect();
                let ok = distinct.len() == pages.len()
                    && pages.iter().all(|&p| self.pages.get(p as usize).is_some_and(|pg| pg.state == MState::Free));
                if !ok {
                    return (false, Some(r));
                }
                for p in pages {
                    self.pages[p as usize].state = MState::Owned(r);
                    self.requests.get_mut(&r).expect("checked").owned.push(p);
                }
                (true, None)
            }
            Op::Write { req, index, raw, a, b } => {
                let r = req % REQUESTS;
                if !self.requests.contains_key(&r) {
                    return (false, None);
                }
                let page = self.write_target(r, index, raw);
                let (a, b) = (u32::from(a % 6), u32::from(b % 6));
                if !self.owns(r, page) || a > b || b > PAGE_SIZE {
                    return (false, Some(r));
                }
                for s in a..b {
                    self.pages[page as usize].written[s as usize] = true;
                }
                (true, None)
            }
            Op::Read { req, tokens, swap_at, swap } => {
                let r = req % REQUESTS;
                let Some(rec) = self.requests.get(&r) else { return (false, None) };
                let table = self.read_table(r, swap_at, swap);
                let tokens = u64::from(tokens) % (table.len() as u64 * ps + 2);
                if rec.quarantined || tokens > table.len() as u64 * ps {
                    return (false, Some(r));
                }
                for (i, &p) in table.iter().enumerate().take(tokens.div_ceil(ps) as usize) {
                    let need = (tokens - i as u64 * ps).min(ps) as usize;
                    let Some(page) = self.pages.get(p as usize) else { return (false, Some(r)) };
                    let readable = match page.state {
                        MState::Owned(o) => o == r,
                        // A holder reads: the grant is checked when it attaches, and a grant
                        // withdrawn later keeps the holds already taken (`allow_cross_tenant_sharing`).
                        MState::Shared(id) => rec.held.contains(&id),
                        _ => false,
                    };
                    if !readable || !page.written[..need].iter().all(|&w| w) {
                        return (false, Some(r));
                    }
                }
                (true, None)
            }
            Op::Release { req } => {
                let r = req % REQUESTS;
                let Some(rec) = self.requests.remove(&r) else { return (false, None) };
                for p in rec.owned {
                    self.end_incarnation(p);
                }
                for id in rec.held {
                    self.drop_hold(id);
                }
                (true, None)
            }
            Op::ReleasePages { req, ref indices } => {
                let r = req % REQUESTS;
                let Some(rec) = self.requests.get(&r) else { return (false, None) };
                let view = self.view(r);
                let pages: Vec<u32> = indices.iter().filter_map(|&i| view.get(usize::from(i)).copied()).collect();
                let distinct: BTreeSet<_> = pages.iter().collect();
                if distinct.len() != pages.len() || !pages.iter().all(|p| rec.owned.contains(p)) {
                    return (false, Some(r));
                }
                for p in pages {
                    self.requests.get_mut(&r).expect("checked").owned.retain(|&q| q != p);
                    self.end_incarnation(p);
                }
                (true, None)
            }
            Op::Preempt { req } => {
                let r = req % REQUESTS;
                let Some(rec) = self.requests.get_mut(&r) else { return (false, None) };
                let owned = std::mem::take(&mut rec.owned);
                let held = std::mem::take(&mut rec.held);
                for p in owned {
                    self.end_incarnation(p);
                }
                for id in held {
                    self.drop_hold(id);
                }
                (true, None)
            }
            Op::Publish { req, key, count } => {
                let (r, k) = (req % REQUESTS, key % KEYS);
                let Some(rec) = self.requests.get(&r) else { return (false, None) };
                if self.key_slot(k).is_some() {
                    return (false, Some(r));
                }
                let n = usize::from(count % 4).min(rec.owned.len());
                let pages: Vec<u32> = rec.owned[..n].to_vec();
                let tenant = rec.tenant;
                let id = self.next_prefix;
                self.next_prefix += 1;
                for &p in &pages {
                    self.pages[p as usize].state = MState::Shared(id);
                }
                let rec = self.requests.get_mut(&r).expect("checked");
                rec.owned.retain(|p| !pages.contains(p));
                rec.held.insert(id);
                self.prefixes.insert(id, MPrefix { key: Some(k), tenant, pages, holders: 1 });
                (true, None)
            }
            Op::Attach { req, key } => {
                let (r, k) = (req % REQUESTS, key % KEYS);
                let Some(rec) = self.requests.get(&r) else { return (false, None) };
                let Some(id) = self.key_slot(k) else { return (false, Some(r)) };
                let pt = self.prefixes[&id].tenant;
                if pt != rec.tenant && !self.sharing.contains(&pt) {
                    return (false, Some(r));
                }
                if self.requests.get_mut(&r).expect("checked").held.insert(id) {
                    self.prefixes.get_mut(&id).expect("exists").holders += 1;
                }
                (true, None)
            }
            Op::Detach { req, key } => {
                let (r, k) = (req % REQUESTS, key % KEYS);
                if !self.requests.contains_key(&r) {
                    return (false, None);
                }
                let Some(id) = self.key_slot(k) else { return (false, Some(r)) };
                if !self.requests.get_mut(&r).expect("checked").held.remove(&id) {
                    return (false, Some(r));
                }
                self.drop_hold(id);
                (true, None)
            }
            Op::Evict { key } => {
                let Some(id) = self.key_slot(key % KEYS) else { return (false, None) };
                if self.prefixes[&id].holders > 0 {
                    return (false, None);
                }
                let prefix = self.prefixes.remove(&id).expect("exists");
                for p in prefix.pages {
                    self.end_incarnation(p);
                }
                (true, None)
            }
            Op::Fork { parent, child } => {
                let (p, c) = (parent % REQUESTS, child % REQUESTS);
                let Some(rec) = self.requests.get(&p).cloned() else { return (false, None) };
                if rec.quarantined || self.requests.contains_key(&c) {
                    return (false, Some(p));
                }
                let mut held = rec.held.clone();
                if !rec.owned.is_empty() {
                    let id = self.next_prefix;
                    self.next_prefix += 1;
                    for &pg in &rec.owned {
                        self.pages[pg as usize].state = MState::Shared(id);
                    }
                    self.prefixes
                        .insert(id, MPrefix { key: None, tenant: rec.tenant, pages: rec.owned.clone(), holders: 1 });
                    let parent = self.requests.get_mut(&p).expect("checked");
                    parent.owned.clear();
                    parent.held.insert(id);
                    held.insert(id);
                }
                for id in &held {
                    self.prefixes.get_mut(id).expect("exists").holders += 1;
                }
                self.requests.insert(c, MRequest { tenant: rec.tenant, owned: Vec::new(), held, quarantined: false });
                (true, None)
            }
            Op::WriteTokens { req, start, len } => {
                let r = req % REQUESTS;
                if !self.requests.contains_key(&r) {
                    return (false, None);
                }
                let view = self.view(r);
                let (start, end) = (u64::from(start % 24), u64::from(start % 24) + u64::from(len % 12));
                if start == end {
                    return (true, None);
                }
                if end > view.len() as u64 * ps {
                    return (false, Some(r));
                }
                if !(start / ps..end.div_ceil(ps)).all(|b| self.owns(r, view[b as usize])) {
                    return (false, Some(r));
                }
                for t in start..end {
                    self.pages[view[(t / ps) as usize] as usize].written[(t % ps) as usize] = true;
                }
                (true, None)
            }
            Op::Import { req, tokens, expected, release_midway } => {
                let r = req % REQUESTS;
                let Some(rec) = self.requests.get(&r) else { return (false, None) };
                let owned = rec.owned.clone();
                if release_midway {
                    // The pages leave the request while the bytes land; nothing is recorded.
                    self.apply(&Op::Release { req });
                    return (false, None);
                }
                let (tokens, expected) = (u64::from(tokens % 20), u64::from(expected % 20));
                if tokens != expected || tokens > owned.len() as u64 * ps {
                    return (false, Some(r));
                }
                for t in 0..tokens {
                    self.pages[owned[(t / ps) as usize] as usize].written[(t % ps) as usize] = true;
                }
                (true, None)
            }
            Op::AllowSharing { tenant, allow } => {
                let t = tenant % TENANTS;
                if allow {
                    self.sharing.insert(t);
                } else {
                    self.sharing.remove(&t);
                }
                (true, None)
            }
            Op::Sync => (true, None),
        }
    }

    /// The request's owned pages as refs to their current incarnations, in the order given.
    fn owned_refs(&self, r: u8) -> Vec<kvguard::PageRef> {
        let owned = self.requests.get(&r).map(|rec| rec.owned.clone()).unwrap_or_default();
        owned
            .into_iter()
            .map(|p| kvguard::PageRef {
                page: PageId(p),
                generation: kvguard::Generation(self.pages[p as usize].generation),
            })
            .collect()
    }

    fn write_target(&self, r: u8, index: u8, raw: bool) -> u32 {
        if raw {
            return u32::from(index) % (PAGES + 2);
        }
        let view = self.view(r);
        if view.is_empty() { u32::from(index) % (PAGES + 2) } else { view[usize::from(index) % view.len()] }
    }

    fn read_table(&self, r: u8, swap_at: u8, swap: u8) -> Vec<u32> {
        let mut table = self.view(r);
        if let Some(slot) = table.get_mut(usize::from(swap_at)) {
            *slot = u32::from(swap) % (PAGES + 2);
        }
        table
    }
}

impl Default for Model {
    fn default() -> Self {
        Model::new()
    }
}

/// Runs `ops` against a fresh table and the model, checking agreement and invariants after each.
/// Panics with a description of the first disagreement.
pub fn run(ops: &[Op]) {
    run_with(config(), ops)
}

/// [`run`] with the device mirror taking the changed tags only at [`Op::Sync`] (and at the end),
/// so several operations change pages between two takes, as between two engine steps: a page
/// changed twice must be listed once with its last tag, and none may be lost. The mirror is
/// compared with every page's info after each take.
pub fn run_syncing(ops: &[Op]) {
    run_checked(config(), ops, false, |_, _, _, _| {})
}

/// What `op` does to request `r`'s row in [`run_rows`] and [`run_slot_rows`]: whether the engine
/// writes the row anew (an operation of that request that changes what it holds or wrote), and
/// the read it makes if it is a read by that request (tokens, the entry swapped, the page put
/// there).
fn row_refresh(op: &Op, r: u8) -> (bool, Option<(u8, u8, u8)>) {
    let mine = |req: u8| req % REQUESTS == r;
    let read = match *op {
        Op::Read { req, tokens, swap_at, swap } if mine(req) => Some((tokens, swap_at, swap)),
        _ => None,
    };
    let refresh = read.is_some()
        || match *op {
            Op::Admit { req, .. }
            | Op::Allocate { req, .. }
            | Op::Claim { req, .. }
            | Op::Attach { req, .. }
            | Op::Write { req, .. }
            | Op::WriteTokens { req, .. } => mine(req),
            _ => false,
        };
    (refresh, read)
}

/// [`run`], and after every operation every request's row of an engine's block table is read
/// through one [`RowCache`] kept across the whole run and through
/// [`OwnershipTable::check_step`]: the incremental verdict must be the full check's, row for row
/// (same rows refused, same kind, block index and page).
///
/// A request's row is what an engine's block table would hold: refreshed to the request's view
/// by the operations that give it pages or tokens (admit, allocate, claim, attach, writes), and
/// left as it was by those that take something away (release, preempt, detach, evict, publish,
/// fork, imports), so a row still lists what was taken, as an engine's stale row would. A
/// [`Op::Read`] reads that request's view with an entry swapped behind the engine's calls, at
/// its own token count; the other requests read one token more each operation (wrapping past
/// their row), as decode steps do. Returns how many rows were judged incrementally.
pub fn run_rows(ops: &[Op]) -> u64 {
    let mut cache = RowCache::new();
    let mut tokens = [0u64; REQUESTS as usize];
    let stride = PAGES as usize + 1;
    let mut entries = vec![-1i32; REQUESTS as usize * stride];
    run_checked(config(), ops, true, |table, model, op, step| {
        let mut reads = Vec::new();
        for r in 0..REQUESTS {
            let (refresh, read) = row_refresh(op, r);
            let row = &mut entries[usize::from(r) * stride..(usize::from(r) + 1) * stride];
            if refresh {
                let (swap_at, swap) = read.map_or((u8::MAX, 0), |(_, at, page)| (at, page));
                row.fill(-1);
                for (e, p) in row.iter_mut().zip(model.read_table(r, swap_at, swap)) {
                    *e = p as i32;
                }
            }
            let listed = row.iter().take_while(|&&e| e >= 0).count() as u64;
            let cap = listed * u64::from(PAGE_SIZE) + 2;
            let t = &mut tokens[usize::from(r)];
            *t = match read {
                // Half the reads that swap an entry keep the row's length: a row changed behind
                // the engine's calls, read for as many tokens as the step before.
                Some((n, at, _)) if u64::from(at) < listed && n % 2 == 0 => *t % cap,
                Some((n, _, _)) => u64::from(n) % cap,
                None => (*t + 1) % cap,
            };
            reads.push(RowRead { request: req_id(r), row: u32::from(r), tokens: *t });
        }
        let rows = BlockRows::new(&entries, stride).expect("whole rows");
        let incremental = table.check_rows(&mut cache, rows, &reads).expect("rows in range");
        assert_full_check_agrees(table, &entries, stride, &reads, &incremental, || {
            format!("step {step}: after {op:?}")
        });
    });
    cache.incremental()
}

/// Asserts that `incremental` is `check_step`'s verdict on `reads` through `entries` (rows of
/// `stride` int32 page ids), row for row: the same rows refused, with the same kind, block index,
/// page and request. `at` says where, in the panic.
fn assert_full_check_agrees(
    table: &OwnershipTable,
    entries: &[i32],
    stride: usize,
    reads: &[RowRead],
    incremental: &kvguard::StepVerdict,
    at: impl Fn() -> String,
) {
    let pages: Vec<Vec<PageId>> =
        entries.chunks(stride).map(|row| row.iter().map(|&e| PageId(e as u32)).collect()).collect();
    let seqs: Vec<SeqRead<'_>> = reads
        .iter()
        .map(|r| SeqRead { request: r.request, block_table: &pages[r.row as usize], tokens: r.tokens })
        .collect();
    let full = table.check_step(&seqs);
    let said = |v: &kvguard::StepVerdict| -> Vec<_> {
        v.refused.iter().map(|(i, v)| (*i, v.kind(), v.block_index(), v.page(), v.request())).collect()
    };
    assert_eq!(said(incremental), said(&full), "{}, the rows' verdicts differ", at());
}

/// [`run_rows`] through a block table the guard holds ([`HeldBlockTable`]) and read by
/// [`OwnershipTable::check_held_rows`]: every step's verdict must be the full check's, row for
/// row. A row is refreshed through the held table's calls: what extends it appended, anything
/// else by `set_row`, or a truncate and an append, by turns; the entry a read swaps is swapped
/// through them too (nothing changes a held row behind its calls). At each [`Op::Sync`] one
/// request's row moves to the spare row (`copy_row`, the old one cleared) and two requests' rows
/// trade places (`swap_rows`), as an engine condensing its batch. Returns the rows judged
/// incrementally.
pub fn run_held_rows(ops: &[Op]) -> u64 {
    let stride = PAGES as usize + 1;
    let n = usize::from(REQUESTS);
    let mut held = HeldBlockTable::new(n + 1, stride).expect("a small table");
    // Request r's row in the held table; row `spare` holds none.
    let mut place: Vec<u32> = (0..n as u32).collect();
    let mut spare = n as u32;
    let mut tokens = [0u64; REQUESTS as usize];
    run_checked(config(), ops, true, |table, model, op, step| {
        if matches!(op, Op::Sync) {
            let r = step % n;
            held.copy_row(place[r], spare).expect("rows in range");
            held.clear_row(place[r]).expect("rows in range");
            (place[r], spare) = (spare, place[r]);
            let (a, b) = (step % n, (step + 1 + step / n) % n);
            held.swap_rows(place[a], place[b]).expect("rows in range");
            place.swap(a, b);
        }
        let mut reads = Vec::new();
        for r in 0..REQUESTS {
            let (refresh, read) = row_refresh(op, r);
            let at = place[usize::from(r)];
            if refresh {
                let (swap_at, swap) = read.map_or((u8::MAX, 0), |(_, at, page)| (at, page));
                let new: Vec<i32> = model.read_table(r, swap_at, swap).into_iter().map(|p| p as i32).collect();
                let old = held.row(at).expect("in range").to_vec();
                if new.starts_with(&old) {
                    held.append(at, &new[old.len()..]).expect("fits");
                } else if step % 2 == 0 {
                    held.set_row(at, &new).expect("fits");
                } else {
                    let same = old.iter().zip(&new).take_while(|(a, b)| a == b).count();
                    held.truncate(at, same).expect("in range");
                    held.append(at, &new[same..]).expect("fits");
                }
                assert_eq!(held.row(at), Some(&new[..]), "step {step}: the row as set");
            }
            let listed = held.row(at).expect("in range").len() as u64;
            let cap = listed * u64::from(PAGE_SIZE) + 2;
            let t = &mut tokens[usize::from(r)];
            *t = match read {
                Some((n, at, _)) if u64::from(at) < listed && n % 2 == 0 => *t % cap,
                Some((n, _, _)) => u64::from(n) % cap,
                None => (*t + 1) % cap,
            };
            reads.push(RowRead { request: req_id(r), row: at, tokens: *t });
        }
        let incremental = table.check_held_rows(&mut held, &reads).expect("rows in range");
        let at = || format!("step {step}: after {op:?} (held rows)");
        assert_full_check_agrees(table, held.entries(), stride, &reads, &incremental, at);
    });
    held.incremental()
}

/// [`run`]'s sequence with every request's row also kept as a token-slot table (SGLang's
/// `req_to_token`: entry `t` is the slot of token `t`, `page * PAGE_SIZE + offset`), read each
/// operation through one [`SlotRowCache`](kvguard::step::SlotRowCache): every step's cached
/// verdict must be the full check's ([`OwnershipTable::check_slot_rows`] from token 0), row for
/// row. Rows change behind the engine's calls as in [`run_rows`] (a page swapped), and also one
/// slot at a time (an entry pointing into another page). Returns the rows judged incrementally.
pub fn run_slot_rows(ops: &[Op]) -> u64 {
    use kvguard::step::{SlotRead, SlotRowCache};
    let mut cache = SlotRowCache::new();
    let mut tokens = [0u64; REQUESTS as usize];
    let ps = PAGE_SIZE as usize;
    let stride = (PAGES as usize + 1) * ps;
    let mut entries = vec![-1i32; REQUESTS as usize * stride];
    run_checked(config(), ops, true, |table, model, op, step| {
        let mut reads = Vec::new();
        for r in 0..REQUESTS {
            let (refresh, read) = row_refresh(op, r);
            let row = &mut entries[usize::from(r) * stride..(usize::from(r) + 1) * stride];
            if refresh {
                let (swap_at, swap) = read.map_or((u8::MAX, 0), |(_, at, page)| (at, page));
                row.fill(-1);
                for (j, p) in model.read_table(r, swap_at, swap).into_iter().enumerate() {
                    for (k, e) in row[j * ps..(j + 1) * ps].iter_mut().enumerate() {
                        *e = (p as usize * ps + k) as i32;
                    }
                }
                // One slot into another page (or past the pool), behind the engine's calls.
                if let Some((_, at, page)) = read
                    && page % 3 == 0
                {
                    let at = (usize::from(at) * 3 + 1) % stride;
                    row[at] = (usize::from(page / 3) * ps + 1) as i32;
                }
            }
            let listed = row.iter().take_while(|&&e| e >= 0).count() as u64;
            let cap = listed + 2;
            let t = &mut tokens[usize::from(r)];
            *t = match read {
                Some((n, at, _)) if u64::from(at) * u64::from(PAGE_SIZE) < listed && n % 2 == 0 => *t % cap,
                Some((n, _, _)) => u64::from(n) % cap,
                None => (*t + 1) % cap,
            };
            reads.push(RowRead { request: req_id(r), row: u32::from(r), tokens: *t });
        }
        let rows = BlockRows::new(&entries, stride).expect("whole rows");
        let cached = table.check_slot_rows_cached(&mut cache, rows, &reads).expect("rows in range");
        let whole: Vec<SlotRead> =
            reads.iter().map(|r| SlotRead { request: r.request, row: r.row, from: 0, tokens: r.tokens }).collect();
        let full = table.check_slot_rows(rows, &whole).expect("rows in range");
        let said = |v: &kvguard::StepVerdict| -> Vec<_> {
            v.refused.iter().map(|(i, v)| (*i, v.kind(), v.block_index(), v.page(), v.request())).collect()
        };
        assert_eq!(said(&cached), said(&full), "step {step}: after {op:?}, the slot rows' verdicts differ");
    });
    cache.incremental()
}

/// [`run`] against a table built from `config` (which should be [`config()`]; anything else is a
/// drift the model must catch).
pub fn run_with(config: PoolConfig, ops: &[Op]) {
    run_checked(config, ops, true, |_, _, _, _| {})
}

/// [`run_with`], the mirror taking the changed tags after every operation (`sync_always`) or
/// only at [`Op::Sync`] and after the last; `after` runs after each operation's checks (table,
/// model, operation, its index).
fn run_checked(
    config: PoolConfig,
    ops: &[Op],
    sync_always: bool,
    mut after: impl FnMut(&OwnershipTable, &Model, &Op, usize),
) {
    let table = OwnershipTable::new(config).expect("the model's pool passes its audit");
    let mut model = Model::new();
    let mut generations: Vec<u32> = vec![1; PAGES as usize];
    // A device mirror kept from the changed tags alone, checked against every page's info.
    let mut mirror = Mirror { tags: vec![DeviceTag::default(); PAGES as usize], changed: Vec::new() };
    for (step, op) in ops.iter().enumerate() {
        let outcome = execute(&table, &model, op);
        let (expected_ok, quarantines) = model.apply(op);
        match (&outcome, expected_ok) {
            (Ok(pages), true) => {
                if let (Op::Allocate { req, .. }, Some(pages)) = (op, pages) {
                    let r = req % REQUESTS;
                    for &p in pages {
                        assert_eq!(
                            model.pages[p as usize].state,
                            MState::Free,
                            "step {step}: allocated a non-free page {p}"
                        );
                        model.pages[p as usize].state = MState::Owned(r);
                        model.requests.get_mut(&r).expect("admitted").owned.push(p);
                    }
                }
            }
            (Err(e), false) => {
                if e.violation().is_some()
                    && let Some(q) = quarantines
                {
                    model.quarantine(q);
                }
            }
            (Ok(_), false) => panic!("step {step}: {op:?} succeeded, the model refuses it"),
            (Err(e), true) => panic!("step {step}: {op:?} refused ({e}), the model allows it"),
        }
        let sync = sync_always || matches!(op, Op::Sync) || step + 1 == ops.len();
        check_invariants(&table, &model, &mut generations, sync.then_some(&mut mirror), step);
        after(&table, &model, op, step);
    }
    // Releasing every request and evicting every prefix returns every page.
    for r in 0..REQUESTS {
        let _ = table.release(req_id(r));
    }
    for k in 0..KEYS {
        let _ = table.evict_prefix(key_id(k));
    }
    let s = table.snapshot();
    assert_eq!(s.free + s.reserved + s.retired, s.total_pages, "pages lost after releasing everything: {s:?}");
    assert_eq!((s.owned, s.shared, s.requests, s.prefixes), (0, 0, 0, 0));
}

/// Runs one op on the table; for an allocation, returns the pages handed out.
fn execute(table: &OwnershipTable, model: &Model, op: &Op) -> Result<Option<Vec<u32>>, Error> {
    let none = |r: Result<(), Error>| r.map(|_| None);
    match *op {
        Op::Admit { req, tenant, prompt, max_new } => {
            none(table.admit(req_id(req), tenant_id(tenant), u64::from(prompt), u64::from(max_new)))
        }
        Op::Allocate { req, n } => {
            table.allocate(req_id(req), u32::from(n % 5)).map(|refs| Some(refs.iter().map(|r| r.page.0).collect()))
        }
        Op::Claim { req, ref pages } => {
            let pages: Vec<PageId> = pages.iter().map(|&p| PageId(u32::from(p) % (PAGES + 2))).collect();
            table.claim(req_id(req), &pages).map(|_| None)
        }
        Op::Write { req, index, raw, a, b } => {
            let page = model.write_target(req % REQUESTS, index, raw);
            none(table.record_write(req_id(req), PageId(page), u32::from(a % 6)..u32::from(b % 6)))
        }
        Op::Read { req, tokens, swap_at, swap } => {
            let bt: Vec<PageId> = model.read_table(req % REQUESTS, swap_at, swap).into_iter().map(PageId).collect();
            let tokens = u64::from(tokens) % (bt.len() as u64 * u64::from(PAGE_SIZE) + 2);
            none(table.verify_read(req_id(req), &bt, tokens))
        }
        Op::Release { req } => table.release(req_id(req)).map(|_| None),
        Op::ReleasePages { req, ref indices } => {
            let view = model.view(req % REQUESTS);
            let pages: Vec<PageId> =
                indices.iter().filter_map(|&i| view.get(usize::from(i))).map(|&p| PageId(p)).collect();
            table.release_pages(req_id(req), &pages).map(|_| None)
        }
        Op::Preempt { req } => table.preempt(req_id(req)).map(|_| None),
        Op::Publish { req, key, count } => {
            let owned = model.requests.get(&(req % REQUESTS)).map(|r| r.owned.clone()).unwrap_or_default();
            let n = usize::from(count % 4).min(owned.len());
            let pages: Vec<PageId> = owned[..n].iter().map(|&p| PageId(p)).collect();
            none(table.publish_prefix(req_id(req), key_id(key), &pages))
        }
        Op::Attach { req, key } => table.attach_prefix(req_id(req), key_id(key)).map(|_| None),
        Op::Detach { req, key } => table.detach_prefix(req_id(req), key_id(key)).map(|_| None),
        Op::Evict { key } => table.evict_prefix(key_id(key)).map(|_| None),
        Op::Fork { parent, child } => none(table.fork(req_id(parent), req_id(child))),
        Op::AllowSharing { tenant, allow } => {
            table.allow_cross_tenant_sharing(tenant_id(tenant), allow);
            Ok(None)
        }
        Op::Sync => Ok(None), // the harness takes the changed tags
        Op::WriteTokens { req, start, len } => {
            let bt: Vec<PageId> = model.view(req % REQUESTS).into_iter().map(PageId).collect();
            let start = u64::from(start % 24);
            none(table.record_write_tokens(req_id(req), &bt, start..start + u64::from(len % 12)))
        }
        Op::Import { req, tokens, expected, release_midway } => {
            let r = req_id(req);
            let refs = model.owned_refs(req % REQUESTS);
            let ticket = table.begin_import(r, &refs)?;
            if release_midway {
                table.release(r)?;
                // Released while pinned: no page may be handed out before the transfer ends.
                let thief = RequestId(1000);
                table.admit(thief, TenantId(9), 1, 0)?;
                for x in &refs {
                    assert!(
                        table.claim(thief, &[x.page]).is_err(),
                        "a page with a transfer in flight was handed out: {x}"
                    );
                }
                table.release(thief)?;
            }
            none(ticket.finish(u64::from(tokens % 20), u64::from(expected % 20)))
        }
    }
}

/// A device tag mirror as a guard keeps it, from `take_changed_tags_into` (the fast path).
struct Mirror {
    tags: Vec<DeviceTag>,
    changed: Vec<(u32, DeviceTag)>,
}

/// Checks the table against the model; with `mirror`, the mirror first takes the changed tags
/// and must then hold every page's.
fn check_invariants(
    table: &OwnershipTable,
    model: &Model,
    generations: &mut [u32],
    mut mirror: Option<&mut Mirror>,
    step: usize,
) {
    if let Some(mirror) = mirror.as_deref_mut() {
        mirror.changed.clear();
        table.take_changed_tags_into(&mut mirror.changed);
        // Each page once (strictly ascending: the table hands them back in page order).
        assert!(
            mirror.changed.windows(2).all(|w| w[0].0 < w[1].0),
            "step {step}: changed pages listed twice or out of order: {:?}",
            mirror.changed.iter().map(|(p, _)| p).collect::<Vec<_>>()
        );
        for &(p, tag) in &mirror.changed {
            mirror.tags[p as usize] = tag;
        }
    }
    let s = table.snapshot();
    assert_eq!(
        s.free + s.owned + s.shared + s.reserved + s.retired + s.awaiting_scrub,
        s.total_pages,
        "step {step}: page states do not add up: {s:?}"
    );
    for p in 0..PAGES {
        let info = table.page_info(PageId(p)).expect("in range");
        let m = &model.pages[p as usize];
        let state = match m.state {
            MState::Free => PageState::Free,
            MState::Owned(_) => PageState::Owned,
            MState::Shared(_) => PageState::Shared,
            MState::Reserved => PageState::Reserved,
            MState::Retired => PageState::Retired,
        };
        assert_eq!(info.state, state, "step {step}: page {p} state");
        // The reference path: a device tag built from the page's info.
        if let Some(mirror) = mirror.as_deref() {
            assert_eq!(mirror.tags[p as usize], DeviceTag::from_page_info(&info), "step {step}: page {p} device tag");
        }
        if let MState::Owned(r) = m.state {
            assert_eq!(info.owner, Some(req_id(r)), "step {step}: page {p} owner");
        }
        assert_eq!(info.generation.0, m.generation, "step {step}: page {p} generation");
        assert!(info.generation.0 >= generations[p as usize], "step {step}: page {p} generation went backwards");
        generations[p as usize] = info.generation.0;
        assert_eq!(
            info.written_slots as usize,
            m.written.iter().filter(|&&w| w).count(),
            "step {step}: page {p} coverage"
        );
    }
    // At most one writing owner: the pages requests own exclusively are disjoint.
    let mut seen = BTreeSet::new();
    for r in 0..REQUESTS {
        if let Some(info) = table.request_info(req_id(r)) {
            for pr in info.owned_pages {
                assert!(seen.insert(pr.page), "step {step}: page {} owned twice", pr.page);
            }
            assert_eq!(info.quarantined, model.requests[&r].quarantined, "step {step}: req {r} quarantine");
        } else {
            assert!(!model.requests.contains_key(&r), "step {step}: req {r} missing from the table");
        }
    }
}
