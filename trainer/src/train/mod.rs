//! The RL loop (`vime-train` without a subcommand), in slime's order:
//!
//! ```text
//! load (or resume from --load) -> [eval at step 0]
//! for rollout in start..--num-rollout:
//!     prompts  = the next --rollout-batch-size prompts (data cursor)
//!     samples  = engine.generate(prompt x --n-samples-per-prompt)     (sft: prompt + label + eos)
//!     rewards  = --rm-type on the decoded responses
//!     old logp = policy forward; ref logp (KL terms); values (PPO critic)
//!     adv, ret = crate::rl::compute_advantages_and_returns
//!     --num-steps-per-rollout x (critic step if PPO; policy step unless critic-only warm-up)
//!     engine  <- policy weights (in place for the built-in engine, an HF folder for HTTP ones)
//!     eval every --eval-interval; metrics line; checkpoint every --save-interval
//! ```
//!
//! Decisions:
//! - The step counter is the number of finished rollouts. Metrics line `k` holds rollout `k-1`'s
//!   rollout, train, perf and (when due) eval metrics; line 0 is the eval before training. A
//!   checkpoint is written after its step's metrics line, so on `--load` the metrics file keeps
//!   lines up to the checkpoint's step and continues from there.
//! - Sampling seeds are derived from (`--seed`, rollout, sample) and (`--seed`, eval set, prompt,
//!   sample): a resumed run generates exactly what the uninterrupted run would have, and every
//!   evaluation uses the same random numbers (common random numbers: eval curves move with the
//!   model, not with the sampler).
//! - Old log-probs are recomputed by the policy before training (slime's default, not the engine's
//!   log-probs); the engine's are kept to report `rollout/log_probs_abs_diff` (trainer vs rollout)
//!   and for `--use-tis`.
//! - Ctrl-C finishes the current phase, writes the plot and returns (a second Ctrl-C exits at
//!   once). No checkpoint is written on interrupt; `--load` resumes from the last saved one.
//! - NaN/Inf: an optimizer step whose loss or gradients are not finite on any rank is not applied
//!   (`step`'s guard) and counted in `train/skipped_steps`; a reward that is not finite is counted in
//!   `rollout/nonfinite_rewards` and skips the steps it poisons. `--check-for-nan-in-loss-and-grad`
//!   stops the run instead, naming the step (Megatron's default is to stop; vime's is to skip, so
//!   one bad sample does not end a long RL run).
//! - With `--load`, HTTP engines get the weights the run starts from before the first rollout, even
//!   without a checkpoint: they outlive a killed trainer and may hold a later step's weights.
pub mod args;
pub mod compat;
pub mod engine;
pub mod eval;
pub mod parallel;
pub mod placement;
pub mod resolve;
pub mod step;
mod ui;

/// Test-only fault hooks for the fault-matrix tests (`trainer/tests/faults.rs`): environment
/// variables read once, hidden from `--help`, a no-op unless set (one `OnceLock` read and a
/// `None` check per visit of a point otherwise).
///
/// - `VIME_TEST_KILL_AT=<point>:<n>[@<rank>]`: SIGKILL this process the n-th time (from 1) it
///   reaches `point` (only on global rank `rank`, `RANK` of torchrun's environment, when given).
/// - `VIME_TEST_ERROR_AT=<point>:<n>[@<rank>]`: that visit returns an error instead.
/// - `VIME_TEST_NAN_AT=<what>:<n>[@<rank>]`: a NaN in the n-th rollout's first reward
///   (`reward`), the n-th policy step's first old log-prob and so its loss (`loss`), or the n-th
///   optimizer step's first gradient (`grad`).
///
/// Points, in the order a rollout reaches them: `rollout` (prompts drawn, nothing generated),
/// `reward` (samples generated, not scored), `logprobs` (old log-probs computed), `optimizer`
/// (a step's gradients accumulated, no update yet), `sync-start` / `sync-end` (around the weight
/// sync), `metrics` (half of the step's JSONL line written), and in a checkpoint save
/// `save-files` (`hf/` written, the optimizer state not), `save-renamed` (the folder renamed,
/// the `latest` pointer not updated), `save-latest` (the pointer's temp file written, not renamed).
pub mod fault {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;

    struct Hook {
        point: String,
        n: u64,
        rank: Option<u64>,
        hits: AtomicU64,
    }

    impl Hook {
        fn parse(var: &str) -> Option<Hook> {
            let spec = std::env::var(var).ok()?;
            let (spec, rank) = match spec.split_once('@') {
                Some((s, r)) => (s.to_string(), Some(r.parse().ok()?)),
                None => (spec, None),
            };
            let (point, n) = spec.rsplit_once(':')?;
            Some(Hook {
                point: point.to_string(),
                n: n.parse().ok()?,
                rank,
                hits: AtomicU64::new(0),
            })
        }

        /// Counts a visit of `point`; true on the visit the hook names.
        fn due(&self, point: &str) -> bool {
            if self.point != point {
                return false;
            }
            if let Some(r) = self.rank {
                let mine: u64 = std::env::var("RANK").ok().and_then(|v| v.parse().ok()).unwrap_or(0);
                if mine != r {
                    return false;
                }
            }
            self.hits.fetch_add(1, Ordering::SeqCst) + 1 == self.n
        }
    }

    struct Hooks {
        kill: Option<Hook>,
        error: Option<Hook>,
        nan: Option<Hook>,
    }

    fn hooks() -> &'static Hooks {
        static H: OnceLock<Hooks> = OnceLock::new();
        H.get_or_init(|| Hooks {
            kill: Hook::parse("VIME_TEST_KILL_AT"),
            error: Hook::parse("VIME_TEST_ERROR_AT"),
            nan: Hook::parse("VIME_TEST_NAN_AT"),
        })
    }

    /// True on the visit of `point` that `VIME_TEST_KILL_AT` names: the caller may leave
    /// something half-done, then calls [`kill`].
    pub fn kill_due(point: &str) -> bool {
        hooks().kill.as_ref().is_some_and(|h| h.due(point))
    }

    /// SIGKILL to this process: no destructor, flush or handler runs.
    pub fn kill(point: &str) -> ! {
        eprintln!("VIME_TEST_KILL_AT: SIGKILL at {point}");
        extern "C" {
            fn raise(sig: std::ffi::c_int) -> std::ffi::c_int;
        }
        const SIGKILL: std::ffi::c_int = 9;
        // SAFETY: raise(3) has no preconditions; SIGKILL cannot be caught, so it does not return.
        unsafe {
            raise(SIGKILL);
        }
        std::process::abort()
    }

    /// A visit of `point`: dies or fails there when a hook names this visit.
    pub fn at(point: &str) -> anyhow::Result<()> {
        if kill_due(point) {
            kill(point);
        }
        if hooks().error.as_ref().is_some_and(|h| h.due(point)) {
            anyhow::bail!("VIME_TEST_ERROR_AT: injected error at {point}");
        }
        Ok(())
    }

    /// True on the visit of `what` (`reward`, `loss`, `grad`) that `VIME_TEST_NAN_AT` names.
    pub fn nan_due(what: &str) -> bool {
        let due = hooks().nan.as_ref().is_some_and(|h| h.due(what));
        if due {
            eprintln!("VIME_TEST_NAN_AT: NaN injected in the {what}");
        }
        due
    }
}

pub use args::{EvalSet, LossType, ParallelArgs, TrainArgs};
pub use engine::Engine;
pub use step::Sample;

