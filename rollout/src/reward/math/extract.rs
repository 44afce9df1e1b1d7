//! Finding the answer in free text, the way math-verify's `parse` does.
//!
//! Candidates are found by a fixed list of patterns, each with a priority (lower first):
//! `final answer is X. I hope` (0), `\boxed{}` (0 or 50), `final answer ... is X` (50),
//! `answer: ... X` (100), `answer ... X` (200), any LaTeX environment or plain number (300).
//! Within a priority the match that ends last is tried first; the first one that parses wins.
//! The text of the first match tried is kept as a string fallback, compared verbatim.
//!
//! The patterns are hand-written scanners that reproduce the upstream regular expressions
//! (lazy/greedy choices and all); each function names the pattern it stands for.

use super::expr::Expr;
use super::latex::parse_latex;
use super::normalize::{normalize_latex, BoxedMode};
use super::value::Value;

/// Which targets to look for (math-verify's `LatexExtractionConfig` / `ExprExtractionConfig`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExtractConfig {
    /// LaTeX environments (`$...$`, `\[...\]`, `\boxed{}`, ...).
    pub latex: bool,
    /// Plain numbers and arithmetic (`1,000.5`, `3/4`).
    pub expr: bool,
    /// Priority of `\boxed{}` matches (0 = before everything, 50 = math-verify's default, -1 = off).
    pub boxed_priority: i32,
}

impl Default for ExtractConfig {
    fn default() -> Self {
        ExtractConfig {
            latex: true,
            expr: true,
            boxed_priority: 50,
        }
    }
}

/// One extracted answer: a parsed value, or the matched text when nothing parsed.
#[derive(Clone, Debug, PartialEq)]
pub enum Extracted {
    Value(Value),
    Str(String),
}

fn starts_at(t: &[char], i: usize, pat: &str) -> bool {
    let mut rest = t.get(i..).unwrap_or(&[]).iter();
    pat.chars().all(|p| rest.next() == Some(&p))
}

/// Case-insensitive ASCII `starts_at`.
fn starts_at_ci(t: &[char], i: usize, pat: &str) -> bool {
    let mut rest = t.get(i..).unwrap_or(&[]).iter();
    pat.chars()
        .all(|p| rest.next().is_some_and(|c| c.to_lowercase().eq(p.to_lowercase())))
}

fn ws_end(t: &[char], i: usize) -> usize {
    let mut k = i;
    while k < t.len() && t[k].is_whitespace() {
        k += 1;
    }
    k
}

fn is_digit(c: char) -> bool {
    c.is_ascii_digit()
}

// ---------------------------------------------------------------------------------------------
// LaTeX environments (`make_latex_env_pattern`)

#[derive(Clone, Debug)]
struct Env {
    content: (usize, usize),
    end: usize,
}

fn contains_boxed(t: &[char], from: usize, to: usize) -> bool {
    // `\\boxed{X+?}`: a `\boxed{` followed by at least one char and a `}` before `to`.
    (from..to).any(|q| starts_at(t, q, "\\boxed{") && (q + 8..to).any(|k| t[k] == '}'))
}

