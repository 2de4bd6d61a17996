//! DLPack capsules read in place: the C structs of `dlpack.h` (v0 `DLManagedTensor` and v1
//! `DLManagedTensorVersioned`) and one safe reader that copies out what a view needs. The
//! capsule is never consumed (renamed): whoever holds it keeps the tensor alive, and the
//! producer's capsule destructor calls the tensor's deleter when the capsule is freed.

use std::ffi::{CStr, c_void};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyCapsule, PyCapsuleMethods};

/// `kDLCPU`: ordinary host memory.
pub const DEVICE_CPU: i32 = 1;
/// `kDLCUDAHost`: pinned host memory (a pinned torch CPU tensor), readable by the host.
pub const DEVICE_CUDA_HOST: i32 = 3;
/// `kDLInt`: signed integers.
const CODE_INT: u8 = 0;
/// Capsule dimensions beyond this are refused as malformed (DLPack's producers stay far below).
const MAX_NDIM: i32 = 64;

#[repr(C)]
struct DLDevice {
    device_type: i32,
    device_id: i32,
}

#[repr(C)]
struct DLDataType {
    code: u8,
    bits: u8,
    lanes: u16,
}

#[repr(C)]
struct DLTensor {
    data: *mut c_void,
    device: DLDevice,
    ndim: i32,
    dtype: DLDataType,
    shape: *const i64,
    /// In elements; null means C-contiguous.
    strides: *const i64,
    byte_offset: u64,
}

#[repr(C)]
struct DLManagedTensor {
    dl_tensor: DLTensor,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensor)>,
}

#[repr(C)]
struct DLPackVersion {
    major: u32,
    minor: u32,
}

#[repr(C)]
struct DLManagedTensorVersioned {
    version: DLPackVersion,
    manager_ctx: *mut c_void,
    deleter: Option<unsafe extern "C" fn(*mut DLManagedTensorVersioned)>,
    flags: u64,
    dl_tensor: DLTensor,
}

/// The capsule names a tensor may travel under: what `__dlpack__` returns (v0, v1), and the
/// capsules numpy keeps as the `base` of an array it made with `numpy.from_dlpack` (v0, v1).
const UNVERSIONED: [&CStr; 2] = [c"dltensor", c"numpy_dltensor"];
const VERSIONED: [&CStr; 2] = [c"dltensor_versioned", c"numpy_dltensor_versioned"];

/// What a capsule says about its tensor, copied out of the producer's structs.
#[derive(Debug)]
pub struct Tensor {
    /// `(device_type, device_id)`.
    pub device: (i32, i32),
    /// `data + byte_offset`: the first element's address.
    pub ptr: usize,
    /// `(code, bits, lanes)`.
    pub dtype: (u8, u8, u16),
    /// `(extent, stride in bytes)` per dimension.
    pub dims: Vec<(usize, isize)>,
    /// The tensor's deleter, by address: how numpy's own exports are recognized.
    pub deleter: usize,
    /// The producer's context (numpy: the exported `ndarray`, borrowed by the capsule).
    pub manager_ctx: *mut c_void,
}

impl Tensor {
    /// Bytes per element, when the dtype is a whole number of bytes.
    pub fn item_size(&self) -> Option<usize> {
        let (_, bits, lanes) = self.dtype;
        let bits = usize::from(bits) * usize::from(lanes);
        (bits > 0 && bits.is_multiple_of(8)).then_some(bits / 8)
    }

    /// Whether its memory is readable by the host (`kDLCPU` or pinned `kDLCUDAHost`).
    pub fn on_host(&self) -> bool {
        matches!(self.device.0, DEVICE_CPU | DEVICE_CUDA_HOST)
    }

    /// Whether it is a signed integer of `bits` bits, one lane.
    pub fn is_int(&self, bits: u8) -> bool {
        self.dtype == (CODE_INT, bits, 1)
    }
}

