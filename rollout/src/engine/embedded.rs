//! The built-in engine: continuous-batching generation on the `vime-qwen3` weights, in process.
//!
//! Each step runs one [`Qwen3::forward_with_cache`] over every active sequence (one new token
//! each) plus the newly admitted prompts (their whole prompt), samples one token per sequence,
//! and retires the finished ones, freeing their KV-cache slot for the next waiting request.
//!
//! Decisions:
//! - Sampling follows vLLM 0.33 (`vllm/v1/sample/sampler.py`, `ops/topk_topp_sampler.py`):
//!   temperature below 1e-5 is greedy (argmax; top-k / top-p ignored); otherwise logits / T, then
//!   top-k (ties with the k-th value kept), then top-p on the renormalised top-k distribution
//!   (a token is dropped when the tokens ranked above it already hold mass >= p; the top token is
//!   always kept), then a draw.
//! - Greedy and plain temperature sampling (no top-k, top-p 1: what RL rollouts use) run on the
//!   logits' device (`vime_kernels::sample::sample_gumbel`: vLLM's exponential race as a
//!   Gumbel-max over noise hashed from the request's seed and token index), so only one token per
//!   sequence leaves the GPU: the host copy and sampling of `[batch, 151936]` f32 logits was 90 % of
//!   a decode step at batch 64 on an H200. Rows with top-k or top-p take the host sampler, whose
//!   request-owned generator (the [`Rng`] SplitMix64) consumes one uniform per token.
//! - Every request has its seed (its own, or a draw from the engine's generator when `None`), so a
//!   seeded request samples the same tokens whatever else is in the batch, on either path.
//! - Log-probs are vLLM's default `logprobs_mode = "raw_logprobs"`: log-softmax of the
//!   unmodified logits (no temperature, no top-k/p). The LM head runs once per step: f32 logits
//!   from bf16 inputs with f32 accumulation (`vime_kernels::lm_head::logits_f32`, the trainer's
//!   log-prob precision, never rounded to bf16), from which the sampler draws the token and takes
//!   its log-prob in the same pass (`sample_gumbel_logprobs`; host rows: the same formula in f64).
//!   The rollout-vs-trainer gap is rounding (the tests bound it).
//! - On CUDA, decode steps (every running sequence feeds one token) replay captured CUDA graphs
//!   (`Qwen3::decode_graphed`: the batch padded to vLLM's capture sizes, per-step inputs in fixed
//!   device buffers): the step was host-bound, ~500 kernel launches for 2.8 ms of GPU work at
//!   batch 64 (0.6B). Steps that admit prompts run the plain forward. `VIME_CUDA_GRAPHS=0` turns
//!   graphs off. The graphs run each layer's q|k|v and gate|up projections as one GEMM each
//!   (`Qwen3::decode_weights`, a copy of ~3/4 of the layer weights, made again after each weight
//!   update; [`EngineOptions::fused_decode`], `VIME_FUSED_DECODE=0` turns it off).
//! - Stopping, in vLLM's `check_stop` order: an EOS id or a `stop_token_ids` id ends with `Stop`
//!   (the id is kept); then `max_tokens` generated, or prompt + output reaching
//!   `max_position_embeddings` (vLLM's `max_model_len`), ends with `Length`.
//! - EOS ids come from the checkpoint (`config.json` and `generation_config.json`'s
//!   `eos_token_id`, as vLLM adds them unless `ignore_eos`); [`EngineOptions::eos_token_ids`]
//!   overrides them.
//! - The model sits behind a `RwLock`: `generate` holds the read lock for the whole batch; a weight
//!   update takes the write lock and copies into the existing `Var`s (`Var::set`), so in-flight
//!   generation never sees half-updated weights and no buffer is reallocated. Every tensor is
//!   checked (names and shapes, each problem naming its tensor) before any is written.
use super::{FinishReason, GenControl, GenOutput, GenRequest, RolloutEngine, SamplingParams};
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use serde_json::Value;
use std::collections::{BTreeMap, VecDeque};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use vime_kernels::testing::Rng;
use vime_qwen3::checkpoint::{check_tensors, load_config, load_hf_weights};
use vime_qwen3::config::Qwen3Config;
use vime_qwen3::infer::{DecodeGraphs, DecodeWeights, HiddenRows};
use vime_qwen3::model::Qwen3;

/// vLLM's `_SAMPLING_EPS`: a temperature below it means greedy.
pub const SAMPLING_EPS: f64 = 1e-5;

