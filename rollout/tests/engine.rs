//! The built-in engine against the training model it shares weights and kernels with, on the HF
//! fixture models (`tests/fixtures/hf`, vocab 160, f32, CPU):
//! - greedy output = argmax decoding with the training model's full-sequence logits;
//! - the engine's log-probs = the training model's `logprobs_entropy` on prompt + completion, for
//!   the completion tokens, to <= 1e-5 (the trainer-vs-rollout log-prob gap), and they are the raw
//!   (unscaled) log-probs whatever the temperature, as vLLM's default `raw_logprobs`;
//! - seeded sampling is reproducible and independent of the batch around it;
//! - top-k 1 and a tiny top-p are greedy; stop ids end with `stop`, `max_tokens` and the context
//!   limit with `length`;
//! - one-step sampling frequencies match softmax(logits / T) (with and without top-k / top-p) by a
//!   chi-square bound at a fixed seed;
//! - weight updates from a directory or from tensors change the outputs and bump the version;
//!   mismatched checkpoints are refused with the offending tensor (or config field) named.
//!
//! Rollout tokens/s is a benchmark: `cargo bench --bench rollout_tokens_per_second`.
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::PathBuf;
use vime_kernels::testing::Rng;
use vime_qwen3::batch::PackedBatch;
use vime_qwen3::model::Qwen3;
use vime_rollout::engine::embedded::{EmbeddedEngine, EngineOptions};
use vime_rollout::engine::{FinishReason, GenOutput, GenRequest, RolloutEngine, SamplingParams};

const CASES: &[&str] = &["tied_gqa", "untied_gqa", "untied_bias"];

fn case_dir(case: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/hf")
        .join(case)
}

fn engine(case: &str) -> Result<EmbeddedEngine> {
    EmbeddedEngine::load_hf(&case_dir(case), DType::F32, &Device::Cpu)
}

fn trainer(case: &str) -> Result<Qwen3> {
    Qwen3::load_hf(&case_dir(case), DType::F32, &Device::Cpu)
}

fn random_tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| (rng.next_u64() % vocab as u64) as u32).collect()
}

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens,
        ..Default::default()
    }
}

fn sampled(temperature: f64, max_tokens: usize, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature,
        max_tokens,
        seed: Some(seed),
        ..Default::default()
    }
}

fn req(prompt: &[u32], params: SamplingParams) -> GenRequest {
    GenRequest {
        prompt_ids: prompt.to_vec(),
        params,
    }
}

fn argmax(x: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &z) in x.iter().enumerate() {
        if z > x[best] {
            best = i;
        }
    }
    best as u32
}

/// Greedy decoding by re-running the training forward on the whole sequence at every step.
fn reference_greedy(model: &Qwen3, prompt: &[u32], n: usize) -> Result<Vec<u32>> {
    let mut seq = prompt.to_vec();
    for _ in 0..n {
        let logits = model.logits(&PackedBatch::from_sequences(&[&seq])?)?;
        let last: Vec<f32> = logits.get(seq.len() - 1)?.to_vec1()?;
        seq.push(argmax(&last));
    }
    Ok(seq[prompt.len()..].to_vec())
}

/// The trainer's log-probs of each completion token (`logprobs_entropy` on prompt + completion,
/// all requests packed in one batch), and the largest |engine - trainer| over all of them.
fn trainer_logprob_gap(model: &Qwen3, reqs: &[GenRequest], outs: &[GenOutput]) -> Result<f64> {
    let seqs: Vec<Vec<u32>> = reqs
        .iter()
        .zip(outs)
        .map(|(r, o)| [r.prompt_ids.clone(), o.token_ids.clone()].concat())
        .collect();
    let batch = PackedBatch::from_sequences(&seqs)?;
    let lp: Vec<f32> = model.logprobs_entropy(&batch)?.logprobs.to_vec1()?;
    let mut worst: f64 = 0.0;
    for (s, (r, o)) in reqs.iter().zip(outs).enumerate() {
        assert_eq!(o.logprobs.len(), o.token_ids.len());
        let start = batch.seq_range(s).start;
        for (j, &got) in o.logprobs.iter().enumerate() {
            // Token j of the completion sits at position p + j; its log-prob is at p + j - 1.
            let want = lp[start + r.prompt_ids.len() + j - 1];
            worst = worst.max((got as f64 - want as f64).abs());
        }
    }
    Ok(worst)
}

