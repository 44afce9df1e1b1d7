// vime's fused CUDA kernels for everything but attention (flash_attn.cu holds that): RMSNorm,
// RoPE, SwiGLU, the LM head's log-prob/entropy pieces and AdamW. Compiled to PTX by
// kernels/build.rs behind the `cuda` feature and loaded by kernels/src/cuda.rs.
//
// Contract (the same as the CPU kernels in kernels/src/*.rs): bf16 in and out, every statistic,
// reduction and transcendental in f32, one rounding on output. The CPU kernels are the reference
// (scripts/gpu/check_kernels.sh holds each kernel to them, forward and backward).
//
// Launch shapes are chosen on the Rust side (kernels/src/cuda.rs); each kernel says what it
// expects. Pointers to packed outputs (`[dx ++ dw]` and the like) arrive already offset.
#include <cuda_bf16.h>
#include <stdint.h>

#include "swiglu.cuh"

typedef __nv_bfloat16 bf16;

#define FULL_MASK 0xffffffffu

__device__ __forceinline__ bool aligned16(const void* p) { return ((uintptr_t)p & 15) == 0; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `scratch` holds 33 floats; the call ends with a barrier so scratch can be reused at once.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float t = lane < nwarps ? scratch[lane] : 0.f;
        t = warp_sum(t);
        if (lane == 0) scratch[32] = t;
    }
    __syncthreads();
    float r = scratch[32];
    __syncthreads();
    return r;
}

// ------------------------------------------------------------------------------------------------
// RMSNorm: y = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps) (computed as the CPU kernel does:
// 1 / sqrt(ss / d + eps)). One block per row, rows strided over the grid; each thread keeps its
// columns (c = tid + i * blockDim) in registers, so d <= RMS_MAXC * blockDim.
// ------------------------------------------------------------------------------------------------
#define RMS_MAXC 16

extern "C" __global__ void vime_rmsnorm_fwd(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                            bf16* __restrict__ y, int rows, int d, float eps) {
    __shared__ float scratch[33];
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const bf16* xr = x + (size_t)r * d;
        float xv[RMS_MAXC];
        float ss = 0.f;
#pragma unroll
        for (int i = 0; i < RMS_MAXC; ++i) {
            int c = threadIdx.x + i * blockDim.x;
            xv[i] = c < d ? __bfloat162float(xr[c]) : 0.f;
            ss += xv[i] * xv[i];
        }
        ss = block_sum(ss, scratch);
        const float rstd = 1.f / sqrtf(ss / (float)d + eps);
        bf16* yr = y + (size_t)r * d;
#pragma unroll
        for (int i = 0; i < RMS_MAXC; ++i) {
            int c = threadIdx.x + i * blockDim.x;
            if (c < d) yr[c] = __float2bfloat16(xv[i] * rstd * __bfloat162float(w[c]));
        }
    }
}

// dx = rstd * (g*w - xhat * mean(g*w*xhat)), xhat = x * rstd; block b writes its partial
// dw[c] = sum over its rows of g*xhat to dw_part[b * d + c] (f32), summed by vime_colsum2_bf16.
extern "C" __global__ void vime_rmsnorm_bwd(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                            const bf16* __restrict__ g, bf16* __restrict__ dx,
                                            float* __restrict__ dw_part, int rows, int d, float eps) {
    __shared__ float scratch[33];
    float dwv[RMS_MAXC];
    float wv[RMS_MAXC];
#pragma unroll
    for (int i = 0; i < RMS_MAXC; ++i) {
        int c = threadIdx.x + i * blockDim.x;
        dwv[i] = 0.f;
        wv[i] = c < d ? __bfloat162float(w[c]) : 0.f;
    }
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const bf16* xr = x + (size_t)r * d;
        const bf16* gr = g + (size_t)r * d;
        float xv[RMS_MAXC], gv[RMS_MAXC];
        float ss = 0.f;
#pragma unroll
        for (int i = 0; i < RMS_MAXC; ++i) {
            int c = threadIdx.x + i * blockDim.x;
            xv[i] = c < d ? __bfloat162float(xr[c]) : 0.f;
            gv[i] = c < d ? __bfloat162float(gr[c]) : 0.f;
            ss += xv[i] * xv[i];
        }
        ss = block_sum(ss, scratch);
        const float rstd = 1.f / sqrtf(ss / (float)d + eps);
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < RMS_MAXC; ++i) {
            float xhat = xv[i] * rstd;
            dwv[i] += gv[i] * xhat;
            dot += gv[i] * wv[i] * xhat;
        }
        dot = block_sum(dot, scratch);
        const float mean = dot / (float)d;
        bf16* dxr = dx + (size_t)r * d;
#pragma unroll
        for (int i = 0; i < RMS_MAXC; ++i) {
            int c = threadIdx.x + i * blockDim.x;
            if (c < d) dxr[c] = __float2bfloat16(rstd * (gv[i] * wv[i] - xv[i] * rstd * mean));
        }
    }
#pragma unroll
    for (int i = 0; i < RMS_MAXC; ++i) {
        int c = threadIdx.x + i * blockDim.x;
        if (c < d) dw_part[(size_t)blockIdx.x * d + c] = dwv[i];
    }
}

// Narrow rows (d <= 32 * RMSW_MAXC, e.g. the per-head q/k norms with d = 128): one warp per row,
// 8 rows per block, rows strided over the grid; no block-wide barriers per row. The backward's dw
// partials are reduced over the block's warps in shared memory (fixed order) and written per
// block, as in the wide kernels.
#define RMSW_MAXC 8
#define RMSW_WARPS 8

extern "C" __global__ void vime_rmsnorm_fwd_warp(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                                 bf16* __restrict__ y, int rows, int d, float eps) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int r = blockIdx.x * RMSW_WARPS + warp; r < rows; r += gridDim.x * RMSW_WARPS) {
        const bf16* xr = x + (size_t)r * d;
        float xv[RMSW_MAXC];
        float ss = 0.f;
#pragma unroll
        for (int i = 0; i < RMSW_MAXC; ++i) {
            int c = lane + 32 * i;
            xv[i] = c < d ? __bfloat162float(xr[c]) : 0.f;
            ss += xv[i] * xv[i];
        }
        ss = warp_sum(ss);
        const float rstd = 1.f / sqrtf(ss / (float)d + eps);
        bf16* yr = y + (size_t)r * d;
#pragma unroll
        for (int i = 0; i < RMSW_MAXC; ++i) {
            int c = lane + 32 * i;
            if (c < d) yr[c] = __float2bfloat16(xv[i] * rstd * __bfloat162float(w[c]));
        }
    }
}

extern "C" __global__ void vime_rmsnorm_bwd_warp(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                                 const bf16* __restrict__ g, bf16* __restrict__ dx,
                                                 float* __restrict__ dw_part, int rows, int d, float eps) {
    __shared__ float red[RMSW_WARPS][32 * RMSW_MAXC];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float dwv[RMSW_MAXC], wv[RMSW_MAXC];
#pragma unroll
    for (int i = 0; i < RMSW_MAXC; ++i) {
        int c = lane + 32 * i;
        dwv[i] = 0.f;
        wv[i] = c < d ? __bfloat162float(w[c]) : 0.f;
    }
    for (int r = blockIdx.x * RMSW_WARPS + warp; r < rows; r += gridDim.x * RMSW_WARPS) {
        const bf16* xr = x + (size_t)r * d;
        const bf16* gr = g + (size_t)r * d;
        float xv[RMSW_MAXC], gv[RMSW_MAXC];
        float ss = 0.f;
#pragma unroll
        for (int i = 0; i < RMSW_MAXC; ++i) {
            int c = lane + 32 * i;
            xv[i] = c < d ? __bfloat162float(xr[c]) : 0.f;
            gv[i] = c < d ? __bfloat162float(gr[c]) : 0.f;
            ss += xv[i] * xv[i];
        }
        ss = warp_sum(ss);
        const float rstd = 1.f / sqrtf(ss / (float)d + eps);
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < RMSW_MAXC; ++i) {
            float xhat = xv[i] * rstd;
            dwv[i] += gv[i] * xhat;
            dot += gv[i] * wv[i] * xhat;
        }
        dot = warp_sum(dot);
        const float mean = dot / (float)d;
        bf16* dxr = dx + (size_t)r * d;
#pragma unroll
        for (int i = 0; i < RMSW_MAXC; ++i) {
            int c = lane + 32 * i;
            if (c < d) dxr[c] = __float2bfloat16(rstd * (gv[i] * wv[i] - xv[i] * rstd * mean));
        }
    }
#pragma unroll
    for (int i = 0; i < RMSW_MAXC; ++i) red[warp][lane + 32 * i] = dwv[i];
    __syncthreads();
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < RMSW_WARPS; ++k) s += red[k][c];
        dw_part[(size_t)blockIdx.x * d + c] = s;
    }
}

// ------------------------------------------------------------------------------------------------
// RMSNorm, 16-byte accesses (d % 8 == 0, every row pointer 16-byte aligned): each thread holds up
// to RMSV_MAXV chunks of 8 columns (chunk c = tid + i * blockDim) in registers. The math and its
// order per element are the wide kernels' above (the sum of squares is reduced in a different
// order, so the last bit of rstd may differ from them). RMSV_MAXV = 1 (rows up to 8192 wide, every
// Qwen3 hidden size): at 4 the backward needed 188 registers, one 320-thread block per SM.
//   fwd: with r != null, s = bf16(x + r) is written to s_out and normalised (the residual add
//        fused into the norm that follows it: x2 = x + o, h2 = rms(x2)); else s = x.
//   bwd: with res != null, dx = bf16(res + bf16(norm'(..))) (the residual's gradient added in the
//        same pass: the add's value exactly, each term rounded to bf16 first).
// ------------------------------------------------------------------------------------------------
#define RMSV_MAXV 1

__device__ __forceinline__ void unpack8(const uint4& u, float* f) {
    const bf16* h = reinterpret_cast<const bf16*>(&u);
#pragma unroll
    for (int k = 0; k < 8; ++k) f[k] = __bfloat162float(h[k]);
}

