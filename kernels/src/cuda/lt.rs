//! The training step's bf16 GEMMs through cuBLASLt, and the per-device cuBLASLt context (handle,
//! workspace, plans) that they and the FP8 GEMMs ([`super::fp8`]) share.
//!
//! Decisions:
//! - Every GEMM of the block (forward, input gradient, weight gradient into f32) and of the LM head
//!   runs cuBLASLt's first heuristic algorithm for its shape with a 32 MiB workspace, not
//!   `cublasGemmEx`'s default. On an H100, bench-gemm (`scripts/gpu/bench_gemm.sh`) timed the 4B
//!   layer's GEMMs at 235 ms through cuBLASLt's first choice against 259 ms through GemmEx (the
//!   default picks slower kernels for the MLP and the input-gradient shapes); on the H200 the two
//!   were within 1 %.
//! - The choice is the heuristic's, fixed for a cuBLAS version, GPU model and shape: no timing
//!   enters it, so every process runs the same kernel and gets the same bits (exact resume). On
//!   the H100 every one of the top 8 heuristic algorithms gave GemmEx's output bit for bit at every
//!   4B shape (no split-K: K is summed in one order); the kernel check tests the heuristic's choice
//!   against GemmEx at the block's shapes.
//! - One plan (descriptor, layouts, algorithm) per shape and layout, made on first use and kept.
//! - Autotuning among algorithms that give the same bits: at a shape's first use, the top
//!   [`TUNE_ALGOS`] heuristic algorithms run on the call's own operands into scratch outputs; an
//!   algorithm is eligible only if its output equals the first choice's byte for byte, and the
//!   fastest eligible one (by CUDA events, and by at least [`TUNE_MARGIN`], else the first) is
//!   kept. Timing may pick differently in another process, but never other bits, so exact resume
//!   holds. Off with `VIME_GEMM_AUTOTUNE=0`; `VIME_GEMM_AUTOTUNE=verbose` prints each choice.
//!   Skipped while the stream is being captured into a CUDA graph (timing needs a sync).
use super::fp8::{Fp8Plan, LT_WORKSPACE};
use super::{device_tensor, tensor_addr};
use candle_core::cuda_backend::cudarc::cublaslt::{result as lt, sys as lt_sys};
use candle_core::cuda_backend::{CudaDevice, DeviceId};
use candle_core::{bail, DType, Result, Tensor};
use std::sync::{Mutex, OnceLock};

pub(crate) fn lt_err(what: &str) -> impl Fn(lt::CublasError) -> candle_core::Error + '_ {
    move |e| candle_core::Error::Msg(format!("cuBLASLt {what}: {e:?}"))
}

/// A cuBLASLt handle, its workspace and the plans made so far, for one device.
pub(crate) struct LtCtx {
    device: DeviceId,
    pub(crate) handle: lt_sys::cublasLtHandle_t,
    pub(crate) workspace: Tensor,
    pub(crate) fp8_plans: Vec<Fp8Plan>,
    plans: Vec<GemmPlan>,
}

// Safety: used only under the lock of `LT`.
unsafe impl Send for LtCtx {}

impl Drop for LtCtx {
    fn drop(&mut self) {
        self.plans.clear();
        self.fp8_plans.clear();
        unsafe {
            let _ = lt::destroy_handle(self.handle);
        }
    }
}

static LT: OnceLock<Mutex<Vec<LtCtx>>> = OnceLock::new();

/// Runs `f` on `dev`'s cuBLASLt context (made on first use), under the contexts' lock.
pub(crate) fn with_ctx<R>(dev: &CudaDevice, f: impl FnOnce(&mut LtCtx) -> Result<R>) -> Result<R> {
    let mut all = LT
        .get_or_init(|| Mutex::new(Vec::new()))
        .lock()
        .map_err(|_| candle_core::Error::Msg("cuBLASLt contexts: a thread panicked holding the lock".into()))?;
    let i = match all.iter().position(|c| c.device == dev.id()) {
        Some(i) => i,
        None => {
            let handle = lt::create_handle().map_err(lt_err("handle"))?;
            let workspace = Tensor::zeros(LT_WORKSPACE, DType::U8, &candle_core::Device::Cuda(dev.clone()))?;
            all.push(LtCtx {
                device: dev.id(),
                handle,
                workspace,
                fp8_plans: Vec::new(),
                plans: Vec::new(),
            });
            all.len() - 1
        }
    };
    f(&mut all[i])
}

/// One bf16 GEMM shape as cuBLAS sees it (column-major): `C [m, n] (ldc) = op(A) op(B) + beta C`,
/// A and B bf16 with leading dimensions `lda`, `ldb`, C bf16 or f32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GemmShape {
    pub ta: bool,
    pub tb: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
    pub c_f32: bool,
}

/// The descriptors of one [`GemmShape`] and the heuristic's first algorithm.
pub(crate) struct GemmPlan {
    shape: GemmShape,
    desc: lt_sys::cublasLtMatmulDesc_t,
    layouts: [lt_sys::cublasLtMatrixLayout_t; 3],
    algo: lt_sys::cublasLtMatmulAlgo_t,
}

