//! RL math: advantage estimators (host-side, f64) and the policy / value losses (candle tensors,
//! so gradients reach log-probs, entropy and values), both as slime computes them.
//!
//! Reference: THUDM/slime v0.3.1, commit 624b824a898ab0ec1fcb4d373004c7f3852bf515 —
//! `slime/ray/rollout.py` (`_post_process_rewards`), `slime/utils/ppo_utils.py`,
//! `slime/backends/megatron_utils/loss.py` (`compute_advantages_and_returns`,
//! `policy_loss_function`, `value_loss_function`, `loss_function`),
//! `slime/backends/megatron_utils/cp_utils.py` (`get_sum_of_sample_mean`) and
//! `slime/utils/distributed_utils.py` (`distributed_masked_whiten`).
//! `tests/fixtures/gen_rl_fixtures.py` re-implements those formulas in torch (and cross-checks
//! them against slime's own functions); `trainer/tests/rl_parity.rs` holds vime to it.
//!
//! One RL step, as the loop uses this module:
//!
//! ```text
//! let rewards = post_process_rewards(&args, &raw, n_samples_per_prompt, rollout_batch_size)?;
//! let adv = compute_advantages_and_returns(&args, &AdvantageInputs { .. }, &dp_all_reduce)?;
//! // per micro-batch, inside Qwen3Model::forward_backward's closure:
//! let reducer = LossReducer::new(&cu_seqlens, &loss_mask, None, args.calculate_per_token_loss)?;
//! let out = policy_loss(&args, &PolicyLossInputs { log_probs, entropy, advantages, .. }, &reducer)?;
//! Ok((out.loss / step_normalizer)?)   // see `LossReducer` for the normalizer
//! ```
//!
//! Decisions:
//! - Everything works on *loss tokens*: the response tokens of several samples packed back to back,
//!   with `cu_seqlens` (`[0, n_0, n_0 + n_1, ..]`) as sample boundaries and a 0/1 loss mask over
//!   them. Gathering response positions out of a packed prompt+response batch is the caller's job.
//! - Advantages are host `Vec<f64>` math (slime does them in f32 tensors; f64 is at least as
//!   accurate); losses are generic over the tensors' dtype (f32 or f64).
//! - The one collective in advantages (whitening's sums) goes through [`SumAllReduce`], so the
//!   data-parallel all-reduce is a value passed in, never global state.
//! - Flags keep slime's spellings in [`RlArgs`], a `clap::Args` and serde struct with slime's
//!   defaults (`eps_clip_high: None` means "= eps_clip", as slime resolves it).
mod advantages;
mod losses;

pub use advantages::{
    approx_kl_host, compute_advantages_and_returns, discounted_returns, gae, grpo_returns, masked_whiten,
    post_process_rewards, reinforce_plus_plus_baseline_advantages, reinforce_plus_plus_returns, AdvantageInputs,
    AdvantageOutputs, NoAllReduce, SumAllReduce,
};
pub use losses::{
    approx_kl, cispo_loss, gspo_kl, policy_loss, ppo_clip_loss, read_scalars, tis_weights, value_loss, LossOutput,
    LossReducer, PolicyLossInputs, TisWeights, ValueLossInputs,
};

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

/// `--advantage-estimator`, spelled as slime spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum AdvantageEstimator {
    /// Group-normalised reward broadcast to every response token.
    Grpo,
    /// GRPO advantages; the policy loss uses a sequence-level ratio.
    Gspo,
    /// GRPO advantages; the policy loss is CISPO's (clipped, stop-gradient IS weight).
    Cispo,
    /// GAE over a critic's values, KL as a per-token reward penalty.
    Ppo,
    /// Discounted return of the KL-penalised token rewards (needs `normalize_advantages`).
    ReinforcePlusPlus,
    /// Reward minus the group mean, minus `kl_coef * kl` per token (needs `normalize_advantages`).
    ReinforcePlusPlusBaseline,
}

/// `--kl-loss-type`: the KL estimator, used both for the KL loss and for the KL reward penalty.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum KlType {
    K1,
    K2,
    K3,
    LowVarKl,
}

