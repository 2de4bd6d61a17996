//! The tiny engine: a prefill node and a decode node, with or without kvguard's layers.
//!
//! Per request, as a disaggregated engine does it: the decode node admits the request from its own
//! copy and allocates pages for the full prompt; the prefill node prefills (or, unguarded and over
//! its pool, silently prefills a one-token dummy), writes KV into its pages and sends them to the
//! decode node's pages; the decode node lands them, attention reads the prompt's slots and the
//! "response" is what those slots say. Pages are handed out LIFO and never cleared.

use crate::kv::{KvPool, SLOT_BYTES, SlotKv};
use crate::tally::{Leak, Outcome, RequestOutcome, RunTally};
use crate::workload::RequestSpec;
use crate::{Layers, Mode, SimConfig, SimError};
use kvguard::transfer::{ExpectedTransfer, Manifest, Receiver, SenderId, TransferHeader, tokens_in_page};
use kvguard::{
    Error, Generation, Op, OwnershipTable, PageId, PageRef, PoolConfig, RequestId, TenantId, Violation, ViolationKind,
};
use std::collections::VecDeque;

/// The token the prefill engine substitutes for a prompt it cannot hold.
pub const DUMMY_TOKEN: u32 = 0;
/// The prefill node's instance id in manifests.
const PREFILL_SENDER: SenderId = SenderId(1);
/// Violation lines kept per run for the printout.
const SAMPLE_VIOLATIONS: usize = 8;

/// A refusal on the way: the request ends with this error.
struct Refusal {
    kind: ViolationKind,
    message: String,
}

impl Refusal {
    fn from_error(e: Error) -> Result<Refusal, SimError> {
        match e.violation_kind() {
            Some(kind) => Ok(Refusal { kind, message: e.to_string() }),
            // Not a verdict on the request but an engine the config cannot run (out of pages).
            None => Err(SimError::Kvguard(e)),
        }
    }
}

struct Node {
    pool: KvPool,
    table: Option<OwnershipTable>,
}

struct Replay<'c> {
    config: &'c SimConfig,
    layers: Option<Layers>,
    prefill: Node,
    decode: Node,
    /// Requests decoding (holding decode pages), oldest first.
    in_flight: VecDeque<(RequestId, Vec<PageId>)>,
    substituted: u64,
}

pub(crate) fn run(config: &SimConfig, workload: &[RequestSpec], mode: Mode) -> Result<RunTally, SimError> {
    let layers = match mode {
        Mode::Unguarded => None,
        Mode::Guarded(l) => Some(l),
    };
    let table = |pages: u32, audited: bool| -> Result<Option<OwnershipTable>, SimError> {
        if layers.is_none() {
            return Ok(None);
        }
        let c = PoolConfig::new(pages, config.page_size, config.max_context);
        Ok(Some(if audited { OwnershipTable::new(c)? } else { OwnershipTable::new_unaudited(c)? }))
    };
    let mut replay = Replay {
        config,
        layers,
        // The incident's prefill pool fails the start-up audit; it is replayed unaudited so that
        // per-request admission is what refuses (the audit is shown separately).
        prefill: Node {
            pool: KvPool::new(config.prefill_pages, config.page_size),
            table: table(config.prefill_pages, false)?,
        },
        decode: Node {
            pool: KvPool::new(config.decode_pages, config.page_size),
            table: table(config.decode_pages, true)?,
        },
        in_flight: VecDeque::new(),
        substituted: 0,
    };
    let prefill_tokens = u64::from(config.prefill_pages) * u64::from(config.page_size);
    let mut outcomes = Vec::with_capacity(workload.len());
    for spec in workload {
        let outcome = match replay.serve(spec)? {
            Ok(outcome) => outcome,
            Err(r) => Outcome::Rejected { kind: r.kind, message: r.message },
        };
        outcomes.push(RequestOutcome {
            request: spec.id,
            tenant: spec.tenant,
            prompt_tokens: spec.prompt_tokens,
            over_long: u64::from(spec.prompt_tokens) > prefill_tokens,
            outcome,
        });
    }
    while replay.finish_oldest()? {}
    let mut violations: Vec<(ViolationKind, u64)> = Vec::new();
    let mut sample_violations = Vec::new();
    for t in [&replay.prefill.table, &replay.decode.table].into_iter().flatten() {
        for (k, n) in t.counters().nonzero() {
            match violations.iter_mut().find(|(x, _)| *x == k) {
                Some((_, m)) => *m += n,
                None => violations.push((k, n)),
            }
        }
        sample_violations.extend(t.drain_violations().iter().take(SAMPLE_VIOLATIONS).map(|v| v.to_string()));
    }
    Ok(RunTally { mode, outcomes, substituted: replay.substituted, violations, sample_violations })
}

