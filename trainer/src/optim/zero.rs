//! ZeRO-1 AdamW (Megatron's `--use-distributed-optimizer`, llm.c's `zero.cuh`): fp32 master
//! weights and moments for this data-parallel rank's shard of the flat parameter buffer only.
//!
//! One step, at DP size `dp`, on every rank of the DP group:
//!
//! ```text
//! flat   = layout.flatten_padded(grads, f32, dp * shard_len)   // one concatenation, table order
//! shard  = dp_group.reduce_scatter(flat, Sum)                  // this rank's range of the sum
//! norm   = sqrt(all_reduce(sum_sq_f64(shard), Sum))            // padding is zero
//! update master/moments of every segment with clip_coefficient(norm, clip_grad) folded in
//! model  = unflatten(all_gather(cast(shard masters, model dtype))); Var::set each parameter
//! ```
//!
//! Decisions:
//! - The per-element math is AdamW's own (`adamw::update` on the CPU, `adamw::update_fused`, the
//!   fused kernel, on CUDA), so a shard updates to the same bits as the whole tensor would.
//! - dp = 1 is [`AdamW`] itself: no flat buffer, no collective, every segment a whole parameter;
//!   the step is `global_grad_norm` + `AdamW::step_scaled` on the caller's gradient tensors,
//!   exactly the single-GPU path (an f32 model's `Var` stays its own master).
//! - Gradients are SUMMED over DP (as the brief of issue 14 asks); averaging is the loss scale's
//!   job (or `GradAccumulator::scale`).
//! - The DP group is a value passed to every call that communicates; the optimizer checks that it
//!   has the size and rank it was built for.
//! - Checkpoint state is AdamW's format (`master.<name>`, `exp_avg.<name>`, `exp_avg_sq.<name>`,
//!   f32, CPU, local TP shapes), gathered across DP, so a checkpoint written at one DP size loads
//!   at any other.
//! - Shards are padded to a multiple of [`SHARD_ALIGN`] elements so that every shard starts
//!   on a 512-byte boundary of the f32 buffer.
//! - Tensor parallelism: the layout table gives local shapes; the gradient norm here is over the
//!   DP group only (a TP > 1 run must still all-reduce the squared norm over the model-parallel
//!   group, counting replicated parameters once; not needed until TP lands).
use super::adamw::{self, check_state_map, StepConsts, STATE_PREFIXES};
use super::{
    clip_coefficient, global_grad_norm, grad_norm_of_squares, megatron_weight_decay, AdamW, NonFiniteGradNorm,
    OptimizerArgs,
};
use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;
use vime_dist::layout::{LayoutEntry, LayoutTable, Placement, Segment};
use vime_dist::{Collectives, ReduceOp};
use vime_qwen3::state_dict::ParamSpec;

/// Every DP shard's length is a multiple of this many elements.
pub const SHARD_ALIGN: usize = 128;

/// The layout table of a Qwen3 model held in `dtype`, as TP rank `tp_rank` of `tp_size` holds it,
/// with Megatron's weight-decay rule.
pub fn qwen3_layout(specs: &[ParamSpec], dtype: DType, tp_rank: usize, tp_size: usize) -> Result<LayoutTable> {
    let entries = specs
        .iter()
        .map(|s| {
            LayoutEntry::new(
                s.name.clone(),
                &s.shape,
                dtype,
                megatron_weight_decay(&s.name, &s.shape),
                s.placement,
            )
        })
        .collect();
    LayoutTable::new(entries, tp_rank, tp_size)
}

/// A layout of `params` as they are (all replicated, no TP), in the given order, with Megatron's
/// weight-decay rule; for models without a weight table of their own (e.g. a critic head).
pub fn replicated_layout(params: &[(String, Var)]) -> Result<LayoutTable> {
    let entries = params
        .iter()
        .map(|(n, v)| {
            LayoutEntry::new(
                n.clone(),
                v.dims(),
                v.dtype(),
                megatron_weight_decay(n, v.dims()),
                Placement::Replicated,
            )
        })
        .collect();
    LayoutTable::new(entries, 0, 1)
}

