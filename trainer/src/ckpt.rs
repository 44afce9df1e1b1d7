//! Training checkpoints: the model in HF layout, the optimizer state and the loop state, written
//! atomically, and found again on resume.
//!
//! Layout under `--save DIR` (Megatron's names, so slime users recognise it):
//!   DIR/iter_0000010/hf/                 config.json + safetensors: loads in HF transformers / vLLM
//!   DIR/iter_0000010/optimizer.safetensors   fp32 master weights and Adam moments by HF name
//!   DIR/iter_0000010/extra.safetensors       other tensors (critic value head, ...), optional
//!   DIR/iter_0000010/state.json          step, rollout id, data cursor, RNG state, anything else
//!   DIR/iter_0000010/critic/             PPO only: the critic (HF backbone + value head)
//!   DIR/iter_0000010/critic_optimizer.safetensors   PPO only: the critic's master weights and moments
//!   DIR/latest_checkpointed_iteration.txt    "10": written last
//!
//! Atomicity: everything is written into `DIR/.tmp-iter_0000010`, every file fsynced, the folder
//! renamed to `iter_0000010` and `DIR` fsynced, and only then is the `latest` pointer replaced
//! (temp file, fsync, rename). A crash at any point leaves the previous pointer naming a complete
//! checkpoint; a stale temp folder from a crashed save is removed by the next save.
//!
//! `VIME_FAULT_INJECT=ckpt-abort-before-rename` aborts the process after the files are written and
//! before the rename: the resume tests use it to kill a save midway for real. The fault-matrix
//! tests SIGKILL it at three more points (`crate::train::fault`): `save-files` (`hf/` written,
//! the optimizer state not), `save-renamed`, `save-latest`.
//!
//! Errors name the file or folder that failed (a full disk, a read-only `--save`), and a failed
//! save leaves the previous checkpoint as `latest`; its temp folder is removed by the next save.
use crate::critic::Critic;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use vime_qwen3::checkpoint::{copy_tokenizer_files, DEFAULT_MAX_SHARD_BYTES};
use vime_qwen3::model::Qwen3;

pub const LATEST_FILE: &str = "latest_checkpointed_iteration.txt";

/// Where the prompt data stands: epoch, position in the (shuffled) order, and the shuffle seed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataCursor {
    pub epoch: u64,
    pub offset: u64,
    pub seed: u64,
}

/// The loop state saved beside the weights. `rng` is the trainer's generator state (a plain
/// integer state, so resume reproduces every later draw); `extra` carries whatever the loop adds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    pub step: u64,
    pub rollout_id: u64,
    pub data: DataCursor,
    pub rng: u64,
    #[serde(default)]
    pub optimizer_step: u64,
    #[serde(default)]
    pub extra: serde_json::Value,
}

/// What a save writes.
pub struct CheckpointContents<'a> {
    pub state: &'a TrainState,
    pub model: &'a Qwen3,
    /// Dtype of the HF weights on disk (the model's own dtype keeps resume exact).
    pub model_dtype: DType,
    pub optimizer: &'a BTreeMap<String, Tensor>,
    pub extra_tensors: &'a BTreeMap<String, Tensor>,
    /// Tokenizer files (`tokenizer.json`, ...) copied from here into `hf/`, so the folder serves
    /// and loads as it is.
    pub tokenizer_dir: Option<&'a Path>,
    /// The PPO critic and its optimizer state.
    pub critic: Option<(&'a Critic, &'a BTreeMap<String, Tensor>)>,
}

/// A checkpoint found on disk.
pub struct Loaded {
    pub dir: PathBuf,
    pub state: TrainState,
    pub optimizer: BTreeMap<String, Tensor>,
    pub extra_tensors: BTreeMap<String, Tensor>,
    /// Empty when the checkpoint has no critic.
    pub critic_optimizer: BTreeMap<String, Tensor>,
}

impl Loaded {
    /// The HF-layout model folder of this checkpoint.
    pub fn hf_dir(&self) -> PathBuf {
        self.dir.join("hf")
    }