/// The RL hyper-parameters, named and defaulted as slime's flags (`slime/utils/arguments.py`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, clap::Args)]
#[serde(default)]
pub struct RlArgs {
    #[arg(long, value_enum, default_value_t = AdvantageEstimator::Grpo)]
    pub advantage_estimator: AdvantageEstimator,
    /// Dr. GRPO: subtract the group mean but do not divide by the group std.
    #[arg(long)]
    pub disable_grpo_std_normalization: bool,
    /// Use the raw rewards (no group mean / std) for grpo, gspo, cispo, reinforce_plus_plus_baseline.
    #[arg(long)]
    pub disable_rewards_normalization: bool,
    /// Discount factor (PPO's GAE and REINFORCE++'s returns).
    #[arg(long, default_value_t = 1.0)]
    pub gamma: f64,
    /// GAE lambda.
    #[arg(long, default_value_t = 1.0)]
    pub lambd: f64,
    /// KL penalty coefficient folded into the rewards (ppo, reinforce_plus_plus[_baseline]).
    #[arg(long, default_value_t = 0.0)]
    pub kl_coef: f64,
    /// Whiten the advantages over every loss token of the batch (all data-parallel ranks).
    #[arg(long)]
    pub normalize_advantages: bool,
    /// PPO clip range: the ratio is clipped to `[1 - eps_clip, 1 + eps_clip_high]`.
    #[arg(long, default_value_t = 0.2)]
    pub eps_clip: f64,
    /// Upper clip range; `None` means `eps_clip`.
    #[arg(long)]
    pub eps_clip_high: Option<f64>,
    /// Dual-clip PPO's lower bound `c > 1` on the loss of tokens with negative advantage.
    #[arg(long)]
    pub eps_clip_c: Option<f64>,
    #[arg(long, value_enum, default_value_t = KlType::K1)]
    pub kl_loss_type: KlType,
    /// Add `kl_loss_coef * KL(policy || reference)` to the policy loss.
    #[arg(long)]
    pub use_kl_loss: bool,
    #[arg(long, default_value_t = 0.0)]
    pub kl_loss_coef: f64,
    /// Multiply the KL loss by the importance ratio `exp(logp - old_logp)` (DeepSeek-V3.2).
    #[arg(long)]
    pub use_unbiased_kl: bool,
    /// Entropy bonus: the loss gets `- entropy_coef * entropy`.
    #[arg(long, default_value_t = 0.0)]
    pub entropy_coef: f64,
    /// Truncated importance sampling between the rollout engine's and the trainer's log-probs.
    #[arg(long)]
    pub use_tis: bool,
    #[arg(long, default_value_t = 2.0)]
    pub tis_clip: f64,
    #[arg(long, default_value_t = 0.0)]
    pub tis_clip_low: f64,
    /// Normalise the loss by the number of loss tokens instead of by the number of samples.
    #[arg(long)]
    pub calculate_per_token_loss: bool,
    /// Clip range of the critic's value update.
    #[arg(long, default_value_t = 0.2)]
    pub value_clip: f64,
    /// PPO warm-up: for the first N rollouts only the critic is trained (slime `train.py`:
    /// the actor trains when `rollout_id >= num_critic_only_steps`).
    #[arg(long, default_value_t = 0)]
    pub num_critic_only_steps: u64,
}

impl Default for RlArgs {
    fn default() -> Self {
        RlArgs {
            advantage_estimator: AdvantageEstimator::Grpo,
            disable_grpo_std_normalization: false,
            disable_rewards_normalization: false,
            gamma: 1.0,
            lambd: 1.0,
            kl_coef: 0.0,
            normalize_advantages: false,
            eps_clip: 0.2,
            eps_clip_high: None,
            eps_clip_c: None,
            kl_loss_type: KlType::K1,
            use_kl_loss: false,
            kl_loss_coef: 0.0,
            use_unbiased_kl: false,
            entropy_coef: 0.0,
            use_tis: false,
            tis_clip: 2.0,
            tis_clip_low: 0.0,
            calculate_per_token_loss: false,
            value_clip: 0.2,
            num_critic_only_steps: 0,
        }
    }
}

impl RlArgs {
    /// The upper clip range as slime resolves it: `eps_clip_high`, or `eps_clip` when unset.
    pub fn eps_clip_high_resolved(&self) -> f64 {
        self.eps_clip_high.unwrap_or(self.eps_clip)
    }

    /// Whether the actor takes optimizer steps on this rollout (false during the critic-only
    /// warm-up of `--num-critic-only-steps`).
    pub fn train_actor(&self, rollout_id: u64) -> bool {
        rollout_id >= self.num_critic_only_steps
    }

    /// Whether the critic is trained (slime: `use_critic = advantage_estimator == "ppo"`).
    pub fn use_critic(&self) -> bool {
        self.advantage_estimator == AdvantageEstimator::Ppo
    }

    /// slime's argument checks on these flags (`slime/utils/arguments.py`), plus one of vime's own:
    /// `tis_clip_low <= tis_clip`.
    pub fn validate(&self) -> Result<()> {
        if self.kl_coef != 0.0 && self.kl_loss_coef != 0.0 {
            bail!(
                "only one of --kl-coef ({}) and --kl-loss-coef ({}) can be set",
                self.kl_coef,
                self.kl_loss_coef
            );
        }
        if matches!(
            self.advantage_estimator,
            AdvantageEstimator::ReinforcePlusPlus | AdvantageEstimator::ReinforcePlusPlusBaseline
        ) && !self.normalize_advantages
        {
            bail!(
                "--advantage-estimator {:?} requires advantage normalization: add --normalize-advantages",
                self.advantage_estimator
            );
        }
        if let Some(c) = self.eps_clip_c {
            if c <= 1.0 {
                bail!("--eps-clip-c is dual-clip PPO's lower bound and must be > 1.0, got {c}");
            }
        }
        if self.tis_clip_low > self.tis_clip {
            bail!(
                "--tis-clip-low ({}) exceeds --tis-clip ({})",
                self.tis_clip_low,
                self.tis_clip
            );
        }
        Ok(())
    }
}
