//! The KV-cache inference forward against the training forward, on the HF fixture models
//! (`tests/fixtures/hf`, vocab 160): prefill a prompt, decode the rest one token at a time, and
//! the logits at every position equal `Qwen3::logits` on the whole sequence (norm-wise relative
//! error per row <= 1e-5 in f32, <= 1e-12 in f64). Batched calls (sequences of different lengths,
//! prefill and decode mixed in one call) give what one sequence at a time gives.
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use std::path::PathBuf;
use vime_kernels::testing::{rel_err, Rng};
use vime_qwen3::batch::PackedBatch;
use vime_qwen3::infer::{HiddenRows, KvCache};
use vime_qwen3::model::Qwen3;

const CASES: &[&str] = &["tied_gqa", "untied_gqa", "untied_bias"];

fn load(case: &str, dtype: DType) -> Result<Qwen3> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/hf")
        .join(case);
    Qwen3::load_hf(&dir, dtype, &Device::Cpu)
}

fn random_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| (rng.next_u64() % vocab as u64) as u32).collect()
}

/// Full-sequence logits of the training forward, `[L, vocab]`.
fn full_logits(model: &Qwen3, seq: &[u32]) -> Result<Tensor> {
    model.logits(&PackedBatch::from_sequences(&[seq])?)
}

/// Largest per-row relative error between `got` rows and `want` rows.
fn max_row_err(got: &Tensor, want: &Tensor) -> Result<f64> {
    let mut worst: f64 = 0.0;
    for r in 0..want.dim(0)? {
        worst = worst.max(rel_err(&got.get(r)?, &want.get(r)?)?);
    }
    Ok(worst)
}

/// Prefills `prompt_len` tokens (all rows returned), decodes the rest one by one; returns the
/// cache-path final-normed hidden states of every position, `[L, hidden]`.
fn cached_hidden(model: &Qwen3, seq: &[u32], prompt_len: usize) -> Result<Tensor> {
    let mut cache = model.new_kv_cache();
    let mut rows = vec![model.forward_with_cache(&[(7, &seq[..prompt_len])], &mut cache, HiddenRows::All)?];
    for (i, &tok) in seq.iter().enumerate().skip(prompt_len) {
        assert_eq!(cache.seq_len(7), i);
        rows.push(model.decode(&[(7, tok)], &mut cache)?);
    }
    assert_eq!(cache.seq_len(7), seq.len());
    assert!(
        rows.iter().all(|r| !r.track_op()),
        "the inference forward must not build a graph"
    );
    Ok(Tensor::cat(&rows, 0)?)
}

/// Logits in f32 (as `Qwen3::logits` computes them); hidden states in the model's dtype, so the
/// f64 run is a tight check of the layer math (f64 logits would be rounded to f32 first).
#[test]
fn prefill_then_decode_matches_training_forward() -> Result<()> {
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::F64, 1e-12)] {
        for (c, case) in CASES.iter().enumerate() {
            let model = load(case, dtype)?;
            let seq = random_tokens(40, model.config().vocab_size, 100 + c as u64);
            let batch = PackedBatch::from_sequences(&[&seq])?;
            let want_h = model.hidden_states(&batch)?;
            let want_logits = model.logits(&batch)?;
            for prompt_len in [1, 9, 33] {
                let got_h = cached_hidden(&model, &seq, prompt_len)?;
                let err_h = max_row_err(&got_h, &want_h)?;
                let err_l = max_row_err(&model.logits_from_hidden(&got_h)?, &want_logits)?;
                println!(
                    "{case} {dtype:?} prompt {prompt_len}: max row rel err hidden {err_h:.3e}, logits {err_l:.3e}"
                );
                assert!(
                    err_h <= tol,
                    "{case} {dtype:?} prompt {prompt_len}: hidden {err_h:.3e} > {tol:e}"
                );
                assert!(
                    err_l <= 1e-5,
                    "{case} {dtype:?} prompt {prompt_len}: logits {err_l:.3e} > 1e-5"
                );
            }
        }
    }
    Ok(())
}

