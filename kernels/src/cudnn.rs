//! cuDNN fused attention (the `cudnn` feature): the Rust side of `cudnn/sdpa.cpp`, which builds
//! and caches cuDNN SDPA graphs through the cuDNN frontend and runs them on candle's stream.
//!
//! Same op as [`crate::attention::varlen_attention`]: causal (bottom-right aligned) grouped-query
//! attention over packed sequences, bf16 in and out, f32 softmax statistics. The packed
//! `[T, H, D]` tensors are cuDNN "THD" ragged tensors; the caller's `cu_seqlens` become the
//! ragged offsets and the padding mask's per-sequence lengths.
//!
//! Decisions:
//! - The saved statistics are cuDNN's own (f32 natural-log log-sum-exp of the scaled scores:
//!   `[T_q, H_q]` on the ragged layout, `[B, H_q, L]` on the dense one), not the flash kernel's
//!   `[H_q, T_q]`; a forward and its backward always run on the same backend and plan, which the
//!   op's saved state records.
//! - Two layouts. Dense (every sequence of one length `L`, `L_q = L_k`): plain `[B, H, L, D]`
//!   views with no padding mask, what torch's SDPA hands cuDNN. Ragged otherwise: THD tensors with
//!   ragged offsets and the padding mask's per-sequence lengths; the longest sequence and the
//!   token totals round up to a power of two (at least 64) and the batch to a power of two (empty
//!   sequences pad it), so a few graphs serve a whole dynamic-batching run.
//! - The causal mask is top-left whenever every sequence has `L_q = L_k` (then identical to
//!   bottom-right): cuDNN's bottom-right-masked backward measured no faster than vime's flash
//!   kernel (`benches/PERF_NOTES.md`). `--attention-backend auto` leaves `L_k > L_q` (KV-cache
//!   prefill and decoding, context-parallel chunks) to the flash kernel; `fused` runs it on cuDNN.
//! - Offsets are int32 element counts (`T x H x D` must stay below 2^31); calls beyond that
//!   report [`Unsupported`] and run the flash kernel (`fused`: an error).
//! - libcudnn and libcudart are loaded at first use (dynamic loading in the frontend); a load or
//!   graph failure under `auto` is reported once and the flash kernel takes over for that
//!   `KernelConfig` (its `fallback` policy), or is an error (`error` policy: several ranks).
#[cfg(feature = "cudnn")]
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, DevicePtr};
#[cfg(feature = "cudnn")]
use candle_core::cuda_backend::{CudaDevice, WrapErr};
#[cfg(feature = "cudnn")]
use candle_core::{bail, Result};
#[cfg(feature = "cudnn")]
use std::ffi::{c_char, c_void, CStr};

#[cfg(feature = "cudnn")]
#[repr(C)]
struct SdpaArgs {
    backward: i32,
    deterministic: i32,
    device: i32,
    layout: i32,
    b: i64,
    s_q: i64,
    s_k: i64,
    h_q: i64,
    h_k: i64,
    d: i64,
    t_q: i64,
    t_k: i64,
    scale: f32,
    top_left: i32,
    stream: *mut c_void,
    q: u64,
    k: u64,
    v: u64,
    o: u64,
    stats: u64,
    dout: u64,
    dq: u64,
    dk: u64,
    dv: u64,
    seq_len_q: u64,
    seq_len_k: u64,
    off_q: u64,
    off_k: u64,
    off_stats: u64,
    workspace: u64,
    workspace_bytes: i64,
    plan: i32,
}

#[cfg(feature = "cudnn")]
extern "C" {
    fn vime_cudnn_sdpa_workspace(a: *const SdpaArgs, bytes: *mut i64, err: *mut c_char, n: usize) -> i32;
    fn vime_cudnn_sdpa_run(a: *const SdpaArgs, err: *mut c_char, n: usize) -> i32;
    fn vime_cudnn_graph_stats(built: *mut i64, seconds: *mut f64);
    fn vime_cudnn_backend_version() -> i64;
}

