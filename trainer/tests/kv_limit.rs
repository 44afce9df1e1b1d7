//! `--rollout-kv-cache-tokens`: a real `vime-train` GRPO run whose built-in engine has a KV cache
//! far smaller than a rollout needs (32 sequences at once against room for 1-3) preempts and
//! recomputes, and trains the same as the run without a limit: every rollout's responses (their
//! lengths, rewards and pass rates) are identical, and every other metric agrees to within the
//! log-prob rounding of recomputed prefixes (<= 1e-5 a log-prob on the CPU,
//! `rollout/tests/engine.rs`). Bad values are refused up front, naming the flag.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use vime_trainer::demo::{make_task, MakeTaskArgs, TaskKind};
use vime_trainer::metrics::read_metrics;

fn task(dir: &Path) -> (PathBuf, PathBuf) {
    let made = make_task(&MakeTaskArgs {
        task: TaskKind::Reverse,
        out: dir.to_path_buf(),
        min_len: 2,
        max_len: 4,
        min_digits: 1,
        max_digits: 2,
        ops: "+".into(),
        n_train: 40,
        n_eval: 4,
        seed: 3,
        hidden_size: 64,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        head_dim: 32,
    })
    .unwrap();
    (made.model_dir, made.files.train)
}

fn flags(model: &Path, train: &Path, save: &Path, extra: &[&str]) -> Vec<String> {
    let mut f: Vec<String> = [
        "--hf-checkpoint",
        model.to_str().unwrap(),
        "--prompt-data",
        train.to_str().unwrap(),
        "--label-key",
        "label",
        "--rollout-seed",
        "7",
        "--rollout-batch-size",
        "8",
        "--n-samples-per-prompt",
        "4",
        "--num-rollout",
        "3",
        "--rollout-max-response-len",
        "24",
        "--rm-type",
        "exact_match",
        "--lr",
        "3e-3",
        "--max-tokens-per-gpu",
        "64",
        "--save",
        save.to_str().unwrap(),
        "--no-progress",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    f.extend(extra.iter().map(|s| s.to_string()));
    f
}

fn run(flags: &[String]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_vime-train"))
        .args(flags)
        .output()
        .unwrap()
}

fn metrics(save: &Path) -> Vec<(u64, BTreeMap<String, f64>)> {
    read_metrics(&save.join("metrics.jsonl"))
        .unwrap()
        .into_iter()
        .map(|(s, m)| (s, m.into_iter().filter(|(k, _)| !k.starts_with("perf/")).collect()))
        .collect()
}

#[test]
fn a_kv_cache_far_too_small_for_the_rollout_preempts_and_trains_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train) = task(&dir.path().join("task"));
    let (free, small) = (dir.path().join("free"), dir.path().join("small"));
    let out = run(&flags(&model, &train, &free, &[]));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    // 4 pages of 16 tokens, one kept for padding: 1-3 of the 32 sequences at a time.
    let out = run(&flags(&model, &train, &small, &["--rollout-kv-cache-tokens", "64"]));
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let (a, b) = (metrics(&free), metrics(&small));
    assert_eq!(a.len(), b.len());
    assert!(a.len() >= 3, "{} steps", a.len());
    let mut preempted = 0.0;
    for ((sa, ma), (sb, mb)) in a.iter().zip(&b) {
        assert_eq!(sa, sb);
        assert!(!ma.contains_key("rollout/kv_preemptions"));
        if let Some(p) = mb.get("rollout/kv_preemptions") {
            preempted += p;
        }
        let keys_b: Vec<&String> = mb.keys().filter(|k| *k != "rollout/kv_preemptions").collect();
        assert_eq!(ma.keys().collect::<Vec<_>>(), keys_b, "step {sa}");
        for (k, va) in ma {
            let vb = mb[k];
            if k.contains("log_prob") {
                // The engine's log-probs of recomputed prefixes: rounding apart.
                assert!((va - vb).abs() <= 1e-5, "step {sa} {k}: {va} vs {vb}");
            } else if k.starts_with("rollout/") {
                // The same tokens: response lengths, rewards, pass rates exactly.
                assert_eq!(*va, vb, "step {sa} {k}");
            } else {
                assert!(
                    (va - vb).abs() <= 1e-3 * va.abs().max(1.0),
                    "step {sa} {k}: {va} vs {vb}"
                );
            }
        }
    }
    assert!(
        preempted > 0.0,
        "the cache never ran full: {:?}",
        b.iter()
            .map(|(_, m)| m.get("rollout/kv_preemptions"))
            .collect::<Vec<_>>()
    );

    // Refused before anything runs: a cache too small for one response, and the flag with
    // HTTP engines (which size their own).
    let out = run(&flags(
        &model,
        &train,
        &dir.path().join("bad"),
        &["--rollout-kv-cache-tokens", "32"],
    ));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && e.contains("--rollout-kv-cache-tokens 32")
            && e.contains("--rollout-max-response-len 24"),
        "{e}"
    );
    let out = run(&flags(
        &model,
        &train,
        &dir.path().join("bad2"),
        &[
            "--rollout-kv-cache-tokens",
            "4096",
            "--rollout-engine",
            "vllm",
            "--vllm-url",
            "http://127.0.0.1:9",
        ],
    ));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && e.contains("--vllm-gpu-memory-utilization"),
        "{e}"
    );
}
