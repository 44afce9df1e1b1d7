//! `vime-train bench-sync`: times the streamed weight sync of a random-init Qwen3 release shape to
//! running engines (vime-serve or vLLM), as the trainer runs it, and checks the engine's weights
//! afterwards bit for bit (per-tensor checksums over `/collective_rpc vime_weight_checksums`).
//!
//! Each sync sends different weights (every parameter is shifted by a step-dependent constant
//! before it), so no sync can pass on stale data. With `--colocate` every sync runs as the loop's
//! colocated one: the engine sleeps (level 1), wakes its weights, receives, wakes its KV cache.
use crate::bench::{config_of, random_model};
use crate::device::parse_device;
use crate::train::engine::{sync_plan, transport_factory};
use anyhow::{ensure, Context, Result};
use candle_core::DType;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use vime_rollout::vllm::{VllmClient, VllmClientConfig};
use vime_sync::pack::checksum;
use vime_sync::protocol::RPC_CHECKSUMS;
use vime_sync::{BucketRule, Protocol, SyncOptions, WeightSender};

#[derive(clap::Args, Debug, Clone)]
pub struct BenchSyncArgs {
    /// qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, or a path to an HF config.json.
    #[arg(long, default_value = "qwen3-4b")]
    pub model: String,
    /// The engine (vime-serve or vLLM) base URL.
    #[arg(long)]
    pub engine_url: String,
    /// ipc (same GPU), nccl (other GPUs) or cpu.
    #[arg(long, default_value = "ipc")]
    pub transport: String,
    /// auto (from the engine's GET /version), native or worker-extension.
    #[arg(long, default_value = "auto")]
    pub protocol: String,
    #[arg(long, default_value_t = vime_sync::DEFAULT_BUFFER_BYTES)]
    pub update_weight_buffer_size: usize,
    /// Timed syncs (the first, which also initialises the transport, is reported apart).
    #[arg(long, default_value_t = 5)]
    pub syncs: usize,
    #[arg(long, default_value = "cuda")]
    pub device: String,
    /// Sleep the engine between syncs and wake it around each, as `--colocate` training does.
    #[arg(long)]
    pub colocate: bool,
    #[arg(long, default_value_t = 300.0)]
    pub timeout: f64,
    /// Skip the checksum comparison (it reads every weight back to the host on both sides; an
    /// engine other than vime-serve has no checksums).
    #[arg(long)]
    pub no_check: bool,
    /// Write the weights of the last sync as an HF checkpoint here (config.json + safetensors),
    /// for checking what the engine computes with them (`vime-train logprobs`).
    #[arg(long)]
    pub save_hf: Option<std::path::PathBuf>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

pub fn run(args: &BenchSyncArgs) -> Result<Value> {
    ensure!(args.syncs >= 1, "--syncs must be at least 1");
    let device = parse_device(&args.device)?;
    let cfg = config_of(&args.model)?;
    let policy = random_model(cfg.clone(), DType::BF16, &device)?;
    let plan = sync_plan(
        &policy,
        DType::BF16,
        args.update_weight_buffer_size,
        BucketRule::CloseBefore,
    )?;
    let client = VllmClient::connect(VllmClientConfig {
        engine_urls: vec![args.engine_url.clone()],
        max_retries: 0,
        ..Default::default()
    })?;
    client
        .wait_healthy(Duration::from_secs(600))
        .with_context(|| format!("waiting for {}", args.engine_url))?;
    let protocol: Protocol = match args.protocol.as_str() {
        "auto" => vime_sync::protocol::choose_protocol(&client.engine_versions()?, &args.transport)?,
        other => other.parse()?,
    };
    let make = transport_factory(&args.transport, &device, &plan, "127.0.0.1")?;
    let mut sender = WeightSender::new(
        plan.clone(),
        make,
        SyncOptions {
            protocol,
            deadline: Duration::from_secs_f64(args.timeout),
            pause: !args.colocate,
            clear_cache: false,
            reset_prefix_cache: true,
        },
    );
    eprintln!(
        "bench-sync: {} ({} parameters, {:.3} GB in bf16) in {} bucket(s) of <= {} MiB over {} to {}",
        args.model,
        cfg.num_parameters(),
        plan.total_bytes() as f64 / 1e9,
        plan.buckets.len(),
        plan.buffer_bytes >> 20,
        args.transport,
        args.engine_url
    );
    let mut reports = Vec::new();
    let mut walls = Vec::new();
    for i in 0..=args.syncs {
        // New values every sync: w <- bf16(w + 2^-10).
        for (_, v) in policy.named_parameters() {
            v.set(&v.as_tensor().affine(1.0, 1.0 / 1024.0)?)?;
        }
        if device.is_cuda() {
            device.synchronize()?;
        }
        #[cfg(feature = "cuda")]
        let used = || vime_sync::cuda::device_memory_used_gb(&device);
        #[cfg(not(feature = "cuda"))]
        let used = || None::<f64>;
        let awake_gb = used();
        let mut asleep_gb = None;
        if args.colocate {
            client.sleep(1)?;
            asleep_gb = used();
            client.wake_up(&["weights"])?;
        }
        let state = policy.state_dict();
        let source = |n: &str| state.get(n).cloned().with_context(|| format!("no parameter {n}"));
        let t = Instant::now();
        let rep = sender.sync(&client, &source, i as u64 + 1)?;
        let wall = t.elapsed().as_secs_f64();
        if args.colocate {
            client.wake_up(&["kv_cache"])?;
        }
        let line = json!({
            "sync": i, "first": i == 0, "wall_s": wall, "prepare_s": rep.prepare_s, "pause_s": rep.pause_s,
            "init_s": rep.init_s, "transfer_s": rep.transfer_s, "stage_s": rep.stage_s,
            "engine_wait_s": rep.engine_wait_s, "engine_load_s": rep.engine_load_s, "finish_s": rep.finish_s, "paused_s": rep.paused_s,
            "bytes": rep.bytes, "buckets": rep.buckets, "tensors": rep.tensors,
            "gpu_used_gb_engine_awake": awake_gb, "gpu_used_gb_engine_asleep": asleep_gb,
        });
        eprintln!("bench-sync: {line}");
        if i > 0 {
            walls.push(wall);
            reports.push(line);
        }
    }
    let field = |k: &str| median(reports.iter().map(|r| r[k].as_f64().unwrap()).collect());
    let mut out = json!({
        "model": args.model, "transport": args.transport, "protocol": format!("{protocol:?}"),
        "colocate": args.colocate, "bytes": plan.total_bytes(), "buckets": plan.buckets.len(),
        "buffer_bytes": plan.buffer_bytes, "syncs": args.syncs,
        "median_wall_s": median(walls.clone()),
        "median_prepare_s": field("prepare_s"), "median_transfer_s": field("transfer_s"),
        "median_stage_s": field("stage_s"), "median_engine_wait_s": field("engine_wait_s"),
        "median_engine_load_s": field("engine_load_s"),
        "median_finish_s": field("finish_s"), "median_paused_s": field("paused_s"),
        "median_gb_per_s": plan.total_bytes() as f64 / 1e9 / median(walls),
        "gpu_used_gb_engine_awake": reports.last().map(|r| r["gpu_used_gb_engine_awake"].clone()),
        "gpu_used_gb_engine_asleep": reports.last().map(|r| r["gpu_used_gb_engine_asleep"].clone()),
    });
    if let Some(dir) = &args.save_hf {
        policy.save_hf(dir, DType::BF16, vime_qwen3::checkpoint::DEFAULT_MAX_SHARD_BYTES)?;
        eprintln!("bench-sync: the last sync's weights are in {}", dir.display());
    }
    if !args.no_check {
        let t = Instant::now();
        let rpc = client.collective_rpc(RPC_CHECKSUMS, &["{}".to_string()], &Default::default())?;
        let theirs = rpc
            .first()
            .and_then(|r| r.get(0))
            .and_then(Value::as_object)
            .context("the engine answered no checksums (is it vime-serve?)")?;
        let mut mismatched = Vec::new();
        for (name, v) in policy.named_parameters() {
            let ours = format!("{:016x}", checksum(v.as_tensor())?);
            if theirs.get(name).and_then(Value::as_str) != Some(ours.as_str()) {
                mismatched.push(name.clone());
            }
        }
        ensure!(
            theirs.len() == policy.named_parameters().len(),
            "the engine has {} tensors, the trainer {}",
            theirs.len(),
            policy.named_parameters().len()
        );
        out["checked_tensors"] = json!(theirs.len());
        out["mismatched_tensors"] = json!(mismatched);
        out["bit_exact"] = json!(mismatched.is_empty());
        eprintln!("bench-sync: checksums compared in {:.1} s", t.elapsed().as_secs_f64());
    }
    println!("{out}");
    Ok(out)
}
