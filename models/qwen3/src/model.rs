//! The Qwen3 dense model for training: a pure forward over a packed varlen batch, and a
//! layer-by-layer backward whose activation memory is set by a [`Recompute`] policy.
//!
//! Decisions:
//! - Layers hold parameters (candle `Var`s) and nothing else: no KV cache, no communicators. The
//!   batch metadata (`position_ids`, `cu_seqlens`, targets) is passed in per call; the kernel
//!   choice ([`KernelConfig`]) is a value the model holds and hands to its blocks.
//! - q/k/v and gate/up stay separate weights, exactly the HF tensors, so tensor parallelism can
//!   shard them column-wise later without re-fusing, and checkpoints map 1:1.
//! - The decoder layer exists once, `crate::block` (explicit forward and backward over local
//!   shapes); this file walks the blocks: forward keeping each block's saved activations
//!   (`Recompute::None`) or only its input (`Recompute::Full`, the block re-runs before its
//!   backward), then the head, then the blocks in reverse, then the embedding.
//! - The head: the LM head runs explicitly too (`logprobs_entropy_saved` and its backward, candle's
//!   autograd only over the caller's loss from two `[T]` leaves); a head of the caller's own
//!   (`forward_backward_with_head`, e.g. a value head) runs under autograd from the final hidden
//!   states.
//! - Log-probs and entropy come from the fused LM-head op, chunked over tokens: `[T, vocab]`
//!   logits are never alive at once (the plain [`Qwen3::logits`] path exists for tests).
//! - candle's autograd over the same layer survives only as `crate::reference`, the test
//!   reference (`set_explicit_backward(false)`).
use crate::batch::PackedBatch;
/// Adds a gradient to a map of gradients (or running sums) by name, in the sum's dtype.
pub use crate::block::put as add_gradient;
use crate::block::{Attention, Block, BlockCtx, Keep, Kept, KeptAttention, Saved};
use crate::checkpoint;
use crate::config::Qwen3Config;
use crate::context_parallel::CpShard;
use crate::state_dict::param_specs;
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{backprop::GradStore, DType, Device, Tensor, Var};
use std::collections::BTreeMap;
use std::path::Path;
use vime_dist::{Collectives, ReduceOp, SingleRank};
use vime_kernels::{
    logprobs_entropy_backward, logprobs_entropy_backward_into, logprobs_entropy_saved_with, logprobs_entropy_with,
    rms_norm, rms_norm_backward, KernelConfig,
};

/// Which activations a layer keeps between its forward and its backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Recompute {
    /// Keep every layer's activations from the forward: fastest, most memory.
    #[default]
    None,
    /// Keep only each layer's input; re-run the layer just before its backward (Megatron's
    /// `--recompute-granularity full --recompute-method uniform --recompute-num-layers 1`).
    Full,
    /// Megatron's other full-recompute layouts, and whether recomputed layers keep attention.
    Layers(RecomputeLayers),
}

/// Which layers recompute (Megatron's `--recompute-method` and `--recompute-num-layers`), and
/// whether they keep their attention output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecomputeLayers {
    pub method: RecomputeMethod,
    /// `uniform`: the size of each group; `block`: how many layers recompute.
    pub num_layers: usize,
    /// Recomputed layers keep their attention output and its log-sum-exp (on CUDA; the composed
    /// op's graph on CPU), so their re-run skips the attention kernel and, under context
    /// parallelism, the K/V gather. At Qwen3-4B this is `T x 4096` bf16 per layer (9 GiB for 36
    /// layers at 32k tokens), and saves a third of the attention FLOPs of a step.
    pub keep_attention: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecomputeMethod {
    /// The layers in consecutive groups of `num_layers`: each group keeps only its input and
    /// re-runs as a whole before its backward (the last group may be shorter).
    Uniform,
    /// The first `num_layers` layers keep only their input and re-run one by one; the others
    /// keep everything.
    Block,
}

/// Per layer: `None` keeps everything, `Some(s)` recomputes from the input of layer `s` (the
/// first of its group).
type RecomputePlan = Vec<Option<usize>>;

impl Recompute {
    /// The layout as [`RecomputeLayers`] (`None`: nothing recomputes).
    pub fn layers(self) -> Option<RecomputeLayers> {
        match self {
            Recompute::None => None,
            Recompute::Full => Some(RecomputeLayers {
                method: RecomputeMethod::Uniform,
                num_layers: 1,
                keep_attention: false,
            }),
            Recompute::Layers(l) => Some(l),
        }
    }

    fn keeps_attention(self) -> bool {
        self.layers().is_some_and(|l| l.keep_attention)
    }

    fn plan(self, layers: usize) -> Result<RecomputePlan> {
        let Some(l) = self.layers() else {
            return Ok(vec![None; layers]);
        };
        if l.num_layers == 0 {
            bail!("the recompute layer count must be at least 1");
        }
        Ok((0..layers)
            .map(|i| match l.method {
                RecomputeMethod::Uniform => Some(i - i % l.num_layers),
                RecomputeMethod::Block => (i < l.num_layers).then_some(i),
            })
            .collect())
    }
}

impl std::fmt::Display for Recompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.layers() {
            None => write!(f, "none"),
            Some(l) => {
                match (l.method, l.num_layers) {
                    (RecomputeMethod::Uniform, 1) => write!(f, "full")?,
                    (RecomputeMethod::Uniform, n) => write!(f, "uniform:{n}")?,
                    (RecomputeMethod::Block, n) => write!(f, "block:{n}")?,
                }
                if l.keep_attention {
                    write!(f, ",keep-attention")?;
                }
                Ok(())
            }
        }
    }
}

/// `none`, `full`, `uniform:N` or `block:N`, optionally followed by `,keep-attention`
/// (`full,keep-attention`). The inverse of `Display`.
impl std::str::FromStr for Recompute {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        let expected = "expected none, full, uniform:N or block:N, optionally followed by ,keep-attention";
        let (layout, keep_attention) = match s.split_once(',') {
            Some((l, "keep-attention")) => (l, true),
            Some((_, other)) => bail!("unknown recompute option {other:?} in {s:?} ({expected})"),
            None => (s, false),
        };
        let count = |n: &str| -> Result<usize> {
            match n.parse::<usize>() {
                Ok(n) if n > 0 => Ok(n),
                _ => bail!("the recompute layer count in {s:?} must be a positive integer"),
            }
        };
        let (method, num_layers) = match layout.split_once(':') {
            None if layout == "none" && !keep_attention => return Ok(Recompute::None),
            None if layout == "none" => bail!("{s:?}: keep-attention needs a recomputing layout"),
            None if layout == "full" => (RecomputeMethod::Uniform, 1),
            Some(("uniform", n)) => (RecomputeMethod::Uniform, count(n)?),
            Some(("block", n)) => (RecomputeMethod::Block, count(n)?),
            _ => bail!("unknown recompute policy {s:?} ({expected})"),
        };
        Ok(Recompute::from_layers(RecomputeLayers {
            method,
            num_layers,
            keep_attention,
        }))
    }
}

impl Recompute {
    /// `l` as a policy, `Full` where it is `uniform:1` without kept attention.
    pub fn from_layers(l: RecomputeLayers) -> Self {
        match l {
            RecomputeLayers {
                method: RecomputeMethod::Uniform,
                num_layers: 1,
                keep_attention: false,
            } => Recompute::Full,
            l => Recompute::Layers(l),
        }
    }
}

/// Per-token outputs of the LM head, both `[T]` f32. Index `i` is about predicting the token at
/// `i + 1` of the same sequence; at each sequence's last token the log-prob is 0 (no target) and
/// the entropy is that of the distribution after the whole sequence.
#[derive(Debug, Clone)]
pub struct TokenOutputs {
    pub logprobs: Tensor,
    pub entropy: Tensor,
}

