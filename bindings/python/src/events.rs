//! A step's ownership events, applied in one call (`OwnershipTable.apply_events`).
//!
//! A scheduler step makes a handful of ownership decisions (admissions, claims, frees, prefix
//! publishes, hits and evictions); one Python→Rust call per decision costs more than the
//! decision itself. The events are read from a list of tuples under the GIL (every one checked
//! before any is applied, so malformed input changes nothing), turned into the core's typed
//! batch (`kvguard::step::EventBatch`, request and tenant strings interned) and applied by the
//! core (`OwnershipTable::apply_events`) with the GIL released, judged as the single-event
//! methods judge them.
//!
//! ```text
//! ("admit",   request, tenant, prompt_tokens, max_new_tokens)
//! ("claim",   request, pages)
//! ("release", request)
//! ("preempt", request)
//! ("publish", request, key, pages)
//! ("attach",  request, key)
//! ("detach",  request, key)
//! ("evict",   request or None, key)   request: whose allocation made the cache drop `key`
//!                                      (not read: the table evicts either way)
//! ("release_pages", request, pages)    the request lets go of these pages and keeps the rest
//! ```

use crate::names::{self, Key, Names, Resolved, StepIds};
use crate::violation::Violation;
use kvguard::step::EventBatch;
use kvguard::{PageId, PrefixKey, RequestId};
use parking_lot::Mutex;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyList, PyString, PyTuple};

/// A request or tenant id read from an event, owned so the events outlive the GIL.
#[derive(Clone, Debug)]
enum OwnedKey {
    Int(u64),
    Name(Box<str>),
}

impl OwnedKey {
    fn read(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<OwnedKey> {
        Ok(match names::key(obj, what)? {
            Key::Int(n) => OwnedKey::Int(n),
            Key::Name(s) => OwnedKey::Name(s.into()),
        })
    }

    fn key(&self) -> Key<'_> {
        match self {
            OwnedKey::Int(n) => Key::Int(*n),
            OwnedKey::Name(s) => Key::Name(s),
        }
    }
}

/// What one event does.
#[derive(Debug)]
enum Op {
    Admit { tenant: OwnedKey, prompt_tokens: u64, max_new_tokens: u64 },
    Claim(Vec<PageId>),
    Release,
    Preempt,
    Publish(PrefixKey, Vec<PageId>),
    Attach(PrefixKey),
    Detach(PrefixKey),
    Evict(PrefixKey),
    ReleasePages(Vec<PageId>),
}

/// One ownership event of a step.
#[derive(Debug)]
pub struct Event {
    /// None only for an eviction nobody is charged with.
    request: Option<OwnedKey>,
    op: Op,
}

/// A refused event: its index in the list, the violation, and the violation's ids as they read
/// when it was refused (a released request's string is forgotten right after).
pub type RefusedEvent = (usize, kvguard::Violation, Resolved);

/// The refused events as Python sees them: `[(index, Violation)]`.
pub type RefusedForPython = Vec<(usize, Py<Violation>)>;

/// An event that failed with an error that is not a violation: its index and the error, after
/// the events refused before it.
pub struct EventError {
    /// Index of the failing event.
    pub index: usize,
    /// The core's error.
    pub error: kvguard::Error,
    /// Refusals of the events before it.
    pub refused: Vec<RefusedEvent>,
}

