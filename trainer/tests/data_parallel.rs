//! Data parallelism with the ZeRO-1 optimizer, end to end: real `vime-train` processes started by
//! `--nproc-per-node N` (the launcher, the rendezvous and the CPU collectives backend all run).
//!
//! One GRPO step on the same rollout (rank 0 generates it with the same seeds at every DP size)
//! at DP = 1, 2 and 4: the loss, the gradient norm, every updated parameter and every tensor of
//! the optimizer state must match DP = 1. Data-parallel ranks sum their gradients in another
//! order than one rank accumulating all micro-batches, so the match is within f32
//! reduction-order error; the bounds are stated at each assertion. Then: resume across DP sizes,
//! and a rank that dies mid-step.
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};
use vime_trainer::demo::{make_task, MakeTaskArgs, TaskKind};
use vime_trainer::metrics::read_metrics;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_vime-train")
}

fn task(dir: &Path) -> (PathBuf, PathBuf) {
    task_of(TaskKind::Reverse, dir)
}

/// The task's model (4 heads, 2 KV heads, head_dim 16) and training prompts. The reverse task's
/// character vocabulary has 13 ids, the arithmetic task's 14 (it splits over TP 2).
fn task_of(kind: TaskKind, dir: &Path) -> (PathBuf, PathBuf) {
    let made = make_task(&MakeTaskArgs {
        task: kind,
        out: dir.to_path_buf(),
        min_len: 2,
        max_len: 5,
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
    (made.model_dir, made.files.train)
}

/// The task's random model after a short supervised warm-up (run at DP = 2, so the SFT path of
/// the data-parallel loop runs too): it gets some answers right, so GRPO's advantages are not all
/// zero and the policy-gradient term is part of the compared gradients.
fn warm_model(dir: &Path) -> (PathBuf, PathBuf) {
    let (model, train) = task(&dir.join("task"));
    let save = dir.join("warm");
    let f: Vec<String> = [
        "--hf-checkpoint",
        model.to_str().unwrap(),
        "--prompt-data",
        train.to_str().unwrap(),
        "--label-key",
        "label",
        "--loss-type",
        "sft",
        "--rollout-batch-size",
        "16",
        "--num-rollout",
        "40",
        "--lr",
        "1e-2",
        "--max-tokens-per-gpu",
        "64",
        "--save",
        save.to_str().unwrap(),
        "--save-interval",
        "40",
        "--no-progress",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    run(2, &f);
    (save.join("iter_0000040/hf"), train)
}

/// A GRPO run of `num_rollout` rollouts (16 samples each) in `steps` optimizer steps per rollout.
fn flags(model: &Path, train: &Path, save: &Path, num_rollout: u64, steps: usize) -> Vec<String> {
    [
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
        "--num-steps-per-rollout",
        &steps.to_string(),
        "--num-rollout",
        &num_rollout.to_string(),
        "--rollout-max-response-len",
        "6",
        "--rollout-temperature",
        "1.0",
        "--rm-type",
        "exact_match",
        "--lr",
        "1e-2",
        "--entropy-coef",
        "0.01",
        "--use-kl-loss",
        "--kl-loss-coef",
        "0.01",
        "--max-tokens-per-gpu",
        "40",
        "--save",
        save.to_str().unwrap(),
        "--save-interval",
        "1",
        "--load",
        save.to_str().unwrap(),
        "--no-progress",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn run(nproc: usize, flags: &[String]) -> std::process::Output {
    let mut cmd = Command::new(bin());
    if nproc > 1 {
        cmd.arg("--nproc-per-node").arg(nproc.to_string());
    }
    let out = cmd.args(flags).output().unwrap();
    assert!(
        out.status.success(),
        "vime-train (nproc {nproc}) failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn load(path: &Path) -> BTreeMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu)
        .unwrap()
        .into_iter()
        .collect()
}

/// `||a - b||_2 / ||a||_2` over one tensor (0 when both are zero), in f64.
fn rel_l2(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let b = b.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let norm = |t: &Tensor| t.sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap().sqrt();
    let d = norm(&(&a - &b).unwrap());
    if d == 0.0 {
        0.0
    } else {
        d / norm(&a).max(1e-300)
    }
}

/// Every tensor of `b` against `a` (same names and shapes): `rel_l2(a - base, b - base)` within
/// `tol` (with `base` the tensors before the step, so what is compared is the update, not the
/// weights it was added to; no base: the tensors themselves). Returns the worst value and how
/// many tensors were not bit-identical.
fn compare(
    what: &str,
    base: Option<&BTreeMap<String, Tensor>>,
    a: &BTreeMap<String, Tensor>,
    b: &BTreeMap<String, Tensor>,
    tol: impl Fn(&str) -> f64,
) -> (f64, usize) {
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "{what}: tensor names"
    );
    let (mut worst, mut inexact) = (0f64, 0usize);
    for (name, x) in a {
        let y = &b[name];
        assert_eq!(x.dims(), y.dims(), "{what}: {name} shape");
        let (x, y) = match base.map(|m| &m[name]) {
            Some(p) => ((x - p).unwrap(), (y - p).unwrap()),
            None => (x.clone(), y.clone()),
        };
        let r = rel_l2(&x, &y);
        let t = tol(name);
        assert!(r <= t, "{what}: {name} differs by {r:e} relative (L2; bound {t:e})");
        worst = worst.max(r);
        inexact += (r > 0.0) as usize;
    }
    (worst, inexact)
}

fn iter_dir(save: &Path, step: u64) -> PathBuf {
    save.join(format!("iter_{step:07}"))
}

fn metric(save: &Path, step: u64, key: &str) -> f64 {
    let lines = read_metrics(&save.join("metrics.jsonl")).unwrap();
    let (_, m) = lines.iter().find(|(s, _)| *s == step).unwrap();
    *m.get(key).unwrap_or_else(|| panic!("no {key} at step {step}"))
}

/// Step 1's `keys` of the run in `save` equal the baseline's within 1e-5, relative with a floor of
/// 1e-3: at the first step pg_loss and kl_loss are ~0 by construction (ratio 1, policy =
/// reference), whatever the gradients.
fn assert_metrics_match(label: &str, base: &Path, save: &Path, keys: &[&str]) {
    for key in keys {
        let (a, b) = (metric(base, 1, key), metric(save, 1, key));
        let err = (a - b).abs() / a.abs().max(1e-3);
        eprintln!("{label}: {key} {b:.9e} vs baseline {a:.9e} (error {err:.1e})");
        assert!(err <= 1e-5, "{label}: {key} {b} vs {a} (error {err:e}, bound 1e-5)");
    }
}

/// [`flags`] for one rollout of one step, plus `extra`.
fn flags_with(model: &Path, train: &Path, save: &Path, extra: &[&str]) -> Vec<String> {
    let mut f = flags(model, train, save, 1, 1);
    f.extend(extra.iter().map(|s| s.to_string()));
    f
}

// Bounds. DP = k sums its ranks' gradients in another order than one rank summing all
// micro-batches, so the reduced f32 gradients differ by summation-order rounding: relative
// ~1e-7 per element, more where a sum cancels. Adam's first moment is linear in the gradient
// and its second quadratic, so their relative L2 difference stays at that level: bound 1e-5.
// The weight update m / (sqrt(v) + eps) is scale-free: an element whose gradient is near eps
// (1e-8) after cancellation turns its rounding error into an O(lr) change, so the update (new
// weights minus the warm model's) is compared in relative L2 per tensor, bound 1e-3; measured
// values are printed. Loss terms and grad norm: 1e-5 relative.
fn state_tol(name: &str) -> f64 {
    if name.starts_with("master.") {
        1e-3
    } else {
        1e-5
    }
}

#[test]
fn dp2_and_dp4_match_dp1_per_parameter() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train) = warm_model(dir.path());
    let mut saves = Vec::new();
    for dp in [1usize, 2, 4] {
        let save = dir.path().join(format!("dp{dp}"));
        let t = Instant::now();
        // A rollout seed whose groups' rewards differ (checked below): the sampled tokens, so
        // this choice, change whenever the engine's sampler does.
        let mut f = flags(&model, &train, &save, 1, 1);
        f.extend(["--seed".to_string(), "3".to_string()]);
        run(dp, &f);
        eprintln!("dp {dp}: one rollout in {:.1} s", t.elapsed().as_secs_f64());
        saves.push((dp, save));
    }
    let (_, base) = &saves[0];
    let before = load(&model.join("model.safetensors"));
    let base_model = load(&iter_dir(base, 1).join("hf/model.safetensors"));
    let base_opt = load(&iter_dir(base, 1).join("optimizer.safetensors"));
    let before_master: BTreeMap<String, Tensor> =
        before.iter().map(|(k, v)| (format!("master.{k}"), v.clone())).collect();
    for (dp, save) in &saves[1..] {
        // Some prompt group must have rewards that differ, else every advantage is 0 and the
        // policy-gradient term (whose loss value is ~0 at the first step, ratio 1, whatever the
        // advantages) would contribute no gradient.
        let flat = metric(base, 1, "rollout/zero_std_groups");
        assert!(
            flat < 1.0,
            "every group's rewards are equal: no advantage signal, nothing tested"
        );
        assert_metrics_match(
            &format!("dp {dp}"),
            base,
            save,
            &[
                "train/loss",
                "train/pg_loss",
                "train/grad_norm",
                "train/kl_loss",
                "train/entropy_loss",
            ],
        );
        let (w, n) = compare(
            &format!("dp {dp} weight updates"),
            Some(&before),
            &base_model,
            &load(&iter_dir(save, 1).join("hf/model.safetensors")),
            |_| 1e-3,
        );
        eprintln!(
            "dp {dp}: weight updates within {w:.1e} (relative L2) of dp 1 ({n} of {} tensors not bit-identical)",
            base_model.len()
        );
        let opt = load(&iter_dir(save, 1).join("optimizer.safetensors"));
        let masters: BTreeMap<String, Tensor> = base_opt
            .iter()
            .filter(|(k, _)| k.starts_with("master."))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let moments: BTreeMap<String, Tensor> = base_opt
            .iter()
            .filter(|(k, _)| !k.starts_with("master."))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        let pick = |m: &BTreeMap<String, Tensor>, master: bool| -> BTreeMap<String, Tensor> {
            m.iter()
                .filter(|(k, _)| k.starts_with("master.") == master)
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        };
        let (o, n) = compare(
            &format!("dp {dp} masters"),
            Some(&before_master),
            &masters,
            &pick(&opt, true),
            state_tol,
        );
        eprintln!(
            "dp {dp}: master updates within {o:.1e} of dp 1 ({n} of {} not bit-identical)",
            masters.len()
        );
        let (o, n) = compare(
            &format!("dp {dp} moments"),
            None,
            &moments,
            &pick(&opt, false),
            state_tol,
        );
        eprintln!(
            "dp {dp}: Adam moments within {o:.1e} of dp 1 ({n} of {} not bit-identical)",
            moments.len()
        );
        let state = |root: &Path| -> serde_json::Value {
            serde_json::from_slice(&std::fs::read(iter_dir(root, 1).join("state.json")).unwrap()).unwrap()
        };
        assert_eq!(state(base), state(save), "dp {dp}: state.json");
    }
}

#[test]
fn a_checkpoint_resumes_at_another_dp_size() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train) = warm_model(dir.path());
    // The reference: 2 rollouts at DP = 2, a checkpoint after each.
    let straight = dir.path().join("straight");
    run(2, &flags(&model, &train, &straight, 2, 2));
    for (dp, exact) in [(2usize, true), (1, false), (4, false)] {
        let resumed = dir.path().join(format!("resumed-dp{dp}"));
        std::fs::create_dir_all(&resumed).unwrap();
        // The step-1 checkpoint of the DP = 2 run, as if the run had stopped there.
        let src = iter_dir(&straight, 1);
        copy_dir(&src, &iter_dir(&resumed, 1));
        std::fs::write(resumed.join("latest_checkpointed_iteration.txt"), "1").unwrap();
        std::fs::copy(straight.join("metrics.jsonl"), resumed.join("metrics.jsonl")).unwrap();
        let out = run(dp, &flags(&model, &train, &resumed, 2, 2));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("resuming from"), "{stderr}");
        let files = ["hf/model.safetensors", "optimizer.safetensors"];
        for f in files {
            let (a, b) = (
                load(&iter_dir(&straight, 2).join(f)),
                load(&iter_dir(&resumed, 2).join(f)),
            );
            if exact {
                // Same DP size: the same bits as the run that was never stopped.
                for (name, x) in &a {
                    let (x, y) = (x.flatten_all().unwrap(), b[name].flatten_all().unwrap());
                    let (x, y) = (x.to_vec1::<f32>().unwrap(), y.to_vec1::<f32>().unwrap());
                    assert!(
                        x.iter().zip(&y).all(|(p, q)| p.to_bits() == q.to_bits()),
                        "resumed at dp {dp}: {f}: {name} is not bit-identical"
                    );
                }
            } else {
                // Another DP size: its step-2 gradients are summed in another order (bounds as
                // above; the state it resumed from is the same bits, see trainer/tests/zero.rs).
                let (w, n) = compare(&format!("resumed at dp {dp}: {f}"), None, &a, &b, |_| 1e-5);
                eprintln!("resumed at dp {dp}: {f} within {w:.1e} (relative L2) of the dp 2 run ({n} tensors inexact)");
            }
        }
    }
}

