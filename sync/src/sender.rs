//! The trainer's side of a weight sync: prepare, pause, stream the buckets, finish, resume, check.
//!
//! One sync, in order (every engine at once, each call bounded by the deadline):
//! 1. prepare (engines still serving): every tensor of the plan, cast to the transfer dtype and
//!    made contiguous, in bucket order; the first bucket is staged;
//! 2. `POST /pause?mode=keep&clear_cache=false` unless the caller already stopped the engines
//!    (`--colocate`: they sleep);
//! 3. on the first sync only: `/init_weight_transfer_engine` on every engine while the transport
//!    connects (NCCL: the communicator forms across both sides);
//! 4. `/start_weight_update`;
//! 5. per bucket k: the transport makes it readable (IPC: our stream is synchronized), the
//!    `/update_weights` call goes out, the transport moves it (NCCL: broadcast, then a bounded
//!    wait for our stream), bucket k+1 is staged into the other buffer while the engines load k,
//!    and the answer (every engine loaded k) frees k's buffer;
//! 6. `/finish_weight_update {weight_version: step}`, optionally
//!    `/reset_prefix_cache`, `/resume`;
//! 7. every engine must report the new version (`GET /weight_info`).
//!
//! Failures: any error or missed deadline ends the sync with an error naming the phase, the
//! bucket and the engine URL(s); the transport is dropped (NCCL: the communicator is aborted, not
//! waited on) and the next sync starts again from `/init_weight_transfer_engine`.
use crate::pack::{check_sources, pack_host};
use crate::plan::{Bucket, SyncPlan};
use crate::protocol::{pause_call, reset_prefix_cache_call, resume_call, Call, EngineControl, Protocol};
use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Map, Value};
use std::time::{Duration, Instant};
use vime_dist::{Collectives, Timeouts};

/// How the bucket bytes travel.
pub trait Transport {
    /// `ipc`, `nccl` or `cpu` (what `init_info.backend` says).
    fn name(&self) -> &'static str;
    /// `init_info` for engine `engine` of `engines` (each engine one worker).
    fn init_info(&self, engine: usize, engines: usize) -> Value;
    /// Joins the engines (runs while their `/init_weight_transfer_engine` calls are in flight).
    fn connect(&mut self, engines: usize, deadline: Duration) -> Result<()>;
    /// Copies `tensors` (bucket `bucket`'s, in its dtype) into staging buffer `slot` (0 or 1).
    fn stage(&mut self, slot: usize, bucket: &Bucket, tensors: &[Tensor]) -> Result<()>;
    /// Makes `slot` readable by the engines before its `/update_weights` call; returns the
    /// transport's `update_info` keys.
    fn ready(&mut self, slot: usize, bucket: &Bucket) -> Result<Map<String, Value>>;
    /// Moves `slot` while the engines' `/update_weights` calls are in flight (NCCL: broadcast and
    /// a bounded wait); nothing for IPC.
    fn transfer(&mut self, slot: usize, deadline: Duration) -> Result<()>;
}

#[derive(Debug, Clone)]
pub struct SyncOptions {
    pub protocol: Protocol,
    /// Bound of every control call and of every transfer.
    pub deadline: Duration,
    /// Pause with `mode=keep` and resume afterwards (off when the engines sleep, `--colocate`).
    pub pause: bool,
    /// `clear_cache` of the pause.
    pub clear_cache: bool,
    pub reset_prefix_cache: bool,
}

impl Default for SyncOptions {
    fn default() -> Self {
        Self {
            protocol: Protocol::Native,
            deadline: Duration::from_secs(120),
            pause: true,
            clear_cache: false,
            reset_prefix_cache: true,
        }
    }
}

