//! `scripts/gpu/check_kernels.sh`: every op on the CUDA device (bf16: the fused CUDA kernels of
//! kernels/cuda/*.cu) against the fused CPU kernel, on fresh random bf16 inputs at real Qwen3-4B
//! shapes, forward and the gradient of a random weighted sum with respect to every input; plus the
//! fused AdamW against the CPU update. Both sides compute in f32 from the same bf16 inputs and round
//! once, so the bound is bf16's: norm-wise relative error <= 1e-2 (about one bf16 ulp is 4e-3).
//! Prints one line per op with the errors, then a verdict line. A second test prints the kernels'
//! timings (`TIME` lines, median of repeated runs) at the shapes `scripts/gpu/torch_kernel_times.py`
//! times torch's equivalents on. Built only with `--features cuda`.
#![cfg(feature = "cuda")]
use candle_core::Var;
use candle_core::{DType, Device, Result, Tensor};
use std::sync::Arc;
use std::time::Instant;
use vime_kernels::decode::SplitPlan;
use vime_kernels::testing::{autograd_grads, rel_err, weighted_sum, Rng};

const TOL: f64 = 1e-2;

/// The attention kernels this build has: vime's flash kernel, and cuDNN's with the cudnn feature.
/// The kernel config of one backend; a cuDNN failure is an error here (no silent fallback).
fn kernels(backend: vime_kernels::AttentionBackend, deterministic: bool) -> Result<vime_kernels::KernelConfig> {
    vime_kernels::KernelConfig::new(backend, deterministic, vime_kernels::CudnnFailure::Error)
        .map_err(candle_core::Error::msg)
}

fn attention_backends() -> Vec<(vime_kernels::AttentionBackend, &'static str)> {
    let mut v = vec![(vime_kernels::AttentionBackend::Flash, "flash")];
    if cfg!(feature = "cudnn") {
        v.push((vime_kernels::AttentionBackend::Fused, "cudnn"));
    }
    v
}
type Op<'a> = &'a dyn Fn(&[Tensor]) -> Result<Tensor>;