/// What one ZeRO-1 step did.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ZeroStepStats {
    /// Steps taken, this one included.
    pub step: u64,
    pub lr: f64,
    /// The global L2 norm of the DP-summed gradient, before clipping.
    pub grad_norm: f64,
    /// The clipping factor folded into the update (`None`: not clipped).
    pub grad_scale: Option<f64>,
}

/// One parameter's part inside this rank's shard, with its f32 state.
struct SegState {
    seg: Segment,
    weight_decay: bool,
    master: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
}

enum State {
    /// dp = 1: the plain optimizer over whole parameters.
    Whole(Box<AdamW>),
    Sharded {
        segs: Vec<SegState>,
        num_steps: u64,
    },
}

pub struct DistributedAdamW {
    layout: LayoutTable,
    /// The model's parameters in layout order.
    vars: Vec<Var>,
    dp_rank: usize,
    dp_size: usize,
    /// This rank's range of the padded flat buffer.
    shard: Range<usize>,
    padded_numel: usize,
    state: State,
    args: OptimizerArgs,
    /// The gradients [`Self::prepare_step`] checked (their tensor ids), for the next step.
    checked: Option<Vec<candle_core::TensorId>>,
}

impl DistributedAdamW {
    /// ZeRO-1 AdamW over `params` (HF name, model `Var`) as they are: the layout is
    /// [`replicated_layout`] in the given order (no TP, Megatron's weight-decay rule). For a Qwen3
    /// policy at TP = 1 this is the same table as [`qwen3_layout`] (same order, shapes, decay).
    pub fn new(params: &[(String, Var)], args: &OptimizerArgs, dp: &dyn Collectives) -> Result<Self> {
        Self::with_layout(params, replicated_layout(params)?, args, dp)
    }

    /// ZeRO-1 AdamW over `params` (HF name, model `Var` in its local TP shape), laid out by
    /// `layout` (which must list exactly these names, shapes and dtypes; its weight-decay flags
    /// are used), for rank `dp.rank()` of the DP group `dp`.
    pub fn with_layout(
        params: &[(String, Var)],
        layout: LayoutTable,
        args: &OptimizerArgs,
        dp: &dyn Collectives,
    ) -> Result<Self> {
        AdamW::check_hyper_params(args)?;
        let mut by_name = BTreeMap::new();
        for (n, v) in params {
            if by_name.insert(n.as_str(), v).is_some() {
                bail!("parameter {n} is listed twice");
            }
        }
        layout
            .check_names(by_name.keys().copied(), "DistributedAdamW parameters vs layout table")
            .context("the model's parameters do not match the layout table")?;
        let mut vars = Vec::with_capacity(layout.len());
        for p in layout.entries() {
            let v = by_name[p.name()];
            if v.dims() != p.local_shape.as_slice() || v.dtype() != p.entry.dtype {
                bail!(
                    "parameter {} is {:?} {:?}; the layout table says {:?} {:?} (local shape, tp rank {} of {})",
                    p.name(),
                    v.dtype(),
                    v.dims(),
                    p.entry.dtype,
                    p.local_shape,
                    layout.tp_rank(),
                    layout.tp_size()
                );
            }
            if !v.dtype().is_float() {
                bail!(
                    "parameter {} has dtype {:?}; AdamW needs floating-point parameters",
                    p.name(),
                    v.dtype()
                );
            }
            vars.push(v.clone());
        }
        let (dp_rank, dp_size) = (dp.rank(), dp.size());
        ensure!(
            dp_size >= 1 && dp_rank < dp_size,
            "bad DP group: rank {dp_rank} of {dp_size}"
        );
        let shard = layout.shard_ranges_aligned(dp_size, SHARD_ALIGN)[dp_rank].clone();
        let padded_numel = layout.padded_numel(dp_size, SHARD_ALIGN);
        let state = if dp_size == 1 {
            let ordered: Vec<(String, Var)> = layout
                .entries()
                .iter()
                .zip(&vars)
                .map(|(p, v)| (p.name().to_string(), v.clone()))
                .collect();
            State::Whole(Box::new(AdamW::with_weight_decay_rule(&ordered, args, |n, _| {
                layout.get(n).is_some_and(|p| p.entry.weight_decay)
            })?))
        } else {
            let mut segs = Vec::new();
            for seg in layout.segments(shard.clone()) {
                let var = &vars[seg.entry];
                let part = var
                    .as_detached_tensor()
                    .flatten_all()?
                    .narrow(0, seg.param_range.start, seg.len())?;
                // Private buffers: the fused CUDA update writes them in place.
                let master = part.to_dtype(DType::F32)?.copy()?;
                let len = seg.len();
                let zeros = || Tensor::zeros(len, DType::F32, var.device());
                segs.push(SegState {
                    weight_decay: layout.entries()[seg.entry].entry.weight_decay,
                    seg,
                    master,
                    exp_avg: zeros()?,
                    exp_avg_sq: zeros()?,
                });
            }
            State::Sharded { segs, num_steps: 0 }
        };
        Ok(DistributedAdamW {
            layout,
            vars,
            dp_rank,
            dp_size,
            shard,
            padded_numel,
            state,
            args: args.clone(),
            checked: None,
        })
    }

