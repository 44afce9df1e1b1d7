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
    run_with(model, train, save, mode, &[])
}

fn run_with(model: &Path, train: &Path, save: &Path, mode: bool, extra: &[String]) -> Vec<(f64, f64)> {
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
        // A gradient whatever the rewards (a random model's are mostly 0), so the weights move
        // and each later rollout runs on synced weights.
        "--entropy-coef",
        "0.01",
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
    args.extend(extra.iter().cloned());
    let out = Command::new(env!("CARGO_BIN_EXE_vime-train"))
        .args(&args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "vime-train failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows = read_metrics(&save.join("metrics.jsonl")).unwrap();
    for (step, m) in &rows {
        assert!(
            m["train/grad_norm"] > 0.0,
            "step {step}: no gradient, the weights did not move"
        );
    }
    rows.into_iter()
        .map(|(_, m)| {
            (
                m["train/train_rollout_logprob_abs_diff"],
                m["rollout/log_probs_max_abs_diff"],
            )
        })
        .collect()
}

fn tiny_task(dir: &Path) -> vime_trainer::demo::MadeTask {
    make_task(&MakeTaskArgs {
        task: TaskKind::Arith,
        out: dir.to_path_buf(),
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
    .unwrap()
}

#[test]
fn true_on_policy_mode_gives_a_zero_trainer_rollout_gap_on_every_step() {
    let dir = tempfile::tempdir().unwrap();
    let made = tiny_task(&dir.path().join("task"));
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

/// The same over HTTP: `vime-train --rollout-engine vllm` against vime-serve's engine in the mode
/// (in process, bf16, the weights synced from disk after each step): the engine's log-probs cross
/// JSON and still equal the trainer's bit for bit.
#[test]
fn true_on_policy_mode_over_http_to_vime_serve_gives_a_zero_gap() {
    use std::sync::Arc;
    use vime_rollout::engine::embedded::{EmbeddedEngine, EngineOptions};
    use vime_rollout::serve::{serve, ServeConfig};
    let dir = tempfile::tempdir().unwrap();
    let made = tiny_task(&dir.path().join("task"));
    let save = dir.path().join("run");
    std::fs::create_dir_all(&save).unwrap();
    let mut model =
        vime_qwen3::model::Qwen3::load_hf(&made.model_dir, candle_core::DType::BF16, &candle_core::Device::Cpu)
            .unwrap();
    model.set_kernel_config(vime_kernels::KernelConfig::default().with_batch_invariant(true));
    let opts = EngineOptions::for_config(model.config());
    let engine = Arc::new(EmbeddedEngine::new(model, opts).unwrap());
    let mut cfg = ServeConfig::from_hf_dir(&made.model_dir, None).unwrap();
    cfg.dev_mode = true;
    cfg.allowed_weights_root = Some(save.canonicalize().unwrap());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    rt.spawn(serve(listener, engine, cfg, std::future::pending()));
    let extra: Vec<String> = [
        "--rollout-engine",
        "vllm",
        "--vllm-url",
        &url,
        "--vllm-request-timeout",
        "60",
        "--update-weight-transport",
        "disk",
    ]
    .map(String::from)
    .to_vec();
    let on = run_with(&made.model_dir, &made.files.train, &save, true, &extra);
    println!("over HTTP, --true-on-policy-mode (mean, max) per step: {on:?}");
    assert_eq!(on.len(), 3);
    for (step, &(mean, max)) in on.iter().enumerate() {
        assert_eq!((mean, max), (0.0, 0.0), "step {}: gap {mean:e} (max {max:e})", step + 1);
    }
}
