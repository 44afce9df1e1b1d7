//! The fault matrix (issue 22) on the CPU: real `vime-train` processes hit by faults, and what
//! survives them.
//!
//! - kill -9 at a chosen point (the hidden `VIME_TEST_KILL_AT=<point>:<n>` hook, see
//!   `vime_trainer::train::fault`) or at a random time, then `--load` to the end: the resumed run
//!   must end with the same bits as the uninterrupted one (every checkpoint's weights, optimizer
//!   state and state.json; every metrics line but timings), lose no metrics line or checkpoint,
//!   leave no temp file behind, and resume from what `latest` named at the kill (so a half-written
//!   checkpoint is never loaded). Each trial picks the visit `n` of its point from a seeded
//!   generator; `VIME_FAULT_TRIALS` sets the trials per point (default 2, CI),
//!   `VIME_FAULT_SEED` the seed, `VIME_FAULT_MATRIX_OUT` a file the table is appended to.
//! - The same through an HTTP engine (vime-serve in this process, disk reload): kill before,
//!   during (the engine's reload kills the trainer) and after a weight sync.
//! - Two ranks (`--nproc-per-node 2`, CPU collectives): one SIGKILLed or failing mid-step; every
//!   rank exits naming it within a bound, and the run resumes to the same bits.
//! - NaN in a reward, a loss or a gradient (`VIME_TEST_NAN_AT`): skipped and counted by default,
//!   the run stopped naming the step with `--check-for-nan-in-loss-and-grad`.
//! - A full disk at a checkpoint write (RLIMIT_FSIZE in the child, and a tiny tmpfs when this runs
//!   as root and may mount) and a read-only `--save` (refused at start): an error naming the path,
//!   no panic, the previous checkpoint still `latest`, and the resume from it finishes.
use std::collections::BTreeMap;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vime_trainer::demo::{make_task, MakeTaskArgs, TaskKind};
use vime_trainer::metrics::read_metrics;

const NUM_ROLLOUT: u64 = 6;
const STEPS_PER_ROLLOUT: u64 = 2;
const SAVE_INTERVAL: u64 = 2;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_vime-train")
}

