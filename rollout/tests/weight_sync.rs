//! A streamed weight sync end to end on the CPU: vime's sender (`vime_sync::WeightSender`, CPU
//! broadcast transport, 4 KiB buckets) drives a real vime-serve (the built-in engine on
//! `tests/fixtures/hf/tied_gqa`, bf16) through a recording proxy that can also fail or hang a call.
//!
//! Checked: the exact call sequence and bodies of both protocols (native routes, worker extension
//! over `/collective_rpc`), the engine's weights after the sync bit for bit against the sent ones
//! (per-tensor checksums and greedy generation equal to an engine built from the sent tensors),
//! that a second sync reuses the transport, that an engine error and a hung engine end the sync
//! within the deadline with an error naming the engine URL and the bucket, that the next sync
//! recovers, and that a tensor the engine does not have is refused by name.
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use vime_dist::layout::{LayoutEntry, LayoutTable};
use vime_qwen3::model::Qwen3;
use vime_qwen3::state_dict::param_specs;
use vime_rollout::engine::embedded::{EmbeddedEngine, EngineOptions};
use vime_rollout::engine::{GenRequest, RolloutEngine, SamplingParams};
use vime_rollout::serve::{self, ServeConfig};
use vime_rollout::vllm::{VllmClient, VllmClientConfig};
use vime_sync::pack::checksum;
use vime_sync::protocol::{EXT_FINISH, EXT_INFO, EXT_INIT, EXT_START, EXT_UPDATE, RPC_CHECKSUMS};
use vime_sync::sender::BroadcastTransport;
use vime_sync::{BucketRule, Protocol, SyncOptions, SyncPlan, Transport, WeightSender};

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf/tied_gqa")
}

