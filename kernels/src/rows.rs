//! Row moves: in-place row writes into a pool tensor (the KV cache's append: `pool[rows[r]] =
//! src[r]`), row gathers (`out[r] = src[index[r]]`: the embedding lookup, context parallelism's key
//! gathers, the engine's cached keys) and context parallelism's key-gradient scatter-add.
use candle_core::{bail, DType, Result, Tensor};

/// Writes row `r` of `src` (`[n, width]`) to row `rows[r]` of `pool` (`[capacity, width]`, same
/// dtype and device), in place; `rows`: `[n]` u32 on the pool's device, each below `capacity`
/// (the caller's invariant). On CUDA bf16 one kernel, one thread per element; elsewhere candle's
/// in-place scatter.
pub fn write_rows(pool: &Tensor, rows: &Tensor, src: &Tensor) -> Result<()> {
    let (n, width) = src.dims2()?;
    if pool.dims2()?.1 != width || rows.dims1()? != n || rows.dtype() != DType::U32 {
        bail!(
            "write_rows: pool {:?}, rows {:?} {:?}, src {:?}",
            pool.dims(),
            rows.dims(),
            rows.dtype(),
            src.dims()
        );
    }
    if n == 0 {
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    if crate::cuda::fused(pool.device(), pool.dtype()) {
        return crate::cuda::rows_write(pool, &src.contiguous()?, rows);
    }
    let idx = rows.reshape((n, 1))?.broadcast_as((n, width))?.contiguous()?;
    pool.scatter_set(&idx, &src.contiguous()?, 0)
}

/// [`write_rows`] of a layer's keys and values into their two pools at the same rows (on CUDA
/// bf16 one launch for both, reading each source row in place even when the rows are views of
/// wider rows). `k, v`: `[n, width]`, or `[n, heads, head_dim]` read as `[n, width]`.
pub fn write_rows2(k_pool: &Tensor, v_pool: &Tensor, rows: &Tensor, k: &Tensor, v: &Tensor) -> Result<()> {
    if k_pool.dims() != v_pool.dims() || k.dims() != v.dims() {
        bail!(
            "write_rows2: pools {:?} / {:?}, sources {:?} / {:?}",
            k_pool.dims(),
            v_pool.dims(),
            k.dims(),
            v.dims()
        );
    }
    let n = k.dim(0)?;
    if n == 0 {
        return Ok(());
    }
    let width = k.elem_count() / n;
    if k_pool.dims2()?.1 != width || rows.dims1()? != n || rows.dtype() != DType::U32 {
        bail!(
            "write_rows2: pool {:?}, rows {:?} {:?}, src {:?}",
            k_pool.dims(),
            rows.dims(),
            rows.dtype(),
            k.dims()
        );
    }
    #[cfg(feature = "cuda")]
    if crate::cuda::fused(k_pool.device(), k_pool.dtype()) {
        return crate::cuda::rows_write2(k_pool, v_pool, k, v, rows);
    }
    write_rows(k_pool, rows, &k.contiguous()?.reshape((n, width))?)?;
    write_rows(v_pool, rows, &v.contiguous()?.reshape((n, width))?)
}

/// `src[index[r]]` for each r: `[n, ...]` from `src` `[rows, ...]`, candle's
/// `src.index_select(index, 0)` (the same values). `index` is on the host; an index at or past
/// `src`'s rows is an error that names it. On CUDA (bf16, f16 or f32, rows a whole number of
/// 16-byte words) one kernel whose blocks copy whole rows, the rows uploaded once for repeated
/// calls with the same rows (a layer loop's); elsewhere candle's `index_select`.
pub fn gather_rows(src: &Tensor, index: &[u32]) -> Result<Tensor> {
    let rows = src.dim(0)?;
    if let Some((r, &i)) = index.iter().enumerate().find(|(_, &i)| i as usize >= rows) {
        bail!("gather_rows: index {r} is row {i}, past the source's {rows} rows");
    }
    #[cfg(feature = "cuda")]
    if let Some(t) = crate::cuda::gather_rows(src, crate::cuda::GatherIndex::Host(index))? {
        return Ok(t);
    }
    src.index_select(&Tensor::from_slice(index, index.len(), src.device())?, 0)
}

/// [`gather_rows`] with the rows already on `src`'s device (`index`: `[n]` u32). They are not
/// checked against `src`'s rows: on the CUDA kernel's path an index past them gives a row of
/// zeros, on candle's whatever its `index_select` does.
pub fn gather_rows_dev(src: &Tensor, index: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(t) = crate::cuda::gather_rows(src, crate::cuda::GatherIndex::Device(&index.contiguous()?))? {
        return Ok(t);
    }
    src.index_select(index, 0)
}

/// `out[index[j]] += src[j]` for every j in order, into zeros of `dst_rows` rows: candle's
/// `Tensor::zeros(..).index_add(index, src, 0)`, with the same bits. `src`: `[n, ...]`, `index`:
/// `n` rows below `dst_rows`; the result has `src`'s trailing dims. Context parallelism's
/// key-gradient scatter (`dK`/`dV` of each chunk's gathered keys back to the all-gathered rows).
///
/// On CUDA bf16 (rows a multiple of 8 elements, the source 16-byte aligned) one kernel over the destination rows, each
/// walking its own sources (listed here on the host, ascending j), with candle's bf16 adds in
/// candle's order. candle's own kernel gives each of a row's elements one thread that walks all
/// of `index` (`width` threads in all), ~10k dependent steps each at Qwen3-4B CP 2.
pub fn index_add_rows(src: &Tensor, index: &[u32], dst_rows: usize) -> Result<Tensor> {
    let n = src.dim(0)?;
    if index.len() != n {
        bail!("index_add_rows: {} indices for {n} source rows", index.len());
    }
    if let Some((j, &r)) = index.iter().enumerate().find(|(_, &r)| r as usize >= dst_rows) {
        bail!("index_add_rows: index {j} is row {r}, past the {dst_rows} destination rows");
    }
    let mut shape = src.dims().to_vec();
    shape[0] = dst_rows;
    #[cfg(feature = "cuda")]
    let width: usize = shape[1..].iter().product();
    #[cfg(feature = "cuda")]
    if crate::cuda::fused(src.device(), src.dtype()) && width.is_multiple_of(8) {
        let src = src.contiguous()?;
        // A view that starts off a 16-byte boundary (never CP's key gradients) takes candle's path.
        if crate::cuda::aligned16(&src)? {
            let csr = rows_by_destination(index, dst_rows);
            return crate::cuda::index_add_rows(&src, &csr, dst_rows, width)?.reshape(shape);
        }
    }
    let zeros = Tensor::zeros(shape.as_slice(), src.dtype(), src.device())?;
    zeros.index_add(&Tensor::from_slice(index, n, src.device())?, src, 0)
}

/// Each destination row's sources, ascending: `dst_rows + 1` offsets, then the source rows
/// (a counting sort of `index`, stable, so every row lists its sources in the order of `index`).
/// Every index is below `dst_rows` (checked by the caller).
#[cfg(any(feature = "cuda", test))]
fn rows_by_destination(index: &[u32], dst_rows: usize) -> Vec<u32> {
    let mut csr = vec![0u32; dst_rows + 1 + index.len()];
    for &r in index {
        csr[r as usize + 1] += 1;
    }
    for r in 0..dst_rows {
        csr[r + 1] += csr[r];
    }
    let mut next: Vec<u32> = csr[..dst_rows].to_vec();
    for (j, &r) in index.iter().enumerate() {
        let at = &mut next[r as usize];
        csr[dst_rows + 1 + *at as usize] = j as u32;
        *at += 1;
    }
    csr
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn rows_by_destination_lists_each_rows_sources_in_order() {
        // destinations of sources 0..6: 2, 0, 2, 3, 0, 2 (row 1 has none)
        let csr = rows_by_destination(&[2, 0, 2, 3, 0, 2], 4);
        assert_eq!(&csr[..5], &[0, 2, 2, 5, 6]);
        assert_eq!(&csr[5..], &[1, 4, 0, 2, 5, 3]);
    }

    #[test]
    fn index_add_rows_sums_each_rows_sources_and_names_bad_rows() -> Result<()> {
        let src = Tensor::arange(0f32, 24., &Device::Cpu)?.reshape((6, 2, 2))?;
        let index = [2u32, 0, 2, 3, 0, 2];
        let got = index_add_rows(&src, &index, 5)?;
        assert_eq!(got.dims(), &[5, 2, 2]);
        // Source row j is 4j .. 4j + 3. Row 0 = sources 1 + 4, row 2 = 0 + 2 + 5, row 3 = 3; rows
        // 1 and 4 have none.
        let want = [
            [20., 22., 24., 26.],
            [0.; 4],
            [28., 31., 34., 37.],
            [12., 13., 14., 15.],
            [0.; 4],
        ];
        assert_eq!(got.flatten_all()?.to_vec1::<f32>()?, want.concat());
        let e = index_add_rows(&src, &[2, 0, 2, 3, 0, 5], 5).unwrap_err().to_string();
        assert!(e.contains("index 5 is row 5, past the 5 destination rows"), "{e}");
        let e = index_add_rows(&src, &[0, 1], 5).unwrap_err().to_string();
        assert!(e.contains("2 indices for 6 source rows"), "{e}");
        Ok(())
    }

    #[test]
    fn gather_rows_takes_whole_rows_in_index_order_and_names_a_row_past_the_source() -> Result<()> {
        // Source row j is 4j .. 4j + 3 (as [2, 2]).
        let src = Tensor::arange(0f32, 24., &Device::Cpu)?.reshape((6, 2, 2))?;
        let got = gather_rows(&src, &[5, 0, 5, 2])?;
        assert_eq!(got.dims(), &[4, 2, 2]);
        let want: Vec<f32> = [5u32, 0, 5, 2]
            .iter()
            .flat_map(|&j| (0..4).map(move |c| (4 * j + c) as f32))
            .collect();
        assert_eq!(got.flatten_all()?.to_vec1::<f32>()?, want);
        let dev_index = Tensor::new(&[5u32, 0, 5, 2], &Device::Cpu)?;
        assert_eq!(
            gather_rows_dev(&src, &dev_index)?.flatten_all()?.to_vec1::<f32>()?,
            want
        );
        assert_eq!(gather_rows(&src, &[])?.dims(), &[0, 2, 2]);
        let e = gather_rows(&src, &[1, 6]).unwrap_err().to_string();
        assert!(e.contains("index 1 is row 6, past the source's 6 rows"), "{e}");
        Ok(())
    }
}
