//! The `deepscaler` and `math` rule-based rewards (slime's `rm_hub/deepscaler.py` and
//! `math_utils.py`, which come from DeepScaleR / Hendrycks' MATH).
//!
//! Grading an extracted answer against a label is "any of":
//! 1. Hendrycks' string normalisation (`mathd`): `\dfrac` -> `\frac`, `\left`/`\right`, units in
//!    `\text{ ...}`, `^\circ`, `\$`, `\%`, `0.5` -> `\frac{1}{2}`, `k = 5` -> `5`, ...;
//! 2. slime's "sympy" grader: a second normalisation (units, `million`, mixed numbers `7 3/4`,
//!    `or`/`and` lists, tuples/intervals element-wise; unreduced `a/b` must match exactly, an
//!    integer label needs an integer answer), with numeric evaluation standing in for
//!    `sympy.simplify`;
//! 3. the math-verify equivalence of [`super::math`] on the two answers.
//!
//! 1 and 2 reproduce slime; 3 adds the cases slime misses (`0.5` vs `\frac12` inside tuples,
//! sets in another order, `x \in [a, b]`, ...).

use super::boxed::last_boxed_answer;
use super::math;

// ---- 1. Hendrycks' normalisation (`mathd_normalize_answer` / `_strip_string`) ----------------

