// flash_attn.cu -- vime's own FlashAttention-2 style attention kernels (forward + backward)
// for head_dim = 128, bf16 inputs, f32 accumulation, causal (bottom-right aligned) masking over
// packed variable-length sequences, with grouped-query attention (GQA).
//
// Why our own kernel: no cuDNN / flash-attn library dependency at build or run time; the Rust side
// JIT-loads the PTX produced by `nvcc -ptx -arch=sm_90 -O3 -std=c++17 flash_attn.cu`.
// Only plain sm_80+ PTX features are used (no wgmma / TMA), so the PTX loads on any sm_90 driver.
//
// Algorithm: FlashAttention-2 (Dao, 2023), written from scratch:
//   * tensor-core matmuls with mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 (inline PTX),
//     operands fetched with ldmatrix / ldmatrix.trans from XOR-swizzled shared memory
//     (16-byte chunk index ^= row & 7: conflict-free ldmatrix and cp.async),
//   * global->shared copies with cp.async (zero-filled beyond the sequence end), double-buffered:
//     the next tile is requested right after the barrier that opens the current step, so one
//     __syncthreads per step suffices in the forward (two in the backward),
//   * forward: 128 query rows per CTA (8 warps x 16 rows, Q fragments kept in registers), 128 keys
//     per step; online softmax in f32 with exp2 (scale*log2(e) folded, MUFU.EX2); the S accumulator
//     fragment is re-packed in registers as the bf16 A operand of P@V (no smem round trip for P);
//     warps skip key blocks entirely above their causal horizon,
//   * backward: one CTA owns a block of 64 keys of one kv head (4 warps x 16 keys) and loops over
//     every query head of its GQA group and every 64-row query block that can see those keys;
//     dK/dV stay in registers (no atomics); S^T = K Q^T and dP^T = V dO^T are computed transposed
//     so that P^T and dS^T are re-used from registers as the A operand of dV += P^T dO and
//     dK += dS^T Q; dS^T goes through shared memory once for dQ = dS K, which is accumulated in
//     f32 with vector red.global.add.v2.f32 (FA2 style dQ accumulator). For dQ each warp owns all
//     64 query rows x 32 of the 128 columns (64 f32 accumulators), which needs 24 ldmatrix.x4 per
//     warp and step instead of 40 for a 16-row x 128-column split (VFA_BWD_OPT 4, measured ~3.5%
//     faster backward on H200). Other template options (tested, slower, kept selectable):
//     VFA_BWD_DEFER=1 (dS^T double-buffered, dQ of step i done in step i+1, one barrier per step;
//     smem 115712 B) and VFA_BWD_BN=128 (8 warps, 1 CTA/SM).
//
// Layouts (all contiguous, row-major):
//   q, o, dout, dq : [Tq, H, 128] bf16          k, v, dk, dv : [Tk, Hkv, 128] bf16
//   lse, delta     : [H, Tq] f32 (index h*Tq + token); lse is natural-log LSE of scale*q.k
//   dq_acc         : [Tq, H, 128] f32, zeroed by the caller before vime_flash_bwd
//   cu_q, cu_k     : n_seqs+1 u32 prefix offsets; sequence s owns q rows cu_q[s]..cu_q[s+1] and
//                    k rows cu_k[s]..cu_k[s+1]; Lk >= Lq; query i sees keys j <= i + (Lk - Lq).
//   query head h uses kv head h / (H / Hkv).
//
// Launch configuration (see also the VFA_* constants below):
//   vime_flash_fwd        grid (ceil(max_lq/128), H, n_seqs),  block 256, dynamic smem 163840 B
//   vime_flash_bwd_delta  grid (ceil(tq*H/8)),                 block 256, no smem
//   vime_flash_bwd        grid (ceil(max_lk/64), Hkv, n_seqs), block 128, dynamic smem 107520 B
//   vime_flash_dq_convert grid (ceil(n/1024)), n = tq*H*128,   block 256, no smem
//   The two big kernels need cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize,
//   bytes) once, before the first launch (driver API: cuFuncSetAttribute(f,
//   CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes)).
//   Inside a launch the CTA -> (tile, head, sequence) mapping is re-ordered (from the linear block
//   index, so grid.x must be exactly the ceil above) so that the heaviest causal tiles of all heads
//   are scheduled first.
//   Order: fwd; then memset(dq_acc, 0); bwd_delta; bwd; dq_convert.

#include <cuda_bf16.h>
#include <stdint.h>

#include "tile_ptx.cuh"

