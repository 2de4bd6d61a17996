//! An engine's block table read in place, row by row, and checked incrementally across steps.
//!
//! An engine keeps one block table for all its running requests (vLLM's `block_table`, SGLang's
//! `req_to_token`): one row per request slot, `stride` int32 page ids a row. Each step, attention
//! reads row `r` up to `tokens` tokens for the request that holds the row. A [`RowCache`] keeps,
//! per row, the entries that were last checked clean, for which request, how many tokens, and the
//! request's [epoch](super::state::RequestEpochs) then (with its request slot, where the table
//! keeps the epoch: no lookup by id). While the epoch holds, nothing was taken from that request
//! (no page left it, lost coverage or became shared, no prefix was let go; a shared page of a
//! prefix it holds changed neither: the table's `shared_epoch`), and it is not quarantined, so
//! an entry checked clean for `n` slots is still clean for them. A row whose earlier entries are
//! unchanged, byte for byte, is then judged only from the page its checked tokens ended in: a
//! decode step costs a comparison of the row and one page's check (its tag: the reader's
//! own page), not a check of every page. Anything else (another request in the row, an entry
//! changed behind the engine's calls, fewer tokens, the epoch moved on) is judged in full, as
//! [`verify_step`](OwnershipTable::verify_step) would; so is any row whose incremental check
//! finds something wrong, so every refusal carries the full check's violation. The verdicts are
//! the full check's, step for step (`tests/it/table_model.rs` holds them equal over random
//! operation sequences).

use super::OwnershipTable;
#[cfg(doc)]
use super::state::RequestRecord;
use super::state::{BlockEntry, RequestEpochs, TableState};
use super::step::StepVerdict;
use crate::ids::{Generation, PageId, RequestId};
use crate::violation::Violation;

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

impl RowsError {
    /// [`RowsError::Row`] for the first of a step's reads (their rows, in order) naming a row
    /// past a table of `n` rows; the rows' maximum first, one pass the compiler vectorizes, the
    /// offender looked for only when there is one. Shared by every step that reads rows.
    #[inline(always)]
    pub(crate) fn first_past(rows: impl Iterator<Item = u32> + Clone, n: usize) -> Result<(), RowsError> {
        if rows.clone().map(|r| r as usize).max().is_some_and(|last| last >= n)
            && let Some((index, row)) = rows.enumerate().find(|&(_, r)| r as usize >= n)
        {
            return Err(RowsError::Row { index, row, rows: n });
        }
        Ok(())
    }
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

    /// Every entry, row after row.
    pub(crate) fn entries(&self) -> &'a [i32] {
        self.entries
    }

    /// Row `row` (in range: the caller checked).
    pub(crate) fn row(&self, row: usize) -> &'a [i32] {
        &self.entries[row * self.stride..][..self.stride]
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

/// What a row was last checked clean as (see the module docs); its entries are the row's part
/// of [`RowCache::entries`].
#[derive(Clone, Copy, Debug)]
pub(super) struct RowHead {
    /// The request that read it.
    request: RequestId,
    /// Its word in [`RequestEpochs`] then (its epoch, not quarantined), or [`RowHead::NONE`].
    word: u64,
    /// The table's `shared_epoch` then.
    shared_epoch: u64,
    /// Tokens read.
    tokens: u64,
    /// Entries checked whole: `tokens / page_size`. The one after them was read in part (if
    /// `tokens` is not a page's end). At most the row's entries, which fit a `u32` in a block
    /// table the cache keeps (see `rows_step`).
    pub(super) whole: u32,
    /// Its request slot ([`RequestRecord::slot`]): where its word is.
    slot: u32,
}

// A head a row: kept to 40 bytes (what a step's scan reads of every row it judges).
const _: () = assert!(std::mem::size_of::<RowHead>() == 40);

impl RowHead {
    /// The word of a row nothing is known of: no slot's word is 0 (a live request's epoch is a
    /// tick, at least 1; a vacant slot's is odd).
    const NONE: u64 = 0;
    pub(super) const EMPTY: RowHead =
        RowHead { request: RequestId(0), word: Self::NONE, shared_epoch: 0, tokens: 0, whole: 0, slot: 0 };
}

