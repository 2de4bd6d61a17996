// kvguard.cuh — the device API of kvguard: page tags, per-slot canaries, CRC32 and the violation
// ring, for engine authors who fuse ownership checks into their own attention and KV-store kernels.
//
// Vocabulary (see DESIGN.md): a *page* is one block of the KV pool (`page_size` token slots); its
// *tag* says who owns it (request, tenant), which *incarnation* it is in (generation) and how many
// leading slots that incarnation wrote. The host ownership table is the source of truth; the
// device tag table is its mirror, updated incrementally by `kvg_apply_tag_updates` (kvguard.cu).
//
// Fusing the check into an attention kernel (one call per page read, uniform across a warp):
//
//     #include "kvguard.cuh"
//     kvg_tag found;
//     uint32_t kind = kvg_check_page(tags, num_pages, page, reader, /*expected_generation=*/0,
//                                    /*need=*/slots_read, &found);
//     if (kind != KVG_OK) { kvg_report(ring, kind, KVG_OP_READ, seq, block, page, ...); skip; }
//
// and, per slot read, `kvg_canary_ok(canaries, page_size, page, slot, found)`: the canary the
// KV-store path stamped must bind the page's current owner and generation, so KV that this
// incarnation never wrote is refused even when the tag says the page is the reader's own.
//
// Everything here is header-only, allocation-free and never synchronises with the host, so it
// fits inside CUDA graphs. The same code compiles as host C++ (kernels/host/kvguard_sim.h) for the
// CPU tests; nothing here depends on a CUDA header or the C++ standard library under NVRTC.
#ifndef KVGUARD_CUH
#define KVGUARD_CUH

#if defined(__CUDACC_RTC__)
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef int int32_t;
typedef unsigned long long uint64_t;
typedef long long int64_t;
typedef unsigned long long uintptr_t;
#else
#include <stdint.h>
#endif

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define KVG_FN __device__ __forceinline__
#define KVG_HD __host__ __device__ __forceinline__
// A cold path (reporting a violation), kept out of line so it costs the checks no registers.
#define KVG_COLD static __device__ __noinline__
#else
#define KVG_FN inline
#define KVG_HD inline
#define KVG_COLD static inline
#endif

// ---------------------------------------------------------------------------------------------
// Layout shared with Rust (`kvguard::cuda::layout`). Any change here must change there too; the
// test `cuda_host_sim::layouts_match_rust` compares sizeof/offsetof of every field.
// ---------------------------------------------------------------------------------------------

// Page states: the discriminants of the Rust `PageState`. Zeroed tag memory reads as a free page
// of generation 0, which no live reference ever names.
#define KVG_STATE_FREE 0u
#define KVG_STATE_OWNED 1u
#define KVG_STATE_SHARED 2u
#define KVG_STATE_RESERVED 3u
#define KVG_STATE_RETIRED 4u
#define KVG_STATE_AWAITING_SCRUB 5u

// Violation kinds found on the device (bit `kind` of a sequence's status word). The Rust side maps
// them onto `ViolationKind` (`DeviceKind::violation_kind`).
#define KVG_OK 0u
#define KVG_KIND_PAGE_OUT_OF_RANGE 1u   // page id < 0 or >= num_pages
#define KVG_KIND_RESERVED_PAGE 2u       // the null/padding page
#define KVG_KIND_FREED_PAGE 3u          // free, awaiting scrub or retired
#define KVG_KIND_FOREIGN_PAGE 4u        // another request's page (or another tenant's unshared prefix)
#define KVG_KIND_STALE_PAGE 5u          // generation differs from the one the engine recorded
#define KVG_KIND_UNWRITTEN_SLOTS 6u     // the tag's written prefix does not cover the read
#define KVG_KIND_BLOCK_TABLE_TOO_SHORT 7u // more tokens than the block table has pages for
#define KVG_KIND_CANARY_MISMATCH 8u     // a slot's canary was not stamped by this incarnation
#define KVG_KIND_WRITE_TO_SHARED 9u     // a KV store into a read-only prefix page
#define KVG_KIND_BAD_LAYOUT 10u         // a malformed step: last_page_len or indptr out of range

// Tag flags (`kvg_tag.flags`); the other bits are reserved, 0.
// A shared page that a request of another tenant reads under a cross-tenant grant: the device
// cannot see a prefix's holders, so any tenant may read it here (the host check is the exact one).
#define KVG_FLAG_SHARED_ACROSS_TENANTS 1u

#define KVG_OP_READ 1u
#define KVG_OP_WRITE 2u