/// Where a sync's time went (seconds) and what it moved.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SyncReport {
    /// Casts and copies before the engines stop (plan order), plus staging the first bucket.
    pub prepare_s: f64,
    /// `/pause` (0 without).
    pub pause_s: f64,
    /// First sync only: `/init_weight_transfer_engine` and the transport's connect.
    pub init_s: f64,
    /// From `/start_weight_update` to the last bucket's answer.
    pub transfer_s: f64,
    /// Trainer-side work inside the transfer: staging buckets 2.. and making them readable.
    pub stage_s: f64,
    /// Waiting for the engines' `/update_weights` answers (their load).
    pub engine_wait_s: f64,
    /// What the engines say they spent receiving and loading (`load_s` in vime-serve's answers;
    /// the slowest engine per bucket, summed); the rest of the wait is the HTTP exchange.
    pub engine_load_s: f64,
    /// `/finish_weight_update`, prefix-cache reset, `/resume`, version check.
    pub finish_s: f64,
    /// First paused call to the resume: how long the engines did not serve.
    pub paused_s: f64,
    pub total_s: f64,
    pub bytes: usize,
    pub buckets: usize,
    pub tensors: usize,
}

impl SyncReport {
    pub fn metrics(&self) -> Vec<(&'static str, f64)> {
        vec![
            ("perf/sync_prepare_time", self.prepare_s),
            ("perf/sync_pause_time", self.pause_s),
            ("perf/sync_init_time", self.init_s),
            ("perf/sync_transfer_time", self.transfer_s),
            ("perf/sync_stage_time", self.stage_s),
            ("perf/sync_engine_wait_time", self.engine_wait_s),
            ("perf/sync_engine_load_time", self.engine_load_s),
            ("perf/sync_finish_time", self.finish_s),
            ("perf/sync_paused_time", self.paused_s),
        ]
    }
}

/// Makes a sender's transport: called on the first sync and again after a failed one.
pub type MakeTransport = Box<dyn Fn() -> Result<Box<dyn Transport>>>;

/// The plan, the transport and whether the engines were initialised.
pub struct WeightSender {
    plan: SyncPlan,
    transport: Option<Box<dyn Transport>>,
    make_transport: MakeTransport,
    connected: bool,
    opts: SyncOptions,
}

fn secs(t: Instant) -> f64 {
    t.elapsed().as_secs_f64()
}

/// `call` on every engine at once; the values in engine order, or one error naming every engine
/// that failed.
pub fn call_all(engines: &dyn EngineControl, calls: &[Call], deadline: Duration, what: &str) -> Result<Vec<Value>> {
    let urls = engines.urls();
    let results: Vec<Result<Value>> = std::thread::scope(|s| {
        let hs: Vec<_> = calls
            .iter()
            .enumerate()
            .map(|(i, c)| s.spawn(move || engines.call(i, c, deadline)))
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("the HTTP thread panicked"))))
            .collect()
    });
    let mut errs = Vec::new();
    let mut vals = Vec::new();
    for (i, r) in results.into_iter().enumerate() {
        match r {
            Ok(v) => vals.push(v),
            Err(e) => errs.push(format!(
                "engine {} ({}): {e:#}",
                i,
                urls.get(i).map(String::as_str).unwrap_or("?")
            )),
        }
    }
    if !errs.is_empty() {
        bail!(
            "weight sync, {what}: {} of {} engine(s) failed: {}",
            errs.len(),
            urls.len(),
            errs.join("; ")
        );
    }
    Ok(vals)
}

fn same_call(engines: &dyn EngineControl, call: &Call, deadline: Duration, what: &str) -> Result<Vec<Value>> {
    let n = engines.urls().len();
    call_all(engines, &vec![call.clone(); n], deadline, what)
}

impl WeightSender {
    /// `make_transport` is called on the first sync and again after a failed one.
    pub fn new(plan: SyncPlan, make_transport: MakeTransport, opts: SyncOptions) -> Self {
        Self {
            plan,
            transport: None,
            make_transport,
            connected: false,
            opts,
        }
    }

    pub fn plan(&self) -> &SyncPlan {
        &self.plan
    }

    pub fn options(&self) -> &SyncOptions {
        &self.opts
    }

    /// Streams the tensors `source(name)` gives (full HF tensors, any dtype) to `engines` as
    /// weight version `version`.
    pub fn sync(
        &mut self,
        engines: &dyn EngineControl,
        source: &dyn Fn(&str) -> Result<Tensor>,
        version: u64,
    ) -> Result<SyncReport> {
        let r = self.sync_inner(engines, source, version);
        if r.is_err() {
            // Whatever state the transport is in (a half-finished broadcast), it is not reused.
            self.transport = None;
            self.connected = false;
        }
        r
    }