/// One environment starting exactly at `p`: `$$..$$`, `\[..\]`, `$..$`, `\(..\)`, ` [..] ` or
/// (plain context only) a bare `\frac{1}{2}`; then `\s*` and an optional percent word.
fn env_at(t: &[char], p: usize, boxed: bool) -> Option<Env> {
    let n = t.len();
    let prev = if p > 0 { Some(t[p - 1]) } else { None };
    let at = |k: usize| t.get(k).copied();
    let mut found: Option<(usize, usize, usize)> = None; // content start, content end, end
                                                         // $$ ... $$
    if found.is_none() && at(p) == Some('$') && at(p + 1) == Some('$') && prev != Some('\\') {
        let r = (p + 2..n.saturating_sub(1)).find(|&r| t[r] == '$' && t[r + 1] == '$');
        if let Some(r) = r {
            if r > p + 2 && t[r - 1] != '\\' && (!boxed || contains_boxed(t, p + 2, r)) {
                found = Some((p + 2, r, r + 2));
            }
        }
    }
    // \[ ... \]
    if found.is_none() && at(p) == Some('\\') && at(p + 1) == Some('[') && prev != Some('\\') {
        let r = (p + 2..n.saturating_sub(1)).find(|&r| t[r] == '\\' && t[r + 1] == ']');
        if let Some(r) = r {
            if r > p + 2 && t[r - 1] != '\\' && (!boxed || contains_boxed(t, p + 2, r)) {
                found = Some((p + 2, r, r + 2));
            }
        }
    }
    // $ ... $ (single line, not after a backslash or a digit)
    if found.is_none() && at(p) == Some('$') && prev != Some('\\') && !prev.is_some_and(is_digit) {
        let mut r = p + 1;
        while r < n {
            let c = t[r];
            if c == '\\' && at(r + 1) == Some('$') {
                r += 2;
                continue;
            }
            if c == '$' {
                if r > p + 1 && (!boxed || contains_boxed(t, p + 1, r)) {
                    found = Some((p + 1, r, r + 1));
                }
                break;
            }
            if c == '\n' {
                break;
            }
            r += 1;
        }
    }
    // \( ... \) (single line)
    if found.is_none() && at(p) == Some('\\') && at(p + 1) == Some('(') && prev != Some('\\') {
        let mut r = p + 2;
        while r < n {
            let c = t[r];
            if c == '\n' {
                break;
            }
            if c == '\\' && at(r + 1) == Some(')') {
                if r > p + 2 && t[r - 1] != '\\' && (!boxed || contains_boxed(t, p + 2, r)) {
                    found = Some((p + 2, r, r + 2));
                }
                break;
            }
            r += 1;
        }
    }
    // \s[ ... ]\s
    if found.is_none() && at(p).is_some_and(char::is_whitespace) && at(p + 1) == Some('[') {
        let mut r = p + 2;
        while r < n {
            let c = t[r];
            if c == '\n' || c == '[' {
                break;
            }
            if c == ']' {
                if r > p + 2 && at(r + 1).is_some_and(char::is_whitespace) && (!boxed || contains_boxed(t, p + 2, r)) {
                    found = Some((p + 2, r, r + 2));
                }
                break;
            }
            r += 1;
        }
    }
    // -?\frac{num}{num}
    if found.is_none() && !boxed {
        let mut k = p;
        if at(k) == Some('-') {
            k += 1;
        }
        if starts_at(t, k, "\\frac{") {
            let num = |mut k: usize| -> Option<usize> {
                if at(k) == Some('-') {
                    k += 1;
                }
                let s = k;
                while at(k).is_some_and(is_digit) {
                    k += 1;
                }
                if k == s {
                    return None;
                }
                if matches!(at(k), Some('.') | Some(',')) && at(k + 1).is_some_and(is_digit) {
                    k += 1;
                    while at(k).is_some_and(is_digit) {
                        k += 1;
                    }
                }
                Some(k)
            };
            if let Some(k2) = num(k + 6) {
                if starts_at(t, k2, "}{") {
                    if let Some(k3) = num(k2 + 2) {
                        if at(k3) == Some('}') {
                            found = Some((p, k3 + 1, k3 + 1));
                        }
                    }
                }
            }
        }
    }
    let (cs, ce, mut end) = found?;
    end = ws_end(t, end);
    for w in [
        "\\%",
        "%",
        "Percent",
        "percent",
        "Percentage",
        "percentage",
        "Pct",
        "pct",
    ] {
        if starts_at(t, end, w) {
            end += w.chars().count();
            break;
        }
    }
    Some(Env { content: (cs, ce), end })
}

/// An environment at `p`, letting a greedy `\s*` before it give back one space (for ` [..] `).
fn env_after_ws(t: &[char], p: usize, boxed: bool) -> Option<Env> {
    let q = ws_end(t, p);
    env_at(t, q, boxed).or_else(|| if q > p { env_at(t, q - 1, boxed) } else { None })
}

/// `ENV (\s*(,?and|,?or|,)\s*ENV)?` x5. Returns every way the optional tails can be taken,
/// longest first (regex backtracking order).
fn env_list_at(t: &[char], p: usize, boxed: bool) -> Vec<Vec<Env>> {
    let Some(first) = env_at(t, p, boxed) else {
        return vec![];
    };
    let mut envs = vec![first];
    for _ in 0..5 {
        let q = ws_end(t, envs.last().expect("non-empty").end);
        let mut next = None;
        for sep in [",and", "and", ",or", "or", ","] {
            if starts_at(t, q, sep) {
                if let Some(e) = env_after_ws(t, q + sep.len(), boxed) {
                    next = Some(e);
                    break;
                }
            }
        }
        match next {
            Some(e) => envs.push(e),
            None => break,
        }
    }
    (1..=envs.len()).rev().map(|k| envs[..k].to_vec()).collect()
}

