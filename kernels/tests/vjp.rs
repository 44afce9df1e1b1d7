//! `vjp_seed(y, g).backward()` must give exactly the gradients of `(y * g).sum_all().backward()`.
use candle_core::{DType, Device, Result, Tensor, Var};
use vime_kernels::testing::{rel_err, Rng};
use vime_kernels::{rms_norm, swiglu, vjp_seed};

#[test]
fn seeds_the_same_gradients_as_the_weighted_sum() -> Result<()> {
    let dev = Device::Cpu;
    let mut rng = Rng::new(7);
    for dtype in [DType::F32, DType::BF16] {
        let x = Var::from_tensor(&rng.randn(&[5, 8], 1.0, dtype, &dev)?)?;
        let w = Var::from_tensor(&rng.randn(&[6, 8], 0.5, dtype, &dev)?)?;
        let gain = Var::from_tensor(&rng.randn(&[6], 1.0, dtype, &dev)?)?;
        let g = rng.randn(&[5, 6], 1.0, dtype, &dev)?;
        let f = |x: &Tensor, w: &Tensor, gain: &Tensor| -> Result<Tensor> {
            let h = x.matmul(&w.t()?)?;
            swiglu(&rms_norm(&h, gain, 1e-6)?, &h)
        };
        let y = f(x.as_tensor(), w.as_tensor(), gain.as_tensor())?;
        let seeded = vjp_seed(&y, &g)?;
        assert_eq!(seeded.dims(), &[] as &[usize]);
        let a = seeded.backward()?;
        let b = (y * &g)?.sum_all()?.backward()?;
        for (name, v) in [("x", &x), ("w", &w), ("gain", &gain)] {
            let ga = a.get(v.as_tensor()).expect("gradient through vjp_seed");
            let gb = b.get(v.as_tensor()).expect("gradient through sum_all");
            let err = rel_err(&ga.to_dtype(DType::F64)?, &gb.to_dtype(DType::F64)?)?;
            let tol = if dtype == DType::F32 { 1e-6 } else { 2e-2 };
            assert!(err <= tol, "{dtype:?} d{name}: relative error {err:e} > {tol:e}");
            assert!(ga.abs()?.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()? > 0.0);
        }
        assert!(a.get(&g).is_none(), "the upstream gradient must stay detached");
    }
    Ok(())
}

#[test]
fn rejects_mismatched_gradients() -> Result<()> {
    let dev = Device::Cpu;
    let y = Tensor::zeros((3, 4), DType::F32, &dev)?;
    let err = vjp_seed(&y, &Tensor::zeros((4, 3), DType::F32, &dev)?)
        .unwrap_err()
        .to_string();
    assert!(err.contains("differ in shape"), "{err}");
    let err = vjp_seed(&y, &Tensor::zeros((3, 4), DType::BF16, &dev)?)
        .unwrap_err()
        .to_string();
    assert!(err.contains("BF16"), "{err}");
    Ok(())
}
