//! The CUDA side of [`crate::fp8`]: per-tensor quantization (`cuda/fp8.cu`) and FP8 GEMMs through
//! cuBLASLt.
//!
//! Hopper's FP8 GEMMs take only the "TN" layout (both operands K-major), which in row-major terms
//! is one form: `out [n, m] = x [n, k] . w [m, k]^T`. A linear layer's three GEMMs all take it:
//! the forward `Y = X . W^T`, the input gradient `dX = dY . (W^T)^T` and the weight gradient
//! `dW = dY^T . (X^T)^T`, which is why [`fp8_quantize`] can write the transpose too.
//!
//! The algorithm of each shape is cuBLASLt's first heuristic choice, which is fixed for a given
//! cuBLAS version, GPU and shape: the same bits in every process (no timing enters the choice).
use super::{device_tensor, i32_of, tensor_addr, FP8_PTX};
use candle_core::cuda_backend::cudarc::cublaslt::{result as lt, sys as lt_sys};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, DeviceId, WrapErr};
use candle_core::{bail, DType, Result, Tensor};
use half::bf16;
use std::sync::{Mutex, OnceLock};

fn dev_of(t: &Tensor, what: &str) -> Result<CudaDevice> {
    match t.device() {
        candle_core::Device::Cuda(d) => Ok(d.clone()),
        _ => bail!("{what}: tensor is not on a CUDA device"),
    }
}

/// The most blocks of the amax reduction: four per SM of an H200 keep ~64 KB of loads in flight
/// per SM, and every block of the cast reads this many partials.
const AMAX_BLOCKS: usize = 528;

/// Where the cast's scale comes from, as device addresses (0: none).
#[derive(Debug, Clone, Copy)]
pub(crate) struct CastScale {
    /// An f32 amax on the device to scale by (delayed scaling), or 0: this tensor's own amax
    /// (current scaling: the amax reduction runs first).
    pub amax_in: u64,
    /// What the scale is multiplied by after `fp8_max / amax`: `2^-margin` (exact).
    pub scale_mul: f32,
    /// An f32 on the device that the cast raises (atomicMax) to this tensor's amax, or 0.
    pub record: u64,
}

impl CastScale {
    /// Current scaling, nothing recorded: the tensor's own amax.
    pub(crate) const CURRENT: CastScale = CastScale {
        amax_in: 0,
        scale_mul: 1.0,
        record: 0,
    };
}

/// The address of element `i` of an f32 tensor on a CUDA device.
pub(crate) fn f32_addr(t: &Tensor, i: usize, what: &str) -> Result<u64> {
    if i >= t.elem_count() {
        bail!("{what}: element {i} of a tensor of {}", t.elem_count());
    }
    Ok(tensor_addr::<f32>(t, what)? + 4 * i as u64)
}

/// One cast's outputs: the FP8 rows `[rows_pad, cols]`, the transpose `[cols, rows_pad]` if asked,
/// and `scale_inv` f32 `[1]`. The rows past `rows` read as zeros.
struct CastBufs {
    out: CudaSlice<u8>,
    out_t: Option<CudaSlice<u8>>,
    sinv: CudaSlice<f32>,
    rows_pad: usize,
    cols: usize,
}

/// An FP8 tensor's bits, its transpose if any, and its `scale_inv`.
pub(crate) type Fp8Parts = (Tensor, Option<Tensor>, Tensor);

impl CastBufs {
    fn new(dev: &CudaDevice, rows: usize, cols: usize, rows_pad: usize, transpose: bool) -> Result<Self> {
        // Padding rows must read as zeros; without padding every byte is written.
        let buf = |len: usize| -> Result<CudaSlice<u8>> {
            if rows_pad > rows {
                dev.alloc_zeros::<u8>(len.max(1))
            } else {
                unsafe { dev.alloc::<u8>(len.max(1)) }
            }
        };
        Ok(Self {
            out: buf(rows_pad * cols)?,
            out_t: if transpose { Some(buf(rows_pad * cols)?) } else { None },
            sinv: unsafe { dev.alloc::<f32>(1) }?,
            rows_pad,
            cols,
        })
    }

