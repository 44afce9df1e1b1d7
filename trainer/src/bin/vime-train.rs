//! `vime-train`: the trainer's command line.
//!
//! - `vime-train [FLAGS]`: a training run (RL with `--loss-type policy_loss`, the default, or SFT
//!   with `--loss-type sft_loss`); flag names follow slime's (see `vime_trainer::train::TrainArgs`).
//! - `vime-train logprobs ...`: score token sequences with an HF Qwen3 checkpoint.
//! - `vime-train check-engines --vllm-url URL ...`: check running rollout engines before a run.
//! - `vime-train make-task arith ...`: write the synthetic arithmetic task of the CPU demo.
use anyhow::{Context, Result};
use clap::{CommandFactory, Parser, Subcommand};
use std::path::PathBuf;
use vime_qwen3::model::Qwen3;
use vime_trainer::device::{parse_device, parse_dtype};
use vime_trainer::train::TrainArgs;

#[derive(Parser)]
#[command(
    name = "vime-train",
    version,
    about = "Native Rust RL post-training for Qwen3",
    args_conflicts_with_subcommands = true,
    args_override_self = true
)]
struct Cli {
    #[command(subcommand)]
    cmd: Option<Cmd>,
    #[command(flatten)]
    train: TrainArgs,
}

#[derive(Subcommand)]
enum Cmd {
    /// Per-token log-probs and entropies of token sequences under an HF Qwen3 checkpoint.
    Logprobs {
        /// HF checkpoint directory (config.json + model.safetensors or a sharded index).
        #[arg(long)]
        hf_checkpoint: PathBuf,
        /// JSONL input: {"tokens": [ids...], "prompt_len": optional} per line.
        #[arg(long)]
        input: PathBuf,
        /// JSONL output: each input object plus "logprobs" and "entropy".
        #[arg(long)]
        output: PathBuf,
        /// Compute dtype: f32, bf16 or f16.
        #[arg(long, default_value = "f32")]
        dtype: String,
        /// cpu, cuda or cuda:N.
        #[arg(long, default_value = "cpu")]
        device: String,
        /// Tokens per packed forward batch.
        #[arg(long, default_value_t = 8192)]
        max_tokens_per_batch: usize,
        /// Tokens per query chunk of the forward (see `Qwen3::set_forward_chunk_tokens`).
        #[arg(long, default_value_t = 8192)]
        forward_chunk_tokens: usize,
    },
    /// Times the training step (forward + backward + AdamW) of a random-init Qwen3 release shape
    /// on synthetic tokens: tokens/s, MFU, peak memory (see vime_trainer::bench).
    BenchStep(vime_trainer::bench::BenchArgs),
    /// Times the streamed weight sync of a random-init Qwen3 release shape to a running engine and
    /// checks the engine's weights bit for bit afterwards (see vime_trainer::bench_sync).
    BenchSync(vime_trainer::bench_sync::BenchSyncArgs),
    /// Times the training step's GEMMs at a release shape, as the block runs them and with each
    /// cuBLASLt heuristic algorithm, plus fused q|k|v and gate|up (see vime_trainer::bench_gemm).
    BenchGemm(vime_trainer::bench_gemm::BenchGemmArgs),
    /// Checks running rollout engines (vLLM or vime-serve, direct or through vllm-router) for what
    /// vime needs of them: generation with seeds and stop ids, pause modes, sleep and wake, control
    /// routes (see vime_rollout::check). Exit status 1 if any check fails.
    CheckEngines(Box<vime_rollout::check::CheckArgs>),
    /// Writes a synthetic task (prompts, eval set, tokenizer, a tiny random Qwen3) for the demo.
    MakeTask(vime_trainer::demo::MakeTaskArgs),
    /// Log-probs, entropies and the gradient of a fixed objective on one packed batch (parity checks).
    Grad {
        #[arg(long)]
        hf_checkpoint: PathBuf,
        /// safetensors with input_ids, cu_seqlens, adv, ent_coef (see vime_trainer::gradcheck).
        #[arg(long)]
        batch: PathBuf,
        #[arg(long)]
        output: PathBuf,
        #[arg(long, default_value = "f32")]
        dtype: String,
        #[arg(long, default_value = "cpu")]
        device: String,
        /// none or full.
        #[arg(long, default_value = "full")]
        recompute: String,
        #[command(flatten)]
        fp8: vime_trainer::device::Fp8Args,
        #[command(flatten)]
        head: vime_trainer::device::HeadArgs,
        /// Under --fp8-recipe delayed: passes run first on the batch's sequences rotated by 1, 2,
        /// ... tokens (gradients dropped), so that the measured pass is scaled by the amax
        /// histories of other tensors, as in training (0: the histories are seeded by the
        /// measured pass itself, which then has tensorwise scaling's bits).
        #[arg(long, default_value_t = 0)]
        fp8_amax_warmup: usize,
    },
}