// A page's tag: 32 bytes, 16-byte aligned (two 128-bit loads).
struct __attribute__((aligned(16))) kvg_tag {
    uint64_t owner;      // Owned: the owning request. Shared: the publisher. Otherwise 0.
    uint64_t tenant;     // The owner's tenant (Owned, Shared). Otherwise 0.
    uint32_t generation; // The page's incarnation; 0 never names a live one.
    uint32_t written;    // Slots 0..written are written by the current incarnation.
    uint32_t state;      // KVG_STATE_*.
    uint32_t flags;      // KVG_FLAG_* bits; the others are 0.
};

// Who reads (or writes) through one sequence of a step.
struct __attribute__((aligned(16))) kvg_reader {
    uint64_t request;
    uint64_t tenant;
};

// One violation found on the device: 96 bytes. `sequence_no` is written last (after a fence), so
// a drained record whose `sequence_no` is not its ring position + 1 is incomplete or overwritten.
struct __attribute__((aligned(16))) kvg_violation {
    uint32_t kind;                // KVG_KIND_*
    uint32_t op;                  // KVG_OP_*
    uint32_t seq;                 // sequence index in the step (token index for stores)
    uint32_t block;               // index of the page in the sequence's block table
    int32_t page;                 // the page id as the block table gave it
    uint32_t slot_start;          // first slot concerned (unwritten, canary, store)
    uint32_t slot_end;            // one past the last slot concerned
    uint32_t expected_generation; // the generation the engine recorded; 0 if none was given
    uint64_t request;             // the reader (or writer)
    uint64_t tenant;              // its tenant
    kvg_tag found;                // the page's tag as the device saw it (zero if out of range)
    uint64_t sequence_no;         // ring position + 1, written last
    uint64_t reserved;
};

// The violation ring: a 32-byte header followed by `capacity` records, in one allocation. The
// device appends; the host drains asynchronously (copy, then advance `consumed`). Records that
// would overwrite undrained ones are dropped and counted, never written.
//
// The single-stream rule: every kernel that reports, and the host's copy of the ring, are ordered
// on one stream (or joined by events). A record still being written when the ring is copied is
// counted incomplete and its slot handed back; a writer that finishes it late could then race
// the writer of the same slot one lap later and tear both. Ordered, no writer is in flight when
// the ring is copied, and the race cannot happen.
struct __attribute__((aligned(16))) kvg_ring {
    uint64_t head;     // records ever reserved (atomic)
    uint64_t dropped;  // records lost because the ring was full (atomic)
    uint64_t consumed; // records the host has drained (written by the host)
    uint32_t capacity; // records that fit after the header
    uint32_t lost;     // of those dropped, a sequence's first finding (atomic): see kvg_report_as
};

KVG_HD kvg_violation *kvg_ring_records(kvg_ring *ring) {
    return reinterpret_cast<kvg_violation *>(ring + 1);
}

// ---------------------------------------------------------------------------------------------
// Reporting
// ---------------------------------------------------------------------------------------------

// Appends one violation to the ring (lock-free; any thread). A null ring only drops it.
//
// `first`: the violation is its sequence's first finding of the step (`kvg_flag` returned true),
// the one record the host needs to refuse that request. Other records (a sequence's further
// bad pages, a token of no sequence) only describe, and take a record only while the ring is
// under half full, so the other half stays for first findings: a step of one request whose
// every page is bad cannot crowd out another request's finding. A first finding dropped all the
// same (more flagged sequences between two drains than half the ring holds) is counted in
// `lost`: the host then cannot tell which request it was, and fails closed.
KVG_COLD void kvg_report_as(kvg_ring *ring, bool first, uint32_t kind, uint32_t op, uint32_t seq, uint32_t block,
                          int32_t page, uint32_t slot_start, uint32_t slot_end, uint32_t expected_generation,
                          kvg_reader who, const kvg_tag &found) {
    if (ring == nullptr) return;
    unsigned long long *head = reinterpret_cast<unsigned long long *>(&ring->head);
    const uint64_t consumed = *reinterpret_cast<volatile uint64_t *>(&ring->consumed);
    uint64_t pos;
    if (first) {
        pos = atomicAdd(head, 1ull);
        if (pos - consumed >= ring->capacity) {
            atomicAdd(reinterpret_cast<unsigned long long *>(&ring->dropped), 1ull);
            atomicAdd(&ring->lost, 1u);
            return;
        }
    } else {
        // Reserve a position only below half the ring (a compare-and-swap: no position is
        // reserved and then left unwritten, which the host would read as a torn record).
        pos = *reinterpret_cast<volatile uint64_t *>(&ring->head);
        for (;;) {
            if (pos - consumed >= ring->capacity / 2) {
                atomicAdd(reinterpret_cast<unsigned long long *>(&ring->dropped), 1ull);
                return;
            }
            const uint64_t seen = atomicCAS(head, pos, pos + 1);
            if (seen == pos) break;
            pos = seen;
        }
    }
    kvg_violation *v = kvg_ring_records(ring) + (pos % ring->capacity);
    v->kind = kind;
    v->op = op;
    v->seq = seq;
    v->block = block;
    v->page = page;
    v->slot_start = slot_start;
    v->slot_end = slot_end;
    v->expected_generation = expected_generation;
    v->request = who.request;
    v->tenant = who.tenant;
    v->found = found;
    v->reserved = 0;
    __threadfence();
    *reinterpret_cast<volatile uint64_t *>(&v->sequence_no) = pos + 1;
}