__device__ __forceinline__ uint4 pack8(const float* f) {
    uint4 u;
    bf16* h = reinterpret_cast<bf16*>(&u);
#pragma unroll
    for (int k = 0; k < 8; ++k) h[k] = __float2bfloat16(f[k]);
    return u;
}

extern "C" __global__ void vime_rmsnorm_fwd_v8(const bf16* __restrict__ x, const bf16* __restrict__ r,
                                               const bf16* __restrict__ w, bf16* __restrict__ s_out,
                                               bf16* __restrict__ y, int rows, int d, float eps) {
    __shared__ float scratch[33];
    const int nv = d >> 3;
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const size_t off = (size_t)row * d;
        const uint4* xr = reinterpret_cast<const uint4*>(x + off);
        const uint4* rr = reinterpret_cast<const uint4*>(r + off);
        uint4* sr = reinterpret_cast<uint4*>(s_out + off);
        float v[RMSV_MAXV][8];
        float ss = 0.f;
#pragma unroll
        for (int i = 0; i < RMSV_MAXV; ++i) {
            const int c = threadIdx.x + i * blockDim.x;
            if (c < nv) {
                unpack8(xr[c], v[i]);
                if (r) {
                    float b[8];
                    unpack8(rr[c], b);
#pragma unroll
                    for (int k = 0; k < 8; ++k) v[i][k] = __bfloat162float(__float2bfloat16(v[i][k] + b[k]));
                    sr[c] = pack8(v[i]);
                }
#pragma unroll
                for (int k = 0; k < 8; ++k) ss += v[i][k] * v[i][k];
            }
        }
        ss = block_sum(ss, scratch);
        const float rstd = 1.f / sqrtf(ss / (float)d + eps);
        uint4* yr = reinterpret_cast<uint4*>(y + off);
        const uint4* wr = reinterpret_cast<const uint4*>(w);
#pragma unroll
        for (int i = 0; i < RMSV_MAXV; ++i) {
            const int c = threadIdx.x + i * blockDim.x;
            if (c < nv) {
                float wv[8], o[8];
                unpack8(wr[c], wv);
#pragma unroll
                for (int k = 0; k < 8; ++k) o[k] = v[i][k] * rstd * wv[k];
                yr[c] = pack8(o);
            }
        }
    }
}

// The backward prefetches: the next row's x, g and residual gradient are loaded (as raw 16-byte
// vectors) before this row's two block reductions, so their memory latency overlaps the barriers
// instead of following them. Each block still takes rows blockIdx.x, + gridDim.x, ... in order
// and each element's expressions are unchanged, so dx and the dw partials keep their bits.
extern "C" __global__ void __launch_bounds__(1024) vime_rmsnorm_bwd_v8(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                               const bf16* __restrict__ g, const bf16* __restrict__ res,
                                               bf16* __restrict__ dx, float* __restrict__ dw_part, int rows,
                                               int d, float eps) {
    __shared__ float scratch[33];
    const int nv = d >> 3;
    float dwv[RMSV_MAXV][8], wv[RMSV_MAXV][8];
    const uint4* wr = reinterpret_cast<const uint4*>(w);
#pragma unroll
    for (int i = 0; i < RMSV_MAXV; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
#pragma unroll
        for (int k = 0; k < 8; ++k) dwv[i][k] = 0.f;
        if (c < nv)
            unpack8(wr[c], wv[i]);
        else
#pragma unroll
            for (int k = 0; k < 8; ++k) wv[i][k] = 0.f;
    }
    // The loaded (not yet unpacked) vectors of the row about to be processed.
    uint4 px[RMSV_MAXV], pg[RMSV_MAXV], pr[RMSV_MAXV];
    const auto fetch = [&](int row) {
        const size_t off = (size_t)row * d;
#pragma unroll
        for (int i = 0; i < RMSV_MAXV; ++i) {
            const int c = threadIdx.x + i * blockDim.x;
            if (c < nv) {
                px[i] = reinterpret_cast<const uint4*>(x + off)[c];
                pg[i] = reinterpret_cast<const uint4*>(g + off)[c];
                if (res) pr[i] = reinterpret_cast<const uint4*>(res + off)[c];
            }
        }
    };
    if (blockIdx.x < rows) fetch(blockIdx.x);
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        const size_t off = (size_t)row * d;
        float xv[RMSV_MAXV][8], gv[RMSV_MAXV][8];
        uint4 rv[RMSV_MAXV];
        float ss = 0.f;
#pragma unroll
        for (int i = 0; i < RMSV_MAXV; ++i) {
            const int c = threadIdx.x + i * blockDim.x;
            if (c < nv) {
                unpack8(px[i], xv[i]);
                unpack8(pg[i], gv[i]);
                if (res) rv[i] = pr[i];
            } else {
#pragma unroll
                for (int k = 0; k < 8; ++k) xv[i][k] = gv[i][k] = 0.f;
            }
#pragma unroll
            for (int k = 0; k < 8; ++k) ss += xv[i][k] * xv[i][k];
        }
        if (row + (int)gridDim.x < rows) fetch(row + gridDim.x);
        ss = block_sum(ss, scratch);
        const float rstd = 1.f / sqrtf(ss / (float)d + eps);
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < RMSV_MAXV; ++i)
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const float xhat = xv[i][k] * rstd;
                dwv[i][k] += gv[i][k] * xhat;
                dot += gv[i][k] * wv[i][k] * xhat;
            }
        dot = block_sum(dot, scratch);
        const float mean = dot / (float)d;
        uint4* dxr = reinterpret_cast<uint4*>(dx + off);
#pragma unroll
        for (int i = 0; i < RMSV_MAXV; ++i) {
            const int c = threadIdx.x + i * blockDim.x;
            if (c < nv) {
                float o[8];
#pragma unroll
                for (int k = 0; k < 8; ++k) o[k] = rstd * (gv[i][k] * wv[i][k] - xv[i][k] * rstd * mean);
                if (res) {
                    float b[8];
                    unpack8(rv[i], b);
#pragma unroll
                    for (int k = 0; k < 8; ++k) o[k] = __bfloat162float(__float2bfloat16(o[k])) + b[k];
                }
                dxr[c] = pack8(o);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < RMSV_MAXV; ++i) {
        const int c = threadIdx.x + i * blockDim.x;
        if (c < nv)
#pragma unroll
            for (int k = 0; k < 8; ++k) dw_part[(size_t)blockIdx.x * d + 8 * c + k] = dwv[i][k];
    }
}

// out[c] = bf16(sum_b part[b * d + c]), a block of 32 x 32 threads per 32 columns: thread (cx, ry)
// sums the parts ry, ry + 32, ... of column c in order, then thread ry = 0 adds the 32 sums in ry
// order. The order depends only on nparts, so the result is deterministic.
extern "C" __global__ void vime_colsum2_bf16(const float* __restrict__ part, bf16* __restrict__ out, int nparts,
                                             int d) {
    __shared__ float acc[32][33];
    const int cx = threadIdx.x, ry = threadIdx.y;
    const int c = blockIdx.x * 32 + cx;
    float s = 0.f;
    if (c < d)
        for (int b = ry; b < nparts; b += 32) s += part[(size_t)b * d + c];
    acc[ry][cx] = s;
    __syncthreads();
    if (ry == 0 && c < d) {
        float t = 0.f;
        for (int k = 0; k < 32; ++k) t += acc[k][cx];
        out[c] = __float2bfloat16(t);
    }
}

// y = bf16(a + b), bf16 (the sum in f32, rounded once: candle's bf16 add on the CPU). 16-byte
// accesses when every pointer is aligned and n % 8 == 0.
extern "C" __global__ void vime_add_bf16(const bf16* __restrict__ a, const bf16* __restrict__ b,
                                         bf16* __restrict__ y, size_t n) {
    const size_t stride = (size_t)gridDim.x * blockDim.x, tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (n % 8 == 0 && aligned16(a) && aligned16(b) && aligned16(y)) {
        for (size_t i = tid; i < n / 8; i += stride) {
            float fa[8], fb[8];
            unpack8(reinterpret_cast<const uint4*>(a)[i], fa);
            unpack8(reinterpret_cast<const uint4*>(b)[i], fb);
#pragma unroll
            for (int k = 0; k < 8; ++k) fa[k] += fb[k];
            reinterpret_cast<uint4*>(y)[i] = pack8(fa);
        }
        return;
    }
    for (size_t i = tid; i < n; i += stride) y[i] = __float2bfloat16(__bfloat162float(a[i]) + __bfloat162float(b[i]));
}

// ------------------------------------------------------------------------------------------------
// Embedding backward (kernels/src/embedding.rs): out [V, D] f32, row v = init[v] (bf16, optional)
// + the rows of g at the positions offs[v]..offs[v+1] of pos (grouped by token id, increasing),
// summed in that order. Rows strided over the grid, columns over the block; no atomics.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void vime_embed_bwd(const bf16* __restrict__ g, const unsigned int* __restrict__ offs,
                                          const unsigned int* __restrict__ pos, const bf16* __restrict__ init,
                                          float* __restrict__ out, int vocab, int d) {
    for (int v = blockIdx.x; v < vocab; v += gridDim.x) {
        const unsigned int a = offs[v], b = offs[v + 1];
        for (int c = threadIdx.x; c < d; c += blockDim.x) {
            float s = init ? __bfloat162float(init[(size_t)v * d + c]) : 0.f;
            for (unsigned int k = a; k < b; ++k) s += __bfloat162float(g[(size_t)pos[k] * d + c]);
            out[(size_t)v * d + c] = s;
        }
    }
}