fn check(name: &str, op: Op, inputs_cpu: &[Tensor], gpu: &Device, failures: &mut Vec<String>) -> Result<()> {
    let inputs_gpu: Vec<Tensor> = inputs_cpu.iter().map(|t| t.to_device(gpu)).collect::<Result<_>>()?;
    let obj = |x: &[Tensor]| weighted_sum(&op(x)?.to_dtype(DType::F32)?, 7);
    let (y_cpu, g_cpu) = (op(inputs_cpu)?, autograd_grads(&obj, inputs_cpu)?);
    let y_gpu = op(&inputs_gpu)?;
    let g_gpu = autograd_grads(&obj, &inputs_gpu)?;
    let fwd = rel_err(&y_gpu.to_device(&Device::Cpu)?, &y_cpu)?;
    let mut errs = vec![fwd];
    for (a, b) in g_gpu.iter().zip(&g_cpu) {
        errs.push(rel_err(&a.to_device(&Device::Cpu)?, b)?);
    }
    let worst = errs.iter().cloned().fold(0.0, f64::max);
    let shapes: Vec<String> = inputs_cpu.iter().map(|t| format!("{:?}", t.dims())).collect();
    println!(
        "{name:<26} {:<52} fwd {:.1e} grads [{}]  {}",
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

    // Qwen3-4B at TP = 2 (tensor parallelism): each rank's shard has 16 query / 4 KV heads and
    // intermediate 4864; the norms' and the rope's shapes follow the local heads.
    let qn = rng.randn(&[t, 16, 128], 1.0, bf, &Device::Cpu)?;
    let wn = (rng.randn(&[128], 0.1, DType::F32, &Device::Cpu)? + 1.0)?.to_dtype(bf)?;
    check(
        "rms_norm (q_norm, TP 2 shard)",
        &|a| vime_kernels::rms_norm(&a[0], &a[1], 1e-6),
        &[qn, wn],
        &gpu,
        &mut failures,
    )?;
    let q = rng.randn(&[t, 16, 128], 1.0, bf, &Device::Cpu)?;
    let p = pos.clone();
    check(
        "rope (TP 2 shard)",
        &|a| vime_kernels::rope(&a[0], &p, 1e6),
        &[q],
        &gpu,
        &mut failures,
    )?;
    let g = rng.randn(&[t, 4864], 2.0, bf, &Device::Cpu)?;
    let u = rng.randn(&[t, 4864], 1.0, bf, &Device::Cpu)?;
    check(
        "swiglu (TP 2 shard)",
        &|a| vime_kernels::swiglu(&a[0], &a[1]),
        &[g, u],
        &gpu,
        &mut failures,
    )?;

    let scale = 1.0 / (128f64).sqrt();
    let mut checks = 15;
    for (backend, tag) in attention_backends() {
        check_attention(
            tag,
            &kernels(backend, false)?,
            &cu,
            scale,
            &gpu,
            &mut rng,
            &mut failures,
        )?;
        checks += 6;
    }
    #[cfg(feature = "cudnn")]
    check_cudnn_determinism(&gpu, &mut rng, &mut failures)?;
    #[cfg(feature = "cudnn")]
    {
        check_cudnn_unfilled_outputs(&gpu, &mut rng, &mut failures)?;
        checks += 1;
    }

    let th = 256usize;
    let h = rng.randn(&[th, 2560], 1.0, bf, &Device::Cpu)?;
    let lm = rng.randn(&[151936, 2560], 0.02, bf, &Device::Cpu)?;
    let mut targets: Vec<u32> = (0..th).map(|_| (rng.next_u64() % 151936) as u32).collect();
    targets[th - 1] = vime_kernels::IGNORE_TARGET;
    let targets: Arc<[u32]> = targets.into();
    // The LM head against the CPU: log-probs and entropy, and their gradients.
    let head = |name: &str, h: Tensor, lm: Tensor, tg: &Arc<[u32]>, chunk: usize, failures: &mut Vec<String>| {
        let op = |a: &[Tensor]| -> Result<Tensor> {
            let (lp, ent) = vime_kernels::logprobs_entropy(&a[0], &a[1], tg, chunk)?;
            Tensor::cat(&[lp, ent], 0)
        };
        check(name, &op, &[h, lm], &gpu, failures)
    };
    head("logprobs_entropy", h, lm, &targets, 64, &mut failures)?;
    // The LM head with every token in one chunk (dW written directly; the case above accumulates
    // over token chunks).
    let h = rng.randn(&[th, 2560], 1.0, bf, &Device::Cpu)?;
    let lm = rng.randn(&[151936, 2560], 0.02, bf, &Device::Cpu)?;
    head("logprobs_entropy (1 chunk)", h, lm, &targets, 4096, &mut failures)?;
    // A vocabulary that is no multiple of 4 (30001 = 16384 + 13617): the second chunk's rows are
    // not 16-byte aligned, so the head's kernels take their scalar loops there.
    let h = rng.randn(&[th, 256], 1.0, bf, &Device::Cpu)?;
    let lm = rng.randn(&[30001, 256], 0.05, bf, &Device::Cpu)?;
    let odd: Arc<[u32]> = targets
        .iter()
        .map(|&t| if t == vime_kernels::IGNORE_TARGET { t } else { t % 30001 })
        .collect();
    head("logprobs_entropy (odd V)", h, lm, &odd, 100, &mut failures)?;

    check_adamw(&gpu, &mut rng, &mut failures)?;
    check_adamw_multi(&gpu, &mut rng, &mut failures)?;
    check_widen_into_sums(&gpu, &mut rng, &mut failures)?;
    check_sum_squares(&gpu, &mut rng, &mut failures)?;
    check_embedding_backward(&gpu, &mut rng, &mut failures)?;
    check_index_add_rows(&gpu, &mut rng, &mut failures)?;
    check_gather_rows(&gpu, &mut rng, &mut failures)?;
    check_lm_head_into(&gpu, &mut rng, &mut failures)?;
    check_lm_head_bf16_logits(&gpu, &mut rng, &mut failures)?;
    check_weight_grad_into(&gpu, &mut rng, &mut failures)?;
    check_residual_norms(&gpu, &mut rng, &mut failures)?;
    check_qk_norm_rope_backward(&gpu, &mut rng, &mut failures)?;
    check_fp8(&gpu, &mut rng, &mut failures)?;
    check_fp8_delayed(&gpu, &mut rng, &mut failures)?;
    checks += 12;

    println!(
        "CHECK_KERNELS VERDICT: {} ({} checks vs the CPU kernels, bf16, rel err bound {TOL:e}; AdamW bit-exact)",
        if failures.is_empty() { "PASS" } else { "FAIL" },
        checks
    );
    assert!(failures.is_empty(), "{failures:?}");
    Ok(())
}

/// The attention checks on one backend (`tag` names it in the output): packed causal sequences at
/// Qwen3-4B's GQA (32 / 8) and its TP = 2 shard (16 / 4), Lk > Lq with lengths off the kernels' tiles and an empty query
/// sequence, and Qwen3-0.6B's GQA (16 / 8) on one long sequence.
fn check_attention(
    tag: &str,
    kc: &vime_kernels::KernelConfig,
    cu: &Arc<[u32]>,
    scale: f64,
    gpu: &Device,
    rng: &mut Rng,
    failures: &mut Vec<String>,
) -> Result<()> {
    let bf = DType::BF16;
    let t = *cu.last().unwrap() as usize;
    let q = rng.randn(&[t, 32, 128], 1.0, bf, &Device::Cpu)?;
    let k = rng.randn(&[t, 8, 128], 1.0, bf, &Device::Cpu)?;
    let v = rng.randn(&[t, 8, 128], 1.0, bf, &Device::Cpu)?;
    let c = cu.clone();
    check(
        &format!("varlen_attention [{tag}]"),
        &|a| vime_kernels::varlen_attention(&a[0], &a[1], &a[2], &c, &c, scale, kc),
        &[q, k, v],
        gpu,
        failures,
    )?;
    // Attention with Lk > Lq (a KV-cache prefill continuation and one-token decoding), lengths
    // that are not multiples of the kernel's tiles, and an empty query sequence.
    let (lq, lk) = ([1u32, 100, 37, 0, 257], [300u32, 100, 200, 3, 257]);
    let cum = |l: &[u32]| -> Arc<[u32]> {
        let mut c = vec![0u32];
        for &x in l {
            c.push(c.last().unwrap() + x);
        }
        c.into()
    };
    let (cq, ck) = (cum(&lq), cum(&lk));
    let (tq, tk) = (*cq.last().unwrap() as usize, *ck.last().unwrap() as usize);
    let q = rng.randn(&[tq, 32, 128], 1.0, bf, &Device::Cpu)?;
    let k = rng.randn(&[tk, 8, 128], 1.0, bf, &Device::Cpu)?;
    let v = rng.randn(&[tk, 8, 128], 1.0, bf, &Device::Cpu)?;
    check(
        &format!("varlen_attention Lk>Lq [{tag}]"),
        &|a| vime_kernels::varlen_attention(&a[0], &a[1], &a[2], &cq, &ck, scale, kc),
        &[q, k, v],
        gpu,
        failures,
    )?;
    // Two sequences of one length (cuDNN's dense layout).
    let c2: Arc<[u32]> = vec![0u32, 640, 1280].into();
    let q = rng.randn(&[1280, 32, 128], 1.0, bf, &Device::Cpu)?;
    let k = rng.randn(&[1280, 8, 128], 1.0, bf, &Device::Cpu)?;
    let v = rng.randn(&[1280, 8, 128], 1.0, bf, &Device::Cpu)?;
    check(
        &format!("varlen_attention 2x640 [{tag}]"),
        &|a| vime_kernels::varlen_attention(&a[0], &a[1], &a[2], &c2, &c2, scale, kc),
        &[q, k, v],
        gpu,
        failures,
    )?;
    // Context parallelism's zigzag layout (CP 2, one 2048-token sequence, chunks of 512): rank 0's
    // query chunks 0 and 3 against their prefixes of 512 and 2048 keys.
    let (cq, ck): (Arc<[u32]>, Arc<[u32]>) = (vec![0u32, 512, 1024].into(), vec![0u32, 512, 2560].into());
    let q = rng.randn(&[1024, 32, 128], 1.0, bf, &Device::Cpu)?;
    let k = rng.randn(&[2560, 8, 128], 1.0, bf, &Device::Cpu)?;
    let v = rng.randn(&[2560, 8, 128], 1.0, bf, &Device::Cpu)?;
    check(
        &format!("varlen_attention CP 2 chunks [{tag}]"),
        &|a| vime_kernels::varlen_attention(&a[0], &a[1], &a[2], &cq, &ck, scale, kc),
        &[q, k, v],
        gpu,
        failures,
    )?;
    // Qwen3-4B's TP = 2 shard (16 / 4 heads) on the packed batch.
    let q = rng.randn(&[t, 16, 128], 1.0, bf, &Device::Cpu)?;
    let k = rng.randn(&[t, 4, 128], 1.0, bf, &Device::Cpu)?;
    let v = rng.randn(&[t, 4, 128], 1.0, bf, &Device::Cpu)?;
    let c = cu.clone();
    check(
        &format!("varlen_attention 16/4 TP 2 shard [{tag}]"),
        &|a| vime_kernels::varlen_attention(&a[0], &a[1], &a[2], &c, &c, scale, kc),
        &[q, k, v],
        gpu,
        failures,
    )?;
    // Qwen3-0.6B's GQA ratio (16 / 8) on one long sequence.
    let c1: Arc<[u32]> = vec![0u32, 1500].into();
    let q = rng.randn(&[1500, 16, 128], 1.0, bf, &Device::Cpu)?;
    let k = rng.randn(&[1500, 8, 128], 1.0, bf, &Device::Cpu)?;
    let v = rng.randn(&[1500, 8, 128], 1.0, bf, &Device::Cpu)?;
    check(
        &format!("varlen_attention 16/8 [{tag}]"),
        &|a| vime_kernels::varlen_attention(&a[0], &a[1], &a[2], &c1, &c1, scale, kc),
        &[q, k, v],
        gpu,
        failures,
    )?;

    Ok(())
}

/// cuDNN's attention backward with `--deterministic-mode`: two runs on the same inputs agree
/// bit for bit (the default, atomics-based dQ need not, and its difference is printed).
#[cfg(feature = "cudnn")]
fn check_cudnn_determinism(gpu: &Device, rng: &mut Rng, failures: &mut Vec<String>) -> Result<()> {
    let bf = DType::BF16;
    let cu: Arc<[u32]> = vec![0u32, 4096, 8192].into();
    let q = rng.randn(&[8192, 32, 128], 1.0, bf, gpu)?;
    let k = rng.randn(&[8192, 8, 128], 1.0, bf, gpu)?;
    let v = rng.randn(&[8192, 8, 128], 1.0, bf, gpu)?;
    let dout = rng.randn(&[8192, 32, 128], 1.0, bf, gpu)?;
    let grads = |kc: &vime_kernels::KernelConfig| -> Result<Vec<f32>> {
        let (o, saved) = vime_kernels::varlen_attention_saved(&q, &k, &v, &cu, &cu, 1.0 / (128f64).sqrt(), kc)?;
        let (dq, dk, dv) = vime_kernels::varlen_attention_backward(&saved, &q, &k, &v, &o, &dout)?;
        let all = Tensor::cat(&[dq.flatten_all()?, dk.flatten_all()?, dv.flatten_all()?], 0)?;
        all.to_dtype(DType::F32)?.to_vec1::<f32>()
    };
    let max_diff = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    for det in [false, true] {
        let kc = kernels(vime_kernels::AttentionBackend::Fused, det)?;
        let (a, b) = (grads(&kc)?, grads(&kc)?);
        let d = max_diff(&a, &b);
        println!("cudnn attention backward, deterministic {det}: max |run1 - run2| = {d:e}");
        if det && d != 0.0 {
            failures.push(format!("cudnn deterministic backward differs between runs by {d:e}"));
        }
    }
    Ok(())
}

/// cuDNN's attention writes every element of the buffers it gets unfilled (O and the statistics
/// forward, dQ/dK/dV backward, on a plan whose sequences cover every row): after freeing buffers
/// of NaN of the sizes the calls allocate (which the device's stream-ordered memory pool is likely,
/// not certain, to hand back to them), a deterministic forward and backward give the bits of a run
/// on clean memory, on the dense and on the ragged layout. A row cuDNN left unwritten would show
/// as NaN or as another run's stale values.
#[cfg(feature = "cudnn")]
fn check_cudnn_unfilled_outputs(gpu: &Device, rng: &mut Rng, failures: &mut Vec<String>) -> Result<()> {
    let bf = DType::BF16;
    let kc = kernels(vime_kernels::AttentionBackend::Fused, true)?;
    for (layout, cu) in [
        ("dense", vec![0u32, 1024, 2048]),
        ("ragged", vec![0u32, 700, 1500, 2048]),
    ] {
        let cu: Arc<[u32]> = cu.into();
        let t = 2048;
        let q = rng.randn(&[t, 16, 128], 1.0, bf, gpu)?;
        let k = rng.randn(&[t, 8, 128], 1.0, bf, gpu)?;
        let v = rng.randn(&[t, 8, 128], 1.0, bf, gpu)?;
        let dout = rng.randn(&[t, 16, 128], 1.0, bf, gpu)?;
        let run = || -> Result<Vec<f32>> {
            let (o, saved) = vime_kernels::varlen_attention_saved(&q, &k, &v, &cu, &cu, 1.0 / (128f64).sqrt(), &kc)?;
            let (dq, dk, dv) = vime_kernels::varlen_attention_backward(&saved, &q, &k, &v, &o, &dout)?;
            let parts = [
                o.flatten_all()?,
                dq.flatten_all()?,
                dk.flatten_all()?,
                dv.flatten_all()?,
            ];
            Tensor::cat(&parts, 0)?.to_dtype(DType::F32)?.to_vec1::<f32>()
        };
        let clean = run()?;
        // NaN in freed buffers of the sizes the calls allocate: O (t x 16 x 128 bf16), the
        // statistics (16 x t f32), the packed dQ/dK/dV (t x 32 x 128 bf16).
        for n in [t * 16 * 128, t * 32 * 128] {
            drop(Tensor::full(f32::NAN, n, gpu)?.to_dtype(bf)?);
        }
        drop(Tensor::full(f32::NAN, 16 * t, gpu)?);
        let dirty = run()?;
        let bad = dirty.iter().filter(|x| !x.is_finite()).count();
        let same = clean.iter().zip(&dirty).all(|(a, b)| a.to_bits() == b.to_bits());
        println!("cudnn attention on unfilled buffers [{layout}]: {bad} non-finite, bits equal to a clean run: {same}");
        if bad > 0 || !same {
            failures.push(format!(
                "cudnn attention [{layout}] on unfilled buffers: {bad} non-finite values, bits equal: {same}"
            ));
        }
    }
    Ok(())
}

/// The CPU AdamW update of trainer/src/optim/adamw.rs, op for op (candle's `affine` rounds its
/// f64 constants to f32 as the kernel's host side does).
#[allow(clippy::too_many_arguments)]
fn adamw_cpu(
    p: &Tensor,
    g: &Tensor,
    m: &Tensor,
    v: &Tensor,
    lr: f64,
    wd: f64,
    b1: f64,
    b2: f64,
    eps: f64,
    t: u64,
) -> Result<(Tensor, Tensor, Tensor)> {
    let bc1 = 1.0 - b1.powf(t as f64);
    let bc2 = (1.0 - b2.powf(t as f64)).sqrt();
    let step = lr / bc1;
    let p = p.affine(1.0 - lr * wd, 0.0)?;
    let m = ((g - m)?.affine(1.0 - b1, 0.0)? + m)?;
    let v = (v.affine(b2, 0.0)? + (g.affine(1.0 - b2, 0.0)? * g)?)?;
    let denom = (v.sqrt()? / bc2)?.affine(1.0, eps)?;
    let p = ((m.affine(-step, 0.0)? / denom)? + p)?;
    Ok((p, m, v))
}

/// AdamW on CUDA against the CPU path, bit for bit: a length the 16-byte kernel takes (n % 4 == 0)
/// and one only the element kernel does.
fn check_adamw(gpu: &Device, rng: &mut Rng, failures: &mut Vec<String>) -> Result<()> {
    for n in [1usize << 20, (1 << 20) + 3] {
        check_adamw_n(gpu, rng, failures, n)?;
    }
    Ok(())
}

/// The AdamW checks' hyper-parameters: (lr, weight decay, beta1, beta2, eps).
const ADAMW_HP: (f64, f64, f64, f64, f64) = (3e-4, 0.1, 0.9, 0.98, 1e-8);

/// The fused kernel's constants of step `t` (1-based) under [`ADAMW_HP`]; step 2 folds a clipping
/// coefficient of 0.37 in (the CPU side scales the gradient first).
fn adam_consts_at(t: u64, decay: bool) -> vime_kernels::cuda::AdamConsts {
    let (lr, wd, b1, b2, eps) = ADAMW_HP;
    let bc1 = 1.0 - b1.powf(t as f64);
    let bc2 = (1.0 - b2.powf(t as f64)).sqrt();
    vime_kernels::cuda::AdamConsts {
        keep: (1.0 - lr * wd) as f32,
        one_m_b1: (1.0 - b1) as f32,
        b2: b2 as f32,
        one_m_b2: (1.0 - b2) as f32,
        inv_bc2: (1.0 / bc2) as f32,
        eps: eps as f32,
        neg_step: (-(lr / bc1)) as f32,
        decay: decay as i32,
        grad_scale: 0.37,
        scale: (t == 2) as i32,
    }
}

fn check_adamw_n(gpu: &Device, rng: &mut Rng, failures: &mut Vec<String>, n: usize) -> Result<()> {
    let f32t = |rng: &mut Rng, s: f64| rng.randn(&[n], s, DType::F32, &Device::Cpu);
    let (mut p, mut m) = (f32t(rng, 1.0)?, f32t(rng, 1e-3)?);
    let mut v = f32t(rng, 1e-3)?.abs()?;
    let (pg, mg, vg) = (p.to_device(gpu)?, m.to_device(gpu)?, v.to_device(gpu)?);
    let model = pg.to_dtype(DType::BF16)?;
    let (lr, wd, b1, b2, eps) = ADAMW_HP;
    for t in 1..=3u64 {
        let g = f32t(rng, 1e-2)?;
        // Step 2 folds a clipping coefficient in; the CPU side scales the gradient first.
        let c = adam_consts_at(t, true);
        vime_kernels::cuda::adamw_update(&pg, &g.to_device(gpu)?, &mg, &vg, Some(&model), c)?;
        let g = if t == 2 { g.affine(0.37f32 as f64, 0.0)? } else { g };
        (p, m, v) = adamw_cpu(&p, &g, &m, &v, lr, wd, b1, b2, eps, t)?;
    }
    let mut worst = 0f32;
    for (cpu, cuda) in [(&p, &pg), (&m, &mg), (&v, &vg)] {
        let d = (cpu - cuda.to_device(&Device::Cpu)?)?
            .abs()?
            .max(0)?
            .to_scalar::<f32>()?;
        worst = worst.max(d);
    }
    let model_err = (model.to_device(&Device::Cpu)?.to_dtype(DType::F32)?
        - p.to_dtype(DType::BF16)?.to_dtype(DType::F32)?)?
    .abs()?
    .max(0)?
    .to_scalar::<f32>()?;
    println!(
        "{:<26} {:<52} max |cpu - cuda| over p, m, v after 3 steps {worst:e}, bf16 model copy {model_err:e}  {}",
        "adamw",
        format!("[{n}] f32"),
        if worst == 0.0 && model_err == 0.0 { "ok" } else { "FAIL" }
    );
    if worst != 0.0 || model_err != 0.0 {
        failures.push(format!("adamw: max abs diff {worst:e}, model copy {model_err:e}"));
    }
    Ok(())
}

/// The one-launch AdamW of many tensors against one `adamw_update` launch each (itself checked
/// bit for bit against the CPU above), bit for bit over three steps: tensors of many chunks and of
/// one, lengths the 16-byte path takes and ones it does not, a view at an odd offset (scalar path),
/// f32 and bf16 gradients, with and without decay and a model copy.
fn check_adamw_multi(gpu: &Device, rng: &mut Rng, failures: &mut Vec<String>) -> Result<()> {
    use vime_kernels::cuda::{adamw_update, adamw_update_multi, AdamwTensor};
    // (length, bf16 gradient, decay, model copy, offset into a larger buffer)
    let cases = [
        (1usize << 20, false, true, true, 0usize),
        ((1 << 20) + 3, false, false, true, 0),
        (5, true, true, false, 0),
        (4096, false, true, true, 0),
        (4097, true, false, true, 0),
        (12288, true, true, true, 0),
        (10000, false, true, true, 1),
        (1, false, false, false, 0),
    ];
    let f32t = |rng: &mut Rng, n: usize, s: f64| rng.randn(&[n], s, DType::F32, gpu);
    struct T {
        p: Tensor,
        m: Tensor,
        v: Tensor,
        model: Option<Tensor>,
    }
    let make = |rng: &mut Rng, n: usize, off: usize, model: bool| -> Result<(T, T)> {
        let p = f32t(rng, n + off, 1.0)?.narrow(0, off, n)?;
        let m = f32t(rng, n + off, 1e-3)?.narrow(0, off, n)?;
        let v = f32t(rng, n + off, 1e-3)?.abs()?.narrow(0, off, n)?;
        let md = if model { Some(p.to_dtype(DType::BF16)?) } else { None };
        let copy = |t: &Tensor| t.copy();
        let b = T {
            p: copy(&p)?,
            m: copy(&m)?,
            v: copy(&v)?,
            model: md.as_ref().map(copy).transpose()?,
        };
        Ok((T { p, m, v, model: md }, b))
    };
    let mut one = Vec::new();
    let mut multi = Vec::new();
    for &(n, _, _, model, off) in &cases {
        let (a, b) = make(rng, n, off, model)?;
        one.push(a);
        multi.push(b);
    }
    // The offset case must really be a view (the copies above made it contiguous from 0 again).
    let (n6, off6) = (cases[6].0, cases[6].4);
    multi[6].p = Tensor::cat(&[&f32t(rng, off6, 1.0)?, &multi[6].p], 0)?.narrow(0, off6, n6)?;
    multi[6].m = Tensor::cat(&[&f32t(rng, off6, 1.0)?, &multi[6].m], 0)?.narrow(0, off6, n6)?;
    multi[6].v = Tensor::cat(&[&f32t(rng, off6, 1.0)?, &multi[6].v], 0)?.narrow(0, off6, n6)?;
    // Kept across the steps, as the optimizer keeps it; before step 3 one tensor's moments are
    // replaced by copies (new buffers, as a loaded state brings), which its row must notice.
    let mut table = vime_kernels::cuda::AdamwTable::default();
    for t in 1..=3u64 {
        if t == 3 {
            multi[0].m = multi[0].m.copy()?;
            multi[0].v = multi[0].v.copy()?;
        }
        let consts = |decay: bool| adam_consts_at(t, decay);
        let grads: Vec<Tensor> = cases
            .iter()
            .map(|&(n, bf, ..)| {
                let g = f32t(rng, n, 1e-2)?;
                Ok(if bf { g.to_dtype(DType::BF16)? } else { g })
            })
            .collect::<Result<_>>()?;
        for ((a, g), &(_, _, decay, ..)) in one.iter().zip(&grads).zip(&cases) {
            adamw_update(&a.p, g, &a.m, &a.v, a.model.as_ref(), consts(decay))?;
        }
        let names: Vec<String> = (0..cases.len()).map(|i| format!("t{i}")).collect();
        let ts: Vec<AdamwTensor<'_>> = multi
            .iter()
            .zip(&grads)
            .zip(&cases)
            .zip(&names)
            .map(|(((b, g), &(_, _, decay, ..)), name)| AdamwTensor {
                name,
                master: &b.p,
                grad: g,
                exp_avg: &b.m,
                exp_avg_sq: &b.v,
                model: b.model.as_ref(),
                decay,
            })
            .collect();
        adamw_update_multi(&ts, consts(true), &mut table)?;
    }
    let bits = |t: &Tensor| -> Result<Vec<u32>> {
        Ok(t.to_dtype(DType::F32)?
            .to_device(&Device::Cpu)?
            .to_vec1::<f32>()?
            .iter()
            .map(|x| x.to_bits())
            .collect())
    };
    let mut differ = Vec::new();
    for (i, (a, b)) in one.iter().zip(&multi).enumerate() {
        let mut same = bits(&a.p)? == bits(&b.p)? && bits(&a.m)? == bits(&b.m)? && bits(&a.v)? == bits(&b.v)?;
        if let (Some(x), Some(y)) = (&a.model, &b.model) {
            same &= bits(x)? == bits(y)?;
        }
        if !same {
            differ.push(format!("{:?}", cases[i]));
        }
    }
    println!(
        "{:<26} {:<52} tensors whose p, m, v or model copy differ from one launch each: {}  {}",
        "adamw (one launch)",
        format!("{} tensors, 3 steps, a state replaced", cases.len()),
        differ.len(),
        if differ.is_empty() { "ok" } else { "FAIL" }
    );
    if !differ.is_empty() {
        failures.push(format!("adamw one launch differs for {}", differ.join(", ")));
    }
    Ok(())
}

/// Median wall time of `f` over `iters` runs after 2 warm-ups, CUDA-synchronised, in ms.
fn median_ms(gpu: &Device, iters: usize, f: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..2 {
        f()?;
    }
    gpu.synchronize()?;
    let mut ts = Vec::with_capacity(iters);
    for _ in 0..iters {
        let t = Instant::now();
        f()?;
        gpu.synchronize()?;
        ts.push(t.elapsed().as_secs_f64() * 1e3);
    }
    ts.sort_by(|a, b| a.partial_cmp(b).unwrap());
    Ok(ts[iters / 2])
}

/// Forward and forward+backward (objective `sum(y * w)` with fixed `w`, whose own backward is a
/// few elementwise passes, on both sides of the comparison) of `op`.
fn time_op(name: &str, shape: &str, gpu: &Device, op: Op, inputs: &[Tensor]) -> Result<()> {
    let vars: Vec<Var> = inputs.iter().map(Var::from_tensor).collect::<Result<_>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = op(&ts)?;
    let w = Rng::new(3).randn(y.dims(), 1.0, DType::F32, gpu)?;
    let fwd = median_ms(gpu, 20, &mut || op(&ts).map(|_| ()))?;
    let both = median_ms(gpu, 20, &mut || {
        let y = op(&ts)?;
        // Reduce the last dim first: candle's sum_all reduces a whole tensor in one CUDA block
        // (milliseconds at these sizes), which would swamp the kernels being timed.
        let d = *y.dims().last().unwrap_or(&1);
        let _g = (y.to_dtype(DType::F32)? * &w)?
            .reshape(((), d))?
            .sum(1)?
            .sum_all()?
            .backward()?;
        Ok(())
    })?;
    // The objective's own cost: the same objective and backward through a trivial op (x * 1)
    // with an output of the same shape and dtype; `fwdbwd - objective` is the op's own time.
    let z = Var::from_tensor(&y.zeros_like()?)?;
    let base = median_ms(gpu, 20, &mut || {
        let y = z.as_tensor().affine(1.0, 0.0)?;
        let d = *y.dims().last().unwrap_or(&1);
        let _g = (y.to_dtype(DType::F32)? * &w)?
            .reshape(((), d))?
            .sum(1)?
            .sum_all()?
            .backward()?;
        Ok(())
    })?;
    println!("TIME {name} {shape} fwd_ms {fwd:.4} fwdbwd_ms {both:.4} objective_ms {base:.4}");
    Ok(())
}

#[test]
fn timings_at_qwen3_4b_shapes() -> Result<()> {
    let gpu = Device::new_cuda(0)?;
    let bf = DType::BF16;
    let mut rng = Rng::new(7);
    let t = 4096usize;
    let pos: Arc<[u32]> = (0..t as u32).collect::<Vec<_>>().into();
    let x = rng.randn(&[t, 2560], 1.0, bf, &gpu)?;
    let w = (rng.randn(&[2560], 0.1, DType::F32, &gpu)? + 1.0)?.to_dtype(bf)?;
    time_op(
        "rms_norm",
        "4096x2560",
        &gpu,
        &|a| vime_kernels::rms_norm(&a[0], &a[1], 1e-6),
        &[x, w],
    )?;
    let q = rng.randn(&[t, 32, 128], 1.0, bf, &gpu)?;
    let wn = (rng.randn(&[128], 0.1, DType::F32, &gpu)? + 1.0)?.to_dtype(bf)?;
    time_op(
        "rms_norm",
        "4096x32x128",
        &gpu,
        &|a| vime_kernels::rms_norm(&a[0], &a[1], 1e-6),
        &[q.clone(), wn],
    )?;
    let p = pos.clone();
    time_op(
        "rope",
        "4096x32x128",
        &gpu,
        &|a| vime_kernels::rope(&a[0], &p, 1e6),
        &[q],
    )?;
    let g = rng.randn(&[t, 9728], 2.0, bf, &gpu)?;
    let u = rng.randn(&[t, 9728], 1.0, bf, &gpu)?;
    time_op(
        "swiglu",
        "4096x9728",
        &gpu,
        &|a| vime_kernels::swiglu(&a[0], &a[1]),
        &[g, u],
    )?;
    // Context parallelism's key-gradient scatter (Qwen3-4B CP 2, one K or V of one layer):
    // candle's index_add against vime's index_add_rows.
    let index = cp2_key_index();
    let src = rng.randn(&[index.len(), 8, 128], 1.0, bf, &gpu)?;
    let ids = Tensor::new(index.as_slice(), &gpu)?;
    let candle_ms = median_ms(&gpu, 5, &mut || {
        Tensor::zeros((8192, 8, 128), bf, &gpu)?
            .index_add(&ids, &src, 0)
            .map(|_| ())
    })?;
    let vime_ms = median_ms(&gpu, 20, &mut || {
        vime_kernels::rows::index_add_rows(&src, &index, 8192).map(|_| ())
    })?;
    println!("TIME cp_key_grad_scatter 10240x8x128_to_8192 candle_index_add_ms {candle_ms:.4} index_add_rows_ms {vime_ms:.4}");
    // Row gathers: candle's index_select against vime's gather_rows, at the Qwen3-4B embedding
    // lookup (8192 ids of 151,936 rows of 2560), CP 2's key gather (one K or V of one layer) and
    // a built-in-engine prefill's cached keys (32k rows of 8 x 128).
    let embed = rng.randn(&[151_936, 2560], 0.02, bf, &gpu)?;
    let ids: Vec<u32> = (0..8192u32).map(|i| (i * 7919) % 151_936).collect();
    let keys = rng.randn(&[16_384, 8, 128], 1.0, bf, &gpu)?;
    let pool_rows: Vec<u32> = (0..32_768u32).map(|i| (i * 40_503) % 65_536).collect();
    let pool = rng.randn(&[65_536, 1024], 1.0, bf, &gpu)?;
    for (what, src, index) in [
        ("embedding_4b 8192_of_151936x2560", &embed, ids),
        ("cp2_keys 10240_of_16384x8x128", &keys, cp2_key_index()),
        ("engine_prefill 32768_of_65536x1024", &pool, pool_rows),
    ] {
        let dev_index = Tensor::new(index.as_slice(), &gpu)?;
        let candle_ms = median_ms(&gpu, 20, &mut || src.index_select(&dev_index, 0).map(|_| ()))?;
        let vime_ms = median_ms(&gpu, 20, &mut || {
            vime_kernels::rows::gather_rows(src, &index).map(|_| ())
        })?;
        // Wall time a call, each followed by a device sync (as every TIME line here).
        println!("TIME gather_rows {what} candle_index_select_ms {candle_ms:.4} gather_rows_ms {vime_ms:.4}");
    }
    // (uneven: 3000 + 1096 tokens, the ragged layout on cuDNN)
    for (seqs, len) in [(1usize, 4096usize), (2, 2048), (1, 8192), (2, 0)] {
        let cu: Arc<[u32]> = if len == 0 {
            vec![0u32, 3000, 4096].into()
        } else {
            (0..=seqs as u32).map(|s| s * len as u32).collect::<Vec<_>>().into()
        };
        let tt = *cu.last().unwrap() as usize;
        let len_tag = if len == 0 {
            "3000+1096".to_string()
        } else {
            format!("{seqs}x{len}")
        };
        let q = rng.randn(&[tt, 32, 128], 1.0, bf, &gpu)?;
        let k = rng.randn(&[tt, 8, 128], 1.0, bf, &gpu)?;
        let v = rng.randn(&[tt, 8, 128], 1.0, bf, &gpu)?;
        let scale = 1.0 / (128f64).sqrt();
        for (backend, tag) in attention_backends() {
            let kc = kernels(backend, false)?;
            let c = cu.clone();
            time_op(
                &format!("attention[{tag}]"),
                &format!("{len_tag}_h32_kv8_d128"),
                &gpu,
                &|a| vime_kernels::varlen_attention(&a[0], &a[1], &a[2], &c, &c, scale, &kc),
                &[q.clone(), k.clone(), v.clone()],
            )?;
        }
    }
    let h = rng.randn(&[t, 2560], 1.0, bf, &gpu)?;
    let lm = rng.randn(&[151936, 2560], 0.02, bf, &gpu)?;
    let targets: Arc<[u32]> = (0..t)
        .map(|_| (rng.next_u64() % 151936) as u32)
        .collect::<Vec<_>>()
        .into();
    time_op(
        "lm_head_logprob_entropy",
        "4096x2560_v151936",
        &gpu,
        &|a| {
            let (lp, ent) = vime_kernels::logprobs_entropy(&a[0], &a[1], &targets, 4096)?;
            Tensor::cat(&[lp, ent], 0)
        },
        &[h, lm],
    )?;
    // AdamW over a flat buffer of 2^28 f32 parameters (bf16 model copy), as torch's fused AdamW
    // is timed in torch_kernel_times.py.
    let n = 1usize << 28;
    let pbuf = Tensor::zeros(n, DType::F32, &gpu)?;
    let (m, v) = (Tensor::zeros(n, DType::F32, &gpu)?, Tensor::zeros(n, DType::F32, &gpu)?);
    let gbuf = Tensor::ones(n, DType::F32, &gpu)?.affine(1e-3, 0.0)?;
    let model = Tensor::zeros(n, bf, &gpu)?;
    let c = vime_kernels::cuda::AdamConsts {
        keep: 0.99997,
        one_m_b1: 0.1,
        b2: 0.98,
        one_m_b2: 0.02,
        inv_bc2: 1.0,
        eps: 1e-8,
        neg_step: -3e-4,
        decay: 1,
        grad_scale: 1.0,
        scale: 0,
    };
    let ms = median_ms(&gpu, 20, &mut || {
        vime_kernels::cuda::adamw_update(&pbuf, &gbuf, &m, &v, Some(&model), c)
    })?;
    println!("TIME adamw 268435456 step_ms {ms:.4}");
    Ok(())
}

/// The fused sum of squares (global gradient norm) against f64 on the host.
fn check_sum_squares(gpu: &Device, rng: &mut Rng, failures: &mut Vec<String>) -> Result<()> {
    // Two large tensors (a full grid of blocks each), an empty one, and 300 small ones of both
    // dtypes (one block each, some under one block's 256 threads): one launch finds every block's
    // tensor, and each result must be its own. The last two are views that start off a 16-byte
    // boundary (the one-element loads), the rest 16-byte loads with a tail of n % 4 or n % 8.
    let mut ts = vec![
        rng.randn(&[3_000_001], 1e-3, DType::F32, &Device::Cpu)?,
        Tensor::zeros(0, DType::F32, &Device::Cpu)?,
        rng.randn(&[2560, 129], 1.0, DType::BF16, &Device::Cpu)?,
    ];
    for i in 0..300usize {
        let dt = if i % 3 == 0 { DType::BF16 } else { DType::F32 };
        ts.push(rng.randn(&[1 + (i * 37) % 600], 1.0 + i as f64, dt, &Device::Cpu)?);
    }
    let unaligned = [
        rng.randn(&[1_000_003], 1.0, DType::F32, &Device::Cpu)?,
        rng.randn(&[700_001], 1.0, DType::BF16, &Device::Cpu)?,
    ];
    let mut on: Vec<Tensor> = ts.iter().map(|t| t.to_device(gpu)).collect::<Result<_>>()?;
    for (t, skip) in unaligned.iter().zip([1usize, 3]) {
        let n = t.elem_count() - skip;
        ts.push(t.narrow(0, skip, n)?);
        on.push(t.to_device(gpu)?.narrow(0, skip, n)?);
    }
    let got = vime_kernels::cuda::sum_squares(&on.iter().collect::<Vec<_>>())?;
    let mut worst = 0f64;
    for (t, g) in ts.iter().zip(&got) {
        let want: f64 = t.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar()?;
        worst = worst.max(if want == 0.0 { g.abs() } else { (g - want).abs() / want });
    }
    let ok = worst <= 1e-12 && got.len() == ts.len() && got[1] == 0.0;
    println!(
        "{:<26} {:<52} rel err vs host f64 {worst:.1e}  {}",
        "sum_squares",
        "[3000001] f32, [0], [2560, 129] bf16, 300 small, 2 unaligned",
        if ok { "ok" } else { "FAIL" }
    );
    if !ok {
        failures.push(format!("sum_squares: rel err {worst:e}"));
    }
    Ok(())
}

/// The residual adds (`add`, fused into the norm forward as `add_rms_norm`, into the norm backward
/// as `rms_norm_backward_add`) on CUDA against the CPU's unfused ops (candle's add, the CPU
/// RMSNorm kernels) at Qwen3-4B's hidden size and Qwen3-0.6B's (1024), every output.
fn check_residual_norms(gpu: &Device, rng: &mut Rng, failures: &mut Vec<String>) -> Result<()> {
    let bf = DType::BF16;
    for (t, d) in [(1040usize, 2560usize), (777, 1024)] {
        let x = rng.randn(&[t, d], 1.0, bf, &Device::Cpu)?;
        let r = rng.randn(&[t, d], 0.5, bf, &Device::Cpu)?;
        let g = rng.randn(&[t, d], 1.0, bf, &Device::Cpu)?;
        let w = (rng.randn(&[d], 0.1, DType::F32, &Device::Cpu)? + 1.0)?.to_dtype(bf)?;
        let on = |a: &Tensor| a.to_device(gpu);
        let back = |a: &Tensor| a.to_device(&Device::Cpu);
        let sum = (&x + &r)?;
        let want_y = vime_kernels::rms_norm(&sum, &w, 1e-6)?;
        let (s_gpu, y_gpu) = vime_kernels::add_rms_norm(&on(&x)?, &on(&r)?, &on(&w)?, 1e-6)?;
        let (wdx, wdw) = vime_kernels::rms_norm_backward(&x, &w, 1e-6, &g)?;
        let want_dx = (&r + &wdx)?;
        let (dx_gpu, dw_gpu) = vime_kernels::rms_norm_backward_add(&on(&x)?, &on(&w)?, 1e-6, &on(&g)?, &on(&r)?)?;
        let add_gpu = vime_kernels::add(&on(&x)?, &on(&r)?)?;
        let errs = [
            ("add", rel_err(&back(&add_gpu)?, &sum)?),
            ("add_rms_norm s", rel_err(&back(&s_gpu)?, &sum)?),
            ("add_rms_norm y", rel_err(&back(&y_gpu)?, &want_y)?),
            ("rms_norm_backward_add dx", rel_err(&back(&dx_gpu)?, &want_dx)?),
            ("rms_norm_backward_add dw", rel_err(&back(&dw_gpu)?, &wdw)?),
        ];
        // The add's result is exact up to the one rounding both sides do: bit-equal.
        let exact = errs[0].1 == 0.0 && errs[1].1 == 0.0;
        let worst = errs.iter().map(|e| e.1).fold(0.0, f64::max);
        let ok = exact && worst <= TOL;
        println!(
            "{:<26} {:<52} {}  {}",
            "residual adds + norms",
            format!("[{t}, {d}]"),
            errs.iter()
                .map(|(n, e)| format!("{n} {e:.1e}"))
                .collect::<Vec<_>>()
                .join(", "),
            if ok { "ok" } else { "FAIL" }
        );
        if !ok {
            failures.push(format!("residual adds + norms [{t}, {d}]: {errs:?}"));
        }
    }
    Ok(())
}

/// The q/k norms' and RoPE's backward in one kernel (`rope::qk_norm_rope_backward`, training,
/// Qwen3-4B's heads, q and k as head views of a fused q|k|v row, 1037 tokens of packed
/// sequences): dq and dk bit for bit against the GPU's separate kernels (`rope_backward`, then
/// `rms_norm_backward`), the weights' gradients within the bound of them, and all four against
/// the CPU kernels.
fn check_qk_norm_rope_backward(gpu: &Device, rng: &mut Rng, failures: &mut Vec<String>) -> Result<()> {
    let (t, hq, hk, d) = (1037usize, 32usize, 8usize, 128usize);
    let bf = DType::BF16;
    let qkv = rng.randn(&[t, hq + 2 * hk, d], 1.0, bf, &Device::Cpu)?;
    let gq = rng.randn(&[t, hq, d], 1.0, bf, &Device::Cpu)?;
    let gk = rng.randn(&[t, hk, d], 1.0, bf, &Device::Cpu)?;
    let wq = (rng.randn(&[d], 0.1, DType::F32, &Device::Cpu)? + 1.0)?.to_dtype(bf)?;
    let wk = (rng.randn(&[d], 0.1, DType::F32, &Device::Cpu)? + 1.0)?.to_dtype(bf)?;
    let pos: Arc<[u32]> = (0..t as u32).map(|i| i % 700).collect();
    let (eps, theta) = (1e-6, 1_000_000.0);
    let run = |qkv: &Tensor, gq: &Tensor, gk: &Tensor, wq: &Tensor, wk: &Tensor| {
        let (q, k) = (qkv.narrow(1, 0, hq)?, qkv.narrow(1, hq, hk)?);
        vime_kernels::rope::qk_norm_rope_backward(gq, gk, &q, &k, wq, wk, eps, &pos, theta)
    };
    let separate = |qkv: &Tensor, gq: &Tensor, gk: &Tensor, wq: &Tensor, wk: &Tensor| -> Result<[Tensor; 4]> {
        let (q, k) = (
            qkv.narrow(1, 0, hq)?.contiguous()?,
            qkv.narrow(1, hq, hk)?.contiguous()?,
        );
        let (dq, dwq) = vime_kernels::rms_norm_backward(&q, wq, eps, &vime_kernels::rope_backward(gq, &pos, theta)?)?;
        let (dk, dwk) = vime_kernels::rms_norm_backward(&k, wk, eps, &vime_kernels::rope_backward(gk, &pos, theta)?)?;
        Ok([dq, dk, dwq, dwk])
    };
    let on = |a: &Tensor| a.to_device(gpu);
    let (fq, fk, fwq, fwk) = run(&on(&qkv)?, &on(&gq)?, &on(&gk)?, &on(&wq)?, &on(&wk)?)?;
    let sep = separate(&on(&qkv)?, &on(&gq)?, &on(&gk)?, &on(&wq)?, &on(&wk)?)?;
    let cpu = separate(&qkv, &gq, &gk, &wq, &wk)?;
    let fused = [fq, fk, fwq, fwk];
    let same = max_abs_diff(&fused[0], &sep[0])?.max(max_abs_diff(&fused[1], &sep[1])?);
    let dw_vs_kernels = rel_err(&fused[2].to_device(&Device::Cpu)?, &sep[2].to_device(&Device::Cpu)?)?.max(rel_err(
        &fused[3].to_device(&Device::Cpu)?,
        &sep[3].to_device(&Device::Cpu)?,
    )?);
    let mut vs_cpu = 0f64;
    for (f, c) in fused.iter().zip(&cpu) {
        vs_cpu = vs_cpu.max(rel_err(&f.to_device(&Device::Cpu)?, c)?);
    }
    report(
        failures,
        "qk_norm_rope backward",
        &format!("q [{t}, {hq}, {d}] k [{t}, {hk}, {d}] (views) bf16"),
        &format!("max |dq,dk - 2 kernels| {same:e}, dw vs kernels {dw_vs_kernels:.1e}, vs cpu {vs_cpu:.1e}"),
        same == 0.0 && dw_vs_kernels <= TOL && vs_cpu <= TOL,
    );
    Ok(())
}

/// A weight gradient accumulated into a running f32 sum by the GEMM itself (cuBLAS beta 1, in
/// place: `weight_grad_into`) against the CPU's `sum + dy^T x` in f64, at a Qwen3-4B MLP shape
/// (down_proj, 2560 x 9728, over 1040 tokens); the sum's buffer must be the one returned (in
/// place), and a wrong-shaped sum an error naming both shapes.
fn check_weight_grad_into(gpu: &Device, rng: &mut Rng, failures: &mut Vec<String>) -> Result<()> {
    let (t, n, d) = (1040usize, 2560usize, 9728usize);
    let dy = rng.randn(&[t, n], 1.0, DType::BF16, &Device::Cpu)?;
    let x = rng.randn(&[t, d], 1.0, DType::BF16, &Device::Cpu)?;
    let sum = rng.randn(&[n, d], 30.0, DType::F32, &Device::Cpu)?;
    let want = (sum.to_dtype(DType::F64)? + dy.to_dtype(DType::F64)?.t()?.matmul(&x.to_dtype(DType::F64)?)?)?;
    let sum_gpu = sum.to_device(gpu)?;
    // A clone shares the buffer: written in place, it reads the new sum too.
    let got = vime_kernels::weight_grad_into(Some(sum_gpu.clone()), &dy.to_device(gpu)?, &x.to_device(gpu)?)?;
    let err = rel_err(&got.to_device(&Device::Cpu)?.to_dtype(DType::F64)?, &want)?;
    let in_place = rel_err(&sum_gpu.to_device(&Device::Cpu)?.to_dtype(DType::F64)?, &want)? <= 1e-5;
    let bad = vime_kernels::weight_grad_into(
        Some(Tensor::zeros((n, d + 1), DType::F32, gpu)?),
        &dy.to_device(gpu)?,
        &x.to_device(gpu)?,
    );
    let named =
        matches!(&bad, Err(e) if e.to_string().contains("[2560, 9729]") && e.to_string().contains("[2560, 9728]"));
    let ok = err <= 1e-5 && in_place && named;
    println!(
        "{:<26} {:<52} rel err vs f64 {err:.1e}, in place {in_place}, shape error {named}  {}",
        "weight_grad_into",
        "sum [2560, 9728] f32 + [1040, 2560]^T [1040, 9728]",
        if ok { "ok" } else { "FAIL" }
    );
    if !ok {
        failures.push(format!(
            "weight_grad_into: rel err {err:e}, in place {in_place}, shape error {named}"
        ));
    }
    Ok(())
}

/// The LM head's backward into a running f32 sum (`logprobs_entropy_backward_into`, the GEMMs
/// adding into the sum in place, beta 1) against the CPU kernel's backward on the same values in
/// f32: in one token chunk and in several, over a vocabulary of three chunks (the last partial);
/// with the forward's logits kept for the backward (the default) and recomputed (a cap of 0),
/// which must give the same bits.
fn check_lm_head_into(gpu: &Device, rng: &mut Rng, failures: &mut Vec<String>) -> Result<()> {
    let (t, hid, vocab) = (200usize, 2560usize, 40_000usize);
    let h = rng.randn(&[t, hid], 1.0, DType::BF16, &Device::Cpu)?;
    let lm = rng.randn(&[vocab, hid], 0.02, DType::BF16, &Device::Cpu)?;
    let targets: Arc<[u32]> = (0..t).map(|_| (rng.next_u64() % vocab as u64) as u32).collect();
    let dlp = rng.randn(&[t], 1.0, DType::F32, &Device::Cpu)?;
    let dent = rng.randn(&[t], 1.0, DType::F32, &Device::Cpu)?;
    // Small next to dW, and compared as (sum after - sum before) against dW: a wrong dW cannot
    // hide under the sum's own values.
    let sum = rng.randn(&[vocab, hid], 1e-3, DType::F32, &Device::Cpu)?;
    let (h32, lm32) = (h.to_dtype(DType::F32)?, lm.to_dtype(DType::F32)?);
    let mut worst = 0f64;
    let (mut in_place, mut same_bits) = (true, true);
    for chunk in [64usize, 4096] {
        let (_, _, saved) = vime_kernels::logprobs_entropy_saved(&h32, &lm32, &targets, chunk)?;
        let (dh_want, dw_want) = vime_kernels::logprobs_entropy_backward(&saved, &h32, &lm32, &dlp, &dent)?;
        let (hg, lmg) = (h.to_device(gpu)?, lm.to_device(gpu)?);
        // The default keeps the forward's logits for the backward; a cap of 0 computes them
        // again. The same bits either way.
        let mut runs = Vec::new();
        for cap in [None, Some(0)] {
            let kc = vime_kernels::KernelConfig::default().with_head_logits_max_bytes(cap);
            let (_, _, saved) = vime_kernels::logprobs_entropy_saved_with(&hg, &lmg, &targets, chunk, &kc)?;
            let sum_g = sum.to_device(gpu)?;
            let (dh, got) = vime_kernels::logprobs_entropy_backward_into(
                &saved,
                &hg,
                &lmg,
                &dlp.to_device(gpu)?,
                &dent.to_device(gpu)?,
                sum_g.clone(),
            )?;
            in_place &= max_abs_diff(&got, &sum_g)? == 0.0;
            runs.push((dh, got));
        }
        let (kept, again) = (&runs[0], &runs[1]);
        same_bits &= max_abs_diff(&kept.0.to_dtype(DType::F32)?, &again.0.to_dtype(DType::F32)?)? == 0.0
            && max_abs_diff(&kept.1, &again.1)? == 0.0;
        let (dh, got) = runs.swap_remove(0);
        worst = worst
            .max(rel_err(&(got.to_device(&Device::Cpu)? - &sum)?, &dw_want)?)
            .max(rel_err(&dh.to_device(&Device::Cpu)?.to_dtype(DType::F32)?, &dh_want)?);
    }
    report(
        failures,
        "logprobs_entropy into sum",
        &format!("[{t}, {hid}] x [{vocab}, {hid}] bf16 + f32 sum"),
        &format!(
            "rel err {worst:.1e} (dW sum and d_hidden, 1 and 4 chunks), in place {in_place}, kept logits = recomputed bits {same_bits}"
        ),
        worst <= TOL && in_place && same_bits,
    );
    Ok(())
}

/// `--lm-head-logits bf16` (`HeadLogits::Bf16`): the CUDA head (GEMM into bf16, the bf16 statistics
/// and dlogits kernels) against the CPU kernels with the same setting (f32 logits rounded to bf16):
/// forward and gradients through the op (the backward computing the logits again), and the
/// training head's backward into an f32 sum with its kept bf16 logits and with them recomputed
/// (the same bits). The setting must show: the GPU's log-probs are nearer the CPU's rounded ones
/// than the CPU's f32 ones (mean error at most a tenth). Vocabularies of 40,000 (the last chunk
/// 7232, whole 8-logit groups) and 30,001 (13,617: the bf16 kernels' one-at-a-time paths).
fn check_lm_head_bf16_logits(gpu: &Device, rng: &mut Rng, failures: &mut Vec<String>) -> Result<()> {
    use vime_kernels::{logprobs_entropy_backward, logprobs_entropy_saved_with, HeadLogits, KernelConfig};
    let bf = KernelConfig::default()
        .with_head_logits(HeadLogits::Bf16)
        .map_err(candle_core::Error::msg)?;
    let fp = KernelConfig::default();
    let (t, hid) = (192usize, 1024usize);
    let mut worst = 0f64;
    let (mut nearer, mut same_bits) = (true, true);
    let mut detail = Vec::new();
    for vocab in [40_000usize, 30_001] {
        let h = rng.randn(&[t, hid], 1.0, DType::BF16, &Device::Cpu)?;
        let lm = rng.randn(&[vocab, hid], 0.06, DType::BF16, &Device::Cpu)?;
        let mut tg: Vec<u32> = (0..t).map(|_| (rng.next_u64() % vocab as u64) as u32).collect();
        tg[t - 1] = vime_kernels::IGNORE_TARGET;
        let tg: Arc<[u32]> = tg.into();
        let op = |a: &[Tensor]| -> Result<Tensor> {
            let (lp, ent) = vime_kernels::logprobs_entropy_with(&a[0], &a[1], &tg, 64, &bf)?;
            Tensor::cat(&[lp, ent], 0)
        };
        check(
            &format!("logprobs_entropy (bf16 logits, V {vocab})"),
            &op,
            &[h.clone(), lm.clone()],
            gpu,
            failures,
        )?;
        // The setting shows: mean |GPU - CPU rounded| against mean |GPU - CPU f32 logits|.
        let (hg, lmg) = (h.to_device(gpu)?, lm.to_device(gpu)?);
        let (lp_g, _) = vime_kernels::logprobs_entropy_with(&hg, &lmg, &tg, 64, &bf)?;
        let (lp_c, _) = vime_kernels::logprobs_entropy_with(&h, &lm, &tg, 64, &bf)?;
        let (lp_c32, _) = vime_kernels::logprobs_entropy_with(&h, &lm, &tg, 64, &fp)?;
        let mean_err = |a: &Tensor, b: &Tensor| -> Result<f64> {
            (a.to_device(&Device::Cpu)?.to_dtype(DType::F64)? - b.to_dtype(DType::F64)?)?
                .abs()?
                .mean_all()?
                .to_scalar::<f64>()
        };
        let (e_same, e_other) = (mean_err(&lp_g, &lp_c)?, mean_err(&lp_g, &lp_c32)?);
        nearer &= e_same <= 0.1 * e_other;
        detail.push(format!(
            "V {vocab}: mean |lp - rounded| {e_same:.1e} vs |lp - f32| {e_other:.1e}"
        ));
        // The training head: into an f32 sum, kept logits (default) and recomputed (cap 0).
        let dlp = rng.randn(&[t], 1.0, DType::F32, &Device::Cpu)?;
        let dent = rng.randn(&[t], 1.0, DType::F32, &Device::Cpu)?;
        let (_, _, saved) = logprobs_entropy_saved_with(&h, &lm, &tg, 64, &bf)?;
        let (dh_want, dw_want) = logprobs_entropy_backward(&saved, &h, &lm, &dlp, &dent)?;
        let mut runs = Vec::new();
        for cap in [None, Some(0)] {
            let kc = bf.clone().with_head_logits_max_bytes(cap);
            let (_, _, saved) = logprobs_entropy_saved_with(&hg, &lmg, &tg, 64, &kc)?;
            let sum = Tensor::zeros((vocab, hid), DType::F32, gpu)?;
            runs.push(vime_kernels::logprobs_entropy_backward_into(
                &saved,
                &hg,
                &lmg,
                &dlp.to_device(gpu)?,
                &dent.to_device(gpu)?,
                sum,
            )?);
        }
        same_bits &= max_abs_diff(&runs[0].0, &runs[1].0)? == 0.0 && max_abs_diff(&runs[0].1, &runs[1].1)? == 0.0;
        let (dh, dw) = &runs[0];
        let to32 = |x: &Tensor| x.to_device(&Device::Cpu)?.to_dtype(DType::F32);
        worst = worst
            .max(rel_err(&to32(dw)?, &to32(&dw_want)?)?)
            .max(rel_err(&to32(dh)?, &to32(&dh_want)?)?);
    }
    report(
        failures,
        "lm head bf16 logits",
        &format!("[{t}, {hid}] x [40000 | 30001, {hid}] bf16"),
        &format!(
            "into sum rel err {worst:.1e}, kept = recomputed bits {same_bits}, nearer the rounded CPU head {nearer} ({})",
            detail.join("; ")
        ),
        worst <= TOL && nearer && same_bits,
    );
    Ok(())
}

/// The gathered-key index of Qwen3-4B CP 2's rank 0 (one 8192-token sequence in zigzag chunks of
/// 2048; rank 0 holds chunks 0 and 3, the all-gathered rows are in chunk order 0, 3 | 1, 2):
/// chunk 0 attends chunk 0's 2048 keys, chunk 3 all 8192.
fn cp2_key_index() -> Vec<u32> {
    let c = 2048u32;
    // all-gathered rows of global chunk g: chunk 0 -> 0, 3 -> 1, 1 -> 2, 2 -> 3 (in units of c)
    let at = [0u32, 2, 3, 1];
    let mut index: Vec<u32> = (0..c).collect();
    for g in 0..4u32 {
        index.extend((0..c).map(|i| at[g as usize] * c + i));
    }
    index
}

/// Context parallelism's key-gradient scatter at [`cp2_key_index`], 8 KV heads: `index_add_rows`
/// against candle's `index_add` on the device, bit for bit (the same bf16 adds in the same order),
/// and against the CPU; then 5 source rows into 4 with an unused destination row, from the start
/// of a buffer (the kernel) and from a view off a 16-byte boundary (candle's path).
fn check_index_add_rows(gpu: &Device, rng: &mut Rng, failures: &mut Vec<String>) -> Result<()> {
    let index = cp2_key_index();
    let n = index.len();
    let src = rng.randn(&[n, 8, 128], 1.0, DType::BF16, gpu)?;
    let got = vime_kernels::rows::index_add_rows(&src, &index, 8192)?;
    let ids = Tensor::new(index.as_slice(), gpu)?;
    let candle = Tensor::zeros((8192, 8, 128), DType::BF16, gpu)?.index_add(&ids, &src, 0)?;
    let cpu = vime_kernels::rows::index_add_rows(&src.to_device(&Device::Cpu)?, &index, 8192)?;
    let bits = |t: &Tensor| -> Result<Vec<u16>> {
        Ok(t.flatten_all()?
            .to_device(&Device::Cpu)?
            .to_vec1::<half::bf16>()?
            .iter()
            .map(|x| x.to_bits())
            .collect())
    };
    let (g, c, h) = (bits(&got)?, bits(&candle)?, bits(&cpu)?);
    let same_gpu = g == c;
    let same_cpu = g == h;
    println!("index_add_rows CP 2 [{n} -> 8192, 8, 128]: bits equal to candle's index_add on the GPU: {same_gpu}, on the CPU: {same_cpu}");
    if !same_gpu || !same_cpu || got.dims() != [8192, 8, 128] {
        failures.push(format!(
            "index_add_rows CP 2: bits equal to candle GPU {same_gpu}, CPU {same_cpu}, dims {:?}",
            got.dims()
        ));
    }
    // 5 source rows of 16 into 4 rows, row 1 unused: at the buffer's start (the kernel), and one
    // element in, off the 16-byte boundary (candle's path).
    let wide = rng.randn(&[5 * 16 + 1], 1.0, DType::BF16, gpu)?;
    let small = [3u32, 0, 3, 2, 0];
    for start in [0, 1] {
        let view = wide.narrow(0, start, 80)?.reshape((5, 16))?;
        let got = vime_kernels::rows::index_add_rows(&view, &small, 4)?;
        let ids = Tensor::new(&small, gpu)?;
        let want = Tensor::zeros((4, 16), DType::BF16, gpu)?.index_add(&ids, &view.contiguous()?, 0)?;
        if bits(&got)? != bits(&want)? {
            failures.push(format!(
                "index_add_rows (view at element {start}, an unused row) differs from index_add"
            ));
        }
    }
    Ok(())
}

/// The row gather (`rows::gather_rows`, `gather_rows_dev`) against candle's `index_select` on the
/// device, bit for bit: bf16 at CP 2's key gather ([`cp2_key_index`], 8 KV heads) with host and
/// device rows; f32 and f16 rows with repeated and descending indices; a row of 24 bytes (not a
/// whole number of 16-byte words) and a view one element off a 16-byte boundary (candle's path);
/// no rows at all; an index past the rows (an error naming it on the host, zeros from the device
/// kernel).
fn check_gather_rows(gpu: &Device, rng: &mut Rng, failures: &mut Vec<String>) -> Result<()> {
    let bits = |t: &Tensor| -> Result<Vec<u32>> {
        let t = t.flatten_all()?.to_device(&Device::Cpu)?;
        Ok(match t.dtype() {
            DType::BF16 => t.to_vec1::<half::bf16>()?.iter().map(|x| x.to_bits() as u32).collect(),
            DType::F16 => t.to_vec1::<half::f16>()?.iter().map(|x| x.to_bits() as u32).collect(),
            _ => t
                .to_dtype(DType::F32)?
                .to_vec1::<f32>()?
                .iter()
                .map(|x| x.to_bits())
                .collect(),
        })
    };
    let mut cases = 0usize;
    let mut same = |what: String, got: &Tensor, want: &Tensor, failures: &mut Vec<String>| -> Result<()> {
        cases += 1;
        if got.dims() != want.dims() || bits(got)? != bits(want)? {
            failures.push(format!(
                "gather_rows {what}: dims {:?} against index_select's {:?}, or other bits",
                got.dims(),
                want.dims()
            ));
        }
        Ok(())
    };
    let index = cp2_key_index();
    let keys = rng.randn(&[16_384, 8, 128], 1.0, DType::BF16, gpu)?;
    let ids = Tensor::new(index.as_slice(), gpu)?;
    let want = keys.index_select(&ids, 0)?;
    same(
        "CP 2 keys (host rows)".into(),
        &vime_kernels::rows::gather_rows(&keys, &index)?,
        &want,
        failures,
    )?;
    same(
        "CP 2 keys (device rows)".into(),
        &vime_kernels::rows::gather_rows_dev(&keys, &ids)?,
        &want,
        failures,
    )?;
    let small: Vec<u32> = vec![5, 5, 0, 4, 3, 2, 1, 0, 5];
    let small_ids = Tensor::new(small.as_slice(), gpu)?;
    for dt in [DType::F32, DType::F16, DType::BF16] {
        for width in [4usize, 8, 12, 264] {
            let src = rng.randn(&[6, width], 1.0, DType::F32, gpu)?.to_dtype(dt)?;
            let got = vime_kernels::rows::gather_rows(&src, &small)?;
            same(
                format!("{dt:?} [6, {width}]"),
                &got,
                &src.index_select(&small_ids, 0)?,
                failures,
            )?;
        }
    }
    let wide = rng.randn(&[6 * 16 + 1], 1.0, DType::BF16, gpu)?;
    let view = wide.narrow(0, 1, 96)?.reshape((6, 16))?;
    same(
        "a view off a 16-byte boundary".into(),
        &vime_kernels::rows::gather_rows(&view, &small)?,
        &view.contiguous()?.index_select(&small_ids, 0)?,
        failures,
    )?;
    let none = vime_kernels::rows::gather_rows(&keys, &[])?;
    if none.dims() != [0, 8, 128] {
        failures.push(format!("gather_rows of no rows: dims {:?}", none.dims()));
    }
    match vime_kernels::rows::gather_rows(&keys, &[3, 16_384]) {
        Err(e) if e.to_string().contains("index 1 is row 16384") => {}
        other => failures.push(format!(
            "gather_rows past the rows: {:?}",
            other.map(|t| t.dims().to_vec())
        )),
    }
    let past = Tensor::new(&[2u32, 16_384, 7], gpu)?;
    let got = vime_kernels::rows::gather_rows_dev(&keys, &past)?.to_dtype(DType::F32)?;
    let zero_row = got.get(1)?.abs()?.sum_all()?.to_scalar::<f32>()?;
    let kept = max_abs_diff(&got.get(2)?, &keys.get(7)?.to_dtype(DType::F32)?)?;
    if zero_row != 0.0 || kept != 0.0 {
        failures.push(format!(
            "gather_rows_dev past the rows: that row sums to {zero_row} (want 0), the next differs by {kept}"
        ));
    }
    println!("gather_rows: {cases} cases bit-equal to index_select checked, plus no rows and rows past the source");
    Ok(())
}

/// The embedding backward (f32 out, tied init, repeated ids) on CUDA against the CPU: the same
/// f32 additions in the same order, so bit-exact.
fn check_embedding_backward(gpu: &Device, rng: &mut Rng, failures: &mut Vec<String>) -> Result<()> {
    let (vocab, d, t) = (151_936usize, 2560usize, 1024usize);
    // Repeats: ids from a small range half the time.
    let ids: Vec<u32> = (0..t)
        .map(|i| {
            let r = rng.next_u64();
            if i % 2 == 0 {
                (r % 50) as u32
            } else {
                (r % vocab as u64) as u32
            }
        })
        .collect();
    let g = rng.randn(&[t, d], 1.0, DType::BF16, &Device::Cpu)?;
    let init = rng.randn(&[vocab, d], 1e-2, DType::BF16, &Device::Cpu)?;
    let mut worst = 0f32;
    for with_init in [false, true] {
        let init_c = with_init.then_some(&init);
        let want = vime_kernels::embedding_backward(&ids, &g, vocab, init_c)?;
        let init_g = init_c.map(|i| i.to_device(gpu)).transpose()?;
        let got = vime_kernels::embedding_backward(&ids, &g.to_device(gpu)?, vocab, init_g.as_ref())?;
        if got.dtype() != DType::F32 || got.dims() != [vocab, d] {
            failures.push(format!("embedding_backward: got {:?} {:?}", got.dtype(), got.dims()));
        }
        let diff = (want - got.to_device(&Device::Cpu)?)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        worst = worst.max(diff);
    }
    // Into a running f32 sum, in place on CUDA (only the batch's rows are touched).
    let sum = rng.randn(&[vocab, d], 1e-2, DType::F32, &Device::Cpu)?;
    let want = vime_kernels::embedding_backward_into(&ids, &g, sum.clone())?;
    let sum_g = sum.to_device(gpu)?;
    let got = vime_kernels::embedding_backward_into(&ids, &g.to_device(gpu)?, sum_g.clone())?;
    let in_place = got.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?
        == sum_g.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
    if !in_place {
        failures.push("embedding_backward_into: the sum was not updated in place".into());
    }
    let diff = (want - got.to_device(&Device::Cpu)?)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?;
    worst = worst.max(diff);
    let ok = worst == 0.0;
    println!(
        "{:<26} {:<52} max |cpu - cuda| {worst:e} (with and without init, into a sum)  {}",
        "embedding_backward",
        format!("[{t}, {d}] bf16 -> [{vocab}, {d}] f32"),
        if ok { "ok" } else { "FAIL" }
    );
    if !ok {
        failures.push(format!("embedding_backward: max abs diff {worst:e}"));
    }
    Ok(())
}

/// The engine's device sampler against its host mirror on the same logits: greedy rows and
/// T = 0.7 / 1.0 rows over the real vocabulary. The keys are the same f32 arithmetic (logf
/// against Rust's ln can differ in the last bit), so at most one row in 256 may differ, and only
/// where the two largest keys are that close.
/// The decode kernel against the CPU path (gather + the CPU attention kernel, one query per
/// sequence) on the same bf16 pool: lengths from 1 to past one split (so the merge runs), rows
/// scattered over the pool as the paged cache scatters them, 2 and 4 query heads per kv head
/// (Qwen3-0.6B and 4B) and 1 and 8, and a batch of 1 (most splits) and of 64.
fn check_decode_attention(gpu: &Device, rng: &mut Rng, failures: &mut Vec<String>) -> Result<()> {
    for kernel in vime_kernels::DecodeKernel::ALL {
        check_decode_attention_with(gpu, rng, failures, kernel)?;
    }
    Ok(())
}

fn check_decode_attention_with(
    gpu: &Device,
    rng: &mut Rng,
    failures: &mut Vec<String>,
    kernel: vime_kernels::DecodeKernel,
) -> Result<()> {
    let kernels = vime_kernels::KernelConfig::default().with_decode_kernel(kernel);
    for (lens, heads) in [
        (vec![1usize, 17, 64, 65, 300, 1000, 4097], 16usize),
        (vec![5000], 32),
        ((0..64).map(|i| 1 + i * 37).collect::<Vec<_>>(), 32),
        // 1 and 8 query heads a kv head: the tensor-core kernel's narrowest and fullest MMA tile.
        (vec![3, 16, 17, 700], 8),
        (vec![1, 33, 2000], 64),
    ] {
        let (hkv, d) = (8usize, 128usize);
        let total: usize = lens.iter().sum();
        let cap = (total + 1024).next_power_of_two();
        let kp = rng.randn(&[cap, hkv * d], 1.0, DType::BF16, &Device::Cpu)?;
        let vp = rng.randn(&[cap, hkv * d], 1.0, DType::BF16, &Device::Cpu)?;
        let q = rng.randn(&[lens.len(), heads, d], 1.0, DType::BF16, &Device::Cpu)?;
        // A permutation of the pool's rows (odd stride over a power of two).
        let rows: Vec<u32> = (0..total).map(|i| ((i * 2_654_435_761 + 11) % cap) as u32).collect();
        let mut cu = vec![0u32];
        for l in &lens {
            cu.push(cu.last().unwrap() + *l as u32);
        }
        let cu: Arc<[u32]> = cu.into();
        let max_len = *lens.iter().max().unwrap();
        let run = |dev: &Device, plan: SplitPlan| -> Result<Tensor> {
            let rows_t = Tensor::from_vec(rows.clone(), total, dev)?;
            let meta = plan.device_meta(&cu);
            let meta_t = Tensor::from_vec(meta.clone(), meta.len(), dev)?;
            vime_kernels::decode::decode_attention(
                &q.to_device(dev)?,
                &kp.to_device(dev)?,
                &vp.to_device(dev)?,
                &rows_t,
                &cu,
                &meta_t,
                plan,
                1.0 / (d as f64).sqrt(),
                &kernels,
            )
        };
        // The plan of an eager call and the fixed plan of a captured graph: both against the CPU.
        let (call, fixed) = (
            SplitPlan::for_call(lens.len(), hkv, max_len),
            SplitPlan::fixed(lens.len(), hkv, max_len),
        );
        let want = run(&Device::Cpu, call)?;
        let got = run(gpu, call)?.to_device(&Device::Cpu)?;
        let got_fixed = run(gpu, fixed)?.to_device(&Device::Cpu)?;
        let err = rel_err(&got, &want)?.max(rel_err(&got_fixed, &want)?);
        let ok = err <= TOL;
        let desc = format!(
            "{kernel:?}: B {} H {heads} Hkv {hkv}, keys 1..{max_len}, splits {}/{}",
            lens.len(),
            call.splits,
            fixed.splits
        );
        println!(
            "{:<26} {desc:<52} rel err {err:.1e}  {}",
            "decode_attention",
            if ok { "ok" } else { "FAIL" }
        );
        if !ok {
            failures.push(format!("decode_attention {desc}: rel err {err:e}"));
        }
    }
    Ok(())
}

/// How fast the decode kernel reads the KV cache at Qwen3-4B's heads (32 query, 8 kv, d 128),
/// with a captured graph's fixed plan, every sequence at the same length, pool rows scattered: the
/// median of 20 timings of 10 back-to-back calls (host-timed, synchronised), and the K + V bytes
/// read per second against the H200's ~4.8 TB/s. Printed, not asserted (a measurement).
fn time_decode_attention(gpu: &Device, rng: &mut Rng) -> Result<()> {
    let (heads, hkv, d) = (32usize, 8usize, 128usize);
    let shapes = [
        (64usize, 160usize),
        (64, 1024),
        (64, 2048),
        (64, 4096),
        (256, 160),
        (16, 2048),
    ];
    // One pool for every shape, drawn on the device (the host generator takes minutes at this size).
    let cap = (shapes.iter().map(|&(b, l)| b * l).max().unwrap_or(0) + 1024).next_power_of_two();
    let pool = || -> Result<Tensor> { Tensor::randn(0f32, 1f32, (cap, hkv * d), gpu)?.to_dtype(DType::BF16) };
    let (kp, vp) = (pool()?, pool()?);
    for (b, len) in shapes {
        let total = b * len;
        let q = rng.randn(&[b, heads, d], 1.0, DType::BF16, gpu)?;
        let rows: Vec<u32> = (0..total).map(|i| ((i * 2_654_435_761 + 11) % cap) as u32).collect();
        let rows_t = Tensor::from_vec(rows, total, gpu)?;
        let cu: Arc<[u32]> = (0..=b).map(|i| (i * len) as u32).collect();
        let plan = SplitPlan::fixed(b, hkv, len);
        let meta = plan.device_meta(&cu);
        let meta_t = Tensor::from_vec(meta.clone(), meta.len(), gpu)?;
        let bytes = (total * hkv * d * 2 * 2) as f64;
        for kernel in vime_kernels::DecodeKernel::ALL {
            let kernels = vime_kernels::KernelConfig::default().with_decode_kernel(kernel);
            let ms = median_ms(gpu, 20, &mut || {
                for _ in 0..10 {
                    vime_kernels::decode::decode_attention(&q, &kp, &vp, &rows_t, &cu, &meta_t, plan, 0.088, &kernels)?;
                }
                Ok(())
            })? / 10.0;
            println!(
                "{:<26} {:<52} {:.1} us a call, {:.2} TB/s of K + V",
                "decode_attention speed",
                format!(
                    "{kernel:?}: B {b} x {len} keys, H {heads} Hkv {hkv}, splits {} x {}",
                    plan.splits, plan.chunk
                ),
                ms * 1e3,
                bytes / (ms * 1e-3) / 1e12
            );
        }
    }
    Ok(())
}

/// `qk_norm_rope` on a training-sized batch (a warp a token, Qwen3-4B's heads, positions of
/// several packed sequences) against the four kernels it replaces on the same device: bit for bit.
fn check_qk_norm_rope_tokens(gpu: &Device, rng: &mut Rng, failures: &mut Vec<String>) -> Result<()> {
    let (t, hq, hk, d) = (
        vime_kernels::cuda::QK_NORM_ROPE_TOKEN_WARPS + 37,
        32usize,
        8usize,
        128usize,
    );
    let q = rng.randn(&[t, hq, d], 1.0, DType::BF16, gpu)?;
    let k = rng.randn(&[t, hk, d], 1.0, DType::BF16, gpu)?;
    let wq = rng.randn(&[d], 1.0, DType::BF16, gpu)?;
    let wk = rng.randn(&[d], 1.0, DType::BF16, gpu)?;
    let pos: Arc<[u32]> = (0..t as u32).map(|i| i % 700).collect();
    let (eps, theta) = (1e-6, 1_000_000.0);
    let (fq, fk) = vime_kernels::rope::qk_norm_rope(&q, &k, &wq, &wk, eps, &pos, None, theta)?;
    let sq = vime_kernels::rope(&vime_kernels::rms_norm(&q, &wq, eps)?, &pos, theta)?;
    let sk = vime_kernels::rope(&vime_kernels::rms_norm(&k, &wk, eps)?, &pos, theta)?;
    let same = max_abs_diff(&fq, &sq)?.max(max_abs_diff(&fk, &sk)?);
    println!(
        "{:<26} {:<52} max |fused - 4 kernels| {same:e}  {}",
        "qk_norm_rope (per token)",
        format!("q [{t}, {hq}, {d}] k [{t}, {hk}, {d}] bf16"),
        if same == 0.0 { "ok" } else { "FAIL" }
    );
    if same != 0.0 {
        failures.push(format!("qk_norm_rope per token: fused vs kernels {same:e}"));
    }
    Ok(())
}

/// The decode step's fused launches: `qk_norm_rope` against the four kernels it replaces on the
/// same device (bit for bit) and against the CPU (bf16 bound); `write_rows2` against two
/// `write_rows` on the CPU (bit for bit).
fn check_fused_decode_ops(gpu: &Device, rng: &mut Rng, failures: &mut Vec<String>) -> Result<()> {
    check_qk_norm_rope_tokens(gpu, rng, failures)?;
    let (t, hq, hk, d) = (257usize, 32usize, 8usize, 128usize);
    let q = rng.randn(&[t, hq, d], 1.0, DType::BF16, &Device::Cpu)?;
    let k = rng.randn(&[t, hk, d], 1.0, DType::BF16, &Device::Cpu)?;
    let wq = rng.randn(&[d], 1.0, DType::BF16, &Device::Cpu)?;
    let wk = rng.randn(&[d], 1.0, DType::BF16, &Device::Cpu)?;
    let pos: Arc<[u32]> = (0..t as u32).map(|i| i * 37 % 40_000).collect();
    let (eps, theta) = (1e-6, 1_000_000.0);
    let g = |x: &Tensor| x.to_device(gpu);
    let (fq, fk) = vime_kernels::rope::qk_norm_rope(&g(&q)?, &g(&k)?, &g(&wq)?, &g(&wk)?, eps, &pos, None, theta)?;
    // The same positions already on the device (a graph's input buffer): the same bits.
    let pos_dev = Tensor::from_vec(pos.to_vec(), t, gpu)?;
    let (dq, dk) =
        vime_kernels::rope::qk_norm_rope(&g(&q)?, &g(&k)?, &g(&wq)?, &g(&wk)?, eps, &pos, Some(&pos_dev), theta)?;
    let sq = vime_kernels::rope(&vime_kernels::rms_norm(&g(&q)?, &g(&wq)?, eps)?, &pos, theta)?;
    let sk = vime_kernels::rope(&vime_kernels::rms_norm(&g(&k)?, &g(&wk)?, eps)?, &pos, theta)?;
    let same = max_abs_diff(&fq, &sq)?
        .max(max_abs_diff(&fk, &sk)?)
        .max(max_abs_diff(&dq, &fq)?)
        .max(max_abs_diff(&dk, &fk)?);
    let (cq, ck) = vime_kernels::rope::qk_norm_rope(&q, &k, &wq, &wk, eps, &pos, None, theta)?;
    let cpu_err = rel_err(&fq.to_device(&Device::Cpu)?, &cq)?.max(rel_err(&fk.to_device(&Device::Cpu)?, &ck)?);
    let ok = same == 0.0 && cpu_err <= TOL;
    println!(
        "{:<26} {:<52} max |fused - 4 kernels| {same:e}, rel err vs cpu {cpu_err:.1e}  {}",
        "qk_norm_rope",
        format!("q [{t}, {hq}, {d}] k [{t}, {hk}, {d}] bf16"),
        if ok { "ok" } else { "FAIL" }
    );
    if !ok {
        failures.push(format!("qk_norm_rope: fused vs kernels {same:e}, vs cpu {cpu_err:e}"));
    }
    let (cap, width, n) = (2048usize, 1024usize, 100usize);
    let pk = rng.randn(&[cap, width], 1.0, DType::BF16, &Device::Cpu)?;
    let pv = rng.randn(&[cap, width], 1.0, DType::BF16, &Device::Cpu)?;
    let sk = rng.randn(&[n, width], 1.0, DType::BF16, &Device::Cpu)?;
    let sv = rng.randn(&[n, width], 1.0, DType::BF16, &Device::Cpu)?;
    let rows: Vec<u32> = (0..n as u32).map(|r| (r * 19 + 3) % cap as u32).collect();
    let rows_c = Tensor::from_vec(rows, n, &Device::Cpu)?;
    let (pk_c, pv_c, pk_g, pv_g) = (pk.copy()?, pv.copy()?, g(&pk)?, g(&pv)?);
    vime_kernels::rows::write_rows(&pk_c, &rows_c, &sk)?;
    vime_kernels::rows::write_rows(&pv_c, &rows_c, &sv)?;
    vime_kernels::rows::write_rows2(&pk_g, &pv_g, &g(&rows_c)?, &g(&sk)?, &g(&sv)?)?;
    let diff = max_abs_diff(&pk_c, &pk_g)?.max(max_abs_diff(&pv_c, &pv_g)?);
    println!(
        "{:<26} {:<52} max |cpu - cuda| {diff:e}  {}",
        "write_rows2",
        format!("2 x [{n}, {width}] bf16 into [{cap}, {width}]"),
        if diff == 0.0 { "ok" } else { "FAIL" }
    );
    if diff != 0.0 {
        failures.push(format!("write_rows2: max abs diff {diff:e}"));
    }
    // The fused-projection path: q, k, v as head views of one [t, (hq + 2 hk) x 128] row (read in
    // place by qk_norm_rope and write_rows2), gate|up as one [t, 2 I] row (swiglu_packed): the
    // same bits as the separate contiguous tensors.
    let qkv = rng.randn(&[t, hq + 2 * hk, d], 1.0, DType::BF16, gpu)?;
    let (qv, kv, vv) = (
        qkv.narrow(1, 0, hq)?,
        qkv.narrow(1, hq, hk)?,
        qkv.narrow(1, hq + hk, hk)?,
    );
    let (aq, ak) = vime_kernels::rope::qk_norm_rope(&qv, &kv, &g(&wq)?, &g(&wk)?, eps, &pos, None, theta)?;
    let (bq, bk) = vime_kernels::rope::qk_norm_rope(
        &qv.contiguous()?,
        &kv.contiguous()?,
        &g(&wq)?,
        &g(&wk)?,
        eps,
        &pos,
        None,
        theta,
    )?;
    let rows_t: Vec<u32> = (0..t as u32).map(|r| (r * 7 + 1) % 4096).collect();
    let rows_g = Tensor::from_vec(rows_t, t, gpu)?;
    let pool = |x: &Tensor| -> Result<Tensor> { x.copy() };
    let base = rng.randn(&[4096, hk * d], 1.0, DType::BF16, gpu)?;
    let (k1, v1, k2, v2) = (pool(&base)?, pool(&base)?, pool(&base)?, pool(&base)?);
    vime_kernels::rows::write_rows2(&k1, &v1, &rows_g, &ak, &vv)?;
    vime_kernels::rows::write_rows2(&k2, &v2, &rows_g, &bk, &vv.contiguous()?)?;
    let inter = 3072usize;
    let gu = rng.randn(&[t, 2 * inter], 1.0, DType::BF16, gpu)?;
    let packed = vime_kernels::swiglu_packed(&gu)?;
    let split = vime_kernels::swiglu(
        &gu.narrow(1, 0, inter)?.contiguous()?,
        &gu.narrow(1, inter, inter)?.contiguous()?,
    )?;
    let diff = [
        max_abs_diff(&aq, &bq)?,
        max_abs_diff(&ak, &bk)?,
        max_abs_diff(&k1, &k2)?,
        max_abs_diff(&v1, &v2)?,
        max_abs_diff(&packed, &split)?,
    ]
    .into_iter()
    .fold(0f32, f32::max);
    println!(
        "{:<26} {:<52} max |views - contiguous| {diff:e}  {}",
        "fused qkv / gate-up views",
        format!("qkv [{t}, {}, {d}], gate|up [{t}, {}]", hq + 2 * hk, 2 * inter),
        if diff == 0.0 { "ok" } else { "FAIL" }
    );
    if diff != 0.0 {
        failures.push(format!("fused projection views: max abs diff {diff:e}"));
    }
    Ok(())
}

fn check_sample_gumbel(gpu: &Device, rng: &mut Rng, failures: &mut Vec<String>) -> Result<()> {
    // 1 and 64 rows split the vocabulary over many blocks (then merge), 256 over a few, 2000
    // not at all: every path of the kernel.
    for rows in [1usize, 64, 256, 2000] {
        let vocab = 151_936usize;
        let logits = rng.randn(&[rows, vocab], 3.0, DType::F32, &Device::Cpu)?;
        let seeds: Vec<u64> = (0..rows as u64).map(|r| r * 7919 + 1).collect();
        let counters: Vec<u64> = (0..rows as u64).map(|r| r % 13).collect();
        let inv_t: Vec<f32> = (0..rows).map(|r| [0.0, 1.0 / 0.7, 1.0][r % 3]).collect();
        let (want, want_lp) = vime_kernels::sample::sample_gumbel_logprobs(&logits, &seeds, &counters, &inv_t)?;
        let (got, got_lp) =
            vime_kernels::sample::sample_gumbel_logprobs(&logits.to_device(gpu)?, &seeds, &counters, &inv_t)?;
        let differ = want.iter().zip(&got).filter(|(a, b)| a != b).count();
        let greedy_differ = want.iter().zip(&got).step_by(3).filter(|(a, b)| a != b).count();
        // Log-probs where both sides drew the same token: f32 on the device, f64 sums on the host.
        let lp_err = want
            .iter()
            .zip(&got)
            .zip(want_lp.iter().zip(&got_lp))
            .filter(|((a, b), _)| a == b)
            .map(|(_, (x, y))| (x - y).abs())
            .fold(0f32, f32::max);
        // A drawn token may differ where two noisy keys tie to f32 rounding: at most 1 row in 256.
        let ok = differ <= rows.div_ceil(256) && greedy_differ == 0 && lp_err <= 1e-4;
        println!(
            "{:<26} {:<52} rows where cuda != cpu: {differ} (greedy rows: {greedy_differ}), log-prob max err {lp_err:.1e}  {}",
            "sample_gumbel",
            format!("[{rows}, {vocab}] f32, T 0 / 0.7 / 1"),
            if ok { "ok" } else { "FAIL" }
        );
        if !ok {
            failures.push(format!(
                "sample_gumbel {rows} rows: {differ} rows differ ({greedy_differ} greedy), log-prob err {lp_err:e}"
            ));
        }
    }
    Ok(())
}

/// The built-in engine's own device ops (sampling, the KV cache's row writes) against their CPU
/// paths. `scripts/gpu/check_kernels.sh` runs it after `every_op`.
#[test]
fn engine_ops_on_cuda_match_the_cpu() -> Result<()> {
    let Ok(gpu) = Device::new_cuda(0) else {
        println!("no CUDA device: skipped");
        return Ok(());
    };
    let mut rng = Rng::new(4242);
    let mut failures = Vec::new();
    check_sample_gumbel(&gpu, &mut rng, &mut failures)?;
    // KV rows: 300 rows of 1024 bf16 written into a 4096-row pool at scattered rows.
    let (cap, width, n) = (4096usize, 1024usize, 300usize);
    let pool = rng.randn(&[cap, width], 1.0, DType::BF16, &Device::Cpu)?;
    let src = rng.randn(&[n, width], 1.0, DType::BF16, &Device::Cpu)?;
    let rows: Vec<u32> = (0..n as u32).map(|r| (r * 13 + 5) % cap as u32).collect();
    let rows_c = Tensor::from_vec(rows.clone(), n, &Device::Cpu)?;
    let (pool_c, pool_g) = (pool.copy()?, pool.to_device(&gpu)?);
    vime_kernels::rows::write_rows(&pool_c, &rows_c, &src)?;
    vime_kernels::rows::write_rows(&pool_g, &rows_c.to_device(&gpu)?, &src.to_device(&gpu)?)?;
    let diff = (pool_c.to_dtype(DType::F32)? - pool_g.to_device(&Device::Cpu)?.to_dtype(DType::F32)?)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?;
    let ok = diff == 0.0;
    println!(
        "{:<26} {:<52} max |cpu - cuda| {diff:e}  {}",
        "write_rows",
        format!("[{n}, {width}] bf16 into [{cap}, {width}]"),
        if ok { "ok" } else { "FAIL" }
    );
    if !ok {
        failures.push(format!("write_rows: max abs diff {diff:e}"));
    }
    check_decode_attention(&gpu, &mut rng, &mut failures)?;
    time_decode_attention(&gpu, &mut rng)?;
    check_fused_decode_ops(&gpu, &mut rng, &mut failures)?;
    check_graph_replay(&gpu, &mut rng, &mut failures)?;
    println!(
        "ENGINE OPS VERDICT: {} (sample_gumbel, write_rows, decode_attention, qk_norm_rope, write_rows2 vs the CPU; \
         a captured graph's replays vs eager runs)",
        if failures.is_empty() { "PASS" } else { "FAIL" }
    );
    assert!(failures.is_empty(), "{failures:?}");
    Ok(())
}

/// A captured CUDA graph (`vime_kernels::cuda::run_and_capture`) of a decode-shaped chain
/// (norm + RoPE with device positions, a K/V row write, matmul, decode attention with device
/// metadata, SwiGLU, an in-place copy into an output buffer) replayed with new inputs written in
/// place (`write_u32`) gives, bit for bit, what the same chain run eagerly on those inputs gives.
#[allow(clippy::type_complexity)]
fn check_graph_replay(gpu: &Device, rng: &mut Rng, failures: &mut Vec<String>) -> Result<()> {
    use vime_kernels::cuda::{run_and_capture, write_u32};
    let (b, hq, hkv, d, cap) = (8usize, 16usize, 8usize, 128usize, 4096usize);
    let kernels = vime_kernels::KernelConfig::default();
    let kp = rng.randn(&[cap, hkv * d], 1.0, DType::BF16, gpu)?;
    let vp = rng.randn(&[cap, hkv * d], 1.0, DType::BF16, gpu)?;
    let wq = rng.randn(&[d], 1.0, DType::BF16, gpu)?;
    let wk = rng.randn(&[d], 1.0, DType::BF16, gpu)?;
    let wo = rng.randn(&[2 * hq * d, hq * d], 0.02, DType::BF16, gpu)?;
    let x_in = Tensor::zeros((b, hq + hkv, d), DType::BF16, gpu)?;
    let out = Tensor::zeros((b, hq * d), DType::BF16, gpu)?;
    let (pos_buf, write_buf) = (Tensor::zeros(b, DType::U32, gpu)?, Tensor::zeros(b, DType::U32, gpu)?);
    let (read_buf, meta_buf) = (
        Tensor::zeros(cap, DType::U32, gpu)?,
        Tensor::zeros(b + 2, DType::U32, gpu)?,
    );
    // Step `s`: each sequence has 40 + 100 s + 7 i keys; its new key is the last one.
    let step = |s: usize| -> (Vec<u32>, Vec<u32>, Vec<u32>, Arc<[u32]>, usize) {
        let lens: Vec<usize> = (0..b).map(|i| 40 + 100 * s + 7 * i).collect();
        let mut read = Vec::new();
        let mut cu = vec![0u32];
        for (i, &l) in lens.iter().enumerate() {
            read.extend((0..l).map(|j| ((i * 397 + j * 8) % cap) as u32));
            cu.push(read.len() as u32);
        }
        let write: Vec<u32> = (0..b).map(|i| read[cu[i + 1] as usize - 1]).collect();
        let pos: Vec<u32> = lens.iter().map(|&l| l as u32 - 1).collect();
        (pos, write, read, cu.into(), *lens.iter().max().unwrap())
    };
    let plan_for = |max_len: usize| SplitPlan::fixed(b, hkv, max_len);
    let chain = |pos: &Arc<[u32]>, cu: &Arc<[u32]>, plan: SplitPlan| -> Result<()> {
        let q = x_in.narrow(1, 0, hq)?;
        let k = x_in.narrow(1, hq, hkv)?;
        let (qr, kr) = vime_kernels::rope::qk_norm_rope(&q, &k, &wq, &wk, 1e-6, pos, Some(&pos_buf), 1e6)?;
        vime_kernels::rows::write_rows2(
            &kp,
            &vp,
            &write_buf,
            &kr.reshape((b, hkv * d))?,
            &kr.reshape((b, hkv * d))?,
        )?;
        let a = vime_kernels::decode::decode_attention(&qr, &kp, &vp, &read_buf, cu, &meta_buf, plan, 0.088, &kernels)?;
        let a = a.reshape((b, hq * d))?;
        let gu = a.matmul(&wo.t()?)?;
        let act = vime_kernels::swiglu(&gu.narrow(1, 0, hq * d)?, &gu.narrow(1, hq * d, hq * d)?)?;
        out.slice_set(&act, 0, 0)
    };
    let load = |s: usize, x: &Tensor| -> Result<(Arc<[u32]>, Arc<[u32]>, SplitPlan)> {
        let (pos, write, read, cu, max_len) = step(s);
        let plan = plan_for(max_len);
        write_u32(&pos_buf, 0, &pos)?;
        write_u32(&write_buf, 0, &write)?;
        write_u32(&read_buf, 0, &read)?;
        write_u32(&meta_buf, 0, &plan.device_meta(&cu))?;
        x_in.slice_set(x, 0, 0)?;
        Ok((pos.into(), cu, plan))
    };
    let xs: Vec<Tensor> = (0..4)
        .map(|_| rng.randn(&[b, hq + hkv, d], 1.0, DType::BF16, gpu))
        .collect::<Result<_>>()?;
    // The pools change as the chain runs (row writes): eager and graph runs start from copies.
    let (k0, v0) = (kp.copy()?, vp.copy()?);
    let (pos, cu, plan) = load(0, &xs[0])?;
    let ((), graph) = run_and_capture(gpu, || chain(&pos, &cu, plan))?;
    let graph = graph?;
    let mut replayed = vec![out.to_device(&Device::Cpu)?];
    for (s, x) in xs.iter().enumerate().skip(1) {
        let (_pos, _cu, p) = load(s, x)?;
        assert_eq!(p.splits, plan.splits, "the fixed plan's grid depends on the batch only");
        graph.launch()?;
        replayed.push(out.to_device(&Device::Cpu)?);
    }
    kp.slice_set(&k0, 0, 0)?;
    vp.slice_set(&v0, 0, 0)?;
    let mut worst = 0f32;
    for (s, x) in xs.iter().enumerate() {
        let (pos, cu, plan) = load(s, x)?;
        chain(&pos, &cu, plan)?;
        worst = worst.max(max_abs_diff(&out, &replayed[s])?);
    }
    let ok = worst == 0.0;
    println!(
        "{:<26} {:<52} max |replay - eager| {worst:e}  {}",
        "cuda_graph_replay",
        format!("B {b} H {hq} Hkv {hkv}, 4 steps, keys 40..{}", 40 + 300 + 7 * (b - 1)),
        if ok { "ok" } else { "FAIL" }
    );
    if !ok {
        failures.push(format!("cuda_graph_replay: max |replay - eager| {worst:e}"));
    }
    Ok(())
}

/// The largest `|a - b|` over two tensors of one shape (any dtype, either device), in f32.
/// The GEMMs of Qwen3-4B's layers, (out, in) as HF stores the weights: q, k/v, o, gate/up, down.
const QWEN3_4B_GEMMS: [(usize, usize); 5] = [(4096, 2560), (1024, 2560), (2560, 4096), (9728, 2560), (2560, 9728)];

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    (a.to_device(&Device::Cpu)?.to_dtype(DType::F32)? - b.to_device(&Device::Cpu)?.to_dtype(DType::F32)?)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()
}