/// A page list: a list or tuple of ints read directly (what a recorder builds), else any 1-D int
/// array.
fn page_ids(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<PageId>> {
    let page = |i: usize, item: Bound<'_, PyAny>| -> PyResult<PageId> {
        let v = item
            .extract::<i64>()
            .map_err(|_| PyTypeError::new_err(format!("{name}[{i}] must be an int, got a {}", item.get_type())))?;
        u32::try_from(v)
            .map(PageId)
            .map_err(|_| PyValueError::new_err(format!("{name}[{i}] is {v}: page ids are ints in 0..2**32")))
    };
    if let Ok(list) = obj.cast::<PyList>() {
        return list.iter().enumerate().map(|(i, item)| page(i, item)).collect();
    }
    if let Ok(tuple) = obj.cast::<PyTuple>() {
        return tuple.iter().enumerate().map(|(i, item)| page(i, item)).collect();
    }
    let a = crate::arrays::IntArray::open(obj, name, 1)?;
    (0..a.len())
        .map(|i| {
            let v = a.get(i, 0);
            u32::try_from(v)
                .map(PageId)
                .map_err(|_| PyValueError::new_err(format!("{name}[{i}] is {v}: page ids are ints in 0..2**32")))
        })
        .collect()
}

fn arity(tuple: &Bound<'_, PyTuple>, i: usize, op: &str, want: usize, shape: &str) -> PyResult<()> {
    if tuple.len() != want {
        return Err(PyValueError::new_err(format!("events[{i}] ({op}) has {} items: expected {shape}", tuple.len())));
    }
    Ok(())
}

/// Reads a list (or any sequence) of event tuples; every one is checked before any is applied.
pub fn parse(events: &Bound<'_, PyAny>) -> PyResult<Vec<Event>> {
    let items = events.try_iter().map_err(|_| PyTypeError::new_err("events must be a sequence of event tuples"))?;
    let mut out = Vec::new();
    for (i, item) in items.enumerate() {
        let item = item?;
        let tuple = item
            .cast::<PyTuple>()
            .map_err(|_| PyTypeError::new_err(format!("events[{i}] must be a tuple, got a {}", item.get_type())))?;
        if tuple.is_empty() {
            return Err(PyValueError::new_err(format!("events[{i}] is empty")));
        }
        let head = tuple.get_item(0)?;
        let head = head.cast::<PyString>().map_err(|_| {
            PyTypeError::new_err(format!("events[{i}][0] must be the event's name (a str), got a {}", head.get_type()))
        })?;
        let name = head.to_str()?;
        let at = |j: usize| tuple.get_item(j);
        let request = |what: &str| -> PyResult<OwnedKey> { OwnedKey::read(&at(1)?, what) };
        let key = |j: usize| -> PyResult<PrefixKey> {
            at(j)?.extract::<u64>().map(PrefixKey).map_err(|_| {
                PyValueError::new_err(format!("events[{i}] ({name}): the prefix key must be an int in 0..2**64"))
            })
        };
        let (request, op) = match name {
            "admit" => {
                arity(tuple, i, name, 5, "(\"admit\", request, tenant, prompt_tokens, max_new_tokens)")?;
                let count = |j: usize, what: &str| -> PyResult<u64> {
                    at(j)?.extract::<u64>().map_err(|_| {
                        PyValueError::new_err(format!("events[{i}] (admit): {what} must be a non-negative int"))
                    })
                };
                let tenant = OwnedKey::read(&at(2)?, "tenant")?;
                let op = Op::Admit {
                    tenant,
                    prompt_tokens: count(3, "prompt_tokens")?,
                    max_new_tokens: count(4, "max_new_tokens")?,
                };
                (Some(request("request")?), op)
            }
            "claim" => {
                arity(tuple, i, name, 3, "(\"claim\", request, pages)")?;
                (Some(request("request")?), Op::Claim(page_ids(&at(2)?, "pages")?))
            }
            "release" | "preempt" => {
                arity(tuple, i, name, 2, "(name, request)")?;
                (Some(request("request")?), if name == "release" { Op::Release } else { Op::Preempt })
            }
            "publish" => {
                arity(tuple, i, name, 4, "(\"publish\", request, key, pages)")?;
                (Some(request("request")?), Op::Publish(key(2)?, page_ids(&at(3)?, "pages")?))
            }
            "attach" | "detach" => {
                arity(tuple, i, name, 3, "(name, request, key)")?;
                let k = key(2)?;
                (Some(request("request")?), if name == "attach" { Op::Attach(k) } else { Op::Detach(k) })
            }
            "release_pages" => {
                arity(tuple, i, name, 3, "(\"release_pages\", request, pages)")?;
                (Some(request("request")?), Op::ReleasePages(page_ids(&at(2)?, "pages")?))
            }
            "evict" => {
                arity(tuple, i, name, 3, "(\"evict\", request or None, key)")?;
                let r = at(1)?;
                let r = if r.is_none() { None } else { Some(OwnedKey::read(&r, "request")?) };
                (r, Op::Evict(key(2)?))
            }
            other => {
                return Err(PyValueError::new_err(format!(
                    "events[{i}]: unknown event {other:?} (admit, claim, release, preempt, publish, attach, detach, evict, release_pages)"
                )));
            }
        };
        out.push(Event { request, op });
    }
    Ok(out)
}