/// `--fp8-recipe delayed` at DP 2: each rank keeps its own amax histories (its own samples), the
/// checkpoint holds both (gathered to rank 0), and a DP 2 run resumed from its step-1 checkpoint
/// ends on the bits of the run that was never stopped.
#[test]
fn fp8_delayed_scaling_histories_are_per_rank_and_resume_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train) = task(&dir.path().join("task"));
    let fp8 = ["--dtype", "bf16", "--fp8-format", "hybrid", "--fp8-recipe", "delayed"].map(String::from);
    let with = |save: &Path| -> Vec<String> {
        let mut f = flags(&model, &train, save, 2, 1);
        f.extend(fp8.iter().cloned());
        f
    };
    let straight = dir.path().join("straight");
    run(2, &with(&straight));
    let extra = load(&iter_dir(&straight, 1).join("extra.safetensors"));
    let (h0, h1) = (
        &extra["fp8_amax_history.policy.rank0"],
        &extra["fp8_amax_history.policy.rank1"],
    );
    // 2 layers x 11 roles, [pending, amax, h_0]: the ranks trained on different samples.
    assert_eq!((h0.dims(), h1.dims()), (&[22usize, 3][..], &[22usize, 3][..]));
    let (v0, v1) = (
        h0.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        h1.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
    );
    assert!(v0 != v1, "the two ranks' histories are the same: not per rank?");
    assert!(
        v0.iter().chain(&v1).skip(1).step_by(3).all(|a| *a > 0.0),
        "an amax of 0"
    );
    let resumed = dir.path().join("resumed");
    copy_dir(&iter_dir(&straight, 1), &iter_dir(&resumed, 1));
    std::fs::write(resumed.join("latest_checkpointed_iteration.txt"), "1").unwrap();
    std::fs::copy(straight.join("metrics.jsonl"), resumed.join("metrics.jsonl")).unwrap();
    let out = run(2, &with(&resumed));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("resuming from") && !stderr.contains("no FP8 amax history"),
        "{stderr}"
    );
    for f in ["hf/model.safetensors", "optimizer.safetensors", "extra.safetensors"] {
        let (a, b) = (
            std::fs::read(iter_dir(&straight, 2).join(f)).unwrap(),
            std::fs::read(iter_dir(&resumed, 2).join(f)).unwrap(),
        );
        assert!(a == b, "resumed at dp 2: {f} differs from the uninterrupted run's");
    }
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        let to = dst.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to);
        } else {
            std::fs::copy(e.path(), to).unwrap();
        }
    }
}

