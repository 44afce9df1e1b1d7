//! The training side of one rollout: forward-only passes that score the rollout (old, reference,
//! rollout-engine log-probs; critic values), and optimizer steps for the policy (RL or SFT) and
//! the critic, each over micro-batches with gradient accumulation.
//!
//! Everything is indexed by rollout sample: `per_sample[i]` holds one value per response token
//! of sample `i`. A micro-batch gathers its samples' response positions out of the packed batch
//! (`MicroBatch::response_ranges`) as slices, so the loss sees `[N]` tensors over loss
//! tokens only, as `crate::rl` expects, and gradients flow back to the packed outputs.
//!
//! NaN/Inf guard (Megatron's `check_for_nan_in_loss_and_grad`): before each update the step's
//! loss terms and every local gradient's sum of squares are checked
//! (`crate::optim::first_nonfinite`, the same sums the optimizer's norm then uses); the ranks agree (the flag rides on the
//! metrics sum over DP, and is summed over CP and TP), and a step that is not finite anywhere is
//! not applied (no update, no optimizer step counted, so the LR schedule does not move either):
//! its report names what was not finite, and the loop skips or stops on it
//! (`--check-for-nan-in-loss-and-grad`).
use crate::batching::{MicroBatch, MicroBatchPolicy, SampleView};
use crate::critic::Critic;
use crate::optim::{DistributedAdamW, GradAccumulator, LrScheduler};
use crate::rl::{policy_loss, read_scalars, value_loss, LossReducer, PolicyLossInputs, RlArgs, ValueLossInputs};
use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use vime_qwen3::batch::PackedBatch;
use vime_qwen3::context_parallel::CpShard;
use vime_qwen3::model::{Qwen3, Recompute, TokenOutputs};
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
    /// In this serde form a NaN/Inf is JSON `null` and reads back as NaN (JSON has no NaN); across
    /// the data-parallel ranks it travels with its bits (`parallel::broadcast_samples`).
    #[serde(with = "nan_as_null")]
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

mod nan_as_null {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &f64, s: S) -> Result<S::Ok, S::Error> {
        if v.is_finite() {
            s.serialize_f64(*v)
        } else {
            s.serialize_none()
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
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

/// A run of consecutive loss tokens: `len` of them at `start..start + len` of the model's
/// outputs, or (under context parallelism) held by another CP rank.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Run {
    Here { start: usize, len: usize },
    Elsewhere { len: usize },
}

impl Run {
    fn len(&self) -> usize {
        match *self {
            Run::Here { len, .. } | Run::Elsewhere { len } => len,
        }
    }
}

/// The loss tokens' positions (`None`: held by another CP rank) as maximal runs.
fn runs_of(positions: impl IntoIterator<Item = Option<usize>>) -> Vec<Run> {
    let mut runs: Vec<Run> = Vec::new();
    for p in positions {
        match (runs.last_mut(), p) {
            (Some(Run::Here { start, len }), Some(p)) if *start + *len == p => *len += 1,
            (Some(Run::Elsewhere { len }), None) => *len += 1,
            (_, Some(p)) => runs.push(Run::Here { start: p, len: 1 }),
            (_, None) => runs.push(Run::Elsewhere { len: 1 }),
        }
    }
    runs
}

/// What the micro-batch closure needs about its loss tokens.
struct LossTokens {
    /// Where the response tokens sit in the model's outputs, in sample order, as runs: the packed
    /// batch's positions, or under context parallelism this rank's local batch's (and runs that
    /// another CP rank holds). Each sample's response is one run without CP, a few with it.
    runs: Vec<Run>,
    /// `[0, n_0, n_0 + n_1, ..]` over the micro-batch's samples.
    cu_seqlens: Vec<usize>,
    /// Where the loss is computed (the reducer's tensors go there).
    device: Device,
    /// Under CP: `[N]` 1 where this rank holds the loss token, else 0.
    local: Option<Tensor>,
}

impl LossTokens {
    fn new(mb: &MicroBatch, shard: Option<&CpShard>, device: &Device) -> Result<Self> {
        let mut pos = Vec::new();
        let mut cu = vec![0usize];
        for r in &mb.response_ranges {
            pos.extend(r.clone());
            cu.push(pos.len());
        }
        let n = pos.len();
        let (runs, local) = match shard {
            None => (runs_of(pos.iter().map(|&p| Some(p))), None),
            Some(sh) => {
                let at = sh.local_positions(&pos);
                let keep: Vec<f32> = at.iter().map(|a| if a.is_some() { 1.0 } else { 0.0 }).collect();
                (runs_of(at), Some(Tensor::from_vec(keep, n, device)?))
            }
        };
        Ok(Self {
            runs,
            cu_seqlens: cu,
            device: device.clone(),
            local,
        })
    }

