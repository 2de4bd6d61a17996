//! Whose memory an array's elements are. A view says where its elements lie (pointer, shape,
//! strides), and numpy passes on whatever it was told (`__array_interface__`, `as_strided`), so
//! a view alone proves nothing. What does: the object that owns the memory, found by walking
//! numpy's `base` chain, and the extent that owner gives of itself in an export it makes (a
//! buffer export of bytes, a bytearray, an `array.array`, an mmap or a numpy array that owns its
//! data; a DLPack capsule of a tensor library). A view is read only inside that extent.

use std::ops::Range;

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyByteArray, PyBytes, PyCapsule, PyDict, PyMemoryView, PyType};

use super::{beyond_address_space, dlpack, span, type_name};

/// How many links of a `base` chain are followed before it is refused (numpy collapses its own
/// chains to one link; a longer one is a wrapper's, or a cycle).
const MAX_CHAIN: usize = 32;

/// The types and addresses the walk recognises, looked up once per process.
#[derive(Debug)]
pub struct Known {
    /// `numpy.ndarray`.
    pub ndarray: Py<PyType>,
    /// `ndarray.__dict__["base"]`: numpy's own getter, which a subclass cannot override.
    base_getter: Py<PyAny>,
    /// `ndarray.__buffer__` (Python 3.12 and later): a subclass showing anything else exports
    /// its buffer from Python code.
    ndarray_buffer: Option<Py<PyAny>>,
    /// `type(object.__init__)`: what a type whose buffer export is C code shows as `__buffer__`.
    slot_wrapper: Py<PyType>,
    /// `array.array` and `mmap.mmap`: standard library owners of their memory.
    owner_types: [Py<PyType>; 2],
    /// numpy's DLPack deleters (v0, and v1 where numpy has it): a capsule with one of them
    /// describes the `ndarray` in its `manager_ctx`, as that array's view, not as an owner.
    numpy_deleters: Vec<usize>,
    /// numpy's array struct, read in place where a probe showed it as its export does.
    fields: Option<super::numpy::Layout>,
}

static KNOWN: PyOnceLock<Known> = PyOnceLock::new();

