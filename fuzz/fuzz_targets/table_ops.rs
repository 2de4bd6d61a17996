//! Arbitrary operation sequences against the ownership table, checked after every operation
//! against the reference model the proptest suite uses (tests/model/mod.rs): same successes and
//! refusals, same page states, owners, generations (never decreasing) and coverage, pages
//! conserved, and every page back in the pool once everything is released.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../tests/it/model/mod.rs"]
mod model;

fuzz_target!(|ops: Vec<model::Op>| {
    model::run(&ops);
});
