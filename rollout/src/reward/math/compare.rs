//! Is the prediction the gold answer? The decision procedure of math-verify's `verify`, on
//! [`Value`]s:
//! - assignments are read through: `x = 5` matches `5`, `k = 1/3` matches `\frac13`, and a chain
//!   `x = 5+5+1 = 11` keeps its first left side and last right side;
//! - relations match when `lhs - rhs` agree (or are proportional, as `2x+4y-3=0` and
//!   `y = -x/2 + 3/4`), also read flipped (`x <= 5` is `5 >= x`);
//! - a relation in one variable matches the set it describes (`1 <= |z| <= 3/2` is
//!   `[-3/2, -1] \cup [1, 3/2]`);
//! - finite sets match in any order, tuples in order, an open interval `(a, b)` matches the pair;
//! - a symbol matches its spelled-out product (`\text{odd}` is `odd`);
//! - numbers: a decimal matches when both round to the same 6 decimals, otherwise values must be
//!   equal; expressions with symbols must agree at several random points.

use super::expr::{agree_everywhere, close, constant_value, exact_value, Expr, C};
use super::extract::Extracted;
use super::value::{NamedSet, RelOp, Value};

/// Any pair (gold candidate, predicted candidate) that matches.
pub fn verify(gold: &[Extracted], pred: &[Extracted]) -> bool {
    gold.iter().any(|g| {
        pred.iter().any(|p| match (g, p) {
            (Extracted::Value(a), Extracted::Value(b)) => value_eq(a, b),
            (Extracted::Str(a), Extracted::Str(b)) => {
                let (a, b) = (a.trim(), b.trim());
                !a.is_empty() && a == b
            }
            _ => false,
        })
    })
}

fn rel(op: RelOp, l: Value, r: Value) -> Value {
    Value::Rel(op, Box::new(l), Box::new(r))
}

/// math-verify's `sympy_expr_eq` (strict mode, no set-relation leniency for the gold side).
pub fn value_eq(gold: &Value, pred: &Value) -> bool {
    // Complex infinity as the gold answer compares to nothing (upstream raises).
    if matches!(gold, Value::Expr(Expr::Zoo)) {
        return false;
    }
    let mut gold = gold.clone();
    let mut pred = pred.clone();
    let gold_assign = gold.is_assignment();
    let pred_assign = pred.is_assignment();
    let gold_eq = gold.is_equation();
    let pred_eq = pred.is_equation();
    if gold_assign {
        gold = truncate_chain(&gold);
    }
    if pred_assign {
        pred = truncate_chain(&pred);
    }
    if pred_eq && !gold_eq {
        if let Some(r) = pred.last_relation().rhs() {
            pred = r.clone();
        }
    } else if gold_assign && !pred_eq {
        if let Some(r) = gold.last_relation().rhs() {
            gold = r.clone();
        }
    }

    if gold.is_relation() && pred.is_set() {
        if let Some(same) = relation_matches_set(&gold, &pred) {
            return same;
        }
    }

    if gold.canon() == pred.canon() {
        return true;
    }
    if gold.is_relation() && pred.is_relation() {
        return relations_eq(&gold, &pred);
    }
    if gold.is_relation() || pred.is_relation() {
        return false;
    }
    if gold.is_set() || pred.is_set() || matches!(gold, Value::Tuple(_)) || matches!(pred, Value::Tuple(_)) {
        return sets_eq(&gold, &pred);
    }
    match (&gold, &pred) {
        (Value::Expr(g), Value::Expr(p)) => {
            if matches!(g, Expr::Sym(_)) || matches!(p, Expr::Sym(_)) {
                return symbols_eq(g, p);
            }
            numeric_eq(g, p) || symbolic_eq(g, p)
        }
        _ => false,
    }
}

