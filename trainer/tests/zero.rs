//! ZeRO-1 `DistributedAdamW` against the plain `AdamW`, on a tiny Qwen3 weight table (CPU).
//!
//! - dp = 1 (`SingleRank`) is `AdamW` bit for bit: weights, norms and state, f32 and bf16 models,
//!   clipping on and off, weight decay on and off (Megatron's rule picks which tensors decay).
//! - dp = 2, 3, 4: ranks are threads, each a rank of a real CPU-backend group (`vime_dist::cpu`,
//!   sums in group-rank order). Each rank gets its own gradient;
//!   the norm equals the single-process norm of the summed gradient to 1e-12 (relative), and
//!   weights / state equal one `AdamW` stepping on that sum formed in rank order, given the same
//!   clipping factor (the factor is computed from the norm, whose last f64 bits depend on how
//!   the sum of squares is split; the reference takes the distributed run's factor).
//! - Resume: the state gathered at dp = 4 loads at dp = 2 and dp = 1 and continues to the same
//!   bits as the uninterrupted dp = 4 run (clipping off there: the norm's last bits differ with
//!   the DP size).
//! - Errors name the tensor: a missing gradient, a wrong shape, an unknown state key, a
//!   non-divisible TP placement, a non-finite gradient on one rank.
use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use std::collections::BTreeMap;
use vime_dist::collectives::SingleRank;
use vime_dist::layout::LayoutTable;
use vime_dist::Collectives;
use vime_kernels::testing::Rng;
use vime_qwen3::config::Qwen3Config;
use vime_qwen3::state_dict::param_specs;
use vime_trainer::optim::{
    clip_coefficient, global_grad_norm, qwen3_layout, replicated_layout, AdamW, DistributedAdamW, NonFiniteGradNorm,
    OptimizerArgs,
};

// ------------------------------------------------------------------------------------------
// Ranks as threads
// ------------------------------------------------------------------------------------------

/// Runs `f(rank, group)` on `dp` threads, each rank of a real CPU-backend group; results in rank
/// order.
fn run_ranks<T: Send>(dp: usize, f: impl Fn(usize, &dyn Collectives) -> Result<T> + Sync) -> Vec<T> {
    vime_dist::cpu::run_threads(dp, "dp", f).unwrap_or_else(|e| panic!("{e:#}"))
}

// ------------------------------------------------------------------------------------------
// A tiny Qwen3 and its gradients
// ------------------------------------------------------------------------------------------

fn tiny_cfg() -> Qwen3Config {
    let mut c = Qwen3Config::preset("qwen3-0.6b").unwrap();
    c.vocab_size = 32;
    c.hidden_size = 16;
    c.intermediate_size = 24;
    c.num_hidden_layers = 2;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 4;
    c.attention_bias = true;
    c.tie_word_embeddings = false;
    c
}

fn model(dtype: DType) -> Vec<(String, Var)> {
    let mut rng = Rng::new(1);
    param_specs(&tiny_cfg())
        .into_iter()
        .map(|s| {
            let t = rng.randn(&s.shape, 0.5, dtype, &Device::Cpu).unwrap();
            (s.name, Var::from_tensor(&t).unwrap())
        })
        .collect()
}

fn layout(dtype: DType) -> LayoutTable {
    qwen3_layout(&param_specs(&tiny_cfg()), dtype, 0, 1).unwrap()
}

/// Rank `rank`'s accumulated gradient at step `step` (f32, as `GradAccumulator::take` gives).
fn grads(step: usize, rank: usize, std: f64) -> BTreeMap<String, Tensor> {
    let mut rng = Rng::new(1000 + 97 * step as u64 + rank as u64);
    param_specs(&tiny_cfg())
        .into_iter()
        .map(|s| (s.name, rng.randn(&s.shape, std, DType::F32, &Device::Cpu).unwrap()))
        .collect()
}

