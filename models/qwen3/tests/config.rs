//! `Qwen3Config`: presets, both HF spellings of `config.json`, validation errors, the HF JSON vime
//! writes.
use candle_core::DType;
use serde_json::{json, Value};
use vime_qwen3::config::{Qwen3Config, TokenIds, PRESET_NAMES};
use vime_qwen3::state_dict::param_specs;

/// huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json as published (written by transformers 4.51;
/// text taken from public verbatim copies of it, the hub itself was not reachable).
const HUB_QWEN3_0_6B: &str = r#"{
  "architectures": [
    "Qwen3ForCausalLM"
  ],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 1024,
  "initializer_range": 0.02,
  "intermediate_size": 3072,
  "max_position_embeddings": 40960,
  "max_window_layers": 28,
  "model_type": "qwen3",
  "num_attention_heads": 16,
  "num_hidden_layers": 28,
  "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06,
  "rope_scaling": null,
  "rope_theta": 1000000,
  "sliding_window": null,
  "tie_word_embeddings": true,
  "torch_dtype": "bfloat16",
  "transformers_version": "4.51.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
}"#;

/// What transformers 5.17 `save_pretrained` writes for that same config (`AutoConfig` of the hub
/// file, saved again): `dtype` instead of `torch_dtype`, `rope_parameters` instead of
/// `rope_theta`/`rope_scaling`, explicit `layer_types`. Verbatim except `layer_types` on one line.
const TRANSFORMERS5_QWEN3_0_6B: &str = r#"{
  "architectures": [
    "Qwen3ForCausalLM"
  ],
  "attention_bias": false,
  "attention_dropout": 0.0,
  "bos_token_id": 151643,
  "dtype": "bfloat16",
  "eos_token_id": 151645,
  "head_dim": 128,
  "hidden_act": "silu",
  "hidden_size": 1024,
  "initializer_range": 0.02,
  "intermediate_size": 3072,
  "layer_types": ["full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention", "full_attention"],
  "max_position_embeddings": 40960,
  "max_window_layers": 28,
  "model_type": "qwen3",
  "num_attention_heads": 16,
  "num_hidden_layers": 28,
  "num_key_value_heads": 8,
  "pad_token_id": null,
  "rms_norm_eps": 1e-06,
  "rope_parameters": {
    "rope_theta": 1000000,
    "rope_type": "default"
  },
  "sliding_window": null,
  "tie_word_embeddings": true,
  "transformers_version": "5.17.0",
  "use_cache": true,
  "use_sliding_window": false,
  "vocab_size": 151936
}"#;

/// `HUB_QWEN3_0_6B` with `edit` applied to its JSON (null removes the key).
fn hub_with(edit: Value) -> String {
    let mut v: Value = serde_json::from_str(HUB_QWEN3_0_6B).unwrap();
    for (k, x) in edit.as_object().unwrap() {
        if x.is_null() {
            v.as_object_mut().unwrap().remove(k);
        } else {
            v[k] = x.clone();
        }
    }
    v.to_string()
}

fn err_of(text: &str) -> String {
    format!(
        "{:#}",
        Qwen3Config::from_json_str(text).expect_err("config should be rejected")
    )
}

fn assert_rejected(edit: Value, must_mention: &[&str]) {
    let msg = err_of(&hub_with(edit.clone()));
    for m in must_mention {
        assert!(msg.contains(m), "error for {edit} should mention {m:?}, got: {msg}");
    }
}

