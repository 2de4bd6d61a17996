//! The C ABI's overhead in instructions, for when wall-clock ratios are noisy:
//!
//! ```text
//! cargo build --release -p kvguard-c --example overhead_count
//! for via in rust c_abi; do for n in 0 20; do
//!   valgrind --tool=callgrind --callgrind-out-file=/dev/null target/release/examples/overhead_count $via $n 2>&1 | grep refs
//! done; done
//! ```
//! (refs at 20 calls - refs at 0 calls) / 20 = instructions per call; setup is the same for both.
//! Two more arguments set the step's shape (default `256 256`: rows, blocks per row); `1 16` is
//! one sequence of 16 pages, where the call's fixed cost (handle lookup, guard) shows.
//! `rows_rust` and `rows_c` run `verify_rows` / `kvg_verify_rows` with a row cache kept across
//! the calls: the first checks every row in full, the rest from each row's last page, so take
//! (refs at 21 calls - refs at 1 call) / 20 there. `step_rust` and `step_c` do the same through
//! the one-call engine step (`engine_step` / `kvg_engine_step`: no events, no tokens written,
//! every row read), with the same subtraction. `decode_rust` and `decode_c` run one decode
//! forward through SGLang's layout, a token-slot table (`decode_forward` / `kvg_decode_forward`:
//! each row's last slot written again, its window from the token before it read).
//! `held_rust` and `held_c` run `verify_held_rows` / `kvg_verify_held_rows` through the same rows
//! held by the guard (`HeldBlockTable` / `kvg_held_rows`), the first call in full: subtract as for
//! `rows_*`.

#[path = "../benches/fixture/mod.rs"]
mod fixture;
use fixture::Fixture;
use kvguard::{BlockRows, HeldBlockTable, RowCache};
use std::hint::black_box;

fn main() {
    let mut args = std::env::args().skip(1);
    let via = args.next().unwrap_or_else(|| "rust".to_string());
    let calls: usize = args.next().and_then(|n| n.parse().ok()).unwrap_or(20);
    let rows: usize = args.next().and_then(|n| n.parse().ok()).unwrap_or(256);
    let blocks: usize = args.next().and_then(|n| n.parse().ok()).unwrap_or(256);
    let f = Fixture::new(rows, blocks);
    let reads = f.reads();
    let row_reads = f.row_reads();
    let mut cache = RowCache::new();
    let computed = f.tokens();
    let scheduled = vec![0u64; computed.len()];
    let (slot_table, last_slots) = f.token_slots();
    let mut held = HeldBlockTable::new(rows, blocks).expect("fits");
    for (r, row) in f.matrix.chunks(blocks.max(1)).enumerate() {
        held.append(r as u32, row).expect("fits");
    }
    for _ in 0..calls {
        let clean = match via.as_str() {
            "c_abi" => f.verify_step_c(black_box(&f.matrix)),
            "rows_c" => f.verify_rows_c(black_box(&f.matrix)),
            "held_c" => f.verify_held_rows_c(),
            "held_rust" => {
                f.table.verify_held_rows(&mut held, black_box(&row_reads)).expect("rows in range").is_clean()
            }
            "step_c" => f.engine_step_c(black_box(&f.matrix), &computed, &scheduled),
            "decode_c" => f.decode_forward_c(black_box(&slot_table), &last_slots),
            "decode_rust" => f.decode_forward_rust(black_box(&slot_table), &last_slots),
            "step_rust" => f.engine_step_rust(&mut cache, black_box(&f.matrix), &computed, &scheduled),
            "rows_rust" => {
                let rows = BlockRows::new(black_box(&f.matrix), f.blocks()).expect("whole rows");
                f.table.verify_rows(&mut cache, rows, &row_reads).expect("rows in range").is_clean()
            }
            _ => f.table.verify_step(black_box(&reads)).is_clean(),
        };
        assert!(clean, "the fixture's step is clean");
    }
}
