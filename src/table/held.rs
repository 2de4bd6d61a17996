//! A block table the guard holds: the engine changes its rows only through calls the guard sees,
//! so a step is checked from what changed, without reading the rows again.
//!
//! [`verify_rows`](OwnershipTable::verify_rows) reads an engine's own block table: the engine can
//! write it anywhere, any time, so each step compares every row read with the copy checked
//! before, a pass over the row's bytes (about 0.1 of a full check at AVX2 width; see
//! `docs/engine-step.md`). A [`HeldBlockTable`] owns the rows instead. The engine appends a step's
//! new entries, sets, truncates, copies and swaps rows through it, and reads them (to copy them
//! to the device, say) through shared slices. Each change that reaches below what a row's last
//! clean check read whole forgets that check; the next step judges that row in full. A row
//! nothing reached below is judged from the page its last check ended in, as
//! [`verify_rows`](OwnershipTable::verify_rows) judges an unchanged row, with no comparison: a
//! decode step costs each row its head and the one page it reads anew.
//!
//! The verdicts are a full [`check_step`](OwnershipTable::check_step)'s of the same rows, step for
//! step (`tests/it/table_model.rs` holds them equal over random operation sequences, with rows
//! changed through every call between steps). What this gives up is the comparison's catch of a
//! row changed *behind* the engine's calls: in safe Rust there is no such change (the rows are
//! lent only as shared slices); through the C ABI or Python's read-only view it takes a write
//! through a pointer the guard lent read-only, memory corruption, which is what the device
//! canary is for.

use super::OwnershipTable;
use super::rows::{BlockRows, RowHead, RowRead, RowsError};
use super::step::StepVerdict;

/// Why a change to a [`HeldBlockTable`] was refused (the table is left as it was).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HeldRowsError {
    /// The table asked for is larger than memory can index, or has 2^32 rows or more, or rows
    /// of 2^32 entries or more.
    #[error("a held block table of {rows} rows of {width} entries is too large")]
    Size {
        /// Rows asked for.
        rows: usize,
        /// Entries per row asked for.
        width: usize,
    },
    /// The system would not give the memory the table asked for.
    #[error("no memory for a held block table of {rows} rows of {width} entries")]
    OutOfMemory {
        /// Rows asked for.
        rows: usize,
        /// Entries per row asked for.
        width: usize,
    },
    /// A change names a row past the table.
    #[error("row {row} is past the held block table's {rows} rows")]
    Row {
        /// The row named.
        row: u32,
        /// Rows in the table.
        rows: usize,
    },
    /// The change would leave a row longer than the table's width.
    #[error("row {row} would hold {len} entries: a row holds at most {width}")]
    Width {
        /// The row named.
        row: u32,
        /// Entries it would hold.
        len: usize,
        /// Entries a row holds at most.
        width: usize,
    },
}

/// An engine's block table held by the guard: `rows` rows of `width` int32 page ids (a
/// negative one names no page), each set up to its length, the rest `-1`. The engine changes it
/// only through these calls, and [`OwnershipTable::verify_held_rows`] checks a step from what
/// changed (see the module docs). Memory: the rows' entries, 4 bytes each, written at creation,
/// and 52 bytes a row.
///
/// ```
/// # use kvguard::{HeldBlockTable, OwnershipTable, PageId, PoolConfig, RequestId, RowRead, TenantId};
/// let table = OwnershipTable::new(PoolConfig::new(64, 16, 1024)).unwrap();
/// let req = RequestId(1);
/// table.admit(req, TenantId(1), 100, 100).unwrap();
/// let bt: Vec<PageId> = table.allocate(req, 2).unwrap().iter().map(|r| r.page).collect();
/// table.record_write_tokens(req, &bt, 0..20).unwrap();
/// let pages: Vec<i32> = bt.iter().map(|p| p.0 as i32).collect();
/// // Row 5 of the engine's block table is this request's: its two pages appended.
/// let mut held = HeldBlockTable::new(8, 4).unwrap();
/// held.append(5, &pages).unwrap();
/// assert_eq!(held.row(5), Some(&pages[..]));
/// let step = [RowRead { request: req, row: 5, tokens: 20 }];
/// assert!(table.verify_held_rows(&mut held, &step).unwrap().is_clean()); // in full
/// table.record_write_tokens(req, &bt, 20..21).unwrap();
/// let step = [RowRead { request: req, row: 5, tokens: 21 }];
/// assert!(table.verify_held_rows(&mut held, &step).unwrap().is_clean()); // its last page alone
/// assert_eq!((held.full(), held.incremental()), (1, 1));
/// // A change below what was checked whole: the next read of the row is judged in full.
/// held.set_row(5, &[pages[1], pages[0]]).unwrap();
/// assert!(!table.verify_held_rows(&mut held, &step).unwrap().is_clean());
/// assert_eq!(held.full(), 2);
/// ```
#[derive(Debug)]
pub struct HeldBlockTable {
    /// The table the heads were checked against (0: none yet; a table's id is never 0).
    table: u64,
    width: usize,
    /// Row `r`'s entries at `r * width..`.
    entries: Vec<i32>,
    /// Entries set, per row: the rest of the row is `-1`.
    lens: Vec<u32>,
    /// What each row was last checked clean as.
    heads: Vec<RowHead>,
    incremental: u64,
    full: u64,
}