/// Rows of `a` and `b` (same shape, any dtype) that differ in any bit.
fn rows_differing(a: &Tensor, b: &Tensor) -> Result<usize> {
    let (a, b) = (
        a.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.to_vec2::<f32>()?,
        b.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.to_vec2::<f32>()?,
    );
    Ok(a.iter()
        .zip(&b)
        .filter(|(x, y)| x.iter().zip(y.iter()).any(|(p, q)| p.to_bits() != q.to_bits()))
        .count())
}

/// Batch invariance on the GPU, the ground a deterministic engine mode (engine log-probs equal
/// to the trainer's bit for bit, issue 20) would stand on: does a token's result depend on how
/// many other tokens share the call? Asserted where vime's own kernels promise it (RMSNorm is
/// one warp per row); measured and printed for what vime does not control or does not yet make
/// invariant: cuBLAS GEMMs at the engine's row counts (1-256) against the trainer's (4096), the
/// decode kernel's split plans against each other and against the trainer's attention over
/// the whole sequence, and the sampler's log-prob against the trainer's log-softmax.
#[test]
fn batch_invariance_on_cuda() -> Result<()> {
    let Ok(gpu) = Device::new_cuda(0) else {
        println!("no CUDA device: skipped");
        return Ok(());
    };
    let mut rng = Rng::new(77);
    let big = 4096usize;
    let mut failures = Vec::new();
    for (n, k) in QWEN3_4B_GEMMS {
        let x = rng.randn(&[big, k], 1.0, DType::BF16, &gpu)?;
        let w = rng.randn(&[n, k], 0.02, DType::BF16, &gpu)?;
        let full = x.matmul(&w.t()?)?;
        let mut line = Vec::new();
        for m in [1usize, 8, 64, 256] {
            let part = x.narrow(0, 0, m)?.matmul(&w.t()?)?;
            line.push(format!("M {m}: {}/{m}", rows_differing(&part, &full.narrow(0, 0, m)?)?));
        }
        println!(
            "{:<26} {:<52} rows differing from M {big}: {}",
            "gemm bf16 (cuBLAS)",
            format!("[M, {k}] x [{n}, {k}]^T"),
            line.join(", ")
        );
    }
    // The LM head in f32 (the engine's logits) at the 4B shape.
    let (vocab, hid) = (151_936usize, 2560usize);
    let lm = rng.randn(&[vocab, hid], 0.02, DType::BF16, &gpu)?;
    let h = rng.randn(&[1024, hid], 1.0, DType::BF16, &gpu)?;
    let full = vime_kernels::lm_head::logits_f32(&h, &lm)?;
    let mut line = Vec::new();
    for m in [1usize, 8, 64, 256] {
        let part = vime_kernels::lm_head::logits_f32(&h.narrow(0, 0, m)?, &lm)?;
        line.push(format!("M {m}: {}/{m}", rows_differing(&part, &full.narrow(0, 0, m)?)?));
    }
    println!(
        "{:<26} {:<52} rows differing from M 1024: {}",
        "logits_f32 (cuBLAS)",
        format!("[M, {hid}] x [{vocab}, {hid}]^T"),
        line.join(", ")
    );
    // The engine's log-prob of its (greedy) token against the trainer's log-softmax, same logits.
    let m = 64usize;
    let logits = full.narrow(0, 0, m)?;
    let (toks, lps) = vime_kernels::sample::sample_gumbel_logprobs(&logits, &vec![1; m], &vec![0; m], &vec![0.0; m])?;
    let targets: Arc<[u32]> = toks.clone().into();
    let (tlp, _) = vime_kernels::logprobs_entropy(&h.narrow(0, 0, m)?, &lm, &targets, 4096)?;
    let tlp = tlp.to_device(&Device::Cpu)?.to_vec1::<f32>()?;
    let same = lps.iter().zip(&tlp).filter(|(a, b)| a.to_bits() == b.to_bits()).count();
    let worst = lps.iter().zip(&tlp).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    println!(
        "{:<26} {:<52} bit-equal {same}/{m}, max |diff| {worst:.1e}",
        "sampler vs trainer logp",
        format!("[{m}, {vocab}]: sample_gumbel vs logprobs_entropy")
    );
    // RMSNorm: one warp per row, so a row's bits cannot depend on the others. Asserted.
    let x = rng.randn(&[big, hid], 1.0, DType::BF16, &gpu)?;
    let wn = rng.randn(&[hid], 1.0, DType::BF16, &gpu)?;
    let full = vime_kernels::rms_norm(&x, &wn, 1e-6)?;
    let mut differ = 0;
    for m in [1usize, 8, 64, 256] {
        differ += rows_differing(
            &vime_kernels::rms_norm(&x.narrow(0, 0, m)?, &wn, 1e-6)?,
            &full.narrow(0, 0, m)?,
        )?;
    }
    println!(
        "{:<26} {:<52} rows differing from M {big}: {differ}  {}",
        "rms_norm",
        format!("[M, {hid}] bf16, M 1 / 8 / 64 / 256"),
        if differ == 0 { "ok" } else { "FAIL" }
    );
    if differ != 0 {
        failures.push(format!("rms_norm: {differ} rows depend on the batch"));
    }
    // Attention at the last position of a 300-token sequence: the decode kernel (split plans of a
    // batch of 1 and of 64) and the trainer's attention over the whole sequence (its last row).
    let (len, hq, hkv, d) = (300usize, 32usize, 8usize, 128usize);
    let q = rng.randn(&[len, hq, d], 1.0, DType::BF16, &gpu)?;
    let kk = rng.randn(&[len, hkv, d], 1.0, DType::BF16, &gpu)?;
    let vv = rng.randn(&[len, hkv, d], 1.0, DType::BF16, &gpu)?;
    let cu: Arc<[u32]> = [0u32, len as u32].into();
    let scale = 1.0 / (d as f64).sqrt();
    let kernels = vime_kernels::KernelConfig::default();
    let trainer = vime_kernels::varlen_attention(&q, &kk, &vv, &cu, &cu, scale, &kernels)?
        .narrow(0, len - 1, 1)?
        .reshape((1, hq * d))?;
    let rows = Tensor::from_vec((0..len as u32).collect::<Vec<_>>(), len, &gpu)?;
    let (kp, vp) = (kk.reshape((len, hkv * d))?, vv.reshape((len, hkv * d))?);
    let ql = q.narrow(0, len - 1, 1)?.contiguous()?;
    let dec = |plan: SplitPlan| -> Result<Tensor> {
        let meta = plan.device_meta(&cu);
        let meta = Tensor::from_vec(meta.clone(), meta.len(), &gpu)?;
        vime_kernels::decode::decode_attention(&ql, &kp, &vp, &rows, &cu, &meta, plan, scale, &kernels)?
            .reshape((1, hq * d))
    };
    let (p1, p64) = (SplitPlan::fixed(1, hkv, len), SplitPlan::fixed(64, hkv, len));
    let (d1, d64) = (dec(p1)?, dec(p64)?);
    println!(
        "{:<26} {:<52} decode plan {}x{} vs {}x{}: max |diff| {:.1e}; decode vs trainer: {:.1e}",
        "attention (last position)",
        format!("{len} keys, H {hq} Hkv {hkv}"),
        p1.splits,
        p1.chunk,
        p64.splits,
        p64.chunk,
        max_abs_diff(&d1, &d64)?,
        max_abs_diff(&d1, &trainer)?
    );
    println!(
        "BATCH INVARIANCE VERDICT: {} (asserted: rms_norm rows; the rest is measured above)",
        if failures.is_empty() { "PASS" } else { "FAIL" }
    );
    assert!(failures.is_empty(), "{failures:?}");
    Ok(())
}

