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
        let j = grad_file(&model, &dir.join("expected.safetensors"), &out_path, Recompute::Full).unwrap();
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
