//! Bucket bytes on the host: packing tensors into a bucket's safetensors-layout bytes and cutting
//! received bytes back into tensors, with every problem naming the tensor.
//!
//! The CUDA transports move the same layout with device copies (`cuda`); this is the path of the
//! CPU backend (a CPU trainer broadcasting to CPU engines) and of the checks.
use crate::plan::{Bucket, TensorSlot};
use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use serde_json::Value;
use vime_dist::layout::torch_dtype_name;

/// Little-endian bytes of `t` (copied to the host), in row-major order.
pub fn tensor_bytes(t: &Tensor) -> Result<Vec<u8>> {
    let t = t.flatten_all()?;
    Ok(match t.dtype() {
        DType::BF16 => t
            .to_vec1::<half::bf16>()?
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect(),
        DType::F16 => t.to_vec1::<half::f16>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F32 => t.to_vec1::<f32>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F64 => t.to_vec1::<f64>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::U8 => t.to_vec1::<u8>()?,
        DType::U32 => t.to_vec1::<u32>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::I64 => t.to_vec1::<i64>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        d => bail!("no byte view for dtype {d:?}"),
    })
}

/// Checks that `tensors` are the bucket's, in order, with its shapes.
pub fn check_sources(bucket: &Bucket, tensors: &[Tensor]) -> Result<()> {
    ensure!(
        tensors.len() == bucket.tensors.len(),
        "bucket of {} tensors given {} sources",
        bucket.tensors.len(),
        tensors.len()
    );
    for (slot, t) in bucket.tensors.iter().zip(tensors) {
        ensure!(
            t.dims() == slot.shape.as_slice(),
            "tensor {}: the plan has shape {:?}, the trainer's tensor is {:?}",
            slot.name,
            slot.shape,
            t.dims()
        );
        ensure!(
            t.dtype() == bucket.dtype,
            "tensor {}: sent as {:?} but prepared as {:?}",
            slot.name,
            bucket.dtype,
            t.dtype()
        );
    }
    Ok(())
}

/// The bucket's bytes: `tensors` (already in the bucket's dtype) back to back.
pub fn pack_host(bucket: &Bucket, tensors: &[Tensor]) -> Result<Vec<u8>> {
    check_sources(bucket, tensors)?;
    let mut out = Vec::with_capacity(bucket.nbytes);
    for (slot, t) in bucket.tensors.iter().zip(tensors) {
        let b = tensor_bytes(t).with_context(|| format!("packing {}", slot.name))?;
        debug_assert_eq!(b.len(), slot.nbytes());
        out.extend_from_slice(&b);
    }
    Ok(out)
}

/// The bucket metadata an engine receives (`update_info`): names, torch dtype names, shapes, in
/// packing order; byte ranges follow from them (tensors back to back).
#[derive(Debug, Clone, PartialEq)]
pub struct BucketMeta {
    pub dtype: DType,
    pub tensors: Vec<TensorSlot>,
    pub nbytes: usize,
}

/// candle's dtype of a torch dtype name (`bfloat16`, `float16`, `float32`, `torch.bfloat16`).
pub fn dtype_of_torch_name(name: &str) -> Option<DType> {
    let n = name.strip_prefix("torch.").unwrap_or(name);
    [DType::BF16, DType::F16, DType::F32, DType::F64, DType::U8, DType::I64]
        .into_iter()
        .find(|d| torch_dtype_name(*d) == n)
}

impl BucketMeta {
    pub fn of(bucket: &Bucket) -> Self {
        Self {
            dtype: bucket.dtype,
            tensors: bucket.tensors.clone(),
            nbytes: bucket.nbytes,
        }
    }

    /// Reads `names`, `dtype_names` and `shapes` of an `update_info` object; every problem names
    /// the key or the tensor.
    pub fn parse(info: &Value) -> Result<Self> {
        let list = |k: &str| -> Result<&Vec<Value>> {
            info.get(k)
                .and_then(Value::as_array)
                .with_context(|| format!("update_info.{k} must be a list"))
        };
        let names = list("names")?;
        let dtypes = list("dtype_names")?;
        let shapes = list("shapes")?;
        ensure!(
            names.len() == dtypes.len() && names.len() == shapes.len(),
            "update_info has {} names, {} dtype_names and {} shapes; they must be the same length",
            names.len(),
            dtypes.len(),
            shapes.len()
        );
        ensure!(!names.is_empty(), "update_info.names is empty");
        let mut tensors = Vec::with_capacity(names.len());
        let mut used = 0usize;
        let mut dtype = None;
        for ((n, d), s) in names.iter().zip(dtypes).zip(shapes) {
            let name = n
                .as_str()
                .with_context(|| format!("update_info.names holds a non-string {n}"))?
                .to_string();
            let dname = d
                .as_str()
                .with_context(|| format!("{name}: dtype name {d} is not a string"))?;
            let dt = dtype_of_torch_name(dname).with_context(|| format!("{name}: unknown dtype {dname:?}"))?;
            match dtype {
                None => dtype = Some(dt),
                Some(prev) if prev != dt => {
                    bail!(
                        "{name}: dtype {dname} differs from the bucket's {}",
                        torch_dtype_name(prev)
                    )
                }
                _ => {}
            }
            let shape: Vec<usize> = s
                .as_array()
                .with_context(|| format!("{name}: shape {s} is not a list"))?
                .iter()
                .map(|x| x.as_u64().map(|v| v as usize))
                .collect::<Option<_>>()
                .with_context(|| format!("{name}: shape {s} must hold non-negative integers"))?;
            let nbytes = shape.iter().product::<usize>() * dt.size_in_bytes();
            tensors.push(TensorSlot {
                name,
                shape,
                begin: used,
                end: used + nbytes,
            });
            used += nbytes;
        }
        Ok(Self {
            dtype: dtype.expect("non-empty"),
            tensors,
            nbytes: used,
        })
    }

    /// The tensors of `bytes` (the whole bucket) on `device`.
    pub fn unpack(&self, bytes: &[u8], device: &Device) -> Result<Vec<(String, Tensor)>> {
        ensure!(
            bytes.len() == self.nbytes,
            "bucket of {} tensors should be {} bytes, received {}",
            self.tensors.len(),
            self.nbytes,
            bytes.len()
        );
        self.tensors
            .iter()
            .map(|s| {
                let t = Tensor::from_raw_buffer(&bytes[s.begin..s.end], self.dtype, &s.shape, device)
                    .with_context(|| format!("unpacking {} {:?}", s.name, s.shape))?;
                Ok((s.name.clone(), t))
            })
            .collect()
    }
}

/// The per-tensor checksum both sides of a sync compare: FNV-1a over the tensor's bytes taken as
/// little-endian 64-bit words (a zero-padded tail word last), so 8 GB hash in seconds.
pub fn checksum(t: &Tensor) -> Result<u64> {
    Ok(checksum_bytes(&tensor_bytes(t)?))
}

pub fn checksum_bytes(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf29ce484222325;
    let mut chunks = bytes.chunks_exact(8);
    for c in &mut chunks {
        h ^= u64::from_le_bytes(c.try_into().expect("8 bytes"));
        h = h.wrapping_mul(0x100000001b3);
    }
    let tail = chunks.remainder();
    if !tail.is_empty() {
        let mut w = [0u8; 8];
        w[..tail.len()].copy_from_slice(tail);
        h ^= u64::from_le_bytes(w);
        h = h.wrapping_mul(0x100000001b3);
    }
    h ^ bytes.len() as u64
}
