//! `vime-serve`: any [`RolloutEngine`] behind the subset of vLLM 0.33's HTTP API that RL rollouts use,
//! so the vLLM client ([`crate::vllm`]), vllm-router and slime-style scripts drive it like `vllm serve`.
//!
//! Shapes follow vLLM 0.33.0's own definitions (wheel `vllm-0.33.0`, paths under `vllm/`):
//! - `POST /v1/completions`: `entrypoints/openai/completion/protocol.py` (`CompletionRequest`,
//!   `CompletionResponse`, `CompletionResponseChoice`, `CompletionLogProbs`) and
//!   `entrypoints/openai/completion/serving.py` (`request_output_to_completion_response`,
//!   `_create_completion_logprobs`: `top_logprobs` keeps `logprobs + 1` entries, logprobs clamped at
//!   -9999.0, one choice per prompt x `n` with `index = len(choices)`, usage counts each prompt once).
//!   `UsageInfo`, `ErrorResponse {error: {message, type, param, code}}`, `ModelCard`:
//!   `entrypoints/serve/engine/protocol.py`; error types/codes: `entrypoints/serve/exception_handling/
//!   error_response.py`. Defaults: `max_tokens` 16, `temperature` 1, `top_p` 1, `top_k` 0 (off);
//!   limits from `sampling_params.py` (`temperature` in [0, 2], `top_p` in (0, 1], `top_k >= -1`).
//! - `POST /pause?mode=abort|wait|keep[&clear_cache=]`, `POST /resume`, `GET /is_paused`:
//!   `entrypoints/rl/online/api_router.py` and `v1/engine/core.py` (`pause_scheduler`,
//!   `_reject_add_while_paused`): `abort` finishes queued requests with `finish_reason: "abort"`;
//!   `wait` lets admitted requests finish; both reject NEW requests with 503 `ServiceUnavailableError`
//!   "Generation is paused. Please retry after it resumes." until `/resume`; `keep` accepts and holds
//!   new requests until `/resume`. `/pause` returns `{"status": "paused"}` once the engine is idle.
//! - `POST /sleep?level=0..2&mode=`, `POST /wake_up?tags=weights&tags=kv_cache`, `GET /is_sleeping`:
//!   `entrypoints/serve/dev/sleep/api_router.py` (query params, not JSON) and `v1/engine/core.py`
//!   (`sleep`, `wake_up`): sleep pauses with `mode`; level >= 1 puts the tags `weights` and `kv_cache`
//!   to sleep and the engine's weights move to the host (vLLM's level-1 offload; level 2 does the
//!   same here: the host copy is kept); `wake_up` with `weights` (or no tags) moves them back, and
//!   scheduling resumes once no tag sleeps (no tags = all; `scheduling` is the level-0 tag), as
//!   vLLM does. The KV cache lives only inside a generate call, so a sleeping engine holds none.
//! - `GET /get_world_size` (`entrypoints/rl/online/api_router.py`): `{"world_size": 1}`.
//! - `POST /reset_prefix_cache` (`entrypoints/serve/dev/cache/api_router.py`): no prefix cache here,
//!   answers `{"success": true}`.
//! - Weights from disk: vLLM 0.33 has no `update_weights_from_disk` route; its disk reload is
//!   `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`
//!   (`entrypoints/serve/dev/rpc/api_router.py` -> `v1/worker/gpu_model_runner.py::reload_weights`,
//!   answer `{"results": [null, ...]}`, one per worker). vime-serve implements exactly that method
//!   (one "worker") and 400s any other. `GET /weight_info` -> `{"weight_version": str}` and
//!   `POST /update_weight_version {"new_version": str}` follow `entrypoints/rl/online/api_router.py`.
//! - Streamed weights (`--weight-transfer-config '{"backend": "ipc"|"nccl"|"cpu"}'`, else refused):
//!   `POST /init_weight_transfer_engine {"init_info"}`, `/start_weight_update`, `/update_weights
//!   {"update_info"}` (answers once the bucket is in the engine), `/finish_weight_update
//!   [{"weight_version"}]`, each answering `{"message": ...}` as vLLM 0.26 does; the keys are
//!   vLLM 0.33's for NCCL (`nccl_unique_id_b64`, `rank_offset`, `world_size`, `packed*`) plus
//!   vime's for IPC (`ipc_handle_b64`, `device_uuid`) and the CPU rendezvous (`master_address`,
//!   `master_port`); unknown keys are refused (`vime_sync::receiver`). The same calls also come as
//!   vime's worker-extension methods over `/collective_rpc` (`vime_init_weight_transfer`, ...,
//!   `vime_weight_info`), and `vime_weight_checksums` returns every tensor's checksum.
//! - `GET /health` (empty 200, `entrypoints/serve/instrumentator/health.py`), `GET /v1/models`
//!   (`entrypoints/openai/models/serving.py`).
//!
//! Decisions:
//! - One batcher task owns all scheduling state (queue, pause mode, the running engine call), so
//!   pause/resume/reload are ordered against generation without locks. Requests arriving within
//!   `batch_window` of the oldest queued one go into one `engine.generate` call on a blocking thread.
//!   A weight reload runs alone, between batches.
//! - `/pause?mode=abort` aborts what is queued and the batch inside the engine at its next decode
//!   step (`GenControl::abort`: each request returns the tokens it has with `finish_reason:
//!   "abort"`, as vLLM's abort does; an engine that cannot stop between steps finishes the batch),
//!   then answers once the engine is idle, which is the guarantee a weight update needs. `wait`
//!   lets the batch finish; `keep` holds new requests but does not hold the running batch.
//! - `logprobs=N`: the engine reports the sampled token's log-prob only, so `top_logprobs` holds that
//!   one entry whatever `N` is. `text` and per-token strings are decoded when the checkpoint has a
//!   `tokenizer.json`; otherwise `text` is "" and tokens are spelled `token_id:ID` (vLLM's
//!   `return_tokens_as_token_ids` form). String prompts need the tokenizer.
//! - Features the engine cannot honour (streaming, beam search, echo, stop strings, penalties,
//!   logit bias, min_p, min_tokens, prompt logprobs, ...) are 400s naming the field, never ignored.
//! - Security, as vLLM: the development endpoints (every route but `/health`, `/v1/models` and
//!   `/v1/completions`: pause, sleep, weights, `/collective_rpc`, and their read-only companions,
//!   exactly vLLM's set, [`ROUTES`]) are served only in dev mode (`ServeConfig::dev_mode`; the
//!   binary's `--dev-mode` or vLLM's `VLLM_SERVER_DEV_MODE=1`); off, each answers 404 saying how to
//!   turn it on. `reload_weights` reads only folders under `ServeConfig::allowed_weights_root`
//!   (resolved first, so `..` and symlinks cannot leave it; 403 otherwise), by default the folder
//!   holding the served checkpoint; vLLM has no such check. The binary binds 127.0.0.1 unless told
//!   otherwise and warns when dev mode is on a non-loopback address.
//! - [`parse_request`] is the one function that reads a client's path, query and body, and answers
//!   every bad input with a 4xx (fuzzed by `tests/fuzz.rs`); the handlers only run what it returns.
use crate::engine::{FinishReason, GenControl, GenOutput, GenRequest, RolloutEngine, SamplingParams};
use anyhow::{Context, Result};
use axum::body::Bytes;
use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use std::collections::{BTreeSet, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

/// vLLM's `PauseMode` (`v1/engine/__init__.py`): `Literal["abort", "wait", "keep"]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PauseMode {
    /// Abort queued requests, reject new ones with 503 until resume (vLLM's default).
    Abort,
    /// Let admitted requests finish, reject new ones with 503 until resume.
    Wait,
    /// Hold queued and new requests; they run after resume.
    Keep,
}

impl PauseMode {
    pub fn as_str(self) -> &'static str {
        match self {
            PauseMode::Abort => "abort",
            PauseMode::Wait => "wait",
            PauseMode::Keep => "keep",
        }
    }
}

