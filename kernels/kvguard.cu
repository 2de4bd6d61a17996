// kvguard.cu — kvguard's kernels: tag updates, block-table verification (vLLM and FlashInfer
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
        kvg_flag(seq_status, s, kind);
        kvg_report(ring, kind, KVG_OP_READ, s, j, page, a, b, expected_generation, reader, found);
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
    kvg_flag(seq_status, s, kind);
    kvg_report(ring, kind, KVG_OP_READ, s, j, -1, found_amount, limit, 0, reader, none);
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

// Writes token `t`'s K and V (`kv_width` = kv_heads * head_dim elements each) into slot
// `slot_mapping[t]` of a cache laid out `[num_pages][page_size][kv_width]`, if the writing
// sequence owns that page; otherwise nothing is written and the store is reported. Slot -1 is
// padding. Launch: one block of 128 threads per token (any grid works).
template <typename T>
KVG_FN void kvg_store_kv(const T *__restrict__ key, const T *__restrict__ value, T *__restrict__ key_cache,
                         T *__restrict__ value_cache, const int64_t *__restrict__ slot_mapping, uint32_t num_tokens,
                         uint32_t kv_width, uint32_t page_size, const int32_t *__restrict__ query_start_loc,
                         uint32_t num_seqs, const kvg_reader *__restrict__ writers, const kvg_tag *__restrict__ tags,
                         uint32_t num_pages, uint32_t *__restrict__ canaries, uint32_t *seq_status, kvg_ring *ring) {
    for (uint32_t t = blockIdx.x; t < num_tokens; t += gridDim.x) {
        const int64_t slot = slot_mapping[t];
        if (slot < 0) continue;
        const uint32_t s = kvg_seq_of_token(query_start_loc, num_seqs, t);
        const kvg_reader writer = writers[s];
        // 32-bit division when the slot fits (always below 2^32 slots: the fast path).
        const bool small = slot <= 0xffffffffll;
        const int64_t page = small ? static_cast<uint32_t>(slot) / page_size : slot / page_size;
        const uint32_t in_page = static_cast<uint32_t>(slot - page * page_size);
        kvg_tag found;
        const uint32_t kind = kvg_check_store(tags, num_pages, page, writer, &found);
        if (kind != KVG_OK) {
            if (threadIdx.x == 0) {
                kvg_flag(seq_status, s, kind);
                int32_t p = page > 0x7fffffffll ? 0x7fffffff : static_cast<int32_t>(page);
                kvg_report(ring, kind, KVG_OP_WRITE, t, 0, p, in_page, in_page + 1, 0, writer, found);
            }
            continue;
        }
        const uint64_t dst = static_cast<uint64_t>(slot) * kv_width;
        const uint64_t src = static_cast<uint64_t>(t) * kv_width;
        for (uint32_t i = threadIdx.x; i < kv_width; i += blockDim.x) {
            key_cache[dst + i] = key[src + i];
            value_cache[dst + i] = value[src + i];
        }
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
// 6. Reference paged decode attention (f32, vLLM layout, GQA), with and without the fused check.
// ---------------------------------------------------------------------------------------------

#define KVG_ATTN_WARPS 4u
#define KVG_ATTN_MAX_DIM 256u
#define KVG_ATTN_PER_LANE (KVG_ATTN_MAX_DIM / KVG_WARP)

// One block (4 warps) per (head, sequence); warp w reads pages w, w+4, ... with an online
// softmax, and the warps are merged at the end. `head_dim` is a multiple of 32, at most 256.
// Caches are `[num_pages][page_size][num_kv_heads][head_dim]`; q and out `[num_seqs][num_heads][head_dim]`.
//
// CHECK: every page is checked before it is read (tag, then the canaries of the slots read).
// Violations are reported once per page (from head 0) and flag the sequence. `fail_closed` 0 is
// report mode: the output is what the unchecked kernel computes. `fail_closed` 1 writes zeros for
// a sequence with any violation (or already flagged in `seq_status` by the standalone verify), so
// leaked KV never reaches sampling. Pages out of range are never read in either mode.
template <bool CHECK>
KVG_FN void kvg_decode_attention(const float *__restrict__ q, const float *__restrict__ key_cache,
                                 const float *__restrict__ value_cache, const int32_t *__restrict__ block_table,
                                 uint32_t max_blocks, const int32_t *__restrict__ seq_lens, uint32_t num_seqs,
                                 uint32_t num_heads, uint32_t num_kv_heads, uint32_t head_dim, uint32_t page_size,
                                 float scale, float *__restrict__ out, const kvg_tag *__restrict__ tags,
                                 uint32_t num_pages, const kvg_reader *__restrict__ readers,
                                 const uint32_t *__restrict__ canaries, uint32_t *seq_status, kvg_ring *ring,
                                 uint32_t fail_closed) {
    __shared__ float warp_m[KVG_ATTN_WARPS];
    __shared__ float warp_l[KVG_ATTN_WARPS];
    __shared__ float warp_acc[KVG_ATTN_WARPS][KVG_ATTN_MAX_DIM];
    __shared__ uint32_t warp_bad[KVG_ATTN_WARPS];
    const uint32_t lane = threadIdx.x % KVG_WARP, warp = threadIdx.x / KVG_WARP;
    const uint32_t per_lane = head_dim / KVG_WARP;
    for (uint32_t s = blockIdx.y; s < num_seqs; s += gridDim.y) {
        for (uint32_t h = blockIdx.x; h < num_heads; h += gridDim.x) {
            const uint32_t kvh = h / (num_heads / num_kv_heads);
            const int32_t len_signed = seq_lens[s];
            const uint32_t len = len_signed > 0 ? static_cast<uint32_t>(len_signed) : 0u;
            const uint32_t blocks = (len + page_size - 1) / page_size;
            float qv[KVG_ATTN_PER_LANE], acc[KVG_ATTN_PER_LANE];
#pragma unroll
            for (uint32_t e = 0; e < KVG_ATTN_PER_LANE; e++) {
                qv[e] = e < per_lane ? q[(static_cast<uint64_t>(s) * num_heads + h) * head_dim + e * KVG_WARP + lane]
                                     : 0.0f;
                acc[e] = 0.0f;
            }
            float m = -3.402823466e38f, l = 0.0f;
            uint32_t bad = 0;
            kvg_reader reader = {0, 0};
            if (CHECK) reader = readers[s];
            const bool reporter = CHECK && h == 0 && lane == 0;
            if (reporter && warp == 0 && blocks > max_blocks) {
                const kvg_tag none = {0, 0, 0, 0, 0, 0};
                kvg_flag(seq_status, s, KVG_KIND_BLOCK_TABLE_TOO_SHORT);
                kvg_report(ring, KVG_KIND_BLOCK_TABLE_TOO_SHORT, KVG_OP_READ, s, max_blocks, -1, len,
                           max_blocks * page_size, 0, reader, none);
            }
            for (uint32_t j = warp; j < blocks && (blocks <= max_blocks); j += KVG_ATTN_WARPS) {
                const int32_t page = block_table[static_cast<uint64_t>(s) * max_blocks + j];
                const uint32_t rest = len - j * page_size;
                const uint32_t need = rest < page_size ? rest : page_size;
                if (CHECK) {
                    kvg_tag found;
                    uint32_t kind = kvg_check_page(tags, num_pages, page, reader, 0, need, &found);
                    uint32_t a = 0, b = 0;
                    if (kind == KVG_KIND_UNWRITTEN_SLOTS) {
                        a = found.written;
                        b = need;
                    } else if (kind == KVG_OK && canaries != nullptr) {
                        const uint64_t ph = kvg_canary_page(found.owner, found.generation, static_cast<uint32_t>(page));
                        uint32_t first_bad = need;
                        for (uint32_t t = lane; t < need; t += KVG_WARP) {
                            if (!kvg_canary_ok(canaries, page_size, static_cast<uint32_t>(page), t, ph) && t < first_bad)
                                first_bad = t;
                        }
                        first_bad = kvg_warp_min(first_bad);
                        if (first_bad < need) {
                            kind = KVG_KIND_CANARY_MISMATCH;
                            a = first_bad;
                            b = first_bad + 1;
                        }
                    }
                    if (kind != KVG_OK) {
                        bad = 1;
                        if (reporter) {
                            kvg_flag(seq_status, s, kind);
                            kvg_report(ring, kind, KVG_OP_READ, s, j, page, a, b, 0, reader, found);
                        }
                        if (kind == KVG_KIND_PAGE_OUT_OF_RANGE || fail_closed) continue;
                    }
                } else if (page < 0) {
                    continue;
                }
                for (uint32_t t = 0; t < need; t++) {
                    const uint64_t row = ((static_cast<uint64_t>(page) * page_size + t) * num_kv_heads + kvh) * head_dim;
                    float dot = 0.0f;
#pragma unroll
                    for (uint32_t e = 0; e < KVG_ATTN_PER_LANE; e++) {
                        if (e < per_lane) dot += qv[e] * key_cache[row + e * KVG_WARP + lane];
                    }
                    const float score = kvg_warp_sum(dot) * scale;
                    const float m_new = score > m ? score : m;
                    const float correction = expf(m - m_new);
                    const float p = expf(score - m_new);
                    l = l * correction + p;
#pragma unroll
                    for (uint32_t e = 0; e < KVG_ATTN_PER_LANE; e++) {
                        if (e < per_lane) acc[e] = acc[e] * correction + p * value_cache[row + e * KVG_WARP + lane];
                    }
                    m = m_new;
                }
            }
            if (lane == 0) {
                warp_m[warp] = m;
                warp_l[warp] = l;
                warp_bad[warp] = bad;
            }
#pragma unroll
            for (uint32_t e = 0; e < KVG_ATTN_PER_LANE; e++) {
                if (e < per_lane) warp_acc[warp][e * KVG_WARP + lane] = acc[e];
            }
            __syncthreads();
            bool zero = blocks > max_blocks;
            if (CHECK && fail_closed) {
                for (uint32_t w = 0; w < KVG_ATTN_WARPS; w++) zero = zero || warp_bad[w] != 0;
                zero = zero || (seq_status != nullptr && seq_status[s] != 0);
            }
            float big = -3.402823466e38f;
            for (uint32_t w = 0; w < KVG_ATTN_WARPS; w++) big = warp_m[w] > big ? warp_m[w] : big;
            float total = 0.0f;
            for (uint32_t w = 0; w < KVG_ATTN_WARPS; w++) total += warp_l[w] * expf(warp_m[w] - big);
            for (uint32_t d = threadIdx.x; d < head_dim; d += blockDim.x) {
                float o = 0.0f;
                if (!zero && total > 0.0f) {
                    for (uint32_t w = 0; w < KVG_ATTN_WARPS; w++) o += warp_acc[w][d] * expf(warp_m[w] - big);
                    o /= total;
                }
                out[(static_cast<uint64_t>(s) * num_heads + h) * head_dim + d] = o;
            }
            __syncthreads();
        }
    }
}

#define KVG_ATTN_ARGS                                                                                                  \
    const float *__restrict__ q, const float *__restrict__ key_cache, const float *__restrict__ value_cache,         \
        const int32_t *__restrict__ block_table, uint32_t max_blocks, const int32_t *__restrict__ seq_lens,          \
        uint32_t num_seqs, uint32_t num_heads, uint32_t num_kv_heads, uint32_t head_dim, uint32_t page_size,         \
        float scale, float *__restrict__ out
#define KVG_ATTN_PASS                                                                                                  \
    q, key_cache, value_cache, block_table, max_blocks, seq_lens, num_seqs, num_heads, num_kv_heads, head_dim,       \
        page_size, scale, out

// Unchecked reference. Launch: grid (num_heads, num_seqs), 128 threads.
extern "C" __global__ void __launch_bounds__(128) kvg_decode_attention_unchecked(KVG_ATTN_ARGS) {
    kvg_decode_attention<false>(KVG_ATTN_PASS, nullptr, 0, nullptr, nullptr, nullptr, nullptr, 0);
}

// With the fused per-page check. Launch: grid (num_heads, num_seqs), 128 threads.
extern "C" __global__ void __launch_bounds__(128)
    kvg_decode_attention_checked(KVG_ATTN_ARGS, const kvg_tag *__restrict__ tags, uint32_t num_pages,
                                 const kvg_reader *__restrict__ readers, const uint32_t *__restrict__ canaries,
                                 uint32_t *seq_status, kvg_ring *ring, uint32_t fail_closed) {
    kvg_decode_attention<true>(KVG_ATTN_PASS, tags, num_pages, readers, canaries, seq_status, ring, fail_closed);
}
