//! `vime_trainer::rl` against slime's formulas: every case of tests/fixtures/rl (written by
//! tests/fixtures/gen_rl_fixtures.py, a torch transcription of slime v0.3.1 @ 624b824a that the
//! script cross-checks against slime's own functions) must match to 1e-6 (f64 reference) and 1e-5
//! (f32 reference) norm-wise relative error: advantages, returns and KL; losses, slime's metrics,
//! `num_tokens`, and the gradients of the loss w.r.t. log-probs, entropy and values.
use candle_core::{DType, Device, Tensor, Var};
use serde::Deserialize;
use std::collections::HashMap;
use std::path::PathBuf;
use vime_kernels::testing::rel_err;
use vime_trainer::rl::*;

#[derive(Debug, Deserialize)]
struct Meta {
    input_sets: HashMap<String, InputSet>,
    cases: Vec<Case>,
}

#[derive(Debug, Deserialize)]
struct InputSet {
    cu_seqlens: Vec<usize>,
}

#[derive(Debug, Deserialize)]
struct Case {
    name: String,
    kind: String,
    inputs: String,
    args: serde_json::Value,
    n_samples_per_prompt: usize,
    rollout_batch_size: usize,
    old_log_probs: bool,
    rollout_log_probs: bool,
    sample_denoms: Option<Vec<f64>>,
    metrics: Vec<String>,
}

struct Fixtures {
    meta: Meta,
    /// (dtype, tolerance, tensors)
    refs: Vec<(DType, f64, HashMap<String, Tensor>)>,
}

fn fixtures() -> Fixtures {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/rl");
    let meta_path = dir.join("cases.json");
    let text = std::fs::read_to_string(&meta_path).unwrap_or_else(|e| panic!("{}: {e}", meta_path.display()));
    let meta: Meta = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", meta_path.display()));
    let load =
        |f: &str| candle_core::safetensors::load(dir.join(f), &Device::Cpu).unwrap_or_else(|e| panic!("{f}: {e}"));
    Fixtures {
        meta,
        refs: vec![
            (DType::F64, 1e-6, load("rl_f64.safetensors")),
            (DType::F32, 1e-5, load("rl_f32.safetensors")),
        ],
    }
}

/// The case's args as vime's `RlArgs`; every key the generator wrote must be a field of `RlArgs`
/// (they are slime's flag names), so a misspelt field fails here rather than being defaulted.
fn rl_args(case: &Case) -> RlArgs {
    let args: RlArgs = serde_json::from_value(case.args.clone()).unwrap_or_else(|e| panic!("{}: args: {e}", case.name));
    let ours = serde_json::to_value(&args).unwrap();
    for key in case.args.as_object().unwrap().keys() {
        assert!(
            ours.get(key).is_some(),
            "{}: fixture arg `{key}` is not an RlArgs field",
            case.name
        );
    }
    args.validate().unwrap_or_else(|e| panic!("{}: {e}", case.name));
    args
}

fn get<'a>(t: &'a HashMap<String, Tensor>, name: &str) -> &'a Tensor {
    t.get(name).unwrap_or_else(|| panic!("fixture tensor `{name}` missing"))
}

fn host(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64).unwrap().to_vec1().unwrap()
}

/// Compares and records a failure message naming the case, the quantity and the dtype; the worst
/// error seen per dtype is kept for the report.
fn check(failures: &mut Vec<String>, what: &str, dtype: DType, tol: f64, ours: &Tensor, reference: &Tensor) {
    match rel_err(ours, reference) {
        Ok(e) => {
            let mut worst = WORST.lock().unwrap();
            let slot = worst.entry(format!("{dtype:?}")).or_insert((0.0, String::new()));
            if e > slot.0 {
                *slot = (e, what.to_string());
            }
            if e > tol || e.is_nan() {
                failures.push(format!("{what} [{dtype:?}]: rel err {e:.3e} > {tol:.0e}"));
            }
        }
        Err(e) => failures.push(format!("{what} [{dtype:?}]: {e}")),
    }
}

static WORST: std::sync::Mutex<std::collections::BTreeMap<String, (f64, String)>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

fn scalar_tensor(x: f64) -> Tensor {
    Tensor::new(&[x], &Device::Cpu).unwrap()
}

