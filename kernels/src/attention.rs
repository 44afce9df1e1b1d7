//! Causal grouped-query attention over packed variable-length sequences, with backward.
//!
//! `q: [Tq, n_heads, head_dim]`, `k, v: [Tk, n_kv_heads, head_dim]`; sequence `s` owns the query
//! rows `cu_seqlens_q[s]..cu_seqlens_q[s+1]` and the key rows `cu_seqlens_k[s]..cu_seqlens_k[s+1]`.
//! Query head `h` reads kv head `h / (n_heads / n_kv_heads)` (HF `repeat_kv`).
//!
//! Causal mask, bottom-right aligned (flash-attn varlen): in a sequence of `Lq` queries and
//! `Lk >= Lq` keys, query `i` sees keys `j <= i + (Lk - Lq)`. With `cu_seqlens_q == cu_seqlens_k`
//! this is ordinary causal self-attention; with `Lk > Lq` the queries are the last `Lq` positions
//! of their keys (a context-parallel query chunk).
//!
//! Forward, per query row: `S_j = scale * q.k_j`, `P = softmax(S)` with max subtraction,
//! `O = sum_j P_j v_j`, all in f32 (f64 for f64 inputs), rounded once on output.
//!
//! Backward (FlashAttention-2 math, the softmax recomputed per query row):
//!   dP_ij = dO_i . v_j          D_i  = sum_j P_ij dP_ij  (= dO_i . O_i)
//!   dS_ij = P_ij (dP_ij - D_i)  dQ_i = scale * sum_j dS_ij k_j
//!   dK_j  = scale * sum_i dS_ij q_i        dV_j = sum_i P_ij dO_i
//! with dK/dV summed over the query heads that share a kv head.
//!
//! Memory: no `[T, T]` score matrix exists, not even per sequence. A query row keeps its `Lk`
//! scores (plus `Lk` values of dP in the backward) in scratch reused across rows. A task copies
//! the keys and values of its kv head into contiguous `[Lk, head_dim]` buffers and writes its
//! output rows (backward: its dQ rows and `[Lk, head_dim]` dK, dV) to local buffers, which are
//! scattered into the output once all tasks are done: transiently about one extra output's worth.
//! Inputs are widened to the accumulation type once per call (a copy of q, k, v, and dO).
//!
//! Decisions:
//! - `D_i` is computed as `sum_j P_ij dP_ij` from the row's recomputed `P` instead of `dO_i . O_i`:
//!   equal in exact arithmetic, it needs no `O` (whose bf16 rounding would leak into every dS),
//!   and it leaves the backward op with four inputs (q, k, v, dO) instead of five.
//! - The backward op is a `CustomOp3` on `(q, k, v)` that carries `dO` in its struct and reads its
//!   storage directly. Packing dO with q (or k with v) would cost a concatenated copy per layer;
//!   a CUDA build reads the stashed tensor's `Storage::Cuda` the same way.
//! - Work is split into rayon tasks per (sequence, kv head), listed in a fixed order. A task owns
//!   the output rows of its query heads and the dK/dV rows of its kv head, so no reduction crosses
//!   tasks: tasks write local buffers that are scattered into the outputs afterwards, and results
//!   are bit-for-bit identical run to run whatever the thread count.
//! - Dot products accumulate in 8 fixed lanes so that they vectorise, with a summation order that
//!   depends on neither the scheduling nor the target.
//! - The CUDA kernel (cuDNN or flash) is chosen by the caller's [`KernelConfig`], which the op
//!   keeps from its forward for its backward; nothing here is process-global.
//! - [`varlen_attention_saved`] / [`varlen_attention_backward`] (no autograd) exist on every
//!   device: where no kernel applies they keep the composed op's local autograd graph instead.
//! - One query row at a time: blocking four rows per pass over the keys measured no faster here
//!   (512 and 1024 tokens, head_dim 128, f32), so the simpler loop stayed.
use crate::config::KernelConfig;
use crate::real::{same_dtype, Real};
use crate::with_acc;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, Layout, Result, Shape, Storage, Tensor};
use rayon::prelude::*;
use std::sync::Arc;

