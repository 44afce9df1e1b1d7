//! `vime-train`'s training flags: slime's names and defaults where slime has the flag, vime's own
//! (documented as such) where it does not.
use crate::optim::OptimizerArgs;
use crate::rl::RlArgs;
use anyhow::{bail, ensure, Context, Result};
use std::path::PathBuf;
use vime_rollout::data::DataArgs;
use vime_rollout::vllm::VllmArgs;

/// `--loss-type`: slime's `policy_loss` (RL) or `sft_loss` (supervised on `--label-key`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "snake_case")]
pub enum LossType {
    PolicyLoss,
    #[value(alias = "sft")]
    SftLoss,
}

/// Every flag of a training run.
#[derive(Debug, Clone, clap::Args)]
pub struct TrainArgs {
    // ---- model and checkpoints -----------------------------------------------------------
    /// HF checkpoint to start from (config.json, safetensors, tokenizer files). Not needed when
    /// `--load` holds a checkpoint.
    #[arg(long)]
    pub hf_checkpoint: Option<PathBuf>,
    /// The reference model for the KL terms (an HF folder); default: `--hf-checkpoint`.
    #[arg(long)]
    pub ref_load: Option<PathBuf>,
    /// The critic's initial weights for PPO (an HF folder, with or without a value head);
    /// default: `--hf-checkpoint` with a fresh value head.
    #[arg(long)]
    pub critic_load: Option<PathBuf>,
    /// Resume from the latest checkpoint in this folder (if it holds one).
    #[arg(long)]
    pub load: Option<PathBuf>,
    /// Write checkpoints here (`iter_0000010/`, `latest_checkpointed_iteration.txt`).
    #[arg(long)]
    pub save: Option<PathBuf>,
    /// Save every N rollouts (and after the last one).
    #[arg(long)]
    pub save_interval: Option<u64>,
    /// vime: a Qwen3 dense release by name (qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, or the HF
    /// id, e.g. Qwen/Qwen3-4B). Without --hf-checkpoint it is found in the local Hugging Face cache
    /// ($HF_HUB_CACHE, $HF_HOME/hub or ~/.cache/huggingface/hub; never downloaded); with one, the
    /// checkpoint must have its shape.
    #[arg(long)]
    pub model: Option<String>,
    /// vime: `hf` (the checkpoint's weights) or `random` (the --model preset's shape with random
    /// weights, N(0, 0.02); the tokenizer still comes from --hf-checkpoint or the cache), for
    /// benchmarks and tests.
    #[arg(long, default_value = "hf")]
    pub init: String,
    /// vime: compute dtype of the policy, critic and reference: auto (bf16 on CUDA, f32 on the
    /// CPU), f32, bf16, f16.
    #[arg(long, default_value = "auto")]
    pub dtype: String,
    /// vime: auto (CUDA when this build has it and a GPU is present, else the CPU), cpu, cuda or
    /// cuda:N.
    #[arg(long, default_value = "auto")]
    pub device: String,
    /// Megatron's flag: the CUDA attention kernel, auto (cuDNN fused attention in a build with
    /// the cudnn feature, else vime's flash kernel), fused (cuDNN) or flash.
    #[arg(long, default_value = "auto")]
    pub attention_backend: String,
    /// Megatron's flag: run-to-run bitwise-reproducible kernels where a backend offers the choice
    /// (cuDNN's attention backward).
    #[arg(long)]
    pub deterministic_mode: bool,
    /// slime's flag: the trainer's forward passes and the built-in engine run batch-invariant
    /// GEMMs and attention (CUDA bf16; `vime_kernels::invariant`), and the engine scores each
    /// sampled token with the trainer's LM-head kernel, so rollout and trainer log-probs are equal
    /// bit for bit (at TP 1 and CP 1). Costs training-forward and decoding speed.
    #[arg(long)]
    pub true_on_policy_mode: bool,
    #[command(flatten)]
    pub fp8: crate::device::Fp8Args,
    #[command(flatten)]
    pub head: crate::device::HeadArgs,
    /// Megatron's seed: rollout sampling, eval sampling and the critic head's init derive from it.
    #[arg(long, default_value_t = 1234)]
    pub seed: u64,

