//! `scripts/gpu/check_kernels.sh`: every op on the CUDA device (today the composed path,
//! `vime_kernels::composed`; the fused CUDA kernels of issue 6 will take its place behind the same
//! functions) against the fused CPU kernel, on fresh random bf16 inputs at real Qwen3-4B shapes,
//! forward and the gradient of a random weighted sum with respect to every input. Both sides
//! compute in f32 from the same bf16 inputs and round once, so the bound is bf16's: norm-wise
//! relative error <= 1e-2 (about one bf16 ulp is 4e-3). Prints one line per op with the errors and
//! the CUDA forward+backward time, then a verdict line. Built only with `--features cuda`.
#![cfg(feature = "cuda")]
use candle_core::{DType, Device, Result, Tensor};
use std::sync::Arc;
use std::time::Instant;
use vime_kernels::testing::{autograd_grads, rel_err, weighted_sum, Rng};

const TOL: f64 = 1e-2;
type Op<'a> = &'a dyn Fn(&[Tensor]) -> Result<Tensor>;

fn check(name: &str, op: Op, inputs_cpu: &[Tensor], gpu: &Device, failures: &mut Vec<String>) -> Result<()> {
    let inputs_gpu: Vec<Tensor> = inputs_cpu.iter().map(|t| t.to_device(gpu)).collect::<Result<_>>()?;
    let obj = |x: &[Tensor]| weighted_sum(&op(x)?.to_dtype(DType::F32)?, 7);
    let (y_cpu, g_cpu) = (op(inputs_cpu)?, autograd_grads(&obj, inputs_cpu)?);
    // Warm-up (kernel JIT and allocations), then a timed forward + backward.
    let _ = autograd_grads(&obj, &inputs_gpu)?;
    gpu.synchronize()?;
    let t = Instant::now();
    let y_gpu = op(&inputs_gpu)?;
    let g_gpu = autograd_grads(&obj, &inputs_gpu)?;
    gpu.synchronize()?;
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let fwd = rel_err(&y_gpu.to_device(&Device::Cpu)?, &y_cpu)?;
    let mut errs = vec![fwd];
    for (a, b) in g_gpu.iter().zip(&g_cpu) {
        errs.push(rel_err(&a.to_device(&Device::Cpu)?, b)?);
    }
    let worst = errs.iter().cloned().fold(0.0, f64::max);
    let shapes: Vec<String> = inputs_cpu.iter().map(|t| format!("{:?}", t.dims())).collect();
    println!(
        "{name:<18} {:<48} fwd {:.1e} grads [{}]  cuda fwd+bwd {ms:8.2} ms  {}",
        shapes.join(" "),
        fwd,
        errs[1..]
            .iter()
            .map(|e| format!("{e:.1e}"))
            .collect::<Vec<_>>()
            .join(", "),
        if worst <= TOL { "ok" } else { "FAIL" }
    );
    if worst > TOL {
        failures.push(format!("{name}: worst rel err {worst:e}"));
    }
    Ok(())
}

#[test]
fn every_op_on_cuda_matches_the_cpu_kernel() -> Result<()> {
    let gpu = Device::new_cuda(0)?;
    let bf = DType::BF16;
    let mut rng = Rng::new(2026);
    let mut failures = Vec::new();
    // Qwen3-4B: hidden 2560, 32 query / 8 kv heads of 128, intermediate 9728, vocab 151936.
    let lens = [512u32, 384, 128];
    let t: usize = lens.iter().sum::<u32>() as usize;
    let mut cu = vec![0u32];
    let mut pos = Vec::new();
    for &l in &lens {
        cu.push(cu.last().unwrap() + l);
        pos.extend(0..l);
    }
    let cu: Arc<[u32]> = cu.into();
    let pos: Arc<[u32]> = pos.into();

    let x = rng.randn(&[t, 2560], 1.0, bf, &Device::Cpu)?;
    let w = (rng.randn(&[2560], 0.1, DType::F32, &Device::Cpu)? + 1.0)?.to_dtype(bf)?;
    check(
        "rms_norm",
        &|a| vime_kernels::rms_norm(&a[0], &a[1], 1e-6),
        &[x, w],
        &gpu,
        &mut failures,
    )?;

    let qn = rng.randn(&[t, 32, 128], 1.0, bf, &Device::Cpu)?;
    let wn = (rng.randn(&[128], 0.1, DType::F32, &Device::Cpu)? + 1.0)?.to_dtype(bf)?;
    check(
        "rms_norm (q_norm)",
        &|a| vime_kernels::rms_norm(&a[0], &a[1], 1e-6),
        &[qn, wn],
        &gpu,
        &mut failures,
    )?;

    let q = rng.randn(&[t, 32, 128], 1.0, bf, &Device::Cpu)?;
    let p = pos.clone();
    check(
        "rope",
        &|a| vime_kernels::rope(&a[0], &p, 1e6),
        &[q],
        &gpu,
        &mut failures,
    )?;

    let g = rng.randn(&[t, 9728], 2.0, bf, &Device::Cpu)?;
    let u = rng.randn(&[t, 9728], 1.0, bf, &Device::Cpu)?;
    check(
        "swiglu",
        &|a| vime_kernels::swiglu(&a[0], &a[1]),
        &[g, u],
        &gpu,
        &mut failures,
    )?;

    let q = rng.randn(&[t, 32, 128], 1.0, bf, &Device::Cpu)?;
    let k = rng.randn(&[t, 8, 128], 1.0, bf, &Device::Cpu)?;
    let v = rng.randn(&[t, 8, 128], 1.0, bf, &Device::Cpu)?;
    let scale = 1.0 / (128f64).sqrt();
    let c = cu.clone();
    check(
        "varlen_attention",
        &|a| vime_kernels::varlen_attention(&a[0], &a[1], &a[2], &c, &c, scale),
        &[q, k, v],
        &gpu,
        &mut failures,
    )?;

    let th = 256usize;
    let h = rng.randn(&[th, 2560], 1.0, bf, &Device::Cpu)?;
    let lm = rng.randn(&[151936, 2560], 0.02, bf, &Device::Cpu)?;
    let mut targets: Vec<u32> = (0..th).map(|_| (rng.next_u64() % 151936) as u32).collect();
    targets[th - 1] = vime_kernels::IGNORE_TARGET;
    let targets: Arc<[u32]> = targets.into();
    let tg = targets.clone();
    check(
        "logprobs_entropy",
        &|a| {
            let (lp, ent) = vime_kernels::logprobs_entropy(&a[0], &a[1], &tg, 64)?;
            Tensor::cat(&[lp, ent], 0)
        },
        &[h, lm],
        &gpu,
        &mut failures,
    )?;

    println!(
        "CHECK_KERNELS VERDICT: {} ({} ops vs the CPU kernels, bf16, rel err bound {TOL:e})",
        if failures.is_empty() { "PASS" } else { "FAIL" },
        6
    );
    assert!(failures.is_empty(), "{failures:?}");
    Ok(())
}
