//! Host side of the fused CUDA kernels (`cuda/ops.cu`, `cuda/flash_attn.cu`, compiled to PTX by
//! `build.rs`): argument checks, allocation, launch shapes, and the cuBLAS GEMMs of the LM head.
//!
//! The fused kernels take bf16 tensors (the training dtype on the GPU); every other dtype on a
//! CUDA device runs the composed path ([`crate::composed`]). The public ops pick the path with
//! [`fused`].
//!
//! Decisions:
//! - Kernels get raw device pointers (with the layout's offset applied) rather than `CudaSlice`
//!   borrows: outputs are often slices of one packed buffer, and everything runs on candle's one
//!   stream, so stream order is the only synchronisation needed.
//! - Host metadata (positions, `cu_seqlens`, targets) is copied to the device per call (a few KB;
//!   a pageable host-to-device copy, which returns once the copy is staged).
//! - The LM head computes each `[rows, chunk]` block of logits with a cuBLAS GEMM, bf16 inputs and
//!   f32 output (the logits are never rounded to bf16), then folds it into per-row running softmax
//!   statistics; the backward recomputes the block, turns it into `dlogits` (bf16, as torch's bf16
//!   autograd has it) and runs two GEMMs. At most `rows x VOCAB_CHUNK` logits exist at a time.
#[cfg(feature = "cudnn")]
use crate::config::AttentionBackend;
use crate::config::KernelConfig;
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::cublas::{result as blas, sys as blas_sys};
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::cudarc::nvrtc::Ptx;
use candle_core::cuda_backend::{CudaDevice, CudaStorage, DeviceId, WrapErr};
use candle_core::{bail, DType, Layout, Result, Shape, Storage, Tensor};
use half::bf16;
use std::sync::{Arc, Mutex, OnceLock};

pub mod gemm_bench;

const OPS_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/ops.ptx"));
const FLASH_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/flash_attn.ptx"));
const DECODE_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/decode.ptx"));
const INVARIANT_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/invariant.ptx"));
const FP8_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/fp8.ptx"));

/// Vocabulary columns per logits block of the LM head.
const VOCAB_CHUNK: usize = 16384;
/// RMSNorm keeps `RMS_MAXC` columns per thread in registers (see ops.cu); rows of at most
/// `RMSW_MAX_D` take the warp-per-row kernels (`RMSW_WARPS` rows per block).
const RMS_MAXC: usize = 16;
const RMSW_MAX_D: usize = 256;
const RMSW_WARPS: usize = 8;

/// Whether the fused CUDA kernels take tensors of this device and dtype.
pub(crate) fn fused(device: &candle_core::Device, dtype: DType) -> bool {
    device.is_cuda() && dtype == DType::BF16
}

/// vime's own module cache: (device, module) -> loaded module. candle's custom-module cache
/// hands out functions whose attributes (the dynamic shared-memory limit) cannot be set.
type ModuleCache = Mutex<Vec<(DeviceId, &'static str, Arc<CudaModule>)>>;
static MODULES: OnceLock<ModuleCache> = OnceLock::new();

fn load(dev: &CudaDevice, module: &'static str, ptx: &'static str, name: &str) -> Result<CudaFunction> {
    let cache = MODULES.get_or_init(|| Mutex::new(Vec::new()));
    let mut cache = cache.lock().unwrap();
    let m = match cache.iter().find(|(d, m, _)| *d == dev.id() && *m == module) {
        Some((_, _, m)) => m.clone(),
        None => {
            let m = dev.cuda_stream().context().load_module(Ptx::from_src(ptx)).w()?;
            cache.push((dev.id(), module, m.clone()));
            m
        }
    };
    m.load_function(name).w()
}

fn ops_fn(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    load(dev, "vime_ops", OPS_PTX, name)
}

fn flash_fn(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    load(dev, "vime_flash_attn", FLASH_PTX, name)
}

fn decode_fn(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    load(dev, "vime_decode", DECODE_PTX, name)
}

fn invariant_fn(dev: &CudaDevice, name: &str) -> Result<CudaFunction> {
    load(dev, "vime_invariant", INVARIANT_PTX, name)
}

/// A launch of `f` on the device's (candle's) stream.
macro_rules! launch {
    ($dev:expr, $f:expr, $cfg:expr, [$($arg:expr),* $(,)?]) => {{
        let stream = $dev.cuda_stream();
        let mut b = stream.launch_builder(&$f);
        $( b.arg($arg); )*
        unsafe { b.launch($cfg) }.w()?;
    }};
}

mod fp8;
pub(crate) use fp8::{
    f32_addr, fp8_amax_commit, fp8_quantize, fp8_swiglu_backward_quantize, fp8_swiglu_quantize, CastScale, Fp8Parts,
};
pub use fp8::{fp8_matmul_t, Fp8Operand, Fp8Plan, Fp8Shape};

/// Device address of a contiguous tensor's first element.
fn addr<T: candle_core::cuda_backend::CudaDType + DeviceRepr>(s: &CudaStorage, l: &Layout, what: &str) -> Result<u64> {
    if !l.is_contiguous() {
        bail!(
            "{what}: the fused CUDA kernels need contiguous tensors, got strides {:?}",
            l.stride()
        );
    }
    raw_addr::<T>(s, l)
}

/// The device address of a tensor's first element, whatever its strides (for kernels that are
/// given the strides).
fn raw_addr<T: candle_core::cuda_backend::CudaDType + DeviceRepr>(s: &CudaStorage, l: &Layout) -> Result<u64> {
    let slice = s.as_cuda_slice::<T>()?;
    let stream = s.device.cuda_stream();
    let (p, _sync) = slice.device_ptr(&stream);
    Ok(p + (l.start_offset() * std::mem::size_of::<T>()) as u64)
}

/// A tensor (no autograd) over a buffer these functions filled.
fn device_tensor<T: candle_core::cuda_backend::CudaDType>(
    out: CudaSlice<T>,
    dev: &CudaDevice,
    shape: impl Into<Shape>,
) -> Tensor {
    let storage = CudaStorage::wrap_cuda_slice(out, dev.clone());
    Tensor::from_storage(
        Storage::Cuda(storage),
        shape,
        candle_core::op::BackpropOp::none(),
        false,
    )
}

fn slice_addr<T>(s: &CudaSlice<T>, dev: &CudaDevice) -> u64 {
    let stream = dev.cuda_stream();
    let (p, _sync) = s.device_ptr(&stream);
    p
}

/// The CUDA storage and layout of a tensor that rides in an op struct.
/// [`tensor_addr`] for a strided view whose strides the kernel is given (no contiguity check).
fn strided_addr<T: candle_core::cuda_backend::CudaDType + DeviceRepr>(t: &Tensor, what: &str) -> Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cuda(s) => raw_addr::<T>(s, layout),
        _ => bail!("{what}: tensor is not on a CUDA device"),
    }
}

fn tensor_addr<T: candle_core::cuda_backend::CudaDType + DeviceRepr>(t: &Tensor, what: &str) -> Result<u64> {
    let (storage, layout) = t.storage_and_layout();
    match &*storage {
        Storage::Cuda(s) => addr::<T>(s, layout, what),
        _ => bail!("{what}: tensor is not on a CUDA device"),
    }
}

fn grid_for(n: usize, threads: u32) -> u32 {
    (n.div_ceil(threads as usize)).clamp(1, 65_535 * 8) as u32
}

fn cfg(grid: u32, block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (grid, 1, 1),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn upload_u32(dev: &CudaDevice, v: &[u32]) -> Result<CudaSlice<u32>> {
    if v.is_empty() {
        return dev.alloc_zeros::<u32>(1);
    }
    dev.cuda_stream().clone_htod(v).w()
}

/// Entries [`upload_u32_cached`] keeps (most recent first) and the longest array it caches.
const UPLOAD_CACHE_ENTRIES: usize = 8;
const UPLOAD_CACHE_MAX_LEN: usize = 1 << 16;

type UploadCache = Mutex<Vec<(DeviceId, Vec<u32>, Arc<CudaSlice<u32>>)>>;
static UPLOADS: OnceLock<UploadCache> = OnceLock::new();

/// [`upload_u32`] for metadata that repeats across calls (the positions and `cu_seqlens` every
/// layer of a forward passes again): an array equal to one of the last few uploaded to this
/// device reuses that device copy, so a forward uploads its metadata once, not once per layer.
/// Comparing a few KB on the host is far cheaper than a host-to-device copy. The device copies
/// are only ever read by kernels, so sharing them (an `Arc`: a `CudaSlice` clone is a device copy)
/// is safe in stream order.
fn upload_u32_cached(dev: &CudaDevice, v: &[u32]) -> Result<Arc<CudaSlice<u32>>> {
    if v.is_empty() || v.len() > UPLOAD_CACHE_MAX_LEN {
        return Ok(Arc::new(upload_u32(dev, v)?));
    }
    let cache = UPLOADS.get_or_init(|| Mutex::new(Vec::new()));
    let mut cache = cache.lock().unwrap();
    if let Some(i) = cache.iter().position(|(d, h, _)| *d == dev.id() && h.as_slice() == v) {
        let hit = cache.remove(i);
        let slice = hit.2.clone();
        cache.insert(0, hit);
        return Ok(slice);
    }
    let slice = Arc::new(upload_u32(dev, v)?);
    cache.insert(0, (dev.id(), v.to_vec(), slice.clone()));
    cache.truncate(UPLOAD_CACHE_ENTRIES);
    Ok(slice)
}

fn check_bf16(op: &str, dtypes: &[DType]) -> Result<()> {
    if let Some(d) = dtypes.iter().find(|d| **d != DType::BF16) {
        bail!("{op}: the fused CUDA kernel takes bf16 only, got {d:?}");
    }
    Ok(())
}

fn i32_of(op: &str, what: &str, n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| candle_core::Error::Msg(format!("{op}: {what} {n} exceeds i32")))
}

// ---------------------------------------------------------------------------------------------
// RMSNorm
// ---------------------------------------------------------------------------------------------

fn rms_threads(d: usize) -> Result<u32> {
    let threads = d.div_ceil(RMS_MAXC).div_ceil(32).clamp(1, 32) * 32;
    if threads * RMS_MAXC < d {
        bail!(
            "rms_norm: the fused CUDA kernel handles rows of at most {} elements, got {d}",
            1024 * RMS_MAXC
        );
    }
    Ok(threads as u32)
}

pub(crate) fn rms_norm_fwd(
    x: &CudaStorage,
    lx: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    eps: f64,
) -> Result<(CudaStorage, Shape)> {
    check_bf16("rms_norm", &[x.dtype(), w.dtype()])?;
    let dev = &x.device;
    let d = *lx.dims().last().unwrap_or(&1);
    let n = lx.shape().elem_count();
    let rows = n.checked_div(d).unwrap_or(0);
    let out = unsafe { dev.alloc::<bf16>(n.max(1)) }?;
    if rows > 0 {
        let (xp, wp, yp) = (
            addr::<bf16>(x, lx, "rms_norm")?,
            addr::<bf16>(w, lw, "rms_norm")?,
            slice_addr(&out, dev),
        );
        let (rows_i, d_i, eps_f) = (
            i32_of("rms_norm", "rows", rows)?,
            i32_of("rms_norm", "d", d)?,
            eps as f32,
        );
        if d <= RMSW_MAX_D {
            let f = ops_fn(dev, "vime_rmsnorm_fwd_warp")?;
            let blocks = rows.div_ceil(RMSW_WARPS).min(132 * 16) as u32;
            let c = cfg(blocks, 32 * RMSW_WARPS as u32);
            launch!(dev, f, c, [&xp, &wp, &yp, &rows_i, &d_i, &eps_f]);
        } else if let Some(threads) = rmsv_threads(d, &[xp, wp, yp]) {
            let f = ops_fn(dev, "vime_rmsnorm_fwd_v8")?;
            let null = 0u64;
            let c = cfg(rows.min(132 * 16) as u32, threads);
            launch!(dev, f, c, [&xp, &null, &wp, &null, &yp, &rows_i, &d_i, &eps_f]);
        } else {
            let f = ops_fn(dev, "vime_rmsnorm_fwd")?;
            let c = cfg(rows.min(132 * 16) as u32, rms_threads(d)?);
            launch!(dev, f, c, [&xp, &wp, &yp, &rows_i, &d_i, &eps_f]);
        }
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), lx.shape().clone()))
}

/// Chunks of 8 columns a thread of the 16-byte RMSNorm kernels holds at most (`RMSV_MAXV`).
const RMSV_MAXV: usize = 1;

/// Threads per block of the 16-byte RMSNorm kernels (`vime_rmsnorm_*_v8`) for rows of `d`, or
/// `None` where they do not apply: narrow rows (the warp kernels), `d % 8 != 0`, rows too wide,
/// or a pointer that is not 16-byte aligned.
fn rmsv_threads(d: usize, ptrs: &[u64]) -> Option<u32> {
    let nv = d / 8;
    if d <= RMSW_MAX_D || !d.is_multiple_of(8) || nv > 1024 * RMSV_MAXV || ptrs.iter().any(|p| p % 16 != 0) {
        return None;
    }
    let threads = nv.div_ceil(nv.div_ceil(1024)).div_ceil(32) * 32;
    Some(threads.min(1024) as u32)
}

/// `s = x + r` and `y = rms_norm(s) * w` in one pass (bf16, contiguous, rows of `d = w.len()`):
/// the residual add fused into the norm that reads its result. Returns `(s, y)`, the same values
/// as the add then the norm.
pub(crate) fn add_rms_norm(x: &Tensor, r: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    check_bf16("add_rms_norm", &[x.dtype(), r.dtype(), w.dtype()])?;
    let d = w.elem_count();
    if x.dims() != r.dims() || x.dims().last() != Some(&d) {
        bail!(
            "add_rms_norm: x {:?}, r {:?} and weight {:?} do not match",
            x.dims(),
            r.dims(),
            w.dims()
        );
    }
    let dev = match x.device() {
        candle_core::Device::Cuda(dv) => dv.clone(),
        _ => bail!("add_rms_norm: tensors must be on a CUDA device"),
    };
    let n = x.elem_count();
    let rows = n.checked_div(d).unwrap_or(0);
    let (so, yo) = unsafe { (dev.alloc::<bf16>(n.max(1))?, dev.alloc::<bf16>(n.max(1))?) };
    if rows > 0 {
        let (xp, rp, wp) = (
            tensor_addr::<bf16>(x, "add_rms_norm x")?,
            tensor_addr::<bf16>(r, "add_rms_norm r")?,
            tensor_addr::<bf16>(w, "add_rms_norm weight")?,
        );
        let (sp, yp) = (slice_addr(&so, &dev), slice_addr(&yo, &dev));
        let Some(threads) = rmsv_threads(d, &[xp, rp, wp, sp, yp]) else {
            bail!("add_rms_norm: rows of {d} need the 16-byte kernel (d % 8 == 0, d > {RMSW_MAX_D})");
        };
        let (rows_i, d_i, eps_f) = (
            i32_of("add_rms_norm", "rows", rows)?,
            i32_of("add_rms_norm", "d", d)?,
            eps as f32,
        );
        let f = ops_fn(&dev, "vime_rmsnorm_fwd_v8")?;
        launch!(
            dev,
            f,
            cfg(rows.min(132 * 16) as u32, threads),
            [&xp, &rp, &wp, &sp, &yp, &rows_i, &d_i, &eps_f]
        );
    }
    Ok((
        device_tensor(so, &dev, x.shape().clone()),
        device_tensor(yo, &dev, x.shape().clone()),
    ))
}

/// Whether [`add_rms_norm`] and [`rms_norm_bwd_res`] take rows of `d` (else the caller composes).
pub(crate) fn fused_residual_norm(d: usize) -> bool {
    rmsv_threads(d, &[]).is_some()
}

/// The RMSNorm backward with the residual's gradient added in the same pass (bf16, contiguous):
/// `(res + dx, dw)`, the values of `rms_norm_backward` followed by the add.
pub(crate) fn rms_norm_bwd_res(x: &Tensor, w: &Tensor, eps: f64, g: &Tensor, res: &Tensor) -> Result<(Tensor, Tensor)> {
    check_bf16("rms_norm backward", &[x.dtype(), w.dtype(), g.dtype(), res.dtype()])?;
    let d = w.elem_count();
    if x.dims() != g.dims() || x.dims() != res.dims() || x.dims().last() != Some(&d) {
        bail!(
            "rms_norm backward: x {:?}, dy {:?}, residual {:?} and weight {:?} do not match",
            x.dims(),
            g.dims(),
            res.dims(),
            w.dims()
        );
    }
    let dev = match x.device() {
        candle_core::Device::Cuda(dv) => dv.clone(),
        _ => bail!("rms_norm backward: tensors must be on a CUDA device"),
    };
    let n = x.elem_count();
    let rows = n.checked_div(d).unwrap_or(0);
    let dx = unsafe { dev.alloc::<bf16>(n.max(1)) }?;
    // The column sum writes every dw element; only an empty input needs the zeros.
    let dw = if rows > 0 {
        unsafe { dev.alloc::<bf16>(d) }?
    } else {
        dev.alloc_zeros::<bf16>(d.max(1))?
    };
    if rows > 0 {
        let (xp, wp, gp, rp) = (
            tensor_addr::<bf16>(x, "rms_norm backward x")?,
            tensor_addr::<bf16>(w, "rms_norm backward weight")?,
            tensor_addr::<bf16>(g, "rms_norm backward dy")?,
            tensor_addr::<bf16>(res, "rms_norm backward residual")?,
        );
        let (dxp, dwp) = (slice_addr(&dx, &dev), slice_addr(&dw, &dev));
        let Some(threads) = rmsv_threads(d, &[xp, wp, gp, rp, dxp]) else {
            bail!("rms_norm backward: rows of {d} need the 16-byte kernel (d % 8 == 0, d > {RMSW_MAX_D})");
        };
        rms_norm_bwd_v8(&dev, [xp, wp, gp, rp, dxp, dwp], rows, d, eps, threads)?;
    }
    Ok((device_tensor(dx, &dev, x.shape().clone()), device_tensor(dw, &dev, d)))
}