    fn sync_inner(
        &mut self,
        engines: &dyn EngineControl,
        source: &dyn Fn(&str) -> Result<Tensor>,
        version: u64,
    ) -> Result<SyncReport> {
        let t_all = Instant::now();
        let d = self.opts.deadline;
        let proto = self.opts.protocol;
        let n = engines.urls().len();
        if n == 0 {
            bail!("weight sync: no engines");
        }
        let mut rep = SyncReport {
            bytes: self.plan.total_bytes(),
            buckets: self.plan.buckets.len(),
            tensors: self.plan.num_tensors(),
            ..Default::default()
        };

        // 1. Prepare while the engines still serve.
        let t = Instant::now();
        let prepared = prepare(&self.plan, source)?;
        if self.transport.is_none() {
            self.transport = Some((self.make_transport)()?);
            self.connected = false;
        }
        let tr = self.transport.as_mut().expect("just made");
        tr.stage(0, &self.plan.buckets[0], &prepared[0])
            .context("weight sync: staging bucket 0")?;
        rep.prepare_s = secs(t);

        // 2. Pause.
        let t_paused = Instant::now();
        if self.opts.pause {
            let t = Instant::now();
            same_call(engines, &pause_call(self.opts.clear_cache), d, "POST /pause")?;
            rep.pause_s = secs(t);
        }

        // 3. Init (first sync).
        if !self.connected {
            let t = Instant::now();
            let calls: Vec<Call> = (0..n)
                .map(|i| proto.init(&tr.init_info(i, n), self.plan.buffer_bytes))
                .collect();
            let (http, conn) = std::thread::scope(|s| {
                let h = s.spawn(|| call_all(engines, &calls, d, "init_weight_transfer_engine"));
                let c = tr.connect(n, d);
                (h.join().unwrap_or_else(|_| Err(anyhow!("the HTTP thread panicked"))), c)
            });
            http.map_err(|e| match proto {
                Protocol::WorkerExtension => e.context(
                    "the worker-extension protocol needs vLLM started with --worker-extension-cls \
                     vime_vllm_ext.VimeWorkerExtension and vime's sync/python on its PYTHONPATH",
                ),
                Protocol::Native => e.context(
                    "the native protocol needs vime-serve (or vLLM) started with --weight-transfer-config \
                     for this transport",
                ),
            })?;
            conn.context("weight sync: the transport did not connect to the engines")?;
            self.connected = true;
            rep.init_s = secs(t);
        }

        // 4-5. Start, then the buckets, double-buffered.
        let t_transfer = Instant::now();
        same_call(engines, &proto.start(), d, "start_weight_update")?;
        let nb = self.plan.buckets.len();
        for k in 0..nb {
            let slot = k % 2;
            let bucket = &self.plan.buckets[k];
            let t = Instant::now();
            let mut info = bucket.update_info();
            let extra = tr
                .ready(slot, bucket)
                .with_context(|| format!("weight sync: bucket {k} of {nb}"))?;
            info.as_object_mut().expect("update_info is an object").extend(extra);
            rep.stage_s += secs(t);
            let call = proto.update(&info);
            let what = format!("update_weights, bucket {k} of {nb} ({} bytes)", bucket.nbytes);
            let next = self.plan.buckets.get(k + 1);
            let (http, moved, staged) = std::thread::scope(|s| {
                let h = s.spawn(|| same_call(engines, &call, d, &what));
                let moved = tr.transfer(slot, d);
                let t = Instant::now();
                let staged = match (&moved, next) {
                    (Ok(()), Some(b)) => tr.stage(1 - slot, b, &prepared[k + 1]).map(|_| secs(t)),
                    _ => Ok(0.0),
                };
                let t = Instant::now();
                let r = h.join().unwrap_or_else(|_| Err(anyhow!("the HTTP thread panicked")));
                (r, moved, staged.map(|s| (s, secs(t))))
            });
            // The engines' answer says more than our side's error (which is often the consequence).
            let answers = http?;
            rep.engine_load_s += answers
                .iter()
                .filter_map(|v| v.get("load_s").and_then(Value::as_f64))
                .fold(0.0, f64::max);
            moved.with_context(|| format!("weight sync: moving bucket {k} of {nb} to the engines"))?;
            let (st, wait) = staged.with_context(|| format!("weight sync: staging bucket {} of {nb}", k + 1))?;
            rep.stage_s += st;
            rep.engine_wait_s += wait;
        }
        rep.transfer_s = secs(t_transfer);

        // 6-7. Finish, version, resume, check.
        let t = Instant::now();
        same_call(engines, &proto.finish(version), d, "finish_weight_update")?;
        if self.opts.reset_prefix_cache {
            same_call(engines, &reset_prefix_cache_call(), d, "reset_prefix_cache")?;
        }
        if self.opts.pause {
            same_call(engines, &resume_call(), d, "POST /resume")?;
        }
        rep.paused_s = secs(t_paused);
        let infos = same_call(engines, &proto.weight_info(), d, "weight version check")?;
        let urls = engines.urls();
        for (i, v) in infos.iter().enumerate() {
            let got = proto.parse_version(v);
            if got.as_deref() != Some(version.to_string().as_str()) {
                bail!(
                    "weight sync: engine {i} ({}) reports weight_version {got:?} after the sync, expected \"{version}\"",
                    urls[i]
                );
            }
        }
        rep.finish_s = secs(t);
        rep.total_s = secs(t_all);
        Ok(rep)
    }
}