// ---------------------------------------------------------------------------------------------
// Plain numbers and expressions (`lazy_expr_regex`)

#[derive(Clone, Debug)]
enum ExprHit {
    Number { integer: String, decimal: String },
    Expr(String),
}

const CURRENCY: &str = "$€£¥₹₽₪₩₫฿₡₢₣₤₥₦₧₨₩₪₫₭₮₯₰₱₲₳₴₵₶₷₸₹₺₻₼₽₾₿";

fn is_expr_char(c: char) -> bool {
    is_digit(c) || c == '.' || c.is_whitespace() || is_op_char(c)
}

fn is_op_char(c: char) -> bool {
    matches!(c, '+' | '-' | '*' | '×' | '/' | '^' | '(' | ')' | '÷')
}

/// `(?:^|\s|=)(?:\*\*)?`: the positions where the body may start.
fn prefix_ends(t: &[char], s: usize) -> Vec<usize> {
    let mut out = Vec::new();
    let mut bases = Vec::new();
    if s == 0 {
        bases.push(0);
    }
    if s < t.len() && (t[s].is_whitespace() || t[s] == '=') {
        bases.push(s + 1);
    }
    for b in bases {
        if starts_at(t, b, "**") {
            out.push(b + 2);
        }
        out.push(b);
    }
    out
}

/// `(?:\*\*)?(?:\.|,|:|\s|\)|\$|$)` at `e`: the match end if the suffix fits.
fn expr_suffix(t: &[char], e: usize) -> Vec<usize> {
    let mut out = Vec::new();
    for s in [if starts_at(t, e, "**") { Some(e + 2) } else { None }, Some(e)]
        .into_iter()
        .flatten()
    {
        match t.get(s) {
            Some(c) if matches!(c, '.' | ',' | ':' | ')' | '$') || c.is_whitespace() => out.push(s + 1),
            None => out.push(s),
            Some('\n') if s + 1 == t.len() => out.push(s),
            _ => {}
        }
    }
    out
}

/// Per-text tables that keep the expression scan linear: where each run of expression
/// characters ends, and where the next operator is.
pub(crate) struct Scan {
    run_end: Vec<usize>,
    next_op: Vec<usize>,
}

impl Scan {
    fn new(t: &[char]) -> Scan {
        let n = t.len();
        let mut run_end = vec![n; n + 1];
        let mut next_op = vec![n; n + 1];
        for i in (0..n).rev() {
            run_end[i] = if is_expr_char(t[i]) { run_end[i + 1] } else { i };
            next_op[i] = if is_op_char(t[i]) { i } else { next_op[i + 1] };
        }
        Scan { run_end, next_op }
    }
}

/// `-?\(?-?\d C* [ops] C+ \)?` at `q` followed by the suffix: the first (match end, expr text)
/// in regex order for which `cont` holds.
fn expr_body(t: &[char], scan: &Scan, q: usize, cont: &dyn Fn(usize) -> bool) -> Option<(usize, String)> {
    let mut k = q;
    if t.get(k) == Some(&'-') {
        k += 1;
    }
    if t.get(k) == Some(&'(') {
        k += 1;
    }
    if t.get(k) == Some(&'-') {
        k += 1;
    }
    if !t.get(k).copied().is_some_and(is_digit) {
        return None;
    }
    let d = k;
    let r_max = scan.run_end[d + 1].max(d + 1);
    // `C* OP C+` ends at e with an operator somewhere in d+1..=e-2.
    let first_op = scan.next_op[d + 1];
    if first_op + 2 > r_max {
        return None;
    }
    for e in (first_op + 2..=r_max).rev() {
        let mut ends = [None, Some(e)];
        if t.get(e) == Some(&')') {
            ends[0] = Some(e + 1);
        }
        for body_end in ends.into_iter().flatten() {
            for m in expr_suffix(t, body_end) {
                if cont(m) {
                    return Some((m, t[q..body_end].iter().collect()));
                }
            }
        }
    }
    None
}