fn finish(kind: &str, ran: usize, failures: Vec<String>) {
    assert!(ran > 0, "no {kind} cases in the fixtures");
    assert!(
        failures.is_empty(),
        "{} {kind} mismatch(es):\n{}",
        failures.len(),
        failures.join("\n")
    );
    eprintln!(
        "{kind}: {ran} case x dtype runs match; worst so far {:?}",
        WORST.lock().unwrap()
    );
}

#[test]
fn advantages_match_slime() {
    let fx = fixtures();
    let mut failures = Vec::new();
    let mut ran = 0;
    for case in fx.meta.cases.iter().filter(|c| c.kind == "advantages") {
        let args = rl_args(case);
        let cu = &fx.meta.input_sets[&case.inputs].cu_seqlens;
        for (dtype, tol, t) in &fx.refs {
            let input = |x: &str| host(get(t, &format!("inputs.{}.{x}", case.inputs)));
            let (raw, mask) = (input("raw_rewards"), input("loss_mask"));
            let (lp, rp, values) = (input("log_probs"), input("ref_log_probs"), input("values"));
            let rewards = post_process_rewards(&args, &raw, case.n_samples_per_prompt, case.rollout_batch_size)
                .unwrap_or_else(|e| panic!("{}: {e}", case.name));
            let inputs = AdvantageInputs {
                cu_seqlens: cu,
                rewards: &rewards,
                loss_mask: &mask,
                log_probs: Some(&lp),
                ref_log_probs: Some(&rp),
                values: Some(&values),
            };
            let out = compute_advantages_and_returns(&args, &inputs, &NoAllReduce)
                .unwrap_or_else(|e| panic!("{}: {e}", case.name));
            let vec = |v: &[f64]| Tensor::new(v, &Device::Cpu).unwrap();
            for (name, ours) in [
                ("rewards", &rewards),
                ("advantages", &out.advantages),
                ("returns", &out.returns),
                ("kl", &out.kl),
            ] {
                let reference = get(t, &format!("{}.{name}", case.name));
                check(
                    &mut failures,
                    &format!("{}.{name}", case.name),
                    *dtype,
                    *tol,
                    &vec(ours),
                    reference,
                );
            }
            ran += 1;
        }
    }
    finish("advantage", ran, failures);
}

#[test]
fn policy_losses_match_slime() {
    let fx = fixtures();
    let mut failures = Vec::new();
    let mut ran = 0;
    for case in fx.meta.cases.iter().filter(|c| c.kind == "policy_loss") {
        let args = rl_args(case);
        let cu = &fx.meta.input_sets[&case.inputs].cu_seqlens;
        for (dtype, tol, t) in &fx.refs {
            let input = |x: &str| get(t, &format!("inputs.{}.{x}", case.inputs)).clone();
            assert_eq!(input("log_probs").dtype(), *dtype, "{}", case.name);
            let from_device = LossReducer::new(
                cu,
                &input("loss_mask"),
                case.sample_denoms.as_deref(),
                args.calculate_per_token_loss,
            )
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
            // The trainer's reducer: the same mask given from the host (no device read between
            // a forward and its backward). It must reduce to the same bits as `new`'s, and the
            // case then runs on it against slime.
            let reducer = LossReducer::from_host_mask(
                cu,
                &host(&input("loss_mask")),
                *dtype,
                &Device::Cpu,
                case.sample_denoms.as_deref(),
                args.calculate_per_token_loss,
            )
            .unwrap_or_else(|e| panic!("{}: {e}", case.name));
            assert_eq!(reducer.num_tokens(), from_device.num_tokens(), "{}", case.name);
            for x in ["log_probs", "advantages", "entropy"] {
                let (a, b) = (
                    reducer.reduce(&input(x)).unwrap(),
                    from_device.reduce(&input(x)).unwrap(),
                );
                assert_eq!(
                    host(&a.reshape(1).unwrap()),
                    host(&b.reshape(1).unwrap()),
                    "{}: reduce({x})",
                    case.name
                );
            }
            let log_probs = Var::from_tensor(&input("log_probs")).unwrap();
            let entropy = Var::from_tensor(&input("entropy")).unwrap();
            let (advantages, old, rf, rollout) = (
                input("advantages"),
                input("old_log_probs"),
                input("ref_log_probs"),
                input("rollout_log_probs"),
            );
            let inputs = PolicyLossInputs {
                log_probs: log_probs.as_tensor(),
                entropy: entropy.as_tensor(),
                advantages: &advantages,
                old_log_probs: case.old_log_probs.then_some(&old),
                ref_log_probs: Some(&rf),
                rollout_log_probs: case.rollout_log_probs.then_some(&rollout),
            };
            let out = policy_loss(&args, &inputs, &reducer).unwrap_or_else(|e| panic!("{}: {e}", case.name));
            assert_eq!(
                out.loss.dtype(),
                *dtype,
                "{}: the loss must stay in the inputs' dtype",
                case.name
            );
            let grads = out.loss.backward().unwrap();
            let grad = |v: &Var| {
                grads
                    .get(v.as_tensor())
                    .cloned()
                    .unwrap_or_else(|| v.as_tensor().zeros_like().unwrap())
            };
            let what = |x: &str| format!("{}.{x}", case.name);
            check(
                &mut failures,
                &what("loss"),
                *dtype,
                *tol,
                &out.loss.reshape(1).unwrap(),
                get(t, &what("loss")),
            );
            check(
                &mut failures,
                &what("grad.log_probs"),
                *dtype,
                *tol,
                &grad(&log_probs),
                get(t, &what("grad.log_probs")),
            );
            check(
                &mut failures,
                &what("grad.entropy"),
                *dtype,
                *tol,
                &grad(&entropy),
                get(t, &what("grad.entropy")),
            );
            check_metrics(
                &mut failures,
                case,
                *dtype,
                *tol,
                t,
                &out.read_metrics().unwrap(),
                reducer.num_tokens(),
            );
            ran += 1;
        }
    }
    finish("policy loss", ran, failures);
}

