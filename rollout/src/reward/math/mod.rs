//! Math-answer equivalence: is a predicted answer the gold answer?
//!
//! A Rust reimplementation of what math-verify 0.9.0 decides (its `parse` + `verify`), without a
//! computer-algebra system:
//! - [`extract`]: find the answer in free text (`\boxed{}`, `final answer is`, `$...$`, plain
//!   numbers), by priority;
//! - [`normalize`]: LaTeX clean-up (`\dfrac`, `\left`, units, `\text{}`, percent words, ...);
//! - [`latex`]: a parser for the answer grammar into a [`value::Value`] (numbers, expressions,
//!   relations, sets, tuples, intervals, matrices);
//! - [`compare`]: the equivalence rules (assignments, relations, sets in any order, decimals to 6
//!   places, random-point evaluation for symbolic equality).
//!
//! Entry points: [`math_equal`] for two free-text strings (the conformance target) and
//! [`answers_equivalent`] for two already-extracted answers (what the reward functions use).
//!
//! The behaviour (and word lists such as the units) follows math-verify 0.9.0 (Apache-2.0) and
//! latex2sympy2_extended 1.10.2 (MIT); the code is written from scratch. Conformance: all 267
//! cases of math-verify's own tests (tests/assets/math/answer-equivalence-cases.jsonl), and
//! 20600/20600 agreement with math-verify on MATH-500/GSM8K-derived pairs (see the README there).
//!
//! Known gaps: no computer algebra (symbolic equality is agreement at 6 random points to 1e-10,
//! exact for rational arithmetic), no integrals/limits/derivatives, matrices only as literals
//! with `+` and products; parses over 50k rule steps or 60 levels deep are rejected.

pub mod compare;
pub mod expr;
pub mod extract;
pub mod latex;
pub mod normalize;
pub mod value;

pub use extract::{ExtractConfig, Extracted};

/// Extract the answer candidates from free text.
pub fn parse(text: &str, cfg: &ExtractConfig) -> Vec<Extracted> {
    extract::extract(text, cfg)
}

/// Does any gold candidate match any predicted candidate?
pub fn verify(gold: &[Extracted], pred: &[Extracted]) -> bool {
    compare::verify(gold, pred)
}

/// math-verify's `verify(parse(gold), parse(pred))` on two free-text strings.
pub fn math_equal(gold: &str, pred: &str, cfg: &ExtractConfig) -> bool {
    verify(&parse(gold, cfg), &parse(pred, cfg))
}

/// Candidates for an answer that is already isolated (a `\boxed{}` content or a dataset label):
/// the whole string read as LaTeX, else whatever extraction finds in it; plus the normalized text.
pub fn parse_answer(answer: &str) -> Vec<Extracted> {
    let trimmed = answer.trim();
    let trimmed = trimmed.strip_suffix('.').unwrap_or(trimmed).trim();
    let trimmed = strip_currency_word(trimmed);
    let mut out = Vec::new();
    // `1 000` / `7,425,000`: LaTeX would read the space as a product.
    if let Some(n) = separated_number(trimmed) {
        out.push(Extracted::Value(value::Value::Expr(n)));
    }
    let (value, normalized) = extract::parse_latex_piece(trimmed, normalize::BoxedMode::All);
    match value {
        Some(v) => out.push(Extracted::Value(v)),
        None => {
            let wrapped = format!("${trimmed}$");
            let cfg = ExtractConfig {
                latex: true,
                expr: true,
                boxed_priority: 0,
            };
            out.extend(
                parse(&wrapped, &cfg)
                    .into_iter()
                    .filter(|e| matches!(e, Extracted::Value(_))),
            );
            if out.is_empty() {
                out.extend(
                    parse(trimmed, &cfg)
                        .into_iter()
                        .filter(|e| matches!(e, Extracted::Value(_))),
                );
            }
        }
    }
    if !normalized.is_empty() {
        out.push(Extracted::Str(normalized));
    }
    out
}

/// `18 dollars` -> `18`: currency words after an answer (math-verify's unit list has none).
fn strip_currency_word(s: &str) -> &str {
    const WORDS: &[&str] = &["dollars", "dollar", "euros", "euro", "yuan", "rupees", "rupee", "usd"];
    let lower = s.to_ascii_lowercase();
    for w in WORDS {
        if let Some(head) = lower.strip_suffix(w) {
            if head.ends_with(|c: char| c.is_whitespace() || c.is_ascii_digit()) && !head.trim().is_empty() {
                return s[..head.len()].trim_end();
            }
        }
    }
    s
}

/// A plain number with thousands separators (`1 000`, `1,000,000.5`, `-12 345`).
fn separated_number(s: &str) -> Option<expr::Expr> {
    let t = s.trim();
    let (neg, body) = match t.strip_prefix('-') {
        Some(b) => (true, b),
        None => (false, t),
    };
    let (int, frac) = match body.split_once('.') {
        Some((a, b)) if !b.is_empty() && b.chars().all(|c| c.is_ascii_digit()) => (a, Some(b)),
        Some(_) => return None,
        None => (body, None),
    };
    let sep = if int.contains(' ') && !int.contains(',') {
        ' '
    } else if int.contains(',') && !int.contains(' ') {
        ','
    } else {
        return None;
    };
    let groups: Vec<&str> = int.split(sep).collect();
    let ok = (1..=3).contains(&groups[0].len())
        && groups.iter().all(|g| g.chars().all(|c| c.is_ascii_digit()))
        && groups[1..].iter().all(|g| g.len() == 3);
    if !ok {
        return None;
    }
    let digits: String = groups.concat();
    let text = format!(
        "{}{digits}{}",
        if neg { "-" } else { "" },
        frac.map(|f| format!(".{f}")).unwrap_or_default()
    );
    if frac.is_some() {
        text.parse().ok().map(expr::Expr::Float)
    } else {
        text.parse::<i128>()
            .ok()
            .filter(|_| digits.len() <= 30)
            .map(expr::Expr::int)
    }
}

/// Are two isolated answers the same (gold first: the comparison is not symmetric, e.g. a gold
/// `x = 5` accepts `5`)?
pub fn answers_equivalent(gold: &str, pred: &str) -> bool {
    verify(&parse_answer(gold), &parse_answer(pred))
}

/// Two expressions equal as values (for the "sympy" grader of the `deepscaler`/`math` rewards).
pub fn expressions_equal(a: &str, b: &str) -> bool {
    let parse_one = |s: &str| extract::parse_latex_piece(s, normalize::BoxedMode::None).0;
    match (parse_one(a), parse_one(b)) {
        (Some(x), Some(y)) => compare::value_eq(&x, &y),
        _ => false,
    }
}
