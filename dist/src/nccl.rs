//! The NCCL backend (feature `cuda`): one communicator per group, created on the model's stream
//! (`CudaDevice::cuda_stream`), so collectives are ordered with the compute around them without
//! extra synchronization. The group's rank 0 makes the unique id and shares its 128 bytes through
//! the store under `nccl/<group name>/id`.
//!
//! Decisions:
//! - `Comm` holds a raw NCCL handle and is neither `Send` nor `Sync`; so is `NcclGroup`, and the
//!   `World` keeps it in an `Rc`. No `unsafe impl`, no statics.
//! - Inputs are made contiguous and read through their layout's start offset (a narrowed tensor
//!   works); outputs are fresh `alloc_zeros` buffers wrapped as tensors without a grad op.
//! - dtypes: f32, bf16, f16, f64, u8, u32, i64 (one macro, the NCCL type follows the Rust type).
//! - The binary links NCCL 2.28 on the device while cudarc's bindings are generated from 2.30; this
//!   file calls only long-standing entry points, and those are all the symbols it imports:
//!   ncclGetUniqueId, ncclCommInitRank, ncclCommAbort (the `Comm` drop), ncclAllReduce,
//!   ncclAllGather, ncclReduceScatter, ncclBroadcast, ncclSend, ncclRecv.
//! - A dead peer leaves NCCL blocked forever; the watchdog (not this file) turns that into an exit.
//! - Not run here (no GPU on the development machine): compile-checked only.
use crate::collectives::{Collectives, ReduceOp};
use crate::launch::Timeouts;
use crate::store::StoreClient;
use anyhow::{anyhow, bail, Result};
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DeviceRepr, ValidAsZeroBits};
use candle_core::cuda_backend::cudarc::nccl::result::NcclError;
use candle_core::cuda_backend::cudarc::nccl::safe::{Comm, Id, ReduceOp as NcclOp};
use candle_core::cuda_backend::{CudaDType, CudaStorageSlice};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Storage, Tensor};

pub struct NcclGroup {
    name: String,
    rank: usize,
    members: Vec<usize>,
    device: Device,
    comm: Comm,
}

impl NcclGroup {
    /// Joins the group `name` as global rank `global`: blocks (inside ncclCommInitRank) until every
    /// member has joined.
    pub fn new(
        store: &StoreClient,
        name: &str,
        members: &[usize],
        global: usize,
        device: &Device,
        t: &Timeouts,
    ) -> Result<Self> {
        let rank = members
            .iter()
            .position(|&m| m == global)
            .ok_or_else(|| anyhow!("rank {global} is not a member of group {name} {members:?}"))?;
        let key = format!("nccl/{name}/id");
        let bytes = if rank == 0 {
            let bytes = Self::unique_id().map_err(|e| anyhow!("group {name}: {e}"))?;
            store.set(&key, &bytes)?;
            bytes
        } else {
            store.get(&key, t.rendezvous)?
        };
        Self::from_unique_id(name, &bytes, rank, members, device)
    }

    /// A fresh NCCL unique id (`ncclGetUniqueId`), 128 bytes.
    pub fn unique_id() -> Result<Vec<u8>> {
        let id = Id::new().map_err(|e| anyhow!("NCCL GetUniqueId: {e:?}"))?;
        Ok(id.internal().iter().map(|c| *c as u8).collect())
    }

    /// Joins the communicator of `id` (128 bytes, made by one member with [`Self::unique_id`]) as
    /// group rank `rank` of `members`: blocks in `ncclCommInitRank` until every member has joined.
    /// What a weight-sync group with engines of other programs uses (they get the id over HTTP).
    pub fn from_unique_id(name: &str, id: &[u8], rank: usize, members: &[usize], device: &Device) -> Result<Self> {
        let arr: [u8; 128] = id
            .try_into()
            .map_err(|_| anyhow!("group {name}: an NCCL unique id is 128 bytes, got {}", id.len()))?;
        let id = Id::uninit(arr.map(|b| b as std::ffi::c_char));
        let stream = device.as_cuda_device()?.cuda_stream();
        let comm = Comm::from_rank(stream, rank, members.len(), id)
            .map_err(|e| anyhow!("group {name}: NCCL CommInitRank: {e:?}"))?;
        Ok(NcclGroup {
            name: name.to_string(),
            rank,
            members: members.to_vec(),
            device: device.clone(),
            comm,
        })
    }