use crate::batching::MicroBatchPolicy;
use crate::ckpt::{self, CheckpointContents, DataCursor, TrainState};
use crate::critic::{Critic, ReferenceModel};
use crate::device::parse_dtype;
use crate::metrics::{plot_metrics_file, MetricsLogger};
use crate::optim::{DistributedAdamW, LrScheduler, OptimizerArgs};
use crate::rl::{compute_advantages_and_returns, post_process_rewards, AdvantageInputs, NoAllReduce};
use anyhow::{bail, ensure, Context, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;
use step::{PolicyData, StepConfig, StepReport};
use ui::Ui;
use vime_dist::World;
use vime_qwen3::batch::PackedBatch;
use vime_qwen3::context_parallel::CpShard;
use vime_qwen3::model::{Qwen3, Recompute};
use vime_qwen3::state_dict::param_specs;
use vime_rollout::data::{PromptDataset, PromptSample, Tokenizer};
use vime_rollout::engine::{FinishReason, GenOutput, GenRequest, SamplingParams};
use vime_rollout::reward::{RewardModel, RewardSample};

pub use ui::interrupted;

/// What a finished (or interrupted) run reports.
#[derive(Debug, Clone, Default)]
pub struct RunSummary {
    /// The step counter at the end (finished rollouts, resumed ones included).
    pub final_step: u64,
    /// Rollouts run by this call.
    pub rollouts_run: u64,
    /// The last metrics line's eval metrics (empty without eval).
    pub last_eval: BTreeMap<String, f64>,
    /// The eval metrics of the first evaluation of this call.
    pub first_eval: BTreeMap<String, f64>,
    pub metrics_file: Option<PathBuf>,
    pub plot_file: Option<PathBuf>,
    pub last_checkpoint: Option<PathBuf>,
    pub interrupted: bool,
}

/// SplitMix64 finaliser: a stateless mixer for per-sample seeds.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn seed_of(parts: &[u64]) -> u64 {
    parts.iter().fold(0x5EED_u64, |acc, &p| mix(acc ^ mix(p)))
}

const EVAL_STREAM: u64 = 0xE7A1;
const ROLLOUT_STREAM: u64 = 0x7011;

/// Everything the loop holds.
struct Run<'a> {
    args: &'a TrainArgs,
    tokenizer: Tokenizer,
    tokenizer_dir: PathBuf,
    eos_ids: Vec<u32>,
    policy: Qwen3,
    opt: DistributedAdamW,
    sched: LrScheduler,
    reference: Option<ReferenceModel>,
    critic: Option<(Critic, DistributedAdamW, LrScheduler)>,
    dataset: PromptDataset,
    eval_sets: Vec<(String, PromptDataset)>,
    reward: Option<RewardModel>,
    rt: tokio::runtime::Runtime,
    /// The rollout engine: rank 0's alone.
    engine: Option<Engine>,
    /// This process's rank and its groups (a single rank without torchrun's environment).
    world: World,
    state: TrainState,
    micro_batches: MicroBatchPolicy,
    recompute: Recompute,
    ui: Ui,
}

/// Runs (or resumes) a training run to `--num-rollout`.
pub fn run(args: &TrainArgs) -> Result<RunSummary> {
    // Everything `auto` or implied is settled, and every flag checked, before any process joins
    // or any weight loads.
    let (args, plan) = resolve::resolve(args)?;
    let args = &args;
    args.validate()?;
    if std::env::var("RANK").map_or(true, |r| r == "0") {
        for line in &plan.lines {
            eprintln!("vime: {line}");
        }
    }
    ui::install_interrupt_handler();
    let (world, device, backend) = parallel::join_world(&args.parallel, &args.device)?;
    let mut run = Run::setup(args, &plan, world, device, backend)?;
    // On an error the run (and its world) is dropped without a goodbye: the other ranks'
    // watchdogs report this rank as failed instead of waiting in their next collective.
    let summary = run.main_loop()?;
    run.world.finish()?;
    Ok(summary)
}

fn load_tokenizer(dir: &Path) -> Result<Tokenizer> {
    Tokenizer::from_dir(dir).with_context(|| format!("loading the tokenizer of {}", dir.display()))
}