/// Engine-wide settings (per-request ones are in [`SamplingParams`]).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineOptions {
    /// Sequences decoded together at most (vLLM `--max-num-seqs`).
    pub max_num_seqs: usize,
    /// Tokens per step at most (decode tokens + admitted prompts); a prompt longer than this runs
    /// alone in its step (vLLM `--max-num-batched-tokens`, without chunked prefill).
    pub max_num_batched_tokens: usize,
    /// Ids that end generation with `Stop` for every request, in addition to `stop_token_ids`.
    pub eos_token_ids: Vec<u32>,
    /// Seed of the engine's generator, which seeds the requests that bring no seed of their own.
    pub seed: u64,
    /// Decode steps through captured CUDA graphs on CUDA (off: vime-serve's `--enforce-eager`,
    /// as vLLM's; `VIME_CUDA_GRAPHS=0` turns them off too).
    pub cuda_graphs: bool,
    /// The CUDA decode graphs run each layer's q|k|v and gate|up projections as one GEMM each,
    /// from a fused copy of those weights (`Qwen3::decode_weights`: ~3/4 of the layer weights
    /// again, 4.7 GB at Qwen3-4B, remade after each weight update). On by default;
    /// `VIME_FUSED_DECODE=0` turns it off too.
    pub fused_decode: bool,
    /// Most tokens the engine's KV cache holds at once, over all running sequences (vime-serve
    /// sets it from `--gpu-memory-utilization` or `--kv-cache-tokens`); `None`: no limit, the
    /// cache grows until the device runs out. With a limit, requests wait for room, and when
    /// the running sequences outgrow it the most recently admitted one is preempted (its cache
    /// freed) and later recomputed from its prompt and the tokens it has, as vLLM does.
    pub kv_cache_tokens: Option<usize>,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            max_num_seqs: 256,
            max_num_batched_tokens: 8192,
            eos_token_ids: Vec::new(),
            seed: 0,
            cuda_graphs: true,
            fused_decode: true,
            kv_cache_tokens: None,
        }
    }
}

impl EngineOptions {
    /// Defaults, with the EOS ids of `cfg` (`eos_token_id`).
    pub fn for_config(cfg: &Qwen3Config) -> Self {
        Self {
            eos_token_ids: cfg.eos_token_id.as_ref().map(|e| e.to_vec()).unwrap_or_default(),
            ..Self::default()
        }
    }
}

/// In-process [`RolloutEngine`] on a [`Qwen3`] model.
pub struct EmbeddedEngine {
    model: RwLock<Qwen3>,
    /// The device the weights belong on while they sleep on the host (`offload_weights`).
    home: Mutex<Option<Device>>,
    weight_version: AtomicU64,
    rng: Mutex<Rng>,
    opts: EngineOptions,
    /// The fused q|k|v and gate|up weights of the CUDA decode graphs and the weight version they
    /// were made from (made again after a weight update, dropped when the weights sleep).
    fused: Mutex<Option<(u64, DecodeWeights)>>,
    /// Preemptions for KV room over the engine's life ([`Self::preemptions`]).
    preemptions: AtomicU64,
}

impl EmbeddedEngine {
    pub fn new(model: Qwen3, opts: EngineOptions) -> Result<Self> {
        if opts.max_num_seqs == 0 || opts.max_num_batched_tokens == 0 {
            bail!("max_num_seqs and max_num_batched_tokens must be positive, got {opts:?}");
        }
        Ok(Self {
            model: RwLock::new(model),
            home: Mutex::new(None),
            weight_version: AtomicU64::new(0),
            rng: Mutex::new(Rng::new(opts.seed)),
            opts,
            fused: Mutex::new(None),
            preemptions: AtomicU64::new(0),
        })
    }

    /// How many times a running sequence was preempted (its KV freed, recomputed later) because
    /// the cache of [`EngineOptions::kv_cache_tokens`] ran full, over the engine's life.
    pub fn preemptions(&self) -> u64 {
        self.preemptions.load(Ordering::Relaxed)
    }

    /// Loads an HF checkpoint directory; the EOS ids come from its `config.json` and
    /// `generation_config.json`.
    pub fn load_hf(dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        let model = Qwen3::load_hf(dir, dtype, device)?;
        let mut opts = EngineOptions::for_config(model.config());
        for id in generation_config_eos(dir)? {
            if !opts.eos_token_ids.contains(&id) {
                opts.eos_token_ids.push(id);
            }
        }
        Self::new(model, opts)
    }

    pub fn options(&self) -> &EngineOptions {
        &self.opts
    }

    pub fn config(&self) -> Result<Qwen3Config> {
        Ok(self.read()?.config().clone())
    }