/// Gradients of one backward: model parameters by HF name, plus whatever the head closure's own
/// variables received (for heads that live outside the model, e.g. a value head).
#[derive(Debug)]
pub struct Gradients {
    pub params: BTreeMap<String, Tensor>,
    pub head: GradStore,
}

/// Delayed FP8 scaling's amax histories on the host ([`Qwen3::fp8_amax_state`]): the settings,
/// the rows (f32 `[roles, 2 + history_len]`, see `vime_kernels::fp8::AmaxHistory`) and which
/// roles have a history yet.
#[derive(Debug, Clone, PartialEq)]
pub struct Fp8AmaxState {
    pub config: vime_kernels::fp8::DelayedScaling,
    pub rows: Vec<f32>,
    pub seeded: Vec<bool>,
}

pub struct Qwen3 {
    cfg: Qwen3Config,
    pub(crate) embed: Var,
    pub(crate) blocks: Vec<Block>,
    pub(crate) norm: Var,
    /// `None` when the LM head is tied to the embedding.
    lm_head: Option<Var>,
    /// Every parameter by HF name, in the canonical `param_specs` order.
    params: Vec<(String, Var)>,
    /// Tokens per LM-head chunk (bounds the live logits block to `chunk x vocab` f32).
    logits_chunk_tokens: usize,
    /// Tokens per query chunk of a forward-only pass (see `Block::forward_chunked`).
    forward_chunk_tokens: usize,
    /// The blocks' local dims and kernel choice.
    ctx: BlockCtx,
    /// This model's tensor-parallel rank and size (its tensors are that rank's shards).
    tp: TpPlace,
    /// `false` switches `forward_backward*` to the test reference (`crate::reference`).
    explicit_backward: bool,
}

/// The layout table of `cfg`'s parameters at TP place `tp` (dtype and weight decay unused here).
fn layout_table(cfg: &Qwen3Config, tp: TpPlace) -> Result<vime_dist::layout::LayoutTable> {
    vime_dist::layout::LayoutTable::new(
        param_specs(cfg)
            .into_iter()
            .map(|s| vime_dist::layout::LayoutEntry::new(s.name, &s.shape, DType::F32, false, s.placement))
            .collect(),
        tp.rank,
        tp.size,
    )
}

/// A vocab-parallel embedding lookup's local ids (0 where another rank holds the id) and the 0/1
/// mask of the rows this rank looked up, `[T, 1]`.
struct EmbedLocal {
    ids: Vec<u32>,
    mask: Tensor,
}

/// Where a model's shards sit in tensor parallelism: rank `rank` of `size` (0 of 1 unsharded).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpPlace {
    pub rank: usize,
    pub size: usize,
}

impl Default for TpPlace {
    fn default() -> Self {
        Self { rank: 0, size: 1 }
    }
}

/// Weights as plain tensors: tracked (part of the autograd graph) or detached (no graph at all).
pub(crate) fn w(v: &Var, track: bool) -> Tensor {
    if track {
        v.as_tensor().clone()
    } else {
        v.as_detached_tensor()
    }
}

impl Qwen3 {
    /// Builds the model from HF-named tensors (as `checkpoint::load_hf_weights` returns them).
    pub fn from_tensors(cfg: Qwen3Config, tensors: BTreeMap<String, Tensor>) -> Result<Self> {
        Self::from_shards(cfg, tensors, TpPlace::default())
    }

