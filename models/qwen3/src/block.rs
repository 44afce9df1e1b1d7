//! The Qwen3 decoder block, written once: an explicit forward (optionally keeping the activations
//! its backward reads, [`Saved`]) and an explicit backward, over LOCAL shapes ([`BlockCtx`]). The
//! training forward/backward, `hidden_states`/`logprobs_entropy` and the KV-cached inference of
//! `infer.rs` all run this code; only the attention differs ([`Attention`]).
//!
//! Decisions:
//! - Hand-written backward, as Megatron-Core does it: no candle autograd graph exists for a block.
//!   Under candle's autograd, Nsight Compute counted 145 ms of `badd_bf16` in one Qwen3-4B step of
//!   4096 tokens with full recompute on an H200, of 580 ms of kernels
//!   (`benches/results/2026-11-30-profile-step-h200.md`, section 1): every gradient is accumulated
//!   as `zeros_like + add`, and the `w.t()` in each linear layer turns the weight's gradient into a
//!   strided add. The same step ran 0.906 -> 0.629 s at 8192 tokens with the explicit backward.
//!   Here each gradient is written once, and each weight gradient comes out of its GEMM in the
//!   weight's own layout (`dW = dY^T X`) and in f32 (`vime_kernels::weight_grad`). The kernels'
//!   explicit ops exist on every device and dtype (falling back to their composed op where no
//!   kernel exists), so this is the only training path; candle's autograd over the same math is
//!   `crate::reference`, a test reference.
//! - Head counts, head_dim and sizes come from [`BlockCtx`] (the shapes ONE rank sees), never from
//!   `Qwen3Config`. Tensor parallelism (Megatron's layout) holds q/k/v/gate/up by columns (this
//!   rank's heads, GQA groups whole) and o/down by rows: the row-parallel outputs are summed over
//!   the TP group passed to forward/backward (o's bias added once, after), and the backward sums
//!   the column-parallel input gradients and the q/k norm weight gradients. At TP = 1 no
//!   collective runs (no copy either). The block holds tensors, no communicator.
//! - Attention is a strategy ([`Attention`]): packed training over one `cu_seqlens` (saved for the
//!   backward), or KV-cached decoding (new keys appended to the caller's cache, queries attend to
//!   cached + new, no backward). A context-parallel variant (gather the keys of the other ranks,
//!   `cu_seqlens_k` != `cu_seqlens_q`) would be a third.
//!
//! The math (`x` in, `y` out, `·` a matmul with the weight as HF stores it, `[out, in]`):
//!   h1 = rms(x; w_in)         q = h1·Wq^T  k = h1·Wk^T  v = h1·Wv^T
//!   qr = rope(rms_head(q; w_qn))   kr = rope(rms_head(k; w_kn))   a = attn(qr, kr, v)
//!   x2 = x + a·Wo^T           h2 = rms(x2; w_post)
//!   g = h2·Wg^T  u = h2·Wu^T  s = silu(g) * u   y = x2 + s·Wd^T
//! and backward, from dy:
//!   dWd = dy^T s   ds = dy·Wd   (dg, du) = swiglu'(g, u; ds)   dWg = dg^T h2   dWu = du^T h2
//!   dh2 = dg·Wg + du·Wu   dx2 = dy + rms'(x2; dh2)   dWo = dx2^T a   da = dx2·Wo
//!   (dqr, dkr, dv) = attn'(da)   dq = rms_head'(q; rope'(dqr))   dk likewise
//!   dWq = dq^T h1 (k, v likewise)   dh1 = dq·Wq + dk·Wk + dv·Wv   dx = dx2 + rms'(x; dh1)
//! (optional q/k/v/o biases: db = column sums of the same upstream gradients).
//!
//! Memory: [`Saved`] keeps x, h1, the pre-norm q and k, v, the roped q and k, the attention
//! output, x2, h2, gate, up and the SwiGLU output (under sequence parallelism x, x2, h1 and h2 as
//! this rank's token slices, h1 and h2 gathered again in the backward): about 0.5 GB per Qwen3-4B layer at 4096
//! tokens. Nothing is recomputed in the backward (recomputing the SwiGLU output cost ~140 us per
//! layer at 4096 x 9728, each norm ~25 us); `Recompute::Full` keeps only x and re-runs the
//! whole block forward instead.
use crate::config::Qwen3Config;
use crate::infer::KvCache;
use anyhow::{bail, Result};
use candle_core::{Tensor, Var};
use std::collections::BTreeMap;
use std::sync::Arc;
use vime_dist::{Collectives, ReduceOp};
use vime_kernels::fp8::{self, AmaxHistory, DelayedScaling, Fp8Format, Fp8Tensor, Side};
use vime_kernels::{
    matmul_acc, rms_norm, rms_norm_backward_add, rope, swiglu, swiglu_backward, varlen_attention,
    varlen_attention_backward, varlen_attention_saved, AttentionSaved, KernelConfig,
};

/// What a block needs besides its weights: the dims ONE rank sees (local heads and intermediate
/// size; equal to the global ones while there is no tensor parallelism), the norm and RoPE
/// constants, and the kernel choice.
#[derive(Debug, Clone)]
pub struct BlockCtx {
    /// Query heads of this rank.
    pub q_heads: usize,
    /// Key/value heads of this rank.
    pub kv_heads: usize,
    pub head_dim: usize,
    /// The residual stream's width (never sharded).
    pub hidden: usize,
    /// The MLP's intermediate size on this rank.
    pub intermediate: usize,
    pub eps: f64,
    pub rope_theta: f64,
    pub kernels: KernelConfig,
    /// Megatron's sequence parallelism (`--sequence-parallel`, with TP > 1): the residual stream,
    /// the norms and the block's input and output hold this rank's slice of the tokens; the
    /// column-parallel layers all-gather their input along the tokens and the row-parallel ones
    /// reduce-scatter their output (backward: the duals).
    pub sequence_parallel: bool,
    /// `--tp-comm-overlap`: the backward starts the collective of each column-parallel layer's
    /// input gradient (q/k/v, gate/up) and computes the layer's weight gradients while it runs
    /// (`Collectives::reduce_while`). The same numbers either way.
    pub comm_overlap: bool,
    /// The FP8 copies of the weights while a [`Fp8WeightCache`] scope is open (see
    /// `Qwen3::with_fp8_weight_cache`); clones of the context share it.
    pub(crate) fp8_weights: Fp8WeightCache,
    /// Decoder layers of the model (the FP8 amax history has a slot per layer and role).
    pub layers: usize,
    /// Delayed scaling's amax histories (`KernelConfig::fp8_delayed`); clones share them.
    pub(crate) fp8_amax: Fp8Amax,
}

/// The roles of a block's FP8 activations (E4M3: the four linear inputs) and gradients (E5M2:
/// the seven output gradients), an amax history slot each under delayed scaling.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Fp8Role {
    H1,
    A2,
    H2,
    Act,
    DQ,
    DK,
    DV,
    DO,
    DGate,
    DUp,
    DDown,
}

/// Slots a layer has in the amax history.
const FP8_ROLES: usize = 11;

impl Proj {
    /// The role of this projection's input.
    fn input_role(self) -> Fp8Role {
        match self {
            Proj::Q | Proj::K | Proj::V => Fp8Role::H1,
            Proj::O => Fp8Role::A2,
            Proj::Gate | Proj::Up => Fp8Role::H2,
            Proj::Down => Fp8Role::Act,
        }
    }
}

/// Delayed scaling's state ([`AmaxHistory`]), made at the first quantization under
/// `KernelConfig::fp8_delayed` (again if the config's history settings change).
#[derive(Debug, Clone, Default)]
pub(crate) struct Fp8Amax(Arc<std::sync::Mutex<Option<AmaxHistory>>>);

impl Fp8Amax {
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<AmaxHistory>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
    /// Commits the roles recorded since the last commit (see [`AmaxHistory::commit`]).
    pub(crate) fn commit(&self) -> Result<()> {
        if let Some(h) = self.lock().as_mut() {
            h.commit()?;
        }
        Ok(())
    }
    /// The settings, rows and seeded roles, if a history exists.
    pub(crate) fn state(&self) -> Result<Option<crate::model::Fp8AmaxState>> {
        match self.lock().as_ref() {
            Some(h) => {
                let (rows, seeded) = h.to_host()?;
                Ok(Some(crate::model::Fp8AmaxState {
                    config: h.config(),
                    rows,
                    seeded,
                }))
            }
            None => Ok(None),
        }
    }
    /// Replaces the state with a saved one, making the history first.
    pub(crate) fn load(
        &self,
        cfg: DelayedScaling,
        slots: usize,
        rows: &[f32],
        seeded: &[bool],
        device: &candle_core::Device,
    ) -> Result<()> {
        let mut h = AmaxHistory::new(cfg, slots, device)?;
        h.load_host(rows, seeded)?;
        *self.lock() = Some(h);
        Ok(())
    }
}

