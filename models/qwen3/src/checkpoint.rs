//! HF checkpoints in and out: `config.json` + `model.safetensors`, or shards
//! `model-0000i-of-0000N.safetensors` + `model.safetensors.index.json`, named and laid out exactly as
//! transformers' `save_pretrained` writes them, so transformers 4.5x/5.x and vLLM load what vime
//! saves and vime loads what they publish.
//!
//! Decisions:
//! - Every tensor is checked against [`param_specs`] before anything is loaded or written: missing
//!   tensors, wrong shapes and unknown names are all reported together, each naming the tensor,
//!   the expected and found shape and the file. Only two kinds of extra tensor are ignored on load:
//!   `lm_head.weight` of a tied model (some exporters store it) and `*.rotary_emb.inv_freq`
//!   (old transformers saved that buffer).
//! - Loading memory-maps each file and converts each tensor to the requested dtype on the
//!   requested device; `model.safetensors` wins over an index when both exist (as in transformers).
//! - Sharding follows `huggingface_hub.split_torch_state_dict_into_shards`: tensors in canonical
//!   order fill a shard until the next one would push it past `max_shard_bytes`; a tensor larger
//!   than the limit gets a shard of its own; one shard means a plain `model.safetensors` and no
//!   index. `total_size` in the index is the sum of tensor bytes (not file sizes), and
//!   `total_parameters` is written too, as transformers 5 does.
//! - Safetensors metadata is `{"format": "pt"}` (transformers refuses files without it). Inside a
//!   file the safetensors crate orders tensors by dtype then name, as the Python writer does.
//! - Every file is written to a hidden temp name in the target directory, fsynced, then renamed, and
//!   the directory is fsynced: a crash never leaves a partial file under a final name. When
//!   overwriting a directory, the old index (and, when sharding, the old `model.safetensors`) is
//!   removed BEFORE new shards are written and the new index is written last, so a crash half-way
//!   leaves no index pointing at a mix of old and new shards. For checkpoints that must survive a
//!   crash as a whole, save each one into a fresh directory.
use crate::config::{hf_dtype_name, Qwen3Config};
use crate::state_dict::{param_specs, ParamSpec, LM_HEAD};
use anyhow::{bail, Context, Result};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

pub const CONFIG_FILE: &str = "config.json";
pub const SAFE_WEIGHTS_NAME: &str = "model.safetensors";
pub const SAFE_WEIGHTS_INDEX_NAME: &str = "model.safetensors.index.json";

/// HF's `max_shard_size="5GB"`: `convert_file_size_to_int` counts "GB" as 10^9 bytes (GiB would be
/// 2^30). That is the transformers 4.x default, the one the published Qwen3 checkpoints were
/// sharded with; transformers 5 raised its default to "50GB".
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

/// Tokenizer and generation files carried along with a checkpoint, when the source has them.
pub const TOKENIZER_FILES: [&str; 8] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
];

/// Reads and validates `dir/config.json`.
pub fn load_config(dir: &Path) -> Result<Qwen3Config> {
    Qwen3Config::from_file(&dir.join(CONFIG_FILE))
}

/// The `model-0000i-of-0000N.safetensors` name of shard `i` (0-based) of `n`, as HF spells it.
pub fn shard_file_name(i: usize, n: usize) -> String {
    format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
}

fn is_shard_file_name(name: &str) -> bool {
    let Some(core) = name.strip_prefix("model-").and_then(|s| s.strip_suffix(".safetensors")) else {
        return false;
    };
    let b = core.as_bytes();
    b.len() == 14 && &core[5..9] == "-of-" && b[..5].iter().chain(&b[9..]).all(u8::is_ascii_digit)
}

/// Tensors present in a checkpoint that are not parameters but are known to be harmless.
fn ignorable(name: &str, cfg: &Qwen3Config) -> bool {
    (name == LM_HEAD && cfg.tie_word_embeddings) || name.ends_with(".rotary_emb.inv_freq")
}

