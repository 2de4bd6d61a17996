//! An engine plugin's mirror of its pool, and a decode step's row write judged against it.
//!
//! A plugin that sees an engine's allocator only through its arrays (SGLang's `req_to_token`
//! rows, written by a GPU kernel) keeps a *mirror* beside it: which request holds each row of
//! the engine's table (`row_keys`) and whether that request is live and claims pages
//! (`row_claimants`), which request owns each page exclusively and which radix prefix holds it
//! (`page_owner`, `page_prefix`: one entry per page of the pool and one more, which no key owns,
//! that every page id out of range reads), and how many tokens of each row the last check found
//! clean (`row_checked`). The mirror only says which calls a step needs; the table stays the
//! judge.
//!
//! A decode step writes one slot per row ([`DecodeRowWrite`]). [`decode_writes`] sorts its
//! positions: a page the row's request already owns is nothing new; a new page of a live row
//! that is no prefix is a claim ([`DecodeClaim`], once per request and page); anything else is
//! left to the plugin, in order. [`OwnershipTable::write_decode_rows`] does that, claims the new
//! pages in one judged [`claim_step`](OwnershipTable::claim_step), and updates the mirror
//! (`page_owner` for each claim granted, `row_checked` lowered to the column each row's write
//! rewrote), all checked before anything changes.
//!
//! ```
//! use kvguard::step::{DecodeRowWrite, PoolMirror};
//! use kvguard::{OwnershipTable, PoolConfig, RequestId, TenantId};
//! let table = OwnershipTable::new(PoolConfig::new(4, 16, 64))?;
//! table.admit(RequestId(7), TenantId(1), 32, 8)?;
//! // One row, request 7's (live, claiming); pages 0..4 and the out-of-range entry; no prefix.
//! let (keys, claimants, prefix) = ([7i64], [1i64], [0i64; 5]);
//! let mut owner = [0i64; 5];
//! let mut checked = [32i64];
//! let mirror = PoolMirror::new(&keys[..], &claimants[..], &prefix[..], &owner[..], table.config().num_pages)?;
//! // The row's token 32 lands in slot 2 * 16: page 2, new to request 7.
//! let write = DecodeRowWrite { rows: &[0], cols: &[32i64][..], slots: &[32i64][..] };
//! let out = table.write_decode_rows(mirror, &mut owner[..], &mut checked[..], write)?;
//! assert!(out.verdict.is_clean() && out.left.is_empty());
//! assert_eq!(owner[2], 7); // the mirror says what the table now says
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use crate::config::PageDiv;
use crate::ids::{PageId, RequestId};
use crate::table::{OwnershipTable, SeqClaim, StepVerdict};

/// Integers read by index: an array of the mirror as the engine's plugin keeps it (a slice of
/// `i64`, or whatever a binding reads in place without copying).
pub trait Ints {
    /// Its entries.
    fn len(&self) -> usize;
    /// Entry `i`; called only with `i < len()`.
    fn at(&self, i: usize) -> i64;
    /// Whether it has no entries.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// An array of the mirror that a step updates in place (`page_owner`, `row_checked`).
pub trait IntsMut: Ints {
    /// Sets entry `i` to `v`; called only with `i < len()`.
    fn set(&mut self, i: usize, v: i64);
}

impl Ints for [i64] {
    fn len(&self) -> usize {
        <[i64]>::len(self)
    }
    #[inline]
    fn at(&self, i: usize) -> i64 {
        self[i]
    }
}

impl IntsMut for [i64] {
    #[inline]
    fn set(&mut self, i: usize, v: i64) {
        self[i] = v;
    }
}

/// Why a mirror or a row write was not taken: nothing was claimed or changed. Each names the
/// argument as the bindings name it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MirrorError {
    /// A per-row array of the mirror is not as long as `row_keys`.
    #[error("{name} has {len} entries, row_keys {row_keys}")]
    RowArray {
        /// The array.
        name: &'static str,
        /// Its entries.
        len: usize,
        /// Entries of `row_keys`.
        row_keys: usize,
    },
    /// `page_owner` or `page_prefix` does not have one entry per page and one more (a shorter
    /// mirror would read pages the table grants as out of range, and claim them again every
    /// step).
    #[error("page_owner ({owner}) and page_prefix ({prefix}) must have one entry per page and one more ({want})")]
    PageArrays {
        /// Entries of `page_owner`.
        owner: usize,
        /// Entries of `page_prefix`.
        prefix: usize,
        /// The pool's pages plus one.
        want: usize,
    },
    /// A position names a row past `row_keys`.
    #[error("rows[{index}] is {row}: row_keys has {row_keys} rows")]
    Row {
        /// The position.
        index: usize,
        /// The row it names.
        row: u64,
        /// Entries of `row_keys`.
        row_keys: usize,
    },
    /// A per-position array is not as long as `rows` (`cols` may also have one entry for all).
    #[error("{name} has {len} entries, rows {rows}")]
    Positions {
        /// The array.
        name: &'static str,
        /// Its entries.
        len: usize,
        /// Entries of `rows`.
        rows: usize,
    },
    /// A row write of more positions than a claim can name (`u32::MAX`).
    #[error("a row write of {len} positions: at most {} are taken", u32::MAX)]
    TooManyPositions {
        /// Entries of `rows`.
        len: usize,
    },
}

