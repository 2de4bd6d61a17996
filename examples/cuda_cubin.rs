//! Writes kvguard's kernels as a CUBIN for one GPU architecture, to be loaded where NVRTC is not
//! installed (`DeviceOptions::cubin`). Needs NVRTC here, no GPU.
//!
//! ```text
//! cargo run --release --features cuda --example cuda_cubin -- --arch sm_90 --out kvguard.sm_90.cubin
//! ```
//!
//! Exits 0 after writing the file, 1 if the kernels cannot be compiled (no NVRTC, or an
//! architecture it does not know) or the file cannot be written, 2 on bad arguments.

use kvguard::cuda::source;
use std::path::PathBuf;
use std::process::ExitCode;

const USAGE: &str = "usage: cuda_cubin --arch sm_XY --out PATH";

/// The architecture and output path named on the command line.
struct Request {
    arch: String,
    out: PathBuf,
}

fn parse(mut args: impl Iterator<Item = String>) -> Result<Request, String> {
    let (mut arch, mut out) = (None, None);
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((flag, value)) => (flag.to_string(), Some(value.to_string())),
            None => (arg, None),
        };
        let slot = match flag.as_str() {
            "--arch" => &mut arch,
            "--out" => &mut out,
            "-h" | "--help" => return Err(USAGE.into()),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        };
        let value = inline.or_else(|| args.next()).ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?;
        *slot = Some(value);
    }
    let arch = arch.ok_or_else(|| format!("--arch is required\n{USAGE}"))?;
    let digits = arch.strip_prefix("sm_").unwrap_or("");
    if digits.len() < 2 || !digits.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err(format!("--arch {arch:?} is not a real architecture such as sm_90\n{USAGE}"));
    }
    let out = PathBuf::from(out.ok_or_else(|| format!("--out is required\n{USAGE}"))?);
    Ok(Request { arch, out })
}

fn main() -> ExitCode {
    let request = match parse(std::env::args().skip(1)) {
        Ok(r) => r,
        Err(message) => {
            eprintln!("cuda_cubin: {message}");
            return ExitCode::from(2);
        }
    };
    let cubin = match source::compile_cubin(&request.arch) {
        Ok(cubin) => cubin,
        Err(e) => {
            eprintln!("cuda_cubin: cannot build the kernels for {}: {e}", request.arch);
            return ExitCode::from(1);
        }
    };
    if let Err(e) = source::check_cubin(&cubin) {
        eprintln!("cuda_cubin: NVRTC's output for {} is not a loadable CUBIN: {e}", request.arch);
        return ExitCode::from(1);
    }
    if let Err(e) = std::fs::write(&request.out, &cubin) {
        eprintln!("cuda_cubin: cannot write {}: {e}", request.out.display());
        return ExitCode::from(1);
    }
    println!(
        "cuda_cubin: wrote {} ({} bytes, {}, fingerprint {})",
        request.out.display(),
        cubin.len(),
        request.arch,
        source::fingerprint_kernel()
    );
    ExitCode::SUCCESS
}