#[test]
fn greedy_matches_full_sequence_argmax_and_trainer_logprobs() -> Result<()> {
    for (c, case) in CASES.iter().enumerate() {
        let (eng, model) = (engine(case)?, trainer(case)?);
        let vocab = model.config().vocab_size;
        let reqs: Vec<GenRequest> = [3usize, 12, 1, 7]
            .iter()
            .enumerate()
            .map(|(i, &l)| req(&random_tokens(l, vocab, 10 * c as u64 + i as u64), greedy(16)))
            .collect();
        let outs = eng.generate(&reqs)?;
        for (r, o) in reqs.iter().zip(&outs) {
            assert_eq!(o.token_ids, reference_greedy(&model, &r.prompt_ids, 16)?, "{case}");
            assert_eq!(o.finish_reason, FinishReason::Length);
        }
        let gap = trainer_logprob_gap(&model, &reqs, &outs)?;
        println!("{case}: greedy ok, max |engine - trainer| log-prob {gap:.3e}");
        assert!(gap <= 1e-5, "{case}: log-prob gap {gap:.3e}");
    }
    Ok(())
}

#[test]
fn sampled_logprobs_are_the_trainers_raw_logprobs() -> Result<()> {
    for (c, case) in CASES.iter().enumerate() {
        let (eng, model) = (engine(case)?, trainer(case)?);
        let vocab = model.config().vocab_size;
        let params = [
            sampled(1.0, 24, 1),
            sampled(0.6, 24, 2),
            SamplingParams {
                top_p: 0.8,
                top_k: 20,
                ..sampled(1.3, 24, 3)
            },
            SamplingParams {
                seed: None,
                ..sampled(1.0, 24, 0)
            },
        ];
        let reqs: Vec<GenRequest> = params
            .iter()
            .enumerate()
            .map(|(i, p)| {
                req(
                    &random_tokens(2 + 5 * i, vocab, 77 + c as u64 * 9 + i as u64),
                    p.clone(),
                )
            })
            .collect();
        let outs = eng.generate(&reqs)?;
        let gap = trainer_logprob_gap(&model, &reqs, &outs)?;
        println!("{case}: sampled (T = 1, 0.6, 1.3 + top-k/p), max |engine - trainer| log-prob {gap:.3e}");
        assert!(gap <= 1e-5, "{case}: log-prob gap {gap:.3e}");
    }
    Ok(())
}

#[test]
fn seeded_sampling_is_reproducible_and_independent_of_the_batch() -> Result<()> {
    let eng = engine("untied_bias")?;
    let vocab = 160;
    let target = req(
        &random_tokens(6, vocab, 5),
        SamplingParams {
            top_p: 0.95,
            ..sampled(1.0, 40, 42)
        },
    );
    let alone = eng.generate(std::slice::from_ref(&target))?.remove(0);
    assert_eq!(
        eng.generate(std::slice::from_ref(&target))?.remove(0),
        alone,
        "same request, same output"
    );
    let others: Vec<GenRequest> = (0..7)
        .map(|i| {
            req(
                &random_tokens(1 + 3 * i, vocab, 300 + i as u64),
                sampled(1.0, 5 + 9 * i, 1000 + i as u64),
            )
        })
        .collect();
    // The target first, in the middle and last; and with only 2 sequences at a time, so it waits
    // in the queue and then shares steps with other mixes of prefill and decode.
    let mut placements = Vec::new();
    for at in [0, 4, 7] {
        let mut reqs = others.clone();
        reqs.insert(at, target.clone());
        placements.push((at, reqs, EngineOptions::default()));
    }
    let mut reqs = others.clone();
    reqs.insert(5, target.clone());
    placements.push((
        5,
        reqs,
        EngineOptions {
            max_num_seqs: 2,
            ..Default::default()
        },
    ));
    let model = trainer("untied_bias")?;
    for (at, reqs, opts) in placements {
        let eng = EmbeddedEngine::new(trainer("untied_bias")?, opts)?;
        let outs = eng.generate(&reqs)?;
        let got = &outs[at];
        assert_eq!(got.token_ids, alone.token_ids, "target at {at}");
        assert_eq!(got.finish_reason, alone.finish_reason);
        let d = got
            .logprobs
            .iter()
            .zip(&alone.logprobs)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(d <= 1e-5, "target at {at}: log-probs differ by {d:e}");
        assert!(trainer_logprob_gap(&model, &reqs, &outs)? <= 1e-5);
    }
    // A different seed gives a different completion (40 tokens at T = 1 over 160 ids).
    let other_seed = req(
        &target.prompt_ids,
        SamplingParams {
            seed: Some(43),
            ..target.params.clone()
        },
    );
    assert_ne!(eng.generate(&[other_seed])?[0].token_ids, alone.token_ids);
    Ok(())
}

