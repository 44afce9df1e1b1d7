use candle_core::{DType, Device, Result, Tensor};
use std::sync::Arc;
use vime_kernels::testing::{autograd_grads, finite_diff_grads, rel_err, Rng};
use vime_kernels::{logprobs_entropy, IGNORE_TARGET};

const T: usize = 11;
const H: usize = 16;
const V: usize = 37;

/// Random targets in `0..v`, with the listed tokens ignored.
fn targets(t: usize, v: usize, ignored: &[usize], seed: u64) -> Arc<[u32]> {
    let mut rng = Rng::new(seed);
    (0..t)
        .map(|i| {
            if ignored.contains(&i) {
                IGNORE_TARGET
            } else {
                (rng.next_u64() % v as u64) as u32
            }
        })
        .collect()
}

/// `(hidden [t, h], lm_head [v, h])`, scaled so logits are O(1).
fn inputs(t: usize, h: usize, v: usize, dtype: DType, seed: u64) -> Result<(Tensor, Tensor)> {
    let mut rng = Rng::new(seed);
    let hidden = rng.randn(&[t, h], 1.0, dtype, &Device::Cpu)?;
    let lm_head = rng.randn(&[v, h], 1.0 / (h as f64).sqrt() * 2.0, dtype, &Device::Cpu)?;
    Ok((hidden, lm_head))
}

/// Log-prob and entropy composed from candle ops that all have a backward.
fn reference(hidden: &Tensor, lm_head: &Tensor, targets: &[u32]) -> Result<(Tensor, Tensor)> {
    let (t, _) = hidden.dims2()?;
    let v = lm_head.dim(0)?;
    let logits = hidden.matmul(&lm_head.t()?)?;
    let z = logits.broadcast_sub(&logits.max_keepdim(1)?.detach())?;
    let lse = z.exp()?.sum_keepdim(1)?.log()?;
    let logp = z.broadcast_sub(&lse)?;
    let p = logp.exp()?;
    let entropy = (p * &logp)?.sum(1)?.neg()?;
    let mut onehot = vec![0f64; t * v];
    for (i, &tg) in targets.iter().enumerate() {
        if tg != IGNORE_TARGET {
            onehot[i * v + tg as usize] = 1.0;
        }
    }
    let onehot = Tensor::from_vec(onehot, (t, v), hidden.device())?.to_dtype(hidden.dtype())?;
    let logprobs = (logp * onehot)?.sum(1)?;
    Ok((logprobs, entropy))
}

/// Weights `(a, b)` of the objective `sum(a * logprob) + sum(b * entropy)`; `a = 0` where ignored.
fn weights(targets: &[u32], dtype: DType, seed: u64) -> Result<(Tensor, Tensor)> {
    let mut rng = Rng::new(seed);
    let t = targets.len();
    let a: Vec<f64> = targets
        .iter()
        .map(|&tg| if tg == IGNORE_TARGET { 0.0 } else { rng.normal() })
        .collect::<Vec<_>>();
    let b: Vec<f64> = (0..t).map(|_| rng.normal()).collect();
    Ok((
        Tensor::from_vec(a, t, &Device::Cpu)?.to_dtype(dtype)?,
        Tensor::from_vec(b, t, &Device::Cpu)?.to_dtype(dtype)?,
    ))
}

fn objective(lp: &Tensor, ent: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    (lp * a)?.sum_all()? + (ent * b)?.sum_all()?
}

fn bits(x: &Tensor) -> Result<Vec<u64>> {
    Ok(x.to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?
        .into_iter()
        .map(f64::to_bits)
        .collect())
}

