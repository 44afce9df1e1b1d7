//! Exact resume. A small deterministic training loop (synthetic token data with a shuffled epoch
//! order, per-step random sample weights from the trainer's RNG, dynamic micro-batches with
//! gradient accumulation, clipping, AdamW with a warmup+cosine schedule) runs in child processes:
//!
//! - straight: 6 steps in one process, checkpoints at 3 and 6;
//! - split: 3 steps and exit; a FRESH process resumes from `latest` and runs 3 more;
//! - killed: like split, but the second process is aborted in the middle of writing the step-6
//!   checkpoint (`VIME_FAULT_INJECT`), which must leave step 3 as `latest` and loadable; a third
//!   process then resumes from step 3 and finishes.
//!
//! The step-6 checkpoints of all three must be equal bit for bit: HF weights, fp32 master weights
//! and Adam moments, step, optimizer step, data cursor and RNG state.
use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use vime_kernels::testing::Rng;
use vime_qwen3::batch::PackedBatch;
use vime_qwen3::model::{Qwen3, Recompute};
use vime_trainer::batching::pack_micro_batches;
use vime_trainer::ckpt::{self, CheckpointContents, DataCursor, TrainState};
use vime_trainer::optim::{clip_grad_norm, AdamW, GradAccumulator, LrDecayStyle, LrScheduler, OptimizerArgs};

const CHILD_ENV: &str = "VIME_RESUME_CHILD";
const GLOBAL_BATCH: usize = 4;
const MAX_TOKENS_PER_GPU: usize = 24;
const SAVE_INTERVAL: u64 = 3;

fn fixture_model() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/hf/tied_gqa")
}

/// A fixed synthetic dataset: 10 sequences of 3..=12 tokens.
fn dataset() -> Vec<Vec<u32>> {
    let mut rng = Rng::new(42);
    (0..10)
        .map(|_| {
            let len = 3 + (rng.next_u64() % 10) as usize;
            (0..len).map(|_| (rng.next_u64() % 160) as u32).collect()
        })
        .collect()
}

/// Epoch order: a Fisher-Yates shuffle seeded by (seed, epoch), so the cursor alone locates us.
fn epoch_order(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut rng = Rng::new(seed.wrapping_mul(1_000_003).wrapping_add(epoch));
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    order
}

fn next_samples(cursor: &mut DataCursor, n: usize, k: usize) -> Vec<usize> {
    let mut out = Vec::with_capacity(k);
    while out.len() < k {
        if cursor.offset as usize >= n {
            cursor.epoch += 1;
            cursor.offset = 0;
        }
        out.push(epoch_order(n, cursor.seed, cursor.epoch)[cursor.offset as usize]);
        cursor.offset += 1;
    }
    out
}

fn optimizer_args() -> OptimizerArgs {
    OptimizerArgs {
        lr: 3e-3,
        min_lr: 3e-4,
        lr_decay_style: LrDecayStyle::Cosine,
        lr_decay_iters: Some(6),
        lr_warmup_iters: 2,
        weight_decay: 0.1,
        clip_grad: 0.5,
        ..OptimizerArgs::default()
    }
}

