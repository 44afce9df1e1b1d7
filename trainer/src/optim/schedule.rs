//! Megatron-Core's learning-rate schedule (`OptimizerParamScheduler.get_lr`), in optimizer steps.
//!
//! Order of the cases is Megatron's and matters: warmup first (inclusive of its last step), then
//! `constant`, then "past `lr_decay_iters` means `min_lr`", then the decay style. The float
//! expressions are written in Megatron's evaluation order so the LRs match it to the last bit.
//! Megatron's weight-decay increment schedule (`start_wd`/`end_wd`) is not reproduced: weight
//! decay is constant.
use super::OptimizerArgs;
use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};
use std::f64::consts::PI;

/// `--lr-decay-style`, spelled as Megatron spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
pub enum LrDecayStyle {
    #[serde(rename = "constant")]
    #[value(name = "constant")]
    Constant,
    #[serde(rename = "linear")]
    #[value(name = "linear")]
    Linear,
    #[serde(rename = "cosine")]
    #[value(name = "cosine")]
    Cosine,
    #[serde(rename = "inverse-square-root")]
    #[value(name = "inverse-square-root")]
    InverseSquareRoot,
    /// Warmup-stable-decay: `lr` until `lr_decay_iters - lr_wsd_decay_iters`, then annealing.
    #[serde(rename = "WSD")]
    #[value(name = "WSD")]
    Wsd,
}

/// `--lr-wsd-decay-style`: the annealing shape of WSD's last phase.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum WsdDecayStyle {
    Linear,
    Cosine,
    Exponential,
    MinusSqrt,
}

/// The LR of each optimizer step; immutable, so resuming needs only the step count.
#[derive(Debug, Clone, PartialEq)]
pub struct LrScheduler {
    max_lr: f64,
    min_lr: f64,
    init_lr: f64,
    warmup: u64,
    style: LrDecayStyle,
    /// 0 for `constant` without `lr_decay_iters` (never read then).
    decay: u64,
    wsd_decay: u64,
    wsd_style: WsdDecayStyle,
}

impl LrScheduler {
    /// Validates as Megatron asserts: `0 <= min_lr <= lr`, `lr_warmup_init <= lr`,
    /// `lr_warmup_iters < lr_decay_iters`; WSD also needs `0 < lr_wsd_decay_iters <= lr_decay_iters`.
    pub fn new(args: &OptimizerArgs) -> Result<Self> {
        let (max_lr, min_lr, init_lr) = (args.lr, args.min_lr, args.lr_warmup_init);
        if !(max_lr.is_finite() && min_lr.is_finite() && init_lr.is_finite()) {
            bail!("lr {max_lr}, min_lr {min_lr} and lr_warmup_init {init_lr} must be finite");
        }
        if min_lr < 0.0 || max_lr < min_lr {
            bail!("need 0 <= min_lr <= lr, got min_lr {min_lr}, lr {max_lr}");
        }
        if init_lr < 0.0 || init_lr > max_lr {
            bail!("need 0 <= lr_warmup_init <= lr, got lr_warmup_init {init_lr}, lr {max_lr}");
        }
        let style = args.lr_decay_style;
        let warmup = args.lr_warmup_iters;
        let decay = match (style, args.lr_decay_iters) {
            (LrDecayStyle::Constant, None) => 0,
            (_, Some(d)) if d > warmup => d,
            (_, Some(d)) => bail!("lr_decay_iters ({d}) must be larger than lr_warmup_iters ({warmup})"),
            (_, None) => {
                bail!("lr_decay_style {style:?} needs lr_decay_iters (Megatron defaults it to train_iters; set it)")
            }
        };
        let wsd_decay = match (style, args.lr_wsd_decay_iters) {
            (LrDecayStyle::Wsd, Some(w)) if w > 0 && w <= decay => w,
            (LrDecayStyle::Wsd, w) => {
                bail!("lr_decay_style WSD needs 0 < lr_wsd_decay_iters <= lr_decay_iters ({decay}), got {w:?}")
            }
            (_, _) => 0,
        };
        Ok(LrScheduler {
            max_lr,
            min_lr,
            init_lr,
            warmup,
            style,
            decay,
            wsd_decay,
            wsd_style: args.lr_wsd_decay_style,
        })
    }

    /// The learning rate after `step` optimizer steps, i.e. the LR to use for step `step`.
    pub fn lr_at(&self, step: u64) -> f64 {
        let (max_lr, min_lr) = (self.max_lr, self.min_lr);
        if self.warmup > 0 && step <= self.warmup {
            return self.init_lr + (max_lr - self.init_lr) * step as f64 / self.warmup as f64;
        }
        if self.style == LrDecayStyle::Constant {
            return max_lr;
        }
        if step > self.decay {
            return min_lr;
        }
        if self.style == LrDecayStyle::InverseSquareRoot {
            let warmup = self.warmup.max(1) as f64;
            let n = step.max(1) as f64;
            return min_lr.max(max_lr * warmup.powf(0.5) / n.powf(0.5));
        }
        let decay_ratio = (step - self.warmup) as f64 / (self.decay - self.warmup) as f64;
        let coeff = match self.style {
            LrDecayStyle::Linear => 1.0 - decay_ratio,
            LrDecayStyle::Cosine => 0.5 * ((PI * decay_ratio).cos() + 1.0),
            LrDecayStyle::Wsd => {
                let anneal_start = self.decay - self.wsd_decay;
                if step <= anneal_start {
                    1.0
                } else {
                    let r = (step - anneal_start) as f64 / self.wsd_decay as f64;
                    match self.wsd_style {
                        WsdDecayStyle::Linear => 1.0 - r,
                        WsdDecayStyle::Cosine => 0.5 * ((PI * r).cos() + 1.0),
                        WsdDecayStyle::Exponential => 2.0 * 0.5f64.powf(r) - 1.0,
                        WsdDecayStyle::MinusSqrt => 1.0 - r.sqrt(),
                    }
                }
            }
            LrDecayStyle::Constant | LrDecayStyle::InverseSquareRoot => unreachable!("handled above"),
        };
        min_lr + coeff * (max_lr - min_lr)
    }
}