#[derive(Clone, Debug, PartialEq)]
enum Fault {
    None,
    /// Answer the k-th `/update_weights` (0-based, counted over the whole test) with a 500.
    FailUpdate(usize),
    /// Never answer calls whose path starts with this.
    Hang(&'static str),
    /// Answer calls whose path starts with this as vLLM 0.26 answers a route it lacks (captured
    /// from the real server by scripts/gpu/vllm_sync.sh: 404 `{"detail": "Not Found"}`).
    NotFound(&'static str),
}

#[derive(Clone)]
struct Proxy {
    backend: String,
    http: reqwest::Client,
    log: Arc<Mutex<Vec<(String, String, Value)>>>,
    fault: Arc<Mutex<Fault>>,
    updates: Arc<Mutex<usize>>,
}

fn is_update(path: &str, body: &Value) -> bool {
    path == "/update_weights" || body.get("method").and_then(Value::as_str) == Some(EXT_UPDATE)
}

async fn forward(State(p): State<Proxy>, method: Method, uri: Uri, body: Bytes) -> Response {
    let pq = uri.path_and_query().map(|x| x.as_str().to_string()).unwrap_or_default();
    let v: Value = serde_json::from_slice(&body).unwrap_or(Value::Null);
    p.log.lock().unwrap().push((method.to_string(), pq.clone(), v.clone()));
    let fault = p.fault.lock().unwrap().clone();
    if is_update(uri.path(), &v) {
        let k = {
            let mut u = p.updates.lock().unwrap();
            *u += 1;
            *u - 1
        };
        if fault == Fault::FailUpdate(k) {
            return (
                StatusCode::INTERNAL_SERVER_ERROR,
                "injected failure: CUDA out of memory",
            )
                .into_response();
        }
    }
    if let Fault::Hang(prefix) = fault {
        if pq.starts_with(prefix) {
            std::future::pending::<()>().await;
        }
    }
    if let Fault::NotFound(prefix) = fault {
        if pq.starts_with(prefix) {
            return (StatusCode::NOT_FOUND, axum::Json(json!({"detail": "Not Found"}))).into_response();
        }
    }
    let r = p
        .http
        .request(method, format!("{}{pq}", p.backend))
        .header("content-type", "application/json")
        .body(body.to_vec())
        .send()
        .await
        .unwrap();
    let status = StatusCode::from_u16(r.status().as_u16()).unwrap();
    (status, r.bytes().await.unwrap()).into_response()
}

struct Setup {
    _rt: tokio::runtime::Runtime,
    proxy: Proxy,
    url: String,
    client: VllmClient,
    engine: Arc<EmbeddedEngine>,
}

fn setup() -> Setup {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = fixture_dir();
    let engine = Arc::new(EmbeddedEngine::load_hf(&dir, DType::BF16, &Device::Cpu).unwrap());
    let mut cfg = ServeConfig::from_hf_dir(&dir, None).unwrap();
    cfg.dev_mode = true;
    cfg.weight_transfer = Some(vime_sync::RecvKind::Cpu);
    cfg.weight_transfer_timeout = Duration::from_secs(20);
    let (backend, url, proxy) = rt.block_on(async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let backend = format!("http://{}", l.local_addr().unwrap());
        let e: Arc<dyn RolloutEngine> = engine.clone();
        tokio::spawn(serve::serve(l, e, cfg, std::future::pending()));
        let proxy = Proxy {
            backend: backend.clone(),
            http: reqwest::Client::new(),
            log: Arc::default(),
            fault: Arc::new(Mutex::new(Fault::None)),
            updates: Arc::default(),
        };
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let app = axum::Router::new().fallback(forward).with_state(proxy.clone());
        tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
        (backend, url, proxy)
    });
    let _ = backend;
    let client = VllmClient::connect(VllmClientConfig {
        engine_urls: vec![url.clone()],
        max_retries: 0,
        ..Default::default()
    })
    .unwrap();
    Setup {
        _rt: rt,
        proxy,
        url,
        client,
        engine,
    }
}

fn plan(rename: Option<(&str, &str)>) -> SyncPlan {
    let cfg = vime_qwen3::checkpoint::load_config(&fixture_dir()).unwrap();
    let entries = param_specs(&cfg)
        .into_iter()
        .map(|s| {
            let name = match rename {
                Some((from, to)) if s.name == from => to.to_string(),
                _ => s.name,
            };
            LayoutEntry::new(name, &s.shape, DType::BF16, false, s.placement)
        })
        .collect();
    let table = LayoutTable::new(entries, 0, 1).unwrap();
    SyncPlan::new(&table, DType::BF16, 4096, BucketRule::CloseBefore).unwrap()
}

/// The fixture's weights, changed by `seed` (`w * (1 + seed / 8) + seed / 100`), in bf16.
fn new_weights(seed: u32) -> BTreeMap<String, Tensor> {
    let cfg = vime_qwen3::checkpoint::load_config(&fixture_dir()).unwrap();
    vime_qwen3::checkpoint::load_hf_weights(&fixture_dir(), &cfg, DType::F32, &Device::Cpu)
        .unwrap()
        .into_iter()
        .map(|(n, t)| {
            let t = t
                .affine(1.0 + seed as f64 / 8.0, seed as f64 / 100.0)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap();
            (n, t)
        })
        .collect()
}

fn sender(protocol: Protocol, plan: SyncPlan, deadline: Duration) -> WeightSender {
    let make = Box::new(|| -> anyhow::Result<Box<dyn Transport>> {
        Ok(Box::new(BroadcastTransport::new("127.0.0.1", &Device::Cpu)?))
    });
    WeightSender::new(
        plan,
        make,
        SyncOptions {
            protocol,
            deadline,
            ..SyncOptions::default()
        },
    )
}

fn source(w: &BTreeMap<String, Tensor>) -> impl Fn(&str) -> anyhow::Result<Tensor> + '_ {
    move |n: &str| w.get(n).cloned().ok_or_else(|| anyhow::anyhow!("no tensor {n}"))
}

fn take_log(s: &Setup) -> Vec<(String, String, Value)> {
    std::mem::take(&mut *s.proxy.log.lock().unwrap())
}

/// Method + path, with the `/collective_rpc` method name appended.
fn call_names(log: &[(String, String, Value)]) -> Vec<String> {
    log.iter()
        .map(|(m, p, b)| match b.get("method").and_then(Value::as_str) {
            Some(rpc) if p == "/collective_rpc" => format!("{m} {p} {rpc}"),
            _ => format!("{m} {p}"),
        })
        .collect()
}

