//! Dynamic batching: packing respects `max_tokens_per_gpu` and covers every sample once, DP
//! balancing beats greedy and stays within its bounds, the micro-batch layout maps outputs back to
//! the right response tokens, and gradients accumulated over micro-batches equal the gradient of one
//! packed global batch for both loss normalisations.
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::PathBuf;
use vime_kernels::testing::{rel_err, Rng};
use vime_qwen3::model::{Qwen3, Recompute};
use vime_trainer::batching::{
    balance_across_ranks, fixed_micro_batches, global_num_tokens, greedy_partition, karmarkar_karp, pack_micro_batches,
    spread, LossNorm, MicroBatch, MicroBatchPolicy, SampleView,
};

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/hf")
        .join(name)
}

fn rand_below(rng: &mut Rng, n: usize) -> usize {
    (rng.next_u64() % n as u64) as usize
}

fn random_lengths(rng: &mut Rng, n: usize, lo: usize, hi: usize) -> Vec<usize> {
    (0..n).map(|_| lo + rand_below(rng, hi - lo + 1)).collect()
}

/// Every index in `0..n` exactly once.
fn assert_covers(parts: &[Vec<usize>], n: usize) {
    let mut seen = vec![0usize; n];
    for p in parts {
        for &i in p {
            assert!(i < n, "index {i} out of range {n}");
            seen[i] += 1;
        }
    }
    assert!(seen.iter().all(|&c| c == 1), "coverage counts {seen:?}");
}

fn sums(parts: &[Vec<usize>], lengths: &[usize]) -> Vec<usize> {
    parts.iter().map(|p| p.iter().map(|&i| lengths[i]).sum()).collect()
}

// ------------------------------------------------------------------------------------------------
// Packing
// ------------------------------------------------------------------------------------------------

#[test]
fn packing_respects_cap_covers_once_and_is_deterministic() -> Result<()> {
    let mut rng = Rng::new(1);
    for trial in 0..300 {
        let n = 1 + rand_below(&mut rng, 60);
        let cap = 64 + rand_below(&mut rng, 2000);
        let lengths = random_lengths(&mut rng, n, 1, cap);
        let mbs = pack_micro_batches(&lengths, cap)?;
        assert_covers(&mbs, n);
        let s = sums(&mbs, &lengths);
        assert!(s.iter().all(|&x| x <= cap), "trial {trial}: sums {s:?} over cap {cap}");
        for mb in &mbs {
            assert!(
                !mb.is_empty() && mb.windows(2).all(|w| w[0] < w[1]),
                "{mb:?} not ascending"
            );
        }
        // First-fit property: no two micro-batches could have been one.
        for a in 0..s.len() {
            for b in a + 1..s.len() {
                assert!(
                    s[a] + s[b] > cap,
                    "trial {trial}: micro-batches {a} and {b} fit together"
                );
            }
        }
        let total: usize = lengths.iter().sum();
        assert!(mbs.len() >= total.div_ceil(cap));
        assert_eq!(mbs, pack_micro_batches(&lengths, cap)?, "not deterministic");
    }
    Ok(())
}

/// Minimum number of bins of size `cap` for `items`, by exhaustive search (small inputs only).
fn optimal_bins(items: &[usize], cap: usize) -> usize {
    fn go(items: &[usize], k: usize, bins: &mut Vec<usize>, cap: usize, best: &mut usize) {
        if bins.len() >= *best {
            return;
        }
        if k == items.len() {
            *best = bins.len();
            return;
        }
        for b in 0..bins.len() {
            if bins[b] + items[k] <= cap {
                bins[b] += items[k];
                go(items, k + 1, bins, cap, best);
                bins[b] -= items[k];
            }
        }
        bins.push(items[k]);
        go(items, k + 1, bins, cap, best);
        bins.pop();
    }
    let mut best = items.len();
    go(items, 0, &mut Vec::new(), cap, &mut best);
    best
}