impl std::str::FromStr for PauseMode {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "abort" => Ok(PauseMode::Abort),
            "wait" => Ok(PauseMode::Wait),
            "keep" => Ok(PauseMode::Keep),
            _ => anyhow::bail!("pause mode must be one of abort, wait, keep; got {s:?}"),
        }
    }
}

/// What the server says about its model and how it batches.
#[derive(Clone)]
pub struct ServeConfig {
    /// `id` in `/v1/models` and `model` in responses (vLLM: `--served-model-name`, else `--model`).
    pub served_model_name: String,
    /// `root` in `/v1/models`.
    pub model_path: String,
    /// Prompt + completion limit (vLLM's `max_model_len`; default `max_position_embeddings`).
    pub max_model_len: usize,
    /// Prompt ids must be below this.
    pub vocab_size: usize,
    /// Added to every request's stop ids unless `ignore_eos` (vLLM stops at EOS by default).
    pub eos_token_ids: Vec<u32>,
    pub tokenizer: Option<Arc<tokenizers::Tokenizer>>,
    /// How long the oldest queued request waits for others to join its engine call.
    pub batch_window: Duration,
    /// Most requests (prompts x n) per engine call; one larger HTTP request still runs whole.
    pub max_batch_size: usize,
    /// The streamed weight-sync backend (`--weight-transfer-config '{"backend": ..}'`); `None`
    /// refuses the weight-transfer routes, as vLLM does without the flag.
    pub weight_transfer: Option<vime_sync::RecvKind>,
    /// Bound of a weight-sync rendezvous and of one bucket's receive.
    pub weight_transfer_timeout: Duration,
    /// Serve the development endpoints ([`ROUTES`] with `dev`), as vLLM does with
    /// `VLLM_SERVER_DEV_MODE=1`; off, they answer 404.
    pub dev_mode: bool,
    /// `reload_weights` reads only folders under this canonical path; `None` refuses every one.
    pub allowed_weights_root: Option<PathBuf>,
}

impl ServeConfig {
    /// Reads `config.json` (and `generation_config.json`, `tokenizer.json` when present) of an HF
    /// checkpoint directory.
    pub fn from_hf_dir(dir: &Path, served_model_name: Option<String>) -> Result<Self> {
        let cfg = vime_qwen3::config::Qwen3Config::from_file(&dir.join("config.json"))
            .with_context(|| format!("reading {}", dir.join("config.json").display()))?;
        let mut eos: Vec<u32> = cfg.eos_token_id.as_ref().map(|t| t.to_vec()).unwrap_or_default();
        let gen_cfg = dir.join("generation_config.json");
        if gen_cfg.exists() {
            let text = std::fs::read_to_string(&gen_cfg).with_context(|| format!("reading {}", gen_cfg.display()))?;
            let v: Value = serde_json::from_str(&text).with_context(|| format!("parsing {}", gen_cfg.display()))?;
            match v.get("eos_token_id") {
                Some(Value::Number(n)) => eos.extend(n.as_u64().map(|x| x as u32)),
                Some(Value::Array(a)) => eos.extend(a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32)),
                _ => {}
            }
        }
        eos.sort_unstable();
        eos.dedup();
        let tok_path = dir.join("tokenizer.json");
        let tokenizer = if tok_path.exists() {
            let t = tokenizers::Tokenizer::from_file(&tok_path)
                .map_err(|e| anyhow::anyhow!("loading {}: {e}", tok_path.display()))?;
            Some(Arc::new(t))
        } else {
            None
        };
        let path = dir.display().to_string();
        Ok(Self {
            served_model_name: served_model_name.unwrap_or_else(|| path.clone()),
            model_path: path,
            max_model_len: cfg.max_position_embeddings,
            vocab_size: cfg.vocab_size,
            eos_token_ids: eos,
            tokenizer,
            batch_window: Duration::from_millis(5),
            max_batch_size: 256,
            weight_transfer: None,
            weight_transfer_timeout: Duration::from_secs(300),
            dev_mode: false,
            allowed_weights_root: default_weights_root(dir),
        })
    }
}

// ------------------------------------------------------------------------------------------------
// Errors in vLLM's shape.

/// `ErrorResponse` of `entrypoints/serve/engine/protocol.py`.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub err_type: &'static str,
    pub message: String,
    pub param: Option<String>,
}

impl ApiError {
    fn bad_request(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            err_type: "BadRequestError",
            message: message.into(),
            param: param.map(str::to_string),
        }
    }
    fn not_found(message: impl Into<String>, param: Option<&str>) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            err_type: "NotFoundError",
            message: message.into(),
            param: param.map(str::to_string),
        }
    }
    fn forbidden(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::FORBIDDEN,
            err_type: "PermissionDeniedError",
            message: message.into(),
            param: None,
        }
    }
    /// A dev route while dev mode is off: vLLM answers a bare 404 (the route is not mounted);
    /// vime-serve says how to turn it on.
    fn dev_mode_off(path: &str) -> Self {
        Self::not_found(
            format!(
                "{path} is a development endpoint, off by default as in vLLM: start vime-serve with \
                 --dev-mode (or VLLM_SERVER_DEV_MODE=1, what vLLM needs) to serve it"
            ),
            None,
        )
    }
    fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            err_type: "InternalServerError",
            message: message.into(),
            param: None,
        }
    }
    fn paused() -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            err_type: "ServiceUnavailableError",
            message: "Generation is paused. Please retry after it resumes.".into(),
            param: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.message,
            "type": self.err_type,
            "param": self.param,
            "code": self.status.as_u16(),
        }});
        (self.status, Json(body)).into_response()
    }
}

// ------------------------------------------------------------------------------------------------
// The batcher: the one owner of the queue, the pause state and the engine.

enum JobError {
    Paused,
    Engine(String),
}

struct GenJob {
    requests: Vec<GenRequest>,
    arrived: Instant,
    /// Completions and the weight-version label they were sampled under.
    reply: oneshot::Sender<Result<(Vec<GenOutput>, String), JobError>>,
}

enum Msg {
    Generate(GenJob),
    Pause {
        mode: PauseMode,
        done: oneshot::Sender<()>,
    },
    Resume {
        done: oneshot::Sender<()>,
    },
    Reload {
        dir: PathBuf,
        done: oneshot::Sender<Result<u64, String>>,
    },
    Weights {
        op: SyncOp,
        done: oneshot::Sender<SyncReply>,
    },
}

/// One weight-transfer call, run by the receiver thread.
#[derive(Debug)]
enum SyncOp {
    Init(Value),
    Start,
    Update(Value),
    Finish,
}

type SyncReply = Result<Value, String>;
type SyncChannel = std::sync::mpsc::Sender<(SyncOp, oneshot::Sender<SyncReply>)>;

enum Outcome {
    Generated(Result<Vec<GenOutput>>),
    Reloaded(Result<()>),
    Synced(SyncReply),
}

enum RunMeta {
    /// The batch's jobs, and the control that aborts it between engine steps.
    Generate(Vec<GenJob>, Arc<GenControl>),
    Reload(oneshot::Sender<Result<u64, String>>),
    Sync(oneshot::Sender<SyncReply>),
}

/// Weight changes run alone, between batches, in arrival order.
enum WeightJob {
    Dir(PathBuf, oneshot::Sender<Result<u64, String>>),
    Sync(SyncOp, oneshot::Sender<SyncReply>),
}

