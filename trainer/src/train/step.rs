//! The training side of one rollout: forward-only passes that score the rollout (old, reference,
//! rollout-engine log-probs; critic values), and optimizer steps for the policy (RL or SFT) and
//! the critic, each over micro-batches with gradient accumulation.
//!
//! Everything is indexed by rollout sample: `per_sample[i]` holds one value per response token
//! of sample `i`. A micro-batch gathers its samples' response positions out of the packed batch
//! (`MicroBatch::response_ranges`) with `index_select`, so the loss sees `[N]` tensors over loss
//! tokens only, as `crate::rl` expects, and gradients flow back to the packed outputs.
use crate::batching::{MicroBatch, MicroBatchPolicy, SampleView};
use crate::critic::Critic;
use crate::optim::{DistributedAdamW, GradAccumulator, LrScheduler};
use crate::rl::{policy_loss, value_loss, LossReducer, PolicyLossInputs, RlArgs, ValueLossInputs};
use anyhow::{Context, Result};
use candle_core::{Device, Tensor};
use std::collections::BTreeMap;
use vime_qwen3::batch::PackedBatch;
use vime_qwen3::model::{Qwen3, Recompute};
use vime_rollout::engine::FinishReason;

/// One generated (or, for SFT, given) sample.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Sample {
    /// The prompt's index in the prompt dataset.
    pub prompt_index: usize,
    /// prompt + response ids.
    pub tokens: Vec<u32>,
    pub response_length: usize,
    /// The engine's log-probs of the response tokens (`None` for SFT samples).
    pub rollout_log_probs: Option<Vec<f32>>,
    pub response: String,
    pub label: Option<String>,
    pub raw_reward: f64,
    pub finish: FinishReason,
}

impl Sample {
    pub fn view(&self) -> SampleView<'_> {
        SampleView {
            tokens: &self.tokens,
            response_length: self.response_length,
            loss_mask: None,
        }
    }
}

/// How the step loss is normalised (see `crate::rl::LossReducer`).
fn normalizer(samples: &[Sample], indices: &[usize], per_token: bool) -> f64 {
    if per_token {
        indices.iter().map(|&i| samples[i].response_length.max(1) as f64).sum()
    } else {
        indices.len() as f64
    }
}

/// What the micro-batch closure needs about its loss tokens.
struct LossTokens {
    /// Packed positions of the response tokens, in sample order.
    positions: Tensor,
    /// `[0, n_0, n_0 + n_1, ..]` over the micro-batch's samples.
    cu_seqlens: Vec<usize>,
    mask: Tensor,
}

impl LossTokens {
    fn new(mb: &MicroBatch, device: &Device) -> Result<Self> {
        let mut pos = Vec::new();
        let mut cu = vec![0usize];
        for r in &mb.response_ranges {
            pos.extend(r.clone().map(|p| p as u32));
            cu.push(pos.len());
        }
        let n = pos.len();
        Ok(Self {
            positions: Tensor::from_vec(pos, n, device)?,
            cu_seqlens: cu,
            mask: Tensor::ones(n, candle_core::DType::F32, device)?,
        })
    }

    fn gather(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.index_select(&self.positions, 0)?)
    }

    /// Per-sample host values of the micro-batch's samples, concatenated: `[N]` f32.
    fn host(&self, mb: &MicroBatch, per_sample: &[Vec<f32>], device: &Device) -> Result<Tensor> {
        let mut v = Vec::with_capacity(*self.cu_seqlens.last().unwrap_or(&0));
        for &i in &mb.sample_indices {
            v.extend_from_slice(&per_sample[i]);
        }
        let n = v.len();
        anyhow::ensure!(
            n == *self.cu_seqlens.last().unwrap_or(&0),
            "internal: {n} per-sample values for {} loss tokens",
            self.cu_seqlens.last().unwrap_or(&0)
        );
        Ok(Tensor::from_vec(v, n, device)?)
    }

    fn reducer(&self, per_token: bool) -> Result<LossReducer> {
        LossReducer::new(&self.cu_seqlens, &self.mask, None, per_token)
    }
}

