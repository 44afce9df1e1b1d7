//! FP8 (E4M3 / E5M2) quantization with one scale per tensor, the input side of FP8 linear layers.
//!
//! Current scaling: the scale comes from the tensor's own amax, so a tensor's bits depend on the
//! tensor alone (no amax history across steps, which would make a resumed run differ from an
//! uninterrupted one):
//!
//! - `amax = max |x|` (NaNs ignored), `scale = fp8_max / amax` (1 when amax is 0 or not finite),
//! - `q = fp8(x * scale)`, rounded to nearest even and saturated to `+-fp8_max`,
//! - `scale_inv = 1 / scale`, which a GEMM multiplies its product by.
//!
//! Delayed scaling (`--fp8-recipe delayed`, [`AmaxHistory`]): the scale comes from an amax
//! history of earlier tensors of the same role, so the cast reads its input once (no amax pass);
//! the cast records the tensor's own amax as it goes, and [`AmaxHistory::commit`] moves it into
//! the history. The history is state: a checkpoint saves it ([`AmaxHistory::to_host`]).
//!
//! [`quantize`] runs on every device: the CPU path here is the reference, the CUDA kernels
//! (`cuda/fp8.cu`) match it bit for bit. It also writes the transpose on request, since Hopper's
//! FP8 GEMMs take only K-major operands: a linear layer's backward needs `W^T`, `X^T` and `dY^T`.
//! The GEMM itself is [`crate::cuda::fp8_matmul_t`] (CUDA only).
use candle_core::{bail, DType, Device, Result, Tensor};
use float8::{F8E4M3, F8E5M2};

/// The two FP8 formats: E4M3 (more precision, max 448: weights and activations) and E5M2 (more
/// range, max 57344: gradients).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fp8Format {
    E4M3,
    E5M2,
}

impl Fp8Format {
    /// The largest finite value.
    pub fn max(self) -> f32 {
        match self {
            Fp8Format::E4M3 => 448.0,
            Fp8Format::E5M2 => 57344.0,
        }
    }
    /// The value of an FP8 bit pattern.
    pub fn to_f32(self, bits: u8) -> f32 {
        match self {
            Fp8Format::E4M3 => F8E4M3::from_bits(bits).to_f32(),
            Fp8Format::E5M2 => F8E5M2::from_bits(bits).to_f32(),
        }
    }
    /// `x` rounded to nearest even, saturated to `+-max` (NaN stays NaN), as `cuda_fp8.h`'s
    /// `__NV_SATFINITE` conversion.
    pub fn from_f32(self, x: f32) -> u8 {
        match self {
            Fp8Format::E4M3 => F8E4M3::from_f32(x).to_bits(),
            Fp8Format::E5M2 => F8E5M2::from_f32(x).to_bits(),
        }
    }
}

/// The scale that maps `amax` onto the format's largest value (1 for an all-zero or non-finite
/// tensor), in f32 as the CUDA kernel computes it.
pub fn scale_for(amax: f32, format: Fp8Format) -> f32 {
    if amax > 0.0 && amax.is_finite() {
        format.max() / amax
    } else {
        1.0
    }
}

/// `scale_for` times `mul` (`2^-margin` under delayed scaling; 1 otherwise: the same value).
fn scale_times(amax: f32, format: Fp8Format, mul: f32) -> f32 {
    if amax > 0.0 && amax.is_finite() {
        format.max() / amax * mul
    } else {
        1.0
    }
}

/// A 2-D tensor in FP8: `data` (u8 bits, `[rows_pad, cols]`), optionally `data_t`
/// (`[cols, rows_pad]`, the transpose) and `scale_inv` (f32 `[1]`, on the same device). `rows`:
/// the tensor's rows; the rows past it (see [`quantize_padded`]) are zeros.
#[derive(Debug, Clone)]
pub struct Fp8Tensor {
    pub rows: usize,
    pub data: Tensor,
    pub data_t: Option<Tensor>,
    pub scale_inv: Tensor,
    pub format: Fp8Format,
}

impl Fp8Tensor {
    #[cfg(feature = "cuda")]
    fn from_parts(rows: usize, (data, data_t, scale_inv): crate::cuda::Fp8Parts, format: Fp8Format) -> Self {
        Self {
            rows,
            data,
            data_t,
            scale_inv,
            format,
        }
    }

    /// The transpose as a tensor of its own (`[cols, rows_pad]`, its rows the columns; read with
    /// [`Side::Rows`]), dropping the bits as quantized: what a weight gradient keeps of a
    /// forward's input, which its forward GEMM has already read.
    pub fn into_transpose(self) -> Result<Fp8Tensor> {
        let Some(t) = self.data_t else {
            bail!(
                "fp8: the transpose of {:?} was not made (quantize with transpose)",
                self.data.dims()
            );
        };
        Ok(Fp8Tensor {
            rows: t.dim(0)?,
            data: t,
            data_t: None,
            scale_inv: self.scale_inv,
            format: self.format,
        })
    }

