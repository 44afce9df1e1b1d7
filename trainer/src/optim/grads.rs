//! Gradients between the backward and the optimizer: accumulation over micro-batches and clipping
//! by the global L2 norm.
//!
//! Decisions:
//! - Accumulation buffers are f32 whatever the gradients' dtype (Megatron's `main_grad`), summed
//!   in micro-batch order, so the result is deterministic. Averaging is an explicit `scale`.
//! - The norm is accumulated in f64 (per-tensor sums of squares, then their sum), so it does not
//!   depend on how tensors are split or ordered beyond the last f64 bits.
//! - Clipping is Megatron's / torch's: `coef = max_norm / (norm + 1e-6)`, applied only when
//!   `coef < 1` (so a norm within 1e-6 below `max_norm` is scaled a hair, as there).
//! - A non-finite norm is an error of its own type ([`NonFiniteGradNorm`], naming the offending
//!   tensors) and leaves the gradients untouched; the caller may skip the step instead of aborting.
use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use std::collections::BTreeMap;

/// The gradient norm was NaN or infinite; `params` are the tensors holding non-finite values.
#[derive(Debug, Clone)]
pub struct NonFiniteGradNorm {
    pub norm: f64,
    pub params: Vec<String>,
}

impl std::fmt::Display for NonFiniteGradNorm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const SHOWN: usize = 8;
        let names = self.params.iter().take(SHOWN).cloned().collect::<Vec<_>>().join(", ");
        let more = self.params.len().saturating_sub(SHOWN);
        write!(f, "gradient norm is {}: non-finite gradients in {names}", self.norm)?;
        if more > 0 {
            write!(f, " and {more} more")?;
        }
        Ok(())
    }
}

impl std::error::Error for NonFiniteGradNorm {}

/// Sum of squares of every element, in f64.
/// On CUDA (f32/bf16 gradients, `cuda` feature): every tensor's sum of squares from the fused
/// kernel, with one host synchronisation for all of them (needed anyway: the clip coefficient and
/// the logged norm are host values). `None` elsewhere.
fn fused_sum_squares(grads: &BTreeMap<String, Tensor>) -> Result<Option<Vec<f64>>> {
    #[cfg(feature = "cuda")]
    {
        let ok = !grads.is_empty()
            && grads
                .values()
                .all(|g| g.device().is_cuda() && matches!(g.dtype(), DType::F32 | DType::BF16));
        if ok {
            let ts: Vec<Tensor> = grads
                .values()
                .map(|g| g.contiguous())
                .collect::<candle_core::Result<_>>()?;
            let refs: Vec<&Tensor> = ts.iter().collect();
            return Ok(Some(
                vime_kernels::cuda::sum_squares(&refs).context("gradient norm (fused CUDA)")?,
            ));
        }
    }
    let _ = grads;
    Ok(None)
}

fn sum_sq(g: &Tensor) -> Result<f64> {
    Ok(g.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>()?)
}

/// Each gradient's sum of squares in f64, in `grads`' order: fused on CUDA
/// (`vime_kernels::cuda::sum_squares`: two launches and one copy to the host for all of them), one
/// tensor at a time elsewhere. The trainer's step computes them once and uses them twice: for the
/// NaN/Inf guard ([`first_nonfinite`]) and for the gradient norm ([`grad_norm_of_squares`]).
pub fn grad_sum_squares(grads: &BTreeMap<String, Tensor>) -> Result<Vec<f64>> {
    match fused_sum_squares(grads)? {
        Some(v) => Ok(v),
        None => grads
            .iter()
            .map(|(name, g)| sum_sq(g).with_context(|| format!("gradient norm of {name} {:?}", g.dims())))
            .collect(),
    }
}

/// The first gradient (by name) with a NaN or an Inf in it, or `None`, from `squares`
/// ([`grad_sum_squares`] of `grads`): the square of a finite f32 or bf16 value cannot overflow
/// f64, so a non-finite sum means a non-finite element. (The guard used to call candle's
/// `sum_all` per tensor, one block a tensor, about 2.4 GB of reads at Qwen3-0.6B and 16 GB at 4B
/// through a single SM each step; a finite sum that overflowed f32 also read as non-finite there.)
pub fn first_nonfinite(grads: &BTreeMap<String, Tensor>, squares: &[f64]) -> Option<String> {
    nonfinite_names(grads, squares).next()
}

