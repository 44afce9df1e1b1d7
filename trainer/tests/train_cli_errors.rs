//! Bad input to `vime-train` fails with an error that names what to fix (the file and line, the
//! flag, the tensor, the URL) and leaves what is on disk as it was.
//!
//! Each test runs `TrainArgs::from_flags` + `train::run` in process, as the binary does (one also
//! runs the binary, for its exit status and `error:` line). Runs that get past flag validation use
//! a tiny random Qwen3 with the real tokenizer (`tests/assets/qwen3-tokenizer`).
use anyhow::Result;
use candle_core::{DType, Device};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use vime_qwen3::checkpoint::copy_tokenizer_files;
use vime_qwen3::config::Qwen3Config;
use vime_qwen3::model::Qwen3;
use vime_trainer::train::{self, TrainArgs};

fn assets() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/assets")
}

fn tiny_qwen3(dir: &Path, vocab_size: usize) -> Result<()> {
    let mut cfg = Qwen3Config::preset("qwen3-0.6b")?;
    cfg.vocab_size = vocab_size;
    cfg.hidden_size = 32;
    cfg.intermediate_size = 64;
    cfg.num_hidden_layers = 1;
    cfg.max_window_layers = 1;
    cfg.num_attention_heads = 2;
    cfg.num_key_value_heads = 1;
    cfg.head_dim = 16;
    cfg.dtype = Some("float32".into());
    Qwen3::init_random(cfg, 0.02, 3, DType::F32, &Device::Cpu)?.save_hf(dir, DType::F32, u64::MAX)?;
    copy_tokenizer_files(&assets().join("qwen3-tokenizer"), dir)?;
    Ok(())
}

/// A model with the real vocabulary, in `root/model`.
fn model_in(root: &Path) -> Result<PathBuf> {
    let dir = root.join("model");
    tiny_qwen3(&dir, 151936)?;
    Ok(dir)
}

fn write(path: &Path, text: &str) -> Result<String> {
    std::fs::write(path, text)?;
    Ok(path.display().to_string())
}

const GOOD_ROWS: &str = "{\"prompt\": \"1+1=\", \"label\": \"2\"}\n{\"prompt\": \"2+2=\", \"label\": \"4\"}\n";

/// A complete GRPO run's flags (that would succeed), with `set` applied: each `--flag value` (or
/// lone `--switch`) in `set` replaces the same flag's value, or is added.
fn flags(model: &str, prompts: &str, set: &[&str]) -> Vec<String> {
    let mut f: Vec<String> = [
        "--hf-checkpoint",
        model,
        "--prompt-data",
        prompts,
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--rm-type",
        "math",
        "--num-rollout",
        "1",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--rollout-max-response-len",
        "4",
        "--no-progress",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut i = 0;
    while i < set.len() {
        let flag = set[i];
        let value = set.get(i + 1).filter(|v| !v.starts_with("--"));
        i += 1 + value.is_some() as usize;
        match (f.iter().position(|s| s == flag), value) {
            (Some(at), Some(v)) => f[at + 1] = v.to_string(),
            (Some(_), None) => {}
            (None, v) => f.extend(std::iter::once(flag).chain(v.copied()).map(str::to_string)),
        }
    }
    f
}

/// `f` without `flag` and its value.
fn without(mut f: Vec<String>, flag: &str) -> Vec<String> {
    let at = f
        .iter()
        .position(|s| s == flag)
        .unwrap_or_else(|| panic!("no {flag} in {f:?}"));
    f.drain(at..at + 2);
    f
}

/// The error (with its whole context chain) of a run with these flags.
fn run_error(flags: Vec<String>) -> String {
    let result = TrainArgs::from_flags(flags).and_then(|a| train::run(&a));
    match result {
        Ok(s) => panic!("expected an error, but the run finished at step {}", s.final_step),
        Err(e) => format!("{e:#}"),
    }
}

fn assert_mentions(err: &str, needles: &[&str]) {
    for n in needles {
        assert!(err.contains(n), "the error does not mention {n:?}:\n{err}");
    }
}

/// Files under `dir` with their contents, to check that a failed run changed nothing.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push((p.clone(), std::fs::read(&p).unwrap()));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn malformed_prompt_jsonl_names_the_file_and_line() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let model = model_in(tmp.path())?;
    let prompts = write(
        &tmp.path().join("prompts.jsonl"),
        &format!("{GOOD_ROWS}\n{{\"prompt\": \"3+3=\", \"label\": \n"),
    )?;
    // An earlier run's log in --save: a failed start must not truncate it.
    let save = tmp.path().join("run");
    std::fs::create_dir_all(&save)?;
    std::fs::write(
        save.join("metrics.jsonl"),
        "{\"step\": 1, \"time\": 0, \"rollout/raw_reward\": 0.5}\n",
    )?;
    let before = snapshot(&save);
    let err = run_error(flags(
        &model.display().to_string(),
        &prompts,
        &["--save", &save.display().to_string()],
    ));
    // Line 3 is blank (skipped); the bad row is line 4.
    assert_mentions(&err, &[&format!("{prompts}:4"), "invalid JSON"]);
    assert_eq!(snapshot(&save), before, "a failed start changed --save");

    // The same in an eval set: the set's name, the file and the line.
    let eval = write(
        &tmp.path().join("eval.jsonl"),
        "{\"prompt\": \"x\", \"label\": \"1\"}\n[1, 2]\n",
    )?;
    let good = write(&tmp.path().join("good.jsonl"), GOOD_ROWS)?;
    let err = run_error(flags(
        &model.display().to_string(),
        &good,
        &["--eval-prompt-data", "arith", &eval, "--eval-interval", "1"],
    ));
    assert_mentions(&err, &["--eval-prompt-data arith", &format!("{eval}:2"), "JSON object"]);
    Ok(())
}

