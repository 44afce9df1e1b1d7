// decode.cu -- attention of one new query per sequence over its keys in the paged KV cache
// (split-KV "flash decoding"), head_dim 128, bf16 in and out, f32 accumulation, GQA.
//
// Why: a decode step has one query per sequence. The prefill kernel (flash_attn.cu) computes
// 128-row query tiles, so 127 of 128 rows are wasted, and it needs the keys packed, which cost a
// gather of every cached row of every layer per step. This kernel reads the pool rows in place
// through the call's row list and is bound by the bytes of K and V it reads.
//
// Layouts:
//   q, out     : [B, H, 128] bf16, contiguous (sequence b's query heads)
//   k, v pools : [capacity, Hkv * 128] bf16, contiguous (one row per cached position)
//   rows       : u32; the keys of sequence b are pool rows rows[cu_k[b] .. cu_k[b+1]] in position order
//   cu_k       : B+2 u32: B+1 prefix offsets into rows, then the split length `chunk` (keys per
//                split, a multiple of 32). On the device so that a captured CUDA graph replays
//                with each step's lengths: the grid's split count is fixed per graph, the chunk
//                is not; splits past a sequence's end find no keys and weigh nothing.
//   part_o     : [B, H, splits, 128] f32, part_lse: [B, H, splits] f32 (log2 domain), only when splits > 1
// The query is the sequence's last position, so it sees every key of its sequence.
//
// Grid (splits, Hkv, B), block 128 (4 warps). A block owns the G = H / Hkv query heads of one kv
// head and keys [split * chunk, (split + 1) * chunk) of one sequence. Within a warp, each half
// (lanes 0-15, 16-31) takes one key at a time and each of its lanes 8 of the 128 dims (one 16-byte
// load of K and one of V); a warp covers 2 x VD_TILE = 8 keys per iteration, loaded before use.
// Each half keeps its own online softmax (running max, sum, 8 x G accumulators); the halves are
// merged with shuffles, the warps through shared memory. With one split the block writes the bf16
// output; otherwise its normalised partial output and log-sum-exp, which vime_decode_combine
// merges.
//
// Three variants share the grid's plan, arguments and merge: this register kernel
// (vime_decode_attn_g*), a shared-memory pipelined one (vime_decode_attn_p*) and a tensor-core
// one (vime_decode_attn_t*, the default since 2026-12-03: 4.0 against 3.0 TB/s at batch 64 x 4096
// keys). The layout paragraph above is the register kernel's; each variant says how it differs.
//
// Why 8 dims a lane (not 16): 16 dims a lane held 2 x 16 x G f32 of query and accumulators plus
// 16 KV loads in flight, 248 registers at G = 4, so 2 blocks an SM; a decode step's blocks each see
// only a few hundred keys, so the kernel was latency-bound at ~1 TB/s (Nsight Compute, Qwen3-4B,
// batch 64, ~150 keys: 38 us a layer for 39 MB). At 8 dims a lane the kernel fits 4 blocks an SM
// (launch bounds) at G <= 4, one more shuffle per dot product.
#include <cuda_bf16.h>
#include <stdint.h>

#include "tile_ptx.cuh"

#define VD_D 128
#define VD_WARPS 4
#define VD_THREADS (VD_WARPS * 32)
#define VD_TILE 4  // keys per lane group per iteration

namespace vd {
using namespace vptx;  // tile_ptx.cuh: cp.async, ldmatrix, mma, pack_bf16, sw256

__device__ __forceinline__ void cvt8(const uint4 raw, float* f) {
    const __nv_bfloat162* x = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 u = __bfloat1622float2(x[i]);
        f[2 * i] = u.x;
        f[2 * i + 1] = u.y;
    }
}

// The factor that rescales a partial (max m) into a merge whose max is mm: 0 for an empty one.
__device__ __forceinline__ float rescale(float m, float mm) {
    return m == -INFINITY ? 0.f : exp2f(m - mm);
}

// One thread's share of a block's work (the register and the pipelined kernel alike): the
// scaled query dims it owns, and its half-warp's online softmax over the keys it has seen.
template <int G>
struct Partial {
    float qf[G][8], m[G], l[G], acc[G][8];

    __device__ __forceinline__ Partial(const __nv_bfloat16* q, int b, int heads, int g, int sl,
                                       float scale_log2) {
#pragma unroll
        for (int h = 0; h < G; ++h) {
            const uint4 raw =
                *reinterpret_cast<const uint4*>(q + ((size_t)b * heads + g * G + h) * VD_D + sl * 8);
            cvt8(raw, qf[h]);
#pragma unroll
            for (int i = 0; i < 8; ++i) qf[h][i] *= scale_log2;
            m[h] = -INFINITY;
            l[h] = 0.f;
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[h][i] = 0.f;
        }
    }

