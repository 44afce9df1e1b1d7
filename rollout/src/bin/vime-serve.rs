//! `vime-serve`: the built-in engine behind vLLM 0.33's HTTP API subset (see `vime_rollout::serve`).
//!
//! Takes `vllm serve`'s argument shape too (`vime-serve MODEL --port P --tensor-parallel-size 1
//! --gpu-memory-utilization X --enable-sleep-mode --worker-extension-cls CLS`), so the vLLM launcher
//! can start it in vLLM's place; the GPU-memory, sleep-mode and worker-extension flags are accepted
//! and have no effect here (a level-1 sleep moves the weights to the host). `--weight-transfer-config`
//! turns on the streamed weight sync, as in vLLM.
//!
//! Security (see `vime_rollout::serve`): binds 127.0.0.1 by default. The development endpoints
//! (pause, sleep, weights, `/collective_rpc`) are off unless `--dev-mode` or vLLM's
//! `VLLM_SERVER_DEV_MODE=1` (an integer, non-zero = on, as vLLM reads it); on, with a non-loopback
//! address, a warning goes to stderr. `reload_weights` reads only under `--allowed-weights-root`
//! (else `VIME_ALLOWED_WEIGHTS_ROOT`, which vime's launcher sets, else the folder holding the
//! checkpoint).
//!
//! EOS is handled per request by the server (vLLM's `ignore_eos`), so the engine is built without
//! engine-wide EOS ids.
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use clap::Parser;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use vime_qwen3::config::{dtype_from_hf_name, Qwen3Config};
use vime_qwen3::model::Qwen3;
use vime_rollout::engine::embedded::{EmbeddedEngine, EngineOptions};
use vime_rollout::engine::RolloutEngine;
use vime_rollout::serve::{self, ServeConfig};

#[derive(Parser, Debug)]
#[command(
    name = "vime-serve",
    about = "vime's built-in engine behind vLLM's HTTP API (completions, pause, weights)"
)]
struct Args {
    /// HF checkpoint directory (as `vllm serve MODEL`); same as --hf-checkpoint.
    model: Option<PathBuf>,
    /// HF checkpoint directory (config.json + safetensors; tokenizer.json optional).
    #[arg(long)]
    hf_checkpoint: Option<PathBuf>,
    /// Address to bind. Anything but a loopback address exposes the server (and, in dev mode, its
    /// weight-loading endpoints) to the network.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// auto (the checkpoint's dtype), bfloat16, float16 or float32.
    #[arg(long, default_value = "auto")]
    dtype: String,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Model id in /v1/models and responses (default: the checkpoint path as given).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Sequences decoded together at most.
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    /// Tokens per engine step at most.
    #[arg(long, default_value_t = 8192)]
    max_num_batched_tokens: usize,
    /// Seed of the engine's generator (requests without a seed draw from it).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Milliseconds a request waits for others to share its engine call.
    #[arg(long, default_value_t = 5)]
    batch_window_ms: u64,
    /// Requests per engine call at most.
    #[arg(long, default_value_t = 256)]
    max_batch_size: usize,
    /// vLLM compatibility: only 1 is supported.
    #[arg(long, default_value_t = 1)]
    tensor_parallel_size: usize,
    /// As vLLM's: the fraction of the GPU's memory this engine may use (weights, the fused decode
    /// weights, activations and the KV cache; default 0.9). The KV cache gets what is left,
    /// allocated when first needed; requests wait, or are preempted and recomputed, when it is
    /// full. Off CUDA the cache has no limit unless --kv-cache-tokens sets one.
    #[arg(long)]
    gpu_memory_utilization: Option<f64>,
    /// vime's: the KV cache's size in tokens (all layers), on any device, instead of the share
    /// --gpu-memory-utilization leaves.
    #[arg(long)]
    kv_cache_tokens: Option<usize>,
    /// vLLM compatibility: accepted, no effect (the sleep endpoints come with --dev-mode).
    #[arg(long)]
    enable_sleep_mode: bool,
    /// vLLM's flag: decode without CUDA graphs (by default each decode step on CUDA replays a
    /// graph captured per batch size).
    #[arg(long)]
    enforce_eager: bool,
    /// vLLM compatibility: accepted, no effect (vime-serve answers vime's worker-extension
    /// methods over /collective_rpc itself).
    #[arg(long)]
    worker_extension_cls: Option<String>,
    /// Streamed weight sync, as vLLM's flag: '{"backend": "ipc"}' (trainer on the same GPU),
    /// '{"backend": "nccl"}' (other GPUs) or '{"backend": "cpu"}' (CPU engines). Without it the
    /// weight-transfer routes are refused and weights update from disk only.
    #[arg(long)]
    weight_transfer_config: Option<String>,
    /// vLLM's `--load-format`: auto (the checkpoint's safetensors) or dummy (random weights from
    /// config.json alone, std 0.02, for benchmarks whose weights arrive by sync).
    #[arg(long, default_value = "auto")]
    load_format: String,
    /// slime's flag: batch-invariant GEMMs and attention on CUDA, and every log-prob by the
    /// trainer's LM-head kernel, so a vime trainer in the same mode computes the same log-probs
    /// bit for bit (no CUDA graphs; slower decoding).
    #[arg(long)]
    true_on_policy_mode: bool,
    /// vime's: the CUDA decode-attention kernel, tensor-cores (a kv head's query heads as MMA
    /// columns, one warp a block; the fastest measured), registers (keys loaded into registers)
    /// or pipelined (keys staged through shared memory with cp.async); `cuda/decode.cu`.
    #[arg(long, default_value = "tensor-cores")]
    decode_kernel: vime_kernels::config::DecodeKernel,
    /// Seconds a weight-sync rendezvous or one bucket may take before the call fails.
    #[arg(long, default_value_t = 300.0)]
    weight_transfer_timeout: f64,
    /// Serve the development endpoints (/pause, /sleep, /collective_rpc, the weight-transfer
    /// routes, ...), as vLLM does with VLLM_SERVER_DEV_MODE=1 (also read here). Off, they answer 404.
    #[arg(long)]
    dev_mode: bool,
    /// `collective_rpc reload_weights` reads only folders under this directory (after resolving
    /// `..` and symlinks). Default: $VIME_ALLOWED_WEIGHTS_ROOT, else the folder holding the checkpoint.
    #[arg(long)]
    allowed_weights_root: Option<PathBuf>,
}

