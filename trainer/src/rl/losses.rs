//! The policy loss (PPO clip, dual clip, GSPO, CISPO; KL loss; entropy bonus; TIS) and the clipped
//! value loss, on candle tensors of any float dtype, over packed loss tokens.
//!
//! Follows slime `slime/utils/ppo_utils.py` (`compute_approx_kl`, `compute_policy_loss`,
//! `compute_cispo_loss`, `compute_gspo_kl`) and `slime/backends/megatron_utils/loss.py`
//! (`policy_loss_function`, `value_loss_function`, `vanilla_tis_function`, `loss_function`), with
//! the reduction of `slime/backends/megatron_utils/cp_utils.py::get_sum_of_sample_mean`.
//!
//! Decisions:
//! - Every token input is a 1-D tensor `[N]` over the loss tokens; [`LossReducer`] carries the
//!   sample boundaries and the loss mask and turns per-token terms into slime's scalars.
//! - A loss function returns what slime's `policy_loss_function` / `value_loss_function` return:
//!   the reducer's *sums* (over samples of per-sample means, or over tokens). Dividing by the step's
//!   sample or token count is the caller's (see [`LossReducer`]), because the count spans every
//!   micro-batch and data-parallel rank of the step.
//! - Metrics are slime's `reported_loss` keys, reduced the same way, as f64 without gradient.
//! - Clamps are `maximum` then `minimum`, so a value sitting exactly on a bound sends half its
//!   gradient through (torch's `clamp` sends all of it); this only differs on exact ties.
use super::{AdvantageEstimator, KlType, RlArgs};
use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Tensor};
use std::collections::BTreeMap;

/// slime's `sum_of_sample_mean` (`cp_utils.get_sum_of_sample_mean`, CP size 1) over packed loss
/// tokens:
///
/// - default: `reduce(x) = sum_s sum_{t in s} x_t * mask_t / max(denom_s, 1)`, `denom_s` being the
///   sample's mask sum, or the caller's `sample_denoms` (slime's `rollout_mask_sums`: every sample
///   of one rollout gets that rollout's total mask sum);
/// - `calculate_per_token_loss`: `reduce(x) = sum_t x_t * mask_t`.
///
/// The step objective is `reduce(..) / step_global_batch_size` (the number of samples of the whole
/// step, over micro-batches and data-parallel ranks) by default, and `reduce(..) / num_tokens`
/// summed over the step with `calculate_per_token_loss`: slime's `loss_function` scales by
/// `num_microbatches / step_global_batch_size * dp_size` and Megatron divides by
/// `num_microbatches` and averages over DP, or divides by the all-reduced `num_tokens`.
#[derive(Debug, Clone)]
pub struct LossReducer {
    cu_seqlens: Vec<usize>,
    /// `[N]`, in the loss dtype.
    mask: Tensor,
    /// `[S]`: `max(mask sum of the sample, 1)`, for GSPO's per-sample means.
    sample_mask_sums: Tensor,
    /// `[N]`: the weight of each token in `reduce`.
    weights: Tensor,
    num_tokens: f64,
}

impl LossReducer {
    /// `loss_mask` is `[N]` (0/1) in the dtype the losses are computed in; `cu_seqlens` the sample
    /// boundaries `[0, .., N]`.
    pub fn new(
        cu_seqlens: &[usize],
        loss_mask: &Tensor,
        sample_denoms: Option<&[f64]>,
        calculate_per_token_loss: bool,
    ) -> Result<Self> {
        let n = Self::tokens_of(cu_seqlens)?;
        ensure!(
            loss_mask.dims() == [n],
            "loss_mask has shape {:?}, cu_seqlens says [{n}]",
            loss_mask.dims()
        );
        let mask_host: Vec<f64> = loss_mask.to_dtype(DType::F64)?.to_vec1()?;
        Self::build(
            cu_seqlens,
            &mask_host,
            loss_mask.detach(),
            sample_denoms,
            calculate_per_token_loss,
        )
    }