    pub fn layout(&self) -> &LayoutTable {
        &self.layout
    }

    /// This rank's range of the padded flat parameter buffer.
    pub fn shard_range(&self) -> Range<usize> {
        self.shard.clone()
    }

    /// The parameter parts this rank holds optimizer state for, in table order (dp = 1: every
    /// parameter whole).
    pub fn segments(&self) -> Vec<Segment> {
        self.layout.segments(self.shard.clone())
    }

    /// Optimizer steps taken so far (the LR of the next step is `sched.lr_at(num_steps())`).
    pub fn num_steps(&self) -> u64 {
        match &self.state {
            State::Whole(a) => a.num_steps(),
            State::Sharded { num_steps, .. } => *num_steps,
        }
    }

    fn check_group(&self, dp: &dyn Collectives) -> Result<()> {
        ensure!(
            dp.size() == self.dp_size && dp.rank() == self.dp_rank,
            "DistributedAdamW was built for DP rank {} of {}, called with rank {} of {}",
            self.dp_rank,
            self.dp_size,
            dp.rank(),
            dp.size()
        );
        Ok(())
    }

    /// Every gradient present with its parameter's local shape, and no others (AdamW's messages).
    fn check_grads(&self, grads: &BTreeMap<String, Tensor>) -> Result<()> {
        for p in self.layout.entries() {
            let Some(g) = grads.get(p.name()) else {
                bail!("no gradient for parameter {} {:?}", p.name(), p.local_shape);
            };
            if g.dims() != p.local_shape.as_slice() {
                bail!(
                    "gradient of {} has shape {:?}, the parameter {:?}",
                    p.name(),
                    g.dims(),
                    p.local_shape
                );
            }
        }
        if grads.len() != self.layout.len() {
            let unknown: Vec<&str> = grads
                .keys()
                .filter(|n| self.layout.index_of(n).is_none())
                .map(String::as_str)
                .collect();
            bail!(
                "gradients for parameters this optimizer does not hold: {}",
                unknown.join(", ")
            );
        }
        Ok(())
    }

    /// [`Self::step_stats`], returning the gradient norm (before clipping).
    pub fn step(
        &mut self,
        grads: &BTreeMap<String, Tensor>,
        lr: f64,
        clip_grad: f64,
        dp: &dyn Collectives,
    ) -> Result<f64> {
        Ok(self.step_stats(grads, lr, clip_grad, dp)?.grad_norm)
    }

