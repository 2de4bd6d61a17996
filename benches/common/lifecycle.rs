//! The engine's own work and one request's life, as the lifecycle benchmarks run them (shared
//! by `benches/ownership.rs` and `benches/instructions.rs`).

use kvguard::{OwnershipTable, PageId, RequestId, TenantId};
use std::hint::black_box;

/// Tokens per page.
pub const PS: u32 = 16;
/// Pages of one request in a lifecycle.
pub const PAGES: u32 = 256;
/// Tokens of one request in a lifecycle.
pub const TOKENS: u64 = PAGES as u64 * PS as u64;

/// What an engine does per page when reading without kvguard: address math over the block table.
pub fn walk(block_table: &[PageId]) -> u64 {
    block_table.iter().map(|p| u64::from(p.0) * u64::from(PS)).fold(0, u64::wrapping_add)
}

/// One request's life: admitted, given its pages, written through the slot mapping the engine
/// builds with `slot_mapping`, read and released.
#[inline(always)]
pub fn one_request(
    table: &OwnershipTable,
    r: u64,
    bt: &mut Vec<PageId>,
    slots: &mut Vec<u64>,
    slot_mapping: impl Fn(&[PageId], u64, &mut Vec<u64>),
) {
    let req = RequestId(r);
    table.admit(req, TenantId(r % 4), TOKENS, 0).expect("admit");
    // The engine's block table row, filled with the pages' ids (the engine keeps no refs).
    bt.clear();
    table.allocate_pages_into(req, PAGES, bt).expect("allocate");
    slot_mapping(bt, TOKENS, slots);
    table.record_write_tokens(req, bt, 0..TOKENS).expect("write");
    table.verify_read(req, bt, TOKENS).expect("read");
    black_box(walk(bt));
    black_box(table.release(req).expect("release"));
}
