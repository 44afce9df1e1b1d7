//! Peak host memory and time of one forward+backward under `Recompute::None` and
//! `Recompute::Full`, for a mid-sized Qwen3 config on CPU.
//!
//! Memory is measured with a counting global allocator (live bytes and their high-water mark
//! during the step, above what was live before it), so the numbers are exact and repeatable, not
//! sampled RSS. The gradients of both policies are also checked to be bit-identical.
//!
//!   cargo bench --bench recompute_memory            (default: 8 layers, 2048 tokens)
//!   cargo bench --bench recompute_memory -- --layers 4 --tokens 512
mod common;

use anyhow::Result;
use candle_core::{DType, Device};
use common::{config, num, random_batch, LIVE, PEAK};
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;
use vime_qwen3::model::{Qwen3, Recompute};

fn main() -> Result<()> {
    let layers = num("--layers", 8);
    let tokens = num("--tokens", 2048);
    let seqs = num("--seqs", 4);
    let cfg = config(layers, 512, 1536, 64)?;
    let model = Qwen3::init_random(cfg.clone(), 0.02, 0, DType::F32, &Device::Cpu)?;
    let batch = random_batch(cfg.vocab_size, tokens, seqs)?;
    let params_bytes: usize = model.named_parameters().iter().map(|(_, v)| v.elem_count() * 4).sum();
    println!(
        "config: layers {layers}, hidden 512, heads 8/4 x 64, inter 1536, vocab 8192, f32, {} tokens in {seqs} sequences",
        batch.num_tokens()
    );
    println!("parameters: {:.1} MiB", params_bytes as f64 / (1 << 20) as f64);
    println!("| policy | peak above baseline (MiB) | of which gradients (MiB) | step time (s) |");
    println!("|---|---|---|---|");
    let mut results = Vec::new();
    for policy in [Recompute::None, Recompute::Full] {
        let base = LIVE.load(Relaxed);
        PEAK.store(base, Relaxed);
        let t0 = Instant::now();
        let (_loss, grads) =
            model.forward_backward(&batch, policy, |o| Ok((o.logprobs.sum_all()? + o.entropy.sum_all()?)?))?;
        let secs = t0.elapsed().as_secs_f64();
        let peak = PEAK.load(Relaxed) - base;
        println!(
            "| {policy:?} | {:.1} | {:.1} | {secs:.2} |",
            peak as f64 / (1 << 20) as f64,
            params_bytes as f64 / (1 << 20) as f64
        );
        results.push(grads);
    }
    let same = results[0].params.iter().all(|(n, g)| {
        let a: Vec<f32> = g.flatten_all().unwrap().to_vec1().unwrap();
        let b: Vec<f32> = results[1].params[n].flatten_all().unwrap().to_vec1().unwrap();
        a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits())
    });
    println!("gradients bit-identical across policies: {same}");
    if !same {
        anyhow::bail!("Recompute::Full changed the gradients");
    }
    Ok(())
}
