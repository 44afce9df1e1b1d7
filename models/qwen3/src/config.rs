//! `Qwen3Config`: the dense Qwen3 `config.json`, read in every spelling HF has used, validated
//! against what vime implements, and written back in a form transformers 4.5x, 5.x and vLLM read.
//!
//! Decisions:
//! - Reading follows transformers' own resolution, not a guess:
//!   - `dtype` (5.x) wins over `torch_dtype` (4.x) when both are present, as in `PreTrainedConfig`.
//!   - RoPE: 5.x writes `rope_parameters: {"rope_type", "rope_theta"}`, 4.x writes top-level
//!     `rope_theta` + `rope_scaling`. As in 5.x `convert_rope_params_to_dict`, a non-null
//!     `rope_scaling` replaces `rope_parameters`, the dict's `rope_theta` wins over the top-level
//!     one, and the default theta is 10000.
//!   - `head_dim` absent means 128: that is the `Qwen3Config` class default in transformers (4.51
//!     and 5.x alike), and HF's modeling reads `config.head_dim`, which therefore always exists. The
//!     `hidden_size / num_attention_heads` fallback in `modeling_qwen3.py` is never reached through
//!     a real `Qwen3Config`, so using it here would silently build different shapes than HF for a
//!     config that omits `head_dim` (e.g. any tiny test config). An explicit `null` is rejected.
//!   - `num_key_value_heads` absent or null means `num_attention_heads`; `sliding_window` is reset
//!     to `None` unless `use_sliding_window` (both as in `Qwen3Config.__post_init__`).
//! - A RoPE dict of type `default` with nothing else in it is folded into `rope_theta` (so
//!   `rope_scaling` is `None`); anything else is kept in `rope_scaling` for [`Qwen3Config::validate`]
//!   to reject by name, since vime implements only the default RoPE.
//! - Parsing (serde) only normalizes; [`Qwen3Config::validate`] decides what vime supports. The
//!   `from_*` constructors do both.
//! - [`Qwen3Config::to_hf_json`] writes every key both generations read: `torch_dtype` and `dtype`,
//!   top-level `rope_theta` + `rope_scaling: null` (4.x, older vLLM) and `rope_parameters` (5.x).
use anyhow::{anyhow, bail, Context, Result};
use candle_core::DType;
use serde::{Deserialize, Serialize};
use serde_json::{json, Map, Value};
use std::path::Path;

/// transformers' `Qwen3Config.head_dim` class default (used when `config.json` has no `head_dim`).
pub const HF_DEFAULT_HEAD_DIM: usize = 128;
/// transformers' `RotaryEmbeddingConfigMixin.default_theta` (no `rope_theta` anywhere).
pub const HF_DEFAULT_ROPE_THETA: f64 = 10_000.0;

/// The most decoder layers a config may have (the largest published dense models have a few
/// hundred); more is taken for a corrupt file.
pub const MAX_HIDDEN_LAYERS: usize = 10_000;

/// The names accepted by [`Qwen3Config::preset`].
pub const PRESET_NAMES: [&str; 4] = ["qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b"];

/// `eos_token_id` (and friends): HF allows one id or a list.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

impl TokenIds {
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(id) => vec![*id],
            TokenIds::Many(ids) => ids.clone(),
        }
    }
    pub fn contains(&self, id: u32) -> bool {
        match self {
            TokenIds::One(x) => *x == id,
            TokenIds::Many(ids) => ids.contains(&id),
        }
    }
}

