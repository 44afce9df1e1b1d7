//! The CPU backend: ranks are processes (or threads, in tests) on one machine, a full TCP mesh
//! between a group's members. What CI runs, and the reference the NCCL backend is checked against.
//!
//! Decisions:
//! - Reductions are a star through group rank 0: it reads every rank's tensor in group-rank
//!   order, sums left to right (rank0 + rank1 + ...) in the tensor's own dtype with candle's ops,
//!   and sends the same result bytes back, so every rank gets bit-identical results and a run is
//!   reproducible. Broadcast goes straight from the root, send/recv straight between the pair.
//! - Each group has its own listener, its own connections and its own key namespace in the store
//!   (`cpu/<group name>/...`), so world, dp, tp and cp groups coexist in one process.
//! - Every message is `[kind u8][len u64][payload]`; kind ERROR carries the root's error text, so
//!   a shape mismatch or a dead member seen by the root fails every rank with the same message
//!   instead of leaving them waiting.
//! - Socket reads and writes time out after `Timeouts::op`; EOF is an error naming the peer's
//!   global rank.
//! - send is a blocking write: two ranks that send large tensors to each other at once must order
//!   the pair (one sends first), as with NCCL outside a group call.
use crate::collectives::{Collectives, ReduceOp};
use crate::launch::Timeouts;
use crate::store::{fmt_secs, StoreClient};
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{CpuStorage, DType, Device, Storage, Tensor};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

const DATA: u8 = 0;
const ERROR: u8 = 1;
/// A single message's limit; a length over it is a corrupt stream, not an allocation to try.
const MAX_MESSAGE: u64 = 1 << 40;

pub struct CpuGroup {
    name: String,
    rank: usize,
    members: Vec<usize>,
    /// `peers[r]`: the connection to group rank `r` (`None` for this rank).
    peers: Vec<Option<TcpStream>>,
    op_timeout: Duration,
}

