//! The decoder layer's backward written out by hand, as Megatron-Core does it: the forward keeps
//! the activations the backward needs ([`Saved`]), and the backward calls the kernels'
//! explicit backward ops and plain GEMMs. No candle autograd graph exists for a layer.
//!
//! Why: under candle's autograd, Nsight Compute counted 145 ms of `badd_bf16` in one Qwen3-4B
//! step of 4096 tokens with full recompute on an H200, of 580 ms of kernels
//! (`benches/results/2026-11-30-profile-step-h200.md`, section 1). Every gradient is accumulated
//! as `zeros_like + add`, and the `w.t()` in each linear layer turns the weight's gradient into a
//! strided add. The same step ran 0.906 -> 0.629 s at 8192 tokens with this file. Here each
//! gradient is written once, and each weight gradient comes out of its GEMM in the weight's own
//! layout (`dW = dY^T X`) and in f32 (`vime_kernels::weight_grad`), ready for the f32 buffers.
//!
//! The math, per layer (`x` in, `y` out, `·` a matmul with the weight as HF stores it, `[out, in]`):
//!   h1 = rms(x; w_in)         q = h1·Wq^T  k = h1·Wk^T  v = h1·Wv^T
//!   qr = rope(rms_head(q; w_qn))   kr = rope(rms_head(k; w_kn))   a = attn(qr, kr, v)
//!   x2 = x + a·Wo^T           h2 = rms(x2; w_post)
//!   g = h2·Wg^T  u = h2·Wu^T  s = silu(g) * u   y = x2 + s·Wd^T
//! and backward, from dy:
//!   dWd = dy^T s   ds = dy·Wd   (dg, du) = swiglu'(g, u; ds)   dWg = dg^T h2   dWu = du^T h2
//!   dh2 = dg·Wg + du·Wu   dx2 = dy + rms'(x2; dh2)   dWo = dx2^T a   da = dx2·Wo
//!   (dqr, dkr, dv) = attn'(da)   dq = rms_head'(q; rope'(dqr))   dk likewise
//!   dWq = dq^T h1 (k, v likewise)   dh1 = dq·Wq + dk·Wk + dv·Wv   dx = dx2 + rms'(x; dh1)
//! (optional q/k/v/o biases: db = column sums of the same upstream gradients).
//!
//! Memory: [`Saved`] keeps x, h1, the pre-norm q and k, v, the roped q and k, the attention
//! output, x2, h2, gate, up and the SwiGLU output: about 0.5 GB per Qwen3-4B layer at 4096
//! tokens. Nothing is recomputed in the backward (recomputing the SwiGLU output cost ~140 us per
//! layer at 4096 x 9728, each norm ~25 us); `Recompute::Full` keeps only x and re-runs the
//! whole layer forward instead.
use crate::batch::PackedBatch;
use crate::model::{Layer, Qwen3};
use anyhow::Result;
use candle_core::{Tensor, Var};
use std::collections::BTreeMap;
use vime_kernels::{
    matmul_acc, rms_norm, rms_norm_backward, rope, rope_backward, swiglu, swiglu_backward, varlen_attention_backward,
    varlen_attention_saved, AttentionSaved,
};

/// The activations of one layer's forward that its explicit backward reads.
pub(crate) struct Saved {
    x: Tensor,
    h1: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qr: Tensor,
    kr: Tensor,
    attn: Tensor,
    attn_saved: AttentionSaved,
    x2: Tensor,
    h2: Tensor,
    gate: Tensor,
    up: Tensor,
    act: Tensor,
}

fn dw(v: &Var) -> Tensor {
    v.as_detached_tensor()
}

/// `x · W^T (+ b)`.
fn linear(x: &Tensor, weight: &Var, bias: Option<&Var>) -> Result<Tensor> {
    let y = x.matmul(&dw(weight).t()?)?;
    Ok(match bias {
        Some(b) => y.broadcast_add(&dw(b))?,
        None => y,
    })
}

/// Adds `g` to the gradient of `name` (the first contribution is stored as is).
fn put(grads: &mut BTreeMap<String, Tensor>, name: String, g: Tensor) -> Result<()> {
    let g = match grads.remove(&name) {
        Some(prev) => (prev + g)?,
        None => g,
    };
    grads.insert(name, g);
    Ok(())
}

impl Qwen3 {
    /// One layer's forward with no autograd graph: the output and what [`Self::layer_backward`]
    /// needs.
    pub(crate) fn layer_forward_saved(&self, l: &Layer, x: &Tensor, batch: &PackedBatch) -> Result<(Tensor, Saved)> {
        let c = self.config();
        let (t, d) = (batch.num_tokens(), c.head_dim);
        let eps = c.rms_norm_eps;
        let h1 = rms_norm(x, &dw(&l.input_norm), eps)?;
        let q = linear(&h1, &l.q_proj, l.q_bias.as_ref())?.reshape((t, c.num_attention_heads, d))?;
        let k = linear(&h1, &l.k_proj, l.k_bias.as_ref())?.reshape((t, c.num_key_value_heads, d))?;
        let v = linear(&h1, &l.v_proj, l.v_bias.as_ref())?.reshape((t, c.num_key_value_heads, d))?;
        let qr = rope(&rms_norm(&q, &dw(&l.q_norm), eps)?, &batch.position_ids, c.rope_theta)?;
        let kr = rope(&rms_norm(&k, &dw(&l.k_norm), eps)?, &batch.position_ids, c.rope_theta)?;
        let scale = 1.0 / (d as f64).sqrt();
        let (attn, attn_saved) = varlen_attention_saved(&qr, &kr, &v, &batch.cu_seqlens, &batch.cu_seqlens, scale)?;
        let a2 = attn.reshape((t, c.num_attention_heads * d))?;
        let x2 = (x + linear(&a2, &l.o_proj, l.o_bias.as_ref())?)?;
        let h2 = rms_norm(&x2, &dw(&l.post_norm), eps)?;
        let gate = linear(&h2, &l.gate_proj, None)?;
        let up = linear(&h2, &l.up_proj, None)?;
        let act = swiglu(&gate, &up)?;
        let y = (&x2 + linear(&act, &l.down_proj, None)?)?;
        let saved = Saved {
            x: x.clone(),
            h1,
            q,
            k,
            v,
            qr,
            kr,
            attn,
            attn_saved,
            x2,
            h2,
            gate,
            up,
            act,
        };
        Ok((y, saved))
    }

