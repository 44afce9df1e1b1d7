//! Device and dtype selection from command-line strings, with errors that say what is accepted.
use anyhow::{bail, Result};
use candle_core::{DType, Device};

/// `cpu`, `cuda` or `cuda:N`. CUDA needs a build with `--features cuda`.
pub fn parse_device(s: &str) -> Result<Device> {
    match s {
        "cpu" => Ok(Device::Cpu),
        _ if s == "cuda" || s.starts_with("cuda:") => {
            let ordinal = match s.strip_prefix("cuda:") {
                Some(n) => n
                    .parse::<usize>()
                    .map_err(|_| anyhow::anyhow!("bad device {s:?}: expected cuda:N"))?,
                None => 0,
            };
            if !candle_core::utils::cuda_is_available() {
                bail!(
                    "device {s:?} asked for, but this vime-train was built without CUDA (rebuild with --features cuda)"
                );
            }
            let device = Device::new_cuda(ordinal)?;
            vime_kernels::prepare_device(&device)?;
            Ok(device)
        }
        other => bail!("unknown device {other:?} (expected cpu, cuda or cuda:N)"),
    }
}

/// `f32`, `bf16` (or `bfloat16`), `f16` (or `float16`).
pub fn parse_dtype(s: &str) -> Result<DType> {
    match s {
        "f32" | "float32" | "fp32" => Ok(DType::F32),
        "bf16" | "bfloat16" => Ok(DType::BF16),
        "f16" | "float16" | "fp16" => Ok(DType::F16),
        other => bail!("unknown dtype {other:?} (expected f32, bf16 or f16)"),
    }
}

/// Megatron's FP8 flags. vime runs the decoder blocks' seven linear layers in FP8 with
/// `--fp8-format hybrid` (`vime_kernels::fp8`): E4M3 weights and activations, E5M2 gradients, on
/// bf16 models, one scale per tensor. `--fp8-recipe tensorwise` (vime's default) scales each
/// tensor by its own amax; `--fp8-recipe delayed` (Megatron's default) scales activations and
/// gradients by amax histories (`--fp8-amax-history-len`, `--fp8-amax-compute-algo`,
/// `--fp8-margin`), saved in checkpoints. The LM head, embeddings, norms and attention stay bf16;
/// master weights and moments stay f32.
#[derive(clap::Args, Debug, Clone)]
pub struct Fp8Args {
    /// Megatron's flag: hybrid (E4M3 forward, E5M2 gradients) turns FP8 on; e4m3 (E4M3 for the
    /// gradients too) is refused.
    #[arg(long)]
    pub fp8_format: Option<String>,
    /// Megatron's flag: tensorwise (current scaling: each tensor's scale from its own amax, a
    /// pass over it before the cast) or delayed (activations and gradients scaled by the amaxes
    /// of the same tensor in earlier micro-batches: no amax pass; weights stay tensorwise).
    /// Megatron's default is delayed; vime's is tensorwise.
    #[arg(long, default_value = "tensorwise")]
    pub fp8_recipe: String,
    /// Megatron's flag (--fp8-recipe delayed): amaxes kept per tensor role.
    #[arg(long, default_value_t = 1)]
    pub fp8_amax_history_len: usize,
    /// Megatron's flag (--fp8-recipe delayed): most_recent or max, the amax of the history a
    /// scale comes from.
    #[arg(long, default_value = "most_recent")]
    pub fp8_amax_compute_algo: String,
    /// Megatron's flag (--fp8-recipe delayed): scale = fp8 max / amax / 2^margin.
    #[arg(long, default_value_t = 0)]
    pub fp8_margin: i32,
}

impl Default for Fp8Args {
    fn default() -> Self {
        Self {
            fp8_format: None,
            fp8_recipe: "tensorwise".into(),
            fp8_amax_history_len: 1,
            fp8_amax_compute_algo: "most_recent".into(),
            fp8_margin: 0,
        }
    }
}

impl Fp8Args {
    /// Whether the flags turn FP8 on; an error for a format or recipe vime does not have.
    pub fn enabled(&self) -> Result<bool> {
        Ok(self.recipe()?.is_some())
    }

    /// Delayed scaling's settings, when `--fp8-recipe delayed` asks for it.
    pub fn delayed(&self) -> Result<Option<vime_kernels::fp8::DelayedScaling>> {
        Ok(self.recipe()?.flatten())
    }

    /// `kernels` with FP8 as the flags say.
    pub fn apply(&self, kernels: vime_kernels::KernelConfig) -> Result<vime_kernels::KernelConfig> {
        let recipe = self.recipe()?;
        Ok(kernels.with_fp8(recipe.is_some()).with_fp8_delayed(recipe.flatten()))
    }