#[test]
fn missing_keys_name_the_file_line_and_flag() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let model = model_in(tmp.path())?;
    let model = model.display().to_string();
    let prompts = write(
        &tmp.path().join("sft.jsonl"),
        "{\"prompt\": \"1+1=\", \"answer\": \"2\"}\n{\"prompt\": \"2+2=\"}\n",
    )?;
    // SFT's label key is missing on line 2.
    let err = run_error(flags(
        &model,
        &prompts,
        &["--loss-type", "sft_loss", "--label-key", "answer"],
    ));
    assert_mentions(&err, &[&format!("{prompts}:2"), "missing key `answer` (--label-key)"]);
    // The input key is missing on every line.
    let err = run_error(flags(
        &model,
        &prompts,
        &[
            "--loss-type",
            "sft_loss",
            "--label-key",
            "answer",
            "--input-key",
            "question",
        ],
    ));
    assert_mentions(&err, &[&format!("{prompts}:1"), "missing key `question` (--input-key)"]);

    // SFT without any --label-key: caught before anything is loaded.
    let err = run_error(without(
        flags("/nonexistent/model", &prompts, &["--loss-type", "sft_loss"]),
        "--label-key",
    ));
    assert_mentions(&err, &["--loss-type sft_loss", "--label-key"]);
    Ok(())
}

#[test]
fn batch_flags_that_do_not_fit_name_the_flags() {
    // Checked before anything is loaded: the paths need not exist.
    let f = |extra: &[&str]| flags("/nonexistent/model", "/nonexistent/prompts.jsonl", extra);

    let err = run_error(f(&["--n-samples-per-prompt", "4", "--global-batch-size", "3"]));
    assert_mentions(
        &err,
        &[
            "--global-batch-size 3 must divide the 8 samples",
            "--rollout-batch-size 2 x --n-samples-per-prompt 4",
        ],
    );
    let err = run_error(f(&["--global-batch-size", "3", "--num-steps-per-rollout", "2"]));
    assert_mentions(
        &err,
        &["--global-batch-size 3 x --num-steps-per-rollout 2 != 4 samples"],
    );
    // 4 samples in 3 steps would silently run 4 steps of 1 (4 / 3 = 1); 0 steps would run 1.
    for n in ["3", "0"] {
        let err = run_error(f(&["--num-steps-per-rollout", n]));
        assert_mentions(
            &err,
            &[&format!("--num-steps-per-rollout {n} must divide the 4 samples")],
        );
    }

    let err = run_error(f(&["--n-samples-per-prompt", "1"]));
    assert_mentions(
        &err,
        &["--advantage-estimator", "--n-samples-per-prompt must be at least 2"],
    );
    // Without group normalisation one sample per prompt is fine (up to the missing model).
    let err = run_error(f(&["--n-samples-per-prompt", "1", "--disable-rewards-normalization"]));
    assert_mentions(&err, &["/nonexistent/model"]);

    let err = run_error(without(f(&[]), "--num-rollout"));
    assert_mentions(&err, &["--num-rollout is required"]);

    let err = run_error(f(&["--eval-interval", "2"]));
    assert_mentions(&err, &["--eval-interval needs --eval-prompt-data"]);
    let err = run_error(f(&["--save-interval", "2"]));
    assert_mentions(&err, &["--save-interval needs --save"]);
    let err = run_error(f(&["--rollout-engine", "vllm"]));
    assert_mentions(&err, &["--rollout-engine vllm needs --vllm-url"]);
}

