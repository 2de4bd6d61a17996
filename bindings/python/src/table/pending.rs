//! `PendingStep` for Python: a worker step whose core part runs on kvguard's own thread while
//! the engine prepares the step's other inputs (`OwnershipTable.begin_record_and_verify_step`).
//!
//! What reads Python objects (the events, the arrays' shapes, req_ids) runs on the calling
//! thread before the step is begun; the core's step (`kvguard::OwnershipTable::engine_step`: the
//! events applied, the writes recorded, the rows judged with the table's row cache) runs on one
//! thread per process that kvguard starts on first use, with no Python object in reach, and
//! hands back what `apply_record_and_verify_step` would have returned. The engine's thread pays
//! for reading its own arguments; the core's step, whose cost is the table's memory read cold
//! after the engine's own step evicted it, runs on another core, whose caches keep the table
//! between steps.
//!
//! Order: every other call on the table first waits for a pending step ([`Pending::settle`]),
//! so a call made after `begin_record_and_verify_step` sees that step applied, as if the step
//! had run on the calling thread. Where the thread cannot be started (or a forked child has
//! none yet, until it starts its own) the step runs on the calling thread: the same verdicts.
//!
//! The one `unsafe` of this module gives the kvguard thread the table and the block table by
//! address: the `PendingStep` holds strong references to both Python objects and does not let
//! them go before the step has run (its `Drop` waits), and the caller does not write the block
//! table until `result()` (documented on `begin_record_and_verify_step`).

use super::{CoreOut, CoreStep, OwnershipTable, StepOutcome};
use crate::events::RefusedForPython;
use parking_lot::{Condvar, Mutex};
use pyo3::prelude::*;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Sender, channel};

/// A table's pending step, if any: what every other call on the table waits for first.
#[derive(Default)]
pub struct Pending {
    /// Whether `step` may hold a step not yet waited for (read without the lock on every call).
    any: AtomicBool,
    step: Mutex<Option<Arc<Done>>>,
}

impl Pending {
    /// Waits until the table's pending step (if any) has run.
    #[inline]
    pub fn settle(&self) {
        if self.any.load(Ordering::Acquire) {
            self.settle_slow();
        }
    }

    #[cold]
    #[inline(never)]
    fn settle_slow(&self) {
        let step = self.step.lock().take();
        if let Some(done) = step {
            done.wait();
        }
        self.any.store(false, Ordering::Release);
    }

    /// `done` is the table's pending step from now on.
    fn set(&self, done: Arc<Done>) {
        *self.step.lock() = Some(done);
        self.any.store(true, Ordering::Release);
    }
}

/// What the core's step hands back: its outcome and the step's room (its events and
/// requests, for the next step), or the panic that stopped it.
type JobOut = std::thread::Result<(CoreOut, CoreStep)>;

/// A begun step's result, once its job has run.
pub struct Done {
    state: Mutex<(bool, Option<JobOut>)>,
    finished: Condvar,
}

impl Done {
    fn new() -> Done {
        Done { state: Mutex::new((false, None)), finished: Condvar::new() }
    }

    fn finish(&self, out: JobOut) {
        let mut state = self.state.lock();
        *state = (true, Some(out));
        self.finished.notify_all();
    }

    /// Waits until the job has run.
    fn wait(&self) {
        let mut state = self.state.lock();
        while !state.0 {
            self.finished.wait(&mut state);
        }
    }

    /// Whether the job has run.
    fn is_finished(&self) -> bool {
        self.state.lock().0
    }

    /// Waits until the job has run and takes what it made (`None` once taken).
    fn take(&self) -> Option<JobOut> {
        let mut state = self.state.lock();
        while !state.0 {
            self.finished.wait(&mut state);
        }
        state.1.take()
    }
}

type Job = Box<dyn FnOnce() + Send + 'static>;

/// kvguard's thread in this process: the process it was started in (a forked child starts its
/// own) and where its jobs go.
static THREAD: Mutex<Option<(u32, Sender<Job>)>> = Mutex::new(None);