    /// The values `q * scale_inv` as f32 `[rows, cols]` (for tests and error measurements).
    pub fn dequantize(&self) -> Result<Tensor> {
        dequantize_bits(&self.data, &self.scale_inv, self.format)
    }
}

/// `bits * scale_inv` as f32, for a u8 tensor of FP8 bits of `format`.
pub fn dequantize_bits(bits: &Tensor, scale_inv: &Tensor, format: Fp8Format) -> Result<Tensor> {
    let shape = bits.shape().clone();
    let s = scale_inv.flatten_all()?.to_vec1::<f32>()?;
    let [s] = s[..] else {
        bail!("fp8 dequantize: scale_inv has {} values, not 1", s.len());
    };
    let vals: Vec<f32> = bits
        .flatten_all()?
        .to_vec1::<u8>()?
        .into_iter()
        .map(|b| format.to_f32(b) * s)
        .collect();
    Tensor::from_vec(vals, shape, &Device::Cpu)
}

/// Which bits of an [`Fp8Tensor`] a GEMM reads: the tensor as quantized, or its transpose.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Rows,
    Transposed,
}

impl Fp8Tensor {
    fn bits(&self, side: Side) -> Result<&Tensor> {
        match side {
            Side::Rows => Ok(&self.data),
            Side::Transposed => match &self.data_t {
                Some(t) => Ok(t),
                None => bail!(
                    "fp8: the transpose of {:?} was not made (quantize with transpose)",
                    self.data.dims()
                ),
            },
        }
    }
}

/// `x . w^T` of FP8 operands (`x [n, k]` and `w [m, k]` as `xs` and `ws` select), times both
/// scales: a new `[n, m]` of dtype `out` (bf16 or f32), or added to `acc` and returned (on CUDA
/// the same buffer, written in place). On CUDA the cuBLASLt FP8 GEMM (fast accumulation if
/// `fast`); elsewhere the f32 product of the dequantized operands, the reference.
pub fn matmul_t(
    x: &Fp8Tensor,
    xs: Side,
    w: &Fp8Tensor,
    ws: Side,
    acc: Option<Tensor>,
    out: DType,
    fast: bool,
) -> Result<Tensor> {
    product(x, xs, w, ws, acc, out, fast, false)
}

/// One GEMM operand pair of [`matmul_t_sum`]: `x`, `xs`, `w`, `ws` as [`matmul_t`] takes them.
pub type Fp8Term<'a> = (&'a Fp8Tensor, Side, &'a Fp8Tensor, Side);

