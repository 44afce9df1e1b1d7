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

/// The longest sequence (prompt and response) a cache limited to `tokens` by
/// [`KvCache::set_max_tokens`] can hold: its whole pages, less the padding row's page and one
/// page of headroom (what `vime-serve` lowers its `max_model_len` to).
pub fn longest_sequence_for(tokens: usize) -> usize {
    ((tokens / PAGE).max(2) * PAGE).saturating_sub(2 * PAGE)
}

/// Smallest pool, in pages.
const MIN_PAGES: usize = 4;

/// One sequence: `len` live positions; `rows[t]` is position t's pool row, for every position
/// of the whole pages it holds (page `rows[k * PAGE] / PAGE` holds positions `k * PAGE..`), so
/// that a call copies a sequence's row list instead of computing it one row at a time.
struct Slot {
    len: usize,
    rows: Vec<u32>,
}

impl Slot {
    fn row(&self, pos: usize) -> u32 {
        self.rows[pos]
    }

    fn num_pages(&self) -> usize {
        self.rows.len() / PAGE
    }

    fn pages(&self) -> impl Iterator<Item = u32> + '_ {
        self.rows.iter().step_by(PAGE).map(|r| r / PAGE as u32)
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
    /// Bumped whenever the pools move (they grow by copying): a captured decode graph holds
    /// their addresses and is dropped when this changes ([`DecodeGraphs`]).
    generation: u64,
    /// This cache's identity, for the same reason.
    uid: u64,
    /// The row padding sequences of a graphed decode step write and read (outside every slot).
    pad_row: Option<u32>,
    /// Most pages the pools may hold ([`KvCache::set_max_tokens`]); `None`: no limit (the pools
    /// grow until the device runs out).
    max_pages: Option<usize>,
}

/// The pool rows of one call (see the module docs), shared by every layer.
pub(crate) struct CallRows {
    /// `[new tokens]`: each new token's pool row.
    write: Tensor,
    /// `[cached + new tokens of every sequence]`: the rows to gather, in call order.
    read: Tensor,
    /// A decode call (one new token per sequence): the decode kernel's metadata on the device
    /// (the sequences' offsets into `read`, then the split length; uploaded once per call, read
    /// by every layer) and its split plan.
    decode: Option<(Tensor, vime_kernels::decode::SplitPlan)>,
    /// The new tokens' positions on the device (a captured graph's input buffer); `None`: the
    /// kernels upload the host positions.
    positions: Option<Tensor>,
    /// The layers' fused projections, when the caller has them.
    fused: Option<DecodeWeights>,
}

impl CallRows {
    pub(crate) fn positions_dev(&self) -> Option<&Tensor> {
        self.positions.as_ref()
    }

    pub(crate) fn fused_layer(&self, layer: usize) -> Option<&(Tensor, Tensor)> {
        self.fused.as_ref().and_then(|f| f.layers.get(layer))
    }
}

/// Each layer's q|k|v projections as one `[q + 2 kv heads x head_dim, hidden]` weight and its
/// gate|up projections as one `[2 x intermediate, hidden]` ([`Qwen3::decode_weights`]): one GEMM
/// each instead of three and two, which at decode batch sizes are small and memory-bound. A copy
/// of those weights (about 3/4 of a layer's bytes), made from the model's current values: make it
/// again after the weights change.
#[derive(Clone)]
pub struct DecodeWeights {
    layers: Arc<Vec<(Tensor, Tensor)>>,
}

