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
//! - The cache is one pool of rows per layer (`[capacity, n_kv_heads x head_dim]` K and V in the
//!   model's dtype on its device), handed out to sequences in pages of [`PAGE`] rows; a sequence's
//!   page list maps its positions to pool rows. A call computes two index tensors once (the rows
//!   its new tokens go to, and the rows of every sequence's cached + new keys in call order) and
//!   each layer then writes its new keys and values with one in-place row write per pool and reads
//!   the packed keys and values for the kernel with one gather per pool: four ops a layer,
//!   whatever the batch (the per-sequence buffers before cost 4 ops per sequence per layer, which
//!   dominated decoding at batch 64 on a GPU). The pool doubles (one copy) when out of pages;
//!   freed pages are reused.
//! - A decode call (one new token per sequence) skips the gather: `vime_kernels::decode` attends
//!   over the pool rows in place (on CUDA one split-KV kernel; elsewhere it gathers, as above).
//! - No gradient is ever tracked: every weight is read through `as_detached_tensor`.
use crate::block::Attention;
use crate::config::Qwen3Config;
use crate::model::{w, Qwen3};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::sync::Arc;
use vime_kernels::rms_norm;

/// Rows per page of the pool.
pub const PAGE: usize = 16;

/// Smallest pool, in pages.
const MIN_PAGES: usize = 4;

/// One sequence: `len` live positions in the pool rows of its `pages`.
struct Slot {
    len: usize,
    pages: Vec<u32>,
}

impl Slot {
    fn row(&self, pos: usize) -> u32 {
        self.pages[pos / PAGE] * PAGE as u32 + (pos % PAGE) as u32
    }
}

/// Per-sequence KV cache for [`Qwen3::forward_with_cache`]. Slots are caller-chosen ids, created
/// on first use; [`KvCache::free`] drops one.
pub struct KvCache {
    num_layers: usize,
    num_kv_heads: usize,
    head_dim: usize,
    dtype: DType,
    device: Device,
    /// Per layer, the K and V pools `[pages x PAGE, kv_heads x head_dim]` (empty until needed).
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    pages: usize,
    free_pages: Vec<u32>,
    slots: BTreeMap<usize, Slot>,
}

/// The pool rows of one call (see the module docs), shared by every layer.
pub(crate) struct CallRows {
    /// `[new tokens]`: each new token's pool row.
    write: Tensor,
    /// `[cached + new tokens of every sequence]`: the rows to gather, in call order.
    read: Tensor,
    /// A decode call (one new token per sequence): the sequences' offsets into `read` on the
    /// device, for the decode kernel (uploaded once per call, read by every layer).
    decode_cu_k: Option<Tensor>,
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
            k: Vec::new(),
            v: Vec::new(),
            pages: 0,
            free_pages: Vec::new(),
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

    /// Drops the keys and values of `slot` (its pages go back to the pool); the id may be reused
    /// for a new sequence.
    pub fn free(&mut self, slot: usize) {
        if let Some(s) = self.slots.remove(&slot) {
            self.free_pages.extend(s.pages);
        }
    }

    /// Drops every slot.
    pub fn clear(&mut self) {
        let slots = std::mem::take(&mut self.slots);
        for s in slots.into_values() {
            self.free_pages.extend(s.pages);
        }
    }

    /// Bytes of K and V per cached token (all layers).
    pub fn bytes_per_token(&self) -> usize {
        2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.size_in_bytes()
    }

    /// Bytes currently allocated by the pools (capacity, not just live rows).
    pub fn allocated_bytes(&self) -> usize {
        self.pages * PAGE * self.bytes_per_token()
    }

    /// Makes `slot` able to hold `tokens` tokens (creating it if needed), growing the pool when
    /// it is out of pages.
    pub fn reserve(&mut self, slot: usize, tokens: usize) -> Result<()> {
        let have = self.slots.get(&slot).map_or(0, |s| s.pages.len());
        let need = tokens.div_ceil(PAGE).saturating_sub(have);
        if need > self.free_pages.len() {
            self.grow(self.pages + need - self.free_pages.len())?;
        }
        let at = self.free_pages.len() - need;
        let new: Vec<u32> = self.free_pages.drain(at..).collect();
        self.slots
            .entry(slot)
            .or_insert_with(|| Slot {
                len: 0,
                pages: Vec::new(),
            })
            .pages
            .extend(new);
        Ok(())
    }

