//! Who wrote the KV bytes in each page's slots, as far as replay can tell: the forensic record
//! that the table's coverage cannot keep (coverage is per incarnation and cleared on release,
//! while the bytes stay in the page until they are overwritten or scrubbed).
//!
//! Per page, at most two runs of slots, newest first: the newest run hides the older one where
//! they overlap. A write by the run's own writer extends it (to the hull of both ranges: a run
//! may claim a gap its writer skipped). A third writer pushes the oldest run out, unless that
//! run is *forced* (a write the table refused but the engine made): then the two older runs
//! merge into one forced run over their hull, charged to the forced writer, so a foreign write
//! is never forgotten while its bytes may still be there (reads are refused on too many slots,
//! never on too few). Memory: 64 bytes per page, allocated with the pool.

use crate::ids::{PageId, RequestId, TenantId};

/// The tenant recorded for a writer replay could not name (a request never admitted).
pub(crate) const NO_TENANT: TenantId = TenantId(u64::MAX);

/// Slots `a..b` of a page last written by `req` of `tenant`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Run {
    pub req: RequestId,
    pub tenant: TenantId,
    pub a: u32,
    pub b: u32,
    /// Written by a write the table refused (the engine made it anyway).
    pub forced: bool,
}

const EMPTY: Run = Run { req: RequestId(0), tenant: NO_TENANT, a: 0, b: 0, forced: false };

impl Run {
    fn is_empty(&self) -> bool {
        self.a >= self.b
    }
    /// Slots of `a..b` this run covers.
    fn overlap(&self, a: u32, b: u32) -> (u32, u32) {
        (self.a.max(a), self.b.min(b))
    }
}

/// One page's runs, newest first.
type Runs = [Run; 2];

/// The writer record of a whole pool.
#[derive(Debug, Default)]
pub(crate) struct PageWriters {
    pages: Vec<Runs>,
    /// Forced runs alive: while there are none, a clean table verdict on a read is final and
    /// the read path never looks here.
    forced: usize,
}

/// A change in which runs refer to which tenants (the caller keeps the tenant names alive).
#[derive(Debug, Default)]
pub(crate) struct TenantRefs {
    pub added: Option<TenantId>,
    pub dropped: [Option<TenantId>; 2],
}

impl PageWriters {
    /// A record for `pages` pages, or `None` if the memory cannot be had.
    pub fn new(pages: u32) -> Option<PageWriters> {
        let mut v = Vec::new();
        v.try_reserve_exact(pages as usize).ok()?;
        v.resize(pages as usize, [EMPTY; 2]);
        Some(PageWriters { pages: v, forced: 0 })
    }

    /// Bytes per page of this record, for memory budgets.
    pub const BYTES_PER_PAGE: u64 = std::mem::size_of::<Runs>() as u64;

    /// Whether any forced run is alive.
    #[inline]
    pub fn any_forced(&self) -> bool {
        self.forced > 0
    }

    /// Records that `req` (of `tenant`, asked only when a new run starts) wrote slots `a..b` of `page`; `forced` when the table
    /// refused the write. Pages beyond the pool are ignored.
    #[inline]
    pub fn write(
        &mut self,
        page: PageId,
        a: u32,
        b: u32,
        req: RequestId,
        tenant: impl FnOnce() -> TenantId,
        forced: bool,
    ) -> TenantRefs {
        let mut refs = TenantRefs::default();
        let Some(runs) = self.pages.get_mut(page.0 as usize) else { return refs };
        if a >= b {
            return refs;
        }
        let top = runs[0];
        if !top.is_empty() && top.req == req && top.forced == forced && top.a <= b && a <= top.b {
            let (ta, tb) = (top.a.min(a), top.b.max(b));
            runs[0].a = ta;
            runs[0].b = tb;
            if runs[1].a >= ta && runs[1].b <= tb && !runs[1].is_empty() {
                refs.dropped[0] = Some(runs[1].tenant);
                self.forced -= usize::from(runs[1].forced);
                runs[1] = EMPTY;
            }
            return refs;
        }
        let tenant = tenant();
        let new = Run { req, tenant, a, b, forced };
        refs.added = Some(tenant);
        // Runs the new one hides entirely go; then the new one goes on top.
        let mut kept: [Run; 2] = [EMPTY; 2];
        let mut n = 0;
        for (i, old) in runs.iter().enumerate() {
            if old.is_empty() {
                continue;
            }
            if old.a >= a && old.b <= b {
                refs.dropped[i] = Some(old.tenant);
                self.forced -= usize::from(old.forced);
            } else {
                kept[n] = *old;
                n += 1;
            }
        }
        let under = match n {
            0 => EMPTY,
            1 => kept[0],
            _ => {
                // Three runs for two places: the oldest goes, or merges if a forced one is involved.
                let (newer, older) = (kept[0], kept[1]);
                if newer.forced || older.forced {
                    let charged = if newer.forced { newer } else { older };
                    let other = if newer.forced { older } else { newer };
                    refs.dropped[0] = Some(other.tenant);
                    self.forced -= usize::from(newer.forced && older.forced);
                    Run { a: newer.a.min(older.a), b: newer.b.max(older.b), forced: true, ..charged }
                } else {
                    refs.dropped[1] = Some(older.tenant);
                    newer
                }
            }
        };
        self.forced += usize::from(forced);
        *runs = [new, under];
        refs
    }

