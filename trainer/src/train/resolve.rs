//! What a run settles before it loads anything, so that a bad command line fails in
//! milliseconds with a message naming the flag:
//! - the checkpoint: `--hf-checkpoint`, or `--model NAME` found in the local Hugging Face cache
//!   (vime never downloads at run time), or `--init random` at the preset's shape;
//! - the device and dtype (`auto`: CUDA and bf16 when this build has CUDA and a GPU is present,
//!   else CPU and f32);
//! - Megatron's model-shape flags (slime's `scripts/models/qwen3-*.sh`) against the checkpoint's
//!   config.json: a mismatch is an error naming both values (slime#1059: a silent mismatch
//!   trains the wrong model).
use super::args::TrainArgs;
use super::compat::{ShapeFlags, ShapeKey};
use super::placement::Layout;
use anyhow::{bail, ensure, Context, Result};
use std::path::{Path, PathBuf};
use vime_qwen3::config::{Preset, Qwen3Config, PRESETS};

/// The Hugging Face hub cache: `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else
/// `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub` (huggingface_hub's order).
pub fn hf_hub_cache() -> PathBuf {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(p) = var("HF_HUB_CACHE") {
        return p;
    }
    if let Some(p) = var("HF_HOME") {
        return p.join("hub");
    }
    let cache =
        var("XDG_CACHE_HOME").unwrap_or_else(|| var("HOME").unwrap_or_else(|| PathBuf::from("/")).join(".cache"));
    cache.join("huggingface").join("hub")
}

/// The preset `--model` names, or an error listing the known names.
pub fn preset(name: &str) -> Result<Preset> {
    Preset::find(name).with_context(|| {
        let known: Vec<String> = PRESETS.iter().map(|p| format!("{} ({})", p.name, p.hf_id)).collect();
        format!(
            "--model {name:?}: not a Qwen3 dense release vime knows; known: {}",
            known.join(", ")
        )
    })
}

/// The snapshot folder of `hf_id` in the hub cache `hub` (`models--Qwen--Qwen3-4B/snapshots/REV`,
/// REV from `refs/main` when present, else the only or newest snapshot holding a config.json).
pub fn find_cached(hub: &Path, hf_id: &str) -> Result<PathBuf> {
    let repo = hub.join(format!("models--{}", hf_id.replace('/', "--")));
    let snapshots = repo.join("snapshots");
    let how = format!(
        "get it with `hf download {hf_id}` (or `huggingface-cli download {hf_id}`), or pass --hf-checkpoint DIR; \
         vime never downloads at run time"
    );
    if let Ok(rev) = std::fs::read_to_string(repo.join("refs").join("main")) {
        let dir = snapshots.join(rev.trim());
        if dir.join("config.json").is_file() {
            return Ok(dir);
        }
    }
    let mut found: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(&snapshots)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path())
        .filter(|d| d.join("config.json").is_file())
        .map(|d| {
            let t = std::fs::metadata(&d)
                .and_then(|m| m.modified())
                .unwrap_or(std::time::UNIX_EPOCH);
            (t, d)
        })
        .collect();
    found.sort();
    match found.pop() {
        Some((_, d)) => Ok(d),
        None => bail!(
            "--model {hf_id}: no local copy in the Hugging Face cache (looked for {}/*/config.json); {how}",
            snapshots.display()
        ),
    }
}

/// `--device`: `auto` becomes `cuda` when this build has CUDA and the driver sees a GPU, else
/// `cpu`; anything else is returned as given.
pub fn device_name(flag: &str) -> String {
    if flag != "auto" {
        return flag.to_string();
    }
    if cuda_devices() > 0 {
        "cuda".into()
    } else {
        "cpu".into()
    }
}

/// GPUs the CUDA driver sees (0 in a build without CUDA), without creating a context.
pub fn cuda_devices() -> usize {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc::driver::result;
        if result::init().is_ok() {
            return result::device::get_count().map(|n| n.max(0) as usize).unwrap_or(0);
        }
    }
    0
}

/// `--dtype`: `auto` is bf16 on CUDA, f32 on the CPU.
pub fn dtype_name(flag: &str, device: &str) -> String {
    match flag {
        "auto" if device.starts_with("cuda") => "bf16".into(),
        "auto" => "f32".into(),
        other => other.into(),
    }
}

