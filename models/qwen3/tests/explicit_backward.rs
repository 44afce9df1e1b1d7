//! The hand-written block backward (`block.rs`) against candle's autograd over the same
//! forward: every parameter gradient and the loss, f64 (to rounding) and f32, with and without
//! recompute, tied and untied, with and without attention biases, on packed sequences.
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use vime_kernels::testing::{rel_err, Rng};
use vime_qwen3::batch::PackedBatch;
use vime_qwen3::config::Qwen3Config;
use vime_qwen3::model::{Qwen3, Recompute};
use vime_qwen3::state_dict::param_specs;

mod common;

/// The checkpoint tests' tiny config (GQA 4/2, head_dim 8 != hidden / heads), with 3 layers.
fn tiny3(tied: bool, bias: bool) -> Qwen3Config {
    let mut c = common::tiny(tied, bias);
    c.num_hidden_layers = 3;
    c.max_window_layers = 3;
    c.validate().unwrap();
    c
}

fn model(cfg: &Qwen3Config, dtype: DType, seed: u64) -> Qwen3 {
    let mut rng = Rng::new(seed);
    let tensors: BTreeMap<String, Tensor> = param_specs(cfg)
        .into_iter()
        .map(|s| {
            // Norm gains away from 1 so that their gradients and the normed paths are exercised.
            let t = if s.shape.len() == 1 && !s.name.ends_with(".bias") {
                (rng.randn(&s.shape, 0.2, dtype, &Device::Cpu).unwrap() + 1.0).unwrap()
            } else {
                rng.randn(&s.shape, 0.3, dtype, &Device::Cpu).unwrap()
            };
            (s.name, t)
        })
        .collect();
    Qwen3::from_tensors(cfg.clone(), tensors).unwrap()
}

fn grads(m: &Qwen3, batch: &PackedBatch, rec: Recompute) -> (f64, BTreeMap<String, Tensor>) {
    // A loss that weighs tokens unequally and uses the entropy too.
    let (loss, g) = m
        .forward_backward(batch, rec, |o| {
            let n = o.logprobs.elem_count();
            let w: Vec<f64> = (0..n).map(|i| 0.5 + (i % 3) as f64 * 0.25).collect();
            let w = Tensor::new(w.as_slice(), &Device::Cpu)?.to_dtype(o.logprobs.dtype())?;
            Ok(((&o.logprobs * &w)?.sum_all()? + (o.entropy.sum_all()? * 0.1)?)?)
        })
        .unwrap();
    (loss, g.params)
}

#[test]
fn explicit_backward_matches_autograd() {
    let batch = PackedBatch::from_sequences(&[vec![3u32, 7, 9, 11, 4, 5, 6], vec![8, 2, 30], vec![12, 13, 14, 15, 16]])
        .unwrap();
    for (dtype, tol) in [(DType::F64, 1e-11), (DType::F32, 2e-5)] {
        for (tied, bias) in [(true, false), (false, true)] {
            let cfg = tiny3(tied, bias);
            let mut m = model(&cfg, dtype, 11);
            assert!(m.explicit_backward(), "the explicit backward is the default");
            for rec in [Recompute::None, Recompute::Full] {
                m.set_explicit_backward(true).unwrap();
                let (le, ge) = grads(&m, &batch, rec);
                m.set_explicit_backward(false).unwrap();
                let (la, ga) = grads(&m, &batch, rec);
                assert_eq!(le, la, "{dtype:?} tied={tied} bias={bias} {rec:?}: loss");
                assert_eq!(
                    ge.keys().collect::<Vec<_>>(),
                    ga.keys().collect::<Vec<_>>(),
                    "the same parameters get gradients"
                );
                assert_eq!(ge.len(), param_specs(&cfg).len());
                for (name, a) in &ga {
                    let e = &ge[name];
                    assert_eq!(e.dims(), a.dims(), "{name}");
                    let err = rel_err(&e.to_dtype(DType::F64).unwrap(), &a.to_dtype(DType::F64).unwrap()).unwrap();
                    assert!(
                        err <= tol,
                        "{dtype:?} tied={tied} bias={bias} {rec:?} {name}: relative error {err:e} > {tol:e}"
                    );
                    let norm = a
                        .to_dtype(DType::F64)
                        .unwrap()
                        .sqr()
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .to_scalar::<f64>()
                        .unwrap();
                    assert!(norm > 0.0, "{name}: zero gradient, the comparison would be vacuous");
                }
            }
        }
    }
}

