// FP8 quantization with one scale per tensor (current scaling: the scale comes from this tensor's
// own amax, so the bits depend on nothing but the tensor). Compiled to PTX by kernels/build.rs
// and loaded by kernels/src/cuda.rs; kernels/src/fp8.rs holds the CPU reference, which these
// kernels match bit for bit (scripts/gpu/check_kernels.sh checks it).
//
//   amax      = max |x| (NaNs ignored, as fmaxf does)
//   scale     = fp8_max / amax, or 1 when amax is 0 or not finite     (fp8_max 448 E4M3, 57344 E5M2)
//   q         = fp8(x * scale), round to nearest even, saturated to +-fp8_max (NaN stays NaN)
//   scale_inv = 1 / scale: what a GEMM multiplies the product by to undo the scale
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <stdint.h>

#include "swiglu.cuh"

typedef __nv_bfloat16 bf16;

#define FULL_MASK 0xffffffffu

__device__ __forceinline__ unsigned short fp8x2(float a, float b, int e5m2) {
    return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3);
}

__device__ __forceinline__ float absmax8(uint4 u) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
    float m = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float2 f = __bfloat1622float2(h[j]);
        m = fmaxf(m, fmaxf(fabsf(f.x), fabsf(f.y)));
    }
    return m;
}

// The max of m over the block, in every thread. Once per kernel (it owns the shared buffer).
__device__ __forceinline__ float block_max(float m) {
    __shared__ float part[32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) part[warp] = m;
    __syncthreads();
    m = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.f;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, o));
    return m;
}

// The amax in two stages, with no atomics and no zero-fill: each block of this kernel writes the
// max |x| of its grid-stride share of the n values to partial[blockIdx.x] (f32 bits, NaNs
// ignored as fmaxf does), and the cast reduces the gridDim.x partials. Order-free: the amax is
// the same whatever the launch shape. 16-byte loads, four in flight per thread, when x is aligned.
extern "C" __global__ void vime_fp8_amax(const bf16* __restrict__ x, unsigned long long n,
                                         unsigned int* __restrict__ partial) {
    float m = 0.f;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long done = 0;
    if (((uintptr_t)x & 15) == 0) {
        const unsigned long long n8 = n / 8;
        const uint4* x8 = reinterpret_cast<const uint4*>(x);
        unsigned long long i = first;
        for (; i + 3 * stride < n8; i += 4 * stride) {
            uint4 u[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) u[k] = x8[i + k * stride];
#pragma unroll
            for (int k = 0; k < 4; ++k) m = fmaxf(m, absmax8(u[k]));
        }
        for (; i < n8; i += stride) m = fmaxf(m, absmax8(x8[i]));
        done = n8 * 8;
    }
    for (unsigned long long i = done + first; i < n; i += stride) m = fmaxf(m, fabsf(__bfloat162float(x[i])));
    m = block_max(m);
    if (threadIdx.x == 0) partial[blockIdx.x] = __float_as_uint(m);
}

// 8 values -> 8 FP8 bytes (the first in the lowest byte) as two words.
__device__ __forceinline__ uint2 fp8x8(uint4 u, float s, int e5m2) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
    unsigned int w[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        const float2 a = __bfloat1622float2(h[2 * j]), b = __bfloat1622float2(h[2 * j + 1]);
        w[j] = (unsigned int)fp8x2(__fmul_rn(a.x, s), __fmul_rn(a.y, s), e5m2) |
               ((unsigned int)fp8x2(__fmul_rn(b.x, s), __fmul_rn(b.y, s), e5m2) << 16);
    }
    return make_uint2(w[0], w[1]);
}

// Byte j of each of a, b, c, d, as one word (a's lowest).
__device__ __forceinline__ unsigned int gather4(unsigned int a, unsigned int b, unsigned int c, unsigned int d, int j) {
    const unsigned int sel = (unsigned int)j | ((unsigned int)(j + 4) << 4);
    return __byte_perm(__byte_perm(a, b, sel), __byte_perm(c, d, sel), 0x5410);
}

