//! With the `cuda` feature, compiles every `cuda/*.cu` to PTX in OUT_DIR (nvcc from `$NVCC`, else
//! `nvcc` on PATH; architecture `sm_$CUDA_COMPUTE_CAP`, default 90), which `src/cuda.rs` embeds
//! and the driver loads at first use. Without the feature it does nothing, so CI needs no CUDA.
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=cuda");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    for name in ["ops", "flash_attn"] {
        let src = PathBuf::from("cuda").join(format!("{name}.cu"));
        println!("cargo:rerun-if-changed={}", src.display());
        let ptx = out.join(format!("{name}.ptx"));
        let status = Command::new(&nvcc)
            .args(["-ptx", "-O3", "-std=c++17", "-lineinfo"])
            .arg(format!("-arch=sm_{cap}"))
            .arg(&src)
            .arg("-o")
            .arg(&ptx)
            .status()
            .unwrap_or_else(|e| {
                panic!(
                    "running {nvcc} for {}: {e} (set NVCC or put nvcc on PATH)",
                    src.display()
                )
            });
        assert!(status.success(), "{nvcc} failed on {}", src.display());
    }
}