    // ---- data and rollout ----------------------------------------------------------------
    #[command(flatten)]
    pub data: DataArgs,
    /// Number of rollouts (training iterations) to run in total, counting resumed ones.
    #[arg(long)]
    pub num_rollout: Option<u64>,
    /// Prompts per rollout.
    #[arg(long, default_value_t = 8)]
    pub rollout_batch_size: usize,
    /// Samples generated per prompt (the GRPO group size).
    #[arg(long, default_value_t = 1)]
    pub n_samples_per_prompt: usize,
    /// Samples per optimizer step; default: the whole rollout (one step per rollout).
    #[arg(long)]
    pub global_batch_size: Option<usize>,
    /// Optimizer steps per rollout; sets `--global-batch-size` to rollout samples / N.
    #[arg(long)]
    pub num_steps_per_rollout: Option<usize>,
    #[arg(long, default_value_t = 1024)]
    pub rollout_max_response_len: usize,
    #[arg(long, default_value_t = 1.0)]
    pub rollout_temperature: f64,
    #[arg(long, default_value_t = 1.0)]
    pub rollout_top_p: f64,
    /// -1 (slime's default): no top-k.
    #[arg(long, default_value_t = -1, allow_negative_numbers = true)]
    pub rollout_top_k: i64,
    /// Extra stop token ids (the tokenizer's EOS always stops).
    #[arg(long, num_args = 1.., action = clap::ArgAction::Set)]
    pub rollout_stop_token_ids: Vec<u32>,
    /// vime: `embedded` (the built-in engine, in this process) or `vllm` (HTTP engines: vLLM or
    /// vime-serve, see `--vllm-url`).
    #[arg(long, default_value = "embedded")]
    pub rollout_engine: String,
    /// vime: the built-in engine's KV cache, in tokens (`vime-serve --kv-cache-tokens`). When
    /// the rollout's sequences need more, running sequences are preempted and recomputed later
    /// (the same outputs, more time; `rollout/kv_preemptions` counts them) instead of running
    /// the GPU out of memory. Default: no limit (the cache grows to what the rollout needs).
    #[arg(long)]
    pub rollout_kv_cache_tokens: Option<usize>,
    /// slime's flag: `vllm` is `--rollout-engine vllm` (engines at --vllm-url, or launched on the
    /// rollout GPUs of the placement); `sglang` is refused (vime does not drive SGLang).
    #[arg(long)]
    pub rollout_backend: Option<String>,
    /// slime's flag: top-k of evaluation sampling; default --rollout-top-k.
    #[arg(long, allow_negative_numbers = true)]
    pub eval_top_k: Option<i64>,
    #[command(flatten)]
    pub placement: PlacementArgs,
    #[command(flatten)]
    pub vllm: VllmArgs,
    #[command(flatten)]
    pub sync: SyncArgs,

    // ---- reward --------------------------------------------------------------------------
    /// deepscaler, math, dapo, f1, exact_match, remote_rm, or boxed_<type>.
    #[arg(long, default_value = "")]
    pub rm_type: String,
    #[arg(long)]
    pub rm_url: Option<String>,
    /// Field of a dict-valued reward to train on (e.g. dapo's `score`).
    #[arg(long)]
    pub reward_key: Option<String>,

