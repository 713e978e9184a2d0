//! Shapes with symbolic dims.

use std::fmt;

/// Sizes known only at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Sym {
    /// New tokens processed in this step (prompt chunk length in prefill, 1 in decode).
    Tokens,
    /// Tokens already held in the KV cache before this step.
    KvLen,
}

impl Sym {
    pub fn name(self) -> &'static str {
        match self {
            Self::Tokens => "tokens",
            Self::KvLen => "kv_len",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Dim {
    Const(usize),
    Sym(Sym),
}

impl Dim {
    pub fn as_const(self) -> Option<usize> {
        match self {
            Self::Const(n) => Some(n),
            Self::Sym(_) => None,
        }
    }
}

impl From<usize> for Dim {
    fn from(n: usize) -> Self {
        Self::Const(n)
    }
}

impl From<Sym> for Dim {
    fn from(s: Sym) -> Self {
        Self::Sym(s)
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Const(n) => write!(f, "{n}"),
            Self::Sym(s) => f.write_str(s.name()),
        }
    }
}

/// Row-major shape, outermost dim first.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct Shape(pub Vec<Dim>);

impl Shape {
    pub fn new(dims: impl IntoIterator<Item = Dim>) -> Self {
        Self(dims.into_iter().collect())
    }

    pub fn rank(&self) -> usize {
        self.0.len()
    }

    pub fn last(&self) -> Option<Dim> {
        self.0.last().copied()
    }

    /// The dims with `tokens` (and `kv_len`) bound to concrete sizes.
    pub fn resolve(&self, tokens: usize, kv_len: usize) -> Vec<usize> {
        self.0
            .iter()
            .map(|d| match d {
                Dim::Const(n) => *n,
                Dim::Sym(Sym::Tokens) => tokens,
                Dim::Sym(Sym::KvLen) => kv_len,
            })
            .collect()
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}