// The scale for an amax a: fp8_max / a x scale_mul, or 1 when a is 0 or not finite.
__device__ __forceinline__ float scale_of(float a, float scale_mul, int e5m2) {
    const float fmax = e5m2 ? 57344.f : 448.f;
    return (a > 0.f && a <= 3.402823466e38f) ? __fmul_rn(__fdiv_rn(fmax, a), scale_mul) : 1.f;
}

// The cast's tile: block (256 threads) over a 64 x 128 tile of a row-major [rows, cols] tensor,
// grid (ceil(cols / 128), ceil(rows / 64)). The loads: 16 threads a row, 8 values (16 bytes) each,
// four rows in flight per thread (rows sub, sub + 16, sub + 32, sub + 48 of the tile).
#define CT_ROWS 64
#define CT_COLS 128
#define CT_PITCH 33
struct CastTile {
    int rows, cols, r0, c0, seg, sub, c;
    __device__ __forceinline__ CastTile(int rows_, int cols_)
        : rows(rows_), cols(cols_), r0(blockIdx.y * CT_ROWS), c0(blockIdx.x * CT_COLS), seg(threadIdx.x & 15),
          sub(threadIdx.x >> 4), c(blockIdx.x * CT_COLS + 8 * (threadIdx.x & 15)) {}
    __device__ __forceinline__ int row(int p) const { return r0 + sub + 16 * p; }
    // Whether load p's 8 values start inside the tensor. With cols a multiple of 8, a segment is
    // all in or all out.
    __device__ __forceinline__ bool in(int p) const { return row(p) < rows && c < cols; }
};

// x[r, c .. c + 8) as 8 bf16 in a uint4 (zeros past cols), for a load inside the tensor: one
// 16-byte load when vec (cols a multiple of 8 and x 16-byte aligned), else element by element.
__device__ __forceinline__ uint4 load8(const bf16* __restrict__ x, const CastTile& t, int p, bool vec) {
    const size_t at = (size_t)t.row(p) * t.cols + t.c;
    if (vec) return *reinterpret_cast<const uint4*>(x + at);
    unsigned short e[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k = 0; k < 8 && t.c + k < t.cols; ++k) e[k] = __bfloat16_as_ushort(x[at + k]);
    return make_uint4(e[0] | ((unsigned)e[1] << 16), e[2] | ((unsigned)e[3] << 16), e[4] | ((unsigned)e[5] << 16),
                      e[6] | ((unsigned)e[7] << 16));
}

// The max |x| of a thread's four loads.
__device__ __forceinline__ float absmax_loads(const uint4 (&u)[4]) {
    float m = 0.f;
#pragma unroll
    for (int p = 0; p < 4; ++p) m = fmaxf(m, absmax8(u[p]));
    return m;
}

