//! Per-token log-prob of the target and entropy of the next-token distribution, straight from the
//! final-normed hidden states and the LM head, without ever holding the `[T, V]` logits.
//!
//!   z_i      = hidden_i . lm_head^T                      (logits of token i, [V])
//!   logp_i   = z_i - m_i - ln s_i,   m_i = max z_i,   s_i = sum_v exp(z_iv - m_i)
//!   lp_i     = logp_i[target_i]                          (0 and no gradient for IGNORE_TARGET)
//!   H_i      = -sum_v p_iv logp_iv = ln s_i - (1/s_i) sum_v exp(z_iv - m_i)(z_iv - m_i)
//! The second form of `H` is a sum of two non-negative terms, so it has no cancellation and needs
//! one pass over the row. Backward, with `g = [g_lp, g_ent]` per token:
//!   dz        = g_lp * (onehot(target) - p) - g_ent * p * (logp + H)
//!   d_hidden  = dz @ lm_head                 d_lm_head = sum over chunks of dz^T @ hidden_chunk
//!
//! Decisions:
//! - Tokens are processed `chunk_tokens` at a time, forward and backward, so at most one
//!   `[chunk_tokens, V]` block of logits (reused in place as `dz` in the backward) is alive. The
//!   backward recomputes the logits rather than saving anything from the forward. Besides that
//!   block, the backward holds the `[V, H]` `d_lm_head` accumulator and one `[V, H]` per-chunk
//!   product that is added into it.
//! - On CUDA, a training forward ([`logprobs_entropy_saved_with`]) keeps the f32 logits instead
//!   when they fit `KernelConfig::head_logits_max_bytes` (by default 1/16 of device memory), and
//!   the backward ([`logprobs_entropy_backward_into`]) reads them rather than running the logits
//!   GEMM again: a third of the head's GEMM time, for `4 T V` bytes alive between the two. The
//!   bits are the same, the recompute being the same GEMM on the same block.
//! - The GEMMs are candle's CPU matmul called on the storages with strided layouts (a row range
//!   of `hidden`, `lm_head` transposed, `dz` transposed), so f32/f64 weights are used in place
//!   without a copy. bf16/f16 inputs are widened to f32 once (the whole `lm_head`, a `[V, H]` f32
//!   copy) so every dot product accumulates in f32; f64 stays f64.
//! - The op's output is `[T, 2]` (logprob, entropy) in the accumulation dtype (f32, or f64 for f64
//!   inputs) whatever the input dtype; the public function narrows it into two contiguous `[T]`
//!   tensors. Gradients come back in the input dtype.
//! - `d_lm_head` is accumulated in the accumulation dtype, chunk by chunk in token order, so a run
//!   is bitwise reproducible for a given chunk size. Different chunk sizes agree only to rounding
//!   (~1e-7 relative in f32): gemm's kernels depend on the row count, and `d_lm_head` is grouped
//!   by chunk.
//! - The softmax statistics are per row and parallel over rows (rayon); nothing is reduced across
//!   rows except `d_lm_head`, which is the GEMM's own reduction plus the ordered chunk sum.
use crate::config::{HeadLogits, KernelConfig};
use crate::real::{same_dtype, Real};
use crate::with_acc;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor, WithDType};
use rayon::prelude::*;
use std::borrow::Cow;
use std::sync::Arc;

pub use crate::checks::IGNORE_TARGET;

/// Elements per rayon task when adding a chunk's `d_lm_head` into the accumulator.
const ADD_CHUNK: usize = 1 << 16;

/// The f32 logits `hidden . lm_head^T` (`[N, H] x [V, H] -> [N, V]`), no gradient: what the
/// built-in engine samples from. bf16 on CUDA is one cuBLAS GEMM with f32 accumulation and f32
/// output (the logits are never rounded to bf16, as in [`logprobs_entropy`]); elsewhere both
/// sides are widened to f32 and multiplied.
pub fn logits_f32(hidden: &Tensor, lm_head: &Tensor) -> Result<Tensor> {
    logits_f32_with(hidden, lm_head, &KernelConfig::default())
}

