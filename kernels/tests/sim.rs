//! The host simulator of CUDA threads (`kernels/sim`, for sessions without a GPU) stays sound,
//! and the kernels of `kernels/cuda/ops.cu` that claim another's bits keep them under it: builds
//! each program with g++ and runs it.
//! - `selftest.cpp`: the simulator's barriers, shuffles and block sums against CUDA's results, a
//!   divergent barrier reported, `vime_qk_norm_rope` == `vime_qk_norm_rope_tok` bit for bit (as
//!   the GPU kernel check finds), the 16-byte RMSNorm forward against a double reference;
//! - `check_adamw_multi.cpp`: the one-launch AdamW against one launch per tensor, 3 steps;
//! - `check_widen_add.cpp`: bf16 gradients into f32 sums in one launch against cast and add;
//! - `check_gather_rows.cpp`: the row gather against a host gather, byte for byte (odd widths,
//!   repeated and out-of-range indices, blocks that loop);
//! - `check_lmhead_stats.cpp`: the LM head's grouped statistics against a double log-softmax and
//!   entropy (rescaling, tails, misaligned rows, chunk remainders); its bf16-logits kernels against
//!   the f32 ones on the same values, bit for bit;
//! - `check_fp8.cpp`: `cuda/fp8.cu`'s amax, cast and amax-history commit kernels against a host
//!   reference of the same rule: current scaling, delayed scaling (a given amax, a margin,
//!   saturation, the tiles' maxima recorded by atomicMax), odd and misaligned shapes, padded
//!   transposes; and the fused SwiGLU casts against SwiGLU then the cast, bit for bit.

use std::path::Path;
use std::process::Command;

/// Builds `kernels/sim/<src>` and runs it; its stdout must hold `verdict`.
fn run_sim(src: &str, verdict: &str) {
    let sim = Path::new(env!("CARGO_MANIFEST_DIR")).join("sim");
    let dir = tempfile_dir(src);
    let exe = dir.join("prog");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let build = Command::new(&cxx)
        .args(["-std=c++17", "-O1", "-ffp-contract=off", "-Wno-unknown-pragmas"])
        .arg(format!("-I{}", sim.join("include").display()))
        .arg(format!("-I{}", sim.display()))
        .arg(sim.join(src))
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("running {cxx} (C++17 compiler for kernels/sim; set CXX): {e}"));
    assert!(
        build.status.success(),
        "{cxx} failed on kernels/sim/{src}:\n{}",
        String::from_utf8_lossy(&build.stderr)
    );
    let run = Command::new(&exe)
        .output()
        .unwrap_or_else(|e| panic!("running kernels/sim/{src}: {e}"));
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success() && stdout.contains(verdict),
        "kernels/sim/{src} failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn simulator_self_test_passes() {
    run_sim("selftest.cpp", "SIMT SELFTEST: PASS");
}

#[test]
fn one_launch_adamw_equals_one_launch_per_tensor_in_the_simulator() {
    run_sim("check_adamw_multi.cpp", "ADAMW MULTI: PASS");
}

#[test]
fn one_launch_widening_equals_cast_and_add_in_the_simulator() {
    run_sim("check_widen_add.cpp", "WIDEN ADD MULTI: PASS");
}

#[test]
fn the_row_gather_equals_a_host_gather_in_the_simulator() {
    run_sim("check_gather_rows.cpp", "GATHER ROWS: PASS");
}

#[test]
fn lm_head_statistics_match_a_double_reference_in_the_simulator() {
    run_sim("check_lmhead_stats.cpp", "LMHEAD STATS: PASS");
}

fn tempfile_dir(src: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("vime-sim-{}-{src}", std::process::id()));
    std::fs::create_dir_all(&d).expect("creating a temporary directory");
    d
}

#[test]
fn fp8_cast_and_amax_history_kernels_match_their_rule_in_the_simulator() {
    run_sim("check_fp8.cpp", "FP8 CAST: PASS");
}
