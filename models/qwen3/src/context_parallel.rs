//! Context parallelism (Megatron's `--context-parallel-size`, zigzag), at the model level: each
//! sequence of a packed batch is padded to a multiple of `2 cp` tokens and cut into `2 cp` equal
//! chunks; CP rank `r` holds chunks `r` and `2 cp - 1 - r` of every sequence (slime's
//! `cp_utils.py`, Megatron's layout), so the causal attention work is even across ranks.
//!
//! - [`CpShard::new`] builds a rank's local [`PackedBatch`] from the global one: its chunks back to
//!   back, positions global (RoPE), targets global (a chunk's last token predicts the first token
//!   of the next chunk, held by another rank), padding tokens with no target. `cu_seqlens` bounds
//!   the query chunks (two per sequence).
//! - Attention: every rank's roped K and V are all-gathered over CP (GQA makes them 4x smaller
//!   than Q at Qwen3-4B), and each local query chunk `j` of a sequence attends the sequence's
//!   chunks `0..=j` (an index list into the gathered buffer; the kernel's bottom-right causal mask
//!   with `L_k = (j + 1) c > L_q = c` gives each query its prefix). Backward: the attention
//!   backward on the same keys, `dK`/`dV` scattered back into the gathered layout (`index_add_rows`)
//!   and reduce-scattered over CP to their owners. The gathered keys are not saved: the backward
//!   gathers them again, as sequence parallelism does.
//! - Everything else in the model is token-local: a CP rank's gradients are its tokens' share,
//!   summed over CP by the caller (the trainer folds CP into the data-parallel reduction), and a
//!   loss that is a sum over tokens is the sum of the ranks' local losses.
use crate::batch::PackedBatch;
use anyhow::{anyhow, ensure, Result};
use candle_core::Tensor;
use std::sync::Arc;
use vime_dist::{Collectives, ReduceOp};
use vime_kernels::lm_head::IGNORE_TARGET;

/// A rank's share of a packed batch under context parallelism, and what its attention needs.
#[derive(Debug, Clone)]
pub struct CpShard {
    pub cp: usize,
    pub rank: usize,
    /// The local tokens: both chunks of every sequence, in sequence order.
    pub batch: PackedBatch,
    /// Key sequence bounds, one per query chunk: chunk `j` of a sequence sees `(j + 1) c` keys.
    pub cu_seqlens_k: Arc<[u32]>,
    /// For each key of the attention's key layout, its row in the CP all-gather of the ranks'
    /// local tokens (rank-major).
    pub kv_index: Arc<[u32]>,
    /// For each local token, its index in the global packed batch (`None`: padding).
    pub global_index: Vec<Option<u32>>,
    /// Chunk length of each sequence.
    pub chunk: Vec<usize>,
    /// The pad multiple it was built with (see [`CpShard::new`]).
    pub multiple: usize,
}

impl CpShard {
    /// Rank `rank` of `cp`'s share of `global`. Sequences are padded to a multiple of
    /// `2 cp x multiple` tokens (`multiple`: the TP size under sequence parallelism, else 1), so
    /// every chunk, and the local batch, splits over TP too.
    pub fn new(global: &PackedBatch, cp: usize, rank: usize, multiple: usize) -> Result<Self> {
        ensure!(cp >= 1 && rank < cp, "context-parallel rank {rank} of {cp}");
        ensure!(multiple >= 1, "pad multiple must be >= 1");
        let n = global.num_sequences();
        let unit = 2 * cp * multiple;
        let chunk: Vec<usize> = (0..n)
            .map(|s| global.seq_range(s).len().div_ceil(unit) * unit / (2 * cp))
            .collect();
        let local_t: usize = chunk.iter().map(|c| 2 * c).sum();
        let (mut ids, mut pos, mut tgt, mut gidx) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let mut cu_q = vec![0u32];
        for (s, &c) in chunk.iter().enumerate() {
            let range = global.seq_range(s);
            for j in [rank, 2 * cp - 1 - rank] {
                for p in j * c..(j + 1) * c {
                    let g = range.start + p;
                    if g < range.end {
                        ids.push(global.input_ids[g]);
                        tgt.push(global.targets[g]);
                        gidx.push(Some(g as u32));
                    } else {
                        ids.push(global.input_ids[range.start]);
                        tgt.push(IGNORE_TARGET);
                        gidx.push(None);
                    }
                    pos.push(p as u32);
                }
                cu_q.push(ids.len() as u32);
            }
        }
        // Where global chunk j of sequence s sits in the rank-major all-gather of local tokens.
        let mut seq_start = Vec::with_capacity(n);
        let mut acc = 0usize;
        for &c in &chunk {
            seq_start.push(acc);
            acc += 2 * c;
        }
        let at = |s: usize, j: usize| -> usize {
            let (owner, slot) = if j < cp { (j, 0) } else { (2 * cp - 1 - j, 1) };
            owner * local_t + seq_start[s] + slot * chunk[s]
        };
        let (mut kv_index, mut cu_k) = (Vec::new(), vec![0u32]);
        for (s, &c) in chunk.iter().enumerate() {
            for j in [rank, 2 * cp - 1 - rank] {
                for jj in 0..=j {
                    let base = at(s, jj);
                    kv_index.extend((base..base + c).map(|i| i as u32));
                }
                cu_k.push(kv_index.len() as u32);
            }
        }
        Ok(Self {
            cp,
            rank,
            batch: PackedBatch {
                input_ids: ids.into(),
                position_ids: pos.into(),
                cu_seqlens: cu_q.into(),
                targets: tgt.into(),
            },
            cu_seqlens_k: cu_k.into(),
            kv_index: kv_index.into(),
            global_index: gidx,
            chunk,
            multiple,
        })
    }

