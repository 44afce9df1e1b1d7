//! Prompt datasets: JSONL rows to prompts, slime's per-epoch order, exact cursor resume, and
//! errors that name `file:line` and the key.
//!
//! The order fixture (tests/fixtures/chat/prompt_order.json) comes from
//! tests/fixtures/gen_chat_template_fixtures.py: CPython's `random.seed(s); random.shuffle(...)`,
//! and the batches slime's `RolloutDataSource.get_samples(n)` hands out (cross-checked there
//! against slime's own code with `--slime`).
use clap::Parser;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use vime_rollout::data::{
    epoch_permutation, ChatMessage, ChatOptions, DataArgs, DataCursor, PromptDataset, PyRandom, Tokenizer,
};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn qwen3() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        Tokenizer::from_dir(repo().join("tests/assets/qwen3-tokenizer")).expect("vendored Qwen3 tokenizer")
    })
}

/// Writes `lines` (joined with '\n') to `name` in a fresh temp dir.
fn jsonl(name: &str, lines: &[&str]) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(name);
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    (dir, path)
}

fn prompt_args() -> DataArgs {
    DataArgs {
        input_key: "prompt".into(),
        label_key: Some("label".into()),
        ..Default::default()
    }
}

fn load_err(lines: &[&str], args: &DataArgs) -> String {
    let (_dir, path) = jsonl("bad.jsonl", lines);
    let err = PromptDataset::load(&path, args, qwen3()).expect_err("load should fail");
    format!("{err:#}")
}

#[test]
fn string_prompts_label_and_metadata() {
    let tok = qwen3();
    let (_dir, path) = jsonl(
        "p.jsonl",
        &[
            r#"{"prompt": "What is 1+1?", "label": "2", "metadata": {"source": "toy", "level": 1}}"#,
            "",
            r#"{"prompt": "Name a prime.", "label": 7}"#,
            r#"{"prompt": "Zero metadata", "label": null, "metadata": 0}"#,
        ],
    );
    let ds = PromptDataset::load(&path, &prompt_args(), tok).unwrap();
    assert_eq!(ds.len(), 3);
    let s = ds.samples();
    assert_eq!(
        (s[0].index, s[0].line, s[1].line, s[2].line),
        (0, 1, 3, 4),
        "blank lines keep the numbering"
    );
    assert_eq!(s[0].prompt, "What is 1+1?");
    assert_eq!(s[0].prompt_ids, tok.encode("What is 1+1?").unwrap());
    assert_eq!(s[0].label_text().as_deref(), Some("2"));
    assert_eq!(s[1].label, Some(json!(7)));
    assert_eq!(s[1].label_text().as_deref(), Some("7"));
    assert_eq!(s[2].label, Some(json!(null)));
    assert_eq!(s[0].metadata, json!({"source": "toy", "level": 1}));
    assert_eq!(s[1].metadata, json!({}), "missing metadata is {{}}");
    assert_eq!(
        s[2].metadata,
        json!({}),
        "falsy metadata is {{}} (slime: `data.get(key) or {{}}`)"
    );

    // No label key: no label, even when rows have one. A custom metadata key.
    let args = DataArgs {
        input_key: "prompt".into(),
        metadata_key: "label".into(),
        ..Default::default()
    };
    let ds = PromptDataset::load(&path, &args, tok).unwrap();
    assert_eq!(ds.samples()[0].label, None);
    assert_eq!(ds.samples()[0].metadata, json!("2"));
}

