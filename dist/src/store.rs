//! The rendezvous store: rank 0 serves a small TCP key-value store at `MASTER_ADDR:MASTER_PORT`
//! (torch's TCPStore, cut down to what vime needs): `set`, `get` (waits for the key, with a
//! deadline), `add` (a counter). It is also where failures are decided: every rank keeps one
//! heartbeat connection open (see [`crate::watchdog`]); EOF or silence on it without a goodbye
//! records `failed = rank N (reason)`, which every other rank's watchdog then reads.
//!
//! Decisions:
//! - One thread per connection and a `Mutex` + `Condvar` over the map: the store sees a handful
//!   of requests per group creation, not a data path.
//! - Frames are `u32` little-endian length + payload, capped at [`MAX_FRAME`]; a malformed frame
//!   closes that connection with an error reply, never panics the server.
//! - Every wait has a deadline: clients connect with retries until the rendezvous timeout, a `get`
//!   carries its own timeout, sockets have read timeouts.
//! - A `get` that is waiting when a rank fails returns the failure at once, so a rendezvous that a
//!   dead rank can no longer complete does not sit out its deadline.
use anyhow::{anyhow, bail, Context, Result};
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The largest frame either side accepts (values are ids and addresses, not tensors).
pub const MAX_FRAME: usize = 16 << 20;

pub(crate) mod op {
    pub const SET: u8 = 1;
    pub const GET: u8 = 2;
    pub const ADD: u8 = 3;
    /// Turns the connection into rank N's heartbeat connection.
    pub const HEARTBEAT: u8 = 4;
    pub const PING: u8 = 5;
    pub const BYE: u8 = 6;
}

pub(crate) mod reply {
    pub const OK: u8 = 0;
    pub const TIMEOUT: u8 = 1;
    pub const FAILED: u8 = 2;
    pub const ERROR: u8 = 3;
}

/// A rank the store has declared dead, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    pub rank: usize,
    pub reason: String,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} ({})", self.rank, self.reason)
    }
}

impl Failure {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let mut out = (self.rank as u64).to_le_bytes().to_vec();
        out.extend_from_slice(self.reason.as_bytes());
        out
    }

    pub(crate) fn decode(b: &[u8]) -> Failure {
        match b.split_first_chunk::<8>() {
            Some((r, reason)) => Failure {
                rank: u64::from_le_bytes(*r) as usize,
                reason: String::from_utf8_lossy(reason).into_owned(),
            },
            None => Failure {
                rank: usize::MAX,
                reason: "malformed failure record".into(),
            },
        }
    }
}

pub(crate) fn write_frame(mut w: &TcpStream, payload: &[u8]) -> io::Result<()> {
    if payload.len() > MAX_FRAME {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "frame over MAX_FRAME"));
    }
    let mut buf = Vec::with_capacity(4 + payload.len());
    buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    buf.extend_from_slice(payload);
    w.write_all(&buf)
}

pub(crate) fn read_frame(mut r: &TcpStream) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes is over the {MAX_FRAME}-byte limit"),
        ));
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf)?;
    Ok(buf)
}

/// A reader over a request payload that answers `None` instead of panicking on short input.
struct Parse<'a>(&'a [u8]);

impl<'a> Parse<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
    }
    fn key(&mut self) -> Option<String> {
        let n = u32::from_le_bytes(self.take(4)?.try_into().ok()?) as usize;
        String::from_utf8(self.take(n)?.to_vec()).ok()
    }
    fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.0)
    }
}

fn put_key(out: &mut Vec<u8>, key: &str) {
    out.extend_from_slice(&(key.len() as u32).to_le_bytes());
    out.extend_from_slice(key.as_bytes());
}

#[derive(Default)]
struct State {
    kv: HashMap<String, Vec<u8>>,
    failed: Option<Failure>,
    goodbye: HashSet<usize>,
    /// Ranks with an open heartbeat connection.
    alive: HashSet<usize>,
    /// Ranks whose heartbeat has been answered with the failure record.
    told: HashSet<usize>,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
    stop: AtomicBool,
    heartbeat_timeout: Duration,
    /// Clones of every accepted connection, shut down when the server stops so that clients see
    /// EOF instead of a silent socket.
    conns: Mutex<HashMap<u64, TcpStream>>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A poisoned lock only means a connection thread panicked; the map is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn fail(&self, rank: usize, reason: String) {
        let mut s = self.lock();
        if s.failed.is_none() && !s.goodbye.contains(&rank) {
            s.failed = Some(Failure { rank, reason });
        }
        self.changed.notify_all();
    }
}

