//! Decode attention: one new query per sequence over that sequence's keys in a paged KV pool.
//!
//! `q: [B, H, d]` holds each sequence's query (its last position, so it sees every key of its
//! sequence); the keys and values of sequence `b` are the pool rows `rows[cu_k[b]..cu_k[b+1]]`
//! of `k_pool, v_pool: [capacity, Hkv x d]`. The result is `[B, H, d]` in q's dtype.
//!
//! Decisions:
//! - On CUDA, bf16, `d = 128` and 1-8 query heads per kv head: one split-KV kernel
//!   (`cuda/decode.cu`) that reads the pool rows in place, no gather and no 128-row query tiles;
//!   which of its variants runs is [`KernelConfig::decode_kernel`] (`DecodeKernel`).
//! - Everywhere else: the rows are gathered and [`crate::varlen_attention`] runs with one query per
//!   sequence, which is also the reference the kernel is tested against (`tests/cuda_vs_cpu.rs`).
//! - Forward only: decoding keeps no graph.
use crate::config::KernelConfig;
use candle_core::{bail, DType, Result, Tensor};
use std::sync::Arc;

/// Blocks the CUDA decode kernel aims for: [`crate::config::GPU_FILL_BLOCKS`].
const TARGET_BLOCKS: usize = crate::config::GPU_FILL_BLOCKS;
/// Keys a decode block covers per iteration (4 warps x 8): a split's length is a multiple.
const KEYS_PER_ITER: usize = 32;
/// Most splits a fixed plan ([`SplitPlan::fixed`]) uses.
const MAX_FIXED_SPLITS: usize = 128;

/// How the CUDA decode kernel divides each sequence's keys: `splits` blocks per (sequence, kv
/// head), each over `chunk` consecutive keys (a multiple of 32). Splits past a sequence's end
/// find no keys and weigh nothing in the merge, so any plan whose `splits x chunk` covers the
/// longest sequence gives the same attention; the plan only sets the reduction's grouping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitPlan {
    pub splits: usize,
    pub chunk: usize,
}

impl SplitPlan {
    /// For one call of `b` sequences over `kv_heads` kv heads, the longest holding `max_len`
    /// keys: enough splits to fill the GPU, no more than the keys need.
    pub fn for_call(b: usize, kv_heads: usize, max_len: usize) -> Self {
        let max_splits = max_len.div_ceil(KEYS_PER_ITER).max(1);
        let splits = TARGET_BLOCKS.div_ceil((b * kv_heads).max(1)).clamp(1, max_splits);
        let chunk = Self::chunk_for(splits, max_len);
        Self {
            splits: max_len.div_ceil(chunk).max(1),
            chunk,
        }
    }

    /// A split count that depends only on the batch (`b` x `kv_heads`), so that a captured CUDA
    /// graph (whose grid is fixed) serves every length: the chunk, which the kernel reads from
    /// the device, follows `max_len` step by step.
    pub fn fixed(b: usize, kv_heads: usize, max_len: usize) -> Self {
        let splits = TARGET_BLOCKS.div_ceil((b * kv_heads).max(1)).clamp(1, MAX_FIXED_SPLITS);
        Self {
            splits,
            chunk: Self::chunk_for(splits, max_len),
        }
    }

    fn chunk_for(splits: usize, max_len: usize) -> usize {
        max_len.max(1).div_ceil(splits).div_ceil(KEYS_PER_ITER) * KEYS_PER_ITER
    }

    /// The kernel's device metadata for sequences at offsets `cu_k` (`B + 1` entries): the
    /// offsets, then the chunk (`B + 2` u32).
    pub fn device_meta(&self, cu_k: &[u32]) -> Vec<u32> {
        let mut m = Vec::with_capacity(cu_k.len() + 1);
        m.extend_from_slice(cu_k);
        m.push(self.chunk as u32);
        m
    }
}

