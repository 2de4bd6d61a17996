//! Request and tenant ids as engines have them: Python `int` or `str`.
//!
//! vLLM's `request_id` and SGLang's `rid` are strings. A string is *interned*: the table gives it
//! the next unused id, never a hash (a collision would merge two requests' ownership). The two id
//! spaces never meet: ints are `0..2**63`, interned strings take ids from `2**63 + 1` up.
//!
//! A request's string lives as long as the request: it is interned by `admit` (or `fork`, for the
//! child) and forgotten by `release`, or at once when the admission is refused. A tenant's string
//! lives while a live request of that tenant (or a sharing permission) holds it. So memory stays
//! flat over millions of requests.

use foldhash::{HashMap, HashSet};
use kvguard::{RequestId, TenantId};
use parking_lot::Mutex;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyList, PyString, PyTuple};

/// The first id of the interned strings' space; never handed out itself.
pub const STRING_IDS: u64 = 1 << 63;

/// The request id a string that is not interned maps to: never admitted, so the table refuses it
/// as an unknown request.
pub const UNKNOWN_REQUEST: RequestId = RequestId(STRING_IDS);

/// The tenant id a string that is not interned maps to: no request has it.
pub const UNKNOWN_TENANT: TenantId = TenantId(STRING_IDS);

/// A request or tenant id as the caller gave it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Key<'a> {
    /// An int id, `0..2**63`.
    Int(u64),
    /// A string id, to be interned.
    Name(&'a str),
}

/// Reads an id: a `str`, or an int in `0..2**63` (anything with `__index__`, numpy ints too).
pub fn key<'a>(obj: &'a Bound<'_, PyAny>, what: &str) -> PyResult<Key<'a>> {
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Key::Name(s.to_str()?));
    }
    if obj.is_instance_of::<PyBool>() {
        return Err(PyTypeError::new_err(format!("{what} must be an int or a str, got bool")));
    }
    // i64 first: i128 goes through a slow path under the limited API.
    match obj.extract::<i64>() {
        Ok(n) => int_key(i128::from(n), what),
        Err(_) => match obj.extract::<u64>() {
            Ok(n) => int_key(i128::from(n), what),
            Err(_) if obj.hasattr("__index__").unwrap_or(false) => {
                Err(PyValueError::new_err(format!("{what} is too large: int ids are 0..2**63")))
            }
            Err(_) => Err(PyTypeError::new_err(format!(
                "{what} must be an int or a str, got {}",
                obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
            ))),
        },
    }
}

/// An int id, checked to be in `0..2**63`.
pub fn int_key(n: i128, what: &str) -> PyResult<Key<'static>> {
    if n < 0 {
        Err(PyValueError::new_err(format!("{what} must be a non-negative int (0..2**63) or a str, got {n}")))
    } else if n >= i128::from(STRING_IDS) {
        Err(PyValueError::new_err(format!(
            "{what} {n} is too large: int ids are 0..2**63 (larger ids are kept for str ids)"
        )))
    } else {
        Ok(Key::Int(n as u64))
    }
}

/// The id objects of the last step read, by position. A scheduler passes the same `int` and
/// `str` objects step after step (vLLM keeps `input_batch.req_ids`), so an item that is the very
/// object seen at its position last time is not read again. A strong reference to each keeps the
/// object (so its value) alive and its address unique. A `str` read as an interned id stays
/// that id until the id is forgotten (ids are never handed out again), so the requests that
/// other requests' admissions and releases leave alone stay remembered: the names log the ids
/// they forget, and each read of a step first strikes those from the cache
/// (`Names::catch_up`). A `str` read as no interned id counts only while no string has been
/// interned since.
///
/// Kept as three arrays by position (each step's scan reads the objects' addresses alone while
/// every remembered id holds, then copies the ids: 16 bytes a request, where one record of all
/// three was 32).
#[derive(Debug, Default)]
pub struct StepIds {
    objects: Vec<Py<PyAny>>,
    requests: Vec<RequestId>,
    valid: Vec<Valid>,
    /// Entries whose `valid` may not hold (`Unknown`, `Stale`): while there are none, the scan
    /// need not read `valid`.
    unsettled: usize,
    /// Each remembered object's position, by its address: a step's event that names its request
    /// by the very object req_ids holds (vLLM's recorder and runner share the request's id
    /// string) finds the id without reading the string or the names' map ([`StepIds::known`]).
    at: HashMap<usize, u32>,
}

