//! The RL loop against an HTTP engine: `vime-train --rollout-engine vllm --vllm-url URL` with
//! vime-serve (the built-in engine behind vLLM's HTTP API) in this process, once per way the
//! weights travel:
//! - `disk`: after every rollout the trainer writes an HF folder and the engine reloads it through
//!   vLLM's `/collective_rpc reload_weights` + `/update_weight_version`;
//! - `cpu`: the weights are streamed in buckets (`vime_sync`, CPU broadcast) through
//!   `/init_weight_transfer_engine` .. `/finish_weight_update`;
//! - `cpu` with `--colocate` and `--update-weights-interval 2`: the engine sleeps while the trainer
//!   trains and the sync wakes it; the second rollout is sampled by the initial weights.
//!
//! Checks: the engine's final weights equal the trainer's last checkpoint bit for bit, every
//! rollout after a sync was sampled by the freshly synced weights (the engine's log-probs equal
//! the trainer's), and the engine saw one weight update per sync.
use candle_core::{DType, Device};
use std::sync::Arc;
use vime_rollout::engine::embedded::EmbeddedEngine;
use vime_rollout::engine::RolloutEngine;
use vime_rollout::serve::{serve, ServeConfig};
use vime_trainer::demo::{make_task, MakeTaskArgs, TaskKind};
use vime_trainer::metrics::read_metrics;
use vime_trainer::train::{run, TrainArgs};

#[test]
fn grpo_through_vime_serve_syncs_weights_every_rollout() {
    grpo_through_vime_serve(&[], None, 3, &[false, false, false]);
}

#[test]
fn grpo_through_vime_serve_streams_weights_over_the_cpu_broadcast() {
    grpo_through_vime_serve(
        &[
            "--update-weight-transport",
            "cpu",
            "--update-weight-buffer-size",
            "8192",
        ],
        Some(vime_sync::RecvKind::Cpu),
        3,
        &[false, false, false],
    );
}

#[test]
fn grpo_colocated_with_a_sync_every_second_rollout() {
    grpo_through_vime_serve(
        &[
            "--update-weight-transport",
            "cpu",
            "--colocate",
            "--update-weights-interval",
            "2",
        ],
        Some(vime_sync::RecvKind::Cpu),
        2,
        &[false, true, false],
    );
}

/// `syncs`: weight updates the engine must have seen; `stale[k]`: rollout k+1 was sampled by
/// weights older than the trainer's (no sync after the step before it).
fn grpo_through_vime_serve(extra: &[&str], transfer: Option<vime_sync::RecvKind>, syncs: u64, stale: &[bool]) {
    let dir = tempfile::tempdir().unwrap();
    let made = make_task(&MakeTaskArgs {
        task: TaskKind::Reverse,
        out: dir.path().join("task"),
        min_len: 2,
        max_len: 4,
        min_digits: 1,
        max_digits: 2,
        ops: "+".into(),
        n_train: 40,
        n_eval: 8,
        seed: 5,
        hidden_size: 64,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        head_dim: 32,
    })
    .unwrap();

    // vime-serve on a free port, on its own runtime thread.
    let engine = Arc::new(EmbeddedEngine::load_hf(&made.model_dir, DType::F32, &Device::Cpu).unwrap());
    let mut cfg = ServeConfig::from_hf_dir(&made.model_dir, None).unwrap();
    cfg.weight_transfer = transfer;
    // The sync's routes are dev endpoints; the trainer writes the reloaded folders under its --save.
    cfg.dev_mode = true;
    cfg.allowed_weights_root = Some(dir.path().canonicalize().unwrap());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let served: Arc<dyn RolloutEngine> = engine.clone();
    let server = rt.spawn(serve(listener, served, cfg, async {
        let _ = stop_rx.await;
    }));

    let save = dir.path().join("run");
    let flags: Vec<String> = [
        "--hf-checkpoint",
        made.model_dir.to_str().unwrap(),
        "--prompt-data",
        made.files.train.to_str().unwrap(),
        "--label-key",
        "label",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "4",
        "--num-rollout",
        "3",
        "--rollout-max-response-len",
        "6",
        "--rm-type",
        "exact_match",
        "--lr",
        "3e-3",
        "--entropy-coef",
        "0.01",
        "--max-tokens-per-gpu",
        "256",
        "--rollout-engine",
        "vllm",
        "--vllm-url",
        &url,
        "--vllm-request-timeout",
        "60",
        "--save",
        save.to_str().unwrap(),
        "--save-interval",
        "3",
        "--no-progress",
    ]
    .iter()
    .chain(extra)
    .map(|s| s.to_string())
    .collect();
    let summary = run(&TrainArgs::from_flags(&flags).unwrap()).unwrap();
    assert_eq!(summary.final_step, 3);

    // One reload per rollout, and the engine now holds the trainer's final weights exactly.
    assert_eq!(engine.weight_version(), syncs);
    let trained = candle_core::safetensors::load(save.join("iter_0000003/hf/model.safetensors"), &Device::Cpu).unwrap();
    let served_weights = engine.with_model(|m| m.state_dict()).unwrap();
    assert_eq!(trained.len(), served_weights.len());
    for (name, t) in &trained {
        let a: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        let b: Vec<f32> = served_weights[name].flatten_all().unwrap().to_vec1().unwrap();
        assert!(a == b, "{name} differs between the trainer's checkpoint and the engine");
    }

    // Rollouts after a sync were sampled by synced weights: the engine's log-probs are the
    // trainer's; a rollout after a skipped sync was not.
    let lines = read_metrics(summary.metrics_file.as_ref().unwrap()).unwrap();
    assert_eq!(lines.len(), 3);
    for ((step, m), stale) in lines.iter().zip(stale) {
        let gap = m["rollout/log_probs_abs_diff"];
        if *stale {
            assert!(
                gap > 1e-4,
                "step {step}: stale weights sampled with a gap of only {gap}"
            );
        } else {
            assert!(gap < 1e-6, "step {step}: {gap}");
        }
        let synced = *step % 2 == 0 || *step == 3 || !extra.contains(&"--update-weights-interval");
        assert_eq!(m.contains_key("perf/sync_time"), synced, "step {step}");
        if synced && transfer.is_some() {
            assert!(m["perf/sync_transfer_time"] > 0.0, "step {step}: {m:?}");
        }
        assert!(m["train/grad_norm"] > 0.0, "step {step}: no gradient");
    }

    let _ = stop_tx.send(());
    rt.block_on(server).unwrap().unwrap();
}
