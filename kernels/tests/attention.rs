//! `varlen_attention` against a reference composed of candle ops (per sequence, repeated kv heads,
//! masked with -inf, softmax from exp/sum/div), finite differences in f64, the bottom-right causal
//! convention, reduced precision, determinism across thread counts, and input validation.
use candle_core::{DType, Device, Result, Tensor, D};
use std::sync::Arc;
use vime_kernels::testing::{autograd_grads, finite_diff_grads, rel_err, weighted_sum, Rng};
use vime_kernels::{AttentionBackend, CudnnFailure, KernelConfig};

/// The op under the default kernel config (the CPU path never consults it).
fn varlen_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_q: &Arc<[u32]>,
    cu_k: &Arc<[u32]>,
    scale: f64,
) -> Result<Tensor> {
    vime_kernels::varlen_attention(q, k, v, cu_q, cu_k, scale, &KernelConfig::default())
}

fn cu(lens: &[u32]) -> Arc<[u32]> {
    let mut out = vec![0u32];
    for &l in lens {
        out.push(out.last().unwrap() + l);
    }
    out.into()
}

/// Causal GQA attention from candle ops, one sequence at a time, never looking at the kernel.
fn reference(q: &Tensor, k: &Tensor, v: &Tensor, cu_q: &[u32], cu_k: &[u32], scale: f64) -> Result<Tensor> {
    let (_, h, _) = q.dims3()?;
    let (_, hkv, _) = k.dims3()?;
    let dev = q.device();
    let kv_of_head: Vec<u32> = (0..h).map(|x| (x / (h / hkv)) as u32).collect();
    let kv_of_head = Tensor::from_vec(kv_of_head, h, dev)?;
    let mut outs = Vec::new();
    for s in 0..cu_q.len() - 1 {
        let (q0, lq) = (cu_q[s] as usize, (cu_q[s + 1] - cu_q[s]) as usize);
        let (k0, lk) = (cu_k[s] as usize, (cu_k[s + 1] - cu_k[s]) as usize);
        if lq == 0 {
            continue;
        }
        let qs = q.narrow(0, q0, lq)?.transpose(0, 1)?.contiguous()?;
        let repeat = |x: &Tensor| {
            x.narrow(0, k0, lk)?
                .transpose(0, 1)?
                .contiguous()?
                .index_select(&kv_of_head, 0)
        };
        let (ks, vs) = (repeat(k)?, repeat(v)?);
        let scores = (qs.matmul(&ks.t()?.contiguous()?)? * scale)?;
        let off = lk - lq;
        let mask: Vec<u8> = (0..lq)
            .flat_map(|i| (0..lk).map(move |j| (j <= i + off) as u8))
            .collect();
        let mask = Tensor::from_vec(mask, (lq, lk), dev)?
            .broadcast_as(scores.shape())?
            .contiguous()?;
        let neg_inf = Tensor::new(f64::NEG_INFINITY, dev)?
            .to_dtype(scores.dtype())?
            .broadcast_as(scores.shape())?
            .contiguous()?;
        let scores = mask.where_cond(&scores, &neg_inf)?;
        let max = scores.max_keepdim(D::Minus1)?.detach();
        let e = scores.broadcast_sub(&max)?.exp()?;
        let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
        outs.push(p.matmul(&vs)?.transpose(0, 1)?.contiguous()?);
    }
    Tensor::cat(&outs, 0)
}

struct Case {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_q: Arc<[u32]>,
    cu_k: Arc<[u32]>,
    scale: f64,
}

fn self_attention_case(lens: &[u32], h: usize, hkv: usize, d: usize, dtype: DType, seed: u64) -> Result<Case> {
    let t = lens.iter().sum::<u32>() as usize;
    let mut rng = Rng::new(seed);
    let dev = Device::Cpu;
    let cu = cu(lens);
    Ok(Case {
        q: rng.randn(&[t, h, d], 1.0, dtype, &dev)?,
        k: rng.randn(&[t, hkv, d], 1.0, dtype, &dev)?,
        v: rng.randn(&[t, hkv, d], 1.0, dtype, &dev)?,
        cu_q: cu.clone(),
        cu_k: cu,
        scale: 1.0 / (d as f64).sqrt(),
    })
}

