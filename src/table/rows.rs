//! An engine's block table read in place, row by row, and checked incrementally across steps.
//!
//! An engine keeps one block table for all its running requests (vLLM's `block_table`, SGLang's
//! `req_to_token`): one row per request slot, `stride` int32 page ids a row. Each step, attention
//! reads row `r` up to `tokens` tokens for the request that holds the row. A [`RowCache`] keeps,
//! per row, the entries that were last checked clean, for which request, how many tokens, and the
//! request's [epoch](super::state::RequestRecord::epoch) then. While the epoch holds, nothing was
//! taken from that request (no page left it, lost coverage or became shared, no prefix was let
//! go; a shared page of a prefix it holds changed neither: the table's `shared_epoch`), so an
//! entry checked clean for `n` slots is still clean for them. A row whose earlier entries are
//! unchanged, byte for byte, is then judged only from the page its checked tokens ended in: a
//! decode step costs a comparison of the row and one page's check, not a check of every page.
//! Anything else (another request in the row, an entry changed behind the engine's calls, fewer
//! tokens, the epoch moved on) is judged in full, as [`verify_step`](OwnershipTable::verify_step)
//! would; so is any row whose incremental check finds something wrong, so every refusal carries
//! the full check's violation. The verdicts are the full check's, step for step
//! (`tests/it/table_rows.rs` holds them equal over random operation sequences).

use super::OwnershipTable;
use super::state::{BlockEntry, RequestRecord, TableState};
use super::step::StepVerdict;
use crate::ids::{Generation, PageId, RequestId};
use crate::violation::Violation;
use std::sync::atomic::Ordering;

/// An int32 block-table entry: a page id; a negative one names no page (it is read as a page
/// past any pool, and refused as `page_out_of_range`).
impl BlockEntry for i32 {
    #[inline(always)]
    fn page(self) -> PageId {
        PageId(self as u32)
    }
    #[inline(always)]
    fn generation(self) -> Option<Generation> {
        None
    }
    #[inline(always)]
    fn entry(page: PageId, _: Generation) -> Self {
        page.0 as i32
    }
}

/// Why a step's rows could not be read: the block table's shape, or a row it does not have.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RowsError {
    /// The entries are not whole rows of `stride`, or `stride` is 0 with entries.
    #[error("a block table of {len} entries is not rows of {stride}")]
    Shape {
        /// Entries given.
        len: usize,
        /// Entries per row.
        stride: usize,
    },
    /// A read names a row past the table.
    #[error("read {index} names row {row}: the block table has {rows} rows")]
    Row {
        /// The read's index in the step.
        index: usize,
        /// The row it named.
        row: u32,
        /// Rows in the table.
        rows: usize,
    },
}

/// An engine's block table as attention reads it, in place: rows of `stride` int32 page ids.
///
/// ```
/// # use kvguard::BlockRows;
/// let entries = [3, 4, -1, 7, 8, 9];
/// let rows = BlockRows::new(&entries, 3).unwrap();
/// assert_eq!(rows.rows(), 2);
/// assert!(BlockRows::new(&entries, 4).is_err());
/// ```
#[derive(Clone, Copy, Debug)]
pub struct BlockRows<'a> {
    entries: &'a [i32],
    stride: usize,
}

impl<'a> BlockRows<'a> {
    /// `entries` as rows of `stride` entries ([`RowsError::Shape`] unless they are whole rows).
    pub fn new(entries: &'a [i32], stride: usize) -> Result<BlockRows<'a>, RowsError> {
        let whole = if stride == 0 { entries.is_empty() } else { entries.len().is_multiple_of(stride) };
        if !whole {
            return Err(RowsError::Shape { len: entries.len(), stride });
        }
        Ok(BlockRows { entries, stride })
    }

    /// How many rows.
    pub fn rows(&self) -> usize {
        self.entries.len().checked_div(self.stride).unwrap_or(0)
    }

    /// Entries per row.
    pub fn width(&self) -> usize {
        self.stride
    }

    /// Row `row` (in range: the caller checked).
    pub(crate) fn row(&self, row: usize) -> &'a [i32] {
        &self.entries[row * self.stride..(row + 1) * self.stride]
    }
}

