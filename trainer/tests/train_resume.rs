//! Kill and resume a real `vime-train` RL run. A GRPO run (built-in engine, shuffled prompts,
//! checkpoints every 2 rollouts, eval every 3) is killed with SIGKILL once its step-2 checkpoint
//! exists, at whatever point it has reached; `--load` then continues it to the end. Compared with
//! the same run left alone, the resumed one must end with bit-identical weights, optimizer state,
//! data cursor and step counters, and its metrics file must hold each step exactly once with the
//! same values (every metric but timings).
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use vime_trainer::demo::{make_task, MakeTaskArgs, TaskKind};
use vime_trainer::metrics::read_metrics;

const NUM_ROLLOUT: u64 = 12;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_vime-train")
}

fn task(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    let made = make_task(&MakeTaskArgs {
        task: TaskKind::Reverse,
        out: dir.to_path_buf(),
        min_len: 2,
        max_len: 4,
        min_digits: 1,
        max_digits: 2,
        ops: "+".into(),
        n_train: 60,
        n_eval: 8,
        seed: 3,
        hidden_size: 64,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        head_dim: 32,
    })
    .unwrap();
    (made.model_dir, made.files.train, made.files.eval)
}

fn train_flags(model: &Path, train: &Path, eval: &Path, save: &Path) -> Vec<String> {
    [
        "--hf-checkpoint",
        model.to_str().unwrap(),
        "--prompt-data",
        train.to_str().unwrap(),
        "--label-key",
        "label",
        "--rollout-shuffle",
        "--rollout-seed",
        "7",
        "--rollout-batch-size",
        "8",
        "--n-samples-per-prompt",
        "4",
        "--num-steps-per-rollout",
        "2",
        "--num-rollout",
        &NUM_ROLLOUT.to_string(),
        "--rollout-max-response-len",
        "6",
        "--rm-type",
        "exact_match",
        "--lr",
        "3e-3",
        "--lr-warmup-iters",
        "3",
        "--lr-decay-style",
        "cosine",
        "--lr-decay-iters",
        "24",
        "--entropy-coef",
        "0.01",
        "--max-tokens-per-gpu",
        "64",
        "--eval-prompt-data",
        "rev",
        eval.to_str().unwrap(),
        "--eval-interval",
        "3",
        "--n-samples-per-eval-prompt",
        "2",
        "--save",
        save.to_str().unwrap(),
        "--save-interval",
        "2",
        "--load",
        save.to_str().unwrap(),
        "--no-progress",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn run_to_end(flags: &[String]) {
    let out = Command::new(bin()).args(flags).output().unwrap();
    assert!(
        out.status.success(),
        "vime-train failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn latest(save: &Path) -> Option<u64> {
    std::fs::read_to_string(save.join("latest_checkpointed_iteration.txt"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

/// Metrics without timings (`perf/*` and the wall clock differ between runs).
fn comparable(path: &Path) -> Vec<(u64, BTreeMap<String, f64>)> {
    read_metrics(path)
        .unwrap()
        .into_iter()
        .map(|(s, m)| (s, m.into_iter().filter(|(k, _)| !k.starts_with("perf/")).collect()))
        .collect()
}

fn files_equal(a: &Path, b: &Path) {
    let (x, y) = (std::fs::read(a).unwrap(), std::fs::read(b).unwrap());
    assert!(x == y, "{} and {} differ", a.display(), b.display());
}

#[test]
fn a_killed_run_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train, eval) = task(&dir.path().join("task"));

    // The reference: one uninterrupted process.
    let straight = dir.path().join("straight");
    run_to_end(&train_flags(&model, &train, &eval, &straight));

    // Killed once the step-2 checkpoint is there, then resumed.
    let killed = dir.path().join("killed");
    let flags = train_flags(&model, &train, &eval, &killed);
    let mut child = Command::new(bin())
        .args(&flags)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while latest(&killed).is_none_or(|s| s < 2) {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "no step-2 checkpoint after 2 minutes"
        );
        if let Some(status) = child.try_wait().unwrap() {
            panic!("vime-train exited ({status}) before it could be killed");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert!(
        !status.success(),
        "the run finished before the kill; nothing was tested"
    );
    let at_kill = latest(&killed).unwrap();
    assert!(at_kill < NUM_ROLLOUT, "killed after the last checkpoint");
    let lines_at_kill = read_metrics(&killed.join("metrics.jsonl")).unwrap().len();
    eprintln!("killed with latest checkpoint at step {at_kill}, {lines_at_kill} metrics lines written");

    run_to_end(&flags);

    // Same final state, bit for bit.
    let last = format!("iter_{NUM_ROLLOUT:07}");
    for f in ["hf/model.safetensors", "optimizer.safetensors"] {
        files_equal(&straight.join(&last).join(f), &killed.join(&last).join(f));
    }
    let state = |root: &Path| -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(root.join(&last).join("state.json")).unwrap()).unwrap()
    };
    let (a, b) = (state(&straight), state(&killed));
    assert_eq!(a, b, "state.json differs");
    assert_eq!(a["step"], NUM_ROLLOUT);
    assert_eq!(a["optimizer_step"], 2 * NUM_ROLLOUT);
    // 12 rollouts x 8 prompts over 60 prompts: the cursor is in epoch 1, offset 36.
    assert_eq!(a["data"]["epoch"], 1);
    assert_eq!(a["data"]["offset"], 36);

    // The metrics file continues: each step once, in order, equal to the uninterrupted run's.
    let (ma, mb) = (
        comparable(&straight.join("metrics.jsonl")),
        comparable(&killed.join("metrics.jsonl")),
    );
    let steps: Vec<u64> = mb.iter().map(|(s, _)| *s).collect();
    assert_eq!(steps, (0..=NUM_ROLLOUT).collect::<Vec<_>>());
    assert_eq!(ma.len(), mb.len());
    for ((sa, a), (sb, b)) in ma.iter().zip(&mb) {
        assert_eq!(sa, sb);
        assert_eq!(
            a.keys().collect::<Vec<_>>(),
            b.keys().collect::<Vec<_>>(),
            "step {sa}: metric names"
        );
        for (k, x) in a {
            assert!(x.to_bits() == b[k].to_bits(), "step {sa}: {k} {x} vs {}", b[k]);
        }
    }
}

/// Ctrl-C (SIGINT) finishes the current phase, writes the plot and exits with status 130; the
/// metrics file holds every finished step and `--load` picks the run up from its last checkpoint.
#[test]
fn ctrl_c_stops_cleanly_with_a_plot() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train, eval) = task(&dir.path().join("task"));
    let save = dir.path().join("run");
    let mut flags = train_flags(&model, &train, &eval, &save);
    let n = flags.iter().position(|f| f == "--num-rollout").unwrap();
    flags[n + 1] = "400".into();
    let child = Command::new(bin())
        .args(&flags)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while latest(&save).is_none_or(|s| s < 2) {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "no step-2 checkpoint after 2 minutes"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let killed = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("interrupted after step"), "{stderr}");
    assert!(save.join("curves.png").is_file());
    let lines = read_metrics(&save.join("metrics.jsonl")).unwrap();
    let last = lines.last().unwrap().0;
    assert!((2..400).contains(&last), "stopped at step {last}");
    let steps: Vec<u64> = lines.iter().map(|(s, _)| *s).collect();
    assert_eq!(steps, (0..=last).collect::<Vec<_>>());
}

/// `--fp8-recipe delayed` keeps state, each role's amax history: a run stopped after its step-2
/// checkpoint and resumed with `--load` must end with the uninterrupted run's bits, which needs
/// the history from the checkpoint (`extra.safetensors`). Without it (the file removed) the
/// resumed run seeds its histories again, warns, and ends elsewhere.
#[test]
fn fp8_delayed_scaling_resumes_exactly_from_its_saved_amax_history() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train, eval) = task(&dir.path().join("task"));
    let run = |save: &Path, rollouts: u64| -> String {
        let mut flags = train_flags(&model, &train, &eval, save);
        let n = flags.iter().position(|f| f == "--num-rollout").unwrap();
        flags[n + 1] = rollouts.to_string();
        for f in ["--eval-prompt-data", "--eval-interval", "--n-samples-per-eval-prompt"] {
            let i = flags.iter().position(|x| x == f).unwrap();
            flags.drain(i..i + if f == "--eval-prompt-data" { 3 } else { 2 });
        }
        flags.extend(
            [
                "--dtype",
                "bf16",
                "--fp8-format",
                "hybrid",
                "--fp8-recipe",
                "delayed",
                "--fp8-amax-history-len",
                "2",
                "--fp8-amax-compute-algo",
                "max",
            ]
            .map(String::from),
        );
        let out = Command::new(bin()).args(&flags).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(out.status.success(), "vime-train failed:\n{stderr}");
        stderr
    };
    let straight = dir.path().join("straight");
    run(&straight, 4);
    let stopped = dir.path().join("stopped");
    run(&stopped, 2);
    let at2 = stopped.join("iter_0000002");
    let extra = candle_core::safetensors::load(at2.join("extra.safetensors"), &candle_core::Device::Cpu).unwrap();
    let hist = &extra["fp8_amax_history.policy.rank0"];
    // 2 layers x 11 roles, [pending, amax, h_0, h_1]; every role seeded after training steps.
    assert_eq!(hist.dims(), [22, 4]);
    let seeded = extra["fp8_amax_seeded.policy.rank0"].to_vec1::<u8>().unwrap();
    assert!(seeded.iter().all(|&s| s == 1), "{seeded:?}");
    // The same stopped run again (the runs are deterministic), to resume without its history.
    let blind = dir.path().join("blind");
    run(&blind, 2);
    run(&stopped, 4);
    let last = "iter_0000004";
    for f in ["hf/model.safetensors", "optimizer.safetensors", "extra.safetensors"] {
        files_equal(&straight.join(last).join(f), &stopped.join(last).join(f));
    }
    std::fs::remove_file(blind.join("iter_0000002/extra.safetensors")).unwrap();
    let stderr = run(&blind, 4);
    assert!(
        stderr.contains("no FP8 amax history of the policy for rank 0"),
        "{stderr}"
    );
    let (a, b) = (
        std::fs::read(straight.join(last).join("hf/model.safetensors")).unwrap(),
        std::fs::read(blind.join(last).join("hf/model.safetensors")).unwrap(),
    );
    assert!(
        a != b,
        "resumed without its amax history, the run still ended on the same bits"
    );
}