fn assert_engine_holds(s: &Setup, w: &BTreeMap<String, Tensor>) {
    let got = s.engine.weight_checksums().unwrap();
    assert_eq!(got.len(), w.len());
    for (n, t) in w {
        assert_eq!(got[n], checksum(t).unwrap(), "tensor {n} differs after the sync");
    }
    // The same checksums over HTTP (what the GPU benchmark compares).
    let rpc = s
        .client
        .collective_rpc(RPC_CHECKSUMS, &["{}".to_string()], &Default::default())
        .unwrap();
    let first = &rpc[0][0];
    for (n, t) in w {
        assert_eq!(first[n], json!(format!("{:016x}", checksum(t).unwrap())), "{n}");
    }
    // Greedy generation through vime-serve equals an engine built from the sent tensors.
    let cfg = vime_qwen3::checkpoint::load_config(&fixture_dir()).unwrap();
    let reference = EmbeddedEngine::new(
        Qwen3::from_tensors(cfg.clone(), w.clone()).unwrap(),
        EngineOptions::for_config(&cfg),
    )
    .unwrap();
    let req = vec![GenRequest {
        prompt_ids: vec![3, 14, 15, 92, 65],
        params: SamplingParams {
            temperature: 0.0,
            max_tokens: 6,
            ..Default::default()
        },
    }];
    let a = s.client.generate(&req).unwrap();
    let b = reference.generate(&req).unwrap();
    assert_eq!(a[0].token_ids, b[0].token_ids);
    for (x, y) in a[0].logprobs.iter().zip(&b[0].logprobs) {
        assert!((x - y).abs() < 1e-5, "{:?} vs {:?}", a[0].logprobs, b[0].logprobs);
    }
}

#[test]
fn native_protocol_streams_every_tensor_bit_exact() {
    let s = setup();
    // vime-serve has no `/version`: the auto choice is the native protocol.
    assert_eq!(s.client.engine_versions().unwrap(), vec![None]);
    take_log(&s);
    let p = plan(None);
    let nb = p.buckets.len();
    assert!(nb >= 4, "the 4 KiB buckets split the fixture into {nb}");
    let names_in_plan: Vec<String> = p
        .buckets
        .iter()
        .flat_map(|b| b.tensors.iter().map(|t| t.name.clone()))
        .collect();
    let mut tx = sender(Protocol::Native, p, Duration::from_secs(20));

    let w1 = new_weights(1);
    let rep = tx.sync(&s.client, &source(&w1), 3).unwrap();
    assert_eq!((rep.buckets, rep.tensors), (nb, w1.len()));
    assert!(rep.engine_load_s > 0.0, "vime-serve reports its load time: {rep:?}");
    assert_eq!(rep.bytes, w1.values().map(|t| t.elem_count() * 2).sum::<usize>());
    let log = take_log(&s);
    let mut expect = vec![
        "POST /pause?mode=keep&clear_cache=false".to_string(),
        "POST /init_weight_transfer_engine".into(),
        "POST /start_weight_update".into(),
    ];
    expect.extend((0..nb).map(|_| "POST /update_weights".to_string()));
    expect.extend(
        [
            "POST /finish_weight_update",
            "POST /reset_prefix_cache",
            "POST /resume",
            "GET /weight_info",
        ]
        .map(String::from),
    );
    assert_eq!(call_names(&log), expect);
    // init_info: CPU rendezvous, no `backend` key in the native dialect.
    let init = &log[1].2["init_info"];
    assert_eq!(init["rank_offset"], json!(1));
    assert_eq!(init["world_size"], json!(2));
    assert_eq!(init["master_address"], json!("127.0.0.1"));
    assert!(init.get("backend").is_none(), "{init}");
    // update_info: every name once, in plan order, bf16, shapes; no packing keys (vLLM 0.33 puts
    // them in init_info).
    let mut sent = Vec::new();
    for (_, _, b) in &log[3..3 + nb] {
        let u = &b["update_info"];
        assert!(u.get("packed").is_none() && u.get("nbytes").is_none(), "{u}");
        for (i, n) in u["names"].as_array().unwrap().iter().enumerate() {
            let n = n.as_str().unwrap().to_string();
            assert_eq!(u["dtype_names"][i], json!("bfloat16"));
            assert_eq!(u["shapes"][i], json!(w1[&n].dims()));
            sent.push(n);
        }
    }
    assert_eq!(sent, names_in_plan);
    assert_eq!(log[3 + nb].2, json!({"weight_version": "3"}));
    assert_engine_holds(&s, &w1);

    // The second sync reuses the group: no init call.
    let w2 = new_weights(2);
    tx.sync(&s.client, &source(&w2), 4).unwrap();
    let log = take_log(&s);
    assert!(!call_names(&log)
        .iter()
        .any(|c| c.contains("init_weight_transfer_engine")));
    assert_engine_holds(&s, &w2);
}

