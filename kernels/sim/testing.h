// The test programs' inputs: a xorshift64 stream, so every run (and both sides of compare.sh) sees
// the same values.
#pragma once
#include <cstdint>

namespace sim {

struct Rng {
    uint64_t s;
    // A uniform value in [0, 1) from the stream's top 24 bits.
    float uniform() {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        return (float)(s >> 40) / (float)(1ull << 24);
    }
    // A uniform value in [-w, w).
    float sym(float w) { return (uniform() - 0.5f) * 2.f * w; }
};

}  // namespace sim