impl<'a> Run<'a> {
    fn setup(
        args: &'a TrainArgs,
        plan: &resolve::Plan,
        world: World,
        device: candle_core::Device,
        backend: &str,
    ) -> Result<Self> {
        // Several ranks: a cuDNN failure is an error, never one rank falling back to the flash
        // kernel alone (its numbers, and its determinism, would differ from the others').
        let on_cudnn_failure = if world.size() > 1 {
            vime_kernels::CudnnFailure::Error
        } else {
            vime_kernels::CudnnFailure::Fallback
        };
        let kernels =
            crate::device::apply_kernel_flags(&args.attention_backend, args.deterministic_mode, on_cudnn_failure)?
                .with_batch_invariant(args.true_on_policy_mode);
        let kernels = args.head.apply(args.fp8.apply(kernels)?)?;
        if args.true_on_policy_mode && world.rank() == 0 {
            let d = world.dims();
            if d.tp > 1 || d.cp > 1 || args.rollout_engine != "embedded" {
                eprintln!(
                    "vime: --true-on-policy-mode makes the trainer's and the engine's log-probs equal bit for bit only \
                     with the built-in engine (or vime-serve with the same flag) at tp 1 and cp 1 (here tp {}, cp {}, \
                     --rollout-engine {}): the kernels stay batch-invariant, the gap is measured as usual",
                    d.tp, d.cp, args.rollout_engine
                );
            }
        }
        let dtype = parse_dtype(&args.dtype)?;
        if kernels.fp8() && dtype != candle_core::DType::BF16 {
            anyhow::bail!(
                "--fp8-format hybrid runs the linear layers of bf16 models (--dtype bf16); this run computes in {dtype:?}"
            );
        }
        let rank0 = world.rank() == 0;
        let ui = if rank0 { Ui::new(args.no_progress) } else { Ui::silent() };
        if world.store().is_some() {
            // A launched world (torchrun's environment), even of one rank.
            let d = world.dims();
            ui.log(&format!(
                "parallel: {} ranks (dp {} x tp {} x cp {}), {} backend, ZeRO-1 optimizer over dp",
                world.size(),
                d.dp,
                d.tp,
                d.cp,
                backend
            ));
        }
        let g = args.global_batch_size_resolved();
        ensure!(
            g >= world.dims().dp,
            "--global-batch-size {g} is smaller than the data-parallel size {}: every rank needs a sample per step",
            world.dims().dp
        );

        if let (true, Some(save)) = (rank0, &args.save) {
            ckpt::check_save_dir(save)?;
        }
        let resumed = match &args.load {
            Some(root) => ckpt::load_latest(root, &device)
                .with_context(|| format!("reading the checkpoints in --load {}", root.display()))?,
            None => None,
        };
        let model_dir = match (&resumed, &args.hf_checkpoint) {
            (Some(l), _) => l.hf_dir(),
            (None, Some(hf)) => hf.clone(),
            (None, None) => bail!(
                "--load {} holds no checkpoint yet and --hf-checkpoint is not set: nothing to start from",
                args.load.as_deref().unwrap_or(Path::new("")).display()
            ),
        };
        let tokenizer_dir = args.hf_checkpoint.clone().unwrap_or_else(|| model_dir.clone());
        let tokenizer = load_tokenizer(&tokenizer_dir)?;

        let mut policy = match &plan.random_init {
            Some(cfg) => {
                // The same draw on every rank (one seed), so TP shards cut one model.
                crate::bench::random_model(cfg.clone(), dtype, &device)?
            }
            None => Qwen3::load_hf(&model_dir, dtype, &device)
                .with_context(|| format!("loading the policy from {}", model_dir.display()))?,
        };
        let tp = world.tp().clone();
        if tp.size() > 1 {
            // Every rank reads the checkpoint and keeps its TP shard (Megatron's split).
            policy = policy
                .shard(vime_qwen3::model::TpPlace {
                    rank: tp.rank(),
                    size: tp.size(),
                })
                .context("sharding the policy over the tensor-parallel group")?;
        }
        policy.set_kernel_config(kernels.clone());
        policy.set_sequence_parallel(args.parallel.sequence_parallel);
        policy.set_tp_comm_overlap(args.parallel.tp_comm_overlap);
        let cfg = policy.config().clone();
        ensure!(
            tokenizer.vocab_size() <= cfg.vocab_size,
            "the tokenizer of {} has {} tokens but the model's vocab_size is {}",
            tokenizer_dir.display(),
            tokenizer.vocab_size(),
            cfg.vocab_size
        );
        let mut opt = if tp.size() > 1 {
            let table = crate::optim::qwen3_layout(&param_specs(&cfg), dtype, tp.rank(), tp.size())?;
            DistributedAdamW::with_layout(policy.named_parameters(), table, &args.optim, &**world.dp())?
        } else {
            DistributedAdamW::new(policy.named_parameters(), &args.optim, &**world.dp())?
        };
        let sched = LrScheduler::new(&args.optim)?;

        let mut state = TrainState {
            rng: args.seed,
            data: DataCursor {
                seed: args.data.rollout_seed,
                ..Default::default()
            },
            ..Default::default()
        };
        if let Some(l) = &resumed {
            opt.load_state_tensors_tp(&l.optimizer, l.state.optimizer_step, &**world.dp())
                .with_context(|| format!("loading the optimizer state of {}", l.dir.display()))?;
            restore_fp8_amax(l, "policy", world.rank(), &policy, &ui)?;
            state = l.state.clone();
            ui.log(&format!(
                "resuming from {} (step {}, {} optimizer steps)",
                l.dir.display(),
                state.step,
                state.optimizer_step
            ));
        }

        let policy_loss = args.loss_type == LossType::PolicyLoss;
        ensure!(
            !(world.dims().cp > 1 && policy_loss && args.rl.advantage_estimator == crate::rl::AdvantageEstimator::Gspo),
            "--advantage-estimator gspo with --context-parallel-size {}: GSPO's per-sample mean log-ratio spans \
             the CP ranks' chunks, which vime does not combine yet",
            world.dims().cp
        );
        let needs_ref = policy_loss && (args.rl.use_kl_loss || args.rl.kl_coef != 0.0);
        let reference = if needs_ref {
            let dir = args
                .ref_load
                .as_ref()
                .or(args.hf_checkpoint.as_ref())
                .context("the KL terms need a reference model: pass --ref-load (or --hf-checkpoint)")?;
            let mut reference = ReferenceModel::load(dir, dtype, &device)?;
            if tp.size() > 1 {
                reference = reference.shard(tp.rank(), tp.size())?;
                reference.set_sequence_parallel(args.parallel.sequence_parallel);
            }
            reference.set_kernel_config(kernels.clone());
            Some(reference)
        } else {
            None
        };

        let critic = if policy_loss && args.rl.use_critic() {
            let mut critic = match resumed.as_ref().and_then(|l| l.critic_dir()) {
                Some(dir) => Critic::load(&dir, dtype, &device)?,
                None => {
                    let dir = args
                        .critic_load
                        .as_ref()
                        .or(args.hf_checkpoint.as_ref())
                        .context("PPO needs a critic: pass --critic-load (or --hf-checkpoint)")?;
                    if Critic::has_value_head(dir) {
                        Critic::load(dir, dtype, &device)?
                    } else {
                        Critic::init_from_hf(dir, dtype, &device, seed_of(&[args.seed, 0xC121]))?
                    }
                }
            };
            if tp.size() > 1 {
                critic = critic.shard(tp.rank(), tp.size())?;
                critic.set_sequence_parallel(args.parallel.sequence_parallel);
                critic.set_tp_comm_overlap(args.parallel.tp_comm_overlap);
            }
            critic.set_kernel_config(kernels.clone());
            let critic_args = OptimizerArgs {
                lr: args.critic_lr.unwrap_or(args.optim.lr),
                ..args.optim.clone()
            };
            let mut copt = if tp.size() > 1 {
                let table = critic.layout(dtype, tp.rank(), tp.size())?;
                DistributedAdamW::with_layout(&critic.named_parameters(), table, &critic_args, &**world.dp())?
            } else {
                DistributedAdamW::new(&critic.named_parameters(), &critic_args, &**world.dp())?
            };
            if let Some(l) = &resumed {
                if !l.critic_optimizer.is_empty() {
                    let steps = l
                        .state
                        .extra
                        .get("critic_optimizer_step")
                        .and_then(|v| v.as_u64())
                        .unwrap_or(0);
                    copt.load_state_tensors_tp(&l.critic_optimizer, steps, &**world.dp())?;
                }
            }
            if let Some(l) = &resumed {
                restore_fp8_amax(l, "critic", world.rank(), critic.backbone(), &ui)?;
            }
            Some((critic, copt, LrScheduler::new(&critic_args)?))
        } else {
            None
        };

        let mut dataset = PromptDataset::from_args(&args.data, &tokenizer)?;
        if resumed.is_some() {
            dataset.set_cursor(vime_rollout::data::DataCursor {
                epoch: state.data.epoch,
                offset: state.data.offset,
                seed: state.data.seed,
            })?;
        }
        let mut eval_sets = Vec::new();
        let eval_data_args = vime_rollout::data::DataArgs {
            rollout_shuffle: false,
            ..args.data.clone()
        };
        for set in args.eval_sets()? {
            let ds = PromptDataset::load(&set.path, &eval_data_args, &tokenizer)
                .with_context(|| format!("loading --eval-prompt-data {} {}", set.name, set.path.display()))?;
            eval_sets.push((set.name, ds));
        }
        let reward = if !args.rm_type.trim().is_empty() || args.rm_url.is_some() {
            Some(RewardModel::new(&args.rm_type, args.rm_url.as_deref())?)
        } else {
            None
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the reward runtime")?;

        let mut eos_ids: Vec<u32> = cfg.eos_token_id.as_ref().map(|e| e.to_vec()).unwrap_or_default();
        if let Some(e) = tokenizer.eos_token_id() {
            if !eos_ids.contains(&e) {
                eos_ids.push(e);
            }
        }
        // Under TP the engine (rank 0's) gets the whole model: every rank joins the gather.
        let whole = whole_policy(&policy, &*tp, rank0)?;
        let engine_policy = whole.as_ref().unwrap_or(&policy);
        let engine = match args.rollout_engine.as_str() {
            _ if !rank0 => None,
            "embedded" => Some(Engine::embedded(
                engine_policy,
                eos_ids.clone(),
                args.seed,
                args.rollout_kv_cache_tokens,
                &args.sync,
            )?),
            _ => {
                let sync_dir = args
                    .save
                    .clone()
                    .unwrap_or_else(|| std::env::temp_dir().join(format!("vime-sync-{}", std::process::id())))
                    .join("weights-for-engines");
                let e = Engine::remote(&args.vllm, &args.sync, engine_policy, &model_dir, sync_dir)?;
                // A run that may be a restart (`--load`) first syncs the weights it starts from:
                // the engines outlive a killed trainer and may hold a later step's weights, even
                // when no checkpoint was written yet (found by trainer/tests/faults.rs).
                match (&resumed, &args.load) {
                    (Some(r), _) => {
                        e.sync_weights(engine_policy, &tokenizer_dir, r.state.step)?;
                    }
                    (None, Some(_)) => {
                        e.sync_weights(engine_policy, &tokenizer_dir, 0)?;
                    }
                    (None, None) => {}
                }
                Some(e)
            }
        };

        drop(whole);
        // Under CP a micro-batch's tokens are spread over the CP ranks: each holds about 1 / cp.
        let micro_batches = match args.max_tokens_per_gpu {
            Some(m) => MicroBatchPolicy::Dynamic {
                max_tokens_per_gpu: m * world.dims().cp,
            },
            None => MicroBatchPolicy::Fixed {
                micro_batch_size: args.micro_batch_size,
            },
        };
        let recompute = args.recompute()?;
        ui.log(&format!(
            "policy: {} parameters, {} layers, hidden {}, vocab {} ({:?} on {:?}); {} prompts in {}; \
             {} samples per rollout, {} optimizer step(s) per rollout, recompute {}",
            cfg.num_parameters(),
            cfg.num_hidden_layers,
            cfg.hidden_size,
            cfg.vocab_size,
            dtype,
            device,
            dataset.len(),
            dataset.path().display(),
            args.rollout_samples(),
            args.steps_per_rollout(),
            recompute
        ));
        Ok(Run {
            args,
            tokenizer,
            tokenizer_dir,
            eos_ids,
            policy,
            opt,
            sched,
            reference,
            critic,
            dataset,
            eval_sets,
            reward,
            rt,
            engine,
            world,
            state,
            micro_batches,
            recompute,
            ui,
        })
    }

    /// Where metrics and plots go: rank 0 writes them, the other ranks nothing.
    fn log_dir(&self) -> Option<PathBuf> {
        if self.world.rank() != 0 {
            return None;
        }
        self.args.log_dir.clone().or_else(|| self.args.save.clone())
    }

    /// Ctrl-C, agreed by every rank at a step boundary: all stop at the same point, none is left
    /// waiting in a collective.
    /// Micro-batches' token counts must divide by this (the TP size under sequence parallelism).
    fn pad_tokens_to(&self) -> usize {
        if self.policy.sequence_parallel() {
            self.world.dims().tp
        } else {
            1
        }
    }

    fn interrupted(&self) -> Result<bool> {
        self.world.agree_any(interrupted())
    }

    fn main_loop(&mut self) -> Result<RunSummary> {
        let args = self.args;
        let num_rollout = args.num_rollout.unwrap_or(0);
        let resumed_at = (self.state.step > 0).then_some(self.state.step);
        let log_dir = self.log_dir();
        let metrics_path = log_dir.as_ref().map(|d| d.join("metrics.jsonl"));
        let plot_path = log_dir.as_ref().map(|d| d.join("curves.png"));
        if let (None, Some(path)) = (resumed_at, &metrics_path) {
            // A fresh start never overwrites an earlier run's metrics: they are moved aside.
            if std::fs::metadata(path).is_ok_and(|m| m.len() > 0) {
                let secs = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0);
                let aside = path.with_extension(format!("jsonl.prev-{secs}"));
                std::fs::rename(path, &aside)
                    .with_context(|| format!("moving the earlier {} aside", path.display()))?;
                self.ui.log(&format!(
                    "{} held an earlier run's metrics (no checkpoint to resume); moved to {}",
                    path.display(),
                    aside.display()
                ));
            }
        }
        let mut logger = MetricsLogger::open(
            metrics_path.as_deref(),
            log_dir.as_ref().map(|d| d.join("tensorboard")).as_deref(),
            resumed_at,
        )?;
        let mut summary = RunSummary {
            metrics_file: metrics_path.clone(),
            plot_file: plot_path.clone(),
            ..Default::default()
        };

        if self.state.step == 0 && args.eval_interval.is_some() && !args.skip_eval_before_train {
            let t = Instant::now();
            let mut m = self.evaluate()?;
            m.insert("perf/eval_time".into(), t.elapsed().as_secs_f64());
            self.ui.log(&format!("step 0 | {}", eval_brief(&m)));
            logger.log(0, &m)?;
            summary.first_eval = eval_only(&m);
            summary.last_eval = summary.first_eval.clone();
            self.plot(metrics_path.as_deref(), plot_path.as_deref());
        }

        let bar = self.ui.main_bar(num_rollout, self.state.step);
        let mut save_time = None;
        while self.state.step < num_rollout {
            if self.interrupted()? {
                summary.interrupted = true;
                break;
            }
            let rollout_id = self.state.step;
            let mut m = self.one_rollout(rollout_id)?;
            if let Some(t) = save_time.take() {
                m.insert("perf/save_time".into(), t);
            }
            self.state.step += 1;
            self.state.rollout_id = self.state.step;
            self.state.optimizer_step = self.opt.num_steps();
            let c = self.dataset.cursor();
            self.state.data = DataCursor {
                epoch: c.epoch,
                offset: c.offset,
                seed: c.seed,
            };
            if let Some((_, copt, _)) = &self.critic {
                self.state.extra = serde_json::json!({ "critic_optimizer_step": copt.num_steps() });
            }
            let step = self.state.step;
            let due = |interval: Option<u64>| interval.is_some_and(|i| step.is_multiple_of(i)) || step == num_rollout;
            let eval_now = args.eval_interval.is_some() && due(args.eval_interval);
            // Weight sync: the engine samples the next rollout (RL) or this evaluation.
            let sync_due = (args.loss_type == LossType::PolicyLoss
                && (step.is_multiple_of(args.sync.update_weights_interval) || step == num_rollout))
                || eval_now;
            let whole = if sync_due {
                whole_policy(&self.policy, &**self.world.tp(), self.engine.is_some())?
            } else {
                None
            };
            if let (Some(engine), true) = (&self.engine, sync_due) {
                fault::at("sync-start")?;
                let t = Instant::now();
                let out = engine.sync_weights(whole.as_ref().unwrap_or(&self.policy), &self.tokenizer_dir, step)?;
                fault::at("sync-end")?;
                let dt = t.elapsed().as_secs_f64();
                m.insert("perf/sync_time".into(), dt);
                m.insert("perf/sync_gb_per_s".into(), out.bytes as f64 / 1e9 / dt.max(1e-9));
                m.extend(out.metrics);
            }
            if eval_now {
                if self.interrupted()? {
                    summary.interrupted = true;
                } else {
                    let t = Instant::now();
                    let e = self.evaluate()?;
                    m.insert("perf/eval_time".into(), t.elapsed().as_secs_f64());
                    if summary.first_eval.is_empty() {
                        summary.first_eval = eval_only(&e);
                    }
                    summary.last_eval = eval_only(&e);
                    m.extend(e);
                }
            }
            logger.log(step, &m)?;
            self.ui.log(&format!("step {step} | {}", brief(&m)));
            bar.set_position(step);
            bar.set_message(short(&m));
            self.plot(metrics_path.as_deref(), plot_path.as_deref());
            summary.rollouts_run += 1;
            if args.save.is_some() && due(args.save_interval) {
                let t = Instant::now();
                summary.last_checkpoint = Some(self.save()?);
                save_time = Some(t.elapsed().as_secs_f64());
            }
            if summary.interrupted {
                break;
            }
        }
        bar.finish();
        if summary.interrupted {
            self.ui.log(&format!(
                "interrupted after step {}; resume with --load {}",
                self.state.step,
                args.save
                    .as_deref()
                    .map(|p| p.display().to_string())
                    .unwrap_or("<no --save>".into())
            ));
        }
        summary.final_step = self.state.step;
        self.plot(metrics_path.as_deref(), plot_path.as_deref());
        Ok(summary)
    }