/// Per-sample response values of `f(batch)` (a `[T]` per-token output) for the samples `subset`
/// (in that order), computed over micro-batches (forward only).
pub fn score_responses(
    samples: &[Sample],
    subset: &[usize],
    policy: MicroBatchPolicy,
    pad_tokens_to: usize,
    f: impl Fn(&PackedBatch) -> Result<Tensor>,
) -> Result<Vec<Vec<f32>>> {
    let views: Vec<SampleView> = samples.iter().map(Sample::view).collect();
    let lengths: Vec<usize> = subset.iter().map(|&i| samples[i].tokens.len()).collect();
    let mut out: BTreeMap<usize, Vec<f32>> = BTreeMap::new();
    for mb_local in policy.plan(&lengths)? {
        let mb_idx: Vec<usize> = mb_local.iter().map(|&j| subset[j]).collect();
        let mut mb = MicroBatch::new(&views, &mb_idx)?;
        mb.pad_to_multiple(pad_tokens_to)?;
        for (i, v) in mb.responses_from_packed(&f(&mb.batch)?)? {
            out.insert(i, v);
        }
    }
    subset
        .iter()
        .map(|i| {
            out.remove(i)
                .with_context(|| format!("internal: sample {i} was not scored"))
        })
        .collect()
}

/// What one optimizer step reports.
#[derive(Debug, Clone, Default)]
pub struct StepReport {
    /// Loss metrics, normalised like the loss (slime's `reported_loss`).
    pub metrics: BTreeMap<String, f64>,
    pub grad_norm: f64,
    pub lr: f64,
    /// Packed tokens through forward + backward.
    pub tokens: usize,
    pub micro_batches: usize,
}

/// The per-token tensors the policy loss needs, per sample.
pub struct PolicyData<'a> {
    pub advantages: &'a [Vec<f32>],
    pub old_log_probs: &'a [Vec<f32>],
    pub ref_log_probs: Option<&'a [Vec<f32>]>,
}

/// Shared settings of the steps.
pub struct StepConfig<'a> {
    pub rl: &'a RlArgs,
    pub micro_batches: MicroBatchPolicy,
    pub recompute: Recompute,
    pub clip_grad: f64,
    /// The data-parallel group: each step's samples are split over it (`--balance-data` picks
    /// how), and the optimizer reduces the gradients over it.
    pub dp: &'a dyn vime_dist::Collectives,
    /// The tensor-parallel group of the model's shards (a group of one without TP).
    pub tp: &'a dyn vime_dist::Collectives,
    pub balance_data: bool,
    /// Pad each micro-batch's tokens to a multiple of this (the TP size under sequence
    /// parallelism, else 1).
    pub pad_tokens_to: usize,
}

fn accumulate(total: &mut BTreeMap<String, f64>, metrics: &BTreeMap<String, f64>, scale: f64) {
    for (k, v) in metrics {
        *total.entry(k.clone()).or_insert(0.0) += v * scale;
    }
}