    /// [`Self::new`] from the mask's host values (`[N]`, 0/1), with the reducer's tensors in
    /// `dtype` on `device`. It reads nothing from the device: `new` copies the mask to the host,
    /// which waits for every kernel queued before it, and the trainer builds its reducer between
    /// a micro-batch's forward and backward, where that wait left the GPU idle while the host
    /// then queued the loss and the backward.
    pub fn from_host_mask(
        cu_seqlens: &[usize],
        loss_mask: &[f64],
        dtype: DType,
        device: &candle_core::Device,
        sample_denoms: Option<&[f64]>,
        calculate_per_token_loss: bool,
    ) -> Result<Self> {
        let n = Self::tokens_of(cu_seqlens)?;
        ensure!(
            loss_mask.len() == n,
            "loss_mask has {} values, cu_seqlens says [{n}]",
            loss_mask.len()
        );
        let mask = Tensor::from_slice(loss_mask, n, device)?.to_dtype(dtype)?;
        Self::build(cu_seqlens, loss_mask, mask, sample_denoms, calculate_per_token_loss)
    }

    /// `N`, the last of `cu_seqlens` once they are checked.
    fn tokens_of(cu_seqlens: &[usize]) -> Result<usize> {
        ensure!(
            !cu_seqlens.is_empty() && cu_seqlens[0] == 0 && cu_seqlens.windows(2).all(|w| w[0] <= w[1]),
            "cu_seqlens must start at 0 and be non-decreasing, got {cu_seqlens:?}"
        );
        Ok(cu_seqlens[cu_seqlens.len() - 1])
    }

    /// The reducer of `cu_seqlens` (checked by the caller) and the mask, given both on the host
    /// and as the device tensor `mask` (in the loss dtype).
    fn build(
        cu_seqlens: &[usize],
        mask_host: &[f64],
        mask: Tensor,
        sample_denoms: Option<&[f64]>,
        calculate_per_token_loss: bool,
    ) -> Result<Self> {
        let num_samples = cu_seqlens.len() - 1;
        let n = cu_seqlens[num_samples];
        if let Some(d) = sample_denoms {
            ensure!(
                d.len() == num_samples,
                "{} sample_denoms for {num_samples} samples",
                d.len()
            );
        }
        let mut weights = Vec::with_capacity(n);
        let mut mask_sums = Vec::with_capacity(num_samples);
        let mut num_tokens = 0.0;
        for (s, w) in cu_seqlens.windows(2).enumerate() {
            let m = &mask_host[w[0]..w[1]];
            let mask_sum: f64 = m.iter().sum();
            let denom = sample_denoms.map_or(mask_sum, |d| d[s]).max(1.0);
            if calculate_per_token_loss {
                weights.extend_from_slice(m);
            } else {
                weights.extend(m.iter().map(|x| x / denom));
            }
            mask_sums.push(mask_sum.max(1.0));
            num_tokens += mask_sum.max(1.0);
        }
        let (dtype, dev) = (mask.dtype(), mask.device().clone());
        Ok(LossReducer {
            cu_seqlens: cu_seqlens.to_vec(),
            mask,
            sample_mask_sums: Tensor::from_vec(mask_sums, num_samples, &dev)?.to_dtype(dtype)?,
            weights: Tensor::from_vec(weights, n, &dev)?.to_dtype(dtype)?,
            num_tokens,
        })
    }

    /// This reducer restricted to the tokens where `keep` (`[N]`, 0/1) is 1, with the same
    /// denominators: what a context-parallel rank reduces over the tokens it holds, so that the
    /// ranks' sums add up to the whole batch's. (Per-sample means, `sample_mean_per_token`, would
    /// need the other ranks' tokens; GSPO is refused under CP.)
    pub fn restricted_to(&self, keep: &Tensor) -> Result<Self> {
        self.check("keep", &keep.to_dtype(self.mask.dtype())?)?;
        let mut r = self.clone();
        r.weights = self.weights.mul(&keep.to_dtype(self.weights.dtype())?)?;
        Ok(r)
    }

