//! Reads and decode steps through an engine's token-slot table (SGLang's `req_to_token`): entry
//! `t` of a row is the KV slot of the row's token `t` (`page * page_size + offset`), so page `j`
//! of the row is its entry `j * page_size` divided by the page size, and every other entry of
//! that page must be that page's slot at its offset (a per-token reader reads each entry).

use super::StepError;
use crate::config::PageDiv;
use crate::ids::{PageId, RequestId};
use crate::table::{BlockRows, OwnershipTable, ReadStamp, RowRead, RowsError, SeqRead, StepVerdict};
use crate::violation::Violation;
use std::ops::Range;

/// One row attention reads through a token-slot table: `request` reads its first `tokens`
/// tokens through row `row`, checked from the page of token `from` on (0: the whole row).
///
/// A window (`from` > 0) clean here is clean in the full check only if the row's entries before
/// its page are those a full check (or an earlier window) found clean, for the same request, and
/// nothing the table did since took a right from it: the engine's side keeps that (SGLang's
/// plugin lowers a row's checked length at every row write and checks every row in full after a
/// release, an eviction or a refusal). A refused window says what to judge in full: its
/// violation's page index counts from the window's first page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SlotRead {
    /// The reading request.
    pub request: RequestId,
    /// Its row in the table.
    pub row: u32,
    /// Tokens already checked clean: the read starts at this token's page.
    pub from: u64,
    /// Tokens read: `0..tokens`. More than the row has entries is refused as
    /// `block_table_too_short`, whether or not the row ends at a page's end.
    pub tokens: u64,
}

/// A decode forward's first KV store through a token-slot table: `reads[i].request` wrote slot
/// `slots[i]` (its one new token; SGLang's `out_cache_loc`), then reads its window as
/// `reads[i]` says.
///
/// ```
/// use kvguard::step::{DecodeForward, DecodeOutcome, SlotRead};
/// use kvguard::{BlockRows, OwnershipTable, PageId, PoolConfig, RequestId, SeqWrite, TenantId};
/// let table = OwnershipTable::new(PoolConfig::new(64, 4, 128))?;
/// let (a, b) = (RequestId(1), RequestId(2));
/// table.admit(a, TenantId(1), 6, 8)?;
/// table.admit(b, TenantId(2), 6, 8)?;
/// table.claim(a, &[PageId(3), PageId(4)])?;
/// table.claim(b, &[PageId(5), PageId(6)])?;
/// // Each prefilled 6 tokens: a's in slots 12.., b's in slots 20..
/// let prefill: [Vec<i64>; 2] = [(12..18).collect(), (20..26).collect()];
/// let writes = [SeqWrite { request: a, slots: &prefill[0] }, SeqWrite { request: b, slots: &prefill[1] }];
/// assert!(table.record_step_writes(&writes).is_clean());
/// // req_to_token, 8 token slots a row: row 0 is a's, row 1 is b's; each decodes its 7th token.
/// let mut req_to_token = [12, 13, 14, 15, 16, 17, 18, 0, 20, 21, 22, 23, 24, 25, 26, 0];
/// let reads = [
///     SlotRead { request: a, row: 0, from: 6, tokens: 7 }, // rows checked clean up to token 6
///     SlotRead { request: b, row: 1, from: 6, tokens: 7 },
/// ];
/// let step = DecodeForward { reads: &reads, slots: &[18, 26], rows: BlockRows::new(&req_to_token, 8)? };
/// assert!(matches!(table.decode_forward(&step)?, DecodeOutcome::Clean));
/// // Next step, b's row names a's page for its 8th token: its window is refused.
/// req_to_token[15] = 19;
/// let reads = [SlotRead { request: b, row: 1, from: 7, tokens: 8 }];
/// let step = DecodeForward { reads: &reads, slots: &[27], rows: BlockRows::new(&req_to_token, 8)? };
/// let DecodeOutcome::Window(verdict) = table.decode_forward(&step)? else { panic!("refused") };
/// assert_eq!(verdict.refused[0].0, 0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug)]
pub struct DecodeForward<'a> {
    /// The rows read, one per request of the batch.
    pub reads: &'a [SlotRead],
    /// The slot each request wrote, as many as `reads`.
    pub slots: &'a [i64],
    /// The token-slot table (`req_to_token`), in place.
    pub rows: BlockRows<'a>,
}

