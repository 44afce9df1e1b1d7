//! The HTTP side of a weight sync: which calls an engine gets in each phase, per protocol, and the
//! [`EngineControl`] interface the sender drives them through (implemented by the vLLM client; the
//! tests drive a recording stand-in through the same client).
//!
//! Protocols (see `sync/PROTOCOLS.md` for the facts read from vLLM's source and the choice per
//! version):
//! - [`Protocol::Native`]: vLLM's weight-transfer routes, `POST /init_weight_transfer_engine
//!   {"init_info"}`, `/start_weight_update`, `/update_weights {"update_info"}`,
//!   `/finish_weight_update`, as vime-serve serves them. The bodies carry no pickles: the IPC
//!   handle is the raw 64-byte `CUipcMemHandle` in base64, NCCL rendezvous is vime's store.
//! - [`Protocol::WorkerExtension`]: a vLLM started with `--worker-extension-cls
//!   vime_vllm_ext.VimeWorkerExtension` (the Python file in `sync/python/`), driven through
//!   `POST /collective_rpc {"method", "args": [JSON string]}`: the same `init_info` / `update_info`
//!   objects, one JSON string argument, opened by the extension with ctypes. Works on vLLM
//!   versions whose native engines need torch pickles on the sender (0.24-0.26).
use anyhow::{bail, Result};
use serde_json::{json, Value};
use std::time::Duration;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    Native,
    WorkerExtension,
}

/// The protocol for engines reporting `versions` (`GET /version`: `Some("0.26.0")` for vLLM,
/// `None` for an engine without the route, which is vime-serve) and the `transport` (`ipc`,
/// `nccl`, `cpu`): vime-serve speaks the native routes; vLLM before 0.33 needs the worker
/// extension for both transports, 0.33 and later for IPC only (its IPC engine still wants torch
/// pickles, its NCCL engine takes `nccl_unique_id_b64`). Engines of different kinds are refused.
pub fn choose_protocol(versions: &[Option<String>], transport: &str) -> Result<Protocol> {
    let pick = |v: &Option<String>| -> Result<Protocol> {
        let Some(v) = v else {
            return Ok(Protocol::Native);
        };
        let mut parts = v.split(|c: char| !c.is_ascii_digit()).filter(|p| !p.is_empty());
        let major: u64 = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
        let minor: u64 = parts.next().and_then(|p| p.parse().ok()).unwrap_or(0);
        let native_nccl = (major, minor) >= (0, 33);
        Ok(if transport == "nccl" && native_nccl {
            Protocol::Native
        } else {
            Protocol::WorkerExtension
        })
    };
    let chosen = versions.iter().map(pick).collect::<Result<Vec<_>>>()?;
    match chosen.first() {
        None => bail!("no engines to choose a weight-sync protocol for"),
        Some(first) if chosen.iter().all(|c| c == first) => Ok(*first),
        _ => bail!(
            "the engines need different weight-sync protocols (versions {versions:?}); run one kind of engine, \
             or pick --update-weight-protocol yourself"
        ),
    }
}

impl std::str::FromStr for Protocol {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "native" => Ok(Protocol::Native),
            "worker-extension" => Ok(Protocol::WorkerExtension),
            _ => bail!("--update-weight-protocol must be auto, native or worker-extension, got {s:?}"),
        }
    }
}

/// The worker-extension methods (`VimeWorkerExtension` in `sync/python/vime_vllm_ext.py`).
pub const EXT_INIT: &str = "vime_init_weight_transfer";
pub const EXT_START: &str = "vime_start_weight_update";
pub const EXT_UPDATE: &str = "vime_update_weights";
pub const EXT_FINISH: &str = "vime_finish_weight_update";
pub const EXT_INFO: &str = "vime_weight_info";
/// vime-serve's `/collective_rpc` method for per-tensor checksums (the sync benchmark's check).
pub const RPC_CHECKSUMS: &str = "vime_weight_checksums";

/// One HTTP call.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub method: &'static str,
    /// Path with query string.
    pub path: String,
    pub body: Option<Value>,
}

impl Call {
    pub fn post(path: impl Into<String>, body: Option<Value>) -> Self {
        Self {
            method: "POST",
            path: path.into(),
            body,
        }
    }
    pub fn get(path: impl Into<String>) -> Self {
        Self {
            method: "GET",
            path: path.into(),
            body: None,
        }
    }
}

/// The engines a sync drives.
pub trait EngineControl: Sync {
    /// One URL per engine (what errors name).
    fn urls(&self) -> Vec<String>;
    /// One attempt of `call` on engine `engine`, answered within `deadline` or an error; never
    /// retried (a retried `/update_weights` would join a collective twice). The answer is the
    /// JSON body (`null` when empty).
    fn call(&self, engine: usize, call: &Call, deadline: Duration) -> Result<Value>;
}

fn rpc(method: &str, arg: &Value) -> Call {
    Call::post(
        "/collective_rpc",
        Some(json!({"method": method, "args": [arg.to_string()], "kwargs": {}})),
    )
}