/// A KV cache too small for every request at once (`EngineOptions::kv_cache_tokens`): requests
/// wait for room, running sequences are preempted and recomputed from prompt + tokens, and every
/// output (tokens, log-probs, finish) is what the unlimited engine gives, the log-probs still the
/// trainer's. A request that could never fit is refused up front, naming it.
#[test]
fn a_full_kv_cache_preempts_and_recomputes_with_the_same_outputs() -> Result<()> {
    let vocab = 160;
    let reqs: Vec<GenRequest> = (0..6)
        .map(|i| {
            req(
                &random_tokens(10 + 3 * i, vocab, 700 + i as u64),
                sampled(1.0, 30 + 4 * i, 900 + i as u64),
            )
        })
        .collect();
    let free = EmbeddedEngine::new(trainer("tied_gqa")?, EngineOptions::default())?;
    let want = free.generate(&reqs)?;
    assert_eq!(free.preemptions(), 0);
    // 10 pages of 16 tokens: one kept for padding, and each request needs 3-5 pages by its end.
    let opts = EngineOptions {
        kv_cache_tokens: Some(160),
        ..Default::default()
    };
    let small = EmbeddedEngine::new(trainer("tied_gqa")?, opts)?;
    let got = small.generate(&reqs)?;
    assert!(small.preemptions() > 0, "the cache never ran full");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.token_ids, w.token_ids, "request {i}");
        assert_eq!(g.finish_reason, w.finish_reason, "request {i}");
        let d = g
            .logprobs
            .iter()
            .zip(&w.logprobs)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(d <= 1e-5, "request {i}: log-probs differ by {d:e}");
    }
    assert!(trainer_logprob_gap(&trainer("tied_gqa")?, &reqs, &got)? <= 1e-5);
    // 3 pages, one for padding: a 10-token prompt with 30 new tokens can never fit.
    let tiny = EmbeddedEngine::new(
        trainer("tied_gqa")?,
        EngineOptions {
            kv_cache_tokens: Some(48),
            ..Default::default()
        },
    )?;
    let e = tiny.generate(&reqs[..1]).unwrap_err().to_string();
    assert!(e.contains("request 0") && e.contains("48-token cache"), "{e}");
    Ok(())
}

#[test]
fn top_k_one_and_tiny_top_p_are_greedy() -> Result<()> {
    for case in CASES {
        let eng = engine(case)?;
        let prompts: Vec<Vec<u32>> = (0..3).map(|i| random_tokens(4 + i, 160, 500 + i as u64)).collect();
        let run = |p: SamplingParams| -> Result<Vec<Vec<u32>>> {
            let reqs: Vec<GenRequest> = prompts.iter().map(|pr| req(pr, p.clone())).collect();
            Ok(eng.generate(&reqs)?.into_iter().map(|o| o.token_ids).collect())
        };
        let want = run(greedy(20))?;
        assert_eq!(
            run(SamplingParams {
                top_k: 1,
                ..sampled(1.0, 20, 9)
            })?,
            want,
            "{case} top-k 1"
        );
        assert_eq!(
            run(SamplingParams {
                top_p: 1e-6,
                ..sampled(1.5, 20, 9)
            })?,
            want,
            "{case} top-p 1e-6"
        );
    }
    Ok(())
}