#[test]
fn matches_composed_reference_f32() -> Result<()> {
    let (hidden, lm_head) = inputs(T, H, V, DType::F32, 1)?;
    let tg = targets(T, V, &[3, 8], 2);
    let (lp, ent) = logprobs_entropy(&hidden, &lm_head, &tg, 4)?;
    let (lp_ref, ent_ref) = reference(&hidden, &lm_head, &tg)?;
    assert_eq!(lp.dims(), [T]);
    assert_eq!(ent.dims(), [T]);
    assert_eq!(lp.dtype(), DType::F32);
    let lp_v: Vec<f32> = lp.to_vec1()?;
    assert_eq!(lp_v[3], 0.0);
    assert_eq!(lp_v[8], 0.0);
    assert!(ent
        .to_vec1::<f32>()?
        .iter()
        .all(|&e| e > 0.0 && e <= (V as f32).ln() + 1e-5));
    let e_lp = rel_err(&lp, &lp_ref)?;
    let e_ent = rel_err(&ent, &ent_ref)?;
    assert!(e_lp <= 1e-5, "logprob rel err {e_lp}");
    assert!(e_ent <= 1e-5, "entropy rel err {e_ent}");

    let (a, b) = weights(&tg, DType::F32, 3)?;
    let ours = autograd_grads(
        &|x| {
            let (lp, ent) = logprobs_entropy(&x[0], &x[1], &tg, 4)?;
            objective(&lp, &ent, &a, &b)
        },
        &[hidden.clone(), lm_head.clone()],
    )?;
    let theirs = autograd_grads(
        &|x| {
            let (lp, ent) = reference(&x[0], &x[1], &tg)?;
            objective(&lp, &ent, &a, &b)
        },
        &[hidden, lm_head],
    )?;
    for (name, o, r) in [("hidden", &ours[0], &theirs[0]), ("lm_head", &ours[1], &theirs[1])] {
        assert_eq!(o.dims(), r.dims());
        let e = rel_err(o, r)?;
        assert!(e <= 1e-4, "d_{name} rel err {e}");
    }
    Ok(())
}

#[test]
fn grads_match_finite_differences_f64() -> Result<()> {
    let (t, h, v) = (5, 4, 7);
    let (hidden, lm_head) = inputs(t, h, v, DType::F64, 4)?;
    let tg = targets(t, v, &[2], 5);
    let (a, b) = weights(&tg, DType::F64, 6)?;
    let f = |x: &[Tensor]| -> Result<Tensor> {
        let (lp, ent) = logprobs_entropy(&x[0], &x[1], &tg, 2)?;
        assert_eq!(lp.dtype(), DType::F64);
        objective(&lp, &ent, &a, &b)
    };
    let inputs = [hidden, lm_head];
    let ours = autograd_grads(&f, &inputs)?;
    let fd = finite_diff_grads(&f, &inputs, 1e-5)?;
    for (name, o, r) in [("hidden", &ours[0], &fd[0]), ("lm_head", &ours[1], &fd[1])] {
        let e = rel_err(o, r)?;
        assert!(e <= 1e-6, "d_{name} rel err vs finite differences {e}");
    }
    Ok(())
}

#[test]
fn chunk_size_does_not_change_results() -> Result<()> {
    let (hidden, lm_head) = inputs(T, H, V, DType::F32, 7)?;
    let tg = targets(T, V, &[0, 10], 8);
    let (a, b) = weights(&tg, DType::F32, 9)?;
    let run = |chunk: usize| -> Result<(Tensor, Tensor, Vec<Tensor>)> {
        let (lp, ent) = logprobs_entropy(&hidden, &lm_head, &tg, chunk)?;
        let grads = autograd_grads(
            &|x| {
                let (lp, ent) = logprobs_entropy(&x[0], &x[1], &tg, chunk)?;
                objective(&lp, &ent, &a, &b)
            },
            &[hidden.clone(), lm_head.clone()],
        )?;
        Ok((lp, ent, grads))
    };
    let (lp0, ent0, g0) = run(T)?;
    for chunk in [1, 3, 1000] {
        let (lp, ent, g) = run(chunk)?;
        // A row's logits come from a GEMM whose row count is the chunk size; gemm's kernels are
        // not guaranteed to round identically for every row count, so this is a tolerance.
        for (name, x, y, tol) in [
            ("logprob", &lp, &lp0, 1e-6),
            ("entropy", &ent, &ent0, 1e-6),
            ("d_hidden", &g[0], &g0[0], 1e-6),
            ("d_lm_head", &g[1], &g0[1], 1e-6),
        ] {
            let e = rel_err(x, y)?;
            assert!(e <= tol, "chunk {chunk}: {name} differs from chunk {T} by {e}");
        }
    }
    Ok(())
}