#[test]
fn worker_extension_protocol_runs_over_collective_rpc() {
    let s = setup();
    let p = plan(None);
    let nb = p.buckets.len();
    let mut tx = sender(Protocol::WorkerExtension, p, Duration::from_secs(20));
    let w = new_weights(3);
    tx.sync(&s.client, &source(&w), 11).unwrap();
    let log = take_log(&s);
    let mut expect = vec![
        "POST /pause?mode=keep&clear_cache=false".to_string(),
        format!("POST /collective_rpc {EXT_INIT}"),
        format!("POST /collective_rpc {EXT_START}"),
    ];
    expect.extend((0..nb).map(|_| format!("POST /collective_rpc {EXT_UPDATE}")));
    expect.extend([
        format!("POST /collective_rpc {EXT_FINISH}"),
        "POST /reset_prefix_cache".into(),
        "POST /resume".into(),
        format!("POST /collective_rpc {EXT_INFO}"),
    ]);
    assert_eq!(call_names(&log), expect);
    // One JSON-string argument: the extension's contract (sync/python/vime_vllm_ext.py).
    let init: Value = serde_json::from_str(log[1].2["args"][0].as_str().unwrap()).unwrap();
    assert_eq!(init["backend"], json!("cpu"));
    let upd: Value = serde_json::from_str(log[3].2["args"][0].as_str().unwrap()).unwrap();
    assert_eq!(upd["packed"], json!(true));
    let nbytes: usize = upd["shapes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            s.as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .product::<usize>()
                * 2
        })
        .sum();
    assert_eq!(upd["nbytes"], json!(nbytes));
    assert_engine_holds(&s, &w);
}

#[test]
fn a_failing_engine_is_named_and_the_next_sync_recovers() {
    let s = setup();
    let mut tx = sender(Protocol::Native, plan(None), Duration::from_secs(20));
    *s.proxy.fault.lock().unwrap() = Fault::FailUpdate(1);
    let err = format!("{:#}", tx.sync(&s.client, &source(&new_weights(4)), 5).unwrap_err());
    assert!(err.contains(&s.url), "{err}");
    assert!(err.contains("bucket 1 of"), "{err}");
    assert!(err.contains("injected failure: CUDA out of memory"), "{err}");
    assert!(err.contains("HTTP 500"), "{err}");
    *s.proxy.fault.lock().unwrap() = Fault::None;
    take_log(&s);
    let w = new_weights(5);
    tx.sync(&s.client, &source(&w), 6).unwrap();
    // After a failure the sender starts again from init.
    assert!(call_names(&take_log(&s)).contains(&"POST /init_weight_transfer_engine".to_string()));
    assert_engine_holds(&s, &w);
}