/// `--true-on-policy-mode`'s kernels (issue 20): a row's bits must not depend on the batch. The
/// batch-invariant GEMM at Qwen3-4B's layer shapes (rows 1 to 256 and an offset window against a
/// 1024-row GEMM, and against an f32 reference); the LM head's log-probs of 64 engine rows against
/// the trainer's over 1024; the attention of single decode queries, of a two-sequence decode
/// batch and of a prefill chunk against the trainer's pass over the packed sequences (and against
/// the flash kernel, and its backward on the invariant forward's log-sum-exp against flash's).
#[test]
fn true_on_policy_kernels_on_cuda() -> Result<()> {
    let Ok(gpu) = Device::new_cuda(0) else {
        println!("no CUDA device: skipped");
        return Ok(());
    };
    let mut rng = Rng::new(78);
    let mut failures = Vec::new();
    let inv = vime_kernels::KernelConfig::default().with_batch_invariant(true);
    let plain = vime_kernels::KernelConfig::default();
    let big = 1024usize;
    for (n, k) in QWEN3_4B_GEMMS.into_iter().chain([(100, 72)]) {
        let x = rng.randn(&[big, k], 1.0, DType::BF16, &gpu)?;
        let w = rng.randn(&[n, k], 0.02, DType::BF16, &gpu)?;
        let t0 = Instant::now();
        let full = vime_kernels::invariant::matmul_t(&x, &w, &inv)?;
        gpu.synchronize()?;
        let ms = t0.elapsed().as_secs_f64() * 1e3;
        let mut differ = 0;
        for (a, m) in [(0usize, 1usize), (0, 8), (0, 64), (0, 256), (37, 64), (big - 3, 3)] {
            let part = vime_kernels::invariant::matmul_t(&x.narrow(0, a, m)?, &w, &inv)?;
            differ += rows_differing(&part, &full.narrow(0, a, m)?)?;
        }
        let reference = x.to_dtype(DType::F32)?.matmul(&w.to_dtype(DType::F32)?.t()?)?;
        let err = rel_err(&full.to_dtype(DType::F32)?, &reference)?;
        // Speed at decode row counts and at 1024, against cuBLAS (printed, not asserted): the
        // weight's bytes over the median time.
        let mut speed = Vec::new();
        for m in [1usize, 64, 256, big] {
            let xm = x.narrow(0, 0, m)?.contiguous()?;
            let bi = median_ms(&gpu, 20, &mut || {
                vime_kernels::invariant::matmul_t(&xm, &w, &inv)?;
                Ok(())
            })?;
            let cublas = median_ms(&gpu, 20, &mut || {
                xm.matmul(&w.t()?)?;
                Ok(())
            })?;
            speed.push(format!("M {m}: {bi:.3} / {cublas:.3} ms"));
        }
        println!(
            "{:<26} {:<40} bi / cuBLAS: {}",
            "bi gemm speed",
            format!("[M, {k}] x [{n}, {k}]^T"),
            speed.join(", ")
        );
        let ok = differ == 0 && err < 1e-2;
        println!(
            "{:<26} {:<40} rows differing: {differ}, rel err vs f32 {err:.1e}, {ms:.2} ms  {}",
            "bi gemm",
            format!("[M, {k}] x [{n}, {k}]^T"),
            if ok { "ok" } else { "FAIL" }
        );
        if !ok {
            failures.push(format!("bi gemm {n}x{k}: {differ} rows differ, rel err {err:.1e}"));
        }
    }
    // The LM head: the engine's 64 rows (its logits, then the trainer's kernel on its hidden rows)
    // against the trainer's 1024-row call.
    let (vocab, hid) = (151_936usize, 2560usize);
    let lm = rng.randn(&[vocab, hid], 0.02, DType::BF16, &gpu)?;
    let h = rng.randn(&[big, hid], 1.0, DType::BF16, &gpu)?;
    let m = 64usize;
    let logits = vime_kernels::lm_head::logits_f32_with(&h.narrow(0, 0, m)?, &lm, &inv)?;
    let toks = vime_kernels::sample::sample_gumbel(&logits, &vec![1; m], &vec![0; m], &vec![1.0; m])?;
    let engine_t: Arc<[u32]> = toks.clone().into();
    let (elp, _) = vime_kernels::logprobs_entropy_with(&h.narrow(0, 0, m)?, &lm, &engine_t, m, &inv)?;
    let mut all: Vec<u32> = toks.clone();
    all.extend((m..big).map(|i| (i * 7919 % vocab) as u32));
    let all: Arc<[u32]> = all.into();
    let (tlp, _) = vime_kernels::logprobs_entropy_with(&h, &lm, &all, 4096, &inv)?;
    let (plp, _) = vime_kernels::logprobs_entropy(&h, &lm, &all, 4096)?;
    let tlp = tlp.narrow(0, 0, m)?;
    let same = m - rows_differing(&elp.unsqueeze(1)?, &tlp.unsqueeze(1)?)?;
    let gap = max_abs_diff(&tlp, &plp.narrow(0, 0, m)?)?;
    let ok = same == m && gap < 1e-2;
    println!(
        "{:<26} {:<40} engine vs trainer bit-equal {same}/{m}; vs cuBLAS mode max |diff| {gap:.1e}  {}",
        "lm head logprobs",
        format!("[{m} of {big}, {hid}] x [{vocab}, {hid}]^T"),
        if ok { "ok" } else { "FAIL" }
    );
    if !ok {
        failures.push(format!("lm head: {same}/{m} bit-equal, gap to cuBLAS {gap:.1e}"));
    }
    // Attention: two packed sequences (300 and 77 tokens), the trainer's call over both.
    for (hq, hkv) in [(32usize, 8usize), (16, 8), (8, 1)] {
        let d = 128usize;
        let (l0, l1) = (300usize, 77usize);
        let t = l0 + l1;
        let q = rng.randn(&[t, hq, d], 1.0, DType::BF16, &gpu)?;
        let kk = rng.randn(&[t, hkv, d], 1.0, DType::BF16, &gpu)?;
        let vv = rng.randn(&[t, hkv, d], 1.0, DType::BF16, &gpu)?;
        let cu: Arc<[u32]> = [0u32, l0 as u32, t as u32].into();
        let scale = 1.0 / (d as f64).sqrt();
        let (full, saved) = vime_kernels::varlen_attention_saved(&q, &kk, &vv, &cu, &cu, scale, &inv)?;
        let mut differ = 0;
        // Single decode queries at positions of sequence 0 (chunk edges at 32).
        for p in [0usize, 1, 31, 32, 33, 150, l0 - 1] {
            let (cq, ck): (Arc<[u32]>, Arc<[u32]>) = ([0u32, 1].into(), [0u32, p as u32 + 1].into());
            let one = vime_kernels::varlen_attention(
                &q.narrow(0, p, 1)?,
                &kk.narrow(0, 0, p + 1)?,
                &vv.narrow(0, 0, p + 1)?,
                &cq,
                &ck,
                scale,
                &inv,
            )?;
            differ += rows_differing(&one.flatten_from(1)?, &full.narrow(0, p, 1)?.flatten_from(1)?)?;
        }
        // A decode batch of both sequences' last queries over their gathered keys.
        let last = Tensor::cat(&[q.narrow(0, l0 - 1, 1)?, q.narrow(0, t - 1, 1)?], 0)?;
        let (cq, ck): (Arc<[u32]>, Arc<[u32]>) = ([0u32, 1, 2].into(), [0u32, l0 as u32, t as u32].into());
        let both = vime_kernels::varlen_attention(&last, &kk, &vv, &cq, &ck, scale, &inv)?;
        let want = Tensor::cat(&[full.narrow(0, l0 - 1, 1)?, full.narrow(0, t - 1, 1)?], 0)?;
        differ += rows_differing(&both.flatten_from(1)?, &want.flatten_from(1)?)?;
        // A prefill chunk: queries 100..300 of sequence 0 against its keys 0..300.
        let (cq, ck): (Arc<[u32]>, Arc<[u32]>) = ([0u32, 200].into(), [0u32, l0 as u32].into());
        let chunk = vime_kernels::varlen_attention(
            &q.narrow(0, 100, 200)?,
            &kk.narrow(0, 0, l0)?,
            &vv.narrow(0, 0, l0)?,
            &cq,
            &ck,
            scale,
            &inv,
        )?;
        differ += rows_differing(&chunk.flatten_from(1)?, &full.narrow(0, 100, 200)?.flatten_from(1)?)?;
        let (flash, fsaved) = vime_kernels::varlen_attention_saved(&q, &kk, &vv, &cu, &cu, scale, &plain)?;
        let gap = max_abs_diff(&full, &flash)?;
        let dout = rng.randn(&[t, hq, d], 1.0, DType::BF16, &gpu)?;
        let (dq, dk, dv) = vime_kernels::varlen_attention_backward(&saved, &q, &kk, &vv, &full, &dout)?;
        let (fq, fk, fv) = vime_kernels::varlen_attention_backward(&fsaved, &q, &kk, &vv, &flash, &dout)?;
        let gerr = [rel_err(&dq, &fq)?, rel_err(&dk, &fk)?, rel_err(&dv, &fv)?]
            .into_iter()
            .fold(0f64, f64::max);
        let ok = differ == 0 && gap < 2e-2 && gerr < 2e-2;
        println!(
            "{:<26} {:<40} rows differing: {differ}; vs default kernel max |diff| {gap:.1e}, backward rel err {gerr:.1e}  {}",
            "bi attention",
            format!("H {hq} Hkv {hkv}, sequences {l0} + {l1}"),
            if ok { "ok" } else { "FAIL" }
        );
        if !ok {
            failures.push(format!(
                "bi attention H {hq} Hkv {hkv}: {differ} rows differ, gap {gap:.1e}, backward {gerr:.1e}"
            ));
        }
    }
    println!(
        "TRUE ON POLICY KERNELS VERDICT: {}",
        if failures.is_empty() { "PASS" } else { "FAIL" }
    );
    assert!(failures.is_empty(), "{failures:?}");
    Ok(())
}

