// SwiGLU's elementwise arithmetic, shared by ops.cu (vime_swiglu_fwd / _bwd, vime_swiglu_packed)
// and fp8.cu (the FP8 casts that compute SwiGLU as they load): one definition, so the fused casts
// quantize the very bf16 values the separate kernels write (the GPU check compares the bits).
//   y = silu(g) * u, silu(g) = g * sigmoid(g)
//   d_gate = gy * u * sig * (1 + g * (1 - sig)),  d_up = gy * silu(g)
#pragma once

__device__ __forceinline__ float sigmoidf_(float g) { return 1.f / (1.f + expf(-g)); }

__device__ __forceinline__ float swiglu_f(float g, float u) { return g * sigmoidf_(g) * u; }

__device__ __forceinline__ void swiglu_b(float g, float u, float o, float& dg, float& du) {
    const float sg = sigmoidf_(g);
    dg = o * u * sg * (1.f + g * (1.f - sg));
    du = o * g * sg;
}