    fn plot(&self, metrics: Option<&Path>, png: Option<&Path>) {
        let (Some(metrics), Some(png)) = (metrics, png) else {
            return;
        };
        let mut eval_keys: Vec<String> = Vec::new();
        for (name, _) in &self.eval_sets {
            eval_keys.push(format!("eval/{name}/pass@1"));
            for k in eval::reported_ks(self.args.n_samples_per_eval_prompt)
                .into_iter()
                .skip(1)
            {
                eval_keys.push(format!("eval/{name}/pass@{k}"));
            }
        }
        let eval_refs: Vec<&str> = eval_keys.iter().map(String::as_str).collect();
        let panels: Vec<(&str, &[&str])> = vec![
            ("reward", &["rollout/raw_reward", "rollout/pass_rate"]),
            ("eval", &eval_refs),
            ("response length", &["rollout/response_len"]),
            ("loss", &["train/pg_loss", "train/loss"]),
            (
                "entropy / KL",
                &["train/entropy_loss", "train/ppo_kl", "train/kl_loss", "rollout/kl"],
            ),
            ("grad norm", &["train/grad_norm", "critic/grad_norm"]),
            (
                "throughput (tokens/s)",
                &["perf/rollout_tokens_per_s", "perf/train_tokens_per_s"],
            ),
            (
                "seconds",
                &[
                    "perf/rollout_time",
                    "perf/train_time",
                    "perf/eval_time",
                    "perf/sync_time",
                ],
            ),
        ];
        if let Err(e) = plot_metrics_file(metrics, png, "vime-train", &panels) {
            self.ui
                .log(&format!("warning: could not write {}: {e:#}", png.display()));
        }
    }