/// The number pattern at `q` (after the prefix): (match end, hit) candidates in regex order.
fn number_body(t: &[char], q: usize, cont: &dyn Fn(usize) -> bool) -> Option<(usize, ExprHit)> {
    let mut starts = vec![];
    if t.get(q).is_some_and(|c| CURRENCY.contains(*c)) {
        starts.push(q + 1);
    }
    starts.push(q);
    let at = |k: usize| t.get(k).copied();
    let digits_from = |k: usize| {
        let mut e = k;
        while at(e).is_some_and(is_digit) {
            e += 1;
        }
        e
    };
    for s in starts {
        if s > 0 && is_digit(t[s - 1]) {
            continue;
        }
        let mut cands: Vec<(usize, String, String)> = vec![];
        let sign = usize::from(at(s) == Some('-'));
        let a = s + sign;
        // 1: -?[1-9]\d{0,2}([ ,]\d{3})+ (\.\d+)?
        if at(a).is_some_and(|c| is_digit(c) && c != '0') {
            let max_lead = (digits_from(a + 1) - (a + 1)).min(2);
            for lead in (0..=max_lead).rev() {
                let mut k = a + 1 + lead;
                let mut group_ends = vec![];
                while matches!(at(k), Some(' ') | Some(',')) && digits_from(k + 1) >= k + 4 {
                    k += 4;
                    group_ends.push(k);
                }
                for &g in group_ends.iter().rev() {
                    let int: String = t[s..g].iter().collect();
                    if at(g) == Some('.') && at(g + 1).is_some_and(is_digit) {
                        let de = digits_from(g + 1);
                        cands.push((de, int.clone(), t[g..de].iter().collect()));
                    }
                    cands.push((g, int, String::new()));
                }
            }
        }
        // 2: -?\d+ [.,]\d+
        let ie = digits_from(a);
        if ie > a && matches!(at(ie), Some('.') | Some(',')) && at(ie + 1).is_some_and(is_digit) {
            let de = digits_from(ie + 1);
            cands.push((de, t[s..ie].iter().collect(), t[ie..de].iter().collect()));
        }
        // 3: \.\d+
        if sign == 0 && at(s) == Some('.') && at(s + 1).is_some_and(is_digit) {
            let de = digits_from(s + 1);
            cands.push((de, String::new(), t[s..de].iter().collect()));
        }
        // 4: -?\d+
        if ie > a {
            cands.push((ie, t[s..ie].iter().collect(), String::new()));
        }
        for (end, integer, decimal) in cands {
            // (?P<percent>\s*(?:%|[Pp]ercent|\s*[Pp]ercentage|\s*[Pp]ct))?
            let w = ws_end(t, end);
            let mut pct_end = None;
            if at(w) == Some('%') {
                pct_end = Some(w + 1);
            } else {
                for p in ["Percent", "percent", "Percentage", "percentage", "Pct", "pct"] {
                    if starts_at(t, w, p) {
                        pct_end = Some(w + p.len());
                        break;
                    }
                }
            }
            let hit = ExprHit::Number { integer, decimal };
            for e in [pct_end, Some(end)].into_iter().flatten() {
                if cont(e) {
                    return Some((e, hit));
                }
            }
        }
    }
    None
}

/// `expr_with_anchors | number_with_anchors` starting (with its prefix) at `s`: the first match
/// (regex order) whose end satisfies `cont`.
fn expr_or_number_at(
    t: &[char],
    scan: &Scan,
    s: usize,
    want_expr: bool,
    want_number: bool,
    cont: &dyn Fn(usize) -> bool,
) -> Option<(usize, ExprHit)> {
    if want_expr {
        for q in prefix_ends(t, s) {
            if let Some((e, text)) = expr_body(t, scan, q, cont) {
                return Some((e, ExprHit::Expr(text)));
            }
        }
    }
    if want_number {
        for q in prefix_ends(t, s) {
            if let Some(hit) = number_body(t, q, cont) {
                return Some(hit);
            }
        }
    }
    None
}

// ---------------------------------------------------------------------------------------------
// Patterns and priorities

#[derive(Clone, Debug)]
enum Hit {
    /// One or more environments joined by `,` / `and` / `or`; each is normalized with every
    /// `\boxed{}` content kept.
    Latex {
        envs: Vec<Env>,
    },
    /// A bare `\boxed{...}` up to the last `}`: only the last box (and the list right before it).
    Boxed {
        from: usize,
        to: usize,
    },
    Expr(ExprHit),
}