fn trials() -> usize {
    std::env::var("VIME_FAULT_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2)
}

/// xorshift64*, seeded by `VIME_FAULT_SEED` (default 22) and a per-test salt.
struct Rng(u64);
impl Rng {
    fn new(salt: u64) -> Self {
        let seed: u64 = std::env::var("VIME_FAULT_SEED")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(22);
        Rng((seed ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) % n.max(1)
    }
}

/// The arithmetic task with a 1-layer model of 9.8k parameters (a rollout takes ~0.1 s).
fn task(dir: &Path) -> (PathBuf, PathBuf) {
    let made = make_task(&MakeTaskArgs {
        task: TaskKind::Arith,
        out: dir.to_path_buf(),
        min_len: 2,
        max_len: 4,
        min_digits: 1,
        max_digits: 2,
        ops: "+".into(),
        n_train: 60,
        n_eval: 8,
        seed: 3,
        hidden_size: 32,
        intermediate_size: 64,
        num_hidden_layers: 1,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        head_dim: 16,
    })
    .unwrap();
    (made.model_dir, made.files.train)
}

/// A GRPO run of [`NUM_ROLLOUT`] rollouts, shuffled prompts, 2 optimizer steps per rollout, a
/// warmup + cosine schedule, a checkpoint every 2 rollouts, resuming from `save`.
fn flags(model: &Path, train: &Path, save: &Path, num_rollout: u64) -> Vec<String> {
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
        "4",
        "--n-samples-per-prompt",
        "2",
        "--num-steps-per-rollout",
        &STEPS_PER_ROLLOUT.to_string(),
        "--num-rollout",
        &num_rollout.to_string(),
        "--rollout-max-response-len",
        "4",
        "--rm-type",
        "exact_match",
        "--lr",
        "3e-3",
        "--lr-warmup-iters",
        "2",
        "--lr-decay-style",
        "cosine",
        "--lr-decay-iters",
        "12",
        "--entropy-coef",
        "0.01",
        "--max-tokens-per-gpu",
        "64",
        "--save",
        save.to_str().unwrap(),
        "--save-interval",
        &SAVE_INTERVAL.to_string(),
        "--load",
        save.to_str().unwrap(),
        "--no-progress",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn run_ok(cmd: &mut Command) -> Output {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "vime-train failed ({}):\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn latest(save: &Path) -> Option<u64> {
    std::fs::read_to_string(save.join("latest_checkpointed_iteration.txt"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
}

/// Metrics without timings (`perf/*` and the wall clock differ between runs) and `ignore`.
fn comparable(path: &Path, ignore: &[&str]) -> Vec<(u64, BTreeMap<String, f64>)> {
    if !path.exists() {
        return Vec::new();
    }
    read_metrics(path)
        .unwrap()
        .into_iter()
        .map(|(s, m)| {
            let m = m
                .into_iter()
                .filter(|(k, _)| !k.starts_with("perf/") && !ignore.contains(&k.as_str()))
                .collect();
            (s, m)
        })
        .collect()
}

fn iter_dirs(save: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(save)
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("iter_"))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

/// What a finished trial run lacks or has different from the uninterrupted run `want`.
#[derive(Default)]
struct Diff {
    /// Metrics lines of `want` that are missing or differ.
    lost_lines: usize,
    /// Checkpoints of `want` that are missing or differ.
    lost_ckpts: usize,
    notes: Vec<String>,
}

fn diff_runs(want: &Path, got: &Path) -> Diff {
    diff_runs_ignoring(want, got, &[])
}

fn diff_runs_ignoring(want: &Path, got: &Path, ignore: &[&str]) -> Diff {
    let mut d = Diff::default();
    let (wi, gi) = (iter_dirs(want), iter_dirs(got));
    for it in &wi {
        let mut same = gi.contains(it);
        if same {
            for f in ["hf/model.safetensors", "optimizer.safetensors", "state.json"] {
                let (a, b) = (
                    std::fs::read(want.join(it).join(f)),
                    std::fs::read(got.join(it).join(f)),
                );
                if a.is_err() || b.is_err() || a.unwrap() != b.unwrap() {
                    d.notes.push(format!("{it}/{f} differs"));
                    same = false;
                }
            }
        } else {
            d.notes.push(format!("{it} missing"));
        }
        d.lost_ckpts += (!same) as usize;
    }
    if latest(want) != latest(got) {
        d.notes.push(format!("latest {:?} vs {:?}", latest(want), latest(got)));
    }
    let (a, b) = (
        comparable(&want.join("metrics.jsonl"), ignore),
        comparable(&got.join("metrics.jsonl"), ignore),
    );
    let steps: Vec<u64> = b.iter().map(|(s, _)| *s).collect();
    if steps != a.iter().map(|(s, _)| *s).collect::<Vec<_>>() {
        d.notes.push(format!("metrics steps {steps:?}"));
    }
    for (i, (s, m)) in a.iter().enumerate() {
        let same = b.get(i).is_some_and(|(t, n)| {
            t == s
                && m.len() == n.len()
                && m.iter()
                    .all(|(k, x)| n.get(k).is_some_and(|y| y.to_bits() == x.to_bits()))
        });
        if !same {
            d.lost_lines += 1;
            let differ: Vec<String> = match b.get(i) {
                Some((_, n)) => m
                    .iter()
                    .filter(|(k, x)| n.get(*k).is_none_or(|y| y.to_bits() != x.to_bits()))
                    .map(|(k, x)| format!("{k} {x} vs {:?}", n.get(k)))
                    .collect(),
                None => vec!["missing".into()],
            };
            d.notes
                .push(format!("metrics line of step {s} differs: {}", differ.join(", ")));
        }
    }
    for e in std::fs::read_dir(got).unwrap().filter_map(|e| e.ok()) {
        let n = e.file_name().to_string_lossy().into_owned();
        if n.starts_with(".tmp-") || n.starts_with(".old-") || n.contains(".tmp") {
            d.notes.push(format!("left behind: {n}"));
        }
    }
    d
}

/// One row of the matrix.
struct Row {
    fault: String,
    trials: usize,
    survived: usize,
    lost_lines: usize,
    lost_ckpts: usize,
    test: &'static str,
    failures: Vec<String>,
}

impl Row {
    fn new(fault: &str, test: &'static str) -> Self {
        Row {
            fault: fault.into(),
            trials: 0,
            survived: 0,
            lost_lines: 0,
            lost_ckpts: 0,
            test,
            failures: Vec::new(),
        }
    }
    fn add(&mut self, what: &str, d: Diff, extra: Vec<String>) {
        self.trials += 1;
        self.lost_lines += d.lost_lines;
        self.lost_ckpts += d.lost_ckpts;
        let mut notes = d.notes;
        notes.extend(extra);
        if notes.is_empty() {
            self.survived += 1;
        } else {
            self.failures.push(format!("{what}: {}", notes.join("; ")));
        }
    }
}

/// Prints the rows as the markdown table of benches/results (and appends it to
/// `VIME_FAULT_MATRIX_OUT`), then fails on any trial that did not survive.
fn report(rows: &[Row]) {
    let mut t = String::from("| fault | trials | survived | lost data | test |\n|---|---|---|---|---|\n");
    for r in rows {
        t.push_str(&format!(
            "| {} | {} | {} | {} metrics lines, {} checkpoints | `faults.rs::{}` |\n",
            r.fault, r.trials, r.survived, r.lost_lines, r.lost_ckpts, r.test
        ));
    }
    eprintln!("{t}");
    if let Ok(p) = std::env::var("VIME_FAULT_MATRIX_OUT") {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new().create(true).append(true).open(p).unwrap();
        f.write_all(t.as_bytes()).unwrap();
    }
    let failures: Vec<&String> = rows.iter().flat_map(|r| &r.failures).collect();
    assert!(failures.is_empty(), "trials that did not survive:\n{failures:#?}");
    assert!(rows.iter().all(|r| r.trials > 0), "a row without trials");
}

/// What the hook leaves: the child was SIGKILLed at `point` (not finished, not failed).
fn killed_by_hook(out: &Output, point: &str) -> Vec<String> {
    let stderr = String::from_utf8_lossy(&out.stderr);
    let mut notes = Vec::new();
    if out.status.signal() != Some(9) {
        notes.push(format!("not SIGKILLed ({}): {stderr}", out.status));
    }
    if !stderr.contains(&format!("VIME_TEST_KILL_AT: SIGKILL at {point}")) {
        notes.push(format!("the hook did not fire at {point}"));
    }
    notes
}

/// The state a kill left: `latest` names a checkpoint that loads whole (weights, optimizer
/// state, loop state). Returns its step.
fn check_latest_loads(save: &Path) -> Result<Option<u64>, String> {
    let Some(step) = latest(save) else { return Ok(None) };
    let loaded = vime_trainer::ckpt::load_latest(save, &candle_core::Device::Cpu)
        .map_err(|e| format!("latest {step} does not load: {e:#}"))?
        .ok_or("latest vanished")?;
    vime_qwen3::model::Qwen3::load_hf(&loaded.hf_dir(), candle_core::DType::F32, &candle_core::Device::Cpu)
        .map_err(|e| format!("the weights of latest {step} do not load: {e:#}"))?;
    Ok(Some(step))
}

/// Resumes `flags` to the end; a note when it did not resume from `at_kill`.
fn resume(cmd: &mut Command, at_kill: Option<u64>) -> Vec<String> {
    let out = cmd.output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        return vec![format!("the resumed run failed ({}): {stderr}", out.status)];
    }
    match at_kill {
        Some(s) if !stderr.contains(&format!("iter_{s:07} (step {s},")) => {
            vec![format!("did not resume from step {s}: {stderr}")]
        }
        None if stderr.contains("resuming from") => vec![format!("resumed with no checkpoint at the kill: {stderr}")],
        _ => Vec::new(),
    }
}

/// `(point, visits in one run)`: every point of `vime_trainer::train::fault` the loop reaches.
fn points() -> Vec<(&'static str, u64)> {
    let saves = NUM_ROLLOUT / SAVE_INTERVAL;
    vec![
        ("rollout", NUM_ROLLOUT),
        ("reward", NUM_ROLLOUT),
        ("logprobs", NUM_ROLLOUT),
        ("optimizer", NUM_ROLLOUT * STEPS_PER_ROLLOUT),
        ("sync-start", NUM_ROLLOUT),
        ("sync-end", NUM_ROLLOUT),
        ("metrics", NUM_ROLLOUT),
        ("save-files", saves),
        ("save-renamed", saves),
        ("save-latest", saves),
    ]
}

fn describe(point: &str) -> &'static str {
    match point {
        "rollout" => "kill -9 in the rollout (prompts drawn, nothing generated)",
        "reward" => "kill -9 at the reward (samples generated, not scored)",
        "logprobs" => "kill -9 after the old log-probs",
        "optimizer" => "kill -9 inside the optimizer loop (gradients accumulated, no update)",
        "sync-start" => "kill -9 as the weight sync starts (built-in engine)",
        "sync-end" => "kill -9 as the weight sync ends (built-in engine)",
        "metrics" => "kill -9 during the metrics write (half a JSONL line written)",
        "save-files" => "kill -9 during a checkpoint write (hf/ written, optimizer state not)",
        "save-renamed" => "kill -9 during a checkpoint write (folder renamed, `latest` not updated)",
        "save-latest" => "kill -9 during a checkpoint write (`latest` temp written, not renamed)",
        _ => "?",
    }
}

#[test]
fn kill_9_at_every_point_resumes_bit_exactly() {
    let t0 = Instant::now();
    let dir = tempfile::tempdir().unwrap();
    let (model, train) = task(&dir.path().join("task"));
    let straight = dir.path().join("straight");
    let t = Instant::now();
    run_ok(Command::new(bin()).args(flags(&model, &train, &straight, NUM_ROLLOUT)));
    let straight_secs = t.elapsed().as_secs_f64();
    assert_eq!(iter_dirs(&straight).len() as u64, NUM_ROLLOUT / SAVE_INTERVAL);

    let mut rows = Vec::new();
    let mut rng = Rng::new(1);
    for (point, visits) in points() {
        let mut row = Row::new(describe(point), "kill_9_at_every_point_resumes_bit_exactly");
        for trial in 0..trials() {
            let n = 1 + rng.below(visits);
            let save = dir.path().join(format!("{point}-{trial}"));
            let f = flags(&model, &train, &save, NUM_ROLLOUT);
            let out = Command::new(bin())
                .args(&f)
                .env("VIME_TEST_KILL_AT", format!("{point}:{n}"))
                .output()
                .unwrap();
            let mut notes = killed_by_hook(&out, point);
            let at_kill = check_latest_loads(&save).unwrap_or_else(|e| {
                notes.push(e);
                None
            });
            notes.extend(resume(Command::new(bin()).args(&f), at_kill));
            row.add(&format!("{point}:{n}"), diff_runs(&straight, &save), notes);
        }
        rows.push(row);
    }

    // SIGKILL from outside at a random time of the run.
    let mut row = Row::new(
        "kill -9 at a random time (uniform over the run)",
        "kill_9_at_every_point_resumes_bit_exactly",
    );
    let mut attempts = 0;
    while row.trials < trials() && attempts < 4 * trials() {
        attempts += 1;
        let save = dir.path().join(format!("random-{attempts}"));
        let f = flags(&model, &train, &save, NUM_ROLLOUT);
        let delay = Duration::from_secs_f64(straight_secs * rng.below(1000) as f64 / 1000.0);
        let mut child = Command::new(bin())
            .args(&f)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(delay);
        let _ = child.kill();
        let status = child.wait().unwrap();
        if status.success() {
            continue; // finished before the kill: no trial
        }
        let mut notes = Vec::new();
        if status.signal() != Some(9) {
            notes.push(format!("exited {status} before the kill"));
        }
        let at_kill = check_latest_loads(&save).unwrap_or_else(|e| {
            notes.push(e);
            None
        });
        notes.extend(resume(Command::new(bin()).args(&f), at_kill));
        row.add(
            &format!("random {:.0} ms", delay.as_secs_f64() * 1e3),
            diff_runs(&straight, &save),
            notes,
        );
    }
    rows.push(row);
    report(&rows);
    eprintln!(
        "kill matrix: {} trials per point, {:.1} s in all (one run {straight_secs:.2} s)",
        trials(),
        t0.elapsed().as_secs_f64()
    );
}

// ------------------------------------------------------------------------------------------
// Through an HTTP engine: the trainer killed around and during a weight sync
// ------------------------------------------------------------------------------------------

/// The built-in engine behind vime-serve, which SIGKILLs the trainer (pid in `victim`) when its
/// weight reload number `kill_on` starts, then reloads anyway: the engine ends up a step ahead of
/// the trainer's last checkpoint, the worst case for a resume. Or it hangs in reload number
/// `hang_on` until `release` (at most 60 s), then reloads.
struct KillingEngine {
    inner: Arc<vime_rollout::engine::embedded::EmbeddedEngine>,
    victim: Arc<AtomicU32>,
    reloads: AtomicU64,
    kill_on: Arc<AtomicU64>,
    hang_on: Arc<AtomicU64>,
    release: Arc<AtomicBool>,
}

impl vime_rollout::engine::RolloutEngine for KillingEngine {
    fn generate(
        &self,
        requests: &[vime_rollout::engine::GenRequest],
    ) -> anyhow::Result<Vec<vime_rollout::engine::GenOutput>> {
        self.inner.generate(requests)
    }
    fn update_weights_from_dir(&self, dir: &Path) -> anyhow::Result<()> {
        let k = self.reloads.fetch_add(1, Ordering::SeqCst) + 1;
        if k == self.kill_on.load(Ordering::SeqCst) {
            // The test stores the pid right after the spawn; on a loaded machine the trainer may
            // get here first.
            let t = Instant::now();
            while self.victim.load(Ordering::SeqCst) == 0 && t.elapsed() < Duration::from_secs(10) {
                std::thread::sleep(Duration::from_millis(1));
            }
            let pid = self.victim.load(Ordering::SeqCst).to_string();
            Command::new("kill").args(["-9", &pid]).status().unwrap();
        }
        if k == self.hang_on.load(Ordering::SeqCst) {
            let t = Instant::now();
            while !self.release.load(Ordering::SeqCst) && t.elapsed() < Duration::from_secs(60) {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
        self.inner.update_weights_from_dir(dir)
    }
    fn weight_version(&self) -> u64 {
        self.inner.weight_version()
    }
}

/// vime-serve (this process) over a fresh built-in engine of `model`, in dev mode (the sync's
/// routes), reloading only from folders under `root` (where the runs save).
struct Served {
    url: String,
    victim: Arc<AtomicU32>,
    kill_on: Arc<AtomicU64>,
    hang_on: Arc<AtomicU64>,
    release: Arc<AtomicBool>,
    _rt: tokio::runtime::Runtime,
}

impl Drop for Served {
    fn drop(&mut self) {
        // A reload hung in a blocking thread would hold the runtime's shutdown.
        self.release.store(true, Ordering::SeqCst);
    }
}

fn serve(model: &Path, root: &Path) -> Served {
    use vime_rollout::engine::embedded::EmbeddedEngine;
    use vime_rollout::serve::{serve, ServeConfig};
    let inner = Arc::new(EmbeddedEngine::load_hf(model, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap());
    let victim = Arc::new(AtomicU32::new(0));
    let kill_on = Arc::new(AtomicU64::new(0));
    let hang_on = Arc::new(AtomicU64::new(0));
    let release = Arc::new(AtomicBool::new(false));
    let engine = Arc::new(KillingEngine {
        inner,
        victim: victim.clone(),
        reloads: AtomicU64::new(0),
        kill_on: kill_on.clone(),
        hang_on: hang_on.clone(),
        release: release.clone(),
    });
    let mut cfg = ServeConfig::from_hf_dir(model, None).unwrap();
    cfg.dev_mode = true;
    cfg.allowed_weights_root = Some(root.canonicalize().unwrap());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let listener = rt.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    rt.spawn(serve(listener, engine, cfg, std::future::pending()));
    Served {
        url,
        victim,
        kill_on,
        hang_on,
        release,
        _rt: rt,
    }
}

fn vllm_flags(model: &Path, train: &Path, save: &Path, url: &str) -> Vec<String> {
    let mut f = flags(model, train, save, NUM_ROLLOUT);
    f.extend(
        [
            "--rollout-engine",
            "vllm",
            "--vllm-url",
            url,
            "--vllm-request-timeout",
            "60",
            "--update-weight-transport",
            "disk",
        ]
        .map(String::from),
    );
    f
}

/// The engine's own log-probs of its samples, as vime-serve batched them: the samples (seeded)
/// and everything trained on do not depend on the batch, these few ulps do (see
/// `assert_matches_in_process` in tests/vllm_client.rs); nothing trains on them (no `--use-tis`).
const ENGINE_LOGPROB_METRICS: [&str; 3] = [
    "rollout/log_probs_abs_diff",
    "rollout/log_probs_max_abs_diff",
    "train/train_rollout_logprob_abs_diff",
];

#[test]
fn kill_9_around_and_during_a_weight_sync_to_vime_serve_resumes_bit_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train) = task(&dir.path().join("task"));
    let straight = dir.path().join("straight");
    {
        let s = serve(&model, dir.path());
        run_ok(Command::new(bin()).args(vllm_flags(&model, &train, &straight, &s.url)));
    }
    // The control: a second uninterrupted run differs at most in the engine's batch-dependent
    // log-prob metrics.
    let again = dir.path().join("again");
    {
        let s = serve(&model, dir.path());
        run_ok(Command::new(bin()).args(vllm_flags(&model, &train, &again, &s.url)));
    }
    let d = diff_runs_ignoring(&straight, &again, &ENGINE_LOGPROB_METRICS);
    assert!(d.notes.is_empty(), "two uninterrupted runs differ: {:?}", d.notes);
    eprintln!(
        "control: the engine log-prob metrics of two uninterrupted runs differ in {} of {NUM_ROLLOUT} lines",
        diff_runs(&straight, &again).lost_lines
    );
    let mut rows = Vec::new();
    let mut rng = Rng::new(2);
    let test = "kill_9_around_and_during_a_weight_sync_to_vime_serve_resumes_bit_exactly";
    for (point, what) in [
        (
            "sync-start",
            "kill -9 as a weight sync to vime-serve starts (HF folder not written)",
        ),
        (
            "mid-reload",
            "kill -9 during a weight sync to vime-serve (the engine reloading)",
        ),
        (
            "sync-end",
            "kill -9 after a weight sync to vime-serve (engine updated, step not logged)",
        ),
    ] {
        let mut row = Row::new(what, test);
        for trial in 0..trials() {
            // One engine per trial: it lives through the kill, as a real one would.
            let s = serve(&model, dir.path());
            // The first trial kills before the first checkpoint: the restart starts afresh while
            // the engine holds a later step's weights.
            let n = if trial == 0 { 1 } else { 1 + rng.below(NUM_ROLLOUT) };
            let save = dir.path().join(format!("{point}-{trial}"));
            let f = vllm_flags(&model, &train, &save, &s.url);
            let mut cmd = Command::new(bin());
            cmd.args(&f).stdout(Stdio::null()).stderr(Stdio::piped());
            if point == "mid-reload" {
                s.kill_on.store(n, Ordering::SeqCst);
            } else {
                cmd.env("VIME_TEST_KILL_AT", format!("{point}:{n}"));
            }
            let child = cmd.spawn().unwrap();
            s.victim.store(child.id(), Ordering::SeqCst);
            let out = child.wait_with_output().unwrap();
            s.victim.store(0, Ordering::SeqCst);
            let mut notes = if point == "mid-reload" {
                match out.status.signal() {
                    Some(9) => Vec::new(),
                    _ => vec![format!("not killed mid-reload ({})", out.status)],
                }
            } else {
                killed_by_hook(&out, point)
            };
            let at_kill = check_latest_loads(&save).unwrap_or_else(|e| {
                notes.push(e);
                None
            });
            notes.extend(resume(Command::new(bin()).args(&f), at_kill));
            row.add(
                &format!("{point}:{n}"),
                diff_runs_ignoring(&straight, &save, &ENGINE_LOGPROB_METRICS),
                notes,
            );
        }
        rows.push(row);
    }
    report(&rows);
}

/// An engine that hangs in a disk reload: the sync fails after about `--update-weight-timeout`
/// (the client's control timeout is 1800 s), the error naming the engine's URL and the flag.
#[test]
fn a_hung_engine_fails_a_disk_weight_sync_within_the_update_weight_timeout() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train) = task(&dir.path().join("task"));
    let s = serve(&model, dir.path());
    s.hang_on.store(1, Ordering::SeqCst);
    let save = dir.path().join("hung");
    let t = Instant::now();
    let out = Command::new(bin())
        .args(vllm_flags(&model, &train, &save, &s.url))
        .args(["--update-weight-timeout", "2"])
        .output()
        .unwrap();
    let secs = t.elapsed().as_secs_f64();
    s.release.store(true, Ordering::SeqCst);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the run succeeded after {secs:.1} s:\n{stderr}");
    assert!(
        stderr.contains(&s.url) && stderr.contains("no answer within 2s"),
        "the error does not name {} and the 2 s: {stderr}",
        s.url
    );
    assert!(stderr.contains("--update-weight-timeout 2 s"), "{stderr}");
    // The run's start and one rollout take a few seconds; the engine would answer after 60 s.
    assert!(secs < 45.0, "the run took {secs:.1} s to fail");
    eprintln!(
        "hung engine: the run failed after {secs:.1} s: {}",
        stderr.trim().lines().last().unwrap_or("")
    );
}

// ------------------------------------------------------------------------------------------
// Two ranks
// ------------------------------------------------------------------------------------------

#[test]
fn a_killed_or_failing_rank_is_named_by_every_rank_and_the_run_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train) = task(&dir.path().join("task"));
    let two = |save: &Path| {
        let mut c = Command::new(bin());
        c.args(["--nproc-per-node", "2"])
            .args(flags(&model, &train, save, NUM_ROLLOUT));
        c
    };
    let straight = dir.path().join("straight");
    run_ok(&mut two(&straight));
    let test = "a_killed_or_failing_rank_is_named_by_every_rank_and_the_run_resumes";
    let mut rows = Vec::new();
    let mut rng = Rng::new(3);
    for (var, what) in [
        (
            "VIME_TEST_KILL_AT",
            "2 ranks: rank 1 SIGKILLed mid-step (optimizer loop)",
        ),
        (
            "VIME_TEST_ERROR_AT",
            "2 ranks: rank 1 fails with an error mid-step (optimizer loop)",
        ),
    ] {
        let mut row = Row::new(what, test);
        for trial in 0..trials() {
            let n = 1 + rng.below(NUM_ROLLOUT * STEPS_PER_ROLLOUT);
            let save = dir.path().join(format!("{var}-{trial}"));
            let t = Instant::now();
            let out = two(&save).env(var, format!("optimizer:{n}@1")).output().unwrap();
            let secs = t.elapsed().as_secs_f64();
            let stderr = String::from_utf8_lossy(&out.stderr);
            let mut notes = Vec::new();
            if out.status.success() {
                notes.push("the run succeeded".into());
            }
            // The launcher reports the rank, and rank 0 (alive) names it too.
            if !stderr.contains("rank 1") {
                notes.push(format!("no error names rank 1: {stderr}"));
            }
            // The launcher's summary (the last line) names rank 1 as the cause, even when rank 0
            // exits in the same poll.
            let summary = stderr.trim().lines().last().unwrap_or("");
            // (An erroring rank 1 and rank 0 in the same poll are both plain exits: not checked.)
            let cause = "local rank 1 was killed by signal 9 (SIGKILL)";
            if var == "VIME_TEST_KILL_AT" && !summary.contains(cause) {
                notes.push(format!("the launcher's summary does not start from rank 1: {summary}"));
            }
            if secs > 30.0 {
                notes.push(format!("took {secs:.1} s to fail (bound 30 s)"));
            }
            eprintln!("{var} optimizer:{n}@1: failed in {secs:.1} s");
            let at_kill = check_latest_loads(&save).unwrap_or_else(|e| {
                notes.push(e);
                None
            });
            notes.extend(resume(&mut two(&save), at_kill));
            row.add(&format!("optimizer:{n}@1"), diff_runs(&straight, &save), notes);
        }
        rows.push(row);
    }
    report(&rows);
}