/// Every recompute layout (Megatron's uniform groups and first-N block, with and without kept
/// attention) re-runs the same deterministic ops on the same inputs, so its loss and every
/// gradient equal those of keeping everything, bit for bit; and the policy strings round-trip.
#[test]
fn every_recompute_layout_gives_the_gradients_of_keeping_everything() {
    let batch = PackedBatch::from_sequences(&[vec![3u32, 7, 9, 11, 4, 5, 6], vec![8, 2, 30], vec![12, 13, 14, 15, 16]])
        .unwrap();
    for (tied, bias) in [(true, false), (false, true)] {
        let cfg = tiny3(tied, bias);
        let m = model(&cfg, DType::F32, 12);
        let (l0, g0) = grads(&m, &batch, Recompute::None);
        for policy in [
            "full",
            "uniform:2",
            "uniform:3",
            "uniform:5",
            "block:1",
            "block:3",
            "block:7",
            "full,keep-attention",
            "uniform:2,keep-attention",
            "block:2,keep-attention",
        ] {
            let rec: Recompute = policy.parse().unwrap();
            assert_eq!(rec.to_string(), policy, "the policy string round-trips");
            let (l, g) = grads(&m, &batch, rec);
            assert_eq!(l, l0, "{policy}: loss");
            assert_eq!(g.len(), g0.len());
            for (name, want) in &g0 {
                let diff = (&g[name] - want)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                assert_eq!(diff, 0.0, "tied={tied} bias={bias} {policy}: gradient of {name}");
            }
        }
    }
    assert_eq!("full".parse::<Recompute>().unwrap(), Recompute::Full);
    assert_eq!("none".parse::<Recompute>().unwrap(), Recompute::None);
    for (bad, says) in [
        ("block:0", "positive integer"),
        ("uniform:x", "positive integer"),
        ("selective", "unknown recompute policy"),
        ("full,keep-everything", "unknown recompute option"),
        ("none,keep-attention", "needs a recomputing layout"),
    ] {
        let e = format!("{:#}", bad.parse::<Recompute>().unwrap_err());
        assert!(e.contains(says), "{bad}: {e}");
    }
}

