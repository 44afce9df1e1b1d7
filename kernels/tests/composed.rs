//! The composed ops (`vime_kernels::composed`, the path non-CPU devices run) against the fused CPU
//! kernels: forward and every input gradient in f32, f64 and bf16, the LM head's chunking, SwiGLU's
//! gradient at saturated gates, and identical validation errors. Run with `--nocapture` to see the
//! measured errors.
//!
//! bf16 compares composed bf16 with fused bf16: both compute in f32 from the same bf16 inputs and
//! round once, so they differ by at most about one bf16 ulp.
use candle_core::{DType, Device, Result, Tensor};
use std::sync::Arc;
use vime_kernels::testing::{autograd_grads, rel_err, weighted_sum, Rng};
use vime_kernels::{composed, IGNORE_TARGET};

const CPU: Device = Device::Cpu;

/// Each dtype with its bound on the norm-wise relative error of the forward and every gradient.
const DTYPES: [(DType, f64); 3] = [(DType::F32, 1e-5), (DType::F64, 1e-10), (DType::BF16, 1e-2)];

type Op<'a> = &'a dyn Fn(&[Tensor]) -> Result<Tensor>;

/// Errors as `1.2e-7, 3.4e-8` for the log.
fn sci(errs: &[f64]) -> String {
    errs.iter().map(|e| format!("{e:.1e}")).collect::<Vec<_>>().join(", ")
}

/// Checks `composed` against `fused` on `inputs`: output shape and dtype, forward, and the
/// gradient of a random weighted sum of the output with respect to every input.
fn compare(name: &str, tol: f64, fused: Op, composed: Op, inputs: &[Tensor]) -> Result<()> {
    let dtype = inputs[0].dtype();
    let (ours, theirs) = (composed(inputs)?, fused(inputs)?);
    assert_eq!(ours.dims(), theirs.dims(), "{name} {dtype:?}: output shape");
    assert_eq!(ours.dtype(), theirs.dtype(), "{name} {dtype:?}: output dtype");
    let fwd = rel_err(&ours, &theirs)?;
    let g_ours = autograd_grads(&|x| weighted_sum(&composed(x)?, 7), inputs)?;
    let g_theirs = autograd_grads(&|x| weighted_sum(&fused(x)?, 7), inputs)?;
    let mut grads = Vec::new();
    for (i, (a, b)) in g_ours.iter().zip(&g_theirs).enumerate() {
        assert_eq!(a.dtype(), inputs[i].dtype(), "{name} {dtype:?}: grad {i} dtype");
        assert_eq!(a.dims(), inputs[i].dims(), "{name} {dtype:?}: grad {i} shape");
        grads.push(rel_err(a, b)?);
    }
    eprintln!("{name:<16} {dtype:?}: forward {fwd:.1e}, grads [{}]", sci(&grads));
    assert!(fwd <= tol, "{name} {dtype:?}: forward rel err {fwd:e} > {tol:e}");
    for (i, e) in grads.iter().enumerate() {
        assert!(*e <= tol, "{name} {dtype:?}: grad of input {i} rel err {e:e} > {tol:e}");
    }
    Ok(())
}

#[test]
fn rms_norm_matches_fused() -> Result<()> {
    for (dtype, tol) in DTYPES {
        let mut rng = Rng::new(1);
        let x = rng.randn(&[9, 3, 16], 1.5, dtype, &CPU)?;
        let w = (rng.randn(&[16], 0.2, DType::F64, &CPU)? + 1.0)?.to_dtype(dtype)?;
        compare(
            "rms_norm",
            tol,
            &|t| vime_kernels::rms_norm(&t[0], &t[1], 1e-6),
            &|t| composed::rms_norm(&t[0], &t[1], 1e-6),
            &[x, w],
        )?;
    }
    Ok(())
}

#[test]
fn rope_matches_fused() -> Result<()> {
    // Three packed sequences: positions restart, and the last one starts mid-sequence with a gap
    // (a context-parallel chunk, or left-truncated prompt).
    let positions: Arc<[u32]> = Arc::from(vec![0u32, 1, 2, 3, 4, 0, 1, 2, 17, 18, 19, 40, 41]);
    for (dtype, tol) in DTYPES {
        let x = Rng::new(2).randn(&[13, 3, 16], 1.0, dtype, &CPU)?;
        for theta in [1e4, 1e6] {
            compare(
                &format!("rope theta={theta:e}"),
                tol,
                &|t| vime_kernels::rope(&t[0], &positions, theta),
                &|t| composed::rope(&t[0], &positions, theta),
                std::slice::from_ref(&x),
            )?;
        }
    }
    Ok(())
}