impl Replay<'_> {
    fn page_size(&self) -> u32 {
        self.config.page_size
    }

    fn pages_for(&self, tokens: u32) -> usize {
        tokens.div_ceil(self.page_size()) as usize
    }

    /// Ends the oldest decoding request; false when none is left.
    fn finish_oldest(&mut self) -> Result<bool, SimError> {
        let Some((req, pages)) = self.in_flight.pop_front() else {
            return Ok(false);
        };
        self.decode.pool.free(&pages);
        if let Some(t) = &self.decode.table {
            t.release(req)?;
        }
        Ok(true)
    }

    /// One request end to end. The outer error is a replay that cannot go on; the inner one a
    /// request refused with an error.
    fn serve(&mut self, spec: &RequestSpec) -> Result<Result<Outcome, Refusal>, SimError> {
        // Decode: admit from its own copy, allocate pages for the full prompt.
        let n = self.pages_for(spec.prompt_tokens);
        while self.in_flight.len() >= self.config.decode_batch.max(1) || self.decode.pool.free_pages() < n {
            if !self.finish_oldest()? {
                break;
            }
        }
        let Some(dpages) = self.decode.pool.allocate(n) else {
            return Err(SimError::DecodePoolTooSmall { pages_needed: n as u64, pages: self.config.decode_pages });
        };
        let drefs = match self.decode_claim(spec, &dpages)? {
            Ok(refs) => refs,
            Err(r) => {
                self.decode.pool.free(&dpages);
                return Ok(Err(r));
            }
        };
        match self.prefill_and_transfer(spec, &dpages, &drefs)? {
            Ok(()) => {}
            Err(r) => {
                self.end_decode(spec.id, &dpages)?;
                return Ok(Err(r));
            }
        }
        match self.check_attention(spec, &drefs)? {
            Ok(()) => {}
            Err(r) => {
                self.end_decode(spec.id, &dpages)?;
                return Ok(Err(r));
            }
        }
        let outcome = attend(&self.decode.pool, spec, &dpages);
        self.in_flight.push_back((spec.id, dpages));
        Ok(Ok(outcome))
    }

    fn end_decode(&mut self, req: RequestId, pages: &[PageId]) -> Result<(), SimError> {
        self.decode.pool.free(pages);
        if let Some(t) = &self.decode.table {
            t.release(req)?;
        }
        Ok(())
    }

    fn decode_claim(&self, spec: &RequestSpec, pages: &[PageId]) -> Result<Result<Vec<PageRef>, Refusal>, SimError> {
        let Some(t) = &self.decode.table else {
            return Ok(Ok(pages.iter().map(|&page| PageRef { page, generation: Generation::FIRST }).collect()));
        };
        if let Err(e) = t.admit(spec.id, spec.tenant, u64::from(spec.prompt_tokens), u64::from(spec.max_new_tokens)) {
            return Refusal::from_error(e).map(Err);
        }
        match t.claim(spec.id, pages) {
            Ok(refs) => Ok(Ok(refs)),
            Err(e) => {
                t.release(spec.id)?;
                Refusal::from_error(e).map(Err)
            }
        }
    }

    /// Prefill writes the prompt's KV (or a dummy's) and sends it into the decode pages.
    fn prefill_and_transfer(
        &mut self,
        spec: &RequestSpec,
        dpages: &[PageId],
        drefs: &[PageRef],
    ) -> Result<Result<(), Refusal>, SimError> {
        let layers = self.layers;
        let admission = layers.is_some_and(|l| l.admission);
        let prompt_pages = self.pages_for(spec.prompt_tokens);
        if admission && let Some(t) = &self.prefill.table {
            // Layer 1: kvguard sees the real prompt before the engine can substitute anything.
            if let Err(e) = t.admit(spec.id, spec.tenant, u64::from(spec.prompt_tokens), 0) {
                return Refusal::from_error(e).map(Err);
            }
        }
        // The engine's own behaviour: a prompt its pool cannot hold becomes a one-token dummy.
        let prefilled: Vec<u32> = if prompt_pages > self.config.prefill_pages as usize {
            self.substituted += 1;
            vec![DUMMY_TOKEN]
        } else {
            spec.prompt()
        };
        let tokens = prefilled.len() as u32;
        if !admission && let Some(t) = &self.prefill.table {
            // Without the admission layer kvguard only sees what the engine chose to prefill.
            if let Err(e) = t.admit(spec.id, spec.tenant, u64::from(tokens), 0) {
                return Refusal::from_error(e).map(Err);
            }
        }
        let Some(ppages) = self.prefill.pool.allocate(self.pages_for(tokens)) else {
            return Err(SimError::Kvguard(Error::OutOfPages {
                requested: self.pages_for(tokens) as u64,
                free: self.prefill.pool.free_pages() as u64,
            }));
        };
        if let Some(t) = &self.prefill.table {
            t.claim(spec.id, &ppages)?;
        }
        let ps = self.page_size();
        for (i, &tok) in prefilled.iter().enumerate() {
            let i = i as u32;
            self.prefill.pool.write(ppages[(i / ps) as usize], i % ps, SlotKv::new(tok, spec.id, spec.tenant));
        }
        if let Some(t) = &self.prefill.table {
            t.record_write_tokens(spec.id, &ppages, 0..u64::from(tokens))?;
        }
        let result = self.transfer(spec, &prefilled, &ppages, dpages, drefs);
        self.prefill.pool.free(&ppages);
        if let Some(t) = &self.prefill.table {
            t.release(spec.id)?;
        }
        result
    }

    /// The transfer of `ppages` (prefill) into the decode pages, checked by the manifest layer.
    fn transfer(
        &mut self,
        spec: &RequestSpec,
        prefilled: &[u32],
        ppages: &[PageId],
        dpages: &[PageId],
        drefs: &[PageRef],
    ) -> Result<Result<(), Refusal>, SimError> {
        let tokens = prefilled.len() as u32;
        let ps = self.page_size();
        let prefill_pool = &self.prefill.pool;
        let sent: Vec<&[u8]> = ppages
            .iter()
            .enumerate()
            .map(|(k, &p)| prefill_pool.page_bytes(p, tokens_in_page(u64::from(tokens), ps, k)))
            .collect();
        let canary = self.layers.is_some_and(|l| l.canary);
        let decode_pool = &mut self.decode.pool;
        let mut land = |page: PageRef, bytes: &[u8]| {
            decode_pool.land(page.page, bytes);
            if canary {
                decode_pool.stamp(spec.id, page, (bytes.len() / SLOT_BYTES as usize) as u32);
            }
        };
        // Decode told prefill where to write: the first pages of the full prompt's pages.
        let dest = &drefs[..sent.len().min(drefs.len())];
        match (&self.decode.table, self.layers) {
            (Some(t), Some(l)) if l.manifest => {
                let header = TransferHeader {
                    request: spec.id,
                    tenant: spec.tenant,
                    sender: PREFILL_SENDER,
                    page_size: self.config.page_size,
                    slot_bytes: SLOT_BYTES,
                };
                let manifest = match Manifest::build(header, prefilled, dest, &sent) {
                    Ok(m) => m.encode(),
                    Err(e) => return Err(SimError::Build(e)),
                };
                let prompt = spec.prompt();
                let expected = ExpectedTransfer::for_prompt(
                    spec.id,
                    spec.tenant,
                    &prompt,
                    drefs,
                    self.config.page_size,
                    SLOT_BYTES,
                )
                .from_sender(PREFILL_SENDER);
                match Receiver::new(t).accept(&expected, &manifest, &sent, |_, page, bytes| {
                    land(page, bytes);
                    Ok(())
                }) {
                    Ok(_) => Ok(Ok(())),
                    Err(e) => Ok(Err(Refusal { kind: e.kind(), message: format!("{}: {e}", e.kind().as_str()) })),
                }
            }
            (table, _) => {
                // No manifest: the transport lands what arrived; the table learns which slots.
                for (&page, bytes) in dest.iter().zip(&sent) {
                    land(page, bytes);
                }
                if let Some(t) = table {
                    t.record_write_tokens(spec.id, &dpages[..dest.len()], 0..u64::from(tokens))?;
                }
                Ok(Ok(()))
            }
        }
    }

    /// The checks before attention runs: the table's read verification and the device canary.
    fn check_attention(&self, spec: &RequestSpec, drefs: &[PageRef]) -> Result<Result<(), Refusal>, SimError> {
        let (Some(t), Some(layers)) = (&self.decode.table, self.layers) else {
            return Ok(Ok(()));
        };
        if layers.table
            && let Err(e) = t.verify_read_refs(spec.id, drefs, u64::from(spec.prompt_tokens))
        {
            return Refusal::from_error(e).map(Err);
        }
        if layers.canary {
            let ps = self.page_size();
            for i in 0..spec.prompt_tokens {
                let (k, slot) = ((i / ps) as usize, i % ps);
                let page = drefs[k];
                if !self.decode.pool.canary_matches(spec.id, page, slot) {
                    let v = Violation::new(ViolationKind::CanaryMismatch, Op::Read)
                        .with_request(spec.id, Some(spec.tenant))
                        .with_page(page.page, Some(page.generation))
                        .with_block_index(k as u32)
                        .with_slots(slot, slot + 1);
                    t.record_violation(v.clone());
                    return Ok(Err(Refusal { kind: v.kind(), message: v.to_string() }));
                }
            }
        }
        Ok(Ok(()))
    }
}