/// Every tensor of the plan, from `source`, in the transfer dtype, contiguous, checked against
/// the plan.
pub fn prepare(plan: &SyncPlan, source: &dyn Fn(&str) -> Result<Tensor>) -> Result<Vec<Vec<Tensor>>> {
    plan.buckets
        .iter()
        .map(|b| {
            let ts = b
                .tensors
                .iter()
                .map(|s| {
                    let t = source(&s.name).with_context(|| format!("weight sync: reading {}", s.name))?;
                    Ok(t.to_dtype(b.dtype)?.contiguous()?)
                })
                .collect::<Result<Vec<_>>>()?;
            check_sources(b, &ts)?;
            Ok(ts)
        })
        .collect()
}

/// The collective transport: the bucket is broadcast from the trainer (rank 0) to every engine
/// worker over a group of its own.
/// - NCCL (trainer on a GPU): the group forms from an NCCL unique id made here and sent in
///   `init_info.nccl_unique_id_b64` (vLLM 0.33's torch-free rendezvous); every member enters
///   `ncclCommInitRank` while the init calls are in flight.
/// - CPU (trainer on the CPU, what CI runs): vime's CPU backend through a rendezvous store the
///   trainer serves at `master_address:master_port`.
///
/// After forming, every member runs one 1-element f32 sum all-reduce (vLLM's warm-up, which its
/// workers expect the trainer to join).
pub struct BroadcastTransport {
    device: Device,
    backend: BroadcastBackend,
    master_address: String,
    store: Option<vime_dist::store::StoreServer>,
    nccl_id: Vec<u8>,
    group: Option<Box<dyn Collectives>>,
    staged: [Option<Tensor>; 2],
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BroadcastBackend {
    Cpu,
    Nccl,
}

impl BroadcastTransport {
    /// `bind_ip`: the address the engines reach this process on (the CPU rendezvous binds it).
    pub fn new(bind_ip: &str, device: &Device) -> Result<Self> {
        let (backend, store, nccl_id) = if device.is_cuda() {
            #[cfg(feature = "cuda")]
            {
                (BroadcastBackend::Nccl, None, vime_dist::nccl::NcclGroup::unique_id()?)
            }
            #[cfg(not(feature = "cuda"))]
            bail!("NCCL weight sync needs the cuda feature")
        } else {
            let store = vime_dist::store::StoreServer::bind(&format!("{bind_ip}:0"), Duration::from_secs(3600))
                .with_context(|| format!("weight sync: serving the rendezvous on {bind_ip}"))?;
            (BroadcastBackend::Cpu, Some(store), Vec::new())
        };
        Ok(Self {
            device: device.clone(),
            backend,
            master_address: bind_ip.to_string(),
            store,
            nccl_id,
            group: None,
            staged: [None, None],
        })
    }
}

/// The name of the group both sides form.
pub const SYNC_GROUP: &str = "weight-sync";

/// How a member reaches the weight-sync group.
pub enum Rendezvous<'a> {
    /// vime's store at `host:port` (CPU backend).
    Store(&'a str),
    /// A 128-byte NCCL unique id.
    NcclId(&'a [u8]),
}

/// Joins the weight-sync group as `rank` of `world_size`, then runs the warm-up all-reduce.
pub fn join_sync_group(
    how: Rendezvous<'_>,
    rank: usize,
    world_size: usize,
    device: &Device,
    deadline: Duration,
) -> Result<Box<dyn Collectives>> {
    let members: Vec<usize> = (0..world_size).collect();
    let g: Box<dyn Collectives> = match how {
        Rendezvous::Store(addr) => {
            let store = vime_dist::store::StoreClient::connect(addr, rank, deadline)?;
            let t = Timeouts {
                rendezvous: deadline,
                op: deadline,
                ..Timeouts::default()
            };
            Box::new(vime_dist::cpu::CpuGroup::new(&store, SYNC_GROUP, &members, rank, &t)?)
        }
        Rendezvous::NcclId(id) => {
            #[cfg(feature = "cuda")]
            {
                Box::new(vime_dist::nccl::NcclGroup::from_unique_id(
                    SYNC_GROUP, id, rank, &members, device,
                )?)
            }
            #[cfg(not(feature = "cuda"))]
            {
                let _ = id;
                bail!("NCCL weight sync needs the cuda feature")
            }
        }
    };
    let warm = g.all_reduce(&Tensor::zeros(1, DType::F32, device)?, vime_dist::ReduceOp::Sum)?;
    warm.to_vec1::<f32>()
        .context("the weight-sync group's warm-up all-reduce")?;
    Ok(g)
}

impl Transport for BroadcastTransport {
    fn name(&self) -> &'static str {
        match self.backend {
            BroadcastBackend::Cpu => "cpu",
            BroadcastBackend::Nccl => "nccl",
        }
    }

    fn init_info(&self, engine: usize, engines: usize) -> Value {
        let mut v = json!({
            "backend": self.name(),
            "rank_offset": engine + 1,
            "world_size": engines + 1,
        });
        let m = v.as_object_mut().expect("object");
        match (&self.store, self.backend) {
            (Some(store), BroadcastBackend::Cpu) => {
                m.insert("master_address".into(), json!(self.master_address));
                m.insert("master_port".into(), json!(store.addr().port()));
            }
            _ => {
                m.insert("nccl_unique_id_b64".into(), json!(crate::b64::encode(&self.nccl_id)));
            }
        }
        v
    }

    fn connect(&mut self, engines: usize, deadline: Duration) -> Result<()> {
        let how = match &self.store {
            Some(store) => format!("{}:{}", self.master_address, store.addr().port()),
            None => String::new(),
        };
        let how = match self.backend {
            BroadcastBackend::Cpu => Rendezvous::Store(&how),
            BroadcastBackend::Nccl => Rendezvous::NcclId(&self.nccl_id),
        };
        self.group = Some(join_sync_group(how, 0, engines + 1, &self.device, deadline)?);
        Ok(())
    }

    fn stage(&mut self, slot: usize, bucket: &Bucket, tensors: &[Tensor]) -> Result<()> {
        let t = match self.backend {
            BroadcastBackend::Cpu => {
                let bytes = pack_host(bucket, tensors)?;
                Tensor::from_raw_buffer(&bytes, DType::U8, &[bytes.len()], &self.device)?
            }
            BroadcastBackend::Nccl => {
                #[cfg(feature = "cuda")]
                {
                    check_sources(bucket, tensors)?;
                    let buf = Tensor::zeros(bucket.nbytes, DType::U8, &self.device)?;
                    let (base, _) = crate::cuda::tensor_address(&buf)?;
                    let parts: Vec<(&Tensor, usize)> =
                        tensors.iter().zip(&bucket.tensors).map(|(t, s)| (t, s.begin)).collect();
                    crate::cuda::pack_device(crate::cuda::cuda_device(&self.device)?, base, &parts)?;
                    buf
                }
                #[cfg(not(feature = "cuda"))]
                bail!("NCCL weight sync needs the cuda feature")
            }
        };
        self.staged[slot] = Some(t);
        Ok(())
    }

    fn ready(&mut self, _slot: usize, bucket: &Bucket) -> Result<Map<String, Value>> {
        let mut m = Map::new();
        m.insert("packed".into(), json!(true));
        m.insert("nbytes".into(), json!(bucket.nbytes));
        Ok(m)
    }

    fn transfer(&mut self, slot: usize, deadline: Duration) -> Result<()> {
        let g = self
            .group
            .as_ref()
            .ok_or_else(|| anyhow!("the weight-sync group is not formed"))?;
        let t = self.staged[slot]
            .as_ref()
            .ok_or_else(|| anyhow!("internal: buffer {slot} was not staged"))?;
        let _out = g.broadcast(t, 0)?;
        #[cfg(feature = "cuda")]
        if let Device::Cuda(c) = &self.device {
            crate::cuda::wait_stream(&c.cuda_stream(), deadline, "the NCCL broadcast of a weight bucket")?;
        }
        let _ = deadline;
        Ok(())
    }
}

/// The CUDA IPC transport (same GPU): two `cuMemAlloc` buffers of the largest bucket, exported
/// once; a bucket is copied in on our stream, the stream is synchronized, and the handle goes out in
/// `update_info` (`ipc_handle_b64`). The buffers live as long as the transport, so an engine can
/// keep its mapping of them open between syncs.
#[cfg(feature = "cuda")]
pub struct IpcTransport {
    device: candle_core::CudaDevice,
    uuid: String,
    buffers: [crate::cuda::IpcBuffer; 2],
}

#[cfg(feature = "cuda")]
impl IpcTransport {
    pub fn new(device: &Device, plan: &SyncPlan) -> Result<Self> {
        let d = crate::cuda::cuda_device(device)?.clone();
        let max = plan.buckets.iter().map(|b| b.nbytes).max().unwrap_or(0);
        let buffers = [
            crate::cuda::IpcBuffer::new(&d, max)?,
            crate::cuda::IpcBuffer::new(&d, max)?,
        ];
        Ok(Self {
            uuid: crate::cuda::device_uuid(&d)?,
            device: d,
            buffers,
        })
    }
}

#[cfg(feature = "cuda")]
impl Transport for IpcTransport {
    fn name(&self) -> &'static str {
        "ipc"
    }