#[test]
fn stop_ids_max_tokens_and_context_limit() -> Result<()> {
    let eng = engine("tied_gqa")?;
    let prompt = random_tokens(5, 160, 3);
    let free = eng.generate(&[req(&prompt, greedy(30))])?.remove(0);
    assert_eq!((free.token_ids.len(), free.finish_reason), (30, FinishReason::Length));
    // Stop at the first occurrence of the 4th generated token; the stop id is kept.
    let stop = free.token_ids[3];
    let first = free.token_ids.iter().position(|&t| t == stop).unwrap();
    let params = SamplingParams {
        stop_token_ids: vec![999, stop],
        ..greedy(30)
    };
    let out = eng.generate(&[req(&prompt, params)])?.remove(0);
    assert_eq!(out.token_ids, free.token_ids[..=first].to_vec());
    assert_eq!(out.finish_reason, FinishReason::Stop);
    // An EOS id set on the engine stops every request.
    let eos_engine = EmbeddedEngine::new(
        trainer("tied_gqa")?,
        EngineOptions {
            eos_token_ids: vec![stop],
            ..Default::default()
        },
    )?;
    let out = eos_engine.generate(&[req(&prompt, greedy(30))])?.remove(0);
    assert_eq!(
        (out.token_ids.len(), out.finish_reason),
        (first + 1, FinishReason::Stop)
    );
    // max_tokens.
    let out = eng.generate(&[req(&prompt, greedy(7))])?.remove(0);
    assert_eq!(
        (out.token_ids, out.finish_reason),
        (free.token_ids[..7].to_vec(), FinishReason::Length)
    );
    // Context: prompt + output may reach max_position_embeddings, not pass it.
    let max_pos = eng.config()?.max_position_embeddings;
    let long = random_tokens(max_pos - 3, 160, 4);
    let out = eng.generate(&[req(&long, greedy(10)), req(&prompt, greedy(10))])?;
    assert_eq!(
        (out[0].token_ids.len(), out[0].finish_reason),
        (3, FinishReason::Length)
    );
    assert_eq!(out[1].token_ids, free.token_ids[..10].to_vec());
    // Refused requests name themselves.
    let bad = |r: GenRequest| format!("{:#}", eng.generate(&[req(&prompt, greedy(1)), r]).unwrap_err());
    assert!(bad(req(&[], greedy(4))).contains("request 1: empty prompt"));
    assert!(bad(req(&random_tokens(max_pos, 160, 1), greedy(4))).contains("max_position_embeddings"));
    assert!(bad(req(&[1, 160], greedy(4))).contains("token 160"));
    assert!(bad(req(
        &prompt,
        SamplingParams {
            top_p: 0.0,
            ..greedy(4)
        }
    ))
    .contains("top_p"));
    assert!(bad(req(&prompt, greedy(0))).contains("max_tokens"));
    Ok(())
}

/// Chi-square statistic of `counts` against `probs` (bins with expected count < 5 pooled), and
/// its degrees of freedom.
fn chi_square(counts: &[usize], probs: &[f64]) -> (f64, usize) {
    let n: usize = counts.iter().sum();
    let (mut chi, mut df) = (0.0, 0usize);
    let (mut pooled_obs, mut pooled_exp) = (0.0, 0.0);
    for (&c, &p) in counts.iter().zip(probs) {
        let e = p * n as f64;
        if e >= 5.0 {
            chi += (c as f64 - e).powi(2) / e;
            df += 1;
        } else {
            pooled_obs += c as f64;
            pooled_exp += e;
        }
    }
    if pooled_exp > 0.0 {
        chi += (pooled_obs - pooled_exp).powi(2) / pooled_exp.max(1e-9);
        df += 1;
    }
    (chi, df.saturating_sub(1))
}