/// The sum over ranks `0..dp`, formed in rank order.
fn summed(step: usize, dp: usize, std: f64) -> BTreeMap<String, Tensor> {
    let mut acc = grads(step, 0, std);
    for r in 1..dp {
        for (n, g) in grads(step, r, std) {
            let s = (&acc[&n] + g).unwrap();
            acc.insert(n, s);
        }
    }
    acc
}

fn args(clip_grad: f64, weight_decay: f64) -> OptimizerArgs {
    OptimizerArgs {
        clip_grad,
        weight_decay,
        adam_beta2: 0.95,
        ..OptimizerArgs::default()
    }
}

const LR: f64 = 3e-3;

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

fn weights(params: &[(String, Var)]) -> BTreeMap<String, Vec<u32>> {
    params.iter().map(|(n, v)| (n.clone(), bits(v.as_tensor()))).collect()
}

fn state_bits(m: &BTreeMap<String, Tensor>) -> BTreeMap<String, (Vec<usize>, DType, Vec<u32>)> {
    m.iter()
        .map(|(k, t)| (k.clone(), (t.dims().to_vec(), t.dtype(), bits(t))))
        .collect()
}

fn assert_same<K: Ord + std::fmt::Debug, V: PartialEq>(a: &BTreeMap<K, V>, b: &BTreeMap<K, V>, what: &str) {
    assert_eq!(
        a.keys().collect::<Vec<_>>(),
        b.keys().collect::<Vec<_>>(),
        "{what}: names"
    );
    for (k, v) in a {
        assert!(*v == b[k], "{what}: {k:?} differs");
    }
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-300)
}

// ------------------------------------------------------------------------------------------
// dp = 1
// ------------------------------------------------------------------------------------------

#[test]
fn dp1_is_adamw_bit_for_bit() -> Result<()> {
    let single = SingleRank::default();
    for dtype in [DType::F32, DType::BF16] {
        // clip 0: off; 0.5: clips every step (the norms are ~10); 1e9: measured, never clips.
        for clip in [0.0, 0.5, 1e9] {
            for wd in [0.0, 0.1] {
                let a = args(clip, wd);
                let (pa, pz) = (model(dtype), model(dtype));
                let mut adamw = AdamW::new(&pa, &a)?;
                let mut zero = DistributedAdamW::with_layout(&pz, layout(dtype), &a, &single)?;
                assert_eq!(zero.segments().len(), pz.len());
                for step in 0..4 {
                    let g = grads(step, 0, 0.7);
                    let norm = global_grad_norm(&g)?;
                    adamw.step_scaled(&g, LR, clip_coefficient(norm, clip))?;
                    let s = zero.step_stats(&g, LR, clip, &single)?;
                    let case = format!("{dtype:?} clip {clip} wd {wd} step {step}");
                    assert_eq!(s.grad_norm.to_bits(), norm.to_bits(), "{case}");
                    assert_eq!(s.grad_scale.is_some(), clip == 0.5, "{case}");
                    assert_eq!(s.step, step as u64 + 1);
                    assert_same(&weights(&pa), &weights(&pz), &case);
                }
                assert_eq!(zero.num_steps(), adamw.num_steps());
                assert_same(
                    &state_bits(&adamw.state_tensors()?),
                    &state_bits(&zero.state_tensors(&single)?),
                    "dp1 state",
                );
            }
        }
    }
    Ok(())
}

