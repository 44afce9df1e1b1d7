//! The placement-aware layout table: every parameter's HF name, global shape, dtype and
//! tensor-parallel placement, its local (this TP rank's) shape, and its offset in one flat buffer
//! of all local parameters back to back. ZeRO-1 shards that buffer; sharding on load, gathering
//! on save and the weight-sync bucket plan read the same table.
//!
//! Decisions:
//! - Model-agnostic: entries come from the model's own weight table, in its canonical order
//!   (for Qwen3: `vime_qwen3::state_dict::param_specs`). The flat order is that order.
//! - A split placement divides its dim evenly (Megatron's rule); anything else is an error naming
//!   the tensor, its shape and the TP size. TP rank `r` holds chunk `r`.
//! - ZeRO-1 shards (Megatron's distributed optimizer, llm.c's `zero.cuh`): the flat buffer is
//!   padded with zeros to `dp * shard_len`, `shard_len` a multiple of an alignment, and cut into
//!   `dp` equal contiguous ranges; a parameter may straddle a boundary. [`LayoutTable::segments`]
//!   says which part of which parameter a range holds; padding belongs to no parameter.
//! - `flatten` is one concatenation (each tensor viewed 1-D, cast if asked); `unflatten` returns
//!   narrows of the flat tensor reshaped (views, no copy).
use anyhow::{bail, ensure, Context, Result};
use candle_core::{DType, Tensor};
use std::collections::{BTreeMap, HashMap};
use std::ops::Range;

/// How tensor parallelism splits a parameter across the TP ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Placement {
    /// Every TP rank holds the whole tensor.
    Replicated,
    /// Column-parallel: split along dim 0 (output features).
    Column,
    /// Row-parallel: split along dim 1 (input features).
    Row,
    /// Vocab-parallel: split along dim 0 (the vocabulary).
    Vocab,
}

impl Placement {
    /// The dim split across TP ranks, `None` when replicated.
    pub fn split_dim(self) -> Option<usize> {
        match self {
            Placement::Replicated => None,
            Placement::Column | Placement::Vocab => Some(0),
            Placement::Row => Some(1),
        }
    }
}

/// The dtype as torch spells it (`torch.bfloat16` -> `"bfloat16"`).
pub fn torch_dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::U8 => "uint8",
        DType::U32 => "uint32",
        DType::I16 => "int16",
        DType::I32 => "int32",
        DType::I64 => "int64",
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        DType::F32 => "float32",
        DType::F64 => "float64",
        _ => "unknown",
    }
}

/// The dtype as a safetensors header spells it (`"BF16"`, `"F32"`, ...).
pub fn safetensors_dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::U8 => "U8",
        DType::U32 => "U32",
        DType::I16 => "I16",
        DType::I32 => "I32",
        DType::I64 => "I64",
        DType::BF16 => "BF16",
        DType::F16 => "F16",
        DType::F32 => "F32",
        DType::F64 => "F64",
        _ => "unknown",
    }
}

/// One parameter as the model's weight table describes it (global, unsharded).
#[derive(Debug, Clone, PartialEq)]
pub struct LayoutEntry {
    /// HF name.
    pub name: String,
    pub global_shape: Vec<usize>,
    /// The model's dtype for this parameter.
    pub dtype: DType,
    /// Whether the optimizer applies weight decay to it.
    pub weight_decay: bool,
    pub placement: Placement,
}

impl LayoutEntry {
    pub fn new(
        name: impl Into<String>,
        global_shape: &[usize],
        dtype: DType,
        weight_decay: bool,
        placement: Placement,
    ) -> Self {
        LayoutEntry {
            name: name.into(),
            global_shape: global_shape.to_vec(),
            dtype,
            weight_decay,
            placement,
        }
    }

    /// `"bfloat16"`, `"float32"`, ... (torch's spelling).
    pub fn dtype_name(&self) -> &'static str {
        torch_dtype_name(self.dtype)
    }
}

/// One parameter on this TP rank: the entry plus its local shape and place in the flat buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamLayout {
    pub entry: LayoutEntry,
    pub local_shape: Vec<usize>,
    pub numel: usize,
    /// Offset of the first element in the flat buffer of all local parameters.
    pub offset: usize,
}

impl ParamLayout {
    pub fn name(&self) -> &str {
        &self.entry.name
    }

    /// The elements this parameter occupies in the flat buffer.
    pub fn flat_range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel
    }
}