#[test]
fn batched_calls_equal_one_sequence_at_a_time() -> Result<()> {
    for (c, case) in CASES.iter().enumerate() {
        let model = load(case, DType::F32)?;
        let vocab = model.config().vocab_size;
        let lens = [5usize, 17, 2, 11];
        let seqs: Vec<Vec<u32>> = lens
            .iter()
            .enumerate()
            .map(|(s, &l)| random_tokens(l + 8, vocab, 1000 * c as u64 + s as u64))
            .collect();
        // Reference: each sequence alone (prefill its prompt, then decode), last-row hidden states.
        let mut solo: Vec<Vec<Tensor>> = Vec::new();
        for (s, seq) in seqs.iter().enumerate() {
            let mut cache = model.new_kv_cache();
            let mut out = vec![model.prefill(&[(s, &seq[..lens[s]])], &mut cache)?];
            for &tok in &seq[lens[s]..] {
                out.push(model.decode(&[(s, tok)], &mut cache)?);
            }
            solo.push(out);
        }
        // Batched: the first three prefill together, the fourth joins one step later (its prompt
        // in the same call as the others' first decode token), then everyone decodes together.
        // Slot ids are not the sequence indices, to show they are just names.
        let slot = |s: usize| 40 + 3 * s;
        let mut cache = model.new_kv_cache();
        let mut got: Vec<Vec<Tensor>> = vec![Vec::new(); seqs.len()];
        let h = model.prefill(
            &(0..3).map(|s| (slot(s), &seqs[s][..lens[s]])).collect::<Vec<_>>(),
            &mut cache,
        )?;
        for (s, g) in got.iter_mut().enumerate().take(3) {
            g.push(h.get(s)?);
        }
        let mut step = 0;
        loop {
            let mut call: Vec<(usize, &[u32])> = Vec::new();
            let mut who = Vec::new();
            for s in 0..seqs.len() {
                if s == 3 && step == 0 {
                    call.push((slot(s), &seqs[s][..lens[s]]));
                    who.push(s);
                } else if !got[s].is_empty() && got[s].len() < solo[s].len() {
                    let pos = lens[s] + got[s].len() - 1;
                    call.push((slot(s), &seqs[s][pos..pos + 1]));
                    who.push(s);
                }
            }
            if call.is_empty() {
                break;
            }
            let h = model.forward_with_cache(&call, &mut cache, HiddenRows::Last)?;
            for (row, &s) in who.iter().enumerate() {
                got[s].push(h.get(row)?);
            }
            step += 1;
        }
        let mut worst: f64 = 0.0;
        let mut bitwise = true;
        for s in 0..seqs.len() {
            assert_eq!(got[s].len(), solo[s].len(), "{case} seq {s}");
            assert_eq!(cache.seq_len(slot(s)), seqs[s].len());
            for (a, b) in got[s].iter().zip(&solo[s]) {
                let a = a.flatten_all()?;
                let b = b.flatten_all()?;
                worst = worst.max(rel_err(&a, &b)?);
                bitwise &= a.to_vec1::<f32>()? == b.to_vec1::<f32>()?;
            }
        }
        println!("{case}: batched vs one at a time, max rel err {worst:.3e}, bitwise equal: {bitwise}");
        assert!(
            worst <= 1e-5,
            "{case}: batched differs from one at a time by {worst:.3e}"
        );
    }
    Ok(())
}

#[test]
fn freed_slot_is_reused_and_growth_keeps_the_past() -> Result<()> {
    let model = load("untied_bias", DType::F32)?;
    let vocab = model.config().vocab_size;
    let a = random_tokens(50, vocab, 1);
    let b = random_tokens(30, vocab, 2);
    let mut cache = model.new_kv_cache();
    // Growth: 50 tokens one by one cross several capacity doublings (16, 32, 64).
    let mut last = model.prefill(&[(0, &a[..1])], &mut cache)?;
    for &t in &a[1..] {
        last = model.decode(&[(0, t)], &mut cache)?;
    }
    let want_a = full_logits(&model, &a)?.get(a.len() - 1)?;
    let got_a = model.logits_from_hidden(&last)?.get(0)?;
    assert!(rel_err(&got_a, &want_a)? <= 1e-5);
    assert!(cache.allocated_bytes() >= 50 * cache.bytes_per_token());
    cache.free(0);
    assert_eq!(cache.seq_len(0), 0);
    assert_eq!(cache.num_slots(), 0);
    let h = model.prefill(&[(0, &b)], &mut cache)?;
    let want_b = full_logits(&model, &b)?.get(b.len() - 1)?;
    assert!(rel_err(&model.logits_from_hidden(&h)?.get(0)?, &want_b)? <= 1e-5);
    Ok(())
}

