//! HF checkpoint save/load: single file and shards, f32 bit-exact and bf16, error messages, HF
//! file layout, and the cross-check with transformers both ways against the fixtures of
//! `tests/fixtures/gen_checkpoint_fixtures.py`: checkpoints transformers wrote load in vime with
//! the tensors and logits transformers computed, and what transformers read back from vime's saves
//! (file bytes, tensors, logits) is what vime writes today.
use candle_core::{DType, Device, Tensor};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use vime_kernels::testing::{rel_err, Rng};
use vime_qwen3::batch::PackedBatch;
use vime_qwen3::checkpoint::{
    copy_tokenizer_files, load_config, load_hf_weights, save_hf_checkpoint, DEFAULT_MAX_SHARD_BYTES,
    SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, TOKENIZER_FILES,
};
use vime_qwen3::config::Qwen3Config;
use vime_qwen3::model::Qwen3;
use vime_qwen3::state_dict::{layer_prefix, param_specs, ParamKind};

mod common;
use common::tiny;

fn random_tensors(cfg: &Qwen3Config, seed: u64) -> BTreeMap<String, Tensor> {
    let mut rng = Rng::new(seed);
    param_specs(cfg)
        .into_iter()
        .map(|s| {
            (
                s.name.clone(),
                rng.randn(&s.shape, 0.5, DType::F32, &Device::Cpu).unwrap(),
            )
        })
        .collect()
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .map(|x| x.to_bits())
        .collect()
}

fn assert_same(a: &BTreeMap<String, Tensor>, b: &BTreeMap<String, Tensor>) {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (name, t) in a {
        assert_eq!(t.dims(), b[name].dims(), "{name}");
        assert!(bits(t) == bits(&b[name]), "{name} differs");
    }
}

fn file_names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

fn err_string<T: std::fmt::Debug>(r: anyhow::Result<T>) -> String {
    format!("{:#}", r.expect_err("should fail"))
}

/// The safetensors header metadata of a file.
fn st_metadata(path: &Path) -> Option<std::collections::HashMap<String, String>> {
    let bytes = std::fs::read(path).unwrap();
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    meta.metadata().clone()
}

#[test]
fn param_table_layout() {
    let c = tiny(false, true);
    let specs = param_specs(&c);
    let names: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names[0], "model.embed_tokens.weight");
    assert_eq!(
        &names[1..6],
        &[
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.0.self_attn.q_proj.bias",
            "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.k_proj.bias",
        ]
    );
    assert_eq!(names[names.len() - 2..], ["model.norm.weight", "lm_head.weight"]);
    // 1 + 2 layers * (11 + 4 biases) + norm + lm_head
    assert_eq!(specs.len(), 1 + 2 * 15 + 2);
    let shape = |n: &str| specs.iter().find(|s| s.name == n).unwrap().shape.clone();
    assert_eq!(shape("model.layers.1.self_attn.q_proj.weight"), vec![32, 24]);
    assert_eq!(shape("model.layers.1.self_attn.k_proj.weight"), vec![16, 24]);
    assert_eq!(shape("model.layers.1.self_attn.o_proj.weight"), vec![24, 32]);
    assert_eq!(shape("model.layers.1.self_attn.o_proj.bias"), vec![24]);
    assert_eq!(shape("model.layers.1.self_attn.q_norm.weight"), vec![8]);
    assert_eq!(shape("model.layers.1.mlp.down_proj.weight"), vec![24, 36]);
    assert_eq!(shape("lm_head.weight"), vec![40, 24]);
    let kind = |n: &str| specs.iter().find(|s| s.name == n).unwrap().kind;
    assert_eq!(kind("model.embed_tokens.weight"), ParamKind::Embedding);
    assert_eq!(kind("model.layers.0.self_attn.v_proj.bias"), ParamKind::LinearBias);
    assert_eq!(
        kind("model.layers.0.post_attention_layernorm.weight"),
        ParamKind::NormWeight
    );
    assert_eq!(kind("lm_head.weight"), ParamKind::LinearWeight);
    assert_eq!(specs[5].layer(), Some(0));
    assert_eq!(specs[0].layer(), None);
    assert_eq!(layer_prefix(7), "model.layers.7");
    // Tied, no bias: no lm_head, no biases.
    let tied = param_specs(&tiny(true, false));
    assert!(tied
        .iter()
        .all(|s| s.name != "lm_head.weight" && s.kind != ParamKind::LinearBias));
    assert_eq!(tied.len(), 1 + 2 * 11 + 1);
}

