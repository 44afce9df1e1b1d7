//! Evaluation: every prompt of each `--eval-prompt-data` set, `--n-samples-per-eval-prompt`
//! samples each, scored by the reward; reports the mean reward, pass@k and response lengths.
//!
//! pass@k is the unbiased estimator of Chen et al. (2021), `1 - C(n - c, k) / C(n, k)` per prompt
//! with `c` passing samples out of `n`, averaged over prompts; a sample passes when its reward is
//! at least `--eval-pass-threshold`. Eval sampling seeds depend on (seed, set, prompt, sample)
//! only, so successive evaluations draw with the same random numbers and their differences are
//! the model's, not the sampler's.

/// `1 - C(n - c, k) / C(n, k)`: the chance that at least one of `k` samples drawn without
/// replacement from `n` (of which `c` pass) passes.
pub fn pass_at_k(n: usize, c: usize, k: usize) -> f64 {
    assert!(c <= n && k >= 1 && k <= n, "pass_at_k(n={n}, c={c}, k={k})");
    if n - c < k {
        return 1.0;
    }
    // prod_{i = n - c + 1}^{n} (1 - k / i), the numerically stable form.
    let mut fail = 1.0;
    for i in (n - c + 1)..=n {
        fail *= 1.0 - k as f64 / i as f64;
    }
    1.0 - fail
}

/// The k reported for `n` samples per prompt: 1, the powers of two below n, and n.
pub fn reported_ks(n: usize) -> Vec<usize> {
    let mut ks = vec![1];
    let mut k = 2;
    while k < n {
        ks.push(k);
        k *= 2;
    }
    if n > 1 {
        ks.push(n);
    }
    ks
}

#[cfg(test)]
mod tests {
    use super::*;

    fn binom(n: u64, k: u64) -> f64 {
        if k > n {
            return 0.0;
        }
        (0..k).fold(1.0, |acc, i| acc * (n - i) as f64 / (i + 1) as f64)
    }

    #[test]
    fn pass_at_k_matches_the_binomial_form() {
        for n in 1..=12usize {
            for c in 0..=n {
                for k in 1..=n {
                    let direct = 1.0 - binom((n - c) as u64, k as u64) / binom(n as u64, k as u64);
                    let got = pass_at_k(n, c, k);
                    assert!((got - direct).abs() < 1e-12, "n={n} c={c} k={k}: {got} vs {direct}");
                }
            }
        }
        assert_eq!(pass_at_k(8, 2, 1), 0.25);
        assert_eq!(pass_at_k(8, 0, 8), 0.0);
        assert_eq!(pass_at_k(8, 1, 8), 1.0);
        assert_eq!(reported_ks(8), vec![1, 2, 4, 8]);
        assert_eq!(reported_ks(6), vec![1, 2, 4, 6]);
        assert_eq!(reported_ks(1), vec![1]);
    }
}
