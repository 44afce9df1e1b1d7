//! `vime-train --true-on-policy-mode` end to end on the CPU: GRPO with the built-in engine on a
//! tiny arithmetic task in bf16, three rollouts with a weight sync after each step. In the mode the
//! trainer's log-probs of every rollout token equal the engine's bit for bit
//! (`train/train_rollout_logprob_abs_diff`, a mean of |difference| over the loss tokens, is exactly
//! 0, and so is the rollout's max |difference|); without it the same run shows a bf16-sized gap, so
//! the check can fail. The GPU run of the same claim at Qwen3-4B shape is
//! `scripts/gpu/true_on_policy.sh` (`benches/results/2026-12-02-true-on-policy-h200.md`).
use std::path::Path;
use std::process::Command;
use vime_trainer::demo::{make_task, MakeTaskArgs, TaskKind};
use vime_trainer::metrics::read_metrics;

fn run(model: &Path, train: &Path, save: &Path, mode: bool) -> Vec<(f64, f64)> {
    let mut args: Vec<String> = [
        "--hf-checkpoint",
        model.to_str().unwrap(),
        "--prompt-data",
        train.to_str().unwrap(),
        "--label-key",
        "label",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "4",
        "--num-rollout",
        "3",
        "--rollout-max-response-len",
        "12",
        "--rm-type",
        "exact_match",
        "--advantage-estimator",
        "grpo",
        "--lr",
        "1e-2",
        "--dtype",
        "bf16",
        "--device",
        "cpu",
        "--save",
        save.to_str().unwrap(),
        "--no-progress",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    if mode {
        args.push("--true-on-policy-mode".into());
    }
    let out = Command::new(env!("CARGO_BIN_EXE_vime-train"))
        .args(&args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "vime-train failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    read_metrics(&save.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .map(|(_, m)| {
            (
                m["train/train_rollout_logprob_abs_diff"],
                m["rollout/log_probs_max_abs_diff"],
            )
        })
        .collect()
}

#[test]
fn true_on_policy_mode_gives_a_zero_trainer_rollout_gap_on_every_step() {
    let dir = tempfile::tempdir().unwrap();
    let made = make_task(&MakeTaskArgs {
        task: TaskKind::Arith,
        out: dir.path().join("task"),
        min_len: 2,
        max_len: 4,
        min_digits: 1,
        max_digits: 2,
        ops: "+".into(),
        n_train: 40,
        n_eval: 4,
        seed: 5,
        hidden_size: 64,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 16,
    })
    .unwrap();
    let on = run(&made.model_dir, &made.files.train, &dir.path().join("on"), true);
    let off = run(&made.model_dir, &made.files.train, &dir.path().join("off"), false);
    println!("--true-on-policy-mode (mean, max) per step: {on:?}; default: {off:?}");
    assert_eq!(on.len(), 3);
    for (step, &(mean, max)) in on.iter().enumerate() {
        assert_eq!((mean, max), (0.0, 0.0), "step {}: gap {mean:e} (max {max:e})", step + 1);
    }
    assert!(
        off.iter().any(|&(mean, _)| mean > 0.0),
        "the default mode's bf16 gap was 0 too, so this run cannot tell the modes apart: {off:?}"
    );
}