    /// Runs `f` on the model under the read lock (weights cannot change meanwhile).
    pub fn with_model<R>(&self, f: impl FnOnce(&Qwen3) -> R) -> Result<R> {
        Ok(f(&*self.read()?))
    }

    /// Replaces every weight with `tensors` (HF names, exactly the model's parameter set, any float
    /// dtype and device: converted to the model's) and bumps the weight version. Nothing is
    /// written unless every tensor checks out.
    pub fn update_weights(&self, tensors: &BTreeMap<String, Tensor>) -> Result<()> {
        let (cfg, dtype, device) = {
            let m = self.read()?;
            (m.config().clone(), m.dtype(), m.device().clone())
        };
        check_tensors(&cfg, tensors).context("update_weights")?;
        let mut converted = BTreeMap::new();
        for (name, t) in tensors {
            // A fresh buffer always: `Var::set` refuses a source that shares the variable's storage.
            let t = if t.dtype() == dtype && t.device().same_device(&device) {
                t.copy()?
            } else {
                t.to_device(&device)?.to_dtype(dtype)?
            };
            converted.insert(name.clone(), t.contiguous()?);
        }
        self.set_weights(converted)
    }

    fn set_weights(&self, tensors: BTreeMap<String, Tensor>) -> Result<()> {
        let model = self
            .model
            .write()
            .map_err(|_| anyhow!("the engine's model lock is poisoned"))?;
        for (name, var) in model.named_parameters() {
            let t = tensors
                .get(name)
                .ok_or_else(|| anyhow!("internal: checked tensor {name} is missing"))?;
            var.set(t).with_context(|| format!("setting {name} {:?}", t.dims()))?;
        }
        self.weight_version.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    /// The fused decode weights of `model` at the current weight version (made on first use
    /// after a change), with [`EngineOptions::fused_decode`]; `None` without it, with
    /// `VIME_FUSED_DECODE=0`, or for models with attention biases. Their strided kernels are held
    /// to the contiguous ones on the GPU by `engine_ops` in `kernels/tests/cuda_vs_cpu.rs`
    /// ("fused qkv / gate-up views", bit for bit).
    fn fused_weights(&self, model: &Qwen3) -> Result<Option<DecodeWeights>> {
        if !self.opts.fused_decode || std::env::var("VIME_FUSED_DECODE").is_ok_and(|v| v == "0") {
            return Ok(None);
        }
        let version = self.weight_version.load(Ordering::SeqCst);
        let mut slot = self
            .fused
            .lock()
            .map_err(|_| anyhow!("the engine's fused-weights lock is poisoned"))?;
        if let Some((v, w)) = &*slot {
            if *v == version {
                return Ok(Some(w.clone()));
            }
        }
        *slot = None;
        let w = model.decode_weights().context("fusing the decode weights")?;
        if let Some(w) = &w {
            *slot = Some((version, w.clone()));
        }
        Ok(w)
    }

    fn read(&self) -> Result<std::sync::RwLockReadGuard<'_, Qwen3>> {
        self.model
            .read()
            .map_err(|_| anyhow!("the engine's model lock is poisoned"))
    }
}

/// `eos_token_id` of `dir/generation_config.json` (one id or a list), empty when absent.
fn generation_config_eos(dir: &Path) -> Result<Vec<u32>> {
    let path = dir.join("generation_config.json");
    if !path.is_file() {
        return Ok(Vec::new());
    }
    let text = std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    let v: Value = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    let ids = match v.get("eos_token_id") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|x| x as u32).collect(),
        Some(x) => x.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
    };
    Ok(ids)
}

/// The config fields that weights cannot reveal (or that a checkpoint's tensors can hide, like
/// an LM head a tied model ignores) must agree between the engine and a checkpoint.
fn check_same_architecture(have: &Qwen3Config, new: &Qwen3Config) -> Result<()> {
    let mut diffs = Vec::new();
    macro_rules! cmp {
        ($($f:ident),*) => {$(
            if have.$f != new.$f {
                diffs.push(format!("{}: engine {:?}, checkpoint {:?}", stringify!($f), have.$f, new.$f));
            }
        )*};
    }
    cmp!(
        vocab_size,
        hidden_size,
        intermediate_size,
        num_hidden_layers,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        rms_norm_eps,
        rope_theta,
        tie_word_embeddings,
        attention_bias
    );
    if !diffs.is_empty() {
        bail!("config.json describes a different model: {}", diffs.join("; "));
    }
    Ok(())
}

