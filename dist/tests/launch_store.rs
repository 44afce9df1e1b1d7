//! The launch contract's parsing, the store's requests and its behaviour on bad input, the
//! rendezvous deadline, the watchdog's failure report in-process, and `ParallelDims`.
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use vime_dist::launch::{free_port, take_nproc_flag};
use vime_dist::store::{StoreClient, StoreServer};
use vime_dist::watchdog::Watchdog;
use vime_dist::{DistEnv, Failure, ParallelDims};

fn env_of(pairs: &[(&str, &str)]) -> anyhow::Result<Option<DistEnv>> {
    let m: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    DistEnv::from_lookup(|k| m.get(k).cloned())
}

const FULL: [(&str, &str); 6] = [
    ("RANK", "3"),
    ("WORLD_SIZE", "4"),
    ("LOCAL_RANK", "1"),
    ("LOCAL_WORLD_SIZE", "2"),
    ("MASTER_ADDR", "10.0.0.1"),
    ("MASTER_PORT", "29500"),
];

fn with(k: &str, v: &str) -> Vec<(&'static str, String)> {
    FULL.iter()
        .map(|(a, b)| (*a, if *a == k { v.to_string() } else { b.to_string() }))
        .collect()
}

fn err_with(k: &str, v: &str) -> String {
    let pairs = with(k, v);
    let p: Vec<(&str, &str)> = pairs.iter().map(|(a, b)| (*a, b.as_str())).collect();
    env_of(&p).unwrap_err().to_string()
}

#[test]
fn env_contract_parses_and_names_bad_variables() {
    assert_eq!(env_of(&[]).unwrap(), None);
    let e = env_of(&FULL).unwrap().unwrap();
    assert_eq!((e.rank, e.world_size, e.local_rank, e.local_world_size), (3, 4, 1, 2));
    assert_eq!(e.store_addr(), "10.0.0.1:29500");
    let missing = env_of(&FULL[..4]).unwrap_err().to_string();
    assert!(
        missing.contains("MASTER_ADDR") && missing.contains("MASTER_PORT"),
        "{missing}"
    );
    assert!(err_with("RANK", "three").contains("RANK=\"three\""));
    assert!(err_with("RANK", "4").contains("RANK=4 is out of range for WORLD_SIZE=4"));
    assert!(err_with("WORLD_SIZE", "-1").contains("WORLD_SIZE"));
    assert!(err_with("LOCAL_RANK", "2").contains("LOCAL_RANK=2"));
    assert!(err_with("LOCAL_WORLD_SIZE", "8").contains("LOCAL_WORLD_SIZE=8"));
    assert!(err_with("MASTER_PORT", "70000").contains("MASTER_PORT"));
    assert!(err_with("MASTER_PORT", "0").contains("MASTER_PORT"));
    // Under torchrun its agent serves its own store at MASTER_PORT: vime's moves to the next port
    // (the GPU machine refused the bind with "Address already in use" before this rule).
    let mut torchrun: Vec<(&str, &str)> = FULL.to_vec();
    torchrun.push(("TORCHELASTIC_RUN_ID", "none"));
    assert_eq!(env_of(&torchrun).unwrap().unwrap().store_addr(), "10.0.0.1:29501");
    torchrun.push(("VIME_STORE_PORT", "31000"));
    assert_eq!(env_of(&torchrun).unwrap().unwrap().store_addr(), "10.0.0.1:31000");
    let mut bad: Vec<(&str, &str)> = FULL.to_vec();
    bad.push(("VIME_STORE_PORT", "x"));
    assert!(env_of(&bad).unwrap_err().to_string().contains("VIME_STORE_PORT"));
}

#[test]
fn nproc_flag_is_taken_out_of_the_args() {
    let mut a: Vec<String> = ["--lr", "1e-6", "--nproc-per-node", "4", "--x"]
        .map(String::from)
        .to_vec();
    assert_eq!(take_nproc_flag(&mut a).unwrap(), Some(4));
    assert_eq!(a, ["--lr", "1e-6", "--x"]);
    let mut b: Vec<String> = vec!["--nproc-per-node=2".into()];
    assert_eq!(take_nproc_flag(&mut b).unwrap(), Some(2));
    assert!(b.is_empty());
    assert!(take_nproc_flag(&mut vec!["--nproc-per-node".into()]).is_err());
    assert!(take_nproc_flag(&mut vec!["--nproc-per-node".into(), "zero".into()]).is_err());
    assert_eq!(take_nproc_flag(&mut vec!["--lr".into()]).unwrap(), None);
}

