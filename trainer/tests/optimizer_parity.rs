//! `vime_trainer::optim` against PyTorch and Megatron, plus its contracts.
//!
//! Golden fixtures come from `tests/fixtures/gen_optimizer_fixtures.py` (torch.optim.AdamW with
//! decay / no-decay groups, `clip_grad_norm_`, and a transcription of Megatron's LR schedule):
//! params and moments must match after every step to 1e-6 (norm-wise relative), grad norms to
//! 1e-6, LRs to 1e-12. The unit tests check weight-decay exclusion, bf16 models updated through the
//! f32 master, a bit-exact checkpoint round trip, and errors that name the tensor.
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use clap::Parser;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use vime_kernels::testing::{rel_err, Rng};
use vime_qwen3::config::Qwen3Config;
use vime_qwen3::state_dict::param_specs;
use vime_trainer::optim::{
    clip_grad_norm, global_grad_norm, megatron_weight_decay, AdamW, DistributedAdamW, GradAccumulator, LrDecayStyle,
    LrScheduler, NonFiniteGradNorm, OptimizerArgs, WsdDecayStyle,
};

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/optim")
}

#[derive(Deserialize)]
struct CaseMeta {
    args: OptimizerArgs,
    steps: usize,
    names: Vec<String>,
}

fn rel_scalar(a: f64, b: f64) -> f64 {
    if a == b {
        0.0
    } else {
        (a - b).abs() / b.abs().max(1e-300)
    }
}

fn run_parity_case(case: &str) -> Result<()> {
    let dir = fixture_dir();
    let meta: CaseMeta = serde_json::from_str(&std::fs::read_to_string(dir.join(format!("{case}.json")))?)?;
    let fx = candle_core::safetensors::load(dir.join(format!("{case}.safetensors")), &Device::Cpu)?;
    let t = |key: String| {
        fx.get(&key)
            .cloned()
            .ok_or_else(|| anyhow::anyhow!("{case}: fixture has no {key}"))
    };
    let params: Vec<(String, Var)> = meta
        .names
        .iter()
        .map(|n| Ok((n.clone(), Var::from_tensor(&t(format!("init.{n}"))?)?)))
        .collect::<Result<_>>()?;
    let mut opt = AdamW::new(&params, &meta.args)?;
    let sched = LrScheduler::new(&meta.args)?;
    let want_lr: Vec<f64> = t("lr".into())?.to_vec1()?;
    let want_norm: Vec<f32> = t("grad_norm".into())?.to_vec1()?;
    for k in 0..meta.steps {
        let mut grads: BTreeMap<String, Tensor> = meta
            .names
            .iter()
            .map(|n| Ok((n.clone(), t(format!("grad.{k}.{n}"))?)))
            .collect::<Result<_>>()?;
        let norm = clip_grad_norm(&mut grads, meta.args.clip_grad)?;
        let e = rel_scalar(norm, want_norm[k] as f64);
        assert!(
            e <= 1e-6,
            "{case} step {k}: grad norm {norm} vs torch {} (rel {e:e})",
            want_norm[k]
        );
        let lr = sched.lr_at(opt.num_steps());
        let e = rel_scalar(lr, want_lr[k]);
        assert!(
            e <= 1e-12,
            "{case} step {k}: lr {lr} vs Megatron {} (rel {e:e})",
            want_lr[k]
        );
        let stats = opt.step(&grads, lr)?;
        assert_eq!(stats.step, k as u64 + 1);
        let state = opt.state_tensors()?;
        for (n, var) in &params {
            for (what, got) in [
                ("param", var.as_tensor().clone()),
                ("exp_avg", state[&format!("exp_avg.{n}")].clone()),
                ("exp_avg_sq", state[&format!("exp_avg_sq.{n}")].clone()),
            ] {
                let e = rel_err(&got, &t(format!("{what}.{k}.{n}"))?)?;
                assert!(e <= 1e-6, "{case} step {k}: {what} of {n} differs from torch by {e:e}");
            }
        }
    }
    Ok(())
}

#[test]
fn adamw_clip_schedule_match_torch_warmup_cosine() -> Result<()> {
    run_parity_case("warmup_cosine")
}

#[test]
fn adamw_clip_schedule_match_torch_linear() -> Result<()> {
    run_parity_case("linear")
}

