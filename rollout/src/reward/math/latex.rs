//! LaTeX answer parser: a tokenizer and a recursive-descent parser producing a [`Value`].
//!
//! The grammar follows the one math-verify relies on (latex2sympy2_extended's `PS.g4`), so that
//! the same strings parse (and fail to parse) the same way:
//! - a whole answer is `x = a, b, c` (symbols on the left of `=` / `\in`), a list of elements
//!   separated by `,` / `;`, or a set expression (`[0,1) \cup (2,3]`, `x \in ...`);
//! - `(a, b)` is an interval when `a < b` could hold, a tuple otherwise; `{a, b}` is a set;
//! - juxtaposition multiplies, except that an integer followed by a positive rational is a mixed
//!   number (`2 \frac{1}{2}` is `5/2`) and a letter followed by `(atom)` or `(a, b, ...)` is a
//!   function application (`f(x)`);
//! - symbols are lowercased; `\text{...}` is one symbol named by its text;
//! - commands are matched by their longest known prefix (`\quadx` is `\quad x`), unknown
//!   commands are errors.
//!
//! Percent signs are dropped: `28\%` is `28`.

use super::expr::Func as F;
use super::expr::{Expr, Func};
use super::value::{NamedSet, RelOp, Value};

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Num(String),
    ENotation(f64),
    Letter(char),
    Greek(String),
    Other(String),
    Accent(String, String),
    Gamma,
    Infty,
    Partial,
    Plus,
    Minus,
    Star,
    Slash,
    Caret,
    Underscore,
    Bang,
    Comma,
    Semi,
    Colon,
    Amp,
    RowSep,
    Bar,
    Norm,
    LParen,
    RParen,
    LBrack,
    RBrack,
    LBrace,
    RBrace,
    LBraceV,
    RBraceV,
    LParenV,
    RParenV,
    LBraceCmd,
    RBraceCmd,
    LBrackCmd,
    RBrackCmd,
    LGroup,
    RGroup,
    Times,
    Cdot,
    Div,
    Mod,
    Pm,
    Rel(RelOp),
    Approx,
    In,
    NotIn,
    Cup,
    Cap,
    SetMinus,
    Subset,
    Supset,
    Frac,
    Sqrt,
    Binom,
    Choose,
    Boxed,
    Phantom,
    Func(&'static str),
    MultiFunc(&'static str),
    Operatorname(String),
    Sum,
    Prod,
    Int,
    Lim,
    To,
    Begin(String),
    End(String),
    LFloor,
    RFloor,
    LCeil,
    RCeil,
    LVert,
    RVert,
    Vert,
    LAngle,
    RAngle,
    Circ,
    EmptySet,
    Named(NamedSet),
    Period,
}

#[derive(Clone, Debug)]
struct Token {
    tok: Tok,
    start: usize,
    end: usize,
}

const GREEK: &[&str] = &[
    "alpha",
    "beta",
    "delta",
    "Delta",
    "epsilon",
    "varepsilon",
    "zeta",
    "eta",
    "theta",
    "Theta",
    "vartheta",
    "iota",
    "kappa",
    "lambda",
    "Lambda",
    "mu",
    "nu",
    "xi",
    "Xi",
    "omicron",
    "pi",
    "Pi",
    "varpi",
    "rho",
    "varrho",
    "sigma",
    "Sigma",
    "varsigma",
    "tau",
    "upsilon",
    "Upsilon",
    "phi",
    "Phi",
    "varphi",
    "chi",
    "psi",
    "Psi",
    "omega",
    "Omega",
];

const OTHER_SYMBOLS: &[&str] = &[
    "Bbbk",
    "wp",
    "nabla",
    "bigstar",
    "angle",
    "nexists",
    "diagdown",
    "measuredangle",
    "eth",
    "diagup",
    "sphericalangle",
    "clubsuit",
    "varnothing",
    "Diamond",
    "complement",
    "diamondsuit",
    "imath",
    "Finv",
    "triangledown",
    "heartsuit",
    "jmath",
    "Game",
    "triangle",
    "spadesuit",
    "ell",
    "hbar",
    "vartriangle",
    "hslash",
    "blacklozenge",
    "lozenge",
    "blacksquare",
    "mho",
    "blacktriangle",
    "sharp",
    "prime",
    "Im",
    "flat",
    "square",
    "backprime",
    "Re",
    "natural",
    "surd",
    "circledS",
];

const ACCENTS: &[&str] = &[
    "acute",
    "bar",
    "overline",
    "breve",
    "check",
    "widecheck",
    "dot",
    "ddot",
    "grave",
    "hat",
    "tilde",
    "widetilde",
    "vec",
    "overrightarrow",
    "bm",
    "boldsymbol",
    "text",
    "textit",
    "textbf",
    "textnormal",
    "mathbb",
    "mathbin",
    "mathbf",
    "mathcal",
    "mathclap",
    "mathclose",
    "mathellipsis",
    "mathfrak",
    "mathinner",
    "mathit",
    "mathnormal",
    "mathop",
    "mathopen",
    "mathord",
    "mathpunct",
    "mathrel",
    "mathring",
    "mathrlap",
    "mathrm",
    "mathscr",
    "mathsf",
    "mathsterling",
    "mathtt",
    "mbox",
];

const FUNCS: &[&str] = &[
    "log", "ln", "exp", "sin", "cos", "tan", "csc", "sec", "cot", "arcsin", "arccos", "arctan", "arccsc", "arcsec",
    "arccot", "sinh", "cosh", "tanh", "arsinh", "arcosh", "artanh", "arcsinh", "arccosh", "arctanh", "floor", "ceil",
    "det",
];

const MULTI_FUNCS: &[&str] = &["gcd", "lcm", "max", "min"];

const SKIPPED: &[&str] = &[
    "quad",
    "qquad",
    "thinspace",
    "medspace",
    "thickspace",
    "negthinspace",
    "negmedspace",
    "negthickspace",
    "vrule",
    "vcenter",
    "vbox",
    "vskip",
    "vspace",
    "hfil",
    "displaystyle",
];

/// The token for a command name, if it is one the grammar knows.
fn command(name: &str) -> Option<Tok> {
    use Tok::*;
    Some(match name {
        "times" => Times,
        "cdot" => Cdot,
        "div" => Div,
        "over" => Slash,
        "mod" => Mod,
        "frac" | "dfrac" | "tfrac" | "cfrac" => Frac,
        "binom" | "tbinom" | "dbinom" => Binom,
        "choose" => Choose,
        "sqrt" => Sqrt,
        "boxed" => Boxed,
        "phantom" => Phantom,
        "sum" => Sum,
        "prod" => Prod,
        "int" => Int,
        "lim" => Lim,
        "to" | "rightarrow" | "Rightarrow" | "longrightarrow" | "Longrightarrow" => To,
        "lt" => Rel(RelOp::Lt),
        "le" | "leq" | "leqslant" => Rel(RelOp::Le),
        "gt" => Rel(RelOp::Gt),
        "ge" | "geq" | "geqslant" => Rel(RelOp::Ge),
        "ne" | "neq" => Rel(RelOp::Ne),
        "equiv" => Rel(RelOp::Eq),
        "approx" => Approx,
        "in" => In,
        "notin" => NotIn,
        "cup" => Cup,
        "cap" => Cap,
        "setminus" => SetMinus,
        "subseteq" => Subset,
        "supseteq" => Supset,
        "emptyset" => EmptySet,
        "pm" | "mp" => Pm,
        "infty" => Infty,
        "partial" => Partial,
        "lfloor" => LFloor,
        "rfloor" => RFloor,
        "lceil" => LCeil,
        "rceil" => RCeil,
        "llcorner" => LFloor,
        "lrcorner" => RFloor,
        "ulcorner" => LCeil,
        "urcorner" => RCeil,
        "lvert" => LVert,
        "rvert" => RVert,
        "vert" => Vert,
        "langle" => LAngle,
        "rangle" => RAngle,
        "lbrace" => LBraceCmd,
        "rbrace" => RBraceCmd,
        "lbrack" => LBrackCmd,
        "rbrack" => RBrackCmd,
        "lgroup" => LGroup,
        "rgroup" => RGroup,
        "circ" | "degree" | "circle" => Circ,
        "Gamma" | "gamma" => Gamma,
        "exponentialE" => Letter('e'),
        _ => {
            if let Some(f) = FUNCS.iter().find(|f| **f == name) {
                Func(f)
            } else if let Some(f) = MULTI_FUNCS.iter().find(|f| **f == name) {
                MultiFunc(f)
            } else if GREEK.contains(&name) {
                Greek(name.to_string())
            } else if OTHER_SYMBOLS.contains(&name) {
                Other(name.to_string())
            } else {
                return None;
            }
        }
    })
}

/// Longest prefix of `letters` that is a known command (or accent, or a skipped command).
fn longest_command(letters: &str) -> Option<&str> {
    (1..=letters.len()).rev().map(|n| &letters[..n]).find(|p| {
        command(p).is_some()
            || ACCENTS.contains(p)
            || SKIPPED.contains(p)
            || matches!(*p, "begin" | "end" | "operatorname" | "mathbb")
    })
}

fn unicode_token(c: char) -> Option<Tok> {
    use Tok::*;
    let greek = |s: &str| Some(Greek(s.to_string()));
    match c {
        '×' | '⋅' | '·' | '∗' | '∘' | '∙' | '⋆' | '⊗' => Some(Times),
        '÷' | '∕' => Some(Div),
        '−' | '∸' => Some(Minus),
        '∔' | '⊕' => Some(Plus),
        '≤' | '≦' | '⩽' => Some(Rel(RelOp::Le)),
        '≥' | '≧' | '⩾' => Some(Rel(RelOp::Ge)),
        '≠' => Some(Rel(RelOp::Ne)),
        '≈' | '≃' | '≅' => Some(Approx),
        '∞' => Some(Infty),
        '∪' => Some(Cup),
        '∩' => Some(Cap),
        '±' | '∓' => Some(Pm),
        '∈' => Some(In),
        '∉' => Some(NotIn),
        '∅' => Some(EmptySet),
        'ℕ' => Some(Named(NamedSet::Naturals)),
        'ℤ' => Some(Named(NamedSet::Integers)),
        'ℚ' => Some(Named(NamedSet::Rationals)),
        'ℝ' => Some(Named(NamedSet::Reals)),
        'ℂ' => Some(Named(NamedSet::Complexes)),
        'α' => greek("alpha"),
        'β' => greek("beta"),
        'γ' | 'Γ' => Some(Gamma),
        'δ' => greek("delta"),
        'Δ' => greek("Delta"),
        'ε' => greek("epsilon"),
        'θ' => greek("theta"),
        'λ' => greek("lambda"),
        'μ' => greek("mu"),
        'π' => greek("pi"),
        'ρ' => greek("rho"),
        'σ' => greek("sigma"),
        'τ' => greek("tau"),
        'φ' => greek("phi"),
        'ω' => greek("omega"),
        _ => None,
    }
}

fn lex(src: &[char]) -> Option<Vec<Token>> {
    let mut out = Vec::new();
    let n = src.len();
    let mut i = 0;
    let at = |k: usize| src.get(k).copied().unwrap_or('\0');
    while i < n {
        let c = src[i];
        let start = i;
        if c.is_whitespace() {
            i += 1;
            continue;
        }
        let push = |out: &mut Vec<Token>, tok: Tok, end: usize| out.push(Token { tok, start, end });
        if c.is_ascii_digit() || (c == '.' && at(i + 1).is_ascii_digit()) {
            let mut j = i;
            while j < n && src[j].is_ascii_digit() {
                j += 1;
            }
            if at(j) == '.' && at(j + 1).is_ascii_digit() {
                j += 1;
                while j < n && src[j].is_ascii_digit() {
                    j += 1;
                }
            }
            let digits: String = src[i..j].iter().collect();
            // E notation: 1E5, 2.5E-3.
            if at(j) == 'E' {
                let mut k = j + 1;
                if matches!(at(k), '+' | '-') {
                    k += 1;
                }
                if at(k).is_ascii_digit() {
                    while k < n && src[k].is_ascii_digit() {
                        k += 1;
                    }
                    let text: String = src[i..k].iter().collect();
                    push(&mut out, Tok::ENotation(text.parse().ok()?), k);
                    i = k;
                    continue;
                }
            }
            // Percent number: `28%`, `28\%`, `28 \%` (at most one space).
            let mut k = j;
            if at(k).is_whitespace() {
                k += 1;
            }
            if at(k) == '%' {
                j = k + 1;
            } else if at(k) == '\\' && at(k + 1) == '%' {
                j = k + 2;
            }
            push(&mut out, Tok::Num(digits), j);
            i = j;
            continue;
        }
        if c.is_ascii_alphabetic() {
            push(&mut out, Tok::Letter(c), i + 1);
            i += 1;
            continue;
        }
        if c == '\\' {
            let d = at(i + 1);
            if d.is_ascii_alphabetic() {
                let mut j = i + 1;
                while j < n && src[j].is_ascii_alphabetic() {
                    j += 1;
                }
                let letters: String = src[i + 1..j].iter().collect();
                let name = longest_command(&letters)?.to_string();
                let mut end = i + 1 + name.len();
                if SKIPPED.contains(&name.as_str()) {
                    i = end;
                    continue;
                }
                match name.as_str() {
                    "begin" | "end" => {
                        // \begin{pmatrix}, \begin{array}{cc}
                        if at(end) != '{' {
                            return None;
                        }
                        let close = (end..n).find(|&k| src[k] == '}')?;
                        let env: String = src[end + 1..close].iter().collect();
                        end = close + 1;
                        if name == "begin" && env == "array" && at(end) == '{' {
                            end = (end..n).find(|&k| src[k] == '}')? + 1;
                        }
                        let tok = if name == "begin" {
                            Tok::Begin(env)
                        } else {
                            Tok::End(env)
                        };
                        push(&mut out, tok, end);
                    }
                    "operatorname" => {
                        if at(end) != '{' {
                            return None;
                        }
                        let close = (end..n).find(|&k| src[k] == '}')?;
                        let op: String = src[end + 1..close].iter().filter(|c| !c.is_whitespace()).collect();
                        push(&mut out, Tok::Operatorname(op), close + 1);
                        end = close + 1;
                    }
                    _ if ACCENTS.contains(&name.as_str()) => {
                        // ACCENT: \cmd WS? { ... } up to the first unescaped `}`, no nesting.
                        let mut k = end;
                        if at(k).is_whitespace() {
                            k += 1;
                        }
                        if at(k) != '{' {
                            return None;
                        }
                        let mut m = k + 1;
                        loop {
                            if m >= n {
                                return None;
                            }
                            if src[m] == '\\' && at(m + 1) == '}' {
                                m += 2;
                                continue;
                            }
                            if src[m] == '}' {
                                break;
                            }
                            m += 1;
                        }
                        let text: String = src[k + 1..m].iter().collect();
                        let tok = if name == "mathbb" {
                            match text.trim() {
                                "N" => Tok::Named(NamedSet::Naturals),
                                "Z" => Tok::Named(NamedSet::Integers),
                                "Q" => Tok::Named(NamedSet::Rationals),
                                "R" => Tok::Named(NamedSet::Reals),
                                "C" => Tok::Named(NamedSet::Complexes),
                                "P" => Tok::Named(NamedSet::Primes),
                                _ => Tok::Accent(name.clone(), text),
                            }
                        } else {
                            Tok::Accent(name.clone(), text)
                        };
                        end = m + 1;
                        push(&mut out, tok, end);
                    }
                    _ => {
                        let tok = command(&name)?;
                        // GREEK_CMD / OTHER_SYMBOL_CMD swallow one trailing space.
                        push(&mut out, tok, end);
                    }
                }
                i = end;
                continue;
            }
            let tok = match d {
                '\\' => Some(Tok::RowSep),
                '{' => Some(Tok::LBraceV),
                '}' => Some(Tok::RBraceV),
                '(' => Some(Tok::LParenV),
                ')' => Some(Tok::RParenV),
                '|' => Some(Tok::Norm),
                ',' | ';' | ':' | '!' | ' ' | '$' => None,
                _ => return None,
            };
            if let Some(tok) = tok {
                push(&mut out, tok, i + 2);
            }
            i += 2;
            continue;
        }
        let two: String = [c, at(i + 1)].iter().collect();
        let (tok, len) = match two.as_str() {
            "<=" => (Tok::Rel(RelOp::Le), 2),
            ">=" => (Tok::Rel(RelOp::Ge), 2),
            "!=" => (Tok::Rel(RelOp::Ne), if at(i + 2) == '=' { 3 } else { 2 }),
            "==" => (Tok::Rel(RelOp::Eq), 2),
            "~=" => (Tok::Approx, 2),
            _ => match c {
                '+' => (Tok::Plus, 1),
                '-' => (Tok::Minus, 1),
                '*' => (Tok::Star, 1),
                '/' => (Tok::Slash, 1),
                '^' => (Tok::Caret, 1),
                '_' => (Tok::Underscore, 1),
                '!' => (Tok::Bang, 1),
                ',' => (Tok::Comma, 1),
                ';' => (Tok::Semi, 1),
                ':' => (Tok::Colon, 1),
                '&' => (Tok::Amp, 1),
                '|' => (Tok::Bar, 1),
                '(' => (Tok::LParen, 1),
                ')' => (Tok::RParen, 1),
                '[' => (Tok::LBrack, 1),
                ']' => (Tok::RBrack, 1),
                '{' => (Tok::LBrace, 1),
                '}' => (Tok::RBrace, 1),
                '=' => (Tok::Rel(RelOp::Eq), 1),
                '<' => (Tok::Rel(RelOp::Lt), 1),
                '>' => (Tok::Rel(RelOp::Gt), 1),
                '.' => (Tok::Period, 1),
                '°' => (Tok::Circ, 1),
                _ => (unicode_token(c)?, 1),
            },
        };
        push(&mut out, tok, i + len);
        i += len;
    }
    Some(out)
}

type P<T> = Result<T, ()>;

struct Parser<'a> {
    toks: Vec<Token>,
    pos: usize,
    src: &'a [char],
    abs_depth: usize,
    /// Nesting of `expr` calls (bounded: model outputs can nest pathologically).
    depth: usize,
    /// Total `expr` calls, backtracking included (bounded: alternatives re-parse).
    steps: usize,
}