    /// One step on `grads` (this rank's f32 sums by HF name, as `GradAccumulator::take` gives):
    /// sums them over the DP group, clips by the global norm (`clip_grad`, `<= 0`: off; folded
    /// into the update as [`clip_coefficient`]), updates this rank's shard with learning rate
    /// `lr`, and leaves identical new weights in every rank's model. A non-finite norm is a
    /// [`NonFiniteGradNorm`] error (on every rank, naming the tensors of every rank) and changes
    /// nothing.
    pub fn step_stats(
        &mut self,
        grads: &BTreeMap<String, Tensor>,
        lr: f64,
        clip_grad: f64,
        dp: &dyn Collectives,
    ) -> Result<ZeroStepStats> {
        self.step_stats_tp(grads, None, lr, clip_grad, dp, &vime_dist::SingleRank::default())
    }

    /// The host half of the next [`Self::step_stats_tp`] on these `grads`, done ahead while the
    /// device is still busy: the gradients' checks and, for an unsharded optimizer, AdamW's
    /// (`AdamW::prepare_step`: on CUDA the fused update's table, built and uploaded). Callers run
    /// it before they wait for the gradient norm's sums of squares; that wait follows the
    /// backward, and what the host did after it left the GPU idle. The step then does not check
    /// these gradients again. Same bits.
    pub fn prepare_step(
        &mut self,
        grads: &BTreeMap<String, Tensor>,
        dp: &dyn Collectives,
        tp: &dyn Collectives,
    ) -> Result<()> {
        self.check_call(dp, tp)?;
        self.check_grads(grads)?;
        if let State::Whole(adamw) = &mut self.state {
            adamw.prepare_step(grads)?;
        }
        self.checked = Some(super::adamw::grad_ids(grads));
        Ok(())
    }

    fn check_call(&self, dp: &dyn Collectives, tp: &dyn Collectives) -> Result<()> {
        ensure!(
            tp.size() == self.layout.tp_size() && tp.rank() == self.layout.tp_rank(),
            "the optimizer's layout is for TP rank {} of {}, called with rank {} of {}",
            self.layout.tp_rank(),
            self.layout.tp_size(),
            tp.rank(),
            tp.size()
        );
        self.check_group(dp)
    }

