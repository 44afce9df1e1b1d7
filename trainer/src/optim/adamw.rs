//! AdamW over fp32 master weights and fp32 moments, exactly `torch.optim.AdamW`'s update:
//!
//! ```text
//! p  <- p * (1 - lr * wd)                         (decoupled decay; wd = 0 for excluded params)
//! m  <- m + (1 - b1) * (g - m)                    (torch's lerp)
//! v  <- v * b2 + (1 - b2) * g * g
//! p  <- p - (lr / (1 - b1^t)) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
//! ```
//!
//! Decisions:
//! - The master copy is f32. For a model held in f32 the model's `Var` *is* the master (no second
//!   copy); for bf16/f16 a separate f32 tensor is kept and the model receives its cast after every
//!   step, so updates smaller than the model dtype's resolution still accumulate.
//! - Moments start at zero and live on the parameter's device. On the CPU each step builds new
//!   tensors and only the model's `Var`s are written in place. On CUDA (with the `cuda` feature,
//!   bf16 or f32 models) one fused kernel per parameter updates master, moments and the model copy
//!   in place (`vime_kernels::cuda::adamw_update`), with the same f32 operations in the same order,
//!   so both paths give the same bits. `state_tensors` returns snapshots either way (copies on
//!   the CPU when the state lives on a CUDA device).
//! - `step` checks every gradient (present, right shape, no unknown names) before touching any
//!   state, so a failed call changes nothing.
//! - Checkpoint state is `master.<name>`, `exp_avg.<name>`, `exp_avg_sq.<name>` (f32) plus the step
//!   count, which [`AdamW::num_steps`] returns and `load_state_tensors` takes: the count is an
//!   integer that the training loop checkpoints with its own counters.
use super::OptimizerArgs;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor, Var};
use std::collections::{BTreeMap, BTreeSet};

/// Megatron's classic weight-decay rule: decay everything except 1-D parameters (norm gains,
/// biases) and anything named `*.bias`.
pub fn megatron_weight_decay(name: &str, shape: &[usize]) -> bool {
    !(shape.len() == 1 || name.ends_with(".bias"))
}

/// What one optimizer step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// Steps taken, this one included (the `t` of the bias correction).
    pub step: u64,
    pub lr: f64,
}

struct ParamState {
    name: String,
    var: Var,
    weight_decay: bool,
    /// `None` when the model's dtype is f32: then the `Var` is the master.
    master: Option<Tensor>,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
}

impl ParamState {
    fn master(&self) -> Tensor {
        match &self.master {
            Some(m) => m.clone(),
            None => self.var.as_detached_tensor(),
        }
    }
}

pub struct AdamW {
    params: Vec<ParamState>,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    num_steps: u64,
    /// The one-launch CUDA update's table of state buffers, kept between steps.
    #[cfg(feature = "cuda")]
    table: vime_kernels::cuda::AdamwTable,
    /// What [`AdamW::prepare_step`] checked and built, for the step that follows it.
    prepared: Option<Prepared>,
}

/// The gradients [`AdamW::prepare_step`] checked (their tensor ids, in the map's order) and, on
/// CUDA, the fused update's launch built for them, with the gradient tensors it points into (kept
/// alive until the launch is queued).
struct Prepared {
    ids: Vec<candle_core::TensorId>,
    #[cfg(feature = "cuda")]
    launch: Option<vime_kernels::cuda::AdamwLaunch>,
    #[cfg(feature = "cuda")]
    _grads: Vec<Tensor>,
}

/// The ids of `grads`' tensors in the map's order: the same tensors (and so the same shapes)
/// exactly when these are equal.
pub(crate) fn grad_ids(grads: &BTreeMap<String, Tensor>) -> Vec<candle_core::TensorId> {
    grads.values().map(Tensor::id).collect()
}

impl AdamW {
    /// AdamW over `params` (HF name, model `Var`) with Megatron's weight-decay exclusions.
    pub fn new(params: &[(String, Var)], args: &OptimizerArgs) -> Result<Self> {
        Self::with_weight_decay_rule(params, args, megatron_weight_decay)
    }

