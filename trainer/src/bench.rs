//! `vime-train bench-step`: the training step alone, timed (issue 6's 4B step, issue 7's
//! throughput benchmark). A random-init Qwen3 of a real release's shape (weights drawn on the
//! device, N(0, 0.02), unit norm gains), synthetic packed sequences, and per optimizer step:
//! `--micro-batches` x (forward + backward of `-mean(logprobs)` with the recompute policy,
//! gradients accumulated in f32), global-norm clipping at 1.0, AdamW with f32 master weights and
//! moments. The loss is the same pass the RL step runs (log-probs and entropy from the fused LM
//! head); only the objective is simpler.
//!
//! Printed: median step time over `--steps` after `--warmup`, split into forward+backward and
//! optimizer; tokens/s; model TFLOP/s and MFU against 989 (H200 dense bf16 spec) and 790 (the
//! measured matmul ceiling) TFLOP/s; the peak device memory in use. FLOPs per token are counted
//! as `6 * N_matmul + 12 * L * s_attn * H * d_head` where `N_matmul` counts every matmul weight
//! (q, k, v, o, gate, up, down per layer, and the LM head) and `s_attn` is the mean number of
//! keys a token attends to (causal: (s + 1) / 2 per sequence of s): the attention term is
//! `2 (QK^T and PV) x 2 flops x (s+1)/2 keys x H x d_head` forward, x3 for forward + backward.
//! Recompute's extra forward is NOT counted (model FLOPs, as Megatron reports them).
//!
//! Memory: CUDA has no allocator statistics in candle, so a sampler thread reads the device's
//! used memory (`cuMemGetInfo`: total - free, which includes the stream-ordered pool's cached
//! blocks, i.e. torch's "reserved" rather than "allocated") every 2 ms during the timed steps.
use crate::device::parse_device;
use crate::optim::{DistributedAdamW, GradAccumulator, OptimizerArgs};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;
use vime_qwen3::batch::PackedBatch;
use vime_qwen3::config::Qwen3Config;
use vime_qwen3::model::{Qwen3, Recompute};
use vime_qwen3::state_dict::param_specs;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchArgs {
    /// qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, or a path to an HF config.json.
    #[arg(long, default_value = "qwen3-4b")]
    pub model: String,
    /// Tokens per packed sequence.
    #[arg(long, default_value_t = 4096)]
    pub seq_len: usize,
    /// Tokens per micro-batch (a multiple of --seq-len; the last sequence is cut to fit).
    #[arg(long, default_value_t = 4096)]
    pub max_tokens_per_gpu: usize,
    /// Micro-batches (gradient accumulation) per optimizer step.
    #[arg(long, default_value_t = 1)]
    pub micro_batches: usize,
    /// Timed optimizer steps.
    #[arg(long, default_value_t = 20)]
    pub steps: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// none, full, uniform:N or block:N, optionally with ,keep-attention (`full,keep-attention`).
    #[arg(long, default_value = "full")]
    pub recompute: String,
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// Model (compute) dtype: bf16 or f32; master weights and moments are f32 either way.
    #[arg(long, default_value = "bf16")]
    pub dtype: String,
    /// Also write the result as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// The layers' backward: explicit (hand-written, `models/qwen3/src/block.rs`, the default) or
    /// autograd (candle's over the same forward, the test reference).
    #[arg(long, default_value = "explicit")]
    pub backward: String,
    /// Override the preset's number of layers (a shorter model of the same shapes).
    #[arg(long)]
    pub layers: Option<usize>,
    /// Before timing, run one micro-batch through both backwards and print the relative
    /// difference of all gradients, ||explicit - autograd|| / ||autograd||, with a verdict.
    #[arg(long)]
    pub compare_backward: bool,
    /// Time the trainer's NaN/Inf guard of the gradients with the step, before the optimizer, as
    /// the training loop runs it (`--check-for-nan-in-loss-and-grad`): off (bench-step's default,
    /// the step alone: the sums of squares are computed before the optimizer either way, as its
    /// norm needs them), fused (the trainer's: `optim::first_nonfinite` on the gradients' fused sums
    /// of squares, which the norm then reuses) or sum-all (the guard before 2026-12-05: candle's `sum_all` per
    /// gradient), to measure what it costs.
    #[arg(long, default_value = "off")]
    pub nan_guard: String,
    /// Under `--fp8-recipe delayed` on CUDA: fused (SwiGLU's output and input gradients computed
    /// by their FP8 casts, never written in bf16; the trainer's path) or separate (the SwiGLU
    /// kernels, then the casts: the same bits), to measure what the fusion saves.
    #[arg(long, default_value = "fused")]
    pub fp8_swiglu_cast: String,
    /// The objective gets `- entropy_coef * mean(entropy)` besides `- mean(logprob)`, as
    /// `vime-train --entropy-coef` adds to the policy loss: what the entropy term's gradient
    /// through the LM head costs a step (0: the log-probs alone).
    #[arg(long, default_value_t = 0.0)]
    pub entropy_coef: f64,
    /// Megatron's flag: the CUDA attention kernel, auto (cuDNN fused attention in a build with
    /// the cudnn feature, else vime's flash kernel), fused (cuDNN) or flash.
    #[arg(long, default_value = "auto")]
    pub attention_backend: String,
    /// Megatron's flag: run-to-run bitwise-reproducible kernels where a backend offers the choice
    /// (cuDNN's attention backward).
    #[arg(long)]
    pub deterministic_mode: bool,
    #[command(flatten)]
    pub fp8: crate::device::Fp8Args,
    #[command(flatten)]
    pub head: crate::device::HeadArgs,
    /// equal: every micro-batch is `--max-tokens-per-gpu` tokens of `--seq-len`-token sequences.
    /// ragged: an RL step's shape, `--samples` samples per optimizer step, each a prompt of
    /// 64-511 tokens (uniform) and a response whose length is log-normal (median
    /// `--response-median`, log-sd `--response-sigma`: a long tail), capped so that a sample is
    /// at most `--seq-len`; grouped into micro-batches of at most `--max-tokens-per-gpu` tokens by
    /// the trainer's own dynamic batching (`batching::pack_micro_batches`), so `--micro-batches`
    /// must stay 1.
    #[arg(long, default_value = "equal")]
    pub lengths: String,
    /// ragged: samples per optimizer step.
    #[arg(long, default_value_t = 64)]
    pub samples: usize,
    /// ragged: median response length in tokens.
    #[arg(long, default_value_t = 1024)]
    pub response_median: usize,
    /// ragged: standard deviation of the log of the response length.
    #[arg(long, default_value_t = 1.0)]
    pub response_sigma: f64,
}

