//! vime's vLLM client against what a real vLLM 0.26.0 answered (captured on an H200 by
//! `scripts/gpu/vllm_sync.sh` into `tests/fixtures/vllm-0.26/responses.jsonl`: every endpoint vime
//! calls, status and body as sent). A replay server answers each (method, path) with the recorded
//! answers in order, so the client's parsing is checked against vLLM's real shapes, including the
//! routes 0.26 lacks (`/weight_info`, `/update_weight_version`: 404 `{"detail": "Not Found"}`).
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use vime_rollout::engine::{FinishReason, GenRequest, RolloutEngine, SamplingParams};
use vime_rollout::vllm::{parse_completion, PauseMode, VllmClient, VllmClientConfig};

type Answers = Arc<Mutex<HashMap<String, Vec<(u16, Value)>>>>;

fn recorded() -> Vec<Value> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/vllm-0.26/responses.jsonl");
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

async fn replay(State(a): State<Answers>, method: Method, uri: Uri, _body: Bytes) -> Response {
    let key = format!("{method} {}", uri.path_and_query().unwrap().as_str());
    let mut a = a.lock().unwrap();
    // The exact query if it was recorded, else the same route with another query (vLLM's
    // answer does not depend on it for these calls).
    let key = if a.contains_key(&key) {
        key
    } else {
        let route = format!("{method} {}", uri.path());
        a.keys()
            .find(|k| k.split('?').next() == Some(route.as_str()))
            .cloned()
            .unwrap_or(key)
    };
    let Some(list) = a.get_mut(&key) else {
        return (
            StatusCode::NOT_FOUND,
            axum::Json(serde_json::json!({"detail": "Not Found"})),
        )
            .into_response();
    };
    let (status, body) = if list.len() > 1 {
        list.remove(0)
    } else {
        list[0].clone()
    };
    let status = StatusCode::from_u16(status).unwrap();
    match body {
        Value::Null => status.into_response(),
        b => (status, axum::Json(b)).into_response(),
    }
}

fn start() -> (tokio::runtime::Runtime, VllmClient) {
    let mut answers: HashMap<String, Vec<(u16, Value)>> = HashMap::new();
    for r in recorded() {
        let key = format!("{} {}", r["method"].as_str().unwrap(), r["path"].as_str().unwrap());
        answers
            .entry(key)
            .or_default()
            .push((r["status"].as_u64().unwrap() as u16, r["response"].clone()));
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let url = rt.block_on(async {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", l.local_addr().unwrap());
        let app = axum::Router::new()
            .fallback(replay)
            .with_state(Arc::new(Mutex::new(answers)));
        tokio::spawn(async move { axum::serve(l, app).await.unwrap() });
        url
    });
    let client = VllmClient::connect(VllmClientConfig {
        engine_urls: vec![url],
        max_retries: 0,
        ..Default::default()
    })
    .unwrap();
    (rt, client)
}

#[test]
fn the_completion_vllm_sent_parses_to_ids_and_logprobs() {
    let r = recorded();
    let c = r.iter().find(|x| x["path"] == "/v1/completions").unwrap();
    let out = parse_completion(&c["response"].to_string(), 3).unwrap();
    let choice = &c["response"]["choices"][0];
    let ids: Vec<u32> = choice["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(out.token_ids, ids);
    assert_eq!(out.token_ids.len(), 4);
    let lps: Vec<f32> = choice["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect();
    assert_eq!(out.logprobs, lps);
    assert_eq!(out.finish_reason, FinishReason::Length);
    // The prompt length vLLM echoes is checked.
    assert!(parse_completion(&c["response"].to_string(), 5).is_err());
}

#[test]
fn the_client_drives_vllm_026_answers() {
    let (_rt, client) = start();
    client.wait_healthy(std::time::Duration::from_secs(5)).unwrap();
    // `/version` picks the protocol: vLLM 0.26 gets the worker extension for IPC and NCCL.
    let versions = client.engine_versions().unwrap();
    assert_eq!(versions, vec![Some("0.26.0".to_string())]);
    for t in ["ipc", "nccl"] {
        assert_eq!(
            vime_sync::protocol::choose_protocol(&versions, t).unwrap(),
            vime_sync::Protocol::WorkerExtension
        );
    }
    let out = client
        .generate(&[GenRequest {
            prompt_ids: vec![9707, 11, 1879],
            params: SamplingParams {
                temperature: 0.0,
                max_tokens: 4,
                ..Default::default()
            },
        }])
        .unwrap();
    assert_eq!(out[0].token_ids.len(), 4);
    assert_eq!(client.is_paused().unwrap(), vec![false]);
    client.pause(PauseMode::Keep).unwrap();
    client.resume().unwrap();
    client.reset_prefix_cache().unwrap();
    client.sleep(1).unwrap();
    client.wake_up(&["weights"]).unwrap();
    client.wake_up(&["kv_cache"]).unwrap();
    let rpc = client
        .collective_rpc("vime_weight_info", &["{}".to_string()], &Default::default())
        .unwrap();
    assert_eq!(rpc, vec![serde_json::json!([{"weight_version": null}])]);
}
