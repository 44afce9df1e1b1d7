//! Batching: which samples share a micro-batch, which DP rank trains which samples, and how a
//! micro-batch's samples become one packed varlen batch whose per-token outputs map back to them.
//!
//! Decisions:
//! - Dynamic batching (`--use-dynamic-batch-size --max-tokens-per-gpu N`) packs samples with
//!   first-fit DECREASING: longest first, each into the first micro-batch with room. slime's
//!   `first_fit_pack` (slime/utils/seqlen_balancing.py) is plain first-fit in arrival order; sorting
//!   first costs nothing here and tightens the guarantee from FF's 1.7 OPT to FFD's
//!   `11/9 OPT + 6/9` micro-batches. Ties break by sample index, so the plan is deterministic;
//!   inside a micro-batch samples keep ascending index order. With context parallelism the caller
//!   passes `max_tokens_per_gpu * cp_size`, as slime's `build_dp_schedule` does.
//! - A sample longer than the cap is an error naming the sample, its length and the cap. slime lets
//!   such a sample run alone in an over-cap micro-batch (and risk OOM); vime never truncates and
//!   never silently exceeds the cap.
//! - Static batching (dynamic off): consecutive chunks of `micro_batch_size` samples, as slime's
//!   `_pack_step_into_mbs`.
//! - DP balancing: Karmarkar-Karp largest differencing for k partitions, ported in spirit from
//!   slime's `karmarkar_karp` / `get_seqlen_balanced_partitions` (verl's code): states of k sets are
//!   merged largest-spread first, pairing one state's heaviest set with the other's lightest.
//!   [`balance_across_ranks`] then improves on it: it polishes both KK and a greedy LPT partition
//!   with pairwise moves/swaps between the heaviest and lightest rank, and keeps whichever has the
//!   smaller spread (ties: KK). So its spread is never worse than greedy's, and never above the
//!   largest item (a bound both KK and LPT satisfy).
//! - The balanced quantity is the token count, as slime's `get_seqlen_balanced_partitions` over
//!   `total_lengths`. Newer slime `--balance-data` balances estimated forward FLOPs
//!   (`coeff * L + L^2`, the quadratic term for causal attention) over whole micro-batches; that
//!   cost can be passed to [`karmarkar_karp`] / [`balance_weights`] directly (they take any `u64`
//!   weights). For vime's sizes (max_tokens_per_gpu of a few thousand, hidden of several thousand)
//!   the linear term dominates, so tokens are the default.
//! - Loss normalisation across micro-batches ([`LossNorm`]): every micro-batch's loss is scaled by
//!   the GLOBAL normaliser (global batch size, or the global loss-token count), so the plain sum of
//!   micro-batch gradients (and a SUM all-reduce over DP) is the gradient of the global objective.
//!   This is the arithmetic slime's `loss_function` does with `num_microbatches / global_batch_size
//!   * dp_size` and Megatron's averaging, without the factors that cancel.
use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::ops::Range;
use vime_qwen3::batch::PackedBatch;

// ---------------------------------------------------------------------------------------------
// Micro-batch plans
// ---------------------------------------------------------------------------------------------

/// How a rank's samples are grouped into micro-batches (gradient-accumulation steps).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MicroBatchPolicy {
    /// `--use-dynamic-batch-size --max-tokens-per-gpu N`: as few micro-batches as first-fit
    /// decreasing finds, each holding at most `max_tokens_per_gpu` tokens.
    Dynamic { max_tokens_per_gpu: usize },
    /// `--micro-batch-size N`: consecutive chunks of `micro_batch_size` samples.
    Fixed { micro_batch_size: usize },
}

impl MicroBatchPolicy {
    /// Sample indices of each micro-batch, for samples of the given token lengths.
    pub fn plan(&self, lengths: &[usize]) -> Result<Vec<Vec<usize>>> {
        match *self {
            MicroBatchPolicy::Dynamic { max_tokens_per_gpu } => pack_micro_batches(lengths, max_tokens_per_gpu),
            MicroBatchPolicy::Fixed { micro_batch_size } => fixed_micro_batches(lengths.len(), micro_batch_size),
        }
    }
}

