//! The forensic summary: which requests read KV that other requests wrote, through reads the
//! replay refused — the question an operator must answer after an incident (whose data went to
//! whom).

use crate::ids::{RequestId, TenantId};
use serde::Serialize;
use std::collections::HashMap;
use std::sync::Arc;

/// Distinct (reader, writer) pairs kept; further pairs are only counted
/// ([`LeakSummary::pairs_dropped`]), so memory stays bounded whatever the trace.
pub const MAX_LEAK_PAIRS: usize = 1 << 16;

/// KV one request wrote that another read through refused reads.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Leak {
    /// The request that read.
    pub reader: u64,
    /// Its tenant, as the trace names it.
    #[serde(serialize_with = "name")]
    pub reader_tenant: Option<Arc<str>>,
    /// The request whose writes it read (`None`: several, or one never admitted).
    pub writer: u64,
    /// The writer's tenant, as the trace names it (`None` when unknown).
    #[serde(serialize_with = "name")]
    pub writer_tenant: Option<Arc<str>>,
    /// Token slots read, summed over the refused reads (a slot read twice counts twice).
    pub slots: u64,
    /// Refused reads that reached the writer's KV.
    pub reads: u64,
    /// The first such read's line.
    pub first_line: u64,
}

fn name<S: serde::Serializer>(n: &Option<Arc<str>>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_some(&n.as_deref())
}

impl Leak {
    /// Whether reader and writer are of different tenants (or either tenant is unknown).
    pub fn cross_tenant(&self) -> bool {
        match (&self.reader_tenant, &self.writer_tenant) {
            (Some(r), Some(w)) => r != w,
            _ => true,
        }
    }
}

/// Every [`Leak`] of a replay, in order of first line.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LeakSummary {
    /// The pairs, in order of first line.
    pub leaks: Vec<Leak>,
    /// Pairs beyond [`MAX_LEAK_PAIRS`], counted but not kept.
    pub pairs_dropped: u64,
}

impl LeakSummary {
    /// Pairs whose reader and writer are of different tenants.
    pub fn cross_tenant(&self) -> impl Iterator<Item = &Leak> {
        self.leaks.iter().filter(|l| l.cross_tenant())
    }
}

/// The running tally behind a [`LeakSummary`].
#[derive(Debug, Default)]
pub(crate) struct Leaks {
    index: HashMap<(RequestId, RequestId), usize>,
    leaks: Vec<Leak>,
    dropped: u64,
    /// The line whose read was last counted per pair, so one read counts once in `reads`.
    last_line: Vec<u64>,
}

impl Leaks {
    /// `reader` read `slots` slots `writer` wrote, on `line`; tenant names are resolved by the
    /// caller once, when the pair is new.
    pub fn add(
        &mut self,
        line: u64,
        reader: (RequestId, TenantId),
        writer: (RequestId, TenantId),
        slots: u64,
        name: impl Fn(TenantId) -> Option<Arc<str>>,
    ) {
        let key = (reader.0, writer.0);
        let at = match self.index.get(&key) {
            Some(&at) => at,
            None if self.leaks.len() >= MAX_LEAK_PAIRS => {
                self.dropped += 1;
                return;
            }
            None => {
                self.leaks.push(Leak {
                    reader: reader.0.0,
                    reader_tenant: name(reader.1),
                    writer: writer.0.0,
                    writer_tenant: name(writer.1),
                    slots: 0,
                    reads: 0,
                    first_line: line,
                });
                self.last_line.push(0);
                self.index.insert(key, self.leaks.len() - 1);
                self.leaks.len() - 1
            }
        };
        let leak = &mut self.leaks[at];
        leak.slots = leak.slots.saturating_add(slots);
        if self.last_line[at] != line {
            self.last_line[at] = line;
            leak.reads += 1;
        }
    }

    pub fn summary(&self) -> LeakSummary {
        LeakSummary { leaks: self.leaks.clone(), pairs_dropped: self.dropped }
    }
}
