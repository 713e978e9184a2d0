//! Gated DeltaNet on the CPU (`Op::GatedDeltaNet`): the reference's recurrence, arranged for
//! the CPU. Per sequence, the convolution runs first over all of its rows (it does not depend
//! on the state), then every value head walks the rows on its own, heads spread over the pool
//! (their states are disjoint). A head's row is two passes over its `[key_dim, value_dim]`
//! state, each along contiguous rows of it so the compiler vectorises them: decay and `kᵀS`
//! together, then the write `S += k·δᵀ` and `qᵀS` together (the reference takes four passes,
//! two of them down columns). Sums over the key dimension are f32, in ascending key order (the
//! reference's are f64), so a head's result depends only on its own rows: the same whether a
//! step holds one sequence or many, one row or a chunk of them.

use super::pool;
use ir::reference::ops;
use ir::DeltaNetSpec;

/// The per-row inputs of one sequence's rows (`rows` of them), as the op takes them.
pub struct Rows<'a> {
    /// The joined projection `[q | k | v]`, `conv_channels` a row.
    pub mixed: &'a [f32],
    /// β's and the decay's pre-activations, `value_heads` a row.
    pub b: &'a [f32],
    pub a: &'a [f32],
}

/// The layer's weights: the convolution (`[channels, K]`, widened to f32), the decay rate as
/// the spec stores it, and `dt_bias`.
pub struct Weights<'a> {
    pub conv: &'a [f32],
    pub a_log: &'a [f32],
    pub dt_bias: &'a [f32],
}

/// One sequence's rows through the layer from `state` (its window, then its heads' matrices),
/// leaving the state after the last row: the outputs `[rows, value_heads·value_dim]`, and the
/// state as it stood after each row of `save_after` (ascending row indices), in order.
pub fn gated_delta_net(
    spec: &DeltaNetSpec,
    rows: Rows,
    weights: Weights,
    state: &mut [f32],
    save_after: &[usize],
) -> (Vec<f32>, Vec<Vec<f32>>) {
    debug_assert!(save_after.windows(2).all(|w| w[0] < w[1]), "ascending rows");
    let (channels, vh, dk, dv) = (spec.conv_channels(), spec.value_heads, spec.key_dim, spec.value_dim);
    let n = rows.mixed.len() / channels;
    let (window, matrices) = state.split_at_mut((spec.conv_kernel - 1) * channels);
    let (x, windows) = convolve(spec, rows.mixed, weights.conv, window, save_after);
    let gates: Vec<(f32, f32)> = (0..n * vh)
        .map(|i| {
            let h = i % vh;
            let decay = ops::delta_net_decay(spec, weights.a_log[h], rows.a[i], weights.dt_bias[h]);
            (decay, ops::sigmoid(rows.b[i]))
        })
        .collect();
    let heads: Vec<(Vec<f32>, Vec<Vec<f32>>)> =
        pool::global().map_chunks_mut(matrices, dk * dv, |h, s| head(spec, h, &x, &gates, s, save_after));
    let mut out = vec![0f32; n * vh * dv];
    for (h, (o, _)) in heads.iter().enumerate() {
        for (r, row) in o.chunks_exact(dv).enumerate() {
            out[(r * vh + h) * dv..(r * vh + h + 1) * dv].copy_from_slice(row);
        }
    }
    let saved = windows
        .into_iter()
        .enumerate()
        .map(|(c, mut saved)| {
            for (_, saved_heads) in &heads {
                saved.extend_from_slice(&saved_heads[c]);
            }
            saved
        })
        .collect();
    (out, saved)
}

/// Tells, row after row, whether the state is saved after it: a cursor over ascending rows,
/// so asking costs the same however many rows are saved.
struct SavePoints<'a> {
    rows: &'a [usize],
    next: usize,
}

impl<'a> SavePoints<'a> {
    fn new(rows: &'a [usize]) -> Self {
        Self { rows, next: 0 }
    }

    /// Whether the state after row `r` is saved; rows are asked in ascending order.
    fn after(&mut self, r: usize) -> bool {
        let hit = self.rows.get(self.next) == Some(&r);
        self.next += hit as usize;
        hit
    }
}