/// The receiver thread: it owns the [`vime_sync::WeightReceiver`] (its NCCL communicator cannot
/// move between threads) and runs one weight-transfer call at a time.
fn spawn_receiver(kind: vime_sync::RecvKind, engine: Arc<dyn RolloutEngine>, deadline: Duration) -> SyncChannel {
    let (tx, rx) = std::sync::mpsc::channel::<(SyncOp, oneshot::Sender<SyncReply>)>();
    std::thread::Builder::new()
        .name("vime-serve-weight-sync".into())
        .spawn(move || {
            let Some(sink) = engine.weight_sink() else {
                for (_, done) in rx {
                    let _ = done.send(Err("this engine does not accept streamed weights".into()));
                }
                return;
            };
            let mut recv = vime_sync::WeightReceiver::new(kind, sink.device(), deadline);
            let mut load_s = 0.0;
            for (op, done) in rx {
                let t = Instant::now();
                let r = match &op {
                    SyncOp::Init(info) => recv.init(info).map(|_| json!({})),
                    SyncOp::Start => {
                        load_s = 0.0;
                        recv.start().map(|_| json!({}))
                    }
                    SyncOp::Update(info) => recv.update(info, sink).map(|_| {
                        let dt = t.elapsed().as_secs_f64();
                        load_s += dt;
                        json!({ "load_s": dt })
                    }),
                    SyncOp::Finish => recv.finish(sink).map(|(b, n)| {
                        eprintln!(
                            "vime-serve: weight update received: {n} tensors in {b} bucket(s), {:.2} ms receiving and loading",
                            load_s * 1e3
                        );
                        json!({ "load_s": load_s })
                    }),
                };
                if let SyncOp::Init(_) = op {
                    if r.is_ok() {
                        eprintln!(
                            "vime-serve: weight transfer engine ({}) ready in {:.3} s",
                            kind.as_str(),
                            t.elapsed().as_secs_f64()
                        );
                    }
                }
                let _ = done.send(r.map_err(|e| format!("{e:#}")));
            }
        })
        .expect("spawning the weight-sync thread");
    tx
}

struct Batcher {
    engine: Arc<dyn RolloutEngine>,
    rx: mpsc::UnboundedReceiver<Msg>,
    shared: Arc<Shared>,
    window: Duration,
    max_batch: usize,
    queue: VecDeque<GenJob>,
    reloads: VecDeque<WeightJob>,
    receiver: Option<SyncChannel>,
    running: Option<(JoinHandle<Outcome>, RunMeta)>,
    paused: Option<PauseMode>,
    pause_waiters: Vec<oneshot::Sender<()>>,
}

impl Batcher {
    fn may_start_generation(&self) -> bool {
        matches!(self.paused, None | Some(PauseMode::Wait))
    }

    fn set_paused(&mut self, p: Option<PauseMode>) {
        self.paused = p;
        *self.shared.paused.lock().unwrap() = p;
    }

    async fn run(mut self) {
        loop {
            if self.running.is_none() {
                if let Some(job) = self.reloads.pop_front() {
                    match job {
                        WeightJob::Dir(dir, done) => {
                            let engine = self.engine.clone();
                            let h = tokio::task::spawn_blocking(move || {
                                Outcome::Reloaded(engine.update_weights_from_dir(&dir))
                            });
                            self.running = Some((h, RunMeta::Reload(done)));
                        }
                        WeightJob::Sync(op, done) => match &self.receiver {
                            None => {
                                let _ = done.send(Err("vime-serve was started without --weight-transfer-config; \
                                     the weight-transfer routes are off"
                                    .into()));
                            }
                            Some(tx) => {
                                let (rtx, rrx) = oneshot::channel();
                                let sent = tx.send((op, rtx)).is_ok();
                                let h = tokio::spawn(async move {
                                    if !sent {
                                        return Outcome::Synced(Err("the weight-sync thread has stopped".into()));
                                    }
                                    Outcome::Synced(
                                        rrx.await
                                            .unwrap_or_else(|_| Err("the weight-sync thread has stopped".into())),
                                    )
                                });
                                self.running = Some((h, RunMeta::Sync(done)));
                            }
                        },
                    }
                } else if self.may_start_generation() {
                    self.queue.retain(|j| !j.reply.is_closed());
                    let queued: usize = self.queue.iter().map(|j| j.requests.len()).sum();
                    let due = self.queue.front().is_some_and(|j| j.arrived.elapsed() >= self.window);
                    if queued > 0 && (due || queued >= self.max_batch) {
                        self.start_batch();
                    }
                }
            }
            if self.running.is_none() && !self.pause_waiters.is_empty() {
                let drained = self.paused != Some(PauseMode::Wait) || self.queue.is_empty();
                if drained {
                    for w in self.pause_waiters.drain(..) {
                        let _ = w.send(());
                    }
                }
            }
            let wake_at = match (&self.running, self.queue.front()) {
                (None, Some(j)) if self.may_start_generation() => Some(j.arrived + self.window),
                _ => None,
            };
            tokio::select! {
                msg = self.rx.recv() => match msg {
                    None => break,
                    Some(m) => self.handle(m),
                },
                out = async { (&mut self.running.as_mut().unwrap().0).await }, if self.running.is_some() => {
                    let (_, meta) = self.running.take().unwrap();
                    self.finish(out, meta);
                }
                _ = tokio::time::sleep_until(wake_at.unwrap_or_else(Instant::now).into()), if wake_at.is_some() => {}
            }
        }
    }

    fn handle(&mut self, msg: Msg) {
        match msg {
            Msg::Generate(job) => match self.paused {
                Some(PauseMode::Abort | PauseMode::Wait) => {
                    let _ = job.reply.send(Err(JobError::Paused));
                }
                _ => self.queue.push_back(job),
            },
            Msg::Pause { mode, done } => {
                self.set_paused(Some(mode));
                if mode == PauseMode::Abort {
                    // The batch inside the engine stops at its next step (the built-in engine;
                    // others finish it), returning what it generated with `abort`.
                    if let Some((_, RunMeta::Generate(_, control))) = &self.running {
                        control.abort();
                    }
                    for job in self.queue.drain(..) {
                        let aborted = job
                            .requests
                            .iter()
                            .map(|_| GenOutput {
                                token_ids: vec![],
                                logprobs: vec![],
                                finish_reason: FinishReason::Abort,
                            })
                            .collect();
                        let _ = job.reply.send(Ok((aborted, self.shared.version_label())));
                    }
                }
                self.pause_waiters.push(done);
            }
            Msg::Resume { done } => {
                self.set_paused(None);
                for w in self.pause_waiters.drain(..) {
                    let _ = w.send(());
                }
                let _ = done.send(());
            }
            Msg::Reload { dir, done } => self.reloads.push_back(WeightJob::Dir(dir, done)),
            Msg::Weights { op, done } => self.reloads.push_back(WeightJob::Sync(op, done)),
        }
    }

    fn start_batch(&mut self) {
        let mut jobs = Vec::new();
        let mut n = 0;
        while let Some(j) = self.queue.front() {
            if !jobs.is_empty() && n + j.requests.len() > self.max_batch {
                break;
            }
            n += j.requests.len();
            jobs.push(self.queue.pop_front().unwrap());
        }
        let requests: Vec<GenRequest> = jobs.iter().flat_map(|j| j.requests.iter().cloned()).collect();
        let engine = self.engine.clone();
        let control = Arc::new(GenControl::default());
        let c = control.clone();
        let h = tokio::task::spawn_blocking(move || Outcome::Generated(engine.generate_with(&requests, &c)));
        self.running = Some((h, RunMeta::Generate(jobs, control)));
    }

    fn finish(&mut self, out: Result<Outcome, tokio::task::JoinError>, meta: RunMeta) {
        match (out, meta) {
            (Ok(Outcome::Generated(res)), RunMeta::Generate(jobs, _)) => {
                let expected: usize = jobs.iter().map(|j| j.requests.len()).sum();
                let res = res
                    .map_err(|e| format!("engine.generate failed: {e:#}"))
                    .and_then(|outs| {
                        if outs.len() == expected {
                            Ok(outs)
                        } else {
                            Err(format!(
                                "engine returned {} completions for {expected} requests",
                                outs.len()
                            ))
                        }
                    });
                match res {
                    Ok(outs) => {
                        let version = self.shared.version_label();
                        let mut outs = outs.into_iter();
                        for job in jobs {
                            let mine: Vec<GenOutput> = outs.by_ref().take(job.requests.len()).collect();
                            let _ = job.reply.send(Ok((mine, version.clone())));
                        }
                    }
                    Err(msg) => {
                        eprintln!("vime-serve: {msg}");
                        for job in jobs {
                            let _ = job.reply.send(Err(JobError::Engine(msg.clone())));
                        }
                    }
                }
            }
            (Ok(Outcome::Reloaded(res)), RunMeta::Reload(done)) => {
                if res.is_ok() {
                    *self.shared.weight_label.lock().unwrap() = None;
                }
                let _ = done.send(res.map(|_| self.engine.weight_version()).map_err(|e| format!("{e:#}")));
            }
            (Err(join), RunMeta::Generate(jobs, _)) => {
                let msg = format!("engine.generate panicked: {join}");
                eprintln!("vime-serve: {msg}");
                for job in jobs {
                    let _ = job.reply.send(Err(JobError::Engine(msg.clone())));
                }
            }
            (Err(join), RunMeta::Reload(done)) => {
                let _ = done.send(Err(format!("weight reload panicked: {join}")));
            }
            (Ok(Outcome::Synced(res)), RunMeta::Sync(done)) => {
                if res.is_ok() {
                    *self.shared.weight_label.lock().unwrap() = None;
                }
                let _ = done.send(res);
            }
            (Err(join), RunMeta::Sync(done)) => {
                let _ = done.send(Err(format!("weight transfer panicked: {join}")));
            }
            _ => unreachable!("outcome and run metadata always match"),
        }
    }
}

