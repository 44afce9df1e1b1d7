//! `--true-on-policy-mode`'s batch-invariant GEMM: `x . w^T` whose every output element is the
//! same bits whatever the number of rows of `x` and wherever the row sits in it.
//!
//! Decisions:
//! - On CUDA (bf16) one kernel of our own (`vime_bi_gemm` in `cuda/invariant.cu`: fixed 64 x 64
//!   tiles, K summed from 0 up in steps of 16 by the same tensor-core instructions, in a split-K
//!   count that depends on the weight's shape only).
//!   cuBLAS chooses its kernel and split-K by the GEMM's size, so the trainer's GEMM over a whole
//!   packed batch and the engine's GEMM over one decode row sum in different orders.
//! - Elsewhere candle's matmul: the CPU GEMM already computes a row of the product the same way
//!   for any row count (the CPU engine's log-probs equal the trainer's today, tested in
//!   `models/qwen3/tests`), and other CUDA dtypes have no invariant kernel (the mode is bf16's).
//! - No backward: the mode changes forward passes only. The training forward calls this, its
//!   backward keeps cuBLAS (`dX = dY . W`, `dW = dY^T X`), which the gradient needs no bits of.
use crate::config::KernelConfig;
use candle_core::{Result, Tensor};

/// `x . w^T` (`x: [m, k]`, `w: [n, k]` as HF stores a linear layer) in `x`'s dtype; with
/// `kernels.batch_invariant()` on bf16 CUDA tensors by the batch-invariant kernel, else candle's
/// matmul.
pub fn matmul_t(x: &Tensor, w: &Tensor, kernels: &KernelConfig) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if kernels.batch_invariant() && crate::cuda::fused(x.device(), x.dtype()) && w.dtype() == x.dtype() {
        let (n, k) = w.dims2()?;
        return crate::cuda::bi_matmul_t(x, w, false, crate::cuda::bi_splits(n, k));
    }
    let _ = kernels;
    x.matmul(&w.t()?)
}