#[test]
fn value_losses_match_slime() {
    let fx = fixtures();
    let mut failures = Vec::new();
    let mut ran = 0;
    for case in fx.meta.cases.iter().filter(|c| c.kind == "value_loss") {
        let args = rl_args(case);
        let cu = &fx.meta.input_sets[&case.inputs].cu_seqlens;
        for (dtype, tol, t) in &fx.refs {
            let input = |x: &str| get(t, &format!("inputs.{}.{x}", case.inputs)).clone();
            let reducer = LossReducer::new(cu, &input("loss_mask"), None, args.calculate_per_token_loss).unwrap();
            let values = Var::from_tensor(&input("values")).unwrap();
            let (old_values, returns) = (input("old_values"), input("returns"));
            let inputs = ValueLossInputs {
                values: values.as_tensor(),
                old_values: &old_values,
                returns: &returns,
            };
            let out = value_loss(&args, &inputs, &reducer).unwrap_or_else(|e| panic!("{}: {e}", case.name));
            let grads = out.loss.backward().unwrap();
            let g = grads
                .get(values.as_tensor())
                .cloned()
                .unwrap_or_else(|| values.zeros_like().unwrap());
            let what = |x: &str| format!("{}.{x}", case.name);
            check(
                &mut failures,
                &what("loss"),
                *dtype,
                *tol,
                &out.loss.reshape(1).unwrap(),
                get(t, &what("loss")),
            );
            check(
                &mut failures,
                &what("grad.values"),
                *dtype,
                *tol,
                &g,
                get(t, &what("grad.values")),
            );
            check_metrics(
                &mut failures,
                case,
                *dtype,
                *tol,
                t,
                &out.read_metrics().unwrap(),
                reducer.num_tokens(),
            );
            ran += 1;
        }
    }
    finish("value loss", ran, failures);
}

fn check_metrics(
    failures: &mut Vec<String>,
    case: &Case,
    dtype: DType,
    tol: f64,
    t: &HashMap<String, Tensor>,
    metrics: &std::collections::BTreeMap<String, f64>,
    num_tokens: f64,
) {
    let ours: Vec<&String> = metrics.keys().collect();
    let theirs: Vec<&String> = case.metrics.iter().collect();
    if ours != theirs {
        failures.push(format!("{}: metric keys {ours:?}, slime reports {theirs:?}", case.name));
    }
    for key in &case.metrics {
        let what = format!("{}.metric.{key}", case.name);
        match metrics.get(key) {
            Some(&v) => check(failures, &what, dtype, tol, &scalar_tensor(v), get(t, &what)),
            None => failures.push(format!("{what}: missing")),
        }
    }
    let what = format!("{}.num_tokens", case.name);
    check(failures, &what, dtype, tol, &scalar_tensor(num_tokens), get(t, &what));
}

