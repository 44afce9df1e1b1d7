//! The forward-only pass in query chunks (`Block::forward_chunked`, what a long scoring pass runs
//! at TP 1) against the whole-batch forward on the HF fixtures: chunk sizes that cut sequences,
//! span several, and leave a one-token sequence alone give the same log-probs and entropy.
use candle_core::{DType, Device};
use std::path::Path;
use vime_kernels::testing::rel_err;
use vime_qwen3::batch::PackedBatch;
use vime_qwen3::checkpoint::{load_config, load_hf_weights};
use vime_qwen3::model::Qwen3;

#[test]
fn chunked_scoring_equals_the_whole_batch_forward() {
    let b = PackedBatch::from_sequences(&[
        vec![3u32, 7, 9, 11, 4, 5, 6],
        vec![8, 2, 30],
        vec![12, 13, 14, 15, 16, 39, 1, 2, 3, 4, 5],
        vec![21],
        vec![1, 2, 3, 4, 5, 6, 7, 8],
    ])
    .unwrap();
    for name in ["tied_gqa", "untied_bias"] {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/hf")
            .join(name);
        let cfg = load_config(&dir).unwrap();
        let w = load_hf_weights(&dir, &cfg, DType::F32, &Device::Cpu).unwrap();
        let mut m = Qwen3::from_tensors(cfg, w).unwrap();
        m.set_forward_chunk_tokens(1 << 20);
        let whole = m.logprobs_entropy(&b).unwrap();
        for chunk in [1usize, 4, 5, 7, 29] {
            m.set_forward_chunk_tokens(chunk);
            let c = m.logprobs_entropy(&b).unwrap();
            let (el, ee) = (
                rel_err(&c.logprobs, &whole.logprobs).unwrap(),
                rel_err(&c.entropy, &whole.entropy).unwrap(),
            );
            assert!(
                el < 1e-5 && ee < 1e-5,
                "{name} chunk {chunk}: logprobs {el:e}, entropy {ee:e}"
            );
        }
    }
}