/// cuDNN graphs built so far and the host seconds that took (`(0, 0.0)` without the cudnn
/// feature): each new shape bucket costs a forward and a backward graph.
pub fn cudnn_graph_stats() -> (u64, f64) {
    #[cfg(feature = "cudnn")]
    {
        crate::cudnn::graph_stats()
    }
    #[cfg(not(feature = "cudnn"))]
    {
        (0, 0.0)
    }
}

/// The loaded cuDNN's version, `9.28.1` (`None` before its first use or without the cudnn
/// feature): which cuDNN runs depends on the loader's path or `VIME_CUDNN_LIB`, so results
/// record it.
pub fn cudnn_version() -> Option<String> {
    #[cfg(feature = "cudnn")]
    let v = crate::cudnn::backend_version();
    #[cfg(not(feature = "cudnn"))]
    let v = 0;
    version_string(v)
}

/// `major.minor.patch` of a cuDNN 9 `CUDNN_VERSION` (major * 10000 + minor * 100 + patch).
fn version_string(v: i64) -> Option<String> {
    (v > 0).then(|| format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100))
}

/// Whether the kernel op (CPU, or fused CUDA: bf16 with head_dim 128) takes these tensors; the
/// composed path runs everything else.
fn kernel_path(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<bool> {
    if q.device().is_cpu() {
        return Ok(true);
    }
    Ok(crate::fused_cuda(q.device(), q.dtype())
        && k.dtype() == q.dtype()
        && v.dtype() == q.dtype()
        && q.rank() == 3
        && q.dim(2)? == 128)
}

/// Causal attention over packed sequences (see the module docs), with backward.
///
/// `q: [Tq, n_heads, head_dim]`, `k, v: [Tk, n_kv_heads, head_dim]`, `cu_seqlens_q` / `cu_seqlens_k`
/// the sequence boundaries (`[0, .., Tq]` / `[0, .., Tk]`, one entry more than sequences). Returns
/// `[Tq, n_heads, head_dim]` in the dtype of `q`. `kernels` picks the CUDA kernel.
pub fn varlen_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens_q: &Arc<[u32]>,
    cu_seqlens_k: &Arc<[u32]>,
    softmax_scale: f64,
    kernels: &KernelConfig,
) -> Result<Tensor> {
    if !kernel_path(q, k, v)? {
        return crate::composed::varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale);
    }
    crate::checks::attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale)?;
    let op = VarlenAttention::new(cu_seqlens_q, cu_seqlens_k, softmax_scale, kernels);
    q.contiguous()?.apply_op3(&k.contiguous()?, &v.contiguous()?, op)
}

/// What [`varlen_attention_backward`] needs from the forward besides q, k, v and the output: the
/// kernel op (on CUDA holding the log-sum-exp the forward saved), or, where no kernel exists, the
/// composed op's local autograd graph.
#[derive(Debug, Clone)]
pub struct AttentionSaved(SavedAttention);

#[derive(Debug, Clone)]
enum SavedAttention {
    Kernel(VarlenAttention),
    Graph(crate::composed::Graph),
}