#[test]
fn bf16_inputs_give_f32_outputs_and_bf16_grads() -> Result<()> {
    let (hidden, lm_head) = inputs(T, H, V, DType::BF16, 10)?;
    let tg = targets(T, V, &[5], 11);
    let (lp, ent) = logprobs_entropy(&hidden, &lm_head, &tg, 4)?;
    assert_eq!(lp.dtype(), DType::F32);
    assert_eq!(ent.dtype(), DType::F32);
    let (h32, w32) = (hidden.to_dtype(DType::F32)?, lm_head.to_dtype(DType::F32)?);
    let (lp32, ent32) = logprobs_entropy(&h32, &w32, &tg, 4)?;
    let e_lp = rel_err(&lp, &lp32)?;
    let e_ent = rel_err(&ent, &ent32)?;
    assert!(e_lp <= 1e-2, "bf16 logprob rel err {e_lp}");
    assert!(e_ent <= 1e-2, "bf16 entropy rel err {e_ent}");

    let (a, b) = weights(&tg, DType::F32, 12)?;
    let grads = autograd_grads(
        &|x| {
            let (lp, ent) = logprobs_entropy(&x[0], &x[1], &tg, 4)?;
            objective(&lp, &ent, &a, &b)
        },
        &[hidden, lm_head],
    )?;
    for (name, g, shape) in [("hidden", &grads[0], [T, H]), ("lm_head", &grads[1], [V, H])] {
        assert_eq!(g.dtype(), DType::BF16, "d_{name} dtype");
        assert_eq!(g.dims(), shape);
        let norm = g.to_dtype(DType::F32)?.abs()?.sum_all()?.to_scalar::<f32>()?;
        assert!(norm > 0.0 && norm.is_finite(), "d_{name} is zero or not finite: {norm}");
    }
    Ok(())
}

#[test]
fn runs_are_bitwise_deterministic() -> Result<()> {
    let (hidden, lm_head) = inputs(T, H, V, DType::F32, 13)?;
    let tg = targets(T, V, &[1, 7], 14);
    let (a, b) = weights(&tg, DType::F32, 15)?;
    let run = || -> Result<Vec<Vec<u64>>> {
        let (lp, ent) = logprobs_entropy(&hidden, &lm_head, &tg, 4)?;
        let g = autograd_grads(
            &|x| {
                let (lp, ent) = logprobs_entropy(&x[0], &x[1], &tg, 4)?;
                objective(&lp, &ent, &a, &b)
            },
            &[hidden.clone(), lm_head.clone()],
        )?;
        Ok(vec![bits(&lp)?, bits(&ent)?, bits(&g[0])?, bits(&g[1])?])
    };
    assert_eq!(run()?, run()?);
    Ok(())
}

#[test]
fn ignored_target_gets_no_logprob_gradient() -> Result<()> {
    let (hidden, lm_head) = inputs(3, 4, 5, DType::F64, 16)?;
    let tg: Arc<[u32]> = Arc::from(vec![1, IGNORE_TARGET, 4]);
    let grads = autograd_grads(
        &|x| {
            let (lp, _) = logprobs_entropy(&x[0], &x[1], &tg, 2)?;
            lp.sum_all()
        },
        &[hidden, lm_head],
    )?;
    let row: Vec<f64> = grads[0].get(1)?.to_vec1()?;
    assert!(row.iter().all(|&x| x == 0.0), "ignored token got a gradient: {row:?}");
    Ok(())
}

#[test]
fn bad_inputs_are_errors() -> Result<()> {
    let (hidden, lm_head) = inputs(4, 3, 5, DType::F32, 17)?;
    let err = |r: Result<(Tensor, Tensor)>| r.err().map(|e| e.to_string()).unwrap_or_default();

    let tg: Arc<[u32]> = Arc::from(vec![0, 1, 5, 2]);
    let msg = err(logprobs_entropy(&hidden, &lm_head, &tg, 2));
    assert!(msg.contains("token 2") && msg.contains("target 5"), "{msg}");

    let ok: Arc<[u32]> = Arc::from(vec![0, 1, 2, 3]);
    let (_, wrong_h) = inputs(4, 6, 5, DType::F32, 18)?;
    let msg = err(logprobs_entropy(&hidden, &wrong_h, &ok, 2));
    assert!(msg.contains("hidden size"), "{msg}");

    let short: Arc<[u32]> = Arc::from(vec![0, 1, 2]);
    let msg = err(logprobs_entropy(&hidden, &lm_head, &short, 2));
    assert!(msg.contains("3 targets for 4 tokens"), "{msg}");

    let msg = err(logprobs_entropy(&hidden.unsqueeze(0)?, &lm_head, &ok, 2));
    assert!(msg.contains("hidden must be [T, H]"), "{msg}");

    let msg = err(logprobs_entropy(&hidden, &lm_head, &ok, 0));
    assert!(msg.contains("chunk_tokens"), "{msg}");

    let msg = err(logprobs_entropy(&hidden, &lm_head.to_dtype(DType::BF16)?, &ok, 2));
    assert!(msg.contains("share a dtype"), "{msg}");
    Ok(())
}