// The embedding backward into a running f32 sum, in place: only the n rows that occur in the batch
// (rows[u], its positions offs[u]..offs[u+1] of pos, increasing) are read and written; row
// rows[u] of out becomes out[rows[u]] + its rows of g, summed in that order (as vime_embed_bwd with
// the sum as its init).
extern "C" __global__ void vime_embed_bwd_acc(const bf16* __restrict__ g, const unsigned int* __restrict__ rows,
                                              const unsigned int* __restrict__ offs,
                                              const unsigned int* __restrict__ pos, float* __restrict__ out,
                                              int n, int d) {
    for (int u = blockIdx.x; u < n; u += gridDim.x) {
        const unsigned int a = offs[u], b = offs[u + 1];
        float* o = out + (size_t)rows[u] * d;
        for (int c = threadIdx.x; c < d; c += blockDim.x) {
            float s = o[c];
            for (unsigned int k = a; k < b; ++k) s += __bfloat162float(g[(size_t)pos[k] * d + c]);
            o[c] = s;
        }
    }
}

// One RoPE rotation of the pair (x1, x2) by (c, s), rounded as written: products and sums by the
// _rn intrinsics, which nvcc never contracts into an FMA. Every RoPE kernel uses it, so the fused
// norm + rope kernels give the bits of the separate ones whatever the compiler contracts where.
__device__ __forceinline__ void rope_rot(float x1, float x2, float c, float s, float* y1, float* y2) {
    *y1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
    *y2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
}

// ------------------------------------------------------------------------------------------------
// RoPE (rotate_half): x [T, H, D], one thread per (token, j < D/2) that rotates pair j of every
// head of its token: the angle (pos * (1 / theta^(2j / D)), in f32 as the CPU kernel computes it)
// and its sincos are computed once per token instead of once per head. sign = -1 is the backward
// (rotation by the opposite angle).
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void vime_rope(const bf16* __restrict__ x, bf16* __restrict__ y,
                                     const unsigned int* __restrict__ pos, int t, int h, int d,
                                     float theta, float sign) {
    const int half = d >> 1;
    const size_t n = (size_t)t * half;
    for (size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x; idx < n;
         idx += (size_t)gridDim.x * blockDim.x) {
        const int j = idx % half;
        const size_t tok = idx / half;
        const float inv_freq = 1.f / powf(theta, (float)(2 * j) / (float)d);
        const float a = (float)pos[tok] * inv_freq;
        float sn, c;
        sincosf(a, &sn, &c);
        sn *= sign;
        const bf16* xr = x + tok * h * d;
        bf16* yr = y + tok * h * d;
        for (int hh = 0; hh < h; ++hh, xr += d, yr += d) {
            const float x1 = __bfloat162float(xr[j]), x2 = __bfloat162float(xr[j + half]);
            float y1, y2;
            rope_rot(x1, x2, c, sn, &y1, &y2);
            yr[j] = __float2bfloat16(y1);
            yr[j + half] = __float2bfloat16(y2);
        }
    }
}

// ------------------------------------------------------------------------------------------------
// SwiGLU: y = silu(g) * u, silu(g) = g * sigmoid(g). Backward, packed [d_gate ++ d_up]:
//   d_gate = gy * u * sig * (1 + g * (1 - sig)),  d_up = gy * silu(g)
// ------------------------------------------------------------------------------------------------
// 8 bf16 per 16-byte access when every pointer is 16-byte aligned and n % 8 == 0 (the usual case:
// whole tensors); element by element otherwise. The math is the same either way, and it is
// swiglu.cuh's (fp8.cu's fused casts compute it too).

extern "C" __global__ void vime_swiglu_fwd(const bf16* __restrict__ gate, const bf16* __restrict__ up,
                                           bf16* __restrict__ y, size_t n) {
    const size_t stride = (size_t)gridDim.x * blockDim.x, tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (n % 8 == 0 && aligned16(gate) && aligned16(up) && aligned16(y)) {
        for (size_t i = tid; i < n / 8; i += stride) {
            uint4 gv = reinterpret_cast<const uint4*>(gate)[i], uv = reinterpret_cast<const uint4*>(up)[i], yv;
            const bf16* g8 = reinterpret_cast<const bf16*>(&gv);
            const bf16* u8 = reinterpret_cast<const bf16*>(&uv);
            bf16* y8 = reinterpret_cast<bf16*>(&yv);
#pragma unroll
            for (int k = 0; k < 8; ++k)
                y8[k] = __float2bfloat16(swiglu_f(__bfloat162float(g8[k]), __bfloat162float(u8[k])));
            reinterpret_cast<uint4*>(y)[i] = yv;
        }
        return;
    }
    for (size_t i = tid; i < n; i += stride)
        y[i] = __float2bfloat16(swiglu_f(__bfloat162float(gate[i]), __bfloat162float(up[i])));
}

extern "C" __global__ void vime_swiglu_bwd(const bf16* __restrict__ gate, const bf16* __restrict__ up,
                                           const bf16* __restrict__ gy, bf16* __restrict__ dgate,
                                           bf16* __restrict__ dup, size_t n) {
    const size_t stride = (size_t)gridDim.x * blockDim.x, tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    float dg, du;
    if (n % 8 == 0 && aligned16(gate) && aligned16(up) && aligned16(gy) && aligned16(dgate) && aligned16(dup)) {
        for (size_t i = tid; i < n / 8; i += stride) {
            uint4 gv = reinterpret_cast<const uint4*>(gate)[i], uv = reinterpret_cast<const uint4*>(up)[i],
                  ov = reinterpret_cast<const uint4*>(gy)[i], dgv, duv;
            const bf16* g8 = reinterpret_cast<const bf16*>(&gv);
            const bf16* u8 = reinterpret_cast<const bf16*>(&uv);
            const bf16* o8 = reinterpret_cast<const bf16*>(&ov);
            bf16* dg8 = reinterpret_cast<bf16*>(&dgv);
            bf16* du8 = reinterpret_cast<bf16*>(&duv);
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                swiglu_b(__bfloat162float(g8[k]), __bfloat162float(u8[k]), __bfloat162float(o8[k]), dg, du);
                dg8[k] = __float2bfloat16(dg);
                du8[k] = __float2bfloat16(du);
            }
            reinterpret_cast<uint4*>(dgate)[i] = dgv;
            reinterpret_cast<uint4*>(dup)[i] = duv;
        }
        return;
    }
    for (size_t i = tid; i < n; i += stride) {
        swiglu_b(__bfloat162float(gate[i]), __bfloat162float(up[i]), __bfloat162float(gy[i]), dg, du);
        dgate[i] = __float2bfloat16(dg);
        dup[i] = __float2bfloat16(du);
    }
}

// ------------------------------------------------------------------------------------------------
// LM head log-prob + entropy, vocabulary-chunked. The logits of one [rows, vc] chunk come from a
// cuBLAS GEMM (bf16 x bf16 -> f32) on the Rust side; these kernels keep per-row running softmax
// statistics relative to the running max M:
//   s = sum exp(z - M),  a = sum exp(z - M) * (z - M)
// so that lse = M + log s and entropy = log s - a / s (no cancellation against M).
// One block per row (blockDim 256), rows < nrows of the chunk starting at token row0.
// ------------------------------------------------------------------------------------------------
// Merges the running statistics (m2, s2, a2) into (m, s, a), both relative to their own max; an
// empty side (s = 0, m = -inf) contributes nothing (no -inf * 0).
__device__ __forceinline__ void softmax_stats_merge(float& m, float& s, float& a, float m2, float s2, float a2) {
    const float mm = fmaxf(m, m2);
    float sn = 0.f, an = 0.f;
    if (s > 0.f) {
        const float f = expf(m - mm);
        sn += s * f;
        an += (a + (m - mm) * s) * f;
    }
    if (s2 > 0.f) {
        const float f = expf(m2 - mm);
        sn += s2 * f;
        an += (a2 + (m2 - mm) * s2) * f;
    }
    m = mm;
    s = sn;
    a = an;
}

// Moves a thread's running statistics to a larger max mn (their sums rescaled by exp(m - mn)).
__device__ __forceinline__ void softmax_stats_raise(float& m, float& s, float& a, float mn) {
    if (s > 0.f) {
        const float f = expf(m - mn);
        a = (a + (m - mn) * s) * f;
        s *= f;
    }
    m = mn;
}

// Adds one logit to a thread's running statistics (online softmax: the max moves as it goes).
__device__ __forceinline__ void softmax_stats_add(float& m, float& s, float& a, float z) {
    if (z > m) softmax_stats_raise(m, s, a, z);
    const float zz = z - m;
    const float e = expf(zz);
    s += e;
    a += e * zz;
}

// Adds a group of N logits to a thread's running statistics: the group's max first, so the running
// max moves (and s, a are rescaled, with the accurate expf) at most once a group; then each logit
// costs a subtract, a multiply, an ex2 (exp2f: 2 ulp) and two adds. The one-at-a-time
// softmax_stats_add spent ~17 instructions a logit on its branch and expf, and that chain, not
// the loads, bounded the statistics kernel (~2.4 TB/s of f32 logits on an H100).
template <int N>
__device__ __forceinline__ void softmax_stats_addn(float& m, float& s, float& a, const float (&x)[N]) {
    float gm = x[0];
#pragma unroll
    for (int i = 1; i < N; ++i) gm = fmaxf(gm, x[i]);
    if (gm > m) softmax_stats_raise(m, s, a, gm);
#pragma unroll
    for (int i = 0; i < N; ++i) {
        const float d = x[i] - m;
        const float e = exp2f(d * 1.4426950408889634f);
        s += e;
        a = fmaf(e, d, a);
    }
}

// 8 logits from 16-byte loads: two float4 (f32 logits) or one uint4 of 8 bf16.
__device__ __forceinline__ void load_logits8(const float* z, int j, float (&x)[8]) {
    const float4* p = reinterpret_cast<const float4*>(z) + 2 * j;
    const float4 u = p[0], w = p[1];
    x[0] = u.x, x[1] = u.y, x[2] = u.z, x[3] = u.w, x[4] = w.x, x[5] = w.y, x[6] = w.z, x[7] = w.w;
}
__device__ __forceinline__ void load_logits8(const bf16* z, int j, float (&x)[8]) {
    const uint4 u = reinterpret_cast<const uint4*>(z)[j];
    const bf16* b = reinterpret_cast<const bf16*>(&u);
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] = __bfloat162float(b[i]);
}
__device__ __forceinline__ float logit_f32(float z) { return z; }
__device__ __forceinline__ float logit_f32(bf16 z) { return __bfloat162float(z); }

