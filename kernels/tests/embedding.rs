//! The embedding backward against candle's `index_add` (and an init added on top), in f32 and
//! f64, with repeated ids; and its input errors.
use candle_core::{DType, Device, Result, Tensor};
use vime_kernels::testing::{rel_err, Rng};
use vime_kernels::{embedding_backward, embedding_backward_into};

#[test]
fn matches_index_add_plus_init() -> Result<()> {
    let mut rng = Rng::new(3);
    let (vocab, d) = (17usize, 5usize);
    let ids = [3u32, 0, 3, 16, 7, 3, 0];
    for dtype in [DType::F32, DType::F64, DType::BF16] {
        let g = rng.randn(&[ids.len(), d], 1.0, dtype, &Device::Cpu)?;
        let init = rng.randn(&[vocab, d], 1.0, dtype, &Device::Cpu)?;
        let acc = if dtype == DType::F64 { DType::F64 } else { DType::F32 };
        let idx = Tensor::new(&ids[..], &Device::Cpu)?;
        let reference = Tensor::zeros((vocab, d), acc, &Device::Cpu)?.index_add(&idx, &g.to_dtype(acc)?, 0)?;
        let got = embedding_backward(&ids, &g, vocab, None)?;
        assert_eq!(got.dtype(), acc);
        assert!(
            rel_err(&got.to_dtype(DType::F64)?, &reference.to_dtype(DType::F64)?)? < 1e-6,
            "{dtype:?}"
        );
        // Rows without a token are exactly zero.
        let row1: Vec<f64> = got.to_dtype(DType::F64)?.get(1)?.to_vec1()?;
        assert!(row1.iter().all(|&v| v == 0.0));
        let with_init = embedding_backward(&ids, &g, vocab, Some(&init))?;
        let want = (reference + init.to_dtype(acc)?)?;
        assert!(
            rel_err(&with_init.to_dtype(DType::F64)?, &want.to_dtype(DType::F64)?)? < 1e-6,
            "{dtype:?} init"
        );
    }
    Ok(())
}

/// Into a running sum: the sum plus index_add, the untouched rows of the sum unchanged, and the
/// sum's dtype and shape checked (naming both).
#[test]
fn into_a_running_sum_adds_index_add() -> Result<()> {
    let mut rng = Rng::new(5);
    let (vocab, d) = (13usize, 4usize);
    let ids = [2u32, 9, 2, 2, 12];
    for (dtype, acc) in [
        (DType::F32, DType::F32),
        (DType::F64, DType::F64),
        (DType::BF16, DType::F32),
    ] {
        let g = rng.randn(&[ids.len(), d], 1.0, dtype, &Device::Cpu)?;
        let sum = rng.randn(&[vocab, d], 1.0, acc, &Device::Cpu)?;
        let idx = Tensor::new(&ids[..], &Device::Cpu)?;
        let want = sum.index_add(&idx, &g.to_dtype(acc)?, 0)?;
        let got = embedding_backward_into(&ids, &g, sum.clone())?;
        assert_eq!(got.dtype(), acc);
        assert!(
            rel_err(&got.to_dtype(DType::F64)?, &want.to_dtype(DType::F64)?)? < 1e-6,
            "{dtype:?}"
        );
        let (r0, s0): (Vec<f64>, Vec<f64>) = (
            got.to_dtype(DType::F64)?.get(0)?.to_vec1()?,
            sum.to_dtype(DType::F64)?.get(0)?.to_vec1()?,
        );
        assert_eq!(r0, s0, "a row without a token keeps the sum's value");
    }
    let g = Tensor::zeros((2, 4), DType::F32, &Device::Cpu)?;
    let err = |r: Result<Tensor>| r.unwrap_err().to_string();
    let bf = Tensor::zeros((10, 4), DType::BF16, &Device::Cpu)?;
    assert!(err(embedding_backward_into(&[1, 2], &g, bf)).contains("running sum is BF16, expected F32"));
    let narrow = Tensor::zeros((10, 3), DType::F32, &Device::Cpu)?;
    assert!(err(embedding_backward_into(&[1, 2], &g, narrow)).contains("[10, 3]"));
    let ok = Tensor::zeros((10, 4), DType::F32, &Device::Cpu)?;
    assert!(err(embedding_backward_into(&[1, 10], &g, ok)).contains("id 10 at position 1"));
    Ok(())
}

#[test]
fn rejects_bad_inputs() -> Result<()> {
    let g = Tensor::zeros((3, 4), DType::F32, &Device::Cpu)?;
    let err = |r: Result<Tensor>| r.unwrap_err().to_string();
    assert!(err(embedding_backward(&[1, 2], &g, 10, None)).contains("2 ids for a gradient of 3 rows"));
    assert!(err(embedding_backward(&[1, 2, 10], &g, 10, None)).contains("id 10 at position 2"));
    let init = Tensor::zeros((9, 4), DType::F32, &Device::Cpu)?;
    assert!(err(embedding_backward(&[1, 2, 3], &g, 10, Some(&init))).contains("init [9, 4]"));
    Ok(())
}
