//! Memory stays flat over a long CPU run (issue 22). A GRPO run of the CPU demo's arithmetic task
//! (1-layer model of 9.8k parameters, 4 prompts x 2 samples, 2 optimizer steps per rollout) runs in
//! this process for `--rollouts` rollouts, with a checkpoint and an eval every 100 rollouts and the
//! metrics, TensorBoard file and PNG curves written after every one, as a real run does. A sampler
//! thread watches `metrics.jsonl`: at every new line (one per rollout) it records the process's
//! RSS (`/proc/self/statm`), its live heap bytes and the heap's high-water mark since the previous
//! line (the counting allocator of `common`, exact).
//!
//! Verdict: the least-squares slope of both over the last 90 % of the rollouts (the first 10 %
//! warm the allocator and the caches), in bytes per rollout, and the growth it extrapolates to.
//!
//!   cargo bench --bench memory_flat                                  (1000 rollouts)
//!   cargo bench --bench memory_flat -- --rollouts 200 --out /tmp/rss.csv
mod common;

use anyhow::{Context, Result};
use common::{arg, num, LIVE, PEAK};
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;
use vime_trainer::demo::{make_task, MakeTaskArgs, TaskKind};
use vime_trainer::train::{run, TrainArgs};

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// Slope (per x) of the least-squares line through `(x, y)`.
fn slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    let (mx, my) = (
        points.iter().map(|p| p.0).sum::<f64>() / n,
        points.iter().map(|p| p.1).sum::<f64>() / n,
    );
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    sxy / sxx
}

struct Sample {
    step: u64,
    secs: f64,
    rss: u64,
    live: u64,
    /// The most live heap bytes during this rollout.
    peak: u64,
}

/// Records a sample at every new line of `path` until `stop`.
fn watch(path: &Path, stop: &AtomicBool, t0: Instant) -> Vec<Sample> {
    let mut samples = Vec::with_capacity(4096);
    let (mut offset, mut lines) = (0u64, 0u64);
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let done = stop.load(Ordering::SeqCst);
        if let Ok(mut f) = std::fs::File::open(path) {
            if f.seek(SeekFrom::Start(offset)).is_ok() {
                while let Ok(n) = f.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    offset += n as u64;
                    for _ in buf[..n].iter().filter(|&&b| b == b'\n') {
                        lines += 1;
                        let live = LIVE.load(Ordering::Relaxed);
                        samples.push(Sample {
                            step: lines,
                            secs: t0.elapsed().as_secs_f64(),
                            rss: rss_bytes(),
                            live: live as u64,
                            peak: PEAK.swap(live, Ordering::Relaxed) as u64,
                        });
                    }
                }
            }
        }
        if done {
            return samples;
        }
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
}

