// kvguard_sim_main.cpp — the CPU test driver: runs one kvguard kernel over the simulated grid.
//
// Usage: kvguard_sim layout
//        kvguard_sim <command> <dir>
// Inputs are little-endian arrays in <dir>/<name>.bin and integer parameters in <dir>/params.txt
// ("name value" per line); outputs are written to <dir>/<name>.out. The Rust tests
// (tests/cuda_host_*.rs, through tests/common/host_sim.rs) write the inputs, run this, and compare.
#include "kvguard_sim.h"

#include "../kvguard.cu"

#include <cstddef>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>
#include <string>

namespace {

std::string dir;
std::map<std::string, double> params;

[[noreturn]] void fail(const std::string &why) {
    std::cerr << "kvguard_sim: " << why << "\n";
    std::exit(2);
}

template <class T> std::vector<T> load(const std::string &name, bool required = true) {
    std::ifstream f(dir + "/" + name + ".bin", std::ios::binary);
    if (!f) {
        if (required) fail("missing input " + name);
        return {};
    }
    std::string bytes((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (bytes.size() % sizeof(T) != 0) fail("input " + name + " is not a whole number of elements");
    std::vector<T> v(bytes.size() / sizeof(T));
    if (!v.empty()) std::memcpy(v.data(), bytes.data(), bytes.size());
    return v;
}

void store_bytes(const std::string &name, const void *data, size_t n) {
    std::ofstream f(dir + "/" + name + ".out", std::ios::binary);
    f.write(static_cast<const char *>(data), static_cast<std::streamsize>(n));
    if (!f) fail("cannot write " + name);
}

template <class T> void store(const std::string &name, const std::vector<T> &v) {
    store_bytes(name, v.data(), v.size() * sizeof(T));
}

uint64_t param(const std::string &name) {
    auto it = params.find(name);
    if (it == params.end()) fail("missing parameter " + name);
    return static_cast<uint64_t>(it->second);
}

uint64_t param_or(const std::string &name, uint64_t otherwise) {
    auto it = params.find(name);
    return it == params.end() ? otherwise : static_cast<uint64_t>(it->second);
}

double param_f(const std::string &name) {
    auto it = params.find(name);
    if (it == params.end()) fail("missing parameter " + name);
    return it->second;
}

template <class T> T *or_null(std::vector<T> &v) { return v.empty() ? nullptr : v.data(); }

// A ring of `capacity` records in 16-byte-aligned storage.
struct Ring {
    std::vector<uint4> storage;
    explicit Ring(uint32_t capacity) {
        size_t bytes = sizeof(kvg_ring) + capacity * sizeof(kvg_violation);
        storage.assign(bytes / sizeof(uint4), uint4{0, 0, 0, 0});
        get()->capacity = capacity;
    }
    kvg_ring *get() { return reinterpret_cast<kvg_ring *>(storage.data()); }
    void save() { store_bytes("ring", storage.data(), storage.size() * sizeof(uint4)); }
};

void layout() {
#define FIELD(T, f) std::cout << #T "." #f " " << offsetof(T, f) << "\n"
    std::cout << "kvg_tag.size " << sizeof(kvg_tag) << "\nkvg_tag.align " << alignof(kvg_tag) << "\n";
    FIELD(kvg_tag, owner);
    FIELD(kvg_tag, tenant);
    FIELD(kvg_tag, generation);
    FIELD(kvg_tag, written);
    FIELD(kvg_tag, state);
    FIELD(kvg_tag, flags);
    std::cout << "kvg_reader.size " << sizeof(kvg_reader) << "\nkvg_reader.align " << alignof(kvg_reader) << "\n";
    FIELD(kvg_reader, request);
    FIELD(kvg_reader, tenant);
    std::cout << "kvg_violation.size " << sizeof(kvg_violation) << "\nkvg_violation.align " << alignof(kvg_violation)
              << "\n";
    FIELD(kvg_violation, kind);
    FIELD(kvg_violation, op);
    FIELD(kvg_violation, seq);
    FIELD(kvg_violation, block);
    FIELD(kvg_violation, page);
    FIELD(kvg_violation, slot_start);
    FIELD(kvg_violation, slot_end);
    FIELD(kvg_violation, expected_generation);
    FIELD(kvg_violation, request);
    FIELD(kvg_violation, tenant);
    FIELD(kvg_violation, found);
    FIELD(kvg_violation, sequence_no);
    FIELD(kvg_violation, reserved);
    std::cout << "kvg_ring.size " << sizeof(kvg_ring) << "\nkvg_ring.align " << alignof(kvg_ring) << "\n";
    FIELD(kvg_ring, head);
    FIELD(kvg_ring, dropped);
    FIELD(kvg_ring, consumed);
    FIELD(kvg_ring, capacity);
    FIELD(kvg_ring, lost);
#undef FIELD
    std::cout << "KVG_FLAG_SHARED_ACROSS_TENANTS " << KVG_FLAG_SHARED_ACROSS_TENANTS << "\n";
}

struct CanaryInput {
    uint64_t owner;
    uint32_t generation, page, slot, pad;
};

void canary() {
    auto in = load<CanaryInput>("canary");
    std::vector<uint32_t> out;
    for (auto &c : in) out.push_back(kvg_canary(c.owner, c.generation, c.page, c.slot));
    store("canary", out);
}

void crc32() {
    auto data = load<uint8_t>("data");
    auto lengths = load<uint64_t>("lengths");
    auto pages = load<int32_t>("pages", false);
    const uint64_t stride = param("stride");
    const uint32_t n_pages = static_cast<uint32_t>(param("n_pages"));
    const uint32_t chunk = static_cast<uint32_t>(param("chunk"));
    const uint32_t threads = static_cast<uint32_t>(param("threads"));
    const uint32_t num_pages = static_cast<uint32_t>(param("num_pages"));
    std::vector<uint32_t> out;
    for (uint64_t len : lengths) {
        std::vector<uint32_t> crc(n_pages, 0xdeadbeefu);
        const uint8_t *base = data.data();
        const int32_t *pg = or_null(pages);
        uint32_t *o = crc.data();
        kvg_sim::launch(dim3{2, 1, 1}, dim3{threads, 1, 1},
                        [=] { kvg_crc32_pages(base, stride, len, pg, n_pages, num_pages, chunk, o); });
        out.insert(out.end(), crc.begin(), crc.end());
    }
    store("crc", out);
}

void tags() {
    auto tags = load<kvg_tag>("tags");
    auto pages = load<uint32_t>("pages");
    auto updates = load<kvg_tag>("updates");
    kvg_tag *t = tags.data();
    const uint32_t n = static_cast<uint32_t>(pages.size()), num_pages = static_cast<uint32_t>(tags.size());
    const uint32_t *p = pages.data();
    const kvg_tag *u = updates.data();
    kvg_sim::launch(dim3{2, 1, 1}, dim3{64, 1, 1}, [=] { kvg_apply_tag_updates(t, num_pages, p, u, n); });
    store("tags", tags);
}

void verify(bool flashinfer) {
    auto tags = load<kvg_tag>("tags");
    auto readers = load<kvg_reader>("readers");
    auto gens = load<uint32_t>("generations", false);
    auto canaries = load<uint32_t>("canaries", false);
    auto query_lens = load<int32_t>("query_lens", false);
    const uint32_t num_seqs = static_cast<uint32_t>(readers.size());
    const uint32_t num_pages = static_cast<uint32_t>(tags.size());
    const uint32_t page_size = static_cast<uint32_t>(param("page_size"));
    std::vector<uint32_t> status(num_seqs, 0);
    Ring ring(static_cast<uint32_t>(param("ring_capacity")));
    const kvg_tag *t = tags.data();
    const kvg_reader *r = readers.data();
    const uint32_t *g = or_null(gens), *c = or_null(canaries);
    const int32_t *ql = or_null(query_lens);
    uint32_t *st = status.data();
    kvg_ring *rg = ring.get();
    const dim3 grid{static_cast<uint32_t>(param("grid_x")), static_cast<uint32_t>(param("grid_y")), 1};
    if (flashinfer) {
        auto indptr = load<int32_t>("kv_indptr");
        auto indices = load<int32_t>("kv_indices");
        auto last = load<int32_t>("kv_last_page_len");
        const int32_t *ip = indptr.data(), *ix = or_null(indices), *lp = last.data();
        const uint32_t ni = static_cast<uint32_t>(indices.size());
        kvg_sim::launch(grid, dim3{32, 1, 1}, [=] {
            kvg_verify_paged_kv(t, num_pages, page_size, ip, ix, lp, num_seqs, ni, g, c, ql, r, st, rg);
        });
    } else if (params.count("row_stride")) {
        auto table = load<int32_t>("req_to_token");
        auto rows = load<int64_t>("rows");
        auto lens = load<int64_t>("seq_lens");
        const uint32_t row_stride = static_cast<uint32_t>(param("row_stride"));
        const uint32_t num_rows = static_cast<uint32_t>(param("num_rows"));
        if (static_cast<uint64_t>(num_rows) * row_stride > table.size()) fail("req_to_token is smaller than its rows");
        if (rows.size() < num_seqs || lens.size() < num_seqs) fail("rows or seq_lens shorter than the readers");
        const int32_t *rt = or_null(table);
        const int64_t *rw = rows.data(), *sl = lens.data();
        kvg_sim::launch(grid, dim3{32, 1, 1}, [=] {
            kvg_verify_token_rows(t, num_pages, page_size, rt, num_rows, row_stride, rw, sl, num_seqs, r, st, rg);
        });
    } else {
        auto table = load<int32_t>("block_table");
        auto lens = load<int32_t>("seq_lens");
        const uint32_t max_blocks = static_cast<uint32_t>(param("max_blocks"));
        const int32_t *bt = table.data(), *sl = lens.data();
        kvg_sim::launch(grid, dim3{32, 1, 1}, [=] {
            kvg_verify_block_table(t, num_pages, page_size, bt, num_seqs, max_blocks, sl, g, c, ql, r, st, rg);
        });
    }
    store("status", status);
    ring.save();
}

void store_kv() {
    auto key = load<uint32_t>("key");
    auto value = load<uint32_t>("value");
    auto key_cache = load<uint32_t>("key_cache");
    auto value_cache = load<uint32_t>("value_cache");
    auto slots = load<int64_t>("slot_mapping");
    auto qsl = load<int32_t>("query_start_loc");
    auto writers = load<kvg_reader>("writers");
    auto tags = load<kvg_tag>("tags");
    auto canaries = load<uint32_t>("canaries");
    const uint32_t kv_width = static_cast<uint32_t>(param("kv_width"));
    const uint32_t page_size = static_cast<uint32_t>(param("page_size"));
    const uint32_t num_seqs = static_cast<uint32_t>(writers.size());
    const uint32_t num_tokens = static_cast<uint32_t>(slots.size());
    const uint32_t num_pages = static_cast<uint32_t>(tags.size());
    std::vector<uint32_t> status(num_seqs, 0);
    Ring ring(static_cast<uint32_t>(param("ring_capacity")));
    const uint32_t *k = key.data(), *v = value.data();
    uint32_t *kc = key_cache.data(), *vc = value_cache.data(), *cn = canaries.data(), *st = status.data();
    const int64_t *sm = slots.data();
    const int32_t *q = qsl.data();
    const kvg_reader *w = writers.data();
    const kvg_tag *t = tags.data();
    kvg_ring *rg = ring.get();
    kvg_sim::launch(dim3{3, 1, 1}, dim3{32, 1, 1}, [=] {
        kvg_store_kv_b32(k, v, kc, vc, sm, num_tokens, kv_width, page_size, q, num_seqs, w, t, num_pages, cn, st, rg);
    });
    store("key_cache", key_cache);
    store("value_cache", value_cache);
    store("canaries", canaries);
    store("status", status);
    ring.save();
}

void scrub() {
    auto data = load<uint8_t>("data");
    auto pages = load<int32_t>("pages");
    auto canaries = load<uint32_t>("canaries");
    const uint64_t offset = param("offset"), stride = param("stride"), bytes = param("page_bytes");
    const uint32_t pattern = static_cast<uint32_t>(param("pattern"));
    const uint32_t page_size = static_cast<uint32_t>(param("page_size"));
    const uint32_t num_pages = static_cast<uint32_t>(param("num_pages"));
    uint8_t *base = data.data() + offset;
    const int32_t *p = pages.data();
    const uint32_t n = static_cast<uint32_t>(pages.size());
    uint32_t *c = canaries.data();
    kvg_sim::launch(dim3{2, 1, 1}, dim3{64, 1, 1},
                    [=] { kvg_scrub_pages(base, stride, bytes, p, n, num_pages, pattern, c, page_size); });
    store("data", data);
    store("canaries", canaries);
}

void attention() {
    auto q = load<float>("q");
    auto bt = load<int32_t>("block_table");
    auto lens = load<int32_t>("seq_lens");
    const uint32_t num_seqs = static_cast<uint32_t>(lens.size());
    const uint32_t max_blocks = static_cast<uint32_t>(param("max_blocks"));
    const uint32_t num_heads = static_cast<uint32_t>(param("num_heads"));
    const uint32_t num_kv_heads = static_cast<uint32_t>(param("num_kv_heads"));
    const uint32_t head_dim = static_cast<uint32_t>(param("head_dim"));
    const uint32_t page_size = static_cast<uint32_t>(param("page_size"));
    const uint32_t splits = static_cast<uint32_t>(param_or("splits", 1));
    const bool bf16 = param_or("bf16", 0) != 0;
    const float scale = static_cast<float>(param_f("scale"));
    const bool checked = param("checked") != 0;
    // The workspace as `AttentionShape::workspace_len(splits)` words, zeroed; the kernel leaves
    // its counters zeroed again, which the test checks.
    const uint32_t group = num_heads / num_kv_heads;
    const uint32_t head_blocks = num_kv_heads * ((group + KVG_ATTN_MAX_GROUP - 1) / KVG_ATTN_MAX_GROUP);
    const uint64_t counters = (static_cast<uint64_t>(num_seqs) * head_blocks + 3) & ~3ull;
    std::vector<float> workspace(counters + static_cast<uint64_t>(num_seqs) * num_heads * splits * (head_dim + 2), 0.0f);
    std::vector<float> out(static_cast<size_t>(num_seqs) * num_heads * head_dim, -1.0f);
    const float *qp = q.data();
    const int32_t *btp = bt.data(), *lp = lens.data();
    float *op = out.data(), *ws = workspace.data();
    const dim3 grid{splits, head_blocks, num_seqs}, block{KVG_ATTN_THREADS, 1, 1};
    std::vector<kvg_tag> tags;
    std::vector<kvg_reader> readers;
    std::vector<uint32_t> canaries, status;
    if (checked) {
        tags = load<kvg_tag>("tags");
        readers = load<kvg_reader>("readers");
        canaries = load<uint32_t>("canaries", false);
        status = load<uint32_t>("status", false);
    }
    if (status.empty()) status.assign(num_seqs, 0);
    Ring ring(static_cast<uint32_t>(param("ring_capacity")));
    const uint32_t fail_closed = static_cast<uint32_t>(param_or("fail_closed", 0));
    const uint32_t num_pages = static_cast<uint32_t>(tags.size());
    const kvg_tag *t = tags.data();
    const kvg_reader *r = readers.data();
    const uint32_t *c = or_null(canaries);
    uint32_t *st = status.data();
    kvg_ring *rg = ring.get();
    if (bf16) {
        auto kc = load<uint16_t>("key_cache");
        auto vc = load<uint16_t>("value_cache");
        const uint16_t *kp = kc.data(), *vp = vc.data();
        kvg_sim::launch(grid, block, [=] {
            if (checked && c != nullptr)
                kvg_decode_attention_checked_canary_bf16(qp, kp, vp, btp, max_blocks, lp, num_seqs, num_heads,
                                                         num_kv_heads, head_dim, page_size, scale, op, ws, splits, t,
                                                         num_pages, r, c, st, rg, fail_closed);
            else if (checked)
                kvg_decode_attention_checked_bf16(qp, kp, vp, btp, max_blocks, lp, num_seqs, num_heads, num_kv_heads,
                                                  head_dim, page_size, scale, op, ws, splits, t, num_pages, r, c, st,
                                                  rg, fail_closed);
            else
                kvg_decode_attention_unchecked_bf16(qp, kp, vp, btp, max_blocks, lp, num_seqs, num_heads, num_kv_heads,
                                                    head_dim, page_size, scale, op, ws, splits);
        });
    } else {
        auto kc = load<float>("key_cache");
        auto vc = load<float>("value_cache");
        const float *kp = kc.data(), *vp = vc.data();
        kvg_sim::launch(grid, block, [=] {
            if (checked && c != nullptr)
                kvg_decode_attention_checked_canary(qp, kp, vp, btp, max_blocks, lp, num_seqs, num_heads, num_kv_heads,
                                                    head_dim, page_size, scale, op, ws, splits, t, num_pages, r, c, st,
                                                    rg, fail_closed);
            else if (checked)
                kvg_decode_attention_checked(qp, kp, vp, btp, max_blocks, lp, num_seqs, num_heads, num_kv_heads,
                                             head_dim, page_size, scale, op, ws, splits, t, num_pages, r, c, st, rg,
                                             fail_closed);
            else
                kvg_decode_attention_unchecked(qp, kp, vp, btp, max_blocks, lp, num_seqs, num_heads, num_kv_heads,
                                               head_dim, page_size, scale, op, ws, splits);
        });
    }
    std::vector<uint32_t> counter_words(counters);
    std::memcpy(counter_words.data(), workspace.data(), counters * 4);
    store("out", out);
    store("counters", counter_words);
    store("status", status);
    ring.save();
}

// The step's writes checked in place, then the flagged sequences fenced (both on the same
// status words, as one stream runs them): `slot_mapping`, `query_start_loc`, `writers`, `tags`,
// optional `block_table` (`max_blocks` a row), optional `status` (words set before the check, as
// an earlier verify of the same step leaves them). Outputs: the fenced `block_table` and
// `slot_mapping`, `status`, the ring.
void slots_and_fence() {
    auto slots = load<int64_t>("slot_mapping");
    auto qsl = load<int32_t>("query_start_loc");
    auto writers = load<kvg_reader>("writers");
    auto tags = load<kvg_tag>("tags");
    auto table = load<int32_t>("block_table", false);
    auto before = load<uint32_t>("status", false);
    const uint32_t page_size = static_cast<uint32_t>(param("page_size"));
    const uint32_t num_seqs = static_cast<uint32_t>(writers.size());
    const uint32_t num_tokens = static_cast<uint32_t>(slots.size());
    const uint32_t num_pages = static_cast<uint32_t>(tags.size());
    const uint32_t max_blocks = table.empty() ? 0u : static_cast<uint32_t>(param("max_blocks"));
    if (qsl.size() < num_seqs + 1) fail("query_start_loc shorter than the writers + 1");
    if (static_cast<uint64_t>(num_seqs) * max_blocks > table.size()) fail("block_table smaller than its rows");
    std::vector<uint32_t> status(num_seqs, 0);
    for (size_t i = 0; i < before.size() && i < status.size(); i++) status[i] = before[i];
    Ring ring(static_cast<uint32_t>(param("ring_capacity")));
    int64_t *sm = slots.data();
    const int32_t *q = qsl.data();
    const kvg_reader *w = writers.data();
    const kvg_tag *t = tags.data();
    int32_t *bt = or_null(table);
    uint32_t *st = status.data();
    kvg_ring *rg = ring.get();
    const dim3 grid{static_cast<uint32_t>(param("grid_x")), static_cast<uint32_t>(param("grid_y")), 1};
    kvg_sim::launch(dim3{grid.x, 1, 1}, dim3{32, 1, 1},
                    [=] { kvg_verify_slot_mapping(t, num_pages, page_size, sm, num_tokens, q, num_seqs, w, st, rg); });
    store("checked_status", status);
    kvg_sim::launch(grid, dim3{32, 1, 1},
                    [=] { kvg_fence_refused(st, num_seqs, q, bt, max_blocks, sm, num_tokens); });
    store("slot_mapping", slots);
    store("block_table", table);
    store("status", status);
    ring.save();
}

} // namespace

int main(int argc, char **argv) {
    if (argc == 2 && std::string(argv[1]) == "layout") {
        layout();
        return 0;
    }
    if (argc != 3) fail("usage: kvguard_sim layout | kvguard_sim <command> <dir>");
    dir = argv[2];
    std::ifstream pf(dir + "/params.txt");
    std::string name;
    double value;
    while (pf >> name >> value) params[name] = value;
    const std::string cmd = argv[1];
    if (cmd == "canary") canary();
    else if (cmd == "crc32") crc32();
    else if (cmd == "tags") tags();
    else if (cmd == "verify_block_table") verify(false);
    else if (cmd == "verify_paged_kv") verify(true);
    else if (cmd == "verify_token_rows") verify(false);
    else if (cmd == "store") store_kv();
    else if (cmd == "slots_and_fence") slots_and_fence();
    else if (cmd == "scrub") scrub();
    else if (cmd == "attention") attention();
    else fail("unknown command " + cmd);
    return 0;
}