/// [`logits_f32`] under the kernel choice `kernels`: in its batch-invariant mode bf16 on CUDA
/// runs the batch-invariant GEMM, whose logits equal [`logprobs_entropy_with`]'s bit for bit.
pub fn logits_f32_with(hidden: &Tensor, lm_head: &Tensor, kernels: &KernelConfig) -> Result<Tensor> {
    let (n, h) = hidden.dims2()?;
    let (v, h2) = lm_head.dims2()?;
    if h != h2 {
        bail!(
            "logits_f32: hidden {:?} and lm_head {:?} differ in width",
            hidden.dims(),
            lm_head.dims()
        );
    }
    #[cfg(feature = "cuda")]
    if crate::cuda::fused(hidden.device(), hidden.dtype()) && lm_head.dtype() == hidden.dtype() && n > 0 {
        if kernels.batch_invariant() {
            // One K-split, as the trainer's vocabulary-chunked GEMM in `lm_head_fwd`.
            return crate::cuda::bi_matmul_t(hidden, lm_head, true, 1);
        }
        return crate::cuda::logits_f32(&hidden.contiguous()?, &lm_head.contiguous()?, n, v, h);
    }
    let _ = (n, v, kernels);
    hidden
        .to_dtype(candle_core::DType::F32)?
        .matmul(&lm_head.to_dtype(candle_core::DType::F32)?.t()?)
}

/// Per-token `(logprob of target, entropy)` of `softmax(hidden @ lm_head^T)`, both `[T]`, f32 (f64
/// for f64 inputs), with backward to `hidden` and `lm_head`.
///
/// `hidden: [T, H]`, `lm_head: [V, H]` (HF `lm_head.weight` layout or the tied embedding),
/// `targets: [T]` ids in `0..V` or [`IGNORE_TARGET`]; at most `chunk_tokens` rows of logits are
/// materialised at a time.
pub fn logprobs_entropy(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Arc<[u32]>,
    chunk_tokens: usize,
) -> Result<(Tensor, Tensor)> {
    logprobs_entropy_with(hidden, lm_head, targets, chunk_tokens, &KernelConfig::default())
}

/// [`logprobs_entropy`] under the kernel choice `kernels` (its batch-invariant mode).
pub fn logprobs_entropy_with(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Arc<[u32]>,
    chunk_tokens: usize,
    kernels: &KernelConfig,
) -> Result<(Tensor, Tensor)> {
    let fused = crate::fused_cuda(hidden.device(), hidden.dtype()) && lm_head.dtype() == hidden.dtype();
    if !(hidden.device().is_cpu() || fused) {
        return crate::composed::logprobs_entropy(hidden, lm_head, targets, chunk_tokens);
    }
    crate::checks::lm_head(hidden, lm_head, targets, chunk_tokens)?;
    let op = LmHead::new(targets, chunk_tokens, kernels);
    let out = hidden.contiguous()?.apply_op2(&lm_head.contiguous()?, op)?;
    split(&out)
}

/// The op's `[T, 2]` (or `[T, 3]`) output as two contiguous `[T]` tensors: log-probs, entropy.
fn split(out: &Tensor) -> Result<(Tensor, Tensor)> {
    let logprobs = out.narrow(1, 0, 1)?.squeeze(1)?.contiguous()?;
    let entropy = out.narrow(1, 1, 1)?.squeeze(1)?.contiguous()?;
    Ok((logprobs, entropy))
}

/// What [`logprobs_entropy_backward`] needs from [`logprobs_entropy_saved`]: the kernel op and
/// its raw output, or, where no kernel exists, the composed op's local autograd graph.
#[derive(Debug, Clone)]
pub struct LmHeadSaved(SavedLmHead);