    /// Puts per-token values of the local batch (`[T_local, ..]`) back into the global batch's
    /// order: `[T_global, ..]` from every rank's local values (in rank order, as an all-gather of
    /// them returns), padding dropped.
    pub fn to_global(shards: &[CpShard], locals: &[Tensor], global_tokens: usize) -> Result<Tensor> {
        ensure!(shards.len() == locals.len(), "one local tensor per CP rank");
        let all = Tensor::cat(locals, 0)?;
        let index = Self::global_rows(shards, global_tokens)?;
        Ok(vime_kernels::rows::gather_rows(&all, &index)?)
    }

    /// Every rank's per-token values (`local`: `[T_local, ..]` on this rank) in the global batch's
    /// order, on every rank: an all-gather over `cp`, then the rows picked in global order. What a
    /// scoring pass returns under CP.
    pub fn gather_to_global(&self, global: &PackedBatch, local: &Tensor, cp: &dyn Collectives) -> Result<Tensor> {
        let shards = (0..self.cp)
            .map(|r| CpShard::new(global, self.cp, r, self.multiple))
            .collect::<Result<Vec<_>>>()?;
        let all = if self.cp == 1 {
            local.clone()
        } else {
            cp.all_gather(&local.contiguous()?)?
        };
        let n = global.num_tokens();
        let index = Self::global_rows(&shards, n)?;
        Ok(vime_kernels::rows::gather_rows(&all, &index)?)
    }

    /// For each global token, its row in the rank-major concatenation of the ranks' local batches.
    fn global_rows(shards: &[CpShard], global_tokens: usize) -> Result<Vec<u32>> {
        let mut rows: Vec<Option<u32>> = vec![None; global_tokens];
        let mut offset = 0usize;
        for sh in shards {
            for (i, g) in sh.global_index.iter().enumerate() {
                if let Some(g) = g {
                    rows[*g as usize] = Some((offset + i) as u32);
                }
            }
            offset += sh.global_index.len();
        }
        rows.iter()
            .enumerate()
            .map(|(g, r)| r.ok_or_else(|| anyhow!("global token {g} is on no CP rank")))
            .collect()
    }

    /// For each global token index in `global_positions`: its index in this rank's local batch, or
    /// `None` when another CP rank holds it.
    pub fn local_positions(&self, global_positions: &[usize]) -> Vec<Option<usize>> {
        let mut at = std::collections::HashMap::with_capacity(self.global_index.len());
        for (i, g) in self.global_index.iter().enumerate() {
            if let Some(g) = g {
                at.insert(*g as usize, i);
            }
        }
        global_positions.iter().map(|p| at.get(p).copied()).collect()
    }

    /// The keys (or values) each local query chunk attends: `[sum_k, heads, d]` from this rank's
    /// `[T_local, heads, d]`, through an all-gather over `cp`.
    pub(crate) fn gather_keys(&self, local: &Tensor, cp: &dyn Collectives) -> Result<Tensor> {
        let all = cp.all_gather(&local.contiguous()?)?;
        Ok(vime_kernels::rows::gather_rows(&all, &self.kv_index)?)
    }

    /// The gradient of [`Self::gather_keys`]: `d_keys [sum_k, heads, d]` back to this rank's
    /// tokens `[T_local, heads, d]` (summed over every chunk that attended them, on every rank).
    pub(crate) fn scatter_key_grads(
        &self,
        d_keys: &Tensor,
        local_like: &Tensor,
        cp: &dyn Collectives,
    ) -> Result<Tensor> {
        let t = local_like.dim(0)?;
        let all = vime_kernels::rows::index_add_rows(d_keys, &self.kv_index, t * self.cp)?;
        cp.reduce_scatter(&all, ReduceOp::Sum)
    }
}