#[test]
fn bad_calls_are_refused() -> Result<()> {
    let model = load("tied_gqa", DType::F32)?;
    let max_pos = model.config().max_position_embeddings;
    let mut cache = model.new_kv_cache();
    let msg = |r: Result<Tensor>| format!("{:#}", r.expect_err("must fail"));
    assert!(msg(model.prefill(&[(1, &[3, 4]), (1, &[5])], &mut cache)).contains("slot 1 appears twice"));
    assert!(msg(model.prefill(&[(1, &[])], &mut cache)).contains("no new tokens"));
    assert!(msg(model.prefill(&[(1, &[3, 999])], &mut cache)).contains("token 999"));
    let long = vec![1u32; max_pos + 1];
    assert!(msg(model.prefill(&[(2, &long)], &mut cache)).contains("max_position_embeddings"));
    let mut wrong = KvCache::new(model.config(), DType::F64, &Device::Cpu);
    assert!(msg(model.prefill(&[(1, &[3])], &mut wrong)).contains("F64"));
    let other = load("untied_gqa", DType::F32)?;
    assert!(msg(model.prefill(&[(1, &[3])], &mut other.new_kv_cache())).contains("layers, kv heads"));
    // A refused call leaves the cache untouched.
    assert_eq!(cache.seq_len(1), 0);
    Ok(())
}

/// The padded decode of the CUDA-graph path ([`Qwen3::decode_graphed`], run eagerly on the CPU)
/// gives every real sequence what [`Qwen3::decode`] gives it, step after step, as the batch
/// shrinks through padded sizes (11 -> 16, 9 -> 16, 5 -> 8, 3 -> 4, 1) and sequences of
/// different lengths share the pool with the padding's spare row; with and without the fused
/// q|k|v and gate|up weights ([`Qwen3::decode_weights`]; the bias case has none).
#[test]
fn graphed_decode_equals_decode() -> Result<()> {
    use vime_qwen3::infer::{graph_batch, DecodeGraphs};
    for (dtype, tol, fuse) in [
        (DType::F32, 1e-5, false),
        (DType::F64, 1e-12, false),
        (DType::F32, 1e-5, true),
        (DType::F64, 1e-12, true),
    ] {
        for case in CASES {
            let model = load(case, dtype)?;
            // Graphs capture only on CUDA (bf16, head_dim 128): here the padded path runs eagerly.
            assert!(!model.graph_safe());
            let fused = if fuse { model.decode_weights()? } else { None };
            assert_eq!(fused.is_some(), fuse && *case != "untied_bias", "{case}");
            if let Some(f) = &fused {
                let c = model.config();
                let per_layer = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim * c.hidden_size
                    + 2 * c.intermediate_size * c.hidden_size;
                assert_eq!(f.bytes(), c.num_hidden_layers * per_layer * dtype.size_in_bytes());
            }
            let vocab = model.config().vocab_size;
            let (mut plain, mut padded) = (model.new_kv_cache(), model.new_kv_cache());
            let mut graphs = DecodeGraphs::new(true);
            let slots: Vec<usize> = (0..11).map(|i| 3 * i + 1).collect();
            let prompts: Vec<Vec<u32>> = slots
                .iter()
                .map(|&s| random_tokens(1 + (s * 7) % 23, vocab, s as u64))
                .collect();
            let seqs: Vec<(usize, &[u32])> = slots.iter().zip(&prompts).map(|(&s, p)| (s, p.as_slice())).collect();
            model.forward_with_cache(&seqs, &mut plain, HiddenRows::Last)?;
            model.forward_with_cache(&seqs, &mut padded, HiddenRows::Last)?;
            let mut live = slots.clone();
            let mut steps = 0;
            for (round, keep) in [11usize, 11, 9, 9, 5, 3, 3, 1, 1].into_iter().enumerate() {
                for s in live.split_off(keep) {
                    plain.free(s);
                    padded.free(s);
                }
                let toks: Vec<(usize, u32)> = live
                    .iter()
                    .map(|&s| (s, ((s * 31 + round * 17) % vocab) as u32))
                    .collect();
                let want = model.decode(&toks, &mut plain)?;
                let got = model.decode_graphed(&toks, &mut padded, &mut graphs, fused.as_ref())?;
                steps += 1;
                assert_eq!(got.dims(), want.dims(), "{case} round {round}");
                let err = max_row_err(&got, &want)?;
                assert!(
                    err <= tol,
                    "{case} {dtype:?} round {round} ({keep} sequences): err {err}"
                );
                for &s in &live {
                    assert_eq!(padded.seq_len(s), plain.seq_len(s), "{case} slot {s}");
                }
            }
            // On the CPU nothing is captured: every step ran the padded forward eagerly.
            assert_eq!(
                (graphs.stats.eager, graphs.stats.captures, graphs.live()),
                (steps, 0, 0)
            );
        }
    }
    assert_eq!(
        [1, 2, 3, 5, 8, 9, 16, 17, 64, 250, 256, 257, 300].map(graph_batch),
        [1, 2, 4, 8, 8, 16, 16, 24, 64, 256, 256, 288, 320]
    );
    Ok(())
}

