//! `vime-train grad` (the Rust half of `scripts/gpu/hf_parity.sh`) on CPU against the committed
//! HF fixtures, whose `expected.safetensors` is in the batch format it reads: the log-probs,
//! entropies, objective and every parameter gradient match HF transformers (f32).
use candle_core::{DType, Device, Tensor};
use std::path::PathBuf;
use vime_qwen3::model::{Qwen3, Recompute};
use vime_trainer::gradcheck::grad_file;

fn rel(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let d = (&a - &b)
        .unwrap()
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    let n = b.sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
    (d / n).sqrt()
}

#[test]
fn grad_subcommand_matches_hf_on_the_fixtures() {
    for case in ["tied_gqa", "untied_gqa", "untied_bias"] {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../tests/fixtures/hf")
            .join(case);
        let expected = candle_core::safetensors::load(dir.join("expected.safetensors"), &Device::Cpu).unwrap();
        let model = Qwen3::load_hf(&dir, DType::F32, &Device::Cpu).unwrap();
        let tmp = tempfile::tempdir().unwrap();
        let out_path = tmp.path().join("out.safetensors");
        let j = grad_file(&model, &dir.join("expected.safetensors"), &out_path, Recompute::Full, 0).unwrap();
        let out = candle_core::safetensors::load(&out_path, &Device::Cpu).unwrap();
        let j_ref = expected["objective"]
            .to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f64>()
            .unwrap()[0];
        assert!(
            (j - j_ref).abs() <= 1e-5 * j_ref.abs(),
            "{case}: objective {j} vs {j_ref}"
        );
        assert!(rel(&out["logprobs"], &expected["logprobs"]) < 1e-5, "{case}: logprobs");
        assert!(rel(&out["entropy"], &expected["entropy"]) < 1e-5, "{case}: entropy");
        let mut n = 0;
        for (name, g) in &expected {
            if let Some(param) = name.strip_prefix("grad.") {
                let ours = out
                    .get(&format!("grad.{param}"))
                    .unwrap_or_else(|| panic!("{case}: no grad.{param}"));
                let e = rel(ours, g);
                assert!(e < 1e-4, "{case}: grad.{param} rel err {e:e}");
                n += 1;
            }
        }
        assert_eq!(
            n,
            out.keys().filter(|k| k.starts_with("grad.")).count(),
            "{case}: gradient count"
        );
    }
}

/// `--fp8-amax-warmup`: with no warm-up pass, delayed scaling seeds its histories from the measured
/// pass itself and gives tensorwise scaling's bits; with warm-up passes (other token sequences)
/// the measured pass is scaled by their amaxes: other bits, still within FP8's error of the bf16
/// pass. Without delayed scaling the flag is refused.
#[test]
fn amax_warmup_scales_the_measured_pass_by_other_tensors_amaxes() {
    use vime_kernels::fp8::DelayedScaling;
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf/untied_gqa");
    let batch = dir.join("expected.safetensors");
    let tmp = tempfile::tempdir().unwrap();
    // fp8: None (bf16), Some(None) tensorwise, Some(Some(d)) delayed.
    let run = |fp8: Option<Option<DelayedScaling>>, warmup: usize, name: &str| {
        let mut model = Qwen3::load_hf(&dir, DType::BF16, &Device::Cpu).unwrap();
        let k = model
            .kernel_config()
            .clone()
            .with_fp8(fp8.is_some())
            .with_fp8_delayed(fp8.flatten());
        model.set_kernel_config(k);
        let out = tmp.path().join(name);
        grad_file(&model, &batch, &out, Recompute::None, warmup)
            .map(|_| candle_core::safetensors::load(&out, &Device::Cpu).unwrap())
    };
    let delayed = DelayedScaling {
        history_len: 2,
        use_max: true,
        margin: 0,
    };
    let bf16 = run(None, 0, "bf16.safetensors").unwrap();
    let tensorwise = run(Some(None), 0, "tw.safetensors").unwrap();
    let seeded = run(Some(Some(delayed)), 0, "d0.safetensors").unwrap();
    let warmed = run(Some(Some(delayed)), 2, "d2.safetensors").unwrap();
    let bits = |t: &Tensor| vime_kernels::testing::f32_values(t).unwrap();
    let (mut differs, mut worst_tw, mut worst_warm) = (false, 0f64, 0f64);
    for (name, t) in &tensorwise {
        assert_eq!(
            bits(t),
            bits(&seeded[name]),
            "{name}: delayed with no warm-up has tensorwise's bits"
        );
        differs |= bits(t) != bits(&warmed[name]);
        if name.starts_with("grad.") {
            worst_tw = worst_tw.max(rel(t, &bf16[name]));
            worst_warm = worst_warm.max(rel(&warmed[name], &bf16[name]));
        }
    }
    assert!(differs, "the warm-up passes changed no bit of the measured pass");
    // The measured pass's gradients stay within FP8's error of bf16's.
    assert!(
        worst_warm.is_finite() && worst_warm < 3.0 * worst_tw.max(1e-3),
        "delayed after warm-up: worst gradient rel err {worst_warm:e} against bf16 (tensorwise {worst_tw:e})"
    );
    assert!(rel(&warmed["logprobs"], &bf16["logprobs"]) < 0.05, "log-probs");
    let err = run(Some(None), 1, "bad.safetensors").unwrap_err();
    assert!(
        format!("{err:#}").contains("--fp8-amax-warmup 1") && format!("{err:#}").contains("--fp8-recipe delayed"),
        "{err:#}"
    );
}
