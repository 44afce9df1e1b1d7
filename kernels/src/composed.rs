//! The device-generic path of every op: the same functions as the fused kernels (same signatures,
//! semantics, output shapes and dtypes), composed only of candle tensor ops that record a backward
//! in candle's autograd and run on every backend (matmul, broadcast arithmetic, exp/log, reductions,
//! narrow/cat, index_select, gather, where_cond, to_dtype, silu).
//!
//! Two uses: it is what the public ops run on a non-CPU device where no fused kernel applies (any
//! dtype but bf16 on CUDA, attention with head_dim other than 128; see `crate::fused_cuda`), also
//! under a local autograd graph for their explicit `*_backward` forms, and it is a reference the
//! fused kernels are tested against (`tests/composed.rs`).
//! candle's own `rms_norm`, `rope`, `softmax_last_dim` and flash-attn record no backward, so none
//! of them appears here.
//!
//! Numerics, chosen to match the fused kernels' contract:
//! - f64 inputs compute in f64, f32 in f32; bf16/f16 inputs are upcast to f32 at entry, computed in
//!   f32 (matmuls included) and the result is cast back to the input dtype once. The LM head's
//!   outputs are f32 (f64 for f64 inputs) whatever the input dtype, as in the fused op. Gradients
//!   come back in the input dtype through the backward of `to_dtype`.
//! - RoPE's cos/sin tables are computed on the host in f64 from `positions` and moved to the
//!   input's device in the compute dtype. The fused CPU kernel (like HF) computes the angles in
//!   f32, so for f32 inputs the two differ by up to about `position * 2^-24` radians.
//! - Softmax maxima used for stabilisation are `detach()`ed: the result does not depend on them.
//! - SwiGLU uses candle's `silu`, whose backward evaluates the sigmoid directly; composing it from
//!   `exp`/`recip` would give a NaN gradient (`0 * inf`) once `exp(-gate)` overflows.
//!
//! Memory, the price of autograd on plain tensor ops:
//! - Attention materialises the `[H, lq, lk]` scores (and a few same-sized intermediates: masked
//!   scores, exponentials, probabilities) per sequence in the compute dtype, and repeats K and V to
//!   all `H` query heads with `index_select`; bf16/f16 q, k, v are first copied to f32. In training
//!   the graph keeps all of it for every sequence until backward: O(H * sum(lq * lk)) memory.
//! - The LM head materialises at most `chunk_tokens x V` logits (plus a few same-sized
//!   intermediates) at a time in the forward, and upcasts the whole `[V, H]` lm_head to f32 once
//!   for bf16/f16 inputs. When the inputs track gradients, the graph keeps every chunk's `[chunk,
//!   V]` intermediates until backward, i.e. O(T x V) memory in training; chunking bounds only the
//!   forward without gradients (e.g. recomputing old logprobs).
//!
//! Inputs are validated by the fused wrappers' own checks (`checks::attention`,
//! `checks::lm_head`, and the same shape checks for the elementwise ops), so both paths give the
//! same error messages; `tests/composed.rs` asserts it.
use crate::checks::IGNORE_TARGET;
use crate::real::same_dtype;
use candle_core::{bail, DType, Result, Tensor, Var, D};
use std::sync::Arc;

/// The dtype an op computes in for inputs of `dtype`: f64 stays f64, f32/bf16/f16 compute in f32.
fn compute_dtype(op: &str, dtype: DType) -> Result<DType> {
    match dtype {
        DType::F64 => Ok(DType::F64),
        DType::F32 | DType::BF16 | DType::F16 => Ok(DType::F32),
        other => bail!("{op}: unsupported dtype {other:?} (f64, f32, bf16, f16)"),
    }
}

/// `y = weight * x / sqrt(mean(x^2, -1) + eps)` over the last dimension of `x`; see
/// [`crate::rms_norm`].
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    if weight.dims() != [d] {
        bail!(
            "rms_norm: weight shape {:?} does not match the last dim {d} of x {:?}",
            weight.dims(),
            x.dims()
        );
    }
    let dtype = same_dtype("rms_norm", &[x.dtype(), weight.dtype()])?;
    let acc = compute_dtype("rms_norm", dtype)?;
    let x = x.to_dtype(acc)?;
    let rstd = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    x.broadcast_mul(&rstd)?
        .broadcast_mul(&weight.to_dtype(acc)?)?
        .to_dtype(dtype)
}

