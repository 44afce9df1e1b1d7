//! Test reference, not the training path: the decoder layer through candle's autograd, and the
//! layer-by-layer VJP backward over it. `Qwen3::set_explicit_backward(false)` switches
//! `forward_backward*` to this file so that tests (`tests/explicit_backward.rs`) and
//! `vime-bench --backward autograd` can hold the explicit block (`block.rs`) to it.
//!
//! Decisions:
//! - The same math and kernels as the block's forward (`rms_norm`, `rope`, `varlen_attention`,
//!   `swiglu` with their autograd backward), the same local dims from the model's `BlockCtx`, so a
//!   mismatch is a bug in the explicit backward, not a difference of formulas.
//! - The backward walks the layers in reverse with the VJP trick: for layer `l` with input leaf
//!   `x_l` and output `y_l`, `vjp_seed(y_l, g).backward()` gives the layer's parameter gradients
//!   and `g_{l-1} = d/dx_l`. Under `Recompute::None` each layer's graph is kept from the forward;
//!   under `Recompute::Full` only the inputs are kept and each layer re-runs before its backward.
use crate::batch::PackedBatch;
use crate::block::Block;
use crate::model::{take_grad, w, Gradients, Head, Qwen3, Recompute};
use anyhow::Result;
use candle_core::{Tensor, Var};
use std::collections::BTreeMap;
use vime_kernels::{rms_norm, rope, swiglu, varlen_attention, vjp_seed};

fn linear(x: &Tensor, weight: &Var, bias: Option<&Var>) -> Result<Tensor> {
    let y = x.matmul(&w(weight, true).t()?)?;
    Ok(match bias {
        Some(b) => y.broadcast_add(&w(b, true))?,
        None => y,
    })
}

/// One decoder layer with every weight tracked, `x: [T, hidden]` -> `[T, hidden]`.
fn layer_forward(m: &Qwen3, l: &Block, x: &Tensor, batch: &PackedBatch) -> Result<Tensor> {
    let c = m.block_ctx();
    let (t, d, eps) = (batch.num_tokens(), c.head_dim, c.eps);
    let h = rms_norm(x, &w(&l.input_norm, true), eps)?;
    let q = linear(&h, &l.q_proj, l.q_bias.as_ref())?.reshape((t, c.q_heads, d))?;
    let k = linear(&h, &l.k_proj, l.k_bias.as_ref())?.reshape((t, c.kv_heads, d))?;
    let v = linear(&h, &l.v_proj, l.v_bias.as_ref())?.reshape((t, c.kv_heads, d))?;
    let q = rope(
        &rms_norm(&q, &w(&l.q_norm, true), eps)?,
        &batch.position_ids,
        c.rope_theta,
    )?;
    let k = rope(
        &rms_norm(&k, &w(&l.k_norm, true), eps)?,
        &batch.position_ids,
        c.rope_theta,
    )?;
    let cu = &batch.cu_seqlens;
    let a = varlen_attention(&q, &k, &v, cu, cu, c.softmax_scale(), &c.kernels)?;
    let a = a.reshape((t, c.q_heads * d))?;
    let x = (x + linear(&a, &l.o_proj, l.o_bias.as_ref())?)?;
    let h = rms_norm(&x, &w(&l.post_norm, true), eps)?;
    let gate = linear(&h, &l.gate_proj, None)?;
    let up = linear(&h, &l.up_proj, None)?;
    let mlp = linear(&swiglu(&gate, &up)?, &l.down_proj, None)?;
    Ok((x + mlp)?)
}

/// `Qwen3::forward_backward*` through candle's autograd (head included).
pub(crate) fn forward_backward(
    m: &Qwen3,
    batch: &PackedBatch,
    recompute: Recompute,
    head: Head<'_>,
) -> Result<(crate::model::QueuedLoss, Gradients)> {
    let keep_graph = recompute == Recompute::None; // any other layout: per-layer recompute (the same values)
                                                   // Under `None`, `kept[l]` holds layer l's input leaf and its tracked output; under `Full`,
                                                   // `inputs[l]` holds only the layer's (detached) input.
    let mut inputs: Vec<Tensor> = Vec::with_capacity(m.blocks.len());
    let mut kept: Vec<Option<(Var, Tensor)>> = Vec::with_capacity(m.blocks.len());
    let mut x = m.embed_tokens(batch, false)?;
    for l in &m.blocks {
        if keep_graph {
            let leaf = Var::from_tensor(&x)?;
            let y = layer_forward(m, l, leaf.as_tensor(), batch)?;
            x = y.detach();
            kept.push(Some((leaf, y)));
        } else {
            let next = m.block_forward(l, &x, batch)?;
            inputs.push(std::mem::replace(&mut x, next));
            kept.push(None);
        }
    }

    let mut params: BTreeMap<String, Tensor> = BTreeMap::new();
    let (loss, mut g, head_grads, tied_head_grad) = m.autograd_head(&x, batch, head, &mut params)?;

    for (i, l) in m.blocks.iter().enumerate().rev() {
        let (leaf, y) = match kept[i].take() {
            Some(pair) => pair,
            None => {
                let leaf = Var::from_tensor(&inputs[i])?;
                let y = layer_forward(m, l, leaf.as_tensor(), batch)?;
                (leaf, y)
            }
        };
        let mut grads = vjp_seed(&y, &g)?.backward()?;
        g = take_grad(&mut grads, leaf.as_tensor(), "a layer input")?;
        m.move_grads(&mut grads, &mut params, &l.vars())?;
    }

    let e = m.embed_tokens(batch, true)?;
    let mut grads = vjp_seed(&e, &g)?.backward()?;
    let ge = take_grad(&mut grads, m.embed.as_tensor(), "model.embed_tokens.weight")?;
    let ge = match tied_head_grad {
        Some(t) => (ge + t)?,
        None => ge,
    };
    params.insert("model.embed_tokens.weight".to_string(), ge);
    Ok((
        crate::model::QueuedLoss::device(loss)?,
        Gradients {
            params,
            head: head_grads,
        },
    ))
}