    /// The scalar `reduce(x)` of the type comment.
    pub fn reduce(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.mul(&self.weights)?.sum_all()?)
    }

    /// Each sample's masked mean `sum_{t in s} x_t mask_t / max(sum_{t in s} mask_t, 1)`, repeated
    /// on every token of the sample (`[N]`).
    ///
    /// Each sample's tokens are one slice (`cu_seqlens`): a sum per slice, broadcast back, not
    /// `index_add` by sample id, which on a 1-D tensor runs on one GPU thread (forward and, through
    /// `index_select`'s gradient, backward).
    pub fn sample_mean_per_token(&self, x: &Tensor) -> Result<Tensor> {
        let xm = x.mul(&self.mask)?;
        let mut parts = Vec::with_capacity(self.num_samples());
        for (s, w) in self.cu_seqlens.windows(2).enumerate() {
            let len = w[1] - w[0];
            if len == 0 {
                continue;
            }
            let mean = xm
                .narrow(0, w[0], len)?
                .sum_keepdim(0)?
                .div(&self.sample_mask_sums.narrow(0, s, 1)?)?;
            // Broadcast views: `cat` copies them into place itself.
            parts.push(mean.broadcast_as(len)?);
        }
        Ok(match parts.len() {
            0 => x.zeros_like()?,
            _ => Tensor::cat(&parts, 0)?,
        })
    }

    /// slime `loss_function`'s `num_tokens`: `sum_s max(sum_{t in s} mask_t, 1)`, this micro-batch's
    /// share of the per-token normalizer.
    pub fn num_tokens(&self) -> f64 {
        self.num_tokens
    }

    pub fn num_samples(&self) -> usize {
        self.cu_seqlens.len() - 1
    }

    pub fn cu_seqlens(&self) -> &[usize] {
        &self.cu_seqlens
    }

    fn check(&self, name: &str, t: &Tensor) -> Result<()> {
        let n = *self.cu_seqlens.last().unwrap_or(&0);
        ensure!(
            t.dims() == [n],
            "{name} has shape {:?}, the loss tokens are [{n}]",
            t.dims()
        );
        ensure!(
            t.dtype() == self.mask.dtype(),
            "{name} is {:?}, the loss mask is {:?}",
            t.dtype(),
            self.mask.dtype()
        );
        Ok(())
    }
}

/// A scalar loss (tracked) and slime's metrics for it (reducer sums, see [`LossReducer`]).
///
/// The metrics stay on the device as detached f64 scalars until [`LossOutput::read_metrics`] (or
/// [`read_scalars`] over several micro-batches) copies them to the host in one transfer: reading
/// each one as it is computed would drain the GPU between the forward and the backward of every
/// micro-batch, once a metric.
#[derive(Debug, Clone)]
pub struct LossOutput {
    pub loss: Tensor,
    pub metrics: BTreeMap<String, Tensor>,
}

impl LossOutput {
    /// The metrics' values (one device-to-host copy).
    pub fn read_metrics(&self) -> Result<BTreeMap<String, f64>> {
        let names: Vec<&String> = self.metrics.keys().collect();
        let values = read_scalars(&self.metrics.values().cloned().collect::<Vec<_>>())?;
        Ok(names.into_iter().cloned().zip(values).collect())
    }
}

/// A metric as a detached f64 scalar on the tensor's device (f32 -> f64 is exact, so the value
/// read later is the one an immediate `to_scalar` would have given).
fn scalar(t: &Tensor) -> Result<Tensor> {
    Ok(t.detach().to_dtype(DType::F64)?.reshape(())?)
}

/// Reads scalar tensors (any dtype, one device) to the host as f64 in one device-to-host copy.
pub fn read_scalars(ts: &[Tensor]) -> Result<Vec<f64>> {
    if ts.is_empty() {
        return Ok(Vec::new());
    }
    let flat = ts
        .iter()
        .map(|t| Ok(t.to_dtype(DType::F64)?.reshape(1)?))
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensor::cat(&flat, 0)?.to_vec1::<f64>()?)
}

