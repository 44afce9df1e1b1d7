//! The whole model under tensor parallelism, with and without sequence parallelism, on real CPU-backend groups
//! (threads), against the same model at TP = 1, on the HF fixtures (tied embeddings + GQA; untied
//! with q/k/v/o biases) at TP = 2 and a random model with 4 KV heads at TP = 4: log-probs and
//! entropy (scoring), the loss, and every parameter gradient of a forward_backward, compared by HF
//! name (sharded gradients concatenated along their split dim; replicated ones equal on every
//! rank). f32; tolerance 2e-5 relative to the largest element (the sums run in another order).
mod common;
use common::{fixture, shards, table};

use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use vime_dist::layout::LayoutTable;
use vime_dist::{Collectives, SingleRank};
use vime_kernels::testing::{rel_err, Rng};
use vime_qwen3::batch::PackedBatch;
use vime_qwen3::config::Qwen3Config;
use vime_qwen3::model::{Qwen3, Recompute, TokenOutputs, TpPlace};

const TOL: f64 = 2e-5;

fn batch() -> PackedBatch {
    PackedBatch::from_sequences(&[
        vec![3u32, 7, 9, 11, 4, 5, 6],
        vec![8, 2, 30],
        vec![12, 13, 14, 15, 16, 39],
    ])
    .unwrap()
}

/// A loss over every log-prob and entropy with fixed random weights.
fn loss(o: &TokenOutputs) -> anyhow::Result<Tensor> {
    let n = o.logprobs.dim(0)?;
    let r1 = Rng::new(1).randn(&[n], 1.0, o.logprobs.dtype(), o.logprobs.device())?;
    let r2 = Rng::new(2).randn(&[n], 0.5, o.entropy.dtype(), o.entropy.device())?;
    Ok(((&o.logprobs * r1)?.sum_all()? + (&o.entropy * r2)?.sum_all()?)?)
}

type Out = (Tensor, Tensor, f64, BTreeMap<String, Tensor>);

fn run(m: &Qwen3, tp: &dyn Collectives) -> anyhow::Result<Out> {
    let b = batch();
    let o = m.logprobs_entropy_tp(&b, tp)?;
    let (l, g) = m.forward_backward_tp(&b, Recompute::None, loss, tp)?;
    // Full recompute gives the same gradients.
    let (l2, g2) = m.forward_backward_tp(&b, Recompute::Full, loss, tp)?;
    anyhow::ensure!(l == l2, "recompute changed the loss");
    for (n, t) in &g.params {
        anyhow::ensure!(rel_err(&g2.params[n], t)? < 1e-6, "recompute changed {n}");
    }
    Ok((o.logprobs, o.entropy, l, g.params))
}

fn check(cfg: &Qwen3Config, global: &BTreeMap<String, Tensor>, tp: usize) {
    for sp in [false, true] {
        check_sp(cfg, global, tp, sp);
    }
}

fn check_sp(cfg: &Qwen3Config, global: &BTreeMap<String, Tensor>, tp: usize, sp: bool) {
    let whole = Qwen3::from_tensors(cfg.clone(), global.clone()).unwrap();
    let (lp1, ent1, l1, g1) = run(&whole, &SingleRank::default()).unwrap();
    let runs = vime_dist::cpu::run_threads(tp, "tp", |r, g| {
        let mut m = shards(cfg, global, r, tp);
        m.set_sequence_parallel(sp);
        let out = run(&m, g)?;
        // Overlapping the reductions with the weight gradients changes no bit.
        m.set_tp_comm_overlap(true);
        let (_, _, l, grads) = run(&m, g)?;
        anyhow::ensure!(l == out.2, "overlap changed the loss");
        for (n, t) in &grads {
            let (a, b) = (
                t.flatten_all()?.to_vec1::<f32>()?,
                out.3[n].flatten_all()?.to_vec1::<f32>()?,
            );
            anyhow::ensure!(a == b, "overlap changed the gradient of {n}");
        }
        Ok(out)
    })
    .unwrap();
    let t0 = table(cfg, 0, tp);
    for (r, (lp, ent, l, _)) in runs.iter().enumerate() {
        assert!(
            rel_err(lp, &lp1).unwrap() < TOL,
            "tp {tp} rank {r} logprobs {}",
            rel_err(lp, &lp1).unwrap()
        );
        assert!(rel_err(ent, &ent1).unwrap() < TOL, "tp {tp} rank {r} entropy");
        assert!(
            (l - l1).abs() <= TOL * l1.abs().max(1.0),
            "tp {tp} rank {r} loss {l} vs {l1}"
        );
    }
    let per_rank: Vec<&BTreeMap<String, Tensor>> = runs.iter().map(|x| &x.3).collect();
    assert_grads_match(&t0, tp, sp, &g1, &per_rank);
}