/// What [`OwnershipTable::decode_forward`] found.
#[derive(Debug)]
#[must_use]
pub enum DecodeOutcome {
    /// Every write was recorded and every window is clean.
    Clean,
    /// Some writes were refused (judged: counted, logged, quarantined under enforce); the clean
    /// ones were recorded, nothing was read.
    Writes(StepVerdict),
    /// The writes were recorded; these windows are refused (pure: nothing counted or
    /// quarantined). Judge the rows in full ([`OwnershipTable::verify_slot_rows`] with `from` 0).
    Window(StepVerdict),
}

impl OwnershipTable {
    /// Whether each read may run, through a token-slot table (SGLang's `req_to_token`: entry `t` of
    /// a row is the slot of its token `t`; see [`SlotRead`]).
    /// Pure, as [`check_step`](Self::check_step). A read naming a row past the table is
    /// [`RowsError::Row`], nothing checked.
    pub fn check_slot_rows(&self, rows: BlockRows<'_>, reads: &[SlotRead]) -> Result<StepVerdict, RowsError> {
        Ok(Gathered::of(rows, reads, self)?.judge(self, reads, false))
    }

    /// [`check_slot_rows`](Self::check_slot_rows), judged as [`verify_step`](Self::verify_step):
    /// each violation counted, logged and (enforce) its request quarantined.
    pub fn verify_slot_rows(&self, rows: BlockRows<'_>, reads: &[SlotRead]) -> Result<StepVerdict, RowsError> {
        Ok(Gathered::of(rows, reads, self)?.judge(self, reads, true))
    }

    /// A decode forward in one call: the writes recorded as
    /// [`record_step_writes`](Self::record_step_writes) records them (judged), then, if all
    /// were, the windows checked as [`check_slot_rows`](Self::check_slot_rows) checks them
    /// (pure). `slots` not as long as `reads` is [`StepError::Slots`], a row past the table
    /// [`StepError::Rows`]: nothing is recorded.
    pub fn decode_forward(&self, step: &DecodeForward<'_>) -> Result<DecodeOutcome, StepError> {
        if step.slots.len() != step.reads.len() {
            return Err(StepError::Slots { reads: step.reads.len(), slots: step.slots.len() });
        }
        // The common decode step: each window one page, its entries in place. Checked without
        // gathering the reads into lists first (the same verdicts).
        if let Some(outcome) =
            self.decode_one_page_windows(step.reads.len(), &|i| step.reads[i], step.slots, step.rows)?
        {
            return Ok(outcome);
        }
        // The windows are gathered first: a row past the table is found before anything is
        // recorded (the step's writes do not change the engine's table).
        let gathered = Gathered::of(step.rows, step.reads, self)?;
        let writers: Vec<RequestId> = step.reads.iter().map(|r| r.request).collect();
        let (written, read) = match &gathered {
            Gathered::InPlace(reads) => self.decode_writes_then_reads(&writers, step.slots, reads),
            Gathered::Windows(w) => {
                let (written, read) = self.decode_writes_then_reads(&writers, step.slots, &w.reads(step.reads));
                (written, read.map(|v| w.fold(v)))
            }
        };
        Ok(DecodeOutcome::of(written, read))
    }

