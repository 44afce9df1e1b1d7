//! The engine's side of a weight sync (vime-serve's `/init_weight_transfer_engine`,
//! `/start_weight_update`, `/update_weights`, `/finish_weight_update`): checks each request, gets
//! the bucket's bytes over the transport, and hands the tensors to the engine.
//!
//! Decisions:
//! - A receiver owns its transport state (the sync group, the IPC mappings), which NCCL does not
//!   let move between threads: vime-serve runs it on a thread of its own.
//! - Unknown keys in `init_info` / `update_info` are refused (vLLM's pydantic models forbid them),
//!   and so is a call out of order (an update before init or outside start..finish).
//! - CUDA receive paths (IPC and NCCL) copy the bucket straight into the engine's own parameter
//!   memory when the dtypes match ([`WeightSink::with_targets`]); otherwise, and on the CPU, the
//!   bucket is cut into tensors and loaded by name ([`WeightSink::load`]).
//! - IPC mappings are opened once per handle and kept until the next init (the sender keeps its
//!   two buffers for its whole life), so a sync opens no handle after the first.
use crate::pack::BucketMeta;
use crate::sender::Rendezvous;
use anyhow::{anyhow, bail, ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};
use std::collections::BTreeSet;
#[cfg(feature = "cuda")]
use std::collections::HashMap;
use std::time::Duration;
use vime_dist::Collectives;

/// Where the received tensors go (the engine).
pub trait WeightSink {
    fn device(&self) -> Device;
    /// Loads new values for some parameters, by HF name (one bucket); names and shapes are checked
    /// before anything is written.
    fn load(&self, tensors: Vec<(String, Tensor)>) -> Result<()>;
    /// Runs `f` on the engine's own parameter tensors of `names` (contiguous, on its device, in
    /// `dtype`) for an in-place write, under the engine's write lock. Returns false, without
    /// calling `f`, when the engine cannot offer them (another dtype); the caller then uses `load`.
    fn with_targets(&self, names: &[String], dtype: DType, f: &mut dyn FnMut(&[Tensor]) -> Result<()>) -> Result<bool>;
    /// A whole update was received (`/finish_weight_update`).
    fn finished(&self) {}
}

/// Which transport a vime-serve accepts (`--weight-transfer-config '{"backend": ..}'`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecvKind {
    Ipc,
    Nccl,
    Cpu,
}

impl RecvKind {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "ipc" => Ok(RecvKind::Ipc),
            "nccl" => Ok(RecvKind::Nccl),
            "cpu" => Ok(RecvKind::Cpu),
            _ => bail!("weight transfer backend must be ipc, nccl or cpu, got {s:?}"),
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            RecvKind::Ipc => "ipc",
            RecvKind::Nccl => "nccl",
            RecvKind::Cpu => "cpu",
        }
    }
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
enum Link {
    Ipc {
        #[cfg(feature = "cuda")]
        mappings: HashMap<String, crate::cuda::IpcMapping>,
    },
    Group(Box<dyn Collectives>),
}

pub struct WeightReceiver {
    kind: RecvKind,
    device: Device,
    link: Option<Link>,
    updating: bool,
    /// Names loaded since `/start_weight_update`.
    loaded: BTreeSet<String>,
    buckets: usize,
    deadline: Duration,
}

/// vime's keys and vLLM 0.33's (the `packed*` ones are accepted; vime always packs).
const INIT_KEYS: &[&str] = &[
    "backend",
    "device_uuid",
    "master_address",
    "master_port",
    "nccl_unique_id_b64",
    "rank_offset",
    "world_size",
    "packed",
    "packed_buffer_size_bytes",
    "packed_num_buffers",
];
const UPDATE_KEYS: &[&str] = &["names", "dtype_names", "shapes", "packed", "nbytes", "ipc_handle_b64"];

fn check_keys(v: &Value, allowed: &[&str], what: &str) -> Result<()> {
    let obj = v
        .as_object()
        .with_context(|| format!("{what} must be a JSON object, got {v}"))?;
    for k in obj.keys() {
        if !allowed.contains(&k.as_str()) {
            bail!("{what}: unknown key {k:?} (known: {})", allowed.join(", "));
        }
    }
    Ok(())
}

fn uint(v: &Value, key: &str, what: &str) -> Result<usize> {
    v.get(key)
        .and_then(Value::as_u64)
        .map(|x| x as usize)
        .with_context(|| format!("{what}.{key} must be a non-negative integer"))
}

impl WeightReceiver {
    pub fn new(kind: RecvKind, device: Device, deadline: Duration) -> Self {
        Self {
            kind,
            device,
            link: None,
            updating: false,
            loaded: BTreeSet::new(),
            buckets: 0,
            deadline,
        }
    }