// Quantizes a thread's four loads u (zeros where a load lies outside the tensor) by s into out
// (row-major, 8-byte stores) and, when out_t is not null, into its transpose out_t [cols, ld_t]:
// the tile's FP8 bytes go through shared memory (33 words a row), a thread gathers 4 columns x 8
// rows with byte permutes, and 8 threads store one out_t row's 64 bytes.
//
// record, when not null, is raised (atomicMax of f32 bits) to the tile's max |u| (the zeros past
// the tensor do not move it), with no barrier of its own: each warp's max by shuffles before the
// stores; with a transpose, thread 0 raises the record once for the block after the barrier the
// transpose has anyway; without one, each warp raises it.
//
// Every thread of the block calls it, with the same record and out_t (it has a barrier when out_t
// is set); a second call on the same tile needs a __syncthreads between the two.
__device__ __forceinline__ void store_fp8(const uint4 (&u)[4], float s, int e5m2, const CastTile& t,
                                          unsigned int* tile, unsigned char* __restrict__ out,
                                          unsigned char* __restrict__ out_t, int ld_t,
                                          unsigned int* __restrict__ record) {
    __shared__ float warp_max[8];
    if (record != nullptr) {
        float m = absmax_loads(u);
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, o));
        if ((threadIdx.x & 31) == 0) {
            if (out_t == nullptr) atomicMax(record, __float_as_uint(m));
            else warp_max[threadIdx.x >> 5] = m;
        }
    }
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const int i = t.sub + 16 * p;
        const uint2 q = fp8x8(u[p], s, e5m2);
        tile[i * CT_PITCH + 2 * t.seg] = q.x;
        tile[i * CT_PITCH + 2 * t.seg + 1] = q.y;
        if (t.in(p)) {
            const size_t at = (size_t)t.row(p) * t.cols + t.c;
            if ((t.cols & 7) == 0) {
                *reinterpret_cast<uint2*>(out + at) = q;
            } else {
                for (int k = 0; k < 8 && t.c + k < t.cols; ++k)
                    out[at + k] = (unsigned char)((k < 4 ? q.x : q.y) >> (8 * (k & 3)));
            }
        }
    }
    if (out_t == nullptr) return;
    __syncthreads();
    if (record != nullptr && threadIdx.x == 0) {
        float m = 0.f;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) m = fmaxf(m, warp_max[w]);
        atomicMax(record, __float_as_uint(m));
    }
    const int g = threadIdx.x & 7, qd = threadIdx.x >> 3;
    const int rr = t.r0 + 8 * g;
    if (rr >= t.rows) return;
    unsigned int w[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = tile[(8 * g + i) * CT_PITCH + qd];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int cc = t.c0 + 4 * qd + j;
        if (cc >= t.cols) break;
        const uint2 v = make_uint2(gather4(w[0], w[1], w[2], w[3], j), gather4(w[4], w[5], w[6], w[7], j));
        const size_t at = (size_t)cc * ld_t + rr;
        // Rows past `rows` in the tile are zeros: with ld_t a multiple of 8 they fit in the row.
        if ((ld_t & 7) == 0) {
            *reinterpret_cast<uint2*>(out_t + at) = v;
        } else {
            for (int k = 0; k < 8 && rr + k < t.rows; ++k)
                out_t[at + k] = (unsigned char)((k < 4 ? v.x : v.y) >> (8 * (k & 3)));
        }
    }
}

// q = fp8(x * scale) for x [rows, cols] (row-major, contiguous) into out [rows, cols] and, when
// out_t is not null, into out_t [cols, ld_t] (the transpose, which Hopper's FP8 GEMMs need for
// the backward: they take only K-major operands; ld_t >= rows, the columns past rows zeros or
// untouched).
//
// The scale: current scaling (amax_in null) from the nparts amax partials of vime_fp8_amax;
// delayed scaling (amax_in not null) from *amax_in, an amax of earlier tensors (partial is not
// read), divided by 2^margin (scale_mul = 2^-margin, exact). record, when not null, is an f32
// amax (its bits, an unsigned int) raised by atomicMax to this tensor's amax: with current
// scaling block (0, 0) raises it to the amax it scaled by; with delayed scaling every block to its
// tile's max |x| (NaNs ignored, as fmaxf does; see store_fp8). Non-negative floats order as their
// bits, so the result is the max whatever the order.
//
// The tile and its stores: CastTile and store_fp8. Block (0, 0) writes scale_inv.
extern "C" __global__ void __launch_bounds__(256)
vime_fp8_cast(const bf16* __restrict__ x, int rows, int cols, const unsigned int* __restrict__ partial,
              int nparts, const float* __restrict__ amax_in, float scale_mul, unsigned int* __restrict__ record,
              float* __restrict__ scale_inv, unsigned char* __restrict__ out,
              unsigned char* __restrict__ out_t, int ld_t, int e5m2) {
    __shared__ unsigned int tile[CT_ROWS * CT_PITCH];
    float a = 0.f;
    if (amax_in != nullptr) {
        a = *amax_in;
    } else {
        for (int i = threadIdx.x; i < nparts; i += blockDim.x) a = fmaxf(a, __uint_as_float(partial[i]));
        a = block_max(a);
        if (record != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0)
            atomicMax(record, __float_as_uint(a));
    }
    const float s = scale_of(a, scale_mul, e5m2);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *scale_inv = __fdiv_rn(1.f, s);
    const CastTile t(rows, cols);
    const bool vec = (cols & 7) == 0 && ((uintptr_t)x & 15) == 0;
    uint4 u[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) u[p] = t.in(p) ? load8(x, t, p, vec) : make_uint4(0, 0, 0, 0);
    // Delayed scaling records each tile's max |x| as it stores (current scaling recorded above).
    store_fp8(u, s, e5m2, t, tile, out, out_t, ld_t, amax_in != nullptr ? record : nullptr);
}