/// Blocks of the wide RMSNorm backward: each writes a `[d]` f32 partial of dw.
const RMS_BWD_BLOCKS: usize = 132 * 8;

/// Launches `vime_rmsnorm_bwd_v8` and the dw column sum. `p = [x, w, g, res (or 0), dx, dw]`.
fn rms_norm_bwd_v8(dev: &CudaDevice, p: [u64; 6], rows: usize, d: usize, eps: f64, threads: u32) -> Result<()> {
    let blocks = rows.min(RMS_BWD_BLOCKS);
    let part = unsafe { dev.alloc::<f32>(blocks * d) }?;
    let pp = slice_addr(&part, dev);
    let (rows_i, d_i, eps_f) = (
        i32_of("rms_norm", "rows", rows)?,
        i32_of("rms_norm", "d", d)?,
        eps as f32,
    );
    let [xp, wp, gp, rp, dxp, dwp] = p;
    let f = ops_fn(dev, "vime_rmsnorm_bwd_v8")?;
    launch!(
        dev,
        f,
        cfg(blocks as u32, threads),
        [&xp, &wp, &gp, &rp, &dxp, &pp, &rows_i, &d_i, &eps_f]
    );
    colsum(dev, pp, dwp, blocks, d)
}

/// `out[c] = bf16(sum_b part[b * d + c])` over `nparts` f32 partial rows, in a fixed order.
fn colsum(dev: &CudaDevice, pp: u64, outp: u64, nparts: usize, d: usize) -> Result<()> {
    let (np_i, d_i) = (i32_of("colsum", "parts", nparts)?, i32_of("colsum", "d", d)?);
    let f = ops_fn(dev, "vime_colsum2_bf16")?;
    let c = LaunchConfig {
        grid_dim: (d.div_ceil(32) as u32, 1, 1),
        block_dim: (32, 32, 1),
        shared_mem_bytes: 0,
    };
    launch!(dev, f, c, [&pp, &outp, &np_i, &d_i]);
    Ok(())
}

/// `a + b`, bf16, same shape, contiguous: one 16-byte-access pass (candle's add reached about a
/// third of the H200's bandwidth on the residual stream).
pub(crate) fn add_bf16(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    check_bf16("add", &[a.dtype(), b.dtype()])?;
    if a.dims() != b.dims() {
        bail!("add: {:?} and {:?} differ in shape", a.dims(), b.dims());
    }
    let dev = match a.device() {
        candle_core::Device::Cuda(dv) => dv.clone(),
        _ => bail!("add: tensors must be on a CUDA device"),
    };
    let n = a.elem_count();
    let out = unsafe { dev.alloc::<bf16>(n.max(1)) }?;
    if n > 0 {
        let (ap, bp, yp) = (
            tensor_addr::<bf16>(a, "add a")?,
            tensor_addr::<bf16>(b, "add b")?,
            slice_addr(&out, &dev),
        );
        let n64 = n as u64;
        let threads = elementwise_threads(n, &[ap, bp, yp]);
        let f = ops_fn(&dev, "vime_add_bf16")?;
        launch!(dev, f, cfg(grid_for(threads, 256), 256), [&ap, &bp, &yp, &n64]);
    }
    Ok(device_tensor(out, &dev, a.shape().clone()))
}

/// Packed `[dx (flat) ++ dw]`, bf16.
pub(crate) fn rms_norm_bwd(
    x: &CudaStorage,
    lx: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    g: &CudaStorage,
    lg: &Layout,
    eps: f64,
) -> Result<(CudaStorage, Shape)> {
    check_bf16("rms_norm backward", &[x.dtype(), w.dtype(), g.dtype()])?;
    let dev = &x.device;
    let d = *lx.dims().last().unwrap_or(&1);
    let n = lx.shape().elem_count();
    let rows = n.checked_div(d).unwrap_or(0);
    // Every element is written: dx by the kernel, dw by the column sum.
    let out = if rows > 0 {
        unsafe { dev.alloc::<bf16>(n + d) }?
    } else {
        dev.alloc_zeros::<bf16>(n + d)?
    };
    if rows > 0 {
        let narrow = d <= RMSW_MAX_D;
        let (xp, wp, gp) = (
            addr::<bf16>(x, lx, "rms_norm backward")?,
            addr::<bf16>(w, lw, "rms_norm backward")?,
            addr::<bf16>(g, lg, "rms_norm backward")?,
        );
        let dxp = slice_addr(&out, dev);
        if let Some(threads) = rmsv_threads(d, &[xp, wp, gp, dxp]) {
            rms_norm_bwd_v8(dev, [xp, wp, gp, 0, dxp, dxp + (n * 2) as u64], rows, d, eps, threads)?;
            return Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), Shape::from(n + d)));
        }
        let blocks = if narrow {
            rows.div_ceil(RMSW_WARPS).min(132 * 4)
        } else {
            rows.min(132 * 4)
        };
        let part = unsafe { dev.alloc::<f32>(blocks * d) }?;
        let dwp = dxp + (n * 2) as u64;
        let pp = slice_addr(&part, dev);
        let (rows_i, d_i, eps_f) = (
            i32_of("rms_norm", "rows", rows)?,
            i32_of("rms_norm", "d", d)?,
            eps as f32,
        );
        let (name, threads) = if narrow {
            ("vime_rmsnorm_bwd_warp", 32 * RMSW_WARPS as u32)
        } else {
            ("vime_rmsnorm_bwd", rms_threads(d)?)
        };
        let f = ops_fn(dev, name)?;
        let c = cfg(blocks as u32, threads);
        launch!(dev, f, c, [&xp, &wp, &gp, &dxp, &pp, &rows_i, &d_i, &eps_f]);
        colsum(dev, pp, dwp, blocks, d)?;
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), Shape::from(n + d)))
}

// ---------------------------------------------------------------------------------------------
// RoPE
// ---------------------------------------------------------------------------------------------

pub(crate) fn rope(
    x: &CudaStorage,
    lx: &Layout,
    positions: &[u32],
    theta: f64,
    sign: f64,
) -> Result<(CudaStorage, Shape)> {
    check_bf16("rope", &[x.dtype()])?;
    let dev = &x.device;
    let dims = lx.dims();
    let (t, h, d) = (dims[0], dims[1], dims[2]);
    let n = t * h * d;
    let out = unsafe { dev.alloc::<bf16>(n.max(1)) }?;
    if n > 0 {
        let pos = upload_u32_cached(dev, positions)?;
        let (xp, yp, pp) = (
            addr::<bf16>(x, lx, "rope")?,
            slice_addr(&out, dev),
            slice_addr(&*pos, dev),
        );
        let (t_i, h_i, d_i) = (
            i32_of("rope", "tokens", t)?,
            i32_of("rope", "heads", h)?,
            i32_of("rope", "head_dim", d)?,
        );
        let (theta_f, sign_f) = (theta as f32, sign as f32);
        let f = ops_fn(dev, "vime_rope")?;
        launch!(
            dev,
            f,
            cfg(grid_for(t * (d / 2), 256), 256),
            [&xp, &yp, &pp, &t_i, &h_i, &d_i, &theta_f, &sign_f]
        );
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), lx.shape().clone()))
}

// ---------------------------------------------------------------------------------------------
// SwiGLU
// ---------------------------------------------------------------------------------------------

/// Threads an elementwise bf16 kernel of ops.cu needs: one per 8 elements when it takes its
/// 16-byte path (`n % 8 == 0`, every pointer 16-byte aligned; the kernel makes the same test),
/// else one per element. A grid sized for `n` threads on the vector path would launch 8x the
/// blocks, 7/8 of them with nothing to do.
fn elementwise_threads(n: usize, ptrs: &[u64]) -> usize {
    if n.is_multiple_of(8) && ptrs.iter().all(|p| p.is_multiple_of(16)) {
        n / 8
    } else {
        n
    }
}

pub(crate) fn swiglu_fwd(g: &CudaStorage, lg: &Layout, u: &CudaStorage, lu: &Layout) -> Result<(CudaStorage, Shape)> {
    check_bf16("swiglu", &[g.dtype(), u.dtype()])?;
    let dev = &g.device;
    let n = lg.shape().elem_count();
    let out = unsafe { dev.alloc::<bf16>(n.max(1)) }?;
    if n > 0 {
        let (gp, up, yp) = (
            addr::<bf16>(g, lg, "swiglu")?,
            addr::<bf16>(u, lu, "swiglu")?,
            slice_addr(&out, dev),
        );
        let n64 = n as u64;
        let f = ops_fn(dev, "vime_swiglu_fwd")?;
        let threads = elementwise_threads(n, &[gp, up, yp]);
        launch!(dev, f, cfg(grid_for(threads, 256), 256), [&gp, &up, &yp, &n64]);
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), lg.shape().clone()))
}

/// Packed `[d_gate ++ d_up]`, bf16.
pub(crate) fn swiglu_bwd(
    g: &CudaStorage,
    lg: &Layout,
    u: &CudaStorage,
    lu: &Layout,
    gy: &CudaStorage,
    lgy: &Layout,
) -> Result<(CudaStorage, Shape)> {
    check_bf16("swiglu backward", &[g.dtype(), u.dtype(), gy.dtype()])?;
    let dev = &g.device;
    let n = lg.shape().elem_count();
    let out = unsafe { dev.alloc::<bf16>((2 * n).max(1)) }?;
    if n > 0 {
        let (gp, up, gyp) = (
            addr::<bf16>(g, lg, "swiglu backward")?,
            addr::<bf16>(u, lu, "swiglu backward")?,
            addr::<bf16>(gy, lgy, "swiglu backward")?,
        );
        let dgp = slice_addr(&out, dev);
        let dup = dgp + (n * 2) as u64;
        let n64 = n as u64;
        let f = ops_fn(dev, "vime_swiglu_bwd")?;
        let threads = elementwise_threads(n, &[gp, up, gyp, dgp, dup]);
        launch!(
            dev,
            f,
            cfg(grid_for(threads, 256), 256),
            [&gp, &up, &gyp, &dgp, &dup, &n64]
        );
    }
    Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), Shape::from(2 * n)))
}

// ---------------------------------------------------------------------------------------------
// LM head: log-prob + entropy
// ---------------------------------------------------------------------------------------------

/// `C (col-major m x n, f32 or bf16) = alpha * op(A) op(B) + beta * C` with bf16 A, B.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm(
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
    let blas_handle = dev.cublas_handle();
    let op = |t: bool| {
        if t {
            blas_sys::cublasOperation_t::CUBLAS_OP_T
        } else {
            blas_sys::cublasOperation_t::CUBLAS_OP_N
        }
    };
    let alpha = 1.0f32;
    let c_type = if c_f32 {
        blas_sys::cudaDataType::CUDA_R_32F
    } else {
        blas_sys::cudaDataType::CUDA_R_16BF
    };
    let to_i =
        |v: usize| i32::try_from(v).map_err(|_| candle_core::Error::Msg(format!("gemm dimension {v} exceeds i32")));
    blas::gemm_ex(
        *blas_handle.handle(),
        op(ta),
        op(tb),
        to_i(m)?,
        to_i(n)?,
        to_i(k)?,
        &alpha as *const f32 as *const _,
        a as *const _,
        blas_sys::cudaDataType::CUDA_R_16BF,
        to_i(lda)?,
        b as *const _,
        blas_sys::cudaDataType::CUDA_R_16BF,
        to_i(ldb)?,
        &beta as *const f32 as *const _,
        c as *mut _,
        c_type,
        to_i(ldc)?,
        blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
    )
    .map_err(|e| candle_core::Error::Msg(format!("cuBLAS GemmEx: {e:?}")))
}

/// `Y = X . W^T` by the batch-invariant GEMM (`vime_bi_gemm`, `cuda/invariant.cu`): `x: [m, k]`
/// and `w: [n, k]` bf16 at device addresses `xp`, `wp` (contiguous rows), `y` written at `yp`
/// with row stride `ldy` elements, bf16 or (`f32_out`) f32.
///
/// Safety: the addresses must hold those extents on `dev`'s stream.
#[allow(clippy::too_many_arguments)]
unsafe fn bi_gemm(
    dev: &CudaDevice,
    xp: u64,
    wp: u64,
    yp: u64,
    m: usize,
    n: usize,
    k: usize,
    ldy: usize,
    f32_out: bool,
    splits: usize,
) -> Result<()> {
    if m == 0 || n == 0 {
        return Ok(());
    }
    let f = invariant_fn(dev, "vime_bi_gemm")?;
    let grid_y = m.div_ceil(64);
    if grid_y > 65_535 {
        bail!("batch-invariant GEMM: {m} rows is more than the grid takes (65535 x 64)");
    }
    let k_per_split = k.div_ceil(splits.max(1)).div_ceil(32).max(1) * 32;
    let splits = k.div_ceil(k_per_split).max(1);
    let c = LaunchConfig {
        grid_dim: (n.div_ceil(64) as u32, grid_y as u32, splits as u32),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    let (m_i, n_i, k_i) = (
        i32_of("bi_gemm", "rows", m)?,
        i32_of("bi_gemm", "columns", n)?,
        i32_of("bi_gemm", "depth", k)?,
    );
    let (ldy_i, f32_i, kps_i) = (
        i32_of("bi_gemm", "row stride", ldy)?,
        f32_out as i32,
        i32_of("bi_gemm", "split", k_per_split)?,
    );
    if splits == 1 {
        let none = 0u64;
        launch!(
            dev,
            f,
            c,
            [&xp, &wp, &yp, &m_i, &n_i, &k_i, &ldy_i, &f32_i, &kps_i, &none]
        );
        return Ok(());
    }
    // Safety: the GEMM writes every partial of every split.
    let part = unsafe { dev.alloc::<f32>(splits * m * n) }?;
    let pp = slice_addr(&part, dev);
    launch!(
        dev,
        f,
        c,
        [&xp, &wp, &yp, &m_i, &n_i, &k_i, &ldy_i, &f32_i, &kps_i, &pp]
    );
    let s_i = splits as i32;
    let r = invariant_fn(dev, "vime_bi_gemm_reduce")?;
    launch!(
        dev,
        r,
        cfg(grid_for(m * n, 256), 256),
        [&pp, &yp, &m_i, &n_i, &s_i, &ldy_i, &f32_i]
    );
    Ok(())
}

/// The split-K count of the batch-invariant GEMM of an `[n, k]` weight: a function of the
/// weight's shape alone, never of the row count, so that every M sums K the same way. About 4
/// blocks per SM of an H200 at one 64-row tile (a decode step's GEMM), at least 256 of K per
/// split, at most 16 splits.
pub(crate) fn bi_splits(n: usize, k: usize) -> usize {
    let want = (528 / n.div_ceil(64).max(1)).max(1);
    want.min((k / 256).max(1)).min(16)
}

/// [`crate::invariant::matmul_t`] on the device: `x [m, k] . w [n, k]^T`, bf16 (or f32) out, in
/// `splits` K-splits.
pub(crate) fn bi_matmul_t(x: &Tensor, w: &Tensor, f32_out: bool, splits: usize) -> Result<Tensor> {
    let dev = match x.device() {
        candle_core::Device::Cuda(d) => d.clone(),
        _ => bail!("batch-invariant GEMM: x must be on a CUDA device"),
    };
    check_bf16("batch-invariant GEMM", &[x.dtype(), w.dtype()])?;
    let (m, k) = x.dims2()?;
    let (n, k2) = w.dims2()?;
    if k != k2 {
        bail!(
            "batch-invariant GEMM: x {:?} and w {:?} differ in depth",
            x.dims(),
            w.dims()
        );
    }
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    let (xp, wp) = (
        tensor_addr::<bf16>(&x, "bi_gemm x")?,
        tensor_addr::<bf16>(&w, "bi_gemm w")?,
    );
    if f32_out {
        // Safety: the kernel writes every element of the [m, n] output.
        let out = unsafe { dev.alloc::<f32>((m * n).max(1)) }?;
        unsafe { bi_gemm(&dev, xp, wp, slice_addr(&out, &dev), m, n, k, n, true, splits)? };
        Ok(device_tensor(out, &dev, (m, n)))
    } else {
        let out = unsafe { dev.alloc::<bf16>((m * n).max(1)) }?;
        unsafe { bi_gemm(&dev, xp, wp, slice_addr(&out, &dev), m, n, k, n, false, splits)? };
        Ok(device_tensor(out, &dev, (m, n)))
    }
}

/// [`crate::lm_head::logits_f32`] on the device: `[n, v]` f32 logits of contiguous bf16
/// `hidden: [n, h]` and `w: [v, h]`, one GEMM.
pub(crate) fn logits_f32(hidden: &Tensor, w: &Tensor, n: usize, v: usize, h: usize) -> Result<Tensor> {
    let dev = match hidden.device() {
        candle_core::Device::Cuda(d) => d.clone(),
        _ => bail!("logits_f32: hidden must be on a CUDA device"),
    };
    let (hp, wp) = (
        tensor_addr::<bf16>(hidden, "logits_f32")?,
        tensor_addr::<bf16>(w, "logits_f32")?,
    );
    // Safety: the GEMM (beta 0) writes every element.
    let out = unsafe { dev.alloc::<f32>(n * v) }?;
    // logits^T [v, n] col-major = logits [n, v] row-major = W [v, h] . hidden^T.
    unsafe {
        gemm(
            &dev,
            true,
            false,
            v,
            n,
            h,
            wp,
            h,
            hp,
            h,
            0.0,
            slice_addr(&out, &dev),
            true,
            v,
        )?
    };
    Ok(device_tensor(out, &dev, (n, v)))
}

/// How the LM head's logits GEMM runs: cuBLAS into f32 (the default) or into bf16
/// ([`crate::HeadLogits`]), or the batch-invariant GEMM into f32 (`--true-on-policy-mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HeadGemm {
    F32,
    Bf16,
    Invariant,
}