/// vLLM's reading of `VLLM_SERVER_DEV_MODE` (`envs.py`: `bool(int(os.getenv(.., "0")))`): an
/// integer, non-zero is on; anything else is an error here as it is there.
fn dev_mode_from_env() -> Result<bool> {
    match std::env::var("VLLM_SERVER_DEV_MODE") {
        Err(std::env::VarError::NotPresent) => Ok(false),
        Err(e) => bail!("VLLM_SERVER_DEV_MODE: {e}"),
        Ok(v) => match v.trim().parse::<i64>() {
            Ok(n) => Ok(n != 0),
            Err(_) => bail!("VLLM_SERVER_DEV_MODE must be an integer (0 or 1, as vLLM reads it), got {v:?}"),
        },
    }
}

/// The `reload_weights` root: `--allowed-weights-root`, else `$VIME_ALLOWED_WEIGHTS_ROOT`, else
/// the folder holding the checkpoint; resolved, and it must exist.
fn weights_root(flag: Option<&std::path::Path>, checkpoint: &std::path::Path) -> Result<Option<PathBuf>> {
    let given = match flag {
        Some(p) => Some((p.to_path_buf(), "--allowed-weights-root")),
        None => std::env::var_os("VIME_ALLOWED_WEIGHTS_ROOT")
            .filter(|v| !v.is_empty())
            .map(|v| (PathBuf::from(v), "VIME_ALLOWED_WEIGHTS_ROOT")),
    };
    match given {
        None => Ok(serve::default_weights_root(checkpoint)),
        Some((p, from)) => {
            let real = p
                .canonicalize()
                .with_context(|| format!("{from} {}: the directory must exist", p.display()))?;
            if !real.is_dir() {
                bail!("{from} {} is not a directory", p.display());
            }
            Ok(Some(real))
        }
    }
}