// SwiGLU's output (swiglu.cuh, rounded to bf16 as vime_swiglu_fwd rounds it) of 8 gate and up
// values.
__device__ __forceinline__ uint4 swiglu8(uint4 gv, uint4 uv) {
    const bf16* g8 = reinterpret_cast<const bf16*>(&gv);
    const bf16* u8 = reinterpret_cast<const bf16*>(&uv);
    uint4 yv;
    bf16* y8 = reinterpret_cast<bf16*>(&yv);
#pragma unroll
    for (int k = 0; k < 8; ++k) y8[k] = __float2bfloat16(swiglu_f(__bfloat162float(g8[k]), __bfloat162float(u8[k])));
    return yv;
}

// vime_fp8_cast of swiglu(gate, up) (vime_swiglu_fwd's bf16 output) with delayed scaling,
// computed as it loads: the bf16 output is never written. gate and up [rows, cols], contiguous;
// amax_in is required (delayed scaling; a role with no history yet takes the two kernels).
// record (optional) is raised to each tile's max |y|. The same bits as vime_swiglu_fwd then
// vime_fp8_cast with the same amax_in.
extern "C" __global__ void __launch_bounds__(256)
vime_fp8_swiglu_cast(const bf16* __restrict__ gate, const bf16* __restrict__ up, int rows, int cols,
                     const float* __restrict__ amax_in, float scale_mul, unsigned int* __restrict__ record,
                     float* __restrict__ scale_inv, unsigned char* __restrict__ out,
                     unsigned char* __restrict__ out_t, int ld_t, int e5m2) {
    __shared__ unsigned int tile[CT_ROWS * CT_PITCH];
    const float s = scale_of(*amax_in, scale_mul, e5m2);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *scale_inv = __fdiv_rn(1.f, s);
    const CastTile t(rows, cols);
    const bool vec = (cols & 7) == 0 && (((uintptr_t)gate | (uintptr_t)up) & 15) == 0;
    uint4 g[4], v[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
        const bool in = t.in(p);
        g[p] = in ? load8(gate, t, p, vec) : make_uint4(0, 0, 0, 0);
        v[p] = in ? load8(up, t, p, vec) : make_uint4(0, 0, 0, 0);
    }
    uint4 y[4];
    // Outside the tensor the output is zeros (+0), as vime_fp8_cast's loads there.
#pragma unroll
    for (int p = 0; p < 4; ++p) y[p] = t.in(p) ? swiglu8(g[p], v[p]) : make_uint4(0, 0, 0, 0);
    store_fp8(y, s, e5m2, t, tile, out, out_t, ld_t, record);
}

