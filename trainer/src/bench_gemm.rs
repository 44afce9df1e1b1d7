//! `vime-train bench-gemm`: the training step's GEMMs of a Qwen3 release shape at `--tokens`
//! rows, each timed as the block runs it (cuBLAS `GemmEx`, default algorithm) and through
//! cuBLASLt with each of its top heuristic algorithms (`vime_kernels::cuda::gemm_bench`), plus the
//! fused q|k|v and gate|up layers the block does not run yet, and each GEMM in FP8 with what the
//! FP8 inputs cost to make (`vime_kernels::fp8::quantize` of every activation, gradient and
//! weight a layer's GEMMs read). Prints one line per GEMM and the totals of one layer's GEMMs
//! (x layers x 1 micro-batch) for each choice.
use crate::bench::config_of;
use anyhow::Result;

#[derive(clap::Args, Debug, Clone)]
pub struct BenchGemmArgs {
    /// qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, or a path to an HF config.json.
    #[arg(long, default_value = "qwen3-4b")]
    pub model: String,
    /// Rows of every GEMM (the tokens of one micro-batch).
    #[arg(long, default_value_t = 8192)]
    pub tokens: usize,
    /// cuBLASLt heuristic algorithms timed per GEMM.
    #[arg(long, default_value_t = 16)]
    pub algos: usize,
    /// cuBLASLt heuristic algorithms timed per GEMM in its FP8 form (E4M3 weights and
    /// activations, E5M2 gradients, one scale per tensor); 0 skips FP8.
    #[arg(long, default_value_t = 4)]
    pub fp8_algos: usize,
    /// Timed calls per algorithm (after 3 warm-up calls).
    #[arg(long, default_value_t = 20)]
    pub reps: usize,
    #[arg(long, default_value = "cuda")]
    pub device: String,
}

/// Which per-layer total a linear layer counts in: the block as it runs (separate q, k, v, gate,
/// up), the fused alternative (q|k|v, gate|up), or both (o, down).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
#[derive(Clone, Copy, PartialEq)]
enum Layout {
    Separate,
    Fused,
    Both,
}

/// The block's linear layers as (name, out, in, the totals they count in), the fused ones last.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn layers(cfg: &vime_qwen3::config::Qwen3Config) -> Vec<(&'static str, usize, usize, Layout)> {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let q = cfg.num_attention_heads * cfg.head_dim;
    let kv = cfg.num_key_value_heads * cfg.head_dim;
    vec![
        ("q_proj", q, h, Layout::Separate),
        ("k_proj", kv, h, Layout::Separate),
        ("v_proj", kv, h, Layout::Separate),
        ("o_proj", h, q, Layout::Both),
        ("gate_proj", i, h, Layout::Separate),
        ("up_proj", i, h, Layout::Separate),
        ("down_proj", h, i, Layout::Both),
        ("qkv (fused)", q + 2 * kv, h, Layout::Fused),
        ("gate_up (fused)", 2 * i, h, Layout::Fused),
    ]
}

