//! What a parsed answer is: a scalar expression, a relation (or a chain of them), a finite set,
//! a tuple, an interval, a union of sets, or one of the named number sets.
//!
//! Sets keep the order they were written in (a tuple compared against a set uses it, as
//! math-verify does), and drop repeated elements.

use super::expr::Expr;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RelOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl RelOp {
    /// The relation read right to left: `a < b` is `b > a`.
    pub fn flipped(self) -> RelOp {
        match self {
            RelOp::Lt => RelOp::Gt,
            RelOp::Gt => RelOp::Lt,
            RelOp::Le => RelOp::Ge,
            RelOp::Ge => RelOp::Le,
            op => op,
        }
    }

    pub fn symbol(self) -> &'static str {
        match self {
            RelOp::Eq => "=",
            RelOp::Ne => "!=",
            RelOp::Lt => "<",
            RelOp::Le => "<=",
            RelOp::Gt => ">",
            RelOp::Ge => ">=",
        }
    }

    pub fn holds(self, l: f64, r: f64) -> bool {
        match self {
            RelOp::Eq => l == r,
            RelOp::Ne => l != r,
            RelOp::Lt => l < r,
            RelOp::Le => l <= r,
            RelOp::Gt => l > r,
            RelOp::Ge => l >= r,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NamedSet {
    Naturals,
    Integers,
    Rationals,
    Reals,
    Complexes,
    Primes,
    Empty,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Expr(Expr),
    Rel(RelOp, Box<Value>, Box<Value>),
    /// A chain `a < b < c` is `And([a < b, b < c])`.
    And(Vec<Value>),
    Set(Vec<Value>),
    Tuple(Vec<Value>),
    Interval {
        lo: Expr,
        hi: Expr,
        lo_open: bool,
        hi_open: bool,
    },
    Union(Vec<Value>),
    Named(NamedSet),
}

impl Value {
    /// A finite set without repeated elements (first occurrence wins).
    pub fn set(items: Vec<Value>) -> Value {
        let mut out: Vec<Value> = Vec::new();
        let mut keys = std::collections::HashSet::new();
        for v in items {
            if keys.insert(v.canon()) {
                out.push(v);
            }
        }
        Value::Set(out)
    }

    pub fn as_expr(&self) -> Option<&Expr> {
        match self {
            Value::Expr(e) => Some(e),
            _ => None,
        }
    }

    pub fn canon(&self) -> String {
        let join = |v: &[Value]| v.iter().map(Value::canon).collect::<Vec<_>>().join(", ");
        match self {
            Value::Expr(e) => e.canon(),
            Value::Rel(op, l, r) => format!("{} {} {}", l.canon(), op.symbol(), r.canon()),
            Value::And(v) => format!("And({})", join(v)),
            Value::Set(v) => {
                let mut parts: Vec<String> = v.iter().map(Value::canon).collect();
                parts.sort();
                format!("{{{}}}", parts.join(", "))
            }
            Value::Tuple(v) => format!("Tuple({})", join(v)),
            Value::Interval {
                lo,
                hi,
                lo_open,
                hi_open,
            } => format!(
                "{}{}, {}{}",
                if *lo_open { "(" } else { "[" },
                lo.canon(),
                hi.canon(),
                if *hi_open { ")" } else { "]" }
            ),
            Value::Union(v) => {
                let mut parts: Vec<String> = v.iter().map(Value::canon).collect();
                parts.sort();
                format!("Union({})", parts.join(", "))
            }
            Value::Named(n) => format!("{n:?}"),
        }
    }

    /// A relation or a chain made only of relations.
    pub fn is_relation(&self) -> bool {
        match self {
            Value::Rel(..) => true,
            Value::And(v) => !v.is_empty() && v.iter().all(|r| matches!(r, Value::Rel(..))),
            _ => false,
        }
    }

    /// An equation (or a chain of equations).
    pub fn is_equation(&self) -> bool {
        match self {
            Value::Rel(RelOp::Eq, ..) => true,
            Value::And(v) => !v.is_empty() && v.iter().all(|r| matches!(r, Value::Rel(RelOp::Eq, ..))),
            _ => false,
        }
    }

    /// An equation whose left side is made of symbols only: `x = 1`, `(p, q) = (3, 2)`, `|AB| = 1`.
    pub fn is_assignment(&self) -> bool {
        match self {
            Value::Rel(RelOp::Eq, l, _) => l.only_symbols(),
            Value::And(v) => self.is_equation() && matches!(&v[0], Value::Rel(_, l, _) if l.only_symbols()),
            _ => false,
        }
    }

    fn only_symbols(&self) -> bool {
        match self {
            Value::Expr(e) => e.only_symbols(),
            Value::Tuple(v) => !v.is_empty() && v.iter().all(Value::only_symbols),
            _ => false,
        }
    }

    pub fn first_relation(&self) -> &Value {
        match self {
            Value::And(v) => &v[0],
            v => v,
        }
    }

    pub fn last_relation(&self) -> &Value {
        match self {
            Value::And(v) => v.last().expect("non-empty chain").last_relation(),
            v => v,
        }
    }

    pub fn lhs(&self) -> Option<&Value> {
        match self {
            Value::Rel(_, l, _) => Some(l),
            _ => None,
        }
    }

    pub fn rhs(&self) -> Option<&Value> {
        match self {
            Value::Rel(_, _, r) => Some(r),
            _ => None,
        }
    }

    /// A set in the sympy sense (tuples are not sets).
    pub fn is_set(&self) -> bool {
        matches!(
            self,
            Value::Set(_) | Value::Interval { .. } | Value::Union(_) | Value::Named(_)
        )
    }

    pub fn contains_zoo(&self) -> bool {
        match self {
            Value::Expr(e) => e.contains_zoo(),
            _ => false,
        }
    }
}