#define VFA_D 128
#define VFA_FWD_BM 128
#define VFA_FWD_BN 128
#define VFA_FWD_THREADS 256
#define VFA_FWD_SMEM (VFA_FWD_BM * 256 + 2 * 2 * VFA_FWD_BN * 256)  // 163840
#define VFA_BWD_BM 64
#ifndef VFA_BWD_BN
#define VFA_BWD_BN 64
#endif
#ifndef VFA_BWD_DEFER
#define VFA_BWD_DEFER 0
#endif
#ifndef VFA_BWD_OPT
#define VFA_BWD_OPT 4
#endif
#define VFA_BWD_THREADS (2 * VFA_BWD_BN)
#define VFA_BWD_MINB (VFA_BWD_BN == 64 ? 2 : 1)
#define VFA_BWD_SMEM \
    (2 * VFA_BWD_BN * 256 + 4 * 64 * 256 + (VFA_BWD_DEFER ? 2 : 1) * VFA_BWD_BN * 128 + 4 * 64 * 4)

namespace vfa {
using namespace vptx;  // tile_ptx.cuh

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
    return (uint32_t)__cvta_generic_to_shared(p);
}

__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src, bool pred) {
    int sz = pred ? 4 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src), "r"(sz));
}

// 2^x with a single MUFU.EX2 (flush-to-zero; ex2(-inf) = +0).
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ void red_add_v2(float* addr, float a, float b) {
    asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(addr), "f"(a), "f"(b) : "memory");
}

// As vptx::sw256 (tile_ptx.cuh), for 128-byte rows (64 bf16).
__device__ __forceinline__ uint32_t sw128(int r, int ch) {
    return (uint32_t)(r * 128 + ((ch ^ (r & 7)) << 4));
}

// Copy a [ROWS, 128] bf16 tile (rows `row0 + r` with row stride `stride` elements, rows >= limit
// zero-filled) into swizzled smem at `dst`.
template <int ROWS, int THREADS>
__device__ __forceinline__ void load_tile(uint32_t dst, const __nv_bfloat16* base, size_t stride,
                                          int row0, int limit, const __nv_bfloat16* any_valid,
                                          int tid) {
#pragma unroll
    for (int c = tid; c < ROWS * 16; c += THREADS) {
        int r = c >> 4, ch = c & 15;
        int gr = row0 + r;
        bool ok = gr < limit;
        const __nv_bfloat16* src = ok ? base + (size_t)gr * stride + ch * 8 : any_valid;
        cp_async16(dst + sw256(r, ch), src, ok);
    }
}

}  // namespace vfa

// ------------------------------------------------------------------------------------------------
// Forward. One CTA = BM = 16*NW query rows of one head of one sequence, NW warps x 16 rows.
// ------------------------------------------------------------------------------------------------
namespace vfa {
template <int NW, int BN>
__device__ __forceinline__ void flash_fwd_impl(
    unsigned char* smem, const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
    const __nv_bfloat16* __restrict__ v, __nv_bfloat16* __restrict__ o, float* __restrict__ lse,
    const unsigned int* __restrict__ cu_q, const unsigned int* __restrict__ cu_k, int tq,
    int heads, int kv_heads, float scale) {
    constexpr int BM = 16 * NW, THREADS = 32 * NW, NT = BN / 8;

    // Heaviest tiles (largest m_block) of every (head, seq) first.
    const int lin = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int hs = gridDim.y * gridDim.z;
    const int m_block = gridDim.x - 1 - lin / hs;
    const int rest = lin % hs;
    const int h = rest % gridDim.y;
    const int seq = rest / gridDim.y;

    const int q_start = cu_q[seq];
    const int Lq = (int)cu_q[seq + 1] - q_start;
    const int k_start = cu_k[seq];
    const int Lk = (int)cu_k[seq + 1] - k_start;
    const int m0 = m_block * BM;
    if (m0 >= Lq) return;
    const int kvh = h / (heads / kv_heads);
    const int off = Lk - Lq;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const uint32_t sQ = smem_u32(smem);
    auto sK = [&](int b) { return sQ + BM * 256 + b * (2 * BN * 256); };
    auto sV = [&](int b) { return sQ + BM * 256 + b * (2 * BN * 256) + BN * 256; };

    const size_t qs = (size_t)heads * VFA_D, ks = (size_t)kv_heads * VFA_D;
    const __nv_bfloat16* qg = q + ((size_t)q_start * heads + h) * VFA_D;
    const __nv_bfloat16* kg = k + ((size_t)k_start * kv_heads + kvh) * VFA_D;
    const __nv_bfloat16* vg = v + ((size_t)k_start * kv_heads + kvh) * VFA_D;

    const int last_q = min(m0 + BM, Lq) - 1;
    const int kmax = min(Lk, last_q + off + 1);  // exclusive bound of visible keys for this CTA
    const int n_blocks = kmax > 0 ? (kmax + BN - 1) / BN : 0;

    load_tile<BM, THREADS>(sQ, qg, qs, m0, Lq, q, tid);
    if (n_blocks > 0) {
        load_tile<BN, THREADS>(sK(0), kg, ks, 0, Lk, k, tid);
        load_tile<BN, THREADS>(sV(0), vg, ks, 0, Lk, v, tid);
    }
    cp_async_commit();

    const float sl2 = scale * 1.4426950408889634f;
    float oacc[16][4];
#pragma unroll
    for (int i = 0; i < 16; ++i) oacc[i][0] = oacc[i][1] = oacc[i][2] = oacc[i][3] = 0.f;
    float mrow[2] = {-INFINITY, -INFINITY};  // running max, in scaled log2 units
    float lrow[2] = {0.f, 0.f};               // thread-partial row sums
    uint32_t qf[8][4];

    const int warp_row0 = m0 + warp * 16;
    const int row_a = warp_row0 + (lane >> 2);  // query index (within seq) of c0/c1
    const int l7 = lane & 7;
    const int hi8 = (lane >> 3) & 1;
    const int hi16 = lane >> 4;

    for (int nb = 0; nb < n_blocks; ++nb) {
        const int buf = nb & 1;
        // Data of block nb was requested one iteration ago; after the barrier every warp is done
        // with block nb-1, so its buffer (buf ^ 1) can be refilled with block nb+1.
        cp_async_wait<0>();
        __syncthreads();
        if (nb + 1 < n_blocks) {
            load_tile<BN, THREADS>(sK(buf ^ 1), kg, ks, (nb + 1) * BN, Lk, k, tid);
            load_tile<BN, THREADS>(sV(buf ^ 1), vg, ks, (nb + 1) * BN, Lk, v, tid);
            cp_async_commit();
        }

        if (nb == 0) {
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) {
                int r = warp * 16 + (lane & 15);
                ldsm_x4(qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], sQ + sw256(r, kk * 2 + hi16));
            }
        }

