//! The rollout engine as the loop sees it: the built-in engine in this process, or HTTP engines
//! (vLLM or vime-serve) that receive the weights streamed in buckets (`vime_sync`) or reload an HF
//! folder (`--update-weight-transport disk`).
//!
//! Decisions:
//! - Every weight sync reads the same bucket plan (HF names in layer order, `--update-weight-
//!   buffer-size` buckets): the built-in engine loads it bucket by bucket in place, HTTP engines
//!   get it over the transport.
//! - The transfer dtype is bf16 for a policy on the GPU (what vLLM serves) and the policy's own
//!   dtype on the CPU (so a CPU engine gets the trainer's exact weights).
//! - Transport `auto`: `ipc` with `--colocate`, `nccl` for a policy on a GPU, `disk` on the CPU.
//! - Launched engines (`--vllm-launch`) bind `--vllm-host` (127.0.0.1) with the dev endpoints on,
//!   and a vime-serve engine reloads only from `sync_dir`, the folder written for it.
//! - `--colocate`: after a rollout the engines sleep (`/sleep?level=1`); the sync wakes their
//!   weights, streams (no pause: sleeping engines do not schedule), then wakes the KV cache.
use crate::train::args::SyncArgs;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Tensor};
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use vime_dist::layout::{LayoutEntry, LayoutTable};
use vime_qwen3::checkpoint::{copy_tokenizer_files, DEFAULT_MAX_SHARD_BYTES};
use vime_qwen3::model::Qwen3;
use vime_qwen3::state_dict::param_specs;
use vime_rollout::engine::embedded::{EmbeddedEngine, EngineOptions};
use vime_rollout::engine::{GenOutput, GenRequest, RolloutEngine};
use vime_rollout::vllm::{VllmArgs, VllmClient, VllmLauncher};
use vime_sync::{BucketRule, Protocol, SyncOptions, SyncPlan, Transport, WeightSender, WeightSink};

pub enum Engine {
    /// Its own copy of the weights (the policy's are updated by the optimizer in place).
    Embedded {
        engine: Box<EmbeddedEngine>,
        plan: SyncPlan,
    },
    Remote {
        client: VllmClient,
        /// Engines this process started (`--vllm-launch`); dropped with the loop.
        _launcher: Option<VllmLauncher>,
        /// Where each new policy is written for the engines to reload (`disk`).
        sync_dir: PathBuf,
        /// The streamed sync (`ipc`, `nccl`, `cpu`); `None` for `disk`.
        sender: Option<RefCell<Box<WeightSender>>>,
        /// `--update-weight-timeout`: the bound on each of the disk sync's control calls (the
        /// streamed sync has its own, `SyncOptions::deadline`).
        update_weight_timeout: Duration,
        colocate: bool,
        asleep: Cell<bool>,
    },
}

/// What one sync moved and where its time went.
pub struct SyncOutcome {
    pub bytes: u64,
    pub metrics: Vec<(String, f64)>,
}

/// A deep copy of the model's weights (the engine must not share storage with the policy,
/// whose `Var`s the optimizer overwrites).
pub fn copy_weights(model: &Qwen3) -> Result<BTreeMap<String, Tensor>> {
    model
        .state_dict()
        .into_iter()
        .map(|(n, t)| Ok((n, t.copy()?)))
        .collect()
}

/// The sync plan of `policy`: every parameter in HF layer order, full shapes.
pub fn sync_plan(policy: &Qwen3, dtype: DType, buffer_bytes: usize, rule: BucketRule) -> Result<SyncPlan> {
    let entries = param_specs(policy.config())
        .into_iter()
        .map(|s| LayoutEntry::new(s.name, &s.shape, dtype, false, s.placement))
        .collect();
    let table = LayoutTable::new(entries, 0, 1)?;
    SyncPlan::new(&table, dtype, buffer_bytes, rule)
}

/// The transport `--update-weight-transport` names, `auto` resolved.
pub fn resolve_transport(args: &SyncArgs, on_gpu: bool) -> Result<&'static str> {
    Ok(match args.update_weight_transport.as_str() {
        // Colocated engines on the CPU (a slime script at CPU scale) reload from disk like any.
        "auto" if args.colocate && on_gpu => "ipc",
        "auto" if on_gpu => "nccl",
        "auto" => "disk",
        "ipc" => "ipc",
        "nccl" => "nccl",
        "cpu" => "cpu",
        "disk" => "disk",
        other => bail!("--update-weight-transport must be auto, ipc, nccl, cpu or disk, got {other:?}"),
    })
}