/// Deepest nesting and largest amount of work a parse may take before it is rejected.
const MAX_DEPTH: usize = 60;
const MAX_STEPS: usize = 50_000;

fn parse_number(text: &str) -> Expr {
    let t: String = text.chars().filter(|c| *c != ',').collect();
    if t.chars().all(|c| c.is_ascii_digit()) {
        let trimmed = t.trim_start_matches('0');
        let digits = if trimmed.is_empty() { "0" } else { trimmed };
        // Exact up to 30 digits (products of two such stay within i128 checks).
        match digits.parse::<i128>().ok().filter(|_| digits.len() <= 30).ok_or(()) {
            Ok(n) => Expr::int(n),
            Err(_) => Expr::Float(digits.parse().unwrap_or(f64::NAN)),
        }
    } else {
        Expr::Float(t.parse().unwrap_or(f64::NAN))
    }
}

/// `a \pm b` gives `a + b` and `a - b`; a lone `\pm b` gives `-b` and `b`.
fn unary_minus(e: Expr) -> Expr {
    Expr::negated(e)
}

/// latex2sympy's `convert_elements_to_set_or_tuple`.
fn set_or_tuple(mut groups: Vec<Vec<Value>>) -> Value {
    if groups.len() == 1 {
        let g = groups.pop().unwrap_or_default();
        if g.len() == 1 {
            return g.into_iter().next().expect("one element");
        }
        return Value::set(g);
    }
    if groups.iter().all(|g| g.len() == 1) {
        return Value::set(groups.into_iter().flatten().collect());
    }
    Value::set(groups.into_iter().map(Value::Tuple).collect())
}