// ------------------------------------------------------------------------------------------------
// Server state and routes.

struct Shared {
    engine: Arc<dyn RolloutEngine>,
    cfg: ServeConfig,
    tx: mpsc::UnboundedSender<Msg>,
    paused: Mutex<Option<PauseMode>>,
    /// Set by `/update_weight_version`, cleared by a reload (then the engine's counter shows).
    weight_label: Mutex<Option<String>>,
    /// Tags put to sleep by `/sleep` and not yet woken (vLLM's `sleeping_tags`).
    sleeping: Mutex<Option<BTreeSet<String>>>,
    created: u64,
}

impl Shared {
    /// `/update_weight_version`'s label, else the engine's counter.
    fn version_label(&self) -> String {
        let label = self.weight_label.lock().unwrap().clone();
        label.unwrap_or_else(|| self.engine.weight_version().to_string())
    }

    async fn send<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Msg) -> Result<T, ApiError> {
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(make(tx))
            .map_err(|_| ApiError::internal("the vime-serve batcher has stopped"))?;
        rx.await
            .map_err(|_| ApiError::internal("the vime-serve batcher has stopped"))
    }
}

type AppState = Arc<Shared>;

/// One route of the API. `dev` routes are vLLM's development endpoints: vLLM mounts them only with
/// `VLLM_SERVER_DEV_MODE=1` (0.26: `entrypoints/openai/api_server.py:237` ->
/// `entrypoints/serve/__init__.py::register_vllm_dev_api_routers`, every route under
/// `entrypoints/serve/dev/`; 0.33: `entrypoints/launchers/api_server/routers.py`, plus
/// `entrypoints/rl/online/api_router.py`), the read-only ones (`/is_paused`, `/is_sleeping`,
/// `/get_world_size`, `/weight_info`) included.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    pub method: &'static str,
    pub path: &'static str,
    pub dev: bool,
}

const fn route(method: &'static str, path: &'static str, dev: bool) -> Route {
    Route { method, path, dev }
}

/// Every route vime-serve serves.
pub const ROUTES: &[Route] = &[
    route("GET", "/health", false),
    route("GET", "/v1/models", false),
    route("POST", "/v1/completions", false),
    route("POST", "/pause", true),
    route("POST", "/resume", true),
    route("GET", "/is_paused", true),
    route("POST", "/sleep", true),
    route("POST", "/wake_up", true),
    route("GET", "/is_sleeping", true),
    route("POST", "/reset_prefix_cache", true),
    route("GET", "/get_world_size", true),
    route("POST", "/collective_rpc", true),
    route("GET", "/weight_info", true),
    route("POST", "/update_weight_version", true),
    route("POST", "/init_weight_transfer_engine", true),
    route("POST", "/start_weight_update", true),
    route("POST", "/update_weights", true),
    route("POST", "/finish_weight_update", true),
];

/// A request as vime-serve understood it, before anything runs. [`parse_request`] is the one place
/// that reads a client's path, query string and body.
pub enum Request {
    Health,
    Models,
    Completion(CompletionParams),
    Pause(PauseMode),
    Resume,
    IsPaused,
    Sleep {
        level: u32,
        mode: PauseMode,
    },
    WakeUp {
        tags: Vec<String>,
    },
    IsSleeping,
    ResetPrefixCache,
    GetWorldSize,
    /// `collective_rpc("reload_weights")`: the folder, resolved and inside the allowed root.
    ReloadWeights(PathBuf),
    /// One of vime's worker-extension methods over `/collective_rpc`, its argument decoded.
    Extension {
        method: String,
        arg: Value,
    },
    WeightInfo,
    UpdateWeightVersion(String),
    InitWeightTransfer(Value),
    StartWeightUpdate,
    UpdateWeights(Value),
    FinishWeightUpdate {
        weight_version: Option<String>,
    },
}

/// Parses one request (`path` as routed, `query` without the `?`). Every refusal is a 4xx in
/// vLLM's error shape: a dev route while dev mode is off is a 404 saying how to turn it on, a
/// `reload_weights` folder outside the allowed root a 403.
pub fn parse_request(cfg: &ServeConfig, path: &str, query: Option<&str>, body: &[u8]) -> Result<Request, ApiError> {
    let Some(route) = ROUTES.iter().find(|r| r.path == path) else {
        return Err(ApiError::not_found(format!("no route {path}"), None));
    };
    if route.dev && !cfg.dev_mode {
        return Err(ApiError::dev_mode_off(path));
    }
    let pairs = query_pairs(query);
    Ok(match path {
        "/health" => Request::Health,
        "/v1/models" => Request::Models,
        "/v1/completions" => Request::Completion(parse_completion(cfg, body)?),
        "/pause" => Request::Pause(parse_mode(&pairs)?),
        "/resume" => Request::Resume,
        "/is_paused" => Request::IsPaused,
        "/sleep" => {
            let level = match query_one(&pairs, "level").map(|l| l.parse::<u32>()) {
                None => 1,
                Some(Ok(l)) if l <= 2 => l,
                Some(_) => {
                    return Err(ApiError::bad_request(
                        "level must be an integer in [0, 2]",
                        Some("level"),
                    ))
                }
            };
            Request::Sleep {
                level,
                mode: parse_mode(&pairs)?,
            }
        }
        "/wake_up" => Request::WakeUp {
            tags: pairs.into_iter().filter(|(k, _)| k == "tags").map(|(_, v)| v).collect(),
        },
        "/is_sleeping" => Request::IsSleeping,
        "/reset_prefix_cache" => Request::ResetPrefixCache,
        "/get_world_size" => Request::GetWorldSize,
        "/collective_rpc" => parse_collective_rpc(cfg, body)?,
        "/weight_info" => Request::WeightInfo,
        "/update_weight_version" => {
            let v: Value = serde_json::from_slice(body)
                .map_err(|e| ApiError::bad_request(format!("JSON decode error: {e}"), None))?;
            match v.get("new_version").and_then(|x| x.as_str()) {
                Some(n) => Request::UpdateWeightVersion(n.to_string()),
                None => {
                    return Err(ApiError::bad_request(
                        "body must be {\"new_version\": string}",
                        Some("new_version"),
                    ))
                }
            }
        }
        "/init_weight_transfer_engine" => Request::InitWeightTransfer(body_key(body, "init_info")?),
        "/start_weight_update" => Request::StartWeightUpdate,
        "/update_weights" => Request::UpdateWeights(body_key(body, "update_info")?),
        "/finish_weight_update" => {
            let weight_version = match json_body(body)?.get("weight_version") {
                None | Some(Value::Null) => None,
                Some(Value::String(v)) => Some(v.clone()),
                Some(other) => {
                    return Err(ApiError::bad_request(
                        format!("weight_version must be a string, got {other}"),
                        Some("weight_version"),
                    ))
                }
            };
            Request::FinishWeightUpdate { weight_version }
        }
        other => return Err(ApiError::not_found(format!("no route {other}"), None)),
    })
}