/// What makes the transport `transport` (`ipc`, `nccl`, `cpu`) of a sender on `device`: called on
/// the first sync and after a failed one. `master_address` is where the engines reach this process
/// for the CPU rendezvous.
pub fn transport_factory(
    transport: &str,
    device: &candle_core::Device,
    plan: &SyncPlan,
    master_address: &str,
) -> Result<vime_sync::sender::MakeTransport> {
    let device = device.clone();
    let master = master_address.to_string();
    Ok(match transport {
        "ipc" => {
            #[cfg(feature = "cuda")]
            {
                let plan = plan.clone();
                Box::new(move || -> Result<Box<dyn Transport>> {
                    Ok(Box::new(vime_sync::sender::IpcTransport::new(&device, &plan)?))
                })
            }
            #[cfg(not(feature = "cuda"))]
            {
                let _ = plan;
                bail!("the ipc weight transport needs a CUDA build of vime-train")
            }
        }
        "nccl" if !device.is_cuda() => {
            bail!("the nccl weight transport needs the policy on a GPU (use cpu for a CPU policy)")
        }
        "cpu" if device.is_cuda() => {
            bail!("the cpu weight transport is for a CPU policy; a GPU policy streams over nccl or ipc")
        }
        "nccl" | "cpu" => Box::new(move || -> Result<Box<dyn Transport>> {
            Ok(Box::new(vime_sync::BroadcastTransport::new(&master, &device)?))
        }),
        other => bail!("weight transport must be ipc, nccl or cpu, got {other:?}"),
    })
}

impl Engine {
    pub fn embedded(
        policy: &Qwen3,
        eos_token_ids: Vec<u32>,
        seed: u64,
        kv_cache_tokens: Option<usize>,
        args: &SyncArgs,
    ) -> Result<Self> {
        let mut copy = Qwen3::from_tensors(policy.config().clone(), copy_weights(policy)?)?;
        copy.set_kernel_config(policy.kernel_config().clone());
        let opts = EngineOptions {
            eos_token_ids,
            seed,
            kv_cache_tokens,
            ..EngineOptions::for_config(policy.config())
        };
        let plan = sync_plan(
            policy,
            policy.dtype(),
            args.update_weight_buffer_size,
            BucketRule::CloseBefore,
        )?;
        Ok(Engine::Embedded {
            engine: Box::new(EmbeddedEngine::new(copy, opts)?),
            plan,
        })
    }

    /// Connects to (or launches) HTTP engines serving `model_dir`, with the sync `args` asks for.
    pub fn remote(
        vllm: &VllmArgs,
        args: &SyncArgs,
        policy: &Qwen3,
        model_dir: &Path,
        sync_dir: PathBuf,
    ) -> Result<Self> {
        let mut vllm = vllm.clone();
        if vllm.vllm_launch {
            // Engines vime launches reload only from where this process writes for them (a
            // vime-serve engine refuses other folders; vLLM has no such check).
            std::fs::create_dir_all(&sync_dir).with_context(|| format!("creating {}", sync_dir.display()))?;
            vllm.allowed_weights_root = Some(sync_dir.clone());
        }
        let (launcher, client) = vllm
            .connect(&model_dir.display().to_string())
            .context("connecting to the rollout engines")?;
        let device = policy.device().clone();
        let transport = resolve_transport(args, device.is_cuda())?;
        let sender = if transport == "disk" {
            None
        } else {
            let protocol = match args.update_weight_protocol.as_str() {
                "auto" => {
                    let versions = client.engine_versions()?;
                    let p = vime_sync::protocol::choose_protocol(&versions, transport)?;
                    eprintln!(
                        "vime: engine versions {versions:?}: weight sync over {transport} with the {p:?} protocol"
                    );
                    p
                }
                other => other.parse::<Protocol>()?,
            };
            let dtype = if device.is_cuda() { DType::BF16 } else { policy.dtype() };
            let plan = sync_plan(policy, dtype, args.update_weight_buffer_size, BucketRule::CloseBefore)?;
            let make = transport_factory(transport, &device, &plan, &args.update_weight_master_address)?;
            let opts = SyncOptions {
                protocol,
                deadline: Duration::from_secs_f64(args.update_weight_timeout),
                pause: !args.colocate,
                clear_cache: false,
                reset_prefix_cache: true,
            };
            Some(RefCell::new(Box::new(WeightSender::new(plan, make, opts))))
        };
        Ok(Engine::Remote {
            client,
            _launcher: launcher,
            sync_dir,
            sender,
            update_weight_timeout: Duration::from_secs_f64(args.update_weight_timeout),
            colocate: args.colocate,
            asleep: Cell::new(false),
        })
    }

    /// The transport in use (`embedded`, `disk`, `ipc`, `nccl`, `cpu`), for the log.
    pub fn describe(&self, args: &SyncArgs) -> String {
        match self {
            Engine::Embedded { .. } => "in place (built-in engine)".into(),
            Engine::Remote { sender: None, .. } => "disk (HF folder reload)".into(),
            Engine::Remote { sender: Some(s), .. } => {
                let s = s.borrow();
                format!(
                    "{} buckets of <= {} MiB over {}, {:?} protocol{}",
                    s.plan().buckets.len(),
                    s.plan().buffer_bytes >> 20,
                    args.update_weight_transport,
                    s.options().protocol,
                    if args.colocate { ", colocated" } else { "" }
                )
            }
        }
    }