/// Each linear weight quantized once (rows and transpose) for the micro-batches of one optimizer
/// step, while its scope is open; outside one, every use quantizes afresh. The weights must not
/// change while the scope is open: the trainer opens it around the micro-batches of a step,
/// between which nothing writes them.
#[derive(Debug, Clone, Default)]
pub(crate) struct Fp8WeightCache(Arc<std::sync::Mutex<Option<Fp8Weights>>>);

/// The FP8 copies of an open [`Fp8WeightCache`] scope, by HF name.
type Fp8Weights = BTreeMap<String, Arc<Fp8Tensor>>;

impl Fp8WeightCache {
    /// Opens the scope (empty) if it is closed; returns whether it did (an open scope is left
    /// as it is, with its copies).
    pub(crate) fn open(&self) -> bool {
        let mut g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if g.is_some() {
            return false;
        }
        *g = Some(BTreeMap::new());
        true
    }
    /// Closes the scope and frees the copies.
    pub(crate) fn close(&self) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
    /// `w` in FP8 with its transpose: the cached copy of `name` inside a scope, else a fresh one.
    fn get(&self, name: &str, w: &Var) -> Result<Arc<Fp8Tensor>> {
        let mut g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let Some(map) = g.as_mut() else {
            return Ok(Arc::new(fp8_quantized(&dw(w), Fp8Format::E4M3, true, 1)?));
        };
        if let Some(q) = map.get(name) {
            return Ok(q.clone());
        }
        let q = Arc::new(fp8_quantized(&dw(w), Fp8Format::E4M3, true, 1)?);
        map.insert(name.to_string(), q.clone());
        Ok(q)
    }
}

impl BlockCtx {
    /// The context of an unsharded model (tensor-parallel size 1).
    pub fn new(cfg: &Qwen3Config, kernels: KernelConfig) -> Self {
        Self {
            q_heads: cfg.num_attention_heads,
            kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            hidden: cfg.hidden_size,
            intermediate: cfg.intermediate_size,
            eps: cfg.rms_norm_eps,
            rope_theta: cfg.rope_theta,
            kernels,
            sequence_parallel: false,
            comm_overlap: false,
            fp8_weights: Fp8WeightCache::default(),
            layers: cfg.num_hidden_layers,
            fp8_amax: Fp8Amax::default(),
        }
    }

    /// Slots of the amax history: a role of each layer.
    pub(crate) fn fp8_slots(&self) -> usize {
        self.layers * FP8_ROLES
    }

    /// An activation (E4M3) or gradient (E5M2) of `layer` in `role` as an FP8 GEMM operand, its
    /// rows padded to [`FP8_ROWS`], with its transpose when a weight gradient will read it:
    /// current scaling, or under `KernelConfig::fp8_delayed` the role's amax history (`record`:
    /// this tensor's amax joins it at the next commit; passes that a backward repeats or that have
    /// none do not record).
    fn fp8_act(
        &self,
        layer: usize,
        role: Fp8Role,
        t: &Tensor,
        format: Fp8Format,
        transpose: bool,
        record: bool,
    ) -> Result<Fp8Tensor> {
        let slot = layer * FP8_ROLES + role as usize;
        match self.with_amax_history(t, |h| h.quantize(slot, t, format, transpose, FP8_ROWS, record))? {
            Some(q) => Ok(q),
            None => fp8_quantized(t, format, transpose, FP8_ROWS),
        }
    }

    /// [`Self::fp8_act`] of `swiglu(gate, up)` in the `Act` role (E4M3). Under delayed scaling
    /// on CUDA, once the role has a history, SwiGLU is computed by the cast and its bf16 output
    /// is never written (`KernelConfig::fp8_fused_swiglu`, `AmaxHistory::try_quantize_swiglu`);
    /// otherwise SwiGLU, then [`Self::fp8_act`]: the same bits either way.
    fn fp8_swiglu(&self, layer: usize, gate: &Tensor, up: &Tensor, transpose: bool, record: bool) -> Result<Fp8Tensor> {
        if self.kernels.fp8_fused_swiglu() {
            let slot = layer * FP8_ROLES + Fp8Role::Act as usize;
            let fused = self.with_amax_history(gate, |h| {
                h.try_quantize_swiglu(slot, gate, up, Fp8Format::E4M3, transpose, FP8_ROWS, record)
            })?;
            if let Some(q) = fused.flatten() {
                return Ok(q);
            }
        }
        self.fp8_act(
            layer,
            Fp8Role::Act,
            &swiglu(gate, up)?,
            Fp8Format::E4M3,
            transpose,
            record,
        )
    }

    /// SwiGLU's input gradients for the upstream `ds`, as [`Self::fp8_act`] quantizes them for
    /// the backward (E5M2 with transposes, roles `DGate` and `DUp`, recorded). Under delayed
    /// scaling on CUDA, once both roles have a history, one kernel computes and casts them and
    /// the bf16 gradients are never written (`KernelConfig::fp8_fused_swiglu`); the same bits as
    /// `swiglu_backward` then [`Self::fp8_act`] of each.
    fn fp8_swiglu_backward(
        &self,
        layer: usize,
        gate: &Tensor,
        up: &Tensor,
        ds: &Tensor,
    ) -> Result<(Fp8Tensor, Fp8Tensor)> {
        if self.kernels.fp8_fused_swiglu() {
            let slots = (
                layer * FP8_ROLES + Fp8Role::DGate as usize,
                layer * FP8_ROLES + Fp8Role::DUp as usize,
            );
            let fused = self.with_amax_history(gate, |h| {
                h.try_quantize_swiglu_backward(slots, gate, up, ds, Fp8Format::E5M2, FP8_ROWS, true)
            })?;
            if let Some(q) = fused.flatten() {
                return Ok(q);
            }
        }
        let (dg, du) = swiglu_backward(gate, up, ds)?;
        let dgq = self.fp8_act(layer, Fp8Role::DGate, &dg, Fp8Format::E5M2, true, true)?;
        drop(dg);
        Ok((
            dgq,
            self.fp8_act(layer, Fp8Role::DUp, &du, Fp8Format::E5M2, true, true)?,
        ))
    }

    /// `f` on the amax history under `KernelConfig::fp8_delayed` (made, or made again for a new
    /// configuration, on `t`'s device), `None` under current scaling. `t` must be bf16.
    fn with_amax_history<R>(
        &self,
        t: &Tensor,
        f: impl FnOnce(&mut AmaxHistory) -> candle_core::Result<R>,
    ) -> Result<Option<R>> {
        let Some(cfg) = self.kernels.fp8_delayed() else {
            return Ok(None);
        };
        bf16_model(t)?;
        let mut g = self.fp8_amax.lock();
        if !g
            .as_ref()
            .is_some_and(|h| h.config() == cfg && h.slots() == self.fp8_slots())
        {
            *g = Some(AmaxHistory::new(cfg, self.fp8_slots(), t.device())?);
        }
        let h = g.as_mut().expect("made above");
        Ok(Some(f(h)?))
    }

    /// The context of one rank at tensor-parallel size `tp`: its share of the query heads, the
    /// key/value heads (GQA groups stay whole, so `tp` must divide `num_key_value_heads`) and the
    /// intermediate size; anything that does not divide evenly is an error naming both numbers.
    pub fn sharded(cfg: &Qwen3Config, kernels: KernelConfig, tp: usize) -> Result<Self> {
        for (what, n) in [
            ("num_key_value_heads", cfg.num_key_value_heads),
            ("num_attention_heads", cfg.num_attention_heads),
            ("intermediate_size", cfg.intermediate_size),
        ] {
            if tp == 0 || !n.is_multiple_of(tp) {
                bail!("the tensor-parallel size ({tp}) must divide {what} ({n})");
            }
        }
        let mut c = Self::new(cfg, kernels);
        c.q_heads /= tp;
        c.kv_heads /= tp;
        c.intermediate /= tp;
        Ok(c)
    }