/// Rotary embedding (`rotate_half`) of `x: [T, n_heads, head_dim]` at `positions: [T]`; see
/// [`crate::rope`].
pub fn rope(x: &Tensor, positions: &Arc<[u32]>, theta: f64) -> Result<Tensor> {
    let (t, _h, d) = x.dims3()?;
    if positions.len() != t {
        bail!("rope: {} positions for {t} tokens (x {:?})", positions.len(), x.dims());
    }
    if d % 2 != 0 {
        bail!("rope: head_dim {d} must be even");
    }
    let dtype = x.dtype();
    let acc = compute_dtype("rope", dtype)?;
    let half = d / 2;
    let inv_freq: Vec<f64> = (0..half).map(|j| 1.0 / theta.powf((2 * j) as f64 / d as f64)).collect();
    let angles = positions
        .iter()
        .flat_map(|&p| inv_freq.iter().map(move |&f| p as f64 * f));
    let cos: Vec<f64> = angles.clone().map(f64::cos).collect();
    let sin: Vec<f64> = angles.map(f64::sin).collect();
    let table = |v: Vec<f64>| Tensor::from_vec(v, (t, 1, half), x.device())?.to_dtype(acc);
    let (cos, sin) = (table(cos)?, table(sin)?);
    let x = x.to_dtype(acc)?;
    let (x1, x2) = (x.narrow(2, 0, half)?, x.narrow(2, half, half)?);
    let lo = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
    let hi = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
    Tensor::cat(&[lo, hi], 2)?.to_dtype(dtype)
}

/// `silu(gate) * up` for two tensors of one shape; see [`crate::swiglu`].
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if gate.dims() != up.dims() {
        bail!("swiglu: gate {:?} and up {:?} differ in shape", gate.dims(), up.dims());
    }
    let dtype = same_dtype("swiglu", &[gate.dtype(), up.dtype()])?;
    let acc = compute_dtype("swiglu", dtype)?;
    (gate.to_dtype(acc)?.silu()? * up.to_dtype(acc)?)?.to_dtype(dtype)
}

/// Causal GQA attention over packed sequences, bottom-right aligned; see
/// [`crate::varlen_attention`] for the conventions.
///
/// One sequence at a time: `[H, lq, lk]` scores from a batched matmul against K repeated to the
/// query heads, `-inf` where `j > i + (lk - lq)`, softmax from exp/sum/div, then `P @ V`.
pub fn varlen_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens_q: &Arc<[u32]>,
    cu_seqlens_k: &Arc<[u32]>,
    softmax_scale: f64,
) -> Result<Tensor> {
    crate::checks::attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale)?;
    let (tq, h, d) = q.dims3()?;
    let hkv = k.dim(1)?;
    let dtype = q.dtype();
    let acc = compute_dtype("varlen_attention", dtype)?;
    let dev = q.device();
    let (q, k, v) = (q.to_dtype(acc)?, k.to_dtype(acc)?, v.to_dtype(acc)?);
    let kv_of_head: Vec<u32> = (0..h).map(|x| (x / (h / hkv)) as u32).collect();
    let kv_of_head = Tensor::from_vec(kv_of_head, h, dev)?;
    let neg_inf = Tensor::new(f64::NEG_INFINITY, dev)?.to_dtype(acc)?;
    let mut outs = Vec::with_capacity(cu_seqlens_q.len() - 1);
    for s in 0..cu_seqlens_q.len() - 1 {
        let span = |cu: &[u32]| (cu[s] as usize, (cu[s + 1] - cu[s]) as usize);
        let ((q0, lq), (k0, lk)) = (span(cu_seqlens_q), span(cu_seqlens_k));
        if lq == 0 {
            continue;
        }
        // [len, heads, head_dim] rows -> [heads, len, head_dim]
        let by_head = |x: &Tensor, at: usize, len: usize| x.narrow(0, at, len)?.transpose(0, 1)?.contiguous();
        let qs = by_head(&q, q0, lq)?;
        let ks = by_head(&k, k0, lk)?.index_select(&kv_of_head, 0)?;
        let vs = by_head(&v, k0, lk)?.index_select(&kv_of_head, 0)?;
        let scores = (qs.matmul(&ks.t()?)? * softmax_scale)?;
        let shape = scores.shape().clone();
        let visible: Vec<u8> = (0..lq)
            .flat_map(|i| (0..lk).map(move |j| (j <= i + (lk - lq)) as u8))
            .collect();
        let visible = Tensor::from_vec(visible, (lq, lk), dev)?.broadcast_as(&shape)?;
        let scores = visible.where_cond(&scores, &neg_inf.broadcast_as(&shape)?)?;
        let max = scores.max_keepdim(D::Minus1)?.detach();
        let e = scores.broadcast_sub(&max)?.exp()?;
        let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        outs.push(p.matmul(&vs)?.transpose(0, 1)?);
    }
    if outs.is_empty() {
        // Only possible with no query tokens at all (cu_seqlens_q ends at Tq).
        return Tensor::zeros((tq, h, d), dtype, dev);
    }
    Tensor::cat(&outs, 0)?.to_dtype(dtype)
}

