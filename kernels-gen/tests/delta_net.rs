//! The Gated DeltaNet kernels (convolution, window, delta rule: recurrent, or in chunks) on the
//! emulator against the IR reference, step after step over each sequence's state: one sequence,
//! and batched steps whose sequences start, continue with fewer rows than the window, sit in
//! any state slot, and span several chunks.

use ir::reference::ops;
use ir::{DecayRate, DeltaNetSpec, ValueHeadOrder};
use kernels_gen::dsl::{Kernel, Ty};
use kernels_gen::emulator::{run, run_profiled, Array, Scalar, SharedTraffic};
use kernels_gen::templates::cache_layout::CacheLayout;
use kernels_gen::templates::quant::WeightFormat;
use kernels_gen::templates::{delta_chunks, delta_net, flash_attention};
use std::collections::HashMap;

mod common;
use common::{bf16_array, close, ints, Rng};

/// One sequence's inputs for some rows: the joined projection (`x_pad` spare columns after
/// each row, as a slice of a wider output is read), b and a.
struct Rows {
    x: Vec<f32>,
    b: Vec<f32>,
    a: Vec<f32>,
}

struct Layer {
    spec: DeltaNetSpec,
    conv: Vec<f32>,
    a_log: Vec<f32>,
    dt_bias: Vec<f32>,
    weights: WeightFormat,
    /// The delta rule's kernels' shared-memory traffic in each step run, in order.
    traffic: std::cell::RefCell<Vec<(String, SharedTraffic)>>,
}

impl Layer {
    fn random(rng: &mut Rng, spec: DeltaNetSpec, weights: WeightFormat) -> Self {
        let mut conv = rng.vec(spec.conv_channels() * spec.conv_kernel);
        if weights == WeightFormat::Dense(Ty::Bf16) {
            conv = conv.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect();
        }
        Self {
            conv,
            // `A` itself is negative.
            a_log: match spec.decay_rate {
                DecayRate::Log => rng.vec(spec.value_heads),
                DecayRate::Value => rng.vec(spec.value_heads).iter().map(|v| -v.exp()).collect(),
            },
            // Some past softplus's threshold of 20.
            dt_bias: (0..spec.value_heads)
                .map(|h| if h == 0 { 25.0 } else { rng.next() })
                .collect(),
            spec,
            weights,
            traffic: Default::default(),
        }
    }

    fn rows(&self, rng: &mut Rng, n: usize) -> Rows {
        let vh = self.spec.value_heads;
        Rows {
            x: rng.vec(n * self.spec.conv_channels()),
            b: rng.vec(n * vh),
            a: rng.vec(n * vh),
        }
    }

    /// The reference over `rows`, continuing `state`.
    fn reference(&self, rows: &Rows, state: &mut [f32]) -> Vec<f32> {
        ops::gated_delta_net(
            &self.spec,
            &rows.x,
            &rows.b,
            &rows.a,
            &self.conv,
            &self.a_log,
            &self.dt_bias,
            state,
        )
    }

    /// The convolution, the window, then the delta rule in `form`'s launches.
    fn kernels(&self, layout: CacheLayout, form: Form) -> (Kernel, Kernel, Vec<Kernel>) {
        let spec = &self.spec;
        let rule = match form {
            Form::Recurrent => vec![delta_net::delta_rule("rule", "test", layout, spec)],
            Form::Chunked => vec![
                delta_chunks::chunk_prepare("prepare", "test", layout, spec),
                delta_chunks::chunk_state("state", "test", layout, spec),
            ],
        };
        (
            delta_net::conv("conv", "test", layout, spec, self.weights),
            delta_net::conv_window("window", "test", layout, spec),
            rule,
        )
    }