#[test]
fn single_file_round_trip_is_bit_exact() {
    for (tied, bias) in [(true, false), (false, true)] {
        let cfg = tiny(tied, bias);
        let tensors = random_tensors(&cfg, 1);
        let dir = tempfile::tempdir().unwrap();
        save_hf_checkpoint(dir.path(), &cfg, &tensors, DType::F32, DEFAULT_MAX_SHARD_BYTES).unwrap();
        assert_eq!(file_names(dir.path()), vec!["config.json", "model.safetensors"]);
        assert_eq!(
            st_metadata(&dir.path().join(SAFE_WEIGHTS_NAME)).unwrap()["format"],
            "pt"
        );
        let cfg2 = load_config(dir.path()).unwrap();
        assert_eq!(cfg2.dtype.as_deref(), Some("float32"));
        let mut expect_cfg = cfg.clone();
        expect_cfg.layer_types = Some(vec!["full_attention".into(); 2]);
        assert_eq!(cfg2, expect_cfg);
        let back = load_hf_weights(dir.path(), &cfg2, DType::F32, &Device::Cpu).unwrap();
        assert_same(&tensors, &back);
    }
}

#[test]
fn sharded_round_trip_is_bit_exact_and_laid_out_as_hf() {
    let cfg = tiny(false, false);
    let tensors = random_tensors(&cfg, 2);
    let specs = param_specs(&cfg);
    let total: u64 = specs.iter().map(|s| 4 * s.numel() as u64).sum();
    let dir = tempfile::tempdir().unwrap();
    // The embedding alone is 40*24*4 = 3840 bytes > 3000: it gets a shard of its own.
    let max = 3000;
    save_hf_checkpoint(dir.path(), &cfg, &tensors, DType::F32, max).unwrap();
    let names = file_names(dir.path());
    let shards: Vec<&String> = names.iter().filter(|n| n.starts_with("model-")).collect();
    let n = shards.len();
    assert!(n > 2, "{names:?}");
    for (i, s) in shards.iter().enumerate() {
        assert_eq!(**s, format!("model-{:05}-of-{:05}.safetensors", i + 1, n));
        assert_eq!(st_metadata(&dir.path().join(s)).unwrap()["format"], "pt");
    }
    assert!(!names.contains(&SAFE_WEIGHTS_NAME.to_string()));
    assert!(names.iter().all(|n| !n.starts_with('.')), "temp files left: {names:?}");
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join(SAFE_WEIGHTS_INDEX_NAME)).unwrap()).unwrap();
    assert_eq!(index["metadata"]["total_size"], total);
    assert_eq!(index["metadata"]["total_parameters"], cfg.num_parameters());
    let wm = index["weight_map"].as_object().unwrap();
    assert_eq!(wm.len(), specs.len());
    // Shards follow the canonical order and respect the limit, except a lone oversize tensor.
    assert_eq!(
        wm["model.embed_tokens.weight"],
        format!("model-00001-of-{n:05}.safetensors")
    );
    let mut per_shard: BTreeMap<String, (u64, usize)> = BTreeMap::new();
    let mut last_shard = String::new();
    for s in &specs {
        let f = wm[&s.name].as_str().unwrap().to_string();
        assert!(f >= last_shard, "{} out of order", s.name);
        last_shard = f.clone();
        let e = per_shard.entry(f).or_default();
        e.0 += 4 * s.numel() as u64;
        e.1 += 1;
    }
    assert_eq!(per_shard.len(), n);
    for (f, (bytes, count)) in &per_shard {
        assert!(*bytes <= max || *count == 1, "{f}: {bytes} bytes in {count} tensors");
    }
    let back = load_hf_weights(dir.path(), &cfg, DType::F32, &Device::Cpu).unwrap();
    assert_same(&tensors, &back);

    // Saving again as one file removes the shards and the index; sharding again removes it.
    save_hf_checkpoint(dir.path(), &cfg, &tensors, DType::F32, DEFAULT_MAX_SHARD_BYTES).unwrap();
    assert_eq!(file_names(dir.path()), vec!["config.json", "model.safetensors"]);
    save_hf_checkpoint(dir.path(), &cfg, &tensors, DType::F32, 6000).unwrap();
    let names = file_names(dir.path());
    assert!(!names.contains(&SAFE_WEIGHTS_NAME.to_string()) && names.contains(&SAFE_WEIGHTS_INDEX_NAME.to_string()));
    assert_same(
        &tensors,
        &load_hf_weights(dir.path(), &cfg, DType::F32, &Device::Cpu).unwrap(),
    );
}