// Appends a violation as a first finding (`kvg_report_as`): for an engine's own kernels, which
// report a sequence once.
KVG_FN void kvg_report(kvg_ring *ring, uint32_t kind, uint32_t op, uint32_t seq, uint32_t block, int32_t page,
                       uint32_t slot_start, uint32_t slot_end, uint32_t expected_generation, kvg_reader who,
                       const kvg_tag &found) {
    kvg_report_as(ring, true, kind, op, seq, block, page, slot_start, slot_end, expected_generation, who, found);
}

// Marks a sequence as refused for `kind` (bit `kind` of its status word). True if this is the
// sequence's first finding since its status word was cleared (`clear_status`, once a step), or
// when no status words are kept: the finding to report as first (`kvg_report_as`).
KVG_FN bool kvg_flag(uint32_t *seq_status, uint32_t seq, uint32_t kind) {
    if (seq_status == nullptr) return true;
    return atomicOr(seq_status + seq, 1u << kind) == 0u;
}

// ---------------------------------------------------------------------------------------------
// Checking a page
// ---------------------------------------------------------------------------------------------

// Checks that `reader` may read slots 0..need of `page`: the first rule broken, in the host
// table's order (range, reserved, freed, foreign, stale, unwritten), or KVG_OK. `*found` receives
// the tag (zeroed when the page is out of range). `expected_generation` 0 skips the stale check.
//
// Shared pages: the device knows a prefix's tenant but not who holds it, so any request of the
// same tenant may read it here, and any request at all once a request of another tenant holds it
// (KVG_FLAG_SHARED_ACROSS_TENANTS). The host table's check (holders only) is the exact one; the
// device never refuses a read the host allows.
//
// `kvg_check_tag` is the same rule on a tag already loaded (zeroed when out of range), so that a
// kernel can load the next page's tag while it reads this page's K/V (`kvg_load_tag`): the
// fused check then costs no dependent load in the attention's loop.
KVG_FN bool kvg_page_in_range(int32_t page, uint32_t num_pages) {
    return page >= 0 && static_cast<uint32_t>(page) < num_pages;
}

// The tag of `page`, or a zeroed tag when it is out of range (never read).
KVG_FN kvg_tag kvg_load_tag(const kvg_tag *__restrict__ tags, uint32_t num_pages, int32_t page) {
    if (!kvg_page_in_range(page, num_pages)) return kvg_tag{0, 0, 0, 0, 0, 0};
    return tags[page];
}

KVG_FN uint32_t kvg_check_tag(const kvg_tag &t, bool in_range, kvg_reader reader, uint32_t expected_generation,
                              uint32_t need) {
    if (!in_range) return KVG_KIND_PAGE_OUT_OF_RANGE;
    switch (t.state) {
    case KVG_STATE_OWNED:
        if (t.owner != reader.request) return KVG_KIND_FOREIGN_PAGE;
        break;
    case KVG_STATE_SHARED:
        if (t.tenant != reader.tenant && (t.flags & KVG_FLAG_SHARED_ACROSS_TENANTS) == 0) return KVG_KIND_FOREIGN_PAGE;
        break;
    case KVG_STATE_RESERVED:
        return KVG_KIND_RESERVED_PAGE;
    default:
        return KVG_KIND_FREED_PAGE;
    }
    if (expected_generation != 0 && expected_generation != t.generation) return KVG_KIND_STALE_PAGE;
    if (t.written < need) return KVG_KIND_UNWRITTEN_SLOTS;
    return KVG_OK;
}