impl HeldBlockTable {
    /// `rows` empty rows of `width` entries ([`HeldRowsError::Size`] if they cannot be indexed,
    /// or there are 2^32 rows or more, or a row is 2^32 entries or longer;
    /// [`HeldRowsError::OutOfMemory`] if the system will not give the memory).
    pub fn new(rows: usize, width: usize) -> Result<HeldBlockTable, HeldRowsError> {
        let size = HeldRowsError::Size { rows, width };
        if u32::try_from(width).is_err() || u32::try_from(rows).is_err() {
            return Err(size);
        }
        let len = rows.checked_mul(width).filter(|&n| n <= isize::MAX as usize / 4).ok_or(size)?;
        // Reserved first, so memory the system will not give is an error, not an abort.
        let oom = |_| HeldRowsError::OutOfMemory { rows, width };
        let (mut entries, mut lens, mut heads) = (Vec::new(), Vec::new(), Vec::new());
        entries.try_reserve_exact(len).map_err(oom)?;
        lens.try_reserve_exact(rows).map_err(oom)?;
        heads.try_reserve_exact(rows).map_err(oom)?;
        entries.resize(len, -1);
        lens.resize(rows, 0);
        heads.resize(rows, RowHead::EMPTY);
        Ok(HeldBlockTable { table: 0, width, entries, lens, heads, incremental: 0, full: 0 })
    }

    /// How many rows.
    pub fn rows(&self) -> usize {
        self.lens.len()
    }

    /// Entries a row holds at most.
    pub fn width(&self) -> usize {
        self.width
    }

    /// Row `row`'s entries set (None past the table).
    pub fn row(&self, row: u32) -> Option<&[i32]> {
        let len = *self.lens.get(row as usize)? as usize;
        Some(&self.entries[row as usize * self.width..][..len])
    }

    /// Every row's entries, row after row, `width` a row (`-1` past each row's length): what an
    /// engine copies to the device.
    pub fn entries(&self) -> &[i32] {
        &self.entries
    }