        const int n0 = nb * BN;
        // Warp-uniform: all keys of this block are beyond the causal horizon of this warp's rows.
        if (n0 > warp_row0 + 15 + off) continue;

        // S = Q K^T (16 x BN per warp)
        float s[NT][4];
#pragma unroll
        for (int i = 0; i < NT; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
        const uint32_t kb = sK(buf);
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
#pragma unroll
            for (int np = 0; np < BN / 16; ++np) {
                uint32_t b0, b1, b2, b3;
                int r = np * 16 + l7 + hi16 * 8;
                ldsm_x4(b0, b1, b2, b3, kb + sw256(r, kk * 2 + hi8));
                mma16816(s[2 * np], qf[kk], b0, b1);
                mma16816(s[2 * np + 1], qf[kk], b2, b3);
            }
        }

        // masking
        const bool need_mask = (n0 + BN > Lk) || (n0 + BN - 1 > warp_row0 + off);
        if (need_mask) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    int j = n0 + nt * 8 + (lane & 3) * 2 + (e & 1);
                    int i = row_a + (e >> 1) * 8;
                    if (j >= Lk || j > i + off) s[nt][e] = -INFINITY;
                }
            }
        }

        // online softmax
#pragma unroll
        for (int rr = 0; rr < 2; ++rr) {
            float mx = -INFINITY;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) mx = fmaxf(mx, fmaxf(s[nt][2 * rr], s[nt][2 * rr + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
            float mnew = fmaxf(mrow[rr], mx * sl2);
            float muse = (mnew == -INFINITY) ? 0.f : mnew;
            float alpha = ex2(mrow[rr] - muse);
            mrow[rr] = mnew;
            float sum = 0.f;
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                float p0 = ex2(fmaf(s[nt][2 * rr], sl2, -muse));
                float p1 = ex2(fmaf(s[nt][2 * rr + 1], sl2, -muse));
                s[nt][2 * rr] = p0;
                s[nt][2 * rr + 1] = p1;
                sum += p0 + p1;
            }
            lrow[rr] = lrow[rr] * alpha + sum;
#pragma unroll
            for (int dt = 0; dt < 16; ++dt) {
                oacc[dt][2 * rr] *= alpha;
                oacc[dt][2 * rr + 1] *= alpha;
            }
        }

        // O += P V
        const uint32_t vb = sV(buf);
#pragma unroll
        for (int kk = 0; kk < BN / 16; ++kk) {
            uint32_t a[4];
            a[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
            a[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
            a[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            a[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int dp = 0; dp < 8; ++dp) {
                uint32_t b0, b1, b2, b3;
                int r = kk * 16 + l7 + hi8 * 8;
                ldsm_x4_t(b0, b1, b2, b3, vb + sw256(r, dp * 2 + hi16));
                mma16816(oacc[2 * dp], a, b0, b1);
                mma16816(oacc[2 * dp + 1], a, b2, b3);
            }
        }
    }
    if (n_blocks == 0) cp_async_wait<0>();

    // epilogue
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        float l = lrow[rr];
        l += __shfl_xor_sync(0xffffffff, l, 1);
        l += __shfl_xor_sync(0xffffffff, l, 2);
        const int i = row_a + rr * 8;
        const float inv = l > 0.f ? 1.f / l : 0.f;
        if (i < Lq) {
            __nv_bfloat16* og = o + ((size_t)(q_start + i) * heads + h) * VFA_D + (lane & 3) * 2;
#pragma unroll
            for (int dt = 0; dt < 16; ++dt) {
                *reinterpret_cast<uint32_t*>(og + dt * 8) =
                    pack_bf16(oacc[dt][2 * rr] * inv, oacc[dt][2 * rr + 1] * inv);
            }
            if ((lane & 3) == 0) {
                float val = l > 0.f ? (mrow[rr] + __log2f(l)) * 0.6931471805599453f : -INFINITY;
                lse[(size_t)h * tq + q_start + i] = val;
            }
        }
    }
}
}  // namespace vfa

