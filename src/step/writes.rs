//! A step's KV writes as an engine's slot-mapping kernel computes them from its block table rows
//! (vLLM's `_compute_slot_mapping`): request `i` writes positions `computed[i]..computed[i] +
//! scheduled[i]`, position `p` to slot `row[min(p / page_size, width - 1)] * page_size + p %
//! page_size`.

use super::StepError;
use crate::config::{PageDiv, PoolConfig};
use crate::ids::RequestId;
use crate::table::{BlockRows, SeqWrite};

/// A step's slot mapping: request `i` wrote `slots[bounds[i]..bounds[i + 1]]`.
#[derive(Clone, Debug, Default)]
pub struct StepSlots {
    slots: Vec<i64>,
    bounds: Vec<usize>,
}

impl StepSlots {
    /// The slots row `i` of `rows` writes for `scheduled[i]` tokens from position `computed[i]`
    /// (both as long as each other, at most the rows there are, else [`StepError::Shape`]; a
    /// position past `u64` is [`StepError::Overflow`]). A request may write at most a
    /// row's width of pages (or the pool's pages, if fewer), and the step at most the pool's
    /// slots: more is [`StepError::TooManyTokens`] / [`StepError::PoolSlots`], checked before
    /// anything is allocated. A negative entry gives a slot no pool has (`i64::MIN`: refused
    /// when recorded, never taken for [`PADDING_SLOT`](crate::table::PADDING_SLOT)); a table of
    /// width 0 gives slots past any pool.
    pub fn from_rows(
        rows: BlockRows<'_>,
        computed: &[u64],
        scheduled: &[u64],
        config: &PoolConfig,
    ) -> Result<StepSlots, StepError> {
        StepSlots::check(rows, computed, scheduled, config)?;
        let width = rows.width();
        let mut bounds = Vec::with_capacity(scheduled.len() + 1);
        bounds.push(0usize);
        let mut sum = 0usize;
        for &s in scheduled {
            sum += s as usize;
            bounds.push(sum);
        }
        let mut slots = Vec::with_capacity(sum);
        if width == 0 {
            slots.resize(sum, i64::MAX);
            return Ok(StepSlots { slots, bounds });
        }
        let last = width as u64 - 1;
        let div = PageDiv::new(config.page_size);
        let ps = i64::from(config.page_size);
        let slot = |row: &[i32], p: u64| {
            let page = row[div.floor(p).min(last) as usize];
            if page < 0 { i64::MIN } else { i64::from(page) * ps + div.offset(p) as i64 }
        };
        // Row i is entries[i * width..][..width]: whole rows, at least as many as the counts
        // (checked).
        for ((row, &c), &s) in rows.entries().chunks_exact(width).zip(computed).zip(scheduled) {
            if s == 1 {
                // A decode step's one token: no range to walk.
                slots.push(slot(row, c));
            } else {
                slots.extend((c..c + s).map(|p| slot(row, p)));
            }
        }
        Ok(StepSlots { slots, bounds })
    }

    /// What [`from_rows`](Self::from_rows) refuses, found without building anything: counts
    /// not as long as each other or more than the rows, a request writing more than a row (or
    /// the pool) addresses, a position past `u64`, a step writing more than the pool's slots.
    pub fn check(
        rows: BlockRows<'_>,
        computed: &[u64],
        scheduled: &[u64],
        config: &PoolConfig,
    ) -> Result<(), StepError> {
        if computed.len() != scheduled.len() || computed.len() > rows.rows() {
            return Err(StepError::Shape {
                requests: computed.len(),
                computed: computed.len(),
                scheduled: scheduled.len(),
                rows: rows.rows(),
            });
        }
        let ps = u64::from(config.page_size);
        let pool = u64::from(config.num_pages) * ps;
        let most = (rows.width() as u64 * ps).min(pool);
        if let Some(index) = scheduled.iter().position(|&s| s > most) {
            return Err(StepError::TooManyTokens { index, tokens: scheduled[index], most });
        }
        if let Some(index) = computed.iter().zip(scheduled).position(|(c, s)| c.checked_add(*s).is_none()) {
            return Err(StepError::Overflow { index, computed: computed[index], scheduled: scheduled[index] });
        }
        let total = scheduled.iter().fold(0u64, |sum, &s| sum.saturating_add(s));
        if total > pool {
            return Err(StepError::PoolSlots { tokens: total, slots: pool });
        }
        Ok(())
    }

    /// The writes of `requests` (request `i` the slots of row `i`; as many as the rows given).
    pub fn writes<'a>(&'a self, requests: &[RequestId]) -> Vec<SeqWrite<'a>> {
        requests
            .iter()
            .zip(self.bounds.windows(2))
            .map(|(&request, w)| SeqWrite { request, slots: &self.slots[w[0]..w[1]] })
            .collect()
    }

    /// Every slot, in request order.
    pub fn slots(&self) -> &[i64] {
        &self.slots
    }

    /// Request `i`'s slots (`i` below the requests there are).
    pub(crate) fn of(&self, i: usize) -> &[i64] {
        &self.slots[self.bounds[i]..self.bounds[i + 1]]
    }
}