    fn cuda(&self) -> Result<&CudaDevice> {
        Ok(self.device.as_cuda_device()?)
    }

    fn err(&self, what: &str) -> impl Fn(NcclError) -> anyhow::Error + '_ {
        let what = what.to_string();
        move |e| anyhow!("group {}: NCCL {what}: {e:?}", self.name)
    }
}

/// A zeroed device buffer of `n` elements of the view's type (the type is inferred, so the
/// dispatch below never names `half`'s types).
fn alloc_like<T: DeviceRepr + ValidAsZeroBits>(
    dev: &CudaDevice,
    _like: &CudaView<'_, T>,
    n: usize,
) -> Result<CudaSlice<T>> {
    Ok(dev.alloc_zeros::<T>(n)?)
}

fn wrap<T: CudaDType>(dev: &CudaDevice, s: CudaSlice<T>, shape: &[usize]) -> Tensor {
    let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(s, dev.clone()));
    Tensor::from_storage(storage, shape, BackpropOp::none(), false)
}

fn nccl_op(op: ReduceOp) -> NcclOp {
    match op {
        ReduceOp::Sum => NcclOp::Sum,
        ReduceOp::Max => NcclOp::Max,
    }
}

/// Runs `$body` with `$src` bound to the contiguous tensor's device view (its layout's offset and
/// element count), once per supported dtype.
macro_rules! with_view {
    ($self:ident, $t:expr, |$src:ident| $body:expr) => {{
        let t = $t.contiguous()?;
        if !t.device().same_device(&$self.device) {
            bail!(
                "group {}: a tensor on {:?}, the group is on {:?}",
                $self.name,
                t.device(),
                $self.device
            );
        }
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cuda(cs) = &*storage else {
            bail!("group {}: NCCL needs a CUDA tensor, got {:?}", $self.name, t.device())
        };
        let range = layout.start_offset()..layout.start_offset() + layout.shape().elem_count();
        match &cs.slice {
            CudaStorageSlice::F32(s) => {
                let $src = s.slice(range);
                $body
            }
            CudaStorageSlice::BF16(s) => {
                let $src = s.slice(range);
                $body
            }
            CudaStorageSlice::F16(s) => {
                let $src = s.slice(range);
                $body
            }
            CudaStorageSlice::F64(s) => {
                let $src = s.slice(range);
                $body
            }
            CudaStorageSlice::U8(s) => {
                let $src = s.slice(range);
                $body
            }
            CudaStorageSlice::U32(s) => {
                let $src = s.slice(range);
                $body
            }
            CudaStorageSlice::I64(s) => {
                let $src = s.slice(range);
                $body
            }
            _ => bail!("group {}: the NCCL backend does not carry {:?}", $self.name, t.dtype()),
        }
    }};
}

