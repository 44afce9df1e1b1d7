//! vime-kernels: every fused op of the Qwen3 training path as a candle `CustomOp` with a forward
//! AND a backward.
//!
//! Decisions:
//! - One implementation per op, generic over the accumulation type ([`Real`]): f64 inputs compute
//!   in f64 (so finite-difference tests are meaningful), every other dtype (f32, bf16, f16)
//!   computes its statistics, softmax and reductions in f32 and rounds once on output.
//! - A backward that yields several gradients is one CustomOp whose output packs them flat; the
//!   public wrapper splits it with `narrow`. That keeps the backward device-generic: the CUDA build
//!   adds a `cuda_fwd` to the same op.
//! - Shape-carrying metadata (positions, `cu_seqlens`, target ids) lives in the op struct on the
//!   host, not in tensors: the batch is built on the host anyway, and it keeps the ops to at most
//!   three tensor inputs.
//! - candle's own `rms_norm`, `rope`, `softmax_last_dim` and flash-attn record no backward and
//!   would silently zero gradients; none of them is used here.
//! - Every fused op has a CPU kernel and, with the `cuda` feature, a CUDA kernel for bf16 tensors
//!   (`cuda/*.cu`, host side in [`cuda`]). Any other device/dtype (f32 on CUDA, say) runs
//!   [`composed`], the same op built from candle tensor ops with autograd backward; [`composed`]
//!   is also the reference the fused kernels are tested against.
//! - The explicit (no-autograd) forward/backward pairs (`*_backward`, [`varlen_attention_saved`],
//!   [`logprobs_entropy_saved`]) exist on every device and dtype: where no kernel exists they run
//!   the [`composed`] op under a local autograd graph and return its gradients, so a model's
//!   hand-written backward needs no second, autograd code path.
//! - Kernel choice is a value ([`KernelConfig`], in [`config`]) passed to the attention ops; the
//!   crate holds no process-global settings (the CUDA module cache is only a cache).
//! - Module dependencies point one way: [`config`], `checks` and [`real`] import nothing
//!   of the ops; the ops import [`composed`] (their fallback), `cuda` (their kernels) and [`vjp`].
pub mod attention;
mod checks;
pub mod composed;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg_attr(not(feature = "cudnn"), allow(dead_code))]
mod cudnn;
pub mod decode;
pub mod embedding;
pub mod fp8;
pub mod invariant;
pub mod lm_head;
pub mod real;
pub mod rmsnorm;
pub mod rope;
pub mod rows;
pub mod sample;
pub mod swiglu;
pub mod testing;
pub mod vjp;

pub use attention::{
    cudnn_graph_stats, cudnn_version, varlen_attention, varlen_attention_backward, varlen_attention_saved,
    AttentionSaved,
};
pub use config::{AttentionBackend, CudnnFailure, DecodeKernel, HeadLogits, KernelConfig, CUDNN_BUILT};
pub use embedding::{embedding_backward, embedding_backward_into};
pub use lm_head::{
    logprobs_entropy, logprobs_entropy_backward, logprobs_entropy_backward_into, logprobs_entropy_saved,
    logprobs_entropy_saved_with, logprobs_entropy_with, LmHeadSaved, IGNORE_TARGET,
};
pub use real::Real;
pub use rmsnorm::{add_rms_norm, rms_norm, rms_norm_backward, rms_norm_backward_add};
pub use rope::{rope, rope_backward};
pub use swiglu::{swiglu, swiglu_backward, swiglu_packed};
pub use vjp::vjp_seed;

/// Readies a device that vime drives: on CUDA, [`cuda::keep_pool_memory`] and
/// [`cuda::single_stream`]; nothing elsewhere. Call once, right after opening the device.
pub fn prepare_device(device: &candle_core::Device) -> candle_core::Result<()> {
    #[cfg(feature = "cuda")]
    {
        cuda::keep_pool_memory(device)?;
        cuda::single_stream(device)?;
    }
    #[cfg(not(feature = "cuda"))]
    let _ = device;
    Ok(())
}