// ------------------------------------------------------------------------------------------
// Numerics
// ------------------------------------------------------------------------------------------

fn finite_weights(path: &Path) -> bool {
    candle_core::safetensors::load(path, &candle_core::Device::Cpu)
        .unwrap()
        .values()
        .all(|t| {
            t.flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .all(|x| x.is_finite())
        })
}

/// A NaN in the 2nd rollout's reward, in the 3rd policy step's loss (one old log-prob) or in the
/// 5th step's gradient: skipped by default (one step not applied, counted in
/// `train/skipped_steps`, the weights stay finite, the other steps train), and with
/// `--check-for-nan-in-loss-and-grad` the run stops with an error naming the step.
#[test]
fn nan_in_reward_loss_or_grad_is_skipped_or_stops_the_run_naming_the_step() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train) = task(&dir.path().join("task"));
    let mut rows = Vec::new();
    let test = "nan_in_reward_loss_or_grad_is_skipped_or_stops_the_run_naming_the_step";
    // (injection, the metrics step it lands in, what the error names)
    for (nan, step, names) in [
        ("reward:2", 2u64, "reward(s) not finite"),
        ("loss:3", 2, "the loss"),
        ("grad:5", 3, "the gradient of"),
    ] {
        let what = nan.split(':').next().unwrap();
        let mut row = Row::new(&format!("NaN in the {what} (injected)"), test);
        let save = dir.path().join(format!("skip-{what}"));
        let out = run_ok(
            Command::new(bin())
                .args(flags(&model, &train, &save, NUM_ROLLOUT))
                .env("VIME_TEST_NAN_AT", nan),
        );
        let stderr = String::from_utf8_lossy(&out.stderr);
        let mut notes = Vec::new();
        let lines = read_metrics(&save.join("metrics.jsonl")).unwrap();
        let skipped: Vec<(u64, f64)> = lines.iter().map(|(s, m)| (*s, m["train/skipped_steps"])).collect();
        let want: Vec<(u64, f64)> = (1..=NUM_ROLLOUT).map(|s| (s, (s == step) as u8 as f64)).collect();
        if skipped != want {
            notes.push(format!("train/skipped_steps {skipped:?}"));
        }
        if !stderr.contains(&format!("warning: step {step}")) {
            notes.push(format!("no warning names step {step}: {stderr}"));
        }
        let last = save.join(format!("iter_{NUM_ROLLOUT:07}"));
        if !finite_weights(&last.join("hf/model.safetensors")) || !finite_weights(&last.join("optimizer.safetensors")) {
            notes.push("a NaN reached the weights or the optimizer state".into());
        }
        let state: serde_json::Value =
            serde_json::from_slice(&std::fs::read(last.join("state.json")).unwrap()).unwrap();
        if state["optimizer_step"] != NUM_ROLLOUT * STEPS_PER_ROLLOUT - 1 {
            notes.push(format!("optimizer_step {} (one step skipped)", state["optimizer_step"]));
        }
        if what == "reward" && lines[1].1.get("rollout/nonfinite_rewards") != Some(&1.0) {
            notes.push("rollout/nonfinite_rewards is not 1 at step 2".into());
        }
        row.add("skipped", Diff::default(), notes);

        let save = dir.path().join(format!("stop-{what}"));
        let t = Instant::now();
        let out = Command::new(bin())
            .args(flags(&model, &train, &save, NUM_ROLLOUT))
            .arg("--check-for-nan-in-loss-and-grad")
            .env("VIME_TEST_NAN_AT", nan)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let mut notes = Vec::new();
        if out.status.success() || stderr.contains("panicked") {
            notes.push(format!("{}: {stderr}", out.status));
        }
        if !(stderr.contains(&format!("step {step}")) && stderr.contains(names)) {
            notes.push(format!("the error does not name step {step} and {names:?}: {stderr}"));
        }
        if !stderr.contains("--check-for-nan-in-loss-and-grad") {
            notes.push("the error does not name the flag".into());
        }
        let lines = read_metrics(&save.join("metrics.jsonl")).unwrap();
        if lines.len() as u64 != step - 1 {
            notes.push(format!("{} metrics lines before the stop", lines.len()));
        }
        eprintln!(
            "stop at {nan}: {:.1} s, {}",
            t.elapsed().as_secs_f64(),
            stderr.trim().lines().last().unwrap_or("")
        );
        row.add("stopped", Diff::default(), notes);
        rows.push(row);
    }

    // Two ranks, the NaN on rank 1 only: both agree to skip the step (or to stop).
    for (nan, step) in [("loss:3@1", 2u64), ("grad:5@1", 3)] {
        let what = nan.split(':').next().unwrap();
        let mut row = Row::new(&format!("2 ranks: NaN in rank 1's {what} only (injected)"), test);
        let save = dir.path().join(format!("dp2-{what}"));
        let out = run_ok(
            Command::new(bin())
                .args(["--nproc-per-node", "2"])
                .args(flags(&model, &train, &save, NUM_ROLLOUT))
                .env("VIME_TEST_NAN_AT", nan),
        );
        let mut notes = Vec::new();
        let lines = read_metrics(&save.join("metrics.jsonl")).unwrap();
        let skipped: Vec<(u64, f64)> = lines.iter().map(|(s, m)| (*s, m["train/skipped_steps"])).collect();
        let want: Vec<(u64, f64)> = (1..=NUM_ROLLOUT).map(|s| (s, (s == step) as u8 as f64)).collect();
        if skipped != want {
            notes.push(format!("train/skipped_steps {skipped:?}"));
        }
        let last = save.join(format!("iter_{NUM_ROLLOUT:07}"));
        if !finite_weights(&last.join("hf/model.safetensors")) || !finite_weights(&last.join("optimizer.safetensors")) {
            notes.push("a NaN reached the weights or the optimizer state".into());
        }
        let stderr = String::from_utf8_lossy(&out.stderr);
        if !stderr.contains(&format!("warning: step {step}")) {
            notes.push(format!("no warning names step {step}: {stderr}"));
        }
        row.add("skipped", Diff::default(), notes);
        let save = dir.path().join(format!("dp2-stop-{what}"));
        let out = Command::new(bin())
            .args(["--nproc-per-node", "2"])
            .args(flags(&model, &train, &save, NUM_ROLLOUT))
            .arg("--check-for-nan-in-loss-and-grad")
            .env("VIME_TEST_NAN_AT", nan)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let mut notes = Vec::new();
        if out.status.success() || !stderr.contains(&format!("step {step} (rollout {})", step - 1)) {
            notes.push(format!("not stopped naming step {step} ({}): {stderr}", out.status));
        }
        row.add("stopped", Diff::default(), notes);
        rows.push(row);
    }
    report(&rows);
}