/// [`parse`] of an optional list: None (or Python's None) is no events.
pub fn parse_optional(events: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<Event>> {
    match events {
        Some(e) if !e.is_none() => parse(e),
        _ => Ok(Vec::new()),
    }
}

/// A step's events as a worker step takes them: read straight into the core's batch (a step
/// that admits and releases nothing, in the plain form a recorder builds: [`StepEvents::read`]),
/// or parsed in full.
pub enum StepEvents {
    /// The core's batch, its names resolved as they read when it was read.
    Batch(EventBatch),
    /// Parsed events (names read as the core applies them).
    Parsed(Vec<Event>),
}

impl StepEvents {
    /// No events.
    pub fn none() -> StepEvents {
        StepEvents::Batch(EventBatch::new())
    }

    /// Reads `events` (None, Python's None, or a sequence of event tuples): through
    /// [`plain_batch`] when it can, else [`parse`] (which raises for what is malformed).
    pub fn read(events: Option<&Bound<'_, PyAny>>, names: &Mutex<Names>) -> PyResult<StepEvents> {
        StepEvents::read_in(events, names, None, EventBatch::new())
    }

    /// [`read`](Self::read) into the memory of `room` (a batch kept from the step before).
    pub fn read_in(
        events: Option<&Bound<'_, PyAny>>,
        names: &Mutex<Names>,
        ids: Option<&Mutex<StepIds>>,
        mut room: EventBatch,
    ) -> PyResult<StepEvents> {
        match events {
            Some(e) if !e.is_none() => match plain_batch(e, names, ids, room) {
                Some(batch) => Ok(StepEvents::Batch(batch)),
                None => Ok(StepEvents::Parsed(parse(e)?)),
            },
            _ => {
                room.clear();
                Ok(StepEvents::Batch(room))
            }
        }
    }

    /// Whether applying them may change which id a str request reads as (see [`renames`]).
    pub fn renames(&self) -> bool {
        match self {
            StepEvents::Batch(_) => false,
            StepEvents::Parsed(events) => renames(events),
        }
    }

    /// The core's batch of events that do not rename, names read now (see [`batch`]).
    pub fn batch(self, names: &Names) -> Option<EventBatch> {
        match self {
            StepEvents::Batch(b) => Some(b),
            StepEvents::Parsed(events) => batch(names, &events),
        }
    }

    /// Applies them as [`apply`] does (no Python code runs: call it with the GIL released).
    pub fn apply(
        &self,
        table: &kvguard::OwnershipTable,
        names: &Mutex<Names>,
    ) -> Result<Vec<RefusedEvent>, Box<EventError>> {
        match self {
            StepEvents::Batch(b) => resolve_applied(names, table.apply_events(b.events())),
            StepEvents::Parsed(events) => apply(table, names, events),
        }
    }
}

/// `events` read straight into the core's batch, each request named as it reads now: what
/// [`batch`] makes of [`parse`]'s events, without an owned copy of every event (the common
/// step's claims, publishes, hits and evictions). `None` when an event admits or releases a
/// request, or is not in the plain form a recorder builds: the events an exact `list` or
/// `tuple` of exact tuples, each headed by its name (a `str`, an enum's member too), ids exact
/// `int`s (`0..2**63`) or `str`s, keys exact `int`s (`0..2**64`), page lists exact lists or
/// tuples of exact `int`s (`0..2**32`). The caller then parses them in full, which reads the
/// other forms and raises for the malformed. Only C code runs while the names are locked (no
/// method of an object is called: every type read is exact, or a `str`'s C-level data).
///
/// The batch is made in the memory of `room` (what it held is dropped): a worker step refills
/// the same batch step after step, allocating nothing once it has room.
///
/// A request named by the very object a step's req_ids held (`ids`, the worker step's
/// remembered ids, when no other thread holds them) is found by its address, its string unread.
pub fn plain_batch(
    events: &Bound<'_, PyAny>,
    names: &Mutex<Names>,
    ids: Option<&Mutex<StepIds>>,
    room: EventBatch,
) -> Option<EventBatch> {
    // Room for one page an event (a decode step's claims and publishes): a batch that fills
    // without reallocating.
    let len = match events.cast_exact::<PyList>() {
        Ok(list) => list.len(),
        Err(_) => events.cast_exact::<PyTuple>().ok()?.len(),
    };
    let mut b = room;
    b.clear();
    b.reserve(len, len);
    let mut pages: Vec<PageId> = Vec::new();
    let mut n = names.lock();
    let mut ids = ids.and_then(|m| m.try_lock());
    if let Some(ids) = ids.as_deref_mut() {
        n.catch_up(ids);
    }
    let (n, ids, interned) = (&*n, ids.as_deref(), n.interned());
    let mut one = |item: Bound<'_, PyAny>| -> Option<()> {
        let tuple = item.cast_exact::<PyTuple>().ok()?;
        let at = |j: usize| tuple.get_borrowed_item(j).ok();
        let head = at(0)?;
        let head = head.cast::<PyString>().ok()?;
        let name = head.to_str().ok()?;
        let request = |obj: &Bound<'_, PyAny>| -> Option<RequestId> {
            // By address first: a remembered object (an exact int or str) is not read at all.
            if let Some(known) = ids.and_then(|ids| ids.known(obj.as_ptr(), interned)) {
                Some(known)
            } else if obj.is_exact_instance_of::<PyInt>() {
                let v = obj.extract::<i64>().ok()?;
                u64::try_from(v).ok().map(RequestId)
            } else {
                Some(n.request(Key::Name(obj.cast::<PyString>().ok()?.to_str().ok()?)))
            }
        };
        let key = |obj: &Bound<'_, PyAny>| -> Option<PrefixKey> {
            if !obj.is_exact_instance_of::<PyInt>() {
                return None;
            }
            obj.extract::<u64>().ok().map(PrefixKey)
        };
        match (name, tuple.len()) {
            ("claim" | "release_pages", 3) => {
                let r = request(&*at(1)?)?;
                plain_pages(&*at(2)?, &mut pages)?;
                if name == "claim" {
                    b.claim(r, &pages)
                } else {
                    b.release_pages(r, &pages)
                };
            }
            ("publish", 4) => {
                let r = request(&*at(1)?)?;
                let k = key(&*at(2)?)?;
                plain_pages(&*at(3)?, &mut pages)?;
                b.publish(r, k, &pages);
            }
            ("attach" | "detach", 3) => {
                let r = request(&*at(1)?)?;
                let k = key(&*at(2)?)?;
                if name == "attach" {
                    b.attach(r, k)
                } else {
                    b.detach(r, k)
                };
            }
            ("preempt", 2) => {
                b.preempt(request(&*at(1)?)?);
            }
            ("evict", 3) => {
                let charged = at(1)?;
                if !charged.is_none() {
                    request(&charged)?; // read as parse reads it, not used
                }
                b.evict(key(&*at(2)?)?);
            }
            _ => return None,
        }
        Some(())
    };
    if let Ok(list) = events.cast_exact::<PyList>() {
        for item in list.iter() {
            one(item)?;
        }
    } else {
        for item in events.cast_exact::<PyTuple>().ok()?.iter() {
            one(item)?;
        }
    }
    Some(b)
}