    pub fn softmax_scale(&self) -> f64 {
        1.0 / (self.head_dim as f64).sqrt()
    }
}

/// The weights of decoder layer `index` (candle `Var`s, exactly the HF tensors).
pub(crate) struct Block {
    pub(crate) index: usize,
    pub(crate) input_norm: Var,
    pub(crate) q_proj: Var,
    pub(crate) k_proj: Var,
    pub(crate) v_proj: Var,
    pub(crate) o_proj: Var,
    pub(crate) q_bias: Option<Var>,
    pub(crate) k_bias: Option<Var>,
    pub(crate) v_bias: Option<Var>,
    pub(crate) o_bias: Option<Var>,
    pub(crate) q_norm: Var,
    pub(crate) k_norm: Var,
    pub(crate) post_norm: Var,
    pub(crate) gate_proj: Var,
    pub(crate) up_proj: Var,
    pub(crate) down_proj: Var,
}

/// How a block's attention finds its keys and values.
pub(crate) enum Attention<'a> {
    /// A packed training (or scoring) batch: queries and keys are the same tokens, sequences
    /// bounded by `cu_seqlens`. The only strategy with a backward.
    Packed { cu_seqlens: &'a Arc<[u32]> },
    /// KV-cached decoding: each sequence's new keys and values are appended to its slot of
    /// `cache`, and its queries attend to cached + new (`cu_seqlens_q` spans the new tokens,
    /// `cu_seqlens_k` cached + new; the kernel's bottom-right causal alignment gives each query
    /// its prefix). `rows`: the pool rows the call writes and reads (`KvCache::call_rows`).
    Cached {
        cache: &'a KvCache,
        rows: &'a crate::infer::CallRows,
        cu_seqlens_q: &'a Arc<[u32]>,
        cu_seqlens_k: &'a Arc<[u32]>,
    },
    /// A packed batch under context parallelism: this rank's zigzag chunks as queries, the keys
    /// and values of each chunk's prefix gathered over `cp` (see `context_parallel`).
    ContextParallel {
        shard: &'a crate::context_parallel::CpShard,
        cp: &'a dyn Collectives,
    },
}

impl Attention<'_> {
    /// Attention of block `layer` over roped `q: [T, q_heads, d]`, `k, v: [T, kv_heads, d]`; with
    /// `save`, also what its backward needs.
    fn run(
        &self,
        layer: usize,
        ctx: &BlockCtx,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        save: bool,
    ) -> Result<(Tensor, Option<AttentionSaved>)> {
        let scale = ctx.softmax_scale();
        match *self {
            Attention::Packed { cu_seqlens: cu } if save => {
                let (a, s) = varlen_attention_saved(q, k, v, cu, cu, scale, &ctx.kernels)?;
                Ok((a, Some(s)))
            }
            Attention::Packed { cu_seqlens: cu } => Ok((varlen_attention(q, k, v, cu, cu, scale, &ctx.kernels)?, None)),
            Attention::ContextParallel { shard, cp } => {
                let (kc, vc) = (shard.gather_keys(k, cp)?, shard.gather_keys(v, cp)?);
                let (cq, ck) = (&shard.batch.cu_seqlens, &shard.cu_seqlens_k);
                if save {
                    let (a, s) = varlen_attention_saved(q, &kc, &vc, cq, ck, scale, &ctx.kernels)?;
                    Ok((a, Some(s)))
                } else {
                    Ok((varlen_attention(q, &kc, &vc, cq, ck, scale, &ctx.kernels)?, None))
                }
            }
            Attention::Cached { .. } if save => bail!("KV-cached attention has no backward"),
            Attention::Cached {
                cache,
                rows,
                cu_seqlens_q,
                cu_seqlens_k,
            } => {
                if let Some(a) = cache.append_and_decode(layer, rows, q, k, v, cu_seqlens_k, scale, &ctx.kernels)? {
                    return Ok((a, None));
                }
                let (k_all, v_all) = cache.append_and_gather(layer, rows, k, v)?;
                let a = varlen_attention(q, &k_all, &v_all, cu_seqlens_q, cu_seqlens_k, scale, &ctx.kernels)?;
                Ok((a, None))
            }
        }
    }
}

/// What a block's forward keeps for its backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Keep {
    /// Nothing (a forward-only pass, or a layer that recomputes all of its forward).
    Nothing,
    /// Only the attention output and what its backward reads (on CUDA the log-sum-exp), so that
    /// the recompute skips the attention kernel (and, under CP, the K/V gather).
    Attention,
    /// Every activation the backward reads ([`Saved`]).
    All,
}

/// The attention output of one block's forward with what its backward needs (see
/// [`Keep::Attention`]).
pub(crate) struct KeptAttention {
    attn: Tensor,
    saved: AttentionSaved,
}

/// What a block's forward kept, by [`Keep`].
pub(crate) enum Kept {
    Nothing,
    Attention(KeptAttention),
    All(Box<Saved>),
}

impl Kept {
    /// Everything the backward reads; an error if the forward kept less.
    pub(crate) fn into_saved(self) -> Result<Saved> {
        match self {
            Kept::All(s) => Ok(*s),
            _ => bail!("the block's forward kept less than its backward reads"),
        }
    }
}

/// The activations of one block's forward that its backward reads.
pub(crate) struct Saved {
    positions: Arc<[u32]>,
    x: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qr: Tensor,
    kr: Tensor,
    attn: Tensor,
    attn_saved: AttentionSaved,
    x2: Tensor,
    gate: Tensor,
    up: Tensor,
    inputs: LinearInputs,
}

/// What the weight gradients of the seven linear layers read of their inputs.
enum LinearInputs {
    /// bf16: the inputs of q/k/v (h1; under SP this rank's token slice), gate/up (h2, the same)
    /// and down (the SwiGLU output). o's input is the attention output, saved for attention.
    Bf16 { h1: Tensor, h2: Tensor, act: Tensor },
    /// FP8 (`KernelConfig::fp8`): the four inputs' FP8 transposes only.
    Fp8(SavedFp8),
}

/// A forward's SwiGLU output: bf16, or (FP8 linear layers) only the down projection's quantized
/// input.
enum Act {
    Bf16(Tensor),
    Fp8(Fp8Tensor),
}

fn dw(v: &Var) -> Tensor {
    v.as_detached_tensor()
}

/// `x · W^T (+ b)`, no gradient tracking; under `--true-on-policy-mode` (CUDA bf16) by the
/// batch-invariant GEMM.
pub(crate) fn linear(kernels: &KernelConfig, x: &Tensor, weight: &Var, bias: Option<&Var>) -> Result<Tensor> {
    let y = vime_kernels::invariant::matmul_t(x, &dw(weight), kernels)?;
    Ok(match bias {
        Some(b) => y.broadcast_add(&dw(b))?,
        None => y,
    })
}

/// The FP8 operands of a block's weight gradients (`KernelConfig::fp8`), kept by the forward:
/// the inputs of q/k/v (h1), o (the attention output), gate/up (h2) and down (the SwiGLU
/// output), each quantized once; only the transpose, which the weight-gradient GEMM reads, is
/// kept ([`Fp8Tensor::into_transpose`]).
pub(crate) struct SavedFp8 {
    h1: Fp8Tensor,
    a2: Fp8Tensor,
    h2: Fp8Tensor,
    act: Fp8Tensor,
}

/// Rows of every FP8 operand are padded to this (Hopper's FP8 GEMMs need dimensions of 16).
const FP8_ROWS: usize = 16;

fn fp8_quantized(t: &Tensor, format: Fp8Format, transpose: bool, rows: usize) -> Result<Fp8Tensor> {
    bf16_model(t)?;
    Ok(fp8::quantize_padded(t, format, transpose, rows)?)
}

/// FP8 quantizes bf16 tensors: for any other dtype, an error naming the flag.
fn bf16_model(t: &Tensor) -> Result<()> {
    if t.dtype() != candle_core::DType::BF16 {
        bail!(
            "--fp8-format runs on bf16 models (--dtype bf16); this one is {:?}",
            t.dtype()
        );
    }
    Ok(())
}