impl CpuGroup {
    /// Joins the group `name` (the same name and member list on every member) as global rank
    /// `global`. Blocks until every member has joined or the rendezvous deadline passes.
    pub fn new(store: &StoreClient, name: &str, members: &[usize], global: usize, t: &Timeouts) -> Result<Self> {
        let rank = members
            .iter()
            .position(|&m| m == global)
            .ok_or_else(|| anyhow!("rank {global} is not a member of group {name} {members:?}"))?;
        let n = members.len();
        let ip = store.local_ip()?;
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))
            .with_context(|| format!("rank {global}: binding a listener for group {name} on {ip}"))?;
        store.set(
            &format!("cpu/{name}/addr/{rank}"),
            listener.local_addr()?.to_string().as_bytes(),
        )?;
        let mut peers: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
        let hello = |r: usize| format!("{name}#{r}");
        // Dial every lower rank, introducing ourselves; accept every higher one.
        for (r, slot) in peers.iter_mut().enumerate().take(rank) {
            let key = format!("cpu/{name}/addr/{r}");
            let addr = String::from_utf8_lossy(&store.get(&key, t.rendezvous)?).into_owned();
            let addr: SocketAddr = addr
                .parse()
                .map_err(|_| anyhow!("group {name}: rank {} published a bad address {addr:?}", members[r]))?;
            let s = TcpStream::connect_timeout(&addr, t.rendezvous).with_context(|| {
                format!(
                    "rank {global}: connecting to rank {} of group {name} at {addr}",
                    members[r]
                )
            })?;
            configure(&s, t.op)?;
            send_msg(&s, DATA, hello(rank).as_bytes())?;
            *slot = Some(s);
        }
        listener.set_nonblocking(true)?;
        let deadline = Instant::now() + t.rendezvous;
        let mut waiting = n - rank - 1;
        while waiting > 0 {
            match listener.accept() {
                Ok((s, _)) => {
                    s.set_nonblocking(false)?;
                    configure(&s, t.op)?;
                    let msg = recv_raw(&s).map_err(|e| anyhow!("group {name}: a joining peer: {e}"))?;
                    let who = String::from_utf8_lossy(&msg).into_owned();
                    let r = who
                        .strip_prefix(&format!("{name}#"))
                        .and_then(|r| r.parse::<usize>().ok())
                        .filter(|r| *r > rank && *r < n && peers[*r].is_none())
                        .ok_or_else(|| anyhow!("group {name}: unexpected peer greeting {who:?}"))?;
                    peers[r] = Some(s);
                    waiting -= 1;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<usize> = (rank + 1..n)
                            .filter(|r| peers[*r].is_none())
                            .map(|r| members[r])
                            .collect();
                        bail!(
                            "rank {global}: ranks {missing:?} did not join group {name} within {} s",
                            fmt_secs(t.rendezvous)
                        );
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => return Err(e).context(format!("group {name}: accepting peers")),
            }
        }
        Ok(CpuGroup {
            name: name.to_string(),
            rank,
            members: members.to_vec(),
            peers,
            op_timeout: t.op,
        })
    }

    fn peer(&self, r: usize) -> Result<&TcpStream> {
        self.peers
            .get(r)
            .and_then(Option::as_ref)
            .ok_or_else(|| anyhow!("group {}: no group rank {r} (size {})", self.name, self.size()))
    }

    fn send_to(&self, r: usize, kind: u8, payload: &[u8]) -> Result<()> {
        send_msg(self.peer(r)?, kind, payload).map_err(|e| self.io_error(r, e))
    }

    fn recv_from(&self, r: usize) -> Result<Vec<u8>> {
        let s = self.peer(r)?;
        match recv_msg(s).map_err(|e| self.io_error(r, e))? {
            (DATA, p) => Ok(p),
            (_, p) => Err(anyhow!("{}", String::from_utf8_lossy(&p))),
        }
    }

    fn io_error(&self, r: usize, e: io::Error) -> anyhow::Error {
        let g = self.members.get(r).copied().unwrap_or(usize::MAX);
        match e.kind() {
            io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset | io::ErrorKind::BrokenPipe => {
                anyhow!(
                    "group {}: rank {g} closed the connection (it died or left early): {e}",
                    self.name
                )
            }
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => anyhow!(
                "group {}: nothing from rank {g} for {} s (VIME_DIST_OP_TIMEOUT)",
                self.name,
                fmt_secs(self.op_timeout)
            ),
            _ => anyhow!("group {}: talking to rank {g}: {e}", self.name),
        }
    }

    /// The star: every rank sends `mine` to group rank 0, which runs `combine` over all of them
    /// (in group-rank order) and answers each rank with its part. A failure at the root (a shape
    /// mismatch, a dead member) is sent to every other rank as the same error.
    fn star(&self, mine: Vec<u8>, combine: impl FnOnce(Vec<Vec<u8>>) -> Result<Reply>) -> Result<Vec<u8>> {
        if self.rank != 0 {
            self.send_to(0, DATA, &mine)?;
            return self.recv_from(0);
        }
        let mut parts = vec![mine];
        let gathered = (1..self.size()).try_for_each(|r| {
            parts.push(self.recv_from(r)?);
            Ok(())
        });
        let reply = gathered.and_then(|()| combine(parts));
        match reply {
            Ok(Reply::Same(out)) => {
                for r in 1..self.size() {
                    self.send_to(r, DATA, &out)?;
                }
                Ok(out)
            }
            Ok(Reply::PerRank(mut outs)) => {
                for (r, o) in outs.iter().enumerate().skip(1) {
                    self.send_to(r, DATA, o)?;
                }
                Ok(std::mem::take(&mut outs[0]))
            }
            Err(e) => {
                let msg = format!("{e:#}");
                for r in 1..self.size() {
                    // Best effort: a dead member's socket is already gone.
                    let _ = self.send_to(r, ERROR, msg.as_bytes());
                }
                Err(e)
            }
        }
    }

    /// Decodes every rank's tensor, checking that all match rank 0's dtype and shape.
    fn decode_all(&self, parts: &[Vec<u8>], what: &str) -> Result<Vec<Tensor>> {
        let ts: Vec<Tensor> = parts.iter().map(|p| decode(p)).collect::<Result<_>>()?;
        for (r, t) in ts.iter().enumerate().skip(1) {
            if t.dtype() != ts[0].dtype() || t.dims() != ts[0].dims() {
                bail!(
                    "group {}: {what} got {:?} {:?} from rank {} but {:?} {:?} from rank {}",
                    self.name,
                    t.dtype(),
                    t.dims(),
                    self.members[r],
                    ts[0].dtype(),
                    ts[0].dims(),
                    self.members[0]
                );
            }
        }
        Ok(ts)
    }
}

enum Reply {
    Same(Vec<u8>),
    PerRank(Vec<Vec<u8>>),
}

fn configure(s: &TcpStream, op: Duration) -> Result<()> {
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(op))?;
    s.set_write_timeout(Some(op))?;
    Ok(())
}

