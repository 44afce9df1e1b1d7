//! Fuzzing the checkpoint readers with the in-tree harness (`vime_kernels::testing::fuzz`: seeded
//! mutations of valid seeds plus structure-aware inputs; no panic, no hang, bounded heap per
//! input). CI runs each target for a bounded number of executions; `VIME_FUZZ_SECS=60 cargo test
//! --release -p vime-qwen3 --test fuzz -- --test-threads 1 --nocapture` runs each for 60 s.
//!
//! Targets:
//! - `safetensors_file`: `model.safetensors` bytes through `load_hf_weights`: byte mutations, and
//!   header-aware ones (the JSON header edited as JSON: shapes, dtypes and data_offsets that lie;
//!   the length prefix replaced by a lie, up to u64::MAX; the data truncated or extended). Every
//!   error must name the file.
//! - `safetensors_index`: `model.safetensors.index.json` over valid shards: weight maps that point
//!   at missing, wrong, non-plain or duplicate files. Every error must name the index or a shard.
//! - `config_json`: `config.json` text through `Qwen3Config::from_json_str` and, when it parses,
//!   the parameter table and count, and `load_config` from a file (the error names it).
//!
//! Crashes the fuzzer found are regression tests at the end of this file.
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::Path;
use vime_kernels::testing::fuzz::{self, random_json, Budget, CountingAlloc, Inputs};
use vime_kernels::testing::Rng;
use vime_qwen3::checkpoint::{load_config, load_hf_weights, save_hf_checkpoint, DEFAULT_MAX_SHARD_BYTES};
use vime_qwen3::config::Qwen3Config;
use vime_qwen3::state_dict::param_specs;

mod common;
use common::tiny;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

/// A scratch directory on tmpfs when there is one: every input is written to a file, and
/// rewriting a file on ext4 makes the kernel flush it (auto_da_alloc), which would make the
/// fuzzer measure the disk.
fn scratch_dir() -> tempfile::TempDir {
    match Path::new("/dev/shm") {
        shm if shm.is_dir() => tempfile::tempdir_in(shm).unwrap_or_else(|_| tempfile::tempdir().unwrap()),
        _ => tempfile::tempdir().unwrap(),
    }
}

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

fn saved(cfg: &Qwen3Config, dtype: DType, max_shard: u64) -> tempfile::TempDir {
    let dir = scratch_dir();
    save_hf_checkpoint(dir.path(), cfg, &random_tensors(cfg, 1), dtype, max_shard).unwrap();
    dir
}

fn pick(rng: &mut Rng, n: usize) -> usize {
    (rng.next_u64() % n.max(1) as u64) as usize
}

