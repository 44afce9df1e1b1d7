//! vime-rollout: everything between prompts and scored samples.
//!
//! - [`check`]: `vime-train check-engines`, what vime needs of running engines, checked.
//! - [`data`]: prompt datasets (`--prompt-data` JSONL), chat templates, tokenization.
//! - [`reward`]: reward functions (`--rm-type`): deepscaler, math, dapo, f1, remote_rm.
//! - [`engine`]: the `RolloutEngine` trait and the built-in engine (KV-cache sampling on the
//!   `vime-qwen3` weights, log-probs from the trainer's own kernels).
//! - [`serve`]: `vime-serve`, the built-in engine behind vLLM 0.33's HTTP API subset.
//! - [`vllm`]: the client for vLLM engines (direct or through vllm-router) and the launcher.
pub mod check;
pub mod data;
pub mod engine;
pub mod reward;
pub mod serve;
pub mod task;
pub mod vllm;
