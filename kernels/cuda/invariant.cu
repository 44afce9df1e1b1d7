// invariant.cu -- the batch-invariant kernels of `--true-on-policy-mode`: a GEMM and a causal
// attention whose every output element is computed by the same instructions in the same order
// whatever the batch around it (rows, sequences, their count and lengths). The trainer's pass over
// a whole packed sequence and the built-in engine's prefill and one-token decode steps run these
// same kernels, so their bf16 activations, and so the log-probs, agree bit for bit.
//
// Why not cuBLAS and the flash/decode kernels: cuBLAS picks its kernel (tile, split-K) by the
// GEMM's M, and a 1-row decode GEMM then sums K in another order than the 4096-row training GEMM
// (measured on an H200: o_proj at K 4096 differs at M 1 and 8, down_proj at K 9728 at every M);
// the flash kernel tiles 128 queries against 64 keys with tensor cores, the decode kernel splits
// the keys over blocks, and the two reduce a row in different orders.
//
// vime_bi_gemm: Y[M, N] = X[M, K] . W[N, K]^T, bf16 in, f32 accumulation, bf16 or f32 out.
//   One 64 x 64 output tile per block of 4 warps (each 32 x 32: 2 x 2 wmma 16x16x16 fragments),
//   K in steps of 32 through two shared-memory stages (cp.async loads the next step's tiles while
//   this step multiplies), each split from its start up. An element's value depends
//   only on its row of X, its row of W and K: the same fragment position (m % 16, n % 16) and the
//   same sequence of mma instructions for every M, every row offset and every N-chunk that starts
//   at a multiple of 16. Rows and columns past M, N and K are loaded as zeros. Split-K: grid.z
//   splits of k_per_split (a multiple of 32) write f32 partials that vime_bi_gemm_reduce adds in
//   split order; the caller picks the split count from (N, K) alone (a decode GEMM of few rows
//   needs them to fill the GPU), so it too is the same for every M.
//
// vime_bi_attn: causal GQA attention, head_dim 128, bf16 q/k/v/out, f32 softmax; the flash
//   kernel's layouts (q [Tq, H, 128], k/v [Tk, Hkv, 128], cu_seqlens_q/k, bottom-right causal mask)
//   and its log-sum-exp ([H, Tq] f32, natural log), so the flash backward runs on its output.
//   Grid (max_lq, Hkv, sequences), block 32 x G (G = H / Hkv query heads, one warp each). Query i
//   of a sequence sees n = i + (Lk - Lq) + 1 keys, read in chunks of 32 from key 0 up; lane j
//   scores key j of the chunk (a sequential 128-term fma dot), the chunk's max and sum are
//   butterfly reductions, then the running max / sum / output rescale and each lane accumulates
//   its 4 output dims over the chunk's keys in order. A warp's arithmetic depends on q, on its
//   keys and values and on n only.
#include <cuda_bf16.h>
#include <mma.h>
#include <stdint.h>

using bf16 = __nv_bfloat16;

#define BI_BM 64
#define BI_BN 64
#define BI_BK 32
#define BI_LDS (BI_BK + 8)   // smem row stride (elements): wmma wants a multiple of 8
#define BI_LDC (BI_BN + 4)   // f32 staging stride: a multiple of 4

namespace bi {

// Copies 16 bytes global -> shared without blocking (cp.async, sm80+); `bytes` 0 writes zeros.
__device__ __forceinline__ void cp16(void* smem, const void* g, int bytes) {
    const unsigned sp = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(sp), "l"(g), "r"(bytes));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Starts loading a 64 x 32 tile (rows r0.., cols k0..) of a row-major [rows, K] bf16 matrix into
// smem, zeros outside: 128 threads, two 16-byte chunks each, by cp.async where a chunk is whole
// and aligned, else by plain stores. `kend`: the end of this split's K range (columns at or past
// it load as zeros); `K`: the row stride.
__device__ __forceinline__ void load_tile(bf16 (*dst)[BI_LDS], const bf16* __restrict__ src, int rows, int kend,
                                          int K, int r0, int k0) {
    const int t = threadIdx.x;
    const int r = t >> 1;            // 0..63
    const int c = (t & 1) * 16;      // 0 or 16
    const int gr = r0 + r;
    const bf16 zero = __float2bfloat16(0.f);
    const bool vec = (K % 8 == 0) && ((reinterpret_cast<uintptr_t>(src) & 15) == 0);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int gc = k0 + c + h * 8;
        bf16* d = &dst[r][c + h * 8];
        if (vec && (gr >= rows || gc >= kend)) {
            cp16(d, src, 0);
        } else if (vec && gc + 8 <= kend) {
            cp16(d, src + (size_t)gr * K + gc, 16);
        } else {
#pragma unroll
            for (int e = 0; e < 8; ++e) {
                d[e] = (gr < rows && gc + e < kend) ? src[(size_t)gr * K + gc + e] : zero;
            }
        }
    }
}

}  // namespace bi