fn problems_error(what: String, problems: &[String]) -> anyhow::Error {
    const SHOWN: usize = 20;
    let mut msg = format!(
        "{what} ({} problem{}):",
        problems.len(),
        if problems.len() == 1 { "" } else { "s" }
    );
    for p in problems.iter().take(SHOWN) {
        msg.push_str("\n  - ");
        msg.push_str(p);
    }
    if problems.len() > SHOWN {
        msg.push_str(&format!("\n  ... and {} more", problems.len() - SHOWN));
    }
    anyhow::anyhow!(msg)
}

fn unexpected_hint(name: &str, cfg: &Qwen3Config) -> &'static str {
    if name == LM_HEAD {
        " (tie_word_embeddings = true: the LM head is model.embed_tokens.weight)"
    } else if name.ends_with(".bias") && !cfg.attention_bias {
        " (attention_bias = false)"
    } else {
        ""
    }
}

/// Which tensor of `path`'s safetensors header is inconsistent, when the safetensors crate refused
/// the file with an error that names none (a shape, dtype or byte range that disagree). Reads the
/// header only, and only when its length prefix is plausible (at most 100 MB, as the crate allows,
/// and within the file).
fn header_problem(path: &Path) -> Option<String> {
    use std::io::Read;
    let mut f = std::fs::File::open(path).ok()?;
    let file_len = f.metadata().ok()?.len();
    let mut prefix = [0u8; 8];
    f.read_exact(&mut prefix).ok()?;
    let n = u64::from_le_bytes(prefix);
    if n > 100_000_000 || n + 8 > file_len {
        return None;
    }
    let mut header = vec![0u8; n as usize];
    f.read_exact(&mut header).ok()?;
    let header: Value = serde_json::from_slice(&header).ok()?;
    let data_len = file_len - 8 - n;
    for (name, t) in header.as_object()?.iter().filter(|(k, _)| *k != "__metadata__") {
        let dtype = t.get("dtype").and_then(Value::as_str).unwrap_or("");
        let bits: u64 = match dtype {
            "BOOL" | "U8" | "I8" | "F8_E5M2" | "F8_E4M3" | "F8_E8M0" => 8,
            "F16" | "BF16" | "I16" | "U16" => 16,
            "F32" | "I32" | "U32" => 32,
            "F64" | "I64" | "U64" => 64,
            _ => continue, // sub-byte or unknown dtypes: the crate's own message stands
        };
        let shape: Option<Vec<u64>> = t
            .get("shape")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_u64).collect());
        let offsets: Option<Vec<u64>> = t
            .get("data_offsets")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_u64).collect());
        let (Some(shape), Some(offsets)) = (shape, offsets) else {
            continue;
        };
        let bytes = shape.iter().try_fold(bits, |acc, &d| acc.checked_mul(d)).map(|b| b / 8);
        let Some(bytes) = bytes else {
            return Some(format!("tensor {name}: shape {shape:?} of {dtype} overflows"));
        };
        if let [start, end] = offsets[..] {
            if end < start || end > data_len {
                return Some(format!(
                    "tensor {name}: data_offsets [{start}, {end}] lie outside the file's {data_len} data bytes"
                ));
            }
            if end - start != bytes {
                return Some(format!(
                    "tensor {name}: shape {shape:?} of {dtype} is {bytes} bytes but its data_offsets [{start}, {end}] span {}",
                    end - start
                ));
            }
        }
    }
    None
}