impl StepIds {
    fn len(&self) -> usize {
        self.objects.len()
    }

    /// Remembers `object` at position `i`, read as `request` (past the end but one, nothing is
    /// remembered). Dropping the object replaced (an exact int or str) runs no Python code.
    fn set(&mut self, i: usize, object: Py<PyAny>, request: RequestId, valid: Valid) {
        let Ok(pos) = u32::try_from(i) else { return };
        let address = object.as_ptr() as usize;
        if i < self.objects.len() {
            self.unsettled -= usize::from(self.valid[i].unsettled());
            let old = self.objects[i].as_ptr() as usize;
            if self.at.get(&old) == Some(&pos) {
                self.at.remove(&old);
            }
            self.objects[i] = object;
            self.requests[i] = request;
            self.valid[i] = valid;
        } else if i == self.objects.len() {
            self.objects.push(object);
            self.requests.push(request);
            self.valid.push(valid);
        } else {
            return;
        }
        self.at.insert(address, pos);
        self.unsettled += usize::from(valid.unsettled());
    }

    /// The id remembered for the very object at `address` (an exact int or str that a step's
    /// req_ids held, kept alive here, so the address is that object's), if it still holds with
    /// `interned` strings interned. The caller has caught the ids up with the names
    /// ([`Names::catch_up`]) under the lock it holds.
    pub fn known(&self, address: *mut ffi::PyObject, interned: u64) -> Option<RequestId> {
        let pos = *self.at.get(&(address as usize))? as usize;
        (self.objects.get(pos)?.as_ptr() == address && self.valid[pos].holds(interned)).then(|| self.requests[pos])
    }

    /// Forgets every entry (drops exact ints and strs only: no Python code runs).
    fn clear(&mut self) {
        self.at.clear();
        self.objects.clear();
        self.requests.clear();
        self.valid.clear();
        self.unsettled = 0;
    }
}

/// How long a remembered id holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Valid {
    /// An int: its id never changes.
    Always,
    /// A str read as a live interned id: until the id is forgotten (struck then).
    Live,
    /// A str read as no interned id, while the names' count of strings interned is this.
    Unknown(u64),
    /// Struck: read it again.
    Stale,
}

impl Valid {
    /// Whether it may stop holding without a strike (it is neither an int's nor a live id's).
    fn unsettled(self) -> bool {
        matches!(self, Valid::Unknown(_) | Valid::Stale)
    }

    /// Whether a remembered id still holds, the names having interned `interned` strings.
    fn holds(self, interned: u64) -> bool {
        match self {
            Valid::Always | Valid::Live => true,
            Valid::Unknown(at) => at == interned,
            Valid::Stale => false,
        }
    }
}

/// A step's request ids from a `list` or `tuple` (vLLM's `input_batch.req_ids`) into `out`
/// (what it held is dropped, its memory kept), or `None` when `seq` is neither. Read once per scheduler step, so exact `int`s and `str`s take a fast path:
/// items are borrowed (no reference counting), an item met at the same position last step is
/// taken from `cache` (when no other thread is using it), and the names lock is held only while
/// no Python code can run. Anything else (numpy ints, subclasses, wrong types) goes through
/// [`key`] with the lock released.
pub fn step_requests(
    seq: &Bound<'_, PyAny>,
    names: &Mutex<Names>,
    cache: &Mutex<StepIds>,
    out: &mut Vec<RequestId>,
) -> Option<PyResult<()>> {
    let (is_list, len) = if let Ok(list) = seq.cast::<PyList>() {
        (true, list.len())
    } else if let Ok(tuple) = seq.cast::<PyTuple>() {
        (false, tuple.len())
    } else {
        return None;
    };
    let mut cache = cache.try_lock();
    Some(read_step_requests(seq, is_list, len, names, cache.as_deref_mut(), out))
}

