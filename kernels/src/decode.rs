//! Decode attention: one new query per sequence over that sequence's keys in a paged KV pool.
//!
//! `q: [B, H, d]` holds each sequence's query (its last position, so it sees every key of its
//! sequence); the keys and values of sequence `b` are the pool rows `rows[cu_k[b]..cu_k[b+1]]`
//! of `k_pool, v_pool: [capacity, Hkv x d]`. The result is `[B, H, d]` in q's dtype.
//!
//! Decisions:
//! - On CUDA, bf16, `d = 128` and 1-8 query heads per kv head: one split-KV kernel
//!   (`cuda/decode.cu`) that reads the pool rows in place, no gather and no 128-row query tiles.
//! - Everywhere else: the rows are gathered and [`crate::varlen_attention`] runs with one query per
//!   sequence, which is also the reference the kernel is tested against (`tests/cuda_vs_cpu.rs`).
//! - Forward only: decoding keeps no graph.
use crate::config::KernelConfig;
use candle_core::{bail, DType, Result, Tensor};
use std::sync::Arc;

/// See the module docs. `cu_k` on the host; `cu_k_dev`: the same values as a u32 tensor on the
/// pools' device (uploaded once per call by the caller, not once per layer).
#[allow(clippy::too_many_arguments)]
pub fn decode_attention(
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    rows: &Tensor,
    cu_k: &Arc<[u32]>,
    cu_k_dev: &Tensor,
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
    if cu_k.len() != b + 1 || cu_k[0] != 0 || cu_k.windows(2).any(|w| w[1] < w[0]) || cu_k[b] as usize != n {
        bail!("decode_attention: cu_k must rise from 0 to the {n} rows over {b} sequences, got {cu_k:?}");
    }
    if cu_k_dev.dims1()? != b + 1 || rows.dtype() != DType::U32 || cu_k_dev.dtype() != DType::U32 {
        bail!(
            "decode_attention: rows {:?} {:?} and cu_k {:?} {:?} must be u32, cu_k of {} entries",
            rows.dims(),
            rows.dtype(),
            cu_k_dev.dims(),
            cu_k_dev.dtype(),
            b + 1
        );
    }
    #[cfg(feature = "cuda")]
    if crate::cuda::fused(q.device(), q.dtype()) && d == 128 && (1..=8).contains(&(h / hkv)) {
        let max_len = cu_k.windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap_or(0);
        return crate::cuda::decode_attention(q, k_pool, v_pool, rows, cu_k_dev, max_len, softmax_scale);
    }
    let k = k_pool.index_select(rows, 0)?.reshape((n, hkv, d))?;
    let v = v_pool.index_select(rows, 0)?.reshape((n, hkv, d))?;
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
        let cu_t = Tensor::from_vec(cu.to_vec(), cu.len(), &dev)?;
        let scale = 1.0 / (d as f64).sqrt();
        let got = decode_attention(&q, &kp, &vp, &rows_t, &cu, &cu_t, scale, &KernelConfig::default())?;
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
        let bad: Arc<[u32]> = [0u32, 1, 6, 22].into();
        let e = decode_attention(&q, &kp, &vp, &rows_t, &bad, &cu_t, scale, &KernelConfig::default()).unwrap_err();
        assert!(format!("{e}").contains("cu_k must rise from 0 to the 23 rows"), "{e}");
        Ok(())
    }
}