#[test]
fn lr_schedules_match_megatron() -> Result<()> {
    #[derive(Deserialize)]
    struct Row {
        args: OptimizerArgs,
        lrs: Vec<f64>,
    }
    let rows: Vec<Row> = serde_json::from_str(&std::fs::read_to_string(fixture_dir().join("schedules.json"))?)?;
    assert!(rows.len() >= 12);
    for row in &rows {
        let sched = LrScheduler::new(&row.args)?;
        for (k, &want) in row.lrs.iter().enumerate() {
            let got = sched.lr_at(k as u64);
            let e = rel_scalar(got, want);
            assert!(
                e <= 1e-12,
                "{:?}/{:?} step {k}: {got} vs Megatron {want}",
                row.args.lr_decay_style,
                row.args.lr_wsd_decay_style
            );
        }
    }
    Ok(())
}

#[test]
fn schedule_validation_names_the_flag() {
    let bad = |a: OptimizerArgs| LrScheduler::new(&a).unwrap_err().to_string();
    let base = OptimizerArgs::default();
    let e = bad(OptimizerArgs {
        lr_decay_style: LrDecayStyle::Cosine,
        ..base.clone()
    });
    assert!(e.contains("lr_decay_iters"), "{e}");
    let e = bad(OptimizerArgs {
        lr_decay_style: LrDecayStyle::Linear,
        lr_decay_iters: Some(5),
        lr_warmup_iters: 5,
        ..base.clone()
    });
    assert!(e.contains("lr_warmup_iters"), "{e}");
    let e = bad(OptimizerArgs {
        min_lr: 1e-3,
        ..base.clone()
    });
    assert!(e.contains("min_lr"), "{e}");
    let e = bad(OptimizerArgs {
        lr_decay_style: LrDecayStyle::Wsd,
        lr_decay_iters: Some(10),
        ..base.clone()
    });
    assert!(e.contains("lr_wsd_decay_iters"), "{e}");
    // Constant with warmup needs no decay length.
    let s = LrScheduler::new(&OptimizerArgs {
        lr: 1e-3,
        lr_warmup_iters: 2,
        ..base
    })
    .unwrap();
    assert_eq!(
        [s.lr_at(0), s.lr_at(1), s.lr_at(2), s.lr_at(1000)],
        [0.0, 5e-4, 1e-3, 1e-3]
    );
}

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    optim: OptimizerArgs,
}

#[test]
fn flags_keep_megatron_spellings_and_defaults_agree() -> Result<()> {
    let cli = Cli::try_parse_from(["vime-train"])?;
    assert_eq!(cli.optim, OptimizerArgs::default());
    let from_json: OptimizerArgs = serde_json::from_str("{}")?;
    assert_eq!(from_json, OptimizerArgs::default());
    let cli = Cli::try_parse_from([
        "vime-train",
        "--lr",
        "2e-6",
        "--min-lr",
        "1e-7",
        "--lr-decay-style",
        "WSD",
        "--lr-decay-iters",
        "100",
        "--lr-warmup-iters",
        "10",
        "--lr-warmup-init",
        "1e-8",
        "--lr-wsd-decay-iters",
        "20",
        "--lr-wsd-decay-style",
        "minus_sqrt",
        "--weight-decay",
        "0.1",
        "--adam-beta1",
        "0.8",
        "--adam-beta2",
        "0.98",
        "--adam-eps",
        "1e-6",
        "--clip-grad",
        "0",
    ])?;
    let a = cli.optim;
    assert_eq!((a.lr, a.min_lr, a.lr_warmup_init), (2e-6, 1e-7, 1e-8));
    assert_eq!(a.lr_decay_style, LrDecayStyle::Wsd);
    assert_eq!(a.lr_wsd_decay_style, WsdDecayStyle::MinusSqrt);
    assert_eq!(
        (a.lr_decay_iters, a.lr_warmup_iters, a.lr_wsd_decay_iters),
        (Some(100), 10, Some(20))
    );
    assert_eq!(
        (a.weight_decay, a.adam_beta1, a.adam_beta2, a.adam_eps, a.clip_grad),
        (0.1, 0.8, 0.98, 1e-6, 0.0)
    );
    a.validate()?;
    let json = serde_json::to_string(&a)?;
    assert!(
        json.contains("\"lr_decay_style\":\"WSD\"") && json.contains("\"minus_sqrt\""),
        "{json}"
    );
    assert_eq!(serde_json::from_str::<OptimizerArgs>(&json)?, a);
    Ok(())
}

