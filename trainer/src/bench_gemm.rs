//! `vime-train bench-gemm`: the training step's GEMMs of a Qwen3 release shape at `--tokens`
//! rows, each timed as the block runs it (cuBLAS `GemmEx`, default algorithm) and through
//! cuBLASLt with each of its top heuristic algorithms (`vime_kernels::cuda::gemm_bench`), plus the
//! fused q|k|v and gate|up layers the block does not run yet. Prints one line per GEMM and the
//! totals of one layer's GEMMs (x layers x 1 micro-batch) for each choice.
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
    use vime_kernels::cuda::gemm_bench::{bench, linear_cases};
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
    println!(
        "bench-gemm model {} tokens {t} algos {} reps {}",
        args.model, args.algos, args.reps
    );
    println!(
        "{:<28} {:>6} {:>6} {:>6} {:>9} {:>7} {:>9} {:>7} {:>9} {:>7} {:>4}",
        "gemm", "m", "n", "k", "GemmEx ms", "TFLOP/s", "Lt[0] ms", "TFLOP/s", "Lt best", "TFLOP/s", "idx"
    );
    // Per-layer totals: separate projections, fused ones, each with GemmEx / Lt[0] / Lt best.
    let mut tot = std::collections::BTreeMap::<&str, [f64; 3]>::new();
    for (tm, &layout) in timings.iter().zip(&layouts) {
        let c = &tm.case;
        let lt0 = tm.lt_ms.first().copied().unwrap_or(f64::NAN);
        let (bi, best) = tm.lt_best().unwrap_or((usize::MAX, f64::NAN));
        println!(
            "{:<28} {:>6} {:>6} {:>6} {:>9.4} {:>7.1} {:>9.4} {:>7.1} {:>9.4} {:>7.1} {:>4}",
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
            bi
        );
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
        }
        if layout != Layout::Separate {
            add("layer, fused qkv + gate_up");
        }
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
    Ok(())
}

#[cfg(not(feature = "cuda"))]
pub fn run(args: &BenchGemmArgs) -> Result<()> {
    config_of(&args.model)?;
    anyhow::bail!("bench-gemm times cuBLAS GEMMs: this vime-train was built without the cuda feature")
}
