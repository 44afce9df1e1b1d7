// Runs kernels of kernels/cuda/ops.cu under simt.h on fixed pseudo-random inputs and writes every
// output, as raw bytes, to one file: kernels/sim/compare.sh builds this against two versions of
// ops.cu and compares the files, so a rewrite meant to keep a kernel's bits is checked without a
// GPU. Launch shapes follow kernels/src/cuda.rs (and a smaller grid, so that blocks loop).
//
//   g++ -std=c++17 -O1 -ffp-contract=off -Iinclude -I. -DOPS_CU='"path/ops.cu"' check_ops.cpp
//   ./a.out out.bin [case-name filter]
#include "simt.h"
#include "testing.h"
#include OPS_CU

#include <string>

static sim::Rng rng{0x9E3779B97F4A7C15ull};
static float rnd() {  // roughly N(0, 1): the sum of four uniforms, centred
    float s = 0.f;
    for (int i = 0; i < 4; ++i) s += rng.uniform();
    return (s - 2.f) * 1.7f;
}
static std::vector<bf16> bf(size_t n, float scale = 1.f, float shift = 0.f) {
    std::vector<bf16> v(n);
    for (auto& x : v) x = __float2bfloat16(rnd() * scale + shift);
    return v;
}

static FILE* out;
static const char* filter;
static int cases = 0;

template <typename T>
static void emit(const char* name, const std::vector<T>& v) {
    const uint64_t n = v.size() * sizeof(T);
    std::fprintf(out, "%s %llu\n", name, (unsigned long long)n);
    std::fwrite(v.data(), 1, n, out);
    std::fputc('\n', out);
}

static bool want(const std::string& name) {
    if (filter && name.find(filter) == std::string::npos) return false;
    ++cases;
    std::fprintf(stderr, "case %s\n", name.c_str());
    return true;
}

// vime_qk_norm_rope_tok and its backward: t tokens, hq/hk heads of 128, q and k as views of a
// fused q|k|v row (stride qs, ks) when `fused`.
static void qk_case(int t, int hq, int hk, bool fused, int grid_cap) {
    const std::string name = "qk t" + std::to_string(t) + " hq" + std::to_string(hq) + " hk" + std::to_string(hk) +
                             (fused ? " fused" : "") + " grid" + std::to_string(grid_cap);
    if (!want(name)) return;
    const int d = 128;
    const long long qs = fused ? (long long)(hq + 2 * hk) * d : (long long)hq * d;
    const long long ks = fused ? qs : (long long)hk * d;
    std::vector<bf16> qkv = bf((size_t)t * (hq + 2 * hk) * d, 2.f);
    std::vector<bf16> qsep = bf((size_t)t * hq * d, 2.f), ksep = bf((size_t)t * hk * d, 2.f);
    const bf16* q = fused ? qkv.data() : qsep.data();
    const bf16* k = fused ? qkv.data() + (size_t)hq * d : ksep.data();
    std::vector<bf16> wq = bf(d, 0.3f, 1.f), wk = bf(d, 0.3f, 1.f);
    std::vector<unsigned> pos(t);
    for (int i = 0; i < t; ++i) pos[i] = (unsigned)((i * 7919) % 4096);
    std::vector<bf16> qo((size_t)t * hq * d), ko((size_t)t * hk * d);
    const float eps = 1e-6f, theta = 1e6f;
    int grid = std::max(1, std::min((t + RMSW_WARPS - 1) / RMSW_WARPS, grid_cap));
    sim::launch(dim3(grid), dim3(32 * RMSW_WARPS), [&] {
        vime_qk_norm_rope_tok(q, k, wq.data(), wk.data(), pos.data(), qo.data(), ko.data(), t, hq, hk, eps, theta,
                              qs, ks);
    });
    emit("qo", qo);
    emit("ko", ko);
    std::vector<bf16> gq = bf((size_t)t * hq * d), gk = bf((size_t)t * hk * d);
    std::vector<bf16> dq((size_t)t * hq * d), dk((size_t)t * hk * d);
    const int blocks = std::max(1, std::min((t + RMSW_WARPS - 1) / RMSW_WARPS, std::min(132 * 4, grid_cap)));
    std::vector<float> pq((size_t)blocks * d), pk((size_t)blocks * d);
    sim::launch(dim3(blocks), dim3(32 * RMSW_WARPS), [&] {
        vime_qk_norm_rope_bwd_tok(gq.data(), gk.data(), q, k, wq.data(), wk.data(), pos.data(), dq.data(), dk.data(),
                                  pq.data(), pk.data(), t, hq, hk, eps, theta, qs, ks);
    });
    emit("dq", dq);
    emit("dk", dk);
    emit("dwq_part", pq);
    emit("dwk_part", pk);
}

