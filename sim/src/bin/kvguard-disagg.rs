//! One side of a disaggregated prefill/decode pair on loopback, with fault injection. The KV
//! travels inside the TCP frames (`--transport tcp`, the default) or over NIXL (`nixl-write`:
//! prefill writes decode's pages; `nixl-read`: decode reads prefill's; needs feature `nixl` and
//! `libnixl_capi.so` on `LD_LIBRARY_PATH`), the control frames over TCP either way.
//!
//! ```text
//! kvguard-disagg decode --port 0             # prints "listening 127.0.0.1:PORT", then one line per request
//! kvguard-disagg prefill --port PORT --fault flip-byte
//! kvguard-disagg --transport nixl-write decode --port 0
//! kvguard-disagg --transport nixl-write prefill --port PORT --fault late
//! ```
//!
//! Exit codes: 0 every transfer accepted (decode) or every pull answered (prefill); 3 decode
//! refused at least one transfer (each printed as `REFUSED req N: <kind>: <error>`); 1 an i/o or
//! protocol error; 2 bad arguments.

use clap::{Parser, Subcommand};
use kvguard_sim::disagg::{self, DisaggConfig, Fault, Transport};
use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Parser)]
#[command(name = "kvguard-disagg", about = "A prefill or decode node exchanging KV over loopback TCP")]
struct Cli {
    #[command(subcommand)]
    role: Role,
    /// Workload seed (both nodes must use the same).
    #[arg(long, default_value_t = 1, global = true)]
    seed: u64,
    /// Requests in the workload (both nodes must use the same), at most 100,000.
    #[arg(long, default_value_t = 3, global = true,
          value_parser = clap::value_parser!(u32).range(1..=i64::from(disagg::MAX_REQUESTS)))]
    requests: u32,
    /// Deadline of each frame, in milliseconds (a frame sent or received whole), 1 to 3,600,000.
    #[arg(long, default_value_t = 10_000, global = true, value_parser = clap::value_parser!(u64).range(1..=3_600_000))]
    timeout_ms: u64,
    /// How the KV travels (both nodes must use the same): tcp, nixl-write, nixl-read.
    #[arg(long, default_value = "tcp", global = true)]
    transport: Transport,
}

#[derive(Subcommand)]
enum Role {
    /// Listen on 127.0.0.1, pull every request's KV, verify each transfer.
    Decode {
        /// Port to listen on; 0 picks an ephemeral one (printed).
        #[arg(long, default_value_t = 0)]
        port: u16,
    },
    /// Connect to the decode node and answer its pulls.
    Prefill {
        /// The decode node's port on 127.0.0.1.
        #[arg(long)]
        port: u16,
        /// Fault injected into the second request's transfer: none, truncate-page, flip-byte,
        /// wrong-request, late, dummy-prompt, missing-checksum.
        #[arg(long, default_value = "none")]
        fault: Fault,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let config = DisaggConfig {
        seed: cli.seed,
        requests: cli.requests,
        timeout: Duration::from_millis(cli.timeout_ms),
        transport: cli.transport,
    };
    let mut out = std::io::stdout();
    match cli.role {
        Role::Decode { port } => {
            let listener = match disagg::bind_decode(port) {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("decode: cannot listen on 127.0.0.1:{port}: {e}");
                    return ExitCode::from(1);
                }
            };
            match listener.local_addr() {
                Ok(addr) => {
                    let _ = writeln!(out, "listening {addr}");
                    let _ = out.flush();
                }
                Err(e) => {
                    eprintln!("decode: {e}");
                    return ExitCode::from(1);
                }
            }
            match disagg::run_decode(&listener, config, &mut out) {
                Ok(s) if s.refused.is_empty() => {
                    let _ = writeln!(out, "decode: {} transfers accepted", s.accepted);
                    ExitCode::SUCCESS
                }
                Ok(s) => {
                    let _ = writeln!(out, "decode: {} accepted, {} refused", s.accepted, s.refused.len());
                    ExitCode::from(3)
                }
                Err(e) => {
                    eprintln!("decode: {e}");
                    ExitCode::from(1)
                }
            }
        }
        Role::Prefill { port, fault } => match disagg::run_prefill(port, fault, config, &mut out) {
            Ok(n) => {
                let _ = writeln!(out, "prefill: {n} transfers sent");
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("prefill: {e}");
                ExitCode::from(1)
            }
        },
    }
}