    /// The critic's folder, when the checkpoint has one.
    pub fn critic_dir(&self) -> Option<PathBuf> {
        let d = self.dir.join("critic");
        d.is_dir().then_some(d)
    }
}

pub fn iter_dir_name(step: u64) -> String {
    format!("iter_{step:07}")
}

fn fsync_dir(dir: &Path) -> Result<()> {
    fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .with_context(|| format!("fsync {}", dir.display()))
}

fn fsync_tree(dir: &Path) -> Result<()> {
    for entry in fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            fsync_tree(&path)?;
        } else {
            fs::File::open(&path)
                .and_then(|f| f.sync_all())
                .with_context(|| format!("fsync {}", path.display()))?;
        }
    }
    fsync_dir(dir)
}

fn write_safetensors(path: &Path, tensors: &BTreeMap<String, Tensor>) -> Result<()> {
    let cpu: Vec<(String, Tensor)> = tensors
        .iter()
        .map(|(n, t)| Ok((n.clone(), t.to_device(&Device::Cpu)?.contiguous()?)))
        .collect::<Result<_>>()?;
    safetensors::serialize_to_file(cpu.iter().map(|(n, t)| (n.as_str(), t)), None, path)
        .with_context(|| format!("writing {}", path.display()))
}

/// Fails at the start of a run, naming the folder, when `root` cannot take checkpoints (read-only,
/// not a folder, no permission): a temp file is created there and removed. A full disk still
/// shows only at a save.
pub fn check_save_dir(root: &Path) -> Result<()> {
    fs::create_dir_all(root).with_context(|| format!("creating the checkpoint folder --save {}", root.display()))?;
    let probe = root.join(format!(".write-test-{}", std::process::id()));
    fs::write(&probe, b"")
        .and_then(|_| fs::remove_file(&probe))
        .with_context(|| format!("the checkpoint folder --save {} is not writable", root.display()))
}

/// Writes a checkpoint for `contents.state.step` under `root` and points `latest` at it.
/// Returns the checkpoint folder.
pub fn save(root: &Path, contents: &CheckpointContents) -> Result<PathBuf> {
    let step = contents.state.step;
    fs::create_dir_all(root).with_context(|| format!("creating the checkpoint folder {}", root.display()))?;
    let name = iter_dir_name(step);
    let tmp = root.join(format!(".tmp-{name}"));
    if tmp.exists() {
        fs::remove_dir_all(&tmp).with_context(|| format!("removing a stale {}", tmp.display()))?;
    }
    fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    let hf = tmp.join("hf");
    contents
        .model
        .save_hf(&hf, contents.model_dtype, DEFAULT_MAX_SHARD_BYTES)
        .with_context(|| format!("writing the model to {}", hf.display()))?;
    if let Some(tok) = contents.tokenizer_dir {
        copy_tokenizer_files(tok, &hf).with_context(|| format!("copying the tokenizer files to {}", hf.display()))?;
    }
    crate::train::fault::at("save-files")?;
    write_safetensors(&tmp.join("optimizer.safetensors"), contents.optimizer)?;
    if let Some((critic, critic_opt)) = contents.critic {
        let dir = tmp.join("critic");
        critic
            .save(&dir, contents.model_dtype, DEFAULT_MAX_SHARD_BYTES)
            .with_context(|| format!("writing the critic to {}", dir.display()))?;
        write_safetensors(&tmp.join("critic_optimizer.safetensors"), critic_opt)?;
    }
    if !contents.extra_tensors.is_empty() {
        write_safetensors(&tmp.join("extra.safetensors"), contents.extra_tensors)?;
    }
    let state_path = tmp.join("state.json");
    fs::write(&state_path, serde_json::to_vec_pretty(contents.state)?)
        .with_context(|| format!("writing {}", state_path.display()))?;
    fsync_tree(&tmp)?;
    if std::env::var("VIME_FAULT_INJECT").as_deref() == Ok("ckpt-abort-before-rename") {
        eprintln!("VIME_FAULT_INJECT: aborting while saving {}", tmp.display());
        std::process::abort();
    }
    let dst = root.join(&name);
    if dst.exists() {
        // Re-saving a step (e.g. after a resume): the new one replaces it only once complete.
        let old = root.join(format!(".old-{name}"));
        let _ = fs::remove_dir_all(&old);
        fs::rename(&dst, &old).with_context(|| format!("renaming {} to {}", dst.display(), old.display()))?;
        fs::rename(&tmp, &dst).with_context(|| format!("renaming {} to {}", tmp.display(), dst.display()))?;
        fs::remove_dir_all(&old).with_context(|| format!("removing {}", old.display()))?;
    } else {
        fs::rename(&tmp, &dst).with_context(|| format!("renaming {} to {}", tmp.display(), dst.display()))?;
    }
    fsync_dir(root)?;
    crate::train::fault::at("save-renamed")?;
    let ptr_tmp = root.join(format!(".{LATEST_FILE}.tmp"));
    let latest = root.join(LATEST_FILE);
    (|| -> std::io::Result<()> {
        fs::write(&ptr_tmp, step.to_string())?;
        fs::File::open(&ptr_tmp)?.sync_all()
    })()
    .with_context(|| format!("writing {}", ptr_tmp.display()))?;
    crate::train::fault::at("save-latest")?;
    fs::rename(&ptr_tmp, &latest).with_context(|| format!("renaming {} to {}", ptr_tmp.display(), latest.display()))?;
    fsync_dir(root)?;
    Ok(dst)
}