    /// AdamW where `decay(name, shape)` says which parameters get weight decay.
    pub fn with_weight_decay_rule(
        params: &[(String, Var)],
        args: &OptimizerArgs,
        decay: impl Fn(&str, &[usize]) -> bool,
    ) -> Result<Self> {
        Self::check_hyper_params(args)?;
        let mut seen = BTreeSet::new();
        let mut states = Vec::with_capacity(params.len());
        for (name, var) in params {
            if !seen.insert(name.as_str()) {
                bail!("parameter {name} is listed twice");
            }
            let dtype = var.dtype();
            if !dtype.is_float() {
                bail!("parameter {name} has dtype {dtype:?}; AdamW needs floating-point parameters");
            }
            let master = match dtype {
                DType::F32 => None,
                _ => Some(var.as_detached_tensor().to_dtype(DType::F32)?),
            };
            // Two buffers, not one shared: the fused CUDA update writes them in place.
            let zeros = || Tensor::zeros(var.shape(), DType::F32, var.device());
            states.push(ParamState {
                name: name.clone(),
                weight_decay: decay(name, var.dims()),
                var: var.clone(),
                master,
                exp_avg: zeros()?,
                exp_avg_sq: zeros()?,
            });
        }
        Ok(AdamW {
            params: states,
            beta1: args.adam_beta1,
            beta2: args.adam_beta2,
            eps: args.adam_eps,
            weight_decay: args.weight_decay,
            num_steps: 0,
            #[cfg(feature = "cuda")]
            table: Default::default(),
            prepared: None,
        })
    }

    pub(crate) fn check_hyper_params(args: &OptimizerArgs) -> Result<()> {
        for (flag, b) in [("adam_beta1", args.adam_beta1), ("adam_beta2", args.adam_beta2)] {
            if !(0.0..1.0).contains(&b) {
                bail!("{flag} must be in [0, 1), got {b}");
            }
        }
        if !(args.adam_eps >= 0.0 && args.adam_eps.is_finite()) {
            bail!("adam_eps must be finite and >= 0, got {}", args.adam_eps);
        }
        if !(args.weight_decay >= 0.0 && args.weight_decay.is_finite()) {
            bail!("weight_decay must be finite and >= 0, got {}", args.weight_decay);
        }
        Ok(())
    }

    /// Optimizer steps taken so far (the LR of the next step is `sched.lr_at(num_steps())`).
    pub fn num_steps(&self) -> u64 {
        self.num_steps
    }

    /// Parameter names in the order given at construction.
    pub fn param_names(&self) -> impl Iterator<Item = &str> {
        self.params.iter().map(|p| p.name.as_str())
    }

    /// Whether `name` gets weight decay; `None` for an unknown name.
    pub fn weight_decay_of(&self, name: &str) -> Option<bool> {
        self.params.iter().find(|p| p.name == name).map(|p| p.weight_decay)
    }

    /// The f32 master weight of `name` (for an f32 model: the model tensor itself, which the next
    /// step overwrites in place; `copy()` it to keep it).
    pub fn master(&self, name: &str) -> Option<Tensor> {
        self.params.iter().find(|p| p.name == name).map(ParamState::master)
    }

    /// Every parameter has a gradient of its shape, and there is no other gradient.
    fn check_grads(&self, grads: &BTreeMap<String, Tensor>) -> Result<()> {
        for p in &self.params {
            let Some(g) = grads.get(&p.name) else {
                bail!("no gradient for parameter {} {:?}", p.name, p.var.dims());
            };
            if g.dims() != p.var.dims() {
                bail!(
                    "gradient of {} has shape {:?}, the parameter {:?}",
                    p.name,
                    g.dims(),
                    p.var.dims()
                );
            }
        }
        if grads.len() != self.params.len() {
            let unknown: Vec<&str> = grads
                .keys()
                .filter(|n| !self.params.iter().any(|p| &p.name == *n))
                .map(String::as_str)
                .collect();
            bail!(
                "gradients for parameters this optimizer does not hold: {}",
                unknown.join(", ")
            );
        }
        Ok(())
    }