/// `a = b = c` (an assignment chain) becomes `a = c`.
fn truncate_chain(v: &Value) -> Value {
    let first = v.first_relation().lhs().cloned();
    let last = v.last_relation().rhs().cloned();
    match (first, last) {
        (Some(l), Some(r)) => rel(RelOp::Eq, l, r),
        _ => v.clone(),
    }
}

fn expr_of(v: &Value) -> Option<&Expr> {
    v.as_expr()
}

fn relations_eq(gold: &Value, pred: &Value) -> bool {
    match (gold, pred) {
        (Value::And(g), Value::And(p)) => g.len() == p.len() && g.iter().zip(p).all(|(a, b)| relations_eq(a, b)),
        (Value::Rel(gop, gl, gr), Value::Rel(pop, pl, pr)) => {
            let (Some(gl), Some(gr), Some(pl), Some(pr)) = (expr_of(gl), expr_of(gr), expr_of(pl), expr_of(pr)) else {
                return false;
            };
            let gd = Expr::minus(gl.clone(), gr.clone());
            if gop == pop
                && value_eq(
                    &Value::Expr(gd.clone()),
                    &Value::Expr(Expr::minus(pl.clone(), pr.clone())),
                )
            {
                return true;
            }
            if *gop == RelOp::Ne || *pop == RelOp::Ne {
                return false;
            }
            if gop.flipped() == *pop
                && value_eq(
                    &Value::Expr(gd.clone()),
                    &Value::Expr(Expr::minus(pr.clone(), pl.clone())),
                )
            {
                return true;
            }
            // Same solution set: `lhs - rhs` proportional (positive factor for the same
            // inequality, negative for the flipped one, any for equations).
            let pd = Expr::minus(pl.clone(), pr.clone());
            match proportional(&gd, &pd) {
                Some(k) => match gop {
                    RelOp::Eq => *pop == RelOp::Eq,
                    _ => (*pop == *gop && k > 0.0) || (*pop == gop.flipped() && k < 0.0),
                },
                None => false,
            }
        }
        _ => false,
    }
}

/// The constant real ratio `a / b`, when there is one and `a` depends on something.
fn proportional(a: &Expr, b: &Expr) -> Option<f64> {
    if !a.has_symbols() || !b.has_symbols() {
        return None;
    }
    let mut ratio: Option<f64> = None;
    for t in 0..super::expr::TRIALS {
        let env = super::expr::Env::trial(t);
        let (x, y) = (a.eval(&env)?, b.eval(&env)?);
        if !x.is_finite() || !y.is_finite() || y.abs() < 1e-12 {
            continue;
        }
        let r = div(x, y);
        if r.im.abs() > 1e-9 * r.re.abs().max(1.0) || r.re.abs() < 1e-12 {
            return None;
        }
        match ratio {
            None => ratio = Some(r.re),
            Some(k) if (k - r.re).abs() <= 1e-9 * k.abs().max(1.0) => {}
            Some(_) => return None,
        }
    }
    ratio
}

fn div(a: C, b: C) -> C {
    let d = b.re * b.re + b.im * b.im;
    C::new((a.re * b.re + a.im * b.im) / d, (a.im * b.re - a.re * b.im) / d)
}

// ---- relation vs set ----------------------------------------------------------------------

/// The single quantity a relation constrains: one symbol, or one function application such as
/// `f(x)` (math-verify unwraps it into a symbol).
fn relation_variable(v: &Value) -> Option<Expr> {
    let mut vars: Vec<Expr> = Vec::new();
    fn walk(e: &Expr, vars: &mut Vec<Expr>) {
        match e {
            Expr::Sym(_) | Expr::Apply(..) if !vars.contains(e) => vars.push(e.clone()),
            Expr::Add(v) | Expr::Mul(v) | Expr::Call(_, v) => v.iter().for_each(|x| walk(x, vars)),
            Expr::Pow(a, b) => {
                walk(a, vars);
                walk(b, vars);
            }
            _ => {}
        }
    }
    let rels: Vec<&Value> = match v {
        Value::And(r) => r.iter().collect(),
        r => vec![r],
    };
    for r in rels {
        let Value::Rel(_, l, rr) = r else { return None };
        walk(expr_of(l)?, &mut vars);
        walk(expr_of(rr)?, &mut vars);
    }
    (vars.len() == 1).then(|| vars.pop().expect("one"))
}

