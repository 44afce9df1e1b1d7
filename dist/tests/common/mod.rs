//! Runs one closure per rank as threads of this process, each rank with its own `World` on the
//! CPU backend and a store on a free loopback port.
#![allow(dead_code)]
use anyhow::{anyhow, Result};
use std::sync::Arc;
use std::time::Duration;
use vime_dist::launch::free_port;
use vime_dist::{Backend, DistEnv, ParallelDims, Timeouts, World, WorldOptions};

pub fn test_options() -> WorldOptions {
    WorldOptions {
        timeouts: Timeouts {
            rendezvous: Duration::from_secs(20),
            op: Duration::from_secs(20),
            heartbeat: Duration::from_secs(10),
            heartbeat_interval: Duration::from_millis(200),
        },
        // Threads share a process: a failure report must not exit the test binary.
        on_failure: Some(Arc::new(|f| eprintln!("test world: {f} died"))),
    }
}

pub fn run_threads(dims: ParallelDims, f: impl Fn(&World) -> Result<()> + Sync) {
    let n = dims.world();
    let port = free_port().unwrap();
    let results: Vec<Result<()>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..n)
            .map(|r| {
                let f = &f;
                s.spawn(move || -> Result<()> {
                    let w = World::new(&DistEnv::local(r, n, port), dims, Backend::Cpu, test_options())?;
                    f(&w)?;
                    w.finish()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|_| Err(anyhow!("panicked"))))
            .collect()
    });
    for (r, res) in results.into_iter().enumerate() {
        if let Err(e) = res {
            panic!("rank {r} of {n}: {e:#}");
        }
    }
}

pub fn world_of(n: usize) -> ParallelDims {
    ParallelDims::new(n, 1, 1, None).unwrap()
}