/// [`varlen_attention`] without autograd, for hand-written backward passes: the output and what
/// its backward needs. Every device and dtype: where no kernel exists (f32 on CUDA, head_dim other
/// than 128) the composed op runs on leaf copies of q, k, v and keeps its graph for the backward.
pub fn varlen_attention_saved(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens_q: &Arc<[u32]>,
    cu_seqlens_k: &Arc<[u32]>,
    softmax_scale: f64,
    kernels: &KernelConfig,
) -> Result<(Tensor, AttentionSaved)> {
    if !kernel_path(q, k, v)? {
        let (out, graph) = crate::composed::Graph::run(&[q, k, v], |t| {
            crate::composed::varlen_attention(&t[0], &t[1], &t[2], cu_seqlens_q, cu_seqlens_k, softmax_scale)
        })?;
        return Ok((out, AttentionSaved(SavedAttention::Graph(graph))));
    }
    crate::checks::attention(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale)?;
    let op = VarlenAttention::new(cu_seqlens_q, cu_seqlens_k, softmax_scale, kernels);
    let out = q
        .contiguous()?
        .apply_op3_no_bwd(&k.contiguous()?, &v.contiguous()?, &op)?;
    Ok((out, AttentionSaved(SavedAttention::Kernel(op))))
}

/// The backward of [`varlen_attention_saved`]: `(dq, dk, dv)` for the upstream gradient `dout`.
/// `q, k, v, out` are the forward's inputs and output.
pub fn varlen_attention_backward(
    saved: &AttentionSaved,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    dout: &Tensor,
) -> Result<(Tensor, Tensor, Tensor)> {
    if dout.dims() != q.dims() || out.dims() != q.dims() {
        bail!(
            "varlen_attention_backward: out {:?} and dout {:?} must match q {:?}",
            out.dims(),
            dout.dims(),
            q.dims()
        );
    }
    let op = match &saved.0 {
        SavedAttention::Kernel(op) => op,
        SavedAttention::Graph(graph) => {
            let mut g = graph.backward(dout)?.into_iter();
            let (dq, dk, dv) = (g.next(), g.next(), g.next());
            return Ok((dq.expect("dq"), dk.expect("dk"), dv.expect("dv")));
        }
    };
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let (dq, dk, dv) = op.bwd(&q, &k, &v, out, dout)?;
    Ok((
        dq.expect("attention dq"),
        dk.expect("attention dk"),
        dv.expect("attention dv"),
    ))
}

#[derive(Debug, Clone)]
struct VarlenAttention {
    cu_q: Arc<[u32]>,
    cu_k: Arc<[u32]>,
    scale: f64,
    /// The kernel choice of the forward, which its backward keeps.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    kernels: KernelConfig,
    /// The CUDA forward's log-sum-exp, which its backward reads (the CPU backward recomputes the
    /// softmax per row instead).
    #[cfg(feature = "cuda")]
    lse: Arc<crate::cuda::SavedLse>,
}

impl VarlenAttention {
    fn new(cu_q: &Arc<[u32]>, cu_k: &Arc<[u32]>, scale: f64, kernels: &KernelConfig) -> Self {
        Self {
            cu_q: cu_q.clone(),
            cu_k: cu_k.clone(),
            scale,
            kernels: kernels.clone(),
            #[cfg(feature = "cuda")]
            lse: Default::default(),
        }
    }
}

/// Sizes of one call, read from the layouts of q and k.
#[derive(Debug, Clone, Copy)]
struct Geom {
    heads: usize,
    kv_heads: usize,
    /// Query heads per kv head.
    group: usize,
    head_dim: usize,
}

impl Geom {
    fn new(lq: &Layout, lk: &Layout) -> Result<Self> {
        let (qd, kd) = (lq.dims(), lk.dims());
        if qd.len() != 3 || kd.len() != 3 || qd[2] != kd[2] || kd[1] == 0 || qd[1] % kd[1] != 0 {
            bail!("varlen_attention: bad shapes q {qd:?}, k {kd:?}");
        }
        Ok(Geom {
            heads: qd[1],
            kv_heads: kd[1],
            group: qd[1] / kd[1],
            head_dim: qd[2],
        })
    }
}

/// One unit of work: one sequence (queries `q0..q0+lq`, keys `k0..k0+lk`), kv head `kv` and its
/// query heads.
#[derive(Debug, Clone, Copy)]
struct Task {
    kv: usize,
    q0: usize,
    lq: usize,
    k0: usize,
    lk: usize,
}