#[test]
fn bf16_save_and_load() {
    let cfg = tiny(true, true);
    let tensors = random_tensors(&cfg, 3);
    let dir = tempfile::tempdir().unwrap();
    save_hf_checkpoint(dir.path(), &cfg, &tensors, DType::BF16, 2000).unwrap();
    let cfg2 = load_config(dir.path()).unwrap();
    assert_eq!(cfg2.dtype.as_deref(), Some("bfloat16"));
    let j: Value = serde_json::from_str(&std::fs::read_to_string(dir.path().join("config.json")).unwrap()).unwrap();
    assert_eq!(
        (&j["torch_dtype"], &j["dtype"]),
        (&Value::from("bfloat16"), &Value::from("bfloat16"))
    );
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join(SAFE_WEIGHTS_INDEX_NAME)).unwrap()).unwrap();
    assert_eq!(index["metadata"]["total_size"], 2 * cfg.num_parameters() as u64);
    // Stored bf16: loading as bf16 gives bf16 tensors equal to the rounded originals.
    let back = load_hf_weights(dir.path(), &cfg2, DType::BF16, &Device::Cpu).unwrap();
    let rounded: BTreeMap<String, Tensor> = tensors
        .iter()
        .map(|(k, t)| (k.clone(), t.to_dtype(DType::BF16).unwrap()))
        .collect();
    for t in back.values() {
        assert_eq!(t.dtype(), DType::BF16);
    }
    assert_same(&rounded, &back);
    // Loading as f32 widens exactly.
    let back32 = load_hf_weights(dir.path(), &cfg2, DType::F32, &Device::Cpu).unwrap();
    assert!(back32.values().all(|t| t.dtype() == DType::F32));
    assert_same(&rounded, &back32);
    // And the bf16 file really holds bf16.
    for f in file_names(dir.path()).iter().filter(|f| f.ends_with(".safetensors")) {
        let bytes = std::fs::read(dir.path().join(f)).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        assert!(st.tensors().iter().all(|(_, v)| v.dtype() == safetensors::Dtype::BF16));
    }
}

#[test]
fn save_rejects_missing_wrong_and_extra_tensors() {
    let cfg = tiny(true, false);
    let dir = tempfile::tempdir().unwrap();
    let mut t = random_tensors(&cfg, 4);
    t.remove("model.layers.1.mlp.up_proj.weight");
    let msg = err_string(save_hf_checkpoint(
        dir.path(),
        &cfg,
        &t,
        DType::F32,
        DEFAULT_MAX_SHARD_BYTES,
    ));
    assert!(
        msg.contains("model.layers.1.mlp.up_proj.weight") && msg.contains("[36, 24]"),
        "{msg}"
    );

    let mut t = random_tensors(&cfg, 4);
    t.insert(
        "model.layers.0.self_attn.k_proj.weight".into(),
        Tensor::zeros((8, 24), DType::F32, &Device::Cpu).unwrap(),
    );
    let msg = err_string(save_hf_checkpoint(
        dir.path(),
        &cfg,
        &t,
        DType::F32,
        DEFAULT_MAX_SHARD_BYTES,
    ));
    assert!(
        msg.contains("model.layers.0.self_attn.k_proj.weight") && msg.contains("[16, 24]") && msg.contains("[8, 24]"),
        "{msg}"
    );

    let mut t = random_tensors(&cfg, 4);
    t.insert(
        "lm_head.weight".into(),
        Tensor::zeros((40, 24), DType::F32, &Device::Cpu).unwrap(),
    );
    let msg = err_string(save_hf_checkpoint(
        dir.path(),
        &cfg,
        &t,
        DType::F32,
        DEFAULT_MAX_SHARD_BYTES,
    ));
    assert!(
        msg.contains("lm_head.weight") && msg.contains("tie_word_embeddings"),
        "{msg}"
    );

    let t = random_tensors(&cfg, 4);
    let msg = err_string(save_hf_checkpoint(
        dir.path(),
        &cfg,
        &t,
        DType::U32,
        DEFAULT_MAX_SHARD_BYTES,
    ));
    assert!(msg.contains("U32"), "{msg}");
    // Nothing was written by the failed saves.
    assert!(file_names(dir.path()).is_empty());
}