// stats: [T, 4] f32 = (M, s, a, target logit), initialised by the caller to (-inf, 0, 0, 0).
// One pass over the row (each logit read once): where the row is 16-byte aligned and a whole
// number of 8-logit groups, each thread loads 4 groups before it adds any (the loads in flight
// together), then its leftover groups; otherwise one logit at a time. Every thread keeps its own
// running (m, s, a), and the block merges them in a fixed order.
template <typename T>
__device__ __forceinline__ void lmhead_stats(const T* __restrict__ logits, int vc, int v0,
                                             const unsigned int* __restrict__ targets, int row0,
                                             float* __restrict__ stats) {
    __shared__ float sm[3][32];
    const int r = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int bd = blockDim.x;
    const T* z = logits + (size_t)r * vc;
    float m = -INFINITY, s = 0.f, a = 0.f;
    int tail = 0;
    if ((vc & 7) == 0 && aligned16(z)) {
        const int ng = vc >> 3;
        int j = threadIdx.x;
        for (; j + 3 * bd < ng; j += 4 * bd) {
            float x[4][8];
#pragma unroll
            for (int u = 0; u < 4; ++u) load_logits8(z, j + u * bd, x[u]);
#pragma unroll
            for (int u = 0; u < 4; ++u) softmax_stats_addn(m, s, a, x[u]);
        }
        for (; j < ng; j += bd) {
            float x[8];
            load_logits8(z, j, x);
            softmax_stats_addn(m, s, a, x);
        }
        tail = vc;
    }
    for (int j = tail + threadIdx.x; j < vc; j += bd) softmax_stats_add(m, s, a, logit_f32(z[j]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(FULL_MASK, m, o), s2 = __shfl_xor_sync(FULL_MASK, s, o),
                    a2 = __shfl_xor_sync(FULL_MASK, a, o);
        softmax_stats_merge(m, s, a, m2, s2, a2);
    }
    if (lane == 0) {
        sm[0][warp] = m;
        sm[1][warp] = s;
        sm[2][warp] = a;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        m = sm[0][0];
        s = sm[1][0];
        a = sm[2][0];
        for (int w = 1; w < nwarps; ++w) softmax_stats_merge(m, s, a, sm[0][w], sm[1][w], sm[2][w]);
        float* st = stats + (size_t)(row0 + r) * 4;
        const unsigned int tg = targets[row0 + r];
        if (tg >= (unsigned int)v0 && tg < (unsigned int)(v0 + vc)) st[3] = logit_f32(z[tg - v0]);
        float m0 = st[0], s0 = st[1], a0 = st[2];
        softmax_stats_merge(m0, s0, a0, m, s, a);
        st[0] = m0;
        st[1] = s0;
        st[2] = a0;
    }
}

extern "C" __global__ void vime_lmhead_stats(const float* __restrict__ logits, int vc, int v0,
                                             const unsigned int* __restrict__ targets, int row0,
                                             float* __restrict__ stats) {
    lmhead_stats(logits, vc, v0, targets, row0, stats);
}
// The same over bf16 logits (`--lm-head-logits bf16`: the GEMM rounds them to bf16, as HF's and
// Megatron's heads do); each logit widened to f32 as it is loaded, then the f32 kernel's math.
extern "C" __global__ void vime_lmhead_stats_bf16(const bf16* __restrict__ logits, int vc, int v0,
                                                  const unsigned int* __restrict__ targets, int row0,
                                                  float* __restrict__ stats) {
    lmhead_stats(logits, vc, v0, targets, row0, stats);
}

// out: [T, 3] f32 (logprob, entropy, lse); the lse column is for the backward. IGNORE (u32 max)
// targets get logprob 0.
extern "C" __global__ void vime_lmhead_finish(const float* __restrict__ stats,
                                              const unsigned int* __restrict__ targets, float* __restrict__ out,
                                              int t) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= t) return;
    const float m = stats[i * 4], s = stats[i * 4 + 1], a = stats[i * 4 + 2], zt = stats[i * 4 + 3];
    const float ls = logf(s);
    const float l = m + ls;
    out[i * 3] = targets[i] == 0xffffffffu ? 0.f : zt - l;
    out[i * 3 + 1] = ls - a / s;
    out[i * 3 + 2] = l;
}

// dz = g_lp * (1[j = target] - p) - g_ent * p * (logp + H), p = exp(z - lse), logp = z - lse,
// H the row's entropy; written as bf16 for the two backward GEMMs (as torch's bf16 autograd has
// the logits' gradient). fwd: [T, 3] the forward output, grad: [T, 3] its gradient (the lse
// column's gradient is ignored: lse is an internal output).
__device__ __forceinline__ float lmhead_dz(float z, unsigned int col, unsigned int tg, float l, float h,
                                           float glp, float gent) {
    const float logp = z - l;
    const float p = expf(logp);
    float v = -glp * p - gent * p * (logp + h);
    if (col == tg) v += glp;
    return v;
}

// f32 logits: 16-byte logit loads and 8-byte dz stores where the row allows (vc % 4 == 0, aligned
// rows); bf16 logits: 16-byte loads and stores of 8 (vc % 8 == 0, aligned rows). The same math per
// element on every path (a bf16 logit widened to f32 first).
__device__ __forceinline__ void lmhead_dz4(const float* z, bf16* d, int j, unsigned int v0, unsigned int tg,
                                           float l, float h, float glp, float gent) {
    const float4 q = reinterpret_cast<const float4*>(z)[j];
    const unsigned int c = v0 + 4 * j;
    uint2 u;
    bf16* o = reinterpret_cast<bf16*>(&u);
    o[0] = __float2bfloat16(lmhead_dz(q.x, c, tg, l, h, glp, gent));
    o[1] = __float2bfloat16(lmhead_dz(q.y, c + 1, tg, l, h, glp, gent));
    o[2] = __float2bfloat16(lmhead_dz(q.z, c + 2, tg, l, h, glp, gent));
    o[3] = __float2bfloat16(lmhead_dz(q.w, c + 3, tg, l, h, glp, gent));
    reinterpret_cast<uint2*>(d)[j] = u;
}
__device__ __forceinline__ void lmhead_dz8(const bf16* z, bf16* d, int j, unsigned int v0, unsigned int tg,
                                           float l, float h, float glp, float gent) {
    const uint4 q = reinterpret_cast<const uint4*>(z)[j];
    const bf16* zi = reinterpret_cast<const bf16*>(&q);
    const unsigned int c = v0 + 8 * j;
    uint4 u;
    bf16* o = reinterpret_cast<bf16*>(&u);
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = __float2bfloat16(lmhead_dz(__bfloat162float(zi[i]), c + i, tg, l, h, glp, gent));
    reinterpret_cast<uint4*>(d)[j] = u;
}

template <typename T>
__device__ __forceinline__ void lmhead_dlogits(const T* __restrict__ logits, int vc, int v0,
                                               const unsigned int* __restrict__ targets, int row0,
                                               const float* __restrict__ fwd, const float* __restrict__ grad,
                                               bf16* __restrict__ dz) {
    const int r = blockIdx.x;
    const int row = row0 + r;
    const float h = fwd[row * 3 + 1], l = fwd[row * 3 + 2];
    const unsigned int tg = targets[row];
    const float glp = tg == 0xffffffffu ? 0.f : grad[row * 3];
    const float gent = grad[row * 3 + 1];
    const T* z = logits + (size_t)r * vc;
    bf16* d = dz + (size_t)r * vc;
    int tail = 0;
    constexpr int W = sizeof(T) == 4 ? 4 : 8;  // logits a 16-byte load
    if (vc % W == 0 && aligned16(z) && ((uintptr_t)d & (2 * W - 1)) == 0) {
        for (int j = threadIdx.x; j < vc / W; j += blockDim.x) {
            if constexpr (W == 4)
                lmhead_dz4(reinterpret_cast<const float*>(z), d, j, (unsigned int)v0, tg, l, h, glp, gent);
            else
                lmhead_dz8(reinterpret_cast<const bf16*>(z), d, j, (unsigned int)v0, tg, l, h, glp, gent);
        }
        tail = vc;
    }
    for (int j = tail + threadIdx.x; j < vc; j += blockDim.x)
        d[j] = __float2bfloat16(lmhead_dz(logit_f32(z[j]), (unsigned int)(v0 + j), tg, l, h, glp, gent));
}

extern "C" __global__ void vime_lmhead_dlogits(const float* __restrict__ logits, int vc, int v0,
                                               const unsigned int* __restrict__ targets, int row0,
                                               const float* __restrict__ fwd, const float* __restrict__ grad,
                                               bf16* __restrict__ dz) {
    lmhead_dlogits(logits, vc, v0, targets, row0, fwd, grad, dz);
}

extern "C" __global__ void vime_lmhead_dlogits_bf16(const bf16* __restrict__ logits, int vc, int v0,
                                                    const unsigned int* __restrict__ targets, int row0,
                                                    const float* __restrict__ fwd, const float* __restrict__ grad,
                                                    bf16* __restrict__ dz) {
    lmhead_dlogits(logits, vc, v0, targets, row0, fwd, grad, dz);
}

extern "C" __global__ void vime_f32_to_bf16(const float* __restrict__ x, bf16* __restrict__ y, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        y[i] = __float2bfloat16(x[i]);
}