    /// Device addresses of the rows, the transpose (0: none) and `scale_inv`.
    fn addrs(&self, dev: &CudaDevice) -> (u64, u64, u64) {
        (
            super::slice_addr(&self.out, dev),
            self.out_t.as_ref().map(|t| super::slice_addr(t, dev)).unwrap_or(0),
            super::slice_addr(&self.sinv, dev),
        )
    }

    fn into_parts(self, dev: &CudaDevice) -> Fp8Parts {
        let (r, c) = (self.rows_pad, self.cols);
        (
            device_tensor(self.out, dev, (r, c)),
            self.out_t.map(|t| device_tensor(t, dev, (c, r))),
            device_tensor(self.sinv, dev, 1),
        )
    }
}

/// The cast kernels' grid: a 256-thread block a 64 x 128 tile.
fn cast_grid(rows: usize, cols: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (cols.div_ceil(128).max(1) as u32, rows.div_ceil(64).max(1) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The kernels' `rows`, `cols` and padded-rows arguments, each checked to fit an i32.
fn cast_dims(what: &str, rows: usize, cols: usize, rows_pad: usize) -> Result<(i32, i32, i32)> {
    Ok((
        i32_of(what, "rows", rows)?,
        i32_of(what, "cols", cols)?,
        i32_of(what, "padded rows", rows_pad)?,
    ))
}

/// bf16 `x [rows, cols]` -> (FP8 bits `[rows_pad, cols]`, the transpose `[cols, rows_pad]` if
/// asked, `scale_inv` f32 `[1]`), the rows past `rows` zero; see [`crate::fp8`]. No host sync.
/// Current scaling: two launches, the amax reduction and the cast, which reads the amax on the
/// device. Delayed scaling (`scale.amax_in`): the cast alone.
pub(crate) fn fp8_quantize(
    x: &Tensor,
    e5m2: bool,
    transpose: bool,
    rows_pad: usize,
    scale: CastScale,
) -> Result<Fp8Parts> {
    let (rows, cols) = x.dims2()?;
    let dev = dev_of(x, "fp8 quantize")?;
    let x = x.contiguous()?;
    let xp = tensor_addr::<bf16>(&x, "fp8 quantize x")?;
    let n = rows * cols;
    let (r_i, c_i, ld_i) = cast_dims("fp8 quantize", rows, cols, rows_pad)?;
    // The amax's per-block partials (every one written: no zero-fill); none under delayed
    // scaling.
    let parts = if scale.amax_in == 0 {
        n.div_ceil(8 * 256 * 4).clamp(1, AMAX_BLOCKS)
    } else {
        1
    };
    let amax = unsafe { dev.alloc::<u32>(parts) }?;
    let bufs = CastBufs::new(&dev, rows, cols, rows_pad, transpose)?;
    let ap = super::slice_addr(&amax, &dev);
    let (op, tp, sp) = bufs.addrs(&dev);
    let n_u = n as u64;
    if scale.amax_in == 0 {
        let f = super::load(&dev, "vime_fp8", FP8_PTX, "vime_fp8_amax")?;
        launch!(dev, f, super::cfg(parts as u32, 256), [&xp, &n_u, &ap]);
    }
    let f = super::load(&dev, "vime_fp8", FP8_PTX, "vime_fp8_cast")?;
    let (e, np) = (i32::from(e5m2), parts as i32);
    let (ain, mul, rec) = (scale.amax_in, scale.scale_mul, scale.record);
    launch!(
        dev,
        f,
        cast_grid(rows, cols),
        [&xp, &r_i, &c_i, &ap, &np, &ain, &mul, &rec, &sp, &op, &tp, &ld_i, &e]
    );
    Ok(bufs.into_parts(&dev))
}

/// The bf16 SwiGLU operands of a fused cast, contiguous, with their addresses: one `[rows, cols]`
/// shape for all, else an error naming `what`.
fn swiglu_operands(what: &str, ts: &[&Tensor]) -> Result<(usize, usize, Vec<Tensor>, Vec<u64>)> {
    let (rows, cols) = ts[0].dims2()?;
    let mut owned = Vec::with_capacity(ts.len());
    let mut addrs = Vec::with_capacity(ts.len());
    for t in ts {
        if t.dtype() != DType::BF16 || t.dims() != [rows, cols] {
            bail!(
                "{what}: expected bf16 [{rows}, {cols}] operands, got {:?} {:?}",
                t.dtype(),
                t.dims()
            );
        }
        let t = t.contiguous()?;
        addrs.push(tensor_addr::<bf16>(&t, what)?);
        owned.push(t);
    }
    Ok((rows, cols, owned, addrs))
}

/// `swiglu(gate, up)` quantized under delayed scaling in one kernel (`vime_fp8_swiglu_cast`): the
/// bits of [`crate::swiglu`] then [`fp8_quantize`] with the same `scale`, without the bf16 output.
/// `scale.amax_in` is required.
pub(crate) fn fp8_swiglu_quantize(
    gate: &Tensor,
    up: &Tensor,
    e5m2: bool,
    transpose: bool,
    rows_pad: usize,
    scale: CastScale,
) -> Result<Fp8Parts> {
    const WHAT: &str = "fp8 swiglu quantize";
    if scale.amax_in == 0 {
        bail!("{WHAT}: needs a delayed scale (an amax history)");
    }
    let dev = dev_of(gate, WHAT)?;
    let (rows, cols, _keep, a) = swiglu_operands(WHAT, &[gate, up])?;
    let (r_i, c_i, ld_i) = cast_dims(WHAT, rows, cols, rows_pad)?;
    let bufs = CastBufs::new(&dev, rows, cols, rows_pad, transpose)?;
    let (op, tp, sp) = bufs.addrs(&dev);
    let f = super::load(&dev, "vime_fp8", FP8_PTX, "vime_fp8_swiglu_cast")?;
    let (ain, mul, rec, e) = (scale.amax_in, scale.scale_mul, scale.record, i32::from(e5m2));
    launch!(
        dev,
        f,
        cast_grid(rows, cols),
        [&a[0], &a[1], &r_i, &c_i, &ain, &mul, &rec, &sp, &op, &tp, &ld_i, &e]
    );
    Ok(bufs.into_parts(&dev))
}

/// SwiGLU's input gradients `(d_gate, d_up)` for the upstream `dy`, each quantized under delayed
/// scaling with its transpose, in one kernel (`vime_fp8_swiglu_bwd_cast`): the bits of
/// [`crate::swiglu_backward`] then [`fp8_quantize`] of each, without the bf16 gradients. Both
/// scales need `amax_in`; they share `scale_mul`.
pub(crate) fn fp8_swiglu_backward_quantize(
    gate: &Tensor,
    up: &Tensor,
    dy: &Tensor,
    e5m2: bool,
    rows_pad: usize,
    sg: CastScale,
    su: CastScale,
) -> Result<(Fp8Parts, Fp8Parts)> {
    const WHAT: &str = "fp8 swiglu backward quantize";
    if sg.amax_in == 0 || su.amax_in == 0 || sg.scale_mul != su.scale_mul {
        bail!("{WHAT}: needs two delayed scales with one margin");
    }
    let dev = dev_of(gate, WHAT)?;
    let (rows, cols, _keep, a) = swiglu_operands(WHAT, &[gate, up, dy])?;
    let (r_i, c_i, ld_i) = cast_dims(WHAT, rows, cols, rows_pad)?;
    let (bg, bu) = (
        CastBufs::new(&dev, rows, cols, rows_pad, true)?,
        CastBufs::new(&dev, rows, cols, rows_pad, true)?,
    );
    let ((og, tg, sgp), (ou, tu, sup)) = (bg.addrs(&dev), bu.addrs(&dev));
    let f = super::load(&dev, "vime_fp8", FP8_PTX, "vime_fp8_swiglu_bwd_cast")?;
    let (mul, e) = (sg.scale_mul, i32::from(e5m2));
    launch!(
        dev,
        f,
        cast_grid(rows, cols),
        [
            &a[0],
            &a[1],
            &a[2],
            &r_i,
            &c_i,
            &sg.amax_in,
            &su.amax_in,
            &mul,
            &sg.record,
            &su.record,
            &sgp,
            &sup,
            &og,
            &tg,
            &ou,
            &tu,
            &ld_i,
            &e
        ]
    );
    Ok((bg.into_parts(&dev), bu.into_parts(&dev)))
}

/// Delayed scaling's history step over `hist` (f32 `[slots, 2 + n_hist]` on the device, see
/// `vime_fp8_amax_commit`) for the slots whose `mask` byte is set. One upload, one launch.
pub(crate) fn fp8_amax_commit(hist: &Tensor, mask: &[u8], n_hist: usize, use_max: bool) -> Result<()> {
    let (slots, width) = hist.dims2()?;
    if width != 2 + n_hist || mask.len() != slots {
        bail!(
            "fp8 amax commit: a history of {:?} for {} slots of {n_hist} entries",
            hist.dims(),
            mask.len()
        );
    }
    let dev = dev_of(hist, "fp8 amax commit")?;
    let hp = tensor_addr::<f32>(hist, "fp8 amax history")?;
    let m = dev.cuda_stream().clone_htod(mask).w()?;
    let mp = super::slice_addr(&m, &dev);
    let (s_i, n_i, u_i) = (
        i32_of("fp8 amax commit", "slots", slots)?,
        i32_of("fp8 amax commit", "history length", n_hist)?,
        i32::from(use_max),
    );
    let f = super::load(&dev, "vime_fp8", FP8_PTX, "vime_fp8_amax_commit")?;
    launch!(
        dev,
        f,
        super::cfg(slots.div_ceil(128).max(1) as u32, 128),
        [&hp, &mp, &s_i, &n_i, &u_i]
    );
    Ok(())
}

/// One FP8 GEMM shape (column-major, as cuBLASLt sees it): `C [m, n] = A^T B (+ beta C)`, A
/// `[k, m]` and B `[k, n]` both K-major FP8, C bf16 or f32. `fast_accum`: cuBLASLt's faster, less
/// precise accumulation (Transformer Engine uses it for the forward only).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fp8Shape {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a_e5m2: bool,
    pub b_e5m2: bool,
    pub c_f32: bool,
    pub beta: f32,
    pub fast_accum: bool,
}

/// cudaDataType values the cudarc enum of this CUDA version lacks (library_types.h).
const CUDA_R_8F_E4M3: u32 = 28;
const CUDA_R_8F_E5M2: u32 = 29;
/// The workspace every FP8 GEMM may use.
pub(crate) const LT_WORKSPACE: usize = 32 << 20;

fn lt_err(what: &str) -> impl Fn(lt::CublasError) -> candle_core::Error + '_ {
    move |e| candle_core::Error::Msg(format!("cuBLASLt FP8 GEMM {what}: {e:?}"))
}