/// softmax(logits / T), then vLLM's top-k (ties kept) and top-p, renormalised: an independent
/// reference for the engine's sampler.
fn reference_probs(logits: &[f32], t: f64, top_k: usize, top_p: f64) -> Vec<f64> {
    let mut order: Vec<usize> = (0..logits.len()).collect();
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
    let kth = logits[order[top_k.min(logits.len()) - 1]];
    let m = logits[order[0]] as f64 / t;
    let mut w: Vec<f64> = logits
        .iter()
        .map(|&z| if z >= kth { (z as f64 / t - m).exp() } else { 0.0 })
        .collect();
    let total: f64 = w.iter().sum();
    let mut before = 0.0;
    for &i in &order {
        if before >= top_p * total && before > 0.0 {
            w[i] = 0.0;
        }
        before += w[i];
    }
    let total: f64 = w.iter().sum();
    w.iter().map(|x| x / total).collect()
}

#[test]
fn one_step_sampling_frequencies_match_the_distribution() -> Result<()> {
    let (eng, model) = (engine("untied_gqa")?, trainer("untied_gqa")?);
    let prompt = random_tokens(9, 160, 11);
    let logits: Vec<f32> = model
        .logits(&PackedBatch::from_sequences(&[&prompt])?)?
        .get(prompt.len() - 1)?
        .to_vec1()?;
    let n = 6000;
    for (t, top_k, top_p) in [(1.0, -1i64, 1.0), (0.7, -1, 1.0), (1.0, 12, 0.85)] {
        let params = SamplingParams {
            temperature: t,
            top_k,
            top_p,
            max_tokens: 1,
            ..Default::default()
        };
        let reqs: Vec<GenRequest> = (0..n)
            .map(|i| {
                req(
                    &prompt,
                    SamplingParams {
                        seed: Some(7_000 + i as u64),
                        ..params.clone()
                    },
                )
            })
            .collect();
        let mut counts = vec![0usize; 160];
        for o in eng.generate(&reqs)? {
            counts[o.token_ids[0] as usize] += 1;
        }
        let k = if top_k > 0 { top_k as usize } else { 160 };
        let probs = reference_probs(&logits, t, k, top_p);
        let outside: usize = counts
            .iter()
            .zip(&probs)
            .filter(|(_, &p)| p == 0.0)
            .map(|(&c, _)| c)
            .sum();
        assert_eq!(
            outside, 0,
            "T {t} top-k {top_k} top-p {top_p}: samples outside the support"
        );
        let (chi, df) = chi_square(&counts, &probs);
        let bound = df as f64 + 5.0 * (2.0 * df as f64).sqrt();
        println!("T {t} top-k {top_k} top-p {top_p}: chi2 {chi:.1} on {df} df (bound {bound:.1})");
        assert!(chi < bound, "chi2 {chi:.1} >= {bound:.1} on {df} df");
    }
    Ok(())
}