    /// Every rank calls it (the optimizer state is gathered from the data-parallel shards);
    /// rank 0 writes the checkpoint, the others wait for it.
    fn save(&mut self) -> Result<PathBuf> {
        let root = self.args.save.clone().context("internal: save without --save")?;
        let optimizer = self.opt.state_tensors_tp(&**self.world.dp(), &**self.world.tp())?;
        let whole = whole_policy(&self.policy, &**self.world.tp(), self.world.rank() == 0)?;
        let critic_state = match &self.critic {
            Some((_, copt, _)) => Some(copt.state_tensors_tp(&**self.world.dp(), &**self.world.tp())?),
            None => None,
        };
        let whole_critic = match &self.critic {
            Some((c, _, _)) if self.world.tp().size() > 1 => c.gathered(&**self.world.tp(), self.world.rank() == 0)?,
            _ => None,
        };
        // Delayed FP8 scaling's amax histories, every rank's (each scales its own tensors).
        let mut extra = BTreeMap::new();
        if self.policy.kernel_config().fp8_delayed().is_some() {
            let world = &**self.world.world();
            extra.extend(ckpt::fp8_amax::gather(world, "policy", &self.policy)?);
            if let Some((c, _, _)) = &self.critic {
                extra.extend(ckpt::fp8_amax::gather(world, "critic", c.backbone())?);
            }
        }
        if self.world.rank() != 0 {
            self.world
                .world()
                .barrier()
                .context("waiting for rank 0 to write the checkpoint")?;
            return Ok(root.join(ckpt::iter_dir_name(self.state.step)));
        }
        let contents = CheckpointContents {
            state: &self.state,
            model: whole.as_ref().unwrap_or(&self.policy),
            model_dtype: self.policy.dtype(),
            optimizer: &optimizer,
            extra_tensors: &extra,
            tokenizer_dir: Some(&self.tokenizer_dir),
            critic: match (&self.critic, &critic_state) {
                (Some((c, _, _)), Some(s)) => Some((whole_critic.as_ref().unwrap_or(c), s)),
                _ => None,
            },
        };
        let dir = ckpt::save(&root, &contents);
        // The other ranks wait here for the files; a failed save is still rank 0's error.
        self.world.world().barrier().context("checkpoint barrier")?;
        let dir = dir?;
        self.ui.log(&format!("saved {}", dir.display()));
        Ok(dir)
    }