impl Known {
    /// The process's table, made on first use (importing numpy, `array` and `mmap`).
    pub fn get(py: Python<'_>) -> PyResult<&'static Known> {
        KNOWN.get_or_try_init(py, || {
            let numpy = py.import("numpy")?;
            let ndarray = numpy.getattr("ndarray")?.cast_into::<PyType>()?;
            let base_getter = ndarray.getattr("__dict__")?.get_item("base")?;
            let ndarray_buffer = ndarray.getattr("__buffer__").ok().map(Bound::unbind);
            let slot_wrapper = py.get_type::<pyo3::PyAny>().getattr("__init__")?.get_type().unbind();
            let array = py.import("array")?.getattr("array")?.cast_into::<PyType>()?.unbind();
            let mmap = py.import("mmap")?.getattr("mmap")?.cast_into::<PyType>()?.unbind();
            // numpy's deleters, by address, from a probe export of each capsule version.
            let probe = numpy.call_method1("zeros", (1,))?;
            let mut numpy_deleters = Vec::new();
            let v0 = probe.call_method0("__dlpack__")?.cast_into::<PyCapsule>()?;
            numpy_deleters.push(dlpack::read(&v0, "numpy's probe")?.deleter);
            let kw = PyDict::new(py);
            kw.set_item("max_version", (1, 0))?;
            if let Ok(v1) = probe.call_method("__dlpack__", (), Some(&kw)) {
                numpy_deleters.push(dlpack::read(v1.cast::<PyCapsule>()?, "numpy's probe")?.deleter);
            }
            // A probe that raises leaves every array to its export, as a layout that disagrees.
            let fields = super::numpy::Layout::probe(&numpy, &ndarray).ok().flatten();
            Ok(Known {
                fields,
                ndarray: ndarray.unbind(),
                base_getter: base_getter.unbind(),
                ndarray_buffer,
                slot_wrapper,
                owner_types: [array, mmap],
                numpy_deleters,
            })
        })
    }

    /// Whether `obj` is exactly a numpy array (not a subclass): numpy's own C code throughout.
    pub fn is_exact_ndarray(&self, obj: &Bound<'_, PyAny>) -> bool {
        obj.get_type().is(self.ndarray.bind(obj.py()))
    }

    /// `obj`'s description from numpy's struct, when it is exactly a numpy array of one or two
    /// dimensions holding native int32 or int64 and the struct's layout was probed.
    pub fn described<'a, 'py>(&self, obj: &'a Bound<'py, PyAny>) -> Option<super::numpy::Described<'a, 'py>> {
        self.fields.as_ref()?.describe(obj)
    }

    /// `obj`'s description from numpy's struct, when it is exactly a 1-D numpy array of native
    /// `dtype` elements and the struct's layout was probed.
    pub fn described_1d<'a, 'py>(
        &self,
        obj: &'a Bound<'py, PyAny>,
        dtype: super::numpy::Dtype,
    ) -> Option<super::numpy::Described<'a, 'py>> {
        self.fields.as_ref()?.describe_1d(obj, dtype)
    }

    /// Whether `obj` is a numpy array (or subclass).
    pub fn is_ndarray(&self, obj: &Bound<'_, PyAny>) -> bool {
        self.is_exact_ndarray(obj) || obj.is_instance(self.ndarray.bind(obj.py())).unwrap_or(false)
    }

    /// Whether a DLPack tensor was exported by numpy (its `manager_ctx` is then the array).
    pub fn numpy_exported(&self, t: &dlpack::Tensor) -> bool {
        t.deleter != 0 && self.numpy_deleters.contains(&t.deleter)
    }

    /// `TypeError` when `obj`'s buffer export is Python code (`__buffer__`, Python 3.12+): its
    /// extents would be whatever that code says. numpy subclasses must keep numpy's export.
    pub fn vet_exporter(&self, obj: &Bound<'_, PyAny>, name: &str) -> PyResult<()> {
        let py = obj.py();
        let Ok(export) = obj.get_type().getattr(intern!(py, "__buffer__")) else {
            return Ok(()); // Python 3.11: only types written in C export buffers.
        };
        let c_level = match &self.ndarray_buffer {
            Some(numpy) if self.is_ndarray(obj) => export.is(numpy.bind(py)),
            _ => export.get_type().is(self.slot_wrapper.bind(py)),
        };
        if c_level {
            return Ok(());
        }
        Err(PyTypeError::new_err(format!(
            "{name}: a {} exports its buffer from Python code (__buffer__), whose pointer and shape cannot be \
             checked: pass the array it wraps",
            type_name(obj)
        )))
    }

    /// numpy's `base` of the array `a` (numpy's own getter, whatever a subclass defines).
    pub fn base_of<'py>(&self, a: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let py = a.py();
        if self.is_exact_ndarray(a) {
            a.getattr(intern!(py, "base"))
        } else {
            self.base_getter.bind(py).call_method1(intern!(py, "__get__"), (a,))
        }
    }
}

/// An owner's buffer export (`PyBUF_FULL_RO`, any number of dimensions, 0-D included: pyo3's
/// `PyUntypedBuffer` refuses a 0-D export's null shape), released on drop.
struct Export(Box<ffi::Py_buffer>);

impl std::fmt::Debug for Export {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Export").field("buf", &self.0.buf).field("len", &self.0.len).finish()
    }
}

