//! Device memory for the CUDA transports (feature `cuda`): bucket buffers from plain `cuMemAlloc`
//! (candle's stream-ordered pool cannot be exported through `cuIpcGetMemHandle`), their IPC handles,
//! the receiver's mapping of a handle, device-to-device copies on candle's stream, and a bounded
//! wait for a stream.
//!
//! Decisions:
//! - Every copy runs on the stream of the tensor's candle device, so it is ordered with the
//!   compute that produced (sender) or will read (receiver) the weights, with no extra sync.
//! - The sender synchronizes its stream before it hands a handle out (the receiver is another
//!   process and cannot wait on our stream); the receiver synchronizes before it answers, which is
//!   the acknowledgement that lets the sender reuse the buffer.
//! - A buffer lives until dropped (`cuMemFree`); a mapping until dropped (`cuIpcCloseMemHandle`).
use anyhow::{anyhow, bail, Context, Result};
use candle_core::cuda_backend::cudarc::driver::{result, sys, CudaContext, CudaStream, DevicePtr};
use candle_core::cuda_backend::{CudaDevice, CudaStorageSlice};
use candle_core::{Device, Storage, Tensor};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `CU_IPC_HANDLE_SIZE`.
pub const IPC_HANDLE_BYTES: usize = 64;

fn cuda(e: impl std::fmt::Debug, what: &str) -> anyhow::Error {
    anyhow!("CUDA {what}: {e:?}")
}

pub fn cuda_device(d: &Device) -> Result<&CudaDevice> {
    match d {
        Device::Cuda(c) => Ok(c),
        other => bail!("expected a CUDA device, got {other:?}"),
    }
}

/// Device address of a contiguous tensor's first element, and its size in bytes.
pub fn tensor_address(t: &Tensor) -> Result<(u64, usize)> {
    let (storage, layout) = t.storage_and_layout();
    if !layout.is_contiguous() {
        bail!("tensor of shape {:?} is not contiguous", t.dims());
    }
    let Storage::Cuda(s) = &*storage else {
        bail!("tensor of shape {:?} is not on a CUDA device", t.dims());
    };
    let stream = s.device.cuda_stream();
    macro_rules! base {
        ($($v:ident),*) => {
            match &s.slice {
                $(CudaStorageSlice::$v(x) => x.device_ptr(&stream).0,)*
                _ => bail!("dtype {:?} is not streamed", t.dtype()),
            }
        };
    }
    let base = base!(U8, U32, I16, I32, I64, BF16, F16, F32, F64);
    let elem = t.dtype().size_in_bytes();
    Ok((base + (layout.start_offset() * elem) as u64, t.elem_count() * elem))
}

/// `n` bytes from `src` to `dst` on `stream` (asynchronous).
///
/// # Safety
/// Both ranges must be live device memory of this context for as long as the copy runs.
pub unsafe fn copy_dtod(dst: u64, src: u64, n: usize, stream: &CudaStream) -> Result<()> {
    stream.context().bind_to_thread().map_err(|e| cuda(e, "bind context"))?;
    result::memcpy_dtod_async(dst, src, n, stream.cu_stream()).map_err(|e| cuda(e, "memcpy device to device"))
}