/// Writes `tensors` as a raw `model.safetensors` (no checks), to build broken checkpoints.
fn write_raw(dir: &Path, tensors: &BTreeMap<String, Tensor>) {
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::tensor::serialize_to_file(
        tensors.iter().map(|(k, v)| (k.clone(), v.clone())),
        Some(meta),
        &dir.join(SAFE_WEIGHTS_NAME),
    )
    .unwrap();
}

#[test]
fn load_errors_name_tensor_shapes_and_file() {
    let cfg = tiny(false, false);
    let dir = tempfile::tempdir().unwrap();
    let dev = Device::Cpu;

    let msg = err_string(load_hf_weights(dir.path(), &cfg, DType::F32, &dev));
    assert!(
        msg.contains("model.safetensors") && msg.contains(&dir.path().display().to_string()),
        "{msg}"
    );

    let mut t = random_tensors(&cfg, 5);
    t.remove("model.layers.0.self_attn.q_norm.weight");
    t.insert(
        "model.layers.1.mlp.gate_proj.weight".into(),
        Tensor::zeros((24, 36), DType::F32, &dev).unwrap(),
    );
    t.insert(
        "model.layers.0.self_attn.q_proj.bias".into(),
        Tensor::zeros(32, DType::F32, &dev).unwrap(),
    );
    write_raw(dir.path(), &t);
    let msg = err_string(load_hf_weights(dir.path(), &cfg, DType::F32, &dev));
    assert!(
        msg.contains("missing tensor model.layers.0.self_attn.q_norm.weight") && msg.contains("[8]"),
        "{msg}"
    );
    assert!(
        msg.contains("model.layers.1.mlp.gate_proj.weight") && msg.contains("expected shape [36, 24], found [24, 36]"),
        "{msg}"
    );
    assert!(
        msg.contains("unexpected tensor model.layers.0.self_attn.q_proj.bias") && msg.contains("attention_bias"),
        "{msg}"
    );
    assert!(msg.contains("model.safetensors"), "{msg}");
    assert!(msg.contains("3 problems"), "{msg}");
}

#[test]
fn load_ignores_tied_lm_head_and_inv_freq() {
    let cfg = tiny(true, false);
    let dir = tempfile::tempdir().unwrap();
    let dev = Device::Cpu;
    let mut t = random_tensors(&cfg, 6);
    let expect = t.clone();
    t.insert("lm_head.weight".into(), t["model.embed_tokens.weight"].clone());
    t.insert(
        "model.layers.0.self_attn.rotary_emb.inv_freq".into(),
        Tensor::ones(4, DType::F32, &dev).unwrap(),
    );
    write_raw(dir.path(), &t);
    let back = load_hf_weights(dir.path(), &cfg, DType::F32, &dev).unwrap();
    assert_same(&expect, &back);
    // Untied: lm_head is required.
    let untied = tiny(false, false);
    let mut t = random_tensors(&untied, 6);
    t.remove("lm_head.weight");
    write_raw(dir.path(), &t);
    let msg = err_string(load_hf_weights(dir.path(), &untied, DType::F32, &dev));
    assert!(
        msg.contains("missing tensor lm_head.weight") && msg.contains("[40, 24]"),
        "{msg}"
    );
}

#[test]
fn index_pointing_to_the_wrong_file_is_an_error() {
    let cfg = tiny(true, false);
    let dir = tempfile::tempdir().unwrap();
    let t = random_tensors(&cfg, 7);
    save_hf_checkpoint(dir.path(), &cfg, &t, DType::F32, 3000).unwrap();
    let p = dir.path().join(SAFE_WEIGHTS_INDEX_NAME);
    let mut index: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    let first = index["weight_map"]["model.embed_tokens.weight"]
        .as_str()
        .unwrap()
        .to_string();
    assert_ne!(index["weight_map"]["model.norm.weight"].as_str().unwrap(), first);
    index["weight_map"]["model.norm.weight"] = Value::from(first.clone());
    std::fs::write(&p, index.to_string()).unwrap();
    let msg = err_string(load_hf_weights(dir.path(), &cfg, DType::F32, &Device::Cpu));
    assert!(msg.contains("model.norm.weight") && msg.contains(&first), "{msg}");
}