/// Every row through the causal convolution and SiLU, q and k L2-normed per head and q scaled
/// by `key_dim^−½` (the reference's arithmetic, row after row through `window`): the rows
/// `[q | k | v]`, and the window as it stood after each row of `save_after`.
fn convolve(
    spec: &DeltaNetSpec,
    mixed: &[f32],
    conv: &[f32],
    window: &mut [f32],
    save_after: &[usize],
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let (channels, keys, dk) = (spec.conv_channels(), spec.key_heads * spec.key_dim, spec.key_dim);
    let q_scale = 1.0 / (dk as f32).sqrt();
    let mut x = vec![0f32; mixed.len()];
    let mut windows = Vec::with_capacity(save_after.len());
    let mut saves = SavePoints::new(save_after);
    for (r, (row, out)) in mixed
        .chunks_exact(channels)
        .zip(x.chunks_exact_mut(channels))
        .enumerate()
    {
        ops::causal_conv_step(conv, spec.conv_kernel, window, row, out);
        out.iter_mut().for_each(|v| *v = ops::silu(*v));
        for head in out[..2 * keys].chunks_exact_mut(dk) {
            ops::l2_normalize(head);
        }
        out[..keys].iter_mut().for_each(|v| *v *= q_scale);
        if saves.after(r) {
            windows.push(window.to_vec());
        }
    }
    (x, windows)
}

