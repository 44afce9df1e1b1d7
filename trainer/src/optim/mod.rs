//! The optimizer side of training: AdamW over fp32 master weights, global-norm gradient clipping,
//! Megatron's LR schedules, micro-batch gradient accumulation, and the flags that configure them.
//!
//! One optimizer step, as the RL loop runs it:
//!
//! ```text
//! for mb in micro_batches {                                    // sums added by the weight GEMMs
//!     acc.put_sums(model.forward_backward_into(mb, .., acc.take_sums())?.1.params)?;
//! }
//! let grads = acc.take();                                       // f32 sums by HF name
//! let grad_norm = global_grad_norm(&grads)?;                    // norm before clipping
//! let lr = sched.lr_at(adamw.num_steps());
//! adamw.step_scaled(&grads, lr, clip_coefficient(grad_norm, args.clip_grad))?; // writes the Vars
//! ```
//!
//! `step_scaled` folds the clipping into the update (bit-identical to [`clip_grad_norm`] followed
//! by `step`, which is the torch-parity reference).
//!
//! Decisions:
//! - Flags keep Megatron/slime spellings (`--lr`, `--min-lr`, `--lr-decay-style`, `--adam-beta2`,
//!   `--clip-grad`, ...) in one [`OptimizerArgs`] that is both a `clap::Args` and a serde struct,
//!   so a config file sets the same names.
//! - The schedule is counted in optimizer steps: the LR of step `k` (0-based, = the number of
//!   steps already taken) is `lr_at(k)`, as Megatron sets the LR for `num_steps = 0` at
//!   construction and advances after each step. Megatron counts samples (`iters *
//!   global_batch_size`); every ratio it forms is the same in iterations.
//! - Weight decay follows Megatron's classic rule, by name and shape, not by model type: no decay
//!   on 1-D parameters (norm gains, biases) nor on `*.bias` ([`megatron_weight_decay`]). For Qwen3
//!   this equals `ParamKind::default_weight_decay`.
//! - Everything the update touches is f32 whatever the model's dtype; the model's `Var`s only
//!   ever receive `master.to_dtype(model dtype)`.
mod adamw;
mod grads;
mod schedule;
mod zero;

pub use adamw::{megatron_weight_decay, AdamW, StepStats};
pub use grads::{
    clip_coefficient, clip_grad_norm, first_nonfinite, first_nonfinite_by_sum_all, global_grad_norm,
    grad_norm_of_squares, grad_sum_squares, GradAccumulator, NonFiniteGradNorm,
};
pub use schedule::{LrDecayStyle, LrScheduler, WsdDecayStyle};
pub use zero::{qwen3_layout, replicated_layout, DistributedAdamW, ZeroStepStats, SHARD_ALIGN};

use serde::{Deserialize, Serialize};

/// Optimizer and LR-schedule hyper-parameters, named as Megatron's / slime's flags.
///
/// Defaults are Megatron's, except two that slime overrides for RL (`lr` 1e-6, and `clip_grad`
/// 1.0, which is also Megatron's) and `lr_decay_style`, which is `constant` here (Megatron:
/// `linear` with `lr_decay_iters` defaulting to `train_iters`; every slime RL script passes
/// `--lr-decay-style constant`, and a constant LR needs no notion of run length).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default)]
pub struct OptimizerArgs {
    /// Peak learning rate, reached at the end of warmup.
    #[arg(long, default_value_t = 1e-6)]
    pub lr: f64,
    /// The learning rate the decay ends at (and stays at after `lr_decay_iters`).
    #[arg(long, default_value_t = 0.0)]
    pub min_lr: f64,
    /// How the learning rate goes from `lr` to `min_lr` after warmup.
    #[arg(long, value_enum, default_value_t = LrDecayStyle::Constant)]
    pub lr_decay_style: LrDecayStyle,
    /// Optimizer steps from step 0 to the end of the decay (warmup included). Required by every
    /// style except `constant` (Megatron defaults it to `train_iters`).
    #[arg(long)]
    pub lr_decay_iters: Option<u64>,
    /// Optimizer steps of linear warmup from `lr_warmup_init` to `lr`.
    #[arg(long, default_value_t = 0)]
    pub lr_warmup_iters: u64,
    /// The learning rate warmup starts from (the LR of step 0 when `lr_warmup_iters > 0`).
    #[arg(long, default_value_t = 0.0)]
    pub lr_warmup_init: f64,
    /// WSD only: the length of the final annealing phase, which ends at `lr_decay_iters`.
    #[arg(long)]
    pub lr_wsd_decay_iters: Option<u64>,
    /// WSD only: the shape of the annealing phase.
    #[arg(long, value_enum, default_value_t = WsdDecayStyle::Exponential)]
    pub lr_wsd_decay_style: WsdDecayStyle,
    /// Decoupled (AdamW) weight decay, applied as `p -= lr * weight_decay * p` to matrices only.
    #[arg(long, default_value_t = 0.01)]
    pub weight_decay: f64,
    #[arg(long, default_value_t = 0.9)]
    pub adam_beta1: f64,
    #[arg(long, default_value_t = 0.999)]
    pub adam_beta2: f64,
    /// Added to `sqrt(v_hat)` in Adam's denominator.
    #[arg(long, default_value_t = 1e-8)]
    pub adam_eps: f64,
    /// Max global L2 norm of the gradients; `<= 0` turns clipping off.
    #[arg(long, default_value_t = 1.0)]
    pub clip_grad: f64,
}

impl Default for OptimizerArgs {
    fn default() -> Self {
        OptimizerArgs {
            lr: 1e-6,
            min_lr: 0.0,
            lr_decay_style: LrDecayStyle::Constant,
            lr_decay_iters: None,
            lr_warmup_iters: 0,
            lr_warmup_init: 0.0,
            lr_wsd_decay_iters: None,
            lr_wsd_decay_style: WsdDecayStyle::Exponential,
            weight_decay: 0.01,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_eps: 1e-8,
            clip_grad: 1.0,
        }
    }
}

impl OptimizerArgs {
    /// Checks the Adam hyper-parameters and the schedule (see [`LrScheduler::new`]).
    pub fn validate(&self) -> anyhow::Result<()> {
        AdamW::check_hyper_params(self)?;
        LrScheduler::new(self)?;
        Ok(())
    }
}