// BM = 128 query rows (8 warps x 16), BN = 128 keys per step, 1 CTA / SM.
extern "C" __global__ void __launch_bounds__(VFA_FWD_THREADS, 1)
    vime_flash_fwd(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                   const __nv_bfloat16* __restrict__ v, __nv_bfloat16* __restrict__ o,
                   float* __restrict__ lse, const unsigned int* __restrict__ cu_q,
                   const unsigned int* __restrict__ cu_k, int tq, int heads, int kv_heads,
                   float scale) {
    extern __shared__ __align__(128) unsigned char smem[];
    vfa::flash_fwd_impl<VFA_FWD_BM / 16, VFA_FWD_BN>(smem, q, k, v, o, lse, cu_q, cu_k, tq, heads,
                                                      kv_heads, scale);
}

// ------------------------------------------------------------------------------------------------
// delta[h*tq + t] = sum_d dO[t,h,d] * O[t,h,d]; one warp per (t, h) row.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(256)
    vime_flash_bwd_delta(const __nv_bfloat16* __restrict__ o, const __nv_bfloat16* __restrict__ dout,
                         float* __restrict__ delta, int tq, int heads) {
    const int row = blockIdx.x * 8 + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= tq * heads) return;
    const uint2 a = *reinterpret_cast<const uint2*>(o + (size_t)row * VFA_D + lane * 4);
    const uint2 b = *reinterpret_cast<const uint2*>(dout + (size_t)row * VFA_D + lane * 4);
    const __nv_bfloat162* a2 = reinterpret_cast<const __nv_bfloat162*>(&a);
    const __nv_bfloat162* b2 = reinterpret_cast<const __nv_bfloat162*>(&b);
    float2 a0 = __bfloat1622float2(a2[0]), a1 = __bfloat1622float2(a2[1]);
    float2 b0 = __bfloat1622float2(b2[0]), b1 = __bfloat1622float2(b2[1]);
    float sum = a0.x * b0.x + a0.y * b0.y + a1.x * b1.x + a1.y * b1.y;
#pragma unroll
    for (int w = 16; w > 0; w >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, w);
    if (lane == 0) {
        const int t = row / heads, h = row % heads;
        delta[(size_t)h * tq + t] = sum;
    }
}

