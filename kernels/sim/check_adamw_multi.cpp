// vime_adamw_multi (every tensor in one launch) against one launch per tensor
// (vime_adamw_{f32g,bf16g}[_v4], as kernels/src/cuda.rs picks them), bit for bit over three steps:
// f32 and bf16 gradients, sizes that are and are not multiples of 4 or of the 4096-element chunk,
// a misaligned view (the 1-element path), decay on some tensors, a model copy on some. Prints
// "ADAMW MULTI: PASS" or what differs. kernels/sim/compare.sh runs it where ops.cu has the kernel.
#include "simt.h"
#include "testing.h"
#include "../cuda/ops.cu"

#include <string>

static sim::Rng rng{0x2545F4914F6CDD1Dull};
static float rnd() { return rng.sym(1.f); }

struct T {
    size_t n;
    bool g_bf16, decay, model, offset;  // offset: the buffers start one element in (not 16-byte aligned)
};

struct Bufs {
    std::vector<float> p, m, v, gf;
    std::vector<bf16> gb, model;
};

static Bufs make(const T& t) {
    const size_t n = t.n + (t.offset ? 1 : 0);
    Bufs b;
    b.p.resize(n), b.m.resize(n), b.v.resize(n), b.gf.resize(n), b.gb.resize(n), b.model.resize(n);
    for (size_t i = 0; i < n; ++i) {
        b.p[i] = rnd(), b.m[i] = rnd() * 0.1f, b.v[i] = std::fabs(rnd()) * 0.01f;
    }
    return b;
}

int main() {
    const std::vector<T> ts = {
        {9000, false, true, true, false},  {128, true, false, true, false}, {4097, true, true, false, false},
        {1, false, false, true, false},    {4096, false, true, true, false}, {13, true, true, true, false},
        {8192 + 6, false, false, false, true}, {2048, true, true, true, true},
    };
    std::vector<Bufs> a, b;
    for (const T& t : ts) {
        a.push_back(make(t));
        b.push_back(a.back());
    }
    int failures = 0;
    for (int step = 1; step <= 3; ++step) {
        // Fresh gradients each step, the same for both.
        for (size_t i = 0; i < ts.size(); ++i)
            for (size_t k = 0; k < a[i].gf.size(); ++k) {
                const float g = rnd();
                a[i].gf[k] = b[i].gf[k] = g;
                a[i].gb[k] = b[i].gb[k] = __float2bfloat16(g);
            }
        AdamConsts c{};
        const float lr = 1e-3f, wd = 0.1f, b1 = 0.9f, b2 = 0.999f;
        c.keep = 1.f - lr * wd, c.one_m_b1 = 1.f - b1, c.b2 = b2, c.one_m_b2 = 1.f - b2;
        c.inv_bc2 = 1.f / std::sqrt(1.f - std::pow(b2, (float)step)), c.eps = 1e-8f;
        c.neg_step = -lr / (1.f - std::pow(b1, (float)step)), c.decay = 1;
        c.grad_scale = 0.5f, c.scale = step == 2;
        // One launch per tensor.
        for (size_t i = 0; i < ts.size(); ++i) {
            const T& t = ts[i];
            const size_t o = t.offset ? 1 : 0;
            Bufs& x = a[i];
            AdamConsts ci = c;
            ci.decay = c.decay && t.decay;
            float *p = x.p.data() + o, *m = x.m.data() + o, *v = x.v.data() + o;
            bf16* model = t.model ? x.model.data() + o : nullptr;
            const bool wide = t.n % 4 == 0 && !t.offset;
            const size_t items = wide ? t.n / 4 : t.n;
            const unsigned grid = (unsigned)std::min<size_t>((items + 255) / 256, 7);
            sim::launch(dim3(grid), dim3(256), [&] {
                if (t.g_bf16) {
                    if (wide)
                        vime_adamw_bf16g_v4(p, x.gb.data() + o, m, v, model, t.n, ci);
                    else
                        vime_adamw_bf16g(p, x.gb.data() + o, m, v, model, t.n, ci);
                } else {
                    if (wide)
                        vime_adamw_f32g_v4(p, x.gf.data() + o, m, v, model, t.n, ci);
                    else
                        vime_adamw_f32g(p, x.gf.data() + o, m, v, model, t.n, ci);
                }
            });
        }
        // All in one launch, as adamw_update_multi lays out the table.
        std::vector<unsigned long long> segs;
        unsigned long long chunks = 0;
        for (size_t i = 0; i < ts.size(); ++i) {
            const T& t = ts[i];
            const size_t o = t.offset ? 1 : 0;
            Bufs& x = b[i];
            const bool wide = t.n % 4 == 0 && !t.offset;
            const unsigned long long g =
                t.g_bf16 ? (unsigned long long)(x.gb.data() + o) : (unsigned long long)(x.gf.data() + o);
            const unsigned long long flags = (t.decay ? 1 : 0) | (t.g_bf16 ? 2 : 0) | (wide ? 4 : 0);
            segs.insert(segs.end(), {(unsigned long long)(x.p.data() + o), g, (unsigned long long)(x.m.data() + o),
                                     (unsigned long long)(x.v.data() + o),
                                     t.model ? (unsigned long long)(x.model.data() + o) : 0ull,
                                     (unsigned long long)t.n, flags, chunks});
            chunks += (t.n + 4095) / 4096;
        }
        const int nseg = (int)(segs.size() / 8);
        sim::launch(dim3(3), dim3(256), [&] { vime_adamw_multi(segs.data(), nseg, chunks, c); });
        for (size_t i = 0; i < ts.size(); ++i) {
            const auto same = [&](const auto& u, const auto& w, const char* what) {
                if (std::memcmp(u.data(), w.data(), u.size() * sizeof(u[0])) != 0) {
                    ++failures;
                    std::fprintf(stderr, "step %d tensor %zu (n %zu): %s differs\n", step, i, ts[i].n, what);
                }
            };
            same(a[i].p, b[i].p, "master");
            same(a[i].m, b[i].m, "exp_avg");
            same(a[i].v, b[i].v, "exp_avg_sq");
            same(a[i].model, b[i].model, "model copy");
        }
    }
    std::printf("ADAMW MULTI: %s (%zu tensors, 3 steps)\n", failures ? "FAIL" : "PASS", ts.size());
    return failures ? 1 : 0;
}
