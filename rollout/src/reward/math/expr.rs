//! Scalar expressions: the tree the LaTeX parser builds, exact-enough constructors, a canonical
//! printer (for structural equality) and numeric evaluation in complex arithmetic.
//!
//! Decisions:
//! - No computer algebra. Two expressions are "symbolically equal" when they agree at several
//!   pseudo-random points (every free symbol gets a value derived from its name and the trial),
//!   which is what `simplify(a - b) == 0` decides for the answers graders see.
//! - Evaluation is complex (principal branches), so `sqrt` of a negative sample or `log` of a
//!   negative number does not abort a comparison; both sides go through the same branches.
//! - Integer literals stay exact rationals (`Rat`) so that "is this a plain number" and
//!   "is this a decimal" (`Float`) can steer the comparison like math-verify does.

use std::f64::consts::{E as EULER, PI};

/// A complex number, just enough for evaluation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct C {
    pub re: f64,
    pub im: f64,
}

impl C {
    pub const fn new(re: f64, im: f64) -> C {
        C { re, im }
    }
    pub const fn real(re: f64) -> C {
        C { re, im: 0.0 }
    }
    pub fn is_finite(self) -> bool {
        self.re.is_finite() && self.im.is_finite()
    }
    pub fn abs(self) -> f64 {
        self.re.hypot(self.im)
    }
    fn add(self, o: C) -> C {
        C::new(self.re + o.re, self.im + o.im)
    }
    fn sub(self, o: C) -> C {
        C::new(self.re - o.re, self.im - o.im)
    }
    fn mul(self, o: C) -> C {
        C::new(self.re * o.re - self.im * o.im, self.re * o.im + self.im * o.re)
    }
    fn div(self, o: C) -> C {
        let d = o.re * o.re + o.im * o.im;
        if d == 0.0 {
            return C::new(f64::NAN, f64::NAN);
        }
        C::new(
            (self.re * o.re + self.im * o.im) / d,
            (self.im * o.re - self.re * o.im) / d,
        )
    }
    fn neg(self) -> C {
        C::new(-self.re, -self.im)
    }
    fn exp(self) -> C {
        let m = self.re.exp();
        C::new(m * self.im.cos(), m * self.im.sin())
    }
    fn ln(self) -> C {
        C::new(self.abs().ln(), self.im.atan2(self.re))
    }
    fn sqrt(self) -> C {
        if self.im == 0.0 && self.re >= 0.0 {
            return C::real(self.re.sqrt());
        }
        let r = self.abs();
        let re = ((r + self.re) / 2.0).sqrt();
        let im = ((r - self.re) / 2.0).sqrt();
        C::new(re, if self.im < 0.0 { -im } else { im })
    }
    fn powi(self, n: i64) -> C {
        let mut base = if n < 0 { C::real(1.0).div(self) } else { self };
        let mut e = n.unsigned_abs();
        let mut acc = C::real(1.0);
        while e > 0 {
            if e & 1 == 1 {
                acc = acc.mul(base);
            }
            base = base.mul(base);
            e >>= 1;
        }
        acc
    }
    fn pow(self, e: C) -> C {
        if e.im == 0.0 && e.re.fract() == 0.0 && e.re.abs() < 1e6 {
            return self.powi(e.re as i64);
        }
        if self.re == 0.0 && self.im == 0.0 {
            return if e.re > 0.0 {
                C::real(0.0)
            } else {
                C::new(f64::NAN, f64::NAN)
            };
        }
        if self.im == 0.0 && self.re > 0.0 && e.im == 0.0 {
            return C::real(self.re.powf(e.re));
        }
        e.mul(self.ln()).exp()
    }
    fn sin(self) -> C {
        C::new(self.re.sin() * self.im.cosh(), self.re.cos() * self.im.sinh())
    }
    fn cos(self) -> C {
        C::new(self.re.cos() * self.im.cosh(), -self.re.sin() * self.im.sinh())
    }
    fn sinh(self) -> C {
        C::new(self.re.sinh() * self.im.cos(), self.re.cosh() * self.im.sin())
    }
    fn cosh(self) -> C {
        C::new(self.re.cosh() * self.im.cos(), self.re.sinh() * self.im.sin())
    }
    const I: C = C::new(0.0, 1.0);
    const ONE: C = C::new(1.0, 0.0);
    fn asin(self) -> C {
        // -i ln(iz + sqrt(1 - z^2))
        let w = C::I.mul(self).add(C::ONE.sub(self.mul(self)).sqrt());
        C::I.neg().mul(w.ln())
    }
    fn acos(self) -> C {
        C::real(PI / 2.0).sub(self.asin())
    }
    fn atan(self) -> C {
        // i/2 (ln(1 - iz) - ln(1 + iz))
        let iz = C::I.mul(self);
        C::new(0.0, 0.5).mul(C::ONE.sub(iz).ln().sub(C::ONE.add(iz).ln()))
    }
    fn asinh(self) -> C {
        self.add(self.mul(self).add(C::ONE).sqrt()).ln()
    }
    fn acosh(self) -> C {
        self.add(self.add(C::ONE).sqrt().mul(self.sub(C::ONE).sqrt())).ln()
    }
    fn atanh(self) -> C {
        C::real(0.5).mul(C::ONE.add(self).ln().sub(C::ONE.sub(self).ln()))
    }
    fn as_real(self) -> Option<f64> {
        if self.im.abs() <= 1e-12 * self.re.abs().max(1.0) {
            Some(self.re)
        } else {
            None
        }
    }
}