    /// The shard of tensor-parallel rank `tp.rank` of `tp.size` from its local tensors (HF names,
    /// Megatron's split of each: `vime_dist::layout`, e.g. `LayoutTable::local_shard` of the
    /// global ones). Its training and scoring methods take that rank's TP group.
    pub fn from_shards(cfg: Qwen3Config, mut tensors: BTreeMap<String, Tensor>, tp: TpPlace) -> Result<Self> {
        cfg.validate()?;
        let ctx = BlockCtx::sharded(&cfg, KernelConfig::default(), tp.size)?;
        crate::vocab_parallel::VocabShard::new(cfg.vocab_size, tp.rank, tp.size)?;
        let table = layout_table(&cfg, tp)?;
        let mut params = Vec::new();
        for p in table.entries() {
            let name = &p.entry.name;
            let t = tensors.remove(name).ok_or_else(|| anyhow!("missing tensor {name}"))?;
            if t.dims() != p.local_shape.as_slice() {
                bail!(
                    "tensor {name}: expected shape {:?}{}, found {:?}",
                    p.local_shape,
                    if tp.size > 1 {
                        format!(" (TP rank {} of {})", tp.rank, tp.size)
                    } else {
                        String::new()
                    },
                    t.dims()
                );
            }
            params.push((name.clone(), Var::from_tensor(&t.contiguous()?)?));
        }
        if let Some(extra) = tensors.keys().next() {
            bail!("unexpected tensor {extra} for this config");
        }
        let by_name: BTreeMap<&str, &Var> = params.iter().map(|(n, v)| (n.as_str(), v)).collect();
        let get = |n: &str| -> Result<Var> {
            by_name
                .get(n)
                .map(|v| (*v).clone())
                .ok_or_else(|| anyhow!("missing tensor {n}"))
        };
        let opt = |n: &str| by_name.get(n).map(|v| (*v).clone());
        let blocks = (0..cfg.num_hidden_layers)
            .map(|i| {
                let p = |s: &str| format!("model.layers.{i}.{s}");
                Ok(Block {
                    index: i,
                    input_norm: get(&p("input_layernorm.weight"))?,
                    q_proj: get(&p("self_attn.q_proj.weight"))?,
                    k_proj: get(&p("self_attn.k_proj.weight"))?,
                    v_proj: get(&p("self_attn.v_proj.weight"))?,
                    o_proj: get(&p("self_attn.o_proj.weight"))?,
                    q_bias: opt(&p("self_attn.q_proj.bias")),
                    k_bias: opt(&p("self_attn.k_proj.bias")),
                    v_bias: opt(&p("self_attn.v_proj.bias")),
                    o_bias: opt(&p("self_attn.o_proj.bias")),
                    q_norm: get(&p("self_attn.q_norm.weight"))?,
                    k_norm: get(&p("self_attn.k_norm.weight"))?,
                    post_norm: get(&p("post_attention_layernorm.weight"))?,
                    gate_proj: get(&p("mlp.gate_proj.weight"))?,
                    up_proj: get(&p("mlp.up_proj.weight"))?,
                    down_proj: get(&p("mlp.down_proj.weight"))?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let embed = get("model.embed_tokens.weight")?;
        let norm = get("model.norm.weight")?;
        let lm_head = if cfg.tie_word_embeddings {
            None
        } else {
            Some(get("lm_head.weight")?)
        };
        // CPU: about 2^26 logits per chunk. The fused CUDA LM head (bf16) also splits the
        // vocabulary (kernels/src/cuda.rs), so its token chunks can be large.
        let logits_chunk_tokens = if vime_kernels::fused_cuda(embed.device(), embed.dtype()) {
            4096
        } else {
            ((1usize << 26) / cfg.vocab_size.max(1)).clamp(16, 4096)
        };
        Ok(Self {
            cfg,
            embed,
            blocks,
            norm,
            lm_head,
            params,
            logits_chunk_tokens,
            forward_chunk_tokens: 8192,
            ctx,
            tp,
            explicit_backward: true,
        })
    }

    /// A randomly initialised model (weights `N(0, std^2)` from a seeded generator, norm weights 1,
    /// biases 0), for benchmarks and tests that need no checkpoint.
    pub fn init_random(cfg: Qwen3Config, std: f64, seed: u64, dtype: DType, device: &Device) -> Result<Self> {
        let mut rng = vime_kernels::testing::Rng::new(seed);
        let mut tensors = BTreeMap::new();
        for spec in param_specs(&cfg) {
            let t = if spec.name.ends_with(".bias") {
                Tensor::zeros(spec.shape.as_slice(), dtype, device)?
            } else if spec.shape.len() == 1 {
                Tensor::ones(spec.shape.as_slice(), dtype, device)?
            } else {
                rng.randn(&spec.shape, std, dtype, device)?
            };
            tensors.insert(spec.name, t);
        }
        Self::from_tensors(cfg, tensors)
    }

    /// Loads `config.json` and the safetensors weights of an HF checkpoint directory.
    pub fn load_hf(dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        let cfg = checkpoint::load_config(dir)?;
        let tensors = checkpoint::load_hf_weights(dir, &cfg, dtype, device)
            .with_context(|| format!("loading weights from {}", dir.display()))?;
        Self::from_tensors(cfg, tensors)
    }

    /// Writes the model as an HF checkpoint directory (config.json + safetensors, sharded past
    /// `max_shard_bytes`) that HF transformers and vLLM load directly.
    pub fn save_hf(&self, dir: &Path, dtype: DType, max_shard_bytes: u64) -> Result<()> {
        if self.tp.size > 1 {
            bail!(
                "this model holds TP rank {} of {}'s shards: save it with save_hf_tp and its TP group",
                self.tp.rank,
                self.tp.size
            );
        }
        checkpoint::save_hf_checkpoint(dir, &self.cfg, &self.state_dict(), dtype, max_shard_bytes)
    }

    /// The shard of TP place `tp` of this (unsharded) model: its Megatron split of every
    /// parameter, copied, with this model's kernel settings.
    pub fn shard(&self, tp: TpPlace) -> Result<Self> {
        if self.tp.size != 1 {
            bail!(
                "shard: the model is already TP rank {} of {}",
                self.tp.rank,
                self.tp.size
            );
        }
        let table = layout_table(&self.cfg, tp)?;
        let local = self
            .params
            .iter()
            .map(|(n, v)| Ok((n.clone(), table.local_shard(n, v.as_tensor())?.copy()?)))
            .collect::<Result<BTreeMap<_, _>>>()?;
        let mut m = Self::from_shards(self.cfg.clone(), local, tp)?;
        m.ctx.kernels = self.ctx.kernels.clone();
        m.logits_chunk_tokens = self.logits_chunk_tokens;
        m.forward_chunk_tokens = self.forward_chunk_tokens;
        Ok(m)
    }

    /// Every parameter as the full HF tensor, gathered over the TP group (on every rank; a
    /// collective). At TP = 1, the state dict itself.
    pub fn gathered_state_dict(&self, tp: &dyn Collectives) -> Result<BTreeMap<String, Tensor>> {
        self.check_tp(tp)?;
        if tp.size() == 1 {
            return Ok(self.state_dict());
        }
        let table = self.layout_table()?;
        self.params
            .iter()
            .map(|(n, v)| Ok((n.clone(), table.gather_global(n, &v.as_detached_tensor(), tp)?)))
            .collect()
    }

    /// [`Self::save_hf`] of a tensor-parallel model: the shards are gathered over `tp` and TP rank
    /// 0 writes the checkpoint (the same bytes as the unsharded model's).
    pub fn save_hf_tp(&self, dir: &Path, dtype: DType, max_shard_bytes: u64, tp: &dyn Collectives) -> Result<()> {
        let full = self.gathered_state_dict(tp)?;
        if tp.rank() == 0 {
            checkpoint::save_hf_checkpoint(dir, &self.cfg, &full, dtype, max_shard_bytes)?;
        }
        Ok(())
    }

    /// The layout table of this model's TP place (global shapes, placements, local shapes).
    fn layout_table(&self) -> Result<vime_dist::layout::LayoutTable> {
        layout_table(&self.cfg, self.tp)
    }

    pub fn config(&self) -> &Qwen3Config {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        self.embed.device()
    }

    pub fn dtype(&self) -> DType {
        self.embed.dtype()
    }

    /// Parameters by HF name, in canonical order.
    pub fn named_parameters(&self) -> &[(String, Var)] {
        &self.params
    }

    /// Detached copies (shared storage) of every parameter by HF name.
    pub fn state_dict(&self) -> BTreeMap<String, Tensor> {
        self.params
            .iter()
            .map(|(n, v)| (n.clone(), v.as_detached_tensor()))
            .collect()
    }

    /// Tokens per chunk of the vocab-parallel LM head. On the fused CUDA kernels (bf16), the LM
    /// head's own chunk ([`Self::set_logits_chunk_tokens`]): they also split the vocabulary, so one
    /// `[chunk, 16384]` f32 block is live. Composed of candle ops (CPU, f32), a few f32
    /// `[chunk, V / tp]` temporaries are live at once: at most 2^24 local logits (64 MiB f32) per
    /// chunk, and at most the head's chunk (Qwen3-4B at TP 2: 220 tokens per chunk).
    fn vocab_parallel_chunk(&self) -> usize {
        if vime_kernels::fused_cuda(self.embed.device(), self.embed.dtype()) {
            return self.logits_chunk_tokens;
        }
        let local = (self.cfg.vocab_size / self.tp.size.max(1)).max(1);
        self.logits_chunk_tokens.min(((1usize << 24) / local).clamp(16, 4096))
    }

    /// Tokens per query chunk of a long forward-only pass (scoring) at TP 1 (default 8192).
    pub fn set_forward_chunk_tokens(&mut self, n: usize) {
        self.forward_chunk_tokens = n.max(1);
    }

    pub fn set_logits_chunk_tokens(&mut self, n: usize) {
        self.logits_chunk_tokens = n.max(1);
    }

    /// The kernel choice every block's attention runs with (default: [`KernelConfig::default`]).
    /// Megatron's sequence parallelism for this tensor-parallel shard (`--sequence-parallel`):
    /// the residual stream holds this rank's slice of the tokens between the layers, so a packed
    /// batch's token count must divide by the TP size (pad it). A no-op at TP = 1.
    pub fn set_sequence_parallel(&mut self, on: bool) {
        self.ctx.sequence_parallel = on && self.tp.size > 1;
    }

    /// `--tp-comm-overlap`: overlap the backward's TP reductions with the weight gradients (see
    /// `BlockCtx::comm_overlap`).
    pub fn set_tp_comm_overlap(&mut self, on: bool) {
        self.ctx.comm_overlap = on;
    }

    pub fn sequence_parallel(&self) -> bool {
        self.ctx.sequence_parallel
    }

    pub fn set_kernel_config(&mut self, kernels: KernelConfig) {
        self.ctx.kernels = kernels;
    }

    pub fn kernel_config(&self) -> &KernelConfig {
        &self.ctx.kernels
    }

    /// Runs `f` (the micro-batches of one optimizer step) with each FP8 weight quantized once
    /// instead of at every use (`KernelConfig::fp8`; without FP8 it just runs `f`). The weights
    /// must not change inside `f`; the copies (1 byte a parameter, twice: rows and transpose) are
    /// freed when it returns. A nested call runs inside the outer scope.
    pub fn with_fp8_weight_cache<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        if !self.ctx.kernels.fp8() || !self.ctx.fp8_weights.open() {
            return f();
        }
        struct Close<'a>(&'a crate::block::Fp8WeightCache);
        impl Drop for Close<'_> {
            fn drop(&mut self) {
                self.0.close();
            }
        }
        let _close = Close(&self.ctx.fp8_weights);
        f()
    }

    /// Delayed FP8 scaling's state (`KernelConfig::fp8_delayed`) on the host, `None` before
    /// the first FP8 quantization made it: what a checkpoint saves so that a resumed run scales
    /// as the uninterrupted one (reads the device).
    pub fn fp8_amax_state(&self) -> Result<Option<Fp8AmaxState>> {
        self.ctx.fp8_amax.state()
    }

    /// Restores [`Self::fp8_amax_state`]'s state: an error naming both if it was saved for
    /// another number of layers or another history length.
    pub fn load_fp8_amax_state(&self, state: &Fp8AmaxState) -> Result<()> {
        let slots = self.ctx.fp8_slots();
        if state.seeded.len() != slots {
            bail!(
                "the saved FP8 amax history has {} roles, this model {slots} ({} layers)",
                state.seeded.len(),
                self.ctx.layers
            );
        }
        self.ctx
            .fp8_amax
            .load(state.config, slots, &state.rows, &state.seeded, self.embed.device())
    }

    /// The blocks' context: local dims (today the global ones) and the kernel choice.
    pub fn block_ctx(&self) -> &BlockCtx {
        &self.ctx
    }

    /// Whether `forward_backward*` runs the explicit block backward (`true`, the default and the
    /// training path, on every device and dtype) or the test reference through candle's autograd
    /// over the same forward (`false`; `crate::reference`).
    pub fn explicit_backward(&self) -> bool {
        self.explicit_backward
    }

    /// Switches between the explicit backward and the autograd test reference (see
    /// [`Self::explicit_backward`]). Never fails now that the explicit kernels exist everywhere;
    /// the `Result` stays for the callers.
    pub fn set_explicit_backward(&mut self, on: bool) -> Result<()> {
        self.explicit_backward = on;
        Ok(())
    }

    pub(crate) fn lm_head_weight(&self, track: bool) -> Tensor {
        w(self.lm_head.as_ref().unwrap_or(&self.embed), track)
    }

    /// The gradient name of the LM head's weight (the embedding's when they are tied).
    fn head_grad_name(&self) -> &'static str {
        match self.lm_head {
            Some(_) => "lm_head.weight",
            None => "model.embed_tokens.weight",
        }
    }