impl Export {
    /// `obj`'s export; `ValueError` when it refuses (a released memoryview, a closed mmap).
    fn get(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<Export> {
        let py = obj.py();
        let mut raw = Box::<ffi::Py_buffer>::new_uninit();
        // SAFETY: `obj` is live (we hold a reference) and `raw` is writable memory for one
        // Py_buffer; on success the exporter filled it and we own the export (released in
        // `Drop`), on failure there is nothing to release.
        let rc = unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), raw.as_mut_ptr(), ffi::PyBUF_FULL_RO) };
        if rc != 0 {
            let e = PyErr::fetch(py);
            let err = PyValueError::new_err(format!(
                "{name}: the {} that owns its memory refused a buffer export ({e})",
                type_name(obj)
            ));
            err.set_cause(py, Some(e));
            return Err(err);
        }
        // SAFETY: PyObject_GetBuffer succeeded, so it initialized the Py_buffer.
        Ok(Export(unsafe { raw.assume_init() }))
    }

    /// The bytes it covers (`None` when it has no element).
    fn span(&self, name: &str) -> PyResult<Option<Range<usize>>> {
        let b = &*self.0;
        let ptr = b.buf as usize;
        let len = usize::try_from(b.len).map_err(|_| beyond_address_space(name))?;
        if b.ndim == 0 || b.shape.is_null() || b.strides.is_null() {
            // One element (0-D) or a C-contiguous block: `len` bytes from `buf`.
            let end = ptr.checked_add(len).ok_or_else(|| beyond_address_space(name))?;
            return Ok((len > 0).then_some(ptr..end));
        }
        let ndim = usize::try_from(b.ndim).map_err(|_| beyond_address_space(name))?;
        // SAFETY: a strided export's shape and strides (non-null, checked) have `ndim` entries
        // each, alive until the export is released, which `self` delays.
        let (shape, strides) =
            unsafe { (std::slice::from_raw_parts(b.shape, ndim), std::slice::from_raw_parts(b.strides, ndim)) };
        if !b.suboffsets.is_null() {
            // SAFETY: as above, for the suboffsets array (non-null, checked).
            let sub = unsafe { std::slice::from_raw_parts(b.suboffsets, ndim) };
            if sub.iter().any(|&o| o >= 0) {
                return Err(PyValueError::new_err(format!("{name}: indirect (suboffset) buffers are not supported")));
            }
        }
        let dims = shape.iter().zip(strides).map(|(&n, &s)| (n.max(0) as usize, s));
        span(ptr, dims, usize::try_from(b.itemsize).unwrap_or(0)).map_err(|()| beyond_address_space(name))
    }

    /// Whether it is one contiguous block (C or Fortran order).
    fn contiguous(&self) -> bool {
        // SAFETY: a live export we own; PyBuffer_IsContiguous only reads it.
        unsafe { ffi::PyBuffer_IsContiguous(&*self.0, b'A' as std::ffi::c_char) == 1 }
    }
}

impl Drop for Export {
    fn drop(&mut self) {
        // SAFETY: an export we own, released once, attached to the interpreter.
        Python::attach(|_| unsafe { ffi::PyBuffer_Release(&mut *self.0) });
    }
}

/// What keeps an owner's memory alive (and, for a buffer export, unresizable) while it is read.
#[derive(Debug)]
enum Hold<'py> {
    /// The owner's buffer export.
    Buffer(#[allow(dead_code)] Export),
    /// The owner's DLPack capsule, unconsumed: freeing it calls the producer's deleter.
    Capsule(#[allow(dead_code)] Bound<'py, PyCapsule>),
    /// Nothing but the owner itself (`Extent::owner`): a torch tensor read by its attributes.
    Owner,
}

/// The memory an owner vouches for, held while a view of it is read.
#[derive(Debug)]
pub struct Extent<'py> {
    /// The owner's bytes (`None`: it has none).
    pub bytes: Option<Range<usize>>,
    /// The owner, named in errors.
    pub owner: Bound<'py, PyAny>,
    _hold: Hold<'py>,
}

impl<'py> Extent<'py> {
    /// `ValueError` unless every byte of `view` (its span; `None` for no element) is the owner's.
    pub fn contains(&self, view: Option<&Range<usize>>, name: &str) -> PyResult<()> {
        let Some(v) = view else { return Ok(()) };
        if self.bytes.as_ref().is_some_and(|o| o.start <= v.start && v.end <= o.end) {
            return Ok(());
        }
        let owner = match &self.bytes {
            Some(o) => format!("the {} bytes {:#x}..{:#x}", o.len(), o.start, o.end),
            None => "no bytes".into(),
        };
        Err(PyValueError::new_err(format!(
            "{name}: its elements reach bytes {:#x}..{:#x}, outside the memory of the {} that owns them ({owner}): \
             a shape, strides or pointer past its buffer (e.g. numpy.lib.stride_tricks.as_strided)",
            v.start,
            v.end,
            type_name(&self.owner)
        )))
    }