KVG_FN uint32_t kvg_check_page(const kvg_tag *__restrict__ tags, uint32_t num_pages, int32_t page,
                               kvg_reader reader, uint32_t expected_generation, uint32_t need, kvg_tag *found) {
    if (!kvg_page_in_range(page, num_pages)) {
        *found = kvg_tag{0, 0, 0, 0, 0, 0};
        return KVG_KIND_PAGE_OUT_OF_RANGE;
    }
    const kvg_tag t = tags[page];
    *found = t;
    return kvg_check_tag(t, true, reader, expected_generation, need);
}

// Checks that `writer` may store into `page`: it must own it exclusively.
KVG_FN uint32_t kvg_check_store(const kvg_tag *__restrict__ tags, uint32_t num_pages, int64_t page,
                                kvg_reader writer, kvg_tag *found) {
    if (page < 0 || static_cast<uint64_t>(page) >= num_pages) {
        *found = kvg_tag{0, 0, 0, 0, 0, 0};
        return KVG_KIND_PAGE_OUT_OF_RANGE;
    }
    const kvg_tag t = tags[page];
    *found = t;
    switch (t.state) {
    case KVG_STATE_OWNED:
        return t.owner == writer.request ? KVG_OK : KVG_KIND_FOREIGN_PAGE;
    case KVG_STATE_SHARED:
        return KVG_KIND_WRITE_TO_SHARED;
    case KVG_STATE_RESERVED:
        return KVG_KIND_RESERVED_PAGE;
    default:
        return KVG_KIND_FREED_PAGE;
    }
}

// ---------------------------------------------------------------------------------------------
// Canaries: 32 bits per slot, binding (owner, generation, page, slot). Never 0, so zeroed or
// scrubbed canary memory never passes. Bit-exact with `kvguard::cuda::layout::canary`.
// ---------------------------------------------------------------------------------------------

KVG_HD uint64_t kvg_mix64(uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdull;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ull;
    h ^= h >> 33;
    return h;
}

// The per-page part of a canary: hash once per page, then `kvg_canary_slot` per slot.
KVG_HD uint64_t kvg_canary_page(uint64_t owner, uint32_t generation, uint32_t page) {
    uint64_t h = kvg_mix64(owner ^ 0x9e3779b97f4a7c15ull);
    return kvg_mix64(h ^ ((static_cast<uint64_t>(generation) << 32) | page));
}

KVG_HD uint32_t kvg_canary_slot(uint64_t page_hash, uint32_t slot) {
    uint32_t c = static_cast<uint32_t>(kvg_mix64(page_hash ^ (0x632be59bd9b4e019ull * (slot + 1ull))) >> 32);
    return c != 0 ? c : 1u;
}

KVG_HD uint32_t kvg_canary(uint64_t owner, uint32_t generation, uint32_t page, uint32_t slot) {
    return kvg_canary_slot(kvg_canary_page(owner, generation, page), slot);
}

// Stamps the canary of `slot` of `page` for `writer` in incarnation `generation` (the KV-store path).
// Stamp only after the slot's K and V are written and visible: every thread that wrote them runs
// `__threadfence()`, then the block `__syncthreads()`, then one thread stamps (as
// `kvg_store_kv` does). A reader on another stream that sees the canary then sees the KV it
// vouches for; stamped first, a canary could pass over KV of the previous incarnation.
KVG_FN void kvg_stamp_canary(uint32_t *canaries, uint32_t page_size, uint32_t page, uint32_t slot, uint64_t writer,
                             uint32_t generation) {
    canaries[static_cast<uint64_t>(page) * page_size + slot] = kvg_canary(writer, generation, page, slot);
}

// Whether `slot` of `page` was stamped by the incarnation described by `tag` (its owner, for
// shared pages the publisher, and its generation).
KVG_FN bool kvg_canary_ok(const uint32_t *__restrict__ canaries, uint32_t page_size, uint32_t page, uint32_t slot,
                          uint64_t page_hash) {
    return canaries[static_cast<uint64_t>(page) * page_size + slot] == kvg_canary_slot(page_hash, slot);
}

// ---------------------------------------------------------------------------------------------
// CRC32 (IEEE, reflected, poly 0xEDB88320, init and xorout 0xFFFFFFFF): bit-exact with crc32fast
// and zlib. Chunks are hashed independently and combined in GF(2) (zlib's crc32_combine).
// ---------------------------------------------------------------------------------------------

#define KVG_CRC32_POLY 0xedb88320u
#define KVG_CRC32_TABLE_WORDS 1024 // slice-by-4: 4 tables of 256 words (4 KiB of shared memory)