/// The vime worker-extension methods `/collective_rpc` answers besides `reload_weights`.
const EXTENSION_METHODS: [&str; 6] = {
    use vime_sync::protocol as p;
    [
        p::EXT_INIT,
        p::EXT_START,
        p::EXT_UPDATE,
        p::EXT_FINISH,
        p::EXT_INFO,
        p::RPC_CHECKSUMS,
    ]
};

fn parse_collective_rpc(cfg: &ServeConfig, body: &[u8]) -> Result<Request, ApiError> {
    let body: Value =
        serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("JSON decode error: {e}"), None))?;
    let Some(obj) = body.as_object() else {
        return Err(ApiError::bad_request("Request body must be a JSON object", None));
    };
    let method = match obj.get("method") {
        Some(Value::String(m)) => m.as_str(),
        _ => return Err(ApiError::bad_request("Missing 'method' in request body", None)),
    };
    if EXTENSION_METHODS.contains(&method) {
        // One JSON-string argument, as the worker extension takes it.
        let arg = match obj.get("args").and_then(|a| a.get(0)) {
            Some(Value::String(t)) => serde_json::from_str(t)
                .map_err(|e| ApiError::bad_request(format!("{method}: args[0] is not JSON: {e}"), Some("args")))?,
            None => json!({}),
            Some(other) => {
                return Err(ApiError::bad_request(
                    format!("{method}: args[0] must be a JSON string, got {other}"),
                    Some("args"),
                ))
            }
        };
        return Ok(Request::Extension {
            method: method.to_string(),
            arg,
        });
    }
    if method != "reload_weights" {
        return Err(ApiError::bad_request(
            format!(
                "vime-serve implements the collective_rpc methods \"reload_weights\" and vime's weight-transfer \
                 extension (vime_*) only, got {method:?}"
            ),
            Some("method"),
        ));
    }
    let path = obj
        .get("kwargs")
        .and_then(|k| k.get("weights_path"))
        .or_else(|| obj.get("args").and_then(|a| a.get(1)))
        .and_then(|p| p.as_str());
    let Some(path) = path else {
        return Err(ApiError::bad_request(
            "reload_weights needs kwargs.weights_path (an HF safetensors directory); vime-serve cannot \
             reload from the original path",
            Some("kwargs"),
        ));
    };
    resolve_weights_path(path, cfg.allowed_weights_root.as_deref()).map(Request::ReloadWeights)
}

/// The `reload_weights` root when none is given: the folder that holds the served checkpoint (so
/// sibling folders, e.g. `runs/step-10` next to `runs/base`, reload), or the checkpoint itself when
/// that folder is `/`. `None` when the checkpoint does not resolve.
pub fn default_weights_root(checkpoint: &Path) -> Option<PathBuf> {
    let real = checkpoint.canonicalize().ok()?;
    match real.parent() {
        Some(p) if p.parent().is_some() => Some(p.to_path_buf()),
        _ => Some(real),
    }
}

