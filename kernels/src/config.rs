//! The kernel choice of one model (or one rank) as a value: which attention kernel bf16 on CUDA
//! runs, whether its backward must be run-to-run reproducible, and what a cuDNN failure does.
//!
//! Decisions:
//! - No process-global state: every attention call takes a [`KernelConfig`] (the op carries a
//!   clone from its forward to its backward), so two models, or two ranks in one process, can run
//!   different kernels.
//! - The `auto` fallback latch (the first cuDNN failure switches to the flash kernel for good) lives
//!   inside the value, an `Arc<AtomicBool>` shared by the clones of one config. Under several ranks
//!   a silent per-rank fallback would break determinism and parity between ranks, so
//!   [`CudnnFailure::Error`] makes a failure the caller's error instead.
//! - This module imports nothing from the rest of the crate: the ops depend on it, not the reverse.
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// Whether this build has cuDNN's fused attention (the `cudnn` feature).
pub const CUDNN_BUILT: bool = cfg!(feature = "cudnn");

/// Which kernel runs bf16 attention on CUDA (the CPU and every other dtype have one path each).
/// Megatron-LM's `--attention-backend` names: `fused` is cuDNN's fused attention (the `cudnn`
/// build feature), `flash` vime's own FlashAttention-2 kernel (`cuda/flash_attn.cu`), `auto`
/// cuDNN where the build has it and it accepts the shape, else flash.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttentionBackend {
    #[default]
    Auto,
    Fused,
    Flash,
}

impl std::str::FromStr for AttentionBackend {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Self::Auto),
            "fused" | "cudnn" => Ok(Self::Fused),
            "flash" => Ok(Self::Flash),
            other => Err(format!(
                "unknown attention backend {other:?} (expected auto, fused (cuDNN) or flash)"
            )),
        }
    }
}

/// What a cuDNN failure (the library missing, a graph it refuses to build or run) does under
/// [`AttentionBackend::Auto`]. Under `Fused` a failure is always an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CudnnFailure {
    /// World size 1: report it once, then run the flash kernel for the rest of this config's life.
    #[default]
    Fallback,
    /// Several ranks: the failure is an error (a rank must not silently switch kernels).
    Error,
}

/// The CUDA decode-attention kernel (`cuda/decode.cu`), forward only, never in the
/// batch-invariant mode (which runs the training attention instead). All three pass
/// `engine_ops` (`tests/cuda_vs_cpu.rs`, which checks and times each) on the H200.
/// - `TensorCores` (the default): a kv head's query heads are the columns of m16n8k16 MMAs, one
///   warp a block, K and V through a warp-private cp.async ring (`vime_decode_attn_t*`). Measured
///   at 4.01 TB/s of K and V at batch 64 x 4096 keys, 1.35x the register kernel, and faster at
///   every shape timed (`benches/results/2026-12-03-decode-tensor-cores-h200.md`).
/// - `Registers` loads each warp's keys into registers (2.96 TB/s at that shape).
/// - `Pipelined` stages a 128-thread block's keys through shared memory with cp.async, three
///   32-key tiles ahead; 4-15 % slower than `Registers` at every shape timed (583802f).
///
/// `vime-serve --decode-kernel registers|pipelined` selects the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DecodeKernel {
    Registers,
    Pipelined,
    #[default]
    TensorCores,
}

impl DecodeKernel {
    /// Every variant, for checks and timings that cover them all.
    pub const ALL: [DecodeKernel; 3] = [
        DecodeKernel::Registers,
        DecodeKernel::Pipelined,
        DecodeKernel::TensorCores,
    ];
}

impl std::str::FromStr for DecodeKernel {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "registers" => Ok(DecodeKernel::Registers),
            "pipelined" => Ok(DecodeKernel::Pipelined),
            "tensor-cores" => Ok(DecodeKernel::TensorCores),
            other => Err(format!("decode kernel {other:?}: registers, pipelined or tensor-cores")),
        }
    }
}

/// The dtype of the LM head's logits on CUDA (bf16 models), from which its log-probs, entropy and
/// logit gradients come (`--lm-head-logits`).
/// - `Fp32` (the default): the logits GEMM accumulates in f32 and writes f32; no logit is ever
///   rounded to bf16 (more precise than HF's and Megatron's heads).
/// - `Bf16`: the GEMM's f32 sums are rounded to bf16, as HF's `lm_head` and Megatron-Core's
///   output layer give them, then widened for the f32 softmax. Half the logits' bytes: the
///   kept logits take half the memory and the head's passes over them move half the bytes.
///   Not with the batch-invariant kernels (`--true-on-policy-mode` keeps f32 logits, which the
///   built-in engine samples from).
///
/// The CPU kernels follow the same choice for bf16 inputs (the logits rounded to bf16 where the
/// GEMM would round them), so the CUDA kernels are checked against them either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HeadLogits {
    #[default]
    Fp32,
    Bf16,
}