fn send_msg(mut s: &TcpStream, kind: u8, payload: &[u8]) -> io::Result<()> {
    let mut head = [0u8; 9];
    head[0] = kind;
    head[1..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    if payload.len() <= 1 << 16 {
        let mut buf = head.to_vec();
        buf.extend_from_slice(payload);
        s.write_all(&buf)
    } else {
        s.write_all(&head)?;
        s.write_all(payload)
    }
}

fn recv_msg(mut s: &TcpStream) -> io::Result<(u8, Vec<u8>)> {
    let mut head = [0u8; 9];
    s.read_exact(&mut head)?;
    let len = u64::from_le_bytes(head[1..].try_into().unwrap_or([0; 8]));
    if len > MAX_MESSAGE || head[0] > ERROR {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "corrupt message header"));
    }
    let mut buf = vec![0u8; len as usize];
    s.read_exact(&mut buf)?;
    Ok((head[0], buf))
}

fn recv_raw(s: &TcpStream) -> io::Result<Vec<u8>> {
    recv_msg(s).map(|(_, p)| p)
}

const DTYPES: [DType; 9] = [
    DType::U8,
    DType::U32,
    DType::I16,
    DType::I32,
    DType::I64,
    DType::BF16,
    DType::F16,
    DType::F32,
    DType::F64,
];

/// `[dtype u8][ndim u8][dims u64 x ndim][little-endian elements]`, from any device.
pub(crate) fn encode(t: &Tensor) -> Result<Vec<u8>> {
    let code = DTYPES
        .iter()
        .position(|d| *d == t.dtype())
        .ok_or_else(|| anyhow!("the CPU backend does not carry {:?} tensors", t.dtype()))?;
    let flat = t.to_device(&Device::Cpu)?.flatten_all()?.contiguous()?;
    let mut out = vec![code as u8, t.rank() as u8];
    for d in t.dims() {
        out.extend_from_slice(&(*d as u64).to_le_bytes());
    }
    let (storage, layout) = flat.storage_and_layout();
    let Storage::Cpu(cpu) = &*storage else {
        bail!("expected a CPU tensor after to_device")
    };
    let range = layout.start_offset()..layout.start_offset() + layout.shape().elem_count();
    macro_rules! le {
        ($v:expr, $x:ident => $bytes:expr) => {
            for $x in &$v[range] {
                out.extend_from_slice(&$bytes);
            }
        };
    }
    match cpu {
        CpuStorage::U8(v) => out.extend_from_slice(&v[range]),
        CpuStorage::U32(v) => le!(v, x => x.to_le_bytes()),
        CpuStorage::I16(v) => le!(v, x => x.to_le_bytes()),
        CpuStorage::I32(v) => le!(v, x => x.to_le_bytes()),
        CpuStorage::I64(v) => le!(v, x => x.to_le_bytes()),
        CpuStorage::BF16(v) => le!(v, x => x.to_bits().to_le_bytes()),
        CpuStorage::F16(v) => le!(v, x => x.to_bits().to_le_bytes()),
        CpuStorage::F32(v) => le!(v, x => x.to_le_bytes()),
        CpuStorage::F64(v) => le!(v, x => x.to_le_bytes()),
        _ => bail!("the CPU backend does not carry {:?} tensors", t.dtype()),
    }
    Ok(out)
}

/// The inverse of [`encode`], on the CPU.
pub(crate) fn decode(b: &[u8]) -> Result<Tensor> {
    let bad = || anyhow!("corrupt tensor message ({} bytes)", b.len());
    let (&code, rest) = b.split_first().ok_or_else(bad)?;
    let (&ndim, mut rest) = rest.split_first().ok_or_else(bad)?;
    let dtype = *DTYPES.get(code as usize).ok_or_else(bad)?;
    let mut dims = Vec::with_capacity(ndim as usize);
    for _ in 0..ndim {
        let (d, r) = rest.split_first_chunk::<8>().ok_or_else(bad)?;
        dims.push(u64::from_le_bytes(*d) as usize);
        rest = r;
    }
    let n: usize = dims.iter().product();
    if rest.len() != n * dtype.size_in_bytes() {
        return Err(bad());
    }
    Ok(Tensor::from_raw_buffer(rest, dtype, &dims, &Device::Cpu)?)
}

fn combine(acc: Tensor, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
    Ok(match op {
        ReduceOp::Sum => acc.add(t)?,
        ReduceOp::Max => acc.maximum(t)?,
    })
}

