//! The `exact_match` reward: 1 when the response is the label, character for character, else 0.
//!
//! vime's own type (slime's `rm_hub` has none), meant for synthetic tasks whose answer is one
//! canonical string ([`crate::task`]: `"12+35="` -> `"47"`), where any other output, `"047"` or
//! `"47 "` followed by more text, is wrong. Both sides are trimmed of surrounding whitespace, and
//! trailing end-of-sequence token texts ([`EOS_TEXTS`]) are dropped from the response, in case it
//! was decoded without `skip_special_tokens`.

/// End-of-sequence and padding token texts a response may end with when decoded with its
/// special tokens: vime's task tokenizer's, Qwen's, and the common `</s>`.
pub const EOS_TEXTS: [&str; 5] = ["<eos>", "<pad>", "<|endoftext|>", "<|im_end|>", "</s>"];

/// The response without surrounding whitespace and trailing [`EOS_TEXTS`].
pub fn strip_response(response: &str) -> &str {
    let mut s = response.trim();
    while let Some(rest) = EOS_TEXTS.iter().find_map(|t| s.strip_suffix(t)) {
        s = rest.trim();
    }
    s
}

/// 1.0 when the stripped response equals the trimmed label, else 0.0.
pub fn exact_match(response: &str, label: &str) -> f64 {
    if strip_response(response) == label.trim() {
        1.0
    } else {
        0.0
    }
}
