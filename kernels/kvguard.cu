// kvguard.cu — kvguard's kernels: tag updates, block-table verification (vLLM, FlashInfer and SGLang
// layouts), a reference KV store that stamps canaries, CRC32 of pages, scrubbing, and a reference
// paged decode attention with and without the fused per-page check.
//
// Every kernel is `extern "C"` (stable names for NVRTC and the driver), takes only fixed-size
// buffers and never waits on the host, so each can be captured into a CUDA graph. Kernels are
// grid-stride loops: any grid works, the launch sizes in `kvguard::cuda` are only the fast ones.
// They also compile as host C++ over the CPU simulator in kernels/host/ for the tests.
#include "kvguard.cuh"

#define KVG_WARP 32u

KVG_FN uint32_t kvg_warp_min(uint32_t v) {
    for (uint32_t o = KVG_WARP / 2; o > 0; o >>= 1) {
        uint32_t other = __shfl_xor_sync(0xffffffffu, v, o);
        v = other < v ? other : v;
    }
    return v;
}

KVG_FN float kvg_warp_sum(float v) {
    for (uint32_t o = KVG_WARP / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// ---------------------------------------------------------------------------------------------
// 1. Tag updates: scatter the pages the host table changed into the device tag table.
// ---------------------------------------------------------------------------------------------

extern "C" __global__ void kvg_apply_tag_updates(kvg_tag *__restrict__ tags, uint32_t num_pages,
                                                 const uint32_t *__restrict__ pages,
                                                 const kvg_tag *__restrict__ updates, uint32_t n) {
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        uint32_t page = pages[i];
        if (page < num_pages) tags[page] = updates[i];
    }
}

// ---------------------------------------------------------------------------------------------
// 2. Verification of a step's block tables, one thread per (sequence, block).
// ---------------------------------------------------------------------------------------------

// Checks block `j` (slots 0..need) of sequence `s`, and, when given, the canaries of its slots
// 0..min(need, stamped): the slots written before this step (this step's own are stamped later).
KVG_FN void kvg_verify_block(const kvg_tag *__restrict__ tags, uint32_t num_pages, uint32_t page_size, int32_t page,
                             uint32_t expected_generation, uint32_t need, uint32_t stamped,
                             const uint32_t *__restrict__ canaries, kvg_reader reader, uint32_t s, uint32_t j,
                             uint32_t *seq_status, kvg_ring *ring) {
    kvg_tag found;
    uint32_t kind = kvg_check_page(tags, num_pages, page, reader, expected_generation, need, &found);
    uint32_t a = 0, b = 0;
    if (kind == KVG_KIND_UNWRITTEN_SLOTS) {
        a = found.written;
        b = need;
    } else if (kind == KVG_OK && canaries != nullptr) {
        const uint64_t h = kvg_canary_page(found.owner, found.generation, static_cast<uint32_t>(page));
        const uint32_t check = stamped < need ? stamped : need;
        for (uint32_t t = 0; t < check; t++) {
            if (!kvg_canary_ok(canaries, page_size, static_cast<uint32_t>(page), t, h)) {
                kind = KVG_KIND_CANARY_MISMATCH;
                a = t;
                b = t + 1;
                break;
            }
        }
    }
    if (kind != KVG_OK) {
        const bool first = kvg_flag(seq_status, s, kind);
        kvg_report_as(ring, first, kind, KVG_OP_READ, s, j, page, a, b, expected_generation, reader, found);
    }
}

// Slots of block `j` written before this step, of a sequence whose first `before` tokens were.
KVG_FN uint32_t kvg_stamped_in_block(uint32_t before, uint32_t j, uint32_t page_size) {
    const uint64_t start = static_cast<uint64_t>(j) * page_size;
    if (before <= start) return 0;
    const uint64_t rest = before - start;
    return rest < page_size ? static_cast<uint32_t>(rest) : page_size;
}

KVG_FN void kvg_report_step(uint32_t kind, uint32_t s, uint32_t j, uint32_t found_amount, uint32_t limit,
                            kvg_reader reader, uint32_t *seq_status, kvg_ring *ring) {
    // Step-level faults carry the amounts in slot_start/slot_end: tokens asked vs covered.
    kvg_tag none = {0, 0, 0, 0, 0, 0};
    const bool first = kvg_flag(seq_status, s, kind);
    kvg_report_as(ring, first, kind, KVG_OP_READ, s, j, -1, found_amount, limit, 0, reader, none);
}

// The tokens of sequence `s` written before this step: `len` minus its query length (this
// step's new tokens), or all `len` when `query_lens` is null. A query length below 0 or above
// `len` is a malformed step: reported, and the sequence is not checked further (returns false).
KVG_FN bool kvg_tokens_before(const int32_t *__restrict__ query_lens, uint32_t s, uint32_t len, bool reporter,
                              kvg_reader reader, uint32_t *seq_status, kvg_ring *ring, uint32_t *before) {
    *before = len;
    if (query_lens == nullptr) return true;
    const int32_t q = query_lens[s];
    if (q < 0 || static_cast<uint32_t>(q) > len) {
        if (reporter) kvg_report_step(KVG_KIND_BAD_LAYOUT, s, 0, static_cast<uint32_t>(q), len, reader, seq_status, ring);
        return false;
    }
    *before = len - static_cast<uint32_t>(q);
    return true;
}

// vLLM layout: `block_table[num_seqs][max_blocks]` (int32, row stride `max_blocks`) and
// `seq_lens[num_seqs]` tokens read. `expected_generations`, if not null, has the block table's
// shape and names the incarnation the engine recorded for each entry. `canaries`, if not null,
// has one word per slot of the pool; `query_lens[num_seqs]`, if not null (read only with
// canaries), is each sequence's tokens of this step, whose slots are not yet stamped: only slots
// `0 .. seq_len - query_len` have their canaries checked.
//
// Work is sized by sequence, not by the row stride: blocks (x, s) stride over sequence s's used
// pages only, so a grid of (a few, num_seqs) blocks is complete at any `max_blocks`; the launch
// (`kvguard::cuda`) picks x from the GPU's SM count and the sequence count. 128 threads.
extern "C" __global__ void __launch_bounds__(128)
    kvg_verify_block_table(const kvg_tag *__restrict__ tags, uint32_t num_pages, uint32_t page_size,
                           const int32_t *__restrict__ block_table, uint32_t num_seqs, uint32_t max_blocks,
                           const int32_t *__restrict__ seq_lens, const uint32_t *__restrict__ expected_generations,
                           const uint32_t *__restrict__ canaries, const int32_t *__restrict__ query_lens,
                           const kvg_reader *__restrict__ readers, uint32_t *seq_status, kvg_ring *ring) {
    for (uint32_t s = blockIdx.y; s < num_seqs; s += gridDim.y) {
        const kvg_reader reader = readers[s];
        const int32_t len = seq_lens[s];
        const uint64_t covered = static_cast<uint64_t>(max_blocks) * page_size;
        const uint32_t first = blockIdx.x * blockDim.x + threadIdx.x;
        if (len < 0 || static_cast<uint64_t>(len) > covered) {
            if (first == 0) {
                uint32_t kind = len < 0 ? KVG_KIND_BAD_LAYOUT : KVG_KIND_BLOCK_TABLE_TOO_SHORT;
                uint32_t cov = covered > 0xffffffffull ? 0xffffffffu : static_cast<uint32_t>(covered);
                kvg_report_step(kind, s, max_blocks, static_cast<uint32_t>(len), cov, reader, seq_status, ring);
            }
            continue;
        }
        uint32_t before = 0;
        if (!kvg_tokens_before(canaries ? query_lens : nullptr, s, static_cast<uint32_t>(len), first == 0, reader,
                               seq_status, ring, &before))
            continue;
        const uint32_t blocks = (static_cast<uint32_t>(len) + page_size - 1) / page_size;
        const int32_t *row = block_table + static_cast<uint64_t>(s) * max_blocks;
        for (uint32_t j = first; j < blocks; j += gridDim.x * blockDim.x) {
            uint32_t rest = static_cast<uint32_t>(len) - j * page_size;
            uint32_t need = rest < page_size ? rest : page_size;
            uint32_t gen = expected_generations ? expected_generations[static_cast<uint64_t>(s) * max_blocks + j] : 0;
            kvg_verify_block(tags, num_pages, page_size, row[j], gen, need, kvg_stamped_in_block(before, j, page_size),
                             canaries, reader, s, j, seq_status, ring);
        }
    }
}

// FlashInfer layout: sequence `s` reads pages `kv_indices[kv_indptr[s] .. kv_indptr[s+1]]`, all
// full but the last, which holds `kv_last_page_len[s]` tokens (1..=page_size when it has pages).
// `kv_indices` has `num_indices` entries; an indptr beyond them is a malformed step, never read.
// `expected_generations`, if not null, is parallel to `kv_indices`; `query_lens` as above.
// Launch: as `kvg_verify_block_table` (blocks (x, s) stride over sequence s's pages), 128 threads.
extern "C" __global__ void __launch_bounds__(128)
    kvg_verify_paged_kv(const kvg_tag *__restrict__ tags, uint32_t num_pages, uint32_t page_size,
                        const int32_t *__restrict__ kv_indptr, const int32_t *__restrict__ kv_indices,
                        const int32_t *__restrict__ kv_last_page_len, uint32_t num_seqs, uint32_t num_indices,
                        const uint32_t *__restrict__ expected_generations, const uint32_t *__restrict__ canaries,
                        const int32_t *__restrict__ query_lens, const kvg_reader *__restrict__ readers,
                        uint32_t *seq_status, kvg_ring *ring) {
    for (uint32_t s = blockIdx.y; s < num_seqs; s += gridDim.y) {
        const kvg_reader reader = readers[s];
        const int32_t start = kv_indptr[s], end = kv_indptr[s + 1];
        const int32_t last = kv_last_page_len[s];
        const uint32_t first = blockIdx.x * blockDim.x + threadIdx.x;
        const bool bad = start < 0 || end < start || static_cast<uint32_t>(end) > num_indices ||
                         (end > start && (last < 1 || static_cast<uint32_t>(last) > page_size));
        if (bad) {
            if (first == 0) {
                kvg_report_step(KVG_KIND_BAD_LAYOUT, s, 0, static_cast<uint32_t>(last), page_size, reader, seq_status,
                                ring);
            }
            continue;
        }
        const uint32_t n = static_cast<uint32_t>(end - start);
        // Tokens read: n - 1 full pages and the last; at most num_indices * page_size.
        const uint64_t tokens = n == 0 ? 0 : static_cast<uint64_t>(n - 1) * page_size + static_cast<uint32_t>(last);
        const uint32_t len = tokens > 0xffffffffull ? 0xffffffffu : static_cast<uint32_t>(tokens);
        uint32_t before = 0;
        if (!kvg_tokens_before(canaries ? query_lens : nullptr, s, len, first == 0, reader, seq_status, ring, &before))
            continue;
        for (uint32_t j = first; j < n; j += gridDim.x * blockDim.x) {
            uint32_t need = j + 1 == n ? static_cast<uint32_t>(last) : page_size;
            uint64_t at = static_cast<uint64_t>(start) + j;
            uint32_t gen = expected_generations ? expected_generations[at] : 0;
            kvg_verify_block(tags, num_pages, page_size, kv_indices[at], gen, need,
                             kvg_stamped_in_block(before, j, page_size), canaries, reader, s, j, seq_status, ring);
        }
    }
}

// SGLang layout, read in place: `req_to_token[num_rows][row_stride]` (int32, one token slot per
// entry, `page * page_size + offset`); sequence `s` reads row `rows[s]` for `seq_lens[s]` tokens
// (int64 both, as SGLang's forward batch has them). Page `j` of the sequence is the page of the
// row's entry `j * page_size`, the first slot of that page (the entry the host check reads), and
// every other entry read must be that page's slot at its offset (one that is not is checked as
// the page it names, up to its slot, as the host check does). A row
// outside `num_rows` or a length below 0 is a malformed step (BAD_LAYOUT); a length beyond the
// row's entries, BLOCK_TABLE_TOO_SHORT (a row need not end at a page's end: one that ends inside
// its last page has no entry for a token past it, whatever that page's slots hold), reported as
// the host check does, against the tokens of the row's whole pages; a negative entry (a slot
// never assigned) names no page.
// Launch: as `kvg_verify_block_table` (blocks (x, s) stride over sequence s's pages), 128 threads.
extern "C" __global__ void __launch_bounds__(128)
    kvg_verify_token_rows(const kvg_tag *__restrict__ tags, uint32_t num_pages, uint32_t page_size,
                          const int32_t *__restrict__ req_to_token, uint32_t num_rows, uint32_t row_stride,
                          const int64_t *__restrict__ rows, const int64_t *__restrict__ seq_lens, uint32_t num_seqs,
                          const kvg_reader *__restrict__ readers, uint32_t *seq_status, kvg_ring *ring) {
    // 32-bit divisions only (a 64-bit one is a subroutine that spills on sm_90). A read may run
    // to the row's last entry, not to its last page's end; one past it is reported against the
    // tokens of the row's whole pages, as the host check reports it.
    const uint32_t row_pages = row_stride / page_size + (row_stride % page_size != 0 ? 1u : 0u);
    const uint32_t whole_tokens = row_stride - row_stride % page_size;
    for (uint32_t s = blockIdx.y; s < num_seqs; s += gridDim.y) {
        const kvg_reader reader = readers[s];
        const int64_t row = rows[s], len = seq_lens[s];
        const uint32_t first = blockIdx.x * blockDim.x + threadIdx.x;
        const bool bad_row = row < 0 || row >= static_cast<int64_t>(num_rows);
        if (bad_row || len < 0 || len > static_cast<int64_t>(row_stride)) {
            if (first == 0) {
                const uint32_t kind = bad_row || len < 0 ? KVG_KIND_BAD_LAYOUT : KVG_KIND_BLOCK_TABLE_TOO_SHORT;
                // Step-level amounts: the row and the rows there are, or the tokens asked and covered.
                const int64_t asked = bad_row ? row : len;
                const uint32_t shown = asked < 0 ? 0u : asked > 0xffffffffll ? 0xffffffffu : static_cast<uint32_t>(asked);
                kvg_report_step(kind, s, row_pages, shown, bad_row ? num_rows : whole_tokens, reader, seq_status, ring);
            }
            continue;
        }
        const uint32_t tokens = static_cast<uint32_t>(len);
        const uint32_t blocks = tokens / page_size + (tokens % page_size != 0 ? 1u : 0u);
        const int32_t *r = req_to_token + static_cast<uint64_t>(row) * row_stride;
        for (uint32_t j = first; j < blocks; j += gridDim.x * blockDim.x) {
            const int32_t slot = r[static_cast<uint64_t>(j) * page_size];
            const int32_t page = slot < 0 ? -1 : static_cast<int32_t>(static_cast<uint32_t>(slot) / page_size);
            const uint32_t rest = tokens - j * page_size;
            const uint32_t need = rest < page_size ? rest : page_size;
            kvg_verify_block(tags, num_pages, page_size, page, 0, need, 0, nullptr, reader, s, j, seq_status, ring);
            if (page < 0) continue; // refused above: it names no page to compare with
            // A per-token reader reads every entry: each must be its page's slot at its offset.
            // One that is not is checked as what it names (its page, up to its slot), as the host
            // check does. Every entry read is in the row: the read is at most the row's stride.
            const int32_t own = page * static_cast<int32_t>(page_size);
            const uint64_t lo = static_cast<uint64_t>(j) * page_size;
            for (uint32_t k = 0; k < need; k++) {
                const int32_t e = r[lo + k];
                // In 64 bits: a page's slots may run past INT32_MAX (a pool of 2^31 slots or more),
                // where `own + k` in int32 would wrap onto a negative entry and pass it.
                if (static_cast<int64_t>(e) == static_cast<int64_t>(own) + k) continue;
                const int32_t other = e < 0 ? -1 : static_cast<int32_t>(static_cast<uint32_t>(e) / page_size);
                const uint32_t upto = e < 0 ? 1u : static_cast<uint32_t>(e) % page_size + 1u;
                kvg_verify_block(tags, num_pages, page_size, other, 0, upto, 0, nullptr, reader, s, j, seq_status, ring);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 3. Reference KV store: slot mapping -> paged cache, canary stamped in the same pass.
// ---------------------------------------------------------------------------------------------

// The sequence token `t` belongs to, from `query_start_loc[num_seqs + 1]` (cumulative tokens).
KVG_FN uint32_t kvg_seq_of_token(const int32_t *__restrict__ query_start_loc, uint32_t num_seqs, uint32_t t) {
    uint32_t lo = 0, hi = num_seqs; // invariant: qsl[lo] <= t < qsl[hi]
    while (hi - lo > 1) {
        uint32_t mid = (lo + hi) / 2;
        if (static_cast<uint32_t>(query_start_loc[mid]) <= t) lo = mid;
        else hi = mid;
    }
    return lo;
}

// Whether token `t` lies in sequence `s`'s tokens `query_start_loc[s] .. [s + 1]` (a sequence
// found by `kvg_seq_of_token`; false when `query_start_loc` is not ordered there).
KVG_FN bool kvg_token_in_seq(const int32_t *__restrict__ query_start_loc, uint32_t s, uint32_t t) {
    const int32_t lo = query_start_loc[s], hi = query_start_loc[s + 1];
    return lo >= 0 && lo <= hi && static_cast<uint32_t>(lo) <= t && t < static_cast<uint32_t>(hi);
}

// Writes token `t`'s K and V (`kv_width` = kv_heads * head_dim elements each) into slot
// `slot_mapping[t]` of a cache laid out `[num_pages][page_size][kv_width]`, if the writing
// sequence owns that page; otherwise nothing is written and the store is reported. Slot -1 is
// padding. A token that writes a slot but lies in no sequence's range (`query_start_loc` ending
// before it, or not ordered there) has no writer: nothing is written, and it is reported
// BAD_LAYOUT with no status word, as `kvg_verify_slot_mapping` reports it.
// Launch: one block of 128 threads per token (any grid works).
template <typename T>
KVG_FN void kvg_store_kv(const T *__restrict__ key, const T *__restrict__ value, T *__restrict__ key_cache,
                         T *__restrict__ value_cache, const int64_t *__restrict__ slot_mapping, uint32_t num_tokens,
                         uint32_t kv_width, uint32_t page_size, const int32_t *__restrict__ query_start_loc,
                         uint32_t num_seqs, const kvg_reader *__restrict__ writers, const kvg_tag *__restrict__ tags,
                         uint32_t num_pages, uint32_t *__restrict__ canaries, uint32_t *seq_status, kvg_ring *ring) {
    for (uint32_t t = blockIdx.x; t < num_tokens; t += gridDim.x) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        const uint32_t s = num_seqs == 0 ? 0u : kvg_seq_of_token(query_start_loc, num_seqs, t);
        // 32-bit division when the slot fits (always below 2^32 slots: the fast path).
        const bool small = slot <= 0xffffffffll;
        const int64_t page = small ? static_cast<uint32_t>(slot) / page_size : slot / page_size;
        const uint32_t in_page = static_cast<uint32_t>(slot - page * page_size);
        if (num_seqs == 0 || !kvg_token_in_seq(query_start_loc, s, t)) {
            if (threadIdx.x == 0) {
                const kvg_reader nobody = {0, 0};
                const kvg_tag none = {0, 0, 0, 0, 0, 0};
                const int32_t p = page > 0x7fffffffll ? 0x7fffffff : static_cast<int32_t>(page);
                kvg_report_as(ring, false, KVG_KIND_BAD_LAYOUT, KVG_OP_WRITE, t, 0, p, in_page, in_page + 1, 0, nobody,
                              none);
            }
            continue;
        }
        const kvg_reader writer = writers[s];
        kvg_tag found;
        const uint32_t kind = kvg_check_store(tags, num_pages, page, writer, &found);
        if (kind != KVG_OK) {
            if (threadIdx.x == 0) {
                const bool first = kvg_flag(seq_status, s, kind);
                int32_t p = page > 0x7fffffffll ? 0x7fffffff : static_cast<int32_t>(page);
                kvg_report_as(ring, first, kind, KVG_OP_WRITE, t, 0, p, in_page, in_page + 1, 0, writer, found);
            }
            continue;
        }
        const uint64_t dst = static_cast<uint64_t>(slot) * kv_width;
        const uint64_t src = static_cast<uint64_t>(t) * kv_width;
        for (uint32_t i = threadIdx.x; i < kv_width; i += blockDim.x) {
            key_cache[dst + i] = key[src + i];
            value_cache[dst + i] = value[src + i];
        }
        // The canary vouches for the KV: it becomes visible only after every thread's K/V
        // writes did (fence each, then the barrier; the branch above is uniform per block).
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0 && canaries != nullptr) {
            kvg_stamp_canary(canaries, page_size, static_cast<uint32_t>(page), in_page, writer.request,
                             found.generation);
        }
    }
}

#define KVG_STORE_ARGS                                                                                                 \
    const int64_t *__restrict__ slot_mapping, uint32_t num_tokens, uint32_t kv_width, uint32_t page_size,             \
        const int32_t *__restrict__ query_start_loc, uint32_t num_seqs, const kvg_reader *__restrict__ writers,      \
        const kvg_tag *__restrict__ tags, uint32_t num_pages, uint32_t *__restrict__ canaries, uint32_t *seq_status, \
        kvg_ring *ring
#define KVG_STORE_PASS                                                                                                 \
    slot_mapping, num_tokens, kv_width, page_size, query_start_loc, num_seqs, writers, tags, num_pages, canaries,     \
        seq_status, ring

// 32-bit elements (f32).
extern "C" __global__ void __launch_bounds__(128)
    kvg_store_kv_b32(const uint32_t *__restrict__ key, const uint32_t *__restrict__ value,
                     uint32_t *__restrict__ key_cache, uint32_t *__restrict__ value_cache, KVG_STORE_ARGS) {
    kvg_store_kv<uint32_t>(key, value, key_cache, value_cache, KVG_STORE_PASS);
}

// 16-bit elements (f16, bf16): the store only moves bits.
extern "C" __global__ void __launch_bounds__(128)
    kvg_store_kv_b16(const uint16_t *__restrict__ key, const uint16_t *__restrict__ value,
                     uint16_t *__restrict__ key_cache, uint16_t *__restrict__ value_cache, KVG_STORE_ARGS) {
    kvg_store_kv<uint16_t>(key, value, key_cache, value_cache, KVG_STORE_PASS);
}

// ---------------------------------------------------------------------------------------------
// 3b. A step the engine built on the device (vLLM's Model Runner V2 gathers its block tables and
// computes its slot mappings there): its writes checked in place, then every refused sequence
// fenced in place, so attention neither reads nor writes for it. No host synchronisation.
// ---------------------------------------------------------------------------------------------

// Checks the step's KV writes without storing anything: token `t` (t < num_tokens) writes slot
// `slot_mapping[t]` (-1 or any negative slot: padding, nothing written), which must lie in a page
// the writer of its sequence owns exclusively (`kvg_check_store`, as the reference store). The
// sequences' tokens are `query_start_loc[s] .. [s + 1]` (int32, `[num_seqs + 1]`). A sequence
// whose range is malformed (negative, decreasing, past num_tokens) is flagged BAD_LAYOUT; a
// token that writes a slot but lies in no sequence's range is reported BAD_LAYOUT (as sequence
// `num_seqs`, no status word) and fenced by `kvg_fence_refused` all the same.
// Launch: any grid, 128 threads (grid-stride over tokens, then over sequences).
extern "C" __global__ void __launch_bounds__(128)
    kvg_verify_slot_mapping(const kvg_tag *__restrict__ tags, uint32_t num_pages, uint32_t page_size,
                            const int64_t *__restrict__ slot_mapping, uint32_t num_tokens,
                            const int32_t *__restrict__ query_start_loc, uint32_t num_seqs,
                            const kvg_reader *__restrict__ writers, uint32_t *seq_status, kvg_ring *ring) {
    const uint32_t first = blockIdx.x * blockDim.x + threadIdx.x, stride = gridDim.x * blockDim.x;
    for (uint32_t s = first; s < num_seqs; s += stride) {
        const int32_t lo = query_start_loc[s], hi = query_start_loc[s + 1];
        if (lo < 0 || hi < lo || static_cast<uint32_t>(hi) > num_tokens) {
            const uint32_t shown = hi < 0 ? 0u : static_cast<uint32_t>(hi);
            kvg_report_step(KVG_KIND_BAD_LAYOUT, s, 0, shown, num_tokens, writers[s], seq_status, ring);
        }
    }
    for (uint32_t t = first; t < num_tokens; t += stride) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        const uint32_t s = num_seqs == 0 ? 0u : kvg_seq_of_token(query_start_loc, num_seqs, t);
        const int64_t page = slot <= 0xffffffffll ? static_cast<uint32_t>(slot) / page_size : slot / page_size;
        const uint32_t in_page = static_cast<uint32_t>(slot - page * page_size);
        const int32_t shown = page > 0x7fffffffll ? 0x7fffffff : static_cast<int32_t>(page);
        if (num_seqs == 0 || !kvg_token_in_seq(query_start_loc, s, t)) {
            const kvg_reader nobody = {0, 0};
            const kvg_tag none = {0, 0, 0, 0, 0, 0};
            kvg_report_as(ring, false, KVG_KIND_BAD_LAYOUT, KVG_OP_WRITE, num_seqs, t, shown, in_page, in_page + 1, 0,
                          nobody, none);
            continue;
        }
        const kvg_reader writer = writers[s];
        kvg_tag found;
        const uint32_t kind = kvg_check_store(tags, num_pages, page, writer, &found);
        if (kind != KVG_OK) {
            const bool first = kvg_flag(seq_status, s, kind);
            kvg_report_as(ring, first, kind, KVG_OP_WRITE, s, t, shown, in_page, in_page + 1, 0, writer, found);
        }
    }
}

// Fences every sequence a check of this step flagged (`seq_status[s] != 0`, the verify kernels'
// status words, complete before this launch on the same stream): its row of `block_table`
// (`[num_seqs][max_blocks]` int32, may be null) is set to page 0, the pool's reserved null page,
// and its tokens' slots in `slot_mapping` (`[num_tokens]` int64, may be null) to -1, padding, so
// attention reads no one's KV for it and its KV store writes nothing. A token in no sequence's
// range (after the last sequence, or under a malformed `query_start_loc`) is set to -1 too.
// Launch: any grid, 128 threads.
extern "C" __global__ void __launch_bounds__(128)
    kvg_fence_refused(const uint32_t *__restrict__ seq_status, uint32_t num_seqs,
                      const int32_t *__restrict__ query_start_loc, int32_t *__restrict__ block_table,
                      uint32_t max_blocks, int64_t *__restrict__ slot_mapping, uint32_t num_tokens) {
    if (block_table != nullptr) {
        for (uint32_t s = blockIdx.y; s < num_seqs; s += gridDim.y) {
            if (seq_status[s] == 0) continue;
            int32_t *row = block_table + static_cast<uint64_t>(s) * max_blocks;
            for (uint32_t j = blockIdx.x * blockDim.x + threadIdx.x; j < max_blocks; j += gridDim.x * blockDim.x)
                row[j] = 0;
        }
    }
    if (slot_mapping != nullptr) {
        const uint32_t threads = gridDim.x * gridDim.y * blockDim.x;
        const uint32_t me = (blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + threadIdx.x;
        for (uint32_t t = me; t < num_tokens; t += threads) {
            if (slot_mapping[t] < 0) continue;
            const uint32_t s = num_seqs == 0 ? 0u : kvg_seq_of_token(query_start_loc, num_seqs, t);
            if (num_seqs == 0 || !kvg_token_in_seq(query_start_loc, s, t) || seq_status[s] != 0) slot_mapping[t] = -1;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 4. CRC32 of pages, bit-exact with crc32fast. Thread t hashes bytes [t E, (t+1) E) of a page, E a
// power of two; the chunk CRCs are combined by a tree in shared memory, where joining two spans
// of s chunks shifts the left one by x^(8 s E) mod P, a table entry since s E is a power of two
// (zlib's crc32_combine without its general-length cost). The tail past the last full chunk is
// folded in last.
// ---------------------------------------------------------------------------------------------

#define KVG_CRC32_MAX_THREADS 256u

// CRC32 of `page_bytes` bytes at `base + page * page_stride` for each page in `pages` (or pages
// 0..n_pages when null), into `out[i]`. Page ids outside 0..num_pages are not read (their CRC is
// written as 0). `chunk_bytes` is the least bytes per thread (0: 16). Launch: blocks of a power of
// two threads, at most 256 (256 is the fast one), and a persistent grid (a few blocks per SM,
// `kvguard::cuda` uses 8): each block builds its 4 KiB table in shared memory once, then strides
// over the pages, so the table costs once per block, not once per page (any grid is complete).
extern "C" __global__ void __launch_bounds__(256)
    kvg_crc32_pages(const uint8_t *__restrict__ base, uint64_t page_stride, uint64_t page_bytes,
                    const int32_t *__restrict__ pages, uint32_t n_pages, uint32_t num_pages, uint32_t chunk_bytes,
                    uint32_t *out) {
    __shared__ uint32_t table[KVG_CRC32_TABLE_WORDS];
    __shared__ uint32_t slot[KVG_CRC32_MAX_THREADS];
    __shared__ uint32_t tail_crc;
    const uint32_t threads = blockDim.x, t = threadIdx.x;
    if (threads > KVG_CRC32_MAX_THREADS || (threads & (threads - 1)) != 0) return;
    for (uint32_t i = t; i < KVG_CRC32_TABLE_WORDS; i += threads) table[i] = kvg_crc32_table_entry(i);
    uint32_t log_e = 0;
    while ((1u << log_e) < (chunk_bytes ? chunk_bytes : 16u) && log_e < 31) log_e++;
    while ((static_cast<uint64_t>(threads) << log_e) < page_bytes) log_e++;
    const uint64_t chunk = 1ull << log_e;
    const uint64_t full = page_bytes >> log_e; // <= threads
    const uint64_t tail = page_bytes & (chunk - 1);
    __syncthreads();
    for (uint32_t i = blockIdx.x; i < n_pages; i += gridDim.x) {
        const int64_t id = pages ? pages[i] : static_cast<int64_t>(i);
        const bool valid = id >= 0 && id < static_cast<int64_t>(num_pages);
        const uint8_t *data = base + (valid ? static_cast<uint64_t>(id) : 0) * page_stride;
        // Chunk c goes to slot c + (threads - full): the leading empty slots combine as zeros.
        if (t < full) {
            slot[t + (threads - full)] = valid ? ~kvg_crc32_update(table, 0xffffffffu, data + t * chunk, chunk) : 0u;
        }
        if (t < threads - full) slot[t] = 0;
        if (t == full) tail_crc = valid && tail ? ~kvg_crc32_update(table, 0xffffffffu, data + t * chunk, tail) : 0u;
        if (t == 0 && full == threads) tail_crc = 0;
        __syncthreads();
        for (uint32_t s = 1, k = 0; s < threads; s <<= 1, k++) {
            if ((t & (2 * s - 1)) == 0) {
                slot[t] = kvg_crc32_multmodp(kvg_crc32_x2n[(3 + log_e + k) & 31u], slot[t]) ^ slot[t + s];
            }
            __syncthreads();
        }
        if (t == 0) out[i] = valid ? kvg_crc32_shift(slot[0], tail) ^ tail_crc : 0u;
        __syncthreads();
    }
}

// ---------------------------------------------------------------------------------------------
// 5. Scrub on release: fill pages with a 32-bit pattern (0: zero; 0x7fa57fa5: NaN in f32, f16 and
// bf16) and clear their canaries, so nothing of the ended incarnation can be read or pass a check.
// ---------------------------------------------------------------------------------------------

// Page ids outside 0..num_pages are skipped. Launch: one block of 256 threads per page (any grid
// works). `canaries` may be null.
extern "C" __global__ void __launch_bounds__(256)
    kvg_scrub_pages(uint8_t *__restrict__ base, uint64_t page_stride, uint64_t page_bytes,
                    const int32_t *__restrict__ pages, uint32_t n_pages, uint32_t num_pages, uint32_t pattern,
                    uint32_t *__restrict__ canaries, uint32_t page_size) {
    for (uint32_t i = blockIdx.x; i < n_pages; i += gridDim.x) {
        const int64_t id = pages ? pages[i] : static_cast<int64_t>(i);
        if (id < 0 || id >= static_cast<int64_t>(num_pages)) continue;
        const uint64_t page = static_cast<uint64_t>(id);
        uint8_t *data = base + page * page_stride;
        const bool vector = (reinterpret_cast<uintptr_t>(data) & 15u) == 0 && page_bytes % 16 == 0;
        if (vector) {
            uint4 *w = reinterpret_cast<uint4 *>(data);
            const uint4 fill = make_uint4(pattern, pattern, pattern, pattern);
            for (uint64_t k = threadIdx.x; k < page_bytes / 16; k += blockDim.x) w[k] = fill;
        } else {
            for (uint64_t k = threadIdx.x; k < page_bytes; k += blockDim.x) {
                data[k] = static_cast<uint8_t>(pattern >> (8 * ((reinterpret_cast<uintptr_t>(data) + k) & 3u)));
            }
        }
        if (canaries != nullptr) {
            for (uint32_t k = threadIdx.x; k < page_size; k += blockDim.x) canaries[page * page_size + k] = 0;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// 6. Paged decode attention (vLLM layout, GQA, split over the KV length), with and without the
// fused check: the baseline engines actually run, and the check fused into it.
// ---------------------------------------------------------------------------------------------

#define KVG_ATTN_WARPS 4u
#define KVG_ATTN_THREADS (KVG_ATTN_WARPS * KVG_WARP)
#define KVG_ATTN_MAX_DIM 256u
#define KVG_ATTN_MAX_GROUP 4u // query heads per block (`AttentionShape::HEADS_PER_BLOCK`)
#define KVG_ATTN_MAX_VEC 8u   // 16-byte loads per lane per K row: at most 128 bytes
#define KVG_ATTN_MAX_DPL (KVG_ATTN_MAX_DIM / KVG_WARP)
#define KVG_ATTN_V_ROWS 8u   // V rows in flight per warp
#define KVG_ATTN_CHECK_BATCHES 2u // batches of 32 tags in flight per warp in the deferred check
#define KVG_ATTN_NEG (-3.402823466e38f)

KVG_FN float kvg_bits_to_float(uint32_t u) {
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

// Element `i` of a 16-byte vector of `T` (float: 4, bfloat16 bits: 8) as a float.
template <typename T> struct kvg_kv;
template <> struct kvg_kv<float> {
    static constexpr uint32_t per_vec = 4;
    KVG_FN static float get(const uint4 &v, uint32_t i) {
        const uint32_t w = i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
        return kvg_bits_to_float(w);
    }
    KVG_FN static float one(float x) { return x; }
};
template <> struct kvg_kv<uint16_t> {
    static constexpr uint32_t per_vec = 8;
    KVG_FN static float get(const uint4 &v, uint32_t i) {
        const uint32_t h = i >> 1;
        const uint32_t w = h == 0 ? v.x : h == 1 ? v.y : h == 2 ? v.z : v.w;
        return kvg_bits_to_float((i & 1u) ? (w & 0xffff0000u) : (w << 16));
    }
    KVG_FN static float one(uint16_t x) { return kvg_bits_to_float(static_cast<uint32_t>(x) << 16); }
};

// One block per (split, head block, sequence): a head block is up to 4 query heads of one KV
// head, so each K/V row is read once for all of them; a split is a contiguous share of the
// sequence's pages. The 4 warps take the split's pages in turn. Per page, a warp reads K with
// 16-byte loads, `L` lanes per token (each lane at most 128 bytes of the row), scores every
// head, keeps an online softmax per head, and reads V with one row per warp load (each lane
// `head_dim / 32` contiguous elements). The warps merge in shared memory; with several splits,
// each block leaves its partial (max, sum, output) in `workspace` and the last block of a
// (sequence, head block) to finish merges them and writes the output, then zeroes its counter.
//
// Caches are `[num_pages][page_size][num_kv_heads][head_dim]` of `T`; q and out
// `[num_seqs][num_heads][head_dim]` f32; `head_dim` a multiple of 32, at most 256. `workspace`
// (read only when `splits > 1`): `AttentionShape::workspace_len(splits)` words, zeroed.
//
// CHECK: pages out of range are never read, in either mode, and every page's tag is judged
// before the output is written. Tags only (CANARY false): the loop itself only tests the range,
// and after it each warp judges the tags of its pages 32 at a time, lane i taking the i-th (the
// first 32 loaded before the loop, so their latency hides behind it): measured on an H200, a
// check inside the loop cost 2 to 4 % of this latency-bound attention, the range test nothing.
// With canaries (CANARY true), each page's tag and slot canaries are judged before its K/V are
// read, the next page's loaded while this page's K/V are read. Violations are reported once per
// page (by the first head block) and flag the sequence. `fail_closed` 0 is report mode: the
// output is what the unchecked kernel computes. `fail_closed` 1 writes zeros for a sequence with
// any violation (or already flagged in `seq_status` by the standalone verify), so leaked KV never
// reaches sampling: a foreign page's K/V may reach this block's registers, never its output.
template <bool CHECK, bool CANARY, typename T>
KVG_FN void kvg_decode_attention(const float *__restrict__ q, const T *__restrict__ key_cache,
                                 const T *__restrict__ value_cache, const int32_t *__restrict__ block_table,
                                 uint32_t max_blocks, const int32_t *__restrict__ seq_lens, uint32_t num_seqs,
                                 uint32_t num_heads, uint32_t num_kv_heads, uint32_t head_dim, uint32_t page_size,
                                 float scale, float *__restrict__ out, float *workspace, uint32_t splits,
                                 const kvg_tag *__restrict__ tags, uint32_t num_pages,
                                 const kvg_reader *__restrict__ readers, const uint32_t *__restrict__ canaries,
                                 uint32_t *seq_status, kvg_ring *ring, uint32_t fail_closed) {
    __shared__ float q_s[KVG_ATTN_MAX_GROUP][KVG_ATTN_MAX_DIM];
    __shared__ float p_s[KVG_ATTN_WARPS][KVG_ATTN_MAX_GROUP][KVG_WARP];
    __shared__ float warp_m[KVG_ATTN_WARPS][KVG_ATTN_MAX_GROUP];
    __shared__ float warp_l[KVG_ATTN_WARPS][KVG_ATTN_MAX_GROUP];
    __shared__ float warp_acc[KVG_ATTN_WARPS][KVG_ATTN_MAX_GROUP][KVG_ATTN_MAX_DIM];
    __shared__ uint32_t block_bad, block_last;
    typedef kvg_kv<T> kv;
    const uint32_t lane = threadIdx.x % KVG_WARP, warp = threadIdx.x / KVG_WARP;
    const uint32_t group = num_heads / num_kv_heads;
    const uint32_t blocks_per_kv = (group + KVG_ATTN_MAX_GROUP - 1) / KVG_ATTN_MAX_GROUP;
    const uint32_t head_blocks = num_kv_heads * blocks_per_kv;
    // K: L lanes per token, nvec 16-byte loads each; V: dpl elements per lane.
    const uint32_t row_bytes = head_dim * static_cast<uint32_t>(sizeof(T));
    uint32_t lanes_per_token = 1;
    while (row_bytes / lanes_per_token > 16 * KVG_ATTN_MAX_VEC) lanes_per_token *= 2;
    const uint32_t nvec = row_bytes / lanes_per_token / 16;
    const uint32_t per_lane = nvec * kv::per_vec;
    const uint32_t tokens_per_pass = KVG_WARP / lanes_per_token;
    const uint32_t tl = lane / lanes_per_token, sub = lane % lanes_per_token;
    const uint32_t dpl = head_dim / KVG_WARP;
    const uint32_t counters = (num_seqs * head_blocks + 3u) & ~3u;
    for (uint32_t s = blockIdx.z; s < num_seqs; s += gridDim.z) {
        for (uint32_t hb = blockIdx.y; hb < head_blocks; hb += gridDim.y) {
            const uint32_t split = blockIdx.x;
            const uint32_t kvh = hb / blocks_per_kv;
            const uint32_t h0 = kvh * group + (hb % blocks_per_kv) * KVG_ATTN_MAX_GROUP;
            const uint32_t rest_heads = group - (hb % blocks_per_kv) * KVG_ATTN_MAX_GROUP;
            const uint32_t nh = rest_heads < KVG_ATTN_MAX_GROUP ? rest_heads : KVG_ATTN_MAX_GROUP;
            const int32_t len_signed = seq_lens[s];
            const uint32_t len = len_signed > 0 ? static_cast<uint32_t>(len_signed) : 0u;
            const uint32_t blocks = (len + page_size - 1) / page_size;
            const bool too_short = blocks > max_blocks;
            const uint32_t per_split = (blocks + splits - 1) / splits;
            const uint32_t j0 = too_short ? 0 : split * per_split;
            const uint32_t j_end = too_short ? 0 : (j0 + per_split < blocks ? j0 + per_split : blocks);
            kvg_reader reader = {0, 0};
            if (CHECK) reader = readers[s];
            if (threadIdx.x == 0) block_bad = 0;
            for (uint32_t i = threadIdx.x; i < nh * head_dim; i += blockDim.x) {
                const uint32_t g = i / head_dim, d = i % head_dim;
                q_s[g][d] = q[(static_cast<uint64_t>(s) * num_heads + h0 + g) * head_dim + d] * scale;
            }
            if (CHECK && too_short && split == 0 && hb == 0 && threadIdx.x == 0) {
                const kvg_tag none = {0, 0, 0, 0, 0, 0};
                const bool first = kvg_flag(seq_status, s, KVG_KIND_BLOCK_TABLE_TOO_SHORT);
                kvg_report_as(ring, first, KVG_KIND_BLOCK_TABLE_TOO_SHORT, KVG_OP_READ, s, max_blocks, -1, len,
                              max_blocks * page_size, 0, reader, none);
            }
            __syncthreads();
            float m[KVG_ATTN_MAX_GROUP], l[KVG_ATTN_MAX_GROUP], acc[KVG_ATTN_MAX_GROUP][KVG_ATTN_MAX_DPL];
#pragma unroll
            for (uint32_t g = 0; g < KVG_ATTN_MAX_GROUP; g++) {
                m[g] = KVG_ATTN_NEG;
                l[g] = 0.0f;
#pragma unroll
                for (uint32_t e = 0; e < KVG_ATTN_MAX_DPL; e++) acc[g][e] = 0.0f;
            }
            const int32_t *row = block_table + static_cast<uint64_t>(s) * max_blocks;
            // Prefetched for the next page: its id, and with canaries its tag and first canaries.
            uint32_t j = j0 + warp;
            int32_t next_page = j < j_end ? row[j] : -1;
            kvg_tag next_tag = {0, 0, 0, 0, 0, 0};
            uint32_t next_canary = 0;
            if (CHECK && CANARY && j < j_end) {
                next_tag = kvg_load_tag(tags, num_pages, next_page);
                if (kvg_page_in_range(next_page, num_pages) && lane < page_size)
                    next_canary = canaries[static_cast<uint64_t>(next_page) * page_size + lane];
            }
            // Tags only: the first 32 of this warp's pages (lane i the i-th), loaded now and
            // judged after the loop with the rest.
            int32_t first_page = -1;
            kvg_tag first_tag = {0, 0, 0, 0, 0, 0};
            if (CHECK && !CANARY) {
                const uint32_t jl = j + lane * KVG_ATTN_WARPS;
                first_page = jl < j_end ? row[jl] : -1;
                first_tag = kvg_load_tag(tags, num_pages, first_page);
            }
            for (; j < j_end; j += KVG_ATTN_WARPS) {
                const int32_t page = next_page;
                const kvg_tag found = next_tag;
                const uint32_t my_canary = next_canary;
                const uint32_t jn = j + KVG_ATTN_WARPS;
                next_page = jn < j_end ? row[jn] : -1;
                if (CHECK && CANARY && jn < j_end) {
                    next_tag = kvg_load_tag(tags, num_pages, next_page);
                    if (kvg_page_in_range(next_page, num_pages) && lane < page_size)
                        next_canary = canaries[static_cast<uint64_t>(next_page) * page_size + lane];
                }
                const uint32_t rest = len - j * page_size;
                const uint32_t need = rest < page_size ? rest : page_size;
                if (CHECK && CANARY) {
                    const bool in_range = kvg_page_in_range(page, num_pages);
                    uint32_t kind = kvg_check_tag(found, in_range, reader, 0, need);
                    uint32_t a = 0, b = 0;
                    if (kind == KVG_KIND_UNWRITTEN_SLOTS) {
                        a = found.written;
                        b = need;
                    } else if (kind == KVG_OK) {
                        const uint64_t ph = kvg_canary_page(found.owner, found.generation, static_cast<uint32_t>(page));
                        uint32_t first_bad = need;
                        for (uint32_t t = lane; t < need; t += KVG_WARP) {
                            const uint32_t c = t == lane ? my_canary
                                                         : canaries[static_cast<uint64_t>(page) * page_size + t];
                            if (c != kvg_canary_slot(ph, t) && t < first_bad) first_bad = t;
                        }
                        first_bad = kvg_warp_min(first_bad);
                        if (first_bad < need) {
                            kind = KVG_KIND_CANARY_MISMATCH;
                            a = first_bad;
                            b = first_bad + 1;
                        }
                    }
                    if (kind != KVG_OK) {
                        if (lane == 0) {
                            block_bad = 1;
                            const bool first = kvg_flag(seq_status, s, kind);
                            if (hb == 0 || first)
                                kvg_report_as(ring, first, kind, KVG_OP_READ, s, j, page, a, b, 0, reader, found);
                        }
                        if (!in_range || fail_closed) continue;
                    }
                } else if (CHECK) {
                    // Tags only: a page out of range is never read; the rest is judged after the loop.
                    if (!kvg_page_in_range(page, num_pages)) continue;
                } else if (page < 0) {
                    continue;
                }
                const uint64_t page_row = static_cast<uint64_t>(page) * page_size;
                for (uint32_t t0 = 0; t0 < need; t0 += tokens_per_pass) {
                    const uint32_t t = t0 + tl;
                    const bool valid = t < need;
                    // K: this lane's share of token t's row, 16 bytes per load.
                    uint4 k[KVG_ATTN_MAX_VEC];
                    const uint4 *krow = reinterpret_cast<const uint4 *>(
                        key_cache + ((page_row + (valid ? t : 0)) * num_kv_heads + kvh) * head_dim + sub * per_lane);
#pragma unroll
                    for (uint32_t v = 0; v < KVG_ATTN_MAX_VEC; v++) {
                        if (v < nvec && valid) k[v] = krow[v];
                        else k[v] = make_uint4(0, 0, 0, 0);
                    }
                    float sc[KVG_ATTN_MAX_GROUP];
#pragma unroll
                    for (uint32_t g = 0; g < KVG_ATTN_MAX_GROUP; g++) {
                        float dot = 0.0f;
                        if (g < nh) {
                            const float *qg = &q_s[g][sub * per_lane];
#pragma unroll
                            for (uint32_t v = 0; v < KVG_ATTN_MAX_VEC; v++) {
                                if (v < nvec) {
#pragma unroll
                                    for (uint32_t e = 0; e < kv::per_vec; e++)
                                        dot += qg[v * kv::per_vec + e] * kv::get(k[v], e);
                                }
                            }
                        }
                        for (uint32_t o = lanes_per_token / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
                        sc[g] = valid ? dot : KVG_ATTN_NEG;
                    }
                    // Online softmax per head over this pass's tokens: the warp's max, then p.
#pragma unroll
                    for (uint32_t g = 0; g < KVG_ATTN_MAX_GROUP; g++) {
                        if (g >= nh) continue;
                        float top = sc[g];
                        for (uint32_t o = KVG_WARP / 2; o >= lanes_per_token && o > 0; o >>= 1) {
                            const float other = __shfl_xor_sync(0xffffffffu, top, o);
                            top = other > top ? other : top;
                        }
                        const float m_new = top > m[g] ? top : m[g];
                        const float correction = expf(m[g] - m_new);
                        m[g] = m_new;
                        l[g] *= correction;
#pragma unroll
                        for (uint32_t e = 0; e < KVG_ATTN_MAX_DPL; e++) acc[g][e] *= correction;
                        if (sub == 0) p_s[warp][g][tl] = valid ? expf(sc[g] - m_new) : 0.0f;
                    }
                    __syncwarp();
                    // V: one row per warp load, each lane `dpl` contiguous elements. When a lane's share
                    // is 4, 8 or 16 bytes, KVG_ATTN_V_ROWS rows are loaded before any is used, so their
                    // loads overlap instead of each waiting for the one before.
                    const uint32_t pass = need - t0 < tokens_per_pass ? need - t0 : tokens_per_pass;
                    const uint32_t vbytes = dpl * static_cast<uint32_t>(sizeof(T));
                    if (vbytes == 16 || vbytes == 8 || vbytes == 4) {
                        for (uint32_t u0 = 0; u0 < pass; u0 += KVG_ATTN_V_ROWS) {
                            uint4 raw[KVG_ATTN_V_ROWS];
#pragma unroll
                            for (uint32_t i = 0; i < KVG_ATTN_V_ROWS; i++) {
                                raw[i] = make_uint4(0, 0, 0, 0);
                                if (u0 + i < pass) {
                                    const T *vrow =
                                        value_cache + ((page_row + t0 + u0 + i) * num_kv_heads + kvh) * head_dim + lane * dpl;
                                    if (vbytes == 16) {
                                        raw[i] = *reinterpret_cast<const uint4 *>(vrow);
                                    } else if (vbytes == 8) {
                                        const uint2 x2 = *reinterpret_cast<const uint2 *>(vrow);
                                        raw[i].x = x2.x;
                                        raw[i].y = x2.y;
                                    } else {
                                        raw[i].x = *reinterpret_cast<const uint32_t *>(vrow);
                                    }
                                }
                            }
#pragma unroll
                            for (uint32_t i = 0; i < KVG_ATTN_V_ROWS; i++) {
                                if (u0 + i >= pass) break;
                                float v[KVG_ATTN_MAX_DPL];
#pragma unroll
                                for (uint32_t e = 0; e < KVG_ATTN_MAX_DPL; e++)
                                    v[e] = e < kv::per_vec ? kv::get(raw[i], e < kv::per_vec ? e : 0) : 0.0f;
#pragma unroll
                                for (uint32_t g = 0; g < KVG_ATTN_MAX_GROUP; g++) {
                                    if (g >= nh) continue;
                                    const float p = p_s[warp][g][u0 + i];
                                    l[g] += p;
#pragma unroll
                                    for (uint32_t e = 0; e < KVG_ATTN_MAX_DPL; e++) {
                                        if (e < dpl) acc[g][e] += p * v[e];
                                    }
                                }
                            }
                        }
                        __syncwarp();
                        continue;
                    }
#pragma unroll 4
                    for (uint32_t u = 0; u < pass; u++) {
                        const T *vrow = value_cache + ((page_row + t0 + u) * num_kv_heads + kvh) * head_dim + lane * dpl;
                        float v[KVG_ATTN_MAX_DPL];
                        if (vbytes % 16 == 0) {
#pragma unroll
                            for (uint32_t w = 0; w < KVG_ATTN_MAX_DPL * sizeof(T) / 16; w++) {
                                if (w * 16 < vbytes) {
                                    const uint4 x = reinterpret_cast<const uint4 *>(vrow)[w];
#pragma unroll
                                    for (uint32_t e = 0; e < kv::per_vec; e++) {
                                        const uint32_t at = w * kv::per_vec + e;
                                        if (at < KVG_ATTN_MAX_DPL) v[at] = kv::get(x, e);
                                    }
                                }
                            }
                        } else if (vbytes % 8 == 0) {
#pragma unroll
                            for (uint32_t w = 0; w < KVG_ATTN_MAX_DPL * sizeof(T) / 8; w++) {
                                if (w * 8 < vbytes) {
                                    const uint2 x2 = reinterpret_cast<const uint2 *>(vrow)[w];
                                    const uint4 x = make_uint4(x2.x, x2.y, 0, 0);
#pragma unroll
                                    for (uint32_t e = 0; e < kv::per_vec / 2; e++) {
                                        const uint32_t at = w * (kv::per_vec / 2) + e;
                                        if (at < KVG_ATTN_MAX_DPL) v[at] = kv::get(x, e);
                                    }
                                }
                            }
                        } else {
#pragma unroll
                            for (uint32_t e = 0; e < KVG_ATTN_MAX_DPL; e++) {
                                if (e < dpl) v[e] = kv::one(vrow[e]);
                            }
                        }
#pragma unroll
                        for (uint32_t g = 0; g < KVG_ATTN_MAX_GROUP; g++) {
                            if (g >= nh) continue;
                            const float p = p_s[warp][g][u];
                            l[g] += p;
#pragma unroll
                            for (uint32_t e = 0; e < KVG_ATTN_MAX_DPL; e++) {
                                if (e < dpl) acc[g][e] += p * v[e];
                            }
                        }
                    }
                    __syncwarp();
                }
            }
            if (CHECK && !CANARY) {
                // Tags only: every page of this warp's share judged, 32 at a time (lane i the i-th),
                // KVG_ATTN_CHECK_BATCHES batches' loads in flight (ids, then tags); a bad page flags
                // the sequence and is reported.
                for (uint32_t jb = j0 + warp; jb < j_end; jb += KVG_ATTN_CHECK_BATCHES * KVG_WARP * KVG_ATTN_WARPS) {
                    const bool first = jb == j0 + warp; // its first 32 were loaded before the loop
                    int32_t p[KVG_ATTN_CHECK_BATCHES];
                    kvg_tag t[KVG_ATTN_CHECK_BATCHES];
#pragma unroll
                    for (uint32_t x = 0; x < KVG_ATTN_CHECK_BATCHES; x++) {
                        const uint32_t jl = jb + (x * KVG_WARP + lane) * KVG_ATTN_WARPS;
                        p[x] = first && x == 0 ? first_page : jl < j_end ? row[jl] : -1;
                    }
#pragma unroll
                    for (uint32_t x = 0; x < KVG_ATTN_CHECK_BATCHES; x++)
                        t[x] = first && x == 0 ? first_tag : kvg_load_tag(tags, num_pages, p[x]);
#pragma unroll
                    for (uint32_t x = 0; x < KVG_ATTN_CHECK_BATCHES; x++) {
                        const uint32_t jl = jb + (x * KVG_WARP + lane) * KVG_ATTN_WARPS;
                        if (jl >= j_end) continue;
                        const uint32_t rest = len - jl * page_size;
                        const uint32_t need = rest < page_size ? rest : page_size;
                        const uint32_t kind = kvg_check_tag(t[x], kvg_page_in_range(p[x], num_pages), reader, 0, need);
                        if (kind != KVG_OK) {
                            const bool unwritten = kind == KVG_KIND_UNWRITTEN_SLOTS;
                            block_bad = 1;
                            const bool first = kvg_flag(seq_status, s, kind);
                            if (hb == 0 || first)
                                kvg_report_as(ring, first, kind, KVG_OP_READ, s, jl, p[x],
                                              unwritten ? t[x].written : 0, unwritten ? need : 0, 0, reader, t[x]);
                        }
                    }
                }
            }
            // Merge the warps.
#pragma unroll
            for (uint32_t g = 0; g < KVG_ATTN_MAX_GROUP; g++) {
                if (g >= nh) continue;
                if (lane == 0) {
                    warp_m[warp][g] = m[g];
                    warp_l[warp][g] = l[g];
                }
#pragma unroll
                for (uint32_t e = 0; e < KVG_ATTN_MAX_DPL; e++) {
                    if (e < dpl) warp_acc[warp][g][lane * dpl + e] = acc[g][e];
                }
            }
            __syncthreads();
            float *parts = workspace + counters;
            const uint32_t stride = head_dim + 2;
            bool zero = too_short;
            if (CHECK && fail_closed)
                zero = zero || block_bad != 0 || reinterpret_cast<volatile uint32_t *>(seq_status)[s] != 0;
            for (uint32_t i = threadIdx.x; i < nh * head_dim; i += blockDim.x) {
                const uint32_t g = i / head_dim, d = i % head_dim;
                float big = KVG_ATTN_NEG;
                for (uint32_t w = 0; w < KVG_ATTN_WARPS; w++) big = warp_m[w][g] > big ? warp_m[w][g] : big;
                float total = 0.0f, o = 0.0f;
                for (uint32_t w = 0; w < KVG_ATTN_WARPS; w++) {
                    const float f = expf(warp_m[w][g] - big);
                    total += warp_l[w][g] * f;
                    o += warp_acc[w][g][d] * f;
                }
                const uint64_t head = static_cast<uint64_t>(s) * num_heads + h0 + g;
                if (splits == 1) {
                    out[head * head_dim + d] = !zero && total > 0.0f ? o / total : 0.0f;
                } else {
                    float *part = parts + (head * splits + split) * stride;
                    if (d == 0) {
                        part[0] = big;
                        part[1] = total;
                    }
                    part[2 + d] = o;
                }
            }
            if (splits > 1) {
                // The last block of (s, hb) to finish merges the splits' partials.
                __threadfence();
                __syncthreads();
                uint32_t *counter = reinterpret_cast<uint32_t *>(workspace) + s * head_blocks + hb;
                if (threadIdx.x == 0) block_last = atomicAdd(counter, 1u) == splits - 1 ? 1u : 0u;
                __syncthreads();
                if (block_last) {
                    __threadfence();
                    if (CHECK && fail_closed) zero = zero || reinterpret_cast<volatile uint32_t *>(seq_status)[s] != 0;
                    const volatile float *vparts = parts;
                    for (uint32_t i = threadIdx.x; i < nh * head_dim; i += blockDim.x) {
                        const uint32_t g = i / head_dim, d = i % head_dim;
                        const uint64_t head = static_cast<uint64_t>(s) * num_heads + h0 + g;
                        const volatile float *first = vparts + head * splits * stride;
                        float big = KVG_ATTN_NEG;
                        for (uint32_t x = 0; x < splits; x++) big = first[x * stride] > big ? first[x * stride] : big;
                        float total = 0.0f, o = 0.0f;
                        for (uint32_t x = 0; x < splits; x++) {
                            const float f = expf(first[x * stride] - big);
                            total += first[x * stride + 1] * f;
                            o += first[x * stride + 2 + d] * f;
                        }
                        out[head * head_dim + d] = !zero && total > 0.0f ? o / total : 0.0f;
                    }
                    if (threadIdx.x == 0) *counter = 0;
                }
            }
            __syncthreads();
        }
    }
}

#define KVG_ATTN_ARGS(T)                                                                                               \
    const float *__restrict__ q, const T *__restrict__ key_cache, const T *__restrict__ value_cache,                 \
        const int32_t *__restrict__ block_table, uint32_t max_blocks, const int32_t *__restrict__ seq_lens,          \
        uint32_t num_seqs, uint32_t num_heads, uint32_t num_kv_heads, uint32_t head_dim, uint32_t page_size,         \
        float scale, float *__restrict__ out, float *workspace, uint32_t splits
#define KVG_ATTN_PASS                                                                                                  \
    q, key_cache, value_cache, block_table, max_blocks, seq_lens, num_seqs, num_heads, num_kv_heads, head_dim,       \
        page_size, scale, out, workspace, splits
#define KVG_ATTN_CHECK_ARGS                                                                                            \
    const kvg_tag *__restrict__ tags, uint32_t num_pages, const kvg_reader *__restrict__ readers,                    \
        const uint32_t *__restrict__ canaries, uint32_t *seq_status, kvg_ring *ring, uint32_t fail_closed
#define KVG_ATTN_CHECK_PASS tags, num_pages, readers, canaries, seq_status, ring, fail_closed

// Launch (all six): grid (splits, head blocks, num_seqs), 128 threads; see kvg_decode_attention.
// `_checked` checks tags (its `canaries` argument is not read), `_checked_canary` tags and canaries.
extern "C" __global__ void __launch_bounds__(KVG_ATTN_THREADS, 3) kvg_decode_attention_unchecked(KVG_ATTN_ARGS(float)) {
    kvg_decode_attention<false, false, float>(KVG_ATTN_PASS, nullptr, 0, nullptr, nullptr, nullptr, nullptr, 0);
}

extern "C" __global__ void __launch_bounds__(KVG_ATTN_THREADS, 3)
    kvg_decode_attention_checked(KVG_ATTN_ARGS(float), KVG_ATTN_CHECK_ARGS) {
    kvg_decode_attention<true, false, float>(KVG_ATTN_PASS, KVG_ATTN_CHECK_PASS);
}

extern "C" __global__ void __launch_bounds__(KVG_ATTN_THREADS, 3)
    kvg_decode_attention_checked_canary(KVG_ATTN_ARGS(float), KVG_ATTN_CHECK_ARGS) {
    kvg_decode_attention<true, true, float>(KVG_ATTN_PASS, KVG_ATTN_CHECK_PASS);
}

// bfloat16 K/V caches (the bits, as uint16_t).
extern "C" __global__ void __launch_bounds__(KVG_ATTN_THREADS, 3)
    kvg_decode_attention_unchecked_bf16(KVG_ATTN_ARGS(uint16_t)) {
    kvg_decode_attention<false, false, uint16_t>(KVG_ATTN_PASS, nullptr, 0, nullptr, nullptr, nullptr, nullptr, 0);
}

extern "C" __global__ void __launch_bounds__(KVG_ATTN_THREADS, 3)
    kvg_decode_attention_checked_bf16(KVG_ATTN_ARGS(uint16_t), KVG_ATTN_CHECK_ARGS) {
    kvg_decode_attention<true, false, uint16_t>(KVG_ATTN_PASS, KVG_ATTN_CHECK_PASS);
}

extern "C" __global__ void __launch_bounds__(KVG_ATTN_THREADS, 3)
    kvg_decode_attention_checked_canary_bf16(KVG_ATTN_ARGS(uint16_t), KVG_ATTN_CHECK_ARGS) {
    kvg_decode_attention<true, true, uint16_t>(KVG_ATTN_PASS, KVG_ATTN_CHECK_PASS);
}
