//! FP8 linear layers (`KernelConfig::with_fp8`, `--fp8-format hybrid --fp8-recipe tensorwise`) on
//! the CPU reference path of `vime_kernels::fp8` (the CUDA GEMMs are held to the same reference by
//! scripts/gpu/check_kernels.sh, and the 4B error by scripts/gpu/fp8_error.sh): a bf16 model's loss
//! and every parameter gradient against the exact ones (the same weights in f64), within FP8's
//! precision and measurably different from bf16's; the same bits run to run and under full
//! recompute (the recomputed forward quantizes the same tensors); gradient sums over micro-batches
//! by the FP8 GEMMs; and a clear error for a model that is not bf16.
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use vime_kernels::fp8::DelayedScaling;
use vime_kernels::testing::{rel_err, Rng};
use vime_qwen3::batch::PackedBatch;
use vime_qwen3::config::Qwen3Config;
use vime_qwen3::model::{Qwen3, Recompute};
use vime_qwen3::state_dict::param_specs;

mod common;

fn tensors(cfg: &Qwen3Config, seed: u64) -> BTreeMap<String, Tensor> {
    let mut rng = Rng::new(seed);
    param_specs(cfg)
        .into_iter()
        .map(|s| {
            let t = if s.shape.len() == 1 && !s.name.ends_with(".bias") {
                (rng.randn(&s.shape, 0.2, DType::F32, &Device::Cpu).unwrap() + 1.0).unwrap()
            } else {
                rng.randn(&s.shape, 0.3, DType::F32, &Device::Cpu).unwrap()
            };
            // bf16 values, so that the f64 model has exactly the bf16 model's weights.
            (s.name, t.to_dtype(DType::BF16).unwrap())
        })
        .collect()
}

fn model(cfg: &Qwen3Config, w: &BTreeMap<String, Tensor>, dtype: DType, fp8: bool) -> Qwen3 {
    let w = w.iter().map(|(n, t)| (n.clone(), t.to_dtype(dtype).unwrap())).collect();
    let mut m = Qwen3::from_tensors(cfg.clone(), w).unwrap();
    let k = m.kernel_config().clone().with_fp8(fp8);
    m.set_kernel_config(k);
    m
}

fn grads(m: &Qwen3, batch: &PackedBatch, rec: Recompute) -> anyhow::Result<(f64, BTreeMap<String, Tensor>)> {
    let (loss, g) = m.forward_backward(batch, rec, |o| {
        let n = o.logprobs.elem_count();
        let w: Vec<f64> = (0..n).map(|i| 0.5 + (i % 3) as f64 * 0.25).collect();
        let w = Tensor::new(w.as_slice(), &Device::Cpu)?.to_dtype(o.logprobs.dtype())?;
        Ok(((&o.logprobs * &w)?.sum_all()? + (o.entropy.sum_all()? * 0.1)?)?)
    })?;
    Ok((loss, g.params))
}

fn f64_of(t: &Tensor) -> Tensor {
    t.to_dtype(DType::F64).unwrap()
}

/// The norm-wise relative error of all gradients together against `want`.
fn total_err(got: &BTreeMap<String, Tensor>, want: &BTreeMap<String, Tensor>) -> f64 {
    let (mut num, mut den) = (0.0, 0.0);
    for (n, w) in want {
        let d = (f64_of(&got[n]) - f64_of(w)).unwrap();
        num += d.sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
        den += f64_of(w).sqr().unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap();
    }
    (num / den).sqrt()
}

/// A tensor's values as f32, to compare bit for bit.
fn bits(t: &Tensor) -> Vec<f32> {
    vime_kernels::testing::f32_values(t).unwrap()
}

/// Two micro-batches of one step.
fn two_micro_batches() -> (PackedBatch, PackedBatch) {
    (
        PackedBatch::from_sequences(&[vec![3u32, 7, 9, 11, 4]]).unwrap(),
        PackedBatch::from_sequences(&[vec![8u32, 2, 30, 31], vec![5, 6]]).unwrap(),
    )
}

fn batch() -> PackedBatch {
    PackedBatch::from_sequences(&[
        vec![3u32, 7, 9, 11, 4, 5, 6, 21, 22, 23, 24],
        vec![8, 2, 30],
        vec![12, 13, 14, 15, 16, 17],
    ])
    .unwrap()
}