#[test]
fn swiglu_matches_fused() -> Result<()> {
    for (dtype, tol) in DTYPES {
        let mut rng = Rng::new(3);
        let g = rng.randn(&[7, 24], 2.0, dtype, &CPU)?;
        let u = rng.randn(&[7, 24], 1.0, dtype, &CPU)?;
        compare(
            "swiglu",
            tol,
            &|t| vime_kernels::swiglu(&t[0], &t[1]),
            &|t| composed::swiglu(&t[0], &t[1]),
            &[g, u],
        )?;
    }
    Ok(())
}

#[test]
fn swiglu_gradient_is_finite_at_saturated_gates() -> Result<()> {
    // exp(-gate) overflows f32 below about -88; a sigmoid composed from exp/recip would give a NaN
    // gradient there.
    let g = Tensor::new(&[[-1000f32, -100.0, -89.0, 0.0, 89.0, 100.0, 1000.0]], &CPU)?;
    let u = Tensor::new(&[[1f32, -2.0, 3.0, -4.0, 5.0, -6.0, 7.0]], &CPU)?;
    compare(
        "swiglu saturated",
        1e-5,
        &|t| vime_kernels::swiglu(&t[0], &t[1]),
        &|t| composed::swiglu(&t[0], &t[1]),
        &[g.clone(), u.clone()],
    )?;
    let grads = autograd_grads(&|x| composed::swiglu(&x[0], &x[1])?.sum_all(), &[g, u])?;
    for grad in grads {
        let v: Vec<f32> = grad.flatten_all()?.to_vec1()?;
        assert!(v.iter().all(|x| x.is_finite()), "non-finite gradient {v:?}");
    }
    Ok(())
}

fn cu(lens: &[u32]) -> Arc<[u32]> {
    let mut out = vec![0u32];
    for &l in lens {
        out.push(out.last().unwrap() + l);
    }
    out.into()
}

#[test]
fn varlen_attention_matches_fused() -> Result<()> {
    // GQA (4 query heads on 2 kv heads); sequences of 5, 3 and 4 queries, the second a query chunk
    // (7 keys, bottom-right aligned), plus a sequence with keys but no queries.
    let (cu_q, cu_k) = (cu(&[5, 3, 0, 4]), cu(&[5, 7, 2, 4]));
    let (h, hkv, d) = (4, 2, 16);
    let scale = 1.0 / (d as f64).sqrt();
    for (dtype, tol) in DTYPES {
        let mut rng = Rng::new(4);
        let q = rng.randn(&[12, h, d], 1.0, dtype, &CPU)?;
        let k = rng.randn(&[18, hkv, d], 1.0, dtype, &CPU)?;
        let v = rng.randn(&[18, hkv, d], 1.0, dtype, &CPU)?;
        compare(
            "varlen_attention",
            tol,
            &|t| vime_kernels::varlen_attention(&t[0], &t[1], &t[2], &cu_q, &cu_k, scale, &Default::default()),
            &|t| composed::varlen_attention(&t[0], &t[1], &t[2], &cu_q, &cu_k, scale),
            &[q, k, v],
        )?;
    }
    Ok(())
}

/// `(hidden [t, h], lm_head [v, h])`, scaled so logits are O(1), and targets with `ignored` tokens.
fn lm_head_case(t: usize, h: usize, v: usize, ignored: &[usize], dtype: DType) -> Result<(Tensor, Tensor, Arc<[u32]>)> {
    let mut rng = Rng::new(5);
    let hidden = rng.randn(&[t, h], 1.0, dtype, &CPU)?;
    let lm_head = rng.randn(&[v, h], 2.0 / (h as f64).sqrt(), dtype, &CPU)?;
    let targets = (0..t)
        .map(|i| {
            if ignored.contains(&i) {
                IGNORE_TARGET
            } else {
                (rng.next_u64() % v as u64) as u32
            }
        })
        .collect();
    Ok((hidden, lm_head, targets))
}

/// `logprobs_entropy` as one `[2, T]` tensor (logprob row, entropy row).
fn stacked(out: (Tensor, Tensor)) -> Result<Tensor> {
    Tensor::stack(&[out.0, out.1], 0)
}