/// A valid-JSON mutation: 1 to 4 nodes (chosen uniformly over the tree) replaced by generated
/// JSON or a vocabulary string, removed, or duplicated.
fn json_mutate(rng: &mut Rng, v: &mut serde_json::Value, keys: &[&str], strings: &[&str]) {
    fn paths(v: &serde_json::Value, at: String, out: &mut Vec<String>) {
        out.push(at.clone());
        match v {
            serde_json::Value::Object(m) => {
                for (k, x) in m {
                    paths(x, format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")), out)
                }
            }
            serde_json::Value::Array(a) => {
                for (i, x) in a.iter().enumerate() {
                    paths(x, format!("{at}/{i}"), out)
                }
            }
            _ => {}
        }
    }
    for _ in 0..1 + rng.next_u64() % 4 {
        let mut all = Vec::new();
        paths(v, String::new(), &mut all);
        let at = all[pick(rng, all.len())].clone();
        let fresh: serde_json::Value = serde_json::from_str(&random_json(rng, 2, keys, strings)).unwrap_or_default();
        let (parent, last) = at.rsplit_once('/').unwrap_or(("", ""));
        match (pick(rng, 4), v.pointer_mut(parent)) {
            (1, Some(serde_json::Value::Object(m))) if !at.is_empty() => {
                m.remove(&last.replace("~1", "/").replace("~0", "~"));
            }
            (1, Some(serde_json::Value::Array(a))) if !at.is_empty() => {
                a.remove(last.parse::<usize>().unwrap());
            }
            (2, Some(serde_json::Value::Array(a))) if !at.is_empty() => {
                let i: usize = last.parse().unwrap();
                let x = a[i].clone();
                a.insert(i, x);
            }
            (3, _) if !strings.is_empty() => {
                let s = strings[pick(rng, strings.len())];
                if let Some(x) = v.pointer_mut(&at) {
                    *x = s.into();
                }
            }
            _ => {
                if let Some(x) = v.pointer_mut(&at) {
                    *x = fresh;
                }
            }
        }
    }
}

// ---- safetensors file ----------------------------------------------------------------------

const ST_KEYS: &[&str] = &["dtype", "shape", "data_offsets", "__metadata__", "format"];
const ST_STRINGS: &[&str] = &[
    "F32",
    "BF16",
    "F16",
    "F64",
    "I64",
    "I32",
    "U8",
    "BOOL",
    "F8_E4M3",
    "F8_E5M2",
    "F4",
    "pt",
    "",
    "model.embed_tokens.weight",
    "model.norm.weight",
    "lm_head.weight",
    "model.layers.0.self_attn.q_proj.weight",
];

/// Splits a safetensors file into (header JSON, data).
fn split_file(bytes: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (bytes[8..8 + n].to_vec(), bytes[8 + n..].to_vec())
}

/// A header-aware input: the seed's header edited (as JSON, or as bytes), a length prefix that is
/// right or a lie, and the data kept, truncated or extended.
fn header_mutation(rng: &mut Rng, inputs: &Inputs) -> Vec<u8> {
    let seed = &inputs.seeds[pick(rng, inputs.seeds.len())];
    let (header, mut data) = split_file(seed);
    let header: Vec<u8> = if pick(rng, 4) == 0 {
        Inputs {
            seeds: vec![header],
            dict: inputs.dict.clone(),
            max_len: inputs.max_len,
        }
        .mutate(rng)
    } else {
        let mut v: serde_json::Value = serde_json::from_slice(&header).unwrap();
        json_mutate(rng, &mut v, ST_KEYS, ST_STRINGS);
        v.to_string().into_bytes()
    };
    let len = header.len() as u64;
    let prefix = match pick(rng, 10) {
        0 => u64::MAX,
        1 => len + 1 + rng.next_u64() % 64,
        2 => len.saturating_sub(1 + rng.next_u64() % 64),
        3 => [0, 1, 7, 8, 1 << 40, 100_000_001][pick(rng, 6)],
        _ => len,
    };
    match pick(rng, 6) {
        0 => data.truncate(pick(rng, data.len() + 1)),
        1 => data.extend((0..1 + pick(rng, 16)).map(|_| rng.next_u64() as u8)),
        _ => {}
    }
    let mut out = prefix.to_le_bytes().to_vec();
    out.extend(header);
    out.extend(data);
    out
}

/// A file the safetensors crate accepts (offsets consistent with shapes and dtypes) whose tensors
/// vime must still check: random dtypes (float or not), shapes right or off by a little, names
/// dropped, duplicated as other names, or unknown.
fn consistent_file(rng: &mut Rng, cfg: &Qwen3Config) -> Vec<u8> {
    use safetensors::Dtype::*;
    let dtypes = [F32, BF16, F16, F64, I64, I32, U8, BOOL, F8_E4M3, U32];
    let mut tensors: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for spec in param_specs(cfg) {
        if pick(rng, 12) == 0 {
            continue;
        }
        let dtype = if pick(rng, 3) == 0 {
            dtypes[pick(rng, dtypes.len())]
        } else {
            F32
        };
        let mut shape = spec.shape.clone();
        match pick(rng, 10) {
            0 => shape.reverse(),
            1 => shape.push(1),
            2 => shape[0] += 1,
            3 => shape = vec![],
            _ => {}
        }
        let name = match pick(rng, 20) {
            0 => format!("{}.extra", spec.name),
            1 => "lm_head.weight".to_string(),
            _ => spec.name.clone(),
        };
        let n = shape.iter().product::<usize>() * dtype.bitsize() / 8;
        let data = (0..n).map(|_| rng.next_u64() as u8).collect();
        tensors.push((name, dtype, shape, data));
    }
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    tensors.dedup_by(|a, b| a.0 == b.0);
    let views: Vec<(String, safetensors::tensor::TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::tensor::serialize(views, Some(meta)).unwrap()
}

#[test]
fn fuzz_safetensors_file() {
    let cfg = tiny(false, true);
    let gen_cfg = cfg.clone();
    let seeds: Vec<Vec<u8>> = [DType::F32, DType::BF16]
        .into_iter()
        .map(|dt| {
            std::fs::read(
                saved(&cfg, dt, DEFAULT_MAX_SHARD_BYTES)
                    .path()
                    .join("model.safetensors"),
            )
            .unwrap()
        })
        .collect();
    let inputs = Inputs {
        seeds,
        dict: ST_STRINGS
            .iter()
            .map(|s| format!("\"{s}\"").into_bytes())
            .chain(["[]", "[0, 0]", "[4294967296, 4294967296]", "{}", "null"].map(|s| s.as_bytes().to_vec()))
            .collect(),
        max_len: 1 << 17,
    };
    let dir = scratch_dir();
    let root = dir.path().to_path_buf();
    let target = move |input: &[u8]| {
        std::fs::write(root.join("model.safetensors"), input).unwrap();
        let mut accepted = false;
        for dtype in [DType::F32, DType::BF16] {
            match load_hf_weights(&root, &cfg, dtype, &Device::Cpu) {
                Ok(_) => accepted = true,
                Err(e) => {
                    let msg = format!("{e:#}");
                    assert!(
                        msg.contains("model.safetensors"),
                        "the error does not name the file: {msg}"
                    );
                }
            }
        }
        accepted
    };
    let gen = move |rng: &mut Rng, inputs: &Inputs| match pick(rng, 3) {
        0 => inputs.mutate(rng),
        1 => header_mutation(rng, inputs),
        _ => consistent_file(rng, &gen_cfg),
    };
    fuzz::run("safetensors_file", &Budget::from_env(), 600, &inputs, gen, target).assert_clean();
}

// ---- safetensors index ---------------------------------------------------------------------

#[test]
fn fuzz_safetensors_index() {
    let cfg = tiny(false, false);
    let dir = saved(&cfg, DType::F32, 5000);
    let root = dir.path().to_path_buf();
    let index_path = root.join("model.safetensors.index.json");
    let index = std::fs::read(&index_path).unwrap();
    let mut names: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut strings: Vec<&'static str> = names.iter().map(|s| &*s.clone().leak()).collect();
    strings.extend([
        "model.safetensors.index.json",
        "config.json",
        "",
        ".",
        "..",
        "../model-00001-of-00005.safetensors",
        "/etc/hosts",
        ".hidden",
        "model.norm.weight",
        "model.embed_tokens.weight",
        "lm_head.weight",
    ]);
    let strings: &'static [&'static str] = strings.leak();
    let inputs = Inputs {
        seeds: vec![index],
        dict: strings.iter().map(|s| format!("\"{s}\"").into_bytes()).collect(),
        max_len: 1 << 14,
    };
    let idx = index_path.clone();
    let target = move |input: &[u8]| {
        std::fs::write(&idx, input).unwrap();
        match load_hf_weights(&root, &cfg, DType::F32, &Device::Cpu) {
            Ok(_) => true,
            Err(e) => {
                let msg = format!("{e:#}");
                assert!(
                    msg.contains("model.safetensors.index.json"),
                    "the error does not name the index: {msg}"
                );
                false
            }
        }
    };
    let keys: &'static [&'static str] = &["weight_map", "metadata", "total_size", "total_parameters"];
    let gen = move |rng: &mut Rng, inputs: &Inputs| {
        if pick(rng, 3) == 0 {
            inputs.mutate(rng)
        } else {
            let mut v: serde_json::Value = serde_json::from_slice(&inputs.seeds[0]).unwrap();
            json_mutate(rng, &mut v, keys, strings);
            v.to_string().into_bytes()
        }
    };
    fuzz::run("safetensors_index", &Budget::from_env(), 600, &inputs, gen, target).assert_clean();
    drop(dir);
}