/// Per row of an engine's block table, what was last checked clean: what makes
/// [`OwnershipTable::verify_rows`] incremental. One per block table; it belongs to one table
/// (given to another, or a block table of another width, it starts over). Laid out flat: a head
/// per row, and the entries of every row in one array, at the block table's own stride. Memory:
/// as much as the block table's rows (allocated zeroed, so the system backs only the pages rows
/// were read through), and 40 bytes a row; with [`OwnershipTable::engine_step`], the room of
/// its largest step's slot mapping (8 bytes a token written and 8 a request).
#[derive(Debug, Default)]
pub struct RowCache {
    table: u64,
    /// Entries per row, in `entries` as in the block table.
    stride: usize,
    heads: Vec<RowHead>,
    /// Row `r`'s entries last checked clean at `r * stride..`: those its head's tokens read.
    entries: Vec<i32>,
    incremental: u64,
    full: u64,
    /// The room of the engine step's slot mapping (its slots and their bounds; see
    /// `OwnershipTable::engine_step`), kept for the next step: a step allocates none once it
    /// has room.
    pub(crate) step_room: (Vec<i64>, Vec<usize>),
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
        self.heads.clear();
    }

    /// Room for `rows` rows of `stride` entries, of table `table`: forgets everything if the
    /// table or the stride changed, keeps the rows it knows if only more rows came.
    fn fit(&mut self, table: u64, rows: usize, stride: usize) {
        if self.table != table || self.stride != stride {
            self.table = table;
            self.stride = stride;
            self.heads.clear();
            self.entries = Vec::new();
        }
        if self.heads.len() < rows {
            self.heads.resize(rows, RowHead::EMPTY);
        }
        let len = rows * stride; // no more than the block table's entries
        if self.entries.len() < len {
            // Zeroed: a large one is mapped, not written, so only the rows read take memory.
            let mut grown = vec![0i32; len];
            grown[..self.entries.len()].copy_from_slice(&self.entries);
            self.entries = grown;
        }
    }
}

impl TableState {
    /// `read` of `row` (the engine's), from its last clean page if its `head` allows, else in
    /// full; `head` and `cached` (the row's entries in the cache) become what was checked clean,
    /// or nothing. Whether it was judged incrementally, and the verdict. `cached` is None for a
    /// row the guard holds ([`HeldBlockTable`](super::HeldBlockTable)): its entries change only
    /// through calls that forget its head, so there is nothing to compare.
    #[inline(always)]
    pub(super) fn check_row(
        &self,
        head: &mut RowHead,
        mut cached: Option<&mut [i32]>,
        read: &RowRead,
        row: &[i32],
    ) -> (bool, Result<(), Violation>) {
        let ps = u64::from(self.page_size);
        let (req, tokens) = (read.request, read.tokens);
        // The slot's word unchanged: the same record (ticks are unique), live, nothing taken
        // from it since, not quarantined.
        if head.request == req
            && head.tokens <= tokens
            && head.shared_epoch == self.shared_epoch
            && self.epochs.word(head.slot) == head.word
        {
            // Entries `..whole` were checked whole; the one at `whole` (if any) only in part.
            // What this step reads anew starts there: in a decode step that one page alone.
            let whole = head.whole as usize;
            // Tokens past the first of the page they end in (40 bytes a head: the page's first
            // token is not kept, a multiply away).
            let need = tokens.wrapping_sub(u64::from(head.whole) * ps);
            if need.wrapping_sub(1) < ps
                && let Some(&entry) = row.get(whole)
            {
                // Slots `0..need` of that page.
                let need = need as u32; // at most a page
                // The page first, while the table's fields are in registers; the comparison
                // (a call) after.
                if (self.own_page(req, entry, need) || self.entry_clean(req, whole, entry, need))
                    && cached.as_deref().is_none_or(|cached| row[..whole] == cached[..whole])
                {
                    if let Some(cached) = cached {
                        cached[whole] = entry;
                    }
                    head.tokens = tokens;
                    if need == self.page_size {
                        head.whole += 1;
                    }
                    return (true, Ok(()));
                }
            } else if self.window_clean(head, cached.as_deref_mut(), read, row) {
                return (true, Ok(()));
            }
        }
        let rec = self.requests.get(&req);
        let verdict = self.check_read_of(rec, req, row, tokens);
        match (&verdict, rec) {
            (Ok(()), Some(rec)) => {
                let whole = self.page_div.floor(tokens);
                if let Some(cached) = cached {
                    let upto = self.page_div.ceil(tokens) as usize;
                    cached[..upto].copy_from_slice(&row[..upto]);
                }
                *head = RowHead {
                    request: req,
                    word: self.epochs.word(rec.slot),
                    shared_epoch: self.shared_epoch,
                    tokens,
                    whole: whole as u32, // at most the row's entries
                    slot: rec.slot,
                };
            }
            _ => *head = RowHead::EMPTY,
        }
        (false, verdict)
    }

    /// Whether `req` (the request a row's head names, live and not quarantined: its word
    /// matched) may read slots `0..need` of `entry`'s page as its own page: owned by it and
    /// written as far as read, by its tag (the hot word's FULL bit only where the watermark
    /// lags, on a page written whole). The full check's verdict on the reader's own page; false
    /// for any other page (a prefix's is judged by [`check_entry`](Self::check_entry)). A
    /// decode step's page is the one its write just touched: one line, already in cache.
    #[inline(always)]
    fn own_page(&self, req: RequestId, entry: i32, need: u32) -> bool {
        let page = entry.page().0 as usize;
        self.tags.get(page).is_some_and(|tag| {
            tag.owned_by(req) && (tag.watermark() >= need || self.hot.get(page).is_some_and(|w| w.is_full()))
        })
    }

