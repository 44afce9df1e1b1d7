//! vime-sync: weight streaming from the trainer to rollout engines.
//!
//! - [`plan`]: the bucket plan (HF names, torch dtype names, full shapes, byte offsets in
//!   safetensors layout, buckets of `--update-weight-buffer-size`) read off the layout table.
//!
//! The transports (CUDA IPC, NCCL), the receivers and the sync control flow are not built yet.
pub mod plan;

pub use plan::{Bucket, BucketRule, SyncPlan, TensorSlot, DEFAULT_BUFFER_BYTES};