    /// [`decode_forward`](Self::decode_forward) of `n` reads made as they are judged: read `i`
    /// is `read(i)`, called once a read where every window is one page (and again, to list them,
    /// where one is not), and always giving the same read. The same verdicts and errors as `decode_forward` given those reads in a
    /// slice, and the same changes to the table; nothing is listed where every window is one page
    /// (the common decode step), so an engine's binding can read its own arrays in place
    /// (kvguard's Python binding reads SGLang's arrays and its plugin's mirror, with the GIL held).
    ///
    /// ```
    /// use kvguard::{BlockRows, OwnershipTable, PoolConfig, RequestId, TenantId};
    /// use kvguard::step::{DecodeOutcome, SlotRead};
    ///
    /// let table = OwnershipTable::new(PoolConfig::new(16, 8, 64))?;
    /// let a = RequestId(1);
    /// table.admit(a, TenantId(0), 2, 1)?;
    /// table.claim(a, &[kvguard::PageId(2)])?;
    /// // Row 0 of the token-slot table: tokens 0 and 1 in slots 16 and 17 (page 2).
    /// let req_to_token = [16, 17, -1, -1, -1, -1, -1, -1];
    /// let rows = BlockRows::new(&req_to_token, 8)?;
    /// // Two steps, each writing one token and reading its row so far; the reads' fields come
    /// // from an engine's own arrays, read by index.
    /// let (checked, lens) = ([0u64, 1], [1u64, 2]);
    /// for (step, slot) in [16i64, 17].into_iter().enumerate() {
    ///     let read = |_: usize| SlotRead { request: a, row: 0, from: checked[step], tokens: lens[step] };
    ///     assert!(matches!(table.decode_forward_by(1, read, &[slot], rows)?, DecodeOutcome::Clean));
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn decode_forward_by(
        &self,
        n: usize,
        read: impl Fn(usize) -> SlotRead,
        slots: &[i64],
        rows: BlockRows<'_>,
    ) -> Result<DecodeOutcome, StepError> {
        if slots.len() != n {
            return Err(StepError::Slots { reads: n, slots: slots.len() });
        }
        if let Some(outcome) = self.decode_one_page_windows(n, &read, slots, rows)? {
            return Ok(outcome);
        }
        let reads: Vec<SlotRead> = (0..n).map(read).collect();
        self.decode_forward(&DecodeForward { reads: &reads, slots, rows })
    }

    /// [`decode_forward`](Self::decode_forward) where every read's window is one page whose
    /// entries are in place ([`one_page_window`]); `None`, nothing done, where one is not. The
    /// windows are found before anything is recorded, as the general path gathers them: a row
    /// past the table is [`StepError::Rows`], and the engine's table is read once.
    fn decode_one_page_windows(
        &self,
        n: usize,
        read: &impl Fn(usize) -> SlotRead,
        slots: &[i64],
        rows: BlockRows<'_>,
    ) -> Result<Option<DecodeOutcome>, StepError> {
        let page_size = self.page_size();
        let div = PageDiv::new(page_size);
        // Each read made once: its window and its writer kept (16 bytes a read).
        let mut windows = Vec::with_capacity(n);
        for i in 0..n {
            let read = read(i);
            if read.row as usize >= rows.rows() {
                // The first row past the table, unless a window before it is not one page: then
                // the general path finds the same row first, as it gathers.
                return Err(RowsError::Row { index: i, row: read.row, rows: rows.rows() }.into());
            }
            match one_page_window(rows, &read, div, page_size) {
                Some((page, tokens)) => windows.push((page, tokens, read.request)),
                None => return Ok(None),
            }
        }
        let (written, read) = self.decode_writes_then_one_page_reads(&windows, slots);
        Ok(Some(DecodeOutcome::of(written, read)))
    }
}

impl DecodeOutcome {
    /// The outcome of a decode step's writes and (if they were all recorded) reads.
    fn of(written: StepVerdict, read: Option<StepVerdict>) -> DecodeOutcome {
        match read {
            None => DecodeOutcome::Writes(written),
            Some(read) if read.is_clean() => DecodeOutcome::Clean,
            Some(read) => DecodeOutcome::Window(read),
        }
    }
}

