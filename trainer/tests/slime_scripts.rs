//! slime scripts run unchanged (issue 19): each seed script's argument list
//! (`tests/fixtures/slime-scripts/*.args`, exactly what the script passes to `python3 train.py`,
//! its Megatron model flags included) is given to `vime-train`, with only paths pointed at
//! fixtures and sizes shrunk by flags appended at the end (the last value of a flag wins, as in
//! argparse). Each run prints its resolved plan and one notice per slime/Megatron flag vime does
//! not need, then runs one rollout on the CPU: the 4B PPO script at TP 2 x CP 2 on four processes,
//! the vLLM scripts through engines vime launches on the placement's rollout GPUs (`vime-serve`,
//! vLLM's API on the CPU, stands in for `vllm serve`).
//!
//! slime's model argument lists (`model-qwen3-*.args`) are checked against the real releases'
//! shapes (`Qwen3Config::preset`) and refused against a checkpoint of another shape. And the
//! README's flag table is the one the parser's own list generates.
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;
use vime_trainer::metrics::read_metrics;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_vime-train")
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The arguments of a fixture, one per line, without its `# ` header.
fn script(name: &str) -> Vec<String> {
    let path = root().join("tests/fixtures/slime-scripts").join(name);
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .filter(|l| !l.starts_with("# "))
        .map(str::to_string)
        .collect()
}

/// `vime-serve`, built once (it belongs to `vime-rollout`: no `CARGO_BIN_EXE_` here), in this test
/// binary's profile.
fn vime_serve() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let profile_dir = PathBuf::from(bin()).parent().unwrap().to_path_buf();
        let mut cmd = Command::new(env!("CARGO"));
        cmd.current_dir(root())
            .args(["build", "-p", "vime-rollout", "--bin", "vime-serve"]);
        if profile_dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        assert!(cmd.status().unwrap().success(), "building vime-serve");
        profile_dir.join("vime-serve")
    })
}

/// A tiny random Qwen3 (the release config with 2 layers, hidden 32, 4/2 heads of 16) with the
/// real tokenizer, as an HF folder; the flags that describe it to Megatron.
fn tiny_model(dir: &Path) -> Vec<String> {
    use candle_core::{DType, Device};
    let mut cfg = vime_qwen3::config::Qwen3Config::preset("qwen3-0.6b").unwrap();
    cfg.hidden_size = 32;
    cfg.intermediate_size = 64;
    cfg.num_hidden_layers = 2;
    cfg.max_window_layers = 2;
    cfg.num_attention_heads = 4;
    cfg.num_key_value_heads = 2;
    cfg.head_dim = 16;
    cfg.dtype = Some("float32".into());
    let m = vime_qwen3::model::Qwen3::init_random(cfg, 0.02, 7, DType::F32, &Device::Cpu).unwrap();
    m.save_hf(dir, DType::F32, u64::MAX).unwrap();
    vime_qwen3::checkpoint::copy_tokenizer_files(&root().join("tests/assets/qwen3-tokenizer"), dir).unwrap();
    [
        "--num-layers",
        "2",
        "--hidden-size",
        "32",
        "--ffn-hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--num-query-groups",
        "2",
        "--kv-channels",
        "16",
    ]
    .map(String::from)
    .to_vec()
}

fn value_of<'a>(args: &'a [String], flag: &str) -> Option<&'a str> {
    args.iter()
        .rposition(|a| a == flag)
        .and_then(|i| args.get(i + 1))
        .map(String::as_str)
}

fn run(args: &[String]) -> Output {
    Command::new(bin())
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("running vime-train")
}