/// The guard as it was before [`first_nonfinite`]: candle's `sum_all` of each gradient, stacked
/// and copied to the host once. Kept for `vime-train bench-step --nan-guard sum-all`, which
/// measures what the replacement saves.
pub fn first_nonfinite_by_sum_all(grads: &BTreeMap<String, Tensor>) -> Result<Option<String>> {
    if grads.is_empty() {
        return Ok(None);
    }
    let sums = grads
        .values()
        .map(|g| g.sum_all()?.to_dtype(DType::F32))
        .collect::<candle_core::Result<Vec<_>>>()?;
    // f32 -> f64 keeps (non-)finiteness.
    let sums: Vec<f64> = Tensor::stack(&sums, 0)?
        .to_vec1::<f32>()?
        .into_iter()
        .map(f64::from)
        .collect();
    Ok(first_nonfinite(grads, &sums))
}

/// The global L2 norm over all gradients (any float dtype). A non-finite norm is a
/// [`NonFiniteGradNorm`] error.
pub fn global_grad_norm(grads: &BTreeMap<String, Tensor>) -> Result<f64> {
    grad_norm_of_squares(grads, &grad_sum_squares(grads)?)
}

/// [`global_grad_norm`] from each gradient's sum of squares (`squares`: [`grad_sum_squares`] of
/// `grads`, in its order).
pub fn grad_norm_of_squares(grads: &BTreeMap<String, Tensor>, squares: &[f64]) -> Result<f64> {
    if squares.len() != grads.len() {
        bail!("{} sums of squares for {} gradients", squares.len(), grads.len());
    }
    let norm = squares.iter().fold(0f64, |t, s| t + s).sqrt();
    if !norm.is_finite() {
        let params = nonfinite_names(grads, squares).collect();
        return Err(NonFiniteGradNorm { norm, params }.into());
    }
    Ok(norm)
}

/// The names of the gradients whose `squares` entry is not finite, in `grads`' order.
fn nonfinite_names<'a>(grads: &'a BTreeMap<String, Tensor>, squares: &'a [f64]) -> impl Iterator<Item = String> + 'a {
    grads
        .keys()
        .zip(squares)
        .filter(|(_, s)| !s.is_finite())
        .map(|(n, _)| n.clone())
}

/// The clipping coefficient `max_norm / (norm + 1e-6)` when it is below 1 (and `max_norm > 0`);
/// `None` when the gradients stay as they are.
pub fn clip_coefficient(norm: f64, max_norm: f64) -> Option<f64> {
    let coef = max_norm / (norm + 1e-6);
    (max_norm > 0.0 && coef < 1.0).then_some(coef)
}

/// Scales all gradients by `max_norm / (norm + 1e-6)` when that is below 1; returns the norm
/// before clipping. `max_norm <= 0` only measures. (The training step instead passes
/// [`clip_coefficient`] to `AdamW::step_scaled`, which folds the scaling into the update.)
pub fn clip_grad_norm(grads: &mut BTreeMap<String, Tensor>, max_norm: f64) -> Result<f64> {
    let norm = global_grad_norm(grads)?;
    if let Some(coef) = clip_coefficient(norm, max_norm) {
        for (name, g) in grads.iter_mut() {
            *g = g
                .affine(coef, 0.0)
                .with_context(|| format!("clipping the gradient of {name}"))?;
        }
    }
    Ok(norm)
}

/// Sums micro-batch gradients by name into f32 buffers.
#[derive(Debug, Default)]
pub struct GradAccumulator {
    sums: BTreeMap<String, Tensor>,
    micro_batches: usize,
}