    /// Grows the pools to at least `pages` pages (doubling), keeping every row.
    fn grow(&mut self, pages: usize) -> Result<()> {
        let new_pages = pages.max(2 * self.pages).max(MIN_PAGES);
        let width = self.num_kv_heads * self.head_dim;
        let rows = self.pages * PAGE;
        let grow = |old: Option<&Tensor>| -> Result<Tensor> {
            let t = Tensor::zeros((new_pages * PAGE, width), self.dtype, &self.device)?;
            if let (Some(old), true) = (old, rows > 0) {
                t.slice_set(old, 0, 0)?;
            }
            Ok(t)
        };
        let k = (0..self.num_layers)
            .map(|l| grow(self.k.get(l)))
            .collect::<Result<Vec<_>>>()?;
        let v = (0..self.num_layers)
            .map(|l| grow(self.v.get(l)))
            .collect::<Result<Vec<_>>>()?;
        self.k = k;
        self.v = v;
        // Hand out low pages first (popped from the end).
        self.free_pages.extend((self.pages as u32..new_pages as u32).rev());
        self.pages = new_pages;
        Ok(())
    }

    /// The pool rows of a call of `seqs = [(slot, past, new tokens)]` (reserved by the caller).
    pub(crate) fn call_rows(&self, seqs: &[(usize, usize, usize)]) -> Result<CallRows> {
        let (mut write, mut read) = (Vec::new(), Vec::new());
        let mut cu_k = vec![0u32];
        for &(slot, p, n) in seqs {
            let s = self
                .slots
                .get(&slot)
                .with_context(|| format!("KV cache slot {slot} was not reserved"))?;
            if s.pages.len() * PAGE < p + n {
                bail!(
                    "KV cache slot {slot} holds {} rows, the call needs {}",
                    s.pages.len() * PAGE,
                    p + n
                );
            }
            write.extend((p..p + n).map(|t| s.row(t)));
            read.extend((0..p + n).map(|t| s.row(t)));
            cu_k.push(read.len() as u32);
        }
        let (nw, nr) = (write.len(), read.len());
        let decode = seqs.iter().all(|&(_, _, n)| n == 1);
        let nk = cu_k.len();
        Ok(CallRows {
            write: Tensor::from_vec(write, nw, &self.device)?,
            read: Tensor::from_vec(read, nr, &self.device)?,
            decode_cu_k: if decode {
                Some(Tensor::from_vec(cu_k, nk, &self.device)?)
            } else {
                None
            },
        })
    }

    /// Writes the new keys and values of layer `layer` (as [`KvCache::append_and_gather`]), then
    /// attends each sequence's one new query `q: [B, q_heads, d]` over its cached + new keys in
    /// place in the pools (`vime_kernels::decode`). `None` unless `rows` is a decode call.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn append_and_decode(
        &self,
        layer: usize,
        rows: &CallRows,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cu_k: &Arc<[u32]>,
        scale: f64,
        kernels: &vime_kernels::KernelConfig,
    ) -> Result<Option<Tensor>> {
        let Some(cu_k_dev) = &rows.decode_cu_k else {
            return Ok(None);
        };
        self.append(layer, rows, k, v)?;
        let (kp, vp) = (&self.k[layer], &self.v[layer]);
        Ok(Some(vime_kernels::decode::decode_attention(
            q, kp, vp, &rows.read, cu_k, cu_k_dev, scale, kernels,
        )?))
    }

    fn append(&self, layer: usize, rows: &CallRows, k: &Tensor, v: &Tensor) -> Result<()> {
        let (t, width) = (k.dim(0)?, self.num_kv_heads * self.head_dim);
        let (k, v) = (
            k.contiguous()?.reshape((t, width))?,
            v.contiguous()?.reshape((t, width))?,
        );
        Ok(vime_kernels::rows::write_rows2(
            &self.k[layer],
            &self.v[layer],
            &rows.write,
            &k,
            &v,
        )?)
    }

    /// Writes the new keys and values of layer `layer` (`k, v: [T_new, kv_heads, d]`, in the
    /// call's order) to their pool rows and returns the packed cached + new keys and values of
    /// every sequence of the call, in call order.
    pub(crate) fn append_and_gather(
        &self,
        layer: usize,
        rows: &CallRows,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        self.append(layer, rows, k, v)?;
        let (kp, vp) = (&self.k[layer], &self.v[layer]);
        let n = rows.read.dim(0)?;
        let shape = (n, self.num_kv_heads, self.head_dim);
        Ok((
            kp.index_select(&rows.read, 0)?.reshape(shape)?,
            vp.index_select(&rows.read, 0)?.reshape(shape)?,
        ))
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
        let calls: Vec<(usize, usize, usize)> = seqs
            .iter()
            .zip(&past)
            .map(|(&(slot, toks), &p)| (slot, p, toks.len()))
            .collect();
        let rows_of_call = cache.call_rows(&calls)?;
        let attention = Attention::Cached {
            cache,
            rows: &rows_of_call,
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