fn interval(lo: Expr, hi: Expr, lo_open: bool, hi_open: bool) -> Value {
    // An interval that would be empty is read as a pair: (3, 1) is the tuple (3, 1).
    if let (Some(a), Some(b)) = (real_constant(&lo), real_constant(&hi)) {
        if (lo_open && hi_open && b <= a) || (!lo_open && !hi_open && b < a) {
            return Value::Tuple(vec![Value::Expr(lo), Value::Expr(hi)]);
        }
    }
    Value::Interval {
        lo,
        hi,
        lo_open,
        hi_open,
    }
}

fn real_constant(e: &Expr) -> Option<f64> {
    let v = super::expr::constant_value(e)?;
    if v.im.abs() < 1e-12 {
        Some(v.re)
    } else {
        None
    }
}

fn relation_value(op: RelOp, lh: Value, rh: Value) -> Value {
    match lh {
        Value::And(mut v) => {
            let last = v.last().and_then(|r| r.rhs()).cloned().expect("chain of relations");
            v.push(Value::Rel(op, Box::new(last), Box::new(rh)));
            Value::And(v)
        }
        Value::Rel(o, l, r) => {
            let mid = (*r).clone();
            Value::And(vec![Value::Rel(o, l, r), Value::Rel(op, Box::new(mid), Box::new(rh))])
        }
        lh => Value::Rel(op, Box::new(lh), Box::new(rh)),
    }
}