    /// The host half of the next [`Self::step_scaled`] on these `grads`, done ahead: their checks
    /// and, on CUDA, the fused update's table (built and its upload queued). A caller runs it
    /// before it waits for the gradient norm, while the device is still busy with the backward;
    /// the step then only launches. Same bits either way. A step on other gradient tensors than
    /// the prepared ones does everything itself, as without it.
    pub fn prepare_step(&mut self, grads: &BTreeMap<String, Tensor>) -> Result<()> {
        self.prepared = None;
        self.check_grads(grads)?;
        #[cfg(feature = "cuda")]
        let (launch, gs) = fused_launch(&self.params, grads, &mut self.table)?;
        self.prepared = Some(Prepared {
            ids: grad_ids(grads),
            #[cfg(feature = "cuda")]
            launch,
            #[cfg(feature = "cuda")]
            _grads: gs,
        });
        Ok(())
    }

    /// One AdamW step with learning rate `lr` on the (accumulated, clipped) gradients, keyed by
    /// the same names as the parameters. Writes the new weights into the model's `Var`s.
    pub fn step(&mut self, grads: &BTreeMap<String, Tensor>, lr: f64) -> Result<StepStats> {
        self.step_scaled(grads, lr, None)
    }

    /// [`Self::step`] on `grads * grad_scale` without a separate pass over the gradients: the
    /// fused CUDA update multiplies as it loads, the CPU path scales first (the same f32
    /// multiply, so the result is bit-identical to clipping first and then stepping).
    pub fn step_scaled(
        &mut self,
        grads: &BTreeMap<String, Tensor>,
        lr: f64,
        grad_scale: Option<f64>,
    ) -> Result<StepStats> {
        if let Some(s) = grad_scale {
            if !(s.is_finite() && s > 0.0) {
                bail!("gradient scale must be finite and > 0, got {s}");
            }
        }
        if !(lr.is_finite() && lr >= 0.0) {
            bail!("learning rate must be finite and >= 0, got {lr}");
        }
        // What `prepare_step` did for these very gradients is not done again.
        let prepared = self.prepared.take().filter(|p| p.ids == grad_ids(grads));
        if prepared.is_none() {
            self.check_grads(grads)?;
        }

        let t = self.num_steps + 1;
        let c = StepConsts::new(self.beta1, self.beta2, self.eps, self.weight_decay, t, lr, grad_scale);
        // Every CUDA parameter in one launch of the fused kernel; the rest (CPU) one by one.
        #[cfg(feature = "cuda")]
        match prepared {
            Some(Prepared { launch, .. }) => {
                if let Some(l) = launch {
                    l.launch(adam_consts(&c, c.decay(true))).context("fused AdamW update")?;
                }
            }
            None => update_fused_all(&self.params, grads, &c, &mut self.table)?,
        }
        #[cfg(not(feature = "cuda"))]
        let _ = prepared;
        for p in self.params.iter_mut() {
            #[cfg(feature = "cuda")]
            if fused_cuda(p) {
                continue;
            }
            let name = p.name.clone();
            let (master, exp_avg, exp_avg_sq) = update(
                &grads[&p.name],
                p.master(),
                &p.exp_avg,
                &p.exp_avg_sq,
                p.weight_decay,
                &c,
            )
            .with_context(|| format!("AdamW update of {name}"))?;
            write_model(&p.var, &master).with_context(|| format!("writing {name} into the model"))?;
            if p.master.is_some() {
                p.master = Some(master);
            }
            p.exp_avg = exp_avg;
            p.exp_avg_sq = exp_avg_sq;
        }
        self.num_steps = t;
        Ok(StepStats { step: t, lr })
    }