impl HeadGemm {
    /// The GEMM of a head with these settings (the batch-invariant one keeps f32 logits).
    pub(crate) fn of(invariant: bool, bf16_logits: bool) -> Self {
        match (invariant, bf16_logits) {
            (true, _) => Self::Invariant,
            (false, true) => Self::Bf16,
            (false, false) => Self::F32,
        }
    }

    fn bf16(self) -> bool {
        self == Self::Bf16
    }

    /// Bytes of one logit.
    fn logit_bytes(self) -> usize {
        if self.bf16() {
            2
        } else {
            4
        }
    }

    fn stats_kernel(self) -> &'static str {
        if self.bf16() {
            "vime_lmhead_stats_bf16"
        } else {
            "vime_lmhead_stats"
        }
    }

    fn dlogits_kernel(self) -> &'static str {
        if self.bf16() {
            "vime_lmhead_dlogits_bf16"
        } else {
            "vime_lmhead_dlogits"
        }
    }

    /// A buffer of `n` logits, unfilled (every element the GEMMs or kernels read is written first).
    fn alloc(self, dev: &CudaDevice, n: usize) -> Result<LogitsBuf> {
        Ok(if self.bf16() {
            LogitsBuf::Bf16(unsafe { dev.alloc::<bf16>(n.max(1)) }?)
        } else {
            LogitsBuf::F32(unsafe { dev.alloc::<f32>(n.max(1)) }?)
        })
    }
}

/// Logits on the device in the head's dtype ([`HeadGemm`]).
enum LogitsBuf {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<bf16>),
}

impl LogitsBuf {
    fn addr(&self, dev: &CudaDevice) -> u64 {
        match self {
            Self::F32(s) => slice_addr(s, dev),
            Self::Bf16(s) => slice_addr(s, dev),
        }
    }

    fn into_tensor(self, dev: &CudaDevice, n: usize) -> Tensor {
        match self {
            Self::F32(s) => device_tensor(s, dev, n),
            Self::Bf16(s) => device_tensor(s, dev, n),
        }
    }
}

/// Forward: `[T, 3]` f32 = (logprob, entropy, lse) per token. The public op narrows the first two
/// columns; the backward reads lse from the saved output.
pub(crate) fn lm_head_fwd(
    h: &CudaStorage,
    lh: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    targets: &[u32],
    chunk_tokens: usize,
    gemm: HeadGemm,
) -> Result<(CudaStorage, Shape)> {
    lm_head_fwd_keep(h, lh, w, lw, targets, chunk_tokens, gemm, false).map(|(o, s, _)| (o, s))
}

/// [`lm_head_fwd_keep`] on tensors, keeping the logits: (the `[T, 3]` output, the `[T * V]`
/// logits, f32 or bf16 as `gemm` says).
pub(crate) fn lm_head_fwd_kept(
    h: &Tensor,
    w: &Tensor,
    targets: &[u32],
    chunk_tokens: usize,
    gemm: HeadGemm,
) -> Result<(Tensor, Tensor)> {
    let (hs, lh) = h.storage_and_layout();
    let (ws, lw) = w.storage_and_layout();
    let (Storage::Cuda(hs), Storage::Cuda(ws)) = (&*hs, &*ws) else {
        bail!("logprobs_entropy: tensors must be on a CUDA device");
    };
    let (t, v) = (lh.dims()[0], lw.dims()[0]);
    if gemm == HeadGemm::Invariant {
        bail!("logprobs_entropy: the batch-invariant head keeps no logits");
    }
    let (out, shape, kept) = lm_head_fwd_keep(hs, lh, ws, lw, targets, chunk_tokens, gemm, true)?;
    let dev = hs.device.clone();
    let out = Tensor::from_storage(Storage::Cuda(out), shape, candle_core::op::BackpropOp::none(), false);
    let kept = match kept {
        Some(k) => k.into_tensor(&dev, t * v),
        None => device_tensor(dev.alloc_zeros::<f32>(1)?, &dev, 0),
    };
    Ok((out, kept))
}

/// [`lm_head_fwd`], with `keep`: every logits block left in one `[T * V]` buffer (returned;
/// the blocks in the order of the loops, token chunk then vocabulary chunk, each `[rows, vc]`),
/// which [`lm_head_bwd_into`] then reads instead of running the logits GEMM again.
#[allow(clippy::too_many_arguments)]
fn lm_head_fwd_keep(
    h: &CudaStorage,
    lh: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    targets: &[u32],
    chunk_tokens: usize,
    gemm: HeadGemm,
    keep: bool,
) -> Result<(CudaStorage, Shape, Option<LogitsBuf>)> {
    check_bf16("logprobs_entropy", &[h.dtype(), w.dtype()])?;
    let dev = &h.device;
    let (t, hid) = (lh.dims()[0], lh.dims()[1]);
    let v = lw.dims()[0];
    let out = dev.alloc_zeros::<f32>((t * 3).max(1))?;
    if t == 0 {
        return Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((0, 3)),
            None,
        ));
    }
    let hp = addr::<bf16>(h, lh, "logprobs_entropy")?;
    let wp = addr::<bf16>(w, lw, "logprobs_entropy")?;
    let tg = upload_u32(dev, targets)?;
    let tgp = slice_addr(&tg, dev);
    let (stats, logits) = lm_head_stats(dev, hp, wp, (t, hid, v), tgp, chunk_tokens, 0, gemm, keep)?;
    let sp = slice_addr(&stats, dev);
    let op = slice_addr(&out, dev);
    let t_i = i32_of("logprobs_entropy", "tokens", t)?;
    let f = ops_fn(dev, "vime_lmhead_finish")?;
    launch!(dev, f, cfg(grid_for(t, 256), 256), [&sp, &tgp, &op, &t_i]);
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev.clone()),
        Shape::from((t, 3)),
        logits,
    ))
}

/// The statistics pass of the LM head's forward: `[T, 4]` f32 `(M, s, a, target logit)` per
/// token over the `v` rows of `w` (`hp`, `wp`: bf16 `[T, H]` and `[V, H]`), whose first row is
/// vocabulary id `v_offset` (a vocabulary shard's; targets are global ids, and a token whose
/// target is outside the shard keeps 0 as its target logit). `keep`: every logits block left in
/// one `[T * V]` buffer (returned; f32 or bf16 as `gemm` says), in the order of the loops.
#[allow(clippy::too_many_arguments)]
fn lm_head_stats(
    dev: &CudaDevice,
    hp: u64,
    wp: u64,
    (t, hid, v): (usize, usize, usize),
    tgp: u64,
    chunk_tokens: usize,
    v_offset: usize,
    gemm_kind: HeadGemm,
    keep: bool,
) -> Result<(CudaSlice<f32>, Option<LogitsBuf>)> {
    // (M, s, a, target logit) per row
    let init: Vec<f32> = (0..t).flat_map(|_| [f32::NEG_INFINITY, 0.0, 0.0, 0.0]).collect();
    let stats = dev.cuda_stream().clone_htod(&init).w()?;
    let sp = slice_addr(&stats, dev);
    let rows_max = chunk_tokens.max(1).min(t);
    let vc_max = VOCAB_CHUNK.min(v);
    let logits = gemm_kind.alloc(dev, if keep { t * v } else { rows_max * vc_max })?;
    let base = logits.addr(dev);
    let f_stats = ops_fn(dev, gemm_kind.stats_kernel())?;
    let mut kept_at = 0u64;
    for row0 in (0..t).step_by(rows_max) {
        let rows = rows_max.min(t - row0);
        for v0 in (0..v).step_by(vc_max) {
            let vc = vc_max.min(v - v0);
            let lp = base + kept_at;
            if keep {
                kept_at += (rows * vc * gemm_kind.logit_bytes()) as u64;
            }
            let (wc, hr) = (wp + (v0 * hid * 2) as u64, hp + (row0 * hid * 2) as u64);
            if gemm_kind == HeadGemm::Invariant {
                // The same logits bits whatever the row count (see `crate::invariant`).
                // One split: the engine's whole-vocabulary logits GEMM must sum K alike.
                unsafe { bi_gemm(dev, hr, wc, lp, rows, vc, hid, vc, true, 1)? };
            } else {
                // logits^T [vc, rows] (col-major) = W_c [vc, H] . hidden_rows^T, f32 sums written
                // as f32 or rounded to bf16.
                let f32_out = !gemm_kind.bf16();
                unsafe { gemm(dev, true, false, vc, rows, hid, wc, hid, hr, hid, 0.0, lp, f32_out, vc)? };
            }
            let vc_i = vc as i32;
            let v0_i = i32_of("logprobs_entropy", "vocabulary offset", v_offset + v0)?;
            let row0_i = row0 as i32;
            launch!(
                dev,
                f_stats,
                cfg(rows as u32, 256),
                [&lp, &vc_i, &v0_i, &tgp, &row0_i, &sp]
            );
        }
    }
    Ok((stats, keep.then_some(logits)))
}

/// [`lm_head_stats`] of a vocabulary shard on tensors: `h: [T, H]`, `w: [V_shard, H]` bf16
/// contiguous, the shard's first row vocabulary id `v_offset`. Returns `[T, 4]` f32.
pub(crate) fn lm_head_shard_stats(
    h: &Tensor,
    w: &Tensor,
    targets: &[u32],
    v_offset: usize,
    chunk_tokens: usize,
    gemm: HeadGemm,
) -> Result<Tensor> {
    check_bf16("vocab-parallel LM head", &[h.dtype(), w.dtype()])?;
    let dev = cuda_dev(h, "vocab-parallel LM head")?;
    let ((t, hid), v) = (h.dims2()?, w.dim(0)?);
    if t == 0 {
        return Tensor::zeros((0, 4), DType::F32, h.device());
    }
    let hp = tensor_addr::<bf16>(h, "vocab-parallel LM head (hidden)")?;
    let wp = tensor_addr::<bf16>(w, "vocab-parallel LM head (weight)")?;
    let tg = upload_u32(&dev, targets)?;
    let (stats, _) = lm_head_stats(
        &dev,
        hp,
        wp,
        (t, hid, v),
        slice_addr(&tg, &dev),
        chunk_tokens,
        v_offset,
        gemm,
        false,
    )?;
    Ok(device_tensor(stats, &dev, (t, 4)))
}

/// The backward of a vocabulary shard of the LM head: `(d_hidden, d_w)`, `d_hidden` `[T, H]`
/// f32 (this shard's share, to be summed over the shards), `d_w` `[V_shard, H]` bf16. `fwd_out`:
/// `[T, 3]` f32 (logprob, entropy, lse) over the whole vocabulary; `grad`: `[T, 3]` f32 (the
/// gradients of logprob and entropy, then zeros). Shapes as [`lm_head_shard_stats`]'s.
#[allow(clippy::too_many_arguments)]
pub(crate) fn lm_head_shard_bwd(
    h: &Tensor,
    w: &Tensor,
    targets: &[u32],
    v_offset: usize,
    fwd_out: &Tensor,
    grad: &Tensor,
    chunk_tokens: usize,
    gemm: HeadGemm,
) -> Result<(Tensor, Tensor)> {
    check_bf16("vocab-parallel LM head backward", &[h.dtype(), w.dtype()])?;
    check_head_grad(grad.dtype(), fwd_out)?;
    let dev = cuda_dev(h, "vocab-parallel LM head backward")?;
    let ((t, hid), v) = (h.dims2()?, w.dim(0)?);
    if t == 0 {
        return Ok((
            Tensor::zeros((0, hid), DType::F32, h.device())?,
            Tensor::zeros((v, hid), DType::BF16, h.device())?,
        ));
    }
    // d_hidden: the first vocabulary chunk's GEMM writes it (beta 0); d_w: the GEMMs (one token
    // chunk) or the final cast of their f32 sum write every element.
    let dh = unsafe { dev.alloc::<f32>(t * hid) }?;
    let dw = unsafe { dev.alloc::<bf16>((v * hid).max(1)) }?;
    let hp = tensor_addr::<bf16>(h, "vocab-parallel LM head backward (hidden)")?;
    let wp = tensor_addr::<bf16>(w, "vocab-parallel LM head backward (weight)")?;
    let gp = tensor_addr::<f32>(grad, "vocab-parallel LM head backward (gradient)")?;
    let dims = (t, hid, v, grad.dims());
    let (dho, dwo) = (DhOut::F32(slice_addr(&dh, &dev)), DwOut::Bf16(slice_addr(&dw, &dev)));
    lm_head_bwd_core(
        &dev,
        hp,
        wp,
        gp,
        fwd_out,
        targets,
        chunk_tokens,
        dims,
        dho,
        dwo,
        None,
        gemm,
        v_offset,
    )?;
    Ok((device_tensor(dh, &dev, (t, hid)), device_tensor(dw, &dev, (v, hid))))
}

/// Backward: packed `[d_hidden (flat) ++ d_lm_head (flat)]`, bf16. `grad` is the gradient of the
/// `[T, 3]` forward output (its third column is ignored), `fwd_out` that output.
#[allow(clippy::too_many_arguments)]
pub(crate) fn lm_head_bwd(
    h: &CudaStorage,
    lh: &Layout,
    w: &CudaStorage,
    lw: &Layout,
    grad: &CudaStorage,
    lg: &Layout,
    fwd_out: &Tensor,
    targets: &[u32],
    chunk_tokens: usize,
    gemm: HeadGemm,
) -> Result<(CudaStorage, Shape)> {
    check_bf16("logprobs_entropy backward", &[h.dtype(), w.dtype()])?;
    check_head_grad(grad.dtype(), fwd_out)?;
    let dev = &h.device;
    let (t, hid) = (lh.dims()[0], lh.dims()[1]);
    let v = lw.dims()[0];
    let out = dev.alloc_zeros::<bf16>(t * hid + v * hid)?;
    if t > 0 {
        let hp = addr::<bf16>(h, lh, "logprobs_entropy backward")?;
        let wp = addr::<bf16>(w, lw, "logprobs_entropy backward")?;
        let gp = addr::<f32>(grad, lg, "logprobs_entropy backward")?;
        let dhidden = slice_addr(&out, dev);
        let dw = DwOut::Bf16(dhidden + (t * hid * 2) as u64);
        let dims = (t, hid, v, lg.dims());
        lm_head_bwd_core(
            dev,
            hp,
            wp,
            gp,
            fwd_out,
            targets,
            chunk_tokens,
            dims,
            DhOut::Bf16(dhidden),
            dw,
            None,
            gemm,
            0,
        )?;
    }
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev.clone()),
        Shape::from(t * hid + v * hid),
    ))
}