/// Built-in functions the parser knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Func {
    Sin,
    Cos,
    Tan,
    Csc,
    Sec,
    Cot,
    Asin,
    Acos,
    Atan,
    Acsc,
    Asec,
    Acot,
    Sinh,
    Cosh,
    Tanh,
    Asinh,
    Acosh,
    Atanh,
    Exp,
    /// `Log[x, base]`.
    Log,
    Abs,
    Floor,
    Ceil,
    Factorial,
    Binom,
    Gcd,
    Lcm,
    Max,
    Min,
    Mod,
}

impl Func {
    pub fn name(self) -> &'static str {
        use Func::*;
        match self {
            Sin => "sin",
            Cos => "cos",
            Tan => "tan",
            Csc => "csc",
            Sec => "sec",
            Cot => "cot",
            Asin => "asin",
            Acos => "acos",
            Atan => "atan",
            Acsc => "acsc",
            Asec => "asec",
            Acot => "acot",
            Sinh => "sinh",
            Cosh => "cosh",
            Tanh => "tanh",
            Asinh => "asinh",
            Acosh => "acosh",
            Atanh => "atanh",
            Exp => "exp",
            Log => "log",
            Abs => "Abs",
            Floor => "floor",
            Ceil => "ceiling",
            Factorial => "factorial",
            Binom => "binomial",
            Gcd => "gcd",
            Lcm => "lcm",
            Max => "Max",
            Min => "Min",
            Mod => "Mod",
        }
    }
}

/// A scalar expression (or a literal matrix, which only ever appears whole).
#[derive(Clone, Debug, PartialEq)]
pub enum Expr {
    /// Exact rational `p/q`, `q > 0`, reduced.
    Rat(i128, i128),
    /// A decimal literal such as `0.5` or `1000.0`.
    Float(f64),
    Sym(String),
    Pi,
    E,
    I,
    /// `\infty` (with sign through `Mul(-1, Inf)`).
    Inf,
    EulerGamma,
    /// Complex infinity: the value of `12:00` (12/0). Never equal to anything.
    Zoo,
    Add(Vec<Expr>),
    Mul(Vec<Expr>),
    Pow(Box<Expr>, Box<Expr>),
    Call(Func, Vec<Expr>),
    /// An undefined function applied to arguments: `f(x)`.
    Apply(String, Vec<Expr>),
    /// `\sum` (`prod == false`) or `\prod` over `var = lo..=hi`.
    Big {
        prod: bool,
        body: Box<Expr>,
        var: String,
        lo: Box<Expr>,
        hi: Box<Expr>,
    },
    Matrix(Vec<Vec<Expr>>),
}