    // VD_TILE keys of this half-warp (K and V: this lane's 8 dims of each; `ok`: inside the split).
    __device__ __forceinline__ void step(const uint4 (&kr)[VD_TILE], const uint4 (&vr)[VD_TILE],
                                         const bool (&ok)[VD_TILE]) {
        if constexpr (VD_TILE * G == 4 || VD_TILE * G == 8 || VD_TILE * G == 16) {
            step_scatter(kr, vr, ok);
        } else {
            step_butterfly(kr, vr, ok);
        }
    }

    // G = 1, 2, 4 (Qwen3 0.6B-8B have G = 2 or 4). The N = VD_TILE x G partial dot products of
    // a lane are reduced over the half-warp by a reduce-scatter (each of the log2 N exchange
    // steps sends half of what is left: N - 1 shuffles in all, 15 at G = 4, where a butterfly
    // per dot product takes 4 N = 64), which leaves lane sl with the whole dot product of one
    // (key, head) pair. That lane computes its pair's exp2 (1 exponential a lane where every lane
    // computed all N), and the N weights are gathered back for the P.V sums. Why: at 8 dims a
    // lane the register kernel is bound by instruction issue (shuffles and exponentials), not
    // by the bytes in flight; the shared-memory pipelined kernel, with the butterfly's
    // arithmetic, was 4-15 % slower (engine_ops, 583802f).
    __device__ __forceinline__ void step_scatter(const uint4 (&kr)[VD_TILE], const uint4 (&vr)[VD_TILE],
                                                 const bool (&ok)[VD_TILE]) {
        constexpr int N = VD_TILE * G;
        constexpr int LOGN = N == 16 ? 4 : N == 8 ? 3 : 2;
        constexpr int SHIFT = 4 - LOGN;  // lane sl ends with pair sl >> SHIFT
        const int sl = threadIdx.x & 15;
        float v[N];
#pragma unroll
        for (int t = 0; t < VD_TILE; ++t) {
            float kf[8];
            cvt8(kr[t], kf);
#pragma unroll
            for (int h = 0; h < G; ++h) {
                float d = 0.f;
#pragma unroll
                for (int i = 0; i < 8; ++i) d = fmaf(qf[h][i], kf[i], d);
                v[t * G + h] = d;  // pair index t * G + h
            }
        }
        // Exchange step k (mask 8 >> k): a lane keeps the upper half of what it holds when its
        // mask bit is set, the lower half otherwise, and adds its partner's copy of that half.
#pragma unroll
        for (int k = 0; k < LOGN; ++k) {
            const int mask = 8 >> k;
            const bool up = (sl & mask) != 0;
#pragma unroll
            for (int i = 0; i < (N >> (k + 1)); ++i) {
                const float lo = v[i], hi = v[i + (N >> (k + 1))];
                v[i] = (up ? hi : lo) + __shfl_xor_sync(0xffffffff, up ? lo : hi, mask);
            }
        }
        float sc = v[0];
#pragma unroll
        for (int mask = 8 >> LOGN; mask >= 1; mask >>= 1) sc += __shfl_xor_sync(0xffffffff, sc, mask);
        const int pair = sl >> SHIFT, t_own = pair / G, h_own = pair % G;
        bool ok_own = ok[0];
        float m_own = m[0];
#pragma unroll
        for (int t = 1; t < VD_TILE; ++t) ok_own = t == t_own ? ok[t] : ok_own;
#pragma unroll
        for (int h = 1; h < G; ++h) m_own = h == h_own ? m[h] : m_own;
        if (!ok_own) sc = -INFINITY;
        // The tile's max of each head: over the keys (pair bits above the head's, lane bits 2-3).
        float mt = fmaxf(sc, __shfl_xor_sync(0xffffffff, sc, 4));
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffff, mt, 8));
        const float mm_own = fmaxf(m_own, mt);
        const float p_own = ok_own ? exp2f(sc - mm_own) : 0.f;
        float mm[G];
#pragma unroll
        for (int h = 0; h < G; ++h) mm[h] = fmaxf(m[h], __shfl_sync(0xffffffff, mt, h << SHIFT, 16));
        float pw[VD_TILE][G];
#pragma unroll
        for (int t = 0; t < VD_TILE; ++t)
#pragma unroll
            for (int h = 0; h < G; ++h) pw[t][h] = __shfl_sync(0xffffffff, p_own, (t * G + h) << SHIFT, 16);
#pragma unroll
        for (int h = 0; h < G; ++h) {
            const float c = rescale(m[h], mm[h]);
            float ls = 0.f;
#pragma unroll
            for (int t = 0; t < VD_TILE; ++t) ls += pw[t][h];
            l[h] = l[h] * c + ls;
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[h][i] *= c;
            m[h] = mm[h];
        }