    // ---- training ------------------------------------------------------------------------
    #[arg(long, value_enum, default_value_t = LossType::PolicyLoss)]
    pub loss_type: LossType,
    #[command(flatten)]
    pub rl: RlArgs,
    #[command(flatten)]
    pub optim: OptimizerArgs,
    /// The critic's learning rate (PPO); default `--lr`.
    #[arg(long)]
    pub critic_lr: Option<f64>,
    /// Pack micro-batches by `--max-tokens-per-gpu` instead of `--micro-batch-size` samples.
    #[arg(long)]
    pub use_dynamic_batch_size: bool,
    #[arg(long)]
    pub max_tokens_per_gpu: Option<usize>,
    #[arg(long, default_value_t = 1)]
    pub micro_batch_size: usize,
    /// Megatron's flag: only `adam` (AdamW: Adam with decoupled weight decay, as Megatron's `adam`).
    #[arg(long, default_value = "adam")]
    pub optimizer: String,
    /// Megatron's activation recompute: `full` keeps only layer inputs and re-runs the forward
    /// in the backward (which layers: `--recompute-method`, `--recompute-num-layers`).
    #[arg(long)]
    pub recompute_granularity: Option<String>,
    /// `uniform` (default): the layers in groups of `--recompute-num-layers`, each group keeping
    /// only its input; `block`: only the first `--recompute-num-layers` layers recompute, the
    /// rest keep everything (faster, more memory).
    #[arg(long)]
    pub recompute_method: Option<String>,
    /// See `--recompute-method` (default 1).
    #[arg(long)]
    pub recompute_num_layers: Option<usize>,
    /// vime: recomputed layers keep their attention output (and its log-sum-exp), so the
    /// recompute skips the attention kernel: at long sequences a third of the attention work, for
    /// `tokens x heads x head_dim` bf16 per layer.
    #[arg(long)]
    pub recompute_keep_attention: bool,
    /// Megatron's flag: stop the run, naming the step, at a NaN/Inf in a loss, a gradient or a
    /// reward. Without it vime still checks every step and skips one that is not finite (no
    /// update; counted in `train/skipped_steps`); Megatron's default is to stop.
    #[arg(long)]
    pub check_for_nan_in_loss_and_grad: bool,

    // ---- parallelism ---------------------------------------------------------------------
    #[command(flatten)]
    pub parallel: ParallelArgs,

    // ---- eval ----------------------------------------------------------------------------
    /// Evaluate every N rollouts (and before the first one).
    #[arg(long)]
    pub eval_interval: Option<u64>,
    /// Eval sets, as slime: `NAME PATH` pairs (a lone PATH is named after its file stem).
    #[arg(long, num_args = 1.., action = clap::ArgAction::Set)]
    pub eval_prompt_data: Vec<String>,
    #[arg(long, default_value_t = 1)]
    pub n_samples_per_eval_prompt: usize,
    /// Default: `--rollout-max-response-len`.
    #[arg(long)]
    pub eval_max_response_len: Option<usize>,
    /// Default: `--rollout-temperature`.
    #[arg(long)]
    pub eval_temperature: Option<f64>,
    #[arg(long)]
    pub eval_top_p: Option<f64>,
    /// vime: a sample passes (for pass@k) when its reward is at least this.
    #[arg(long, default_value_t = 1.0)]
    pub eval_pass_threshold: f64,
    /// slime: skip the evaluation before the first rollout.
    #[arg(long)]
    pub skip_eval_before_train: bool,

    // ---- what a user watches (vime) ------------------------------------------------------
    /// Folder for `metrics.jsonl`, `tensorboard/` and `curves.png`; default: `--save`.
    #[arg(long)]
    pub log_dir: Option<PathBuf>,
    /// No progress bars (they are also hidden when stderr is not a terminal).
    #[arg(long)]
    pub no_progress: bool,
    /// The slime / Megatron flags `compat::split` took out of the command line.
    #[arg(skip)]
    pub compat: super::compat::CompatSeen,
}

/// slime's placement flags: which GPUs train and which serve (see `super::placement`).
#[derive(Debug, Clone, clap::Args)]
pub struct PlacementArgs {
    /// slime's flag: nodes that train. vime runs on one node; more is refused.
    #[arg(long, default_value_t = 1)]
    pub actor_num_nodes: usize,
    /// slime's flag: GPUs per node that train (the ranks `--nproc-per-node` starts; default: the
    /// world vime was started with).
    #[arg(long)]
    pub actor_num_gpus_per_node: Option<usize>,
    /// slime's flag: GPUs that serve rollouts (engines of --rollout-num-gpus-per-engine each).
    /// With --colocate they are the training GPUs; otherwise the GPUs after them.
    #[arg(long)]
    pub rollout_num_gpus: Option<usize>,
}