extern "C" __global__ void __launch_bounds__(128)
vime_bi_gemm(const bf16* __restrict__ x, const bf16* __restrict__ w, void* __restrict__ y, int M, int N, int K,
             int ldy, int f32_out, int k_per_split, float* __restrict__ part) {
    using namespace nvcuda;
    // Two stages: the next K-step's tiles load while this one's multiply.
    __shared__ __align__(32) bf16 xs[2][BI_BM][BI_LDS];
    __shared__ __align__(32) bf16 ws[2][BI_BN][BI_LDS];
    __shared__ __align__(32) float cs[BI_BM][BI_LDC];
    const int n0 = blockIdx.x * BI_BN, m0 = blockIdx.y * BI_BM;
    const int warp = threadIdx.x >> 5;
    const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.f);
    // Split blockIdx.z of gridDim.z covers K range [kb, ke); one split writes y directly.
    const int kb = blockIdx.z * k_per_split, ke = min(K, kb + k_per_split);
    if (kb < ke) {
        bi::load_tile(xs[0], x, M, ke, K, m0, kb);
        bi::load_tile(ws[0], w, N, ke, K, n0, kb);
    }
    bi::cp_commit();
    int stage = 0;
    for (int k0 = kb; k0 < ke; k0 += BI_BK, stage ^= 1) {
        if (k0 + BI_BK < ke) {
            bi::load_tile(xs[stage ^ 1], x, M, ke, K, m0, k0 + BI_BK);
            bi::load_tile(ws[stage ^ 1], w, N, ke, K, n0, k0 + BI_BK);
            bi::cp_commit();
            bi::cp_wait<1>();
        } else {
            bi::cp_wait<0>();
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < BI_BK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major> a[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major> b[2];
#pragma unroll
            for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(a[i], &xs[stage][wm + i * 16][kk], BI_LDS);
#pragma unroll
            for (int j = 0; j < 2; ++j) wmma::load_matrix_sync(b[j], &ws[stage][wn + j * 16][kk], BI_LDS);
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j)
            wmma::store_matrix_sync(&cs[wm + i * 16][wn + j * 16], acc[i][j], BI_LDC, wmma::mem_row_major);
    __syncthreads();
    for (int e = threadIdx.x; e < BI_BM * BI_BN; e += blockDim.x) {
        const int r = e / BI_BN, c = e % BI_BN;
        const int gm = m0 + r, gn = n0 + c;
        if (gm < M && gn < N) {
            if (gridDim.z > 1) {
                part[((size_t)blockIdx.z * M + gm) * N + gn] = cs[r][c];
            } else if (f32_out) {
                reinterpret_cast<float*>(y)[(size_t)gm * ldy + gn] = cs[r][c];
            } else {
                reinterpret_cast<bf16*>(y)[(size_t)gm * ldy + gn] = __float2bfloat16(cs[r][c]);
            }
        }
    }
}

// The splits' partial sums of vime_bi_gemm added in split order, then rounded once.
extern "C" __global__ void vime_bi_gemm_reduce(const float* __restrict__ part, void* __restrict__ y, int M, int N,
                                               int splits, int ldy, int f32_out) {
    const size_t mn = (size_t)M * N;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < mn; e += (size_t)gridDim.x * blockDim.x) {
        float acc = part[e];
        for (int s = 1; s < splits; ++s) acc += part[(size_t)s * mn + e];
        const size_t gm = e / N, gn = e % N;
        if (f32_out) {
            reinterpret_cast<float*>(y)[gm * ldy + gn] = acc;
        } else {
            reinterpret_cast<bf16*>(y)[gm * ldy + gn] = __float2bfloat16(acc);
        }
    }
}