fn read_step_requests(
    seq: &Bound<'_, PyAny>,
    is_list: bool,
    len: usize,
    names: &Mutex<Names>,
    mut cache: Option<&mut StepIds>,
    out: &mut Vec<RequestId>,
) -> PyResult<()> {
    let py = seq.py();
    out.clear();
    out.reserve(len);
    let mut guard = Some(names.lock());
    if let (Some(n), Some(c)) = (guard.as_deref_mut(), cache.as_deref_mut()) {
        n.catch_up(c);
    }
    let mut interned = guard.as_ref().map_or(0, |n| n.interned);
    let get_item: unsafe extern "C" fn(*mut ffi::PyObject, ffi::Py_ssize_t) -> *mut ffi::PyObject =
        if is_list { ffi::PyList_GetItem } else { ffi::PyTuple_GetItem };
    // SAFETY: `seq` is a list or tuple (checked by the caller, `get_item` chosen to match), alive
    // for this borrow; the index is within `len`, and a list shortened meanwhile (only Python code
    // run by the slow path below can do that) makes the call return NULL, handled where it is
    // used. The item pointer is borrowed: it is used before any Python code runs (the slow path
    // takes an owned reference first).
    let get = |i: usize| unsafe { get_item(seq.as_ptr(), i as ffi::Py_ssize_t) };
    // The steady state first: the leading items that are the objects seen at their positions
    // last step, found in one pass and copied in another.
    let mut first = 0;
    if let Some(c) = cache.as_deref() {
        let known = len.min(c.len());
        let objects = &c.objects[..known];
        first = if c.unsettled == 0 {
            objects.iter().enumerate().position(|(i, o)| get(i) != o.as_ptr())
        } else {
            let valid = &c.valid[..known];
            objects.iter().zip(valid).enumerate().position(|(i, (o, v))| get(i) != o.as_ptr() || !v.holds(interned))
        }
        .unwrap_or(known);
        out.extend_from_slice(&c.requests[..first]);
    }
    for i in first..len {
        let item = get(i);
        if item.is_null() {
            drop(guard.take());
            return Err(PyErr::take(py).unwrap_or_else(|| PyValueError::new_err("req_ids changed while it was read")));
        }
        if let Some(c) = cache.as_deref()
            && i < c.len()
            && c.objects[i].as_ptr() == item
            && c.valid[i].holds(interned)
        {
            out.push(c.requests[i]);
            continue;
        }
        // SAFETY: `item` is a live object (non-null, borrowed from `seq`); reading its type
        // pointer is what Py_TYPE does.
        let ty = unsafe { ffi::Py_TYPE(item) };
        let fast = if ty == &raw mut ffi::PyLong_Type {
            let mut overflow = 0;
            // SAFETY: `item` is an exact int; with an overflow flag, no exception is set.
            let n = unsafe { ffi::PyLong_AsLongLongAndOverflow(item, &mut overflow) };
            (overflow == 0 && n >= 0).then_some((RequestId(n as u64), Valid::Always))
        } else if ty == &raw mut ffi::PyUnicode_Type {
            // SAFETY: `item` is live for this borrow and an exact str; from_ptr ties it to
            // this iteration and no Python code runs while it is used.
            let item = unsafe { Borrowed::from_ptr(py, item) };
            let item = item.cast::<PyString>()?;
            let key = Key::Name(item.to_str()?);
            let names = match guard {
                Some(ref mut n) => n,
                None => {
                    // Retaken after the slow path let it go: what was forgotten meanwhile is
                    // struck first.
                    let n = guard.insert(names.lock());
                    if let Some(c) = cache.as_deref_mut() {
                        n.catch_up(c);
                    }
                    n
                }
            };
            interned = names.interned;
            let request = names.request(key);
            Some((request, if request == UNKNOWN_REQUEST { Valid::Unknown(interned) } else { Valid::Live }))
        } else {
            None
        };
        // SAFETY: as above; to_owned takes a strong reference before any Python code runs.
        let owned = unsafe { Borrowed::from_ptr(py, item) }.to_owned();
        let Some((request, valid)) = fast else {
            // The slow path may run Python code (`__index__`): no lock held, the item owned.
            drop(guard.take());
            let key = key(&owned, "req_ids entry")?;
            let names = guard.insert(names.lock());
            if let Some(c) = cache.as_deref_mut() {
                names.catch_up(c);
            }
            interned = names.interned;
            out.push(names.request(key));
            continue;
        };
        out.push(request);
        // Only exact ints and strs are kept: their value cannot change while they are held.
        // Dropping the object replaced (an exact int or str) runs no Python code.
        if let Some(c) = cache.as_deref_mut() {
            c.set(i, owned.unbind(), request, valid);
        }
    }
    Ok(())
}