/// One row attention reads in a step: `request` reads the first `tokens` tokens through row
/// `row` of the block table.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowRead {
    /// The reading request.
    pub request: RequestId,
    /// Its row in the block table.
    pub row: u32,
    /// Tokens read: `0..tokens`.
    pub tokens: u64,
}

/// What a row was last checked clean as (see the module docs).
#[derive(Clone, Debug)]
struct Checked {
    request: RequestId,
    epoch: u64,
    shared_epoch: u64,
    tokens: u64,
    /// The row's entries that were read: those covering `tokens`.
    entries: Vec<i32>,
}

/// Per row of an engine's block table, what was last checked clean: what makes
/// [`OwnershipTable::verify_rows`] incremental. One per block table; it belongs to one table
/// (given to another, it starts over). Memory: the read entries of each row, 4 bytes a page.
#[derive(Debug, Default)]
pub struct RowCache {
    table: u64,
    rows: Vec<Option<Checked>>,
    incremental: u64,
    full: u64,
}

impl RowCache {
    /// An empty cache: the first step checks every row in full.
    pub fn new() -> RowCache {
        RowCache::default()
    }

    /// Rows judged incrementally (from their last clean page) since the cache was made.
    pub fn incremental(&self) -> u64 {
        self.incremental
    }

    /// Rows judged in full since the cache was made.
    pub fn full(&self) -> u64 {
        self.full
    }

    /// Forgets every row: the next step checks each in full.
    pub fn clear(&mut self) {
        self.rows.clear();
    }
}

impl TableState {
    /// `read` of `row` for `rec` (its record, `None` if unknown): from its last clean page if
    /// `cached` allows, else in full; `cached` becomes what was checked clean, or nothing.
    fn check_row(
        &self,
        cached: &mut Option<Checked>,
        rec: Option<&RequestRecord>,
        read: &RowRead,
        row: &[i32],
        counts: (&mut u64, &mut u64),
    ) -> Result<(), Violation> {
        let (incremental, full) = counts;
        let ps = u64::from(self.page_size);
        let (req, tokens) = (read.request, read.tokens);
        if let (Some(rec), Some(c)) = (rec, cached.as_mut())
            && c.request == req
            && c.epoch == rec.epoch
            && c.shared_epoch == self.shared_epoch
            && c.tokens <= tokens
        {
            // Entries `..from` were checked whole; the one at `from` (if any) only in part. The
            // window `from..read` is what this step reads anew: usually one page, two where a
            // page filled.
            let from = self.page_div.floor(c.tokens) as usize;
            let read = self.page_div.ceil(tokens) as usize;
            if read <= row.len()
                && row[..from] == c.entries[..from]
                && !rec.quarantined.load(Ordering::Relaxed)
                && self.window_clean(rec, req, &row[from..read], tokens - from as u64 * ps)
            {
                c.entries.truncate(from);
                c.entries.extend_from_slice(&row[from..read]);
                c.tokens = tokens;
                *incremental += 1;
                return Ok(());
            }
        }
        *full += 1;
        match self.check_read_of(rec, req, row, tokens) {
            Ok(()) => {
                let rec = rec.expect("a clean read has a record");
                let read = self.page_div.ceil(tokens) as usize;
                let c = cached.get_or_insert_with(|| Checked {
                    request: req,
                    epoch: 0,
                    shared_epoch: 0,
                    tokens: 0,
                    entries: Vec::new(),
                });
                c.request = req;
                c.epoch = rec.epoch;
                c.shared_epoch = self.shared_epoch;
                c.tokens = tokens;
                c.entries.clear();
                c.entries.extend_from_slice(&row[..read]);
                Ok(())
            }
            Err(v) => {
                *cached = None;
                Err(v)
            }
        }
    }
}

