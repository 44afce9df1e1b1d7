// vime_gather_rows16 (out[r] = src[idx[r]] in 16-byte words; zeros for an index past the rows)
// against a host gather, byte for byte: rows of 1, 3 and 40 words (fewer, odd and more words than
// the block's threads), repeated, descending and out-of-range indices, a grid smaller than the
// rows (blocks loop) and no rows at all. Every output byte is written (the output starts as 0xAB).
// Prints "GATHER ROWS: PASS" or what differs.
#include "simt.h"
#include "testing.h"
#include "../cuda/ops.cu"

static sim::Rng rng{0x2545f4914f6cdd1dull};
static unsigned word() { return (unsigned)(rng.uniform() * 16777216.f) | ((unsigned)(rng.uniform() * 256.f) << 24); }

int main() {
    int bad = 0, cases = 0;
    const unsigned widths[] = {1, 3, 40};
    const unsigned grids[] = {1, 2, 64};
    for (unsigned w16 : widths) {
        for (unsigned grid : grids) {
            const unsigned src_rows = 7;
            std::vector<uint4> src(src_rows * w16);
            for (auto& u : src) u = uint4{word(), word(), word(), word()};
            std::vector<unsigned> idx = {6, 0, 0, 3, 7, 2, 1, 6, 100, 5, 4};
            const unsigned rows = (unsigned)idx.size();
            std::vector<uint4> out(rows * w16);
            std::memset(out.data(), 0xAB, out.size() * sizeof(uint4));
            sim::launch(dim3(grid), dim3(32), [&] {
                vime_gather_rows16(out.data(), src.data(), idx.data(), rows, src_rows, w16);
            });
            for (unsigned r = 0; r < rows; ++r) {
                uint4 zero{0u, 0u, 0u, 0u};
                const uint4* want = idx[r] < src_rows ? &src[idx[r] * w16] : nullptr;
                for (unsigned c = 0; c < w16; ++c) {
                    const uint4& got = out[r * w16 + c];
                    if (std::memcmp(&got, want ? &want[c] : &zero, sizeof(uint4)) != 0) {
                        ++bad;
                        std::fprintf(stderr, "width %u grid %u: row %u (index %u) word %u differs\n", w16, grid, r, idx[r], c);
                    }
                }
            }
            ++cases;
        }
    }
    // No rows: nothing written, nothing read.
    std::vector<uint4> none(1, uint4{1u, 2u, 3u, 4u});
    sim::launch(dim3(1), dim3(32), [&] { vime_gather_rows16(none.data(), nullptr, nullptr, 0, 7, 3); });
    if (none[0].x != 1u || none[0].w != 4u) ++bad;
    std::printf("GATHER ROWS: %s (%d cases)\n", bad ? "FAIL" : "PASS", cases);
    return bad ? 1 : 0;
}