    /// The dtype of the gradient sums (f32; f64 for an f64 model).
    fn grad_sum_dtype(&self) -> DType {
        if self.dtype() == DType::F64 {
            DType::F64
        } else {
            DType::F32
        }
    }

    /// The running sums of the parameters whose gradients the explicit backward makes in bf16
    /// (the norms' weights, biases), out of `params`: [`Self::widen_to_sums`] adds this
    /// micro-batch's gradients to them in one launch at the end of the backward, where `put`
    /// would cast and add each as it arrives (226 launches a micro-batch at Qwen3-0.6B). Which
    /// names are held aside only decides where the add happens, never its value.
    fn take_bf16_grad_sums(&self, params: &mut BTreeMap<String, Tensor>) -> BTreeMap<String, Tensor> {
        if !matches!(self.dtype(), DType::BF16 | DType::F16) {
            return BTreeMap::new();
        }
        let names: Vec<String> = params
            .keys()
            .filter(|n| n.ends_with("norm.weight") || n.ends_with(".bias"))
            .cloned()
            .collect();
        names
            .into_iter()
            .filter_map(|n| params.remove(&n).map(|s| (n, s)))
            .collect()
    }

    /// Makes every gradient in `params` a running sum in the sums' dtype: the half-precision
    /// ones widened, with the sums held aside by [`Self::take_bf16_grad_sums`] added, all in one
    /// `vime_kernels::widen_into_sums` (one launch on CUDA); a held sum whose gradient came in
    /// another dtype is added as `put` adds, and one that got no gradient goes back as it was.
    fn widen_to_sums(&self, params: &mut BTreeMap<String, Tensor>, mut held: BTreeMap<String, Tensor>) -> Result<()> {
        let to = self.grad_sum_dtype();
        let names: Vec<String> = params
            .iter()
            .filter(|(_, g)| matches!(g.dtype(), DType::BF16 | DType::F16))
            .map(|(n, _)| n.clone())
            .collect();
        let items: Vec<(Tensor, Option<Tensor>)> = names
            .iter()
            .map(|n| (params.remove(n).expect("listed above"), held.remove(n)))
            .collect();
        let sums = vime_kernels::widen_into_sums(items, to)
            .with_context(|| format!("the gradient sums of {}", names.join(", ")))?;
        params.extend(names.into_iter().zip(sums));
        for (name, sum) in held {
            let s = match params.remove(&name) {
                Some(g) => (&sum + g.to_dtype(sum.dtype())?).with_context(|| format!("the gradient sum of {name}"))?,
                None => sum,
            };
            params.insert(name, s);
        }
        Ok(())
    }

    fn check_batch(&self, batch: &PackedBatch) -> Result<()> {
        let v = self.cfg.vocab_size as u32;
        if let Some((i, &id)) = batch.input_ids.iter().enumerate().find(|(_, &id)| id >= v) {
            bail!("token {id} at packed position {i} is outside the vocabulary ({v} ids)");
        }
        let max_pos = self.cfg.max_position_embeddings;
        if batch.max_seqlen() > max_pos {
            bail!(
                "a sequence of {} tokens exceeds max_position_embeddings {max_pos}",
                batch.max_seqlen()
            );
        }
        Ok(())
    }

    pub(crate) fn embed_tokens(&self, batch: &PackedBatch, track: bool) -> Result<Tensor> {
        if track {
            let ids = Tensor::from_slice(&batch.input_ids, batch.num_tokens(), self.device())?;
            return Ok(w(&self.embed, true).embedding(&ids)?);
        }
        Ok(vime_kernels::rows::gather_rows(
            &w(&self.embed, false),
            &batch.input_ids,
        )?)
    }

    /// This rank's vocabulary slice.
    fn vocab_shard(&self) -> Result<crate::vocab_parallel::VocabShard> {
        Ok(
            crate::vocab_parallel::VocabShard::new(self.cfg.vocab_size, self.tp.rank, self.tp.size)?
                .with_head_logits(self.ctx.kernels.head_logits()),
        )
    }

    /// With sequence parallelism, the batch's tokens must split evenly over the TP ranks.
    fn check_sp(&self, batch: &PackedBatch) -> Result<()> {
        if self.ctx.sequence_parallel && !batch.num_tokens().is_multiple_of(self.tp.size) {
            bail!(
                "sequence parallelism splits the {} tokens of the batch over {} TP ranks: pad the batch to a multiple of {}",
                batch.num_tokens(),
                self.tp.size,
                self.tp.size
            );
        }
        Ok(())
    }

    /// This rank's token slice of `[T, ..]` (sequence parallelism).
    fn sp_slice(&self, t: &Tensor) -> Result<Tensor> {
        let per = t.dim(0)? / self.tp.size;
        Ok(t.narrow(0, self.tp.rank * per, per)?)
    }

    /// Checks that `tp` is the group this model's shards belong to.
    fn check_tp(&self, tp: &dyn Collectives) -> Result<()> {
        if tp.size() != self.tp.size || tp.rank() != self.tp.rank {
            bail!(
                "the model holds the shards of TP rank {} of {}, but the group given is rank {} of {}",
                self.tp.rank,
                self.tp.size,
                tp.rank(),
                tp.size()
            );
        }
        Ok(())
    }

    /// The vocab-parallel embedding: each rank looks up the ids of its slice (zeros for the
    /// others), summed over TP. Also returns the local ids and the 0/1 row mask the backward uses.
    fn embed_tokens_tp(&self, batch: &PackedBatch, tp: &dyn Collectives) -> Result<(Tensor, Option<EmbedLocal>)> {
        if tp.size() == 1 {
            return Ok((self.embed_tokens(batch, false)?, None));
        }
        let shard = self.vocab_shard()?;
        let (local, mask): (Vec<u32>, Vec<f32>) = batch
            .input_ids
            .iter()
            .map(|&id| {
                let id = id as usize;
                if id >= shard.offset && id < shard.offset + shard.len {
                    ((id - shard.offset) as u32, 1.0)
                } else {
                    (0, 0.0)
                }
            })
            .unzip();
        let n = local.len();
        let mask = Tensor::from_vec(mask, (n, 1), self.device())?.to_dtype(self.dtype())?;
        let x = vime_kernels::rows::gather_rows(&w(&self.embed, false), &local)?.broadcast_mul(&mask)?;
        // With sequence parallelism the sum lands on each rank's token slice (a reduce-scatter).
        let x = if self.ctx.sequence_parallel {
            tp.reduce_scatter(&x, ReduceOp::Sum)?
        } else {
            tp.all_reduce(&x, ReduceOp::Sum)?
        };
        Ok((x, Some(EmbedLocal { ids: local, mask })))
    }