/// Runs `mb_fn(micro-batch, its loss tokens, the step's loss normaliser)` on each micro-batch of
/// this data-parallel rank's share of `indices`, accumulates the gradients, and steps the ZeRO-1
/// optimizer (which reduces them over the DP group, clips by the global norm and updates). The
/// normaliser is the whole step's, so the sum of every rank's gradients is the step's gradient.
fn optimizer_step(
    samples: &[Sample],
    indices: &[usize],
    cfg: &StepConfig,
    opt: &mut DistributedAdamW,
    sched: &LrScheduler,
    mut mb_fn: impl FnMut(&MicroBatch, &LossTokens, f64) -> Result<(BTreeMap<String, Tensor>, BTreeMap<String, f64>)>,
    device: &Device,
) -> Result<StepReport> {
    let norm = normalizer(samples, indices, cfg.rl.calculate_per_token_loss);
    let views: Vec<SampleView> = samples.iter().map(Sample::view).collect();
    let step_lengths: Vec<usize> = indices.iter().map(|&i| samples[i].tokens.len()).collect();
    let share = &super::parallel::dp_split(&step_lengths, cfg.dp.size(), cfg.balance_data)[cfg.dp.rank()];
    anyhow::ensure!(
        !share.is_empty(),
        "data-parallel rank {} got no sample of this step's {} (--global-batch-size must be at least the \
         data-parallel size {})",
        cfg.dp.rank(),
        indices.len(),
        cfg.dp.size()
    );
    let mine: Vec<usize> = share.iter().map(|&j| indices[j]).collect();
    let lengths: Vec<usize> = mine.iter().map(|&i| samples[i].tokens.len()).collect();
    let mut acc = GradAccumulator::new();
    let mut report = StepReport::default();
    let (mut tokens, mut micro_batches) = (0usize, 0usize);
    for local in cfg.micro_batches.plan(&lengths)? {
        let global: Vec<usize> = local.iter().map(|&j| mine[j]).collect();
        let mut mb = MicroBatch::new(&views, &global)?;
        mb.pad_to_multiple(cfg.pad_tokens_to)?;
        let lt = LossTokens::new(&mb, device)?;
        let (grads, metrics) = mb_fn(&mb, &lt, norm)?;
        acc.add(&grads)?;
        accumulate(&mut report.metrics, &metrics, 1.0);
        tokens += mb.sample_tokens();
        micro_batches += 1;
    }
    let grads = acc.take();
    // For the multi-rank failure tests: a rank that dies, or fails with an error, while the
    // others wait in a collective.
    let fault = std::env::var("VIME_FAULT_INJECT").unwrap_or_default();
    if fault == format!("abort-rank-{}-in-step", cfg.dp.rank()) {
        eprintln!(
            "VIME_FAULT_INJECT: data-parallel rank {} aborts mid-step",
            cfg.dp.rank()
        );
        std::process::abort();
    }
    if fault == format!("error-rank-{}-in-step", cfg.dp.rank()) {
        anyhow::bail!("VIME_FAULT_INJECT: data-parallel rank {} fails mid-step", cfg.dp.rank());
    }
    // One exchange sums the loss metrics and the counts over the ranks (the two keys below are
    // no loss metric's name).
    let (tk, mk) = ("\u{0}tokens", "\u{0}micro_batches");
    report.metrics.insert(tk.into(), tokens as f64);
    report.metrics.insert(mk.into(), micro_batches as f64);
    super::parallel::sum_metrics(cfg.dp, &mut report.metrics)?;
    report.tokens = report.metrics.remove(tk).unwrap_or(0.0) as usize;
    report.micro_batches = report.metrics.remove(mk).unwrap_or(0.0) as usize;
    report.lr = sched.lr_at(opt.num_steps());
    // Reduce-scatter, global norm, clipping folded into the update, all-gather.
    report.grad_norm = opt
        .step_stats_tp(&grads, report.lr, cfg.clip_grad, cfg.dp, cfg.tp)?
        .grad_norm;
    Ok(report)
}