#[cfg(feature = "cuda")]
pub fn run(args: &BenchGemmArgs) -> Result<()> {
    use vime_kernels::cuda::gemm_bench::{bench, bench_fp8, bench_quantize, linear_cases};
    let cfg = config_of(&args.model)?;
    let device = crate::device::parse_device(&args.device)?;
    let t = args.tokens;
    let (mut cases, mut layouts) = (Vec::new(), Vec::new());
    for (name, out, inp, layout) in layers(&cfg) {
        let c = linear_cases(name, t, out, inp);
        layouts.extend(std::iter::repeat_n(layout, c.len()));
        cases.extend(c);
    }
    let timings = bench(&device, &cases, args.algos, args.reps)?;
    let fp8 = if args.fp8_algos > 0 {
        bench_fp8(&device, &cases, args.fp8_algos, args.reps)?
    } else {
        vec![Vec::new(); cases.len()]
    };
    println!(
        "bench-gemm model {} tokens {t} algos {} reps {}",
        args.model, args.algos, args.reps
    );
    println!(
        "{:<28} {:>6} {:>6} {:>6} {:>9} {:>7} {:>9} {:>7} {:>9} {:>7} {:>4} {:>9} {:>7} {:>9} {:>7}",
        "gemm",
        "m",
        "n",
        "k",
        "GemmEx ms",
        "TFLOP/s",
        "Lt[0] ms",
        "TFLOP/s",
        "Lt best",
        "TFLOP/s",
        "idx",
        "FP8[0] ms",
        "TFLOP/s",
        "FP8 best",
        "TFLOP/s"
    );
    // Which cuBLASLt algorithms gave other bits than GemmEx (beta-0 cases).
    let mut differ_lines = Vec::new();
    // Per-layer totals: separate projections, fused ones, each with GemmEx / Lt[0] / Lt best.
    let mut tot = std::collections::BTreeMap::<&str, [f64; 3]>::new();
    // The separate layout's GEMMs in FP8: heuristic #0 (what fp8_matmul_t runs) and the best.
    let mut fp8_tot = [0.0f64; 2];
    for ((tm, &layout), f8) in timings.iter().zip(&layouts).zip(&fp8) {
        let c = &tm.case;
        let lt0 = tm.lt_ms.first().copied().unwrap_or(f64::NAN);
        let (bi, best) = tm.lt_best().unwrap_or((usize::MAX, f64::NAN));
        let f0 = f8.first().copied().unwrap_or(f64::NAN);
        let fbest = f8.iter().copied().fold(f64::NAN, f64::min);
        println!(
            "{:<28} {:>6} {:>6} {:>6} {:>9.4} {:>7.1} {:>9.4} {:>7.1} {:>9.4} {:>7.1} {:>4} {:>9.4} {:>7.1} {:>9.4} {:>7.1}",
            c.name,
            c.m,
            c.n,
            c.k,
            tm.gemm_ex_ms,
            tm.tflops(tm.gemm_ex_ms),
            lt0,
            tm.tflops(lt0),
            best,
            tm.tflops(best),
            bi,
            f0,
            tm.tflops(f0),
            fbest,
            tm.tflops(fbest)
        );
        if !tm.lt_same.is_empty() {
            let differ: Vec<String> = (0..tm.lt_same.len())
                .filter(|&i| !tm.lt_same[i])
                .map(|i| i.to_string())
                .collect();
            differ_lines.push(format!(
                "BITS {:<24} {} of {} algorithms equal GemmEx's output; differing: [{}]",
                c.name,
                tm.lt_same.len() - differ.len(),
                tm.lt_same.len(),
                differ.join(", ")
            ));
        }
        // One micro-batch's GEMMs as the block runs them: fwd, dgrad, and the wgrad of the
        // first micro-batch (beta 0); the running-sum wgrad (beta 1) is informational.
        if c.beta != 0.0 {
            continue;
        }
        let mut add = |key: &'static str| {
            let e = tot.entry(key).or_insert([0.0; 3]);
            e[0] += tm.gemm_ex_ms;
            e[1] += lt0;
            e[2] += best;
        };
        if layout != Layout::Fused {
            add("layer, separate (as now)");
            fp8_tot[0] += f0;
            fp8_tot[1] += fbest;
        }
        if layout != Layout::Separate {
            add("layer, fused qkv + gate_up");
        }
    }
    for line in &differ_lines {
        println!("{line}");
    }
    let l = cfg.num_hidden_layers as f64;
    for (k, [ex, lt0, best]) in &tot {
        println!(
            "TOTAL {k}: GemmEx {:.2} ms, Lt[0] {:.2} ms, Lt best {:.2} ms per layer; x {l} layers: {:.1} / {:.1} / {:.1} ms",
            ex,
            lt0,
            best,
            ex * l,
            lt0 * l,
            best * l
        );
    }
    if args.fp8_algos > 0 {
        // What a layer's FP8 GEMMs read, made by quantize (amax + cast + transpose), per
        // micro-batch: its 4 distinct inputs (E4M3), the 7 output gradients (E5M2: the same
        // cost) and the 7 weights (once per optimizer step: per micro-batch at one micro-batch
        // a step, the worst case).
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        let q = cfg.num_attention_heads * cfg.head_dim;
        let kv = cfg.num_key_value_heads * cfg.head_dim;
        let groups: [(&str, Vec<(usize, usize)>); 3] = [
            ("activations", vec![(t, h), (t, q), (t, h), (t, i)]),
            (
                "gradients",
                vec![(t, q), (t, kv), (t, kv), (t, h), (t, i), (t, i), (t, h)],
            ),
            (
                "weights",
                vec![(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)],
            ),
        ];
        let mut shapes: Vec<(usize, usize)> = groups.iter().flat_map(|(_, v)| v.iter().copied()).collect();
        shapes.sort_unstable();
        shapes.dedup();
        let ms = bench_quantize(&device, &shapes, args.reps)?;
        for (&(r, c), t) in shapes.iter().zip(&ms) {
            // Bytes moved: the amax reads x (2 bytes a value), the cast reads it again and
            // writes the bits and their transpose (1 byte each).
            let gb = 6.0 * (r * c) as f64 / 1e9;
            println!("QUANT [{r}, {c}]: {t:.4} ms, {:.0} GB/s", gb / (t / 1e3));
        }
        let of = |s: &(usize, usize)| ms[shapes.iter().position(|x| x == s).expect("timed")];
        let mut quant = 0.0;
        for (name, v) in &groups {
            let g: f64 = v.iter().map(of).sum();
            quant += g;
            println!("QUANT {name}: {} tensors, {g:.3} ms per layer", v.len());
        }
        println!(
            "TOTAL FP8 layer, separate: FP8[0] {:.2} ms, FP8 best {:.2} ms, quantize {quant:.2} ms per layer; x {l} layers: {:.1} / {:.1} / {:.1} ms",
            fp8_tot[0],
            fp8_tot[1],
            fp8_tot[0] * l,
            fp8_tot[1] * l,
            quant * l
        );
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
pub fn run(args: &BenchGemmArgs) -> Result<()> {
    config_of(&args.model)?;
    anyhow::bail!("bench-gemm times cuBLAS GEMMs: this vime-train was built without the cuda feature")
}