/// Megatron's shape flags against `cfg` (read from `source`): every given value must equal the
/// config's, and when any shape flag is given (a Megatron model spec) its switches must describe
/// this checkpoint (tied or untied embeddings, q/k norms, SwiGLU, RMSNorm, biases). Errors name
/// the flag, its value, the config key and the config's value.
pub fn check_shape(cfg: &Qwen3Config, shape: &ShapeFlags, source: &Path) -> Result<()> {
    if shape.values.is_empty() {
        return Ok(());
    }
    let cfg_path = source.join("config.json");
    let mut errors = Vec::new();
    let num = |v: &str| v.parse::<f64>().ok();
    for (flag, key, value) in &shape.values {
        let (name, want): (&str, String) = match key {
            ShapeKey::Layers => ("num_hidden_layers", cfg.num_hidden_layers.to_string()),
            ShapeKey::Hidden => ("hidden_size", cfg.hidden_size.to_string()),
            ShapeKey::Ffn => ("intermediate_size", cfg.intermediate_size.to_string()),
            ShapeKey::Heads => ("num_attention_heads", cfg.num_attention_heads.to_string()),
            ShapeKey::QueryGroups => ("num_key_value_heads", cfg.num_key_value_heads.to_string()),
            ShapeKey::KvChannels => ("head_dim", cfg.head_dim.to_string()),
            ShapeKey::RotaryBase => ("rope_theta", cfg.rope_theta.to_string()),
            ShapeKey::Vocab => ("vocab_size", cfg.vocab_size.to_string()),
            ShapeKey::NormEps => ("rms_norm_eps", cfg.rms_norm_eps.to_string()),
            ShapeKey::MaxPositions => ("max_position_embeddings", cfg.max_position_embeddings.to_string()),
            // Switches and fixed-choice flags are checked below.
            ShapeKey::Switch(_) => continue,
        };
        let same = match (num(value), num(&want)) {
            (Some(a), Some(b)) => (a - b).abs() <= 1e-12 * b.abs().max(1.0),
            _ => value == &want,
        };
        if !same {
            errors.push(format!("{flag} {value} but {} has {name} = {want}", cfg_path.display()));
        }
    }
    let has = |s: &str| shape.switches.iter().any(|x| x == s);
    let expect = |errors: &mut Vec<String>, switch: &str, wanted: bool, why: String| {
        if has(switch) != wanted {
            errors.push(if wanted {
                format!("{why}: add {switch} (Megatron would build the model without it)")
            } else {
                format!("{why}: remove {switch}")
            });
        }
    };
    let c = cfg_path.display();
    expect(
        &mut errors,
        "--untie-embeddings-and-output-weights",
        !cfg.tie_word_embeddings,
        format!("{c} has tie_word_embeddings = {}", cfg.tie_word_embeddings),
    );
    expect(
        &mut errors,
        "--qk-layernorm",
        true,
        "Qwen3 normalises q and k per head".into(),
    );
    expect(&mut errors, "--swiglu", true, "Qwen3's MLP is SwiGLU".into());
    if cfg.num_key_value_heads < cfg.num_attention_heads {
        expect(
            &mut errors,
            "--group-query-attention",
            true,
            format!(
                "{c} has {} key/value heads for {} query heads",
                cfg.num_key_value_heads, cfg.num_attention_heads
            ),
        );
    }
    if cfg.attention_bias {
        expect(
            &mut errors,
            "--add-qkv-bias",
            true,
            format!("{c} has attention_bias = true"),
        );
    } else if has("--add-qkv-bias") {
        errors.push(format!("--add-qkv-bias but {c} has attention_bias = false"));
    }
    if !errors.is_empty() {
        bail!(
            "the Megatron model flags do not describe the checkpoint {}:\n  {}",
            source.display(),
            errors.join("\n  ")
        );
    }
    Ok(())
}