#[derive(Debug, Clone)]
enum SavedLmHead {
    Kernel {
        op: LmHead,
        /// The op's raw output (`[T, 2]`, or `[T, 3]` with the log-sum-exp on CUDA).
        out: Tensor,
        /// On CUDA, the forward's logits (f32, or bf16 under `HeadLogits::Bf16`) when they fit
        /// `KernelConfig::head_logits_max_bytes` (`[T * V]`, in the kernels' block order), which
        /// the backward reads instead of computing them again.
        #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
        logits: Option<Tensor>,
    },
    /// The composed op's graph, its output `[T, 2]` (logprob, entropy).
    Graph(crate::composed::Graph),
}

/// [`logprobs_entropy`] without autograd, for hand-written backward passes: `(logprobs, entropy)`
/// and what the backward needs. Every device and dtype: where no kernel exists the composed op
/// runs on leaf copies of `hidden` and `lm_head` and keeps its graph (`[T, V]` intermediates, as
/// autograd over it would) for the backward.
pub fn logprobs_entropy_saved(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Arc<[u32]>,
    chunk_tokens: usize,
) -> Result<(Tensor, Tensor, LmHeadSaved)> {
    logprobs_entropy_saved_with(hidden, lm_head, targets, chunk_tokens, &KernelConfig::default())
}

/// [`logprobs_entropy_saved`] under the kernel choice `kernels` (its batch-invariant mode; the
/// backward is the same either way).
pub fn logprobs_entropy_saved_with(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Arc<[u32]>,
    chunk_tokens: usize,
    kernels: &KernelConfig,
) -> Result<(Tensor, Tensor, LmHeadSaved)> {
    let fused = crate::fused_cuda(hidden.device(), hidden.dtype()) && lm_head.dtype() == hidden.dtype();
    if !(hidden.device().is_cpu() || fused) {
        let (out, graph) = crate::composed::Graph::run(&[hidden, lm_head], |t| {
            let (lp, ent) = crate::composed::logprobs_entropy(&t[0], &t[1], targets, chunk_tokens)?;
            Tensor::stack(&[lp, ent], 1)
        })?;
        let (lp, ent) = split(&out)?;
        return Ok((lp, ent, LmHeadSaved(SavedLmHead::Graph(graph))));
    }
    crate::checks::lm_head(hidden, lm_head, targets, chunk_tokens)?;
    let op = LmHead::new(targets, chunk_tokens, kernels);
    let (hidden, lm_head) = (hidden.contiguous()?, lm_head.contiguous()?);
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(dev) = hidden.device() {
        // The logits of a training forward (the backward's GEMM then skipped), when they fit.
        let bytes = hidden.dim(0)? * lm_head.dim(0)? * if op.bf16_logits { 2 } else { 4 };
        let cap = kernels.head_logits_max_bytes(dev.cuda_stream().context().total_mem().unwrap_or(0));
        if fused && !op.invariant && bytes > 0 && bytes <= cap {
            let (out, logits) = crate::cuda::lm_head_fwd_kept(&hidden, &lm_head, targets, chunk_tokens, op.gemm())?;
            let (logprobs, entropy) = split(&out)?;
            let logits = Some(logits);
            return Ok((logprobs, entropy, LmHeadSaved(SavedLmHead::Kernel { op, out, logits })));
        }
    }
    let out = hidden.apply_op2_no_bwd(&lm_head, &op)?;
    let (logprobs, entropy) = split(&out)?;
    let logits = None;
    Ok((logprobs, entropy, LmHeadSaved(SavedLmHead::Kernel { op, out, logits })))
}

/// The backward of [`logprobs_entropy_saved`]: `(d_hidden, d_lm_head)` (input dtype) for the
/// gradients `d_logprobs`, `d_entropy` (`[T]`) of its two outputs.
pub fn logprobs_entropy_backward(
    saved: &LmHeadSaved,
    hidden: &Tensor,
    lm_head: &Tensor,
    d_logprobs: &Tensor,
    d_entropy: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (op, out) = match &saved.0 {
        SavedLmHead::Kernel { op, out, .. } => (op, out),
        SavedLmHead::Graph(graph) => {
            let d = Tensor::stack(&[d_logprobs.clone(), d_entropy.to_dtype(d_logprobs.dtype())?], 1)?;
            let mut g = graph.backward(&d)?.into_iter();
            let (dh, dw) = (g.next(), g.next());
            return Ok((dh.expect("lm head d_hidden"), dw.expect("lm head d_lm_head")));
        }
    };
    let grad = output_grad(out, d_logprobs, d_entropy)?;
    let (dh, dw) = op.bwd(&hidden.contiguous()?, &lm_head.contiguous()?, out, &grad)?;
    Ok((dh.expect("lm head d_hidden"), dw.expect("lm head d_lm_head")))
}