    /// The three launches over a step of `segments` (each a sequence's rows) with `state`
    /// (`[slots, state_len]`), `checkpoints` (`[places, state_len]`, where the batched layout
    /// keeps states after the rows `row_checkpoint` marks) and the layout's step inputs; the
    /// step's output rows.
    fn step(
        &self,
        (layout, form): (CacheLayout, Form),
        segments: &[&Rows],
        (state, checkpoints): (&mut Vec<f32>, &mut Vec<f32>),
        step: HashMap<String, Array>,
        first: i64,
    ) -> Vec<f32> {
        const PAD: usize = 3;
        let (c, vh) = (self.spec.conv_channels(), self.spec.value_heads);
        let stride = c + PAD;
        let mut x = Vec::new();
        let (mut b, mut a) = (Vec::new(), Vec::new());
        for rows in segments {
            for row in rows.x.chunks_exact(c) {
                x.extend_from_slice(row);
                x.extend_from_slice(&[7.0; PAD]);
            }
            // b and a with rows 2·vh apart, side by side as slices of one output.
            for (rb, ra) in rows.b.chunks_exact(vh).zip(rows.a.chunks_exact(vh)) {
                b.extend_from_slice(rb);
                b.extend_from_slice(ra);
                a.extend_from_slice(ra);
                a.extend_from_slice(rb);
            }
        }
        let tokens = x.len() / stride;
        let weights = match self.weights {
            WeightFormat::Dense(Ty::Bf16) => bf16_array(&self.conv),
            _ => Array::f32(&self.conv),
        };
        let mut bufs: HashMap<String, Array> = HashMap::from([
            ("x".into(), Array::f32(&x)),
            ("w".into(), weights),
            ("state".into(), Array::f32(state)),
            ("checkpoints".into(), Array::f32(checkpoints)),
            ("out".into(), Array::poisoned(Ty::F32, tokens * c)),
            ("b".into(), Array::f32(&b)),
            ("a".into(), Array::f32(&a)),
            ("a_log".into(), Array::f32(&self.a_log)),
            ("dt_bias".into(), Array::f32(&self.dt_bias)),
        ]);
        bufs.extend(step);
        let mut scalars = ints(&[
            ("tokens", tokens as i64),
            ("seqs", segments.len() as i64),
            ("x_stride", stride as i64),
            ("b_stride", 2 * vh as i64),
            ("a_stride", 2 * vh as i64),
            ("first", first),
        ]);
        scalars.insert("unused".into(), Scalar::Int(0));
        let (conv, window, rule) = self.kernels(layout, form);
        run(&conv, &mut bufs, &scalars).unwrap();
        run(&window, &mut bufs, &scalars).unwrap();
        let convolved = bufs.remove("out").unwrap();
        bufs.insert("conv".into(), convolved);
        let width = vh * self.spec.value_dim;
        bufs.insert("out".into(), Array::poisoned(Ty::F32, tokens * width));
        for (name, width) in delta_chunks::scratch(&self.spec) {
            bufs.insert(name.into(), Array::poisoned(Ty::F32, tokens * width));
        }
        let lens: Vec<usize> = segments.iter().map(|rows| rows.x.len() / c).collect();
        let tiles = flash_attention::query_tiles(&lens, delta_chunks::CHUNK);
        let tiles: Vec<i64> = tiles.iter().map(|&t| t as i64).collect();
        bufs.insert("query_tiles".into(), Array::ints(Ty::I32, &tiles));
        for kernel in &rule {
            let traffic = run_profiled(kernel, &mut bufs, &scalars).unwrap();
            self.traffic.borrow_mut().push((kernel.name.clone(), traffic));
        }
        *state = bufs["state"].to_f32().unwrap();
        *checkpoints = bufs["checkpoints"].to_f32().unwrap();
        bufs["out"].to_f32().unwrap()
    }

    /// A state as the reference keeps it, its matrices transposed as the device keeps them
    /// (and back: the transpose is its own inverse up to swapping the dims).
    fn device_state(&self, state: &[f32], to_device: bool) -> Vec<f32> {
        let spec = &self.spec;
        let (dk, dv) = (spec.key_dim, spec.value_dim);
        let (rows, cols) = if to_device { (dk, dv) } else { (dv, dk) };
        let window = (spec.conv_kernel - 1) * spec.conv_channels();
        let mut out = state[..window].to_vec();
        for m in state[window..].chunks_exact(dk * dv) {
            out.extend((0..cols).flat_map(|c| (0..rows).map(move |r| m[r * cols + c])));
        }
        out
    }
}