fn main() {
    // A training command line first loses slime's and Megatron's flags that are not options of
    // vime's own (`compat`: notices, model-shape checks, refusals); subcommands parse as they are.
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let subcommand = argv
        .get(1)
        .and_then(|a| a.to_str())
        .is_some_and(|a| Cli::command().get_subcommands().any(|s| s.get_name() == a));
    let (argv, compat) = if subcommand {
        (argv, Default::default())
    } else {
        match vime_trainer::train::compat::split(argv) {
            Ok(x) => x,
            Err(e) => {
                eprintln!("vime-train: error: {e:#}");
                std::process::exit(2);
            }
        }
    };
    let mut cli = Cli::parse_from(argv);
    cli.train.compat = compat;
    // `--nproc-per-node N` (or slime's `--actor-num-gpus-per-node N`) in a process that is not
    // itself a rank: start N ranks of the same command line and wait for them.
    let nproc = cli
        .train
        .parallel
        .nproc_per_node
        .or(cli.train.placement.actor_num_gpus_per_node.filter(|&n| n > 1));
    if let (None, Some(n)) = (&cli.cmd, nproc) {
        // (A process that already has torchrun's environment is a rank: it runs.)
        if std::env::var_os("RANK").is_none() {
            let code = match launch(n) {
                Ok(code) => code,
                Err(e) => {
                    eprintln!("vime-train: error: {e:#}");
                    1
                }
            };
            std::process::exit(code);
        }
    }
    let code = match run(cli) {
        Ok(code) => code,
        Err(e) => {
            // Each rank of a launched world says which one it is.
            match std::env::var("RANK") {
                Ok(r) => eprintln!("vime-train: rank {r}: error: {e:#}"),
                Err(_) => eprintln!("vime-train: error: {e:#}"),
            }
            1
        }
    };
    std::process::exit(code);
}

/// The launcher: this program's own arguments minus `--nproc-per-node N`, run as N local ranks.
/// Exits 0 when every rank did, 130 when every rank stopped on Ctrl-C (as a single process does),
/// else with an error naming the first rank that failed.
fn launch(nproc: usize) -> Result<i32> {
    let mut args: Vec<std::ffi::OsString> = Vec::new();
    let mut it = std::env::args_os().skip(1);
    while let Some(a) = it.next() {
        match a.to_str() {
            Some("--nproc-per-node") => {
                it.next();
            }
            Some(s) if s.starts_with("--nproc-per-node=") => {}
            _ => args.push(a),
        }
    }
    let program = std::env::current_exe().context("finding this program's path to start the ranks")?;
    let run = vime_dist::launch::run_local(&vime_dist::launch::LocalLaunch::new(nproc, &program, &args), |_, _| {})?;
    if run.statuses.iter().all(|s| s.code() == Some(130)) {
        return Ok(130);
    }
    match run.failure_summary() {
        None => Ok(0),
        Some(why) => anyhow::bail!("{why}"),
    }
}

fn run(cli: Cli) -> Result<i32> {
    match cli.cmd {
        None => {
            let summary = vime_trainer::train::run(&cli.train)?;
            let (graphs, build_s) = vime_kernels::cudnn_graph_stats();
            if graphs > 0 {
                let v = vime_kernels::cudnn_version().unwrap_or_else(|| "?".into());
                eprintln!("cuDNN {v} attention: {graphs} graphs built, {build_s:.2} s of host time");
            }
            if let Some(p) = &summary.metrics_file {
                eprintln!("metrics: {}", p.display());
            }
            if let Some(p) = &summary.plot_file {
                eprintln!("curves:  {}", p.display());
            }
            if let Some(p) = &summary.last_checkpoint {
                eprintln!("last checkpoint: {}", p.display());
            }
            Ok(if summary.interrupted { 130 } else { 0 })
        }
        Some(Cmd::Logprobs {
            hf_checkpoint,
            input,
            output,
            dtype,
            device,
            max_tokens_per_batch,
            forward_chunk_tokens,
        }) => {
            let device = parse_device(&device)?;
            let dtype = parse_dtype(&dtype)?;
            let t0 = std::time::Instant::now();
            let mut model = Qwen3::load_hf(&hf_checkpoint, dtype, &device)
                .with_context(|| format!("loading the checkpoint {}", hf_checkpoint.display()))?;
            model.set_forward_chunk_tokens(forward_chunk_tokens);
            let n = vime_trainer::score::score_file(&model, &input, &output, max_tokens_per_batch.max(1))?;
            eprintln!(
                "scored {n} sequences in {:.2}s -> {}",
                t0.elapsed().as_secs_f64(),
                output.display()
            );
            Ok(0)
        }
        Some(Cmd::Grad {
            hf_checkpoint,
            batch,
            output,
            dtype,
            device,
            recompute,
            fp8,
            head,
            fp8_amax_warmup,
        }) => {
            let device = parse_device(&device)?;
            let dtype = parse_dtype(&dtype)?;
            let t0 = std::time::Instant::now();
            let mut model = Qwen3::load_hf(&hf_checkpoint, dtype, &device)
                .with_context(|| format!("loading the checkpoint {}", hf_checkpoint.display()))?;
            let k = head.apply(fp8.apply(model.kernel_config().clone())?)?;
            model.set_kernel_config(k);
            device.synchronize()?;
            let loaded = t0.elapsed().as_secs_f64();
            let t1 = std::time::Instant::now();
            let j = vime_trainer::gradcheck::grad_file(&model, &batch, &output, recompute.parse()?, fp8_amax_warmup)?;
            eprintln!(
                "objective {j:.6e}; load {loaded:.1}s, forward+backward+write {:.1}s -> {}",
                t1.elapsed().as_secs_f64(),
                output.display()
            );
            Ok(0)
        }
        Some(Cmd::BenchStep(args)) => {
            vime_trainer::bench::run(&args)?;
            Ok(0)
        }
        Some(Cmd::BenchSync(args)) => {
            vime_trainer::bench_sync::run(&args)?;
            Ok(0)
        }
        Some(Cmd::BenchGemm(args)) => {
            vime_trainer::bench_gemm::run(&args)?;
            Ok(0)
        }
        Some(Cmd::CheckEngines(args)) => vime_rollout::check::run(&args),
        Some(Cmd::MakeTask(args)) => {
            let files = vime_trainer::demo::make_task(&args)?;
            eprintln!("{files}");
            Ok(0)
        }
    }
}
