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
//! - The fused ops have CPU kernels only for now. On any other device each public op dispatches to
//!   [`composed`], the same op built from candle tensor ops with autograd backward (until the fused
//!   CUDA kernels land, issue 6); [`composed`] is also the reference the fused kernels are tested
//!   against.
pub mod attention;
pub mod composed;
pub mod lm_head;
pub mod real;
pub mod rmsnorm;
pub mod rope;
pub mod swiglu;
pub mod testing;

pub use attention::varlen_attention;
pub use lm_head::{logprobs_entropy, IGNORE_TARGET};
pub use real::Real;
pub use rmsnorm::rms_norm;
pub use rope::rope;
pub use swiglu::swiglu;
