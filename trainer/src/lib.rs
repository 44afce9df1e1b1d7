//! vime-trainer: everything around the model that makes it train, and the `vime-train` binary.
//!
//! - [`rl`]: advantage estimators and RL losses, following slime's formulas.
//! - [`optim`]: AdamW with fp32 master weights and moments, clipping, LR schedules, accumulation.
//! - [`batching`]: dynamic micro-batches by `max_tokens_per_gpu`, balancing across DP ranks.
//! - [`critic`]: the PPO critic (Qwen3 backbone + value head) and the frozen reference model.
//! - [`ckpt`]: atomic training checkpoints (HF model + optimizer + loop state) and exact resume.
//! - [`score`]: the `vime-train logprobs` scoring command.
pub mod batching;
pub mod bench;
pub mod bench_gemm;
pub mod bench_sync;
pub mod ckpt;
pub mod critic;
pub mod demo;
pub mod device;
pub mod gradcheck;
pub mod metrics;
pub mod optim;
pub mod rl;
pub mod score;
pub mod train;