#[test]
fn weight_updates_swap_outputs_and_bump_the_version() -> Result<()> {
    let eng = engine("tied_gqa")?;
    let original = trainer("tied_gqa")?;
    let cfg = original.config().clone();
    let prompts: Vec<Vec<u32>> = (0..3).map(|i| random_tokens(3 + 4 * i, 160, 40 + i as u64)).collect();
    let reqs: Vec<GenRequest> = prompts.iter().map(|p| req(p, greedy(12))).collect();
    let before = eng.generate(&reqs)?;
    assert_eq!(eng.weight_version(), 0);

    // A different checkpoint of the same shapes.
    let tmp = tempfile::tempdir()?;
    let other = Qwen3::init_random(cfg.clone(), 0.3, 12345, DType::F32, &Device::Cpu)?;
    other.save_hf(tmp.path(), DType::F32, u64::MAX)?;
    eng.update_weights_from_dir(tmp.path())?;
    assert_eq!(eng.weight_version(), 1);
    let after = eng.generate(&reqs)?;
    assert_ne!(after, before);
    for (r, o) in reqs.iter().zip(&after) {
        assert_eq!(o.token_ids, reference_greedy(&other, &r.prompt_ids, 12)?);
    }
    assert!(trainer_logprob_gap(&other, &reqs, &after)? <= 1e-5);

    // A checkpoint of another shape is refused, naming the tensors; nothing changes.
    let err = format!(
        "{:#}",
        eng.update_weights_from_dir(&case_dir("untied_gqa")).unwrap_err()
    );
    println!("mismatched checkpoint: {err}");
    assert!(err.contains("model.layers.0.self_attn.k_proj.weight"), "{err}");
    assert!(err.contains("model.layers.2.mlp.up_proj.weight"), "{err}");
    assert_eq!(eng.weight_version(), 1);
    assert_eq!(eng.generate(&reqs)?, after);

    // Same shapes, different architecture (rope_theta): refused by config field.
    let tmp2 = tempfile::tempdir()?;
    let mut cfg2 = cfg.clone();
    cfg2.rope_theta = 5e5;
    Qwen3::init_random(cfg2, 0.3, 1, DType::F32, &Device::Cpu)?.save_hf(tmp2.path(), DType::F32, u64::MAX)?;
    let err = format!("{:#}", eng.update_weights_from_dir(tmp2.path()).unwrap_err());
    assert!(err.contains("rope_theta"), "{err}");
    assert_eq!(eng.weight_version(), 1);

    // In-process update from tensors (bf16 in, converted to the engine's f32): back to the
    // original weights up to bf16 rounding, so use the exact f32 ones for the output check.
    let mut tensors: BTreeMap<String, Tensor> = original.state_dict();
    eng.update_weights(&tensors)?;
    assert_eq!(eng.weight_version(), 2);
    assert_eq!(eng.generate(&reqs)?, before);
    let bf16: BTreeMap<String, Tensor> = tensors
        .iter()
        .map(|(n, t)| Ok((n.clone(), t.to_dtype(DType::BF16)?)))
        .collect::<Result<_>>()?;
    eng.update_weights(&bf16)?;
    assert_eq!(eng.weight_version(), 3);
    // Wrong shape / unknown / missing tensors are refused by name.
    tensors.insert("model.norm.weight".into(), Tensor::zeros(3, DType::F32, &Device::Cpu)?);
    let err = format!("{:#}", eng.update_weights(&tensors).unwrap_err());
    assert!(err.contains("model.norm.weight") && err.contains("[64]"), "{err}");
    tensors.remove("model.norm.weight");
    tensors.insert(
        "lm_head.weight".into(),
        Tensor::zeros((160, 64), DType::F32, &Device::Cpu)?,
    );
    let err = format!("{:#}", eng.update_weights(&tensors).unwrap_err());
    assert!(
        err.contains("missing tensor model.norm.weight") && err.contains("unexpected tensor lm_head.weight"),
        "{err}"
    );
    assert_eq!(eng.weight_version(), 3);
    Ok(())
}

/// bf16 weights and KV cache: the engine runs, and its log-probs track the bf16 trainer's (same
/// dtype, same kernels; the two forwards round differently, so the bound is bf16-sized).
#[test]
fn bf16_engine_tracks_the_bf16_trainer() -> Result<()> {
    let dir = case_dir("untied_bias");
    let eng = EmbeddedEngine::load_hf(&dir, DType::BF16, &Device::Cpu)?;
    let model = Qwen3::load_hf(&dir, DType::BF16, &Device::Cpu)?;
    let reqs: Vec<GenRequest> = (0..4)
        .map(|i| {
            req(
                &random_tokens(3 + 2 * i, 160, 60 + i as u64),
                sampled(1.0, 16, i as u64),
            )
        })
        .collect();
    let outs = eng.generate(&reqs)?;
    let gap = trainer_logprob_gap(&model, &reqs, &outs)?;
    println!("bf16: max |engine - trainer| log-prob {gap:.3e}");
    assert!(gap <= 1e-2, "bf16 log-prob gap {gap:.3e}");
    Ok(())
}

