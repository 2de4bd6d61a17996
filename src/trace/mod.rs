//! Traces of an engine's ownership events, replayed offline (issue 4).