    pub fn kind(&self) -> RecvKind {
        self.kind
    }

    /// `/init_weight_transfer_engine`: for `nccl`/`cpu`, joins the sender's group (blocks until
    /// the sender joins, bounded by the deadline).
    pub fn init(&mut self, info: &Value) -> Result<()> {
        check_keys(info, INIT_KEYS, "init_info")?;
        if let Some(b) = info.get("backend") {
            let b = b.as_str().context("init_info.backend must be a string")?;
            ensure!(
                b == self.kind.as_str(),
                "init_info.backend is {b:?} but this engine was started with the {:?} weight transfer backend",
                self.kind.as_str()
            );
        }
        self.link = None;
        self.updating = false;
        match self.kind {
            RecvKind::Ipc => {
                #[cfg(feature = "cuda")]
                {
                    let d = crate::cuda::cuda_device(&self.device)
                        .context("the ipc weight transfer backend needs the engine on a CUDA device")?;
                    if let Some(u) = info.get("device_uuid").and_then(Value::as_str) {
                        let ours = crate::cuda::device_uuid(d)?;
                        ensure!(
                            u == ours,
                            "init_info.device_uuid {u} is not this engine's GPU ({ours}): CUDA IPC is for a trainer on the same GPU; use nccl"
                        );
                    }
                    self.link = Some(Link::Ipc {
                        mappings: HashMap::new(),
                    });
                }
                #[cfg(not(feature = "cuda"))]
                bail!("the ipc weight transfer backend needs a CUDA build of vime-serve");
            }
            RecvKind::Nccl | RecvKind::Cpu => {
                let rank = uint(info, "rank_offset", "init_info")?;
                let world = uint(info, "world_size", "init_info")?;
                ensure!(
                    rank >= 1 && rank < world,
                    "init_info.rank_offset {rank} must be in 1..world_size ({world}); rank 0 is the trainer"
                );
                ensure!(
                    (self.kind == RecvKind::Nccl) == self.device.is_cuda(),
                    "the {} weight transfer backend does not fit an engine on {:?}",
                    self.kind.as_str(),
                    self.device
                );
                let g = match self.kind {
                    RecvKind::Nccl => {
                        let id = info
                            .get("nccl_unique_id_b64")
                            .and_then(Value::as_str)
                            .context("init_info.nccl_unique_id_b64 must be a string (the nccl backend)")?;
                        let id = crate::b64::decode(id).context("init_info.nccl_unique_id_b64")?;
                        crate::sender::join_sync_group(
                            Rendezvous::NcclId(&id),
                            rank,
                            world,
                            &self.device,
                            self.deadline,
                        )
                        .with_context(|| {
                            format!("joining the trainer's NCCL weight-sync group as rank {rank} of {world}")
                        })?
                    }
                    _ => {
                        let addr = info
                            .get("master_address")
                            .and_then(Value::as_str)
                            .context("init_info.master_address must be a string (the cpu backend)")?;
                        let port = uint(info, "master_port", "init_info")?;
                        let at = format!("{addr}:{port}");
                        crate::sender::join_sync_group(Rendezvous::Store(&at), rank, world, &self.device, self.deadline)
                            .with_context(|| {
                                format!("joining the trainer's weight-sync group at {at} as rank {rank} of {world}")
                            })?
                    }
                };
                self.link = Some(Link::Group(g));
            }
        }
        Ok(())
    }

    /// `/start_weight_update`.
    pub fn start(&mut self) -> Result<()> {
        ensure!(
            self.link.is_some(),
            "/start_weight_update before /init_weight_transfer_engine"
        );
        self.updating = true;
        self.loaded.clear();
        self.buckets = 0;
        Ok(())
    }

