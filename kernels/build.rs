//! With the `cuda` feature, compiles every `cuda/*.cu` to PTX in OUT_DIR (nvcc from `$NVCC`, else
//! `nvcc` on PATH; architecture `sm_$CUDA_COMPUTE_CAP`, default 90), which `src/cuda.rs` embeds
//! and the driver loads at first use. Without the feature it does nothing, so CI needs no CUDA.
//!
//! With the `cudnn` feature it also compiles `cudnn/sdpa.cpp` (cuDNN fused attention through the
//! header-only cuDNN frontend) with `$CXX` (default `g++`) into a static library. Headers:
//! `$CUDNN_FRONTEND_INCLUDE` (cudnn_frontend.h), `$CUDNN_INCLUDE` (cudnn.h) and
//! `$CUDA_HOME/include` (cuda_runtime_api.h); `scripts/gpu/cudnn-headers.sh` fetches the first
//! two from PyPI. Nothing links against libcudnn: the frontend loads it at first use.
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=cuda");
    println!("cargo:rerun-if-env-changed=NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=CXX");
    println!("cargo:rerun-if-env-changed=CUDNN_FRONTEND_INCLUDE");
    println!("cargo:rerun-if-env-changed=CUDNN_INCLUDE");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let nvcc = std::env::var("NVCC").unwrap_or_else(|_| "nvcc".into());
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    for name in ["ops", "flash_attn", "decode", "invariant", "fp8"] {
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
    if std::env::var_os("CARGO_FEATURE_CUDNN").is_some() {
        build_cudnn(&out);
    }
}

fn build_cudnn(out: &std::path::Path) {
    let src = PathBuf::from("cudnn").join("sdpa.cpp");
    println!("cargo:rerun-if-changed={}", src.display());
    let var = |name: &str| {
        std::env::var(name)
            .unwrap_or_else(|_| panic!("the cudnn feature needs ${name} (source scripts/gpu/cudnn-headers.sh)"))
    };
    let cuda_home = std::env::var("CUDA_HOME")
        .or_else(|_| std::env::var("CUDA_PATH"))
        .unwrap_or_else(|_| panic!("the cudnn feature needs $CUDA_HOME (for cuda_runtime_api.h)"));
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".into());
    let obj = out.join("vime_cudnn_sdpa.o");
    let status = Command::new(&cxx)
        .args(["-std=c++17", "-O2", "-fPIC", "-DNV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING"])
        .arg(format!("-I{}", var("CUDNN_FRONTEND_INCLUDE")))
        .arg(format!("-I{}", var("CUDNN_INCLUDE")))
        .arg(format!("-I{cuda_home}/include"))
        .arg("-c")
        .arg(&src)
        .arg("-o")
        .arg(&obj)
        .status()
        .unwrap_or_else(|e| panic!("running {cxx} for {}: {e}", src.display()));
    assert!(status.success(), "{cxx} failed on {}", src.display());
    let lib = out.join("libvime_cudnn.a");
    let _ = std::fs::remove_file(&lib);
    let status = Command::new("ar")
        .arg("crs")
        .arg(&lib)
        .arg(&obj)
        .status()
        .unwrap_or_else(|e| panic!("running ar: {e}"));
    assert!(status.success(), "ar failed on {}", obj.display());
    println!("cargo:rustc-link-search=native={}", out.display());
    println!("cargo:rustc-link-lib=static=vime_cudnn");
    println!("cargo:rustc-link-lib=dylib=stdc++");
    println!("cargo:rustc-link-lib=dylib=dl");
}
