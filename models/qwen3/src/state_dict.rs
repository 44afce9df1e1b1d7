//! The HF weight-name table of a dense Qwen3: every parameter's name, shape and kind, as data.
//!
//! Decisions:
//! - One table ([`param_specs`]) that loading, saving, the model and later weight decay / tensor
//!   parallel sharding all read, instead of names spelled out at each use.
//! - Canonical order: embeddings, then each layer in forward order (input norm, q/k/v/o each
//!   followed by its bias, q/k norms, post-attention norm, gate/up/down), then the final norm, then
//!   `lm_head` (only when untied). Shards are filled in this order. (HF's `state_dict()` lists a
//!   layer in module-registration order, attention, mlp, then the two norms; names are what count.)
//! - Shapes are PyTorch `nn.Linear` layout, `[out_features, in_features]`.
//! - With `attention_bias`, q, k, v AND o_proj get a bias: transformers' `Qwen3Attention` builds
//!   all four with `bias=config.attention_bias` (unlike Qwen2, whose o_proj never has one).
//! - Each parameter carries its tensor-parallel [`Placement`] (Megatron's: column-parallel q/k/v
//!   and gate/up, their biases split with them; row-parallel o/down, whose bias stays replicated
//!   and is added once after the reduction; vocab-parallel embeddings and `lm_head`; norms
//!   replicated). Only data for now: the layout table (`vime_dist::layout`) reads it.
//! - Checked against `Qwen3ForCausalLM(config).state_dict()` of transformers 5.17 (names and
//!   shapes, with and without `attention_bias`). A tied model's `state_dict()` still lists
//!   `lm_head.weight` (the shared tensor) but `save_pretrained` does not write it.
use crate::config::Qwen3Config;

pub const EMBED_TOKENS: &str = "model.embed_tokens.weight";
pub const FINAL_NORM: &str = "model.norm.weight";
pub const LM_HEAD: &str = "lm_head.weight";

/// What a parameter is; decides weight decay and, later, how tensor parallelism shards it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParamKind {
    /// `model.embed_tokens.weight` `[vocab, hidden]` (also the LM head when tied).
    Embedding,
    /// A linear weight `[out, in]`, `lm_head.weight` included.
    LinearWeight,
    /// A linear bias `[out]` (only with `attention_bias`).
    LinearBias,
    /// An RMSNorm gain `[dim]`.
    NormWeight,
}

impl ParamKind {
    /// The usual AdamW split: decay matrices (embeddings, linear weights), not biases or norm gains.
    pub fn default_weight_decay(self) -> bool {
        matches!(self, ParamKind::Embedding | ParamKind::LinearWeight)
    }
}

/// How tensor parallelism splits a parameter (the layout table's type, so both read one enum):
/// `Replicated` (norm gains, o_proj's bias), `Column` (dim 0: q/k/v, gate/up weights, q/k/v
/// biases), `Row` (dim 1: o_proj, down_proj weights), `Vocab` (dim 0: embed_tokens, lm_head).
pub use vime_dist::layout::Placement;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub kind: ParamKind,
    pub placement: Placement,
}

impl ParamSpec {
    fn new(name: impl Into<String>, shape: &[usize], kind: ParamKind, placement: Placement) -> Self {
        ParamSpec {
            name: name.into(),
            shape: shape.to_vec(),
            kind,
            placement,
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The layer index for `model.layers.{i}.*` names, `None` for embeddings, final norm, lm_head.
    pub fn layer(&self) -> Option<usize> {
        self.name.strip_prefix("model.layers.")?.split('.').next()?.parse().ok()
    }
}

/// `model.layers.{i}` (no trailing dot): the HF module path of decoder layer `i`.
pub fn layer_prefix(i: usize) -> String {
    format!("model.layers.{i}")
}

/// The parameters of decoder layer `i`, in canonical order.
pub fn layer_param_specs(cfg: &Qwen3Config, i: usize) -> Vec<ParamSpec> {
    use ParamKind::*;
    use Placement::*;
    let p = layer_prefix(i);
    let (h, im, d) = (cfg.hidden_size, cfg.intermediate_size, cfg.head_dim);
    let (q, kv) = (cfg.q_dim(), cfg.kv_dim());
    let mut v = vec![ParamSpec::new(
        format!("{p}.input_layernorm.weight"),
        &[h],
        NormWeight,
        Replicated,
    )];
    // (projection, out, in, weight placement, bias placement)
    for (proj, out, inp, wp, bp) in [
        ("q_proj", q, h, Column, Column),
        ("k_proj", kv, h, Column, Column),
        ("v_proj", kv, h, Column, Column),
        ("o_proj", h, q, Row, Replicated),
    ] {
        v.push(ParamSpec::new(
            format!("{p}.self_attn.{proj}.weight"),
            &[out, inp],
            LinearWeight,
            wp,
        ));
        if cfg.attention_bias {
            v.push(ParamSpec::new(
                format!("{p}.self_attn.{proj}.bias"),
                &[out],
                LinearBias,
                bp,
            ));
        }
    }
    v.push(ParamSpec::new(
        format!("{p}.self_attn.q_norm.weight"),
        &[d],
        NormWeight,
        Replicated,
    ));
    v.push(ParamSpec::new(
        format!("{p}.self_attn.k_norm.weight"),
        &[d],
        NormWeight,
        Replicated,
    ));
    v.push(ParamSpec::new(
        format!("{p}.post_attention_layernorm.weight"),
        &[h],
        NormWeight,
        Replicated,
    ));
    v.push(ParamSpec::new(
        format!("{p}.mlp.gate_proj.weight"),
        &[im, h],
        LinearWeight,
        Column,
    ));
    v.push(ParamSpec::new(
        format!("{p}.mlp.up_proj.weight"),
        &[im, h],
        LinearWeight,
        Column,
    ));
    v.push(ParamSpec::new(
        format!("{p}.mlp.down_proj.weight"),
        &[h, im],
        LinearWeight,
        Row,
    ));
    v
}

/// Every parameter of `Qwen3ForCausalLM` for `cfg`, in canonical order.
pub fn param_specs(cfg: &Qwen3Config) -> Vec<ParamSpec> {
    let (v, h) = (cfg.vocab_size, cfg.hidden_size);
    let mut specs = vec![ParamSpec::new(
        EMBED_TOKENS,
        &[v, h],
        ParamKind::Embedding,
        Placement::Vocab,
    )];
    for i in 0..cfg.num_hidden_layers {
        specs.extend(layer_param_specs(cfg, i));
    }
    specs.push(ParamSpec::new(
        FINAL_NORM,
        &[h],
        ParamKind::NormWeight,
        Placement::Replicated,
    ));
    if !cfg.tie_word_embeddings {
        specs.push(ParamSpec::new(
            LM_HEAD,
            &[v, h],
            ParamKind::LinearWeight,
            Placement::Vocab,
        ));
    }
    specs
}