/// Whether the public ops run the fused CUDA kernels for tensors of this device and dtype (bf16 on
/// a CUDA device, in a build with the `cuda` feature); other non-CPU cases run [`composed`].
pub fn fused_cuda(device: &candle_core::Device, dtype: candle_core::DType) -> bool {
    #[cfg(feature = "cuda")]
    {
        cuda::fused(device, dtype)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (device, dtype);
        false
    }
}

/// `a + b` (same shape and dtype). Fused CUDA (bf16): one 16-byte-access pass; elsewhere candle's
/// add. The value is the same: the f32 sum of the two bf16 values, rounded once.
pub fn add(a: &candle_core::Tensor, b: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
    #[cfg(feature = "cuda")]
    if fused_cuda(a.device(), a.dtype()) && b.dtype() == a.dtype() && a.dims() == b.dims() {
        return cuda::add_bf16(&a.contiguous()?, &b.contiguous()?);
    }
    a + b
}

/// Gradients into running sums: for each `(g, sum)`, `sum + g` in the sum's dtype, or `g` in
/// `dtype` where there is no sum (`g` as is when already in it). The values of
/// `sum + g.to_dtype(sum.dtype())` and `g.to_dtype(dtype)`, bit for bit. Fused CUDA (bf16
/// gradients, f32 sums, contiguous): one launch for every tensor, each sum updated in place.
pub fn widen_into_sums(
    items: Vec<(candle_core::Tensor, Option<candle_core::Tensor>)>,
    dtype: candle_core::DType,
) -> candle_core::Result<Vec<candle_core::Tensor>> {
    #[cfg(feature = "cuda")]
    if dtype == candle_core::DType::F32
        && !items.is_empty()
        && items.iter().all(|(g, s)| {
            fused_cuda(g.device(), g.dtype())
                && g.is_contiguous()
                && s.as_ref().is_none_or(|s| {
                    s.dtype() == candle_core::DType::F32
                        && s.is_contiguous()
                        && s.dims() == g.dims()
                        && s.device().same_device(g.device())
                })
        })
        && items.iter().all(|(g, _)| g.device().same_device(items[0].0.device()))
    {
        return cuda::widen_add_multi(&items);
    }
    items
        .into_iter()
        .map(|(g, sum)| match sum {
            Some(s) => {
                let g = g.to_dtype(s.dtype())?;
                s + g
            }
            None => g.to_dtype(dtype),
        })
        .collect()
}

/// A linear layer's weight gradient `dy^T x` (`dy: [T, out]`, `x: [T, in]`), `[out, in]` in at
/// least f32 (f64 inputs stay f64). Fused CUDA (bf16): one cuBLAS GEMM writing f32 directly, so the
/// f32 gradient buffers of the optimizer need no separate cast pass.
pub fn weight_grad(dy: &candle_core::Tensor, x: &candle_core::Tensor) -> candle_core::Result<candle_core::Tensor> {
    use candle_core::DType;
    #[cfg(feature = "cuda")]
    if fused_cuda(dy.device(), dy.dtype()) && x.dtype() == dy.dtype() {
        return cuda::weight_grad_f32(&dy.contiguous()?, &x.contiguous()?);
    }
    let g = dy.t()?.matmul(x)?;
    match g.dtype() {
        DType::F64 | DType::F32 => Ok(g),
        _ => g.to_dtype(DType::F32),
    }
}