fn substitute(e: &Expr, var: &Expr, x: f64) -> Expr {
    if e == var {
        return Expr::Float(x);
    }
    match e {
        Expr::Add(v) => Expr::Add(v.iter().map(|a| substitute(a, var, x)).collect()),
        Expr::Mul(v) => Expr::Mul(v.iter().map(|a| substitute(a, var, x)).collect()),
        Expr::Call(f, v) => Expr::Call(*f, v.iter().map(|a| substitute(a, var, x)).collect()),
        Expr::Pow(a, b) => Expr::pow(substitute(a, var, x), substitute(b, var, x)),
        e => e.clone(),
    }
}

fn relation_holds(v: &Value, var: &Expr, x: f64) -> Option<bool> {
    let rels: Vec<&Value> = match v {
        Value::And(r) => r.iter().collect(),
        r => vec![r],
    };
    let mut all = true;
    for r in rels {
        let Value::Rel(op, l, rr) = r else { return None };
        let lv = constant_value(&substitute(expr_of(l)?, var, x))?;
        let rv = constant_value(&substitute(expr_of(rr)?, var, x))?;
        if lv.im.abs() > 1e-9 || rv.im.abs() > 1e-9 {
            return None;
        }
        let holds = match op {
            RelOp::Eq => (lv.re - rv.re).abs() <= 1e-9 * lv.re.abs().max(1.0),
            RelOp::Ne => (lv.re - rv.re).abs() > 1e-9 * lv.re.abs().max(1.0),
            op => op.holds(lv.re, rv.re),
        };
        all &= holds;
    }
    Some(all)
}

fn real_const(e: &Expr) -> Option<f64> {
    match e {
        Expr::Inf => return Some(f64::INFINITY),
        Expr::Mul(v) if v.len() == 2 && v[0] == Expr::int(-1) && v[1] == Expr::Inf => return Some(f64::NEG_INFINITY),
        _ => {}
    }
    let v = constant_value(e)?;
    (v.im.abs() < 1e-12).then_some(v.re)
}

/// Membership of `x` in a set with constant bounds.
fn set_contains(s: &Value, x: f64) -> Option<bool> {
    Some(match s {
        Value::Interval {
            lo,
            hi,
            lo_open,
            hi_open,
        } => {
            let (a, b) = (real_const(lo)?, real_const(hi)?);
            let above = if *lo_open { x > a } else { x >= a };
            let below = if *hi_open { x < b } else { x <= b };
            above && below
        }
        Value::Union(parts) => {
            let mut any = false;
            for p in parts {
                any |= set_contains(p, x)?;
            }
            any
        }
        Value::Set(items) => {
            let mut any = false;
            for i in items {
                let v = real_const(expr_of(i)?)?;
                any |= (v - x).abs() <= 1e-9 * v.abs().max(1.0);
            }
            any
        }
        Value::Named(NamedSet::Reals) => true,
        Value::Named(NamedSet::Empty) => false,
        _ => return None,
    })
}

fn set_bounds(s: &Value, out: &mut Vec<f64>) -> Option<()> {
    match s {
        Value::Interval { lo, hi, .. } => {
            out.push(real_const(lo)?);
            out.push(real_const(hi)?);
        }
        Value::Union(parts) => {
            for p in parts {
                set_bounds(p, out)?;
            }
        }
        Value::Set(items) => {
            for i in items {
                out.push(real_const(expr_of(i)?)?);
            }
        }
        Value::Named(NamedSet::Reals | NamedSet::Empty) => {}
        _ => return None,
    }
    Some(())
}