#[derive(Clone, Debug)]
struct Match {
    start: usize,
    end: usize,
    hit: Hit,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pattern {
    LatexFinalIs,
    LatexFinalJustIs,
    LatexAnswerColon,
    LatexAnswer,
    LatexPlain,
    LatexBoxedEnvs,
    LatexBoxed,
    ExprFinalIs,
    ExprFinalJustIs,
    ExprAnswerColon,
    ExprAnswer,
    ExprPlain,
    NumberPlain,
}

/// `\.?\s?I hope` right at `e`.
fn i_hope(t: &[char], e: usize) -> bool {
    let mut opts = vec![];
    let dot = if t.get(e) == Some(&'.') {
        vec![e + 1, e]
    } else {
        vec![e]
    };
    for d in dot {
        if t.get(d).is_some_and(|c| c.is_whitespace()) {
            opts.push(d + 1);
        }
        opts.push(d);
    }
    opts.into_iter().any(|k| starts_at(t, k, "I hope"))
}

/// `(?!\s*=)` at `e`.
fn not_followed_by_eq(t: &[char], e: usize) -> bool {
    t.get(ws_end(t, e)) != Some(&'=')
}

fn latex_list_match(t: &[char], p: usize, boxed: bool, cont: impl Fn(usize) -> bool) -> Option<Vec<Env>> {
    env_list_at(t, p, boxed)
        .into_iter()
        .find(|envs| cont(envs.last().expect("non-empty").end))
}

/// Try the pattern at `s`; the match (start = `s`) if it matches there.
fn match_at(t: &[char], scan: &Scan, s: usize, pat: Pattern) -> Option<Match> {
    let n = t.len();
    let latex = |envs: Vec<Env>, end: usize| {
        Some(Match {
            start: s,
            end,
            hit: Hit::Latex { envs },
        })
    };
    let last_end = |envs: &[Env]| envs.last().expect("non-empty").end;
    match pat {
        Pattern::LatexPlain => {
            let envs = latex_list_match(t, s, false, |_| true)?;
            let e = last_end(&envs);
            latex(envs, e)
        }
        Pattern::LatexBoxedEnvs => {
            let envs = latex_list_match(t, s, true, |_| true)?;
            let e = ws_end(t, last_end(&envs));
            latex(envs, e)
        }
        Pattern::LatexBoxed => {
            if !starts_at(t, s, "\\boxed{") {
                return None;
            }
            let close = (s + 8..n).rev().find(|&k| t[k] == '}')?;
            Some(Match {
                start: s,
                end: close + 1,
                hit: Hit::Boxed { from: s, to: close + 1 },
            })
        }
        Pattern::LatexFinalIs => {
            if !starts_at_ci(t, s, "final answer is") {
                return None;
            }
            let mut k = s + 15;
            if t.get(k) == Some(&':') {
                k += 1;
            }
            let w = ws_end(t, k);
            for q in (k..=w).rev() {
                if let Some(envs) = latex_list_match(t, q, false, |e| i_hope(t, e)) {
                    let e = last_end(&envs);
                    // The match ends after "I hope"; only its end position matters for ordering.
                    let end = (e..n).find(|&m| starts_at(t, m, "I hope")).map_or(e, |m| m + 6);
                    return latex(envs, end);
                }
                if q < w {
                    break;
                }
            }
            None
        }
        Pattern::LatexFinalJustIs => {
            if !starts_at_ci(t, s, "final answer") {
                return None;
            }
            for k in 0..=100 {
                let q = s + 12 + k;
                if q >= n {
                    break;
                }
                if !t[q].is_whitespace() {
                    continue;
                }
                let w = ws_end(t, q);
                if !starts_at(t, w, "is") {
                    continue;
                }
                let mut a = w + 2;
                if t.get(a) == Some(&':') {
                    a += 1;
                }
                let b = ws_end(t, a);
                let found = latex_list_match(t, b, false, |_| true).or_else(|| {
                    if b > a {
                        latex_list_match(t, b - 1, false, |_| true)
                    } else {
                        None
                    }
                });
                if let Some(envs) = found {
                    let e = last_end(&envs);
                    return latex(envs, e);
                }
            }
            None
        }
        Pattern::LatexAnswerColon | Pattern::LatexAnswer => {
            if !starts_at_ci(t, s, "answer") {
                return None;
            }
            let mut k0 = s + 6;
            if pat == Pattern::LatexAnswerColon {
                if t.get(k0) != Some(&':') {
                    return None;
                }
                k0 += 1;
            }
            for k in 0..=50 {
                let q = k0 + k;
                if q > n {
                    break;
                }
                if let Some(envs) = latex_list_match(t, q, false, |_| true) {
                    let e = last_end(&envs);
                    return latex(envs, e);
                }
            }
            None
        }
        Pattern::ExprPlain | Pattern::NumberPlain => {
            let want_expr = pat == Pattern::ExprPlain;
            let (e, hit) = expr_or_number_at(t, scan, s, want_expr, !want_expr, &|_| true)?;
            Some(Match {
                start: s,
                end: e,
                hit: Hit::Expr(hit),
            })
        }
        Pattern::ExprFinalIs => {
            if !starts_at_ci(t, s, "final answer is") {
                return None;
            }
            let mut k = s + 15;
            if t.get(k) == Some(&':') {
                k += 1;
            }
            let w = ws_end(t, k);
            for q in (k..=w).rev() {
                if let Some((e, hit)) = expr_or_number_at(t, scan, q, true, true, &|e| i_hope(t, e)) {
                    let end = (e..n).find(|&m| starts_at(t, m, "I hope")).map_or(e, |m| m + 6);
                    return Some(Match {
                        start: s,
                        end,
                        hit: Hit::Expr(hit),
                    });
                }
            }
            None
        }
        Pattern::ExprFinalJustIs => {
            if !starts_at_ci(t, s, "final answer") {
                return None;
            }
            for k in 0..=100 {
                let q = s + 12 + k;
                if q >= n || (k > 0 && t[q - 1] == '\n') {
                    break;
                }
                if !t[q].is_whitespace() {
                    continue;
                }
                let w = ws_end(t, q);
                if !starts_at(t, w, "is") {
                    continue;
                }
                let mut a = w + 2;
                if t.get(a) == Some(&':') {
                    a += 1;
                }
                if let Some((e, hit)) = expr_or_number_at(t, scan, a, true, true, &|_| true) {
                    return Some(Match {
                        start: s,
                        end: e,
                        hit: Hit::Expr(hit),
                    });
                }
            }
            None
        }
        Pattern::ExprAnswerColon | Pattern::ExprAnswer => {
            if !starts_at_ci(t, s, "answer") {
                return None;
            }
            let mut k0 = s + 6;
            if pat == Pattern::ExprAnswerColon {
                if t.get(k0) != Some(&':') {
                    return None;
                }
                k0 += 1;
            }
            // `.` does not cross newlines in these patterns.
            let line_end = (k0..n).find(|&m| t[m] == '\n').unwrap_or(n);
            // (?:.{0,100}=\s*|.{0,50}?) : the last `=` within reach first, then lazy 0..=50.
            let reach = (k0 + 100).min(line_end);
            for eq in (k0..reach.min(n)).rev().filter(|&m| t[m] == '=') {
                let w = ws_end(t, eq + 1);
                for q in (eq + 1..=w).rev() {
                    if let Some((e, hit)) = expr_or_number_at(t, scan, q, true, true, &|e| not_followed_by_eq(t, e)) {
                        return Some(Match {
                            start: s,
                            end: e,
                            hit: Hit::Expr(hit),
                        });
                    }
                }
            }
            for k in 0..=50 {
                let q = k0 + k;
                if q > line_end {
                    break;
                }
                if let Some((e, hit)) = expr_or_number_at(t, scan, q, true, true, &|e| not_followed_by_eq(t, e)) {
                    return Some(Match {
                        start: s,
                        end: e,
                        hit: Hit::Expr(hit),
                    });
                }
            }
            None
        }
    }
}

/// Python's `finditer`: non-overlapping matches, left to right.
fn find_all(t: &[char], scan: &Scan, pat: Pattern) -> Vec<Match> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos <= t.len() {
        let mut next = None;
        for s in pos..=t.len() {
            if let Some(m) = match_at(t, scan, s, pat) {
                next = Some(m);
                break;
            }
        }
        let Some(m) = next else { break };
        pos = if m.end > m.start { m.end } else { m.start + 1 };
        out.push(m);
    }
    out
}

