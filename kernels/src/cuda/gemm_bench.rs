//! A microbenchmark of the training step's GEMMs (`vime-train bench-gemm`): each linear layer's
//! forward, input-gradient and weight-gradient GEMM at its real shape, timed with CUDA events as
//! the training path calls it (cuBLAS `GemmEx`, default algorithm), and the same GEMM through
//! cuBLASLt with each of its top heuristic algorithms timed, to show how much a different
//! algorithm choice (or a fused q|k|v, gate|up layer) could take off a step before any of it is
//! built into the training path.
//!
//! Column-major throughout (cuBLAS's view of the row-major tensors): `C [m, n] = op(A) op(B)`.
use super::{gemm, tensor_addr};
use candle_core::cuda_backend::cudarc::cublaslt::{result as lt, sys as lt_sys};
use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::{bail, DType, Device, Result, Tensor};
use half::bf16;

/// One GEMM: `C [m, n] (ldc) = op(A) op(B) + beta C`, A and B bf16, C bf16 or f32.
#[derive(Debug, Clone)]
pub struct GemmCase {
    pub name: String,
    pub ta: bool,
    pub tb: bool,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub c_f32: bool,
    pub beta: f32,
}

impl GemmCase {
    pub fn flops(&self) -> f64 {
        2.0 * self.m as f64 * self.n as f64 * self.k as f64
    }
    fn a_dims(&self) -> (usize, usize) {
        if self.ta {
            (self.k, self.m)
        } else {
            (self.m, self.k)
        }
    }
    fn b_dims(&self) -> (usize, usize) {
        if self.tb {
            (self.n, self.k)
        } else {
            (self.k, self.n)
        }
    }
}

/// The three GEMMs of a linear layer `Y [t, out] = X [t, in] W^T` as the training block runs
/// them: the forward (bf16 out), the input gradient `dX = dY W` (bf16, beta 0: the first
/// projection of a sum; the later ones run beta 1) and the weight gradient `dW = dY^T X` in f32,
/// into a new buffer (beta 0) and into the running sum (beta 1).
pub fn linear_cases(layer: &str, t: usize, out: usize, inp: usize) -> Vec<GemmCase> {
    let c = |role: &str, ta, tb, m, n, k, c_f32, beta| GemmCase {
        name: format!("{layer} {role}"),
        ta,
        tb,
        m,
        n,
        k,
        c_f32,
        beta,
    };
    vec![
        // Y^T [out, t] = (W as stored [in, out] col-major)^T . X^T [in, t]
        c("fwd", true, false, out, t, inp, false, 0.0),
        // dX^T [in, t] = W-as-stored [in, out] . dY^T [out, t]
        c("dgrad", false, false, inp, t, out, false, 0.0),
        // dW^T [in, out] = X^T [in, t] . (dY^T [out, t])^T
        c("wgrad f32", false, true, inp, out, t, true, 0.0),
        c("wgrad f32 +=", false, true, inp, out, t, true, 1.0),
    ]
}

/// What one case measured: milliseconds per call of `GemmEx` (default algorithm) and of each
/// cuBLASLt heuristic algorithm, in the heuristic's order.
#[derive(Debug, Clone)]
pub struct GemmTiming {
    pub case: GemmCase,
    pub gemm_ex_ms: f64,
    pub lt_ms: Vec<f64>,
    /// Per cuBLASLt algorithm (beta-0 cases only, else empty): whether its output equals
    /// `GemmEx`'s element for element on the same inputs. An algorithm that sums `K` in the same
    /// order gives the same bits; split-K and stream-K kernels need not.
    pub lt_same: Vec<bool>,
}

impl GemmTiming {
    /// The fastest cuBLASLt algorithm: (its index in the heuristic's list, ms).
    pub fn lt_best(&self) -> Option<(usize, f64)> {
        self.lt_ms
            .iter()
            .copied()
            .enumerate()
            .min_by(|a, b| a.1.total_cmp(&b.1))
    }
    pub fn tflops(&self, ms: f64) -> f64 {
        self.case.flops() / (ms * 1e-3) / 1e12
    }
}

