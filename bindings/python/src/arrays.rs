//! Zero-copy views of the engine's integer arrays: numpy arrays, buffer-protocol objects and
//! host (CPU or pinned) DLPack tensors such as torch CPU tensors; int32 and int64; any strides (a
//! row stride that is not the row's width is honoured). Plain Python sequences of ints are
//! accepted for 1-D arguments and copied.
//!
//! An exact numpy array is described from numpy's own struct (module `numpy`, its layout probed
//! once against numpy's buffer export), anything else through its buffer export or DLPack.
//!
//! Nothing is read on an object's word alone: a view's elements must lie inside the memory of the
//! object that owns them (module `owner`), so a lying `__array_interface__`, an `as_strided` view past
//! its buffer or a tensor on a device is refused with a Python exception, never read. A device
//! tensor is refused before its data is touched (`__dlpack_device__`).
//!
//! The arrays must not be written, resized or freed by another thread while a call reads them
//! (the GIL is released during the check, as numpy does for its own loops).

mod dlpack;
mod numpy;
mod owner;

use std::ops::Range;

use kvguard::PageId;
use pyo3::buffer::{Element, PyBuffer, PyUntypedBuffer};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyList, PyTuple};

use owner::{Extent, Known};

/// The element type of an array kvguard reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    /// `int32` (vLLM's block table, FlashInfer's indices).
    I32,
    /// `int64` (vLLM's slot mapping; torch's default integer).
    I64,
}

impl Elem {
    fn size(self) -> usize {
        match self {
            Elem::I32 => 4,
            Elem::I64 => 8,
        }
    }
}