/// The gradient of the kernel op's raw output `out` (`[T, 2]`, or `[T, 3]` on CUDA) from those of
/// its two outputs: `[d_logprobs, d_entropy]` per token, zeros for CUDA's third column (the
/// log-sum-exp, internal: no gradient).
fn output_grad(out: &Tensor, d_logprobs: &Tensor, d_entropy: &Tensor) -> Result<Tensor> {
    let (t, cols) = out.dims2()?;
    if d_logprobs.dims() != [t] || d_entropy.dims() != [t] {
        bail!(
            "logprobs_entropy_backward: gradients {:?} and {:?} for {t} tokens",
            d_logprobs.dims(),
            d_entropy.dims()
        );
    }
    let dt = out.dtype();
    let grad = Tensor::stack(&[d_logprobs.to_dtype(dt)?, d_entropy.to_dtype(dt)?], 1)?;
    if cols > 2 {
        return Tensor::cat(&[grad, Tensor::zeros((t, cols - 2), dt, out.device())?], 1);
    }
    Ok(grad)
}

/// [`logprobs_entropy_backward`] with `d_lm_head` added to the running gradient sum `sum: [V, H]`
/// (f32, or f64 for f64 inputs): `(d_hidden, sum + d_lm_head)`. On CUDA (bf16) the head's GEMMs add
/// into `sum` in place (it must not be shared; the returned tensor is `sum` itself), so the
/// weight's gradient is never rounded to bf16 and no `[V, H]` buffer of its own is allocated;
/// elsewhere the gradient is computed as by [`logprobs_entropy_backward`] and added.
pub fn logprobs_entropy_backward_into(
    saved: &LmHeadSaved,
    hidden: &Tensor,
    lm_head: &Tensor,
    d_logprobs: &Tensor,
    d_entropy: &Tensor,
    sum: Tensor,
) -> Result<(Tensor, Tensor)> {
    if sum.dims() != lm_head.dims() {
        bail!(
            "logprobs_entropy_backward: the running sum is {:?}, the LM head {:?}",
            sum.dims(),
            lm_head.dims()
        );
    }
    #[cfg(feature = "cuda")]
    if let SavedLmHead::Kernel { op, out, logits } = &saved.0 {
        if out.device().is_cuda() && sum.dtype() == candle_core::DType::F32 && sum.is_contiguous() {
            let grad = output_grad(out, d_logprobs, d_entropy)?;
            let dh = crate::cuda::lm_head_bwd_into(
                &hidden.contiguous()?,
                &lm_head.contiguous()?,
                &grad,
                out,
                &op.targets,
                op.chunk_tokens,
                &sum,
                logits.as_ref(),
                op.gemm(),
            )?;
            return Ok((dh, sum));
        }
    }
    let (dh, dw) = logprobs_entropy_backward(saved, hidden, lm_head, d_logprobs, d_entropy)?;
    let total = (sum.clone() + dw.to_dtype(sum.dtype())?)?;
    Ok((dh, total))
}