/// `\frac12` -> `\frac{1}{2}`; `None` where Python would raise (caught by the caller).
fn hendrycks_fix_fracs(s: &str) -> Option<String> {
    let mut parts = s.split("\\frac");
    let mut out = parts.next().unwrap_or("").to_string();
    for sub in parts {
        out.push_str("\\frac");
        let cs: Vec<char> = sub.chars().collect();
        if cs.first() == Some(&'{') {
            out.push_str(sub);
        } else if cs.is_empty() {
            return None; // substr[0] on an empty string
        } else if cs.len() < 2 {
            return Some(s.to_string());
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
    Some(out)
}

fn hendrycks_fix_sqrt(s: &str) -> Option<String> {
    if !s.contains("\\sqrt") {
        return Some(s.to_string());
    }
    let mut parts = s.split("\\sqrt");
    let mut out = parts.next().unwrap_or("").to_string();
    for part in parts {
        let mut cs = part.chars();
        let first = cs.next()?; // split[0] on an empty string raises
        if first != '{' {
            out.push_str(&format!("\\sqrt{{{first}}}{}", cs.as_str()));
        } else {
            out.push_str("\\sqrt");
            out.push_str(part);
        }
    }
    Some(out)
}

fn strip_string(s: &str) -> Option<String> {
    let mut s = s.replace('\n', "").replace("\\!", "").replace("\\\\", "\\");
    s = s.replace("tfrac", "frac").replace("dfrac", "frac");
    s = s.replace("\\left", "").replace("\\right", "");
    s = s.replace("^{\\circ}", "").replace("^\\circ", "");
    s = s.replace("\\$", "");
    // units on the right: "\text{ " only ever describes units
    if s.contains("\\text{ ") {
        let parts: Vec<&str> = s.split("\\text{ ").collect();
        if parts.len() != 2 {
            return None;
        }
        s = parts[0].to_string();
    }
    s = s.replace("\\%", "");
    s = s.replace(" .", " 0.").replace("{.", "{0.");
    if s.is_empty() {
        return Some(s);
    }
    if s.starts_with('.') {
        s = format!("0{s}");
    }
    let eq: Vec<&str> = s.split('=').collect();
    if eq.len() == 2 && eq[0].chars().count() <= 2 {
        s = eq[1].to_string();
    }
    s = hendrycks_fix_sqrt(&s)?;
    s = s.replace(' ', "");
    s = hendrycks_fix_fracs(&s)?;
    if s == "0.5" {
        s = "\\frac{1}{2}".into();
    }
    Some(math::normalize::fix_a_slash_b(&s))
}

/// `mathd_normalize_answer`: strip an enclosing `\text{}`, then Hendrycks' normalisation.
pub fn mathd_normalize(answer: &str) -> String {
    let mut a = answer.trim().to_string();
    if let Some(inner) = a.strip_prefix("\\text{").and_then(|r| r.strip_suffix('}')) {
        if !inner.is_empty() && !inner.contains('\n') {
            a = inner.trim().to_string();
        }
    }
    strip_string(&a).unwrap_or(a)
}

pub fn grade_mathd(given: &str, truth: &str) -> bool {
    mathd_normalize(truth) == mathd_normalize(given)
}

// ---- 2. slime's "sympy" grader ------------------------------------------------------------

const SYMPY_UNITS: &[&str] = &[
    "degree",
    "cm",
    "centimeter",
    "meter",
    "mile",
    "second",
    "minute",
    "hour",
    "day",
    "week",
    "month",
    "year",
    "foot",
    "feet",
    "inch",
    "yard",
];

/// `re.sub(rf"{unit}(es)?(s)? *(\^[0-9]+)?", "", s)`
fn remove_unit(s: &str, unit: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some(i) = rest.find(unit) {
        out.push_str(&rest[..i]);
        let mut r = &rest[i + unit.len()..];
        r = r.strip_prefix("es").unwrap_or(r);
        r = r.strip_prefix('s').unwrap_or(r);
        r = r.trim_start_matches(' ');
        if let Some(p) = r.strip_prefix('^') {
            let digits = p.len() - p.trim_start_matches(|c: char| c.is_ascii_digit()).len();
            if digits > 0 {
                r = &p[digits..];
            }
        }
        rest = r;
    }
    out.push_str(rest);
    out
}

fn py_float(s: &str) -> Option<f64> {
    let t = s.trim();
    if t.is_empty() || t.chars().any(|c| c.is_alphabetic() && !"eE".contains(c)) {
        return None;
    }
    t.replace('_', "").parse().ok()
}

/// `_strip_properly_formatted_commas`: `1,234` -> `1234`, tuple commas kept.
fn strip_thousands_commas(s: &str) -> String {
    let mut cur: Vec<char> = s.chars().collect();
    loop {
        let mut out = Vec::with_capacity(cur.len());
        let mut i = 0;
        let mut changed = false;
        while i < cur.len() {
            let fits = i + 4 < cur.len() + 1
                && i > 0
                && cur[i] == ','
                && cur[i - 1].is_ascii_digit()
                && cur
                    .get(i + 1..i + 4)
                    .is_some_and(|d| d.iter().all(|c| c.is_ascii_digit()))
                && cur.get(i + 4).is_none_or(|c| !c.is_ascii_digit());
            if fits {
                changed = true;
                i += 1;
                continue;
            }
            out.push(cur[i]);
            i += 1;
        }
        if !changed {
            return cur.into_iter().collect();
        }
        cur = out;
    }
}

fn str_is_int(s: &str) -> bool {
    py_float(&strip_thousands_commas(s)).is_some_and(|x| (x - x.round()).abs() <= 1e-7)
}

/// slime's `_normalize` (the LaTeX-to-text step is left to the parser, which reads LaTeX).
fn sympy_normalize(expr: &str) -> String {
    let mut e = expr.to_string();
    if let Some(inner) = e.strip_prefix("\\text{").and_then(|r| r.strip_suffix('}')) {
        if !inner.is_empty() {
            e = inner.to_string();
        }
    }
    e = e.replace("\\%", "%").replace("\\$", "$").replace(['$', '%'], "");
    e = e.replace(" or ", " , ").replace(" and ", " , ");
    e = e
        .replace("million", "*10^6")
        .replace("billion", "*10^9")
        .replace("trillion", "*10^12");
    for unit in SYMPY_UNITS {
        e = remove_unit(&e, unit);
    }
    // \^ *\\circ
    while let Some(i) = e.find('^') {
        let after = e[i + 1..].trim_start_matches(' ');
        if let Some(rest) = after.strip_prefix("\\circ") {
            e = format!("{}{}", &e[..i], rest);
        } else {
            break;
        }
    }
    if e.len() > 1 && e.starts_with('{') && e.ends_with('}') {
        e = e[1..e.len() - 1].to_string();
    }
    // ,\\! *
    while let Some(i) = e.find(",\\!") {
        let rest = e[i + 3..].trim_start_matches(' ').to_string();
        e = format!("{}{}", &e[..i], rest);
    }
    if let Some(x) = py_float(&e) {
        if (x - x.round()).abs() <= 1e-7 && x.abs() < 1e18 {
            e = format!("{}", x.round() as i64);
        }
    }
    // "- *" -> "-"
    let mut out = String::new();
    let mut chars = e.chars().peekable();
    while let Some(c) = chars.next() {
        out.push(c);
        if c == '-' {
            while chars.peek() == Some(&' ') {
                chars.next();
            }
        }
    }
    e = out;
    // mixed numbers: "7 3/4" -> "7+3/4"
    let cs: Vec<char> = e.chars().collect();
    let mut out = String::new();
    let mut i = 0;
    while i < cs.len() {
        out.push(cs[i]);
        if cs[i].is_ascii_digit() && cs.get(i + 1) == Some(&' ') {
            let mut k = i + 1;
            while cs.get(k) == Some(&' ') {
                k += 1;
            }
            if cs.get(k).is_some_and(|c| c.is_ascii_digit()) {
                out.push('+');
                i = k;
                continue;
            }
        }
        i += 1;
    }
    e = out.replace(' ', "");
    if !e.contains('\\') {
        e = e.replace(['{', '}'], "");
    }
    e = e.to_lowercase();
    if str_is_int(&e) {
        if let Some(x) = py_float(&strip_thousands_commas(&e)) {
            e = format!("{}", x.trunc() as i64);
        }
    }
    e
}

fn is_frac(s: &str) -> bool {
    // ^-?[0-9]+.?/0*[1-9][0-9]*.?$
    let t = s.strip_prefix('-').unwrap_or(s);
    let Some((a, b)) = t.split_once('/') else { return false };
    let a = a.strip_suffix(|c: char| !c.is_ascii_digit()).unwrap_or(a);
    let b = b.strip_suffix(|c: char| !c.is_ascii_digit()).unwrap_or(b);
    !a.is_empty()
        && a.chars().all(|c| c.is_ascii_digit())
        && b.trim_start_matches('0')
            .starts_with(|c: char| ('1'..='9').contains(&c))
        && b.chars().all(|c| c.is_ascii_digit())
}

fn split_tuple(e: &str) -> Vec<String> {
    let e = strip_thousands_commas(e);
    if e.is_empty() {
        return vec![];
    }
    let cs: Vec<char> = e.chars().collect();
    let brackets = "()[]";
    if cs.len() > 2
        && brackets.contains(cs[0])
        && brackets.contains(cs[cs.len() - 1])
        && cs[1..cs.len() - 1].iter().all(|c| !brackets.contains(*c))
    {
        let inner: String = cs[1..cs.len() - 1].iter().collect();
        return inner.split(',').map(|x| x.trim().to_string()).collect();
    }
    vec![e]
}

/// slime's `should_allow_eval` guard, then "equal under evaluation".
fn equal_under_evaluation(truth: &str, given: &str) -> bool {
    let expr = format!("({truth})-({given})");
    // slime counts letters after LaTeX became text; here command names (`\\times`) are skipped.
    let mut letters = std::collections::BTreeSet::new();
    let mut in_command = false;
    for c in expr.replace("sqrt", "").replace("frac", "").chars() {
        if c == '\\' {
            in_command = true;
        } else if c.is_alphabetic() {
            if !in_command {
                letters.insert(c);
            }
        } else {
            in_command = false;
        }
    }
    if letters.len() > 2 || expr.contains("^{") || expr.contains("^(") {
        return false;
    }
    let cs: Vec<char> = expr.chars().collect();
    for i in 0..cs.len() {
        if cs[i] == '^' {
            let mut k = i + 1;
            while cs.get(k).is_some_and(|c| c.is_ascii_digit()) {
                k += 1;
            }
            if k - (i + 1) >= 2 || (k > i + 1 && cs.get(k) == Some(&'^')) {
                return false;
            }
        }
    }
    math::expressions_equal(truth, given)
}

pub fn grade_sympy(given: &str, truth: &str) -> bool {
    let gt = sympy_normalize(truth);
    let gv = sympy_normalize(given);
    if gt == gv {
        return true;
    }
    if gv.is_empty() {
        return false;
    }
    let gt_elems = split_tuple(&gt);
    let gv_elems = split_tuple(&gv);
    if gt_elems.len() > 1 && (gt.chars().next() != gv.chars().next() || gt.chars().last() != gv.chars().last()) {
        return false;
    }
    if gt_elems.len() != gv_elems.len() {
        return false;
    }
    gt_elems.iter().zip(&gv_elems).all(|(t, g)| {
        if is_frac(t) && is_frac(g) {
            t == g
        } else if str_is_int(t) != str_is_int(g) {
            false
        } else {
            equal_under_evaluation(t, g)
        }
    })
}

// ---- grading and rewards ------------------------------------------------------------------

/// Is `given` (an extracted answer) the `truth` label? See the module comment.
pub fn grade_answer(given: &str, truth: &str) -> bool {
    grade_mathd(given, truth) || grade_sympy(given, truth) || math::answers_equivalent(truth, given)
}

/// slime's `extract_answer` with the lenient box forms (`\fbox{}`, `\boxed 5`).
fn extract_answer(passage: &str) -> Option<String> {
    last_boxed_answer(passage)
}

/// The label to grade against: its boxed content when it has one.
fn label_truth(label: &str) -> Option<String> {
    if label.contains("\\boxed") {
        extract_answer(label)
    } else {
        Some(label.to_string())
    }
}

/// `deepscaler`: 1 when the last boxed answer after `</think>` matches the label, else 0.
/// A response without `</think>` (nor the old `###Response` marker) scores 0, as in slime.
pub fn deepscaler_reward(response: &str, label: &str) -> f64 {
    let solution = if let Some(i) = response.rfind("</think>") {
        &response[i + "</think>".len()..]
    } else if response.contains("###Response") {
        response.split("###Response").nth(1).unwrap_or("")
    } else {
        return 0.0;
    };
    let Some(answer) = extract_answer(solution) else {
        return 0.0;
    };
    if label.is_empty() {
        return 0.0;
    }
    match label_truth(label) {
        Some(truth) if grade_answer(&answer, &truth) => 1.0,
        _ => 0.0,
    }
}

/// `math` (slime's `grade_answer_verl`): the last boxed answer anywhere in the response.
pub fn math_reward(response: &str, label: &str) -> f64 {
    if label.is_empty() {
        return 0.0;
    }
    let Some(truth) = label_truth(label) else { return 0.0 };
    let Some(answer) = extract_answer(response) else {
        return 0.0;
    };
    if grade_answer(&answer, &truth) {
        1.0
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mathd_forms() {
        assert_eq!(mathd_normalize("\\dfrac{1}{2}"), "\\frac{1}{2}");
        assert_eq!(mathd_normalize("0.5"), "\\frac{1}{2}");
        assert_eq!(mathd_normalize("k = 5"), "5");
        assert_eq!(mathd_normalize("\\text{Evelyn}"), "Evelyn");
        assert_eq!(mathd_normalize("10\\text{ cm}"), "10");
        assert_eq!(mathd_normalize("\\sqrt3"), "\\sqrt{3}");
        assert_eq!(mathd_normalize("1/2"), "\\frac{1}{2}");
    }

    #[test]
    fn sympy_forms() {
        assert!(grade_sympy("7 3/4", "31/4"));
        assert!(grade_sympy("2.5 million", "2.5 \\times 10^6"));
        assert!(
            !grade_sympy("5 million", "5000000"),
            "an integer label needs an integer answer"
        );
        assert!(grade_sympy("1,000", "1000"));
        assert!(!grade_sympy("2/4", "1/2"), "unreduced fractions must match exactly");
        assert!(grade_sympy("(1, 2)", "(1,2)"));
        assert!(!grade_sympy("[1, 2)", "(1,2)"));
    }
}