    /// The loss tokens' values of a per-token model output (`[T]`, f32): `[N]`. Under CP the
    /// tokens another rank holds take `elsewhere` (`[N]`, a constant: the old log-prob, so that
    /// ratios there are 1 and finite) or 0; the reducer gives them no weight, so they add nothing
    /// to the loss or its gradient.
    ///
    /// Slices and a concatenation, not `index_select`: the gradient of `index_select` is candle's
    /// `index_add`, which on a 1-D tensor runs on one GPU thread (~1.5 ms for 8k tokens on an
    /// H100, once for the log-probs and once for the entropy of every micro-batch), where a
    /// slice's gradient is a copy at bandwidth.
    fn gather_or(&self, x: &Tensor, elsewhere: Option<&Tensor>) -> Result<Tensor> {
        let mut parts = Vec::with_capacity(self.runs.len());
        let mut at = 0;
        for run in &self.runs {
            parts.push(match (*run, elsewhere) {
                (Run::Here { start, len }, _) => x.narrow(0, start, len)?,
                (Run::Elsewhere { len }, Some(e)) => e.detach().narrow(0, at, len)?,
                (Run::Elsewhere { len }, None) => Tensor::zeros(len, x.dtype(), x.device())?,
            });
            at += run.len();
        }
        // (`Tensor::cat` of one part is that part, no copy.)
        let out = match parts.len() {
            0 => Tensor::zeros(0, x.dtype(), x.device())?,
            _ => Tensor::cat(&parts, 0)?,
        };
        // A CP rank that holds none of the loss tokens still backpropagates (a zero gradient):
        // the loss must depend on the model's outputs, as the collectives of the backward run on
        // every rank. `x[0] * 0` on each token keeps that dependency and adds nothing.
        let here = self.runs.iter().any(|r| matches!(r, Run::Here { .. }));
        if !here && at > 0 && x.dim(0)? > 0 {
            // A product with a zero tensor, not `affine(0, 0)`: candle's backward does not follow an
            // affine whose factor is 0.
            let zero = x.narrow(0, 0, 1)?.mul(&Tensor::zeros(1, x.dtype(), x.device())?)?;
            return Ok((out + zero.broadcast_as(at)?)?);
        }
        Ok(out)
    }

