//! RMSNorm over the last dimension, HF Qwen3 semantics: `y = w * x / sqrt(mean(x^2) + eps)`.
//!
//! Statistics in f32 (f64 for f64 inputs); the output is rounded once to the input dtype. The
//! backward recomputes `rstd` from `x` instead of saving it: one extra pass over a row that is
//! already in cache, and no second output to carry through candle's graph.
//!   xhat = x * rstd
//!   dw   = sum_rows(g * xhat)
//!   dx   = rstd * (g*w - xhat * mean(g*w*xhat))
use crate::real::{same_dtype, Real};
use crate::with_acc;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

/// Rows per rayon task; fixed so that reductions over rows happen in the same order every run.
const ROWS_PER_TASK: usize = 64;

/// `y = weight * x / sqrt(mean(x^2, -1) + eps)` over the last dimension of `x`, with backward.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let fused = crate::fused_cuda(x.device(), x.dtype()) && weight.dtype() == x.dtype();
    if !(x.device().is_cpu() || fused) {
        return crate::composed::rms_norm(x, weight, eps);
    }
    let d = x.dim(candle_core::D::Minus1)?;
    if weight.dims() != [d] {
        bail!(
            "rms_norm: weight shape {:?} does not match the last dim {d} of x {:?}",
            weight.dims(),
            x.dims()
        );
    }
    x.contiguous()?.apply_op2(&weight.contiguous()?, RmsNorm { eps })
}

/// The backward of [`rms_norm`] without autograd, for hand-written backward passes:
/// `(dx, dweight)` for the upstream gradient `dy`. The CPU and fused CUDA kernels where they
/// apply, else the composed op's autograd on leaf copies of `x` and `weight`.
pub fn rms_norm_backward(x: &Tensor, weight: &Tensor, eps: f64, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    if dy.dims() != x.dims() {
        bail!(
            "rms_norm_backward: dy {:?} and x {:?} differ in shape",
            dy.dims(),
            x.dims()
        );
    }
    let fused = crate::fused_cuda(x.device(), x.dtype()) && weight.dtype() == x.dtype();
    if !(x.device().is_cpu() || fused) {
        return crate::composed::rms_norm_backward(x, weight, eps, dy);
    }
    let (x, weight) = (x.contiguous()?, weight.contiguous()?);
    let (dx, dw) = RmsNorm { eps }.bwd(&x, &weight, &x, dy)?;
    Ok((dx.expect("rms_norm dx"), dw.expect("rms_norm dweight")))
}

/// `s = x + r` and `rms_norm(s, weight, eps)`, returned as `(s, y)`: the residual add and the norm
/// that reads it (the block's `x2 = x + o`, `h2 = rms(x2)`). Fused CUDA (bf16, rows of a multiple
/// of 8 wider than the warp kernels' 256): one pass that reads x and r and writes s and y, the
/// same values as the add then the norm; elsewhere exactly those two ops.
pub fn add_rms_norm(x: &Tensor, r: &Tensor, weight: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if crate::fused_cuda(x.device(), x.dtype())
        && r.dtype() == x.dtype()
        && weight.dtype() == x.dtype()
        && crate::cuda::fused_residual_norm(weight.elem_count())
    {
        return crate::cuda::add_rms_norm(&x.contiguous()?, &r.contiguous()?, &weight.contiguous()?, eps);
    }
    let s = crate::add(x, r)?;
    let y = rms_norm(&s, weight, eps)?;
    Ok((s, y))
}

/// [`rms_norm_backward`] with the gradient `residual` that reaches `x` by the skip connection
/// added: `(residual + dx, dw)` (the block's `dx2 = dy + rms'(x2; dh2)`). Fused CUDA (as
/// [`add_rms_norm`]): the add happens in the backward's own pass, the values of the two ops;
/// elsewhere exactly those two ops.
pub fn rms_norm_backward_add(
    x: &Tensor,
    weight: &Tensor,
    eps: f64,
    dy: &Tensor,
    residual: &Tensor,
) -> Result<(Tensor, Tensor)> {
    if residual.dims() != x.dims() {
        bail!(
            "rms_norm_backward_add: the residual gradient {:?} and x {:?} differ in shape",
            residual.dims(),
            x.dims()
        );
    }
    #[cfg(feature = "cuda")]
    if crate::fused_cuda(x.device(), x.dtype())
        && [weight.dtype(), dy.dtype(), residual.dtype()]
            .iter()
            .all(|&t| t == x.dtype())
        && dy.dims() == x.dims()
        && crate::cuda::fused_residual_norm(weight.elem_count())
    {
        return crate::cuda::rms_norm_bwd_res(
            &x.contiguous()?,
            &weight.contiguous()?,
            eps,
            &dy.contiguous()?,
            &residual.contiguous()?,
        );
    }
    let (dx, dw) = rms_norm_backward(x, weight, eps, dy)?;
    Ok((crate::add(residual, &dx)?, dw))
}