#pragma unroll
        for (int t = 0; t < VD_TILE; ++t) {
            float vf[8];
            cvt8(vr[t], vf);
#pragma unroll
            for (int h = 0; h < G; ++h)
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[h][i] = fmaf(pw[t][h], vf[i], acc[h][i]);
        }
    }

    // Any G: each dot product reduced by its own butterfly over the half-warp, every lane
    // computing every weight. Its dot-product loop repeats step_scatter's on purpose: sharing
    // one helper changed the register counts of the kernels that run this step (ptxas,
    // by 1-16 registers), which no H200 run has measured.
    __device__ __forceinline__ void step_butterfly(const uint4 (&kr)[VD_TILE], const uint4 (&vr)[VD_TILE],
                                                   const bool (&ok)[VD_TILE]) {
        float s[VD_TILE][G];
#pragma unroll
        for (int t = 0; t < VD_TILE; ++t) {
            float kf[8];
            cvt8(kr[t], kf);
#pragma unroll
            for (int h = 0; h < G; ++h) {
                float d = 0.f;
#pragma unroll
                for (int i = 0; i < 8; ++i) d = fmaf(qf[h][i], kf[i], d);
                d += __shfl_xor_sync(0xffffffff, d, 1);
                d += __shfl_xor_sync(0xffffffff, d, 2);
                d += __shfl_xor_sync(0xffffffff, d, 4);
                d += __shfl_xor_sync(0xffffffff, d, 8);
                s[t][h] = ok[t] ? d : -INFINITY;
            }
        }
#pragma unroll
        for (int h = 0; h < G; ++h) {
            float mt = m[h];
#pragma unroll
            for (int t = 0; t < VD_TILE; ++t) mt = fmaxf(mt, s[t][h]);
            if (mt == -INFINITY) continue;  // no valid key for this half yet
            const float c = rescale(m[h], mt);
            l[h] *= c;
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[h][i] *= c;
            m[h] = mt;
        }
#pragma unroll
        for (int t = 0; t < VD_TILE; ++t) {
            float vf[8];
            cvt8(vr[t], vf);
#pragma unroll
            for (int h = 0; h < G; ++h) {
                const float p = ok[t] ? exp2f(s[t][h] - m[h]) : 0.f;
                l[h] += p;
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[h][i] = fmaf(p, vf[i], acc[h][i]);
            }
        }
    }

    // Merges the two halves of each warp (lanes sl and sl + 16 hold the same dims), then the
    // warps through `smem` (at least VD_WARPS x G x (VD_D + 2) floats, free for this use), and
    // writes the block's bf16 output (one split) or its partial output and log-sum-exp.
    __device__ __forceinline__ void finish(float* smem, int warp, int kq, int sl, int g, int b, int split,
                                           int nsplit, int heads, __nv_bfloat16* __restrict__ out,
                                           float* __restrict__ part_o, float* __restrict__ part_lse) {
#pragma unroll
        for (int h = 0; h < G; ++h) {
            const float mo = __shfl_xor_sync(0xffffffff, m[h], 16);
            const float lo = __shfl_xor_sync(0xffffffff, l[h], 16);
            const float mm = fmaxf(m[h], mo);
            const float ca = rescale(m[h], mm), cb = rescale(mo, mm);
            l[h] = l[h] * ca + lo * cb;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float ao = __shfl_xor_sync(0xffffffff, acc[h][i], 16);
                acc[h][i] = acc[h][i] * ca + ao * cb;
            }
            m[h] = mm;
        }
        float(*s_acc)[G][VD_D] = reinterpret_cast<float(*)[G][VD_D]>(smem);
        float(*s_m)[G] = reinterpret_cast<float(*)[G]>(smem + VD_WARPS * G * VD_D);
        float(*s_l)[G] = reinterpret_cast<float(*)[G]>(smem + VD_WARPS * G * VD_D + VD_WARPS * G);
        if (kq == 0) {
#pragma unroll
            for (int h = 0; h < G; ++h) {
#pragma unroll
                for (int i = 0; i < 8; ++i) s_acc[warp][h][sl * 8 + i] = acc[h][i];
                if (sl == 0) {
                    s_m[warp][h] = m[h];
                    s_l[warp][h] = l[h];
                }
            }
        }
        __syncthreads();
        for (int e = threadIdx.x; e < G * VD_D; e += VD_THREADS) {
            const int h = e / VD_D, dim = e % VD_D;
            float mm = -INFINITY;
#pragma unroll
            for (int w = 0; w < VD_WARPS; ++w) mm = fmaxf(mm, s_m[w][h]);
            float lt = 0.f, at = 0.f;
#pragma unroll
            for (int w = 0; w < VD_WARPS; ++w) {
                const float c = rescale(s_m[w][h], mm);
                lt += s_l[w][h] * c;
                at += s_acc[w][h][dim] * c;
            }
            const int hh = g * G + h;
            const float o = lt > 0.f ? at / lt : 0.f;
            if (nsplit == 1) {
                out[((size_t)b * heads + hh) * VD_D + dim] = __float2bfloat16(o);
            } else {
                const size_t pi = ((size_t)b * heads + hh) * nsplit + split;
                part_o[pi * VD_D + dim] = o;
                if (dim == 0) part_lse[pi] = lt > 0.f ? mm + __log2f(lt) : -INFINITY;
            }
        }
    }
};