/// `path` with `.` and `..` removed lexically, made absolute against the working directory.
fn lexical_absolute(path: &Path) -> PathBuf {
    let abs = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut out = PathBuf::new();
    for c in abs.components() {
        match c {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// The folder a `reload_weights` names, resolved (`..` and symlinks followed), or a refusal: 403
/// when it lies outside `root` (a canonical path; `None` refuses every folder), 400 when it is not
/// a directory. A path that does not resolve is judged by its lexical form, so a path outside the
/// root is refused the same way whether or not it exists. Links inside the folder are its owner's
/// business: the check is on the folder.
pub fn resolve_weights_path(path: &str, root: Option<&Path>) -> Result<PathBuf, ApiError> {
    let Some(root) = root else {
        return Err(ApiError::forbidden(format!(
            "reload_weights from {path:?} refused: vime-serve has no allowed weights root \
             (start it with --allowed-weights-root DIR)"
        )));
    };
    let outside = |resolved: &Path| {
        let via = if resolved == Path::new(path) {
            String::new()
        } else {
            format!(" (resolves to {})", resolved.display())
        };
        ApiError::forbidden(format!(
            "weights_path {path:?}{via} is outside the allowed weights root {} \
             (vime-serve --allowed-weights-root DIR sets it)",
            root.display()
        ))
    };
    match std::fs::canonicalize(path) {
        Ok(real) if !real.starts_with(root) => Err(outside(&real)),
        Ok(real) if !real.is_dir() => Err(ApiError::bad_request(
            format!("weights_path {path:?} is not a directory"),
            Some("kwargs"),
        )),
        Ok(real) => Ok(real),
        Err(e) => {
            let lexical = lexical_absolute(Path::new(path));
            if !lexical.starts_with(root) {
                return Err(outside(&lexical));
            }
            Err(ApiError::bad_request(
                format!("weights_path {path:?} is not a directory ({e})"),
                Some("kwargs"),
            ))
        }
    }
}

/// Builds the axum app and starts its batcher task (call inside a tokio runtime). With
/// `cfg.dev_mode` off, the dev routes answer 404 with how to turn them on.
pub fn app(engine: Arc<dyn RolloutEngine>, cfg: ServeConfig) -> Router {
    let (tx, rx) = mpsc::unbounded_channel();
    let shared = Arc::new(Shared {
        engine: engine.clone(),
        cfg: cfg.clone(),
        tx,
        paused: Mutex::new(None),
        weight_label: Mutex::new(None),
        sleeping: Mutex::new(None),
        created: unix_now(),
    });
    let batcher = Batcher {
        engine,
        rx,
        shared: shared.clone(),
        window: cfg.batch_window,
        max_batch: cfg.max_batch_size.max(1),
        queue: VecDeque::new(),
        reloads: VecDeque::new(),
        receiver: cfg
            .weight_transfer
            .map(|k| spawn_receiver(k, shared.engine.clone(), cfg.weight_transfer_timeout)),
        running: None,
        paused: None,
        pause_waiters: Vec::new(),
    };
    tokio::spawn(batcher.run());
    let mut router = Router::new();
    for r in ROUTES {
        let path = r.path;
        let handler = move |State(s): State<AppState>, RawQuery(q): RawQuery, body: Bytes| async move {
            match parse_request(&s.cfg, path, q.as_deref(), &body) {
                Ok(req) => execute(&s, req).await,
                Err(e) => e.into_response(),
            }
        };
        let method = match (r.dev && !cfg.dev_mode, r.method) {
            (true, _) => any(handler),
            (false, "GET") => get(handler),
            (false, _) => post(handler),
        };
        router = router.route(path, method);
    }
    router.with_state(shared)
}

/// Serves `app(engine, cfg)` on `listener` until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    engine: Arc<dyn RolloutEngine>,
    cfg: ServeConfig,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<()> {
    let app = app(engine, cfg);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
        .context("vime-serve HTTP server failed")
}

/// Runs a parsed request.
async fn execute(s: &AppState, req: Request) -> Response {
    match req {
        Request::Health if s.tx.is_closed() => StatusCode::SERVICE_UNAVAILABLE.into_response(),
        Request::Health => StatusCode::OK.into_response(),
        Request::Models => models(s),
        Request::Completion(p) => completions(s, p).await,
        Request::Pause(mode) => match s.send(|done| Msg::Pause { mode, done }).await {
            Ok(()) => Json(json!({"status": "paused"})).into_response(),
            Err(e) => e.into_response(),
        },
        Request::Resume => match s.send(|done| Msg::Resume { done }).await {
            Ok(()) => Json(json!({"status": "resumed"})).into_response(),
            Err(e) => e.into_response(),
        },
        Request::IsPaused => {
            let p = s.paused.lock().unwrap().is_some();
            Json(json!({"is_paused": p})).into_response()
        }
        Request::Sleep { level, mode } => sleep(s, level, mode).await,
        Request::WakeUp { tags } => wake_up(s, tags).await,
        Request::IsSleeping => {
            let sleeping = s.sleeping.lock().unwrap().is_some();
            Json(json!({"is_sleeping": sleeping})).into_response()
        }
        // No prefix cache here.
        Request::ResetPrefixCache => Json(json!({"success": true})).into_response(),
        // TP x PP x DP of the engine: vime-serve is one process.
        Request::GetWorldSize => Json(json!({"world_size": 1})).into_response(),
        Request::ReloadWeights(dir) => reload_weights(s, dir).await,
        Request::Extension { method, arg } => extension_rpc(s, &method, arg).await,
        Request::WeightInfo => Json(json!({"weight_version": s.version_label()})).into_response(),
        Request::UpdateWeightVersion(v) => {
            *s.weight_label.lock().unwrap() = Some(v.clone());
            Json(json!({"success": true, "new_version": v})).into_response()
        }
        Request::InitWeightTransfer(info) => {
            reply(weight_op(s, SyncOp::Init(info)).await, "Weight transfer initialized")
        }
        Request::StartWeightUpdate => reply(weight_op(s, SyncOp::Start).await, "Weight update started"),
        // Answers once the engine holds the bucket.
        Request::UpdateWeights(info) => reply(weight_op(s, SyncOp::Update(info)).await, "Weights updated"),
        // vLLM 0.33 takes the version here.
        Request::FinishWeightUpdate { weight_version } => {
            let r = weight_op(s, SyncOp::Finish).await;
            if r.is_ok() {
                if let Some(v) = weight_version {
                    *s.weight_label.lock().unwrap() = Some(v);
                }
            }
            reply(r, "Weight update finished")
        }
    }
}

fn models(s: &AppState) -> Response {
    Json(json!({
        "object": "list",
        "data": [{
            "id": s.cfg.served_model_name,
            "object": "model",
            "created": s.created,
            "owned_by": "vllm",
            "root": s.cfg.model_path,
            "parent": null,
            "max_model_len": s.cfg.max_model_len,
            "permission": [{
                "id": format!("modelperm-{}", random_hex()),
                "object": "model_permission",
                "created": s.created,
                "allow_create_engine": false,
                "allow_sampling": true,
                "allow_logprobs": true,
                "allow_search_indices": false,
                "allow_view": true,
                "allow_fine_tuning": false,
                "organization": "*",
                "group": null,
                "is_blocking": false,
            }],
        }],
    }))
    .into_response()
}

/// Query string pairs, percent-decoded, repeated keys kept (`tags=a&tags=b`).
fn query_pairs(q: Option<&str>) -> Vec<(String, String)> {
    let Some(q) = q else { return vec![] };
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() && hex(b[i + 1]).is_some() && hex(b[i + 2]).is_some() => {
                out.push((hex(b[i + 1]).unwrap() * 16 + hex(b[i + 2]).unwrap()) as u8);
                i += 2;
            }
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn query_one(pairs: &[(String, String)], key: &str) -> Option<String> {
    pairs.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v.clone())
}

fn parse_mode(pairs: &[(String, String)]) -> Result<PauseMode, ApiError> {
    match query_one(pairs, "mode") {
        None => Ok(PauseMode::Abort),
        Some(m) => m
            .parse()
            .map_err(|e: anyhow::Error| ApiError::bad_request(e.to_string(), Some("mode"))),
    }
}

const SLEEP_TAGS: [&str; 2] = ["weights", "kv_cache"];

async fn sleep(s: &AppState, level: u32, mode: PauseMode) -> Response {
    if let Err(e) = s.send(|done| Msg::Pause { mode, done }).await {
        return e.into_response();
    }
    // Level 0 pauses scheduling only; nothing is asleep (vLLM's `is_sleeping` stays false).
    if level >= 1 {
        *s.sleeping.lock().unwrap() = Some(SLEEP_TAGS.iter().map(|t| t.to_string()).collect());
        // The engine is idle (the pause answered): its weights go to the host. The KV cache lives
        // only inside a generate call, so there is none to drop.
        let engine = s.engine.clone();
        match tokio::task::spawn_blocking(move || engine.offload_weights()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return ApiError::internal(format!("sleep: {e:#}")).into_response(),
            Err(e) => return ApiError::internal(format!("sleep: {e}")).into_response(),
        }
    }
    Json(json!({"status": "sleeping", "level": level})).into_response()
}

async fn wake_up(s: &AppState, tags: Vec<String>) -> Response {
    let fully_awake = {
        let mut sleeping = s.sleeping.lock().unwrap();
        match sleeping.as_mut() {
            None => true,
            Some(set) => {
                if tags.is_empty() {
                    set.clear();
                } else {
                    // "scheduling" is vLLM's level-0 tag: nothing to wake for it.
                    for t in tags.iter().filter(|t| *t != "scheduling") {
                        if !set.remove(t) {
                            eprintln!("vime-serve: wake_up tag {t:?} is not in sleeping tags {set:?}");
                        }
                    }
                }
                if set.is_empty() {
                    *sleeping = None;
                    true
                } else {
                    false
                }
            }
        }
    };
    if tags.is_empty() || tags.iter().any(|t| t == "weights") {
        let engine = s.engine.clone();
        match tokio::task::spawn_blocking(move || engine.restore_weights()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return ApiError::internal(format!("wake_up: {e:#}")).into_response(),
            Err(e) => return ApiError::internal(format!("wake_up: {e}")).into_response(),
        }
    }
    if fully_awake {
        if let Err(e) = s.send(|done| Msg::Resume { done }).await {
            return e.into_response();
        }
    }
    let tags = if tags.is_empty() { Value::Null } else { json!(tags) };
    Json(json!({"status": if fully_awake { "awake" } else { "sleeping" }, "tags": tags})).into_response()
}

/// `collective_rpc("reload_weights")` on a folder [`resolve_weights_path`] let through.
async fn reload_weights(s: &AppState, dir: PathBuf) -> Response {
    let path = dir.display().to_string();
    match s.send(|done| Msg::Reload { dir, done }).await {
        Ok(Ok(version)) => {
            eprintln!("vime-serve: reloaded weights from {path}, weight_version {version}");
            Json(json!({"results": [null]})).into_response()
        }
        Ok(Err(msg)) => ApiError::internal(format!("reload_weights from {path} failed: {msg}")).into_response(),
        Err(e) => e.into_response(),
    }
}

/// Runs one weight-transfer call through the batcher (alone, between batches).
async fn weight_op(s: &AppState, op: SyncOp) -> Result<Value, ApiError> {
    let what = match &op {
        SyncOp::Init(_) => "init_weight_transfer_engine",
        SyncOp::Start => "start_weight_update",
        SyncOp::Update(_) => "update_weights",
        SyncOp::Finish => "finish_weight_update",
    };
    match s.send(|done| Msg::Weights { op, done }).await? {
        Ok(v) => Ok(v),
        Err(msg) => Err(ApiError::internal(format!("{what} failed: {msg}"))),
    }
}

/// The JSON object body of a weight-transfer route (empty bodies read as `{}`).
fn json_body(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    if body.iter().all(|b| b.is_ascii_whitespace()) {
        return Ok(Map::new());
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::bad_request("Request body must be a JSON object", None)),
        Err(e) => Err(ApiError::bad_request(format!("JSON decode error: {e}"), None)),
    }
}

/// vLLM's `{"message"}` answer, plus what the receiver measured (`load_s`: seconds this engine
/// spent receiving and loading).
fn reply(r: Result<Value, ApiError>, message: &str) -> Response {
    match r {
        Ok(mut v) => {
            if let Some(m) = v.as_object_mut() {
                m.insert("message".into(), json!(message));
            } else {
                v = json!({ "message": message });
            }
            Json(v).into_response()
        }
        Err(e) => e.into_response(),
    }
}

/// The object under `key` of a weight-transfer body (400 without it, as vLLM).
fn body_key(body: &[u8], key: &str) -> Result<Value, ApiError> {
    json_body(body)?
        .remove(key)
        .ok_or_else(|| ApiError::bad_request(format!("Missing '{key}' in request body"), Some(key)))
}

/// vime's worker-extension methods over `/collective_rpc` (one JSON-string argument), so the
/// sender's worker-extension protocol runs against vime-serve exactly as against vLLM.
async fn extension_rpc(s: &AppState, method: &str, arg: Value) -> Response {
    use vime_sync::protocol as p;
    let r = match method {
        m if m == p::EXT_INIT => weight_op(s, SyncOp::Init(arg)).await,
        m if m == p::EXT_START => weight_op(s, SyncOp::Start).await,
        m if m == p::EXT_UPDATE => weight_op(s, SyncOp::Update(arg)).await,
        m if m == p::EXT_FINISH => {
            let r = weight_op(s, SyncOp::Finish).await;
            if r.is_ok() {
                if let Some(v) = arg.get("weight_version").and_then(Value::as_str) {
                    *s.weight_label.lock().unwrap() = Some(v.to_string());
                }
            }
            r.map(|_| json!({"weight_version": s.version_label()}))
        }
        m if m == p::EXT_INFO => Ok(json!({"weight_version": s.version_label()})),
        m if m == p::RPC_CHECKSUMS => {
            let engine = s.engine.clone();
            match tokio::task::spawn_blocking(move || engine.weight_checksums()).await {
                Ok(Ok(sums)) => Ok(json!(sums
                    .into_iter()
                    .map(|(k, v)| (k, Value::String(format!("{v:016x}"))))
                    .collect::<Map<String, Value>>())),
                Ok(Err(e)) => Err(ApiError::internal(format!("{method}: {e:#}"))),
                Err(e) => Err(ApiError::internal(format!("{method} panicked: {e}"))),
            }
        }
        _ => unreachable!("dispatched on known names"),
    };
    match r {
        Ok(v) => Json(json!({"results": [v]})).into_response(),
        Err(e) => e.into_response(),
    }
}

// ------------------------------------------------------------------------------------------------
// /v1/completions

#[derive(Deserialize)]
#[serde(untagged)]
enum PromptField {
    Ids(Vec<i64>),
    Batch(Vec<Vec<i64>>),
    Text(String),
    Texts(Vec<String>),
}

/// The fields of vLLM's `CompletionRequest` that vime-serve reads; every other known field must be
/// absent, null or at its default (checked in [`reject_unsupported`]); unknown extra fields are
/// ignored as vLLM ignores them.
#[derive(Deserialize)]
struct CompletionRequest {
    model: Option<String>,
    prompt: Option<PromptField>,
    max_tokens: Option<i64>,
    n: Option<i64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    seed: Option<i64>,
    logprobs: Option<i64>,
    stop_token_ids: Option<Vec<i64>>,
    ignore_eos: Option<bool>,
    skip_special_tokens: Option<bool>,
    return_token_ids: Option<bool>,
    return_tokens_as_token_ids: Option<bool>,
    return_weight_versions: Option<bool>,
    add_special_tokens: Option<bool>,
    request_id: Option<String>,
    #[serde(flatten)]
    extra: Map<String, Value>,
}

/// `(field, value it may take)`: anything else is a 400.
fn reject_unsupported(extra: &Map<String, Value>) -> Result<(), ApiError> {
    let ok = |name: &str, v: &Value| -> bool {
        match name {
            "stream" | "echo" | "use_beam_search" => matches!(v, Value::Null | Value::Bool(false)),
            "stop" => match v {
                Value::Null => true,
                Value::String(s) => s.is_empty(),
                Value::Array(a) => a.is_empty(),
                _ => false,
            },
            "frequency_penalty" | "presence_penalty" | "min_p" => v.is_null() || v.as_f64() == Some(0.0),
            "repetition_penalty" | "length_penalty" => v.is_null() || v.as_f64() == Some(1.0),
            "min_tokens" => v.is_null() || v.as_i64() == Some(0),
            "logit_bias"
            | "allowed_token_ids"
            | "logprob_token_ids"
            | "prompt_logprobs"
            | "suffix"
            | "response_format"
            | "structured_outputs"
            | "prompt_embeds"
            | "truncate_prompt_tokens"
            | "stream_options"
            | "thinking_token_budget"
            | "repetition_detection"
            | "kv_transfer_params" => v.is_null(),
            "bad_words" => v.is_null() || v.as_array().is_some_and(|a| a.is_empty()),
            _ => true,
        }
    };
    for (k, v) in extra {
        if !ok(k, v) {
            return Err(ApiError::bad_request(
                format!("`{k}` = {v} is not supported by vime-serve"),
                Some(k),
            ));
        }
    }
    Ok(())
}

/// Most sequences (prompts x `n`) one completion request may ask for; vLLM has no such bound, but a
/// server that allocates per sequence needs one.
pub const MAX_SEQUENCES_PER_REQUEST: usize = 1 << 16;
/// Most token ids (each sequence's prompt and stop ids) one completion request may expand to.
pub const MAX_EXPANDED_TOKEN_IDS: usize = 1 << 24;

/// A completion request, checked: what the engine runs and how the answer is spelled.
pub struct CompletionParams {
    prompts: Vec<Vec<u32>>,
    n: usize,
    params: Vec<SamplingParams>,
    /// Stop ids the user asked for (for `stop_reason`), without the EOS ids we add.
    user_stops: Vec<u32>,
    logprobs: Option<i64>,
    return_token_ids: bool,
    as_token_ids: bool,
    skip_special_tokens: bool,
    return_weight_versions: bool,
    request_id: Option<String>,
}

fn parse_completion(cfg: &ServeConfig, body: &[u8]) -> Result<CompletionParams, ApiError> {
    let req: CompletionRequest =
        serde_json::from_slice(body).map_err(|e| ApiError::bad_request(format!("invalid request body: {e}"), None))?;
    reject_unsupported(&req.extra)?;
    if let Some(m) = &req.model {
        if !m.is_empty() && *m != cfg.served_model_name {
            return Err(ApiError::not_found(
                format!(
                    "The model `{m}` does not exist. Valid aliases: {}.",
                    cfg.served_model_name
                ),
                Some("model"),
            ));
        }
    }
    let add_special = req.add_special_tokens.unwrap_or(true);
    let encode = |text: &str| -> Result<Vec<i64>, ApiError> {
        let tok = cfg.tokenizer.as_ref().ok_or_else(|| {
            ApiError::bad_request(
                "text prompts need a tokenizer.json in the checkpoint; send token ids instead",
                Some("prompt"),
            )
        })?;
        let enc = tok
            .encode(text, add_special)
            .map_err(|e| ApiError::bad_request(format!("tokenizing the prompt failed: {e}"), Some("prompt")))?;
        Ok(enc.get_ids().iter().map(|&x| x as i64).collect())
    };
    let raw: Vec<Vec<i64>> = match req.prompt {
        None => {
            return Err(ApiError::bad_request(
                "Either prompt or prompt_embeds must be provided and non-empty.",
                Some("prompt"),
            ))
        }
        Some(PromptField::Ids(ids)) => vec![ids],
        Some(PromptField::Batch(b)) => b,
        Some(PromptField::Text(t)) => vec![encode(&t)?],
        Some(PromptField::Texts(ts)) => ts.iter().map(|t| encode(t)).collect::<Result<_, _>>()?,
    };
    if raw.is_empty() {
        return Err(ApiError::bad_request(
            "prompt must hold at least one prompt",
            Some("prompt"),
        ));
    }
    let mut prompts = Vec::with_capacity(raw.len());
    for (i, p) in raw.iter().enumerate() {
        if p.is_empty() {
            return Err(ApiError::bad_request(format!("prompt {i} is empty"), Some("prompt")));
        }
        let mut ids = Vec::with_capacity(p.len());
        for &t in p {
            if t < 0 || t as u64 >= cfg.vocab_size as u64 {
                return Err(ApiError::bad_request(
                    format!(
                        "Token id {t} in prompt {i} is out of vocabulary (vocab_size {})",
                        cfg.vocab_size
                    ),
                    Some("prompt"),
                ));
            }
            ids.push(t as u32);
        }
        if ids.len() >= cfg.max_model_len {
            return Err(ApiError::bad_request(
                format!(
                    "Input length ({}) of prompt {i} leaves no room to generate within the model's maximum \
                     context length ({})",
                    ids.len(),
                    cfg.max_model_len
                ),
                Some("prompt"),
            ));
        }
        prompts.push(ids);
    }
    let n = req.n.unwrap_or(1);
    if n < 1 {
        return Err(ApiError::bad_request(
            format!("n must be at least 1, got {n}."),
            Some("n"),
        ));
    }
    let max_tokens = req.max_tokens.unwrap_or(16);
    if max_tokens < 1 {
        return Err(ApiError::bad_request(
            format!("max_tokens must be at least 1, got {max_tokens}."),
            Some("max_tokens"),
        ));
    }
    let temperature = req.temperature.unwrap_or(1.0);
    if !temperature.is_finite() || !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::bad_request(
            format!("temperature must be in [0, 2], got {temperature}."),
            Some("temperature"),
        ));
    }
    let top_p = req.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::bad_request(
            format!("top_p must be in (0, 1], got {top_p}."),
            Some("top_p"),
        ));
    }
    let top_k = req.top_k.unwrap_or(0);
    if top_k < -1 {
        return Err(ApiError::bad_request(
            format!("top_k must be 0 (disable), or at least 1, got {top_k}."),
            Some("top_k"),
        ));
    }
    if let Some(lp) = req.logprobs {
        if lp < 0 && lp != -1 {
            return Err(ApiError::bad_request(
                "`logprobs` must be a positive value or -1.",
                Some("logprobs"),
            ));
        }
    }
    let mut user_stops = Vec::new();
    for &t in req.stop_token_ids.as_deref().unwrap_or(&[]) {
        if t < 0 || t as u64 >= cfg.vocab_size as u64 {
            return Err(ApiError::bad_request(
                format!("stop token id {t} is out of vocabulary"),
                Some("stop_token_ids"),
            ));
        }
        user_stops.push(t as u32);
    }
    let mut stops = user_stops.clone();
    if !req.ignore_eos.unwrap_or(false) {
        for &e in &cfg.eos_token_ids {
            if !stops.contains(&e) {
                stops.push(e);
            }
        }
    }
    // Every sequence holds its own prompt and stop ids: bound what one request expands to before
    // allocating it (found by `tests/fuzz.rs`: `"n": 4294967296` asked for 309 GB and aborted).
    let seqs = prompts.len().saturating_mul(n as usize);
    if seqs > MAX_SEQUENCES_PER_REQUEST {
        return Err(ApiError::bad_request(
            format!(
                "n ({n}) x {} prompt(s) is {seqs} sequences, more than vime-serve's limit of \
                 {MAX_SEQUENCES_PER_REQUEST} per request",
                prompts.len()
            ),
            Some("n"),
        ));
    }
    let ids = (prompts.iter().map(|p| p.len() + stops.len()).sum::<usize>()).saturating_mul(n as usize);
    if ids > MAX_EXPANDED_TOKEN_IDS {
        return Err(ApiError::bad_request(
            format!(
                "n ({n}) copies of the prompts and their stop ids are {ids} token ids, more than \
                 vime-serve's limit of {MAX_EXPANDED_TOKEN_IDS} per request; send fewer prompts or a smaller n"
            ),
            Some("n"),
        ));
    }
    let mut params = Vec::with_capacity(seqs);
    for p in &prompts {
        let room = cfg.max_model_len - p.len();
        for i in 0..n {
            params.push(SamplingParams {
                temperature,
                top_p,
                top_k,
                max_tokens: (max_tokens as usize).min(room),
                stop_token_ids: stops.clone(),
                // n > 1 with a seed: sample i uses seed + i, so the n samples differ but replay exactly.
                seed: req.seed.map(|s| (s as u64).wrapping_add(i as u64)),
            });
        }
    }
    Ok(CompletionParams {
        prompts,
        n: n as usize,
        params,
        user_stops,
        logprobs: req.logprobs,
        return_token_ids: req.return_token_ids.unwrap_or(false),
        as_token_ids: req.return_tokens_as_token_ids.unwrap_or(false),
        skip_special_tokens: req.skip_special_tokens.unwrap_or(true),
        return_weight_versions: req.return_weight_versions.unwrap_or(false),
        request_id: req.request_id,
    })
}