/// `CUDNN_VERSION` of the library loaded at first use (major * 10000 + minor * 100 + patch), 0
/// before that.
#[cfg(feature = "cudnn")]
pub fn backend_version() -> i64 {
    unsafe { vime_cudnn_backend_version() }
}

/// cuDNN graphs built so far in this process and the host seconds spent building them (each new
/// shape bucket costs one forward and one backward graph).
#[cfg(feature = "cudnn")]
pub fn graph_stats() -> (u64, f64) {
    let (mut n, mut s) = (0i64, 0f64);
    unsafe { vime_cudnn_graph_stats(&mut n, &mut s) };
    (n as u64, s)
}

/// The shape of one call: packed geometry plus the `cu_seqlens` with empty sequences dropped.
#[derive(Debug, PartialEq)]
pub(crate) struct Plan {
    /// Every kept sequence has the same `L_q = L_k`: cuDNN's dense layout (no ragged offsets, no
    /// padding mask; `s_q = s_k` is that length exactly), measured faster than the ragged one.
    dense: bool,
    /// Every kept sequence has `L_q = L_k` (top-left and bottom-right causal masks coincide).
    pub(crate) top_left: bool,
    /// Every query and key row belongs to a kept sequence (both offsets start at 0, and no
    /// sequence without queries holds keys), so cuDNN writes every row of O, the statistics, dQ,
    /// dK and dV: their buffers need no zero fill.
    pub(crate) covers: bool,
    b: usize,
    s_q: usize,
    s_k: usize,
    t_q: usize,
    t_k: usize,
    h_q: usize,
    h_k: usize,
    d: usize,
    /// int32 index data uploaded at once: seq_len_q, seq_len_k, off_q, off_k, off_stats, each
    /// starting at a 16-byte boundary (`seg` elements apart).
    index: Vec<i32>,
    seg: usize,
}

/// Why a call cannot run on cuDNN (it then runs the flash kernel).
#[derive(Debug)]
pub(crate) struct Unsupported(pub String);

fn bucket(n: usize) -> usize {
    n.next_power_of_two().max(64)
}

/// `VIME_CUDNN_LAYOUT=ragged`: every call on the ragged layout (for measuring the two against
/// each other; read once).
fn force_ragged() -> bool {
    static RAGGED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *RAGGED.get_or_init(|| std::env::var("VIME_CUDNN_LAYOUT").is_ok_and(|v| v == "ragged"))
}

/// `VIME_CUDNN_SDPA_PLAN=F,B`: run the forward on the F-th and the backward on the B-th engine
/// config of cuDNN's heuristics modes A and B (listed on stderr when the graph is built; -1 is
/// mode A's first choice, the default), for measuring cuDNN's plans against each other (read once).
#[cfg(feature = "cudnn")]
fn forced_plans() -> (i32, i32) {
    static PLANS: std::sync::OnceLock<(i32, i32)> = std::sync::OnceLock::new();
    *PLANS.get_or_init(|| {
        let v = std::env::var("VIME_CUDNN_SDPA_PLAN").unwrap_or_default();
        let mut it = v.split(',').map(|x| x.trim().parse::<i32>().unwrap_or(-1));
        (it.next().unwrap_or(-1), it.next().unwrap_or(-1))
    })
}