/// One RL optimizer step of the policy on `indices`.
#[allow(clippy::too_many_arguments)]
pub fn policy_step(
    model: &Qwen3,
    opt: &mut DistributedAdamW,
    sched: &LrScheduler,
    cfg: &StepConfig,
    samples: &[Sample],
    indices: &[usize],
    data: &PolicyData,
) -> Result<StepReport> {
    let per_token = cfg.rl.calculate_per_token_loss;
    let device = model.device().clone();
    let rollout: Option<Vec<Vec<f32>>> = samples
        .iter()
        .map(|s| s.rollout_log_probs.clone())
        .collect::<Option<Vec<_>>>();
    optimizer_step(
        samples,
        indices,
        cfg,
        opt,
        sched,
        |mb, lt, norm| {
            let adv = lt.host(mb, data.advantages, &device)?;
            let old = lt.host(mb, data.old_log_probs, &device)?;
            let reference = data.ref_log_probs.map(|r| lt.host(mb, r, &device)).transpose()?;
            let roll = rollout.as_deref().map(|r| lt.host(mb, r, &device)).transpose()?;
            let mut metrics = BTreeMap::new();
            let (_, grads) = model.forward_backward_tp(
                &mb.batch,
                cfg.recompute,
                |o| {
                    let logp = lt.gather(&o.logprobs)?;
                    let entropy = lt.gather(&o.entropy)?;
                    let reducer = lt.reducer(per_token)?;
                    let out = policy_loss(
                        cfg.rl,
                        &PolicyLossInputs {
                            log_probs: &logp,
                            entropy: &entropy,
                            advantages: &adv,
                            old_log_probs: Some(&old),
                            ref_log_probs: reference.as_ref(),
                            rollout_log_probs: roll.as_ref(),
                        },
                        &reducer,
                    )?;
                    accumulate(&mut metrics, &out.metrics, 1.0 / norm);
                    Ok((out.loss / norm)?)
                },
                cfg.tp,
            )?;
            Ok((grads.params, metrics))
        },
        &device,
    )
    .context("policy step")
}

/// One supervised step: `-sum_of_sample_mean(log p(response))` over `indices`.
pub fn sft_step(
    model: &Qwen3,
    opt: &mut DistributedAdamW,
    sched: &LrScheduler,
    cfg: &StepConfig,
    samples: &[Sample],
    indices: &[usize],
) -> Result<StepReport> {
    let per_token = cfg.rl.calculate_per_token_loss;
    let device = model.device().clone();
    optimizer_step(
        samples,
        indices,
        cfg,
        opt,
        sched,
        |mb, lt, norm| {
            let mut metrics = BTreeMap::new();
            let (_, grads) = model.forward_backward_tp(
                &mb.batch,
                cfg.recompute,
                |o| {
                    let logp = lt.gather(&o.logprobs)?;
                    let entropy = lt.gather(&o.entropy)?;
                    let reducer = lt.reducer(per_token)?;
                    let loss = reducer.reduce(&logp)?.neg()?;
                    let sum =
                        |t: &Tensor| -> Result<f64> { Ok(t.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?) };
                    metrics.insert("loss".to_string(), sum(&loss)? / norm);
                    metrics.insert("entropy_loss".to_string(), sum(&reducer.reduce(&entropy)?)? / norm);
                    Ok((loss / norm)?)
                },
                cfg.tp,
            )?;
            Ok((grads.params, metrics))
        },
        &device,
    )
    .context("SFT step")
}

/// One critic step (PPO) on `indices`: slime's clipped value loss against the GAE returns.
#[allow(clippy::too_many_arguments)]
pub fn critic_step(
    critic: &Critic,
    opt: &mut DistributedAdamW,
    sched: &LrScheduler,
    cfg: &StepConfig,
    samples: &[Sample],
    indices: &[usize],
    old_values: &[Vec<f32>],
    returns: &[Vec<f32>],
) -> Result<StepReport> {
    let per_token = cfg.rl.calculate_per_token_loss;
    let device = critic.backbone().device().clone();
    optimizer_step(
        samples,
        indices,
        cfg,
        opt,
        sched,
        |mb, lt, norm| {
            let old = lt.host(mb, old_values, &device)?;
            let ret = lt.host(mb, returns, &device)?;
            let mut metrics = BTreeMap::new();
            let (_, grads) = critic.forward_backward_tp(
                &mb.batch,
                cfg.recompute,
                |v| {
                    let values = lt.gather(v)?.to_dtype(candle_core::DType::F32)?;
                    let reducer = lt.reducer(per_token)?;
                    let out = value_loss(
                        cfg.rl,
                        &ValueLossInputs {
                            values: &values,
                            old_values: &old,
                            returns: &ret,
                        },
                        &reducer,
                    )?;
                    accumulate(&mut metrics, &out.metrics, 1.0 / norm);
                    Ok((out.loss / norm)?)
                },
                cfg.tp,
            )?;
            Ok((grads.params, metrics))
        },
        &device,
    )
    .context("critic step")
}