#[test]
fn first_fit_decreasing_is_within_its_bound_of_the_optimum() -> Result<()> {
    // FFD uses at most 11/9 OPT + 6/9 bins (Dosa 2007); check it against exhaustive search.
    let mut rng = Rng::new(2);
    let mut worse_than_opt = 0;
    for trial in 0..400 {
        let n = 1 + rand_below(&mut rng, 10);
        let cap = 100;
        // Items around a third to a half of the cap are where first-fit heuristics go wrong.
        let lengths = if trial % 2 == 0 {
            random_lengths(&mut rng, n, 1, cap)
        } else {
            random_lengths(&mut rng, n, 20, 60)
        };
        let got = pack_micro_batches(&lengths, cap)?.len();
        let opt = optimal_bins(&lengths, cap);
        assert!(got >= opt);
        assert!(
            9 * got <= 11 * opt + 6,
            "FFD {got} bins vs optimum {opt} for {lengths:?}"
        );
        worse_than_opt += (got > opt) as usize;
    }
    eprintln!("FFD used more micro-batches than optimal in {worse_than_opt}/400 instances");
    Ok(())
}

#[test]
fn packing_matches_the_slime_help_example() -> Result<()> {
    // slime's --use-dynamic-batch-size help: lengths 100, 200, 300 with max_tokens_per_gpu 300
    // give two micro-batches, [100, 200] and [300].
    let mbs = pack_micro_batches(&[100, 200, 300], 300)?;
    assert_eq!(mbs, vec![vec![2], vec![0, 1]]);
    Ok(())
}

#[test]
fn over_long_and_empty_samples_are_errors() {
    let err = pack_micro_batches(&[10, 20, 30, 301, 5], 300).unwrap_err().to_string();
    assert!(
        err.contains("sample 3") && err.contains("301") && err.contains("300"),
        "unhelpful error: {err}"
    );
    let err = pack_micro_batches(&[10, 0], 300).unwrap_err().to_string();
    assert!(err.contains("sample 1") && err.contains("empty"), "{err}");
    assert!(pack_micro_batches(&[10], 0).is_err());
    assert_eq!(pack_micro_batches(&[], 10).unwrap(), Vec::<Vec<usize>>::new());
}

