// The FP8 quantization kernels of kernels/cuda/fp8.cu under the simulator, against a host
// reference of the same rule (kernels/src/fp8.rs's CPU path): amax = max |x| (NaN ignored),
// scale = fp8_max / amax x scale_mul (1 for amax 0 or not finite), q = fp8(x * scale) rounded to
// nearest even and saturated, scale_inv = 1 / scale, the transpose into [cols, ld_t].
//
// - Current scaling: vime_fp8_amax's partials, then vime_fp8_cast reducing them; with a record
//   pointer, block (0, 0) raises it to the amax.
// - Delayed scaling (--fp8-recipe delayed): the cast scales by *amax_in x 2^-margin without reading
//   partials, and raises the record to the max |x| of its tiles by atomicMax, with and without a
//   transpose, with an amax_in below the tensor's (saturation) and above it; without a record too.
// - Shapes: 16-byte rows (the vector path), an odd width (the scalar path), rows that do not fill
//   the 64-row tiles, padded transposes (ld_t > rows), a misaligned input; E4M3 and E5M2.
// - vime_fp8_amax_commit over slots with a mask: the history moves, pending becomes h_0 and 0,
//   the amax is h_0 or the history's max; unmasked slots are untouched.
//
// Prints "FP8 CAST: PASS" or what differs.
#include "simt.h"
#include "testing.h"
#include "../cuda/fp8.cu"

#include <cstdio>
#include <vector>

static sim::Rng rng{0x9e3779b97f4a7c15ull};

static int bad = 0;
static void expect(bool ok, const char* what, int c) {
    if (!ok) {
        ++bad;
        std::printf("  FAIL case %d: %s\n", c, what);
    }
}

// One case: x [rows, cols] (values up to `scale`, one outlier) at `offset` elements into its
// buffer; `delayed`: amax_in = amax x `rel` (else current scaling); `record`: a record pointer.
static void run_case(int c, int rows, int cols, float scale, int offset, bool e5m2, bool delayed, float rel,
                     float scale_mul, bool record, bool transpose = true) {
    std::vector<bf16> buf((size_t)rows * cols + offset + 8);
    bf16* x = buf.data() + offset;
    float amax = 0.f;
    for (int i = 0; i < rows * cols; ++i) {
        float v = rng.sym(scale);
        // The outlier in the last column's tiles, in the fourth load of the block's last warp
        // (row 127: tile row 63, loaded by threads 240-255) where the tensor is that tall: a record
        // taken from fewer blocks, warps or loads misses it.
        if (i == std::min(rows - 1, 127) * cols + cols - 1) v = -3.5f * scale;
        x[i] = __float2bfloat16(v);
        amax = fmaxf(amax, fabsf(__bfloat162float(x[i])));
    }
    const int ld_t = (rows + 15) / 16 * 16;
    std::vector<unsigned char> out((size_t)rows * cols, 0xAA), out_t((size_t)cols * ld_t, 0);
    float sinv = -1.f;
    unsigned rec = record ? 0u : 0xdeadbeefu;
    const float fmax = e5m2 ? 57344.f : 448.f;
    float amax_in = amax * rel;
    const int nparts = 5;
    std::vector<unsigned> parts(nparts, 0xffffffffu);
    if (!delayed) {
        sim::launch(dim3(nparts), dim3(256), [&] { vime_fp8_amax(x, (unsigned long long)rows * cols, parts.data()); });
    }
    const dim3 grid((cols + 127) / 128, (rows + 63) / 64);
    sim::launch(grid, dim3(256), [&] {
        vime_fp8_cast(x, rows, cols, parts.data(), nparts, delayed ? &amax_in : nullptr, delayed ? scale_mul : 1.f,
                      record ? &rec : nullptr, &sinv, out.data(), transpose ? out_t.data() : nullptr, ld_t,
                      e5m2 ? 1 : 0);
    });
    // The reference.
    const float a = delayed ? amax_in : amax;
    const float s = (a > 0.f && std::isfinite(a)) ? (fmax / a) * (delayed ? scale_mul : 1.f) : 1.f;
    expect(sinv == 1.f / s, "scale_inv", c);
    int wrong = 0, wrong_t = 0, sat = 0;
    for (int r = 0; r < rows; ++r)
        for (int k = 0; k < cols; ++k) {
            const float v = __bfloat162float(x[(size_t)r * cols + k]);
            const unsigned char q = sim::fp8_of(v * s, e5m2);
            wrong += out[(size_t)r * cols + k] != q;
            wrong_t += out_t[(size_t)k * ld_t + r] != (transpose ? q : 0);
            sat += std::fabs(v * s) >= fmax;
        }
    int pad = 0;  // the transpose's columns past rows stay as they were (zeros)
    for (int k = 0; k < cols; ++k)
        for (int r = rows; r < ld_t; ++r) pad += out_t[(size_t)k * ld_t + r] != 0;
    expect(wrong == 0, "bits", c);
    expect(wrong_t == 0, "transpose bits", c);
    expect(pad == 0, "transpose padding", c);
    if (record) expect(rec == __float_as_uint(amax), "record = the tensor's amax", c);
    else expect(rec == 0xdeadbeefu, "no record pointer, nothing written", c);
    if (delayed) expect(parts[0] == 0xffffffffu, "delayed scaling reads no partials", c);
    std::printf("case %d: [%d, %d] +%d %s %s%s%s amax %.4g -> scale %.4g, %d saturated: %s\n", c, rows, cols,
                offset, e5m2 ? "E5M2" : "E4M3", delayed ? "delayed" : "current", record ? " +record" : "",
                transpose ? "" : " no transpose", amax, s, sat,
                wrong || wrong_t || pad ? "DIFFERS" : "ok");
}

