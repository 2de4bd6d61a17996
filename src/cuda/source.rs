//! The kernel sources, embedded, and their compilation through NVRTC (compiled once per
//! architecture and process, then cached).

use super::DeviceError;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// `kernels/kvguard.cuh`: the device API engines include to fuse the checks into their kernels.
pub const KVGUARD_CUH: &str = include_str!("../../kernels/kvguard.cuh");
/// `kernels/kvguard.cu`: kvguard's own kernels.
pub const KVGUARD_CU: &str = include_str!("../../kernels/kvguard.cu");

/// Every `extern "C"` kernel in `kvguard.cu`.
pub const KERNELS: &[&str] = &[
    "kvg_apply_tag_updates",
    "kvg_verify_block_table",
    "kvg_verify_paged_kv",
    "kvg_store_kv_b32",
    "kvg_store_kv_b16",
    "kvg_crc32_pages",
    "kvg_scrub_pages",
    "kvg_decode_attention_unchecked",
    "kvg_decode_attention_checked",
];

/// One translation unit for NVRTC: `kvguard.cu` with `kvguard.cuh` inlined where it is included,
/// so compiling needs no file system and no CUDA headers.
pub fn nvrtc_source() -> String {
    KVGUARD_CU.replacen("#include \"kvguard.cuh\"", KVGUARD_CUH, 1)
}

/// Whether the NVRTC library can be loaded (without loading it for good, and without panicking).
pub fn nvrtc_available() -> bool {
    super::backend::nvrtc_library_present()
}

/// Compiles the kernels to a CUBIN for a real architecture such as `"sm_90"` (what
/// [`DeviceGuard`](super::DeviceGuard) loads: no PTX JIT); cached per architecture for the life
/// of the process. Errors as [`compile_ptx`].
pub fn compile_cubin(arch: &str) -> Result<Arc<[u8]>, DeviceError> {
    static CACHE: OnceLock<Mutex<HashMap<String, Arc<[u8]>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(cubin) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(arch) {
        return Ok(cubin.clone());
    }
    if !nvrtc_available() {
        return Err(DeviceError::NvrtcNotFound);
    }
    let options = vec![format!("--gpu-architecture={arch}"), "--std=c++17".into(), "-lineinfo".into()];
    let source = nvrtc_source();
    let compiled = std::panic::catch_unwind(|| super::backend::nvrtc_cubin(&source, &options))
        .map_err(|p| DeviceError::Loader(super::panic_message(p)))?;
    let cubin: Arc<[u8]> = compiled.map_err(|log| DeviceError::Compile { arch: arch.to_string(), log })?.into();
    cache.lock().unwrap_or_else(|e| e.into_inner()).insert(arch.to_string(), cubin.clone());
    Ok(cubin)
}

/// Compiles the kernels to PTX for a virtual architecture such as `"compute_90"`; cached per
/// architecture for the life of the process.
///
/// Returns [`DeviceError::NvrtcNotFound`] when NVRTC cannot be loaded and
/// [`DeviceError::Compile`] with NVRTC's log when the sources do not compile.
pub fn compile_ptx(arch: &str) -> Result<Arc<str>, DeviceError> {
    static CACHE: OnceLock<Mutex<HashMap<String, Arc<str>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(ptx) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(arch) {
        return Ok(ptx.clone());
    }
    if !nvrtc_available() {
        return Err(DeviceError::NvrtcNotFound);
    }
    let opts = cudarc::nvrtc::CompileOptions {
        options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".into(), "-lineinfo".into()],
        name: Some("kvguard.cu".into()),
        ..Default::default()
    };
    let source = nvrtc_source();
    // Loading NVRTC's symbols panics in cudarc if the library lacks one (a toolkit older than
    // this crate's cudarc features): the probe above rules out a missing library, and this turns
    // the remaining case into an error instead of a panic.
    let compiled = std::panic::catch_unwind(|| cudarc::nvrtc::compile_ptx_with_opts(&source, opts))
        .map_err(|p| DeviceError::Loader(super::panic_message(p)))?;
    let ptx: Arc<str> = compiled
        .map_err(|e| {
            let log = match &e {
                cudarc::nvrtc::CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
                other => other.to_string(),
            };
            DeviceError::Compile { arch: arch.to_string(), log }
        })?
        .to_src()
        .into();
    cache.lock().unwrap_or_else(|e| e.into_inner()).insert(arch.to_string(), ptx.clone());
    Ok(ptx)
}