/// Runs seed script `name` at CPU scale with `ranks` training processes; returns its stderr.
fn run_seed(name: &str, ranks: usize) -> String {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    let save = dir.path().join("ckpt");
    let prompts = root().join("tests/assets/math/gsm8k-smoke.jsonl").display().to_string();
    let mut args = script(name);
    let original = args.clone();
    let m = model.display().to_string();
    let s = save.display().to_string();
    args.extend(tiny_model(&model));
    args.extend(
        [
            "--hf-checkpoint",
            &m,
            "--ref-load",
            &m,
            "--load",
            &s,
            "--save",
            &s,
            "--prompt-data",
            &prompts,
            "--num-rollout",
            "1",
            "--rollout-batch-size",
            "2",
            "--n-samples-per-prompt",
            "2",
            "--global-batch-size",
            "4",
            "--rollout-max-response-len",
            "8",
            "--max-tokens-per-gpu",
            "256",
            "--n-samples-per-eval-prompt",
            "1",
            "--eval-max-response-len",
            "4",
            "--actor-num-gpus-per-node",
            &ranks.to_string(),
            "--rollout-num-gpus",
            "1",
            "--rollout-num-gpus-per-engine",
            "1",
            "--no-progress",
        ]
        .map(String::from),
    );
    if original.contains(&"--eval-prompt-data".to_string()) {
        args.extend(["--eval-prompt-data", "aime", &prompts].map(String::from));
    }
    let vllm = value_of(&original, "--rollout-backend") == Some("vllm");
    if vllm {
        args.extend([
            "--vllm-command".to_string(),
            vime_serve().display().to_string(),
            "--vllm-log-dir".to_string(),
            dir.path().join("engines").display().to_string(),
        ]);
    }
    let out = run(&args);
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(out.status.success(), "{name}: vime-train failed\n{err}");
    // The plan, and a notice for each slime / Megatron flag vime does not need.
    assert!(
        err.contains("vime: placement: train on"),
        "{name}: no placement line\n{err}"
    );
    if vllm {
        assert!(
            err.contains("vime: engines: vime launches 1 vLLM engine(s)"),
            "{name}\n{err}"
        );
        // The launched engine: dev endpoints on loopback (said once), and its reloads confined to
        // the folder the trainer writes them to.
        assert!(
            err.contains("vime: engine 0's dev endpoints") && err.contains("are exposed on 127.0.0.1:"),
            "{name}\n{err}"
        );
        let log = std::fs::read_to_string(dir.path().join("engines/vllm-engine-0.log")).unwrap();
        let root = save.join("weights-for-engines").canonicalize().unwrap();
        assert!(
            log.contains(&format!("reads folders under {} only", root.display())),
            "{name}\n{log}"
        );
    }
    for flag in [
        "--train-backend",
        "--attention-dropout",
        "--accumulate-allreduce-grads-in-fp32",
    ] {
        assert!(
            err.contains(&format!("vime: {flag}")),
            "{name}: no notice for {flag}\n{err}"
        );
    }
    // One rollout trained (the PPO script's first rollout trains only the critic:
    // --num-critic-only-steps 1).
    let rows = read_metrics(&save.join("metrics.jsonl")).unwrap();
    let trained = |m: &std::collections::BTreeMap<String, f64>| {
        m.contains_key("train/loss") || m.contains_key("critic/value_loss")
    };
    assert!(
        rows.iter().any(|(step, m)| *step == 1 && trained(m)),
        "{name}: {rows:?}"
    );
    err
}

#[test]
fn seed_ppo_4b_colocated_vllm_script_runs_at_tp2_by_cp2() {
    let err = run_seed("seed000-ppo-colocate-4b.args", 4);
    assert!(err.contains("parallel: 4 ranks (dp 1 x tp 2 x cp 2)"), "{err}");
    assert!(err.contains("--megatron-config-path"), "{err}");
}

#[test]
fn seed_grpo_colocated_script_runs_on_the_built_in_engine() {
    let err = run_seed("seed002-grpo-colocate-0.6b.args", 1);
    assert!(err.contains("the built-in engine always shares"), "{err}");
}

#[test]
fn seed_grpo_vllm_script_runs_with_launched_engines() {
    run_seed("seed003-grpo-vllm-0.6b.args", 1);
}

/// The SGLang comparison script of seed 003 names no rollout backend: vime serves its rollouts
/// with the built-in engine and says so.
#[test]
fn seed_grpo_sglang_script_runs_on_the_built_in_engine() {
    let err = run_seed("seed003-grpo-sglang-0.6b.args", 1);
    assert!(err.contains("pass --rollout-backend vllm to serve on them"), "{err}");
}

