//! Rollout tokens/s of the built-in engine on CPU: generated tokens / wall time of one
//! `EmbeddedEngine::generate` call (batch of 16 prompts of 32 tokens, up to 128 new tokens each,
//! sampled at temperature 1), after a warm-up call, for the `tied_gqa` HF fixture and a random
//! mid-sized config. A measurement, not a test: nothing is asserted.
//!
//!   cargo bench --bench rollout_tokens_per_second
//!   cargo bench --bench rollout_tokens_per_second -- --batch 32 --max-tokens 64
use anyhow::Result;
use candle_core::{DType, Device};
use std::path::PathBuf;
use std::time::Instant;
use vime_kernels::testing::Rng;
use vime_qwen3::config::Qwen3Config;
use vime_qwen3::model::Qwen3;
use vime_rollout::engine::embedded::{EmbeddedEngine, EngineOptions};
use vime_rollout::engine::{GenRequest, RolloutEngine, SamplingParams};

/// `--name N` from the command line, else `default`.
fn num(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .map(|v| v.parse().unwrap_or_else(|_| panic!("{name} takes a number, got {v}")))
        .unwrap_or(default)
}

fn main() -> Result<()> {
    let batch = num("--batch", 16);
    let prompt_len = num("--prompt-len", 32);
    let max_tokens = num("--max-tokens", 128);
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/tied_gqa");
    let random_cfg = Qwen3Config::from_json_str(
        r#"{"model_type": "qwen3", "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 768,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 4096,
        "tie_word_embeddings": true, "attention_bias": false, "torch_dtype": "float32", "hidden_act": "silu"}"#,
    )?;
    let runs: Vec<(&str, Qwen3)> = vec![
        (
            "tied_gqa fixture (h64, 2 layers, vocab 160)",
            Qwen3::load_hf(&fixture, DType::F32, &Device::Cpu)?,
        ),
        (
            "random (h256, 4 layers, vocab 2048)",
            Qwen3::init_random(random_cfg, 0.02, 0, DType::F32, &Device::Cpu)?,
        ),
    ];
    println!("| model | batch | prompt | new tokens | seconds | tokens/s |");
    println!("|---|---|---|---|---|---|");
    for (name, model) in runs {
        let vocab = model.config().vocab_size as u64;
        let eng = EmbeddedEngine::new(model, EngineOptions::default())?;
        let reqs: Vec<GenRequest> = (0..batch as u64)
            .map(|i| {
                let mut rng = Rng::new(i);
                GenRequest {
                    prompt_ids: (0..prompt_len).map(|_| (rng.next_u64() % vocab) as u32).collect(),
                    params: SamplingParams {
                        temperature: 1.0,
                        max_tokens,
                        seed: Some(i),
                        ..Default::default()
                    },
                }
            })
            .collect();
        eng.generate(&reqs[..2.min(batch)])?; // warm-up
        let t0 = Instant::now();
        let outs = eng.generate(&reqs)?;
        let secs = t0.elapsed().as_secs_f64();
        let tokens: usize = outs.iter().map(|o| o.token_ids.len()).sum();
        println!(
            "| {name} | {batch} | {prompt_len} | {tokens} | {secs:.3} | {:.0} |",
            tokens as f64 / secs
        );
    }
    Ok(())
}
