//! Root package of the vime workspace: it exists to hold the cross-crate integration tests in
//! `tests/` and the benchmarks in `benches/`. The code lives in the member crates.
pub use vime_kernels as kernels;
pub use vime_qwen3 as qwen3;
pub use vime_trainer as trainer;