    /// `None`: FP8 off; `Some(None)`: tensorwise; `Some(Some(d))`: delayed. Delayed-only flags
    /// with another recipe are an error, as are values out of range.
    fn recipe(&self) -> Result<Option<Option<vime_kernels::fp8::DelayedScaling>>> {
        let use_max = match self.fp8_amax_compute_algo.as_str() {
            "most_recent" => false,
            "max" => true,
            a => bail!("--fp8-amax-compute-algo {a:?}: expected most_recent or max"),
        };
        let d = vime_kernels::fp8::DelayedScaling {
            history_len: self.fp8_amax_history_len,
            use_max,
            margin: self.fp8_margin,
        };
        let delayed_only = d != vime_kernels::fp8::DelayedScaling::default();
        let recipe = match self.fp8_format.as_deref() {
            None => None,
            Some("hybrid") => match self.fp8_recipe.as_str() {
                "tensorwise" => Some(None),
                "delayed" => {
                    d.check().map_err(anyhow::Error::msg)?;
                    Some(Some(d))
                }
                r => bail!(
                    "--fp8-recipe {r:?}: vime has tensorwise (one scale per tensor from its current amax) and \
                     delayed (scales from amax histories); mxfp8 and blockwise are not implemented"
                ),
            },
            Some("e4m3") => bail!(
                "--fp8-format e4m3: not implemented; pass --fp8-format hybrid (E4M3 weights and activations, E5M2 \
                 gradients)"
            ),
            Some(f) => bail!("--fp8-format {f:?}: expected hybrid (or e4m3, which vime does not have)"),
        };
        if delayed_only && !matches!(recipe, Some(Some(_))) {
            bail!(
                "--fp8-amax-history-len, --fp8-amax-compute-algo and --fp8-margin set delayed scaling; pass them \
                 with --fp8-format hybrid --fp8-recipe delayed (Megatron's default recipe; vime's is tensorwise)"
            );
        }
        Ok(recipe)
    }
}

/// The LM head's logits dtype on CUDA (bf16 models).
#[derive(clap::Args, Debug, Clone)]
pub struct HeadArgs {
    /// The dtype of the LM head's logits on CUDA: fp32 (the GEMM writes its f32 sums; no logit
    /// is rounded) or bf16 (rounded to bf16 as HF's lm_head and Megatron-Core's output layer give
    /// them, then a f32 softmax: half the logits' bytes and memory; under --tp > 1 each rank's
    /// vocabulary shard alike). bf16 is refused with --true-on-policy-mode (the engine samples
    /// from f32 logits).
    #[arg(long, default_value = "fp32")]
    pub lm_head_logits: String,
}

impl Default for HeadArgs {
    fn default() -> Self {
        Self {
            lm_head_logits: "fp32".into(),
        }
    }
}

impl HeadArgs {
    /// `kernels` with the head's logits as the flag says (an error for a bad value or a pairing
    /// the kernels refuse).
    pub fn apply(&self, kernels: vime_kernels::KernelConfig) -> Result<vime_kernels::KernelConfig> {
        let logits: vime_kernels::HeadLogits = self
            .lm_head_logits
            .parse()
            .map_err(|e: String| anyhow::anyhow!("--lm-head-logits: {e}"))?;
        kernels.with_head_logits(logits).map_err(|e| anyhow::anyhow!(e))
    }
}