    /// [`Self::step_stats`] of a tensor-parallel shard (`grads` of this TP rank's shards, the
    /// layout built for its TP place): the global norm sums the squares of the TP-split
    /// parameters over `tp` and counts the replicated ones once (they are equal on every TP
    /// rank), so every rank clips by the norm of the whole model's gradient. `squares`: each
    /// gradient's sum of squares (`grad_sum_squares` of `grads`) where the caller has them
    /// already (the trainer's NaN/Inf guard), used for the norm of an unsharded optimizer at TP 1
    /// instead of a second pass over the gradients; `None` computes them.
    pub fn step_stats_tp(
        &mut self,
        grads: &BTreeMap<String, Tensor>,
        squares: Option<&[f64]>,
        lr: f64,
        clip_grad: f64,
        dp: &dyn Collectives,
        tp: &dyn Collectives,
    ) -> Result<ZeroStepStats> {
        self.check_call(dp, tp)?;
        // Gradients `prepare_step` checked are not checked again.
        if self.checked.take() != Some(super::adamw::grad_ids(grads)) {
            self.check_grads(grads)?;
        }
        if !(lr.is_finite() && lr >= 0.0) {
            bail!("learning rate must be finite and >= 0, got {lr}");
        }
        let segs = match &mut self.state {
            State::Whole(adamw) => {
                let grad_norm = match squares {
                    _ if tp.size() > 1 => tp_grad_norm(grads, &self.layout, tp)?,
                    Some(sq) => grad_norm_of_squares(grads, sq)?,
                    None => global_grad_norm(grads)?,
                };
                let grad_scale = clip_coefficient(grad_norm, clip_grad);
                let s = adamw.step_scaled(grads, lr, grad_scale)?;
                return Ok(ZeroStepStats {
                    step: s.step,
                    lr,
                    grad_norm,
                    grad_scale,
                });
            }
            State::Sharded { segs, .. } => segs,
        };

        let flat = self
            .layout
            .flatten_padded(grads, Some(DType::F32), self.padded_numel)
            .context("flattening the gradients")?;
        let shard = dp
            .reduce_scatter(&flat, ReduceOp::Sum)
            .context("reduce-scatter of the gradients")?;
        drop(flat);
        ensure!(
            shard.dims() == [self.shard.len()],
            "reduce-scatter returned shape {:?}, expected [{}]",
            shard.dims(),
            self.shard.len()
        );
        let start = self.shard.start;
        // Squares of this shard, apart by placement: TP-split parameters (summed over TP too)
        // and replicated ones (counted once). At TP 1 all of it is one sum.
        let (mut split, mut whole) = (0f64, 0f64);
        if tp.size() > 1 {
            for s in segs.iter() {
                let v = sum_squares(&shard.narrow(0, s.seg.flat_range.start - start, s.seg.len())?)?;
                match self.layout.entries()[s.seg.entry].entry.placement.split_dim() {
                    Some(_) => split += v,
                    None => whole += v,
                }
            }
        } else {
            whole = sum_squares(&shard)?;
        }
        let sums = dp
            .all_reduce(&Tensor::new(&[split, whole], shard.device())?, ReduceOp::Sum)
            .context("all-reduce of the squared gradient norm")?
            .to_device(&Device::Cpu)?
            .to_vec1::<f64>()?;
        let split = if tp.size() > 1 {
            tp.all_reduce(&Tensor::new(&[sums[0]], &Device::Cpu)?, ReduceOp::Sum)?
                .to_vec1::<f64>()?[0]
        } else {
            sums[0]
        };
        let grad_norm = (split + sums[1]).sqrt();
        let view = |s: &Segment| shard.narrow(0, s.flat_range.start - start, s.len());
        if !grad_norm.is_finite() {
            let mut mine = Vec::new();
            for s in segs.iter() {
                if !sum_squares(&view(&s.seg)?)?.is_finite() {
                    mine.push(s.seg.name.clone());
                }
            }
            let all = dp.all_gather_bytes(mine.join("\n").as_bytes())?;
            let bad: BTreeSet<&str> = all
                .iter()
                .flat_map(|b| std::str::from_utf8(b).unwrap_or("").split('\n'))
                .filter(|n| !n.is_empty())
                .collect();
            let params = self
                .layout
                .entries()
                .iter()
                .map(|p| p.name())
                .filter(|n| bad.contains(n))
                .map(str::to_string)
                .collect();
            return Err(NonFiniteGradNorm {
                norm: grad_norm,
                params,
            }
            .into());
        }
        let grad_scale = clip_coefficient(grad_norm, clip_grad);
        if let Some(s) = grad_scale {
            ensure!(
                s.is_finite() && s > 0.0,
                "gradient scale must be finite and > 0, got {s}"
            );
        }

        let a = &self.args;
        let t = self.num_steps() + 1;
        let c = StepConsts::new(
            a.adam_beta1,
            a.adam_beta2,
            a.adam_eps,
            a.weight_decay,
            t,
            lr,
            grad_scale,
        );
        let State::Sharded { segs, num_steps } = &mut self.state else {
            unreachable!("dp > 1 is sharded")
        };
        for s in segs.iter_mut() {
            let g = view(&s.seg)?;
            #[cfg(feature = "cuda")]
            if s.master.device().is_cuda() {
                adamw::update_fused(&s.master, &g, &s.exp_avg, &s.exp_avg_sq, None, s.weight_decay, &c)
                    .with_context(|| format!("fused AdamW update of {} {:?}", s.seg.name, s.seg.param_range))?;
                continue;
            }
            let (master, exp_avg, exp_avg_sq) =
                adamw::update(&g, s.master.clone(), &s.exp_avg, &s.exp_avg_sq, s.weight_decay, &c)
                    .with_context(|| format!("AdamW update of {} {:?}", s.seg.name, s.seg.param_range))?;
            s.master = master;
            s.exp_avg = exp_avg;
            s.exp_avg_sq = exp_avg_sq;
        }
        *num_steps = t;
        drop(shard);

        // The new weights: this rank's masters in the model dtype, gathered, unflattened.
        let dtype = self.gather_dtype();
        let mine = self.shard_of(|s| &s.master, dtype)?;
        let full = dp.all_gather(&mine).context("all-gather of the updated weights")?;
        let tensors = self.layout.unflatten(&full)?;
        for (p, var) in self.layout.entries().iter().zip(&self.vars) {
            var.set(&tensors[p.name()].to_dtype(var.dtype())?)
                .with_context(|| format!("writing {} into the model", p.name()))?;
        }
        Ok(ZeroStepStats {
            step: t,
            lr,
            grad_norm,
            grad_scale,
        })
    }