/// `x · W^T (+ b)`: in FP8 from `xq`, the input already quantized (E4M3 weight; fast
/// accumulation, as Transformer Engine runs the forward; bf16 out), or by [`linear`] when there
/// is none.
fn project(w: Weight, x: &Tensor, xq: Option<&Fp8Tensor>, bias: Option<&Var>) -> Result<Tensor> {
    match xq {
        None => linear(&w.ctx.kernels, x, w.var, bias),
        Some(xq) => project_fp8(w, xq, bias),
    }
}

/// [`project`] of an input that exists only in FP8.
fn project_fp8(w: Weight, xq: &Fp8Tensor, bias: Option<&Var>) -> Result<Tensor> {
    let y = fp8::matmul_t(
        xq,
        Side::Rows,
        &*w.fp8()?,
        Side::Rows,
        None,
        candle_core::DType::BF16,
        true,
    )?;
    Ok(match bias {
        Some(b) => y.broadcast_add(&dw(b))?,
        None => y,
    })
}

/// [`project`] for a scoring pass: in FP8 under `KernelConfig::fp8` (the input quantized here,
/// recording nothing under delayed scaling), so that scoring runs the training forward's
/// arithmetic.
fn linear_scoring(w: Weight, x: &Tensor, bias: Option<&Var>) -> Result<Tensor> {
    let xq = if w.ctx.kernels.fp8() {
        Some(
            w.ctx
                .fp8_act(w.layer, w.proj.input_role(), x, Fp8Format::E4M3, false, false)?,
        )
    } else {
        None
    };
    project(w, x, xq.as_ref(), bias)
}

/// A block's seven linear layers.
#[derive(Debug, Clone, Copy)]
enum Proj {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

/// One of a block's linear weights: its context (kernels, FP8 weight cache), its HF name and the
/// weight.
#[derive(Clone, Copy)]
struct Weight<'a> {
    ctx: &'a BlockCtx,
    layer: usize,
    proj: Proj,
    name: &'static str,
    var: &'a Var,
}

impl Weight<'_> {
    /// The weight in FP8 (E4M3, with its transpose), from the step's cache when one is open. Its
    /// rows are output features, never padded: an FP8 GEMM on CUDA needs them a multiple of 16,
    /// which every Qwen3 release shape is.
    fn fp8(&self) -> Result<Arc<Fp8Tensor>> {
        let name = format!("model.layers.{}.{}", self.layer, self.name);
        self.ctx.fp8_weights.get(&name, self.var)
    }
}

/// The sum of a partial result over the tensor-parallel group (nothing at all at TP = 1: no copy).
fn tp_sum(tp: &dyn Collectives, t: Tensor) -> Result<Tensor> {
    if tp.size() == 1 {
        Ok(t)
    } else {
        tp.all_reduce(&t, ReduceOp::Sum)
    }
}

/// The entry of a column-parallel layer: the identity, or with sequence parallelism the
/// all-gather of the token slices (`[T / tp, ..]` -> `[T, ..]`).
fn sp_gather(ctx: &BlockCtx, tp: &dyn Collectives, t: Tensor) -> Result<Tensor> {
    if ctx.sequence_parallel && tp.size() > 1 {
        tp.all_gather(&t)
    } else {
        Ok(t)
    }
}

/// The exit of a row-parallel layer: the sum over TP, or with sequence parallelism the
/// reduce-scatter to this rank's token slice (`[T, ..]` -> `[T / tp, ..]`).
fn sp_reduce(ctx: &BlockCtx, tp: &dyn Collectives, t: Tensor) -> Result<Tensor> {
    if ctx.sequence_parallel && tp.size() > 1 {
        tp.reduce_scatter(&t, ReduceOp::Sum)
    } else {
        tp_sum(tp, t)
    }
}

/// [`sp_reduce`] of `t` with `work` run meanwhile: overlapped under `ctx.comm_overlap` (when the
/// backend can), else the collective then the work.
fn sp_reduce_while(
    ctx: &BlockCtx,
    tp: &dyn Collectives,
    t: Tensor,
    work: &mut dyn FnMut() -> Result<()>,
) -> Result<Tensor> {
    if tp.size() == 1 || !ctx.comm_overlap {
        let r = sp_reduce(ctx, tp, t)?;
        work()?;
        return Ok(r);
    }
    tp.reduce_while(&t, ReduceOp::Sum, ctx.sequence_parallel, work)
}

/// A gradient that is partial over the token slices under sequence parallelism (norm weights,
/// o's bias): summed over TP then; as it is otherwise.
fn sp_partial(ctx: &BlockCtx, tp: &dyn Collectives, t: Tensor) -> Result<Tensor> {
    if ctx.sequence_parallel {
        tp_sum(tp, t)
    } else {
        Ok(t)
    }
}

/// Adds `g` to the gradient of `name` (the first contribution is stored as is; a later one is
/// added in the dtype of the sum, e.g. an f32 running sum over micro-batches).
pub fn put(grads: &mut BTreeMap<String, Tensor>, name: String, g: Tensor) -> Result<()> {
    let g = match grads.remove(&name) {
        Some(prev) => {
            let g = g.to_dtype(prev.dtype())?;
            (prev + g).map_err(|e| anyhow::anyhow!("adding to the gradient of {name}: {e}"))?
        }
        None => g,
    };
    grads.insert(name, g);
    Ok(())
}

/// Adds the weight gradient `dy^T x` to the gradient of `name`, by the GEMM itself when a sum is
/// already there (`vime_kernels::weight_grad_into`: on CUDA in place, no add pass).
fn put_wgrad(grads: &mut BTreeMap<String, Tensor>, name: String, dy: &Tensor, x: &Tensor) -> Result<()> {
    let prev = grads.remove(&name);
    let g = vime_kernels::weight_grad_into(prev, dy, x).map_err(|e| anyhow::anyhow!("gradient of {name}: {e}"))?;
    grads.insert(name, g);
    Ok(())
}

/// [`put_wgrad`] in FP8: `dyq^T x` from dyq's transpose and `xt`, the input's transpose as a
/// tensor of its own ([`Fp8Tensor::into_transpose`]), in f32, added by the GEMM to the running
/// sum if there is one.
fn put_wgrad_fp8(grads: &mut BTreeMap<String, Tensor>, name: String, dyq: &Fp8Tensor, xt: &Fp8Tensor) -> Result<()> {
    let prev = grads.remove(&name);
    let g = fp8::matmul_t(
        dyq,
        Side::Transposed,
        xt,
        Side::Rows,
        prev,
        candle_core::DType::F32,
        false,
    )
    .map_err(|e| anyhow::anyhow!("gradient of {name}: {e}"))?;
    grads.insert(name, g);
    Ok(())
}

impl Block {
    /// `sum_i dyq_i · W_i` in FP8 (from the weights' transposes), bf16: the input gradient of
    /// one input through its projections, each GEMM adding into the sum of the ones before (no
    /// add passes).
    fn dgrad_fp8_sum(&self, ctx: &BlockCtx, terms: &[(&Fp8Tensor, Proj)]) -> Result<Tensor> {
        let ws = terms
            .iter()
            .map(|&(_, p)| self.weight(ctx, p).fp8())
            .collect::<Result<Vec<_>>>()?;
        let t: Vec<fp8::Fp8Term<'_>> = terms
            .iter()
            .zip(&ws)
            .map(|(&(dyq, _), w)| (dyq, Side::Rows, &**w, Side::Transposed))
            .collect();
        Ok(fp8::matmul_t_sum(&t, candle_core::DType::BF16, false)?)
    }

    /// A linear weight as the FP8 helpers take it.
    fn weight<'a>(&'a self, ctx: &'a BlockCtx, p: Proj) -> Weight<'a> {
        let (name, var) = match p {
            Proj::Q => ("self_attn.q_proj.weight", &self.q_proj),
            Proj::K => ("self_attn.k_proj.weight", &self.k_proj),
            Proj::V => ("self_attn.v_proj.weight", &self.v_proj),
            Proj::O => ("self_attn.o_proj.weight", &self.o_proj),
            Proj::Gate => ("mlp.gate_proj.weight", &self.gate_proj),
            Proj::Up => ("mlp.up_proj.weight", &self.up_proj),
            Proj::Down => ("mlp.down_proj.weight", &self.down_proj),
        };
        Weight {
            ctx,
            layer: self.index,
            proj: p,
            name,
            var,
        }
    }

