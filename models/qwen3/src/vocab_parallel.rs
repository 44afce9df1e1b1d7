//! The vocab-parallel LM head's log-prob and entropy (tensor parallelism): each TP rank holds a
//! slice `[V / tp, H]` of the LM head (or tied embedding) and computes per-token statistics of its
//! logits only; all-reduces over the TP group combine them, as Megatron's
//! `tensor_parallel/cross_entropy.py` combines its partial max and sum-exp. No rank materialises
//! full-vocabulary logits.
//!
//! Per token, with `z` the logits of this rank's slice, `m` the global max:
//! - forward: `m = max_r max z_r` (all-reduce max); `S = sum_r sum exp(z_r - m)`,
//!   `U = sum_r sum exp(z_r - m) z_r`, `z_t` (the target's logit, 0 on ranks that do not hold it)
//!   summed in one all-reduce; `lse = m + ln S`, `logp = z_t - lse`, `H = lse - U / S`;
//! - backward: `dz_j = g_lp (1[j = t] - p_j) - g_H p_j (z_j - lse + H)` with `p_j = exp(z_j - lse)`,
//!   local to the slice; `d_lm_head_slice = dz^T hidden` stays local, `d_hidden = dz lm_head_slice`
//!   is summed over the TP group (the hidden state is replicated across it).
//!
//! Decisions:
//! - On CUDA with bf16 inputs, the fused LM-head kernels of the unsharded head run on the shard
//!   (`vime_kernels::lm_head::shard_stats` / `shard_backward`: bf16 GEMMs into f32 logits blocks,
//!   one-pass statistics, the same `dz` kernel), and the per-shard statistics are merged here. Its
//!   collectives: one all-gather of `[T, 4]` forward, one all-reduce of the f32 `d_hidden`
//!   backward. The logits are recomputed in the backward.
//! - Elsewhere (CPU, f32/f64): composed of candle ops in f32 (f64 for f64 inputs), `chunk_tokens`
//!   rows of logits at a time, the logits recomputed in the backward (only `lse` and `H` are
//!   saved): the same memory shape as the fused unsharded kernel (`vime_kernels::logprobs_entropy`),
//!   which both forms are tested against.
//! - Targets are global vocabulary ids (`IGNORE_TARGET` rows give log-prob 0 and no log-prob
//!   gradient, as the unsharded kernel); a rank holds `[offset, offset + V / tp)`.
//! - The composed forward is two collectives per chunk (a max, then one sum of `[rows, 3]`), the
//!   backward one (the `d_hidden` sum).
use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor, D};
use vime_dist::{Collectives, ReduceOp};
use vime_kernels::lm_head::IGNORE_TARGET;
use vime_kernels::HeadLogits;

/// This rank's slice of the vocabulary, and how its logits are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct VocabShard {
    pub offset: usize,
    pub len: usize,
    pub vocab: usize,
    /// `--lm-head-logits`: with `Bf16`, bf16 inputs' logits are rounded to bf16 before the
    /// softmax, as the unsharded head does (the default `Fp32`: f32 logits).
    pub logits: HeadLogits,
}

impl VocabShard {
    /// Megatron's even split: `vocab / tp` ids per rank (an uneven vocabulary is an error naming
    /// both numbers).
    pub fn new(vocab: usize, tp_rank: usize, tp_size: usize) -> Result<Self> {
        ensure!(tp_size > 0 && tp_rank < tp_size, "TP rank {tp_rank} of {tp_size}");
        ensure!(
            vocab.is_multiple_of(tp_size),
            "the vocabulary ({vocab}) must divide evenly over the tensor-parallel size ({tp_size})"
        );
        let len = vocab / tp_size;
        Ok(Self {
            offset: tp_rank * len,
            len,
            vocab,
            logits: HeadLogits::Fp32,
        })
    }

    /// This shard with its logits in `logits`.
    pub fn with_head_logits(mut self, logits: HeadLogits) -> Self {
        self.logits = logits;
        self
    }

    /// The shard's logits `[n, V_r]` of `x` (accumulation dtype) against `w` (the same), rounded
    /// to bf16 and back where the shard says so and the inputs are bf16.
    fn logits(&self, x: &Tensor, w: &Tensor, input: DType) -> Result<Tensor> {
        let z = x.matmul(&w.t()?)?;
        if self.logits == HeadLogits::Bf16 && input == DType::BF16 {
            Ok(z.to_dtype(DType::BF16)?.to_dtype(z.dtype())?)
        } else {
            Ok(z)
        }
    }
}

/// What the backward needs from the forward: per-token `lse` and entropy, in the accumulation dtype.
#[derive(Debug, Clone)]
pub struct VocabParallelSaved {
    lse: Tensor,
    entropy: Tensor,
}