    /// The dtype the weights travel in: the model's when all parameters share one, else f32.
    fn gather_dtype(&self) -> DType {
        let mut it = self.vars.iter().map(|v| v.dtype());
        match it.next() {
            Some(d) if it.all(|e| e == d) => d,
            _ => DType::F32,
        }
    }

    /// This rank's shard of one kind of state (`pick`), cast to `dtype`, padded with zeros to the
    /// shard length.
    fn shard_of(&self, pick: impl Fn(&SegState) -> &Tensor, dtype: DType) -> Result<Tensor> {
        let State::Sharded { segs, .. } = &self.state else {
            bail!("no shards at dp = 1")
        };
        let device = self.vars.first().map(|v| v.device().clone()).unwrap_or(Device::Cpu);
        let mut parts: Vec<Tensor> = segs.iter().map(|s| pick(s).clone()).collect();
        let real: usize = segs.iter().map(|s| s.seg.len()).sum();
        if real < self.shard.len() {
            parts.push(Tensor::zeros(self.shard.len() - real, DType::F32, &device)?);
        }
        Ok(Tensor::cat(&parts, 0)?.to_dtype(dtype)?)
    }

    /// The full optimizer state by name, in [`AdamW::state_tensors`]' format (f32, CPU, local TP
    /// shapes). A collective at dp > 1: every rank of the DP group calls it, every rank gets the
    /// whole state.
    pub fn state_tensors(&self, dp: &dyn Collectives) -> Result<BTreeMap<String, Tensor>> {
        self.check_group(dp)?;
        if let State::Whole(adamw) = &self.state {
            return adamw.state_tensors();
        }
        let mut out = BTreeMap::new();
        for prefix in STATE_PREFIXES {
            let mine = self.shard_of(
                |s| match prefix {
                    "master" => &s.master,
                    "exp_avg" => &s.exp_avg,
                    _ => &s.exp_avg_sq,
                },
                DType::F32,
            )?;
            let full = dp
                .all_gather(&mine)
                .with_context(|| format!("all-gather of the optimizer state {prefix}"))?
                .to_device(&Device::Cpu)?;
            for (name, t) in self.layout.unflatten(&full)? {
                out.insert(format!("{prefix}.{name}"), t);
            }
        }
        Ok(out)
    }

    /// Restores what [`Self::state_tensors`] (at any DP size) or [`AdamW::state_tensors`]
    /// returned: each rank keeps its own segments and writes the full master weights (cast) into
    /// its model. Every tensor is checked (present, f32, local shape, no unknown names) before
    /// anything changes. Needs no communication.
    /// [`Self::state_tensors`] with the TP shards gathered: every tensor at its parameter's global
    /// shape, so a checkpoint does not depend on the TP size either. Collective over `dp` and `tp`.
    pub fn state_tensors_tp(&self, dp: &dyn Collectives, tp: &dyn Collectives) -> Result<BTreeMap<String, Tensor>> {
        let local = self.state_tensors(dp)?;
        if tp.size() == 1 {
            return Ok(local);
        }
        local
            .into_iter()
            .map(|(k, t)| {
                let g = self.layout.gather_global(state_param(&k), &t, tp)?;
                Ok((k, g))
            })
            .collect()
    }

