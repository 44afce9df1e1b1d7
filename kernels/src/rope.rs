//! Rotary position embedding, HF Qwen3 convention (`rotate_half`: the two halves of each head
//! are the pair, not interleaved lanes):
//!   out[..i]   = x[..i] * cos - x[i..] * sin
//!   out[i..]   = x[i..] * cos + x[..i] * sin          (i = head_dim / 2)
//! with `angle(pos, j) = pos * inv_freq[j]`, `inv_freq[j] = 1 / theta^(2j / head_dim)`, computed in
//! f32 as HF does (f64 for f64 inputs), so f32 parity holds to rounding.
//!
//! The backward of a rotation is the rotation by the opposite angle: the same op with `sign = -1`.
//! Positions are per token (`position_ids`, restarting per packed sequence) and shared by all
//! layers through an `Arc`.
use crate::real::Real;
use crate::with_acc;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;
use std::sync::Arc;

/// Applies RoPE to `x: [T, n_heads, head_dim]` at `positions: [T]`, with backward.
pub fn rope(x: &Tensor, positions: &Arc<[u32]>, theta: f64) -> Result<Tensor> {
    if !x.device().is_cpu() && !crate::fused_cuda(x.device(), x.dtype()) {
        return crate::composed::rope(x, positions, theta);
    }
    let (t, _h, d) = x.dims3()?;
    if positions.len() != t {
        bail!("rope: {} positions for {t} tokens (x {:?})", positions.len(), x.dims());
    }
    if d % 2 != 0 {
        bail!("rope: head_dim {d} must be even");
    }
    x.contiguous()?.apply_op1(Rope {
        positions: positions.clone(),
        theta,
        sign: 1.0,
    })
}

/// The backward of [`rope`] without autograd: the rotation of `dy` by the opposite angles. Where
/// no kernel exists, [`crate::composed::rope_backward`].
pub fn rope_backward(dy: &Tensor, positions: &Arc<[u32]>, theta: f64) -> Result<Tensor> {
    if !dy.device().is_cpu() && !crate::fused_cuda(dy.device(), dy.dtype()) {
        return crate::composed::rope_backward(dy, positions, theta);
    }
    let (t, _h, d) = dy.dims3()?;
    if positions.len() != t || d % 2 != 0 {
        bail!("rope_backward: {} positions for dy {:?}", positions.len(), dy.dims());
    }
    dy.contiguous()?.apply_op1_no_bwd(&Rope {
        positions: positions.clone(),
        theta,
        sign: -1.0,
    })
}

/// Inference only (no backward): `(rope(rms_norm(q; wq)), rope(rms_norm(k; wk)))` for the
/// per-head norms of a layer, `q: [T, Hq, d]`, `k: [T, Hk, d]`, `wq, wk: [d]`. On CUDA bf16 with
/// `d = 128` one kernel that equals the four separate kernels bit for bit; elsewhere those ops.
/// `positions_dev`: the same positions already on the device (u32), read by the kernel instead
/// of uploading `positions` (a captured CUDA graph's input buffer).
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope(
    q: &Tensor,
    k: &Tensor,
    wq: &Tensor,
    wk: &Tensor,
    eps: f64,
    positions: &Arc<[u32]>,
    positions_dev: Option<&Tensor>,
    theta: f64,
) -> Result<(Tensor, Tensor)> {
    if let Some(p) = positions_dev {
        if p.dims1()? != positions.len() || p.dtype() != DType::U32 {
            bail!(
                "qk_norm_rope: device positions {:?} {:?}, {} host positions",
                p.dims(),
                p.dtype(),
                positions.len()
            );
        }
    }
    #[cfg(feature = "cuda")]
    if crate::fused_cuda(q.device(), q.dtype()) && q.dim(2)? == 128 && k.dim(2)? == 128 {
        let t = q.dim(0)?;
        if positions.len() != t || k.dim(0)? != t || wq.dims() != [128] || wk.dims() != [128] {
            bail!(
                "qk_norm_rope: q {:?}, k {:?}, weights {:?} / {:?}, {} positions",
                q.dims(),
                k.dims(),
                wq.dims(),
                wk.dims(),
                positions.len()
            );
        }
        // q and k may be head views of wider rows (the fused q|k|v projection): read in place.
        return crate::cuda::qk_norm_rope(
            q,
            k,
            &wq.contiguous()?,
            &wk.contiguous()?,
            positions,
            positions_dev,
            eps,
            theta,
        );
    }
    Ok((
        rope(&crate::rms_norm(q, wq, eps)?, positions, theta)?,
        rope(&crate::rms_norm(k, wk, eps)?, positions, theta)?,
    ))
}