/// `--weight-transfer-config` JSON: `{"backend": "ipc" | "nccl" | "cpu"}` (vLLM's only field).
fn parse_weight_transfer(s: &str) -> Result<vime_sync::RecvKind> {
    let v: serde_json::Value =
        serde_json::from_str(s).with_context(|| format!("--weight-transfer-config {s:?} is not JSON"))?;
    let Some(obj) = v.as_object() else {
        bail!("--weight-transfer-config must be a JSON object like '{{\"backend\": \"ipc\"}}', got {s}");
    };
    for k in obj.keys() {
        if k != "backend" {
            bail!("--weight-transfer-config: unknown key {k:?} (the only one is \"backend\")");
        }
    }
    let b = obj.get("backend").and_then(|b| b.as_str()).unwrap_or("nccl");
    vime_sync::RecvKind::parse(b).context("--weight-transfer-config")
}

fn parse_device(s: &str) -> Result<Device> {
    let d = open_device(s)?;
    vime_kernels::prepare_device(&d)?;
    Ok(d)
}

fn open_device(s: &str) -> Result<Device> {
    match s {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Device::new_cuda(0).context("opening cuda:0 (built without the `cuda` feature?)"),
        _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(i)) => {
                Device::new_cuda(i).with_context(|| format!("opening {s} (built without the `cuda` feature?)"))
            }
            _ => bail!("--device must be cpu, cuda or cuda:N, got {s:?}"),
        },
    }
}

fn parse_dtype(s: &str, cfg: &Qwen3Config) -> Result<DType> {
    match s {
        "auto" => cfg.candle_dtype(),
        "bf16" => Ok(DType::BF16),
        "fp16" | "half" => Ok(DType::F16),
        "fp32" | "float" => Ok(DType::F32),
        other => dtype_from_hf_name(other).context("--dtype"),
    }
}

/// The engine vime-serve runs: the built-in engine on the checkpoint, EOS left to the server.
#[allow(clippy::too_many_arguments)]
fn build_engine(
    dir: &std::path::Path,
    dtype: DType,
    device: &Device,
    opts: EngineOptions,
    kv: KvSize,
    dummy: bool,
    true_on_policy: bool,
    decode: vime_kernels::config::DecodeKernel,
) -> Result<(Arc<dyn RolloutEngine>, Option<usize>)> {
    let mut model = if dummy {
        let cfg = Qwen3Config::from_file(&dir.join("config.json"))?;
        Qwen3::init_random(cfg, 0.02, 0, dtype, device)?
    } else {
        Qwen3::load_hf(dir, dtype, device).with_context(|| format!("loading {}", dir.display()))?
    };
    let kernels = model
        .kernel_config()
        .clone()
        .with_batch_invariant(true_on_policy)
        .with_decode_kernel(decode);
    model.set_kernel_config(kernels);
    let mut opts = opts;
    opts.kv_cache_tokens = match kv {
        KvSize::Tokens(t) => Some(t),
        KvSize::Utilization(u) => kv_tokens_for_utilization(&model, device, u, opts.fused_decode && !true_on_policy)?,
    };
    if let Some(t) = opts.kv_cache_tokens {
        let gib = (t * model.new_kv_cache().bytes_per_token()) as f64 / (1u64 << 30) as f64;
        eprintln!("vime-serve: KV cache of {t} tokens ({gib:.1} GiB)");
    }
    let kv_tokens = opts.kv_cache_tokens;
    Ok((Arc::new(EmbeddedEngine::new(model, opts)?), kv_tokens))
}

/// How the KV cache is sized: `--kv-cache-tokens`, or `--gpu-memory-utilization`'s share.
#[derive(Clone, Copy)]
enum KvSize {
    Tokens(usize),
    Utilization(f64),
}

/// Memory kept aside for activations, the decode graphs' buffers and the sampler (a prefill of
/// `--max-num-batched-tokens` 8192 at Qwen3-8B's widths needs well under this).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
const ACTIVATION_RESERVE: u64 = 4 << 30;