/// How new weights reach the rollout engines after each step (slime's flag names where slime has
/// them; see `crate::train::engine` and `vime_sync`).
#[derive(Debug, Clone, clap::Args)]
pub struct SyncArgs {
    /// slime: bytes per weight-sync bucket (default 512 MiB).
    #[arg(long, default_value_t = vime_sync::DEFAULT_BUFFER_BYTES)]
    pub update_weight_buffer_size: usize,
    /// auto (ipc with --colocate on a GPU, nccl for a policy on a GPU, disk on the CPU), ipc, nccl, cpu
    /// (CPU broadcast, for engines on the CPU) or disk (an HF folder the engines reload).
    #[arg(long, default_value = "auto")]
    pub update_weight_transport: String,
    /// vime: auto (from each engine's GET /version: vime-serve native, vLLM the worker
    /// extension, except NCCL into vLLM >= 0.33 native), native (vime-serve, vLLM 0.33's
    /// weight-transfer routes) or worker-extension (vLLM started with --worker-extension-cls
    /// vime_vllm_ext.VimeWorkerExtension, the file in sync/python/ on its PYTHONPATH).
    #[arg(long, default_value = "auto")]
    pub update_weight_protocol: String,
    /// vime: seconds any weight-sync call or transfer may take before the sync fails naming the
    /// engine.
    #[arg(long, default_value_t = 300.0)]
    pub update_weight_timeout: f64,
    /// vime: the address the engines reach this trainer on for the sync rendezvous (cpu).
    #[arg(long, default_value = "127.0.0.1")]
    pub update_weight_master_address: String,
    /// slime: the engines share the trainer's GPU(s) and sleep while it trains.
    #[arg(long)]
    pub colocate: bool,
    /// slime: sync the weights every N rollouts (and always before an evaluation and at the end).
    #[arg(long, default_value_t = 1)]
    pub update_weights_interval: u64,
}

/// How the run is spread over processes (Megatron's flag names; see `crate::train::parallel`).
#[derive(Debug, Clone, clap::Args)]
pub struct ParallelArgs {
    /// vime (torchrun's flag): start N local ranks of this same command line, one process per
    /// GPU (`cuda:LOCAL_RANK`) or per CPU rank, and wait for them. Without it a process that finds
    /// torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
    /// MASTER_PORT) joins that world, so `torchrun --no-python --nproc-per-node N vime-train ...`
    /// and Slurm's `srun` work too.
    #[arg(long)]
    pub nproc_per_node: Option<usize>,
    /// Megatron's flag (`--tp`): tensor-parallel size (Megatron's column/row-parallel layers and
    /// a vocab-parallel embedding and LM head); the KL reference model and the PPO critic are
    /// sharded the same way.
    #[arg(long = "tensor-model-parallel-size", visible_alias = "tp", default_value_t = 1)]
    pub tensor_model_parallel_size: usize,
    /// Megatron's flag: sequence parallelism with TP (the residual stream and the norms hold each TP
    /// rank's slice of the tokens; micro-batches are padded to a multiple of the TP size). No
    /// effect at TP 1.
    #[arg(long)]
    pub sequence_parallel: bool,
    /// Megatron's flag: overlap the backward's tensor-parallel reductions (each column-parallel
    /// layer's input gradient) with the layer's weight-gradient GEMMs. The same numbers either
    /// way. The CPU backend overlaps them on a helper thread; NCCL does not overlap them yet: its
    /// collectives run on the compute stream.
    #[arg(long)]
    pub tp_comm_overlap: bool,
    /// Megatron's flag (`--cp`): context-parallel size. Each micro-batch's sequences are cut into
    /// `2 x cp` chunks, rank r holding chunks r and 2cp-1-r (zigzag); K/V are all-gathered over
    /// CP in attention; losses, metrics and gradients are summed over CP.
    #[arg(long = "context-parallel-size", visible_alias = "cp", default_value_t = 1)]
    pub context_parallel_size: usize,
    /// Megatron's flag (`--dp`): derived as world size / (tp x cp); when given, it must agree.
    #[arg(long = "data-parallel-size", visible_alias = "dp")]
    pub data_parallel_size: Option<usize>,
    /// Megatron's flag: ZeRO-1, the optimizer state (fp32 master weights and Adam moments) sharded
    /// over the data-parallel ranks, gradients reduce-scattered, parameters all-gathered. Always on
    /// in vime (at DP = 1 the one shard is everything, and it costs nothing); the flag is accepted
    /// so Megatron and slime scripts run unchanged.
    #[arg(long)]
    pub use_distributed_optimizer: bool,
    /// Megatron's flag: collectives backend, `auto` (NCCL on CUDA devices, else cpu), `nccl`, or
    /// `cpu` (TCP between processes on one machine; `gloo` is accepted as its name).
    #[arg(long, default_value = "auto")]
    pub distributed_backend: String,
    /// Megatron's flag: how long a collective or the rendezvous may wait for the other ranks.
    #[arg(long, default_value_t = 10.0)]
    pub distributed_timeout_minutes: f64,
    /// slime's flag: split each optimizer step's samples over the data-parallel ranks by
    /// Karmarkar-Karp on token counts (equal sample counts per rank) instead of round-robin.
    #[arg(long)]
    pub balance_data: bool,
}

