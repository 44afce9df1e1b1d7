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

/// The global L2 norm over all gradients (any float dtype). A non-finite norm is a
/// [`NonFiniteGradNorm`] error.
pub fn global_grad_norm(grads: &BTreeMap<String, Tensor>) -> Result<f64> {
    let mut total = 0f64;
    let mut bad = Vec::new();
    let fused = fused_sum_squares(grads)?;
    for (i, (name, g)) in grads.iter().enumerate() {
        let s = match &fused {
            Some(v) => v[i],
            None => sum_sq(g).with_context(|| format!("gradient norm of {name} {:?}", g.dims()))?,
        };
        if !s.is_finite() {
            bad.push(name.clone());
        }
        total += s;
    }
    let norm = total.sqrt();
    if !norm.is_finite() {
        return Err(NonFiniteGradNorm { norm, params: bad }.into());
    }
    Ok(norm)
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