/// Mean ms per call of `f` over `reps` calls after `warm` calls, by CUDA events on the stream.
fn time_ms(dev: &CudaDevice, warm: usize, reps: usize, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..warm {
        f()?;
    }
    let stream = dev.cuda_stream();
    let flags = Some(CUevent_flags::CU_EVENT_DEFAULT);
    let start = stream.record_event(flags).w()?;
    for _ in 0..reps {
        f()?;
    }
    let end = stream.record_event(flags).w()?;
    Ok(start.elapsed_ms(&end).w()? as f64 / reps as f64)
}

fn lt_err(what: &str) -> impl Fn(lt::CublasError) -> candle_core::Error + '_ {
    move |e| candle_core::Error::Msg(format!("cuBLASLt {what}: {e:?}"))
}

/// Times every case: `GemmEx` and up to `algos` cuBLASLt heuristic algorithms (32 MiB
/// workspace), `reps` calls each after 3 warm-up calls, on random bf16 inputs (zeros would run
/// at a lower power and overstate the rate).
pub fn bench(device: &Device, cases: &[GemmCase], algos: usize, reps: usize) -> Result<Vec<GemmTiming>> {
    let dev = match device {
        Device::Cuda(d) => d.clone(),
        _ => bail!("bench-gemm needs a CUDA device"),
    };
    let ws_bytes = super::fp8::LT_WORKSPACE;
    let ws = unsafe { dev.alloc::<u8>(ws_bytes) }?;
    let ws_t = super::device_tensor(ws, &dev, ws_bytes);
    let ws_p = tensor_addr::<u8>(&ws_t, "workspace")?;
    let handle = lt::create_handle().map_err(lt_err("handle"))?;
    let stream = dev.cuda_stream().cu_stream() as lt_sys::cudaStream_t;
    let mut out = Vec::with_capacity(cases.len());
    for case in cases {
        let (ar, ac) = case.a_dims();
        let (br, bc) = case.b_dims();
        // Row-major candle tensors of [cols, rows] are the column-major [rows, cols] matrices.
        let rand =
            |r: usize, c: usize| -> Result<Tensor> { Tensor::randn(0f32, 1.0, (c, r), device)?.to_dtype(DType::BF16) };
        let (a, b) = (rand(ar, ac)?, rand(br, bc)?);
        let c_dtype = if case.c_f32 { DType::F32 } else { DType::BF16 };
        let c = Tensor::randn(0f32, 1.0, (case.n, case.m), device)?.to_dtype(c_dtype)?;
        let (ap, bp) = (tensor_addr::<bf16>(&a, "a")?, tensor_addr::<bf16>(&b, "b")?);
        let addr = |t: &Tensor| {
            if case.c_f32 {
                tensor_addr::<f32>(t, "c")
            } else {
                tensor_addr::<bf16>(t, "c")
            }
        };
        let cp = addr(&c)?;
        let gemm_ex_ms = time_ms(&dev, 3, reps, &mut || unsafe {
            gemm(
                &dev, case.ta, case.tb, case.m, case.n, case.k, ap, ar, bp, br, case.beta, cp, case.c_f32, case.m,
            )
        })?;

        // cublasOperation_t as the int32 the attribute takes: CUBLAS_OP_N = 0, CUBLAS_OP_T = 1.
        let op = |t: bool| -> i32 { i32::from(t) };
        let c_type = if case.c_f32 {
            lt_sys::cudaDataType::CUDA_R_32F
        } else {
            lt_sys::cudaDataType::CUDA_R_16BF
        };
        let bf = lt_sys::cudaDataType::CUDA_R_16BF;
        let desc = lt::create_matmul_desc(
            lt_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            lt_sys::cudaDataType::CUDA_R_32F,
        )
        .map_err(lt_err("matmul desc"))?;
        let (opa, opb) = (op(case.ta), op(case.tb));
        let sz = std::mem::size_of::<i32>();
        let la = lt::create_matrix_layout(bf, ar as u64, ac as u64, ar as i64).map_err(lt_err("layout"))?;
        let lb = lt::create_matrix_layout(bf, br as u64, bc as u64, br as i64).map_err(lt_err("layout"))?;
        let lc =
            lt::create_matrix_layout(c_type, case.m as u64, case.n as u64, case.m as i64).map_err(lt_err("layout"))?;
        let heur = unsafe {
            for (attr, op) in [
                (
                    lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                    &opa,
                ),
                (
                    lt_sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                    &opb,
                ),
            ] {
                lt::set_matmul_desc_attribute(desc, attr, op as *const i32 as *const _, sz)
                    .map_err(lt_err("transpose"))?;
            }
            super::fp8::heuristic_algos(handle, desc, [la, lb, lc], algos)?
        };
        let (alpha, beta) = (1.0f32, case.beta);
        let lt_into = |algo: &lt_sys::cublasLtMatmulAlgo_t, out: u64, beta: f32| unsafe {
            lt::matmul(
                handle,
                desc,
                &alpha as *const f32 as *const _,
                &beta as *const f32 as *const _,
                ap as *const _,
                la,
                bp as *const _,
                lb,
                out as *const _,
                lc,
                out as *mut _,
                lc,
                algo,
                ws_p as *mut _,
                ws_bytes,
                stream,
            )
            .map_err(lt_err("matmul"))
        };
        // The same products into fresh outputs (beta 0), compared with GemmEx's.
        let mut lt_same = Vec::new();
        if case.beta == 0.0 {
            let fresh = || Tensor::full(f32::NAN, (case.n, case.m), device)?.to_dtype(c_dtype);
            let reference = fresh()?;
            unsafe {
                gemm(
                    &dev,
                    case.ta,
                    case.tb,
                    case.m,
                    case.n,
                    case.k,
                    ap,
                    ar,
                    bp,
                    br,
                    0.0,
                    addr(&reference)?,
                    case.c_f32,
                    case.m,
                )?
            };
            for algo in &heur {
                let out = fresh()?;
                lt_into(algo, addr(&out)?, 0.0)?;
                // Differing elements (NaN, an unwritten element, differs from everything).
                let differ = out
                    .ne(&reference)?
                    .to_dtype(DType::F32)?
                    .sum_all()?
                    .to_scalar::<f32>()?;
                lt_same.push(differ == 0.0);
            }
        }
        let mut lt_ms = Vec::new();
        for algo in &heur {
            lt_ms.push(time_ms(&dev, 3, reps, &mut || lt_into(algo, cp, beta))?);
        }
        unsafe {
            let _ = lt::destroy_matrix_layout(la);
            let _ = lt::destroy_matrix_layout(lb);
            let _ = lt::destroy_matrix_layout(lc);
            let _ = lt::destroy_matmul_desc(desc);
        }
        out.push(GemmTiming {
            case: case.clone(),
            gemm_ex_ms,
            lt_ms,
            lt_same,
        });
    }
    unsafe {
        let _ = lt::destroy_handle(handle);
    }
    Ok(out)
}

