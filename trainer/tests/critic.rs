//! The critic and the reference model: value-head gradients against a composed reference and
//! finite differences, backbone gradients, loading from the HF fixture, the save/load round trip,
//! and reference log-probs against HF transformers' (tests/fixtures/hf).
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use std::cell::RefCell;
use std::path::PathBuf;
use vime_kernels::testing::{rel_err, weighted_sum, Rng};
use vime_qwen3::batch::PackedBatch;
use vime_qwen3::model::{Qwen3, Recompute};
use vime_trainer::batching::{MicroBatch, SampleView};
use vime_trainer::critic::{Critic, ReferenceModel, VALUE_HEAD_BIAS, VALUE_HEAD_FILE, VALUE_HEAD_WEIGHT};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/hf")
        .join(name)
}

fn batch(vocab: u32, lengths: &[usize], seed: u64) -> PackedBatch {
    let mut rng = Rng::new(seed);
    let seqs: Vec<Vec<u32>> = lengths
        .iter()
        .map(|&l| (0..l).map(|_| (rng.next_u64() % vocab as u64) as u32).collect())
        .collect();
    PackedBatch::from_sequences(&seqs).unwrap()
}

fn bits(t: &Tensor) -> Result<Vec<u64>> {
    Ok(t.to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?
        .into_iter()
        .map(f64::to_bits)
        .collect())
}

fn abs_sum(t: &Tensor) -> Result<f64> {
    Ok(t.to_dtype(DType::F64)?.abs()?.sum_all()?.to_scalar::<f64>()?)
}

#[test]
fn critic_loads_from_the_hf_fixture_with_a_fresh_head() -> Result<()> {
    let dir = fixture("tied_gqa");
    let critic = Critic::init_from_hf(&dir, DType::F32, &Device::Cpu, 7)?;
    let h = critic.config().hidden_size;
    let (w, b) = critic.value_head();
    assert_eq!(w.dims(), [1, h]);
    assert_eq!(b.dims(), [1]);
    assert_eq!(w.dtype(), DType::F32);
    assert_eq!(b.as_tensor().to_vec1::<f32>()?, vec![0.0]);
    // N(0, initializer_range^2), initializer_range = 0.1 in this fixture.
    let v: Vec<f32> = w.as_tensor().flatten_all()?.to_vec1()?;
    let std = (v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>() / v.len() as f64).sqrt();
    assert!((0.07..0.13).contains(&std), "value head std {std}");

    let names: Vec<String> = critic.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert!(names.contains(&VALUE_HEAD_WEIGHT.to_string()) && names.contains(&VALUE_HEAD_BIAS.to_string()));
    assert!(!names.contains(&"lm_head.weight".to_string()));
    assert!(!Critic::has_value_head(&dir));
    let err = Critic::load(&dir, DType::F32, &Device::Cpu).err().unwrap().to_string();
    assert!(err.contains(VALUE_HEAD_FILE), "{err}");

    let pb = batch(critic.config().vocab_size as u32, &[5, 9, 3], 1);
    let values = critic.values(&pb)?;
    assert_eq!(values.dims(), [17]);
    assert!(values.to_vec1::<f32>()?.iter().all(|x| x.is_finite()));
    // The values are the hidden states through the head.
    let hidden = critic.backbone().hidden_states(&pb)?;
    let expect = hidden
        .matmul(&w.as_tensor().t()?)?
        .broadcast_add(b.as_tensor())?
        .squeeze(1)?;
    assert_eq!(bits(&values)?, bits(&expect)?);
    Ok(())
}

#[test]
fn value_head_gradient_matches_the_composed_reference() -> Result<()> {
    let critic = Critic::init_from_hf(&fixture("tied_gqa"), DType::F32, &Device::Cpu, 3)?;
    let pb = batch(critic.config().vocab_size as u32, &[7, 12, 4, 9], 2);
    let seen = RefCell::new(None);
    // loss = sum_t r_t v_t: dL/dw = r^T H, dL/db = sum_t r_t.
    let (loss, grads) = critic.forward_backward(&pb, Recompute::Full, |v| {
        *seen.borrow_mut() = Some(v.clone());
        Ok(weighted_sum(v, 99)?)
    })?;
    let values = critic.values(&pb)?;
    let seen = seen.into_inner().unwrap();
    assert_eq!(
        bits(&seen)?,
        bits(&values)?,
        "values inside forward_backward differ from values()"
    );
    let r = Rng::new(99).randn(&[pb.num_tokens()], 1.0, DType::F32, &Device::Cpu)?;
    let expect_loss = (&values * &r)?.sum_all()?.to_scalar::<f32>()? as f64;
    assert!((loss - expect_loss).abs() <= 1e-5 * expect_loss.abs().max(1.0));

    let hidden = critic.backbone().hidden_states(&pb)?;
    let gw = r.unsqueeze(0)?.matmul(&hidden)?; // [1, hidden]
    let gb = r.sum_keepdim(0)?; // [1]
    let e_w = rel_err(&grads.params[VALUE_HEAD_WEIGHT], &gw)?;
    let e_b = rel_err(&grads.params[VALUE_HEAD_BIAS], &gb)?;
    assert!(
        e_w <= 1e-5 && e_b <= 1e-5,
        "value head grads: weight {e_w:e}, bias {e_b:e}"
    );
    Ok(())
}

