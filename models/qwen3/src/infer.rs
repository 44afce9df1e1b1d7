//! The inference forward: the training model's weights and kernels run over an external KV cache.
//!
//! One call, [`Qwen3::forward_with_cache`], serves prefill, decode and any mix of the two: each
//! sequence brings its new tokens, which are appended after the tokens its cache slot already
//! holds, at positions continuing from the cached length. [`Qwen3::prefill`] and
//! [`Qwen3::decode`] are the two common shapes of it.
//!
//! Decisions:
//! - The cache is a value the caller owns ([`KvCache`]), never state inside the model: the
//!   training model stays cache-free and one model serves any number of caches (one per rollout
//!   batch, one per thread).
//! - The layer is the training block (`crate::block`, same code, same kernels, same detached
//!   weights) with its `Attention::Cached` strategy: the attention keys and values are the cached
//!   ones followed by the new ones: `cu_seqlens_q` spans the new tokens, `cu_seqlens_k` the
//!   cached and the new keys, and the kernel's bottom-right causal alignment makes query `i` of a
//!   sequence see exactly its prefix. The tests hold both paths to the same logits.
//! - A slot stores per layer one `[capacity, n_kv_heads, head_dim]` K and V buffer in the model's
//!   dtype on its device, written in place (`slice_set`) and doubled when full, so appending a
//!   token costs no copy of the past. Each layer gathers the live rows of every sequence of the
//!   call into one packed K and V for the kernel: one copy of the live cache per layer per call.
//! - No gradient is ever tracked: every weight is read through `as_detached_tensor`.
use crate::block::Attention;
use crate::config::Qwen3Config;
use crate::model::{w, Qwen3};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::sync::Arc;
use vime_kernels::rms_norm;

/// Smallest buffer a slot allocates, in tokens.
const MIN_CAPACITY: usize = 16;

/// Keys and values of one sequence: per layer, `[capacity, n_kv_heads, head_dim]` buffers whose
/// first `len` rows are live.
struct Slot {
    len: usize,
    capacity: usize,
    k: Vec<Tensor>,
    v: Vec<Tensor>,
}

/// Per-sequence KV cache for [`Qwen3::forward_with_cache`]. Slots are caller-chosen ids, created
/// on first use; [`KvCache::free`] drops one.
pub struct KvCache {
    num_layers: usize,
    num_kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    device: Device,
    slots: BTreeMap<usize, Slot>,
}

impl KvCache {
    /// An empty cache for models of `cfg`, holding keys and values as `dtype` on `device` (use the
    /// model's: [`Qwen3::new_kv_cache`]).
    pub fn new(cfg: &Qwen3Config, dtype: DType, device: &Device) -> Self {
        Self::with_kv_heads(cfg, cfg.num_key_value_heads, dtype, device)
    }

    /// A cache holding `kv_heads` key/value heads per layer (a rank's local heads).
    pub(crate) fn with_kv_heads(cfg: &Qwen3Config, kv_heads: usize, dtype: DType, device: &Device) -> Self {
        Self {
            num_layers: cfg.num_hidden_layers,
            num_kv_heads: kv_heads,
            head_dim: cfg.head_dim,
            dtype,
            device: device.clone(),
            slots: BTreeMap::new(),
        }
    }

    /// Tokens cached for `slot` (0 for a slot never used or freed).
    pub fn seq_len(&self, slot: usize) -> usize {
        self.slots.get(&slot).map_or(0, |s| s.len)
    }

    /// Number of slots holding a sequence.
    pub fn num_slots(&self) -> usize {
        self.slots.len()
    }

    /// Drops the keys and values of `slot`; the id may be reused for a new sequence.
    pub fn free(&mut self, slot: usize) {
        self.slots.remove(&slot);
    }

    /// Drops every slot.
    pub fn clear(&mut self) {
        self.slots.clear();
    }

    /// Bytes of K and V per cached token (all layers).
    pub fn bytes_per_token(&self) -> usize {
        2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.size_in_bytes()
    }

    /// Bytes currently allocated by all slots (capacity, not just live rows).
    pub fn allocated_bytes(&self) -> usize {
        self.slots.values().map(|s| s.capacity).sum::<usize>() * self.bytes_per_token()
    }