    fn exported(owner: Bound<'py, PyAny>, buf: Export, name: &str) -> PyResult<Extent<'py>> {
        let bytes = buf.span(name)?;
        Ok(Extent { bytes, owner, _hold: Hold::Buffer(buf) })
    }
}

/// The bytes a buffer export covers (`None` when it has no element).
pub fn export_span(buf: &PyUntypedBuffer, name: &str) -> PyResult<Option<Range<usize>>> {
    if buf.suboffsets().is_some_and(|s| s.iter().any(|&o| o >= 0)) {
        return Err(PyValueError::new_err(format!("{name}: indirect (suboffset) buffers are not supported")));
    }
    let dims = buf.shape().iter().copied().zip(buf.strides().iter().copied());
    span(buf.buf_ptr() as usize, dims, buf.item_size()).map_err(|()| beyond_address_space(name))
}

/// `TypeError` for a DLPack device the host cannot read.
pub fn device_refused(name: &str, device: (i32, i32)) -> PyErr {
    let kind = match device.0 {
        2 => "CUDA",
        4 => "OpenCL",
        7 => "Vulkan",
        8 => "Metal",
        9 => "VPI",
        10 => "ROCm",
        13 => "CUDA managed",
        14 => "oneAPI",
        _ => "non-host",
    };
    PyTypeError::new_err(format!(
        "{name} is in {kind} device memory (DLPack device ({}, {})): kvguard reads host arrays only; check device \
         block tables with kvguard.DeviceGuard (verify_block_table)",
        device.0, device.1
    ))
}

/// torch's `Tensor` type and `torch._C._to_dlpack`, once torch is imported: an exact tensor is
/// exported by torch's C++ directly (about 0.2 µs) instead of through `Tensor.__dlpack_device__`
/// and `Tensor.__dlpack__`, Python functions of about 2 and 3 µs (measured with torch 2.14).
static TORCH: PyOnceLock<Option<(Py<PyType>, Py<PyAny>)>> = PyOnceLock::new();

/// The torch fast path when torch is imported and has it (left unset until torch is imported).
fn torch_export(py: Python<'_>) -> Option<&'static (Py<PyType>, Py<PyAny>)> {
    if let Some(t) = TORCH.get(py) {
        return t.as_ref();
    }
    let modules = py.import("sys").ok()?.getattr("modules").ok()?;
    let torch = modules.get_item("torch").ok()?;
    let found = (|| {
        let tensor = torch.getattr("Tensor").ok()?.cast_into::<PyType>().ok()?;
        let to_dlpack = torch.getattr("_C").ok()?.getattr("_to_dlpack").ok()?;
        Some((tensor.unbind(), to_dlpack.unbind()))
    })();
    TORCH.get_or_init(py, || found).as_ref()
}

/// `obj`'s DLPack export, when it has one (`None`: no `__dlpack_device__`): its device asked
/// first and refused unless the host can read it, then the capsule and the tensor it describes.
/// An exact torch tensor is exported by torch's C++ (`torch._C._to_dlpack`, which touches no
/// data) and its device read from the capsule, torch's own description.
pub fn dlpack_export<'py>(
    obj: &Bound<'py, PyAny>,
    name: &str,
) -> PyResult<Option<(Bound<'py, PyCapsule>, dlpack::Tensor)>> {
    let py = obj.py();
    if let Some((tensor_type, to_dlpack)) = torch_export(py)
        && obj.get_type().is(tensor_type.bind(py))
        && let Ok(capsule) = to_dlpack.bind(py).call1((obj,))
    {
        let capsule = capsule.cast_into::<PyCapsule>().map_err(PyErr::from)?;
        let tensor = dlpack::read(&capsule, name)?;
        if !tensor.on_host() {
            return Err(device_refused(name, tensor.device));
        }
        return Ok(Some((capsule, tensor)));
    }
    if !obj.hasattr(intern!(py, "__dlpack_device__"))? {
        return Ok(None);
    }
    host_device(obj, name)?;
    capsule_of(obj, name).map(Some)
}

/// `obj.__dlpack_device__()`, refused unless the host can read it.
fn host_device(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<()> {
    let py = obj.py();
    let device: (i32, i32) =
        obj.call_method0(intern!(py, "__dlpack_device__")).and_then(|d| d.extract()).map_err(|e| {
            let err = PyTypeError::new_err(format!(
                "{name}: __dlpack_device__ did not name a host device ({e}): kvguard reads host arrays only; check \
                 device block tables with kvguard.DeviceGuard (verify_block_table)"
            ));
            err.set_cause(py, Some(e));
            err
        })?;
    if matches!(device.0, dlpack::DEVICE_CPU | dlpack::DEVICE_CUDA_HOST) {
        Ok(())
    } else {
        Err(device_refused(name, device))
    }
}

/// `obj.__dlpack__()` (after [`host_device`]) as a capsule and the tensor it describes, whose
/// device is checked again (the capsule is the producer's word, `__dlpack_device__` a method's).
fn capsule_of<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<(Bound<'py, PyCapsule>, dlpack::Tensor)> {
    let py = obj.py();
    let failed = |e: PyErr, what: &str| {
        let err = PyTypeError::new_err(format!("{name}: __dlpack__ {what} ({e})"));
        err.set_cause(py, Some(e));
        err
    };
    let capsule = obj
        .call_method0(intern!(py, "__dlpack__"))
        .map_err(|e| failed(e, "failed"))?
        .cast_into::<PyCapsule>()
        .map_err(|e| failed(e.into(), "did not return a capsule"))?;
    let tensor = dlpack::read(&capsule, name)?;
    if !tensor.on_host() {
        return Err(device_refused(name, tensor.device));
    }
    Ok((capsule, tensor))
}

/// The ndarray a numpy DLPack export describes (its `manager_ctx`, which the capsule holds).
pub fn numpy_array<'py>(
    known: &Known,
    capsule: &Bound<'py, PyCapsule>,
    t: &dlpack::Tensor,
    name: &str,
) -> PyResult<Bound<'py, PyAny>> {
    let py = capsule.py();
    if t.manager_ctx.is_null() {
        return Err(PyValueError::new_err(format!("{name}: numpy's DLPack capsule has no array")));
    }
    // SAFETY: a tensor with numpy's deleter was made by numpy's `__dlpack__`, whose
    // `manager_ctx` is the exported object (an ndarray, or a numpy scalar for v1), to which the
    // capsule holds a reference until its deleter runs; we hold the capsule, and take a
    // reference of our own here.
    let ctx = unsafe { Bound::from_borrowed_ptr(py, t.manager_ctx.cast()) };
    if !known.is_ndarray(&ctx) {
        return Err(PyTypeError::new_err(format!("{name}: numpy's DLPack capsule describes a {}", type_name(&ctx))));
    }
    Ok(ctx)
}