/// A limited cache (`KvCache::set_max_tokens`): the pools are allocated at the limit on first
/// use (never doubled past it), `available_pages` counts what is left (one page kept for the
/// decode graphs' padding row), a `reserve` past the limit is refused naming the sequence and
/// changes nothing, freed pages come back, and a forward over the cached rows still matches the
/// training forward.
#[test]
fn a_limited_cache_allocates_once_and_refuses_past_its_limit() -> Result<()> {
    let model = load("tied_gqa", DType::F32)?;
    let mut cache = model.new_kv_cache();
    cache.set_max_tokens(Some(100)); // 6 pages of 16
    assert_eq!(cache.max_tokens(), Some(96));
    assert_eq!(cache.available_pages(), 5);
    let seq = random_tokens(40, 160, 11);
    model.forward_with_cache(&[(1, &seq[..])], &mut cache, HiddenRows::Last)?;
    assert_eq!(
        cache.allocated_bytes(),
        96 * cache.bytes_per_token(),
        "allocated at the limit"
    );
    assert_eq!(cache.available_pages(), 2, "3 pages for 40 tokens, 1 kept for padding");
    assert_eq!(cache.pages_short(2, 33), 3);
    let e = cache.reserve(2, 33).unwrap_err().to_string();
    assert!(e.contains("KV cache full: sequence 2 needs 3 more pages"), "{e}");
    assert_eq!(cache.num_slots(), 1, "a refused reserve creates nothing");
    assert_eq!(cache.available_pages(), 2);
    cache.reserve(2, 32)?;
    assert_eq!(cache.available_pages(), 0);
    cache.free(1);
    assert_eq!(cache.available_pages(), 3);
    // Decoding on after the refusals gives the training forward's logits.
    let mut rows = Vec::new();
    let mut cache2 = model.new_kv_cache();
    cache2.set_max_tokens(Some(100));
    rows.push(model.forward_with_cache(&[(1, &seq[..30])], &mut cache2, HiddenRows::All)?);
    for &tok in &seq[30..] {
        rows.push(model.decode(&[(1, tok)], &mut cache2)?);
    }
    let got = model.logits_from_hidden(&Tensor::cat(&rows, 0)?)?;
    let err = max_row_err(&got, &full_logits(&model, &seq)?)?;
    assert!(err <= 1e-5, "rel err {err}");
    Ok(())
}
