// A host stand-in for CUDA's <cuda_bf16.h>, enough for kernels/cuda/*.cu under kernels/sim/simt.h:
// bf16 storage and the two conversions, with the device's rounding (round to nearest even, NaN to
// the canonical 0x7fff).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
    uint16_t x;
};

inline float __bfloat162float(__nv_bfloat16 h) {
    const uint32_t u = static_cast<uint32_t>(h.x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline __nv_bfloat16 __float2bfloat16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if (std::isnan(f)) return __nv_bfloat16{0x7fff};
    u += 0x7fffu + ((u >> 16) & 1u);
    return __nv_bfloat16{static_cast<uint16_t>(u >> 16)};
}

inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __float2bfloat16(f); }

// Pairs, and the add of two bf16 values rounded once to bf16 (the device's add.rn.bf16x2: the
// float sum of two bf16 values rounds to the same bf16 as the exact sum). For
// vime_index_add_rows_bf16, which the simulator compiles but does not run yet.
struct alignas(4) __nv_bfloat162 {
    __nv_bfloat16 x, y;
};

inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return __nv_bfloat162{__float2bfloat16(a), __float2bfloat16(b)};
}

inline __nv_bfloat162 __hadd2(__nv_bfloat162 a, __nv_bfloat162 b) {
    return __nv_bfloat162{__float2bfloat16(__bfloat162float(a.x) + __bfloat162float(b.x)),
                          __float2bfloat16(__bfloat162float(a.y) + __bfloat162float(b.y))};
}