#[test]
fn fixed_micro_batches_are_consecutive_chunks() -> Result<()> {
    assert_eq!(
        fixed_micro_batches(10, 4)?,
        vec![vec![0, 1, 2, 3], vec![4, 5, 6, 7], vec![8, 9]]
    );
    assert_eq!(fixed_micro_batches(0, 4)?, Vec::<Vec<usize>>::new());
    assert!(fixed_micro_batches(3, 0).is_err());
    let lengths = [5, 900, 7, 3];
    let fixed = MicroBatchPolicy::Fixed { micro_batch_size: 2 }.plan(&lengths)?;
    assert_eq!(fixed, vec![vec![0, 1], vec![2, 3]]);
    let dynamic = MicroBatchPolicy::Dynamic {
        max_tokens_per_gpu: 1000,
    }
    .plan(&lengths)?;
    assert_eq!(dynamic, vec![vec![0, 1, 2, 3]]);
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// Balancing across DP ranks
// ------------------------------------------------------------------------------------------------

#[test]
fn balance_covers_once_and_beats_greedy() {
    let mut rng = Rng::new(3);
    let (mut kk_wins, mut kk_losses, mut trials) = (0, 0, 0);
    for trial in 0..500 {
        let k = 1 + rand_below(&mut rng, 8);
        let n = 1 + rand_below(&mut rng, 80);
        let equal = trial % 2 == 0;
        // Mix short and long-tailed length distributions.
        let lengths: Vec<usize> = if trial % 3 == 0 {
            (0..n).map(|_| 1 + (rng.uniform().powi(4) * 16384.0) as usize).collect()
        } else {
            random_lengths(&mut rng, n, 1, 4096)
        };
        let w: Vec<u64> = lengths.iter().map(|&l| l as u64).collect();
        let max_item = *w.iter().max().unwrap();

        let parts = balance_across_ranks(&lengths, k, equal);
        assert_eq!(parts.len(), k);
        assert_covers(&parts, n);
        for p in &parts {
            assert!(p.windows(2).all(|x| x[0] < x[1]), "rank indices not ascending");
        }
        if equal {
            let counts: Vec<usize> = parts.iter().map(Vec::len).collect();
            let (lo, hi) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
            assert!(hi - lo <= 1, "equal_size counts {counts:?}");
            if (n / k) * k == n {
                assert_eq!(lo, hi, "equal_size counts {counts:?}");
            }
        }

        let kk = karmarkar_karp(&w, k, equal);
        let greedy = greedy_partition(&w, k, equal);
        assert_covers(&kk, n);
        assert_covers(&greedy, n);
        let (s_best, s_kk, s_greedy) = (spread(&parts, &w), spread(&kk, &w), spread(&greedy, &w));
        // Never worse than the greedy baseline; never above the largest item (a bound both
        // largest differencing and LPT satisfy: each merge / placement keeps spread <= max item).
        assert!(s_best <= s_greedy, "trial {trial}: {s_best} > greedy {s_greedy}");
        assert!(s_best <= s_kk, "trial {trial}: {s_best} > plain KK {s_kk}");
        assert!(
            s_kk <= max_item,
            "trial {trial}: KK spread {s_kk} > max item {max_item}"
        );
        assert!(s_greedy <= max_item);
        if n >= k {
            trials += 1;
            kk_wins += (s_kk < s_greedy) as usize;
            kk_losses += (s_kk > s_greedy) as usize;
        }
    }
    eprintln!("plain KK vs greedy LPT over {trials} instances: better {kk_wins}, worse {kk_losses}");
    assert!(
        kk_wins > 4 * kk_losses,
        "KK should usually beat greedy: {kk_wins} vs {kk_losses}"
    );
}

#[test]
fn balance_known_instance_reaches_the_optimum() {
    // {8, 7, 6, 5, 4} into 2: greedy LPT ends at 17 / 13, largest differencing at 16 / 14, one swap
    // of the refinement reaches the perfect 15 / 15.
    let lengths = [8, 7, 6, 5, 4];
    let w: Vec<u64> = lengths.iter().map(|&l| l as u64).collect();
    assert_eq!(spread(&greedy_partition(&w, 2, false), &w), 4);
    assert_eq!(spread(&karmarkar_karp(&w, 2, false), &w), 2);
    let parts = balance_across_ranks(&lengths, 2, false);
    assert_eq!(sums(&parts, &lengths), vec![15, 15]);
}

#[test]
fn balance_edge_cases() {
    assert_eq!(balance_across_ranks(&[3, 1, 2], 1, true), vec![vec![0, 1, 2]]);
    let parts = balance_across_ranks(&[5, 9], 4, false);
    assert_covers(&parts, 2);
    assert_eq!(parts.iter().filter(|p| p.is_empty()).count(), 2);
    let parts = balance_across_ranks(&[5, 9, 1], 4, true);
    assert_covers(&parts, 3);
    assert!(parts.iter().all(|p| p.len() <= 1));
    assert_eq!(balance_across_ranks(&[], 3, true), vec![Vec::<usize>::new(); 3]);
    // Deterministic.
    let l: Vec<usize> = (0..50).map(|i| (i * 37) % 101 + 1).collect();
    assert_eq!(balance_across_ranks(&l, 4, true), balance_across_ranks(&l, 4, true));
}

// ------------------------------------------------------------------------------------------------
// Micro-batch layout
// ------------------------------------------------------------------------------------------------

#[test]
fn micro_batch_maps_outputs_to_response_tokens() -> Result<()> {
    let a: Vec<u32> = vec![1, 2, 3, 4, 5]; // prompt 2, response 3
    let b: Vec<u32> = vec![6, 7, 8]; // prompt 1, response 2, second response token masked out
    let mask_b = [1.0f32, 0.0];
    let samples = [
        SampleView {
            tokens: &a,
            response_length: 3,
            loss_mask: None,
        },
        SampleView {
            tokens: &b,
            response_length: 2,
            loss_mask: Some(&mask_b),
        },
    ];
    // Packed in the order [1, 0].
    let mb = MicroBatch::new(&samples, &[1, 0])?;
    assert_eq!(&*mb.batch.input_ids, &[6, 7, 8, 1, 2, 3, 4, 5]);
    assert_eq!(mb.response_ranges, vec![0..2, 4..7]);
    assert_eq!(mb.loss_mask, vec![1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0]);
    // The target at each response position is the response token itself.
    for (j, &i) in mb.sample_indices.iter().enumerate() {
        let s = &samples[i];
        let resp = &s.tokens[s.prompt_length()..];
        let targets: Vec<u32> = mb.response_ranges[j].clone().map(|p| mb.batch.targets[p]).collect();
        assert_eq!(targets, resp);
    }
    // Host values in, packed tensor, host values out.
    let per_sample = vec![vec![0.5f32, -1.0, 2.0], vec![3.0f32, 4.0]];
    let packed = mb.packed_from_responses(&per_sample, &Device::Cpu)?;
    assert_eq!(packed.to_vec1::<f32>()?, vec![3.0, 4.0, 0.0, 0.0, 0.5, -1.0, 2.0, 0.0]);
    let back = mb.responses_from_packed(&packed)?;
    assert_eq!(back, vec![(1, per_sample[1].clone()), (0, per_sample[0].clone())]);
    // Loss weights: sample-mean over a global batch of 4 samples, and per-token over 10 tokens.
    let w = mb.loss_weights(LossNorm::SampleMean { global_batch_size: 4 });
    assert_eq!(w, vec![0.25, 0.0, 0.0, 0.0, 1.0 / 12.0, 1.0 / 12.0, 1.0 / 12.0, 0.0]);
    let w = mb.loss_weights(LossNorm::PerToken {
        global_num_tokens: 10.0,
    });
    assert_eq!(w, vec![0.1, 0.0, 0.0, 0.0, 0.1, 0.1, 0.1, 0.0]);
    assert_eq!(global_num_tokens(&samples), 4.0);

    // Errors name the sample.
    let bad_mask = [1.0f32];
    let bad = [SampleView {
        tokens: &a,
        response_length: 3,
        loss_mask: Some(&bad_mask),
    }];
    assert!(MicroBatch::new(&bad, &[0])
        .unwrap_err()
        .to_string()
        .contains("sample 0"));
    let no_prompt = [SampleView {
        tokens: &b,
        response_length: 3,
        loss_mask: None,
    }];
    assert!(MicroBatch::new(&no_prompt, &[0]).is_err());
    assert!(MicroBatch::new(&samples, &[2]).is_err());
    Ok(())
}

// ------------------------------------------------------------------------------------------------
// Gradient accumulation equivalence
// ------------------------------------------------------------------------------------------------

struct RlData {
    tokens: Vec<Vec<u32>>,
    response_lengths: Vec<usize>,
    masks: Vec<Vec<f32>>,
    advantages: Vec<Vec<f32>>,
}

impl RlData {
    fn random(n: usize, vocab: u32, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let mut d = RlData {
            tokens: vec![],
            response_lengths: vec![],
            masks: vec![],
            advantages: vec![],
        };
        for s in 0..n {
            let len = 6 + rand_below(&mut rng, 43); // 6..=48
            let prompt = 1 + rand_below(&mut rng, 12.min(len - 1));
            let r = len - prompt;
            d.tokens
                .push((0..len).map(|_| (rng.next_u64() % vocab as u64) as u32).collect());
            d.response_lengths.push(r);
            // Sample 3 has every response token masked out (its mean clamps the count to 1).
            d.masks.push(
                (0..r)
                    .map(|_| if s != 3 && rng.uniform() < 0.8 { 1.0 } else { 0.0 })
                    .collect(),
            );
            d.advantages.push((0..r).map(|_| rng.normal() as f32).collect());
        }
        d
    }

    fn views(&self) -> Vec<SampleView<'_>> {
        (0..self.tokens.len())
            .map(|i| SampleView {
                tokens: &self.tokens[i],
                response_length: self.response_lengths[i],
                loss_mask: Some(&self.masks[i]),
            })
            .collect()
    }
}