/// A page list in the plain form (an exact list or tuple of exact ints in `0..2**32`) into
/// `out`; `None` for anything else.
fn plain_pages(obj: &Bound<'_, PyAny>, out: &mut Vec<PageId>) -> Option<()> {
    out.clear();
    let page = |item: Bound<'_, PyAny>| -> Option<PageId> {
        if !item.is_exact_instance_of::<PyInt>() {
            return None;
        }
        u32::try_from(item.extract::<i64>().ok()?).ok().map(PageId)
    };
    if let Ok(list) = obj.cast_exact::<PyList>() {
        for item in list.iter() {
            out.push(page(item)?);
        }
    } else {
        for item in obj.cast_exact::<PyTuple>().ok()?.iter() {
            out.push(page(item)?);
        }
    }
    Some(())
}

/// Whether applying `events` may change which id a str request reads as (an admission interns
/// it, a release forgets it).
pub fn renames(events: &[Event]) -> bool {
    events.iter().any(|e| matches!(e.op, Op::Admit { .. } | Op::Release))
}

/// The request and tenant strings a segment's events name, interned as they will read when the
/// core applies them: a segment ends before an event whose ids an earlier event of the segment
/// changes (a request it admits or releases, or after a release, a string tenant an admission
/// names, which the release may forget).
struct Segment {
    /// Events `start..end` of the list.
    end: usize,
    /// The admissions' interned ids, in order (index into the list, admission).
    admissions: Vec<(usize, names::Admission)>,
}