    /// The table as [`BlockRows`], for the calls that read an engine's block table.
    pub fn block_rows(&self) -> BlockRows<'_> {
        BlockRows::new(&self.entries, self.width).expect("whole rows: made so")
    }

    /// Rows judged incrementally (from their last clean page) since the table was made.
    pub fn incremental(&self) -> u64 {
        self.incremental
    }

    /// Rows judged in full since the table was made.
    pub fn full(&self) -> u64 {
        self.full
    }

    /// Appends `entries` to row `row` (a step's new pages).
    pub fn append(&mut self, row: u32, entries: &[i32]) -> Result<(), HeldRowsError> {
        let len = self.len_of(row)?;
        let end = self.fits(row, len.saturating_add(entries.len()))?;
        self.row_mut(row)[len..end].copy_from_slice(entries);
        self.lens[row as usize] = end as u32; // at most the width, which fits
        Ok(())
    }

    /// Row `row` becomes `entries` (a request given the row, or its pages anew).
    pub fn set_row(&mut self, row: u32, entries: &[i32]) -> Result<(), HeldRowsError> {
        let len = self.len_of(row)?;
        let end = self.fits(row, entries.len())?;
        let first = self.row(row).unwrap_or_default().iter().zip(entries).take_while(|(a, b)| a == b).count();
        self.changed(row, first);
        let cells = self.row_mut(row);
        cells[..end].copy_from_slice(entries);
        cells[end..len.max(end)].fill(-1);
        self.lens[row as usize] = end as u32;
        Ok(())
    }

    /// Row `row` keeps its first `len` entries (all of them if it has no more).
    pub fn truncate(&mut self, row: u32, len: usize) -> Result<(), HeldRowsError> {
        let now = self.len_of(row)?;
        if len < now {
            self.changed(row, len);
            self.row_mut(row)[len..now].fill(-1);
            self.lens[row as usize] = len as u32; // less than a length that fits
        }
        Ok(())
    }

    /// Row `row` emptied (its request gone).
    pub fn clear_row(&mut self, row: u32) -> Result<(), HeldRowsError> {
        self.truncate(row, 0)
    }

    /// Row `to` becomes a copy of row `from` (an engine condensing its rows), and what `from`
    /// was checked clean as goes with it.
    pub fn copy_row(&mut self, from: u32, to: u32) -> Result<(), HeldRowsError> {
        let (len, _) = (self.len_of(from)?, self.len_of(to)?);
        if from != to {
            let w = self.width;
            self.entries.copy_within(from as usize * w..(from as usize + 1) * w, to as usize * w);
            self.lens[to as usize] = len as u32;
            self.heads[to as usize] = self.heads[from as usize];
        }
        Ok(())
    }

    /// Rows `a` and `b` trade places, each with what it was checked clean as.
    pub fn swap_rows(&mut self, a: u32, b: u32) -> Result<(), HeldRowsError> {
        self.len_of(a)?;
        self.len_of(b)?;
        if a != b {
            let w = self.width;
            let (lo, hi) = (a.min(b) as usize, a.max(b) as usize);
            let (left, right) = self.entries.split_at_mut(hi * w);
            left[lo * w..][..w].swap_with_slice(&mut right[..w]);
            self.lens.swap(lo, hi);
            self.heads.swap(lo, hi);
        }
        Ok(())
    }

    /// Forgets every row's last clean check: the next step judges each in full.
    pub fn forget(&mut self) {
        self.heads.fill(RowHead::EMPTY);
    }

    fn len_of(&self, row: u32) -> Result<usize, HeldRowsError> {
        self.lens.get(row as usize).map(|&l| l as usize).ok_or(HeldRowsError::Row { row, rows: self.rows() })
    }

    fn fits(&self, row: u32, len: usize) -> Result<usize, HeldRowsError> {
        if len > self.width {
            return Err(HeldRowsError::Width { row, len, width: self.width });
        }
        Ok(len)
    }

    fn row_mut(&mut self, row: u32) -> &mut [i32] {
        &mut self.entries[row as usize * self.width..][..self.width]
    }

    /// Row `row` changed from entry `from` on: a check that read an entry before it whole is
    /// forgotten (entries from the check's last page on are read anew anyway).
    fn changed(&mut self, row: u32, from: usize) {
        let head = &mut self.heads[row as usize];
        if from < head.whole as usize {
            *head = RowHead::EMPTY;
        }
    }
}

impl OwnershipTable {
    /// [`check_held_rows`](Self::check_held_rows), judged: every refused row is counted, logged
    /// and (enforce) quarantined, as [`verify_step`](Self::verify_step) does. See
    /// [`HeldBlockTable`] for an example.
    pub fn verify_held_rows(&self, held: &mut HeldBlockTable, reads: &[RowRead]) -> Result<StepVerdict, RowsError> {
        self.held_step(held, reads.iter().copied(), true)
    }