/// Every TP=1 gradient equals the ranks' shards concatenated along the split dim (replicated
/// ones: equal on every rank and to TP=1).
fn assert_grads_match(
    t0: &LayoutTable,
    tp: usize,
    sp: bool,
    g1: &BTreeMap<String, Tensor>,
    runs: &[&BTreeMap<String, Tensor>],
) {
    assert_eq!(runs[0].len(), g1.len());
    for (name, want) in g1 {
        let place = t0.get(name).unwrap().entry.placement;
        let got = match place.split_dim() {
            Some(d) => Tensor::cat(&runs.iter().map(|x| x[name].clone()).collect::<Vec<_>>(), d).unwrap(),
            None => {
                for (r, x) in runs.iter().enumerate() {
                    let e = rel_err(&x[name], &runs[0][name]).unwrap();
                    assert!(e < 1e-6, "tp {tp} sp {sp}: replicated {name} differs on rank {r} ({e})");
                }
                runs[0][name].clone()
            }
        };
        let e = rel_err(&got.to_dtype(DType::F32).unwrap(), &want.to_dtype(DType::F32).unwrap()).unwrap();
        assert!(e < TOL, "tp {tp} sp {sp}: gradient of {name} ({place:?}) off by {e}");
    }
}

/// A custom head on the final hidden states (the PPO critic's value head is one): under TP and
/// SP it sees every token on every rank, and the loss and every gradient equal TP=1.
#[test]
fn a_custom_head_under_tp_and_sp_matches_tp1() {
    let (cfg, global) = fixture("untied_bias");
    let b = batch();
    let r = Rng::new(9)
        .randn(&[b.num_tokens(), cfg.hidden_size], 1.0, DType::F32, &Device::Cpu)
        .unwrap();
    let head = |h: &Tensor| -> anyhow::Result<Tensor> { Ok((h * &r)?.tanh()?.sum_all()?) };
    let whole = Qwen3::from_tensors(cfg.clone(), global.clone()).unwrap();
    let (l1, g1) = whole.forward_backward_with_head(&b, Recompute::None, head).unwrap();
    let tp = 2;
    for sp in [false, true] {
        let runs = vime_dist::cpu::run_threads(tp, "tp", |rank, g| {
            let mut m = shards(&cfg, &global, rank, tp);
            m.set_sequence_parallel(sp);
            let (l, gr) = m.forward_backward_with_head_tp(&b, Recompute::Full, head, g)?;
            Ok((l, gr.params))
        })
        .unwrap();
        for (rank, (l, _)) in runs.iter().enumerate() {
            assert!(
                (l - l1).abs() <= TOL * l1.abs().max(1.0),
                "tp {tp} sp {sp} rank {rank}: loss {l} vs {l1}"
            );
        }
        let per_rank: Vec<&BTreeMap<String, Tensor>> = runs.iter().map(|x| &x.1).collect();
        assert_grads_match(&table(&cfg, 0, tp), tp, sp, &g1.params, &per_rank);
    }
}

#[test]
fn tied_gqa_fixture_at_tp2() {
    let (cfg, w) = fixture("tied_gqa");
    assert!(cfg.tie_word_embeddings);
    check(&cfg, &w, 2);
}