/// slime's model argument lists describe the real releases (checked against each preset's
/// config.json shape), and against a checkpoint of another shape they are an error that names
/// the flag, both values and the file, before any weight loads.
#[test]
fn slime_model_flags_are_checked_against_config_json() {
    let dir = tempfile::tempdir().unwrap();
    for (file, preset) in [
        ("model-qwen3-0.6B.args", "qwen3-0.6b"),
        ("model-qwen3-1.7B.args", "qwen3-1.7b"),
        ("model-qwen3-4B.args", "qwen3-4b"),
        ("model-qwen3-8B.args", "qwen3-8b"),
    ] {
        // The release's config.json alone: the check reads nothing else.
        let ckpt = dir.path().join(preset);
        std::fs::create_dir_all(&ckpt).unwrap();
        let cfg = vime_qwen3::config::Qwen3Config::preset(preset).unwrap();
        std::fs::write(ckpt.join("config.json"), serde_json::to_string(&cfg).unwrap()).unwrap();
        let flags = script(file);
        let seen = vime_trainer::train::compat::split(
            std::iter::once("vime-train".into())
                .chain(flags.iter().map(Into::into))
                .collect(),
        )
        .unwrap()
        .1;
        vime_trainer::train::resolve::check_shape(&cfg, &seen.shape, &ckpt)
            .unwrap_or_else(|e| panic!("{file} vs {preset}: {e:#}"));
        // The 4B flags against the 8B checkpoint (and the other way round) fail, naming values.
        if preset == "qwen3-8b" {
            let four = vime_qwen3::config::Qwen3Config::preset("qwen3-4b").unwrap();
            let e = format!(
                "{:#}",
                vime_trainer::train::resolve::check_shape(&four, &seen.shape, &ckpt).unwrap_err()
            );
            assert!(
                e.contains("--hidden-size 4096 but") && e.contains("hidden_size = 2560"),
                "{e}"
            );
            assert!(
                e.contains("tie_word_embeddings = true") && e.contains("remove --untie-embeddings-and-output-weights"),
                "{e}"
            );
        }
    }
}

/// The errors of issue 19, each before any model loads: a shape flag that disagrees with
/// config.json, a Megatron torch_dist folder, an unknown flag, a `--model` with no local copy.
#[test]
fn bad_slime_command_lines_fail_fast_naming_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    tiny_model(&model);
    let m = model.display().to_string();
    let prompts = root().join("tests/assets/math/gsm8k-smoke.jsonl").display().to_string();
    let base = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = [
            "--prompt-data",
            &prompts,
            "--input-key",
            "prompt",
            "--label-key",
            "label",
            "--rm-type",
            "deepscaler",
            "--num-rollout",
            "1",
            "--n-samples-per-prompt",
            "2",
        ]
        .map(String::from)
        .to_vec();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let fail = |args: Vec<String>, says: &[&str]| {
        let t = std::time::Instant::now();
        let out = run(&args);
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(!out.status.success(), "{args:?} succeeded");
        for s in says {
            assert!(err.contains(s), "{args:?}: missing {s:?} in\n{err}");
        }
        assert!(!err.contains("panicked"), "{err}");
        assert!(t.elapsed().as_secs() < 20, "{args:?} took {:?}", t.elapsed());
    };
    let cfg_path = model.join("config.json").display().to_string();
    fail(
        base(&[
            "--hf-checkpoint",
            &m,
            "--num-layers",
            "36",
            "--qk-layernorm",
            "--swiglu",
            "--group-query-attention",
        ]),
        &["--num-layers 36 but", &cfg_path, "num_hidden_layers = 2"],
    );
    fail(
        base(&["--hf-checkpoint", &m, "--num-layers", "2"]),
        &["add --qk-layernorm", "add --swiglu"],
    );
    let dist = dir.path().join("Qwen3-4B_torch_dist");
    std::fs::create_dir_all(dist.join("iter_0000000")).unwrap();
    std::fs::write(dist.join("iter_0000000").join("__0_0.distcp"), b"").unwrap();
    std::fs::write(dist.join("latest_checkpointed_iteration.txt"), b"release").unwrap();
    let d = dist.display().to_string();
    fail(
        base(&["--hf-checkpoint", &m, "--ref-load", &d]),
        &["--ref-load", &d, "Megatron torch_dist", "pass the HF checkpoint"],
    );
    fail(
        base(&["--hf-checkpoint", &m, "--no-such-flag", "1"]),
        &["--no-such-flag"],
    );
    fail(
        base(&["--hf-checkpoint", &m, "--attention-dropout", "0.1"]),
        &["--attention-dropout 0.1", "without dropout"],
    );
    let mut no_copy = base(&["--model", "qwen3-4b"]);
    no_copy.extend(["--save".to_string(), dir.path().join("s").display().to_string()]);
    let out = Command::new(bin())
        .args(&no_copy)
        .env("HF_HOME", dir.path().join("empty-hf-home"))
        .env_remove("HF_HUB_CACHE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("--model Qwen/Qwen3-4B: no local copy") && err.contains("hf download Qwen/Qwen3-4B"),
        "{err}"
    );
}

