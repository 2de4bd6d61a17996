// kvguard_sim.h — runs kvguard's CUDA kernels as host C++ on a simulated grid, for the CPU tests.
//
// Each launch starts one OS thread per thread of a block and runs the blocks one after another
// with those threads. `__syncthreads` is a barrier over the block's live threads and warp
// shuffles exchange through a per-warp buffer between two barriers, so kernels that use shared
// memory, barriers and full-warp shuffles behave as on a GPU. A thread that returns leaves the
// barriers, as an exited GPU thread does. `__shared__` variables become function statics, which
// is exactly their scope here since blocks never run concurrently. Block sizes must be multiples
// of 32. Slow by design: for correctness tests on small grids only.
#ifndef KVGUARD_SIM_H
#define KVGUARD_SIM_H

#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

struct dim3 {
    uint32_t x = 1, y = 1, z = 1;
};
struct uint4 {
    uint32_t x, y, z, w;
};
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return uint4{x, y, z, w}; }
struct uint2 {
    uint32_t x, y;
};

inline thread_local dim3 threadIdx;
inline thread_local dim3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

namespace kvg_sim {

// A reusable barrier whose live count shrinks when threads leave (exit the kernel).
class Barrier {
  public:
    void reset(uint32_t n) {
        std::lock_guard<std::mutex> l(m_);
        expected_ = n;
        arrived_ = 0;
    }
    void wait() {
        std::unique_lock<std::mutex> l(m_);
        uint64_t phase = phase_;
        if (++arrived_ >= expected_) {
            open(l);
        } else {
            cv_.wait(l, [&] { return phase_ != phase; });
        }
    }
    void leave() {
        std::unique_lock<std::mutex> l(m_);
        expected_--;
        if (arrived_ > 0 && arrived_ >= expected_) open(l);
    }

  private:
    void open(std::unique_lock<std::mutex> &) {
        arrived_ = 0;
        phase_++;
        cv_.notify_all();
    }
    std::mutex m_;
    std::condition_variable cv_;
    uint32_t expected_ = 0, arrived_ = 0;
    uint64_t phase_ = 0;
};

struct Block {
    Barrier block;
    std::vector<std::unique_ptr<Barrier>> warps;
    std::vector<uint64_t> exchange;
};

inline Block *current = nullptr;
inline thread_local uint32_t linear_tid = 0;

// Runs `kernel()` over `grid` x `block`.
template <class F> void launch(dim3 grid, dim3 block, F kernel) {
    const uint32_t n = block.x * block.y * block.z;
    if (n == 0 || n % 32 != 0) {
        std::fprintf(stderr, "kvguard_sim: block size %u is not a positive multiple of 32\n", n);
        std::abort();
    }
    gridDim = grid;
    blockDim = block;
    Block ctx;
    ctx.exchange.assign(n, 0);
    for (uint32_t w = 0; w < n / 32; w++) ctx.warps.push_back(std::make_unique<Barrier>());
    current = &ctx;
    Barrier end;
    end.reset(n);
    auto reset = [&] {
        ctx.block.reset(n);
        for (auto &w : ctx.warps) w->reset(32);
    };
    reset();
    std::vector<std::thread> threads;
    for (uint32_t t = 0; t < n; t++) {
        threads.emplace_back([&, t] {
            linear_tid = t;
            threadIdx = dim3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
            for (uint32_t z = 0; z < grid.z; z++)
                for (uint32_t y = 0; y < grid.y; y++)
                    for (uint32_t x = 0; x < grid.x; x++) {
                        blockIdx = dim3{x, y, z};
                        kernel();
                        ctx.block.leave();
                        ctx.warps[t / 32]->leave();
                        end.wait();
                        if (t == 0) reset();
                        end.wait();
                    }
        });
    }
    for (auto &th : threads) th.join();
    current = nullptr;
}

template <class T> T shuffle(T v, uint32_t src_lane) {
    static_assert(sizeof(T) <= 8, "shuffle of at most 64 bits");
    const uint32_t t = linear_tid, base = t & ~31u;
    uint64_t bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    current->exchange[t] = bits;
    current->warps[t / 32]->wait();
    uint64_t got = current->exchange[base + (src_lane & 31u)];
    current->warps[t / 32]->wait();
    T out;
    std::memcpy(&out, &got, sizeof(T));
    return out;
}

} // namespace kvg_sim

inline void __syncthreads() { kvg_sim::current->block.wait(); }
inline void __syncwarp(uint32_t = 0xffffffffu) { kvg_sim::current->warps[kvg_sim::linear_tid / 32]->wait(); }
template <class T> T __shfl_xor_sync(uint32_t, T v, uint32_t mask) {
    return kvg_sim::shuffle(v, (kvg_sim::linear_tid & 31u) ^ mask);
}
template <class T> T __shfl_sync(uint32_t, T v, uint32_t lane) { return kvg_sim::shuffle(v, lane); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline unsigned long long atomicAdd(unsigned long long *p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
inline uint32_t atomicAdd(uint32_t *p, uint32_t v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline uint32_t atomicOr(uint32_t *p, uint32_t v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }
inline unsigned long long atomicCAS(unsigned long long *p, unsigned long long expected, unsigned long long desired) {
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}

#endif // KVGUARD_SIM_H
