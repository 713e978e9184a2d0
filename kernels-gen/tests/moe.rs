//! The MoE kernels (routing, experts' gate/up, weighted down projections) on the emulator
//! against the IR reference: routes exactly (ties, NaN logits, DeepSeek-V3's groups and their
//! masking quirk), outputs within f32 rounding, f32 and bf16 weights.

use ir::reference::ops;
use ir::{GluAct, MoeRouter, MoeSpec};
use kernels_gen::dsl::{MmaElement, Ty};
use kernels_gen::emulator::{run, Array};
use kernels_gen::templates::moe;
use kernels_gen::templates::quant::WeightFormat;
use std::collections::HashMap;

mod common;
use common::{bf16_array, close, ints, rows_of, Rng};

fn spec(experts: usize, experts_per_token: usize, normalize: bool, router: MoeRouter) -> MoeSpec {
    MoeSpec {
        experts,
        experts_per_token,
        normalize,
        intermediate: 40,
        act: GluAct::Silu,
        router,
    }
}

fn specs() -> Vec<MoeSpec> {
    vec![
        // Qwen3-Next's router (softmax over every expert, normalised).
        spec(16, 4, true, MoeRouter::Softmax),
        // Gemma 4's: normalised, then each expert's scale; GELU experts.
        MoeSpec {
            act: GluAct::GeluTanh,
            ..spec(24, 3, true, MoeRouter::SoftmaxExpertScale)
        },
        // Qwen2-MoE's: not normalised.
        spec(40, 6, false, MoeRouter::Softmax),
        // DeepSeek-V3's shape in small: 2 of 4 groups.
        spec(
            16,
            4,
            true,
            MoeRouter::GroupedSigmoid {
                groups: 4,
                top_groups: 2,
                scaling: 2.5,
            },
        ),
        // GLM-4.5's: one group, more experts than a warp has lanes.
        spec(
            80,
            8,
            true,
            MoeRouter::GroupedSigmoid {
                groups: 1,
                top_groups: 1,
                scaling: 1.8,
            },
        ),
    ]
}

/// What the router reads and writes: its `logits`, its per-expert `vector` (as the score bias
/// and as the experts' scales: each router reads the one it has), and room for `pairs` routes
/// and weights.
fn routing_buffers(logits: &[f32], vector: &[f32], pairs: usize) -> HashMap<String, Array> {
    HashMap::from([
        ("logits".into(), Array::f32(logits)),
        ("score_bias".into(), Array::f32(vector)),
        ("expert_scale".into(), Array::f32(vector)),
        ("routes".into(), Array::poisoned(Ty::I32, pairs)),
        ("route_weights".into(), Array::poisoned(Ty::F32, pairs)),
    ])
}

/// Logits with ties (a few levels only) and a NaN, from `rng`.
fn logits(rng: &mut Rng, rows: usize, experts: usize, stride: usize) -> Vec<f32> {
    let mut out = vec![9.0; rows * stride];
    for r in 0..rows {
        for e in 0..experts {
            out[r * stride + e] = (rng.next() * 3.0).round() / 2.0 + if r % 2 == 0 { 0.0 } else { rng.next() };
        }
    }
    out[stride + 1] = f32::NAN;
    out
}