/// The LM head's backward with `d_lm_head` added into the running f32 sum `dw_sum: [V, H]`
/// (contiguous, owned by the caller) by its GEMMs (beta 1): no bf16 rounding of the weight's
/// gradient, no `[V, H]` buffer of its own. Returns `d_hidden` (bf16 `[T, H]`). `h: [T, H]`,
/// `w: [V, H]` bf16 contiguous, `grad`/`fwd_out` as [`lm_head_bwd`]'s.
#[allow(clippy::too_many_arguments)]
pub(crate) fn lm_head_bwd_into(
    h: &Tensor,
    w: &Tensor,
    grad: &Tensor,
    fwd_out: &Tensor,
    targets: &[u32],
    chunk_tokens: usize,
    dw_sum: &Tensor,
    kept: Option<&Tensor>,
    gemm: HeadGemm,
) -> Result<Tensor> {
    check_bf16("logprobs_entropy backward", &[h.dtype(), w.dtype()])?;
    check_head_grad(grad.dtype(), fwd_out)?;
    let (t, hid) = h.dims2()?;
    let v = w.dim(0)?;
    if dw_sum.dims() != [v, hid] || dw_sum.dtype() != DType::F32 {
        bail!(
            "logprobs_entropy backward: the running sum is {:?} {:?}, the head [{v}, {hid}] needs f32",
            dw_sum.dtype(),
            dw_sum.dims()
        );
    }
    let dev = match h.device() {
        candle_core::Device::Cuda(d) => d.clone(),
        _ => bail!("logprobs_entropy backward: tensors must be on a CUDA device"),
    };
    if t == 0 {
        return Ok(device_tensor(dev.alloc_zeros::<bf16>(1)?, &dev, (0, hid)));
    }
    // Every element is written by the final cast.
    let out = unsafe { dev.alloc::<bf16>(t * hid) }?;
    {
        let hp = tensor_addr::<bf16>(h, "logprobs_entropy backward hidden")?;
        let wp = tensor_addr::<bf16>(w, "logprobs_entropy backward lm_head")?;
        let gp = tensor_addr::<f32>(grad, "logprobs_entropy backward gradient")?;
        let dw = DwOut::F32Sum(tensor_addr::<f32>(dw_sum, "logprobs_entropy backward sum")?);
        let dims = (t, hid, v, grad.dims());
        let kept = match kept {
            Some(k) if k.dims() == [t * v] && k.dtype() == DType::F32 && !gemm.bf16() => {
                Some(tensor_addr::<f32>(k, "logprobs_entropy backward kept logits")?)
            }
            Some(k) if k.dims() == [t * v] && k.dtype() == DType::BF16 && gemm.bf16() => {
                Some(tensor_addr::<bf16>(k, "logprobs_entropy backward kept logits")?)
            }
            Some(k) => bail!(
                "logprobs_entropy backward: kept logits {:?} {:?} for [{t}, {v}]",
                k.dtype(),
                k.dims()
            ),
            None => None,
        };
        lm_head_bwd_core(
            &dev,
            hp,
            wp,
            gp,
            fwd_out,
            targets,
            chunk_tokens,
            dims,
            DhOut::Bf16(slice_addr(&out, &dev)),
            dw,
            kept,
            gemm,
            0,
        )?;
    }
    Ok(device_tensor(out, &dev, (t, hid)))
}

/// The LM head backward's f32 inputs: the output gradient and the saved forward output.
fn check_head_grad(grad: DType, fwd_out: &Tensor) -> Result<()> {
    if grad != DType::F32 || fwd_out.dtype() != DType::F32 {
        bail!("logprobs_entropy backward: the output gradient and saved output must be f32");
    }
    Ok(())
}

/// Where the LM head's backward puts `d_lm_head`: bf16 at this address (written, in f32 first when
/// the tokens take more than one chunk), or added into the f32 sum at this address.
#[derive(Clone, Copy)]
enum DwOut {
    Bf16(u64),
    F32Sum(u64),
}

/// Where the LM head's backward puts `d_hidden`: bf16 (cast from the f32 sum over vocabulary
/// chunks), or that f32 sum itself (a vocabulary shard's share, summed over the shards next).
#[derive(Clone, Copy)]
enum DhOut {
    Bf16(u64),
    F32(u64),
}

/// The chunked GEMMs of the LM head's backward. `dims`: (T, H, V, the gradient's dims); `dhidden`
/// receives `d_hidden` in bf16 (f32-accumulated over vocabulary chunks). `kept`: the forward's
/// logits ([`lm_head_fwd_keep`]), read instead of computed again; the same bits, since the
/// recompute is the same GEMM on the same block. `gemm_kind`: the logits' dtype (f32 or bf16, as
/// the forward's; a batch-invariant forward's backward recomputes f32 logits with cuBLAS).
#[allow(clippy::too_many_arguments)]
fn lm_head_bwd_core(
    dev: &CudaDevice,
    hp: u64,
    wp: u64,
    gp: u64,
    fwd_out: &Tensor,
    targets: &[u32],
    chunk_tokens: usize,
    dims: (usize, usize, usize, &[usize]),
    dhidden: DhOut,
    dw: DwOut,
    kept: Option<u64>,
    gemm_kind: HeadGemm,
    v_offset: usize,
) -> Result<()> {
    let (t, hid, v, gdims) = dims;
    if gdims != [t, 3] || fwd_out.dims() != [t, 3] {
        bail!(
            "logprobs_entropy backward: gradient {:?} / saved output {:?} are not [{t}, 3]",
            gdims,
            fwd_out.dims()
        );
    }
    let fp = tensor_addr::<f32>(fwd_out, "logprobs_entropy backward")?;
    let tg = upload_u32(dev, targets)?;
    let tgp = slice_addr(&tg, dev);
    // d_hidden's f32 sum over vocabulary chunks: the first chunk's GEMM writes it (beta 0), so it
    // needs no zero fill.
    let (_dh_acc, dhp) = match dhidden {
        DhOut::F32(p) => (None, p),
        DhOut::Bf16(_) => {
            let acc = unsafe { dev.alloc::<f32>((t * hid).max(1)) }?;
            let p = slice_addr(&acc, dev);
            (Some(acc), p)
        }
    };
    let rows_max = chunk_tokens.max(1).min(t);
    let vc_max = VOCAB_CHUNK.min(v);
    // The recomputed logits' block (unused when they are kept), f32 or bf16 as the forward's.
    let logits = gemm_kind.alloc(dev, if kept.is_some() { 1 } else { rows_max * vc_max })?;
    let mut kept_at = 0u64;
    let dz = unsafe { dev.alloc::<bf16>(rows_max * vc_max) }?;
    let dzp = slice_addr(&dz, dev);
    // Into bf16, dW is accumulated over token chunks in f32 when there is more than one chunk.
    let dw_acc = match dw {
        DwOut::Bf16(_) if rows_max < t => Some(dev.alloc_zeros::<f32>(v * hid)?),
        _ => None,
    };
    let f_dz = ops_fn(dev, gemm_kind.dlogits_kernel())?;
    for row0 in (0..t).step_by(rows_max) {
        let rows = rows_max.min(t - row0);
        for v0 in (0..v).step_by(vc_max) {
            let vc = vc_max.min(v - v0);
            let wc = wp + (v0 * hid * 2) as u64;
            let hr = hp + (row0 * hid * 2) as u64;
            let lp = match kept {
                Some(base) => {
                    let lp = base + kept_at;
                    kept_at += (rows * vc * gemm_kind.logit_bytes()) as u64;
                    lp
                }
                None => {
                    let lp = logits.addr(dev);
                    let f32_out = !gemm_kind.bf16();
                    unsafe {
                        gemm(dev, true, false, vc, rows, hid, wc, hid, hr, hid, 0.0, lp, f32_out, vc)?;
                    }
                    lp
                }
            };
            let vc_i = vc as i32;
            let v0_i = i32_of("logprobs_entropy backward", "vocabulary offset", v_offset + v0)?;
            let row0_i = row0 as i32;
            launch!(
                dev,
                f_dz,
                cfg(rows as u32, 256),
                [&lp, &vc_i, &v0_i, &tgp, &row0_i, &fp, &gp, &dzp]
            );
            // d_W_c^T [H, vc] (+)= hidden_rows^T [H, rows] . dz [rows, vc]: into the f32 sum
            // (given, or this call's over its chunks) with beta 1, else into bf16 with beta 0.
            let (dw_p, beta, f32_out) = match (dw, &dw_acc) {
                (DwOut::F32Sum(p), _) => (p + (v0 * hid * 4) as u64, 1.0, true),
                (DwOut::Bf16(_), Some(acc)) => (slice_addr(acc, dev) + (v0 * hid * 4) as u64, 1.0, true),
                (DwOut::Bf16(p), None) => (p + (v0 * hid * 2) as u64, 0.0, false),
            };
            unsafe {
                // d_hidden^T [H, rows] (+)= W_c^T [H, vc] . dz^T [vc, rows]
                gemm(
                    dev,
                    false,
                    false,
                    hid,
                    rows,
                    vc,
                    wc,
                    hid,
                    dzp,
                    vc,
                    if v0 == 0 { 0.0 } else { 1.0 },
                    dhp + (row0 * hid * 4) as u64,
                    true,
                    hid,
                )?;
                gemm(
                    dev, false, true, hid, vc, rows, hr, hid, dzp, vc, beta, dw_p, f32_out, hid,
                )?;
            }
        }
    }
    let f = ops_fn(dev, "vime_f32_to_bf16")?;
    if let DhOut::Bf16(dhidden) = dhidden {
        let n_h = (t * hid) as u64;
        launch!(dev, f, cfg(grid_for(t * hid, 256), 256), [&dhp, &dhidden, &n_h]);
    }
    if let (Some(acc), DwOut::Bf16(dwp)) = (&dw_acc, dw) {
        let ap = slice_addr(acc, dev);
        let n_w = (v * hid) as u64;
        launch!(dev, f, cfg(grid_for(v * hid, 256), 256), [&ap, &dwp, &n_w]);
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Flash attention
// ---------------------------------------------------------------------------------------------

/// Launch shapes of flash_attn.cu (its header and `VFA_*` constants): query rows per forward CTA,
/// key rows per backward CTA, threads and dynamic shared memory. The kernels derive their tile
/// from the linear block index, so grid.x must be exactly `ceil(max_len / block)`.
const FLASH_FWD_BLOCK_M: usize = 128;
const FLASH_FWD_THREADS: u32 = 256;
const FLASH_FWD_SMEM: u32 = 163_840;
const FLASH_BWD_BLOCK_N: usize = 64;
const FLASH_BWD_THREADS: u32 = 128;
const FLASH_BWD_SMEM: u32 = 107_520;

/// The forward's softmax statistics, kept by the op for its backward: the flash kernel's
/// log-sum-exp (`[H, Tq]` f32), or, with the forward's cuDNN plan in `.1`, cuDNN's (whose
/// backward then runs on that same plan).
#[derive(Default)]
pub(crate) struct SavedLse(Mutex<Option<(CudaSlice<f32>, Option<crate::cudnn::Plan>)>>);

/// The cuDNN plan for this call if `kernels` asks for cuDNN and the shape fits it; `None` runs
/// the flash kernel. `--attention-backend fused` turns a refusal into an error, `auto` runs flash.
#[cfg(feature = "cudnn")]
fn cudnn_plan(
    kernels: &KernelConfig,
    cu_q: &[u32],
    cu_k: &[u32],
    h: usize,
    hkv: usize,
    d: usize,
) -> Result<Option<crate::cudnn::Plan>> {
    let backend = kernels.attention();
    if !kernels.wants_cudnn() {
        return Ok(None);
    }
    match crate::cudnn::Plan::new(cu_q, cu_k, h, hkv, d) {
        // `auto` leaves L_k > L_q (the built-in engine's KV-cache prefill and decoding, context-
        // parallel chunks) to the flash kernel: cuDNN's bottom-right-masked backward measured no
        // faster than flash, and decoding would build a graph for every new key length bucket.
        Ok(p) if backend == AttentionBackend::Auto && !p.top_left => Ok(None),
        Ok(p) => Ok(Some(p)),
        Err(crate::cudnn::Unsupported(why)) if backend == AttentionBackend::Fused => {
            bail!("varlen_attention: --attention-backend fused (cuDNN) cannot run this call: {why}")
        }
        Err(_) => Ok(None),
    }
}

impl std::fmt::Debug for SavedLse {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SavedLse")
    }
}

struct SeqGrid {
    n: u32,
    max_lq: usize,
    max_lk: usize,
}

fn seq_grid(cu_q: &[u32], cu_k: &[u32]) -> SeqGrid {
    let lens = |cu: &[u32]| cu.windows(2).map(|w| (w[1] - w[0]) as usize).max().unwrap_or(0);
    SeqGrid {
        n: cu_q.len().saturating_sub(1) as u32,
        max_lq: lens(cu_q),
        max_lk: lens(cu_k),
    }
}

fn set_smem(f: &CudaFunction, bytes: u32) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum as Attr;
    if bytes > 48 * 1024 {
        f.set_attribute(Attr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, bytes as i32)
            .w()?;
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_fwd(
    q: &CudaStorage,
    lq: &Layout,
    k: &CudaStorage,
    lk: &Layout,
    v: &CudaStorage,
    lv: &Layout,
    cu_q: &[u32],
    cu_k: &[u32],
    scale: f64,
    kernels: &KernelConfig,
    saved: &SavedLse,
) -> Result<(CudaStorage, Shape)> {
    #[cfg(not(feature = "cudnn"))]
    let _ = kernels;
    check_bf16("varlen_attention", &[q.dtype(), k.dtype(), v.dtype()])?;
    let dev = &q.device;
    let (tq, h) = (lq.dims()[0], lq.dims()[1]);
    if kernels.batch_invariant() {
        let out = dev.alloc_zeros::<bf16>((tq * h * 128).max(1))?;
        let lse = dev.alloc_zeros::<f32>((h * tq).max(1))?;
        bi_attention(q, lq, k, lk, v, lv, cu_q, cu_k, scale, &out, &lse)?;
        // The flash backward reads this log-sum-exp (same layout and base).
        *saved.0.lock().unwrap() = Some((lse, None));
        return Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), lq.shape().clone()));
    }
    #[cfg(feature = "cudnn")]
    if tq > 0 {
        if let Some(plan) = cudnn_plan(kernels, cu_q, cu_k, h, lk.dims()[1], lq.dims()[2])? {
            // cuDNN writes every row of a covering plan: no zero fill (33.5 MB of O a layer at
            // Qwen3-0.6B's 8192 tokens). The flash fallback below gets fresh zeroed buffers.
            let out = attention_buffer::<bf16>(dev, tq * h * 128, plan.covers)?;
            let lse = attention_buffer::<f32>(dev, h * tq, plan.covers)?;
            let ptrs = crate::cudnn::Ptrs {
                q: addr::<bf16>(q, lq, "varlen_attention")?,
                k: addr::<bf16>(k, lk, "varlen_attention")?,
                v: addr::<bf16>(v, lv, "varlen_attention")?,
                o: slice_addr(&out, dev),
                stats: slice_addr(&lse, dev),
                ..Default::default()
            };
            match crate::cudnn::run(dev, &plan, false, false, scale, &ptrs) {
                Ok(()) => {
                    *saved.0.lock().unwrap() = Some((lse, Some(plan)));
                    return Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), lq.shape().clone()));
                }
                Err(e) => kernels.cudnn_failed(e)?,
            }
        }
    }
    let out = dev.alloc_zeros::<bf16>((tq * h * 128).max(1))?;
    let lse = dev.alloc_zeros::<f32>((h * tq).max(1))?;
    let g = seq_grid(cu_q, cu_k);
    if tq > 0 && g.max_lq > 0 {
        let f = flash_fn(dev, "vime_flash_fwd")?;
        set_smem(&f, FLASH_FWD_SMEM)?;
        let cfg = LaunchConfig {
            grid_dim: (g.max_lq.div_ceil(FLASH_FWD_BLOCK_M) as u32, h as u32, g.n),
            block_dim: (FLASH_FWD_THREADS, 1, 1),
            shared_mem_bytes: FLASH_FWD_SMEM,
        };
        launch_attention_fwd(&f, cfg, (q, lq), (k, lk), (v, lv), cu_q, cu_k, scale, &out, &lse)?;
    }
    *saved.0.lock().unwrap() = Some((lse, None));
    Ok((CudaStorage::wrap_cuda_slice(out, dev.clone()), lq.shape().clone()))
}

/// An attention output buffer of `n` elements (at least 1): left unfilled where the kernel writes
/// every element (`written`: cuDNN on a plan that covers every row), zero-filled otherwise.
#[cfg(feature = "cudnn")]
fn attention_buffer<T: DeviceRepr + candle_core::cuda_backend::cudarc::driver::ValidAsZeroBits>(
    dev: &CudaDevice,
    n: usize,
    written: bool,
) -> Result<CudaSlice<T>> {
    if written {
        // SAFETY: plain device memory of a Copy type, all of it written by the kernel before
        // anything reads it.
        unsafe { dev.alloc::<T>(n.max(1)) }
    } else {
        dev.alloc_zeros::<T>(n.max(1))
    }
}

/// Most query heads per kv head `vime_bi_attn` takes (one warp each; `BI_MAXG` in invariant.cu).
const BI_MAX_GROUP: usize = 8;