    /// Makes `slot` able to hold `tokens` tokens without reallocating (creating it if needed).
    pub fn reserve(&mut self, slot: usize, tokens: usize) -> Result<()> {
        let (layers, shape_tail, dtype, device) = (
            self.num_layers,
            (self.num_kv_heads, self.head_dim),
            self.dtype,
            self.device.clone(),
        );
        let s = self.slots.entry(slot).or_insert_with(|| Slot {
            len: 0,
            capacity: 0,
            k: Vec::new(),
            v: Vec::new(),
        });
        if tokens <= s.capacity {
            return Ok(());
        }
        let live = s.len;
        let capacity = tokens.max(2 * s.capacity).max(MIN_CAPACITY);
        let grow = |old: Option<&Tensor>| -> Result<Tensor> {
            let t = Tensor::zeros((capacity, shape_tail.0, shape_tail.1), dtype, &device)?;
            if let (Some(old), true) = (old, live > 0) {
                t.slice_set(&old.narrow(0, 0, live)?, 0, 0)?;
            }
            Ok(t)
        };
        let k = (0..layers).map(|l| grow(s.k.get(l))).collect::<Result<Vec<_>>>()?;
        let v = (0..layers).map(|l| grow(s.v.get(l))).collect::<Result<Vec<_>>>()?;
        s.k = k;
        s.v = v;
        s.capacity = capacity;
        Ok(())
    }
}

impl KvCache {
    /// Writes the new keys and values of layer `layer` (`k, v: [T_new, kv_heads, d]`, sequence `s`
    /// owning rows `cu_seqlens_q[s]..cu_seqlens_q[s + 1]`) after the `past` rows of each slot of
    /// `seqs = [(slot, past)]` (reserved by the caller), and returns the packed cached + new keys
    /// and values of every sequence, in call order.
    pub(crate) fn append_and_gather(
        &self,
        layer: usize,
        seqs: &[(usize, usize)],
        cu_seqlens_q: &[u32],
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let mut ks = Vec::with_capacity(seqs.len());
        let mut vs = Vec::with_capacity(seqs.len());
        for (s, &(slot, p)) in seqs.iter().enumerate() {
            let buf = self
                .slots
                .get(&slot)
                .with_context(|| format!("KV cache slot {slot} was not reserved"))?;
            let (q0, n) = (
                cu_seqlens_q[s] as usize,
                (cu_seqlens_q[s + 1] - cu_seqlens_q[s]) as usize,
            );
            buf.k[layer].slice_set(&k.narrow(0, q0, n)?, 0, p)?;
            buf.v[layer].slice_set(&v.narrow(0, q0, n)?, 0, p)?;
            ks.push(buf.k[layer].narrow(0, 0, p + n)?);
            vs.push(buf.v[layer].narrow(0, 0, p + n)?);
        }
        Ok((Tensor::cat(&ks, 0)?, Tensor::cat(&vs, 0)?))
    }
}

/// Which rows [`Qwen3::forward_with_cache`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HiddenRows {
    /// The last new token of each sequence: `[num_sequences, hidden]`.
    Last,
    /// Every new token, packed in call order: `[total_new_tokens, hidden]`.
    All,
}

impl Qwen3 {
    /// An empty KV cache in this model's dtype, on its device.
    pub fn new_kv_cache(&self) -> KvCache {
        KvCache::with_kv_heads(self.config(), self.block_ctx().kv_heads, self.dtype(), self.device())
    }

    /// The LM head `[vocab, hidden]` (the embedding when tied), detached: what
    /// `vime_kernels::logprobs_entropy` takes with the final-normed hidden states.
    pub fn lm_head(&self) -> Tensor {
        self.lm_head_weight(false)
    }

    /// Logits `[N, vocab]` in f32 of final-normed hidden states `[N, hidden]` (the same product
    /// as [`Qwen3::logits`]).
    pub fn logits_from_hidden(&self, hidden: &Tensor) -> Result<Tensor> {
        let h = hidden.to_dtype(DType::F32)?;
        Ok(h.matmul(&self.lm_head().to_dtype(DType::F32)?.t()?)?)
    }