/// Routing picks the reference's experts (ascending) with its weights, for every router.
#[test]
fn routing_matches_the_reference_with_ties_and_nan() {
    let mut rng = Rng(51);
    for spec in specs() {
        let (rows, e, k) = (6, spec.experts, spec.experts_per_token);
        let stride = e + 5;
        let logits = logits(&mut rng, rows, e, stride);
        // A bias large enough to reorder scores, and to push most below the 0 that experts of
        // the groups not chosen count as (so some of those are chosen, as in HF).
        let bias: Vec<f32> = (0..e).map(|_| rng.next() * 1.5 - 1.2).collect();
        let mut bufs = routing_buffers(&logits, &bias, rows * k);
        let scalars = ints(&[("tokens", rows as i64), ("logits_stride", stride as i64)]);
        run(&moe::route("route", "test", &spec), &mut bufs, &scalars).unwrap();
        let routes = bufs["routes"].to_i64().unwrap();
        let weights = bufs["route_weights"].to_f32().unwrap();
        for r in 0..rows {
            let bias = if spec.has_expert_vector() { &bias[..] } else { &[] };
            let want = ops::moe_route(&logits[r * stride..r * stride + e], bias, &spec);
            let got: Vec<usize> = routes[r * k..(r + 1) * k].iter().map(|&e| e as usize).collect();
            let want_experts: Vec<usize> = want.iter().map(|&(e, _)| e).collect();
            assert_eq!(got, want_experts, "{spec:?}: row {r}");
            if r != 1 {
                let want_weights: Vec<f32> = want.iter().map(|&(_, w)| w).collect();
                close(
                    &weights[r * k..(r + 1) * k],
                    &want_weights,
                    1e-5,
                    &format!("{spec:?}: row {r}"),
                );
            }
        }
    }
}

/// The three launches compute the reference's layer, over rows of a strided activation.
#[test]
fn experts_match_the_reference_layer() {
    let mut rng = Rng(52);
    // Rows of 48 (and hidden units of 40): weights read 16 bytes a lane; of 44 and 36 (bf16)
    // or 42 and 38 (f32): one at a time.
    let mut cases = Vec::new();
    for spec in specs() {
        for format in [WeightFormat::Dense(Ty::F32), WeightFormat::Dense(Ty::Bf16)] {
            let ragged = match format {
                WeightFormat::Dense(Ty::Bf16) => (44, 36),
                _ => (42, 38),
            };
            for (d, i) in [(48, 40), ragged] {
                cases.push((
                    MoeSpec {
                        intermediate: i,
                        ..spec
                    },
                    format,
                    d,
                ));
            }
        }
    }
    for (spec, format, d) in cases {
        let (rows, e, k, i) = (5, spec.experts, spec.experts_per_token, spec.intermediate);
        let (x_stride, l_stride) = (d + 3, e + 2);
        let x = rng.vec(rows * x_stride);
        let logits: Vec<f32> = rng.vec(rows * l_stride);
        let bias = rng.vec(e);
        let round = |w: Vec<f32>| match format {
            WeightFormat::Dense(Ty::Bf16) => w.iter().map(|&v| half::bf16::from_f32(v).to_f32()).collect(),
            _ => w,
        };
        let gate_up = round(rng.vec(e * 2 * i * d));
        let down = round(rng.vec(e * d * i));
        let array = |w: &[f32]| match format {
            WeightFormat::Dense(Ty::Bf16) => bf16_array(w),
            _ => Array::f32(w),
        };
        let mut bufs = routing_buffers(&logits, &bias, rows * k);
        bufs.extend([
            ("x".into(), Array::f32(&x)),
            ("hidden".into(), Array::poisoned(Ty::F32, rows * k * i)),
            ("out".into(), Array::poisoned(Ty::F32, rows * d)),
        ]);
        let scalars = ints(&[
            ("tokens", rows as i64),
            ("logits_stride", l_stride as i64),
            ("x_stride", x_stride as i64),
            ("d", d as i64),
        ]);
        run(&moe::route("route", "test", &spec), &mut bufs, &scalars).unwrap();
        bufs.insert("w".into(), array(&gate_up));
        run(&moe::gate_up("gate_up", "test", &spec, d, format), &mut bufs, &scalars).unwrap();
        bufs.insert("w".into(), array(&down));
        run(&moe::down("down", "test", &spec, d, format), &mut bufs, &scalars).unwrap();
        let bias = if spec.has_expert_vector() { &bias[..] } else { &[] };
        let want = ops::moe(
            &rows_of(&x, rows, d, x_stride),
            &rows_of(&logits, rows, e, l_stride),
            bias,
            &gate_up,
            &down,
            &spec,
        );
        close(
            &bufs["out"].to_f32().unwrap(),
            &want,
            1e-5,
            &format!("{spec:?} {format:?} d={d}"),
        );
    }
}

