//! Advantage estimators and returns, host-side in f64, over packed loss tokens (`cu_seqlens`).
//!
//! Follows slime: reward post-processing in `slime/ray/rollout.py::_post_process_rewards`, the
//! estimators in `slime/utils/ppo_utils.py`, the dispatch and whitening in
//! `slime/backends/megatron_utils/loss.py::compute_advantages_and_returns` and
//! `slime/utils/distributed_utils.py::distributed_masked_whiten`.
//!
//! Decisions (each is slime's behaviour, kept on purpose):
//! - GRPO-family rewards are normalised per prompt group *before* this step, on the whole rollout
//!   ([`post_process_rewards`]); the per-token advantage is then that scalar broadcast to every
//!   response token, masked or not.
//! - The KL used as a reward penalty is `--kl-loss-type`'s estimator of `log_probs - ref_log_probs`
//!   without importance ratio; with `kl_coef == 0` it is all zeros (no reference model needed).
//! - PPO adds the scalar reward on the *last response token* and ignores the loss mask in GAE;
//!   REINFORCE++ masks the KL and adds the reward on the *last unmasked* token.
//! - Whitening uses the masked mean and the Bessel-corrected masked variance over every loss token
//!   of every data-parallel rank, `(a - mean) / sqrt(var + 1e-8)`, and writes every token (masked
//!   ones too).
use super::{AdvantageEstimator, KlType, RlArgs};
use anyhow::{bail, ensure, Result};

/// A sum all-reduce over the data-parallel group, for the statistics of [`masked_whiten`].
/// Single-process training passes [`NoAllReduce`]; a closure `Fn(&mut [f64]) -> Result<()>` works.
pub trait SumAllReduce {
    /// Replace `values` in place by their element-wise sum over all ranks.
    fn all_reduce_sum(&self, values: &mut [f64]) -> Result<()>;
}

/// The identity all-reduce of a single rank.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoAllReduce;

impl SumAllReduce for NoAllReduce {
    fn all_reduce_sum(&self, _values: &mut [f64]) -> Result<()> {
        Ok(())
    }
}

impl<F: Fn(&mut [f64]) -> Result<()>> SumAllReduce for F {
    fn all_reduce_sum(&self, values: &mut [f64]) -> Result<()> {
        self(values)
    }
}

/// slime `RolloutManager._post_process_rewards` (`slime/ray/rollout.py`): the per-sample reward
/// the advantage estimators see.
///
/// For grpo / gspo / cispo / reinforce_plus_plus_baseline (unless `disable_rewards_normalization`)
/// rewards are split into groups of `n_samples_per_prompt` — or, when the count is not
/// `n_samples_per_prompt * rollout_batch_size`, into a single group of all of them, as slime does —
/// and each becomes `r - mean(group)`; grpo / gspo / cispo then divide by
/// `std_unbiased(group) + 1e-6` unless `disable_grpo_std_normalization`. Other estimators get the
/// raw rewards. slime would silently produce NaN for a std over one sample; this is an error here.
pub fn post_process_rewards(
    args: &RlArgs,
    raw_rewards: &[f64],
    n_samples_per_prompt: usize,
    rollout_batch_size: usize,
) -> Result<Vec<f64>> {
    use AdvantageEstimator::*;
    let est = args.advantage_estimator;
    if !matches!(est, Grpo | Gspo | Cispo | ReinforcePlusPlusBaseline) || args.disable_rewards_normalization {
        return Ok(raw_rewards.to_vec());
    }
    if raw_rewards.is_empty() {
        return Ok(Vec::new());
    }
    let group = if raw_rewards.len() == n_samples_per_prompt * rollout_batch_size {
        n_samples_per_prompt
    } else {
        raw_rewards.len()
    };
    ensure!(group > 0, "n_samples_per_prompt must be positive");
    let divide_by_std = matches!(est, Grpo | Gspo | Cispo) && !args.disable_grpo_std_normalization;
    if divide_by_std && group < 2 {
        bail!("GRPO std normalization needs groups of at least 2 samples, got a group of {group}");
    }
    let mut out = Vec::with_capacity(raw_rewards.len());
    for g in raw_rewards.chunks(group) {
        let mean = g.iter().sum::<f64>() / g.len() as f64;
        let centered: Vec<f64> = g.iter().map(|r| r - mean).collect();
        if divide_by_std {
            let c_mean = centered.iter().sum::<f64>() / g.len() as f64;
            let var = centered.iter().map(|c| (c - c_mean).powi(2)).sum::<f64>() / (g.len() - 1) as f64;
            let std = var.sqrt();
            out.extend(centered.iter().map(|c| c / (std + 1e-6)));
        } else {
            out.extend(centered);
        }
    }
    Ok(out)
}

