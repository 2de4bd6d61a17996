//! SGLang's decode calls, judged against the plugin's mirror of its pool (kvguard.sglang's
//! arrays; see [`crate::mirror`]): a decode step's block-table writes claimed
//! (`claim_decode_slots`, and `write_decode_rows` with the mirror updated in place), and a
//! decode forward's first KV store recorded with each row's window checked
//! (`check_decode_forward`).

use super::row_reads::{row_index, slot_rows};
use super::verdict::StepVerdict;
use super::worker::step_error;
use super::{NUMPY, OwnershipTable};
use crate::arrays::{I64Mut, IntArray};
use crate::mirror;
use kvguard::RequestId;
use kvguard::step::{DecodeForward, DecodeOutcome, SlotRead};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

impl OwnershipTable {
    /// claim_decode_slots: the step's new pages claimed, the mirror read only.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn decode_slot_claims(
        &self,
        py: Python<'_>,
        row_keys: &Bound<'_, PyAny>,
        row_claimants: &Bound<'_, PyAny>,
        page_owner: &Bound<'_, PyAny>,
        page_prefix: &Bound<'_, PyAny>,
        rows: &Bound<'_, PyAny>,
        slots: &Bound<'_, PyAny>,
    ) -> PyResult<(StepVerdict, Vec<usize>, Py<PyAny>)> {
        let owner = IntArray::open(page_owner, "page_owner", 1)?;
        let arrays = MirrorArrays::open(row_keys, row_claimants, page_prefix, rows, slots)?;
        let owner = mirror::Lookup::new(&owner);
        let l = arrays.lookups();
        let mirror = l.mirror(&owner, self.table.config().num_pages)?;
        let writes = kvguard::step::decode_writes(mirror, &owner, &arrays.rows, &l.slots, self.table.page_size())
            .map_err(mirror::mirror_error)?;
        let table = &self.table;
        let v = py.detach(|| table.claim_decode(&writes));
        // (page, key) pairs as little-endian int64 bytes, numpy's view of them below.
        let never = self.table.config().num_pages as usize;
        let mut granted: Vec<u8> = Vec::with_capacity(writes.claims.len() * 16);
        for c in writes.granted(&v).filter(|c| c.at(never) < never) {
            granted.extend_from_slice(&i64::from(c.page.0).to_le_bytes());
            granted.extend_from_slice(&(c.request.0 as i64).to_le_bytes());
        }
        let np = NUMPY.get_or_try_init(py, || -> PyResult<Py<PyModule>> { Ok(py.import("numpy")?.unbind()) })?;
        let granted = np
            .bind(py)
            .call_method1("frombuffer", (pyo3::types::PyBytes::new(py, &granted), "<i8"))?
            .call_method1("reshape", (-1, 2))?;
        Ok((self.verdict(py, v, writes.claims.len(), true)?, writes.left, granted.unbind()))
    }

    /// write_decode_rows: the step's new pages claimed, the mirror updated in place.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn decode_row_writes(
        &self,
        py: Python<'_>,
        row_keys: &Bound<'_, PyAny>,
        row_claimants: &Bound<'_, PyAny>,
        page_owner: &Bound<'_, PyAny>,
        page_prefix: &Bound<'_, PyAny>,
        row_checked: &Bound<'_, PyAny>,
        rows: &Bound<'_, PyAny>,
        cols: &Bound<'_, PyAny>,
        slots: &Bound<'_, PyAny>,
    ) -> PyResult<Option<(StepVerdict, Vec<usize>)>> {
        let owner = I64Mut::open(page_owner, "page_owner")?;
        let arrays = MirrorArrays::open(row_keys, row_claimants, page_prefix, rows, slots)?;
        let checked = I64Mut::open(row_checked, "row_checked")?;
        let cols = IntArray::open(cols, "cols", 1)?;
        let read = [
            (&arrays.keys, "row_keys"),
            (&arrays.claimants, "row_claimants"),
            (&arrays.prefix, "page_prefix"),
            (&arrays.slots, "slots"),
            (&cols, "cols"),
        ];
        owner.apart("page_owner", &read, Some((&checked, "row_checked")))?;
        checked.apart("row_checked", &read, None)?;
        let cols = mirror::Lookup::new(&cols);
        let l = arrays.lookups();
        let mirror = l.mirror(&mirror::Written(&owner), self.table.config().num_pages)?;
        let write = kvguard::step::DecodeRowWrite { rows: &arrays.rows, cols: &cols, slots: &l.slots };
        // The core's write_decode_rows in its three parts: the plugin's arrays are read and
        // written with the GIL held (their SAFETY: see I64Mut), the table's claims made with it
        // released (as every call into the table is). Everything is checked before anything
        // changes.
        let (mut owner_w, mut checked_w) = (mirror::Written(&owner), mirror::Written(&checked));
        let writes =
            write.sort(mirror, &owner_w, checked.len(), self.table.page_size()).map_err(mirror::mirror_error)?;
        let table = &self.table;
        let v = if writes.claims.is_empty() {
            kvguard::StepVerdict::default() // the common step: nothing to claim, no GIL round trip
        } else {
            py.detach(|| table.claim_decode(&writes))
        };
        write.update_mirror(&writes, &v, &mut owner_w, &mut checked_w);
        if v.is_clean() && writes.left.is_empty() {
            return Ok(None);
        }
        Ok(Some((self.verdict(py, v, writes.claims.len(), true)?, writes.left)))
    }

    /// check_decode_forward: the forward's writes recorded, then each row's window checked.
    #[inline]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn decode_forward_check(
        &self,
        py: Python<'_>,
        row_keys: &Bound<'_, PyAny>,
        row_claimants: &Bound<'_, PyAny>,
        row_checked: &Bound<'_, PyAny>,
        req_to_token: &Bound<'_, PyAny>,
        rows: &Bound<'_, PyAny>,
        seq_lens: &Bound<'_, PyAny>,
        out_cache_loc: &Bound<'_, PyAny>,
    ) -> PyResult<Option<(&'static str, Option<StepVerdict>)>> {
        let keys = IntArray::open(row_keys, "row_keys", 1)?;
        let claimants = IntArray::open(row_claimants, "row_claimants", 1)?;
        mirror::check_rows("row_claimants", claimants.len(), keys.len())?;
        let checked = I64Mut::open(row_checked, "row_checked")?;
        mirror::check_rows("row_checked", checked.len(), keys.len())?;
        let t = IntArray::open(req_to_token, "req_to_token", 2)?;
        let rows = IntArray::open(rows, "rows", 1)?;
        let n = rows.len();
        // Rows and lengths are checked, then read in place (no list of them).
        mirror::check_step_rows(&rows, keys.len(), t.len())?;
        let row_at = mirror::Lookup::new(&rows);
        if u32::try_from(t.len()).is_err() {
            // Rows past u32::MAX exist in such a table: the core names rows in 32 bits.
            (0..n).try_for_each(|i| row_index(row_at.at(i) as u64).map(drop))?;
        }
        let lens = IntArray::open(seq_lens, "seq_lens", 1)?;
        mirror::check_positions("seq_lens", lens.len(), n)?;
        lens.check_counts(n, "seq_lens")?;
        let len_at = mirror::Lookup::new(&lens);
        let loc = IntArray::open(out_cache_loc, "out_cache_loc", 1)?;
        // Nothing read in place may share memory with row_checked, which this call writes.
        checked.apart(
            "row_checked",
            &[
                (&keys, "row_keys"),
                (&claimants, "row_claimants"),
                (&t, "req_to_token"),
                (&loc, "out_cache_loc"),
                (&rows, "rows"),
                (&lens, "seq_lens"),
            ],
            None,
        )?;
        // The mirror's int64 arrays read as slices (the per-row loops below are the call's cost).
        let (key_of, live) = (mirror::Lookup::new(&keys), mirror::Lookup::new(&claimants));
        if loc.len() != n {
            return Ok(Some(("full", None)));
        }
        // A row whose request claims nothing makes it a full check (nothing changed by it).
        if !(0..n).all(|i| live.at(row_at.at(i) as usize) != 0) {
            return Ok(Some(("full", None)));
        }
        let copied: Vec<i64>;
        let slots: &[i64] = match loc.as_i64() {
            Some(s) => s,
            None => {
                copied = (0..n).map(|i| loc.get(i, 0)).collect();
                &copied
            }
        };
        // Read `i`: its window starts at its row's checked length (rows and lengths checked
        // above: non-negative, within the arrays).
        let read = |i: usize| {
            let r = row_at.at(i) as usize;
            SlotRead {
                request: RequestId(key_of.at(r) as u64),
                row: r as u32,
                from: checked.get(r).max(0) as u64,
                tokens: len_at.at(i) as u64,
            }
        };
        let core = &self.table;
        // Each row's checked length as its window was read from (a row twice in the step moves
        // once, from the first).
        let read_from: Vec<i64> = (0..n).map(|i| checked.get(row_at.at(i) as usize)).collect();
        // The GIL stays held: the reads are made from the plugin's mirror and SGLang's arrays as
        // the core judges them (the arrays are read only with it), and the core calls no Python,
        // so the table's lock is never held by a thread that waits for the GIL.
        let outcome = match t.as_i32_rows() {
            // SGLang's int32 table, in place: nothing lists the step's reads.
            Some((entries, width)) => {
                let table =
                    kvguard::BlockRows::new(entries, width).map_err(|e| PyValueError::new_err(e.to_string()))?;
                core.decode_forward_by(n, read, slots, table)
            }
            // Any other table: the reads listed, their windows converted to int32.
            None => {
                let reads: Vec<SlotRead> = (0..n).map(read).collect();
                let mut converted = Vec::new();
                let (table, reads) = slot_rows(&t, reads, core.config(), &mut converted)?;
                core.decode_forward(&DecodeForward { reads: &reads, slots, rows: table })
            }
        }
        .map_err(step_error)?;
        match outcome {
            DecodeOutcome::Writes(written) => return Ok(Some(("writes", Some(self.verdict(py, written, n, true)?)))),
            DecodeOutcome::Window(_) => return Ok(Some(("window", None))),
            DecodeOutcome::Clean => {}
        }
        // Each row's checked length moves up to its length from the value its window was read
        // from (a row named twice: once).
        for (i, &was) in read_from.iter().enumerate() {
            let r = row_at.at(i) as usize;
            if checked.get(r) == was {
                checked.set(r, len_at.at(i));
            }
        }
        Ok(None)
    }
}