fn relation_constants(v: &Value, out: &mut Vec<f64>) {
    fn walk(e: &Expr, out: &mut Vec<f64>) {
        match e {
            Expr::Rat(..) | Expr::Float(_) => {
                if let Some(c) = real_const(e) {
                    out.push(c);
                    out.push(-c);
                }
            }
            Expr::Add(v) | Expr::Mul(v) | Expr::Call(_, v) => v.iter().for_each(|x| walk(x, out)),
            Expr::Pow(a, b) => {
                walk(a, out);
                walk(b, out);
            }
            _ => {}
        }
    }
    match v {
        Value::And(r) => r.iter().for_each(|x| relation_constants(x, out)),
        Value::Rel(_, l, r) => {
            if let Some(e) = expr_of(l) {
                walk(e, out);
            }
            if let Some(e) = expr_of(r) {
                walk(e, out);
            }
        }
        _ => {}
    }
}

/// Does the one-variable relation describe exactly this set? `None` when it cannot be decided
/// (several variables, symbolic bounds), which upstream also treats as "not comparable".
fn relation_matches_set(relation: &Value, set: &Value) -> Option<bool> {
    let var = relation_variable(relation)?;
    let mut pts = Vec::new();
    set_bounds(set, &mut pts)?;
    relation_constants(relation, &mut pts);
    let mut finite: Vec<f64> = pts.into_iter().filter(|p| p.is_finite()).collect();
    finite.extend([-1000.0, -3.7, -0.5, 0.0, 0.5, 2.3, 1000.0]);
    finite.sort_by(|a, b| a.partial_cmp(b).expect("finite"));
    finite.dedup();
    let mut tests = Vec::new();
    for (i, &p) in finite.iter().enumerate() {
        let d = 1e-6 * p.abs().max(1.0);
        tests.extend([p, p - d, p + d]);
        if let Some(&q) = finite.get(i + 1) {
            tests.push((p + q) / 2.0);
        }
    }
    if let (Some(&lo), Some(&hi)) = (finite.first(), finite.last()) {
        tests.extend([lo - 1.0, hi + 1.0, lo - 1e4, hi + 1e4]);
    }
    for x in tests {
        let (Some(a), Some(b)) = (relation_holds(relation, &var, x), set_contains(set, x)) else {
            continue;
        };
        if a != b {
            return Some(false);
        }
    }
    Some(true)
}

// ---- sets ---------------------------------------------------------------------------------

fn sets_eq(gold: &Value, pred: &Value) -> bool {
    let wrap = |v: &Value| {
        if v.is_set() || matches!(v, Value::Tuple(_)) {
            v.clone()
        } else {
            Value::Set(vec![v.clone()])
        }
    };
    let (a, b) = (wrap(gold), wrap(pred));
    if let (
        Value::Interval {
            lo: al,
            hi: ah,
            lo_open: alo,
            hi_open: aho,
        },
        Value::Interval {
            lo: bl,
            hi: bh,
            lo_open: blo,
            hi_open: bho,
        },
    ) = (&a, &b)
    {
        return alo == blo
            && aho == bho
            && value_eq(&Value::Expr(al.clone()), &Value::Expr(bl.clone()))
            && value_eq(&Value::Expr(ah.clone()), &Value::Expr(bh.clone()));
    }
    if a.canon() == b.canon() {
        return true;
    }
    if a.is_set() && b.is_set() && same_points(&a, &b) {
        return true;
    }
    if let Value::Union(ua) = &a {
        if let Value::Union(ub) = &b {
            if matching(ua, ub) {
                return true;
            }
        }
    }
    let finite = |v: &Value| matches!(v, Value::Set(_) | Value::Tuple(_));
    if finite(&a) && finite(&b) {
        return deep_compare(&a, &b);
    }
    let pair = |lo: &Expr, hi: &Expr| Value::Tuple(vec![Value::Expr(lo.clone()), Value::Expr(hi.clone())]);
    if let Value::Interval {
        lo,
        hi,
        lo_open: true,
        hi_open: true,
    } = &a
    {
        if finite(&b) && items(&b).len() == 2 {
            return deep_compare(&pair(lo, hi), &b);
        }
    }
    if let Value::Interval {
        lo,
        hi,
        lo_open: true,
        hi_open: true,
    } = &b
    {
        if finite(&a) && items(&a).len() == 2 {
            return deep_compare(&a, &pair(lo, hi));
        }
    }
    false
}

