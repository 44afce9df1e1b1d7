//! vime-serve's security defaults: the development endpoints are refused (404 saying how to turn
//! them on) unless dev mode is on, by `--dev-mode` or vLLM's `VLLM_SERVER_DEV_MODE=1`;
//! `reload_weights` reads only folders under the allowed root, whatever `..` or a symlink says;
//! dev mode on a non-loopback address prints a warning at start-up.
//!
//! In process over HTTP (the built-in engine on `tests/fixtures/hf/tied_gqa`), then the binary
//! itself for its flags, environment and start-up lines.
use serde_json::{json, Value};
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use vime_rollout::engine::embedded::EmbeddedEngine;
use vime_rollout::engine::RolloutEngine;
use vime_rollout::serve::{self, ServeConfig, ROUTES};
use vime_rollout::vllm::{is_loopback_host, pick_free_port};

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/hf/tied_gqa")
        .canonicalize()
        .unwrap()
}

/// A copy of the fixture checkpoint (config.json + model.safetensors) in `dir`.
fn copy_checkpoint(dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(fixture_dir().join(f), dir.join(f)).unwrap();
    }
    dir.to_path_buf()
}

struct Server {
    base: String,
    http: reqwest::Client,
    engine: Arc<EmbeddedEngine>,
}

impl Server {
    async fn start(cfg: ServeConfig) -> Self {
        let engine = Arc::new(
            EmbeddedEngine::load_hf(&fixture_dir(), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap(),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let e: Arc<dyn RolloutEngine> = engine.clone();
        tokio::spawn(serve::serve(listener, e, cfg, std::future::pending()));
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()
            .unwrap();
        Self { base, http, engine }
    }
    async fn call(&self, method: &str, path: &str, body: Value) -> (u16, Value) {
        let url = format!("{}{path}", self.base);
        let req = match method {
            "GET" => self.http.get(url),
            _ => self.http.post(url).json(&body),
        };
        let r = req.send().await.unwrap();
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or(Value::Null))
    }
    async fn reload(&self, path: impl AsRef<Path>) -> (u16, String) {
        let body = json!({"method": "reload_weights", "args": [], "kwargs": {"weights_path": path.as_ref()}});
        let (status, v) = self.call("POST", "/collective_rpc", body).await;
        (status, v["error"]["message"].as_str().unwrap_or("").to_string())
    }
}

fn config(dev_mode: bool, root: Option<PathBuf>) -> ServeConfig {
    let mut cfg = ServeConfig::from_hf_dir(&fixture_dir(), Some("tied".into())).unwrap();
    cfg.dev_mode = dev_mode;
    cfg.allowed_weights_root = root;
    cfg
}

/// A valid request to each dev route (the weight-transfer ones fail past parsing: no
/// `--weight-transfer-config`).
fn dev_request(path: &str, ckpt: &Path) -> Value {
    match path {
        "/collective_rpc" => json!({"method": "reload_weights", "kwargs": {"weights_path": ckpt}}),
        "/update_weight_version" => json!({"new_version": "v1"}),
        "/init_weight_transfer_engine" => json!({"init_info": {}}),
        "/update_weights" => json!({"update_info": {}}),
        _ => json!({}),
    }
}

#[test]
fn the_dev_routes_are_vllms_dev_routes() {
    // vLLM 0.26 mounts everything but these only with VLLM_SERVER_DEV_MODE=1
    // (entrypoints/openai/api_server.py:237); 0.33's RL routes (weight_info,
    // update_weight_version) are behind the same switch.
    let public: Vec<&str> = ROUTES.iter().filter(|r| !r.dev).map(|r| r.path).collect();
    assert_eq!(public, ["/health", "/v1/models", "/v1/completions"]);
    for p in [
        "/collective_rpc",
        "/pause",
        "/sleep",
        "/update_weights",
        "/is_paused",
        "/weight_info",
    ] {
        assert!(ROUTES.iter().any(|r| r.path == p && r.dev), "{p}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_endpoints_are_refused_without_dev_mode() {
    let s = Server::start(config(false, Some(fixture_dir().parent().unwrap().to_path_buf()))).await;
    for r in ROUTES.iter().filter(|r| r.dev) {
        // Either method: the route is off, not merely the wrong method.
        for method in ["GET", "POST"] {
            let (status, v) = s.call(method, r.path, dev_request(r.path, &fixture_dir())).await;
            assert_eq!(status, 404, "{method} {}: {v}", r.path);
            assert_eq!(v["error"]["type"], "NotFoundError", "{v}");
            assert_eq!(v["error"]["code"], 404, "{v}");
            let msg = v["error"]["message"].as_str().unwrap();
            assert!(msg.contains(r.path), "{msg}");
            assert!(
                msg.contains("--dev-mode") && msg.contains("VLLM_SERVER_DEV_MODE=1"),
                "the refusal says how to turn it on: {msg}"
            );
        }
    }
    assert_eq!(s.engine.weight_version(), 0, "nothing was reloaded");
    // The public routes still work.
    assert_eq!(s.call("GET", "/health", Value::Null).await.0, 200);
    assert_eq!(s.call("GET", "/v1/models", Value::Null).await.0, 200);
    let (status, v) = s
        .call("POST", "/v1/completions", json!({"prompt": [1, 2], "max_tokens": 2}))
        .await;
    assert_eq!(status, 200, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_endpoints_are_served_with_dev_mode() {
    let s = Server::start(config(true, Some(fixture_dir().parent().unwrap().to_path_buf()))).await;
    for r in ROUTES.iter().filter(|r| r.dev) {
        let (status, v) = s.call(r.method, r.path, dev_request(r.path, &fixture_dir())).await;
        assert_ne!(status, 404, "{} {}: {v}", r.method, r.path);
        match r.path {
            "/init_weight_transfer_engine" | "/start_weight_update" | "/update_weights" | "/finish_weight_update" => {
                // Served, and refused for want of --weight-transfer-config, as vLLM refuses it.
                assert!(
                    v["error"]["message"]
                        .as_str()
                        .unwrap()
                        .contains("--weight-transfer-config"),
                    "{v}"
                );
            }
            _ => assert_eq!(status, 200, "{} {}: {v}", r.method, r.path),
        }
    }
    assert_eq!(s.engine.weight_version(), 1, "the reload ran");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_weights_outside_the_allowed_root_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().canonicalize().unwrap();
    let root = base.join("root");
    let inside = copy_checkpoint(&root.join("step-1"));
    let outside = copy_checkpoint(&base.join("elsewhere"));
    std::os::unix::fs::symlink(&outside, root.join("link-out")).unwrap();
    std::os::unix::fs::symlink(&inside, root.join("link-in")).unwrap();
    let s = Server::start(config(true, Some(root.clone()))).await;
    let root_s = root.display().to_string();

    // Inside: the folder itself, through `..` that stays inside, through a symlink inside.
    assert_eq!(s.reload(&inside).await, (200, String::new()));
    assert_eq!(s.reload(root.join("step-1/../step-1")).await.0, 200);
    assert_eq!(s.reload(root.join("link-in")).await.0, 200);
    assert_eq!(s.engine.weight_version(), 3);

    // A folder outside the root.
    let (status, msg) = s.reload(&outside).await;
    assert_eq!(status, 403, "{msg}");
    assert!(
        msg.contains(&outside.display().to_string()) && msg.contains(&root_s),
        "{msg}"
    );
    assert!(msg.contains("--allowed-weights-root"), "{msg}");
    // `..` out of the root.
    let (status, msg) = s.reload(root.join("step-1/../../elsewhere")).await;
    assert_eq!(status, 403, "{msg}");
    assert!(
        msg.contains("resolves to") && msg.contains(&outside.display().to_string()),
        "{msg}"
    );
    // A symlink in the root that points out of it.
    let (status, msg) = s.reload(root.join("link-out")).await;
    assert_eq!(status, 403, "{msg}");
    assert!(msg.contains("link-out") && msg.contains(&root_s), "{msg}");
    // A prefix of the root's name is not the root.
    let (status, msg) = s.reload(format!("{root_s}-sibling")).await;
    assert_eq!(status, 403, "{msg}");
    // A missing path: outside is refused as outside (whether it exists is not told); inside it
    // is not a directory.
    let (status, msg) = s.reload(base.join("missing/../../etc")).await;
    assert_eq!(status, 403, "{msg}");
    let (status, msg) = s.reload(root.join("missing")).await;
    assert_eq!(status, 400, "{msg}");
    assert!(msg.contains("not a directory"), "{msg}");
    // A relative path resolves against the server's working directory (outside the root here).
    assert_eq!(s.reload("../..").await.0, 403);
    assert_eq!(s.engine.weight_version(), 3, "no refused folder was loaded");

    // No root: every reload is refused, naming the flag.
    let s = Server::start(config(true, None)).await;
    let (status, msg) = s.reload(&inside).await;
    assert_eq!(status, 403, "{msg}");
    assert!(msg.contains("--allowed-weights-root"), "{msg}");
    assert_eq!(s.engine.weight_version(), 0);
}

#[test]
fn the_default_root_is_the_folder_holding_the_checkpoint() {
    let fixture = fixture_dir();
    assert_eq!(
        serve::default_weights_root(&fixture),
        Some(fixture.parent().unwrap().to_path_buf())
    );
    assert_eq!(
        ServeConfig::from_hf_dir(&fixture, None).unwrap().allowed_weights_root,
        Some(fixture.parent().unwrap().to_path_buf())
    );
    assert!(
        !ServeConfig::from_hf_dir(&fixture, None).unwrap().dev_mode,
        "dev mode is off by default"
    );
    // A checkpoint right under `/` is its own root, never `/`.
    let top = Path::new("/tmp").canonicalize().unwrap();
    if top.parent() == Some(Path::new("/")) {
        assert_eq!(serve::default_weights_root(&top), Some(top.clone()));
    }
    assert_eq!(serve::default_weights_root(Path::new("/no/such/checkpoint")), None);
}

#[test]
fn loopback_hosts() {
    for h in ["127.0.0.1", "127.0.0.2", "localhost", "::1", "[::1]"] {
        assert!(is_loopback_host(h), "{h}");
    }
    for h in ["0.0.0.0", "::", "10.0.0.1", "example.com", ""] {
        assert!(!is_loopback_host(h), "{h}");
    }
}

// ---- the binary ------------------------------------------------------------------------------

/// A `vime-serve` child; SIGKILLed on drop. Its stderr lines arrive on `lines`.
struct Proc {
    child: Child,
    url: String,
    lines: std::sync::mpsc::Receiver<String>,
    seen: Vec<String>,
}

impl Proc {
    fn spawn(args: &[&str], env: &[(&str, &str)]) -> (Child, std::sync::mpsc::Receiver<String>, u16) {
        let port = pick_free_port().unwrap();
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_vime-serve"));
        cmd.arg(fixture_dir())
            .args(["--port", &port.to_string()])
            .args(args)
            .env_remove("VLLM_SERVER_DEV_MODE")
            .env_remove("VIME_ALLOWED_WEIGHTS_ROOT")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        let err = child.stderr.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for l in std::io::BufReader::new(err).lines() {
                let Ok(l) = l else { break };
                if tx.send(l).is_err() {
                    break;
                }
            }
        });
        (child, rx, port)
    }

    /// Starts one and reads stderr up to its security notes (printed before it serves).
    fn start(args: &[&str], env: &[(&str, &str)]) -> Self {
        let (child, lines, port) = Self::spawn(args, env);
        let mut p = Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
            lines,
            seen: Vec::new(),
        };
        p.read_until("development endpoints");
        // Anything else the notes print comes right after that line.
        while let Ok(l) = p.lines.recv_timeout(Duration::from_millis(300)) {
            p.seen.push(l);
        }
        p
    }

    fn read_until(&mut self, needle: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !self.seen.iter().any(|l| l.contains(needle)) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) => self.seen.push(l),
                Err(_) => panic!(
                    "vime-serve printed no {needle:?} line; stderr:\n{}",
                    self.seen.join("\n")
                ),
            }
        }
    }

    fn stderr(&self) -> String {
        self.seen.join("\n")
    }

    fn call(&self, method: &str, path: &str, body: &str) -> (u16, String) {
        use std::io::{Read, Write};
        let host = self.url.trim_start_matches("http://");
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut s = loop {
            match std::net::TcpStream::connect(host) {
                Ok(s) => break s,
                Err(e) if Instant::now() > deadline => panic!("connecting to {host}: {e}"),
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        };
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut buf = String::new();
        s.read_to_string(&mut buf).unwrap();
        let status = buf.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
        (
            status,
            buf.split_once("\r\n\r\n")
                .map(|(_, b)| b.to_string())
                .unwrap_or_default(),
        )
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn vime_serve_warns_when_dev_mode_listens_beyond_loopback() {
    let p = Proc::start(&["--host", "0.0.0.0", "--dev-mode"], &[]);
    let err = p.stderr();
    assert!(err.contains("development endpoints are enabled on 0.0.0.0:"), "{err}");
    assert!(
        err.contains("SECURITY WARNING") && err.contains("non-loopback"),
        "{err}"
    );
    assert!(
        err.contains("/collective_rpc"),
        "the warning names the endpoints: {err}"
    );
    assert_eq!(p.call("GET", "/is_paused", "").0, 200);
    drop(p);

    // Loopback and dev mode: the endpoints are listed, no warning.
    let p = Proc::start(&["--dev-mode"], &[]);
    let err = p.stderr();
    assert!(err.contains("development endpoints are enabled on 127.0.0.1:"), "{err}");
    assert!(!err.contains("SECURITY WARNING"), "{err}");
    drop(p);

    // 0.0.0.0 without dev mode: nothing to warn about.
    let p = Proc::start(&["--host", "0.0.0.0"], &[]);
    let err = p.stderr();
    assert!(
        err.contains("development endpoints (") && err.contains("are off"),
        "{err}"
    );
    assert!(!err.contains("SECURITY WARNING"), "{err}");
}

#[test]
fn vime_serve_reads_vllms_dev_mode_variable() {
    let p = Proc::start(&[], &[("VLLM_SERVER_DEV_MODE", "1")]);
    assert_eq!(p.call("GET", "/is_paused", "").0, 200, "{}", p.stderr());
    drop(p);
    let p = Proc::start(&[], &[("VLLM_SERVER_DEV_MODE", "0")]);
    let (status, body) = p.call("POST", "/pause", "");
    assert_eq!(status, 404, "{body}");
    assert!(body.contains("--dev-mode"), "{body}");
    assert_eq!(
        p.call("POST", "/v1/completions", r#"{"prompt": [1], "max_tokens": 1}"#)
            .0,
        200
    );
    drop(p);
    // vLLM reads the variable with int(): anything else stops it, and vime-serve.
    let (mut child, lines, _) = Proc::spawn(&[], &[("VLLM_SERVER_DEV_MODE", "yes")]);
    let status = child.wait().unwrap();
    let err: Vec<String> = lines.iter().collect();
    assert!(!status.success());
    assert!(
        err.join("\n").contains("VLLM_SERVER_DEV_MODE must be an integer"),
        "{err:?}"
    );
}

#[test]
fn vime_serve_allowed_weights_root_flag_and_variable() {
    let tmp = tempfile::tempdir().unwrap();
    let base = tmp.path().canonicalize().unwrap();
    let root = base.join("root");
    let inside = copy_checkpoint(&root.join("step-1"));
    let outside = copy_checkpoint(&base.join("elsewhere"));
    let reload = |p: &Proc, dir: &Path| {
        p.call(
            "POST",
            "/collective_rpc",
            &json!({"method": "reload_weights", "kwargs": {"weights_path": dir}}).to_string(),
        )
    };
    let flag = root.display().to_string();
    let p = Proc::start(&["--dev-mode", "--allowed-weights-root", &flag], &[]);
    assert!(
        p.stderr().contains(&format!("reads folders under {flag} only")),
        "{}",
        p.stderr()
    );
    assert_eq!(reload(&p, &inside).0, 200);
    let (status, body) = reload(&p, &outside);
    assert_eq!(status, 403, "{body}");
    assert!(body.contains(&flag), "{body}");
    drop(p);
    // The launcher's variable; the flag wins over it.
    let p = Proc::start(&["--dev-mode"], &[("VIME_ALLOWED_WEIGHTS_ROOT", &flag)]);
    assert_eq!(reload(&p, &inside).0, 200);
    assert_eq!(reload(&p, &outside).0, 403);
    drop(p);
    let other = base.display().to_string();
    let p = Proc::start(
        &["--dev-mode", "--allowed-weights-root", &other],
        &[("VIME_ALLOWED_WEIGHTS_ROOT", &flag)],
    );
    assert_eq!(reload(&p, &outside).0, 200);
    drop(p);
    // Without either, the folder holding the checkpoint (tests/fixtures/hf): a temp folder is out.
    let p = Proc::start(&["--dev-mode"], &[]);
    let (status, body) = reload(&p, &inside);
    assert_eq!(status, 403, "{body}");
    assert!(
        body.contains(&fixture_dir().parent().unwrap().display().to_string()),
        "{body}"
    );
    drop(p);
    // A root that does not exist stops start-up, naming it.
    let missing = base.join("missing").display().to_string();
    let (mut child, lines, _) = Proc::spawn(&["--allowed-weights-root", &missing], &[]);
    assert!(!child.wait().unwrap().success());
    let err = lines.iter().collect::<Vec<_>>().join("\n");
    assert!(
        err.contains(&missing) && err.contains("--allowed-weights-root"),
        "{err}"
    );
}

/// `--kv-cache-tokens` sizes the engine's KV cache on any device: the served `max_model_len`
/// comes down to the longest sequence it holds (a prompt past it is a 400, a completion stops at
/// it), requests that together outgrow it still complete (preempted and recomputed), and bad
/// sizes stop vime-serve with the flag named.
#[test]
fn vime_serve_kv_cache_tokens_flag() {
    // 6 pages of 16: one for padding, one spare, so one sequence holds at most 64 tokens.
    let p = Proc::start(&["--kv-cache-tokens", "96"], &[]);
    let err = p.stderr();
    assert!(err.contains("KV cache of 96 tokens"), "{err}");
    assert!(err.contains("max_model_len 512 -> 64"), "{err}");
    let (status, body) = p.call("GET", "/v1/models", "");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("\"max_model_len\":64"), "{body}");
    let prompt: Vec<u32> = (1..=70).collect();
    let (status, body) = p.call(
        "POST",
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 4}).to_string(),
    );
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("maximum context length (64)"), "{body}");
    // Four 20-token prompts of up to 44 new tokens: 4 x 64 tokens against a 96-token cache.
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| (1 + i..21 + i).collect()).collect();
    let (status, body) = p.call(
        "POST",
        "/v1/completions",
        &json!({"prompt": prompts, "max_tokens": 100, "temperature": 1.0, "seed": 3, "ignore_eos": true}).to_string(),
    );
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4, "{body}");
    for c in choices {
        assert_eq!(c["finish_reason"], "length", "{body}");
    }
    assert_eq!(v["usage"]["completion_tokens"], 4 * 44, "{body}");
    drop(p);
    for (args, want) in [
        (&["--kv-cache-tokens", "0"][..], "--kv-cache-tokens must be at least 1"),
        (
            &["--gpu-memory-utilization", "1.5"][..],
            "--gpu-memory-utilization must be in (0, 1]",
        ),
        (&["--decode-kernel", "fast"][..], "registers, pipelined or tensor-cores"),
    ] {
        let (mut child, lines, _) = Proc::spawn(args, &[]);
        let status = child.wait().unwrap();
        let err: Vec<String> = lines.iter().collect();
        assert!(!status.success(), "{args:?}");
        assert!(err.join("\n").contains(want), "{args:?}: {err:?}");
    }
}