impl Case {
    fn inputs(&self) -> Vec<Tensor> {
        vec![self.q.clone(), self.k.clone(), self.v.clone()]
    }
    fn kernel(&self, x: &[Tensor]) -> Result<Tensor> {
        varlen_attention(&x[0], &x[1], &x[2], &self.cu_q, &self.cu_k, self.scale)
    }
    fn reference(&self, x: &[Tensor]) -> Result<Tensor> {
        reference(&x[0], &x[1], &x[2], &self.cu_q, &self.cu_k, self.scale)
    }
    fn kernel_grads(&self, seed: u64) -> Result<Vec<Tensor>> {
        autograd_grads(&|x| weighted_sum(&self.kernel(x)?, seed), &self.inputs())
    }
}

#[test]
fn matches_composed_reference_f32() -> Result<()> {
    let c = self_attention_case(&[5, 9, 0, 1], 4, 2, 8, DType::F32, 1)?;
    let out = c.kernel(&c.inputs())?;
    let want = c.reference(&c.inputs())?;
    assert_eq!(out.dims(), &[15, 4, 8]);
    assert_eq!(out.dtype(), DType::F32);
    let e = rel_err(&out, &want)?;
    assert!(e <= 1e-5, "forward rel_err {e}");

    let got = c.kernel_grads(7)?;
    let want = autograd_grads(&|x| weighted_sum(&c.reference(x)?, 7), &c.inputs())?;
    for (name, (g, w)) in ["dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
        assert_eq!(g.dims(), w.dims(), "{name}");
        let e = rel_err(g, w)?;
        assert!(e <= 1e-4, "{name} rel_err {e}");
    }
    Ok(())
}

#[test]
fn backward_matches_finite_differences_f64() -> Result<()> {
    let c = self_attention_case(&[3, 4], 2, 1, 4, DType::F64, 2)?;
    let f = |x: &[Tensor]| weighted_sum(&c.kernel(x)?, 11);
    let got = autograd_grads(&f, &c.inputs())?;
    let want = finite_diff_grads(&f, &c.inputs(), 1e-5)?;
    for (name, (g, w)) in ["dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
        let e = rel_err(g, w)?;
        assert!(e <= 1e-6, "{name} rel_err {e}");
    }
    Ok(())
}

#[test]
fn query_chunk_is_bottom_right_aligned() -> Result<()> {
    // Full self-attention over sequences of 7, 4 and 5 tokens; the chunk keeps the last 3, all 4
    // and the last 1 queries of them against all of their keys.
    let lens = [7u32, 4, 5];
    let full = self_attention_case(&lens, 4, 2, 8, DType::F32, 3)?;
    let keep = [(4usize, 3usize), (7, 4), (15, 1)];
    let rows = |x: &Tensor| -> Result<Tensor> {
        Tensor::cat(
            &keep
                .iter()
                .map(|&(at, n)| x.narrow(0, at, n))
                .collect::<Result<Vec<_>>>()?,
            0,
        )
    };
    let chunk = Case {
        q: rows(&full.q)?,
        cu_q: cu(&[3, 4, 1]),
        cu_k: full.cu_k.clone(),
        k: full.k.clone(),
        v: full.v.clone(),
        ..full
    };

    let out = chunk.kernel(&chunk.inputs())?;
    let want = rows(&full.kernel(&full.inputs())?)?;
    assert_eq!(out.dims(), &[8, 4, 8]);
    let e = rel_err(&out, &want)?;
    assert!(e <= 1e-6, "chunk vs full rows rel_err {e}");
    let e = rel_err(&out, &chunk.reference(&chunk.inputs())?)?;
    assert!(e <= 1e-5, "chunk vs composed reference rel_err {e}");

    let got = chunk.kernel_grads(5)?;
    let want = autograd_grads(&|x| weighted_sum(&rows(&full.kernel(x)?)?, 5), &full.inputs())?;
    let e = rel_err(&got[0], &rows(&want[0])?)?;
    assert!(e <= 1e-6, "dq rel_err {e}");
    for (name, i) in [("dk", 1), ("dv", 2)] {
        let e = rel_err(&got[i], &want[i])?;
        assert!(e <= 1e-6, "{name} rel_err {e}");
    }
    Ok(())
}