/// The expert-by-expert gate/up and down (what prefill runs; the down's products then summed
/// by `combine`) write exactly the row-by-row kernels' values, over more pairs than one
/// block-wide chunk of routes holds.
#[test]
fn experts_one_by_one_equal_rows_one_by_one() {
    let mut rng = Rng(53);
    for spec in specs() {
        for format in [WeightFormat::Dense(Ty::F32), WeightFormat::Dense(Ty::Bf16)] {
            let (rows, d, e, k, i) = (40, 48, spec.experts, spec.experts_per_token, spec.intermediate);
            let x = rng.vec(rows * d);
            let logits = rng.vec(rows * e);
            let gate_up = rng.vec(e * 2 * i * d);
            let weights = match format {
                WeightFormat::Dense(Ty::Bf16) => bf16_array(&gate_up),
                _ => Array::f32(&gate_up),
            };
            let vector = rng.vec(e);
            let mut bufs = routing_buffers(&logits, &vector, rows * k);
            bufs.extend([("x".into(), Array::f32(&x)), ("w".into(), weights)]);
            let scalars = ints(&[
                ("tokens", rows as i64),
                ("logits_stride", e as i64),
                ("x_stride", d as i64),
            ]);
            run(&moe::route("route", "test", &spec), &mut bufs, &scalars).unwrap();
            let mut hidden = Vec::new();
            for kernel in [
                moe::gate_up("rows", "test", &spec, d, format),
                moe::gate_up_by_expert("experts", "test", &spec, d, format),
            ] {
                bufs.insert("hidden".into(), Array::poisoned(Ty::F32, rows * k * i));
                run(&kernel, &mut bufs, &scalars).unwrap();
                hidden.push(bufs["hidden"].to_f32().unwrap());
            }
            assert_eq!(hidden[0], hidden[1], "{spec:?} {format:?}");
            let down = rng.vec(e * d * i);
            bufs.insert(
                "w".into(),
                match format {
                    WeightFormat::Dense(Ty::Bf16) => bf16_array(&down),
                    _ => Array::f32(&down),
                },
            );
            bufs.insert("out".into(), Array::poisoned(Ty::F32, rows * d));
            let mut scalars = scalars.clone();
            scalars.insert("active".into(), kernels_gen::emulator::Scalar::Int(1));
            run(&moe::down("rows", "test", &spec, d, format), &mut bufs, &scalars).unwrap();
            let row_by_row = bufs["out"].to_f32().unwrap();
            bufs.insert("out".into(), Array::poisoned(Ty::F32, rows * d));
            bufs.insert("ys".into(), Array::poisoned(Ty::F32, rows * k * d));
            run(
                &moe::down_by_expert("experts", "test", &spec, d, format),
                &mut bufs,
                &scalars,
            )
            .unwrap();
            run(&moe::combine("combine", "test", &spec, d), &mut bufs, &scalars).unwrap();
            assert_eq!(bufs["out"].to_f32().unwrap(), row_by_row, "{spec:?} {format:?}: down");
        }
    }
}

/// `v` rounded (nearest even) to the tensor cores' `element`.
fn rounded(element: MmaElement, v: f32) -> f32 {
    match element {
        MmaElement::Bf16 => half::bf16::from_f32(v).to_f32(),
        MmaElement::F16 => half::f16::from_f32(v).to_f32(),
    }
}

/// `values` as an array of `element`s.
fn array_of(element: MmaElement, values: &[f32]) -> Array {
    match element {
        MmaElement::Bf16 => bf16_array(values),
        MmaElement::F16 => Array::f16(&values.iter().map(|&v| half::f16::from_f32(v)).collect::<Vec<_>>()),
    }
}

