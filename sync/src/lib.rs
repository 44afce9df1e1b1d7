//! vime-sync: weight streaming from the trainer to rollout engines.
//!
//! - [`plan`]: the bucket plan (HF names, torch dtype names, full shapes, byte offsets in
//!   safetensors layout, buckets of `--update-weight-buffer-size`) read off the layout table.
//! - [`pack`]: bucket bytes on the host, the `update_info` metadata, per-tensor checksums.
//! - [`protocol`]: the HTTP calls of each phase per protocol (vime-serve / vLLM-native routes, or
//!   vLLM with vime's worker extension through `/collective_rpc`), and [`EngineControl`].
//! - [`sender`]: the trainer's side, [`WeightSender`] with its transports (CUDA IPC on one GPU, a
//!   broadcast group: NCCL between GPUs, vime's CPU backend between CPU processes).
//! - [`receiver`]: the engine's side, [`WeightReceiver`] (what vime-serve runs).
//! - `cuda` (feature `cuda`): `cuMemAlloc` buffers, IPC handles and mappings, device copies.
//! - `python/vime_vllm_ext.py`: the vLLM worker extension of [`Protocol::WorkerExtension`].
pub mod b64;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod pack;
pub mod plan;
pub mod protocol;
pub mod receiver;
pub mod sender;

pub use plan::{Bucket, BucketRule, SyncPlan, TensorSlot, DEFAULT_BUFFER_BYTES};
pub use protocol::{Call, EngineControl, Protocol};
pub use receiver::{RecvKind, WeightReceiver, WeightSink};
pub use sender::{BroadcastTransport, SyncOptions, SyncReport, Transport, WeightSender};