/// A dense Qwen3 configuration, field for field the HF `config.json` (plain HF names).
///
/// `Serialize` writes this struct as is (vime's own spelling, which `Deserialize` reads back);
/// [`Qwen3Config::to_hf_json`] writes the `config.json` that HF and vLLM read.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(try_from = "RawConfig")]
pub struct Qwen3Config {
    /// `Some("qwen3")` when read from a file that names it; anything else fails `validate`.
    pub model_type: Option<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    /// Per-head dimension; NOT `hidden_size / num_attention_heads` in general (Qwen3-4B: 128 != 80).
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    /// A RoPE scaling dict other than the plain default; `validate` rejects any `Some`.
    pub rope_scaling: Option<Value>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// Bias on q/k/v AND o_proj (transformers' `Qwen3Attention` uses `bias=config.attention_bias`
    /// for all four).
    pub attention_bias: bool,
    /// Storage dtype as HF names it ("bfloat16", "float16", "float32"), from `dtype` or
    /// `torch_dtype`; `None` when the file names neither.
    pub dtype: Option<String>,
    pub hidden_act: String,
    pub use_sliding_window: bool,
    pub sliding_window: Option<usize>,
    pub max_window_layers: usize,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<TokenIds>,
    pub pad_token_id: Option<u32>,
    /// Per-layer attention types when the file lists them (5.x always does).
    pub layer_types: Option<Vec<String>>,
    pub attention_dropout: f64,
    pub initializer_range: f64,
}

/// Every spelling of the HF keys, before normalization.
#[derive(Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    vocab_size: Option<usize>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    // `None` when absent (HF default 128), `Some(Value::Null)` when explicitly null (rejected).
    #[serde(default, deserialize_with = "present")]
    head_dim: Option<Value>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    max_position_embeddings: Option<usize>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    dtype: Option<String>,
    torch_dtype: Option<String>,
    hidden_act: Option<String>,
    use_sliding_window: Option<bool>,
    sliding_window: Option<usize>,
    max_window_layers: Option<usize>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<TokenIds>,
    pad_token_id: Option<u32>,
    layer_types: Option<Vec<String>>,
    attention_dropout: Option<f64>,
    initializer_range: Option<f64>,
}

/// Marks a key as present even when its value is null.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

fn required(v: Option<usize>, field: &str) -> Result<usize> {
    v.ok_or_else(|| anyhow!("config: missing field `{field}`"))
}

/// Splits a RoPE dict into (theta, the dict if it is anything but a plain default RoPE).
fn normalize_rope(params: &Value, top_level_theta: Option<f64>) -> Result<(f64, Option<Value>)> {
    let obj = params
        .as_object()
        .ok_or_else(|| anyhow!("config: `rope_parameters`/`rope_scaling` must be an object, got {params}"))?;
    // 5.x may nest one dict per layer type ({"full_attention": {...}, "sliding_attention": {...}}).
    let layer_keys = ["full_attention", "sliding_attention"];
    let obj = if !obj.is_empty() && obj.keys().all(|k| layer_keys.contains(&k.as_str())) {
        let mut dicts = obj.iter().filter(|(_, v)| !v.is_null());
        let (first_name, first) = dicts
            .next()
            .ok_or_else(|| anyhow!("config: `rope_parameters` has no entries"))?;
        for (name, other) in dicts {
            if other != first {
                bail!(
                    "config: `rope_parameters` differs between layer types ({first_name}: {first}, {name}: {other}); \
                     vime supports one RoPE for all layers"
                );
            }
        }
        first
            .as_object()
            .ok_or_else(|| anyhow!("config: `rope_parameters.{first_name}` must be an object, got {first}"))?
    } else {
        obj
    };
    let theta = match obj.get("rope_theta") {
        Some(Value::Null) | None => top_level_theta.unwrap_or(HF_DEFAULT_ROPE_THETA),
        Some(v) => v
            .as_f64()
            .ok_or_else(|| anyhow!("config: `rope_parameters.rope_theta` must be a number, got {v}"))?,
    };
    let rope_type = rope_type_of(obj);
    let residual: Vec<&String> = obj
        .iter()
        .filter(|(k, v)| {
            let known = matches!(k.as_str(), "rope_type" | "type" | "rope_theta");
            let trivial = k.as_str() == "partial_rotary_factor" && v.as_f64() == Some(1.0);
            !(known || trivial)
        })
        .map(|(k, _)| k)
        .collect();
    if rope_type == "default" && residual.is_empty() {
        Ok((theta, None))
    } else {
        let mut kept = obj.clone();
        kept.remove("rope_theta");
        Ok((theta, Some(Value::Object(kept))))
    }
}