impl Task {
    /// Keys visible to query `i` of the task's sequence (bottom-right causal).
    #[inline]
    fn visible(&self, i: usize) -> usize {
        i + (self.lk - self.lq) + 1
    }
}

/// Tasks in sequence-major, kv-head-minor order; sequences without queries produce nothing.
fn tasks(cu_q: &[u32], cu_k: &[u32], kv_heads: usize) -> Vec<Task> {
    let mut out = Vec::new();
    for s in 0..cu_q.len().saturating_sub(1) {
        let (q0, k0) = (cu_q[s] as usize, cu_k[s] as usize);
        let (lq, lk) = (cu_q[s + 1] as usize - q0, cu_k[s + 1] as usize - k0);
        if lq == 0 {
            continue;
        }
        out.extend((0..kv_heads).map(|kv| Task { kv, q0, lq, k0, lk }));
    }
    out
}

#[inline]
fn dot<R: Real>(a: &[R], b: &[R]) -> R {
    let mut lanes = [R::ZERO; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    let mut s = ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
    for (&x, &y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

/// `y += a * x`.
#[inline]
fn axpy<R: Real>(y: &mut [R], a: R, x: &[R]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

#[inline]
fn scale_in_place<R: Real>(y: &mut [R], a: R) {
    for y in y {
        *y *= a;
    }
}

/// Copies the rows `k0..k0 + lk` of kv head `kv` of a `[Tk, kv_heads, head_dim]` buffer into a
/// contiguous `[lk, head_dim]` one.
fn gather_head<R: Real>(x: &[R], t: &Task, g: &Geom) -> Vec<R> {
    let d = g.head_dim;
    let mut out = Vec::with_capacity(t.lk * d);
    for j in 0..t.lk {
        let at = ((t.k0 + j) * g.kv_heads + t.kv) * d;
        out.extend_from_slice(&x[at..at + d]);
    }
    out
}

/// Row `i` of query head `hh` (within the task's group) of a `[Tq, heads, head_dim]` buffer.
#[inline]
fn q_row<'a, R>(x: &'a [R], t: &Task, g: &Geom, hh: usize, i: usize) -> &'a [R] {
    let at = ((t.q0 + i) * g.heads + t.kv * g.group + hh) * g.head_dim;
    &x[at..at + g.head_dim]
}

/// Writes `p[j] = exp(scale * q.k_j - max)` for the `p.len()` visible keys; returns `sum_j p[j]`.
#[inline]
fn exp_scores<R: Real>(q: &[R], keys: &[R], scale: R, p: &mut [R]) -> R {
    let d = q.len();
    let mut max = R::NEG_INFINITY;
    for (j, pj) in p.iter_mut().enumerate() {
        *pj = scale * dot(q, &keys[j * d..(j + 1) * d]);
        max = max.max(*pj);
    }
    let mut sum = R::ZERO;
    for pj in p.iter_mut() {
        *pj = (*pj - max).exp();
        sum += *pj;
    }
    sum
}

fn forward<R: Real>(q: &[R], k: &[R], v: &[R], g: Geom, cu_q: &[u32], cu_k: &[u32], scale: R) -> Vec<R> {
    let d = g.head_dim;
    let tasks = tasks(cu_q, cu_k, g.kv_heads);
    let blocks: Vec<Vec<R>> = tasks
        .par_iter()
        .map(|t| {
            let (keys, vals) = (gather_head(k, t, &g), gather_head(v, t, &g));
            let mut p = vec![R::ZERO; t.lk];
            let mut out = vec![R::ZERO; g.group * t.lq * d];
            for hh in 0..g.group {
                for i in 0..t.lq {
                    let n = t.visible(i);
                    let sum = exp_scores(q_row(q, t, &g, hh, i), &keys, scale, &mut p[..n]);
                    let o = &mut out[(hh * t.lq + i) * d..][..d];
                    for (j, &pj) in p[..n].iter().enumerate() {
                        axpy(o, pj, &vals[j * d..(j + 1) * d]);
                    }
                    scale_in_place(o, R::ONE / sum);
                }
            }
            out
        })
        .collect();
    let mut out = vec![R::ZERO; q.len()];
    for (t, block) in tasks.iter().zip(&blocks) {
        for hh in 0..g.group {
            for i in 0..t.lq {
                let at = ((t.q0 + i) * g.heads + t.kv * g.group + hh) * d;
                out[at..at + d].copy_from_slice(&block[(hh * t.lq + i) * d..][..d]);
            }
        }
    }
    out
}

/// Returns `[dq ++ dk ++ dv]`, each flat in the layout of its input.
#[allow(clippy::too_many_arguments)]
fn backward<R: Real>(q: &[R], k: &[R], v: &[R], dout: &[R], g: Geom, cu_q: &[u32], cu_k: &[u32], scale: R) -> Vec<R> {
    let d = g.head_dim;
    let tasks = tasks(cu_q, cu_k, g.kv_heads);
    let blocks: Vec<(Vec<R>, Vec<R>, Vec<R>)> = tasks
        .par_iter()
        .map(|t| {
            let (keys, vals) = (gather_head(k, t, &g), gather_head(v, t, &g));
            let (mut p, mut dp) = (vec![R::ZERO; t.lk], vec![R::ZERO; t.lk]);
            let mut dq = vec![R::ZERO; g.group * t.lq * d];
            let (mut dk, mut dv) = (vec![R::ZERO; t.lk * d], vec![R::ZERO; t.lk * d]);
            for hh in 0..g.group {
                for i in 0..t.lq {
                    let n = t.visible(i);
                    let (qi, doi) = (q_row(q, t, &g, hh, i), q_row(dout, t, &g, hh, i));
                    let (p, dp) = (&mut p[..n], &mut dp[..n]);
                    let inv = R::ONE / exp_scores(qi, &keys, scale, p);
                    let mut delta = R::ZERO;
                    for j in 0..n {
                        p[j] *= inv;
                        dp[j] = dot(doi, &vals[j * d..(j + 1) * d]);
                        delta += p[j] * dp[j];
                    }
                    let dqi = &mut dq[(hh * t.lq + i) * d..][..d];
                    for j in 0..n {
                        let ds = p[j] * (dp[j] - delta);
                        let row = j * d..(j + 1) * d;
                        axpy(dqi, ds, &keys[row.clone()]);
                        axpy(&mut dk[row.clone()], ds, qi);
                        axpy(&mut dv[row], p[j], doi);
                    }
                    scale_in_place(dqi, scale);
                }
            }
            scale_in_place(&mut dk, scale);
            (dq, dk, dv)
        })
        .collect();
    let (nq, nk) = (q.len(), k.len());
    let mut out = vec![R::ZERO; nq + 2 * nk];
    let (dq_all, dkv_all) = out.split_at_mut(nq);
    let (dk_all, dv_all) = dkv_all.split_at_mut(nk);
    for (t, (dq, dk, dv)) in tasks.iter().zip(&blocks) {
        for hh in 0..g.group {
            for i in 0..t.lq {
                let at = ((t.q0 + i) * g.heads + t.kv * g.group + hh) * d;
                dq_all[at..at + d].copy_from_slice(&dq[(hh * t.lq + i) * d..][..d]);
            }
        }
        for j in 0..t.lk {
            let at = ((t.k0 + j) * g.kv_heads + t.kv) * d;
            dk_all[at..at + d].copy_from_slice(&dk[j * d..(j + 1) * d]);
            dv_all[at..at + d].copy_from_slice(&dv[j * d..(j + 1) * d]);
        }
    }
    out
}

impl CustomOp3 for VarlenAttention {
    fn name(&self) -> &'static str {
        "vime-varlen-attention"
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
        let dtype = same_dtype("varlen_attention", &[s1.dtype(), s2.dtype(), s3.dtype()])?;
        let g = Geom::new(l1, l2)?;
        with_acc!(dtype, R => {
            let q = R::read(s1, l1)?;
            let k = R::read(s2, l2)?;
            let v = R::read(s3, l3)?;
            let out = forward(&q, &k, &v, g, &self.cu_q, &self.cu_k, R::from_f64(self.scale));
            Ok((R::write(out, dtype)?, l1.shape().clone()))
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
        Geom::new(l1, l2)?;
        crate::cuda::flash_fwd(
            s1,
            l1,
            s2,
            l2,
            s3,
            l3,
            &self.cu_q,
            &self.cu_k,
            self.scale,
            &self.kernels,
            &self.lse,
        )
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let op = VarlenAttentionBwd {
            fwd: self.clone(),
            grad_out: grad.contiguous()?,
            out: res.clone(),
        };
        let packed = q.apply_op3_no_bwd(k, v, &op)?;
        let (nq, nk) = (q.elem_count(), k.elem_count());
        let dq = packed.narrow(0, 0, nq)?.reshape(q.shape())?;
        let dk = packed.narrow(0, nq, nk)?.reshape(k.shape())?;
        let dv = packed.narrow(0, nq + nk, nk)?.reshape(v.shape())?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

/// The backward of [`VarlenAttention`] on `(q, k, v)`; `dO` rides in the struct.
struct VarlenAttentionBwd {
    fwd: VarlenAttention,
    grad_out: Tensor,
    /// The forward's output O (the CUDA backward's `delta = rowsum(dO * O)`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    out: Tensor,
}

impl CustomOp3 for VarlenAttentionBwd {
    fn name(&self) -> &'static str {
        "vime-varlen-attention-bwd"
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
        let dtype = same_dtype(
            "varlen_attention backward",
            &[s1.dtype(), s2.dtype(), s3.dtype(), self.grad_out.dtype()],
        )?;
        if self.grad_out.dims() != l1.dims() {
            bail!(
                "varlen_attention backward: grad {:?} does not match q {:?}",
                self.grad_out.dims(),
                l1.dims()
            );
        }
        let g = Geom::new(l1, l2)?;
        with_acc!(dtype, R => {
            let q = R::read(s1, l1)?;
            let k = R::read(s2, l2)?;
            let v = R::read(s3, l3)?;
            let dout = {
                let (storage, layout) = self.grad_out.storage_and_layout();
                match &*storage {
                    Storage::Cpu(s) => R::read(s, layout)?,
                    _ => bail!("varlen_attention backward: grad is not on the CPU while q, k, v are"),
                }
            };
            let f = &self.fwd;
            let out = backward(&q, &k, &v, &dout, g, &f.cu_q, &f.cu_k, R::from_f64(f.scale));
            let len = out.len();
            Ok((R::write(out, dtype)?, Shape::from(len)))
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
        if self.grad_out.dims() != l1.dims() {
            bail!(
                "varlen_attention backward: grad {:?} does not match q {:?}",
                self.grad_out.dims(),
                l1.dims()
            );
        }
        let f = &self.fwd;
        crate::cuda::flash_bwd(
            s1,
            l1,
            s2,
            l2,
            s3,
            l3,
            &self.out,
            &self.grad_out,
            &f.cu_q,
            &f.cu_k,
            f.scale,
            &f.kernels,
            &f.lse,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::version_string;

    #[test]
    fn cudnn_version_reads_as_major_minor_patch() {
        // cudnn_version.h: CUDNN_VERSION = MAJOR * 10000 + MINOR * 100 + PATCHLEVEL; the pinned
        // headers are 9.19.0 (91900), the kit's library 9.28.1 (92801).
        assert_eq!(version_string(91900).as_deref(), Some("9.19.0"));
        assert_eq!(version_string(92801).as_deref(), Some("9.28.1"));
        assert_eq!(version_string(0), None);
    }
}
