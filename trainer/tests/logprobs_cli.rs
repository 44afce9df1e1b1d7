//! `vime-train logprobs` as a user runs it: on the HF fixture checkpoint (tests/fixtures/hf/tied_gqa,
//! written by tests/fixtures/gen_hf_fixtures.py with HF transformers) it must reproduce HF's
//! per-token log-probs and entropies; bad input must fail with the file and line, leaving no output.
use std::path::{Path, PathBuf};
use std::process::Command;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures")
}

fn run(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_vime-train"))
        .args(args)
        .output()
        .expect("running vime-train")
}

fn logprobs_cmd(input: &Path, output: &Path, extra: &[&str]) -> std::process::Output {
    let ckpt = fixtures().join("hf/tied_gqa");
    let mut args = vec![
        "logprobs",
        "--hf-checkpoint",
        ckpt.to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    run(&args)
}

fn floats(v: &serde_json::Value, key: &str) -> Vec<f64> {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("missing {key}"))
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect()
}

#[test]
fn reproduces_hf_logprobs_and_entropy() {
    let tmp = tempfile::tempdir().unwrap();
    // batch of 1 token-budget forces one sequence per forward; the default packs them all
    for extra in [&[][..], &["--max-tokens-per-batch", "1"][..]] {
        let out_path = tmp.path().join("out.jsonl");
        let out = logprobs_cmd(&fixtures().join("logprobs_input.jsonl"), &out_path, extra);
        assert!(
            out.status.success(),
            "vime-train failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let got: Vec<serde_json::Value> = std::fs::read_to_string(&out_path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let inputs: Vec<serde_json::Value> = std::fs::read_to_string(fixtures().join("logprobs_input.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let want: Vec<serde_json::Value> =
            std::fs::read_to_string(fixtures().join("hf/tied_gqa/expected_logprobs.jsonl"))
                .unwrap()
                .lines()
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
        assert_eq!(got.len(), want.len());
        for (i, ((g, w), inp)) in got.iter().zip(&want).zip(&inputs).enumerate() {
            assert_eq!(g["tokens"], inp["tokens"], "line {i}: input keys are kept");
            for key in ["logprobs", "entropy"] {
                let (a, b) = (floats(g, key), floats(w, key));
                assert_eq!(a.len(), b.len(), "line {i} {key} length");
                let scale = b.iter().fold(0f64, |m, x| m.max(x.abs()));
                let err = a.iter().zip(&b).fold(0f64, |m, (x, y)| m.max((x - y).abs())) / scale;
                assert!(err <= 1e-5, "line {i} {key}: relative error {err:e}");
            }
            if let Some(p) = inp.get("prompt_len").and_then(|p| p.as_u64()) {
                let lp = floats(g, "logprobs");
                assert_eq!(
                    floats(g, "response_logprobs"),
                    lp[p as usize - 1..].to_vec(),
                    "line {i}"
                );
            }
        }
    }
}

#[test]
fn bad_input_names_file_and_line_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: &[(&str, &str)] = &[
        ("{\"tokens\": [1, 2, 3]}\n{\"tokens\": [1, 2\n", ":2: not valid JSON"),
        (
            "{\"tokens\": [1, 2, 3]}\n\n{\"ids\": [1, 2]}\n",
            ":3: missing key \"tokens\"",
        ),
        (
            "{\"tokens\": [1, 99999]}\n",
            "tokens[1] = 99999 is outside the vocabulary",
        ),
        ("{\"tokens\": [5]}\n", "at least 2 ids"),
        (
            "{\"tokens\": [1, 2, 3], \"prompt_len\": 3}\n",
            "\"prompt_len\" must be an integer in 1..3",
        ),
    ];
    for (i, (text, msg)) in cases.iter().enumerate() {
        let input = tmp.path().join(format!("bad{i}.jsonl"));
        std::fs::write(&input, text).unwrap();
        let output = tmp.path().join(format!("out{i}.jsonl"));
        let out = logprobs_cmd(&input, &output, &[]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "case {i} should fail");
        assert!(err.contains(msg), "case {i}: stderr {err:?} should contain {msg:?}");
        assert!(
            err.contains(&format!("bad{i}.jsonl")),
            "case {i}: stderr should name the file: {err}"
        );
        assert!(!output.exists(), "case {i}: no output file on failure");
    }
    let out = logprobs_cmd(
        &fixtures().join("logprobs_input.jsonl"),
        &tmp.path().join("x.jsonl"),
        &["--dtype", "f8"],
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown dtype \"f8\""));
    let missing = tmp.path().join("nope");
    let out = run(&[
        "logprobs",
        "--hf-checkpoint",
        missing.to_str().unwrap(),
        "--input",
        "x",
        "--output",
        "y",
    ]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("nope"),
        "names the missing checkpoint dir"
    );
}