// vime_rmsnorm_fwd_v8 / vime_rmsnorm_bwd_v8 (+ the column sum) with and without the residual.
static void rms_case(int rows, int d, bool res, int grid_cap) {
    const std::string name = "rms rows" + std::to_string(rows) + " d" + std::to_string(d) + (res ? " res" : "") +
                             " grid" + std::to_string(grid_cap);
    if (!want(name)) return;
    const int threads = ((d / 8 + 31) / 32) * 32;
    std::vector<bf16> x = bf((size_t)rows * d), r = bf((size_t)rows * d), w = bf(d, 0.3f, 1.f);
    std::vector<bf16> s((size_t)rows * d), y((size_t)rows * d);
    const float eps = 1e-6f;
    sim::launch(dim3(std::min(rows, grid_cap)), dim3(threads), [&] {
        vime_rmsnorm_fwd_v8(x.data(), res ? r.data() : nullptr, w.data(), s.data(), y.data(), rows, d, eps);
    });
    if (res) emit("s", s);
    emit("y", y);
    std::vector<bf16> g = bf((size_t)rows * d), dx((size_t)rows * d), dw(d);
    const int blocks = std::min(rows, std::min(132 * 8, grid_cap));
    std::vector<float> part((size_t)blocks * d);
    sim::launch(dim3(blocks), dim3(threads), [&] {
        vime_rmsnorm_bwd_v8(x.data(), w.data(), g.data(), res ? r.data() : nullptr, dx.data(), part.data(), rows, d,
                            eps);
    });
    sim::launch(dim3((d + 31) / 32), dim3(32, 32), [&] { vime_colsum2_bf16(part.data(), dw.data(), blocks, d); });
    emit("dx", dx);
    emit("dw_part", part);
    emit("dw", dw);
}

// vime_lmhead_stats over vocabulary chunks, then vime_lmhead_finish and vime_lmhead_dlogits.
static void lmhead_case(int t, int v, int vc_max, int row_chunk) {
    const std::string name = "lmhead t" + std::to_string(t) + " v" + std::to_string(v) + " vc" +
                             std::to_string(vc_max) + " rows" + std::to_string(row_chunk);
    if (!want(name)) return;
    std::vector<float> logits((size_t)t * v);
    for (auto& z : logits) z = rnd() * 3.f;
    std::vector<unsigned> tg(t);
    for (int i = 0; i < t; ++i) tg[i] = i % 5 == 4 ? 0xffffffffu : (unsigned)((i * 104729) % v);
    std::vector<float> stats((size_t)t * 4);
    for (int i = 0; i < t; ++i) stats[i * 4] = -INFINITY, stats[i * 4 + 1] = stats[i * 4 + 2] = stats[i * 4 + 3] = 0.f;
    // Each (row chunk, vocab chunk) as the host lays it out: a [rows, vc] block of its own.
    std::vector<std::vector<float>> kept;
    for (int row0 = 0; row0 < t; row0 += row_chunk) {
        const int rows = std::min(row_chunk, t - row0);
        for (int v0 = 0; v0 < v; v0 += vc_max) {
            const int vc = std::min(vc_max, v - v0);
            std::vector<float> blk((size_t)rows * vc);
            for (int r = 0; r < rows; ++r)
                for (int c = 0; c < vc; ++c) blk[(size_t)r * vc + c] = logits[(size_t)(row0 + r) * v + v0 + c];
            sim::launch(dim3(rows), dim3(256),
                        [&] { vime_lmhead_stats(blk.data(), vc, v0, tg.data(), row0, stats.data()); });
            kept.push_back(std::move(blk));
        }
    }
    emit("stats", stats);
    std::vector<float> fwd((size_t)t * 3);
    sim::launch(dim3((t + 255) / 256), dim3(256), [&] { vime_lmhead_finish(stats.data(), tg.data(), fwd.data(), t); });
    emit("fwd", fwd);
    std::vector<float> grad((size_t)t * 3);
    for (auto& gv : grad) gv = rnd();
    size_t ki = 0;
    for (int row0 = 0; row0 < t; row0 += row_chunk) {
        const int rows = std::min(row_chunk, t - row0);
        for (int v0 = 0; v0 < v; v0 += vc_max) {
            const int vc = std::min(vc_max, v - v0);
            std::vector<bf16> dz((size_t)rows * vc);
            const std::vector<float>& blk = kept[ki++];
            sim::launch(dim3(rows), dim3(256), [&] {
                vime_lmhead_dlogits(blk.data(), vc, v0, tg.data(), row0, fwd.data(), grad.data(), dz.data());
            });
            emit("dz", dz);
        }
    }
}

