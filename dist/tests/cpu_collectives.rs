//! Every collective of the CPU backend, ranks as threads, at world sizes 1 to 4, against values
//! computed directly on each rank.
mod common;
use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use common::{run_threads, world_of};
use vime_dist::{Collectives, ParallelDims, ReduceOp};

/// Rank `r`'s input: values that make a sum's rounding order matter.
fn input(r: usize, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let base = Tensor::arange(0f64, n as f64, &Device::Cpu)?;
    let t = ((base * (0.1 + r as f64 * 1.37))? + 1e-3 * (r as f64 + 1.0))?;
    Ok(t.reshape(shape)?.to_dtype(dtype)?)
}

/// The sum in group-rank order, computed directly.
fn expected_sum(n: usize, shape: &[usize], dtype: DType) -> Result<Tensor> {
    let mut acc = input(0, shape, dtype)?;
    for r in 1..n {
        acc = acc.add(&input(r, shape, dtype)?)?;
    }
    Ok(acc)
}

fn same_bits(a: &Tensor, b: &Tensor) -> Result<bool> {
    Ok(a.dims() == b.dims()
        && a.dtype() == b.dtype()
        && a.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?
            == b.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?)
}

/// Every rank's bytes of `t` are identical.
fn check_identical(g: &dyn Collectives, t: &Tensor) -> Result<()> {
    let bytes: Vec<u8> = t
        .to_dtype(DType::F64)?
        .flatten_all()?
        .to_vec1::<f64>()?
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let all = g.all_gather_bytes(&bytes)?;
    ensure!(all.iter().all(|b| *b == all[0]), "ranks disagree bitwise");
    Ok(())
}

fn every_collective(g: &dyn Collectives) -> Result<()> {
    let (r, n) = (g.rank(), g.size());
    for dtype in [DType::F32, DType::F64, DType::BF16, DType::F16] {
        let shape = [3, 5];
        let got = g.all_reduce(&input(r, &shape, dtype)?, ReduceOp::Sum)?;
        ensure!(
            same_bits(&got, &expected_sum(n, &shape, dtype)?)?,
            "all_reduce {dtype:?} at size {n}"
        );
        check_identical(g, &got)?;
        let mx = g.all_reduce(&input(r, &shape, dtype)?, ReduceOp::Max)?;
        ensure!(
            same_bits(&mx, &input(n - 1, &shape, dtype)?)?,
            "all_reduce max {dtype:?}"
        );
    }
    let ints = g.all_reduce(&Tensor::new(&[r as i64, 1, -2], &Device::Cpu)?, ReduceOp::Sum)?;
    let s = (n * (n - 1) / 2) as i64;
    ensure!(ints.to_vec1::<i64>()? == [s, n as i64, -2 * n as i64], "i64 all_reduce");
    let u = g.all_reduce(&Tensor::new(&[r as u32 + 1], &Device::Cpu)?, ReduceOp::Sum)?;
    ensure!(u.to_vec1::<u32>()? == [(n * (n + 1) / 2) as u32], "u32 all_reduce");

    // all_gather: concatenation in rank order.
    let mine = input(r, &[2, 3], DType::F32)?;
    let gathered = g.all_gather(&mine)?;
    let parts: Vec<Tensor> = (0..n).map(|k| input(k, &[2, 3], DType::F32)).collect::<Result<_>>()?;
    ensure!(same_bits(&gathered, &Tensor::cat(&parts, 0)?)?, "all_gather");

    // reduce_scatter: this rank's chunk of the ordered sum; gathering the chunks is the all_reduce.
    let x = input(r, &[2 * n, 3], DType::F32)?;
    let chunk = g.reduce_scatter(&x, ReduceOp::Sum)?;
    let full = expected_sum(n, &[2 * n, 3], DType::F32)?;
    ensure!(same_bits(&chunk, &full.narrow(0, 2 * r, 2)?)?, "reduce_scatter chunk");
    ensure!(
        same_bits(&g.all_gather(&chunk)?, &g.all_reduce(&x, ReduceOp::Sum)?)?,
        "reduce_scatter/all_gather round trip"
    );

    // broadcast from the last rank; others pass garbage of the same shape.
    let root = n - 1;
    let b = g.broadcast(&input(r, &[4], DType::BF16)?, root)?;
    ensure!(same_bits(&b, &input(root, &[4], DType::BF16)?)?, "broadcast");

    // send/recv around a ring (small messages, so all sending first cannot block).
    if n > 1 {
        g.send(&input(r, &[3], DType::F32)?, (r + 1) % n)?;
        let from = (r + n - 1) % n;
        let got = g.recv(&[3], DType::F32, from)?;
        ensure!(same_bits(&got, &input(from, &[3], DType::F32)?)?, "recv from {from}");
    }

    let msg = format!("root {r} says hi");
    ensure!(
        g.broadcast_bytes(msg.as_bytes(), 0)? == b"root 0 says hi",
        "broadcast_bytes"
    );
    let all = g.all_gather_bytes(&vec![r as u8; r])?;
    ensure!(
        all == (0..n).map(|k| vec![k as u8; k]).collect::<Vec<_>>(),
        "all_gather_bytes"
    );
    g.barrier()?;
    Ok(())
}

#[test]
fn every_collective_at_sizes_1_to_4() {
    for n in 1..=4 {
        run_threads(world_of(n), |w| every_collective(w.world().as_ref()));
    }
}

#[test]
fn agree_any_is_true_everywhere_when_one_rank_says_so() {
    run_threads(world_of(3), |w| {
        ensure!(!w.agree_any(false)?, "nobody said true");
        ensure!(w.agree_any(w.rank() == 1)?, "rank 1 said true");
        ensure!(w.agree_any(true)?, "everybody said true");
        Ok(())
    });
}

#[test]
fn mismatched_shapes_fail_on_every_rank_naming_both() {
    run_threads(world_of(3), |w| {
        let t = Tensor::zeros(if w.rank() == 2 { 5 } else { 4 }, DType::F32, &Device::Cpu)?;
        let err = w.world().all_reduce(&t, ReduceOp::Sum).unwrap_err().to_string();
        ensure!(
            err.contains("[5]") && err.contains("[4]") && err.contains("rank 2"),
            "error was: {err}"
        );
        // The group is still usable afterwards.
        w.world().barrier()
    });
}

/// dp and tp groups of a 2 x 2 world (and cp x tp) work at the same time, each over its members.
#[test]
fn subgroups_of_a_2x2_world_run_concurrently() {
    for (tp, cp) in [(2, 1), (2, 2), (1, 2)] {
        let dims = ParallelDims::new(4, tp, cp, None).unwrap();
        run_threads(dims, |w| {
            let r = w.rank();
            let me = Tensor::new(&[r as f32, 1.0], &Device::Cpu)?;
            for (name, g) in [("dp", w.dp()), ("tp", w.tp()), ("cp", w.cp()), ("world", w.world())] {
                let s = g.all_reduce(&me, ReduceOp::Sum)?.to_vec1::<f32>()?;
                let want = g.members().iter().map(|m| *m as f32).sum::<f32>();
                ensure!(s == [want, g.size() as f32], "{name} group {:?}: {s:?}", g.members());
                ensure!(
                    g.members()[g.rank()] == r,
                    "{name}: member list does not hold this rank"
                );
            }
            let d = w.dims();
            ensure!(
                w.dp().size() == d.dp && w.tp().size() == d.tp && w.cp().size() == d.cp,
                "group sizes"
            );
            Ok(())
        });
    }
}
