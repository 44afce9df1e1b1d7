//! HF checkpoint save/load: single file and shards, f32 bit-exact and bf16, error messages, HF
//! file layout. The transformers cross-check is a manual step: set `VIME_KEEP_SAVE_DIR` to keep
//! checkpoints for `tests/fixtures/check_hf_loads_vime.py`, and `VIME_HF_SAVED_DIR` to load one
//! written by transformers (see that script).
use candle_core::{DType, Device, Tensor};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;
use vime_kernels::testing::Rng;
use vime_qwen3::checkpoint::{
    copy_tokenizer_files, load_config, load_hf_weights, save_hf_checkpoint, DEFAULT_MAX_SHARD_BYTES,
    SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, TOKENIZER_FILES,
};
use vime_qwen3::config::Qwen3Config;
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

/// Manual step, writes checkpoints for `tests/fixtures/check_hf_loads_vime.py` when
/// `VIME_KEEP_SAVE_DIR` is set: `tied_f32_single/` (tied, f32, one file), `untied_bias_bf16_sharded/`
/// (untied, attention_bias, bf16, shards) and `untied_f32_sharded/`.
#[test]
fn keep_save_dir_for_python_check() {
    let Ok(root) = std::env::var("VIME_KEEP_SAVE_DIR") else {
        return;
    };
    let root = Path::new(&root);
    let cases = [
        (
            "tied_f32_single",
            tiny(true, false),
            DType::F32,
            DEFAULT_MAX_SHARD_BYTES,
        ),
        ("untied_bias_bf16_sharded", tiny(false, true), DType::BF16, 3000),
        ("untied_f32_sharded", tiny(false, false), DType::F32, 5000),
    ];
    for (i, (name, cfg, dtype, max)) in cases.into_iter().enumerate() {
        let dir = root.join(name);
        save_hf_checkpoint(&dir, &cfg, &random_tensors(&cfg, 100 + i as u64), dtype, max).unwrap();
        eprintln!("saved {}", dir.display());
    }
}

/// Manual step: loads a checkpoint that transformers wrote (`check_hf_loads_vime.py --write-hf DIR`)
/// when `VIME_HF_SAVED_DIR` is set, and compares with the reference dump the script wrote next to it.
#[test]
fn load_checkpoint_written_by_transformers() {
    let Ok(dir) = std::env::var("VIME_HF_SAVED_DIR") else {
        return;
    };
    let dir = Path::new(&dir);
    let cfg = load_config(dir).unwrap();
    let got = load_hf_weights(dir, &cfg, DType::F32, &Device::Cpu).unwrap();
    // reference.safetensors: every parameter as f32, tied lm_head excluded, written by the script.
    let reference =
        candle_core::safetensors::load(dir.join("reference").join("reference.safetensors"), &Device::Cpu).unwrap();
    let reference: BTreeMap<String, Tensor> = reference.into_iter().collect();
    assert_same(&reference, &got);
    eprintln!(
        "loaded {} tensors written by transformers from {}",
        got.len(),
        dir.display()
    );
}