/// `read`'s window through `rows` (its row in the table) where it is one page: that page and
/// the tokens read of it, as [`Windows::gather`] (or, at page size 1, [`Gathered::of`]) would
/// gather it. `None` where the read goes past the row's end, the window covers no page or more
/// than one, its first entry is negative, it reads more tokens than a page holds, or an entry of
/// its page is not that page's slot at its offset: such a window has extra reads or a refusal,
/// the general path's to find.
#[inline(always)]
fn one_page_window(rows: BlockRows<'_>, read: &SlotRead, div: PageDiv, page_size: u32) -> Option<(PageId, u32)> {
    let row = rows.row(read.row as usize);
    let stride = page_size as usize;
    let seq = read.tokens;
    if seq > rows.width() as u64 {
        return None; // a read past the row's end: refused as too short, by the general path
    }
    let (first, end, last) = window_of(read, rows.width(), stride, div, usize::MAX);
    if end != first.checked_add(1)? {
        return None;
    }
    let lo = first * stride;
    let page = &row[lo..(lo + stride).min(last).max(lo)];
    let &base = page.first()?;
    let slot = u64::try_from(base).ok()?;
    let own = base - div.offset(slot) as i32;
    // The highest first slot of a page whose slots all fit in an int32 (as the gather's `top`).
    if stride > 1 && (own > i32::MAX - (stride as i32 - 1) || off_its_page(page, own) != 0) {
        return None;
    }
    let tokens = seq - first as u64 * u64::from(page_size);
    let tokens = u32::try_from(tokens).ok().filter(|&t| t <= page_size)?;
    Some((PageId(div.floor(slot) as u32), tokens))
}

/// Read `read`'s window in a row of `entries` entries of pages of `stride`: pages `first..end`
/// of the row, their entries read up to entry `last`. From the page of token `from` (the row's
/// end, if that is past it) to the page of the read's last token, at most `most` pages; a read
/// past the row's end reads only the row's whole pages, so it is refused as too short (a last
/// page the row holds in part has no entries for the tokens past it). What
/// [`Windows::gather`] gathers and [`one_page_window`] finds.
#[inline(always)]
fn window_of(read: &SlotRead, entries: usize, stride: usize, div: PageDiv, most: usize) -> (usize, usize, usize) {
    let seq = read.tokens;
    let width = entries.div_ceil(stride);
    let first = usize::try_from(div.floor(read.from.min(seq))).unwrap_or(usize::MAX).min(width);
    let in_row = if seq > entries as u64 { entries / stride } else { width };
    let end =
        usize::try_from(div.ceil(seq)).unwrap_or(usize::MAX).min(in_row).max(first).min(first.saturating_add(most));
    (first, end, usize::try_from(seq).unwrap_or(usize::MAX).min(entries))
}

/// Per row of a token-slot table (SGLang's `req_to_token`), what was last checked clean: what
/// makes [`OwnershipTable::verify_slot_rows_cached`] incremental. The token-slot twin of
/// [`RowCache`](crate::RowCache): a row read again by the same request, whose right to read is
/// where it stood at the row's last clean check (nothing taken from it since, not quarantined:
/// its epoch word and the table's `shared_epoch`, as `RowCache` reads them) and whose entries
/// of the pages checked whole then are unchanged, byte for byte, is judged only from the page
/// that check ended in; any other row in full. So an entry changed behind the engine's calls is
/// still found, at the cost of comparing the row with its copy rather than judging each entry.
/// One per token-slot table; given another table, or a table of another width, it starts over.
/// Memory: as much as the table's rows (allocated zeroed) and 32 bytes a row.
#[derive(Debug, Default)]
pub struct SlotRowCache {
    table: u64,
    stride: usize,
    heads: Vec<SlotHead>,
    /// Row `r`'s entries last checked clean at `r * stride..`.
    entries: Vec<i32>,
    incremental: u64,
    full: u64,
}

/// What a row was last checked clean as.
#[derive(Clone, Copy, Debug)]
struct SlotHead {
    request: RequestId,
    /// The reader's stamp before that check; None: nothing is known of the row.
    stamp: Option<ReadStamp>,
    /// Tokens read clean.
    tokens: u64,
}