impl DecodeWeights {
    /// Bytes the fused copies hold.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|(a, b)| (a.elem_count() + b.elem_count()) * a.dtype().size_in_bytes())
            .sum()
    }

    fn id(&self) -> usize {
        Arc::as_ptr(&self.layers) as usize
    }
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
            generation: 0,
            uid: {
                static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
                NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            },
            pad_row: None,
            max_pages: None,
        }
    }

    /// Limits the pools to `tokens` rows (rounded down to whole pages; at least one page for the
    /// padding row and one for a sequence), or lifts the limit (`None`); the pools are then
    /// allocated at the limit when first needed. A limit below what the pools already hold keeps
    /// them (they never shrink) and stops their growth. A caller that
    /// must not fail mid-step asks [`Self::pages_short`] before [`Self::reserve`].
    pub fn set_max_tokens(&mut self, tokens: Option<usize>) {
        self.max_pages = tokens.map(|t| (t / PAGE).max(2));
    }

    /// The token limit set by [`Self::set_max_tokens`] (whole pages), if any.
    pub fn max_tokens(&self) -> Option<usize> {
        self.max_pages.map(|p| p * PAGE)
    }

    /// Pages still available: free pages plus what the pools may still grow by (`usize::MAX`
    /// without a limit), less the padding row's page while it is not yet taken.
    pub fn available_pages(&self) -> usize {
        let pad = usize::from(self.pad_row.is_none());
        match self.max_pages {
            None => usize::MAX,
            Some(m) => (self.free_pages.len() + m.saturating_sub(self.pages)).saturating_sub(pad),
        }
    }

    /// Pages `slot` lacks to hold `tokens` tokens (0 when it has them).
    pub fn pages_short(&self, slot: usize, tokens: usize) -> usize {
        let have = self.slots.get(&slot).map_or(0, Slot::num_pages);
        tokens.div_ceil(PAGE).saturating_sub(have)
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
            self.free_pages.extend(s.pages());
        }
    }

    /// Drops every slot.
    pub fn clear(&mut self) {
        let slots = std::mem::take(&mut self.slots);
        for s in slots.values() {
            self.free_pages.extend(s.pages());
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
    /// it is out of pages; refused (nothing changed) past the limit of [`Self::set_max_tokens`].
    pub fn reserve(&mut self, slot: usize, tokens: usize) -> Result<()> {
        let need = self.pages_short(slot, tokens);
        let pad = usize::from(self.pad_row.is_none());
        if let Some(max) = self.max_pages {
            if need + pad > self.free_pages.len() + max.saturating_sub(self.pages) {
                bail!(
                    "KV cache full: sequence {slot} needs {need} more pages of {PAGE} tokens for {tokens} tokens, \
                     {} of the cache's {} pages ({} tokens) are free",
                    self.available_pages(),
                    max,
                    max * PAGE
                );
            }
        }
        if need > self.free_pages.len() {
            self.grow(self.pages + need - self.free_pages.len())?;
        }
        let at = self.free_pages.len() - need;
        let s = self.slots.entry(slot).or_insert_with(|| Slot {
            len: 0,
            rows: Vec::new(),
        });
        for page in self.free_pages.drain(at..) {
            s.rows.extend((0..PAGE as u32).map(|t| page * PAGE as u32 + t));
        }
        Ok(())
    }

    /// Grows the pools to at least `pages` pages (doubling), keeping every row. With a limit
    /// ([`Self::set_max_tokens`]) the first growth allocates the whole limit: doubling near a
    /// large limit would hold the old and the new pools at once (1.5x the limit), which is what
    /// a limit sized to the device's free memory cannot afford.
    fn grow(&mut self, pages: usize) -> Result<()> {
        let new_pages = match self.max_pages {
            Some(max) => max.max(pages),
            None => pages.max(2 * self.pages).max(MIN_PAGES),
        };
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
        self.generation += 1;
        // Hand out low pages first (popped from the end).
        self.free_pages.extend((self.pages as u32..new_pages as u32).rev());
        self.pages = new_pages;
        Ok(())
    }

    /// A pool row outside every slot, for the padding sequences of a graphed decode step.
    fn pad_row(&mut self) -> Result<u32> {
        if let Some(r) = self.pad_row {
            return Ok(r);
        }
        if self.free_pages.is_empty() {
            self.grow(self.pages + 1)?;
        }
        let page = self.free_pages.pop().expect("grown above");
        let row = page * PAGE as u32;
        self.pad_row = Some(row);
        Ok(row)
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
            if s.rows.len() < p + n {
                bail!(
                    "KV cache slot {slot} holds {} rows, the call needs {}",
                    s.rows.len(),
                    p + n
                );
            }
            write.extend((p..p + n).map(|t| s.row(t)));
            read.extend_from_slice(&s.rows[..p + n]);
            cu_k.push(read.len() as u32);
        }
        let (nw, nr) = (write.len(), read.len());
        let decode = if seqs.iter().all(|&(_, _, n)| n == 1) {
            let max_len = seqs.iter().map(|&(_, p, n)| p + n).max().unwrap_or(0);
            let plan = vime_kernels::decode::SplitPlan::for_call(seqs.len(), self.num_kv_heads, max_len);
            let meta = plan.device_meta(&cu_k);
            let n = meta.len();
            Some((Tensor::from_vec(meta, n, &self.device)?, plan))
        } else {
            None
        };
        Ok(CallRows {
            write: Tensor::from_vec(write, nw, &self.device)?,
            read: Tensor::from_vec(read, nr, &self.device)?,
            decode,
            positions: None,
            fused: None,
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
        // `--true-on-policy-mode`: the packed path, whose attention is the trainer's kernel.
        let Some((meta, plan)) = rows.decode.as_ref().filter(|_| !kernels.batch_invariant()) else {
            return Ok(None);
        };
        self.append(layer, rows, k, v)?;
        let (kp, vp) = (&self.k[layer], &self.v[layer]);
        Ok(Some(vime_kernels::decode::decode_attention(
            q, kp, vp, &rows.read, cu_k, meta, *plan, scale, kernels,
        )?))
    }

    fn append(&self, layer: usize, rows: &CallRows, k: &Tensor, v: &Tensor) -> Result<()> {
        // `[T, kv_heads, d]`, possibly head views of the fused projection: written in place.
        Ok(vime_kernels::rows::write_rows2(
            &self.k[layer],
            &self.v[layer],
            &rows.write,
            k,
            v,
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
            vime_kernels::rows::gather_rows_dev(kp, &rows.read)?.reshape(shape)?,
            vime_kernels::rows::gather_rows_dev(vp, &rows.read)?.reshape(shape)?,
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
        self.check_call(seqs, cache)?;

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
        let positions: Arc<[u32]> = positions.into();
        let (cu_q, cu_k): (Arc<[u32]>, Arc<[u32]>) = (cu_q.into(), cu_k.into());

        // The host ids are bounds-checked again here (the engine checks requests first).
        let mut x = vime_kernels::rows::gather_rows(&w(&self.embed, false), &ids)?;
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
        x = self.cached_layers(x, &positions, &attention)?;
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

    /// The fused q|k|v and gate|up weights of every layer ([`DecodeWeights`]) for
    /// [`Self::decode_graphed`]; `None` for models with attention biases (not fused).
    pub fn decode_weights(&self) -> Result<Option<DecodeWeights>> {
        if self
            .blocks
            .iter()
            .any(|b| b.q_bias.is_some() || b.k_bias.is_some() || b.v_bias.is_some())
        {
            return Ok(None);
        }
        let layers = self
            .blocks
            .iter()
            .map(|b| -> Result<(Tensor, Tensor)> {
                let qkv = Tensor::cat(&[w(&b.q_proj, false), w(&b.k_proj, false), w(&b.v_proj, false)], 0)?;
                let gu = Tensor::cat(&[w(&b.gate_proj, false), w(&b.up_proj, false)], 0)?;
                Ok((qkv, gu))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Some(DecodeWeights {
            layers: Arc::new(layers),
        }))
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

    /// Whether a decode step of this model may be captured as a CUDA graph: on CUDA in bf16 with
    /// head_dim 128 and 1-8 query heads per kv head (every Qwen3), where every op of the step is
    /// one of vime's kernels with its sizes fixed by the batch. Elsewhere some op would size its
    /// work from the step's lengths on the host (the gather of the generic decode path), which a
    /// graph would freeze at its capture: [`Self::decode_graphed`] then runs eagerly. Under
    /// `--true-on-policy-mode` too: its decode step gathers the keys as the packed path does.
    pub fn graph_safe(&self) -> bool {
        let ctx = self.block_ctx();
        self.device().is_cuda()
            && self.dtype() == DType::BF16
            && ctx.head_dim == 128
            && ctx.kv_heads > 0
            && ctx.q_heads.is_multiple_of(ctx.kv_heads)
            && (1..=8).contains(&(ctx.q_heads / ctx.kv_heads))
            && !ctx.kernels.batch_invariant()
    }

    /// Every layer over `x` with KV-cached attention, keeping nothing for a backward.
    fn cached_layers(&self, mut x: Tensor, positions: &Arc<[u32]>, attention: &Attention<'_>) -> Result<Tensor> {
        for b in &self.blocks {
            x = b
                .forward(
                    self.block_ctx(),
                    &x,
                    positions,
                    attention,
                    crate::block::Keep::Nothing,
                    None,
                    &vime_dist::SingleRank::default(),
                )?
                .0;
        }
        Ok(x)
    }

    /// What [`Self::forward_with_cache`] refuses: no sequences, a slot twice, a sequence with no
    /// tokens, a token outside the vocabulary, a sequence past `max_position_embeddings`, a
    /// cache of another shape.
    fn check_call(&self, seqs: &[(usize, &[u32])], cache: &KvCache) -> Result<()> {
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
        Ok(())
    }

    /// [`Self::decode`] through captured CUDA graphs: the batch is padded to a bucket size
    /// ([`graph_batch`]), every per-step input goes to that bucket's fixed device buffers, and
    /// the whole forward (embedding, every layer, the final norm) replays as one graph launch
    /// once captured. The padding sequences (token 0 at position 0) write and read one spare
    /// pool row and their outputs are dropped; each real sequence attends only to its own keys,
    /// so its hidden state is what [`Self::decode`] computes, up to the split of the decode
    /// kernel's key reduction (a fixed plan per bucket, [`vime_kernels::decode::SplitPlan::fixed`]).
    /// Without CUDA (or with graphs off) the same padded forward runs eagerly, which is how the
    /// CPU tests hold it to [`Self::decode`]. `graphs` must serve this model and `cache` only;
    /// it starts over when either changes or the pool grows.
    pub fn decode_graphed(
        &self,
        steps: &[(usize, u32)],
        cache: &mut KvCache,
        graphs: &mut DecodeGraphs,
        fused: Option<&DecodeWeights>,
    ) -> Result<Tensor> {
        let toks: Vec<[u32; 1]> = steps.iter().map(|&(_, t)| [t]).collect();
        let seqs: Vec<(usize, &[u32])> = steps.iter().zip(&toks).map(|(&(s, _), t)| (s, &t[..])).collect();
        self.check_call(&seqs, cache)?;
        let c = self.config();
        for &(slot, _) in steps {
            let p = cache.seq_len(slot);
            cache.reserve(slot, p + 1)?;
        }
        let pad = cache.pad_row()?;
        let (b, bp) = (steps.len(), graph_batch(steps.len()));

        // Host inputs: the real sequences, then the padding.
        let (mut ids, mut positions, mut write) =
            (Vec::with_capacity(bp), Vec::with_capacity(bp), Vec::with_capacity(bp));
        let mut read = Vec::new();
        let mut cu_k = Vec::with_capacity(bp + 1);
        cu_k.push(0u32);
        let mut max_len = 1;
        for &(slot, tok) in steps {
            let s = cache.slots.get(&slot).expect("reserved above");
            let p = s.len;
            ids.push(tok);
            positions.push(p as u32);
            write.push(s.row(p));
            read.extend_from_slice(&s.rows[..=p]);
            cu_k.push(read.len() as u32);
            max_len = max_len.max(p + 1);
        }
        for _ in b..bp {
            ids.push(0);
            positions.push(0);
            write.push(pad);
            read.push(pad);
            cu_k.push(read.len() as u32);
        }
        let plan = vime_kernels::decode::SplitPlan::fixed(bp, cache.num_kv_heads, max_len);
        let meta = plan.device_meta(&cu_k);

        let model_id = (self.embed.as_tensor().id(), fused.map_or(0, DecodeWeights::id));
        graphs.start(model_id, cache, read.len())?;
        let dev = self.device().clone();
        graphs.front_bucket(bp, c.hidden_size, self.dtype(), &dev)?;
        let read_buf = graphs.read.as_mut().expect("made by start");
        put(read_buf, &read)?;
        let read_buf = read_buf.clone();
        let bucket = &mut graphs.buckets[0];
        put(&mut bucket.ids, &ids)?;
        put(&mut bucket.positions, &positions)?;
        put(&mut bucket.write, &write)?;
        put(&mut bucket.meta, &meta)?;

        let cu_q: Arc<[u32]> = (0..=bp as u32).collect();
        let cu_k: Arc<[u32]> = cu_k.into();
        let positions: Arc<[u32]> = positions.into();
        let cache_ref: &KvCache = cache;
        let (ids_t, pos_t, write_t, meta_t, out_t) = (
            bucket.ids.clone(),
            bucket.positions.clone(),
            bucket.write.clone(),
            bucket.meta.clone(),
            bucket.out.clone(),
        );
        let body = || -> Result<()> {
            let rows = CallRows {
                write: write_t.clone(),
                read: read_buf.clone(),
                decode: Some((meta_t.clone(), plan)),
                positions: Some(pos_t.clone()),
                fused: fused.cloned(),
            };
            let attention = Attention::Cached {
                cache: cache_ref,
                rows: &rows,
                cu_seqlens_q: &cu_q,
                cu_seqlens_k: &cu_k,
            };
            let x = self.cached_layers(w(&self.embed, false).embedding(&ids_t)?, &positions, &attention)?;
            let y = rms_norm(&x, &w(&self.norm, false), c.rms_norm_eps)?;
            Ok(out_t.slice_set(&y, 0, 0)?)
        };
        // Replayed, or run once and captured: the step is done. Otherwise it runs eagerly.
        #[cfg(feature = "cuda")]
        let done = graphs.enabled
            && self.graph_safe()
            && match &bucket.graph {
                Some(g) => {
                    g.launch()?;
                    graphs.stats.replays += 1;
                    true
                }
                None => match vime_kernels::cuda::run_and_capture(&dev, &body)? {
                    ((), Ok(g)) => {
                        bucket.graph = Some(g);
                        graphs.stats.captures += 1;
                        true
                    }
                    ((), Err(e)) => {
                        // The step ran; go on without graphs rather than fail the rollout.
                        eprintln!(
                            "vime: capturing the decode step of {bp} sequences as a CUDA graph failed, \
                             decoding without graphs: {e:#}"
                        );
                        graphs.enabled = false;
                        graphs.stats.eager += 1;
                        true
                    }
                },
            };
        #[cfg(not(feature = "cuda"))]
        let done = false;
        if !done {
            body()?;
            graphs.stats.eager += 1;
        }
        for &(slot, _) in steps {
            cache.slots.get_mut(&slot).expect("reserved above").len += 1;
        }
        Ok(out_t.narrow(0, 0, b)?.copy()?)
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

/// The batch size a graphed decode step of `b` sequences pads to (vLLM's capture sizes): 1, 2,
/// 4, 8, then multiples of 8 up to 256, then of 32. Few graphs, little padding.
pub fn graph_batch(b: usize) -> usize {
    match b {
        0..=8 => b.max(1).next_power_of_two(),
        9..=256 => b.next_multiple_of(8),
        _ => b.next_multiple_of(32),
    }
}

/// Writes `host` into the u32 buffer `t` (same length): in place on CUDA (the buffer keeps its
/// address, which a captured graph reads), a new tensor elsewhere.
fn put(t: &mut Tensor, host: &[u32]) -> Result<()> {
    #[cfg(feature = "cuda")]
    if t.device().is_cuda() {
        if host.len() > t.elem_count() {
            bail!("internal: {} values for a buffer of {:?}", host.len(), t.dims());
        }
        return Ok(vime_kernels::cuda::write_u32(t, 0, host)?);
    }
    let n = t.elem_count();
    let mut v = host.to_vec();
    v.resize(n.max(host.len()), 0);
    let len = v.len();
    *t = Tensor::from_vec(v, len, t.device())?;
    Ok(())
}

/// Graphs at most kept (least recently used dropped first): each holds its own activations.
const MAX_GRAPHS: usize = 24;

/// Counts of [`Qwen3::decode_graphed`] steps, by how they ran.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct GraphStats {
    /// Steps that captured a new graph (and ran eagerly once).
    pub captures: usize,
    /// Steps that replayed a captured graph.
    pub replays: usize,
    /// Steps that ran the padded forward without graphs (CPU, or graphs off).
    pub eager: usize,
}

/// One bucket's fixed buffers and graph.
struct GraphBucket {
    batch: usize,
    ids: Tensor,
    positions: Tensor,
    write: Tensor,
    meta: Tensor,
    out: Tensor,
    #[cfg(feature = "cuda")]
    graph: Option<vime_kernels::cuda::DeviceGraph>,
}

/// The captured decode graphs of one model over one [`KvCache`] ([`Qwen3::decode_graphed`]),
/// one per padded batch size, with their input buffers. Not `Send`: a graph belongs to the
/// thread that captured it (keep one per generate call).
pub struct DecodeGraphs {
    enabled: bool,
    /// ((model, fused weights), cache, cache generation) the graphs were captured for.
    owner: Option<((candle_core::TensorId, usize), u64, u64)>,
    /// The rows every sequence reads, `[capacity]` u32, shared by the buckets.
    read: Option<Tensor>,
    buckets: Vec<GraphBucket>,
    pub stats: GraphStats,
}

impl DecodeGraphs {
    /// `enabled`: capture and replay on CUDA devices (elsewhere the padded forward runs eagerly).
    pub fn new(enabled: bool) -> Self {
        Self {
            enabled,
            owner: None,
            read: None,
            buckets: Vec::new(),
            stats: GraphStats::default(),
        }
    }

    /// Whether graphs are used: the flag given to [`Self::new`] and the `VIME_CUDA_GRAPHS`
    /// environment variable (`0` turns them off).
    pub fn from_env() -> Self {
        Self::new(std::env::var("VIME_CUDA_GRAPHS").map_or(true, |v| v != "0"))
    }

    /// Whether this value captures graphs (on CUDA devices).
    pub fn enabled(&self) -> bool {
        self.enabled
    }

    /// Graphs captured and alive.
    pub fn live(&self) -> usize {
        #[cfg(feature = "cuda")]
        return self.buckets.iter().filter(|b| b.graph.is_some()).count();
        #[cfg(not(feature = "cuda"))]
        0
    }

    /// Drops everything captured unless it was for this model, cache and pool; makes the read
    /// buffer hold at least `reads` rows.
    fn start(&mut self, model: (candle_core::TensorId, usize), cache: &KvCache, reads: usize) -> Result<()> {
        let owner = Some((model, cache.uid, cache.generation));
        let fits = self.read.as_ref().is_some_and(|r| r.elem_count() >= reads);
        if self.owner != owner || !fits {
            self.buckets.clear();
            // Every sequence's keys sit in distinct pool rows; the padding adds one read each.
            let cap = reads.max(cache.pages * PAGE + 1024);
            self.read = Some(Tensor::zeros(cap, DType::U32, &cache.device)?);
            self.owner = owner;
        }
        Ok(())
    }

    /// Moves the bucket of padded batch `batch` (made on first use) to the front.
    fn front_bucket(&mut self, batch: usize, hidden: usize, dtype: DType, dev: &Device) -> Result<()> {
        if let Some(i) = self.buckets.iter().position(|b| b.batch == batch) {
            if i != 0 {
                let b = self.buckets.remove(i);
                self.buckets.insert(0, b);
            }
        } else {
            let z = |n: usize| Tensor::zeros(n, DType::U32, dev);
            self.buckets.insert(
                0,
                GraphBucket {
                    batch,
                    ids: z(batch)?,
                    positions: z(batch)?,
                    write: z(batch)?,
                    meta: z(batch + 2)?,
                    out: Tensor::zeros((batch, hidden), dtype, dev)?,
                    #[cfg(feature = "cuda")]
                    graph: None,
                },
            );
            self.buckets.truncate(MAX_GRAPHS);
        }
        Ok(())
    }
}