/// Prints one check's line (`op`, `shape`, what it measured, ok or FAIL) and records a failure.
/// `widen_into_sums` on the GPU (one launch for every tensor, the sums updated in place) against
/// its CPU path (`sum + g.to_dtype(F32)`, `g.to_dtype(F32)`), bit for bit: Qwen3-4B's norm widths,
/// with and without a running sum, a -0.0 gradient element without a sum (must stay -0.0), and an
/// empty tensor; the in-place sums must be the buffers returned.
fn check_widen_into_sums(gpu: &Device, rng: &mut Rng, failures: &mut Vec<String>) -> Result<()> {
    let bf = DType::BF16;
    let shapes: [&[usize]; 6] = [&[128], &[2560], &[128], &[2560], &[0], &[3, 5]];
    let mut items_cpu = Vec::new();
    let mut items_gpu = Vec::new();
    for (i, sh) in shapes.iter().enumerate() {
        let mut g = rng.randn(sh, 0.5, bf, &Device::Cpu)?;
        if i == 2 {
            // -0.0 at element 0 of a gradient with no sum
            let mut v = g.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            v[0] = -0.0;
            g = Tensor::from_vec(v, sh.to_vec(), &Device::Cpu)?.to_dtype(bf)?;
        }
        let sum = (i % 2 == 1)
            .then(|| rng.randn(sh, 2.0, DType::F32, &Device::Cpu))
            .transpose()?;
        items_gpu.push((g.to_device(gpu)?, sum.as_ref().map(|s| s.to_device(gpu)).transpose()?));
        items_cpu.push((g, sum));
    }
    let sum_ids: Vec<Option<candle_core::TensorId>> =
        items_gpu.iter().map(|(_, s)| s.as_ref().map(|s| s.id())).collect();
    let want = vime_kernels::widen_into_sums(items_cpu, DType::F32)?;
    let got = vime_kernels::widen_into_sums(items_gpu, DType::F32)?;
    let mut same = want.len() == got.len();
    for (w, g) in want.iter().zip(&got) {
        let (w, g) = (
            w.flatten_all()?.to_vec1::<f32>()?,
            g.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?,
        );
        same &= w.len() == g.len() && w.iter().zip(&g).all(|(a, b)| a.to_bits() == b.to_bits());
    }
    let in_place = got.iter().zip(&sum_ids).all(|(g, p)| p.is_none_or(|p| g.id() == p));
    report(
        failures,
        "widen_into_sums",
        "6 tensors (128, 2560, [3, 5], empty), bf16 -> f32",
        &format!("bit-equal to the CPU {same}, sums in place {in_place}"),
        same && in_place,
    );
    Ok(())
}

