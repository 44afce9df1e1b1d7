//! `vime-serve` over HTTP, in process: vLLM 0.33 response shapes (field for field), pause modes,
//! sleep/wake, weight reload and version, batching, and 400s for requests it cannot honour.
//!
//! Most tests run a deterministic mock engine (with a gate that holds `generate` open, to catch the
//! server mid-batch); the last ones run the built-in engine on `tests/fixtures/hf/tied_gqa` and check
//! that what comes over HTTP is exactly what the engine returns in process.
use anyhow::Result;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;
use vime_rollout::engine::embedded::EmbeddedEngine;
use vime_rollout::engine::{FinishReason, GenOutput, GenRequest, RolloutEngine, SamplingParams};
use vime_rollout::serve::{self, ServeConfig};

const VOCAB: usize = 100;

/// Deterministic engine: token i of a request is `(sum(prompt) + 7 i) % VOCAB`, its log-prob
/// `-0.1 (i + 1)`; stops after a stop id (kept) or at `max_tokens`. `hold()` makes `generate`
/// wait until `release()`.
#[derive(Default)]
struct MockEngine {
    version: AtomicU64,
    batches: Mutex<Vec<usize>>,
    entered: AtomicUsize,
    gate: Mutex<bool>,
    cv: Condvar,
}

impl MockEngine {
    fn hold(&self) {
        *self.gate.lock().unwrap() = true;
    }
    fn release(&self) {
        *self.gate.lock().unwrap() = false;
        self.cv.notify_all();
    }
    fn expected(r: &GenRequest) -> GenOutput {
        let base: u32 = r.prompt_ids.iter().sum();
        let mut out = GenOutput {
            token_ids: vec![],
            logprobs: vec![],
            finish_reason: FinishReason::Length,
        };
        for i in 0..r.params.max_tokens {
            let t = (base + 7 * i as u32) % VOCAB as u32;
            out.token_ids.push(t);
            out.logprobs.push(-0.1 * (i + 1) as f32);
            if r.params.stop_token_ids.contains(&t) {
                out.finish_reason = FinishReason::Stop;
                break;
            }
        }
        out
    }
}

impl RolloutEngine for MockEngine {
    fn generate(&self, requests: &[GenRequest]) -> Result<Vec<GenOutput>> {
        self.entered.fetch_add(1, Ordering::SeqCst);
        let mut g = self.gate.lock().unwrap();
        while *g {
            g = self.cv.wait(g).unwrap();
        }
        drop(g);
        self.batches.lock().unwrap().push(requests.len());
        Ok(requests.iter().map(Self::expected).collect())
    }
    fn update_weights_from_dir(&self, dir: &Path) -> Result<()> {
        anyhow::ensure!(dir.join("config.json").exists(), "no config.json in {}", dir.display());
        self.version.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    fn weight_version(&self) -> u64 {
        self.version.load(Ordering::SeqCst)
    }
}

fn mock_config() -> ServeConfig {
    ServeConfig {
        served_model_name: "mock".into(),
        model_path: "/models/mock".into(),
        max_model_len: 64,
        vocab_size: VOCAB,
        eos_token_ids: vec![99],
        tokenizer: None,
        batch_window: Duration::from_millis(5),
        max_batch_size: 256,
        weight_transfer: None,
        weight_transfer_timeout: Duration::from_secs(30),
        // The control endpoints these tests drive are dev endpoints; the root is not what they
        // test (`serve_security.rs` does both).
        dev_mode: true,
        allowed_weights_root: Some(PathBuf::from("/")),
    }
}

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf/tied_gqa")
}

struct Server {
    base: String,
    http: reqwest::Client,
}

impl Server {
    async fn start(engine: Arc<dyn RolloutEngine>, cfg: ServeConfig) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(serve::serve(listener, engine, cfg, std::future::pending()));
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .unwrap();
        Self { base, http }
    }
    async fn post(&self, path: &str, body: Value) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }
    async fn post_raw(&self, path: &str, body: &'static str) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .body(body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap_or(Value::Null))
    }
    async fn get(&self, path: &str) -> (u16, Value) {
        let r = self.http.get(format!("{}{path}", self.base)).send().await.unwrap();
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }
}

fn keys(v: &Value) -> BTreeSet<String> {
    v.as_object().unwrap().keys().cloned().collect()
}