fn main() -> Result<()> {
    let rollouts = num("--rollouts", 1000) as u64;
    let out = arg("--out").unwrap_or_else(|| "target/memory_flat.csv".into());
    let dir = tempfile::tempdir()?;
    let made = make_task(&MakeTaskArgs {
        task: TaskKind::Arith,
        out: dir.path().join("task"),
        min_len: 2,
        max_len: 4,
        min_digits: 1,
        max_digits: 2,
        ops: "+".into(),
        n_train: 400,
        n_eval: 8,
        seed: 3,
        hidden_size: 32,
        intermediate_size: 64,
        num_hidden_layers: 1,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        head_dim: 16,
    })?;
    let save = dir.path().join("run");
    let flags: Vec<String> = [
        "--hf-checkpoint",
        made.model_dir.to_str().unwrap(),
        "--prompt-data",
        made.files.train.to_str().unwrap(),
        "--label-key",
        "label",
        "--rollout-shuffle",
        "--rollout-batch-size",
        "4",
        "--n-samples-per-prompt",
        "2",
        "--num-steps-per-rollout",
        "2",
        "--num-rollout",
        &rollouts.to_string(),
        "--rollout-max-response-len",
        "4",
        "--rm-type",
        "exact_match",
        "--lr",
        "3e-3",
        "--entropy-coef",
        "0.01",
        "--max-tokens-per-gpu",
        "64",
        "--eval-prompt-data",
        "arith",
        made.files.eval.to_str().unwrap(),
        "--eval-interval",
        "100",
        "--skip-eval-before-train",
        "--save",
        save.to_str().unwrap(),
        "--save-interval",
        "100",
        "--no-progress",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let args = TrainArgs::from_flags(&flags)?;

    let stop = Arc::new(AtomicBool::new(false));
    let t0 = Instant::now();
    let sampler = {
        let (path, stop) = (save.join("metrics.jsonl"), stop.clone());
        std::thread::spawn(move || watch(&path, &stop, t0))
    };
    let before = (rss_bytes(), LIVE.load(Ordering::Relaxed) as u64);
    let summary = run(&args)?;
    stop.store(true, Ordering::SeqCst);
    let samples = sampler.join().expect("sampler thread");
    anyhow::ensure!(
        summary.final_step == rollouts,
        "the run stopped at {}",
        summary.final_step
    );
    anyhow::ensure!(
        samples.len() as u64 == rollouts,
        "{} samples for {rollouts} rollouts",
        samples.len()
    );

    let mut csv = String::from("step,seconds,rss_bytes,live_heap_bytes,step_peak_heap_bytes\n");
    for s in &samples {
        csv.push_str(&format!("{},{:.3},{},{},{}\n", s.step, s.secs, s.rss, s.live, s.peak));
    }
    std::fs::write(&out, csv).with_context(|| format!("writing {out}"))?;

    let tail: Vec<&Sample> = samples.iter().filter(|s| s.step > rollouts / 10).collect();
    let rss_slope = slope(&tail.iter().map(|s| (s.step as f64, s.rss as f64)).collect::<Vec<_>>());
    let live_slope = slope(&tail.iter().map(|s| (s.step as f64, s.live as f64)).collect::<Vec<_>>());
    let peak_slope = slope(&tail.iter().map(|s| (s.step as f64, s.peak as f64)).collect::<Vec<_>>());
    let mib = |b: f64| b / (1u64 << 20) as f64;
    let span = tail.len() as f64;
    let (first, last) = (tail.first().unwrap(), tail.last().unwrap());
    let max_rss = tail.iter().map(|s| s.rss).max().unwrap();
    let min_rss = tail.iter().map(|s| s.rss).min().unwrap();
    println!(
        "{rollouts} rollouts in {:.1} s; before the run: RSS {:.1} MiB, live heap {:.2} MiB",
        t0.elapsed().as_secs_f64(),
        mib(before.0 as f64),
        mib(before.1 as f64)
    );
    println!(
        "rollout {}: RSS {:.2} MiB, live heap {:.3} MiB; rollout {}: RSS {:.2} MiB, live heap {:.3} MiB",
        first.step,
        mib(first.rss as f64),
        mib(first.live as f64),
        last.step,
        mib(last.rss as f64),
        mib(last.live as f64)
    );
    println!(
        "over rollouts {}..={}: RSS min {:.2} / max {:.2} MiB",
        first.step,
        last.step,
        mib(min_rss as f64),
        mib(max_rss as f64)
    );
    println!(
        "slope over the last {span:.0} rollouts: RSS {rss_slope:.1} B/rollout ({:.3} MiB over them), \
         live heap {live_slope:.1} B/rollout ({:.3} MiB over them)",
        mib(rss_slope * span),
        mib(live_slope * span)
    );
    println!(
        "per-rollout heap high-water mark: {:.2} MiB at rollout {}, {:.2} MiB at rollout {}; slope {peak_slope:.1} B/rollout",
        mib(first.peak as f64),
        first.step,
        mib(last.peak as f64),
        last.step
    );
    println!("curve: {out}");
    Ok(())
}
