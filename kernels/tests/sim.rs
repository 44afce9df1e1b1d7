//! The host simulator of CUDA threads (`kernels/sim`, for sessions without a GPU) stays sound:
//! builds `selftest.cpp` with g++ and runs it. The self-test holds the simulator's barriers,
//! shuffles and block sums to CUDA's results, checks that a divergent barrier is reported, that
//! `vime_qk_norm_rope` and `vime_qk_norm_rope_tok` of `kernels/cuda/ops.cu` are bit-equal (as the
//! GPU kernel check finds), and that the 16-byte RMSNorm forward matches a double reference.

use std::path::Path;
use std::process::Command;

#[test]
fn simulator_self_test_passes() {
    let sim = Path::new(env!("CARGO_MANIFEST_DIR")).join("sim");
    let dir = tempfile_dir();
    let exe = dir.join("selftest");
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let build = Command::new(&cxx)
        .args(["-std=c++17", "-O1", "-ffp-contract=off", "-Wno-unknown-pragmas"])
        .arg(format!("-I{}", sim.join("include").display()))
        .arg(format!("-I{}", sim.display()))
        .arg(sim.join("selftest.cpp"))
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("running {cxx} (C++17 compiler for kernels/sim; set CXX): {e}"));
    assert!(
        build.status.success(),
        "{cxx} failed on kernels/sim/selftest.cpp:\n{}",
        String::from_utf8_lossy(&build.stderr)
    );
    let run = Command::new(&exe).output().expect("running the simulator self-test");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success() && stdout.contains("SIMT SELFTEST: PASS"),
        "simulator self-test failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn tempfile_dir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("vime-sim-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("creating a temporary directory");
    d
}
