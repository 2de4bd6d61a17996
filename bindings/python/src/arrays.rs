//! Zero-copy views of the engine's integer arrays: numpy arrays, anything exposing the buffer
//! protocol, or anything with `__array_interface__`; int32 and int64; any strides (a row stride
//! that is not the row's width is honoured). Plain Python sequences of ints are accepted for 1-D
//! arguments and copied.
//!
//! The arrays must not be written by another thread while a call reads them (the GIL is released
//! during the check, as numpy does for its own loops).

use kvguard::PageId;
use pyo3::buffer::{PyBuffer, PyUntypedBuffer};
use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

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
    /// An object exposing `__array_interface__`.
    Object(#[allow(dead_code)] Bound<'py, PyAny>),
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
    _keep: Keep<'py>,
}

fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}

impl<'py> IntArray<'py> {
    /// Views `obj` as an int32 or int64 array of `ndim` dimensions; `name` names the argument
    /// in errors.
    pub fn open(obj: &Bound<'py, PyAny>, name: &str, ndim: usize) -> PyResult<IntArray<'py>> {
        if let Ok(buf) = PyUntypedBuffer::get(obj) {
            return Self::from_buffer(buf, name, ndim);
        }
        if let Ok(iface) = obj.getattr("__array_interface__") {
            return Self::from_interface(obj, &iface, name, ndim);
        }
        if ndim == 1
            && !obj.is_instance_of::<pyo3::types::PyString>()
            && let Ok(items) = obj.try_iter()
        {
            let mut v = Vec::new();
            for item in items {
                let item = item?;
                v.push(
                    item.extract::<i64>().map_err(|_| {
                        PyTypeError::new_err(format!("{name} must hold ints, got a {}", type_name(&item)))
                    })?,
                );
            }
            let ptr = v.as_ptr().cast::<u8>();
            let len = v.len();
            return Ok(IntArray {
                ptr,
                elem: Elem::I64,
                shape: [len, 1],
                strides: [8, 8],
                ndim: 1,
                _keep: Keep::Owned(v),
            });
        }
        Err(PyTypeError::new_err(format!(
            "{name} must be a {ndim}-D int32 or int64 array (numpy, buffer protocol or __array_interface__){}, got {}",
            if ndim == 1 { " or a sequence of ints" } else { "" },
            type_name(obj)
        )))
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

    fn from_buffer(buf: PyUntypedBuffer, name: &str, ndim: usize) -> PyResult<IntArray<'py>> {
        let elem = Self::elem_of(buf.format().to_bytes(), buf.item_size(), name)?;
        if buf.dimensions() != ndim {
            return Err(PyValueError::new_err(format!(
                "{name} must be {ndim}-D, got {} dimensions (shape {:?})",
                buf.dimensions(),
                buf.shape()
            )));
        }
        if buf.suboffsets().is_some_and(|s| s.iter().any(|&o| o >= 0)) {
            return Err(PyValueError::new_err(format!("{name}: indirect (suboffset) buffers are not supported")));
        }
        let mut shape = [0, 1];
        let mut strides = [elem.size() as isize; 2];
        shape[..ndim].copy_from_slice(&buf.shape()[..ndim]);
        strides[..ndim].copy_from_slice(&buf.strides()[..ndim]);
        let ptr = buf.buf_ptr() as *const u8;
        Ok(IntArray { ptr, elem, shape, strides, ndim, _keep: Keep::Buffer(buf) })
    }

    fn from_interface(
        obj: &Bound<'py, PyAny>,
        iface: &Bound<'py, PyAny>,
        name: &str,
        ndim: usize,
    ) -> PyResult<IntArray<'py>> {
        let bad = |what: &str| PyValueError::new_err(format!("{name}: __array_interface__ {what}"));
        let iface = iface.cast::<PyDict>().map_err(|_| bad("is not a dict"))?;
        let typestr: String = iface.get_item("typestr")?.ok_or_else(|| bad("has no typestr"))?.extract()?;
        let elem = match typestr.as_str() {
            "<i4" | "=i4" => Elem::I32,
            "<i8" | "=i8" => Elem::I64,
            other => {
                return Err(PyTypeError::new_err(format!(
                    "{name} must have dtype int32 or int64, got typestr {other:?}"
                )));
            }
        };
        let shape_v: Vec<usize> = iface.get_item("shape")?.ok_or_else(|| bad("has no shape"))?.extract()?;
        if shape_v.len() != ndim {
            return Err(PyValueError::new_err(format!(
                "{name} must be {ndim}-D, got {} dimensions (shape {shape_v:?})",
                shape_v.len()
            )));
        }
        let data = iface.get_item("data")?.ok_or_else(|| bad("has no data"))?;
        let data = data.cast::<PyTuple>().map_err(|_| bad("data is not a (pointer, read_only) tuple"))?;
        let addr: usize = data.get_item(0)?.extract()?;
        if iface.get_item("mask")?.is_some_and(|m| !m.is_none()) {
            return Err(bad("has a mask (masked arrays are not supported)"));
        }
        let mut shape = [0, 1];
        shape[..ndim].copy_from_slice(&shape_v);
        let strides_v: Option<Vec<isize>> = match iface.get_item("strides")? {
            Some(s) if !s.is_none() => Some(s.extract()?),
            _ => None,
        };
        let size = elem.size() as isize;
        let strides = match strides_v {
            Some(s) if s.len() == ndim => {
                let mut st = [size; 2];
                st[..ndim].copy_from_slice(&s);
                st
            }
            Some(_) => return Err(bad("strides do not match its shape")),
            // C-contiguous.
            None => [if ndim == 2 { size * shape[1] as isize } else { size }, size],
        };
        let offset: isize = match iface.get_item("offset")? {
            Some(o) if !o.is_none() => o.extract()?,
            _ => 0,
        };
        let ptr = (addr as *const u8).wrapping_offset(offset);
        if addr == 0 && shape[0] * shape[1] > 0 {
            return Err(bad("data pointer is null"));
        }
        Ok(IntArray { ptr, elem, shape, strides, ndim, _keep: Keep::Object(obj.clone()) })
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
    pub fn span(&self) -> std::ops::Range<usize> {
        let (rows, cols) = (self.shape[0], self.width());
        if rows == 0 || cols == 0 {
            return 0..0;
        }
        let base = self.ptr as usize;
        let (mut lo, mut hi) = (base as isize, base as isize);
        for (n, stride) in [(rows, self.strides[0]), (cols, if self.ndim == 2 { self.strides[1] } else { 0 })] {
            let reach = (n as isize - 1).saturating_mul(stride);
            if reach < 0 { lo = lo.saturating_add(reach) } else { hi = hi.saturating_add(reach) }
        }
        lo.max(0) as usize..(hi.max(0) as usize).saturating_add(self.elem.size())
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

    /// The first `n` entries of a 1-D array as non-negative ints; `what` names them in the
    /// `ValueError` a negative one raises.
    pub fn counts(&self, n: usize, name: &str) -> PyResult<Vec<u64>> {
        if self.len() < n {
            return Err(PyValueError::new_err(format!("{name} has {} entries, {n} needed", self.len())));
        }
        match self.as_ints() {
            Some(Ints::I32(s)) => return non_negative(&s[..n], name),
            Some(Ints::I64(s)) => return non_negative(&s[..n], name),
            None => {}
        }
        (0..n)
            .map(|i| {
                let v = self.get(i, 0);
                u64::try_from(v).map_err(|_| PyValueError::new_err(format!("{name}[{i}] is {v}: must be >= 0")))
            })
            .collect()
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

/// `values` as `u64`s, or the `ValueError` naming the first negative one. One branch-free pass
/// checks them all, so the common case (all fine) is a tight loop.
fn non_negative<T: Copy + Into<i64>>(values: &[T], name: &str) -> PyResult<Vec<u64>> {
    if values.iter().fold(false, |neg, &v| neg | (v.into() < 0)) {
        let (i, v) =
            values.iter().enumerate().find(|(_, v)| (**v).into() < 0).map_or((0, 0), |(i, v)| (i, (*v).into()));
        return Err(PyValueError::new_err(format!("{name}[{i}] is {v}: must be >= 0")));
    }
    Ok(values.iter().map(|&v| v.into() as u64).collect())
}

/// A 1-D int64 array the binding writes in place: an engine plugin's own bookkeeping
/// (kvguard.sglang's page owners and checked row lengths), updated in the same call that judged
/// the step instead of by numpy afterwards. It must be writable and C-contiguous.
#[derive(Debug)]
pub struct I64Mut {
    /// Keeps the exported memory alive (released on drop, with the GIL).
    buf: PyBuffer<i64>,
    len: usize,
}

impl I64Mut {
    /// Views `obj` for writing; `name` names the argument in errors.
    pub fn open(obj: &Bound<'_, PyAny>, name: &str) -> PyResult<I64Mut> {
        let wrong = || {
            PyTypeError::new_err(format!(
                "{name} must be a writable, contiguous 1-D int64 array (numpy), got {}",
                type_name(obj)
            ))
        };
        let buf = PyBuffer::<i64>::get(obj).map_err(|_| wrong())?;
        if buf.readonly() || !buf.is_c_contiguous() || buf.dimensions() != 1 {
            return Err(wrong());
        }
        let len = buf.item_count();
        Ok(I64Mut { buf, len })
    }

    /// Its length.
    pub fn len(&self) -> usize {
        self.len
    }

    fn span(&self) -> std::ops::Range<usize> {
        let base = self.buf.buf_ptr() as usize;
        base..base + self.len * 8
    }

    /// `ValueError` when it shares memory with `other` (an argument named `other_name`), or with
    /// the other writable array `also`: the binding writes it while it reads the others, so
    /// they must not alias (the SAFETY of [`I64Mut::get`] and [`I64Mut::set`] relies on it).
    pub fn apart(&self, name: &str, others: &[(&IntArray<'_>, &str)], also: Option<(&I64Mut, &str)>) -> PyResult<()> {
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

    fn at(&self, i: usize) -> *mut i64 {
        assert!(i < self.len, "index within the array");
        self.buf.buf_ptr().cast::<i64>().wrapping_add(i)
    }

    /// Entry `i` (`i < len()`, asserted: a violation is a bug of this crate, caught by PyO3).
    pub fn get(&self, i: usize) -> i64 {
        // SAFETY: `i < len` (asserted in `at`): an element of the exported buffer, C-contiguous
        // int64 aligned for i64 (PyBuffer::<i64>::get checked format, size and alignment), alive
        // while `buf` is. The binding reads and writes it only with the GIL held (never inside
        // `py.detach`), so no Python code runs meanwhile, and no Rust reference to it exists:
        // every access is one of these raw reads and writes, and the calls that write one check
        // it `apart` from every array they borrow as a slice.
        unsafe { self.at(i).read() }
    }

    /// Sets entry `i` to `v` (`i < len()`, asserted).
    pub fn set(&self, i: usize, v: i64) {
        // SAFETY: as in `get`; the buffer is not read-only (checked in `open`).
        unsafe { self.at(i).write(v) }
    }
}
