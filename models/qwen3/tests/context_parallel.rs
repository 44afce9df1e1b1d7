//! Context parallelism (`vime_qwen3::context_parallel`) against CP = 1 on real CPU-backend groups
//! of threads: the zigzag layout, then the HF fixtures at CP 2 and 4 (and TP 2 x CP 2 on four
//! ranks) on a packed batch of unequal lengths, including lengths that do not divide by `2 cp` and
//! a one-token sequence: every log-prob and entropy, the loss, and every parameter gradient (summed
//! over CP) equal the CP = 1 run's, with and without recompute.

mod common;

use candle_core::{Device, Tensor};
use common::{fixture, shards, table};
use std::collections::BTreeMap;
use vime_dist::{Collectives, ReduceOp, SingleRank};
use vime_kernels::testing::{rel_err, Rng};
use vime_qwen3::batch::PackedBatch;
use vime_qwen3::config::Qwen3Config;
use vime_qwen3::context_parallel::CpShard;
use vime_qwen3::model::{Qwen3, Recompute, TokenOutputs};

const TOL: f64 = 2e-5;

fn batch() -> PackedBatch {
    PackedBatch::from_sequences(&[
        vec![3u32, 7, 9, 11, 4, 5, 6],
        vec![8, 2, 30],
        vec![12, 13, 14, 15, 16, 39, 1, 2, 3, 4, 5],
        vec![21],
        vec![1, 2, 3, 4, 5, 6, 7, 8],
    ])
    .unwrap()
}

/// Per-token loss weights by GLOBAL token (padding weighs 0), so that every layout computes the
/// same function: sum_t w1[t] logp[t] + w2[t] H[t].
fn weights(n: usize) -> (Vec<f32>, Vec<f32>) {
    let mut r = Rng::new(5);
    let a = (0..n).map(|_| (r.next_u64() % 1000) as f32 / 500.0 - 1.0).collect();
    let b = (0..n).map(|_| (r.next_u64() % 1000) as f32 / 1000.0 - 0.5).collect();
    (a, b)
}

fn local_weights(shard: &CpShard, w: &[f32]) -> Tensor {
    let v: Vec<f32> = shard
        .global_index
        .iter()
        .map(|g| g.map_or(0.0, |g| w[g as usize]))
        .collect();
    Tensor::from_vec(v.clone(), v.len(), &Device::Cpu).unwrap()
}

fn weighted_loss(o: &TokenOutputs, w1: &Tensor, w2: &Tensor) -> anyhow::Result<Tensor> {
    Ok(((&o.logprobs * w1)?.sum_all()? + (&o.entropy * w2)?.sum_all()?)?)
}

#[test]
fn the_zigzag_layout_holds_chunks_r_and_2cp_minus_1_minus_r() {
    let b = batch();
    for cp in [1usize, 2, 4] {
        let shards: Vec<CpShard> = (0..cp).map(|r| CpShard::new(&b, cp, r, 1).unwrap()).collect();
        // Every real token on exactly one rank; a round trip restores the global order.
        let ids: Vec<Tensor> = shards
            .iter()
            .map(|s| Tensor::from_slice(&s.batch.input_ids, s.batch.num_tokens(), &Device::Cpu).unwrap())
            .collect();
        let back = CpShard::to_global(&shards, &ids, b.num_tokens()).unwrap();
        assert_eq!(back.to_vec1::<u32>().unwrap(), b.input_ids.to_vec(), "cp {cp}");
        for s in &shards {
            // Equal work: every rank holds 2 chunks of each sequence.
            assert_eq!(s.batch.num_tokens(), shards[0].batch.num_tokens());
            assert_eq!(s.batch.num_sequences(), 2 * b.num_sequences());
        }
    }
    // The 7-token sequence at CP 2: padded to 8, chunks of 2; rank 0 holds positions 0, 1 and 6, 7
    // (7 is padding, with no target); rank 1 holds 2, 3 and 4, 5.
    let r0 = CpShard::new(&b, 2, 0, 1).unwrap();
    let r1 = CpShard::new(&b, 2, 1, 1).unwrap();
    assert_eq!(&r0.batch.position_ids[..4], &[0, 1, 6, 7]);
    assert_eq!(&r1.batch.position_ids[..4], &[2, 3, 4, 5]);
    assert_eq!(r0.global_index[3], None);
    assert_eq!(r0.batch.targets[3], vime_kernels::IGNORE_TARGET);
    // The last token of chunk 0 predicts the first token of chunk 1, held by rank 1.
    assert_eq!(r0.batch.targets[1], 9);
    // Rank 0's second chunk (chunk 3) attends chunks 0..=3: 8 keys; its first chunk 2 keys.
    assert_eq!(&r0.cu_seqlens_k[..3], &[0, 2, 10]);
    // Padded to a multiple of 2 cp x 2 (TP 2 with SP): the 7-token sequence to 8, chunks of 2.
    let sp = CpShard::new(&b, 2, 0, 2).unwrap();
    assert_eq!(sp.chunk[1], 2, "the 3-token sequence pads to 8");
    assert!(sp.batch.num_tokens().is_multiple_of(2));
}

/// (logprobs, entropy, loss, grads) of one rank: this rank's share, in its local order.
type Out = (Tensor, Tensor, f64, BTreeMap<String, Tensor>);

