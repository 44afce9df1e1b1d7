//! Token sampling for the built-in engine: temperature sampling without top-k / top-p as a
//! Gumbel-max over counter-based noise, one kernel on CUDA (`vime_sample_gumbel` in
//! `cuda/ops.cu`), the same arithmetic on the host.
//!
//! Decisions:
//! - It is vLLM's sampler for this case (`vllm/v1/sample/ops/topk_topp_sampler.py`,
//!   `random_sample`: `probs / Exponential(1)` then argmax, an exponential race), written as the
//!   equivalent Gumbel-max `argmax(z / T - log(-log u))`, so no softmax or sort over the
//!   vocabulary is needed and only one token per row leaves the device.
//! - The noise of vocabulary entry `j` is a hash of `(seed, counter, j)` (SplitMix64's mixer):
//!   a request with a seed samples the same tokens whatever else is in the batch, and the counter
//!   (the request's token index) makes every step's noise fresh.
//! - `inv_t = 0` is greedy (the first largest logit). Ties go to the smallest index; NaN never
//!   wins.
//! - [`sample_gumbel_logprobs`] also returns the sampled token's log-prob under the raw logits
//!   (temperature 1, what vLLM reports and the trainer computes), from the same pass over the row
//!   (a running max and sum of exponentials), so the engine needs the LM head once per step.
use candle_core::{bail, DType, Result, Tensor};

/// SplitMix64's output function.
fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The sampling key of logit `z` at vocabulary index `j` for a row of `base` noise
/// (`mix64(seed + counter * GOLDEN)`) and inverse temperature `inv_t` (the kernel's arithmetic).
fn key(z: f32, j: usize, base: u64, inv_t: f32) -> f32 {
    if inv_t == 0.0 {
        return z;
    }
    let h = mix64(base.wrapping_add(j as u64));
    let u = ((h >> 40) as f32 + 0.5) * 5.960_464_5e-8;
    z * inv_t - (-(u.ln())).ln()
}

/// One token per row of `logits` (`[rows, vocab]`, f32): row `r` draws from
/// `softmax(logits[r] * inv_t[r])` with noise `(seeds[r], counters[r])`, or takes the argmax
/// where `inv_t[r] == 0`. On CUDA one kernel; elsewhere the same arithmetic on the host.
pub fn sample_gumbel(logits: &Tensor, seeds: &[u64], counters: &[u64], inv_t: &[f32]) -> Result<Vec<u32>> {
    Ok(sample(logits, seeds, counters, inv_t, false)?.0)
}

/// [`sample_gumbel`], and each sampled token's log-prob under `log_softmax(logits[r])` (the raw
/// logits, whatever the temperature).
pub fn sample_gumbel_logprobs(
    logits: &Tensor,
    seeds: &[u64],
    counters: &[u64],
    inv_t: &[f32],
) -> Result<(Vec<u32>, Vec<f32>)> {
    let (toks, lps) = sample(logits, seeds, counters, inv_t, true)?;
    Ok((toks, lps.unwrap_or_default()))
}

fn sample(
    logits: &Tensor,
    seeds: &[u64],
    counters: &[u64],
    inv_t: &[f32],
    logprobs: bool,
) -> Result<(Vec<u32>, Option<Vec<f32>>)> {
    let (rows, vocab) = logits.dims2()?;
    if logits.dtype() != DType::F32 {
        bail!("sample_gumbel: logits must be f32, got {:?}", logits.dtype());
    }
    if seeds.len() != rows || counters.len() != rows || inv_t.len() != rows {
        bail!(
            "sample_gumbel: {rows} rows but {} seeds, {} counters, {} inverse temperatures",
            seeds.len(),
            counters.len(),
            inv_t.len()
        );
    }
    if rows == 0 || vocab == 0 {
        return Ok((vec![0; rows], logprobs.then(|| vec![f32::NEG_INFINITY; rows])));
    }
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() {
        return crate::cuda::sample_gumbel(logits, seeds, counters, inv_t, logprobs);
    }
    let x = logits.to_vec2::<f32>()?;
    let toks: Vec<u32> = x
        .iter()
        .enumerate()
        .map(|(r, row)| {
            let base = mix64(seeds[r].wrapping_add(counters[r].wrapping_mul(0x9E37_79B9_7F4A_7C15)));
            let (mut best, mut bi) = (f32::NEG_INFINITY, None);
            for (j, &z) in row.iter().enumerate() {
                let k = key(z, j, base, inv_t[r]);
                if k > best || bi.is_none() && k == best {
                    best = k;
                    bi = Some(j);
                }
            }
            bi.unwrap_or(0) as u32
        })
        .collect();
    let lps = logprobs.then(|| x.iter().zip(&toks).map(|(row, &t)| raw_logprob(row, t)).collect());
    Ok((toks, lps))
}