static void commit_case(int c, int n_hist, bool use_max) {
    const int slots = 5, w = 2 + n_hist;
    std::vector<float> h((size_t)slots * w);
    for (auto& v : h) v = rng.uniform() * 10.f;
    const std::vector<float> before = h;
    const unsigned char mask[slots] = {1, 0, 1, 1, 0};
    sim::launch(dim3(1), dim3(128), [&] { vime_fp8_amax_commit(h.data(), mask, slots, n_hist, use_max ? 1 : 0); });
    for (int s = 0; s < slots; ++s) {
        const float* b = &before[(size_t)s * w];
        const float* a = &h[(size_t)s * w];
        if (!mask[s]) {
            expect(std::memcmp(a, b, sizeof(float) * w) == 0, "an unmasked slot is untouched", c);
            continue;
        }
        bool ok = a[0] == 0.f && a[2] == b[0];
        for (int i = 1; i < n_hist; ++i) ok &= a[2 + i] == b[1 + i];
        float m = a[2];
        if (use_max)
            for (int i = 1; i < n_hist; ++i) m = fmaxf(m, a[2 + i]);
        ok &= a[1] == m;
        expect(ok, "a committed slot", c);
    }
    std::printf("commit case %d: history %d, %s\n", c, n_hist, use_max ? "max" : "most recent");
}