// ---- config.json ---------------------------------------------------------------------------

const CONFIG_KEYS: &[&str] = &[
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "rope_type",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "torch_dtype",
    "dtype",
    "hidden_act",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "layer_types",
    "attention_dropout",
    "initializer_range",
];
const CONFIG_STRINGS: &[&str] = &[
    "qwen3",
    "qwen2",
    "silu",
    "gelu",
    "bfloat16",
    "float32",
    "float16",
    "int8",
    "default",
    "yarn",
    "full_attention",
    "sliding_attention",
];

#[test]
fn fuzz_config_json() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut seeds: Vec<Vec<u8>> = ["tied_gqa", "untied_gqa", "untied_bias"]
        .iter()
        .map(|c| std::fs::read(repo.join("tests/fixtures/hf").join(c).join("config.json")).unwrap())
        .collect();
    seeds.push(
        std::fs::read(repo.join("models/qwen3/tests/fixtures/checkpoint/hf_saved/tied_f32_single/config.json"))
            .unwrap(),
    );
    for p in vime_qwen3::config::PRESET_NAMES {
        seeds.push(Qwen3Config::preset(p).unwrap().to_hf_json().to_string().into_bytes());
    }
    let inputs = Inputs {
        seeds,
        dict: CONFIG_KEYS.iter().map(|s| format!("\"{s}\"").into_bytes()).collect(),
        max_len: 1 << 14,
    };
    let dir = scratch_dir();
    let path = dir.path().join("config.json");
    let target = move |input: &[u8]| {
        let text = String::from_utf8_lossy(input);
        let parsed = Qwen3Config::from_json_str(&text);
        if let Ok(cfg) = &parsed {
            let _ = cfg.num_parameters();
            let _ = (cfg.q_dim(), cfg.kv_dim(), cfg.candle_dtype());
            let again = Qwen3Config::from_json_str(&cfg.to_hf_json().to_string()).expect("a valid config round-trips");
            assert_eq!(again.num_parameters(), cfg.num_parameters());
        }
        std::fs::write(&path, input).unwrap();
        if let Err(e) = load_config(path.parent().unwrap()) {
            let msg = format!("{e:#}");
            assert!(msg.contains("config.json"), "the error does not name the file: {msg}");
        }
        parsed.is_ok()
    };
    let gen = |rng: &mut Rng, inputs: &Inputs| match pick(rng, 3) {
        0 => inputs.mutate(rng),
        _ => {
            let mut v: serde_json::Value =
                serde_json::from_slice(&inputs.seeds[pick(rng, inputs.seeds.len())]).unwrap();
            json_mutate(rng, &mut v, CONFIG_KEYS, CONFIG_STRINGS);
            v.to_string().into_bytes()
        }
    };
    fuzz::run("config_json", &Budget::from_env(), 3000, &inputs, gen, target).assert_clean();
}