/// slime `compute_approx_kl`, with `d = log_probs - log_probs_base`:
/// k1 `d`; k2 `d^2 / 2`; k3 / low_var_kl `exp(-d) - 1 + d`; times `importance_ratio` if given
/// (`use_unbiased_kl`); low_var_kl then clamped to `[-10, 10]`.
pub fn approx_kl(
    log_probs: &Tensor,
    log_probs_base: &Tensor,
    kl_type: KlType,
    importance_ratio: Option<&Tensor>,
) -> Result<Tensor> {
    let d = log_probs.sub(log_probs_base)?;
    let kl = match kl_type {
        KlType::K1 => d,
        KlType::K2 => (d.sqr()? / 2.0)?,
        KlType::K3 | KlType::LowVarKl => {
            let neg = d.neg()?;
            neg.exp()?.affine(1.0, -1.0)?.sub(&neg)?
        }
    };
    let kl = match importance_ratio {
        Some(r) => kl.mul(r)?,
        None => kl,
    };
    Ok(match kl_type {
        KlType::LowVarKl => kl.clamp(-10.0, 10.0)?,
        _ => kl,
    })
}

/// slime `compute_policy_loss`, with `ppo_kl = old_logp - logp` and `r = exp(-ppo_kl)`:
/// `L1 = -r A`, `L2 = -clip(r, 1 - eps_clip, 1 + eps_clip_high) A`, `L = max(L1, L2)`,
/// `clipfrac = [L2 > L1]`; dual clip: `L = min(-eps_clip_c A, L)` where `A < 0`.
/// Returns per-token `(pg_losses, clipfrac)`.
pub fn ppo_clip_loss(
    ppo_kl: &Tensor,
    advantages: &Tensor,
    eps_clip: f64,
    eps_clip_high: f64,
    eps_clip_c: Option<f64>,
) -> Result<(Tensor, Tensor)> {
    let ratio = ppo_kl.neg()?.exp()?;
    let l1 = ratio.mul(advantages)?.neg()?;
    let l2 = ratio
        .clamp(1.0 - eps_clip, 1.0 + eps_clip_high)?
        .mul(advantages)?
        .neg()?;
    let clipped = l1.maximum(&l2)?;
    let clipfrac = l2.gt(&l1)?.to_dtype(ppo_kl.dtype())?;
    let pg = match eps_clip_c {
        Some(c) => {
            ensure!(c > 1.0, "dual-clip PPO needs eps_clip_c > 1.0, got {c}");
            let l3 = (advantages * -c)?;
            advantages.lt(0.0)?.where_cond(&l3.minimum(&clipped)?, &clipped)?
        }
        None => clipped,
    };
    Ok((pg, clipfrac))
}

/// slime `compute_cispo_loss` (MiniMax-M1): `r = exp(-ppo_kl)`,
/// `L = -sg(clip(r, 1 - eps_clip, 1 + eps_clip_high)) A logp`, `clipfrac = [clip(r) != r]`; the
/// gradient flows through `logp` only. Returns per-token `(pg_losses, clipfrac)`.
pub fn cispo_loss(
    ppo_kl: &Tensor,
    log_probs: &Tensor,
    advantages: &Tensor,
    eps_clip: f64,
    eps_clip_high: f64,
) -> Result<(Tensor, Tensor)> {
    let ratio = ppo_kl.neg()?.exp()?.detach();
    let truncated = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip_high)?;
    let pg = truncated.mul(advantages)?.mul(log_probs)?.neg()?;
    let clipfrac = truncated.ne(&ratio)?.to_dtype(ppo_kl.dtype())?;
    Ok((pg, clipfrac))
}

/// slime `compute_gspo_kl`: the sequence-level `ppo_kl` of GSPO, each sample's masked mean of
/// `old_logp - logp` (denominator `max(mask sum, 1)`) repeated on its tokens.
pub fn gspo_kl(log_probs: &Tensor, old_log_probs: &Tensor, reducer: &LossReducer) -> Result<Tensor> {
    reducer.sample_mean_per_token(&old_log_probs.sub(log_probs)?)
}

/// Truncated importance sampling between the trainer's (old-policy) and the rollout engine's
/// log-probs, as slime `vanilla_tis_function`; all detached.
#[derive(Debug, Clone)]
pub struct TisWeights {
    /// `clamp(tis, tis_clip_low, tis_clip)`: multiplies the per-token policy loss.
    pub weights: Tensor,
    /// `exp(train_logp - rollout_logp)`.
    pub tis: Tensor,
    /// `[weights != tis]`.
    pub clipfrac: Tensor,
    /// `|tis - 1|`.
    pub tis_abs: Tensor,
}