/// The extent of the object that owns the memory `obj` views: `obj` itself when it owns it,
/// else the end of its `base` chain (numpy arrays), `.obj` (memoryviews) or the array a numpy
/// DLPack capsule describes. `TypeError` when the chain ends where memory cannot be established.
pub fn owner_of<'py>(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<Extent<'py>> {
    let py = obj.py();
    let known = Known::get(py)?;
    let mut at = obj.clone();
    for _ in 0..MAX_CHAIN {
        // numpy arrays: a view's base, or the array itself when it has none (it owns its data,
        // or C code made it over memory it vouches for).
        if known.is_ndarray(&at) {
            let base = known.base_of(&at)?;
            if !base.is_none() {
                at = base;
                continue;
            }
            if !known.is_exact_ndarray(&at) {
                known.vet_exporter(&at, name)?;
            }
            let buf = Export::get(&at, name)?;
            return Extent::exported(at, buf, name);
        }
        if let Ok(view) = at.cast::<PyMemoryView>() {
            let inner = view.getattr(intern!(py, "obj")).map_err(|e| {
                let err = PyValueError::new_err(format!("{name}: a released memoryview"));
                err.set_cause(py, Some(e));
                err
            })?;
            if inner.is_none() {
                // Made by C code over memory it vouches for.
                let buf = Export::get(&at, name)?;
                return Extent::exported(at, buf, name);
            }
            at = inner;
            continue;
        }
        if at.is_exact_instance_of::<PyBytes>()
            || at.is_exact_instance_of::<PyByteArray>()
            || known.owner_types.iter().any(|t| at.is_exact_instance(t.bind(py)))
        {
            let buf = Export::get(&at, name)?;
            return Extent::exported(at, buf, name);
        }
        // numpy.from_dlpack keeps the producer's capsule as the array's base.
        if let Ok(capsule) = at.cast::<PyCapsule>() {
            let tensor = dlpack::read(capsule, name)?;
            if !tensor.on_host() {
                return Err(device_refused(name, tensor.device));
            }
            if known.numpy_exported(&tensor) {
                at = numpy_array(known, capsule, &tensor, name)?;
                continue;
            }
            return tensor_extent(at.clone(), capsule.clone(), tensor, name);
        }
        if let Some(extent) = torch_cpu_extent(&at) {
            return Ok(extent);
        }
        if let Some((capsule, tensor)) = dlpack_export(&at, name)? {
            if known.numpy_exported(&tensor) {
                at = numpy_array(known, &capsule, &tensor, name)?;
                continue;
            }
            return tensor_extent(at, capsule, tensor, name);
        }
        if super::exports_buffer(&at) {
            known.vet_exporter(&at, name)?;
            let buf = Export::get(&at, name)?;
            if !buf.contiguous() {
                return Err(PyTypeError::new_err(format!(
                    "{name}: its memory's owner, a {}, exports a strided view, not its own memory",
                    type_name(&at)
                )));
            }
            return Extent::exported(at, buf, name);
        }
        // Wrappers that name what they wrap (numpy's as_strided keeps the array as `.base`).
        if let Ok(base) = at.getattr(intern!(py, "base"))
            && !base.is_none()
        {
            at = base;
            continue;
        }
        return Err(PyTypeError::new_err(format!(
            "{name}: cannot establish whose memory it views: its base chain ends at a {}, which exports neither \
             a buffer nor DLPack (an __array_interface__ pointer is not checked)",
            type_name(&at)
        )));
    }
    Err(PyValueError::new_err(format!("{name}: its base chain is longer than {MAX_CHAIN} links")))
}

