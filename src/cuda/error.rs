//! [`DeviceError`]: why the device side could not be set up or a device operation failed.

/// Why the device side could not be set up or a device operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// The CUDA driver library (`libcuda.so`) is not installed: no NVIDIA driver here.
    #[error("the CUDA driver library (libcuda) could not be loaded: no NVIDIA driver on this machine")]
    DriverNotFound,
    /// The driver loaded but has no device of that ordinal.
    #[error("no CUDA device {ordinal}: the driver reports {count} device(s)")]
    NoDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// Devices the driver reports.
        count: i32,
    },
    /// NVRTC (`libnvrtc.so`) could not be loaded, so the kernels cannot be compiled.
    #[error(
        "the NVRTC library (libnvrtc) could not be loaded: install the CUDA toolkit or the \
         nvidia-cuda-nvrtc-cu12 wheel and put its lib directory on LD_LIBRARY_PATH, or pass kernels \
         built ahead of time as DeviceOptions::cubin"
    )]
    NvrtcNotFound,
    /// A prebuilt CUBIN ([`DeviceOptions::cubin`](super::DeviceOptions::cubin)) cannot be used:
    /// not a CUDA ELF image, no code for this device's architecture, or built from other kernel
    /// sources than this kvguard's (see [`fingerprint_kernel`](super::source::fingerprint_kernel)).
    #[error("the prebuilt kvguard CUBIN cannot be used: {0}")]
    Cubin(String),
    /// NVRTC refused the kernel sources.
    #[error("kvguard kernels did not compile for {arch}: {log}")]
    Compile {
        /// The virtual architecture (`compute_90`).
        arch: String,
        /// NVRTC's log.
        log: String,
    },
    /// A CUDA library was found but could not be used (a missing symbol: too old a driver or
    /// toolkit for this build).
    #[error("a CUDA library could not be used: {0}")]
    Loader(String),
    /// A driver call failed.
    #[error("CUDA driver error: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// An argument does not fit the guard's buffers or the memory it names.
    #[error("{0}")]
    Argument(String),
}

/// The message of a panic a CUDA library raised while loading (cudarc panics on a missing symbol).
pub(super) fn panic_message(p: Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a CUDA library panicked while loading".into())
}