fn validate_request(i: usize, r: &GenRequest, cfg: &Qwen3Config) -> Result<()> {
    let p = &r.params;
    let n = r.prompt_ids.len();
    if n == 0 {
        bail!("request {i}: empty prompt");
    }
    if n >= cfg.max_position_embeddings {
        bail!(
            "request {i}: prompt of {n} tokens leaves no room under max_position_embeddings {}",
            cfg.max_position_embeddings
        );
    }
    if let Some(&id) = r.prompt_ids.iter().find(|&&id| id as usize >= cfg.vocab_size) {
        bail!(
            "request {i}: prompt token {id} is outside the vocabulary ({} ids)",
            cfg.vocab_size
        );
    }
    if !(p.temperature.is_finite() && p.temperature >= 0.0) {
        bail!(
            "request {i}: temperature must be finite and >= 0, got {}",
            p.temperature
        );
    }
    if !(p.top_p > 0.0 && p.top_p <= 1.0) {
        bail!("request {i}: top_p must be in (0, 1], got {}", p.top_p);
    }
    if p.top_k < -1 {
        bail!(
            "request {i}: top_k must be -1 (disabled), 0 (disabled) or positive, got {}",
            p.top_k
        );
    }
    if p.max_tokens == 0 {
        bail!("request {i}: max_tokens must be at least 1");
    }
    Ok(())
}

/// Seconds per phase of [`EmbeddedEngine::generate`] (`VIME_ENGINE_PROFILE`).
#[derive(Debug, Default)]
struct StepProfile {
    steps: usize,
    /// Tokens fed to the model (prompts and decoded tokens).
    tokens: usize,
    /// Tokens sampled (one per sequence per step).
    sampled: usize,
    /// scheduling and bookkeeping, model forward (KV cache included), LM head logits, logits to
    /// the host (top-k/top-p rows only), sampling with the sampled tokens' log-probs.
    secs: [f64; 5],
}

impl StepProfile {
    fn report(&self) -> String {
        const NAMES: [&str; 5] = ["schedule", "forward", "lm_head", "to_host", "sample"];
        let total: f64 = self.secs.iter().sum();
        let parts: Vec<String> = NAMES
            .iter()
            .zip(self.secs)
            .map(|(n, s)| {
                format!(
                    "{n} {:.1} ms/step ({:.0}%)",
                    1e3 * s / self.steps.max(1) as f64,
                    100.0 * s / total.max(1e-12)
                )
            })
            .collect();
        format!(
            "ENGINE PROFILE: {} steps, {} tokens in, {} sampled, {:.2} s, {:.0} sampled tokens/s; {}",
            self.steps,
            self.tokens,
            self.sampled,
            total,
            self.sampled as f64 / total.max(1e-12),
            parts.join(", ")
        )
    }
}

/// One request in flight.
struct Seq {
    /// The request's seed (its own, or drawn from the engine's generator): the device sampler's
    /// noise is a function of it and the token index.
    seed: u64,
    rng: Rng,
    token_ids: Vec<u32>,
    logprobs: Vec<f32>,
    finish: Option<FinishReason>,
}

impl RolloutEngine for EmbeddedEngine {
    fn generate(&self, requests: &[GenRequest]) -> Result<Vec<GenOutput>> {
        self.generate_with(requests, &GenControl::default())
    }

