//! An exact numpy array's description read from numpy's own struct (`PyArrayObject_fields` in
//! `numpy/ndarraytypes.h`: its data pointer, dimensions, strides, base and dtype), without a
//! buffer export. The engines hand the same arrays every step; an export made numpy build a
//! format string and a `Py_buffer` each time, and freed them after (about a hundred lines of
//! cache a step, most of them code).
//!
//! Nothing here trusts the layout on its word: [`Layout::probe`] reads two probe arrays both ways
//! (the struct, and numpy's buffer export) once a process, and only a layout that agrees on every
//! field is used; otherwise every array goes through its export as before.

use std::ffi::{c_char, c_int, c_long};

use pyo3::buffer::PyUntypedBuffer;
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PySlice, PyTuple, PyType};

/// The leading fields of `PyArrayObject_fields`, unchanged since numpy 1.7 (numpy 2 included).
#[repr(C)]
struct Fields {
    _ob_base: ffi::PyObject,
    data: *mut u8,
    nd: c_int,
    dimensions: *const isize,
    strides: *const isize,
    base: *mut ffi::PyObject,
    descr: *const Descr,
    flags: c_int,
}

/// `NPY_ARRAY_C_CONTIGUOUS` and `NPY_ARRAY_WRITEABLE`, numpy's flag bits.
const C_CONTIGUOUS: c_int = 0x0001;
const WRITEABLE: c_int = 0x0400;

/// The leading fields of `PyArray_Descr` (the same in numpy 1 and 2; what follows them moved).
#[repr(C)]
struct Descr {
    _ob_base: ffi::PyObject,
    _typeobj: *mut ffi::PyTypeObject,
    kind: c_char,
    type_: c_char,
    byteorder: c_char,
}

/// numpy's struct layout, checked against its buffer export (see the module docs).
#[derive(Debug)]
pub struct Layout {
    ndarray: Py<PyType>,
}

/// An element type kvguard reads or writes, as numpy's dtype names it: its kind (`'i'` signed,
/// `'u'` unsigned) and its size in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dtype {
    /// numpy's `dtype.kind`.
    pub kind: u8,
    /// Bytes an element.
    pub item: usize,
}

/// What an exact numpy array says of itself: an integer array of one or two dimensions in native
/// byte order (anything else is left to the buffer export, which names what is wrong).
pub struct Described<'a, 'py> {
    /// Its first element.
    pub ptr: usize,
    /// Its dimensions, as numpy holds them.
    pub dims: &'a [isize],
    /// Their strides in bytes.
    pub strides: &'a [isize],
    /// Its element size in bytes.
    pub item: usize,
    /// The object whose memory it views, if any (numpy's `base`).
    pub base: Option<Bound<'py, PyAny>>,
    /// Whether numpy lets it be written (`NPY_ARRAY_WRITEABLE`).
    pub writeable: bool,
    /// Whether its elements lie one after another, row after row (`NPY_ARRAY_C_CONTIGUOUS`).
    pub c_contiguous: bool,
}

impl Layout {
    /// The layout, if two probe arrays (a strided int32 view and an int64 vector) read through
    /// the struct exactly as their buffer exports and `base` describe them; `None` otherwise.
    pub fn probe(numpy: &Bound<'_, PyModule>, ndarray: &Bound<'_, PyType>) -> PyResult<Option<Layout>> {
        let py = numpy.py();
        let basic = |t: &Bound<'_, PyAny>| -> PyResult<usize> { t.getattr("__basicsize__")?.extract() };
        if basic(ndarray.as_any())? < size_of::<Fields>() || basic(&numpy.getattr("dtype")?)? < size_of::<Descr>() {
            return Ok(None);
        }
        let layout = Layout { ndarray: ndarray.clone().unbind() };
        let kw = PyDict::new(py);
        kw.set_item("dtype", "int32")?;
        let grid = numpy.call_method("zeros", ((3, 5),), Some(&kw))?;
        let view = grid.get_item(PyTuple::new(py, [PySlice::full(py), PySlice::new(py, 1, 4, 1)])?)?;
        kw.set_item("dtype", "int64")?;
        let vector = numpy.call_method("arange", (4,), Some(&kw))?;
        vector.call_method1("setflags", (false,))?; // read-only: the flag word read too
        for probe in [&view, &vector] {
            let Some(d) = layout.describe(probe) else { return Ok(None) };
            let buf = PyUntypedBuffer::get(probe)?;
            let shape: Vec<isize> = buf.shape().iter().map(|&s| s as isize).collect();
            let base = probe.getattr("base")?;
            let same = d.ptr == buf.buf_ptr() as usize
                && d.dims == shape.as_slice()
                && d.strides == buf.strides()
                && d.item == buf.item_size()
                && d.writeable != buf.readonly()
                && d.c_contiguous == buf.is_c_contiguous()
                && match &d.base {
                    Some(b) => b.is(&base),
                    None => base.is_none(),
                };
            if !same {
                return Ok(None);
            }
        }
        Ok(Some(layout))
    }

