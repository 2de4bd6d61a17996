//! One side of a disaggregated prefill/decode pair over loopback TCP (issue 3).
fn main() {}