fn closes(open: &Tok, close: &Tok) -> bool {
    use Tok::*;
    matches!(
        (open, close),
        (LParen, RParen)
            | (LBrace, RBrace)
            | (LBrack, RBrack)
            | (LBraceV, RBraceV)
            | (LBraceCmd, RBraceCmd)
            | (LBrackCmd, RBrackCmd)
            | (LGroup, RGroup)
    )
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos).map(|t| &t.tok)
    }
    fn peek_at(&self, k: usize) -> Option<&Tok> {
        self.toks.get(self.pos + k).map(|t| &t.tok)
    }
    fn eof(&self) -> bool {
        self.pos >= self.toks.len()
    }
    fn bump(&mut self) -> Option<Tok> {
        let t = self.toks.get(self.pos).map(|t| t.tok.clone());
        self.pos += 1;
        t
    }
    fn eat(&mut self, t: &Tok) -> bool {
        if self.peek() == Some(t) {
            self.pos += 1;
            true
        } else {
            false
        }
    }
    fn expect(&mut self, t: &Tok) -> P<()> {
        if self.eat(t) {
            Ok(())
        } else {
            Err(())
        }
    }
    /// Source text of tokens `from..to` without whitespace (ANTLR's `getText`).
    fn text(&self, from: usize, to: usize) -> String {
        if from >= to {
            return String::new();
        }
        let (s, e) = (self.toks[from].start, self.toks[to - 1].end);
        self.src[s..e].iter().filter(|c| !c.is_whitespace()).collect()
    }
    fn attempt<T>(&mut self, f: impl FnOnce(&mut Self) -> P<T>) -> P<T> {
        let (pos, abs_depth, depth) = (self.pos, self.abs_depth, self.depth);
        let r = f(self);
        if r.is_err() {
            self.pos = pos;
            self.abs_depth = abs_depth;
            self.depth = depth;
        }
        r
    }

    // ---- top level ----

    fn math(&mut self) -> P<Value> {
        if let Ok(v) = self.attempt(|p| {
            let v = p.set_elements_relation()?;
            if p.eof() {
                Ok(v)
            } else {
                Err(())
            }
        }) {
            return Ok(v);
        }
        if let Ok(v) = self.attempt(|p| {
            let groups = p.semicolon_elements(false)?;
            if p.eof() {
                Ok(set_or_tuple(groups))
            } else {
                Err(())
            }
        }) {
            return Ok(v);
        }
        self.attempt(|p| {
            let v = p.set_relation()?;
            if p.eof() {
                Ok(v)
            } else {
                Err(())
            }
        })
    }

    fn set_elements_relation(&mut self) -> P<Value> {
        let lhs = self.atom_expr_list()?;
        match self.bump() {
            Some(Tok::In) | Some(Tok::Rel(RelOp::Eq)) => {}
            _ => return Err(()),
        }
        let groups = self.semicolon_elements(true)?;
        Ok(Value::Rel(RelOp::Eq, Box::new(lhs), Box::new(set_or_tuple(groups))))
    }

    fn atom_expr_list(&mut self) -> P<Value> {
        if self.peek() == Some(&Tok::LParen) {
            return self.attempt(|p| {
                p.bump();
                let mut items = vec![Value::Expr(p.atom_expr()?)];
                while p.eat(&Tok::Comma) {
                    items.push(Value::Expr(p.atom_expr()?));
                }
                p.expect(&Tok::RParen)?;
                Ok(if items.len() == 1 {
                    items.pop().expect("one")
                } else {
                    Value::Tuple(items)
                })
            });
        }
        Ok(Value::Expr(self.atom_expr()?))
    }

    fn semicolon_elements(&mut self, no_relation: bool) -> P<Vec<Vec<Value>>> {
        let mut groups = vec![self.comma_elements(no_relation)?];
        while self.eat(&Tok::Semi) {
            groups.push(self.comma_elements(no_relation)?);
        }
        Ok(groups)
    }

    fn comma_elements(&mut self, no_relation: bool) -> P<Vec<Value>> {
        let mut items = self.element(no_relation)?;
        while self.eat(&Tok::Comma) {
            items.extend(self.element(no_relation)?);
        }
        Ok(items)
    }

    fn at_element_end(&self) -> bool {
        use Tok::*;
        matches!(
            self.peek(),
            None | Some(Comma | Semi | RParen | RBrack | RBrace | RBraceV | RParenV | RBrackCmd | RGroup)
        )
    }

    fn element(&mut self, no_relation: bool) -> P<Vec<Value>> {
        self.guarded(|p| p.element_inner(no_relation))
    }

    fn element_inner(&mut self, no_relation: bool) -> P<Vec<Value>> {
        // plus_minus_expr
        if let Ok(v) = self.attempt(|p| {
            let v = if p.eat(&Tok::Pm) {
                let e = p.expr()?;
                vec![Value::Expr(unary_minus(e.clone())), Value::Expr(e)]
            } else {
                let a = p.expr()?;
                p.expect(&Tok::Pm)?;
                let b = p.expr()?;
                vec![
                    Value::Expr(Expr::plus(a.clone(), b.clone())),
                    Value::Expr(Expr::plus(a, unary_minus(b))),
                ]
            };
            if p.at_element_end() {
                Ok(v)
            } else {
                Err(())
            }
        }) {
            return Ok(v);
        }
        if let Ok(v) = self.attempt(|p| {
            let v = p.set_atom()?;
            if p.at_element_end() {
                Ok(vec![v])
            } else {
                Err(())
            }
        }) {
            return Ok(v);
        }
        self.attempt(|p| {
            let v = if no_relation {
                Value::Expr(p.expr()?)
            } else {
                p.relation()?
            };
            if p.at_element_end() {
                Ok(vec![v])
            } else {
                Err(())
            }
        })
    }

    fn set_relation(&mut self) -> P<Value> {
        if let Ok(v) = self.attempt(|p| {
            let lhs = p.atom_expr_list()?;
            match p.bump() {
                Some(Tok::In) | Some(Tok::Rel(RelOp::Eq)) => {}
                _ => return Err(()),
            }
            let rhs = p.set_relation()?;
            Ok(Value::Rel(RelOp::Eq, Box::new(lhs), Box::new(rhs)))
        }) {
            return Ok(v);
        }
        self.union_expr()
    }

    fn union_expr(&mut self) -> P<Value> {
        let to_set = |v: Value| match v {
            Value::Tuple(items) => Value::set(items),
            v => v,
        };
        let first = self.set_group()?;
        if self.peek() != Some(&Tok::Cup) {
            return Ok(first);
        }
        let mut parts = vec![to_set(first)];
        while self.eat(&Tok::Cup) {
            match to_set(self.set_group()?) {
                Value::Union(v) => parts.extend(v),
                v => parts.push(v),
            }
        }
        Ok(Value::Union(parts))
    }

    fn set_group(&mut self) -> P<Value> {
        self.guarded(|p| p.set_group_inner())
    }

    fn set_group_inner(&mut self) -> P<Value> {
        if let Ok(v) = self.attempt(|p| p.set_atom()) {
            return Ok(v);
        }
        self.attempt(|p| {
            p.expect(&Tok::LParen)?;
            let v = p.union_expr()?;
            p.expect(&Tok::RParen)?;
            Ok(v)
        })
    }

    fn set_atom(&mut self) -> P<Value> {
        self.guarded(|p| p.set_atom_inner())
    }

    fn set_atom_inner(&mut self) -> P<Value> {
        use Tok::*;
        // interval
        if let Ok(v) = self.attempt(|p| {
            let lo_open = match p.bump() {
                Some(LBrack | LBrackCmd) => false,
                Some(LParen | LParenV | LGroup) => true,
                _ => return Err(()),
            };
            let lo = p.expr()?;
            p.expect(&Comma)?;
            let hi = p.expr()?;
            let hi_open = match p.bump() {
                Some(RBrack | RBrackCmd) => false,
                Some(RParen | RParenV | RGroup) => true,
                _ => return Err(()),
            };
            Ok(interval(lo, hi, lo_open, hi_open))
        }) {
            return Ok(v);
        }
        // literal sets
        match self.peek() {
            Some(Named(n)) => {
                let n = *n;
                self.bump();
                return Ok(Value::Named(n));
            }
            Some(EmptySet) => {
                self.bump();
                return Ok(Value::Named(NamedSet::Empty));
            }
            Some(LBrace) if self.peek_at(1) == Some(&RBrace) => {
                self.pos += 2;
                return Ok(Value::Named(NamedSet::Empty));
            }
            Some(LBraceV) if self.peek_at(1) == Some(&RBraceV) => {
                self.pos += 2;
                return Ok(Value::Named(NamedSet::Empty));
            }
            _ => {}
        }
        // ordered tuple
        if let Ok(v) = self.attempt(|p| {
            let close = match p.bump() {
                Some(LParen) => RParen,
                Some(LParenV) => RParenV,
                Some(LBrack) => RBrack,
                _ => return Err(()),
            };
            let groups = p.semicolon_elements(false)?;
            p.expect(&close)?;
            let mut items: Vec<Value> = groups.into_iter().flatten().collect();
            Ok(if items.len() == 1 {
                items.pop().expect("one")
            } else {
                Value::Tuple(items)
            })
        }) {
            return Ok(v);
        }
        // finite set
        self.attempt(|p| {
            let (close, boxed) = match p.bump() {
                Some(LBrace) => (RBrace, false),
                Some(LBraceV) => (RBraceV, false),
                Some(Boxed) => {
                    p.expect(&LBrace)?;
                    (RBrace, true)
                }
                _ => return Err(()),
            };
            let groups = p.semicolon_elements(false)?;
            p.expect(&close)?;
            Ok(if boxed {
                set_or_tuple(groups)
            } else {
                Value::set(groups.into_iter().flatten().collect())
            })
        })
    }

    fn relation(&mut self) -> P<Value> {
        let mut lh = Value::Expr(self.expr()?);
        loop {
            let op = match self.peek() {
                Some(Tok::Rel(op)) => Some(*op),
                Some(Tok::Approx) => None,
                _ => return Ok(lh),
            };
            self.bump();
            let rh = Value::Expr(self.expr()?);
            lh = match op {
                Some(op) => relation_value(op, lh, rh),
                None => {
                    // `x \approx 3` keeps 3, `1/3 \approx 0.33` keeps 1/3.
                    let symbolic_lhs = matches!(&lh, Value::Expr(e) if e.only_symbols());
                    if symbolic_lhs {
                        rh
                    } else {
                        lh
                    }
                }
            };
        }
    }

    // ---- expressions ----

    /// Run a recursive rule under the depth and work budgets.
    fn guarded<T>(&mut self, f: impl FnOnce(&mut Self) -> P<T>) -> P<T> {
        self.steps += 1;
        if self.depth >= MAX_DEPTH || self.steps > MAX_STEPS {
            return Err(());
        }
        self.depth += 1;
        let r = f(self);
        self.depth -= 1;
        r
    }

    fn expr(&mut self) -> P<Expr> {
        self.guarded(|p| p.expr_inner())
    }

    fn expr_inner(&mut self) -> P<Expr> {
        let mut lh = self.mp()?;
        loop {
            if self.eat(&Tok::Plus) {
                let rh = self.mp()?;
                lh = Expr::plus(lh, rh);
            } else if self.eat(&Tok::Minus) {
                let rh = self.mp()?;
                lh = Expr::minus(lh, rh);
            } else {
                return Ok(lh);
            }
        }
    }

    fn mp(&mut self) -> P<Expr> {
        let mut lh = self.unary()?;
        loop {
            match self.peek() {
                Some(Tok::Star | Tok::Times | Tok::Cdot) => {
                    self.bump();
                    let rh = self.unary()?;
                    lh = Expr::times(lh, rh);
                }
                Some(Tok::Slash | Tok::Div | Tok::Colon) => {
                    self.bump();
                    let rh = self.unary()?;
                    if lh.is_matrix() || rh.is_matrix() {
                        return Err(());
                    }
                    lh = Expr::over(lh, rh);
                }
                Some(Tok::Mod) => {
                    self.bump();
                    let rh = self.unary()?;
                    lh = Expr::call(Func::Mod, vec![lh, rh]);
                }
                _ => return Ok(lh),
            }
        }
    }

    fn unary(&mut self) -> P<Expr> {
        if self.eat(&Tok::Plus) {
            return self.unary();
        }
        if self.eat(&Tok::Minus) {
            let e = self.unary()?;
            return Ok(Expr::negated(e));
        }
        self.postfix_list(false)
    }

    fn can_start_postfix(&self, no_func: bool) -> bool {
        use Tok::*;
        let Some(t) = self.peek() else { return false };
        match t {
            Func(_) | MultiFunc(_) | Operatorname(_) | Sum | Prod | Sqrt | Int | Lim => !no_func,
            Letter('e') => !no_func,
            Bar | Vert => self.abs_depth == 0,
            Num(_) | ENotation(_) | Letter(_) | Greek(_) | Other(_) | Accent(..) | Gamma | Infty | Partial | LParen
            | LBrace | LBrack | LBraceV | LBraceCmd | LBrackCmd | LGroup | Norm | LVert | LFloor | LCeil | Frac
            | Binom | Begin(_) | Boxed | Phantom => true,
            _ => false,
        }
    }

    /// `postfix+`: juxtaposed factors multiply (mixed numbers excepted).
    fn postfix_list(&mut self, no_func_tail: bool) -> P<Expr> {
        let mut items = vec![self.postfix()?];
        while self.can_start_postfix(no_func_tail) {
            match self.attempt(|p| p.postfix()) {
                Ok(e) => items.push(e),
                Err(()) => break,
            }
        }
        let mut acc = items.pop().expect("one item");
        while let Some(res) = items.pop() {
            let mixed = match (&res, &acc) {
                (Expr::Rat(n, 1), Expr::Rat(p, q)) if *p > 0 && *q > 0 => {
                    let whole = n.checked_mul(*q);
                    let num = if *n < 0 {
                        whole.and_then(|w| w.checked_sub(*p))
                    } else {
                        whole.and_then(|w| w.checked_add(*p))
                    };
                    num.map(|num| Expr::rat(num, *q))
                }
                _ => None,
            };
            acc = match mixed {
                Some(m) => m,
                None => Expr::times(res, acc),
            };
        }
        Ok(acc)
    }

    fn is_degree(&self) -> bool {
        matches!(
            (self.peek(), self.peek_at(1), self.peek_at(2), self.peek_at(3)),
            (Some(Tok::Caret), Some(Tok::Circ), ..)
                | (Some(Tok::Caret), Some(Tok::LBrace), Some(Tok::Circ), Some(Tok::RBrace))
        )
    }

    fn skip_degree(&mut self) {
        if self.peek_at(1) == Some(&Tok::Circ) {
            self.pos += 2;
        } else {
            self.pos += 4;
        }
    }

    fn postfix(&mut self) -> P<Expr> {
        let mut e = self.exp()?;
        loop {
            if self.eat(&Tok::Bang) {
                e = Expr::call(Func::Factorial, vec![e]);
            } else if self.is_degree() {
                self.skip_degree();
            } else {
                return Ok(e);
            }
        }
    }

    fn exp(&mut self) -> P<Expr> {
        let mut base = self.comp()?;
        while self.peek() == Some(&Tok::Caret) && !self.is_degree() {
            self.bump();
            let exponent = self.sup_body()?;
            self.maybe_subexpr()?;
            base = Expr::pow(base, exponent);
        }
        Ok(base)
    }

    /// After `^`: an atom or `{expr}`.
    fn sup_body(&mut self) -> P<Expr> {
        if self.eat(&Tok::LBrace) {
            let e = self.expr()?;
            self.expect(&Tok::RBrace)?;
            return Ok(e);
        }
        self.atom()
    }

    /// An ignored `_x` / `_{...}` after a number or power.
    fn maybe_subexpr(&mut self) -> P<()> {
        if self.eat(&Tok::Underscore) {
            if self.eat(&Tok::LBrace) {
                let _ = self.expr()?;
                while self.eat(&Tok::Comma) {
                    let _ = self.expr()?;
                }
                self.expect(&Tok::RBrace)?;
            } else {
                let _ = self.atom()?;
            }
        }
        Ok(())
    }

    fn comp(&mut self) -> P<Expr> {
        use Tok::*;
        let Some(t) = self.peek().cloned() else { return Err(()) };
        match t {
            LParen | LBrace | LBrack | LBraceV | LBraceCmd | LBrackCmd | LGroup => {
                self.bump();
                let e = self.expr()?;
                if t == LBrace && self.eat(&Choose) {
                    let k = self.expr()?;
                    self.expect(&RBrace)?;
                    return Ok(Expr::call(F::Binom, vec![e, k]));
                }
                let close = self.bump().ok_or(())?;
                if !closes(&t, &close) {
                    return Err(());
                }
                Ok(e)
            }
            Phantom | Boxed => {
                self.bump();
                self.expect(&LBrace)?;
                let e = self.expr()?;
                self.expect(&RBrace)?;
                Ok(e)
            }
            Norm | Bar | LVert | Vert => {
                self.bump();
                self.abs_depth += 1;
                let e = self.expr()?;
                self.abs_depth -= 1;
                let close = self.bump().ok_or(())?;
                let ok = matches!((&t, &close), (Norm, Norm) | (Bar, Bar) | (LVert, RVert) | (Vert, Vert));
                if !ok {
                    return Err(());
                }
                Ok(Expr::call(F::Abs, vec![e]))
            }
            LFloor | LCeil => {
                self.bump();
                let e = self.expr()?;
                let close = if t == LFloor { RFloor } else { RCeil };
                self.expect(&close)?;
                Ok(Expr::call(if t == LFloor { F::Floor } else { F::Ceil }, vec![e]))
            }
            Frac => {
                self.bump();
                self.expect(&LBrace)?;
                let top = self.expr()?;
                self.expect(&RBrace)?;
                self.expect(&LBrace)?;
                let bot = self.expr()?;
                self.expect(&RBrace)?;
                if top.is_matrix() || bot.is_matrix() {
                    return Err(());
                }
                Ok(Expr::over(top, bot))
            }
            Binom => {
                self.bump();
                self.expect(&LBrace)?;
                let n = self.expr()?;
                self.expect(&RBrace)?;
                self.expect(&LBrace)?;
                let k = self.expr()?;
                self.expect(&RBrace)?;
                Ok(Expr::call(F::Binom, vec![n, k]))
            }
            Begin(env) => self.matrix(&env),
            Sqrt => {
                self.bump();
                let root = if self.eat(&LBrack) {
                    let r = self.expr()?;
                    self.expect(&RBrack)?;
                    Some(r)
                } else {
                    None
                };
                self.expect(&LBrace)?;
                let base = self.expr()?;
                self.expect(&RBrace)?;
                let exponent = match root {
                    Some(r) => Expr::over(Expr::int(1), r),
                    None => Expr::rat(1, 2),
                };
                Ok(Expr::pow(base, exponent))
            }
            Func(name) => self.func(name),
            MultiFunc(name) => self.multi_func(name),
            Operatorname(name) => self.operatorname(&name),
            Sum | Prod => self.big_op(t == Prod),
            Letter('e') => {
                self.bump();
                if self.peek() == Some(&Caret) && !self.is_degree() {
                    self.bump();
                    let x = self.sup_body()?;
                    return Ok(Expr::call(F::Exp, vec![x]));
                }
                Ok(Expr::E)
            }
            Letter(_) | Greek(_) | Other(_) | Accent(..) => {
                if let Ok(e) = self.attempt(|p| p.applied_function()) {
                    return Ok(e);
                }
                self.atom()
            }
            _ => self.atom(),
        }
    }

    /// `f(x)`, `f(x, y)`, `f^2(x)`: a letter applied to one atom or to a comma list.
    fn applied_function(&mut self) -> P<Expr> {
        let head_start = self.pos;
        match self.bump() {
            Some(Tok::Letter(c)) if c != 'e' && c != 'E' => {}
            Some(Tok::Greek(_) | Tok::Other(_) | Tok::Accent(..)) => {}
            _ => return Err(()),
        }
        if self.peek() == Some(&Tok::Underscore) {
            self.bump();
            if self.eat(&Tok::LBrace) {
                let _ = self.expr()?;
                while self.eat(&Tok::Comma) {
                    let _ = self.expr()?;
                }
                self.expect(&Tok::RBrace)?;
            } else {
                let _ = self.atom()?;
            }
        }
        let name = self.text(head_start, self.pos);
        let power = if self.peek() == Some(&Tok::Caret) && !self.is_degree() {
            self.bump();
            Some(self.sup_body()?)
        } else {
            None
        };
        self.expect(&Tok::LParen)?;
        let mut args = Vec::new();
        let single = self.attempt(|p| {
            let a = p.atom()?;
            p.expect(&Tok::RParen)?;
            Ok(a)
        });
        match single {
            Ok(a) => args.push(a),
            Err(()) => {
                args.push(self.expr()?);
                self.expect(&Tok::Comma)?;
                if !self.eat(&Tok::RParen) {
                    args.push(self.expr()?);
                    while self.eat(&Tok::Comma) {
                        args.push(self.expr()?);
                    }
                    self.expect(&Tok::RParen)?;
                }
            }
        }
        let f = Expr::Apply(name, args);
        Ok(match power {
            Some(p) => Expr::pow(f, p),
            None => f,
        })
    }

    fn atom(&mut self) -> P<Expr> {
        use Tok::*;
        match self.peek().cloned().ok_or(())? {
            Letter(c) if c != 'e' && c != 'E' => self.atom_expr(),
            Greek(_) | Other(_) | Accent(..) => self.atom_expr(),
            Letter('E') => {
                self.bump();
                Ok(Expr::Sym("e".into()))
            }
            Letter(_) => {
                self.bump();
                Ok(Expr::E)
            }
            Infty => {
                self.bump();
                Ok(Expr::Inf)
            }
            Partial => {
                self.bump();
                Ok(Expr::Sym("partial".into()))
            }
            Gamma => {
                self.bump();
                Ok(Expr::EulerGamma)
            }
            ENotation(f) => {
                self.bump();
                Ok(Expr::Float(f))
            }
            Num(s) => {
                self.bump();
                let e = parse_number(&s);
                self.maybe_subexpr()?;
                Ok(e)
            }
            _ => Err(()),
        }
    }

    /// A symbol with optional subscript/superscript: `x`, `a_{37}`, `\alpha^2`, `\text{Evelyn}`.
    fn atom_expr(&mut self) -> P<Expr> {
        let head = self.bump().ok_or(())?;
        let name = match &head {
            Tok::Letter(c) if *c != 'e' && *c != 'E' => c.to_string(),
            Tok::Greek(g) => g.clone(),
            Tok::Other(o) => o.clone(),
            Tok::Accent(cmd, text) => accent_name(cmd, text),
            _ => return Err(()),
        };
        let mut subscript = String::new();
        let mut sup = None;
        for _ in 0..2 {
            if subscript.is_empty() && self.peek() == Some(&Tok::Underscore) {
                self.bump();
                let from = self.pos;
                if self.eat(&Tok::LBrace) {
                    let inner_from = self.pos;
                    let _ = self.expr()?;
                    while self.eat(&Tok::Comma) {
                        let _ = self.expr()?;
                    }
                    let inner = self.text(inner_from, self.pos);
                    self.expect(&Tok::RBrace)?;
                    subscript = inner;
                } else {
                    let _ = self.atom()?;
                    subscript = self.text(from, self.pos);
                }
                if subscript.is_empty() {
                    return Err(());
                }
            } else if sup.is_none() && self.peek() == Some(&Tok::Caret) && !self.is_degree() {
                self.bump();
                sup = Some(self.sup_body()?);
            }
        }
        if head == Tok::Letter('I') {
            return Ok(Expr::I);
        }
        let mut full = name;
        if !subscript.is_empty() {
            if subscript.chars().count() > 1 {
                full = format!("{full}_{{{subscript}}}");
            } else {
                full = format!("{full}_{subscript}");
            }
        }
        // `\text{\beta}` is the symbol beta (a leading backslash is dropped).
        if let Some(stripped) = full.strip_prefix('\\') {
            full = stripped.to_string();
        }
        let sym = match full.as_str() {
            "pi" | "Pi" => Expr::Pi,
            "gamma" | "Gamma" => Expr::EulerGamma,
            _ => {
                let lower = full.to_lowercase();
                if lower == "pi" {
                    Expr::Pi
                } else {
                    Expr::Sym(lower)
                }
            }
        };
        Ok(match sup {
            Some(p) => Expr::pow(sym, p),
            None => sym,
        })
    }

    /// Optional `_sub` and `^sup`, either order.
    fn sub_sup(&mut self) -> P<(Option<Expr>, Option<Expr>)> {
        let (mut sub, mut sup) = (None, None);
        for _ in 0..2 {
            if sub.is_none() && self.eat(&Tok::Underscore) {
                sub = Some(self.sup_body()?);
            } else if sup.is_none() && self.peek() == Some(&Tok::Caret) && !self.is_degree() {
                self.bump();
                sup = Some(self.sup_body()?);
            }
        }
        Ok((sub, sup))
    }

    /// The argument of a one-argument function: `(expr)` or a bare factor (`\sin 2x`).
    fn func_arg(&mut self) -> P<Expr> {
        if self.eat(&Tok::LParen) {
            let e = self.expr()?;
            self.expect(&Tok::RParen)?;
            return Ok(e);
        }
        let mut negate = false;
        loop {
            if self.eat(&Tok::Minus) {
                negate = !negate;
            } else if !self.eat(&Tok::Plus) {
                break;
            }
        }
        let e = self.postfix_list(true)?;
        Ok(if negate { Expr::negated(e) } else { e })
    }

    fn func(&mut self, name: &'static str) -> P<Expr> {
        self.bump();
        let (sub, mut sup) = self.sub_sup()?;
        let arg = self.func_arg()?;
        let inverse = matches!(&sup, Some(Expr::Rat(-1, 1)));
        let f = match name {
            "sin" | "cos" | "tan" | "csc" | "sec" | "cot" | "sinh" | "cosh" | "tanh" if inverse => {
                sup = None;
                match name {
                    "sin" => Func::Asin,
                    "cos" => Func::Acos,
                    "tan" => Func::Atan,
                    "csc" => Func::Acsc,
                    "sec" => Func::Asec,
                    "cot" => Func::Acot,
                    "sinh" => Func::Asinh,
                    "cosh" => Func::Acosh,
                    _ => Func::Atanh,
                }
            }
            "sin" => Func::Sin,
            "cos" => Func::Cos,
            "tan" => Func::Tan,
            "csc" => Func::Csc,
            "sec" => Func::Sec,
            "cot" => Func::Cot,
            "arcsin" => Func::Asin,
            "arccos" => Func::Acos,
            "arctan" => Func::Atan,
            "arccsc" => Func::Acsc,
            "arcsec" => Func::Asec,
            "arccot" => Func::Acot,
            "sinh" => Func::Sinh,
            "cosh" => Func::Cosh,
            "tanh" => Func::Tanh,
            "arsinh" | "arcsinh" => Func::Asinh,
            "arcosh" | "arccosh" => Func::Acosh,
            "artanh" | "arctanh" => Func::Atanh,
            "exp" => Func::Exp,
            "floor" => Func::Floor,
            "ceil" => Func::Ceil,
            "log" | "ln" => {
                let base = match sub {
                    Some(b) => b,
                    None if name == "log" => Expr::int(10),
                    None => Expr::E,
                };
                let e = Expr::call(Func::Log, vec![arg, base]);
                return Ok(match sup {
                    Some(p) => Expr::pow(e, p),
                    None => e,
                });
            }
            _ => return Err(()),
        };
        let e = Expr::call(f, vec![arg]);
        Ok(match sup {
            Some(p) => Expr::pow(e, p),
            None => e,
        })
    }

    fn multi_func(&mut self, name: &'static str) -> P<Expr> {
        self.bump();
        let (_, sup) = self.sub_sup()?;
        let args = if self.eat(&Tok::LParen) {
            let mut args = vec![self.expr()?];
            while self.eat(&Tok::Comma) {
                args.push(self.expr()?);
            }
            self.expect(&Tok::RParen)?;
            args
        } else {
            vec![self.func_arg()?]
        };
        let f = match name {
            "gcd" => Func::Gcd,
            "lcm" => Func::Lcm,
            "max" => Func::Max,
            _ => Func::Min,
        };
        let e = Expr::call(f, args);
        Ok(match sup {
            Some(p) => Expr::pow(e, p),
            None => e,
        })
    }

    fn operatorname(&mut self, name: &str) -> P<Expr> {
        let f = match name {
            "arsinh" | "arcsinh" => Func::Asinh,
            "arcosh" | "arccosh" => Func::Acosh,
            "artanh" | "arctanh" => Func::Atanh,
            "floor" => Func::Floor,
            "ceil" => Func::Ceil,
            "gcd" => Func::Gcd,
            "lcm" => Func::Lcm,
            _ => return Err(()),
        };
        self.bump();
        let (_, sup) = self.sub_sup()?;
        let args = if self.eat(&Tok::LParen) {
            let mut args = vec![self.expr()?];
            while self.eat(&Tok::Comma) {
                args.push(self.expr()?);
            }
            self.expect(&Tok::RParen)?;
            args
        } else {
            vec![self.func_arg()?]
        };
        let e = Expr::call(f, args);
        Ok(match sup {
            Some(p) => Expr::pow(e, p),
            None => e,
        })
    }

    /// `\sum_{k=a}^{b} body` / `\prod`.
    fn big_op(&mut self, prod: bool) -> P<Expr> {
        self.bump();
        let (mut var, mut lo, mut hi) = (None, None, None);
        for _ in 0..2 {
            if var.is_none() && self.eat(&Tok::Underscore) {
                self.expect(&Tok::LBrace)?;
                let v = self.expr()?;
                if !self.eat(&Tok::Rel(RelOp::Eq)) {
                    return Err(());
                }
                lo = Some(self.expr()?);
                self.expect(&Tok::RBrace)?;
                var = Some(v);
            } else if hi.is_none() && self.eat(&Tok::Caret) {
                hi = Some(self.sup_body()?);
            }
        }
        let (Some(Expr::Sym(var)), Some(lo), Some(hi)) = (var, lo, hi) else {
            return Err(());
        };
        let body = self.mp()?;
        Ok(Expr::Big {
            prod,
            body: Box::new(body),
            var,
            lo: Box::new(lo),
            hi: Box::new(hi),
        })
    }

    fn matrix(&mut self, env: &str) -> P<Expr> {
        if !matches!(env, "matrix" | "pmatrix" | "bmatrix" | "array") {
            return Err(());
        }
        self.bump();
        let mut rows = vec![];
        loop {
            if matches!(self.peek(), Some(Tok::End(e)) if e == env) {
                self.bump();
                break;
            }
            let mut row = vec![self.expr()?];
            while self.eat(&Tok::Amp) {
                row.push(self.expr()?);
            }
            rows.push(row);
            if !self.eat(&Tok::RowSep) {
                match self.bump() {
                    Some(Tok::End(e)) if e == env => break,
                    _ => return Err(()),
                }
            }
        }
        if rows.is_empty() {
            return Err(());
        }
        Ok(Expr::Matrix(rows))
    }
}