/// The part of one parameter that falls inside a range of the flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Segment {
    /// Index into [`LayoutTable::entries`].
    pub entry: usize,
    pub name: String,
    /// Range within the parameter's flattened (row-major) local tensor.
    pub param_range: Range<usize>,
    /// The same elements' range within the flat buffer.
    pub flat_range: Range<usize>,
}

impl Segment {
    pub fn len(&self) -> usize {
        self.param_range.len()
    }

    pub fn is_empty(&self) -> bool {
        self.param_range.is_empty()
    }

    /// Whether the segment is the whole parameter of `numel` elements.
    pub fn is_whole(&self, numel: usize) -> bool {
        self.param_range == (0..numel)
    }
}

#[derive(Debug, Clone)]
pub struct LayoutTable {
    params: Vec<ParamLayout>,
    index: HashMap<String, usize>,
    tp_rank: usize,
    tp_size: usize,
    total_numel: usize,
}

impl LayoutTable {
    /// The table of `entries` (canonical order) as TP rank `tp_rank` of `tp_size` holds them.
    pub fn new(entries: Vec<LayoutEntry>, tp_rank: usize, tp_size: usize) -> Result<Self> {
        ensure!(tp_size >= 1, "the tensor-parallel size must be at least 1");
        ensure!(
            tp_rank < tp_size,
            "tensor-parallel rank {tp_rank} is out of range for size {tp_size}"
        );
        let mut params = Vec::with_capacity(entries.len());
        let mut index = HashMap::with_capacity(entries.len());
        let mut offset = 0usize;
        for entry in entries {
            if index.insert(entry.name.clone(), params.len()).is_some() {
                bail!("parameter {} is listed twice in the layout table", entry.name);
            }
            let local_shape = local_shape(&entry, tp_size)?;
            let numel = local_shape.iter().product();
            params.push(ParamLayout {
                entry,
                local_shape,
                numel,
                offset,
            });
            offset += numel;
        }
        Ok(LayoutTable {
            params,
            index,
            tp_rank,
            tp_size,
            total_numel: offset,
        })
    }

    pub fn entries(&self) -> &[ParamLayout] {
        &self.params
    }