fn acc_dtype(d: DType) -> DType {
    if d == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// Local target index and a 0/1 "this rank holds it" mask, for `targets` (global ids).
fn local_targets(targets: &[u32], shard: &VocabShard, device: &Device, acc: DType) -> Result<(Tensor, Tensor)> {
    let mut idx = Vec::with_capacity(targets.len());
    let mut mine = Vec::with_capacity(targets.len());
    for &t in targets {
        let t = t as usize;
        if t != IGNORE_TARGET as usize && t >= shard.offset && t < shard.offset + shard.len {
            idx.push((t - shard.offset) as u32);
            mine.push(1f64);
        } else {
            idx.push(0);
            mine.push(0.0);
        }
    }
    let n = targets.len();
    Ok((
        Tensor::from_vec(idx, (n, 1), device)?,
        Tensor::from_vec(mine, n, device)?.to_dtype(acc)?,
    ))
}

fn check(hidden: &Tensor, lm_head: &Tensor, targets: &[u32], shard: &VocabShard) -> Result<()> {
    let (t, h) = hidden.dims2()?;
    let (v, h2) = lm_head.dims2()?;
    ensure!(
        h == h2,
        "hidden {:?} and LM-head slice {:?} differ in width",
        hidden.dims(),
        lm_head.dims()
    );
    ensure!(
        v == shard.len,
        "the LM-head slice has {v} rows, the shard {}",
        shard.len
    );
    ensure!(targets.len() == t, "{} targets for {t} tokens", targets.len());
    for (i, &x) in targets.iter().enumerate() {
        ensure!(
            x == IGNORE_TARGET || (x as usize) < shard.vocab,
            "target {i} is {x}, outside the vocabulary of {}",
            shard.vocab
        );
    }
    Ok(())
}

/// Per-token `(log-prob of target, entropy)` over the whole vocabulary, from this rank's slice:
/// both `[T]` in f32 (f64 for f64 inputs), equal on every TP rank.
pub fn vocab_parallel_logprobs_entropy(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &[u32],
    shard: &VocabShard,
    tp: &dyn Collectives,
    chunk_tokens: usize,
) -> Result<(Tensor, Tensor, VocabParallelSaved)> {
    check(hidden, lm_head, targets, shard)?;
    if let Some(stats) =
        vime_kernels::lm_head::shard_stats(hidden, lm_head, targets, shard.offset, chunk_tokens, shard.logits)?
    {
        return merged_shard_stats(&stats, targets, tp);
    }
    let acc = acc_dtype(hidden.dtype());
    let w = lm_head.to_dtype(acc)?;
    let t = hidden.dim(0)?;
    let chunk = chunk_tokens.max(1);
    let (mut lps, mut ents, mut lses) = (Vec::new(), Vec::new(), Vec::new());
    let mut start = 0;
    while start < t {
        let n = chunk.min(t - start);
        let x = hidden.narrow(0, start, n)?.to_dtype(acc)?;
        let z = shard.logits(&x, &w, hidden.dtype())?; // [n, V_r]
        let m = tp.all_reduce(&z.max_keepdim(D::Minus1)?, ReduceOp::Max)?; // [n, 1]
        let e = z.broadcast_sub(&m)?.exp()?;
        let (idx, mine) = local_targets(&targets[start..start + n], shard, hidden.device(), acc)?;
        let zt = (z.gather(&idx, 1)?.squeeze(1)? * &mine)?;
        let stats = Tensor::stack(&[e.sum(D::Minus1)?, (&e * &z)?.sum(D::Minus1)?, zt], 1)?; // [n, 3]
        let stats = tp.all_reduce(&stats, ReduceOp::Sum)?;
        let s = stats.narrow(1, 0, 1)?.squeeze(1)?;
        let u = stats.narrow(1, 1, 1)?.squeeze(1)?;
        let zt = stats.narrow(1, 2, 1)?.squeeze(1)?;
        let lse = (m.squeeze(1)? + s.log()?)?;
        let ent = (&lse - (u / &s)?)?;
        let keep: Vec<f64> = targets[start..start + n]
            .iter()
            .map(|&x| (x != IGNORE_TARGET) as u8 as f64)
            .collect();
        let keep = Tensor::from_vec(keep, n, hidden.device())?.to_dtype(acc)?;
        lps.push(((zt - &lse)? * keep)?);
        ents.push(ent);
        lses.push(lse);
        start += n;
    }
    let cat = |v: Vec<Tensor>| -> Result<Tensor> {
        if v.is_empty() {
            Ok(Tensor::zeros(0, acc, hidden.device())?)
        } else {
            Ok(Tensor::cat(&v, 0)?)
        }
    };
    let entropy = cat(ents)?;
    let saved = VocabParallelSaved {
        lse: cat(lses)?,
        entropy: entropy.clone(),
    };
    Ok((cat(lps)?, entropy, saved))
}

/// The fused kernels' per-shard statistics (`vime_kernels::lm_head::shard_stats`, `[T, 4]`)
/// merged over the TP group: every rank's gathered (one collective) and combined in rank order,
/// so every rank gets the same bits. Returns what [`vocab_parallel_logprobs_entropy`] does, f32.
fn merged_shard_stats(
    stats: &Tensor,
    targets: &[u32],
    tp: &dyn Collectives,
) -> Result<(Tensor, Tensor, VocabParallelSaved)> {
    let t = targets.len();
    let all = tp.all_gather(&stats.contiguous()?)?.reshape((tp.size(), t, 4))?;
    let col = |r: usize, c: usize| -> Result<Tensor> { Ok(all.get(r)?.narrow(1, c, 1)?.squeeze(1)?) };
    let mut m = col(0, 0)?;
    for r in 1..tp.size() {
        m = m.maximum(&col(r, 0)?)?;
    }
    let (mut s, mut a, mut zt) = (m.zeros_like()?, m.zeros_like()?, m.zeros_like()?);
    for r in 0..tp.size() {
        let (mr, sr, ar) = (col(r, 0)?, col(r, 1)?, col(r, 2)?);
        let d = (&mr - &m)?;
        let f = d.exp()?;
        s = (s + (&sr * &f)?)?;
        a = (a + ((ar + (d * &sr)?)? * &f)?)?;
        zt = (zt + col(r, 3)?)?;
    }
    let ls = s.log()?;
    let lse = (&m + &ls)?;
    let entropy = (ls - (a / &s)?)?;
    let keep: Vec<f32> = targets.iter().map(|&x| (x != IGNORE_TARGET) as u8 as f32).collect();
    let keep = Tensor::from_vec(keep, t, stats.device())?;
    let logprobs = ((zt - &lse)? * keep)?;
    let saved = VocabParallelSaved {
        lse,
        entropy: entropy.clone(),
    };
    Ok((logprobs, entropy, saved))
}

/// Gradients of `sum(g_lp * logp + g_ent * H)`: `(d_hidden [T, H], d_lm_head_slice [V/tp, H])` in
/// the inputs' dtypes; `d_hidden` is already summed over the TP group.
#[allow(clippy::too_many_arguments)]
pub fn vocab_parallel_logprobs_entropy_backward(
    hidden: &Tensor,
    lm_head: &Tensor,
    targets: &[u32],
    shard: &VocabShard,
    saved: &VocabParallelSaved,
    g_lp: &Tensor,
    g_ent: &Tensor,
    tp: &dyn Collectives,
    chunk_tokens: usize,
) -> Result<(Tensor, Tensor)> {
    check(hidden, lm_head, targets, shard)?;
    let t = hidden.dim(0)?;
    ensure!(
        g_lp.dims() == [t] && g_ent.dims() == [t],
        "gradients {:?} / {:?} for {t} tokens",
        g_lp.dims(),
        g_ent.dims()
    );
    if let Some((dh, dw)) = vime_kernels::lm_head::shard_backward(
        hidden,
        lm_head,
        targets,
        shard.offset,
        &saved.lse,
        &saved.entropy,
        g_lp,
        g_ent,
        chunk_tokens,
        shard.logits,
    )? {
        let dh = tp.all_reduce(&dh, ReduceOp::Sum)?;
        return Ok((dh.to_dtype(hidden.dtype())?, dw));
    }
    let acc = acc_dtype(hidden.dtype());
    let w = lm_head.to_dtype(acc)?;
    let chunk = chunk_tokens.max(1);
    let mut d_hidden = Vec::new();
    let mut d_w = Tensor::zeros(w.dims(), acc, hidden.device())?;
    let mut start = 0;
    while start < t {
        let n = chunk.min(t - start);
        let x = hidden.narrow(0, start, n)?.to_dtype(acc)?;
        let z = shard.logits(&x, &w, hidden.dtype())?;
        let lse = saved.lse.narrow(0, start, n)?.unsqueeze(1)?;
        let ent = saved.entropy.narrow(0, start, n)?.unsqueeze(1)?;
        let p = z.broadcast_sub(&lse)?.exp()?;
        let ts = &targets[start..start + n];
        let keep: Vec<f64> = ts.iter().map(|&x| (x != IGNORE_TARGET) as u8 as f64).collect();
        let keep = Tensor::from_vec(keep, (n, 1), hidden.device())?.to_dtype(acc)?;
        let glp = (g_lp.narrow(0, start, n)?.to_dtype(acc)?.unsqueeze(1)? * keep)?;
        let gent = g_ent.narrow(0, start, n)?.to_dtype(acc)?.unsqueeze(1)?;
        let (idx, mine) = local_targets(ts, shard, hidden.device(), acc)?;
        let onehot = Tensor::zeros(z.dims(), acc, hidden.device())?.scatter_add(&idx, &mine.unsqueeze(1)?, 1)?;
        // dz = g_lp (onehot - p) - g_H p (z - lse + H)
        let dz = (onehot - &p)?.broadcast_mul(&glp)?;
        let dz = (dz
            - p.mul(&z.broadcast_sub(&lse)?.broadcast_add(&ent)?)?
                .broadcast_mul(&gent)?)?;
        d_hidden.push(dz.matmul(&w)?);
        d_w = (d_w + dz.t()?.matmul(&x)?)?;
        start += n;
    }
    let d_hidden = if d_hidden.is_empty() {
        Tensor::zeros(hidden.dims(), acc, hidden.device())?
    } else {
        Tensor::cat(&d_hidden, 0)?
    };
    let d_hidden = tp.all_reduce(&d_hidden, ReduceOp::Sum)?;
    Ok((d_hidden.to_dtype(hidden.dtype())?, d_w.to_dtype(lm_head.dtype())?))
}
