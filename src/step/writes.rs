//! A step's KV writes as an engine's slot-mapping kernel computes them from its block table rows
//! (vLLM's `_compute_slot_mapping`): request `i` writes positions `computed[i]..computed[i] +
//! scheduled[i]`, position `p` to slot `row[min(p / page_size, width - 1)] * page_size + p %
//! page_size`.

use super::counts::{Count, with_count_slices};
use super::{Counts, StepError};
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
        computed: Counts<'_>,
        scheduled: Counts<'_>,
        config: &PoolConfig,
    ) -> Result<StepSlots, StepError> {
        let mut slots = StepSlots::default();
        slots.fill_from_rows(rows, computed, scheduled, config)?;
        Ok(slots)
    }

    /// Empty slots in the room of `slots` and `bounds` (what they held is dropped).
    pub(crate) fn in_room((mut slots, mut bounds): (Vec<i64>, Vec<usize>)) -> StepSlots {
        slots.clear();
        bounds.clear();
        StepSlots { slots, bounds }
    }

    /// Their room, for the next step's [`in_room`](Self::in_room).
    pub(crate) fn into_room(self) -> (Vec<i64>, Vec<usize>) {
        (self.slots, self.bounds)
    }

    /// [`from_rows`](Self::from_rows) into these slots' memory (what they held is dropped,
    /// their room kept): an engine's step refills one `StepSlots` step after step, with no
    /// allocation once it has room for a step. On an error they are left empty.
    pub(crate) fn fill_from_rows(
        &mut self,
        rows: BlockRows<'_>,
        computed: Counts<'_>,
        scheduled: Counts<'_>,
        config: &PoolConfig,
    ) -> Result<(), StepError> {
        self.slots.clear();
        self.bounds.clear();
        StepSlots::check(rows, computed, scheduled, config)?;
        let width = rows.width();
        let StepSlots { slots, bounds } = self;
        bounds.reserve(scheduled.len() + 1);
        bounds.push(0usize);
        let mut sum = 0usize;
        for s in scheduled {
            sum += s as usize;
            bounds.push(sum);
        }
        slots.reserve(sum);
        if width == 0 {
            slots.resize(sum, i64::MAX);
            return Ok(());
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
        let rows = rows.entries().chunks_exact(width);
        with_count_slices!(computed, scheduled, |computed, scheduled| fill(rows, computed, scheduled, &slot, slots));
        Ok(())
    }

    /// What [`from_rows`](Self::from_rows) refuses, found without building anything: counts
    /// not as long as each other or more than the rows, a request writing more than a row (or
    /// the pool) addresses, a position past `u64`, a step writing more than the pool's slots.
    pub fn check(
        rows: BlockRows<'_>,
        computed: Counts<'_>,
        scheduled: Counts<'_>,
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
        let (too_many, overflow, total) = with_count_slices!(computed, scheduled, |c, s| scan(c, s, most));
        if let Some(index) = too_many {
            return Err(StepError::TooManyTokens { index, tokens: scheduled.get(index), most });
        }
        if let Some(index) = overflow {
            return Err(StepError::Overflow { index, computed: computed.get(index), scheduled: scheduled.get(index) });
        }
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

/// The slots of each row's positions `computed[i]..computed[i] + scheduled[i]` (none
/// overflows: checked), in row order.
fn fill<C: Count, S: Count>(
    rows: std::slice::ChunksExact<'_, i32>,
    computed: &[C],
    scheduled: &[S],
    slot: &impl Fn(&[i32], u64) -> i64,
    slots: &mut Vec<i64>,
) {
    for ((row, c), s) in rows.zip(computed).zip(scheduled) {
        let (c, s) = (c.count(), s.count());
        if s == 1 {
            // A decode step's one token: no range to walk.
            slots.push(slot(row, c));
        } else {
            slots.extend((c..c + s).map(|p| slot(row, p)));
        }
    }
}

/// One pass over a step's counts: the first request writing more than `most` tokens, the first
/// whose last position overflows, and the tokens of the step (saturating).
fn scan<C: Count, S: Count>(computed: &[C], scheduled: &[S], most: u64) -> (Option<usize>, Option<usize>, u64) {
    let (mut too_many, mut overflow, mut total) = (None, None, 0u64);
    for (i, (c, s)) in computed.iter().zip(scheduled).enumerate() {
        let (c, s) = (c.count(), s.count());
        if s > most && too_many.is_none() {
            too_many = Some(i);
        }
        if c.checked_add(s).is_none() && overflow.is_none() {
            overflow = Some(i);
        }
        total = total.saturating_add(s);
    }
    (too_many, overflow, total)
}