impl std::str::FromStr for HeadLogits {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "fp32" | "f32" => Ok(Self::Fp32),
            "bf16" => Ok(Self::Bf16),
            other => Err(format!("LM head logits {other:?}: fp32 or bf16")),
        }
    }
}

/// The kernel settings one model runs with. `Default`: `auto`, non-deterministic, `fallback`.
/// Clones share the fallback latch.
#[derive(Debug, Clone, Default)]
pub struct KernelConfig {
    attention: AttentionBackend,
    deterministic: bool,
    on_cudnn_failure: CudnnFailure,
    /// `--true-on-policy-mode`: every GEMM and attention of a forward on CUDA runs the
    /// batch-invariant kernels (`cuda/invariant.cu`), so a token's activations do not depend on
    /// what else is in the batch and the built-in engine's decode steps reproduce the trainer's
    /// pass over the whole sequence bit for bit. Backward passes are unchanged.
    batch_invariant: bool,
    /// The decode attention kernel on CUDA ([`DecodeKernel`]).
    decode_kernel: DecodeKernel,
    /// `--fp8-format hybrid --fp8-recipe tensorwise`: the decoder blocks' seven linear layers
    /// run their GEMMs in FP8 (`crate::fp8`): E4M3 weights and activations, E5M2 gradients,
    /// one scale per tensor from its own amax. The LM head, norms and attention stay bf16.
    fp8: bool,
    /// `--fp8-recipe delayed`: the activations and gradients of the FP8 layers take their scales
    /// from amax histories (`crate::fp8::AmaxHistory`) instead of their own amax; the weights
    /// keep current scaling. `None`: current scaling everywhere (tensorwise).
    fp8_delayed: Option<crate::fp8::DelayedScaling>,
    /// Under delayed scaling on CUDA, SwiGLU's output and input gradients are computed by their
    /// FP8 casts and never written in bf16 (the same bits). Off only to time the two-kernel path
    /// against it (`vime-train bench-step --fp8-swiglu-cast separate`).
    fp8_fused_swiglu: bool,
    /// The most bytes of logits (f32, or bf16 under `HeadLogits::Bf16`) the LM head's training
    /// forward on CUDA keeps for its backward (which otherwise runs the logits GEMM again: the
    /// same bits either way). `None`: 1/16 of the device's memory (8.9 GB on an H200: 14.6k
    /// tokens of Qwen3's 151,936-entry f32 vocabulary rows); `Some(0)`: always recompute.
    head_logits_max_bytes: Option<usize>,
    /// The LM head's logits dtype on CUDA ([`HeadLogits`]).
    head_logits: HeadLogits,
    /// Set once cuDNN failed under `auto` + `fallback`: every later call runs the flash kernel.
    cudnn_off: Arc<AtomicBool>,
}

impl KernelConfig {
    /// `Fused` in a build without the `cudnn` feature is an error here rather than at the first
    /// forward. `deterministic` asks for a run-to-run bitwise-reproducible attention backward
    /// where the backend has a choice (cuDNN's deterministic dQ accumulation; the flash kernel's
    /// dQ uses f32 atomics either way, and the CPU kernel is always deterministic).
    pub fn new(
        attention: AttentionBackend,
        deterministic: bool,
        on_cudnn_failure: CudnnFailure,
    ) -> Result<Self, String> {
        if attention == AttentionBackend::Fused && !CUDNN_BUILT {
            return Err(
                "--attention-backend fused needs a build with the cudnn feature (cargo build --features cudnn)"
                    .to_string(),
            );
        }
        Ok(Self {
            attention,
            deterministic,
            on_cudnn_failure,
            batch_invariant: false,
            decode_kernel: DecodeKernel::default(),
            fp8: false,
            fp8_delayed: None,
            fp8_fused_swiglu: true,
            head_logits_max_bytes: None,
            head_logits: HeadLogits::Fp32,
            cudnn_off: Arc::default(),
        })
    }

    /// This config with the LM head keeping at most `bytes` of logits (see the field's docs;
    /// `None`: the default share of device memory).
    pub fn with_head_logits_max_bytes(mut self, bytes: Option<usize>) -> Self {
        self.head_logits_max_bytes = bytes;
        self
    }

    /// The most bytes of logits the LM head keeps on a device of `device_bytes` memory.
    pub fn head_logits_max_bytes(&self, device_bytes: usize) -> usize {
        self.head_logits_max_bytes.unwrap_or(device_bytes / 16)
    }

    /// This config with the LM head's logits in `logits` ([`HeadLogits`]). `Bf16` with the
    /// batch-invariant kernels is an error.
    pub fn with_head_logits(mut self, logits: HeadLogits) -> Result<Self, String> {
        if self.batch_invariant && logits == HeadLogits::Bf16 {
            return Err(
                "--lm-head-logits bf16 does not go with --true-on-policy-mode, whose batch-invariant \
                 LM head keeps f32 logits (the ones the built-in engine samples from)"
                    .to_string(),
            );
        }
        self.head_logits = logits;
        Ok(self)
    }

