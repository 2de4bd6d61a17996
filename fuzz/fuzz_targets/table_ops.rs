//! Arbitrary operation sequences against the ownership table, checked after every operation
//! against the reference model the proptest suite uses (tests/model/mod.rs): same successes and
//! refusals, same page states, owners, generations (never decreasing) and coverage, pages
//! conserved, and every page back in the pool once everything is released; and after every
//! operation, every request's row of an engine's block table read through one `RowCache` gets
//! the full check's verdict (`model::run_rows`), and so does each row of a block table the guard
//! holds, changed only through its calls (`model::run_held_rows`).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../tests/it/model/mod.rs"]
mod model;

fuzz_target!(|ops: Vec<model::Op>| {
    model::run_rows(&ops);
    model::run_held_rows(&ops);
});