fn report(failures: &mut Vec<String>, op: &str, shape: &str, detail: &str, ok: bool) {
    println!("{op:<26} {shape:<52} {detail}  {}", if ok { "ok" } else { "FAIL" });
    if !ok {
        failures.push(format!("{op} {shape}: {detail}"));
    }
}

/// FP8 quantization (`cuda/fp8.cu`) bit for bit against the CPU reference of `vime_kernels::fp8`
/// (bits, transpose and scale), at a projection's shape with an outlier, an odd shape (the
/// kernels' scalar tails) in E5M2, unpadded and with its rows padded to 16 (the transpose's
/// vector stores over zero rows), and an all-zero tensor; then the FP8 GEMM (cuBLASLt) against
/// the f64 product of the dequantized operands: a bf16 output, a weight gradient added to an
/// f32 sum (E5M2 x E4M3), the error for a shape Hopper's FP8 GEMMs cannot take, and a two-term
/// input gradient summed in bf16 by the GEMMs (`matmul_t_sum`) with padded rows.
/// Delayed FP8 scaling (`fp8::AmaxHistory`, `--fp8-recipe delayed`): the CUDA history (the
/// cast scaling by a device amax and recording its tiles' maxima by atomicMax, and the commit
/// kernel) against the CPU history, bit for bit, over a sequence of tensors of three roles:
/// seeding by current scaling, a tensor recorded twice before a commit, a read that records
/// nothing, a tensor larger than its scale allows (saturation), odd shapes with padded rows and
/// transposes, margin 1 and the max of a history of 3. Every quantized tensor's bits, transpose
/// and scale_inv, and the rows after every commit.
fn check_fp8_delayed(gpu: &Device, rng: &mut Rng, failures: &mut Vec<String>) -> Result<()> {
    use vime_kernels::fp8::{AmaxHistory, DelayedScaling, Fp8Format};
    let cfg = DelayedScaling {
        history_len: 3,
        use_max: true,
        margin: 1,
    };
    let (mut cpu, mut dev) = (AmaxHistory::new(cfg, 3, &Device::Cpu)?, AmaxHistory::new(cfg, 3, gpu)?);
    // (slot, rows, cols, scale, format, record, commit after)
    let steps: [(usize, usize, usize, f64, Fp8Format, bool, bool); 12] = [
        (0, 1040, 2560, 1.0, Fp8Format::E4M3, true, false),
        (1, 70, 37, 1e-3, Fp8Format::E5M2, true, false),
        (0, 1040, 2560, 2.0, Fp8Format::E4M3, true, false),
        (2, 64, 96, 1.0, Fp8Format::E4M3, false, true),
        (0, 517, 2560, 0.5, Fp8Format::E4M3, true, false),
        (1, 70, 37, 1e-3, Fp8Format::E5M2, true, false),
        (2, 64, 96, 1.0, Fp8Format::E4M3, false, true),
        (0, 1040, 2560, 30.0, Fp8Format::E4M3, true, false),
        (1, 33, 40, 5e-3, Fp8Format::E5M2, false, true),
        (0, 1040, 2560, 1.0, Fp8Format::E4M3, true, true),
        (1, 70, 37, 1e-3, Fp8Format::E5M2, true, true),
        (0, 16, 2560, 1.0, Fp8Format::E4M3, false, false),
    ];
    let (mut worst, mut all) = (String::new(), true);
    for (i, &(slot, rows, cols, scale, fmt, record, commit)) in steps.iter().enumerate() {
        let x = (rng.randn(&[rows, cols], 1.0, DType::F32, &Device::Cpu)? * scale)?.to_dtype(DType::BF16)?;
        let want = cpu.quantize(slot, &x, fmt, true, 16, record)?;
        let got = dev.quantize(slot, &x.to_device(gpu)?, fmt, true, 16, record)?;
        let same = |a: &Tensor, b: &Tensor| -> Result<bool> {
            Ok(a.flatten_all()?.to_vec1::<u8>()? == b.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<u8>()?)
        };
        let bits = same(&want.data, &got.data)?;
        let bits_t = same(want.data_t.as_ref().unwrap(), got.data_t.as_ref().unwrap())?;
        let (s_w, s_g) = (
            want.scale_inv.to_vec1::<f32>()?[0],
            got.scale_inv.to_device(&Device::Cpu)?.to_vec1::<f32>()?[0],
        );
        let mut ok = bits && bits_t && s_w.to_bits() == s_g.to_bits();
        if commit {
            cpu.commit()?;
            dev.commit()?;
        }
        let (hc, hd) = (cpu.to_host()?, dev.to_host()?);
        let rows_same = hc.0.iter().map(|v| v.to_bits()).eq(hd.0.iter().map(|v| v.to_bits())) && hc.1 == hd.1;
        ok &= rows_same;
        if !ok {
            all = false;
            worst = format!(
                "step {i} (slot {slot} [{rows}, {cols}] x{scale}): bits {bits}, transpose {bits_t}, scale_inv {s_g:e} vs {s_w:e}, history {rows_same} ({:?} vs {:?})",
                &hd.0[..5.min(hd.0.len())],
                &hc.0[..5.min(hc.0.len())]
            );
            break;
        }
    }
    let (rows, seeded) = cpu.to_host()?;
    report(
        failures,
        "fp8 delayed scaling",
        "12 tensors, 3 roles, history 3 max, margin 1",
        &if all {
            format!(
                "bits, transposes, scales and histories equal; amaxes {:?}, seeded {seeded:?}",
                [rows[1], rows[6], rows[11]]
            )
        } else {
            worst
        },
        all,
    );
    Ok(())
}