#[test]
fn rendezvous_without_a_server_fails_in_time_naming_the_address() {
    let addr = format!("127.0.0.1:{}", free_port().unwrap());
    let t0 = Instant::now();
    let err = StoreClient::connect(&addr, 3, Duration::from_secs(1))
        .err()
        .unwrap()
        .to_string();
    let took = t0.elapsed();
    assert!(
        err.contains(&format!(
            "rank 3: no rendezvous at {addr} after 1 s (is rank 0 running?)"
        )),
        "{err}"
    );
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

#[test]
fn store_set_get_add_and_deadlines() {
    let server = StoreServer::bind("127.0.0.1:0", Duration::from_secs(10)).unwrap();
    let addr = server.addr().to_string();
    let a = StoreClient::connect(&addr, 0, Duration::from_secs(5)).unwrap();
    let b = StoreClient::connect(&addr, 1, Duration::from_secs(5)).unwrap();
    a.set("k", b"v1").unwrap();
    assert_eq!(b.get("k", Duration::from_secs(1)).unwrap(), b"v1");
    assert_eq!(a.add("n", 5).unwrap(), 5);
    assert_eq!(b.add("n", -2).unwrap(), 3);
    // A get waits for a later set.
    let late = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        a.set("late", b"here").unwrap();
    });
    assert_eq!(b.get("late", Duration::from_secs(5)).unwrap(), b"here");
    late.join().unwrap();
    let t0 = Instant::now();
    let err = b.get("never", Duration::from_millis(300)).unwrap_err().to_string();
    assert!(err.contains("`never` did not appear") && err.contains(&addr), "{err}");
    assert!(t0.elapsed() < Duration::from_secs(3));
}

#[test]
fn store_survives_garbage() {
    let server = StoreServer::bind("127.0.0.1:0", Duration::from_secs(10)).unwrap();
    let addr = server.addr().to_string();
    // A frame claiming 4 GiB, then an unknown request, then a truncated one.
    for junk in [
        &[0xff, 0xff, 0xff, 0xff][..],
        &[1, 0, 0, 0, 99],
        &[3, 0, 0, 0, 2, 1, 1],
        &[9, 0, 0, 0, 1, 255, 255, 255, 255, 0, 0, 0, 0],
    ] {
        let mut s = TcpStream::connect(&addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        s.write_all(junk).unwrap();
        let mut buf = Vec::new();
        let _ = s.read_to_end(&mut buf); // an error reply, EOF, or a reset: anything but a hang
    }
    let c = StoreClient::connect(&addr, 0, Duration::from_secs(5)).unwrap();
    c.set("still", b"works").unwrap();
    assert_eq!(c.get("still", Duration::from_secs(1)).unwrap(), b"works");
}

/// Two ranks' watchdogs in one process: rank 1 goes away without a goodbye, rank 0's handler
/// hears about it within about a heartbeat interval; a rank that says goodbye is not reported.
#[test]
fn watchdog_reports_a_vanished_rank_but_not_a_finished_one() {
    let server = StoreServer::bind("127.0.0.1:0", Duration::from_secs(10)).unwrap();
    let addr = server.addr().to_string();
    let (tx, rx) = mpsc::channel::<Failure>();
    let tx = Arc::new(Mutex::new(tx));
    let start = |rank: usize| {
        let tx = tx.clone();
        Watchdog::start(
            StoreClient::connect(&addr, rank, Duration::from_secs(5)).unwrap(),
            Duration::from_millis(100),
            Duration::from_secs(5),
            Arc::new(move |f: &Failure| {
                let _ = tx.lock().unwrap().send(f.clone());
            }),
        )
        .unwrap()
    };
    let (w0, w1, w2) = (start(0), start(1), start(2));
    w2.finish().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert!(rx.try_recv().is_err(), "a finished rank was reported");
    let t0 = Instant::now();
    w1.abandon();
    let f = rx.recv_timeout(Duration::from_secs(5)).expect("no failure reported");
    assert_eq!(f.rank, 1, "{f}");
    eprintln!("in-process watchdog: reported {f} after {:?}", t0.elapsed());
    assert_eq!(server.failure().map(|f| f.rank), Some(1));
    drop(w0);
}

#[test]
fn dims_validation_names_the_sizes() {
    let e = ParallelDims::new(6, 4, 1, None).unwrap_err().to_string();
    assert!(e.contains("6") && e.contains("4"), "{e}");
    let e = ParallelDims::new(8, 2, 2, Some(4)).unwrap_err().to_string();
    assert!(e.contains("--data-parallel-size 4") && e.contains("= 2"), "{e}");
    assert!(ParallelDims::new(0, 1, 1, None).is_err());
    assert!(ParallelDims::new(4, 0, 1, None).is_err());
}

#[test]
fn dims_coords_and_groups_for_world_8_tp_2_cp_2() {
    let d = ParallelDims::new(8, 2, 2, None).unwrap();
    assert_eq!(d.dp, 2);
    let c = d.coords(5);
    assert_eq!((c.dp, c.cp, c.tp), (1, 0, 1));
    assert_eq!(d.global_rank(1, 0, 1), 5);
    assert_eq!(d.tp_group(5), [4, 5]);
    assert_eq!(d.cp_group(5), [5, 7]);
    assert_eq!(d.dp_group(5), [1, 5]);
    for of in [ParallelDims::tp_group, ParallelDims::cp_group, ParallelDims::dp_group] {
        let groups = d.all_groups(of);
        assert_eq!(groups.len(), 4);
        let mut all: Vec<usize> = groups.concat();
        all.sort();
        assert_eq!(all, (0..8).collect::<Vec<_>>(), "each rank in exactly one group");
    }
    for r in 0..8 {
        let c = d.coords(r);
        assert_eq!(d.global_rank(c.dp, c.cp, c.tp), r);
    }
}