    /// The forward of a scoring pass in query chunks of `chunk` tokens (TP 1, nothing saved):
    /// the roped keys and the values of every token first (GQA keeps them small), then each
    /// chunk's queries attend their sequences' keys up to the chunk's end (the kernel's
    /// bottom-right causal mask with `L_k >= L_q`), and the o-projection and MLP run on the chunk.
    /// So no `[T, intermediate]` or `[T, q_heads x d]` tensor is ever live: at Qwen3-4B and 32k
    /// tokens the MLP alone would hold 1.8 GiB. The same values as [`Self::forward`].
    pub(crate) fn forward_chunked(
        &self,
        ctx: &BlockCtx,
        x: &Tensor,
        positions: &Arc<[u32]>,
        cu_seqlens: &Arc<[u32]>,
        chunk: usize,
    ) -> Result<Tensor> {
        let (d, eps) = (ctx.head_dim, ctx.eps);
        let t = x.dim(0)?;
        let chunk = chunk.max(1);
        let h1 = rms_norm(x, &dw(&self.input_norm), eps)?;
        let k = linear_scoring(self.weight(ctx, Proj::K), &h1, self.k_bias.as_ref())?.reshape((t, ctx.kv_heads, d))?;
        let v = linear_scoring(self.weight(ctx, Proj::V), &h1, self.v_bias.as_ref())?.reshape((t, ctx.kv_heads, d))?;
        let kr = rope(&rms_norm(&k, &dw(&self.k_norm), eps)?, positions, ctx.rope_theta)?;
        drop(k);
        let mut outs = Vec::with_capacity(t.div_ceil(chunk));
        let mut a = 0usize;
        while a < t {
            let b = (a + chunk).min(t);
            let n = b - a;
            let pos: Arc<[u32]> = positions[a..b].into();
            let q = linear_scoring(self.weight(ctx, Proj::Q), &h1.narrow(0, a, n)?, self.q_bias.as_ref())?
                .reshape((n, ctx.q_heads, d))?;
            let qr = rope(&rms_norm(&q, &dw(&self.q_norm), eps)?, &pos, ctx.rope_theta)?;
            drop(q);
            // Each sequence overlapping [a, b): its queries there, its keys from its start to b.
            // The sequences are packed back to back, so those keys are the one run of rows from
            // the first such sequence's start to b: a view of the keys, not a copy.
            let (mut cu_q, mut cu_k, mut k0) = (vec![0u32], vec![0u32], None);
            for w in cu_seqlens.windows(2) {
                let (start, end) = (w[0] as usize, w[1] as usize);
                let (qs, qe) = (start.max(a), end.min(b));
                if qs >= qe {
                    continue;
                }
                let k0 = *k0.get_or_insert(start);
                cu_q.push(cu_q.last().unwrap() + (qe - qs) as u32);
                cu_k.push((qe - k0) as u32);
            }
            let k0 = k0.unwrap_or(b);
            let (cu_q, cu_k): (Arc<[u32]>, Arc<[u32]>) = (cu_q.into(), cu_k.into());
            let (kc, vc) = (kr.narrow(0, k0, b - k0)?, v.narrow(0, k0, b - k0)?);
            let attn = varlen_attention(&qr, &kc, &vc, &cu_q, &cu_k, ctx.softmax_scale(), &ctx.kernels)?;
            drop((qr, kc, vc));
            let o = linear_scoring(self.weight(ctx, Proj::O), &attn.reshape((n, ctx.q_heads * d))?, None)?;
            let o = match &self.o_bias {
                Some(bias) => o.broadcast_add(&dw(bias))?,
                None => o,
            };
            let (x2, h2) = vime_kernels::add_rms_norm(&x.narrow(0, a, n)?, &o, &dw(&self.post_norm), eps)?;
            let gate = linear_scoring(self.weight(ctx, Proj::Gate), &h2, None)?;
            let up = linear_scoring(self.weight(ctx, Proj::Up), &h2, None)?;
            let down = if ctx.kernels.fp8() {
                // As `linear_scoring` quantizes (reading the history, recording nothing).
                let q = ctx.fp8_swiglu(self.index, &gate, &up, false, false)?;
                project_fp8(self.weight(ctx, Proj::Down), &q, None)?
            } else {
                linear_scoring(self.weight(ctx, Proj::Down), &swiglu(&gate, &up)?, None)?
            };
            outs.push(vime_kernels::add(&x2, &down)?);
            a = b;
        }
        Ok(Tensor::cat(&outs, 0)?)
    }