impl SlotHead {
    const EMPTY: SlotHead = SlotHead { request: RequestId(0), stamp: None, tokens: 0 };
}

impl SlotRowCache {
    /// An empty cache: the first check judges every row in full.
    pub fn new() -> SlotRowCache {
        SlotRowCache::default()
    }

    /// Rows judged from their last clean page since the cache was made.
    pub fn incremental(&self) -> u64 {
        self.incremental
    }

    /// Rows judged in full since the cache was made.
    pub fn full(&self) -> u64 {
        self.full
    }

    /// Forgets every row: the next check judges each in full.
    pub fn clear(&mut self) {
        self.heads.clear();
    }

    /// Room for `rows` rows of `stride` entries of table `table` (see `RowCache`).
    fn fit(&mut self, table: u64, rows: usize, stride: usize) {
        if self.table != table || self.stride != stride {
            self.table = table;
            self.stride = stride;
            self.heads.clear();
            self.entries = Vec::new();
        }
        if self.heads.len() < rows {
            self.heads.resize(rows, SlotHead::EMPTY);
        }
        let len = rows * stride; // no more than the table's entries
        if self.entries.len() < len {
            let mut grown = vec![0i32; len];
            grown[..self.entries.len()].copy_from_slice(&self.entries);
            self.entries = grown;
        }
    }
}

