//! What the engine lends kvguard: its device memory ([`Borrowed`]) and the streams to queue
//! work on ([`EngineStream`]).
//!
//! kvguard cannot check that a raw device address or stream handle is live, so each enters
//! through an `unsafe` constructor whose `# Safety` section is the engine's promise. This file
//! holds those two declarations and nothing else unsafe; everything downstream takes the values
//! safely and checks what it can (every launch checks that the elements it touches lie inside
//! what was lent).

use std::marker::PhantomData;

/// Device memory the engine owns and lends to kvguard: `len` elements of `T` at a device address.
/// kvguard never frees it.
#[derive(Debug, PartialEq, Eq)]
pub struct Borrowed<T> {
    ptr: u64,
    len: usize,
    elem: PhantomData<fn() -> T>,
}

impl<T> Clone for Borrowed<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Borrowed<T> {}

impl<T> Borrowed<T> {
    /// Lends `len` elements of `T` at device address `ptr` (a `CUdeviceptr`, e.g. a PyTorch
    /// tensor's `data_ptr()`).
    ///
    /// # Safety
    /// - `ptr` is an address in the CUDA context of the [`DeviceGuard`](super::DeviceGuard) this
    ///   is passed to, aligned for `T` (and to 16 bytes for pages given to the scrub kernel's
    ///   vector path, which it checks itself), and `len * size_of::<T>()` bytes from it are one
    ///   live allocation (`len == 0` needs no allocation);
    /// - the memory stays allocated, and is not handed to anything else, until every kvguard
    ///   launch given this value has completed on its stream;
    /// - nothing else writes memory a launch reads, or touches memory a launch writes, unless
    ///   ordered with the launch on the stream (the usual rule for a CUDA kernel's arguments).
    pub unsafe fn from_raw(ptr: u64, len: usize) -> Borrowed<T> {
        Borrowed { ptr, len, elem: PhantomData }
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// Elements lent.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is lent.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// A CUDA stream to queue kvguard's work on, passed with every call that queues any (e.g.
/// PyTorch's current stream, or the side stream a `torch.cuda.graph` captures on), so that
/// kvguard's launches are ordered with the engine's own work exactly as the caller chooses.
#[derive(Debug)]
pub struct EngineStream {
    raw: cudarc::driver::sys::CUstream,
}

impl EngineStream {
    /// Lends the stream `stream` (a `CUstream`, e.g. `torch.cuda.current_stream().cuda_stream`).
    ///
    /// # Safety
    /// - `stream` is a live `CUstream` of the CUDA context of the
    ///   [`DeviceGuard`](super::DeviceGuard) it is given to (the primary context of the guard's
    ///   device ordinal), or null (the legacy default stream, which cannot be captured);
    /// - it stays alive during every call it is given to (work already queued on it may
    ///   outlive it, as CUDA allows).
    pub unsafe fn from_raw(stream: cudarc::driver::sys::CUstream) -> EngineStream {
        EngineStream { raw: stream }
    }

    /// The `CUstream` handle.
    pub fn as_raw(&self) -> cudarc::driver::sys::CUstream {
        self.raw
    }
}
