//! Arbitrary engine steps (events before and after the writes, rows of garbage, foreign and
//! free pages, any counts) through `OwnershipTable::engine_step`, beside the calls it stands
//! for made one by one on a second table: the same verdict at every stage and the same pages
//! after every step, under both policies (`tests/it/model/step.rs`); after each, a decode row
//! write against a plugin's mirror of the pool beside its claims one by one
//! (`tests/it/model/mirror.rs`).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../tests/it/model/mod.rs"]
mod model;

fuzz_target!(|steps: Vec<model::step::Drawn>| {
    model::step::same_as_one_by_one(&steps, kvguard::Policy::Enforce);
    model::step::same_as_one_by_one(&steps, kvguard::Policy::Report);
});