/// slime `vanilla_tis_function`: `tis = exp(train_logp - rollout_logp)`, weight
/// `clamp(tis, tis_clip_low, tis_clip)`.
pub fn tis_weights(
    train_log_probs: &Tensor,
    rollout_log_probs: &Tensor,
    tis_clip_low: f64,
    tis_clip: f64,
) -> Result<TisWeights> {
    let tis = train_log_probs.detach().sub(&rollout_log_probs.detach())?.exp()?;
    let weights = tis.clamp(tis_clip_low, tis_clip)?;
    let clipfrac = weights.ne(&tis)?.to_dtype(tis.dtype())?;
    let tis_abs = tis.affine(1.0, -1.0)?.abs()?;
    Ok(TisWeights {
        weights,
        tis,
        clipfrac,
        tis_abs,
    })
}

/// The inputs of [`policy_loss`], all `[N]` over the loss tokens, in the reducer's dtype.
#[derive(Debug, Clone, Copy)]
pub struct PolicyLossInputs<'a> {
    /// The current policy's log-probs (tracked).
    pub log_probs: &'a Tensor,
    /// The current policy's entropy (tracked when `entropy_coef != 0`).
    pub entropy: &'a Tensor,
    pub advantages: &'a Tensor,
    /// The old policy's log-probs (slime `log_probs`); `None`: on-policy, `logp.detach()`.
    pub old_log_probs: Option<&'a Tensor>,
    /// The reference model's log-probs, for `use_kl_loss`.
    pub ref_log_probs: Option<&'a Tensor>,
    /// The rollout engine's log-probs: needed by `use_tis`; if given, also reported as
    /// `train_rollout_logprob_abs_diff`.
    pub rollout_log_probs: Option<&'a Tensor>,
}

/// slime `policy_loss_function`, `reduce` being `reducer.reduce`:
///
/// ```text
/// ppo_kl = old_logp - logp                  (gspo: gspo_kl, the per-sample mean)
/// pg     = ppo_clip_loss(ppo_kl, A) | cispo_loss(ppo_kl, logp, A)
/// pg    *= tis_weights(old_logp, rollout_logp)                      if use_tis
/// loss   = reduce(pg) - entropy_coef * reduce(entropy)
///        + kl_loss_coef * reduce(approx_kl(logp, ref_logp, kl_loss_type,
///                                          exp(logp - old_logp) if use_unbiased_kl))  if use_kl_loss
/// ```
///
/// Metrics: `loss`, `pg_loss`, `entropy_loss`, `pg_clipfrac`, `ppo_kl`, and `kl_loss`
/// (use_kl_loss), `ois = reduce(exp(-ppo_kl))`, `tis`, `tis_clipfrac`, `tis_abs` (use_tis),
/// `train_rollout_logprob_abs_diff = reduce(|old_logp - rollout_logp|)` (rollout log-probs given).
pub fn policy_loss(args: &RlArgs, inputs: &PolicyLossInputs, reducer: &LossReducer) -> Result<LossOutput> {
    let logp = inputs.log_probs;
    reducer.check("log_probs", logp)?;
    reducer.check("entropy", inputs.entropy)?;
    reducer.check("advantages", inputs.advantages)?;
    let old = match inputs.old_log_probs {
        Some(t) => {
            reducer.check("old_log_probs", t)?;
            t.detach()
        }
        None => logp.detach(),
    };
    let advantages = inputs.advantages.detach();
    let eps_high = args.eps_clip_high_resolved();

    let ppo_kl = match args.advantage_estimator {
        AdvantageEstimator::Gspo => gspo_kl(logp, &old, reducer)?,
        _ => old.sub(logp)?,
    };
    let (mut pg, clipfrac) = match args.advantage_estimator {
        AdvantageEstimator::Cispo => cispo_loss(&ppo_kl, logp, &advantages, args.eps_clip, eps_high)?,
        _ => ppo_clip_loss(&ppo_kl, &advantages, args.eps_clip, eps_high, args.eps_clip_c)?,
    };

    let mut metrics = BTreeMap::new();
    if args.use_tis {
        let rollout = inputs
            .rollout_log_probs
            .context("use_tis needs the rollout engine's log-probs")?;
        reducer.check("rollout_log_probs", rollout)?;
        let tis = tis_weights(&old, rollout, args.tis_clip_low, args.tis_clip)?;
        pg = pg.mul(&tis.weights)?;
        metrics.insert("ois".into(), scalar(&reducer.reduce(&ppo_kl.neg()?.exp()?)?)?);
        metrics.insert("tis".into(), scalar(&reducer.reduce(&tis.tis)?)?);
        metrics.insert("tis_clipfrac".into(), scalar(&reducer.reduce(&tis.clipfrac)?)?);
        metrics.insert("tis_abs".into(), scalar(&reducer.reduce(&tis.tis_abs)?)?);
    }

    let pg_loss = reducer.reduce(&pg)?;
    let entropy_loss = reducer.reduce(inputs.entropy)?;
    let mut loss = pg_loss.sub(&(&entropy_loss * args.entropy_coef)?)?;

    if args.use_kl_loss {
        let Some(ref_logp) = inputs.ref_log_probs else {
            bail!("use_kl_loss needs the reference model's log-probs");
        };
        reducer.check("ref_log_probs", ref_logp)?;
        let ratio = if args.use_unbiased_kl {
            Some(logp.sub(&old)?.exp()?)
        } else {
            None
        };
        let kl = approx_kl(logp, ref_logp, args.kl_loss_type, ratio.as_ref())?;
        let kl_loss = reducer.reduce(&kl)?;
        loss = loss.add(&(&kl_loss * args.kl_loss_coef)?)?;
        metrics.insert("kl_loss".into(), scalar(&kl_loss)?);
    }

    if let Some(rollout) = inputs.rollout_log_probs {
        reducer.check("rollout_log_probs", rollout)?;
        let diff = reducer.reduce(&old.sub(rollout)?.abs()?)?;
        metrics.insert("train_rollout_logprob_abs_diff".into(), scalar(&diff)?);
    }
    metrics.insert("loss".into(), scalar(&loss)?);
    metrics.insert("pg_loss".into(), scalar(&pg_loss)?);
    metrics.insert("entropy_loss".into(), scalar(&entropy_loss)?);
    metrics.insert("pg_clipfrac".into(), scalar(&reducer.reduce(&clipfrac)?)?);
    metrics.insert("ppo_kl".into(), scalar(&reducer.reduce(&ppo_kl)?)?);
    Ok(LossOutput { loss, metrics })
}

