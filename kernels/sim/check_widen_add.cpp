// vime_widen_add_multi (bf16 gradients into f32 running sums, every tensor in one launch) against
// the host's cast and add, bit for bit: with and without a sum, in place and into fresh buffers,
// -0.0 without a sum (stays -0.0), NaN, an empty tensor, more tensors than blocks. Prints
// "WIDEN ADD MULTI: PASS" or what differs. kernels/sim/compare.sh runs it where ops.cu has it.
#include "simt.h"
#include "testing.h"
#include "../cuda/ops.cu"

static sim::Rng rng{0x853c49e6748fea9bull};
static float rnd() { return rng.sym(4.f); }

int main() {
    const size_t sizes[] = {128, 1024, 0, 300, 2560, 1, 128};
    const int n = sizeof(sizes) / sizeof(sizes[0]);
    std::vector<std::vector<bf16>> g(n);
    std::vector<std::vector<float>> sum(n), out(n), want(n);
    std::vector<unsigned long long> segs;
    int nseg = 0;
    for (int i = 0; i < n; ++i) {
        g[i].resize(sizes[i]);
        for (auto& x : g[i]) x = __float2bfloat16(rnd());
        if (sizes[i] > 2) {
            g[i][0] = __float2bfloat16(-0.0f);
            g[i][1] = __float2bfloat16(NAN);
        }
        const bool has_sum = i % 2 == 1;
        want[i].resize(sizes[i]);
        if (has_sum) {
            sum[i].resize(sizes[i]);
            for (auto& x : sum[i]) x = rnd();
        }
        for (size_t j = 0; j < sizes[i]; ++j)
            want[i][j] = has_sum ? sum[i][j] + __bfloat162float(g[i][j]) : __bfloat162float(g[i][j]);
        out[i].assign(sizes[i], 12345.f);
        if (sizes[i] == 0) continue;  // the host skips empty tensors
        float* o = has_sum ? sum[i].data() : out[i].data();  // in place where there is a sum
        segs.insert(segs.end(), {(unsigned long long)g[i].data(), has_sum ? (unsigned long long)sum[i].data() : 0ull,
                                 (unsigned long long)o, (unsigned long long)sizes[i]});
        ++nseg;
    }
    sim::launch(dim3(3), dim3(256), [&] { vime_widen_add_multi(segs.data(), nseg); });
    int bad = 0;
    for (int i = 0; i < n; ++i) {
        const std::vector<float>& got = i % 2 == 1 ? sum[i] : out[i];
        if (got.size() != want[i].size() ||
            std::memcmp(got.data(), want[i].data(), got.size() * sizeof(float)) != 0) {
            ++bad;
            std::fprintf(stderr, "tensor %d (n %zu) differs\n", i, sizes[i]);
        }
    }
    std::printf("WIDEN ADD MULTI: %s (%d tensors)\n", bad ? "FAIL" : "PASS", n);
    return bad ? 1 : 0;
}