/// A vocabulary shard's statistics for the vocabulary-parallel LM head, on the fused CUDA kernels
/// (bf16 `hidden [T, H]` and `w_shard [V_shard, H]` on CUDA, the shard's first row vocabulary id
/// `v_offset`, `targets` global ids): `[T, 4]` f32 per token, `(M, s, a, z_t)` with `M` the
/// shard's largest logit, `s = sum exp(z - M)`, `a = sum exp(z - M) (z - M)` and `z_t` the
/// target's logit where the shard holds it (0 elsewhere). Merged over the shards in any order
/// (`m = max M_r`, `s = sum s_r e^(M_r - m)`, `a = sum (a_r + (M_r - m) s_r) e^(M_r - m)`,
/// `z_t = sum z_t,r`), `lse = m + ln s`, `logp = z_t - lse` and `H = ln s - a / s`. `None` where
/// the kernels do not apply (other devices or dtypes): the caller composes the op.
pub fn shard_stats(
    hidden: &Tensor,
    w_shard: &Tensor,
    targets: &[u32],
    v_offset: usize,
    chunk_tokens: usize,
    logits: HeadLogits,
) -> Result<Option<Tensor>> {
    if !shard_kernels(hidden, w_shard) {
        return Ok(None);
    }
    shard_check(hidden, w_shard, targets, chunk_tokens)?;
    #[cfg(feature = "cuda")]
    let out = {
        let (h, w) = (hidden.contiguous()?, w_shard.contiguous()?);
        let gemm = crate::cuda::HeadGemm::of(false, logits == HeadLogits::Bf16);
        crate::cuda::lm_head_shard_stats(&h, &w, targets, v_offset, chunk_tokens, gemm).map(Some)
    };
    #[cfg(not(feature = "cuda"))]
    let out = {
        let _ = (v_offset, logits);
        Ok(None)
    };
    out
}

/// The backward of a vocabulary shard ([`shard_stats`]' kernels): `(d_hidden, d_w_shard)` for the
/// gradients `d_logprobs`, `d_entropy` (`[T]`) of the whole-vocabulary outputs whose `lse` and
/// `entropy` (`[T]` f32) the merged statistics gave. `d_hidden` is `[T, H]` f32, this shard's
/// share (to be summed over the shards); `d_w_shard` `[V_shard, H]` bf16. `None` where the kernels
/// do not apply.
#[allow(clippy::too_many_arguments)]
pub fn shard_backward(
    hidden: &Tensor,
    w_shard: &Tensor,
    targets: &[u32],
    v_offset: usize,
    lse: &Tensor,
    entropy: &Tensor,
    d_logprobs: &Tensor,
    d_entropy: &Tensor,
    chunk_tokens: usize,
    logits: HeadLogits,
) -> Result<Option<(Tensor, Tensor)>> {
    if !shard_kernels(hidden, w_shard) {
        return Ok(None);
    }
    shard_check(hidden, w_shard, targets, chunk_tokens)?;
    let t = targets.len();
    for (what, x) in [("lse", lse), ("entropy", entropy)] {
        if x.dims() != [t] {
            bail!("vocab-parallel LM head backward: {what} is {:?}, not [{t}]", x.dims());
        }
    }
    let f = |x: &Tensor| x.to_dtype(candle_core::DType::F32);
    // The kernel's saved-output layout (logprob, entropy, lse); the backward reads the last two.
    let zeros = Tensor::zeros(t, candle_core::DType::F32, hidden.device())?;
    let fwd_out = Tensor::stack(&[zeros, f(entropy)?, f(lse)?], 1)?;
    // Checks the gradients' shapes too.
    let grad = output_grad(&fwd_out, d_logprobs, d_entropy)?;
    #[cfg(feature = "cuda")]
    let out = {
        let (h, w) = (hidden.contiguous()?, w_shard.contiguous()?);
        let gemm = crate::cuda::HeadGemm::of(false, logits == HeadLogits::Bf16);
        crate::cuda::lm_head_shard_bwd(&h, &w, targets, v_offset, &fwd_out, &grad, chunk_tokens, gemm).map(Some)
    };
    #[cfg(not(feature = "cuda"))]
    let out = {
        let _ = (v_offset, fwd_out, grad, logits);
        Ok(None)
    };
    out
}

/// Whether the vocabulary-shard kernels run: bf16 `hidden` and weight, both on one CUDA device.
fn shard_kernels(hidden: &Tensor, w_shard: &Tensor) -> bool {
    crate::fused_cuda(hidden.device(), hidden.dtype())
        && w_shard.dtype() == hidden.dtype()
        && hidden.device().same_device(w_shard.device())
}