/// Runs the loop up to `total_steps`, resuming from `root`'s latest checkpoint if there is one.
fn train(root: &Path, total_steps: u64, stop_after: Option<u64>) -> Result<()> {
    let data = dataset();
    let (model, mut opt, mut state) = match ckpt::load_latest(root, &Device::Cpu)? {
        Some(loaded) => {
            let model = Qwen3::load_hf(&loaded.hf_dir(), DType::F32, &Device::Cpu)?;
            let mut opt = AdamW::new(model.named_parameters(), &optimizer_args())?;
            opt.load_state_tensors(&loaded.optimizer, loaded.state.optimizer_step)?;
            (model, opt, loaded.state)
        }
        None => {
            let model = Qwen3::load_hf(&fixture_model(), DType::F32, &Device::Cpu)?;
            let opt = AdamW::new(model.named_parameters(), &optimizer_args())?;
            let state = TrainState {
                rng: Rng::new(7).state(),
                data: DataCursor {
                    seed: 1234,
                    ..Default::default()
                },
                ..Default::default()
            };
            (model, opt, state)
        }
    };
    let sched = LrScheduler::new(&optimizer_args())?;
    let mut rng = Rng::from_state(state.rng);
    let mut steps_here = 0;
    while state.step < total_steps && stop_after.is_none_or(|s| steps_here < s) {
        let picked = next_samples(&mut state.data, data.len(), GLOBAL_BATCH);
        let weights: Vec<f64> = picked.iter().map(|_| rng.normal()).collect();
        let lengths: Vec<usize> = picked.iter().map(|&i| data[i].len()).collect();
        let mut acc = GradAccumulator::new();
        for mb in pack_micro_batches(&lengths, MAX_TOKENS_PER_GPU)? {
            let seqs: Vec<&[u32]> = mb.iter().map(|&j| data[picked[j]].as_slice()).collect();
            let batch = PackedBatch::from_sequences(&seqs)?;
            // per-token weight: the sample's weight over its scored tokens and the global batch
            let mut w = Vec::with_capacity(batch.num_tokens());
            for &j in &mb {
                let len = data[picked[j]].len();
                w.extend(std::iter::repeat_n(
                    (weights[j] / (len - 1) as f64 / GLOBAL_BATCH as f64) as f32,
                    len - 1,
                ));
                w.push(0.0);
            }
            let w = Tensor::from_vec(w, batch.num_tokens(), &Device::Cpu)?;
            let (_loss, grads) =
                model.forward_backward(&batch, Recompute::Full, |o| Ok((&o.logprobs * &w)?.sum_all()?.neg()?))?;
            acc.add(&grads.params)?;
        }
        let mut grads = acc.take();
        clip_grad_norm(&mut grads, optimizer_args().clip_grad)?;
        opt.step(&grads, sched.lr_at(opt.num_steps()))?;
        state.step += 1;
        state.optimizer_step = opt.num_steps();
        state.rng = rng.state();
        steps_here += 1;
        if state.step % SAVE_INTERVAL == 0 {
            let optimizer = opt.state_tensors()?;
            let extra = BTreeMap::new();
            let contents = CheckpointContents {
                state: &state,
                model: &model,
                model_dtype: DType::F32,
                optimizer: &optimizer,
                extra_tensors: &extra,
                tokenizer_dir: None,
                critic: None,
            };
            ckpt::save(root, &contents)?;
        }
    }
    Ok(())
}

/// The child side: does nothing unless the parent set `VIME_RESUME_CHILD=root;total;stop_after`.
#[test]
fn resume_child() -> Result<()> {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return Ok(());
    };
    let parts: Vec<&str> = spec.split(';').collect();
    let stop_after = parts[2].parse::<u64>().ok();
    train(Path::new(parts[0]), parts[1].parse()?, stop_after)
}

fn child(root: &Path, total: u64, stop_after: Option<u64>, fault: bool) -> std::process::ExitStatus {
    let spec = format!(
        "{};{total};{}",
        root.display(),
        stop_after.map(|s| s.to_string()).unwrap_or_default()
    );
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["--exact", "resume_child", "--test-threads", "1", "--nocapture"])
        .env(CHILD_ENV, spec);
    if fault {
        cmd.env("VIME_FAULT_INJECT", "ckpt-abort-before-rename");
    } else {
        cmd.env_remove("VIME_FAULT_INJECT");
    }
    // the child's own test-harness lines stay out of this test's output; its errors go to stderr
    cmd.stdout(std::process::Stdio::null())
        .status()
        .expect("spawning the child test process")
}

fn tensors(path: &Path) -> BTreeMap<String, Vec<u32>> {
    candle_core::safetensors::load(path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("loading {}: {e}", path.display()))
        .into_iter()
        .map(|(n, t)| {
            let bits = t
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect();
            (n, bits)
        })
        .collect()
}

