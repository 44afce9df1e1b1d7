//! The `dapo` reward (slime's `rm_hub/math_dapo_utils.py`, from DAPO / Minerva):
//! take the last 300 characters, find the last `Answer: ...` line, normalise it Minerva-style
//! and compare it as a string with the integer label. Returns `score` (+1 / -1), `acc` and
//! `pred`, like slime's dict (`--reward-key score` selects the score).
//!
//! The label must be a number (`str(int(float(label)))`); anything else is an error, where slime
//! raises.

const SUBSTITUTIONS: &[(&str, &str)] = &[
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
];

const REMOVED_EXPRESSIONS: &[&str] = &[
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    "\"",
    "\\dots",
    "<|im_end|>",
    "<|endoftext|>",
];

/// `re.sub(r"(\\CMD\{)(.*?)(\})", r"\2", line)`: unwrap every `\CMD{...}` (lazy, one line).
fn unwrap_command(line: &str, cmd: &str) -> String {
    let open = format!("\\{cmd}{{");
    let mut out = String::new();
    let mut rest = line;
    while let Some(i) = rest.find(&open) {
        let after = &rest[i + open.len()..];
        match after.find('}') {
            Some(j) => {
                out.push_str(&rest[..i]);
                out.push_str(&after[..j]);
                rest = &after[j + 1..];
            }
            None => break,
        }
    }
    out.push_str(rest);
    out
}

/// Apply a per-line substitution (Python's `.` does not match newlines).
fn per_line(s: &str, f: impl Fn(&str) -> String) -> String {
    s.split('\n').map(f).collect::<Vec<_>>().join("\n")
}

/// Minerva's `normalize_final_answer`.
pub fn normalize_final_answer(answer: &str) -> String {
    let mut s = answer.rsplit('=').next().unwrap_or("").to_string();
    for (before, after) in SUBSTITUTIONS {
        s = s.replace(before, after);
    }
    for e in REMOVED_EXPRESSIONS {
        s = s.replace(e, "");
    }
    // (.*?)(\$)(.*?)(\$)(.*) -> $\3$ : keep what is between the first two dollars of a line.
    s = per_line(&s, |line| {
        let mut it = line.splitn(3, '$');
        match (it.next(), it.next(), it.next()) {
            (Some(_), Some(mid), Some(_)) => format!("${mid}$"),
            _ => line.to_string(),
        }
    });
    s = per_line(&s, |l| unwrap_command(l, "text"));
    s = per_line(&s, |l| unwrap_command(l, "textbf"));
    s = per_line(&s, |l| unwrap_command(l, "overline"));
    // (\\boxed\{)(.*)(\}) -> \2 : greedy, up to the last `}` of the line.
    s = per_line(&s, |line| match line.find("\\boxed{") {
        Some(i) => match line.rfind('}') {
            Some(j) if j >= i + 7 => format!("{}{}{}", &line[..i], &line[i + 7..j], &line[j + 1..]),
            _ => line.to_string(),
        },
        None => line.to_string(),
    });
    // (frac)([^{])(.) -> frac{\2}{\3}
    s = per_line(&s, |line| {
        let cs: Vec<char> = line.chars().collect();
        let mut out = String::new();
        let mut i = 0;
        while i < cs.len() {
            if cs[i..].starts_with(&['f', 'r', 'a', 'c']) && i + 5 < cs.len() && cs[i + 4] != '{' {
                out.push_str(&format!("frac{{{}}}{{{}}}", cs[i + 4], cs[i + 5]));
                i += 6;
                continue;
            }
            out.push(cs[i]);
            i += 1;
        }
        out
    });
    // (sqrt)([^{]) -> sqrt{\2}
    s = per_line(&s, |line| {
        let cs: Vec<char> = line.chars().collect();
        let mut out = String::new();
        let mut i = 0;
        while i < cs.len() {
            if cs[i..].starts_with(&['s', 'q', 'r', 't']) && i + 4 < cs.len() && cs[i + 4] != '{' {
                out.push_str(&format!("sqrt{{{}}}", cs[i + 4]));
                i += 5;
                continue;
            }
            out.push(cs[i]);
            i += 1;
        }
        out
    });
    s = s.replace('$', "");
    let no_commas = s.replace(',', "");
    if !no_commas.is_empty() && no_commas.chars().all(|c| c.is_ascii_digit()) {
        s = no_commas;
    }
    s.trim().to_string()
}

/// `re.findall(r"(?i)Answer\s*:\s*([^\n]+)", s)[-1]`.
fn last_answer_line(s: &str) -> Option<String> {
    let cs: Vec<char> = s.chars().collect();
    let n = cs.len();
    let mut last = None;
    let mut i = 0;
    while i + 6 <= n {
        let word: String = cs[i..i + 6].iter().collect();
        if word.to_lowercase() != "answer" {
            i += 1;
            continue;
        }
        let mut k = i + 6;
        while k < n && cs[k].is_whitespace() {
            k += 1;
        }
        if k >= n || cs[k] != ':' {
            i += 1;
            continue;
        }
        let colon = k;
        let mut w = colon + 1;
        while w < n && cs[w].is_whitespace() {
            w += 1;
        }
        // \s* is greedy but gives back whitespace when [^\n]+ would otherwise be empty.
        let mut found = None;
        for p in (colon + 1..=w).rev() {
            if p < n && cs[p] != '\n' {
                let mut e = p;
                while e < n && cs[e] != '\n' {
                    e += 1;
                }
                found = Some((p, e));
                break;
            }
        }
        match found {
            Some((p, e)) => {
                last = Some(cs[p..e].iter().collect());
                i = e.max(i + 1);
            }
            None => i += 1,
        }
    }
    last
}

/// Python's `str(int(float(label)))` on a normalised label.
fn integer_label(label: &str) -> Option<String> {
    let t = label.trim().replace('_', "");
    let x: f64 = t.parse().ok()?;
    if !x.is_finite() {
        return None;
    }
    Some(format!("{}", x.trunc() as i128))
}

/// slime's `compute_score` for `--rm-type dapo`: `(score, acc, pred)`.
pub fn dapo_score(solution: &str, label: &str) -> anyhow::Result<(f64, bool, String)> {
    let chars: Vec<char> = solution.chars().collect();
    let tail: String = chars[chars.len().saturating_sub(300)..].iter().collect();
    let extracted = last_answer_line(&tail).unwrap_or_else(|| "[INVALID]".to_string());
    let pred = normalize_final_answer(&extracted);
    let gt_norm = normalize_final_answer(label);
    let gt = integer_label(&gt_norm).ok_or_else(|| {
        anyhow::anyhow!("dapo reward: label {label:?} is not a number (math_dapo compares integer answers)")
    })?;
    let correct = pred == gt;
    Ok((if correct { 1.0 } else { -1.0 }, correct, pred))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn minerva_normalisation() {
        assert_eq!(normalize_final_answer("$\\boxed{1,000}$"), "1000");
        assert_eq!(normalize_final_answer("x = 12 dollars"), "12");
        assert_eq!(normalize_final_answer("\\frac12"), "\\frac{1}{2}");
        assert_eq!(normalize_final_answer("\\text{5}"), "5");
    }

    #[test]
    fn answer_lines() {
        assert_eq!(last_answer_line("Answer: 3\nmore\nanswer : 42"), Some("42".into()));
        assert_eq!(last_answer_line("no answer here"), None);
    }
}