#define BI_D 128
#define BI_KC 32
#define BI_MAXG 8

extern "C" __global__ void __launch_bounds__(32 * BI_MAXG)
vime_bi_attn(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
             bf16* __restrict__ out, float* __restrict__ lse, const unsigned* __restrict__ cu_q,
             const unsigned* __restrict__ cu_k, int tq, int h, int hkv, float scale) {
    __shared__ float qs[BI_MAXG][BI_D];
    __shared__ bf16 ks[BI_KC][BI_D + 2];  // +2: lane j reads row j, a bank of its own
    __shared__ __align__(16) bf16 vs[BI_KC][BI_D];
    const int s = blockIdx.z, kvh = blockIdx.y, i = blockIdx.x;
    const int q0 = cu_q[s], lq = (int)cu_q[s + 1] - q0;
    if (i >= lq) return;
    const int k0 = cu_k[s], lk = (int)cu_k[s + 1] - k0;
    const int n = i + (lk - lq) + 1;
    const int G = h / hkv;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int head = kvh * G + warp;
    const int row = q0 + i;
    const bf16* qrow = q + ((size_t)row * h + head) * BI_D;
    for (int d = lane; d < BI_D; d += 32) qs[warp][d] = __bfloat162float(qrow[d]);
    float m = -INFINITY, l = 0.f;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    const int nthreads = blockDim.x;
    for (int c = 0; c < n; c += BI_KC) {
        const int nc = min(BI_KC, n - c);
        __syncthreads();
        // 32 keys x 128 dims of K and V, as bf16 pairs.
        for (int e = threadIdx.x; e < BI_KC * (BI_D / 2); e += nthreads) {
            const int r = e / (BI_D / 2), p = (e % (BI_D / 2)) * 2;
            __nv_bfloat162 kv2 = __floats2bfloat162_rn(0.f, 0.f), vv2 = kv2;
            if (r < nc) {
                const size_t at = ((size_t)(k0 + c + r) * hkv + kvh) * BI_D + p;
                kv2 = *reinterpret_cast<const __nv_bfloat162*>(k + at);
                vv2 = *reinterpret_cast<const __nv_bfloat162*>(v + at);
            }
            *reinterpret_cast<__nv_bfloat162*>(&ks[r][p]) = kv2;
            *reinterpret_cast<__nv_bfloat162*>(&vs[r][p]) = vv2;
        }
        __syncthreads();
        float sc = -INFINITY;
        if (lane < nc) {
            float dot = 0.f;
#pragma unroll 16
            for (int d = 0; d < BI_D; ++d) dot = fmaf(qs[warp][d], __bfloat162float(ks[lane][d]), dot);
            sc = dot * scale;
        }
        float cm = sc;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) cm = fmaxf(cm, __shfl_xor_sync(0xffffffffu, cm, o));
        const float mn = fmaxf(m, cm);
        const float p = lane < nc ? expf(sc - mn) : 0.f;
        const float corr = (m == -INFINITY) ? 0.f : expf(m - mn);
        float ps = p;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
        l = l * corr + ps;
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[e] *= corr;
        for (int j = 0; j < nc; ++j) {
            const float pj = __shfl_sync(0xffffffffu, p, j);
            const __nv_bfloat162* vr = reinterpret_cast<const __nv_bfloat162*>(&vs[j][lane * 4]);
            const float2 a = __bfloat1622float2(vr[0]), b = __bfloat1622float2(vr[1]);
            acc[0] = fmaf(pj, a.x, acc[0]);
            acc[1] = fmaf(pj, a.y, acc[1]);
            acc[2] = fmaf(pj, b.x, acc[2]);
            acc[3] = fmaf(pj, b.y, acc[3]);
        }
        m = mn;
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    bf16* orow = out + ((size_t)row * h + head) * BI_D + lane * 4;
#pragma unroll
    for (int e = 0; e < 4; ++e) orow[e] = __float2bfloat16(acc[e] * inv);
    if (lane == 0) lse[(size_t)head * tq + row] = l > 0.f ? m + logf(l) : -INFINITY;
}