/// A rank that dies (abort) or fails with an error mid-step, while the others wait for it in a
/// collective: every rank exits, the run fails naming the rank, well within 30 s.
#[test]
fn a_rank_that_dies_mid_step_fails_the_run_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train) = task(&dir.path().join("task"));
    for (fault, rank) in [("abort-rank-1-in-step", 1), ("error-rank-2-in-step", 2)] {
        let save = dir.path().join(fault);
        let t = Instant::now();
        let out = Command::new(bin())
            .args(["--nproc-per-node", "3"])
            .args(flags(&model, &train, &save, 2, 2))
            .env("VIME_FAULT_INJECT", fault)
            .output()
            .unwrap();
        let secs = t.elapsed().as_secs_f64();
        let stderr = String::from_utf8_lossy(&out.stderr);
        eprintln!("{fault}: the run failed in {secs:.1} s:\n{stderr}");
        assert!(!out.status.success(), "{fault}: the run succeeded:\n{stderr}");
        assert!(
            stderr.contains(&format!("rank {rank}")),
            "{fault}: the errors do not name rank {rank}:\n{stderr}"
        );
        assert!(
            Duration::from_secs_f64(secs) < Duration::from_secs(30),
            "{fault}: took {secs:.1} s to fail (bound 30 s)"
        );
    }
}