    /// The backward of layer `i` from `dy = dL/dy`: adds the parameter gradients to `grads` (by HF
    /// name) and returns `dL/dx`.
    pub(crate) fn layer_backward(
        &self,
        i: usize,
        s: Saved,
        dy: &Tensor,
        batch: &PackedBatch,
        grads: &mut BTreeMap<String, Tensor>,
    ) -> Result<Tensor> {
        let l = &self.layers[i];
        let c = self.config();
        let (t, d) = (batch.num_tokens(), c.head_dim);
        let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        let eps = c.rms_norm_eps;
        let name = |p: &str| format!("model.layers.{i}.{p}");
        // dW = dY^T X in the weight's own [out, in] layout, in f32 (f64 models: f64).
        let wgrad = |dy2: &Tensor, x2: &Tensor| -> Result<Tensor> { Ok(vime_kernels::weight_grad(dy2, x2)?) };
        let bgrad = |dy2: &Tensor| -> Result<Tensor> { Ok(dy2.sum(0)?) };

        // MLP.
        let h2 = &s.h2;
        put(grads, name("mlp.down_proj.weight"), wgrad(dy, &s.act)?)?;
        let ds = dy.matmul(&dw(&l.down_proj))?;
        let (dg, du) = swiglu_backward(&s.gate, &s.up, &ds)?;
        drop(ds);
        put(grads, name("mlp.gate_proj.weight"), wgrad(&dg, h2)?)?;
        put(grads, name("mlp.up_proj.weight"), wgrad(&du, h2)?)?;
        let dh2 = matmul_acc(dg.matmul(&dw(&l.gate_proj))?, &du, &dw(&l.up_proj))?;
        drop((dg, du));
        let (dx2n, dwpost) = rms_norm_backward(&s.x2, &dw(&l.post_norm), eps, &dh2)?;
        put(grads, name("post_attention_layernorm.weight"), dwpost)?;
        let dx2 = (dy + dx2n)?;

        // Attention output projection.
        let a2 = s.attn.reshape((t, nh * d))?;
        put(grads, name("self_attn.o_proj.weight"), wgrad(&dx2, &a2)?)?;
        if l.o_bias.is_some() {
            put(grads, name("self_attn.o_proj.bias"), bgrad(&dx2)?)?;
        }
        let da = dx2.matmul(&dw(&l.o_proj))?.reshape((t, nh, d))?;
        let (dqr, dkr, dv) = varlen_attention_backward(&s.attn_saved, &s.qr, &s.kr, &s.v, &s.attn, &da)?;
        drop(da);
        let (dq, dwqn) = rms_norm_backward(
            &s.q,
            &dw(&l.q_norm),
            eps,
            &rope_backward(&dqr, &batch.position_ids, c.rope_theta)?,
        )?;
        let (dk, dwkn) = rms_norm_backward(
            &s.k,
            &dw(&l.k_norm),
            eps,
            &rope_backward(&dkr, &batch.position_ids, c.rope_theta)?,
        )?;
        put(grads, name("self_attn.q_norm.weight"), dwqn)?;
        put(grads, name("self_attn.k_norm.weight"), dwkn)?;
        let dq = dq.reshape((t, nh * d))?;
        let dk = dk.reshape((t, nkv * d))?;
        let dv = dv.reshape((t, nkv * d))?;

        // q/k/v projections and the input norm.
        let h1 = &s.h1;
        put(grads, name("self_attn.q_proj.weight"), wgrad(&dq, h1)?)?;
        put(grads, name("self_attn.k_proj.weight"), wgrad(&dk, h1)?)?;
        put(grads, name("self_attn.v_proj.weight"), wgrad(&dv, h1)?)?;
        for (b, g, n) in [(&l.q_bias, &dq, "q"), (&l.k_bias, &dk, "k"), (&l.v_bias, &dv, "v")] {
            if b.is_some() {
                put(grads, name(&format!("self_attn.{n}_proj.bias")), bgrad(g)?)?;
            }
        }
        let dh1 = matmul_acc(dq.matmul(&dw(&l.q_proj))?, &dk, &dw(&l.k_proj))?;
        let dh1 = matmul_acc(dh1, &dv, &dw(&l.v_proj))?;
        let (dxn, dwin) = rms_norm_backward(&s.x, &dw(&l.input_norm), eps, &dh1)?;
        put(grads, name("input_layernorm.weight"), dwin)?;
        Ok((dx2 + dxn)?)
    }
}