#[test]
fn weight_decay_rule_matches_param_kind_for_qwen3() -> Result<()> {
    let mut cfg = Qwen3Config::preset("qwen3-8b")?;
    cfg.attention_bias = true;
    cfg.num_hidden_layers = 2;
    for spec in param_specs(&cfg) {
        assert_eq!(
            megatron_weight_decay(&spec.name, &spec.shape),
            spec.kind.default_weight_decay(),
            "{} {:?}",
            spec.name,
            spec.kind
        );
    }
    Ok(())
}

fn var(t: Tensor) -> Var {
    Var::from_tensor(&t).unwrap()
}

fn bits(t: &Tensor) -> Vec<u32> {
    let t = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    t.to_vec1::<f32>().unwrap().into_iter().map(f32::to_bits).collect()
}

#[test]
fn excluded_params_do_not_decay() -> Result<()> {
    let dev = Device::Cpu;
    let mut rng = Rng::new(7);
    let params = vec![
        (
            "model.norm.weight".to_string(),
            var(rng.randn(&[5], 1.0, DType::F32, &dev)?),
        ),
        (
            "model.layers.0.self_attn.q_proj.bias".to_string(),
            var(rng.randn(&[3], 1.0, DType::F32, &dev)?),
        ),
        (
            "model.layers.0.self_attn.q_proj.weight".to_string(),
            var(rng.randn(&[3, 5], 1.0, DType::F32, &dev)?),
        ),
    ];
    let before: Vec<Tensor> = params.iter().map(|(_, v)| v.as_tensor().copy().unwrap()).collect();
    let args = OptimizerArgs {
        weight_decay: 0.1,
        ..Default::default()
    };
    let mut opt = AdamW::new(&params, &args)?;
    assert_eq!(opt.weight_decay_of("model.norm.weight"), Some(false));
    assert_eq!(opt.weight_decay_of("model.layers.0.self_attn.q_proj.bias"), Some(false));
    assert_eq!(
        opt.weight_decay_of("model.layers.0.self_attn.q_proj.weight"),
        Some(true)
    );
    let zero_grads: BTreeMap<String, Tensor> = params
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().zeros_like().unwrap()))
        .collect();
    let (lr, steps) = (0.5, 3);
    for _ in 0..steps {
        opt.step(&zero_grads, lr)?;
    }
    // Zero gradient: Adam's update is 0 / (0 + eps) = 0, so only weight decay can move a weight.
    assert_eq!(bits(params[0].1.as_tensor()), bits(&before[0]), "norm weight moved");
    assert_eq!(bits(params[1].1.as_tensor()), bits(&before[1]), "bias moved");
    let f = (1.0 - lr * 0.1) as f32;
    let want: Vec<f32> = before[2]
        .flatten_all()?
        .to_vec1::<f32>()?
        .iter()
        .map(|x| x * f * f * f)
        .collect();
    let got: Vec<f32> = params[2].1.as_tensor().flatten_all()?.to_vec1()?;
    assert_eq!(got, want, "linear weight should shrink by (1 - lr * wd) per step");
    Ok(())
}

#[test]
fn bf16_model_is_updated_through_the_f32_master() -> Result<()> {
    let dev = Device::Cpu;
    let name = "model.layers.0.input_layernorm.weight";
    let p = var(Tensor::ones(4, DType::BF16, &dev)?);
    let params = vec![(name.to_string(), p.clone())];
    let mut opt = AdamW::new(&params, &OptimizerArgs::default())?;
    // A constant gradient makes every Adam update lr / (1 + eps): 1e-4, below bf16's half-ulp at 1.
    let grads = BTreeMap::from([(name.to_string(), Tensor::ones(4, DType::F32, &dev)?)]);
    let lr = 1e-4;
    for _ in 0..10 {
        opt.step(&grads, lr)?;
    }
    let master = opt.master(name).unwrap();
    assert_eq!(master.dtype(), DType::F32);
    let m: Vec<f32> = master.to_vec1()?;
    assert!(m.iter().all(|&x| (x - 0.999).abs() < 1e-6), "master {m:?}");
    assert_eq!(p.dtype(), DType::BF16);
    assert_eq!(
        p.as_tensor().to_dtype(DType::F32)?.to_vec1::<f32>()?,
        vec![1.0; 4],
        "bf16 rounds 0.999 to 1"
    );
    for _ in 0..20 {
        opt.step(&grads, lr)?;
    }
    let m: Vec<f32> = opt.master(name).unwrap().to_vec1()?;
    assert!(m.iter().all(|&x| (x - 0.997).abs() < 1e-6), "master {m:?}");
    // 0.997 is nearer 0.99609375 than 1.0 in bf16: the accumulated updates reached the model.
    assert_eq!(
        p.as_tensor().to_dtype(DType::F32)?.to_vec1::<f32>()?,
        vec![0.99609375; 4]
    );
    assert_eq!(
        bits(p.as_tensor()),
        bits(&opt.master(name).unwrap().to_dtype(DType::BF16)?)
    );
    Ok(())
}