/// The KV cache's tokens on CUDA at memory utilization `u`: `u x total` less the weights, the
/// fused decode copies (when used) and [`ACTIVATION_RESERVE`], and never more than the device
/// has free less the same. `None` off CUDA (no limit).
fn kv_tokens_for_utilization(model: &Qwen3, device: &Device, u: f64, fused: bool) -> Result<Option<usize>> {
    let Device::Cuda(_c) = device else { return Ok(None) };
    #[cfg(feature = "cuda")]
    {
        let (free, total) = vime_sync::cuda::device_memory_info(_c)?;
        let bytes = |pred: &dyn Fn(&str) -> bool| -> u64 {
            model
                .named_parameters()
                .iter()
                .filter(|(n, _)| pred(n))
                .map(|(_, v)| (v.elem_count() * v.dtype().size_in_bytes()) as u64)
                .sum()
        };
        let weights = bytes(&|_| true);
        let fused_bytes = if fused {
            bytes(&|n| {
                ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]
                    .iter()
                    .any(|p| n.contains(p))
            })
        } else {
            0
        };
        let share = (u * total as f64) as u64;
        let left = share
            .saturating_sub(weights + fused_bytes + ACTIVATION_RESERVE)
            .min(free.saturating_sub(fused_bytes + ACTIVATION_RESERVE));
        let per_token = model.new_kv_cache().bytes_per_token() as u64;
        let tokens = (left / per_token.max(1)) as usize;
        if tokens < 4 * vime_qwen3::infer::PAGE {
            bail!(
                "--gpu-memory-utilization {u} leaves no room for the KV cache: {:.1} GiB of {:.1} GiB is the share, \
                 the weights take {:.1} GiB (+ {:.1} GiB fused decode copies, {:.1} GiB kept for activations), \
                 {:.1} GiB is free on the device",
                share as f64 / (1u64 << 30) as f64,
                total as f64 / (1u64 << 30) as f64,
                weights as f64 / (1u64 << 30) as f64,
                fused_bytes as f64 / (1u64 << 30) as f64,
                ACTIVATION_RESERVE as f64 / (1u64 << 30) as f64,
                free as f64 / (1u64 << 30) as f64
            );
        }
        Ok(Some(tokens))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (model, u, fused);
        Ok(None)
    }
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let dir = match (&args.model, &args.hf_checkpoint) {
        (Some(a), Some(b)) if a != b => bail!("MODEL {} and --hf-checkpoint {} disagree", a.display(), b.display()),
        (Some(d), _) | (None, Some(d)) => d.clone(),
        (None, None) => bail!("give the HF checkpoint directory (MODEL or --hf-checkpoint)"),
    };
    if args.tensor_parallel_size != 1 {
        bail!(
            "vime-serve runs one device per engine; --tensor-parallel-size {} is not supported",
            args.tensor_parallel_size
        );
    }
    if let Some(cls) = &args.worker_extension_cls {
        eprintln!(
            "vime-serve: --worker-extension-cls {cls} ignored (vime-serve serves vime's extension methods itself)"
        );
    }
    let dev_mode = args.dev_mode || dev_mode_from_env()?;
    let reload_root = weights_root(args.allowed_weights_root.as_deref(), &dir)?;
    let weight_transfer = args
        .weight_transfer_config
        .as_deref()
        .map(parse_weight_transfer)
        .transpose()?;
    if !(args.weight_transfer_timeout > 0.0 && args.weight_transfer_timeout.is_finite()) {
        bail!("--weight-transfer-timeout must be a positive number of seconds");
    }
    let cfg = Qwen3Config::from_file(&dir.join("config.json"))?;
    let device = parse_device(&args.device)?;
    let dtype = parse_dtype(&args.dtype, &cfg)?;
    let mut serve_cfg = ServeConfig::from_hf_dir(&dir, args.served_model_name.clone())?;
    serve_cfg.batch_window = Duration::from_millis(args.batch_window_ms);
    serve_cfg.max_batch_size = args.max_batch_size;
    serve_cfg.weight_transfer = weight_transfer;
    serve_cfg.weight_transfer_timeout = Duration::from_secs_f64(args.weight_transfer_timeout);
    serve_cfg.dev_mode = dev_mode;
    serve_cfg.allowed_weights_root = reload_root;
    let opts = EngineOptions {
        max_num_seqs: args.max_num_seqs,
        max_num_batched_tokens: args.max_num_batched_tokens,
        eos_token_ids: Vec::new(),
        seed: args.seed,
        cuda_graphs: !args.enforce_eager,
        ..EngineOptions::default()
    };
    let kv = match (args.kv_cache_tokens, args.gpu_memory_utilization) {
        (Some(0), _) => bail!("--kv-cache-tokens must be at least 1"),
        (Some(t), _) => KvSize::Tokens(t),
        (None, Some(u)) if !(u > 0.0 && u <= 1.0) => bail!("--gpu-memory-utilization must be in (0, 1], got {u}"),
        (None, u) => KvSize::Utilization(u.unwrap_or(0.9)),
    };
    let dummy = match args.load_format.as_str() {
        "auto" | "safetensors" => false,
        "dummy" => true,
        other => bail!("--load-format must be auto, safetensors or dummy, got {other:?}"),
    };
    let engine = {
        let (dir, device) = (dir.clone(), device.clone());
        let invariant = args.true_on_policy_mode;
        let decode = args.decode_kernel;
        tokio::task::spawn_blocking(move || build_engine(&dir, dtype, &device, opts, kv, dummy, invariant, decode))
            .await??
    };
    let (engine, kv_tokens) = engine;
    // As vLLM: no sequence may be longer than the KV cache can hold (vLLM refuses to start; here
    // the served max_model_len comes down to it, so prompts past it get a 400 and completions
    // stop at it, instead of a request that can never fit failing the batch it shares).
    if let Some(t) = kv_tokens {
        let room = vime_qwen3::infer::longest_sequence_for(t);
        if room < serve_cfg.max_model_len {
            eprintln!(
                "vime-serve: max_model_len {} -> {room}: the longest sequence the {t}-token KV cache holds",
                serve_cfg.max_model_len
            );
            serve_cfg.max_model_len = room;
        }
    }
    let addr = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    eprintln!(
        "vime-serve: {} ({:?} on {:?}) listening on http://{addr}",
        serve_cfg.served_model_name, dtype, args.device
    );
    let bound = listener.local_addr().context("the bound address")?;
    for line in security_notes(&serve_cfg, bound) {
        eprintln!("vime-serve: {line}");
    }
    serve::serve(listener, engine, serve_cfg, shutdown_signal()).await
}