/// Weights of `format` made from `values` (rows `row` wide): the buffer the kernels read, and
/// the weights as tensor cores multiplying `element`s take them (decoded, rounded to it: half
/// weights multiplied as halves are exact). Q8_0 blocks: each 32 values' largest over 127 as
/// the scale (an f16), the codes rounded.
fn expert_weights(values: &[f32], format: WeightFormat, element: MmaElement) -> (Array, Vec<f32>) {
    let round = |v: &[f32]| v.iter().map(|&a| rounded(element, a)).collect::<Vec<f32>>();
    match format {
        WeightFormat::Dense(Ty::Bf16) => (bf16_array(values), round(values)),
        WeightFormat::Dense(Ty::F16) => {
            let halves: Vec<half::f16> = values.iter().map(|&v| half::f16::from_f32(v)).collect();
            let widened: Vec<f32> = halves.iter().map(|h| h.to_f32()).collect();
            (Array::f16(&halves), round(&widened))
        }
        WeightFormat::Blocks(ir::DType::Q8_0) => {
            let mut bytes = Vec::new();
            for block in values.chunks(32) {
                let scale = half::f16::from_f32(block.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0);
                bytes.extend(scale.to_le_bytes());
                bytes.extend(
                    block
                        .iter()
                        .map(|&v| (v / scale.to_f32()).round().clamp(-127.0, 127.0) as i8 as u8),
                );
            }
            let mut decoded = vec![0f32; values.len()];
            models::quant::GgmlType::Q8_0.dequantize(&bytes, &mut decoded);
            (Array::u8(&bytes), round(&decoded))
        }
        other => panic!("{other:?}"),
    }
}

/// Run `kernel`; its shared-memory accesses, where it has any, one wavefront each (the
/// tensor-core kernels' tiles: rows staged a bf16 pair a thread, blocks decoded a run of 16,
/// read by `ldmatrix`).
fn shared_conflict_free(
    kernel: &kernels_gen::dsl::Kernel,
    bufs: &mut HashMap<String, Array>,
    scalars: &HashMap<String, kernels_gen::emulator::Scalar>,
    what: &str,
) {
    let traffic = kernels_gen::emulator::run_profiled(kernel, bufs, scalars).unwrap();
    for (array, t) in &traffic.0 {
        assert_eq!(t.worst, 1, "{what}: {}, {array}: {t:?}", kernel.name);
    }
}