/// slime `compute_approx_kl` on one token without importance ratio, `d = log_prob - log_prob_base`:
/// k1 `d`; k2 `d^2 / 2`; k3 and low_var_kl `exp(-d) - 1 + d`, low_var_kl clamped to `[-10, 10]`.
pub fn approx_kl_host(log_prob: f64, log_prob_base: f64, kl_type: KlType) -> f64 {
    let d = log_prob - log_prob_base;
    match kl_type {
        KlType::K1 => d,
        KlType::K2 => d * d / 2.0,
        KlType::K3 => (-d).exp() - 1.0 + d,
        KlType::LowVarKl => ((-d).exp() - 1.0 + d).clamp(-10.0, 10.0),
    }
}

/// The inputs of [`compute_advantages_and_returns`]: packed loss tokens of `cu_seqlens.len() - 1`
/// samples. `log_probs` / `ref_log_probs` are needed when `kl_coef != 0`, `values` for ppo.
#[derive(Debug, Clone, Copy)]
pub struct AdvantageInputs<'a> {
    /// Sample boundaries over the packed tokens: `[0, n_0, n_0 + n_1, ..]`.
    pub cu_seqlens: &'a [usize],
    /// One reward per sample, already through [`post_process_rewards`].
    pub rewards: &'a [f64],
    /// 0/1 per token.
    pub loss_mask: &'a [f64],
    /// The policy's log-probs of the sampled tokens (slime's `log_probs`, the old policy).
    pub log_probs: Option<&'a [f64]>,
    pub ref_log_probs: Option<&'a [f64]>,
    /// The critic's values per token (ppo).
    pub values: Option<&'a [f64]>,
}

/// Per-token advantages and returns (packed like the inputs), and the KL used as reward penalty.
#[derive(Debug, Clone, PartialEq)]
pub struct AdvantageOutputs {
    pub advantages: Vec<f64>,
    pub returns: Vec<f64>,
    pub kl: Vec<f64>,
}