#[test]
fn logprobs_entropy_matches_fused() -> Result<()> {
    let chunk = 4;
    for (dtype, tol) in DTYPES {
        let (hidden, lm_head, tg) = lm_head_case(11, 16, 37, &[3, 8], dtype)?;
        let (lp, ent) = composed::logprobs_entropy(&hidden, &lm_head, &tg, chunk)?;
        let out_dtype = if dtype == DType::F64 { DType::F64 } else { DType::F32 };
        for out in [&lp, &ent] {
            assert_eq!(out.dims(), [11]);
            assert_eq!(out.dtype(), out_dtype, "outputs are f32, or f64 for f64 inputs");
        }
        let lp: Vec<f64> = lp.to_dtype(DType::F64)?.to_vec1()?;
        assert_eq!((lp[3], lp[8]), (0.0, 0.0), "ignored tokens have logprob 0");
        let ent: Vec<f64> = ent.to_dtype(DType::F64)?.to_vec1()?;
        assert!(
            ent.iter().all(|&e| e > 0.0),
            "entropy is computed for every token: {ent:?}"
        );
        compare(
            "logprobs_entropy",
            tol,
            &|t| stacked(vime_kernels::logprobs_entropy(&t[0], &t[1], &tg, chunk)?),
            &|t| stacked(composed::logprobs_entropy(&t[0], &t[1], &tg, chunk)?),
            &[hidden, lm_head],
        )?;
    }
    Ok(())
}

#[test]
fn logprobs_entropy_does_not_depend_on_the_chunk() -> Result<()> {
    let t = 11;
    let (hidden, lm_head, tg) = lm_head_case(t, 16, 37, &[0, 6], DType::F32)?;
    let run = |chunk: usize| -> Result<Vec<Tensor>> {
        let f = |x: &[Tensor]| stacked(composed::logprobs_entropy(&x[0], &x[1], &tg, chunk)?);
        let mut out = vec![f(&[hidden.clone(), lm_head.clone()])?];
        out.extend(autograd_grads(
            &|x| weighted_sum(&f(x)?, 9),
            &[hidden.clone(), lm_head.clone()],
        )?);
        Ok(out)
    };
    let whole = run(t)?;
    for chunk in [1, 3] {
        let errs = run(chunk)?
            .iter()
            .zip(&whole)
            .map(|(a, b)| rel_err(a, b))
            .collect::<Result<Vec<_>>>()?;
        eprintln!(
            "chunk {chunk} vs {t}: [forward, d_hidden, d_lm_head] rel err [{}]",
            sci(&errs)
        );
        for (name, e) in ["forward", "d_hidden", "d_lm_head"].iter().zip(errs) {
            assert!(e <= 1e-6, "chunk {chunk}: {name} differs from chunk {t} by {e:e}");
        }
    }
    Ok(())
}

/// The first line of an error (a backtrace, when enabled, follows it).
fn message<T>(r: Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.to_string().lines().next().unwrap_or_default().to_string(),
    }
}

fn same_error<T>(case: &str, fused: Result<T>, composed: Result<T>) {
    let (a, b) = (message(fused), message(composed));
    assert_eq!(a, b, "{case}: fused and composed errors differ");
}