/// The step that `root/latest_checkpointed_iteration.txt` names, if any.
pub fn latest_step(root: &Path) -> Result<Option<u64>> {
    let p = root.join(LATEST_FILE);
    if !p.exists() {
        return Ok(None);
    }
    let text = fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
    let step = text
        .trim()
        .parse::<u64>()
        .with_context(|| format!("{}: expected an iteration number, found {:?}", p.display(), text.trim()))?;
    Ok(Some(step))
}

/// Loads the checkpoint that `latest` names under `root` (None when there is none yet). Tensors
/// come back on `device`; the model itself is loaded by the caller from [`Loaded::hf_dir`].
pub fn load_latest(root: &Path, device: &Device) -> Result<Option<Loaded>> {
    match latest_step(root)? {
        Some(step) => load_step(root, step, device).map(Some),
        None => Ok(None),
    }
}

pub fn load_step(root: &Path, step: u64, device: &Device) -> Result<Loaded> {
    let dir = root.join(iter_dir_name(step));
    if !dir.is_dir() {
        bail!(
            "checkpoint {} named by {} does not exist",
            dir.display(),
            root.join(LATEST_FILE).display()
        );
    }
    let state_path = dir.join("state.json");
    let state: TrainState =
        serde_json::from_slice(&fs::read(&state_path).with_context(|| format!("reading {}", state_path.display()))?)
            .with_context(|| format!("parsing {}", state_path.display()))?;
    if state.step != step {
        bail!(
            "{} says step {} but sits in {}",
            state_path.display(),
            state.step,
            dir.display()
        );
    }
    let load = |name: &str| -> Result<BTreeMap<String, Tensor>> {
        let p = dir.join(name);
        if !p.exists() {
            return Ok(BTreeMap::new());
        }
        Ok(candle_core::safetensors::load(&p, device)
            .with_context(|| format!("reading {}", p.display()))?
            .into_iter()
            .collect())
    };
    let optimizer = load("optimizer.safetensors")?;
    let extra_tensors = load("extra.safetensors")?;
    let critic_optimizer = load("critic_optimizer.safetensors")?;
    Ok(Loaded {
        dir,
        state,
        optimizer,
        extra_tensors,
        critic_optimizer,
    })
}

