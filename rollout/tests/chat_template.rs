//! Chat templates and tokenization against HF transformers, on the real Qwen3 tokenizer.
//!
//! Fixtures: tests/fixtures/chat/{cases.jsonl, prompt_digests.json}, written by
//! tests/fixtures/gen_chat_template_fixtures.py with transformers 5.17 (`apply_chat_template(...,
//! tokenize=False)`, `tokenizer(text, add_special_tokens=False)`, `decode`). Every check is exact:
//! the same bytes, the same ids.
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use vime_rollout::data::{parse_json, ChatOptions, DataArgs, PromptDataset, TemplateValue, Tokenizer};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn qwen3() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        Tokenizer::from_dir(repo().join("tests/assets/qwen3-tokenizer")).expect("vendored Qwen3 tokenizer")
    })
}

/// FNV-1a 64 over the ids as little-endian u32 bytes, as `"<len>:<hex>"` (the generator's digest).
fn digest(ids: &[u32]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for id in ids {
        for b in id.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    format!("{}:{h:016x}", ids.len())
}

/// Where two strings first differ, for a readable failure.
fn first_difference(a: &str, b: &str) -> String {
    let i = a
        .char_indices()
        .zip(b.chars())
        .find(|((_, x), y)| x != y)
        .map(|((i, _), _)| i)
        .unwrap_or(a.len().min(b.len()));
    let ctx = |s: &str| {
        s.get(i.saturating_sub(40)..(i + 40).min(s.len()))
            .unwrap_or("")
            .to_string()
    };
    format!(
        "first difference at byte {i}:\n  vime: {:?}\n  hf:   {:?}",
        ctx(a),
        ctx(b)
    )
}

struct Case {
    name: String,
    messages: Option<TemplateValue>,
    opts: ChatOptions,
    text: String,
    ids: Vec<u32>,
    decoded: String,
    decoded_skip_special: String,
}

fn cases() -> Vec<Case> {
    let path = repo().join("tests/fixtures/chat/cases.jsonl");
    let body = std::fs::read_to_string(&path).unwrap();
    body.lines()
        .map(|line| {
            // Parsed twice: as a template value (key order kept, for tools and tool-call arguments)
            // and as serde_json for the plain fields.
            let v = parse_json(line).unwrap();
            let j: serde_json::Value = serde_json::from_str(line).unwrap();
            let some = |key: &str| Some(v.get_attr(key).unwrap()).filter(|x| !x.is_none());
            let mut opts = ChatOptions {
                add_generation_prompt: j["add_generation_prompt"].as_bool().unwrap(),
                tools: some("tools"),
                ..Default::default()
            };
            let kwargs = v.get_attr("kwargs").unwrap();
            for key in kwargs.try_iter().unwrap() {
                opts.kwargs
                    .insert(key.as_str().unwrap().to_string(), kwargs.get_item(&key).unwrap());
            }
            Case {
                name: j["name"].as_str().unwrap().to_string(),
                messages: some("messages"),
                opts,
                text: j["text"].as_str().unwrap().to_string(),
                ids: serde_json::from_value(j["ids"].clone()).unwrap(),
                decoded: j["decoded"].as_str().unwrap().to_string(),
                decoded_skip_special: j["decoded_skip_special"].as_str().unwrap().to_string(),
            }
        })
        .collect()
}

#[test]
fn chat_template_text_equals_hf_byte_for_byte() {
    let tok = qwen3();
    let cases = cases();
    let rendered: Vec<_> = cases.iter().filter(|c| c.messages.is_some()).collect();
    assert!(rendered.len() >= 8, "the fixture should hold at least 8 conversations");
    for case in rendered {
        let got = tok
            .apply_chat_template(case.messages.as_ref().unwrap(), &case.opts)
            .unwrap();
        assert!(
            got == case.text,
            "case {}: {}",
            case.name,
            first_difference(&got, &case.text)
        );
    }
}

#[test]
fn token_ids_and_decoding_equal_hf() {
    let tok = qwen3();
    for case in cases() {
        let ids = tok.encode(&case.text).unwrap();
        assert_eq!(ids, case.ids, "case {}: ids", case.name);
        assert_eq!(
            tok.decode(&ids, false).unwrap(),
            case.decoded,
            "case {}: decode",
            case.name
        );
        assert_eq!(
            tok.decode(&ids, true).unwrap(),
            case.decoded_skip_special,
            "case {}: decode(skip_special_tokens)",
            case.name
        );
    }
}

#[test]
fn qwen3_special_tokens() {
    let tok = qwen3();
    assert_eq!(tok.vocab_size(), 151_669);
    assert_eq!(tok.special_token("eos_token"), Some("<|im_end|>"));
    assert_eq!(tok.eos_token_id(), Some(151_645));
    assert_eq!(tok.pad_token_id(), Some(151_643));
    assert_eq!(tok.token_to_id("<think>"), Some(151_667));
    assert_eq!(tok.token_to_id("</think>"), Some(151_668));
    assert_eq!(tok.special_token("bos_token"), None);
    // Engines and the server share one tokenizer across threads.
    fn send_sync<T: Send + Sync>(_: &T) {}
    send_sync(tok);
}

/// Every GSM8K-test and MATH-500 prompt, raw and through slime's `--apply-chat-template` path
/// (with and without `enable_thinking: false`), tokenizes to HF's ids.
#[test]
fn every_math_prompt_tokenizes_as_hf() {
    let tok = qwen3();
    let path = repo().join("tests/fixtures/chat/prompt_digests.json");
    let fixture: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let sets = fixture["sets"].as_array().unwrap();
    assert_eq!(sets.len(), 6);
    for set in sets {
        let args = DataArgs {
            input_key: "prompt".into(),
            label_key: Some("label".into()),
            apply_chat_template: set["apply_chat_template"].as_bool().unwrap(),
            apply_chat_template_kwargs: set["kwargs"].as_object().unwrap().clone(),
            ..Default::default()
        };
        let file = set["file"].as_str().unwrap();
        let ds = PromptDataset::load(repo().join(file), &args, tok).unwrap();
        let want: Vec<&str> = set["digests"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_str().unwrap())
            .collect();
        assert_eq!(ds.len(), want.len(), "{file}");
        for (sample, want) in ds.samples().iter().zip(want) {
            assert_eq!(
                digest(&sample.prompt_ids),
                want,
                "{file}:{} (template {})",
                sample.line,
                args.apply_chat_template
            );
        }
    }
}