/// One interned string and how many holds keep it.
#[derive(Debug)]
struct Entry {
    name: Box<str>,
    holds: u64,
}

/// A name as the map from names to ids keeps it: its bytes in the map's own slot where they fit
/// (engines' request ids do: vLLM's are about 40 bytes), so a lookup compares bytes already in the
/// line it probed, rather than following a pointer to a heap string that a step of the engine's
/// own work has evicted (that second miss was about a tenth of vLLM's worker call, cold).
#[derive(Clone, Debug)]
enum NameKey {
    Inline { len: u8, bytes: [u8; NameKey::INLINE] },
    Heap(Box<[u8]>),
}

impl NameKey {
    /// The longest name kept inline: a slot of the map (key and id) is then 64 bytes.
    const INLINE: usize = 54;

    fn new(name: &str) -> NameKey {
        let b = name.as_bytes();
        if b.len() <= Self::INLINE {
            let mut bytes = [0; Self::INLINE];
            bytes[..b.len()].copy_from_slice(b);
            NameKey::Inline { len: b.len() as u8, bytes }
        } else {
            NameKey::Heap(b.into())
        }
    }

    fn bytes(&self) -> &[u8] {
        match self {
            NameKey::Inline { len, bytes } => &bytes[..usize::from(*len)],
            NameKey::Heap(b) => b,
        }
    }
}

/// Equal, hashed and borrowed as its bytes, so the map is looked up by `name.as_bytes()`.
impl PartialEq for NameKey {
    fn eq(&self, other: &NameKey) -> bool {
        self.bytes() == other.bytes()
    }
}

impl Eq for NameKey {}

impl std::hash::Hash for NameKey {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.bytes().hash(state);
    }
}

impl std::borrow::Borrow<[u8]> for NameKey {
    fn borrow(&self) -> &[u8] {
        self.bytes()
    }
}

/// One id space (requests or tenants): names to ids and back.
#[derive(Debug, Default)]
struct Space {
    ids: HashMap<NameKey, u64>,
    names: HashMap<u64, Entry>,
    next: u64,
}

impl Space {
    fn get(&self, name: &str) -> Option<u64> {
        self.ids.get(name.as_bytes()).copied()
    }

    /// The name's id, interned if new, with one more hold; and whether it was new.
    fn hold(&mut self, name: &str) -> (u64, bool) {
        if let Some(&id) = self.ids.get(name.as_bytes()) {
            if let Some(e) = self.names.get_mut(&id) {
                e.holds += 1;
            }
            return (id, false);
        }
        self.next += 1;
        let id = STRING_IDS + self.next;
        self.ids.insert(NameKey::new(name), id);
        self.names.insert(id, Entry { name: name.into(), holds: 1 });
        (id, true)
    }

    /// Drops one hold of `id`; the name is forgotten with its last hold.
    fn release(&mut self, id: u64) {
        if let Some(e) = self.names.get_mut(&id) {
            e.holds = e.holds.saturating_sub(1);
            if e.holds == 0
                && let Some(e) = self.names.remove(&id)
            {
                self.ids.remove(e.name.as_bytes());
            }
        }
    }

    fn name(&self, id: u64) -> Option<&str> {
        self.names.get(&id).map(|e| &*e.name)
    }
}