/// `sum_i x_i . w_i^T` (all `x_i` with the same rows) into a new `[n, m]` of dtype `out`: each
/// product after the first added by its GEMM to the sum of those before (on CUDA in the
/// epilogue, so one rounding to `out` a term and no add pass), the padding rows dropped once at
/// the end. What an input gradient through several projections of one input is (q/k/v, gate/up).
pub fn matmul_t_sum(terms: &[Fp8Term<'_>], out: DType, fast: bool) -> Result<Tensor> {
    let Some(((x0, xs0, _, _), _)) = terms.split_first() else {
        bail!("fp8 matmul_t_sum: no terms");
    };
    let mut acc = None;
    for &(x, xs, w, ws) in terms {
        if xs != *xs0 || x.rows != x0.rows {
            bail!("fp8 matmul_t_sum: the terms' x differ in rows or side");
        }
        acc = Some(product(x, xs, w, ws, acc, out, fast, true)?);
    }
    let sum = acc.expect("one term at least");
    match xs0 {
        Side::Rows if x0.rows < sum.dim(0)? => sum.narrow(0, 0, x0.rows),
        _ => Ok(sum),
    }
}

/// [`matmul_t`], with the padding rows of a new output kept when `keep_pad`.
#[allow(clippy::too_many_arguments)]
fn product(
    x: &Fp8Tensor,
    xs: Side,
    w: &Fp8Tensor,
    ws: Side,
    acc: Option<Tensor>,
    out: DType,
    fast: bool,
    keep_pad: bool,
) -> Result<Tensor> {
    let (xb, wb) = (x.bits(xs)?, w.bits(ws)?);
    // x's zero padding rows (see `quantize_padded`) give zero rows of the product: a new output
    // drops them (a view of its first rows), a sum must have them.
    let unpad = |t: Tensor| -> Result<Tensor> {
        match xs {
            Side::Rows if !keep_pad && x.rows < t.dim(0)? => t.narrow(0, 0, x.rows),
            _ => Ok(t),
        }
    };
    if let Some(a) = &acc {
        if a.dim(0)? != xb.dim(0)? {
            bail!(
                "fp8 matmul_t: a sum of {:?} for an operand of {} rows (padded: {})",
                a.dims(),
                x.rows,
                xb.dim(0)?
            );
        }
    }
    #[cfg(feature = "cuda")]
    if xb.device().is_cuda() {
        use crate::cuda::{fp8_matmul_t, Fp8Operand};
        let xo = Fp8Operand {
            bits: xb,
            ..Fp8Operand::of(x)
        };
        let wo = Fp8Operand {
            bits: wb,
            ..Fp8Operand::of(w)
        };
        let r = fp8_matmul_t(xo, wo, acc.as_ref(), out, fast)?;
        return match (r, acc) {
            (Some(t), _) => unpad(t),
            (None, Some(t)) => Ok(t),
            (None, None) => bail!("fp8 matmul_t: no output"),
        };
    }
    let _ = fast;
    let (n, k) = xb.dims2()?;
    let (m, kw) = wb.dims2()?;
    if k != kw {
        bail!(
            "fp8 matmul_t: x {:?} and w {:?} differ in their inner dimension",
            xb.dims(),
            wb.dims()
        );
    }
    let xd = dequantize_bits(xb, &x.scale_inv, x.format)?;
    let wd = dequantize_bits(wb, &w.scale_inv, w.format)?;
    let p = xd.matmul(&wd.t()?)?.to_device(xb.device())?;
    match acc {
        Some(a) => {
            if a.dims() != [n, m] {
                bail!("fp8 matmul_t: the sum is {:?}, the product [{n}, {m}]", a.dims());
            }
            // As the GEMM's epilogue: the product plus the sum in f32, rounded once.
            (a.to_dtype(DType::F32)? + p.to_dtype(DType::F32)?)?.to_dtype(a.dtype())
        }
        None => unpad(p.to_dtype(out)?),
    }
}

/// Quantizes a bf16 `[rows, cols]` tensor (see the module doc); with `transpose`, also its
/// transpose. CUDA tensors run `cuda/fp8.cu`, others the CPU reference.
pub fn quantize(x: &Tensor, format: Fp8Format, transpose: bool) -> Result<Fp8Tensor> {
    quantize_padded(x, format, transpose, 1)
}

/// [`quantize`] with the rows padded by zero rows to a multiple of `multiple` (Hopper's FP8 GEMMs
/// need every dimension a multiple of 16, and a batch's token count is anything). The scale is
/// the tensor's own: zeros do not move the amax.
pub fn quantize_padded(x: &Tensor, format: Fp8Format, transpose: bool, multiple: usize) -> Result<Fp8Tensor> {
    let rows_pad = padded_rows(x, multiple)?;
    #[cfg(feature = "cuda")]
    if x.device().is_cuda() {
        return quantize_cuda(x, format, transpose, rows_pad, crate::cuda::CastScale::CURRENT);
    }
    Ok(quantize_cpu(x, format, transpose, rows_pad, None, 1.0)?.0)
}

/// `x`'s rows rounded up to a multiple of `multiple`; an error unless `x` is a bf16 matrix.
fn padded_rows(x: &Tensor, multiple: usize) -> Result<usize> {
    let (rows, _) = x.dims2()?;
    if x.dtype() != DType::BF16 {
        bail!(
            "fp8 quantize: expected a bf16 tensor, got {:?} {:?}",
            x.dtype(),
            x.dims()
        );
    }
    Ok(rows.div_ceil(multiple.max(1)) * multiple.max(1))
}

/// The CUDA kernels' quantization of `x` (`cuda/fp8.cu`), scaled as `scale` says.
#[cfg(feature = "cuda")]
fn quantize_cuda(
    x: &Tensor,
    format: Fp8Format,
    transpose: bool,
    rows_pad: usize,
    scale: crate::cuda::CastScale,
) -> Result<Fp8Tensor> {
    let parts = crate::cuda::fp8_quantize(x, format == Fp8Format::E5M2, transpose, rows_pad, scale)?;
    Ok(Fp8Tensor::from_parts(x.dim(0)?, parts, format))
}

/// The cast's scale from an amax-history row starting at element `row` of the device history
/// `h`: its amax times `delayed` (`2^-margin`) when the role has one (`Some`), else the tensor's
/// own amax (current scaling); with `record`, the row's pending amax is raised.
#[cfg(feature = "cuda")]
fn device_scale(h: &Tensor, row: usize, delayed: Option<f32>, record: bool) -> Result<crate::cuda::CastScale> {
    let at = |i: usize| crate::cuda::f32_addr(h, row + i, "fp8 amax history");
    Ok(crate::cuda::CastScale {
        amax_in: if delayed.is_some() { at(1)? } else { 0 },
        scale_mul: delayed.unwrap_or(1.0),
        record: if record { at(0)? } else { 0 },
    })
}

/// The CPU reference of both scalings: the scale from `scale_amax` (delayed) or from `x`'s own
/// amax (current, `None`), times `mul`; returns the FP8 tensor and `x`'s amax.
fn quantize_cpu(
    x: &Tensor,
    format: Fp8Format,
    transpose: bool,
    rows_pad: usize,
    scale_amax: Option<f32>,
    mul: f32,
) -> Result<(Fp8Tensor, f32)> {
    let (rows, cols) = x.dims2()?;
    let v = x.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    let amax = v.iter().fold(0f32, |m, &a| m.max(a.abs()));
    let scale = scale_times(scale_amax.unwrap_or(amax), format, mul);
    let mut q: Vec<u8> = v.iter().map(|&a| format.from_f32(a * scale)).collect();
    q.resize(rows_pad * cols, 0);
    let data_t = if transpose {
        let mut t = vec![0u8; q.len()];
        for r in 0..rows {
            for c in 0..cols {
                t[c * rows_pad + r] = q[r * cols + c];
            }
        }
        Some(Tensor::from_vec(t, (cols, rows_pad), x.device())?)
    } else {
        None
    };
    let t = Fp8Tensor {
        rows,
        data: Tensor::from_vec(q, (rows_pad, cols), x.device())?,
        data_t,
        scale_inv: Tensor::from_vec(vec![1.0 / scale], 1, x.device())?,
        format,
    };
    Ok((t, amax))
}

/// How delayed scaling turns a history into a scale: Megatron's `--fp8-amax-history-len`,
/// `--fp8-amax-compute-algo` and `--fp8-margin` (defaults 1, most_recent, 0).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DelayedScaling {
    /// Amaxes kept a slot (>= 1).
    pub history_len: usize,
    /// The scale from the largest amax in the history (`max`) or the newest (`most_recent`).
    pub use_max: bool,
    /// `scale = fp8_max / amax / 2^margin`.
    pub margin: i32,
}