// ------------------------------------------------------------------------------------------------
// Backward. One CTA = BN = 16*NW keys of one kv head of one sequence, NW warps x 16 keys; it loops
// over the query heads of the GQA group and the 64-row query blocks that can see its keys.
// ------------------------------------------------------------------------------------------------
namespace vfa {

template <int NW, bool DEFER>
struct BwdCfg {
    static constexpr int BM = 64, BN = 16 * NW, THREADS = 32 * NW;
    static constexpr int NDS = DEFER ? 2 : 1;                 // dS^T buffers
    static constexpr int OFF_V = BN * 256;
    static constexpr int OFF_Q = 2 * BN * 256;                // [2] x (Q tile, dO tile)
    static constexpr int OFF_DS = OFF_Q + 4 * BM * 256;       // dS^T [NDS][BN][64] bf16
    static constexpr int OFF_LSE = OFF_DS + NDS * BN * 128;   // lse [2][64], delta [2][64] f32
    static constexpr int SMEM = OFF_LSE + 4 * BM * 4;
};
static_assert(BwdCfg<VFA_BWD_BN / 16, VFA_BWD_DEFER>::SMEM == VFA_BWD_SMEM, "smem");

template <int NW, bool DEFER, int OPT = 0>
__device__ __forceinline__ void flash_bwd_impl(
    unsigned char* smem, const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
    const __nv_bfloat16* __restrict__ v, const __nv_bfloat16* __restrict__ dout,
    const float* __restrict__ lse, const float* __restrict__ delta, float* __restrict__ dq_acc,
    __nv_bfloat16* __restrict__ dk, __nv_bfloat16* __restrict__ dv,
    const unsigned int* __restrict__ cu_q, const unsigned int* __restrict__ cu_k, int tq,
    int heads, int kv_heads, float scale) {
    using C = BwdCfg<NW, DEFER>;
    constexpr int BM = C::BM, BN = C::BN, THREADS = C::THREADS;

    // Heaviest key blocks (n_block 0 sees the most queries) of every (kv head, seq) first.
    const int lin = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int hs = gridDim.y * gridDim.z;
    const int n_block = lin / hs;
    const int rest = lin % hs;
    const int kvh = rest % gridDim.y;
    const int seq = rest / gridDim.y;

    const int q_start = cu_q[seq];
    const int Lq = (int)cu_q[seq + 1] - q_start;
    const int k_start = cu_k[seq];
    const int Lk = (int)cu_k[seq + 1] - k_start;
    const int n0 = n_block * BN;
    if (n0 >= Lk) return;
    const int group = heads / kv_heads;
    const int off = Lk - Lq;

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const uint32_t sK = smem_u32(smem);
    const uint32_t sV = sK + C::OFF_V;
    auto sQ = [&](int b) { return sK + C::OFF_Q + b * (2 * BM * 256); };
    auto sdO = [&](int b) { return sK + C::OFF_Q + b * (2 * BM * 256) + BM * 256; };
    auto sdSb = [&](int b) { return sK + C::OFF_DS + (DEFER ? b * (BN * 128) : 0); };
    float* sLse = reinterpret_cast<float*>(smem + C::OFF_LSE);  // [2][64]
    float* sDel = sLse + 2 * BM;                               // [2][64]

    const size_t qs = (size_t)heads * VFA_D, ks = (size_t)kv_heads * VFA_D;
    const __nv_bfloat16* kg = k + ((size_t)k_start * kv_heads + kvh) * VFA_D;
    const __nv_bfloat16* vg = v + ((size_t)k_start * kv_heads + kvh) * VFA_D;

    // query blocks that can see keys n0..: i >= n0 - off
    const int m_min = max(0, n0 - off) / BM;
    const int m_max = (Lq + BM - 1) / BM;
    const int n_mb = max(0, m_max - m_min);
    const int n_it = n_mb * group;

    auto issue_q = [&](int it, int b) {
        const int hl = it / n_mb;
        const int mb = m_min + it % n_mb;
        const int hh = kvh * group + hl;
        const int m0 = mb * BM;
        const __nv_bfloat16* qg = q + ((size_t)q_start * heads + hh) * VFA_D;
        const __nv_bfloat16* dg = dout + ((size_t)q_start * heads + hh) * VFA_D;
        load_tile<BM, THREADS>(sQ(b), qg, qs, m0, Lq, q, tid);
        load_tile<BM, THREADS>(sdO(b), dg, qs, m0, Lq, dout, tid);
        if (tid < 2 * BM) {
            const int r = tid & 63;
            const bool ok = m0 + r < Lq;
            const size_t idx = (size_t)hh * tq + q_start + m0 + r;
            if (tid < BM)
                cp_async4(smem_u32(sLse + b * BM + r), ok ? lse + idx : lse, ok);
            else
                cp_async4(smem_u32(sDel + b * BM + r), ok ? delta + idx : delta, ok);
        }
    };

    float dka[16][4], dva[16][4];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        dka[i][0] = dka[i][1] = dka[i][2] = dka[i][3] = 0.f;
        dva[i][0] = dva[i][1] = dva[i][2] = dva[i][3] = 0.f;
    }

    if (n_it > 0) {
        load_tile<BN, THREADS>(sK, kg, ks, n0, Lk, k, tid);
        load_tile<BN, THREADS>(sV, vg, ks, n0, Lk, v, tid);
        issue_q(0, 0);
        cp_async_commit();
    }

    const float sl2 = scale * 1.4426950408889634f;
    const int l7 = lane & 7;
    const int hi8 = (lane >> 3) & 1;
    const int hi16 = lane >> 4;
    const int kw0 = n0 + warp * 16;              // first key of this warp (within seq)
    const int key_a = kw0 + (lane >> 2);         // key index (within seq) of c0/c1