/// Builds the core's batch of `events[start..]` up to the segment's end (see [`Segment`]),
/// interning as [`apply`]'s single calls would.
fn segment(names: &mut Names, events: &[Event], start: usize, batch: &mut EventBatch) -> Segment {
    batch.clear();
    let mut touched: Vec<&str> = Vec::new();
    let mut released = false;
    let mut admissions = Vec::new();
    let mut end = start;
    for event in &events[start..] {
        let name = match &event.request {
            Some(OwnedKey::Name(s)) => Some(&**s),
            _ => None,
        };
        let cuts = name.is_some_and(|n| touched.contains(&n))
            || (released && matches!(&event.op, Op::Admit { tenant: OwnedKey::Name(_), .. }));
        if cuts && end > start {
            break;
        }
        let request = event.request.as_ref().map_or(names::UNKNOWN_REQUEST, |k| names.request(k.key()));
        match &event.op {
            Op::Admit { tenant, prompt_tokens, max_new_tokens } => {
                let key = event.request.as_ref().map_or(Key::Int(names::UNKNOWN_REQUEST.0), OwnedKey::key);
                let a = names.admit(key, tenant.key());
                batch.admit(a.request, a.tenant, *prompt_tokens, *max_new_tokens);
                admissions.push((end, a));
                touched.extend(name);
            }
            Op::Claim(pages) => {
                batch.claim(request, pages);
            }
            Op::Release => {
                batch.release(request);
                touched.extend(name);
                released |= name.is_some();
            }
            Op::Preempt => {
                batch.preempt(request);
            }
            Op::Publish(key, pages) => {
                batch.publish(request, *key, pages);
            }
            Op::Attach(key) => {
                batch.attach(request, *key);
            }
            Op::Detach(key) => {
                batch.detach(request, *key);
            }
            Op::Evict(key) => {
                batch.evict(*key);
            }
            Op::ReleasePages(pages) => {
                batch.release_pages(request, pages);
            }
        }
        end += 1;
    }
    Segment { end, admissions }
}