/// At dp = 1 an f32 model's `Var` stays its own master (no second copy, as in `AdamW`).
#[test]
fn dp1_f32_master_is_the_model_tensor() -> Result<()> {
    let single = SingleRank::default();
    let p = model(DType::F32);
    let mut zero = DistributedAdamW::new(&p, &args(1.0, 0.1), &single)?;
    zero.step(&grads(0, 0, 0.7), LR, 1.0, &single)?;
    let st = zero.state_tensors(&single)?;
    for (n, v) in &p {
        assert_eq!(bits(&st[&format!("master.{n}")]), bits(v.as_tensor()), "{n}");
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------
// dp > 1
// ------------------------------------------------------------------------------------------

struct RankResult {
    weights: BTreeMap<String, Vec<u32>>,
    norms: Vec<f64>,
    scales: Vec<Option<f64>>,
    state: BTreeMap<String, (Vec<usize>, DType, Vec<u32>)>,
    shard: std::ops::Range<usize>,
}

fn run_sharded(dp: usize, dtype: DType, a: &OptimizerArgs, steps: usize) -> Vec<RankResult> {
    run_ranks(dp, |rank, group| {
        let p = model(dtype);
        let mut zero = DistributedAdamW::with_layout(&p, layout(dtype), a, group)?;
        let (mut norms, mut scales) = (Vec::new(), Vec::new());
        for step in 0..steps {
            let s = zero.step_stats(&grads(step, rank, 0.7), LR, a.clip_grad, group)?;
            norms.push(s.grad_norm);
            scales.push(s.grad_scale);
        }
        Ok(RankResult {
            weights: weights(&p),
            norms,
            scales,
            state: state_bits(&zero.state_tensors(group)?),
            shard: zero.shard_range(),
        })
    })
}

#[test]
fn sharded_steps_equal_adamw_on_the_summed_gradient() -> Result<()> {
    let total = layout(DType::F32).total_numel();
    for dp in [2, 3, 4] {
        for dtype in [DType::F32, DType::BF16] {
            // clip 2.0 clips (the summed norms are ~10-20); wd 0.1 decays matrices only.
            let a = args(2.0, 0.1);
            let steps = 3;
            let ranks = run_sharded(dp, dtype, &a, steps);
            // The shards tile the padded buffer, and at least one parameter straddles a boundary.
            assert_eq!(ranks[0].shard.start, 0);
            for w in ranks.windows(2) {
                assert_eq!(w[0].shard.end, w[1].shard.start);
            }
            assert!(ranks[dp - 1].shard.end >= total);
            let lt = layout(dtype);
            let cut = ranks[0].shard.end;
            assert!(lt.entries().iter().any(|p| p.offset < cut && cut < p.offset + p.numel));

            let pr = model(dtype);
            let mut reference = AdamW::new(&pr, &a)?;
            for step in 0..steps {
                let s = summed(step, dp, 0.7);
                let norm = global_grad_norm(&s)?;
                for (r, rr) in ranks.iter().enumerate() {
                    let e = rel(rr.norms[step], norm);
                    assert!(
                        e <= 1e-12,
                        "dp {dp} rank {r} step {step}: norm {} vs {norm} ({e:e})",
                        rr.norms[step]
                    );
                    assert_eq!(rr.norms[step].to_bits(), ranks[0].norms[step].to_bits());
                    assert_eq!(rr.scales[step], ranks[0].scales[step]);
                }
                let scale = ranks[0].scales[step];
                assert!(scale.is_some(), "dp {dp} step {step}: expected clipping");
                assert_eq!(clip_coefficient(norm, a.clip_grad).is_some(), scale.is_some());
                reference.step_scaled(&s, LR, scale)?;
            }
            let want = weights(&pr);
            let want_state = state_bits(&reference.state_tensors()?);
            for (r, rr) in ranks.iter().enumerate() {
                assert_same(&want, &rr.weights, &format!("dp {dp} {dtype:?} rank {r} weights"));
                assert_same(&want_state, &rr.state, &format!("dp {dp} {dtype:?} rank {r} state"));
            }
        }
    }
    Ok(())
}

#[test]
fn state_saved_at_dp4_resumes_at_dp2_and_dp1() -> Result<()> {
    let dtype = DType::BF16;
    let a = args(0.0, 0.1);
    let (k, m) = (2, 2);
    // The uninterrupted dp = 4 run, and its state after k steps.
    let runs = run_ranks(4, |rank, group| {
        let p = model(dtype);
        let mut zero = DistributedAdamW::with_layout(&p, layout(dtype), &a, group)?;
        let mut saved = None;
        for step in 0..k + m {
            if step == k {
                saved = Some(zero.state_tensors(group)?);
            }
            zero.step(&grads(step, rank, 0.7), LR, a.clip_grad, group)?;
        }
        Ok((weights(&p), saved.unwrap()))
    });
    let (want, saved) = (&runs[0].0, &runs[0].1);
    for (r, run) in runs.iter().enumerate() {
        assert_same(want, &run.0, &format!("dp 4 rank {r}"));
        assert_same(&state_bits(saved), &state_bits(&run.1), "state on every rank");
    }
    // Continue at dp = 2 (rank 0 brings the dp = 4 sum, rank 1 zeros: the same summed bits)
    // and at dp = 1, from models holding other values: loading writes the master into them.
    for dp in [2, 1] {
        let resumed = run_ranks(dp, |rank, group| {
            let p: Vec<(String, Var)> = model(dtype)
                .into_iter()
                .map(|(n, v)| (n, Var::from_tensor(&v.as_tensor().zeros_like().unwrap()).unwrap()))
                .collect();
            let mut zero = DistributedAdamW::with_layout(&p, layout(dtype), &a, group)?;
            let g: &dyn Collectives = group;
            zero.load_state_tensors(saved, k as u64, g)?;
            assert_eq!(zero.num_steps(), k as u64);
            for step in k..k + m {
                let grad = if rank == 0 {
                    summed(step, 4, 0.7)
                } else {
                    grads(step, 0, 0.0)
                };
                zero.step(&grad, LR, a.clip_grad, g)?;
            }
            Ok(weights(&p))
        });
        for (r, w) in resumed.iter().enumerate() {
            assert_same(want, w, &format!("resumed at dp {dp}, rank {r}"));
        }
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------
// Errors and layout
// ------------------------------------------------------------------------------------------

fn err_of<T>(r: Result<T>) -> String {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn errors_name_the_tensor() -> Result<()> {
    let dtype = DType::F32;
    let q = "model.layers.1.self_attn.q_proj.weight";
    // Checks run before any collective: rank 0 of a group of 2 (rank 1 only joins) and one rank.
    let single = SingleRank::default();
    let check = |g: &dyn Collectives| -> Result<()> {
        let p = model(dtype);
        let mut zero = DistributedAdamW::with_layout(&p, layout(dtype), &args(1.0, 0.1), g)?;
        let mut gr = grads(0, 0, 1.0);
        gr.remove(q);
        let e = err_of(zero.step(&gr, LR, 1.0, g));
        assert!(e.contains("no gradient for parameter") && e.contains(q), "{e}");
        let mut gr = grads(0, 0, 1.0);
        gr.insert(q.into(), Tensor::zeros((3, 3), DType::F32, &Device::Cpu)?);
        let e = err_of(zero.step(&gr, LR, 1.0, g));
        assert!(e.contains(q) && e.contains("[3, 3]"), "{e}");
        let mut gr = grads(0, 0, 1.0);
        gr.insert("model.stray.weight".into(), Tensor::zeros(2, DType::F32, &Device::Cpu)?);
        let e = err_of(zero.step(&gr, LR, 1.0, g));
        assert!(e.contains("model.stray.weight"), "{e}");

        // State: an unknown key, a missing key, a wrong shape (from AdamW's own state).
        let full = AdamW::new(&p, &args(1.0, 0.1))?.state_tensors()?;
        let mut st = full.clone();
        st.insert(
            "exp_avg.model.stray.weight".into(),
            Tensor::zeros(2, DType::F32, &Device::Cpu)?,
        );
        let e = err_of(zero.load_state_tensors(&st, 1, g));
        assert!(e.contains("exp_avg.model.stray.weight"), "{e}");
        let mut st = full.clone();
        st.remove(&format!("exp_avg_sq.{q}"));
        let e = err_of(zero.load_state_tensors(&st, 1, g));
        assert!(e.contains(&format!("exp_avg_sq.{q}")), "{e}");
        let mut st = full.clone();
        st.insert(format!("master.{q}"), Tensor::zeros(5, DType::F32, &Device::Cpu)?);
        let e = err_of(zero.load_state_tensors(&st, 1, g));
        assert!(e.contains(&format!("master.{q}")) && e.contains("[5]"), "{e}");
        assert_eq!(zero.num_steps(), 0, "a failed call changes nothing");
        zero.load_state_tensors(&full, 3, g)?;
        assert_eq!(zero.num_steps(), 3);

        // Model vs layout.
        let mut bad = model(dtype);
        bad.retain(|(n, _)| n != q);
        let e = err_of(DistributedAdamW::with_layout(&bad, layout(dtype), &args(1.0, 0.1), g));
        assert!(e.contains(q), "{e}");
        let e = err_of(DistributedAdamW::with_layout(
            &model(DType::BF16),
            layout(dtype),
            &args(1.0, 0.1),
            g,
        ));
        assert!(e.contains("model.embed_tokens.weight") && e.contains("BF16"), "{e}");
        Ok(())
    };
    run_ranks(2, |r, g| if r == 0 { check(g) } else { Ok(()) });
    check(&single)?;
    // A TP size that does not divide a split dim (vocab 32, q_dim 16, kv_dim 8 / 3).
    let e = err_of(qwen3_layout(&param_specs(&tiny_cfg()), dtype, 0, 3));
    assert!(
        e.contains("model.embed_tokens.weight") && e.contains("not divisible"),
        "{e}"
    );
    let mut cfg = tiny_cfg();
    cfg.vocab_size = 48;
    let e = err_of(qwen3_layout(&param_specs(&cfg), dtype, 0, 3));
    assert!(
        e.contains("model.layers.0.self_attn.q_proj.weight") && e.contains("not divisible"),
        "{e}"
    );
    Ok(())
}

#[test]
fn non_finite_gradient_on_one_rank_fails_every_rank() {
    let bad = "model.layers.0.mlp.up_proj.weight";
    let errs = run_ranks(2, |rank, group| {
        let p = model(DType::BF16);
        let mut zero = DistributedAdamW::with_layout(&p, layout(DType::BF16), &args(1.0, 0.1), group)?;
        let before = weights(&p);
        let mut g = grads(0, rank, 1.0);
        if rank == 1 {
            let shape = g[bad].dims().to_vec();
            g.insert(bad.into(), Tensor::full(f32::NAN, shape, &Device::Cpu)?);
        }
        let e = zero.step(&g, LR, 1.0, group).unwrap_err();
        assert_eq!(weights(&p), before);
        assert_eq!(zero.num_steps(), 0);
        Ok(e.downcast::<NonFiniteGradNorm>().expect("a NonFiniteGradNorm").params)
    });
    for params in errs {
        assert_eq!(params, vec![bad.to_string()]);
    }
}

#[test]
fn qwen3_placements_give_tp2_local_shapes() -> Result<()> {
    let cfg = tiny_cfg();
    let (h, im, q, kv, v) = (16, 24, 16, 8, 32);
    let t = qwen3_layout(&param_specs(&cfg), DType::BF16, 1, 2)?;
    let shape = |n: &str| t.get(n).unwrap().local_shape.clone();
    let l = "model.layers.0";
    assert_eq!(shape("model.embed_tokens.weight"), vec![v / 2, h]);
    assert_eq!(shape("lm_head.weight"), vec![v / 2, h]);
    assert_eq!(shape(&format!("{l}.self_attn.q_proj.weight")), vec![q / 2, h]);
    assert_eq!(shape(&format!("{l}.self_attn.q_proj.bias")), vec![q / 2]);
    assert_eq!(shape(&format!("{l}.self_attn.k_proj.weight")), vec![kv / 2, h]);
    assert_eq!(shape(&format!("{l}.self_attn.v_proj.bias")), vec![kv / 2]);
    assert_eq!(shape(&format!("{l}.self_attn.o_proj.weight")), vec![h, q / 2]);
    assert_eq!(shape(&format!("{l}.self_attn.o_proj.bias")), vec![h]);
    assert_eq!(shape(&format!("{l}.self_attn.q_norm.weight")), vec![4]);
    assert_eq!(shape(&format!("{l}.mlp.gate_proj.weight")), vec![im / 2, h]);
    assert_eq!(shape(&format!("{l}.mlp.up_proj.weight")), vec![im / 2, h]);
    assert_eq!(shape(&format!("{l}.mlp.down_proj.weight")), vec![h, im / 2]);
    assert_eq!(shape("model.norm.weight"), vec![h]);
    assert_eq!(t.entries()[0].entry.dtype_name(), "bfloat16");
    // Megatron's decay rule: matrices decay, biases and norms do not.
    assert!(
        t.get(&format!("{l}.self_attn.q_proj.weight"))
            .unwrap()
            .entry
            .weight_decay
    );
    assert!(!t.get(&format!("{l}.self_attn.q_proj.bias")).unwrap().entry.weight_decay);
    assert!(!t.get("model.norm.weight").unwrap().entry.weight_decay);
    // The TP shards of the two ranks tile the global parameter count (replicated counted twice).
    let t0 = qwen3_layout(&param_specs(&cfg), DType::BF16, 0, 2)?;
    assert_eq!(t0.total_numel(), t.total_numel());
    let replicated: usize = t
        .entries()
        .iter()
        .filter(|p| p.entry.placement == vime_dist::layout::Placement::Replicated)
        .map(|p| p.numel)
        .sum();
    assert_eq!(2 * t.total_numel() - replicated, cfg.num_parameters());
    Ok(())
}

/// The ZeRO shard arithmetic on random tables, for dp 1..=5 (the dist crate's unit tests cover the
/// layout itself): segments of all ranks together are every parameter, whole, once.
#[test]
fn segments_of_all_ranks_cover_every_parameter_once() -> Result<()> {
    let mut rng = Rng::new(3);
    for trial in 0..20 {
        let params: Vec<(String, Var)> = (0..1 + trial % 7)
            .map(|i| {
                let shape: Vec<usize> = (0..1 + (rng.next_u64() % 3) as usize)
                    .map(|_| (rng.next_u64() % 40) as usize)
                    .collect();
                let t = Tensor::zeros(shape, DType::F32, &Device::Cpu).unwrap();
                (format!("p{i}"), Var::from_tensor(&t).unwrap())
            })
            .collect();
        let lt = replicated_layout(&params)?;
        for dp in 1..=5 {
            let per_rank = run_ranks(dp, |_, g| {
                Ok(DistributedAdamW::with_layout(&params, lt.clone(), &args(1.0, 0.0), g)?.segments())
            });
            let mut seen = vec![0usize; lt.total_numel()];
            for segments in per_rank {
                for s in segments {
                    seen[s.flat_range.clone()].iter_mut().for_each(|x| *x += 1);
                    assert_eq!(lt.entries()[s.entry].offset + s.param_range.start, s.flat_range.start);
                }
            }
            assert!(seen.iter().all(|&x| x == 1), "trial {trial} dp {dp}");
        }
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------
// tensor parallelism
// ------------------------------------------------------------------------------------------

/// `tp x dp` ranks as threads, each in a TP group (consecutive ranks, Megatron's order) and a DP
/// group of real CPU-backend groups; `f(tp_rank, dp_rank, tp, dp)`. Results in global rank order.
fn run_tp_dp<T: Send>(
    tp: usize,
    dp: usize,
    f: impl Fn(usize, usize, &dyn Collectives, &dyn Collectives) -> Result<T> + Sync,
) -> Vec<T> {
    use vime_dist::cpu::CpuGroup;
    use vime_dist::launch::{free_port, Timeouts};
    use vime_dist::store::{StoreClient, StoreServer};
    let t = Timeouts::default();
    let addr = format!("127.0.0.1:{}", free_port().unwrap());
    let _server = StoreServer::bind(&addr, t.heartbeat).unwrap();
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..tp * dp)
            .map(|g| {
                let (f, addr) = (&f, &addr);
                s.spawn(move || -> Result<T> {
                    let (tr, dr) = (g % tp, g / tp);
                    let store = StoreClient::connect(addr, g, t.rendezvous)?;
                    let tp_members: Vec<usize> = (0..tp).map(|i| dr * tp + i).collect();
                    let dp_members: Vec<usize> = (0..dp).map(|i| i * tp + tr).collect();
                    let tpg = CpuGroup::new(&store, &format!("tp{dr}"), &tp_members, g, &t)?;
                    let dpg = CpuGroup::new(&store, &format!("dp{tr}"), &dp_members, g, &t)?;
                    f(tr, dr, &tpg, &dpg)
                })
            })
            .collect();
        hs.into_iter()
            .enumerate()
            .map(|(r, h)| h.join().unwrap().unwrap_or_else(|e| panic!("rank {r}: {e:#}")))
            .collect()
    })
}

/// TP = 2 at DP = 1 and TP = 2 x DP = 2: the gradient norm is the whole model's (TP-split squares
/// summed over TP, replicated ones once), every rank clips by it, and the new weights are the TP = 1
/// optimizer's, sliced, within f32 rounding of the norm's summation order.
#[test]
fn tp_shards_step_like_the_whole_model() -> Result<()> {
    let specs = param_specs(&tiny_cfg());
    for (tp, dp) in [(2usize, 1usize), (2, 2)] {
        // Clip hard so the norm matters for every element.
        let a = args(0.5, 0.1);
        let whole = model(DType::F32);
        let mut reference = DistributedAdamW::with_layout(&whole, layout(DType::F32), &a, &SingleRank::default())?;
        let summed = summed(0, dp, 1.0);
        let ref_norm = reference.step(&summed, LR, a.clip_grad, &SingleRank::default())?;
        let ref_w: BTreeMap<String, Tensor> = whole
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().copy().unwrap()))
            .collect();
        let out = run_tp_dp(tp, dp, |tr, dr, tpg, dpg| {
            let table = qwen3_layout(&specs, DType::F32, tr, tp)?;
            let local: Vec<(String, Var)> = model(DType::F32)
                .into_iter()
                .map(|(n, v)| Ok((n.clone(), Var::from_tensor(&table.local_shard(&n, v.as_tensor())?)?)))
                .collect::<Result<_>>()?;
            let g: BTreeMap<String, Tensor> = grads(0, dr, 1.0)
                .into_iter()
                .map(|(n, t)| Ok((n.clone(), table.local_shard(&n, &t)?)))
                .collect::<Result<_>>()?;
            let mut opt = DistributedAdamW::with_layout(&local, table.clone(), &a, dpg)?;
            let stats = opt.step_stats_tp(&g, None, LR, a.clip_grad, dpg, tpg)?;
            let w: BTreeMap<String, Tensor> = local
                .iter()
                .map(|(n, v)| Ok((n.clone(), table.gather_global(n, v.as_tensor(), tpg)?)))
                .collect::<Result<_>>()?;
            Ok((stats.grad_norm, w))
        });
        for (r, (norm, w)) in out.iter().enumerate() {
            assert!(
                rel(*norm, ref_norm) < 1e-6,
                "tp {tp} dp {dp} rank {r}: norm {norm} vs {ref_norm}"
            );
            for (n, t) in &ref_w {
                let e = vime_kernels::testing::rel_err(&w[n], t)?;
                assert!(e < 1e-6, "tp {tp} dp {dp} rank {r}: {n} off by {e}");
            }
        }
    }
    Ok(())
}