/// Attention over the prompt's slots, and the response derived from what they hold.
fn attend(pool: &KvPool, spec: &RequestSpec, pages: &[PageId]) -> Outcome {
    let ps = pool.page_size();
    let (me, my_tenant) = (spec.id.0 as u32, spec.tenant.0 as u32);
    let mut faithful = true;
    let (mut foreign, mut cross, mut victims) = (0u64, 0u64, 0u32);
    let mut last = None;
    let mut first = None;
    for i in 0..spec.prompt_tokens {
        let kv = pool.read(pages[(i / ps) as usize], i % ps);
        if kv.request == me && kv.tenant == my_tenant {
            faithful &= kv.token == spec.token(i);
            continue;
        }
        faithful = false;
        if kv.request == 0 {
            continue; // never written: garbage, but nobody's data
        }
        foreign += 1;
        if kv.tenant != my_tenant {
            cross += 1;
        }
        if last != Some(kv.request) {
            last = Some(kv.request);
            victims = (victims + 1).min(1000);
        }
        first.get_or_insert((RequestId(u64::from(kv.request)), TenantId(u64::from(kv.tenant))));
    }
    let leak =
        first.map(|first_victim| Leak { foreign_slots: foreign, cross_tenant_slots: cross, victims, first_victim });
    Outcome::Served { leak, faithful }
}