/// Applies `events` in order through the core's [`OwnershipTable::apply_events`] (no Python
/// code runs: call it with the GIL released), in as few batches as their names allow. Returns
/// the refused events, or the first error that is not a violation (the events after it are not
/// applied).
///
/// [`OwnershipTable::apply_events`]: kvguard::OwnershipTable::apply_events
pub fn apply(
    table: &kvguard::OwnershipTable,
    names: &Mutex<Names>,
    events: &[Event],
) -> Result<Vec<RefusedEvent>, Box<EventError>> {
    let mut refused: Vec<RefusedEvent> = Vec::new();
    let mut batch = EventBatch::new();
    let mut start = 0;
    while start < events.len() {
        let seg = segment(&mut names.lock(), events, start, &mut batch);
        let applied = table.apply_events(batch.events());
        // The names follow what the table did, event by event: each refusal resolved as the ids
        // read when it was refused, then the event's own effect on the names.
        let stop = applied.failed.as_ref().map_or(seg.end - start, |(k, _)| *k);
        let mut n = names.lock();
        let mut violations = applied.refused.into_iter().peekable();
        let mut admissions = seg.admissions.into_iter().peekable();
        for k in 0..(seg.end - start).min(stop + 1) {
            let mut was_refused = false;
            while let Some((_, v)) = violations.next_if(|(j, _)| *j == k) {
                let r = n.resolve(&v);
                refused.push((start + k, v, r));
                was_refused = true;
            }
            if let Some((_, a)) = admissions.next_if(|(j, _)| *j == start + k) {
                if was_refused || k == stop { n.refused(a) } else { n.admitted(a) }
            }
            if matches!(events[start + k].op, Op::Release) {
                n.forget(batch.events().request(k));
            }
        }
        // Admissions past a failure were interned and never applied.
        for (_, a) in admissions {
            n.refused(a);
        }
        drop(n);
        if let Some((k, error)) = applied.failed {
            return Err(Box::new(EventError { index: start + k, error, refused }));
        }
        start = seg.end;
    }
    Ok(refused)
}

/// The core's batch of `events`, every request read as it reads now; `None` if an event
/// admits or releases a request ([`renames`]: those go through [`apply`]).
pub fn batch(names: &Names, events: &[Event]) -> Option<EventBatch> {
    let pages = events
        .iter()
        .map(|e| match &e.op {
            Op::Claim(p) | Op::Publish(_, p) | Op::ReleasePages(p) => p.len(),
            _ => 0,
        })
        .sum();
    let mut b = EventBatch::with_capacity(events.len(), pages);
    for event in events {
        let request = event.request.as_ref().map_or(names::UNKNOWN_REQUEST, |k| names.request(k.key()));
        match &event.op {
            Op::Admit { .. } | Op::Release => return None,
            Op::Claim(pages) => b.claim(request, pages),
            Op::Preempt => b.preempt(request),
            Op::Publish(key, pages) => b.publish(request, *key, pages),
            Op::Attach(key) => b.attach(request, *key),
            Op::Detach(key) => b.detach(request, *key),
            Op::Evict(key) => b.evict(*key),
            Op::ReleasePages(pages) => b.release_pages(request, pages),
        };
    }
    Some(b)
}

/// The refused events of a batch that renamed nothing, resolved now; its failure, if any.
pub fn resolve_applied(
    names: &Mutex<Names>,
    applied: kvguard::step::AppliedEvents,
) -> Result<Vec<RefusedEvent>, Box<EventError>> {
    let n = names.lock();
    let refused: Vec<RefusedEvent> = applied
        .refused
        .into_iter()
        .map(|(i, v)| {
            let r = n.resolve(&v);
            (i, v, r)
        })
        .collect();
    match applied.failed {
        Some((index, error)) => Err(Box::new(EventError { index, error, refused })),
        None => Ok(refused),
    }
}