    fn sampling(&self, temperature: f64, top_p: f64, top_k: i64, max_tokens: usize, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_p,
            top_k,
            max_tokens,
            stop_token_ids: self.args.rollout_stop_token_ids.clone(),
            seed: Some(seed),
        }
    }

    /// Scores decoded responses; one reward per output.
    fn rewards(&self, prompts: &[&PromptSample], responses: &[String]) -> Result<Vec<f64>> {
        let rm = self.reward.as_ref().context("no --rm-type to score samples with")?;
        let samples: Vec<RewardSample> = prompts
            .iter()
            .zip(responses)
            .map(|(p, r)| RewardSample {
                prompt: serde_json::Value::String(p.prompt.clone()),
                response: r.clone(),
                label: p.label_text(),
                rm_type: p.metadata.get("rm_type").and_then(|v| v.as_str()).map(str::to_string),
            })
            .collect();
        let rewards = self.rt.block_on(rm.score_batch(&samples))?;
        rewards
            .iter()
            .enumerate()
            .map(|(i, r)| {
                r.value(self.args.reward_key.as_deref())
                    .with_context(|| format!("reward of sample {i}"))
            })
            .collect()
    }

    fn decode(&self, out: &GenOutput) -> Result<String> {
        self.tokenizer.decode(&out.token_ids, true)
    }

    fn generate_samples(&mut self, prompts: &[PromptSample], rollout_id: u64) -> Result<Vec<Sample>> {
        let args = self.args;
        let n = args.n_samples_per_prompt;
        let mut requests = Vec::with_capacity(prompts.len() * n);
        let mut owners: Vec<&PromptSample> = Vec::with_capacity(prompts.len() * n);
        for p in prompts {
            ensure!(
                !p.prompt_ids.is_empty(),
                "{}:{}: the prompt is empty (a response needs at least one prompt token before it)",
                self.dataset.path().display(),
                p.line
            );
            for _ in 0..n {
                let i = requests.len() as u64;
                requests.push(GenRequest {
                    prompt_ids: p.prompt_ids.clone(),
                    params: self.sampling(
                        args.rollout_temperature,
                        args.rollout_top_p,
                        args.rollout_top_k,
                        args.rollout_max_response_len,
                        seed_of(&[args.seed, ROLLOUT_STREAM, rollout_id, i]),
                    ),
                });
                owners.push(p);
            }
        }
        let engine = self.engine.as_ref().context("internal: only rank 0 generates")?;
        let outputs = engine.generate(&requests).context("generating the rollout")?;
        engine.release_for_training()?;
        ensure!(
            outputs.len() == requests.len(),
            "the engine returned {} completions for {} requests",
            outputs.len(),
            requests.len()
        );
        let responses: Vec<String> = outputs.iter().map(|o| self.decode(o)).collect::<Result<_>>()?;
        fault::at("reward")?;
        let mut rewards = self.rewards(&owners, &responses)?;
        if fault::nan_due("reward") {
            rewards[0] = f64::NAN;
        }
        // A reward that is not finite poisons the advantages it is normalised with: the steps that
        // hold them are skipped by the step's NaN guard, or the run stops here.
        if let Some(i) = rewards.iter().position(|r| !r.is_finite()) {
            let bad = rewards.iter().filter(|r| !r.is_finite()).count();
            let what = format!(
                "step {}: {bad} reward(s) not finite, the first of sample {i} ({}, prompt line {}): {}",
                rollout_id + 1,
                self.dataset.path().display(),
                owners[i].line,
                rewards[i]
            );
            ensure!(
                !args.check_for_nan_in_loss_and_grad,
                "{what} (--check-for-nan-in-loss-and-grad)"
            );
            self.ui.log(&format!(
                "warning: {what}; the optimizer steps that train on it are skipped"
            ));
        }
        let mut samples = Vec::with_capacity(outputs.len());
        for (((p, out), response), reward) in owners.iter().zip(outputs).zip(responses).zip(rewards) {
            ensure!(
                !out.token_ids.is_empty(),
                "the engine returned an empty completion for prompt {} (line {})",
                p.index,
                p.line
            );
            let mut tokens = p.prompt_ids.clone();
            tokens.extend_from_slice(&out.token_ids);
            samples.push(Sample {
                prompt_index: p.index,
                response_length: out.token_ids.len(),
                tokens,
                rollout_log_probs: Some(out.logprobs),
                response,
                label: p.label_text(),
                raw_reward: reward,
                finish: out.finish_reason,
            });
        }
        Ok(samples)
    }

    fn sft_samples(&self, prompts: &[PromptSample]) -> Result<Vec<Sample>> {
        let eos = *self
            .eos_ids
            .first()
            .context("SFT needs an EOS token: the tokenizer and config name none")?;
        prompts
            .iter()
            .map(|p| {
                let label = p.label_text().with_context(|| {
                    format!(
                        "{}:{}: the row has no label to train on",
                        self.dataset.path().display(),
                        p.line
                    )
                })?;
                let mut resp = self.tokenizer.encode(&label)?;
                resp.push(eos);
                let mut tokens = p.prompt_ids.clone();
                tokens.extend_from_slice(&resp);
                ensure!(
                    !p.prompt_ids.is_empty(),
                    "{}:{}: empty prompt",
                    self.dataset.path().display(),
                    p.line
                );
                Ok(Sample {
                    prompt_index: p.index,
                    response_length: resp.len(),
                    tokens,
                    rollout_log_probs: None,
                    response: label.clone(),
                    label: Some(label),
                    raw_reward: 0.0,
                    finish: FinishReason::Stop,
                })
            })
            .collect()
    }

    fn one_rollout(&mut self, rollout_id: u64) -> Result<BTreeMap<String, f64>> {
        let args = self.args;
        let mut m = BTreeMap::new();
        let prompts: Vec<PromptSample> = self
            .dataset
            .next_batch(args.rollout_batch_size)
            .into_iter()
            .cloned()
            .collect();
        let is_rl = args.loss_type == LossType::PolicyLoss;
        fault::at("rollout")?;

        // Rollout.
        let t = Instant::now();
        let phase = self.ui.spinner(if is_rl { "rollout" } else { "batch" });
        // Rank 0 generates (or builds the SFT samples) and sends them to every rank.
        let preempted_before = self.engine.as_ref().and_then(Engine::preemptions);
        let mine = (self.world.rank() == 0).then(|| {
            if is_rl {
                self.generate_samples(&prompts, rollout_id)
            } else {
                self.sft_samples(&prompts)
            }
        });
        let samples = parallel::broadcast_samples(&**self.world.world(), mine)?;
        phase.finish_and_clear();
        let rollout_time = t.elapsed().as_secs_f64();
        let gen_tokens: usize = samples.iter().map(|s| s.response_length).sum();
        if is_rl {
            m.insert("perf/rollout_time".into(), rollout_time);
            m.insert(
                "perf/rollout_tokens_per_s".into(),
                gen_tokens as f64 / rollout_time.max(1e-9),
            );
            rollout_metrics(&samples, args, &mut m);
            if let (Some(before), Some(after), Some(_)) = (
                preempted_before,
                self.engine.as_ref().and_then(Engine::preemptions),
                args.rollout_kv_cache_tokens,
            ) {
                m.insert("rollout/kv_preemptions".into(), (after - before) as f64);
            }
            if let Some(s) = samples.first() {
                let prompt = self
                    .tokenizer
                    .decode(&s.tokens[..s.tokens.len() - s.response_length], false)?;
                self.ui.log(&format!(
                    "  sample: {:?} -> {:?} (label {:?}, reward {})",
                    prompt,
                    s.response,
                    s.label.as_deref().unwrap_or(""),
                    s.raw_reward
                ));
            }
        }

        // Scoring passes.
        let flat = |v: &[Vec<f32>]| v.iter().flatten().map(|&x| x as f64).collect::<Vec<f64>>();
        let t = Instant::now();
        let n = samples.len();
        let spinner = self.ui.spinner("log-probs");
        let (old_logp, ref_logp, values) = if is_rl {
            // Each data-parallel rank scores its share; every rank gets all of them back.
            let (dp, mbs, balance) = (&**self.world.dp(), self.micro_batches, args.parallel.balance_data);
            let lengths: Vec<usize> = samples.iter().map(|s| s.tokens.len()).collect();
            let split = |f: &dyn Fn(&PackedBatch) -> Result<candle_core::Tensor>| {
                parallel::score_split(dp, &lengths, balance, |idx| {
                    step::score_responses(&samples, idx, mbs, self.pad_tokens_to(), f)
                })
            };
            let (tp, cp) = (&**self.world.tp(), &**self.world.cp());
            // Under CP each rank scores its zigzag share of a micro-batch, and the shares are
            // gathered back into the batch's order on every rank.
            let pad = self.pad_tokens_to();
            let on_cp =
                |b: &PackedBatch, f: &dyn Fn(&CpShard) -> Result<candle_core::Tensor>| -> Result<candle_core::Tensor> {
                    let shard = CpShard::new(b, cp.size(), cp.rank(), pad)?;
                    shard.gather_to_global(b, &f(&shard)?, cp)
                };
            // Under FP8 each model's weights are quantized once for all of its scoring
            // micro-batches (none of them changes while it scores).
            let old = self.policy.with_fp8_weight_cache(|| {
                if cp.size() > 1 {
                    split(&|b| on_cp(b, &|s| Ok(self.policy.logprobs_entropy_cp(s, tp, cp)?.logprobs)))
                } else {
                    split(&|b| Ok(self.policy.logprobs_entropy_tp(b, tp)?.logprobs))
                }
            })?;
            let reference = match &self.reference {
                Some(r) if cp.size() > 1 => Some(
                    r.model()
                        .with_fp8_weight_cache(|| split(&|b| on_cp(b, &|s| r.logprobs_cp(s, tp, cp))))?,
                ),
                Some(r) => Some(r.model().with_fp8_weight_cache(|| split(&|b| r.logprobs_tp(b, tp)))?),
                None => None,
            };
            let values = match &self.critic {
                Some((c, _, _)) if cp.size() > 1 => Some(
                    c.backbone()
                        .with_fp8_weight_cache(|| split(&|b| on_cp(b, &|s| c.values_cp(s, tp, cp))))?,
                ),
                Some((c, _, _)) => Some(c.backbone().with_fp8_weight_cache(|| split(&|b| c.values_tp(b, tp)))?),
                None => None,
            };
            (old, reference, values)
        } else {
            (Vec::new(), None, None)
        };
        spinner.finish_and_clear();
        if is_rl {
            fault::at("logprobs")?;
            m.insert("perf/log_probs_time".into(), t.elapsed().as_secs_f64());
            let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
            let old_flat = flat(&old_logp);
            m.insert("rollout/log_probs".into(), mean(&old_flat));
            let roll: Vec<f64> = samples
                .iter()
                .flat_map(|s| s.rollout_log_probs.iter().flatten().map(|&x| x as f64))
                .collect();
            if roll.len() == old_flat.len() {
                let d: Vec<f64> = roll.iter().zip(&old_flat).map(|(a, b)| (a - b).abs()).collect();
                m.insert("rollout/log_probs_abs_diff".into(), mean(&d));
                m.insert(
                    "rollout/log_probs_max_abs_diff".into(),
                    d.iter().cloned().fold(0.0, f64::max),
                );
            }
            if let Some(r) = &ref_logp {
                let rf = flat(r);
                m.insert("rollout/ref_log_probs".into(), mean(&rf));
                let kl: Vec<f64> = old_flat.iter().zip(&rf).map(|(a, b)| a - b).collect();
                m.insert("rollout/kl".into(), mean(&kl));
            }
            if let Some(v) = &values {
                m.insert("rollout/values".into(), mean(&flat(v)));
            }
        }

        // Advantages.
        let (advantages, returns) = if is_rl {
            let raw: Vec<f64> = samples.iter().map(|s| s.raw_reward).collect();
            let rewards = post_process_rewards(&args.rl, &raw, args.n_samples_per_prompt, args.rollout_batch_size)?;
            let mut cu = vec![0usize];
            for s in &samples {
                cu.push(cu.last().unwrap() + s.response_length);
            }
            let total = *cu.last().unwrap();
            let old_flat = flat(&old_logp);
            let ref_flat = ref_logp.as_deref().map(flat);
            let val_flat = values.as_deref().map(flat);
            let mask = vec![1.0; total];
            let out = compute_advantages_and_returns(
                &args.rl,
                &AdvantageInputs {
                    cu_seqlens: &cu,
                    rewards: &rewards,
                    loss_mask: &mask,
                    log_probs: Some(&old_flat),
                    ref_log_probs: ref_flat.as_deref(),
                    values: val_flat.as_deref(),
                },
                &NoAllReduce,
            )?;
            let split = |v: &[f64]| -> Vec<Vec<f32>> {
                cu.windows(2)
                    .map(|w| v[w[0]..w[1]].iter().map(|&x| x as f32).collect())
                    .collect()
            };
            m.insert(
                "rollout/advantages".into(),
                out.advantages.iter().sum::<f64>() / total.max(1) as f64,
            );
            m.insert("rollout/rewards".into(), rewards.iter().sum::<f64>() / n.max(1) as f64);
            (split(&out.advantages), split(&out.returns))
        } else {
            (Vec::new(), Vec::new())
        };

        // Optimizer steps.
        let t = Instant::now();
        let g = args.global_batch_size_resolved();
        let steps = n / g;
        let bar = self.ui.steps_bar(steps as u64, if is_rl { "train" } else { "sft" });
        let mut reports: Vec<StepReport> = Vec::new();
        let mut critic_reports: Vec<StepReport> = Vec::new();
        let (mut skipped, mut critic_skipped) = (0usize, 0usize);
        // A step the NaN guard did not apply (see `step`): counted, or the run stops naming it.
        let guard =
            |r: StepReport, s: usize, kind: &str, count: &mut usize, keep: &mut Vec<StepReport>| -> Result<()> {
                match &r.skipped {
                    None => keep.push(r),
                    Some(what) => {
                        let at = format!(
                            "step {} (rollout {rollout_id}), {kind} optimizer step {} of {steps}: {what}",
                            rollout_id + 1,
                            s + 1
                        );
                        ensure!(
                            !args.check_for_nan_in_loss_and_grad,
                            "{at}; stopping (--check-for-nan-in-loss-and-grad)"
                        );
                        self.ui.log(&format!("warning: {at}; the step is skipped (no update)"));
                        *count += 1;
                    }
                }
                Ok(())
            };
        let train_actor = !is_rl || args.rl.train_actor(rollout_id);
        let cfg = StepConfig {
            rl: &args.rl,
            micro_batches: self.micro_batches,
            recompute: self.recompute,
            clip_grad: args.optim.clip_grad,
            dp: &**self.world.dp(),
            tp: &**self.world.tp(),
            cp: &**self.world.cp(),
            balance_data: args.parallel.balance_data,
            pad_tokens_to: self.pad_tokens_to(),
        };
        for s in 0..steps {
            let idx: Vec<usize> = (s * g..(s + 1) * g).collect();
            if let (Some(v), true) = (&values, is_rl) {
                let (critic, copt, csched) = self.critic.as_mut().context("internal: values without a critic")?;
                let r = step::critic_step(critic, copt, csched, &cfg, &samples, &idx, v, &returns)?;
                guard(r, s, "critic", &mut critic_skipped, &mut critic_reports)?;
            }
            if train_actor {
                let r = if is_rl {
                    step::policy_step(
                        &self.policy,
                        &mut self.opt,
                        &self.sched,
                        &cfg,
                        &samples,
                        &idx,
                        &PolicyData {
                            advantages: &advantages,
                            old_log_probs: &old_logp,
                            ref_log_probs: ref_logp.as_deref(),
                        },
                    )?
                } else {
                    step::sft_step(&self.policy, &mut self.opt, &self.sched, &cfg, &samples, &idx)?
                };
                guard(r, s, "policy", &mut skipped, &mut reports)?;
            }
            bar.inc(1);
            if self.world.agree_any(interrupted())? {
                break;
            }
        }
        bar.finish_and_clear();
        // The last optimizer step's kernels are still queued when the loop ends (a step waits
        // for its metrics, not for its update): wait for them, so that the train time holds
        // every step's whole work, as bench-step's step time does.
        self.policy.device().synchronize()?;
        let train_time = t.elapsed().as_secs_f64();
        m.insert("perf/train_time".into(), train_time);
        let trained: usize = reports.iter().chain(&critic_reports).map(|r| r.tokens).sum();
        m.insert("perf/train_tokens_per_s".into(), trained as f64 / train_time.max(1e-9));
        average_reports(&reports, "train", &mut m);
        average_reports(&critic_reports, "critic", &mut m);
        if train_actor && steps > 0 {
            m.insert("train/skipped_steps".into(), skipped as f64);
        }
        if self.critic.is_some() && is_rl && steps > 0 {
            m.insert("critic/skipped_steps".into(), critic_skipped as f64);
        }
        if !is_rl {
            m.insert("perf/sft_tokens".into(), trained as f64);
        }

        m.insert("perf/step_time".into(), rollout_time + train_time);
        // Device memory in use after the step (the whole GPU's, every process on it): the curve
        // that shows whether a long run's memory stays flat (scripts/gpu/memory_flat_gpu.sh).
        #[cfg(feature = "cuda")]
        if let Some(gb) = vime_sync::cuda::device_memory_used_gb(self.policy.device()) {
            m.insert("perf/gpu_memory_used_gb".into(), gb);
        }
        Ok(m)
    }

    /// Evaluates every eval set with the engine's current weights.
    fn evaluate(&mut self) -> Result<BTreeMap<String, f64>> {
        let args = self.args;
        let n = args.n_samples_per_eval_prompt;
        let temperature = args.eval_temperature.unwrap_or(args.rollout_temperature);
        let top_p = args.eval_top_p.unwrap_or(args.rollout_top_p);
        let top_k = args.eval_top_k.unwrap_or(args.rollout_top_k);
        let max_tokens = args.eval_max_response_len.unwrap_or(args.rollout_max_response_len);
        let mut m = BTreeMap::new();
        let Some(engine) = &self.engine else {
            // Rank 0 evaluates; the other ranks have no engine and log nothing.
            return Ok(m);
        };
        let spinner = self.ui.spinner("eval");
        for (si, (name, ds)) in self.eval_sets.iter().enumerate() {
            let mut requests = Vec::new();
            let mut owners = Vec::new();
            for p in ds.samples() {
                for k in 0..n {
                    requests.push(GenRequest {
                        prompt_ids: p.prompt_ids.clone(),
                        params: self.sampling(
                            temperature,
                            top_p,
                            top_k,
                            max_tokens,
                            seed_of(&[args.seed, EVAL_STREAM, si as u64, p.index as u64, k as u64]),
                        ),
                    });
                    owners.push(p);
                }
            }
            let t = Instant::now();
            let outputs = engine
                .generate(&requests)
                .with_context(|| format!("evaluating {name}"))?;
            let gen_time = t.elapsed().as_secs_f64();
            let responses: Vec<String> = outputs.iter().map(|o| self.decode(o)).collect::<Result<_>>()?;
            let rewards = self.rewards(&owners, &responses)?;
            let total = rewards.len().max(1) as f64;
            m.insert(format!("eval/{name}/reward"), rewards.iter().sum::<f64>() / total);
            let lens: usize = outputs.iter().map(|o| o.token_ids.len()).sum();
            m.insert(format!("eval/{name}/response_len"), lens as f64 / total);
            let truncated = outputs
                .iter()
                .filter(|o| o.finish_reason == FinishReason::Length)
                .count();
            m.insert(format!("eval/{name}/truncated"), truncated as f64 / total);
            m.insert(
                format!("perf/eval_{name}_tokens_per_s"),
                lens as f64 / gen_time.max(1e-9),
            );
            let passes: Vec<usize> = rewards
                .chunks(n)
                .map(|c| c.iter().filter(|&&r| r >= args.eval_pass_threshold).count())
                .collect();
            for k in eval::reported_ks(n) {
                let p = passes.iter().map(|&c| eval::pass_at_k(n, c, k)).sum::<f64>() / passes.len().max(1) as f64;
                m.insert(format!("eval/{name}/pass@{k}"), p);
            }
        }
        spinner.finish_and_clear();
        Ok(m)
    }
}