    /// [`verify_held_rows`](Self::verify_held_rows) of reads an engine keeps in its own shape
    /// (columns of request ids, rows and lengths, say), read through `reads` twice (rows in
    /// range first, then the step), none built: what the C ABI calls with its arrays.
    ///
    /// ```
    /// # use kvguard::{HeldBlockTable, OwnershipTable, PoolConfig, RequestId, RowRead};
    /// # let table = OwnershipTable::new(PoolConfig::new(64, 16, 1024)).unwrap();
    /// # let mut held = HeldBlockTable::new(4, 4).unwrap();
    /// let (ids, rows, lens) = ([7u64, 9], [0u32, 1], [0u64, 0]);
    /// let reads = ids.iter().zip(&rows).zip(&lens).map(|((&r, &row), &tokens)| RowRead {
    ///     request: RequestId(r),
    ///     row,
    ///     tokens,
    /// });
    /// // Unknown requests, even reading nothing: both refused.
    /// assert_eq!(table.verify_held_reads(&mut held, reads).unwrap().refused.len(), 2);
    /// ```
    pub fn verify_held_reads<I>(&self, held: &mut HeldBlockTable, reads: I) -> Result<StepVerdict, RowsError>
    where
        I: IntoIterator<Item = RowRead>,
        I::IntoIter: Clone,
    {
        self.held_step(held, reads.into_iter(), true)
    }

    /// [`check_held_rows`](Self::check_held_rows) of reads in the engine's own shape (see
    /// [`verify_held_reads`](Self::verify_held_reads)).
    pub fn check_held_reads<I>(&self, held: &mut HeldBlockTable, reads: I) -> Result<StepVerdict, RowsError>
    where
        I: IntoIterator<Item = RowRead>,
        I::IntoIter: Clone,
    {
        self.held_step(held, reads.into_iter(), false)
    }

    /// A step's reads through a block table the guard holds, checked as
    /// [`check_step`](Self::check_step) would check them (the same verdict, row for row): a row
    /// judged clean before, still read by the same request, from whom nothing was taken since
    /// and whose entries read whole then were not changed since, is judged only from the page
    /// its last check ended in (see the module docs of `table::held`). Pure: counts, logs and
    /// quarantines nothing. [`RowsError::Row`] (nothing checked, nothing kept) if a read names
    /// a row past the table.
    pub fn check_held_rows(&self, held: &mut HeldBlockTable, reads: &[RowRead]) -> Result<StepVerdict, RowsError> {
        self.held_step(held, reads.iter().copied(), false)
    }

    fn held_step(
        &self,
        held: &mut HeldBlockTable,
        reads: impl Iterator<Item = RowRead> + Clone,
        judged: bool,
    ) -> Result<StepVerdict, RowsError> {
        let n = held.rows();
        RowsError::first_past(reads.clone().map(|r| r.row), n)?;
        if held.table != self.id() {
            held.forget();
            held.table = self.id();
        }
        let state = self.state.read();
        let mut verdict = StepVerdict::default();
        let HeldBlockTable { width, entries, heads, incremental, full, .. } = held;
        let (mut in_full, mut count) = (0, 0);
        for (i, read) in reads.enumerate() {
            count += 1;
            let r = read.row as usize; // in range: checked above
            let row = &entries[r * *width..][..*width];
            let (fast, checked) = state.check_row(&mut heads[r], None, &read, row);
            in_full += u64::from(!fast);
            if let Err(v) = checked {
                if judged {
                    self.note(&state, &v);
                }
                verdict.refused.push((i, v));
            }
        }
        *full += in_full;
        *incremental += count - in_full;
        Ok(verdict)
    }
}

#[cfg(test)]
mod tests {
    //! The calls that change a held row, each against a row read clean before: a change below
    //! what was read whole is judged in full; one past it is read anew; a row's check goes with
    //! its entries when rows are copied or swapped.
    use super::{HeldBlockTable, HeldRowsError};
    use crate::{OwnershipTable, PageId, PoolConfig, RequestId, RowRead, RowsError, TenantId, ViolationKind};

    const PS: u32 = 4;
    const A: RequestId = RequestId(1);
    const B: RequestId = RequestId(2);

