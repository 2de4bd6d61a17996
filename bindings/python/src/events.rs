//! A step's ownership events, applied in one call (`OwnershipTable.apply_events`).
//!
//! A scheduler step makes a handful of ownership decisions (admissions, claims, frees, prefix
//! publishes, hits and evictions); one Python→Rust call per decision costs more than the
//! decision itself. The events are read from a list of tuples under the GIL (every one checked
//! before any is applied, so malformed input changes nothing), then applied in order with the
//! GIL released, each through the core call its single-event method makes, judged the same way;
//! a run of consecutive claims goes to the core as one `claim_step` (one lock).
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
//!                                      (reported with a refusal; the table evicts either way)
//! ```

use crate::names::{self, Key, Names, Resolved};
use crate::violation::Violation;
use kvguard::{PageId, PrefixKey, RequestId, SeqClaim};
use parking_lot::Mutex;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyList, PyString, PyTuple};

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
            "evict" => {
                arity(tuple, i, name, 3, "(\"evict\", request or None, key)")?;
                let r = at(1)?;
                let r = if r.is_none() { None } else { Some(OwnedKey::read(&r, "request")?) };
                (r, Op::Evict(key(2)?))
            }
            other => {
                return Err(PyValueError::new_err(format!(
                    "events[{i}]: unknown event {other:?} (admit, claim, release, preempt, publish, attach, detach, evict)"
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

/// Whether applying `events` may change which id a str request reads as (an admission interns
/// it, a release forgets it).
pub fn renames(events: &[Event]) -> bool {
    events.iter().any(|e| matches!(e.op, Op::Admit { .. } | Op::Release))
}

/// Applies `events` in order (no Python code runs: call it with the GIL released). Returns the
/// refused events, or the first error that is not a violation (the events after it are not
/// applied).
pub fn apply(
    table: &kvguard::OwnershipTable,
    names: &Mutex<Names>,
    events: &[Event],
) -> Result<Vec<RefusedEvent>, Box<EventError>> {
    let mut refused: Vec<RefusedEvent> = Vec::new();
    let request_of = |e: &Event| -> RequestId {
        e.request.as_ref().map_or(names::UNKNOWN_REQUEST, |k| names.lock().request(k.key()))
    };
    let mut i = 0;
    while i < events.len() {
        let event = &events[i];
        let outcome: Result<(), kvguard::Error> = match &event.op {
            Op::Claim(_) => {
                // The run of claims starting here, under one lock.
                let end =
                    events[i..].iter().position(|e| !matches!(e.op, Op::Claim(_))).map_or(events.len(), |n| i + n);
                let claims: Vec<SeqClaim<'_>> = {
                    let n = names.lock();
                    events[i..end]
                        .iter()
                        .map(|e| SeqClaim {
                            request: e.request.as_ref().map_or(names::UNKNOWN_REQUEST, |k| n.request(k.key())),
                            pages: match &e.op {
                                Op::Claim(p) => p,
                                _ => &[],
                            },
                        })
                        .collect()
                };
                let verdict = table.claim_step(&claims);
                if !verdict.refused.is_empty() {
                    let n = names.lock();
                    refused.extend(verdict.refused.into_iter().map(|(k, v)| {
                        let r = n.resolve(&v);
                        (i + k, v, r)
                    }));
                }
                i = end;
                continue;
            }
            Op::Admit { tenant, prompt_tokens, max_new_tokens } => {
                let key = event.request.as_ref().map_or(Key::Int(names::UNKNOWN_REQUEST.0), OwnedKey::key);
                let a = names.lock().admit(key, tenant.key());
                match table.admit(a.request, a.tenant, *prompt_tokens, *max_new_tokens) {
                    Ok(()) => {
                        names.lock().admitted(a);
                        Ok(())
                    }
                    Err(e) => {
                        let mut n = names.lock();
                        if let kvguard::Error::Violation(v) = &e {
                            let r = n.resolve(v);
                            refused.push((i, v.clone(), r));
                        }
                        n.refused(a);
                        match e {
                            kvguard::Error::Violation(_) => Ok(()),
                            other => Err(other),
                        }
                    }
                }
            }
            Op::Release => {
                let req = request_of(event);
                let out = table.release(req);
                let mut n = names.lock();
                let out = match out {
                    Err(kvguard::Error::Violation(v)) => {
                        let r = n.resolve(&v);
                        refused.push((i, v, r));
                        Ok(())
                    }
                    other => other.map(drop),
                };
                n.forget(req);
                out
            }
            Op::Preempt => table.preempt(request_of(event)).map(drop),
            Op::Publish(key, pages) => table.publish_prefix(request_of(event), *key, pages),
            Op::Attach(key) => table.attach_prefix(request_of(event), *key).map(drop),
            Op::Detach(key) => table.detach_prefix(request_of(event), *key).map(drop),
            Op::Evict(key) => table.evict_prefix(*key).map(drop),
        };
        match outcome {
            Ok(()) => {}
            Err(kvguard::Error::Violation(v)) => {
                let r = names.lock().resolve(&v);
                refused.push((i, v, r));
            }
            Err(error) => return Err(Box::new(EventError { index: i, error, refused })),
        }
        i += 1;
    }
    Ok(refused)
}