    pub fn len(&self) -> usize {
        self.params.len()
    }

    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.index.get(name).copied()
    }

    pub fn get(&self, name: &str) -> Option<&ParamLayout> {
        self.index_of(name).map(|i| &self.params[i])
    }

    pub fn tp_rank(&self) -> usize {
        self.tp_rank
    }

    pub fn tp_size(&self) -> usize {
        self.tp_size
    }

    /// Elements of all local parameters together (the flat buffer without padding).
    pub fn total_numel(&self) -> usize {
        self.total_numel
    }

    /// This TP rank's chunk of a global (unsharded) tensor of parameter `name`.
    pub fn local_shard(&self, name: &str, global: &Tensor) -> Result<Tensor> {
        let Some(p) = self.get(name) else {
            bail!("{name} is not in the layout table");
        };
        if global.dims() != p.entry.global_shape.as_slice() {
            bail!(
                "{name} has shape {:?}, the layout table's global shape is {:?}",
                global.dims(),
                p.entry.global_shape
            );
        }
        Ok(match p.entry.placement.split_dim() {
            None => global.clone(),
            Some(d) => {
                let n = p.local_shape[d];
                global.narrow(d, self.tp_rank * n, n)?
            }
        })
    }

    /// The global tensor of parameter `name` from every TP rank's `local` shard (the inverse of
    /// [`Self::local_shard`]): an all-gather over `tp` along the split dim, rank order; a
    /// replicated parameter comes back as it is. Collective: every TP rank calls it, same order.
    pub fn gather_global(&self, name: &str, local: &Tensor, tp: &dyn crate::Collectives) -> Result<Tensor> {
        let Some(p) = self.get(name) else {
            bail!("{name} is not in the layout table");
        };
        ensure!(
            tp.size() == self.tp_size,
            "{name}: the layout is for TP size {}, the group has {} ranks",
            self.tp_size,
            tp.size()
        );
        ensure!(
            local.dims() == p.local_shape.as_slice(),
            "{name}: local shard {:?}, the layout table's is {:?}",
            local.dims(),
            p.local_shape
        );
        Ok(match p.entry.placement.split_dim() {
            _ if self.tp_size == 1 => local.clone(),
            None => local.clone(),
            Some(0) => tp.all_gather(&local.contiguous()?)?,
            Some(d) => {
                // Gather along dim 0 of the transposed shard, then transpose back.
                let g = tp.all_gather(&local.transpose(0, d)?.contiguous()?)?;
                g.transpose(0, d)?.contiguous()?
            }
        })
    }

    /// The flat buffer of `tensors` (local shapes, one per entry, no others) in table order,
    /// 1-D, cast to `dtype` when given (else all must share one dtype).
    pub fn flatten(&self, tensors: &BTreeMap<String, Tensor>, dtype: Option<DType>) -> Result<Tensor> {
        self.flatten_padded(tensors, dtype, self.total_numel)
    }

    /// [`Self::flatten`] followed by zeros up to `len` elements (>= `total_numel`), still one
    /// concatenation.
    pub fn flatten_padded(
        &self,
        tensors: &BTreeMap<String, Tensor>,
        dtype: Option<DType>,
        len: usize,
    ) -> Result<Tensor> {
        ensure!(
            len >= self.total_numel,
            "flat length {len} is below the {} elements of the layout",
            self.total_numel
        );
        self.check_names(tensors.keys().map(String::as_str), "flatten")?;
        let mut parts = Vec::with_capacity(self.params.len() + 1);
        let mut out_dtype = dtype;
        let mut device = None;
        for p in &self.params {
            let t = &tensors[p.name()];
            if t.dims() != p.local_shape.as_slice() {
                bail!(
                    "{} has shape {:?}, the layout's local shape is {:?} (tp rank {} of {})",
                    p.name(),
                    t.dims(),
                    p.local_shape,
                    self.tp_rank,
                    self.tp_size
                );
            }
            let want = *out_dtype.get_or_insert(t.dtype());
            if dtype.is_none() && t.dtype() != want {
                bail!(
                    "{} has dtype {:?}, earlier tensors {want:?}; pass a dtype to flatten mixed dtypes",
                    p.name(),
                    t.dtype()
                );
            }
            device.get_or_insert_with(|| t.device().clone());
            if p.numel == 0 {
                continue;
            }
            let flat = t.flatten_all()?.to_dtype(want)?;
            parts.push(flat);
        }
        let dtype = out_dtype.unwrap_or(DType::F32);
        let device = device.unwrap_or(candle_core::Device::Cpu);
        if len > self.total_numel {
            parts.push(Tensor::zeros(len - self.total_numel, dtype, &device)?);
        }
        if parts.is_empty() {
            return Ok(Tensor::zeros(0, dtype, &device)?);
        }
        Tensor::cat(&parts, 0).context("concatenating the flat buffer")
    }

    /// The parameters of a flat buffer (1-D, at least `total_numel` long; elements past it are
    /// padding and ignored), each a narrow of `flat` reshaped to its local shape.
    pub fn unflatten(&self, flat: &Tensor) -> Result<BTreeMap<String, Tensor>> {
        ensure!(
            flat.rank() == 1 && flat.dim(0)? >= self.total_numel,
            "a flat buffer of this layout is 1-D with at least {} elements, got shape {:?}",
            self.total_numel,
            flat.dims()
        );
        self.params
            .iter()
            .map(|p| {
                let t = flat
                    .narrow(0, p.offset, p.numel)?
                    .reshape(p.local_shape.as_slice())
                    .with_context(|| format!("unflattening {}", p.name()))?;
                Ok((p.name().to_string(), t))
            })
            .collect()
    }

    /// Flat-buffer length padded for `dp` equal shards whose length is a multiple of `align`.
    pub fn padded_numel(&self, dp: usize, align: usize) -> usize {
        self.shard_len(dp, align) * dp.max(1)
    }

    fn shard_len(&self, dp: usize, align: usize) -> usize {
        let (dp, align) = (dp.max(1), align.max(1));
        self.total_numel.div_ceil(dp).div_ceil(align) * align
    }

    /// The ZeRO-1 shards: the flat buffer padded to a multiple of `dp`, cut into `dp` equal
    /// contiguous ranges (DP rank `r` owns range `r`).
    pub fn shard_ranges(&self, dp: usize) -> Vec<Range<usize>> {
        self.shard_ranges_aligned(dp, 1)
    }

    /// [`Self::shard_ranges`] with every shard's length a multiple of `align` elements.
    pub fn shard_ranges_aligned(&self, dp: usize, align: usize) -> Vec<Range<usize>> {
        let n = self.shard_len(dp, align);
        (0..dp.max(1)).map(|r| r * n..(r + 1) * n).collect()
    }

    /// The parts of parameters inside `range` of the flat buffer, in table order (padding and
    /// zero-element parameters give none).
    pub fn segments(&self, range: Range<usize>) -> Vec<Segment> {
        // First parameter ending after range.start (offsets are sorted).
        let first = self.params.partition_point(|p| p.offset + p.numel <= range.start);
        let mut out = Vec::new();
        for (i, p) in self.params.iter().enumerate().skip(first) {
            if p.offset >= range.end {
                break;
            }
            let lo = p.offset.max(range.start);
            let hi = (p.offset + p.numel).min(range.end);
            if lo < hi {
                out.push(Segment {
                    entry: i,
                    name: p.name().to_string(),
                    param_range: lo - p.offset..hi - p.offset,
                    flat_range: lo..hi,
                });
            }
        }
        out
    }

    /// Errors unless `names` are exactly the table's names (each listed once), naming the
    /// missing and the unknown ones.
    pub fn check_names<'a>(&self, names: impl IntoIterator<Item = &'a str>, what: &str) -> Result<()> {
        let mut seen = vec![false; self.params.len()];
        let mut unknown = Vec::new();
        for n in names {
            match self.index_of(n) {
                Some(i) => seen[i] = true,
                None => unknown.push(n.to_string()),
            }
        }
        let missing: Vec<String> = self
            .params
            .iter()
            .zip(&seen)
            .filter(|(_, s)| !**s)
            .map(|(p, _)| format!("{} {:?}", p.name(), p.local_shape))
            .collect();
        if !missing.is_empty() {
            bail!("{what}: no tensor for {}", missing.join(", "));
        }
        if !unknown.is_empty() {
            bail!("{what}: tensors for no parameter of the layout: {}", unknown.join(", "));
        }
        Ok(())
    }
}