/// slime `compute_advantages_and_returns` (`slime/backends/megatron_utils/loss.py`):
///
/// - grpo, gspo, cispo: `A_t = G_t = r` ([`grpo_returns`]);
/// - ppo: token rewards `-kl_coef * kl_t` plus `r` on the last token, then GAE ([`gae`]);
/// - reinforce_plus_plus: discounted returns of the masked, KL-penalised token rewards
///   ([`reinforce_plus_plus_returns`]), `A = G`;
/// - reinforce_plus_plus_baseline: `A_t = G_t = r - kl_coef * kl_t`;
///
/// then, with `normalize_advantages`, [`masked_whiten`] over all ranks through `all_reduce`.
pub fn compute_advantages_and_returns(
    args: &RlArgs,
    inputs: &AdvantageInputs,
    all_reduce: &dyn SumAllReduce,
) -> Result<AdvantageOutputs> {
    let cu = inputs.cu_seqlens;
    ensure!(
        !cu.is_empty() && cu[0] == 0 && cu.windows(2).all(|w| w[0] <= w[1]),
        "cu_seqlens must start at 0 and be non-decreasing, got {cu:?}"
    );
    let num_samples = cu.len() - 1;
    let num_tokens = cu[num_samples];
    ensure!(
        inputs.rewards.len() == num_samples,
        "{} rewards for {num_samples} samples",
        inputs.rewards.len()
    );
    let check_len = |name: &str, len: usize| -> Result<()> {
        ensure!(
            len == num_tokens,
            "{name} has {len} tokens, cu_seqlens says {num_tokens}"
        );
        Ok(())
    };
    check_len("loss_mask", inputs.loss_mask.len())?;

    let kl: Vec<f64> = match (args.kl_coef != 0.0, inputs.log_probs) {
        (true, Some(lp)) => {
            let Some(rp) = inputs.ref_log_probs else {
                bail!("kl_coef = {} needs the reference model's log-probs", args.kl_coef);
            };
            check_len("log_probs", lp.len())?;
            check_len("ref_log_probs", rp.len())?;
            lp.iter()
                .zip(rp)
                .map(|(&a, &b)| approx_kl_host(a, b, args.kl_loss_type))
                .collect()
        }
        _ => vec![0.0; num_tokens],
    };

    let (advantages, returns) = match args.advantage_estimator {
        AdvantageEstimator::Grpo | AdvantageEstimator::Gspo | AdvantageEstimator::Cispo => {
            let g = grpo_returns(inputs.rewards, cu);
            (g.clone(), g)
        }
        AdvantageEstimator::Ppo => {
            let Some(values) = inputs.values else {
                bail!("advantage_estimator ppo needs the critic's values");
            };
            check_len("values", values.len())?;
            let mut adv = Vec::with_capacity(num_tokens);
            let mut ret = Vec::with_capacity(num_tokens);
            for (s, w) in cu.windows(2).enumerate() {
                let mut token_rewards: Vec<f64> = kl[w[0]..w[1]].iter().map(|k| k * -args.kl_coef).collect();
                if let Some(last) = token_rewards.last_mut() {
                    *last += inputs.rewards[s];
                }
                let (a, r) = gae(&token_rewards, &values[w[0]..w[1]], args.gamma, args.lambd);
                adv.extend(a);
                ret.extend(r);
            }
            (adv, ret)
        }
        AdvantageEstimator::ReinforcePlusPlus => {
            let g = reinforce_plus_plus_returns(inputs.rewards, &kl, inputs.loss_mask, cu, args.kl_coef, args.gamma)?;
            (g.clone(), g)
        }
        AdvantageEstimator::ReinforcePlusPlusBaseline => {
            let a = reinforce_plus_plus_baseline_advantages(inputs.rewards, &kl, cu, args.kl_coef);
            (a.clone(), a)
        }
    };

    let advantages = if args.normalize_advantages {
        masked_whiten(&advantages, inputs.loss_mask, all_reduce)?
    } else {
        advantages
    };
    Ok(AdvantageOutputs {
        advantages,
        returns,
        kl,
    })
}

/// slime `get_grpo_returns`: each sample's reward broadcast to all of its tokens.
pub fn grpo_returns(rewards: &[f64], cu_seqlens: &[usize]) -> Vec<f64> {
    cu_seqlens
        .windows(2)
        .zip(rewards)
        .flat_map(|(w, &r)| std::iter::repeat_n(r, w[1] - w[0]))
        .collect()
}

/// slime `vanilla_gae` / `chunked_gae` on one sample (`V_T = 0` past the last token):
/// `delta_t = r_t + gamma * V_{t+1} - V_t`, `A_t = delta_t + gamma * lambd * A_{t+1}`,
/// returns `G_t = A_t + V_t`. Returns `(advantages, returns)`.
pub fn gae(token_rewards: &[f64], values: &[f64], gamma: f64, lambd: f64) -> (Vec<f64>, Vec<f64>) {
    let n = token_rewards.len();
    let mut adv = vec![0.0; n];
    let mut last = 0.0;
    for t in (0..n).rev() {
        let next_value = if t + 1 < n { values[t + 1] } else { 0.0 };
        let delta = token_rewards[t] + gamma * next_value - values[t];
        last = delta + gamma * lambd * last;
        adv[t] = last;
    }
    let ret = adv.iter().zip(values).map(|(a, v)| a + v).collect();
    (adv, ret)
}