/// The names one table has interned.
#[derive(Debug, Default)]
pub struct Names {
    requests: Space,
    tenants: Space,
    /// The string tenant each live request holds.
    tenant_of: HashMap<u64, u64>,
    /// String tenants held by a sharing permission.
    sharing: HashSet<u64>,
    /// How many request strings have been interned (what a [`StepIds`] entry read as unknown
    /// checks).
    interned: u64,
    /// Request ids forgotten since the step ids last caught up; `None` once more than
    /// [`FORGOTTEN_LOG`] were (the step ids then start over).
    forgotten: Option<Vec<u64>>,
}

/// How many forgotten ids [`Names`] logs for the step ids before it gives up and has them start
/// over (a table whose steps are never read through [`step_requests`] keeps no more).
const FORGOTTEN_LOG: usize = 4096;

/// What [`Names::admit`] took, to be kept or given back.
#[derive(Clone, Copy, Debug)]
pub struct Admission {
    /// The request's id.
    pub request: RequestId,
    /// Its tenant's id.
    pub tenant: TenantId,
    new_request: bool,
    string_tenant: bool,
}

impl Names {
    /// How many request strings have been interned so far (what a remembered step id read as
    /// unknown is checked against).
    pub fn interned(&self) -> u64 {
        self.interned
    }

    /// The id of a request for a call that does not create it (a string never admitted maps to
    /// [`UNKNOWN_REQUEST`]).
    pub fn request(&self, key: Key<'_>) -> RequestId {
        match key {
            Key::Int(n) => RequestId(n),
            Key::Name(s) => self.requests.get(s).map(RequestId).unwrap_or(UNKNOWN_REQUEST),
        }
    }

    /// The id of a tenant for a call that does not hold it.
    pub fn tenant(&self, key: Key<'_>) -> TenantId {
        match key {
            Key::Int(n) => TenantId(n),
            Key::Name(s) => self.tenants.get(s).map(TenantId).unwrap_or(UNKNOWN_TENANT),
        }
    }

    /// Interns a request about to be admitted (a live string keeps its id: the table then
    /// refuses the duplicate) and holds its tenant. Give it back with [`Names::refused`] or keep
    /// it with [`Names::admitted`].
    pub fn admit(&mut self, request: Key<'_>, tenant: Key<'_>) -> Admission {
        let (request, new_request) = match request {
            Key::Int(n) => (RequestId(n), false),
            Key::Name(s) => {
                let (id, new) = self.requests.hold(s);
                self.interned += u64::from(new);
                if !new {
                    // A duplicate: the live request keeps the only hold.
                    self.requests.release(id);
                }
                (RequestId(id), new)
            }
        };
        let (tenant, string_tenant) = match tenant {
            Key::Int(n) => (TenantId(n), false),
            Key::Name(s) => (TenantId(self.tenants.hold(s).0), true),
        };
        Admission { request, tenant, new_request, string_tenant }
    }

    /// A child about to be forked from `parent`: interned like an admission, holding the
    /// parent's string tenant if it has one.
    pub fn fork(&mut self, parent: RequestId, child: Key<'_>) -> Admission {
        let tenant = self.tenant_of.get(&parent.0).copied();
        let mut a = self.admit(child, Key::Int(0));
        if let Some(t) = tenant {
            self.tenants.names.entry(t).and_modify(|e| e.holds += 1);
            a.tenant = TenantId(t);
            a.string_tenant = true;
        }
        a
    }

    /// The table admitted it: the request keeps its string and its tenant hold.
    pub fn admitted(&mut self, a: Admission) {
        if a.string_tenant
            && let Some(old) = self.tenant_of.insert(a.request.0, a.tenant.0)
        {
            self.tenants.release(old);
        }
    }

    /// The table refused it: a string interned for it is forgotten, the tenant hold dropped.
    pub fn refused(&mut self, a: Admission) {
        if a.new_request {
            self.release_request(a.request.0);
        }
        if a.string_tenant {
            self.tenants.release(a.tenant.0);
        }
    }

