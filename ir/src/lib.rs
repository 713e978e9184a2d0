//! bbc's intermediate representation.
//!
//! A [`Graph`] is one forward step of a model over `tokens` new tokens: typed nodes whose
//! shapes may name symbolic dims ([`Sym::Tokens`], [`Sym::KvLen`]). It has a canonical text
//! form ([`Graph::to_text`]) that every compiler stage can dump, and a reference interpreter
//! ([`reference::Interpreter`]) that defines what every op means numerically: f32 values with
//! f64 accumulation where sums are long. Later backends are checked against it.

mod dtype;
mod expr;
pub mod float8;
mod graph;
pub mod multi_token;
mod op;
pub mod reference;
mod shape;
mod tensor;
mod text;

pub use dtype::DType;
pub use expr::Expr;
pub use float8::F8E4M3;
pub use graph::{Graph, GraphError, Node, NodeId};
pub use op::{
    AttentionSpec, DecayRate, DeltaNetSpec, GluAct, InputKind, MoeRouter, MoeSpec, Op, RopeLayout, RopeScaling,
    RopeSpec, SparseMlaSpec, ValueHeadOrder, TOKENS,
};
pub use shape::{Dim, Shape, Sym};
pub use tensor::Tensor;