/// The mirror's read-only arrays and a decode row write's positions, opened (each argument's
/// type checked, named in its error); the core checks their lengths against each other.
struct MirrorArrays<'py> {
    keys: IntArray<'py>,
    claimants: IntArray<'py>,
    prefix: IntArray<'py>,
    rows: Vec<u64>,
    slots: IntArray<'py>,
}

impl<'py> MirrorArrays<'py> {
    fn open(
        row_keys: &Bound<'py, PyAny>,
        row_claimants: &Bound<'py, PyAny>,
        page_prefix: &Bound<'py, PyAny>,
        rows: &Bound<'py, PyAny>,
        slots: &Bound<'py, PyAny>,
    ) -> PyResult<Self> {
        let keys = IntArray::open(row_keys, "row_keys", 1)?;
        let claimants = IntArray::open(row_claimants, "row_claimants", 1)?;
        let prefix = IntArray::open(page_prefix, "page_prefix", 1)?;
        let rows = IntArray::open(rows, "rows", 1)?;
        let rows = rows.counts(rows.len(), "rows")?;
        let slots = IntArray::open(slots, "slots", 1)?;
        Ok(MirrorArrays { keys, claimants, prefix, rows, slots })
    }

    fn lookups(&self) -> MirrorLookups<'_, 'py> {
        MirrorLookups {
            keys: mirror::Lookup::new(&self.keys),
            claimants: mirror::Lookup::new(&self.claimants),
            prefix: mirror::Lookup::new(&self.prefix),
            slots: mirror::Lookup::new(&self.slots),
        }
    }
}

/// [`MirrorArrays`] read by index, as the core reads them.
struct MirrorLookups<'a, 'py> {
    keys: mirror::Lookup<'a, 'py>,
    claimants: mirror::Lookup<'a, 'py>,
    prefix: mirror::Lookup<'a, 'py>,
    slots: mirror::Lookup<'a, 'py>,
}

impl<'a, 'py> MirrorLookups<'a, 'py> {
    /// The core's mirror, checked against `page_owner` and the pool (`ValueError` naming the
    /// array).
    fn mirror(
        &self,
        page_owner: &impl kvguard::step::Ints,
        pool_pages: u32,
    ) -> PyResult<kvguard::step::PoolMirror<'_, mirror::Lookup<'a, 'py>>> {
        kvguard::step::PoolMirror::new(&self.keys, &self.claimants, &self.prefix, page_owner, pool_pages)
            .map_err(mirror::mirror_error)
    }
}
