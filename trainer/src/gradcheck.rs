//! `vime-train grad`: log-probs, entropies and the gradient of a fixed objective on one packed
//! batch, for parity checks against HF transformers (`scripts/gpu/hf_parity.sh`).
//!
//! Input, a safetensors file: `input_ids` (i64 `[T]`), `cu_seqlens` (i64 `[S + 1]`), `adv`
//! (f32 `[T]`, 0 at each sequence's last token) and `ent_coef` (f32 `[1]`). The objective is the
//! one of the CPU parity fixtures: `J = sum_i adv_i * logprob_i + ent_coef * sum_i entropy_i`.
//! Output, a safetensors file: `logprobs` and `entropy` (f32 `[T]`), `objective` (f64 `[1]`) and
//! `grad.<HF name>` for every parameter in the model's dtype (a tied model's `lm_head` use is in
//! `grad.model.embed_tokens.weight`, as HF reports it). Written to a temporary name and renamed.
use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::Path;
use vime_qwen3::batch::PackedBatch;
use vime_qwen3::model::{Qwen3, Recompute};

fn ids(t: &Tensor, name: &str, path: &Path) -> Result<Vec<u32>> {
    let v: Vec<i64> = t
        .to_dtype(DType::I64)?
        .to_vec1()
        .with_context(|| format!("{}: {name} must be a 1-D integer tensor", path.display()))?;
    v.into_iter()
        .map(|x| u32::try_from(x).with_context(|| format!("{}: {name} holds {x}", path.display())))
        .collect()
}

/// Runs the forward and backward on `batch_path` and writes `out_path`. Returns the objective.
///
/// `amax_warmup` passes (FP8 delayed scaling only) run first on other token sequences of the same
/// shapes, each sequence rotated left by 1, 2, ... tokens, with the same objective and their
/// gradients dropped. They fill the amax histories as earlier micro-batches of a run would, so the
/// measured pass is scaled by other tensors' amaxes: the error delayed scaling adds in training.
/// With none, delayed scaling's first pass seeds its histories from its own tensors and gives
/// tensorwise scaling's bits.
pub fn grad_file(
    model: &Qwen3,
    batch_path: &Path,
    out_path: &Path,
    recompute: Recompute,
    amax_warmup: usize,
) -> Result<f64> {
    ensure!(
        amax_warmup == 0 || model.kernel_config().fp8_delayed().is_some(),
        "--fp8-amax-warmup {amax_warmup}: the warm-up passes fill delayed scaling's amax histories; pass \
         --fp8-format hybrid --fp8-recipe delayed"
    );
    let inputs = candle_core::safetensors::load(batch_path, &Device::Cpu)
        .with_context(|| format!("reading {}", batch_path.display()))?;
    let get = |name: &str| {
        inputs
            .get(name)
            .with_context(|| format!("{}: no tensor {name}", batch_path.display()))
    };
    let input_ids = ids(get("input_ids")?, "input_ids", batch_path)?;
    let cu = ids(get("cu_seqlens")?, "cu_seqlens", batch_path)?;
    ensure!(
        cu.first() == Some(&0) && cu.last() == Some(&(input_ids.len() as u32)) && cu.windows(2).all(|w| w[0] < w[1]),
        "{}: cu_seqlens {:?} does not split {} tokens",
        batch_path.display(),
        cu,
        input_ids.len()
    );
    let seqs: Vec<&[u32]> = cu
        .windows(2)
        .map(|w| &input_ids[w[0] as usize..w[1] as usize])
        .collect();
    let batch = PackedBatch::from_sequences(&seqs)?;
    let device = model.device().clone();
    let adv = get("adv")?.to_dtype(DType::F32)?.to_device(&device)?;
    ensure!(
        adv.dims() == [input_ids.len()],
        "{}: adv must be [T]",
        batch_path.display()
    );
    let ent_coef = get("ent_coef")?.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?[0];
    let objective_of = |o: &vime_qwen3::model::TokenOutputs| -> Result<Tensor> {
        Ok(((&o.logprobs * &adv)?.sum_all()? + (o.entropy.sum_all()? * ent_coef)?)?)
    };
    for k in 1..=amax_warmup {
        let rotated: Vec<Vec<u32>> = seqs
            .iter()
            .map(|s| {
                let mut r = s.to_vec();
                r.rotate_left(k % s.len());
                r
            })
            .collect();
        let warm = PackedBatch::from_sequences(&rotated)?;
        model
            .forward_backward(&warm, recompute, objective_of)
            .with_context(|| format!("amax warm-up pass {k}"))?;
    }

    let mut outputs = None;
    let (objective, grads) = model.forward_backward(&batch, recompute, |o| {
        outputs = Some((o.logprobs.detach(), o.entropy.detach()));
        objective_of(o)
    })?;
    let (logprobs, entropy) = outputs.context("internal: the loss closure did not run")?;
    let mut out: BTreeMap<String, Tensor> = BTreeMap::new();
    out.insert(
        "logprobs".into(),
        logprobs.to_dtype(DType::F32)?.to_device(&Device::Cpu)?,
    );
    out.insert("entropy".into(), entropy.to_dtype(DType::F32)?.to_device(&Device::Cpu)?);
    out.insert("objective".into(), Tensor::new(&[objective], &Device::Cpu)?);
    for (name, g) in grads.params {
        out.insert(format!("grad.{name}"), g.to_device(&Device::Cpu)?);
    }
    let tmp = out_path.with_extension("safetensors.tmp");
    let out: std::collections::HashMap<String, Tensor> = out.into_iter().collect();
    candle_core::safetensors::save(&out, &tmp).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, out_path).with_context(|| format!("renaming {} to {}", tmp.display(), out_path.display()))?;
    Ok(objective)
}
