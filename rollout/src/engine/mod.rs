//! The rollout engine interface and the built-in engine.
//!
//! A [`RolloutEngine`] turns prompt token ids into sampled completions with per-token log-probs.
//! Two implementations: [`embedded::EmbeddedEngine`] (in-process, on the `vime-qwen3` weights, KV
//! cache on the model's device) and the vLLM client (`crate::vllm`), which speaks HTTP to vLLM or
//! to `vime-serve`. The trainer sees only this trait.
//!
//! Decisions: the interface is synchronous and batch-shaped (a whole rollout batch in, all
//! completions out, in request order); an engine that is async inside (the HTTP client) runs its
//! own runtime. Sampling parameters follow vLLM's names and defaults.
use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::path::Path;

pub mod embedded;

/// vLLM-style sampling parameters for one request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f64,
    /// 1.0 disables nucleus filtering.
    pub top_p: f64,
    /// 0 or negative disables top-k (vLLM uses -1).
    pub top_k: i64,
    /// Maximum number of generated tokens (`--rollout-max-response-len`).
    pub max_tokens: usize,
    /// Generation stops after any of these ids (the id is kept in the output, as vLLM does for EOS).
    pub stop_token_ids: Vec<u32>,
    /// Per-request seed; `None` draws from the engine's own generator.
    pub seed: Option<u64>,
}

impl SamplingParams {
    /// Greedy, or temperature sampling with neither top-k nor top-p over a vocabulary of `vocab`:
    /// what the device sampler draws (`vime_kernels::sample`).
    pub fn is_plain(&self, vocab: usize) -> bool {
        let greedy = self.temperature < embedded::SAMPLING_EPS;
        let no_top_k = self.top_k <= 0 || self.top_k as u64 >= vocab as u64;
        greedy || (no_top_k && self.top_p >= 1.0)
    }

    /// `1 / temperature`, and 0 for greedy (vLLM's threshold, [`embedded::SAMPLING_EPS`]).
    pub fn inverse_temperature(&self) -> f32 {
        if self.temperature < embedded::SAMPLING_EPS {
            0.0
        } else {
            (1.0 / self.temperature) as f32
        }
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: -1,
            max_tokens: 16,
            stop_token_ids: Vec::new(),
            seed: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenRequest {
    pub prompt_ids: Vec<u32>,
    pub params: SamplingParams,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// A stop token was generated.
    Stop,
    /// `max_tokens` (or the model's context) was reached.
    Length,
    /// The engine aborted the request (e.g. paused with `mode=abort`).
    Abort,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GenOutput {
    /// Generated ids only (the prompt is not repeated).
    pub token_ids: Vec<u32>,
    /// log p(token_ids[i] | prompt, token_ids[..i]) under the engine's weights, one per token.
    pub logprobs: Vec<f32>,
    pub finish_reason: FinishReason,
}

/// A running [`RolloutEngine::generate_with`] call's handle from outside: abort it between decode
/// steps (vLLM's `/pause?mode=abort` for requests already scheduled), and watch its progress.
#[derive(Debug, Default)]
pub struct GenControl {
    abort: std::sync::atomic::AtomicBool,
    steps: std::sync::atomic::AtomicU64,
}

impl GenControl {
    /// Asks the call to stop at its next step boundary: every unfinished request comes back with
    /// the tokens (and log-probs) generated so far and [`FinishReason::Abort`].
    pub fn abort(&self) {
        self.abort.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn is_aborted(&self) -> bool {
        self.abort.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Engine steps (forward passes) the call has finished so far.
    pub fn steps(&self) -> u64 {
        self.steps.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Called by the engine after each step.
    pub fn step_done(&self) {
        self.steps.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// What the trainer needs from any rollout engine.
pub trait RolloutEngine: Send + Sync {
    /// Generates one completion per request, in request order.
    fn generate(&self, requests: &[GenRequest]) -> Result<Vec<GenOutput>>;
    /// [`RolloutEngine::generate`] under `control`. Engines that can stop between steps (the
    /// built-in one) honour [`GenControl::abort`]; the default ignores the control and runs the
    /// batch to the end.
    fn generate_with(&self, requests: &[GenRequest], control: &GenControl) -> Result<Vec<GenOutput>> {
        let _ = control;
        self.generate(requests)
    }
    /// Replaces the weights with those of an HF safetensors checkpoint directory.
    fn update_weights_from_dir(&self, dir: &Path) -> Result<()>;
    /// Monotone counter bumped by every weight update.
    fn weight_version(&self) -> u64;
    /// Where a streamed weight sync writes (vime-serve's `/update_weights`); `None` for engines
    /// that only reload from disk.
    fn weight_sink(&self) -> Option<&dyn vime_sync::WeightSink> {
        None
    }
    /// Sleep level >= 1 for the weights (vLLM's offload): move them to the host, freeing the
    /// device for a colocated trainer. A no-op for engines on the CPU or without the ability.
    fn offload_weights(&self) -> Result<()> {
        Ok(())
    }
    /// Undoes [`RolloutEngine::offload_weights`] (`/wake_up?tags=weights`); a no-op when the
    /// weights are where they belong.
    fn restore_weights(&self) -> Result<()> {
        Ok(())
    }
    /// Per-tensor checksums of the weights (`vime_sync::pack::checksum`), by HF name: what the
    /// sync benchmarks compare with the trainer's.
    fn weight_checksums(&self) -> Result<std::collections::BTreeMap<String, u64>> {
        anyhow::bail!("this engine does not report weight checksums")
    }
}