    /// Whether `req` may read slots `0..need` of `entry`'s page (entry `index` of its row), as
    /// the full read checks it (a page not the reader's own: a prefix's, or refused).
    #[cold]
    #[inline(never)]
    fn entry_clean(&self, req: RequestId, index: usize, entry: i32, need: u32) -> bool {
        self.requests.get(&req).is_some_and(|rec| self.check_entry(rec, req, index, entry, need).is_ok())
    }

    /// [`check_row`](Self::check_row) from a row's last clean page when it reads anew no page
    /// or more than that page (a step of no token, or of several): the entries checked before
    /// unchanged, each page read anew checked as the full read checks it (a refusal is judged
    /// again in full, for its violation). The row's `head` and `cached` entries updated if
    /// clean.
    #[inline(never)]
    fn window_clean(&self, head: &mut RowHead, cached: Option<&mut [i32]>, read: &RowRead, row: &[i32]) -> bool {
        let (whole, tokens) = (head.whole as usize, read.tokens);
        let upto = self.page_div.ceil(tokens) as usize;
        if upto > row.len() || cached.as_deref().is_some_and(|cached| row[..whole] != cached[..whole]) {
            return false;
        }
        let window = &row[whole..upto];
        let last = window.len().saturating_sub(1);
        let tail = self.page_div.offset(tokens) as u32;
        let need = |k: usize| if k == last && tail > 0 { tail } else { self.page_size };
        let clean = window.iter().enumerate().all(|(k, &entry)| self.own_page(read.request, entry, need(k)))
            || self.requests.get(&read.request).is_some_and(|rec| {
                window
                    .iter()
                    .enumerate()
                    .all(|(k, &entry)| self.check_entry(rec, read.request, k, entry, need(k)).is_ok())
            });
        if clean {
            if let Some(cached) = cached {
                cached[whole..upto].copy_from_slice(window);
            }
            let now = self.page_div.floor(tokens);
            // At most the row's entries.
            (head.tokens, head.whole) = (tokens, now as u32);
        }
        clean
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
        self.rows_by(cache, rows, reads.len(), |i| reads[i], judged)
    }

    /// [`rows_step`](Self::rows_step) of the `count` reads `read(0..count)`, made as they are
    /// judged (the engine step's reads need no list of their own).
    pub(crate) fn rows_by(
        &self,
        cache: &mut RowCache,
        rows: BlockRows<'_>,
        count: usize,
        read: impl Fn(usize) -> RowRead,
        judged: bool,
    ) -> Result<StepVerdict, RowsError> {
        let n = rows.rows();
        RowsError::first_past((0..count).map(|i| read(i).row), n)?;
        let stride = rows.width();
        if u32::try_from(stride).is_err() {
            let reads: Vec<RowRead> = (0..count).map(read).collect();
            return Ok(self.rows_in_full(cache, rows, &reads, judged));
        }
        cache.fit(self.id(), n, stride);
        let state = self.state.read();
        let mut verdict = StepVerdict::default();
        let RowCache { heads, entries, incremental, full, .. } = cache;
        let mut in_full = 0;
        for i in 0..count {
            let read = read(i);
            let r = read.row as usize; // in range: checked above
            let row = rows.row(r);
            let cached = &mut entries[r * stride..][..stride];
            let (fast, checked) = state.check_row(&mut heads[r], Some(cached), &read, row);
            in_full += u64::from(!fast);
            if let Err(v) = checked {
                if judged {
                    self.note(&state, &v);
                }
                verdict.refused.push((i, v));
            }
        }
        *full += in_full;
        *incremental += count as u64 - in_full;
        Ok(verdict)
    }