    /// A and B, three pages each, 9 tokens written; A's pages in row 1, B's in row 2, both read
    /// clean at 8 tokens then 9 (the second read incremental).
    struct Setup {
        table: OwnershipTable,
        held: HeldBlockTable,
        a: Vec<i32>,
        b: Vec<i32>,
    }

    fn setup() -> Setup {
        let table = OwnershipTable::new(PoolConfig::new(32, PS, 64)).unwrap();
        let mut held = HeldBlockTable::new(4, 6).unwrap();
        let mut own = Vec::new();
        for (req, row) in [(A, 1), (B, 2)] {
            table.admit(req, TenantId(1), 12, 0).unwrap();
            let pages: Vec<PageId> = table.allocate(req, 3).unwrap().iter().map(|r| r.page).collect();
            table.record_write_tokens(req, &pages, 0..9).unwrap();
            let entries: Vec<i32> = pages.iter().map(|p| p.0 as i32).collect();
            held.append(row, &entries).unwrap();
            own.push(entries);
        }
        let b = own.pop().unwrap();
        let a = own.pop().unwrap();
        let mut s = Setup { table, held, a, b };
        assert_eq!(s.read(&[(A, 1, 8), (B, 2, 8)]), vec![None, None]);
        assert_eq!(s.read(&[(A, 1, 9), (B, 2, 9)]), vec![None, None]);
        assert_eq!((s.held.full(), s.held.incremental()), (2, 2));
        s
    }

    impl Setup {
        /// Each `(request, row, tokens)` read: its refusal's kind and block index, if refused.
        fn read(&mut self, reads: &[(RequestId, u32, u64)]) -> Vec<Option<(ViolationKind, Option<u32>)>> {
            let step: Vec<RowRead> =
                reads.iter().map(|&(request, row, tokens)| RowRead { request, row, tokens }).collect();
            let v = self.table.check_held_rows(&mut self.held, &step).unwrap();
            let mut out = vec![None; reads.len()];
            for (i, v) in &v.refused {
                out[*i] = Some((v.kind(), v.block_index()));
            }
            out
        }
    }

    #[test]
    fn an_entry_set_below_what_was_read_whole_is_judged_in_full() {
        let mut s = setup();
        let mut row = s.a.clone();
        row[0] = s.b[0]; // B's page in A's row
        s.held.set_row(1, &row).unwrap();
        assert_eq!(s.read(&[(A, 1, 9)]), vec![Some((ViolationKind::ForeignPage, Some(0)))]);
        assert_eq!(s.held.full(), 3);
    }

    #[test]
    fn a_row_set_to_what_it_held_keeps_its_check() {
        let mut s = setup();
        let row = s.a.clone();
        s.held.set_row(1, &row).unwrap();
        assert_eq!(s.read(&[(A, 1, 9)]), vec![None]);
        assert_eq!((s.held.full(), s.held.incremental()), (2, 3));
    }

    #[test]
    fn a_row_truncated_and_grown_again_with_another_page_is_judged_in_full() {
        let mut s = setup();
        s.held.truncate(1, 1).unwrap();
        s.held.append(1, &[s.b[1], s.a[2]]).unwrap();
        assert_eq!(s.held.row(1), Some(&[s.a[0], s.b[1], s.a[2]][..]));
        assert_eq!(s.read(&[(A, 1, 9)]), vec![Some((ViolationKind::ForeignPage, Some(1)))]);
    }

    #[test]
    fn a_page_appended_past_the_check_is_read_anew() {
        let mut s = setup();
        s.held.truncate(1, 2).unwrap(); // the page read in part goes: nothing read whole
        s.held.append(1, &[s.b[2]]).unwrap();
        assert_eq!(s.read(&[(A, 1, 9)]), vec![Some((ViolationKind::ForeignPage, Some(2)))]);
        assert_eq!(s.held.incremental(), 2, "a refusal is judged in full");
    }

    #[test]
    fn a_cleared_row_reads_no_page() {
        let mut s = setup();
        s.held.clear_row(1).unwrap();
        assert_eq!(s.held.row(1), Some(&[][..]));
        assert_eq!(s.read(&[(A, 1, 9)]), vec![Some((ViolationKind::PageOutOfRange, Some(0)))]);
    }