/// Loss and summed gradients over the micro-batches `plan`, each scaled by `norm_of(mb)`.
fn accumulate(
    model: &Qwen3,
    data: &RlData,
    plan: &[Vec<usize>],
    recompute: Recompute,
    norm_of: &dyn Fn(&MicroBatch) -> LossNorm,
) -> Result<(f64, BTreeMap<String, Tensor>)> {
    let views = data.views();
    let mut total = 0.0;
    let mut acc: BTreeMap<String, Tensor> = BTreeMap::new();
    for idx in plan {
        let mb = MicroBatch::new(&views, idx)?;
        let adv = mb.packed_from_responses(&data.advantages, model.device())?;
        let norm = norm_of(&mb);
        // A per-token objective: advantage-weighted log-prob plus a small entropy bonus.
        let (loss, grads) = model.forward_backward(&mb.batch, recompute, |o| {
            let x = ((&o.logprobs * &adv)? + (&o.entropy * 0.01)?)?;
            mb.reduce_loss(&x, norm)
        })?;
        total += loss;
        for (name, g) in grads.params {
            let g = match acc.remove(&name) {
                Some(a) => (a + g)?,
                None => g,
            };
            acc.insert(name, g);
        }
    }
    Ok((total, acc))
}

/// The global objective computed on the host, in f64, from one forward over every sample:
/// `sum_s c_s * sum_t m_st (A_st logp_st + 0.01 H_st)` with `c_s` from `norm`.
fn host_objective(model: &Qwen3, data: &RlData, norm: LossNorm) -> Result<f64> {
    let views = data.views();
    let all: Vec<usize> = (0..views.len()).collect();
    let mb = MicroBatch::new(&views, &all)?;
    let out = model.logprobs_entropy(&mb.batch)?;
    let lp = mb.responses_from_packed(&out.logprobs)?;
    let ent = mb.responses_from_packed(&out.entropy)?;
    let mut total = 0.0;
    for ((i, lp), (_, h)) in lp.into_iter().zip(ent) {
        let m = &data.masks[i];
        let a = &data.advantages[i];
        let s: f64 = (0..m.len())
            .map(|t| m[t] as f64 * (a[t] as f64 * lp[t] as f64 + 0.01 * h[t] as f64))
            .sum();
        let count = m.iter().map(|&x| x as f64).sum::<f64>().max(1.0);
        total += match norm {
            LossNorm::SampleMean { global_batch_size } => s / count / global_batch_size as f64,
            LossNorm::PerToken { global_num_tokens } => s / global_num_tokens,
        };
    }
    Ok(total)
}