#[test]
fn bad_flags_are_named_by_the_parser() {
    let f = |extra: &[&str]| flags("/m", "/p.jsonl", extra);
    let err = run_error(f(&["--rollout-batch-sise", "4"]));
    assert_mentions(&err, &["--rollout-batch-sise"]);
    let err = run_error(f(&["--n-samples-per-prompt", "four"]));
    assert_mentions(&err, &["--n-samples-per-prompt", "four"]);
    let err = run_error(f(&["--apply-chat-template-kwargs", "{enable_thinking: false}"]));
    assert_mentions(&err, &["--apply-chat-template-kwargs", "invalid JSON"]);
    let err = run_error(f(&["--advantage-estimator", "grpo2"]));
    assert_mentions(&err, &["--advantage-estimator", "grpo2"]);
    let err = run_error(f(&["--rollout-engine", "sglang"]));
    assert_mentions(&err, &["--rollout-engine \"sglang\""]);

    let err = run_error(f(&["--recompute-method", "block"]));
    assert_mentions(&err, &["--recompute-method", "need", "--recompute-granularity full"]);
    let err = run_error(f(&["--recompute-granularity", "full", "--recompute-method", "blocks"]));
    assert_mentions(&err, &["--recompute-method \"blocks\"", "uniform or block"]);
    let err = run_error(f(&["--recompute-granularity", "full", "--recompute-num-layers", "0"]));
    assert_mentions(&err, &["--recompute-num-layers must be at least 1"]);
    // Megatron's recompute layouts become the model's policy.
    let policy = |extra: &[&str]| {
        TrainArgs::from_flags(f(extra))
            .unwrap()
            .recompute()
            .unwrap()
            .to_string()
    };
    assert_eq!(policy(&[]), "none");
    assert_eq!(policy(&["--recompute-granularity", "full"]), "full");
    let slime = [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "uniform",
        "--recompute-num-layers",
        "1",
    ];
    assert_eq!(policy(&slime), "full");
    let block = [
        "--recompute-granularity",
        "full",
        "--recompute-method",
        "block",
        "--recompute-num-layers",
        "30",
    ];
    assert_eq!(policy(&block), "block:30");
    let keep = [
        "--recompute-granularity",
        "full",
        "--recompute-num-layers",
        "2",
        "--recompute-keep-attention",
    ];
    assert_eq!(policy(&keep), "uniform:2,keep-attention");

    // slime's explicit "no top-k" parses as a value, not as a flag.
    let args = TrainArgs::from_flags(f(&["--rollout-top-k", "-1"])).expect("--rollout-top-k -1");
    assert_eq!(args.rollout_top_k, -1);
}

#[test]
fn unknown_rm_type_is_named() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let model = model_in(tmp.path())?;
    let prompts = write(&tmp.path().join("p.jsonl"), GOOD_ROWS)?;
    let err = run_error(flags(
        &model.display().to_string(),
        &prompts,
        &["--rm-type", "deepscalar"],
    ));
    assert_mentions(&err, &["--rm-type \"deepscalar\" is not implemented", "deepscaler"]);
    Ok(())
}

#[test]
fn fp8_flags_vime_lacks_or_an_f32_run_are_named_before_any_rollout() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let model = model_in(tmp.path())?;
    let prompts = write(&tmp.path().join("p.jsonl"), GOOD_ROWS)?;
    let m = model.display().to_string();
    let err = run_error(flags(
        &m,
        &prompts,
        &["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"],
    ));
    assert_mentions(&err, &["--fp8-recipe \"mxfp8\"", "tensorwise", "delayed"]);
    // Delayed scaling's settings without delayed scaling, or out of range.
    let err = run_error(flags(
        &m,
        &prompts,
        &["--fp8-format", "hybrid", "--fp8-amax-history-len", "16"],
    ));
    assert_mentions(&err, &["--fp8-amax-history-len", "--fp8-recipe delayed"]);
    let err = run_error(flags(
        &m,
        &prompts,
        &[
            "--fp8-format",
            "hybrid",
            "--fp8-recipe",
            "delayed",
            "--fp8-amax-compute-algo",
            "mean",
        ],
    ));
    assert_mentions(&err, &["--fp8-amax-compute-algo \"mean\"", "most_recent or max"]);
    let err = run_error(flags(&m, &prompts, &["--fp8-format", "e4m3"]));
    assert_mentions(&err, &["--fp8-format e4m3", "--fp8-format hybrid"]);
    // The CPU run computes in f32: FP8 needs bf16.
    let err = run_error(flags(&m, &prompts, &["--fp8-format", "hybrid"]));
    assert_mentions(&err, &["--fp8-format hybrid", "bf16", "F32"]);
    Ok(())
}