impl ParallelArgs {
    /// The checks that need no other process; each error names the flag.
    pub fn validate(&self) -> Result<()> {
        if let Some(n) = self.nproc_per_node {
            ensure!(n >= 1, "--nproc-per-node must be at least 1");
        }
        ensure!(
            self.tensor_model_parallel_size >= 1 && self.context_parallel_size >= 1,
            "--tensor-model-parallel-size and --context-parallel-size must be at least 1"
        );
        if let Some(d) = self.data_parallel_size {
            ensure!(d >= 1, "--data-parallel-size must be at least 1");
        }
        match self.distributed_backend.as_str() {
            "auto" | "nccl" | "cpu" | "gloo" => {}
            other => bail!("--distributed-backend {other:?}: expected auto, nccl or cpu (gloo)"),
        }
        ensure!(
            self.distributed_timeout_minutes.is_finite() && self.distributed_timeout_minutes > 0.0,
            "--distributed-timeout-minutes must be positive, got {}",
            self.distributed_timeout_minutes
        );
        Ok(())
    }
}

/// One `--eval-prompt-data` set.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalSet {
    pub name: String,
    pub path: PathBuf,
}

/// `vime-train`'s training command line alone (the binary adds its subcommands).
#[derive(clap::Parser)]
#[command(name = "vime-train", args_override_self = true)]
pub struct TrainCli {
    #[command(flatten)]
    pub args: TrainArgs,
}