// ------------------------------------------------------------------------------------------------
// AdamW over flat f32 buffers, in place, exactly the sequence of the CPU path
// (trainer/src/optim/adamw.rs, torch.optim.AdamW's order) with the same f32 constants (the host
// rounds each f64 constant to f32 once, as candle's affine does), each operation rounded as there
// (explicit _rn intrinsics: no FMA contraction), so CUDA and CPU agree bit for bit:
//   p <- p * keep                    (keep = 1 - lr * wd; skipped when decay is off)
//   m <- (g - m) * one_m_b1 + m
//   v <- v * b2 + (g * one_m_b2) * g
//   p <- (m * neg_step) / (sqrt(v) * inv_bc2 + eps) + p
// and the model copy (bf16, may be null) receives bf16(p).
// ------------------------------------------------------------------------------------------------
template <typename G>
__device__ __forceinline__ float load_g(const G* g, size_t i);
template <>
__device__ __forceinline__ float load_g<float>(const float* g, size_t i) { return g[i]; }
template <>
__device__ __forceinline__ float load_g<bf16>(const bf16* g, size_t i) { return __bfloat162float(g[i]); }

struct AdamConsts {
    float keep, one_m_b1, b2, one_m_b2, inv_bc2, eps, neg_step;
    int decay;
    // Gradient clipping folded in: g = g * grad_scale (one f32 multiply, as the separate scaling
    // pass computed it) when scale != 0.
    float grad_scale;
    int scale;
};

// One element's update (the sequence above).
__device__ __forceinline__ void adamw_elem(float& pi, float gi, float& mi, float& vi, const AdamConsts& c) {
    if (c.scale) gi = __fmul_rn(gi, c.grad_scale);
    if (c.decay) pi = __fmul_rn(pi, c.keep);
    mi = __fadd_rn(__fmul_rn(__fsub_rn(gi, mi), c.one_m_b1), mi);
    vi = __fadd_rn(__fmul_rn(vi, c.b2), __fmul_rn(__fmul_rn(gi, c.one_m_b2), gi));
    const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(vi), c.inv_bc2), c.eps);
    pi = __fadd_rn(__fdiv_rn(__fmul_rn(mi, c.neg_step), denom), pi);
}

// Element i of a tensor, in place (and its bf16 model copy).
template <typename G>
__device__ __forceinline__ void adamw_at(float* __restrict__ p, const G* __restrict__ g, float* __restrict__ m,
                                         float* __restrict__ v, bf16* __restrict__ model, size_t i,
                                         const AdamConsts& c) {
    float pi = p[i], mi = m[i], vi = v[i];
    adamw_elem(pi, load_g<G>(g, i), mi, vi, c);
    p[i] = pi;
    m[i] = mi;
    v[i] = vi;
    if (model) model[i] = __float2bfloat16(pi);
}

template <typename G>
__device__ __forceinline__ void adamw_body(float* __restrict__ p, const G* __restrict__ g, float* __restrict__ m,
                                           float* __restrict__ v, bf16* __restrict__ model, size_t n,
                                           const AdamConsts c) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        adamw_at<G>(p, g, m, v, model, i, c);
}

// Four elements a thread per iteration with 16-byte accesses of p, m, v (and an f32 g; 8 bytes of
// a bf16 g and of the model copy): n % 4 == 0, every pointer aligned (the host checks). The same
// per-element operations, so the same bits as adamw_body.
template <typename G>
__device__ __forceinline__ void load_g4(const G* g, size_t i, float* out);
template <>
__device__ __forceinline__ void load_g4<float>(const float* g, size_t i, float* out) {
    const float4 q = reinterpret_cast<const float4*>(g)[i];
    out[0] = q.x, out[1] = q.y, out[2] = q.z, out[3] = q.w;
}
template <>
__device__ __forceinline__ void load_g4<bf16>(const bf16* g, size_t i, float* out) {
    const uint2 q = reinterpret_cast<const uint2*>(g)[i];
    const bf16* h = reinterpret_cast<const bf16*>(&q);
#pragma unroll
    for (int k = 0; k < 4; ++k) out[k] = __bfloat162float(h[k]);
}

// 16-byte vector i (elements 4i..4i+3) of a tensor, in place (and its bf16 model copy).
template <typename G>
__device__ __forceinline__ void adamw_at4(float* __restrict__ p, const G* __restrict__ g, float* __restrict__ m,
                                          float* __restrict__ v, bf16* __restrict__ model, size_t i,
                                          const AdamConsts& c) {
    float4* p4 = reinterpret_cast<float4*>(p);
    float4* m4 = reinterpret_cast<float4*>(m);
    float4* v4 = reinterpret_cast<float4*>(v);
    float4 pq = p4[i], mq = m4[i], vq = v4[i];
    float gq[4];
    load_g4<G>(g, i, gq);
    adamw_elem(pq.x, gq[0], mq.x, vq.x, c);
    adamw_elem(pq.y, gq[1], mq.y, vq.y, c);
    adamw_elem(pq.z, gq[2], mq.z, vq.z, c);
    adamw_elem(pq.w, gq[3], mq.w, vq.w, c);
    p4[i] = pq;
    m4[i] = mq;
    v4[i] = vq;
    if (model) {
        uint2 o;
        bf16* h = reinterpret_cast<bf16*>(&o);
        h[0] = __float2bfloat16(pq.x), h[1] = __float2bfloat16(pq.y);
        h[2] = __float2bfloat16(pq.z), h[3] = __float2bfloat16(pq.w);
        reinterpret_cast<uint2*>(model)[i] = o;
    }
}

template <typename G>
__device__ __forceinline__ void adamw_body4(float* __restrict__ p, const G* __restrict__ g, float* __restrict__ m,
                                            float* __restrict__ v, bf16* __restrict__ model, size_t n,
                                            const AdamConsts c) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n / 4; i += (size_t)gridDim.x * blockDim.x)
        adamw_at4<G>(p, g, m, v, model, i, c);
}

extern "C" __global__ void vime_adamw_f32g_v4(float* p, const float* g, float* m, float* v, bf16* model, size_t n,
                                              AdamConsts c) {
    adamw_body4<float>(p, g, m, v, model, n, c);
}

extern "C" __global__ void vime_adamw_bf16g_v4(float* p, const bf16* g, float* m, float* v, bf16* model, size_t n,
                                               AdamConsts c) {
    adamw_body4<bf16>(p, g, m, v, model, n, c);
}

extern "C" __global__ void vime_adamw_f32g(float* p, const float* g, float* m, float* v, bf16* model, size_t n,
                                           AdamConsts c) {
    adamw_body<float>(p, g, m, v, model, n, c);
}

extern "C" __global__ void vime_adamw_bf16g(float* p, const bf16* g, float* m, float* v, bf16* model, size_t n,
                                            AdamConsts c) {
    adamw_body<bf16>(p, g, m, v, model, n, c);
}

// Every tensor of an optimizer step in one launch (the per-tensor launches above cost a gap and a
// partial last wave each: ~0.7 ms of a 0.6B step's 5.5 ms, 310 tensors). Each tensor is cut into
// chunks of ADAMW_CHUNK elements; a persistent grid strides over all chunks, finding a chunk's
// tensor by binary search over the table (8 u64 a tensor: p, g, m, v, model or 0, n,
// flags = decay | g is bf16 << 1 | 16-byte path << 2, first chunk). The same per-element
// operations as adamw_body, so the same bits as the per-tensor kernels.
#define ADAMW_CHUNK 4096
template <typename G>
__device__ __forceinline__ void adamw_chunk(float* __restrict__ p, const G* __restrict__ g, float* __restrict__ m,
                                            float* __restrict__ v, bf16* __restrict__ model, size_t begin,
                                            size_t end, bool vec, const AdamConsts& c) {
    if (vec) {  // begin is a multiple of ADAMW_CHUNK, end of 4 (n % 4 == 0)
        for (size_t i = begin / 4 + threadIdx.x; i < end / 4; i += blockDim.x) adamw_at4<G>(p, g, m, v, model, i, c);
    } else {
        for (size_t i = begin + threadIdx.x; i < end; i += blockDim.x) adamw_at<G>(p, g, m, v, model, i, c);
    }
}

extern "C" __global__ void __launch_bounds__(256, 4) vime_adamw_multi(const unsigned long long* __restrict__ segs,
                                                                   int nseg, unsigned long long nchunks,
                                                                   AdamConsts c) {
    for (unsigned long long ch = blockIdx.x; ch < nchunks; ch += gridDim.x) {
        int lo = 0, hi = nseg - 1;  // the last tensor whose first chunk is <= ch
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (segs[8 * mid + 7] <= ch) lo = mid;
            else hi = mid - 1;
        }
        const unsigned long long* s = segs + 8 * lo;
        const size_t n = s[5], begin = (size_t)(ch - s[7]) * ADAMW_CHUNK;
        const size_t end = begin + ADAMW_CHUNK < n ? begin + ADAMW_CHUNK : n;
        const unsigned long long flags = s[6];
        AdamConsts cc = c;
        cc.decay = c.decay && (flags & 1);
        float* p = reinterpret_cast<float*>(s[0]);
        float* m = reinterpret_cast<float*>(s[2]);
        float* v = reinterpret_cast<float*>(s[3]);
        bf16* model = reinterpret_cast<bf16*>(s[4]);
        const bool vec = (flags >> 2) & 1;
        if ((flags >> 1) & 1)
            adamw_chunk<bf16>(p, reinterpret_cast<const bf16*>(s[1]), m, v, model, begin, end, vec, cc);
        else
            adamw_chunk<float>(p, reinterpret_cast<const float*>(s[1]), m, v, model, begin, end, vec, cc);
    }
}