#[test]
fn reduced_precision_matches_f32() -> Result<()> {
    let c16 = self_attention_case(&[6, 11, 1], 4, 2, 16, DType::BF16, 4)?;
    let up = |x: &Tensor| x.to_dtype(DType::F32);
    let c32 = Case {
        q: up(&c16.q)?,
        k: up(&c16.k)?,
        v: up(&c16.v)?,
        cu_q: c16.cu_q.clone(),
        cu_k: c16.cu_k.clone(),
        ..c16
    };
    let want = c32.kernel(&c32.inputs())?;

    let out = c16.kernel(&c16.inputs())?;
    assert_eq!(out.dtype(), DType::BF16);
    let e = rel_err(&out, &want)?;
    assert!(e <= 1e-2, "bf16 forward rel_err {e}");

    let half = |x: &Tensor| x.to_dtype(DType::F16);
    let f16_inputs = [half(&c16.q)?, half(&c16.k)?, half(&c16.v)?];
    let out = c16.kernel(&f16_inputs)?;
    assert_eq!(out.dtype(), DType::F16);
    let e = rel_err(&out, &want)?;
    assert!(e <= 1e-3, "f16 forward rel_err {e}");

    let got = c16.kernel_grads(9)?;
    let want = c32.kernel_grads(9)?;
    for (name, (g, w)) in ["dq", "dk", "dv"].iter().zip(got.iter().zip(&want)) {
        assert_eq!(g.dtype(), DType::BF16, "{name}");
        assert_eq!(g.dims(), w.dims(), "{name}");
        let mag = g.to_dtype(DType::F32)?.abs()?.sum_all()?.to_scalar::<f32>()?;
        assert!(mag > 0.0, "{name} is all zeros");
        let e = rel_err(g, w)?;
        assert!(e <= 1e-2, "bf16 {name} rel_err {e}");
    }
    Ok(())
}

fn bits(t: &Tensor) -> Result<Vec<u32>> {
    Ok(t.flatten_all()?.to_vec1::<f32>()?.iter().map(|x| x.to_bits()).collect())
}

#[test]
fn deterministic_across_runs_and_thread_counts() -> Result<()> {
    let c = self_attention_case(&[37, 1, 64, 0, 20], 8, 2, 16, DType::F32, 6)?;
    let run = || -> Result<Vec<Vec<u32>>> {
        let mut out = vec![bits(&c.kernel(&c.inputs())?)?];
        for g in c.kernel_grads(13)? {
            out.push(bits(&g)?);
        }
        Ok(out)
    };
    let first = run()?;
    assert_eq!(first, run()?, "two runs differ");
    for threads in [1, 3] {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        assert_eq!(
            first,
            pool.install(run)?,
            "{threads} threads differ from the default pool"
        );
    }
    Ok(())
}

