//! Writes kvguard's kernels as a CUBIN for one GPU architecture, to be loaded where NVRTC is not
//! installed (`DeviceOptions::cubin`). Needs NVRTC here, no GPU.
//!
//! ```text
//! cargo run --release --features cuda --example cuda_cubin -- --arch sm_90 --out kvguard.sm_90.cubin
//! ```
//!
//! Exits 0 after writing the file, 1 if the kernels cannot be compiled (no NVRTC, or an
//! architecture it does not know) or the file cannot be written, 2 on bad arguments.

use clap::Parser;
use kvguard::cuda::source;
use std::path::PathBuf;
use std::process::ExitCode;

/// Writes kvguard's kernels as a CUBIN for one GPU architecture (needs NVRTC, no GPU).
#[derive(Parser, Debug)]
#[command(name = "cuda_cubin")]
struct Args {
    /// The real architecture to build for: sm_90 (H100, H200), sm_80 (A100), ...
    #[arg(long, value_name = "sm_XY", value_parser = parse_arch)]
    arch: String,
    /// Where to write the CUBIN.
    #[arg(long, value_name = "PATH")]
    out: PathBuf,
}

/// A real architecture such as `sm_90` (not a virtual one such as `compute_90`).
fn parse_arch(arch: &str) -> Result<String, String> {
    let digits = arch.strip_prefix("sm_").unwrap_or("");
    if digits.len() < 2 || !digits.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return Err(format!("{arch:?} is not a real architecture such as sm_90"));
    }
    Ok(arch.to_string())
}

fn main() -> ExitCode {
    // Bad arguments: clap prints the error and usage and exits 2.
    let args = Args::parse();
    let cubin = match source::compile_cubin(&args.arch) {
        Ok(cubin) => cubin,
        Err(e) => {
            eprintln!("cuda_cubin: cannot build the kernels for {}: {e}", args.arch);
            return ExitCode::from(1);
        }
    };
    if let Err(e) = source::check_cubin(&cubin) {
        eprintln!("cuda_cubin: NVRTC's output for {} is not a loadable CUBIN: {e}", args.arch);
        return ExitCode::from(1);
    }
    if let Err(e) = std::fs::write(&args.out, &cubin) {
        eprintln!("cuda_cubin: cannot write {}: {e}", args.out.display());
        return ExitCode::from(1);
    }
    println!(
        "cuda_cubin: wrote {} ({} bytes, {}, fingerprint {})",
        args.out.display(),
        cubin.len(),
        args.arch,
        source::fingerprint_kernel()
    );
    ExitCode::SUCCESS
}