/// A small model's parameters: two matrices, a norm, a bias.
fn toy_params(dtype: DType, seed: u64) -> Vec<(String, Var)> {
    let mut rng = Rng::new(seed);
    [
        ("model.embed_tokens.weight", vec![9, 4]),
        ("model.layers.0.mlp.up_proj.weight", vec![6, 4]),
        ("model.layers.0.post_attention_layernorm.weight", vec![4]),
        ("model.layers.0.self_attn.k_proj.bias", vec![6]),
    ]
    .into_iter()
    .map(|(n, s)| (n.to_string(), var(rng.randn(&s, 0.5, dtype, &Device::Cpu).unwrap())))
    .collect()
}

fn toy_grads(params: &[(String, Var)], rng: &mut Rng) -> BTreeMap<String, Tensor> {
    params
        .iter()
        .map(|(n, v)| (n.clone(), rng.randn(v.dims(), 0.3, DType::F32, &Device::Cpu).unwrap()))
        .collect()
}

fn resume_is_bit_exact(dtype: DType) -> Result<()> {
    let args = OptimizerArgs {
        lr: 1e-2,
        weight_decay: 0.1,
        clip_grad: 1.0,
        ..Default::default()
    };
    let (steps, split) = (6, 3);
    // Run A: straight through.
    let a_params = toy_params(dtype, 1);
    let mut a = AdamW::new(&a_params, &args)?;
    let mut rng = Rng::new(99);
    let all_grads: Vec<_> = (0..steps).map(|_| toy_grads(&a_params, &mut rng)).collect();
    let mut snapshot = None;
    for (k, g) in all_grads.iter().enumerate() {
        if k == split {
            snapshot = Some((a.state_tensors()?, a.num_steps(), {
                let m: BTreeMap<String, Tensor> = a_params
                    .iter()
                    .map(|(n, v)| (n.clone(), v.as_tensor().copy().unwrap()))
                    .collect();
                m
            }));
        }
        let mut g = g.clone();
        clip_grad_norm(&mut g, args.clip_grad)?;
        a.step(&g, 1e-2)?;
    }
    let (state, n, model) = snapshot.unwrap();
    let dir = tempfile::tempdir()?;
    candle_core::safetensors::save(&state.into_iter().collect(), dir.path().join("optim.safetensors"))?;
    candle_core::safetensors::save(&model.into_iter().collect(), dir.path().join("model.safetensors"))?;

    // Run B: a fresh process's view: model from its checkpoint, optimizer state loaded.
    let model = candle_core::safetensors::load(dir.path().join("model.safetensors"), &Device::Cpu)?;
    let b_params: Vec<(String, Var)> = a_params
        .iter()
        .map(|(name, _)| (name.clone(), var(model[name].clone())))
        .collect();
    let mut b = AdamW::new(&b_params, &args)?;
    let state: BTreeMap<String, Tensor> =
        candle_core::safetensors::load(dir.path().join("optim.safetensors"), &Device::Cpu)?
            .into_iter()
            .collect();
    b.load_state_tensors(&state, n)?;
    assert_eq!(b.num_steps(), split as u64);
    for g in &all_grads[split..] {
        let mut g = g.clone();
        clip_grad_norm(&mut g, args.clip_grad)?;
        b.step(&g, 1e-2)?;
    }
    let (sa, sb) = (a.state_tensors()?, b.state_tensors()?);
    assert_eq!(sa.keys().collect::<Vec<_>>(), sb.keys().collect::<Vec<_>>());
    for (k, t) in &sa {
        assert_eq!(t.dtype(), DType::F32, "{k}");
        assert_eq!(bits(t), bits(&sb[k]), "{dtype:?}: {k} differs after resume");
    }
    for ((n, va), (_, vb)) in a_params.iter().zip(&b_params) {
        assert_eq!(vb.dtype(), dtype);
        assert_eq!(
            bits(va.as_tensor()),
            bits(vb.as_tensor()),
            "{dtype:?}: model {n} differs after resume"
        );
    }
    assert_eq!(a.num_steps(), b.num_steps());
    Ok(())
}

