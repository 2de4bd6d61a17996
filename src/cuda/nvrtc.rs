//! The NVRTC edge: the calls into NVRTC's C API that cudarc's safe wrapper does not cover
//! (compiling straight to a CUBIN), and the probe for the library. Every `unsafe` block has its
//! `SAFETY` argument; the program handle is destroyed exactly once, by its `Drop`.

/// Whether the NVRTC library can be loaded, without loading it for good or panicking.
pub(super) fn library_present() -> bool {
    // SAFETY: `is_culib_present` only tries `dlopen` on NVRTC's library names and drops what it
    // opened; no NVRTC code runs.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// Compiles `source` with NVRTC `options` straight to a CUBIN (SASS for one real architecture,
/// `--gpu-architecture=sm_XY`): loading it needs no PTX JIT, so a driver older than the NVRTC
/// that compiled it still loads it. `Err` carries NVRTC's log or error. The caller has checked
/// that NVRTC is present.
pub(super) fn compile_cubin(source: &str, options: &[String]) -> Result<Vec<u8>, String> {
    use cudarc::nvrtc::{result, sys};
    struct Program(sys::nvrtcProgram);
    impl Drop for Program {
        fn drop(&mut self) {
            // SAFETY: `self.0` came from `create_program` and is destroyed exactly once, here.
            let _ = unsafe { result::destroy_program(self.0) };
        }
    }
    let src = std::ffi::CString::new(source).map_err(|_| "the source contains a NUL byte".to_string())?;
    let name = c"kvguard.cu";
    let program = Program(result::create_program(&src, Some(name)).map_err(|e| format!("{e:?}"))?);
    // SAFETY: `program.0` is a live program; the options are NUL-free strings copied by NVRTC.
    if let Err(e) = unsafe { result::compile_program(program.0, options) } {
        // SAFETY: the program is live; the log is a NUL-terminated copy owned by the Vec.
        let log = unsafe { result::get_program_log(program.0) }.unwrap_or_default();
        let bytes: Vec<u8> = log.iter().map(|&c| c as u8).take_while(|&b| b != 0).collect();
        return Err(format!("{e:?}: {}", String::from_utf8_lossy(&bytes)));
    }
    let mut size = 0usize;
    // SAFETY: the program compiled; `size` is a valid out-pointer.
    unsafe { sys::nvrtcGetCUBINSize(program.0, &mut size) }.result().map_err(|e| format!("{e:?}"))?;
    let mut cubin = vec![0u8; size];
    // SAFETY: `cubin` has exactly the `size` bytes NVRTC asked for.
    unsafe { sys::nvrtcGetCUBIN(program.0, cubin.as_mut_ptr().cast()) }.result().map_err(|e| format!("{e:?}"))?;
    Ok(cubin)
}