impl OwnershipTable {
    /// [`check_slot_rows_cached`](Self::check_slot_rows_cached), judged as
    /// [`verify_slot_rows`](Self::verify_slot_rows): each violation counted, logged and
    /// (enforce) its request quarantined.
    ///
    /// ```
    /// use kvguard::step::SlotRowCache;
    /// use kvguard::{BlockRows, OwnershipTable, PageId, PoolConfig, RequestId, RowRead, SeqWrite, TenantId};
    /// let table = OwnershipTable::new(PoolConfig::new(64, 4, 128))?;
    /// let a = RequestId(1);
    /// table.admit(a, TenantId(1), 6, 8)?;
    /// table.claim(a, &[PageId(3), PageId(4)])?;
    /// let slots: Vec<i64> = (12..19).collect();
    /// assert!(table.record_step_writes(&[SeqWrite { request: a, slots: &slots }]).is_clean());
    /// // req_to_token, 8 token slots a row: row 0 is a's.
    /// let mut req_to_token = [12, 13, 14, 15, 16, 17, 18, 0];
    /// let mut cache = SlotRowCache::new();
    /// let read = [RowRead { request: a, row: 0, tokens: 7 }];
    /// let rows = BlockRows::new(&req_to_token, 8)?;
    /// assert!(table.verify_slot_rows_cached(&mut cache, rows, &read)?.is_clean()); // in full
    /// assert!(table.verify_slot_rows_cached(&mut cache, rows, &read)?.is_clean()); // its last page
    /// assert_eq!((cache.full(), cache.incremental()), (1, 1));
    /// // An entry of a page checked whole changed behind the engine's calls: found.
    /// req_to_token[1] = 40;
    /// let rows = BlockRows::new(&req_to_token, 8)?;
    /// assert!(!table.verify_slot_rows_cached(&mut cache, rows, &read)?.is_clean());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn verify_slot_rows_cached(
        &self,
        cache: &mut SlotRowCache,
        rows: BlockRows<'_>,
        reads: &[RowRead],
    ) -> Result<StepVerdict, RowsError> {
        self.slot_rows_cached(cache, rows, reads, true)
    }

    /// Whether each read may run through a token-slot table, as
    /// [`check_slot_rows`](Self::check_slot_rows) checks it from token 0 (the same verdict, row
    /// for row), incrementally across calls through `cache` (see [`SlotRowCache`]): a row whose
    /// reader's right and whose entries are as they were at its last clean check is judged from
    /// the page that check ended in. Pure. A read naming a row past the table is
    /// [`RowsError::Row`]: nothing checked, `cache` unchanged.
    pub fn check_slot_rows_cached(
        &self,
        cache: &mut SlotRowCache,
        rows: BlockRows<'_>,
        reads: &[RowRead],
    ) -> Result<StepVerdict, RowsError> {
        self.slot_rows_cached(cache, rows, reads, false)
    }

    fn slot_rows_cached(
        &self,
        cache: &mut SlotRowCache,
        rows: BlockRows<'_>,
        reads: &[RowRead],
        judged: bool,
    ) -> Result<StepVerdict, RowsError> {
        RowsError::first_past(reads.iter().map(|r| r.row), rows.rows())?;
        let stride = rows.width();
        cache.fit(self.id(), rows.rows(), stride);
        let ps = u64::from(self.page_size());
        // Stamps before anything is judged: a right taken while this call runs makes them stale,
        // so what is kept is judged again next time, never trusted.
        let before = self.read_stamps(reads.iter().map(|r| r.request));
        let as_slot = |r: &RowRead, from: u64| SlotRead { request: r.request, row: r.row, from, tokens: r.tokens };
        // Each read from its row's last clean page where that holds (`from`: the tokens read
        // clean then; the entries of the pages before that one compared), else in full.
        let mut from = vec![0u64; reads.len()];
        let (mut windows, mut full): (Vec<usize>, Vec<usize>) = (Vec::new(), Vec::new());
        for (i, r) in reads.iter().enumerate() {
            let row = r.row as usize;
            let head = cache.heads[row];
            let whole = (head.tokens / ps * ps).min(stride as u64) as usize;
            if head.stamp.is_some()
                && head.stamp == before[i]
                && head.request == r.request
                && head.tokens <= r.tokens
                && rows.row(row)[..whole] == cache.entries[row * stride..][..whole]
            {
                from[i] = head.tokens;
                windows.push(i);
            } else {
                full.push(i);
            }
        }
        let mut clean = vec![false; reads.len()];
        if !windows.is_empty() {
            let step: Vec<SlotRead> = windows.iter().map(|&i| as_slot(&reads[i], from[i])).collect();
            let verdict = Gathered::of(rows, &step, self)?.judge(self, &step, false);
            let after = self.read_stamps(step.iter().map(|r| r.request));
            let mut refused = vec![false; step.len()];
            for (k, _) in &verdict.refused {
                refused[*k] = true;
            }
            // A refused window is judged again in full (its violation is the full check's); so is
            // one whose reader lost a right while it was judged.
            for (k, &i) in windows.iter().enumerate() {
                if refused[k] || after[k] != before[i] {
                    from[i] = 0;
                    full.push(i);
                } else {
                    clean[i] = true;
                }
            }
            full.sort_unstable();
        }
        let mut verdict = StepVerdict::default();
        if !full.is_empty() {
            let step: Vec<SlotRead> = full.iter().map(|&i| as_slot(&reads[i], 0)).collect();
            let judged = Gathered::of(rows, &step, self)?.judge(self, &step, judged);
            let mut refused: Vec<Option<Violation>> = vec![None; step.len()];
            for (k, v) in judged.refused {
                refused[k] = Some(v);
            }
            for (k, v) in refused.into_iter().enumerate() {
                match v {
                    Some(v) => verdict.refused.push((full[k], v)),
                    None => clean[full[k]] = true,
                }
            }
            verdict.refused.sort_by_key(|(i, _)| *i);
        }
        cache.full += full.len() as u64;
        cache.incremental += (reads.len() - full.len()) as u64;
        for (i, r) in reads.iter().enumerate() {
            let row = r.row as usize;
            if !clean[i] {
                cache.heads[row] = SlotHead::EMPTY;
                continue;
            }
            let upto = r.tokens.min(stride as u64) as usize;
            let start = ((from[i] / ps * ps) as usize).min(upto);
            cache.entries[row * stride..][start..upto].copy_from_slice(&rows.row(row)[start..upto]);
            cache.heads[row] = SlotHead { request: r.request, stamp: before[i], tokens: r.tokens };
        }
        Ok(verdict)
    }
}

