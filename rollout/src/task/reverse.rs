//! Digit-string reversal as a verifiable task: the prompt `"52813="`, the label `"31825"`, scored by
//! `--rm-type exact_match`. The CPU demo's task: a 400k-parameter model learns it from scratch in
//! a few hundred optimizer steps (integer addition, whose digits are sums modulo 10, takes a tiny
//! model thousands), so SFT reaches a partial accuracy quickly and RL has room to improve on it.
//!
//! Decisions: the length is uniform in `min_len..=max_len`, then every digit uniform (leading zeros
//! allowed: the string is a string, not a number). The vocabulary is the ten digits and `'='`.
use anyhow::{bail, Result};
use vime_kernels::testing::Rng;

use super::arith::below;
use super::SyntheticTask;

/// The longest string [`ReverseTask`] accepts.
pub const MAX_LEN: u32 = 32;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReverseTask {
    pub min_len: u32,
    pub max_len: u32,
}

impl Default for ReverseTask {
    /// Strings of 3 to 6 digits: 1,111,000 distinct prompts, 11 tokens at most with the EOS.
    fn default() -> Self {
        ReverseTask { min_len: 3, max_len: 6 }
    }
}

impl SyntheticTask for ReverseTask {
    fn validate(&self) -> Result<()> {
        if self.min_len == 0 || self.min_len > self.max_len || self.max_len > MAX_LEN {
            bail!(
                "reverse task: lengths {}..={} must satisfy 1 <= min_len <= max_len <= {MAX_LEN}",
                self.min_len,
                self.max_len
            );
        }
        Ok(())
    }

    fn sample(&self, rng: &mut Rng) -> (String, String) {
        let len = self.min_len + below(rng, (self.max_len - self.min_len + 1) as u64) as u32;
        let s: String = (0..len).map(|_| char::from(b'0' + below(rng, 10) as u8)).collect();
        (format!("{s}="), s.chars().rev().collect())
    }

    fn num_prompts(&self) -> u128 {
        (self.min_len..=self.max_len).map(|l| 10u128.saturating_pow(l)).sum()
    }

    fn vocab_chars(&self) -> String {
        "0123456789=".to_string()
    }
}