#[test]
fn rejects_bad_inputs_with_clear_errors() -> Result<()> {
    let dev = Device::Cpu;
    let z = |shape: &[usize]| Tensor::zeros(shape, DType::F32, &dev);
    let (q, k) = (z(&[9, 4, 8])?, z(&[9, 2, 8])?);
    let ok = cu(&[5, 4]);
    let cus = |v: &[u32]| -> Arc<[u32]> { v.into() };
    let err = |r: Result<Tensor>| match r {
        Ok(t) => panic!("expected an error, got a tensor of shape {:?}", t.dims()),
        Err(e) => e.to_string(),
    };
    let expect = |r: Result<Tensor>, needle: &str| {
        let m = err(r);
        assert!(m.contains(needle), "error {m:?} should mention {needle:?}");
    };

    assert!(varlen_attention(&q, &k, &k, &ok, &ok, 0.5).is_ok());
    expect(
        varlen_attention(&q, &k, &k, &cus(&[1, 5, 9]), &ok, 0.5),
        "must start at 0",
    );
    expect(
        varlen_attention(&q, &k, &k, &cus(&[0, 5, 8]), &cus(&[0, 5, 8]), 0.5),
        "token count 9",
    );
    expect(
        varlen_attention(&q, &k, &k, &ok, &cus(&[0, 6, 4, 9]), 0.5),
        "not monotone",
    );
    expect(varlen_attention(&q, &k, &k, &cus(&[]), &ok, 0.5), "empty");
    expect(varlen_attention(&q, &k, &k, &cus(&[0, 9]), &ok, 0.5), "sequences");
    expect(
        varlen_attention(&q, &k, &k, &ok, &cus(&[0, 3, 9]), 0.5),
        "5 queries but only 3 keys",
    );
    expect(
        varlen_attention(&z(&[9, 3, 8])?, &k, &k, &ok, &ok, 0.5),
        "multiple of n_kv_heads 2",
    );
    expect(
        varlen_attention(&q, &z(&[9, 0, 8])?, &z(&[9, 0, 8])?, &ok, &ok, 0.5),
        "multiple of n_kv_heads 0",
    );
    expect(
        varlen_attention(&q, &z(&[9, 2, 4])?, &z(&[9, 2, 4])?, &ok, &ok, 0.5),
        "head_dim",
    );
    expect(
        varlen_attention(&q, &k, &z(&[9, 1, 8])?, &ok, &ok, 0.5),
        "differ in shape",
    );
    expect(
        varlen_attention(&q, &k, &k.to_dtype(DType::F64)?, &ok, &ok, 0.5),
        "share a dtype",
    );
    expect(
        varlen_attention(&q.flatten_from(1)?, &k, &k, &ok, &ok, 0.5),
        "q must be [tokens, heads, head_dim]",
    );
    let (qi, ki) = (q.to_dtype(DType::U32)?, k.to_dtype(DType::U32)?);
    expect(varlen_attention(&qi, &ki, &ki, &ok, &ok, 0.5), "unsupported dtype");
    expect(varlen_attention(&q, &k, &k, &ok, &ok, f64::NAN), "softmax_scale");
    Ok(())
}

#[test]
fn attention_backend_names_parse_and_fused_needs_the_cudnn_build() {
    use AttentionBackend as B;
    assert_eq!("auto".parse::<B>().unwrap(), B::Auto);
    assert_eq!("fused".parse::<B>().unwrap(), B::Fused);
    assert_eq!("cudnn".parse::<B>().unwrap(), B::Fused);
    assert_eq!("flash".parse::<B>().unwrap(), B::Flash);
    let e = "local".parse::<B>().unwrap_err();
    assert!(e.contains("local") && e.contains("auto, fused"), "{e}");
    let r = KernelConfig::new(B::Fused, false, CudnnFailure::Fallback);
    if cfg!(feature = "cudnn") {
        assert_eq!(r.unwrap().attention(), B::Fused);
    } else {
        let e = r.unwrap_err();
        assert!(e.contains("cudnn feature"), "{e}");
    }
    // The CPU path never consults the backend: flash / auto give bit-identical results.
    let c = cu(&[5, 3]);
    let mut rng = Rng::new(11);
    let q = rng.randn(&[8, 4, 8], 1.0, DType::F32, &Device::Cpu).unwrap();
    let k = rng.randn(&[8, 2, 8], 1.0, DType::F32, &Device::Cpu).unwrap();
    let v = rng.randn(&[8, 2, 8], 1.0, DType::F32, &Device::Cpu).unwrap();
    let a = varlen_attention(&q, &k, &v, &c, &c, 0.3).unwrap();
    let flash = KernelConfig::new(B::Flash, true, CudnnFailure::Error).unwrap();
    let b = vime_kernels::varlen_attention(&q, &k, &v, &c, &c, 0.3, &flash).unwrap();
    assert_eq!(bits(&a).unwrap(), bits(&b).unwrap());
}