#[test]
fn bad_inputs_give_the_fused_errors() -> Result<()> {
    let z = |shape: &[usize], dtype: DType| Tensor::zeros(shape, dtype, &CPU);
    let f32z = |shape: &[usize]| z(shape, DType::F32);
    let arc = |v: &[u32]| -> Arc<[u32]> { v.into() };

    let (x, w) = (f32z(&[3, 8])?, f32z(&[8])?);
    same_error(
        "rms_norm weight",
        vime_kernels::rms_norm(&x, &f32z(&[7])?, 1e-6),
        composed::rms_norm(&x, &f32z(&[7])?, 1e-6),
    );
    let w64 = w.to_dtype(DType::F64)?;
    same_error(
        "rms_norm dtypes",
        vime_kernels::rms_norm(&x, &w64, 1e-6),
        composed::rms_norm(&x, &w64, 1e-6),
    );

    let x3 = f32z(&[3, 2, 8])?;
    for (case, x, pos) in [
        ("rope positions", &x3, arc(&[0, 1])),
        ("rope odd head_dim", &f32z(&[3, 2, 7])?, arc(&[0, 1, 2])),
        ("rope rank", &x, arc(&[0, 1, 2])),
    ] {
        same_error(case, vime_kernels::rope(x, &pos, 1e4), composed::rope(x, &pos, 1e4));
    }

    let u = f32z(&[3, 7])?;
    same_error("swiglu shapes", vime_kernels::swiglu(&x, &u), composed::swiglu(&x, &u));
    let x64 = x.to_dtype(DType::F64)?;
    same_error(
        "swiglu dtypes",
        vime_kernels::swiglu(&x, &x64),
        composed::swiglu(&x, &x64),
    );

    let (q, k) = (f32z(&[9, 4, 8])?, f32z(&[9, 2, 8])?);
    let ok = cu(&[5, 4]);
    let (qi, ki) = (q.to_dtype(DType::U32)?, k.to_dtype(DType::U32)?);
    let (k0, k4, v1) = (f32z(&[9, 0, 8])?, f32z(&[9, 2, 4])?, f32z(&[9, 1, 8])?);
    let (q3, k64, q2) = (f32z(&[9, 3, 8])?, k.to_dtype(DType::F64)?, q.flatten_from(1)?);
    let attention_cases = [
        ("cu_q start", &q, &k, &k, arc(&[1, 5, 9]), ok.clone(), 0.5),
        ("cu end", &q, &k, &k, arc(&[0, 5, 8]), arc(&[0, 5, 8]), 0.5),
        ("cu_k monotone", &q, &k, &k, ok.clone(), arc(&[0, 6, 4, 9]), 0.5),
        ("cu_q empty", &q, &k, &k, arc(&[]), ok.clone(), 0.5),
        ("sequence counts", &q, &k, &k, arc(&[0, 9]), ok.clone(), 0.5),
        ("lk < lq", &q, &k, &k, ok.clone(), arc(&[0, 3, 9]), 0.5),
        ("heads", &q3, &k, &k, ok.clone(), ok.clone(), 0.5),
        ("zero kv heads", &q, &k0, &k0, ok.clone(), ok.clone(), 0.5),
        ("head_dim", &q, &k4, &k4, ok.clone(), ok.clone(), 0.5),
        ("k/v shapes", &q, &k, &v1, ok.clone(), ok.clone(), 0.5),
        ("dtypes", &q, &k, &k64, ok.clone(), ok.clone(), 0.5),
        ("rank", &q2, &k, &k, ok.clone(), ok.clone(), 0.5),
        ("unsupported dtype", &qi, &ki, &ki, ok.clone(), ok.clone(), 0.5),
        ("scale", &q, &k, &k, ok.clone(), ok.clone(), f64::NAN),
    ];
    for (case, q, k, v, cu_q, cu_k, scale) in attention_cases {
        same_error(
            &format!("varlen_attention {case}"),
            vime_kernels::varlen_attention(q, k, v, &cu_q, &cu_k, scale, &Default::default()),
            composed::varlen_attention(q, k, v, &cu_q, &cu_k, scale),
        );
    }

    let (hidden, lm_head) = (f32z(&[4, 3])?, f32z(&[5, 3])?);
    let (wide, hidden3, lm_bf16) = (f32z(&[5, 6])?, hidden.unsqueeze(0)?, lm_head.to_dtype(DType::BF16)?);
    let good = arc(&[0, 1, 2, 3]);
    let lm_head_cases = [
        ("target range", &hidden, &lm_head, arc(&[0, 1, 5, 2]), 2),
        ("hidden size", &hidden, &wide, good.clone(), 2),
        ("target count", &hidden, &lm_head, arc(&[0, 1, 2]), 2),
        ("hidden rank", &hidden3, &lm_head, good.clone(), 2),
        ("empty vocabulary", &hidden, &f32z(&[0, 3])?, good.clone(), 2),
        ("chunk", &hidden, &lm_head, good.clone(), 0),
        ("dtypes", &hidden, &lm_bf16, good.clone(), 2),
    ];
    for (case, hidden, lm_head, tg, chunk) in lm_head_cases {
        same_error(
            &format!("logprobs_entropy {case}"),
            vime_kernels::logprobs_entropy(hidden, lm_head, &tg, chunk),
            composed::logprobs_entropy(hidden, lm_head, &tg, chunk),
        );
    }
    Ok(())
}

/// Every gradient pair `(ours, theirs)` within `tol` (norm-wise relative error).
fn close(name: &str, tol: f64, pairs: &[(&Tensor, &Tensor)]) -> Result<()> {
    for (i, (a, b)) in pairs.iter().enumerate() {
        assert_eq!(a.dims(), b.dims(), "{name}: gradient {i} shape");
        let e = rel_err(&a.to_dtype(DType::F64)?, &b.to_dtype(DType::F64)?)?;
        assert!(e <= tol, "{name}: gradient {i} relative error {e:e} > {tol:e}");
    }
    Ok(())
}