fn local_shape(e: &LayoutEntry, tp: usize) -> Result<Vec<usize>> {
    let mut shape = e.global_shape.clone();
    if let Some(d) = e.placement.split_dim() {
        let Some(n) = shape.get_mut(d) else {
            bail!(
                "{} has shape {:?}: a {:?} placement splits dim {d}, which it does not have",
                e.name,
                e.global_shape,
                e.placement
            );
        };
        if *n % tp != 0 {
            bail!(
                "{} has shape {:?}: dim {d} ({}) is not divisible by the tensor-parallel size {tp} ({:?} placement)",
                e.name,
                e.global_shape,
                *n,
                e.placement
            );
        }
        *n /= tp;
    }
    Ok(shape)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// xorshift64*, enough for shapes.
    struct Rng(u64);
    impl Rng {
        fn below(&mut self, n: usize) -> usize {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            (self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n
        }
    }

    fn random_table(rng: &mut Rng, n: usize) -> LayoutTable {
        let entries = (0..n)
            .map(|i| {
                let rank = 1 + rng.below(3);
                let shape: Vec<usize> = (0..rank).map(|_| rng.below(6)).collect();
                LayoutEntry::new(format!("p{i}"), &shape, DType::F32, rank > 1, Placement::Replicated)
            })
            .collect();
        LayoutTable::new(entries, 0, 1).unwrap()
    }

    #[test]
    fn offsets_shards_and_segments_cover_every_element_once() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for trial in 0..40 {
            let t = random_table(&mut rng, 1 + trial % 9);
            let mut off = 0;
            for p in t.entries() {
                assert_eq!(p.offset, off);
                assert_eq!(p.numel, p.local_shape.iter().product::<usize>());
                off += p.numel;
            }
            assert_eq!(t.total_numel(), off);
            for dp in 1..=5 {
                for align in [1, 4] {
                    let ranges = t.shard_ranges_aligned(dp, align);
                    assert_eq!(ranges.len(), dp);
                    let len = ranges[0].len();
                    assert_eq!(len % align, 0);
                    assert_eq!(ranges[0].start, 0);
                    for w in ranges.windows(2) {
                        assert_eq!(w[0].end, w[1].start);
                        assert_eq!(w[1].len(), len);
                    }
                    assert!(ranges[dp - 1].end >= t.total_numel());
                    assert_eq!(ranges[dp - 1].end, t.padded_numel(dp, align));
                    // Every element of every parameter exactly once, flat and param ranges agreeing.
                    let mut hits = vec![0u8; t.total_numel()];
                    let mut per_param = vec![0usize; t.len()];
                    for r in &ranges {
                        for s in t.segments(r.clone()) {
                            let p = &t.entries()[s.entry];
                            assert_eq!(s.name, p.name());
                            assert!(s.flat_range.start >= r.start && s.flat_range.end <= r.end);
                            assert_eq!(s.flat_range.start, p.offset + s.param_range.start);
                            assert_eq!(s.flat_range.len(), s.param_range.len());
                            assert!(!s.is_empty());
                            per_param[s.entry] += s.len();
                            for h in &mut hits[s.flat_range.clone()] {
                                *h += 1;
                            }
                        }
                    }
                    assert!(hits.iter().all(|&h| h == 1), "trial {trial} dp {dp}");
                    for (p, n) in t.entries().iter().zip(per_param) {
                        assert_eq!(n, p.numel);
                    }
                }
            }
            // dp = 1: each segment is a whole parameter.
            for s in t.segments(t.shard_ranges(1)[0].clone()) {
                assert!(s.is_whole(t.entries()[s.entry].numel));
            }
        }
    }

    #[test]
    fn flatten_unflatten_round_trip() -> Result<()> {
        let mut rng = Rng(7);
        let t = random_table(&mut rng, 7);
        let mut map = BTreeMap::new();
        let mut k = 0f32;
        for p in t.entries() {
            let v: Vec<f32> = (0..p.numel)
                .map(|_| {
                    k += 1.0;
                    k
                })
                .collect();
            map.insert(
                p.name().to_string(),
                Tensor::from_vec(v, p.local_shape.as_slice(), &Device::Cpu)?,
            );
        }
        let flat = t.flatten(&map, None)?;
        assert_eq!(flat.dims(), &[t.total_numel()]);
        let want: Vec<f32> = (1..=t.total_numel()).map(|i| i as f32).collect();
        assert_eq!(flat.to_vec1::<f32>()?, want);
        let padded = t.flatten_padded(&map, Some(DType::BF16), t.padded_numel(3, 4))?;
        assert_eq!(padded.dtype(), DType::BF16);
        assert_eq!(padded.dims(), &[t.padded_numel(3, 4)]);
        let back = t.unflatten(&flat)?;
        let back_padded = t.unflatten(&padded.to_dtype(DType::F32)?)?;
        for (name, x) in &map {
            assert_eq!(back[name].dims(), x.dims());
            assert_eq!(
                back[name].flatten_all()?.to_vec1::<f32>()?,
                x.flatten_all()?.to_vec1::<f32>()?
            );
            assert_eq!(
                back_padded[name].flatten_all()?.to_vec1::<f32>()?,
                x.flatten_all()?.to_vec1::<f32>()?
            );
        }
        // Errors name the tensor.
        let mut bad = map.clone();
        bad.insert("p3".into(), Tensor::zeros(1000, DType::F32, &Device::Cpu)?);
        assert!(t.flatten(&bad, None).unwrap_err().to_string().contains("p3"));
        bad.remove("p3");
        assert!(t
            .flatten(&bad, None)
            .unwrap_err()
            .to_string()
            .contains("no tensor for p3"));
        let mut extra = map.clone();
        extra.insert("stray".into(), Tensor::zeros(1, DType::F32, &Device::Cpu)?);
        assert!(t.flatten(&extra, None).unwrap_err().to_string().contains("stray"));
        Ok(())
    }

    #[test]
    fn tensor_parallel_local_shapes() -> Result<()> {
        let entries = vec![
            LayoutEntry::new("embed", &[8, 4], DType::BF16, true, Placement::Vocab),
            LayoutEntry::new("q", &[6, 4], DType::BF16, true, Placement::Column),
            LayoutEntry::new("q.bias", &[6], DType::BF16, false, Placement::Column),
            LayoutEntry::new("o", &[4, 6], DType::BF16, true, Placement::Row),
            LayoutEntry::new("o.bias", &[4], DType::BF16, false, Placement::Replicated),
            LayoutEntry::new("norm", &[4], DType::BF16, false, Placement::Replicated),
        ];
        let t = LayoutTable::new(entries.clone(), 1, 2)?;
        let shapes: Vec<&[usize]> = t.entries().iter().map(|p| p.local_shape.as_slice()).collect();
        assert_eq!(shapes, vec![&[4, 4][..], &[3, 4], &[3], &[4, 3], &[4], &[4]]);
        assert_eq!(t.total_numel(), 16 + 12 + 3 + 12 + 4 + 4);
        assert_eq!(t.entries()[0].entry.dtype_name(), "bfloat16");
        let o = Tensor::arange(0f32, 24.0, &Device::Cpu)?.reshape((4, 6))?;
        let local = t.local_shard("o", &o)?;
        assert_eq!(local.to_vec2::<f32>()?[0], vec![3.0, 4.0, 5.0]);
        let err = LayoutTable::new(entries, 0, 4).unwrap_err().to_string();
        assert!(err.contains("q ") && err.contains("not divisible"), "{err}");
        Ok(())
    }
}