/// The FP8 form of a bf16 case (see [`super::fp8`]): the same `m, n, k` in the TN layout Hopper's
/// FP8 GEMMs take, weights and activations E4M3, gradients E5M2 (the forward's B is the
/// activation; the input and weight gradients' B is the output gradient), fast accumulation in
/// the forward only, as Transformer Engine runs them.
pub fn fp8_shape(case: &GemmCase) -> super::Fp8Shape {
    let fwd = case.ta && !case.tb;
    super::Fp8Shape {
        m: case.m,
        n: case.n,
        k: case.k,
        a_e5m2: false,
        b_e5m2: !fwd,
        c_f32: case.c_f32,
        beta: case.beta,
        fast_accum: fwd,
    }
}

/// Times each case's FP8 form ([`fp8_shape`]) with each of up to `algos` cuBLASLt heuristic
/// algorithms (heuristic order; #0 is what `fp8_matmul_t` runs), on operands quantized from
/// random normal bf16 values (so the bit patterns, and the power drawn, are realistic).
pub fn bench_fp8(device: &Device, cases: &[GemmCase], algos: usize, reps: usize) -> Result<Vec<Vec<f64>>> {
    use crate::fp8::{quantize, Fp8Format};
    let dev = match device {
        Device::Cuda(d) => d.clone(),
        _ => bail!("bench-gemm needs a CUDA device"),
    };
    let ws = Tensor::zeros(super::fp8::LT_WORKSPACE, DType::U8, device)?;
    let ws_p = tensor_addr::<u8>(&ws, "workspace")?;
    let handle = lt::create_handle().map_err(lt_err("handle"))?;
    let stream = dev.cuda_stream().cu_stream() as lt_sys::cudaStream_t;
    let run = || -> Result<Vec<Vec<f64>>> {
        let mut out = Vec::with_capacity(cases.len());
        for case in cases {
            let s = fp8_shape(case);
            let fmt = |e5m2: bool| if e5m2 { Fp8Format::E5M2 } else { Fp8Format::E4M3 };
            let rand = |r: usize, c: usize| -> Result<Tensor> {
                Tensor::randn(0f32, 1.0, (r, c), device)?.to_dtype(DType::BF16)
            };
            // Row-major [m, k] and [n, k]: the K-major column-major A [k, m] and B [k, n].
            let a = quantize(&rand(s.m, s.k)?, fmt(s.a_e5m2), false)?;
            let b = quantize(&rand(s.n, s.k)?, fmt(s.b_e5m2), false)?;
            let c_dtype = if s.c_f32 { DType::F32 } else { DType::BF16 };
            let c = Tensor::randn(0f32, 1.0, (s.n, s.m), device)?.to_dtype(c_dtype)?;
            let cp = if s.c_f32 {
                tensor_addr::<f32>(&c, "c")?
            } else {
                tensor_addr::<bf16>(&c, "c")?
            };
            let (ap, bp) = (tensor_addr::<u8>(&a.data, "a")?, tensor_addr::<u8>(&b.data, "b")?);
            let (asp, bsp) = (
                tensor_addr::<f32>(&a.scale_inv, "a scale")?,
                tensor_addr::<f32>(&b.scale_inv, "b scale")?,
            );
            // A shape cuBLASLt cannot run in FP8 gets no timings (and says why), not an abort.
            // Safety: the handle is destroyed only after this loop.
            let plan = match unsafe { super::Fp8Plan::new(handle, s, algos) } {
                Ok(p) => p,
                Err(e) => {
                    eprintln!("bench-gemm: {}: {e}", case.name);
                    out.push(Vec::new());
                    continue;
                }
            };
            let mut ms = Vec::with_capacity(plan.algos.len());
            for i in 0..plan.algos.len() {
                ms.push(time_ms(&dev, 3, reps, &mut || unsafe {
                    plan.run(handle, i, ap, asp, bp, bsp, cp, ws_p, stream)
                })?);
            }
            out.push(ms);
        }
        Ok(out)
    };
    let r = run();
    unsafe {
        let _ = lt::destroy_handle(handle);
    }
    r
}

/// Mean ms of one [`crate::fp8::quantize`] (amax, then the cast with its transpose) of a bf16
/// `[rows, cols]` tensor, per shape.
pub fn bench_quantize(device: &Device, shapes: &[(usize, usize)], reps: usize) -> Result<Vec<f64>> {
    let dev = match device {
        Device::Cuda(d) => d.clone(),
        _ => bail!("bench-gemm needs a CUDA device"),
    };
    let mut out = Vec::new();
    for &(r, c) in shapes {
        let x = Tensor::randn(0f32, 1.0, (r, c), device)?.to_dtype(DType::BF16)?;
        out.push(time_ms(&dev, 3, reps, &mut || {
            crate::fp8::quantize(&x, crate::fp8::Fp8Format::E4M3, true).map(|_| ())
        })?);
    }
    Ok(out)
}