    /// The block's forward with no autograd graph, `x: [T, hidden]` -> `[T, hidden]` at RoPE
    /// `positions: [T]`, keeping what `keep` says for [`Self::backward`]. `reuse`: the attention
    /// this block's earlier forward over the same input kept ([`Keep::Attention`]), used instead
    /// of running attention again (the same values: the kernels are deterministic). `tp`: the
    /// tensor-parallel group whose rank holds these (local) weights.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn forward(
        &self,
        ctx: &BlockCtx,
        x: &Tensor,
        positions: &Arc<[u32]>,
        attention: &Attention<'_>,
        keep: Keep,
        reuse: Option<KeptAttention>,
        tp: &dyn Collectives,
    ) -> Result<(Tensor, Kept)> {
        let (d, eps) = (ctx.head_dim, ctx.eps);
        // Under SP the saved norms are this rank's token slices (`h1_local`, `h2_local`); the
        // backward gathers them again, as Megatron does, instead of keeping [T, hidden] twice.
        let h1_local = rms_norm(x, &dw(&self.input_norm), eps)?;
        let h1 = sp_gather(ctx, tp, h1_local.clone())?;
        let t = h1.dim(0)?;
        // Inference with fused weights (`crate::infer::DecodeWeights`): q|k|v and gate|up as one
        // GEMM each, the kernels below reading their heads and halves in place.
        // `--true-on-policy-mode` runs the trainer's op sequence exactly (separate projections,
        // separate norm and rope), so a decode row gets the trainer's bits.
        let decode_rows = match attention {
            Attention::Cached { rows, .. } if !ctx.kernels.batch_invariant() => Some(*rows),
            _ => None,
        };
        let fused = decode_rows.and_then(|rows| rows.fused_layer(self.index));
        // FP8 linear layers (training and scoring, not decoding): each input quantized once, with
        // its transpose when the backward will read it.
        let fp8 = ctx.kernels.fp8() && decode_rows.is_none();
        // Under delayed scaling only a forward that keeps everything records its amaxes: a
        // recompute's first forward and a scoring pass read the histories, and the recompute
        // (which keeps everything) records, so it quantizes with the scales of the pass it repeats.
        let keep_t = keep == Keep::All;
        let quant = |x: &Tensor, role: Fp8Role| -> Result<Option<Fp8Tensor>> {
            if fp8 {
                Ok(Some(ctx.fp8_act(
                    self.index,
                    role,
                    x,
                    Fp8Format::E4M3,
                    keep_t,
                    keep_t,
                )?))
            } else {
                Ok(None)
            }
        };
        let h1q = if fused.is_none() {
            quant(&h1, Fp8Role::H1)?
        } else {
            None
        };
        let (q, k, v) = if let Some((wqkv, _)) = fused {
            let (hq, hkv) = (ctx.q_heads, ctx.kv_heads);
            let qkv = h1.matmul(&wqkv.t()?)?.reshape((t, hq + 2 * hkv, d))?;
            (
                qkv.narrow(1, 0, hq)?,
                qkv.narrow(1, hq, hkv)?,
                qkv.narrow(1, hq + hkv, hkv)?,
            )
        } else {
            // Column-parallel q/k/v (this rank's heads): the identity here, the sum of dh1 back.
            let p = |w, bias: &Option<Var>| project(self.weight(ctx, w), &h1, h1q.as_ref(), bias.as_ref());
            (
                p(Proj::Q, &self.q_bias)?.reshape((t, ctx.q_heads, d))?,
                p(Proj::K, &self.k_bias)?.reshape((t, ctx.kv_heads, d))?,
                p(Proj::V, &self.v_bias)?.reshape((t, ctx.kv_heads, d))?,
            )
        };
        let (qr, kr) = if let Some(rows) = decode_rows {
            // Decoding: the four norm/rope kernels as one launch (the same bits).
            let (wq, wk) = (dw(&self.q_norm), dw(&self.k_norm));
            let pos_dev = rows.positions_dev();
            vime_kernels::rope::qk_norm_rope(&q, &k, &wq, &wk, eps, positions, pos_dev, ctx.rope_theta)?
        } else if !ctx.kernels.batch_invariant() {
            // Training and scoring: the same single launch (bit-equal to the four kernels below,
            // which `--true-on-policy-mode` keeps running as they are).
            let (wq, wk) = (dw(&self.q_norm), dw(&self.k_norm));
            vime_kernels::rope::qk_norm_rope(&q, &k, &wq, &wk, eps, positions, None, ctx.rope_theta)?
        } else {
            (
                rope(&rms_norm(&q, &dw(&self.q_norm), eps)?, positions, ctx.rope_theta)?,
                rope(&rms_norm(&k, &dw(&self.k_norm), eps)?, positions, ctx.rope_theta)?,
            )
        };
        let (attn, attn_saved) = match reuse {
            Some(k) => (k.attn, Some(k.saved)),
            None => attention.run(self.index, ctx, &qr, &kr, &v, keep != Keep::Nothing)?,
        };
        let a2 = attn.reshape((t, ctx.q_heads * d))?;
        // Row-parallel o_proj: the partial products summed over TP, the bias added once after.
        let a2q = quant(&a2, Fp8Role::A2)?;
        let o = sp_reduce(ctx, tp, project(self.weight(ctx, Proj::O), &a2, a2q.as_ref(), None)?)?;
        let o = match &self.o_bias {
            Some(b) => o.broadcast_add(&dw(b))?,
            None => o,
        };
        // The residual add and the post-attention norm in one pass (fused on CUDA).
        let (x2, h2_local) = vime_kernels::add_rms_norm(x, &o, &dw(&self.post_norm), eps)?;
        let h2 = sp_gather(ctx, tp, h2_local.clone())?;
        if let Some((_, wgu)) = fused {
            if keep != Keep::Nothing {
                bail!(
                    "layer {}: fused inference weights keep nothing for a backward",
                    self.index
                );
            }
            let act = vime_kernels::swiglu_packed(&h2.matmul(&wgu.t()?)?)?;
            let y = vime_kernels::add(
                &x2,
                &sp_reduce(ctx, tp, linear(&ctx.kernels, &act, &self.down_proj, None)?)?,
            )?;
            return Ok((y, Kept::Nothing));
        }
        // Column-parallel gate/up (this rank's share of the intermediate size).
        let h2q = quant(&h2, Fp8Role::H2)?;
        let gate = project(self.weight(ctx, Proj::Gate), &h2, h2q.as_ref(), None)?;
        let up = project(self.weight(ctx, Proj::Up), &h2, h2q.as_ref(), None)?;
        // Under FP8 the SwiGLU output exists only quantized (computed by the cast, under delayed
        // scaling): the down projection and the backward read nothing else.
        let act = if fp8 {
            Act::Fp8(ctx.fp8_swiglu(self.index, &gate, &up, keep_t, keep_t)?)
        } else {
            Act::Bf16(swiglu(&gate, &up)?)
        };
        // Row-parallel down_proj, summed over TP.
        let down = match &act {
            Act::Bf16(a) => project(self.weight(ctx, Proj::Down), a, None, None)?,
            Act::Fp8(q) => project_fp8(self.weight(ctx, Proj::Down), q, None)?,
        };
        let y = vime_kernels::add(&x2, &sp_reduce(ctx, tp, down)?)?;
        let attn_saved = match (keep, attn_saved) {
            (Keep::Nothing, _) => return Ok((y, Kept::Nothing)),
            (Keep::Attention, Some(saved)) => return Ok((y, Kept::Attention(KeptAttention { attn, saved }))),
            (_, Some(saved)) => saved,
            (_, None) => bail!("layer {}: attention kept nothing for the backward", self.index),
        };
        let inputs = match (h1q, a2q, h2q, act) {
            (Some(h1), Some(a2), Some(h2), Act::Fp8(act)) => LinearInputs::Fp8(SavedFp8 {
                h1: h1.into_transpose()?,
                a2: a2.into_transpose()?,
                h2: h2.into_transpose()?,
                act: act.into_transpose()?,
            }),
            (None, None, None, Act::Bf16(act)) => LinearInputs::Bf16 {
                h1: if ctx.sequence_parallel { h1_local } else { h1 },
                h2: if ctx.sequence_parallel { h2_local } else { h2 },
                act,
            },
            _ => bail!(
                "layer {}: a forward with some linear inputs in FP8 and some not",
                self.index
            ),
        };
        let saved = Saved {
            positions: positions.clone(),
            x: x.clone(),
            q,
            k,
            v,
            qr,
            kr,
            attn,
            attn_saved,
            x2,
            gate,
            up,
            inputs,
        };
        Ok((y, Kept::All(Box::new(saved))))
    }

    /// The backward from `dy = dL/dy`: adds the parameter gradients to `grads` (by HF name; the
    /// local shards under TP) and returns `dL/dx`. Under TP the duals of the forward's
    /// collectives: the input gradients of the column-parallel layers (`dh1`, `dh2`) are summed
    /// over the group, and so are the `q_norm` / `k_norm` weight gradients (partial over this
    /// rank's heads); everything else is local or already replicated.
    pub(crate) fn backward(
        &self,
        ctx: &BlockCtx,
        s: Saved,
        dy: &Tensor,
        grads: &mut BTreeMap<String, Tensor>,
        tp: &dyn Collectives,
        attention: &Attention<'_>,
    ) -> Result<Tensor> {
        let i = self.index;
        let name = |p: &str| format!("model.layers.{i}.{p}");
        // dW = dY^T X in the weight's own [out, in] layout, in f32 (f64 models: f64), added by
        // its GEMM to the sum already in `grads` (earlier micro-batches) if there is one.
        if ctx.kernels.fp8() != matches!(s.inputs, LinearInputs::Fp8(_)) {
            bail!(
                "layer {i}: an {} backward of a forward that ran {}",
                if ctx.kernels.fp8() { "FP8" } else { "bf16" },
                if ctx.kernels.fp8() { "bf16" } else { "FP8" }
            );
        }
        // MLP.
        let dy_all = sp_gather(ctx, tp, dy.clone())?;
        let (h2, act) = match &s.inputs {
            LinearInputs::Bf16 { h2, act, .. } => (h2.clone(), act.clone()),
            LinearInputs::Fp8(f) => {
                let dyq = ctx.fp8_act(self.index, Fp8Role::DDown, &dy_all, Fp8Format::E5M2, true, true)?;
                put_wgrad_fp8(grads, name("mlp.down_proj.weight"), &dyq, &f.act)?;
                let ds = self.dgrad_fp8_sum(ctx, &[(&dyq, Proj::Down)])?;
                drop((dyq, dy_all));
                let (dgq, duq) = ctx.fp8_swiglu_backward(self.index, &s.gate, &s.up, &ds)?;
                drop(ds);
                let dh2 = self.dgrad_fp8_sum(ctx, &[(&dgq, Proj::Gate), (&duq, Proj::Up)])?;
                let dh2 = sp_reduce_while(ctx, tp, dh2, &mut || {
                    put_wgrad_fp8(grads, name("mlp.gate_proj.weight"), &dgq, &f.h2)?;
                    put_wgrad_fp8(grads, name("mlp.up_proj.weight"), &duq, &f.h2)
                })?;
                return self.backward_attention(ctx, s, dy, dh2, grads, tp, attention);
            }
        };
        let h2 = &sp_gather(ctx, tp, h2)?;
        put_wgrad(grads, name("mlp.down_proj.weight"), &dy_all, &act)?;
        drop(act);
        let ds = dy_all.matmul(&dw(&self.down_proj))?;
        drop(dy_all);
        let (dg, du) = swiglu_backward(&s.gate, &s.up, &ds)?;
        drop(ds);
        // The input gradient first; its reduction runs while gate's and up's weight gradients
        // are computed.
        let dh2 = matmul_acc(dg.matmul(&dw(&self.gate_proj))?, &du, &dw(&self.up_proj))?;
        let dh2 = sp_reduce_while(ctx, tp, dh2, &mut || {
            put_wgrad(grads, name("mlp.gate_proj.weight"), &dg, h2)?;
            put_wgrad(grads, name("mlp.up_proj.weight"), &du, h2)
        })?;
        drop((dg, du));
        self.backward_attention(ctx, s, dy, dh2, grads, tp, attention)
    }

    /// The backward from the post-attention norm down: `dh2` is the gradient of the MLP's input
    /// (summed over TP), `dy` the block output's.
    #[allow(clippy::too_many_arguments)]
    fn backward_attention(
        &self,
        ctx: &BlockCtx,
        s: Saved,
        dy: &Tensor,
        dh2: Tensor,
        grads: &mut BTreeMap<String, Tensor>,
        tp: &dyn Collectives,
        attention: &Attention<'_>,
    ) -> Result<Tensor> {
        let (nh, nkv, d, eps) = (ctx.q_heads, ctx.kv_heads, ctx.head_dim, ctx.eps);
        let t = s.qr.dim(0)?;
        let i = self.index;
        let name = |p: &str| format!("model.layers.{i}.{p}");
        let bgrad = |dy2: &Tensor| -> Result<Tensor> { Ok(dy2.sum(0)?) };
        let f8 = match &s.inputs {
            LinearInputs::Fp8(f) => Some(f),
            LinearInputs::Bf16 { .. } => None,
        };
        // dx2 = dy + rms'(x2; dh2): the skip connection's gradient added in the norm's pass.
        let (dx2, dwpost) = rms_norm_backward_add(&s.x2, &dw(&self.post_norm), eps, &dh2, dy)?;
        put(
            grads,
            name("post_attention_layernorm.weight"),
            sp_partial(ctx, tp, dwpost)?,
        )?;

        // Attention output projection.
        let a2 = s.attn.reshape((t, nh * d))?;
        let dx2_all = sp_gather(ctx, tp, dx2.clone())?;
        if self.o_bias.is_some() {
            put(grads, name("self_attn.o_proj.bias"), sp_partial(ctx, tp, bgrad(&dx2)?)?)?;
        }
        let da = match f8 {
            Some(f) => {
                let dq = ctx.fp8_act(self.index, Fp8Role::DO, &dx2_all, Fp8Format::E5M2, true, true)?;
                put_wgrad_fp8(grads, name("self_attn.o_proj.weight"), &dq, &f.a2)?;
                self.dgrad_fp8_sum(ctx, &[(&dq, Proj::O)])?
            }
            None => {
                put_wgrad(grads, name("self_attn.o_proj.weight"), &dx2_all, &a2)?;
                dx2_all.matmul(&dw(&self.o_proj))?
            }
        };
        let da = da.reshape((t, nh, d))?;
        drop(dx2_all);
        let (dqr, dkr, dv) = match attention {
            // The prefix keys are gathered again (not saved); their gradients go back to the
            // ranks that hold those tokens.
            Attention::ContextParallel { shard, cp } => {
                let (kc, vc) = (shard.gather_keys(&s.kr, *cp)?, shard.gather_keys(&s.v, *cp)?);
                let (dq, dkc, dvc) = varlen_attention_backward(&s.attn_saved, &s.qr, &kc, &vc, &s.attn, &da)?;
                (
                    dq,
                    shard.scatter_key_grads(&dkc, &s.kr, *cp)?,
                    shard.scatter_key_grads(&dvc, &s.v, *cp)?,
                )
            }
            _ => varlen_attention_backward(&s.attn_saved, &s.qr, &s.kr, &s.v, &s.attn, &da)?,
        };
        drop(da);
        // The rotations back and the q/k norms' backward (one kernel on CUDA).
        let (dq, dk, dwqn, dwkn) = vime_kernels::rope::qk_norm_rope_backward(
            &dqr,
            &dkr,
            &s.q,
            &s.k,
            &dw(&self.q_norm),
            &dw(&self.k_norm),
            eps,
            &s.positions,
            ctx.rope_theta,
        )?;
        put(grads, name("self_attn.q_norm.weight"), tp_sum(tp, dwqn)?)?;
        put(grads, name("self_attn.k_norm.weight"), tp_sum(tp, dwkn)?)?;
        let dq = dq.reshape((t, nh * d))?;
        let dk = dk.reshape((t, nkv * d))?;
        let dv = dv.reshape((t, nkv * d))?;

        // q/k/v projections and the input norm.
        let h1 = match &s.inputs {
            LinearInputs::Bf16 { h1, .. } => Some(sp_gather(ctx, tp, h1.clone())?),
            LinearInputs::Fp8(_) => None,
        };
        // The input gradient first; its reduction runs while q's, k's and v's weight (and bias)
        // gradients are computed.
        let qkv8 = match f8 {
            Some(f) => Some((
                f,
                ctx.fp8_act(self.index, Fp8Role::DQ, &dq, Fp8Format::E5M2, true, true)?,
                ctx.fp8_act(self.index, Fp8Role::DK, &dk, Fp8Format::E5M2, true, true)?,
                ctx.fp8_act(self.index, Fp8Role::DV, &dv, Fp8Format::E5M2, true, true)?,
            )),
            None => None,
        };
        let dh1 = match &qkv8 {
            Some((_, q8, k8, v8)) => self.dgrad_fp8_sum(ctx, &[(q8, Proj::Q), (k8, Proj::K), (v8, Proj::V)])?,
            None => {
                let dh1 = matmul_acc(dq.matmul(&dw(&self.q_proj))?, &dk, &dw(&self.k_proj))?;
                matmul_acc(dh1, &dv, &dw(&self.v_proj))?
            }
        };
        let dh1 = sp_reduce_while(ctx, tp, dh1, &mut || {
            if let Some((f, q8, k8, v8)) = &qkv8 {
                put_wgrad_fp8(grads, name("self_attn.q_proj.weight"), q8, &f.h1)?;
                put_wgrad_fp8(grads, name("self_attn.k_proj.weight"), k8, &f.h1)?;
                put_wgrad_fp8(grads, name("self_attn.v_proj.weight"), v8, &f.h1)?;
            } else if let Some(h1) = &h1 {
                put_wgrad(grads, name("self_attn.q_proj.weight"), &dq, h1)?;
                put_wgrad(grads, name("self_attn.k_proj.weight"), &dk, h1)?;
                put_wgrad(grads, name("self_attn.v_proj.weight"), &dv, h1)?;
            }
            for (b, g, n) in [
                (&self.q_bias, &dq, "q"),
                (&self.k_bias, &dk, "k"),
                (&self.v_bias, &dv, "v"),
            ] {
                if b.is_some() {
                    put(grads, name(&format!("self_attn.{n}_proj.bias")), bgrad(g)?)?;
                }
            }
            Ok(())
        })?;
        let (dx, dwin) = rms_norm_backward_add(&s.x, &dw(&self.input_norm), eps, &dh1, &dx2)?;
        put(grads, name("input_layernorm.weight"), sp_partial(ctx, tp, dwin)?)?;
        Ok(dx)
    }

    /// Every parameter of the block, in a fixed order.
    pub(crate) fn vars(&self) -> Vec<&Var> {
        [
            Some(&self.input_norm),
            Some(&self.q_proj),
            Some(&self.k_proj),
            Some(&self.v_proj),
            Some(&self.o_proj),
            self.q_bias.as_ref(),
            self.k_bias.as_ref(),
            self.v_bias.as_ref(),
            self.o_bias.as_ref(),
            Some(&self.q_norm),
            Some(&self.k_norm),
            Some(&self.post_norm),
            Some(&self.gate_proj),
            Some(&self.up_proj),
            Some(&self.down_proj),
        ]
        .into_iter()
        .flatten()
        .collect()
    }
}

