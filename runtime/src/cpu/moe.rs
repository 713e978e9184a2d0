//! Mixture-of-experts on the CPU (`Op::Moe`): route every row (the IR's router, shared with
//! the reference), then run each chosen expert once over all the rows that chose it, so its
//! weights are read once a step however many rows it serves, and add the weighted outputs
//! back in ascending expert order, as HF adds them. A row's result does not depend on which
//! other rows share the step.

use super::activation;
use super::matrix::Matrix;
use ir::reference::ops;
use ir::{MoeSpec, Tensor};

pub fn moe(spec: &MoeSpec, x: &Tensor, logits: &Tensor, score_bias: &[f32], gate_up: &Matrix, down: &Matrix) -> Tensor {
    let (d, n) = (x.row_len(), spec.intermediate);
    let mut users: Vec<Vec<(usize, f32)>> = vec![Vec::new(); spec.experts];
    for r in 0..x.rows() {
        for (e, w) in ops::moe_route(logits.row(r), score_bias, spec) {
            users[e].push((r, w));
        }
    }
    let mut out = Tensor::zeros(x.shape.clone());
    for (e, rows) in users.iter().enumerate().filter(|(_, rows)| !rows.is_empty()) {
        let xs: Vec<f32> = rows.iter().flat_map(|&(r, _)| x.row(r)).copied().collect();
        let mut h = vec![0f32; rows.len() * 2 * n];
        gate_up.matmul_rows(e * 2 * n..(e + 1) * 2 * n, &xs, rows.len(), &mut h);
        let mut m = vec![0f32; rows.len() * n];
        activation::glu(&h, 2 * n, spec.act, &mut m);
        let mut y = vec![0f32; rows.len() * d];
        down.matmul_rows(e * d..(e + 1) * d, &m, rows.len(), &mut y);
        for (&(r, w), yr) in rows.iter().zip(y.chunks_exact(d)) {
            for (o, y) in out.data[r * d..(r + 1) * d].iter_mut().zip(yr) {
                *o += y * w;
            }
        }
    }
    out
}
