//! Shared by the integration tests of this crate (each uses some of it).
#![allow(dead_code)]
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::Path;
use vime_dist::layout::{LayoutEntry, LayoutTable};
use vime_qwen3::checkpoint::{load_config, load_hf_weights};
use vime_qwen3::config::{Qwen3Config, TokenIds};
use vime_qwen3::model::{Qwen3, TpPlace};
use vime_qwen3::state_dict::param_specs;

/// An HF fixture of `tests/fixtures/hf/` in f32 on the CPU: its config and tensors.
pub fn fixture(name: &str) -> (Qwen3Config, BTreeMap<String, Tensor>) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/hf")
        .join(name);
    let cfg = load_config(&dir).unwrap();
    let w = load_hf_weights(&dir, &cfg, DType::F32, &Device::Cpu).unwrap();
    (cfg, w)
}

/// The Megatron TP layout of `cfg` at rank `rank` of `tp` (f32).
pub fn table(cfg: &Qwen3Config, rank: usize, tp: usize) -> LayoutTable {
    let e = param_specs(cfg)
        .into_iter()
        .map(|s| LayoutEntry::new(s.name, &s.shape, DType::F32, false, s.placement))
        .collect();
    LayoutTable::new(e, rank, tp).unwrap()
}

/// TP rank `rank` of `tp`'s model from the global tensors.
pub fn shards(cfg: &Qwen3Config, global: &BTreeMap<String, Tensor>, rank: usize, tp: usize) -> Qwen3 {
    let t = table(cfg, rank, tp);
    let local = global
        .iter()
        .map(|(n, g)| (n.clone(), t.local_shard(n, g).unwrap()))
        .collect();
    Qwen3::from_shards(cfg.clone(), local, TpPlace { rank, size: tp }).unwrap()
}

/// A tiny valid config: GQA 4/2, head_dim 8 != hidden / heads = 6.
pub fn tiny(tied: bool, bias: bool) -> Qwen3Config {
    let mut c = Qwen3Config::preset("qwen3-0.6b").unwrap();
    c.vocab_size = 40;
    c.hidden_size = 24;
    c.intermediate_size = 36;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 8;
    c.max_position_embeddings = 64;
    c.max_window_layers = 2;
    c.tie_word_embeddings = tied;
    c.attention_bias = bias;
    c.dtype = Some("float32".into());
    (c.bos_token_id, c.eos_token_id) = (Some(1), Some(TokenIds::One(2)));
    c.validate().unwrap();
    c
}