/// Hands `job` to kvguard's thread (started on first use); gives it back when the thread
/// cannot be started or reached.
fn submit(job: Job) -> Result<(), Job> {
    let mut thread = THREAD.lock();
    let pid = std::process::id();
    if !matches!(&*thread, Some((started_in, _)) if *started_in == pid) {
        let (sender, jobs) = channel::<Job>();
        let started = std::thread::Builder::new().name("kvguard-step".into()).spawn(move || {
            for job in jobs {
                job();
            }
        });
        *thread = started.ok().map(|_| (pid, sender));
    }
    match &*thread {
        Some((_, sender)) => sender.send(job).map_err(|e| e.0),
        None => Err(job),
    }
}

/// The block table a begun step reads: the engine's own int32 rows, in place, or the rows
/// converted from another array (owned).
pub enum StepRows {
    /// The engine's C-contiguous int32 table, by address (see [`StepRows::in_place`]).
    InPlace { entries: *const i32, len: usize, width: usize },
    /// Rows converted for the step.
    Converted { entries: Vec<i32>, width: usize },
}

// SAFETY: `InPlace` addresses memory of a Python object the `PendingStep` keeps alive until the
// job has run, and only reads it (i32 loads); `Converted` owns its rows.
unsafe impl Send for StepRows {}

impl StepRows {
    /// The engine's rows, read in place by the step (the caller keeps their owner alive).
    pub fn in_place(entries: &[i32], width: usize) -> StepRows {
        StepRows::InPlace { entries: entries.as_ptr(), len: entries.len(), width }
    }

    fn rows(&self) -> Result<kvguard::BlockRows<'_>, kvguard::RowsError> {
        match self {
            StepRows::InPlace { entries, len, width } => {
                // SAFETY: `entries .. entries + len` is the int32 buffer of the block table the
                // PendingStep holds a strong reference to (`rows_owner`) until this job has run
                // (its Drop waits for it); begin_record_and_verify_step's caller does not write
                // it meanwhile (its documented contract, as for any call reading an array in
                // place with the GIL released).
                let entries = unsafe { std::slice::from_raw_parts(*entries, *len) };
                kvguard::BlockRows::new(entries, *width)
            }
            StepRows::Converted { entries, width } => kvguard::BlockRows::new(entries, *width),
        }
    }
}

/// A begun step's token counts, copied when it is begun (an engine may update its own arrays
/// while the step runs).
pub struct StepCounts {
    computed: Vec<u64>,
    scheduled: Vec<u64>,
}

impl StepCounts {
    /// The first `n` of each.
    pub fn copied(computed: kvguard::step::Counts<'_>, scheduled: kvguard::step::Counts<'_>, n: usize) -> StepCounts {
        StepCounts {
            computed: (0..n).map(|i| computed.get(i)).collect(),
            scheduled: (0..n).map(|i| scheduled.get(i)).collect(),
        }
    }
}

/// The table, by address, for the job (see the module's safety argument).
struct TableAt(*const OwnershipTable);

// SAFETY: `OwnershipTable` is `Sync` (a frozen pyclass of locks and the core table); the address
// is only followed while the PendingStep holding the table's Python object waits for the job.
unsafe impl Send for TableAt {}

/// A worker step begun with OwnershipTable.begin_record_and_verify_step: its core part runs on
/// kvguard's thread while the caller goes on.
///
/// result() waits for it and returns what apply_record_and_verify_step returns, (refused_early,
/// writes, refused_late, reads), or raises what it would have raised; again on a second call.
/// done is True once the step has run. Every other call on the table waits for the step first.
/// A PendingStep let go of without result() still waits for its step (its violations are
/// logged, as every violation is).
#[pyclass(module = "kvguard")]
pub struct PendingStep {
    /// The job's result (`None`: a step that ran whole on the calling thread).
    done: Option<Arc<Done>>,
    /// The result, once taken from `done` (for a second call).
    result: Option<PyResult<Py<PyAny>>>,
    /// The early events' refusals when they were applied on the calling thread.
    refused_early: Option<RefusedForPython>,
    /// Requests in the step.
    n: usize,
    /// The table, kept alive while its step runs.
    table: Py<OwnershipTable>,
    /// The block table the step reads in place, kept alive while it runs.
    rows_owner: Option<Py<PyAny>>,
}