/// Reads the tensor `capsule` describes; `name` names the argument in errors. The capsule must
/// stay alive (and unconsumed) while `ptr` is read: the caller keeps it.
pub fn read(capsule: &Bound<'_, PyCapsule>, name: &str) -> PyResult<Tensor> {
    let bad = |what: String| PyValueError::new_err(format!("{name}: its DLPack capsule {what}"));
    let cname = capsule.name()?.map(|n| {
        // SAFETY: the name of a live capsule we hold, read before anything can rename it (the
        // GIL is held throughout).
        unsafe { n.as_cstr() }.to_owned()
    });
    let Some(cname) = cname else {
        return Err(PyTypeError::new_err(format!("{name}: __dlpack__ returned a capsule without a name")));
    };
    let (tensor, ctx, deleter) = if UNVERSIONED.contains(&cname.as_c_str()) {
        let p = capsule.pointer_checked(Some(&cname))?.cast::<DLManagedTensor>();
        // SAFETY: a capsule named `dltensor` (or numpy's `numpy_dltensor`) holds a
        // `DLManagedTensor` (dlpack.h, v0), valid until its deleter runs, which only the
        // capsule's destructor does once the capsule is freed: we hold the capsule.
        let m = unsafe { p.as_ref() };
        (&m.dl_tensor, m.manager_ctx, m.deleter.map_or(0, |d| d as usize))
    } else if VERSIONED.contains(&cname.as_c_str()) {
        let p = capsule.pointer_checked(Some(&cname))?.cast::<DLManagedTensorVersioned>();
        // SAFETY: as above, for the v1 struct a `dltensor_versioned` capsule holds.
        let m = unsafe { p.as_ref() };
        if m.version.major != 1 {
            return Err(bad(format!("is DLPack {}.{}, only 1.x is read", m.version.major, m.version.minor)));
        }
        (&m.dl_tensor, m.manager_ctx, m.deleter.map_or(0, |d| d as usize))
    } else {
        return Err(PyTypeError::new_err(format!(
            "{name}: __dlpack__ returned a capsule named {cname:?}, not \"dltensor\""
        )));
    };
    if !(0..=MAX_NDIM).contains(&tensor.ndim) {
        return Err(bad(format!("has {} dimensions", tensor.ndim)));
    }
    let ndim = tensor.ndim as usize;
    if ndim > 0 && tensor.shape.is_null() {
        return Err(bad("has a null shape".into()));
    }
    let read_dim = |at: *const i64, i: usize| {
        // SAFETY: `at` is the tensor's shape or strides array, non-null (checked by the
        // callers), `ndim` entries long (dlpack.h), alive with the capsule; `i < ndim`.
        unsafe { at.add(i).read_unaligned() }
    };
    let mut t = Tensor {
        device: (tensor.device.device_type, tensor.device.device_id),
        ptr: (tensor.data as usize).wrapping_add(tensor.byte_offset as usize),
        dtype: (tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes),
        dims: Vec::with_capacity(ndim),
        deleter,
        manager_ctx: ctx,
    };
    let item = t.item_size().ok_or_else(|| bad(format!("has elements of {} bits", t.dtype.1)))? as isize;
    let overflow = || bad("has strides whose byte offsets overflow".into());
    // Strides null: C-contiguous, each dimension's stride the product of the ones after it.
    let mut contiguous = item;
    let mut dims = vec![(0usize, 0isize); ndim];
    for i in (0..ndim).rev() {
        let extent = read_dim(tensor.shape, i);
        let extent = usize::try_from(extent).map_err(|_| bad(format!("has a negative extent {extent}")))?;
        let stride = if tensor.strides.is_null() {
            contiguous
        } else {
            isize::try_from(read_dim(tensor.strides, i)).ok().and_then(|s| s.checked_mul(item)).ok_or_else(overflow)?
        };
        dims[i] = (extent, stride);
        contiguous = isize::try_from(extent.max(1)).ok().and_then(|e| contiguous.checked_mul(e)).unwrap_or(isize::MAX);
    }
    t.dims = dims;
    Ok(t)
}
