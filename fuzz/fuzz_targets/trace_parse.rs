//! Arbitrary bytes through the trace parser and replayer: never a panic, whatever the input.
//!
//! The pool is capped at 4,096 pages so an input cannot ask for gigabytes of page tags; every other
//! limit is the replayer's default.
#![no_main]
use kvguard::trace::{ReplayOptions, Replayer};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let options = ReplayOptions::default().with_max_pool_pages(4096).with_max_line_bytes(1 << 16);
    // Whole-trace streaming.
    let mut replayer = Replayer::with_options(options);
    let mut violations = 0u64;
    let result = replayer.replay(data, |v| {
        // Formatting a verdict must not panic either.
        let _ = v.to_string();
        violations += 1;
        Ok(())
    });
    match result {
        Ok(summary) => assert_eq!(summary.violations, violations),
        Err(e) => {
            let _ = e.to_string();
            assert!(e.line() >= 1);
        }
    }
    // Line by line, going on past unusable lines.
    let mut replayer = Replayer::with_options(options);
    for line in data.split(|&b| b == b'\n') {
        let _ = replayer.feed_line(line);
    }
});