fn specs() -> [DeltaNetSpec; 3] {
    [
        // The tiny fixture's shape: 2 value heads per key head, narrow heads.
        DeltaNetSpec {
            key_heads: 2,
            value_heads: 4,
            key_dim: 16,
            value_dim: 16,
            conv_kernel: 4,
            state_slot: 0,
            value_head_order: ValueHeadOrder::Grouped,
            decay_rate: DecayRate::Log,
        },
        // Qwen3.5's head widths (128): 8 lanes a column, 4 tiles of columns; one key head.
        DeltaNetSpec {
            key_heads: 1,
            value_heads: 2,
            key_dim: 128,
            value_dim: 128,
            conv_kernel: 4,
            state_slot: 0,
            value_head_order: ValueHeadOrder::Grouped,
            decay_rate: DecayRate::Log,
        },
        // As llama.cpp's GGUF files store the tiny fixture: value heads tiled over the key
        // heads, the decay rate stored as `A`.
        DeltaNetSpec {
            key_heads: 2,
            value_heads: 4,
            key_dim: 16,
            value_dim: 16,
            conv_kernel: 4,
            state_slot: 0,
            value_head_order: ValueHeadOrder::Tiled,
            decay_rate: DecayRate::Value,
        },
    ]
}

/// How the delta rule runs: a row at a time, or in chunks.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Form {
    Recurrent,
    Chunked,
}

const FORMS: [Form; 2] = [Form::Recurrent, Form::Chunked];

/// One sequence over steps of 5, 1 and 2 rows (fewer than the window's 3), then 150 (two
/// whole chunks and part of a third) and 64 (one whole chunk), the state kept between steps:
/// outputs and the state after each step equal the reference's, in either form.
#[test]
fn one_sequence_continues_its_state_across_steps() {
    let mut rng = Rng(41);
    for spec in specs() {
        for weights in [WeightFormat::Dense(Ty::F32), WeightFormat::Dense(Ty::Bf16)] {
            let layer = Layer::random(&mut rng, spec, weights);
            let steps: Vec<Vec<Rows>> = [5, 1, 2, 150, 64]
                .into_iter()
                .map(|n| vec![layer.rows(&mut rng, n)])
                .collect();
            for form in FORMS {
                let mut state = vec![0f32; spec.state_len()];
                let mut want_state = state.clone();
                let mut first = 0;
                for rows in &steps {
                    let n = rows[0].b.len() / spec.value_heads;
                    let want = layer.reference(&rows[0], &mut want_state);
                    let got = layer.step(
                        (CacheLayout::Contiguous, form),
                        &[&rows[0]],
                        (&mut state, &mut Vec::new()),
                        HashMap::new(),
                        first,
                    );
                    let what = format!("{form:?} {spec:?} {weights:?}, {n} rows at {first}");
                    close(&got, &want, 1e-4, &what);
                    close(
                        &layer.device_state(&state, false),
                        &want_state,
                        1e-4,
                        &format!("{what}: state"),
                    );
                    first += n as i64;
                }
            }
        }
    }
}