// The fused SwiGLU casts against their two-kernel references: y = bf16(swiglu(g, u)) (swiglu.cuh,
// the arithmetic vime_swiglu_fwd runs) then vime_fp8_cast of y; (dg, du) = bf16(swiglu'(g, u; dy))
// then vime_fp8_cast of each. Bit for bit: the FP8 rows, the transposes (padding untouched),
// scale_inv and the records. g, u and dy at `offset` elements into their buffers (misaligned:
// the scalar loads); an outlier in the last column's tile, fourth load of the last warp.
static void swiglu_case(int c, int rows, int cols, int offset, bool e5m2, float rel, float scale_mul, bool record,
                        bool transpose) {
    const size_t n = (size_t)rows * cols;
    std::vector<bf16> gb(n + offset + 8), ub(n + offset + 8), ob(n + offset + 8);
    bf16 *g = gb.data() + offset, *u = ub.data() + offset, *o = ob.data() + offset;
    const size_t hot = (size_t)std::min(rows - 1, 127) * cols + cols - 1;
    for (size_t i = 0; i < n; ++i) {
        g[i] = __float2bfloat16(i == hot ? 3.f : rng.sym(4.f));
        u[i] = __float2bfloat16(i == hot ? -9.f : rng.sym(2.f));
        o[i] = __float2bfloat16(i == hot ? 7.f : rng.sym(0.01f));
    }
    // The bf16 tensors the separate kernels write.
    std::vector<bf16> y(n), dg(n), du(n);
    float ay = 0.f, ag = 0.f, au = 0.f;
    for (size_t i = 0; i < n; ++i) {
        const float gf = __bfloat162float(g[i]), uf = __bfloat162float(u[i]), of = __bfloat162float(o[i]);
        y[i] = __float2bfloat16(swiglu_f(gf, uf));
        float a, b;
        swiglu_b(gf, uf, of, a, b);
        dg[i] = __float2bfloat16(a);
        du[i] = __float2bfloat16(b);
        ay = fmaxf(ay, fabsf(__bfloat162float(y[i])));
        ag = fmaxf(ag, fabsf(__bfloat162float(dg[i])));
        au = fmaxf(au, fabsf(__bfloat162float(du[i])));
    }
    const int ld_t = (rows + 15) / 16 * 16;
    const dim3 grid((cols + 127) / 128, (rows + 63) / 64);
    struct Out {
        std::vector<unsigned char> q, qt;
        float sinv = -1.f;
        unsigned rec = 0;
    };
    auto fresh = [&]() {
        Out r;
        r.q.assign(n, 0xAA);
        r.qt.assign((size_t)cols * ld_t, 0);
        r.rec = record ? 0u : 0xdeadbeefu;
        return r;
    };
    // The reference: vime_fp8_cast of a bf16 tensor under delayed scaling by amax_in.
    auto cast = [&](const bf16* x, float amax_in, bool with_t) {
        Out r = fresh();
        unsigned part = 0;
        sim::launch(grid, dim3(256), [&] {
            vime_fp8_cast(x, rows, cols, &part, 1, &amax_in, scale_mul, record ? &r.rec : nullptr, &r.sinv, r.q.data(),
                          with_t ? r.qt.data() : nullptr, ld_t, e5m2 ? 1 : 0);
        });
        return r;
    };
    auto same = [&](const Out& a, const Out& b, const char* what) {
        char msg[96];
        std::snprintf(msg, sizeof msg, "%s: rows", what);
        expect(a.q == b.q, msg, c);
        std::snprintf(msg, sizeof msg, "%s: transpose", what);
        expect(a.qt == b.qt, msg, c);
        std::snprintf(msg, sizeof msg, "%s: scale_inv", what);
        expect(a.sinv == b.sinv && a.sinv > 0.f, msg, c);
        std::snprintf(msg, sizeof msg, "%s: record", what);
        expect(a.rec == b.rec, msg, c);
    };
    // Forward.
    const float in_y = ay * rel;
    const Out ref_y = cast(y.data(), in_y, transpose);
    Out got_y = fresh();
    sim::launch(grid, dim3(256), [&] {
        vime_fp8_swiglu_cast(g, u, rows, cols, &in_y, scale_mul, record ? &got_y.rec : nullptr, &got_y.sinv,
                             got_y.q.data(), transpose ? got_y.qt.data() : nullptr, ld_t, e5m2 ? 1 : 0);
    });
    same(got_y, ref_y, "swiglu cast");
    if (record) expect(got_y.rec == __float_as_uint(ay), "swiglu record = max |y|", c);
    // Backward (always with transposes: the weight gradients read them).
    const float in_g = ag * rel, in_u = au * rel * 0.5f;
    const Out ref_g = cast(dg.data(), in_g, true), ref_u = cast(du.data(), in_u, true);
    Out got_g = fresh(), got_u = fresh();
    sim::launch(grid, dim3(256), [&] {
        vime_fp8_swiglu_bwd_cast(g, u, o, rows, cols, &in_g, &in_u, scale_mul, record ? &got_g.rec : nullptr,
                                 record ? &got_u.rec : nullptr, &got_g.sinv, &got_u.sinv, got_g.q.data(),
                                 got_g.qt.data(), got_u.q.data(), got_u.qt.data(), ld_t, e5m2 ? 1 : 0);
    });
    same(got_g, ref_g, "swiglu bwd cast d_gate");
    same(got_u, ref_u, "swiglu bwd cast d_up");
    if (record) {
        expect(got_g.rec == __float_as_uint(ag), "d_gate record = max |d_gate|", c);
        expect(got_u.rec == __float_as_uint(au), "d_up record = max |d_up|", c);
    }
    std::printf("swiglu case %d: [%d, %d] +%d %s rel %.2g mul %.2g%s%s: max |y| %.4g |dg| %.4g |du| %.4g\n", c, rows,
                cols, offset, e5m2 ? "E5M2" : "E4M3", rel, scale_mul, record ? " +record" : "",
                transpose ? "" : " (forward without transpose)", ay, ag, au);
}

int main() {
    int c = 0;
    // Current scaling, with and without a record.
    run_case(c++, 130, 256, 2.f, 0, false, false, 1.f, 1.f, true);
    run_case(c++, 70, 37, 1e-3f, 0, true, false, 1.f, 1.f, false);
    run_case(c++, 33, 40, 1.f, 1, false, false, 1.f, 1.f, true);  // misaligned: the scalar loads
    // Delayed scaling: an amax below the tensor's (saturation), above it, margin 1 (x 0.5).
    run_case(c++, 130, 256, 2.f, 0, false, true, 0.2f, 1.f, true);
    run_case(c++, 70, 37, 1e-3f, 0, true, true, 1.7f, 0.5f, true);
    run_case(c++, 33, 40, 1.f, 1, false, true, 0.8f, 0.25f, true);
    run_case(c++, 130, 256, 2.f, 0, true, true, 1.2f, 1.f, false);
    // Without a transpose (a forward that keeps nothing).
    run_case(c++, 130, 256, 2.f, 0, false, true, 0.7f, 1.f, true, false);
    run_case(c++, 33, 40, 1.f, 1, true, true, 1.3f, 0.5f, true, false);
    // The fused SwiGLU casts: vector and scalar paths, partial tiles, saturation (rel < 1), margin.
    swiglu_case(c++, 130, 256, 0, false, 1.3f, 1.f, true, true);
    swiglu_case(c++, 130, 256, 0, true, 0.3f, 0.5f, true, true);
    swiglu_case(c++, 70, 37, 0, false, 0.8f, 1.f, true, false);
    swiglu_case(c++, 33, 40, 1, true, 1.1f, 0.25f, false, true);
    swiglu_case(c++, 200, 136, 3, false, 2.f, 1.f, true, true);
    for (int n : {1, 3})
        for (bool m : {false, true}) commit_case(c++, n, m);
    std::printf("FP8 CAST: %s\n", bad ? "FAIL" : "PASS");
    return bad ? 1 : 0;
}