#[derive(Debug, Clone, Copy)]
struct RmsNorm {
    eps: f64,
}

fn rstd<R: Real>(row: &[R], eps: f64) -> R {
    let mut ss = R::ZERO;
    for &v in row {
        ss += v * v;
    }
    R::ONE / (ss / R::from_f64(row.len() as f64) + R::from_f64(eps)).sqrt()
}

fn forward<R: Real>(x: &[R], w: &[R], eps: f64) -> Vec<R> {
    let d = w.len();
    let mut y = vec![R::ZERO; x.len()];
    y.par_chunks_mut(d * ROWS_PER_TASK)
        .zip(x.par_chunks(d * ROWS_PER_TASK))
        .for_each(|(yc, xc)| {
            for (yr, xr) in yc.chunks_mut(d).zip(xc.chunks(d)) {
                let r = rstd(xr, eps);
                for i in 0..d {
                    yr[i] = xr[i] * r * w[i];
                }
            }
        });
    y
}

/// Returns `[dx (flat) ++ dw]`.
fn backward<R: Real>(x: &[R], w: &[R], g: &[R], eps: f64) -> Vec<R> {
    let d = w.len();
    let n = x.len();
    let mut out = vec![R::ZERO; n + d];
    let (dx, dw) = out.split_at_mut(n);
    let partial_dw: Vec<Vec<R>> = dx
        .par_chunks_mut(d * ROWS_PER_TASK)
        .zip(x.par_chunks(d * ROWS_PER_TASK))
        .zip(g.par_chunks(d * ROWS_PER_TASK))
        .map(|((dxc, xc), gc)| {
            let mut dw_local = vec![R::ZERO; d];
            for ((dxr, xr), gr) in dxc.chunks_mut(d).zip(xc.chunks(d)).zip(gc.chunks(d)) {
                let r = rstd(xr, eps);
                let mut dot = R::ZERO;
                for i in 0..d {
                    let xhat = xr[i] * r;
                    dw_local[i] += gr[i] * xhat;
                    dot += gr[i] * w[i] * xhat;
                }
                let mean = dot / R::from_f64(d as f64);
                for i in 0..d {
                    dxr[i] = r * (gr[i] * w[i] - xr[i] * r * mean);
                }
            }
            dw_local
        })
        .collect();
    for p in partial_dw {
        for i in 0..d {
            dw[i] += p[i];
        }
    }
    out
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "vime-rms-norm"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let dtype = same_dtype("rms_norm", &[s1.dtype(), s2.dtype()])?;
        with_acc!(dtype, R => {
            let x = R::read(s1, l1)?;
            let w = R::read(s2, l2)?;
            Ok((R::write(forward(&x, &w, self.eps), dtype)?, l1.shape().clone()))
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
        crate::cuda::rms_norm_fwd(s1, l1, s2, l2, self.eps)
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let packed = x.apply_op3_no_bwd(w, &grad.contiguous()?, &RmsNormBwd { eps: self.eps })?;
        let n = x.elem_count();
        let dx = packed.narrow(0, 0, n)?.reshape(x.shape())?;
        let dw = packed.narrow(0, n, w.elem_count())?;
        Ok((Some(dx), Some(dw)))
    }
}

#[derive(Debug, Clone, Copy)]
struct RmsNormBwd {
    eps: f64,
}

impl CustomOp3 for RmsNormBwd {
    fn name(&self) -> &'static str {
        "vime-rms-norm-bwd"
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
        let dtype = same_dtype("rms_norm backward", &[s1.dtype(), s2.dtype(), s3.dtype()])?;
        with_acc!(dtype, R => {
            let x = R::read(s1, l1)?;
            let w = R::read(s2, l2)?;
            let g = R::read(s3, l3)?;
            let out = backward(&x, &w, &g, self.eps);
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
        crate::cuda::rms_norm_bwd(s1, l1, s2, l2, s3, l3, self.eps)
    }
}