impl Default for DelayedScaling {
    fn default() -> Self {
        Self {
            history_len: 1,
            use_max: false,
            margin: 0,
        }
    }
}

impl DelayedScaling {
    /// An error naming the flag for a history length of 0 or a margin out of range.
    pub fn check(&self) -> std::result::Result<(), String> {
        if self.history_len == 0 || self.history_len > 65536 {
            return Err(format!(
                "--fp8-amax-history-len {}: expected 1 to 65536",
                self.history_len
            ));
        }
        if !(0..=64).contains(&self.margin) {
            return Err(format!("--fp8-margin {}: expected 0 to 64", self.margin));
        }
        Ok(())
    }
    fn scale_mul(&self) -> f32 {
        2f32.powi(-self.margin)
    }
}

/// Where an [`AmaxHistory`]'s rows live: f32 `[slots, 2 + history_len]`, a row `[pending,
/// amax, h_0 .. h_{n-1}]` (`h_0` the newest; `pending` the max of the tensors recorded since the
/// last commit; `amax` what the next quantization scales by).
#[derive(Debug)]
enum Rows {
    Host(Vec<f32>),
    /// On a CUDA device, written in place by the cast and commit kernels.
    #[cfg(feature = "cuda")]
    Device(Tensor),
}

/// Delayed scaling's state for `slots` tensor roles (one per layer and linear input or output
/// gradient): each role's amax history, and on the host which roles have one yet and which were
/// recorded since the last commit.
///
/// - A role with no history yet is quantized with current scaling (an amax pass), which seeds it.
/// - [`Self::quantize`] with `record` raises the role's pending amax to the tensor's amax; one
///   without (a scoring pass, or a recompute's first forward) only reads the history, so a
///   recompute quantizes with the same scale as the forward it repeats.
/// - [`Self::commit`] (once a micro-batch's backward is queued) moves each recorded role's
///   pending amax into its history.
#[derive(Debug)]
pub struct AmaxHistory {
    cfg: DelayedScaling,
    slots: usize,
    rows: Rows,
    seeded: Vec<bool>,
    recorded: Vec<bool>,
}

