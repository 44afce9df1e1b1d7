//! Shared by the benchmarks (each includes it with `mod common;`): a counting global allocator
//! (live heap bytes and their high-water mark, exact) and `--flag value` parsing.
#![allow(dead_code)]
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use vime_qwen3::batch::PackedBatch;
use vime_qwen3::config::Qwen3Config;

pub struct Counting;
pub static LIVE: AtomicUsize = AtomicUsize::new(0);
pub static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        let p = System.alloc(l);
        if !p.is_null() {
            let now = LIVE.fetch_add(l.size(), Relaxed) + l.size();
            PEAK.fetch_max(now, Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l);
        LIVE.fetch_sub(l.size(), Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        let q = System.realloc(p, l, new);
        if !q.is_null() {
            if new > l.size() {
                let now = LIVE.fetch_add(new - l.size(), Relaxed) + new - l.size();
                PEAK.fetch_max(now, Relaxed);
            } else {
                LIVE.fetch_sub(l.size() - new, Relaxed);
            }
        }
        q
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The value after `name` on the command line.
pub fn arg(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

/// A numeric `--flag value`, or `default`.
pub fn num(name: &str, default: usize) -> usize {
    arg(name).and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The benchmarks' Qwen3 shape: 8 query / 4 KV heads, vocabulary 8192 (tied), f32.
pub fn config(layers: usize, hidden: usize, intermediate: usize, head_dim: usize) -> anyhow::Result<Qwen3Config> {
    Qwen3Config::from_json_str(&format!(
        r#"{{"model_type": "qwen3", "vocab_size": 8192, "hidden_size": {hidden}, "intermediate_size": {intermediate},
        "num_hidden_layers": {layers}, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": {head_dim},
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
        "tie_word_embeddings": true, "attention_bias": false, "torch_dtype": "float32", "hidden_act": "silu"}}"#
    ))
}

/// `seqs` sequences of `tokens / seqs` random ids (seed 1), packed.
pub fn random_batch(vocab: usize, tokens: usize, seqs: usize) -> anyhow::Result<PackedBatch> {
    let mut rng = vime_kernels::testing::Rng::new(1);
    let data: Vec<Vec<u32>> = (0..seqs)
        .map(|_| {
            (0..tokens / seqs)
                .map(|_| (rng.next_u64() % vocab as u64) as u32)
                .collect()
        })
        .collect();
    PackedBatch::from_sequences(&data)
}