impl Collectives for NcclGroup {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.members.len()
    }
    fn members(&self) -> &[usize] {
        &self.members
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let dev = self.cuda()?;
        with_view!(self, t, |src| {
            let mut out = alloc_like(dev, &src, src.len())?;
            self.comm
                .all_reduce(&src, &mut out, &nccl_op(op))
                .map_err(self.err("AllReduce"))?;
            Ok(wrap(dev, out, t.dims()))
        })
    }

    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        if t.rank() == 0 {
            bail!(
                "group {}: all_gather of a scalar (it concatenates along dim 0)",
                self.name
            );
        }
        let dev = self.cuda()?;
        let mut shape = t.dims().to_vec();
        shape[0] *= self.size();
        with_view!(self, t, |src| {
            let mut out = alloc_like(dev, &src, src.len() * self.size())?;
            self.comm.all_gather(&src, &mut out).map_err(self.err("AllGather"))?;
            Ok(wrap(dev, out, &shape))
        })
    }

    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let n = self.size();
        let d0 = t.dims().first().copied().unwrap_or(0);
        if t.rank() == 0 || d0 % n != 0 {
            bail!(
                "group {}: reduce_scatter needs dim 0 divisible by {n}, got shape {:?}",
                self.name,
                t.dims()
            );
        }
        let dev = self.cuda()?;
        let mut shape = t.dims().to_vec();
        shape[0] /= n;
        with_view!(self, t, |src| {
            let mut out = alloc_like(dev, &src, src.len() / n)?;
            self.comm
                .reduce_scatter(&src, &mut out, &nccl_op(op))
                .map_err(self.err("ReduceScatter"))?;
            Ok(wrap(dev, out, &shape))
        })
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        if root >= self.size() {
            bail!(
                "group {}: broadcast from group rank {root} of {}",
                self.name,
                self.size()
            );
        }
        let dev = self.cuda()?;
        with_view!(self, t, |src| {
            let mut out = alloc_like(dev, &src, src.len())?;
            self.comm
                .broadcast(Some(&src), &mut out, root as i32)
                .map_err(self.err("Broadcast"))?;
            Ok(wrap(dev, out, t.dims()))
        })
    }

    fn barrier(&self) -> Result<()> {
        let one = Tensor::zeros(1, DType::F32, &self.device)?;
        self.all_reduce(&one, ReduceOp::Sum)?;
        Ok(self.device.synchronize()?)
    }

    fn send(&self, t: &Tensor, peer: usize) -> Result<()> {
        if peer >= self.size() || peer == self.rank {
            bail!(
                "group {}: send to group rank {peer} from {} of {}",
                self.name,
                self.rank,
                self.size()
            );
        }
        with_view!(self, t, |src| {
            self.comm.send(&src, peer as i32).map_err(self.err("Send"))?;
            Ok(())
        })
    }

    fn recv(&self, shape: &[usize], dtype: DType, peer: usize) -> Result<Tensor> {
        if peer >= self.size() || peer == self.rank {
            bail!(
                "group {}: recv from group rank {peer} at {} of {}",
                self.name,
                self.rank,
                self.size()
            );
        }
        let dev = self.cuda()?;
        // A typed template for the dispatch; its buffer is not written.
        let like = Tensor::zeros(1, dtype, &self.device)?;
        let n: usize = shape.iter().product();
        with_view!(self, like, |src| {
            let mut out = alloc_like(dev, &src, n)?;
            self.comm.recv(&mut out, peer as i32).map_err(self.err("Recv"))?;
            Ok(wrap(dev, out, shape))
        })
    }

    fn broadcast_bytes(&self, data: &[u8], root: usize) -> Result<Vec<u8>> {
        let len = if self.rank == root { data.len() as i64 } else { 0 };
        let len = self
            .broadcast(&Tensor::new(&[len], &self.device)?, root)?
            .to_vec1::<i64>()?[0] as usize;
        if len == 0 {
            return Ok(Vec::new());
        }
        let buf = if self.rank == root {
            Tensor::from_slice(data, len, &self.device)?
        } else {
            Tensor::zeros(len, DType::U8, &self.device)?
        };
        Ok(self.broadcast(&buf, root)?.to_vec1::<u8>()?)
    }

    fn all_gather_bytes(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let lens = self
            .all_gather(&Tensor::new(&[data.len() as i64], &self.device)?)?
            .to_vec1::<i64>()?;
        let max = lens.iter().copied().max().unwrap_or(0) as usize;
        if max == 0 {
            return Ok(vec![Vec::new(); self.size()]);
        }
        let mut padded = data.to_vec();
        padded.resize(max, 0);
        let all = self
            .all_gather(&Tensor::from_vec(padded, max, &self.device)?)?
            .to_vec1::<u8>()?;
        Ok(all
            .chunks(max)
            .zip(&lens)
            .map(|(c, &l)| c[..l as usize].to_vec())
            .collect())
    }
}