// ------------------------------------------------------------------------------------------------
// bf16 gradients into their f32 running sums, every tensor of a backward in one launch (the norms'
// weights: 113 tensors at Qwen3-0.6B, each a cast, and from the second micro-batch on an add too,
// launched one by one). Segment i is 4 u64s: the bf16 gradient, the f32 sum to add to (0: none),
// the f32 output (the sum itself, in place, or a fresh buffer), n. out = sum + f32(g) rounded as an
// f32 add, or f32(g) exactly where there is no sum (no add of zero, which would turn -0 into +0):
// the bits of candle's cast and add. A block (or several, strided) per segment.
extern "C" __global__ void vime_widen_add_multi(const unsigned long long* __restrict__ segs, int nseg) {
    for (int i = blockIdx.x; i < nseg; i += gridDim.x) {
        const bf16* g = reinterpret_cast<const bf16*>(segs[4 * i]);
        const float* sum = reinterpret_cast<const float*>(segs[4 * i + 1]);
        float* out = reinterpret_cast<float*>(segs[4 * i + 2]);
        const size_t n = segs[4 * i + 3];
        for (size_t j = threadIdx.x; j < n; j += blockDim.x) {
            const float v = __bfloat162float(g[j]);
            out[j] = sum ? __fadd_rn(sum[j], v) : v;
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Sum of squares for the global gradient norm, deterministic: vime_sumsq_* writes one f64 partial
// per block (grid-stride over the tensor, a fixed grid), vime_sum_partials adds a tensor's
// partials in block order (one warp, then lane order). Squares and sums in f64, as the CPU path.
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ double block_sum_f64(double v, double* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    double r = 0.0;
    if (threadIdx.x == 0)
        for (int w = 0; w < nwarps; ++w) r += scratch[w];
    return r;  // valid in thread 0
}

// The sum of squares of the 16 bytes at vector j of x (4 f32 or 8 bf16 values), in f64, in a fixed
// pairwise order.
template <typename T>
__device__ __forceinline__ double sumsq16(const T* __restrict__ x, size_t j);
template <>
__device__ __forceinline__ double sumsq16<float>(const float* __restrict__ x, size_t j) {
    const float4 q = __ldg(reinterpret_cast<const float4*>(x) + j);
    const double a = q.x, b = q.y, c = q.z, d = q.w;
    return (a * a + b * b) + (c * c + d * d);
}
template <>
__device__ __forceinline__ double sumsq16<bf16>(const bf16* __restrict__ x, size_t j) {
    const uint4 q = __ldg(reinterpret_cast<const uint4*>(x) + j);
    const bf16* h = reinterpret_cast<const bf16*>(&q);
    double e[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) e[k] = (double)__bfloat162float(h[k]);
    return ((e[0] * e[0] + e[1] * e[1]) + (e[2] * e[2] + e[3] * e[3])) +
           ((e[4] * e[4] + e[5] * e[5]) + (e[6] * e[6] + e[7] * e[7]));
}

// The sum of squares of x[0..n) as `blocks` blocks (this one `block`) compute it: partial[block].
// `vec` (x 16-byte aligned, the host checks): 16-byte loads over the whole vectors, two in flight
// a thread (four spill at the 32 registers that keep all 1056 blocks resident), and the
// n % (16 / sizeof(T)) tail elements by block 0's first threads; else one element a load. Either way the order of additions depends only on n, the grid and `vec`, so the
// result is deterministic.
template <typename T>
__device__ __forceinline__ void sumsq_blocks(const T* __restrict__ x, size_t n, double* __restrict__ partial,
                                             unsigned int blocks, unsigned int block, bool vec) {
    __shared__ double scratch[32];
    double s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0;
    const size_t stride = (size_t)blocks * blockDim.x;
    size_t i = (size_t)block * blockDim.x + threadIdx.x;
    if (vec) {
        constexpr size_t V = 16 / sizeof(T);
        const size_t nv = n / V;
        for (; i + stride < nv; i += 2 * stride) {
            s0 += sumsq16<T>(x, i);
            s1 += sumsq16<T>(x, i + stride);
        }
        for (; i < nv; i += stride) s0 += sumsq16<T>(x, i);
        if (block == 0 && threadIdx.x < n - nv * V) {
            const double a = (double)load_g<T>(x, nv * V + threadIdx.x);
            s2 += a * a;
        }
    } else {
        // Four loads in flight per thread per iteration (the loop is bound by memory latency, not
        // by the f64 math).
        for (; i + 3 * stride < n; i += 4 * stride) {
            const double a = (double)load_g<T>(x, i), b = (double)load_g<T>(x, i + stride),
                         c = (double)load_g<T>(x, i + 2 * stride), e = (double)load_g<T>(x, i + 3 * stride);
            s0 += a * a;
            s1 += b * b;
            s2 += c * c;
            s3 += e * e;
        }
        for (; i < n; i += stride) {
            const double a = (double)load_g<T>(x, i);
            s0 += a * a;
        }
    }
    double s = block_sum_f64((s0 + s1) + (s2 + s3), scratch);
    if (threadIdx.x == 0) partial[block] = s;
}


// Many tensors' sums of squares in two launches, each with the bits of its own grid of
// SUMSQ_BLOCKS-capped blocks and a fixed-order sum of their partials: segment i is 4 u64s
// (address, n, its first logical block, its block count | bf16 << 32 | 16-byte aligned << 33).
// The grid is persistent (gridDim.x >= every segment's block count): physical block p runs
// segment i's logical block (p - first_i) mod gridDim.x when that is below its count, so one-block
// tensors spread over the grid. Partials land at partial[first_i + logical block], as per-tensor launches lay them out.
// (8 blocks of 256 an SM, all 1056 resident: a persistent block that waited for a free SM would
// run its whole share after the others.)
extern "C" __global__ void __launch_bounds__(256, 8) vime_sumsq_multi(const unsigned long long* __restrict__ segs, int nseg,
                                            double* __restrict__ partial) {
    const unsigned int g = gridDim.x, p = blockIdx.x;
    for (int i = 0; i < nseg; ++i) {
        const unsigned long long* sg = segs + 4 * i;
        const unsigned int first = (unsigned int)sg[2], blocks = (unsigned int)(sg[3] & 0xffffffffu);
        const unsigned int lb = (p + g - first % g) % g;
        if (lb >= blocks) continue;
        const bool vec = (sg[3] >> 33) & 1;
        if ((sg[3] >> 32) & 1)
            sumsq_blocks<bf16>(reinterpret_cast<const bf16*>(sg[0]), sg[1], partial + first, blocks, lb, vec);
        else
            sumsq_blocks<float>(reinterpret_cast<const float*>(sg[0]), sg[1], partial + first, blocks, lb, vec);
        __syncthreads();  // the reduction's scratch is reused by the next segment
    }
}

// out[i] = the sum of segment i's partials in a fixed order (lane-strided, then the 32 lane sums in
// lane order); one warp per segment (grid nseg).
extern "C" __global__ void vime_sum_partials_multi(const double* __restrict__ partial,
                                                   const unsigned long long* __restrict__ segs,
                                                   double* __restrict__ out) {
    const unsigned long long* sg = segs + 4 * blockIdx.x;
    const int np = (int)(sg[3] & 0xffffffffu);
    const double* p = partial + sg[2];
    double s = 0.0;
    for (int i = threadIdx.x; i < np; i += 32) s += p[i];
    double total = 0.0;
    for (int l = 0; l < 32; ++l) total += __shfl_sync(FULL_MASK, s, l);
    if (threadIdx.x == 0) out[blockIdx.x] = total;
}

// ------------------------------------------------------------------------------------------------
// Sampling (the built-in engine): Gumbel-max over counter-based noise, one block of 256 threads per
// row of f32 logits [rows, vocab]. key_j = logit_j * inv_t[row] + g_j, g_j = -log(-log(u_j)),
// u_j = ((h >> 40) + 0.5) / 2^24 with h = mix64(mix64(seed + counter * GOLDEN) + j): the noise
// depends only on (seed, counter, j), never on the batch. inv_t == 0 is greedy (key = logit). The
// token is the first index of the largest key (NaN never wins). vime_kernels::sample mirrors this
// on the host.
// ------------------------------------------------------------------------------------------------
__device__ __forceinline__ unsigned long long vime_mix64(unsigned long long z) {
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// Grid (rows, splits): block (row, s) covers the vocabulary slice [s * chunk, (s + 1) * chunk).
// With one split it writes the token (and log-prob); with more, its partial (best key, its index,
// running max and sum of exp) to part_* [rows, splits], which vime_sample_gumbel_merge combines.
// The argmax (ties to the lower index) is exact whatever the split; the log-sum-exp is reordered.
extern "C" __global__ void __launch_bounds__(256)
    vime_sample_gumbel(const float* __restrict__ logits, int vocab, const unsigned long long* __restrict__ seeds,
                       const unsigned long long* __restrict__ counters, const float* __restrict__ inv_t,
                       unsigned int* __restrict__ out, float* __restrict__ logprob, int chunk,
                       float* __restrict__ part_key, int* __restrict__ part_idx, float* __restrict__ part_m,
                       float* __restrict__ part_se) {
    // With `logprob` (may be null): also the log-softmax of the raw logits (temperature 1) at the
    // sampled token, from the same pass: each thread keeps a running max and sum of exp.
    const int row = blockIdx.x, split = blockIdx.y, nsplit = gridDim.y;
    const float* x = logits + (size_t)row * vocab;
    const float it = inv_t[row];
    const unsigned long long base = vime_mix64(seeds[row] + counters[row] * 0x9E3779B97F4A7C15ULL);
    const int lo = split * chunk, hi = min(lo + chunk, vocab);
    float best = -INFINITY;
    int bi = 0x7fffffff;
    float m = -INFINITY, se = 0.f;
    for (int j = lo + threadIdx.x; j < hi; j += 256) {
        const float z = x[j];
        float key = z;
        if (it != 0.f) {
            const unsigned long long h = vime_mix64(base + (unsigned long long)j);
            const float u = ((float)(h >> 40) + 0.5f) * 5.9604644775390625e-08f;
            key = z * it - logf(-logf(u));
        }
        if (key > best || (key == best && j < bi)) {
            best = key;
            bi = j;
        }
        if (logprob != nullptr && z > -INFINITY) {
            if (z > m) {
                se = se * expf(m - z) + 1.f;
                m = z;
            } else {
                se += expf(z - m);
            }
        }
    }
    __shared__ float sk[256];
    __shared__ int si[256];
    __shared__ float smx[256], ssum[256];
    sk[threadIdx.x] = best;
    si[threadIdx.x] = bi;
    smx[threadIdx.x] = m;
    ssum[threadIdx.x] = se;
    __syncthreads();
    for (int s = 128; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            const float ok = sk[threadIdx.x + s];
            const int oi = si[threadIdx.x + s];
            if (ok > sk[threadIdx.x] || (ok == sk[threadIdx.x] && oi < si[threadIdx.x])) {
                sk[threadIdx.x] = ok;
                si[threadIdx.x] = oi;
            }
            const float ma = smx[threadIdx.x], mb = smx[threadIdx.x + s];
            const float mm = fmaxf(ma, mb);
            if (mm > -INFINITY) {
                ssum[threadIdx.x] = ssum[threadIdx.x] * expf(ma - mm) + ssum[threadIdx.x + s] * expf(mb - mm);
                smx[threadIdx.x] = mm;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        if (nsplit > 1) {
            const size_t pi = (size_t)row * nsplit + split;
            part_key[pi] = sk[0];
            part_idx[pi] = si[0];
            part_m[pi] = smx[0];
            part_se[pi] = ssum[0];
            return;
        }
        const unsigned int tok = si[0] == 0x7fffffff ? 0u : (unsigned int)si[0];
        out[row] = tok;
        if (logprob != nullptr) logprob[row] = x[tok] - (smx[0] + logf(ssum[0]));
    }
}

// Merges vime_sample_gumbel's splits: one 32-thread block per row.
extern "C" __global__ void __launch_bounds__(32)
    vime_sample_gumbel_merge(const float* __restrict__ logits, int vocab, int nsplit,
                             const float* __restrict__ part_key, const int* __restrict__ part_idx,
                             const float* __restrict__ part_m, const float* __restrict__ part_se,
                             unsigned int* __restrict__ out, float* __restrict__ logprob) {
    const int row = blockIdx.x, lane = threadIdx.x;
    float best = -INFINITY, m = -INFINITY, se = 0.f;
    int bi = 0x7fffffff;
    for (int s = lane; s < nsplit; s += 32) {
        const size_t pi = (size_t)row * nsplit + s;
        const float k = part_key[pi];
        const int i = part_idx[pi];
        if (k > best || (k == best && i < bi)) {
            best = k;
            bi = i;
        }
        const float pm = part_m[pi], mm = fmaxf(m, pm);
        if (mm > -INFINITY) {
            se = se * expf(m - mm) + part_se[pi] * expf(pm - mm);
            m = mm;
        }
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float ok = __shfl_down_sync(0xffffffffu, best, o);
        const int oi = __shfl_down_sync(0xffffffffu, bi, o);
        if (ok > best || (ok == best && oi < bi)) {
            best = ok;
            bi = oi;
        }
        const float om = __shfl_down_sync(0xffffffffu, m, o), os = __shfl_down_sync(0xffffffffu, se, o);
        const float mm = fmaxf(m, om);
        if (mm > -INFINITY) {
            se = se * expf(m - mm) + os * expf(om - mm);
            m = mm;
        }
    }
    if (lane == 0) {
        const unsigned int tok = bi == 0x7fffffff ? 0u : (unsigned int)bi;
        out[row] = tok;
        if (logprob != nullptr) logprob[row] = logits[(size_t)row * vocab + tok] - (m + logf(se));
    }
}

// ------------------------------------------------------------------------------------------------
// pool[rows[r], :] = src[r, :] for r < n_rows, rows of `width` bf16 (the KV cache's append): one
// thread per element. candle's scatter loops over the rows in each thread (`width` threads in
// all), which cost ~0.2 ms per call at 256 rows.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void vime_rows_write_bf16(bf16* __restrict__ pool, const bf16* __restrict__ src,
                                                const unsigned int* __restrict__ rows, unsigned long long n,
                                                int width) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const unsigned long long r = i / width, c = i % width;
        pool[(unsigned long long)rows[r] * width + c] = src[i];
    }
}

// ------------------------------------------------------------------------------------------------
// Inference: the per-head q/k RMSNorm and RoPE of one layer in one launch (the decode step's
// 4 launches become 1). One warp per (token, head) row of q ([t, hq, d]) then k ([t, hk, d]),
// d = 128: lane l holds elements l, l+32, l+64, l+96, so both members of its RoPE pairs
// (j, j + 64). The arithmetic is vime_rmsnorm_fwd_warp's (same sum order, rounded to bf16) then
// vime_rope's on the rounded values, so the result equals the two kernels bit for bit
// (kernels/tests/cuda_vs_cpu.rs checks it).
// ------------------------------------------------------------------------------------------------
// q_stride / k_stride: elements from one token's heads to the next (hq * 128 and hk * 128 for
// contiguous inputs; the fused q|k|v row width when q and k are views of one projection).
// The angles of a lane's two rotation pairs (j = lane and lane + 32 of d = 128) at position p.
__device__ __forceinline__ void qk_rope_angles(float p, int lane, float theta, float* sn, float* cs) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int j = lane + 32 * i;
        const float inv_freq = 1.f / powf(theta, (float)(2 * j) / 128.f);
        sincosf(p * inv_freq, &sn[i], &cs[i]);
    }
}