#[test]
fn a_hung_engine_is_named_within_the_deadline() {
    let s = setup();
    let mut tx = sender(Protocol::Native, plan(None), Duration::from_secs(2));
    *s.proxy.fault.lock().unwrap() = Fault::Hang("/update_weights");
    let t = Instant::now();
    let err = format!("{:#}", tx.sync(&s.client, &source(&new_weights(6)), 7).unwrap_err());
    let dt = t.elapsed();
    assert!(dt < Duration::from_secs(15), "the sync took {dt:?}");
    assert!(
        dt >= Duration::from_secs(2),
        "the sync gave up after {dt:?}, before the deadline"
    );
    assert!(err.contains(&s.url), "{err}");
    assert!(err.contains("no answer within 2s"), "{err}");
    assert!(err.contains("bucket 0 of"), "{err}");
    *s.proxy.fault.lock().unwrap() = Fault::None;
    let w = new_weights(7);
    tx.sync(&s.client, &source(&w), 8).unwrap();
    assert_engine_holds(&s, &w);
}

#[test]
fn a_tensor_the_engine_lacks_is_refused_by_name() {
    let s = setup();
    let bogus = "model.layers.0.mlp.bogus_proj.weight";
    let mut tx = sender(
        Protocol::Native,
        plan(Some(("model.layers.0.mlp.up_proj.weight", bogus))),
        Duration::from_secs(20),
    );
    let mut w = new_weights(8);
    let t = w.remove("model.layers.0.mlp.up_proj.weight").unwrap();
    w.insert(bogus.to_string(), t);
    let before = s.engine.weight_checksums().unwrap();
    let err = format!("{:#}", tx.sync(&s.client, &source(&w), 9).unwrap_err());
    assert!(err.contains(bogus) && err.contains(&s.url), "{err}");
    // Nothing from the refused bucket on was written (the final norm is sent last).
    let after = s.engine.weight_checksums().unwrap();
    assert_eq!(before["model.norm.weight"], after["model.norm.weight"]);
    assert_ne!(before["model.embed_tokens.weight"], after["model.embed_tokens.weight"]);
}

/// vLLM 0.26 has no `/update_weight_version`: the disk reload still succeeds, the client keeps the
/// version itself and stops calling the route.
#[test]
fn a_disk_reload_survives_an_engine_without_the_version_route() {
    let s = setup();
    *s.proxy.fault.lock().unwrap() = Fault::NotFound("/update_weight_version");
    for v in 1..=2 {
        s.client.update_weights_from_dir(&fixture_dir()).unwrap();
        assert_eq!(s.client.weight_version(), v);
    }
    let calls = call_names(&take_log(&s));
    assert_eq!(
        calls.iter().filter(|c| c.contains("/update_weight_version")).count(),
        1,
        "{calls:?}"
    );
    assert_eq!(
        calls
            .iter()
            .filter(|c| c.contains("reload_weights") || c.ends_with("/collective_rpc"))
            .count(),
        2,
        "{calls:?}"
    );
}

/// The disk reload within a sync deadline (the trainer's `--update-weight-timeout`): an engine
/// that never answers the reload fails it after about the deadline, not the client's
/// `control_timeout` (1800 s here), naming the engine's URL and the deadline; the engines are
/// resumed, and the next reload succeeds.
#[test]
fn a_hung_engine_fails_a_disk_reload_within_the_sync_deadline() {
    let s = setup();
    *s.proxy.fault.lock().unwrap() = Fault::Hang("/collective_rpc");
    let t = Instant::now();
    let err = format!(
        "{:#}",
        s.client
            .update_weights_from_dir_within(&fixture_dir(), Duration::from_secs(2))
            .unwrap_err()
    );
    let dt = t.elapsed();
    assert!(dt < Duration::from_secs(15), "the reload took {dt:?}");
    assert!(
        dt >= Duration::from_secs(2),
        "the reload gave up after {dt:?}, before the deadline"
    );
    assert!(err.contains(&s.url), "{err}");
    assert!(err.contains("no answer within 2s"), "{err}");
    assert!(err.contains("/collective_rpc"), "{err}");
    assert_eq!(s.client.is_paused().unwrap(), vec![false]);
    *s.proxy.fault.lock().unwrap() = Fault::None;
    let v = s.client.weight_version();
    s.client
        .update_weights_from_dir_within(&fixture_dir(), Duration::from_secs(20))
        .unwrap();
    assert_eq!(s.client.weight_version(), v + 1);
}