fn rope_type_of(obj: &Map<String, Value>) -> String {
    match obj.get("rope_type").or_else(|| obj.get("type")) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Null) | None => "default".to_string(),
        Some(other) => other.to_string(),
    }
}

impl TryFrom<RawConfig> for Qwen3Config {
    type Error = anyhow::Error;

    fn try_from(r: RawConfig) -> Result<Self> {
        let num_attention_heads = required(r.num_attention_heads, "num_attention_heads")?;
        let head_dim = match r.head_dim {
            None => HF_DEFAULT_HEAD_DIM,
            Some(Value::Null) => bail!("config: `head_dim` is null (transformers' Qwen3Config requires an integer)"),
            Some(v) => v
                .as_u64()
                .map(|x| x as usize)
                .ok_or_else(|| anyhow!("config: `head_dim` must be a non-negative integer, got {v}"))?,
        };
        // As transformers 5.x: a non-null `rope_scaling` replaces `rope_parameters`.
        let rope_dict = r.rope_scaling.as_ref().or(r.rope_parameters.as_ref());
        let (rope_theta, rope_scaling) = match rope_dict {
            Some(d) => normalize_rope(d, r.rope_theta)?,
            None => (r.rope_theta.unwrap_or(HF_DEFAULT_ROPE_THETA), None),
        };
        let use_sliding_window = r.use_sliding_window.unwrap_or(false);
        Ok(Qwen3Config {
            model_type: r.model_type,
            vocab_size: required(r.vocab_size, "vocab_size")?,
            hidden_size: required(r.hidden_size, "hidden_size")?,
            intermediate_size: required(r.intermediate_size, "intermediate_size")?,
            num_hidden_layers: required(r.num_hidden_layers, "num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads: r.num_key_value_heads.unwrap_or(num_attention_heads),
            head_dim,
            rms_norm_eps: r.rms_norm_eps.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings: r.max_position_embeddings.unwrap_or(32768),
            tie_word_embeddings: r.tie_word_embeddings.unwrap_or(false),
            attention_bias: r.attention_bias.unwrap_or(false),
            // "If both are provided, keep `dtype`" (transformers 5 `PreTrainedConfig.__post_init__`).
            dtype: r.dtype.or(r.torch_dtype),
            hidden_act: r.hidden_act.unwrap_or_else(|| "silu".to_string()),
            use_sliding_window,
            sliding_window: if use_sliding_window { r.sliding_window } else { None },
            max_window_layers: r.max_window_layers.unwrap_or(28),
            bos_token_id: r.bos_token_id,
            eos_token_id: r.eos_token_id,
            pad_token_id: r.pad_token_id,
            layer_types: r.layer_types,
            attention_dropout: r.attention_dropout.unwrap_or(0.0),
            initializer_range: r.initializer_range.unwrap_or(0.02),
        })
    }
}

/// HF dtype name -> candle dtype, for the dtypes vime stores weights in.
pub fn dtype_from_hf_name(name: &str) -> Result<DType> {
    match name {
        "bfloat16" => Ok(DType::BF16),
        "float16" => Ok(DType::F16),
        "float32" => Ok(DType::F32),
        other => bail!("dtype {other:?} is not supported (expected \"bfloat16\", \"float16\" or \"float32\")"),
    }
}

/// candle dtype -> the name HF writes in `config.json`.
pub fn hf_dtype_name(dtype: DType) -> Result<&'static str> {
    match dtype {
        DType::BF16 => Ok("bfloat16"),
        DType::F16 => Ok("float16"),
        DType::F32 => Ok("float32"),
        other => bail!("dtype {other:?} is not supported for Qwen3 weights (expected bf16, f16 or f32)"),
    }
}