/// Sums (or maxes) in group-rank order: ((t0 + t1) + t2) + ...
fn reduce_in_order(ts: Vec<Tensor>, op: ReduceOp) -> Result<Tensor> {
    let mut it = ts.into_iter();
    let first = it.next().ok_or_else(|| anyhow!("reduce over no tensors"))?;
    it.try_fold(first, |acc, t| combine(acc, &t, op))
}

fn encode_list(items: &[Vec<u8>]) -> Vec<u8> {
    let mut out = (items.len() as u64).to_le_bytes().to_vec();
    for i in items {
        out.extend_from_slice(&(i.len() as u64).to_le_bytes());
        out.extend_from_slice(i);
    }
    out
}

fn decode_list(mut b: &[u8]) -> Result<Vec<Vec<u8>>> {
    let bad = || anyhow!("corrupt byte-list message");
    let (n, r) = b.split_first_chunk::<8>().ok_or_else(bad)?;
    b = r;
    let n = u64::from_le_bytes(*n) as usize;
    let mut out = Vec::with_capacity(n.min(1 << 16));
    for _ in 0..n {
        let (l, r) = b.split_first_chunk::<8>().ok_or_else(bad)?;
        let l = u64::from_le_bytes(*l) as usize;
        if r.len() < l {
            return Err(bad());
        }
        out.push(r[..l].to_vec());
        b = &r[l..];
    }
    Ok(out)
}

impl Collectives for CpuGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    /// The collective on a scoped helper thread (it only waits on this group's sockets and sums),
    /// `work` on this one.
    fn reduce_while(
        &self,
        t: &Tensor,
        op: ReduceOp,
        scatter: bool,
        work: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Tensor> {
        std::thread::scope(|s| {
            let comm = s.spawn(|| {
                if scatter {
                    self.reduce_scatter(t, op)
                } else {
                    self.all_reduce(t, op)
                }
            });
            let worked = work();
            let reduced = comm
                .join()
                .map_err(|_| anyhow!("group {}: the overlapped collective panicked", self.name))?;
            worked?;
            reduced
        })
    }
    fn size(&self) -> usize {
        self.members.len()
    }
    fn members(&self) -> &[usize] {
        &self.members
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let out = self.star(encode(t)?, |parts| {
            let ts = self.decode_all(&parts, "all_reduce")?;
            Ok(Reply::Same(encode(&reduce_in_order(ts, op)?)?))
        })?;
        Ok(decode(&out)?.to_device(t.device())?)
    }

    fn all_gather(&self, t: &Tensor) -> Result<Tensor> {
        if t.rank() == 0 {
            bail!(
                "group {}: all_gather of a scalar (it concatenates along dim 0)",
                self.name
            );
        }
        let out = self.star(encode(t)?, |parts| {
            let ts = self.decode_all(&parts, "all_gather")?;
            Ok(Reply::Same(encode(&Tensor::cat(&ts, 0)?)?))
        })?;
        Ok(decode(&out)?.to_device(t.device())?)
    }

    fn reduce_scatter(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let n = self.size();
        let d0 = t.dims().first().copied().unwrap_or(0);
        if t.rank() == 0 || d0 % n != 0 {
            // Every rank sees its own shape, so every rank fails here alike.
            bail!(
                "group {}: reduce_scatter needs dim 0 divisible by {n}, got shape {:?}",
                self.name,
                t.dims()
            );
        }
        let out = self.star(encode(t)?, |parts| {
            let ts = self.decode_all(&parts, "reduce_scatter")?;
            let sum = reduce_in_order(ts, op)?;
            let k = d0 / n;
            let chunks = (0..n)
                .map(|r| encode(&sum.narrow(0, r * k, k)?))
                .collect::<Result<_>>()?;
            Ok(Reply::PerRank(chunks))
        })?;
        Ok(decode(&out)?.to_device(t.device())?)
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        if root >= self.size() {
            bail!(
                "group {}: broadcast from group rank {root} of {}",
                self.name,
                self.size()
            );
        }
        if self.rank == root {
            let b = encode(t)?;
            for r in (0..self.size()).filter(|r| *r != root) {
                self.send_to(r, DATA, &b)?;
            }
            return Ok(t.copy()?);
        }
        let got = decode(&self.recv_from(root)?)?;
        if got.dtype() != t.dtype() || got.dims() != t.dims() {
            bail!(
                "group {}: broadcast from rank {} sent {:?} {:?}, this rank expected {:?} {:?}",
                self.name,
                self.members[root],
                got.dtype(),
                got.dims(),
                t.dtype(),
                t.dims()
            );
        }
        Ok(got.to_device(t.device())?)
    }

    fn barrier(&self) -> Result<()> {
        self.star(Vec::new(), |_| Ok(Reply::Same(Vec::new()))).map(|_| ())
    }

    fn send(&self, t: &Tensor, peer: usize) -> Result<()> {
        if peer == self.rank {
            bail!("group {}: send to itself (group rank {peer})", self.name);
        }
        self.send_to(peer, DATA, &encode(t)?)
    }

    fn recv(&self, shape: &[usize], dtype: DType, peer: usize) -> Result<Tensor> {
        if peer == self.rank {
            bail!("group {}: recv from itself (group rank {peer})", self.name);
        }
        let got = decode(&self.recv_from(peer)?)?;
        if got.dtype() != dtype || got.dims() != shape {
            bail!(
                "group {}: recv from rank {} got {:?} {:?}, expected {dtype:?} {shape:?}",
                self.name,
                self.members[peer],
                got.dtype(),
                got.dims()
            );
        }
        Ok(got)
    }

    fn broadcast_bytes(&self, data: &[u8], root: usize) -> Result<Vec<u8>> {
        if root >= self.size() {
            bail!(
                "group {}: broadcast from group rank {root} of {}",
                self.name,
                self.size()
            );
        }
        if self.rank == root {
            for r in (0..self.size()).filter(|r| *r != root) {
                self.send_to(r, DATA, data)?;
            }
            return Ok(data.to_vec());
        }
        self.recv_from(root)
    }

    fn all_gather_bytes(&self, data: &[u8]) -> Result<Vec<Vec<u8>>> {
        let out = self.star(data.to_vec(), |parts| Ok(Reply::Same(encode_list(&parts))))?;
        decode_list(&out)
    }
}