// x^(2^k) mod P for k = 0..31, so x^n mod P is a product over the bits of n. `static`: each
// translation unit that includes this header gets its own copy (internal linkage), so engines
// that build several .cu files with relocatable device code (-rdc) link without duplicate
// symbols; the 128 bytes of constant memory per unit are the price.
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
static __constant__
#else
static const
#endif
    uint32_t kvg_crc32_x2n[32] = {
        0x40000000u, 0x20000000u, 0x08000000u, 0x00800000u, 0x00008000u, 0xedb88320u, 0xb1e6b092u, 0xa06a2517u,
        0xed627daeu, 0x88d14467u, 0xd7bbfe6au, 0xec447f11u, 0x8e7ea170u, 0x6427800eu, 0x4d47bae0u, 0x09fe548fu,
        0x83852d0fu, 0x30362f1au, 0x7b5a9cc3u, 0x31fec169u, 0x9fec022au, 0x6c8dedc4u, 0x15d6874du, 0x5fde7a4eu,
        0xbad90e37u, 0x2e4e5eefu, 0x4eaba214u, 0xa8a472c0u, 0x429a969eu, 0x148d302au, 0xc40ba6d0u, 0xc4e22c3cu,
};

// Entry `i` of the slice-by-4 table (`i` in 0..1024); fill shared memory with it, then sync.
KVG_FN uint32_t kvg_crc32_table_entry(uint32_t i) {
    uint32_t c = i & 0xffu;
    for (int k = 0; k < 8; k++) c = (c & 1u) ? (c >> 1) ^ KVG_CRC32_POLY : c >> 1;
    for (uint32_t s = 0; s < (i >> 8); s++) {
        // table[s+1][b] = (table[s][b] >> 8) ^ table[0][table[s][b] & 0xff]
        uint32_t low = c & 0xffu;
        for (int k = 0; k < 8; k++) low = (low & 1u) ? (low >> 1) ^ KVG_CRC32_POLY : low >> 1;
        c = (c >> 8) ^ low;
    }
    return c;
}

KVG_FN uint32_t kvg_crc32_word(const uint32_t *__restrict__ table, uint32_t crc) {
    return table[768 + (crc & 0xffu)] ^ table[512 + ((crc >> 8) & 0xffu)] ^ table[256 + ((crc >> 16) & 0xffu)] ^
           table[crc >> 24];
}

// Continues a raw CRC register `crc` (pre-inverted) over `n` bytes at `p`, with the table:
// bytes up to 16-byte alignment, then 16 bytes per load, then the tail.
KVG_FN uint32_t kvg_crc32_update(const uint32_t *__restrict__ table, uint32_t crc, const uint8_t *__restrict__ p,
                                 uint64_t n) {
    while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 15u) != 0) {
        crc = table[(crc ^ *p++) & 0xffu] ^ (crc >> 8);
        n--;
    }
    const uint4 *v = reinterpret_cast<const uint4 *>(p);
    for (; n >= 16; n -= 16) {
        const uint4 x = *v++;
        crc = kvg_crc32_word(table, crc ^ x.x);
        crc = kvg_crc32_word(table, crc ^ x.y);
        crc = kvg_crc32_word(table, crc ^ x.z);
        crc = kvg_crc32_word(table, crc ^ x.w);
    }
    p = reinterpret_cast<const uint8_t *>(v);
    while (n-- > 0) crc = table[(crc ^ *p++) & 0xffu] ^ (crc >> 8);
    return crc;
}

// a(x) * b(x) mod P, both reflected (zlib's multmodp).
KVG_HD uint32_t kvg_crc32_multmodp(uint32_t a, uint32_t b) {
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = (b & 1u) ? (b >> 1) ^ KVG_CRC32_POLY : b >> 1;
    }
    return p;
}

// `crc` shifted past `nbytes` zero-free bytes: crc * x^(8 nbytes) mod P.
KVG_FN uint32_t kvg_crc32_shift(uint32_t crc, uint64_t nbytes) {
    uint32_t p = 1u << 31; // x^0
    uint32_t k = 3;        // x^(8 n) = x^(n << 3)
    while (nbytes != 0) {
        if (nbytes & 1u) p = kvg_crc32_multmodp(kvg_crc32_x2n[k & 31u], p);
        nbytes >>= 1;
        k++;
    }
    return kvg_crc32_multmodp(p, crc);
}

// CRC32 of A||B from crc(A), crc(B) and len(B) (zlib's crc32_combine).
KVG_FN uint32_t kvg_crc32_combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
    return kvg_crc32_shift(crc_a, len_b) ^ crc_b;
}

#endif // KVGUARD_CUH