#[test]
fn state_round_trip_is_bit_exact_bf16() -> Result<()> {
    resume_is_bit_exact(DType::BF16)
}

#[test]
fn state_round_trip_is_bit_exact_f32() -> Result<()> {
    resume_is_bit_exact(DType::F32)
}

#[test]
fn state_tensors_are_snapshots() -> Result<()> {
    let params = toy_params(DType::F32, 3);
    let mut opt = AdamW::new(&params, &OptimizerArgs::default())?;
    let mut rng = Rng::new(5);
    opt.step(&toy_grads(&params, &mut rng), 1e-2)?;
    let snap = opt.state_tensors()?;
    let before: BTreeMap<&String, Vec<u32>> = snap.iter().map(|(k, t)| (k, bits(t))).collect();
    opt.step(&toy_grads(&params, &mut rng), 1e-2)?;
    for (k, t) in &snap {
        assert_eq!(bits(t), before[k], "{k} changed under a later step");
    }
    Ok(())
}

fn err_of<T: std::fmt::Debug>(r: Result<T>) -> String {
    format!("{:#}", r.unwrap_err())
}

#[test]
fn errors_name_the_parameter() -> Result<()> {
    let params = toy_params(DType::BF16, 4);
    let mut opt = AdamW::new(&params, &OptimizerArgs::default())?;
    let mut rng = Rng::new(6);
    let good = toy_grads(&params, &mut rng);
    let norm_name = "model.layers.0.post_attention_layernorm.weight";
    let before = bits(params[2].1.as_tensor());

    let mut g = good.clone();
    g.remove(norm_name);
    let e = err_of(opt.step(&g, 1e-3));
    assert!(e.contains(norm_name) && e.contains("no gradient"), "{e}");

    let mut g = good.clone();
    g.insert(norm_name.into(), Tensor::zeros(5, DType::F32, &Device::Cpu)?);
    let e = err_of(opt.step(&g, 1e-3));
    assert!(e.contains(norm_name) && e.contains("[5]") && e.contains("[4]"), "{e}");

    let mut g = good.clone();
    g.insert("lm_head.weight".into(), Tensor::zeros(3, DType::F32, &Device::Cpu)?);
    let e = err_of(opt.step(&g, 1e-3));
    assert!(e.contains("lm_head.weight"), "{e}");

    // Failed steps changed nothing.
    assert_eq!(opt.num_steps(), 0);
    assert_eq!(bits(params[2].1.as_tensor()), before);
    opt.step(&good, 1e-3)?;

    let state = opt.state_tensors()?;
    let key = format!("exp_avg_sq.{norm_name}");
    let mut s = state.clone();
    s.remove(&key);
    let e = err_of(opt.load_state_tensors(&s, 1));
    assert!(e.contains(&key), "{e}");
    let mut s = state.clone();
    s.insert(key.clone(), Tensor::zeros((2, 2), DType::F32, &Device::Cpu)?);
    let e = err_of(opt.load_state_tensors(&s, 1));
    assert!(e.contains(&key) && e.contains("[2, 2]"), "{e}");
    let mut s = state.clone();
    s.insert(key.clone(), state[&key].to_dtype(DType::BF16)?);
    let e = err_of(opt.load_state_tensors(&s, 1));
    assert!(e.contains(&key) && e.contains("BF16"), "{e}");
    let mut s = state.clone();
    s.insert(
        "master.model.norm.weight".into(),
        Tensor::zeros(4, DType::F32, &Device::Cpu)?,
    );
    let e = err_of(opt.load_state_tensors(&s, 1));
    assert!(e.contains("master.model.norm.weight"), "{e}");

    let dup = vec![params[0].clone(), params[0].clone()];
    let e = err_of(AdamW::new(&dup, &OptimizerArgs::default()).map(|_| ()));
    assert!(e.contains("model.embed_tokens.weight") && e.contains("twice"), "{e}");
    Ok(())
}