/// A numpy view of a torch CPU tensor (`tensor.numpy()`, vLLM's `CpuGpuBuffer.np`) whose
/// memory kvguard keeps alive across calls: the tensor's storage when the view was first
/// judged, held, with its bytes. torch makes a storage a numpy view was taken of unresizable, and
/// one held here is not freed when its tensor gets another (`set_`, `.data =`), so while its
/// data pointer stays the same (it moves only if torch swaps the data itself, e.g.
/// `share_memory_`), the view's memory is the storage's: a later call checks the view against
/// these bytes with one attribute read, not an export of the tensor.
struct Pinned {
    /// The view, weakly (a dead one's entry is dropped, and its storage let go).
    view: Py<pyo3::types::PyWeakrefReference>,
    /// The storage (a `torch.UntypedStorage`), strongly.
    storage: Py<PyAny>,
    bytes: Range<usize>,
}

/// The pinned views (see [`Pinned`]); an engine reads a handful of arrays a step.
static PINNED: parking_lot::Mutex<Vec<Pinned>> = parking_lot::Mutex::new(Vec::new());

/// How many views are pinned at most (the oldest is let go for a new one).
const PINNED_VIEWS: usize = 16;

/// The extent of `view`'s owner when `view` is a numpy view of an exact torch CPU tensor
/// (`base`) whose storage is pinned, or can be pinned now (see [`Pinned`]); `None` otherwise
/// (another thread holds the pins, the storage is resizable or not on the host, torch raised):
/// the caller then judges the view by [`owner_of`].
pub fn pinned_torch_view<'py>(view: &Bound<'py, PyAny>, base: &Bound<'py, PyAny>) -> Option<Extent<'py>> {
    let py = view.py();
    let (tensor_type, _) = torch_export(py)?;
    if !base.get_type().is(tensor_type.bind(py)) {
        return None;
    }
    let mut pins = PINNED.try_lock()?;
    let data_ptr = |storage: &Bound<'py, PyAny>| -> Option<usize> {
        storage.call_method0(intern!(py, "data_ptr")).ok()?.extract().ok()
    };
    if let Some(i) = pins.iter().position(|p| p.view.bind(py).upgrade().is_some_and(|v| v.is(view))) {
        let storage = pins[i].storage.bind(py).clone();
        if data_ptr(&storage) == Some(pins[i].bytes.start) {
            let bytes = pins[i].bytes.clone();
            return Some(Extent { bytes: Some(bytes), owner: storage, _hold: Hold::Owner });
        }
        pins.remove(i); // torch moved the data: judge it afresh
    }
    pins.retain(|p| p.view.bind(py).upgrade().is_some());
    let storage = base.call_method0(intern!(py, "untyped_storage")).ok()?;
    let flag = |v: PyResult<Bound<'py, PyAny>>| v.ok()?.extract::<bool>().ok();
    let host = storage.getattr(intern!(py, "device")).ok()?.getattr(intern!(py, "type")).ok()?;
    if flag(storage.call_method0(intern!(py, "resizable")))? || host.extract::<String>().ok()? != "cpu" {
        return None;
    }
    let start = data_ptr(&storage)?;
    let len: usize = storage.call_method0(intern!(py, "nbytes")).ok()?.extract().ok()?;
    let bytes = start..start.checked_add(len)?;
    if len == 0 {
        return None;
    }
    let weak = pyo3::types::PyWeakrefReference::new(view).ok()?;
    if pins.len() >= PINNED_VIEWS {
        pins.remove(0);
    }
    pins.push(Pinned { view: weak.unbind(), storage: storage.clone().unbind(), bytes: bytes.clone() });
    Some(Extent { bytes: Some(bytes), owner: storage, _hold: Hold::Owner })
}

