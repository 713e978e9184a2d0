//! Rotary embeddings on the CPU: the cos/sin of every rotary frequency at every row's position,
//! computed once per step for each kind of rope the graph has (Gemma 3 has two thetas) and
//! shared by every layer, where the reference computes them again for every rope op (in f64:
//! a few percent of a prefill). The same values as the reference's, applied by its
//! `rope_row`, so results are bit for bit the reference's.

use super::rows;
use ir::reference::ops;
use ir::RopeSpec;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// Per row of a step: `cos` and `sin` of each rotary frequency, `half` of them a row.
struct Table {
    half: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

/// What the tables depend on besides the positions: theta, the rotary width, the linear
/// scaling, the head width for proportional RoPE (whose frequencies are spaced over the head),
/// and the scaling by frequency.
type Key = (u64, usize, u64, Option<usize>, String);

/// A step's rope tables, built on first use; every rope op of the step rotates rows at the
/// step's positions.
pub struct StepRope {
    positions: Vec<usize>,
    tables: Mutex<HashMap<Key, Arc<Table>>>,
}

impl StepRope {
    pub fn new(positions: Vec<usize>) -> Self {
        Self {
            positions,
            tables: Mutex::new(HashMap::new()),
        }
    }

    /// The step's positions, a row each.
    pub fn positions(&self) -> &[usize] {
        &self.positions
    }

    /// Rotate `x` (rows of `spec.heads · head_dim` at `positions`) in place.
    pub fn apply(&self, spec: &RopeSpec, x: &mut [f32], positions: &[usize]) {
        let width = spec.heads * spec.head_dim;
        if positions != self.positions.as_slice() {
            // Not the step's rows: the reference, as it is.
            return ops::rope(spec, x, positions);
        }
        let table = self.table(spec);
        rows::for_row_runs(x, width, |first, run| {
            for (i, row) in run.chunks_exact_mut(width).enumerate() {
                let at = (first + i) * table.half..(first + i + 1) * table.half;
                ops::rope_row(spec, row, &table.cos[at.clone()], &table.sin[at]);
            }
        });
    }

    fn table(&self, spec: &RopeSpec) -> Arc<Table> {
        let proportional = (spec.layout == ir::RopeLayout::Proportional).then_some(spec.head_dim);
        let key = (
            spec.theta.to_bits(),
            spec.rotary_dim,
            spec.position_scale.to_bits(),
            proportional,
            spec.scaling.describe(),
        );
        let mut tables = self.tables.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        tables
            .entry(key)
            .or_insert_with(|| Arc::new(build(spec, &self.positions)))
            .clone()
    }
}

fn build(spec: &RopeSpec, positions: &[usize]) -> Table {
    let inv_freq = ops::rope_inv_freq(spec);
    let half = inv_freq.len();
    let (mut cos, mut sin) = (vec![0f32; positions.len() * half], vec![0f32; positions.len() * half]);
    for ((c, s), &p) in cos
        .chunks_exact_mut(half.max(1))
        .zip(sin.chunks_exact_mut(half.max(1)))
        .zip(positions)
    {
        ops::rope_cos_sin(spec, &inv_freq, p, c, s);
    }
    Table { half, cos, sin }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir::RopeLayout;

    /// Bit for bit the reference's rope, for two specs sharing a step, both layouts, partial
    /// rotary width, and positions that are not the step's.
    #[test]
    fn tables_give_the_references_bits() {
        let positions: Vec<usize> = (0..20).map(|i| 3 + 7 * i).collect();
        let step = StepRope::new(positions.clone());
        for (theta, layout, rotary_dim) in [
            (10_000.0, RopeLayout::RotateHalf, 16),
            (1_000_000.0, RopeLayout::AdjacentPairs, 8),
            (10_000.0, RopeLayout::RotateHalf, 16),
        ] {
            let spec = RopeSpec {
                heads: 3,
                head_dim: 16,
                rotary_dim,
                theta,
                position_scale: 2.0,
                layout,
                scaling: ir::RopeScaling::None,
            };
            let x: Vec<f32> = (0..20 * 48).map(|i| ((i * 37 % 101) as f32 - 50.0) / 13.0).collect();
            for positions in [&positions[..], &positions[..5]] {
                let rows = positions.len();
                let (mut got, mut want) = (x[..rows * 48].to_vec(), x[..rows * 48].to_vec());
                step.apply(&spec, &mut got, positions);
                ops::rope(&spec, &mut want, positions);
                assert_eq!(
                    got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                );
            }
        }
        assert_eq!(step.tables.lock().unwrap().len(), 2, "one table per kind of rope");
    }
}