// ---- regression tests: what the fuzzer found, and the header lies it is built around ---------

/// `model.safetensors` of the seed with its header edited by `edit` (length prefix kept right).
fn with_header(seed: &[u8], edit: impl FnOnce(&mut serde_json::Value)) -> Vec<u8> {
    let (header, data) = split_file(seed);
    let mut v: serde_json::Value = serde_json::from_slice(&header).unwrap();
    edit(&mut v);
    let header = v.to_string().into_bytes();
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend(header);
    out.extend(data);
    out
}

fn load_error(dir: &Path, cfg: &Qwen3Config) -> String {
    format!(
        "{:#}",
        load_hf_weights(dir, cfg, DType::F32, &Device::Cpu).expect_err("must be refused")
    )
}

/// Headers that lie about sizes, offsets or dtypes, truncated files and huge length prefixes are
/// errors naming the file, and the tensor where one is at fault; none allocates what it claims.
#[test]
fn lying_safetensors_headers_are_errors_naming_file_and_tensor() {
    let cfg = tiny(false, true);
    let good = std::fs::read(
        saved(&cfg, DType::F32, DEFAULT_MAX_SHARD_BYTES)
            .path()
            .join("model.safetensors"),
    )
    .unwrap();
    let dir = scratch_dir();
    let file = dir.path().join("model.safetensors");
    let norm = "model.norm.weight";
    let (header_len, data_len) = {
        let (h, d) = split_file(&good);
        (h.len(), d.len())
    };
    let mut prefix_lie = good.clone();
    prefix_lie[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    let mut prefix_past_end = good.clone();
    prefix_past_end[..8].copy_from_slice(&((good.len() - 7) as u64).to_le_bytes());
    let cases: Vec<(&str, Vec<u8>, Vec<&str>)> = vec![
        (
            "a shape bigger than its bytes",
            with_header(&good, |v| v[norm]["shape"] = serde_json::json!([25])),
            vec![norm, "shape [25] of F32 is 100 bytes", "span 96"],
        ),
        (
            "a shape that overflows",
            with_header(&good, |v| {
                v[norm]["shape"] = serde_json::json!([4294967296u64, 4294967296u64, 16])
            }),
            vec![norm, "overflows"],
        ),
        (
            "an integer dtype with the right byte count",
            with_header(&good, |v| v[norm]["dtype"] = "I32".into()),
            vec![norm, "I32", "not a float dtype"],
        ),
        (
            "data truncated",
            good[..good.len() - 10].to_vec(),
            vec![
                "data_offsets",
                "outside the file's",
                &*format!("{} data bytes", data_len - 10).leak(),
            ],
        ),
        ("header truncated", good[..8 + header_len / 2].to_vec(), vec![]),
        ("length prefix u64::MAX", prefix_lie, vec!["header too large"]),
        ("length prefix past the end", prefix_past_end, vec![]),
        ("only the prefix", good[..8].to_vec(), vec![]),
        ("empty file", Vec::new(), vec![]),
    ];
    for (what, bytes, want) in cases {
        std::fs::write(&file, &bytes).unwrap();
        let msg = load_error(dir.path(), &cfg);
        assert!(msg.contains(&file.display().to_string()), "{what}: {msg}");
        for w in want {
            assert!(msg.contains(w), "{what}: no {w:?} in: {msg}");
        }
    }
}

/// Found by `fuzz_safetensors_index`: an index naming `""` (the directory itself), a file that is
/// not safetensors, or no tensors at all gave errors that did not name the index.
#[test]
fn index_errors_name_the_index() {
    let cfg = tiny(false, false);
    let dir = saved(&cfg, DType::F32, 5000);
    let idx = dir.path().join("model.safetensors.index.json");
    let good: serde_json::Value = serde_json::from_slice(&std::fs::read(&idx).unwrap()).unwrap();
    let edit = |f: &dyn Fn(&mut serde_json::Value)| {
        let mut v = good.clone();
        f(&mut v);
        std::fs::write(&idx, v.to_string()).unwrap();
        load_error(dir.path(), &cfg)
    };
    let msg = edit(&|v| v["weight_map"]["model.norm.weight"] = "".into());
    assert!(
        msg.contains("model.safetensors.index.json") && msg.contains("is not a plain file name"),
        "{msg}"
    );
    let msg = edit(&|v| v["weight_map"]["model.norm.weight"] = "config.json".into());
    assert!(
        msg.contains("config.json")
            && msg.contains("named by model.safetensors.index.json")
            && msg.contains("model.norm.weight"),
        "{msg}"
    );
    let msg = edit(&|v| v["weight_map"] = serde_json::json!({}));
    assert!(
        msg.contains("missing tensor model.embed_tokens.weight")
            && msg.contains("the shards")
            && msg.contains("model.safetensors.index.json"),
        "{msg}"
    );
    let msg = edit(&|v| {
        v["weight_map"]
            .as_object_mut()
            .unwrap()
            .remove("model.layers.0.mlp.gate_proj.weight");
    });
    assert!(
        msg.contains("missing tensor model.layers.0.mlp.gate_proj.weight")
            && msg.contains("model.safetensors.index.json"),
        "{msg}"
    );
}

/// Found by `fuzz_config_json` (a 60 s run): Qwen3-0.6B's config with `"num_hidden_layers":
/// 4294967296` passed validation, and the parameter table then asked for a 1.4 GB allocation
/// (the harness refused it and printed the input). Sizes whose product overflows are refused too.
#[test]
fn config_with_a_huge_layer_count_or_overflowing_sizes_is_refused() {
    let base = Qwen3Config::preset("qwen3-0.6b").unwrap().to_hf_json();
    let with = |k: &str, v: serde_json::Value| {
        let mut j = base.clone();
        j[k] = v;
        format!(
            "{:#}",
            Qwen3Config::from_json_str(&j.to_string()).expect_err("must be refused")
        )
    };
    let msg = with("num_hidden_layers", 4294967296u64.into());
    assert!(msg.contains("num_hidden_layers = 4294967296"), "{msg}");
    let msg = with("head_dim", (1u64 << 62).into());
    assert!(msg.contains("head_dim") && msg.contains("overflows"), "{msg}");
    let msg = with("hidden_size", (1u64 << 48).into());
    assert!(
        msg.contains("model.embed_tokens.weight") && msg.contains("overflows"),
        "{msg}"
    );
    let msg = with("intermediate_size", (1u64 << 56).into());
    assert!(msg.contains("mlp") && msg.contains("overflows"), "{msg}");
    // The limit leaves every real model alone.
    for p in vime_qwen3::config::PRESET_NAMES {
        Qwen3Config::from_json_str(&Qwen3Config::preset(p).unwrap().to_hf_json().to_string()).unwrap();
    }
}