impl TableState {
    /// Whether `req` may read `tokens` tokens through `window`, the entries a row reads beyond
    /// those checked clean before (which hold `tokens` within them): each page's own check, as
    /// the full read's (a refusal is judged again in full, for its violation).
    #[inline]
    fn window_clean(&self, rec: &RequestRecord, req: RequestId, window: &[i32], tokens: u64) -> bool {
        let last = window.len().saturating_sub(1);
        let tail = self.page_div.offset(tokens) as u32;
        window.iter().enumerate().all(|(k, &entry)| {
            let need = if k == last && tail > 0 { tail } else { self.page_size };
            self.check_entry(rec, req, k, entry, need).is_ok()
        })
    }
}

impl OwnershipTable {
    /// [`check_rows`](Self::check_rows), judged: every refused row is counted, logged and
    /// (enforce) quarantined, as [`verify_step`](Self::verify_step) does.
    ///
    /// ```
    /// # use kvguard::{BlockRows, OwnershipTable, PageId, PoolConfig, RequestId, RowCache, RowRead, TenantId};
    /// let table = OwnershipTable::new(PoolConfig::new(64, 16, 1024)).unwrap();
    /// let req = RequestId(1);
    /// table.admit(req, TenantId(1), 100, 100).unwrap();
    /// let pages: Vec<PageId> = table.allocate(req, 2).unwrap().iter().map(|r| r.page).collect();
    /// table.record_write_tokens(req, &pages, 0..20).unwrap();
    /// // The engine's block table: row 5 is this request's.
    /// let mut entries = vec![-1i32; 8 * 4];
    /// entries[5 * 4] = pages[0].0 as i32;
    /// entries[5 * 4 + 1] = pages[1].0 as i32;
    /// let mut cache = RowCache::new();
    /// let step = [RowRead { request: req, row: 5, tokens: 20 }];
    /// let rows = BlockRows::new(&entries, 4).unwrap();
    /// assert!(table.verify_rows(&mut cache, rows, &step).unwrap().is_clean()); // in full
    /// table.record_write_tokens(req, &pages, 20..21).unwrap();
    /// let step = [RowRead { request: req, row: 5, tokens: 21 }];
    /// assert!(table.verify_rows(&mut cache, rows, &step).unwrap().is_clean()); // one page
    /// assert_eq!((cache.full(), cache.incremental()), (1, 1));
    /// ```
    pub fn verify_rows(
        &self,
        cache: &mut RowCache,
        rows: BlockRows<'_>,
        reads: &[RowRead],
    ) -> Result<StepVerdict, RowsError> {
        self.rows_step(cache, rows, reads, true)
    }

    /// A decode step's reads through the engine's own block table, checked as
    /// [`check_step`](Self::check_step) would check them (the same verdict, row for row), but
    /// incrementally: a row judged clean before, still held by the same request, whose entries
    /// read then are unchanged and from whom nothing was taken since, is judged only from the
    /// page its last check ended in (see the module docs of `table::rows`). Pure: counts, logs
    /// and quarantines nothing. [`RowsError`] (nothing checked, `cache` unchanged) if a read
    /// names a row past the table.
    pub fn check_rows(
        &self,
        cache: &mut RowCache,
        rows: BlockRows<'_>,
        reads: &[RowRead],
    ) -> Result<StepVerdict, RowsError> {
        self.rows_step(cache, rows, reads, false)
    }