/// A Qwen3 dense release vime knows by name (`--model`): its preset name and its Hugging Face id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Preset {
    pub name: &'static str,
    pub hf_id: &'static str,
}

/// The releases of [`Qwen3Config::preset`], with their Hugging Face ids.
pub const PRESETS: &[Preset] = &[
    Preset {
        name: "qwen3-0.6b",
        hf_id: "Qwen/Qwen3-0.6B",
    },
    Preset {
        name: "qwen3-1.7b",
        hf_id: "Qwen/Qwen3-1.7B",
    },
    Preset {
        name: "qwen3-4b",
        hf_id: "Qwen/Qwen3-4B",
    },
    Preset {
        name: "qwen3-8b",
        hf_id: "Qwen/Qwen3-8B",
    },
];

impl Preset {
    /// The preset named `name`: vime's name or the HF id, in any case (`qwen3-4b`,
    /// `Qwen/Qwen3-4B`, `Qwen3-4B`).
    pub fn find(name: &str) -> Option<Preset> {
        let n = name.to_ascii_lowercase();
        PRESETS
            .iter()
            .find(|p| {
                let id = p.hf_id.to_ascii_lowercase();
                n == p.name || n == id || Some(n.as_str()) == id.split('/').nth(1)
            })
            .copied()
    }

    /// The release's config.json ([`Qwen3Config::preset`]).
    pub fn config(&self) -> Qwen3Config {
        Qwen3Config::preset(self.name).expect("every entry of PRESETS is a preset")
    }
}

impl Qwen3Config {
    /// Parses a `config.json` text (4.x or 5.x spelling) and validates it.
    pub fn from_json_str(s: &str) -> Result<Self> {
        let cfg: Qwen3Config = serde_json::from_str(s).context("parsing Qwen3 config.json")?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads and validates a `config.json`; errors name the file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Self::from_json_str(&text).with_context(|| format!("invalid Qwen3 config {}", path.display()))
    }