/// The mirror's arrays a step reads, checked against each other and the pool
/// ([`PoolMirror::new`]). `A` is how they are held: slices of `i64` by default.
#[derive(Debug)]
pub struct PoolMirror<'a, A: Ints + ?Sized = [i64]> {
    row_keys: &'a A,
    row_claimants: &'a A,
    page_prefix: &'a A,
}

impl<A: Ints + ?Sized> Clone for PoolMirror<'_, A> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<A: Ints + ?Sized> Copy for PoolMirror<'_, A> {}

impl<'a, A: Ints + ?Sized> PoolMirror<'a, A> {
    /// The mirror of a pool of `pool_pages` pages: `row_keys` and `row_claimants` one entry per
    /// row of the engine's table, `page_prefix` and `page_owner` (of which only the length is
    /// read here) one per page and one more.
    pub fn new(
        row_keys: &'a A,
        row_claimants: &'a A,
        page_prefix: &'a A,
        page_owner: &(impl Ints + ?Sized),
        pool_pages: u32,
    ) -> Result<Self, MirrorError> {
        if row_claimants.len() != row_keys.len() {
            return Err(MirrorError::RowArray {
                name: "row_claimants",
                len: row_claimants.len(),
                row_keys: row_keys.len(),
            });
        }
        let want = pool_pages as usize + 1;
        if page_owner.len() != want || page_prefix.len() != want {
            return Err(MirrorError::PageArrays { owner: page_owner.len(), prefix: page_prefix.len(), want });
        }
        Ok(PoolMirror { row_keys, row_claimants, page_prefix })
    }

    /// Rows of the engine's table it covers.
    pub fn rows(&self) -> usize {
        self.row_keys.len()
    }

    /// The index every page id out of the pool reads (the last entry of the page arrays).
    fn never(&self) -> usize {
        self.page_prefix.len() - 1
    }
}

/// A decode step's row write: position `i` wrote slot `slots[i]` into row `rows[i]` of the
/// engine's table, at column `cols[i]` (one entry of `cols` applies to every position).
#[derive(Debug)]
pub struct DecodeRowWrite<'a, A: Ints + ?Sized = [i64]> {
    /// The row each position wrote.
    pub rows: &'a [u64],
    /// The column each position wrote (a negative one counts from the row's end: the whole
    /// row is checked again).
    pub cols: &'a A,
    /// The slot each position wrote.
    pub slots: &'a A,
}

impl<A: Ints + ?Sized> Clone for DecodeRowWrite<'_, A> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<A: Ints + ?Sized> Copy for DecodeRowWrite<'_, A> {}

/// One new page of a decode step's row write: the claim it needs. Sixteen bytes: SGLang at page
/// size 1 makes one a row every step, and a step's list of them is memory it touches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeClaim {
    /// The row's request (its key in `row_keys`).
    pub request: RequestId,
    /// The page the slot is in (`u32::MAX` for a slot no page of any pool holds).
    pub page: PageId,
    /// The first position of the write that made it (a write has at most `u32::MAX`
    /// positions: [`MirrorError::TooManyPositions`] past that).
    pub position: u32,
}

impl DecodeClaim {
    /// The page's index in the mirror's page arrays of `never + 1` entries: the page, or
    /// `never` (the last entry, which stands for every page out of the pool).
    pub fn at(&self, never: usize) -> usize {
        let page = self.page.0 as usize;
        if page < never { page } else { never }
    }
}

/// What a decode step's row write needs: the claims of new pages of live rows, and the
/// positions the table cannot take from the mirror alone (a row of no live request, a page of
/// a radix prefix), left to the plugin in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DecodeWrites {
    /// The claims, in the order of their first position.
    pub claims: Vec<DecodeClaim>,
    /// Positions left to the plugin.
    pub left: Vec<usize>,
}

impl DecodeWrites {
    /// The claims `verdict` (over [`claims`](Self::claims), as
    /// [`OwnershipTable::claim_decode`] gives it) granted, of pages in the pool: what the
    /// mirror's `page_owner` must now say.
    pub fn granted<'a>(&'a self, verdict: &'a StepVerdict) -> impl Iterator<Item = &'a DecodeClaim> + 'a {
        let mut refused = verdict.refused.iter().map(|(i, _)| *i).peekable();
        self.claims.iter().enumerate().filter_map(move |(k, c)| {
            while refused.next_if(|&i| i < k).is_some() {}
            if refused.next_if_eq(&k).is_some() { None } else { Some(c) }
        })
    }
}

