//! The rollout engine as the loop sees it: the built-in engine in this process (weights copied in
//! place after each step), or HTTP engines (vLLM or vime-serve) that reload an HF folder.
use anyhow::{Context, Result};
use candle_core::Tensor;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use vime_qwen3::checkpoint::{copy_tokenizer_files, DEFAULT_MAX_SHARD_BYTES};
use vime_qwen3::model::Qwen3;
use vime_rollout::engine::embedded::{EmbeddedEngine, EngineOptions};
use vime_rollout::engine::{GenOutput, GenRequest, RolloutEngine};
use vime_rollout::vllm::{VllmArgs, VllmClient, VllmLauncher};

pub enum Engine {
    /// Its own copy of the weights (the policy's are updated by the optimizer in place).
    Embedded(Box<EmbeddedEngine>),
    Remote {
        client: VllmClient,
        /// Engines this process started (`--vllm-launch`); dropped with the loop.
        _launcher: Option<VllmLauncher>,
        /// Where each new policy is written for the engines to reload.
        sync_dir: PathBuf,
    },
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

impl Engine {
    pub fn embedded(policy: &Qwen3, eos_token_ids: Vec<u32>, seed: u64) -> Result<Self> {
        let mut copy = Qwen3::from_tensors(policy.config().clone(), copy_weights(policy)?)?;
        copy.set_kernel_config(policy.kernel_config().clone());
        let opts = EngineOptions {
            eos_token_ids,
            seed,
            ..EngineOptions::for_config(policy.config())
        };
        Ok(Engine::Embedded(Box::new(EmbeddedEngine::new(copy, opts)?)))
    }

    /// Connects to (or launches) HTTP engines serving `model_dir`.
    pub fn remote(args: &VllmArgs, model_dir: &Path, sync_dir: PathBuf) -> Result<Self> {
        let (launcher, client) = args
            .connect(&model_dir.display().to_string())
            .context("connecting to the rollout engines")?;
        Ok(Engine::Remote {
            client,
            _launcher: launcher,
            sync_dir,
        })
    }

    pub fn generate(&self, requests: &[GenRequest]) -> Result<Vec<GenOutput>> {
        match self {
            Engine::Embedded(e) => e.generate(requests),
            Engine::Remote { client, .. } => client.generate(requests),
        }
    }

    /// Sends the policy's current weights to the engine. Returns the bytes moved.
    pub fn sync_weights(&self, policy: &Qwen3, tokenizer_dir: &Path) -> Result<u64> {
        let bytes = policy
            .named_parameters()
            .iter()
            .map(|(_, v)| (v.elem_count() * v.dtype().size_in_bytes()) as u64)
            .sum();
        match self {
            Engine::Embedded(e) => e.update_weights(&policy.state_dict())?,
            Engine::Remote { client, sync_dir, .. } => {
                policy.save_hf(sync_dir, policy.dtype(), DEFAULT_MAX_SHARD_BYTES)?;
                copy_tokenizer_files(tokenizer_dir, sync_dir)?;
                client.update_weights_from_dir(sync_dir)?;
            }
        }
        Ok(bytes)
    }
}
