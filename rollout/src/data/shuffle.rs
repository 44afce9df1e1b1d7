//! The per-epoch prompt order, drawn exactly as slime draws it: `random.seed(seed + epoch)` then
//! `random.shuffle(list(range(n)))` in CPython, so a slime run and a vime run with the same
//! `--rollout-seed` visit the prompts in the same order.
//!
//! That is CPython's MT19937 (`_randommodule.c`): `init_by_array` over the seed's 32-bit words,
//! `getrandbits(k)` taking the top `k` bits of each 32-bit draw, `_randbelow` by rejection, and a
//! Fisher-Yates walk from the end. Nothing else in vime uses this generator.

const N: usize = 624;
const M: usize = 397;

/// CPython's Mersenne Twister, enough of it for `random.seed(int)` and `random.shuffle`.
pub struct PyRandom {
    mt: [u32; N],
    index: usize,
}

impl PyRandom {
    /// `random.seed(seed)` for a non-negative integer seed.
    pub fn new(seed: u64) -> Self {
        // CPython splits abs(seed) into little-endian 32-bit words; zero is the single word [0].
        let key: Vec<u32> = if seed >> 32 == 0 {
            vec![seed as u32]
        } else {
            vec![seed as u32, (seed >> 32) as u32]
        };
        let mut rng = PyRandom { mt: [0; N], index: N };
        rng.init_by_array(&key);
        rng
    }

    fn init_genrand(&mut self, s: u32) {
        self.mt[0] = s;
        for i in 1..N {
            let prev = self.mt[i - 1];
            self.mt[i] = 1812433253u32.wrapping_mul(prev ^ (prev >> 30)).wrapping_add(i as u32);
        }
        self.index = N;
    }

    fn init_by_array(&mut self, key: &[u32]) {
        self.init_genrand(19650218);
        let (mut i, mut j) = (1usize, 0usize);
        for _ in 0..N.max(key.len()) {
            let prev = self.mt[i - 1];
            self.mt[i] = (self.mt[i] ^ (prev ^ (prev >> 30)).wrapping_mul(1664525))
                .wrapping_add(key[j])
                .wrapping_add(j as u32);
            i += 1;
            j += 1;
            if i >= N {
                self.mt[0] = self.mt[N - 1];
                i = 1;
            }
            if j >= key.len() {
                j = 0;
            }
        }
        for _ in 0..N - 1 {
            let prev = self.mt[i - 1];
            self.mt[i] = (self.mt[i] ^ (prev ^ (prev >> 30)).wrapping_mul(1566083941)).wrapping_sub(i as u32);
            i += 1;
            if i >= N {
                self.mt[0] = self.mt[N - 1];
                i = 1;
            }
        }
        self.mt[0] = 0x8000_0000;
    }

    /// One 32-bit draw (`genrand_uint32`).
    pub fn next_u32(&mut self) -> u32 {
        const UPPER: u32 = 0x8000_0000;
        const LOWER: u32 = 0x7fff_ffff;
        const MATRIX_A: u32 = 0x9908_b0df;
        if self.index >= N {
            for k in 0..N {
                let y = (self.mt[k] & UPPER) | (self.mt[(k + 1) % N] & LOWER);
                let mag = if y & 1 == 1 { MATRIX_A } else { 0 };
                self.mt[k] = self.mt[(k + M) % N] ^ (y >> 1) ^ mag;
            }
            self.index = 0;
        }
        let mut y = self.mt[self.index];
        self.index += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// `random.getrandbits(k)` for `k <= 64`: 32-bit words least significant first, the last one
    /// keeping its top bits.
    pub fn getrandbits(&mut self, k: u32) -> u64 {
        assert!(k <= 64, "getrandbits({k}) is wider than 64 bits");
        let mut out = 0u64;
        let (mut left, mut shift) = (k, 0u32);
        while left > 0 {
            let mut word = self.next_u32() as u64;
            if left < 32 {
                word >>= 32 - left;
            }
            out |= word << shift;
            shift += 32;
            left = left.saturating_sub(32);
        }
        out
    }

    /// `random._randbelow(n)`: uniform in `[0, n)`, by rejection over `n.bit_length()` bits.
    pub fn randbelow(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        let k = 64 - n.leading_zeros();
        loop {
            let r = self.getrandbits(k);
            if r < n {
                return r;
            }
        }
    }

    /// `random.shuffle(items)`.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.randbelow(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
}

/// The order of epoch `epoch` over `n` prompts: `random.seed(seed + epoch)` then
/// `random.shuffle(list(range(n)))`, as slime's `Dataset.shuffle(epoch)`.
pub fn epoch_permutation(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    PyRandom::new(seed.wrapping_add(epoch)).shuffle(&mut order);
    order
}
