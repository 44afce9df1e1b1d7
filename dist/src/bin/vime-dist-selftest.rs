//! A rank of the multi-process tests (launched by `tests/multiprocess.rs` through `run_local`):
//! builds a `World` from the launch environment on the CPU backend and runs one scenario.
//!
//! - `collectives TP`: every collective on the world, dp and tp groups, checked against values
//!   computed directly; prints `selftest ok rank R`.
//! - `die-in-collective V`: rank V aborts; the others sit in a world all_reduce.
//! - `die-while-hung V`: rank V aborts; the others sleep forever, as if blocked inside NCCL, so
//!   only the watchdog can end them.
use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use vime_dist::{Backend, ReduceOp, World};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mode = args.first().map(String::as_str).unwrap_or("collectives");
    let arg = args.get(1).and_then(|a| a.parse::<usize>().ok()).unwrap_or(1);
    match mode {
        "collectives" => collectives(arg),
        "die-in-collective" | "die-while-hung" => {
            let world = World::from_env(1, 1, None, Backend::Cpu)?;
            world.world().barrier()?;
            if world.rank() == arg {
                std::process::abort();
            }
            if mode == "die-in-collective" {
                let t = Tensor::ones(4, DType::F32, &Device::Cpu)?;
                world.world().all_reduce(&t, ReduceOp::Sum)?;
            }
            loop {
                std::thread::sleep(std::time::Duration::from_secs(1));
            }
        }
        m => anyhow::bail!("unknown selftest mode {m:?}"),
    }
}

fn collectives(tp: usize) -> Result<()> {
    let world = World::from_env(tp, 1, None, Backend::Cpu)?;
    let (r, n) = (world.rank(), world.size());
    let dev = Device::Cpu;
    let t = (Tensor::arange(0f32, 6., &dev)? + r as f64)?;
    let sum = world.world().all_reduce(&t, ReduceOp::Sum)?.to_vec1::<f32>()?;
    let want: Vec<f32> = (0..6).map(|i| (0..n).map(|k| (i + k) as f32).sum()).collect();
    ensure!(sum == want, "rank {r}: all_reduce {sum:?} != {want:?}");
    let g = world
        .world()
        .all_gather(&Tensor::new(&[r as u32], &dev)?)?
        .to_vec1::<u32>()?;
    ensure!(g == (0..n as u32).collect::<Vec<_>>(), "rank {r}: all_gather {g:?}");
    let dp = world.dp();
    let dsum = dp
        .all_reduce(&Tensor::new(&[r as i64], &dev)?, ReduceOp::Sum)?
        .to_vec1::<i64>()?[0];
    let dwant: i64 = dp.members().iter().map(|m| *m as i64).sum();
    ensure!(dsum == dwant, "rank {r}: dp all_reduce {dsum} != {dwant}");
    let tpg = world.tp();
    let b = tpg.broadcast_bytes(format!("from {}", tpg.members()[0]).as_bytes(), 0)?;
    ensure!(
        b == format!("from {}", tpg.members()[0]).as_bytes(),
        "rank {r}: tp broadcast_bytes"
    );
    ensure!(!world.agree_any(false)?, "rank {r}: agree_any(false) was true");
    ensure!(
        world.agree_any(r == n - 1)?,
        "rank {r}: agree_any missed the last rank's true"
    );
    world.world().barrier()?;
    world.finish()?;
    println!("selftest ok rank {r}");
    Ok(())
}
