//! The RL loop on real data: GSM8K prompts (`tests/assets/math/gsm8k-smoke.jsonl`), the real Qwen3
//! tokenizer and chat template (`tests/assets/qwen3-tokenizer`), the `deepscaler` reward, and a
//! tiny random Qwen3 (hidden 32, 2 layers, the real 151,936-token vocabulary). It proves the full
//! path (template, tokenize, generate, score, train, evaluate, checkpoint, resume), not learning.
//!
//! What a random model gets: `deepscaler` scores 0 unless the response holds `</think>` followed
//! by a `\boxed{}` answer equal to the label, which 16 random tokens out of 151,936 never do. So
//! every GRPO group has equal rewards and zero advantages, and the policy gradient is zero; the
//! GRPO run adds `--entropy-coef 0.01` so that the optimizer really steps. PPO needs no such help:
//! its advantages come from the critic's values and the KL penalty.
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;
use vime_qwen3::checkpoint::copy_tokenizer_files;
use vime_qwen3::config::Qwen3Config;
use vime_qwen3::model::Qwen3;
use vime_rollout::data::{PromptDataset, Tokenizer};
use vime_trainer::metrics::read_metrics;
use vime_trainer::train::{self, TrainArgs};

const MAX_RESPONSE_LEN: f64 = 16.0;

fn assets() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/assets")
}

fn gsm8k() -> String {
    assets().join("math/gsm8k-smoke.jsonl").display().to_string()
}

/// A tiny random Qwen3 with the real vocabulary, saved as an HF folder with the real tokenizer.
fn tiny_qwen3(dir: &Path) -> Result<()> {
    let mut cfg = Qwen3Config::preset("qwen3-0.6b")?;
    cfg.hidden_size = 32;
    cfg.intermediate_size = 64;
    cfg.num_hidden_layers = 2;
    cfg.max_window_layers = 2;
    cfg.num_attention_heads = 2;
    cfg.num_key_value_heads = 1;
    cfg.head_dim = 16;
    cfg.dtype = Some("float32".into());
    let model = Qwen3::init_random(cfg, 0.02, 7, DType::F32, &Device::Cpu)?;
    model.save_hf(dir, DType::F32, u64::MAX)?;
    copy_tokenizer_files(&assets().join("qwen3-tokenizer"), dir)?;
    Ok(())
}

fn flags(model: &Path, extra: &[&str]) -> Vec<String> {
    let mut f: Vec<String> = [
        "--hf-checkpoint",
        &model.display().to_string(),
        "--prompt-data",
        &gsm8k(),
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--apply-chat-template",
        "--apply-chat-template-kwargs",
        r#"{"enable_thinking": false}"#,
        "--rm-type",
        "deepscaler",
        "--n-samples-per-prompt",
        "4",
        "--rollout-batch-size",
        "2",
        "--rollout-max-response-len",
        "16",
        "--max-tokens-per-gpu",
        "4096",
        "--lr",
        "1e-3",
        "--no-progress",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    f.extend(extra.iter().map(|s| s.to_string()));
    f
}

fn metrics_by_step(path: &Path) -> Result<BTreeMap<u64, BTreeMap<String, f64>>> {
    Ok(read_metrics(path)?.into_iter().collect())
}

fn get(m: &BTreeMap<String, f64>, key: &str, step: u64) -> f64 {
    *m.get(key)
        .unwrap_or_else(|| panic!("step {step}: no {key} in {:?}", m.keys().collect::<Vec<_>>()))
}

/// The checks every training line of a run on a random model passes.
fn check_rollout_line(m: &BTreeMap<String, f64>, step: u64) {
    let reward = get(m, "rollout/raw_reward", step);
    assert_eq!(reward, 0.0, "step {step}: a random model scores 0 under deepscaler");
    let len = get(m, "rollout/response_len", step);
    assert!(
        (1.0..=MAX_RESPONSE_LEN).contains(&len),
        "step {step}: rollout/response_len {len} outside [1, 16]"
    );
    let diff = get(m, "rollout/log_probs_abs_diff", step);
    assert!(
        diff.is_finite() && diff < 1e-4,
        "step {step}: engine vs trainer log-probs differ by {diff} on average (same kernels: rounding only)"
    );
    let max_diff = get(m, "rollout/log_probs_max_abs_diff", step);
    assert!(
        max_diff < 1e-4,
        "step {step}: rollout/log_probs_max_abs_diff {max_diff}"
    );
    let gnorm = get(m, "train/grad_norm", step);
    assert!(gnorm.is_finite() && gnorm > 0.0, "step {step}: train/grad_norm {gnorm}");
    for (k, v) in m {
        assert!(v.is_finite(), "step {step}: {k} = {v}");
    }
}

fn assert_serves(hf: &Path) {
    for f in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        assert!(hf.join(f).is_file(), "{} is missing", hf.join(f).display());
    }
    Qwen3::load_hf(hf, DType::F32, &Device::Cpu).expect("the checkpoint loads as an HF Qwen3");
    Tokenizer::from_dir(hf).expect("the checkpoint's tokenizer loads");
}