    /// One block's forward over a packed batch, no gradient tracking, nothing saved.
    pub(crate) fn block_forward(&self, b: &Block, x: &Tensor, batch: &PackedBatch) -> Result<Tensor> {
        let attention = Attention::Packed {
            cu_seqlens: &batch.cu_seqlens,
        };
        Ok(b.forward(
            &self.ctx,
            x,
            &batch.position_ids,
            &attention,
            Keep::Nothing,
            None,
            &SingleRank::default(),
        )?
        .0)
    }

    /// Final-normed hidden states `[T, hidden]`, no gradient tracking.
    pub fn hidden_states(&self, batch: &PackedBatch) -> Result<Tensor> {
        self.hidden_states_tp(batch, &SingleRank::default())
    }

    /// [`Self::hidden_states`] of a tensor-parallel shard, with its TP group (replicated result).
    pub fn hidden_states_tp(&self, batch: &PackedBatch, tp: &dyn Collectives) -> Result<Tensor> {
        let attention = Attention::Packed {
            cu_seqlens: &batch.cu_seqlens,
        };
        self.hidden_states_with(batch, tp, &attention)
    }

    /// [`Self::hidden_states_tp`] of a CP rank's share of a batch (`shard.batch`'s tokens).
    pub fn hidden_states_cp(&self, shard: &CpShard, tp: &dyn Collectives, cp: &dyn Collectives) -> Result<Tensor> {
        self.check_cp(shard, cp)?;
        self.hidden_states_with(&shard.batch, tp, &Attention::ContextParallel { shard, cp })
    }

    /// [`Self::logprobs_entropy_tp`] of a CP rank's share of a batch, in `shard.batch`'s order.
    pub fn logprobs_entropy_cp(
        &self,
        shard: &CpShard,
        tp: &dyn Collectives,
        cp: &dyn Collectives,
    ) -> Result<TokenOutputs> {
        let h = self.hidden_states_cp(shard, tp, cp)?;
        self.head_logprobs(&h, &shard.batch, tp)
    }

    fn hidden_states_with(
        &self,
        batch: &PackedBatch,
        tp: &dyn Collectives,
        attention: &Attention<'_>,
    ) -> Result<Tensor> {
        self.check_batch(batch)?;
        self.check_tp(tp)?;
        self.check_sp(batch)?;
        let mut x = self.embed_tokens_tp(batch, tp)?.0;
        // A long forward-only pass at TP 1 runs each block in query chunks (see
        // `Block::forward_chunked`): its live activations stay those of a chunk.
        if tp.size() == 1
            && matches!(attention, Attention::Packed { .. })
            && batch.num_tokens() > self.forward_chunk_tokens
        {
            for b in &self.blocks {
                x = b.forward_chunked(
                    &self.ctx,
                    &x,
                    &batch.position_ids,
                    &batch.cu_seqlens,
                    self.forward_chunk_tokens,
                )?;
            }
            return Ok(rms_norm(&x, &w(&self.norm, false), self.cfg.rms_norm_eps)?);
        }
        for b in &self.blocks {
            x = b
                .forward(&self.ctx, &x, &batch.position_ids, attention, Keep::Nothing, None, tp)?
                .0;
        }
        let h = rms_norm(&x, &w(&self.norm, false), self.cfg.rms_norm_eps)?;
        if self.ctx.sequence_parallel {
            return tp.all_gather(&h);
        }
        Ok(h)
    }

    /// Full logits `[T, vocab]` in f32. For tests and small inputs: this is the path that
    /// materialises every logit; training uses [`Self::logprobs_entropy`].
    pub fn logits(&self, batch: &PackedBatch) -> Result<Tensor> {
        let h = self.hidden_states(batch)?.to_dtype(DType::F32)?;
        Ok(h.matmul(&self.lm_head_weight(false).to_dtype(DType::F32)?.t()?)?)
    }

    /// Per-token log-probs of the next token and entropies, no gradient tracking.
    pub fn logprobs_entropy(&self, batch: &PackedBatch) -> Result<TokenOutputs> {
        self.logprobs_entropy_tp(batch, &SingleRank::default())
    }

    /// [`Self::logprobs_entropy`] of a tensor-parallel shard (vocab-parallel LM head); equal on
    /// every rank of `tp`.
    pub fn logprobs_entropy_tp(&self, batch: &PackedBatch, tp: &dyn Collectives) -> Result<TokenOutputs> {
        let h = self.hidden_states_tp(batch, tp)?;
        self.head_logprobs(&h, batch, tp)
    }

    /// The LM head's log-probs and entropy of final-normed hidden states (vocab-parallel under TP).
    fn head_logprobs(&self, h: &Tensor, batch: &PackedBatch, tp: &dyn Collectives) -> Result<TokenOutputs> {
        if tp.size() > 1 {
            let (logprobs, entropy, _) = crate::vocab_parallel::vocab_parallel_logprobs_entropy(
                h,
                &self.lm_head_weight(false),
                &batch.targets,
                &self.vocab_shard()?,
                tp,
                self.vocab_parallel_chunk(),
            )?;
            return Ok(TokenOutputs { logprobs, entropy });
        }
        let (logprobs, entropy) = logprobs_entropy_with(
            h,
            &self.lm_head_weight(false),
            &batch.targets,
            self.logits_chunk_tokens,
            &self.ctx.kernels,
        )?;
        Ok(TokenOutputs { logprobs, entropy })
    }

    /// Forward and backward of `loss_fn(logprobs, entropy)` over the packed batch. Returns the
    /// loss value and the gradient of every parameter (tied embeddings: one gradient, both uses).
    pub fn forward_backward(
        &self,
        batch: &PackedBatch,
        recompute: Recompute,
        loss_fn: impl FnOnce(&TokenOutputs) -> Result<Tensor>,
    ) -> Result<(f64, Gradients)> {
        read_loss(self.forward_backward_impl(
            batch,
            recompute,
            Head::Lm(Box::new(loss_fn)),
            &SingleRank::default(),
            None,
            None,
        ))
    }

    /// [`Self::forward_backward`] of a tensor-parallel shard with its TP group: the loss is the
    /// same on every rank, each rank's gradients are of its own shards (by HF name).
    pub fn forward_backward_tp(
        &self,
        batch: &PackedBatch,
        recompute: Recompute,
        loss_fn: impl FnOnce(&TokenOutputs) -> Result<Tensor>,
        tp: &dyn Collectives,
    ) -> Result<(f64, Gradients)> {
        read_loss(self.forward_backward_impl(batch, recompute, Head::Lm(Box::new(loss_fn)), tp, None, None))
    }

    /// [`Self::forward_backward_tp`] under context parallelism: `shard` is this CP rank's share of
    /// the batch ([`CpShard::new`]), `cp` its CP group. The loss sees this rank's tokens only
    /// (`TokenOutputs` in `shard.batch`'s order), and the gradients are this rank's share: summed
    /// over CP (with a loss that sums over tokens), they are the whole batch's.
    pub fn forward_backward_cp(
        &self,
        shard: &CpShard,
        recompute: Recompute,
        loss_fn: impl FnOnce(&TokenOutputs) -> Result<Tensor>,
        tp: &dyn Collectives,
        cp: &dyn Collectives,
    ) -> Result<(f64, Gradients)> {
        self.check_cp(shard, cp)?;
        read_loss(self.forward_backward_impl(
            &shard.batch,
            recompute,
            Head::Lm(Box::new(loss_fn)),
            tp,
            Some((shard, cp)),
            None,
        ))
    }

