//! The `kvguard` command line (replay, audit): see issue 4.
fn main() {}