    /// The bytes of `page` are gone (poisoned or zeroed): its runs are dropped.
    pub fn scrub(&mut self, page: PageId) -> TenantRefs {
        let mut refs = TenantRefs::default();
        if let Some(runs) = self.pages.get_mut(page.0 as usize) {
            for (i, run) in runs.iter_mut().enumerate() {
                if !run.is_empty() {
                    refs.dropped[i] = Some(run.tenant);
                    self.forced -= usize::from(run.forced);
                    *run = EMPTY;
                }
            }
        }
        refs
    }

    /// The first forced run by someone other than `reader` visible in slots `0..need` of
    /// `page`, with the slots of it that are visible there.
    #[inline]
    pub fn foreign_forced(&self, page: PageId, need: u32, reader: RequestId) -> Option<Run> {
        let runs = self.pages.get(page.0 as usize)?;
        self.visible(runs, 0, need).find(|r| r.forced && r.req != reader)
    }

    /// Who wrote slots `0..need` of `page`: each visible run clipped to what it shows there
    /// (slots nobody is known to have written are not listed).
    pub fn writers(&self, page: PageId, need: u32) -> impl Iterator<Item = Run> + '_ {
        let runs = self.pages.get(page.0 as usize).copied().unwrap_or([EMPTY; 2]);
        let top = runs[0];
        let (ta, tb) = top.overlap(0, need);
        let under = runs[1];
        let (ua, ub) = under.overlap(0, need);
        // What the top run hides of the one under it: its visible part is the longer side.
        let below = (ua, ub.min(ta.max(ua)));
        let above = (ua.max(tb.min(ub)), ub);
        let shown = if below.1.saturating_sub(below.0) >= above.1.saturating_sub(above.0) { below } else { above };
        let both = [Run { a: ta, b: tb, ..top }, Run { a: shown.0, b: shown.1, ..under }];
        both.into_iter().filter(|r| !r.is_empty())
    }

    fn visible<'r>(&self, runs: &'r Runs, a: u32, b: u32) -> impl Iterator<Item = Run> + 'r {
        let top = runs[0];
        runs.iter().enumerate().filter_map(move |(i, r)| {
            let (x, y) = r.overlap(a, b);
            if x >= y {
                return None;
            }
            // The run under the top one shows where the top one does not cover it.
            if i == 1 && !top.is_empty() && top.a <= x && y <= top.b {
                return None;
            }
            Some(Run { a: x, b: y, ..*r })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: RequestId = RequestId(1);
    const B: RequestId = RequestId(2);
    const C: RequestId = RequestId(3);

    #[test]
    fn appends_extend_one_run_and_a_new_writer_layers_on_top() {
        let mut w = PageWriters::new(4).unwrap();
        let p = PageId(1);
        w.write(p, 0, 8, A, || TenantId(1), false);
        w.write(p, 8, 16, A, || TenantId(1), false);
        assert_eq!(w.writers(p, 16).map(|r| (r.req, r.a, r.b)).collect::<Vec<_>>(), [(A, 0, 16)]);
        w.write(p, 0, 4, B, || TenantId(2), false);
        assert_eq!(w.writers(p, 16).map(|r| (r.req, r.a, r.b)).collect::<Vec<_>>(), [(B, 0, 4), (A, 4, 16)]);
        w.write(p, 0, 16, B, || TenantId(2), false);
        assert_eq!(w.writers(p, 16).map(|r| (r.req, r.a, r.b)).collect::<Vec<_>>(), [(B, 0, 16)]);
    }

    #[test]
    fn a_forced_run_is_never_pushed_out() {
        let mut w = PageWriters::new(4).unwrap();
        let p = PageId(2);
        w.write(p, 0, 16, A, || TenantId(1), false);
        w.write(p, 4, 6, B, || TenantId(2), true);
        assert!(w.any_forced());
        assert_eq!(w.foreign_forced(p, 16, A).map(|r| (r.req, r.a, r.b)), Some((B, 4, 6)));
        assert_eq!(w.foreign_forced(p, 4, A), None, "slots 0..4 do not reach the forced run");
        assert_eq!(w.foreign_forced(p, 16, B), None, "a writer reads its own bytes");
        w.write(p, 10, 12, C, || TenantId(3), false);
        assert!(w.foreign_forced(p, 16, A).is_some_and(|r| r.req == B), "merged, still forced");
        // The owner rewrites everything: the forced bytes are gone.
        w.write(p, 0, 16, A, || TenantId(1), false);
        assert!(!w.any_forced());
        assert_eq!(w.foreign_forced(p, 16, A), None);
    }

    #[test]
    fn a_scrub_forgets_the_page() {
        let mut w = PageWriters::new(1).unwrap();
        w.write(PageId(0), 0, 3, B, || TenantId(2), true);
        let refs = w.scrub(PageId(0));
        assert_eq!(refs.dropped[0], Some(TenantId(2)));
        assert!(!w.any_forced());
        assert_eq!(w.writers(PageId(0), 16).count(), 0);
        assert_eq!(w.write(PageId(9), 0, 1, A, || TenantId(1), false).added, None, "beyond the pool");
    }
}
