//! vime-qwen3: the Qwen3 dense model for training.
//!
//! - [`config`]: `Qwen3Config`, mirroring HF `config.json`, validated, with the published presets.
//! - [`state_dict`]: the HF weight-name table (names and shapes per config).
//! - [`checkpoint`]: HF safetensors in (single file or sharded index) and out (same layout).
//! - [`batch`]: the packed varlen batch (`input_ids`, `position_ids`, `cu_seqlens`).
//! - [`model`]: the training forward over a packed batch, layer-by-layer backward with a
//!   recompute policy, log-probs and entropy from chunked LM-head ops. No KV cache, no collectives.
pub mod batch;
pub mod checkpoint;
pub mod config;
mod explicit;
pub mod infer;
pub mod model;
pub mod state_dict;