fn set(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|s| s.to_string()).collect()
}

async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), f)
        .await
        .unwrap_or_else(|_| panic!("{what}: timed out"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn completion_response_has_vllm_shape() {
    let engine = Arc::new(MockEngine::default());
    let s = Server::start(engine.clone(), mock_config()).await;
    let (status, v) = s
        .post(
            "/v1/completions",
            json!({"model": "mock", "prompt": [[1, 2, 3], [4, 5]], "n": 2, "max_tokens": 4, "temperature": 0.7,
                   "top_p": 0.9, "top_k": 20, "seed": 3, "logprobs": 0, "return_token_ids": true,
                   "return_weight_versions": true, "stop_token_ids": [13], "request_id": "abc"}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    // CompletionResponse (entrypoints/openai/completion/protocol.py), every field present.
    assert_eq!(
        keys(&v),
        set(&[
            "id",
            "object",
            "created",
            "model",
            "choices",
            "service_tier",
            "system_fingerprint",
            "usage",
            "kv_transfer_params",
            "ec_transfer_params",
            "metrics"
        ])
    );
    assert_eq!(v["id"], "cmpl-abc");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["model"], "mock");
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4, "2 prompts x n=2, prompt-major");
    let prompts = [vec![1u32, 2, 3], vec![4, 5]];
    for (k, c) in choices.iter().enumerate() {
        assert_eq!(
            keys(c),
            set(&[
                "index",
                "text",
                "logprobs",
                "finish_reason",
                "stop_reason",
                "token_ids",
                "prompt_logprobs",
                "prompt_token_ids",
                "routed_experts",
                "weight_versions"
            ])
        );
        assert_eq!(c["index"], k);
        let prompt = &prompts[k / 2];
        assert_eq!(c["prompt_token_ids"], json!(prompt));
        let req = GenRequest {
            prompt_ids: prompt.clone(),
            params: SamplingParams {
                max_tokens: 4,
                stop_token_ids: vec![13, 99],
                ..Default::default()
            },
        };
        let want = MockEngine::expected(&req);
        assert_eq!(c["token_ids"], json!(want.token_ids));
        let lp = &c["logprobs"];
        assert_eq!(
            keys(lp),
            set(&["text_offset", "token_logprobs", "tokens", "top_logprobs"])
        );
        let lps: Vec<f64> = lp["token_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(lps.len(), want.token_ids.len());
        for (a, b) in lps.iter().zip(&want.logprobs) {
            assert!((a - *b as f64).abs() < 1e-6);
        }
        // No tokenizer: tokens are spelled as vLLM's return_tokens_as_token_ids does.
        let toks: Vec<String> = want.token_ids.iter().map(|t| format!("token_id:{t}")).collect();
        assert_eq!(lp["tokens"], json!(toks));
        assert_eq!(lp["top_logprobs"][0], json!({ toks[0].clone(): lps[0] }));
        assert_eq!(lp["text_offset"][0], 0);
        assert_eq!(lp["text_offset"][1], toks[0].len());
        assert_eq!(c["text"], "");
        assert_eq!(
            c["weight_versions"],
            json!([{"version": "0", "start": 0, "end": want.token_ids.len()}])
        );
    }
    // Prompt [1,2,3]: tokens 6, 13 -> user stop id 13: finish "stop", stop_reason 13.
    assert_eq!(choices[0]["token_ids"], json!([6, 13]));
    assert_eq!(choices[0]["finish_reason"], "stop");
    assert_eq!(choices[0]["stop_reason"], 13);
    // Prompt [4,5]: 9, 16, 23, 30 -> length.
    assert_eq!(choices[2]["finish_reason"], "length");
    assert_eq!(choices[2]["stop_reason"], Value::Null);
    assert_eq!(
        v["usage"],
        json!({"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17,
               "prompt_tokens_details": null, "completion_tokens_details": null})
    );

    // Without return_token_ids / logprobs those fields are null, as in vLLM.
    let (status, v) = s
        .post("/v1/completions", json!({"prompt": [1, 2], "max_tokens": 2}))
        .await;
    assert_eq!(status, 200);
    let c = &v["choices"][0];
    assert_eq!(c["token_ids"], Value::Null);
    assert_eq!(c["prompt_token_ids"], Value::Null);
    assert_eq!(c["logprobs"], Value::Null);
    assert_eq!(c["weight_versions"], Value::Null);
    assert!(v["id"].as_str().unwrap().starts_with("cmpl-"));

    // EOS (99, from the server config) stops with stop_reason null; ignore_eos lifts it.
    let (_, v) = s
        .post(
            "/v1/completions",
            json!({"prompt": [92], "max_tokens": 5, "return_token_ids": true}),
        )
        .await;
    assert_eq!(v["choices"][0]["token_ids"], json!([92, 99]));
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(v["choices"][0]["stop_reason"], Value::Null);
    let (_, v) = s
        .post(
            "/v1/completions",
            json!({"prompt": [92], "max_tokens": 3, "ignore_eos": true, "return_token_ids": true}),
        )
        .await;
    assert_eq!(v["choices"][0]["token_ids"], json!([92, 99, 6]));
    assert_eq!(v["choices"][0]["finish_reason"], "length");

    // max_tokens is cut to the room left under max_model_len (vLLM's get_max_tokens).
    let long: Vec<u32> = vec![0; 60];
    let (_, v) = s
        .post(
            "/v1/completions",
            json!({"prompt": long, "max_tokens": 50, "return_token_ids": true}),
        )
        .await;
    assert_eq!(v["choices"][0]["token_ids"].as_array().unwrap().len(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn models_health_and_control_endpoints() {
    let engine = Arc::new(MockEngine::default());
    let s = Server::start(engine, mock_config()).await;
    let r = s.http.get(format!("{}/health", s.base)).send().await.unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert_eq!(r.text().await.unwrap(), "");
    let (status, v) = s.get("/v1/models").await;
    assert_eq!(status, 200);
    assert_eq!(v["object"], "list");
    let card = &v["data"][0];
    assert_eq!(
        keys(card),
        set(&[
            "id",
            "object",
            "created",
            "owned_by",
            "root",
            "parent",
            "max_model_len",
            "permission"
        ])
    );
    assert_eq!(card["id"], "mock");
    assert_eq!(card["root"], "/models/mock");
    assert_eq!(card["max_model_len"], 64);
    assert_eq!(card["object"], "model");
    assert_eq!(card["permission"][0]["object"], "model_permission");
    assert_eq!(
        s.post("/reset_prefix_cache", json!({})).await,
        (200, json!({"success": true}))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_requests_are_400_with_a_message() {
    let engine = Arc::new(MockEngine::default());
    let s = Server::start(engine.clone(), mock_config()).await;
    let cases: Vec<(Value, &str, &str)> = vec![
        (json!({"max_tokens": 4}), "prompt", "prompt"),
        (json!({"prompt": []}), "empty", "prompt"),
        (json!({"prompt": [[1], []]}), "prompt 1 is empty", "prompt"),
        (json!({"prompt": [1, 100]}), "out of vocabulary", "prompt"),
        (json!({"prompt": [1, -1]}), "out of vocabulary", "prompt"),
        (json!({"prompt": "hello"}), "tokenizer", "prompt"),
        (json!({"prompt": vec![1; 64]}), "maximum context length", "prompt"),
        (
            json!({"prompt": [1], "max_tokens": 0}),
            "max_tokens must be at least 1",
            "max_tokens",
        ),
        (json!({"prompt": [1], "n": 0}), "n must be at least 1", "n"),
        (
            json!({"prompt": [1], "temperature": 2.5}),
            "temperature must be in [0, 2]",
            "temperature",
        ),
        (json!({"prompt": [1], "top_p": 0.0}), "top_p must be in (0, 1]", "top_p"),
        (json!({"prompt": [1], "top_k": -2}), "top_k", "top_k"),
        (json!({"prompt": [1], "logprobs": -3}), "logprobs", "logprobs"),
        (
            json!({"prompt": [1], "stop_token_ids": [1000]}),
            "out of vocabulary",
            "stop_token_ids",
        ),
        (json!({"prompt": [1], "stream": true}), "`stream`", "stream"),
        (json!({"prompt": [1], "stop": ["</s>"]}), "`stop`", "stop"),
        (
            json!({"prompt": [1], "use_beam_search": true}),
            "`use_beam_search`",
            "use_beam_search",
        ),
        (
            json!({"prompt": [1], "presence_penalty": 0.5}),
            "`presence_penalty`",
            "presence_penalty",
        ),
        (
            json!({"prompt": [1], "logit_bias": {"3": 1.0}}),
            "`logit_bias`",
            "logit_bias",
        ),
        (json!({"prompt": [1], "max_tokens": "many"}), "invalid request body", ""),
    ];
    for (body, needle, param) in cases {
        let (status, v) = s.post("/v1/completions", body.clone()).await;
        assert_eq!(status, 400, "{body} -> {v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(needle), "{body}: message {msg:?} lacks {needle:?}");
        assert_eq!(v["error"]["type"], "BadRequestError");
        assert_eq!(v["error"]["code"], 400);
        if !param.is_empty() {
            assert_eq!(v["error"]["param"], param, "{body}");
        }
    }
    let (status, v) = s.post_raw("/v1/completions", "{not json").await;
    assert_eq!(status, 400);
    assert!(v["error"]["message"].as_str().unwrap().contains("invalid request body"));
    // The wrong model is a 404 NotFoundError, as in vLLM.
    let (status, v) = s
        .post("/v1/completions", json!({"model": "other", "prompt": [1]}))
        .await;
    assert_eq!(status, 404);
    assert_eq!(v["error"]["type"], "NotFoundError");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("The model `other` does not exist"));
    // Control endpoints validate their query params.
    let (status, v) = s.post("/pause?mode=later", json!({})).await;
    assert_eq!(status, 400);
    assert!(v["error"]["message"].as_str().unwrap().contains("abort, wait, keep"));
    let (status, _) = s.post("/sleep?level=3", json!({})).await;
    assert_eq!(status, 400);
    let (status, v) = s
        .post("/collective_rpc", json!({"method": "init_weight_transfer"}))
        .await;
    assert_eq!(status, 400);
    assert!(v["error"]["message"].as_str().unwrap().contains("reload_weights"));
    let (status, v) = s
        .post("/collective_rpc", json!({"method": "reload_weights", "kwargs": {}}))
        .await;
    assert_eq!(status, 400);
    assert!(v["error"]["message"].as_str().unwrap().contains("weights_path"));
    let (status, v) = s
        .post(
            "/collective_rpc",
            json!({"method": "reload_weights", "kwargs": {"weights_path": "/nonexistent/x"}}),
        )
        .await;
    assert_eq!(status, 400);
    assert!(v["error"]["message"].as_str().unwrap().contains("/nonexistent/x"));
    assert!(v["error"]["message"].as_str().unwrap().contains("not a directory"));
    assert!(
        engine.batches.lock().unwrap().is_empty(),
        "no bad request reached the engine"
    );
}

/// Starts a completion in the background; returns its handle.
fn spawn_completion(s: &Server, prompt: Vec<u32>) -> tokio::task::JoinHandle<(u16, Value)> {
    let http = s.http.clone();
    let url = format!("{}/v1/completions", s.base);
    tokio::spawn(async move {
        let r = http
            .post(url)
            .json(&json!({"prompt": prompt, "max_tokens": 3, "return_token_ids": true, "logprobs": 0}))
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().await.unwrap())
    })
}

async fn wait_entered(engine: &MockEngine, n: usize) {
    within("engine entry", async {
        while engine.entered.load(Ordering::SeqCst) < n {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pause_abort_aborts_queued_and_rejects_new_until_resume() {
    let engine = Arc::new(MockEngine::default());
    let s = Server::start(engine.clone(), mock_config()).await;
    engine.hold();
    let a = spawn_completion(&s, vec![1]);
    wait_entered(&engine, 1).await; // A is inside engine.generate
    let b = spawn_completion(&s, vec![2]); // B queues behind it
    tokio::time::sleep(Duration::from_millis(50)).await;
    let pause = {
        let (http, url) = (s.http.clone(), format!("{}/pause?mode=abort", s.base));
        tokio::spawn(async move { http.post(url).send().await.unwrap().json::<Value>().await.unwrap() })
    };
    // B comes back at once, aborted, with no tokens (vLLM: finish_reason "abort").
    let (status, vb) = within("aborted B", b).await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(vb["choices"][0]["finish_reason"], "abort");
    assert_eq!(vb["choices"][0]["token_ids"], json!([]));
    // /pause answers only once the engine is idle: A is still inside generate.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(!pause.is_finished(), "/pause returned while a batch was in the engine");
    assert_eq!(s.get("/is_paused").await, (200, json!({"is_paused": true})));
    engine.release();
    assert_eq!(within("pause", pause).await.unwrap(), json!({"status": "paused"}));
    let (status, va) = within("A", a).await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(
        va["choices"][0]["finish_reason"], "length",
        "a batch inside the engine finishes"
    );
    // New requests: 503 ServiceUnavailableError until /resume.
    let (status, v) = s.post("/v1/completions", json!({"prompt": [3]})).await;
    assert_eq!(status, 503);
    assert_eq!(v["error"]["type"], "ServiceUnavailableError");
    assert_eq!(
        v["error"]["message"],
        "Generation is paused. Please retry after it resumes."
    );
    assert_eq!(s.post("/resume", json!({})).await, (200, json!({"status": "resumed"})));
    assert_eq!(s.get("/is_paused").await, (200, json!({"is_paused": false})));
    let (status, _) = s.post("/v1/completions", json!({"prompt": [3]})).await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pause_wait_drains_admitted_requests() {
    let engine = Arc::new(MockEngine::default());
    let s = Server::start(engine.clone(), mock_config()).await;
    engine.hold();
    let a = spawn_completion(&s, vec![1]);
    wait_entered(&engine, 1).await;
    let b = spawn_completion(&s, vec![2]);
    tokio::time::sleep(Duration::from_millis(50)).await;
    let pause = {
        let (http, url) = (s.http.clone(), format!("{}/pause?mode=wait", s.base));
        tokio::spawn(async move { http.post(url).send().await.unwrap().status().as_u16() })
    };
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (status, _) = s.post("/v1/completions", json!({"prompt": [3]})).await;
    assert_eq!(status, 503, "new requests are rejected while pausing in wait mode");
    assert!(!pause.is_finished());
    engine.release();
    assert_eq!(within("pause", pause).await.unwrap(), 200);
    // Both admitted requests completed normally before /pause returned.
    for h in [a, b] {
        let (status, v) = h.await.unwrap();
        assert_eq!(status, 200);
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(v["choices"][0]["token_ids"].as_array().unwrap().len(), 3);
    }
    assert_eq!(engine.entered.load(Ordering::SeqCst), 2);
    s.post("/resume", json!({})).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pause_keep_holds_new_requests_until_resume() {
    let engine = Arc::new(MockEngine::default());
    let s = Server::start(engine.clone(), mock_config()).await;
    assert_eq!(
        s.post("/pause?mode=keep", json!({})).await,
        (200, json!({"status": "paused"}))
    );
    assert_eq!(s.get("/is_paused").await.1, json!({"is_paused": true}));
    let c = spawn_completion(&s, vec![5]);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!c.is_finished(), "a request made while paused (keep) waits");
    assert_eq!(engine.entered.load(Ordering::SeqCst), 0);
    s.post("/resume", json!({})).await;
    let (status, v) = within("held request", c).await.unwrap();
    assert_eq!(status, 200);
    assert_eq!(v["choices"][0]["token_ids"], json!([5, 12, 19]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sleep_pauses_and_wake_up_by_tags_resumes() {
    let engine = Arc::new(MockEngine::default());
    let s = Server::start(engine.clone(), mock_config()).await;
    assert_eq!(
        s.post("/sleep?level=1&mode=keep", json!({})).await,
        (200, json!({"status": "sleeping", "level": 1}))
    );
    assert_eq!(s.get("/is_sleeping").await.1, json!({"is_sleeping": true}));
    assert_eq!(s.get("/is_paused").await.1, json!({"is_paused": true}));
    assert_eq!(
        s.post("/wake_up?tags=weights", json!({})).await,
        (200, json!({"status": "sleeping", "tags": ["weights"]}))
    );
    assert_eq!(s.get("/is_paused").await.1, json!({"is_paused": true}));
    assert_eq!(
        s.post("/wake_up?tags=kv_cache", json!({})).await,
        (200, json!({"status": "awake", "tags": ["kv_cache"]}))
    );
    assert_eq!(s.get("/is_sleeping").await.1, json!({"is_sleeping": false}));
    assert_eq!(s.get("/is_paused").await.1, json!({"is_paused": false}));
    // Both tags in one call, and no tags at all (wakes everything; tags null as in vLLM).
    s.post("/sleep?level=2", json!({})).await;
    assert_eq!(
        s.post("/wake_up?tags=weights&tags=kv_cache", json!({})).await,
        (200, json!({"status": "awake", "tags": ["weights", "kv_cache"]}))
    );
    s.post("/sleep?level=1", json!({})).await;
    assert_eq!(
        s.post("/wake_up", json!({})).await,
        (200, json!({"status": "awake", "tags": null}))
    );
    // Level 0 pauses scheduling only: not sleeping, but paused until woken ("scheduling" tag).
    s.post("/sleep?level=0", json!({})).await;
    assert_eq!(s.get("/is_sleeping").await.1, json!({"is_sleeping": false}));
    assert_eq!(s.get("/is_paused").await.1, json!({"is_paused": true}));
    assert_eq!(
        s.post("/wake_up?tags=scheduling", json!({})).await,
        (200, json!({"status": "awake", "tags": ["scheduling"]}))
    );
    assert_eq!(s.get("/is_paused").await.1, json!({"is_paused": false}));
    let (status, _) = s.post("/v1/completions", json!({"prompt": [1]})).await;
    assert_eq!(status, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn reload_weights_bumps_the_version() {
    let engine = Arc::new(MockEngine::default());
    let s = Server::start(engine.clone(), mock_config()).await;
    assert_eq!(s.get("/weight_info").await, (200, json!({"weight_version": "0"})));
    let dir = fixture_dir().canonicalize().unwrap();
    let body = json!({"method": "reload_weights", "args": [], "kwargs": {"weights_path": dir}});
    assert_eq!(
        s.post("/collective_rpc", body.clone()).await,
        (200, json!({"results": [null]}))
    );
    assert_eq!(engine.weight_version(), 1);
    assert_eq!(s.get("/weight_info").await.1, json!({"weight_version": "1"}));
    // A label set by /update_weight_version shows in /weight_info and in weight_versions spans.
    assert_eq!(
        s.post("/update_weight_version", json!({"new_version": "step-7"})).await,
        (200, json!({"success": true, "new_version": "step-7"}))
    );
    assert_eq!(s.get("/weight_info").await.1, json!({"weight_version": "step-7"}));
    let (_, v) = s
        .post(
            "/v1/completions",
            json!({"prompt": [1], "max_tokens": 2, "return_weight_versions": true}),
        )
        .await;
    assert_eq!(
        v["choices"][0]["weight_versions"],
        json!([{"version": "step-7", "start": 0, "end": 2}])
    );
    // A reload while paused (keep) works and runs between batches.
    s.post("/pause?mode=keep", json!({})).await;
    assert_eq!(s.post("/collective_rpc", body).await.0, 200);
    assert_eq!(s.get("/weight_info").await.1, json!({"weight_version": "2"}));
    s.post("/resume", json!({})).await;
    // A failing reload is a 500 naming the path, and the version stays.
    let tmp = tempfile::tempdir().unwrap();
    let bad = json!({"method": "reload_weights", "kwargs": {"weights_path": tmp.path()}});
    let (status, v) = s.post("/collective_rpc", bad).await;
    assert_eq!(status, 500);
    assert!(v["error"]["message"].as_str().unwrap().contains("config.json"), "{v}");
    assert_eq!(engine.weight_version(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_requests_share_engine_calls() {
    let engine = Arc::new(MockEngine::default());
    let mut cfg = mock_config();
    cfg.batch_window = Duration::from_millis(100);
    let s = Server::start(engine.clone(), cfg).await;
    let hs: Vec<_> = (0..8).map(|i| spawn_completion(&s, vec![i])).collect();
    for (i, h) in hs.into_iter().enumerate() {
        let (status, v) = within("batched request", h).await.unwrap();
        assert_eq!(status, 200);
        let i = i as u32;
        assert_eq!(
            v["choices"][0]["token_ids"],
            json!([i, i + 7, i + 14]),
            "each request gets its own output"
        );
    }
    let batches = engine.batches.lock().unwrap().clone();
    assert_eq!(batches.iter().sum::<usize>(), 8);
    assert!(
        batches.len() < 8,
        "8 requests within the window should share engine calls, got {batches:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn embedded_engine_served_matches_in_process() {
    let dir = fixture_dir();
    let mut cfg = ServeConfig::from_hf_dir(&dir, Some("tied".into())).unwrap();
    cfg.dev_mode = true;
    let engine: Arc<dyn RolloutEngine> =
        Arc::new(EmbeddedEngine::load_hf(&dir, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap());
    let s = Server::start(engine.clone(), cfg).await;
    let body = json!({"model": "tied", "prompt": [[3, 17, 42], [9, 8]], "max_tokens": 6, "temperature": 1.0,
                      "top_p": 0.9, "top_k": 40, "seed": 1234, "logprobs": 1, "return_token_ids": true});
    let (status, v) = s.post("/v1/completions", body).await;
    assert_eq!(status, 200, "{v}");
    let prompts = [vec![3u32, 17, 42], vec![9, 8]];
    let want = engine
        .generate(
            &prompts
                .iter()
                .map(|p| GenRequest {
                    prompt_ids: p.clone(),
                    params: SamplingParams {
                        temperature: 1.0,
                        top_p: 0.9,
                        top_k: 40,
                        max_tokens: 6,
                        stop_token_ids: vec![],
                        seed: Some(1234),
                    },
                })
                .collect::<Vec<_>>(),
        )
        .unwrap();
    for (c, w) in v["choices"].as_array().unwrap().iter().zip(&want) {
        assert_eq!(c["token_ids"], json!(w.token_ids));
        let lps: Vec<f64> = c["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        for (a, b) in lps.iter().zip(&w.logprobs) {
            assert!((a - *b as f64).abs() < 1e-5, "{a} vs {b}");
            assert!(*a <= 0.0);
        }
        assert_eq!(c["finish_reason"], "length");
    }
    // Reloading the same checkpoint bumps the engine's version.
    let body = json!({"method": "reload_weights", "kwargs": {"weights_path": dir.canonicalize().unwrap()}});
    assert_eq!(s.post("/collective_rpc", body).await, (200, json!({"results": [null]})));
    assert_eq!(engine.weight_version(), 1);
    assert_eq!(s.get("/weight_info").await.1, json!({"weight_version": "1"}));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tokenizer_gives_text_tokens_and_string_prompts() {
    let tok_path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/assets/qwen3-tokenizer/tokenizer.json");
    let tok = Arc::new(tokenizers::Tokenizer::from_file(&tok_path).unwrap());
    let mut cfg = mock_config();
    cfg.tokenizer = Some(tok.clone());
    let engine = Arc::new(MockEngine::default());
    let s = Server::start(engine, cfg).await;
    // "a" and "!" are single byte-level tokens (ids 64 and 0) in Qwen3's vocabulary.
    let (status, v) = s
        .post(
            "/v1/completions",
            json!({"prompt": "a!", "max_tokens": 3, "logprobs": 2, "return_token_ids": true}),
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let c = &v["choices"][0];
    assert_eq!(c["prompt_token_ids"], json!([64, 0]));
    let ids: Vec<u32> = vec![64, 71, 78];
    assert_eq!(c["token_ids"], json!(ids));
    assert_eq!(c["text"], tok.decode(&ids, true).unwrap());
    let toks: Vec<String> = ids.iter().map(|&t| tok.decode(&[t], false).unwrap()).collect();
    assert_eq!(c["logprobs"]["tokens"], json!(toks));
    assert_eq!(c["logprobs"]["text_offset"], json!([0, 1, 2]));
    // logprobs=2 still lists only the sampled token (the engine reports no alternatives).
    assert_eq!(c["logprobs"]["top_logprobs"][0].as_object().unwrap().len(), 1);
    // return_tokens_as_token_ids spells tokens as ids even with a tokenizer.
    let (_, v) = s
        .post(
            "/v1/completions",
            json!({"prompt": ["a", "!"], "max_tokens": 1, "logprobs": 0,
                                        "return_tokens_as_token_ids": true}),
        )
        .await;
    assert_eq!(v["choices"][0]["logprobs"]["tokens"], json!(["token_id:64"]));
    assert_eq!(v["choices"][1]["logprobs"]["tokens"], json!(["token_id:0"]));
    // A text whose tokens fall outside the model's vocabulary is a 400, not a crash.
    let (status, v) = s.post("/v1/completions", json!({"prompt": "hello world"})).await;
    assert_eq!(status, 400);
    assert!(v["error"]["message"].as_str().unwrap().contains("out of vocabulary"));
}