    /// [`rows_step`](Self::rows_step) for rows of 2^32 entries or more (16 GiB each), longer
    /// than a row's head counts: nothing kept, each read checked in full.
    #[cold]
    #[inline(never)]
    fn rows_in_full(&self, cache: &mut RowCache, rows: BlockRows<'_>, reads: &[RowRead], judged: bool) -> StepVerdict {
        cache.clear();
        cache.full += reads.len() as u64;
        let state = self.state.read();
        let mut verdict = StepVerdict::default();
        for (i, read) in reads.iter().enumerate() {
            let row = rows.row(read.row as usize); // in range: the caller checked
            if let Err(v) = state.check_read_of(state.requests.get(&read.request), read.request, row, read.tokens) {
                if judged {
                    self.note(&state, &v);
                }
                verdict.refused.push((i, v));
            }
        }
        verdict
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
    fn a_quarantined_request_is_refused_in_a_row_left_as_it_was() {
        let mut s = setup().clean();
        // B reads a free page elsewhere: refused, and (enforce) quarantined.
        assert!(s.table.verify_read(B, &[PageId(31)], 1).is_err());
        assert_eq!(s.read(14), Some((ViolationKind::Quarantined, None)));
    }

    /// B's own three pages in row 3, nine tokens written, its row clean at 8 tokens (from its
    /// last page: two whole) and at 9.
    fn own_pages_only() -> (Setup, Vec<PageId>) {
        let table = OwnershipTable::new(PoolConfig::new(32, PS, 64)).unwrap();
        table.admit(B, TenantId(1), 12, 0).unwrap();
        let own: Vec<PageId> = table.allocate(B, 3).unwrap().iter().map(|r| r.page).collect();
        table.record_write_tokens(B, &own, 0..9).unwrap();
        let mut entries = vec![-1i32; 4 * STRIDE];
        for (e, p) in entries[3 * STRIDE..].iter_mut().zip(&own) {
            *e = p.0 as i32;
        }
        let mut s = Setup { table, shared: Vec::new(), own: own.clone(), entries, cache: RowCache::new() };
        assert_eq!(s.read(7), None);
        assert_eq!(s.read(8), None);
        assert_eq!(s.read(9), None);
        assert_eq!((s.cache.full(), s.cache.incremental()), (1, 2));
        (s, own)
    }

    #[test]
    fn a_released_requests_row_read_again_is_refused() {
        let (mut s, _) = own_pages_only();
        assert_eq!(s.read(8), None); // fewer tokens: in full, clean, at two whole pages
        s.table.release(B).unwrap();
        // The same tokens: nothing read anew, only the row's entries compared.
        assert_eq!(s.read(8), Some((ViolationKind::UnknownRequest, None)));
    }

    #[test]
    fn a_reused_request_slot_does_not_pass_on_its_old_occupants_row() {
        let (mut s, own) = own_pages_only();
        // B goes; C takes B's request slot, and B's pages, written whole.
        let c = RequestId(3);
        s.table.release(B).unwrap();
        s.table.admit(c, TenantId(1), 12, 0).unwrap();
        assert_eq!(s.table.state.read().requests.get(&c).expect("C is admitted").slot, 0, "C took B's slot");
        s.table.claim(c, &own).unwrap();
        s.table.record_write_tokens(c, &own, 0..12).unwrap();
        // B's row as B left it: its pages now C's, whole, held by the slot B had.
        assert_eq!(s.read(10), Some((ViolationKind::UnknownRequest, None)));
        // Read by C, the row is C's to read.
        let rows = BlockRows::new(&s.entries, STRIDE).unwrap();
        let step = [RowRead { request: c, row: 3, tokens: 10 }];
        assert!(s.table.check_rows(&mut s.cache, rows, &step).unwrap().is_clean());
    }

    #[test]
    fn an_entry_changed_behind_the_engine_is_judged_in_full() {
        let mut s = setup().clean();
        s.entries[3 * STRIDE] = s.own[1].0 as i32; // a page of B's own, in the prefix's place
        assert_eq!(s.read(14), Some((ViolationKind::UnwrittenSlots, Some(0))));
        assert_eq!(s.cache.full(), 2);
    }

    #[test]
    fn an_entry_changed_behind_the_engine_is_judged_in_full_whatever_is_read_anew() {
        // Two pages read anew (from 4 tokens to 9), then none (9 again).
        for (before, after) in [(4, 9), (9, 9)] {
            let (mut s, _) = own_pages_only();
            assert_eq!(s.read(before), None);
            s.entries[3 * STRIDE] = 31; // a free page
            assert_eq!(s.read(after), Some((ViolationKind::FreedPage, Some(0))), "{before} then {after}");
        }
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

/// Where a request's right to read stood at one moment: its request slot's epoch word and the
/// table's `shared_epoch`. While a request's stamp is unchanged nothing was taken from it (see
/// the module docs), so what a check found clean at one stamp is still clean at the same stamp.
/// Crate-internal: what [`SlotRowCache`](crate::step::SlotRowCache) keeps per row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ReadStamp {
    word: u64,
    shared_epoch: u64,
}

impl OwnershipTable {
    /// Each request's [`ReadStamp`] now, in one read of the table: None for a request the table
    /// does not hold, or one quarantined (nothing checked of it is kept).
    pub(crate) fn read_stamps(&self, requests: impl Iterator<Item = RequestId>) -> Vec<Option<ReadStamp>> {
        let state = self.state.read();
        requests
            .map(|r| {
                let rec = state.requests.get(&r)?;
                let word = state.epochs.word(rec.slot);
                (word & RequestEpochs::QUARANTINED == 0).then_some(ReadStamp { word, shared_epoch: state.shared_epoch })
            })
            .collect()
    }
}