/// `--lm-head-logits bf16` on the CPU kernels (bf16 inputs): the log-probs and entropy are those
/// of the logits rounded to bf16 (HF's and Megatron's head), not of the f32 logits; the backward
/// differentiates the same rounded softmax (straight through the rounding). The CUDA kernels are
/// held to these in `cuda_vs_cpu`.
#[test]
fn bf16_head_logits_are_the_rounded_logits() -> Result<()> {
    use vime_kernels::{logprobs_entropy_with, HeadLogits, KernelConfig};
    let (t, h, v) = (9, 32, 45);
    let (hidden, lm_head) = inputs(t, h, v, DType::BF16, 21)?;
    let lm_head = (lm_head * 6.0)?; // logits of a few units, where bf16's spacing is 1/64 - 1/32
    let tg = targets(t, v, &[4], 22);
    let bf = KernelConfig::default().with_head_logits(HeadLogits::Bf16).unwrap();
    let (lp, ent) = logprobs_entropy_with(&hidden, &lm_head, &tg, 4, &bf)?;
    let (lp32, ent32) = logprobs_entropy(&hidden, &lm_head, &tg, 4)?;
    // The reference: the f32 logits, rounded to bf16, then log-softmax in f64.
    let z = hidden
        .to_dtype(DType::F32)?
        .matmul(&lm_head.to_dtype(DType::F32)?.t()?)?;
    let zr = z.to_dtype(DType::BF16)?.to_dtype(DType::F64)?;
    let tg64: Vec<u32> = tg.to_vec();
    let (lp_ref, ent_ref) = reference(&zr, &Tensor::eye(v, DType::F64, &Device::Cpu)?, &tg64)?;
    let max_diff = |a: &Tensor, b: &Tensor| -> Result<f64> {
        (a.to_dtype(DType::F64)? - b.to_dtype(DType::F64)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f64>()
    };
    let (e_lp, e_ent) = (max_diff(&lp, &lp_ref)?, max_diff(&ent, &ent_ref)?);
    assert!(
        e_lp <= 2e-6 && e_ent <= 2e-6,
        "bf16-logit log-prob err {e_lp}, entropy err {e_ent}"
    );
    // The rounding shows: the f32-logit outputs are farther from this reference than the bound.
    let (d_lp, d_ent) = (max_diff(&lp32, &lp_ref)?, max_diff(&ent32, &ent_ref)?);
    assert!(
        d_lp > 1e-4 && d_ent > 1e-5,
        "f32 logits within {d_lp} / {d_ent} of the rounded ones"
    );

    // Backward: the kernel's gradients against autograd over the rounded reference, whose
    // rounding (a detached correction) passes the gradient straight through.
    let (a, b) = weights(&tg, DType::F32, 23)?;
    let grads = autograd_grads(
        &|x| {
            let (lp, ent) = logprobs_entropy_with(&x[0], &x[1], &tg, 4, &bf)?;
            objective(&lp, &ent, &a, &b)
        },
        &[hidden.clone(), lm_head.clone()],
    )?;
    let (a64, b64) = (a.to_dtype(DType::F64)?, b.to_dtype(DType::F64)?);
    let want = autograd_grads(
        &|x| {
            let z = x[0].matmul(&x[1].t()?)?;
            let zr = (&z + (z.to_dtype(DType::F32)?.to_dtype(DType::BF16)?.to_dtype(DType::F64)? - &z)?.detach())?;
            let (lp, ent) = reference(&zr, &Tensor::eye(v, DType::F64, &Device::Cpu)?, &tg64)?;
            objective(&lp, &ent, &a64, &b64)
        },
        &[hidden.to_dtype(DType::F64)?, lm_head.to_dtype(DType::F64)?],
    )?;
    for (name, g, w) in [("hidden", &grads[0], &want[0]), ("lm_head", &grads[1], &want[1])] {
        let e = rel_err(&g.to_dtype(DType::F64)?, w)?;
        assert!(e <= 1e-2, "d_{name} rel err {e} against the rounded reference");
    }
    // Refused with the batch-invariant kernels (their head keeps f32 logits).
    let inv = KernelConfig::default().with_batch_invariant(true);
    let err = inv.with_head_logits(HeadLogits::Bf16).unwrap_err();
    assert!(err.contains("--true-on-policy-mode"), "{err}");
    Ok(())
}