template <int G>
__device__ __forceinline__ void decode_impl(const __nv_bfloat16* __restrict__ q,
                                            const __nv_bfloat16* __restrict__ kpool,
                                            const __nv_bfloat16* __restrict__ vpool,
                                            const unsigned int* __restrict__ rows,
                                            const unsigned int* __restrict__ cu_k,
                                            __nv_bfloat16* __restrict__ out, float* __restrict__ part_o,
                                            float* __restrict__ part_lse, int heads, int kv_heads,
                                            float scale_log2) {
    __shared__ float merge[VD_WARPS * G * (VD_D + 2)];
    const int split = blockIdx.x, g = blockIdx.y, b = blockIdx.z, nsplit = gridDim.x;
    const int chunk = (int)cu_k[gridDim.z + 1];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int kq = lane >> 4, sl = lane & 15;
    const unsigned k0 = cu_k[b];
    const int len = (int)(cu_k[b + 1] - k0);
    const int start = split * chunk, end = min(start + chunk, len);
    const size_t width = (size_t)kv_heads * VD_D;
    const __nv_bfloat16* kb = kpool + (size_t)g * VD_D + sl * 8;
    const __nv_bfloat16* vb = vpool + (size_t)g * VD_D + sl * 8;

    Partial<G> p(q, b, heads, g, sl, scale_log2);
    for (int j0 = start + warp * (2 * VD_TILE); j0 < end; j0 += VD_WARPS * 2 * VD_TILE) {
        uint4 kr[VD_TILE], vr[VD_TILE];
        bool ok[VD_TILE];
#pragma unroll
        for (int t = 0; t < VD_TILE; ++t) {
            const int j = j0 + t * 2 + kq;
            ok[t] = j < end;
            if (ok[t]) {
                const size_t row = (size_t)rows[k0 + j] * width;
                kr[t] = *reinterpret_cast<const uint4*>(kb + row);
                vr[t] = *reinterpret_cast<const uint4*>(vb + row);
            } else {
                kr[t] = vr[t] = make_uint4(0, 0, 0, 0);
            }
        }
        p.step(kr, vr, ok);
    }
    p.finish(merge, warp, kq, sl, g, b, split, nsplit, heads, out, part_o, part_lse);
}

}  // namespace vd

#define VD_ARGS                                                                                  \
    const __nv_bfloat16 *__restrict__ q, const __nv_bfloat16 *__restrict__ kpool,                \
        const __nv_bfloat16 *__restrict__ vpool, const unsigned int *__restrict__ rows,          \
        const unsigned int *__restrict__ cu_k, __nv_bfloat16 *__restrict__ out,                  \
        float *__restrict__ part_o, float *__restrict__ part_lse, int heads, int kv_heads,       \
        float scale_log2
#define VD_KERNEL(G)                                                                             \
    extern "C" __global__ void __launch_bounds__(VD_THREADS, (G) <= 4 ? 4 : 2)                  \
        vime_decode_attn_g##G(VD_ARGS) {                                                         \
        vd::decode_impl<G>(q, kpool, vpool, rows, cu_k, out, part_o, part_lse, heads, kv_heads,  \
                           scale_log2);                                                   \
    }
VD_KERNEL(1)
VD_KERNEL(2)
VD_KERNEL(3)
VD_KERNEL(4)
VD_KERNEL(5)
VD_KERNEL(6)
VD_KERNEL(7)
VD_KERNEL(8)