/// Tensor parallelism of one block on real CPU-backend groups (threads): TP = 2 and 4, with q/k/v
/// biases, against the same block at TP = 1, per output and per parameter gradient (the ranks'
/// shards concatenated along their split dim; replicated gradients equal on every rank).
#[cfg(test)]
mod tp_tests {
    use super::*;
    use crate::state_dict::layer_param_specs;
    use candle_core::{DType, Device};
    use vime_dist::layout::{LayoutEntry, LayoutTable};
    use vime_dist::SingleRank;
    use vime_kernels::testing::{rel_err, Rng};

    fn cfg() -> Qwen3Config {
        let mut c = Qwen3Config::preset("qwen3-0.6b").unwrap();
        c.hidden_size = 16;
        c.intermediate_size = 24;
        c.num_attention_heads = 8;
        c.num_key_value_heads = 4;
        c.head_dim = 4;
        c.attention_bias = true;
        c
    }

    fn global_tensors(c: &Qwen3Config) -> BTreeMap<String, Tensor> {
        let mut rng = Rng::new(9);
        layer_param_specs(c, 0)
            .into_iter()
            .map(|s| {
                let t = rng.randn(&s.shape, 0.3, DType::F32, &Device::Cpu).unwrap();
                let t = if s.name.ends_with("norm.weight") {
                    (t + 1.0).unwrap()
                } else {
                    t
                };
                (s.name, t)
            })
            .collect()
    }