/// `--model NAME` given with a checkpoint: the checkpoint must have the preset's shape.
pub fn check_preset(p: &Preset, cfg: &Qwen3Config, source: &Path) -> Result<()> {
    let want = p.config();
    let pairs = [
        ("hidden_size", want.hidden_size, cfg.hidden_size),
        ("intermediate_size", want.intermediate_size, cfg.intermediate_size),
        ("num_hidden_layers", want.num_hidden_layers, cfg.num_hidden_layers),
        ("num_attention_heads", want.num_attention_heads, cfg.num_attention_heads),
        ("num_key_value_heads", want.num_key_value_heads, cfg.num_key_value_heads),
        ("vocab_size", want.vocab_size, cfg.vocab_size),
    ];
    for (key, w, g) in pairs {
        if w != g {
            bail!(
                "--model {} is {} with {key} = {w}, but {} has {key} = {g}",
                p.name,
                p.hf_id,
                source.join("config.json").display()
            );
        }
    }
    Ok(())
}

/// A Megatron `torch_dist` checkpoint folder (what slime passes to `--ref-load` / `--load`):
/// `iter_*/` holding `.distcp` shards or `common.pt`, or those files at the top.
pub fn is_megatron_checkpoint(dir: &Path) -> bool {
    let has_dist = |d: &Path| {
        std::fs::read_dir(d).into_iter().flatten().flatten().any(|e| {
            let n = e.file_name().to_string_lossy().to_string();
            n.ends_with(".distcp") || n == "common.pt" || n == ".metadata" || n.starts_with("mp_rank_")
        })
    };
    if has_dist(dir) {
        return true;
    }
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| e.file_name().to_string_lossy().starts_with("iter_") && has_dist(&e.path()))
}

/// What a run settled before loading anything (printed at its start).
#[derive(Debug, Clone)]
pub struct Plan {
    /// `--init random`: the preset config to draw weights for.
    pub random_init: Option<Qwen3Config>,
    pub layout: Option<Layout>,
    /// The lines printed at start: what was resolved, then one notice per slime / Megatron flag.
    pub lines: Vec<String>,
}