/// Groups sample indices into micro-batches of at most `max_tokens_per_gpu` tokens each, by
/// first-fit decreasing (see the module notes). Every index appears exactly once; indices inside
/// a micro-batch are ascending. A sample longer than the cap, or empty, is an error.
pub fn pack_micro_batches(lengths: &[usize], max_tokens_per_gpu: usize) -> Result<Vec<Vec<usize>>> {
    ensure!(max_tokens_per_gpu > 0, "max_tokens_per_gpu must be positive");
    for (i, &len) in lengths.iter().enumerate() {
        if len == 0 {
            bail!("sample {i} is empty (0 tokens); every sample needs at least one token");
        }
        if len > max_tokens_per_gpu {
            bail!(
                "sample {i} has {len} tokens, more than max_tokens_per_gpu = {max_tokens_per_gpu}; \
                 raise --max-tokens-per-gpu (x cp_size with context parallelism) or cap the rollout length \
                 (samples are never truncated)"
            );
        }
    }
    let mut order: Vec<usize> = (0..lengths.len()).collect();
    order.sort_by(|&a, &b| lengths[b].cmp(&lengths[a]).then(a.cmp(&b)));
    let mut bins: Vec<Vec<usize>> = Vec::new();
    let mut room: Vec<usize> = Vec::new();
    for i in order {
        match room.iter().position(|&r| r >= lengths[i]) {
            Some(b) => {
                bins[b].push(i);
                room[b] -= lengths[i];
            }
            None => {
                bins.push(vec![i]);
                room.push(max_tokens_per_gpu - lengths[i]);
            }
        }
    }
    for b in &mut bins {
        b.sort_unstable();
    }
    Ok(bins)
}

/// Static micro-batches: `[0..m), [m..2m), ...` for `num_samples` samples (the last may be short).
pub fn fixed_micro_batches(num_samples: usize, micro_batch_size: usize) -> Result<Vec<Vec<usize>>> {
    ensure!(micro_batch_size > 0, "micro_batch_size must be positive");
    Ok((0..num_samples)
        .step_by(micro_batch_size)
        .map(|s| (s..(s + micro_batch_size).min(num_samples)).collect())
        .collect())
}

// ---------------------------------------------------------------------------------------------
// Balancing across DP ranks
// ---------------------------------------------------------------------------------------------

/// Splits samples across `dp_size` ranks so that the ranks' token totals are as even as this
/// module knows how (see the module notes). With `equal_size`, every rank gets the same number of
/// samples (when `lengths.len()` is not a multiple of `dp_size`, counts differ by at most one).
/// Returns each rank's sample indices, ascending; with fewer samples than ranks some are empty.
///
/// Panics when `dp_size == 0` (`ParallelDims` never builds one).
pub fn balance_across_ranks(lengths: &[usize], dp_size: usize, equal_size: bool) -> Vec<Vec<usize>> {
    let w: Vec<u64> = lengths.iter().map(|&l| l as u64).collect();
    balance_weights(&w, dp_size, equal_size)
}

/// [`balance_across_ranks`] for arbitrary per-item costs (e.g. estimated FLOPs).
pub fn balance_weights(weights: &[u64], k: usize, equal_size: bool) -> Vec<Vec<usize>> {
    let mut kk = karmarkar_karp(weights, k, equal_size);
    refine(&mut kk, weights, !equal_size);
    let mut greedy = greedy_partition(weights, k, equal_size);
    refine(&mut greedy, weights, !equal_size);
    let mut best = if spread(&greedy, weights) < spread(&kk, weights) {
        greedy
    } else {
        kk
    };
    for p in &mut best {
        p.sort_unstable();
    }
    best
}

/// `max - min` of the partitions' weight sums.
pub fn spread(parts: &[Vec<usize>], weights: &[u64]) -> u64 {
    let sums: Vec<u64> = parts.iter().map(|p| p.iter().map(|&i| weights[i]).sum()).collect();
    sums.iter().max().copied().unwrap_or(0) - sums.iter().min().copied().unwrap_or(0)
}

/// One set of a KK state: its weight sum and item indices (insertion order).
#[derive(Clone, PartialEq, Eq)]
struct KkSet {
    sum: u64,
    items: Vec<usize>,
}

impl Ord for KkSet {
    fn cmp(&self, o: &Self) -> Ordering {
        (self.sum, self.items.len(), &self.items).cmp(&(o.sum, o.items.len(), &o.items))
    }
}
impl PartialOrd for KkSet {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}

