//! `\boxed{}` extraction.
//!
//! [`last_boxed_only_string`] and [`remove_boxed`] are slime's (`rm_hub/math_utils.py`):
//! the last `\boxed` (or `\fbox` when there is no `\boxed`) with balanced braces, and its
//! content only when it starts with `\boxed{`. [`last_boxed_answer`] is what the reward
//! functions use: the same, but also accepting `\fbox{...}` and the brace-less `\boxed 5`
//! (verl's form), which slime scores 0.

/// The last `\boxed...{...}` (or `\fbox`) span with balanced braces, as slime finds it.
pub fn last_boxed_only_string(s: &str) -> Option<&str> {
    let idx = s.rfind("\\boxed").or_else(|| s.rfind("\\fbox"))?;
    let mut depth = 0i32;
    for (i, b) in s.bytes().enumerate().skip(idx) {
        match b {
            b'{' => depth += 1,
            b'}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&s[idx..=i]);
                }
            }
            _ => {}
        }
    }
    None
}

/// `\boxed{x}` -> `x`; anything else (including `\fbox{x}`) -> `None`, as in slime.
pub fn remove_boxed(s: &str) -> Option<&str> {
    s.strip_prefix("\\boxed{")?.strip_suffix('}')
}

/// slime's `extract_answer`: the last boxed content, only if the text mentions `\boxed`.
pub fn slime_extract_answer(passage: &str) -> Option<&str> {
    if !passage.contains("\\boxed") {
        return None;
    }
    remove_boxed(last_boxed_only_string(passage)?)
}

/// Content of the last `\boxed{...}`, `\fbox{...}` or `\boxed x` in `text` (nested braces kept).
pub fn last_boxed_answer(text: &str) -> Option<String> {
    let mut end = text.len();
    loop {
        let boxed = text[..end].rfind("\\boxed");
        let fbox = text[..end].rfind("\\fbox");
        let (start, cmd) = match (boxed, fbox) {
            (None, None) => return None,
            (Some(b), Some(f)) if f > b => (f, "\\fbox"),
            (Some(b), _) => (b, "\\boxed"),
            (None, Some(f)) => (f, "\\fbox"),
        };
        if let Some(content) = boxed_content_at(text, start + cmd.len()) {
            return Some(content);
        }
        end = start;
    }
}

/// The argument of a box command whose name ends at byte `after`.
fn boxed_content_at(text: &str, after: usize) -> Option<String> {
    let rest = &text[after..];
    let trimmed = rest.trim_start();
    if let Some(inner) = trimmed.strip_prefix('{') {
        let mut depth = 1i32;
        for (i, b) in inner.bytes().enumerate() {
            match b {
                b'{' => depth += 1,
                b'}' => {
                    depth -= 1;
                    if depth == 0 {
                        return Some(inner[..i].to_string());
                    }
                }
                _ => {}
            }
        }
        return None;
    }
    // `\boxed 5$`: up to the closing `$` (or the end of the line), as verl does.
    if rest.starts_with(' ') {
        let content = trimmed.split(['$', '\n']).next().unwrap_or("").trim();
        if !content.is_empty() {
            return Some(content.to_string());
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slime_forms() {
        assert_eq!(
            last_boxed_only_string("a \\boxed{1} b \\boxed{\\frac{1}{2}} c"),
            Some("\\boxed{\\frac{1}{2}}")
        );
        assert_eq!(remove_boxed("\\boxed{x}"), Some("x"));
        assert_eq!(remove_boxed("\\fbox{x}"), None);
        assert_eq!(slime_extract_answer("\\fbox{3}"), None);
    }

    #[test]
    fn lenient_forms() {
        assert_eq!(
            last_boxed_answer("so \\boxed{\\frac{1}{\\sqrt{2}}}."),
            Some("\\frac{1}{\\sqrt{2}}".into())
        );
        assert_eq!(last_boxed_answer("$\\boxed 5$"), Some("5".into()));
        assert_eq!(last_boxed_answer("\\fbox{7}"), Some("7".into()));
        assert_eq!(last_boxed_answer("\\boxed{1} then \\boxed{"), Some("1".into()));
        assert_eq!(last_boxed_answer("no box"), None);
    }
}