/// An exact torch tensor's extent from its own description, without exporting it: a strided,
/// contiguous tensor on the CPU (pinned host memory too) holds its elements in
/// `data_ptr() .. data_ptr() + nbytes`. vLLM's host arrays are numpy views of such tensors, read
/// every step: four attribute reads where a DLPack export (torch's C++ building a managed tensor
/// and a capsule, then freeing them) cost about 200 lines of cache a view. `None` for anything
/// else, or when torch says otherwise or raises (a sparse tensor's `is_contiguous`): the DLPack
/// path then judges it.
fn torch_cpu_extent<'py>(at: &Bound<'py, PyAny>) -> Option<Extent<'py>> {
    let py = at.py();
    let (tensor_type, _) = torch_export(py)?;
    if !at.get_type().is(tensor_type.bind(py)) {
        return None;
    }
    let flag = |v: PyResult<Bound<'py, PyAny>>| v.ok()?.extract::<bool>().ok();
    if !flag(at.getattr(intern!(py, "is_cpu")))? || !flag(at.call_method0(intern!(py, "is_contiguous")))? {
        return None;
    }
    let ptr: usize = at.call_method0(intern!(py, "data_ptr")).ok()?.extract().ok()?;
    let len: usize = at.getattr(intern!(py, "nbytes")).ok()?.extract().ok()?;
    let bytes = (len > 0).then(|| ptr.checked_add(len).map(|end| ptr..end)).flatten();
    if len > 0 && bytes.is_none() {
        return None;
    }
    Some(Extent { bytes, owner: at.clone(), _hold: Hold::Owner })
}

/// A DLPack producer's tensor as an owner's extent: its span, as the producer describes it.
fn tensor_extent<'py>(
    owner: Bound<'py, PyAny>,
    capsule: Bound<'py, PyCapsule>,
    t: dlpack::Tensor,
    name: &str,
) -> PyResult<Extent<'py>> {
    let item = t.item_size().unwrap_or(1);
    let bytes = span(t.ptr, t.dims.iter().copied(), item).map_err(|()| beyond_address_space(name))?;
    Ok(Extent { bytes, owner, _hold: Hold::Capsule(capsule) })
}