/// The symbol name an accent command produces: `\text{(C)}` is `c`, `\overline{AB}` is `bar{ab}`.
fn accent_name(cmd: &str, text: &str) -> String {
    let mut text: String = text.chars().filter(|c| *c != ' ').collect();
    let kind = match cmd {
        "bar" | "overline" => "bar",
        "vec" | "overrightarrow" => "vec",
        "tilde" | "widetilde" => "tilde",
        c if c.contains("text") || c.contains("mbox") => {
            text = text.chars().filter(|c| *c != '(' && *c != ')').collect();
            ""
        }
        c if c.contains("math") => "math",
        c => c,
    };
    if kind.is_empty() {
        text
    } else {
        format!("{kind}{{{text}}}")
    }
}

/// `^\s*-?\d{1,3}(,\d{3})+(\.\d+)?\s*$`: a number with thousands separators, not a set.
fn is_comma_number(s: &str) -> bool {
    let t = s.trim();
    let t = t.strip_prefix('-').unwrap_or(t);
    let (int, frac) = match t.split_once('.') {
        Some((a, b)) => (a, Some(b)),
        None => (t, None),
    };
    if let Some(f) = frac {
        if f.is_empty() || !f.chars().all(|c| c.is_ascii_digit()) {
            return false;
        }
    }
    let groups: Vec<&str> = int.split(',').collect();
    groups.len() >= 2
        && (1..=3).contains(&groups[0].len())
        && groups.iter().all(|g| g.chars().all(|c| c.is_ascii_digit()))
        && groups[1..].iter().all(|g| g.len() == 3)
}

