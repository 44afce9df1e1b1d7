//! The bucket plan of a weight sync: every parameter's HF name, torch dtype name, full (gathered)
//! shape and byte range, tensors back to back in safetensors layout, cut into buckets of
//! `--update-weight-buffer-size` bytes (slime's flag, default 512 MiB).
//!
//! Decisions:
//! - The plan reads the layout table (`vime_dist::layout`), in its canonical HF layer order, and
//!   uses each parameter's GLOBAL shape: with tensor parallelism the shards are gathered to full
//!   HF tensors before packing, as Megatron does, so the engine always receives HF tensors.
//! - Tensors are packed with no padding between them, exactly as safetensors lays out its data
//!   section; [`Bucket::safetensors_header`] makes any bucket a valid safetensors file when the
//!   header is written in front of the bucket's bytes (the tests read it back with the
//!   `safetensors` crate).
//! - Two closing rules, because the two receivers differ:
//!   - [`BucketRule::CloseBefore`] (vime's buffers, slime's `_update_bucket_weights` rule): a
//!     tensor that would push the bucket past the buffer size starts the next bucket, so a bucket
//!     never exceeds the buffer unless one tensor alone does (then it is a bucket of its own).
//!   - [`BucketRule::CloseAfter`] (vLLM's packed NCCL mode, `distributed/weight_transfer/
//!     packed_tensor.py` in 0.26 and 0.33): a bucket closes right after the tensor that brings it
//!     strictly past the buffer size.
//! - The transfer dtype is one for all tensors (`bfloat16` for vLLM); the casts happen before the
//!   engines pause, so the plan is computed once per run, not per sync.
use anyhow::{bail, Result};
use candle_core::DType;
use serde_json::{json, Map, Value};
use vime_dist::layout::{safetensors_dtype_name, torch_dtype_name, LayoutTable};

/// slime's `--update-weight-buffer-size` default: 512 MiB.
pub const DEFAULT_BUFFER_BYTES: usize = 512 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BucketRule {
    /// Close a bucket before the tensor that would push it past the buffer size.
    CloseBefore,
    /// Close a bucket right after the tensor that brings it strictly past the buffer size.
    CloseAfter,
}

/// One tensor inside a bucket.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorSlot {
    pub name: String,
    /// The full HF shape.
    pub shape: Vec<usize>,
    /// Byte range inside the bucket.
    pub begin: usize,
    pub end: usize,
}

impl TensorSlot {
    pub fn nbytes(&self) -> usize {
        self.end - self.begin
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Bucket {
    pub tensors: Vec<TensorSlot>,
    pub nbytes: usize,
    pub dtype: DType,
}

impl Bucket {
    /// vLLM's `update_info` metadata of this bucket: `names`, `dtype_names`, `shapes`.
    pub fn update_info(&self) -> Value {
        let names: Vec<&str> = self.tensors.iter().map(|t| t.name.as_str()).collect();
        let dtypes: Vec<&str> = self.tensors.iter().map(|_| torch_dtype_name(self.dtype)).collect();
        let shapes: Vec<&[usize]> = self.tensors.iter().map(|t| t.shape.as_slice()).collect();
        json!({ "names": names, "dtype_names": dtypes, "shapes": shapes })
    }

    /// The safetensors header (8-byte little-endian length, then the JSON, space-padded to a
    /// multiple of 8 as the format recommends) that makes `header ++ bucket bytes` a safetensors
    /// file.
    pub fn safetensors_header(&self) -> Vec<u8> {
        let mut m = Map::new();
        for t in &self.tensors {
            m.insert(
                t.name.clone(),
                json!({
                    "dtype": safetensors_dtype_name(self.dtype),
                    "shape": t.shape,
                    "data_offsets": [t.begin, t.end],
                }),
            );
        }
        let mut text = serde_json::to_vec(&Value::Object(m)).expect("a JSON object serialises");
        while !(8 + text.len()).is_multiple_of(8) {
            text.push(b' ');
        }
        let mut out = (text.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(&text);
        out
    }
}

/// The whole sync: buckets in order, every parameter exactly once.
#[derive(Debug, Clone, PartialEq)]
pub struct SyncPlan {
    pub buckets: Vec<Bucket>,
    pub buffer_bytes: usize,
    pub rule: BucketRule,
}

impl SyncPlan {
    /// The plan of every parameter of `table` (global shapes, table order) sent as `dtype` in
    /// buckets of `buffer_bytes`.
    pub fn new(table: &LayoutTable, dtype: DType, buffer_bytes: usize, rule: BucketRule) -> Result<Self> {
        if buffer_bytes == 0 {
            bail!("--update-weight-buffer-size must be positive");
        }
        if table.is_empty() {
            bail!("the weight sync has no parameters to send");
        }
        let elem = dtype.size_in_bytes();
        let mut buckets: Vec<Bucket> = Vec::new();
        let mut cur: Vec<TensorSlot> = Vec::new();
        let mut used = 0usize;
        let close = |cur: &mut Vec<TensorSlot>, used: &mut usize, buckets: &mut Vec<Bucket>| {
            if !cur.is_empty() {
                buckets.push(Bucket {
                    tensors: std::mem::take(cur),
                    nbytes: *used,
                    dtype,
                });
                *used = 0;
            }
        };
        for p in table.entries() {
            let shape = p.entry.global_shape.clone();
            let nbytes = shape.iter().product::<usize>() * elem;
            if rule == BucketRule::CloseBefore && used > 0 && used + nbytes > buffer_bytes {
                close(&mut cur, &mut used, &mut buckets);
            }
            cur.push(TensorSlot {
                name: p.entry.name.clone(),
                shape,
                begin: used,
                end: used + nbytes,
            });
            used += nbytes;
            // CloseBefore: a full bucket closes; CloseAfter: vLLM's `>` (a bucket that lands exactly
            // on the size stays open for the next tensor, `packed_tensor.py`).
            let full = match rule {
                BucketRule::CloseBefore => used >= buffer_bytes,
                BucketRule::CloseAfter => used > buffer_bytes,
            };
            if full {
                close(&mut cur, &mut used, &mut buckets);
            }
        }
        close(&mut cur, &mut used, &mut buckets);
        Ok(SyncPlan {
            buckets,
            buffer_bytes,
            rule,
        })
    }

    pub fn total_bytes(&self) -> usize {
        self.buckets.iter().map(|b| b.nbytes).sum()
    }

    pub fn num_tensors(&self) -> usize {
        self.buckets.iter().map(|b| b.tensors.len()).sum()
    }
}
