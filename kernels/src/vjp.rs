//! `vjp_seed(y, g)`: starts a backward pass at `y` with the upstream gradient `g` — the
//! vector-Jacobian product that the layer-by-layer backward (and the recompute path) needs.
//!
//! candle's `backward()` only starts at a scalar, so the obvious seed is
//! `(y * g.detach()).sum_all().backward()`. That computes a product and a full reduction nobody
//! reads, and on CUDA candle reduces a whole tensor in ONE thread block. Replacing it with this op
//! took 26 ms off a 4096-token Qwen3-4B step with full recompute on an H200 (0.654 -> 0.628 s,
//! `benches/results/2026-11-30-bench-step-h200-issue7.md`). This op is a scalar whose forward
//! computes nothing (its value is 0; nobody reads it) and whose backward hands `grad * g` to `y`,
//! where `grad` is the scalar seed (1 from `backward()`). So
//! `vjp_seed(y, g).backward()` yields exactly the gradients of `(y * g).sum_all().backward()`
//! without the reduction or the elementwise product in the forward.
#[cfg(feature = "cuda")]
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

/// A scalar (value 0, f32) whose gradient with respect to `y` is `g` (times the seed). `g` is
/// detached: no gradient flows into it.
pub fn vjp_seed(y: &Tensor, g: &Tensor) -> Result<Tensor> {
    if y.dims() != g.dims() {
        bail!(
            "vjp_seed: output {:?} and its gradient {:?} differ in shape",
            y.dims(),
            g.dims()
        );
    }
    if y.dtype() != g.dtype() {
        bail!(
            "vjp_seed: output is {:?} but its gradient is {:?}",
            y.dtype(),
            g.dtype()
        );
    }
    y.apply_op2(&g.detach(), VjpSeed)
}

#[derive(Debug, Clone, Copy)]
struct VjpSeed;

impl CustomOp2 for VjpSeed {
    fn name(&self) -> &'static str {
        "vime-vjp-seed"
    }

    fn cpu_fwd(&self, _s1: &CpuStorage, _l1: &Layout, _s2: &CpuStorage, _l2: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((CpuStorage::F32(vec![0.0]), Shape::from(())))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        _l1: &Layout,
        _s2: &candle_core::CudaStorage,
        _l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let dev = s1.device();
        let zero = dev.alloc_zeros::<f32>(1)?;
        Ok((
            candle_core::CudaStorage::wrap_cuda_slice(zero, dev.clone()),
            Shape::from(()),
        ))
    }

    fn bwd(&self, _y: &Tensor, g: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // One elementwise pass (the seed is 1 from backward(); reading it would cost a sync).
        Ok((Some(g.broadcast_mul(&grad.to_dtype(g.dtype())?)?), None))
    }
}