    /// Checks `control` before every step: once aborted, every unfinished request ends with the
    /// tokens it has and `Abort` (requests never admitted come back empty).
    fn generate_with(&self, requests: &[GenRequest], control: &GenControl) -> Result<Vec<GenOutput>> {
        let model = self.read()?;
        let cfg = model.config();
        for (i, r) in requests.iter().enumerate() {
            validate_request(i, r, cfg)?;
        }
        let mut cache = model.new_kv_cache();
        cache.set_max_tokens(self.opts.kv_cache_tokens);
        if let Some(cap) = cache.max_tokens() {
            use vime_qwen3::infer::PAGE;
            // Whole pages, less the graphs' padding page: what one sequence can ever hold.
            let room = cap.saturating_sub(2 * PAGE);
            let most = |r: &GenRequest| (r.prompt_ids.len() + r.params.max_tokens).min(cfg.max_position_embeddings);
            for (i, r) in requests.iter().enumerate() {
                if most(r) > room {
                    bail!(
                        "request {i}: its prompt ({} tokens) and max_tokens ({}) need up to {} tokens of KV \
                         cache, more than the engine's {cap}-token cache can give one sequence ({room}); \
                         raise the cache (vime-serve: --gpu-memory-utilization or --kv-cache-tokens; vime-train: \
                         --rollout-kv-cache-tokens) or lower max_tokens",
                        r.prompt_ids.len(),
                        r.params.max_tokens,
                        most(r)
                    );
                }
            }
            // The pools are allocated once at the limit; a call that can never need it all (every
            // request at its longest, the padding page, one spare) allocates only that.
            let demand: usize = requests.iter().map(|r| most(r).div_ceil(PAGE) * PAGE).sum::<usize>() + 2 * PAGE;
            cache.set_max_tokens(Some(cap.min(demand)));
        }
        let mut seqs: Vec<Seq> = {
            let mut engine_rng = self
                .rng
                .lock()
                .map_err(|_| anyhow!("the engine's generator lock is poisoned"))?;
            requests
                .iter()
                .map(|r| {
                    let seed = r.params.seed.unwrap_or_else(|| engine_rng.next_u64());
                    Seq {
                        seed,
                        rng: Rng::new(seed),
                        token_ids: Vec::with_capacity(r.params.max_tokens.min(4096)),
                        logprobs: Vec::with_capacity(r.params.max_tokens.min(4096)),
                        finish: None,
                    }
                })
                .collect()
        };
        let lm_head = model.lm_head();
        let kernels = model.block_ctx().kernels.clone();
        // Decode steps through captured CUDA graphs (`VIME_CUDA_GRAPHS=0`: off); prefill and
        // mixed steps, and every step off CUDA, run the plain forward.
        let mut graphs = DecodeGraphs::from_env();
        let use_graphs = self.opts.cuda_graphs && graphs.enabled() && model.graph_safe();
        let fused = if use_graphs { self.fused_weights(&model)? } else { None };
        let mut waiting: VecDeque<usize> = (0..requests.len()).collect();
        // Requests with a sampled token still to feed, in admission order; the slot id is the
        // request index.
        let mut running: Vec<usize> = Vec::new();
        // Sequences preempted for KV room (each recomputed once admitted again).
        let mut preempted = 0usize;
        // `VIME_ENGINE_PROFILE=1`: where a generate call's time goes, per phase (each phase ends
        // with a device sync, which itself costs a little), printed to stderr at the end.
        let mut profile = std::env::var_os("VIME_ENGINE_PROFILE").map(|_| StepProfile::default());
        let mut mark = std::time::Instant::now();
        let mut phase = |p: &mut Option<StepProfile>, slot: usize| -> Result<()> {
            if let Some(p) = p {
                model.device().synchronize()?;
                let now = std::time::Instant::now();
                p.secs[slot] += (now - mark).as_secs_f64();
                mark = now;
            }
            Ok(())
        };
        loop {
            if control.is_aborted() {
                for s in seqs.iter_mut().filter(|s| s.finish.is_none()) {
                    s.finish = Some(FinishReason::Abort);
                }
                break;
            }
            // KV room: every running sequence needs a row for its next token; when the cache
            // cannot give them all one, preempt the most recently admitted (free its rows, put it
            // first in line, recompute it from prompt + generated tokens when it is admitted
            // again: vLLM's preemption by recompute).
            let mut room = cache.available_pages();
            loop {
                let need: usize = running
                    .iter()
                    .map(|&i| cache.pages_short(i, cache.seq_len(i) + 1))
                    .sum();
                if need <= room {
                    room -= need;
                    break;
                }
                let Some(i) = running.pop() else { break };
                if running.is_empty() {
                    bail!(
                        "internal: the KV cache ({:?} tokens) cannot hold request {i} alone at {} tokens",
                        cache.max_tokens(),
                        cache.seq_len(i) + 1
                    );
                }
                cache.free(i);
                waiting.push_front(i);
                preempted += 1;
                room = cache.available_pages();
            }
            // A waiting request's input: its prompt, then (after a preemption) its tokens so far.
            let input_len = |i: usize| requests[i].prompt_ids.len() + seqs[i].token_ids.len();
            let mut budget = self.opts.max_num_batched_tokens.saturating_sub(running.len());
            let mut admitted = Vec::new();
            while running.len() + admitted.len() < self.opts.max_num_seqs {
                let Some(&i) = waiting.front() else { break };
                let n = input_len(i);
                let first = running.is_empty() && admitted.is_empty();
                if n > budget && !first {
                    break;
                }
                let pages = cache.pages_short(i, n);
                if pages > room {
                    break;
                }
                room -= pages;
                budget = budget.saturating_sub(n);
                admitted.push(i);
                waiting.pop_front();
            }
            let order: Vec<usize> = running.iter().chain(&admitted).copied().collect();
            if order.is_empty() {
                if waiting.is_empty() {
                    break;
                }
                bail!(
                    "internal: request {} waits for {} tokens of KV cache and nothing runs",
                    waiting[0],
                    input_len(waiting[0])
                );
            }
            let recompute: BTreeMap<usize, Vec<u32>> = admitted
                .iter()
                .filter(|&&i| !seqs[i].token_ids.is_empty())
                .map(|&i| (i, [requests[i].prompt_ids.as_slice(), &seqs[i].token_ids].concat()))
                .collect();
            let inputs: Vec<(usize, &[u32])> = order
                .iter()
                .map(|&i| match (recompute.get(&i), seqs[i].token_ids.last()) {
                    (Some(all), _) => (i, all.as_slice()),
                    (None, Some(_)) => (i, &seqs[i].token_ids[seqs[i].token_ids.len() - 1..]),
                    (None, None) => (i, requests[i].prompt_ids.as_slice()),
                })
                .collect();
            if let Some(p) = &mut profile {
                p.steps += 1;
                p.tokens += inputs.iter().map(|(_, t)| t.len()).sum::<usize>();
                p.sampled += inputs.len();
            }
            phase(&mut profile, 0)?;
            let hidden = if use_graphs && inputs.iter().all(|(_, t)| t.len() == 1) {
                // A decode step: one CUDA graph launch per step once captured.
                let steps: Vec<(usize, u32)> = inputs.iter().map(|&(i, t)| (i, t[0])).collect();
                model.decode_graphed(&steps, &mut cache, &mut graphs, fused.as_ref())?
            } else {
                model.forward_with_cache(&inputs, &mut cache, HiddenRows::Last)?
            };
            phase(&mut profile, 1)?;
            // The LM head once: f32 logits (never rounded to bf16), sampled and scored from the
            // same values (`--true-on-policy-mode` scores them again below, the trainer's way).
            let logits = vime_kernels::lm_head::logits_f32_with(&hidden, &lm_head, &kernels)?;
            phase(&mut profile, 2)?;
            // Plain temperature sampling (and greedy) on the logits' device, one token and its
            // log-prob per row back; rows with top-k or top-p go to the host sampler.
            let plain = |i: usize| requests[i].params.is_plain(cfg.vocab_size);
            let (mut sampled, mut lp): (Vec<u32>, Vec<f32>) = if order.iter().any(|&i| plain(i)) {
                let seeds: Vec<u64> = order.iter().map(|&i| seqs[i].seed).collect();
                let counters: Vec<u64> = order.iter().map(|&i| seqs[i].token_ids.len() as u64).collect();
                let inv_t: Vec<f32> = order
                    .iter()
                    .map(|&i| requests[i].params.inverse_temperature())
                    .collect();
                if kernels.batch_invariant() {
                    // Scored below, by the trainer's kernel.
                    let toks = vime_kernels::sample::sample_gumbel(&logits, &seeds, &counters, &inv_t)?;
                    (toks, vec![0.0; order.len()])
                } else {
                    vime_kernels::sample::sample_gumbel_logprobs(&logits, &seeds, &counters, &inv_t)?
                }
            } else {
                (vec![0; order.len()], vec![0.0; order.len()])
            };
            let host: Vec<usize> = (0..order.len()).filter(|&r| !plain(order[r])).collect();
            if !host.is_empty() {
                let idx: Vec<u32> = host.iter().map(|&r| r as u32).collect();
                let rows = logits
                    .index_select(&Tensor::from_vec(idx, host.len(), logits.device())?, 0)?
                    .to_vec2::<f32>()?;
                phase(&mut profile, 3)?;
                for (&r, row) in host.iter().zip(&rows) {
                    let i = order[r];
                    sampled[r] = sample_token(row, &requests[i].params, &mut seqs[i].rng);
                    if !kernels.batch_invariant() {
                        lp[r] = vime_kernels::sample::raw_logprob(row, sampled[r]);
                    }
                }
            }
            if kernels.batch_invariant() {
                // `--true-on-policy-mode`: each token's log-prob by the trainer's own LM-head
                // kernel on the same hidden rows (the logits GEMM again, batch-invariant), so it
                // is the trainer's number bit for bit, not the sampler's equal-in-exact-math one.
                let targets: Arc<[u32]> = sampled.clone().into();
                let rows = targets.len().max(1);
                lp = vime_kernels::logprobs_entropy_with(&hidden, &lm_head, &targets, rows, &kernels)?
                    .0
                    .to_vec1::<f32>()?;
            }
            phase(&mut profile, 4)?;
            running.clear();
            for ((&i, &tok), &lp) in order.iter().zip(sampled.iter()).zip(&lp) {
                let (r, s) = (&requests[i], &mut seqs[i]);
                s.token_ids.push(tok);
                s.logprobs.push(lp);
                s.finish = if r.params.stop_token_ids.contains(&tok) || self.opts.eos_token_ids.contains(&tok) {
                    Some(FinishReason::Stop)
                } else if s.token_ids.len() >= r.params.max_tokens
                    || r.prompt_ids.len() + s.token_ids.len() >= cfg.max_position_embeddings
                {
                    Some(FinishReason::Length)
                } else {
                    None
                };
                if s.finish.is_some() {
                    cache.free(i);
                } else {
                    running.push(i);
                }
            }
            control.step_done();
        }
        phase(&mut profile, 0)?;
        if preempted > 0 {
            self.preemptions.fetch_add(preempted as u64, Ordering::Relaxed);
            eprintln!(
                "vime: the engine's KV cache ({} tokens) ran full: {preempted} preemptions, each sequence recomputed \
                 from its prompt and tokens when admitted again (vime-serve's --gpu-memory-utilization or \
                 --kv-cache-tokens, vime-train's --rollout-kv-cache-tokens give it more room)",
                cache.max_tokens().unwrap_or(0)
            );
        }
        if let Some(p) = &profile {
            let g = graphs.stats;
            eprintln!(
                "{}; decode graphs: {} captured, {} replays, {} eager",
                p.report(),
                g.captures,
                g.replays,
                g.eager
            );
        }
        Ok(seqs
            .into_iter()
            .map(|s| GenOutput {
                token_ids: s.token_ids,
                logprobs: s.logprobs,
                finish_reason: s.finish.expect("every request runs until it finishes"),
            })
            .collect())
    }