    /// Optimizer state by name, all f32: `master.<name>`, `exp_avg.<name>`, `exp_avg_sq.<name>`.
    /// The step count is [`AdamW::num_steps`]. The tensors are snapshots (later steps do not
    /// change them).
    pub fn state_tensors(&self) -> Result<BTreeMap<String, Tensor>> {
        let mut out = BTreeMap::new();
        for p in &self.params {
            let master = match &p.master {
                Some(m) => m.clone(),
                None => p.var.as_detached_tensor().copy()?,
            };
            // CUDA state is updated in place by the fused kernel: hand out host copies.
            let snap = |t: Tensor| -> Result<Tensor> {
                Ok(if t.device().is_cuda() {
                    t.to_device(&candle_core::Device::Cpu)?
                } else {
                    t
                })
            };
            out.insert(format!("master.{}", p.name), snap(master)?);
            out.insert(format!("exp_avg.{}", p.name), snap(p.exp_avg.clone())?);
            out.insert(format!("exp_avg_sq.{}", p.name), snap(p.exp_avg_sq.clone())?);
        }
        Ok(out)
    }

    /// Restores what [`AdamW::state_tensors`] and [`AdamW::num_steps`] returned, and writes the
    /// master weights (cast to the model dtype) into the model, so model and optimizer agree bit
    /// for bit with the run that saved them. Every tensor is checked (present, f32, shape, no
    /// unknown names) before anything changes.
    pub fn load_state_tensors(&mut self, map: &BTreeMap<String, Tensor>, num_steps: u64) -> Result<()> {
        // A prepared launch points into the state buffers this replaces.
        self.prepared = None;
        check_state_map(map, self.params.iter().map(|p| (p.name.as_str(), p.var.dims())))?;
        for p in self.params.iter_mut() {
            let load = |prefix: &str| -> Result<Tensor> {
                let key = format!("{prefix}.{}", p.name);
                Ok(map[&key].to_device(p.var.device())?)
            };
            let (master, exp_avg, exp_avg_sq) = (load("master")?, load("exp_avg")?, load("exp_avg_sq")?);
            // A private copy: the map may hold the model's own tensor, which `Var::set` refuses.
            let master = master.copy()?;
            write_model(&p.var, &master).with_context(|| format!("writing master.{} into the model", p.name))?;
            if p.master.is_some() {
                p.master = Some(master);
            }
            // Private copies: the fused CUDA update writes them in place.
            p.exp_avg = exp_avg.copy()?;
            p.exp_avg_sq = exp_avg_sq.copy()?;
        }
        self.num_steps = num_steps;
        Ok(())
    }
}

/// The scalars of step `t` (1-based) of AdamW, shared by [`AdamW`] and the ZeRO-1
/// `DistributedAdamW`, so both run the same f32 operations on every element.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StepConsts {
    beta1: f64,
    beta2: f64,
    eps: f64,
    /// `lr * weight_decay`, applied to parameters that decay.
    lr_wd: f64,
    bias_correction2_sqrt: f64,
    step_size: f64,
    grad_scale: Option<f64>,
}

impl StepConsts {
    pub(crate) fn new(
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
        t: u64,
        lr: f64,
        grad_scale: Option<f64>,
    ) -> Self {
        let bias_correction1 = 1.0 - beta1.powf(t as f64);
        let bias_correction2_sqrt = (1.0 - beta2.powf(t as f64)).sqrt();
        StepConsts {
            beta1,
            beta2,
            eps,
            lr_wd: lr * weight_decay,
            bias_correction2_sqrt,
            step_size: lr / bias_correction1,
            grad_scale,
        }
    }

    fn decay(&self, weight_decay: bool) -> f64 {
        if weight_decay {
            self.lr_wd
        } else {
            0.0
        }
    }
}