#[test]
fn presets_validate_and_have_the_published_numbers() {
    // (name, hidden, intermediate, layers, heads, kv_heads, tied)
    let published = [
        ("qwen3-0.6b", 1024, 3072, 28, 16, 8, true),
        ("qwen3-1.7b", 2048, 6144, 28, 16, 8, true),
        ("qwen3-4b", 2560, 9728, 36, 32, 8, true),
        ("qwen3-8b", 4096, 12288, 36, 32, 8, false),
    ];
    assert_eq!(PRESET_NAMES.len(), published.len());
    for (name, h, i, l, nh, nkv, tied) in published {
        let c = Qwen3Config::preset(name).unwrap();
        c.validate().unwrap();
        assert_eq!(
            (
                c.hidden_size,
                c.intermediate_size,
                c.num_hidden_layers,
                c.num_attention_heads,
                c.num_key_value_heads
            ),
            (h, i, l, nh, nkv),
            "{name}"
        );
        assert_eq!(c.tie_word_embeddings, tied, "{name}");
        assert_eq!(c.head_dim, 128, "{name}");
        assert_eq!(c.vocab_size, 151936);
        assert_eq!(c.rms_norm_eps, 1e-6);
        assert_eq!(c.rope_theta, 1e6);
        assert_eq!(c.rope_scaling, None);
        assert_eq!(c.max_position_embeddings, 40960);
        assert_eq!(c.dtype.as_deref(), Some("bfloat16"));
        assert_eq!(c.candle_dtype().unwrap(), DType::BF16);
        assert!(!c.attention_bias);
        assert_eq!(
            (c.bos_token_id, c.eos_token_id.clone()),
            (Some(151643), Some(TokenIds::One(151645)))
        );
    }
    // Qwen3-4B: head_dim is NOT hidden / heads.
    let c4 = Qwen3Config::preset("qwen3-4b").unwrap();
    assert_eq!(c4.hidden_size / c4.num_attention_heads, 80);
    assert_eq!((c4.q_dim(), c4.kv_dim()), (32 * 128, 8 * 128));
    // Case-insensitive names.
    assert_eq!(
        Qwen3Config::preset("Qwen3-8B").unwrap(),
        Qwen3Config::preset("qwen3-8b").unwrap()
    );
}

#[test]
fn preset_parameter_counts() {
    // The rounded non-embedding counts of the Qwen3 model cards: 0.6B 0.44B, 1.7B 1.4B, 4B 3.6B, 8B 6.95B.
    let non_embedding = |name: &str| {
        let c = Qwen3Config::preset(name).unwrap();
        let emb = c.vocab_size * c.hidden_size * if c.tie_word_embeddings { 1 } else { 2 };
        (c.num_parameters(), c.num_parameters() - emb)
    };
    let (total, ne) = non_embedding("qwen3-0.6b");
    assert_eq!(total, 596_049_920); // the exact count of the published safetensors
    assert!((0.43e9..0.45e9).contains(&(ne as f64)), "{ne}");
    let (_, ne) = non_embedding("qwen3-1.7b");
    assert!((1.35e9..1.45e9).contains(&(ne as f64)), "{ne}");
    let (_, ne) = non_embedding("qwen3-4b");
    assert!((3.55e9..3.65e9).contains(&(ne as f64)), "{ne}");
    let (total, ne) = non_embedding("qwen3-8b");
    assert!((6.9e9..7.0e9).contains(&(ne as f64)), "{ne}");
    assert!((8.1e9..8.3e9).contains(&(total as f64)), "{total}");
}

#[test]
fn unknown_preset_lists_the_known_ones() {
    let msg = format!("{:#}", Qwen3Config::preset("qwen3-14b").unwrap_err());
    assert!(msg.contains("qwen3-14b"), "{msg}");
    for name in PRESET_NAMES {
        assert!(msg.contains(name), "{msg}");
    }
}

#[test]
fn parses_the_hub_4x_config() {
    let c = Qwen3Config::from_json_str(HUB_QWEN3_0_6B).unwrap();
    assert_eq!(c.model_type.as_deref(), Some("qwen3"));
    assert_eq!(c.rope_theta, 1e6);
    assert_eq!(c.rope_scaling, None);
    assert_eq!(c.dtype.as_deref(), Some("bfloat16"));
    assert_eq!(c.layer_types, None);
    assert_eq!(c.sliding_window, None);
    assert_eq!(c.max_window_layers, 28);
    assert_eq!(c.pad_token_id, None);
    // Everything but the fields a file can omit matches the preset.
    let mut p = Qwen3Config::preset("qwen3-0.6b").unwrap();
    p.model_type = c.model_type.clone();
    assert_eq!(c, p);
}

#[test]
fn parses_the_transformers5_config_to_the_same_model() {
    let c5 = Qwen3Config::from_json_str(TRANSFORMERS5_QWEN3_0_6B).unwrap();
    let c4 = Qwen3Config::from_json_str(HUB_QWEN3_0_6B).unwrap();
    assert_eq!(c5.rope_theta, 1e6);
    assert_eq!(c5.rope_scaling, None);
    assert_eq!(c5.dtype.as_deref(), Some("bfloat16"));
    assert_eq!(c5.layer_types.as_ref().map(Vec::len), Some(28));
    let mut c5_no_lt = c5.clone();
    c5_no_lt.layer_types = None;
    assert_eq!(c5_no_lt, c4);
}