// vime_swiglu_fwd / _bwd and vime_add_bf16: 16-byte and element paths (n % 8 != 0), strided grids.
static void elementwise_case(size_t n, unsigned grid) {
    const std::string name = "elementwise n" + std::to_string(n) + " grid" + std::to_string(grid);
    if (!want(name)) return;
    std::vector<bf16> g = bf(n, 2.f), u = bf(n), gy = bf(n), y(n), dg(n), du(n), a = bf(n), s(n);
    sim::launch(dim3(grid), dim3(256), [&] { vime_swiglu_fwd(g.data(), u.data(), y.data(), n); });
    sim::launch(dim3(grid), dim3(256),
                [&] { vime_swiglu_bwd(g.data(), u.data(), gy.data(), dg.data(), du.data(), n); });
    sim::launch(dim3(grid), dim3(256), [&] { vime_add_bf16(a.data(), u.data(), s.data(), n); });
    emit("swiglu y", y);
    emit("swiglu dg", dg);
    emit("swiglu du", du);
    emit("add", s);
}

// vime_sumsq_multi + vime_sum_partials_multi over f32 and bf16 tensors, a misaligned view (the
// element path) and tensors of more blocks than the grid, laid out as kernels/src/cuda.rs does.
static void sumsq_case(unsigned grid) {
    const std::string name = "sumsq grid" + std::to_string(grid);
    if (!want(name)) return;
    std::vector<float> f1(5000), f2(4099);
    for (auto& x : f1) x = rnd();
    for (auto& x : f2) x = rnd() * 3.f;
    std::vector<bf16> b1 = bf(3001), b2 = bf(64);
    struct Seg {
        const void* p;
        size_t n;
        bool bf16;
    };
    const Seg segs_in[] = {{f1.data(), f1.size(), false}, {b1.data(), b1.size(), true},
                           {f2.data() + 1, f2.size() - 1, false}, {b2.data(), b2.size(), true}};
    std::vector<unsigned long long> segs;
    unsigned long long first = 0;
    for (const Seg& sg : segs_in) {
        const unsigned long long blocks = std::min<unsigned long long>(grid, (sg.n + 255) / 256);
        const unsigned long long vec = ((uintptr_t)sg.p % 16) == 0;
        segs.insert(segs.end(), {(unsigned long long)sg.p, (unsigned long long)sg.n, first,
                                 blocks | ((unsigned long long)sg.bf16 << 32) | (vec << 33)});
        first += blocks;
    }
    std::vector<double> partial(first), out(4);
    sim::launch(dim3(grid), dim3(256), [&] { vime_sumsq_multi(segs.data(), 4, partial.data()); });
    sim::launch(dim3(4), dim3(32), [&] { vime_sum_partials_multi(partial.data(), segs.data(), out.data()); });
    emit("sumsq partials", partial);
    emit("sumsq", out);
}

