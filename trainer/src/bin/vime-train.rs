//! `vime-train`: the trainer's command line. Subcommands so far: `logprobs` (score sequences with
//! an HF Qwen3 checkpoint). Flag names follow slime's where slime has one.
use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use std::path::PathBuf;
use vime_qwen3::model::Qwen3;
use vime_trainer::device::{parse_device, parse_dtype};

#[derive(Parser)]
#[command(name = "vime-train", version, about = "Native Rust RL post-training for Qwen3")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
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
    },
}

fn main() -> Result<()> {
    match Cli::parse().cmd {
        Cmd::Logprobs {
            hf_checkpoint,
            input,
            output,
            dtype,
            device,
            max_tokens_per_batch,
        } => {
            let device = parse_device(&device)?;
            let dtype = parse_dtype(&dtype)?;
            let t0 = std::time::Instant::now();
            let model = Qwen3::load_hf(&hf_checkpoint, dtype, &device)
                .with_context(|| format!("loading the checkpoint {}", hf_checkpoint.display()))?;
            let n = vime_trainer::score::score_file(&model, &input, &output, max_tokens_per_batch.max(1))?;
            eprintln!(
                "scored {n} sequences in {:.2}s -> {}",
                t0.elapsed().as_secs_f64(),
                output.display()
            );
        }
    }
    Ok(())
}