fn assert_same_checkpoint(a: &Path, b: &Path) {
    for file in ["hf/model.safetensors", "optimizer.safetensors"] {
        let (ta, tb) = (tensors(&a.join(file)), tensors(&b.join(file)));
        assert_eq!(
            ta.keys().collect::<Vec<_>>(),
            tb.keys().collect::<Vec<_>>(),
            "{file}: tensor names"
        );
        for (name, bits) in &ta {
            assert!(
                bits == &tb[name],
                "{file}: {name} differs between {} and {}",
                a.display(),
                b.display()
            );
        }
    }
    let sa: TrainState = serde_json::from_slice(&std::fs::read(a.join("state.json")).unwrap()).unwrap();
    let sb: TrainState = serde_json::from_slice(&std::fs::read(b.join("state.json")).unwrap()).unwrap();
    assert_eq!(sa, sb, "loop state (step, optimizer step, data cursor, RNG)");
}

#[test]
fn resume_in_a_fresh_process_is_bit_exact_and_a_killed_save_keeps_the_previous_checkpoint() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (straight, split, killed) = (
        tmp.path().join("straight"),
        tmp.path().join("split"),
        tmp.path().join("killed"),
    );

    assert!(child(&straight, 6, None, false).success(), "straight run failed");
    assert_eq!(ckpt::latest_step(&straight).unwrap(), Some(6));

    assert!(child(&split, 6, Some(3), false).success(), "first half failed");
    assert_eq!(ckpt::latest_step(&split).unwrap(), Some(3));
    assert_same_checkpoint(&straight.join("iter_0000003"), &split.join("iter_0000003"));
    assert!(child(&split, 6, None, false).success(), "resumed half failed");
    assert_eq!(ckpt::latest_step(&split).unwrap(), Some(6));
    assert_same_checkpoint(&straight.join("iter_0000006"), &split.join("iter_0000006"));

    assert!(child(&killed, 6, Some(3), false).success());
    let status = child(&killed, 6, None, true);
    assert!(!status.success(), "the fault-injected save must kill the process");
    assert_eq!(
        ckpt::latest_step(&killed).unwrap(),
        Some(3),
        "latest must still name the last complete checkpoint"
    );
    assert!(
        killed.join(".tmp-iter_0000006").exists(),
        "the killed save got as far as its temp folder"
    );
    assert!(
        !killed.join("iter_0000006").exists(),
        "no half checkpoint under the final name"
    );
    let loaded = ckpt::load_latest(&killed, &Device::Cpu)
        .unwrap()
        .expect("step 3 is loadable");
    assert_eq!(loaded.state.step, 3);
    Qwen3::load_hf(&loaded.hf_dir(), DType::F32, &Device::Cpu).expect("step-3 model loads");
    assert!(
        child(&killed, 6, None, false).success(),
        "resume after the killed save failed"
    );
    assert!(
        !killed.join(".tmp-iter_0000006").exists(),
        "the stale temp folder is cleaned up"
    );
    assert_same_checkpoint(&straight.join("iter_0000006"), &killed.join("iter_0000006"));
}

#[test]
fn a_corrupt_latest_pointer_is_a_clear_error() {
    if std::env::var(CHILD_ENV).is_ok() {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join(ckpt::LATEST_FILE), "ten").unwrap();
    let e = ckpt::load_latest(tmp.path(), &Device::Cpu).err().unwrap().to_string();
    assert!(
        e.contains("latest_checkpointed_iteration.txt") && e.contains("\"ten\""),
        "{e}"
    );
    std::fs::write(tmp.path().join(ckpt::LATEST_FILE), "10").unwrap();
    let e = ckpt::load_latest(tmp.path(), &Device::Cpu).err().unwrap().to_string();
    assert!(e.contains("iter_0000010") && e.contains("does not exist"), "{e}");
}