/// Ctrl-C reaches every rank of `--nproc-per-node` (a terminal signals the whole foreground
/// process group): the ranks agree to stop at the same step, and the launcher exits 130 like a
/// single process; the metrics file holds every finished step once.
#[test]
fn ctrl_c_stops_every_rank_at_one_step() {
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let (model, train) = task(&dir.path().join("task"));
    let save = dir.path().join("run");
    let child = Command::new(bin())
        .args(["--nproc-per-node", "2"])
        .args(flags(&model, &train, &save, 400, 2))
        .process_group(0)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let latest = || {
        std::fs::read_to_string(save.join("latest_checkpointed_iteration.txt"))
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
    };
    let t = Instant::now();
    while latest().is_none_or(|s| s < 2) {
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "no step-2 checkpoint after 2 minutes"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let group = format!("-{}", child.id());
    assert!(Command::new("kill")
        .args(["-INT", "--", &group])
        .status()
        .unwrap()
        .success());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    assert!(stderr.contains("interrupted after step"), "{stderr}");
    let lines = read_metrics(&save.join("metrics.jsonl")).unwrap();
    let last = lines.last().unwrap().0;
    assert!((2..400).contains(&last), "stopped at step {last}");
    let steps: Vec<u64> = lines.iter().map(|(s, _)| *s).collect();
    assert_eq!(steps, (1..=last).collect::<Vec<_>>());
}

// ------------------------------------------------------------------------------------------
// tensor parallelism in the loop
// ------------------------------------------------------------------------------------------

/// One GRPO step (with the KL term, so the reference model is sharded too) at TP = 2 (2 processes),
/// and one PPO step (the critic sharded too) at TP = 2,
/// TP = 2 x DP = 2 (4 processes) and TP = 2 with sequence parallelism (micro-batches padded to
/// even token counts) against TP = 1, on the arithmetic task's model (vocabulary of
/// 14, 2 KV heads). Every rank loads the checkpoint and keeps its shard; the saved checkpoint and
/// optimizer state are gathered to global shapes, so they compare name for name, and resume at the
/// other TP size. Bounds as for DP (the TP sums run in another order as well). The random model
/// earns no reward here, so the compared gradient is the entropy term's (the log-prob path under
/// TP is compared per parameter in `models/qwen3/tests/tensor_parallel.rs`).
#[test]
fn tp2_and_tp2_dp2_match_tp1_per_parameter() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train) = task_of(TaskKind::Arith, &dir.path().join("task"));
    let flags_for = |save: &Path, extra: &[&str]| flags_with(&model, &train, save, extra);
    let base = dir.path().join("tp1");
    run(1, &flags_for(&base, &[]));
    let before = load(&model.join("model.safetensors"));
    let base_model = load(&iter_dir(&base, 1).join("hf/model.safetensors"));
    let base_opt = load(&iter_dir(&base, 1).join("optimizer.safetensors"));
    let before_master: BTreeMap<String, Tensor> =
        before.iter().map(|(k, v)| (format!("master.{k}"), v.clone())).collect();
    for (nproc, label, sp) in [
        (2usize, "tp 2", false),
        (4, "tp 2 x dp 2", false),
        (2, "tp 2 + sp (comm overlap)", true),
    ] {
        let save = dir.path().join(format!("tp2-{nproc}-{sp}"));
        let tp_flags: &[&str] = if sp {
            &["--tp", "2", "--sequence-parallel", "--tp-comm-overlap"]
        } else {
            &["--tp", "2"]
        };
        run(nproc, &flags_for(&save, tp_flags));
        assert_metrics_match(
            label,
            &base,
            &save,
            &["train/loss", "train/grad_norm", "train/entropy_loss", "train/kl_loss"],
        );
        let (w, _) = compare(
            &format!("{label} weight updates"),
            Some(&before),
            &base_model,
            &load(&iter_dir(&save, 1).join("hf/model.safetensors")),
            |_| 1e-3,
        );
        eprintln!("{label}: weight updates within {w:.1e} of tp 1");
        let opt = load(&iter_dir(&save, 1).join("optimizer.safetensors"));
        let split = |m: &BTreeMap<String, Tensor>, master: bool| -> BTreeMap<String, Tensor> {
            m.iter()
                .filter(|(k, _)| k.starts_with("master.") == master)
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        };
        compare(
            &format!("{label} masters"),
            Some(&before_master),
            &split(&base_opt, true),
            &split(&opt, true),
            state_tol,
        );
        compare(
            &format!("{label} moments"),
            None,
            &split(&base_opt, false),
            &split(&opt, false),
            state_tol,
        );
        // The checkpoint holds global shapes: it resumes at TP 1 (one more rollout).
        let mut more = flags_for(&save, &[]);
        let at = more.iter().position(|x| x == "--num-rollout").unwrap();
        more[at + 1] = "2".into();
        run(1, &more);
        assert!(
            iter_dir(&save, 2).join("optimizer.safetensors").is_file(),
            "{label}: no resumed step"
        );
    }
    // PPO: the critic (backbone sharded, value head replicated) and its optimizer too.
    let ppo_base = dir.path().join("ppo-tp1");
    run(1, &flags_for(&ppo_base, &["--advantage-estimator", "ppo"]));
    // TP 2, and TP 2 + SP (the value head fed every token).
    for (label, extra) in [
        ("ppo tp 2", &["--tp", "2"][..]),
        ("ppo tp 2 + sp", &["--tp", "2", "--sequence-parallel"][..]),
    ] {
        let ppo_tp2 = dir.path().join(label.replace(' ', "-"));
        let mut f = vec!["--advantage-estimator", "ppo"];
        f.extend_from_slice(extra);
        run(2, &flags_for(&ppo_tp2, &f));
        assert_metrics_match(
            label,
            &ppo_base,
            &ppo_tp2,
            &["train/grad_norm", "critic/grad_norm", "critic/value_loss"],
        );
        for (what, file) in [
            ("policy", "hf/model.safetensors"),
            ("critic", "critic/model.safetensors"),
        ] {
            let (w, _) = compare(
                &format!("{label} {what} weight updates"),
                Some(&before),
                &load(&iter_dir(&ppo_base, 1).join(file)),
                &load(&iter_dir(&ppo_tp2, 1).join(file)),
                |_| 1e-3,
            );
            eprintln!("{label}: {what} weight updates within {w:.1e} of tp 1");
        }
        let (a, b) = (
            load(&iter_dir(&ppo_base, 1).join("critic/value_head.safetensors")),
            load(&iter_dir(&ppo_tp2, 1).join("critic/value_head.safetensors")),
        );
        compare(&format!("{label} value head"), None, &a, &b, |_| 1e-4);
    }

    // And a TP 1 checkpoint resumes at TP 2.
    let mut more = flags_for(&base, &["--tp", "2"]);
    let at = more.iter().position(|x| x == "--num-rollout").unwrap();
    more[at + 1] = "2".into();
    run(2, &more);
    assert!(
        iter_dir(&base, 2).join("optimizer.safetensors").is_file(),
        "tp 1 -> 2: no resumed step"
    );
}