fn assert_grads_close(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>, tol: f64) -> Result<f64> {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    let mut worst: f64 = 0.0;
    for (name, ga) in a {
        let e = rel_err(ga, &b[name])?;
        assert!(e <= tol, "{name}: relative error {e:e} > {tol:e}");
        worst = worst.max(e);
    }
    Ok(worst)
}

#[test]
fn accumulated_micro_batch_gradients_equal_the_global_batch_gradient() -> Result<()> {
    let model = Qwen3::load_hf(&fixture("tied_gqa"), DType::F32, &Device::Cpu)?;
    let data = RlData::random(10, model.config().vocab_size as u32, 11);
    let lengths: Vec<usize> = data.tokens.iter().map(Vec::len).collect();
    let n = lengths.len();
    let whole = vec![(0..n).collect::<Vec<_>>()];
    let cap = 64;
    let plan = pack_micro_batches(&lengths, cap)?;
    assert!(
        plan.len() >= 4,
        "want several micro-batches, got {plan:?} for {lengths:?}"
    );
    assert!(plan
        .iter()
        .all(|mb| mb.iter().map(|&i| lengths[i]).sum::<usize>() <= cap));

    let sample_mean = LossNorm::SampleMean { global_batch_size: n };
    let per_token = LossNorm::PerToken {
        global_num_tokens: global_num_tokens(&data.views()),
    };
    for norm in [sample_mean, per_token] {
        let (loss_full, g_full) = accumulate(&model, &data, &whole, Recompute::None, &|_| norm)?;
        let (loss_acc, g_acc) = accumulate(&model, &data, &plan, Recompute::Full, &|_| norm)?;
        let host = host_objective(&model, &data, norm)?;
        assert!(
            (loss_full - host).abs() <= 1e-5 * host.abs().max(1e-3),
            "{norm:?}: packed loss {loss_full} vs host formula {host}"
        );
        assert!(
            (loss_acc - loss_full).abs() <= 1e-5 * loss_full.abs().max(1e-3),
            "{norm:?}: accumulated loss {loss_acc} vs {loss_full}"
        );
        let worst = assert_grads_close(&g_acc, &g_full, 1e-5)?;
        eprintln!(
            "{norm:?}: {} micro-batches, loss {loss_full:.6}, worst gradient rel err {worst:e}",
            plan.len()
        );
    }

    // The scaling matters: normalising each micro-batch by its OWN token count (instead of the
    // global one) gives a different gradient.
    let (_, g_full) = accumulate(&model, &data, &whole, Recompute::None, &|_| per_token)?;
    let views = data.views();
    let local = |mb: &MicroBatch| LossNorm::PerToken {
        global_num_tokens: mb.sample_indices.iter().map(|&i| views[i].clamped_loss_tokens()).sum(),
    };
    let (_, g_local) = accumulate(&model, &data, &plan, Recompute::None, &local)?;
    let e = rel_err(&g_local["model.norm.weight"], &g_full["model.norm.weight"])?;
    assert!(
        e > 1e-2,
        "local normalisation should not match the global gradient (rel err {e:e})"
    );
    Ok(())
}

