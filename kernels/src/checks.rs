//! The argument checks of the attention and LM-head ops, shared by the fused kernels and the
//! composed path (so both give the same error messages; `tests/composed.rs` asserts it). Lives
//! apart from both so that neither imports the other for them.
use crate::real::same_dtype;
use candle_core::{bail, DType, Result, Tensor};

/// Target id meaning "no next token here": its log-prob is 0 and gets no gradient.
pub const IGNORE_TARGET: u32 = u32::MAX;

/// Every check of [`crate::varlen_attention`]; the composed path runs the same ones.
pub(crate) fn attention(q: &Tensor, k: &Tensor, v: &Tensor, cu_q: &[u32], cu_k: &[u32], scale: f64) -> Result<()> {
    for (name, t) in [("q", q), ("k", k), ("v", v)] {
        if t.rank() != 3 {
            bail!(
                "varlen_attention: {name} must be [tokens, heads, head_dim], got shape {:?}",
                t.dims()
            );
        }
    }
    let (tq, h, d) = q.dims3()?;
    let (tk, hkv, dk) = k.dims3()?;
    if v.dims() != k.dims() {
        bail!(
            "varlen_attention: k {:?} and v {:?} differ in shape",
            k.dims(),
            v.dims()
        );
    }
    if dk != d {
        bail!("varlen_attention: head_dim of q ({d}) and k/v ({dk}) differ");
    }
    if hkv == 0 || h == 0 || h % hkv != 0 {
        bail!("varlen_attention: n_heads {h} must be a positive multiple of n_kv_heads {hkv}");
    }
    let dtype = same_dtype("varlen_attention", &[q.dtype(), k.dtype(), v.dtype()])?;
    if !matches!(dtype, DType::F64 | DType::F32 | DType::BF16 | DType::F16) {
        bail!("varlen_attention: unsupported dtype {dtype:?} (f64, f32, bf16, f16)");
    }
    if !scale.is_finite() {
        bail!("varlen_attention: softmax_scale {scale} is not finite");
    }
    check_cu_seqlens("cu_seqlens_q", cu_q, tq)?;
    check_cu_seqlens("cu_seqlens_k", cu_k, tk)?;
    if cu_q.len() != cu_k.len() {
        bail!(
            "varlen_attention: cu_seqlens_q describes {} sequences and cu_seqlens_k {}",
            cu_q.len() - 1,
            cu_k.len() - 1
        );
    }
    for s in 0..cu_q.len() - 1 {
        let (lq, lk) = (cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]);
        if lk < lq {
            bail!("varlen_attention: sequence {s} has {lq} queries but only {lk} keys (need Lk >= Lq)");
        }
    }
    Ok(())
}

fn check_cu_seqlens(name: &str, cu: &[u32], tokens: usize) -> Result<()> {
    if cu.is_empty() {
        bail!("varlen_attention: {name} is empty; it needs at least [0]");
    }
    if cu[0] != 0 {
        bail!("varlen_attention: {name} must start at 0, got {cu:?}");
    }
    if let Some(s) = cu.windows(2).position(|w| w[1] < w[0]) {
        bail!("varlen_attention: {name} is not monotone at sequence {s}: {cu:?}");
    }
    if *cu.last().unwrap() as usize != tokens {
        bail!("varlen_attention: {name} must end at the token count {tokens}, got {cu:?}");
    }
    Ok(())
}

/// Every check of [`logprobs_entropy`] (the composed path runs the same ones); returns `(T, H, V)`.
pub(crate) fn lm_head(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &[u32],
    chunk_tokens: usize,
) -> Result<(usize, usize, usize)> {
    let (t, h) = match hidden.dims() {
        &[t, h] => (t, h),
        d => bail!("logprobs_entropy: hidden must be [T, H], got {d:?}"),
    };
    let (v, hw) = match lm_head.dims() {
        &[v, hw] => (v, hw),
        d => bail!("logprobs_entropy: lm_head must be [V, H], got {d:?}"),
    };
    if hw != h {
        bail!(
            "logprobs_entropy: lm_head {:?} does not match the hidden size {h} of hidden {:?}",
            lm_head.dims(),
            hidden.dims()
        );
    }
    if v == 0 {
        bail!("logprobs_entropy: lm_head has an empty vocabulary");
    }
    if targets.len() != t {
        bail!(
            "logprobs_entropy: {} targets for {t} tokens (hidden {:?})",
            targets.len(),
            hidden.dims()
        );
    }
    if chunk_tokens == 0 {
        bail!("logprobs_entropy: chunk_tokens must be > 0");
    }
    same_dtype("logprobs_entropy", &[hidden.dtype(), lm_head.dtype()])?;
    if let Some((i, &id)) = targets
        .iter()
        .enumerate()
        .find(|&(_, &id)| id != IGNORE_TARGET && id as usize >= v)
    {
        bail!("logprobs_entropy: target {id} of token {i} is out of range for a vocabulary of {v}");
    }
    Ok((t, h, v))
}