/// Loads the weights of an HF Qwen3 checkpoint directory (`model.safetensors`, or the shards of
/// `model.safetensors.index.json`), checked against [`param_specs`], as `dtype` on `device`.
pub fn load_hf_weights(
    dir: &Path,
    cfg: &Qwen3Config,
    dtype: DType,
    device: &Device,
) -> Result<BTreeMap<String, Tensor>> {
    // (file, names the index says the file holds)
    let mut files: Vec<(PathBuf, Vec<String>)> = Vec::new();
    let single = dir.join(SAFE_WEIGHTS_NAME);
    let index = dir.join(SAFE_WEIGHTS_INDEX_NAME);
    if single.is_file() {
        files.push((single.clone(), Vec::new()));
    } else if index.is_file() {
        let text = std::fs::read_to_string(&index).with_context(|| format!("reading {}", index.display()))?;
        let v: Value = serde_json::from_str(&text).with_context(|| format!("parsing {}", index.display()))?;
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .with_context(|| format!("{}: no \"weight_map\" object", index.display()))?;
        let mut by_file: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for (name, file) in map {
            let file = file
                .as_str()
                .with_context(|| format!("{}: weight_map[{name:?}] is not a file name", index.display()))?;
            if file.is_empty() || file.contains('/') || file.contains('\\') || file.starts_with('.') {
                bail!(
                    "{}: weight_map[{name:?}] = {file:?} is not a plain file name",
                    index.display()
                );
            }
            by_file.entry(file.to_string()).or_default().push(name.clone());
        }
        files.extend(by_file.into_iter().map(|(f, names)| (dir.join(f), names)));
    } else {
        bail!(
            "{}: no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME} in this directory",
            dir.display()
        );
    }

    // Pass 1: headers only; every problem is collected before any tensor is read.
    let specs = param_specs(cfg);
    let by_name: HashMap<&str, &ParamSpec> = specs.iter().map(|s| (s.name.as_str(), s)).collect();
    let mut mmaps = Vec::with_capacity(files.len());
    let mut found: BTreeMap<String, usize> = BTreeMap::new(); // name -> index into `files`
    let mut problems = Vec::new();
    for (fi, (path, listed)) in files.iter().enumerate() {
        // SAFETY: the file is mapped read-only; as with any mmap, it must not be modified while
        // mapped. Every tensor is copied out before this function returns.
        let st = unsafe { MmapedSafetensors::new(path) }.with_context(|| {
            let named_by = match listed.first() {
                Some(first) => format!(
                    " (named by {SAFE_WEIGHTS_INDEX_NAME} for {} tensors, e.g. {first})",
                    listed.len()
                ),
                None => String::new(),
            };
            match header_problem(path) {
                Some(p) => format!("opening {}{named_by}: {p}", path.display()),
                None => format!("opening {}{named_by}", path.display()),
            }
        })?;
        for name in listed {
            if st.get(name).is_err() {
                problems.push(format!(
                    "{SAFE_WEIGHTS_INDEX_NAME} puts {name} in {} but that file has no such tensor",
                    path.display()
                ));
            }
        }
        for (name, view) in st.tensors() {
            if let Some(&prev) = found.get(&name) {
                problems.push(format!(
                    "tensor {name} is in both {} and {}",
                    files[prev].0.display(),
                    path.display()
                ));
                continue;
            }
            match by_name.get(name.as_str()) {
                None if ignorable(&name, cfg) => {}
                None => problems.push(format!(
                    "unexpected tensor {name} {:?} in {}: not a parameter of this Qwen3 config{}",
                    view.shape(),
                    path.display(),
                    unexpected_hint(&name, cfg)
                )),
                Some(spec) => {
                    if view.shape() != spec.shape.as_slice() {
                        problems.push(format!(
                            "tensor {name} in {}: expected shape {:?}, found {:?}",
                            path.display(),
                            spec.shape,
                            view.shape()
                        ));
                    } else if !matches!(
                        view.dtype(),
                        safetensors::Dtype::BF16
                            | safetensors::Dtype::F16
                            | safetensors::Dtype::F32
                            | safetensors::Dtype::F64
                    ) {
                        problems.push(format!(
                            "tensor {name} in {}: dtype {:?} is not a float dtype",
                            path.display(),
                            view.dtype()
                        ));
                    }
                    found.insert(name, fi);
                }
            }
        }
        mmaps.push(st);
    }
    let file_list = || {
        let list = files
            .iter()
            .map(|(p, _)| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        match files.first() {
            Some((p, _)) if *p == single => list,
            _ => format!("the shards {} lists ({list})", index.display()),
        }
    };
    for spec in &specs {
        if !found.contains_key(&spec.name) {
            problems.push(format!(
                "missing tensor {} (expected shape {:?}) in {}",
                spec.name,
                spec.shape,
                file_list()
            ));
        }
    }
    if !problems.is_empty() {
        return Err(problems_error(
            format!("{}: checkpoint does not match the Qwen3 config", dir.display()),
            &problems,
        ));
    }

    // Pass 2: read, convert, place.
    let mut out = BTreeMap::new();
    for spec in &specs {
        let fi = found[&spec.name];
        let path = &files[fi].0;
        let t = mmaps[fi]
            .load(&spec.name, device)
            .and_then(|t| t.to_dtype(dtype))
            .with_context(|| format!("loading tensor {} from {}", spec.name, path.display()))?;
        out.insert(spec.name.clone(), t);
    }
    Ok(out)
}

/// Checks that `tensors` holds exactly the parameters of `cfg` with their shapes.
pub fn check_tensors(cfg: &Qwen3Config, tensors: &BTreeMap<String, Tensor>) -> Result<()> {
    let specs = param_specs(cfg);
    let mut problems = Vec::new();
    for spec in &specs {
        match tensors.get(&spec.name) {
            None => problems.push(format!(
                "missing tensor {} (expected shape {:?})",
                spec.name, spec.shape
            )),
            Some(t) if t.dims() != spec.shape.as_slice() => problems.push(format!(
                "tensor {}: expected shape {:?}, found {:?}",
                spec.name,
                spec.shape,
                t.dims()
            )),
            Some(_) => {}
        }
    }
    let known: std::collections::HashSet<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    for (name, t) in tensors {
        if !known.contains(name.as_str()) {
            problems.push(format!(
                "unexpected tensor {name} {:?}: not a parameter of this Qwen3 config{}",
                t.dims(),
                unexpected_hint(name, cfg)
            ));
        }
    }
    if !problems.is_empty() {
        return Err(problems_error(
            "tensors do not match the Qwen3 config".to_string(),
            &problems,
        ));
    }
    Ok(())
}

/// Splits the canonical order into shards as `huggingface_hub` does; returns the spec indices of
/// each shard.
fn plan_shards(sizes: &[u64], max_shard_bytes: u64) -> Vec<Vec<usize>> {
    let mut shards = Vec::new();
    let (mut cur, mut cur_bytes) = (Vec::new(), 0u64);
    for (i, &b) in sizes.iter().enumerate() {
        if !cur.is_empty() && cur_bytes + b > max_shard_bytes {
            shards.push(std::mem::take(&mut cur));
            cur_bytes = 0;
        }
        cur.push(i);
        cur_bytes += b;
    }
    if !cur.is_empty() {
        shards.push(cur);
    }
    shards
}

fn temp_path(dir: &Path, name: &str) -> PathBuf {
    dir.join(format!(".{name}.vime-tmp-{}", std::process::id()))
}

/// fsyncs `tmp`, renames it to `dir/name`. Removes `tmp` on failure.
fn commit(tmp: &Path, dir: &Path, name: &str) -> Result<()> {
    let fin = dir.join(name);
    let r = (|| -> Result<()> {
        std::fs::File::open(tmp)?.sync_all()?;
        std::fs::rename(tmp, &fin)?;
        Ok(())
    })();
    if r.is_err() {
        let _ = std::fs::remove_file(tmp);
    }
    r.with_context(|| format!("writing {}", fin.display()))
}

/// Writes `bytes` to `dir/name` atomically (temp file, fsync, rename).
fn write_file_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    let tmp = temp_path(dir, name);
    let r = (|| -> std::io::Result<()> {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.flush()
    })();
    if let Err(e) = r {
        let _ = std::fs::remove_file(&tmp);
        return Err(e).with_context(|| format!("writing {}", dir.join(name).display()));
    }
    commit(&tmp, dir, name)
}

