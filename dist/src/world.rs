//! `World`: this process's rank, its `ParallelDims`, and its process groups (`world`, `dp`, `tp`,
//! `cp`) as values the trainer passes down. No globals: two worlds in one process (the thread
//! tests) are simply two values.
//!
//! Building one (every rank, same order): rank 0 starts the store; every rank connects, starts its
//! watchdog, checks that all ranks agree on the world size and dims, then joins its world group
//! and its dp, tp and cp groups in that order (the same order everywhere, which NCCL's blocking
//! communicator init needs). A group of one member is a `SingleRank`, with no connections.
//!
//! Finishing: [`World::finish`] says goodbye to the store; rank 0 then waits for every rank's
//! goodbye before it stops the store, so that no finishing rank mistakes rank 0's exit for a
//! death. A world dropped without `finish` (an early error, a panic) leaves without a goodbye,
//! so the others are told this rank failed rather than waiting for it.
use crate::collectives::{Collectives, SingleRank};
use crate::cpu::CpuGroup;
use crate::dims::{ParallelDims, RankCoords};
use crate::launch::{DistEnv, Timeouts};
use crate::store::{Failure, StoreClient, StoreServer};
use crate::watchdog::{exit_on_failure, FailureHandler, Watchdog};
use anyhow::{bail, Context, Result};
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

/// Which collectives implementation the groups use.
#[derive(Debug, Clone)]
pub enum Backend {
    /// TCP between processes (or threads) on one machine.
    Cpu,
    /// NCCL on this device's stream (one GPU per rank).
    #[cfg(feature = "cuda")]
    Nccl(candle_core::Device),
}

/// How a `World` is built beyond the launch contract.
#[derive(Clone)]
pub struct WorldOptions {
    pub timeouts: Timeouts,
    /// What the watchdog does when another rank dies; `None`: print and exit
    /// ([`crate::watchdog::EXIT_PEER_DIED`]).
    pub on_failure: Option<FailureHandler>,
}

impl WorldOptions {
    /// Timeouts from the `VIME_DIST_*` variables, the exiting failure handler.
    pub fn from_env() -> Result<Self> {
        Ok(WorldOptions {
            timeouts: Timeouts::from_env()?,
            on_failure: None,
        })
    }
}

pub struct World {
    coords: RankCoords,
    dims: ParallelDims,
    world: Rc<dyn Collectives>,
    dp: Rc<dyn Collectives>,
    tp: Rc<dyn Collectives>,
    cp: Rc<dyn Collectives>,
    timeouts: Timeouts,
    store: Option<StoreClient>,
    watchdog: Option<Watchdog>,
    server: Option<StoreServer>,
}

impl World {
    /// One process: every group a `SingleRank`; no store, no threads.
    pub fn single() -> World {
        let g = || -> Rc<dyn Collectives> { Rc::new(SingleRank::new(0)) };
        World {
            coords: ParallelDims::SINGLE.coords(0),
            dims: ParallelDims::SINGLE,
            world: g(),
            dp: g(),
            tp: g(),
            cp: g(),
            timeouts: Timeouts::default(),
            store: None,
            watchdog: None,
            server: None,
        }
    }

    /// From the torchrun variables (see [`DistEnv`]) and the trainer's parallel sizes; dp is
    /// derived from the world size when `dp` is `None`. No launch variables: a single process,
    /// which then must have tp = cp = dp = 1.
    pub fn from_env(tp: usize, cp: usize, dp: Option<usize>, backend: Backend) -> Result<World> {
        match DistEnv::from_env()? {
            None => {
                ParallelDims::new(1, tp, cp, dp).context(
                    "no launch environment (RANK, WORLD_SIZE, ...): this is a single-process run; \
                     use --nproc-per-node or torchrun for parallel sizes above 1",
                )?;
                Ok(World::single())
            }
            Some(env) => {
                let dims = ParallelDims::new(env.world_size, tp, cp, dp)?;
                World::new(&env, dims, backend, WorldOptions::from_env()?)
            }
        }
    }