/// Sorts a decode step's row write against the mirror (see the module doc): a page the row's
/// request owns in `page_owner` is nothing new; a new page of a live row (`row_claimants` not
/// 0) that no prefix holds (`page_prefix` 0) is a claim, once per request and page however many
/// positions write it; anything else is left, in order. A slot out of the pool reads the last
/// entry, which no key owns: it is claimed, and the table refuses it.
///
/// Position `i` wrote slot `slots[i]` into row `rows[i]`. `page_owner` is as long as the
/// mirror's page arrays (checked by [`PoolMirror::new`]). [`MirrorError`] where a position
/// names a row past the mirror or `slots` is not one entry per position.
pub fn decode_writes<A: Ints + ?Sized>(
    mirror: PoolMirror<'_, A>,
    page_owner: &(impl Ints + ?Sized),
    rows: &[u64],
    slots: &A,
    page_size: u32,
) -> Result<DecodeWrites, MirrorError> {
    check_positions(mirror, rows, slots)?;
    Ok(sort_writes(mirror, page_owner, rows, slots, page_size))
}

/// `rows` within the mirror, one slot per position.
fn check_positions<A: Ints + ?Sized>(mirror: PoolMirror<'_, A>, rows: &[u64], slots: &A) -> Result<(), MirrorError> {
    let row_keys = mirror.rows();
    if let Some((index, &row)) = rows.iter().enumerate().find(|(_, r)| **r >= row_keys as u64) {
        return Err(MirrorError::Row { index, row, row_keys });
    }
    if slots.len() != rows.len() {
        return Err(MirrorError::Positions { name: "slots", len: slots.len(), rows: rows.len() });
    }
    if u32::try_from(rows.len()).is_err() {
        // A claim names its position in 32 bits.
        return Err(MirrorError::TooManyPositions { len: rows.len() });
    }
    Ok(())
}

fn sort_writes<A: Ints + ?Sized>(
    mirror: PoolMirror<'_, A>,
    page_owner: &(impl Ints + ?Sized),
    rows: &[u64],
    slots: &A,
    page_size: u32,
) -> DecodeWrites {
    let div = PageDiv::new(page_size);
    let never = mirror.never();
    // A claim a row is the common step at page size 1 (every row opens a page); at larger
    // sizes most steps claim nothing.
    let claims = if page_size == 1 { Vec::with_capacity(rows.len()) } else { Vec::new() };
    let mut out = DecodeWrites { claims, left: Vec::new() };
    // Two positions claim one page for one request only where a row comes twice (a request
    // holds one row): then, and only then, claims are kept apart by (request, page).
    let mut seen_row = vec![false; mirror.rows()];
    let repeats = rows.iter().any(|&r| std::mem::replace(&mut seen_row[r as usize], true));
    let mut claimed = std::collections::HashSet::new();
    for (i, &row) in rows.iter().enumerate() {
        let row = row as usize;
        let key = mirror.row_keys.at(row);
        let page = div.floor_i64(slots.at(i));
        let at = usize::try_from(page).ok().filter(|&p| p < never).unwrap_or(never);
        // The last entry stands for every page out of range: no key owns it, whatever it holds.
        if at < never && page_owner.at(at) == key {
            continue;
        }
        if mirror.row_claimants.at(row) == 0 || mirror.page_prefix.at(at) != 0 {
            out.left.push(i);
            continue;
        }
        let page = PageId(u32::try_from(page).unwrap_or(u32::MAX));
        if repeats && !claimed.insert((key, page)) {
            continue;
        }
        // `i` fits: check_positions refused a write of more than u32::MAX positions.
        out.claims.push(DecodeClaim { request: RequestId(key as u64), page, position: i as u32 });
    }
    out
}

/// What [`OwnershipTable::write_decode_rows`] did: the claims it made, the verdict on them (in
/// order, judged: a refusal is counted, logged and, under enforce, quarantines its request) and
/// the positions left to the plugin.
#[derive(Debug, Default)]
pub struct RowWriteOutcome {
    /// The claims made.
    pub claims: Vec<DecodeClaim>,
    /// The verdict over `claims`, index for index.
    pub verdict: StepVerdict,
    /// Positions left to the plugin, in order.
    pub left: Vec<usize>,
}

impl RowWriteOutcome {
    /// Whether every position's page was its row's own or claimed cleanly (the common step).
    pub fn is_clean(&self) -> bool {
        self.verdict.is_clean() && self.left.is_empty()
    }
}