    fn update_weights_from_dir(&self, dir: &Path) -> Result<()> {
        let (cfg, dtype, device) = {
            let m = self.read()?;
            (m.config().clone(), m.dtype(), m.device().clone())
        };
        let tensors = load_hf_weights(dir, &cfg, dtype, &device).context("updating the engine's weights")?;
        if dir.join("config.json").is_file() {
            let new = load_config(dir)?;
            check_same_architecture(&cfg, &new).with_context(|| format!("updating weights from {}", dir.display()))?;
        }
        self.set_weights(tensors)
    }

    fn weight_version(&self) -> u64 {
        self.weight_version.load(Ordering::SeqCst)
    }

    fn weight_sink(&self) -> Option<&dyn vime_sync::WeightSink> {
        Some(self)
    }

    fn offload_weights(&self) -> Result<()> {
        let mut home = self
            .home
            .lock()
            .map_err(|_| anyhow!("the engine's home lock is poisoned"))?;
        let mut model = self
            .model
            .write()
            .map_err(|_| anyhow!("the engine's model lock is poisoned"))?;
        let device = model.device().clone();
        if home.is_some() || device.is_cpu() {
            return Ok(());
        }
        *model = moved(&model, &Device::Cpu).context("offloading the engine's weights to the host")?;
        *self
            .fused
            .lock()
            .map_err(|_| anyhow!("the engine's fused-weights lock is poisoned"))? = None;
        device.synchronize()?;
        *home = Some(device);
        Ok(())
    }