/// `log_softmax(row)[token]`, summed in f64: the host mirror's log-prob (and the engine's for
/// rows it samples on the host).
pub fn raw_logprob(row: &[f32], token: u32) -> f32 {
    let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    let s: f64 = row.iter().map(|&z| (z as f64 - m).exp()).sum();
    (row[token as usize] as f64 - m - s.ln()) as f32
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Frequencies over many seeds follow softmax(z / T) (chi-square), greedy is the first
    /// argmax, and a row's token depends only on its own (seed, counter).
    #[test]
    fn draws_follow_the_softmax_and_depend_only_on_seed_and_counter() {
        let z: Vec<f32> = (0..12).map(|i| ((i * 7 % 5) as f32 - 2.0) * 0.7).collect();
        for t in [1.0f32, 0.5] {
            let n = 20_000;
            let logits = Tensor::from_vec(z.repeat(n), (n, 12), &Device::Cpu).unwrap();
            let seeds: Vec<u64> = (0..n as u64).collect();
            let toks = sample_gumbel(&logits, &seeds, &vec![3; n], &vec![1.0 / t; n]).unwrap();
            let m = z.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let w: Vec<f64> = z.iter().map(|&v| (((v - m) / t) as f64).exp()).collect();
            let total: f64 = w.iter().sum();
            let mut counts = [0usize; 12];
            for &k in &toks {
                counts[k as usize] += 1;
            }
            let chi: f64 = counts
                .iter()
                .zip(&w)
                .map(|(&c, &p)| {
                    let e = p / total * n as f64;
                    (c as f64 - e).powi(2) / e
                })
                .sum();
            // 11 degrees of freedom: the 0.999 quantile is 31.3.
            assert!(chi < 31.3, "T {t}: chi2 {chi:.1}, counts {counts:?}");
        }
        // Greedy: the first of the largest logits (several entries of z tie at the maximum).
        let logits = Tensor::from_vec(z.clone(), (1, 12), &Device::Cpu).unwrap();
        let first_max = z
            .iter()
            .position(|&v| v == z.iter().cloned().fold(f32::NEG_INFINITY, f32::max))
            .unwrap();
        assert_eq!(
            sample_gumbel(&logits, &[9], &[0], &[0.0]).unwrap(),
            vec![first_max as u32]
        );
        // Row independence: a row alone and inside a batch draw the same token.
        let batch = Tensor::from_vec(z.repeat(3), (3, 12), &Device::Cpu).unwrap();
        let all = sample_gumbel(&batch, &[5, 77, 9], &[1, 2, 3], &[1.0; 3]).unwrap();
        let alone = sample_gumbel(&logits, &[77], &[2], &[1.0]).unwrap();
        assert_eq!(all[1], alone[0]);
        // The log-probs are log_softmax of the raw logits at the sampled token, at any temperature.
        let (toks, lps) = sample_gumbel_logprobs(&batch, &[5, 77, 9], &[1, 2, 3], &[1.0, 2.0, 0.0]).unwrap();
        let m = z.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let lse = m + z.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
        for (&t, &lp) in toks.iter().zip(&lps) {
            assert!(
                (lp as f64 - (z[t as usize] as f64 - lse)).abs() < 1e-6,
                "{lp} vs {}",
                z[t as usize] as f64 - lse
            );
        }
        let e = format!("{}", sample_gumbel(&batch, &[1], &[1, 2, 3], &[1.0; 3]).unwrap_err());
        assert!(e.contains("3 rows but 1 seeds"), "{e}");
    }
}