/// Rank 0's store server. Stops (and closes every connection) on drop.
pub struct StoreServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Serves at `addr` (`host:port`; port 0 picks a free one, see [`StoreServer::addr`]).
    /// `heartbeat_timeout`: how long a heartbeat connection may stay silent before its rank is
    /// declared dead.
    pub fn bind(addr: &str, heartbeat_timeout: Duration) -> Result<Self> {
        let listener = TcpListener::bind(addr)
            .or_else(|e| {
                // MASTER_ADDR may name this host by an address it cannot bind (a NAT, a
                // hostname resolving elsewhere); serve on every interface at that port instead.
                let port = addr.rsplit(':').next().unwrap_or("0");
                TcpListener::bind(format!("0.0.0.0:{port}")).map_err(|_| e)
            })
            .with_context(|| format!("rank 0: cannot serve the rendezvous store at {addr}"))?;
        listener.set_nonblocking(true)?;
        let local = listener.local_addr()?;
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            stop: AtomicBool::new(false),
            heartbeat_timeout,
            conns: Mutex::new(HashMap::new()),
        });
        let sh = shared.clone();
        let accept = std::thread::Builder::new()
            .name("vime-store".into())
            .spawn(move || accept_loop(listener, sh))?;
        Ok(StoreServer {
            addr: local,
            shared,
            accept: Some(accept),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn failure(&self) -> Option<Failure> {
        self.shared.lock().failed.clone()
    }

    /// A handle that rank 0's failure handler uses to keep the store up until the others have
    /// read the failure record (see [`Linger::wait_told`]).
    pub fn linger(&self) -> Linger {
        Linger(self.shared.clone())
    }

    /// Waits until ranks `0..world` have all said goodbye; an error if a rank fails first or the
    /// deadline passes (naming the ranks still missing).
    pub fn wait_goodbyes(&self, world: usize, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut s = self.shared.lock();
        loop {
            if let Some(f) = &s.failed {
                bail!("rank 0: {f} before every rank finished");
            }
            let missing: Vec<usize> = (0..world).filter(|r| !s.goodbye.contains(r)).collect();
            if missing.is_empty() {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                bail!(
                    "rank 0: ranks {missing:?} did not finish within {} s of rank 0",
                    timeout.as_secs()
                );
            }
            s = self
                .shared
                .changed
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
        for (_, c) in self.shared.conns.lock().unwrap_or_else(|e| e.into_inner()).drain() {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        self.shared.changed.notify_all();
    }
}

/// Lets rank 0, about to exit because another rank died, wait until every other live rank has
/// read the failure record: otherwise they would see the store vanish and blame rank 0.
pub struct Linger(Arc<Shared>);

impl Linger {
    /// Waits (at most `timeout`) until every rank with a live heartbeat has been told.
    pub fn wait_told(&self, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        let mut s = self.0.lock();
        loop {
            if s.failed.is_none() || s.alive.iter().all(|r| s.told.contains(r)) {
                return;
            }
            let now = Instant::now();
            if now >= deadline {
                return;
            }
            s = self
                .0
                .changed
                .wait_timeout(s, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut next_id = 0u64;
    while !shared.stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                let _ = stream.set_nonblocking(false);
                let _ = stream.set_nodelay(true);
                let id = next_id;
                next_id += 1;
                if let Ok(c) = stream.try_clone() {
                    shared.conns.lock().unwrap_or_else(|e| e.into_inner()).insert(id, c);
                }
                let sh = shared.clone();
                let _ = std::thread::Builder::new()
                    .name("vime-store-conn".into())
                    .spawn(move || {
                        serve(&stream, &sh);
                        // Close for real: the clone kept for shutdown would hold it open.
                        let _ = stream.shutdown(std::net::Shutdown::Both);
                        sh.conns.lock().unwrap_or_else(|e| e.into_inner()).remove(&id);
                    });
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(10)),
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

fn respond(s: &TcpStream, code: u8, body: &[u8]) -> io::Result<()> {
    let mut out = Vec::with_capacity(1 + body.len());
    out.push(code);
    out.extend_from_slice(body);
    write_frame(s, &out)
}

fn serve(stream: &TcpStream, shared: &Shared) {
    while let Ok(req) = read_frame(stream) {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let mut p = Parse(&req);
        let ok = match p.u8() {
            Some(op::SET) => match p.key() {
                Some(k) => {
                    let v = p.rest().to_vec();
                    shared.lock().kv.insert(k, v);
                    shared.changed.notify_all();
                    respond(stream, reply::OK, &[])
                }
                None => return refuse(stream, "malformed SET"),
            },
            Some(op::GET) => match (p.u64(), p.key()) {
                (Some(ms), Some(k)) => {
                    let (code, body) = wait_key(shared, &k, Duration::from_millis(ms));
                    respond(stream, code, &body)
                }
                _ => return refuse(stream, "malformed GET"),
            },
            Some(op::ADD) => match (p.u64(), p.key()) {
                (Some(d), Some(k)) => {
                    let mut s = shared.lock();
                    let cur =
                        s.kv.get(&k)
                            .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
                            .map(i64::from_le_bytes)
                            .unwrap_or(0);
                    let new = cur.wrapping_add(d as i64);
                    s.kv.insert(k, new.to_le_bytes().to_vec());
                    drop(s);
                    shared.changed.notify_all();
                    respond(stream, reply::OK, &new.to_le_bytes())
                }
                _ => return refuse(stream, "malformed ADD"),
            },
            Some(op::HEARTBEAT) => match p.u64() {
                Some(rank) => {
                    if respond(stream, reply::OK, &[]).is_ok() {
                        heartbeat(stream, shared, rank as usize);
                    }
                    return;
                }
                None => return refuse(stream, "malformed HEARTBEAT"),
            },
            _ => return refuse(stream, "unknown request"),
        };
        if ok.is_err() {
            return;
        }
    }
}

/// Answers a bad request with an error and closes the connection (its framing can't be trusted).
fn refuse(stream: &TcpStream, why: &str) {
    let _ = respond(stream, reply::ERROR, why.as_bytes());
}

fn wait_key(shared: &Shared, key: &str, timeout: Duration) -> (u8, Vec<u8>) {
    let deadline = Instant::now() + timeout;
    let mut s = shared.lock();
    loop {
        if let Some(v) = s.kv.get(key) {
            return (reply::OK, v.clone());
        }
        if let Some(f) = &s.failed {
            return (reply::FAILED, f.encode());
        }
        let now = Instant::now();
        if now >= deadline || shared.stop.load(Ordering::SeqCst) {
            return (reply::TIMEOUT, Vec::new());
        }
        s = shared
            .changed
            .wait_timeout(s, deadline - now)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

/// Rank `rank`'s heartbeat connection: PINGs are answered with the failure record (if any);
/// a goodbye marks the rank finished; EOF, an error or silence without one marks it dead.
fn heartbeat(stream: &TcpStream, shared: &Shared, rank: usize) {
    let _ = stream.set_read_timeout(Some(shared.heartbeat_timeout));
    shared.lock().alive.insert(rank);
    heartbeat_loop(stream, shared, rank);
    shared.lock().alive.remove(&rank);
    shared.changed.notify_all();
}

fn heartbeat_loop(stream: &TcpStream, shared: &Shared, rank: usize) {
    loop {
        let req = match read_frame(stream) {
            Ok(r) => r,
            Err(e) => {
                let reason = match e.kind() {
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => {
                        format!("no heartbeat for {} s", shared.heartbeat_timeout.as_secs_f32())
                    }
                    io::ErrorKind::UnexpectedEof | io::ErrorKind::ConnectionReset => {
                        "its connection closed without a goodbye: the process exited or gave up".into()
                    }
                    _ => format!("heartbeat connection error: {e}"),
                };
                if !shared.stop.load(Ordering::SeqCst) {
                    shared.fail(rank, reason);
                }
                return;
            }
        };
        let sent = match req.first() {
            Some(&op::PING) => {
                let failed = shared.lock().failed.clone();
                match failed {
                    Some(f) => {
                        let sent = respond(stream, reply::FAILED, &f.encode());
                        shared.lock().told.insert(rank);
                        shared.changed.notify_all();
                        sent
                    }
                    None => respond(stream, reply::OK, &[]),
                }
            }
            Some(&op::BYE) => {
                shared.lock().goodbye.insert(rank);
                shared.changed.notify_all();
                respond(stream, reply::OK, &[])
            }
            _ => respond(stream, reply::ERROR, b"unknown heartbeat request"),
        };
        if sent.is_err() {
            // Writing failed: the rank is gone unless it said goodbye (`fail` checks that).
            shared.fail(rank, "heartbeat connection closed".into());
            return;
        }
    }
}

/// One connection to the store. Requests are synchronous; `&self` methods, one caller at a time.
pub struct StoreClient {
    stream: TcpStream,
    addr: String,
    rank: usize,
    timeout: Duration,
}

impl StoreClient {
    /// Connects to `addr` with retries until `timeout` (the rendezvous deadline) has passed.
    pub fn connect(addr: &str, rank: usize, timeout: Duration) -> Result<Self> {
        let deadline = Instant::now() + timeout;
        loop {
            let attempt = addr
                .to_socket_addrs()
                .map_err(|e| e.to_string())
                .and_then(|mut a| a.next().ok_or_else(|| "resolves to no address".to_string()))
                .and_then(|a| {
                    let left = deadline.saturating_duration_since(Instant::now());
                    let t = left.clamp(Duration::from_millis(10), Duration::from_secs(2));
                    TcpStream::connect_timeout(&a, t).map_err(|e| e.to_string())
                });
            match attempt {
                Ok(stream) => {
                    stream.set_nodelay(true)?;
                    return Ok(StoreClient {
                        stream,
                        addr: addr.to_string(),
                        rank,
                        timeout,
                    });
                }
                Err(e) if Instant::now() < deadline => drop(e),
                Err(e) => bail!(
                    "rank {rank}: no rendezvous at {addr} after {} s (is rank 0 running?): {e}",
                    fmt_secs(timeout)
                ),
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn addr(&self) -> &str {
        &self.addr
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The local address of this connection: the address this host uses to reach rank 0, which
    /// is where peers can reach this host too.
    pub fn local_ip(&self) -> Result<std::net::IpAddr> {
        Ok(self.stream.local_addr()?.ip())
    }

    pub(crate) fn into_stream(self) -> TcpStream {
        self.stream
    }

    fn request(&self, req: &[u8], wait: Duration) -> Result<(u8, Vec<u8>)> {
        let lost = |e: io::Error| {
            anyhow!(
                "rank {}: lost the rendezvous store at {} (did rank 0 die?): {e}",
                self.rank,
                self.addr
            )
        };
        self.stream.set_read_timeout(Some(wait + Duration::from_secs(5)))?;
        write_frame(&self.stream, req).map_err(lost)?;
        let resp = read_frame(&self.stream).map_err(lost)?;
        match resp.split_first() {
            Some((&code, body)) => Ok((code, body.to_vec())),
            None => bail!("rank {}: empty reply from the store at {}", self.rank, self.addr),
        }
    }

    fn check(&self, what: &str, code: u8, body: &[u8]) -> Result<()> {
        match code {
            reply::OK => Ok(()),
            reply::FAILED => bail!("rank {}: {} died while {what}", self.rank, Failure::decode(body)),
            _ => bail!(
                "rank {}: the store at {} refused {what}: {}",
                self.rank,
                self.addr,
                String::from_utf8_lossy(body)
            ),
        }
    }

    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        let mut req = vec![op::SET];
        put_key(&mut req, key);
        req.extend_from_slice(value);
        let (code, body) = self.request(&req, self.timeout)?;
        self.check(&format!("setting `{key}`"), code, &body)
    }

    /// The value of `key`, waiting up to `timeout` for some rank to set it.
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let mut req = vec![op::GET];
        req.extend_from_slice(&(timeout.as_millis() as u64).to_le_bytes());
        put_key(&mut req, key);
        let (code, body) = self.request(&req, timeout)?;
        if code == reply::TIMEOUT {
            bail!(
                "rank {}: `{key}` did not appear in the store at {} within {} s",
                self.rank,
                self.addr,
                fmt_secs(timeout)
            );
        }
        self.check(&format!("waiting for `{key}`"), code, &body)?;
        Ok(body)
    }

    /// Adds `delta` to the counter `key` (0 when unset) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut req = vec![op::ADD];
        req.extend_from_slice(&delta.to_le_bytes());
        put_key(&mut req, key);
        let (code, body) = self.request(&req, self.timeout)?;
        self.check(&format!("adding to `{key}`"), code, &body)?;
        let b: [u8; 8] = body
            .as_slice()
            .try_into()
            .map_err(|_| anyhow!("rank {}: malformed ADD reply", self.rank))?;
        Ok(i64::from_le_bytes(b))
    }
}

pub(crate) fn fmt_secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{s:.0}")
    } else {
        format!("{s:.1}")
    }
}