    fn restore_weights(&self) -> Result<()> {
        let mut home = self
            .home
            .lock()
            .map_err(|_| anyhow!("the engine's home lock is poisoned"))?;
        let Some(device) = home.clone() else {
            return Ok(());
        };
        let mut model = self
            .model
            .write()
            .map_err(|_| anyhow!("the engine's model lock is poisoned"))?;
        *model = moved(&model, &device).context("restoring the engine's weights to the device")?;
        *home = None;
        Ok(())
    }

    fn weight_checksums(&self) -> Result<BTreeMap<String, u64>> {
        let model = self.read()?;
        model
            .named_parameters()
            .iter()
            .map(|(n, v)| Ok((n.clone(), vime_sync::pack::checksum(v.as_tensor())?)))
            .collect()
    }
}

/// The same model with its weights on `device` (fresh buffers; the old model's are freed when it
/// drops).
fn moved(m: &Qwen3, device: &Device) -> Result<Qwen3> {
    let tensors = m
        .state_dict()
        .into_iter()
        .map(|(n, t)| Ok((n, t.to_device(device)?)))
        .collect::<Result<BTreeMap<_, _>>>()?;
    let mut out = Qwen3::from_tensors(m.config().clone(), tensors)?;
    out.set_kernel_config(m.kernel_config().clone());
    Ok(out)
}

/// A streamed sync writes a bucket at a time: names and shapes are checked against the model
/// before anything is written, then the parameters are set under the write lock. The weight
/// version is bumped by [`EmbeddedEngine::finish_weight_update`], once per sync.
impl vime_sync::WeightSink for EmbeddedEngine {
    fn device(&self) -> Device {
        self.read().map(|m| m.device().clone()).unwrap_or(Device::Cpu)
    }