/// Gradient accumulation through the backward (`forward_backward_into`, the trainer's optimizer
/// step): three micro-batches whose gradients are added to the running sums by the backward
/// itself give, per parameter, the sum of the three `forward_backward` results; tied and untied,
/// with biases, with and without recompute, in f32 (the sums' dtype) from bf16-free f32 models.
/// The first micro-batch starts from empty sums and so returns exactly `forward_backward`'s.
#[test]
fn gradients_accumulated_in_the_backward_equal_the_sum_of_the_micro_batches() {
    let mbs = [
        PackedBatch::from_sequences(&[vec![3u32, 7, 9, 11, 4, 5, 6], vec![8, 2, 30]]).unwrap(),
        PackedBatch::from_sequences(&[vec![12u32, 13, 14, 15, 16]]).unwrap(),
        PackedBatch::from_sequences(&[vec![1u32, 2, 3], vec![4, 5], vec![6, 7, 8, 9]]).unwrap(),
    ];
    let loss = |o: &vime_qwen3::model::TokenOutputs| -> anyhow::Result<Tensor> {
        Ok(((o.logprobs.sum_all()? * -0.5)? + (o.entropy.sum_all()? * 0.1)?)?)
    };
    let single = vime_dist::SingleRank::default();
    for (tied, bias, rec) in [
        (true, false, Recompute::None),
        (false, true, Recompute::None),
        (true, true, Recompute::Full),
    ] {
        let m = model(&tiny3(tied, bias), DType::F32, 5);
        let mut want: BTreeMap<String, Tensor> = BTreeMap::new();
        let mut sums = BTreeMap::new();
        for (k, b) in mbs.iter().enumerate() {
            let (l1, g) = m.forward_backward(b, rec, loss).unwrap();
            for (n, t) in g.params {
                let t = match want.remove(&n) {
                    Some(s) => (s + t).unwrap(),
                    None => t,
                };
                want.insert(n, t);
            }
            let (l2, g) = m
                .forward_backward_into(b, rec, loss, &single, None, None, sums)
                .unwrap();
            assert_eq!(l1, l2.read().unwrap(), "micro-batch {k}: the loss");
            sums = g.params;
            assert_eq!(
                sums.len(),
                want.len(),
                "micro-batch {k}: the parameters with a gradient"
            );
            for (n, w) in &want {
                let e = rel_err(&sums[n], w).unwrap();
                let tol = if k == 0 { 0.0 } else { 1e-6 };
                assert!(
                    e <= tol,
                    "tied {tied} bias {bias} {rec:?} micro-batch {k}: {n} off by {e}"
                );
            }
        }
    }
}

/// A bf16 model's running sums are f32 from the first micro-batch on: the norms' weight
/// gradients, which their kernels round to bf16 (as Megatron's do), come back from
/// `forward_backward_into` already widened to f32 (queued behind the backward instead of cast by
/// the caller after the loss is read), with the values the caller's cast gave: per parameter,
/// bit for bit the f32 sum of `forward_backward`'s gradients, each widened to f32 first.
#[test]
fn a_bf16_models_sums_are_f32_and_equal_the_widened_gradients() {
    let mbs = [
        PackedBatch::from_sequences(&[vec![3u32, 7, 9, 11, 4, 5, 6], vec![8, 2, 30]]).unwrap(),
        PackedBatch::from_sequences(&[vec![12u32, 13, 14, 15, 16]]).unwrap(),
    ];
    let loss = |o: &vime_qwen3::model::TokenOutputs| -> anyhow::Result<Tensor> { Ok((o.logprobs.sum_all()? * -0.5)?) };
    let single = vime_dist::SingleRank::default();
    let m = model(&tiny3(true, true), DType::BF16, 7);
    let (mut want, mut sums): (BTreeMap<String, Tensor>, _) = (BTreeMap::new(), BTreeMap::new());
    let mut half = 0;
    for (k, b) in mbs.iter().enumerate() {
        let (_, g) = m.forward_backward(b, Recompute::None, loss).unwrap();
        for (n, t) in g.params {
            half += (t.dtype() == DType::BF16) as usize;
            let t = t.to_dtype(DType::F32).unwrap();
            let t = match want.remove(&n) {
                Some(s) => (s + t).unwrap(),
                None => t,
            };
            want.insert(n, t);
        }
        sums = m
            .forward_backward_into(b, Recompute::None, loss, &single, None, None, sums)
            .unwrap()
            .1
            .params;
        assert_eq!(sums.len(), want.len(), "micro-batch {k}");
        for (n, w) in &want {
            assert_eq!(sums[n].dtype(), DType::F32, "micro-batch {k}: the sum of {n}");
            let (a, b) = (
                sums[n].flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                w.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            let same = a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(
                same,
                "micro-batch {k}: the sum of {n} differs from the widened gradients"
            );
        }
    }
    // The case this is about: the plain backward does hand out bf16 gradients (the norms').
    assert!(half > 0, "no bf16 gradient came out of forward_backward");
}
