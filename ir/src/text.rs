//! The canonical text form: one line per node, stable across runs (snapshot-tested).
//!
//! ```text
//! graph llama
//! %0 = input token_ids : i32[tokens]
//! %1 = weight "token_embd.weight" : q8_0[49152, 576]
//! %2 = embedding(%1, %0) : f32[tokens, 576]
//! output logits = %2
//! ```

use crate::op::Op;
use crate::Graph;
use std::fmt::Write;

impl Graph {
    pub fn to_text(&self) -> String {
        let mut out = format!("graph {}\n", self.name);
        for (i, node) in self.nodes().iter().enumerate() {
            let _ = write!(out, "%{i} = {}", node.op.name());
            match &node.op {
                Op::Input(_) | Op::Weight { .. } => {
                    let _ = write!(out, " {}", node.op.attributes());
                }
                op => {
                    let args: Vec<String> = node.inputs.iter().map(|x| format!("%{}", x.0)).collect();
                    let _ = write!(out, "({})", args.join(", "));
                    let attrs = op.attributes();
                    if !attrs.is_empty() {
                        let _ = write!(out, " {{{attrs}}}");
                    }
                }
            }
            let _ = writeln!(out, " : {}{}", node.dtype, node.shape);
        }
        for (name, id) in self.outputs() {
            let _ = writeln!(out, "output {name} = %{}", id.0);
        }
        out
    }
}