    fn gather(&self, x: &Tensor) -> Result<Tensor> {
        self.gather_or(x, None)
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
        // Every loss token counts (mask 1), given from the host: reading a device mask here
        // would wait for the forward, and the GPU would idle while the host queued the loss and
        // the backward.
        let mask = vec![1.0; *self.cu_seqlens.last().unwrap_or(&0)];
        let r = LossReducer::from_host_mask(&self.cu_seqlens, &mask, DType::F32, &self.device, None, per_token)?;
        match &self.local {
            Some(keep) => r.restricted_to(keep),
            None => Ok(r),
        }
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
    /// Not applied: what was not finite (a loss term or a gradient, on this rank or another).
    pub skipped: Option<String>,
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
    /// The context-parallel group: each micro-batch's sequences are split over it (zigzag), the
    /// losses, metrics and gradients summed over it (a group of one without CP).
    pub cp: &'a dyn vime_dist::Collectives,
    pub balance_data: bool,
    /// Pad each micro-batch's tokens to a multiple of this (the TP size under sequence
    /// parallelism, else 1). Under CP, each sequence is padded to a multiple of `2 cp x` this.
    pub pad_tokens_to: usize,
}

impl StepConfig<'_> {
    /// This CP rank's share of a micro-batch (`None` without CP).
    fn cp_shard(&self, batch: &PackedBatch) -> Result<Option<CpShard>> {
        if self.cp.size() == 1 {
            return Ok(None);
        }
        Ok(Some(CpShard::new(
            batch,
            self.cp.size(),
            self.cp.rank(),
            self.pad_tokens_to,
        )?))
    }
}

/// The loss metrics of an optimizer step's micro-batches, kept on the device (scalar tensors,
/// each with its factor) and read in one copy once every micro-batch's backward is queued: read as
/// they came, they made the host wait for each micro-batch's forward, once a metric, and the GPU
/// idle until the backward was launched.
#[derive(Default)]
pub struct PendingMetrics {
    keys: Vec<(String, f64)>,
    values: Vec<Tensor>,
}

impl PendingMetrics {
    /// Adds `factor * metric` for each metric (summed with the same keys' other entries on read).
    pub fn add(&mut self, metrics: BTreeMap<String, Tensor>, factor: f64) {
        for (k, v) in metrics {
            self.keys.push((k, factor));
            self.values.push(v);
        }
    }

    pub fn append(&mut self, other: PendingMetrics) {
        self.keys.extend(other.keys);
        self.values.extend(other.values);
    }

