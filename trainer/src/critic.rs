//! The PPO critic (a Qwen3 backbone with a scalar value head) and the frozen reference model.
//!
//! Decisions:
//! - The value head is a linear layer `hidden -> 1` WITH a bias, as slime's critic
//!   (`LinearForLastLayer(hidden, 1, bias=True)` in slime/backends/megatron_utils/model_provider.py
//!   replaces Megatron's `output_layer`): `v_t = h_t . w_v + b_v` on the final-normed hidden state
//!   `h_t`. A fresh head is `w_v ~ N(0, std^2)`, `b_v = 0`, as slime's init and its
//!   `_reinitialize_critic_output_layer`; slime's `std` is Megatron's `init_method_std` (0.02
//!   unless set), vime uses the config's `initializer_range` (0.02 for every Qwen3 release).
//! - The head lives in f32 (f64 when the backbone runs in f64, so finite-difference tests are
//!   meaningful) whatever the backbone's dtype: hidden states are cast up before the head, as
//!   slime casts the value output with `.float()`. The head is `hidden + 1` numbers, so its master
//!   copy costs nothing.
//! - `values[p]` is the value of the state after packed token `p`, i.e. before token `p + 1`, so
//!   a sample's response-token values sit at the same packed positions as its log-probs
//!   ([`crate::batching::MicroBatch::response_ranges`]), as slime's `get_values` slices them.
//! - The critic's trainable parameters are the backbone's minus an untied `lm_head.weight` (the
//!   value head replaces it; it is kept only so the backbone saves as a complete HF checkpoint),
//!   plus [`VALUE_HEAD_WEIGHT`] and [`VALUE_HEAD_BIAS`]. [`Critic::forward_backward`] returns all of
//!   them in `Gradients::params`, so an optimizer sees one name -> gradient map.
//! - Checkpoint layout: the backbone exactly as an HF Qwen3 checkpoint (`config.json`,
//!   `model.safetensors` or shards + index) and the head in [`VALUE_HEAD_FILE`], tensors
//!   `value_head.weight` `[1, hidden]` and `value_head.bias` `[1]` in the head dtype (Megatron
//!   calls them `output_layer.weight/bias`, TRL `v_head.summary.weight/bias`). HF transformers and
//!   vime load the directory as a plain Qwen3 (they read only the model files); vLLM's loader
//!   globs `*.safetensors` and would trip on the head file, but critics are never served.
//!   [`Critic::load`] requires the head file; [`Critic::init_from_hf`] always starts a fresh head
//!   (slime re-initialises a head missing from the checkpoint; here the caller chooses, with
//!   [`Critic::has_value_head`]).
//! - [`ReferenceModel`] (`--ref-load`) owns a `Qwen3` and exposes only forward log-probs. Every
//!   forward it calls reads detached weights (no autograd graph), and with no backward API nothing
//!   ever allocates a gradient: candle keeps no per-variable gradient buffer (a `GradStore` exists
//!   only as the result of a `backward()`), so its memory is the weights and one forward's
//!   activations.
use crate::batching::MicroBatch;
use anyhow::{anyhow, bail, ensure, Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use vime_qwen3::batch::PackedBatch;
use vime_qwen3::config::Qwen3Config;
use vime_qwen3::model::{Gradients, Qwen3, Recompute};
use vime_qwen3::state_dict::LM_HEAD;

/// The value head's file inside a critic checkpoint directory.
pub const VALUE_HEAD_FILE: &str = "value_head.safetensors";
/// `[1, hidden]`.
pub const VALUE_HEAD_WEIGHT: &str = "value_head.weight";
/// `[1]`.
pub const VALUE_HEAD_BIAS: &str = "value_head.bias";

/// The value head's dtype for a backbone of `model_dtype`: f64 stays f64, all else computes in f32.
pub fn value_head_dtype(model_dtype: DType) -> DType {
    if model_dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

/// A Qwen3 backbone with a scalar value head.
pub struct Critic {
    backbone: Qwen3,
    weight: Var,
    bias: Var,
}

impl Critic {
    /// The kernel choice of the backbone's attention (see `Qwen3::set_kernel_config`).
    pub fn set_kernel_config(&mut self, kernels: vime_kernels::KernelConfig) {
        self.backbone.set_kernel_config(kernels);
    }

    /// Wraps `backbone` with the given head (`weight [1, hidden]`, `bias [1]`), converted to
    /// [`value_head_dtype`] on the backbone's device.
    pub fn new(backbone: Qwen3, weight: &Tensor, bias: &Tensor) -> Result<Self> {
        let h = backbone.config().hidden_size;
        ensure!(
            weight.dims() == [1, h],
            "{VALUE_HEAD_WEIGHT}: expected shape [1, {h}], found {:?}",
            weight.dims()
        );
        ensure!(
            bias.dims() == [1],
            "{VALUE_HEAD_BIAS}: expected shape [1], found {:?}",
            bias.dims()
        );
        let (dt, dev) = (value_head_dtype(backbone.dtype()), backbone.device().clone());
        let weight = Var::from_tensor(&weight.to_device(&dev)?.to_dtype(dt)?.contiguous()?)?;
        let bias = Var::from_tensor(&bias.to_device(&dev)?.to_dtype(dt)?.contiguous()?)?;
        Ok(Self { backbone, weight, bias })
    }

    /// `backbone` with a fresh head: `w_v ~ N(0, std^2)` from a seeded generator, `b_v = 0`.
    pub fn with_fresh_value_head(backbone: Qwen3, std: f64, seed: u64) -> Result<Self> {
        let h = backbone.config().hidden_size;
        let (dt, dev) = (value_head_dtype(backbone.dtype()), backbone.device().clone());
        let w = vime_kernels::testing::Rng::new(seed).randn(&[1, h], std, dt, &dev)?;
        let b = Tensor::zeros(1, dt, &dev)?;
        Self::new(backbone, &w, &b)
    }

    /// A new critic from an HF Qwen3 checkpoint (e.g. the policy's `--hf-checkpoint`): backbone
    /// weights from `dir`, a fresh head with `std = initializer_range`. Any head file in `dir` is
    /// ignored; use [`Critic::load`] to resume.
    pub fn init_from_hf(dir: &Path, dtype: DType, device: &Device, seed: u64) -> Result<Self> {
        let backbone = Qwen3::load_hf(dir, dtype, device)?;
        let std = backbone.config().initializer_range;
        Self::with_fresh_value_head(backbone, std, seed)
    }

    /// Whether `dir` holds a saved value head.
    pub fn has_value_head(dir: &Path) -> bool {
        dir.join(VALUE_HEAD_FILE).is_file()
    }

    /// Loads a critic saved by [`Critic::save`]: the HF backbone and `dir/value_head.safetensors`.
    pub fn load(dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        let path = dir.join(VALUE_HEAD_FILE);
        if !path.is_file() {
            bail!(
                "{}: no value head; a critic checkpoint has {VALUE_HEAD_FILE} next to the HF weights \
                 (use Critic::init_from_hf to start a critic from a plain Qwen3 checkpoint)",
                path.display()
            );
        }
        let backbone = Qwen3::load_hf(dir, dtype, device)?;
        let mut head = candle_core::safetensors::load(&path, device)
            .with_context(|| format!("reading value head {}", path.display()))?;
        let mut take = |name: &str| {
            head.remove(name)
                .ok_or_else(|| anyhow!("{}: missing tensor {name}", path.display()))
        };
        let (w, b) = (take(VALUE_HEAD_WEIGHT)?, take(VALUE_HEAD_BIAS)?);
        if let Some(extra) = head.keys().next() {
            bail!("{}: unexpected tensor {extra}", path.display());
        }
        Self::new(backbone, &w, &b).with_context(|| format!("loading value head {}", path.display()))
    }

    /// Writes the backbone as an HF checkpoint (stored as `dtype`, sharded past `max_shard_bytes`)
    /// and the head, in its own dtype, to `dir/value_head.safetensors` (temp file, fsync, rename).
    pub fn save(&self, dir: &Path, dtype: DType, max_shard_bytes: u64) -> Result<()> {
        self.backbone.save_hf(dir, dtype, max_shard_bytes)?;
        let tensors: HashMap<String, Tensor> = [
            (VALUE_HEAD_WEIGHT.to_string(), self.weight.as_detached_tensor()),
            (VALUE_HEAD_BIAS.to_string(), self.bias.as_detached_tensor()),
        ]
        .into_iter()
        .map(|(n, t)| Ok((n, t.to_device(&Device::Cpu)?)))
        .collect::<Result<_>>()?;
        let fin = dir.join(VALUE_HEAD_FILE);
        let tmp = dir.join(format!(".{VALUE_HEAD_FILE}.vime-tmp-{}", std::process::id()));
        let r = (|| -> Result<()> {
            candle_core::safetensors::save(&tensors, &tmp)?;
            std::fs::File::open(&tmp)?.sync_all()?;
            std::fs::rename(&tmp, &fin)?;
            #[cfg(unix)]
            std::fs::File::open(dir)?.sync_all()?;
            Ok(())
        })();
        if r.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        r.with_context(|| format!("writing {}", fin.display()))
    }

    pub fn backbone(&self) -> &Qwen3 {
        &self.backbone
    }

    pub fn config(&self) -> &Qwen3Config {
        self.backbone.config()
    }

    /// `(weight [1, hidden], bias [1])`.
    pub fn value_head(&self) -> (&Var, &Var) {
        (&self.weight, &self.bias)
    }

    /// The trainable parameters by name: the backbone's (minus an untied `lm_head.weight`), then
    /// [`VALUE_HEAD_WEIGHT`] and [`VALUE_HEAD_BIAS`].
    pub fn named_parameters(&self) -> Vec<(String, Var)> {
        let mut v: Vec<(String, Var)> = self
            .backbone
            .named_parameters()
            .iter()
            .filter(|(n, _)| n != LM_HEAD)
            .cloned()
            .collect();
        v.push((VALUE_HEAD_WEIGHT.to_string(), self.weight.clone()));
        v.push((VALUE_HEAD_BIAS.to_string(), self.bias.clone()));
        v
    }

    /// `h [T, hidden] -> [T]` in the head dtype.
    fn head(&self, h: &Tensor, track: bool) -> Result<Tensor> {
        let (w, b) = if track {
            (self.weight.as_tensor().clone(), self.bias.as_tensor().clone())
        } else {
            (self.weight.as_detached_tensor(), self.bias.as_detached_tensor())
        };
        let v = h.to_dtype(w.dtype())?.matmul(&w.t()?)?.broadcast_add(&b)?;
        Ok(v.squeeze(1)?)
    }

    /// Per-token values `[T]` (f32, or f64 for an f64 backbone), no gradient tracking.
    pub fn values(&self, batch: &PackedBatch) -> Result<Tensor> {
        self.head(&self.backbone.hidden_states(batch)?, false)
    }

    /// This critic as TP rank `rank` of `size` holds it: the backbone's shard, the value head
    /// replicated.
    pub fn shard(&self, rank: usize, size: usize) -> Result<Self> {
        let backbone = self.backbone.shard(vime_qwen3::model::TpPlace { rank, size })?;
        Self::new(
            backbone,
            &self.weight.as_detached_tensor(),
            &self.bias.as_detached_tensor(),
        )
    }

    /// Sequence parallelism for this TP shard: the backbone's residual stream is sharded by
    /// tokens; the (replicated) value head still sees every token (`Qwen3`'s custom-head path
    /// gathers the last hidden states for it).
    pub fn set_sequence_parallel(&mut self, on: bool) {
        self.backbone.set_sequence_parallel(on);
    }

    /// `--tp-comm-overlap` for the backbone's backward (see `Qwen3::set_tp_comm_overlap`).
    pub fn set_tp_comm_overlap(&mut self, on: bool) {
        self.backbone.set_tp_comm_overlap(on);
    }

    /// The whole critic from the TP shards (a collective over `tp`; kept where `keep`).
    pub fn gathered(&self, tp: &dyn vime_dist::Collectives, keep: bool) -> Result<Option<Self>> {
        let full = self.backbone.gathered_state_dict(tp)?;
        if !keep {
            return Ok(None);
        }
        let mut b = Qwen3::from_tensors(self.backbone.config().clone(), full)?;
        b.set_kernel_config(self.backbone.kernel_config().clone());
        Ok(Some(Self::new(
            b,
            &self.weight.as_detached_tensor(),
            &self.bias.as_detached_tensor(),
        )?))
    }

    /// [`Self::values`] of a TP shard, with its TP group.
    pub fn values_tp(&self, batch: &PackedBatch, tp: &dyn vime_dist::Collectives) -> Result<Tensor> {
        self.head(&self.backbone.hidden_states_tp(batch, tp)?, false)
    }

    /// [`Self::values_tp`] of a CP rank's share of a batch (`shard.batch`'s order).
    pub fn values_cp(
        &self,
        shard: &vime_qwen3::context_parallel::CpShard,
        tp: &dyn vime_dist::Collectives,
        cp: &dyn vime_dist::Collectives,
    ) -> Result<Tensor> {
        self.head(&self.backbone.hidden_states_cp(shard, tp, cp)?, false)
    }

    /// The optimizer layout of this critic at its TP place: the backbone's Megatron split, the
    /// value head replicated.
    pub fn layout(&self, dtype: DType, tp_rank: usize, tp_size: usize) -> Result<vime_dist::layout::LayoutTable> {
        let specs: Vec<vime_qwen3::state_dict::ParamSpec> = vime_qwen3::state_dict::param_specs(self.config())
            .into_iter()
            .filter(|s| s.name != LM_HEAD)
            .collect();
        let table = crate::optim::qwen3_layout(&specs, dtype, tp_rank, tp_size)?;
        let mut entries: Vec<vime_dist::layout::LayoutEntry> =
            table.entries().iter().map(|p| p.entry.clone()).collect();
        // The value head as `replicated_layout` describes it at TP 1 (same weight-decay rule).
        for (n, v) in [(VALUE_HEAD_WEIGHT, &self.weight), (VALUE_HEAD_BIAS, &self.bias)] {
            entries.push(vime_dist::layout::LayoutEntry::new(
                n.to_string(),
                v.dims(),
                v.dtype(),
                crate::optim::megatron_weight_decay(n, v.dims()),
                vime_dist::layout::Placement::Replicated,
            ));
        }
        vime_dist::layout::LayoutTable::new(entries, tp_rank, tp_size)
    }

    /// [`Self::forward_backward_tp`] under context parallelism: `loss_fn` sees this rank's
    /// tokens' values (see `Qwen3::forward_backward_cp`).
    pub fn forward_backward_cp(
        &self,
        shard: &vime_qwen3::context_parallel::CpShard,
        recompute: Recompute,
        loss_fn: impl FnOnce(&Tensor) -> Result<Tensor>,
        tp: &dyn vime_dist::Collectives,
        cp: &dyn vime_dist::Collectives,
    ) -> Result<(f64, Gradients)> {
        let (loss, grads) =
            self.backbone
                .forward_backward_with_head_cp(shard, recompute, |h| loss_fn(&self.head(h, true)?), tp, cp)?;
        Ok((loss, self.take_head_grads(grads)?))
    }

    /// Values of a micro-batch read back per sample's response tokens (for old values / GAE).
    pub fn response_values(&self, mb: &MicroBatch) -> Result<Vec<(usize, Vec<f32>)>> {
        mb.responses_from_packed(&self.values(&mb.batch)?)
    }

    /// Forward and backward of `loss_fn(values [T])`. Returns the loss and the gradient of every
    /// trainable parameter (see [`Critic::named_parameters`]), value head included.
    pub fn forward_backward(
        &self,
        batch: &PackedBatch,
        recompute: Recompute,
        loss_fn: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<(f64, Gradients)> {
        self.forward_backward_tp(batch, recompute, loss_fn, &vime_dist::SingleRank::default())
    }

    /// [`Self::forward_backward`] of a TP shard, with its TP group.
    pub fn forward_backward_tp(
        &self,
        batch: &PackedBatch,
        recompute: Recompute,
        loss_fn: impl FnOnce(&Tensor) -> Result<Tensor>,
        tp: &dyn vime_dist::Collectives,
    ) -> Result<(f64, Gradients)> {
        let (loss, grads) =
            self.backbone
                .forward_backward_with_head_tp(batch, recompute, |h| loss_fn(&self.head(h, true)?), tp)?;
        Ok((loss, self.take_head_grads(grads)?))
    }

    /// The backbone's gradients without the unused LM head, plus the value head's.
    /// Gradient accumulation (see `Qwen3::forward_backward_into`): this micro-batch's gradients
    /// added to `sums`, the earlier micro-batches' (value head included), which come back as
    /// `Gradients::params`. Under CP pass the `shard` and its `cp` group. The loss stays on the
    /// device until read (`Qwen3::forward_backward_into`).
    #[allow(clippy::too_many_arguments)]
    pub fn forward_backward_into(
        &self,
        batch: &PackedBatch,
        recompute: Recompute,
        loss_fn: impl FnOnce(&Tensor) -> Result<Tensor>,
        tp: &dyn vime_dist::Collectives,
        cp: Option<&dyn vime_dist::Collectives>,
        shard: Option<&vime_qwen3::context_parallel::CpShard>,
        mut sums: BTreeMap<String, Tensor>,
    ) -> Result<(vime_qwen3::model::QueuedLoss, Gradients)> {
        let head_sums: Vec<(String, Tensor)> = [VALUE_HEAD_WEIGHT, VALUE_HEAD_BIAS]
            .into_iter()
            .filter_map(|n| sums.remove(n).map(|t| (n.to_string(), t)))
            .collect();
        let (loss, mut grads) = self.backbone.forward_backward_with_head_into(
            batch,
            recompute,
            |h| loss_fn(&self.head(h, true)?),
            tp,
            cp,
            shard,
            sums,
        )?;
        grads.params.extend(head_sums);
        Ok((loss, self.take_head_grads(grads)?))
    }

    /// The value head's gradients into `grads.params` (added to a sum already there), and the
    /// backbone's unused LM head out.
    fn take_head_grads(&self, mut grads: Gradients) -> Result<Gradients> {
        grads.params.remove(LM_HEAD);
        for (name, var) in [(VALUE_HEAD_WEIGHT, &self.weight), (VALUE_HEAD_BIAS, &self.bias)] {
            let g = match grads.head.remove(var.as_tensor()) {
                Some(g) => g,
                None => var.as_tensor().zeros_like()?,
            };
            vime_qwen3::model::add_gradient(&mut grads.params, name.to_string(), g)?;
        }
        Ok(grads)
    }
}

/// The frozen reference policy (`--ref-load`): forward log-probs only (see the module notes).
pub struct ReferenceModel {
    model: Qwen3,
}

impl ReferenceModel {
    /// The frozen model itself.
    pub fn model(&self) -> &Qwen3 {
        &self.model
    }

    /// The kernel choice of the reference's attention (see `Qwen3::set_kernel_config`).
    pub fn set_kernel_config(&mut self, kernels: vime_kernels::KernelConfig) {
        self.model.set_kernel_config(kernels);
    }

    /// Loads an HF Qwen3 checkpoint directory as the reference.
    pub fn load(dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        let model =
            Qwen3::load_hf(dir, dtype, device).with_context(|| format!("loading --ref-load {}", dir.display()))?;
        Ok(Self { model })
    }

    /// Freezes an already built model (e.g. a copy of the initial policy).
    pub fn from_model(model: Qwen3) -> Self {
        Self { model }
    }

    pub fn config(&self) -> &Qwen3Config {
        self.model.config()
    }

    pub fn dtype(&self) -> DType {
        self.model.dtype()
    }

    pub fn set_logits_chunk_tokens(&mut self, n: usize) {
        self.model.set_logits_chunk_tokens(n);
    }

    /// Per-token next-token log-probs `[T]` f32 (0 at each sequence's last token).
    pub fn logprobs(&self, batch: &PackedBatch) -> Result<Tensor> {
        Ok(self.model.logprobs_entropy(batch)?.logprobs)
    }

    /// This reference as TP rank `rank` of `size` holds it (see `Qwen3::shard`).
    pub fn shard(&self, rank: usize, size: usize) -> Result<Self> {
        Ok(Self {
            model: self.model.shard(vime_qwen3::model::TpPlace { rank, size })?,
        })
    }

    /// Sequence parallelism for this TP shard (see `Qwen3::set_sequence_parallel`).
    pub fn set_sequence_parallel(&mut self, on: bool) {
        self.model.set_sequence_parallel(on);
    }

    /// [`Self::logprobs`] of a TP shard, with its TP group.
    pub fn logprobs_tp(&self, batch: &PackedBatch, tp: &dyn vime_dist::Collectives) -> Result<Tensor> {
        Ok(self.model.logprobs_entropy_tp(batch, tp)?.logprobs)
    }

    /// [`Self::logprobs_tp`] of a CP rank's share of a batch (`shard.batch`'s order).
    pub fn logprobs_cp(
        &self,
        shard: &vime_qwen3::context_parallel::CpShard,
        tp: &dyn vime_dist::Collectives,
        cp: &dyn vime_dist::Collectives,
    ) -> Result<Tensor> {
        Ok(self.model.logprobs_entropy_cp(shard, tp, cp)?.logprobs)
    }
}