/// Whitening over two data-parallel "ranks", each all-reducing its sums with the other's, equals
/// whitening the whole batch: the interface a real DP all-reduce plugs into.
#[test]
fn whitening_all_reduce_spans_ranks() {
    let fx = fixtures();
    let (_, _, t) = &fx.refs[0];
    let adv = host(get(t, "inputs.base.advantages"));
    let mask = host(get(t, "inputs.base.loss_mask"));
    let whole = masked_whiten(&adv, &mask, &NoAllReduce).unwrap();
    let cut = 17;
    let local_stats = |a: &[f64], m: &[f64]| -> [f64; 3] {
        let mut s = [0.0; 3];
        for (&x, &w) in a.iter().zip(m) {
            s[0] += x * w;
            s[1] += x * x * w;
            s[2] += w;
        }
        s
    };
    let (left_stats, right_stats) = (
        local_stats(&adv[..cut], &mask[..cut]),
        local_stats(&adv[cut..], &mask[cut..]),
    );
    let add = |other: [f64; 3]| {
        move |v: &mut [f64]| -> anyhow::Result<()> {
            for (x, o) in v.iter_mut().zip(other) {
                *x += o;
            }
            Ok(())
        }
    };
    let mut split = masked_whiten(&adv[..cut], &mask[..cut], &add(right_stats)).unwrap();
    split.extend(masked_whiten(&adv[cut..], &mask[cut..], &add(left_stats)).unwrap());
    for (a, b) in split.iter().zip(&whole) {
        assert!(
            (a - b).abs() <= 1e-12 * b.abs().max(1.0),
            "split whitening {a} != whole {b}"
        );
    }
    // And the whole-batch whitening is the fixture's (adv_grpo_whiten whitens GRPO advantages, so
    // check the statistics directly): masked mean 0 and masked unbiased variance ~1.
    let n: f64 = mask.iter().sum();
    let mean = whole.iter().zip(&mask).map(|(a, m)| a * m).sum::<f64>() / n;
    let var = whole
        .iter()
        .zip(&mask)
        .map(|(a, m)| (a - mean).powi(2) * m)
        .sum::<f64>()
        / (n - 1.0);
    assert!(mean.abs() < 1e-12 && (var - 1.0).abs() < 1e-6, "mean {mean}, var {var}");
}

#[test]
fn rl_args_follow_slime_flags_and_defaults() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        rl: RlArgs,
    }
    let d = Cli::parse_from(["vime"]).rl;
    assert_eq!(d, RlArgs::default(), "clap defaults must equal RlArgs::default()");
    assert_eq!(d.advantage_estimator, AdvantageEstimator::Grpo);
    assert_eq!(
        (d.eps_clip, d.eps_clip_high, d.eps_clip_high_resolved()),
        (0.2, None, 0.2)
    );
    assert_eq!((d.gamma, d.lambd, d.kl_coef, d.value_clip), (1.0, 1.0, 0.0, 0.2));
    assert_eq!((d.tis_clip, d.tis_clip_low, d.kl_loss_type), (2.0, 0.0, KlType::K1));
    let empty: RlArgs = serde_json::from_str("{}").unwrap();
    assert_eq!(empty, d, "serde defaults must equal RlArgs::default()");
    let warm = Cli::parse_from(["vime", "--num-critic-only-steps", "2"]).rl;
    assert_eq!(
        (0..4).map(|r| warm.train_actor(r)).collect::<Vec<_>>(),
        [false, false, true, true]
    );
    assert!(d.train_actor(0), "no critic-only warm-up by default");

    let a = Cli::parse_from([
        "vime",
        "--advantage-estimator",
        "reinforce_plus_plus_baseline",
        "--kl-loss-type",
        "low_var_kl",
        "--eps-clip-high",
        "0.28",
        "--eps-clip-c",
        "3",
        "--disable-grpo-std-normalization",
        "--normalize-advantages",
        "--use-tis",
        "--calculate-per-token-loss",
    ])
    .rl;
    assert_eq!(a.advantage_estimator, AdvantageEstimator::ReinforcePlusPlusBaseline);
    assert_eq!(a.kl_loss_type, KlType::LowVarKl);
    assert_eq!((a.eps_clip_high_resolved(), a.eps_clip_c), (0.28, Some(3.0)));
    assert!(a.disable_grpo_std_normalization && a.normalize_advantages && a.use_tis && a.calculate_per_token_loss);
    a.validate().unwrap();
    let json = serde_json::to_value(&a).unwrap();
    assert_eq!(json["advantage_estimator"], "reinforce_plus_plus_baseline");
    assert_eq!(json["kl_loss_type"], "low_var_kl");
    assert_eq!(serde_json::from_value::<RlArgs>(json).unwrap(), a);

    // slime's argument checks.
    let bad = |f: &dyn Fn(&mut RlArgs)| {
        let mut x = RlArgs::default();
        f(&mut x);
        x.validate().is_err()
    };
    assert!(bad(&|x| {
        x.kl_coef = 0.1;
        x.kl_loss_coef = 0.1;
    }));
    assert!(bad(&|x| x.advantage_estimator = AdvantageEstimator::ReinforcePlusPlus));
    assert!(bad(&|x| x.eps_clip_c = Some(1.0)));
}