#[test]
fn chat_template_on_strings_and_messages() {
    let tok = qwen3();
    let (_dir, path) = jsonl(
        "chat.jsonl",
        &[
            r#"{"input": "What is 2+2?"}"#,
            r#"{"input": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]}"#,
            r#"{"input": [{"role": "user", "content": "Weather?"}], "tools": "[{\"type\": \"function\", \"function\": {\"name\": \"w\", \"parameters\": {\"z\": 1, \"a\": 2}}}]", "metadata": {"id": 3}}"#,
        ],
    );
    let mut kwargs = serde_json::Map::new();
    kwargs.insert("enable_thinking".into(), json!(false));
    let args = DataArgs {
        apply_chat_template: true,
        apply_chat_template_kwargs: kwargs.clone(),
        ..Default::default()
    };
    let ds = PromptDataset::load(&path, &args, tok).unwrap();
    let s = ds.samples();

    let opts = ChatOptions::generation().json_kwargs(&kwargs);
    let user = [ChatMessage::new("user", "What is 2+2?")];
    assert_eq!(
        s[0].prompt,
        tok.chat_template(false).unwrap().render_messages(&user, &opts).unwrap()
    );
    assert_eq!(
        s[0].prompt,
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    );
    assert_eq!(s[0].prompt_ids, tok.encode(&s[0].prompt).unwrap());
    assert!(s[1]
        .prompt
        .starts_with("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"));

    // Tools given as a JSON string: rendered in the row's key order, and kept in the metadata.
    assert!(
        s[2].prompt
            .contains(r#"{"type": "function", "function": {"name": "w", "parameters": {"z": 1, "a": 2}}}"#),
        "{}",
        s[2].prompt
    );
    assert_eq!(s[2].metadata["id"], json!(3));
    assert_eq!(s[2].metadata["tools"][0]["function"]["name"], json!("w"));
}

#[test]
fn max_prompt_len_filters_and_counts() {
    let tok = qwen3();
    let long = "word ".repeat(50);
    let lines = [
        r#"{"prompt": "short"}"#.to_string(),
        json!({ "prompt": long }).to_string(),
        r#"{"prompt": "also short"}"#.to_string(),
    ];
    let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
    let (_dir, path) = jsonl("p.jsonl", &lines);
    let args = DataArgs {
        input_key: "prompt".into(),
        rollout_max_prompt_len: Some(10),
        ..Default::default()
    };
    let ds = PromptDataset::load(&path, &args, tok).unwrap();
    assert_eq!(ds.num_filtered_long(), 1);
    assert_eq!(ds.len(), 2);
    assert_eq!((ds.samples()[1].index, ds.samples()[1].line), (1, 3));
    assert!(ds.samples().iter().all(|s| s.prompt_ids.len() <= 10));
    // slime keeps a prompt of exactly the limit.
    let exact = tok.encode("also short").unwrap().len();
    let args = DataArgs {
        rollout_max_prompt_len: Some(exact),
        ..args
    };
    assert_eq!(PromptDataset::load(&path, &args, tok).unwrap().num_filtered_long(), 1);
    let args = DataArgs {
        rollout_max_prompt_len: Some(0),
        ..args
    };
    let err = PromptDataset::load(&path, &args, tok).unwrap_err();
    assert!(format!("{err:#}").contains("every prompt is longer"), "{err:#}");
}

fn order_fixture() -> serde_json::Value {
    let path = repo().join("tests/fixtures/chat/prompt_order.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn shuffle_is_cpythons_random_shuffle() {
    for p in order_fixture()["permutations"].as_array().unwrap() {
        let (n, seed) = (p["n"].as_u64().unwrap() as usize, p["seed"].as_u64().unwrap());
        let want: Vec<usize> = serde_json::from_value(p["permutation"].clone()).unwrap();
        assert_eq!(epoch_permutation(n, seed, 0), want, "n={n} seed={seed}");
    }
    // python3 -c "import random; random.seed(42); print([random.getrandbits(32) for _ in range(3)])"
    let mut rng = PyRandom::new(42);
    assert_eq!(
        [rng.next_u32(), rng.next_u32(), rng.next_u32()],
        [2746317213, 478163327, 107420369]
    );
    // epoch e is seeded with seed + e
    assert_eq!(epoch_permutation(10, 42, 3), epoch_permutation(10, 45, 0));
}

#[test]
fn prompt_stream_matches_slime_across_epochs() {
    let tok = qwen3();
    let fixture = order_fixture();
    let stream = &fixture["stream"];
    let a = &stream["args"];
    let args = DataArgs {
        input_key: a["input_key"].as_str().unwrap().into(),
        label_key: Some(a["label_key"].as_str().unwrap().into()),
        apply_chat_template: a["apply_chat_template"].as_bool().unwrap(),
        apply_chat_template_kwargs: a["apply_chat_template_kwargs"].as_object().unwrap().clone(),
        rollout_shuffle: a["rollout_shuffle"].as_bool().unwrap(),
        rollout_seed: a["rollout_seed"].as_u64().unwrap(),
        ..Default::default()
    };
    // "tests/assets/math/gsm8k-test.prompt-label.jsonl@[0:37]": slime's row-slice syntax.
    let ds_path = repo().join(stream["prompt_data"].as_str().unwrap());
    let mut ds = PromptDataset::load(&ds_path, &args, tok).unwrap();
    assert_eq!(ds.len(), 37);
    assert_eq!(
        ds.path(),
        repo().join("tests/assets/math/gsm8k-test.prompt-label.jsonl")
    );

    // The rendered prompts' ids equal HF's (FNV digests, as in chat_template.rs).
    let digests: Vec<String> = serde_json::from_value(stream["row_digests"].clone()).unwrap();
    for (s, want) in ds.samples().iter().zip(&digests) {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in s.prompt_ids.iter().flat_map(|id| id.to_le_bytes()) {
            h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
        }
        assert_eq!(&format!("{}:{h:016x}", s.prompt_ids.len()), want, "row {}", s.index);
    }

    let sizes: Vec<usize> = serde_json::from_value(stream["batch_sizes"].clone()).unwrap();
    let batches: Vec<Vec<usize>> = serde_json::from_value(stream["batches"].clone()).unwrap();
    for (n, want) in sizes.iter().zip(&batches) {
        assert_eq!(&ds.next_indices(*n), want, "batch of {n}");
    }
    let cursor = ds.cursor();
    assert_eq!(
        (cursor.epoch, cursor.offset, cursor.seed),
        (
            stream["final_epoch"].as_u64().unwrap(),
            stream["final_offset"].as_u64().unwrap(),
            42
        )
    );
}

/// Loads, takes some batches, saves the cursor (through JSON, as a checkpoint would), rebuilds
/// the dataset from the file, restores, continues: the same prompts as a run never interrupted.
#[test]
fn cursor_resume_continues_the_same_sequence() {
    let tok = qwen3();
    let lines: Vec<String> = (0..11)
        .map(|i| json!({"prompt": format!("question {i}"), "label": i}).to_string())
        .collect();
    let lines: Vec<&str> = lines.iter().map(String::as_str).collect();
    let (_dir, path) = jsonl("p.jsonl", &lines);
    let sizes = [4, 4, 4, 7, 11, 3, 25, 1, 6];
    for shuffle in [true, false] {
        let args = DataArgs {
            rollout_shuffle: shuffle,
            rollout_seed: 7,
            ..prompt_args()
        };
        let mut straight = PromptDataset::load(&path, &args, tok).unwrap();
        let want: Vec<Vec<String>> = sizes
            .iter()
            .map(|&n| straight.next_batch(n).iter().map(|s| s.prompt.clone()).collect())
            .collect();
        assert_eq!(want.iter().map(Vec::len).collect::<Vec<_>>(), sizes.to_vec());

        for stop in 0..=sizes.len() {
            let mut first = PromptDataset::load(&path, &args, tok).unwrap();
            let mut got: Vec<Vec<String>> = Vec::new();
            for &n in &sizes[..stop] {
                got.push(first.next_batch(n).iter().map(|s| s.prompt.clone()).collect());
            }
            let saved = serde_json::to_string(&first.cursor()).unwrap();
            drop(first);

            let mut resumed = PromptDataset::load(&path, &args, tok).unwrap();
            resumed
                .set_cursor(serde_json::from_str::<DataCursor>(&saved).unwrap())
                .unwrap();
            for &n in &sizes[stop..] {
                got.push(resumed.next_batch(n).iter().map(|s| s.prompt.clone()).collect());
            }
            assert_eq!(
                got, want,
                "shuffle={shuffle}, resumed after {stop} batches (cursor {saved})"
            );
        }
    }

    // The shuffled order of each epoch is a permutation, and epochs differ.
    let args = DataArgs {
        rollout_shuffle: true,
        ..prompt_args()
    };
    let mut ds = PromptDataset::load(&path, &args, tok).unwrap();
    let e0 = ds.next_indices(11);
    let e1 = ds.next_indices(11);
    assert_eq!(
        ds.cursor(),
        DataCursor {
            epoch: 1,
            offset: 11,
            seed: 42
        }
    );
    let mut sorted = e0.clone();
    sorted.sort();
    assert_eq!(sorted, (0..11).collect::<Vec<_>>());
    assert_ne!(e0, e1);
}

#[test]
fn cursor_restore_refuses_a_different_seed_or_a_shorter_file() {
    let tok = qwen3();
    let (_dir, path) = jsonl("p.jsonl", &[r#"{"prompt": "a"}"#, r#"{"prompt": "b"}"#]);
    let args = DataArgs {
        rollout_shuffle: true,
        ..prompt_args()
    };
    let args = DataArgs {
        label_key: None,
        ..args
    };
    let mut ds = PromptDataset::load(&path, &args, tok).unwrap();
    let err = ds
        .set_cursor(DataCursor {
            epoch: 0,
            offset: 1,
            seed: 43,
        })
        .unwrap_err();
    assert!(format!("{err:#}").contains("--rollout-seed 43"), "{err:#}");
    let err = ds
        .set_cursor(DataCursor {
            epoch: 2,
            offset: 3,
            seed: 42,
        })
        .unwrap_err();
    assert!(format!("{err:#}").contains("past the 2 prompts"), "{err:#}");
    ds.set_cursor(DataCursor {
        epoch: 2,
        offset: 2,
        seed: 42,
    })
    .unwrap();
    assert_eq!(ds.epoch_order(), epoch_permutation(2, 42, 2));
}

#[test]
fn errors_name_file_line_and_key() {
    let args = prompt_args();
    let cases: Vec<(Vec<&str>, DataArgs, &[&str])> = vec![
        (
            vec![r#"{"prompt": "a", "label": "1"}"#, r#"{"prompt": "b", "label": "2""#],
            args.clone(),
            &["bad.jsonl:2", "invalid JSON"],
        ),
        (
            vec![
                r#"{"prompt": "a", "label": "1"}"#,
                "",
                r#"{"question": "b", "label": "2"}"#,
            ],
            args.clone(),
            &["bad.jsonl:3", "missing key `prompt` (--input-key)"],
        ),
        (
            vec![r#"{"prompt": "a"}"#],
            args.clone(),
            &["bad.jsonl:1", "missing key `label` (--label-key)"],
        ),
        (
            vec![r#"{"prompt": 42, "label": "1"}"#],
            args.clone(),
            &["bad.jsonl:1", "`prompt` (--input-key)", "got number"],
        ),
        (
            vec![r#"["prompt", "label"]"#],
            args.clone(),
            &["bad.jsonl:1", "must be a JSON object"],
        ),
        (
            vec![r#"{"prompt": [{"role": "user", "content": "hi"}], "label": "1"}"#],
            args.clone(),
            &["bad.jsonl:1", "`prompt` (--input-key)", "--apply-chat-template"],
        ),
        (
            vec![r#"{"prompt": [{"content": "hi"}], "label": "1"}"#],
            DataArgs {
                apply_chat_template: true,
                ..args.clone()
            },
            &[
                "bad.jsonl:1",
                "`prompt` (--input-key)",
                "message 0: `role` must be a string",
            ],
        ),
        (
            vec![r#"{"prompt": [{"role": "user", "content": 5}], "label": "1"}"#],
            DataArgs {
                apply_chat_template: true,
                ..args.clone()
            },
            &["bad.jsonl:1", "`content` must be a string"],
        ),
        (
            vec![r#"{"prompt": "a", "label": "1", "tools": {"name": "f"}}"#],
            args.clone(),
            &["bad.jsonl:1", "`tools` (--tool-key)", "list"],
        ),
        (
            vec![r#"{"prompt": "a", "label": "1", "tools": "[oops"}"#],
            args.clone(),
            &["bad.jsonl:1", "`tools` (--tool-key)", "not JSON"],
        ),
        (
            vec![r#"{"prompt": "a", "label": "1", "tools": [], "metadata": [1]}"#],
            args.clone(),
            &["bad.jsonl:1", "`metadata` (--metadata-key) must be an object"],
        ),
        (vec!["", "  "], args.clone(), &["bad.jsonl", "no prompts"]),
    ];
    for (lines, args, wants) in cases {
        let msg = load_err(&lines, &args);
        for want in wants {
            assert!(msg.contains(want), "{lines:?}: error {msg:?} should contain {want:?}");
        }
    }
    let err = PromptDataset::load("/nonexistent/p.jsonl", &prompt_args(), qwen3()).unwrap_err();
    assert!(format!("{err:#}").contains("/nonexistent/p.jsonl"), "{err:#}");
}

#[test]
fn flags_keep_slimes_names_and_defaults() {
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        data: DataArgs,
    }
    let d = Cli::try_parse_from(["x"]).unwrap().data;
    assert_eq!(d, DataArgs::default());
    assert_eq!(
        (d.input_key.as_str(), d.metadata_key.as_str(), d.tool_key.as_str()),
        ("input", "metadata", "tools")
    );
    assert_eq!(
        (d.label_key, d.rollout_seed, d.rollout_shuffle, d.apply_chat_template),
        (None, 42, false, false)
    );

    let d = Cli::try_parse_from([
        "x",
        "--prompt-data",
        "/data/dapo.jsonl",
        "--input-key",
        "prompt",
        "--label-key",
        "label",
        "--apply-chat-template",
        "--apply-chat-template-kwargs",
        r#"{"enable_thinking": false}"#,
        "--rollout-shuffle",
        "--rollout-seed",
        "7",
        "--rollout-max-prompt-len",
        "1024",
    ])
    .unwrap()
    .data;
    assert_eq!(d.prompt_data.as_deref(), Some(Path::new("/data/dapo.jsonl")));
    assert_eq!(d.apply_chat_template_kwargs.get("enable_thinking"), Some(&json!(false)));
    assert!(d.apply_chat_template && d.rollout_shuffle);
    assert_eq!((d.rollout_seed, d.rollout_max_prompt_len), (7, Some(1024)));
    assert!(Cli::try_parse_from(["x", "--apply-chat-template-kwargs", "[1]"]).is_err());
    assert!(Cli::try_parse_from(["x", "--apply-chat-template-kwargs", "{oops"]).is_err());

    // The same names in a config file.
    let from_file: DataArgs = serde_json::from_value(json!({"input_key": "prompt", "rollout_shuffle": true})).unwrap();
    assert_eq!(
        from_file,
        DataArgs {
            input_key: "prompt".into(),
            rollout_shuffle: true,
            ..Default::default()
        }
    );
}
