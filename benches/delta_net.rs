//! One Gated DeltaNet layer on the CPU at real Qwen3.5 shapes (heads of 128; 16 key heads and
//! 16 value heads as the 0.8B and 2B have, or 32 as the 9B has), random inputs: the reference
//! interpreter's recurrence (`ir::reference::ops::gated_delta_net`, what the CPU backend ran
//! before) against the CPU backend's (`runtime::cpu::delta_net`), side by side in one run, for
//! a decode row of one sequence and for a 128-row prefill chunk. Prints ms per call of each
//! (median of alternated runs) and the speed-up. `cargo bench --bench delta_net`.

use ir::reference::ops;
use ir::{DecayRate, DeltaNetSpec, ValueHeadOrder};
use kernels_gen::templates::fill;
use runtime::cpu::delta_net::{self, Rows, Weights};
use std::time::Instant;

/// Deterministic values in [−1, 1) (the device fill's generator).
fn values(seed: u32, n: usize) -> Vec<f32> {
    (0..n as u32).map(|i| fill::uniform(seed, i, 0.0, 1.0)).collect()
}

fn median(mut t: Vec<f64>) -> f64 {
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}

fn main() {
    println!(
        "{:>28} {:>6} {:>14} {:>14} {:>8}",
        "shape", "rows", "reference ms", "cpu ms", "speed-up"
    );
    for (label, value_heads) in [("0.8B/2B: 16 key, 16 value", 16), ("9B: 16 key, 32 value", 32)] {
        let spec = DeltaNetSpec {
            key_heads: 16,
            value_heads,
            key_dim: 128,
            value_dim: 128,
            conv_kernel: 4,
            state_slot: 0,
            value_head_order: ValueHeadOrder::Grouped,
            decay_rate: DecayRate::Log,
        };
        let (channels, vh) = (spec.conv_channels(), spec.value_heads);
        let conv = values(1, channels * spec.conv_kernel);
        let a_log = values(2, vh);
        let dt_bias = values(3, vh);
        for rows in [1, 128] {
            let mixed = values(4, rows * channels);
            let (b, a) = (values(5, rows * vh), values(6, rows * vh));
            // A state as a sequence 64 rows in would hold.
            let state = values(7, spec.state_len());
            let (mut reference, mut cpu) = (Vec::new(), Vec::new());
            let reps = if rows == 1 { 200 } else { 5 };
            for _ in 0..7 {
                let mut s = state.clone();
                let start = Instant::now();
                for _ in 0..reps {
                    std::hint::black_box(ops::gated_delta_net(
                        &spec, &mixed, &b, &a, &conv, &a_log, &dt_bias, &mut s,
                    ));
                }
                reference.push(start.elapsed().as_secs_f64() * 1e3 / reps as f64);
                let mut s = state.clone();
                let start = Instant::now();
                for _ in 0..reps {
                    let rows = Rows {
                        mixed: &mixed,
                        b: &b,
                        a: &a,
                    };
                    let weights = Weights {
                        conv: &conv,
                        a_log: &a_log,
                        dt_bias: &dt_bias,
                    };
                    std::hint::black_box(delta_net::gated_delta_net(&spec, rows, weights, &mut s, &[]));
                }
                cpu.push(start.elapsed().as_secs_f64() * 1e3 / reps as f64);
            }
            let (r, c) = (median(reference), median(cpu));
            println!("{label:>28} {rows:>6} {r:>14.3} {c:>14.3} {:>7.1}×", r / c);
        }
    }
}