#[test]
fn hf_resolution_rules() {
    // `dtype` wins over `torch_dtype`.
    let c = Qwen3Config::from_json_str(&hub_with(json!({"torch_dtype": "float16", "dtype": "float32"}))).unwrap();
    assert_eq!(c.candle_dtype().unwrap(), DType::F32);
    // No dtype at all: None, loaded as f32.
    let c = Qwen3Config::from_json_str(&hub_with(json!({"torch_dtype": null}))).unwrap();
    assert_eq!((c.dtype.clone(), c.candle_dtype().unwrap()), (None, DType::F32));
    // rope_parameters' theta wins over the top-level one; absent everywhere: 10000.
    let c = Qwen3Config::from_json_str(&hub_with(
        json!({"rope_parameters": {"rope_type": "default", "rope_theta": 5e6}, "rope_theta": 1e4}),
    ))
    .unwrap();
    assert_eq!(c.rope_theta, 5e6);
    let c = Qwen3Config::from_json_str(&hub_with(json!({"rope_theta": null}))).unwrap();
    assert_eq!(c.rope_theta, 10_000.0);
    // An old-style `{"type": "default"}` rope_scaling is the plain RoPE.
    let c = Qwen3Config::from_json_str(&hub_with(json!({"rope_scaling": {"type": "default"}}))).unwrap();
    assert_eq!((c.rope_scaling.clone(), c.rope_theta), (None, 1e6));
    // Per-layer-type rope_parameters (5.x nested form).
    let c = Qwen3Config::from_json_str(&hub_with(
        json!({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 2e6}}}),
    ))
    .unwrap();
    assert_eq!(c.rope_theta, 2e6);
    // head_dim absent: transformers' class default 128, even where hidden/heads differs.
    let c = Qwen3Config::from_json_str(&hub_with(json!({"head_dim": null}))).unwrap();
    assert_eq!(c.head_dim, 128);
    let c = Qwen3Config::from_json_str(&hub_with(
        json!({"head_dim": null, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2}),
    ))
    .unwrap();
    assert_eq!(c.head_dim, 128);
    // num_key_value_heads absent: = num_attention_heads.
    let c = Qwen3Config::from_json_str(&hub_with(json!({"num_key_value_heads": null}))).unwrap();
    assert_eq!(c.num_key_value_heads, 16);
    // eos as a list.
    let c = Qwen3Config::from_json_str(&hub_with(json!({"eos_token_id": [151645, 151643]}))).unwrap();
    assert_eq!(c.eos_token_id, Some(TokenIds::Many(vec![151645, 151643])));
    assert!(c.eos_token_id.as_ref().unwrap().contains(151643));
    // sliding_window is dropped when use_sliding_window is false (Qwen2.5-style configs carry one).
    let c = Qwen3Config::from_json_str(&hub_with(json!({"sliding_window": 131072}))).unwrap();
    assert_eq!(c.sliding_window, None);
}

#[test]
fn explicit_null_head_dim_is_rejected() {
    let mut v: Value = serde_json::from_str(HUB_QWEN3_0_6B).unwrap();
    v["head_dim"] = Value::Null;
    let msg = err_of(&v.to_string());
    assert!(msg.contains("head_dim"), "{msg}");
}