#[test]
fn clip_grad_norm_formula_and_off_switch() -> Result<()> {
    let dev = Device::Cpu;
    let grads = BTreeMap::from([
        ("a".to_string(), Tensor::new(&[3f32], &dev)?),
        ("b".to_string(), Tensor::new(&[[4f32]], &dev)?.to_dtype(DType::BF16)?),
    ]);
    let mut g = grads.clone();
    assert_eq!(clip_grad_norm(&mut g, 0.0)?, 5.0);
    assert_eq!(bits(&g["a"]), bits(&grads["a"]), "max_norm 0 must not clip");
    assert_eq!(clip_grad_norm(&mut g, 10.0)?, 5.0);
    assert_eq!(bits(&g["a"]), bits(&grads["a"]), "norm below max_norm must not clip");
    assert_eq!(clip_grad_norm(&mut g, 1.0)?, 5.0);
    let coef = 1.0 / (5.0 + 1e-6);
    assert_eq!(g["a"].to_vec1::<f32>()?, vec![(3.0 * coef) as f32]);
    assert_eq!(g["b"].dtype(), DType::BF16);
    assert!((global_grad_norm(&g)? - 1.0).abs() < 1e-2);
    Ok(())
}

#[test]
fn non_finite_grad_norm_is_reported_with_names() -> Result<()> {
    let dev = Device::Cpu;
    let mut grads = BTreeMap::from([
        ("ok".to_string(), Tensor::new(&[1f32, 2.0], &dev)?),
        ("model.norm.weight".to_string(), Tensor::new(&[1f32, f32::NAN], &dev)?),
        ("lm_head.weight".to_string(), Tensor::new(&[f32::INFINITY], &dev)?),
    ]);
    let err = clip_grad_norm(&mut grads, 1.0).unwrap_err();
    let nf = err.downcast_ref::<NonFiniteGradNorm>().expect("a NonFiniteGradNorm");
    assert_eq!(
        nf.params,
        vec!["lm_head.weight".to_string(), "model.norm.weight".to_string()]
    );
    assert!(err.to_string().contains("model.norm.weight"), "{err}");
    assert_eq!(
        grads["ok"].to_vec1::<f32>()?,
        vec![1.0, 2.0],
        "grads untouched on error"
    );
    Ok(())
}

#[test]
fn grad_accumulator_sums_in_f32() -> Result<()> {
    let dev = Device::Cpu;
    let mut acc = GradAccumulator::new();
    assert!(acc.is_empty());
    let x = Tensor::new(&[1.0f32, 2.0, 3.0], &dev)?;
    acc.add(&BTreeMap::from([("w".to_string(), x.to_dtype(DType::BF16)?)]))?;
    acc.add(&BTreeMap::from([
        ("w".to_string(), x.affine(2.0, 0.0)?),
        ("b".to_string(), Tensor::new(&[0.5f32], &dev)?),
    ]))?;
    let e = err_of(acc.add(&BTreeMap::from([(
        "w".to_string(),
        Tensor::zeros(2, DType::F32, &dev)?,
    )])));
    assert!(
        e.contains("gradient of w") && e.contains("[2]") && e.contains("[3]"),
        "{e}"
    );
    assert_eq!(acc.micro_batches(), 2);
    acc.scale(0.5)?;
    let sums = acc.take();
    assert!(acc.is_empty() && acc.micro_batches() == 0);
    assert_eq!(sums["w"].dtype(), DType::F32);
    assert_eq!(sums["w"].to_vec1::<f32>()?, vec![1.5, 3.0, 4.5]);
    assert_eq!(sums["b"].to_vec1::<f32>()?, vec![0.25]);
    Ok(())
}