fn shard_check(hidden: &Tensor, w_shard: &Tensor, targets: &[u32], chunk_tokens: usize) -> Result<()> {
    match (hidden.dims(), w_shard.dims()) {
        (&[t, h], &[v, hw]) if hw == h && targets.len() == t && v > 0 && chunk_tokens > 0 => Ok(()),
        (a, b) => bail!(
            "vocab-parallel LM head: bad shapes hidden {a:?}, shard {b:?} for {} targets, chunk {chunk_tokens}",
            targets.len()
        ),
    }
}

#[derive(Debug, Clone)]
struct LmHead {
    targets: Arc<[u32]>,
    chunk_tokens: usize,
    /// `--true-on-policy-mode`: the logits by the batch-invariant GEMM on CUDA (no effect on the
    /// CPU, whose GEMM already sums every row in one order).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    invariant: bool,
    /// `--lm-head-logits bf16` ([`HeadLogits::Bf16`]) for bf16 inputs: the logits rounded to bf16
    /// before the softmax, forward and backward. Never with `invariant`, whose logits stay f32.
    bf16_logits: bool,
}

impl LmHead {
    fn new(targets: &Arc<[u32]>, chunk_tokens: usize, kernels: &KernelConfig) -> Self {
        let invariant = kernels.batch_invariant();
        Self {
            targets: targets.clone(),
            chunk_tokens,
            invariant,
            bf16_logits: kernels.head_logits() == HeadLogits::Bf16 && !invariant,
        }
    }

    /// The CUDA logits GEMM these settings run.
    #[cfg(feature = "cuda")]
    fn gemm(&self) -> crate::cuda::HeadGemm {
        crate::cuda::HeadGemm::of(self.invariant, self.bf16_logits)
    }
}

/// `(T, H, V)` from the layouts of `hidden` and `lm_head`, re-checked so a bad call errors.
fn sizes(op: &str, lh: &Layout, lw: &Layout, targets: &[u32], chunk_tokens: usize) -> Result<(usize, usize, usize)> {
    match (lh.dims(), lw.dims()) {
        (&[t, h], &[v, hw]) if hw == h && targets.len() == t && v > 0 && chunk_tokens > 0 => Ok((t, h, v)),
        (a, b) => bail!(
            "{op}: bad shapes hidden {a:?}, lm_head {b:?} for {} targets",
            targets.len()
        ),
    }
}

/// `s` in the accumulation dtype `R`: borrowed when it already is, widened once otherwise.
fn in_acc<'a, R: WithDType>(s: &'a CpuStorage, l: &Layout) -> Result<(Cow<'a, CpuStorage>, Layout)> {
    if s.dtype() == R::DTYPE {
        Ok((Cow::Borrowed(s), l.clone()))
    } else {
        Ok((
            Cow::Owned(s.to_dtype(l, R::DTYPE)?),
            Layout::contiguous(l.shape().clone()),
        ))
    }
}

/// Logits of tokens `start..start + len`: `hidden[start..start + len] @ lm_head^T`, `[len, V]`,
/// each rounded to bf16 (and widened back) when `round_bf16`.
#[allow(clippy::too_many_arguments)]
fn chunk_logits<R: Real + WithDType>(
    hs: &CpuStorage,
    hl: &Layout,
    ws: &CpuStorage,
    wl: &Layout,
    start: usize,
    len: usize,
    h: usize,
    v: usize,
    round_bf16: bool,
) -> Result<Vec<R>> {
    let z = hs.matmul(ws, (1, len, v, h), &hl.narrow(0, start, len)?, &wl.transpose(0, 1)?)?;
    let mut z = R::cpu_storage_data(z)?;
    if round_bf16 {
        // Where the CUDA GEMM rounds its f32 sums to bf16 (`HeadLogits::Bf16`).
        z.par_iter_mut()
            .for_each(|x| *x = <R as Real>::from_f64(half::bf16::from_f64(Real::to_f64(*x)).to_f64()));
    }
    Ok(z)
}