/// The sample lengths of one ragged (RL-shaped) optimizer step, drawn from `rng` (see
/// `BenchArgs::lengths`): prompt uniform in [64, 512), response log-normal, the total capped at
/// `seq_len` (and at least 2 tokens).
pub fn ragged_lengths(
    rng: &mut vime_kernels::testing::Rng,
    samples: usize,
    seq_len: usize,
    median: usize,
    sigma: f64,
) -> Vec<usize> {
    (0..samples)
        .map(|_| {
            let prompt = 64 + (rng.next_u64() % 448) as usize;
            let response = (median as f64 * (sigma * rng.normal()).exp()).round().max(1.0) as usize;
            (prompt + response).clamp(2, seq_len.max(2))
        })
        .collect()
}

/// Model FLOPs of one optimizer step over sequences of these lengths (each a causal sequence of
/// its own: `flops_per_token(cfg, s) x s` summed).
pub fn flops_of_lengths(cfg: &Qwen3Config, lengths: &[usize]) -> f64 {
    lengths.iter().map(|&s| flops_per_token(cfg, s) * s as f64).sum()
}

/// Bound of `--compare-backward`: two bf16 computations of the same gradients that differ only
/// in rounding order (measured 5.4e-3 on the CPU for a 2-layer Qwen3-0.6B-shaped bf16 model and
/// 7.6e-3 on an H200 for a 4-layer Qwen3-4B-shaped one,
/// `benches/results/2026-11-30-bench-train-h200-after.md`).
const COMPARE_BOUND: f64 = 2e-2;

/// A preset's config (`qwen3-4b`, `Qwen/Qwen3-4B`, ...) or an HF config.json file.
pub fn config_of(model: &str) -> Result<Qwen3Config> {
    if let Some(p) = vime_qwen3::config::Preset::find(model) {
        return Ok(p.config());
    }
    let path = PathBuf::from(model);
    if path.is_file() {
        return Qwen3Config::from_file(&path);
    }
    bail!(
        "--model {model:?}: neither a known preset (qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b) nor a config.json file"
    )
}

/// Model FLOPs per token (see the module docs) for sequences of `seq_len`.
pub fn flops_per_token(cfg: &Qwen3Config, seq_len: usize) -> f64 {
    let (h, i, l) = (
        cfg.hidden_size as f64,
        cfg.intermediate_size as f64,
        cfg.num_hidden_layers as f64,
    );
    let (qh, kvh, d) = (
        cfg.num_attention_heads as f64,
        cfg.num_key_value_heads as f64,
        cfg.head_dim as f64,
    );
    let per_layer = h * qh * d + 2.0 * h * kvh * d + qh * d * h + 3.0 * h * i;
    let matmul = l * per_layer + h * cfg.vocab_size as f64;
    let keys = (seq_len as f64 + 1.0) / 2.0;
    // QK^T and PV: 2 matmuls x 2 flops per multiply-add x keys x d per head, forward; x3 with
    // the backward.
    6.0 * matmul + 12.0 * l * keys * qh * d
}

/// A peak-memory sampler for a CUDA device (cuMemGetInfo every 2 ms while alive).
struct MemSampler {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    handle: Option<std::thread::JoinHandle<u64>>,
}

impl MemSampler {
    fn start(device: &Device) -> Option<Self> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(d) = device {
            use candle_core::cuda_backend::cudarc::driver::result::mem_get_info;
            use std::sync::atomic::{AtomicBool, Ordering};
            let ctx = d.cuda_stream().context().clone();
            let stop = std::sync::Arc::new(AtomicBool::new(false));
            let s = stop.clone();
            let handle = std::thread::spawn(move || {
                let mut peak = 0u64;
                if ctx.bind_to_thread().is_err() {
                    return 0;
                }
                while !s.load(Ordering::Relaxed) {
                    if let Ok((free, total)) = mem_get_info() {
                        peak = peak.max((total - free) as u64);
                    }
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                peak
            });
            return Some(Self {
                stop,
                handle: Some(handle),
            });
        }
        let _ = device;
        None
    }