/// See the module docs. `cu_k` on the host (`B + 1` offsets rising from 0, the last at most the
/// number of `rows`: a fixed buffer may hold more rows than a call reads); `meta`: on the pools'
/// device, [`SplitPlan::device_meta`] of `plan` and `cu_k` (uploaded once per call by the
/// caller, not once per layer); `plan.splits x plan.chunk` must cover the longest sequence.
#[allow(clippy::too_many_arguments)]
pub fn decode_attention(
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    rows: &Tensor,
    cu_k: &Arc<[u32]>,
    meta: &Tensor,
    plan: SplitPlan,
    softmax_scale: f64,
    kernels: &KernelConfig,
) -> Result<Tensor> {
    let (b, h, d) = q.dims3()?;
    let (_, width) = k_pool.dims2()?;
    if v_pool.dims() != k_pool.dims() || d == 0 || width % d != 0 {
        bail!(
            "decode_attention: q {:?}, k pool {:?}, v pool {:?}",
            q.dims(),
            k_pool.dims(),
            v_pool.dims()
        );
    }
    let hkv = width / d;
    if hkv == 0 || h % hkv != 0 {
        bail!("decode_attention: {h} query heads are not a multiple of {hkv} kv heads");
    }
    let n = rows.dims1()?;
    if cu_k.len() != b + 1 || cu_k[0] != 0 || cu_k.windows(2).any(|w| w[1] < w[0]) || cu_k[b] as usize > n {
        bail!("decode_attention: cu_k must rise from 0 to at most the {n} rows over {b} sequences, got {cu_k:?}");
    }
    let max_len = cu_k.windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap_or(0);
    if plan.splits == 0 || !plan.chunk.is_multiple_of(KEYS_PER_ITER) || plan.splits * plan.chunk < max_len {
        bail!("decode_attention: {plan:?} does not cover the longest sequence ({max_len} keys)");
    }
    if meta.dims1()? != b + 2 || rows.dtype() != DType::U32 || meta.dtype() != DType::U32 {
        bail!(
            "decode_attention: rows {:?} {:?} and the metadata {:?} {:?} must be u32, the metadata of {} entries",
            rows.dims(),
            rows.dtype(),
            meta.dims(),
            meta.dtype(),
            b + 2
        );
    }
    #[cfg(feature = "cuda")]
    if crate::cuda::fused(q.device(), q.dtype()) && d == 128 && (1..=8).contains(&(h / hkv)) {
        return crate::cuda::decode_attention(
            q,
            k_pool,
            v_pool,
            rows,
            meta,
            plan,
            max_len,
            softmax_scale,
            kernels.decode_kernel(),
        );
    }
    let used = cu_k[b] as usize;
    let rows = rows.narrow(0, 0, used)?;
    let k = k_pool.index_select(&rows, 0)?.reshape((used, hkv, d))?;
    let v = v_pool.index_select(&rows, 0)?.reshape((used, hkv, d))?;
    let cu_q: Arc<[u32]> = (0..=b as u32).collect();
    crate::varlen_attention(q, &k, &v, &cu_q, cu_k, softmax_scale, kernels)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;
    use candle_core::Device;

    /// Each sequence's query against its own keys, one sequence at a time from contiguous K/V
    /// (the composed attention, its last query row): what the pool rows must reproduce, whatever
    /// order the rows sit in the pool.
    #[test]
    fn pool_rows_give_each_sequence_its_own_keys() -> Result<()> {
        let dev = Device::Cpu;
        let mut rng = Rng::new(5);
        let (hq, hkv, d, cap) = (4usize, 2usize, 8usize, 64usize);
        let lens = [1usize, 5, 17];
        let total: usize = lens.iter().sum();
        let kp = rng.randn(&[cap, hkv * d], 1.0, DType::F32, &dev)?;
        let vp = rng.randn(&[cap, hkv * d], 1.0, DType::F32, &dev)?;
        let q = rng.randn(&[lens.len(), hq, d], 1.0, DType::F32, &dev)?;
        // Rows scattered over the pool (an odd stride over a power of two: all distinct).
        let rows: Vec<u32> = (0..total).map(|i| ((i * 37 + 9) % cap) as u32).collect();
        let cu: Arc<[u32]> = [0u32, 1, 6, 23].into();
        let rows_t = Tensor::from_vec(rows.clone(), total, &dev)?;
        let plan = SplitPlan::for_call(lens.len(), hkv, 17);
        let meta = plan.device_meta(&cu);
        let cu_t = Tensor::from_vec(meta.clone(), meta.len(), &dev)?;
        let scale = 1.0 / (d as f64).sqrt();
        let got = decode_attention(&q, &kp, &vp, &rows_t, &cu, &cu_t, plan, scale, &KernelConfig::default())?;
        for (s, &len) in lens.iter().enumerate() {
            let idx = Tensor::from_vec(rows[cu[s] as usize..cu[s + 1] as usize].to_vec(), len, &dev)?;
            let k = kp.index_select(&idx, 0)?.reshape((len, hkv, d))?;
            let v = vp.index_select(&idx, 0)?.reshape((len, hkv, d))?;
            // The query as the last of `len` queries: earlier rows are zeros, only the last is read.
            let qs = Tensor::zeros((len - 1, hq, d), DType::F32, &dev)?;
            let qs = Tensor::cat(&[&qs, &q.narrow(0, s, 1)?], 0)?;
            let cu1: Arc<[u32]> = [0u32, len as u32].into();
            let want = crate::composed::varlen_attention(&qs, &k, &v, &cu1, &cu1, scale)?.narrow(0, len - 1, 1)?;
            let err = (got.narrow(0, s, 1)? - want)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            assert!(err < 1e-5, "sequence {s}: max err {err}");
        }
        // Offsets that do not cover the rows are refused, naming them.
        let bad: Arc<[u32]> = [0u32, 1, 6, 24].into();
        let e = decode_attention(
            &q,
            &kp,
            &vp,
            &rows_t,
            &bad,
            &cu_t,
            plan,
            scale,
            &KernelConfig::default(),
        )
        .unwrap_err();
        assert!(
            format!("{e}").contains("cu_k must rise from 0 to at most the 23 rows"),
            "{e}"
        );
        // A plan that does not reach the longest sequence's last key is refused.
        let short = SplitPlan { splits: 1, chunk: 64 };
        let long: Arc<[u32]> = [0u32, 1, 6, 23].into();
        let rows_l = Tensor::from_vec(
            (0..2 * cap as u32).map(|i| i % cap as u32).collect::<Vec<_>>(),
            2 * cap,
            &dev,
        )?;
        let _ = decode_attention(
            &q,
            &kp,
            &vp,
            &rows_l,
            &long,
            &cu_t,
            short,
            scale,
            &KernelConfig::default(),
        )?;
        let e = decode_attention(
            &q,
            &kp,
            &vp,
            &rows_l,
            &[0u32, 1, 6, 76].into(),
            &cu_t,
            short,
            scale,
            &KernelConfig::default(),
        )
        .unwrap_err();
        assert!(
            format!("{e}").contains("does not cover the longest sequence (70 keys)"),
            "{e}"
        );
        Ok(())
    }
}