    /// `obj`'s own description, when it is exactly a numpy array of one or two dimensions holding
    /// native int32 or int64; `None` for anything else.
    pub fn describe<'a, 'py>(&self, obj: &'a Bound<'py, PyAny>) -> Option<Described<'a, 'py>> {
        self.described(obj, |dtype| dtype.kind == b'i' && matches!(dtype.item, 4 | 8))
    }

    /// `obj`'s own description, when it is exactly a numpy array of one dimension holding native
    /// elements of `dtype`; `None` for anything else.
    pub fn describe_1d<'a, 'py>(&self, obj: &'a Bound<'py, PyAny>, dtype: Dtype) -> Option<Described<'a, 'py>> {
        self.described(obj, |d| d == dtype).filter(|d| d.dims.len() == 1)
    }

    fn described<'a, 'py>(
        &self,
        obj: &'a Bound<'py, PyAny>,
        wanted: impl Fn(Dtype) -> bool,
    ) -> Option<Described<'a, 'py>> {
        let py = obj.py();
        if !obj.get_type().is(self.ndarray.bind(py)) {
            return None;
        }
        // SAFETY: `obj` is exactly `numpy.ndarray` (checked above), whose instances begin with
        // `PyArrayObject_fields`; `Layout` exists only where numpy's type is at least `Fields`
        // long and a probe read through these fields agreed with numpy's buffer export. We hold
        // a reference to `obj` and the GIL: numpy changes or frees none of it while we read.
        let f = unsafe { &*obj.as_ptr().cast::<Fields>() };
        let nd = usize::try_from(f.nd).ok().filter(|n| (1..=2).contains(n))?;
        if f.dimensions.is_null() || f.strides.is_null() || f.descr.is_null() {
            return None;
        }
        // SAFETY: an array of `nd` >= 1 dimensions holds `nd` dimensions and `nd` strides at
        // these pointers (non-null, checked), allocated with the array and freed with it; the
        // borrow is tied to `obj`'s, which keeps the array alive.
        let (dims, strides) =
            unsafe { (std::slice::from_raw_parts(f.dimensions, nd), std::slice::from_raw_parts(f.strides, nd)) };
        // SAFETY: an array holds a reference to its dtype (non-null, checked), a `PyArray_Descr`
        // whose leading fields are `Descr`'s (numpy's dtype type is at least that long: probed).
        let d = unsafe { &*f.descr };
        let native = match d.byteorder as u8 {
            b'=' => true,
            b'<' => cfg!(target_endian = "little"),
            b'>' => cfg!(target_endian = "big"),
            _ => false,
        };
        // The C type's code, as numpy's `dtype.char` names it: its size from the C type.
        let item = match d.type_ as u8 {
            b'i' | b'I' => size_of::<c_int>(),
            b'l' | b'L' => size_of::<c_long>(),
            b'q' | b'Q' => 8,
            b'B' => 1,
            _ => 0,
        };
        let native = native || item == 1; // one byte: numpy's byte order is '|'
        if !native || item == 0 || !wanted(Dtype { kind: d.kind as u8, item }) {
            return None;
        }
        let base = (!f.base.is_null()).then(|| {
            // SAFETY: a non-null `base` is an object the array holds a reference to while it
            // lives (we hold the array); borrowing it takes a reference of our own.
            unsafe { Bound::from_borrowed_ptr(py, f.base) }
        });
        Some(Described {
            ptr: f.data as usize,
            dims,
            strides,
            item,
            base,
            writeable: f.flags & WRITEABLE != 0,
            c_contiguous: f.flags & C_CONTIGUOUS != 0,
        })
    }
}