fn max_abs_diff(a: &Qwen3, b: &Qwen3) -> Result<f32> {
    let (a, b) = (a.state_dict(), b.state_dict());
    let mut worst = 0f32;
    for (name, t) in &a {
        let d: Tensor = (t - &b[name])?.abs()?.flatten_all()?.max(0)?;
        worst = worst.max(d.to_scalar::<f32>()?);
    }
    Ok(worst)
}

#[test]
fn grpo_on_gsm8k_with_the_real_tokenizer_and_chat_template() -> Result<()> {
    let t0 = Instant::now();
    let tmp = tempfile::tempdir()?;
    let model = tmp.path().join("model");
    tiny_qwen3(&model)?;
    let save = tmp.path().join("run");
    let save_s = save.display().to_string();
    let args = TrainArgs::from_flags(flags(
        &model,
        &[
            "--num-rollout",
            "2",
            "--entropy-coef",
            "0.01",
            // Eight rows the two rollouts (rows 1-4) never see, through slime's row-slice syntax.
            "--eval-prompt-data",
            "gsm8k",
            &format!("{}@[16:24]", gsm8k()),
            "--eval-interval",
            "2",
            "--save",
            &save_s,
            "--save-interval",
            "2",
        ],
    ))?;

    // The prompts the engine is given: the data API on the run's own flags and tokenizer.
    let tokenizer = Tokenizer::from_dir(&model)?;
    let data = PromptDataset::from_args(&args.data, &tokenizer)?;
    assert_eq!(data.len(), 32);
    let first = &data.samples()[0];
    assert!(
        first
            .prompt
            .starts_with("<|im_start|>user\nJanet’s ducks lay 16 eggs per day."),
        "not chat-templated: {:?}",
        first.prompt
    );
    assert!(
        first
            .prompt
            .ends_with("<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        "enable_thinking=false should close an empty think block: {:?}",
        first.prompt
    );
    assert_eq!(first.label_text().as_deref(), Some("18"));
    assert_eq!(first.prompt_ids[0], 151644, "the first token is <|im_start|>");
    assert_eq!(tokenizer.decode(&first.prompt_ids, false)?, first.prompt);

    let summary = train::run(&args)?;
    assert_eq!(summary.final_step, 2);
    assert_eq!(summary.rollouts_run, 2);
    assert!(!summary.interrupted);

    // Metrics: the eval before training, then one line per rollout; the eval is due again at 2.
    let metrics_file = summary.metrics_file.clone().expect("--save sets the log dir");
    assert_eq!(metrics_file, save.join("metrics.jsonl"));
    let lines = metrics_by_step(&metrics_file)?;
    assert_eq!(lines.keys().copied().collect::<Vec<_>>(), vec![0, 1, 2]);
    let eval0 = &lines[&0];
    assert!(!eval0.contains_key("rollout/raw_reward"), "line 0 is the eval only");
    for step in [0, 2] {
        let m = &lines[&step];
        assert_eq!(get(m, "eval/gsm8k/reward", step), 0.0);
        assert_eq!(get(m, "eval/gsm8k/pass@1", step), 0.0);
        let len = get(m, "eval/gsm8k/response_len", step);
        assert!(
            (1.0..=MAX_RESPONSE_LEN).contains(&len),
            "step {step}: eval length {len}"
        );
    }
    assert!(!lines[&1].contains_key("eval/gsm8k/reward"), "no eval due at step 1");
    for step in [1, 2] {
        check_rollout_line(&lines[&step], step);
        // Every group scored all zeros: no GRPO signal; the gradient is the entropy bonus's.
        assert_eq!(get(&lines[&step], "rollout/zero_std_groups", step), 1.0);
        assert_eq!(get(&lines[&step], "rollout/advantages", step), 0.0);
        assert_eq!(
            get(&lines[&step], "train/steps", step),
            1.0,
            "one optimizer step per rollout"
        );
    }
    assert_eq!(summary.first_eval.get("eval/gsm8k/pass@1"), Some(&0.0));
    assert!(summary.last_eval.contains_key("eval/gsm8k/reward"));
    assert!(summary.plot_file.as_ref().is_some_and(|p| p.is_file()), "curves.png");
    assert!(save.join("tensorboard").is_dir());

    // The checkpoint: an HF folder that serves as it is, with weights the optimizer moved.
    let ckpt = save.join("iter_0000002");
    assert_eq!(summary.last_checkpoint.as_deref(), Some(ckpt.as_path()));
    assert_eq!(
        std::fs::read_to_string(save.join("latest_checkpointed_iteration.txt"))?.trim(),
        "2"
    );
    assert!(!save.join("iter_0000001").exists(), "--save-interval 2");
    assert!(ckpt.join("optimizer.safetensors").is_file());
    assert_serves(&ckpt.join("hf"));
    let before = Qwen3::load_hf(&model, DType::F32, &Device::Cpu)?;
    let after = Qwen3::load_hf(&ckpt.join("hf"), DType::F32, &Device::Cpu)?;
    let moved = max_abs_diff(&before, &after)?;
    assert!(moved > 0.0, "two optimizer steps left the weights unchanged");
    eprintln!("grpo gsm8k smoke: {:.1}s", t0.elapsed().as_secs_f64());
    Ok(())
}

#[test]
fn ppo_on_gsm8k_saves_the_critic_and_resumes() -> Result<()> {
    let t0 = Instant::now();
    let tmp = tempfile::tempdir()?;
    let model = tmp.path().join("model");
    tiny_qwen3(&model)?;
    let save = tmp.path().join("run");
    let save_s = save.display().to_string();
    let ppo = |num_rollout: &str, load: bool| -> Vec<String> {
        let mut extra = vec![
            "--advantage-estimator",
            "ppo",
            "--kl-coef",
            "0.01",
            "--num-steps-per-rollout",
            "2",
            "--num-rollout",
            num_rollout,
            "--save",
            &save_s,
            "--save-interval",
            "1",
        ];
        if load {
            extra.extend(["--load", &save_s]);
        }
        flags(&model, &extra)
    };

    let args = TrainArgs::from_flags(ppo("1", false))?;
    assert_eq!(args.global_batch_size_resolved(), 4);
    let first = train::run(&args)?;
    assert_eq!((first.final_step, first.rollouts_run), (1, 1));
    let ckpt = save.join("iter_0000001");
    assert_eq!(first.last_checkpoint.as_deref(), Some(ckpt.as_path()));
    assert_serves(&ckpt.join("hf"));
    assert!(ckpt.join("critic").is_dir(), "a PPO checkpoint holds the critic");
    assert!(ckpt.join("critic/config.json").is_file());
    assert!(ckpt.join("critic_optimizer.safetensors").is_file());

    let lines = metrics_by_step(&save.join("metrics.jsonl"))?;
    assert_eq!(lines.keys().copied().collect::<Vec<_>>(), vec![1]);
    let m = &lines[&1];
    check_rollout_line(m, 1);
    assert_eq!(get(m, "train/steps", 1), 2.0, "--num-steps-per-rollout 2");
    assert_eq!(get(m, "critic/steps", 1), 2.0);
    let vloss = get(m, "critic/value_loss", 1);
    assert!(vloss.is_finite() && vloss > 0.0, "critic/value_loss {vloss}");
    let cgnorm = get(m, "critic/grad_norm", 1);
    assert!(cgnorm.is_finite() && cgnorm > 0.0, "critic/grad_norm {cgnorm}");
    // Before the first update the policy is the reference: the same weights and kernels.
    assert_eq!(get(m, "rollout/kl", 1), 0.0);

    // Resume for one more rollout.
    let resumed = train::run(&TrainArgs::from_flags(ppo("2", true))?)?;
    assert_eq!((resumed.final_step, resumed.rollouts_run), (2, 1));
    let ckpt2 = save.join("iter_0000002");
    assert_eq!(resumed.last_checkpoint.as_deref(), Some(ckpt2.as_path()));
    assert!(ckpt2.join("critic").is_dir() && ckpt2.join("critic_optimizer.safetensors").is_file());
    let state: serde_json::Value = serde_json::from_slice(&std::fs::read(ckpt2.join("state.json"))?)?;
    assert_eq!(state["step"], 2);
    assert_eq!(state["optimizer_step"], 4, "2 optimizer steps per rollout, continued");
    assert_eq!(state["extra"]["critic_optimizer_step"], 4);
    assert_eq!(state["data"]["offset"], 4, "2 prompts per rollout, continued");
    let lines = metrics_by_step(&save.join("metrics.jsonl"))?;
    assert_eq!(lines.keys().copied().collect::<Vec<_>>(), vec![1, 2]);
    check_rollout_line(&lines[&2], 2);
    let vloss = get(&lines[&2], "critic/value_loss", 2);
    assert!(vloss.is_finite(), "critic/value_loss {vloss}");
    eprintln!("ppo gsm8k smoke + resume: {:.1}s", t0.elapsed().as_secs_f64());
    Ok(())
}