    /// The request ended: its string and its tenant hold are dropped.
    pub fn forget(&mut self, request: RequestId) {
        if request.0 > STRING_IDS {
            self.release_request(request.0);
        }
        if let Some(t) = self.tenant_of.remove(&request.0) {
            self.tenants.release(t);
        }
    }

    /// Drops a hold of request string `id`, logging it for the step ids (see [`StepIds`]).
    fn release_request(&mut self, id: u64) {
        self.requests.release(id);
        match &mut self.forgotten {
            Some(log) if log.len() < FORGOTTEN_LOG => log.push(id),
            _ => self.forgotten = None,
        }
    }

    /// Strikes from `ids` the ids forgotten since it last caught up (all of them, if the log
    /// overflowed), and empties the log.
    pub fn catch_up(&mut self, ids: &mut StepIds) {
        match self.forgotten.as_mut() {
            Some(log) if log.is_empty() => {}
            Some(log) => {
                log.sort_unstable();
                // The ids alone are read (the validity of a match only): a step's scan copies
                // them next anyway. Interned ids grow with time, so a range test settles most.
                let (lo, hi) = (log[0], log[log.len() - 1]);
                let StepIds { requests, valid, unsettled, .. } = ids;
                for (r, v) in requests.iter().zip(valid.iter_mut()) {
                    if r.0 < lo || r.0 > hi || log.binary_search(&r.0).is_err() {
                        continue;
                    }
                    if *v == Valid::Live {
                        *v = Valid::Stale;
                        *unsettled += 1;
                    }
                }
                log.clear();
            }
            None => {
                ids.clear();
                self.forgotten = Some(Vec::new());
            }
        }
    }

    /// A tenant's sharing permission: a str tenant is held while it allows sharing. Returns
    /// its id.
    pub fn share(&mut self, tenant: Key<'_>, allow: bool) -> TenantId {
        match tenant {
            Key::Int(n) => TenantId(n),
            Key::Name(s) => match (allow, self.tenants.get(s)) {
                (true, Some(id)) if self.sharing.contains(&id) => TenantId(id),
                (true, _) => {
                    let id = self.tenants.hold(s).0;
                    self.sharing.insert(id);
                    TenantId(id)
                }
                (false, Some(id)) => {
                    if self.sharing.remove(&id) {
                        self.tenants.release(id);
                    }
                    TenantId(id)
                }
                (false, None) => UNKNOWN_TENANT,
            },
        }
    }

    /// The string a request id was interned from, while the request lives.
    pub fn request_name(&self, id: RequestId) -> Option<&str> {
        self.requests.name(id.0)
    }

    /// The string a tenant id was interned from, while something holds it.
    pub fn tenant_name(&self, id: TenantId) -> Option<&str> {
        self.tenants.name(id.0)
    }

    /// Interned request and tenant strings held now.
    pub fn len(&self) -> (usize, usize) {
        (self.requests.names.len(), self.tenants.names.len())
    }

    /// A request id as Python sees it: its string while it lives, else the int.
    pub fn request_id(&self, id: RequestId) -> PyId {
        self.request_name(id).map_or(PyId::Int(id.0), |s| PyId::Name(s.into()))
    }

    /// A tenant id as Python sees it: its string while held, else the int.
    pub fn tenant_id(&self, id: TenantId) -> PyId {
        self.tenant_name(id).map_or(PyId::Int(id.0), |s| PyId::Name(s.into()))
    }

    /// The ids a violation names, as Python sees them.
    pub fn resolve(&self, v: &kvguard::Violation) -> Resolved {
        Resolved {
            request: v.request().map(|r| self.request_id(r)),
            tenant: v.tenant().map(|t| self.tenant_id(t)),
            owner: v.owner().map(|r| self.request_id(r)),
            owner_tenant: v.owner_tenant().map(|t| self.tenant_id(t)),
        }
    }
}

/// An id resolved under the names lock, turned into a Python object after it is dropped (making
/// Python objects may run Python code: the lock is never held then).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PyId {
    /// An int id (or a string id no longer interned).
    Int(u64),
    /// The string it was interned from.
    Name(Box<str>),
}