    /// Rejects everything vime's Qwen3 does not implement, naming the field and its value.
    pub fn validate(&self) -> Result<()> {
        if let Some(mt) = &self.model_type {
            if mt != "qwen3" {
                bail!(
                    "model_type = {mt:?} is not supported: vime implements only the dense \"qwen3\" model \
                     (not qwen3_moe, qwen2, qwen3_next, ...)"
                );
            }
        }
        for (field, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                bail!("{field} = 0: must be positive");
            }
        }
        if !self.num_attention_heads.is_multiple_of(self.num_key_value_heads) {
            bail!(
                "num_attention_heads = {} is not a multiple of num_key_value_heads = {}",
                self.num_attention_heads,
                self.num_key_value_heads
            );
        }
        if !self.head_dim.is_multiple_of(2) {
            bail!(
                "head_dim = {} is odd: rotary embeddings need an even head_dim",
                self.head_dim
            );
        }
        if self.vocab_size > u32::MAX as usize {
            bail!("vocab_size = {} does not fit in u32 token ids", self.vocab_size);
        }
        if !(self.rms_norm_eps > 0.0 && self.rms_norm_eps.is_finite()) {
            bail!("rms_norm_eps = {}: must be positive and finite", self.rms_norm_eps);
        }
        if !(self.rope_theta > 0.0 && self.rope_theta.is_finite()) {
            bail!("rope_theta = {}: must be positive and finite", self.rope_theta);
        }
        if let Some(rs) = &self.rope_scaling {
            let Some(obj) = rs.as_object() else {
                bail!("rope_scaling = {rs}: must be null or an object");
            };
            let rope_type = rope_type_of(obj);
            if rope_type != "default" {
                bail!(
                    "rope_scaling / rope_parameters rope_type = {rope_type:?} is not implemented: vime implements only \
                     the default RoPE (no yarn, linear, dynamic, llama3, longrope scaling); full value: {rs}"
                );
            }
            let extra: Vec<&str> = obj
                .keys()
                .map(String::as_str)
                .filter(|k| !matches!(*k, "rope_type" | "type" | "rope_theta"))
                .collect();
            if !extra.is_empty() {
                bail!(
                    "rope_scaling / rope_parameters has keys {extra:?} that vime does not implement; full value: {rs}"
                );
            }
        }
        if self.hidden_act != "silu" {
            bail!(
                "hidden_act = {:?} is not supported: vime implements only \"silu\" (SwiGLU)",
                self.hidden_act
            );
        }
        if self.attention_dropout != 0.0 {
            bail!(
                "attention_dropout = {} is not supported: vime implements only 0.0",
                self.attention_dropout
            );
        }
        if self.use_sliding_window {
            bail!(
                "use_sliding_window = true is not supported: vime implements only full attention \
                 (sliding_window = {:?}, max_window_layers = {})",
                self.sliding_window,
                self.max_window_layers
            );
        }
        if let Some(lt) = &self.layer_types {
            if let Some((i, t)) = lt.iter().enumerate().find(|(_, t)| t.as_str() != "full_attention") {
                bail!("layer_types[{i}] = {t:?} is not supported: vime implements only \"full_attention\"");
            }
            if lt.len() != self.num_hidden_layers {
                bail!(
                    "layer_types has {} entries but num_hidden_layers = {}",
                    lt.len(),
                    self.num_hidden_layers
                );
            }
        }
        if let Some(d) = &self.dtype {
            dtype_from_hf_name(d).with_context(|| format!("dtype / torch_dtype = {d:?}"))?;
        }
        // A corrupt config must not make the parameter table huge or its sizes overflow (found by
        // fuzzing: `num_hidden_layers = 4294967296` made the table allocate without bound).
        if self.num_hidden_layers > MAX_HIDDEN_LAYERS {
            bail!(
                "num_hidden_layers = {}: more than vime supports ({MAX_HIDDEN_LAYERS}); is the config corrupt?",
                self.num_hidden_layers
            );
        }
        for (what, heads) in [
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
        ] {
            if heads.checked_mul(self.head_dim).is_none() {
                bail!("{what} * head_dim = {heads} * {} overflows", self.head_dim);
            }
        }
        let mut total: usize = 0;
        for s in crate::state_dict::param_specs(self) {
            // Elements, and bytes of the widest dtype (f64), must fit in usize.
            let numel = s.shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
            match numel
                .and_then(|n| total.checked_add(n))
                .filter(|t| t.checked_mul(8).is_some())
            {
                Some(t) => total = t,
                None => bail!(
                    "parameter {} of shape {:?}: the model's size overflows (is the config corrupt?)",
                    s.name,
                    s.shape
                ),
            }
        }
        Ok(())
    }

    /// The published `Qwen/Qwen3-*` configs (the post-trained "hybrid thinking" releases).
    ///
    /// Sources: the `config.json` of huggingface.co/Qwen/Qwen3-{0.6B,1.7B,4B,8B} (written by
    /// transformers 4.51.0). The hub was not reachable when this was written; the values come from
    /// verbatim copies of those files in public code: 0.6B (two independent copies), 4B and 8B
    /// (complete copies); 1.7B's sizes (2048/6144/28 layers/16/8/128, tied) from a test fixture
    /// labelled Qwen/Qwen3-1.7B, its remaining fields (40960, 1e6, max_window_layers 28) assumed
    /// equal to its siblings'. The 0.6B count, 596,049,920 parameters, matches published figures.
    /// Common to all four: vocab 151936, head_dim 128, rms_norm_eps 1e-6, rope_theta 1e6 (written
    /// as the integer 1000000), rope_scaling null, max_position_embeddings 40960, bf16,
    /// attention_bias false, sliding window off (sliding_window null), bos 151643
    /// (<|endoftext|>), eos 151645 (<|im_end|>; the -Base releases use 151643 and 32768 positions).
    pub fn preset(name: &str) -> Result<Self> {
        // (hidden, intermediate, layers, heads, kv_heads, tied, max_window_layers)
        let (h, i, l, nh, nkv, tied, mwl) = match name.to_ascii_lowercase().as_str() {
            // Qwen/Qwen3-0.6B/config.json
            "qwen3-0.6b" => (1024, 3072, 28, 16, 8, true, 28),
            // Qwen/Qwen3-1.7B/config.json
            "qwen3-1.7b" => (2048, 6144, 28, 16, 8, true, 28),
            // Qwen/Qwen3-4B/config.json (head_dim 128 although 2560 / 32 = 80)
            "qwen3-4b" => (2560, 9728, 36, 32, 8, true, 36),
            // Qwen/Qwen3-8B/config.json (the smallest untied one)
            "qwen3-8b" => (4096, 12288, 36, 32, 8, false, 36),
            _ => bail!(
                "unknown Qwen3 preset {name:?}; known presets: {}",
                PRESET_NAMES.join(", ")
            ),
        };
        let cfg = Qwen3Config {
            model_type: Some("qwen3".to_string()),
            vocab_size: 151936,
            hidden_size: h,
            intermediate_size: i,
            num_hidden_layers: l,
            num_attention_heads: nh,
            num_key_value_heads: nkv,
            head_dim: 128,
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            rope_scaling: None,
            max_position_embeddings: 40960,
            tie_word_embeddings: tied,
            attention_bias: false,
            dtype: Some("bfloat16".to_string()),
            hidden_act: "silu".to_string(),
            use_sliding_window: false,
            sliding_window: None,
            max_window_layers: mwl,
            bos_token_id: Some(151643),
            eos_token_id: Some(TokenIds::One(151645)),
            pad_token_id: None,
            layer_types: None,
            attention_dropout: 0.0,
            initializer_range: 0.02,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The `config.json` vime writes: all fields, with `torch_dtype` and `dtype`, `rope_theta` +
    /// `rope_scaling` (4.x, vLLM) and `rope_parameters` (5.x). Keys sorted, as HF writes them.
    pub fn to_hf_json(&self) -> Value {
        let rope_parameters = match &self.rope_scaling {
            None => json!({"rope_type": "default", "rope_theta": self.rope_theta}),
            Some(Value::Object(m)) => {
                let mut m = m.clone();
                m.insert("rope_theta".to_string(), json!(self.rope_theta));
                Value::Object(m)
            }
            Some(other) => other.clone(),
        };
        let layer_types = self
            .layer_types
            .clone()
            .unwrap_or_else(|| vec!["full_attention".to_string(); self.num_hidden_layers]);
        json!({
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.hidden_act,
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": self.initializer_range,
            "rms_norm_eps": self.rms_norm_eps,
            "use_cache": true,
            "tie_word_embeddings": self.tie_word_embeddings,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "rope_parameters": rope_parameters,
            "attention_bias": self.attention_bias,
            "attention_dropout": self.attention_dropout,
            "use_sliding_window": self.use_sliding_window,
            "sliding_window": self.sliding_window,
            "max_window_layers": self.max_window_layers,
            "layer_types": layer_types,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "torch_dtype": self.dtype,
            "dtype": self.dtype,
        })
    }

    /// `num_attention_heads * head_dim`: rows of q_proj, columns of o_proj.
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }

    /// `num_key_value_heads * head_dim`: rows of k_proj and v_proj.
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// The storage dtype of the config (`dtype`/`torch_dtype`); `F32` when the file names none,
    /// which is what transformers loads such a checkpoint as.
    pub fn candle_dtype(&self) -> Result<DType> {
        match &self.dtype {
            None => Ok(DType::F32),
            Some(d) => dtype_from_hf_name(d).with_context(|| format!("dtype / torch_dtype = {d:?}")),
        }
    }

    /// Number of parameters, counting tied embeddings once (sum over [`crate::state_dict::param_specs`]).
    pub fn num_parameters(&self) -> usize {
        crate::state_dict::param_specs(self).iter().map(|s| s.numel()).sum()
    }
}