/// Delayed FP8 scaling's amax histories in a checkpoint (`--fp8-recipe delayed`): each rank's
/// state of each model (`policy`, `critic`), in `extra.safetensors` as
/// `fp8_amax_history.<model>.rank<r>` (f32 `[roles, 2 + history_len]`) and
/// `fp8_amax_seeded.<model>.rank<r>` (u8 `[roles]`). Per rank, because each rank's activations
/// and gradients are its own (data, context and tensor parallelism).
pub mod fp8_amax {
    use crate::train::parallel::{decode_scores, encode_scores};
    use anyhow::{bail, Context, Result};
    use candle_core::{DType, Device, Tensor};
    use std::collections::BTreeMap;
    use vime_dist::Collectives;
    use vime_qwen3::model::{Fp8AmaxState, Qwen3};

    fn keys(model: &str, rank: usize) -> (String, String) {
        (
            format!("fp8_amax_history.{model}.rank{rank}"),
            format!("fp8_amax_seeded.{model}.rank{rank}"),
        )
    }

    /// Every rank's state of `model` (this process's `m`) gathered over `world`, as the extra
    /// tensors rank 0 writes. Every rank calls it. Nothing for a rank without a history. On the
    /// wire a state is two f32 vectors (`encode_scores`): the rows, and 1 or 0 a role for seeded.
    pub fn gather(world: &dyn Collectives, name: &str, m: &Qwen3) -> Result<BTreeMap<String, Tensor>> {
        let mine = match m.fp8_amax_state()? {
            Some(s) => encode_scores(&[s.rows, s.seeded.iter().map(|&x| f32::from(u8::from(x))).collect()]),
            None => Vec::new(),
        };
        let all = world
            .all_gather_bytes(&mine)
            .with_context(|| format!("gathering the ranks' FP8 amax histories of the {name}"))?;
        let mut out = BTreeMap::new();
        for (r, b) in all.iter().enumerate() {
            let bad = || format!("rank {r}'s FP8 amax history of the {name}");
            let vs = decode_scores(b).with_context(bad)?;
            let [rows, seeded] = match <[Vec<f32>; 2]>::try_from(vs) {
                Ok(v) => v,
                Err(vs) if vs.is_empty() => continue,
                Err(vs) => bail!("{}: {} vectors, not 2 (rows, seeded)", bad(), vs.len()),
            };
            let roles = seeded.len();
            if roles == 0 || rows.len() % roles != 0 {
                bail!("{}: {} values for {roles} roles", bad(), rows.len());
            }
            let (hk, sk) = keys(name, r);
            let width = rows.len() / roles;
            out.insert(hk, Tensor::from_vec(rows, (roles, width), &Device::Cpu)?);
            let seeded: Vec<u8> = seeded.iter().map(|&x| u8::from(x != 0.0)).collect();
            out.insert(sk, Tensor::from_vec(seeded, roles, &Device::Cpu)?);
        }
        Ok(out)
    }

    /// Restores rank `rank`'s history of `model` into `m` (whose kernel config has delayed
    /// scaling) from a checkpoint's extra tensors. `Ok(false)` when the checkpoint has none for
    /// this rank (saved without delayed scaling, or by fewer ranks): the histories start over.
    pub fn restore(extra: &BTreeMap<String, Tensor>, name: &str, rank: usize, m: &Qwen3) -> Result<bool> {
        let Some(config) = m.kernel_config().fp8_delayed() else {
            return Ok(false);
        };
        let (hk, sk) = keys(name, rank);
        let (Some(h), Some(s)) = (extra.get(&hk), extra.get(&sk)) else {
            return Ok(false);
        };
        let (_, width) = h.dims2().with_context(|| format!("the checkpoint's {hk}"))?;
        if width != 2 + config.history_len {
            bail!(
                "the checkpoint's FP8 amax history ({hk}) keeps {} amaxes a role; this run's \
                 --fp8-amax-history-len is {}",
                width.saturating_sub(2),
                config.history_len
            );
        }
        let state = Fp8AmaxState {
            config,
            rows: h.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
            seeded: s
                .to_dtype(DType::U8)?
                .to_vec1::<u8>()?
                .into_iter()
                .map(|b| b != 0)
                .collect(),
        };
        m.load_fp8_amax_state(&state)
            .with_context(|| format!("restoring the {name}'s FP8 amax history from {hk}"))?;
        Ok(true)
    }
}