impl PyId {
    /// The Python object: `int` or `str`.
    pub fn to_py(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        Ok(match self {
            PyId::Int(n) => n.into_pyobject(py)?.into_any().unbind(),
            PyId::Name(s) => PyString::new(py, s).into_any().unbind(),
        })
    }
}

/// The ids a violation names, resolved.
#[derive(Clone, Debug, Default)]
pub struct Resolved {
    /// The request that did it.
    pub request: Option<PyId>,
    /// Its tenant.
    pub tenant: Option<PyId>,
    /// The page's owner.
    pub owner: Option<PyId>,
    /// The owner's tenant.
    pub owner_tenant: Option<PyId>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_get_fresh_ids_and_are_forgotten_with_the_request() {
        let mut names = Names::default();
        let a = names.admit(Key::Name("cmpl-1"), Key::Name("acme"));
        names.admitted(a);
        let b = names.admit(Key::Name("cmpl-2"), Key::Name("acme"));
        names.admitted(b);
        assert_ne!(a.request, b.request);
        assert_eq!(a.tenant, b.tenant);
        assert!(a.request.0 > STRING_IDS && b.request.0 > STRING_IDS);
        assert_eq!(names.request(Key::Name("cmpl-1")), a.request);
        assert_eq!(names.request(Key::Name("nope")), UNKNOWN_REQUEST);
        names.forget(a.request);
        assert_eq!(names.request(Key::Name("cmpl-1")), UNKNOWN_REQUEST);
        assert_eq!(names.len(), (1, 1));
        names.forget(b.request);
        assert_eq!(names.len(), (0, 0));
    }

    #[test]
    fn a_refused_admission_leaves_nothing_and_a_duplicate_keeps_the_live_one() {
        let mut names = Names::default();
        let a = names.admit(Key::Name("r"), Key::Name("t"));
        names.admitted(a);
        let dup = names.admit(Key::Name("r"), Key::Name("t"));
        assert_eq!(dup.request, a.request);
        names.refused(dup);
        assert_eq!(names.request(Key::Name("r")), a.request);
        assert_eq!(names.len(), (1, 1));
        let refused = names.admit(Key::Name("other"), Key::Int(3));
        names.refused(refused);
        assert_eq!(names.len(), (1, 1));
    }

    /// Names kept in the map's slot and names kept on the heap (either side of the longest kept
    /// inline, multi-byte characters, the empty name, names one a prefix of another) each get
    /// their own id, are found again by their text alone and are forgotten alone.
    #[test]
    fn a_name_is_found_by_its_text_whether_kept_inline_or_on_the_heap() {
        let n = NameKey::INLINE;
        let texts: Vec<String> = vec![
            String::new(),
            "a".into(),
            "a".repeat(n - 1),
            "a".repeat(n),
            "a".repeat(n + 1),
            "a".repeat(4 * n),
            format!("{}é", "a".repeat(n - 2)), // n + 1 bytes: on the heap
            format!("{}é", "a".repeat(n - 3)), // n bytes: inline
            "cmpl-0123456789abcdef0123456789abcdef-0".into(),
        ];
        let mut names = Names::default();
        let ids: Vec<RequestId> = texts
            .iter()
            .map(|t| {
                let a = names.admit(Key::Name(t), Key::Int(0));
                names.admitted(a);
                a.request
            })
            .collect();
        let distinct: std::collections::HashSet<_> = ids.iter().collect();
        assert_eq!(distinct.len(), texts.len(), "every text its own id");
        for (t, id) in texts.iter().zip(&ids) {
            assert_eq!(names.request(Key::Name(t)), *id, "{t:?}");
            assert_eq!(names.request_name(*id), Some(t.as_str()));
        }
        for (k, id) in ids.iter().enumerate() {
            names.forget(*id);
            assert_eq!(names.request(Key::Name(&texts[k])), UNKNOWN_REQUEST);
            for (t, other) in texts.iter().zip(&ids).skip(k + 1) {
                assert_eq!(names.request(Key::Name(t)), *other, "{t:?} after {:?} went", texts[k]);
            }
        }
        assert_eq!(names.len(), (0, 0));
    }
}
