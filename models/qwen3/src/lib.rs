//! vime-qwen3: the Qwen3 dense model for training.
//!
//! - [`config`]: `Qwen3Config`, mirroring HF `config.json`, validated, with the published presets.
//! - [`state_dict`]: the HF weight-name table (names and shapes per config).
//! - [`checkpoint`]: HF safetensors in (single file or sharded index) and out (same layout).
//! - [`batch`]: the packed varlen batch (`input_ids`, `position_ids`, `cu_seqlens`).
//! - [`block`]: the decoder block, once: explicit forward (optionally saving activations) and
//!   backward over local shapes ([`block::BlockCtx`]), attention as a strategy (packed training,
//!   KV-cached decoding).
//! - [`model`]: the training forward over a packed batch, block-by-block backward with a
//!   recompute policy, log-probs and entropy from chunked LM-head ops. No KV cache, no collectives.
//! - [`infer`]: the caller-owned KV cache and the cached forward (prefill, decode) over the blocks.
//! - `reference`: candle's autograd over the same layer, the test reference of the explicit
//!   backward (`Qwen3::set_explicit_backward(false)`), not the training path.
pub mod batch;
pub mod block;
pub mod checkpoint;
pub mod config;
pub mod context_parallel;
pub mod infer;
pub mod model;
mod reference;
pub mod state_dict;
pub mod vocab_parallel;