/// Zero exactly when entry `k` of `page` is `own + k` for every `k` (`own + page.len()` fits in an
/// int32). Eight entries at a time, each chunk's differences ORed into one lane per offset, so
/// the compiler checks a chunk with a few vector instructions instead of eight compares.
#[inline(always)]
fn off_its_page(page: &[i32], own: i32) -> i32 {
    const RAMP: [i32; 8] = [0, 1, 2, 3, 4, 5, 6, 7];
    let (chunks, rest) = page.as_chunks::<8>();
    let mut lanes = [0i32; 8];
    let mut base = own;
    for chunk in chunks {
        for k in 0..8 {
            lanes[k] |= chunk[k].wrapping_sub(RAMP[k]) ^ base;
        }
        base = base.wrapping_add(8);
    }
    let tail = rest.iter().zip(RAMP).fold(0, |bad, (&e, k)| bad | (e.wrapping_sub(k) ^ base));
    lanes.iter().fold(tail, |bad, &l| bad | l)
}

/// A step's reads as the table checks them.
enum Gathered<'a> {
    /// Page size 1: each entry is its own page, each read's entries read in place.
    InPlace(Vec<SeqRead<'a, i32>>),
    /// Larger pages: each page gathered from its first entry, with the extra reads.
    Windows(Windows),
}

impl<'a> Gathered<'a> {
    /// The reads through `rows` (a read naming a row past the table is [`RowsError::Row`]).
    fn of(rows: BlockRows<'a>, reads: &[SlotRead], table: &OwnershipTable) -> Result<Gathered<'a>, RowsError> {
        RowsError::first_past(reads.iter().map(|r| r.row), rows.rows())?;
        if table.page_size() > 1 {
            return Ok(Gathered::Windows(Windows::gather(rows, reads, table)));
        }
        Ok(Gathered::InPlace(
            reads
                .iter()
                .map(|r| {
                    let row = rows.row(r.row as usize);
                    // A window past the row's end starts at its end (a read needing more is
                    // refused as block_table_too_short).
                    let first = usize::try_from(r.from.min(r.tokens)).unwrap_or(usize::MAX).min(row.len());
                    SeqRead { request: r.request, block_table: &row[first..], tokens: r.tokens - first as u64 }
                })
                .collect(),
        ))
    }

    /// The verdict on the reads, row for row (`judged`: as `verify_step`, else `check_step`).
    fn judge(&self, table: &OwnershipTable, reads: &[SlotRead], judged: bool) -> StepVerdict {
        match self {
            Gathered::InPlace(r) => table.step_of_entries(r, judged),
            Gathered::Windows(w) => {
                let r = w.reads(reads);
                w.fold(if judged { table.verify_step(&r) } else { table.check_step(&r) })
            }
        }
    }
}

/// The pages each read's window covers, gathered from its row: `pages[spans[i]]` for read `i`,
/// read for `tokens[i]` tokens (counted from the window's first page), and the extra reads of
/// entries that are not their page's slot: `(read index, the page the entry names, tokens of it
/// read: its slot's offset + 1)`.
struct Windows {
    pages: Vec<PageId>,
    spans: Vec<Range<usize>>,
    tokens: Vec<u64>,
    extra: Vec<(usize, PageId, u64)>,
}

impl Windows {
    /// Reads each row's window (each read's row is in the table; pages of more than one token).
    /// A negative entry, or one past the pool, names a page beyond any
    /// pool (refused as `page_out_of_range`). A row is read for at most the pool's pages plus one
    /// from its window's start: a read that needs more is refused as `block_table_too_short`, so
    /// a huge length allocates nothing beyond that.
    fn gather(rows: BlockRows<'_>, reads: &[SlotRead], table: &OwnershipTable) -> Windows {
        let config = table.config();
        let page_size = config.page_size;
        let ps = u64::from(page_size);
        let stride = page_size as usize;
        let div = PageDiv::new(page_size);
        let entries = rows.width();
        let most = config.num_pages as usize + 1;
        let mut out = Windows {
            pages: Vec::with_capacity(reads.len() * 2),
            spans: Vec::with_capacity(reads.len()),
            tokens: Vec::with_capacity(reads.len()),
            extra: Vec::new(),
        };
        // The highest first slot of a page whose slots all fit in an int32.
        let top = i32::MAX - (stride as i32 - 1);
        for (i, read) in reads.iter().enumerate() {
            let row = rows.row(read.row as usize);
            let seq = read.tokens;
            let (first, end, last) = window_of(read, entries, stride, div, most);
            let start = out.pages.len();
            // The entries of each page read, up to the tokens read and the row's end.
            for j in first..end {
                let lo = j * stride;
                out.page(i, &row[lo..(lo + stride).min(last).max(lo)], div, top);
            }
            out.spans.push(start..out.pages.len());
            out.tokens.push(seq - first as u64 * ps);
        }
        out
    }