// A head row's (d = 128, four columns a lane) values into xv and its RMSNorm 1 / rms, with
// vime_rmsnorm_*_warp's order of operations.
__device__ __forceinline__ float head_row_rstd(const bf16* __restrict__ xr, int lane, float eps, float (&xv)[4]) {
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        xv[i] = __bfloat162float(xr[lane + 32 * i]);
        ss += xv[i] * xv[i];
    }
    ss = warp_sum(ss);
    return 1.f / sqrtf(ss / 128.f + eps);
}

// QK_GROUP head rows at a time: their loads are issued together, then their sums reduced, then
// their outputs written. One row at a time left a warp a single 256-byte row in flight, about 2 TB/s
// on the H200 at 5 blocks an SM (the 0.6B and 4B timelines); the same expressions per element in the
// same order, so the bits do not change.
#define QK_GROUP 4

// `n` rows (n <= QK_GROUP) of one token's heads, 128 apart from x (the input row) and y (the
// output row), normalised by w (`wv`: the lane's four weights) and rotated by the lane's angles.
__device__ __forceinline__ void qk_norm_rope_rows(const bf16* __restrict__ x, bf16* __restrict__ y, int n,
                                                  const float (&wv)[4], int lane, float eps, const float* sn,
                                                  const float* cs) {
    float xv[QK_GROUP][4], ss[QK_GROUP];
#pragma unroll
    for (int g = 0; g < QK_GROUP; ++g)
        if (g < n)
#pragma unroll
            for (int i = 0; i < 4; ++i) xv[g][i] = __bfloat162float(x[g * 128 + lane + 32 * i]);
#pragma unroll
    for (int g = 0; g < QK_GROUP; ++g) {
        ss[g] = 0.f;
        if (g < n)
#pragma unroll
            for (int i = 0; i < 4; ++i) ss[g] += xv[g][i] * xv[g][i];
    }
#pragma unroll
    for (int g = 0; g < QK_GROUP; ++g)
        if (g < n) ss[g] = warp_sum(ss[g]);
#pragma unroll
    for (int g = 0; g < QK_GROUP; ++g) {
        if (g >= n) break;
        const float rstd = 1.f / sqrtf(ss[g] / 128.f + eps);
        float nv[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) nv[i] = __bfloat162float(__float2bfloat16(xv[g][i] * rstd * wv[i]));
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int j = lane + 32 * i;
            float y1, y2;
            rope_rot(nv[i], nv[i + 2], cs[i], sn[i], &y1, &y2);
            y[g * 128 + j] = __float2bfloat16(y1);
            y[g * 128 + j + 64] = __float2bfloat16(y2);
        }
    }
}

extern "C" __global__ void vime_qk_norm_rope(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                             const bf16* __restrict__ wq, const bf16* __restrict__ wk,
                                             const unsigned int* __restrict__ pos, bf16* __restrict__ qo,
                                             bf16* __restrict__ ko, int t, int hq, int hk, float eps,
                                             float theta, long long q_stride, long long k_stride) {
    const int d = 128;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int rows = t * (hq + hk);
    for (int r = blockIdx.x * RMSW_WARPS + warp; r < rows; r += gridDim.x * RMSW_WARPS) {
        const int tok = r / (hq + hk), hh = r % (hq + hk);
        const bool is_q = hh < hq;
        const bf16* xr = is_q ? q + (size_t)tok * q_stride + (size_t)hh * d
                              : k + (size_t)tok * k_stride + (size_t)(hh - hq) * d;
        bf16* yr = is_q ? qo + ((size_t)tok * hq + hh) * d : ko + ((size_t)tok * hk + (hh - hq)) * d;
        float sn[2], cs[2], wv[4];
        qk_rope_angles((float)pos[tok], lane, theta, sn, cs);
#pragma unroll
        for (int i = 0; i < 4; ++i) wv[i] = __bfloat162float((is_q ? wq : wk)[lane + 32 * i]);
        qk_norm_rope_rows(xr, yr, 1, wv, lane, eps, sn, cs);
    }
}

// vime_qk_norm_rope with one warp per token instead of per head row: each lane's two rotation
// angles (pairs j = lane and lane + 32) and their sincos are computed once per token and used for
// all hq + hk heads (the per-row kernel computes them for every head: 40 times over at Qwen3-4B,
// which made it slower than the separate norm and rope kernels on a training batch). The same
// operations per element, so the same bits as vime_qk_norm_rope and as the four separate kernels.
//
extern "C" __global__ void vime_qk_norm_rope_tok(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                                 const bf16* __restrict__ wq, const bf16* __restrict__ wk,
                                                 const unsigned int* __restrict__ pos, bf16* __restrict__ qo,
                                                 bf16* __restrict__ ko, int t, int hq, int hk, float eps,
                                                 float theta, long long q_stride, long long k_stride) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float wqv[4], wkv[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        wqv[i] = __bfloat162float(wq[lane + 32 * i]);
        wkv[i] = __bfloat162float(wk[lane + 32 * i]);
    }
    for (int tok = blockIdx.x * RMSW_WARPS + warp; tok < t; tok += gridDim.x * RMSW_WARPS) {
        float sn[2], cs[2];
        qk_rope_angles((float)pos[tok], lane, theta, sn, cs);
        for (int h0 = 0; h0 < hq; h0 += QK_GROUP)
            qk_norm_rope_rows(q + (size_t)tok * q_stride + (size_t)h0 * 128, qo + ((size_t)tok * hq + h0) * 128,
                              min(QK_GROUP, hq - h0), wqv, lane, eps, sn, cs);
        for (int h0 = 0; h0 < hk; h0 += QK_GROUP)
            qk_norm_rope_rows(k + (size_t)tok * k_stride + (size_t)h0 * 128, ko + ((size_t)tok * hk + h0) * 128,
                              min(QK_GROUP, hk - h0), wkv, lane, eps, sn, cs);
    }
}