/// The fused SwiGLU casts of delayed scaling (`vime_fp8_swiglu_cast`, `vime_fp8_swiglu_bwd_cast`,
/// through `AmaxHistory::try_quantize_swiglu` / `try_quantize_swiglu_backward`) against the
/// two-kernel path on the same GPU (`swiglu` / `swiglu_backward`, then `AmaxHistory::quantize`),
/// bit for bit: the FP8 rows and transposes, `scale_inv`, and the histories after each commit.
/// Both histories are seeded by the same first micro-batch (which takes the two-kernel path in
/// both); the fused kernels must run on every later one. Shapes: an MLP's [1040, 3072], rows that
/// leave a partial tile, an odd width (the scalar loads) and a misaligned row view; records on
/// and off.
fn check_fp8_swiglu_fused(gpu: &Device, rng: &mut Rng, failures: &mut Vec<String>) -> Result<()> {
    use vime_kernels::fp8::{AmaxHistory, DelayedScaling, Fp8Format, Fp8Tensor};
    let cfg = DelayedScaling {
        history_len: 2,
        use_max: true,
        margin: 1,
    };
    let (mut fused, mut plain) = (AmaxHistory::new(cfg, 3, gpu)?, AmaxHistory::new(cfg, 3, gpu)?);
    let bits = |t: &Tensor| -> Result<Vec<u8>> { t.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<u8>() };
    let same = |a: &Fp8Tensor, b: &Fp8Tensor| -> Result<bool> {
        let t = match (&a.data_t, &b.data_t) {
            (Some(x), Some(y)) => bits(x)? == bits(y)?,
            (None, None) => true,
            _ => false,
        };
        let s =
            |q: &Fp8Tensor| -> Result<u32> { Ok(q.scale_inv.to_device(&Device::Cpu)?.to_vec1::<f32>()?[0].to_bits()) };
        Ok(t && bits(&a.data)? == bits(&b.data)? && s(a)? == s(b)? && a.rows == b.rows)
    };
    // (rows, cols, row offset of a view, record, forward transpose)
    let steps: [(usize, usize, usize, bool, bool); 6] = [
        (1040, 3072, 0, true, true),
        (1040, 3072, 0, true, true),
        (70, 40, 0, false, false),
        (33, 37, 1, true, true),
        (517, 3072, 0, true, true),
        (1040, 3072, 0, false, true),
    ];
    let (mut all, mut worst) = (true, String::new());
    for (i, &(rows, cols, off, record, tr)) in steps.iter().enumerate() {
        let make = |scale: f64, rng: &mut Rng| -> Result<Tensor> {
            let t = (rng.randn(&[rows + off, cols], 1.0, DType::F32, &Device::Cpu)? * scale)?.to_dtype(DType::BF16)?;
            t.to_device(gpu)?.narrow(0, off, rows)
        };
        let (g, u, dy) = (make(2.0, rng)?, make(1.0, rng)?, make(1e-3 * (1 + i) as f64, rng)?);
        let act = vime_kernels::swiglu(&g, &u)?;
        let (dg, du) = vime_kernels::swiglu_backward(&g, &u, &dy)?;
        // The fused kernels run from the second micro-batch on (the first seeds the histories
        // through the two-kernel path, in both).
        let fwd_q = fused.try_quantize_swiglu(0, &g, &u, Fp8Format::E4M3, tr, 16, record)?;
        let bwd_q = fused.try_quantize_swiglu_backward((1, 2), &g, &u, &dy, Fp8Format::E5M2, 16, record)?;
        let ran = fwd_q.is_some() && bwd_q.is_some();
        let a = match fwd_q {
            Some(q) => q,
            None => fused.quantize(0, &act, Fp8Format::E4M3, tr, 16, record)?,
        };
        let (ag, au) = match bwd_q {
            Some(q) => q,
            None => (
                fused.quantize(1, &dg, Fp8Format::E5M2, true, 16, record)?,
                fused.quantize(2, &du, Fp8Format::E5M2, true, 16, record)?,
            ),
        };
        let b = plain.quantize(0, &act, Fp8Format::E4M3, tr, 16, record)?;
        let (bg, bu) = (
            plain.quantize(1, &dg, Fp8Format::E5M2, true, 16, record)?,
            plain.quantize(2, &du, Fp8Format::E5M2, true, 16, record)?,
        );
        fused.commit()?;
        plain.commit()?;
        let (hf, hp) = (fused.to_host()?, plain.to_host()?);
        let hist = hf.0.iter().map(|v| v.to_bits()).eq(hp.0.iter().map(|v| v.to_bits())) && hf.1 == hp.1;
        let (fwd, dgate, dup) = (same(&a, &b)?, same(&ag, &bg)?, same(&au, &bu)?);
        let path = ran == (i > 0);
        if !(fwd && dgate && dup && hist && path) {
            all = false;
            worst = format!(
                "micro-batch {i} [{rows}, {cols}] +{off}: fused kernels ran {ran}, forward {fwd}, d_gate {dgate}, d_up {dup}, histories {hist} ({:?} vs {:?})",
                &hf.0[..4],
                &hp.0[..4]
            );
            break;
        }
    }
    report(
        failures,
        "fp8 fused swiglu casts",
        "6 micro-batches, history 2 max, margin 1",
        &if all {
            "fused from micro-batch 1 on; bits, transposes, scales and histories equal to swiglu + cast".to_string()
        } else {
            worst
        },
        all,
    );
    Ok(())
}