impl Plan {
    pub(crate) fn new(
        cu_q: &[u32],
        cu_k: &[u32],
        h_q: usize,
        h_k: usize,
        d: usize,
    ) -> std::result::Result<Self, Unsupported> {
        let (t_q, t_k) = (*cu_q.last().unwrap_or(&0) as usize, *cu_k.last().unwrap_or(&0) as usize);
        if (t_q * h_q * d) >= (1 << 31) || (t_k * h_k * d) >= (1 << 31) {
            return Err(Unsupported(format!(
                "{t_q} x {h_q} x {d} query or {t_k} x {h_k} x {d} key elements exceed cuDNN's int32 offsets"
            )));
        }
        let keep: Vec<usize> = (0..cu_q.len().saturating_sub(1))
            .filter(|&s| cu_q[s + 1] > cu_q[s])
            .collect();
        let b = keep.len();
        if b == 0 {
            return Err(Unsupported("no non-empty sequence".into()));
        }
        let len = |s: usize| ((cu_q[s + 1] - cu_q[s]) as usize, (cu_k[s + 1] - cu_k[s]) as usize);
        let top_left = keep.iter().all(|&s| len(s).0 == len(s).1);
        let covers = cu_q[0] == 0
            && cu_k[0] == 0
            && (0..cu_q.len() - 1).all(|s| cu_q[s + 1] > cu_q[s] || cu_k[s + 1] == cu_k[s]);
        // The dense layout reads sequence i at i x s_q and i x s_k: only right when every row
        // belongs to a kept sequence of that one length.
        let dense = covers && top_left && keep.iter().all(|&s| len(s) == len(keep[0])) && !force_ragged();
        // The ragged graph's batch rounds up to a power of two with empty sequences (length 0,
        // offsets at the end), so that a few graphs serve every micro-batch of a dynamic-batching
        // run (measured on the H200: a forward + backward graph pair 2.1-2.6 s of host time in a
        // fresh process, 0.13 s for a pair of shapes an earlier process on the machine had built;
        // the load of libcudnn and cuDNN's kernel compilation were not timed apart).
        let b_graph = if dense { b } else { b.next_power_of_two() };
        let seg = (b_graph + 1).next_multiple_of(4);
        let mut index = vec![0i32; 5 * seg];
        let (mut max_q, mut max_k) = (0usize, 0usize);
        for (i, &s) in keep.iter().enumerate() {
            let (lq, lk) = len(s);
            max_q = max_q.max(lq);
            max_k = max_k.max(lk);
            index[i] = lq as i32;
            index[seg + i] = lk as i32;
            index[2 * seg + i] = (cu_q[s] as usize * h_q * d) as i32;
            index[3 * seg + i] = (cu_k[s] as usize * h_k * d) as i32;
            index[4 * seg + i] = (cu_q[s] as usize * h_q) as i32;
        }
        // Past-the-end offsets (where the last kept sequence ends), repeated for the padding.
        let last = keep[b - 1];
        for i in b..=b_graph {
            index[2 * seg + i] = (cu_q[last + 1] as usize * h_q * d) as i32;
            index[3 * seg + i] = (cu_k[last + 1] as usize * h_k * d) as i32;
            index[4 * seg + i] = (cu_q[last + 1] as usize * h_q) as i32;
        }
        let b = b_graph;
        let (s_q, s_k, t_q, t_k) = if dense {
            (max_q, max_k, t_q, t_k)
        } else {
            (bucket(max_q), bucket(max_k), bucket(t_q), bucket(t_k))
        };
        Ok(Self {
            dense,
            top_left,
            covers,
            b,
            s_q,
            s_k,
            t_q,
            t_k,
            h_q,
            h_k,
            d,
            index,
            seg,
        })
    }
}

/// Device pointers of one call (0 where the direction does not use them).
#[cfg(feature = "cudnn")]
#[derive(Default)]
pub(crate) struct Ptrs {
    pub q: u64,
    pub k: u64,
    pub v: u64,
    pub o: u64,
    pub stats: u64,
    pub dout: u64,
    pub dq: u64,
    pub dk: u64,
    pub dv: u64,
}

#[cfg(feature = "cudnn")]
fn message(buf: &[u8]) -> String {
    CStr::from_bytes_until_nul(buf)
        .map(|c| c.to_string_lossy().into_owned())
        .unwrap_or_else(|_| "unknown cuDNN error".into())
}