/// One AdamW update of one tensor as new tensors: `(master, exp_avg, exp_avg_sq)` from the
/// gradient `g` (any float dtype, any device; cast to f32 on the master's device and scaled by
/// `c.grad_scale` first) and the f32 state.
pub(crate) fn update(
    g: &Tensor,
    master: Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    weight_decay: bool,
    c: &StepConsts,
) -> Result<(Tensor, Tensor, Tensor)> {
    let mut g = g.to_dtype(DType::F32)?.to_device(master.device())?;
    if let Some(s) = c.grad_scale {
        g = g.affine(s, 0.0)?;
    }
    let mut master = master;
    let decay = c.decay(weight_decay);
    if decay != 0.0 {
        master = master.affine(1.0 - decay, 0.0)?;
    }
    let exp_avg = ((&g - exp_avg)?.affine(1.0 - c.beta1, 0.0)? + exp_avg)?;
    let exp_avg_sq = (exp_avg_sq.affine(c.beta2, 0.0)? + (g.affine(1.0 - c.beta2, 0.0)? * &g)?)?;
    let denom = (exp_avg_sq.sqrt()? / c.bias_correction2_sqrt)?.affine(1.0, c.eps)?;
    let master = ((exp_avg.affine(-c.step_size, 0.0)? / denom)? + master)?;
    Ok((master, exp_avg, exp_avg_sq))
}

/// [`update`] in place on CUDA with the fused kernel (same f32 operations, same order):
/// `master`, `exp_avg`, `exp_avg_sq` are f32 and contiguous (offsets allowed); `model`, when
/// given, is a bf16 tensor of the same shape that receives the rounded master.
#[cfg(feature = "cuda")]
pub(crate) fn update_fused(
    master: &Tensor,
    g: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    model: Option<&Tensor>,
    weight_decay: bool,
    c: &StepConsts,
) -> Result<()> {
    let k = adam_consts(c, c.decay(weight_decay));
    Ok(vime_kernels::cuda::adamw_update(
        master,
        &kernel_grad(g)?,
        exp_avg,
        exp_avg_sq,
        model,
        k,
    )?)
}

/// The kernel's f32 constants of step `c`, with `decay` (`lr * weight_decay`, or 0) for the
/// tensors that decay.
#[cfg(feature = "cuda")]
fn adam_consts(c: &StepConsts, decay: f64) -> vime_kernels::cuda::AdamConsts {
    vime_kernels::cuda::AdamConsts {
        keep: (1.0 - decay) as f32,
        one_m_b1: (1.0 - c.beta1) as f32,
        b2: c.beta2 as f32,
        one_m_b2: (1.0 - c.beta2) as f32,
        inv_bc2: (1.0 / c.bias_correction2_sqrt) as f32,
        eps: c.eps as f32,
        neg_step: (-c.step_size) as f32,
        decay: (decay != 0.0) as i32,
        grad_scale: c.grad_scale.unwrap_or(1.0) as f32,
        scale: c.grad_scale.is_some() as i32,
    }
}

/// A gradient as the fused kernel reads it: contiguous, f32 or bf16.
#[cfg(feature = "cuda")]
fn kernel_grad(g: &Tensor) -> Result<Tensor> {
    let g = g.contiguous()?;
    Ok(match g.dtype() {
        DType::F32 | DType::BF16 => g,
        _ => g.to_dtype(DType::F32)?,
    })
}

/// [`update_fused`] of every CUDA parameter of `params` in one kernel launch ([`fused_launch`],
/// the same bits as one launch each). The gradients' shapes were checked by the caller.
#[cfg(feature = "cuda")]
fn update_fused_all(
    params: &[ParamState],
    grads: &BTreeMap<String, Tensor>,
    c: &StepConsts,
    table: &mut vime_kernels::cuda::AdamwTable,
) -> Result<()> {
    // `_gs`: the gradients the launch reads, alive until it is queued.
    let (launch, _gs) = fused_launch(params, grads, table)?;
    if let Some(l) = launch {
        // The decay applies to the tensors marked so: `keep` is theirs.
        l.launch(adam_consts(c, c.decay(true))).context("fused AdamW update")?;
    }
    Ok(())
}