// The per-tensor AdamW kernels (16-byte and element paths, f32 and bf16 gradients), 2 steps.
static void adamw_case(size_t n, bool g_bf16) {
    const std::string name = "adamw n" + std::to_string(n) + (g_bf16 ? " bf16" : " f32");
    if (!want(name)) return;
    std::vector<float> p(n), m(n), v(n), gf(n);
    for (size_t i = 0; i < n; ++i) p[i] = rnd(), m[i] = rnd() * 0.1f, v[i] = std::fabs(rnd()) * 0.01f;
    std::vector<bf16> model(n);
    for (int step = 1; step <= 2; ++step) {
        for (auto& x : gf) x = rnd() * 0.01f;
        std::vector<bf16> gb(n);
        for (size_t i = 0; i < n; ++i) gb[i] = __float2bfloat16(gf[i]);
        AdamConsts c{};
        c.keep = 1.f - 3e-4f * 0.1f, c.one_m_b1 = 0.1f, c.b2 = 0.98f, c.one_m_b2 = 0.02f;
        c.inv_bc2 = 1.f / std::sqrt(1.f - std::pow(0.98f, (float)step)), c.eps = 1e-8f;
        c.neg_step = -3e-4f / (1.f - std::pow(0.9f, (float)step)), c.decay = step == 1;
        c.grad_scale = 0.37f, c.scale = step == 2;
        const bool wide = n % 4 == 0;
        sim::launch(dim3(3), dim3(256), [&] {
            if (g_bf16)
                wide ? vime_adamw_bf16g_v4(p.data(), gb.data(), m.data(), v.data(), model.data(), n, c)
                     : vime_adamw_bf16g(p.data(), gb.data(), m.data(), v.data(), model.data(), n, c);
            else
                wide ? vime_adamw_f32g_v4(p.data(), gf.data(), m.data(), v.data(), model.data(), n, c)
                     : vime_adamw_f32g(p.data(), gf.data(), m.data(), v.data(), model.data(), n, c);
        });
    }
    emit("adamw p", p);
    emit("adamw m", m);
    emit("adamw v", v);
    emit("adamw model", model);
}

int main(int argc, char** argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s out.bin [filter]\n", argv[0]);
        return 2;
    }
    out = std::fopen(argv[1], "wb");
    if (!out) {
        std::perror(argv[1]);
        return 2;
    }
    filter = argc > 2 ? argv[2] : nullptr;
    // Qwen3-0.6B's and -4B's head counts, a count that leaves remainders, the fused q|k|v view,
    // and grids small enough that warps loop over tokens.
    qk_case(37, 16, 8, true, 1 << 30);
    qk_case(37, 32, 8, true, 2);
    qk_case(21, 5, 3, false, 1 << 30);
    qk_case(70, 16, 8, false, 3);
    // Qwen3-0.6B's and -4B's hidden sizes; one row a block, and several.
    rms_case(19, 1024, true, 1 << 30);
    rms_case(19, 1024, false, 4);
    rms_case(23, 2560, true, 5);
    rms_case(7, 2560, false, 1 << 30);
    rms_case(33, 4096, true, 6);
    // Vocabulary chunks with a tail, a chunk width that is not a multiple of 4, row chunks.
    lmhead_case(11, 3000, 1024, 11);
    lmhead_case(9, 2002, 1001, 4);
    lmhead_case(6, 4096, 4096, 6);
    // Rows longer than a batch of 256 x 4 vectors: whole batches, a partial one, a short chunk.
    lmhead_case(5, 12000, 5132, 3);
    elementwise_case(4096, 3);
    elementwise_case(1001, 2);
    sumsq_case(3);
    sumsq_case(64);
    adamw_case(4100, false);
    adamw_case(1027, true);
    std::fclose(out);
    std::fprintf(stderr, "%d cases\n", cases);
    return cases ? 0 : 1;
}
