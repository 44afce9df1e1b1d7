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
    cudnn_graph_stats, varlen_attention, varlen_attention_backward, varlen_attention_saved, AttentionSaved,
};
pub use config::{AttentionBackend, CudnnFailure, DecodeKernel, KernelConfig, CUDNN_BUILT};
pub use embedding::embedding_backward;
pub use lm_head::{
    logprobs_entropy, logprobs_entropy_backward, logprobs_entropy_saved, logprobs_entropy_saved_with,
    logprobs_entropy_with, LmHeadSaved, IGNORE_TARGET,
};
pub use real::Real;
pub use rmsnorm::{rms_norm, rms_norm_backward};
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