    /// Page `entries` (its first entry, then the rest up to the tokens read) of read `i`'s
    /// window: the page its first entry names, and an extra read for every entry that is not
    /// that page's slot at its offset. Apart from the loop over the reads, so that loop's
    /// values stay in registers.
    #[inline(never)]
    fn page(&mut self, i: usize, entries: &[i32], div: PageDiv, top: i32) {
        let page_of = |v: i32| u32::try_from(v).map_or(PageId(u32::MAX), |v| PageId(div.floor(u64::from(v)) as u32));
        let Some(&base) = entries.first() else { return };
        self.pages.push(page_of(base));
        if base < 0 {
            return; // a negative first entry is refused as page_out_of_range already
        }
        let own = base - div.offset(base as u64) as i32;
        // Entry k of the page is its slot own + k: in int32 (eight at a time) where the page's
        // slots fit in one, in i64 where they may not.
        let in_place = if own <= top {
            off_its_page(entries, own) == 0
        } else {
            entries.iter().enumerate().all(|(k, &e)| i64::from(e) - k as i64 == i64::from(own))
        };
        if !in_place {
            for (k, &slot) in entries.iter().enumerate() {
                if i64::from(slot) - k as i64 != i64::from(own) {
                    let tokens = u32::try_from(slot).map_or(1, |s| div.offset(u64::from(s)) + 1);
                    self.extra.push((i, page_of(slot), tokens));
                }
            }
        }
    }

    /// The reads to check: read `i` through its window's pages, then the extra reads (index
    /// `n + k` for extra `k`; see [`fold`](Self::fold)).
    fn reads<'a>(&'a self, reads: &[SlotRead]) -> Vec<SeqRead<'a>> {
        let rows = reads.iter().zip(&self.spans).zip(&self.tokens).map(|((r, span), &tokens)| SeqRead {
            request: r.request,
            block_table: &self.pages[span.clone()],
            tokens,
        });
        let extra = self.extra.iter().map(|&(i, ref page, tokens)| SeqRead {
            request: reads[i].request,
            block_table: std::slice::from_ref(page),
            tokens,
        });
        rows.chain(extra).collect()
    }

    /// A verdict over [`reads`](Self::reads) as one over the rows: an extra read's refusal is
    /// its row's, and a row refused more than once keeps its first (its own pages' before an
    /// extra's).
    fn fold(&self, mut v: StepVerdict) -> StepVerdict {
        let n = self.spans.len();
        if self.extra.is_empty() || v.refused.iter().all(|(i, _)| *i < n) {
            return v;
        }
        for (i, _) in &mut v.refused {
            if *i >= n {
                *i = self.extra[*i - n].0;
            }
        }
        v.refused.sort_by_key(|(i, _)| *i);
        v.refused.dedup_by_key(|(i, _)| *i);
        v
    }
}
