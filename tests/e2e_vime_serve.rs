//! The RL loop against an HTTP engine: `vime-train --rollout-engine vllm --vllm-url URL` with
//! vime-serve (the built-in engine behind vLLM 0.33's HTTP API) in this process. After every
//! rollout the trainer writes its weights to an HF folder and the engine reloads them through
//! vLLM's `/collective_rpc reload_weights` + `/update_weight_version`, as a vLLM engine would.
//! Checks: the engine's final weights equal the trainer's last checkpoint bit for bit, every
//! rollout was sampled by the freshly synced weights (the engine's log-probs equal the trainer's),
//! and the engine saw one weight update per rollout.
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
    let cfg = ServeConfig::from_hf_dir(&made.model_dir, None).unwrap();
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
    .map(|s| s.to_string())
    .collect();
    let summary = run(&TrainArgs::from_flags(&flags).unwrap()).unwrap();
    assert_eq!(summary.final_step, 3);

    // One reload per rollout, and the engine now holds the trainer's final weights exactly.
    assert_eq!(engine.weight_version(), 3);
    let trained = candle_core::safetensors::load(save.join("iter_0000003/hf/model.safetensors"), &Device::Cpu).unwrap();
    let served_weights = engine.with_model(|m| m.state_dict()).unwrap();
    assert_eq!(trained.len(), served_weights.len());
    for (name, t) in &trained {
        let a: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        let b: Vec<f32> = served_weights[name].flatten_all().unwrap().to_vec1().unwrap();
        assert!(a == b, "{name} differs between the trainer's checkpoint and the engine");
    }

    // Rollouts 2 and 3 were sampled by synced weights: the engine's log-probs are the trainer's.
    let lines = read_metrics(summary.metrics_file.as_ref().unwrap()).unwrap();
    assert_eq!(lines.len(), 3);
    for (step, m) in &lines {
        assert!(
            m["rollout/log_probs_abs_diff"] < 1e-6,
            "step {step}: {}",
            m["rollout/log_probs_abs_diff"]
        );
        assert!(m["perf/sync_time"] > 0.0);
        assert!(m["train/grad_norm"] > 0.0, "step {step}: no gradient");
    }

    let _ = stop_tx.send(());
    rt.block_on(server).unwrap().unwrap();
}