    /// [`Self::forward_backward_with_head_tp`] under context parallelism (see
    /// [`Self::forward_backward_cp`]): the head sees this rank's tokens.
    pub fn forward_backward_with_head_cp(
        &self,
        shard: &CpShard,
        recompute: Recompute,
        head: impl FnOnce(&Tensor) -> Result<Tensor>,
        tp: &dyn Collectives,
        cp: &dyn Collectives,
    ) -> Result<(f64, Gradients)> {
        self.check_cp(shard, cp)?;
        read_loss(self.forward_backward_impl(
            &shard.batch,
            recompute,
            Head::Hidden(Box::new(head)),
            tp,
            Some((shard, cp)),
            None,
        ))
    }

    /// Gradient accumulation: [`Self::forward_backward_tp`] (or, with `cp`, `_cp`) whose gradients
    /// are added to `sums`, the running sums of the earlier micro-batches of the step (by HF
    /// name, f32; empty for the first), which come back as `Gradients::params`. Each weight
    /// GEMM of the backward accumulates into its sum in place (Megatron's gradient-accumulation
    /// fusion) instead of writing a fresh gradient that is added after: no add pass, no second
    /// f32 copy of the gradients. The same values as summing `forward_backward_tp`'s results.
    /// Under context parallelism pass this rank's `shard` and the `cp` group: the shard's own
    /// batch is the one run (`batch` is then not read).
    ///
    /// The loss comes back still on the device ([`QueuedLoss`]): nothing here waits for the
    /// device, so the host goes on queuing (the next micro-batch, the optimizer's first kernels)
    /// while the backward runs. Reading it ([`QueuedLoss::read`]) waits.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_backward_into(
        &self,
        batch: &PackedBatch,
        recompute: Recompute,
        loss_fn: impl FnOnce(&TokenOutputs) -> Result<Tensor>,
        tp: &dyn Collectives,
        cp: Option<&dyn Collectives>,
        shard: Option<&CpShard>,
        sums: BTreeMap<String, Tensor>,
    ) -> Result<(QueuedLoss, Gradients)> {
        self.fb_into(batch, recompute, Head::Lm(Box::new(loss_fn)), tp, cp, shard, sums)
    }

    /// [`Self::forward_backward_into`] with a head of the caller's (see
    /// [`Self::forward_backward_with_head`]); the head's own gradients are not in `sums`.
    #[allow(clippy::too_many_arguments)]
    pub fn forward_backward_with_head_into(
        &self,
        batch: &PackedBatch,
        recompute: Recompute,
        head: impl FnOnce(&Tensor) -> Result<Tensor>,
        tp: &dyn Collectives,
        cp: Option<&dyn Collectives>,
        shard: Option<&CpShard>,
        sums: BTreeMap<String, Tensor>,
    ) -> Result<(QueuedLoss, Gradients)> {
        self.fb_into(batch, recompute, Head::Hidden(Box::new(head)), tp, cp, shard, sums)
    }

    #[allow(clippy::too_many_arguments)]
    fn fb_into(
        &self,
        batch: &PackedBatch,
        recompute: Recompute,
        head: Head<'_>,
        tp: &dyn Collectives,
        cp: Option<&dyn Collectives>,
        shard: Option<&CpShard>,
        sums: BTreeMap<String, Tensor>,
    ) -> Result<(QueuedLoss, Gradients)> {
        match (shard, cp) {
            (None, _) => self.forward_backward_impl(batch, recompute, head, tp, None, Some(sums)),
            (Some(sh), Some(cp)) => {
                self.check_cp(sh, cp)?;
                self.forward_backward_impl(&sh.batch, recompute, head, tp, Some((sh, cp)), Some(sums))
            }
            (Some(_), None) => bail!("a context-parallel shard needs its CP group"),
        }
    }

    fn check_cp(&self, shard: &CpShard, cp: &dyn Collectives) -> Result<()> {
        if cp.size() != shard.cp || cp.rank() != shard.rank {
            bail!(
                "the batch is CP rank {} of {}'s share, but the CP group given is rank {} of {}",
                shard.rank,
                shard.cp,
                cp.rank(),
                cp.size()
            );
        }
        Ok(())
    }

    /// The general form: `head` maps the final-normed hidden states `[T, hidden]` (tracked) to a
    /// scalar loss. It may use the model's LM head or variables of its own (a value head); the
    /// latter's gradients come back in `Gradients::head`.
    pub fn forward_backward_with_head(
        &self,
        batch: &PackedBatch,
        recompute: Recompute,
        head: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<(f64, Gradients)> {
        read_loss(self.forward_backward_impl(
            batch,
            recompute,
            Head::Hidden(Box::new(head)),
            &SingleRank::default(),
            None,
            None,
        ))
    }

    /// [`Self::forward_backward_with_head`] of a tensor-parallel shard: the head sees every
    /// token's hidden state (gathered under sequence parallelism), so its own gradients are equal
    /// on every rank.
    pub fn forward_backward_with_head_tp(
        &self,
        batch: &PackedBatch,
        recompute: Recompute,
        head: impl FnOnce(&Tensor) -> Result<Tensor>,
        tp: &dyn Collectives,
    ) -> Result<(f64, Gradients)> {
        read_loss(self.forward_backward_impl(batch, recompute, Head::Hidden(Box::new(head)), tp, None, None))
    }

    fn forward_backward_impl(
        &self,
        batch: &PackedBatch,
        recompute: Recompute,
        head: Head<'_>,
        tp: &dyn Collectives,
        cp: Option<(&CpShard, &dyn Collectives)>,
        sums: Option<BTreeMap<String, Tensor>>,
    ) -> Result<(QueuedLoss, Gradients)> {
        // `Some`: gradient accumulation (`forward_backward_into`), whose results are the running
        // sums, all in the sums' dtype; `None`: this batch's gradients in their own dtypes.
        let as_sums = sums.is_some();
        let sums = sums.unwrap_or_default();
        self.check_batch(batch)?;
        self.check_tp(tp)?;
        self.check_sp(batch)?;
        if !self.explicit_backward {
            if cp.is_some() {
                bail!("the autograd reference has no context parallelism");
            }
            if tp.size() > 1 {
                bail!("the autograd reference has no tensor parallelism");
            }
            let (loss, mut grads) = crate::reference::forward_backward(self, batch, recompute, head)?;
            let mut params = sums;
            for (name, g) in std::mem::take(&mut grads.params) {
                add_gradient(&mut params, name, g)?;
            }
            if as_sums {
                self.widen_to_sums(&mut params, BTreeMap::new())?;
            }
            grads.params = params;
            return Ok((loss, grads));
        }
        let plan = recompute.plan(self.blocks.len())?;
        let attention = match cp {
            Some((shard, cp)) => Attention::ContextParallel { shard, cp },
            None => Attention::Packed {
                cu_seqlens: &batch.cu_seqlens,
            },
        };
        // Forward. A layer that keeps everything fills `saved[l]`; the first layer of a
        // recompute group keeps its input in `inputs[l]`, and under keep-attention every
        // recomputed layer its attention in `kept[l]`.
        let mut params = sums;
        let held = self.take_bf16_grad_sums(&mut params);
        // The LM head's gradient sum (the embedding's too when they are tied), taken out of the
        // running sums or made now, before the forward, while memory is low: the head's GEMMs
        // add into it in f32 and the embedding's backward adds its rows in place, so no
        // `[V, H]` buffer is allocated at the memory peak and nothing is rounded to bf16.
        let head_sum = match head {
            Head::Lm(_) if tp.size() == 1 => Some(match params.remove(self.head_grad_name()) {
                Some(s) => s,
                None => Tensor::zeros(
                    self.lm_head_weight(false).dims(),
                    self.grad_sum_dtype(),
                    self.embed.device(),
                )?,
            }),
            _ => None,
        };
        let n = self.blocks.len();
        let mut inputs: Vec<Option<Tensor>> = (0..n).map(|_| None).collect();
        let mut saved: Vec<Option<Saved>> = (0..n).map(|_| None).collect();
        let mut kept: Vec<Option<KeptAttention>> = (0..n).map(|_| None).collect();
        let (mut x, embed_local) = self.embed_tokens_tp(batch, tp)?;
        for (i, b) in self.blocks.iter().enumerate() {
            let keep = match plan[i] {
                None => Keep::All,
                Some(_) if recompute.keeps_attention() => Keep::Attention,
                Some(_) => Keep::Nothing,
            };
            if plan[i] == Some(i) {
                inputs[i] = Some(x.clone());
            }
            let (y, k) = b.forward(&self.ctx, &x, &batch.position_ids, &attention, keep, None, tp)?;
            match k {
                Kept::All(s) => saved[i] = Some(*s),
                Kept::Attention(a) => kept[i] = Some(a),
                Kept::Nothing => {}
            }
            x = y;
        }

        // Head: final norm + the caller's loss. Every gradient is added to `sums` (the earlier
        // micro-batches'; the weight GEMMs accumulate into them in place).
        let (loss, mut g, head_grads, tied_head_grad) = match head {
            Head::Lm(loss_fn) => self.lm_head_explicit(&x, batch, loss_fn, &mut params, tp, head_sum)?,
            // Under SP a custom head (the critic's value head, replicated over TP) sees every
            // token: the last residual is gathered, the head runs on the whole batch on every rank
            // (so its gradients and the final norm's are whole on each, as at TP 1), and dL/dx is
            // cut back to this rank's tokens (every rank computes the same loss).
            head if self.ctx.sequence_parallel => {
                let whole = tp.all_gather(&x)?;
                let (l, g, hg, tied) = self.autograd_head(&whole, batch, head, &mut params)?;
                (l, self.sp_slice(&g)?, hg, tied.map(TiedGrad::Grad))
            }
            head => {
                let (l, g, hg, tied) = self.autograd_head(&x, batch, head, &mut params)?;
                (l, g, hg, tied.map(TiedGrad::Grad))
            }
        };
        drop(x);

        // Blocks in reverse. Reaching a recomputed layer (the last of its group: the walk is in
        // reverse) re-runs its whole group from the group's input, keeping everything.
        for (i, b) in self.blocks.iter().enumerate().rev() {
            if saved[i].is_none() {
                let start = plan[i].ok_or_else(|| anyhow!("layer {i} kept nothing and does not recompute"))?;
                let mut h = inputs[start]
                    .take()
                    .ok_or_else(|| anyhow!("layer {start}'s input was not kept for its recompute"))?;
                for j in start..=i {
                    let (y, k) = self.blocks[j].forward(
                        &self.ctx,
                        &h,
                        &batch.position_ids,
                        &attention,
                        Keep::All,
                        kept[j].take(),
                        tp,
                    )?;
                    saved[j] = Some(k.into_saved()?);
                    h = y;
                }
            }
            let s = saved[i].take().expect("saved above");
            g = b.backward(&self.ctx, s, &g, &mut params, tp, &attention)?;
        }

        // Embedding (under TP: this rank's vocabulary rows; the other ranks' rows are masked out).
        // Into a running sum where there is one (the tied head's, or an earlier micro-batch's),
        // in place: only the batch's rows are touched. The sum is out of `params` then, so the
        // `add_gradient` below stores the result as it is.
        let embed_name = "model.embed_tokens.weight".to_string();
        let (sum, tied_head_grad) = match (&embed_local, tied_head_grad) {
            (None, Some(TiedGrad::Sum(sum))) => (Some(sum), None),
            (None, None)
                if params
                    .get(&embed_name)
                    .is_some_and(|s| s.dtype() == self.grad_sum_dtype()) =>
            {
                (params.remove(&embed_name), None)
            }
            (_, tied) => (None, tied.map(TiedGrad::into_tensor)),
        };
        let ge = match (sum, &embed_local) {
            (Some(sum), _) => vime_kernels::embedding_backward_into(&batch.input_ids, &g, sum)?,
            (None, None) => {
                vime_kernels::embedding_backward(&batch.input_ids, &g, self.cfg.vocab_size, tied_head_grad.as_ref())?
            }
            (None, Some(EmbedLocal { ids, mask })) => vime_kernels::embedding_backward(
                ids,
                &if self.ctx.sequence_parallel {
                    tp.all_gather(&g)?
                } else {
                    g
                }
                .broadcast_mul(&mask.to_dtype(self.dtype())?)?,
                self.vocab_shard()?.len,
                tied_head_grad.as_ref(),
            )?,
        };
        add_gradient(&mut params, embed_name, ge)?;
        if as_sums {
            // Queued behind the backward, before the wait below (cast after it, as the caller's
            // accumulator once did, each launch found the GPU idle). One launch for all of them.
            self.widen_to_sums(&mut params, held)?;
        }
        // Delayed FP8 scaling: this micro-batch's amaxes join the histories (queued; no sync).
        self.ctx.fp8_amax.commit()?;
        // The loss is not read here: reading it waits for the device, which then idles while the
        // host does what comes next (the next micro-batch, the optimizer's preparation). The
        // callers read it once that work is queued.
        Ok((
            QueuedLoss::device(loss)?,
            Gradients {
                params,
                head: head_grads,
            },
        ))
    }

    /// The head under candle's autograd from the last block's output `x`: final norm, then the
    /// LM head + loss or the caller's head. Returns the loss, `dL/dx`, the head's own gradient
    /// store, and the LM head's gradient when it is tied to the embedding.
    #[allow(clippy::type_complexity)]
    pub(crate) fn autograd_head(
        &self,
        x: &Tensor,
        batch: &PackedBatch,
        head: Head<'_>,
        params: &mut BTreeMap<String, Tensor>,
    ) -> Result<(Tensor, Tensor, GradStore, Option<Tensor>)> {
        let last = Var::from_tensor(x)?;
        let hn = rms_norm(last.as_tensor(), &w(&self.norm, true), self.cfg.rms_norm_eps)?;
        let loss = match head {
            Head::Lm(loss_fn) => {
                let (logprobs, entropy) = logprobs_entropy_with(
                    &hn,
                    &self.lm_head_weight(true),
                    &batch.targets,
                    self.logits_chunk_tokens,
                    &self.ctx.kernels,
                )?;
                loss_fn(&TokenOutputs { logprobs, entropy })?
            }
            Head::Hidden(f) => f(&hn)?,
        };
        check_scalar(&loss)?;
        let mut head_grads = loss.backward()?;
        let g = take_grad(&mut head_grads, last.as_tensor(), "the final hidden states")?;
        self.move_grads(&mut head_grads, params, &[&self.norm])?;
        if let Some(lm) = &self.lm_head {
            self.move_grads(&mut head_grads, params, &[lm])?;
        }
        let tied = self
            .lm_head
            .is_none()
            .then(|| head_grads.remove(self.embed.as_tensor()))
            .flatten();
        Ok((loss, g, head_grads, tied))
    }

    /// Moves the gradients of `vars` out of `grads` into `params` under their HF names. A
    /// parameter that received no gradient gets zeros (it did not influence the loss).
    pub(crate) fn move_grads(
        &self,
        grads: &mut GradStore,
        params: &mut BTreeMap<String, Tensor>,
        vars: &[&Var],
    ) -> Result<()> {
        for v in vars {
            let name = self.name_of(v)?;
            let g = match grads.remove(v.as_tensor()) {
                Some(g) => g,
                None => v.as_tensor().zeros_like()?,
            };
            add_gradient(params, name.to_string(), g)?;
        }
        Ok(())
    }

    fn name_of(&self, v: &Var) -> Result<&str> {
        let id = v.as_tensor().id();
        self.params
            .iter()
            .find(|(_, p)| p.as_tensor().id() == id)
            .map(|(n, _)| n.as_str())
            .ok_or_else(|| anyhow!("internal: a variable that is not a model parameter"))
    }
}

