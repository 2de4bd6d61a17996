//! Writes kvguard's kernels as a CUBIN for one GPU architecture (placeholder; see scripts/gpu-check).
fn main() {}