    // dQ (64 queries x 128) += dS K over this CTA's BN keys, for step `st` (dS^T in `sdS`).
    // NW=4: warp w -> queries 16w..16w+15, both 64-column halves.
    // NW=8: warp w -> queries 16(w&3).., column half w>>2.
    auto do_dq = [&](int st, uint32_t sdS) {
        const int hh = kvh * group + st / n_mb;
        const int m0 = (m_min + st % n_mb) * BM;
        constexpr int NHALF = (NW == 4) ? 2 : 1;
        const int qt = warp & 3;
        const int i0 = m0 + qt * 16 + (lane >> 2);
        float* dqg = dq_acc + ((size_t)(q_start + i0) * heads + hh) * VFA_D + (lane & 3) * 2;
        const size_t rs8 = (size_t)8 * heads * VFA_D;
        // keys of this CTA that any query of this block can see: j <= m0 + BM - 1 + off
        const int kv_lim = m0 + BM + off - n0;  // number of (possibly) live keys from n0
        if constexpr (NW == 4 && (OPT & 6) != 0) {
            // OPT & 2 / 4: warp w -> all 64 queries x columns 32w..32w+31, in 2 passes of 32
            // queries (OPT & 2) or 1 pass (OPT & 4): fewer ldmatrix than the 16-query layout.
            constexpr int MT = (OPT & 4) ? 4 : 2;  // 16-query tiles per pass
#pragma unroll
            for (int pass = 0; pass < 4 / MT; ++pass) {
                float acc[MT][4][4];
#pragma unroll
                for (int a = 0; a < MT; ++a)
#pragma unroll
                    for (int b = 0; b < 4; ++b) acc[a][b][0] = acc[a][b][1] = acc[a][b][2] = acc[a][b][3] = 0.f;
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) {
                    uint32_t bf[2][4];
#pragma unroll
                    for (int dp = 0; dp < 2; ++dp)
                        ldsm_x4_t(bf[dp][0], bf[dp][1], bf[dp][2], bf[dp][3],
                                  sK + sw256(kk * 16 + l7 + hi8 * 8, warp * 4 + dp * 2 + hi16));
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        const int q16 = pass * MT + mt;
                        uint32_t qa[4];
                        ldsm_x4_t(qa[0], qa[1], qa[2], qa[3],
                                  sdS + sw128(kk * 16 + l7 + hi16 * 8, q16 * 2 + hi8));
#pragma unroll
                        for (int dp = 0; dp < 2; ++dp) {
                            mma16816(acc[mt][2 * dp], qa, bf[dp][0], bf[dp][1]);
                            mma16816(acc[mt][2 * dp + 1], qa, bf[dp][2], bf[dp][3]);
                        }
                    }
                }
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    const int q16 = pass * MT + mt;
                    const int r0 = m0 + q16 * 16 + (lane >> 2);
                    float* g = dq_acc + ((size_t)(q_start + r0) * heads + hh) * VFA_D + warp * 32 +
                               (lane & 3) * 2;
#pragma unroll
                    for (int nt = 0; nt < 4; ++nt) {
                        if (r0 < Lq) red_add_v2(g + nt * 8, acc[mt][nt][0] * scale, acc[mt][nt][1] * scale);
                        if (r0 + 8 < Lq)
                            red_add_v2(g + rs8 + nt * 8, acc[mt][nt][2] * scale, acc[mt][nt][3] * scale);
                    }
                }
            }
            return;
        }
        // OPT & 1: load the dS^T fragments once for both column halves.
        constexpr bool HOIST = (OPT & 1) && NHALF == 2;
        uint32_t dsf[HOIST ? BN / 16 : 1][4];
        if (HOIST) {
#pragma unroll
            for (int kk = 0; kk < (HOIST ? BN / 16 : 1); ++kk)
                ldsm_x4_t(dsf[kk][0], dsf[kk][1], dsf[kk][2], dsf[kk][3],
                          sdS + sw128(kk * 16 + l7 + hi16 * 8, qt * 2 + hi8));
        }
#pragma unroll
        for (int hidx = 0; hidx < NHALF; ++hidx) {
            const int half = (NW == 4) ? hidx : (warp >> 2);
            float acc[8][4];
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < BN / 16; ++kk) {
                if (NW == 4 || kk * 16 < kv_lim) {
                    uint32_t qa[4];
                    if (HOIST) {
                        qa[0] = dsf[HOIST ? kk : 0][0];
                        qa[1] = dsf[HOIST ? kk : 0][1];
                        qa[2] = dsf[HOIST ? kk : 0][2];
                        qa[3] = dsf[HOIST ? kk : 0][3];
                    } else {
                        ldsm_x4_t(qa[0], qa[1], qa[2], qa[3],
                                  sdS + sw128(kk * 16 + l7 + hi16 * 8, qt * 2 + hi8));
                    }
#pragma unroll
                    for (int dp = 0; dp < 4; ++dp) {
                        uint32_t b0, b1, b2, b3;
                        ldsm_x4_t(b0, b1, b2, b3,
                                  sK + sw256(kk * 16 + l7 + hi8 * 8, half * 8 + dp * 2 + hi16));
                        mma16816(acc[2 * dp], qa, b0, b1);
                        mma16816(acc[2 * dp + 1], qa, b2, b3);
                    }
                }
            }
