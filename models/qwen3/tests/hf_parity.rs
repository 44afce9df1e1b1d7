//! Golden parity with HF transformers. `tests/fixtures/gen_hf_fixtures.py` (repo root) builds tiny
//! random `Qwen3ForCausalLM` models, runs a packed batch of 3 sequences through HF one sequence at a
//! time, and records logits, next-token log-probs, entropies and the gradient of every parameter of
//! `J = sum_i adv_i * logprob_i + ent_coef * sum_i entropy_i`. This test loads the same checkpoint
//! with vime and checks, in f32:
//!   logits, log-probs, entropy: norm-wise relative error <= 1e-5
//!   every parameter gradient:   <= 1e-4, under both recompute policies,
//!   and the two policies give bit-identical gradients;
//! then saves the model in HF layout (single file and sharded), loads it back and checks the bits.
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::PathBuf;
use vime_kernels::testing::rel_err;
use vime_qwen3::batch::PackedBatch;
use vime_qwen3::model::{Qwen3, Recompute};

const CASES: &[&str] = &["tied_gqa", "untied_gqa", "untied_bias"];

fn case_dir(case: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/hf")
        .join(case)
}

struct Fixture {
    model: Qwen3,
    batch: PackedBatch,
    expected: BTreeMap<String, Tensor>,
}

fn load(case: &str) -> Result<Fixture> {
    let dir = case_dir(case);
    let model = Qwen3::load_hf(&dir, DType::F32, &Device::Cpu)?;
    let expected: BTreeMap<String, Tensor> =
        candle_core::safetensors::load(dir.join("expected.safetensors"), &Device::Cpu)?
            .into_iter()
            .collect();
    let ids: Vec<i64> = expected["input_ids"].to_vec1()?;
    let cu: Vec<i64> = expected["cu_seqlens"].to_vec1()?;
    let seqs: Vec<Vec<u32>> = cu
        .windows(2)
        .map(|w| ids[w[0] as usize..w[1] as usize].iter().map(|&t| t as u32).collect())
        .collect();
    let batch = PackedBatch::from_sequences(&seqs)?;
    let pos: Vec<i64> = expected["position_ids"].to_vec1()?;
    assert_eq!(
        batch.position_ids.iter().map(|&p| p as i64).collect::<Vec<_>>(),
        pos,
        "{case}: position_ids"
    );
    Ok(Fixture { model, batch, expected })
}

fn assert_close(case: &str, what: &str, ours: &Tensor, theirs: &Tensor, tol: f64) -> Result<f64> {
    let e = rel_err(ours, theirs)?;
    assert!(e <= tol, "{case}: {what}: relative error {e:.3e} > {tol:.0e}");
    Ok(e)
}

#[test]
fn logits_logprobs_entropy_match_hf() -> Result<()> {
    for case in CASES {
        let f = load(case)?;
        let logits = f.model.logits(&f.batch)?;
        let e1 = assert_close(case, "logits", &logits, &f.expected["logits"], 1e-5)?;
        let out = f.model.logprobs_entropy(&f.batch)?;
        let e2 = assert_close(case, "logprobs", &out.logprobs, &f.expected["logprobs"], 1e-5)?;
        let e3 = assert_close(case, "entropy", &out.entropy, &f.expected["entropy"], 1e-5)?;
        println!("{case}: rel err logits {e1:.2e}, logprobs {e2:.2e}, entropy {e3:.2e}");
    }
    Ok(())
}

#[test]
fn gradients_match_hf_under_both_recompute_policies() -> Result<()> {
    for case in CASES {
        let f = load(case)?;
        let adv = f.expected["adv"].clone();
        let ent_coef = f.expected["ent_coef"].to_vec1::<f32>()?[0] as f64;
        let objective = f.expected["objective"].to_vec1::<f32>()?[0] as f64;
        let mut per_policy = Vec::new();
        for policy in [Recompute::None, Recompute::Full] {
            let (loss, grads) = f.model.forward_backward(&f.batch, policy, |o| {
                Ok(((&o.logprobs * &adv)?.sum_all()? + (o.entropy.sum_all()? * ent_coef)?)?)
            })?;
            assert!(
                (loss - objective).abs() <= 1e-5 * objective.abs().max(1.0),
                "{case} {policy:?}: objective {loss} vs HF {objective}"
            );
            let mut worst = (0.0f64, String::new());
            let specs = vime_qwen3::state_dict::param_specs(f.model.config());
            assert_eq!(grads.params.len(), specs.len(), "{case}: one gradient per parameter");
            for spec in &specs {
                let ours = &grads.params[&spec.name];
                let theirs = f.expected.get(&format!("grad.{}", spec.name)).unwrap_or_else(|| {
                    panic!("{case}: fixture has no gradient for {}", spec.name);
                });
                let e = assert_close(case, &format!("grad {} ({policy:?})", spec.name), ours, theirs, 1e-4)?;
                if e > worst.0 {
                    worst = (e, spec.name.clone());
                }
            }
            println!(
                "{case} {policy:?}: loss {loss:.6} (HF {objective:.6}), worst grad rel err {:.2e} ({})",
                worst.0, worst.1
            );
            per_policy.push(grads);
        }
        for (name, g_none) in &per_policy[0].params {
            let g_full = &per_policy[1].params[name];
            let a: Vec<f32> = g_none.flatten_all()?.to_vec1()?;
            let b: Vec<f32> = g_full.flatten_all()?.to_vec1()?;
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{case}: gradient of {name} differs between Recompute::None and Recompute::Full"
            );
        }
    }
    Ok(())
}

#[test]
fn hf_save_load_round_trip_is_exact() -> Result<()> {
    for case in CASES {
        let f = load(case)?;
        let before = f.model.state_dict();
        let logits = f.model.logits(&f.batch)?;
        // one file, then shards small enough that every few tensors start a new file
        for max_shard in [u64::MAX, 64 * 1024] {
            let tmp = tempfile::tempdir()?;
            f.model.save_hf(tmp.path(), DType::F32, max_shard)?;
            let sharded = tmp.path().join("model.safetensors.index.json").exists();
            assert_eq!(sharded, max_shard != u64::MAX, "{case}: index.json presence");
            let again = Qwen3::load_hf(tmp.path(), DType::F32, &Device::Cpu)?;
            assert_eq!(again.config(), f.model.config(), "{case}: config round trip");
            let after = again.state_dict();
            assert_eq!(before.keys().collect::<Vec<_>>(), after.keys().collect::<Vec<_>>());
            for (name, t) in &before {
                let a: Vec<f32> = t.flatten_all()?.to_vec1()?;
                let b: Vec<f32> = after[name].flatten_all()?.to_vec1()?;
                assert!(a == b, "{case}: {name} changed in the save/load round trip");
            }
            let l2 = again.logits(&f.batch)?;
            assert_eq!(rel_err(&l2, &logits)?, 0.0, "{case}: logits after round trip");
        }
    }
    Ok(())
}