impl GradAccumulator {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one micro-batch's gradients (any float dtype). A name seen before must come with the
    /// same shape; the check runs before anything is added.
    pub fn add(&mut self, grads: &BTreeMap<String, Tensor>) -> Result<()> {
        for (name, g) in grads {
            if let Some(sum) = self.sums.get(name) {
                if sum.dims() != g.dims() {
                    bail!(
                        "gradient of {name} has shape {:?} in micro-batch {}, but {:?} before",
                        g.dims(),
                        self.micro_batches,
                        sum.dims()
                    );
                }
            }
        }
        for (name, g) in grads {
            let g = g.to_dtype(DType::F32)?;
            let sum = match self.sums.remove(name) {
                Some(sum) => (sum + g).with_context(|| format!("accumulating the gradient of {name}"))?,
                None => g,
            };
            self.sums.insert(name.clone(), sum);
        }
        self.micro_batches += 1;
        Ok(())
    }

    /// Gradient accumulation in the backward itself: the running sums, moved out to be passed to
    /// `Qwen3::forward_backward_into` (empty before the first micro-batch); give its result back
    /// with [`Self::put_sums`].
    pub fn take_sums(&mut self) -> BTreeMap<String, Tensor> {
        std::mem::take(&mut self.sums)
    }

    /// The running sums after one more micro-batch (what `forward_backward_into` returned for
    /// [`Self::take_sums`]'s map), stored as f32 (the first micro-batch's may have come in bf16).
    pub fn put_sums(&mut self, sums: BTreeMap<String, Tensor>) -> Result<()> {
        if !self.sums.is_empty() {
            bail!("put_sums: the accumulator still holds sums (take_sums was not called)");
        }
        for (name, g) in sums {
            let g = g
                .to_dtype(DType::F32)
                .with_context(|| format!("accumulating the gradient of {name}"))?;
            self.sums.insert(name, g);
        }
        self.micro_batches += 1;
        Ok(())
    }

    /// Multiplies every buffer by `factor` (e.g. `1 / micro_batches` to average).
    pub fn scale(&mut self, factor: f64) -> Result<()> {
        for (name, sum) in self.sums.iter_mut() {
            *sum = sum
                .affine(factor, 0.0)
                .with_context(|| format!("scaling the gradient of {name}"))?;
        }
        Ok(())
    }

    /// Micro-batches added since the last `take`.
    pub fn micro_batches(&self) -> usize {
        self.micro_batches
    }

    pub fn is_empty(&self) -> bool {
        self.sums.is_empty()
    }

    /// The f32 sums by name; the accumulator is empty afterwards.
    pub fn take(&mut self) -> BTreeMap<String, Tensor> {
        self.micro_batches = 0;
        std::mem::take(&mut self.sums)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn t(v: &[f32], dtype: DType) -> Tensor {
        Tensor::new(v, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
    }

    fn first_nonfinite(g: &BTreeMap<String, Tensor>) -> Result<Option<String>> {
        Ok(super::first_nonfinite(g, &grad_sum_squares(g)?))
    }

    #[test]
    fn the_nan_guard_names_the_first_gradient_with_a_nan_or_an_inf() {
        let mut g = BTreeMap::new();
        g.insert("a".to_string(), t(&[1.0, -2.0, 0.5], DType::F32));
        g.insert("c".to_string(), t(&[f32::INFINITY, 1.0], DType::F32));
        assert_eq!(first_nonfinite(&g).unwrap().as_deref(), Some("c"));
        g.insert("b".to_string(), t(&[1.0, f32::NAN], DType::BF16));
        assert_eq!(first_nonfinite(&g).unwrap().as_deref(), Some("b"));
        assert_eq!(first_nonfinite_by_sum_all(&g).unwrap().as_deref(), Some("b"));
        g.remove("b");
        g.remove("c");
        assert_eq!(first_nonfinite(&g).unwrap(), None);
        assert_eq!(first_nonfinite(&BTreeMap::new()).unwrap(), None);
    }

    #[test]
    fn a_finite_gradient_whose_f32_sum_overflows_is_not_flagged() {
        // 3e38 + 3e38 overflows f32 (the old guard's sum_all called it non-finite); its squares
        // in f64 do not.
        let mut g = BTreeMap::new();
        g.insert("big".to_string(), t(&[3e38, 3e38], DType::F32));
        assert_eq!(first_nonfinite_by_sum_all(&g).unwrap().as_deref(), Some("big"));
        assert_eq!(first_nonfinite(&g).unwrap(), None);
    }
}