    #[test]
    fn a_copied_row_takes_its_check_with_it() {
        let mut s = setup();
        s.held.copy_row(1, 3).unwrap();
        s.held.clear_row(1).unwrap();
        assert_eq!(s.read(&[(A, 3, 9)]), vec![None]);
        assert_eq!(s.held.incremental(), 3, "A's row moved, its check with it");
        // Copied over a checked row: that row's check is the copy's.
        s.held.copy_row(3, 2).unwrap();
        assert_eq!(s.read(&[(B, 2, 9)]), vec![Some((ViolationKind::ForeignPage, Some(0)))]);
    }

    #[test]
    fn swapped_rows_take_their_checks_with_them() {
        let mut s = setup();
        s.held.swap_rows(2, 1).unwrap();
        assert_eq!(s.held.row(1), Some(&s.b[..]));
        assert_eq!(s.read(&[(A, 2, 9), (B, 1, 9)]), vec![None, None]);
        assert_eq!(s.held.incremental(), 4);
        assert_eq!(s.read(&[(A, 1, 9)]), vec![Some((ViolationKind::ForeignPage, Some(0)))]);
    }

    #[test]
    fn a_right_taken_is_refused_in_a_row_left_as_it_was() {
        let mut s = setup();
        s.table.release_pages(A, &[PageId(s.a[2] as u32)]).unwrap();
        assert_eq!(s.read(&[(A, 1, 9)]), vec![Some((ViolationKind::FreedPage, Some(2)))]);
    }

    #[test]
    fn checked_against_another_table_each_row_starts_over() {
        let mut s = setup();
        let other = OwnershipTable::new(PoolConfig::new(32, PS, 64)).unwrap();
        let step = [RowRead { request: A, row: 1, tokens: 9 }];
        assert!(!other.check_held_rows(&mut s.held, &step).unwrap().is_clean());
        assert_eq!(s.read(&[(A, 1, 9)]), vec![None]);
        assert_eq!(s.held.full(), 4, "the other table's read, then this one's, in full");
    }

    #[test]
    fn changes_that_do_not_fit_are_refused_and_change_nothing() {
        let mut s = setup();
        let before = s.held.entries().to_vec();
        assert_eq!(s.held.append(1, &[1, 2, 3, 4]), Err(HeldRowsError::Width { row: 1, len: 7, width: 6 }));
        assert_eq!(s.held.set_row(1, &[0; 7]), Err(HeldRowsError::Width { row: 1, len: 7, width: 6 }));
        assert_eq!(s.held.append(4, &[1]), Err(HeldRowsError::Row { row: 4, rows: 4 }));
        assert_eq!(s.held.copy_row(1, 9), Err(HeldRowsError::Row { row: 9, rows: 4 }));
        assert_eq!(s.held.swap_rows(7, 1), Err(HeldRowsError::Row { row: 7, rows: 4 }));
        assert_eq!(s.held.truncate(4, 0), Err(HeldRowsError::Row { row: 4, rows: 4 }));
        assert_eq!(s.held.entries(), &before[..]);
        assert_eq!(s.read(&[(A, 1, 9), (B, 2, 9)]), vec![None, None]);
        assert_eq!(s.held.incremental(), 4);
    }

    #[test]
    fn a_table_too_large_to_index_is_refused() {
        assert_eq!(
            HeldBlockTable::new(usize::MAX / 2, 4).unwrap_err(),
            HeldRowsError::Size { rows: usize::MAX / 2, width: 4 }
        );
        assert!(HeldBlockTable::new(2, 1 << 33).is_err());
        assert_eq!(HeldBlockTable::new(0, 0).unwrap().entries().len(), 0);
    }

    #[test]
    fn a_read_past_the_table_is_an_error_and_checks_nothing() {
        let mut s = setup();
        let step = [RowRead { request: A, row: 1, tokens: 9 }, RowRead { request: B, row: 4, tokens: 9 }];
        assert_eq!(
            s.table.check_held_rows(&mut s.held, &step).unwrap_err(),
            RowsError::Row { index: 1, row: 4, rows: 4 }
        );
        assert_eq!(s.held.full() + s.held.incremental(), 4);
    }
}