    fn init_info(&self, _engine: usize, _engines: usize) -> Value {
        json!({"backend": "ipc", "device_uuid": self.uuid})
    }

    fn connect(&mut self, _engines: usize, _deadline: Duration) -> Result<()> {
        Ok(())
    }

    fn stage(&mut self, slot: usize, bucket: &Bucket, tensors: &[Tensor]) -> Result<()> {
        check_sources(bucket, tensors)?;
        let parts: Vec<(&Tensor, usize)> = tensors.iter().zip(&bucket.tensors).map(|(t, s)| (t, s.begin)).collect();
        crate::cuda::pack_device(&self.device, self.buffers[slot].ptr(), &parts)
    }

    fn ready(&mut self, slot: usize, bucket: &Bucket) -> Result<Map<String, Value>> {
        self.device
            .cuda_stream()
            .synchronize()
            .map_err(|e| anyhow!("CUDA stream synchronize: {e:?}"))?;
        let mut m = Map::new();
        m.insert("packed".into(), json!(true));
        m.insert("nbytes".into(), json!(bucket.nbytes));
        m.insert(
            "ipc_handle_b64".into(),
            json!(crate::b64::encode(self.buffers[slot].handle())),
        );
        Ok(m)
    }

    fn transfer(&mut self, _slot: usize, _deadline: Duration) -> Result<()> {
        Ok(())
    }
}