// ---- vime_decode_attn_p{G}: the same attention, K and V staged through shared memory --------
//
// Why: the register kernel above can keep only the bytes its registers hold in flight (4 KB a
// warp during its load phase, 16 warps an SM), which caps it near 2.9 TB/s of the H200's ~4.8 at
// long KV (engine_ops, 0546e45). Here the whole block copies tiles of 32 keys (K and V of its kv
// head: 16 KB) into shared memory with cp.async, VD_STAGES tiles ahead, so the bytes in flight no
// longer cost registers; the arithmetic is the register kernel's (half a warp a key, 8 dims a
// lane: `Partial`), reading the tile from shared memory. Same grid, arguments, outputs and merge.
// Thread i copies 64 bytes of K and 64 of V of key i / 4 of each tile (4 + 4 cp.async of 16 B),
// its pool row fetched one tile ahead. Selected by `KernelConfig::decode_kernel`.
#define VD_STAGES 3
#define VD_KEYS 32  // keys per tile (4 warps x 8)
#define VD_TILE_BYTES (VD_KEYS * 2 * VD_D * 2)  // K and V rows of one kv head: 16 KB

namespace vd {

template <int G>
__device__ __forceinline__ void decode_pipelined(const __nv_bfloat16* __restrict__ q,
                                                 const __nv_bfloat16* __restrict__ kpool,
                                                 const __nv_bfloat16* __restrict__ vpool,
                                                 const unsigned int* __restrict__ rows,
                                                 const unsigned int* __restrict__ cu_k,
                                                 __nv_bfloat16* __restrict__ out, float* __restrict__ part_o,
                                                 float* __restrict__ part_lse, int heads, int kv_heads,
                                                 float scale_log2) {
    // The tiles; after the loop the same bytes hold the warps' merge.
    __shared__ __align__(16) unsigned char smem[VD_STAGES * VD_TILE_BYTES];
    const int split = blockIdx.x, g = blockIdx.y, b = blockIdx.z, nsplit = gridDim.x;
    const int chunk = (int)cu_k[gridDim.z + 1];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int kq = lane >> 4, sl = lane & 15;
    const unsigned k0 = cu_k[b];
    const int len = (int)(cu_k[b + 1] - k0);
    const int start = split * chunk, end = min(start + chunk, len);
    const int tiles = end > start ? (end - start + VD_KEYS - 1) / VD_KEYS : 0;
    const size_t width = (size_t)kv_heads * VD_D;
    // This thread's share of every tile copy: key ck of the tile, bytes [cp * 64, cp * 64 + 64)
    // of its K row and of its V row.
    const int ck = threadIdx.x >> 2, cp = threadIdx.x & 3;
    const __nv_bfloat16* kb = kpool + (size_t)g * VD_D + cp * 32;
    const __nv_bfloat16* vb = vpool + (size_t)g * VD_D + cp * 32;
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(smem);
    // Shared layout of a tile: key j's K row (16 x 16 B) then its V row (16 x 16 B).
    auto row_of = [&](int tile) -> unsigned {
        const int j = start + tile * VD_KEYS + ck;
        return (tile < tiles && j < end) ? rows[k0 + j] : 0xffffffffu;
    };
    auto issue = [&](int tile, unsigned row) {
        if (tile < tiles) {
            const bool ok = row != 0xffffffffu;
            const size_t off = ok ? (size_t)row * width : 0;
            const uint32_t dst = sbase + (tile % VD_STAGES) * VD_TILE_BYTES + ck * (2 * VD_D * 2) + cp * 64;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                cp_async16(dst + i * 16, kb + off + i * 8, ok);
                cp_async16(dst + VD_D * 2 + i * 16, vb + off + i * 8, ok);
            }
        }
        cp_async_commit();  // an empty group past the last tile keeps the count
    };

    Partial<G> p(q, b, heads, g, sl, scale_log2);
#pragma unroll
    for (int t = 0; t < VD_STAGES - 1; ++t) issue(t, row_of(t));
    unsigned next = row_of(VD_STAGES - 1);
    for (int t = 0; t < tiles; ++t) {
        cp_async_wait<VD_STAGES - 2>();  // this thread's copies of tile t have landed
        __syncthreads();                 // everyone's have; tile t - 1's buffer is free
        issue(t + VD_STAGES - 1, next);
        next = row_of(t + VD_STAGES);
        const uint4* tb = reinterpret_cast<const uint4*>(smem + (t % VD_STAGES) * VD_TILE_BYTES);
        const int j0 = start + t * VD_KEYS + warp * (2 * VD_TILE);
        uint4 kr[VD_TILE], vr[VD_TILE];
        bool ok[VD_TILE];
#pragma unroll
        for (int u = 0; u < VD_TILE; ++u) {
            const int kk = warp * (2 * VD_TILE) + u * 2 + kq;  // key within the tile: 32 uint4 a key
            ok[u] = j0 + u * 2 + kq < end;
            kr[u] = tb[kk * 32 + sl];
            vr[u] = tb[kk * 32 + 16 + sl];
        }
        // The butterfly: with the reduce-scatter this kernel needed a 64-byte stack frame and ran
        // 30-50 % slower (engine_ops, d9065b2); with the butterfly it is 583802f's kernel.
        p.step_butterfly(kr, vr, ok);
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp is done with the tiles: their bytes become the merge's
    p.finish(reinterpret_cast<float*>(smem), warp, kq, sl, g, b, split, nsplit, heads, out, part_o, part_lse);
}

}  // namespace vd