// One head row of vime_qk_norm_rope_bwd_tok: gr the gradient of the rotated output, xr the norm's
// input, dr the input's gradient; dwv accumulates the weight's gradient (the lane's 4 columns).
__device__ __forceinline__ void qk_norm_rope_bwd_row(const bf16* __restrict__ gr, const bf16* __restrict__ xr,
                                                     bf16* __restrict__ dr, const float (&wv)[4], float (&dwv)[4],
                                                     int lane, float eps, const float* sn, const float* cs) {
    float gv[4], xv[4];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        float y1, y2;
        rope_rot(__bfloat162float(gr[lane + 32 * i]), __bfloat162float(gr[lane + 32 * i + 64]), cs[i], sn[i], &y1,
                 &y2);
        gv[i] = __bfloat162float(__float2bfloat16(y1));
        gv[i + 2] = __bfloat162float(__float2bfloat16(y2));
    }
    const float rstd = head_row_rstd(xr, lane, eps, xv);
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float xhat = xv[i] * rstd;
        dwv[i] += gv[i] * xhat;
        dot += gv[i] * wv[i] * xhat;
    }
    dot = warp_sum(dot);
    const float mean = dot / 128.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) dr[lane + 32 * i] = __float2bfloat16(rstd * (gv[i] * wv[i] - xv[i] * rstd * mean));
}

// The backward of vime_qk_norm_rope_tok in one pass (training, d = 128), a warp a token: for each
// head row, the rotation back by the token's angles (rounded to bf16, as vime_rope with sign -1
// writes it), then vime_rmsnorm_bwd_warp's RMSNorm backward of that row. So dq/dk are meant to
// have the bits of those two kernels in sequence (the kernel check compares them). The weights'
// gradients are per-block partials, q's and k's, which the caller sums in a fixed order; their
// rows are grouped otherwise than in the separate kernel, so their last bits may differ from it.
// gq/gk: [T, H, 128] contiguous; xq/xk: the norm's inputs, token rows q_stride / k_stride apart.
extern "C" __global__ void vime_qk_norm_rope_bwd_tok(const bf16* __restrict__ gq, const bf16* __restrict__ gk,
                                                     const bf16* __restrict__ xq, const bf16* __restrict__ xk,
                                                     const bf16* __restrict__ wq, const bf16* __restrict__ wk,
                                                     const unsigned int* __restrict__ pos, bf16* __restrict__ dq,
                                                     bf16* __restrict__ dk, float* __restrict__ dwq_part,
                                                     float* __restrict__ dwk_part, int t, int hq, int hk, float eps,
                                                     float theta, long long q_stride, long long k_stride) {
    __shared__ float red[RMSW_WARPS][2][128];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float wqv[4], wkv[4], dwq[4], dwk[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        wqv[i] = __bfloat162float(wq[lane + 32 * i]);
        wkv[i] = __bfloat162float(wk[lane + 32 * i]);
        dwq[i] = 0.f;
        dwk[i] = 0.f;
    }
    for (int tok = blockIdx.x * RMSW_WARPS + warp; tok < t; tok += gridDim.x * RMSW_WARPS) {
        float sn[2], cs[2];
        qk_rope_angles((float)pos[tok], lane, theta, sn, cs);
        sn[0] *= -1.f;
        sn[1] *= -1.f;
        for (int hh = 0; hh < hq; ++hh) {
            const size_t o = ((size_t)tok * hq + hh) * 128;
            qk_norm_rope_bwd_row(gq + o, xq + (size_t)tok * q_stride + (size_t)hh * 128, dq + o, wqv, dwq, lane, eps,
                                 sn, cs);
        }
        for (int hh = 0; hh < hk; ++hh) {
            const size_t o = ((size_t)tok * hk + hh) * 128;
            qk_norm_rope_bwd_row(gk + o, xk + (size_t)tok * k_stride + (size_t)hh * 128, dk + o, wkv, dwk, lane, eps,
                                 sn, cs);
        }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        red[warp][0][lane + 32 * i] = dwq[i];
        red[warp][1][lane + 32 * i] = dwk[i];
    }
    __syncthreads();
    for (int c = threadIdx.x; c < 256; c += blockDim.x) {
        const int which = c >> 7, col = c & 127;
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < RMSW_WARPS; ++k) s += red[k][which][col];
        (which ? dwk_part : dwq_part)[(size_t)blockIdx.x * 128 + col] = s;
    }
}

// The KV cache's append of one layer, K and V in one launch: pool_k[rows[r]] = src_k[r] and
// pool_v[rows[r]] = src_v[r] (as vime_rows_write_bf16, twice). Source rows are sk_stride /
// sv_stride elements apart (width when contiguous; wider when a source is a view of the fused
// q|k|v projection).
extern "C" __global__ void vime_rows_write2_bf16(bf16* __restrict__ pk, bf16* __restrict__ pv,
                                                 const bf16* __restrict__ sk, const bf16* __restrict__ sv,
                                                 const unsigned int* __restrict__ rows, unsigned long long n,
                                                 int width, long long sk_stride, long long sv_stride) {
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < 2 * n; i += stride) {
        const bool is_v = i >= n;
        const unsigned long long e = is_v ? i - n : i;
        const unsigned long long r = e / width, c = e % width;
        const bf16 x = is_v ? sv[r * sv_stride + c] : sk[r * sk_stride + c];
        (is_v ? pv : pk)[(unsigned long long)rows[r] * width + c] = x;
    }
}

// SwiGLU of the fused gate|up projection: y[r, c] = swiglu(gu[r, c], gu[r, inter + c]) for
// gu [t, 2 * inter] -> y [t, inter]; the same arithmetic as vime_swiglu_fwd, so the same bits.
extern "C" __global__ void vime_swiglu_packed(const bf16* __restrict__ gu, bf16* __restrict__ y, size_t t,
                                              int inter) {
    const size_t n = t * (size_t)inter;
    const size_t stride = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const size_t r = i / inter, c = i % inter;
        const bf16* row = gu + r * 2 * (size_t)inter;
        y[i] = __float2bfloat16(swiglu_f(__bfloat162float(row[c]), __bfloat162float(row[inter + c])));
    }
}

// ------------------------------------------------------------------------------------------------
// Row gather: out[r] = src[idx[r]] for r < rows, in 16-byte units (any dtype whose row is a
// multiple of 16 bytes; src and out 16-byte aligned: the Rust side checks). An index at or past
// src_rows gives a row of zeros. candle's index_select gives each 2-byte element a thread that
// divides its flat index three ways; here a block walks rows and its threads a row's 16-byte
// words.
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void vime_gather_rows16(uint4* __restrict__ out, const uint4* __restrict__ src,
                                              const unsigned int* __restrict__ idx, unsigned int rows,
                                              unsigned int src_rows, unsigned int width16) {
    for (unsigned int r = blockIdx.x; r < rows; r += gridDim.x) {
        const unsigned int j = idx[r];
        uint4* o = out + (unsigned long long)r * width16;
        if (j < src_rows) {
            const uint4* s = src + (unsigned long long)j * width16;
            for (unsigned int c = threadIdx.x; c < width16; c += blockDim.x) o[c] = s[c];
        } else {
            const uint4 zero = {0u, 0u, 0u, 0u};
            for (unsigned int c = threadIdx.x; c < width16; c += blockDim.x) o[c] = zero;
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Context parallelism's key-gradient scatter: out[index[j]] += src[j] over j in order, into zeros
// (candle's `zeros.index_add(index, src, 0)`). candle's kernel gives each of the row's `width`
// elements one thread that walks every j (1,024 threads for 8 KV heads, each ~10k dependent
// read-modify-writes at Qwen3-4B CP 2); here one thread holds 8 elements of one destination row
// and walks only that row's sources, listed by the host (`csr`: rows + 1 offsets, then the
// source rows, ascending j within a row). The adds are candle's (`__hadd`, rounded to bf16 each
// time, starting from +0, in the same order): the same bits. width8 = width / 8; src and out
// 16-byte aligned, width % 8 == 0 (the Rust side checks).
// ------------------------------------------------------------------------------------------------
extern "C" __global__ void vime_index_add_rows_bf16(bf16* __restrict__ out, const bf16* __restrict__ src,
                                                    const unsigned int* __restrict__ csr, unsigned int rows,
                                                    int width8) {
    const unsigned int* srcs = csr + rows + 1;
    const unsigned long long total = (unsigned long long)rows * width8;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long width = (unsigned long long)width8 * 8;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += stride) {
        const unsigned int r = (unsigned int)(i / width8);
        const unsigned long long c = (i % width8) * 8;
        __nv_bfloat162 acc[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) acc[k] = __floats2bfloat162_rn(0.f, 0.f);
        const unsigned int end = csr[r + 1];
        for (unsigned int e = csr[r]; e < end; ++e) {
            const uint4 u = *reinterpret_cast<const uint4*>(src + (unsigned long long)srcs[e] * width + c);
            const __nv_bfloat162* v = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
            for (int k = 0; k < 4; ++k) acc[k] = __hadd2(acc[k], v[k]);
        }
        *reinterpret_cast<uint4*>(out + (unsigned long long)r * width + c) = *reinterpret_cast<const uint4*>(acc);
    }
}