#[test]
fn fp8_gradients_are_within_fp8_precision_of_the_exact_ones_and_differ_from_bf16() {
    let b = batch();
    for (tied, bias) in [(true, false), (false, true)] {
        let cfg = common::tiny(tied, bias);
        let w = tensors(&cfg, 5);
        let (l64, g64) = grads(&model(&cfg, &w, DType::F64, false), &b, Recompute::None).unwrap();
        let (lbf, gbf) = grads(&model(&cfg, &w, DType::BF16, false), &b, Recompute::None).unwrap();
        let (l8, g8) = grads(&model(&cfg, &w, DType::BF16, true), &b, Recompute::None).unwrap();
        assert_eq!(g8.keys().collect::<Vec<_>>(), g64.keys().collect::<Vec<_>>());
        let (e_bf, e_8) = (total_err(&gbf, &g64), total_err(&g8, &g64));
        let (le_bf, le_8) = (((lbf - l64) / l64).abs(), ((l8 - l64) / l64).abs());
        eprintln!("tied={tied} bias={bias}: gradient rel err bf16 {e_bf:.2e} fp8 {e_8:.2e}; loss bf16 {le_bf:.2e} fp8 {le_8:.2e}");
        // E4M3 keeps 3 mantissa bits (an RMS rounding error of ~2 % a value), E5M2 2 (~4 %), and
        // each of this 24-wide model's 2 layers rounds 4 inputs, 7 weights and 7 gradients: its
        // gradients come out ~20-30 % off the exact ones (bf16: ~1 %). A wrong operand, side or
        // scale gives errors of 100 % and more, a lost scale orders of magnitude.
        assert!(e_8 < 0.35, "tied={tied} bias={bias}: FP8 gradients off by {e_8:e}");
        assert!(
            e_8 > 3.0 * e_bf,
            "tied={tied} bias={bias}: FP8 {e_8:e} vs bf16 {e_bf:e}: is FP8 on?"
        );
        assert!(le_8 < 0.03, "tied={tied} bias={bias}: FP8 loss off by {le_8:e}");
        for (n, want) in &g64 {
            let e = rel_err(&f64_of(&g8[n]), &f64_of(want)).unwrap();
            assert!(e < 0.8, "tied={tied} bias={bias}: {n} off by {e:e}");
        }
    }
}

#[test]
fn fp8_is_bit_for_bit_reproducible_and_recompute_gives_its_bits() {
    let b = batch();
    let cfg = common::tiny(false, true);
    let w = tensors(&cfg, 6);
    let m = model(&cfg, &w, DType::BF16, true);
    let (l0, g0) = grads(&m, &b, Recompute::None).unwrap();
    for rec in [Recompute::None, Recompute::Full, "full,keep-attention".parse().unwrap()] {
        let (l, g) = grads(&m, &b, rec).unwrap();
        assert_eq!(l, l0, "{rec:?}: loss");
        for (n, want) in &g0 {
            let same = bits(&g[n]) == bits(want);
            assert!(same, "{rec:?}: the gradient of {n} differs");
        }
    }
}

#[test]
fn fp8_weight_gradients_add_into_the_running_sum() {
    // Two micro-batches into one sum (the FP8 weight-gradient GEMM adding to the f32 sum of the
    // first) against the two sums taken separately.
    let cfg = common::tiny(true, false);
    let w = tensors(&cfg, 7);
    let m = model(&cfg, &w, DType::BF16, true);
    let (b1, b2) = two_micro_batches();
    let loss = |o: &vime_qwen3::model::TokenOutputs| -> anyhow::Result<Tensor> { Ok(o.logprobs.sum_all()?) };
    let (_, g1) = m.forward_backward(&b1, Recompute::None, loss).unwrap();
    let (_, g2) = m.forward_backward(&b2, Recompute::None, loss).unwrap();
    let first = g1.params.clone();
    let single = vime_dist::SingleRank::default();
    let (_, both) = m
        .forward_backward_into(&b2, Recompute::None, loss, &single, None, None, first)
        .unwrap();
    let name = "model.layers.1.mlp.down_proj.weight";
    let want = (f64_of(&g1.params[name]) + f64_of(&g2.params[name])).unwrap();
    let e = rel_err(&f64_of(&both.params[name]), &want).unwrap();
    assert!(e < 1e-6, "{name}: the summed gradient is off by {e:e}");
    assert_eq!(both.params[name].dtype(), DType::F32);
}

#[test]
fn fp8_on_a_model_that_is_not_bf16_is_a_clear_error() {
    let cfg = common::tiny(true, false);
    let w = tensors(&cfg, 8);
    let m = model(&cfg, &w, DType::F32, true);
    let e = grads(&m, &batch(), Recompute::None).unwrap_err();
    let msg = format!("{e:#}");
    assert!(msg.contains("--fp8-format runs on bf16 models"), "{msg}");
}