/// The kernel config of `--attention-backend` and `--deterministic-mode` for the model(s) of this
/// process, with what a cuDNN failure does: `Fallback` (one process: report it, then the flash
/// kernel) or `Error` (several ranks: no rank may switch kernels alone).
pub fn apply_kernel_flags(
    attention_backend: &str,
    deterministic: bool,
    on_cudnn_failure: vime_kernels::CudnnFailure,
) -> Result<vime_kernels::KernelConfig> {
    let b: vime_kernels::AttentionBackend = attention_backend
        .parse()
        .map_err(|e: String| anyhow::anyhow!("--attention-backend: {e}"))?;
    let cfg = vime_kernels::KernelConfig::new(b, deterministic, on_cudnn_failure).map_err(anyhow::Error::msg)?;
    if b == vime_kernels::AttentionBackend::Flash && vime_kernels::CUDNN_BUILT {
        // slime's Megatron scripts pass `--attention-backend flash`; say what it means here.
        eprintln!(
            "vime: --attention-backend flash runs vime's own FlashAttention-2 kernel; auto (the default) runs \
             cuDNN's fused attention, 1.17x faster per Qwen3-4B training step on an H200 (benches/PERF_NOTES.md)"
        );
    }
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    const F: vime_kernels::CudnnFailure = vime_kernels::CudnnFailure::Fallback;

    #[test]
    fn fp8_flags_turn_fp8_on_or_say_what_vime_has() {
        let f = |format: Option<&str>, recipe: &str| Fp8Args {
            fp8_format: format.map(String::from),
            fp8_recipe: recipe.into(),
            ..Default::default()
        };
        assert!(!f(None, "tensorwise").enabled().unwrap());
        assert!(f(Some("hybrid"), "tensorwise").enabled().unwrap());
        assert_eq!(f(Some("hybrid"), "tensorwise").delayed().unwrap(), None);
        let d = f(Some("hybrid"), "delayed");
        assert!(d.enabled().unwrap());
        assert_eq!(d.delayed().unwrap(), Some(vime_kernels::fp8::DelayedScaling::default()));
        let k = d.apply(vime_kernels::KernelConfig::default()).unwrap();
        assert!(k.fp8() && k.fp8_delayed().is_some());
        let max3 = Fp8Args {
            fp8_amax_history_len: 3,
            fp8_amax_compute_algo: "max".into(),
            fp8_margin: 2,
            ..f(Some("hybrid"), "delayed")
        };
        assert_eq!(
            max3.delayed().unwrap(),
            Some(vime_kernels::fp8::DelayedScaling {
                history_len: 3,
                use_max: true,
                margin: 2
            })
        );
        for (args, says) in [
            (
                Fp8Args {
                    fp8_amax_history_len: 0,
                    ..f(Some("hybrid"), "delayed")
                },
                "--fp8-amax-history-len 0",
            ),
            (
                Fp8Args {
                    fp8_amax_compute_algo: "mean".into(),
                    ..f(Some("hybrid"), "delayed")
                },
                "--fp8-amax-compute-algo \"mean\"",
            ),
            (
                Fp8Args {
                    fp8_margin: -1,
                    ..f(Some("hybrid"), "delayed")
                },
                "--fp8-margin -1",
            ),
            (
                Fp8Args {
                    fp8_amax_history_len: 16,
                    ..f(Some("hybrid"), "tensorwise")
                },
                "with --fp8-format hybrid --fp8-recipe delayed",
            ),
            (
                Fp8Args {
                    fp8_margin: 1,
                    ..f(None, "tensorwise")
                },
                "with --fp8-format hybrid --fp8-recipe delayed",
            ),
        ] {
            let e = args.enabled().unwrap_err().to_string();
            assert!(e.contains(says), "{args:?}: {e}");
        }
        for (format, recipe, says) in [
            ("hybrid", "mxfp8", "--fp8-recipe \"mxfp8\""),
            (
                "e4m3",
                "tensorwise",
                "--fp8-format e4m3: not implemented; pass --fp8-format hybrid",
            ),
            ("fp4", "tensorwise", "--fp8-format \"fp4\": expected hybrid"),
        ] {
            let e = f(Some(format), recipe).enabled().unwrap_err().to_string();
            assert!(e.contains(says), "{format} {recipe}: {e}");
        }
    }

    #[test]
    fn lm_head_logits_flag_sets_the_head_or_says_why_not() {
        let f = |v: &str| HeadArgs {
            lm_head_logits: v.into(),
        };
        let k = vime_kernels::KernelConfig::default();
        assert_eq!(
            f("fp32").apply(k.clone()).unwrap().head_logits(),
            vime_kernels::HeadLogits::Fp32
        );
        assert_eq!(
            f("bf16").apply(k.clone()).unwrap().head_logits(),
            vime_kernels::HeadLogits::Bf16
        );
        let e = f("fp16").apply(k.clone()).unwrap_err().to_string();
        assert!(
            e.contains("--lm-head-logits") && e.contains("fp16") && e.contains("fp32 or bf16"),
            "{e}"
        );
        let e = f("bf16").apply(k.with_batch_invariant(true)).unwrap_err().to_string();
        assert!(e.contains("--true-on-policy-mode"), "{e}");
    }

    #[test]
    fn kernel_flags_are_checked() {
        let e = apply_kernel_flags("unfused", false, F).unwrap_err().to_string();
        assert!(e.contains("--attention-backend") && e.contains("unfused"), "{e}");
        let auto = apply_kernel_flags("auto", true, F).unwrap();
        assert_eq!(auto.attention(), vime_kernels::AttentionBackend::Auto);
        assert!(auto.deterministic());
        let fused = apply_kernel_flags("fused", false, F);
        assert_eq!(fused.is_ok(), vime_kernels::CUDNN_BUILT, "{fused:?}");
    }
}
