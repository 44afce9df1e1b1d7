//! vime-dist: the distributed layer every parallel layout stands on.
//!
//! - [`dims`]: `ParallelDims { dp, tp, cp }` validated against the world size, rank coordinates,
//!   and the member lists of every group.
//! - [`collectives`]: the [`Collectives`] trait (a process group as a value): all-reduce,
//!   all-gather, reduce-scatter, broadcast, barrier, send/recv over candle tensors, plus small
//!   host-side helpers for exchanging bytes.
//! - backends: [`cpu`] (ranks are processes on one machine, TCP between them; what CI runs) and
//!   `nccl` (behind the `cuda` feature, one communicator per group on the model's stream).
//! - [`store`]: the rendezvous (rank 0 serves a small key-value store at MASTER_ADDR:MASTER_PORT,
//!   with timeouts and errors naming the address), which also decides which rank died;
//!   [`watchdog`]: the per-rank heartbeat thread that turns a dead rank into an exit naming it on
//!   every other rank, even while they are blocked in a collective.
//! - [`world`]: [`World`], this process's rank, dims and groups, built from the launch contract.
//! - [`launch`]: the torchrun environment contract (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//!   `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`) and `--nproc-per-node N` local spawning.
//!
//! No globals: a process's groups live in a [`World`] value that the trainer passes down.
pub mod collectives;
pub mod cpu;
pub mod dims;
pub mod launch;
pub mod layout;
#[cfg(feature = "cuda")]
pub mod nccl;
pub mod store;
pub mod watchdog;
pub mod world;

pub use collectives::{Collectives, ReduceOp, SingleRank};
pub use dims::{ParallelDims, RankCoords};
pub use launch::{spawn_local, DistEnv, Timeouts};
pub use store::Failure;
pub use watchdog::EXIT_PEER_DIED;
pub use world::{Backend, World, WorldOptions};