// Safety: the descriptors are plain host objects, used under the contexts' lock.
unsafe impl Send for GemmPlan {}

impl Drop for GemmPlan {
    fn drop(&mut self) {
        unsafe {
            for l in self.layouts {
                if !l.is_null() {
                    let _ = lt::destroy_matrix_layout(l);
                }
            }
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

fn i64_of(what: &str, v: usize) -> Result<i64> {
    i64::try_from(v).map_err(|_| candle_core::Error::Msg(format!("GEMM {what} {v} out of range")))
}

impl GemmPlan {
    /// Descriptors and `n` heuristic algorithms for `shape` (the first is the one [`gemm`] runs);
    /// an error names the shape when cuBLASLt offers none.
    ///
    /// # Safety
    /// `handle` must be a live cuBLASLt handle.
    pub(crate) unsafe fn new(
        handle: lt_sys::cublasLtHandle_t,
        shape: GemmShape,
        n: usize,
    ) -> Result<(Self, Vec<lt_sys::cublasLtMatmulAlgo_t>)> {
        let GemmShape {
            ta,
            tb,
            m,
            n: cols,
            k,
            lda,
            ldb,
            ldc,
            c_f32,
        } = shape;
        let desc = lt::create_matmul_desc(
            lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            lt_sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(lt_err("matmul descriptor"))?;
        // From here the plan owns what it made, so an early return frees it.
        let mut plan = GemmPlan {
            shape,
            desc,
            layouts: [std::ptr::null_mut(); 3],
            algo: lt_sys::cublasLtMatmulAlgo_t { data: [0; 8] },
        };
        let (opa, opb) = (i32::from(ta), i32::from(tb));
        use lt_sys::cublasLtMatmulDescAttributes_t as A;
        for (attr, op) in [
            (A::CUBLASLT_MATMUL_DESC_TRANSA, &opa),
            (A::CUBLASLT_MATMUL_DESC_TRANSB, &opb),
        ] {
            lt::set_matmul_desc_attribute(desc, attr, op as *const i32 as *const _, 4).map_err(lt_err("transpose"))?;
        }
        let bf = lt_sys::cudaDataType::CUDA_R_16BF;
        let c_type = if c_f32 { lt_sys::cudaDataType::CUDA_R_32F } else { bf };
        // Stored (column-major) extents: op(A) is [m, k], op(B) is [k, n].
        let (ar, ac) = if ta { (k, m) } else { (m, k) };
        let (br, bc) = if tb { (cols, k) } else { (k, cols) };
        for (i, (ty, rows, cs, ld)) in [(bf, ar, ac, lda), (bf, br, bc, ldb), (c_type, m, cols, ldc)]
            .into_iter()
            .enumerate()
        {
            if ld < rows.max(1) {
                bail!("GEMM {shape:?}: leading dimension {ld} under the {rows} rows it spans");
            }
            plan.layouts[i] = lt::create_matrix_layout(ty, rows as u64, cs as u64, i64_of("leading dimension", ld)?)
                .map_err(lt_err("layout"))?;
        }
        let [la, lb, lc] = plan.layouts;
        let algos = super::fp8::heuristic_algos(handle, desc, [la, lb, lc], n.max(1))?;
        let Some(first) = algos.first() else {
            bail!("GEMM {shape:?}: cuBLASLt offers no algorithm");
        };
        plan.algo = *first;
        Ok((plan, algos))
    }

    /// `C = op(A) op(B) + beta C` with algorithm `algo` on `stream`.
    ///
    /// # Safety
    /// The addresses must point at device buffers of the plan's shape, and the workspace at
    /// [`LT_WORKSPACE`] bytes, all live until the GEMM has run.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn run_algo(
        &self,
        handle: lt_sys::cublasLtHandle_t,
        algo: &lt_sys::cublasLtMatmulAlgo_t,
        a: u64,
        b: u64,
        beta: f32,
        c: u64,
        workspace: u64,
        stream: lt_sys::cudaStream_t,
    ) -> Result<()> {
        let alpha = 1.0f32;
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

/// Heuristic algorithms tried at a shape's first use.
const TUNE_ALGOS: usize = 8;
/// Timed calls per algorithm (after one warm-up).
const TUNE_REPS: usize = 4;
/// How much faster than the heuristic's first choice another algorithm must time to be kept.
const TUNE_MARGIN: f64 = 0.02;

/// `VIME_GEMM_AUTOTUNE`: unset or `1` tunes, `verbose` tunes and prints, `0` does not (read once).
fn autotune_mode() -> (bool, bool) {
    static MODE: OnceLock<(bool, bool)> = OnceLock::new();
    *MODE.get_or_init(|| match std::env::var("VIME_GEMM_AUTOTUNE").as_deref() {
        Ok("0") => (false, false),
        Ok("verbose") => (true, true),
        _ => (true, false),
    })
}

/// The fastest of `algos` whose output on these operands equals `algos[0]`'s byte for byte (see
/// the module's decisions), or `algos[0]`.
///
/// # Safety
/// As [`GemmPlan::run_algo`]; `a` and `b` are only read.
#[allow(clippy::too_many_arguments)]
unsafe fn tune(
    dev: &CudaDevice,
    handle: lt_sys::cublasLtHandle_t,
    plan: &GemmPlan,
    algos: &[lt_sys::cublasLtMatmulAlgo_t],
    a: u64,
    b: u64,
    workspace: u64,
    stream: lt_sys::cudaStream_t,
) -> Result<(lt_sys::cublasLtMatmulAlgo_t, String)> {
    let sh = plan.shape;
    let bytes = sh.ldc * sh.n * if sh.c_f32 { 4 } else { 2 };
    let scratch = || -> Result<Tensor> {
        // Safety: each is written (beta 0) before it is read.
        let s = unsafe { dev.alloc::<u8>(bytes.max(1)) }?;
        Ok(device_tensor(s, dev, bytes.max(1)))
    };
    let (c0, c1) = (scratch()?, scratch()?);
    let (p0, p1) = (tensor_addr::<u8>(&c0, "tune")?, tensor_addr::<u8>(&c1, "tune")?);
    plan.run_algo(handle, &algos[0], a, b, 0.0, p0, workspace, stream)?;
    let time = |algo: &lt_sys::cublasLtMatmulAlgo_t| {
        super::gemm_bench::time_ms(dev, 1, TUNE_REPS, &mut || unsafe {
            plan.run_algo(handle, algo, a, b, 0.0, p1, workspace, stream)
        })
    };
    let first = time(&algos[0])?;
    let (mut best, mut best_ms) = (0usize, first);
    let mut report = format!("#0 {first:.4} ms");
    for (i, algo) in algos.iter().enumerate().skip(1) {
        plan.run_algo(handle, algo, a, b, 0.0, p1, workspace, stream)?;
        let differ = c0.ne(&c1)?.to_dtype(DType::F32)?.sum_all()?.to_scalar::<f32>()?;
        if differ != 0.0 {
            report.push_str(&format!(", #{i} other bits"));
            continue;
        }
        let ms = time(algo)?;
        report.push_str(&format!(", #{i} {ms:.4} ms"));
        if ms < best_ms && ms < first * (1.0 - TUNE_MARGIN) {
            (best, best_ms) = (i, ms);
        }
    }
    Ok((algos[best], format!("{report}: #{best}")))
}

/// `C (col-major m x n, f32 or bf16) = op(A) op(B) + beta C` with bf16 A, B on `dev`'s stream,
/// by cuBLASLt's first heuristic algorithm for the shape (see the module's decisions).
///
/// # Safety
/// The addresses must hold those extents on `dev`'s stream, live until the GEMM has run.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm(
    dev: &CudaDevice,
    ta: bool,
    tb: bool,
    m: usize,
    n: usize,
    k: usize,
    a: u64,
    lda: usize,
    b: u64,
    ldb: usize,
    beta: f32,
    c: u64,
    c_f32: bool,
    ldc: usize,
) -> Result<()> {
    if m == 0 || n == 0 {
        return Ok(());
    }
    let shape = GemmShape {
        ta,
        tb,
        m,
        n,
        k,
        lda,
        ldb,
        ldc,
        c_f32,
    };
    let stream = dev.cuda_stream().cu_stream() as lt_sys::cudaStream_t;
    with_ctx(dev, |ctx| {
        let wsp = tensor_addr::<u8>(&ctx.workspace, "cuBLASLt workspace")?;
        let i = match ctx.plans.iter().position(|p| p.shape == shape) {
            Some(i) => i,
            None => {
                let (tuning, verbose) = autotune_mode();
                use candle_core::cuda_backend::cudarc::driver::sys::CUstreamCaptureStatus as Capture;
                let idle = dev
                    .cuda_stream()
                    .capture_status()
                    .is_ok_and(|s| s == Capture::CU_STREAM_CAPTURE_STATUS_NONE);
                let n = if tuning && idle { TUNE_ALGOS } else { 1 };
                // Safety: the context's handle lives as long as the context; the operands are
                // the caller's, only read.
                let (mut p, algos) = unsafe { GemmPlan::new(ctx.handle, shape, n)? };
                if algos.len() > 1 {
                    let (algo, report) = unsafe { tune(dev, ctx.handle, &p, &algos, a, b, wsp, stream)? };
                    p.algo = algo;
                    if verbose {
                        eprintln!("cuBLASLt GEMM {shape:?}: {report}");
                    }
                }
                ctx.plans.push(p);
                ctx.plans.len() - 1
            }
        };
        let plan = &ctx.plans[i];
        unsafe { plan.run_algo(ctx.handle, &plan.algo, a, b, beta, c, wsp, stream) }
    })
}