/// Per-token `(logprob of target, entropy)` of `softmax(hidden @ lm_head^T)`, both `[T]`, f32 (f64
/// for f64 inputs); see [`crate::logprobs_entropy`].
///
/// Per chunk of `chunk_tokens` rows: `z = hidden_c @ lm_head^T`, `logp = z - max - ln sum exp(z -
/// max)`, `lp = gather(logp, target)` (target 0 then masked to 0 for [`IGNORE_TARGET`]), `H = -sum p
/// logp`; the per-chunk results are concatenated.
pub fn logprobs_entropy(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &Arc<[u32]>,
    chunk_tokens: usize,
) -> Result<(Tensor, Tensor)> {
    let (t, _h, _v) = crate::checks::lm_head(hidden, lm_head, targets, chunk_tokens)?;
    let acc = compute_dtype("logprobs_entropy", hidden.dtype())?;
    let dev = hidden.device();
    if t == 0 {
        let empty = Tensor::zeros(0, acc, dev)?;
        return Ok((empty.clone(), empty));
    }
    let w = lm_head.to_dtype(acc)?.contiguous()?;
    let ids: Vec<u32> = targets
        .iter()
        .map(|&id| if id == IGNORE_TARGET { 0 } else { id })
        .collect();
    let ids = Tensor::from_vec(ids, (t, 1), dev)?;
    let keep: Vec<u8> = targets.iter().map(|&id| (id != IGNORE_TARGET) as u8).collect();
    let keep = Tensor::from_vec(keep, t, dev)?.to_dtype(acc)?;
    let (mut logprobs, mut entropy) = (Vec::new(), Vec::new());
    for start in (0..t).step_by(chunk_tokens) {
        let len = (t - start).min(chunk_tokens);
        let z = hidden
            .narrow(0, start, len)?
            .to_dtype(acc)?
            .contiguous()?
            .matmul(&w.t()?)?;
        let z = z.broadcast_sub(&z.max_keepdim(1)?.detach())?;
        let logp = z.broadcast_sub(&z.exp()?.sum_keepdim(1)?.log()?)?;
        entropy.push((logp.exp()? * &logp)?.sum(1)?.neg()?);
        let lp = logp.gather(&ids.narrow(0, start, len)?, 1)?.squeeze(1)?;
        logprobs.push((lp * keep.narrow(0, start, len)?)?);
    }
    Ok((Tensor::cat(&logprobs, 0)?, Tensor::cat(&entropy, 0)?))
}

/// A composed op run on leaf copies of its inputs under a local autograd graph, kept for its
/// backward: the explicit (no model-level autograd) form of an op wherever no kernel exists. The
/// graph holds what candle's autograd would (the attention scores, the LM head's `[T, V]` blocks).
#[derive(Debug, Clone)]
pub struct Graph {
    inputs: Vec<Var>,
    out: Tensor,
}

impl Graph {
    /// Runs `f` on leaf copies of `inputs`; returns its output (detached) and the graph.
    pub fn run(inputs: &[&Tensor], f: impl FnOnce(&[Tensor]) -> Result<Tensor>) -> Result<(Tensor, Graph)> {
        let inputs = inputs.iter().map(|t| Var::from_tensor(t)).collect::<Result<Vec<_>>>()?;
        let leaves: Vec<Tensor> = inputs.iter().map(|v| v.as_tensor().clone()).collect();
        let out = f(&leaves)?;
        Ok((out.detach(), Graph { inputs, out }))
    }

    /// The gradient of every input for the output gradient `dout` (zeros for an input the output
    /// does not depend on).
    pub fn backward(&self, dout: &Tensor) -> Result<Vec<Tensor>> {
        let mut grads = crate::vjp_seed(&self.out, &dout.to_dtype(self.out.dtype())?)?.backward()?;
        self.inputs
            .iter()
            .map(|v| match grads.remove(v.as_tensor()) {
                Some(g) => Ok(g),
                None => v.as_tensor().zeros_like(),
            })
            .collect()
    }
}

fn two(g: Vec<Tensor>) -> (Tensor, Tensor) {
    let mut g = g.into_iter();
    (g.next().expect("two gradients"), g.next().expect("two gradients"))
}

/// `(dx, dweight)` of [`rms_norm`] through its autograd; see [`crate::rms_norm_backward`].
pub fn rms_norm_backward(x: &Tensor, weight: &Tensor, eps: f64, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    let (_, g) = Graph::run(&[x, weight], |t| rms_norm(&t[0], &t[1], eps))?;
    Ok(two(g.backward(dy)?))
}

/// The backward of [`rope`] through its autograd (a rotation is linear: any input serves, zeros
/// here); see [`crate::rope_backward`].
pub fn rope_backward(dy: &Tensor, positions: &Arc<[u32]>, theta: f64) -> Result<Tensor> {
    let (_, g) = Graph::run(&[&dy.zeros_like()?], |t| rope(&t[0], positions, theta))?;
    Ok(g.backward(dy)?.remove(0))
}

/// `(d_gate, d_up)` of [`swiglu`] through its autograd; see [`crate::swiglu_backward`].
pub fn swiglu_backward(gate: &Tensor, up: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    let (_, g) = Graph::run(&[gate, up], |t| swiglu(&t[0], &t[1]))?;
    Ok(two(g.backward(dy)?))
}
