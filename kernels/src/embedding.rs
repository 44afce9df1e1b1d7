//! The backward of an embedding lookup `out[i] = table[ids[i]]`:
//!   d_table[v] = init[v] + sum over i with ids[i] == v of g[i]      (in token order)
//! in at least f32 (f64 for f64 gradients). `init` is the other gradient of a tied table (the LM
//! head's), so a tied model's embedding gradient comes out of one pass.
//!
//! Decisions:
//! - Deterministic: each row is summed by one thread per column, `init` first and then the tokens
//!   in increasing position, on the CPU and on CUDA alike (no atomics), so the two agree bit for
//!   bit. The CUDA kernel gets the positions grouped by token id from a counting sort on the host
//!   (the ids are host data anyway).
//! - Every row of the output is written (zeros, or `init`, where no token occurs), so the result
//!   needs no separate zero fill; the f32 output is what the optimizer's buffers hold, so there is
//!   no later cast pass over the `[V, H]` table either.
use candle_core::{bail, DType, Device, Result, Tensor};

/// `d_table` (`[vocab, D]`, f32, or f64 for f64 `g`) for `g: [T, D]` and `ids: [T]`, plus `init`
/// (`[vocab, D]`, any float dtype) when given.
pub fn embedding_backward(ids: &[u32], g: &Tensor, vocab: usize, init: Option<&Tensor>) -> Result<Tensor> {
    let (t, d) = g.dims2()?;
    if ids.len() != t {
        bail!("embedding_backward: {} ids for a gradient of {t} rows", ids.len());
    }
    if let Some((i, &id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
        bail!("embedding_backward: id {id} at position {i} is outside the vocabulary ({vocab} rows)");
    }
    if let Some(init) = init {
        if init.dims() != [vocab, d] {
            bail!("embedding_backward: init {:?}, expected [{vocab}, {d}]", init.dims());
        }
    }
    #[cfg(feature = "cuda")]
    if crate::fused_cuda(g.device(), g.dtype()) && init.is_none_or(|i| i.dtype() == DType::BF16) {
        let init = init.map(|i| i.contiguous()).transpose()?;
        return crate::cuda::embedding_backward(ids, &g.contiguous()?, vocab, init.as_ref());
    }
    let acc = if g.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    let dev = g.device().clone();
    let g = g.to_device(&Device::Cpu)?.to_dtype(acc)?;
    let init = match init {
        Some(i) => Some(i.to_device(&Device::Cpu)?.to_dtype(acc)?),
        None => None,
    };
    let out = match acc {
        DType::F64 => scatter::<f64>(ids, &g, vocab, d, init.as_ref())?,
        _ => scatter::<f32>(ids, &g, vocab, d, init.as_ref())?,
    };
    out.to_device(&dev)
}

/// `sum + d_table` for a running gradient sum `sum: [vocab, D]` (f32, or f64 for f64 `g`): on CUDA
/// (bf16 `g`, f32 `sum`) in place, reading and writing only the rows of the ids in `ids`
/// (`sum` must not be shared: the returned tensor is `sum` itself); elsewhere [`embedding_backward`]
/// with `sum` as its `init` (a new tensor). The same per-element order either way: the sum's value
/// first, then the tokens in increasing position.
pub fn embedding_backward_into(ids: &[u32], g: &Tensor, sum: Tensor) -> Result<Tensor> {
    let (t, d) = g.dims2()?;
    let vocab = sum.dim(0)?;
    if sum.dims() != [vocab, d] {
        bail!(
            "embedding_backward: the running sum is {:?}, the gradient's rows are {d} wide",
            sum.dims()
        );
    }
    let want = if g.dtype() == DType::F64 {
        DType::F64
    } else {
        DType::F32
    };
    if sum.dtype() != want {
        bail!(
            "embedding_backward: the running sum is {:?}, expected {want:?}",
            sum.dtype()
        );
    }
    if ids.len() != t {
        bail!("embedding_backward: {} ids for a gradient of {t} rows", ids.len());
    }
    if let Some((i, &id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
        bail!("embedding_backward: id {id} at position {i} is outside the vocabulary ({vocab} rows)");
    }
    #[cfg(feature = "cuda")]
    if crate::fused_cuda(g.device(), g.dtype()) && sum.is_contiguous() {
        crate::cuda::embedding_backward_acc(ids, &g.contiguous()?, &sum)?;
        return Ok(sum);
    }
    embedding_backward(ids, g, vocab, Some(&sum))
}

fn scatter<T>(ids: &[u32], g: &Tensor, vocab: usize, d: usize, init: Option<&Tensor>) -> Result<Tensor>
where
    T: candle_core::WithDType + std::ops::AddAssign,
{
    let mut out: Vec<T> = match init {
        Some(i) => i.flatten_all()?.to_vec1::<T>()?,
        None => vec![T::zero(); vocab * d],
    };
    let gv = g.flatten_all()?.to_vec1::<T>()?;
    for (i, &id) in ids.iter().enumerate() {
        let row = &mut out[id as usize * d..(id as usize + 1) * d];
        for (o, &x) in row.iter_mut().zip(&gv[i * d..(i + 1) * d]) {
            *o += x;
        }
    }
    Tensor::from_vec(out, (vocab, d), &Device::Cpu)
}