    /// [`Self::load_state_tensors`] from a map at global shapes (a checkpoint of any TP size):
    /// this TP rank's shard of each tensor is loaded.
    pub fn load_state_tensors_tp(
        &mut self,
        map: &BTreeMap<String, Tensor>,
        num_steps: u64,
        dp: &dyn Collectives,
    ) -> Result<()> {
        if self.layout.tp_size() == 1 {
            return self.load_state_tensors(map, num_steps, dp);
        }
        let local = map
            .iter()
            .map(|(k, t)| {
                let name = state_param(k);
                let l = match self.layout.get(name) {
                    Some(_) => self.layout.local_shard(name, t)?,
                    None => t.clone(),
                };
                Ok((k.clone(), l))
            })
            .collect::<Result<BTreeMap<_, _>>>()?;
        self.load_state_tensors(&local, num_steps, dp)
    }

    pub fn load_state_tensors(
        &mut self,
        map: &BTreeMap<String, Tensor>,
        num_steps: u64,
        dp: &dyn Collectives,
    ) -> Result<()> {
        self.check_group(dp)?;
        if let State::Whole(adamw) = &mut self.state {
            return adamw.load_state_tensors(map, num_steps);
        }
        check_state_map(
            map,
            self.layout
                .entries()
                .iter()
                .map(|p| (p.name(), p.local_shape.as_slice())),
        )?;
        let State::Sharded { segs, num_steps: n } = &mut self.state else {
            unreachable!("dp > 1 is sharded")
        };
        for s in segs.iter_mut() {
            let device = self.vars[s.seg.entry].device();
            let part = |prefix: &str| -> Result<Tensor> {
                let t = &map[&format!("{prefix}.{}", s.seg.name)];
                // Private copies: the fused CUDA update writes them in place.
                Ok(t.flatten_all()?
                    .narrow(0, s.seg.param_range.start, s.seg.len())?
                    .to_device(device)?
                    .copy()?)
            };
            let (master, exp_avg, exp_avg_sq) = (part("master")?, part("exp_avg")?, part("exp_avg_sq")?);
            s.master = master;
            s.exp_avg = exp_avg;
            s.exp_avg_sq = exp_avg_sq;
        }
        for (p, var) in self.layout.entries().iter().zip(&self.vars) {
            // A private copy: the map may hold the model's own tensor, which `Var::set` refuses.
            let master = map[&format!("master.{}", p.name())].to_device(var.device())?.copy()?;
            var.set(&master.to_dtype(var.dtype())?)
                .with_context(|| format!("writing master.{} into the model", p.name()))?;
        }
        *n = num_steps;
        Ok(())
    }
}

/// Sum of squares of every element in f64 (the fused kernel on CUDA, as `global_grad_norm`).
fn sum_squares(t: &Tensor) -> Result<f64> {
    #[cfg(feature = "cuda")]
    if t.device().is_cuda() && matches!(t.dtype(), DType::F32 | DType::BF16) {
        return Ok(vime_kernels::cuda::sum_squares(&[&t.contiguous()?])?[0]);
    }
    Ok(t.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>()?)
}

/// The parameter an optimizer-state key (`master.NAME`, `exp_avg.NAME`, ...) belongs to.
fn state_param(key: &str) -> &str {
    key.split_once('.').map(|(_, n)| n).unwrap_or(key)
}

/// The global gradient norm over tensor-parallel shards (dp = 1): squares of TP-split parameters
/// summed over `tp`, replicated ones counted once.
fn tp_grad_norm(grads: &BTreeMap<String, Tensor>, layout: &LayoutTable, tp: &dyn Collectives) -> Result<f64> {
    let (mut split, mut whole, mut bad) = (0f64, 0f64, Vec::new());
    for p in layout.entries() {
        let g = &grads[p.name()];
        let v = sum_squares(&g.flatten_all()?)?;
        if !v.is_finite() {
            bad.push(p.name().to_string());
        }
        match p.entry.placement.split_dim() {
            Some(_) => split += v,
            None => whole += v,
        }
    }
    let split = tp
        .all_reduce(&Tensor::new(&[split], &Device::Cpu)?, ReduceOp::Sum)?
        .to_vec1::<f64>()?[0];
    let norm = (split + whole).sqrt();
    if !norm.is_finite() {
        return Err(NonFiniteGradNorm { norm, params: bad }.into());
    }
    Ok(norm)
}