/// The batch-invariant attention (`vime_bi_attn`) into `out` and `lse` (the flash kernel's
/// layouts), for `--true-on-policy-mode`.
#[allow(clippy::too_many_arguments)]
fn bi_attention(
    q: &CudaStorage,
    lq: &Layout,
    k: &CudaStorage,
    lk: &Layout,
    v: &CudaStorage,
    lv: &Layout,
    cu_q: &[u32],
    cu_k: &[u32],
    scale: f64,
    out: &CudaSlice<bf16>,
    lse: &CudaSlice<f32>,
) -> Result<()> {
    let dev = &q.device;
    let (tq, h) = (lq.dims()[0], lq.dims()[1]);
    let hkv = lk.dims()[1];
    let group = h / hkv.max(1);
    if group == 0 || group > BI_MAX_GROUP || h % hkv != 0 {
        bail!(
            "--true-on-policy-mode: the batch-invariant attention takes 1 to {BI_MAX_GROUP} query heads per kv head, got {h} query and {hkv} kv heads"
        );
    }
    let g = seq_grid(cu_q, cu_k);
    if tq == 0 || g.max_lq == 0 {
        return Ok(());
    }
    if g.max_lq > i32::MAX as usize || g.n > 65_535 {
        bail!(
            "--true-on-policy-mode attention: {} sequences of up to {} queries do not fit the grid",
            g.n,
            g.max_lq
        );
    }
    let f = invariant_fn(dev, "vime_bi_attn")?;
    let c = LaunchConfig {
        grid_dim: (g.max_lq as u32, hkv as u32, g.n),
        block_dim: (32 * group as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    launch_attention_fwd(&f, c, (q, lq), (k, lk), (v, lv), cu_q, cu_k, scale, out, lse)
}

/// Launches an attention forward kernel of the flash kernel's signature (`vime_flash_fwd`,
/// `vime_bi_attn`): q, k, v, out, lse, cu_seqlens_q/k, Tq, H, Hkv, scale.
#[allow(clippy::too_many_arguments)]
fn launch_attention_fwd(
    f: &CudaFunction,
    cfg: LaunchConfig,
    (q, lq): (&CudaStorage, &Layout),
    (k, lk): (&CudaStorage, &Layout),
    (v, lv): (&CudaStorage, &Layout),
    cu_q: &[u32],
    cu_k: &[u32],
    scale: f64,
    out: &CudaSlice<bf16>,
    lse: &CudaSlice<f32>,
) -> Result<()> {
    let dev = &q.device;
    let (tq, h, hkv) = (lq.dims()[0], lq.dims()[1], lk.dims()[1]);
    let (cq, ck) = (upload_u32_cached(dev, cu_q)?, upload_u32_cached(dev, cu_k)?);
    let (qp, kp, vp) = (
        addr::<bf16>(q, lq, "varlen_attention")?,
        addr::<bf16>(k, lk, "varlen_attention")?,
        addr::<bf16>(v, lv, "varlen_attention")?,
    );
    let (op, lp, cqp, ckp) = (
        slice_addr(out, dev),
        slice_addr(lse, dev),
        slice_addr(&*cq, dev),
        slice_addr(&*ck, dev),
    );
    let (tq_i, h_i, hkv_i, scale_f) = (tq as i32, h as i32, hkv as i32, scale as f32);
    launch!(
        dev,
        f,
        cfg,
        [&qp, &kp, &vp, &op, &lp, &cqp, &ckp, &tq_i, &h_i, &hkv_i, &scale_f]
    );
    Ok(())
}

/// Packed `[dq ++ dk ++ dv]`, bf16.
#[allow(clippy::too_many_arguments)]
pub(crate) fn flash_bwd(
    q: &CudaStorage,
    lq: &Layout,
    k: &CudaStorage,
    lk: &Layout,
    v: &CudaStorage,
    lv: &Layout,
    out: &Tensor,
    dout: &Tensor,
    cu_q: &[u32],
    cu_k: &[u32],
    scale: f64,
    kernels: &KernelConfig,
    saved: &SavedLse,
) -> Result<(CudaStorage, Shape)> {
    #[cfg(not(feature = "cudnn"))]
    let _ = kernels;
    check_bf16(
        "varlen_attention backward",
        &[q.dtype(), k.dtype(), v.dtype(), out.dtype(), dout.dtype()],
    )?;
    let dev = &q.device;
    let (tq, h, d) = (lq.dims()[0], lq.dims()[1], lq.dims()[2]);
    let (tk, hkv) = (lk.dims()[0], lk.dims()[1]);
    let (nq, nk) = (tq * h * d, tk * hkv * d);
    let guard = saved.0.lock().unwrap();
    let Some((lse, plan)) = guard.as_ref() else {
        bail!("varlen_attention backward: no saved log-sum-exp (the forward did not run on CUDA)");
    };
    #[cfg(feature = "cudnn")]
    if let Some(plan) = plan {
        // dQ, dK and dV of a covering plan: every row written (67 MB a layer at Qwen3-0.6B).
        let packed = attention_buffer::<bf16>(dev, nq + 2 * nk, plan.covers)?;
        let dqp = slice_addr(&packed, dev);
        let ptrs = crate::cudnn::Ptrs {
            q: addr::<bf16>(q, lq, "varlen_attention backward")?,
            k: addr::<bf16>(k, lk, "varlen_attention backward")?,
            v: addr::<bf16>(v, lv, "varlen_attention backward")?,
            o: tensor_addr::<bf16>(out, "varlen_attention backward (output)")?,
            stats: slice_addr(lse, dev),
            dout: tensor_addr::<bf16>(dout, "varlen_attention backward (output gradient)")?,
            dq: dqp,
            dk: dqp + (nq * 2) as u64,
            dv: dqp + ((nq + nk) * 2) as u64,
        };
        crate::cudnn::run(dev, plan, true, kernels.deterministic(), scale, &ptrs)?;
        return Ok((
            CudaStorage::wrap_cuda_slice(packed, dev.clone()),
            Shape::from(nq + 2 * nk),
        ));
    }
    debug_assert!(plan.is_none(), "a cuDNN plan without the cudnn feature");
    let packed = dev.alloc_zeros::<bf16>((nq + 2 * nk).max(1))?;
    if tq > 0 && tk > 0 {
        let g = seq_grid(cu_q, cu_k);
        let (cq, ck) = (upload_u32_cached(dev, cu_q)?, upload_u32_cached(dev, cu_k)?);
        let (qp, kp, vp) = (
            addr::<bf16>(q, lq, "varlen_attention backward")?,
            addr::<bf16>(k, lk, "varlen_attention backward")?,
            addr::<bf16>(v, lv, "varlen_attention backward")?,
        );
        let (op, dop) = (
            tensor_addr::<bf16>(out, "varlen_attention backward (output)")?,
            tensor_addr::<bf16>(dout, "varlen_attention backward (output gradient)")?,
        );
        let delta = unsafe { dev.alloc::<f32>(h * tq) }?;
        let dq_acc = dev.alloc_zeros::<f32>(nq)?;
        let (deltap, dqap) = (slice_addr(&delta, dev), slice_addr(&dq_acc, dev));
        let (lsep, cqp, ckp) = (slice_addr(lse, dev), slice_addr(&*cq, dev), slice_addr(&*ck, dev));
        let dqp = slice_addr(&packed, dev);
        let dkp = dqp + (nq * 2) as u64;
        let dvp = dkp + (nk * 2) as u64;
        let (tq_i, tk_i, h_i, hkv_i, scale_f) = (tq as i32, tk as i32, h as i32, hkv as i32, scale as f32);
        let f = flash_fn(dev, "vime_flash_bwd_delta")?;
        launch!(
            dev,
            f,
            cfg((tq * h).div_ceil(8) as u32, 256),
            [&op, &dop, &deltap, &tq_i, &h_i]
        );
        let f = flash_fn(dev, "vime_flash_bwd")?;
        set_smem(&f, FLASH_BWD_SMEM)?;
        let cfg3 = LaunchConfig {
            grid_dim: (g.max_lk.div_ceil(FLASH_BWD_BLOCK_N).max(1) as u32, hkv as u32, g.n),
            block_dim: (FLASH_BWD_THREADS, 1, 1),
            shared_mem_bytes: FLASH_BWD_SMEM,
        };
        launch!(
            dev,
            f,
            cfg3,
            [
                &qp, &kp, &vp, &dop, &lsep, &deltap, &dqap, &dkp, &dvp, &cqp, &ckp, &tq_i, &tk_i, &h_i, &hkv_i,
                &scale_f
            ]
        );
        let nq_i = i32_of("varlen_attention", "dq elements", nq)?;
        let f = flash_fn(dev, "vime_flash_dq_convert")?;
        launch!(dev, f, cfg(nq.div_ceil(1024) as u32, 256), [&dqap, &dqp, &nq_i]);
    }
    Ok((
        CudaStorage::wrap_cuda_slice(packed, dev.clone()),
        Shape::from(nq + 2 * nk),
    ))
}

// ---------------------------------------------------------------------------------------------
// AdamW
// ---------------------------------------------------------------------------------------------

/// The f32 constants of one AdamW step, each rounded from f64 once (as candle's `affine` does on
/// the CPU path); mirrors `AdamConsts` in ops.cu.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AdamConsts {
    pub keep: f32,
    pub one_m_b1: f32,
    pub b2: f32,
    pub one_m_b2: f32,
    pub inv_bc2: f32,
    pub eps: f32,
    pub neg_step: f32,
    pub decay: i32,
    /// The gradient is multiplied by `grad_scale` first (clipping) when `scale != 0`.
    pub grad_scale: f32,
    pub scale: i32,
}

unsafe impl DeviceRepr for AdamConsts {}

/// The buffers of one tensor's AdamW update, checked: the addresses, the element count, whether
/// the gradient is bf16 (else f32) and whether every buffer allows the 16-byte kernel.
struct AdamwPtrs {
    p: u64,
    g: u64,
    m: u64,
    v: u64,
    model: u64,
    n: usize,
    g_bf16: bool,
    wide: bool,
}

/// The optimizer-state half of [`AdamwPtrs`], which stays valid as long as its tensors live: the
/// ids of master, moments and model copy (to know it is still theirs), their addresses, the
/// master's shape, and whether they allow the 16-byte kernel.
#[derive(Clone)]
struct AdamwStateRow {
    ids: [Option<candle_core::TensorId>; 4],
    p: u64,
    m: u64,
    v: u64,
    model: u64,
    dims: Vec<usize>,
    wide: bool,
}

fn adamw_state_ids(
    master: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    model: Option<&Tensor>,
) -> [Option<candle_core::TensorId>; 4] {
    [
        Some(master.id()),
        Some(exp_avg.id()),
        Some(exp_avg_sq.id()),
        model.map(Tensor::id),
    ]
}

fn adamw_state_row(
    master: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    model: Option<&Tensor>,
) -> Result<AdamwStateRow> {
    for (what, t) in [("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)] {
        if t.dims() != master.dims() {
            bail!(
                "adamw: {what} {:?} does not match the master weight {:?}",
                t.dims(),
                master.dims()
            );
        }
    }
    for (what, t) in [("master", master), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)] {
        if t.dtype() != DType::F32 {
            bail!("adamw: {what} must be f32, got {:?}", t.dtype());
        }
    }
    if !master.device().is_cuda() {
        bail!("adamw: the fused kernel runs on CUDA tensors");
    }
    let p = tensor_addr::<f32>(master, "adamw master")?;
    let m = tensor_addr::<f32>(exp_avg, "adamw exp_avg")?;
    let v = tensor_addr::<f32>(exp_avg_sq, "adamw exp_avg_sq")?;
    let model_p = match model {
        Some(t) => {
            if t.dims() != master.dims() || t.dtype() != DType::BF16 {
                bail!(
                    "adamw: model copy must be bf16 {:?}, got {:?} {:?}",
                    master.dims(),
                    t.dtype(),
                    t.dims()
                );
            }
            tensor_addr::<bf16>(t, "adamw model")?
        }
        None => 0u64,
    };
    let wide = master.elem_count().is_multiple_of(4)
        && [p, m, v].iter().all(|a| a.is_multiple_of(16))
        && model_p.is_multiple_of(8);
    Ok(AdamwStateRow {
        ids: adamw_state_ids(master, exp_avg, exp_avg_sq, model),
        p,
        m,
        v,
        model: model_p,
        dims: master.dims().to_vec(),
        wide,
    })
}

/// [`AdamwPtrs`] of a state row and this step's gradient (its shape, dtype and address checked).
fn adamw_with_grad(row: &AdamwStateRow, grad: &Tensor) -> Result<AdamwPtrs> {
    if grad.dims() != row.dims.as_slice() {
        bail!(
            "adamw: grad {:?} does not match the master weight {:?}",
            grad.dims(),
            row.dims
        );
    }
    let (g, g_bf16, g_align) = match grad.dtype() {
        DType::F32 => (tensor_addr::<f32>(grad, "adamw grad")?, false, 16),
        DType::BF16 => (tensor_addr::<bf16>(grad, "adamw grad")?, true, 8),
        other => bail!("adamw: gradient dtype {other:?} (f32 or bf16)"),
    };
    Ok(AdamwPtrs {
        p: row.p,
        g,
        m: row.m,
        v: row.v,
        model: row.model,
        n: row.dims.iter().product(),
        g_bf16,
        // Four elements a thread with 16-byte accesses where every buffer allows it (the same bits).
        wide: row.wide && g.is_multiple_of(g_align),
    })
}

fn adamw_ptrs(
    master: &Tensor,
    grad: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    model: Option<&Tensor>,
) -> Result<AdamwPtrs> {
    adamw_with_grad(&adamw_state_row(master, exp_avg, exp_avg_sq, model)?, grad)
}

fn cuda_dev(t: &Tensor, what: &str) -> Result<CudaDevice> {
    match t.device() {
        candle_core::Device::Cuda(d) => Ok(d.clone()),
        _ => bail!("{what}: tensors must be on a CUDA device"),
    }
}

/// One fused AdamW update in place: `master`, `exp_avg`, `exp_avg_sq` (f32, contiguous, one shape)
/// from `grad` (f32 or bf16); `model` (bf16, optional) receives the rounded master.
pub fn adamw_update(
    master: &Tensor,
    grad: &Tensor,
    exp_avg: &Tensor,
    exp_avg_sq: &Tensor,
    model: Option<&Tensor>,
    c: AdamConsts,
) -> Result<()> {
    let a = adamw_ptrs(master, grad, exp_avg, exp_avg_sq, model)?;
    let dev = cuda_dev(master, "adamw")?;
    if a.n == 0 {
        return Ok(());
    }
    let name = if a.g_bf16 {
        "vime_adamw_bf16g"
    } else {
        "vime_adamw_f32g"
    };
    let (name, items) = if a.wide {
        (format!("{name}_v4"), a.n / 4)
    } else {
        (name.to_string(), a.n)
    };
    let (pp, gp, mp, vp, model_p, n64) = (a.p, a.g, a.m, a.v, a.model, a.n as u64);
    let f = ops_fn(&dev, &name)?;
    launch!(
        dev,
        f,
        cfg(grid_for(items, 256).min(132 * 32), 256),
        [&pp, &gp, &mp, &vp, &model_p, &n64, &c]
    );
    Ok(())
}

/// One tensor of [`adamw_update_multi`]: the buffers of [`adamw_update`], and whether its weight
/// decays (`AdamConsts::decay` applies only to tensors that do).
pub struct AdamwTensor<'a> {
    /// For errors: the parameter's name.
    pub name: &'a str,
    pub master: &'a Tensor,
    pub grad: &'a Tensor,
    pub exp_avg: &'a Tensor,
    pub exp_avg_sq: &'a Tensor,
    pub model: Option<&'a Tensor>,
    pub decay: bool,
}

/// Elements a block of `vime_adamw_multi` updates at a time (the kernel's ADAMW_CHUNK).
const ADAMW_CHUNK: usize = 4096;
/// The persistent grid of `vime_adamw_multi`: 4 blocks of 256 an SM on an H200 (132 SMs).
const ADAMW_BLOCKS: usize = 132 * 4;

/// The optimizer-state half of [`adamw_update_multi`]'s table, kept between steps by its caller
/// (one per optimizer): the state buffers' addresses are looked up and checked once, so a step
/// only looks up its gradients. A row is rebuilt when its tensors are no longer the same ones (a
/// loaded state). Without it, building the table after the gradient norm's read took ~0.6 ms of
/// host time at Qwen3-0.6B (310 tensors) with the GPU idle (the 1c65817 timeline).
#[derive(Default)]
pub struct AdamwTable {
    rows: Vec<Option<AdamwStateRow>>,
}