/// sympy's `str(Float)`: 15 significant digits, trailing zeros kept (`1.25000000000000`), so
/// that the symbol `\text{9}` prints like the integer 9 but `\text{1.25}` not like 1.25.
fn sympy_float_str(x: f64) -> String {
    if x == 0.0 {
        return "0.0".into();
    }
    if !x.is_finite() {
        return format!("{x}");
    }
    let sci = format!("{:.14e}", x.abs());
    let (mant, exp) = sci.split_once('e').expect("scientific format");
    let exp: i32 = exp.parse().expect("exponent");
    let digits: String = mant.chars().filter(|c| c.is_ascii_digit()).collect();
    let sign = if x < 0.0 { "-" } else { "" };
    if -5 < exp && exp < 15 {
        if exp >= 0 {
            let (int, frac) = digits.split_at(exp as usize + 1);
            let frac = if frac.is_empty() { "0" } else { frac };
            format!("{sign}{int}.{frac}")
        } else {
            format!("{sign}0.{}{digits}", "0".repeat((-exp - 1) as usize))
        }
    } else {
        format!(
            "{sign}{}.{}e{}{}",
            &digits[..1],
            &digits[1..],
            if exp < 0 { "-" } else { "+" },
            exp.abs()
        )
    }
}

fn gcd(a: i128, b: i128) -> i128 {
    let (mut a, mut b) = (a.abs(), b.abs());
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

impl Expr {
    pub fn int(n: i128) -> Expr {
        Expr::Rat(n, 1)
    }

    /// `p/q` reduced; `q == 0` gives `Zoo` (sympy's `Rational(p, 0)`).
    pub fn rat(p: i128, q: i128) -> Expr {
        if q == 0 {
            return Expr::Zoo;
        }
        let g = gcd(p, q).max(1);
        let s = if q < 0 { -1 } else { 1 };
        Expr::Rat(s * p / g, s * q / g)
    }

    pub fn is_integer(&self) -> bool {
        matches!(self, Expr::Rat(_, 1))
    }

    pub fn is_number(&self) -> bool {
        matches!(self, Expr::Rat(..) | Expr::Float(_))
    }

    pub fn is_matrix(&self) -> bool {
        matches!(self, Expr::Matrix(_))
    }

    /// Sum with flattening (`latex2sympy`'s `add_flat`); literal matrices add elementwise.
    pub fn plus(a: Expr, b: Expr) -> Expr {
        if let (Expr::Matrix(x), Expr::Matrix(y)) = (&a, &b) {
            if x.len() == y.len() && x.iter().zip(y).all(|(r, s)| r.len() == s.len()) {
                let rows = x
                    .iter()
                    .zip(y)
                    .map(|(r, s)| r.iter().zip(s).map(|(p, q)| Expr::plus(p.clone(), q.clone())).collect())
                    .collect();
                return Expr::Matrix(rows);
            }
        }
        let mut args = Vec::new();
        for e in [a, b] {
            match e {
                Expr::Add(v) => args.extend(v),
                e => args.push(e),
            }
        }
        Expr::Add(args)
    }

    /// Product with flattening; literal matrices multiply as matrices, scalars scale them.
    pub fn times(a: Expr, b: Expr) -> Expr {
        match (&a, &b) {
            (Expr::Matrix(x), Expr::Matrix(y)) => {
                let inner = y.len();
                if x.iter().all(|r| r.len() == inner) && inner > 0 {
                    let cols = y[0].len();
                    let rows = x
                        .iter()
                        .map(|r| {
                            (0..cols)
                                .map(|j| {
                                    let terms: Vec<Expr> = (0..inner)
                                        .map(|k| Expr::times(r[k].clone(), y[k].get(j).cloned().unwrap_or(Expr::Zoo)))
                                        .collect();
                                    Expr::Add(terms)
                                })
                                .collect()
                        })
                        .collect();
                    return Expr::Matrix(rows);
                }
            }
            (Expr::Matrix(x), s) | (s, Expr::Matrix(x)) => {
                let rows = x
                    .iter()
                    .map(|r| r.iter().map(|p| Expr::times(s.clone(), p.clone())).collect())
                    .collect();
                return Expr::Matrix(rows);
            }
            _ => {}
        }
        let mut args = Vec::new();
        for e in [a, b] {
            match e {
                Expr::Mul(v) => args.extend(v),
                e => args.push(e),
            }
        }
        Expr::Mul(args)
    }

    /// Unary minus: numbers negate exactly, anything else becomes `-1 * x`.
    pub fn negated(a: Expr) -> Expr {
        match a {
            Expr::Rat(p, q) => Expr::Rat(-p, q),
            Expr::Float(f) => Expr::Float(-f),
            Expr::Matrix(_) => Expr::times(Expr::int(-1), a),
            e => Expr::times(Expr::int(-1), e),
        }
    }

    pub fn minus(a: Expr, b: Expr) -> Expr {
        Expr::plus(a, Expr::negated(b))
    }

    /// Division: two integers give an exact rational, otherwise `a * b^-1`.
    pub fn over(a: Expr, b: Expr) -> Expr {
        if let (Expr::Rat(p, 1), Expr::Rat(q, 1)) = (&a, &b) {
            return Expr::rat(*p, *q);
        }
        Expr::Mul(vec![a, Expr::Pow(Box::new(b), Box::new(Expr::int(-1)))])
    }

    pub fn pow(a: Expr, b: Expr) -> Expr {
        Expr::Pow(Box::new(a), Box::new(b))
    }

    pub fn call(f: Func, args: Vec<Expr>) -> Expr {
        Expr::Call(f, args)
    }

    /// Free symbol names (undefined function names count, as `f` in `f(x)`).
    pub fn symbols(&self, out: &mut Vec<String>) {
        match self {
            Expr::Sym(s) if !out.contains(s) => out.push(s.clone()),
            Expr::Add(v) | Expr::Mul(v) | Expr::Call(_, v) => v.iter().for_each(|e| e.symbols(out)),
            Expr::Apply(name, v) => {
                let n = format!("{name}()");
                if !out.contains(&n) {
                    out.push(n);
                }
                v.iter().for_each(|e| e.symbols(out))
            }
            Expr::Pow(a, b) => {
                a.symbols(out);
                b.symbols(out);
            }
            Expr::Big { body, var, lo, hi, .. } => {
                let mut inner = Vec::new();
                body.symbols(&mut inner);
                for s in inner {
                    if &s != var && !out.contains(&s) {
                        out.push(s);
                    }
                }
                lo.symbols(out);
                hi.symbols(out);
            }
            Expr::Matrix(rows) => rows.iter().flatten().for_each(|e| e.symbols(out)),
            _ => {}
        }
    }

    pub fn has_symbols(&self) -> bool {
        let mut v = Vec::new();
        self.symbols(&mut v);
        !v.is_empty()
    }

    pub fn contains_zoo(&self) -> bool {
        match self {
            Expr::Zoo => true,
            Expr::Add(v) | Expr::Mul(v) | Expr::Call(_, v) | Expr::Apply(_, v) => v.iter().any(Expr::contains_zoo),
            Expr::Pow(a, b) => a.contains_zoo() || b.contains_zoo(),
            Expr::Big { body, lo, hi, .. } => body.contains_zoo() || lo.contains_zoo() || hi.contains_zoo(),
            Expr::Matrix(rows) => rows.iter().flatten().any(Expr::contains_zoo),
            _ => false,
        }
    }

    /// True for a symbol, a product/power/function of symbols only (`AB`, `A/S`, `|AB|`, `f(x)`):
    /// the left side of an "assignment" such as `|AB| = 1` (math-verify's `is_expr_of_only_symbols`).
    pub fn only_symbols(&self) -> bool {
        match self {
            Expr::Sym(_) => true,
            Expr::Pow(b, e) if **e == Expr::int(-1) => b.only_symbols(),
            Expr::Add(v) | Expr::Mul(v) | Expr::Call(_, v) | Expr::Apply(_, v) => {
                !v.is_empty() && v.iter().all(Expr::only_symbols)
            }
            Expr::Pow(a, b) => a.only_symbols() && b.only_symbols(),
            _ => false,
        }
    }

    /// Canonical text: commutative arguments sorted, so `F_k F_m == F_m F_k` structurally.
    pub fn canon(&self) -> String {
        match self {
            Expr::Rat(p, 1) => p.to_string(),
            Expr::Rat(p, q) => format!("{p}/{q}"),
            Expr::Float(f) => sympy_float_str(*f),
            Expr::Sym(s) => s.clone(),
            Expr::Pi => "pi".into(),
            Expr::E => "E".into(),
            Expr::I => "I".into(),
            Expr::Inf => "oo".into(),
            Expr::EulerGamma => "EulerGamma".into(),
            Expr::Zoo => "zoo".into(),
            Expr::Add(v) => {
                let mut parts: Vec<String> = v.iter().map(Expr::canon).collect();
                parts.sort();
                format!("({})", parts.join(" + "))
            }
            Expr::Mul(v) => {
                let mut parts: Vec<String> = v.iter().map(Expr::canon).collect();
                parts.sort();
                format!("({})", parts.join("*"))
            }
            Expr::Pow(a, b) => format!("({})**({})", a.canon(), b.canon()),
            Expr::Call(f, v) => format!(
                "{}({})",
                f.name(),
                v.iter().map(Expr::canon).collect::<Vec<_>>().join(", ")
            ),
            Expr::Apply(n, v) => format!("{n}({})", v.iter().map(Expr::canon).collect::<Vec<_>>().join(", ")),
            Expr::Big {
                prod,
                body,
                var,
                lo,
                hi,
            } => format!(
                "{}({}, ({var}, {}, {}))",
                if *prod { "Product" } else { "Sum" },
                body.canon(),
                lo.canon(),
                hi.canon()
            ),
            Expr::Matrix(rows) => format!(
                "Matrix([{}])",
                rows.iter()
                    .map(|r| format!("[{}]", r.iter().map(Expr::canon).collect::<Vec<_>>().join(", ")))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }

    /// Evaluate with every free symbol bound by `env`. `None` when the expression has no value
    /// there (unsupported construct, matrix, complex infinity).
    pub fn eval(&self, env: &Env) -> Option<C> {
        Some(match self {
            Expr::Rat(p, q) => C::real(*p as f64 / *q as f64),
            Expr::Float(f) => C::real(*f),
            Expr::Sym(s) => env.value(s),
            Expr::Pi => C::real(PI),
            Expr::E => C::real(EULER),
            Expr::I => C::I,
            Expr::Inf => C::real(f64::INFINITY),
            Expr::EulerGamma => C::real(0.577_215_664_901_532_9),
            Expr::Zoo | Expr::Matrix(_) => return None,
            Expr::Add(v) => {
                let mut acc = C::real(0.0);
                for e in v {
                    acc = acc.add(e.eval(env)?);
                }
                acc
            }
            Expr::Mul(v) => {
                let mut acc = C::real(1.0);
                for e in v {
                    acc = acc.mul(e.eval(env)?);
                }
                acc
            }
            Expr::Pow(a, b) => a.eval(env)?.pow(b.eval(env)?),
            Expr::Call(f, args) => eval_call(*f, args, env)?,
            Expr::Apply(name, args) => {
                // An arbitrary but fixed smooth function per name: f(x) and f(y) differ, f(x) == f(x).
                let mut acc = C::real(env.value(&format!("{name}()")).re);
                for (k, a) in args.iter().enumerate() {
                    let v = a.eval(env)?;
                    let w = C::real(1.0 + 0.37 * (k as f64 + 1.0));
                    acc = acc.add(v.mul(w).sin().mul(C::real(1.3 + k as f64)));
                }
                acc
            }
            Expr::Big {
                prod,
                body,
                var,
                lo,
                hi,
            } => {
                let lo_v = lo.eval(env)?.as_real()?;
                let hi_v = hi.eval(env)?.as_real()?;
                let mut inner = Vec::new();
                body.symbols(&mut inner);
                if lo_v.fract() == 0.0 && hi_v.fract() == 0.0 && hi_v - lo_v < 2_000.0 {
                    let mut acc = C::real(if *prod { 1.0 } else { 0.0 });
                    let mut k = lo_v;
                    while k <= hi_v {
                        let v = body.eval(&env.with(var, C::real(k)))?;
                        acc = if *prod { acc.mul(v) } else { acc.add(v) };
                        k += 1.0;
                    }
                    acc
                } else if !inner.contains(var) {
                    // Bounds are symbolic but the body does not depend on the index.
                    let n = C::real(hi_v - lo_v + 1.0);
                    let v = body.eval(env)?;
                    if *prod {
                        v.pow(n)
                    } else {
                        v.mul(n)
                    }
                } else {
                    return None;
                }
            }
        })
    }
}

fn real_int(c: C) -> Option<i128> {
    let r = c.as_real()?;
    if (r - r.round()).abs() < 1e-9 && r.abs() < 1e30 {
        Some(r.round() as i128)
    } else {
        None
    }
}

/// Lanczos approximation of Gamma for real arguments.
fn gamma(x: f64) -> f64 {
    if x < 0.5 {
        return PI / ((PI * x).sin() * gamma(1.0 - x));
    }
    const G: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    let x = x - 1.0;
    let mut a = G[0];
    let t = x + 7.5;
    for (i, g) in G.iter().enumerate().skip(1) {
        a += g / (x + i as f64);
    }
    (2.0 * PI).sqrt() * t.powf(x + 0.5) * (-t).exp() * a
}

fn eval_call(f: Func, args: &[Expr], env: &Env) -> Option<C> {
    use Func::*;
    let vals: Vec<C> = args.iter().map(|a| a.eval(env)).collect::<Option<_>>()?;
    let x = *vals.first()?;
    let one = C::real(1.0);
    Some(match f {
        Sin => x.sin(),
        Cos => x.cos(),
        Tan => x.sin().div(x.cos()),
        Csc => one.div(x.sin()),
        Sec => one.div(x.cos()),
        Cot => x.cos().div(x.sin()),
        Asin => x.asin(),
        Acos => x.acos(),
        Atan => x.atan(),
        Acsc => one.div(x).asin(),
        Asec => one.div(x).acos(),
        Acot => one.div(x).atan(),
        Sinh => x.sinh(),
        Cosh => x.cosh(),
        Tanh => x.sinh().div(x.cosh()),
        Asinh => x.asinh(),
        Acosh => x.acosh(),
        Atanh => x.atanh(),
        Exp => x.exp(),
        Log => {
            let base = vals.get(1).copied().unwrap_or(C::real(EULER));
            x.ln().div(base.ln())
        }
        Abs => C::real(x.abs()),
        Floor => C::real(x.as_real()?.floor()),
        Ceil => C::real(x.as_real()?.ceil()),
        Factorial => {
            let r = x.as_real()?;
            if r < 0.0 && r.fract() == 0.0 {
                return None;
            }
            C::real(gamma(r + 1.0))
        }
        Binom => {
            let n = x.as_real()?;
            let k = vals.get(1)?.as_real()?;
            if k.fract() == 0.0 && k >= 0.0 {
                let mut acc = 1.0;
                for i in 0..(k as i64) {
                    acc *= (n - i as f64) / (i as f64 + 1.0);
                }
                C::real(acc)
            } else {
                C::real(gamma(n + 1.0) / (gamma(k + 1.0) * gamma(n - k + 1.0)))
            }
        }
        Gcd | Lcm => {
            let ints: Vec<i128> = vals.iter().map(|v| real_int(*v)).collect::<Option<_>>()?;
            let mut acc = ints[0].abs();
            for &n in &ints[1..] {
                acc = if f == Gcd {
                    gcd(acc, n)
                } else {
                    let g = gcd(acc, n);
                    if g == 0 {
                        0
                    } else {
                        (acc / g).checked_mul(n.abs())?
                    }
                };
            }
            C::real(acc as f64)
        }
        Max | Min => {
            let reals: Vec<f64> = vals.iter().map(|v| v.as_real()).collect::<Option<_>>()?;
            let it = reals.into_iter();
            C::real(if f == Max {
                it.fold(f64::NEG_INFINITY, f64::max)
            } else {
                it.fold(f64::INFINITY, f64::min)
            })
        }
        Mod => {
            let a = x.as_real()?;
            let b = vals.get(1)?.as_real()?;
            C::real(a - b * (a / b).floor())
        }
    })
}

/// Exact value of a symbol-free expression built from rationals with `+`, `*` and integer
/// powers (`None` otherwise or on overflow): large integers must not compare "close enough".
pub fn exact_value(e: &Expr) -> Option<(i128, i128)> {
    fn norm(p: i128, q: i128) -> Option<(i128, i128)> {
        if q == 0 {
            return None;
        }
        let g = gcd(p, q).max(1);
        let s = if q < 0 { -1 } else { 1 };
        Some((s * (p / g), s * (q / g)))
    }
    fn add(a: (i128, i128), b: (i128, i128)) -> Option<(i128, i128)> {
        norm(
            a.0.checked_mul(b.1)?.checked_add(b.0.checked_mul(a.1)?)?,
            a.1.checked_mul(b.1)?,
        )
    }
    fn mul(a: (i128, i128), b: (i128, i128)) -> Option<(i128, i128)> {
        norm(a.0.checked_mul(b.0)?, a.1.checked_mul(b.1)?)
    }
    match e {
        Expr::Rat(p, q) => norm(*p, *q),
        Expr::Add(v) => v.iter().try_fold((0, 1), |acc, x| add(acc, exact_value(x)?)),
        Expr::Mul(v) => v.iter().try_fold((1, 1), |acc, x| mul(acc, exact_value(x)?)),
        Expr::Pow(b, x) => {
            let base = exact_value(b)?;
            let (n, 1) = exact_value(x)? else { return None };
            if n.abs() > 256 {
                return None;
            }
            let mut acc = (1, 1);
            for _ in 0..n.abs() {
                acc = mul(acc, base)?;
            }
            if n < 0 {
                norm(acc.1, acc.0)
            } else {
                Some(acc)
            }
        }
        _ => None,
    }
}

/// Values for free symbols: a fixed pseudo-random value per (name, trial).
#[derive(Clone, Debug)]
pub struct Env {
    trial: u64,
    bound: Vec<(String, C)>,
}

impl Env {
    pub fn trial(trial: u64) -> Env {
        Env {
            trial,
            bound: Vec::new(),
        }
    }

    fn with(&self, name: &str, v: C) -> Env {
        let mut e = self.clone();
        e.bound.push((name.to_string(), v));
        e
    }

    pub fn value(&self, name: &str) -> C {
        if let Some((_, v)) = self.bound.iter().rev().find(|(n, _)| n == name) {
            return *v;
        }
        // FNV-1a of the name, mixed with the trial number (splitmix64 finaliser).
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in name.bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        let mut z = h ^ self.trial.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let u = (z >> 11) as f64 / (1u64 << 53) as f64;
        let mag = 0.35 + 2.1 * u;
        // Trials 0 and 1 use positive values, later ones mix signs (real symbols can be negative).
        let negative = self.trial >= 2 && (z & 1) == 1;
        C::real(if negative { -mag } else { mag })
    }
}

/// Relative closeness used for "equal as numbers".
pub fn close(a: C, b: C, rel: f64) -> bool {
    let scale = a.abs().max(b.abs()).max(1.0);
    a.sub(b).abs() <= rel * scale
}

/// Numbers of trials for random-point equality.
pub const TRIALS: u64 = 6;

/// `a` and `b` agree at every trial point where both have a finite value (and there is at least one).
pub fn agree_everywhere(a: &Expr, b: &Expr) -> bool {
    let mut seen = 0;
    for t in 0..TRIALS {
        let env = Env::trial(t);
        match (a.eval(&env), b.eval(&env)) {
            (Some(x), Some(y)) if x.is_finite() && y.is_finite() => {
                if !close(x, y, 1e-10) {
                    return false;
                }
                seen += 1;
            }
            (Some(x), Some(y)) if !x.is_finite() && !y.is_finite() => {}
            (None, None) => {}
            _ => return false,
        }
    }
    seen > 0
}

/// The value of an expression without free symbols, if it has one.
pub fn constant_value(e: &Expr) -> Option<C> {
    if e.has_symbols() {
        return None;
    }
    e.eval(&Env::trial(0))
}