/// A batched step of `seqs` (each its state slot, rows and the position of its first row;
/// slots hold states of earlier steps over as many rows as that position, and an earlier
/// sequence's in the slot of one starting, which it must not read), keeping the states after
/// the rows `kept` names (sequence, row among its rows): outputs, checkpoints and each slot's
/// state after the step equal the reference's.
fn check_batched(
    rng: &mut Rng,
    spec: DeltaNetSpec,
    form: Form,
    seqs: &[(usize, usize, usize)],
    kept: &[(usize, usize)],
) {
    let layer = Layer::random(rng, spec, WeightFormat::Dense(Ty::F32));
    let len = spec.state_len();
    let slots = seqs.iter().map(|s| s.0 + 1).max().unwrap_or(0);
    let mut state = rng.vec(slots * len);
    let mut before: Vec<Vec<f32>> = Vec::new();
    for &(slot, _, pos) in seqs {
        let mut s = vec![0f32; len];
        if pos > 0 {
            layer.reference(&layer.rows(rng, pos), &mut s);
            state[slot * len..(slot + 1) * len].copy_from_slice(&layer.device_state(&s, true));
        }
        before.push(s);
    }
    let rows: Vec<Rows> = seqs.iter().map(|&(_, n, _)| layer.rows(rng, n)).collect();
    let (c, vh) = (spec.conv_channels(), spec.value_heads);
    let want_checkpoints: Vec<Vec<f32>> = kept
        .iter()
        .map(|&(seq, row)| {
            let r = &rows[seq];
            let n = row + 1;
            let first = Rows {
                x: r.x[..n * c].to_vec(),
                b: r.b[..n * vh].to_vec(),
                a: r.a[..n * vh].to_vec(),
            };
            let mut s = before[seq].clone();
            layer.reference(&first, &mut s);
            s
        })
        .collect();
    let mut want = Vec::new();
    let mut after = before.clone();
    for (r, s) in rows.iter().zip(&mut after) {
        want.extend(layer.reference(r, s));
    }
    let (mut last_rows, mut row_pos, mut row_seq, mut row_checkpoint) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut at = 0i64;
    for (s, &(_, n, pos)) in seqs.iter().enumerate() {
        at += n as i64;
        last_rows.push(at - 1);
        row_pos.extend((pos..pos + n).map(|p| p as i64));
        row_seq.extend(std::iter::repeat_n(s as i64, n));
        row_checkpoint.extend((0..n).map(|row| {
            kept.iter()
                .position(|&k| k == (s, row))
                .map_or(-1, |place| place as i64)
        }));
    }
    let slot_of: Vec<i64> = seqs.iter().map(|s| s.0 as i64).collect();
    let step = HashMap::from([
        ("last_rows".to_string(), Array::ints(Ty::I32, &last_rows)),
        ("row_pos".to_string(), Array::ints(Ty::I32, &row_pos)),
        ("row_seq".to_string(), Array::ints(Ty::I32, &row_seq)),
        ("state_slots".to_string(), Array::ints(Ty::I32, &slot_of)),
        ("row_checkpoint".to_string(), Array::ints(Ty::I32, &row_checkpoint)),
    ]);
    let segments: Vec<&Rows> = rows.iter().collect();
    let mut checkpoints = vec![f32::NAN; kept.len().max(1) * len];
    let got = layer.step(
        (CacheLayout::Batched, form),
        &segments,
        (&mut state, &mut checkpoints),
        step,
        0,
    );
    let what = format!("{form:?} {spec:?}");
    close(&got, &want, 1e-4, &format!("{what}: batched outputs"));
    for (place, want) in want_checkpoints.iter().enumerate() {
        let got = layer.device_state(&checkpoints[place * len..(place + 1) * len], false);
        close(&got, want, 1e-4, &format!("{what}: checkpoint {place}"));
    }
    for (&(slot, _, _), want) in seqs.iter().zip(&after) {
        let got = layer.device_state(&state[slot * len..(slot + 1) * len], false);
        close(&got, want, 1e-4, &format!("{what}: slot {slot}"));
    }
}

/// A batched step: a sequence starting in slot 1, one continuing with one row and one with
/// two. The states after rows other than a sequence's last are kept where asked (the starting
/// sequence's first two rows, the two-row sequence's first: its window reaching back into its
/// state).
#[test]
fn batched_sequences_keep_their_own_states() {
    let mut rng = Rng(42);
    for spec in specs() {
        for form in FORMS {
            check_batched(
                &mut rng,
                spec,
                form,
                &[(1, 3, 0), (2, 1, 6), (0, 2, 4)],
                &[(0, 0), (0, 1), (2, 0)],
            );
        }
    }
}

/// A batched step of sequences spanning chunks: one starting over 130 rows (two whole chunks
/// and two rows), one continuing over 65, one over a single row; states kept after a chunk's
/// last row, the next chunk's first, rows inside chunks and a sequence's first.
#[test]
fn batched_sequences_span_chunks() {
    let mut rng = Rng(43);
    for spec in specs() {
        for form in FORMS {
            check_batched(
                &mut rng,
                spec,
                form,
                &[(1, 130, 0), (2, 65, 7), (0, 1, 4)],
                &[(0, 63), (0, 64), (0, 100), (1, 0), (1, 40)],
            );
        }
    }
}

/// A prompt's chunks at Qwen3.5's head widths (128): every shared access of the chunked form
/// takes one wavefront a phase (the recurrent form has no shared memory).
#[test]
fn chunks_meet_no_bank_conflicts() {
    let mut rng = Rng(44);
    let spec = specs()[1];
    let layer = Layer::random(&mut rng, spec, WeightFormat::Dense(Ty::F32));
    let rows = layer.rows(&mut rng, 70);
    let mut state = vec![0f32; spec.state_len()];
    layer.step(
        (CacheLayout::Contiguous, Form::Chunked),
        &[&rows],
        (&mut state, &mut Vec::new()),
        HashMap::new(),
        0,
    );
    let traffic = layer.traffic.borrow();
    assert_eq!(traffic.len(), 2);
    for (kernel, traffic) in traffic.iter() {
        assert!(!traffic.0.is_empty(), "{kernel}: no shared traffic");
        for (array, t) in &traffic.0 {
            assert_eq!(t.worst, 1, "{kernel}, {array}: {t:?}");
        }
    }
}
