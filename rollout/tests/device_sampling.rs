//! The engine's plain temperature sampling (no top-k / top-p: the path `vime_kernels::sample`
//! draws on the logits' device) on the HF fixture model: a seeded request gets the same tokens
//! alone and anywhere in a batch of other requests (also when it waits in the queue), a different
//! seed gives a different completion, and the log-probs are the trainer's raw log-probs.
use anyhow::Result;
use candle_core::{DType, Device};
use std::path::PathBuf;
use vime_kernels::testing::Rng;
use vime_qwen3::batch::PackedBatch;
use vime_qwen3::model::Qwen3;
use vime_rollout::engine::embedded::{EmbeddedEngine, EngineOptions};
use vime_rollout::engine::{GenRequest, RolloutEngine, SamplingParams};

fn model() -> Result<Qwen3> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf/untied_gqa");
    Qwen3::load_hf(&dir, DType::F32, &Device::Cpu)
}

fn req(n: usize, seed: u64, max_tokens: usize, temperature: f64) -> GenRequest {
    let mut rng = Rng::new(seed ^ 0xABCD);
    GenRequest {
        prompt_ids: (0..n).map(|_| (rng.next_u64() % 160) as u32).collect(),
        params: SamplingParams {
            temperature,
            max_tokens,
            seed: Some(seed),
            ..Default::default()
        },
    }
}

#[test]
fn plain_sampling_is_independent_of_the_batch_and_keeps_the_trainers_logprobs() -> Result<()> {
    let target = req(5, 42, 30, 0.8);
    assert!(target.params.is_plain(160));
    let alone = EmbeddedEngine::new(model()?, EngineOptions::default())?.generate(std::slice::from_ref(&target))?;
    let others: Vec<GenRequest> = (0..6).map(|i| req(2 + 3 * i, 100 + i as u64, 4 + 7 * i, 1.0)).collect();
    for (at, max_num_seqs) in [(0, 256), (3, 256), (6, 256), (4, 2)] {
        let mut reqs = others.clone();
        reqs.insert(at, target.clone());
        let eng = EmbeddedEngine::new(
            model()?,
            EngineOptions {
                max_num_seqs,
                ..Default::default()
            },
        )?;
        let outs = eng.generate(&reqs)?;
        assert_eq!(
            outs[at].token_ids, alone[0].token_ids,
            "target at {at}, max_num_seqs {max_num_seqs}"
        );
    }
    let mut other = target.clone();
    other.params.seed = Some(43);
    let eng = EmbeddedEngine::new(model()?, EngineOptions::default())?;
    assert_ne!(eng.generate(&[other])?[0].token_ids, alone[0].token_ids);
    // The log-probs are the trainer's raw log-probs of the sampled tokens.
    let m = model()?;
    let seq: Vec<u32> = target.prompt_ids.iter().chain(&alone[0].token_ids).copied().collect();
    let lp = m
        .logprobs_entropy(&PackedBatch::from_sequences(&[&seq])?)?
        .logprobs
        .to_vec1::<f32>()?;
    let p = target.prompt_ids.len();
    for (k, &got) in alone[0].logprobs.iter().enumerate() {
        assert!(
            (got - lp[p - 1 + k]).abs() <= 1e-5,
            "token {k}: {got} vs {}",
            lp[p - 1 + k]
        );
    }
    Ok(())
}
