//! Device-side checks through CUDA (issue 5).