/// Runs one direction of the graph for `plan` on the device's stream.
#[cfg(feature = "cudnn")]
pub(crate) fn run(
    dev: &CudaDevice,
    plan: &Plan,
    backward: bool,
    deterministic: bool,
    scale: f64,
    p: &Ptrs,
) -> Result<()> {
    let stream = dev.cuda_stream();
    // The dense layout's graph has no sequence-length or offset tensors (sdpa.cpp binds them only
    // on the ragged one), so its calls skip the upload and pass null pointers.
    let index: Option<CudaSlice<i32>> = if plan.dense {
        None
    } else {
        Some(stream.clone_htod(&plan.index).w()?)
    };
    let base = match &index {
        Some(index) => {
            let (ptr, _sync) = index.device_ptr(&stream);
            ptr
        }
        None => 0,
    };
    let at = |i: usize| if base == 0 { 0 } else { base + (i * plan.seg * 4) as u64 };
    let mut a = SdpaArgs {
        backward: backward as i32,
        deterministic: deterministic as i32,
        device: stream.context().ordinal() as i32,
        layout: plan.dense as i32,
        b: plan.b as i64,
        s_q: plan.s_q as i64,
        s_k: plan.s_k as i64,
        h_q: plan.h_q as i64,
        h_k: plan.h_k as i64,
        d: plan.d as i64,
        t_q: plan.t_q as i64,
        t_k: plan.t_k as i64,
        scale: scale as f32,
        top_left: plan.top_left as i32,
        stream: stream.cu_stream() as *mut c_void,
        q: p.q,
        k: p.k,
        v: p.v,
        o: p.o,
        stats: p.stats,
        dout: p.dout,
        dq: p.dq,
        dk: p.dk,
        dv: p.dv,
        seq_len_q: at(0),
        seq_len_k: at(1),
        off_q: at(2),
        off_k: at(3),
        off_stats: at(4),
        workspace: 0,
        workspace_bytes: 0,
        plan: if backward { forced_plans().1 } else { forced_plans().0 },
    };
    let what = if backward { "backward" } else { "forward" };
    let mut err = vec![0u8; 2048];
    let mut bytes = 0i64;
    // The frontend uses the runtime API, which follows the thread's current context.
    stream.context().bind_to_thread().w()?;
    let rc = unsafe { vime_cudnn_sdpa_workspace(&a, &mut bytes, err.as_mut_ptr().cast(), err.len()) };
    if rc != 0 {
        bail!("cuDNN attention {what}: building the graph failed: {}", message(&err));
    }
    let ws: Option<CudaSlice<u8>> = if bytes > 0 {
        Some(unsafe { dev.alloc::<u8>(bytes as usize) }?)
    } else {
        None
    };
    if let Some(ws) = &ws {
        let (ptr, _sync) = ws.device_ptr(&stream);
        a.workspace = ptr;
        a.workspace_bytes = bytes;
    }
    let rc = unsafe { vime_cudnn_sdpa_run(&a, err.as_mut_ptr().cast(), err.len()) };
    if rc != 0 {
        bail!("cuDNN attention {what}: {}", message(&err));
    }
    // `index` and `ws` are freed in stream order (candle's pool), after the kernels that read them.
    drop((index, ws));
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Plan {
        fn layout(&self) -> (&'static str, bool) {
            (if self.dense { "dense" } else { "ragged" }, self.top_left)
        }
    }

    #[test]
    fn equal_lengths_take_the_dense_layout() {
        let p = Plan::new(&[0, 4096, 8192], &[0, 4096, 8192], 32, 8, 128).unwrap();
        assert_eq!(p.layout(), ("dense", true));
        assert!(p.covers);
        assert_eq!((p.b, p.s_q, p.s_k, p.t_q), (2, 4096, 4096, 8192));
    }

    #[test]
    fn keys_outside_every_kept_sequence_need_the_ragged_layout_and_a_zero_fill() {
        // Two kept sequences of 4 = 4 rows, between them one with 3 keys and no query: the dense
        // layout would read the second sequence's keys at 4, not at 7, and cuDNN writes no dK or
        // dV rows for keys no kept sequence holds.
        let p = Plan::new(&[0, 4, 4, 8], &[0, 4, 7, 11], 2, 1, 8).unwrap();
        assert_eq!(p.layout(), ("ragged", true));
        assert!(!p.covers);
        // Empty in both: nothing is left out.
        let p = Plan::new(&[0, 4, 4, 8], &[0, 4, 4, 8], 2, 1, 8).unwrap();
        assert_eq!(p.layout(), ("dense", true));
        assert!(p.covers);
        // Rows before the first sequence.
        let p = Plan::new(&[2, 6, 10], &[2, 6, 10], 2, 1, 8).unwrap();
        assert_eq!(p.layout(), ("ragged", true));
        assert!(!p.covers);
        // Prefill after a cache (L_k > L_q): every key is in a kept sequence.
        let p = Plan::new(&[0, 3, 5], &[0, 10, 14], 2, 1, 8).unwrap();
        assert_eq!(p.layout(), ("ragged", false));
        assert!(p.covers);
    }

    #[test]
    fn ragged_offsets_skip_empty_sequences_and_bucket_the_shape() {
        // lengths q: 1, 0, 100, 37 / k: 300, 3, 100, 200 (the empty query sequence is dropped)
        let (cq, ck) = ([0u32, 1, 1, 101, 138], [0u32, 300, 303, 403, 603]);
        let p = Plan::new(&cq, &ck, 4, 2, 8).unwrap();
        assert_eq!(p.layout(), ("ragged", false));
        assert!(!p.covers, "the dropped sequence's 3 keys");
        // 3 sequences kept, the graph's batch padded to 4 with an empty one
        assert_eq!((p.b, p.s_q, p.s_k, p.t_q, p.t_k), (4, 128, 512, 256, 1024));
        let seg = p.seg;
        assert_eq!(seg, 8);
        assert_eq!(&p.index[..4], &[1, 100, 37, 0]); // seq_len_q
        assert_eq!(&p.index[seg..seg + 4], &[300, 100, 200, 0]); // seq_len_k
        assert_eq!(&p.index[2 * seg..2 * seg + 5], &[0, 32, 32 * 101, 32 * 138, 32 * 138]); // q: x h_q x d
        let k_off = [0, 16 * 303, 16 * 403, 16 * 603, 16 * 603];
        assert_eq!(&p.index[3 * seg..3 * seg + 5], &k_off); // k: x h_k x d
        assert_eq!(&p.index[4 * seg..4 * seg + 5], &[0, 4, 4 * 101, 4 * 138, 4 * 138]); // stats: x h_q
                                                                                        // 5..8 sequences share the graph of 8
        let c5: Vec<u32> = (0..=5).map(|i| i * 10 + i * i).collect();
        let c8: Vec<u32> = (0..=8).map(|i| i * 10 + i * i).collect();
        let (p5, p8) = (
            Plan::new(&c5, &c5, 2, 1, 8).unwrap(),
            Plan::new(&c8, &c8, 2, 1, 8).unwrap(),
        );
        assert_eq!((p5.b, p8.b), (8, 8));
    }

    #[test]
    fn unequal_self_attention_lengths_are_ragged_but_top_left() {
        let p = Plan::new(&[0, 10, 30], &[0, 10, 30], 2, 1, 8).unwrap();
        assert_eq!(p.layout(), ("ragged", true));
    }

    #[test]
    fn refusals_name_the_reason() {
        assert!(Plan::new(&[0, 0], &[0, 5], 2, 1, 8)
            .unwrap_err()
            .0
            .contains("no non-empty"));
        let big = 1u32 << 20;
        let e = Plan::new(&[0, big], &[0, big], 32, 8, 128).unwrap_err();
        assert!(e.0.contains("int32"), "{}", e.0);
    }
}