/// `(m, ln s, H)` of one row of logits (see the module header).
fn row_stats<R: Real>(z: &[R]) -> (R, R, R) {
    let mut m = R::NEG_INFINITY;
    for &x in z {
        m = m.max(x);
    }
    let (mut s, mut a) = (R::ZERO, R::ZERO);
    for &x in z {
        let d = x - m;
        let e = d.exp();
        s += e;
        a += e * d;
    }
    let ln_s = s.ln();
    (m, ln_s, ln_s - a / s)
}

/// Overwrites one row of logits with `dz`.
fn dlogits_row<R: Real>(row: &mut [R], target: u32, g_lp: R, g_ent: R) {
    let (m, ln_s, ent) = row_stats(row);
    let g_lp = if target == IGNORE_TARGET { R::ZERO } else { g_lp };
    for x in row.iter_mut() {
        let logp = (*x - m) - ln_s;
        let p = logp.exp();
        *x = -p * (g_lp + g_ent * (logp + ent));
    }
    if target != IGNORE_TARGET {
        row[target as usize] += g_lp;
    }
}

/// Returns `[lp_0, H_0, lp_1, H_1, ...]`.
#[allow(clippy::too_many_arguments)]
fn forward<R: Real + WithDType>(
    hs: &CpuStorage,
    hl: &Layout,
    ws: &CpuStorage,
    wl: &Layout,
    targets: &[u32],
    chunk_tokens: usize,
    (t, h, v): (usize, usize, usize),
    round_bf16: bool,
) -> Result<Vec<R>> {
    let mut out = vec![R::ZERO; 2 * t];
    for start in (0..t).step_by(chunk_tokens) {
        let len = (t - start).min(chunk_tokens);
        let out_c = &mut out[2 * start..2 * (start + len)];
        let z = chunk_logits::<R>(hs, hl, ws, wl, start, len, h, v, round_bf16)?;
        out_c
            .par_chunks_mut(2)
            .zip(z.par_chunks(v))
            .zip(targets[start..start + len].par_iter())
            .for_each(|((o, row), &tg)| {
                let (m, ln_s, ent) = row_stats(row);
                o[0] = if tg == IGNORE_TARGET {
                    R::ZERO
                } else {
                    (row[tg as usize] - m) - ln_s
                };
                o[1] = ent;
            });
    }
    Ok(out)
}

/// Returns `[d_hidden (flat) ++ d_lm_head (flat)]`; `g` is the `[T, 2]` output gradient, flat.
#[allow(clippy::too_many_arguments)]
fn backward<R: Real + WithDType>(
    hs: &CpuStorage,
    hl: &Layout,
    ws: &CpuStorage,
    wl: &Layout,
    g: &[R],
    targets: &[u32],
    chunk_tokens: usize,
    (t, h, v): (usize, usize, usize),
    round_bf16: bool,
) -> Result<Vec<R>> {
    let mut out = vec![R::ZERO; t * h + v * h];
    let (dh, dw) = out.split_at_mut(t * h);
    for start in (0..t).step_by(chunk_tokens) {
        let len = (t - start).min(chunk_tokens);
        let mut z = chunk_logits::<R>(hs, hl, ws, wl, start, len, h, v, round_bf16)?;
        z.par_chunks_mut(v)
            .zip(targets[start..start + len].par_iter())
            .zip(g[2 * start..2 * (start + len)].par_chunks(2))
            .for_each(|((row, &tg), gr)| dlogits_row(row, tg, gr[0], gr[1]));
        let dz = R::to_cpu_storage_owned(z);
        let dz_l = Layout::contiguous((len, v));
        let dh_part = dz.matmul(ws, (1, len, h, v), &dz_l, wl)?;
        dh[start * h..(start + len) * h].copy_from_slice(R::cpu_storage_as_slice(&dh_part)?);
        let dw_part = dz.matmul(hs, (1, v, h, len), &dz_l.transpose(0, 1)?, &hl.narrow(0, start, len)?)?;
        dw.par_chunks_mut(ADD_CHUNK)
            .zip(R::cpu_storage_as_slice(&dw_part)?.par_chunks(ADD_CHUNK))
            .for_each(|(acc, part)| {
                for (a, &p) in acc.iter_mut().zip(part) {
                    *a += p;
                }
            });
    }
    Ok(out)
}