// ------------------------------------------------------------------------------------------
// context parallelism in the loop
// ------------------------------------------------------------------------------------------

/// One GRPO step (KL term on, so the reference scores under CP too) at CP = 2 and TP = 2 x CP = 2
/// (4 processes), and one PPO step at CP = 2 (the critic's values and value loss under CP), against
/// CP = 1 on the arithmetic task's model (CP 2 with full recompute keeping attention). Every sequence is cut into 2 x cp zigzag chunks (padded
/// to a multiple of 2 cp, x 2 under SP); scoring passes gather the chunks back, losses and metrics
/// and gradients are summed over CP. `--max-tokens-per-gpu 40` counts a rank's share, so CP 2
/// packs micro-batches of up to 80 tokens, and the sums still match. Bounds as for TP.
#[test]
fn cp2_and_tp2_by_cp2_match_cp1_per_parameter() {
    let dir = tempfile::tempdir().unwrap();
    let (model, train) = task_of(TaskKind::Arith, &dir.path().join("task"));
    let flags_for = |save: &Path, extra: &[&str]| flags_with(&model, &train, save, extra);
    let before = load(&model.join("model.safetensors"));
    let check = |label: &str, base: &Path, save: &Path, keys: &[&str], files: &[&str]| {
        assert_metrics_match(label, base, save, keys);
        for file in files {
            let (w, _) = compare(
                &format!("{label} {file}"),
                Some(&before),
                &load(&iter_dir(base, 1).join(file)),
                &load(&iter_dir(save, 1).join(file)),
                |_| 1e-3,
            );
            eprintln!("{label}: {file} updates within {w:.1e} of cp 1");
        }
    };
    let base = dir.path().join("cp1");
    run(1, &flags_for(&base, &[]));
    let grpo = ["train/loss", "train/grad_norm", "train/entropy_loss", "train/kl_loss"];
    for (nproc, label, extra) in [
        // With recompute whose layers keep their attention (the recompute skips the K/V gather).
        (
            2usize,
            "cp 2",
            &[
                "--cp",
                "2",
                "--recompute-granularity",
                "full",
                "--recompute-keep-attention",
            ][..],
        ),
        (4, "tp 2 x cp 2", &["--tp", "2", "--cp", "2"][..]),
        (
            4,
            "tp 2 x cp 2 + sp",
            &["--tp", "2", "--cp", "2", "--sequence-parallel"][..],
        ),
    ] {
        let save = dir.path().join(label.replace(' ', "-"));
        run(nproc, &flags_for(&save, extra));
        check(label, &base, &save, &grpo, &["hf/model.safetensors"]);
    }
    let ppo_base = dir.path().join("ppo-cp1");
    run(1, &flags_for(&ppo_base, &["--advantage-estimator", "ppo"]));
    let ppo = dir.path().join("ppo-cp2");
    run(2, &flags_for(&ppo, &["--advantage-estimator", "ppo", "--cp", "2"]));
    check(
        "ppo cp 2",
        &ppo_base,
        &ppo,
        &["train/grad_norm", "critic/grad_norm", "critic/value_loss"],
        &["hf/model.safetensors", "critic/model.safetensors"],
    );
    let (a, b) = (
        load(&iter_dir(&ppo_base, 1).join("critic/value_head.safetensors")),
        load(&iter_dir(&ppo, 1).join("critic/value_head.safetensors")),
    );
    compare("ppo cp 2 value head", None, &a, &b, |_| 1e-4);
}

