// A host stand-in for CUDA's <cuda_fp8.h>, enough for kernels/cuda/fp8.cu under kernels/sim/simt.h:
// the float pair to FP8 pair conversion (round to nearest even, __NV_SATFINITE: values past the
// format's largest finite one, infinities included, become it; NaN becomes 0x7f), and the other
// intrinsics fp8.cu uses (bit casts, byte permutes, atomicMax, bf16 pair reads, make_*). The
// conversion picks the nearest of the format's 127 non-negative finite values by their exact
// values, a different route to the bits than the device's, so the simulator's reference and
// kernel agree only if the kernel feeds the conversion the right values in the right places.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cuda_bf16.h"

enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };

namespace sim {
// The value of non-negative FP8 code c (sign bit clear) of E4M3 (bias 7, 3 mantissa bits) or
// E5M2 (bias 15, 2 mantissa bits).
inline double fp8_value(int c, bool e5m2) {
    const int mb = e5m2 ? 2 : 3, bias = e5m2 ? 15 : 7;
    const int e = c >> mb, m = c & ((1 << mb) - 1);
    if (e == 0) return std::ldexp((double)m, 1 - bias - mb);
    return std::ldexp(1.0 + (double)m / (1 << mb), e - bias);
}
// float -> FP8 code, round to nearest even, saturated to the largest finite value.
inline unsigned char fp8_of(float x, bool e5m2) {
    if (std::isnan(x)) return 0x7f;
    const unsigned char sign = std::signbit(x) ? 0x80 : 0;
    const double a = std::fabs((double)x);
    const int top = e5m2 ? 0x7b : 0x7e;  // 57344 and 448
    if (a >= fp8_value(top, e5m2)) return sign | top;
    int lo = 0;
    while (lo < top && fp8_value(lo + 1, e5m2) <= a) ++lo;
    const double d0 = a - fp8_value(lo, e5m2), d1 = fp8_value(lo + 1, e5m2) - a;
    const int c = (d0 < d1 || (d0 == d1 && (lo & 1) == 0)) ? lo : lo + 1;
    return sign | (unsigned char)c;
}
}  // namespace sim

inline unsigned short __nv_cvt_float2_to_fp8x2(float2 v, __nv_saturation_t, __nv_fp8_interpretation_t f) {
    const bool e5m2 = f == __NV_E5M2;
    return (unsigned short)(sim::fp8_of(v.x, e5m2) | (sim::fp8_of(v.y, e5m2) << 8));
}

inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.x; }
inline float2 __bfloat1622float2(__nv_bfloat162 h) { return float2{__bfloat162float(h.x), __bfloat162float(h.y)}; }
inline float2 make_float2(float a, float b) { return float2{a, b}; }
inline uint2 make_uint2(unsigned a, unsigned b) { return uint2{a, b}; }
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
// PTX prmt (default mode): byte i of the result is byte ((s >> 4i) & 7) of {b, a} (a the low word).
inline unsigned __byte_perm(unsigned a, unsigned b, unsigned s) {
    const uint64_t v = ((uint64_t)b << 32) | a;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
    return r;
}
// One block runs at a time and its fibers switch only at barriers: a plain read-modify-write.
inline unsigned atomicMax(unsigned* p, unsigned v) {
    const unsigned old = *p;
    if (v > old) *p = v;
    return old;
}