    /// Sequences the built-in engine preempted because its KV cache ran full, over its life
    /// (`--rollout-kv-cache-tokens`); None for HTTP engines.
    pub fn preemptions(&self) -> Option<u64> {
        match self {
            Engine::Embedded { engine, .. } => Some(engine.preemptions()),
            Engine::Remote { .. } => None,
        }
    }

    pub fn generate(&self, requests: &[GenRequest]) -> Result<Vec<GenOutput>> {
        match self {
            Engine::Embedded { engine, .. } => engine.generate(requests),
            Engine::Remote { client, asleep, .. } => {
                if asleep.get() {
                    client.wake_up(&[]).context("waking the engines to generate")?;
                    asleep.set(false);
                }
                client.generate(requests)
            }
        }
    }

    /// `--colocate`: the engines release the GPU while the trainer trains (`/sleep?level=1`).
    pub fn release_for_training(&self) -> Result<()> {
        if let Engine::Remote {
            client,
            colocate: true,
            asleep,
            ..
        } = self
        {
            if !asleep.get() {
                client.sleep(1).context("putting the colocated engines to sleep")?;
                asleep.set(true);
            }
        }
        Ok(())
    }

    /// Sends the policy's current weights to the engine as weight version `version`.
    pub fn sync_weights(&self, policy: &Qwen3, tokenizer_dir: &Path, version: u64) -> Result<SyncOutcome> {
        let state = policy.state_dict();
        let source = |n: &str| {
            state
                .get(n)
                .cloned()
                .with_context(|| format!("the policy has no parameter {n}"))
        };
        let bytes = policy
            .named_parameters()
            .iter()
            .map(|(_, v)| (v.elem_count() * v.dtype().size_in_bytes()) as u64)
            .sum();
        let mut metrics = Vec::new();
        match self {
            Engine::Embedded { engine, plan } => {
                let prepared = vime_sync::sender::prepare(plan, &source)?;
                for (b, ts) in plan.buckets.iter().zip(prepared) {
                    let named = b.tensors.iter().map(|s| s.name.clone()).zip(ts).collect();
                    engine.load(named)?;
                }
                engine.finished();
            }
            Engine::Remote {
                client,
                sync_dir,
                sender: None,
                update_weight_timeout,
                ..
            } => {
                policy.save_hf(sync_dir, policy.dtype(), DEFAULT_MAX_SHARD_BYTES)?;
                copy_tokenizer_files(tokenizer_dir, sync_dir)?;
                client
                    .update_weights_from_dir_within(sync_dir, *update_weight_timeout)
                    .with_context(|| {
                        format!(
                            "the weight sync (disk reload of {}), each call bounded by --update-weight-timeout {} s",
                            sync_dir.display(),
                            update_weight_timeout.as_secs_f64()
                        )
                    })?;
            }
            Engine::Remote {
                client,
                sender: Some(sender),
                colocate,
                asleep,
                ..
            } => {
                #[cfg(feature = "cuda")]
                let gpu_used = |m: &mut Vec<(String, f64)>, key: &str| {
                    if let Some(gb) = vime_sync::cuda::device_memory_used_gb(policy.device()) {
                        m.push((key.to_string(), gb));
                    }
                };
                #[cfg(not(feature = "cuda"))]
                let gpu_used = |_: &mut Vec<(String, f64)>, _: &str| {};
                if *colocate && asleep.get() {
                    // The GPU as training left it, the engines asleep (every process's use).
                    gpu_used(&mut metrics, "perf/gpu_used_gb_engines_asleep");
                    let t = Instant::now();
                    client
                        .wake_up(&["weights"])
                        .context("waking the engines' weights for the sync")?;
                    metrics.push(("perf/sync_wake_weights_time".into(), t.elapsed().as_secs_f64()));
                }
                let rep = sender.borrow_mut().sync(client, &source, version)?;
                if *colocate && asleep.get() {
                    let t = Instant::now();
                    client
                        .wake_up(&["kv_cache"])
                        .context("waking the engines' KV cache after the sync")?;
                    asleep.set(false);
                    metrics.push(("perf/sync_wake_kv_cache_time".into(), t.elapsed().as_secs_f64()));
                }
                gpu_used(&mut metrics, "perf/gpu_used_gb_engines_awake");
                metrics.extend(rep.metrics().into_iter().map(|(k, v)| (k.to_string(), v)));
                return Ok(SyncOutcome {
                    bytes: rep.bytes as u64,
                    metrics,
                });
            }
        }
        Ok(SyncOutcome { bytes, metrics })
    }
}