impl CustomOp2 for LmHead {
    fn name(&self) -> &'static str {
        "vime-lm-head-logprobs-entropy"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let dtype = same_dtype("logprobs_entropy", &[s1.dtype(), s2.dtype()])?;
        let dims = sizes("logprobs_entropy", l1, l2, &self.targets, self.chunk_tokens)?;
        with_acc!(dtype, R => {
            let (hs, hl) = in_acc::<R>(s1, l1)?;
            let (ws, wl) = in_acc::<R>(s2, l2)?;
            let round = self.bf16_logits && dtype == candle_core::DType::BF16;
            let out = forward::<R>(&hs, &hl, &ws, &wl, &self.targets, self.chunk_tokens, dims, round)?;
            Ok((R::to_cpu_storage_owned(out), Shape::from((dims.0, 2))))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        sizes("logprobs_entropy", l1, l2, &self.targets, self.chunk_tokens)?;
        crate::cuda::lm_head_fwd(s1, l1, s2, l2, &self.targets, self.chunk_tokens, self.gemm())
    }

    fn bwd(
        &self,
        hidden: &Tensor,
        lm_head: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let hidden = hidden.contiguous()?;
        let lm_head = lm_head.contiguous()?;
        let op = LmHeadBwd {
            targets: self.targets.clone(),
            chunk_tokens: self.chunk_tokens,
            bf16_logits: self.bf16_logits,
            fwd_out: res.clone(),
        };
        let packed = hidden.apply_op3_no_bwd(&lm_head, &grad.contiguous()?, &op)?;
        let n = hidden.elem_count();
        let d_hidden = packed.narrow(0, 0, n)?.reshape(hidden.shape())?;
        let d_lm_head = packed.narrow(0, n, lm_head.elem_count())?.reshape(lm_head.shape())?;
        Ok((Some(d_hidden), Some(d_lm_head)))
    }
}

#[derive(Debug, Clone)]
struct LmHeadBwd {
    targets: Arc<[u32]>,
    chunk_tokens: usize,
    /// The forward's [`LmHead::bf16_logits`].
    bf16_logits: bool,
    /// The forward's output: the CUDA backward reads each row's log-sum-exp and entropy from it
    /// (its third column, CUDA only); the CPU backward recomputes them.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fwd_out: Tensor,
}

impl CustomOp3 for LmHeadBwd {
    fn name(&self) -> &'static str {
        "vime-lm-head-logprobs-entropy-bwd"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let op = "logprobs_entropy backward";
        let dtype = same_dtype(op, &[s1.dtype(), s2.dtype()])?;
        let dims = sizes(op, l1, l2, &self.targets, self.chunk_tokens)?;
        if l3.dims() != [dims.0, 2] {
            bail!("{op}: output gradient {:?} is not [{}, 2]", l3.dims(), dims.0);
        }
        with_acc!(dtype, R => {
            let (hs, hl) = in_acc::<R>(s1, l1)?;
            let (ws, wl) = in_acc::<R>(s2, l2)?;
            let g = R::read(s3, l3)?;
            let round = self.bf16_logits && dtype == candle_core::DType::BF16;
            let out = backward::<R>(&hs, &hl, &ws, &wl, &g, &self.targets, self.chunk_tokens, dims, round)?;
            let len = out.len();
            let out = if dtype == R::DTYPE { R::to_cpu_storage_owned(out) } else { R::write(out, dtype)? };
            Ok((out, Shape::from(len)))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let op = "logprobs_entropy backward";
        sizes(op, l1, l2, &self.targets, self.chunk_tokens)?;
        let gemm = crate::cuda::HeadGemm::of(false, self.bf16_logits);
        crate::cuda::lm_head_bwd(
            s1,
            l1,
            s2,
            l2,
            s3,
            l3,
            &self.fwd_out,
            &self.targets,
            self.chunk_tokens,
            gemm,
        )
    }
}