/// slime `chunked_discounted_returns` on one sample: `G_t = r_t + gamma * G_{t+1}`, `G_T = 0`.
pub fn discounted_returns(token_rewards: &[f64], gamma: f64) -> Vec<f64> {
    let mut out = vec![0.0; token_rewards.len()];
    let mut acc = 0.0;
    for t in (0..token_rewards.len()).rev() {
        acc = token_rewards[t] + gamma * acc;
        out[t] = acc;
    }
    out
}

/// slime `get_reinforce_plus_plus_returns`: token rewards `-kl_coef * kl_t * mask_t`, plus the
/// sample's reward on its last unmasked token, then [`discounted_returns`]. A sample without any
/// unmasked token is an error (slime asserts).
pub fn reinforce_plus_plus_returns(
    rewards: &[f64],
    kl: &[f64],
    loss_mask: &[f64],
    cu_seqlens: &[usize],
    kl_coef: f64,
    gamma: f64,
) -> Result<Vec<f64>> {
    let mut out = Vec::with_capacity(kl.len());
    for (s, w) in cu_seqlens.windows(2).enumerate() {
        let (kl, mask) = (&kl[w[0]..w[1]], &loss_mask[w[0]..w[1]]);
        let Some(last) = mask.iter().rposition(|&m| m != 0.0) else {
            bail!("reinforce_plus_plus: sample {s} has no unmasked token");
        };
        let mut token_rewards: Vec<f64> = kl.iter().zip(mask).map(|(k, m)| -kl_coef * (k * m)).collect();
        token_rewards[last] += rewards[s];
        out.extend(discounted_returns(&token_rewards, gamma));
    }
    Ok(out)
}

/// slime `get_reinforce_plus_plus_baseline_advantages`: `A_t = r - kl_coef * kl_t`, with `r`
/// already baseline-subtracted by [`post_process_rewards`]; the loss mask is not applied.
pub fn reinforce_plus_plus_baseline_advantages(
    rewards: &[f64],
    kl: &[f64],
    cu_seqlens: &[usize],
    kl_coef: f64,
) -> Vec<f64> {
    cu_seqlens
        .windows(2)
        .zip(rewards)
        .flat_map(|(w, &r)| kl[w[0]..w[1]].iter().map(move |k| r - kl_coef * k))
        .collect()
}

/// slime `distributed_masked_whiten` (shift_mean, epsilon 1e-8): with `n = sum(mask)`,
/// `mean = sum(a * mask) / n`, `var = (sum(a^2 * mask) / n - mean^2) * n / (n - 1)` (the Bessel
/// factor only when `n >= 2`), every token becomes `(a - mean) / sqrt(var + 1e-8)`. The three sums
/// go through `all_reduce` so the statistics are those of the whole data-parallel batch.
pub fn masked_whiten(values: &[f64], loss_mask: &[f64], all_reduce: &dyn SumAllReduce) -> Result<Vec<f64>> {
    ensure!(
        values.len() == loss_mask.len(),
        "masked_whiten: {} values, {} mask entries",
        values.len(),
        loss_mask.len()
    );
    let mut stats = [0.0f64; 3];
    for (&v, &m) in values.iter().zip(loss_mask) {
        stats[0] += v * m;
        stats[1] += v * v * m;
        stats[2] += m;
    }
    all_reduce.all_reduce_sum(&mut stats)?;
    let [sum, sum_sq, n] = stats;
    ensure!(
        n != 0.0,
        "the loss mask is empty on every rank: nothing to whiten the advantages over"
    );
    let mean = sum / n;
    let mut var = sum_sq / n - mean * mean;
    if n >= 2.0 {
        var *= n / (n - 1.0);
    }
    let inv_std = 1.0 / (var + 1e-8).sqrt();
    Ok(values.iter().map(|v| (v - mean) * inv_std).collect())
}