// ------------------------------------------------------------------------------------------
// Disk full, read-only save dir
// ------------------------------------------------------------------------------------------

/// `cmd` runs with RLIMIT_FSIZE = `bytes` and SIGXFSZ ignored: a write past `bytes` fails with
/// EFBIG ("File too large"), as a full disk fails one with ENOSPC.
fn with_file_size_limit(cmd: &mut Command, bytes: u64) -> &mut Command {
    #[repr(C)]
    struct Rlimit {
        cur: u64,
        max: u64,
    }
    extern "C" {
        fn setrlimit(resource: std::ffi::c_int, rlim: *const Rlimit) -> std::ffi::c_int;
        fn signal(sig: std::ffi::c_int, handler: usize) -> usize;
    }
    const RLIMIT_FSIZE: std::ffi::c_int = 1;
    const SIGXFSZ: std::ffi::c_int = 25;
    const SIG_IGN: usize = 1;
    // SAFETY: between fork and exec only async-signal-safe calls (setrlimit, signal) run.
    unsafe {
        cmd.pre_exec(move || {
            signal(SIGXFSZ, SIG_IGN);
            let lim = Rlimit { cur: bytes, max: bytes };
            if setrlimit(RLIMIT_FSIZE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        })
    }
}

/// Runs `--num-rollout 4` on `save` (which holds the step-2 checkpoint of a good run) under
/// `setup`, expecting the step-4 save to fail naming a path under `save`; then, with `fix` applied,
/// the resume from step 2 to the end. Returns the notes of what went wrong.
fn fail_then_resume(
    model: &Path,
    train: &Path,
    save: &Path,
    log_dir: &Path,
    setup: impl FnOnce(&mut Command) -> &mut Command,
    error_names: &str,
    fix: impl FnOnce(),
) -> Vec<String> {
    let mut notes = Vec::new();
    let mut f = flags(model, train, save, 4);
    f.extend(["--log-dir".to_string(), log_dir.to_str().unwrap().to_string()]);
    let mut cmd = Command::new(bin());
    cmd.args(&f);
    let out = setup(&mut cmd).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        notes.push("the run succeeded".into());
    }
    if out.status.signal().is_some() || stderr.contains("panicked") {
        notes.push(format!("not a clean error ({}): {stderr}", out.status));
    }
    if !stderr.contains(error_names) {
        notes.push(format!("the error does not name {error_names:?}: {stderr}"));
    }
    eprintln!("error: {}", stderr.trim().lines().last().unwrap_or(""));
    if latest(save) != Some(2) {
        notes.push(format!("latest is {:?} after the failed save, not 2", latest(save)));
    }
    fix();
    let out = Command::new(bin()).args(&f).output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() || !stderr.contains("iter_0000002 (step 2,") || latest(save) != Some(4) {
        notes.push(format!("the resume from step 2 failed ({}): {stderr}", out.status));
    }
    notes
}