#[test]
fn the_step_weight_cache_gives_the_bits_of_quantizing_at_every_use() {
    // Two micro-batches accumulated inside one cache scope (each weight quantized once) against
    // the same two without it (every use quantizes afresh): the same bits, since quantization
    // depends on the weight alone. A nested scope runs inside the outer one.
    let cfg = common::tiny(false, true);
    let w = tensors(&cfg, 9);
    let m = model(&cfg, &w, DType::BF16, true);
    let single = vime_dist::SingleRank::default();
    let (b1, b2) = two_micro_batches();
    let loss = |o: &vime_qwen3::model::TokenOutputs| -> anyhow::Result<Tensor> { Ok(o.logprobs.sum_all()?) };
    let two = || -> anyhow::Result<BTreeMap<String, Tensor>> {
        let (_, g) = m.forward_backward_into(&b1, Recompute::None, loss, &single, None, None, BTreeMap::new())?;
        let (_, g) = m.forward_backward_into(&b2, Recompute::Full, loss, &single, None, None, g.params)?;
        Ok(g.params)
    };
    let plain = two().unwrap();
    let cached = m.with_fp8_weight_cache(|| m.with_fp8_weight_cache(two)).unwrap();
    for (n, want) in &plain {
        assert!(
            bits(&cached[n]) == bits(want),
            "the gradient of {n} differs with the cache"
        );
    }
}

/// A bf16 FP8 model with delayed scaling (`--fp8-recipe delayed`).
fn delayed(cfg: &Qwen3Config, w: &BTreeMap<String, Tensor>, d: DelayedScaling) -> Qwen3 {
    let mut m = model(cfg, w, DType::BF16, true);
    let k = m.kernel_config().clone().with_fp8_delayed(Some(d));
    m.set_kernel_config(k);
    m
}

fn same_bits(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) -> Option<String> {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    a.iter().find(|(n, t)| bits(t) != bits(&b[*n])).map(|(n, _)| n.clone())
}

#[test]
fn delayed_scaling_seeds_with_current_scaling_then_scales_by_the_last_micro_batch() {
    // The first micro-batch has no history: every role is scaled by its own amax, the
    // tensorwise bits. The second, on the same batch (same weights, same inputs, so the same
    // amaxes), scales by the first's amaxes: tensorwise's bits again. On another batch it
    // scales by amaxes that are not its own: other bits, still within FP8's precision of the
    // tensorwise gradients. A margin of 1 halves every scale: other bits too.
    let cfg = common::tiny(false, true);
    let w = tensors(&cfg, 10);
    let (b, other) = (batch(), two_micro_batches().1);
    let tw = model(&cfg, &w, DType::BF16, true);
    let (l_tw, g_tw) = grads(&tw, &b, Recompute::None).unwrap();
    let (_, g_tw_other) = grads(&tw, &other, Recompute::None).unwrap();
    let m = delayed(&cfg, &w, DelayedScaling::default());
    assert!(
        m.fp8_amax_state().unwrap().is_none(),
        "no history before the first FP8 pass"
    );
    let (l1, g1) = grads(&m, &b, Recompute::None).unwrap();
    assert_eq!(l1, l_tw);
    assert_eq!(same_bits(&g1, &g_tw), None, "the first micro-batch is tensorwise");
    let st = m.fp8_amax_state().unwrap().expect("a history after the first pass");
    let roles = cfg.num_hidden_layers * 11;
    assert_eq!((st.seeded.len(), st.rows.len()), (roles, roles * 3));
    assert!(
        st.seeded.iter().all(|&s| s),
        "every role of the training pass is seeded"
    );
    for r in st.rows.chunks(3) {
        // [pending, amax, h_0]: committed (pending 0), most recent (amax = h_0), a real amax.
        assert_eq!((r[0], r[1]), (0.0, r[2]), "{r:?}");
        assert!(r[2] > 0.0 && r[2].is_finite(), "{r:?}");
    }
    let (l2, g2) = grads(&m, &b, Recompute::None).unwrap();
    assert_eq!(l2, l_tw);
    assert_eq!(same_bits(&g2, &g_tw), None, "the same batch again: its own amaxes");
    let (_, g3) = grads(&m, &other, Recompute::None).unwrap();
    let differs = same_bits(&g3, &g_tw_other);
    assert!(differs.is_some(), "another batch scaled by the last one's amaxes");
    // Against the exact gradients (f64), as the first test holds tensorwise: the same bound,
    // and near tensorwise's own error (the two batches' amaxes are alike; a lost or inverted
    // scale would be far off).
    let (_, g64) = grads(&model(&cfg, &w, DType::F64, false), &other, Recompute::None).unwrap();
    let (e_d, e_tw) = (total_err(&g3, &g64), total_err(&g_tw_other, &g64));
    eprintln!("gradient rel err against f64: delayed {e_d:.3e}, tensorwise {e_tw:.3e}");
    assert!(e_d < 0.35 && e_d < 1.5 * e_tw, "delayed {e_d:e} vs tensorwise {e_tw:e}");
    let half = delayed(
        &cfg,
        &w,
        DelayedScaling {
            margin: 1,
            ..Default::default()
        },
    );
    grads(&half, &b, Recompute::None).unwrap();
    let (_, gh) = grads(&half, &b, Recompute::None).unwrap();
    assert!(same_bits(&gh, &g_tw).is_some(), "a margin changes the scales");
    let (_, g64) = grads(&model(&cfg, &w, DType::F64, false), &b, Recompute::None).unwrap();
    let (e_h, e_tw) = (total_err(&gh, &g64), total_err(&g_tw, &g64));
    eprintln!("margin 1: gradient rel err against f64 {e_h:.3e}, tensorwise {e_tw:.3e}");
    assert!(
        e_h < 0.35 && e_h < 1.5 * e_tw,
        "margin 1 {e_h:e} vs tensorwise {e_tw:e}"
    );
}

