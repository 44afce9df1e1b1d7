//! Test helpers shared by the kernel tests and the model tests of other crates: a seeded normal
//! generator (no `rand` dependency, same numbers on every machine, state saveable for resume), autograd gradients through
//! candle's graph, central finite differences in f64, and a norm-wise relative error.
use candle_core::{DType, Device, Result, Tensor, Var};

/// SplitMix64 + Box-Muller: deterministic standard normals.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    /// The generator's whole state: saving it and [`Rng::from_state`] resume the exact sequence.
    pub fn state(&self) -> u64 {
        self.0
    }
    pub fn from_state(state: u64) -> Self {
        Rng(state)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in (0, 1).
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    pub fn normal(&mut self) -> f64 {
        let (u1, u2) = (self.uniform(), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
    /// A tensor of `N(0, std^2)` values of the given shape and dtype, on `device`.
    pub fn randn(&mut self, shape: &[usize], std: f64, dtype: DType, device: &Device) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        let v: Vec<f64> = (0..n).map(|_| self.normal() * std).collect();
        Tensor::from_vec(v, shape, device)?.to_dtype(dtype)
    }
}

/// Gradients of the scalar `f(inputs)` with respect to every input, through candle's autograd.
/// An input that receives no gradient gets zeros (so a dropped gradient shows up as an error).
pub fn autograd_grads(f: &dyn Fn(&[Tensor]) -> Result<Tensor>, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
    let vars: Vec<Var> = inputs
        .iter()
        .map(|t| Var::from_tensor(&t.copy()?))
        .collect::<Result<_>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&ts)?;
    let grads = y.backward()?;
    ts.iter()
        .map(|t| match grads.get(t) {
            Some(g) => Ok(g.clone()),
            None => t.zeros_like(),
        })
        .collect()
}

/// Central finite differences of the scalar `f` in f64: `(f(x+h) - f(x-h)) / 2h` per element.
/// Inputs must be f64 tensors; `f` is evaluated without gradient tracking.
pub fn finite_diff_grads(f: &dyn Fn(&[Tensor]) -> Result<Tensor>, inputs: &[Tensor], h: f64) -> Result<Vec<Tensor>> {
    let mut out = Vec::with_capacity(inputs.len());
    for k in 0..inputs.len() {
        let base: Vec<f64> = inputs[k].flatten_all()?.to_vec1()?;
        let mut grad = vec![0f64; base.len()];
        for i in 0..base.len() {
            let eval = |delta: f64| -> Result<f64> {
                let mut v = base.clone();
                v[i] += delta;
                let mut args = inputs.to_vec();
                args[k] = Tensor::from_vec(v, inputs[k].shape(), inputs[k].device())?;
                f(&args)?.to_dtype(DType::F64)?.to_scalar::<f64>()
            };
            grad[i] = (eval(h)? - eval(-h)?) / (2.0 * h);
        }
        out.push(Tensor::from_vec(grad, inputs[k].shape(), inputs[k].device())?);
    }
    Ok(out)
}

/// `max|a - b| / max|b|` (norm-wise relative error; `b` is the reference).
pub fn rel_err(a: &Tensor, b: &Tensor) -> Result<f64> {
    if a.dims() != b.dims() {
        candle_core::bail!("rel_err: shapes differ, {:?} vs {:?}", a.dims(), b.dims());
    }
    let a = a.to_dtype(DType::F64)?.flatten_all()?;
    let b = b.to_dtype(DType::F64)?.flatten_all()?;
    let diff = (a - &b)?.abs()?.max(0)?.to_scalar::<f64>()?;
    let scale = b.abs()?.max(0)?.to_scalar::<f64>()?.max(1e-30);
    Ok(diff / scale)
}

/// `sum(y * r)` for a fixed random `r` of `y`'s shape: a scalar objective whose gradient with
/// respect to `y` is `r`, so every output element contributes to every test.
pub fn weighted_sum(y: &Tensor, seed: u64) -> Result<Tensor> {
    let r = Rng::new(seed).randn(y.dims(), 1.0, y.dtype(), y.device())?;
    (y * r)?.sum_all()
}