impl<A: Ints + ?Sized> DecodeRowWrite<'_, A> {
    /// The first part of [`OwnershipTable::write_decode_rows`]: checks the write against the
    /// mirror and the lengths of the two arrays it will update (`page_owner`, and `row_checked`
    /// of `row_checked_len` entries), and sorts its positions ([`decode_writes`]). Nothing
    /// changes. A binding that must let go of a lock of its own around the table's call
    /// (Python's GIL) runs the three parts itself: this, [`OwnershipTable::claim_decode`], then
    /// [`update_mirror`](Self::update_mirror).
    pub fn sort(
        &self,
        mirror: PoolMirror<'_, A>,
        page_owner: &(impl Ints + ?Sized),
        row_checked_len: usize,
        page_size: u32,
    ) -> Result<DecodeWrites, MirrorError> {
        if page_owner.len() != mirror.never() + 1 {
            return Err(MirrorError::PageArrays {
                owner: page_owner.len(),
                prefix: mirror.page_prefix.len(),
                want: mirror.never() + 1,
            });
        }
        if row_checked_len != mirror.rows() {
            return Err(MirrorError::RowArray { name: "row_checked", len: row_checked_len, row_keys: mirror.rows() });
        }
        let n = self.rows.len();
        if self.cols.len() != 1 && self.cols.len() != n {
            return Err(MirrorError::Positions { name: "cols", len: self.cols.len(), rows: n });
        }
        check_positions(mirror, self.rows, self.slots)?;
        Ok(sort_writes(mirror, page_owner, self.rows, self.slots, page_size))
    }

    /// The last part of [`OwnershipTable::write_decode_rows`]: each row's checked length drops
    /// to its column where that is lower (a negative column: to 0), and each claim `verdict`
    /// granted of a page in the pool sets `page_owner[page]` to its request's key. `writes` is
    /// what [`sort`](Self::sort) gave for this write and these arrays, `verdict`
    /// [`OwnershipTable::claim_decode`]'s over it. (Arrays other than those `sort` checked are
    /// written only where they have the entry: a misuse changes less, never panics.)
    pub fn update_mirror<M: IntsMut + ?Sized>(
        &self,
        writes: &DecodeWrites,
        verdict: &StepVerdict,
        page_owner: &mut M,
        row_checked: &mut M,
    ) {
        let one = self.cols.len() == 1;
        for (i, &row) in self.rows.iter().enumerate() {
            let (row, at) = (row as usize, if one { 0 } else { i });
            if row >= row_checked.len() || at >= self.cols.len() {
                continue;
            }
            let col = self.cols.at(at).max(0);
            if col < row_checked.at(row) {
                row_checked.set(row, col);
            }
        }
        let never = page_owner.len().saturating_sub(1);
        for c in writes.granted(verdict) {
            let at = c.at(never);
            if at < never {
                page_owner.set(at, c.request.0 as i64);
            }
        }
    }
}

impl OwnershipTable {
    /// The claims of a decode step's row write ([`decode_writes`]), each its own claim of one
    /// page, in one judged [`claim_step`](Self::claim_step); the verdict is over `writes.claims`,
    /// index for index.
    pub fn claim_decode(&self, writes: &DecodeWrites) -> StepVerdict {
        if writes.claims.is_empty() {
            return StepVerdict::default();
        }
        // Each claim made as it is read: no list of the step's pages or claims (SGLang at page
        // size 1 claims a page a row every step).
        self.claims_by(writes.claims.len(), |k| {
            let c = &writes.claims[k];
            SeqClaim { request: c.request, pages: std::slice::from_ref(&c.page) }
        })
    }

    /// A decode step's row write against the mirror, the mirror updated in place: each row's
    /// checked length `row_checked[rows[i]]` drops to `cols[i]` where that is lower (a negative
    /// column: to 0), the new pages are claimed ([`claim_decode`](Self::claim_decode)), and each
    /// claim granted of a page in the pool sets `page_owner[page]` to its request's key. The
    /// three parts, for a caller that runs them itself: [`DecodeRowWrite::sort`],
    /// [`claim_decode`](Self::claim_decode), [`DecodeRowWrite::update_mirror`].
    ///
    /// Everything is checked before anything changes ([`MirrorError`]: `page_owner` or
    /// `row_checked` of the wrong length, `cols` not one entry or one per position, and as
    /// [`decode_writes`]).
    pub fn write_decode_rows<A: Ints + ?Sized, M: IntsMut + ?Sized>(
        &self,
        mirror: PoolMirror<'_, A>,
        page_owner: &mut M,
        row_checked: &mut M,
        write: DecodeRowWrite<'_, A>,
    ) -> Result<RowWriteOutcome, MirrorError> {
        let writes = write.sort(mirror, &*page_owner, row_checked.len(), self.page_size())?;
        let verdict = self.claim_decode(&writes);
        write.update_mirror(&writes, &verdict, page_owner, row_checked);
        Ok(RowWriteOutcome { claims: writes.claims, verdict, left: writes.left })
    }
}