/// Value head `h` over every row of the convolved `x`, from its state matrix `s` (`[key_dim,
/// value_dim]`, left after the last row): its outputs `[rows, value_dim]` and its matrix after
/// each row of `save_after`.
fn head(
    spec: &DeltaNetSpec,
    h: usize,
    x: &[f32],
    gates: &[(f32, f32)],
    s: &mut [f32],
    save_after: &[usize],
) -> (Vec<f32>, Vec<Vec<f32>>) {
    let (channels, keys, vh) = (spec.conv_channels(), spec.key_heads * spec.key_dim, spec.value_heads);
    let (dk, dv) = (spec.key_dim, spec.value_dim);
    let kh = spec.key_head(h);
    let rows = x.len() / channels;
    let mut out = vec![0f32; rows * dv];
    let mut saved = Vec::with_capacity(save_after.len());
    let mut saves = SavePoints::new(save_after);
    let mut read = vec![0f32; dv];
    for (r, o) in out.chunks_exact_mut(dv).enumerate() {
        let row = &x[r * channels..(r + 1) * channels];
        let q = &row[kh * dk..(kh + 1) * dk];
        let k = &row[keys + kh * dk..keys + (kh + 1) * dk];
        let v = &row[2 * keys + h * dv..2 * keys + (h + 1) * dv];
        let (decay, beta) = gates[r * vh + h];
        // S ← g·S, and kᵀS of the decayed state.
        read.fill(0.0);
        for (s_i, &k_i) in s.chunks_exact_mut(dv).zip(k) {
            for (s_ij, read_j) in s_i.iter_mut().zip(read.iter_mut()) {
                *s_ij *= decay;
                *read_j += k_i * *s_ij;
            }
        }
        // δ = β(v − kᵀS), kept in `read`.
        for (read_j, &v_j) in read.iter_mut().zip(v) {
            *read_j = (v_j - *read_j) * beta;
        }
        // S ← S + k·δᵀ, and qᵀS of the written state.
        for ((s_i, &k_i), &q_i) in s.chunks_exact_mut(dv).zip(k).zip(q) {
            for ((s_ij, &delta_j), o_j) in s_i.iter_mut().zip(&read).zip(o.iter_mut()) {
                *s_ij += k_i * delta_j;
                *o_j += q_i * *s_ij;
            }
        }
        if saves.after(r) {
            saved.push(s.to_vec());
        }
    }
    (out, saved)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ir::{DecayRate, ValueHeadOrder};

    /// Deterministic values in [−1, 1) (the device fill's generator).
    fn values(seed: u32, n: usize) -> Vec<f32> {
        (0..n as u32)
            .map(|i| kernels_gen::templates::fill::uniform(seed, i, 0.0, 1.0))
            .collect()
    }

    struct Layer {
        spec: DeltaNetSpec,
        conv: Vec<f32>,
        a_log: Vec<f32>,
        dt_bias: Vec<f32>,
        mixed: Vec<f32>,
        b: Vec<f32>,
        a: Vec<f32>,
    }

    impl Layer {
        fn new(order: ValueHeadOrder, decay_rate: DecayRate, rows: usize) -> Self {
            let spec = DeltaNetSpec {
                key_heads: 2,
                value_heads: 4,
                key_dim: 16,
                value_dim: 8,
                conv_kernel: 4,
                state_slot: 0,
                value_head_order: order,
                decay_rate,
            };
            let (c, vh) = (spec.conv_channels(), spec.value_heads);
            let a_log = match decay_rate {
                DecayRate::Log => values(2, vh),
                DecayRate::Value => values(2, vh).iter().map(|v| -v.exp()).collect(),
            };
            Self {
                conv: values(1, c * spec.conv_kernel),
                a_log,
                dt_bias: values(3, vh),
                mixed: values(4, rows * c),
                b: values(5, rows * vh),
                a: values(6, rows * vh),
                spec,
            }
        }

        /// Rows `range` through the CPU kernel, saving the state after rows `save_after`.
        fn run(
            &self,
            range: std::ops::Range<usize>,
            state: &mut [f32],
            save_after: &[usize],
        ) -> (Vec<f32>, Vec<Vec<f32>>) {
            let (c, vh) = (self.spec.conv_channels(), self.spec.value_heads);
            let rows = Rows {
                mixed: &self.mixed[range.start * c..range.end * c],
                b: &self.b[range.start * vh..range.end * vh],
                a: &self.a[range.start * vh..range.end * vh],
            };
            let weights = Weights {
                conv: &self.conv,
                a_log: &self.a_log,
                dt_bias: &self.dt_bias,
            };
            gated_delta_net(&self.spec, rows, weights, state, save_after)
        }

        /// Rows `range` through the reference.
        fn reference(&self, range: std::ops::Range<usize>, state: &mut [f32]) -> Vec<f32> {
            let (c, vh) = (self.spec.conv_channels(), self.spec.value_heads);
            ops::gated_delta_net(
                &self.spec,
                &self.mixed[range.start * c..range.end * c],
                &self.b[range.start * vh..range.end * vh],
                &self.a[range.start * vh..range.end * vh],
                &self.conv,
                &self.a_log,
                &self.dt_bias,
                state,
            )
        }
    }

    /// The larger of two differences, a NaN the larger (`f32::max` would pass it by).
    fn worse(m: f32, d: f32) -> f32 {
        if d > m || d.is_nan() {
            d
        } else {
            m
        }
    }

    fn assert_close(got: &[f32], want: &[f32], what: &str) {
        let scale = want.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
        let worst = got.iter().zip(want).fold(0f32, |m, (a, b)| worse(m, (a - b).abs()));
        assert!(
            got.len() == want.len() && worst <= 1e-5 * scale,
            "{what}: off by {worst} of {scale}"
        );
    }

    /// The reference's outputs and final state (to f32 rounding), for both value-head orders
    /// and both decay forms.
    #[test]
    fn follows_the_reference() {
        for (order, rate) in [
            (ValueHeadOrder::Grouped, DecayRate::Log),
            (ValueHeadOrder::Tiled, DecayRate::Value),
        ] {
            let layer = Layer::new(order, rate, 9);
            let mut state = values(8, layer.spec.state_len());
            let mut want_state = state.clone();
            let (out, _) = layer.run(0..9, &mut state, &[]);
            let want = layer.reference(0..9, &mut want_state);
            assert_close(&out, &want, &format!("{order:?} {rate:?} outputs"));
            assert_close(&state, &want_state, &format!("{order:?} {rate:?} state"));
        }
    }

    /// Rows split over steps give bit for bit what one step gives (a request's tokens do not
    /// depend on how its prompt is chunked), and the states saved are those after the rows
    /// asked for, wherever they lie.
    #[test]
    fn steps_compose_and_saved_states_are_those_after_their_rows() {
        let layer = Layer::new(ValueHeadOrder::Grouped, DecayRate::Log, 10);
        let mut whole = vec![0f32; layer.spec.state_len()];
        let rows = [0, 3, 6, 7, 8];
        let (all, saved) = layer.run(0..10, &mut whole, &rows);
        let mut split = vec![0f32; layer.spec.state_len()];
        let (mut parts, _) = layer.run(0..3, &mut split, &[]);
        parts.extend(layer.run(3..10, &mut split, &[]).0);
        assert_eq!(parts, all);
        assert_eq!(split, whole);
        assert_eq!(saved.len(), rows.len());
        for (&row, saved) in rows.iter().zip(&saved) {
            let mut state = vec![0f32; layer.spec.state_len()];
            layer.run(0..row + 1, &mut state, &[]);
            assert_eq!(saved, &state, "after row {row}");
        }
    }
}