fn sync_dir(dir: &Path) -> Result<()> {
    #[cfg(unix)]
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| format!("syncing directory {}", dir.display()))?;
    Ok(())
}

fn remove_if_exists(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing stale {}", path.display()))
        }
        _ => Ok(()),
    }
}

/// Writes an HF checkpoint of `tensors` into `dir` (created if needed): `config.json` (with `dtype`
/// set to the save dtype) and one `model.safetensors` when the tensors total at most
/// `max_shard_bytes`, else HF-named shards + `model.safetensors.index.json`. Tensors are stored as
/// `dtype` (bf16, f16 or f32). Stale weight files of an earlier save into `dir` are removed.
pub fn save_hf_checkpoint(
    dir: &Path,
    cfg: &Qwen3Config,
    tensors: &BTreeMap<String, Tensor>,
    dtype: DType,
    max_shard_bytes: u64,
) -> Result<()> {
    let dtype_name = hf_dtype_name(dtype)?;
    cfg.validate()?;
    if max_shard_bytes == 0 {
        bail!("max_shard_bytes must be positive");
    }
    check_tensors(cfg, tensors)?;
    let specs = param_specs(cfg);
    let sizes: Vec<u64> = specs
        .iter()
        .map(|s| (s.numel() * dtype.size_in_bytes()) as u64)
        .collect();
    let total_size: u64 = sizes.iter().sum();
    let total_parameters: usize = specs.iter().map(|s| s.numel()).sum();
    let shards = plan_shards(&sizes, max_shard_bytes);
    let n = shards.len();
    let file_names: Vec<String> = if n == 1 {
        vec![SAFE_WEIGHTS_NAME.to_string()]
    } else {
        (0..n).map(|i| shard_file_name(i, n)).collect()
    };

    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut hf_cfg = cfg.clone();
    hf_cfg.dtype = Some(dtype_name.to_string());
    let cfg_text = serde_json::to_string_pretty(&hf_cfg.to_hf_json())? + "\n";
    write_file_atomic(dir, CONFIG_FILE, cfg_text.as_bytes())?;

    // No index may point at a mix of old and new shards, and no stale single file may shadow it.
    remove_if_exists(&dir.join(SAFE_WEIGHTS_INDEX_NAME))?;
    if n > 1 {
        remove_if_exists(&dir.join(SAFE_WEIGHTS_NAME))?;
    }
    sync_dir(dir)?;

    let metadata: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();
    let mut weight_map = BTreeMap::new();
    for (shard, file) in shards.iter().zip(&file_names) {
        let mut data: Vec<(String, Tensor)> = Vec::with_capacity(shard.len());
        for &i in shard {
            let name = &specs[i].name;
            let t = tensors[name]
                .to_device(&Device::Cpu)
                .and_then(|t| t.to_dtype(dtype))
                .and_then(|t| t.contiguous())
                .with_context(|| format!("converting tensor {name} to {dtype_name}"))?;
            data.push((name.clone(), t));
            weight_map.insert(name.clone(), file.clone());
        }
        let tmp = temp_path(dir, file);
        if let Err(e) = safetensors::tensor::serialize_to_file(data, Some(metadata.clone()), &tmp) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e).with_context(|| format!("writing {}", dir.join(file).display()));
        }
        commit(&tmp, dir, file)?;
    }
    if n > 1 {
        let index = json!({
            "metadata": {"total_size": total_size, "total_parameters": total_parameters},
            "weight_map": weight_map,
        });
        let text = serde_json::to_string_pretty(&index)? + "\n";
        write_file_atomic(dir, SAFE_WEIGHTS_INDEX_NAME, text.as_bytes())?;
    }
    // Shards of an earlier save with another shard count.
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if is_shard_file_name(&name) && !file_names.contains(&name) {
            remove_if_exists(&dir.join(&name))?;
        }
    }
    sync_dir(dir)
}

/// Copies the tokenizer / generation files of [`TOKENIZER_FILES`] that exist in `from` into `to`
/// (created if needed), each atomically. Returns the names copied.
pub fn copy_tokenizer_files(from: &Path, to: &Path) -> Result<Vec<String>> {
    std::fs::create_dir_all(to).with_context(|| format!("creating {}", to.display()))?;
    let mut copied = Vec::new();
    for name in TOKENIZER_FILES {
        let src = from.join(name);
        if !src.is_file() {
            continue;
        }
        let tmp = temp_path(to, name);
        if let Err(e) = std::fs::copy(&src, &tmp) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e).with_context(|| format!("copying {} to {}", src.display(), to.join(name).display()));
        }
        commit(&tmp, to, name)?;
        copied.push(name.to_string());
    }
    if !copied.is_empty() {
        sync_dir(to)?;
    }
    Ok(copied)
}
