//! A step's shadow claims and KV writes, one call each: `claim_step` (each request's pages a
//! span of one page array) and `record_step_writes` (vLLM's slot mapping and query start
//! locations); each request all or nothing and judged, the arrays read in place where their
//! layout allows, the GIL released.

use super::OwnershipTable;
use super::verdict::StepVerdict;
use crate::arrays::{IntArray, Ints};
use kvguard::{PageId, RequestId, SeqClaim, SeqWrite};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

impl OwnershipTable {
    /// claim_step: request `i` claims `pages[indptr[i]..indptr[i + 1]]`, judged.
    #[inline]
    pub(super) fn step_claims(
        &self,
        py: Python<'_>,
        req_ids: &Bound<'_, PyAny>,
        pages: &Bound<'_, PyAny>,
        indptr: &Bound<'_, PyAny>,
    ) -> PyResult<StepVerdict> {
        let requests = self.step_requests(req_ids)?;
        let n = requests.len();
        let pages = IntArray::open(pages, "pages", 1)?;
        let indptr = IntArray::open(indptr, "indptr", 1)?.counts(n + 1, "indptr")?;
        let spans = csr_spans(&indptr, pages.len(), "indptr", "pages")?;
        let mut buf = Vec::new();
        let all = pages_view(&pages, &mut buf);
        let claims: Vec<SeqClaim<'_>> =
            requests.iter().zip(spans).map(|(&request, span)| SeqClaim { request, pages: &all[span] }).collect();
        let table = &self.table;
        let v = py.detach(|| table.claim_step(&claims));
        drop(claims);
        self.verdict(py, v, n, true)
    }

    /// record_step_writes: request `i` wrote
    /// `slot_mapping[query_start_loc[i]..query_start_loc[i + 1]]`, judged.
    #[inline]
    pub(super) fn step_slot_writes(
        &self,
        py: Python<'_>,
        req_ids: &Bound<'_, PyAny>,
        slot_mapping: &Bound<'_, PyAny>,
        query_start_loc: &Bound<'_, PyAny>,
    ) -> PyResult<StepVerdict> {
        let requests = self.step_requests(req_ids)?;
        let n = requests.len();
        let slots = IntArray::open(slot_mapping, "slot_mapping", 1)?;
        let qsl = IntArray::open(query_start_loc, "query_start_loc", 1)?;
        if qsl.len() < n + 1 {
            return Err(PyValueError::new_err(format!("query_start_loc has {} entries, {} needed", qsl.len(), n + 1)));
        }
        // int64 slots are borrowed as they are; others are converted.
        let copied: Vec<i64> =
            if slots.as_i64().is_none() { (0..slots.len()).map(|j| slots.get(j, 0)).collect() } else { Vec::new() };
        let all: &[i64] = slots.as_i64().unwrap_or(&copied);
        let writes = match qsl.as_ints() {
            Some(Ints::I32(q)) => step_writes(&requests, &q[..=n], all)?,
            Some(Ints::I64(q)) => step_writes(&requests, &q[..=n], all)?,
            None => step_writes(&requests, &(0..=n).map(|i| qsl.get(i, 0)).collect::<Vec<_>>(), all)?,
        };
        let table = &self.table;
        let v = py.detach(|| table.record_step_writes(&writes));
        drop(writes);
        self.verdict(py, v, n, true)
    }
}

/// A step's writes: request `i` wrote `slots[qsl[i]..qsl[i + 1]]`. `qsl` has one entry more than
/// `requests`; every range must be within `slots` (one branch-free pass checks them all, then an
/// exact-size collect builds the writes: the common case is two tight loops).
fn step_writes<'a, T: Copy + Into<i64>>(
    requests: &[RequestId],
    qsl: &[T],
    slots: &'a [i64],
) -> PyResult<Vec<SeqWrite<'a>>> {
    let len = slots.len() as i64;
    let bad = |w: &[T]| (w[0].into() < 0) | (w[0].into() > w[1].into()) | (w[1].into() > len);
    if qsl.windows(2).fold(false, |any, w| any | bad(w)) {
        let i = qsl.windows(2).position(bad).unwrap_or(0);
        let (start, end) = (qsl[i].into(), qsl[i + 1].into());
        let what = if start < 0 { "must be >= 0" } else { "is not a range within slot_mapping" };
        return Err(PyValueError::new_err(format!(
            "query_start_loc[{i}..{}] = {start}..{end} {what} (slot_mapping has {len} entries)",
            i + 1
        )));
    }
    Ok(requests
        .iter()
        .zip(qsl.windows(2))
        .map(|(&request, w)| SeqWrite { request, slots: &slots[w[0].into() as usize..w[1].into() as usize] })
        .collect())
}

/// A step's CSR spans: entry `i` is `indptr[i]..indptr[i + 1]`, each a range within `len` items
/// (`what` names them in the `ValueError`).
fn csr_spans(indptr: &[u64], len: usize, name: &str, what: &str) -> PyResult<Vec<std::ops::Range<usize>>> {
    indptr
        .windows(2)
        .enumerate()
        .map(|(i, w)| {
            if w[0] > w[1] || w[1] > len as u64 {
                return Err(PyValueError::new_err(format!(
                    "{name}[{i}..{}] = {}..{} is not a range within {what} (length {len})",
                    i + 1,
                    w[0],
                    w[1]
                )));
            }
            Ok(w[0] as usize..w[1] as usize)
        })
        .collect()
}

/// A 1-D page array as page ids: int32 borrowed as it is, anything else converted into `buf`
/// (a value outside `0..2**32` becomes a page beyond any pool: refused as page_out_of_range).
fn pages_view<'a>(a: &'a IntArray<'_>, buf: &'a mut Vec<PageId>) -> &'a [PageId] {
    match a.row_pages(0) {
        Some(pages) => pages,
        None => {
            a.row_pages_into(0, a.len(), buf);
            buf
        }
    }
}