/// The head of [`Qwen3::forward_backward_impl`]: the model's LM head followed by a loss over
/// log-probs and entropy, or any head over the final-normed hidden states.
pub(crate) enum Head<'a> {
    Lm(LossFn<'a>),
    Hidden(HeadFn<'a>),
}

/// Any head over the final-normed hidden states, returning the loss.
type HeadFn<'a> = Box<dyn FnOnce(&Tensor) -> Result<Tensor> + 'a>;

/// A loss over the LM head's log-probs and entropy.
type LossFn<'a> = Box<dyn FnOnce(&TokenOutputs) -> Result<Tensor> + 'a>;

fn check_scalar(loss: &Tensor) -> Result<()> {
    if loss.elem_count() != 1 {
        bail!("the loss must be a scalar, got shape {:?}", loss.dims());
    }
    Ok(())
}

pub(crate) fn scalar_loss(loss: &Tensor) -> Result<f64> {
    check_scalar(loss)?;
    Ok(loss.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?[0])
}

/// A forward/backward's loss, still on the device until [`Self::read`] (which waits for the
/// device to reach it): see [`Qwen3::forward_backward_into`].
#[derive(Debug, Clone)]
pub struct QueuedLoss(Tensor);

impl QueuedLoss {
    /// The scalar loss tensor (checked to be one value), not read.
    pub(crate) fn device(loss: Tensor) -> Result<Self> {
        check_scalar(&loss)?;
        // Detached: the loss's autograd graph (a custom head's inputs, `[T, hidden]`) is not
        // kept alive until the read.
        Ok(Self(loss.detach()))
    }
    /// The value: waits for the device to compute it.
    pub fn read(&self) -> Result<f64> {
        scalar_loss(&self.0)
    }
}

/// A result with its loss read (the public forms that return the value).
fn read_loss(r: Result<(QueuedLoss, Gradients)>) -> Result<(f64, Gradients)> {
    let (loss, grads) = r?;
    Ok((loss.read()?, grads))
}

impl Qwen3 {
    /// The LM head without autograd through the model (explicit backward): final norm and
    /// log-probs/entropy forward with no graph, candle's autograd only over the caller's loss
    /// (from two `[T]` leaves), then the head's and the norm's explicit backward. Returns the loss,
    /// `dL/dx` of the last layer's output, the loss's own gradient store, and the LM head's
    /// gradient when it is tied to the embedding (added into the embedding's by the caller).
    #[allow(clippy::type_complexity)]
    fn lm_head_explicit(
        &self,
        x: &Tensor,
        batch: &PackedBatch,
        loss_fn: LossFn<'_>,
        params: &mut BTreeMap<String, Tensor>,
        tp: &dyn Collectives,
        head_sum: Option<Tensor>,
    ) -> Result<(Tensor, Tensor, GradStore, Option<TiedGrad>)> {
        let eps = self.cfg.rms_norm_eps;
        let norm_w = w(&self.norm, false);
        let hn = rms_norm(x, &norm_w, eps)?;
        // Sequence parallelism: the head sees every token (replicated), the norm only this rank's.
        let hn = if self.ctx.sequence_parallel {
            tp.all_gather(&hn)?
        } else {
            hn
        };
        let wlm = self.lm_head_weight(false);
        enum HeadSaved {
            Whole(vime_kernels::LmHeadSaved),
            Vocab(
                crate::vocab_parallel::VocabParallelSaved,
                crate::vocab_parallel::VocabShard,
            ),
        }
        let (lp, ent, saved) = if tp.size() > 1 {
            let shard = self.vocab_shard()?;
            let (lp, ent, s) = crate::vocab_parallel::vocab_parallel_logprobs_entropy(
                &hn,
                &wlm,
                &batch.targets,
                &shard,
                tp,
                self.vocab_parallel_chunk(),
            )?;
            (lp, ent, HeadSaved::Vocab(s, shard))
        } else {
            let (lp, ent, s) =
                logprobs_entropy_saved_with(&hn, &wlm, &batch.targets, self.logits_chunk_tokens, &self.ctx.kernels)?;
            (lp, ent, HeadSaved::Whole(s))
        };
        let (lpv, entv) = (Var::from_tensor(&lp)?, Var::from_tensor(&ent)?);
        let loss = loss_fn(&TokenOutputs {
            logprobs: lpv.as_tensor().clone(),
            entropy: entv.as_tensor().clone(),
        })?;
        check_scalar(&loss)?;
        let mut head_grads = loss.backward()?;
        let dlp = match head_grads.remove(lpv.as_tensor()) {
            Some(d) => d,
            None => lp.zeros_like()?,
        };
        let dent = match head_grads.remove(entv.as_tensor()) {
            Some(d) => d,
            None => ent.zeros_like()?,
        };
        let (dhn, dwlm) = match (&saved, head_sum) {
            (HeadSaved::Whole(s), Some(sum)) => {
                let (dh, sum) = logprobs_entropy_backward_into(s, &hn, &wlm, &dlp, &dent, sum)?;
                (dh, TiedGrad::Sum(sum))
            }
            (HeadSaved::Whole(s), None) => {
                let (dh, dw) = logprobs_entropy_backward(s, &hn, &wlm, &dlp, &dent)?;
                (dh, TiedGrad::Grad(dw))
            }
            (HeadSaved::Vocab(_, _), Some(_)) => bail!("the vocabulary-parallel head takes no running sum"),
            (HeadSaved::Vocab(s, shard), None) => {
                let (dh, dw) = crate::vocab_parallel::vocab_parallel_logprobs_entropy_backward(
                    &hn,
                    &wlm,
                    &batch.targets,
                    shard,
                    s,
                    &dlp,
                    &dent,
                    tp,
                    self.vocab_parallel_chunk(),
                )?;
                (dh, TiedGrad::Grad(dw))
            }
        };
        drop(saved);
        let dhn = if self.ctx.sequence_parallel {
            self.sp_slice(&dhn)?
        } else {
            dhn
        };
        let (g, dnorm) = rms_norm_backward(x, &norm_w, eps, &dhn)?;
        let dnorm = if self.ctx.sequence_parallel {
            tp.all_reduce(&dnorm, ReduceOp::Sum)?
        } else {
            dnorm
        };
        add_gradient(params, "model.norm.weight".to_string(), dnorm)?;
        let tied = match (&self.lm_head, dwlm) {
            (Some(_), TiedGrad::Sum(sum)) => {
                params.insert("lm_head.weight".to_string(), sum);
                None
            }
            (Some(_), TiedGrad::Grad(dw)) => {
                add_gradient(params, "lm_head.weight".to_string(), dw)?;
                None
            }
            (None, tied) => Some(tied),
        };
        Ok((loss, g, head_grads, tied))
    }
}

/// The LM head's weight gradient as the head hands it to the embedding's backward when the two
/// are tied: the head's gradient alone (added to the embedding's as its init), or the running
/// sum that already holds it (the embedding's rows are added into it in place).
enum TiedGrad {
    Grad(Tensor),
    Sum(Tensor),
}

impl TiedGrad {
    fn into_tensor(self) -> Tensor {
        match self {
            TiedGrad::Grad(t) | TiedGrad::Sum(t) => t,
        }
    }
}

pub(crate) fn take_grad(grads: &mut GradStore, t: &Tensor, what: &str) -> Result<Tensor> {
    grads
        .remove(t)
        .ok_or_else(|| anyhow!("the loss does not depend on {what}: no gradient reached it"))
}
