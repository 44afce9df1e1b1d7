//! LaTeX clean-up before parsing, matching what math-verify's `normalize_latex` does:
//! `\boxed{}` extraction, `\left`/`\right`, `\dfrac`/`\tfrac`, `\text{...}` units at the end,
//! "and"/"or" lists, percent words, `\frac12`, `\sqrt3`, `a/b`, a leading `.`, and so on.
//!
//! Everything is written as small scanners over `Vec<char>` (no regex engine); each function
//! names the upstream pattern it stands for. Positions are in chars, as Python's are.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BoxedMode {
    /// Join every `\boxed{}` content with commas.
    All,
    /// The last `\boxed{}`, plus the ones right before it when they look like one list.
    Last,
    None,
}

fn chars(s: &str) -> Vec<char> {
    s.chars().collect()
}

fn starts_at(t: &[char], i: usize, pat: &str) -> bool {
    let mut rest = t.get(i..).unwrap_or(&[]).iter();
    pat.chars().all(|p| rest.next() == Some(&p))
}

fn rfind(t: &[char], pat: &str, end: usize) -> Option<usize> {
    let n = pat.chars().count();
    if n > end {
        return None;
    }
    (0..=end - n).rev().find(|&i| starts_at(t, i, pat))
}

fn is_word(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Content of `\boxed{...}` / `\fbox{...}` searched from the right (math-verify's
/// `extract_boxed_content`). Returns `text` unchanged when there is no box.
pub fn extract_boxed_content(text: &str, mode: BoxedMode) -> String {
    let t = chars(text);
    let mut results: Vec<String> = Vec::new();
    let mut current = t.len();
    let mut max_pos = t.len();
    let mut last_boxed_start: Option<usize> = None;
    let content_end_of = |open: usize, max_pos: usize| -> Option<usize> {
        let mut depth = 1;
        let mut i = open;
        while i + 1 < max_pos {
            i += 1;
            if t[i] == '{' {
                depth += 1;
            } else if t[i] == '}' {
                depth -= 1;
                if depth == 0 {
                    return Some(i);
                }
            }
        }
        None
    };
    loop {
        let boxed = rfind(&t, "\\boxed", current);
        let fbox = rfind(&t, "\\fbox", current);
        let (start, cmd_len) = match (boxed, fbox) {
            (None, None) => break,
            (Some(b), Some(f)) if f > b => (f, 5),
            (Some(b), _) => (b, 6),
            (None, Some(f)) => (f, 5),
        };
        let mut next = start + cmd_len;
        while next < max_pos && t[next].is_whitespace() {
            next += 1;
        }
        if next >= max_pos {
            break;
        }
        if t[next] == '{' {
            let Some(close) = content_end_of(next, max_pos) else {
                if results.is_empty() {
                    results.push(t[next..].iter().collect());
                }
                break;
            };
            let content: String = t[next + 1..close].iter().collect::<String>().trim().to_string();
            if mode == BoxedMode::Last {
                if let Some(prev_start) = last_boxed_start {
                    let between: Vec<char> = t[(close + 1).min(prev_start)..prev_start].to_vec();
                    let prev = results.last().cloned().unwrap_or_default();
                    let close_enough = between.len() < 10;
                    let separated = content != prev && between.len() < 70 && has_list_separator(&between);
                    if !(close_enough || separated) {
                        break;
                    }
                }
            }
            if results.last() != Some(&content) {
                results.push(content);
            }
            last_boxed_start = Some(start);
            max_pos = start;
        } else {
            if results.is_empty() {
                results.push(t[next..].iter().collect());
            }
            break;
        }
        current = start;
    }
    if results.is_empty() {
        return text.to_string();
    }
    results.reverse();
    results.join(",")
}

/// `\b(and|or)\b|,|;`
fn has_list_separator(t: &[char]) -> bool {
    if t.iter().any(|c| *c == ',' || *c == ';') {
        return true;
    }
    for (i, _) in t.iter().enumerate() {
        for w in ["and", "or"] {
            let n = w.len();
            if starts_at(t, i, w) && (i == 0 || !is_word(t[i - 1])) && t.get(i + n).is_none_or(|c| !is_word(*c)) {
                return true;
            }
        }
    }
    false
}

const LEFT_DELIMS: &[&str] = &[
    "\\{",
    "{",
    "\\|",
    "|",
    "[",
    "(",
    "\\rbracl",
    "\\lgroup",
    "\\lbrace",
    "\\lbrack",
    "\\vert",
    "\\lvert",
    "\\lceil",
    "\\lfloor",
    "\\vert",
    "\\lvert",
    "\\langle",
    "\\llcorner",
    "\\ulcorner",
];
const RIGHT_DELIMS: &[&str] = &[
    "\\}",
    "}",
    "\\|",
    "|",
    "]",
    ")",
    "\\rbrack",
    "\\rgroup",
    "\\rbrace",
    "\\rbrack",
    "\\vert",
    "\\rvert",
    "\\rceil",
    "\\rfloor",
    "\\vert",
    "\\rvert",
    "\\rangle",
    "\\lrcorner",
    "\\urcorner",
];

/// `\\m?left(DELIM)` -> `DELIM` (and the same for `\right`).
fn strip_left_right(t: &[char], word: &str, delims: &[&str]) -> Vec<char> {
    let mut out = Vec::with_capacity(t.len());
    let mut i = 0;
    while i < t.len() {
        if t[i] == '\\' {
            let mut k = i + 1;
            if t.get(k) == Some(&'m') && starts_at(t, k + 1, word) {
                k += 1;
            }
            if starts_at(t, k, word) {
                let after = k + word.len();
                if let Some(d) = delims.iter().find(|d| starts_at(t, after, d)) {
                    out.extend(d.chars());
                    i = after + d.chars().count();
                    continue;
                }
            }
        }
        out.push(t[i]);
        i += 1;
    }
    out
}

/// math-verify's `to_remove_regex`: `\mathrm{th}`, `\!`, empty `\text{}`, dollars, quotes,
/// `\displaystyle`.
fn remove_noise(t: &[char]) -> Vec<char> {
    let mut out = Vec::with_capacity(t.len());
    let mut i = 0;
    while i < t.len() {
        if starts_at(t, i, "\\mathrm{th}") {
            i += 11;
            continue;
        }
        if starts_at(t, i, "\\!") {
            i += 2;
            while i < t.len() && t[i].is_whitespace() {
                i += 1;
            }
            continue;
        }
        if starts_at(t, i, "\\text") {
            let mut k = i + 5;
            while k < t.len() && t[k].is_whitespace() {
                k += 1;
            }
            if t.get(k) == Some(&'{') {
                k += 1;
                while k < t.len() && t[k].is_whitespace() {
                    k += 1;
                }
                if t.get(k) == Some(&'}') {
                    i = k + 1;
                    continue;
                }
            }
        }
        if starts_at(t, i, "\\$") {
            i += 2;
            continue;
        }
        if t[i] == '$' {
            i += 1;
            continue;
        }
        if (t[i] == '"' || t[i] == '\'') && (i == 0 || t[i - 1] != '\\') {
            i += 1;
            continue;
        }
        if starts_at(t, i, "\\displaystyle") {
            i += 13;
            continue;
        }
        out.push(t[i]);
        i += 1;
    }
    out
}

/// `runs[i]`: where the whitespace run starting at `i` ends (`i` itself when `t[i]` is not
/// whitespace), for every `i` in `0..=t.len()`. Computed once per string: scanning the run again
/// at every position made long whitespace runs quadratic (found by fuzzing).
fn ws_runs(t: &[char]) -> Vec<usize> {
    let mut runs = vec![t.len(); t.len() + 1];
    for i in (0..t.len()).rev() {
        runs[i] = if t[i].is_whitespace() { runs[i + 1] } else { i };
    }
    runs
}

fn word_boundary(t: &[char], i: usize) -> bool {
    let before = i > 0 && is_word(t[i - 1]);
    let after = i < t.len() && is_word(t[i]);
    before != after
}

/// One replacement tried at `i`: `Some((consumed, replacement))`.
fn replacement_at(t: &[char], runs: &[usize], i: usize) -> Option<(usize, &'static str)> {
    let c = t[i];
    // `\s*` from k: where the whitespace run at k ends.
    let ws = |k: usize| runs.get(k).copied().unwrap_or(k);
    // math: \\math(?:rm|it|bf)
    for w in ["\\mathrm", "\\mathit", "\\mathbf"] {
        if starts_at(t, i, w) {
            return Some((7, "\\text"));
        }
    }
    // text: \\text(?:normal|bf|it|rm)
    for w in ["\\textnormal", "\\textbf", "\\textit", "\\textrm"] {
        if starts_at(t, i, w) {
            return Some((w.len(), "\\text"));
        }
    }
    // frac: \\(?:d|t|c)frac
    for w in ["\\dfrac", "\\tfrac", "\\cfrac"] {
        if starts_at(t, i, w) {
            return Some((6, "\\frac"));
        }
    }
    // decimal_space: \s\.
    if c.is_whitespace() && t.get(i + 1) == Some(&'.') {
        return Some((2, " 0."));
    }
    // decimal_brace: \{\.
    if c == '{' && t.get(i + 1) == Some(&'.') {
        return Some((2, "{0."));
    }
    // approx: ~=
    if c == '~' && t.get(i + 1) == Some(&'=') {
        return Some((2, "\\approx"));
    }
    // comma: \s*\{\s*,\s*\}
    {
        let k = ws(i);
        if t.get(k) == Some(&'{') {
            let k = ws(k + 1);
            if t.get(k) == Some(&',') {
                let k = ws(k + 1);
                if t.get(k) == Some(&'}') {
                    return Some((k + 1 - i, ","));
                }
            }
        }
    }
    // and_or: (?<![a-zA-Z])(,?\s*(?:and|or))(?![a-zA-Z])
    if i == 0 || !t[i - 1].is_ascii_alphabetic() {
        let mut k = i;
        if t.get(k) == Some(&',') {
            k += 1;
        }
        // \s* is greedy and "and"/"or" cannot start with a space, so only the full run counts.
        let k = ws(k);
        for w in ["and", "or"] {
            if starts_at(t, k, w) && !t.get(k + w.len()).is_some_and(|c| c.is_ascii_alphabetic()) {
                return Some((k + w.len() - i, ","));
            }
        }
    }
    // and_or_text: ,?\s*\\text{\s*(?:and|or)\s*}
    {
        let mut k = i;
        if t.get(k) == Some(&',') {
            k += 1;
        }
        let k = ws(k);
        if starts_at(t, k, "\\text{") {
            let k = ws(k + 6);
            for w in ["and", "or"] {
                if starts_at(t, k, w) {
                    let m = ws(k + w.len());
                    if t.get(m) == Some(&'}') {
                        return Some((m + 1 - i, ","));
                    }
                }
            }
        }
    }
    // backslash_space: (?<!\\)\\\s
    if c == '\\' && t.get(i + 1).is_some_and(|c| c.is_whitespace()) && (i == 0 || t[i - 1] != '\\') {
        return Some((2, " "));
    }
    // infinity
    if starts_at(t, i, "infinity") {
        return Some((8, "\\infty"));
    }
    // dot: ,?(\\ldots)
    if c == ',' && starts_at(t, i + 1, "\\ldots") {
        return Some((7, " "));
    }
    if starts_at(t, i, "\\ldots") {
        return Some((6, " "));
    }
    // percentage / percent / pct words, and their \text{} forms.
    for (word, text_form) in [
        ("percentage", "\\text{percentage}"),
        ("percent", "\\text{percent}"),
        ("pct", "\\text{pct}"),
    ] {
        let k = ws(i);
        if starts_at(t, k, word) && word_boundary(t, k) && word_boundary(t, k + word.len()) {
            return Some((k + word.len() - i, "\\%"));
        }
        if starts_at(t, i, text_form) {
            return Some((text_form.len(), "%"));
        }
    }
    // inf: (?<!\\)inf(?!inity)
    if starts_at(t, i, "inf") && (i == 0 || t[i - 1] != '\\') && !starts_at(t, i + 3, "inity") {
        return Some((3, "\\infty"));
    }
    // sqrt: " sqrt"
    if c == ' ' && starts_at(t, i + 1, "sqrt") {
        return Some((5, "\\sqrt"));
    }
    None
}

/// math-verify's `replace_in_latex`: one left-to-right pass over all the replacement patterns.
fn replace_in_latex(t: &[char]) -> Vec<char> {
    let mut out = Vec::with_capacity(t.len());
    let runs = ws_runs(t);
    let mut i = 0;
    while i < t.len() {
        if let Some((n, rep)) = replacement_at(t, &runs, i) {
            out.extend(rep.chars());
            i += n.max(1);
        } else {
            out.push(t[i]);
            i += 1;
        }
    }
    out
}

const UNITS: &[&str] = &[
    "integerpoint",
    "feet",
    "sue",
    "digit",
    "pound",
    "meal",
    "edge",
    "student",
    "children ticket",
    "multiple",
    "east",
    "degree",
    "mph",
    "kmph",
    "ft",
    "m square",
    " m east",
    "sq m",
    "deg",
    "mile",
    "q .",
    "monkey",
    "prime",
    "ratio",
    "profit of rs",
    "rd",
    "o",
    "gm",
    "p . m",
    "lb",
    "tile",
    "per",
    "dm",
    "lt",
    "gain",
    "ab",
    "way",
    "west",
    "a .",
    "b .",
    "c .",
    "d .",
    "e .",
    "f .",
    "g .",
    "h .",
    "t",
    "h",
    "no change",
    "men",
    "soldier",
    "pie",
    "bc",
    "excess",
    "st",
    "inches",
    "noon",
    "cent",
    "by",
    "gal",
    "kmh",
    "c",
    "acre",
    "rise",
    "a . m",
    "th",
    "π r 2",
    "sq",
    "mark",
    "l",
    "toy",
    "coin",
    "sq . m",
    "gallon",
    "° f",
    "profit",
    "minw",
    "yr",
    "women",
    "am",
    "pm",
    "hr",
    "cu cm",
    "square",
    "v â € ™",
    "are",
    "rupee",
    "rounds",
    "cubic",
    "cc",
    "mtr",
    "s",
    "ohm",
    "number",
    "kmph",
    "day",
    "hour",
    "minute",
    "min",
    "second",
    "man",
    "woman",
    "sec",
    "cube",
    "mt",
    "sq inch",
    "mp",
    "∏ cm ³",
    "hectare",
    "more",
    "sec",
    "unit",
    "cu . m",
    "cm 2",
    "rs .",
    "rs",
    "kg",
    "g",
    "month",
    "km",
    "m",
    "cm",
    "mm",
    "apple",
    "liter",
    "loss",
    "yard",
    "pure",
    "year",
    "increase",
    "decrease",
    "d",
    "less",
    "Surface",
    "litre",
    "pi sq m",
    "s .",
    "metre",
    "meter",
    "inch",
];

/// `(\d|\}|\s)\s*(?:UNIT)(?:s|es)?\s*$` -> the first group: a unit word ending the string.
fn strip_unit_word(t: &[char]) -> Vec<char> {
    // Where the trailing whitespace starts: `\s*$` from e is `e >= trailing`.
    let mut trailing = t.len();
    while trailing > 0 && t[trailing - 1].is_whitespace() {
        trailing -= 1;
    }
    let tail_is_unit = |k: usize| -> bool {
        // t[k..] must be UNIT (s|es)? \s* $
        UNITS.iter().any(|u| {
            if !starts_at(t, k, u) {
                return false;
            }
            let mut e = k + u.chars().count();
            let rest_ws = |e: usize| e >= trailing;
            if rest_ws(e) {
                return true;
            }
            if t.get(e) == Some(&'s') && rest_ws(e + 1) {
                return true;
            }
            if starts_at(t, e, "es") {
                e += 2;
                return rest_ws(e);
            }
            false
        })
    };
    // A unit can only start where the whitespace run after p ends, or up to `lead` characters
    // before (units that begin with a space): trying every k of the run, for every p in it, made
    // long runs quadratic (found by fuzzing: 4000 spaces inside `$...$` took 2.6 s).
    let lead = UNITS
        .iter()
        .map(|u| u.chars().take_while(|c| c.is_whitespace()).count())
        .max()
        .unwrap_or(0);
    let run_end = ws_runs(t);
    for p in 0..t.len() {
        let c = t[p];
        if !(c.is_numeric() || c == '}' || c.is_whitespace()) {
            continue;
        }
        // \s* is greedy but may give back: any k in p+1..=ws_end that can start a unit.
        let ws_end = run_end[p + 1];
        for k in (ws_end.saturating_sub(lead).max(p + 1)..=ws_end).rev() {
            if tail_is_unit(k) {
                return t[..=p].to_vec();
            }
        }
    }
    t.to_vec()
}

/// `(\\(?:text|mbox){.*?})(\^\d|\{\^\d\})?$` -> "": a trailing `\text{...}` (units).
fn strip_unit_text(t: &[char]) -> Vec<char> {
    let n = t.len();
    // The string must end in `}` or `}^d` (`}{^d}` ends in `}` too); `.*?` can reach that `}`.
    let close = if n >= 1 && t[n - 1] == '}' {
        n - 1
    } else if n >= 3 && t[n - 1].is_ascii_digit() && t[n - 2] == '^' && t[n - 3] == '}' {
        n - 3
    } else {
        return t.to_vec();
    };
    for i in 0..n {
        for w in ["\\text{", "\\mbox{"] {
            if starts_at(t, i, w) && i + w.len() <= close {
                return t[..i].to_vec();
            }
        }
    }
    t.to_vec()
}

/// `\^\s?\((.*?)\)` -> `^{...}` and friends (math-verify's malformed operators).
fn fix_malformed_operators(t: &[char]) -> Vec<char> {
    let mut t = t.to_vec();
    // ^(x) -> ^{x}
    t = sub_all(&t, |t, i| {
        if t[i] != '^' {
            return None;
        }
        let mut k = i + 1;
        if t.get(k).is_some_and(|c| c.is_whitespace()) {
            k += 1;
        }
        if t.get(k) != Some(&'(') {
            return None;
        }
        let close = (k + 1..t.len()).find(|&m| t[m] == ')')?;
        let inner: String = t[k + 1..close].iter().collect();
        Some((close + 1 - i, format!("^{{{inner}}}")))
    });
    // sqrt(x) -> \sqrt{x}
    t = sub_all(&t, |t, i| {
        if !starts_at(t, i, "sqrt") {
            return None;
        }
        let mut k = i + 4;
        if t.get(k).is_some_and(|c| c.is_whitespace()) {
            k += 1;
        }
        if t.get(k) != Some(&'(') {
            return None;
        }
        let close = (k + 1..t.len()).find(|&m| t[m] == ')')?;
        let inner: String = t[k + 1..close].iter().collect();
        Some((close + 1 - i, format!("\\sqrt{{{inner}}}")))
    });
    // \frac\s?(\d)\s?(\d+) -> \frac{a}{bc}, and \log_\s?(\d)\s?(\d+) -> \log_{a}{bc}
    for cmd in ["\\frac", "\\log_"] {
        t = sub_all(&t, |t, i| {
            let (len, a, b) = digit_then_digits_after(t, i, cmd)?;
            Some((len, format!("{cmd}{{{a}}}{{{b}}}")))
        });
    }
    // \frac\s?{(.*?)}\s?(\d) -> \frac{..}{d}
    t = sub_all(&t, |t, i| {
        if !starts_at(t, i, "\\frac") {
            return None;
        }
        let mut k = i + 5;
        if t.get(k).is_some_and(|c| c.is_whitespace()) {
            k += 1;
        }
        if t.get(k) != Some(&'{') {
            return None;
        }
        // Lazy `.*?}` followed by `\s?\d`: the first `}` that is followed by an optional space and a digit.
        for close in k + 1..t.len() {
            if t[close] != '}' {
                continue;
            }
            let mut m = close + 1;
            if t.get(m).is_some_and(|c| c.is_whitespace()) && t.get(m + 1).is_some_and(|c| c.is_ascii_digit()) {
                m += 1;
            }
            if let Some(d) = t.get(m).filter(|c| c.is_ascii_digit()) {
                let inner: String = t[k + 1..close].iter().collect();
                return Some((m + 1 - i, format!("\\frac{{{inner}}}{{{d}}}")));
            }
        }
        None
    });
    // \frac\s?(\d)\s?{(.*?)} -> \frac{d}{..}
    t = sub_all(&t, |t, i| {
        if !starts_at(t, i, "\\frac") {
            return None;
        }
        let mut k = i + 5;
        if t.get(k).is_some_and(|c| c.is_whitespace()) {
            k += 1;
        }
        let d = *t.get(k).filter(|c| c.is_ascii_digit())?;
        k += 1;
        if t.get(k).is_some_and(|c| c.is_whitespace()) {
            k += 1;
        }
        if t.get(k) != Some(&'{') {
            return None;
        }
        let close = (k + 1..t.len()).find(|&m| t[m] == '}')?;
        let inner: String = t[k + 1..close].iter().collect();
        Some((close + 1 - i, format!("\\frac{{{d}}}{{{inner}}}")))
    });
    // \sqrt\s?(\d) -> \sqrt{d}
    t = sub_all(&t, |t, i| {
        if !starts_at(t, i, "\\sqrt") {
            return None;
        }
        let mut k = i + 5;
        if t.get(k).is_some_and(|c| c.is_whitespace()) {
            k += 1;
        }
        let d = *t.get(k).filter(|c| c.is_ascii_digit())?;
        Some((k + 1 - i, format!("\\sqrt{{{d}}}")))
    });
    let s: String = t.iter().collect();
    chars(&s.replace(" sqrt", "\\sqrt"))
}

/// Replace every non-overlapping match, scanning left to right.
fn sub_all(t: &[char], f: impl Fn(&[char], usize) -> Option<(usize, String)>) -> Vec<char> {
    let mut out = Vec::with_capacity(t.len());
    let mut i = 0;
    while i < t.len() {
        if let Some((n, rep)) = f(t, i) {
            out.extend(rep.chars());
            i += n.max(1);
        } else {
            out.push(t[i]);
            i += 1;
        }
    }
    out
}

/// `\sqrt3` -> `\sqrt{3}` (Hendrycks' `_fix_sqrt`).
pub fn fix_sqrt(text: &str) -> String {
    if !text.contains("\\sqrt") {
        return text.to_string();
    }
    let mut parts = text.split("\\sqrt");
    let mut out = parts.next().unwrap_or("").to_string();
    for part in parts {
        let p = part.trim_start();
        let mut cs = p.chars();
        match cs.next() {
            Some(c) if c != '{' && c != '[' => {
                out.push_str(&format!("\\sqrt{{{c}}}{}", cs.as_str()));
            }
            _ => {
                out.push_str("\\sqrt");
                out.push_str(p);
            }
        }
    }
    out
}

/// `\frac12` -> `\frac{1}{2}`, `\frac1{72}` -> `\frac{1}{72}` (Hendrycks' `_fix_fracs`).
pub fn fix_fracs(text: &str) -> String {
    let mut parts = text.split("\\frac");
    let mut out = parts.next().unwrap_or("").to_string();
    for part in parts {
        let p = part.trim_start();
        out.push_str("\\frac");
        let cs: Vec<char> = p.chars().collect();
        if cs.first() == Some(&'{') {
            out.push_str(p);
        } else if cs.len() < 2 {
            return text.to_string();
        } else {
            let (a, b) = (cs[0], cs[1]);
            let rest: String = cs[2..].iter().collect();
            if b != '{' {
                out.push_str(&format!("{{{a}}}{{{b}}}{rest}"));
            } else {
                out.push_str(&format!("{{{a}}}{b}{rest}"));
            }
        }
    }
    out
}

/// Python's `int(s)` for the strings that matter here (optional sign, digits, surrounding space).
fn py_int(s: &str) -> Option<i128> {
    let t = s.trim();
    let (neg, digits) = match t.strip_prefix('-') {
        Some(d) => (true, d),
        None => (false, t.strip_prefix('+').unwrap_or(t)),
    };
    if digits.is_empty() || !digits.chars().all(|c| c.is_ascii_digit() || c == '_') {
        return None;
    }
    let v: i128 = digits.replace('_', "").parse().ok()?;
    Some(if neg { -v } else { v })
}

/// `2/3` -> `\frac{2}{3}` when the whole text is exactly that (Hendrycks' `_fix_a_slash_b`).
pub fn fix_a_slash_b(text: &str) -> String {
    let parts: Vec<&str> = text.split('/').collect();
    if parts.len() != 2 {
        return text.to_string();
    }
    match (py_int(parts[0]), py_int(parts[1])) {
        (Some(a), Some(b)) if text == format!("{a}/{b}") => format!("\\frac{{{a}}}{{{b}}}"),
        _ => text.to_string(),
    }
}

/// math-verify's `normalize_latex` with its extraction config (basic, units, malformed
/// operators and nits all on; `boxed` as given).
pub fn normalize_latex(text: &str, boxed: BoxedMode) -> String {
    let mut text = if boxed == BoxedMode::None {
        text.to_string()
    } else {
        extract_boxed_content(text, boxed)
    };

    // basic_latex
    text = text
        .replace("\\mathrm{T}", "T")
        .replace("\\mathrm{d}", "d")
        .replace("{\\rm d}", "d");
    text = text
        .replace("\\left[\\begin{matrix}", "\\begin{bmatrix}")
        .replace("\\end{matrix}\\right]", "\\end{bmatrix}");
    let mut t = chars(&text);
    t = strip_left_right(&t, "left", LEFT_DELIMS);
    t = strip_left_right(&t, "right", RIGHT_DELIMS);
    t = remove_noise(&t);
    t = replace_in_latex(&t);
    let mut text: String = t
        .iter()
        .map(|c| if *c == '\n' || *c == '\t' { ' ' } else { *c })
        .collect();
    if !text.contains("matrix") {
        // \\\\(?=[a-zA-Z]) -> \\ : doubled backslashes before commands.
        let t = chars(&text);
        let mut out = Vec::with_capacity(t.len());
        let mut i = 0;
        while i < t.len() {
            if t[i] == '\\' && t.get(i + 1) == Some(&'\\') && t.get(i + 2).is_some_and(|c| c.is_ascii_alphabetic()) {
                out.push('\\');
                i += 2;
                continue;
            }
            out.push(t[i]);
            i += 1;
        }
        text = out.into_iter().collect();
    }

    // units
    let stripped: String = strip_unit_text(&chars(&text)).into_iter().collect();
    let stripped = stripped.trim().to_string();
    if !stripped.is_empty() && stripped != text {
        text = stripped;
    }
    for _ in 0..2 {
        let s: String = strip_unit_word(&chars(&text)).into_iter().collect();
        if !s.is_empty() && s != text {
            text = s;
        }
    }

    // nits
    if text.starts_with('.') {
        text = format!("0{text}");
    }
    if text == "0.5" {
        text = "\\frac{1}{2}".to_string();
    }

    // malformed operators
    text = fix_malformed_operators(&chars(&text)).into_iter().collect();
    text = fix_sqrt(&text);
    text = fix_fracs(&text);
    text = fix_a_slash_b(&text);
    text.trim().to_string()
}

/// Matches `cmd\s?(\d)\s?(\d+)` at `i`: the length matched, the single digit and the digit run.
fn digit_then_digits_after(t: &[char], i: usize, cmd: &str) -> Option<(usize, char, String)> {
    if !starts_at(t, i, cmd) {
        return None;
    }
    let mut k = i + cmd.chars().count();
    if t.get(k).is_some_and(|c| c.is_whitespace()) {
        k += 1;
    }
    let a = *t.get(k).filter(|c| c.is_ascii_digit())?;
    k += 1;
    if t.get(k).is_some_and(|c| c.is_whitespace()) {
        k += 1;
    }
    let start = k;
    while t.get(k).is_some_and(|c| c.is_ascii_digit()) {
        k += 1;
    }
    if k == start {
        return None;
    }
    Some((k - i, a, t[start..k].iter().collect()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn boxed_content() {
        assert_eq!(
            extract_boxed_content("a \\boxed{1} and \\boxed{2}", BoxedMode::Last),
            "1,2"
        );
        assert_eq!(
            extract_boxed_content("\\boxed{1} no no no no no \\boxed{2}", BoxedMode::Last),
            "2"
        );
        assert_eq!(
            extract_boxed_content("\\boxed{\\frac{1}{2}}", BoxedMode::All),
            "\\frac{1}{2}"
        );
        assert_eq!(extract_boxed_content("no box", BoxedMode::All), "no box");
    }

    #[test]
    fn normalization() {
        let n = |s| normalize_latex(s, BoxedMode::All);
        assert_eq!(n("\\left( \\frac{1}{3} \\right)"), "( \\frac{1}{3} )");
        assert_eq!(n("\\frac{1}{3} \\text{meters}"), "\\frac{1}{3}");
        assert_eq!(n("15\\mbox{ cm}^2"), "15");
        assert_eq!(n("\\frac13"), "\\frac{1}{3}");
        assert_eq!(n("\\sqrt3"), "\\sqrt{3}");
        assert_eq!(n("28 percent"), "28\\%");
        assert_eq!(n("125 miles"), "125");
        assert_eq!(n("12\\text{ and }13"), "12,13");
        assert_eq!(n("14{,}916"), "14,916");
        assert_eq!(n("1/3"), "\\frac{1}{3}");
        assert_eq!(n(".4"), "0.4");
    }
}