/// Runs `f(rank, group)` on `n` threads of this process, each a rank of one real CPU-backend group
/// `name` (TCP through a store served on loopback, sums in rank order); results in rank order, or
/// the first failing rank's error. What the multi-rank tests of the layers above use.
pub fn run_threads<T: Send>(
    n: usize,
    name: &str,
    f: impl Fn(usize, &dyn crate::Collectives) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let t = Timeouts::default();
    let addr = format!("127.0.0.1:{}", crate::launch::free_port()?);
    let _server = crate::store::StoreServer::bind(&addr, t.heartbeat)?;
    let members: Vec<usize> = (0..n).collect();
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let (f, addr, members) = (&f, &addr, &members);
                s.spawn(move || -> Result<T> {
                    let store = StoreClient::connect(addr, r, t.rendezvous)?;
                    let g = CpuGroup::new(&store, name, members, r, &t)?;
                    f(r, &g)
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(r, h)| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow!("rank {r} panicked")))
                    .with_context(|| format!("rank {r}"))
            })
            .collect()
    })
}

/// [`run_threads`] over a `tp x cp` grid of thread ranks (TP fastest, as Megatron orders them:
/// global rank `c * tp + t`): `f(global rank, its TP group, its CP group)`, results in global-rank
/// order. For the tests of layers that communicate over two groups.
pub fn run_threads_grid<T: Send>(
    tp: usize,
    cp: usize,
    f: impl Fn(usize, &dyn crate::Collectives, &dyn crate::Collectives) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let t = Timeouts::default();
    let addr = format!("127.0.0.1:{}", crate::launch::free_port()?);
    let _server = crate::store::StoreServer::bind(&addr, t.heartbeat)?;
    let n = tp * cp;
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|g| {
                let (f, addr) = (&f, &addr);
                s.spawn(move || -> Result<T> {
                    let store = StoreClient::connect(addr, g, t.rendezvous)?;
                    let (c, r) = (g / tp, g % tp);
                    let tp_members: Vec<usize> = (0..tp).map(|i| c * tp + i).collect();
                    let cp_members: Vec<usize> = (0..cp).map(|i| i * tp + r).collect();
                    let tpg = CpuGroup::new(&store, &format!("tp{c}"), &tp_members, g, &t)?;
                    let cpg = CpuGroup::new(&store, &format!("cp{r}"), &cp_members, g, &t)?;
                    f(g, &tpg, &cpg)
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(g, h)| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow!("rank {g} panicked")))
                    .with_context(|| format!("rank {g}"))
            })
            .collect()
    })
}