impl Protocol {
    /// `init_info` as the transport made it. The native dialect is vLLM 0.33's for NCCL: no
    /// `backend` key (the engine's `--weight-transfer-config` says it), and the packing settings
    /// in `init_info` (`packed_buffer_size_bytes` is the bucket size, so every bucket is one chunk
    /// under vLLM's "close after the tensor that passes the size" rule).
    pub fn init(self, init_info: &Value, buffer_bytes: usize) -> Call {
        match self {
            Protocol::Native => {
                let mut info = init_info.clone();
                if let Some(m) = info.as_object_mut() {
                    m.remove("backend");
                    if m.contains_key("nccl_unique_id_b64") {
                        m.insert("packed".into(), json!(true));
                        m.insert("packed_buffer_size_bytes".into(), json!(buffer_bytes));
                    }
                }
                Call::post("/init_weight_transfer_engine", Some(json!({ "init_info": info })))
            }
            Protocol::WorkerExtension => rpc(EXT_INIT, init_info),
        }
    }

    pub fn start(self) -> Call {
        match self {
            Protocol::Native => Call::post("/start_weight_update", None),
            Protocol::WorkerExtension => rpc(EXT_START, &json!({})),
        }
    }

    /// `update_info`: names, dtype names, shapes, and the transport's keys. The native dialect
    /// drops `packed` / `nbytes` outside IPC (vLLM 0.33 moved them to `init_info`).
    pub fn update(self, update_info: &Value) -> Call {
        match self {
            Protocol::Native => {
                let mut info = update_info.clone();
                if let Some(m) = info.as_object_mut() {
                    if !m.contains_key("ipc_handle_b64") {
                        m.remove("packed");
                        m.remove("nbytes");
                    }
                }
                Call::post("/update_weights", Some(json!({ "update_info": info })))
            }
            Protocol::WorkerExtension => rpc(EXT_UPDATE, update_info),
        }
    }

    /// Ends the update as weight version `version` (vLLM 0.33's `/finish_weight_update
    /// {"weight_version"}`; 0.26 has no version, so the extension keeps it).
    pub fn finish(self, version: u64) -> Call {
        let body = json!({"weight_version": version.to_string()});
        match self {
            Protocol::Native => Call::post("/finish_weight_update", Some(body)),
            Protocol::WorkerExtension => rpc(EXT_FINISH, &body),
        }
    }

    /// Asks the engine's weight version (`GET /weight_info`; the extension's `vime_weight_info`).
    pub fn weight_info(self) -> Call {
        match self {
            Protocol::Native => Call::get("/weight_info"),
            Protocol::WorkerExtension => rpc(EXT_INFO, &json!({})),
        }
    }

    /// The version in a [`Protocol::weight_info`] answer (every worker's must agree).
    pub fn parse_version(self, v: &Value) -> Option<String> {
        match self {
            Protocol::Native => parse_weight_version(v),
            Protocol::WorkerExtension => {
                let all: Vec<Option<String>> = rpc_results(v).iter().map(parse_weight_version).collect();
                match all.first() {
                    Some(first) if all.iter().all(|x| x == first) => first.clone(),
                    _ => None,
                }
            }
        }
    }
}

/// `POST /pause?mode=keep&clear_cache=..`: queued and new requests are held, not aborted.
pub fn pause_call(clear_cache: bool) -> Call {
    Call::post(format!("/pause?mode=keep&clear_cache={clear_cache}"), None)
}

pub fn resume_call() -> Call {
    Call::post("/resume", None)
}

pub fn reset_prefix_cache_call() -> Call {
    Call::post("/reset_prefix_cache", None)
}

/// The version an engine reports in `GET /weight_info` (`{"weight_version": "<n>"}`).
pub fn parse_weight_version(v: &Value) -> Option<String> {
    match v.get("weight_version")? {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

/// `results` of a `/collective_rpc` answer: one entry per worker.
pub fn rpc_results(v: &Value) -> Vec<Value> {
    v.get("results").and_then(Value::as_array).cloned().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_protocol_follows_the_engine_and_the_transport() {
        let v = |s: &str| Some(s.to_string());
        assert_eq!(choose_protocol(&[None], "ipc").unwrap(), Protocol::Native);
        assert_eq!(choose_protocol(&[None, None], "cpu").unwrap(), Protocol::Native);
        assert_eq!(
            choose_protocol(&[v("0.26.0")], "ipc").unwrap(),
            Protocol::WorkerExtension
        );
        assert_eq!(
            choose_protocol(&[v("0.26.0")], "nccl").unwrap(),
            Protocol::WorkerExtension
        );
        assert_eq!(choose_protocol(&[v("0.33.0")], "nccl").unwrap(), Protocol::Native);
        assert_eq!(
            choose_protocol(&[v("0.33.1rc1")], "ipc").unwrap(),
            Protocol::WorkerExtension
        );
        assert_eq!(choose_protocol(&[v("1.2.0")], "nccl").unwrap(), Protocol::Native);
        assert!(choose_protocol(&[None, v("0.26.0")], "ipc").is_err());
        assert!(choose_protocol(&[], "ipc").is_err());
    }
}