#[test]
fn critic_gradients_match_finite_differences_in_f64() -> Result<()> {
    let dev = Device::Cpu;
    let dir = fixture("untied_bias");
    let base = Qwen3::load_hf(&dir, DType::F64, &dev)?;
    let cfg = base.config().clone();
    let state = base.state_dict();
    let head = Critic::with_fresh_value_head(base, 0.3, 5)?;
    let (w0, b0) = (head.value_head().0.as_tensor().copy()?, Tensor::new(&[0.2f64], &dev)?);
    assert_eq!(w0.dtype(), DType::F64);
    let pb = batch(cfg.vocab_size as u32, &[6, 4, 5], 3);
    // A non-linear loss of the values: sum_t r_t v_t^2.
    let loss_of = |v: &Tensor| -> candle_core::Result<Tensor> { weighted_sum(&v.sqr()?, 17) };

    let critic = Critic::new(Qwen3::from_tensors(cfg.clone(), state.clone())?, &w0, &b0)?;
    let (_, grads) = critic.forward_backward(&pb, Recompute::None, |v| Ok(loss_of(v)?))?;
    assert!(
        !grads.params.contains_key("lm_head.weight"),
        "an untied lm_head is not a critic parameter"
    );

    // Central differences over selected elements of the head and the backbone.
    let eval = |name: &str, idx: usize, delta: f64| -> Result<f64> {
        let bump = |t: &Tensor| -> Result<Tensor> {
            let mut v: Vec<f64> = t.flatten_all()?.to_vec1()?;
            v[idx] += delta;
            Ok(Tensor::from_vec(v, t.dims(), &dev)?)
        };
        let (mut st, mut w, mut b) = (state.clone(), w0.clone(), b0.clone());
        match name {
            VALUE_HEAD_WEIGHT => w = bump(&w)?,
            VALUE_HEAD_BIAS => b = bump(&b)?,
            _ => {
                let t = bump(&st[name])?;
                st.insert(name.to_string(), t);
            }
        }
        let c = Critic::new(Qwen3::from_tensors(cfg.clone(), st)?, &w, &b)?;
        Ok(loss_of(&c.values(&pb)?)?.to_scalar::<f64>()?)
    };
    let h = 1e-5;
    let checks: Vec<(&str, Vec<usize>)> = vec![
        (VALUE_HEAD_WEIGHT, (0..cfg.hidden_size).collect()),
        (VALUE_HEAD_BIAS, vec![0]),
        ("model.norm.weight", (0..cfg.hidden_size).step_by(5).collect()),
        ("model.layers.0.self_attn.k_proj.bias", (0..8).collect()),
        ("model.layers.1.mlp.down_proj.weight", vec![0, 17, 1000, 3000]),
        (
            "model.embed_tokens.weight",
            (0..cfg.hidden_size * 3).step_by(7).collect(),
        ),
    ];
    for (name, idxs) in checks {
        let g: Vec<f64> = grads.params[name].flatten_all()?.to_vec1()?;
        let scale = g.iter().fold(0f64, |m, x| m.max(x.abs())).max(1e-8);
        for i in idxs {
            let fd = (eval(name, i, h)? - eval(name, i, -h)?) / (2.0 * h);
            let err = (fd - g[i]).abs() / scale;
            assert!(
                err <= 1e-6,
                "{name}[{i}]: autograd {} vs finite difference {fd} (rel {err:e})",
                g[i]
            );
        }
    }
    Ok(())
}

#[test]
fn backbone_gradients_flow_into_every_parameter() -> Result<()> {
    for fx in ["tied_gqa", "untied_bias"] {
        let critic = Critic::init_from_hf(&fixture(fx), DType::F32, &Device::Cpu, 4)?;
        let pb = batch(critic.config().vocab_size as u32, &[8, 5, 11], 4);
        let (_, grads) = critic.forward_backward(&pb, Recompute::Full, |v| Ok(weighted_sum(v, 5)?))?;
        let names: Vec<String> = critic.named_parameters().into_iter().map(|(n, _)| n).collect();
        let got: Vec<String> = grads.params.keys().cloned().collect();
        let mut want = names.clone();
        want.sort();
        assert_eq!(got, want, "{fx}: gradient names differ from the trainable parameters");
        for (name, var) in critic.named_parameters() {
            let g = &grads.params[&name];
            assert_eq!(g.dims(), var.dims(), "{fx}: {name}");
            assert!(abs_sum(g)? > 0.0, "{fx}: {name} got a zero gradient");
        }
    }
    Ok(())
}