    /// Sums the metrics into `total`, in the order they were added.
    pub fn read_into(self, total: &mut BTreeMap<String, f64>) -> Result<()> {
        let values = read_scalars(&self.values)?;
        for ((k, factor), v) in self.keys.into_iter().zip(values) {
            *total.entry(k).or_insert(0.0) += v * factor;
        }
        Ok(())
    }
}

/// Runs `mb_fn(micro-batch, its loss tokens, the step's loss normaliser)` on each micro-batch of
/// this data-parallel rank's share of `indices`, accumulates the gradients, and steps the ZeRO-1
/// optimizer (which reduces them over the DP group, clips by the global norm and updates). The
/// normaliser is the whole step's, so the sum of every rank's gradients is the step's gradient.
#[allow(clippy::too_many_arguments)]
fn optimizer_step(
    model: &Qwen3,
    samples: &[Sample],
    indices: &[usize],
    cfg: &StepConfig,
    opt: &mut DistributedAdamW,
    sched: &LrScheduler,
    mut mb_fn: impl FnMut(
        &MicroBatch,
        Option<&CpShard>,
        &LossTokens,
        f64,
        BTreeMap<String, Tensor>,
    ) -> Result<(BTreeMap<String, Tensor>, PendingMetrics)>,
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
    let mut pending = PendingMetrics::default();
    let (mut tokens, mut micro_batches) = (0usize, 0usize);
    // The micro-batches share the weights: under FP8 each is quantized once for all of them.
    model.with_fp8_weight_cache(|| -> Result<()> {
        for local in cfg.micro_batches.plan(&lengths)? {
            let global: Vec<usize> = local.iter().map(|&j| mine[j]).collect();
            let mut mb = MicroBatch::new(&views, &global)?;
            if cfg.cp.size() == 1 {
                mb.pad_to_multiple(cfg.pad_tokens_to)?;
            }
            let shard = cfg.cp_shard(&mb.batch)?;
            let lt = LossTokens::new(&mb, shard.as_ref(), device)?;
            // The running gradient sums go into the backward and come back with this micro-batch's
            // added (by the weight GEMMs themselves, see `Qwen3::forward_backward_into`).
            let (sums, metrics) = mb_fn(&mb, shard.as_ref(), &lt, norm, acc.take_sums())?;
            acc.put_sums(sums)?;
            pending.append(metrics);
            tokens += mb.sample_tokens();
            micro_batches += 1;
        }
        Ok(())
    })?;
    let mut grads = acc.take();
    if super::fault::nan_due("grad") {
        if let Some(g) = grads.values_mut().next() {
            *g = g.affine(f64::NAN, 0.0)?;
        }
    }
    // Under CP each rank holds its tokens' share of the gradients and of the loss metrics.
    if cfg.cp.size() > 1 {
        for g in grads.values_mut() {
            *g = cfg.cp.all_reduce(g, vime_dist::ReduceOp::Sum)?;
        }
    }
    // The optimizer's checks and (on CUDA) its fused update's table, built while the backward
    // runs; after the wait below only the norm, clipping and the launch are left.
    opt.prepare_step(&grads, cfg.dp, cfg.tp)?;
    // Each gradient's sum of squares, once, queued behind the backward: the guard reads them here
    // and the optimizer's norm below. Their copy is the step's first wait for the device (the
    // metrics' read below then waits for nothing), so the host work since the last micro-batch
    // was queued ran while the backward did, instead of with the GPU idle after a read.
    let squares = crate::optim::grad_sum_squares(&grads)?;
    pending.read_into(&mut report.metrics)?;
    // The NaN/Inf guard's flag (see the module docs), one key per rank so that every rank learns
    // which one it was. Loss terms that are not finite are zeroed for the metric exchanges (JSON
    // has no NaN); the step is dropped anyway.
    let flag_prefix = "\u{0}nonfinite ";
    let nk = format!(
        "{flag_prefix}dp {} tp {} cp {}",
        cfg.dp.rank(),
        cfg.tp.rank(),
        cfg.cp.rank()
    );
    let loss_bad = take_nonfinite(&mut report.metrics);
    report.metrics.insert(nk.clone(), loss_bad.is_some() as u8 as f64);
    if cfg.cp.size() > 1 {
        super::parallel::sum_metrics(cfg.cp, &mut report.metrics)?;
    }
    let grad_bad = match loss_bad {
        Some(_) => None,
        None => crate::optim::first_nonfinite(&grads, &squares),
    };
    if grad_bad.is_some() {
        *report.metrics.entry(nk.clone()).or_default() += 1.0;
    }
    super::fault::at("optimizer")?;
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
    let mut flags: BTreeMap<String, f64> = BTreeMap::new();
    report.metrics.retain(|k, v| {
        let flag = k.starts_with(flag_prefix);
        if flag {
            flags.insert(k.clone(), *v);
        }
        !flag
    });
    if cfg.tp.size() > 1 {
        // TP ranks hold different gradient shards.
        super::parallel::sum_metrics(cfg.tp, &mut flags)?;
    }
    let flagged: Vec<&str> = flags
        .iter()
        .filter(|(_, v)| **v > 0.0)
        .map(|(k, _)| &k[flag_prefix.len()..])
        .collect();
    if !flagged.is_empty() {
        let what = match (loss_bad, grad_bad) {
            (Some(k), _) => format!("the loss ({k}) is not finite"),
            (None, Some(n)) => format!("the gradient of {n} is not finite"),
            (None, None) => "a loss or gradient is not finite".into(),
        };
        report.skipped = Some(format!("{what} on rank(s) {}", flagged.join(", ")));
        report.grad_norm = f64::NAN;
        return Ok(report);
    }
    // Reduce-scatter, global norm, clipping folded into the update, all-gather.
    report.grad_norm = opt
        .step_stats_tp(&grads, Some(&squares), report.lr, cfg.clip_grad, cfg.dp, cfg.tp)?
        .grad_norm;
    Ok(report)
}

/// Zeroes the metrics that are not finite; the name of the first, if any.
fn take_nonfinite(m: &mut BTreeMap<String, f64>) -> Option<String> {
    let mut first = None;
    for (k, v) in m.iter_mut() {
        if !v.is_finite() {
            first.get_or_insert_with(|| k.clone());
            *v = 0.0;
        }
    }
    first
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
    // Test hook: a NaN first old log-prob in each sample makes this step's loss NaN (on every
    // data-parallel rank whose process has the hook).
    let poisoned;
    let data = if super::fault::nan_due("loss") {
        let mut old = data.old_log_probs.to_vec();
        for &i in indices {
            if let Some(x) = old[i].first_mut() {
                *x = f32::NAN;
            }
        }
        poisoned = old;
        &PolicyData {
            old_log_probs: &poisoned,
            ..*data
        }
    } else {
        data
    };
    optimizer_step(
        model,
        samples,
        indices,
        cfg,
        opt,
        sched,
        |mb, shard, lt, norm, sums| {
            let adv = lt.host(mb, data.advantages, &device)?;
            let old = lt.host(mb, data.old_log_probs, &device)?;
            let reference = data.ref_log_probs.map(|r| lt.host(mb, r, &device)).transpose()?;
            let roll = rollout.as_deref().map(|r| lt.host(mb, r, &device)).transpose()?;
            let mut metrics = PendingMetrics::default();
            let loss_fn = |o: &TokenOutputs| {
                let logp = lt.gather_or(&o.logprobs, Some(&old))?;
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
                metrics.add(out.metrics, 1.0 / norm);
                Ok((out.loss / norm)?)
            };
            let (_, grads) =
                model.forward_backward_into(&mb.batch, cfg.recompute, loss_fn, cfg.tp, Some(cfg.cp), shard, sums)?;
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
        model,
        samples,
        indices,
        cfg,
        opt,
        sched,
        |mb, shard, lt, norm, sums| {
            let mut metrics = PendingMetrics::default();
            let loss_fn = |o: &TokenOutputs| {
                let logp = lt.gather(&o.logprobs)?;
                let entropy = lt.gather(&o.entropy)?;
                let reducer = lt.reducer(per_token)?;
                let loss = reducer.reduce(&logp)?.neg()?;
                let entropy_loss = reducer.reduce(&entropy)?.detach();
                metrics.add(
                    BTreeMap::from([
                        ("loss".to_string(), loss.detach()),
                        ("entropy_loss".to_string(), entropy_loss),
                    ]),
                    1.0 / norm,
                );
                Ok((loss / norm)?)
            };
            let (_, grads) =
                model.forward_backward_into(&mb.batch, cfg.recompute, loss_fn, cfg.tp, Some(cfg.cp), shard, sums)?;
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
        critic.backbone(),
        samples,
        indices,
        cfg,
        opt,
        sched,
        |mb, shard, lt, norm, sums| {
            let old = lt.host(mb, old_values, &device)?;
            let ret = lt.host(mb, returns, &device)?;
            let mut metrics = PendingMetrics::default();
            let loss_fn = |v: &Tensor| {
                let values = lt.gather_or(&v.to_dtype(candle_core::DType::F32)?, Some(&old))?;
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
                metrics.add(out.metrics, 1.0 / norm);
                Ok((out.loss / norm)?)
            };
            let (_, grads) =
                critic.forward_backward_into(&mb.batch, cfg.recompute, loss_fn, cfg.tp, Some(cfg.cp), shard, sums)?;
            Ok((grads.params, metrics))
        },
        &device,
    )
    .context("critic step")
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    #[test]
    fn loss_token_runs_are_maximal() {
        let here = |start, len| Run::Here { start, len };
        let pos = [Some(3), Some(4), Some(5), Some(9), None, None, Some(10), Some(0), None];
        assert_eq!(
            runs_of(pos),
            vec![
                here(3, 3),
                here(9, 1),
                Run::Elsewhere { len: 2 },
                here(10, 1),
                here(0, 1),
                Run::Elsewhere { len: 1 }
            ]
        );
        assert_eq!(runs_of([]), vec![]);
    }

    /// The slices give `index_select`'s values and gradient: each loss token's output, and each
    /// output position's gradient once per loss token there (0 elsewhere); under CP the tokens
    /// another rank holds take `elsewhere` and send no gradient back.
    #[test]
    fn loss_token_gather_matches_index_select() -> Result<()> {
        let dev = Device::Cpu;
        let t = 12;
        let x = candle_core::Var::from_tensor(&Tensor::arange(0f32, t as f32, &dev)?.affine(0.5, -1.0)?)?;
        // Two samples' responses (positions 2..5 and 7..11), then a CP rank that holds only some.
        let pos: Vec<usize> = (2..5).chain(7..11).collect();
        let n = pos.len();
        let w = Tensor::arange(1f32, n as f32 + 1.0, &dev)?;
        let cases: [Vec<Option<usize>>; 3] = [
            pos.iter().map(|&p| Some(p)).collect(),
            pos.iter()
                .enumerate()
                .map(|(i, &p)| (i % 3 != 1).then_some(p))
                .collect(),
            // A CP rank that holds none of them: still a (zero) gradient, as index_select gave.
            vec![None; n],
        ];
        let elsewhere = Tensor::full(-7f32, n, &dev)?;
        for at in cases {
            let keep: Vec<f32> = at.iter().map(|a| a.is_some() as u8 as f32).collect();
            let lt = LossTokens {
                runs: runs_of(at.iter().copied()),
                cu_seqlens: vec![0, 3, n],
                device: dev.clone(),
                local: Some(Tensor::new(keep.as_slice(), &dev)?),
            };
            let ours = lt.gather_or(x.as_tensor(), Some(&elsewhere))?;
            let g = ours.mul(&w)?.sum_all()?.backward()?;
            let ours_grad: Vec<f32> = g.get(x.as_tensor()).expect("a gradient").to_vec1()?;
            // The reference: index_select at the held positions, `elsewhere` at the others.
            let idx: Vec<u32> = at.iter().map(|a| a.unwrap_or(0) as u32).collect();
            let sel = x.as_tensor().index_select(&Tensor::new(idx.as_slice(), &dev)?, 0)?;
            let k = Tensor::new(keep.as_slice(), &dev)?;
            let want = (sel.mul(&k)? + elsewhere.mul(&(1.0 - &k)?)?)?;
            let gw = want.mul(&w)?.sum_all()?.backward()?;
            let want_grad: Vec<f32> = gw.get(x.as_tensor()).expect("a gradient").to_vec1()?;
            assert_eq!(ours.to_vec1::<f32>()?, want.to_vec1::<f32>()?, "{at:?}");
            assert_eq!(ours_grad, want_grad, "{at:?}");
            assert_eq!(
                lt.gather(x.as_tensor())?.to_vec1::<f32>()?,
                sel.mul(&k)?.to_vec1::<f32>()?
            );
        }
        Ok(())
    }

    /// The deferred read gives what reading each metric as it was computed gave: the f32 value
    /// widened to f64, times its factor, summed in the order added.
    #[test]
    fn pending_metrics_sum_like_immediate_reads() -> Result<()> {
        let dev = Device::Cpu;
        let f32s = |v: f32| Tensor::new(v, &dev).unwrap();
        let mut pending = PendingMetrics::default();
        let mb = |loss: f32, ent: f32| {
            BTreeMap::from([
                ("loss".to_string(), f32s(loss).to_dtype(DType::F64).unwrap()),
                ("entropy_loss".to_string(), f32s(ent).to_dtype(DType::F64).unwrap()),
            ])
        };
        let (a, b, c) = (0.1f32, 2.7f32, -1.3e-3f32);
        let mut one = PendingMetrics::default();
        one.add(mb(a, b), 1.0 / 3.0);
        pending.append(one);
        pending.add(mb(c, a), 1.0 / 7.0);
        let mut total = BTreeMap::from([("loss".to_string(), 5.0)]);
        pending.read_into(&mut total)?;
        let want_loss = 5.0 + a as f64 * (1.0 / 3.0) + c as f64 * (1.0 / 7.0);
        let want_ent = b as f64 * (1.0 / 3.0) + a as f64 * (1.0 / 7.0);
        assert_eq!(total["loss"].to_bits(), want_loss.to_bits());
        assert_eq!(total["entropy_loss"].to_bits(), want_ent.to_bits());
        assert_eq!(total.len(), 2);
        // Nothing pending reads nothing.
        PendingMetrics::default().read_into(&mut total)?;
        assert_eq!(total["loss"].to_bits(), want_loss.to_bits());
        Ok(())
    }
}