/// `GenControl::abort` stops a running call at its next step: every request comes back with
/// `Abort` and a prefix of what it would have generated (seeded, so the uncut run is the
/// reference), long before `max_tokens`. The test aborts once the engine has done 5 steps (its
/// step counter, not wall time); the requests ask for 480 tokens.
#[test]
fn abort_stops_a_running_generate_between_steps() -> Result<()> {
    use vime_rollout::engine::GenControl;
    let eng = engine("tied_gqa")?;
    let reqs: Vec<GenRequest> = (0..3)
        .map(|i| {
            req(
                &random_tokens(4 + i, 160, 90 + i as u64),
                sampled(1.0, 480, 7 + i as u64),
            )
        })
        .collect();
    let control = GenControl::default();
    let cut = std::thread::scope(|s| {
        let h = s.spawn(|| eng.generate_with(&reqs, &control));
        while control.steps() < 5 && !h.is_finished() {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        control.abort();
        h.join().expect("generate panicked")
    })?;
    let full = eng.generate(&reqs)?;
    for (i, (c, f)) in cut.iter().zip(&full).enumerate() {
        assert_eq!(c.finish_reason, FinishReason::Abort, "request {i}");
        let n = c.token_ids.len();
        assert!((5..480).contains(&n), "request {i}: {n} tokens after the abort");
        assert_eq!(
            c.token_ids[..],
            f.token_ids[..n],
            "request {i}: not a prefix of the uncut run"
        );
        assert_eq!(c.logprobs[..], f.logprobs[..n], "request {i}");
    }
    // Aborted before the first step: nothing generated.
    let control = GenControl::default();
    control.abort();
    let none = eng.generate_with(&reqs, &control)?;
    assert!(none
        .iter()
        .all(|o| o.token_ids.is_empty() && o.finish_reason == FinishReason::Abort));
    Ok(())
}

/// `--true-on-policy-mode` (the kernel config's batch-invariant flag): the engine's log-probs are
/// the trainer's bit for bit, f32 and bf16, greedy and sampled (plain and top-k/top-p rows), with
/// requests of different lengths decoding together. The CPU kernels are batch-invariant already;
/// the mode makes the engine run the trainer's op sequence (separate q/k/v, norm and rope; the
/// packed attention over gathered keys) and score with the trainer's LM-head kernel. The GPU half
/// is `kernels/tests/cuda_vs_cpu.rs::true_on_policy_kernels_on_cuda` and
/// `scripts/gpu/true_on_policy.sh`.
#[test]
fn true_on_policy_mode_logprobs_equal_the_trainers_bit_for_bit() -> Result<()> {
    let inv = vime_kernels::KernelConfig::default().with_batch_invariant(true);
    for (case, dtype) in [
        ("untied_bias", DType::BF16),
        ("tied_gqa", DType::F32),
        ("untied_gqa", DType::BF16),
    ] {
        let dir = case_dir(case);
        let mut model = Qwen3::load_hf(&dir, dtype, &Device::Cpu)?;
        model.set_kernel_config(inv.clone());
        let mut served = Qwen3::load_hf(&dir, dtype, &Device::Cpu)?;
        served.set_kernel_config(inv.clone());
        let eng = EmbeddedEngine::new(served, EngineOptions::for_config(model.config()))?;
        let vocab = model.config().vocab_size;
        let reqs: Vec<GenRequest> = (0..5)
            .map(|i| {
                let params = match i {
                    0 => greedy(20),
                    4 => SamplingParams {
                        top_p: 0.8,
                        top_k: 20,
                        ..sampled(1.3, 20, 4)
                    },
                    _ => sampled(1.0, 20, i as u64),
                };
                req(&random_tokens(2 + 4 * i, vocab, 90 + i as u64), params)
            })
            .collect();
        let outs = eng.generate(&reqs)?;
        let gap = trainer_logprob_gap(&model, &reqs, &outs)?;
        println!("{case} {dtype:?} --true-on-policy-mode: max |engine - trainer| log-prob {gap:e}");
        assert_eq!(gap, 0.0, "{case} {dtype:?}: log-prob gap {gap:e}");
    }
    Ok(())
}
