// The LM head's statistics kernel (vime_lmhead_stats, then vime_lmhead_finish) against a double
// reference of log-softmax and entropy, over vocabulary chunks as the host runs them: rows whose
// max sits in a late group (the running max moves, s and a are rescaled), a chunk width that is
// not a whole number of 8-logit groups (the one-at-a-time path), a misaligned view, widths that
// leave threads without a group or with several rounds of 4 groups, wide logit ranges, and
// targets inside, outside and ignored. Then the bf16-logits kernels (vime_lmhead_stats_bf16,
// vime_lmhead_dlogits_bf16) against the f32 ones on the same values widened, bit for bit: they
// widen each logit as they load it and run the same math. Prints "LMHEAD STATS: PASS" or what
// misses.
//
// The bound: 1e-6 relative (1e-6 absolute near 0) for log-prob and entropy. On the GPU, exp2f is
// the hardware ex2 (2 ulp); here it is libm's, so this checks the kernel's grouping, rescaling and
// merge order, and scripts/gpu/check_kernels.sh checks the device's arithmetic against the CPU
// kernel.
#include "simt.h"
#include "testing.h"
#include "../cuda/ops.cu"

#include <cmath>
#include <cstring>
#include <cstdio>
#include <vector>

static sim::Rng rng{0x2545f4914f6cdd1dull};

// One case: t rows of v logits, run in [rows <= row_chunk, vc <= vc_max] blocks, each block at
// `offset` floats into a buffer of its own (offset 1 misaligns every row).
static int run_case(int t, int v, int vc_max, int row_chunk, float scale, int offset, int threads) {
    std::vector<float> logits((size_t)t * v);
    for (int r = 0; r < t; ++r)
        for (int c = 0; c < v; ++c) {
            float z = rng.sym(scale);
            // Every third row climbs: its max is in its last group, so the max moves group after group.
            if (r % 3 == 1) z = scale * (float)c / (float)v + rng.sym(0.5f);
            logits[(size_t)r * v + c] = z;
        }
    std::vector<unsigned> tg(t);
    for (int r = 0; r < t; ++r) tg[r] = r % 5 == 4 ? 0xffffffffu : (unsigned)(((size_t)r * 104729u + 7u) % v);
    std::vector<float> stats((size_t)t * 4);
    for (int r = 0; r < t; ++r) stats[r * 4] = -INFINITY, stats[r * 4 + 1] = stats[r * 4 + 2] = stats[r * 4 + 3] = 0.f;
    for (int row0 = 0; row0 < t; row0 += row_chunk) {
        const int rows = std::min(row_chunk, t - row0);
        for (int v0 = 0; v0 < v; v0 += vc_max) {
            const int vc = std::min(vc_max, v - v0);
            std::vector<float> buf((size_t)rows * vc + offset + 4);
            float* blk = buf.data() + offset;
            for (int r = 0; r < rows; ++r)
                for (int c = 0; c < vc; ++c) blk[(size_t)r * vc + c] = logits[(size_t)(row0 + r) * v + v0 + c];
            sim::launch(dim3(rows), dim3(threads), [&] { vime_lmhead_stats(blk, vc, v0, tg.data(), row0, stats.data()); });
        }
    }
    std::vector<float> fwd((size_t)t * 3);
    sim::launch(dim3((t + 255) / 256), dim3(256), [&] { vime_lmhead_finish(stats.data(), tg.data(), fwd.data(), t); });
    int bad = 0;
    for (int r = 0; r < t; ++r) {
        const float* z = &logits[(size_t)r * v];
        double m = -INFINITY;
        for (int c = 0; c < v; ++c) m = std::max(m, (double)z[c]);
        double s = 0, a = 0;
        for (int c = 0; c < v; ++c) {
            const double e = std::exp((double)z[c] - m);
            s += e;
            a += e * ((double)z[c] - m);
        }
        const double lse = m + std::log(s), ent = std::log(s) - a / s;
        const double lp = tg[r] == 0xffffffffu ? 0.0 : (double)z[tg[r]] - lse;
        const double got[3] = {fwd[r * 3], fwd[r * 3 + 1], fwd[r * 3 + 2]}, want[3] = {lp, ent, lse};
        for (int k = 0; k < 3; ++k) {
            const double err = std::fabs(got[k] - want[k]), tol = 1e-6 * std::max(1.0, std::fabs(want[k]));
            if (!(err <= tol)) {
                if (bad < 8)
                    std::fprintf(stderr, "t%d v%d vc%d off%d row %d col %d: got %.9g want %.9g\n", t, v, vc_max,
                                 offset, r, k, got[k], want[k]);
                ++bad;
            }
        }
    }
    return bad;
}