// The two casts of SwiGLU's input gradients with delayed scaling, computed as they load:
// (d_gate, d_up) = swiglu'(gate, up; dy) (swiglu.cuh, rounded to bf16 as vime_swiglu_bwd rounds
// them), d_gate quantized by *amax_g into out_g and out_gt, d_up by *amax_u into out_u and out_ut
// (the transposes [cols, ld_t]; both required), each with its scale_inv and optional record. The
// bf16 gradients are never written. The same bits as vime_swiglu_bwd then vime_fp8_cast of each.
extern "C" __global__ void __launch_bounds__(256)
vime_fp8_swiglu_bwd_cast(const bf16* __restrict__ gate, const bf16* __restrict__ up, const bf16* __restrict__ dy,
                         int rows, int cols, const float* __restrict__ amax_g, const float* __restrict__ amax_u,
                         float scale_mul, unsigned int* __restrict__ rec_g, unsigned int* __restrict__ rec_u,
                         float* __restrict__ sinv_g, float* __restrict__ sinv_u, unsigned char* __restrict__ out_g,
                         unsigned char* __restrict__ out_gt, unsigned char* __restrict__ out_u,
                         unsigned char* __restrict__ out_ut, int ld_t, int e5m2) {
    __shared__ unsigned int tile[CT_ROWS * CT_PITCH];
    const float sg = scale_of(*amax_g, scale_mul, e5m2), su = scale_of(*amax_u, scale_mul, e5m2);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {
        *sinv_g = __fdiv_rn(1.f, sg);
        *sinv_u = __fdiv_rn(1.f, su);
    }
    const CastTile t(rows, cols);
    const bool vec = (cols & 7) == 0 && (((uintptr_t)gate | (uintptr_t)up | (uintptr_t)dy) & 15) == 0;
    uint4 dg[4], du[4];
    {
        uint4 g[4], v[4], o[4];
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            const bool in = t.in(p);
            g[p] = in ? load8(gate, t, p, vec) : make_uint4(0, 0, 0, 0);
            v[p] = in ? load8(up, t, p, vec) : make_uint4(0, 0, 0, 0);
            o[p] = in ? load8(dy, t, p, vec) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            dg[p] = make_uint4(0, 0, 0, 0);
            du[p] = make_uint4(0, 0, 0, 0);
            if (!t.in(p)) continue;
            const bf16* g8 = reinterpret_cast<const bf16*>(&g[p]);
            const bf16* u8 = reinterpret_cast<const bf16*>(&v[p]);
            const bf16* o8 = reinterpret_cast<const bf16*>(&o[p]);
            bf16* dg8 = reinterpret_cast<bf16*>(&dg[p]);
            bf16* du8 = reinterpret_cast<bf16*>(&du[p]);
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                float a, b;
                swiglu_b(__bfloat162float(g8[k]), __bfloat162float(u8[k]), __bfloat162float(o8[k]), a, b);
                dg8[k] = __float2bfloat16(a);
                du8[k] = __float2bfloat16(b);
            }
        }
    }
    store_fp8(dg, sg, e5m2, t, tile, out_g, out_gt, ld_t, rec_g);
    __syncthreads();
    store_fp8(du, su, e5m2, t, tile, out_u, out_ut, ld_t, rec_u);
}

// Delayed scaling's history, one row of width 2 + n_hist floats a slot: [pending, amax, h_0 ..
// h_{n_hist-1}] (h_0 the newest). For each slot whose mask byte is set: the history moves one
// place (the oldest drops), h_0 = pending, pending = 0, and amax = h_0 (most recent) or the max
// of the history (use_max). Slots whose byte is 0 are left as they are. A thread a slot.
extern "C" __global__ void vime_fp8_amax_commit(float* __restrict__ hist, const unsigned char* __restrict__ mask,
                                                int slots, int n_hist, int use_max) {
    const int s = blockIdx.x * blockDim.x + threadIdx.x;
    if (s >= slots || mask[s] == 0) return;
    float* row = hist + (size_t)s * (2 + n_hist);
    for (int i = n_hist - 1; i > 0; --i) row[2 + i] = row[1 + i];
    row[2] = row[0];
    row[0] = 0.f;
    float a = row[2];
    if (use_max)
        for (int i = 1; i < n_hist; ++i) a = fmaxf(a, row[2 + i]);
    row[1] = a;
}