#[test]
fn tokenizer_files_are_copied_when_present() {
    let from = tempfile::tempdir().unwrap();
    let to = tempfile::tempdir().unwrap();
    std::fs::write(from.path().join("tokenizer.json"), "{}").unwrap();
    std::fs::write(from.path().join("merges.txt"), "#v\n").unwrap();
    std::fs::write(from.path().join("chat_template.jinja"), "{{ x }}").unwrap();
    std::fs::write(from.path().join("model.safetensors"), "not copied").unwrap();
    let out = to.path().join("sub");
    let copied = copy_tokenizer_files(from.path(), &out).unwrap();
    assert_eq!(copied, vec!["tokenizer.json", "merges.txt", "chat_template.jinja"]);
    assert_eq!(
        file_names(&out),
        vec!["chat_template.jinja", "merges.txt", "tokenizer.json"]
    );
    assert_eq!(std::fs::read_to_string(out.join("merges.txt")).unwrap(), "#v\n");
    assert_eq!(TOKENIZER_FILES.len(), 8);
}

// ---- cross-checks with transformers (fixtures of gen_checkpoint_fixtures.py) ----------------

fn ckpt_fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/checkpoint")
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("parsing {}: {e}", path.display()))
}

/// FNV-1a 64 as the generator computes it, as 16 hex digits.
fn fnv1a64(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    format!("{h:016x}")
}

fn f32_le_bytes(t: &Tensor) -> Vec<u8> {
    bits(t).iter().flat_map(|b| b.to_le_bytes()).collect()
}

/// The config fields the generator recorded as transformers parsed them, from a vime config.
fn config_fields(cfg: &Qwen3Config) -> Value {
    serde_json::json!({
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id.as_ref().map(|e| e.to_vec()).unwrap_or_default(),
        "dtype": cfg.dtype,
    })
}