    fn finish(mut self) -> u64 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.handle.take().map(|h| h.join().unwrap_or(0)).unwrap_or(0)
    }
}

/// A Qwen3 of `cfg`'s shape with N(0, 0.02) weights and unit norm gains, the same in every
/// process (seeded: cuRAND on CUDA, vime's host generator on the CPU).
pub fn random_model(cfg: Qwen3Config, dtype: DType, device: &Device) -> Result<Qwen3> {
    if device.is_cuda() {
        device.set_seed(1234)?;
    }
    let mut host = vime_kernels::testing::Rng::new(1234);
    let mut tensors = BTreeMap::new();
    for spec in param_specs(&cfg) {
        let t = if spec.shape.len() == 1 {
            Tensor::ones(spec.shape.as_slice(), dtype, device)?
        } else if device.is_cuda() {
            Tensor::randn(0f32, 0.02, spec.shape.as_slice(), device)?.to_dtype(dtype)?
        } else {
            host.randn(&spec.shape, 0.02, dtype, device)?
        };
        tensors.insert(spec.name, t);
    }
    Qwen3::from_tensors(cfg, tensors)
}

/// The host-side pieces of bench-step's step whose host time it reports (`host_ms` key, label of
/// the `HOST` line), to tell apart the launch gaps a timeline shows around the optimizer: the
/// accumulator's hand-over with the optimizer's preparation (`prepare_step`: its checks and
/// table) and the gradients' sums of squares up to their copy (the step's first wait for the
/// device: it comes after the backward, so these two are in `fwd_bwd_s`), then the guard's check,
/// the optimizer call (norm, clipping, launch; asynchronous) and the gradients' frees (in
/// `optimizer_s`).
const HOST_PIECES: [(&str, &str); 5] = [
    ("take", "take + optimizer prepare"),
    ("squares", "sums of squares incl. their copy"),
    ("guard", "guard"),
    ("optimizer_call", "optimizer call"),
    ("drop_grads", "gradients freed"),
];

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// `--compare-backward`: the gradients of one micro-batch from both backwards.
fn compare_backward(
    model: &mut Qwen3,
    batch: &PackedBatch,
    recompute: Recompute,
    objective: &dyn Fn(&vime_qwen3::model::TokenOutputs) -> anyhow::Result<Tensor>,
) -> Result<()> {
    let was = model.explicit_backward();
    model.set_explicit_backward(true)?;
    let (le, ge) = model.forward_backward(batch, recompute, objective)?;
    model.set_explicit_backward(false)?;
    let (la, ga) = model.forward_backward(batch, recompute, objective)?;
    model.set_explicit_backward(was)?;
    let (mut diff, mut reference) = (BTreeMap::new(), BTreeMap::new());
    for (name, a) in &ga.params {
        let e = ge
            .params
            .get(name)
            .with_context(|| format!("explicit backward: no gradient for {name}"))?;
        let a32 = a.to_dtype(DType::F32)?;
        diff.insert(name.clone(), (e.to_dtype(DType::F32)? - &a32)?);
        reference.insert(name.clone(), a32);
    }
    let rel = crate::optim::global_grad_norm(&diff)? / crate::optim::global_grad_norm(&reference)?.max(1e-30);
    let verdict = if rel <= COMPARE_BOUND && ge.params.len() == ga.params.len() {
        "PASS"
    } else {
        "FAIL"
    };
    println!(
        "COMPARE_BACKWARD: loss explicit {le:.6} autograd {la:.6}; {} gradients, ||explicit - autograd|| / ||autograd|| = {rel:.3e} (bound {COMPARE_BOUND:e}): {verdict}",
        ga.params.len()
    );
    if verdict != "PASS" {
        bail!("the explicit backward's gradients differ from autograd's by {rel:.3e}");
    }
    Ok(())
}