#define VD_PKERNEL(G)                                                                            \
    extern "C" __global__ void __launch_bounds__(VD_THREADS, (G) <= 4 ? 4 : 2)                  \
        vime_decode_attn_p##G(VD_ARGS) {                                                         \
        vd::decode_pipelined<G>(q, kpool, vpool, rows, cu_k, out, part_o, part_lse, heads,       \
                                kv_heads, scale_log2);                                           \
    }
VD_PKERNEL(1)
VD_PKERNEL(2)
VD_PKERNEL(3)
VD_PKERNEL(4)
VD_PKERNEL(5)
VD_PKERNEL(6)
VD_PKERNEL(7)
VD_PKERNEL(8)

// ---- vime_decode_attn_t{G}: the same attention on tensor cores, one warp a block -------------
//
// Why: at 8 dims a lane the register kernel spends ~50 warp instructions a key (FMAs, bf16
// conversions, shuffles, exponentials); the pipelined one adds shared-memory reads and block
// barriers to that, and neither kept enough bytes in flight to pass ~2.9 TB/s of the H200's ~4.8
// (engine_ops). Here the G query heads of a kv head are the 8 columns of one m16n8k16 MMA tile,
// so 16 keys cost 8 MMAs for S^T = K Q^T, 8 for O^T += V^T P^T and 16 ldmatrix: ~6 instructions
// a key. K and V go to shared memory with cp.async, VT_STAGES groups of 16 keys ahead, in a
// ring private to the warp (no block barrier; the warp's own __syncwarp orders it).
//
// Grid (VT_SUB x splits, Hkv, B), block 32. The plan (splits x chunk) is the other kernels';
// block x = split * VT_SUB + sub takes the 16-key groups sub, sub + VT_SUB, ... of split's chunk,
// and writes its normalised partial output and log-sum-exp (log2) as split x of
// VT_SUB x splits, which vime_decode_combine merges (always, even at one split).
//
// Fragments (PTX ISA, mma.m16n8k16, g = lane / 4, t = lane % 4):
//   S^T [16 keys x 8 heads] = K [16 keys x 16 dims] . Q^T [16 dims x 8 heads], over 8 dim chunks:
//     A = K via ldmatrix, B = Q^T straight from global (head g's dims 2t, 2t+1, +8; 0 for g >= G);
//     C: keys g and g + 8, heads 2t and 2t + 1, so a thread's online softmax is over 2 heads.
//   O^T [16 dims x 8 heads] += V^T [16 dims x 16 keys] . P^T [16 keys x 8 heads], 8 dim tiles:
//     A = V^T via ldmatrix.trans; B = P^T: S^T's C fragment in bf16 is an 8x8 matrix in the
//     fragment layout, and movmatrix.trans makes it P^T's B fragment (no shared memory).
//   O^T's C has the same head columns as S^T's, so the rescale by a new max is per thread.
// P is rounded to bf16 for the P.V MMA (as the prefill kernel does); l sums it in f32.
//
// Measured (engine_ops, H200, 2026-12-03): 4.01 TB/s of K + V at B 64 x 4096 keys (268 against
// the register kernel's 363 us), 3.71 at 2048, 2.44 at B 256 x 160; faster than both other
// variants at every shape timed. A first version in which each lane copied one key's 16-byte
// pieces (16 rows touched per cp.async) ran at 1.36 TB/s: the copy mapping, not the math, was the
// bound. Its error against the f32 CPU reference is 1e-3..4e-3 relative (P in bf16), against
// 2e-5..5e-4 for the others.
#define VT_SUB 4      // blocks (warps) per split
#define VT_STAGES 3   // groups of 16 keys in flight per warp, with the one being read
#define VT_GROUP_BYTES (16 * 2 * VD_D * 2)  // K then V of 16 keys of one kv head: 8 KB