/// `step_scaled(grads, lr, clip_coefficient(norm))` (clipping folded into the update, as the
/// training step and the fused CUDA kernel do it) equals clipping the gradients and then stepping,
/// bit for bit, for f32 and bf16 models; and a norm below the bound applies no scale.
#[test]
fn folded_clipping_equals_clip_then_step() -> Result<()> {
    use vime_trainer::optim::clip_coefficient;
    for dtype in [DType::F32, DType::BF16] {
        let args = OptimizerArgs {
            lr: 1e-2,
            weight_decay: 0.1,
            clip_grad: 1.0,
            ..Default::default()
        };
        let (pa, pb) = (toy_params(dtype, 5), toy_params(dtype, 5));
        let (mut a, mut b) = (AdamW::new(&pa, &args)?, AdamW::new(&pb, &args)?);
        let mut rng = Rng::new(17);
        let mut scaled_steps = 0;
        for _ in 0..4 {
            let g = toy_grads(&pa, &mut rng);
            let mut clipped = g.clone();
            let norm = clip_grad_norm(&mut clipped, args.clip_grad)?;
            a.step(&clipped, 1e-2)?;
            assert_eq!(norm, global_grad_norm(&g)?);
            let coef = clip_coefficient(norm, args.clip_grad);
            scaled_steps += usize::from(coef.is_some());
            b.step_scaled(&g, 1e-2, coef)?;
        }
        assert!(
            scaled_steps > 0,
            "the toy gradients must exceed the clip bound at least once"
        );
        for ((n, va), (_, vb)) in pa.iter().zip(&pb) {
            assert_eq!(bits(va.as_tensor()), bits(vb.as_tensor()), "{dtype:?} {n}");
        }
        let (sa, sb) = (a.state_tensors()?, b.state_tensors()?);
        for (n, t) in &sa {
            assert_eq!(bits(t), bits(&sb[n]), "{dtype:?} state {n}");
        }
    }
    assert_eq!(clip_coefficient(0.5, 1.0), None);
    assert_eq!(clip_coefficient(3.0, 0.0), None);
    assert!((clip_coefficient(3.0, 1.0).unwrap() - 1.0 / (3.0 + 1e-6)).abs() < 1e-15);
    Ok(())
}

/// `prepare_step` (the optimizer's checks and table, done before the caller waits for the
/// gradient norm) changes no bit of the step, and a step on other gradient tensors than the
/// prepared ones checks them itself: a wrong shape is still the step's error. On the CPU this
/// covers the checks moved ahead and the step that skips them; the prepared CUDA launch's bits
/// are checked on a GPU by `scripts/gpu/first_wait.sh` (equal final losses, deterministic mode).
#[test]
fn a_prepared_step_has_the_bits_of_an_unprepared_one() -> Result<()> {
    let dev = Device::Cpu;
    let single = vime_dist::SingleRank::default();
    let mut rng = Rng::new(11);
    let shapes: [(&str, &[usize]); 3] = [
        ("model.norm.weight", &[6]),
        ("model.layers.0.self_attn.q_proj.weight", &[4, 6]),
        ("model.layers.0.mlp.down_proj.weight", &[6, 5]),
    ];
    let init: Vec<Tensor> = shapes
        .iter()
        .map(|(_, s)| rng.randn(s, 1.0, DType::BF16, &dev))
        .collect::<candle_core::Result<_>>()?;
    let grads: Vec<BTreeMap<String, Tensor>> = (0..3)
        .map(|_| {
            shapes
                .iter()
                .map(|(n, s)| Ok((n.to_string(), rng.randn(s, 1.0, DType::F32, &dev)?)))
                .collect::<candle_core::Result<_>>()
        })
        .collect::<candle_core::Result<_>>()?;
    let args = OptimizerArgs {
        weight_decay: 0.1,
        ..Default::default()
    };
    let fresh = || -> Vec<(String, Var)> {
        shapes
            .iter()
            .zip(&init)
            .map(|((n, _), t)| (n.to_string(), var(t.copy().unwrap())))
            .collect()
    };
    let run = |prepare: bool| -> Result<Vec<Vec<u32>>> {
        let params = fresh();
        let mut opt = DistributedAdamW::new(&params, &args, &single)?;
        for g in &grads {
            if prepare {
                opt.prepare_step(g, &single, &single)?;
            }
            opt.step_stats_tp(g, None, 1e-2, 1.0, &single, &single)?;
        }
        Ok(params.iter().map(|(_, v)| bits(v.as_tensor())).collect())
    };
    assert_eq!(run(true)?, run(false)?, "the weights after three steps");
    let params = fresh();
    let mut opt = DistributedAdamW::new(&params, &args, &single)?;
    opt.prepare_step(&grads[0], &single, &single)?;
    let mut bad = grads[0].clone();
    bad.insert(shapes[1].0.to_string(), Tensor::zeros((6, 4), DType::F32, &dev)?);
    let err = opt.step_stats_tp(&bad, None, 1e-2, 1.0, &single, &single).unwrap_err();
    assert!(format!("{err:#}").contains("has shape [6, 4]"), "{err:#}");
    Ok(())
}