#[test]
fn bf16_backbone_keeps_an_f32_value_head() -> Result<()> {
    let critic = Critic::init_from_hf(&fixture("tied_gqa"), DType::BF16, &Device::Cpu, 6)?;
    assert_eq!(critic.value_head().0.dtype(), DType::F32);
    let pb = batch(critic.config().vocab_size as u32, &[6, 9], 5);
    assert_eq!(critic.values(&pb)?.dtype(), DType::F32);
    let (_, grads) = critic.forward_backward(&pb, Recompute::None, |v| Ok(weighted_sum(v, 6)?))?;
    assert_eq!(grads.params[VALUE_HEAD_WEIGHT].dtype(), DType::F32);
    assert_eq!(grads.params["model.norm.weight"].dtype(), DType::BF16);
    Ok(())
}

#[test]
fn critic_checkpoint_round_trips_bit_exactly() -> Result<()> {
    let dev = Device::Cpu;
    let critic = Critic::init_from_hf(&fixture("untied_bias"), DType::F32, &dev, 8)?;
    // A non-zero bias, so the round trip is not trivially 0 == 0.
    let (w, b) = critic.value_head();
    b.set(&Tensor::new(&[0.375f32], &dev)?)?;
    let tmp = tempfile::tempdir()?;
    critic.save(tmp.path(), DType::F32, 1 << 14)?; // small shards: exercise the index layout
    assert!(tmp.path().join(VALUE_HEAD_FILE).is_file());
    assert!(Critic::has_value_head(tmp.path()));

    let back = Critic::load(tmp.path(), DType::F32, &dev)?;
    let (w2, b2) = back.value_head();
    assert_eq!(bits(w2.as_tensor())?, bits(w.as_tensor())?);
    assert_eq!(bits(b2.as_tensor())?, bits(b.as_tensor())?);
    let (a, z) = (critic.backbone().state_dict(), back.backbone().state_dict());
    assert_eq!(a.keys().collect::<Vec<_>>(), z.keys().collect::<Vec<_>>());
    for (name, t) in &a {
        assert_eq!(bits(t)?, bits(&z[name])?, "{name} changed in the round trip");
    }
    let pb = batch(critic.config().vocab_size as u32, &[4, 10], 6);
    assert_eq!(bits(&critic.values(&pb)?)?, bits(&back.values(&pb)?)?);
    // The directory is still a plain HF Qwen3 checkpoint.
    Qwen3::load_hf(tmp.path(), DType::F32, &dev)?;
    // Resaving into the same directory works (overwrites the head atomically).
    back.save(tmp.path(), DType::F32, 1 << 30)?;
    Critic::load(tmp.path(), DType::F32, &dev)?;
    Ok(())
}

#[test]
fn reference_logprobs_match_the_hf_fixture() -> Result<()> {
    // The HF transformers log-probs of the fixture's packed batch (tests/fixtures/hf/README.md):
    // log p(token i+1 | 0..i), 0 at each sequence's last token.
    let dir = fixture("tied_gqa");
    let expected: std::collections::BTreeMap<String, Tensor> =
        candle_core::safetensors::load(dir.join("expected.safetensors"), &Device::Cpu)?
            .into_iter()
            .collect();
    let ids: Vec<i64> = expected["input_ids"].to_vec1()?;
    let cu: Vec<i64> = expected["cu_seqlens"].to_vec1()?;
    let seqs: Vec<Vec<u32>> = cu
        .windows(2)
        .map(|w| ids[w[0] as usize..w[1] as usize].iter().map(|&t| t as u32).collect())
        .collect();
    let hf = &expected["logprobs"];
    let reference = ReferenceModel::load(&dir, DType::F32, &Device::Cpu)?;
    let pb = PackedBatch::from_sequences(&seqs)?;
    let a = reference.logprobs(&pb)?;
    assert_eq!(a.dims(), [pb.num_tokens()]);
    let e = rel_err(&a, hf)?;
    assert!(e <= 1e-5, "reference log-probs vs HF: relative error {e:.3e}");

    // Read back per response through a micro-batch: the reference log-prob of each response token
    // of sequence 1 (response = its last 4 tokens, predicted at positions L-5 .. L-2).
    let (s, response_length) = (1, 4);
    let samples = [SampleView {
        tokens: &seqs[s],
        response_length,
        loss_mask: None,
    }];
    let mb = MicroBatch::new(&samples, &[0])?;
    let per = mb.responses_from_packed(&reference.logprobs(&mb.batch)?)?;
    let hf: Vec<f32> = hf.to_vec1()?;
    let end = cu[s + 1] as usize - 1;
    let want = &hf[end - response_length..end];
    assert_eq!(per.len(), 1);
    assert_eq!(per[0].0, 0);
    assert_eq!(per[0].1.len(), response_length);
    for (x, y) in per[0].1.iter().zip(want) {
        assert!((x - y).abs() <= 1e-5 * y.abs().max(1.0), "{x} vs HF {y}");
    }
    Ok(())
}