/// What keeps an array's memory alive while it is viewed.
#[derive(Debug)]
enum Keep<'py> {
    /// A buffer-protocol export (released on drop, with the GIL).
    Buffer(#[allow(dead_code)] PyUntypedBuffer),
    /// A numpy array read through its own struct: a reference to it.
    Array(#[allow(dead_code)] Bound<'py, PyAny>),
    /// A DLPack tensor's capsule, unconsumed: freeing it calls the producer's deleter.
    Capsule(#[allow(dead_code)] Bound<'py, PyCapsule>),
    /// A copy of a Python sequence.
    Owned(#[allow(dead_code)] Vec<i64>),
}

/// A 1-D or 2-D integer array borrowed from Python.
#[derive(Debug)]
pub struct IntArray<'py> {
    ptr: *const u8,
    elem: Elem,
    shape: [usize; 2],
    /// In bytes.
    strides: [isize; 2],
    ndim: usize,
    /// The bytes its elements span (`None`: it has none), inside its owner's memory.
    bytes: Option<Range<usize>>,
    _keep: Keep<'py>,
    /// The owner's export, when the owner is not the viewed object itself.
    _owner: Option<Extent<'py>>,
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}

/// Whether `obj`'s type implements the buffer protocol (no export is made).
fn exports_buffer(obj: &Bound<'_, PyAny>) -> bool {
    // SAFETY: `obj` is a live object (we hold a reference); PyObject_CheckBuffer only reads its
    // type's slots and sets no error.
    unsafe { pyo3::ffi::PyObject_CheckBuffer(obj.as_ptr()) == 1 }
}

/// The bytes `[first, last + item)` that the elements at `ptr + sum(i_k * stride_k)`, `i_k <
/// extent_k`, touch, negative strides included; `None` when there is no element; `Err` when the
/// offsets leave the address space. What every view is checked with against its owner.
fn span(ptr: usize, dims: impl IntoIterator<Item = (usize, isize)>, item: usize) -> Result<Option<Range<usize>>, ()> {
    let (mut lo, mut hi) = (0i128, 0i128);
    let mut empty = false;
    for (extent, stride) in dims {
        if extent == 0 {
            empty = true;
            continue;
        }
        let reach = (extent as i128 - 1).checked_mul(stride as i128).ok_or(())?;
        if reach < 0 {
            lo = lo.checked_add(reach).ok_or(())?;
        } else {
            hi = hi.checked_add(reach).ok_or(())?;
        }
    }
    if empty {
        return Ok(None);
    }
    let start = ptr as i128 + lo;
    let end = ptr as i128 + hi + item as i128;
    if start < 0 || end > usize::MAX as i128 {
        return Err(());
    }
    Ok(Some(start as usize..end as usize))
}

/// `ValueError` for a view whose shape and strides leave the address space.
#[cold]
#[inline(never)]
fn beyond_address_space(name: &str) -> PyErr {
    PyValueError::new_err(format!("{name}: its shape and strides reach beyond the address space"))
}

/// What an argument may be, for the `TypeError` that refuses anything else.
fn accepted(ndim: usize) -> String {
    format!(
        "a {ndim}-D int32 or int64 array (a numpy array, a buffer-protocol object or a host DLPack tensor such as a \
         torch CPU tensor){}",
        if ndim == 1 { ", or a sequence of ints" } else { "" }
    )
}

impl<'py> IntArray<'py> {
    /// Views `obj` as an int32 or int64 array of `ndim` dimensions; `name` names the argument
    /// in errors. `TypeError` for an object it cannot read (an `__array_interface__` alone, a
    /// device tensor, a wrong dtype), `ValueError` for a wrong shape or a view outside its owner's
    /// memory.
    pub fn open(obj: &Bound<'py, PyAny>, name: &str, ndim: usize) -> PyResult<IntArray<'py>> {
        let py = obj.py();
        if ndim == 1 && (obj.is_exact_instance_of::<PyList>() || obj.is_exact_instance_of::<PyTuple>()) {
            return Self::from_sequence(obj, name);
        }
        let known = Known::get(py)?;
        // Exact numpy arrays: the engines' arrays, the hot path (numpy's struct read in place;
        // the export, for anything the struct does not settle, names what is wrong).
        if known.is_exact_ndarray(obj) {
            let (mut a, base) = match Self::from_fields(known, obj, name, ndim)? {
                Some(read) => read,
                None => {
                    let a = Self::from_buffer(Self::export(obj, name)?, name, ndim)?;
                    let base = obj.getattr(intern!(py, "base"))?;
                    (a, (!base.is_none()).then_some(base))
                }
            };
            if let Some(base) = base {
                // vLLM's arrays: views of torch tensors, their storage pinned across calls.
                let owner = match owner::pinned_torch_view(obj, &base) {
                    Some(pinned) => pinned,
                    None => owner::owner_of(&base, name)?,
                };
                a.owned_by(owner, name)?;
            }
            return Ok(a);
        }
        if exports_buffer(obj) {
            known.vet_exporter(obj, name)?;
            let buf = Self::export(obj, name)?;
            let mut a = Self::from_buffer(buf, name, ndim)?;
            let is_owner = obj.is_exact_instance_of::<pyo3::types::PyBytes>()
                || obj.is_exact_instance_of::<pyo3::types::PyByteArray>();
            if !is_owner {
                a.owned_by(owner::owner_of(obj, name)?, name)?;
            }
            return Ok(a);
        }
        if let Some((capsule, tensor)) = owner::dlpack_export(obj, name)? {
            let owner = if known.numpy_exported(&tensor) {
                Some(owner::owner_of(&owner::numpy_array(known, &capsule, &tensor, name)?, name)?)
            } else {
                None // The producer's own description of its tensor (torch checks its strides).
            };
            let mut a = Self::from_tensor(capsule, &tensor, name, ndim)?;
            if let Some(owner) = owner {
                a.owned_by(owner, name)?;
            }
            return Ok(a);
        }
        if obj.hasattr(intern!(py, "__cuda_array_interface__"))? {
            return Err(PyTypeError::new_err(format!(
                "{name} is in device memory (__cuda_array_interface__): kvguard reads host arrays only; check \
                 device block tables with kvguard.DeviceGuard (verify_block_table)"
            )));
        }
        if obj.hasattr(intern!(py, "__array_interface__"))? {
            return Err(PyTypeError::new_err(format!(
                "{name} must be {}, got a {} exposing only __array_interface__, whose pointer and shape cannot \
                 be checked against the memory they claim",
                accepted(ndim),
                type_name(obj)
            )));
        }
        if ndim == 1 && !obj.is_instance_of::<pyo3::types::PyString>() && obj.try_iter().is_ok() {
            return Self::from_sequence(obj, name);
        }
        Err(PyTypeError::new_err(format!("{name} must be {}, got {}", accepted(ndim), type_name(obj))))
    }

    /// `obj`'s buffer export for reading; `ValueError` when the exporter refuses (a released
    /// memoryview).
    fn export(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<PyUntypedBuffer> {
        PyUntypedBuffer::get(obj).map_err(|e| {
            let err = PyValueError::new_err(format!("{name}: its buffer export failed ({e})"));
            err.set_cause(obj.py(), Some(e));
            err
        })
    }

    /// Checks that its elements lie in `owner`'s memory, and holds that memory while viewed.
    fn owned_by(&mut self, owner: Extent<'py>, name: &str) -> PyResult<()> {
        owner.contains(self.bytes.as_ref(), name)?;
        self._owner = Some(owner);
        Ok(())
    }

    /// A copy of the ints of a 1-D sequence.
    fn from_sequence(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<IntArray<'py>> {
        let mut v = Vec::new();
        for (i, item) in obj.try_iter()?.enumerate() {
            let item = item?;
            let value = item.extract::<i64>().map_err(|_| {
                if item.is_instance_of::<pyo3::types::PyInt>() {
                    // An int, out of the 64-bit range: a value error, not a wrong type.
                    let shown = item.str().map(|s| s.to_string()).unwrap_or_default();
                    PyValueError::new_err(format!("{name}[{i}] is {shown}: out of the int64 range"))
                } else {
                    PyTypeError::new_err(format!("{name} must hold ints, got a {}", type_name(&item)))
                }
            })?;
            v.push(value);
        }
        let ptr = v.as_ptr().cast::<u8>();
        let len = v.len();
        let bytes = (len > 0).then(|| ptr as usize..ptr as usize + len * 8);
        Ok(IntArray {
            ptr,
            elem: Elem::I64,
            shape: [len, 1],
            strides: [8, 8],
            ndim: 1,
            bytes,
            _keep: Keep::Owned(v),
            _owner: None,
        })
    }

    /// The element type of a buffer's struct-module format: a signed integer of 4 or 8 bytes,
    /// native or little-endian (parsed without allocating: this runs on every step call).
    fn elem_of(format: &[u8], item_size: usize, name: &str) -> PyResult<Elem> {
        let (order, code) = match *format {
            [code] => (b'@', code),
            [order, code] => (order, code),
            _ => (0, 0),
        };
        if matches!(order, b'>' | b'!') {
            return Err(PyTypeError::new_err(format!("{name} must be little-endian int32 or int64, got big-endian")));
        }
        let native = order == b'@';
        let size = match (code, native) {
            (b'i', _) => Some(4),
            (b'q', _) => Some(8),
            (b'l', true) => Some(std::mem::size_of::<std::ffi::c_long>()),
            (b'l', false) => Some(4),
            (b'n', true) => Some(std::mem::size_of::<isize>()),
            _ => None,
        };
        match size.filter(|&s| s == item_size && (native || matches!(order, b'=' | b'<'))) {
            Some(4) => Ok(Elem::I32),
            Some(8) => Ok(Elem::I64),
            _ => Err(PyTypeError::new_err(format!(
                "{name} must have dtype int32 or int64, got format {:?} ({item_size}-byte items)",
                String::from_utf8_lossy(format)
            ))),
        }
    }

    #[cold]
    #[inline(never)]
    fn wrong_ndim(name: &str, ndim: usize, shape: &[usize]) -> PyErr {
        PyValueError::new_err(format!("{name} must be {ndim}-D, got {} dimensions (shape {shape:?})", shape.len()))
    }

    fn from_buffer(buf: PyUntypedBuffer, name: &str, ndim: usize) -> PyResult<IntArray<'py>> {
        let elem = Self::elem_of(buf.format().to_bytes(), buf.item_size(), name)?;
        if buf.dimensions() != ndim {
            return Err(Self::wrong_ndim(name, ndim, buf.shape()));
        }
        let bytes = owner::export_span(&buf, name)?;
        let mut shape = [0, 1];
        let mut strides = [elem.size() as isize; 2];
        shape[..ndim].copy_from_slice(&buf.shape()[..ndim]);
        strides[..ndim].copy_from_slice(&buf.strides()[..ndim]);
        let ptr = buf.buf_ptr() as *const u8;
        Ok(IntArray { ptr, elem, shape, strides, ndim, bytes, _keep: Keep::Buffer(buf), _owner: None })
    }

    /// An exact numpy array of `ndim` dimensions holding native int32 or int64, from numpy's
    /// own struct (no export), and its `base`; `None` for anything else.
    #[allow(clippy::type_complexity)]
    fn from_fields(
        known: &owner::Known,
        obj: &Bound<'py, PyAny>,
        name: &str,
        ndim: usize,
    ) -> PyResult<Option<(IntArray<'py>, Option<Bound<'py, PyAny>>)>> {
        let Some(d) = known.described(obj) else { return Ok(None) };
        if d.dims.len() != ndim || d.dims.iter().any(|&n| n < 0) {
            return Ok(None);
        }
        let elem = if d.item == 4 { Elem::I32 } else { Elem::I64 };
        let mut shape = [0, 1];
        let mut strides = [d.item as isize; 2];
        for (k, (&n, &stride)) in d.dims.iter().zip(d.strides).enumerate() {
            (shape[k], strides[k]) = (n as usize, stride);
        }
        let bytes = span(d.ptr, shape[..ndim].iter().copied().zip(strides[..ndim].iter().copied()), d.item)
            .map_err(|()| beyond_address_space(name))?;
        let a = IntArray {
            ptr: d.ptr as *const u8,
            elem,
            shape,
            strides,
            ndim,
            bytes,
            _keep: Keep::Array(obj.clone()),
            _owner: None,
        };
        Ok(Some((a, d.base)))
    }

    fn from_tensor(
        capsule: Bound<'py, PyCapsule>,
        t: &dlpack::Tensor,
        name: &str,
        ndim: usize,
    ) -> PyResult<IntArray<'py>> {
        let elem = if t.is_int(32) {
            Elem::I32
        } else if t.is_int(64) {
            Elem::I64
        } else {
            let (code, bits, lanes) = t.dtype;
            return Err(PyTypeError::new_err(format!(
                "{name} must have dtype int32 or int64, got DLPack dtype (code {code}, bits {bits}, lanes {lanes})"
            )));
        };
        if t.dims.len() != ndim {
            let shape: Vec<usize> = t.dims.iter().map(|d| d.0).collect();
            return Err(Self::wrong_ndim(name, ndim, &shape));
        }
        let bytes = span(t.ptr, t.dims.iter().copied(), elem.size()).map_err(|()| beyond_address_space(name))?;
        let mut shape = [0, 1];
        let mut strides = [elem.size() as isize; 2];
        for (i, &(extent, stride)) in t.dims.iter().enumerate() {
            shape[i] = extent;
            strides[i] = stride;
        }
        let ptr = t.ptr as *const u8;
        Ok(IntArray { ptr, elem, shape, strides, ndim, bytes, _keep: Keep::Capsule(capsule), _owner: None })
    }

    /// The element type.
    pub fn elem(&self) -> Elem {
        self.elem
    }

    /// Length of the first dimension.
    pub fn len(&self) -> usize {
        self.shape[0]
    }

    /// Whether the first dimension is empty.
    pub fn is_empty(&self) -> bool {
        self.shape[0] == 0
    }

    /// The addresses its elements span, first byte to one past the last (empty when it has no
    /// element): what [`I64Mut::apart`] compares.
    pub fn span(&self) -> Range<usize> {
        self.bytes.clone().unwrap_or(0..0)
    }

    /// Length of the second dimension (1 for a 1-D array).
    pub fn width(&self) -> usize {
        if self.ndim == 2 { self.shape[1] } else { 1 }
    }

    /// Element `(i, j)` (`j` = 0 for 1-D), widened to `i64`. Bounds are the caller's: `i <
    /// len()`, `j < width()` (checked, a violation is a bug of this crate and panics inside
    /// PyO3's guard, never across the boundary).
    pub fn get(&self, i: usize, j: usize) -> i64 {
        assert!(i < self.shape[0] && j < self.width(), "index within the array's shape");
        let at = self.ptr.wrapping_offset(i as isize * self.strides[0] + j as isize * self.strides[1]);
        // SAFETY: `(i, j)` is within the shape (asserted), so `at` is an element of the viewed
        // array, whose memory `_keep` keeps alive; read_unaligned needs no alignment.
        unsafe {
            match self.elem {
                Elem::I32 => i64::from(at.cast::<i32>().read_unaligned()),
                Elem::I64 => at.cast::<i64>().read_unaligned(),
            }
        }
    }

    /// Whether the second dimension (or the only one) is contiguous and aligned for the element
    /// type, so rows can be borrowed as slices.
    fn rows_contiguous(&self) -> bool {
        let inner = if self.ndim == 2 { self.strides[1] } else { self.strides[0] };
        let size = self.elem.size();
        let aligned = (self.ptr as usize).is_multiple_of(size) && (self.strides[0].unsigned_abs()).is_multiple_of(size);
        (inner == size as isize || (self.width() <= 1 && self.ndim == 2)) && aligned
    }

    /// Row `i` (of a 2-D array; the whole array for 1-D, `i` = 0) as page ids without copying,
    /// when it is int32, contiguous and aligned. A negative int32 reads as a page id of 2**31 or
    /// more: beyond any pool, refused as `page_out_of_range`, never a real page.
    pub fn row_pages(&self, i: usize) -> Option<&[PageId]> {
        if self.elem != Elem::I32 || !self.rows_contiguous() || i >= self.rows() {
            return None;
        }
        let len = if self.ndim == 2 { self.shape[1] } else { self.shape[0] };
        if len == 0 {
            return Some(&[]);
        }
        let at = self.ptr.wrapping_offset(if self.ndim == 2 { i as isize * self.strides[0] } else { 0 });
        // SAFETY: `at` is row `i`'s first element: `len` contiguous int32s (inner stride 4,
        // checked above), aligned to 4 (checked), kept alive by `_keep` for the borrow of
        // `self`. `PageId` is `#[repr(transparent)]` over `u32`, which has the size and
        // alignment of `i32`, and every bit pattern is a valid `u32`.
        Some(unsafe { std::slice::from_raw_parts(at.cast::<PageId>(), len) })
    }

    /// The whole 2-D array as its int32 entries, row after row, and the row length, without
    /// copying: when it is int32, C-contiguous (each row right after the one before) and aligned.
    /// A negative entry reads as a page past any pool where it is read as a page id.
    pub fn as_i32_rows(&self) -> Option<(&[i32], usize)> {
        let width = self.shape[1];
        if self.ndim != 2 || self.elem != Elem::I32 || !self.rows_contiguous() {
            return None;
        }
        let n = self.shape[0].checked_mul(width)?;
        if n == 0 {
            return Some((&[], width));
        }
        if self.shape[0] > 1 && self.strides[0] != (width * 4) as isize {
            return None; // rows with a gap between them, or in another order
        }
        // SAFETY: `n` int32s at `ptr`: row after row with no gap (the row stride is the row's
        // bytes, the inner stride 4, both checked), aligned to 4 (checked), kept alive by `_keep`
        // for the borrow of `self`.
        Some((unsafe { std::slice::from_raw_parts(self.ptr.cast::<i32>(), n) }, width))
    }

    /// The whole 1-D array as `&[i64]` without copying, when it is int64, contiguous and aligned.
    pub fn as_i64(&self) -> Option<&[i64]> {
        if self.ndim != 1 || self.elem != Elem::I64 || !self.rows_contiguous() {
            return None;
        }
        if self.shape[0] == 0 {
            return Some(&[]);
        }
        // SAFETY: `shape[0]` contiguous (stride 8, checked), 8-aligned (checked) int64s at
        // `ptr`, kept alive by `_keep` for the borrow of `self`.
        Some(unsafe { std::slice::from_raw_parts(self.ptr.cast::<i64>(), self.shape[0]) })
    }

    fn rows(&self) -> usize {
        if self.ndim == 2 { self.shape[0] } else { 1 }
    }

    /// Appends the first `n` entries of row `i` (of a 2-D array; `i` = 0 and the whole array
    /// for 1-D) to `out` as page ids: any dtype and stride. A value outside `0..2**32` becomes
    /// `u32::MAX`, beyond any pool: refused as `page_out_of_range`, never a real page.
    pub fn row_pages_into(&self, i: usize, n: usize, out: &mut Vec<PageId>) {
        for j in 0..n {
            let v = if self.ndim == 2 { self.get(i, j) } else { self.get(j, 0) };
            out.push(PageId(u32::try_from(v).unwrap_or(u32::MAX)));
        }
    }

    /// The whole 1-D array as a slice of its own element type without copying, when it is
    /// contiguous and aligned (the step path reads it in one tight loop then).
    pub fn as_ints(&self) -> Option<Ints<'_>> {
        if self.ndim != 1 || !self.rows_contiguous() {
            return None;
        }
        let len = self.shape[0];
        if len == 0 {
            return Some(Ints::I64(&[]));
        }
        // SAFETY: `len` contiguous elements of `elem`'s type (inner stride = element size,
        // checked by rows_contiguous) at `ptr`, aligned for that type (checked), kept alive by
        // `_keep` for the borrow of `self`; every bit pattern is a valid i32/i64.
        Some(unsafe {
            match self.elem {
                Elem::I32 => Ints::I32(std::slice::from_raw_parts(self.ptr.cast::<i32>(), len)),
                Elem::I64 => Ints::I64(std::slice::from_raw_parts(self.ptr.cast::<i64>(), len)),
            }
        })
    }

    /// The first `n` entries of a 1-D array checked non-negative, to be read in place:
    /// `ValueError` naming the first negative one (or the array's length, if it is shorter).
    pub fn check_counts(&self, n: usize, name: &str) -> PyResult<()> {
        if self.len() < n {
            return Err(PyValueError::new_err(format!("{name} has {} entries, {n} needed", self.len())));
        }
        let negative = match self.as_ints() {
            Some(Ints::I32(s)) => s[..n].iter().fold(false, |neg, &v| neg | (v < 0)),
            Some(Ints::I64(s)) => s[..n].iter().fold(false, |neg, &v| neg | (v < 0)),
            None => (0..n).any(|i| self.get(i, 0) < 0),
        };
        if !negative {
            return Ok(());
        }
        let (i, v) = (0..n).map(|i| (i, self.get(i, 0))).find(|&(_, v)| v < 0).unwrap_or((0, -1));
        Err(PyValueError::new_err(format!("{name}[{i}] is {v}: must be >= 0")))
    }

    /// The first `n` entries of a 1-D array as non-negative ints; `what` names them in the
    /// `ValueError` a negative one raises.
    pub fn counts(&self, n: usize, name: &str) -> PyResult<Vec<u64>> {
        self.check_counts(n, name)?;
        // Every entry is non-negative (checked above): `as u64` keeps its value.
        Ok(match self.as_ints() {
            Some(Ints::I32(s)) => s[..n].iter().map(|&v| v as u64).collect(),
            Some(Ints::I64(s)) => s[..n].iter().map(|&v| v as u64).collect(),
            None => (0..n).map(|i| self.get(i, 0) as u64).collect(),
        })
    }
}

/// A step's per-request token counts as the engine hands them: a contiguous int32 array (vLLM's
/// `num_computed_tokens_cpu`, its scheduled counts) read in place, anything else converted once.
/// Reading in place spares the step a copy written cold every step.
#[derive(Debug)]
pub enum StepCounts<'py> {
    /// The first `n` entries of an int32 array, each checked non-negative when opened.
    InPlace(IntArray<'py>, usize),
    /// The counts converted (a list, an int64 or strided array).
    Owned(Vec<u64>),
}

impl<'py> StepCounts<'py> {
    /// The first `n` counts of `obj` (a 1-D int array or sequence); `ValueError` naming `name`
    /// when there are fewer or one is negative, `TypeError` for what is no int array.
    pub fn open(obj: &Bound<'py, PyAny>, name: &str, n: usize) -> PyResult<StepCounts<'py>> {
        let a = IntArray::open(obj, name, 1)?;
        if a.len() >= n
            && let Some(Ints::I32(s)) = a.as_ints()
        {
            let counts = &s[..n];
            if let Err(e) = kvguard::step::Counts::from_i32(counts) {
                return Err(PyValueError::new_err(format!("{name}[{}] is {}: must be >= 0", e.index, e.value)));
            }
            return Ok(StepCounts::InPlace(a, n));
        }
        a.counts(n, name).map(StepCounts::Owned)
    }

    /// The counts, for the core's step. `ValueError` naming `name` if an in-place count turned
    /// negative since it was opened (the engine wrote its array during the call).
    pub fn counts(&self, name: &str) -> PyResult<kvguard::step::Counts<'_>> {
        match self {
            StepCounts::Owned(v) => Ok(v.into()),
            StepCounts::InPlace(a, n) => match a.as_ints() {
                Some(Ints::I32(s)) => kvguard::step::Counts::from_i32(&s[..*n])
                    .map_err(|e| PyValueError::new_err(format!("{name}[{}] is {}: must be >= 0", e.index, e.value))),
                _ => Err(PyValueError::new_err(format!("{name} changed while it was read"))),
            },
        }
    }
}

/// A contiguous 1-D array borrowed as a slice of its element type.
#[derive(Clone, Copy, Debug)]
pub enum Ints<'a> {
    /// int32 entries.
    I32(&'a [i32]),
    /// int64 entries.
    I64(&'a [i64]),
}

/// A 1-D integer array the binding writes in place: an engine plugin's own bookkeeping
/// (kvguard.sglang's page owners and checked row lengths, [`I64Mut`]; its marks of the pages
/// SGLang's allocator handed out, [`U8Mut`]), updated in the same call that judged the step
/// instead of by numpy afterwards. It must be writable and C-contiguous, and inside its owner's
/// memory as [`IntArray`]'s views are (a write past it would corrupt the process).
#[derive(Debug)]
pub struct ArrayMut<'py, T: Element> {
    /// Its first element.
    ptr: *mut T,
    /// Keeps its memory alive: its buffer export (released on drop, with the GIL), or the
    /// exact numpy array itself, read through numpy's struct.
    _keep: KeepMut<'py, T>,
    len: usize,
    /// The owner's export, when the owner is not the exported object itself.
    _owner: Option<Extent<'py>>,
}

/// What keeps an [`ArrayMut`]'s memory alive.
#[derive(Debug)]
enum KeepMut<'py, T: Element> {
    Buffer(#[allow(dead_code)] PyBuffer<T>),
    Array(#[allow(dead_code)] Bound<'py, PyAny>),
}

/// A writable 1-D int64 array ([`ArrayMut`]).
pub type I64Mut<'py> = ArrayMut<'py, i64>;
/// A writable 1-D uint8 array ([`ArrayMut`]): a numpy bool array's `view(np.uint8)`.
pub type U8Mut<'py> = ArrayMut<'py, u8>;

/// The numpy name of an element type [`ArrayMut`] writes, for its errors.
pub trait Named: Element + Copy {
    /// `int64`, `uint8`.
    const NAME: &'static str;
    /// numpy's `dtype.kind` of it: `i` (signed), `u` (unsigned).
    const KIND: u8;
}

impl Named for i64 {
    const NAME: &'static str = "int64";
    const KIND: u8 = b'i';
}

impl Named for u8 {
    const NAME: &'static str = "uint8";
    const KIND: u8 = b'u';
}

impl<'py, T: Named> ArrayMut<'py, T> {
    /// Views `obj` for writing; `name` names the argument in errors.
    pub fn open(obj: &Bound<'py, PyAny>, name: &str) -> PyResult<ArrayMut<'py, T>> {
        let wrong = || {
            PyTypeError::new_err(format!(
                "{name} must be a writable, contiguous 1-D {} array (numpy), got {}",
                T::NAME,
                type_name(obj)
            ))
        };
        let py = obj.py();
        let known = Known::get(py)?;
        let exact = known.is_exact_ndarray(obj);
        let size = std::mem::size_of::<T>();
        // An exact numpy array, writable, contiguous and aligned, from numpy's struct (the
        // plugins' mirrors, every step); anything else through a buffer export, as before.
        let fields = known.described_1d(obj, numpy::Dtype { kind: T::KIND, item: size }).filter(|d| {
            d.writeable && d.c_contiguous && d.dims[0] >= 0 && d.ptr.is_multiple_of(std::mem::align_of::<T>())
        });
        let (ptr, len, keep, base) = match fields {
            Some(d) => (d.ptr as *mut T, d.dims[0] as usize, KeepMut::Array(obj.clone()), d.base),
            None => {
                if !exact && exports_buffer(obj) {
                    known.vet_exporter(obj, name)?;
                }
                let buf = PyBuffer::<T>::get(obj).map_err(|_| wrong())?;
                if buf.readonly() || !buf.is_c_contiguous() || buf.dimensions() != 1 {
                    return Err(wrong());
                }
                let base = if exact {
                    let b = obj.getattr(intern!(py, "base"))?;
                    (!b.is_none()).then_some(b)
                } else {
                    Some(obj.clone())
                };
                (buf.buf_ptr().cast::<T>(), buf.item_count(), KeepMut::Buffer(buf), base)
            }
        };
        let bytes = span(ptr as usize, [(len, size as isize)], size)
            .map_err(|()| PyValueError::new_err(format!("{name}: its shape reaches beyond the address space")))?;
        let owner = match base {
            Some(b) => Some(owner::owner_of(&b, name)?),
            None => None,
        };
        if let Some(owner) = &owner {
            owner.contains(bytes.as_ref(), name)?;
        }
        Ok(ArrayMut { ptr, _keep: keep, len, _owner: owner })
    }

    /// Its length.
    pub fn len(&self) -> usize {
        self.len
    }

    fn span(&self) -> std::ops::Range<usize> {
        let base = self.ptr as usize;
        base..base + self.len * std::mem::size_of::<T>()
    }

    /// `ValueError` when it shares memory with `other` (an argument named `other_name`), or with
    /// the other writable array `also`: the binding writes it while it reads the others, so
    /// they must not alias (the SAFETY of [`I64Mut::get`] and [`I64Mut::set`] relies on it).
    pub fn apart(
        &self,
        name: &str,
        others: &[(&IntArray<'_>, &str)],
        also: Option<(&ArrayMut<'_, T>, &str)>,
    ) -> PyResult<()> {
        let mine = self.span();
        let overlaps = |r: std::ops::Range<usize>| {
            r.start < r.end && mine.start < mine.end && r.start < mine.end && mine.start < r.end
        };
        let hit = others
            .iter()
            .find(|(a, _)| overlaps(a.span()))
            .map(|(_, n)| *n)
            .or_else(|| also.filter(|(m, _)| overlaps(m.span())).map(|(_, n)| n));
        match hit {
            Some(other) => {
                Err(PyValueError::new_err(format!("{name} shares memory with {other}: pass separate arrays")))
            }
            None => Ok(()),
        }
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn at(&self, i: usize) -> *mut T {
        assert!(i < self.len, "index within the array");
        self.ptr.wrapping_add(i)
    }

    /// Entry `i` (`i < len()`, asserted: a violation is a bug of this crate, caught by PyO3).
    pub fn get(&self, i: usize) -> T {
        // SAFETY: `i < len` (asserted in `at`): an element of the viewed array, C-contiguous
        // `T` aligned for `T` (PyBuffer::<T>::get checked format, size and alignment; numpy's
        // struct its dtype, flags and pointer), alive while `_keep` is. The binding reads and
        // writes it only with the GIL held (never inside `py.detach`), so no Python code runs
        // meanwhile, and no Rust reference to it exists: every access is one of these raw reads
        // and writes, and the calls that write one check it `apart` from every array they borrow
        // as a slice.
        unsafe { self.at(i).read() }
    }

    /// Sets entry `i` to `v` (`i < len()`, asserted).
    pub fn set(&self, i: usize, v: T) {
        // SAFETY: as in `get`; the array is not read-only (checked in `open`).
        unsafe { self.at(i).write(v) }
    }
}