fn patterns(cfg: &ExtractConfig) -> Vec<(i32, Pattern)> {
    let mut pats = Vec::new();
    if cfg.latex {
        pats.extend([
            (0, Pattern::LatexFinalIs),
            (50, Pattern::LatexFinalJustIs),
            (100, Pattern::LatexAnswerColon),
            (200, Pattern::LatexAnswer),
            (300, Pattern::LatexPlain),
        ]);
        if cfg.boxed_priority >= 0 {
            pats.push((cfg.boxed_priority, Pattern::LatexBoxedEnvs));
            pats.push((cfg.boxed_priority, Pattern::LatexBoxed));
        }
    }
    if cfg.expr {
        pats.extend([
            (0, Pattern::ExprFinalIs),
            (50, Pattern::ExprFinalJustIs),
            (100, Pattern::ExprAnswerColon),
            (200, Pattern::ExprAnswer),
            (300, Pattern::ExprPlain),
            (300, Pattern::NumberPlain),
        ]);
    }
    // Stable: within a priority, LaTeX patterns come before expression patterns.
    pats.sort_by_key(|(p, _)| *p);
    pats
}

/// Parse a normalized LaTeX string; on failure retry with the part after the last `=` of a chain.
fn parse_latex_with_fallback(latex: &str) -> Option<Value> {
    if let Some(v) = parse_latex(latex) {
        return Some(v);
    }
    let last = last_equation_part(latex);
    if last != latex {
        return parse_latex(&last);
    }
    None
}