#[test]
fn untied_fixture_with_attention_bias_at_tp2() {
    let (cfg, w) = fixture("untied_bias");
    assert!(cfg.attention_bias && !cfg.tie_word_embeddings);
    check(&cfg, &w, 2);
}

#[test]
fn a_random_model_with_four_kv_heads_at_tp4() {
    let mut cfg = common::tiny(false, false);
    cfg.num_attention_heads = 8;
    cfg.num_key_value_heads = 4;
    let m = Qwen3::init_random(cfg.clone(), 0.1, 3, DType::F32, &Device::Cpu).unwrap();
    check(&cfg, &m.state_dict(), 4);
}

#[test]
fn a_shard_with_the_wrong_group_or_shapes_is_refused() {
    let (cfg, w) = fixture("tied_gqa");
    let m = shards(&cfg, &w, 1, 2);
    let e = format!("{:#}", m.logprobs_entropy(&batch()).unwrap_err());
    assert!(e.contains("TP rank 1 of 2") && e.contains("rank 0 of 1"), "{e}");
    let e = format!(
        "{:#}",
        Qwen3::from_shards(cfg.clone(), w.clone(), TpPlace { rank: 0, size: 2 })
            .err()
            .unwrap()
    );
    assert!(e.contains("(TP rank 0 of 2)"), "{e}");
    let e = format!(
        "{:#}",
        Qwen3::from_shards(cfg.clone(), w, TpPlace { rank: 0, size: 4 })
            .err()
            .unwrap()
    );
    assert!(e.contains("num_key_value_heads (2)"), "{e}");
}

/// An HF checkpoint saved under TP = 2 (gathered, written by rank 0) is byte-identical to the one
/// the unsharded model writes from the same weights; the gathered tensors equal the originals bit
/// for bit on every rank.
#[test]
fn a_checkpoint_saved_under_tp2_is_byte_identical_to_tp1() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["tied_gqa", "untied_bias"] {
        let (cfg, w) = fixture(name);
        let one = dir.path().join(format!("{name}-tp1"));
        let two = dir.path().join(format!("{name}-tp2"));
        Qwen3::from_tensors(cfg.clone(), w.clone())
            .unwrap()
            .save_hf(&one, DType::F32, u64::MAX)
            .unwrap();
        let gathered = vime_dist::cpu::run_threads(2, "tp", |r, g| {
            let m = shards(&cfg, &w, r, 2);
            assert!(
                m.save_hf(&two, DType::F32, u64::MAX).is_err(),
                "a shard alone must not save"
            );
            m.save_hf_tp(&two, DType::F32, u64::MAX, g)?;
            m.gathered_state_dict(g)
        })
        .unwrap();
        for full in &gathered {
            for (n, t) in &w {
                let a: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
                let b: Vec<f32> = full[n].flatten_all().unwrap().to_vec1().unwrap();
                assert!(a == b, "{name}: {n} gathered differs");
            }
        }
        for f in ["model.safetensors", "config.json"] {
            let a = std::fs::read(one.join(f)).unwrap();
            let b = std::fs::read(two.join(f)).unwrap();
            assert!(
                a == b,
                "{name}: {f} differs between TP 1 and TP 2 ({} vs {} bytes)",
                a.len(),
                b.len()
            );
        }
    }
}

#[test]
fn sequence_parallelism_needs_a_batch_that_splits_over_tp() {
    let (cfg, w) = fixture("tied_gqa");
    let errs = vime_dist::cpu::run_threads(2, "tp", |r, g| {
        let mut m = shards(&cfg, &w, r, 2);
        m.set_sequence_parallel(true);
        let b = PackedBatch::from_sequences(&[vec![3u32, 7, 9]]).unwrap();
        Ok(format!("{:#}", m.logprobs_entropy_tp(&b, g).unwrap_err()))
    })
    .unwrap();
    assert!(
        errs[0].contains("3 tokens") && errs[0].contains("multiple of 2"),
        "{}",
        errs[0]
    );
}