// The bf16-logits kernels on bf16-rounded logits against the f32 kernels on the same values
// widened: stats and dz bit for bit. `offset` bf16 elements into each block's buffer (1 leaves
// rows misaligned: the one-at-a-time paths).
static int run_bf16_case(int t, int vc, float scale, int offset, int threads) {
    std::vector<bf16> zb((size_t)t * vc + offset + 8);
    std::vector<float> zf((size_t)t * vc + offset + 4);  // misaligned alike: the same path
    for (int r = 0; r < t; ++r)
        for (int c = 0; c < vc; ++c) {
            const float z = r % 3 == 1 ? scale * (float)c / (float)vc + rng.sym(0.5f) : rng.sym(scale);
            zb[offset + (size_t)r * vc + c] = __float2bfloat16(z);
            zf[offset + (size_t)r * vc + c] = __bfloat162float(zb[offset + (size_t)r * vc + c]);
        }
    std::vector<unsigned> tg(t);
    for (int r = 0; r < t; ++r) tg[r] = r % 5 == 4 ? 0xffffffffu : (unsigned)(((size_t)r * 7919u + 3u) % vc);
    auto init = [&] {
        std::vector<float> st((size_t)t * 4);
        for (int r = 0; r < t; ++r) st[r * 4] = -INFINITY, st[r * 4 + 1] = st[r * 4 + 2] = st[r * 4 + 3] = 0.f;
        return st;
    };
    std::vector<float> sb = init(), sf = init();
    const bf16* zbp = zb.data() + offset;
    sim::launch(dim3(t), dim3(threads), [&] { vime_lmhead_stats_bf16(zbp, vc, 0, tg.data(), 0, sb.data()); });
    sim::launch(dim3(t), dim3(threads), [&] { vime_lmhead_stats(zf.data() + offset, vc, 0, tg.data(), 0, sf.data()); });
    int bad = std::memcmp(sb.data(), sf.data(), sb.size() * sizeof(float)) != 0;
    if (bad) std::fprintf(stderr, "bf16 stats t%d vc%d off%d differ from f32\n", t, vc, offset);
    std::vector<float> fwd((size_t)t * 3), grad((size_t)t * 3);
    sim::launch(dim3((t + 255) / 256), dim3(256), [&] { vime_lmhead_finish(sf.data(), tg.data(), fwd.data(), t); });
    for (auto& g : grad) g = rng.sym(1.f);
    std::vector<bf16> db((size_t)t * vc + 8), df((size_t)t * vc + 8);
    sim::launch(dim3(t), dim3(threads), [&] {
        vime_lmhead_dlogits_bf16(zbp, vc, 0, tg.data(), 0, fwd.data(), grad.data(), db.data());
    });
    sim::launch(dim3(t), dim3(threads), [&] {
        vime_lmhead_dlogits(zf.data() + offset, vc, 0, tg.data(), 0, fwd.data(), grad.data(), df.data());
    });
    if (std::memcmp(db.data(), df.data(), db.size() * sizeof(bf16)) != 0) {
        std::fprintf(stderr, "bf16 dz t%d vc%d off%d differ from f32\n", t, vc, offset);
        ++bad;
    }
    return bad;
}

int main() {
    int bad = 0, cases = 0;
    // (t, v, vc_max, row_chunk, scale, offset, threads)
    const struct { int t, v, vc, rows; float scale; int off, threads; } cs[] = {
        {7, 16384, 16384, 7, 12.f, 0, 256},  // one chunk: 8 groups a thread, two rounds of 4
        {6, 5000, 2048, 4, 30.f, 0, 256},    // chunks of 2048 and a 904 remainder
        {5, 3003, 1024, 5, 8.f, 0, 256},     // 1024-wide chunks, then 955: the one-at-a-time path
        {4, 4096, 4096, 4, 8.f, 1, 256},     // misaligned rows: the one-at-a-time path
        {5, 200, 200, 5, 3.f, 0, 256},       // 25 groups: most threads have none
        {3, 33000, 16384, 2, 50.f, 0, 64},   // few threads: many rounds, wide range
    };
    for (const auto& c : cs) {
        bad += run_case(c.t, c.v, c.vc, c.rows, c.scale, c.off, c.threads);
        ++cases;
    }
    // (t, vc, scale, offset, threads): whole groups; a 4-logit remainder; misaligned rows.
    const struct { int t, vc; float scale; int off, threads; } bs[] = {
        {5, 16384, 20.f, 0, 256}, {4, 2052, 8.f, 0, 256}, {3, 4096, 8.f, 1, 256}, {3, 1000, 40.f, 0, 64},
    };
    for (const auto& c : bs) {
        bad += run_bf16_case(c.t, c.vc, c.scale, c.off, c.threads);
        ++cases;
    }
    std::printf("LMHEAD STATS: %s (%d cases)\n", bad ? "FAIL" : "PASS", cases);
    return bad ? 1 : 0;
}
