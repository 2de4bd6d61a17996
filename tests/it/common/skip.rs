//! Loud skips. A test that cannot run on this machine (no GPU, no NVRTC, no C++ compiler) says
//! so on stderr and appends a line to `$KVGUARD_SKIP_LOG`; `scripts/test` prints that file after
//! the suite and counts it in its summary, so a skip is never a silent pass.

use std::io::Write;

/// Records that the current test was skipped, and why.
pub fn skipped(why: &str) {
    let test = std::thread::current().name().unwrap_or("(unnamed test)").to_string();
    eprintln!("\n*** SKIPPED {test}: {why} ***\n");
    if let Some(path) = std::env::var_os("KVGUARD_SKIP_LOG")
        && let Ok(mut log) = std::fs::OpenOptions::new().create(true).append(true).open(path)
    {
        // One write of the whole line: tests skip from several threads at once, and appends of
        // one small write each do not interleave.
        let line = format!("{test}: {}\n", why.replace('\n', " "));
        let _ = log.write_all(line.as_bytes());
    }
}
