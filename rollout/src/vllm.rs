//! The vLLM side of rollouts: [`VllmClient`] (a [`RolloutEngine`] over HTTP, to vLLM 0.33 engines
//! directly or through vllm-router, or to `vime-serve`) and [`VllmLauncher`] (`vllm serve` children).
//!
//! What it speaks, as vLLM 0.33.0 defines it (wheel `vllm-0.33.0`, paths under `vllm/`; see
//! [`crate::serve`] for the response shapes):
//! - `POST /v1/completions` with the prompt as token ids, `return_token_ids: true`, `logprobs: 0`:
//!   the sample is `choices[0].token_ids` and its log-probs `choices[0].logprobs.token_logprobs`
//!   (`entrypoints/openai/completion/{protocol,serving}.py`). One HTTP request per sample (`n = 1`),
//!   so retries and load balancing are per sample.
//! - Control, query parameters only: `POST /pause?mode=`, `POST /resume`, `GET /is_paused`
//!   (`entrypoints/rl/online/api_router.py`); `POST /sleep?level=`, `POST /wake_up?tags=..&tags=..`
//!   (`entrypoints/serve/dev/sleep/api_router.py`, `v1/engine/core.py::wake_up`; vLLM knows the tags
//!   `weights`, `kv_cache` and `scheduling` and only logs a warning for others, so others are refused here); `POST /reset_prefix_cache`
//!   (`entrypoints/serve/dev/cache/api_router.py`); `POST /collective_rpc {method, args, kwargs}` with
//!   string arguments (`entrypoints/serve/dev/rpc/api_router.py`). These need the engines started with
//!   `VLLM_SERVER_DEV_MODE=1` (`entrypoints/launchers/api_server/routers.py`).
//! - Weights from a directory: `collective_rpc("reload_weights", kwargs={"weights_path": DIR})`
//!   (`v1/worker/gpu_model_runner.py::reload_weights`, in place, HF checkpoint format), then
//!   `POST /update_weight_version {"new_version": "<n>"}` (`entrypoints/rl/online/api_router.py`).
//! - vllm-router (the Rust `vllm-project/router`, `pip install vllm-router`, `src/server.rs`):
//!   `POST /workers {"url": URL}` to register, `DELETE /workers/{url-encoded URL}` to deregister
//!   (the path segment is the URL, percent-encoded like Python's `quote(url, safe="")`, not a worker
//!   id). The router only forwards generation; control calls go to each engine's own URL.
//!
//! Decisions:
//! - The client never scores a failure as a sample: a request either returns a well-formed completion
//!   (token ids and one log-prob each) or `generate` fails with an error naming the URL(s) it tried.
//!   `finish_reason: "abort"` (engine paused with `mode=abort`) is passed through as
//!   [`FinishReason::Abort`] for the caller to resample.
//! - Retries: connection errors, timeouts, 408/429 and 5xx (503 is what a paused engine answers)
//!   are retried with exponential backoff, preferring engines that have not failed this request;
//!   other 4xx fail at once with the engine's message. Everything is bounded: `max_retries`,
//!   `request_timeout` per attempt, `retry_backoff_max`.
//! - Liveness: `/health` stays 200 while a vLLM engine is wedged (in a weight transfer, a stuck
//!   collective), and a stopped process does not answer at all, so an attempt that has waited
//!   `liveness_interval` gets its engine probed by a 1-token completion that must answer within
//!   `liveness_timeout` (one probe per engine at a time, its verdict shared by every request on it).
//!   A failed probe fails the attempt as retryable, naming the engine as hung, and new requests
//!   avoid that engine until it answers again. Through a router the registered engines are probed
//!   the same way (`prune_dead_workers`) and a hung one is deregistered.
//! - Engine choice without a router: least in-flight requests, ties broken round-robin.
//! - Backpressure: a semaphore of `max_concurrent_requests` HTTP requests across all engines.
//! - The trait is sync; the client owns a tokio runtime and blocks on it (from a helper thread when
//!   called inside another runtime).
//! - `update_weights_from_dir` pauses the engines with `mode=keep` around the reload unless the caller
//!   already paused them, so no completion mixes weights; `weight_version` is the client's own counter,
//!   also written to every engine with `/update_weight_version`. A weight sync's caller bounds its
//!   control calls with its own deadline ([`VllmClient::update_weights_from_dir_within`], the
//!   trainer's `--update-weight-timeout`); other control calls get `control_timeout` per attempt.
//! - The launcher binds each engine to 127.0.0.1 unless given a host (`--vllm-host`), and runs it with
//!   `VLLM_SERVER_DEV_MODE=1` (the sync needs the dev endpoints), saying so in one line per engine
//!   with its address (a warning when that is not loopback); `VIME_ALLOWED_WEIGHTS_ROOT` tells a
//!   vime-serve engine where `reload_weights` may read (vLLM has no such check and ignores it).
//!   Each engine runs in its own process group, logs to
//!   `<log_dir>/vllm-engine-<i>.log`, waits for `GET /health` up to a deadline (failing early with
//!   the log's tail when a child exits), and on drop sends SIGTERM to each group, then SIGKILL after
//!   a grace period. Children also get SIGTERM if the launching thread dies (`PR_SET_PDEATHSIG`):
//!   launch from a thread that lives as long as the engines should (the main thread).
use crate::engine::{FinishReason, GenOutput, GenRequest, RolloutEngine};
pub use crate::serve::PauseMode;
use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Map, Value};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

/// How the client reaches its engines.
#[derive(Debug, Clone)]
pub struct VllmClientConfig {
    /// Engine base URLs (`http://host:port`). With a router these are registered with it and still
    /// receive the control calls (pause, weights, sleep) directly.
    pub engine_urls: Vec<String>,
    /// vllm-router base URL: generation goes through it.
    pub router_url: Option<String>,
    /// `model` field of each request; `None` leaves it out (vLLM then uses its only model).
    pub model: Option<String>,
    /// Most HTTP generation requests in flight at once, over all engines.
    pub max_concurrent_requests: usize,
    /// Limit for one generation attempt.
    pub request_timeout: Duration,
    /// Limit for one control call (pause, resume, reload_weights, ...).
    pub control_timeout: Duration,
    /// Retries after the first attempt, per request.
    pub max_retries: u32,
    /// First backoff; doubles per retry up to `retry_backoff_max`.
    pub retry_backoff: Duration,
    pub retry_backoff_max: Duration,
    /// An attempt that has waited this long gets its engine probed (see the module docs).
    pub liveness_interval: Duration,
    /// How long the 1-token probe may take before the engine counts as hung.
    pub liveness_timeout: Duration,
}

impl Default for VllmClientConfig {
    fn default() -> Self {
        Self {
            engine_urls: Vec::new(),
            router_url: None,
            model: None,
            max_concurrent_requests: 256,
            request_timeout: Duration::from_secs(3600),
            control_timeout: Duration::from_secs(1800),
            max_retries: 5,
            retry_backoff: Duration::from_millis(500),
            retry_backoff_max: Duration::from_secs(8),
            liveness_interval: Duration::from_secs(60),
            liveness_timeout: Duration::from_secs(60),
        }
    }
}

/// Counters since the client was made (for metrics and tests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ClientStats {
    /// Generation requests answered with a completion.
    pub completed: u64,
    /// Attempts repeated after a retryable failure.
    pub retries: u64,
    /// Generation requests given up on.
    pub failed: u64,
    /// Engines deregistered from the router because they stopped answering `/health` or a
    /// 1-token probe.
    pub deregistered_dead: u64,
    /// Liveness probes sent (1-token completions), and those that failed.
    pub liveness_probes: u64,
    pub hung_detected: u64,
}

struct EngineSlot {
    url: String,
    in_flight: AtomicUsize,
    /// The last liveness probe: when it ended and why it failed (`None`: the engine answered).
    probe: tokio::sync::Mutex<Option<(Instant, Option<String>)>>,
    /// The last probe failed: new requests go elsewhere while another engine is usable.
    hung: AtomicBool,
}

struct Inner {
    cfg: VllmClientConfig,
    http: reqwest::Client,
    engines: Vec<EngineSlot>,
    router: Option<EngineSlot>,
    rr: AtomicUsize,
    sem: Semaphore,
    weight_version: AtomicU64,
    /// The engines answered 404 to `/update_weight_version` (vLLM < 0.33): not called again.
    no_version_route: AtomicBool,
    user_paused: AtomicBool,
    registered: Mutex<Vec<String>>,
    /// The engines this client added to the router (removed again at shutdown); the others were
    /// there already and stay.
    owned: Mutex<Vec<String>>,
    /// When the router's workers were last probed after a failed attempt (one probe at a time).
    last_prune: tokio::sync::Mutex<Option<Instant>>,
    deregistered_dead: AtomicU64,
    /// Engines deregistered as dead, with why (named in a later failure's error).
    dead: Mutex<Vec<String>>,
    completed: AtomicU64,
    retries: AtomicU64,
    failed: AtomicU64,
    liveness_probes: AtomicU64,
    hung_detected: AtomicU64,
}

