//! A prefill node and a decode node exchanging KV pages and manifests over loopback TCP, once per
//! injected fault: every fault is refused by decode with its named error, the clean run passes.
//!
//! ```text
//! cargo run -p kvguard-sim --example disagg_tcp                    # every fault
//! cargo run -p kvguard-sim --example disagg_tcp -- --fault late    # one
//! ```
//!
//! The same two roles run as separate processes with `kvguard-disagg decode` / `kvguard-disagg
//! prefill --port P --fault F`; here they are two threads of one process, on real sockets.

use clap::Parser;
use kvguard_sim::disagg::{self, DisaggConfig, Fault};
use std::process::ExitCode;

/// A prefill and a decode node exchanging KV over loopback TCP, once per injected fault.
#[derive(Parser)]
#[command(name = "disagg_tcp")]
struct Args {
    /// Run only this fault: none, truncate-page, flip-byte, wrong-request, late, dummy-prompt,
    /// missing-checksum (default: every one).
    #[arg(long, value_name = "NAME")]
    fault: Option<Fault>,
    /// Workload seed.
    #[arg(long, default_value_t = DisaggConfig::default().seed)]
    seed: u64,
}

fn main() -> ExitCode {
    let args = Args::parse();
    let faults = args.fault.map_or_else(|| Fault::ALL.to_vec(), |f| vec![f]);
    let config = DisaggConfig { seed: args.seed, ..DisaggConfig::default() };
    let mut all_as_expected = true;
    for fault in faults {
        println!("== fault {fault}");
        let listener = match disagg::bind_decode(0) {
            Ok(l) => l,
            Err(e) => {
                eprintln!("cannot listen on loopback: {e}");
                return ExitCode::from(1);
            }
        };
        let port = listener.local_addr().map(|a| a.port()).unwrap_or(0);
        let prefill = std::thread::spawn(move || {
            let mut log = Vec::new();
            let result = disagg::run_prefill(port, fault, config, &mut log);
            (result.map_err(|e| e.to_string()), String::from_utf8_lossy(&log).into_owned())
        });
        let mut log = Vec::new();
        let decoded = disagg::run_decode(&listener, config, &mut log);
        let (sent, prefill_log) =
            prefill.join().unwrap_or_else(|_| (Err("prefill thread panicked".into()), String::new()));
        print!("{prefill_log}{}", String::from_utf8_lossy(&log));
        let refused: Vec<&str> = match (&decoded, &sent) {
            (Ok(s), Ok(_)) => s.refused.iter().map(|&(_, k)| k).collect(),
            (d, p) => {
                println!("error: decode {:?}, prefill {:?}", d.as_ref().err(), p.as_ref().err());
                all_as_expected = false;
                continue;
            }
        };
        let expected: Vec<&str> = fault.expected_refusal().into_iter().collect();
        let verdict = if refused == expected { "as expected" } else { "UNEXPECTED" };
        all_as_expected &= refused == expected;
        println!("-> refused {refused:?}, {verdict}\n");
    }
    if all_as_expected { ExitCode::SUCCESS } else { ExitCode::from(1) }
}