/// The tensor-core prefill kernels against the row-by-row ones given the same inputs as the
/// tensor cores take them: `group_pairs` lists each expert's pairs in order (exactly), and
/// `list_tiles` their tiles of 64; `moe_mma::gate_up` (and for bf16 experts `moe_wgmma`'s and
/// `moe_tcgen05`'s) writes what `moe::gate_up` does for rows and weights rounded to bf16 (bf16
/// weights copied, f16 and Q8_0 ones decoded into the tile), rounded to bf16 itself
/// ([`rounded_close`]), `moe_mma::down` (and the others') what `moe::down_by_expert` does for
/// those hidden units and weights rounded to bf16, within f32 rounding (the sums go in
/// another order). Half experts multiplied as halves (the bf16 experts' kernels, all three,
/// `halves::over_halves`) likewise for rows and hidden units rounded to half and the weights
/// exact. Shapes: one expert chosen by every row (two tiles of pairs), hidden sizes and expert
/// widths below, across and past a 64-, 128-wide tile and a K step. The tensor-core kernels'
/// shared memory without bank conflicts.
#[test]
fn tensor_core_experts_match_the_row_kernels_on_rounded_inputs() {
    use kernels_gen::emulator::Scalar;
    use kernels_gen::templates::{halves, moe_mma, moe_tcgen05, moe_wgmma};
    let mut rng = Rng(54);
    let (bf16, f16) = (WeightFormat::Dense(Ty::Bf16), WeightFormat::Dense(Ty::F16));
    for (spec, d, i, format, element) in [
        (specs()[0], 48, 40, bf16, MmaElement::Bf16),
        (specs()[1], 72, 96, bf16, MmaElement::Bf16),
        (specs()[4], 136, 24, bf16, MmaElement::Bf16),
        (specs()[1], 40, 24, f16, MmaElement::Bf16),
        (
            specs()[0],
            64,
            32,
            WeightFormat::Blocks(ir::DType::Q8_0),
            MmaElement::Bf16,
        ),
        (
            specs()[4],
            96,
            64,
            WeightFormat::Blocks(ir::DType::Q8_0),
            MmaElement::Bf16,
        ),
        (specs()[1], 72, 96, f16, MmaElement::F16),
        (specs()[4], 136, 24, f16, MmaElement::F16),
    ] {
        let spec = MoeSpec {
            intermediate: i,
            ..spec
        };
        assert!(moe_mma::supports(&spec, d, format));
        let what = format!("{spec:?} {format:?} d={d} multiplied as {element:?}");
        let round = |v: &[f32]| v.iter().map(|&a| rounded(element, a)).collect::<Vec<f32>>();
        // The weights as the tensor cores' kernels take them: half weights multiplied as halves
        // by the bf16 experts' kernels over halves.
        let tiled = match element {
            MmaElement::F16 => bf16,
            MmaElement::Bf16 => format,
        };
        let over = |kernel| halves::multiplying(element, kernel);
        // The row kernels' weights: bf16 holds the bf16-rounded ones exactly, f16 the halves.
        let reference_format = match element {
            MmaElement::F16 => f16,
            MmaElement::Bf16 => bf16,
        };
        let (rows, e, k) = (80, spec.experts, spec.experts_per_token);
        let x = rng.vec(rows * d);
        let mut logits = rng.vec(rows * e);
        // Every row chooses expert 3 (its score bias too, under a grouped router): 80 pairs,
        // two tiles of them.
        for r in 0..rows {
            logits[r * e + 3] = 9.0;
        }
        let (gate_up, gate_up_taken) = expert_weights(&rng.vec(e * 2 * i * d), format, element);
        let (down, down_taken) = expert_weights(&rng.vec(e * d * i), format, element);
        let mut vector = rng.vec(e);
        vector[3] = 5.0;
        let mut bufs = routing_buffers(&logits, &vector, rows * k);
        bufs.extend([
            // Places past an expert's count are never written.
            ("expert_pairs".into(), Array::ints(Ty::I32, &vec![-7; e * rows])),
            ("expert_counts".into(), Array::poisoned(Ty::I32, e)),
        ]);
        let mut scalars = ints(&[
            ("tokens", rows as i64),
            ("logits_stride", e as i64),
            ("x_stride", d as i64),
        ]);
        scalars.insert("active".into(), Scalar::Int(1));
        run(&moe::route("route", "test", &spec), &mut bufs, &scalars).unwrap();
        run(&moe_mma::group_pairs("group", "test", &spec), &mut bufs, &scalars).unwrap();
        let routes = bufs["routes"].to_i64().unwrap();
        let (listed, counts) = (
            bufs["expert_pairs"].to_i64().unwrap(),
            bufs["expert_counts"].to_i64().unwrap(),
        );
        for expert in 0..e {
            let want: Vec<i64> = (0..rows * k)
                .filter(|&p| routes[p] == expert as i64)
                .map(|p| p as i64)
                .collect();
            assert_eq!(counts[expert], want.len() as i64, "{what}: expert {expert}");
            assert_eq!(
                &listed[expert * rows..expert * rows + want.len()],
                &want[..],
                "{what}: expert {expert}"
            );
        }
        assert_eq!(counts[3], rows as i64);
        // Each expert's tiles of 64 pairs listed in order, −1 to the bound (poisoned first: each
        // place is written).
        let bound = moe_mma::tile_bound(&spec, kernels_gen::dsl::int(rows as i64))
            .eval_int(&|_| None)
            .unwrap() as usize;
        bufs.insert("tiles".into(), Array::poisoned(Ty::I32, bound));
        run(&moe_mma::list_tiles("tiles", "test", &spec), &mut bufs, &scalars).unwrap();
        let row_tiles = rows.div_ceil(64) as i64;
        let mut want: Vec<i64> = (0..e)
            .flat_map(|expert| {
                (0..(counts[expert] as usize).div_ceil(64) as i64).map(move |t| expert as i64 * row_tiles + t)
            })
            .collect();
        assert!(
            want.len() <= bound,
            "{what}: {} tiles past the bound {bound}",
            want.len()
        );
        want.resize(bound, -1);
        assert_eq!(bufs["tiles"].to_i64().unwrap(), want, "{what}: tiles");
        // Gate/up: the tensor cores' over x's rows rounded (`bf16_rows`'s: rows padded to a
        // wider stride whose padding is NaN, never read; `x` itself NaN, never read either), the
        // row kernel's over x and the weights rounded.
        let xb_stride = d + 8;
        let xb: Vec<f32> = (0..rows * xb_stride)
            .map(|at| match at % xb_stride {
                c if c < d => x[at / xb_stride * d + c],
                _ => f32::NAN,
            })
            .collect();
        let mut scalars = scalars.clone();
        scalars.insert("xb_stride".into(), Scalar::Int(xb_stride as i64));
        bufs.insert("xb".into(), array_of(element, &xb));
        // The tensor-core kernels: `mma.sync`'s, and bf16 experts' `wgmma` (Hopper) and
        // `tcgen05` (B200) ones.
        let mut kernels = vec![(
            over(moe_mma::gate_up("mma", "test", &spec, d, tiled)),
            over(moe_mma::down("mma", "test", &spec, d, tiled)),
        )];
        if moe_wgmma::supports(&spec, d, tiled) {
            kernels.push((
                over(moe_wgmma::gate_up("wgmma", "test", &spec, d)),
                over(moe_wgmma::down("wgmma", "test", &spec, d)),
            ));
        }
        if moe_tcgen05::supports(&spec, d, tiled) {
            kernels.push((
                over(moe_tcgen05::gate_up("tcgen05", "test", &spec, d)),
                over(moe_tcgen05::down("tcgen05", "test", &spec, d)),
            ));
        }
        // Half experts multiply as halves on every target's tensor cores.
        assert_eq!(kernels.len() == 3, tiled == bf16, "{what}");
        let mut run_gate_up = |kernel: &kernels_gen::dsl::Kernel, x: &[f32], w: Array, hidden_ty: Ty| {
            bufs.insert("x".into(), Array::f32(x));
            bufs.insert("w".into(), w);
            bufs.insert("hidden".into(), Array::poisoned(hidden_ty, rows * k * i));
            shared_conflict_free(kernel, &mut bufs, &scalars, &what);
            bufs["hidden"].clone()
        };
        let want = run_gate_up(
            &moe::gate_up("rows", "test", &spec, d, reference_format),
            &round(&x),
            array_of(element, &gate_up_taken),
            Ty::F32,
        );
        let hidden: Vec<Array> = kernels
            .iter()
            .map(|(gate_up_kernel, _)| {
                let got = run_gate_up(gate_up_kernel, &vec![f32::NAN; x.len()], gate_up.clone(), element.ty());
                let what = format!("{what}: {} gate/up", gate_up_kernel.name);
                rounded_close(&got.to_f32().unwrap(), &want.to_f32().unwrap(), (element, 1e-5), &what);
                got
            })
            .collect();
        // Down: the tensor cores' over the rounded hidden units as the first gate/up left them,
        // the expert kernel's over their values and the weights rounded.
        let mut run_down = |kernel: &kernels_gen::dsl::Kernel, hidden: Array, w: Array| {
            bufs.insert("hidden".into(), hidden);
            bufs.insert("w".into(), w);
            bufs.insert("out".into(), Array::poisoned(Ty::F32, rows * d));
            bufs.insert("ys".into(), Array::poisoned(Ty::F32, rows * k * d));
            shared_conflict_free(kernel, &mut bufs, &scalars, &what);
            bufs["ys"].to_f32().unwrap()
        };
        let want = run_down(
            &moe::down_by_expert("experts", "test", &spec, d, reference_format),
            Array::f32(&hidden[0].to_f32().unwrap()),
            array_of(element, &down_taken),
        );
        for (_, down_kernel) in &kernels {
            let got = run_down(down_kernel, hidden[0].clone(), down.clone());
            close(&got, &want, 1e-5, &format!("{what}: {} down", down_kernel.name));
        }
    }
}

