// Checks simt.h itself: barriers, shuffles and block sums give CUDA's results, a warp that diverges
// at a barrier is reported, and two kernels of ops.cu that the GPU kernel check holds to be equal
// bit for bit (vime_qk_norm_rope per head row and per token) are equal here too; RMSNorm matches a
// host reference. Prints "SIMT SELFTEST: PASS" or the failures.
#include "simt.h"
#include "testing.h"
#include "../cuda/ops.cu"

#include <sys/wait.h>
#include <unistd.h>

#include <string>

static int failures = 0;
static void check(bool ok, const std::string& what) {
    if (!ok) {
        ++failures;
        std::fprintf(stderr, "FAIL: %s\n", what.c_str());
    }
}

static sim::Rng rng{88172645463325252ull};
static float rnd() { return rng.sym(2.f); }

int main() {
    // Shuffles: xor, down (lanes past the end keep their own value), broadcast.
    {
        std::vector<int> x(64), d(64), b(64);
        sim::launch(dim3(1), dim3(64), [&] {
            const int t = threadIdx.x;
            x[t] = __shfl_xor_sync(FULL_MASK, t, 1);
            d[t] = __shfl_down_sync(FULL_MASK, t, 4);
            b[t] = __shfl_sync(FULL_MASK, t * 10, 3);
        });
        for (int t = 0; t < 64; ++t) {
            check(x[t] == (t ^ 1), "shfl_xor lane " + std::to_string(t));
            check(d[t] == ((t % 32) + 4 < 32 ? t + 4 : t), "shfl_down lane " + std::to_string(t));
            check(b[t] == ((t / 32) * 32 + 3) * 10, "shfl_sync lane " + std::to_string(t));
        }
    }
    // __syncthreads orders shared writes before reads; block_sum (two barriers, warp 0 alone
    // shuffling between them) returns the total to every thread, over several blocks.
    for (unsigned n : {32u, 128u, 320u, 1024u}) {
        std::vector<float> got(3 * n);
        std::vector<int> nb(3 * n);
        sim::launch(dim3(3), dim3(n), [&] {
            __shared__ int sh[1024];
            __shared__ float scratch[33];
            const int t = threadIdx.x;
            sh[t] = t + (int)blockIdx.x;
            __syncthreads();
            nb[blockIdx.x * n + t] = sh[(t + 1) % n];
            __syncthreads();
            got[blockIdx.x * n + t] = block_sum((float)(t + 1), scratch);
        });
        for (unsigned blk = 0; blk < 3; ++blk)
            for (unsigned t = 0; t < n; ++t) {
                check(nb[blk * n + t] == (int)((t + 1) % n + blk), "barrier order, block size " + std::to_string(n));
                check(got[blk * n + t] == (float)n * (n + 1) / 2, "block_sum, block size " + std::to_string(n));
            }
    }
    // A warp whose lanes wait at different barriers is reported (the child aborts).
    {
        const pid_t pid = fork();
        if (pid == 0) {
            std::freopen("/dev/null", "w", stderr);
            sim::launch(dim3(1), dim3(32), [&] {
                if (threadIdx.x < 16)
                    __syncthreads();
                else
                    (void)__shfl_xor_sync(FULL_MASK, 1, 1);
            });
            _exit(0);
        }
        int status = 0;
        waitpid(pid, &status, 0);
        check(!(WIFEXITED(status) && WEXITSTATUS(status) == 0), "a divergent barrier is reported");
    }
    // vime_qk_norm_rope (a warp a head row) and vime_qk_norm_rope_tok (a warp a token): the same bits.
    {
        const int t = 13, hq = 4, hk = 2, d = 128;
        std::vector<bf16> q(t * hq * d), k(t * hk * d), wq(d), wk(d);
        for (auto& v : q) v = __float2bfloat16(rnd());
        for (auto& v : k) v = __float2bfloat16(rnd());
        for (auto& v : wq) v = __float2bfloat16(1.f + rnd() * 0.1f);
        for (auto& v : wk) v = __float2bfloat16(1.f + rnd() * 0.1f);
        std::vector<unsigned> pos(t);
        for (int i = 0; i < t; ++i) pos[i] = 3 * i + 1;
        std::vector<bf16> q1(q.size()), k1(k.size()), q2(q.size()), k2(k.size());
        sim::launch(dim3(2), dim3(256), [&] {
            vime_qk_norm_rope(q.data(), k.data(), wq.data(), wk.data(), pos.data(), q1.data(), k1.data(), t, hq, hk,
                              1e-6f, 1e6f, hq * d, hk * d);
        });
        sim::launch(dim3(2), dim3(256), [&] {
            vime_qk_norm_rope_tok(q.data(), k.data(), wq.data(), wk.data(), pos.data(), q2.data(), k2.data(), t, hq,
                                  hk, 1e-6f, 1e6f, hq * d, hk * d);
        });
        check(std::memcmp(q1.data(), q2.data(), q1.size() * 2) == 0 &&
                  std::memcmp(k1.data(), k2.data(), k1.size() * 2) == 0,
              "qk_norm_rope per row == per token");
    }
    // vime_rmsnorm_fwd_v8 against the formula in double (within bf16's rounding).
    {
        const int rows = 5, d = 1024;
        std::vector<bf16> x(rows * d), w(d), s(rows * d), y(rows * d);
        for (auto& v : x) v = __float2bfloat16(rnd());
        for (auto& v : w) v = __float2bfloat16(1.f + rnd() * 0.1f);
        sim::launch(dim3(2), dim3(128),
                    [&] { vime_rmsnorm_fwd_v8(x.data(), nullptr, w.data(), s.data(), y.data(), rows, d, 1e-6f); });
        double worst = 0;
        for (int r = 0; r < rows; ++r) {
            double ss = 0;
            for (int c = 0; c < d; ++c) ss += (double)__bfloat162float(x[r * d + c]) * __bfloat162float(x[r * d + c]);
            const double rstd = 1.0 / std::sqrt(ss / d + 1e-6);
            for (int c = 0; c < d; ++c) {
                const double want = __bfloat162float(x[r * d + c]) * rstd * __bfloat162float(w[c]);
                worst = std::max(worst, std::fabs(__bfloat162float(y[r * d + c]) - want) / (std::fabs(want) + 1e-3));
            }
        }
        check(worst < 1.0 / 128, "rmsnorm_fwd_v8 against double: relative error " + std::to_string(worst));
    }
    std::printf("SIMT SELFTEST: %s\n", failures ? "FAIL" : "PASS");
    return failures ? 1 : 0;
}
