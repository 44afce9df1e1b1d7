//! RMSNorm, RoPE and SwiGLU: forward and backward against composed candle ops (f32) and against
//! central finite differences (f64), bf16 forward against f32, and the backward never dropping a
//! gradient (every input gets one).
use candle_core::{DType, Device, Result, Tensor, D};
use std::sync::Arc;
use vime_kernels::testing::{autograd_grads, finite_diff_grads, rel_err, weighted_sum, Rng};
use vime_kernels::{rms_norm, rope, swiglu};

const CPU: Device = Device::Cpu;

/// Composed reference: HF Qwen3RMSNorm, `w * x * rsqrt(mean(x^2) + eps)`.
fn rms_norm_ref(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)?.broadcast_mul(w)
}

/// Composed reference: HF `apply_rotary_pos_emb` with `rotate_half`, cos/sin from f64 angles.
fn rope_ref(x: &Tensor, positions: &[u32], theta: f64) -> Result<Tensor> {
    let (t, _h, d) = x.dims3()?;
    let half = d / 2;
    let mut cos = Vec::with_capacity(t * d);
    let mut sin = Vec::with_capacity(t * d);
    for &p in positions {
        for _ in 0..2 {
            for j in 0..half {
                let a = p as f64 / theta.powf((2 * j) as f64 / d as f64);
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
    }
    let cos = Tensor::from_vec(cos, (t, 1, d), x.device())?.to_dtype(x.dtype())?;
    let sin = Tensor::from_vec(sin, (t, 1, d), x.device())?.to_dtype(x.dtype())?;
    let x1 = x.narrow(2, 0, half)?;
    let x2 = x.narrow(2, half, half)?;
    let rot = Tensor::cat(&[&x2.neg()?, &x1], 2)?;
    x.broadcast_mul(&cos)? + rot.broadcast_mul(&sin)?
}

fn swiglu_ref(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    let sig = (g.neg()?.exp()? + 1.0)?.recip()?;
    (g * sig)? * u
}

fn check_against(
    name: &str,
    ours: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    reference: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    inputs: &[Tensor],
    fwd_tol: f64,
    grad_tol: f64,
) -> Result<()> {
    let (a, b) = (ours(inputs)?, reference(inputs)?);
    let e = rel_err(&a, &b)?;
    assert!(e <= fwd_tol, "{name}: forward rel err {e:e} > {fwd_tol:e}");
    let obj_ours = |x: &[Tensor]| weighted_sum(&ours(x)?, 7);
    let obj_ref = |x: &[Tensor]| weighted_sum(&reference(x)?, 7);
    let ga = autograd_grads(&obj_ours, inputs)?;
    let gb = autograd_grads(&obj_ref, inputs)?;
    for (i, (ga, gb)) in ga.iter().zip(&gb).enumerate() {
        assert_eq!(ga.dtype(), inputs[i].dtype(), "{name}: grad {i} dtype");
        let e = rel_err(ga, gb)?;
        assert!(e <= grad_tol, "{name}: grad of input {i} rel err {e:e} > {grad_tol:e}");
        let n = ga.to_dtype(DType::F64)?.abs()?.sum_all()?.to_scalar::<f64>()?;
        assert!(n > 0.0, "{name}: grad of input {i} is all zeros");
    }
    Ok(())
}

fn check_finite_diff(name: &str, f: &dyn Fn(&[Tensor]) -> Result<Tensor>, inputs: &[Tensor]) -> Result<()> {
    let obj = |x: &[Tensor]| weighted_sum(&f(x)?, 11);
    let auto = autograd_grads(&obj, inputs)?;
    let fd = finite_diff_grads(&obj, inputs, 1e-6)?;
    for (i, (a, n)) in auto.iter().zip(&fd).enumerate() {
        let e = rel_err(a, n)?;
        assert!(e <= 1e-6, "{name}: finite-difference check of input {i}: rel err {e:e}");
    }
    Ok(())
}

fn positions() -> Arc<[u32]> {
    // two packed sequences (5 and 4 tokens), positions restart
    Arc::from(vec![0u32, 1, 2, 3, 4, 0, 1, 2, 3])
}

#[test]
fn rms_norm_matches_composed_f32() -> Result<()> {
    let mut rng = Rng::new(1);
    let x = rng.randn(&[9, 3, 16], 1.5, DType::F32, &CPU)?;
    let w = (rng.randn(&[16], 0.2, DType::F32, &CPU)? + 1.0)?;
    check_against(
        "rms_norm",
        &|t| rms_norm(&t[0], &t[1], 1e-6),
        &|t| rms_norm_ref(&t[0], &t[1], 1e-6),
        &[x, w],
        1e-6,
        1e-5,
    )
}

#[test]
fn rms_norm_finite_differences_f64() -> Result<()> {
    let mut rng = Rng::new(2);
    let x = rng.randn(&[5, 6], 1.0, DType::F64, &CPU)?;
    let w = (rng.randn(&[6], 0.3, DType::F64, &CPU)? + 1.0)?;
    check_finite_diff("rms_norm", &|t| rms_norm(&t[0], &t[1], 1e-5), &[x, w])
}

#[test]
fn rope_matches_composed_f32() -> Result<()> {
    let mut rng = Rng::new(3);
    let x = rng.randn(&[9, 4, 16], 1.0, DType::F32, &CPU)?;
    let pos = positions();
    check_against(
        "rope",
        &|t| rope(&t[0], &pos, 10000.0),
        &|t| rope_ref(&t[0], &pos, 10000.0),
        &[x],
        1e-6,
        1e-6,
    )
}

#[test]
fn rope_finite_differences_f64() -> Result<()> {
    let mut rng = Rng::new(4);
    let x = rng.randn(&[9, 2, 8], 1.0, DType::F64, &CPU)?;
    let pos = positions();
    check_finite_diff("rope", &|t| rope(&t[0], &pos, 1_000_000.0), &[x])?;
    // f64 forward also equals the composed reference to f64 precision
    let e = rel_err(&rope(&x_again(4)?, &pos, 1e6)?, &rope_ref(&x_again(4)?, &pos, 1e6)?)?;
    assert!(e < 1e-12, "rope f64 forward rel err {e:e}");
    Ok(())
}

fn x_again(seed: u64) -> Result<Tensor> {
    Rng::new(seed).randn(&[9, 2, 8], 1.0, DType::F64, &CPU)
}

#[test]
fn rope_position_zero_is_identity_and_rotation_preserves_norm() -> Result<()> {
    let x = Rng::new(5).randn(&[3, 2, 8], 1.0, DType::F64, &CPU)?;
    let y = rope(&x, &Arc::from(vec![0u32, 7, 300]), 10000.0)?;
    let row0 = (y.get(0)? - x.get(0)?)?.abs()?.max_all()?.to_scalar::<f64>()?;
    assert!(row0 < 1e-15, "position 0 must be the identity");
    let nx = x.sqr()?.sum(2)?;
    let ny = y.sqr()?.sum(2)?;
    assert!(rel_err(&ny, &nx)? < 1e-12, "rotation must preserve each head's norm");
    Ok(())
}

#[test]
fn swiglu_matches_composed_f32() -> Result<()> {
    let mut rng = Rng::new(6);
    let g = rng.randn(&[7, 24], 2.0, DType::F32, &CPU)?;
    let u = rng.randn(&[7, 24], 1.0, DType::F32, &CPU)?;
    check_against(
        "swiglu",
        &|t| swiglu(&t[0], &t[1]),
        &|t| swiglu_ref(&t[0], &t[1]),
        &[g, u],
        1e-6,
        1e-5,
    )
}

#[test]
fn swiglu_finite_differences_f64() -> Result<()> {
    let mut rng = Rng::new(7);
    let g = rng.randn(&[4, 5], 2.0, DType::F64, &CPU)?;
    let u = rng.randn(&[4, 5], 1.0, DType::F64, &CPU)?;
    check_finite_diff("swiglu", &|t| swiglu(&t[0], &t[1]), &[g, u])
}

#[test]
fn bf16_forward_and_backward_track_f32() -> Result<()> {
    let mut rng = Rng::new(8);
    // bf16-representable inputs, so the only difference is the output rounding
    let x = rng.randn(&[9, 4, 16], 1.0, DType::BF16, &CPU)?;
    let w = (rng.randn(&[16], 0.2, DType::F32, &CPU)? + 1.0)?.to_dtype(DType::BF16)?;
    let u = rng.randn(&[9, 4, 16], 1.0, DType::BF16, &CPU)?;
    let pos = positions();
    let f32_of = |t: &Tensor| t.to_dtype(DType::F32);
    let cases: Vec<(&str, Tensor, Tensor)> = vec![
        (
            "rms_norm",
            rms_norm(&x, &w, 1e-6)?,
            rms_norm(&f32_of(&x)?, &f32_of(&w)?, 1e-6)?,
        ),
        ("rope", rope(&x, &pos, 1e6)?, rope(&f32_of(&x)?, &pos, 1e6)?),
        ("swiglu", swiglu(&x, &u)?, swiglu(&f32_of(&x)?, &f32_of(&u)?)?),
    ];
    for (name, lo, hi) in cases {
        assert_eq!(lo.dtype(), DType::BF16, "{name}: output dtype follows the input");
        let e = rel_err(&lo, &hi)?;
        assert!(e <= 8e-3, "{name}: bf16 vs f32 rel err {e:e}");
    }
    let obj = |t: &[Tensor]| weighted_sum(&swiglu(&rms_norm(&t[0], &t[1], 1e-6)?, &rope(&t[2], &pos, 1e6)?)?, 3);
    let g16 = autograd_grads(&obj, &[x.clone(), w.clone(), u.clone()])?;
    let g32 = autograd_grads(&obj, &[f32_of(&x)?, f32_of(&w)?, f32_of(&u)?])?;
    for (i, (a, b)) in g16.iter().zip(&g32).enumerate() {
        assert_eq!(a.dtype(), DType::BF16);
        let e = rel_err(a, b)?;
        assert!(e <= 3e-2, "bf16 grad {i} rel err {e:e}");
    }
    Ok(())
}

#[test]
fn shape_errors_are_clear() {
    let x = Tensor::zeros((3, 8), DType::F32, &CPU).unwrap();
    let w = Tensor::zeros(7, DType::F32, &CPU).unwrap();
    let e = rms_norm(&x, &w, 1e-6).unwrap_err().to_string();
    assert!(e.contains("weight shape") && e.contains("[7]"), "{e}");
    let x3 = Tensor::zeros((3, 2, 8), DType::F32, &CPU).unwrap();
    let e = rope(&x3, &Arc::from(vec![0u32, 1]), 1e4).unwrap_err().to_string();
    assert!(e.contains("2 positions for 3 tokens"), "{e}");
    let e = swiglu(&x, &Tensor::zeros((3, 7), DType::F32, &CPU).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("differ in shape"), "{e}");
}