    /// `/update_weights`: receives one bucket and loads it; returns once the engine holds it.
    pub fn update(&mut self, info: &Value, sink: &dyn WeightSink) -> Result<()> {
        check_keys(info, UPDATE_KEYS, "update_info")?;
        ensure!(
            self.updating,
            "/update_weights outside /start_weight_update .. /finish_weight_update"
        );
        if let Some(p) = info.get("packed") {
            ensure!(
                p == &json!(true),
                "update_info.packed must be true (vime sends packed buckets only)"
            );
        }
        let meta = BucketMeta::parse(info)?;
        if let Some(n) = info.get("nbytes") {
            ensure!(
                n.as_u64() == Some(meta.nbytes as u64),
                "update_info.nbytes is {n} but the tensors listed take {} bytes",
                meta.nbytes
            );
        }
        for s in &meta.tensors {
            ensure!(
                !self.loaded.contains(&s.name),
                "tensor {} sent twice in one weight update",
                s.name
            );
        }
        let device = self.device.clone();
        match self.link.as_mut().ok_or_else(|| anyhow!("no weight transfer engine"))? {
            Link::Group(g) => {
                let buf = Tensor::zeros(meta.nbytes, DType::U8, &device)?;
                let got = g.broadcast(&buf, 0).context("receiving a weight bucket")?;
                load_device_bytes(&meta, &got, sink)?;
            }
            Link::Ipc {
                #[cfg(feature = "cuda")]
                mappings,
            } => {
                #[cfg(feature = "cuda")]
                {
                    let h = info
                        .get("ipc_handle_b64")
                        .and_then(Value::as_str)
                        .context("update_info.ipc_handle_b64 is required by the ipc backend")?;
                    let d = crate::cuda::cuda_device(&device)?;
                    if !mappings.contains_key(h) {
                        let bytes = crate::b64::decode(h).context("update_info.ipc_handle_b64")?;
                        mappings.insert(h.to_string(), crate::cuda::IpcMapping::open(d, &bytes)?);
                    }
                    let base = mappings[h].ptr();
                    load_from_device_ptr(&meta, base, d, sink)?;
                }
                #[cfg(not(feature = "cuda"))]
                bail!("the ipc backend needs a CUDA build");
            }
        }
        self.loaded.extend(meta.tensors.iter().map(|s| s.name.clone()));
        self.buckets += 1;
        Ok(())
    }

    /// `/finish_weight_update`: returns (buckets, tensors) received in this update.
    pub fn finish(&mut self, sink: &dyn WeightSink) -> Result<(usize, usize)> {
        ensure!(self.updating, "/finish_weight_update without /start_weight_update");
        self.updating = false;
        sink.finished();
        Ok((self.buckets, self.loaded.len()))
    }
}

/// Loads a bucket that is a u8 tensor (broadcast receive buffer) on the sink's device.
fn load_device_bytes(meta: &BucketMeta, bytes: &Tensor, sink: &dyn WeightSink) -> Result<()> {
    match bytes.device() {
        Device::Cpu => {
            let v = bytes.to_vec1::<u8>()?;
            sink.load(meta.unpack(&v, &Device::Cpu)?)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => {
            let (base, _) = crate::cuda::tensor_address(bytes)?;
            load_from_device_ptr(meta, base, d, sink)
        }
        #[allow(unreachable_patterns)]
        other => bail!("weight sync on {other:?} is not supported"),
    }
}

/// Copies the bucket at device address `base` into the engine (in place when it can), then waits
/// for the copies: the answer to `/update_weights` means the sender may reuse the buffer.
#[cfg(feature = "cuda")]
fn load_from_device_ptr(
    meta: &BucketMeta,
    base: u64,
    d: &candle_core::CudaDevice,
    sink: &dyn WeightSink,
) -> Result<()> {
    let names: Vec<String> = meta.tensors.iter().map(|s| s.name.clone()).collect();
    let mut f = |targets: &[Tensor]| -> Result<()> {
        ensure!(
            targets.len() == meta.tensors.len(),
            "internal: {} targets",
            targets.len()
        );
        for (t, s) in targets.iter().zip(&meta.tensors) {
            ensure!(
                t.dims() == s.shape.as_slice(),
                "tensor {}: the engine's parameter has shape {:?}, the sync sent {:?}",
                s.name,
                t.dims(),
                s.shape
            );
        }
        let parts: Vec<(&Tensor, usize)> = targets.iter().zip(&meta.tensors).map(|(t, s)| (t, s.begin)).collect();
        crate::cuda::unpack_device(d, base, &parts)?;
        d.cuda_stream()
            .synchronize()
            .map_err(|e| anyhow!("CUDA stream synchronize: {e:?}"))
    };
    if sink.with_targets(&names, meta.dtype, &mut f)? {
        return Ok(());
    }
    // Another dtype in the engine: through the host, then cast by `load`.
    let mut host = vec![0u8; meta.nbytes];
    let stream = d.cuda_stream();
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| anyhow!("CUDA bind context: {e:?}"))?;
    unsafe {
        candle_core::cuda_backend::cudarc::driver::result::memcpy_dtoh_async(&mut host, base, stream.cu_stream())
            .map_err(|e| anyhow!("CUDA memcpy device to host: {e:?}"))?;
    }
    stream
        .synchronize()
        .map_err(|e| anyhow!("CUDA stream synchronize: {e:?}"))?;
    sink.load(meta.unpack(&host, &Device::Cpu)?)
}