namespace vd {

// An 8x8 b16 matrix held one register a lane in the MMA fragment layout, transposed.
__device__ __forceinline__ uint32_t movmatrix_t(uint32_t x) {
    uint32_t y;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
    return y;
}

template <int G>
__device__ __forceinline__ void decode_tensor(const __nv_bfloat16* __restrict__ q,
                                              const __nv_bfloat16* __restrict__ kpool,
                                              const __nv_bfloat16* __restrict__ vpool,
                                              const unsigned int* __restrict__ rows,
                                              const unsigned int* __restrict__ cu_k,
                                              float* __restrict__ part_o, float* __restrict__ part_lse,
                                              int heads, int kv_heads, float scale_log2) {
    __shared__ __align__(128) unsigned char smem[VT_STAGES * VT_GROUP_BYTES];
    const int split = blockIdx.x / VT_SUB, sub = blockIdx.x % VT_SUB, kvh = blockIdx.y, b = blockIdx.z;
    const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
    const int chunk = (int)cu_k[gridDim.z + 1];
    const unsigned k0 = cu_k[b];
    const int len = (int)(cu_k[b + 1] - k0);
    const int start = split * chunk, end = min(start + chunk, len);
    const int groups_all = end > start ? (end - start + 15) / 16 : 0;
    const int groups = groups_all > sub ? (groups_all - sub + VT_SUB - 1) / VT_SUB : 0;  // this warp's
    const size_t width = (size_t)kv_heads * VD_D;
    const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(smem);

    // Q^T's B fragments: head g of this kv head's group, dims 16c + 2t (+1) and 16c + 8 + 2t (+1).
    uint32_t qb[8][2];
    {
        const bool on = g < G;
        const uint32_t* qh =
            reinterpret_cast<const uint32_t*>(q + ((size_t)b * heads + kvh * G + (on ? g : 0)) * VD_D);
#pragma unroll
        for (int c = 0; c < 8; ++c) {
            qb[c][0] = on ? qh[c * 8 + t] : 0u;
            qb[c][1] = on ? qh[c * 8 + 4 + t] : 0u;
        }
    }
    // The copy: cp.async i of a group moves keys 2i and 2i + 1 (lanes 0-15 and 16-31), one
    // 16-byte chunk a lane, so each instruction reads two whole 256-byte rows (a lane-per-key
    // split, 16 separate 16-byte pieces an instruction, ran at ~1.4 TB/s). Lane l (mod 16) holds
    // the pool row of key l of the group; shuffles hand each lane its key's row.
    const int ch = lane & 15, kh = lane >> 4;
    auto row_of = [&](int n) -> unsigned {  // n: this warp's group
        const int j = start + (sub + n * VT_SUB) * 16 + (lane & 15);
        return (n < groups && j < end) ? rows[k0 + j] : 0xffffffffu;
    };
    auto issue = [&](int n, unsigned row16) {
        if (n < groups) {
            const uint32_t dk = sbase + (n % VT_STAGES) * VT_GROUP_BYTES;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int key = 2 * i + kh;
                const unsigned row = __shfl_sync(0xffffffff, row16, key);
                const bool ok = row != 0xffffffffu;
                const size_t off = ok ? (size_t)row * width + (size_t)kvh * VD_D + ch * 8 : 0;
                cp_async16(dk + sw256(key, ch), kpool + off, ok);
                cp_async16(dk + 4096 + sw256(key, ch), vpool + off, ok);
            }
        }
        cp_async_commit();  // an empty group past the last keeps the count
    };