    fn rows_step(
        &self,
        cache: &mut RowCache,
        rows: BlockRows<'_>,
        reads: &[RowRead],
        judged: bool,
    ) -> Result<StepVerdict, RowsError> {
        let n = rows.rows();
        if let Some((index, r)) = reads.iter().enumerate().find(|(_, r)| r.row as usize >= n) {
            return Err(RowsError::Row { index, row: r.row, rows: n });
        }
        if cache.table != self.id() {
            cache.rows.clear();
            cache.table = self.id();
        }
        if cache.rows.len() < n {
            cache.rows.resize(n, None);
        }
        let state = self.state.read();
        let mut verdict = StepVerdict::default();
        let RowCache { rows: cached, incremental, full, .. } = cache;
        for (i, read) in reads.iter().enumerate() {
            let rec = state.requests.get(&read.request);
            let row = rows.row(read.row as usize);
            let slot = &mut cached[read.row as usize];
            if let Err(v) = state.check_row(slot, rec, read, row, (&mut *incremental, &mut *full)) {
                if judged {
                    self.note(&state, &v);
                }
                verdict.refused.push((i, v));
            }
        }
        Ok(verdict)
    }
}

#[cfg(test)]
mod tests {
    //! Each way a right to read is taken, against a row the engine left as it was: the row was
    //! clean, nothing in it changed, and the next step (one token more) must still be refused
    //! where the full check refuses it.
    use crate::{
        BlockRows, OwnershipTable, PageId, PoolConfig, PrefixKey, RequestId, RowCache, RowRead, TenantId, ViolationKind,
    };

    const PS: u32 = 4;
    const STRIDE: usize = 8;
    const A: RequestId = RequestId(1);
    const B: RequestId = RequestId(2);

    /// A publishes two written pages under key 9; B holds them and two pages of its own, 14 of
    /// its 16 tokens written. B's row (row 3) is its block table.
    struct Setup {
        table: OwnershipTable,
        shared: Vec<PageId>,
        own: Vec<PageId>,
        entries: Vec<i32>,
        cache: RowCache,
    }

    fn setup() -> Setup {
        let table = OwnershipTable::new(PoolConfig::new(32, PS, 64)).unwrap();
        table.admit(A, TenantId(1), 8, 0).unwrap();
        table.admit(B, TenantId(1), 16, 8).unwrap();
        let shared: Vec<PageId> = table.allocate(A, 2).unwrap().iter().map(|r| r.page).collect();
        table.record_write_tokens(A, &shared, 0..8).unwrap();
        table.publish_prefix(A, PrefixKey(9), &shared).unwrap();
        table.attach_prefix(B, PrefixKey(9)).unwrap();
        let own: Vec<PageId> = table.allocate(B, 2).unwrap().iter().map(|r| r.page).collect();
        let row: Vec<PageId> = shared.iter().chain(&own).copied().collect();
        table.record_write_tokens(B, &row, 8..14).unwrap();
        let mut entries = vec![-1i32; 4 * STRIDE];
        for (e, p) in entries[3 * STRIDE..].iter_mut().zip(&row) {
            *e = p.0 as i32;
        }
        Setup { table, shared, own, entries, cache: RowCache::new() }
    }

    impl Setup {
        /// B reads `tokens` through row 3: the verdict's kind and block index, if refused.
        fn read(&mut self, tokens: u64) -> Option<(ViolationKind, Option<u32>)> {
            let rows = BlockRows::new(&self.entries, STRIDE).unwrap();
            let step = [RowRead { request: B, row: 3, tokens }];
            let v = self.table.check_rows(&mut self.cache, rows, &step).unwrap();
            v.refused.first().map(|(_, v)| (v.kind(), v.block_index()))
        }

        /// B's row clean at 13 tokens, then at 14 from its last page alone.
        fn clean(mut self) -> Setup {
            assert_eq!(self.read(13), None);
            assert_eq!(self.read(14), None);
            assert_eq!((self.cache.full(), self.cache.incremental()), (1, 1));
            self
        }
    }

    #[test]
    fn a_prefix_let_go_is_refused_in_a_row_left_as_it_was() {
        let mut s = setup().clean();
        s.table.detach_prefix(B, PrefixKey(9)).unwrap();
        assert_eq!(s.read(14), Some((ViolationKind::ForeignPage, Some(0))));
    }