/// `--model NAME` finds the checkpoint in the Hugging Face cache (`$HF_HOME/hub`, snapshot of
/// `refs/main`) and checks that it has the release's shape: a tiny snapshot filed as Qwen3-0.6B is
/// found, then refused naming both shapes. (A real 0.6B does not train on a CI runner.)
#[test]
fn model_name_resolves_from_the_hf_cache() {
    let dir = tempfile::tempdir().unwrap();
    let snap = dir.path().join("hub/models--Qwen--Qwen3-0.6B/snapshots/0123abc");
    std::fs::create_dir_all(dir.path().join("hub/models--Qwen--Qwen3-0.6B/refs")).unwrap();
    std::fs::write(dir.path().join("hub/models--Qwen--Qwen3-0.6B/refs/main"), "0123abc").unwrap();
    tiny_model(&snap);
    let prompts = root().join("tests/assets/math/gsm8k-smoke.jsonl").display().to_string();
    let save = dir.path().join("save");
    let s = save.display().to_string();
    let args: Vec<String> = [
        "--model",
        "Qwen/Qwen3-0.6B",
        "--prompt-data",
        &prompts,
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--rm-type",
        "deepscaler",
        "--num-rollout",
        "1",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "2",
        "--rollout-max-response-len",
        "4",
        "--save",
        &s,
        "--no-progress",
    ]
    .map(String::from)
    .to_vec();
    let out = Command::new(bin())
        .args(&args)
        .env("HF_HOME", dir.path())
        .env_remove("HF_HUB_CACHE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("--model qwen3-0.6b is Qwen/Qwen3-0.6B"), "{err}");
    assert!(
        err.contains("hidden_size = 1024") && err.contains("hidden_size = 32") && err.contains("0123abc"),
        "{err}"
    );
}

/// The README's flag table is the one generated from the parser's own list (clap's options and
/// `compat::COMPAT`), so it cannot drift. `VIME_UPDATE_README=1` rewrites it.
#[test]
fn the_readme_flag_table_is_generated_from_the_parser() {
    use clap::CommandFactory;
    let table = vime_trainer::train::compat::flag_table(&vime_trainer::train::args::TrainCli::command());
    let path = root().join("README.md");
    let readme = std::fs::read_to_string(&path).unwrap();
    let (begin, end) = (
        "<!-- flag-table: generated by compat::flag_table -->\n",
        "<!-- /flag-table -->",
    );
    let a = readme.find(begin).expect("README has the flag-table begin marker") + begin.len();
    let b = readme[a..].find(end).expect("README has the flag-table end marker") + a;
    if std::env::var_os("VIME_UPDATE_README").is_some() {
        std::fs::write(&path, format!("{}{table}{}", &readme[..a], &readme[b..])).unwrap();
        return;
    }
    assert!(
        readme[a..b] == table,
        "README.md's flag table is stale: run `VIME_UPDATE_README=1 cargo test -p vime-trainer --test slime_scripts \
         the_readme_flag_table`"
    );
    // Every flag of every seed script and slime model script is in it.
    for f in std::fs::read_dir(root().join("tests/fixtures/slime-scripts")).unwrap() {
        let p = f.unwrap().path();
        if p.extension().is_some_and(|e| e == "args") {
            for flag in script(p.file_name().unwrap().to_str().unwrap())
                .iter()
                .filter(|a| a.starts_with("--"))
            {
                assert!(
                    table.contains(&format!("`{flag}")),
                    "{}: {flag} is not in the flag table",
                    p.display()
                );
            }
        }
    }
}