/// [`adamw_update`] of many tensors (all on one CUDA device) in one launch, with the same bits:
/// the per-tensor launches left a gap and a partial last wave each (310 of them in a 0.6B step).
/// Every tensor is checked before anything runs. `table` keeps the state's half of the launch's
/// table for the next step (see [`AdamwTable`]); `ts` in the same order each step.
pub fn adamw_update_multi(ts: &[AdamwTensor<'_>], c: AdamConsts, table: &mut AdamwTable) -> Result<()> {
    match adamw_multi_prepare(ts, table)? {
        Some(l) => l.launch(c),
        None => Ok(()),
    }
}

/// [`adamw_update_multi`]'s launch, prepared: its table built, checked and uploaded (queued), so
/// that only the step's constants are left to give. A caller prepares it while the device is
/// still busy (before it waits for the gradient norm) and launches it once the clipping factor is
/// known: the table's host time then no longer leaves the GPU idle.
pub struct AdamwLaunch {
    dev: CudaDevice,
    segs: CudaSlice<u64>,
    nseg: i32,
    chunks: u64,
}

impl AdamwLaunch {
    /// Queues the update with the step's constants.
    pub fn launch(&self, c: AdamConsts) -> Result<()> {
        let dev = &self.dev;
        let tp = slice_addr(&self.segs, dev);
        let grid = (self.chunks as usize).min(ADAMW_BLOCKS) as u32;
        let f = ops_fn(dev, "vime_adamw_multi")?;
        launch!(dev, f, cfg(grid, 256), [&tp, &self.nseg, &self.chunks, &c]);
        Ok(())
    }
}

/// The table of [`adamw_update_multi`] for `ts` (see [`AdamwLaunch`]); `None` when there is
/// nothing to update.
pub fn adamw_multi_prepare(ts: &[AdamwTensor<'_>], table: &mut AdamwTable) -> Result<Option<AdamwLaunch>> {
    let Some(first) = ts.first() else {
        return Ok(None);
    };
    let dev = cuda_dev(first.master, "adamw_update_multi")?;
    table.rows.resize(ts.len(), None);
    let mut segs: Vec<u64> = Vec::with_capacity(8 * ts.len());
    let mut chunks = 0u64;
    for (t, slot) in ts.iter().zip(table.rows.iter_mut()) {
        let ids = adamw_state_ids(t.master, t.exp_avg, t.exp_avg_sq, t.model);
        if slot.as_ref().is_none_or(|r| r.ids != ids) {
            *slot = Some(
                adamw_state_row(t.master, t.exp_avg, t.exp_avg_sq, t.model)
                    .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", t.name)))?,
            );
        }
        let row = slot.as_ref().expect("set above");
        let a = adamw_with_grad(row, t.grad).map_err(|e| candle_core::Error::Msg(format!("{}: {e}", t.name)))?;
        if !t.grad.device().same_device(first.master.device()) || !t.master.device().same_device(first.master.device())
        {
            bail!(
                "adamw_update_multi: {} is on another device than {}",
                t.name,
                first.name
            );
        }
        if a.n == 0 {
            continue;
        }
        let flags = u64::from(t.decay) | (u64::from(a.g_bf16) << 1) | (u64::from(a.wide) << 2);
        segs.extend([a.p, a.g, a.m, a.v, a.model, a.n as u64, flags, chunks]);
        chunks += a.n.div_ceil(ADAMW_CHUNK) as u64;
    }
    if segs.is_empty() {
        return Ok(None);
    }
    let nseg = i32_of("adamw_update_multi", "tensors", segs.len() / 8)?;
    let segs = dev.cuda_stream().clone_htod(&segs).w()?;
    Ok(Some(AdamwLaunch {
        dev,
        segs,
        nseg,
        chunks,
    }))
}

// ---------------------------------------------------------------------------------------------
// Embedding backward
// ---------------------------------------------------------------------------------------------

/// The positions of `ids` grouped by id (a counting sort, positions increasing within an id) and
/// the offsets of each id's group: id `v`'s positions are `pos[offs[v]..offs[v + 1]]`.
fn group_by_id(ids: &[u32], vocab: usize) -> (Vec<u32>, Vec<u32>) {
    let mut offs = vec![0u32; vocab + 1];
    for &id in ids {
        offs[id as usize + 1] += 1;
    }
    for v in 0..vocab {
        offs[v + 1] += offs[v];
    }
    let mut next = offs.clone();
    let mut pos = vec![0u32; ids.len()];
    for (i, &id) in ids.iter().enumerate() {
        pos[next[id as usize] as usize] = i as u32;
        next[id as usize] += 1;
    }
    (offs, pos)
}

/// See `crate::embedding`: f32 `[vocab, D]` from bf16 `g: [T, D]` (contiguous) and optional bf16
/// `init: [vocab, D]`. The positions are grouped by token id with a counting sort on the host.
pub(crate) fn embedding_backward(ids: &[u32], g: &Tensor, vocab: usize, init: Option<&Tensor>) -> Result<Tensor> {
    let (t, d) = g.dims2()?;
    let dev = match g.device() {
        candle_core::Device::Cuda(dv) => dv.clone(),
        _ => bail!("embedding_backward: tensors must be on a CUDA device"),
    };
    let (offs, pos) = group_by_id(ids, vocab);
    let out = unsafe { dev.alloc::<f32>((vocab * d).max(1)) }?;
    if vocab > 0 && d > 0 {
        let (offs_d, pos_d) = (upload_u32(&dev, &offs)?, upload_u32(&dev, &pos)?);
        let gp = if t > 0 {
            tensor_addr::<bf16>(g, "embedding_backward g")?
        } else {
            0
        };
        let ip = match init {
            Some(i) => tensor_addr::<bf16>(i, "embedding_backward init")?,
            None => 0u64,
        };
        let (op, pp, outp) = (
            slice_addr(&offs_d, &dev),
            slice_addr(&pos_d, &dev),
            slice_addr(&out, &dev),
        );
        let (v_i, d_i) = (
            i32_of("embedding_backward", "vocab", vocab)?,
            i32_of("embedding_backward", "width", d)?,
        );
        let f = ops_fn(&dev, "vime_embed_bwd")?;
        let blocks = vocab.min(132 * 16) as u32;
        launch!(dev, f, cfg(blocks, 256), [&gp, &op, &pp, &ip, &outp, &v_i, &d_i]);
    }
    Ok(device_tensor(out, &dev, (vocab, d)))
}

/// See `crate::embedding::embedding_backward_into`: `acc [vocab, D] += scatter(g)` in place, f32
/// `acc` (contiguous, owned by the caller), bf16 `g: [T, D]` (contiguous). Only the rows of the
/// batch's ids are read and written (a few thousand of ~150k at Qwen3's vocabulary).
pub(crate) fn embedding_backward_acc(ids: &[u32], g: &Tensor, acc: &Tensor) -> Result<()> {
    let (t, d) = g.dims2()?;
    let vocab = acc.dim(0)?;
    let dev = match g.device() {
        candle_core::Device::Cuda(dv) => dv.clone(),
        _ => bail!("embedding_backward: tensors must be on a CUDA device"),
    };
    if t == 0 || d == 0 {
        return Ok(());
    }
    // The ids that occur (increasing) with their position ranges.
    let (count, pos) = group_by_id(ids, vocab);
    let (mut rows, mut offs) = (Vec::new(), vec![0u32]);
    for v in 0..vocab {
        if count[v + 1] > count[v] {
            rows.push(v as u32);
            offs.push(count[v + 1]);
        }
    }
    let (rows_d, offs_d, pos_d) = (
        upload_u32(&dev, &rows)?,
        upload_u32(&dev, &offs)?,
        upload_u32(&dev, &pos)?,
    );
    let gp = tensor_addr::<bf16>(g, "embedding_backward g")?;
    let outp = tensor_addr::<f32>(acc, "embedding_backward sum")?;
    let (rp, op, pp) = (
        slice_addr(&rows_d, &dev),
        slice_addr(&offs_d, &dev),
        slice_addr(&pos_d, &dev),
    );
    let (n_i, d_i) = (
        i32_of("embedding_backward", "rows", rows.len())?,
        i32_of("embedding_backward", "width", d)?,
    );
    let f = ops_fn(&dev, "vime_embed_bwd_acc")?;
    let blocks = rows.len().clamp(1, 132 * 16) as u32;
    launch!(dev, f, cfg(blocks, 256), [&gp, &rp, &op, &pp, &outp, &n_i, &d_i]);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Memory pool
// ---------------------------------------------------------------------------------------------

/// Turns off cudarc's cross-stream event tracking for the device's context. With it on (the
/// default once candle creates its stream), every allocation creates two CUDA events and every
/// launch of a candle op records and waits on an event per buffer argument: several driver calls
/// per op. Turning it off took a 0.6B decode step's forward from 10-11 to 8-9 ms, part of its
/// ~8 ms of host time (`benches/results/2026-12-02-engine-vs-vllm-h200.md`). vime queues all of its work on candle's
/// one stream per device (its kernels, cuBLAS, NCCL, the weight-sync copies), where stream order
/// alone orders every access, so the events buy nothing. Host reads synchronise the stream as
/// before.
pub fn single_stream(device: &candle_core::Device) -> Result<()> {
    if let candle_core::Device::Cuda(d) = device {
        // Safety: see above; no vime code creates a second stream on this context.
        unsafe { d.disable_event_tracking() };
    }
    Ok(())
}

/// Keeps freed device memory cached in the device's stream-ordered pool (release threshold =
/// max) instead of handing it back to the driver at every synchronisation: candle allocates
/// with `cuMemAllocAsync`, and the default threshold (0) unmaps the pool at each host sync (one
/// per micro-batch, for the loss value), so the next step's allocations may map memory again.
/// This is what torch's caching allocator does; the used-memory figure then includes the cache.
/// Its effect on step time was not measured on its own (it landed with other changes, a0c0a1a).
pub fn keep_pool_memory(device: &candle_core::Device) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::{result as drv, sys as drv_sys};
    let candle_core::Device::Cuda(d) = device else {
        return Ok(());
    };
    let ctx = d.cuda_stream().context().clone();
    if !ctx.has_async_alloc() {
        return Ok(());
    }
    ctx.bind_to_thread().w()?;
    let mut threshold: u64 = u64::MAX;
    unsafe {
        let pool = drv::device::get_default_mem_pool(ctx.cu_device()).w()?;
        drv_sys::cuMemPoolSetAttribute(
            pool,
            drv_sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut std::ffi::c_void,
        )
        .result()
        .w()?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Weight gradients
// ---------------------------------------------------------------------------------------------

/// `dy^T x` as f32 `[N, D]` for bf16 `dy: [T, N]`, `x: [T, D]` (contiguous): a linear layer's
/// weight gradient straight out of one cuBLAS GEMM with f32 output, in the weight's `[out, in]`
/// layout, so the f32 gradient buffer needs no separate cast pass.
pub(crate) fn weight_grad_f32(dy: &Tensor, x: &Tensor) -> Result<Tensor> {
    weight_grad_gemm(dy, x, None)
}

/// `acc += dy^T x` in place: `acc: [N, D]` f32 (owned by the caller, contiguous), bf16
/// `dy: [T, N]`, `x: [T, D]` (contiguous): [`weight_grad_f32`]'s GEMM with beta 1.
pub(crate) fn weight_grad_acc_inplace(acc: &Tensor, dy: &Tensor, x: &Tensor) -> Result<()> {
    weight_grad_gemm(dy, x, Some(acc)).map(|_| ())
}

/// The GEMM of [`weight_grad_f32`] (`acc: None`, into a new buffer, beta 0) and
/// [`weight_grad_acc_inplace`] (into `acc`, beta 1); returns the tensor written.
fn weight_grad_gemm(dy: &Tensor, x: &Tensor, acc: Option<&Tensor>) -> Result<Tensor> {
    let (t, n) = dy.dims2()?;
    let (t2, d) = x.dims2()?;
    if t != t2 {
        bail!("weight_grad: dy {:?} and x {:?} differ in rows", dy.dims(), x.dims());
    }
    check_bf16("weight_grad", &[dy.dtype(), x.dtype()])?;
    if let Some(acc) = acc {
        if acc.dims() != [n, d] || acc.dtype() != DType::F32 {
            bail!(
                "weight_grad: the running sum is {:?} {:?}, dy {:?}^T . x {:?} needs f32 [{n}, {d}]",
                acc.dtype(),
                acc.dims(),
                dy.dims(),
                x.dims()
            );
        }
    }
    let dev = match dy.device() {
        candle_core::Device::Cuda(d) => d.clone(),
        _ => bail!("weight_grad: tensors must be on a CUDA device"),
    };
    let run = t > 0 && n > 0 && d > 0;
    let out = match acc {
        Some(acc) => acc.clone(),
        // The GEMM (beta 0, so C is never read) writes every element; only an empty product
        // needs the zero fill (a memset of every weight's f32 gradient per micro-batch otherwise).
        None if run => device_tensor(unsafe { dev.alloc::<f32>(n * d) }?, &dev, (n, d)),
        None => device_tensor(dev.alloc_zeros::<f32>((n * d).max(1))?, &dev, (n, d)),
    };
    if run {
        let (yp, xp, cp) = (
            tensor_addr::<bf16>(dy, "weight_grad dy")?,
            tensor_addr::<bf16>(x, "weight_grad x")?,
            tensor_addr::<f32>(&out, "weight_grad out")?,
        );
        let beta = if acc.is_some() { 1.0 } else { 0.0 };
        // Column-major view: C^T [d, n] = X^T-as-stored [d, t] . (dY-as-stored [n, t])^T.
        unsafe { gemm(&dev, false, true, d, n, t, xp, d, yp, n, beta, cp, true, d)? };
    }
    Ok(out)
}

/// `acc += a . w` in place, bf16: `acc: [T, D]` (owned by the caller, not shared), `a: [T, I]`,
/// `w: [I, D]` (a weight as HF stores it, `[out, in]`), contiguous. One cuBLAS GEMM with beta 1
/// (f32 accumulation, one rounding) instead of a GEMM into a new buffer and an add pass.
pub(crate) fn matmul_acc_inplace(acc: &Tensor, a: &Tensor, w: &Tensor) -> Result<()> {
    let (t, d) = acc.dims2()?;
    let (t2, i) = a.dims2()?;
    let (i2, d2) = w.dims2()?;
    if t != t2 || i != i2 || d != d2 {
        bail!(
            "matmul_acc: acc {:?} != a {:?} . w {:?}",
            acc.dims(),
            a.dims(),
            w.dims()
        );
    }
    check_bf16("matmul_acc", &[acc.dtype(), a.dtype(), w.dtype()])?;
    let dev = match acc.device() {
        candle_core::Device::Cuda(d) => d.clone(),
        _ => bail!("matmul_acc: tensors must be on a CUDA device"),
    };
    if t == 0 || d == 0 || i == 0 {
        return Ok(());
    }
    let (cp, ap, wp) = (
        tensor_addr::<bf16>(acc, "matmul_acc acc")?,
        tensor_addr::<bf16>(a, "matmul_acc a")?,
        tensor_addr::<bf16>(w, "matmul_acc w")?,
    );
    // Column-major: acc^T [d, t] += W-as-stored [d, i] . A-as-stored [i, t].
    unsafe { gemm(&dev, false, false, d, t, i, wp, d, ap, i, 1.0, cp, false, d) }
}

// ---------------------------------------------------------------------------------------------
// Sum of squares (global gradient norm)
// ---------------------------------------------------------------------------------------------

/// Blocks per tensor of the sum-of-squares kernels: fixed, so the summation order (and the bits)
/// never depend on anything but the tensor sizes; 8 per SM of an H200, enough loads in flight to
/// stream at memory bandwidth. `vime_sumsq_multi` runs them as a persistent grid of this many
/// blocks, all resident on an H200 (32 registers, 8 blocks an SM); on a GPU with fewer SMs the
/// same bits come out, more slowly.
const SUMSQ_BLOCKS: usize = 1056;

/// [`crate::widen_into_sums`] on one CUDA device: each `(g, sum)` is a contiguous bf16 gradient
/// and its f32 running sum (same shape, contiguous) or none. Returns the f32 results: each sum
/// itself, updated in place, or a fresh tensor. One launch for all of them.
pub(crate) fn widen_add_multi(items: &[(Tensor, Option<Tensor>)]) -> Result<Vec<Tensor>> {
    let Some((first, _)) = items.first() else {
        return Ok(Vec::new());
    };
    let dev = cuda_dev(first, "widen_into_sums")?;
    let mut segs: Vec<u64> = Vec::with_capacity(4 * items.len());
    let mut outs = Vec::with_capacity(items.len());
    for (g, sum) in items {
        let gp = tensor_addr::<bf16>(g, "widen_into_sums gradient")?;
        let (sp, out) = match sum {
            Some(s) => {
                if s.dims() != g.dims() || s.dtype() != DType::F32 {
                    bail!(
                        "widen_into_sums: the sum is {:?} {:?}, the gradient {:?} needs f32",
                        s.dtype(),
                        s.dims(),
                        g.dims()
                    );
                }
                (tensor_addr::<f32>(s, "widen_into_sums sum")?, s.clone())
            }
            None => {
                // Safety: the kernel writes every element.
                let buf = unsafe { dev.alloc::<f32>(g.elem_count().max(1)) }?;
                (0, device_tensor(buf, &dev, g.shape().clone()))
            }
        };
        let op = tensor_addr::<f32>(&out, "widen_into_sums output")?;
        if g.elem_count() > 0 {
            segs.extend([gp, sp, op, g.elem_count() as u64]);
        }
        outs.push(out);
    }
    if !segs.is_empty() {
        let nseg = i32_of("widen_into_sums", "tensors", segs.len() / 4)?;
        let table = dev.cuda_stream().clone_htod(&segs).w()?;
        let tp = slice_addr(&table, &dev);
        let f = ops_fn(&dev, "vime_widen_add_multi")?;
        launch!(dev, f, cfg(nseg.clamp(1, 65_535) as u32, 256), [&tp, &nseg]);
    }
    Ok(outs)
}

/// `sum(x^2)` in f64 of each tensor (f32 or bf16, contiguous, all on one CUDA device), with a
/// single device-to-host copy for all of them: candle's `sum_all` reduces a whole tensor in one
/// block, which made the gradient norm of a 4B model take seconds.
pub fn sum_squares(ts: &[&Tensor]) -> Result<Vec<f64>> {
    let Some(first) = ts.first() else {
        return Ok(Vec::new());
    };
    let dev = cuda_dev(first, "sum_squares")?;
    // One segment per non-empty tensor, each with the grid its own launch had (bit-equal results);
    // two launches for all of them.
    let mut segs: Vec<u64> = Vec::with_capacity(4 * ts.len());
    let mut slot = Vec::with_capacity(ts.len());
    let mut blocks_total = 0usize;
    for (i, t) in ts.iter().enumerate() {
        let n = t.elem_count();
        if n == 0 {
            continue;
        }
        let (xp, bf) = match t.dtype() {
            DType::F32 => (tensor_addr::<f32>(t, "sum_squares")?, 0u64),
            DType::BF16 => (tensor_addr::<bf16>(t, "sum_squares")?, 1u64),
            other => bail!("sum_squares: dtype {other:?} (f32 or bf16)"),
        };
        let blocks = SUMSQ_BLOCKS.min(n.div_ceil(256));
        // 16-byte loads where the tensor starts at a 16-byte boundary (a view may not).
        let vec = u64::from(xp % 16 == 0);
        segs.extend([
            xp,
            n as u64,
            blocks_total as u64,
            blocks as u64 | (bf << 32) | (vec << 33),
        ]);
        slot.push(i);
        blocks_total += blocks;
    }
    let mut result = vec![0f64; ts.len()];
    if slot.is_empty() {
        return Ok(result);
    }
    if blocks_total > u32::MAX as usize / 2 {
        bail!("sum_squares: {blocks_total} blocks over {} tensors", ts.len());
    }
    let stream = dev.cuda_stream();
    let table = stream.clone_htod(&segs).w()?;
    let partial = unsafe { dev.alloc::<f64>(blocks_total) }?;
    let out = unsafe { dev.alloc::<f64>(slot.len()) }?;
    let (tp, pp, op) = (
        slice_addr(&table, &dev),
        slice_addr(&partial, &dev),
        slice_addr(&out, &dev),
    );
    let nseg = slot.len() as i32;
    let f = ops_fn(&dev, "vime_sumsq_multi")?;
    // Persistent: no more blocks than the largest per-tensor grid (each tensor's logical blocks
    // then map to distinct physical ones).
    let grid = blocks_total.min(SUMSQ_BLOCKS) as u32;
    launch!(dev, f, cfg(grid, 256), [&tp, &nseg, &pp]);
    let f = ops_fn(&dev, "vime_sum_partials_multi")?;
    launch!(dev, f, cfg(slot.len() as u32, 32), [&pp, &tp, &op]);
    for (v, i) in stream.clone_dtoh(&out).w()?.into_iter().zip(slot) {
        result[i] = v;
    }
    Ok(result)
}

/// [`crate::sample::sample_gumbel_logprobs`] on the device: one launch over vocabulary slices
/// (plus a merge when there is more than one), `rows` u32 (and, with `logprobs`, `rows` f32)
/// back to the host.
pub fn sample_gumbel(
    logits: &Tensor,
    seeds: &[u64],
    counters: &[u64],
    inv_t: &[f32],
    logprobs: bool,
) -> Result<(Vec<u32>, Option<Vec<f32>>)> {
    let dev = match logits.device() {
        candle_core::Device::Cuda(d) => d.clone(),
        _ => bail!("sample_gumbel: logits must be on a CUDA device"),
    };
    let (rows, vocab) = logits.dims2()?;
    let x = tensor_addr::<f32>(&logits.contiguous()?, "sample_gumbel")?;
    let stream = dev.cuda_stream();
    let seeds = stream.clone_htod(seeds).w()?;
    let counters = stream.clone_htod(counters).w()?;
    let inv_t = stream.clone_htod(inv_t).w()?;
    let out = dev.alloc_zeros::<u32>(rows)?;
    let lp = if logprobs {
        Some(dev.alloc_zeros::<f32>(rows)?)
    } else {
        None
    };
    let f = ops_fn(&dev, "vime_sample_gumbel")?;
    let v = vocab as i32;
    let (sp, cp, tp, op) = (
        slice_addr(&seeds, &dev),
        slice_addr(&counters, &dev),
        slice_addr(&inv_t, &dev),
        slice_addr(&out, &dev),
    );
    let lpp = lp.as_ref().map_or(0u64, |l| slice_addr(l, &dev));
    // Enough blocks to fill the GPU (one block per row left 131 of 132 SMs idle at batch 1 and
    // took ~0.25 ms a step at batch 64), slices of at least 4096 logits.
    let splits = crate::config::GPU_FILL_BLOCKS
        .div_ceil(rows.max(1))
        .clamp(1, vocab.div_ceil(4096).max(1));
    let chunk = vocab.div_ceil(splits);
    let splits = vocab.div_ceil(chunk.max(1)).max(1);
    let parts = if splits > 1 { rows * splits } else { 1 };
    // Safety: with more than one split every (row, split) of all four is written.
    let (pk, pi, pm, ps) = unsafe {
        (
            dev.alloc::<f32>(parts)?,
            dev.alloc::<i32>(parts)?,
            dev.alloc::<f32>(parts)?,
            dev.alloc::<f32>(parts)?,
        )
    };
    let (pkp, pip, pmp, psp) = (
        slice_addr(&pk, &dev),
        slice_addr(&pi, &dev),
        slice_addr(&pm, &dev),
        slice_addr(&ps, &dev),
    );
    let chunk_i = i32_of("sample_gumbel", "chunk", chunk)?;
    let launch = LaunchConfig {
        grid_dim: (rows as u32, splits as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    launch!(
        dev,
        f,
        launch,
        [&x, &v, &sp, &cp, &tp, &op, &lpp, &chunk_i, &pkp, &pip, &pmp, &psp]
    );
    if splits > 1 {
        let g = ops_fn(&dev, "vime_sample_gumbel_merge")?;
        let s_i = splits as i32;
        launch!(
            dev,
            g,
            cfg(rows as u32, 32),
            [&x, &v, &s_i, &pkp, &pip, &pmp, &psp, &op, &lpp]
        );
    }
    let toks = stream.clone_dtoh(&out).w()?;
    let lps = match &lp {
        Some(l) => Some(stream.clone_dtoh(l).w()?),
        None => None,
    };
    Ok((toks, lps))
}

/// `pool[rows[r]] = src[r]` in place for the rows of `src` (`[n, width]` bf16, contiguous) into
/// `pool` (`[capacity, width]` bf16, contiguous; `rows`: `[n]` u32 on the device, each <
/// capacity, checked by the caller). The KV cache's append.
pub fn rows_write(pool: &Tensor, src: &Tensor, rows: &Tensor) -> Result<()> {
    let dev = match pool.device() {
        candle_core::Device::Cuda(d) => d.clone(),
        _ => bail!("rows_write: the pool must be on a CUDA device"),
    };
    check_bf16("rows_write", &[pool.dtype(), src.dtype()])?;
    let (n, width) = src.dims2()?;
    if pool.dims2()?.1 != width || rows.dims1()? != n {
        bail!(
            "rows_write: pool {:?}, src {:?}, rows {:?}",
            pool.dims(),
            src.dims(),
            rows.dims()
        );
    }
    if n == 0 {
        return Ok(());
    }
    let (pp, sp) = (
        tensor_addr::<bf16>(pool, "rows_write")?,
        tensor_addr::<bf16>(src, "rows_write")?,
    );
    let rp = tensor_addr::<u32>(rows, "rows_write")?;
    let total = (n * width) as u64;
    let w = width as i32;
    let f = ops_fn(&dev, "vime_rows_write_bf16")?;
    launch!(dev, f, cfg(grid_for(n * width, 256), 256), [&pp, &sp, &rp, &total, &w]);
    Ok(())
}

/// Whether a contiguous CUDA tensor's first element sits on a 16-byte boundary (a view into a
/// buffer may not; fresh buffers do).
pub(crate) fn aligned16(t: &Tensor) -> Result<bool> {
    Ok(tensor_addr::<bf16>(t, "aligned16")? % 16 == 0)
}

/// [`crate::rows::index_add_rows`] on the device: `src` `[n, width]` bf16 contiguous and 16-byte
/// aligned, `width % 8 == 0` (checked by the caller), `csr` the destination rows' source lists
/// (`dst_rows + 1` offsets, then the `n` source rows). One thread per 8 elements of a
/// destination row; every row is written (zeros where it has no source).
pub(crate) fn index_add_rows(src: &Tensor, csr: &[u32], dst_rows: usize, width: usize) -> Result<Tensor> {
    let dev = cuda_dev(src, "index_add_rows")?;
    check_bf16("index_add_rows", &[src.dtype()])?;
    let n_out = dst_rows * width;
    // SAFETY: the kernel writes every element (each destination row, sources or not).
    let out = unsafe { dev.alloc::<bf16>(n_out.max(1)) }?;
    if n_out > 0 {
        let sp = tensor_addr::<bf16>(src, "index_add_rows")?;
        let table = upload_u32_cached(&dev, csr)?;
        let (op, cp) = (slice_addr(&out, &dev), slice_addr(&*table, &dev));
        let rows =
            u32::try_from(dst_rows).map_err(|_| candle_core::Error::Msg(format!("index_add_rows: {dst_rows} rows")))?;
        let w8 = i32_of("index_add_rows", "width / 8", width / 8)?;
        let f = ops_fn(&dev, "vime_index_add_rows_bf16")?;
        launch!(dev, f, cfg(grid_for(n_out / 8, 256), 256), [&op, &sp, &cp, &rows, &w8]);
    }
    Ok(device_tensor(out, &dev, (dst_rows, width)))
}

/// The rows [`gather_rows`] takes: on the host (uploaded through the upload cache, so that a
/// layer loop passing the same rows again uploads them once) or on the device (u32).
pub(crate) enum GatherIndex<'a> {
    Host(&'a [u32]),
    Device(&'a Tensor),
}

/// [`crate::rows::gather_rows`] on the device: row `r` of the result is row `idx[r]` of `src`
/// (zeros for an index past its rows), or `None` when the kernel does not take `src` or `idx`
/// (the caller then runs candle's `index_select`). It takes a contiguous bf16, f16 or f32 `src`
/// on a CUDA device with at least one row, rows a whole number of 16-byte words and its first
/// element 16-byte aligned, and host rows or u32 device rows.
pub(crate) fn gather_rows(src: &Tensor, idx: GatherIndex<'_>) -> Result<Option<Tensor>> {
    if !src.device().is_cuda() || src.rank() == 0 || !src.is_contiguous() || src.elem_count() == 0 {
        return Ok(None);
    }
    if let GatherIndex::Device(t) = idx {
        if t.dtype() != DType::U32 {
            return Ok(None);
        }
    }
    match src.dtype() {
        DType::BF16 => gather_rows_t::<bf16>(src, idx),
        DType::F16 => gather_rows_t::<half::f16>(src, idx),
        DType::F32 => gather_rows_t::<f32>(src, idx),
        _ => Ok(None),
    }
}

fn gather_rows_t<T: candle_core::cuda_backend::CudaDType + DeviceRepr>(
    src: &Tensor,
    idx: GatherIndex<'_>,
) -> Result<Option<Tensor>> {
    let src_rows = src.dim(0)?;
    let width = src.elem_count() / src_rows;
    let row_bytes = width * std::mem::size_of::<T>();
    let sp = tensor_addr::<T>(src, "gather_rows")?;
    let (Ok(sr), Ok(w16)) = (u32::try_from(src_rows), u32::try_from(row_bytes / 16)) else {
        return Ok(None);
    };
    if !row_bytes.is_multiple_of(16) || !sp.is_multiple_of(16) {
        return Ok(None);
    }
    let dev = cuda_dev(src, "gather_rows")?;
    let n = match &idx {
        GatherIndex::Host(v) => v.len(),
        GatherIndex::Device(t) => t.dims1()?,
    };
    let mut shape = src.dims().to_vec();
    shape[0] = n;
    // SAFETY: the kernel writes every row of the result (a source row or zeros).
    let out = unsafe { dev.alloc::<T>((n * width).max(1)) }?;
    if n > 0 {
        let rows =
            u32::try_from(n).map_err(|_| candle_core::Error::Msg(format!("gather_rows: {n} rows exceed u32")))?;
        let op = slice_addr(&out, &dev);
        // The uploaded host rows stay alive until the launch is queued (and in the cache after).
        let (ip, _held) = match idx {
            GatherIndex::Host(v) => {
                let up = upload_u32_cached(&dev, v)?;
                (slice_addr(&*up, &dev), Some(up))
            }
            GatherIndex::Device(t) => (tensor_addr::<u32>(t, "gather_rows index")?, None),
        };
        let f = ops_fn(&dev, "vime_gather_rows16")?;
        let threads = (w16 as usize).next_multiple_of(32).clamp(32, 256) as u32;
        let grid = n.min(65_535 * 8) as u32;
        launch!(dev, f, cfg(grid, threads), [&op, &sp, &ip, &rows, &sr, &w16]);
    }
    Ok(Some(device_tensor(out, &dev, shape)))
}

/// [`crate::decode::decode_attention`] on the device: `q: [B, H, 128]` bf16, the pools
/// `[capacity, Hkv x 128]` bf16, `rows` and `meta` (offsets then chunk) u32 on the device
/// (checked by the caller), `max_len` the longest sequence. One split-KV launch over
/// `plan.splits`, plus a merge when there is more than one split (always for `TensorCores`,
/// whose blocks are `VT_SUB` warps' shares of a split: see `cuda/decode.cu`).
#[allow(clippy::too_many_arguments)]
pub fn decode_attention(
    q: &Tensor,
    k_pool: &Tensor,
    v_pool: &Tensor,
    rows: &Tensor,
    cu_k: &Tensor,
    plan: crate::decode::SplitPlan,
    max_len: usize,
    scale: f64,
    kernel: crate::config::DecodeKernel,
) -> Result<Tensor> {
    use crate::config::DecodeKernel;
    let dev = match q.device() {
        candle_core::Device::Cuda(d) => d.clone(),
        _ => bail!("decode_attention: q must be on a CUDA device"),
    };
    check_bf16("decode_attention", &[q.dtype(), k_pool.dtype(), v_pool.dtype()])?;
    let (b, h, d) = q.dims3()?;
    let hkv = k_pool.dims2()?.1 / 128;
    if d != 128 || h % hkv != 0 || !(1..=8).contains(&(h / hkv)) {
        bail!(
            "decode_attention: head_dim 128 and 1-8 query heads per kv head, got q {:?}, pool {:?}",
            q.dims(),
            k_pool.dims()
        );
    }
    let n = b * h * d;
    let run = b > 0 && max_len > 0;
    let out = if run {
        // Safety: every element of `out` is written by the kernel (or the merge) below.
        unsafe { dev.alloc::<bf16>(n) }?
    } else {
        dev.alloc_zeros::<bf16>(n.max(1))?
    };
    if run {
        // The kernel's name letter, its blocks per split and threads per block: the tensor-core
        // kernel is one warp a block and `VT_SUB` (4, `cuda/decode.cu`) blocks a split.
        let (kind, sub, threads) = match kernel {
            DecodeKernel::Registers => ("g", 1, 128),
            DecodeKernel::Pipelined => ("p", 1, 128),
            DecodeKernel::TensorCores => ("t", 4, 32),
        };
        let splits = plan.splits * sub;
        let (part_o, part_lse) = if splits > 1 {
            // Safety: the kernel writes every (row, split) of both.
            unsafe {
                (
                    dev.alloc::<f32>(b * h * splits * 128)?,
                    dev.alloc::<f32>(b * h * splits)?,
                )
            }
        } else {
            (dev.alloc_zeros::<f32>(1)?, dev.alloc_zeros::<f32>(1)?)
        };
        let qc = q.contiguous()?;
        let (qp, kp, vp) = (
            tensor_addr::<bf16>(&qc, "decode_attention")?,
            tensor_addr::<bf16>(k_pool, "decode_attention")?,
            tensor_addr::<bf16>(v_pool, "decode_attention")?,
        );
        let (rp, cp) = (
            tensor_addr::<u32>(rows, "decode_attention")?,
            tensor_addr::<u32>(cu_k, "decode_attention")?,
        );
        let (op, pop, plp) = (
            slice_addr(&out, &dev),
            slice_addr(&part_o, &dev),
            slice_addr(&part_lse, &dev),
        );
        let (h_i, hkv_i) = (h as i32, hkv as i32);
        let scale_log2 = (scale * std::f64::consts::LOG2_E) as f32;
        let f = decode_fn(&dev, &format!("vime_decode_attn_{kind}{}", h / hkv))?;
        let launch = LaunchConfig {
            grid_dim: (splits as u32, hkv as u32, b as u32),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(
            dev,
            f,
            launch,
            [&qp, &kp, &vp, &rp, &cp, &op, &pop, &plp, &h_i, &hkv_i, &scale_log2]
        );
        if splits > 1 {
            let f = decode_fn(&dev, "vime_decode_combine")?;
            let s_i = splits as i32;
            launch!(dev, f, cfg((b * h) as u32, 128), [&pop, &plp, &op, &s_i]);
        }
    }
    Ok(device_tensor(out, &dev, (b, h, d)))
}

/// Tokens from which [`qk_norm_rope`] runs a warp per token rather than per head row.
pub const QK_NORM_ROPE_TOKEN_WARPS: usize = 1024;

/// [`crate::rope::qk_norm_rope`] on the device: contiguous bf16 `q: [t, hq, 128]`,
/// `k: [t, hk, 128]`, norm weights `[128]`; one launch.
#[allow(clippy::too_many_arguments)]
pub(crate) fn qk_norm_rope(
    q: &Tensor,
    k: &Tensor,
    wq: &Tensor,
    wk: &Tensor,
    positions: &[u32],
    positions_dev: Option<&Tensor>,
    eps: f64,
    theta: f64,
) -> Result<(Tensor, Tensor)> {
    let dev = match q.device() {
        candle_core::Device::Cuda(d) => d.clone(),
        _ => bail!("qk_norm_rope: q must be on a CUDA device"),
    };
    check_bf16("qk_norm_rope", &[q.dtype(), k.dtype(), wq.dtype(), wk.dtype()])?;
    let (t, hq, _) = q.dims3()?;
    let hk = k.dims3()?.1;
    let (nq, nk) = (t * hq * 128, t * hk * 128);
    // Safety: the kernel writes every element of both.
    let (qo, ko) = unsafe { (dev.alloc::<bf16>(nq.max(1))?, dev.alloc::<bf16>(nk.max(1))?) };
    if t > 0 {
        // Device positions (a captured graph's input buffer) or this call's, uploaded.
        let pos = match positions_dev {
            Some(_) => None,
            None => Some(upload_u32_cached(&dev, positions)?),
        };
        let pp = match (positions_dev, &pos) {
            (Some(p), _) => tensor_addr::<u32>(p, "qk_norm_rope")?,
            (None, Some(p)) => slice_addr(&**p, &dev),
            (None, None) => unreachable!("uploaded above"),
        };
        let (q, qs) = head_rows(q)?;
        let (k, ks) = head_rows(k)?;
        let (qp, kp, wqp, wkp) = (
            strided_addr::<bf16>(&q, "qk_norm_rope")?,
            strided_addr::<bf16>(&k, "qk_norm_rope")?,
            tensor_addr::<bf16>(wq, "qk_norm_rope")?,
            tensor_addr::<bf16>(wk, "qk_norm_rope")?,
        );
        let (qs, ks) = (qs as i64, ks as i64);
        let (qop, kop) = (slice_addr(&qo, &dev), slice_addr(&ko, &dev));
        let (t_i, hq_i, hk_i) = (i32_of("qk_norm_rope", "tokens", t)?, hq as i32, hk as i32);
        let (eps_f, theta_f) = (eps as f32, theta as f32);
        // Many tokens (a training or prefill batch): a warp a token, each angle's sincos once for
        // all its heads; few (decoding): a warp a head row, for parallelism. The same bits.
        let (name, rows) = if t >= QK_NORM_ROPE_TOKEN_WARPS {
            ("vime_qk_norm_rope_tok", t)
        } else {
            ("vime_qk_norm_rope", t * (hq + hk))
        };
        let f = ops_fn(&dev, name)?;
        let grid = rows.div_ceil(RMSW_WARPS).clamp(1, 65_535) as u32;
        launch!(
            dev,
            f,
            cfg(grid, (32 * RMSW_WARPS) as u32),
            [&qp, &kp, &wqp, &wkp, &pp, &qop, &kop, &t_i, &hq_i, &hk_i, &eps_f, &theta_f, &qs, &ks]
        );
    }
    Ok((
        device_tensor(qo, &dev, (t, hq, 128)),
        device_tensor(ko, &dev, (t, hk, 128)),
    ))
}

/// [`crate::rope::qk_norm_rope_backward`] on the device: `gq: [t, hq, 128]`, `gk: [t, hk, 128]`
/// (the gradients of the rotated outputs), `xq`/`xk` the norms' inputs (head views of wider rows
/// are read in place), weights `[128]`, all bf16. Returns `(dq, dk, dwq, dwk)`: one launch for
/// both inputs' gradients and the weights' partials, then one column sum each.
#[allow(clippy::too_many_arguments)]
pub(crate) fn qk_norm_rope_bwd(
    gq: &Tensor,
    gk: &Tensor,
    xq: &Tensor,
    xk: &Tensor,
    wq: &Tensor,
    wk: &Tensor,
    positions: &[u32],
    eps: f64,
    theta: f64,
) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
    let dev = match gq.device() {
        candle_core::Device::Cuda(d) => d.clone(),
        _ => bail!("qk_norm_rope backward: tensors must be on a CUDA device"),
    };
    let what = "qk_norm_rope backward";
    check_bf16(
        what,
        &[gq.dtype(), gk.dtype(), xq.dtype(), xk.dtype(), wq.dtype(), wk.dtype()],
    )?;
    let (t, hq, _) = gq.dims3()?;
    let hk = gk.dims3()?.1;
    let (nq, nk) = (t * hq * 128, t * hk * 128);
    let blocks = t.div_ceil(RMSW_WARPS).clamp(1, 132 * 4);
    // Safety: the kernel writes every element of dq, dk and both partials.
    let (dq, dk, part) = unsafe {
        (
            dev.alloc::<bf16>(nq.max(1))?,
            dev.alloc::<bf16>(nk.max(1))?,
            dev.alloc::<f32>(2 * blocks * 128)?,
        )
    };
    // Written by the column sums below; zeros only when there are no tokens.
    let (dwq, dwk) = if t > 0 {
        unsafe { (dev.alloc::<bf16>(128)?, dev.alloc::<bf16>(128)?) }
    } else {
        (dev.alloc_zeros::<bf16>(128)?, dev.alloc_zeros::<bf16>(128)?)
    };
    if t > 0 {
        let pos = upload_u32_cached(&dev, positions)?;
        let (gq, gk) = (gq.contiguous()?, gk.contiguous()?);
        let (xq, qs) = head_rows(xq)?;
        let (xk, ks) = head_rows(xk)?;
        let (wq, wk) = (wq.contiguous()?, wk.contiguous()?);
        let (gqp, gkp, xqp, xkp, wqp, wkp) = (
            tensor_addr::<bf16>(&gq, what)?,
            tensor_addr::<bf16>(&gk, what)?,
            strided_addr::<bf16>(&xq, what)?,
            strided_addr::<bf16>(&xk, what)?,
            tensor_addr::<bf16>(&wq, what)?,
            tensor_addr::<bf16>(&wk, what)?,
        );
        let pp = slice_addr(&*pos, &dev);
        let (dqp, dkp, partp) = (slice_addr(&dq, &dev), slice_addr(&dk, &dev), slice_addr(&part, &dev));
        let partk = partp + (blocks * 128 * 4) as u64;
        let (qs, ks) = (qs as i64, ks as i64);
        let (t_i, hq_i, hk_i) = (i32_of(what, "tokens", t)?, hq as i32, hk as i32);
        let (eps_f, theta_f) = (eps as f32, theta as f32);
        let f = ops_fn(&dev, "vime_qk_norm_rope_bwd_tok")?;
        launch!(
            dev,
            f,
            cfg(blocks as u32, (32 * RMSW_WARPS) as u32),
            [
                &gqp, &gkp, &xqp, &xkp, &wqp, &wkp, &pp, &dqp, &dkp, &partp, &partk, &t_i, &hq_i, &hk_i, &eps_f,
                &theta_f, &qs, &ks
            ]
        );
        colsum(&dev, partp, slice_addr(&dwq, &dev), blocks, 128)?;
        colsum(&dev, partk, slice_addr(&dwk, &dev), blocks, 128)?;
    }
    Ok((
        device_tensor(dq, &dev, (t, hq, 128)),
        device_tensor(dk, &dev, (t, hk, 128)),
        device_tensor(dwq, &dev, 128),
        device_tensor(dwk, &dev, 128),
    ))
}

/// [`crate::rows::write_rows2`] on the device: both pools `[capacity, width]`, both sources
/// `[n, width]` (bf16, contiguous), `rows: [n]` u32 on the device; one launch.
pub fn rows_write2(k_pool: &Tensor, v_pool: &Tensor, k: &Tensor, v: &Tensor, rows: &Tensor) -> Result<()> {
    let dev = match k_pool.device() {
        candle_core::Device::Cuda(d) => d.clone(),
        _ => bail!("rows_write2: the pools must be on a CUDA device"),
    };
    check_bf16("rows_write2", &[k_pool.dtype(), v_pool.dtype(), k.dtype(), v.dtype()])?;
    let (k, n, width, k_stride) = pool_rows(k)?;
    let (v, nv, wv, v_stride) = pool_rows(v)?;
    if (nv, wv) != (n, width) || k_pool.dims2()?.1 != width {
        bail!(
            "rows_write2: pool {:?}, sources of {n} x {width} and {nv} x {wv}",
            k_pool.dims()
        );
    }
    if n == 0 {
        return Ok(());
    }
    let (pk, pv, sk, sv) = (
        tensor_addr::<bf16>(k_pool, "rows_write2")?,
        tensor_addr::<bf16>(v_pool, "rows_write2")?,
        strided_addr::<bf16>(&k, "rows_write2")?,
        strided_addr::<bf16>(&v, "rows_write2")?,
    );
    let rp = tensor_addr::<u32>(rows, "rows_write2")?;
    let total = (n * width) as u64;
    let w = width as i32;
    let (ks, vs) = (k_stride as i64, v_stride as i64);
    let f = ops_fn(&dev, "vime_rows_write2_bf16")?;
    launch!(
        dev,
        f,
        cfg(grid_for(2 * n * width, 256), 256),
        [&pk, &pv, &sk, &sv, &rp, &total, &w, &ks, &vs]
    );
    Ok(())
}

/// `t` as rows the kernels can read in place: `[n, h, d]` with strides `(s, d, 1)` (a view of
/// heads within wider rows, e.g. of the fused q|k|v projection) gives itself and `s`; any other
/// layout a contiguous copy and `h * d`.
fn head_rows(t: &Tensor) -> Result<(Tensor, usize)> {
    let (_, h, d) = t.dims3()?;
    let st = t.stride();
    if st[2] == 1 && (st[1] == d || h == 1) {
        return Ok((t.clone(), st[0]));
    }
    Ok((t.contiguous()?, h * d))
}

/// `t` (`[n, width]`, or `[n, h, d]` as `[n, h x d]`) as rows of `width` elements `stride`
/// apart: in place when each row is contiguous, else a contiguous copy.
fn pool_rows(t: &Tensor) -> Result<(Tensor, usize, usize, usize)> {
    let st = t.stride().to_vec();
    match *t.dims() {
        [n, w] if st[1] == 1 => Ok((t.clone(), n, w, st[0])),
        [n, h, d] if st[2] == 1 && (st[1] == d || h == 1) => Ok((t.clone(), n, h * d, st[0])),
        [n, ref rest @ ..] => {
            let w: usize = rest.iter().product();
            Ok((t.contiguous()?, n, w, w))
        }
        [] => bail!("rows_write2: a scalar source"),
    }
}

/// [`crate::swiglu::swiglu_packed`] on the device: `gu: [t, 2 x inter]` bf16, contiguous.
pub fn swiglu_packed(gu: &Tensor) -> Result<Tensor> {
    let dev = match gu.device() {
        candle_core::Device::Cuda(d) => d.clone(),
        _ => bail!("swiglu_packed: gu must be on a CUDA device"),
    };
    check_bf16("swiglu_packed", &[gu.dtype()])?;
    let gu = gu.contiguous()?;
    let (t, two) = gu.dims2()?;
    let inter = two / 2;
    // Safety: the kernel writes every element.
    let y = unsafe { dev.alloc::<bf16>((t * inter).max(1))? };
    if t * inter > 0 {
        let (gp, yp) = (tensor_addr::<bf16>(&gu, "swiglu_packed")?, slice_addr(&y, &dev));
        let (t_u, i_i) = (t, i32_of("swiglu_packed", "intermediate", inter)?);
        let f = ops_fn(&dev, "vime_swiglu_packed")?;
        launch!(dev, f, cfg(grid_for(t * inter, 256), 256), [&gp, &yp, &t_u, &i_i]);
    }
    Ok(device_tensor(y, &dev, (t, inter)))
}

/// Writes `src` into the contiguous u32 device tensor `dst` from element `offset`, on its
/// device's stream (after the work queued before, before the work queued after). A captured
/// graph's input buffers keep their addresses: this is how each replay reads its step's values.
pub fn write_u32(dst: &Tensor, offset: usize, src: &[u32]) -> Result<()> {
    let dev = match dst.device() {
        candle_core::Device::Cuda(d) => d.clone(),
        _ => bail!("write_u32: the destination must be on a CUDA device"),
    };
    if dst.dtype() != DType::U32 || !dst.is_contiguous() || offset + src.len() > dst.elem_count() {
        bail!(
            "write_u32: {} values at {offset} into {:?} {:?}",
            src.len(),
            dst.dims(),
            dst.dtype()
        );
    }
    if src.is_empty() {
        return Ok(());
    }
    let p = tensor_addr::<u32>(dst, "write_u32")? + 4 * offset as u64;
    let stream = dev.cuda_stream();
    stream.context().bind_to_thread().w()?;
    // Safety: `p .. p + 4 len` lies inside `dst` (checked above); a pageable source is staged
    // by the driver before the call returns, so `src` may go away after it.
    unsafe { candle_core::cuda_backend::cudarc::driver::result::memcpy_htod_async(p, src, stream.cu_stream()) }.w()?;
    Ok(())
}

/// Work on a device's stream, captured once and replayed with [`DeviceGraph::launch`]: one
/// launch instead of one per kernel. The graph reads and writes the addresses it was captured
/// with; inputs change between replays only through buffers written in place ([`write_u32`],
/// `slice_set`).
pub struct DeviceGraph {
    graph: candle_core::cuda_backend::cudarc::driver::CudaGraph,
}

impl DeviceGraph {
    /// Queues one replay on the stream it was captured from.
    pub fn launch(&self) -> Result<()> {
        self.graph.launch().w()
    }
}

/// Runs `f` once (for real: its result is returned), then again under stream capture (nothing
/// executes; the kernels it queues become the graph). Both runs keep candle's small host
/// uploads (kernel layout parameters) in candle's capture cache, so that the captured run
/// reuses the first run's device copies instead of copying from the host, which a capture
/// cannot do. `f` must be the same work both times, must not read results back to the host,
/// and must drop every tensor it creates except those it writes into buffers that outlive it:
/// a graph owns the memory allocated inside it, and all of it is freed inside it.
///
/// The outer error is the first run's; the inner one says why there is no graph (the work is
/// done either way, so a caller can go on without graphs).
pub fn run_and_capture<R, E: From<candle_core::Error>>(
    device: &candle_core::Device,
    mut f: impl FnMut() -> std::result::Result<R, E>,
) -> std::result::Result<(R, std::result::Result<DeviceGraph, E>), E> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let dev = match device {
        candle_core::Device::Cuda(d) => d.clone(),
        _ => return Err(candle_core::Error::Msg("run_and_capture: CUDA graphs need a CUDA device".into()).into()),
    };
    let _cache = dev.enable_cuda_graph_htod_cache();
    let out = f()?;
    let stream = dev.cuda_stream();
    let graph = (|| -> std::result::Result<DeviceGraph, E> {
        stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .w()?;
        let captured = f().map(drop);
        // End the capture whatever happened, so that the stream is usable again.
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        captured?;
        let graph = graph
            .w()?
            .ok_or_else(|| candle_core::Error::Msg("run_and_capture: the capture recorded nothing".into()))?;
        Ok(DeviceGraph { graph })
    })();
    Ok((out, graph))
}