pub fn run(args: &BenchArgs) -> Result<serde_json::Value> {
    if !args.entropy_coef.is_finite() {
        bail!("--entropy-coef {}: expected a finite number", args.entropy_coef);
    }
    let kernels = crate::device::apply_kernel_flags(
        &args.attention_backend,
        args.deterministic_mode,
        vime_kernels::CudnnFailure::Fallback,
    )?;
    let fused_swiglu = match args.fp8_swiglu_cast.as_str() {
        "fused" => true,
        "separate" => false,
        other => bail!("--fp8-swiglu-cast {other:?}: expected fused or separate"),
    };
    let kernels = args
        .head
        .apply(args.fp8.apply(kernels)?.with_fp8_fused_swiglu(fused_swiglu))?;
    let device = parse_device(&args.device)?;
    let dtype = match args.dtype.as_str() {
        "bf16" => DType::BF16,
        "f32" => DType::F32,
        other => bail!("--dtype {other:?}: bf16 or f32"),
    };
    let recompute: Recompute = args.recompute.parse()?;
    if args.seq_len == 0 || args.max_tokens_per_gpu < args.seq_len || args.steps == 0 || args.micro_batches == 0 {
        bail!("need --seq-len >= 1, --max-tokens-per-gpu >= --seq-len, --steps >= 1, --micro-batches >= 1");
    }
    let ragged = match args.lengths.as_str() {
        "equal" => false,
        "ragged" => true,
        other => bail!("--lengths {other:?}: equal or ragged"),
    };
    if ragged
        && (args.micro_batches != 1
            || args.samples == 0
            || args.response_median == 0
            || args.response_sigma.is_nan()
            || args.response_sigma < 0.0)
    {
        bail!(
            "--lengths ragged: micro-batches come from dynamic batching (leave --micro-batches at 1), and it needs --samples >= 1, --response-median >= 1, --response-sigma >= 0"
        );
    }
    let mut cfg = config_of(&args.model)?;
    if let Some(l) = args.layers {
        if l == 0 {
            bail!("--layers must be at least 1");
        }
        cfg.num_hidden_layers = l;
        cfg.max_window_layers = cfg.max_window_layers.min(l);
    }
    let t0 = Instant::now();
    let explicit = match args.backward.as_str() {
        "explicit" => true,
        "autograd" => false,
        other => bail!("--backward {other:?}: explicit or autograd"),
    };
    let mut model = random_model(cfg.clone(), dtype, &device).context("building the random model")?;
    model.set_explicit_backward(explicit)?;
    model.set_kernel_config(kernels);
    let n_params: usize = model.named_parameters().iter().map(|(_, v)| v.elem_count()).sum();
    let opt_args = OptimizerArgs {
        lr: 1e-6,
        ..OptimizerArgs::default()
    };
    // The trainer's optimizer, ZeRO-1 over a data-parallel group of one (it is AdamW itself there).
    let dp = vime_dist::collectives::SingleRank::default();
    let mut opt = DistributedAdamW::new(model.named_parameters(), &opt_args, &dp)?;
    device.synchronize()?;
    eprintln!(
        "bench-step: {} ({:.3}B params), {dtype:?}{}, recompute {}, {} x {} tokens per step, built in {:.1}s",
        args.model,
        n_params as f64 / 1e9,
        if model.kernel_config().fp8() {
            " with FP8 linear layers (hybrid, tensorwise)"
        } else {
            ""
        },
        recompute,
        args.micro_batches,
        args.max_tokens_per_gpu,
        t0.elapsed().as_secs_f64()
    );
    let mut rng = vime_kernels::testing::Rng::new(99);
    // Sequence lengths of each micro-batch.
    let plan: Vec<Vec<usize>> = if ragged {
        let lengths = ragged_lengths(
            &mut rng,
            args.samples,
            args.seq_len,
            args.response_median,
            args.response_sigma,
        );
        crate::batching::pack_micro_batches(&lengths, args.max_tokens_per_gpu)?
            .into_iter()
            .map(|mb| mb.into_iter().map(|i| lengths[i]).collect())
            .collect()
    } else {
        let mut mb = Vec::new();
        let mut left = args.max_tokens_per_gpu;
        while left > 0 {
            let len = args.seq_len.min(left);
            mb.push(len);
            left -= len;
        }
        vec![mb; args.micro_batches]
    };
    let all_lengths: Vec<usize> = plan.iter().flatten().copied().collect();
    let tokens: usize = all_lengths.iter().sum();
    let fpt = flops_of_lengths(&cfg, &all_lengths) / tokens as f64;
    let mean_len = tokens as f64 / all_lengths.len() as f64;
    let fill = tokens as f64 / (plan.len() * args.max_tokens_per_gpu) as f64;
    let mut batches = Vec::new();
    for mb in &plan {
        let seqs: Vec<Vec<u32>> = mb
            .iter()
            .map(|&len| {
                (0..len)
                    .map(|_| (rng.next_u64() % cfg.vocab_size as u64) as u32)
                    .collect()
            })
            .collect();
        batches.push(PackedBatch::from_sequences(&seqs)?);
    }
    if ragged {
        eprintln!(
            "bench-step: ragged, {} samples of {}-{} tokens (mean {:.0}) in {} micro-batches of at most {} tokens ({:.1}% full)",
            all_lengths.len(),
            all_lengths.iter().min().unwrap_or(&0),
            all_lengths.iter().max().unwrap_or(&0),
            mean_len,
            plan.len(),
            args.max_tokens_per_gpu,
            100.0 * fill
        );
    }
    let objective = |o: &vime_qwen3::model::TokenOutputs| -> anyhow::Result<Tensor> {
        let n = o.logprobs.elem_count().max(1) as f64;
        let loss = o.logprobs.sum_all()?.affine(-1.0 / n, 0.0)?;
        if args.entropy_coef == 0.0 {
            return Ok(loss);
        }
        Ok((loss - o.entropy.sum_all()?.affine(args.entropy_coef / n, 0.0)?)?)
    };
    if args.compare_backward {
        compare_backward(&mut model, &batches[0], recompute, &objective)?;
    }
    if !matches!(args.nan_guard.as_str(), "off" | "fused" | "sum-all") {
        bail!("--nan-guard {:?}: expected off, fused or sum-all", args.nan_guard);
    }
    let tokens_per_step = tokens as f64;
    let single = vime_dist::SingleRank::default();
    let (mut fb, mut optim, mut total) = (Vec::new(), Vec::new(), Vec::new());
    // Host time (not GPU time) of the optimizer phase's pieces (`HOST_PIECES`), per timed step.
    let mut host: [Vec<f64>; HOST_PIECES.len()] = Default::default();
    let mut sampler = None;
    let mut last_loss = 0.0;
    for step in 0..args.warmup + args.steps {
        if step == args.warmup {
            sampler = MemSampler::start(&device);
        }
        let s0 = Instant::now();
        let mut acc = GradAccumulator::new();
        let mut loss = None;
        // As the trainer's optimizer step does: the running sums go through the backward, and
        // under FP8 each weight is quantized once for the step's micro-batches. Nothing here waits
        // for the device: the losses stay on it (`QueuedLoss`).
        model.with_fp8_weight_cache(|| -> Result<()> {
            for b in &batches {
                let sums = acc.take_sums();
                let (l, grads) = model.forward_backward_into(b, recompute, objective, &single, None, None, sums)?;
                loss = Some(l);
                acc.put_sums(grads.params)?;
            }
            Ok(())
        })?;
        let h0 = Instant::now();
        let grads = acc.take();
        // The optimizer's checks and its fused update's table, done while the backward runs.
        opt.prepare_step(&grads, &dp, &single)?;
        let h1 = Instant::now();
        // Each gradient's sum of squares, queued behind the backward and read: the step's first
        // wait for the device, so the host work above (the accumulator, the FP8 weights' frees,
        // the optimizer's preparation) ran while the backward did, not with the GPU idle after a
        // sync. The sums go on to the optimizer's norm, as in the trainer's step.
        let squares = crate::optim::grad_sum_squares(&grads)?;
        let s1 = Instant::now();
        // The guard as `--nan-guard` asks.
        let bad = match args.nan_guard.as_str() {
            "fused" => crate::optim::first_nonfinite(&grads, &squares),
            "sum-all" => crate::optim::first_nonfinite_by_sum_all(&grads)?,
            _ => None,
        };
        if let Some(name) = bad {
            bail!("bench-step: the gradient of {name} is not finite");
        }
        let h2 = Instant::now();
        opt.step_stats_tp(&grads, Some(&squares), opt_args.lr, 1.0, &dp, &single)?;
        let h3 = Instant::now();
        // Freed while the optimizer's kernels run, as the trainer's step frees them (it returns
        // without waiting for the device). Freed after the wait, the ~310 frees (0.6B) were
        // host time at the next step's start with the GPU idle: 0.6-0.9 ms of gap in the 0.6B
        // timeline (benches/results/2026-12-05-rows-981a9bb-h200.md).
        drop(grads);
        let h4 = Instant::now();
        if let Some(l) = loss.take() {
            last_loss = l.read()?;
        }
        device.synchronize()?;
        let s2 = Instant::now();
        if step >= args.warmup {
            for (v, (a, b)) in host.iter_mut().zip([(h0, h1), (h1, s1), (s1, h2), (h2, h3), (h3, h4)]) {
                v.push((b - a).as_secs_f64());
            }
            fb.push((s1 - s0).as_secs_f64());
            optim.push((s2 - s1).as_secs_f64());
            total.push((s2 - s0).as_secs_f64());
        }
    }
    let peak = sampler.map(MemSampler::finish).unwrap_or(0);
    let (fb, optim, step) = (median(&mut fb), median(&mut optim), median(&mut total));
    let host_ms: Vec<f64> = host.iter_mut().map(|v| 1e3 * median(v)).collect();
    let tps = tokens_per_step / step;
    let tflops = tps * fpt / 1e12;
    let (graphs, build_s) = vime_kernels::cudnn_graph_stats();
    let out = serde_json::json!({
        "system": "vime",
        "model": args.model,
        "params": n_params,
        "dtype": args.dtype,
        "recompute": args.recompute,
        "attention": if device.is_cuda() { model.kernel_config().attention_kernel() } else { "cpu" },
        "deterministic_mode": args.deterministic_mode,
        "nan_guard": args.nan_guard,
        "entropy_coef": args.entropy_coef,
        "fp8": args.fp8.fp8_format.as_ref().map(|f| match args.fp8.delayed() {
            Ok(Some(d)) => format!(
                "{f} delayed (history {}, {}, margin {})",
                d.history_len,
                if d.use_max { "max" } else { "most_recent" },
                d.margin
            ),
            _ => format!("{f} {}", args.fp8.fp8_recipe),
        }),
        "fp8_swiglu_cast": args.fp8.delayed().ok().flatten().map(|_| args.fp8_swiglu_cast.clone()),
        "lm_head_logits": args.head.lm_head_logits,
        "cudnn_graphs": graphs,
        "cudnn_graph_build_s": build_s,
        "cudnn_version": vime_kernels::cudnn_version(),
        "seq_len": args.seq_len,
        "tokens_per_micro_batch": args.max_tokens_per_gpu,
        "micro_batches": plan.len(),
        "lengths": args.lengths,
        "samples": all_lengths.len(),
        "tokens_per_step": tokens,
        "mean_sample_len": mean_len,
        "max_sample_len": all_lengths.iter().max().copied().unwrap_or(0),
        "micro_batch_fill": fill,
        "steps": args.steps,
        "step_s": step,
        "fwd_bwd_s": fb,
        "optimizer_s": optim,
        "tokens_per_s": tps,
        "flops_per_token": fpt,
        "model_tflops": tflops,
        "mfu_989": tflops / 989.0,
        "mfu_790": tflops / 790.0,
        "peak_mem_gib": peak as f64 / (1u64 << 30) as f64,
        "final_loss": last_loss,
        "host_ms": HOST_PIECES.iter().zip(&host_ms).map(|((k, _), v)| (k.to_string(), serde_json::json!(v))).collect::<serde_json::Map<_, _>>(),
    });
    println!(
        "RESULT vime {} seq {} tokens/step {} recompute {} attention {}{}: step {:.3} s (fwd+bwd {:.3}, optimizer {:.3}), {:.0} tokens/s, {:.0} TFLOP/s, MFU {:.1}% of 989 / {:.1}% of 790, peak mem {:.1} GiB",
        args.model,
        args.seq_len,
        tokens_per_step,
        args.recompute,
        out["attention"].as_str().unwrap_or("?"),
        if ragged { " lengths ragged" } else { "" },
        step,
        fb,
        optim,
        tps,
        tflops,
        100.0 * tflops / 989.0,
        100.0 * tflops / 790.0,
        peak as f64 / (1u64 << 30) as f64
    );
    let pieces: Vec<String> = HOST_PIECES
        .iter()
        .zip(&host_ms)
        .map(|((_, label), v)| format!("{label} {v:.3}"))
        .collect();
    println!("HOST optimizer phase (median ms of host time): {}", pieces.join(", "));
    if graphs > 0 {
        let v = out["cudnn_version"].as_str().unwrap_or("?");
        println!("cuDNN {v} attention: {graphs} graphs built, {build_s:.2} s of host time (warm-up included)");
    }
    if let Some(p) = &args.json {
        std::fs::write(p, serde_json::to_string_pretty(&out)?).with_context(|| format!("writing {}", p.display()))?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flops_per_token_of_qwen3_4b_counts_every_matmul_and_causal_attention() {
        let cfg = config_of("qwen3-4b").unwrap();
        // Counted from the shapes, one token at a time: the forward of token i (0-based) of a
        // causal sequence of s does, per layer, a [1, in] x [in, out] product for each weight
        // (q 2560->4096, k and v 2560->1024, o 4096->2560, gate/up 2560->9728, down 9728->2560)
        // and, per query head, q.K^T over its i+1 keys ([1,128] x [128,i+1]) and P.V
        // ([1,i+1] x [i+1,128]); the LM head is 2560->151936. Each multiply-add is 2 FLOPs and
        // the backward does twice the forward's (input and weight gradients).
        let macs_weights: f64 = 36.0
            * (2560.0 * 4096.0 + 2.0 * 2560.0 * 1024.0 + 4096.0 * 2560.0 + 3.0 * 2560.0 * 9728.0)
            + 2560.0 * 151936.0;
        for s in [1usize, 7, 4096, 32768] {
            let fwd: f64 = (0..s)
                .map(|i| 2.0 * macs_weights + 36.0 * 32.0 * 2.0 * (2.0 * 128.0 * (i + 1) as f64))
                .sum();
            let want = 3.0 * fwd / s as f64;
            let got = flops_per_token(&cfg, s);
            assert!((got - want).abs() / want < 1e-9, "s={s}: {got} vs {want}");
        }
        // The anchor: Qwen3-4B at s = 4096 is 27.76 GFLOP per token.
        assert!((flops_per_token(&cfg, 4096) / 1e9 - 27.76).abs() < 0.01);
        // Qwen3-4B: 3.63 B matmul weights in the layers plus the 0.39 B LM head (tied to the
        // embedding, which is a lookup and not counted again): 4.02 B.
        assert!((macs_weights / 1e9 - 4.022).abs() < 0.001, "{}", macs_weights / 1e9);
    }

    #[test]
    fn flops_of_ragged_lengths_count_each_sequence_causally_on_its_own() {
        let cfg = config_of("qwen3-4b").unwrap();
        // The same per-token count as above, for a pack of a 7- and a 4096-token sequence: each
        // token attends only to its own sequence's earlier tokens.
        let macs_weights: f64 = 36.0
            * (2560.0 * 4096.0 + 2.0 * 2560.0 * 1024.0 + 4096.0 * 2560.0 + 3.0 * 2560.0 * 9728.0)
            + 2560.0 * 151936.0;
        let seq = |s: usize| -> f64 {
            (0..s)
                .map(|i| 3.0 * (2.0 * macs_weights + 36.0 * 32.0 * 2.0 * (2.0 * 128.0 * (i + 1) as f64)))
                .sum()
        };
        let want = seq(7) + seq(4096);
        let got = flops_of_lengths(&cfg, &[7, 4096]);
        assert!((got - want).abs() / want < 1e-9, "{got} vs {want}");
        // One 4103-token sequence does more attention than the two apart.
        assert!(flops_of_lengths(&cfg, &[4103]) > got);
    }

    #[test]
    fn ragged_lengths_are_prompt_plus_a_long_tailed_response_capped_at_the_sequence() {
        let mut rng = vime_kernels::testing::Rng::new(5);
        // sigma 0: every response is the median, prompts cover [64, 512).
        let l = ragged_lengths(&mut rng, 2000, 1 << 20, 300, 0.0);
        assert!(l.iter().all(|&x| (364..812).contains(&x)), "{:?}", &l[..8]);
        assert!(*l.iter().min().unwrap() < 380 && *l.iter().max().unwrap() > 795);
        // sigma 1: P(response > 4 x median) = P(Z > ln 4) = 8.3 %; the median sample is about
        // median + the mean prompt (288).
        let mut l = ragged_lengths(&mut rng, 20000, 1 << 20, 1000, 1.0);
        let tail = l.iter().filter(|&&x| x > 4000 + 511).count() as f64 / 20000.0;
        assert!((0.06..0.09).contains(&tail), "tail {tail}");
        l.sort_unstable();
        let med = l[10000] as f64;
        assert!((1150.0..1450.0).contains(&med), "median {med}");
        // The cap: no sample past --seq-len.
        let l = ragged_lengths(&mut rng, 2000, 1024, 1000, 1.0);
        assert!(l.iter().all(|&x| (2..=1024).contains(&x)) && l.iter().filter(|&&x| x == 1024).count() > 500);
    }

    #[test]
    fn a_ragged_step_packs_by_dynamic_batching_and_counts_its_tokens() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        std::fs::write(&path, tiny_config().to_string()).unwrap();
        let args = BenchArgs {
            seq_len: 48,
            max_tokens_per_gpu: 64,
            recompute: "none".into(),
            dtype: "f32".into(),
            lengths: "ragged".into(),
            samples: 9,
            response_median: 8,
            ..cpu_args(&path.display().to_string())
        };
        let out = run(&args).unwrap();
        // The same draw, packed independently: the step holds every sample once.
        let mut rng = vime_kernels::testing::Rng::new(99);
        let lengths = ragged_lengths(&mut rng, 9, 48, 8, 1.0);
        let plan = crate::batching::pack_micro_batches(&lengths, 64).unwrap();
        let tokens: usize = lengths.iter().sum();
        assert_eq!(out["samples"], 9);
        assert_eq!(out["tokens_per_step"], tokens);
        assert_eq!(out["micro_batches"], plan.len());
        assert!(plan.len() >= tokens.div_ceil(64) && plan.len() > 1);
        let (tps, step) = (out["tokens_per_s"].as_f64().unwrap(), out["step_s"].as_f64().unwrap());
        assert!((tps * step - tokens as f64).abs() < 1e-6);
        let cfg = config_of(&args.model).unwrap();
        let fpt = out["flops_per_token"].as_f64().unwrap();
        assert!((fpt * tokens as f64 - flops_of_lengths(&cfg, &lengths)).abs() / fpt < 1e-6);
        assert!((out["micro_batch_fill"].as_f64().unwrap() - tokens as f64 / (64 * plan.len()) as f64).abs() < 1e-12);
        // Ragged needs micro-batches from the packing, and a known --lengths.
        let e = format!(
            "{:#}",
            run(&BenchArgs {
                micro_batches: 3,
                ..args.clone()
            })
            .unwrap_err()
        );
        assert!(e.contains("--micro-batches"), "{e}");
        let e = format!(
            "{:#}",
            run(&BenchArgs {
                lengths: "jagged".into(),
                ..args.clone()
            })
            .unwrap_err()
        );
        assert!(e.contains("--lengths") && e.contains("jagged"), "{e}");
        let e = format!(
            "{:#}",
            run(&BenchArgs {
                response_sigma: -1.0,
                ..args
            })
            .unwrap_err()
        );
        assert!(e.contains("--response-sigma"), "{e}");
    }

    /// bench-step's defaults on the CPU, one step, no warm-up.
    fn cpu_args(model: &str) -> BenchArgs {
        BenchArgs {
            model: model.into(),
            seq_len: 4096,
            max_tokens_per_gpu: 4096,
            micro_batches: 1,
            steps: 1,
            warmup: 0,
            recompute: "full".into(),
            device: "cpu".into(),
            dtype: "bf16".into(),
            json: None,
            backward: "explicit".into(),
            layers: None,
            compare_backward: false,
            nan_guard: "fused".into(),
            fp8_swiglu_cast: "fused".into(),
            entropy_coef: 0.0,
            attention_backend: "auto".into(),
            deterministic_mode: false,
            fp8: Default::default(),
            head: Default::default(),
            lengths: "equal".into(),
            samples: 64,
            response_median: 1024,
            response_sigma: 1.0,
        }
    }

    fn tiny_config() -> serde_json::Value {
        serde_json::json!({
            "model_type": "qwen3", "vocab_size": 97, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256,
            "tie_word_embeddings": true, "attention_bias": false, "hidden_act": "silu",
            "use_sliding_window": false, "max_window_layers": 2
        })
    }

    #[test]
    fn a_tiny_step_runs_on_the_cpu_and_reports_sane_numbers() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = tiny_config();
        let path = dir.path().join("config.json");
        std::fs::write(&path, cfg.to_string()).unwrap();
        let json = dir.path().join("out.json");
        let args = BenchArgs {
            seq_len: 16,
            max_tokens_per_gpu: 40,
            micro_batches: 2,
            steps: 2,
            warmup: 1,
            dtype: "f32".into(),
            json: Some(json.clone()),
            // f32 on the CPU: the two backwards agree to ~1e-7, far inside the bound.
            compare_backward: true,
            ..cpu_args(&path.display().to_string())
        };
        let out = run(&args).unwrap();
        // embedding + 2 x (q, k, v, o, gate/up/down, two norms of 32, q/k norms of 8) + final norm
        let per_layer = 32 * 32 + 2 * 32 * 16 + 32 * 32 + 3 * 32 * 64 + 2 * 32 + 2 * 8;
        assert_eq!(out["params"], serde_json::json!(97 * 32 + 2 * per_layer + 32));
        let tps = out["tokens_per_s"].as_f64().unwrap();
        let step = out["step_s"].as_f64().unwrap();
        assert!(
            tps > 0.0 && (tps * step - 80.0).abs() < 1e-6,
            "80 tokens per step: {tps} x {step}"
        );
        // -mean(logprob) of a random model over 97 ids is near ln(97) = 4.57.
        assert_eq!(out["attention"], "cpu");
        assert_eq!(out["cudnn_graphs"], 0);
        let loss = out["final_loss"].as_f64().unwrap();
        assert!((loss - 97f64.ln()).abs() < 0.5, "loss {loss}");
        // The host pieces are medians of parts of the timed phases (the hand-over and the sums
        // of squares up to the first wait are in fwd+bwd; the rest in the optimizer phase), so
        // each median lies within its phase's.
        let ms = |k: &str| out["host_ms"][k].as_f64().unwrap_or(-1.0);
        let (fb_ms, opt_ms) = (
            1e3 * out["fwd_bwd_s"].as_f64().unwrap(),
            1e3 * out["optimizer_s"].as_f64().unwrap(),
        );
        for k in ["take", "squares"] {
            assert!((0.0..=fb_ms).contains(&ms(k)), "host_ms.{k}: {}", out["host_ms"]);
        }
        for k in ["guard", "optimizer_call", "drop_grads"] {
            assert!((0.0..=opt_ms).contains(&ms(k)), "host_ms.{k}: {}", out["host_ms"]);
        }
        let back: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
        assert_eq!(back, out);
    }

    #[test]
    fn the_entropy_coef_subtracts_the_mean_entropy_from_the_objective() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("config.json");
        std::fs::write(&path, tiny_config().to_string()).unwrap();
        // One step, no warm-up: the loss is the first forward's, before any update, so the runs
        // differ only in the objective.
        let loss = |c: f64| {
            let args = BenchArgs {
                seq_len: 16,
                max_tokens_per_gpu: 32,
                dtype: "f32".into(),
                entropy_coef: c,
                ..cpu_args(&path.display().to_string())
            };
            let out = run(&args).unwrap();
            assert_eq!(out["entropy_coef"], serde_json::json!(c));
            out["final_loss"].as_f64().unwrap()
        };
        let (l0, l1, l2) = (loss(0.0), loss(1.0), loss(2.0));
        // L(c) = -mean(logprob) - c * mean(entropy). A random-init model (N(0, 0.02) weights) is
        // close to uniform over its 97 ids, whose entropy is ln 97: the term's sign and scale.
        let h = l0 - l1;
        assert!(
            (h - 97f64.ln()).abs() < 0.05,
            "mean entropy {h}, ln 97 = {}",
            97f64.ln()
        );
        assert!((l0 - l2 - 2.0 * h).abs() < 1e-4, "{l0} {l1} {l2}");
        let e = format!(
            "{:#}",
            run(&BenchArgs {
                entropy_coef: f64::NAN,
                ..cpu_args("qwen3-4b")
            })
            .unwrap_err()
        );
        assert!(e.contains("--entropy-coef"), "{e}");
    }

    #[test]
    fn bad_flags_are_clear_errors() {
        let base = cpu_args("qwen3-4b");
        let err = |a: BenchArgs| format!("{:#}", run(&a).unwrap_err());
        let e = err(BenchArgs {
            model: "qwen9-1t".into(),
            ..base.clone()
        });
        assert!(e.contains("qwen9-1t") && e.contains("qwen3-4b"), "{e}");
        let e = err(BenchArgs {
            max_tokens_per_gpu: 100,
            ..base.clone()
        });
        assert!(e.contains("--max-tokens-per-gpu"), "{e}");
        let e = err(BenchArgs {
            recompute: "some".into(),
            ..base.clone()
        });
        assert!(e.contains("recompute"), "{e}");
        let e = err(BenchArgs {
            backward: "magic".into(),
            ..base.clone()
        });
        assert!(e.contains("--backward") && e.contains("magic"), "{e}");
        let e = err(BenchArgs {
            layers: Some(0),
            ..base.clone()
        });
        assert!(e.contains("--layers"), "{e}");
        let e = err(BenchArgs {
            fp8_swiglu_cast: "both".into(),
            ..base.clone()
        });
        assert!(e.contains("--fp8-swiglu-cast") && e.contains("both"), "{e}");
        let e = err(BenchArgs {
            dtype: "int8".into(),
            ..base
        });
        assert!(e.contains("--dtype"), "{e}");
    }
}