/// Each of `got` (values of `element`) is `want`'s value rounded to it, `want` taken anywhere
/// within `tol` of the largest (the f32 rounding of sums in another order, which may carry a
/// value across a rounding boundary).
fn rounded_close(got: &[f32], want: &[f32], (element, tol): (MmaElement, f32), what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let scale = want.iter().fold(1e-3f32, |m, v| m.max(v.abs()));
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let (lo, hi) = (rounded(element, w - tol * scale), rounded(element, w + tol * scale));
        assert!(lo <= g && g <= hi, "{what}[{i}]: {g} not {w} rounded to {element:?}");
    }
}

/// The tile list over more experts than the listing block has threads (Qwen3-Next's 512, in
/// chunks of 256): each expert's tiles in order, carried across chunks, for counts of none,
/// one pair, a whole tile and more; −1 to the bound; none listed in a step that is not active.
#[test]
fn pair_tiles_are_listed_across_chunks_of_experts() {
    use kernels_gen::emulator::Scalar;
    use kernels_gen::templates::moe_mma;
    let spec = spec(512, 10, true, MoeRouter::Softmax);
    let tokens = 1000;
    // Counts cycling through none, one pair, a tile, a tile and one, and a few (9 088 of the
    // 10 000 pairs).
    let counts: Vec<i64> = (0..spec.experts).map(|e| [0, 1, 64, 65, 7, 2, 0, 3][e % 8]).collect();
    assert!(counts.iter().sum::<i64>() <= (tokens * spec.experts_per_token) as i64);
    let bound = moe_mma::tile_bound(&spec, kernels_gen::dsl::int(tokens as i64))
        .eval_int(&|_| None)
        .unwrap() as usize;
    let row_tiles = tokens.div_ceil(64) as i64;
    let mut want: Vec<i64> = counts
        .iter()
        .enumerate()
        .flat_map(|(expert, &count)| {
            (0..(count as usize).div_ceil(64) as i64).map(move |t| expert as i64 * row_tiles + t)
        })
        .collect();
    assert!(
        want.len() <= bound && want.iter().any(|&t| t >= 256 * row_tiles),
        "tiles of the second chunk"
    );
    want.resize(bound, -1);
    for active in [1, 0] {
        let mut bufs = HashMap::from([
            ("expert_counts".into(), Array::ints(Ty::I32, &counts)),
            ("tiles".into(), Array::ints(Ty::I32, &vec![-7; bound])),
        ]);
        let mut scalars = ints(&[("tokens", tokens as i64)]);
        scalars.insert("active".into(), Scalar::Int(active));
        run(&moe_mma::list_tiles("tiles", "test", &spec), &mut bufs, &scalars).unwrap();
        let got = bufs["tiles"].to_i64().unwrap();
        match active {
            1 => assert_eq!(got, want),
            _ => assert!(got.iter().all(|&t| t == -7), "listed in an inactive step"),
        }
    }
}
