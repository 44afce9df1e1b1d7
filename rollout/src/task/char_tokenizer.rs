//! A character-level tokenizer in HF format: one token per character, for synthetic tasks whose
//! alphabet is a handful of characters (a vocabulary of ~20 keeps a CPU demo model tiny).
//!
//! Decisions:
//! - Id layout: the special tokens first (ids `0..special.len()`), then each character of `chars`
//!   in the order given. `special[0]` is the `eos_token`; `special[1]` the `pad_token` (without
//!   one, the pad is the eos). There is no bos token, and encoding adds no special tokens.
//! - `tokenizer.json` is a `WordLevel` model behind a `Split` pre-tokenizer that isolates every
//!   character (regex `[\s\S]`, which unlike `.` also matches a newline), and a `Fuse` decoder
//!   that concatenates tokens (the default decoder would join them with spaces), so
//!   `decode(encode(s)) == s`, spaces included when `' '` is in `chars`. Special tokens are
//!   `added_tokens` with `special: true`, dropped by `decode(ids, skip_special_tokens=true)`.
//! - A character outside `chars` is an error at encode time, not an `<unk>` id: the model has no
//!   `<unk>` in its vocabulary, so encoding fails with the `tokenizers` error "Missing \[UNK\]
//!   token from the vocabulary". A synthetic task generates every prompt itself, so such a
//!   character is a bug to surface, not text to approximate.
//! - `tokenizer_config.json` names `tokenizer_class: PreTrainedTokenizerFast`, so `AutoTokenizer`
//!   loads `tokenizer.json` as is even beside a Qwen3 `config.json` (whose model type would pick
//!   `Qwen2Tokenizer`). It has no chat template, and `clean_up_tokenization_spaces: false` keeps
//!   decoding from rewriting spaces.
//!
//! Checked by hand with transformers 5.17.0 / tokenizers 0.23.3 in Python, on `write_task`
//! outputs: `AutoTokenizer.from_pretrained(dir)`, with and without a Qwen3 `config.json` beside
//! it, loads a `TokenizersBackend` (v5's `PreTrainedTokenizerFast`) with the same vocab size and
//! eos/pad ids (0/1, no bos) as this crate, encodes `"12+35="`, `"-3*7="` and `"99-1="` to the
//! same ids with or without `add_special_tokens`, decodes with and without skipping `<eos>`,
//! round-trips text with spaces and newlines, and raises on an unknown character.
use anyhow::{bail, Context, Result};
use serde_json::{json, Map, Value as Json};
use std::collections::HashSet;
use std::path::Path;

use super::write_atomic;

/// `model_max_length` in `tokenizer_config.json`: a bound for truncation warnings only; the
/// model's own `max_position_embeddings` is the real limit.
pub const MODEL_MAX_LENGTH: usize = 32768;

/// Writes `dir/tokenizer.json` and `dir/tokenizer_config.json` (the folder is created if
/// needed). See the module doc for the id layout: `special` first, then `chars`.
pub fn write_char_tokenizer(dir: &Path, chars: &str, special: &[&str]) -> Result<()> {
    let Some(&eos) = special.first() else {
        bail!("a char tokenizer needs at least one special token (the eos token)");
    };
    let pad = special.get(1).copied().unwrap_or(eos);
    if chars.is_empty() {
        bail!("a char tokenizer needs at least one character");
    }
    let mut seen = HashSet::new();
    let tokens: Vec<String> = special
        .iter()
        .map(|s| s.to_string())
        .chain(chars.chars().map(String::from))
        .collect();
    for t in &tokens {
        if t.is_empty() {
            bail!("a special token is the empty string");
        }
        if !seen.insert(t.as_str()) {
            bail!("token {t:?} appears twice in the char tokenizer's special tokens + characters");
        }
    }

    let vocab: Map<String, Json> = tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (t.clone(), json!(id)))
        .collect();
    let added_tokens: Vec<Json> = special
        .iter()
        .enumerate()
        .map(|(id, t)| {
            json!({
                "id": id, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": true,
            })
        })
        .collect();
    let tokenizer = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added_tokens,
        "normalizer": null,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "[\\s\\S]"}, "behavior": "Isolated", "invert": false},
        "post_processor": null,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"},
    });
    let config = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": null,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": null,
        "model_max_length": MODEL_MAX_LENGTH,
        "clean_up_tokenization_spaces": false,
    });

    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    write_atomic(
        &dir.join("tokenizer.json"),
        (serde_json::to_string_pretty(&tokenizer)? + "\n").as_bytes(),
    )?;
    write_atomic(
        &dir.join("tokenizer_config.json"),
        (serde_json::to_string_pretty(&config)? + "\n").as_bytes(),
    )?;
    Ok(())
}