/// Errors a user can act on, instead of NaNs or silent defaults.
#[test]
fn bad_inputs_are_reported() {
    let grpo = RlArgs::default();
    let e = post_process_rewards(&grpo, &[1.0, 0.0], 1, 2).unwrap_err().to_string();
    assert!(e.contains("groups of at least 2"), "{e}");
    let cu = [0, 2, 4];
    let mask = [1.0, 1.0, 0.0, 0.0];
    let rpp = RlArgs {
        advantage_estimator: AdvantageEstimator::ReinforcePlusPlus,
        normalize_advantages: true,
        ..RlArgs::default()
    };
    let inputs = AdvantageInputs {
        cu_seqlens: &cu,
        rewards: &[1.0, 0.0],
        loss_mask: &mask,
        log_probs: None,
        ref_log_probs: None,
        values: None,
    };
    let e = compute_advantages_and_returns(&rpp, &inputs, &NoAllReduce)
        .unwrap_err()
        .to_string();
    assert!(e.contains("sample 1 has no unmasked token"), "{e}");
    let ppo = RlArgs {
        advantage_estimator: AdvantageEstimator::Ppo,
        ..RlArgs::default()
    };
    let e = compute_advantages_and_returns(&ppo, &inputs, &NoAllReduce)
        .unwrap_err()
        .to_string();
    assert!(e.contains("critic"), "{e}");
    let e = masked_whiten(&[1.0, 2.0], &[0.0, 0.0], &NoAllReduce)
        .unwrap_err()
        .to_string();
    assert!(e.contains("empty"), "{e}");

    let dev = Device::Cpu;
    let mask_t = Tensor::new(&[1f32, 1., 1., 0.], &dev).unwrap();
    let e = LossReducer::new(&[0, 3], &mask_t, None, false).unwrap_err().to_string();
    assert!(e.contains("loss_mask has shape [4]"), "{e}");
    let e = LossReducer::from_host_mask(&[0, 3], &[1.0, 1.0], DType::F32, &dev, None, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("loss_mask has 2 values, cu_seqlens says [3]"), "{e}");
    let e = LossReducer::from_host_mask(&[1, 3], &[1.0, 1.0], DType::F32, &dev, None, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("cu_seqlens must start at 0"), "{e}");
    let reducer = LossReducer::new(&cu, &mask_t, None, false).unwrap();
    let x = Tensor::new(&[0.1f32, 0.2, 0.3, 0.4], &dev).unwrap();
    let x64 = x.to_dtype(DType::F64).unwrap();
    let tis = RlArgs {
        use_tis: true,
        ..RlArgs::default()
    };
    let ok = PolicyLossInputs {
        log_probs: &x,
        entropy: &x,
        advantages: &x,
        old_log_probs: None,
        ref_log_probs: None,
        rollout_log_probs: None,
    };
    let e = policy_loss(&tis, &ok, &reducer).unwrap_err().to_string();
    assert!(e.contains("use_tis needs the rollout engine's log-probs"), "{e}");
    let mixed = PolicyLossInputs { advantages: &x64, ..ok };
    let e = policy_loss(&grpo, &mixed, &reducer).unwrap_err().to_string();
    assert!(e.contains("advantages is F64"), "{e}");
}