/// `args` with everything `auto` or implied made concrete (device, dtype, the checkpoint of
/// `--model`, `--rollout-backend`, engines launched on the placement's rollout GPUs), and the
/// [`Plan`]. Reads config.json files only; loads no weights. Every error names its flag.
pub fn resolve(args: &TrainArgs) -> Result<(TrainArgs, Plan)> {
    let mut a = args.clone();
    let mut lines = Vec::new();
    a.device = device_name(&args.device);
    a.dtype = dtype_name(&args.dtype, &a.device);
    if args.device == "auto" || args.dtype == "auto" {
        lines.push(format!(
            "device: {} ({}), dtype {} ({})",
            a.device,
            if args.device == "auto" { "auto" } else { "given" },
            a.dtype,
            if args.dtype == "auto" { "auto" } else { "given" }
        ));
    }
    if !args.optimizer.eq_ignore_ascii_case("adam") {
        bail!(
            "--optimizer {:?}: vime's optimizer is AdamW (Megatron's `adam`, decoupled weight decay); pass --optimizer adam",
            args.optimizer
        );
    }
    match args.rollout_backend.as_deref().map(str::to_ascii_lowercase).as_deref() {
        None => {}
        Some("vllm") => a.rollout_engine = "vllm".into(),
        Some("sglang") => bail!(
            "--rollout-backend sglang: vime drives vLLM engines or its own engine, not SGLang; pass --rollout-backend vllm"
        ),
        Some(other) => bail!("--rollout-backend {other:?}: expected vllm"),
    }

    // The checkpoint.
    let random = match args.init.as_str() {
        "hf" => false,
        "random" => true,
        other => bail!("--init {other:?}: expected hf or random"),
    };
    let preset = args.model.as_deref().map(preset).transpose()?;
    if random && preset.is_none() {
        bail!("--init random needs --model NAME (the shape to draw weights for)");
    }
    if a.hf_checkpoint.is_none() {
        if let Some(p) = &preset {
            let resumable = match &args.load {
                Some(root) => crate::ckpt::latest_step(root)
                    .with_context(|| format!("reading the checkpoints in --load {}", root.display()))?
                    .is_some(),
                None => false,
            };
            if !resumable || random {
                let dir = find_cached(&hf_hub_cache(), p.hf_id)?;
                lines.push(format!(
                    "--model {}: {} from the Hugging Face cache",
                    p.name,
                    dir.display()
                ));
                a.hf_checkpoint = Some(dir);
            }
        }
    }
    for (flag, dir) in [
        ("--hf-checkpoint", &a.hf_checkpoint),
        ("--ref-load", &a.ref_load),
        ("--critic-load", &a.critic_load),
    ] {
        if let Some(d) = dir {
            if is_megatron_checkpoint(d) {
                bail!(
                    "{flag} {}: this is a Megatron torch_dist checkpoint; vime loads HF folders (config.json + safetensors): pass the HF checkpoint (--ref-load defaults to --hf-checkpoint)",
                    d.display()
                );
            }
        }
    }
    if let Some(root) = &a.load {
        if is_megatron_checkpoint(root) {
            bail!(
                "--load {}: this is a Megatron torch_dist checkpoint; vime resumes from its own checkpoints (--save) and starts from HF folders: pass the HF checkpoint as --hf-checkpoint and a fresh --load/--save folder",
                root.display()
            );
        }
    }
    // The config the shape flags describe: the preset under --init random, else the checkpoint the
    // run starts from (a --load checkpoint's own HF folder when it holds one).
    let resumed_hf = match &a.load {
        Some(root) => crate::ckpt::latest_step(root)
            .with_context(|| format!("reading the checkpoints in --load {}", root.display()))?
            .map(|s| root.join(crate::ckpt::iter_dir_name(s)).join("hf"))
            .filter(|d| d.join("config.json").is_file()),
        None => None,
    };
    let random_init = if random {
        let p = preset.expect("checked above");
        ensure!(
            resumed_hf.is_none(),
            "--init random with --load {}: that folder holds a checkpoint to resume; drop --init random",
            a.load.as_deref().unwrap_or(Path::new("")).display()
        );
        ensure!(
            a.rollout_engine != "vllm",
            "--init random with vLLM engines: the engines need a checkpoint to start from; use the built-in engine"
        );
        Some(p.config())
    } else {
        None
    };
    let source = resumed_hf.clone().or_else(|| a.hf_checkpoint.clone());
    if let Some(cfg) = &random_init {
        check_shape(cfg, &args.compat.shape, Path::new(preset.expect("random").name))?;
        lines.push(format!(
            "model: {} shape, random weights (--init random)",
            preset.expect("random").hf_id
        ));
    } else if let Some(dir) = &source {
        let path = dir.join("config.json");
        if path.is_file() {
            let cfg = Qwen3Config::from_file(&path)?;
            check_shape(&cfg, &args.compat.shape, dir)?;
            if let (Some(p), None) = (&preset, &resumed_hf) {
                check_preset(p, &cfg, dir)?;
            }
        }
    }

    // Placement.
    let p = &args.placement;
    let world = std::env::var("WORLD_SIZE").ok().and_then(|w| w.parse::<usize>().ok());
    let ranks = p
        .actor_num_gpus_per_node
        .or(args.parallel.nproc_per_node)
        .or(world)
        .unwrap_or(1);
    if let (Some(g), Some(n)) = (p.actor_num_gpus_per_node, args.parallel.nproc_per_node.or(world)) {
        ensure!(
            g == n,
            "--actor-num-gpus-per-node {g} but {n} ranks were started (--nproc-per-node or WORLD_SIZE): they must agree"
        );
    }
    let placed = p.actor_num_gpus_per_node.is_some() || p.rollout_num_gpus.is_some() || p.actor_num_nodes != 1;
    let layout = if placed {
        let visible = if a.device.starts_with("cuda") {
            Some(cuda_devices())
        } else {
            None
        };
        let l = Layout::new(
            p.actor_num_nodes,
            ranks,
            p.rollout_num_gpus,
            args.vllm.rollout_num_gpus_per_engine,
            args.sync.colocate,
            visible,
        )?;
        let mut line = l.describe();
        if !a.device.starts_with("cuda") {
            line.push_str(" [CPU run: the GPU numbers are not used]");
        }
        lines.push(line);
        if a.rollout_engine == "vllm" && a.vllm.vllm_urls.is_empty() && l.engines() > 0 {
            // slime's Ray starts the engines; vime launches them, each on its own GPUs.
            a.vllm.vllm_launch = true;
            a.vllm.vllm_num_engines = l.engines();
            a.vllm.vllm_gpus = Some(l.rollout.clone());
            if args.sync.colocate {
                a.vllm.vllm_enable_sleep_mode = true;
            }
            lines.push(format!(
                "engines: vime launches {} vLLM engine(s) (`{}`), tensor-parallel {} each",
                l.engines(),
                a.vllm.vllm_command,
                l.gpus_per_engine
            ));
        } else if a.rollout_engine == "embedded" && l.engines() > 0 && !l.colocate {
            lines.push(format!(
                "engines: the built-in engine serves in this process on the policy's device; the {} rollout GPU(s) are not used (pass --rollout-backend vllm to serve on them)",
                l.rollout.len()
            ));
        }
        Some(l)
    } else {
        None
    };
    if a.sync.colocate && a.rollout_engine == "embedded" {
        lines.push("--colocate: the built-in engine always shares the trainer's process and GPU (rank 0's)".into());
    }
    lines.extend(args.compat.notices.iter().cloned());
    Ok((
        a,
        Plan {
            random_init,
            layout,
            lines,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_snapshot_of_refs_main_is_found_and_a_missing_model_says_how_to_get_it() {
        let hub = tempfile::tempdir().unwrap();
        let repo = hub.path().join("models--Qwen--Qwen3-0.6B");
        for rev in ["aaa", "bbb"] {
            std::fs::create_dir_all(repo.join("snapshots").join(rev)).unwrap();
            std::fs::write(repo.join("snapshots").join(rev).join("config.json"), "{}").unwrap();
        }
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs").join("main"), "aaa\n").unwrap();
        let p = preset("Qwen/Qwen3-0.6B").unwrap();
        assert_eq!(p.name, "qwen3-0.6b");
        assert_eq!(
            find_cached(hub.path(), p.hf_id).unwrap(),
            repo.join("snapshots").join("aaa")
        );
        let e = format!("{:#}", find_cached(hub.path(), "Qwen/Qwen3-4B").unwrap_err());
        assert!(
            e.contains("models--Qwen--Qwen3-4B")
                && e.contains("hf download Qwen/Qwen3-4B")
                && e.contains("--hf-checkpoint"),
            "{e}"
        );
        let e = format!("{:#}", preset("qwen3-5b").unwrap_err());
        assert!(e.contains("qwen3-5b") && e.contains("qwen3-4b (Qwen/Qwen3-4B)"), "{e}");
        let names: Vec<&str> = PRESETS.iter().map(|p| p.name).collect();
        assert_eq!(names, vime_qwen3::config::PRESET_NAMES, "every preset has an HF id");
        for name in ["qwen3-4b", "Qwen3-4B", "qwen/qwen3-4b"] {
            assert_eq!(preset(name).unwrap().hf_id, "Qwen/Qwen3-4B", "{name}");
        }
    }

    #[test]
    fn random_init_needs_a_preset_and_the_built_in_engine() {
        let args = |extra: &[&str]| {
            let mut v = vec!["--prompt-data", "/p.jsonl", "--num-rollout", "1", "--rm-type", "math"];
            v.extend_from_slice(extra);
            TrainArgs::from_flags(v).unwrap()
        };
        let e = |a: TrainArgs| format!("{:#}", resolve(&a).unwrap_err());
        assert!(e(args(&["--init", "random"])).contains("--init random needs --model NAME"));
        assert!(e(args(&["--init", "zeros"])).contains("--init \"zeros\""));
        let err = e(args(&[
            "--init",
            "random",
            "--model",
            "qwen3-4b",
            "--rollout-backend",
            "vllm",
        ]));
        // Without a cached copy the tokenizer cannot be found; with one, vLLM engines are refused.
        assert!(
            err.contains("no local copy") || err.contains("need a checkpoint"),
            "{err}"
        );
        assert!(e(args(&["--optimizer", "sgd"])).contains("--optimizer \"sgd\": vime's optimizer is AdamW"));
        assert!(e(args(&["--rollout-backend", "sglang"])).contains("not SGLang"));
    }

    #[test]
    fn auto_dtype_follows_the_device() {
        assert_eq!(dtype_name("auto", "cuda:1"), "bf16");
        assert_eq!(dtype_name("auto", "cpu"), "f32");
        assert_eq!(dtype_name("f16", "cpu"), "f16");
        assert_eq!(device_name("cuda:3"), "cuda:3");
        if !candle_core::utils::cuda_is_available() {
            assert_eq!(device_name("auto"), "cpu");
        }
    }
}
