//! The receiver's checks, before anything is received or written: every malformed or out-of-order
//! weight-transfer call is refused with an error naming the key, the tensor or the missing call.
//! (The receive itself, over the CPU broadcast into a real engine, is `rollout/tests/weight_sync.rs`.)
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};
use std::sync::Mutex;
use std::time::Duration;
use vime_sync::sender::{join_sync_group, Rendezvous};
use vime_sync::{RecvKind, WeightReceiver, WeightSink};

/// Records what the receiver hands over.
#[derive(Default)]
struct Recorder(Mutex<Vec<(String, Vec<usize>)>>);

impl WeightSink for Recorder {
    fn device(&self) -> Device {
        Device::Cpu
    }
    fn load(&self, tensors: Vec<(String, Tensor)>) -> anyhow::Result<()> {
        let mut g = self.0.lock().unwrap();
        g.extend(tensors.into_iter().map(|(n, t)| (n, t.dims().to_vec())));
        Ok(())
    }
    fn with_targets(
        &self,
        _: &[String],
        _: DType,
        _: &mut dyn FnMut(&[Tensor]) -> anyhow::Result<()>,
    ) -> anyhow::Result<bool> {
        Ok(false)
    }
}

fn err(r: anyhow::Result<impl std::fmt::Debug>) -> String {
    format!("{:#}", r.unwrap_err())
}

/// A receiver joined (as rank 1) to a sender thread's CPU group; the thread broadcasts `buckets`.
fn joined(buckets: Vec<Vec<u8>>) -> (WeightReceiver, std::thread::JoinHandle<()>) {
    let store = vime_dist::store::StoreServer::bind("127.0.0.1:0", Duration::from_secs(60)).unwrap();
    let addr = store.addr().to_string();
    let port = store.addr().port();
    let a = addr.clone();
    let h = std::thread::spawn(move || {
        let _store = store;
        let g = join_sync_group(Rendezvous::Store(&a), 0, 2, &Device::Cpu, Duration::from_secs(20)).unwrap();
        for b in buckets {
            let t = Tensor::from_raw_buffer(&b, DType::U8, &[b.len()], &Device::Cpu).unwrap();
            g.broadcast(&t, 0).unwrap();
        }
    });
    let mut r = WeightReceiver::new(RecvKind::Cpu, Device::Cpu, Duration::from_secs(20));
    r.init(&json!({"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}))
        .unwrap();
    (r, h)
}

fn info(names: &[&str], shapes: Value) -> Value {
    json!({"names": names, "dtype_names": names.iter().map(|_| "bfloat16").collect::<Vec<_>>(), "shapes": shapes})
}

#[test]
fn init_refuses_bad_init_info_by_key() {
    let mut r = WeightReceiver::new(RecvKind::Cpu, Device::Cpu, Duration::from_secs(1));
    assert!(err(r.start()).contains("/start_weight_update before /init_weight_transfer_engine"));
    let e =
        err(r.init(&json!({"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 2, "bucket": 3})));
    assert!(e.contains("unknown key \"bucket\""), "{e}");
    let e = err(r.init(&json!({"backend": "ipc"})));
    assert!(e.contains("\"ipc\"") && e.contains("\"cpu\""), "{e}");
    let e = err(r.init(&json!({"master_address": "h", "master_port": 1, "rank_offset": 0, "world_size": 2})));
    assert!(e.contains("rank_offset 0") && e.contains("trainer"), "{e}");
    let e = err(r.init(&json!({"master_port": 1, "rank_offset": 1, "world_size": 2})));
    assert!(e.contains("init_info.master_address"), "{e}");
    let e = err(r.init(&json!("not an object")));
    assert!(e.contains("must be a JSON object"), "{e}");
    // An unreachable trainer: a bounded wait, then an error naming the address.
    let mut r = WeightReceiver::new(RecvKind::Cpu, Device::Cpu, Duration::from_millis(300));
    let port = vime_dist::launch::free_port().unwrap();
    let e =
        err(r.init(&json!({"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2})));
    assert!(e.contains(&format!("127.0.0.1:{port}")), "{e}");
}

#[test]
fn updates_are_checked_before_anything_is_received() {
    // bf16 [2, 3] + [4]: 12 + 8 bytes.
    let bucket: Vec<u8> = (0u8..20).collect();
    let (mut r, h) = joined(vec![bucket.clone()]);
    let sink = Recorder::default();
    let good = info(&["a.weight", "b.weight"], json!([[2, 3], [4]]));
    assert!(err(r.update(&good, &sink)).contains("outside /start_weight_update"));
    r.start().unwrap();
    let mut bad = good.clone();
    bad["ipc_handles_pickled"] = json!("x");
    assert!(err(r.update(&bad, &sink)).contains("unknown key \"ipc_handles_pickled\""));
    let mut bad = good.clone();
    bad["shapes"] = json!([[2, 3]]);
    assert!(err(r.update(&bad, &sink)).contains("2 names, 2 dtype_names and 1 shapes"));
    let mut bad = good.clone();
    bad["dtype_names"] = json!(["bfloat16", "complex32"]);
    let e = err(r.update(&bad, &sink));
    assert!(e.contains("b.weight") && e.contains("complex32"), "{e}");
    let mut bad = good.clone();
    bad["dtype_names"] = json!(["bfloat16", "float32"]);
    assert!(err(r.update(&bad, &sink)).contains("b.weight: dtype float32 differs"));
    let mut bad = good.clone();
    bad["nbytes"] = json!(21);
    assert!(err(r.update(&bad, &sink)).contains("nbytes is 21 but the tensors listed take 20 bytes"));
    let mut bad = good.clone();
    bad["shapes"] = json!([[2, -3], [4]]);
    assert!(err(r.update(&bad, &sink)).contains("a.weight: shape"));
    assert!(
        sink.0.lock().unwrap().is_empty(),
        "nothing may load from a refused update"
    );

    // The good one receives the broadcast and hands both tensors over, then the same name twice
    // in one update is refused.
    r.update(&good, &sink).unwrap();
    assert_eq!(
        *sink.0.lock().unwrap(),
        vec![("a.weight".to_string(), vec![2, 3]), ("b.weight".to_string(), vec![4])]
    );
    let e = err(r.update(&info(&["a.weight"], json!([[2, 3]])), &sink));
    assert!(e.contains("tensor a.weight sent twice"), "{e}");
    assert_eq!(r.finish(&sink).unwrap(), (1, 2));
    assert!(err(r.finish(&sink)).contains("without /start_weight_update"));
    h.join().unwrap();
}