#[test]
fn rejections_name_the_field_and_value() {
    // Rope scaling types vime does not implement, in both spellings.
    for t in ["yarn", "linear", "dynamic", "llama3", "longrope"] {
        assert_rejected(
            json!({"rope_scaling": {"rope_type": t, "factor": 4.0, "original_max_position_embeddings": 32768}}),
            &["rope_scaling", t, "not implemented"],
        );
        assert_rejected(
            json!({"rope_scaling": null, "rope_parameters": {"rope_type": t, "factor": 4.0, "rope_theta": 1e6}}),
            &["rope_parameters", t, "not implemented"],
        );
    }
    assert_rejected(
        json!({"rope_scaling": {"type": "linear", "factor": 2.0}}),
        &["linear", "not implemented"],
    );
    assert_rejected(
        json!({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}),
        &["partial_rotary_factor"],
    );
    assert_rejected(
        json!({"use_sliding_window": true, "sliding_window": 4096}),
        &["use_sliding_window"],
    );
    let mut lt = vec!["full_attention"; 28];
    lt[3] = "sliding_attention";
    assert_rejected(json!({"layer_types": lt}), &["layer_types[3]", "sliding_attention"]);
    assert_rejected(
        json!({"layer_types": vec!["full_attention"; 27]}),
        &["layer_types", "27", "28"],
    );
    assert_rejected(json!({"hidden_act": "gelu"}), &["hidden_act", "gelu"]);
    assert_rejected(json!({"attention_dropout": 0.1}), &["attention_dropout", "0.1"]);
    assert_rejected(
        json!({"num_key_value_heads": 3}),
        &["num_attention_heads", "16", "num_key_value_heads", "3"],
    );
    assert_rejected(json!({"head_dim": 127}), &["head_dim", "127", "odd"]);
    for field in [
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_key_value_heads",
        "head_dim",
    ] {
        assert_rejected(json!({ field: 0 }), &[field, "0"]);
    }
    assert_rejected(
        json!({"num_attention_heads": 0, "num_key_value_heads": 0}),
        &["num_attention_heads", "0"],
    );
    assert_rejected(json!({"model_type": "qwen3_moe"}), &["model_type", "qwen3_moe"]);
    assert_rejected(json!({"model_type": "qwen2"}), &["model_type", "qwen2"]);
    assert_rejected(json!({"torch_dtype": "int8"}), &["dtype", "int8"]);
    assert_rejected(json!({"rms_norm_eps": 0.0}), &["rms_norm_eps"]);
    assert_rejected(json!({"hidden_size": null}), &["hidden_size", "missing"]);
}

#[test]
fn from_file_errors_name_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.json");
    let msg = format!("{:#}", Qwen3Config::from_file(&missing).unwrap_err());
    assert!(msg.contains("nope.json"), "{msg}");
    let bad = dir.path().join("config.json");
    std::fs::write(&bad, hub_with(json!({"hidden_act": "relu"}))).unwrap();
    let msg = format!("{:#}", Qwen3Config::from_file(&bad).unwrap_err());
    assert!(msg.contains("config.json") && msg.contains("hidden_act"), "{msg}");
    std::fs::write(&bad, HUB_QWEN3_0_6B).unwrap();
    assert_eq!(Qwen3Config::from_file(&bad).unwrap().hidden_size, 1024);
}

#[test]
fn hf_json_has_both_spellings_and_reads_back() {
    for name in PRESET_NAMES {
        let c = Qwen3Config::preset(name).unwrap();
        let j = c.to_hf_json();
        assert_eq!(j["architectures"], json!(["Qwen3ForCausalLM"]));
        assert_eq!(j["model_type"], "qwen3");
        assert_eq!(
            (&j["torch_dtype"], &j["dtype"]),
            (&json!("bfloat16"), &json!("bfloat16"))
        );
        assert_eq!(j["rope_theta"], json!(1e6));
        assert_eq!(j["rope_scaling"], Value::Null);
        assert_eq!(j["rope_parameters"], json!({"rope_type": "default", "rope_theta": 1e6}));
        assert_eq!(j["head_dim"], 128);
        assert_eq!(j["layer_types"].as_array().unwrap().len(), c.num_hidden_layers);
        assert_eq!(j["sliding_window"], Value::Null);
        assert_eq!(j["use_sliding_window"], false);
        assert_eq!(j["tie_word_embeddings"], c.tie_word_embeddings);
        let back = Qwen3Config::from_json_str(&j.to_string()).unwrap();
        let mut expect = c.clone();
        expect.layer_types = Some(vec!["full_attention".to_string(); c.num_hidden_layers]);
        assert_eq!(back, expect, "{name}");
    }
}

#[test]
fn serde_round_trip_of_the_struct() {
    let c = Qwen3Config::from_json_str(TRANSFORMERS5_QWEN3_0_6B).unwrap();
    let s = serde_json::to_string(&c).unwrap();
    let back: Qwen3Config = serde_json::from_str(&s).unwrap();
    assert_eq!(back, c);
}

#[test]
fn helpers() {
    let c = Qwen3Config::preset("qwen3-8b").unwrap();
    assert_eq!(c.q_dim(), 4096);
    assert_eq!(c.kv_dim(), 1024);
    let n: usize = param_specs(&c).iter().map(|s| s.numel()).sum();
    assert_eq!(c.num_parameters(), n);
    let mut c16 = c.clone();
    c16.dtype = Some("float16".into());
    assert_eq!(c16.candle_dtype().unwrap(), DType::F16);
    c16.dtype = Some("float64".into());
    assert!(format!("{:#}", c16.candle_dtype().unwrap_err()).contains("float64"));
}
