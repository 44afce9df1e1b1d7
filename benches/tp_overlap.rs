//! What `--tp-comm-overlap` buys (issue 17): one forward+backward at TP 2, with and without
//! sequence parallelism, timed with the backward's TP reductions run after the weight gradients
//! (off) or beside them (on, `Collectives::reduce_while`), on vime's CPU backend with one process
//! per rank. Steps alternate off/on so that drift hits both alike; the median of `--steps` each is
//! reported, and the gradients of the two orders are checked to be bit-identical.
//!
//!   cargo bench --bench tp_overlap                      (4 layers, hidden 1024, 2048 tokens)
//!   cargo bench --bench tp_overlap -- --layers 2 --tokens 1024 --steps 3
mod common;

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use common::{arg, config, num, random_batch};
use std::time::Instant;
use vime_qwen3::model::{Qwen3, Recompute, TpPlace};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn rank_main(sp: bool, out: &str) -> Result<()> {
    let (layers, tokens, steps) = (num("--layers", 4), num("--tokens", 2048), num("--steps", 5));
    let cfg = config(layers, 1024, 3072, 128)?;
    let world = vime_dist::World::from_env(2, 1, Some(1), vime_dist::Backend::Cpu)?;
    let group = world.tp().clone();
    let rank = group.rank();
    let mut model =
        Qwen3::init_random(cfg.clone(), 0.02, 0, DType::F32, &Device::Cpu)?.shard(TpPlace { rank, size: 2 })?;
    model.set_sequence_parallel(sp);
    let batch = random_batch(cfg.vocab_size, tokens, 4)?;
    let mut times = [Vec::new(), Vec::new()];
    let mut grads: [Option<std::collections::BTreeMap<String, Tensor>>; 2] = [None, None];
    for step in 0..=steps {
        for on in [false, true] {
            model.set_tp_comm_overlap(on);
            group.barrier()?;
            let t0 = Instant::now();
            let (_, g) = model.forward_backward_tp(
                &batch,
                Recompute::None,
                |o| Ok((o.logprobs.sum_all()? + o.entropy.sum_all()?)?),
                group.as_ref(),
            )?;
            let secs = t0.elapsed().as_secs_f64();
            if step > 0 {
                times[on as usize].push(secs); // step 0 warms up
            }
            grads[on as usize] = Some(g.params);
        }
    }
    let (off, on) = (grads[0].as_ref().unwrap(), grads[1].as_ref().unwrap());
    for (n, t) in off {
        let (a, b) = (
            t.flatten_all()?.to_vec1::<f32>()?,
            on[n].flatten_all()?.to_vec1::<f32>()?,
        );
        ensure!(a == b, "rank {rank}: --tp-comm-overlap changed the gradient of {n}");
    }
    let line = format!("{} {}", median(times[0].clone()), median(times[1].clone()));
    std::fs::write(format!("{out}/rank{rank}.txt"), line)?;
    Ok(())
}

fn main() -> Result<()> {
    if let Some(sp) = arg("--rank-sp") {
        return rank_main(sp == "1", &arg("--out").context("--out")?);
    }
    let dir = tempfile::tempdir()?;
    let exe = std::env::current_exe()?;
    println!(
        "config: layers {}, hidden 1024, heads 8/4 x 128, inter 3072, vocab 8192, f32, {} tokens; TP 2 on the CPU backend, \
         one process per rank; median of {} steps each, off/on alternating",
        num("--layers", 4),
        num("--tokens", 2048),
        num("--steps", 5)
    );
    println!("| SP | step, overlap off (s) | step, overlap on (s) | on / off | gradients |");
    println!("|---|---|---|---|---|");
    for sp in [false, true] {
        let out = dir.path().join(format!("sp{}", sp as u8));
        std::fs::create_dir_all(&out)?;
        let mut args: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
        args.extend([
            "--rank-sp".into(),
            (sp as u8).to_string(),
            "--out".into(),
            out.to_string_lossy().into_owned(),
        ]);
        vime_dist::launch::spawn_local(2, &exe, &args).with_context(|| format!("SP {sp}"))?;
        // The slower rank bounds the step.
        let mut worst = (0f64, 0f64);
        for r in 0..2 {
            let s = std::fs::read_to_string(out.join(format!("rank{r}.txt")))?;
            let v: Vec<f64> = s.split_whitespace().map(|x| x.parse().unwrap()).collect();
            worst = (worst.0.max(v[0]), worst.1.max(v[1]));
        }
        println!(
            "| {} | {:.3} | {:.3} | {:.3} | bit-identical |",
            if sp { "on" } else { "off" },
            worst.0,
            worst.1,
            worst.1 / worst.0
        );
    }
    Ok(())
}