/// Up to `n` of cuBLASLt's heuristic algorithms for `desc` over the layouts of A, B and C (D as
/// C), best first, within [`LT_WORKSPACE`]; those it marks unusable are left out.
///
/// # Safety
/// The handle, descriptor and layouts must be live.
pub(crate) unsafe fn heuristic_algos(
    handle: lt_sys::cublasLtHandle_t,
    desc: lt_sys::cublasLtMatmulDesc_t,
    [la, lb, lc]: [lt_sys::cublasLtMatrixLayout_t; 3],
    n: usize,
) -> Result<Vec<lt_sys::cublasLtMatmulAlgo_t>> {
    let err = |e: lt::CublasError| candle_core::Error::Msg(format!("cuBLASLt heuristic: {e:?}"));
    let pref = lt::create_matmul_pref().map_err(err)?;
    let ws = LT_WORKSPACE as u64;
    let r = lt::set_matmul_pref_attribute(
        pref,
        lt_sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
        &ws as *const u64 as *const _,
        8,
    );
    let mut heur = vec![
        lt_sys::cublasLtMatmulHeuristicResult_t {
            algo: lt_sys::cublasLtMatmulAlgo_t { data: [0; 8] },
            workspaceSize: 0,
            state: lt_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS,
            wavesCount: 0.0,
            reserved: [0; 4],
        };
        n.max(1)
    ];
    let mut found = 0i32;
    let h = r.and_then(|_| {
        lt_sys::cublasLtMatmulAlgoGetHeuristic(
            handle,
            desc,
            la,
            lb,
            lc,
            lc,
            pref,
            heur.len() as i32,
            heur.as_mut_ptr(),
            &mut found,
        )
        .result()
    });
    let _ = lt::destroy_matmul_pref(pref);
    h.map_err(err)?;
    Ok(heur
        .iter()
        .take(found.max(0) as usize)
        .filter(|h| h.state == lt_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
        .map(|h| h.algo)
        .collect())
}

/// The descriptors of one [`Fp8Shape`] and its heuristic algorithms (best first).
pub struct Fp8Plan {
    shape: Fp8Shape,
    desc: lt_sys::cublasLtMatmulDesc_t,
    layouts: [lt_sys::cublasLtMatrixLayout_t; 3],
    pub algos: Vec<lt_sys::cublasLtMatmulAlgo_t>,
}

// Safety: the descriptors are plain host objects, used under the cache's lock or by one thread.
unsafe impl Send for Fp8Plan {}

impl Drop for Fp8Plan {
    fn drop(&mut self) {
        unsafe {
            for l in self.layouts {
                let _ = lt::destroy_matrix_layout(l);
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

impl Fp8Plan {
    /// Descriptors and up to `algos` heuristic algorithms for `shape`; an error names the shape
    /// when cuBLASLt supports none (FP8 needs m, n, k multiples of 16, and not both E5M2).
    ///
    /// # Safety
    /// `handle` must be a live cuBLASLt handle.
    pub unsafe fn new(handle: lt_sys::cublasLtHandle_t, shape: Fp8Shape, algos: usize) -> Result<Self> {
        let Fp8Shape { m, n, k, .. } = shape;
        if m % 16 != 0 || n % 16 != 0 || k % 16 != 0 {
            bail!("FP8 GEMM {m} x {n} x {k}: every dimension must be a multiple of 16");
        }
        if shape.a_e5m2 && shape.b_e5m2 {
            bail!("FP8 GEMM {m} x {n} x {k}: E5M2 x E5M2 is not supported, one operand must be E4M3");
        }
        let desc = lt::create_matmul_desc(
            lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            lt_sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(lt_err("descriptor"))?;
        // From here the plan owns what it created, so an error below frees it.
        let mut plan = Fp8Plan {
            shape,
            desc,
            layouts: [std::ptr::null_mut(); 3],
            algos: Vec::new(),
        };
        let fp8 = |e5m2: bool| if e5m2 { CUDA_R_8F_E5M2 } else { CUDA_R_8F_E4M3 };
        let c_type = if shape.c_f32 {
            lt_sys::cudaDataType::CUDA_R_32F
        } else {
            lt_sys::cudaDataType::CUDA_R_16BF
        };
        unsafe {
            let (op_t, op_n, fast) = (1i32, 0i32, i8::from(shape.fast_accum));
            let set = |attr, v: *const std::ffi::c_void, size| {
                lt::set_matmul_desc_attribute(desc, attr, v, size).map_err(lt_err("attribute"))
            };
            use lt_sys::cublasLtMatmulDescAttributes_t as A;
            set(A::CUBLASLT_MATMUL_DESC_TRANSA, &op_t as *const i32 as *const _, 4)?;
            set(A::CUBLASLT_MATMUL_DESC_TRANSB, &op_n as *const i32 as *const _, 4)?;
            set(A::CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast as *const i8 as *const _, 1)?;
            for (i, (ty, rows, cols)) in [
                (Some(fp8(shape.a_e5m2)), k, m),
                (Some(fp8(shape.b_e5m2)), k, n),
                (None, m, n),
            ]
            .into_iter()
            .enumerate()
            {
                // The FP8 types are set as the raw attribute: a layout made as 8-bit ints first.
                let base = if ty.is_some() {
                    lt_sys::cudaDataType::CUDA_R_8I
                } else {
                    c_type
                };
                plan.layouts[i] =
                    lt::create_matrix_layout(base, rows as u64, cols as u64, rows as i64).map_err(lt_err("layout"))?;
                if let Some(ty) = ty {
                    lt::set_matrix_layout_attribute(
                        plan.layouts[i],
                        lt_sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_TYPE,
                        &ty as *const u32 as *const _,
                        4,
                    )
                    .map_err(lt_err("layout type"))?;
                }
            }
            let [la, lb, lc] = plan.layouts;
            plan.algos = heuristic_algos(handle, desc, [la, lb, lc], algos)?;
        }
        if plan.algos.is_empty() {
            bail!("FP8 GEMM {shape:?}: cuBLASLt offers no algorithm");
        }
        Ok(plan)
    }

    /// Runs the plan with algorithm `algo` on `stream`: `C = scale_a scale_b A^T B + beta C`
    /// (device addresses; the scales are f32 on the device).
    ///
    /// # Safety
    /// The addresses must point at device buffers of the plan's shape and types, and the workspace
    /// at [`LT_WORKSPACE`] bytes, all live until the GEMM has run.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run(
        &self,
        handle: lt_sys::cublasLtHandle_t,
        algo: usize,
        a: u64,
        a_scale: u64,
        b: u64,
        b_scale: u64,
        c: u64,
        workspace: u64,
        stream: lt_sys::cudaStream_t,
    ) -> Result<()> {
        use lt_sys::cublasLtMatmulDescAttributes_t as A;
        for (attr, p) in [
            (A::CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &a_scale),
            (A::CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &b_scale),
        ] {
            lt::set_matmul_desc_attribute(self.desc, attr, p as *const u64 as *const _, 8)
                .map_err(lt_err("scale pointer"))?;
        }
        let Some(algo) = self.algos.get(algo) else {
            bail!("FP8 GEMM {:?}: no algorithm #{algo}", self.shape);
        };
        let (alpha, beta) = (1.0f32, self.shape.beta);
        let [la, lb, lc] = self.layouts;
        lt::matmul(
            handle,
            self.desc,
            &alpha as *const f32 as *const _,
            &beta as *const f32 as *const _,
            a as *const _,
            la,
            b as *const _,
            lb,
            c as *const _,
            lc,
            c as *mut _,
            lc,
            algo,
            workspace as *mut _,
            LT_WORKSPACE,
            stream,
        )
        .map_err(lt_err("matmul"))
    }
}

/// A cuBLASLt handle, its workspace and the plans made so far, per device.
struct LtCtx {
    device: DeviceId,
    handle: lt_sys::cublasLtHandle_t,
    workspace: Tensor,
    plans: Vec<Fp8Plan>,
}

// Safety: used only under the lock of `LT`.
unsafe impl Send for LtCtx {}

static LT: OnceLock<Mutex<Vec<LtCtx>>> = OnceLock::new();

/// One operand of [`fp8_matmul_t`]: FP8 bits `[rows, k]` (row-major, contiguous) and their
/// `scale_inv` (f32 `[1]`).
#[derive(Clone, Copy)]
pub struct Fp8Operand<'a> {
    pub bits: &'a Tensor,
    pub scale_inv: &'a Tensor,
    pub e5m2: bool,
}

impl<'a> Fp8Operand<'a> {
    /// The tensor as quantized (`[rows, cols]`).
    pub fn of(t: &'a crate::fp8::Fp8Tensor) -> Self {
        Fp8Operand {
            bits: &t.data,
            scale_inv: &t.scale_inv,
            e5m2: t.format == crate::fp8::Fp8Format::E5M2,
        }
    }
}

/// `x [n, k] . w [m, k]^T` times both operands' `scale_inv`: into a new `[n, m]` of dtype `out`
/// (bf16 or f32; `acc = None`, returned) or added to `acc` (bf16 or f32 `[n, m]`, contiguous;
/// returns None).
pub fn fp8_matmul_t(
    x: Fp8Operand,
    w: Fp8Operand,
    acc: Option<&Tensor>,
    out: DType,
    fast_accum: bool,
) -> Result<Option<Tensor>> {
    let (n, k) = x.bits.dims2()?;
    let (m, kw) = w.bits.dims2()?;
    if kw != k {
        bail!(
            "fp8_matmul_t: x {:?} and w {:?} differ in their inner dimension",
            x.bits.dims(),
            w.bits.dims()
        );
    }
    for (t, what) in [(x.bits, "x"), (w.bits, "w")] {
        if t.dtype() != DType::U8 {
            bail!("fp8_matmul_t: {what} must hold FP8 bits as u8, got {:?}", t.dtype());
        }
    }
    let dev = dev_of(x.bits, "fp8_matmul_t")?;
    let (out, c_f32, beta) = match acc {
        Some(a) => {
            if a.dims() != [n, m] {
                bail!("fp8_matmul_t: the sum is {:?}, the product [{n}, {m}]", a.dims());
            }
            match a.dtype() {
                DType::F32 => (None, true, 1.0),
                DType::BF16 => (None, false, 1.0),
                d => bail!("fp8_matmul_t: the sum must be f32 or bf16, got {d:?}"),
            }
        }
        None => {
            // Every element is written (beta 0), so the buffer starts uninitialised.
            let t = match out {
                DType::F32 => device_tensor(unsafe { dev.alloc::<f32>((n * m).max(1)) }?, &dev, (n, m)),
                DType::BF16 => device_tensor(unsafe { dev.alloc::<bf16>((n * m).max(1)) }?, &dev, (n, m)),
                d => bail!("fp8_matmul_t: the output must be f32 or bf16, got {d:?}"),
            };
            (Some(t), out == DType::F32, 0.0)
        }
    };
    let c = acc.or(out.as_ref()).expect("an output");
    let cp = if c_f32 {
        tensor_addr::<f32>(c, "fp8_matmul_t sum")?
    } else {
        tensor_addr::<bf16>(c, "fp8_matmul_t output")?
    };
    let (ap, bp) = (
        tensor_addr::<u8>(w.bits, "fp8_matmul_t w")?,
        tensor_addr::<u8>(x.bits, "fp8_matmul_t x")?,
    );
    let (asp, bsp) = (
        tensor_addr::<f32>(w.scale_inv, "fp8_matmul_t w scale")?,
        tensor_addr::<f32>(x.scale_inv, "fp8_matmul_t x scale")?,
    );
    let shape = Fp8Shape {
        m,
        n,
        k,
        a_e5m2: w.e5m2,
        b_e5m2: x.e5m2,
        c_f32,
        beta,
        fast_accum,
    };
    let mut all = LT.get_or_init(|| Mutex::new(Vec::new())).lock().unwrap();
    let ctx = match all.iter().position(|c| c.device == dev.id()) {
        Some(i) => &mut all[i],
        None => {
            let handle = lt::create_handle().map_err(lt_err("handle"))?;
            let workspace = Tensor::zeros(LT_WORKSPACE, DType::U8, x.bits.device())?;
            all.push(LtCtx {
                device: dev.id(),
                handle,
                workspace,
                plans: Vec::new(),
            });
            all.last_mut().expect("just pushed")
        }
    };
    let plan = match ctx.plans.iter().position(|p| p.shape == shape) {
        Some(i) => &ctx.plans[i],
        None => {
            // Safety: the context's handle lives as long as the context.
            let p = unsafe { Fp8Plan::new(ctx.handle, shape, 1)? };
            ctx.plans.push(p);
            ctx.plans.last().expect("just pushed")
        }
    };
    let wsp = tensor_addr::<u8>(&ctx.workspace, "fp8 workspace")?;
    let stream = dev.cuda_stream().cu_stream() as lt_sys::cudaStream_t;
    unsafe { plan.run(ctx.handle, 0, ap, asp, bp, bsp, cp, wsp, stream)? };
    Ok(out)
}