fn items(v: &Value) -> &[Value] {
    match v {
        Value::Set(x) | Value::Tuple(x) => x,
        _ => &[],
    }
}

/// Two sets with constant bounds that contain the same points (sympy's empty symmetric
/// difference).
fn same_points(a: &Value, b: &Value) -> bool {
    let mut pts = Vec::new();
    if set_bounds(a, &mut pts).is_none() || set_bounds(b, &mut pts).is_none() {
        return false;
    }
    let mut finite: Vec<f64> = pts.into_iter().filter(|p| p.is_finite()).collect();
    if finite.is_empty() {
        finite.push(0.0);
    }
    finite.sort_by(|x, y| x.partial_cmp(y).expect("finite"));
    finite.dedup();
    let mut tests = Vec::new();
    for (i, &p) in finite.iter().enumerate() {
        let d = 1e-6 * p.abs().max(1.0);
        tests.extend([p, p - d, p + d]);
        if let Some(&q) = finite.get(i + 1) {
            tests.push((p + q) / 2.0);
        }
    }
    tests.extend([finite[0] - 1e4, finite[finite.len() - 1] + 1e4]);
    tests
        .into_iter()
        .all(|x| set_contains(a, x).is_some() && set_contains(a, x) == set_contains(b, x))
}

/// Element-wise comparison of finite sets / tuples: sets in any order, tuples in order (a tuple
/// against a set uses the set's written order).
fn deep_compare(gold: &Value, pred: &Value) -> bool {
    let (g, p) = (items(gold), items(pred));
    if g.len() != p.len() {
        return false;
    }
    match gold {
        Value::Set(_) => matching(g, p),
        _ => g.iter().zip(p).all(|(a, b)| value_eq(a, b)),
    }
}

/// Largest set compared element against element (quadratic work); bigger ones are compared
/// in sorted order only.
const MAX_MATCHING: usize = 64;

/// A sort key for set elements: numeric value when there is one, else the canonical text.
fn element_key(v: &Value) -> (u8, f64, String) {
    match v.as_expr().and_then(constant_value) {
        Some(c) if c.im.abs() < 1e-12 && c.re.is_finite() => (0, c.re, String::new()),
        _ => (1, 0.0, v.canon()),
    }
}

/// A perfect matching between `g` and `p` under `value_eq` (any order).
fn matching(g: &[Value], p: &[Value]) -> bool {
    if g.len() != p.len() {
        return false;
    }
    let n = g.len();
    // Cheap first: both sorted, element by element.
    let sorted = |v: &[Value]| {
        let mut k: Vec<(u8, f64, String, usize)> = v
            .iter()
            .enumerate()
            .map(|(i, x)| {
                let (a, b, c) = element_key(x);
                (a, b, c, i)
            })
            .collect();
        k.sort_by(|x, y| x.0.cmp(&y.0).then(x.1.total_cmp(&y.1)).then(x.2.cmp(&y.2)));
        k.into_iter().map(|x| x.3).collect::<Vec<_>>()
    };
    let (gs, ps) = (sorted(g), sorted(p));
    if gs.iter().zip(&ps).all(|(&i, &j)| value_eq(&g[i], &p[j])) {
        return true;
    }
    if n > MAX_MATCHING {
        return false;
    }
    let eq: Vec<Vec<bool>> = g.iter().map(|a| p.iter().map(|b| value_eq(a, b)).collect()).collect();
    let mut owner: Vec<Option<usize>> = vec![None; n];
    fn augment(i: usize, eq: &[Vec<bool>], seen: &mut [bool], owner: &mut [Option<usize>]) -> bool {
        for j in 0..eq[i].len() {
            if eq[i][j] && !seen[j] {
                seen[j] = true;
                if owner[j].is_none_or(|k| augment(k, eq, seen, owner)) {
                    owner[j] = Some(i);
                    return true;
                }
            }
        }
        false
    }
    (0..n).all(|i| augment(i, &eq, &mut vec![false; n], &mut owner))
}

