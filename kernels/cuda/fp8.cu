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

typedef __nv_bfloat16 bf16;

#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float fp8_scale(const unsigned int* amax, int e5m2) {
    const float a = __uint_as_float(*amax);
    const float fmax = e5m2 ? 57344.f : 448.f;
    return (a > 0.f && a <= 3.402823466e38f) ? __fdiv_rn(fmax, a) : 1.f;
}

__device__ __forceinline__ unsigned short fp8x2(float a, float b, int e5m2) {
    return __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3);
}

__device__ __forceinline__ unsigned char fp8x1(float a, int e5m2) {
    return __nv_cvt_float_to_fp8(a, __NV_SATFINITE, e5m2 ? __NV_E5M2 : __NV_E4M3);
}

// *amax = max(*amax, max |x[i]|) over n values, as f32 bits (non-negative floats order as their
// bits, so atomicMax on the bits is a float max; the caller zero-fills *amax). Order-free: the
// result is the same whatever the launch shape. 16-byte loads when x is aligned.
extern "C" __global__ void vime_fp8_amax(const bf16* __restrict__ x, unsigned long long n,
                                         unsigned int* __restrict__ amax) {
    float m = 0.f;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long done = 0;
    if (((uintptr_t)x & 15) == 0) {
        const unsigned long long n8 = n / 8;
        const uint4* x8 = reinterpret_cast<const uint4*>(x);
        for (unsigned long long i = first; i < n8; i += stride) {
            const uint4 u = x8[i];
            const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float2 f = __bfloat1622float2(h[j]);
                m = fmaxf(m, fmaxf(fabsf(f.x), fabsf(f.y)));
            }
        }
        done = n8 * 8;
    }
    for (unsigned long long i = done + first; i < n; i += stride) m = fmaxf(m, fabsf(__bfloat162float(x[i])));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, o));
    __shared__ float part[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) part[warp] = m;
    __syncthreads();
    if (warp == 0) {
        m = lane < (int)(blockDim.x >> 5) ? part[lane] : 0.f;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(FULL_MASK, m, o));
        if (lane == 0) atomicMax(amax, __float_as_uint(m));
    }
}

// q = fp8(x * scale) for x [rows, cols] (row-major, contiguous) into out [rows, cols] and, when
// out_t is not null, into out_t [cols, ld_t] (the transpose, which Hopper's FP8 GEMMs need for the
// backward: they take only K-major operands; ld_t >= rows, the columns past rows untouched). Block (256) = 8 warps over a 64 x 64 tile, grid
// (ceil(cols / 64), ceil(rows / 64)). Block (0, 0) writes scale_inv.
#define FP8_TILE 64
extern "C" __global__ void vime_fp8_cast(const bf16* __restrict__ x, int rows, int cols,
                                         const unsigned int* __restrict__ amax, float* __restrict__ scale_inv,
                                         unsigned char* __restrict__ out, unsigned char* __restrict__ out_t,
                                         int ld_t, int e5m2) {
    __shared__ float tile[FP8_TILE][FP8_TILE + 1];
    const float s = fp8_scale(amax, e5m2);
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) *scale_inv = __fdiv_rn(1.f, s);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r0 = blockIdx.y * FP8_TILE, c0 = blockIdx.x * FP8_TILE;
    const int c = c0 + 2 * lane;
    const bool pairs = (cols & 1) == 0;
    for (int i = warp; i < FP8_TILE; i += 8) {
        const int r = r0 + i;
        if (r >= rows) break;
        const size_t at = (size_t)r * cols + c;
        float v0 = 0.f, v1 = 0.f;
        if (c < cols) v0 = __fmul_rn(__bfloat162float(x[at]), s);
        if (c + 1 < cols) v1 = __fmul_rn(__bfloat162float(x[at + 1]), s);
        tile[i][2 * lane] = v0;
        tile[i][2 * lane + 1] = v1;
        if (pairs && c + 1 < cols) {
            *reinterpret_cast<unsigned short*>(out + at) = fp8x2(v0, v1, e5m2);
        } else {
            if (c < cols) out[at] = fp8x1(v0, e5m2);
            if (c + 1 < cols) out[at + 1] = fp8x1(v1, e5m2);
        }
    }
    if (out_t == nullptr) return;
    __syncthreads();
    const int r = r0 + 2 * lane;
    const bool pairs_t = (ld_t & 1) == 0;
    for (int j = warp; j < FP8_TILE; j += 8) {
        const int cc = c0 + j;
        if (cc >= cols) break;
        const size_t at = (size_t)cc * ld_t + r;
        const float v0 = tile[2 * lane][j], v1 = tile[2 * lane + 1][j];
        if (pairs_t && r + 1 < rows) {
            *reinterpret_cast<unsigned short*>(out_t + at) = fp8x2(v0, v1, e5m2);
        } else {
            if (r < rows) out_t[at] = fp8x1(v0, e5m2);
            if (r + 1 < rows) out_t[at + 1] = fp8x1(v1, e5m2);
        }
    }
}