#[test]
fn micro_batches_of_balanced_ranks_also_accumulate_exactly() -> Result<()> {
    // Two DP ranks (simulated): balance samples, pack each rank's share, and SUM both ranks'
    // accumulated gradients (the all-reduce): still the global-batch gradient.
    let model = Qwen3::load_hf(&fixture("tied_gqa"), DType::F32, &Device::Cpu)?;
    let data = RlData::random(10, model.config().vocab_size as u32, 12);
    let lengths: Vec<usize> = data.tokens.iter().map(Vec::len).collect();
    let norm = LossNorm::SampleMean {
        global_batch_size: lengths.len(),
    };
    let (_, g_full) = accumulate(&model, &data, &[(0..lengths.len()).collect()], Recompute::None, &|_| {
        norm
    })?;
    let ranks = balance_across_ranks(&lengths, 2, true);
    let mut total: BTreeMap<String, Tensor> = BTreeMap::new();
    for rank in &ranks {
        let local_lengths: Vec<usize> = rank.iter().map(|&i| lengths[i]).collect();
        let plan: Vec<Vec<usize>> = pack_micro_batches(&local_lengths, 80)?
            .into_iter()
            .map(|mb| mb.into_iter().map(|j| rank[j]).collect())
            .collect();
        let (_, g) = accumulate(&model, &data, &plan, Recompute::None, &|_| norm)?;
        for (name, g) in g {
            let g = match total.remove(&name) {
                Some(a) => (a + g)?,
                None => g,
            };
            total.insert(name, g);
        }
    }
    assert_grads_close(&total, &g_full, 1e-5)?;
    Ok(())
}

/// Sequence parallelism pads a micro-batch to a multiple of the TP size with one padding sequence
/// after every sample: outside the responses and the loss mask, not counted as sample tokens, and
/// the samples' packed positions unchanged.
#[test]
fn padding_to_a_multiple_adds_one_masked_sequence() -> Result<()> {
    let a: Vec<u32> = vec![1, 2, 3, 4, 5];
    let b: Vec<u32> = vec![6, 7, 8];
    let samples = [
        SampleView {
            tokens: &a,
            response_length: 3,
            loss_mask: None,
        },
        SampleView {
            tokens: &b,
            response_length: 2,
            loss_mask: None,
        },
    ];
    let mut mb = MicroBatch::new(&samples, &[0, 1])?;
    let before = (mb.response_ranges.clone(), mb.loss_mask.clone());
    mb.pad_to_multiple(4)?; // 8 tokens: nothing to add
    assert_eq!(mb.num_tokens(), 8);
    mb.pad_to_multiple(3)?; // 8 -> 9
    assert_eq!((mb.num_tokens(), mb.sample_tokens()), (9, 8));
    assert_eq!(&*mb.batch.input_ids, &[1, 2, 3, 4, 5, 6, 7, 8, 0]);
    assert_eq!(mb.batch.num_sequences(), 3);
    assert_eq!(mb.response_ranges, before.0);
    assert_eq!(&mb.loss_mask[..8], &before.1[..]);
    assert_eq!(mb.loss_mask[8], 0.0);
    let x = Tensor::arange(0f32, 9.0, &Device::Cpu)?;
    let back = mb.responses_from_packed(&x)?;
    assert_eq!(back, vec![(0, vec![1.0, 2.0, 3.0]), (1, vec![5.0, 6.0])]);
    Ok(())
}