    fn block_of(m: &BTreeMap<String, Tensor>) -> Block {
        let get = |n: &str| Var::from_tensor(&m[&format!("model.layers.0.{n}")]).unwrap();
        let opt = |n: &str| {
            m.get(&format!("model.layers.0.{n}"))
                .map(|t| Var::from_tensor(t).unwrap())
        };
        Block {
            index: 0,
            input_norm: get("input_layernorm.weight"),
            q_proj: get("self_attn.q_proj.weight"),
            k_proj: get("self_attn.k_proj.weight"),
            v_proj: get("self_attn.v_proj.weight"),
            o_proj: get("self_attn.o_proj.weight"),
            q_bias: opt("self_attn.q_proj.bias"),
            k_bias: opt("self_attn.k_proj.bias"),
            v_bias: opt("self_attn.v_proj.bias"),
            o_bias: opt("self_attn.o_proj.bias"),
            q_norm: get("self_attn.q_norm.weight"),
            k_norm: get("self_attn.k_norm.weight"),
            post_norm: get("post_attention_layernorm.weight"),
            gate_proj: get("mlp.gate_proj.weight"),
            up_proj: get("mlp.up_proj.weight"),
            down_proj: get("mlp.down_proj.weight"),
        }
    }

    fn table(c: &Qwen3Config, rank: usize, tp: usize) -> LayoutTable {
        let entries = layer_param_specs(c, 0)
            .into_iter()
            .map(|s| LayoutEntry::new(s.name, &s.shape, DType::F32, false, s.placement))
            .collect();
        LayoutTable::new(entries, rank, tp).unwrap()
    }

    type Run = (Tensor, Tensor, BTreeMap<String, Tensor>);

    /// Forward + backward of rank `tp.rank()`'s shard: (y, dx, local gradients).
    /// With `sp`, the rank gets (and returns) its slice of the tokens.
    fn run(
        c: &Qwen3Config,
        g: &BTreeMap<String, Tensor>,
        x: &Tensor,
        dy: &Tensor,
        tp: &dyn Collectives,
        sp: bool,
    ) -> Result<Run> {
        let (r, n) = (tp.rank(), tp.size());
        let tokens = |a: &Tensor| -> Result<Tensor> {
            let per = a.dim(0)? / n;
            Ok(if sp { a.narrow(0, r * per, per)? } else { a.clone() })
        };
        let (x, dy) = (&tokens(x)?, &tokens(dy)?);
        let t = table(c, r, n);
        let local: BTreeMap<String, Tensor> = g
            .iter()
            .map(|(k, v)| Ok((k.clone(), t.local_shard(k, v)?)))
            .collect::<Result<_>>()?;
        let block = block_of(&local);
        let mut ctx = BlockCtx::sharded(c, KernelConfig::default(), n)?;
        ctx.sequence_parallel = sp;
        let cu: Arc<[u32]> = vec![0u32, 5, 12].into();
        let positions: Arc<[u32]> = (0..5u32).chain(0..7).collect::<Vec<_>>().into();
        let att = Attention::Packed { cu_seqlens: &cu };
        let (y, saved) = block.forward(&ctx, x, &positions, &att, Keep::All, None, tp)?;
        let mut grads = BTreeMap::new();
        let dx = block.backward(&ctx, saved.into_saved()?, dy, &mut grads, tp, &att)?;
        Ok((y, dx, grads))
    }

    #[test]
    fn a_tp_size_that_splits_a_gqa_group_is_refused() {
        let e = format!(
            "{:#}",
            BlockCtx::sharded(&cfg(), KernelConfig::default(), 8).unwrap_err()
        );
        assert!(e.contains("(8)") && e.contains("num_key_value_heads (4)"), "{e}");
        let e = format!(
            "{:#}",
            BlockCtx::sharded(&cfg(), KernelConfig::default(), 0).unwrap_err()
        );
        assert!(e.contains("(0)"), "{e}");
    }

    #[test]
    fn tp2_and_tp4_equal_tp1_per_output_and_gradient() {
        check(false);
    }

    #[test]
    fn sequence_parallel_tp2_and_tp4_equal_tp1_per_output_and_gradient() {
        check(true);
    }

    fn check(sp: bool) {
        let c = cfg();
        let g = global_tensors(&c);
        let mut rng = Rng::new(4);
        let x = rng.randn(&[12, 16], 1.0, DType::F32, &Device::Cpu).unwrap();
        let dy = rng.randn(&[12, 16], 1.0, DType::F32, &Device::Cpu).unwrap();
        let (y1, dx1, g1) = run(&c, &g, &x, &dy, &SingleRank::default(), false).unwrap();
        for tp in [2usize, 4] {
            let runs = vime_dist::cpu::run_threads(tp, "tp", |_, grp| run(&c, &g, &x, &dy, grp, sp)).unwrap();
            let t0 = table(&c, 0, tp);
            let (ys, dxs): (Vec<Tensor>, Vec<Tensor>) = runs.iter().map(|r| (r.0.clone(), r.1.clone())).unzip();
            // Under SP each rank returns its token slice: the slices in rank order are the whole.
            let (ys, dxs) = if sp {
                (vec![Tensor::cat(&ys, 0).unwrap()], vec![Tensor::cat(&dxs, 0).unwrap()])
            } else {
                (ys, dxs)
            };
            for (r, (y, dx)) in ys.iter().zip(&dxs).enumerate() {
                let (ey, edx) = (rel_err(y, &y1).unwrap(), rel_err(dx, &dx1).unwrap());
                assert!(ey < 1e-5, "tp {tp} sp {sp} rank {r} y {ey}");
                assert!(edx < 1e-5, "tp {tp} sp {sp} rank {r} dx {edx}");
            }
            assert_eq!(g1.len(), runs[0].2.len());
            for (name, want) in &g1 {
                let placement = t0.get(name).unwrap().entry.placement;
                let got = match placement.split_dim() {
                    Some(d) => Tensor::cat(&runs.iter().map(|x| x.2[name].clone()).collect::<Vec<_>>(), d).unwrap(),
                    None => {
                        for (r, x) in runs.iter().enumerate() {
                            let e = rel_err(&x.2[name], &runs[0].2[name]).unwrap();
                            assert!(e < 1e-6, "tp {tp} sp {sp}: replicated {name} differs on rank {r} ({e})");
                        }
                        runs[0].2[name].clone()
                    }
                };
                let e = rel_err(&got, want).unwrap();
                assert!(
                    e < 1e-5,
                    "tp {tp} sp {sp}: gradient of {name} ({placement:?}) off by {e}"
                );
            }
        }
    }
}

#[cfg(test)]
mod fp8_cache_tests {
    use super::*;
    use candle_core::{DType, Device};

    /// Inside a scope a weight is quantized once (every use gets the same copy, by pointer) and
    /// a nested open keeps the copies; outside one, and after the scope closes, each use
    /// quantizes afresh (same bits, a new copy).
    #[test]
    fn a_weight_is_quantized_once_per_scope() {
        let w = Var::from_tensor(
            &Tensor::randn(0f32, 1.0, (32, 16), &Device::Cpu)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap(),
        )
        .unwrap();
        let cache = Fp8WeightCache::default();
        let get = || cache.get("model.layers.0.mlp.up_proj.weight", &w).unwrap();
        assert!(!Arc::ptr_eq(&get(), &get()), "no scope: a fresh copy each time");
        assert!(cache.open());
        let first = get();
        assert!(Arc::ptr_eq(&first, &get()), "in a scope: one copy");
        assert!(!cache.open(), "a nested open leaves the scope as it is");
        assert!(Arc::ptr_eq(&first, &get()), "the nested open kept the copy");
        assert!(first.data_t.is_some(), "the transpose is there for the backward");
        cache.close();
        let after = get();
        assert!(!Arc::ptr_eq(&first, &after), "closed: a fresh copy");
        let bits = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<u8>().unwrap();
        assert_eq!(bits(&first.data), bits(&after.data));
    }
}