/// math-verify's `get_last_eq`: `a = b = c` -> `c` (not when `,` or `;` make it a list).
pub fn last_equation_part(latex: &str) -> String {
    if latex.contains(',') || latex.contains(';') {
        return latex.to_string();
    }
    let t: Vec<char> = latex.chars().collect();
    let mut parts = vec![];
    let mut start = 0;
    for i in 0..t.len() {
        if t[i] == '=' && !(i > 0 && matches!(t[i - 1], '\\' | '<' | '!' | '>')) {
            parts.push(t[start..i].iter().collect::<String>());
            start = i + 1;
        }
    }
    parts.push(t[start..].iter().collect());
    if parts.len() > 2 {
        parts.pop().expect("non-empty")
    } else {
        latex.to_string()
    }
}

/// Normalize and parse one matched LaTeX piece: (value, normalized text).
pub fn parse_latex_piece(piece: &str, boxed: BoxedMode) -> (Option<Value>, String) {
    let normalized = normalize_latex(piece, boxed);
    let v = parse_latex_with_fallback(&normalized);
    (v, normalized)
}

fn extract_match(t: &[char], m: &Match) -> (Option<Value>, String) {
    match &m.hit {
        Hit::Boxed { from, to } => {
            let s: String = t[*from..*to].iter().collect();
            parse_latex_piece(&s, BoxedMode::Last)
        }
        Hit::Latex { envs } => {
            let pieces: Vec<(Option<Value>, String)> = envs
                .iter()
                .map(|e| {
                    let s: String = t[e.content.0..e.content.1].iter().collect();
                    parse_latex_piece(&s, BoxedMode::All)
                })
                .collect();
            if pieces.len() > 1 && pieces.iter().all(|(v, _)| v.is_some()) {
                let mut items = Vec::new();
                let mut texts = Vec::new();
                for (v, s) in pieces {
                    match v.expect("checked") {
                        Value::Set(elems) => items.extend(elems),
                        v => items.push(v),
                    }
                    texts.push(s);
                }
                return (Some(Value::set(items)), texts.join(" and "));
            }
            pieces.into_iter().next().unwrap_or((None, String::new()))
        }
        Hit::Expr(ExprHit::Number { integer, decimal }) => {
            let int: String = integer.chars().filter(|c| *c != ',' && *c != ' ').collect();
            let int = int.trim_start_matches('0');
            let int = if int.is_empty() { "0" } else { int };
            let number = format!("{int}{}", decimal.replace(',', "."));
            let v = if number.contains('.') {
                number.parse::<f64>().ok().map(Expr::Float)
            } else {
                number
                    .parse::<i128>()
                    .ok()
                    .map(Expr::int)
                    .or_else(|| number.parse::<f64>().ok().map(Expr::Float))
            };
            (v.map(Value::Expr), number)
        }
        Hit::Expr(ExprHit::Expr(text)) => {
            let v = parse_plain_expr(&text.replace('\n', " ").replace('^', "**"));
            (v.map(Value::Expr), text.clone())
        }
    }
}

