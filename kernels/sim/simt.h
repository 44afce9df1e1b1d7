// simt.h: runs CUDA kernels on the host, one fiber per CUDA thread, so that their indexing, their
// barriers and their warp shuffles can be checked without a GPU (kernels/sim/README.md).
//
// A launch runs its blocks one after another. Inside a block every thread is a ucontext fiber on
// one OS thread, run until it reaches __syncthreads (waits for every live thread of the block), a
// warp shuffle (waits for every live lane of its warp, twice: once to publish, once so no lane
// overwrites a value another has not read yet), or its end. A warp whose lanes wait at different
// kinds of barrier, or a block whose threads can never all arrive, is reported as a deadlock.
// __shared__ becomes `static`: one block at a time, so one copy is the block's.
//
// The float intrinsics are the plain IEEE operations (build with -ffp-contract=off so that no
// multiply-add is fused); libm's expf / sincosf / powf are not CUDA's, so results are compared
// against other kernels under this same simulator, not against the GPU's bits.
#pragma once
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "cuda_bf16.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __shared__ static
#define __launch_bounds__(...)

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct uint3 {
    unsigned x, y, z;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) float2 {
    float x, y;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(16) int4 {
    int x, y, z, w;
};

inline uint3 threadIdx, blockIdx;
inline dim3 blockDim, gridDim;

inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
template <typename T>
inline T __ldg(const T* p) {
    return *p;
}
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline unsigned long long min(unsigned long long a, unsigned long long b) { return a < b ? a : b; }
inline unsigned long long max(unsigned long long a, unsigned long long b) { return a > b ? a : b; }

namespace sim {

enum State { RUN, AT_BLOCK, AT_WARP, DONE };

struct Fiber {
    ucontext_t ctx;
    uint3 tid;
    int warp = 0, lane = 0;
    State state = RUN;
};

struct Block {
    ucontext_t sched;
    std::vector<Fiber> fibers;
    Fiber* cur = nullptr;
    std::function<void()> body;
    std::vector<uint64_t> slots;  // 32 a warp
};

inline Block*& block() {
    static Block* b = nullptr;
    return b;
}

inline void trampoline() {
    Block* b = block();
    b->body();
    b->cur->state = DONE;
}

inline void wait(State s) {
    Block* b = block();
    b->cur->state = s;
    swapcontext(&b->cur->ctx, &b->sched);
}

[[noreturn]] inline void fail(const char* what) {
    std::fprintf(stderr, "simt: %s (block %u,%u,%u)\n", what, blockIdx.x, blockIdx.y, blockIdx.z);
    std::abort();
}

// Runs body() as every thread of every block of the grid.
inline void launch(dim3 grid, dim3 blk, std::function<void()> body) {
    const unsigned nthreads = blk.x * blk.y * blk.z;
    if (nthreads == 0 || nthreads > 1024) fail("block size must be 1..1024");
    gridDim = grid;
    blockDim = blk;
    const size_t stack = 64 * 1024;
    std::vector<std::vector<char>> stacks(nthreads, std::vector<char>(stack));  // reused by every block
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                blockIdx = uint3{bx, by, bz};
                Block b;
                b.body = body;
                b.fibers.resize(nthreads);
                b.slots.assign(((nthreads + 31) / 32) * 32, 0);
                block() = &b;
                for (unsigned t = 0; t < nthreads; ++t) {
                    Fiber& f = b.fibers[t];
                    f.tid = uint3{t % blk.x, (t / blk.x) % blk.y, t / (blk.x * blk.y)};
                    f.warp = t / 32;
                    f.lane = t % 32;
                    getcontext(&f.ctx);
                    f.ctx.uc_stack.ss_sp = stacks[t].data();
                    f.ctx.uc_stack.ss_size = stack;
                    f.ctx.uc_link = &b.sched;
                    makecontext(&f.ctx, trampoline, 0);
                }
                for (;;) {
                    bool ran = false;
                    for (Fiber& f : b.fibers) {
                        if (f.state != RUN) continue;
                        ran = true;
                        b.cur = &f;
                        threadIdx = f.tid;
                        swapcontext(&b.sched, &f.ctx);
                    }
                    if (ran) continue;
                    // Nobody can run: release the warps whose live lanes all wait at a shuffle,
                    // else the block if every live thread waits at __syncthreads.
                    bool released = false, any_live = false, all_block = true;
                    for (size_t w = 0; w * 32 < b.fibers.size(); ++w) {
                        int at_warp = 0, live = 0;
                        for (size_t t = w * 32; t < std::min(b.fibers.size(), w * 32 + 32); ++t) {
                            const State s = b.fibers[t].state;
                            if (s == DONE) continue;
                            ++live;
                            if (s == AT_WARP) ++at_warp;
                        }
                        if (live) any_live = true;
                        if (at_warp && at_warp != live) fail("a warp's lanes wait at different barriers");
                        if (at_warp) {
                            for (size_t t = w * 32; t < std::min(b.fibers.size(), w * 32 + 32); ++t)
                                if (b.fibers[t].state == AT_WARP) b.fibers[t].state = RUN;
                            released = true;
                            all_block = false;
                        }
                    }
                    if (!any_live) break;
                    if (released) continue;
                    if (!all_block) fail("deadlock");
                    for (Fiber& f : b.fibers)
                        if (f.state == AT_BLOCK) f.state = RUN;
                }
                block() = nullptr;
            }
}

template <typename T>
inline T exchange(T v, int src_lane) {
    static_assert(sizeof(T) <= 8, "shuffle of more than 8 bytes");
    Block* b = block();
    const int w = b->cur->warp, lane = b->cur->lane;
    uint64_t u = 0;
    std::memcpy(&u, &v, sizeof(T));
    b->slots[w * 32 + lane] = u;
    wait(AT_WARP);
    T r;
    std::memcpy(&r, &b->slots[w * 32 + (src_lane & 31)], sizeof(T));
    wait(AT_WARP);
    return r;
}

inline int lane_id() { return block()->cur->lane; }

}  // namespace sim

inline void __syncthreads() { sim::wait(sim::AT_BLOCK); }
inline void __syncwarp(unsigned = 0xffffffffu) { sim::wait(sim::AT_WARP); }

template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int mask, int width = 32) {
    const int lane = sim::lane_id();
    const int src = lane ^ mask;
    return sim::exchange(v, (src / width == lane / width) ? src : lane);
}
template <typename T>
inline T __shfl_down_sync(unsigned, T v, unsigned delta, int width = 32) {
    const int lane = sim::lane_id();
    const int src = lane + (int)delta;
    return sim::exchange(v, (src / width == lane / width) ? src : lane);
}
template <typename T>
inline T __shfl_sync(unsigned, T v, int src, int width = 32) {
    const int lane = sim::lane_id();
    return sim::exchange(v, (lane / width) * width + (src % width));
}
