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