/// Everything extracted from `text`: at most one parsed value, then the fallback string.
pub fn extract(text: &str, cfg: &ExtractConfig) -> Vec<Extracted> {
    let t: Vec<char> = text.chars().collect();
    let scan = Scan::new(&t);
    let pats = patterns(cfg);
    let mut out = Vec::new();
    let mut fallback: Option<String> = None;
    let mut i = 0;
    while i < pats.len() {
        let prio = pats[i].0;
        let mut j = i;
        let mut matches: Vec<Match> = Vec::new();
        while j < pats.len() && pats[j].0 == prio {
            matches.extend(find_all(&t, &scan, pats[j].1));
            j += 1;
        }
        i = j;
        // Rightmost end first, then leftmost start (stable for ties).
        matches.sort_by(|a, b| b.end.cmp(&a.end).then(a.start.cmp(&b.start)));
        let mut got = None;
        for m in &matches {
            let (v, s) = extract_match(&t, m);
            if fallback.is_none() && !s.is_empty() {
                fallback = Some(s);
            }
            if let Some(v) = v {
                got = Some(v);
                break;
            }
        }
        if let Some(v) = got {
            out.push(Extracted::Value(v));
            break;
        }
    }
    if let Some(s) = fallback {
        out.push(Extracted::Str(s));
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Python-syntax arithmetic (`parse_expr` on the plain expression matches)

struct Plain<'a> {
    t: &'a [char],
    i: usize,
}

impl Plain<'_> {
    fn ws(&mut self) {
        while self.i < self.t.len() && self.t[self.i].is_whitespace() {
            self.i += 1;
        }
    }
    fn peek(&mut self) -> Option<char> {
        self.ws();
        self.t.get(self.i).copied()
    }
    fn eat(&mut self, s: &str) -> bool {
        self.ws();
        if starts_at(self.t, self.i, s) {
            self.i += s.chars().count();
            true
        } else {
            false
        }
    }
    fn sum(&mut self) -> Option<Expr> {
        let mut acc = self.term()?;
        loop {
            if self.eat("+") {
                acc = Expr::plus(acc, self.term()?);
            } else if self.eat("-") {
                acc = Expr::minus(acc, self.term()?);
            } else {
                return Some(acc);
            }
        }
    }
    fn term(&mut self) -> Option<Expr> {
        let mut acc = self.factor()?;
        loop {
            self.ws();
            if starts_at(self.t, self.i, "**") {
                return Some(acc);
            }
            if self.eat("*") {
                acc = Expr::times(acc, self.factor()?);
            } else if self.eat("/") {
                let d = self.factor()?;
                acc = Expr::Mul(vec![acc, Expr::pow(d, Expr::int(-1))]);
            } else {
                return Some(acc);
            }
        }
    }
    fn factor(&mut self) -> Option<Expr> {
        if self.eat("+") {
            return self.factor();
        }
        if self.eat("-") {
            return Some(Expr::negated(self.factor()?));
        }
        self.power()
    }
    fn power(&mut self) -> Option<Expr> {
        let base = self.atom()?;
        if self.eat("**") {
            let e = self.factor()?;
            return Some(Expr::pow(base, e));
        }
        Some(base)
    }
    fn atom(&mut self) -> Option<Expr> {
        if self.eat("(") {
            let e = self.sum()?;
            if !self.eat(")") {
                return None;
            }
            return Some(e);
        }
        let c = self.peek()?;
        if !(c.is_ascii_digit() || c == '.') {
            return None;
        }
        let s = self.i;
        while self.i < self.t.len() && (self.t[self.i].is_ascii_digit() || self.t[self.i] == '.') {
            self.i += 1;
        }
        let text: String = self.t[s..self.i].iter().collect();
        if text.contains('.') {
            text.parse::<f64>().ok().map(Expr::Float)
        } else {
            text.parse::<i128>().ok().map(Expr::int)
        }
    }
}

/// Arithmetic in Python syntax (`1/2 + 3**2`); juxtaposition and unknown characters fail.
pub fn parse_plain_expr(s: &str) -> Option<Expr> {
    let t: Vec<char> = s.chars().collect();
    let mut p = Plain { t: &t, i: 0 };
    let e = p.sum()?;
    if p.peek().is_some() {
        return None;
    }
    Some(e)
}