async fn completions(s: &AppState, parsed: CompletionParams) -> Response {
    let requests: Vec<GenRequest> = parsed
        .prompts
        .iter()
        .flat_map(|p| std::iter::repeat_n(p, parsed.n))
        .zip(parsed.params.iter().cloned())
        .map(|(p, params)| GenRequest {
            prompt_ids: p.clone(),
            params,
        })
        .collect();
    let result = s
        .send(|reply| {
            Msg::Generate(GenJob {
                requests,
                arrived: Instant::now(),
                reply,
            })
        })
        .await;
    let (outs, version) = match result {
        Err(e) => return e.into_response(),
        Ok(Err(JobError::Paused)) => return ApiError::paused().into_response(),
        Ok(Err(JobError::Engine(msg))) => return ApiError::internal(msg).into_response(),
        Ok(Ok(done)) => done,
    };
    Json(completion_response(&s.cfg, &parsed, outs, &version)).into_response()
}

fn completion_response(cfg: &ServeConfig, p: &CompletionParams, outs: Vec<GenOutput>, version: &str) -> Value {
    let tok = cfg.tokenizer.as_deref();
    let decode = |ids: &[u32]| -> String {
        tok.and_then(|t| t.decode(ids, p.skip_special_tokens).ok())
            .unwrap_or_default()
    };
    let token_str = |id: u32| -> String {
        match tok {
            Some(t) if !p.as_token_ids => t.decode(&[id], false).unwrap_or_else(|_| format!("token_id:{id}")),
            _ => format!("token_id:{id}"),
        }
    };
    let mut choices = Vec::with_capacity(outs.len());
    let mut completion_tokens = 0usize;
    for (k, out) in outs.into_iter().enumerate() {
        let prompt = &p.prompts[k / p.n];
        completion_tokens += out.token_ids.len();
        let logprobs = p.logprobs.map(|_| {
            let tokens: Vec<String> = out.token_ids.iter().map(|&t| token_str(t)).collect();
            let mut offsets = Vec::with_capacity(tokens.len());
            let mut at = 0usize;
            for t in &tokens {
                offsets.push(at);
                at += t.chars().count();
            }
            let lps: Vec<f64> = out.logprobs.iter().map(|&x| (x as f64).max(-9999.0)).collect();
            let top: Vec<Value> = tokens
                .iter()
                .zip(&lps)
                .map(|(t, &lp)| json!({ t.clone(): lp }))
                .collect();
            json!({"text_offset": offsets, "token_logprobs": lps, "tokens": tokens, "top_logprobs": top})
        });
        let stop_reason = match (out.finish_reason, out.token_ids.last()) {
            (FinishReason::Stop, Some(&last)) if p.user_stops.contains(&last) => json!(last),
            _ => Value::Null,
        };
        let finish = match out.finish_reason {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        };
        choices.push(json!({
            "index": k,
            "text": decode(&out.token_ids),
            "logprobs": logprobs,
            "finish_reason": finish,
            "stop_reason": stop_reason,
            "token_ids": if p.return_token_ids { json!(out.token_ids) } else { Value::Null },
            "prompt_logprobs": null,
            "prompt_token_ids": if p.return_token_ids { json!(prompt) } else { Value::Null },
            "routed_experts": null,
            "weight_versions": if p.return_weight_versions {
                json!([{"version": version, "start": 0, "end": out.token_ids.len()}])
            } else {
                Value::Null
            },
        }));
    }
    let prompt_tokens: usize = p.prompts.iter().map(|x| x.len()).sum();
    let id = match &p.request_id {
        Some(r) => format!("cmpl-{r}"),
        None => format!("cmpl-{}", random_hex()),
    };
    json!({
        "id": id,
        "object": "text_completion",
        "created": unix_now(),
        "model": cfg.served_model_name,
        "choices": choices,
        "service_tier": null,
        "system_fingerprint": null,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": null,
            "completion_tokens_details": null,
        },
        "kv_transfer_params": null,
        "ec_transfer_params": null,
        "metrics": null,
    })
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// 32 hex digits, unique within the process (ids only; not a security token).
fn random_hex() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let c = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mix = (nanos ^ (std::process::id() as u64) << 32).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    format!("{mix:016x}{c:016x}")
}