    float acc[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;  // heads 2t and 2t + 1

    // ldmatrix addresses (lane's row of matrix lane / 8): K as A (keys x dims), V as A^T.
    const int mi = lane >> 3, mr = lane & 7;
    const int k_row = mr + ((mi & 1) << 3), k_ch = mi >> 1;        // matrices: keys 0-7/8-15, dims +0/+8
    const int v_row = mr + ((mi >> 1) << 3), v_ch = mi & 1;        // matrices: dims +0/+8, keys 0-7/8-15

#pragma unroll
    for (int n = 0; n < VT_STAGES - 1; ++n) issue(n, row_of(n));
    unsigned next = row_of(VT_STAGES - 1);
    for (int n = 0; n < groups; ++n) {
        cp_async_wait<VT_STAGES - 2>();  // this lane's copies of group n have landed
        __syncwarp();                    // every lane's; group n - 1's stage is free
        issue(n + VT_STAGES - 1, next);
        next = row_of(n + VT_STAGES);
        const uint32_t kst = sbase + (n % VT_STAGES) * VT_GROUP_BYTES, vst = kst + 4096;

        float sa[4] = {0.f, 0.f, 0.f, 0.f}, sb[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int c = 0; c < 8; c += 2) {
            uint32_t a[4], a2[4];
            ldsm_x4(a[0], a[1], a[2], a[3], kst + sw256(k_row, 2 * c + k_ch));
            ldsm_x4(a2[0], a2[1], a2[2], a2[3], kst + sw256(k_row, 2 * (c + 1) + k_ch));
            mma16816(sa, a, qb[c][0], qb[c][1]);
            mma16816(sb, a2, qb[c + 1][0], qb[c + 1][1]);
        }
        const int j0 = start + (sub + n * VT_SUB) * 16 + g;  // keys of rows g and g + 8
        const bool ok0 = j0 < end, ok1 = j0 + 8 < end;
        float s[4];
        s[0] = ok0 ? (sa[0] + sb[0]) * scale_log2 : -INFINITY;
        s[1] = ok0 ? (sa[1] + sb[1]) * scale_log2 : -INFINITY;
        s[2] = ok1 ? (sa[2] + sb[2]) * scale_log2 : -INFINITY;
        s[3] = ok1 ? (sa[3] + sb[3]) * scale_log2 : -INFINITY;
        float x0 = fmaxf(s[0], s[2]), x1 = fmaxf(s[1], s[3]);
#pragma unroll
        for (int mask = 4; mask <= 16; mask <<= 1) {
            x0 = fmaxf(x0, __shfl_xor_sync(0xffffffff, x0, mask));
            x1 = fmaxf(x1, __shfl_xor_sync(0xffffffff, x1, mask));
        }
        // Key g of the group is always inside the split, so the group's max is finite.
        const float n0 = fmaxf(m0, x0), n1 = fmaxf(m1, x1);
        const float c0 = rescale(m0, n0), c1 = rescale(m1, n1);
        const float p0 = exp2f(s[0] - n0), p1 = exp2f(s[1] - n1), p2 = exp2f(s[2] - n0), p3 = exp2f(s[3] - n1);
        l0 = l0 * c0 + p0 + p2;
        l1 = l1 * c1 + p1 + p3;
        m0 = n0;
        m1 = n1;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            acc[i][0] *= c0;
            acc[i][1] *= c1;
            acc[i][2] *= c0;
            acc[i][3] *= c1;
        }
        const uint32_t pb0 = movmatrix_t(pack_bf16(p0, p1)), pb1 = movmatrix_t(pack_bf16(p2, p3));
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            uint32_t a[4];
            ldsm_x4_t(a[0], a[1], a[2], a[3], vst + sw256(v_row, 2 * i + v_ch));
            mma16816(acc[i], a, pb0, pb1);
        }
    }
    cp_async_wait<0>();
    // Each thread's l is over its keys g and g + 8: the sums over the 8 groups of lanes.
#pragma unroll
    for (int mask = 4; mask <= 16; mask <<= 1) {
        l0 += __shfl_xor_sync(0xffffffff, l0, mask);
        l1 += __shfl_xor_sync(0xffffffff, l1, mask);
    }
    const int nsplit = gridDim.x;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int h = 2 * t + e;
        if (h < G) {
            const float l = e ? l1 : l0, m = e ? m1 : m0;
            const float inv = l > 0.f ? 1.f / l : 0.f;
            const size_t pi = ((size_t)b * heads + kvh * G + h) * nsplit + blockIdx.x;
            float* o = part_o + pi * VD_D;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                o[16 * i + g] = acc[i][e] * inv;
                o[16 * i + g + 8] = acc[i][2 + e] * inv;
            }
            if (g == 0) part_lse[pi] = l > 0.f ? m + __log2f(l) : -INFINITY;
        }
    }
}

}  // namespace vd

#define VD_TKERNEL(G)                                                                            \
    extern "C" __global__ void __launch_bounds__(32) vime_decode_attn_t##G(VD_ARGS) {            \
        (void)out;                                                                               \
        vd::decode_tensor<G>(q, kpool, vpool, rows, cu_k, part_o, part_lse, heads, kv_heads,     \
                             scale_log2);                                                        \
    }
VD_TKERNEL(1)
VD_TKERNEL(2)
VD_TKERNEL(3)
VD_TKERNEL(4)
VD_TKERNEL(5)
VD_TKERNEL(6)
VD_TKERNEL(7)
VD_TKERNEL(8)

// Merges the splits of vime_decode_attn: grid (B * H), block 128 (one thread per dim).
extern "C" __global__ void __launch_bounds__(VD_D)
    vime_decode_combine(const float* __restrict__ part_o, const float* __restrict__ part_lse,
                        __nv_bfloat16* __restrict__ out, int nsplit) {
    const size_t row = blockIdx.x;
    const int dim = threadIdx.x;
    const float* lse = part_lse + row * nsplit;
    float mm = -INFINITY;
    for (int s = 0; s < nsplit; ++s) mm = fmaxf(mm, lse[s]);
    float wt = 0.f, o = 0.f;
    for (int s = 0; s < nsplit; ++s) {
        const float c = vd::rescale(lse[s], mm);
        wt += c;
        o += c * part_o[(row * nsplit + s) * VD_D + dim];
    }
    out[row * VD_D + dim] = __float2bfloat16(wt > 0.f ? o / wt : 0.f);
}