    pub fn new(env: &DistEnv, dims: ParallelDims, backend: Backend, opts: WorldOptions) -> Result<World> {
        let rank = env.rank;
        if dims.world() != env.world_size {
            bail!(
                "rank {rank}: dims dp {} x tp {} x cp {} = {} ranks, but WORLD_SIZE is {}",
                dims.dp,
                dims.tp,
                dims.cp,
                dims.world(),
                env.world_size
            );
        }
        let t = opts.timeouts;
        let addr = env.store_addr();
        let server = if rank == 0 {
            Some(StoreServer::bind(&addr, t.heartbeat)?)
        } else {
            None
        };
        let store = StoreClient::connect(&addr, rank, t.rendezvous)?;
        let mut handler = opts.on_failure.clone().unwrap_or_else(|| exit_on_failure(rank));
        if let Some(server) = &server {
            // Rank 0 hosts the store: before it exits over another rank's death, the others
            // must have read who died, or they would blame rank 0 for the vanished store.
            let (linger, inner) = (server.linger(), handler);
            let wait = 4 * t.heartbeat_interval + Duration::from_secs(1);
            handler = Arc::new(move |f: &Failure| {
                linger.wait_told(wait);
                inner(f)
            });
        }
        let beat = StoreClient::connect(&addr, rank, t.rendezvous)?;
        let watchdog = Watchdog::start(beat, t.heartbeat_interval, t.heartbeat, handler)?;

        let groups = (|| -> Result<[Rc<dyn Collectives>; 4]> {
            let layout = format!("world {} dp {} tp {} cp {}", env.world_size, dims.dp, dims.tp, dims.cp);
            if rank == 0 {
                store.set("vime/layout", layout.as_bytes())?;
            } else {
                let theirs = store.get("vime/layout", t.rendezvous)?;
                if theirs != layout.as_bytes() {
                    bail!(
                        "rank {rank} was launched with {layout}, rank 0 with {}",
                        String::from_utf8_lossy(&theirs)
                    );
                }
            }

            // A group of one is a SingleRank (no communicator), except the NCCL world group: a
            // launched world always builds one, so NCCL is set up and checked even at world
            // size 1 (torchrun --nproc-per-node 1).
            let join = |kind: &str, members: Vec<usize>| -> Result<Rc<dyn Collectives>> {
                #[cfg(feature = "cuda")]
                let real = kind == "world" && matches!(backend, Backend::Nccl(_));
                #[cfg(not(feature = "cuda"))]
                let real = false;
                if members.len() == 1 && !real {
                    return Ok(Rc::new(SingleRank::new(rank)));
                }
                let list: Vec<String> = members.iter().map(|m| m.to_string()).collect();
                let name = format!("{kind}:{}", list.join(","));
                let g: Rc<dyn Collectives> = match &backend {
                    Backend::Cpu => Rc::new(CpuGroup::new(&store, &name, &members, rank, &t)?),
                    #[cfg(feature = "cuda")]
                    Backend::Nccl(device) => {
                        Rc::new(crate::nccl::NcclGroup::new(&store, &name, &members, rank, device, &t)?)
                    }
                };
                Ok(g)
            };
            let world = join("world", (0..env.world_size).collect())?;
            // The communicator works: a one-element sum over the world is its size.
            let device = match &backend {
                Backend::Cpu => candle_core::Device::Cpu,
                #[cfg(feature = "cuda")]
                Backend::Nccl(d) => d.clone(),
            };
            let one = candle_core::Tensor::ones(1, candle_core::DType::F32, &device)?;
            let sum = world.all_reduce(&one, crate::ReduceOp::Sum)?.to_vec1::<f32>()?[0];
            if sum != env.world_size as f32 {
                bail!(
                    "rank {rank}: the world group's check all-reduce gave {sum}, not the world size {}",
                    env.world_size
                );
            }
            let dp = join("dp", dims.dp_group(rank))?;
            let tp = join("tp", dims.tp_group(rank))?;
            let cp = join("cp", dims.cp_group(rank))?;
            Ok([world, dp, tp, cp])
        })();
        let [world, dp, tp, cp] = match groups {
            Ok(g) => g,
            Err(e) => {
                // Tell the others at once rather than leave them to their rendezvous deadline.
                watchdog.abandon();
                return Err(e);
            }
        };
        Ok(World {
            coords: dims.coords(rank),
            dims,
            world,
            dp,
            tp,
            cp,
            timeouts: t,
            store: Some(store),
            watchdog: Some(watchdog),
            server,
        })
    }

    pub fn rank(&self) -> usize {
        self.coords.global
    }
    pub fn size(&self) -> usize {
        self.dims.world()
    }
    pub fn is_main(&self) -> bool {
        self.coords.global == 0
    }
    pub fn dims(&self) -> ParallelDims {
        self.dims
    }
    pub fn coords(&self) -> RankCoords {
        self.coords
    }
    pub fn world(&self) -> &Rc<dyn Collectives> {
        &self.world
    }
    pub fn dp(&self) -> &Rc<dyn Collectives> {
        &self.dp
    }
    pub fn tp(&self) -> &Rc<dyn Collectives> {
        &self.tp
    }
    pub fn cp(&self) -> &Rc<dyn Collectives> {
        &self.cp
    }
    /// The rendezvous store (small host-side exchanges); `None` for [`World::single`].
    pub fn store(&self) -> Option<&StoreClient> {
        self.store.as_ref()
    }

    /// True on every rank if any rank passed true: the collective decision at a step boundary
    /// (Ctrl-C seen on one rank, an error on one rank) so that all ranks stop at the same step.
    pub fn agree_any(&self, flag: bool) -> Result<bool> {
        let all = self.world.all_gather_bytes(&[flag as u8])?;
        Ok(all.iter().any(|b| b.first() == Some(&1)))
    }

    /// Clean shutdown: says goodbye (so this rank is not reported dead), and on rank 0 waits for
    /// every rank's goodbye before the store stops.
    pub fn finish(mut self) -> Result<()> {
        self.shutdown()
    }

    fn shutdown(&mut self) -> Result<()> {
        let bye = self.watchdog.take().map(Watchdog::finish).unwrap_or(Ok(()));
        let all = match &self.server {
            Some(s) => s.wait_goodbyes(self.size(), self.timeouts.rendezvous),
            None => Ok(()),
        };
        self.store = None;
        self.server = None;
        bye.and(all)
    }
}

impl Drop for World {
    /// A world dropped without [`World::finish`] (an error returned early, a panic) leaves as a
    /// failed rank: no goodbye, so the other ranks' watchdogs stop them instead of leaving them
    /// waiting in a collective.
    fn drop(&mut self) {
        if let Some(w) = self.watchdog.take() {
            w.abandon();
        }
        self.store = None;
        std::mem::forget(self.server.take());
    }
}