/// The inputs of [`value_loss`], all `[N]` over the loss tokens, in the reducer's dtype.
#[derive(Debug, Clone, Copy)]
pub struct ValueLossInputs<'a> {
    /// The critic's current values (tracked).
    pub values: &'a Tensor,
    /// The critic's values when the rollout was scored.
    pub old_values: &'a Tensor,
    pub returns: &'a Tensor,
}

/// slime `value_loss_function` (no 1/2 factor):
/// `L = reduce(max((v_old + clamp(v - v_old, -c, c) - R)^2, (v - R)^2))`, `c = value_clip`.
/// Metrics: `value_loss`, `value_clipfrac = reduce([|v - v_old| > c])`.
pub fn value_loss(args: &RlArgs, inputs: &ValueLossInputs, reducer: &LossReducer) -> Result<LossOutput> {
    let v = inputs.values;
    reducer.check("values", v)?;
    reducer.check("old_values", inputs.old_values)?;
    reducer.check("returns", inputs.returns)?;
    let (old, ret) = (inputs.old_values.detach(), inputs.returns.detach());
    let c = args.value_clip;
    let delta = v.sub(&old)?;
    let clipfrac = delta.abs()?.gt(c)?.to_dtype(v.dtype())?;
    let clipped = old.add(&delta.clamp(-c, c)?)?;
    let surr1 = clipped.sub(&ret)?.sqr()?;
    let surr2 = v.sub(&ret)?.sqr()?;
    let loss = reducer.reduce(&surr1.maximum(&surr2)?)?;
    let mut metrics = BTreeMap::new();
    metrics.insert("value_loss".into(), scalar(&loss)?);
    metrics.insert("value_clipfrac".into(), scalar(&reducer.reduce(&clipfrac)?)?);
    Ok(LossOutput { loss, metrics })
}