/// A [`RolloutEngine`] backed by vLLM 0.33 HTTP engines (or `vime-serve`).
pub struct VllmClient {
    inner: Arc<Inner>,
    rt: Option<tokio::runtime::Runtime>,
}

/// Why one attempt failed, and whether another may succeed.
struct AttemptError {
    retryable: bool,
    message: String,
}

fn trim_url(u: &str) -> String {
    u.trim_end_matches('/').to_string()
}

/// Python's `urllib.parse.quote(s, safe="")`: everything but `A-Za-z0-9_.-~` percent-encoded.
pub fn url_encode_component(s: &str) -> String {
    let mut out = String::with_capacity(s.len() * 3);
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl VllmClient {
    /// Builds the client; with a router, registers every engine URL with it (`POST /workers`).
    pub fn connect(cfg: VllmClientConfig) -> Result<Self> {
        if cfg.engine_urls.is_empty() && cfg.router_url.is_none() {
            bail!("the vLLM client needs at least one engine URL (--vllm-url) or a router URL (--vllm-router-url)");
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("vime-vllm-client")
            .enable_all()
            .build()
            .context("starting the vLLM client's tokio runtime")?;
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .pool_idle_timeout(Duration::from_secs(30))
            .build()
            .context("building the HTTP client")?;
        let slot = |u: &String| EngineSlot {
            url: trim_url(u),
            in_flight: AtomicUsize::new(0),
            probe: tokio::sync::Mutex::new(None),
            hung: AtomicBool::new(false),
        };
        let inner = Arc::new(Inner {
            engines: cfg.engine_urls.iter().map(slot).collect(),
            router: cfg.router_url.as_ref().map(slot),
            sem: Semaphore::new(cfg.max_concurrent_requests.max(1)),
            cfg,
            http,
            rr: AtomicUsize::new(0),
            weight_version: AtomicU64::new(0),
            no_version_route: AtomicBool::new(false),
            user_paused: AtomicBool::new(false),
            registered: Mutex::new(Vec::new()),
            owned: Mutex::new(Vec::new()),
            last_prune: tokio::sync::Mutex::new(None),
            deregistered_dead: AtomicU64::new(0),
            dead: Mutex::new(Vec::new()),
            completed: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            liveness_probes: AtomicU64::new(0),
            hung_detected: AtomicU64::new(0),
        });
        let client = Self { inner, rt: Some(rt) };
        if client.inner.router.is_some() {
            let inner = client.inner.clone();
            client.block(async move { inner.register_all().await })?;
        }
        Ok(client)
    }

    fn block<F>(&self, f: F) -> F::Output
    where
        F: std::future::Future + Send,
        F::Output: Send,
    {
        let rt = self.rt.as_ref().expect("runtime lives until drop");
        if tokio::runtime::Handle::try_current().is_ok() {
            std::thread::scope(|s| s.spawn(|| rt.block_on(f)).join().expect("vLLM client thread panicked"))
        } else {
            rt.block_on(f)
        }
    }

    /// Engine URLs (control calls go here).
    pub fn engine_urls(&self) -> Vec<String> {
        self.inner.engines.iter().map(|e| e.url.clone()).collect()
    }

    /// The engine URLs registered with the router now (dead ones are dropped, see `prune_dead_workers`).
    pub fn registered_workers(&self) -> Vec<String> {
        self.inner.registered.lock().unwrap().clone()
    }

    /// The router's own list of its workers (`GET /workers`: `{"workers": [{"url": ..}, ..]}`, or
    /// plain URL strings); `None` without a router.
    pub fn router_listed_workers(&self) -> Result<Option<Vec<String>>> {
        let Some(router) = self.inner.router.as_ref().map(|r| r.url.clone()) else {
            return Ok(None);
        };
        let inner = self.inner.clone();
        let v = self
            .block(async move {
                inner
                    .control_one(&router, reqwest::Method::GET, "/workers", None, None)
                    .await
            })
            .map_err(|e| anyhow!("GET /workers on the router: {e}"))?;
        parse_router_workers(&v).map(Some)
    }

    pub fn stats(&self) -> ClientStats {
        ClientStats {
            completed: self.inner.completed.load(Ordering::Relaxed),
            retries: self.inner.retries.load(Ordering::Relaxed),
            failed: self.inner.failed.load(Ordering::Relaxed),
            deregistered_dead: self.inner.deregistered_dead.load(Ordering::Relaxed),
            liveness_probes: self.inner.liveness_probes.load(Ordering::Relaxed),
            hung_detected: self.inner.hung_detected.load(Ordering::Relaxed),
        }
    }

    /// The async form of [`RolloutEngine::generate`].
    pub async fn generate_async(&self, requests: &[GenRequest]) -> Result<Vec<GenOutput>> {
        self.inner.clone().generate(requests.to_vec()).await
    }

    /// Waits until every engine (and the router) answers `GET /health` with 200.
    pub fn wait_healthy(&self, timeout: Duration) -> Result<()> {
        let inner = self.inner.clone();
        self.block(async move {
            let deadline = Instant::now() + timeout;
            let urls: Vec<String> = inner
                .engines
                .iter()
                .chain(inner.router.iter())
                .map(|e| e.url.clone())
                .collect();
            for u in urls {
                loop {
                    let ok = inner
                        .http
                        .get(format!("{u}/health"))
                        .timeout(Duration::from_secs(5))
                        .send()
                        .await
                        .is_ok_and(|r| r.status().is_success());
                    if ok {
                        break;
                    }
                    if Instant::now() >= deadline {
                        bail!("vLLM engine {u} is not healthy (GET /health) after {timeout:?}");
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
            Ok(())
        })
    }

    /// `GET /version` of every engine, in `engine_urls` order: `Some("0.26.0")` for vLLM, `None`
    /// for an engine without the route (404, vime-serve).
    pub fn engine_versions(&self) -> Result<Vec<Option<String>>> {
        use vime_sync::EngineControl;
        (0..self.inner.engines.len())
            .map(
                |i| match self.call(i, &vime_sync::Call::get("/version"), self.inner.cfg.control_timeout) {
                    Ok(v) => Ok(v.get("version").and_then(Value::as_str).map(str::to_string)),
                    Err(e) if format!("{e:#}").contains("HTTP 404") => Ok(None),
                    Err(e) => Err(e.context(format!("asking {} for its version", self.inner.engines[i].url))),
                },
            )
            .collect()
    }

    /// [`RolloutEngine::update_weights_from_dir`] with each of its control calls (pause, reload,
    /// version, resume; retries included) bounded by `deadline` rather than `control_timeout` per
    /// attempt: a hung engine fails the sync after about `deadline`, the error naming its URL.
    pub fn update_weights_from_dir_within(&self, dir: &Path, deadline: Duration) -> Result<()> {
        let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
        let inner = self.inner.clone();
        self.block(async move { inner.update_weights(&dir, Some(deadline)).await })
    }

    /// `POST /pause?mode=` on every engine; returns once all are paused.
    pub fn pause(&self, mode: PauseMode) -> Result<()> {
        self.inner.user_paused.store(true, Ordering::SeqCst);
        let inner = self.inner.clone();
        self.block(async move { inner.pause_all(mode, None).await })
    }

    /// `POST /resume` on every engine.
    pub fn resume(&self) -> Result<()> {
        self.inner.user_paused.store(false, Ordering::SeqCst);
        let inner = self.inner.clone();
        self.block(async move { inner.resume_all(None).await })
    }

    /// `GET /is_paused` of every engine, in `engine_urls` order.
    pub fn is_paused(&self) -> Result<Vec<bool>> {
        let inner = self.inner.clone();
        self.block(async move {
            let vals = inner.control_all(reqwest::Method::GET, "/is_paused", None).await?;
            vals.iter()
                .zip(&inner.engines)
                .map(|(v, e)| {
                    v.get("is_paused")
                        .and_then(Value::as_bool)
                        .ok_or_else(|| anyhow!("{}: bad /is_paused answer {v}", e.url))
                })
                .collect()
        })
    }

    /// `POST /sleep?level=` (0: pause only, 1: offload weights and drop KV cache, 2: drop both).
    pub fn sleep(&self, level: u8) -> Result<()> {
        if level > 2 {
            bail!("sleep level must be 0, 1 or 2, got {level}");
        }
        let inner = self.inner.clone();
        self.block(async move {
            inner
                .control_all(reqwest::Method::POST, &format!("/sleep?level={level}"), None)
                .await
        })?;
        Ok(())
    }

    /// `POST /wake_up?tags=..` with vLLM's tags (`weights`, `kv_cache`, and `scheduling` for a
    /// level-0 sleep); empty wakes everything. Colocated training wakes `weights` first, loads new
    /// weights, then wakes `kv_cache`.
    pub fn wake_up(&self, tags: &[&str]) -> Result<()> {
        for t in tags {
            if !matches!(*t, "weights" | "kv_cache" | "scheduling") {
                bail!("vLLM 0.33 wake_up knows the tags \"weights\", \"kv_cache\" and \"scheduling\" only, got {t:?}");
            }
        }
        let q: Vec<String> = tags.iter().map(|t| format!("tags={t}")).collect();
        let path = if q.is_empty() {
            "/wake_up".to_string()
        } else {
            format!("/wake_up?{}", q.join("&"))
        };
        let inner = self.inner.clone();
        self.block(async move { inner.control_all(reqwest::Method::POST, &path, None).await })?;
        Ok(())
    }

    /// `POST /reset_prefix_cache` on every engine.
    pub fn reset_prefix_cache(&self) -> Result<()> {
        let inner = self.inner.clone();
        self.block(async move {
            inner
                .control_all(reqwest::Method::POST, "/reset_prefix_cache", None)
                .await
        })?;
        Ok(())
    }

    /// `POST /collective_rpc` on every engine (string arguments only, as vLLM requires); returns each
    /// engine's `results` list, in `engine_urls` order.
    pub fn collective_rpc(&self, method: &str, args: &[String], kwargs: &Map<String, Value>) -> Result<Vec<Value>> {
        for (k, v) in kwargs {
            if !v.is_string() {
                bail!("collective_rpc kwargs must be strings (vLLM passes no other types); {k} = {v}");
            }
        }
        let body = json!({"method": method, "args": args, "kwargs": kwargs});
        let inner = self.inner.clone();
        let vals = self.block(async move {
            inner
                .control_all(reqwest::Method::POST, "/collective_rpc", Some(body))
                .await
        })?;
        Ok(vals
            .into_iter()
            .map(|v| v.get("results").cloned().unwrap_or(Value::Null))
            .collect())
    }

    /// Deregisters the engines from the router (`DELETE /workers/{url}`); idempotent, also run on drop.
    pub fn shutdown(&self) -> Result<()> {
        if self.inner.router.is_none() || self.inner.owned.lock().unwrap().is_empty() {
            return Ok(());
        }
        let inner = self.inner.clone();
        self.block(async move { inner.deregister_all().await })
    }
}

impl Drop for VllmClient {
    fn drop(&mut self) {
        if let Err(e) = self.shutdown() {
            eprintln!("vime vLLM client: {e:#}");
        }
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl RolloutEngine for VllmClient {
    fn generate(&self, requests: &[GenRequest]) -> Result<Vec<GenOutput>> {
        let inner = self.inner.clone();
        let requests = requests.to_vec();
        self.block(async move { inner.generate(requests).await })
    }

    fn update_weights_from_dir(&self, dir: &Path) -> Result<()> {
        let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
        let inner = self.inner.clone();
        self.block(async move { inner.update_weights(&dir, None).await })
    }

    fn weight_version(&self) -> u64 {
        self.inner.weight_version.load(Ordering::SeqCst)
    }
}

struct InFlight<'a>(&'a AtomicUsize);
impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

fn classify(e: reqwest::Error) -> AttemptError {
    let kind = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "connection failed"
    } else {
        "request failed"
    };
    let mut msg = format!("{kind}: {e}");
    let mut src = std::error::Error::source(&e);
    while let Some(s) = src {
        msg.push_str(&format!(": {s}"));
        src = s.source();
    }
    AttemptError {
        retryable: true,
        message: msg,
    }
}

impl Inner {
    fn backoff(&self, attempt: u32) -> Duration {
        let b = self.cfg.retry_backoff.saturating_mul(1u32 << attempt.min(16));
        b.min(self.cfg.retry_backoff_max)
    }

    /// The target for a generation attempt: the router, or the least-loaded engine that has not
    /// failed this request (all engines if every one has).
    fn pick(&self, failed: &[usize]) -> (usize, &EngineSlot) {
        if let Some(r) = &self.router {
            return (usize::MAX, r);
        }
        let n = self.engines.len();
        let start = self.rr.fetch_add(1, Ordering::Relaxed);
        let usable = |i: usize| !failed.contains(&i) && !self.engines[i].hung.load(Ordering::Relaxed);
        let fresh = (0..n).any(|i| !failed.contains(&i));
        let any_usable = (0..n).any(usable);
        let mut best: Option<(usize, usize)> = None;
        for k in 0..n {
            let i = (start + k) % n;
            if (any_usable && !usable(i)) || (fresh && failed.contains(&i)) {
                continue;
            }
            let load = self.engines[i].in_flight.load(Ordering::Relaxed);
            if best.is_none_or(|(_, l)| load < l) {
                best = Some((i, load));
            }
        }
        let i = best.map(|b| b.0).unwrap_or(0);
        (i, &self.engines[i])
    }

    async fn generate(self: Arc<Self>, requests: Vec<GenRequest>) -> Result<Vec<GenOutput>> {
        let mut set = tokio::task::JoinSet::new();
        for (i, r) in requests.into_iter().enumerate() {
            let me = self.clone();
            set.spawn(async move { (i, me.generate_one(i, r).await) });
        }
        let mut outs: Vec<Option<GenOutput>> = vec![None; set.len()];
        while let Some(joined) = set.join_next().await {
            let (i, res) = joined.context("a vLLM request task panicked")?;
            // An error drops `set`, which aborts the other requests.
            outs[i] = Some(res?);
        }
        Ok(outs.into_iter().map(|o| o.expect("every request answered")).collect())
    }

    fn completion_body(&self, r: &GenRequest) -> Value {
        let p = &r.params;
        let mut body = json!({
            "prompt": r.prompt_ids,
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": if p.top_k > 0 { p.top_k } else { 0 },
            "stop_token_ids": p.stop_token_ids,
            "logprobs": 0,
            "return_token_ids": true,
            "n": 1,
        });
        if let Some(seed) = p.seed {
            body["seed"] = json!(seed as i64);
        }
        if let Some(m) = &self.cfg.model {
            body["model"] = json!(m);
        }
        body
    }

    async fn generate_one(&self, idx: usize, r: GenRequest) -> Result<GenOutput> {
        let _permit = self.sem.acquire().await.expect("semaphore never closed");
        let body = self.completion_body(&r);
        let mut failed: Vec<usize> = Vec::new();
        let mut errors: Vec<(String, String)> = Vec::new();
        let attempts = self.cfg.max_retries + 1;
        for attempt in 0..attempts {
            let (slot_idx, slot) = self.pick(&failed);
            slot.in_flight.fetch_add(1, Ordering::Relaxed);
            let guard = InFlight(&slot.in_flight);
            let dead_before = self.deregistered_dead.load(Ordering::SeqCst);
            let res = tokio::select! {
                r = self.attempt_completion(&slot.url, &body, r.prompt_ids.len()) => r,
                why = self.watch_liveness(slot, dead_before) => Err(AttemptError { retryable: true, message: why }),
            };
            drop(guard);
            match res {
                Ok(out) => {
                    slot.hung.store(false, Ordering::Relaxed);
                    self.completed.fetch_add(1, Ordering::Relaxed);
                    return Ok(out);
                }
                Err(e) => {
                    let via = match &self.router {
                        Some(_) => format!("router {} (workers {})", slot.url, self.engine_list()),
                        None => slot.url.clone(),
                    };
                    errors.push((via.clone(), e.message.clone()));
                    if !e.retryable {
                        self.failed.fetch_add(1, Ordering::Relaxed);
                        bail!("vLLM request {idx} to {via} failed: {}", e.message);
                    }
                    if !failed.contains(&slot_idx) {
                        failed.push(slot_idx);
                    }
                    if attempt + 1 < attempts {
                        self.retries.fetch_add(1, Ordering::Relaxed);
                        if self.router.is_some() {
                            self.prune_dead_workers().await;
                        }
                        let wait = self.backoff(attempt);
                        eprintln!(
                            "vime vLLM client: request {idx} attempt {}/{attempts} to {via} failed ({}); retrying in {wait:?}",
                            attempt + 1,
                            e.message
                        );
                        tokio::time::sleep(wait).await;
                    }
                }
            }
        }
        self.failed.fetch_add(1, Ordering::Relaxed);
        let mut tried: Vec<&str> = errors.iter().map(|(u, _)| u.as_str()).collect();
        tried.dedup();
        let (last_url, last_err) = errors.last().expect("at least one attempt");
        let dead = self.dead.lock().unwrap().clone();
        let dead = if dead.is_empty() {
            String::new()
        } else {
            format!("; deregistered from the router as down: {}", dead.join(", "))
        };
        bail!(
            "vLLM engine(s) {} did not answer request {idx} after {attempts} attempts; last error from {last_url}: {last_err}{dead}",
            tried.join(", ")
        )
    }

    /// Resolves only when the engine of an attempt is found hung (see the module docs): every
    /// `liveness_interval` (at once when the engine was found hung before), a shared 1-token
    /// probe of the engine; through a router, a probe of every registered engine, and the attempt
    /// is given up when one was deregistered since it started (`dead_before`).
    async fn watch_liveness(&self, slot: &EngineSlot, dead_before: u64) -> String {
        let started = Instant::now();
        let mut first = true;
        loop {
            if !(first && slot.hung.load(Ordering::Relaxed)) {
                tokio::time::sleep(self.cfg.liveness_interval).await;
            }
            first = false;
            if self.user_paused.load(Ordering::SeqCst) {
                continue;
            }
            if self.router.is_some() {
                self.prune_dead_workers().await;
                if self.deregistered_dead.load(Ordering::SeqCst) > dead_before {
                    let dead = self.dead.lock().unwrap().join(", ");
                    return format!(
                        "no answer after {:?}, and an engine behind the router was found down meanwhile: {dead}",
                        started.elapsed()
                    );
                }
                continue;
            }
            if let Some(why) = self.liveness(slot).await {
                return format!(
                    "engine hung: no answer after {:?}, and {why} (GET /health is not enough: vLLM answers it while wedged)",
                    started.elapsed()
                );
            }
        }
    }

    /// The engine's liveness, probed at most once per `liveness_interval` (other requests share
    /// the verdict): `None` when it generated a token in time, else why not.
    async fn liveness(&self, slot: &EngineSlot) -> Option<String> {
        let mut last = slot.probe.lock().await;
        if let Some((at, verdict)) = &*last {
            if at.elapsed() < self.cfg.liveness_interval {
                return verdict.clone();
            }
        }
        let verdict = self.probe_generates(&slot.url).await;
        slot.hung.store(verdict.is_some(), Ordering::Relaxed);
        *last = Some((Instant::now(), verdict.clone()));
        verdict
    }

    /// A 1-token completion on `base` within `liveness_timeout`: `None` when the engine answered
    /// (a completion, or 503 when it is paused), else why not.
    async fn probe_generates(&self, base: &str) -> Option<String> {
        self.liveness_probes.fetch_add(1, Ordering::Relaxed);
        let mut body = json!({"prompt": [0], "max_tokens": 1, "temperature": 0.0, "n": 1});
        if let Some(m) = &self.cfg.model {
            body["model"] = json!(m);
        }
        let timeout = self.cfg.liveness_timeout;
        let sent = self
            .http
            .post(format!("{base}/v1/completions"))
            .json(&body)
            .timeout(timeout)
            .send()
            .await;
        let why = match sent {
            Ok(r) if r.status().is_success() => match r.text().await {
                Ok(_) => return None,
                Err(e) => classify(e).message,
            },
            Ok(r) if r.status().as_u16() == 503 => return None,
            Ok(r) if !r.status().is_server_error() => return None,
            Ok(r) => format!("answered {}", r.status()),
            Err(e) => classify(e).message,
        };
        self.hung_detected.fetch_add(1, Ordering::Relaxed);
        Some(format!(
            "a 1-token probe (POST {base}/v1/completions, max_tokens 1, deadline {timeout:?}) failed: {why}"
        ))
    }

    fn engine_list(&self) -> String {
        self.engines
            .iter()
            .map(|e| e.url.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    }

    async fn attempt_completion(&self, base: &str, body: &Value, prompt_len: usize) -> Result<GenOutput, AttemptError> {
        let resp = self
            .http
            .post(format!("{base}/v1/completions"))
            .json(body)
            .timeout(self.cfg.request_timeout)
            .send()
            .await
            .map_err(classify)?;
        let status = resp.status();
        let text = resp.text().await.map_err(classify)?;
        if !status.is_success() {
            let retryable = status.is_server_error() || status.as_u16() == 408 || status.as_u16() == 429;
            let msg = serde_json::from_str::<Value>(&text)
                .ok()
                .and_then(|v| v.pointer("/error/message").and_then(Value::as_str).map(str::to_string))
                .unwrap_or_else(|| text.chars().take(500).collect());
            return Err(AttemptError {
                retryable,
                message: format!("HTTP {status}: {msg}"),
            });
        }
        parse_completion(&text, prompt_len).map_err(|e| AttemptError {
            retryable: false,
            message: format!("{e:#}"),
        })
    }

    /// One control call on every engine, concurrently; retried like generation; the error names every
    /// engine that failed.
    async fn control_all(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> Result<Vec<Value>> {
        self.control_all_within(method, path, body, None).await
    }

    /// [`Self::control_all`] with each engine's call (its retries included) bounded by
    /// `deadline` instead of `control_timeout` per attempt.
    async fn control_all_within(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
        deadline: Option<Duration>,
    ) -> Result<Vec<Value>> {
        let futs = self
            .engines
            .iter()
            .map(|e| self.control_one(&e.url, method.clone(), path, body.clone(), deadline));
        let results = join_all(futs).await;
        let mut errs = Vec::new();
        let mut vals = Vec::new();
        for (e, r) in self.engines.iter().zip(results) {
            match r {
                Ok(v) => vals.push(v),
                Err(err) => errs.push(format!("{}: {err}", e.url)),
            }
        }
        if !errs.is_empty() {
            bail!(
                "{} {path} failed on {} of {} vLLM engine(s): {}",
                method,
                errs.len(),
                self.engines.len(),
                errs.join("; ")
            );
        }
        Ok(vals)
    }

    async fn control_one(
        &self,
        base: &str,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
        deadline: Option<Duration>,
    ) -> Result<Value, String> {
        let attempts = self.cfg.max_retries + 1;
        let start = Instant::now();
        let mut last = String::new();
        for attempt in 0..attempts {
            let timeout = match deadline {
                None => self.cfg.control_timeout,
                Some(d) => match d.checked_sub(start.elapsed()) {
                    Some(left) if !left.is_zero() => left,
                    _ => {
                        last = format!("{last} (no time left to retry within {d:?})");
                        break;
                    }
                },
            };
            let mut req = self
                .http
                .request(method.clone(), format!("{base}{path}"))
                .timeout(timeout);
            if let Some(b) = &body {
                req = req.json(b);
            }
            let within = |e: reqwest::Error| match deadline {
                Some(d) if e.is_timeout() => AttemptError {
                    retryable: false,
                    message: format!("no answer within {d:?} (the engine hung?)"),
                },
                _ => classify(e),
            };
            let err = match req.send().await {
                Err(e) => within(e),
                Ok(resp) => {
                    let status = resp.status();
                    match resp.text().await {
                        Err(e) => within(e),
                        Ok(text) if status.is_success() => {
                            return Ok(serde_json::from_str(&text).unwrap_or(Value::Null));
                        }
                        Ok(text) => AttemptError {
                            retryable: status.is_server_error() && status.as_u16() != 500,
                            message: format!("HTTP {status}: {}", text.chars().take(500).collect::<String>()),
                        },
                    }
                }
            };
            last = err.message;
            if !err.retryable {
                break;
            }
            if attempt + 1 < attempts {
                self.retries.fetch_add(1, Ordering::Relaxed);
                let pause = self.backoff(attempt);
                let pause = match deadline {
                    Some(d) => pause.min(d.saturating_sub(start.elapsed())),
                    None => pause,
                };
                tokio::time::sleep(pause).await;
            }
        }
        Err(last)
    }

    async fn pause_all(&self, mode: PauseMode, deadline: Option<Duration>) -> Result<()> {
        let path = format!("/pause?mode={}", mode.as_str());
        self.control_all_within(reqwest::Method::POST, &path, None, deadline)
            .await?;
        Ok(())
    }

    async fn resume_all(&self, deadline: Option<Duration>) -> Result<()> {
        self.control_all_within(reqwest::Method::POST, "/resume", None, deadline)
            .await?;
        Ok(())
    }

    /// The disk reload; with `deadline`, each of its control calls (pause, reload, version,
    /// resume) gets that long, retries included, instead of `control_timeout` per attempt.
    async fn update_weights(&self, dir: &Path, deadline: Option<Duration>) -> Result<()> {
        if self.engines.is_empty() {
            bail!(
                "update_weights_from_dir needs the engine URLs (--vllm-url); the router does not forward control calls"
            );
        }
        let path = dir
            .to_str()
            .ok_or_else(|| anyhow!("weights dir {} is not UTF-8", dir.display()))?
            .to_string();
        let we_paused = !self.user_paused.load(Ordering::SeqCst);
        if we_paused {
            if let Err(e) = self.pause_all(PauseMode::Keep, deadline).await {
                // The engines that did pause would hold every later request: resumed, best effort.
                let _ = self.resume_all(deadline).await;
                return Err(e.context("pausing the engines for a weight update"));
            }
        }
        let body = json!({"method": "reload_weights", "args": [], "kwargs": {"weights_path": path}});
        let reload = self
            .control_all_within(reqwest::Method::POST, "/collective_rpc", Some(body), deadline)
            .await;
        let result = match reload {
            Ok(_) => {
                let v = self.weight_version.load(Ordering::SeqCst) + 1;
                let label = json!({"new_version": v.to_string()});
                // vLLM 0.26 has no version route (a 404): the client's own counter is the version.
                let r = if self.no_version_route.load(Ordering::SeqCst) {
                    Ok(Vec::new())
                } else {
                    match self
                        .control_all_within(reqwest::Method::POST, "/update_weight_version", Some(label), deadline)
                        .await
                    {
                        Err(e) if format!("{e:#}").contains("HTTP 404") => {
                            eprintln!(
                                "vime vLLM client: the engines have no /update_weight_version (vLLM < 0.33); \
                                 the weight version is kept by vime only"
                            );
                            self.no_version_route.store(true, Ordering::SeqCst);
                            Ok(Vec::new())
                        }
                        r => r,
                    }
                };
                if r.is_ok() {
                    self.weight_version.store(v, Ordering::SeqCst);
                }
                r.map(|_| ())
            }
            Err(e) => Err(e.context(format!("reloading weights from {}", dir.display()))),
        };
        if we_paused {
            let resumed = self
                .resume_all(deadline)
                .await
                .context("resuming the engines after a weight update");
            result?;
            resumed?;
            return Ok(());
        }
        result
    }

    async fn register_all(&self) -> Result<()> {
        let router = self.router.as_ref().expect("router set").url.clone();
        for e in &self.engines {
            let body = json!({"url": e.url});
            match self
                .control_one(&router, reqwest::Method::POST, "/workers", Some(body), None)
                .await
            {
                Ok(_) => self.owned.lock().unwrap().push(e.url.clone()),
                // vllm-router answers 400 "Worker .. already exists" for a worker it has (started
                // with --worker-urls, or left by a run that died): used, and left there at exit.
                Err(err) if err.contains("already exists") => {
                    eprintln!("vime vLLM client: engine {} was already registered with router {router}; it stays there after this run", e.url);
                }
                Err(err) => bail!(
                    "registering vLLM engine {} with router {router} (POST /workers): {err}",
                    e.url
                ),
            }
            self.registered.lock().unwrap().push(e.url.clone());
        }
        Ok(())
    }

    /// Through a router a failed attempt may mean that a worker behind it died, and the router may
    /// keep picking it (vllm-router's health check runs every 60 s by default). So every registered
    /// engine's `GET /health` is probed (2 s each, concurrently), then a 1-token completion (within
    /// `liveness_timeout`: `/health` stays 200 while vLLM is wedged), and the ones that do not
    /// answer, or answer 5xx (vLLM's dead engine core), are deregistered (`DELETE /workers/{url}`):
    /// the retry then goes to the living. At most one probe per second; it runs during a rollout
    /// only, when no engine sleeps.
    async fn prune_dead_workers(&self) {
        let mut last = self.last_prune.lock().await;
        if last.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
            return;
        }
        let urls: Vec<String> = self.registered.lock().unwrap().clone();
        let probes = urls.iter().map(|u| async move {
            match self
                .http
                .get(format!("{u}/health"))
                .timeout(Duration::from_secs(2))
                .send()
                .await
            {
                Ok(r) if !r.status().is_server_error() => self.probe_generates(u).await,
                Ok(r) => Some(format!("GET /health answered {}", r.status())),
                Err(e) => Some(classify(e).message),
            }
        });
        let verdicts = join_all(probes).await;
        let router = self.router.as_ref().expect("router set").url.clone();
        for (u, why) in urls.iter().zip(verdicts) {
            let Some(why) = why else { continue };
            let path = format!("/workers/{}", url_encode_component(u));
            let removed = self
                .control_one(&router, reqwest::Method::DELETE, &path, None, None)
                .await;
            self.registered.lock().unwrap().retain(|x| x != u);
            self.owned.lock().unwrap().retain(|x| x != u);
            self.deregistered_dead.fetch_add(1, Ordering::Relaxed);
            self.dead.lock().unwrap().push(format!("{u} ({why})"));
            match removed {
                Ok(_) => {
                    eprintln!("vime vLLM client: engine {u} is down ({why}); deregistered it from router {router}")
                }
                Err(e) => eprintln!(
                    "vime vLLM client: engine {u} is down ({why}); deregistering it from router {router} failed: {e}"
                ),
            }
        }
        *last = Some(Instant::now());
    }

    async fn deregister_all(&self) -> Result<()> {
        let router = self.router.as_ref().expect("router set").url.clone();
        let urls: Vec<String> = std::mem::take(&mut *self.owned.lock().unwrap());
        self.registered.lock().unwrap().clear();
        let mut errs = Vec::new();
        for u in urls {
            let path = format!("/workers/{}", url_encode_component(&u));
            if let Err(err) = self
                .control_one(&router, reqwest::Method::DELETE, &path, None, None)
                .await
            {
                errs.push(format!("{u}: {err}"));
            }
        }
        if !errs.is_empty() {
            bail!(
                "deregistering from router {router} (DELETE /workers/{{url}}) failed: {}",
                errs.join("; ")
            );
        }
        Ok(())
    }
}

/// The worker URLs of vllm-router's `GET /workers` answer (`{"workers": [{"url": .., "is_healthy":
/// .., ..}], "total": n, "stats": {..}}` in 0.1.17; plain URL strings are accepted too).
pub fn parse_router_workers(v: &Value) -> Result<Vec<String>> {
    let list = v
        .get("workers")
        .and_then(Value::as_array)
        .ok_or_else(|| anyhow!("the router's GET /workers has no \"workers\" list: {v}"))?;
    list.iter()
        .map(|w| {
            w.as_str()
                .or_else(|| w.get("url").and_then(Value::as_str))
                .map(trim_url)
                .ok_or_else(|| anyhow!("a router worker without a url: {w}"))
        })
        .collect()
}

/// Runs a few futures concurrently on this task (one control call per engine), outputs in order.
async fn join_all<F: std::future::Future>(futs: impl IntoIterator<Item = F>) -> Vec<F::Output> {
    let mut pending: Vec<_> = futs.into_iter().map(|f| Some(Box::pin(f))).collect();
    let mut outs: Vec<Option<F::Output>> = pending.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        for (slot, out) in pending.iter_mut().zip(outs.iter_mut()) {
            if let Some(f) = slot {
                if let std::task::Poll::Ready(v) = f.as_mut().poll(cx) {
                    *out = Some(v);
                    *slot = None;
                }
            }
        }
        if pending.iter().all(Option::is_none) {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    outs.into_iter().map(|o| o.expect("polled to completion")).collect()
}

/// Reads the one choice of a `CompletionResponse` into a [`GenOutput`], or says what is missing.
pub fn parse_completion(text: &str, prompt_len: usize) -> Result<GenOutput> {
    let v: Value = serde_json::from_str(text).context("completion response is not JSON")?;
    let choices = v
        .get("choices")
        .and_then(Value::as_array)
        .ok_or_else(|| anyhow!("completion response has no choices"))?;
    // vime asks for one sample per request (`n: 1`; a group is several requests with their own seeds).
    if choices.len() != 1 {
        bail!(
            "completion response has {} choices; vime asked for one (n=1)",
            choices.len()
        );
    }
    let choice = &choices[0];
    let ids = choice
        .get("token_ids")
        .and_then(Value::as_array)
        .ok_or_else(|| anyhow!("choice has no token_ids (the engine ignored return_token_ids)"))?;
    let token_ids: Vec<u32> = ids
        .iter()
        .map(|x| {
            x.as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .ok_or_else(|| anyhow!("bad token id {x}"))
        })
        .collect::<Result<_>>()?;
    let lps = choice
        .pointer("/logprobs/token_logprobs")
        .and_then(Value::as_array)
        .ok_or_else(|| anyhow!("choice has no logprobs.token_logprobs (the engine ignored logprobs=0)"))?;
    if lps.len() != token_ids.len() {
        bail!("choice has {} token ids but {} log-probs", token_ids.len(), lps.len());
    }
    let logprobs: Vec<f32> = lps
        .iter()
        .enumerate()
        .map(|(i, x)| {
            x.as_f64()
                .map(|x| x as f32)
                .ok_or_else(|| anyhow!("log-prob {i} is {x}, not a number"))
        })
        .collect::<Result<_>>()?;
    let finish_reason = match choice.get("finish_reason").and_then(Value::as_str) {
        Some("stop") => FinishReason::Stop,
        Some("length") => FinishReason::Length,
        Some("abort") => FinishReason::Abort,
        other => bail!("unexpected finish_reason {other:?}"),
    };
    if let Some(p) = choice.get("prompt_token_ids").and_then(Value::as_array) {
        if p.len() != prompt_len {
            bail!("engine saw a {}-token prompt, {prompt_len} were sent", p.len());
        }
    }
    Ok(GenOutput {
        token_ids,
        logprobs,
        finish_reason,
    })
}

// ------------------------------------------------------------------------------------------------
// Launcher

/// How to start `vllm serve` engines (or any program taking the same arguments, e.g. `vime-serve`).
#[derive(Debug, Clone)]
pub struct VllmLaunchConfig {
    /// The program, e.g. `vllm`.
    pub program: PathBuf,
    /// Arguments before the model, e.g. `["serve"]`.
    pub program_args: Vec<String>,
    /// Model path or name (the HF checkpoint).
    pub model: String,
    pub num_engines: usize,
    pub host: String,
    /// Engine `i` listens on `base_port + i`; `None` picks free ports.
    pub base_port: Option<u16>,
    pub tensor_parallel_size: usize,
    pub gpu_memory_utilization: f64,
    pub enable_sleep_mode: bool,
    /// `--worker-extension-cls` (vime's weight-sync extension).
    pub worker_extension_cls: Option<String>,
    pub extra_args: Vec<String>,
    /// Extra environment for the engines (`VLLM_SERVER_DEV_MODE=1` is always set).
    pub env: Vec<(String, String)>,
    /// Where a vime-serve engine's `reload_weights` may read (`VIME_ALLOWED_WEIGHTS_ROOT`); vLLM
    /// ignores the variable.
    pub allowed_weights_root: Option<PathBuf>,
    /// GPUs to split among engines (`tensor_parallel_size` each, via `CUDA_VISIBLE_DEVICES`);
    /// `None` leaves the variable alone.
    pub gpus: Option<Vec<usize>>,
    pub log_dir: PathBuf,
    pub health_timeout: Duration,
}

impl Default for VllmLaunchConfig {
    fn default() -> Self {
        Self {
            program: PathBuf::from("vllm"),
            program_args: vec!["serve".into()],
            model: String::new(),
            num_engines: 1,
            host: "127.0.0.1".into(),
            base_port: None,
            tensor_parallel_size: 1,
            gpu_memory_utilization: 0.9,
            enable_sleep_mode: false,
            worker_extension_cls: None,
            extra_args: Vec::new(),
            env: Vec::new(),
            allowed_weights_root: None,
            gpus: None,
            log_dir: PathBuf::from("logs"),
            health_timeout: Duration::from_secs(900),
        }
    }
}

struct Launched {
    /// Which engine (0-based), for a restart on a new port.
    index: usize,
    port: u16,
    /// The port came from [`pick_free_port`] (not `--vllm-base-port`), so another may be tried.
    picked: bool,
    url: String,
    child: Child,
    log: PathBuf,
}

/// Whether the socket listening on `port` belongs to a process of process group `pgid` (a
/// launched engine and its workers): `None` where Linux's /proc cannot tell. A free port is
/// picked, released, then bound by the engine; in between, another process may take it, and
/// `GET /health` would then be answered by someone else's server.
pub fn port_owned_by_group(port: u16, pgid: u32) -> Option<bool> {
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            let f: Vec<&str> = line.split_whitespace().collect();
            let local_port = f
                .get(1)
                .and_then(|a| a.rsplit(':').next())
                .and_then(|h| u16::from_str_radix(h, 16).ok());
            if f.len() > 9 && local_port == Some(port) && f[3] == "0A" {
                inodes.push(format!("socket:[{}]", f[9]));
            }
        }
    }
    if inodes.is_empty() {
        return None;
    }
    for proc_dir in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(stat) = std::fs::read_to_string(proc_dir.path().join("stat")) else {
            continue;
        };
        // pid (comm) state ppid pgrp ...: comm may hold spaces, so read after the last ')'.
        let pgrp = stat
            .rsplit(')')
            .next()
            .and_then(|rest| rest.split_whitespace().nth(2)?.parse::<u32>().ok());
        if pgrp != Some(pgid) {
            continue;
        }
        let Ok(fds) = std::fs::read_dir(proc_dir.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if std::fs::read_link(fd.path()).is_ok_and(|t| inodes.iter().any(|i| t.as_os_str() == i.as_str())) {
                return Some(true);
            }
        }
    }
    Some(false)
}

/// Engines started by vime; stopped (process group SIGTERM, then SIGKILL) on drop.
pub struct VllmLauncher {
    engines: Vec<Launched>,
}

/// Whether `host` (an address or `localhost`) is a loopback address: anything else exposes an
/// engine's endpoints to the network.
pub fn is_loopback_host(host: &str) -> bool {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    h.eq_ignore_ascii_case("localhost") || h.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// A free TCP port on 127.0.0.1 (bound and released; another process could take it in between).
pub fn pick_free_port() -> Result<u16> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").context("binding 127.0.0.1:0 to find a free port")?;
    Ok(l.local_addr()?.port())
}

impl VllmLaunchConfig {
    /// The argument list of engine `i` (after `program`).
    /// `CUDA_VISIBLE_DEVICES` of engine `i`: its `tensor_parallel_size` GPUs of `gpus`, in order
    /// (`None` when no GPUs are assigned, or too few: `launch` refuses that first).
    pub fn visible_devices(&self, i: usize) -> Option<String> {
        let tp = self.tensor_parallel_size;
        let mine = self.gpus.as_ref()?.get(i * tp..(i + 1) * tp)?;
        Some(mine.iter().map(|g| g.to_string()).collect::<Vec<_>>().join(","))
    }

    pub fn args(&self, port: u16) -> Vec<String> {
        let mut a = self.program_args.clone();
        a.push(self.model.clone());
        a.extend(["--host".into(), self.host.clone(), "--port".into(), port.to_string()]);
        a.extend(["--tensor-parallel-size".into(), self.tensor_parallel_size.to_string()]);
        a.extend([
            "--gpu-memory-utilization".into(),
            self.gpu_memory_utilization.to_string(),
        ]);
        if self.enable_sleep_mode {
            a.push("--enable-sleep-mode".into());
        }
        if let Some(cls) = &self.worker_extension_cls {
            a.extend(["--worker-extension-cls".into(), cls.clone()]);
        }
        a.extend(self.extra_args.iter().cloned());
        a
    }
}

impl VllmLauncher {
    /// Starts `num_engines` engines and waits until each answers `GET /health`.
    pub fn launch(cfg: &VllmLaunchConfig) -> Result<Self> {
        if cfg.num_engines == 0 {
            bail!("--vllm-num-engines must be at least 1");
        }
        if let Some(gpus) = &cfg.gpus {
            let need = cfg.num_engines * cfg.tensor_parallel_size;
            if gpus.len() < need {
                bail!(
                    "{} engines x tensor parallel {} need {need} GPUs, {} given",
                    cfg.num_engines,
                    cfg.tensor_parallel_size,
                    gpus.len()
                );
            }
        }
        std::fs::create_dir_all(&cfg.log_dir).with_context(|| format!("creating {}", cfg.log_dir.display()))?;
        let mut launcher = Self { engines: Vec::new() };
        for i in 0..cfg.num_engines {
            let port = match cfg.base_port {
                Some(p) => p
                    .checked_add(i as u16)
                    .ok_or_else(|| anyhow!("port {p} + {i} overflows"))?,
                None => pick_free_port()?,
            };
            launcher
                .engines
                .push(Self::spawn(cfg, i, port, cfg.base_port.is_none())?);
        }
        launcher.wait_healthy(cfg)?;
        Ok(launcher)
    }

    /// Starts engine `i` on `port`.
    fn spawn(cfg: &VllmLaunchConfig, i: usize, port: u16, picked: bool) -> Result<Launched> {
        let log = cfg.log_dir.join(format!("vllm-engine-{i}.log"));
        let out = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let err = out.try_clone()?;
        let mut cmd = Command::new(&cfg.program);
        cmd.args(cfg.args(port))
            .env("VLLM_SERVER_DEV_MODE", "1")
            .envs(
                cfg.allowed_weights_root
                    .iter()
                    .map(|r| ("VIME_ALLOWED_WEIGHTS_ROOT", r)),
            )
            .envs(cfg.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        if let Some(list) = cfg.visible_devices(i) {
            cmd.env("CUDA_VISIBLE_DEVICES", list);
        }
        {
            use std::os::unix::process::CommandExt;
            cmd.process_group(0);
            // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
            unsafe {
                cmd.pre_exec(|| {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM);
                    Ok(())
                });
            }
        }
        let child = cmd.spawn().with_context(|| {
            format!(
                "starting {} {} (see --vllm-command)",
                cfg.program.display(),
                cfg.args(port).join(" ")
            )
        })?;
        let host = if cfg.host == "0.0.0.0" {
            "127.0.0.1"
        } else {
            cfg.host.as_str()
        };
        eprintln!(
            "vime: started vLLM engine {i} (pid {}) on {host}:{port}, log {}",
            child.id(),
            log.display()
        );
        if is_loopback_host(&cfg.host) {
            eprintln!(
                "vime: engine {i}'s dev endpoints (/collective_rpc, /pause, /sleep, weight transfer; \
                 VLLM_SERVER_DEV_MODE=1) are exposed on {}:{port}, loopback only",
                cfg.host
            );
        } else {
            eprintln!(
                "vime: SECURITY WARNING: engine {i}'s dev endpoints (/collective_rpc, /pause, /sleep, \
                 weight transfer; VLLM_SERVER_DEV_MODE=1) are exposed on {}:{port}, a non-loopback \
                 address: anyone who can reach it can replace the engine's weights",
                cfg.host
            );
        }
        Ok(Launched {
            index: i,
            port,
            picked,
            url: format!("http://{host}:{port}"),
            child,
            log,
        })
    }

    /// Waits until every engine answers `GET /health` from its own process group. An engine whose
    /// picked port was taken by another process before it bound it is started again on a new
    /// port (up to 3 times).
    fn wait_healthy(&mut self, cfg: &VllmLaunchConfig) -> Result<()> {
        let timeout = cfg.health_timeout;
        let deadline = Instant::now() + timeout;
        for e in &mut self.engines {
            let mut restarts = 0;
            loop {
                if let Some(status) = e.child.try_wait()? {
                    if e.picked && restarts < 3 && port_owned_by_group(e.port, e.child.id()) == Some(false) {
                        eprintln!(
                            "vime: engine {} exited ({status}): port {} was taken by another process before \
                             it bound it; starting it again on another port",
                            e.index, e.port
                        );
                        restarts += 1;
                        *e = Self::spawn(cfg, e.index, pick_free_port()?, true)?;
                        continue;
                    }
                    bail!(
                        "vLLM engine {} exited ({status}) before becoming healthy; log {}:\n{}",
                        e.url,
                        e.log.display(),
                        tail(&e.log, 40)
                    );
                }
                // Someone else's server on the port is not this engine: wait for the engine.
                if http_get_status(&e.url, "/health", Duration::from_secs(2)) == Some(200)
                    && port_owned_by_group(e.port, e.child.id()) != Some(false)
                {
                    break;
                }
                if Instant::now() >= deadline {
                    bail!(
                        "vLLM engine {} not healthy after {timeout:?} (GET /health); log {}:\n{}",
                        e.url,
                        e.log.display(),
                        tail(&e.log, 40)
                    );
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
        Ok(())
    }

    pub fn urls(&self) -> Vec<String> {
        self.engines.iter().map(|e| e.url.clone()).collect()
    }

    pub fn log_paths(&self) -> Vec<PathBuf> {
        self.engines.iter().map(|e| e.log.clone()).collect()
    }

    pub fn pids(&self) -> Vec<u32> {
        self.engines.iter().map(|e| e.child.id()).collect()
    }

    /// Stops every engine: SIGTERM to its process group, SIGKILL after `grace`.
    pub fn shutdown(&mut self, grace: Duration) {
        for e in &self.engines {
            if let Ok(pid) = i32::try_from(e.child.id()) {
                // SAFETY: plain syscall; the group id is the child's pid (process_group(0)).
                unsafe { libc::kill(-pid, libc::SIGTERM) };
            }
        }
        let deadline = Instant::now() + grace;
        for e in &mut self.engines {
            loop {
                match e.child.try_wait() {
                    Ok(Some(_)) | Err(_) => break,
                    Ok(None) if Instant::now() >= deadline => {
                        if let Ok(pid) = i32::try_from(e.child.id()) {
                            // SAFETY: as above.
                            unsafe { libc::kill(-pid, libc::SIGKILL) };
                        }
                        let _ = e.child.wait();
                        break;
                    }
                    Ok(None) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
        }
        self.engines.clear();
    }
}

impl Drop for VllmLauncher {
    fn drop(&mut self) {
        self.shutdown(Duration::from_secs(15));
    }
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Status of a plain-HTTP GET (std only, so it works inside or outside any async runtime).
fn http_get_status(base: &str, path: &str, timeout: Duration) -> Option<u16> {
    let hostport = base.strip_prefix("http://")?.trim_end_matches('/');
    let addr = std::net::ToSocketAddrs::to_socket_addrs(hostport).ok()?.next()?;
    let mut s = std::net::TcpStream::connect_timeout(&addr, timeout).ok()?;
    s.set_read_timeout(Some(timeout)).ok()?;
    s.set_write_timeout(Some(timeout)).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {hostport}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut buf = [0u8; 64];
    let n = s.read(&mut buf).ok()?;
    let head = std::str::from_utf8(&buf[..n]).ok()?;
    head.split_whitespace().nth(1)?.parse().ok()
}

// ------------------------------------------------------------------------------------------------
// Command line

/// The rollout-engine flags for vLLM (flatten into a trainer's clap definition).
#[derive(Debug, Clone, clap::Args)]
pub struct VllmArgs {
    /// A vLLM (or vime-serve) engine URL; repeat for several engines.
    #[arg(long = "vllm-url")]
    pub vllm_urls: Vec<String>,
    /// A vllm-router URL: engines are registered with it and generation goes through it.
    #[arg(long)]
    pub vllm_router_url: Option<String>,
    /// Most generation requests in flight at once, over all engines.
    #[arg(long, default_value_t = 256)]
    pub vllm_max_concurrent_requests: usize,
    /// Seconds one generation attempt may take.
    #[arg(long, default_value_t = 3600.0)]
    pub vllm_request_timeout: f64,
    /// Retries per request after connection errors, timeouts and 5xx.
    #[arg(long, default_value_t = 5)]
    pub vllm_max_retries: u32,
    /// vime: seconds a generation request waits before its engine is probed with a 1-token
    /// completion (vLLM's /health stays 200 while an engine is wedged).
    #[arg(long, default_value_t = 60.0)]
    pub vllm_liveness_interval: f64,
    /// vime: seconds that probe may take before the engine counts as hung (the request is then
    /// retried on another engine).
    #[arg(long, default_value_t = 60.0)]
    pub vllm_liveness_timeout: f64,
    /// Start the engines here (`--vllm-command` MODEL ...) instead of connecting to running ones.
    #[arg(long)]
    pub vllm_launch: bool,
    /// The program and leading arguments that serve a model.
    #[arg(long, default_value = "vllm serve")]
    pub vllm_command: String,
    #[arg(long, default_value_t = 1)]
    pub vllm_num_engines: usize,
    /// Tensor parallel size of each launched engine (slime's flag).
    #[arg(long, default_value_t = 1)]
    pub rollout_num_gpus_per_engine: usize,
    #[arg(long, default_value_t = 0.9)]
    pub vllm_gpu_memory_utilization: f64,
    #[arg(long)]
    pub vllm_enable_sleep_mode: bool,
    #[arg(long)]
    pub vllm_worker_extension_cls: Option<String>,
    /// First port of the launched engines; free ports when unset.
    #[arg(long)]
    pub vllm_base_port: Option<u16>,
    /// vime: the address launched engines bind. They run with VLLM_SERVER_DEV_MODE=1 (weight sync
    /// needs it), so anything but loopback exposes /collective_rpc and the weight routes.
    #[arg(long, default_value = "127.0.0.1")]
    pub vllm_host: String,
    #[arg(long, default_value = "logs")]
    pub vllm_log_dir: PathBuf,
    /// Seconds to wait for launched engines' /health.
    #[arg(long, default_value_t = 900.0)]
    pub vllm_health_timeout: f64,
    /// slime's flag: passed to launched engines as `--max-num-seqs`.
    #[arg(long)]
    pub vllm_max_num_seqs: Option<usize>,
    /// slime's flag: passed to launched engines as `--max-num-batched-tokens`.
    #[arg(long)]
    pub vllm_max_num_batched_tokens: Option<usize>,
    /// slime's flag: passed to launched engines as `--enforce-eager` (no CUDA graphs).
    #[arg(long)]
    pub vllm_enforce_eager: bool,
    /// GPUs for the launched engines, `--rollout-num-gpus-per-engine` each (set by the trainer's
    /// placement).
    #[arg(skip)]
    pub vllm_gpus: Option<Vec<usize>>,
    /// Where launched vime-serve engines may `reload_weights` from (set by the trainer: the folder
    /// it writes weights to for them).
    #[arg(skip)]
    pub allowed_weights_root: Option<PathBuf>,
}

impl VllmArgs {
    pub fn launch_config(&self, model: &str) -> VllmLaunchConfig {
        let mut words = self.vllm_command.split_whitespace().map(str::to_string);
        let program = PathBuf::from(words.next().unwrap_or_else(|| "vllm".into()));
        VllmLaunchConfig {
            program,
            program_args: words.collect(),
            model: model.to_string(),
            num_engines: self.vllm_num_engines,
            host: self.vllm_host.clone(),
            base_port: self.vllm_base_port,
            tensor_parallel_size: self.rollout_num_gpus_per_engine,
            gpu_memory_utilization: self.vllm_gpu_memory_utilization,
            enable_sleep_mode: self.vllm_enable_sleep_mode,
            worker_extension_cls: self.vllm_worker_extension_cls.clone(),
            log_dir: self.vllm_log_dir.clone(),
            health_timeout: Duration::from_secs_f64(self.vllm_health_timeout),
            gpus: self.vllm_gpus.clone(),
            allowed_weights_root: self.allowed_weights_root.clone(),
            extra_args: self.engine_flags(),
            ..Default::default()
        }
    }

    /// vLLM flags of slime's engine options.
    pub fn engine_flags(&self) -> Vec<String> {
        let mut v = Vec::new();
        if let Some(n) = self.vllm_max_num_seqs {
            v.extend(["--max-num-seqs".to_string(), n.to_string()]);
        }
        if let Some(n) = self.vllm_max_num_batched_tokens {
            v.extend(["--max-num-batched-tokens".to_string(), n.to_string()]);
        }
        if self.vllm_enforce_eager {
            v.push("--enforce-eager".to_string());
        }
        v
    }

    pub fn client_config(&self, engine_urls: Vec<String>) -> VllmClientConfig {
        VllmClientConfig {
            engine_urls,
            router_url: self.vllm_router_url.clone(),
            max_concurrent_requests: self.vllm_max_concurrent_requests,
            request_timeout: Duration::from_secs_f64(self.vllm_request_timeout),
            max_retries: self.vllm_max_retries,
            liveness_interval: Duration::from_secs_f64(self.vllm_liveness_interval),
            liveness_timeout: Duration::from_secs_f64(self.vllm_liveness_timeout),
            ..Default::default()
        }
    }

    /// Launches engines when `--vllm-launch` (serving `model`), then connects the client to them and
    /// to every `--vllm-url`. Keep the launcher alive as long as the client.
    pub fn connect(&self, model: &str) -> Result<(Option<VllmLauncher>, VllmClient)> {
        let mut urls = self.vllm_urls.clone();
        let launcher = if self.vllm_launch {
            Some(VllmLauncher::launch(&self.launch_config(model))?)
        } else {
            None
        };
        if let Some(l) = &launcher {
            urls.extend(l.urls());
        }
        let client = VllmClient::connect(self.client_config(urls))?;
        Ok((launcher, client))
    }
}

/// The weight sync's control calls: one attempt each, bounded by the sync's deadline, never
/// retried (a second `/update_weights` would join a broadcast twice); errors carry the HTTP status
/// and the engine's message.
impl vime_sync::EngineControl for VllmClient {
    fn urls(&self) -> Vec<String> {
        self.engine_urls()
    }

    fn call(&self, engine: usize, call: &vime_sync::Call, deadline: Duration) -> Result<Value> {
        let base = self
            .inner
            .engines
            .get(engine)
            .map(|e| e.url.clone())
            .ok_or_else(|| anyhow!("no engine {engine} (the weight sync needs the engine URLs, --vllm-url)"))?;
        let url = format!("{base}{}", call.path);
        let method = reqwest::Method::from_bytes(call.method.as_bytes()).context("HTTP method")?;
        let http = self.inner.http.clone();
        let body = call.body.clone();
        let what = format!("{} {}", call.method, call.path.split('?').next().unwrap_or(""));
        self.block(async move {
            let mut req = http.request(method, &url).timeout(deadline);
            if let Some(b) = &body {
                req = req.json(b);
            }
            let resp = req.send().await.map_err(|e| {
                if e.is_timeout() {
                    anyhow!("{what}: no answer within {deadline:?} (the engine hung?)")
                } else {
                    anyhow!("{what}: {e}")
                }
            })?;
            let status = resp.status();
            let text = resp.text().await.map_err(|e| {
                if e.is_timeout() {
                    anyhow!("{what}: no answer within {deadline:?} (the engine hung?)")
                } else {
                    anyhow!("{what}: reading the answer: {e}")
                }
            })?;
            if !status.is_success() {
                bail!("{what}: HTTP {status}: {}", text.chars().take(800).collect::<String>());
            }
            if text.trim().is_empty() {
                return Ok(Value::Null);
            }
            serde_json::from_str(&text).map_err(|e| anyhow!("{what}: the answer is not JSON ({e}): {text:.200}"))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn a_port_is_owned_by_the_process_group_that_listens_on_it() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = l.local_addr().unwrap().port();
        // SAFETY: plain syscall.
        let mine = unsafe { libc::getpgrp() } as u32;
        assert_eq!(port_owned_by_group(port, mine), Some(true));
        assert_eq!(port_owned_by_group(port, mine.wrapping_add(1_000_000)), Some(false));
        drop(l);
        // Nobody listens: /proc cannot say whose it is.
        assert_eq!(port_owned_by_group(port, mine), None);
    }

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        vllm: VllmArgs,
    }

    /// slime's engine flags reach the launched engines' command lines, and the placement's GPUs
    /// are split among the engines, `--rollout-num-gpus-per-engine` each.
    #[test]
    fn engine_flags_and_gpus_reach_the_launch() {
        let mut a = Cli::parse_from([
            "x",
            "--rollout-num-gpus-per-engine",
            "2",
            "--vllm-max-num-seqs",
            "64",
            "--vllm-max-num-batched-tokens",
            "8192",
            "--vllm-enforce-eager",
        ])
        .vllm;
        a.vllm_num_engines = 3;
        a.vllm_gpus = Some(vec![2, 3, 4, 5, 6, 7]);
        let cfg = a.launch_config("/m");
        let args = cfg.args(8000);
        for pair in [
            ["--max-num-seqs", "64"],
            ["--max-num-batched-tokens", "8192"],
            ["--tensor-parallel-size", "2"],
        ] {
            assert!(args.windows(2).any(|w| w == pair), "{pair:?} in {args:?}");
        }
        assert!(args.contains(&"--enforce-eager".to_string()), "{args:?}");
        let visible: Vec<Option<String>> = (0..4).map(|i| cfg.visible_devices(i)).collect();
        assert_eq!(
            visible,
            [Some("2,3".into()), Some("4,5".into()), Some("6,7".into()), None]
        );
        a.vllm_gpus = None;
        assert_eq!(a.launch_config("/m").visible_devices(0), None);
    }
}