/// Checks `tensors` (f32 views), the config and vime's logits on the recorded input ids against
/// a record of what transformers had: config fields, per-tensor dtype (of `stored`), shape and
/// FNV-1a-64 of the f32 bytes, logits to 1e-5 relative error.
fn check_against_transformers(
    what: &str,
    cfg: &Qwen3Config,
    tensors: &BTreeMap<String, Tensor>,
    stored: DType,
    model_dir: &Path,
    record: &Value,
) {
    assert_eq!(config_fields(cfg), record["config"], "{what}: config fields");
    let rec = record["tensors"].as_object().unwrap();
    assert_eq!(
        tensors.keys().collect::<Vec<_>>(),
        rec.keys().collect::<Vec<_>>(),
        "{what}: parameter names"
    );
    let dtype_name = vime_qwen3::config::hf_dtype_name(stored).unwrap();
    for (name, t) in tensors {
        let r = &rec[name];
        assert_eq!(r["dtype"], dtype_name, "{what}: {name} dtype");
        assert_eq!(serde_json::json!(t.dims()), r["shape"], "{what}: {name} shape");
        let sum = t
            .to_dtype(DType::F64)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f64>()
            .unwrap();
        assert_eq!(
            fnv1a64(&f32_le_bytes(t)),
            r["fnv1a64"].as_str().unwrap(),
            "{what}: {name} differs from what transformers holds (sum {sum} vs {})",
            r["sum"]
        );
    }
    let ids: Vec<u32> = record["input_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let expect: Vec<f32> = record["logits"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|row| row.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32))
        .collect();
    let model = Qwen3::load_hf(model_dir, DType::F32, &Device::Cpu).unwrap();
    let logits = model
        .logits(&PackedBatch::from_sequences(std::slice::from_ref(&ids)).unwrap())
        .unwrap();
    let expect = Tensor::from_vec(expect, (ids.len(), cfg.vocab_size), &Device::Cpu).unwrap();
    let e = rel_err(&logits, &expect).unwrap();
    assert!(e <= 1e-5, "{what}: logits vs transformers: relative error {e:.3e}");
}

/// The checkpoints `gen_checkpoint_fixtures.py` has transformers read: seeded random tensors saved
/// as (name, config, save dtype, max shard bytes).
fn vime_save_cases() -> Vec<(&'static str, Qwen3Config, DType, u64)> {
    vec![
        (
            "tied_f32_single",
            tiny(true, false),
            DType::F32,
            DEFAULT_MAX_SHARD_BYTES,
        ),
        ("untied_bias_bf16_sharded", tiny(false, true), DType::BF16, 3000),
        ("untied_f32_sharded", tiny(false, false), DType::F32, 5000),
    ]
}

/// vime -> transformers. Saves the cases of [`vime_save_cases`] (into `VIME_KEEP_SAVE_DIR` when
/// set, for the generator and for `check_hf_loads_vime.py`) and checks them against
/// `hf_reads_vime.json`, what transformers read from the same saves: the weight files byte for
/// byte, the config fields, every tensor, and the logits.
#[test]
fn vime_saved_checkpoints_read_back_by_transformers() {
    let tmp = tempfile::tempdir().unwrap();
    let root = std::env::var("VIME_KEEP_SAVE_DIR").map_or_else(|_| tmp.path().to_path_buf(), PathBuf::from);
    let cases = vime_save_cases();
    for (i, (name, cfg, dtype, max)) in cases.iter().enumerate() {
        let dir = root.join(name);
        save_hf_checkpoint(&dir, cfg, &random_tensors(cfg, 100 + i as u64), *dtype, *max).unwrap();
        eprintln!("saved {}", dir.display());
    }
    let record = read_json(&ckpt_fixtures().join("hf_reads_vime.json"));
    for (i, (name, cfg, dtype, _)) in cases.iter().enumerate() {
        let dir = root.join(name);
        let rec = &record[*name];
        let files = rec["files"].as_object().unwrap();
        let ours: Vec<String> = file_names(&dir)
            .into_iter()
            .filter(|f| f.ends_with(".safetensors") || f.ends_with(".index.json"))
            .collect();
        assert_eq!(ours, files.keys().cloned().collect::<Vec<_>>(), "{name}: weight files");
        for (f, h) in files {
            assert_eq!(
                fnv1a64(&std::fs::read(dir.join(f)).unwrap()),
                h.as_str().unwrap(),
                "{name}/{f} differs from the file transformers read; if the change is intended, \
                 re-run models/qwen3/tests/fixtures/gen_checkpoint_fixtures.py"
            );
        }
        // What was saved, as the values the file holds (rounded to the save dtype).
        let saved: BTreeMap<String, Tensor> = random_tensors(cfg, 100 + i as u64)
            .into_iter()
            .map(|(k, t)| (k, t.to_dtype(*dtype).unwrap().to_dtype(DType::F32).unwrap()))
            .collect();
        let mut saved_cfg = cfg.clone();
        saved_cfg.dtype = Some(vime_qwen3::config::hf_dtype_name(*dtype).unwrap().into());
        check_against_transformers(name, &saved_cfg, &saved, *dtype, &dir, rec);
    }
}

/// transformers -> vime: loads the checkpoints transformers wrote (`hf_saved/<case>/`) and checks
/// the config, every tensor and the logits against what transformers computed (`expected.json`).
#[test]
fn load_checkpoint_written_by_transformers() {
    for (case, stored) in [
        ("tied_f32_single", DType::F32),
        ("untied_bias_bf16_sharded", DType::BF16),
    ] {
        let dir = ckpt_fixtures().join("hf_saved").join(case);
        let cfg = load_config(&dir).unwrap();
        let got = load_hf_weights(&dir, &cfg, DType::F32, &Device::Cpu).unwrap();
        let record = read_json(&dir.join("expected.json"));
        check_against_transformers(case, &cfg, &got, stored, &dir, &record);
        // Loaded in the stored dtype, the values are the same.
        let native = load_hf_weights(&dir, &cfg, stored, &Device::Cpu).unwrap();
        assert!(native.values().all(|t| t.dtype() == stored), "{case}");
        assert_same(&got, &native);
    }
    // The sharded one really is sharded, the single one is one file.
    let names = file_names(&ckpt_fixtures().join("hf_saved/untied_bias_bf16_sharded"));
    assert!(names.contains(&SAFE_WEIGHTS_INDEX_NAME.to_string()), "{names:?}");
    let names = file_names(&ckpt_fixtures().join("hf_saved/tied_f32_single"));
    assert!(names.contains(&SAFE_WEIGHTS_NAME.to_string()), "{names:?}");
}