#pragma unroll
            for (int dt = 0; dt < 8; ++dt) {
                const int col = half * 64 + dt * 8;
                if (i0 < Lq) red_add_v2(dqg + col, acc[dt][0] * scale, acc[dt][1] * scale);
                if (i0 + 8 < Lq) red_add_v2(dqg + rs8 + col, acc[dt][2] * scale, acc[dt][3] * scale);
            }
        }
    };

    for (int it = 0; it < n_it; ++it) {
        const int buf = it & 1;
        // Data of iteration it was requested one iteration ago. After the barrier every warp has
        // finished iteration it-1 (its dS^T writes, and for !DEFER its dQ), so buffer buf^1 can
        // be refilled; with DEFER, dS^T of step it-1 (buffer buf^1) is complete and is consumed
        // now, while dS^T buffer buf (last read in step it-1) is rewritten below.
        cp_async_wait<0>();
        __syncthreads();
        if (it + 1 < n_it) {
            issue_q(it + 1, buf ^ 1);
            cp_async_commit();
        }
        if (DEFER && it > 0) do_dq(it - 1, sdSb(buf ^ 1));
        const uint32_t sdS = sdSb(buf);

        const int m0 = (m_min + it % n_mb) * BM;
        const uint32_t qb = sQ(buf), db = sdO(buf);
        const float* lb = sLse + buf * BM;
        const float* deb = sDel + buf * BM;

        const int rk = warp * 16 + (lane >> 2);  // dS^T smem row of c0/c1
        // Warp-uniform: no query of this block sees any key of this warp (or keys past the end).
        // (With BN = BM = 64 this cannot happen for NW = 4; the test only exists for NW > 4.)
        const bool dead = (NW > 4) && ((kw0 > m0 + BM - 1 + off) || (kw0 >= Lk));
        if (dead) {
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sdS + sw128(rk, nt) + (lane & 3) * 4),
                             "r"(0u));
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sdS + sw128(rk + 8, nt) + (lane & 3) * 4),
                             "r"(0u));
            }
        } else {
            // S^T = K Q^T : 16 keys x 64 queries per warp
            float s[8][4], dp_[8][4];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
                dp_[i][0] = dp_[i][1] = dp_[i][2] = dp_[i][3] = 0.f;
            }
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) {
                uint32_t a[4];
                ldsm_x4(a[0], a[1], a[2], a[3], sK + sw256(warp * 16 + (lane & 15), kk * 2 + hi16));
#pragma unroll
                for (int np = 0; np < 4; ++np) {
                    uint32_t b0, b1, b2, b3;
                    ldsm_x4(b0, b1, b2, b3, qb + sw256(np * 16 + l7 + hi16 * 8, kk * 2 + hi8));
                    mma16816(s[2 * np], a, b0, b1);
                    mma16816(s[2 * np + 1], a, b2, b3);
                }
            }

            // P^T = exp(scale * S^T - lse)
            const bool need_mask = (n0 + BN > Lk) || (m0 + BM > Lq) || (n0 + BN - 1 > m0 + off);
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int mc = nt * 8 + (lane & 3) * 2 + (e & 1);
                    float lv = lb[mc];
                    lv = (lv == -INFINITY) ? INFINITY : lv * 1.4426950408889634f;
                    s[nt][e] = ex2(fmaf(s[nt][e], sl2, -lv));
                }
            }
            if (need_mask) {
#pragma unroll
                for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int i = m0 + nt * 8 + (lane & 3) * 2 + (e & 1);
                        const int j = key_a + (e >> 1) * 8;
                        if (j >= Lk || i >= Lq || j > i + off) s[nt][e] = 0.f;
                    }
                }
            }

            // dV += P^T dO
            uint32_t pa[4][4];
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                pa[kk][0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
                pa[kk][1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
                pa[kk][2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                pa[kk][3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
                for (int dp = 0; dp < 8; ++dp) {
                    uint32_t b0, b1, b2, b3;
                    ldsm_x4_t(b0, b1, b2, b3, db + sw256(kk * 16 + l7 + hi8 * 8, dp * 2 + hi16));
                    mma16816(dva[2 * dp], pa[kk], b0, b1);
                    mma16816(dva[2 * dp + 1], pa[kk], b2, b3);
                }
            }

            // dP^T = V dO^T
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) {
                uint32_t a[4];
                ldsm_x4(a[0], a[1], a[2], a[3], sV + sw256(warp * 16 + (lane & 15), kk * 2 + hi16));
#pragma unroll
                for (int np = 0; np < 4; ++np) {
                    uint32_t b0, b1, b2, b3;
                    ldsm_x4(b0, b1, b2, b3, db + sw256(np * 16 + l7 + hi16 * 8, kk * 2 + hi8));
                    mma16816(dp_[2 * np], a, b0, b1);
                    mma16816(dp_[2 * np + 1], a, b2, b3);
                }
            }

            // dS^T = P^T * (dP^T - delta); write bf16 dS^T to smem; dK += dS^T Q
            uint32_t da[4][4];
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
                const int mc = nt * 8 + (lane & 3) * 2;
                const float d0 = deb[mc], d1 = deb[mc + 1];
                const float x0 = s[nt][0] * (dp_[nt][0] - d0);
                const float x1 = s[nt][1] * (dp_[nt][1] - d1);
                const float x2 = s[nt][2] * (dp_[nt][2] - d0);
                const float x3 = s[nt][3] * (dp_[nt][3] - d1);
                const uint32_t u01 = pack_bf16(x0, x1), u23 = pack_bf16(x2, x3);
                da[nt >> 1][(nt & 1) * 2 + 0] = u01;
                da[nt >> 1][(nt & 1) * 2 + 1] = u23;
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sdS + sw128(rk, nt) + (lane & 3) * 4),
                             "r"(u01));
                asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sdS + sw128(rk + 8, nt) + (lane & 3) * 4),
                             "r"(u23));
            }
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
                for (int dp = 0; dp < 8; ++dp) {
                    uint32_t b0, b1, b2, b3;
                    ldsm_x4_t(b0, b1, b2, b3, qb + sw256(kk * 16 + l7 + hi8 * 8, dp * 2 + hi16));
                    mma16816(dka[2 * dp], da[kk], b0, b1);
                    mma16816(dka[2 * dp + 1], da[kk], b2, b3);
                }
            }
        }
        if (!DEFER) {
            __syncthreads();
            do_dq(it, sdS);
        }
    }
    if (DEFER && n_it > 0) {
        __syncthreads();
        do_dq(n_it - 1, sdSb((n_it - 1) & 1));
    }

    // epilogue: write dK (scaled) and dV for keys < Lk (zeros if no query sees them)
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {
        const int j = key_a + rr * 8;
        if (j < Lk) {
            const size_t base = ((size_t)(k_start + j) * kv_heads + kvh) * VFA_D + (lane & 3) * 2;
#pragma unroll
            for (int dt = 0; dt < 16; ++dt) {
                *reinterpret_cast<uint32_t*>(dk + base + dt * 8) =
                    pack_bf16(dka[dt][2 * rr] * scale, dka[dt][2 * rr + 1] * scale);
                *reinterpret_cast<uint32_t*>(dv + base + dt * 8) =
                    pack_bf16(dva[dt][2 * rr], dva[dt][2 * rr + 1]);
            }
        }
    }
}

}  // namespace vfa