fn cp_run(
    m: &Qwen3,
    shard: &CpShard,
    tp: &dyn Collectives,
    cp: &dyn Collectives,
    recompute: Recompute,
) -> anyhow::Result<Out> {
    let (a, b) = weights(batch().num_tokens());
    let (w1, w2) = (local_weights(shard, &a), local_weights(shard, &b));
    let o = m.logprobs_entropy_cp(shard, tp, cp)?;
    let (l, g) = m.forward_backward_cp(shard, recompute, |o| weighted_loss(o, &w1, &w2), tp, cp)?;
    // The gradients summed over CP (what the trainer's DP x CP reduction does).
    let mut summed = BTreeMap::new();
    for (n, t) in g.params {
        summed.insert(n, cp.all_reduce(&t, ReduceOp::Sum)?);
    }
    let loss = cp
        .all_reduce(&Tensor::new(&[l as f32], &Device::Cpu)?, ReduceOp::Sum)?
        .to_vec1::<f32>()?[0] as f64;
    Ok((o.logprobs, o.entropy, loss, summed))
}

fn reference(cfg: &Qwen3Config, global: &BTreeMap<String, Tensor>) -> Out {
    let whole = Qwen3::from_tensors(cfg.clone(), global.clone()).unwrap();
    let b = batch();
    let (a, c) = weights(b.num_tokens());
    let (w1, w2) = (
        Tensor::from_vec(a, b.num_tokens(), &Device::Cpu).unwrap(),
        Tensor::from_vec(c, b.num_tokens(), &Device::Cpu).unwrap(),
    );
    let o = whole.logprobs_entropy_tp(&b, &SingleRank::default()).unwrap();
    let (l, g) = whole
        .forward_backward(&b, Recompute::None, |o| weighted_loss(o, &w1, &w2))
        .unwrap();
    (o.logprobs, o.entropy, l, g.params)
}

fn check(cfg: &Qwen3Config, global: &BTreeMap<String, Tensor>, tp: usize, cp: usize, sp: bool) {
    let (lp1, ent1, l1, g1) = reference(cfg, global);
    let b = batch();
    // Kept attention skips the K/V gather in the recompute; the backward still gathers.
    let keep_attention: Recompute = "full,keep-attention".parse().unwrap();
    for recompute in [Recompute::None, Recompute::Full, keep_attention] {
        let runs = vime_dist::cpu::run_threads_grid(tp, cp, |g, tpg, cpg| {
            let mut m = shards(cfg, global, tpg.rank(), tp);
            m.set_sequence_parallel(sp);
            let shard = CpShard::new(&b, cp, cpg.rank(), if sp { tp } else { 1 })?;
            let out = cp_run(&m, &shard, tpg, cpg, recompute)?;
            Ok((g, shard, out))
        })
        .unwrap();
        let what = format!("tp {tp} x cp {cp} (sp {sp}, {recompute:?})");
        // Per token, in global order, from the TP-rank-0 ranks of each CP rank.
        let cp_ranks: Vec<&(usize, CpShard, Out)> = runs.iter().filter(|r| r.0 % tp == 0).collect();
        let shards: Vec<CpShard> = cp_ranks.iter().map(|r| r.1.clone()).collect();
        let lp = CpShard::to_global(
            &shards,
            &cp_ranks.iter().map(|r| r.2 .0.clone()).collect::<Vec<_>>(),
            b.num_tokens(),
        )
        .unwrap();
        let ent = CpShard::to_global(
            &shards,
            &cp_ranks.iter().map(|r| r.2 .1.clone()).collect::<Vec<_>>(),
            b.num_tokens(),
        )
        .unwrap();
        assert!(
            rel_err(&lp, &lp1).unwrap() < TOL,
            "{what}: logprobs {}",
            rel_err(&lp, &lp1).unwrap()
        );
        assert!(
            rel_err(&ent, &ent1).unwrap() < TOL,
            "{what}: entropy {}",
            rel_err(&ent, &ent1).unwrap()
        );
        let t0 = table(cfg, 0, tp);
        for (g, _, (_, _, l, grads)) in &runs {
            assert!(
                (l - l1).abs() <= TOL * l1.abs().max(1.0),
                "{what} rank {g}: loss {l} vs {l1}"
            );
            assert_eq!(grads.len(), g1.len());
        }
        for (name, want) in &g1 {
            let place = t0.get(name).unwrap().entry.placement;
            // TP shards of CP rank 0 concatenated (every CP rank holds the same sums).
            let tp_ranks: Vec<&Tensor> = runs.iter().filter(|r| r.0 / tp == 0).map(|r| &r.2 .3[name]).collect();
            let got = match place.split_dim() {
                Some(d) => Tensor::cat(&tp_ranks, d).unwrap(),
                None => tp_ranks[0].clone(),
            };
            let e = rel_err(&got, want).unwrap();
            assert!(e < TOL, "{what}: gradient of {name} off by {e}");
        }
    }
}

#[test]
fn tied_gqa_fixture_at_cp2_and_cp4() {
    let (cfg, w) = fixture("tied_gqa");
    check(&cfg, &w, 1, 2, false);
    check(&cfg, &w, 1, 4, false);
}

#[test]
fn untied_fixture_with_attention_bias_at_cp2() {
    let (cfg, w) = fixture("untied_bias");
    check(&cfg, &w, 1, 2, false);
}

#[test]
fn tp2_by_cp2_on_four_ranks_with_and_without_sp() {
    let (cfg, w) = fixture("untied_bias");
    check(&cfg, &w, 2, 2, false);
    check(&cfg, &w, 2, 2, true);
}

#[test]
fn a_shard_for_another_cp_rank_is_refused() {
    let (cfg, w) = fixture("tied_gqa");
    let m = Qwen3::from_tensors(cfg, w).unwrap();
    let shard = CpShard::new(&batch(), 2, 1, 1).unwrap();
    let e = format!(
        "{:#}",
        m.logprobs_entropy_cp(&shard, &SingleRank::default(), &SingleRank::default())
            .unwrap_err()
    );
    assert!(e.contains("CP rank 1 of 2") && e.contains("rank 0 of 1"), "{e}");
    assert!(CpShard::new(&batch(), 2, 2, 1).is_err());
}