/// What start-up says about the exposed surface: dev mode on or off, the reload root, and a
/// warning when dev mode listens on a non-loopback address.
fn security_notes(cfg: &ServeConfig, bound: std::net::SocketAddr) -> Vec<String> {
    let mut notes = Vec::new();
    if !cfg.dev_mode {
        notes.push(
            "development endpoints (/pause, /sleep, /collective_rpc, weight transfer, ...) are off; \
             --dev-mode or VLLM_SERVER_DEV_MODE=1 turns them on"
                .into(),
        );
        if cfg.weight_transfer.is_some() {
            notes.push("--weight-transfer-config is set but its routes need dev mode".into());
        }
        return notes;
    }
    let dev: Vec<&str> = serve::ROUTES.iter().filter(|r| r.dev).map(|r| r.path).collect();
    notes.push(format!(
        "development endpoints are enabled on {bound} (--dev-mode / VLLM_SERVER_DEV_MODE=1): {}",
        dev.join(" ")
    ));
    match &cfg.allowed_weights_root {
        Some(root) => notes.push(format!(
            "collective_rpc reload_weights reads folders under {} only",
            root.display()
        )),
        None => notes.push("collective_rpc reload_weights is refused (no allowed weights root)".into()),
    }
    if !bound.ip().is_loopback() {
        notes.push(format!(
            "SECURITY WARNING: development endpoints on a non-loopback address ({bound}): anyone who \
             can reach it can pause the engine and replace its weights. Bind 127.0.0.1 (the default \
             --host) unless this network is trusted."
        ));
    }
    notes
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    eprintln!("vime-serve: shutting down");
}