impl AmaxHistory {
    /// An empty history (no role seeded) on `device`.
    pub fn new(cfg: DelayedScaling, slots: usize, device: &Device) -> Result<Self> {
        cfg.check().map_err(candle_core::Error::Msg)?;
        let width = 2 + cfg.history_len;
        let rows = match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => Rows::Device(Tensor::zeros((slots, width), DType::F32, device)?),
            _ => Rows::Host(vec![0.0; slots * width]),
        };
        Ok(Self {
            cfg,
            slots,
            rows,
            seeded: vec![false; slots],
            recorded: vec![false; slots],
        })
    }

    pub fn config(&self) -> DelayedScaling {
        self.cfg
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    fn width(&self) -> usize {
        2 + self.cfg.history_len
    }

    /// [`quantize_padded`] of `x` for role `slot`: scaled by the role's history once it has
    /// one, else by `x`'s own amax; with `record`, `x`'s amax joins the role's pending amax.
    pub fn quantize(
        &mut self,
        slot: usize,
        x: &Tensor,
        format: Fp8Format,
        transpose: bool,
        multiple: usize,
        record: bool,
    ) -> Result<Fp8Tensor> {
        self.check_slot(slot)?;
        let rows_pad = padded_rows(x, multiple)?;
        let (seeded, width, mul) = (self.seeded[slot], self.width(), self.cfg.scale_mul());
        self.recorded[slot] |= record;
        match &mut self.rows {
            Rows::Host(h) => {
                let row = &mut h[slot * width..(slot + 1) * width];
                let (t, amax) = if seeded {
                    quantize_cpu(x, format, transpose, rows_pad, Some(row[1]), mul)?
                } else {
                    quantize_cpu(x, format, transpose, rows_pad, None, 1.0)?
                };
                if record {
                    row[0] = row[0].max(amax);
                }
                Ok(t)
            }
            #[cfg(feature = "cuda")]
            Rows::Device(h) => {
                if !x.device().same_device(h.device()) {
                    bail!(
                        "fp8 amax history: a tensor on {:?}, the history on {:?}",
                        x.device(),
                        h.device()
                    );
                }
                let scale = device_scale(h, slot * width, seeded.then_some(mul), record)?;
                quantize_cuda(x, format, transpose, rows_pad, scale)
            }
        }
    }

    /// The scales of the fused casts for `slots` on `t`: `Some` when the history is on `t`'s
    /// CUDA device and every slot is seeded (the fused casts have no amax pass), and then, with
    /// `record`, the slots count as recorded; `None` otherwise, with nothing changed.
    #[cfg(feature = "cuda")]
    fn fused_scales<const N: usize>(
        &mut self,
        slots: [usize; N],
        t: &Tensor,
        record: bool,
    ) -> Result<Option<[crate::cuda::CastScale; N]>> {
        let (width, mul) = (self.width(), self.cfg.scale_mul());
        let Rows::Device(h) = &self.rows else {
            return Ok(None);
        };
        if !t.device().same_device(h.device()) || !slots.iter().all(|&s| self.seeded[s]) {
            return Ok(None);
        }
        let mut scales = [crate::cuda::CastScale::CURRENT; N];
        for (sc, &slot) in scales.iter_mut().zip(&slots) {
            *sc = device_scale(h, slot * width, Some(mul), record)?;
        }
        for &slot in &slots {
            self.recorded[slot] |= record;
        }
        Ok(Some(scales))
    }

    fn check_slot(&self, slot: usize) -> Result<()> {
        if slot >= self.slots {
            bail!("fp8 amax history: role {slot} of {}", self.slots);
        }
        Ok(())
    }

    /// [`Self::quantize`] of `swiglu(gate, up)` ([`crate::swiglu`]) for role `slot` in one CUDA
    /// kernel that computes SwiGLU as it casts (the bf16 output is never written), when the
    /// history is on the device and the role seeded; `None` otherwise, for the caller to run
    /// SwiGLU and then [`Self::quantize`], which gives the same bits.
    #[allow(clippy::too_many_arguments)]
    pub fn try_quantize_swiglu(
        &mut self,
        slot: usize,
        gate: &Tensor,
        up: &Tensor,
        format: Fp8Format,
        transpose: bool,
        multiple: usize,
        record: bool,
    ) -> Result<Option<Fp8Tensor>> {
        self.check_slot(slot)?;
        #[cfg(feature = "cuda")]
        if let Some([scale]) = self.fused_scales([slot], gate, record)? {
            let rows_pad = padded_rows(gate, multiple)?;
            let parts =
                crate::cuda::fp8_swiglu_quantize(gate, up, format == Fp8Format::E5M2, transpose, rows_pad, scale)?;
            return Ok(Some(Fp8Tensor::from_parts(gate.dim(0)?, parts, format)));
        }
        let _ = (gate, up, format, transpose, multiple, record);
        Ok(None)
    }

    /// SwiGLU's input gradients `(d_gate, d_up)` for the upstream `dy`
    /// ([`crate::swiglu_backward`]) quantized with their transposes for roles `slots.0` and
    /// `slots.1`, in one CUDA kernel that computes them as it casts (the bf16 gradients are never
    /// written), when the history is on the device and both roles seeded; `None` otherwise, for
    /// the caller to run the backward and then [`Self::quantize`] of each (the same bits).
    #[allow(clippy::too_many_arguments)]
    pub fn try_quantize_swiglu_backward(
        &mut self,
        slots: (usize, usize),
        gate: &Tensor,
        up: &Tensor,
        dy: &Tensor,
        format: Fp8Format,
        multiple: usize,
        record: bool,
    ) -> Result<Option<(Fp8Tensor, Fp8Tensor)>> {
        self.check_slot(slots.0)?;
        self.check_slot(slots.1)?;
        #[cfg(feature = "cuda")]
        if let Some([sg, su]) = self.fused_scales([slots.0, slots.1], gate, record)? {
            let rows_pad = padded_rows(gate, multiple)?;
            let (pg, pu) =
                crate::cuda::fp8_swiglu_backward_quantize(gate, up, dy, format == Fp8Format::E5M2, rows_pad, sg, su)?;
            let rows = gate.dim(0)?;
            return Ok(Some((
                Fp8Tensor::from_parts(rows, pg, format),
                Fp8Tensor::from_parts(rows, pu, format),
            )));
        }
        let _ = (gate, up, dy, format, multiple, record);
        Ok(None)
    }

    /// Moves each role recorded since the last commit into its history (see the type's doc);
    /// those roles count as seeded from now on. Nothing to do when none was recorded.
    pub fn commit(&mut self) -> Result<()> {
        if !self.recorded.iter().any(|&r| r) {
            return Ok(());
        }
        let (width, use_max) = (self.width(), self.cfg.use_max);
        match &mut self.rows {
            Rows::Host(h) => {
                for (s, _) in self.recorded.iter().enumerate().filter(|(_, &r)| r) {
                    let row = &mut h[s * width..(s + 1) * width];
                    row.copy_within(2..width - 1, 3);
                    row[2] = row[0];
                    row[0] = 0.0;
                    row[1] = if use_max {
                        row[2..].iter().fold(0f32, |m, &a| m.max(a))
                    } else {
                        row[2]
                    };
                }
            }
            #[cfg(feature = "cuda")]
            Rows::Device(h) => {
                let mask: Vec<u8> = self.recorded.iter().map(|&r| u8::from(r)).collect();
                crate::cuda::fp8_amax_commit(h, &mask, self.cfg.history_len, use_max)?;
            }
        }
        for (s, r) in self.seeded.iter_mut().zip(self.recorded.iter_mut()) {
            *s |= std::mem::take(r);
        }
        Ok(())
    }

    /// The rows (f32 `[slots, 2 + history_len]`, as the type's doc lays them out) and which
    /// roles are seeded, on the host: what a checkpoint saves. Reads the device (a sync).
    pub fn to_host(&self) -> Result<(Vec<f32>, Vec<bool>)> {
        let rows = match &self.rows {
            Rows::Host(h) => h.clone(),
            #[cfg(feature = "cuda")]
            Rows::Device(h) => h.flatten_all()?.to_vec1::<f32>()?,
        };
        Ok((rows, self.seeded.clone()))
    }

    /// Replaces the state with a saved one ([`Self::to_host`]'s); an error if its shape is not
    /// this history's. Nothing counts as recorded afterwards.
    pub fn load_host(&mut self, rows: &[f32], seeded: &[bool]) -> Result<()> {
        let width = self.width();
        if rows.len() != self.slots * width || seeded.len() != self.slots {
            bail!(
                "fp8 amax history: a saved state of {} values and {} roles for {} roles of {width} (history length {})",
                rows.len(),
                seeded.len(),
                self.slots,
                self.cfg.history_len
            );
        }
        match &mut self.rows {
            Rows::Host(h) => h.copy_from_slice(rows),
            #[cfg(feature = "cuda")]
            Rows::Device(h) => *h = Tensor::from_slice(rows, (self.slots, width), h.device())?,
        }
        self.seeded.copy_from_slice(seeded);
        self.recorded.fill(false);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_limits_round_to_nearest_even_and_saturation() {
        for f in [Fp8Format::E4M3, Fp8Format::E5M2] {
            assert_eq!(f.to_f32(f.from_f32(f.max())), f.max());
            assert_eq!(f.to_f32(f.from_f32(1e9)), f.max(), "{f:?} saturates");
            assert_eq!(f.to_f32(f.from_f32(-1e9)), -f.max());
            assert!(f.to_f32(f.from_f32(f32::NAN)).is_nan());
            assert_eq!(f.to_f32(f.from_f32(0.0)), 0.0);
        }
        // E4M3 has 3 mantissa bits: 1 + 1/16 is halfway between 1 and 1.125 and rounds to even (1);
        // 1 + 3/16 between 1.125 and 1.25 rounds to 1.25.
        assert_eq!(Fp8Format::E4M3.to_f32(Fp8Format::E4M3.from_f32(1.0625)), 1.0);
        assert_eq!(Fp8Format::E4M3.to_f32(Fp8Format::E4M3.from_f32(1.1875)), 1.25);
        // E5M2 has 2: 1 + 1/8 rounds to 1, 1 + 3/8 to 1.5.
        assert_eq!(Fp8Format::E5M2.to_f32(Fp8Format::E5M2.from_f32(1.125)), 1.0);
        assert_eq!(Fp8Format::E5M2.to_f32(Fp8Format::E5M2.from_f32(1.375)), 1.5);
    }

    #[test]
    fn quantize_maps_amax_to_the_format_max_and_round_trips_within_half_an_ulp() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (37, 70), &dev).unwrap();
        // One outlier sets the scale.
        let x = x
            .slice_assign(&[3..4, 5..6], &Tensor::full(-9.5f32, (1, 1), &dev).unwrap())
            .unwrap();
        let xb = x.to_dtype(DType::BF16).unwrap();
        let xf = xb
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        for f in [Fp8Format::E4M3, Fp8Format::E5M2] {
            let q = quantize(&xb, f, true).unwrap();
            let s = q.scale_inv.to_vec1::<f32>().unwrap()[0];
            assert_eq!(s, 1.0 / (f.max() / 9.5));
            let d = q.dequantize().unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            // The outlier lands on the format's max exactly.
            assert_eq!(d[3 * 70 + 5], -9.5);
            let mant = if f == Fp8Format::E4M3 { 3 } else { 2 };
            for (a, b) in xf.iter().zip(&d) {
                // Normal range: relative error at most half an ulp, 2^-(mant+1).
                if a.abs() * (f.max() / 9.5) >= 2f32.powi(if f == Fp8Format::E4M3 { -6 } else { -14 }) {
                    assert!(
                        ((a - b) / a).abs() <= 2f32.powi(-(mant + 1)) * 1.0001,
                        "{f:?} {a} -> {b}"
                    );
                }
            }
            let n = q.data.to_vec2::<u8>().unwrap();
            let scale = q.scale_inv.to_vec1::<f32>().unwrap();
            // The transpose as a tensor of its own keeps the scale and format, and its rows are
            // the columns.
            let qt = q.into_transpose().unwrap();
            assert_eq!((qt.rows, qt.data_t.is_none(), qt.format), (n[0].len(), true, f));
            assert_eq!(qt.scale_inv.to_vec1::<f32>().unwrap(), scale);
            assert!(
                qt.clone().into_transpose().is_err(),
                "a second transpose was never made"
            );
            let t = qt.data.to_vec2::<u8>().unwrap();
            for (r, row) in n.iter().enumerate() {
                for (c, &b) in row.iter().enumerate() {
                    assert_eq!(t[c][r], b);
                }
            }
        }
    }

    #[test]
    fn a_sum_of_products_rounds_once_a_term_and_drops_the_padding_rows_at_the_end() {
        let g = |r: usize, c: usize, seed: u64| -> Tensor {
            let v: Vec<f32> = (0..r * c)
                .map(|i| (((i as u64 * 2654435761 + seed * 97) % 1000) as f32 / 500.0 - 1.0) * 3.0)
                .collect();
            Tensor::from_vec(v, (r, c), &Device::Cpu)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap()
        };
        // x rows 5, padded to 16; two terms, w [m = 3, k = 4] each.
        let q = |t: &Tensor, f| quantize_padded(t, f, false, 16).unwrap();
        let (x1, x2) = (q(&g(5, 4, 1), Fp8Format::E5M2), q(&g(5, 4, 2), Fp8Format::E5M2));
        let (w1, w2) = (
            quantize(&g(3, 4, 3), Fp8Format::E4M3, false).unwrap(),
            quantize(&g(3, 4, 4), Fp8Format::E4M3, false).unwrap(),
        );
        let s = matmul_t_sum(
            &[(&x1, Side::Rows, &w1, Side::Rows), (&x2, Side::Rows, &w2, Side::Rows)],
            DType::BF16,
            false,
        )
        .unwrap();
        assert_eq!(s.dims(), [5, 3]);
        // The reference: each product of the dequantized operands in f64, the running sum
        // rounded to bf16 after each term.
        let d = |t: &Fp8Tensor| t.dequantize().unwrap().to_dtype(DType::F64).unwrap();
        let p = |x: &Fp8Tensor, w: &Fp8Tensor| d(x).narrow(0, 0, 5).unwrap().matmul(&d(w).t().unwrap()).unwrap();
        let bf = |t: Tensor| t.to_dtype(DType::BF16).unwrap().to_dtype(DType::F64).unwrap();
        let want = bf((bf(p(&x1, &w1)) + p(&x2, &w2)).unwrap());
        let got = s.to_dtype(DType::F64).unwrap();
        assert_eq!(got.to_vec2::<f64>().unwrap(), want.to_vec2::<f64>().unwrap());
        assert!(matmul_t_sum(&[], DType::BF16, false).is_err());
        let mixed = matmul_t_sum(
            &[(&x1, Side::Rows, &w1, Side::Rows), (&w1, Side::Rows, &w1, Side::Rows)],
            DType::BF16,
            false,
        );
        assert!(mixed.is_err(), "terms with different rows are refused");
    }

    #[test]
    fn an_all_zero_tensor_gets_scale_one_and_bad_input_is_refused() {
        let z = Tensor::zeros((4, 6), DType::BF16, &Device::Cpu).unwrap();
        let q = quantize(&z, Fp8Format::E4M3, false).unwrap();
        assert_eq!(q.scale_inv.to_vec1::<f32>().unwrap(), [1.0]);
        assert!(q.data_t.is_none());
        assert!(q
            .data
            .flatten_all()
            .unwrap()
            .to_vec1::<u8>()
            .unwrap()
            .iter()
            .all(|&b| b == 0));
        let f = Tensor::zeros((4, 6), DType::F32, &Device::Cpu).unwrap();
        let e = quantize(&f, Fp8Format::E4M3, false).unwrap_err().to_string();
        assert!(e.contains("bf16"), "{e}");
        let v = Tensor::zeros(6, DType::BF16, &Device::Cpu).unwrap();
        assert!(quantize(&v, Fp8Format::E4M3, false).is_err());
    }

    /// A tensor's values as f32, flat.
    fn vals(t: &Tensor) -> Vec<f32> {
        crate::testing::f32_values(t).unwrap()
    }

    #[test]
    fn amax_history_seeds_records_commits_and_scales_by_its_rule() {
        let dev = Device::Cpu;
        // A tensor whose amax is `a` (one element), bf16-exact values.
        let t = |a: f32| {
            let v: Vec<f32> = (0..12)
                .map(|i| if i == 5 { -a } else { a * (i as f32) / 16.0 })
                .collect();
            Tensor::from_vec(v, (3, 4), &dev)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap()
        };
        let sinv = |q: &Fp8Tensor| q.scale_inv.to_vec1::<f32>().unwrap()[0];
        for use_max in [false, true] {
            let cfg = DelayedScaling {
                history_len: 3,
                use_max,
                margin: 2,
            };
            let mut h = AmaxHistory::new(cfg, 2, &dev).unwrap();
            // Unseeded: current scaling (no margin), the tensor's own amax; the bits and scale of
            // `quantize_padded`. Two records before a commit: the pending amax is their max.
            let q = h.quantize(0, &t(4.0), Fp8Format::E4M3, true, 16, true).unwrap();
            let want = quantize_padded(&t(4.0), Fp8Format::E4M3, true, 16).unwrap();
            assert_eq!(q.data.to_vec2::<u8>().unwrap(), want.data.to_vec2::<u8>().unwrap());
            assert_eq!(
                q.data_t.as_ref().unwrap().to_vec2::<u8>().unwrap(),
                want.data_t.unwrap().to_vec2::<u8>().unwrap()
            );
            assert_eq!(sinv(&q), 4.0 / 448.0);
            h.quantize(0, &t(6.0), Fp8Format::E4M3, false, 1, true).unwrap();
            // Read without recording: slot 1 stays unseeded after the commit.
            h.quantize(1, &t(9.0), Fp8Format::E5M2, false, 1, false).unwrap();
            h.commit().unwrap();
            let (rows, seeded) = h.to_host().unwrap();
            assert_eq!(seeded, [true, false]);
            assert_eq!(&rows[..5], &[0.0, 6.0, 6.0, 0.0, 0.0]);
            assert_eq!(&rows[5..], &[0.0; 5], "slot 1 untouched");
            // Seeded: the scale is fp8_max / 6 / 2^2, whatever the tensor's own amax (2 here).
            let q = h.quantize(0, &t(2.0), Fp8Format::E4M3, false, 1, true).unwrap();
            assert_eq!(sinv(&q), 1.0 / (448.0 / 6.0 / 4.0));
            let (d, x) = (vals(&q.dequantize().unwrap()), vals(&t(2.0)));
            let s = 448.0f32 / 6.0 / 4.0;
            for (a, b) in x.iter().zip(&d) {
                assert_eq!(*b, Fp8Format::E4M3.to_f32(Fp8Format::E4M3.from_f32(a * s)) * sinv(&q));
            }
            h.commit().unwrap();
            // A tensor larger than the scale allows saturates at fp8_max (times scale_inv).
            let q = h.quantize(0, &t(100.0), Fp8Format::E4M3, false, 1, true).unwrap();
            assert_eq!(vals(&q.dequantize().unwrap())[5], -448.0 * sinv(&q), "saturated");
            h.commit().unwrap();
            h.quantize(0, &t(1.0), Fp8Format::E4M3, false, 1, true).unwrap();
            h.commit().unwrap();
            // History [1, 100, 2] (6 dropped off the end): most recent 1, max 100.
            let (rows, _) = h.to_host().unwrap();
            assert_eq!(&rows[..5], &[0.0, if use_max { 100.0 } else { 1.0 }, 1.0, 100.0, 2.0]);
            // Saved and loaded: the same state; a state of another shape is refused.
            let mut g = AmaxHistory::new(cfg, 2, &dev).unwrap();
            let (rows, seeded) = h.to_host().unwrap();
            g.load_host(&rows, &seeded).unwrap();
            assert_eq!(g.to_host().unwrap(), (rows.clone(), seeded.clone()));
            assert!(g.load_host(&rows[1..], &seeded).is_err());
            assert!(
                h.quantize(2, &t(1.0), Fp8Format::E4M3, false, 1, true).is_err(),
                "no slot 2"
            );
        }
        assert!(AmaxHistory::new(
            DelayedScaling {
                history_len: 0,
                ..Default::default()
            },
            1,
            &dev
        )
        .is_err());
        assert!(AmaxHistory::new(
            DelayedScaling {
                margin: -1,
                ..Default::default()
            },
            1,
            &dev
        )
        .is_err());
    }
}