fn is_root() -> bool {
    extern "C" {
        fn geteuid() -> u32;
    }
    // SAFETY: geteuid(2) always succeeds.
    unsafe { geteuid() == 0 }
}

fn mount_tmpfs(at: &Path, opts: &str) -> bool {
    is_root()
        && Command::new("mount")
            .args(["-t", "tmpfs", "-o", opts, "tmpfs", at.to_str().unwrap()])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
}

fn umount(at: &Path) {
    let _ = Command::new("umount").arg(at).status();
}

#[test]
fn a_full_disk_or_read_only_save_dir_fails_naming_the_path_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train) = task(&dir.path().join("task"));
    let test = "a_full_disk_or_read_only_save_dir_fails_naming_the_path_and_resumes";
    let mut rows = Vec::new();
    // A good start: the step-2 checkpoint.
    let start = |save: &Path, logs: &Path| {
        let mut f = flags(&model, &train, save, 2);
        f.extend(["--log-dir".to_string(), logs.to_str().unwrap().to_string()]);
        run_ok(Command::new(bin()).args(f));
    };
    let opt_bytes = {
        let (save, logs) = (dir.path().join("probe"), dir.path().join("probe-logs"));
        start(&save, &logs);
        std::fs::metadata(save.join("iter_0000002/optimizer.safetensors"))
            .unwrap()
            .len()
    };

    // File-size limit: the optimizer state (the largest file) no longer fits.
    let mut row = Row::new(
        "disk full: RLIMIT_FSIZE in the child (EFBIG) at a checkpoint write",
        test,
    );
    let (save, logs) = (dir.path().join("fsize"), dir.path().join("fsize-logs"));
    start(&save, &logs);
    let notes = fail_then_resume(
        &model,
        &train,
        &save,
        &logs,
        |c| with_file_size_limit(c, opt_bytes / 2),
        &format!("{}/.tmp-iter_0000004/optimizer.safetensors", save.display()),
        || {},
    );
    row.add("fsize", Diff::default(), notes);
    rows.push(row);

    // A real full disk: a tmpfs that holds one checkpoint, not two.
    let (save, logs) = (dir.path().join("tmpfs"), dir.path().join("tmpfs-logs"));
    std::fs::create_dir_all(&save).unwrap();
    let ckpt_bytes: u64 = {
        let probe = dir.path().join("probe/iter_0000002");
        let mut total = 0;
        for sub in ["", "hf"] {
            for e in std::fs::read_dir(probe.join(sub)).unwrap().filter_map(|e| e.ok()) {
                let m = e.metadata().unwrap();
                if m.is_file() {
                    total += m.len().div_ceil(4096) * 4096;
                }
            }
        }
        total
    };
    if mount_tmpfs(&save, &format!("size={}", ckpt_bytes * 3 / 2 + 16384)) {
        let mut row = Row::new(
            "disk full: a tmpfs of 1.5 checkpoints (ENOSPC) at a checkpoint write",
            test,
        );
        start(&save, &logs);
        let s = save.clone();
        let notes = fail_then_resume(
            &model,
            &train,
            &save,
            &logs,
            |c| c,
            &format!("{}/.tmp-iter_0000004", save.display()),
            move || {
                // Room again (a user freeing space), then the resume.
                let _ = Command::new("mount")
                    .args(["-o", "remount,size=64m", s.to_str().unwrap()])
                    .status();
            },
        );
        umount(&save);
        row.add("tmpfs", Diff::default(), notes);
        rows.push(row);
    } else {
        eprintln!("not root or no mount(8) here: the tmpfs disk-full case did not run (RLIMIT_FSIZE did)");
    }

    // Read-only: chmod 0555 (not root), or a read-only tmpfs over it (root, whom modes do not stop).
    let mut row = Row::new(
        "read-only --save (a fresh run; a restart after a checkpoint): refused at start, naming it",
        test,
    );
    let ro = dir.path().join("ro");
    std::fs::create_dir_all(&ro).unwrap();
    let mounted = is_root() && mount_tmpfs(&ro, "ro,size=64k");
    if !is_root() {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o555)).unwrap();
    }
    if is_root() && !mounted {
        eprintln!("root without mount(8): the read-only case cannot be made here");
    } else {
        let logs = dir.path().join("ro-logs");
        let mut f = flags(&model, &train, &ro, 2);
        f.extend(["--log-dir".to_string(), logs.to_str().unwrap().to_string()]);
        let out = Command::new(bin()).args(&f).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        let mut notes = Vec::new();
        if out.status.success() || out.status.signal().is_some() || stderr.contains("panicked") {
            notes.push(format!("not a clean error ({}): {stderr}", out.status));
        }
        if !stderr.contains(&ro.display().to_string()) {
            notes.push(format!("the error does not name {}: {stderr}", ro.display()));
        }
        eprintln!("read-only: {}", stderr.trim().lines().last().unwrap_or(""));
        if !stderr.contains("not writable") || logs.join("metrics.jsonl").exists() {
            notes.push(format!("not refused before the first rollout: {stderr}"));
        }
        if mounted {
            umount(&ro);
        }
        row.add("ro at start", Diff::default(), notes);
    }
    // Read-only for the restart after the step-2 checkpoint (a remount, or the folder's mode).
    let (save, logs) = (dir.path().join("ro2"), dir.path().join("ro2-logs"));
    std::fs::create_dir_all(&save).unwrap();
    let tmpfs = is_root() && mount_tmpfs(&save, "size=16m");
    if is_root() && !tmpfs {
        eprintln!("root without mount(8): the read-only-after-a-checkpoint case cannot be made here");
    } else {
        start(&save, &logs);
        let s = save.clone();
        let make_ro = move || {
            if tmpfs {
                assert!(Command::new("mount")
                    .args(["-o", "remount,ro", s.to_str().unwrap()])
                    .status()
                    .unwrap()
                    .success());
            } else {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(&s, std::fs::Permissions::from_mode(0o555)).unwrap();
            }
        };
        make_ro();
        let s = save.clone();
        let notes = fail_then_resume(
            &model,
            &train,
            &save,
            &logs,
            |c| c,
            &format!("--save {} is not writable", save.display()),
            move || {
                if tmpfs {
                    let _ = Command::new("mount")
                        .args(["-o", "remount,rw", s.to_str().unwrap()])
                        .status();
                } else {
                    use std::os::unix::fs::PermissionsExt;
                    std::fs::set_permissions(&s, std::fs::Permissions::from_mode(0o755)).unwrap();
                }
            },
        );
        if tmpfs {
            umount(&save);
        }
        row.add("ro after step 2", Diff::default(), notes);
    }
    rows.push(row);
    report(&rows);
}