#define VFA_BWD_ARGS                                                                               \
    const __nv_bfloat16 *__restrict__ q, const __nv_bfloat16 *__restrict__ k,                      \
        const __nv_bfloat16 *__restrict__ v, const __nv_bfloat16 *__restrict__ dout,               \
        const float *__restrict__ lse, const float *__restrict__ delta, float *__restrict__ dq_acc, \
        __nv_bfloat16 *__restrict__ dk, __nv_bfloat16 *__restrict__ dv,                            \
        const unsigned int *__restrict__ cu_q, const unsigned int *__restrict__ cu_k, int tq,      \
        int tk, int heads, int kv_heads, float scale

// BN = 64 keys (4 warps x 16), BM = 64 queries per step, 2 CTAs / SM.
extern "C" __global__ void __launch_bounds__(VFA_BWD_THREADS, VFA_BWD_MINB) vime_flash_bwd(VFA_BWD_ARGS) {
    extern __shared__ __align__(128) unsigned char smem[];
    (void)tk;
    vfa::flash_bwd_impl<VFA_BWD_BN / 16, (bool)VFA_BWD_DEFER, VFA_BWD_OPT>(smem, q, k, v, dout, lse, delta, dq_acc, dk, dv, cu_q, cu_k, tq, heads,
                           kv_heads, scale);
}

// ------------------------------------------------------------------------------------------------
// dq[i] = bf16(dq_acc[i]); n is a multiple of 4 (it is Tq*H*128).
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void __launch_bounds__(256)
    vime_flash_dq_convert(const float* __restrict__ dq_acc, __nv_bfloat16* __restrict__ dq, int n) {
    const int i = (blockIdx.x * 256 + threadIdx.x) * 4;
    if (i + 3 < n) {
        const float4 x = *reinterpret_cast<const float4*>(dq_acc + i);
        uint2 r;
        r.x = vfa::pack_bf16(x.x, x.y);
        r.y = vfa::pack_bf16(x.z, x.w);
        *reinterpret_cast<uint2*>(dq + i) = r;
    } else {
        for (int t = i; t < n; ++t) dq[t] = __float2bfloat16(dq_acc[t]);
    }
}
