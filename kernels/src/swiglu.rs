//! SwiGLU gate: `y = silu(gate) * up`, `silu(g) = g * sigmoid(g)`, elementwise in f32 (f64 for
//! f64 inputs). Backward, packed as `[d_gate ++ d_up]`:
//!   d_gate = g_y * up * sig(g) * (1 + g * (1 - sig(g)))
//!   d_up   = g_y * silu(g)
use crate::real::{same_dtype, Real};
use crate::with_acc;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

const CHUNK: usize = 1 << 14;

/// `silu(gate) * up` for two tensors of one shape, with backward.
pub fn swiglu(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let fused = crate::fused_cuda(gate.device(), gate.dtype()) && up.dtype() == gate.dtype();
    if !(gate.device().is_cpu() || fused) {
        return crate::composed::swiglu(gate, up);
    }
    if gate.dims() != up.dims() {
        bail!("swiglu: gate {:?} and up {:?} differ in shape", gate.dims(), up.dims());
    }
    gate.contiguous()?.apply_op2(&up.contiguous()?, SwiGlu)
}

/// Inference only: [`swiglu`] of the two halves of a fused gate|up projection `gu: [t, 2 x I]`
/// (gate the first `I` columns, up the last), `[t, I]`. On CUDA bf16 one kernel reading `gu` in
/// place with the same arithmetic as [`swiglu`]'s (the same bits); elsewhere [`swiglu`] of the
/// two halves.
pub fn swiglu_packed(gu: &Tensor) -> Result<Tensor> {
    let (_, two) = gu.dims2()?;
    if two % 2 != 0 {
        bail!("swiglu_packed: {two} columns do not split into gate and up halves");
    }
    #[cfg(feature = "cuda")]
    if crate::fused_cuda(gu.device(), gu.dtype()) {
        return crate::cuda::swiglu_packed(gu);
    }
    swiglu(&gu.narrow(1, 0, two / 2)?, &gu.narrow(1, two / 2, two / 2)?)
}

/// The backward of [`swiglu`] without autograd: `(d_gate, d_up)` for the upstream gradient `dy`.
/// Where no kernel exists, the composed op's autograd on leaf copies of `gate` and `up`.
pub fn swiglu_backward(gate: &Tensor, up: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    if gate.dims() != up.dims() || dy.dims() != gate.dims() {
        bail!(
            "swiglu_backward: gate {:?}, up {:?} and dy {:?} must match",
            gate.dims(),
            up.dims(),
            dy.dims()
        );
    }
    let fused = crate::fused_cuda(gate.device(), gate.dtype()) && up.dtype() == gate.dtype();
    if !(gate.device().is_cpu() || fused) {
        return crate::composed::swiglu_backward(gate, up, dy);
    }
    let (gate, up) = (gate.contiguous()?, up.contiguous()?);
    let (dg, du) = SwiGlu.bwd(&gate, &up, &gate, dy)?;
    Ok((dg.expect("swiglu d_gate"), du.expect("swiglu d_up")))
}

#[inline]
fn sigmoid<R: Real>(g: R) -> R {
    R::ONE / (R::ONE + (-g).exp())
}

#[derive(Debug, Clone, Copy)]
struct SwiGlu;

impl CustomOp2 for SwiGlu {
    fn name(&self) -> &'static str {
        "vime-swiglu"
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        let dtype = same_dtype("swiglu", &[s1.dtype(), s2.dtype()])?;
        with_acc!(dtype, R => {
            let g = R::read(s1, l1)?;
            let u = R::read(s2, l2)?;
            let mut y = vec![R::ZERO; g.len()];
            y.par_chunks_mut(CHUNK).zip(g.par_chunks(CHUNK)).zip(u.par_chunks(CHUNK)).for_each(|((y, g), u)| {
                for i in 0..y.len() {
                    y[i] = g[i] * sigmoid(g[i]) * u[i];
                }
            });
            Ok((R::write(y, dtype)?, l1.shape().clone()))
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
        crate::cuda::swiglu_fwd(s1, l1, s2, l2)
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let packed = gate.apply_op3_no_bwd(up, &grad.contiguous()?, &SwiGluBwd)?;
        let n = gate.elem_count();
        let dg = packed.narrow(0, 0, n)?.reshape(gate.shape())?;
        let du = packed.narrow(0, n, n)?.reshape(up.shape())?;
        Ok((Some(dg), Some(du)))
    }
}

#[derive(Debug, Clone, Copy)]
struct SwiGluBwd;

impl CustomOp3 for SwiGluBwd {
    fn name(&self) -> &'static str {
        "vime-swiglu-bwd"
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
        let dtype = same_dtype("swiglu backward", &[s1.dtype(), s2.dtype(), s3.dtype()])?;
        with_acc!(dtype, R => {
            let g = R::read(s1, l1)?;
            let u = R::read(s2, l2)?;
            let gy = R::read(s3, l3)?;
            let n = g.len();
            let mut out = vec![R::ZERO; 2 * n];
            let (dg, du) = out.split_at_mut(n);
            dg.par_chunks_mut(CHUNK)
                .zip(du.par_chunks_mut(CHUNK))
                .zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK)).zip(gy.par_chunks(CHUNK)))
                .for_each(|((dg, du), ((g, u), gy))| {
                    for i in 0..dg.len() {
                        let s = sigmoid(g[i]);
                        dg[i] = gy[i] * u[i] * s * (R::ONE + g[i] * (R::ONE - s));
                        du[i] = gy[i] * g[i] * s;
                    }
                });
            Ok((R::write(out, dtype)?, Shape::from(2 * n)))
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
        crate::cuda::swiglu_bwd(s1, l1, s2, l2, s3, l3)
    }
}