/// The one launch of the fused update of every CUDA parameter of `params` on `grads` (checked by
/// the caller), its table built and uploaded, with the gradient tensors it reads (contiguous,
/// f32 or bf16), which must stay alive until it is queued.
#[cfg(feature = "cuda")]
fn fused_launch(
    params: &[ParamState],
    grads: &BTreeMap<String, Tensor>,
    table: &mut vime_kernels::cuda::AdamwTable,
) -> Result<(Option<vime_kernels::cuda::AdamwLaunch>, Vec<Tensor>)> {
    let fused: Vec<&ParamState> = params.iter().filter(|p| fused_cuda(p)).collect();
    let gs = fused
        .iter()
        .map(|p| kernel_grad(&grads[&p.name]).with_context(|| format!("the gradient of {}", p.name)))
        .collect::<Result<Vec<_>>>()?;
    let launch =
        vime_kernels::cuda::adamw_multi_prepare(&adamw_tensors(&fused, &gs), table).context("fused AdamW update")?;
    Ok((launch, gs))
}

/// The fused kernel's view of `fused` parameters with their gradients `gs` (in that order).
#[cfg(feature = "cuda")]
fn adamw_tensors<'a>(fused: &[&'a ParamState], gs: &'a [Tensor]) -> Vec<vime_kernels::cuda::AdamwTensor<'a>> {
    fused
        .iter()
        .zip(gs)
        .map(|(p, g)| vime_kernels::cuda::AdamwTensor {
            name: &p.name,
            master: p.master.as_ref().unwrap_or_else(|| p.var.as_tensor()),
            grad: g,
            exp_avg: &p.exp_avg,
            exp_avg_sq: &p.exp_avg_sq,
            model: p.master.as_ref().map(|_| p.var.as_tensor()),
            decay: p.weight_decay,
        })
        .collect()
}

/// Whether `p` takes the fused CUDA AdamW kernel: a CUDA parameter held in bf16 (separate f32
/// master) or f32 (the var is the master).
#[cfg(feature = "cuda")]
fn fused_cuda(p: &ParamState) -> bool {
    p.var.device().is_cuda() && matches!(p.var.dtype(), DType::BF16 | DType::F32)
}

/// `var <- master` cast to the var's dtype.
fn write_model(var: &Var, master: &Tensor) -> Result<()> {
    var.set(&master.to_dtype(var.dtype())?)?;
    Ok(())
}

/// The keys of an optimizer state map, per parameter.
pub(super) const STATE_PREFIXES: [&str; 3] = ["master", "exp_avg", "exp_avg_sq"];

/// Checks an optimizer state map against `(name, shape)` of every parameter before anything is
/// loaded: each `master.` / `exp_avg.` / `exp_avg_sq.` tensor present, f32, of the parameter's
/// shape, and no key for a parameter that is not there.
pub(super) fn check_state_map<'a>(
    map: &BTreeMap<String, Tensor>,
    params: impl Iterator<Item = (&'a str, &'a [usize])>,
) -> Result<()> {
    let mut expected = BTreeSet::new();
    for (name, shape) in params {
        for prefix in STATE_PREFIXES {
            let key = format!("{prefix}.{name}");
            let Some(t) = map.get(&key) else {
                bail!("optimizer state has no tensor {key}");
            };
            if t.dtype() != DType::F32 {
                bail!("optimizer state tensor {key} has dtype {:?}, expected F32", t.dtype());
            }
            if t.dims() != shape {
                bail!(
                    "optimizer state tensor {key} has shape {:?}, the parameter {:?}",
                    t.dims(),
                    shape
                );
            }
            expected.insert(key);
        }
    }
    let unknown: Vec<&str> = map
        .keys()
        .filter(|k| !expected.contains(*k))
        .map(String::as_str)
        .collect();
    if !unknown.is_empty() {
        bail!(
            "optimizer state has tensors for no parameter of this model: {}",
            unknown.join(", ")
        );
    }
    Ok(())
}