fn check_fp8(gpu: &Device, rng: &mut Rng, failures: &mut Vec<String>) -> Result<()> {
    use vime_kernels::cuda::{fp8_matmul_t, Fp8Operand};
    use vime_kernels::fp8::{quantize, quantize_padded, Fp8Format, Fp8Tensor};
    for (rows, cols, fmt, scale, pad) in [
        (1040usize, 2560usize, Fp8Format::E4M3, 1.0f32, 1usize),
        (70, 37, Fp8Format::E5M2, 1e-3, 1),
        (70, 37, Fp8Format::E5M2, 1e-3, 16),
        (64, 96, Fp8Format::E4M3, 0.0, 1),
    ] {
        let x = (rng.randn(&[rows, cols], 1.0, DType::F32, &Device::Cpu)? * scale as f64)?;
        let x = if scale > 0.0 {
            x.slice_assign(&[1..2, 3..4], &Tensor::full(-40.0 * scale, (1, 1), &Device::Cpu)?)?
        } else {
            x
        };
        let x = x.to_dtype(DType::BF16)?;
        let want = quantize_padded(&x, fmt, true, pad)?;
        let got = quantize_padded(&x.to_device(gpu)?, fmt, true, pad)?;
        let same = |a: &Tensor, b: &Tensor| -> Result<bool> {
            Ok(a.flatten_all()?.to_vec1::<u8>()? == b.to_device(&Device::Cpu)?.flatten_all()?.to_vec1::<u8>()?)
        };
        let bits = same(&want.data, &got.data)?;
        let bits_t = same(want.data_t.as_ref().unwrap(), got.data_t.as_ref().unwrap())?;
        let s_w = want.scale_inv.to_vec1::<f32>()?[0];
        let s_g = got.scale_inv.to_device(&Device::Cpu)?.to_vec1::<f32>()?[0];
        let ok = bits && bits_t && s_w.to_bits() == s_g.to_bits();
        report(
            failures,
            "fp8 quantize",
            &format!("[{rows}, {cols}] rows padded to {pad}, {fmt:?} x{scale}"),
            &format!("bits {bits}, transpose {bits_t}, scale_inv {s_g:e} vs {s_w:e}"),
            ok,
        );
    }
    // The GEMMs: out [n, m] = x [n, k] . w [m, k]^T.
    let q = |t: &Tensor, fmt| -> Result<Fp8Tensor> { quantize(&t.to_dtype(DType::BF16)?.to_device(gpu)?, fmt, false) };
    let op = Fp8Operand::of;
    let f64_of = |t: &Fp8Tensor| -> Result<Tensor> { t.dequantize()?.to_dtype(DType::F64) };
    let (n, m, k) = (1040usize, 1536usize, 2560usize);
    let x = q(&rng.randn(&[n, k], 1.0, DType::F32, &Device::Cpu)?, Fp8Format::E4M3)?;
    let w = q(&rng.randn(&[m, k], 0.02, DType::F32, &Device::Cpu)?, Fp8Format::E4M3)?;
    let want = f64_of(&x)?.matmul(&f64_of(&w)?.t()?)?;
    for fast in [false, true] {
        let got = fp8_matmul_t(op(&x), op(&w), None, DType::BF16, fast)?.expect("a new output");
        let err = rel_err(&got.to_device(&Device::Cpu)?.to_dtype(DType::F64)?, &want)?;
        let ok = got.dtype() == DType::BF16 && err <= TOL;
        report(
            failures,
            "fp8_matmul_t",
            &format!("[{n}, {k}] . [{m}, {k}]^T E4M3, bf16 out, fast accum {fast}"),
            &format!("rel err vs f64 {err:.1e}"),
            ok,
        );
    }
    let dy_t = q(&rng.randn(&[m, n], 1e-3, DType::F32, &Device::Cpu)?, Fp8Format::E5M2)?;
    let x_t = q(&rng.randn(&[k, n], 1.0, DType::F32, &Device::Cpu)?, Fp8Format::E4M3)?;
    let sum = rng.randn(&[m, k], 0.05, DType::F32, &Device::Cpu)?;
    let want = (sum.to_dtype(DType::F64)? + f64_of(&dy_t)?.matmul(&f64_of(&x_t)?.t()?)?)?;
    let sum_gpu = sum.to_device(gpu)?;
    let none = fp8_matmul_t(op(&dy_t), op(&x_t), Some(&sum_gpu), DType::F32, false)?;
    let err = rel_err(&sum_gpu.to_device(&Device::Cpu)?.to_dtype(DType::F64)?, &want)?;
    let odd = q(&rng.randn(&[40, 24], 1.0, DType::F32, &Device::Cpu)?, Fp8Format::E4M3)?;
    let bad = fp8_matmul_t(op(&odd), op(&odd), None, DType::BF16, false);
    let named = matches!(&bad, Err(e) if e.to_string().contains("multiple of 16"));
    // Not f32's 1e-7: Hopper's FP8 tensor cores accumulate below f32 precision between cuBLAS's
    // promotions to f32 (measured 9.5e-5 and 1.0e-4 on two data draws, 2026-12-04); a wrong
    // operand or scale is off by O(1).
    let ok = none.is_none() && err <= 1e-3 && named;
    report(
        failures,
        "fp8_matmul_t += f32",
        &format!("sum [{m}, {k}] + [{m}, {n}] E5M2 . [{k}, {n}]^T E4M3"),
        &format!("rel err vs f64 {err:.1e}, shape error {named}"),
        ok,
    );
    // An input gradient through two projections (gate/up's): the second GEMM adds into the
    // first's bf16 output, x's rows padded (1030 -> 1040) and dropped at the end.
    let rows = 1030;
    let qp = |t: &Tensor, fmt| -> Result<Fp8Tensor> {
        vime_kernels::fp8::quantize_padded(&t.to_dtype(DType::BF16)?.to_device(gpu)?, fmt, false, 16)
    };
    let (g1, g2) = (
        qp(&rng.randn(&[rows, k], 1e-3, DType::F32, &Device::Cpu)?, Fp8Format::E5M2)?,
        qp(&rng.randn(&[rows, k], 1e-3, DType::F32, &Device::Cpu)?, Fp8Format::E5M2)?,
    );
    let (w1, w2) = (
        q(&rng.randn(&[m, k], 0.02, DType::F32, &Device::Cpu)?, Fp8Format::E4M3)?,
        q(&rng.randn(&[m, k], 0.02, DType::F32, &Device::Cpu)?, Fp8Format::E4M3)?,
    );
    let p =
        |x: &Fp8Tensor, w: &Fp8Tensor| -> Result<Tensor> { f64_of(x)?.narrow(0, 0, rows)?.matmul(&f64_of(w)?.t()?) };
    let want = (p(&g1, &w1)? + p(&g2, &w2)?)?;
    use vime_kernels::fp8::{matmul_t_sum, Side};
    let got = matmul_t_sum(
        &[(&g1, Side::Rows, &w1, Side::Rows), (&g2, Side::Rows, &w2, Side::Rows)],
        DType::BF16,
        false,
    )?;
    let err = rel_err(&got.to_device(&Device::Cpu)?.to_dtype(DType::F64)?, &want)?;
    report(
        failures,
        "fp8 matmul_t_sum bf16",
        &format!("[{rows} (pad 1040), {k}] . [{m}, {k}]^T x 2 E5M2 . E4M3"),
        &format!("dims {:?}, rel err vs f64 {err:.1e}", got.dims()),
        got.dims() == [rows, m] && got.dtype() == DType::BF16 && err <= TOL,
    );
    Ok(())
}

/// The FP8 checks alone (also part of `every_op_on_cuda_matches_the_cpu_kernel`).
#[test]
fn fp8_on_cuda_matches_the_cpu() -> Result<()> {
    let gpu = Device::new_cuda(0)?;
    let mut rng = Rng::new(21);
    let mut failures = Vec::new();
    check_fp8(&gpu, &mut rng, &mut failures)?;
    check_fp8_delayed(&gpu, &mut rng, &mut failures)?;
    check_fp8_swiglu_fused(&gpu, &mut rng, &mut failures)?;
    println!("FP8 VERDICT: {}", if failures.is_empty() { "PASS" } else { "FAIL" });
    assert!(failures.is_empty(), "{failures:?}");
    Ok(())
}