fn rollout_metrics(samples: &[Sample], args: &TrainArgs, m: &mut BTreeMap<String, f64>) {
    let n = samples.len().max(1) as f64;
    let rewards: Vec<f64> = samples.iter().map(|s| s.raw_reward).collect();
    let mean = rewards.iter().sum::<f64>() / n;
    let var = rewards.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / n;
    m.insert("rollout/raw_reward".into(), mean);
    m.insert("rollout/raw_reward_std".into(), var.sqrt());
    let nonfinite = rewards.iter().filter(|r| !r.is_finite()).count();
    m.insert("rollout/nonfinite_rewards".into(), nonfinite as f64);
    let passed = rewards.iter().filter(|&&r| r >= args.eval_pass_threshold).count();
    m.insert("rollout/pass_rate".into(), passed as f64 / n);
    let lens: Vec<usize> = samples.iter().map(|s| s.response_length).collect();
    m.insert("rollout/response_len".into(), lens.iter().sum::<usize>() as f64 / n);
    m.insert(
        "rollout/response_len_max".into(),
        *lens.iter().max().unwrap_or(&0) as f64,
    );
    let truncated = samples.iter().filter(|s| s.finish == FinishReason::Length).count();
    m.insert("rollout/truncated".into(), truncated as f64 / n);
    // Groups whose samples all got the same reward carry no GRPO signal.
    let g = args.n_samples_per_prompt.max(1);
    let groups: Vec<&[f64]> = rewards.chunks(g).collect();
    let flat = groups.iter().filter(|c| c.iter().all(|&r| r == c[0])).count();
    m.insert(
        "rollout/zero_std_groups".into(),
        flat as f64 / groups.len().max(1) as f64,
    );
}