/// A KK state: k sets, heaviest first. `id` (creation order) makes the heap order total.
struct KkState {
    sets: Vec<KkSet>,
    id: usize,
}

impl KkState {
    fn spread(&self) -> u64 {
        self.sets[0].sum - self.sets[self.sets.len() - 1].sum
    }
}

impl Ord for KkState {
    /// The heap pops the greatest: largest spread, then heaviest top set, then oldest.
    fn cmp(&self, o: &Self) -> Ordering {
        self.spread()
            .cmp(&o.spread())
            .then_with(|| self.sets[0].cmp(&o.sets[0]))
            .then_with(|| o.id.cmp(&self.id))
    }
}
impl PartialOrd for KkState {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl PartialEq for KkState {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for KkState {}

/// Karmarkar-Karp largest differencing into `k` partitions, as slime's `karmarkar_karp`: start
/// from one state per item (or, with `equal_size`, one state per run of `k` consecutive items in
/// ascending weight order, one item per set), then repeatedly merge the two states of largest
/// spread, heaviest set of one with lightest of the other. With `equal_size` and a count that is
/// not a multiple of `k`, zero-weight placeholders fill the last run (so counts differ by <= 1).
/// Partitions come back heaviest first; indices in merge order.
pub fn karmarkar_karp(weights: &[u64], k: usize, equal_size: bool) -> Vec<Vec<usize>> {
    assert!(k > 0, "cannot partition into 0 parts");
    let n = weights.len();
    // Items past `n` are placeholders of weight 0.
    let padded = if equal_size { n.div_ceil(k) * k } else { n };
    let weight = |i: usize| if i < n { weights[i] } else { 0 };
    let mut sorted: Vec<usize> = (0..padded).collect();
    sorted.sort_by_key(|&i| (weight(i), i));
    let empty = || KkSet {
        sum: 0,
        items: Vec::new(),
    };
    let mut heap = BinaryHeap::new();
    let groups: Vec<&[usize]> = if equal_size {
        sorted.chunks(k).collect()
    } else {
        sorted.chunks(1).collect()
    };
    for (id, group) in groups.into_iter().enumerate() {
        let mut sets: Vec<KkSet> = (0..k).map(|_| empty()).collect();
        for (s, &i) in sets.iter_mut().zip(group) {
            s.sum += weight(i);
            s.items.push(i);
        }
        sets.sort_by(|a, b| b.cmp(a));
        heap.push(KkState { sets, id });
    }
    let mut next_id = heap.len();
    while heap.len() > 1 {
        let (a, b) = (heap.pop().unwrap(), heap.pop().unwrap());
        let mut sets: Vec<KkSet> = a
            .sets
            .into_iter()
            .zip(b.sets.into_iter().rev())
            .map(|(mut x, y)| {
                x.sum += y.sum;
                x.items.extend(y.items);
                x
            })
            .collect();
        sets.sort_by(|a, b| b.cmp(a));
        heap.push(KkState { sets, id: next_id });
        next_id += 1;
    }
    match heap.pop() {
        Some(s) => s
            .sets
            .into_iter()
            .map(|s| s.items.into_iter().filter(|&i| i < n).collect())
            .collect(),
        None => vec![Vec::new(); k],
    }
}

/// Greedy LPT: items heaviest first, each onto the lightest partition (with `equal_size`, onto the
/// partition with the fewest items, then the lightest — slime's `greedy_partition` bias trick).
pub fn greedy_partition(weights: &[u64], k: usize, equal_size: bool) -> Vec<Vec<usize>> {
    assert!(k > 0, "cannot partition into 0 parts");
    let mut order: Vec<usize> = (0..weights.len()).collect();
    order.sort_by(|&a, &b| weights[b].cmp(&weights[a]).then(a.cmp(&b)));
    let mut parts = vec![Vec::new(); k];
    let mut sums = vec![0u64; k];
    for i in order {
        let p = (0..k)
            .min_by_key(|&p| {
                let count = if equal_size { parts[p].len() } else { 0 };
                (count, sums[p], p)
            })
            .unwrap();
        parts[p].push(i);
        sums[p] += weights[i];
    }
    parts
}

/// Local search: while some move (if `allow_moves`) or swap between the heaviest and lightest
/// partitions strictly lowers the global spread, apply the best one. Swaps keep partition sizes.
fn refine(parts: &mut [Vec<usize>], w: &[u64], allow_moves: bool) {
    let k = parts.len();
    if k < 2 {
        return;
    }
    let mut sums: Vec<u64> = parts.iter().map(|p| p.iter().map(|&i| w[i]).sum()).collect();
    // Each accepted step lowers the spread by >= 1; the cap only bounds pathological inputs.
    for _ in 0..4 * w.len() + 16 {
        let hi = (0..k).max_by_key(|&p| (sums[p], std::cmp::Reverse(p))).unwrap();
        let lo = (0..k).min_by_key(|&p| (sums[p], p)).unwrap();
        let cur = sums[hi] - sums[lo];
        if cur == 0 {
            return;
        }
        let (others_max, others_min) = (0..k)
            .filter(|&p| p != hi && p != lo)
            .fold((0u64, u64::MAX), |(mx, mn), p| (mx.max(sums[p]), mn.min(sums[p])));
        // Global spread after shifting weight `d` (0 < d < cur) from `hi` to `lo`. Convex in `d`
        // with a minimum at cur / 2, so the nearest candidates on each side of it suffice.
        let after = |d: u64| {
            let (h, l) = (sums[hi] - d, sums[lo] + d);
            h.max(l).max(others_max) - h.min(l).min(others_min)
        };
        let target = cur / 2;
        // (new spread, item leaving hi, item leaving lo or None for a move)
        let mut best: Option<(u64, usize, Option<usize>)> = None;
        let mut consider = |d: u64, a: usize, b: Option<usize>| {
            if d > 0 && d < cur {
                let s = after(d);
                if s < cur && best.is_none_or(|(bs, ..)| s < bs) {
                    best = Some((s, a, b));
                }
            }
        };
        if allow_moves {
            for &a in &parts[hi] {
                consider(w[a], a, None);
            }
        }
        let mut lo_sorted: Vec<usize> = parts[lo].clone();
        lo_sorted.sort_by_key(|&b| (w[b], b));
        for &a in &parts[hi] {
            // d = w[a] - w[b] closest to target from both sides: w[b] closest to w[a] - target.
            let want = w[a].saturating_sub(target);
            let pos = lo_sorted.partition_point(|&b| w[b] < want);
            for j in [pos.wrapping_sub(1), pos] {
                if let Some(&b) = lo_sorted.get(j) {
                    if w[a] > w[b] {
                        consider(w[a] - w[b], a, Some(b));
                    }
                }
            }
        }
        let Some((_, a, b)) = best else { return };
        parts[hi].retain(|&x| x != a);
        parts[lo].push(a);
        sums[hi] -= w[a];
        sums[lo] += w[a];
        if let Some(b) = b {
            parts[lo].retain(|&x| x != b);
            parts[hi].push(b);
            sums[lo] -= w[b];
            sums[hi] += w[b];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Micro-batch tensors
// ---------------------------------------------------------------------------------------------

/// One rollout sample as the trainer sees it: `tokens` = prompt + response, the last
/// `response_length` of which are the response; `loss_mask` (one entry per response token, 1 to
/// train on it, 0 to skip it; `None` = all ones), slime's `loss_masks`.
#[derive(Debug, Clone, Copy)]
pub struct SampleView<'a> {
    pub tokens: &'a [u32],
    pub response_length: usize,
    pub loss_mask: Option<&'a [f32]>,
}

impl<'a> SampleView<'a> {
    pub fn prompt_length(&self) -> usize {
        self.tokens.len() - self.response_length
    }

    /// `max(1, sum(loss_mask))`: the sample's token count as slime's normalisers count it.
    pub fn clamped_loss_tokens(&self) -> f64 {
        let s: f64 = match self.loss_mask {
            Some(m) => m.iter().map(|&x| x as f64).sum(),
            None => self.response_length as f64,
        };
        s.max(1.0)
    }
}

/// The global normaliser of the loss, shared by every micro-batch of one optimizer step (across all
/// DP ranks), so that summing micro-batch gradients (and SUM-reducing over DP) gives the gradient
/// of the global objective.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LossNorm {
    /// slime's default: `(1 / global_batch_size) * sum_s (sum_t m_st x_st) / max(1, sum_t m_st)`.
    SampleMean { global_batch_size: usize },
    /// `--calculate-per-token-loss`: `sum_s sum_t m_st x_st / global_num_tokens`, where
    /// `global_num_tokens = sum_s max(1, sum_t m_st)` over the whole global batch (slime's
    /// `num_tokens`, see [`global_num_tokens`]).
    PerToken { global_num_tokens: f64 },
}

/// `sum_s max(1, sum(loss_mask_s))` over `samples`: the [`LossNorm::PerToken`] normaliser.
pub fn global_num_tokens(samples: &[SampleView]) -> f64 {
    samples.iter().map(SampleView::clamped_loss_tokens).sum()
}

/// The selected samples of one micro-batch packed end to end, plus the host-side map from packed
/// positions back to samples.
///
/// The model's per-token outputs at packed position `p` are about the token at `p + 1` of the same
/// sequence (the next-token log-prob; for a critic, the value of the state before that token). So
/// sample `j`'s response token `r` (0-based) is read at packed position
/// `cu_seqlens[j] + prompt_length - 1 + r`: `response_ranges[j]` is that range, as slime's
/// `get_responses` slices `logits[start - 1 : end - 1]`. A response therefore needs a prompt of at
/// least one token.
#[derive(Debug, Clone)]
pub struct MicroBatch {
    pub batch: PackedBatch,
    /// Global sample index of each packed sequence, in packed order.
    pub sample_indices: Vec<usize>,
    /// Per packed sequence: the packed positions whose outputs belong to its response tokens.
    pub response_ranges: Vec<Range<usize>>,
    /// `[T]`: the loss mask placed on packed positions (0 outside responses).
    pub loss_mask: Vec<f32>,
    /// Per packed sequence: `max(1, sum(loss_mask))`.
    clamped_loss_tokens: Vec<f64>,
    /// Padding tokens appended by [`Self::pad_to_multiple`] (after every sample).
    padding: usize,
}

impl MicroBatch {
    /// Packs `samples[i]` for each `i` in `indices` (in that order).
    pub fn new(samples: &[SampleView], indices: &[usize]) -> Result<Self> {
        ensure!(!indices.is_empty(), "a micro-batch needs at least one sample");
        let mut seqs = Vec::with_capacity(indices.len());
        let mut response_ranges = Vec::with_capacity(indices.len());
        let mut loss_mask = Vec::new();
        let mut clamped = Vec::with_capacity(indices.len());
        let mut start = 0usize;
        for &i in indices {
            let s = samples
                .get(i)
                .with_context(|| format!("sample index {i} out of range ({} samples)", samples.len()))?;
            let (len, r) = (s.tokens.len(), s.response_length);
            ensure!(
                r < len,
                "sample {i}: response_length {r} needs at least one prompt token before it ({len} tokens in all)"
            );
            if let Some(m) = s.loss_mask {
                ensure!(
                    m.len() == r,
                    "sample {i}: loss_mask has {} entries, response_length is {r}",
                    m.len()
                );
            }
            let resp = start + len - r - 1..start + len - 1;
            loss_mask.resize(start + len, 0.0);
            match s.loss_mask {
                Some(m) => loss_mask[resp.clone()].copy_from_slice(m),
                None => loss_mask[resp.clone()].fill(1.0),
            }
            response_ranges.push(resp);
            clamped.push(s.clamped_loss_tokens());
            seqs.push(s.tokens);
            start += len;
        }
        let batch = PackedBatch::from_sequences(&seqs).with_context(|| format!("packing samples {indices:?}"))?;
        Ok(Self {
            batch,
            sample_indices: indices.to_vec(),
            response_ranges,
            loss_mask,
            clamped_loss_tokens: clamped,
            padding: 0,
        })
    }

    /// Packed tokens, padding included (the length of every per-token tensor of the batch).
    pub fn num_tokens(&self) -> usize {
        self.batch.num_tokens()
    }

    /// The samples' tokens (padding excluded): what throughput counts.
    pub fn sample_tokens(&self) -> usize {
        self.batch.num_tokens() - self.padding
    }

    /// Appends one padding sequence (token 0, outside every response and the loss mask) so the
    /// packed token count is a multiple of `m`: sequence parallelism splits the tokens evenly over
    /// the TP ranks. vime pads to the TP size itself (at most `m - 1` tokens); slime pads to TP x
    /// 128, for kernel shapes vime's varlen kernels do not need.
    pub fn pad_to_multiple(&mut self, m: usize) -> Result<()> {
        let t = self.batch.num_tokens();
        let k = if m <= 1 { 0 } else { (m - t % m) % m };
        if k == 0 {
            return Ok(());
        }
        let mut seqs: Vec<Vec<u32>> = (0..self.batch.num_sequences())
            .map(|s| self.batch.input_ids[self.batch.seq_range(s)].to_vec())
            .collect();
        seqs.push(vec![0; k]);
        self.batch = PackedBatch::from_sequences(&seqs).context("padding a micro-batch")?;
        self.loss_mask.resize(t + k, 0.0);
        self.padding += k;
        Ok(())
    }

    pub fn num_samples(&self) -> usize {
        self.sample_indices.len()
    }

    /// Per packed position, the weight `c_p` such that this micro-batch's share of the global loss
    /// is `sum_p c_p * x_p` for per-token values `x` (`[T]`):
    /// `SampleMean`: `m_p / max(1, sum m of its sample) / global_batch_size`;
    /// `PerToken`: `m_p / global_num_tokens`.
    pub fn loss_weights(&self, norm: LossNorm) -> Vec<f32> {
        let mut c = vec![0f32; self.num_tokens()];
        for (j, range) in self.response_ranges.iter().enumerate() {
            let scale = match norm {
                LossNorm::SampleMean { global_batch_size } => {
                    1.0 / (self.clamped_loss_tokens[j] * global_batch_size as f64)
                }
                LossNorm::PerToken { global_num_tokens } => 1.0 / global_num_tokens,
            };
            for p in range.clone() {
                c[p] = (self.loss_mask[p] as f64 * scale) as f32;
            }
        }
        c
    }

    /// This micro-batch's share of the global loss for per-token values `x` (`[T]`; reduced in f32,
    /// or f64 when `x` is f64): `sum_p loss_weights[p] * x_p`. Differentiable in `x`.
    pub fn reduce_loss(&self, x: &Tensor, norm: LossNorm) -> Result<Tensor> {
        ensure!(
            x.dims() == [self.num_tokens()],
            "per-token values of shape {:?} for a micro-batch of {} tokens",
            x.dims(),
            self.num_tokens()
        );
        let dtype = if x.dtype() == DType::F64 {
            DType::F64
        } else {
            DType::F32
        };
        let c = Tensor::from_vec(self.loss_weights(norm), self.num_tokens(), x.device())?.to_dtype(dtype)?;
        Ok((x.to_dtype(dtype)? * c)?.sum_all()?)
    }

    /// `[T]` f32 tensor of per-response-token host values (`per_sample[i]` for global sample `i`,
    /// one value per response token, e.g. advantages or old log-probs) placed at their packed
    /// positions; 0 elsewhere.
    pub fn packed_from_responses<S: AsRef<[f32]>>(&self, per_sample: &[S], device: &Device) -> Result<Tensor> {
        let mut v = vec![0f32; self.num_tokens()];
        for (&i, range) in self.sample_indices.iter().zip(&self.response_ranges) {
            let src = per_sample
                .get(i)
                .with_context(|| format!("no per-sample values for sample {i}"))?
                .as_ref();
            ensure!(
                src.len() == range.len(),
                "sample {i}: {} values for {} response tokens",
                src.len(),
                range.len()
            );
            v[range.clone()].copy_from_slice(src);
        }
        Ok(Tensor::from_vec(v, self.num_tokens(), device)?)
    }

    /// The inverse: per-token model outputs (`[T]`) read back per sample as
    /// `(global sample index, response values)`, e.g. to store old log-probs or values.
    pub fn responses_from_packed(&self, x: &Tensor) -> Result<Vec<(usize, Vec<f32>)>> {
        ensure!(
            x.dims() == [self.num_tokens()],
            "per-token values of shape {:?} for a micro-batch of {} tokens",
            x.dims(),
            self.num_tokens()
        );
        let v: Vec<f32> = x.to_dtype(DType::F32)?.to_vec1()?;
        Ok(self
            .sample_indices
            .iter()
            .zip(&self.response_ranges)
            .map(|(&i, r)| (i, v[r.clone()].to_vec()))
            .collect())
    }
}
