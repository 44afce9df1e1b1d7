//! In-place row writes into a pool tensor (the KV cache's append): `pool[rows[r]] = src[r]`.
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