    fn load(&self, tensors: Vec<(String, Tensor)>) -> Result<()> {
        let model = self
            .model
            .write()
            .map_err(|_| anyhow!("the engine's model lock is poisoned"))?;
        let (dtype, device) = (model.dtype(), model.device().clone());
        let vars: BTreeMap<&str, &candle_core::Var> =
            model.named_parameters().iter().map(|(n, v)| (n.as_str(), v)).collect();
        let mut ready = Vec::with_capacity(tensors.len());
        for (name, t) in &tensors {
            let var = vars
                .get(name.as_str())
                .ok_or_else(|| anyhow!("unexpected tensor {name} {:?}: not a parameter of this model", t.dims()))?;
            if var.dims() != t.dims() {
                bail!(
                    "tensor {name}: the engine's parameter has shape {:?}, received {:?}",
                    var.dims(),
                    t.dims()
                );
            }
            let t = if t.dtype() == dtype && t.device().same_device(&device) {
                t.copy()?
            } else {
                t.to_device(&device)?.to_dtype(dtype)?
            };
            ready.push((*var, t.contiguous()?, name));
        }
        for (var, t, name) in ready {
            var.set(&t).with_context(|| format!("setting {name} {:?}", t.dims()))?;
        }
        Ok(())
    }

    fn with_targets(&self, names: &[String], dtype: DType, f: &mut dyn FnMut(&[Tensor]) -> Result<()>) -> Result<bool> {
        let model = self
            .model
            .write()
            .map_err(|_| anyhow!("the engine's model lock is poisoned"))?;
        if model.dtype() != dtype {
            return Ok(false);
        }
        let vars: BTreeMap<&str, &candle_core::Var> =
            model.named_parameters().iter().map(|(n, v)| (n.as_str(), v)).collect();
        let targets = names
            .iter()
            .map(|n| {
                vars.get(n.as_str())
                    .map(|v| v.as_tensor().clone())
                    .ok_or_else(|| anyhow!("unexpected tensor {n}: not a parameter of this model"))
            })
            .collect::<Result<Vec<_>>>()?;
        f(&targets)?;
        Ok(true)
    }

    fn finished(&self) {
        self.finish_weight_update();
    }
}

impl EmbeddedEngine {
    /// Ends a streamed sync: one new weight version.
    pub fn finish_weight_update(&self) -> u64 {
        self.weight_version.fetch_add(1, Ordering::SeqCst) + 1
    }
}

/// Samples one token from `logits` (`[vocab]`, the raw model output) as vLLM does with
/// `params` (see the module docs), drawing one uniform from `rng` unless greedy.
pub fn sample_token(logits: &[f32], params: &SamplingParams, rng: &mut Rng) -> u32 {
    if params.temperature < SAMPLING_EPS {
        return argmax(logits);
    }
    let v = logits.len();
    let inv_t = 1.0 / params.temperature;
    // Candidates (scaled logit, id); top-k keeps every token tied with the k-th largest.
    let mut cand: Vec<(f64, u32)> = match usize::try_from(params.top_k) {
        Ok(k) if k > 0 && k < v => {
            let mut sorted: Vec<f32> = logits.to_vec();
            let (_, kth, _) = sorted.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
            let kth = *kth;
            logits
                .iter()
                .enumerate()
                .filter(|(_, &z)| z >= kth)
                .map(|(i, &z)| (z as f64 * inv_t, i as u32))
                .collect()
        }
        _ => logits
            .iter()
            .enumerate()
            .map(|(i, &z)| (z as f64 * inv_t, i as u32))
            .collect(),
    };
    let m = cand.iter().map(|c| c.0).fold(f64::NEG_INFINITY, f64::max);
    for c in cand.iter_mut() {
        c.0 = (c.0 - m).exp();
    }
    let total: f64 = cand.iter().map(|c| c.0).sum();
    let mut mass = total;
    if params.top_p < 1.0 {
        cand.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let (mut before, mut keep) = (0.0, 0);
        for c in &cand {
            if keep > 0 && before >= params.top_p * total {
                break;
            }
            before += c.0;
            keep += 1;
        }
        cand.truncate(keep);
        mass = before;
    }
    let u = rng.uniform() * mass;
    let mut acc = 0.0;
    for c in &cand {
        acc += c.0;
        if u < acc {
            return c.1;
        }
    }
    cand.last().map_or(0, |c| c.1)
}

/// Index of the first maximum (NaN never wins).
fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &z) in x.iter().enumerate() {
        if z > x[best] || x[best].is_nan() {
            best = i;
        }
    }
    best as u32
}