/// Parse a (normalized) LaTeX answer. `None` when the grammar rejects it.
pub fn parse_latex(latex: &str) -> Option<Value> {
    let src: Vec<char> = latex.chars().collect();
    let toks = lex(&src)?;
    if toks.is_empty() {
        return None;
    }
    let mut p = Parser {
        toks,
        pos: 0,
        src: &src,
        abs_depth: 0,
        depth: 0,
        steps: 0,
    };
    let v = p.math().ok()?;
    // `7,425,000` is a number, not the set {7, 425, 0}.
    if is_comma_number(latex) && !matches!(v, Value::Rel(..)) {
        let digits: String = latex.trim().chars().filter(|c| *c != ',').collect();
        return Some(Value::Expr(parse_number(&digits)));
    }
    Some(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(s: &str) -> String {
        parse_latex(s).map(|v| v.canon()).unwrap_or_else(|| "<none>".into())
    }

    #[test]
    fn basics() {
        assert_eq!(canon("\\frac{1}{3}"), "1/3");
        assert_eq!(canon("2 \\frac{1}{2}"), "5/2");
        assert_eq!(canon("7,425,000"), "7425000");
        assert_eq!(canon("32, 349"), "{32, 349}");
        assert_eq!(canon("28\\%"), "28");
        assert_eq!(canon("x \\in [-2,7]"), "x = [-2, 7]");
        assert_eq!(canon("(3,1)"), "Tuple(3, 1)");
        assert_eq!(canon("(1,3)"), "(1, 3)");
        assert_eq!(canon("\\text{Evelyn}"), "evelyn");
        assert_eq!(canon("12:00"), "zoo");
        assert_eq!(canon("1 = \\zzz = 0"), "<none>");
        assert_eq!(canon("f(x) = 1"), "f(x) = 1");
    }
}