impl TrainArgs {
    /// Parses training flags as `vime-train` does (without the program name), e.g. for tests and
    /// embedding programs: `TrainArgs::from_flags(["--hf-checkpoint", dir, ...])`.
    pub fn from_flags<I, T>(flags: I) -> Result<Self>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        use clap::Parser;
        let argv = std::iter::once(std::ffi::OsString::from("vime-train")).chain(flags.into_iter().map(Into::into));
        let (rest, compat) = super::compat::split(argv.collect())?;
        let mut args = TrainCli::try_parse_from(rest).map_err(|e| anyhow::anyhow!("{e}"))?.args;
        args.compat = compat;
        Ok(args)
    }

    /// Samples per rollout.
    pub fn rollout_samples(&self) -> usize {
        let n = match self.loss_type {
            LossType::PolicyLoss => self.n_samples_per_prompt,
            LossType::SftLoss => 1,
        };
        self.rollout_batch_size * n
    }

    /// Samples per optimizer step, as slime resolves `--global-batch-size` /
    /// `--num-steps-per-rollout`.
    pub fn global_batch_size_resolved(&self) -> usize {
        match (self.global_batch_size, self.num_steps_per_rollout) {
            (Some(g), _) => g,
            (None, Some(n)) => self.rollout_samples() / n.max(1),
            (None, None) => self.rollout_samples(),
        }
    }

    pub fn steps_per_rollout(&self) -> usize {
        self.rollout_samples() / self.global_batch_size_resolved().max(1)
    }

    pub fn eval_sets(&self) -> Result<Vec<EvalSet>> {
        let mut out = Vec::new();
        let mut it = self.eval_prompt_data.iter().peekable();
        while let Some(a) = it.next() {
            let looks_like_path = |s: &str| s.contains('/') || s.ends_with(".jsonl") || s.contains('@');
            if looks_like_path(a) {
                let stem = PathBuf::from(a.split('@').next().unwrap_or(a));
                let name = stem.file_stem().and_then(|s| s.to_str()).unwrap_or("eval").to_string();
                out.push(EvalSet {
                    name,
                    path: PathBuf::from(a),
                });
            } else {
                let path = it
                    .next()
                    .with_context(|| format!("--eval-prompt-data: the set {a:?} has no path after it"))?;
                out.push(EvalSet {
                    name: a.clone(),
                    path: PathBuf::from(path),
                });
            }
        }
        Ok(out)
    }

    /// Every check that can run before anything is loaded; each error names the flag.
    /// The recompute policy of `--recompute-granularity`, `--recompute-method`,
    /// `--recompute-num-layers` and `--recompute-keep-attention`.
    pub fn recompute(&self) -> Result<vime_qwen3::model::Recompute> {
        use vime_qwen3::model::{Recompute, RecomputeLayers, RecomputeMethod};
        let layers_given = self.recompute_method.is_some() || self.recompute_num_layers.is_some();
        match self.recompute_granularity.as_deref() {
            None => {
                ensure!(
                    !layers_given && !self.recompute_keep_attention,
                    "--recompute-method, --recompute-num-layers and --recompute-keep-attention need \
                     --recompute-granularity full"
                );
                Ok(Recompute::None)
            }
            Some("full") => {
                let method = match self.recompute_method.as_deref() {
                    None | Some("uniform") => RecomputeMethod::Uniform,
                    Some("block") => RecomputeMethod::Block,
                    Some(other) => bail!("--recompute-method {other:?}: expected uniform or block"),
                };
                let num_layers = self.recompute_num_layers.unwrap_or(1);
                ensure!(num_layers > 0, "--recompute-num-layers must be at least 1");
                Ok(Recompute::from_layers(RecomputeLayers {
                    method,
                    num_layers,
                    keep_attention: self.recompute_keep_attention,
                }))
            }
            Some(other) => bail!("--recompute-granularity {other:?} is not supported (use full, or leave it out)"),
        }
    }

    pub fn validate(&self) -> Result<()> {
        self.rl.validate()?;
        self.parallel.validate()?;
        self.optim.validate()?;
        ensure!(self.rollout_batch_size > 0, "--rollout-batch-size must be positive");
        ensure!(self.n_samples_per_prompt > 0, "--n-samples-per-prompt must be positive");
        ensure!(
            self.rollout_max_response_len > 0,
            "--rollout-max-response-len must be positive"
        );
        ensure!(self.micro_batch_size > 0, "--micro-batch-size must be positive");
        ensure!(
            self.num_rollout.is_some(),
            "--num-rollout is required (the number of rollouts to run in total)"
        );
        ensure!(
            self.data.prompt_data.is_some(),
            "--prompt-data is required (a JSONL file of prompts)"
        );
        ensure!(
            self.hf_checkpoint.is_some() || self.load.is_some(),
            "--hf-checkpoint is required (or --load with a checkpoint to resume)"
        );
        let samples = self.rollout_samples();
        if let Some(n) = self.num_steps_per_rollout {
            ensure!(
                n > 0 && samples.is_multiple_of(n),
                "--num-steps-per-rollout {n} must divide the {samples} samples of a rollout \
                 (--rollout-batch-size x --n-samples-per-prompt)"
            );
        }
        let g = self.global_batch_size_resolved();
        if let (Some(gb), Some(n)) = (self.global_batch_size, self.num_steps_per_rollout) {
            ensure!(
                gb * n == samples,
                "--global-batch-size {gb} x --num-steps-per-rollout {n} != {samples} samples per rollout \
                 (--rollout-batch-size x --n-samples-per-prompt)"
            );
        }
        ensure!(
            g > 0 && samples.is_multiple_of(g),
            "--global-batch-size {g} must divide the {samples} samples of a rollout \
             (--rollout-batch-size {} x --n-samples-per-prompt {})",
            self.rollout_batch_size,
            if self.loss_type == LossType::SftLoss {
                1
            } else {
                self.n_samples_per_prompt
            }
        );
        if self.use_dynamic_batch_size {
            ensure!(
                self.max_tokens_per_gpu.is_some(),
                "--use-dynamic-batch-size needs --max-tokens-per-gpu"
            );
        }
        if let Some(m) = self.max_tokens_per_gpu {
            ensure!(m > 0, "--max-tokens-per-gpu must be positive");
        }
        self.recompute()?;
        ensure!(
            self.sync.update_weight_buffer_size > 0,
            "--update-weight-buffer-size must be positive"
        );
        ensure!(
            self.sync.update_weights_interval > 0,
            "--update-weights-interval must be at least 1"
        );
        ensure!(
            self.sync.update_weight_timeout > 0.0 && self.sync.update_weight_timeout.is_finite(),
            "--update-weight-timeout must be a positive number of seconds"
        );
        crate::train::engine::resolve_transport(&self.sync, false)?;
        if self.sync.update_weight_protocol != "auto" {
            self.sync.update_weight_protocol.parse::<vime_sync::Protocol>()?;
        }
        match self.rollout_engine.as_str() {
            "embedded" => {}
            "vllm" => ensure!(
                !self.vllm.vllm_urls.is_empty() || self.vllm.vllm_launch,
                "--rollout-engine vllm needs --vllm-url URL (or --vllm-launch)"
            ),
            other => bail!("--rollout-engine {other:?}: expected embedded or vllm"),
        }
        if let Some(t) = self.rollout_kv_cache_tokens {
            ensure!(
                self.rollout_engine == "embedded",
                "--rollout-kv-cache-tokens sizes the built-in engine's cache; vLLM engines size theirs with --vllm-gpu-memory-utilization"
            );
            let room = vime_qwen3::infer::longest_sequence_for(t);
            ensure!(
                room > self.rollout_max_response_len,
                "--rollout-kv-cache-tokens {t} holds sequences of at most {room} tokens, too few for a prompt and a response of --rollout-max-response-len {} (give at least {})",
                self.rollout_max_response_len,
                (self.rollout_max_response_len + 1).div_ceil(vime_qwen3::infer::PAGE) * vime_qwen3::infer::PAGE + 2 * vime_qwen3::infer::PAGE
            );
        }
        if !self.rm_type.trim().is_empty() {
            self.rm_type.parse::<vime_rollout::reward::RmType>()?;
        }
        if self.loss_type == LossType::PolicyLoss {
            ensure!(
                !self.rm_type.trim().is_empty() || self.rm_url.is_some(),
                "--rm-type is required for RL (e.g. deepscaler, math, exact_match)"
            );
            if matches!(
                self.rl.advantage_estimator,
                crate::rl::AdvantageEstimator::Grpo
                    | crate::rl::AdvantageEstimator::Gspo
                    | crate::rl::AdvantageEstimator::Cispo
            ) && !self.rl.disable_rewards_normalization
                && !self.rl.disable_grpo_std_normalization
            {
                ensure!(
                    self.n_samples_per_prompt >= 2,
                    "--advantage-estimator {:?} normalises rewards within each prompt's group: \
                     --n-samples-per-prompt must be at least 2",
                    self.rl.advantage_estimator
                );
            }
        } else {
            ensure!(
                self.data.label_key.is_some(),
                "--loss-type sft_loss trains on each row's label: set --label-key"
            );
        }
        if let Some(i) = self.eval_interval {
            ensure!(i > 0, "--eval-interval must be positive");
            ensure!(
                !self.eval_prompt_data.is_empty(),
                "--eval-interval needs --eval-prompt-data NAME PATH"
            );
            ensure!(
                !self.rm_type.trim().is_empty() || self.rm_url.is_some(),
                "evaluation scores with --rm-type: set it"
            );
        }
        ensure!(
            self.n_samples_per_eval_prompt > 0,
            "--n-samples-per-eval-prompt must be positive"
        );
        if let Some(s) = self.save_interval {
            ensure!(s > 0, "--save-interval must be positive");
            ensure!(self.save.is_some(), "--save-interval needs --save DIR");
        }
        self.eval_sets()?;
        Ok(())
    }
}