    #[test]
    fn pages_released_are_refused_in_a_row_left_as_it_was() {
        let mut s = setup().clean();
        s.table.release_pages(B, &s.own[..1]).unwrap();
        assert_eq!(s.read(14), Some((ViolationKind::FreedPage, Some(2))));
    }

    #[test]
    fn a_preempted_request_is_refused_in_a_row_left_as_it_was() {
        let mut s = setup().clean();
        s.table.preempt(B).unwrap();
        assert_eq!(s.read(14), Some((ViolationKind::ForeignPage, Some(0))));
    }

    #[test]
    fn an_overwritten_page_is_refused_in_a_row_left_as_it_was() {
        let mut s = setup().clean();
        // A transfer of A's wrote into B's first own page.
        s.table.record_overwritten(A, &s.own[..1]);
        assert_eq!(s.read(14), Some((ViolationKind::UnwrittenSlots, Some(2))));
    }

    #[test]
    fn a_held_prefix_evicted_by_force_is_refused_in_a_row_left_as_it_was() {
        let mut s = setup().clean();
        assert!(s.table.force_evict_prefix(PrefixKey(9)));
        assert_eq!(s.read(14), Some((ViolationKind::FreedPage, Some(0))));
    }

    #[test]
    fn a_shared_page_taken_by_force_is_refused_in_a_row_left_as_it_was() {
        let mut s = setup().clean();
        s.table.admit(RequestId(3), TenantId(2), 4, 0).unwrap();
        assert_eq!(s.table.force_claim(RequestId(3), &s.shared[1..]), 1);
        assert_eq!(s.read(14), Some((ViolationKind::ForeignPage, Some(1))));
    }

    #[test]
    fn a_page_published_by_its_reader_takes_nothing_and_reads_on_incrementally() {
        let mut s = setup().clean();
        s.table.publish_prefix(B, PrefixKey(10), &s.own[..1]).unwrap();
        assert_eq!(s.read(14), None);
        assert_eq!((s.cache.full(), s.cache.incremental()), (1, 2), "B holds what it published");
    }

    #[test]
    fn a_request_preempted_holding_only_a_prefix_is_refused_in_a_row_left_as_it_was() {
        let mut s = setup();
        s.table.release_pages(B, &s.own).unwrap();
        s.entries[3 * STRIDE + 2..4 * STRIDE].fill(-1);
        assert_eq!(s.read(7), None);
        assert_eq!(s.read(8), None);
        s.table.preempt(B).unwrap(); // no page of its own: only its hold goes
        assert_eq!(s.read(8), Some((ViolationKind::ForeignPage, Some(0))));
    }

    #[test]
    fn a_request_released_and_admitted_again_under_its_id_starts_over() {
        let mut s = setup().clean();
        s.table.release(B).unwrap();
        s.table.admit(B, TenantId(1), 16, 8).unwrap();
        assert_eq!(s.read(14), Some((ViolationKind::ForeignPage, Some(0))));
    }

    #[test]
    fn an_entry_changed_behind_the_engine_is_judged_in_full() {
        let mut s = setup().clean();
        s.entries[3 * STRIDE] = s.own[1].0 as i32; // a page of B's own, in the prefix's place
        assert_eq!(s.read(14), Some((ViolationKind::UnwrittenSlots, Some(0))));
        assert_eq!(s.cache.full(), 2);
    }

    #[test]
    fn a_row_past_the_table_is_an_error_and_checks_nothing() {
        let mut s = setup();
        let rows = BlockRows::new(&s.entries, STRIDE).unwrap();
        let step = [RowRead { request: B, row: 3, tokens: 4 }, RowRead { request: B, row: 4, tokens: 4 }];
        let e = s.table.check_rows(&mut s.cache, rows, &step).unwrap_err();
        assert_eq!(e, super::RowsError::Row { index: 1, row: 4, rows: 4 });
        assert_eq!(s.cache.full() + s.cache.incremental(), 0);
    }
}