#[test]
fn lm_head_logits_values_and_pairings_vime_refuses_are_named() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let model = model_in(tmp.path())?;
    let prompts = write(&tmp.path().join("p.jsonl"), GOOD_ROWS)?;
    let m = model.display().to_string();
    let err = run_error(flags(&m, &prompts, &["--lm-head-logits", "fp16"]));
    assert_mentions(&err, &["--lm-head-logits", "\"fp16\"", "fp32 or bf16"]);
    let err = run_error(flags(
        &m,
        &prompts,
        &["--lm-head-logits", "bf16", "--true-on-policy-mode"],
    ));
    assert_mentions(&err, &["--lm-head-logits bf16", "--true-on-policy-mode"]);
    Ok(())
}

#[test]
fn unreachable_vllm_engine_names_the_url_and_does_not_hang() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let model = model_in(tmp.path())?;
    let prompts = write(&tmp.path().join("p.jsonl"), GOOD_ROWS)?;
    // Port 9 (discard) has no listener: connections are refused at once.
    let url = "http://127.0.0.1:9";
    let t = Instant::now();
    let err = run_error(flags(
        &model.display().to_string(),
        &prompts,
        &[
            "--rollout-engine",
            "vllm",
            "--vllm-url",
            url,
            "--vllm-max-retries",
            "0",
            "--vllm-request-timeout",
            "5",
        ],
    ));
    assert_mentions(&err, &["generating the rollout", url, "did not answer"]);
    assert!(t.elapsed() < Duration::from_secs(30), "took {:?}", t.elapsed());
    Ok(())
}

#[test]
fn corrupt_checkpoint_pointer_is_named_and_left_alone() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let ckpts = tmp.path().join("ckpts");
    std::fs::create_dir_all(ckpts.join("iter_0000002"))?;
    std::fs::write(
        ckpts.join("metrics.jsonl"),
        "{\"step\": 2, \"time\": 0, \"train/loss\": 1.5}\n",
    )?;
    let latest = ckpts.join("latest_checkpointed_iteration.txt");
    std::fs::write(&latest, "iter_2\n")?;
    let before = snapshot(&ckpts);
    let ckpts_s = ckpts.display().to_string();
    // No --hf-checkpoint: --load alone.
    let resume = without(
        flags(
            "",
            "/nonexistent/prompts.jsonl",
            &["--load", &ckpts_s, "--save", &ckpts_s],
        ),
        "--hf-checkpoint",
    );
    let err = run_error(resume.clone());
    assert_mentions(
        &err,
        &[
            &format!("--load {ckpts_s}"),
            &latest.display().to_string(),
            "expected an iteration number, found \"iter_2\"",
        ],
    );
    assert_eq!(
        snapshot(&ckpts),
        before,
        "a failed resume changed the checkpoint folder"
    );

    // A pointer to a checkpoint that is not there.
    std::fs::write(&latest, "7")?;
    let err = run_error(resume.clone());
    assert_mentions(&err, &["iter_0000007", "does not exist", &latest.display().to_string()]);

    // A pointer to a checkpoint without its state.
    std::fs::write(&latest, "2")?;
    let err = run_error(resume.clone());
    assert_mentions(&err, &[&ckpts.join("iter_0000002/state.json").display().to_string()]);

    // The binary says the same, on one `error:` line, with exit status 1.
    std::fs::write(&latest, "iter_2\n")?;
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_vime-train"))
        .args(&resume)
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {stderr}");
    assert_mentions(&stderr, &["vime-train: error: ", "expected an iteration number"]);
    Ok(())
}

#[test]
fn checkpoint_whose_tokenizer_exceeds_the_vocab_is_refused() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let model = tmp.path().join("small-vocab");
    tiny_qwen3(&model, 1000)?;
    let prompts = write(&tmp.path().join("p.jsonl"), GOOD_ROWS)?;
    let err = run_error(flags(&model.display().to_string(), &prompts, &[]));
    assert_mentions(
        &err,
        &[
            &format!("the tokenizer of {} has 151669 tokens", model.display()),
            "vocab_size is 1000",
        ],
    );
    Ok(())
}

#[test]
fn weights_that_do_not_match_the_config_name_the_tensor() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let model = model_in(tmp.path())?;
    let config = model.join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(&config)?)?;
    cfg["intermediate_size"] = 96.into();
    std::fs::write(&config, serde_json::to_vec_pretty(&cfg)?)?;
    let prompts = write(&tmp.path().join("p.jsonl"), GOOD_ROWS)?;
    let err = run_error(flags(&model.display().to_string(), &prompts, &[]));
    assert_mentions(
        &err,
        &[
            &model.display().to_string(),
            "model.layers.0.mlp.gate_proj.weight",
            "[96, 32]",
            "[64, 32]",
        ],
    );
    Ok(())
}