#[test]
fn delayed_scaling_recompute_scoring_and_a_restored_history_give_the_same_bits() {
    // Recompute quantizes with the scales of the forward it repeats, and records once: full
    // and keep-attention recompute give no recompute's bits, and leave the same history. A
    // scoring pass reads the history and records nothing. A history saved after a micro-batch
    // and loaded into a fresh model gives the next micro-batches' bits (exact resume).
    let cfg = common::tiny(true, false);
    let w = tensors(&cfg, 11);
    let (b1, b2) = two_micro_batches();
    let b3 = batch();
    let d = DelayedScaling {
        history_len: 2,
        use_max: true,
        margin: 0,
    };
    let run = |rec: Recompute, score: bool| {
        let m = delayed(&cfg, &w, d);
        grads(&m, &b1, rec).unwrap();
        if score {
            m.logprobs_entropy(&b3).unwrap();
        }
        let s = m.fp8_amax_state().unwrap().unwrap();
        let (l2, g2) = grads(&m, &b2, rec).unwrap();
        let (l3, g3) = grads(&m, &b3, rec).unwrap();
        (s, l2, g2, l3, g3, m.fp8_amax_state().unwrap().unwrap())
    };
    let (s1, l2, g2, l3, g3, s3) = run(Recompute::None, false);
    for (rec, score) in [
        (Recompute::Full, false),
        ("full,keep-attention".parse().unwrap(), false),
        (Recompute::None, true),
    ] {
        let (t1, m2, h2, m3, h3, t3) = run(rec, score);
        assert_eq!((&t1, &t3), (&s1, &s3), "{rec:?} score={score}: the histories");
        assert_eq!((m2, m3), (l2, l3), "{rec:?} score={score}: losses");
        assert_eq!(same_bits(&h2, &g2), None, "{rec:?} score={score}");
        assert_eq!(same_bits(&h3, &g3), None, "{rec:?} score={score}");
    }
    // History of 2, max: after three micro-batches each role's amax is the larger of the last
    // two.
    for r in s3.rows.chunks(4) {
        assert_eq!(r[1], r[2].max(r[3]), "{r:?}");
    }
    // Resume: a fresh model with the history saved after b1.
    let fresh = delayed(&cfg, &w, d);
    fresh.load_fp8_amax_state(&s1).unwrap();
    let (m2, h2) = grads(&fresh, &b2, Recompute::None).unwrap();
    let (m3, h3) = grads(&fresh, &b3, Recompute::None).unwrap();
    assert_eq!((m2, m3), (l2, l3));
    assert_eq!(same_bits(&h2, &g2), None, "resumed: micro-batch 2");
    assert_eq!(same_bits(&h3, &g3), None, "resumed: micro-batch 3");
    // Without the history, the fresh model seeds again: other bits.
    let cold = delayed(&cfg, &w, d);
    let (_, c2) = grads(&cold, &b2, Recompute::None).unwrap();
    assert!(same_bits(&c2, &g2).is_some(), "a history that was not restored shows");
    // A history for another model shape is refused, naming both.
    let mut wrong = s1.clone();
    wrong.seeded.pop();
    let e = fresh.load_fp8_amax_state(&wrong).unwrap_err().to_string();
    assert!(e.contains("roles") && e.contains("layers"), "{e}");
}