/// What TP and CP cannot do yet, or cannot do with this model, is a clear error.
#[test]
fn tp_refusals_name_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let fail = |nproc: usize, model: &Path, train: &Path, extra: &[&str]| -> String {
        let f = flags_with(model, train, &dir.path().join("run"), extra);
        let out = Command::new(bin())
            .arg("--nproc-per-node")
            .arg(nproc.to_string())
            .args(&f)
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let (model, train) = task(&dir.path().join("task"));
    let e = fail(2, &model, &train, &["--tp", "2"]);
    assert!(
        e.contains("model.embed_tokens.weight") && e.contains("(13) is not divisible by the tensor-parallel size 2"),
        "{e}"
    );
    // TP 4 does not divide the arithmetic task's 14 ids: named, with both numbers.
    let (model, train) = task_of(TaskKind::Arith, &dir.path().join("arith"));
    let e = fail(4, &model, &train, &["--tp", "4"]);
    assert!(e.contains("(14) is not divisible by the tensor-parallel size 4"), "{e}");
    // GSPO's per-sample mean spans the CP ranks' chunks: refused under CP.
    let e = fail(2, &model, &train, &["--cp", "2", "--advantage-estimator", "gspo"]);
    assert!(e.contains("gspo with --context-parallel-size 2"), "{e}");
}