/// The backward of the training forward's `(rope(rms_norm(q; wq)), rope(rms_norm(k; wk)))`
/// without autograd: `gq`/`gk` the gradients of the rotated outputs, `q`/`k` the norms' inputs.
/// Returns `(dq, dk, dwq, dwk)`, each as [`rope_backward`] then [`crate::rms_norm_backward`]
/// give them. On CUDA bf16 with `d = 128` one kernel for both (the same bits for `dq`/`dk`, the
/// weights' gradients summed over other row groups); elsewhere those ops.
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope_backward(
    gq: &Tensor,
    gk: &Tensor,
    q: &Tensor,
    k: &Tensor,
    wq: &Tensor,
    wk: &Tensor,
    eps: f64,
    positions: &Arc<[u32]>,
    theta: f64,
) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
    let (t, hq, d) = gq.dims3()?;
    let (tk, hk, dk) = gk.dims3()?;
    if q.dims() != [t, hq, d] || k.dims() != [tk, hk, dk] || tk != t || dk != d || positions.len() != t {
        bail!(
            "qk_norm_rope_backward: gq {:?}, gk {:?}, q {:?}, k {:?}, {} positions",
            gq.dims(),
            gk.dims(),
            q.dims(),
            k.dims(),
            positions.len()
        );
    }
    #[cfg(feature = "cuda")]
    if crate::fused_cuda(gq.device(), gq.dtype()) && d == 128 {
        if wq.dims() != [128] || wk.dims() != [128] {
            bail!(
                "qk_norm_rope_backward: norm weights {:?} / {:?} for head_dim 128",
                wq.dims(),
                wk.dims()
            );
        }
        return crate::cuda::qk_norm_rope_bwd(gq, gk, q, k, wq, wk, positions, eps, theta);
    }
    let (dq, dwq) = crate::rms_norm_backward(q, wq, eps, &rope_backward(gq, positions, theta)?)?;
    let (dk, dwk) = crate::rms_norm_backward(k, wk, eps, &rope_backward(gk, positions, theta)?)?;
    Ok((dq, dk, dwq, dwk))
}

#[derive(Debug, Clone)]
struct Rope {
    positions: Arc<[u32]>,
    theta: f64,
    /// +1 rotates forward (the op), -1 rotates back (its backward).
    sign: f64,
}

fn apply<R: Real>(x: &[R], dims: &[usize], positions: &[u32], theta: f64, sign: f64) -> Vec<R> {
    let (h, d) = (dims[1], dims[2]);
    let half = d / 2;
    let inv_freq: Vec<R> = (0..half)
        .map(|j| R::ONE / R::from_f64(theta).powf(R::from_f64((2 * j) as f64) / R::from_f64(d as f64)))
        .collect();
    let s = R::from_f64(sign);
    let mut out = vec![R::ZERO; x.len()];
    out.par_chunks_mut(h * d)
        .zip(x.par_chunks(h * d))
        .zip(positions.par_iter())
        .for_each(|((ot, xt), &p)| {
            let pos = R::from_f64(p as f64);
            let (cos, sin): (Vec<R>, Vec<R>) = inv_freq
                .iter()
                .map(|&f| {
                    let a = pos * f;
                    (a.cos(), s * a.sin())
                })
                .unzip();
            for (oh, xh) in ot.chunks_mut(d).zip(xt.chunks(d)) {
                for j in 0..half {
                    let (x1, x2) = (xh[j], xh[j + half]);
                    oh[j] = x1 * cos[j] - x2 * sin[j];
                    oh[j + half] = x2 * cos[j] + x1 * sin[j];
                }
            }
        });
    out
}

impl CustomOp1 for Rope {
    fn name(&self) -> &'static str {
        "vime-rope"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let dtype = s.dtype();
        with_acc!(dtype, R => {
            let x = R::read(s, l)?;
            let y = apply(&x, l.dims(), &self.positions, self.theta, self.sign);
            Ok((R::write(y, dtype)?, l.shape().clone()))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s: &candle_core::CudaStorage, l: &Layout) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::cuda::rope(s, l, &self.positions, self.theta, self.sign)
    }

    fn bwd(&self, _x: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let back = Rope {
            sign: -self.sign,
            ..self.clone()
        };
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(&back)?))
    }
}