// ---- symbols and numbers ------------------------------------------------------------------

/// A product of single symbols spelled out (`o*d*d` is "odd"); `E` counts as "e".
fn spelled(e: &Expr) -> Option<String> {
    match e {
        Expr::Mul(v) => v
            .iter()
            .map(|x| match x {
                Expr::Sym(s) => Some(s.clone()),
                Expr::E => Some("e".into()),
                _ => None,
            })
            .collect(),
        _ => None,
    }
}

fn symbols_eq(gold: &Expr, pred: &Expr) -> bool {
    match (gold, pred) {
        (Expr::Sym(s), Expr::E) | (Expr::E, Expr::Sym(s)) if s.to_lowercase() == "e" => true,
        (Expr::Sym(s), other) | (other, Expr::Sym(s)) if spelled(other).is_some() => {
            spelled(other).expect("checked").to_lowercase() == s.to_lowercase()
        }
        (Expr::Sym(a), Expr::Sym(b)) => {
            let norm = |s: &str| {
                if s.chars().count() > 1 {
                    s.to_lowercase()
                } else {
                    s.to_string()
                }
            };
            norm(a) == norm(b)
        }
        _ => gold.canon() == pred.canon(),
    }
}

fn round6(x: f64) -> f64 {
    (x * 1e6).round()
}

/// math-verify's `sympy_numeric_eq`: decimals compare at 6 decimal places, exact numbers exactly.
fn numeric_eq(gold: &Expr, pred: &Expr) -> bool {
    if let (Expr::Matrix(a), Expr::Matrix(b)) = (gold, pred) {
        return a.len() == b.len()
            && a.iter().zip(b).all(|(r, s)| {
                r.len() == s.len() && r.iter().zip(s).all(|(x, y)| numeric_eq(x, y) || symbolic_eq(x, y))
            });
    }
    if gold.is_matrix() || pred.is_matrix() {
        return false;
    }
    if let (Some(a), Some(b)) = (exact_value(gold), exact_value(pred)) {
        if !(matches!(gold, Expr::Float(_)) || matches!(pred, Expr::Float(_))) {
            return a == b;
        }
    }
    let (gv, pv) = (constant_value(gold), constant_value(pred));
    if gold.is_number() || pred.is_number() {
        let (Some(a), Some(b)) = (gv, pv) else { return false };
        if matches!(gold, Expr::Float(_)) || matches!(pred, Expr::Float(_)) {
            return a.im.abs() < 1e-12 && b.im.abs() < 1e-12 && round6(a.re) == round6(b.re);
        }
        return a.is_finite() && b.is_finite() && close(a, b, 1e-12);
    }
    match (gv, pv) {
        (Some(a), Some(b)) => a.is_finite() && b.is_finite() && close(a, b, 1e-12),
        _ => false,
    }
}

/// `simplify(gold - pred) == 0`, decided by evaluation at random points.
fn symbolic_eq(gold: &Expr, pred: &Expr) -> bool {
    if gold.is_matrix() || pred.is_matrix() {
        return false;
    }
    if let (Some(a), Some(b)) = (exact_value(gold), exact_value(pred)) {
        return a == b;
    }
    agree_everywhere(gold, pred)
}