    pub fn head_logits(&self) -> HeadLogits {
        self.head_logits
    }

    /// This config with the batch-invariant kernels on or off (see the field's docs).
    pub fn with_batch_invariant(mut self, on: bool) -> Self {
        self.batch_invariant = on;
        self
    }

    pub fn batch_invariant(&self) -> bool {
        self.batch_invariant
    }

    /// This config with the blocks' linear layers in FP8 or not (see the field's docs).
    pub fn with_fp8(mut self, on: bool) -> Self {
        self.fp8 = on;
        self
    }

    pub fn fp8(&self) -> bool {
        self.fp8
    }

    /// This config with delayed scaling for the FP8 layers' activations and gradients (`None`:
    /// current scaling); see the field's docs. Only meaningful with [`Self::with_fp8`] on.
    pub fn with_fp8_delayed(mut self, delayed: Option<crate::fp8::DelayedScaling>) -> Self {
        self.fp8_delayed = delayed;
        self
    }

    pub fn fp8_delayed(&self) -> Option<crate::fp8::DelayedScaling> {
        self.fp8_delayed
    }

    /// This config with SwiGLU fused into its FP8 casts or not (see the field's docs).
    pub fn with_fp8_fused_swiglu(mut self, on: bool) -> Self {
        self.fp8_fused_swiglu = on;
        self
    }

    pub fn fp8_fused_swiglu(&self) -> bool {
        self.fp8_fused_swiglu
    }

    /// This config with decode attention run by `kernel` on CUDA.
    pub fn with_decode_kernel(mut self, kernel: DecodeKernel) -> Self {
        self.decode_kernel = kernel;
        self
    }

    pub fn decode_kernel(&self) -> DecodeKernel {
        self.decode_kernel
    }

    pub fn attention(&self) -> AttentionBackend {
        self.attention
    }

    pub fn deterministic(&self) -> bool {
        self.deterministic
    }

    pub fn on_cudnn_failure(&self) -> CudnnFailure {
        self.on_cudnn_failure
    }

    /// The kernel bf16 attention on CUDA runs now: `"cudnn"` or `"flash"` (also after `auto` fell
    /// back from a cuDNN failure).
    pub fn attention_kernel(&self) -> &'static str {
        if CUDNN_BUILT && self.wants_cudnn() {
            "cudnn"
        } else {
            "flash"
        }
    }

    /// Whether the next call should try cuDNN (the backend allows it and no fallback happened).
    pub(crate) fn wants_cudnn(&self) -> bool {
        self.attention != AttentionBackend::Flash && !self.cudnn_off.load(Ordering::Relaxed)
    }

    /// A cuDNN failure: `Ok` (reported once, flash from now on) under `auto` + `fallback`, else
    /// the error.
    #[cfg_attr(not(feature = "cudnn"), allow(dead_code))]
    pub(crate) fn cudnn_failed<E: std::fmt::Display>(&self, e: E) -> Result<(), E> {
        if self.attention == AttentionBackend::Fused || self.on_cudnn_failure == CudnnFailure::Error {
            return Err(e);
        }
        if !self.cudnn_off.swap(true, Ordering::Relaxed) {
            eprintln!("vime: cuDNN attention unavailable, using the flash kernel from now on ({e})");
        }
        Ok(())
    }
}

/// Resident blocks a memory-bound kernel aims for on an H200 (132 SMs x 8): enough bytes in
/// flight to run at bandwidth. The decode attention's and the sampler's split counts come from it.
pub(crate) const GPU_FILL_BLOCKS: usize = 1056;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fallback_latch_is_shared_by_clones_only() {
        let a = KernelConfig::default();
        let b = a.clone();
        let other = KernelConfig::default();
        assert!(a.cudnn_failed("boom").is_ok());
        assert!(!b.wants_cudnn(), "a clone shares the latch");
        assert!(other.wants_cudnn(), "another config does not");
        assert_eq!(b.attention_kernel(), "flash");
        let strict = KernelConfig::new(AttentionBackend::Auto, false, CudnnFailure::Error).unwrap();
        assert_eq!(strict.cudnn_failed("boom"), Err("boom"));
        assert!(strict.wants_cudnn());
    }

    #[test]
    fn fused_needs_the_cudnn_build() {
        let r = KernelConfig::new(AttentionBackend::Fused, false, CudnnFailure::Fallback);
        assert_eq!(r.is_ok(), CUDNN_BUILT);
        let flash = KernelConfig::new(AttentionBackend::Flash, true, CudnnFailure::Error).unwrap();
        assert_eq!(flash.attention_kernel(), "flash");
        assert!(flash.deterministic());
    }
}