fn average_reports(reports: &[StepReport], prefix: &str, m: &mut BTreeMap<String, f64>) {
    if reports.is_empty() {
        return;
    }
    let k = reports.len() as f64;
    let mut sums: BTreeMap<String, f64> = BTreeMap::new();
    for r in reports {
        for (name, v) in &r.metrics {
            *sums.entry(name.clone()).or_default() += v;
        }
        *sums.entry("grad_norm".into()).or_default() += r.grad_norm;
        *sums.entry("lr".into()).or_default() += r.lr;
        *sums.entry("micro_batches".into()).or_default() += r.micro_batches as f64;
    }
    for (name, v) in sums {
        m.insert(format!("{prefix}/{name}"), v / k);
    }
    m.insert(format!("{prefix}/steps"), k);
}

fn eval_only(m: &BTreeMap<String, f64>) -> BTreeMap<String, f64> {
    m.iter()
        .filter(|(k, _)| k.starts_with("eval/"))
        .map(|(k, v)| (k.clone(), *v))
        .collect()
}

fn eval_brief(m: &BTreeMap<String, f64>) -> String {
    m.iter()
        .filter(|(k, _)| k.starts_with("eval/") && k.contains("pass@"))
        .map(|(k, v)| format!("{} {:.3}", &k[5..], v))
        .collect::<Vec<_>>()
        .join(" ")
}

fn short(m: &BTreeMap<String, f64>) -> String {
    let get = |k: &str| m.get(k).copied();
    let mut parts = Vec::new();
    if let Some(r) = get("rollout/raw_reward") {
        parts.push(format!("reward {r:.3}"));
    }
    if let Some(l) = get("train/loss") {
        parts.push(format!("loss {l:.4}"));
    }
    parts.join(" ")
}

fn brief(m: &BTreeMap<String, f64>) -> String {
    let get = |k: &str| m.get(k).copied();
    let mut parts = Vec::new();
    if let Some(r) = get("rollout/raw_reward") {
        parts.push(format!("reward {r:.3}"));
    }
    if let Some(l) = get("rollout/response_len") {
        parts.push(format!("len {l:.1}"));
    }
    if let Some(l) = get("train/loss") {
        parts.push(format!("loss {l:.4}"));
    }
    if let Some(g) = get("train/grad_norm") {
        parts.push(format!("gnorm {g:.3}"));
    }
    if let Some(k) = get("train/ppo_kl") {
        parts.push(format!("ppo_kl {k:.2e}"));
    }
    if let Some(e) = get("train/entropy_loss") {
        parts.push(format!("entropy {e:.3}"));
    }
    if let Some(v) = get("critic/value_loss") {
        parts.push(format!("value_loss {v:.4}"));
    }
    let e = eval_brief(m);
    if !e.is_empty() {
        parts.push(e);
    }
    let t = get("perf/rollout_time").unwrap_or(0.0) + get("perf/train_time").unwrap_or(0.0);
    parts.push(format!("{t:.1}s"));
    parts.join(" | ")
}

/// Under tensor parallelism, the whole policy gathered from the TP shards (every TP rank must call
/// it: the gather is collective), kept where `keep` (the rank that needs it: the engine's, the
/// checkpoint writer); `None` without TP (the policy itself is whole).
/// Under `--fp8-recipe delayed`, this rank's amax history of `name` from the resumed checkpoint
/// `l`, so the run scales its FP8 tensors as the uninterrupted one would; a warning when the
/// checkpoint has none for this rank (saved with another recipe or by fewer ranks).
fn restore_fp8_amax(l: &ckpt::Loaded, name: &str, rank: usize, m: &Qwen3, ui: &Ui) -> Result<()> {
    if m.kernel_config().fp8_delayed().is_none() {
        return Ok(());
    }
    if !ckpt::fp8_amax::restore(&l.extra_tensors, name, rank, m)
        .with_context(|| format!("resuming from {}", l.dir.display()))?
    {
        ui.log(&format!(
            "warning: {} has no FP8 amax history of the {name} for rank {rank} (saved without --fp8-recipe \
             delayed, or by fewer ranks): the histories start over, so the first micro-batch scales by its own \
             amaxes and the FP8 bits differ from an uninterrupted run's",
            l.dir.display()
        ));
    }
    Ok(())
}

fn whole_policy(policy: &Qwen3, tp: &dyn vime_dist::Collectives, keep: bool) -> Result<Option<Qwen3>> {
    if tp.size() == 1 {
        return Ok(None);
    }
    let full = policy.gathered_state_dict(tp)?;
    if !keep {
        return Ok(None);
    }
    let mut m = Qwen3::from_tensors(policy.config().clone(), full)?;
    m.set_kernel_config(policy.kernel_config().clone());
    Ok(Some(m))
}