    /// Runs `seqs` (`(slot, new tokens)`, distinct slots, at least one token each) after what
    /// `cache` holds for their slots, appends their keys and values to the cache, and returns the
    /// final-normed hidden states of the requested rows.
    pub fn forward_with_cache(
        &self,
        seqs: &[(usize, &[u32])],
        cache: &mut KvCache,
        rows: HiddenRows,
    ) -> Result<Tensor> {
        let c = self.config();
        self.check_cache(cache)?;
        if seqs.is_empty() {
            bail!("forward_with_cache: no sequences");
        }
        let vocab = c.vocab_size as u32;
        let mut seen = std::collections::BTreeSet::new();
        for (i, &(slot, toks)) in seqs.iter().enumerate() {
            if !seen.insert(slot) {
                bail!("forward_with_cache: slot {slot} appears twice in one call");
            }
            if toks.is_empty() {
                bail!("forward_with_cache: sequence {i} (slot {slot}) has no new tokens");
            }
            if let Some(&id) = toks.iter().find(|&&id| id >= vocab) {
                bail!("forward_with_cache: token {id} of slot {slot} is outside the vocabulary ({vocab} ids)");
            }
            let total = cache.seq_len(slot) + toks.len();
            if total > c.max_position_embeddings {
                bail!(
                    "forward_with_cache: slot {slot} would hold {total} tokens, past max_position_embeddings {}",
                    c.max_position_embeddings
                );
            }
        }

        // Host metadata: positions continue from each slot's cached length.
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let (mut cu_q, mut cu_k) = (vec![0u32], vec![0u32]);
        let mut past = Vec::with_capacity(seqs.len());
        for &(slot, toks) in seqs {
            let p = cache.seq_len(slot);
            past.push(p);
            ids.extend_from_slice(toks);
            positions.extend((p..p + toks.len()).map(|x| x as u32));
            cu_q.push(ids.len() as u32);
            cu_k.push(cu_k.last().unwrap() + (p + toks.len()) as u32);
        }
        for (&(slot, toks), &p) in seqs.iter().zip(&past) {
            cache.reserve(slot, p + toks.len())?;
        }
        let t = ids.len();
        let positions: Arc<[u32]> = positions.into();
        let (cu_q, cu_k): (Arc<[u32]>, Arc<[u32]>) = (cu_q.into(), cu_k.into());

        let ids = Tensor::from_vec(ids, t, self.device())?;
        let mut x = w(&self.embed, false).embedding(&ids)?;
        let slots: Vec<(usize, usize)> = seqs.iter().zip(&past).map(|(&(slot, _), &p)| (slot, p)).collect();
        let attention = Attention::Cached {
            cache,
            seqs: &slots,
            cu_seqlens_q: &cu_q,
            cu_seqlens_k: &cu_k,
        };
        for b in &self.blocks {
            x = b
                .forward(
                    self.block_ctx(),
                    &x,
                    &positions,
                    &attention,
                    crate::block::Keep::Nothing,
                    None,
                    &vime_dist::SingleRank::default(),
                )?
                .0;
        }
        for (&(slot, toks), &p) in seqs.iter().zip(&past) {
            cache.slots.get_mut(&slot).expect("reserved above").len = p + toks.len();
        }
        if rows == HiddenRows::Last {
            let last: Vec<u32> = cu_q[1..].iter().map(|&e| e - 1).collect();
            let n = last.len();
            x = x.index_select(&Tensor::from_vec(last, n, self.device())?, 0)?;
        }
        Ok(rms_norm(&x, &w(&self.norm, false), c.rms_norm_eps)?)
    }

    /// Prefill: runs each `(slot, prompt)` (slots empty or continuing) and returns the
    /// final-normed hidden state of each sequence's last token, `[num_sequences, hidden]`.
    pub fn prefill(&self, seqs: &[(usize, &[u32])], cache: &mut KvCache) -> Result<Tensor> {
        self.forward_with_cache(seqs, cache, HiddenRows::Last)
    }

    /// Decode: one new token per `(slot, token)`; returns `[num_sequences, hidden]`, final-normed.
    pub fn decode(&self, steps: &[(usize, u32)], cache: &mut KvCache) -> Result<Tensor> {
        let toks: Vec<[u32; 1]> = steps.iter().map(|&(_, t)| [t]).collect();
        let seqs: Vec<(usize, &[u32])> = steps.iter().zip(&toks).map(|(&(s, _), t)| (s, &t[..])).collect();
        self.forward_with_cache(&seqs, cache, HiddenRows::Last)
    }

    fn check_cache(&self, cache: &KvCache) -> Result<()> {
        let c = self.config();
        let want = (c.num_hidden_layers, self.block_ctx().kv_heads, c.head_dim);
        let got = (cache.num_layers, cache.num_kv_heads, cache.head_dim);
        if want != got {
            bail!("KV cache built for (layers, kv heads, head_dim) = {got:?}, the model has {want:?}");
        }
        if cache.dtype != self.dtype() || !cache.device.same_device(self.device()) {
            bail!(
                "KV cache holds {:?} on {:?}, the model is {:?} on {:?}",
                cache.dtype,
                cache.device,
                self.dtype(),
                self.device()
            );
        }
        Ok(())
    }
}