/// Waits until everything queued on `stream` so far has run, or `deadline` passes.
pub fn wait_stream(stream: &CudaStream, deadline: Duration, what: &str) -> Result<()> {
    let ev = stream.record_event(None).map_err(|e| cuda(e, "record event"))?;
    let t0 = Instant::now();
    loop {
        if ev.try_is_complete().map_err(|e| cuda(e, what))? {
            return Ok(());
        }
        if t0.elapsed() > deadline {
            bail!("{what}: the GPU work did not finish within {deadline:?}");
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// The 16-byte UUID of the device, as lowercase hex (`nvidia-smi -L` without the dashes).
pub fn device_uuid(d: &CudaDevice) -> Result<String> {
    let ctx = d.cuda_stream().context().clone();
    let u = ctx.uuid().map_err(|e| cuda(e, "device uuid"))?;
    Ok(u.bytes.iter().map(|b| format!("{:02x}", *b as u8)).collect())
}

/// A bucket buffer from `cuMemAlloc`, exportable to another process on the same GPU.
pub struct IpcBuffer {
    ptr: sys::CUdeviceptr,
    nbytes: usize,
    handle: [u8; IPC_HANDLE_BYTES],
    ctx: Arc<CudaContext>,
}

impl IpcBuffer {
    pub fn new(d: &CudaDevice, nbytes: usize) -> Result<Self> {
        let ctx = d.cuda_stream().context().clone();
        ctx.bind_to_thread().map_err(|e| cuda(e, "bind context"))?;
        let ptr = unsafe { result::malloc_sync(nbytes.max(1)) }
            .map_err(|e| cuda(e, &format!("cuMemAlloc of a {nbytes}-byte sync buffer")))?;
        let mut h = std::mem::MaybeUninit::<sys::CUipcMemHandle>::uninit();
        let r = unsafe { sys::cuIpcGetMemHandle(h.as_mut_ptr(), ptr) };
        if r != sys::CUresult::CUDA_SUCCESS {
            unsafe {
                let _ = result::free_sync(ptr);
            }
            return Err(cuda(r, "cuIpcGetMemHandle"));
        }
        let h = unsafe { h.assume_init() };
        let mut handle = [0u8; IPC_HANDLE_BYTES];
        for (o, c) in handle.iter_mut().zip(h.reserved.iter()) {
            *o = *c as u8;
        }
        Ok(Self {
            ptr,
            nbytes,
            handle,
            ctx,
        })
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    pub fn nbytes(&self) -> usize {
        self.nbytes
    }

    pub fn handle(&self) -> &[u8; IPC_HANDLE_BYTES] {
        &self.handle
    }
}

impl Drop for IpcBuffer {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        unsafe {
            let _ = result::free_sync(self.ptr);
        }
    }
}

/// Another process's [`IpcBuffer`], opened on this process's context.
pub struct IpcMapping {
    ptr: sys::CUdeviceptr,
    ctx: Arc<CudaContext>,
}

impl IpcMapping {
    pub fn open(d: &CudaDevice, handle: &[u8]) -> Result<Self> {
        if handle.len() != IPC_HANDLE_BYTES {
            bail!("a CUDA IPC handle is {IPC_HANDLE_BYTES} bytes, got {}", handle.len());
        }
        let ctx = d.cuda_stream().context().clone();
        ctx.bind_to_thread().map_err(|e| cuda(e, "bind context"))?;
        let mut h = sys::CUipcMemHandle {
            reserved: [0; IPC_HANDLE_BYTES],
        };
        for (o, c) in h.reserved.iter_mut().zip(handle) {
            *o = *c as _;
        }
        let mut ptr: sys::CUdeviceptr = 0;
        let r = unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as std::ffi::c_uint,
            )
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(cuda(
                r,
                "cuIpcOpenMemHandle (is the sender alive, and on this machine?)",
            ));
        }
        Ok(Self { ptr, ctx })
    }

    pub fn ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        unsafe {
            let _ = sys::cuIpcCloseMemHandle(self.ptr);
        }
    }
}

/// Copies each tensor (contiguous, on `d`) to `base + offset`.
pub fn pack_device(d: &CudaDevice, base: u64, parts: &[(&Tensor, usize)]) -> Result<()> {
    let stream = d.cuda_stream();
    for (t, off) in parts {
        let (src, n) = tensor_address(t)?;
        unsafe { copy_dtod(base + *off as u64, src, n, &stream) }?;
    }
    Ok(())
}

/// Copies `base + offset` into each (existing, contiguous) tensor on `d`: the receiver's in-place
/// load.
pub fn unpack_device(d: &CudaDevice, base: u64, parts: &[(&Tensor, usize)]) -> Result<()> {
    let stream = d.cuda_stream();
    for (t, off) in parts {
        let (dst, n) = tensor_address(t).with_context(|| format!("receiving tensor {:?}", t.dims()))?;
        unsafe { copy_dtod(dst, base + *off as u64, n, &stream) }?;
    }
    Ok(())
}

/// Bytes in use on the device, by every process (`cuMemGetInfo`: total - free).
pub fn device_memory_used(d: &CudaDevice) -> Result<u64> {
    let (free, total) = device_memory_info(d)?;
    Ok(total - free)
}

/// `(free, total)` bytes of `d`'s memory (`cuMemGetInfo`).
pub fn device_memory_info(d: &CudaDevice) -> Result<(u64, u64)> {
    d.cuda_stream()
        .context()
        .bind_to_thread()
        .map_err(|e| cuda(e, "bind context"))?;
    let (free, total) = result::mem_get_info().map_err(|e| cuda(e, "cuMemGetInfo"))?;
    Ok((free as u64, total as u64))
}

/// [`device_memory_used`] of `d` in GB, or `None` off the GPU.
pub fn device_memory_used_gb(d: &Device) -> Option<f64> {
    match d {
        Device::Cuda(c) => device_memory_used(c).ok().map(|b| b as f64 / 1e9),
        _ => None,
    }
}