impl PendingStep {
    /// Begins `core` over `rows` on kvguard's thread (on this one when that thread cannot run
    /// it).
    pub(super) fn begin(
        table: &Bound<'_, OwnershipTable>,
        block_table: &Bound<'_, PyAny>,
        core: CoreStep,
        rows: StepRows,
        counts: StepCounts,
        refused_early: Option<RefusedForPython>,
        n: usize,
    ) -> PendingStep {
        let done = Arc::new(Done::new());
        let this = table.get();
        this.pending.set(Arc::clone(&done));
        let at = TableAt(std::ptr::from_ref(this));
        let finished = Arc::clone(&done);
        let job: Job = Box::new(move || {
            let at = at; // the whole wrapper (its Send), not its field
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                // SAFETY: see `TableAt`: the PendingStep made below keeps `table` alive and its
                // Drop waits for this job.
                let t = unsafe { &*at.0 };
                let out = match rows.rows() {
                    Ok(rows) => core.run(
                        &t.core_table,
                        &t.name_lock,
                        &t.worker_rows,
                        rows,
                        (&counts.computed).into(),
                        (&counts.scheduled).into(),
                    ),
                    Err(_) => CoreOut::stopped(kvguard::step::StepError::Shape {
                        requests: n,
                        computed: counts.computed.len(),
                        scheduled: counts.scheduled.len(),
                        rows: 0,
                    }),
                };
                (out, core)
            }));
            finished.finish(out);
        });
        if let Err(job) = submit(job) {
            table.py().detach(job);
        }
        PendingStep {
            done: Some(done),
            result: None,
            refused_early,
            n,
            table: table.clone().unbind(),
            rows_owner: Some(block_table.clone().unbind()),
        }
    }

    /// A step that ran whole on the calling thread.
    pub(super) fn ready(
        py: Python<'_>,
        table: &Bound<'_, OwnershipTable>,
        outcome: StepOutcome,
    ) -> PyResult<PendingStep> {
        Ok(PendingStep {
            done: None,
            result: Some(Ok(outcome.into_pyobject(py)?.into_any().unbind())),
            refused_early: None,
            n: 0,
            table: table.clone().unbind(),
            rows_owner: None,
        })
    }

    /// The step's outcome for Python, taken from its job (the room given back to the table).
    fn finish(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let Some(out) = self.done.as_deref().and_then(|done| py.detach(|| done.take())) else {
            return Err(pyo3::exceptions::PyRuntimeError::new_err("kvguard: the step's result was taken"));
        };
        self.rows_owner = None;
        let (out, core) = out
            .map_err(|_| pyo3::exceptions::PyRuntimeError::new_err("kvguard: the step panicked on kvguard's thread"))?;
        let table = self.table.get();
        if let Some(mut room) = table.step_room.try_lock() {
            (room.early, room.late, room.requests) = (core.early, core.late, core.requests);
        }
        let outcome = table.finish_worker_step(py, out, self.refused_early.take(), self.n)?;
        Ok(outcome.into_pyobject(py)?.into_any().unbind())
    }
}

#[pymethods]
impl PendingStep {
    /// Waits for the step and returns (refused_early, writes, refused_late, reads), or raises
    /// what apply_record_and_verify_step would have raised (again on a later call).
    fn result(&mut self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        if self.result.is_none() {
            self.result = Some(self.finish(py));
        }
        match &self.result {
            Some(Ok(outcome)) => Ok(outcome.clone_ref(py)),
            Some(Err(e)) => Err(e.clone_ref(py)),
            None => Err(pyo3::exceptions::PyRuntimeError::new_err("kvguard: no result")),
        }
    }

    /// Whether the step has run (result() then returns at once).
    #[getter]
    fn done(&self) -> bool {
        self.result.is_some() || self.done.as_deref().is_none_or(Done::is_finished)
    }
}

impl Drop for PendingStep {
    fn drop(&mut self) {
        if self.result.is_none() {
            // The job reads the table and the block table this object holds: wait for it, and
            // judge its outcome (its violations logged) so that nothing it found goes unsaid.
            Python::attach(|py| {
                let _ = self.finish(py);
            });
        }
    }
}

impl CoreOut {
    /// The outcome of a core step that could not run.
    pub(super) fn stopped(error: kvguard::step::StepError) -> CoreOut {
        CoreOut {
            outcome: Err(error),
            early: Ok(Vec::new()),
            written: Vec::new(),
            late: Ok(Vec::new()),
            read: Vec::new(),
        }
    }
}