/// The explicit backward forms that the kernels fall back to where no kernel exists (the
/// composed op under a local autograd graph) give the CPU kernels' explicit gradients.
#[test]
fn explicit_fallbacks_match_the_kernels() -> Result<()> {
    let mut rng = Rng::new(23);
    for (dtype, tol) in [(DType::F64, 1e-10), (DType::F32, 1e-5)] {
        let x = rng.randn(&[6, 3, 8], 1.0, dtype, &CPU)?;
        let w = (rng.randn(&[8], 0.2, dtype, &CPU)? + 1.0)?;
        let dy = rng.randn(&[6, 3, 8], 1.0, dtype, &CPU)?;
        let (a, b) = composed::rms_norm_backward(&x, &w, 1e-6, &dy)?;
        let (c, d) = vime_kernels::rms_norm_backward(&x, &w, 1e-6, &dy)?;
        close("rms_norm_backward", tol, &[(&a, &c), (&b, &d)])?;

        let p: Arc<[u32]> = vec![0u32, 1, 2, 7, 0, 3].into();
        let a = composed::rope_backward(&dy, &p, 1e4)?;
        let c = vime_kernels::rope_backward(&dy, &p, 1e4)?;
        // The CPU kernel computes its angles in f32 (see the composed module docs).
        close("rope_backward", tol.max(1e-6), &[(&a, &c)])?;

        let (g, u) = (
            rng.randn(&[5, 7], 2.0, dtype, &CPU)?,
            rng.randn(&[5, 7], 1.0, dtype, &CPU)?,
        );
        let dy = rng.randn(&[5, 7], 1.0, dtype, &CPU)?;
        let (a, b) = composed::swiglu_backward(&g, &u, &dy)?;
        let (c, d) = vime_kernels::swiglu_backward(&g, &u, &dy)?;
        close("swiglu_backward", tol, &[(&a, &c), (&b, &d)])?;

        let (cq, ck) = (cu(&[3, 1, 4]), cu(&[5, 1, 4]));
        let q = rng.randn(&[8, 4, 8], 1.0, dtype, &CPU)?;
        let k = rng.randn(&[10, 2, 8], 1.0, dtype, &CPU)?;
        let v = rng.randn(&[10, 2, 8], 1.0, dtype, &CPU)?;
        let dout = rng.randn(&[8, 4, 8], 1.0, dtype, &CPU)?;
        let kc = vime_kernels::KernelConfig::default();
        let (o1, graph) = composed::Graph::run(&[&q, &k, &v], |t| {
            composed::varlen_attention(&t[0], &t[1], &t[2], &cq, &ck, 0.3)
        })?;
        let g1 = graph.backward(&dout)?;
        let (o2, saved) = vime_kernels::varlen_attention_saved(&q, &k, &v, &cq, &ck, 0.3, &kc)?;
        let (dq, dk, dv) = vime_kernels::varlen_attention_backward(&saved, &q, &k, &v, &o2, &dout)?;
        close(
            "attention",
            tol,
            &[(&o1, &o2), (&g1[0], &dq), (&g1[1], &dk), (&g1[2], &dv)],
        )?;

        let (h, lm, tg) = lm_head_case(9, 8, 13, &[2, 8], dtype)?;
        let (dlp, dent) = (rng.randn(&[9], 1.0, dtype, &CPU)?, rng.randn(&[9], 1.0, dtype, &CPU)?);
        let (out, graph) = composed::Graph::run(&[&h, &lm], |t| {
            stacked(composed::logprobs_entropy(&t[0], &t[1], &tg, 4)?)
        })?;
        let acc = out.dtype();
        let g1 = graph.backward(&Tensor::stack(&[dlp.to_dtype(acc)?, dent.to_dtype(acc)?], 0)?)?;
        let (lp, ent, saved) = vime_kernels::logprobs_entropy_saved(&h, &lm, &tg, 4)?;
        let (dh, dw) =
            vime_kernels::logprobs_entropy_backward(&saved, &h, &lm, &dlp.to_dtype(acc)?, &dent.to_dtype(acc)?)?;
        close(
            "lm head",
            tol,
            &[(&out, &stacked((lp, ent))?), (&g1[0], &dh), (&g1[1], &dw)],
        )?;
    }
    Ok(())
}