/// `acc + dy^T x`: [`weight_grad`] added to a running sum `acc` (`[out, in]`, f32 or f64), e.g.
/// the earlier micro-batches' gradient of the same weight; `None` is [`weight_grad`] itself.
/// Fused CUDA (bf16 `dy`, `x`; contiguous f32 `acc`): the GEMM accumulates into `acc`'s buffer in
/// place (cuBLAS beta = 1, Megatron's gradient-accumulation fusion), instead of a GEMM into a new
/// f32 buffer and an add pass that reads both and writes a third (12 bytes a parameter per
/// micro-batch, and a second f32 copy of every gradient alive at once). The caller must own
/// `acc`. The value is the same: the GEMM's f32 accumulator plus `acc`, rounded once to f32, is
/// what the add computes from the GEMM's f32 output. Elsewhere: [`weight_grad`] + add (in
/// `acc`'s dtype). A shape mismatch is an error naming both shapes.
pub fn weight_grad_into(
    acc: Option<candle_core::Tensor>,
    dy: &candle_core::Tensor,
    x: &candle_core::Tensor,
) -> candle_core::Result<candle_core::Tensor> {
    let Some(acc) = acc else {
        return weight_grad(dy, x);
    };
    let (out, inp) = (dy.dim(candle_core::D::Minus1)?, x.dim(candle_core::D::Minus1)?);
    if acc.dims() != [out, inp] {
        candle_core::bail!(
            "weight gradient: the running sum is {:?}, but dy {:?} and x {:?} give [{out}, {inp}]",
            acc.dims(),
            dy.dims(),
            x.dims()
        );
    }
    #[cfg(feature = "cuda")]
    if fused_cuda(dy.device(), dy.dtype())
        && x.dtype() == dy.dtype()
        && acc.dtype() == candle_core::DType::F32
        && acc.is_contiguous()
        && acc.device().same_device(dy.device())
    {
        cuda::weight_grad_acc_inplace(&acc, &dy.contiguous()?, &x.contiguous()?)?;
        return Ok(acc);
    }
    let g = weight_grad(dy, x)?.to_dtype(acc.dtype())?;
    acc + g
}

/// `acc + a . w` (`acc: [T, D]`, `a: [T, I]`, `w: [I, D]`), consuming `acc`. Fused CUDA (bf16):
/// the GEMM accumulates into `acc`'s buffer in place (cuBLAS beta = 1), saving an add pass; the
/// caller must own `acc` (a fresh result, not shared with another tensor). Elsewhere: matmul +
/// add.
pub fn matmul_acc(
    acc: candle_core::Tensor,
    a: &candle_core::Tensor,
    w: &candle_core::Tensor,
) -> candle_core::Result<candle_core::Tensor> {
    #[cfg(feature = "cuda")]
    if fused_cuda(acc.device(), acc.dtype())
        && a.dtype() == acc.dtype()
        && w.dtype() == acc.dtype()
        && acc.is_contiguous()
    {
        cuda::matmul_acc_inplace(&acc, &a.contiguous()?, &w.contiguous()?)?;
        return Ok(acc);
    }
    acc + a.matmul(w)?
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Tensor};

    /// `weight_grad_into` on the CPU: the sum plus `dy^T x` computed by hand, in the sum's dtype
    /// (f32 sum, bf16 inputs), `None` is `weight_grad`, and a sum of the wrong shape is an error
    /// naming both shapes.
    #[test]
    fn weight_grad_into_adds_dy_t_x_to_the_sum() {
        let dev = Device::Cpu;
        let dy = Tensor::new(&[[1f32, 2.0], [3.0, -1.0], [0.5, 4.0]], &dev).unwrap();
        let x = Tensor::new(&[[2f32, 0.0, 1.0], [1.0, 1.0, -2.0], [4.0, 2.0, 0.0]], &dev).unwrap();
        let sum = Tensor::new(&[[10f32, 20.0, 30.0], [-1.0, -2.0, -3.0]], &dev).unwrap();
        // dy^T x: row o, col i = sum_t dy[t, o] x[t, i].
        let want = [
            [10.0 + 7.0, 20.0 + 4.0, 30.0 - 5.0],
            [-1.0 + 19.0, -2.0 + 7.0, -3.0 + 4.0],
        ];
        let bf = |t: &Tensor| t.to_dtype(DType::BF16).unwrap();
        let got = weight_grad_into(Some(sum.clone()), &bf(&dy), &bf(&x)).unwrap();
        assert_eq!(got.dtype(), DType::F32);
        assert_eq!(got.to_vec2::<f32>().unwrap(), want);
        let first = weight_grad_into(None, &bf(&dy), &bf(&x)).unwrap();
        assert_eq!(first.to_vec2::<f32>().unwrap(), [[7.0, 4.0, -5.0], [19.0, 7.0, 4.0]]);
        let e = weight_grad_into(Some(Tensor::zeros((3, 3), DType::F32, &dev).unwrap()), &dy, &x)
            .unwrap_err()
            .to_string();
        assert!(e.contains("[3, 3]") && e.contains("[2, 3]"), "{e}");
    }
}
