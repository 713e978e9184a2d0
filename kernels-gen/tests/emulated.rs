//! Every template, run on the emulator, against the IR reference on random data (never
//! zeros) at several shapes, ragged ones included; outputs start poisoned, so an element the
//! kernel forgets to write fails the test.

use half::bf16;
use ir::reference::ops;
use ir::{GluAct, RopeLayout, RopeSpec};
use kernels_gen::dsl::{self, Kernel, Mbarrier, RegisterChange, Stmt, Ty};
use kernels_gen::emulator::{run, Array, Scalar};
use kernels_gen::templates::gemv::GemvSpec;
use kernels_gen::templates::*;
use std::collections::HashMap;

mod common;
use common::{
    bf16_array, close, edited, ints, profile_matmul, residual_reference, rows_of, run_gemv, run_norm_gemv,
    try_run_matmul, try_run_residual_matmul, try_run_split_matmul, Residual, Rng,
};

#[test]
fn elementwise_matches_expression_semantics() {
    let expr = ir::Expr::Mul(
        Box::new(ir::Expr::Silu(Box::new(ir::Expr::Add(
            Box::new(ir::Expr::Input(0)),
            Box::new(ir::Expr::Input(1)),
        )))),
        Box::new(ir::Expr::Add(
            Box::new(ir::Expr::GeluTanh(Box::new(ir::Expr::Scale(
                Box::new(ir::Expr::Input(1)),
                0.5,
            )))),
            Box::new(ir::Expr::Sigmoid(Box::new(ir::Expr::SoftCap(
                Box::new(ir::Expr::Scale(Box::new(ir::Expr::Input(0)), 4.0)),
                1.5,
            )))),
        )),
    );
    let k = elementwise::elementwise("ew", "test", &expr);
    let mut rng = Rng(1);
    for n in [1, 255, 256, 1000] {
        let (a, b) = (rng.vec(n), rng.vec(n));
        let mut bufs = HashMap::from([
            ("in0".into(), Array::f32(&a)),
            ("in1".into(), Array::f32(&b)),
            ("out".into(), Array::poisoned(Ty::F32, n)),
        ]);
        run(
            &k,
            &mut bufs,
            &ints(&[
                ("n", n as i64),
                ("width", n as i64),
                ("in0_stride", n as i64),
                ("in1_stride", n as i64),
            ]),
        )
        .unwrap();
        let want: Vec<f32> = (0..n).map(|i| expr.eval(&[a[i], b[i]])).collect();
        close(&bufs["out"].to_f32().unwrap(), &want, 1e-5, "elementwise");
    }
}

/// A bias added to every row of a strided source (a slice of a joined projection).
#[test]
fn add_bias_adds_the_vector_to_every_row() {
    let mut rng = Rng(23);
    let (rows, width, stride) = (3, 37, 50);
    let (x, bias) = (rng.vec(rows * stride), rng.vec(width));
    let mut bufs = HashMap::from([
        ("x".into(), Array::f32(&x)),
        ("bias".into(), Array::f32(&bias)),
        ("out".into(), Array::poisoned(Ty::F32, rows * width)),
    ]);
    let scalars = ints(&[
        ("n", (rows * width) as i64),
        ("width", width as i64),
        ("x_stride", stride as i64),
    ]);
    run(&elementwise::add_bias("bias", "test"), &mut bufs, &scalars).unwrap();
    let want = ops::add_bias(&rows_of(&x, rows, width, stride), &bias);
    assert_eq!(bufs["out"].to_f32().unwrap(), want);
}

/// Rows scaled by a column of scalars (rows of a wider output) or all by one.
#[test]
fn scale_rows_scales_by_a_column_or_one_scalar() {
    let mut rng = Rng(24);
    let (rows, width, stride) = (4, 21, 30);
    let (x, column) = (rng.vec(rows * stride), rng.vec(rows * 3));
    for (s_stride, scalars) in [(3usize, column.clone()), (0, vec![column[0]])] {
        let mut bufs = HashMap::from([
            ("x".into(), Array::f32(&x)),
            ("s".into(), Array::f32(&scalars)),
            ("out".into(), Array::poisoned(Ty::F32, rows * width)),
        ]);
        let scalars_of_rows: Vec<f32> = (0..rows).map(|r| scalars[r * s_stride]).collect();
        let scalars_given = if s_stride == 0 {
            &scalars[..]
        } else {
            &scalars_of_rows[..]
        };
        let scalars = ints(&[
            ("n", (rows * width) as i64),
            ("width", width as i64),
            ("x_stride", stride as i64),
            ("s_stride", s_stride as i64),
        ]);
        run(&elementwise::scale_rows("scale", "test"), &mut bufs, &scalars).unwrap();
        let want = ops::scale_rows(&rows_of(&x, rows, width, stride), width, scalars_given);
        assert_eq!(bufs["out"].to_f32().unwrap(), want, "s_stride {s_stride}");
    }
}

#[test]
fn rms_norm_and_residual_form_match_reference() {
    let mut rng = Rng(2);
    for (groups, group) in [(1, 1), (3, 64), (2, 577), (5, 256)] {
        let (x, w) = (rng.vec(groups * group), rng.vec(group));
        let k = rms_norm::rms_norm("norm", "test", 1e-6, 1.0);
        let mut bufs = HashMap::from([
            ("x".into(), Array::f32(&x)),
            ("w".into(), Array::f32(&w)),
            ("out".into(), Array::poisoned(Ty::F32, x.len())),
        ]);
        run(
            &k,
            &mut bufs,
            &ints(&[
                ("groups", groups as i64),
                ("group", group as i64),
                ("width", group as i64),
                ("x_stride", group as i64),
            ]),
        )
        .unwrap();
        let mut want = vec![0f32; x.len()];
        ops::rms_norm(&x, &w, 1e-6, 1.0, &mut want);
        close(&bufs["out"].to_f32().unwrap(), &want, 1e-5, "rms_norm");

        let mut bufs = HashMap::from([
            ("x".into(), Array::f32(&x)),
            ("out".into(), Array::poisoned(Ty::F32, x.len())),
        ]);
        let scalars = ints(&[
            ("groups", groups as i64),
            ("group", group as i64),
            ("width", group as i64),
            ("x_stride", group as i64),
        ]);
        run(&rms_norm::unit_rms_norm("unit", "test", 1e-6), &mut bufs, &scalars).unwrap();
        let want = ops::unit_rms_norm(&x, group, 1e-6);
        close(&bufs["out"].to_f32().unwrap(), &want, 1e-5, "unit_rms_norm");

        let b = rng.vec(x.len());
        let k = rms_norm::add_rms_norm("add_norm", "test", 1e-6, 0.0);
        let mut bufs = HashMap::from([
            ("a".into(), Array::f32(&x)),
            ("b".into(), Array::f32(&b)),
            ("w".into(), Array::f32(&w)),
            ("out".into(), Array::poisoned(Ty::F32, 2 * x.len())),
        ]);
        let d = group as i64;
        run(
            &k,
            &mut bufs,
            &ints(&[("rows", groups as i64), ("d", d), ("a_stride", d), ("b_stride", d)]),
        )
        .unwrap();
        close(
            &bufs["out"].to_f32().unwrap(),
            &ops::add_rms_norm(&x, &b, &w, 1e-6, 0.0),
            1e-5,
            "add_rms_norm",
        );
    }
}

/// LayerNorm of rows read from a wider, strided source, with an offset that the mean must
/// remove (values far from 0).
#[test]
fn layer_norm_matches_reference() {
    let mut rng = Rng(25);
    for (rows, d, stride) in [(1, 1, 1), (3, 16, 20), (2, 577, 600)] {
        let x: Vec<f32> = rng.vec(rows * stride).iter().map(|v| v + 3.0).collect();
        let (w, bias) = (rng.vec(d), rng.vec(d));
        let mut bufs = HashMap::from([
            ("x".into(), Array::f32(&x)),
            ("w".into(), Array::f32(&w)),
            ("bias".into(), Array::f32(&bias)),
            ("out".into(), Array::poisoned(Ty::F32, rows * d)),
        ]);
        let scalars = ints(&[("rows", rows as i64), ("d", d as i64), ("x_stride", stride as i64)]);
        run(&rms_norm::layer_norm("ln", "test", 1e-6), &mut bufs, &scalars).unwrap();
        let want = ops::layer_norm(&rows_of(&x, rows, d, stride), &w, &bias, 1e-6);
        close(
            &bufs["out"].to_f32().unwrap(),
            &want,
            1e-4,
            &format!("layer_norm {rows}x{d}"),
        );
    }
}

/// Every GEMV variant: scalar and vector loads (k a multiple of the vector, or not), one token
/// per pass (decode) or eight (prefill, with token counts that leave a partial last pass).
#[test]
fn gemv_matches_reference_for_f32_and_bf16_weights() {
    let mut rng = Rng(3);
    for (tokens, n, k) in [
        (1, 1, 1),
        (1, 37, 100),
        (3, 9, 64),
        (2, 17, 333),
        (11, 5, 256),
        (8, 3, 40),
    ] {
        let (x, w) = (rng.vec(tokens * k), rng.vec(n * k));
        let mut want = vec![0f32; tokens * n];
        for weight in [Ty::F32, Ty::Bf16] {
            let w_used: Vec<f32> = match weight {
                Ty::Bf16 => w.iter().map(|&v| bf16::from_f32(v).to_f32()).collect(),
                _ => w.clone(),
            };
            ops::matmul(&x, &w_used, k, &mut want);
            let wbuf = match weight {
                Ty::Bf16 => bf16_array(&w),
                _ => Array::f32(&w),
            };
            let decode = GemvSpec::decode(quant::WeightFormat::Dense(weight), k);
            let x_vectors = decode.with_x_vectors();
            // The plain GEMV prefetching its weights as the norm-prologue ones do.
            let prefetching = x_vectors.with_prefetch_steps(gemv::PREFETCH_STEPS);
            for spec in [decode, decode.prefill(), x_vectors, x_vectors.prefill(), prefetching] {
                let run = |spec| run_gemv(&gemv::gemv("gemv", "test", spec), &x, wbuf.clone(), (tokens, n, k, k));
                matches_with_any_rows_per_warp(spec, &want, "gemv", run);
            }
        }
    }
}

/// `run(spec)` (a GEMV's output) close to `want`; and with 2, 3 and 4 weight rows a warp,
/// where `spec`'s weights allow more than one, the same bits as with one: sharing activation
/// loads among a warp's rows changes no row's order of sums (each element compared by its
/// bits; `out` is poisoned before a launch, so a row left unwritten differs too).
fn matches_with_any_rows_per_warp(spec: GemvSpec, want: &[f32], what: &str, run: impl Fn(GemvSpec) -> Array) {
    let one_row = run(spec).to_f32().unwrap();
    close(&one_row, want, 1e-5, &format!("{what} {spec:?}"));
    let sharing = (2..=gemv::MAX_ROWS_PER_WARP)
        .map(|rows| spec.with_rows_per_warp(rows))
        .filter(|shared| shared.rows_per_warp > 1);
    for spec in sharing {
        let out = run(spec).to_f32().unwrap();
        assert_eq!(out.len(), one_row.len(), "{what} {spec:?}");
        for (i, (a, b)) in out.iter().zip(&one_row).enumerate() {
            assert_eq!(
                a.to_bits(),
                b.to_bits(),
                "{what} {spec:?}: element {i}: {a} against {b} with one row a warp"
            );
        }
    }
}

#[test]
fn glu_matches_reference() {
    let mut rng = Rng(4);
    for (tokens, n) in [(1, 1), (2, 300), (3, 17)] {
        let x = rng.vec(tokens * 2 * n);
        for act in [GluAct::Silu, GluAct::GeluTanh] {
            let k = glu::glu("glu", "test", act);
            let mut bufs = HashMap::from([
                ("x".into(), Array::f32(&x)),
                ("out".into(), Array::poisoned(Ty::F32, tokens * n)),
            ]);
            run(
                &k,
                &mut bufs,
                &ints(&[("tokens", tokens as i64), ("n", n as i64), ("x_stride", 2 * n as i64)]),
            )
            .unwrap();
            close(&bufs["out"].to_f32().unwrap(), &ops::glu(&x, 2 * n, act), 1e-5, "glu");
        }
    }
}

#[test]
fn rope_matches_reference_for_every_layout_and_partial_rotation() {
    let mut rng = Rng(5);
    for layout in [
        RopeLayout::RotateHalf,
        RopeLayout::AdjacentPairs,
        RopeLayout::Proportional,
    ] {
        // The last with YaRN: blended frequencies, cos and sin times its attention factor.
        let yarn = ir::RopeScaling::Yarn {
            factor: 4.0,
            original_context: 64.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
            attention_factor: 0.1 * 4f64.ln() + 1.0,
        };
        for (heads, head_dim, rotary_dim, scaling) in [
            (2, 8, 8, ir::RopeScaling::None),
            (3, 16, 4, ir::RopeScaling::None),
            (1, 64, 64, ir::RopeScaling::None),
            (2, 16, 16, yarn),
        ] {
            let spec = RopeSpec {
                heads,
                head_dim,
                rotary_dim,
                theta: 10_000.0,
                position_scale: 1.0,
                layout,
                scaling,
            };
            let tokens = 3;
            let x = rng.vec(tokens * heads * head_dim);
            let positions = [0usize, 7, 41];
            let k = rope::rope("rope", "test", rope::Rotation::of(&spec));
            let mut bufs = HashMap::from([
                ("x".into(), Array::f32(&x)),
                ("positions".into(), Array::ints(Ty::I32, &positions.map(|p| p as i64))),
                ("inv_freq".into(), Array::f32(&ops::rope_inv_freq(&spec))),
                ("out".into(), Array::poisoned(Ty::F32, x.len())),
            ]);
            let scalars = ints(&[
                ("tokens", tokens as i64),
                ("width", (heads * head_dim) as i64),
                ("head_dim", head_dim as i64),
                ("rotary_dim", rotary_dim as i64),
                ("x_stride", (heads * head_dim) as i64),
            ]);
            run(&k, &mut bufs, &scalars).unwrap();
            let mut want = x.clone();
            ops::rope(&spec, &mut want, &positions);
            close(&bufs["out"].to_f32().unwrap(), &want, 1e-5, "rope");
        }
    }
}

#[test]
fn embedding_gathers_and_scales() {
    let mut rng = Rng(6);
    let (vocab, d) = (11, 13);
    let table = rng.vec(vocab * d);
    let ids = [3i64, 0, 10, 3];
    let k = embedding::embedding("embed", "test", quant::WeightFormat::Dense(Ty::F32));
    let mut bufs = HashMap::from([
        ("w".into(), Array::f32(&table)),
        ("ids".into(), Array::ints(Ty::I32, &ids)),
        ("out".into(), Array::poisoned(Ty::F32, ids.len() * d)),
    ]);
    let mut scalars = ints(&[("tokens", ids.len() as i64), ("d", d as i64)]);
    scalars.insert("scale".into(), Scalar::F32(2.5));
    run(&k, &mut bufs, &scalars).unwrap();
    let want: Vec<f32> = ids
        .iter()
        .flat_map(|&i| table[i as usize * d..(i as usize + 1) * d].iter().map(|v| v * 2.5))
        .collect();
    close(&bufs["out"].to_f32().unwrap(), &want, 0.0, "embedding");
}

#[test]
fn top_k_matches_reference_with_ties_and_nan() {
    let mut rng = Rng(7);
    for v in [1, 5, 256, 1000, 3001, 8300] {
        let mut logits = rng.vec(2 * v);
        // Ties in the second row at its maximum and below it, and a NaN.
        if v > 10 {
            let m = logits[v..].iter().cloned().fold(f32::NEG_INFINITY, f32::max) + 1.0;
            logits[v + 9] = m;
            logits[v + 3] = m;
            logits[v + 7] = m - 0.5;
            logits[v + 2] = m - 0.5;
            logits[v + 1] = f32::NAN;
        }
        // Ties among one thread's elements: in one group of loads (32 a thread, 256 threads)
        // and in the next.
        if v > 8200 {
            let m = logits[v + 9];
            logits[v + 3 + 256] = m;
            logits[v + 3 + 8192] = m;
        }
        for k in [1, 5] {
            let k = k.min(v);
            let kernel = top_k::top_k("top_k", "test");
            let mut bufs = HashMap::from([
                ("logits".into(), Array::f32(&logits)),
                ("out".into(), Array::poisoned(Ty::I32, 2 * k)),
            ]);
            run(
                &kernel,
                &mut bufs,
                &ints(&[("rows", 2), ("v", v as i64), ("k", k as i64)]),
            )
            .unwrap();
            let want: Vec<i64> = (0..2)
                .flat_map(|r| ops::top_k(&logits[r * v..(r + 1) * v], k))
                .map(|i| i as i64)
                .collect();
            assert_eq!(bufs["out"].to_i64().unwrap(), want, "v = {v}, k = {k}");
        }
    }
    // A row of NaN only ranks them all as −∞: lowest indices first, as the reference does.
    let kernel = top_k::top_k("top_k", "test");
    let mut bufs = HashMap::from([
        ("logits".into(), Array::f32(&[f32::NAN; 4])),
        ("out".into(), Array::poisoned(Ty::I32, 3)),
    ]);
    run(&kernel, &mut bufs, &ints(&[("rows", 1), ("v", 4), ("k", 3)])).unwrap();
    assert_eq!(bufs["out"].to_i64().unwrap(), vec![0, 1, 2]);
}

#[test]
fn gather_rows_picks_the_indexed_rows_of_a_strided_source() {
    let mut rng = Rng(21);
    let (rows_in, width, stride) = (9, 13, 17);
    let src = rng.vec(rows_in * stride);
    let index = [8i64, 0, 3, 3];
    let mut bufs = HashMap::from([
        ("src".into(), Array::f32(&src)),
        ("index".into(), Array::ints(Ty::I32, &index)),
        ("out".into(), Array::poisoned(Ty::F32, index.len() * width)),
    ]);
    let scalars = ints(&[
        ("rows", index.len() as i64),
        ("width", width as i64),
        ("src_stride", stride as i64),
    ]);
    run(&gather::gather_rows("gather", "test"), &mut bufs, &scalars).unwrap();
    let want: Vec<f32> = index
        .iter()
        .flat_map(|&r| src[r as usize * stride..r as usize * stride + width].to_vec())
        .collect();
    assert_eq!(bufs["out"].to_f32().unwrap(), want);
}

/// The device fill equals the host's `uniform` element for element (bf16: rounded once), from
/// any base index, and its values spread over [offset - scale, offset + scale).
/// Columns of every group side by side, from a strided source (a slice of a wider row): the
/// reference's `group_slice` of each row's slice.
#[test]
fn gather_column_groups_matches_group_slice() {
    let mut rng = Rng(22);
    for (rows, groups, group, start, len, offset, stride) in [(3, 4, 64, 0, 32, 0, 256), (5, 3, 10, 7, 3, 5, 41)] {
        let src = rng.vec(rows * stride);
        let width = groups * len;
        let mut bufs = HashMap::from([
            ("src".into(), Array::f32(&src[offset..])),
            ("out".into(), Array::poisoned(Ty::F32, rows * width)),
        ]);
        let scalars = ints(&[
            ("rows", rows as i64),
            ("width", width as i64),
            ("src_stride", stride as i64),
            ("group", group as i64),
            ("start", start as i64),
            ("len", len as i64),
        ]);
        run(&gather::gather_column_groups("groups", "test"), &mut bufs, &scalars).unwrap();
        let want: Vec<f32> = (0..rows)
            .flat_map(|r| ops::group_slice(&src[offset + r * stride..][..groups * group], group, start, len))
            .collect();
        assert_eq!(bufs["out"].to_f32().unwrap(), want);
    }
}

/// Each row's columns in an order, from a strided source: the reference's `permute_columns`
/// of each row's slice, for orders that reverse, shuffle and keep the columns.
#[test]
fn gather_columns_matches_permute_columns() {
    let mut rng = Rng(24);
    for (rows, width, stride, offset) in [(3, 64, 64, 0), (5, 40, 97, 9)] {
        let src = rng.vec(rows * stride + offset);
        let reversed: Vec<usize> = (0..width).rev().collect();
        let shuffled: Vec<usize> = (0..width).map(|j| (j * 7 + 3) % width).collect();
        let kept: Vec<usize> = (0..width).collect();
        for order in [reversed, shuffled, kept] {
            let index: Vec<i64> = order.iter().map(|&c| c as i64).collect();
            let mut bufs = HashMap::from([
                ("src".into(), Array::f32(&src[offset..])),
                ("order".into(), Array::ints(Ty::I32, &index)),
                ("out".into(), Array::poisoned(Ty::F32, rows * width)),
            ]);
            let scalars = ints(&[
                ("rows", rows as i64),
                ("width", width as i64),
                ("src_stride", stride as i64),
            ]);
            run(&gather::gather_columns("columns", "test"), &mut bufs, &scalars).unwrap();
            let want = ops::permute_columns(&rows_of(&src[offset..], rows, width, stride), &order);
            assert_eq!(bufs["out"].to_f32().unwrap(), want);
        }
    }
}

/// Two strided sources' rows side by side: the reference's `concat_columns` of each one's
/// rows (slices of wider rows, as the plan's views hand them over).
#[test]
fn concat_columns_matches_the_reference() {
    let mut rng = Rng(23);
    for (rows, a_width, b_width, a_stride, b_stride) in [(1, 64, 64, 64, 64), (5, 7, 12, 9, 40)] {
        let (a, b) = (rng.vec(rows * a_stride), rng.vec(rows * b_stride));
        let width = a_width + b_width;
        let mut bufs = HashMap::from([
            ("a".into(), Array::f32(&a)),
            ("b".into(), Array::f32(&b)),
            ("out".into(), Array::poisoned(Ty::F32, rows * width)),
        ]);
        let scalars = ints(&[
            ("rows", rows as i64),
            ("width", width as i64),
            ("a_width", a_width as i64),
            ("a_stride", a_stride as i64),
            ("b_stride", b_stride as i64),
        ]);
        run(&gather::concat_columns("concat", "test"), &mut bufs, &scalars).unwrap();
        let want = ops::concat_columns(
            &rows_of(&a, rows, a_width, a_stride),
            a_width,
            &rows_of(&b, rows, b_width, b_stride),
            b_width,
        );
        assert_eq!(bufs["out"].to_f32().unwrap(), want);
    }
}

/// A shortlist's candidates rescored with the full head (bf16 rows): each the f32 dot of its
/// row's `h` (a strided source) and the head's row; then each row's best candidate, ties to
/// the lowest id whatever their order.
#[test]
fn shortlist_rescores_candidates_and_picks_the_best_lowest_id_first() {
    let mut rng = Rng(24);
    let (rows, c, k, vocab, h_stride) = (3usize, 5usize, 64usize, 20usize, 70usize);
    let h = rng.vec(rows * h_stride);
    let head: Vec<bf16> = rng.vec(vocab * k).into_iter().map(bf16::from_f32).collect();
    let candidates: Vec<i64> = (0..rows * c).map(|t| ((t * 7 + 3) % vocab) as i64).collect();
    let mut bufs = HashMap::from([
        ("h".into(), Array::f32(&h)),
        ("w".into(), Array::bf16(&head)),
        ("candidates".into(), Array::ints(Ty::I32, &candidates)),
        ("out".into(), Array::poisoned(Ty::F32, rows * c)),
    ]);
    let scalars = ints(&[
        ("items", (rows * c) as i64),
        ("c", c as i64),
        ("k", k as i64),
        ("h_stride", h_stride as i64),
    ]);
    let rescore = shortlist::rescore("rescore", "test", quant::WeightFormat::Dense(Ty::Bf16));
    run(&rescore, &mut bufs, &scalars).unwrap();
    let got = bufs["out"].to_f32().unwrap();
    for (t, &id) in candidates.iter().enumerate() {
        let x = &h[t / c * h_stride..][..k];
        let w: Vec<f32> = head[id as usize * k..][..k].iter().map(|v| v.to_f32()).collect();
        let want = ops::dot(x, &w) as f32;
        assert!(
            (got[t] - want).abs() <= 1e-5 * want.abs().max(1.0),
            "candidate {t}: {} vs {want}",
            got[t]
        );
    }
    // Row 0 ties at its best between ids 9 and 4 (in that order); row 1's best is alone.
    let scores = [1.0, 3.0, 3.0, 2.0, 0.0, -1.0, -5.0, -0.5, -2.0, -0.75];
    let ids = [7i64, 9, 4, 1, 2, 3, 8, 6, 0, 5];
    let mut bufs = HashMap::from([
        ("scores".into(), Array::f32(&scores)),
        ("candidates".into(), Array::ints(Ty::I32, &ids)),
        ("out".into(), Array::poisoned(Ty::I32, 2)),
    ]);
    run(
        &shortlist::best("best", "test"),
        &mut bufs,
        &ints(&[("rows", 2), ("c", 5)]),
    )
    .unwrap();
    assert_eq!(bufs["out"].to_i64().unwrap(), vec![4, 6]);
}

#[test]
fn fill_uniform_makes_the_hosts_values_from_any_base() {
    let (n, base, seed, offset, scale) = (1000usize, 7_000_000i64, 42i64, 0.5f32, 0.25f32);
    for ty in [Ty::F32, Ty::Bf16, Ty::F16, Ty::F8E4M3] {
        let mut bufs = HashMap::from([("out".to_string(), Array::poisoned(ty, n))]);
        let mut scalars = ints(&[("n", n as i64), ("base", base), ("seed", seed)]);
        scalars.insert("offset".into(), Scalar::F32(offset));
        scalars.insert("scale".into(), Scalar::F32(scale));
        run(&fill::fill_uniform("fill", "test", ty), &mut bufs, &scalars).unwrap();
        let got = bufs["out"].to_f32().unwrap();
        let want: Vec<f32> = (0..n)
            .map(|i| fill::uniform(seed as u32, (base as usize + i) as u32, offset, scale))
            .map(|v| match ty {
                Ty::Bf16 => bf16::from_f32(v).to_f32(),
                Ty::F16 => half::f16::from_f32(v).to_f32(),
                Ty::F8E4M3 => ir::F8E4M3::from_f32(v).to_f32(),
                _ => v,
            })
            .collect();
        assert_eq!(got, want, "{ty:?}");
        assert!(want.iter().all(|v| (offset - scale..=offset + scale).contains(v)));
        let mean = want.iter().sum::<f32>() / n as f32;
        assert!((mean - offset).abs() < 0.05 * scale * 4.0, "mean {mean}");
        let below = want.iter().filter(|&&v| v < offset).count();
        assert!((400..600).contains(&below), "{below} of {n} below the middle");
    }
    // Another seed, other values.
    assert_ne!(fill::uniform(1, 5, 0.0, 1.0), fill::uniform(2, 5, 0.0, 1.0));
}

#[test]
fn attention_matches_reference_with_windows_groups_and_long_caches() {
    let mut rng = Rng(8);
    use kernels_gen::templates::cache_layout::CacheLayout;
    for (tokens, first, heads, kv_heads, head_dim, window) in [
        (1, 0, 2, 1, 8, 0),
        (1, 300, 4, 2, 16, 0),
        (2, 33, 8, 2, 32, 0),
        (3, 5, 2, 2, 8, 4),
        (2, 520, 2, 1, 32, 300),
        // A head_dim past one warp's width that is not a multiple of it (the last lane dims
        // guarded), Gemma 3's 256 and Gemma 4's global 512 (heads of 2 query heads each).
        (2, 40, 2, 1, 80, 0),
        (1, 70, 2, 2, 256, 0),
        (2, 45, 4, 2, 512, 0),
    ] {
        let len = first + tokens;
        let (q, k, v) = (
            rng.vec(tokens * heads * head_dim),
            rng.vec(len * kv_heads * head_dim),
            rng.vec(len * kv_heads * head_dim),
        );
        let want = attention_reference((&q, &k, &v), (first, heads, kv_heads, head_dim, window));
        let mut scalars = ints(&[
            ("tokens", tokens as i64),
            ("q_stride", (heads * head_dim + 5) as i64),
            ("first", first as i64),
            ("heads", heads as i64),
            ("kv_heads", kv_heads as i64),
            ("window", window as i64),
        ]);
        scalars.insert("scale".into(), Scalar::F32(0.3));
        // The query rows inside wider rows (Q as a slice of the joined ropes' output).
        let q_rows: Vec<f32> = q
            .chunks(heads * head_dim)
            .flat_map(|row| row.iter().copied().chain([9.0; 5]))
            .collect();
        // One split, the plans' count, and more splits than some rows have keys; a head per
        // block, and the KV head's whole group (what the plans take, registers allowing).
        let groups = [1, attention::heads_per_block(heads, kv_heads, head_dim)];
        for (splits, group) in [1, attention::splits_for(tokens), 7]
            .into_iter()
            .flat_map(|s| groups.map(|g| (s, g)))
        {
            let mut bufs = HashMap::from([
                ("q".into(), Array::f32(&q_rows)),
                ("k".into(), Array::f32(&k)),
                ("v".into(), Array::f32(&v)),
            ]);
            for kernel in split_passes(CacheLayout::Contiguous, head_dim, group, Ty::F32) {
                let out = run_attention(&kernel, &mut bufs, &scalars, (tokens, heads, head_dim), splits);
                close(&out, &want, 1e-5, &format!("{}, {splits} splits", kernel.origin));
            }
        }
    }
}

/// The tensor-core prefill attention against the reference on bf16-rounded queries, keys and
/// values: one and several query tiles (ragged), a cached prefix before the chunk, grouped KV
/// heads, a window, head dims 16 to 256, the cache contiguous and paged (blocks shuffled); on
/// `mma.sync` and, for heads up to 128 dims, on Hopper's `wgmma` and the B200's `tcgen05`
/// (by TMA at 64 and 128); and on `mma.sync` over FP8 caches (`flash_attention_over`: the
/// codes copied as stored and each tile widened to bf16 in shared memory, or past 128 dims
/// loaded widened), heads of 16 to 256. Its
/// probabilities meet the values rounded to bf16 (the tensor cores' operand), so it agrees to
/// bf16's precision (errors up to 1.2e-3 of the largest output here), not f32's.
#[test]
fn flash_attention_matches_reference() {
    use kernels_gen::templates::cache_layout::CacheLayout;
    let mut rng = Rng(41);
    let round = |v: &[f32]| v.iter().map(|&a| bf16::from_f32(a).to_f32()).collect::<Vec<_>>();
    let bf16_cases = [
        (20, 0, 2, 1, 16, 0),
        (70, 37, 4, 2, 64, 0),
        (130, 0, 2, 2, 32, 50),
        (9, 100, 2, 1, 128, 0),
        (17, 3, 2, 1, 256, 0),
        (33, 5, 2, 1, 96, 0),
        // A window past a tile at a head TMA's boxes take: the blocks' first tiles past 0.
        (150, 20, 2, 1, 128, 100),
        // Rows past two 128-key tiles, which every row sees whole (no mask), then one that
        // the causal mask cuts; and behind a window, tiles it cuts, one it leaves whole, one
        // the causal mask cuts.
        (9, 300, 2, 1, 64, 0),
        (20, 400, 2, 1, 32, 200),
    ];
    let narrow_cases = [
        (20, 0, 2, 1, 16, 0),
        (70, 37, 4, 2, 64, 0),
        (9, 100, 2, 1, 128, 50),
        (17, 3, 2, 1, 256, 0),
    ];
    let cases = bf16_cases
        .map(|c| (c, Ty::Bf16))
        .into_iter()
        .chain(narrow_cases.map(|c| (c, Ty::F8E4M3)))
        .chain(narrow_cases.map(|c| (c, Ty::F16)));
    for ((tokens, first, heads, kv_heads, head_dim, window), cache) in cases {
        let len = first + tokens;
        let stored = |v: &[f32]| stored_in(cache, v);
        // Queries as the tensor cores take them: a half cache's kernels round them to half.
        let q = match cache {
            Ty::F16 => stored(&rng.vec(tokens * heads * head_dim)),
            _ => round(&rng.vec(tokens * heads * head_dim)),
        };
        let (k, v) = (
            stored(&rng.vec(len * kv_heads * head_dim)),
            stored(&rng.vec(len * kv_heads * head_dim)),
        );
        let pool = |values: &[f32]| cache_array(cache, values);
        let want = attention_reference((&q, &k, &v), (first, heads, kv_heads, head_dim, window));
        let q_stride = heads * head_dim + 8;
        let q_rows: Vec<f32> = q
            .chunks(heads * head_dim)
            .flat_map(|row| row.iter().copied().chain([9.0; 8]))
            .collect();
        let mut scalars = ints(&[
            ("tokens", tokens as i64),
            ("q_stride", q_stride as i64),
            ("first", first as i64),
            ("heads", heads as i64),
            ("kv_heads", kv_heads as i64),
            ("window", window as i64),
        ]);
        scalars.insert("scale".into(), Scalar::F32(0.3));
        for (layout, (kernel, _)) in [CacheLayout::Contiguous, CacheLayout::Paged]
            .into_iter()
            .flat_map(|layout| {
                flash_kernels_over(layout, (head_dim, cache))
                    .into_iter()
                    .map(move |k| (layout, k))
            })
        {
            let row = kv_heads * head_dim;
            let mut bufs = HashMap::from([
                ("q".into(), Array::f32(&q_rows)),
                ("out".into(), Array::poisoned(Ty::F32, tokens * heads * head_dim)),
            ]);
            let mut scalars = scalars.clone();
            match layout {
                CacheLayout::Paged => {
                    let block_size = 16;
                    let (table, paged_k, paged_v) = reversed_pages((&k, &v), row, block_size);
                    bufs.insert("k".into(), pool(&paged_k));
                    bufs.insert("v".into(), pool(&paged_v));
                    bufs.insert("block_table".into(), Array::ints(Ty::I32, &table));
                    scalars.insert("block_size".into(), Scalar::Int(block_size as i64));
                    scalars.insert("cache_rows".into(), Scalar::Int((paged_k.len() / row) as i64));
                    scalars.insert("cache_width".into(), Scalar::Int(row as i64));
                }
                _ => {
                    bufs.insert("k".into(), pool(&k));
                    bufs.insert("v".into(), pool(&v));
                    scalars.insert("cache_rows".into(), Scalar::Int(len as i64));
                    scalars.insert("cache_width".into(), Scalar::Int(row as i64));
                }
            }
            run(&kernel, &mut bufs, &scalars)
                .unwrap_or_else(|e| panic!("{tokens}×{head_dim} {layout:?}: {e}\n{}", kernel.origin));
            close(
                &bufs["out"].to_f32().unwrap(),
                &want,
                probabilities_tolerance(cache),
                &format!(
                    "flash attention {tokens} rows from {first}, head_dim {head_dim}, window {window}, {layout:?}\n{}",
                    kernel.origin
                ),
            );
        }
    }
}

/// FP8 codes, as an FP8 KV cache stores them (each value rounded as `ir::F8E4M3` rounds).
fn fp8_array(values: &[f32]) -> Array {
    let codes: Vec<u8> = values.iter().map(|&x| ir::F8E4M3::from_f32(x).0).collect();
    Array::from_le_bytes(Ty::F8E4M3, &codes)
}

/// A KV cache of `cache` elements (bf16, f16 or FP8) holding `values`, each rounded as stored.
fn cache_array(cache: Ty, values: &[f32]) -> Array {
    match cache {
        Ty::F8E4M3 => fp8_array(values),
        Ty::F16 => Array::f16(&values.iter().map(|&v| half::f16::from_f32(v)).collect::<Vec<_>>()),
        _ => bf16_array(values),
    }
}

/// `values` as a cache of `cache` elements holds them.
fn stored_in(cache: Ty, values: &[f32]) -> Vec<f32> {
    let dtype = match cache {
        Ty::F8E4M3 => ir::DType::F8E4M3,
        Ty::F16 => ir::DType::F16,
        _ => ir::DType::BF16,
    };
    values.iter().map(|&a| ops::stored_as(a, dtype)).collect()
}

/// How far the tensor-core attention may stray from the reference, of the largest output:
/// its probabilities meet the values rounded to bf16 (errors up to 1.2e-3 here), or over a
/// half cache to half, whose three more bits hold it within 3e-4 (bf16 probabilities would
/// stray past that).
fn probabilities_tolerance(cache: Ty) -> f32 {
    match cache {
        Ty::F16 => 3e-4,
        _ => 2e-3,
    }
}

/// The tensor-core attention over a batched step (the serving plans' paged pool): sequences
/// with a cached prefix and without, one of a single row (a decode row beside prompt chunks),
/// one longer than a query tile (of either kernel), each with its own shuffled blocks in one
/// pool; the rows concatenated as a step orders them. Each sequence's rows against the
/// reference over its own cache; the spare tiles of the grid write nothing (the output starts
/// poisoned but for the rows, which all must be written). On `mma.sync` and Hopper's `wgmma`
/// over a bf16 pool, and on `mma.sync` over an FP8 one.
#[test]
fn flash_attention_over_a_batched_step_matches_reference() {
    use kernels_gen::templates::cache_layout::CacheLayout;
    let mut rng = Rng(43);
    let round = |v: &[f32]| v.iter().map(|&a| bf16::from_f32(a).to_f32()).collect::<Vec<_>>();
    // (rows this step, positions cached before them)
    let sequences = [(150usize, 37usize), (1, 20), (16, 0), (5, 100)];
    let shapes = [(4, 2, 32, 0), (2, 1, 16, 24), (2, 1, 64, 0)];
    let caches = shapes
        .map(|s| (s, Ty::Bf16))
        .into_iter()
        .chain([((4, 2, 32, 0), Ty::F8E4M3), ((2, 1, 16, 24), Ty::F8E4M3)])
        .chain([((4, 2, 32, 0), Ty::F16), ((2, 1, 16, 24), Ty::F16)]);
    for ((heads, kv_heads, head_dim, window), cache) in caches {
        let stored = |v: &[f32]| stored_in(cache, v);
        let row = kv_heads * head_dim;
        let block_size = 16;
        let (mut pool_k, mut pool_v) = (Vec::new(), Vec::new());
        let (mut tables, mut row_table, mut row_pos) = (Vec::new(), Vec::new(), Vec::new());
        let (mut q_rows, mut want) = (Vec::new(), Vec::new());
        for &(rows, first) in &sequences {
            let len = first + rows;
            let q = match cache {
                Ty::F16 => stored(&rng.vec(rows * heads * head_dim)),
                _ => round(&rng.vec(rows * heads * head_dim)),
            };
            let (k, v) = (stored(&rng.vec(len * row)), stored(&rng.vec(len * row)));
            want.extend(attention_reference(
                (&q, &k, &v),
                (first, heads, kv_heads, head_dim, window),
            ));
            q_rows.extend(q);
            // This sequence's blocks: fresh ones at the pool's end, in reverse order.
            let blocks = len.div_ceil(block_size);
            let base = pool_k.len() / (block_size * row);
            let table: Vec<usize> = (0..blocks).map(|b| base + blocks - 1 - b).collect();
            pool_k.resize((base + blocks) * block_size * row, 0.0);
            pool_v.resize((base + blocks) * block_size * row, 0.0);
            for p in 0..len {
                let at = (table[p / block_size] * block_size + p % block_size) * row;
                pool_k[at..at + row].copy_from_slice(&k[p * row..(p + 1) * row]);
                pool_v[at..at + row].copy_from_slice(&v[p * row..(p + 1) * row]);
            }
            row_table.extend(std::iter::repeat_n(tables.len() as i64, rows));
            row_pos.extend((first..len).map(|p| p as i64));
            tables.extend(table.iter().map(|&b| b as i64));
        }
        let tokens: usize = sequences.iter().map(|s| s.0).sum();
        let segment_rows: Vec<usize> = sequences.iter().map(|s| s.0).collect();
        let pool = |values: &[f32]| cache_array(cache, values);
        let bufs = HashMap::from([
            ("q".into(), Array::f32(&q_rows)),
            ("k".into(), pool(&pool_k)),
            ("v".into(), pool(&pool_v)),
            ("out".into(), Array::poisoned(Ty::F32, tokens * heads * head_dim)),
            ("block_tables".into(), Array::ints(Ty::I32, &tables)),
            ("row_table".into(), Array::ints(Ty::I32, &row_table)),
            ("row_pos".into(), Array::ints(Ty::I32, &row_pos)),
        ]);
        let mut scalars = ints(&[
            ("tokens", tokens as i64),
            ("q_stride", (heads * head_dim) as i64),
            ("first", 0),
            ("heads", heads as i64),
            ("kv_heads", kv_heads as i64),
            ("window", window as i64),
            ("block_size", block_size as i64),
            ("seqs", sequences.len() as i64),
            ("cache_rows", (pool_k.len() / row) as i64),
            ("cache_width", row as i64),
        ]);
        scalars.insert("scale".into(), Scalar::F32(0.3));
        for (kernel, tile_rows) in flash_kernels_over(CacheLayout::Batched, (head_dim, cache)) {
            let mut bufs = bufs.clone();
            let tiles: Vec<i64> = flash_attention::query_tiles(&segment_rows, tile_rows)
                .iter()
                .map(|&t| t as i64)
                .collect();
            bufs.insert("query_tiles".into(), Array::ints(Ty::I32, &tiles));
            run(&kernel, &mut bufs, &scalars).unwrap_or_else(|e| panic!("head_dim {head_dim}: {e}\n{}", kernel.origin));
            close(
                &bufs["out"].to_f32().unwrap(),
                &want,
                probabilities_tolerance(cache),
                &format!(
                    "batched flash attention, head_dim {head_dim}, window {window}\n{}",
                    kernel.origin
                ),
            );
        }
    }
}

/// The tensor-core kernels move data through shared memory without bank conflicts, as the
/// emulator counts them (`run_profiled`: every warp's access one wavefront a phase): each
/// prefill attention at 64, 128 and 256 dims, the `mma.sync` one's key, value and (past 128
/// dims) query `ldmatrix` loads (rows 16 bytes longer than the head; rows of 256 bytes took 8
/// wavefronts a key load), also over FP8 caches from 16 dims (copied rows 16 or 32 bytes
/// longer; the widening's 8-byte loads and 16-byte stores, 8 keys' same dims a phase),
/// the queries the `wgmma` and `tcgen05` ones store and the probabilities `tcgen05`'s stores
/// (16-byte stores; 2-byte ones 16 bytes apart took 4); the decode split passes' merges of
/// their warps' states (the vector pass's accumulators 2, below); and the `mma.sync` GEMMs'
/// activation and weight tiles (staged with padding, or read from TMA's swizzled boxes).
#[test]
fn shared_memory_accesses_meet_no_bank_conflicts() {
    use kernels_gen::emulator::{run_profiled, SharedTraffic};
    use kernels_gen::templates::cache_layout::CacheLayout;
    let conflict_free = |traffic: &SharedTraffic, what: &str| {
        assert!(!traffic.0.is_empty(), "{what}: no shared traffic");
        for (array, t) in &traffic.0 {
            assert_eq!(t.worst, 1, "{what}, {array}: {t:?}");
        }
    };
    let mut rng = Rng(5);
    let round = |v: &[f32]| v.iter().map(|&a| bf16::from_f32(a).to_f32()).collect::<Vec<_>>();
    let caches = [64, 128, 256]
        .map(|d| (d, Ty::Bf16))
        .into_iter()
        .chain([16, 64, 128, 256].map(|d| (d, Ty::F8E4M3)))
        .chain([64, 128, 256].map(|d| (d, Ty::F16)));
    for (head_dim, cache) in caches {
        let (tokens, heads) = (70, 2);
        let (q, k, v) = (
            round(&rng.vec(tokens * heads * head_dim)),
            round(&rng.vec(tokens * head_dim)),
            round(&rng.vec(tokens * head_dim)),
        );
        let pool = |values: &[f32]| cache_array(cache, values);
        let mut scalars = ints(&[
            ("tokens", tokens as i64),
            ("q_stride", (heads * head_dim) as i64),
            ("first", 0),
            ("heads", heads as i64),
            ("kv_heads", 1),
            ("window", 0),
            ("cache_rows", tokens as i64),
            ("cache_width", head_dim as i64),
        ]);
        scalars.insert("scale".into(), Scalar::F32(0.3));
        for (kernel, _) in flash_kernels_over(CacheLayout::Contiguous, (head_dim, cache)) {
            let mut bufs = HashMap::from([
                ("q".into(), Array::f32(&q)),
                ("k".into(), pool(&k)),
                ("v".into(), pool(&v)),
                ("out".into(), Array::poisoned(Ty::F32, tokens * heads * head_dim)),
            ]);
            let traffic = run_profiled(&kernel, &mut bufs, &scalars).unwrap();
            conflict_free(&traffic, &format!("head_dim {head_dim}: {}", kernel.origin));
        }
    }
    // The decode steps' split passes over a 128-dim bf16 cache: their warps' states merged
    // through shared memory. The vector pass's accumulators leave each lane in 16-byte stores
    // of a lane's 8 floats, 32 bytes on from the next lane's: a phase's 8 lanes span 256
    // bytes, 2 wavefronts.
    let (heads, kv_heads, head_dim, tokens, first) = (8, 2, 128, 2, 300);
    let len = first + tokens;
    let (q, k, v) = (
        rng.vec(tokens * heads * head_dim),
        round(&rng.vec(len * kv_heads * head_dim)),
        round(&rng.vec(len * kv_heads * head_dim)),
    );
    let mut scalars = ints(&[
        ("tokens", tokens as i64),
        ("q_stride", (heads * head_dim) as i64),
        ("first", first as i64),
        ("heads", heads as i64),
        ("kv_heads", kv_heads as i64),
        ("window", 0),
        ("splits", 4),
    ]);
    scalars.insert("scale".into(), Scalar::F32(0.1));
    for pass in split_passes(CacheLayout::Contiguous, head_dim, 4, Ty::Bf16) {
        let mut bufs = HashMap::from([
            ("q".into(), Array::f32(&q)),
            ("k".into(), bf16_array(&k)),
            ("v".into(), bf16_array(&v)),
            (
                "partial".into(),
                Array::poisoned(Ty::F32, tokens * heads * 4 * (head_dim + 2)),
            ),
        ]);
        let mut traffic = run_profiled(&pass, &mut bufs, &scalars).unwrap();
        if pass.name == "attention_vector" {
            let acc = traffic.0.remove("warp_acc").expect("the accumulators' traffic");
            assert_eq!(acc.worst, 2, "{acc:?}");
        }
        conflict_free(&traffic, &pass.origin);
    }
    let (tokens, n, k) = (64, 128, 256);
    let (x, w) = (rng.vec(tokens * k), bf16_array(&rng.vec(n * k)));
    let gemms = [
        (
            gemm_mma::gemm_mma("gemm", "test", gemm_mma::WeightStaging::CpAsync),
            Array::f32(&x),
        ),
        (
            gemm_mma::gemm_mma("gemm", "test", gemm_mma::WeightStaging::Registers),
            Array::f32(&x),
        ),
        (gemm_tma_mma::gemm_tma_mma_bf16("gemm", "test"), bf16_array(&x)),
    ];
    for (gemm, x) in gemms {
        let traffic = profile_matmul(&gemm, x, w.clone(), (tokens, n, k, k)).unwrap();
        conflict_free(&traffic, &gemm.origin);
    }
}

/// The `wgmma` flash attention needs its fences, waits and barriers, and the emulator says why
/// when one is missing: without `fence.proxy.async` the tensor cores read queries, keys and
/// values the generic proxy wrote; without the waits the next step touches registers the
/// tensor cores still use; waiting for one group too few, the softmax reads scores still
/// being computed, or the rescaling outputs `P·V` still adds to; without the barrier a warp
/// reads tiles other threads copied. Over an FP8 cache too: there the fence also publishes
/// each tile widened by the generic proxy, and a barrier the codes each thread copied.
#[test]
fn the_wgmma_flash_attention_fails_without_its_fences_and_waits() {
    use kernels_gen::templates::cache_layout::CacheLayout;
    let lockstep = flash_attention_wgmma::Schedule::Lockstep;
    let fp8 = flash_attention_wgmma::flash_attention_wgmma_over(
        "flash",
        "test",
        CacheLayout::Contiguous,
        (32, Ty::F8E4M3),
        lockstep,
    );
    let waiting = |from: u32, to: u32| {
        move |s: &Stmt| match s {
            Stmt::WgmmaWait(n) if *n == from => Some(Stmt::WgmmaWait(to)),
            other => Some(other.clone()),
        }
    };
    for (what, edit, expected) in [
        (
            "the fences",
            &dropping(|s| matches!(s, Stmt::FenceProxyAsync)) as Edit,
            "without fence.proxy.async",
        ),
        (
            "the waits",
            &dropping(|s| matches!(s, Stmt::WgmmaWait(_))),
            "while a wgmma",
        ),
        ("the scores' wait", &waiting(1, 2), "touches `s0_0` while a wgmma"),
        ("the values' wait", &waiting(0, 1), "touches `o0_0` while a wgmma"),
        (
            "the barriers",
            &dropping(|s| matches!(s, Stmt::SyncThreads)),
            "without a __syncthreads() between",
        ),
    ] {
        for kernel in [&wgmma_flash_for_faults(lockstep), &fp8] {
            flash_fails_without(kernel, (what, edit, expected));
        }
    }
}

/// The warp-specialised `wgmma` flash attention hands its tiles over through mbarriers, and
/// the emulator says why when a hand-over is missing: without the consumers' wait on `full`
/// their tensor cores read a buffer before its copies; without the producer's wait for
/// its copies, or its fence, it hands over what has not landed or what the async proxy may
/// not see; without its wait on `empty` it refills a buffer the consumers' tensor cores read,
/// ordered by nothing; without the consumers' release on `empty` both roles wait forever, and
/// without a warpgroup passing the turn on, the other waits forever for its turn; without the
/// producer's release of its registers the consumers' claim waits forever.
#[test]
fn the_specialised_wgmma_flash_attention_fails_without_its_hand_overs() {
    let kernel = wgmma_flash_for_faults(flash_attention_wgmma::Schedule::Specialised);
    let registers_released = dropping(|s| {
        matches!(
            s,
            Stmt::SetMaxRegisters {
                change: RegisterChange::Release,
                ..
            }
        )
    });
    let consumers_wait = dropping(|s| waits_on(s, "full"));
    let producers_wait = dropping(|s| waits_on(s, "empty"));
    let release = dropping(|s| arrives_on(s, "empty"));
    let turn_passed = dropping(|s| arrives_on(s, "turn"));
    let landing = dropping(|s| matches!(s, Stmt::CpAsyncWait(_)));
    let fence = dropping(|s| matches!(s, Stmt::FenceProxyAsync));
    for (what, edit, expected) in [
        // The consumers run ahead of the producer's first copy.
        (
            "the consumers' wait",
            &consumers_wait as Edit,
            "wgmma reads ks[0], which was never written",
        ),
        (
            "the producer's wait for its copies",
            &landing,
            "while a cp.async into it is in flight",
        ),
        ("the producer's fence", &fence, "without fence.proxy.async"),
        (
            "the producer's wait for a buffer",
            &producers_wait,
            "read by warpgroup 0's tensor cores without a __syncthreads() between",
        ),
        // Reported with the consumers' wait for the tile the waiting producer would copy.
        (
            "the consumers' release",
            &release,
            "of mbarrier full[2], which never completes",
        ),
        (
            "the turn passed on",
            &turn_passed,
            "of mbarrier turn[0], which never completes",
        ),
        (
            "the producer's registers released",
            &registers_released,
            "setmaxnreg.inc to 232 waits for 8192 registers, and the block's pool holds 0",
        ),
    ] {
        flash_fails_without(&kernel, (what, edit, expected));
    }
}

/// The `wgmma` flash attention loading its tiles by TMA hands them over through mbarriers
/// whose phases count the copies' bytes, and the emulator says why when a hand-over is
/// missing: without the consumers' wait on `full` their tensor cores read a buffer before its
/// copies land; without the bytes announced the phase never completes; without the
/// producer's wait on `empty` its copies overwrite a buffer the consumers' tensor cores read,
/// ordered by nothing; without the consumers' release on `empty` both roles wait forever.
#[test]
fn the_tma_wgmma_flash_attention_fails_without_its_hand_overs() {
    let kernel = wgmma_flash_for_faults(flash_attention_wgmma::Schedule::Tma);
    let consumers_wait = dropping(|s| waits_on(s, "full"));
    let announced = dropping(announces_bytes);
    let producers_wait = dropping(|s| waits_on(s, "empty"));
    let release = dropping(|s| arrives_on(s, "empty"));
    for (what, edit, expected) in [
        (
            "the consumers' wait",
            &consumers_wait as Edit,
            "wgmma reads ks[0], which was never written",
        ),
        (
            "the bytes announced",
            &announced,
            "of mbarrier full[0], which never completes (0 of 1 arrivals, -32768 transaction bytes",
        ),
        (
            "the producer's wait for a buffer",
            &producers_wait,
            "TMA copy overwrites ks[0], read by warpgroup 0's tensor cores",
        ),
        (
            "the consumers' release",
            &release,
            "of mbarrier full[0], which never completes",
        ),
    ] {
        flash_fails_without(&kernel, (what, edit, expected));
    }
}

/// The `wgmma` flash attention on `schedule` for the fault tests: one head over a contiguous
/// cache (32 dims, 64 by TMA), long enough (4 key tiles) for the ring to wrap.
fn wgmma_flash_for_faults(schedule: flash_attention_wgmma::Schedule) -> Kernel {
    use kernels_gen::templates::cache_layout::CacheLayout;
    let head_dim = match schedule {
        flash_attention_wgmma::Schedule::Tma => 64,
        _ => 32,
    };
    flash_attention_wgmma::flash_attention_wgmma("flash", "test", CacheLayout::Contiguous, head_dim, schedule)
}

/// The `tcgen05` flash attention hands its tensor memory and shared buffers between thread 0's
/// MMAs and the block's threads through mbarriers and barriers, and the emulator says why when
/// one is missing: without thread 0's wait on `free` a tile's `P·V` overwrites what other warps
/// were reading; without the waits on `scores` or `values` a warp reads TMEM an MMA is still
/// writing; without `tcgen05.wait::ld` a thread uses registers still loading; without the
/// waits for the copies the tensor cores read a tile still landing; without the proxy fences
/// they read copies or probabilities the async proxy may not see; without the barriers thread
/// 0 multiplies probabilities other threads are still storing; and without the deallocation
/// the block exits holding its columns.
#[test]
fn the_tcgen05_flash_attention_fails_without_its_hand_overs() {
    use kernels_gen::templates::cache_layout::CacheLayout;
    let kernel = flash_attention_tcgen05::flash_attention_tcgen05(
        "flash",
        "test",
        CacheLayout::Contiguous,
        32,
        flash_attention_tcgen05::Loads::Copies,
    );
    for (what, edit, expected) in [
        (
            "the wait on `free`",
            &dropping(|s| waits_on(s, "free")) as Edit,
            "tcgen05.mma writes TMEM lane 0, column 144 that warp 4 read",
        ),
        (
            "the wait on `scores`",
            &dropping(|s| waits_on(s, "scores")),
            "tcgen05.ld of TMEM before waiting on the `scores",
        ),
        (
            "the wait on `values`",
            &dropping(|s| waits_on(s, "values")),
            "tcgen05.ld of TMEM before waiting on the `values",
        ),
        (
            "the waits for TMEM loads",
            &dropping(|s| matches!(s, Stmt::Tcgen05(op) if matches!(&**op, dsl::Tcgen05::WaitLd))),
            "before tcgen05.wait::ld",
        ),
        (
            "the waits for the copies",
            &dropping(|s| matches!(s, Stmt::CpAsyncWait(_))),
            "while a cp.async into it is in flight",
        ),
        (
            "the proxy fences",
            &dropping(|s| matches!(s, Stmt::FenceProxyAsync)),
            "without fence.proxy.async",
        ),
        (
            "the barriers",
            &dropping(|s| matches!(s, Stmt::SyncThreads)),
            "without a __syncthreads() between",
        ),
        (
            "the deallocation",
            &dropping(|s| matches!(s, Stmt::Tcgen05(op) if matches!(&**op, dsl::Tcgen05::Dealloc { .. }))),
            "still allocated when the block exits",
        ),
    ] {
        flash_fails_without(&kernel, (what, edit, expected));
    }
}

/// The `tcgen05` flash attention loading its tiles by TMA hands them to thread 0's MMAs through
/// mbarriers counting their bytes, and the emulator says why when a hand-over is missing:
/// without thread 0's waits on `landed` its MMAs read a buffer before the boxes land; without
/// the bytes announced the phase never completes.
#[test]
fn the_tma_tcgen05_flash_attention_fails_without_its_hand_overs() {
    use kernels_gen::templates::cache_layout::CacheLayout;
    let kernel = flash_attention_tcgen05::flash_attention_tcgen05(
        "flash",
        "test",
        CacheLayout::Contiguous,
        64,
        flash_attention_tcgen05::Loads::Tma,
    );
    for (what, edit, expected) in [
        (
            "the waits on `landed`",
            &dropping(|s| waits_on(s, "landed")) as Edit,
            "tcgen05.mma reads ks[0] before waiting for phase 0 of mbarrier landed[0]",
        ),
        (
            "the bytes announced",
            &dropping(announces_bytes),
            "of mbarrier landed[0], which never completes (0 of 1 arrivals, -16384 transaction bytes",
        ),
    ] {
        flash_fails_without(&kernel, (what, edit, expected));
    }
}

/// `kernel` (a flash attention over a contiguous cache, one head of 32 dims, or of 64 where
/// it loads by TMA) runs as it is, and with `edit` applied (leaving out `what`) into a fault
/// whose message contains `expected`: 16 rows at positions 400.., one block whose keys are
/// four tiles of 128 keys (seven of 64), enough for a ring to wrap.
fn flash_fails_without(kernel: &Kernel, (what, edit, expected): (&str, Edit, &str)) {
    let mut rng = Rng(53);
    let tma = kernel.tensor_maps().next().is_some();
    let (tokens, first, head_dim) = (16, 400, if tma { 64 } else { 32 });
    let positions = first + tokens;
    let round = |v: &[f32]| v.iter().map(|&a| bf16::from_f32(a).to_f32()).collect::<Vec<_>>();
    let (q, k, v) = (
        round(&rng.vec(tokens * head_dim)),
        round(&rng.vec(positions * head_dim)),
        round(&rng.vec(positions * head_dim)),
    );
    let mut scalars = ints(&[
        ("tokens", tokens as i64),
        ("q_stride", head_dim as i64),
        ("first", first as i64),
        ("heads", 1),
        ("kv_heads", 1),
        ("window", 0),
        ("cache_rows", positions as i64),
        ("cache_width", head_dim as i64),
    ]);
    scalars.insert("scale".into(), Scalar::F32(0.3));
    // The cache as the kernel reads it: bf16, or FP8 codes.
    let pool = |values: &[f32]| match kernel.param("k") {
        Some(kernels_gen::dsl::Param::Buffer { ty: Ty::F8E4M3, .. }) => fp8_array(values),
        _ => bf16_array(values),
    };
    let run_with = |body: Vec<Stmt>| {
        let mut broken = kernel.clone();
        broken.body = body;
        let mut bufs = HashMap::from([
            ("q".into(), Array::f32(&q)),
            ("k".into(), pool(&k)),
            ("v".into(), pool(&v)),
            ("out".into(), Array::poisoned(Ty::F32, tokens * head_dim)),
        ]);
        run(&broken, &mut bufs, &scalars).map_err(|e| e.to_string())
    };
    run_with(kernel.body.clone()).unwrap();
    let body = edited(&kernel.body, edit);
    assert_ne!(body, kernel.body, "{what}");
    let message = run_with(body).unwrap_err();
    assert!(message.contains(expected), "without {what}: {message}");
}

/// The tensor-core prefill attention kernels for `head_dim` over `layout` and a cache of
/// `cache` elements, each with the rows of its query tiles: on `mma.sync` (masking every tile,
/// and only those the block's rows do not see whole), and on `wgmma` (every schedule) and
/// `tcgen05` (copying and by TMA) where they take the head; over FP8, `wgmma` in its lockstep
/// schedule and `tcgen05` copying alone (their other forms read 16-bit tiles only).
fn flash_kernels_over(
    layout: kernels_gen::templates::cache_layout::CacheLayout,
    (head_dim, cache): (usize, Ty),
) -> Vec<(Kernel, usize)> {
    use flash_attention::Masking;
    use flash_attention_tcgen05::Loads;
    use flash_attention_wgmma::Schedule;
    let fp8 = cache == Ty::F8E4M3;
    let wgmma = [Schedule::Lockstep, Schedule::Specialised, Schedule::Tma]
        .into_iter()
        .filter(|&schedule| !fp8 || schedule == Schedule::Lockstep)
        .filter(|&schedule| match schedule {
            Schedule::Tma => flash_tma::supports(head_dim),
            _ => flash_attention_wgmma::supports(head_dim),
        })
        .map(|schedule| {
            (
                flash_attention_wgmma::flash_attention_wgmma_over(
                    "flash_wgmma",
                    "test",
                    layout,
                    (head_dim, cache),
                    schedule,
                ),
                flash_attention_wgmma::QUERY_TILE_ROWS,
            )
        });
    let tcgen05 = [Loads::Copies, Loads::Tma]
        .into_iter()
        .filter(|&loads| !fp8 || loads == Loads::Copies)
        .filter(|&loads| match loads {
            Loads::Copies => flash_attention_tcgen05::supports(head_dim),
            Loads::Tma => flash_tma::supports(head_dim),
        })
        .map(|loads| {
            (
                flash_attention_tcgen05::flash_attention_tcgen05_over(
                    "flash_tcgen05",
                    "test",
                    layout,
                    (head_dim, cache),
                    loads,
                ),
                flash_attention_tcgen05::QUERY_TILE_ROWS,
            )
        });
    let mma = [Masking::EveryTile, Masking::CutTiles].map(|masking| {
        (
            flash_attention::flash_attention_over("flash", "test", layout, (head_dim, cache), masking),
            flash_attention::QUERY_TILE_ROWS,
        )
    });
    mma.into_iter().chain(wgmma).chain(tcgen05).collect()
}

/// The IR reference's causal attention (scale 0.3) of the rows `first..` of one sequence, its
/// cache `k`/`v` holding positions `0..first + rows`; `window` 0 for none.
fn attention_reference(
    (q, k, v): (&[f32], &[f32], &[f32]),
    (first, heads, kv_heads, head_dim, window): (usize, usize, usize, usize, usize),
) -> Vec<f32> {
    let spec = ir::AttentionSpec {
        heads,
        kv_heads,
        head_dim,
        scale: 0.3,
        window: (window > 0).then_some(window),
        cache_slot: 0,
        cache_dtype: ir::DType::F32,
    };
    let len = k.len() / (kv_heads * head_dim);
    let slot = ir::reference::KvSlot {
        positions: (0..len).collect(),
        k: k.to_vec(),
        v: v.to_vec(),
    };
    let positions: Vec<usize> = (first..len).collect();
    let rows = positions.len();
    let q = ir::Tensor::new(vec![rows, heads * head_dim], q.to_vec());
    ir::reference::attention_over_slot(&spec, &q, &slot, &positions).data
}

/// The split passes over a cache in `layout`: one element a lane, and 16 bytes a lane where
/// the head allows (`attention_vector`); their partials are the same.
fn split_passes(
    layout: kernels_gen::templates::cache_layout::CacheLayout,
    head_dim: usize,
    group: usize,
    cache: Ty,
) -> Vec<Kernel> {
    let mut passes = vec![attention::attention_split(
        "attention",
        "test",
        layout,
        head_dim,
        group,
        cache,
    )];
    if attention_vector::supports(head_dim, cache) {
        passes.push(attention_vector::attention_split_vector(
            "attention_vector",
            "test",
            layout,
            head_dim,
            group,
            cache,
        ));
    }
    passes
}

/// The vector split pass over bf16 caches of every head size it takes (a 16-byte load a lane
/// covering 8 to 64 dims of a row of 64 to 512; several keys a warp at once, one a lane at
/// 512), paged with its blocks in reverse order, against the reference on the rounded keys
/// and values: decode rows after caches whose spans end mid-iteration, a window, one split,
/// the plans' count and more, and the block's heads as the plans group them. Keys past a
/// span's end reload its last row and must not count.
#[test]
fn vector_split_attention_matches_reference_on_bf16_caches() {
    use kernels_gen::templates::cache_layout::CacheLayout;
    let mut rng = Rng(44);
    let round = |v: &[f32]| v.iter().map(|&a| bf16::from_f32(a).to_f32()).collect::<Vec<_>>();
    let block_size = 16;
    for (tokens, first, heads, kv_heads, head_dim, window) in [
        (1, 300, 8, 2, 64, 0),
        (2, 211, 8, 2, 128, 0),
        (1, 130, 4, 2, 128, 37),
        (1, 97, 4, 1, 256, 0),
        (2, 45, 2, 1, 512, 0),
    ] {
        assert!(attention_vector::supports(head_dim, Ty::Bf16));
        let len = first + tokens;
        let row = kv_heads * head_dim;
        let (q, k, v) = (
            rng.vec(tokens * heads * head_dim),
            round(&rng.vec(len * row)),
            round(&rng.vec(len * row)),
        );
        let want = attention_reference((&q, &k, &v), (first, heads, kv_heads, head_dim, window));
        let (table, paged_k, paged_v) = reversed_pages((&k, &v), row, block_size);
        // The reference's scale and window.
        let spec = ir::AttentionSpec {
            scale: 0.3,
            window: (window > 0).then_some(window),
            ..cache_test_spec(heads, kv_heads, head_dim)
        };
        let scalars = attention_scalars(&spec, tokens, first, block_size);
        let group = attention_vector::heads_per_block(heads, kv_heads, head_dim, Ty::Bf16);
        let kernel = attention_vector::attention_split_vector(
            "attention_vector",
            "test",
            CacheLayout::Paged,
            head_dim,
            group,
            Ty::Bf16,
        );
        for splits in [1, attention::splits_for(tokens), 7] {
            let mut bufs = HashMap::from([
                ("q".into(), Array::f32(&q)),
                ("k".into(), bf16_array(&paged_k)),
                ("v".into(), bf16_array(&paged_v)),
                ("block_table".into(), Array::ints(Ty::I32, &table)),
            ]);
            let out = run_attention(&kernel, &mut bufs, &scalars, (tokens, heads, head_dim), splits);
            close(
                &out,
                &want,
                1e-5,
                &format!("{tokens} rows after {first}, {splits} splits: {}", kernel.origin),
            );
        }
    }
}

/// Keys and values of `row` elements a position, paged in blocks of `block_size` positions in
/// reverse order behind one spare block: the block table and the two pools.
fn reversed_pages((k, v): (&[f32], &[f32]), row: usize, block_size: usize) -> (Vec<i64>, Vec<f32>, Vec<f32>) {
    let len = k.len() / row;
    let blocks = len.div_ceil(block_size);
    let table: Vec<i64> = (0..blocks).map(|b| (blocks - b) as i64).collect();
    let mut paged_k = vec![0f32; (blocks + 1) * block_size * row];
    let mut paged_v = paged_k.clone();
    for p in 0..len {
        let at = (table[p / block_size] as usize * block_size + p % block_size) * row;
        paged_k[at..at + row].copy_from_slice(&k[p * row..(p + 1) * row]);
        paged_v[at..at + row].copy_from_slice(&v[p * row..(p + 1) * row]);
    }
    (table, paged_k, paged_v)
}

/// Run attention's split pass (`split`, over `bufs` and `scalars`, which lack the partials and
/// the split count) and its combine pass; the output. The partials start poisoned: every one
/// the combine reads must have been written, empty splits' too.
fn run_attention(
    split: &Kernel,
    bufs: &mut HashMap<String, Array>,
    scalars: &HashMap<String, Scalar>,
    (tokens, heads, head_dim): (usize, usize, usize),
    splits: usize,
) -> Vec<f32> {
    let mut scalars = scalars.clone();
    scalars.insert("splits".into(), Scalar::Int(splits as i64));
    let partials = tokens * heads * splits * (head_dim + 2);
    bufs.insert("partial".into(), Array::poisoned(Ty::F32, partials));
    run(split, bufs, &scalars).unwrap();
    let mut merged = HashMap::from([
        ("partial".into(), bufs.remove("partial").unwrap()),
        ("out".into(), Array::poisoned(Ty::F32, tokens * heads * head_dim)),
    ]);
    let combine = attention::attention_combine("combine", "test", head_dim);
    run(&combine, &mut merged, &scalars).unwrap();
    merged["out"].to_f32().unwrap()
}

/// Column slices of fused outputs are read in place: inputs whose rows lie further apart than
/// their width (the Q part of a joined QKV row, the normed half of `add_rms_norm`).
#[test]
fn strided_inputs_read_slices_in_place() {
    let mut rng = Rng(9);
    let (tokens, k, extra, n) = (3, 40, 24, 7);
    let stride = k + extra;
    let wide = rng.vec(tokens * stride);
    let x: Vec<f32> = (0..tokens)
        .flat_map(|t| wide[t * stride + extra..t * stride + extra + k].to_vec())
        .collect();
    let w = rng.vec(n * k);
    let mut want = vec![0f32; tokens * n];
    ops::matmul(&x, &w, k, &mut want);
    // The slice starts `extra` columns in: the launch passes the buffer at that offset.
    let shifted: Vec<f32> = wide[extra..].to_vec();
    let decode = GemvSpec::decode(quant::WeightFormat::Dense(Ty::F32), k);
    for spec in [decode, decode.with_x_vectors()] {
        let out = run_gemv(
            &gemv::gemv("gemv", "test", spec),
            &shifted,
            Array::f32(&w),
            (tokens, n, k, stride),
        );
        close(&out.to_f32().unwrap(), &want, 1e-5, &format!("strided gemv {spec:?}"));
    }
    // A view two columns into an aligned buffer is not 16-byte aligned: vector loads of it are
    // refused (codegen reads such views with scalar loads).
    let kernel = gemv::gemv("gemv", "test", decode.with_x_vectors());
    let x = Array::f32(&wide[2..]).placed_at(2);
    let fault = try_run_matmul(&kernel, x, None, Array::f32(&w), (tokens, n, k, stride))
        .unwrap_err()
        .to_string();
    assert!(fault.contains("misaligned"), "{fault}");

    let (groups_per_row, group) = (4, 10);
    let width = groups_per_row * group;
    let wide = rng.vec(tokens * (width + 6));
    let x: Vec<f32> = (0..tokens)
        .flat_map(|t| wide[t * (width + 6)..t * (width + 6) + width].to_vec())
        .collect();
    let nw = rng.vec(group);
    let mut want = vec![0f32; x.len()];
    ops::rms_norm(&x, &nw, 1e-6, 0.0, &mut want);
    let kernel = rms_norm::rms_norm("norm", "test", 1e-6, 0.0);
    let mut bufs = HashMap::from([
        ("x".into(), Array::f32(&wide)),
        ("w".into(), Array::f32(&nw)),
        ("out".into(), Array::poisoned(Ty::F32, x.len())),
    ]);
    let scalars = ints(&[
        ("groups", (tokens * groups_per_row) as i64),
        ("group", group as i64),
        ("width", width as i64),
        ("x_stride", (width + 6) as i64),
    ]);
    run(&kernel, &mut bufs, &scalars).unwrap();
    close(&bufs["out"].to_f32().unwrap(), &want, 1e-5, "strided per-head rms_norm");

    // RoPE on the query columns of a joined QKV output (as the GPU plan launches it).
    let (heads, head_dim) = (2, 8);
    let width = heads * head_dim;
    let stride = width + 12;
    let wide = rng.vec(tokens * stride);
    let mut want: Vec<f32> = (0..tokens)
        .flat_map(|t| wide[t * stride..t * stride + width].to_vec())
        .collect();
    let spec = RopeSpec {
        heads,
        head_dim,
        rotary_dim: head_dim,
        theta: 10_000.0,
        position_scale: 1.0,
        layout: RopeLayout::RotateHalf,
        scaling: ir::RopeScaling::None,
    };
    let positions = [3usize, 4, 5];
    ops::rope(&spec, &mut want, &positions);
    let mut bufs = HashMap::from([
        ("x".into(), Array::f32(&wide)),
        ("positions".into(), Array::ints(Ty::I32, &positions.map(|p| p as i64))),
        ("inv_freq".into(), Array::f32(&ops::rope_inv_freq(&spec))),
        ("out".into(), Array::poisoned(Ty::F32, want.len())),
    ]);
    let scalars = ints(&[
        ("tokens", tokens as i64),
        ("width", width as i64),
        ("head_dim", head_dim as i64),
        ("rotary_dim", head_dim as i64),
        ("x_stride", stride as i64),
    ]);
    run(
        &rope::rope("rope", "test", rope::Rotation::plain(RopeLayout::RotateHalf)),
        &mut bufs,
        &scalars,
    )
    .unwrap();
    close(&bufs["out"].to_f32().unwrap(), &want, 1e-5, "strided rope");
}

/// `rope_kv_append` against the reference: queries rotated into `q_out`, keys rotated and
/// values copied into a paged cache (the new rows straddle a block edge; the cached rows stay
/// as they were), both rope layouts, whole and partial rotation, f32, bf16 and FP8 caches,
/// each source read in place from rows of its own width. A rotated key a last f32 bit from the
/// reference's can round to the neighbouring bf16 (hence 8e-3 there); FP8's boundaries are
/// 2¹⁶ times sparser, and its codes here all equal the reference's.
#[test]
fn rope_kv_append_rotates_queries_and_keys_and_appends_keys_and_values() {
    let mut rng = Rng(21);
    let (heads, kv_heads, head_dim, tokens, first, block_size) = (4, 2, 8, 3, 3, 4);
    let (q_dim, kv_dim) = (heads * head_dim, kv_heads * head_dim);
    let strides = [q_dim + 3, kv_dim + 5, kv_dim + 1];
    let table = [2i64, 0];
    let physical = |p: usize| table[p / block_size] as usize * block_size + p % block_size;
    let positions: Vec<usize> = (first..first + tokens).collect();
    for (layout, rotary_dim, cache) in [
        (RopeLayout::RotateHalf, head_dim, Ty::F32),
        (RopeLayout::AdjacentPairs, head_dim / 2, Ty::F32),
        (RopeLayout::RotateHalf, head_dim / 2, Ty::Bf16),
        (RopeLayout::AdjacentPairs, head_dim, Ty::F8E4M3),
    ] {
        let dtype = match cache {
            Ty::Bf16 => ir::DType::BF16,
            Ty::F8E4M3 => ir::DType::F8E4M3,
            _ => ir::DType::F32,
        };
        let spec = |heads| RopeSpec {
            heads,
            head_dim,
            rotary_dim,
            theta: 10_000.0,
            position_scale: 1.0,
            layout,
            scaling: ir::RopeScaling::None,
        };
        let sources = strides.map(|stride| rng.vec(tokens * stride));
        let rows = |at: usize, len: usize| -> Vec<f32> {
            (0..tokens)
                .flat_map(|t| sources[at][t * strides[at]..][..len].to_vec())
                .collect()
        };
        let (mut q, mut k, v) = (rows(0, q_dim), rows(1, kv_dim), rows(2, kv_dim));
        ops::rope(&spec(heads), &mut q, &positions);
        ops::rope(&spec(kv_heads), &mut k, &positions);
        let old = (rng.vec(3 * block_size * kv_dim), rng.vec(3 * block_size * kv_dim));
        let pool = |values: &[f32]| -> Vec<f32> { values.iter().map(|&e| ops::stored_as(e, dtype)).collect() };
        let array = |values: &[f32]| match cache {
            Ty::Bf16 => bf16_array(values),
            Ty::F8E4M3 => fp8_array(values),
            _ => Array::f32(values),
        };
        let mut bufs = HashMap::from([
            ("q_src".into(), Array::f32(&sources[0])),
            ("k_src".into(), Array::f32(&sources[1])),
            ("v_src".into(), Array::f32(&sources[2])),
            (
                "positions".into(),
                Array::ints(Ty::I32, &positions.iter().map(|&p| p as i64).collect::<Vec<_>>()),
            ),
            ("inv_freq".into(), Array::f32(&ops::rope_inv_freq(&spec(heads)))),
            ("q_out".into(), Array::poisoned(Ty::F32, tokens * q_dim)),
            ("k_cache".into(), array(&old.0)),
            ("v_cache".into(), array(&old.1)),
            ("block_table".into(), Array::ints(Ty::I32, &table)),
        ]);
        let scalars = ints(&[
            ("tokens", tokens as i64),
            ("q_dim", q_dim as i64),
            ("kv_dim", kv_dim as i64),
            ("head_dim", head_dim as i64),
            ("rotary_dim", rotary_dim as i64),
            ("first", first as i64),
            ("q_stride", strides[0] as i64),
            ("k_stride", strides[1] as i64),
            ("v_stride", strides[2] as i64),
            ("block_size", block_size as i64),
        ]);
        let kernel = kv_append::rope_kv_append(
            "rope_append",
            "test",
            cache_layout::CacheLayout::Paged,
            cache,
            rope::Rotation::plain(layout),
        );
        run(&kernel, &mut bufs, &scalars).unwrap();
        let what = format!("{layout:?}, rotary_dim {rotary_dim}, {cache:?} cache");
        close(&bufs["q_out"].to_f32().unwrap(), &q, 1e-5, &format!("queries, {what}"));
        let tol = if cache == Ty::Bf16 { 8e-3 } else { 1e-5 };
        for (name, old, new) in [("k_cache", &old.0, &k), ("v_cache", &old.1, &v)] {
            let mut want = pool(old);
            for (t, &p) in positions.iter().enumerate() {
                want[physical(p) * kv_dim..][..kv_dim].copy_from_slice(&pool(&new[t * kv_dim..][..kv_dim]));
            }
            close(&bufs[name].to_f32().unwrap(), &want, tol, &format!("{name}, {what}"));
        }
    }
}

#[test]
fn kv_append_writes_rows_after_the_cached_ones() {
    let mut rng = Rng(10);
    // K and V rows inside wider rows of different widths (slices of fused outputs).
    let (tokens, kv_dim, first, k_stride, v_stride) = (2, 6, 3, 9, 14);
    let (k_src, v_src) = (rng.vec(tokens * k_stride), rng.vec(tokens * v_stride));
    let (k_old, v_old) = (rng.vec(first * kv_dim), rng.vec(first * kv_dim));
    let append = |bufs: &mut HashMap<String, Array>, tokens: usize, first: usize, strides: (usize, usize)| {
        let scalars = ints(&[
            ("tokens", tokens as i64),
            ("kv_dim", kv_dim as i64),
            ("first", first as i64),
            ("k_stride", strides.0 as i64),
            ("v_stride", strides.1 as i64),
        ]);
        run(&kv_append::kv_append("kv", "test"), bufs, &scalars).unwrap();
    };
    let cache = Array::poisoned(Ty::F32, (first + tokens) * kv_dim);
    // The old rows are already there.
    let mut bufs = HashMap::from([
        ("k_src".into(), Array::f32(&k_old)),
        ("v_src".into(), Array::f32(&v_old)),
        ("k_cache".into(), cache.clone()),
        ("v_cache".into(), cache),
    ]);
    append(&mut bufs, first, 0, (kv_dim, kv_dim));
    bufs.insert("k_src".into(), Array::f32(&k_src));
    bufs.insert("v_src".into(), Array::f32(&v_src));
    append(&mut bufs, tokens, first, (k_stride, v_stride));
    for (name, old, src, stride) in [
        ("k_cache", &k_old, &k_src, k_stride),
        ("v_cache", &v_old, &v_src, v_stride),
    ] {
        let mut want = old.clone();
        for t in 0..tokens {
            want.extend_from_slice(&src[t * stride..t * stride + kv_dim]);
        }
        close(&bufs[name].to_f32().unwrap(), &want, 0.0, name);
    }
}

#[test]
fn rms_norm_prologue_gemv_matches_norm_then_matmul() {
    let mut rng = Rng(11);
    for (tokens, n, k) in [(1, 5, 64), (2, 9, 100), (10, 4, 32)] {
        let (x, g, w) = (rng.vec(tokens * k), rng.vec(k), rng.vec(n * k));
        let mut normed = vec![0f32; x.len()];
        ops::rms_norm(&x, &g, 1e-6, 1.0, &mut normed);
        let mut want = vec![0f32; tokens * n];
        ops::matmul(&normed, &w, k, &mut want);
        let decode =
            GemvSpec::decode(quant::WeightFormat::Dense(Ty::F32), k).with_norm(gemv::NormPrologue::new(1e-6, 1.0));
        for spec in [decode, decode.prefill(), decode.with_x_vectors().prefill()] {
            let run = |spec| {
                let kernel = gemv::gemv("norm_gemv", "test", spec);
                run_norm_gemv(&kernel, &x, Some(&g), Array::f32(&w), (tokens, n, k, k))
            };
            matches_with_any_rows_per_warp(spec, &want, "rms_norm_gemv", run);
        }
    }
}

/// `residual_reference` with the GLU of the product's halves: rows `[sum | act(g)·u]`.
fn residual_glu_reference(want: &[f32], (tokens, n, k): (usize, usize, usize), act: GluAct) -> Vec<f32> {
    (0..tokens)
        .flat_map(|t| {
            let row = &want[t * (k + n)..(t + 1) * (k + n)];
            let gated = ops::glu(&row[k..], n, act);
            row[..k].iter().copied().chain(gated).collect::<Vec<_>>()
        })
        .collect()
}

/// The GLU epilogue on the residual matmul: each warp's gate row and up row meet in the GEMV
/// (one token a pass and four, vector loads or not); on Hopper's and Blackwell's GEMMs every
/// product goes through the partials, in one piece and with K split, and the reduction
/// applies the GLU.
#[test]
fn glu_epilogue_gates_the_product() {
    let mut rng = Rng(31);
    let norm = gemv::NormPrologue::new(1e-6, 1.0).with_residual();
    // 1056: many passes over a row per lane, the last vectors' prefetch clamped to the row.
    for (tokens, n, k, act) in [
        (1, 18, 64, GluAct::Silu),
        (6, 10, 96, GluAct::GeluTanh),
        (2, 8, 1056, GluAct::Silu),
    ] {
        let strides = (k + 4, k);
        let inputs = Residual::random(&mut rng, (tokens, n, k), strides);
        let w = &inputs.w;
        let plain = residual_reference(&inputs, (tokens, n, k), |v| v, 1.0, 1e-6);
        let want = residual_glu_reference(&plain, (tokens, n, k), act);
        let decode = GemvSpec::decode(quant::WeightFormat::Dense(Ty::F32), k)
            .with_norm(norm)
            .with_glu(act);
        for spec in [decode, decode.prefill(), decode.with_x_vectors().prefill()] {
            let run = |spec| {
                let kernel = gemv::gemv("glu_gemv", "test", spec);
                try_run_residual_matmul((&kernel, None), &inputs, Array::f32(w), (tokens, n, k, n / 2), 1).unwrap()
            };
            matches_with_any_rows_per_warp(spec, &want, &format!("{tokens}×{n}×{k}"), run);
        }
    }
    let act = GluAct::Silu;
    let reduce = split_k::reduce("reduce", "test", 16, Some(act), Some(norm));
    for gemm in prologue_gemms(Some(norm), Some(act)) {
        for (tokens, n, k) in [(20, 260, 136), (17, 64, 256), (70, 130, 72)] {
            let strides = (k, k + 8);
            let inputs = Residual::random(&mut rng, (tokens, n, k), strides);
            let w = &inputs.w;
            let round = |v: f32| bf16::from_f32(v).to_f32();
            let plain = residual_reference(&inputs, (tokens, n, k), round, 1.0, 1e-6);
            let want = residual_glu_reference(&plain, (tokens, n, k), act);
            let w = bf16_array(w);
            for splits in [1, 2] {
                let dims = (tokens, n, k, n / 2);
                let out = try_run_residual_matmul((&gemm, Some(&reduce)), &inputs, w.clone(), dims, splits).unwrap();
                close(
                    &out.to_f32().unwrap(),
                    &want,
                    1e-5,
                    &format!("glu gemm {tokens}×{n}×{k}, {splits} splits\n{}", gemm.origin),
                );
            }
        }
    }
}

/// The residual prologue (`add_rms_norm_matmul`) on the GEMV, in every variant a plan builds
/// (one token a pass, four, vector loads of both inputs) over strided inputs, and on Hopper's
/// and Blackwell's GEMMs in one piece and with K split: the sum lands beside the product, each
/// written once.
#[test]
fn residual_prologue_matmuls_write_the_sum_and_the_product() {
    let mut rng = Rng(29);
    let (eps, offset) = (1e-6f32, 1.0f32);
    let norm = gemv::NormPrologue::new(eps, offset).with_residual();
    for (tokens, n, k, pads) in [
        (1, 9, 64, (0, 4)),
        (6, 5, 96, (8, 0)),
        (3, 70, 32, (4, 4)),
        (2, 6, 1056, (0, 4)),
    ] {
        let strides = (k + pads.0, k + pads.1);
        let inputs = Residual::random(&mut rng, (tokens, n, k), strides);
        let w = &inputs.w;
        let want = residual_reference(&inputs, (tokens, n, k), |v| v, offset, eps);
        let decode = GemvSpec::decode(quant::WeightFormat::Dense(Ty::F32), k).with_norm(norm);
        for spec in [
            decode,
            decode.prefill(),
            decode.with_x_vectors(),
            decode.with_x_vectors().prefill(),
        ] {
            let run = |spec| {
                let kernel = gemv::gemv("add_norm_gemv", "test", spec);
                try_run_residual_matmul((&kernel, None), &inputs, Array::f32(w), (tokens, n, k, n), 1).unwrap()
            };
            matches_with_any_rows_per_warp(spec, &want, &format!("{tokens}×{n}×{k}"), run);
        }
    }
    let reduce = split_k::reduce("reduce", "test", 16, None, Some(norm));
    for gemm in prologue_gemms(Some(norm), None) {
        for (tokens, n, k, pads) in [(20, 70, 136, (3, 0)), (33, 130, 256, (0, 5)), (70, 40, 64, (0, 0))] {
            let strides = (k + pads.0, k + pads.1);
            let inputs = Residual::random(&mut rng, (tokens, n, k), strides);
            let w = &inputs.w;
            let round = |v: f32| bf16::from_f32(v).to_f32();
            let want = residual_reference(&inputs, (tokens, n, k), round, offset, eps);
            let w = bf16_array(w);
            for splits in [1, 3] {
                let out =
                    try_run_residual_matmul((&gemm, Some(&reduce)), &inputs, w.clone(), (tokens, n, k, n), splits)
                        .unwrap();
                close(
                    &out.to_f32().unwrap(),
                    &want,
                    1e-5,
                    &format!("residual gemm {tokens}×{n}×{k}, {splits} splits\n{}", gemm.origin),
                );
            }
        }
    }
}

/// Every tensor-core GEMM over bf16 weights, each with a norm prologue, a GLU epilogue and K
/// splits, the same parameters and results: Hopper's (`wgmma`, as plans build it and on the
/// schedules earlier GPU runs timed), Blackwell's (`tcgen05`) and `mma.sync` (weights by
/// `cp.async` and through registers).
fn prologue_gemms(norm: Option<gemv::NormPrologue>, glu: Option<GluAct>) -> [Kernel; 6] {
    use gemm_mma::WeightStaging;
    [
        gemm_wgmma::gemm_wgmma_bf16_with("gemm", "test", norm, glu),
        gemm_wgmma::gemm_wgmma_bf16_scheduled("gemm", "test", norm, glu, gemm_wgmma::Schedule::IN_STEP_TWO_STAGES),
        gemm_wgmma::gemm_wgmma_bf16_scheduled("gemm", "test", norm, glu, gemm_wgmma::Schedule::AHEAD_TWO_STAGES),
        gemm_tcgen05::gemm_tcgen05_bf16_with("gemm", "test", norm, glu),
        gemm_mma::gemm_mma_with("gemm", "test", WeightStaging::CpAsync, norm, glu),
        gemm_mma::gemm_mma_with("gemm", "test", WeightStaging::Registers, norm, glu),
    ]
}

/// IEEE half weights (f16 models): the decode GEMVs (one token a pass, four, vector loads of
/// activations; with the residual norm prologue and the GLU epilogue) read them exactly; the
/// `mma.sync` GEMM rounds them to bf16 in its tile, like its activations, in one piece and
/// with K split.
#[test]
fn half_weights_match_the_reference() {
    let mut rng = Rng(47);
    let half = |v: &[f32]| v.iter().map(|&x| half::f16::from_f32(x)).collect::<Vec<_>>();
    let exact = |v: &[f32]| half(v).iter().map(|h| h.to_f32()).collect::<Vec<_>>();
    let norm = gemv::NormPrologue::new(1e-6, 1.0).with_residual();
    for (tokens, n, k) in [(1, 20, 64), (5, 16, 136)] {
        let mut inputs = Residual::random(&mut rng, (tokens, n, k), (k, k + 4));
        inputs.w = exact(&inputs.w);
        let w = Array::f16(&half(&inputs.w));
        // Plain GEMV against the dot of the half values.
        let mut plain = vec![0f32; tokens * n];
        ops::matmul(&inputs.x, &inputs.w, k, &mut plain);
        let decode = GemvSpec::decode(quant::WeightFormat::Dense(Ty::F16), k);
        for spec in [decode, decode.prefill(), decode.with_x_vectors()] {
            let out = run_gemv(
                &gemv::gemv("gemv_f16", "test", spec),
                &inputs.x,
                w.clone(),
                (tokens, n, k, k),
            );
            close(
                &out.to_f32().unwrap(),
                &plain,
                1e-5,
                &format!("{tokens}×{n}×{k} {spec:?}"),
            );
        }
        // The residual norm prologue, and the GLU epilogue after it.
        let want = residual_reference(&inputs, (tokens, n, k), |v| v, 1.0, 1e-6);
        let act = GluAct::Silu;
        let gated = residual_glu_reference(&want, (tokens, n, k), act);
        for spec in [decode.with_norm(norm), decode.with_norm(norm).prefill()] {
            let kernel = gemv::gemv("norm_gemv_f16", "test", spec);
            let out = try_run_residual_matmul((&kernel, None), &inputs, w.clone(), (tokens, n, k, n), 1).unwrap();
            close(&out.to_f32().unwrap(), &want, 1e-5, &format!("{spec:?}"));
            let kernel = gemv::gemv("glu_gemv_f16", "test", spec.with_glu(act));
            let out = try_run_residual_matmul((&kernel, None), &inputs, w.clone(), (tokens, n, k, n / 2), 1).unwrap();
            close(&out.to_f32().unwrap(), &gated, 1e-5, &format!("{spec:?} with the GLU"));
        }
    }
    // The GEMM: weights and activations rounded to bf16 in the tile.
    let gemm = gemm_mma::gemm_mma_with(
        "gemm_f16",
        "test",
        gemm_mma::WeightStaging::HalfWeights,
        Some(norm),
        None,
    );
    let reduce = split_k::reduce("reduce", "test", 16, None, Some(norm));
    let (tokens, n, k) = (20, 70, 136);
    let mut inputs = Residual::random(&mut rng, (tokens, n, k), (k + 3, k));
    inputs.w = exact(&inputs.w);
    let round = |v: f32| bf16::from_f32(v).to_f32();
    let want = residual_reference(&inputs, (tokens, n, k), round, 1.0, 1e-6);
    for splits in [1, 3] {
        let w = Array::f16(&half(&inputs.w));
        let out = try_run_residual_matmul((&gemm, Some(&reduce)), &inputs, w, (tokens, n, k, n), splits).unwrap();
        close(
            &out.to_f32().unwrap(),
            &want,
            1e-5,
            &format!("f16 gemm, {splits} splits"),
        );
    }
}

/// Run a prefill GEMM kernel on `(tokens, n, k)` shapes with activations `pad` columns wider
/// than `k` and compare with the reference on bf16-rounded inputs.
fn gemm_matches_reference(kernel: &Kernel, shapes: &[(usize, usize, usize)], pad: usize, seed: u64) {
    let mut rng = Rng(seed);
    for &(tokens, n, k) in shapes {
        let x_stride = k + pad;
        let (x, w) = (rng.vec(tokens * x_stride), rng.vec(n * k));
        let round = |v: &[f32]| v.iter().map(|&a| bf16::from_f32(a).to_f32()).collect::<Vec<_>>();
        let dense_x: Vec<f32> = x.chunks(x_stride).flat_map(|row| round(&row[..k])).collect();
        let mut want = vec![0f32; tokens * n];
        ops::matmul(&dense_x, &round(&w), k, &mut want);
        let w = bf16_array(&w);
        let out = try_run_matmul(kernel, Array::f32(&x), None, w, (tokens, n, k, x_stride))
            .unwrap_or_else(|e| panic!("{tokens}×{n}×{k}: {e}"));
        close(
            &out.to_f32().unwrap(),
            &want,
            1e-5,
            &format!("{} {tokens}×{n}×{k}", kernel.name),
        );
    }
}

#[test]
fn tensor_core_gemm_matches_reference_on_bf16_inputs() {
    // One tile, ragged edges, several tiles each way with a ragged K step.
    let shapes = [
        (16, 8, 16),
        (20, 13, 40),
        (3, 70, 100),
        (33, 9, 16),
        (64, 64, 32),
        (130, 70, 72),
    ];
    let registers = gemm_mma::gemm_mma("gemm", "test", gemm_mma::WeightStaging::Registers);
    gemm_matches_reference(&registers, &shapes, 0, 12);
    gemm_matches_reference(&registers, &shapes[1..3], 3, 14);
    // The cp.async weight pipeline needs K a multiple of 8 (the last shape: K past two stages).
    let shapes = [
        (16, 8, 16),
        (20, 13, 40),
        (3, 70, 104),
        (64, 64, 32),
        (130, 70, 72),
        (70, 130, 200),
    ];
    let pipelined = gemm_mma::gemm_mma("gemm", "test", gemm_mma::WeightStaging::CpAsync);
    gemm_matches_reference(&pipelined, &shapes, 0, 19);
    gemm_matches_reference(&pipelined, &shapes[1..3], 3, 20);
}

#[test]
fn hopper_wgmma_gemm_matches_reference_on_bf16_inputs() {
    // K a multiple of 8 (the kernel's contract): one k step and one tile, ragged tokens and
    // rows, a ragged last k step, several tiles each way, and K past two pipeline stages.
    let shapes = [
        (16, 8, 16),
        (20, 13, 40),
        (3, 70, 104),
        (64, 128, 64),
        (130, 140, 200),
        (70, 260, 136),
    ];
    let in_step =
        gemm_wgmma::gemm_wgmma_bf16_scheduled("gemm", "test", None, None, gemm_wgmma::Schedule::IN_STEP_TWO_STAGES);
    let two_stages =
        gemm_wgmma::gemm_wgmma_bf16_scheduled("gemm", "test", None, None, gemm_wgmma::Schedule::AHEAD_TWO_STAGES);
    for gemm in [gemm_wgmma::gemm_wgmma_bf16("gemm", "test"), in_step, two_stages] {
        gemm_matches_reference(&gemm, &shapes, 0, 15);
        gemm_matches_reference(&gemm, &shapes[1..3], 5, 16);
    }
}

/// The shapes the TMA GEMMs are checked on: (tokens, weight rows, K, activation row padding);
/// one K step and one tile, ragged everything with a ring refilled, and few tokens over
/// several weight tiles.
const TMA_SHAPES: [(usize, usize, usize, usize); 4] =
    [(20, 13, 40, 0), (130, 140, 264, 8), (3, 300, 136, 0), (17, 300, 136, 0)];

/// A TMA GEMM on bf16 activations (rows `x_stride` apart, a multiple of 8) and weights against
/// the reference on the same bf16 values, over [`TMA_SHAPES`]: in one piece, and in three K
/// splits summed by the reduction (steps under 16 rows run the GEMV in plans, where the
/// reduction skips them, so those are not split). Ragged tokens, rows and last K step: TMA
/// fills past them with zeros.
fn tma_gemm_matches_reference(gemm: &Kernel, seed: u64) {
    let mut rng = Rng(seed);
    let reduce = split_k::reduce("reduce", "test", 16, None, None);
    // Over halves (`halves::over_halves`) the operands are f16.
    let halves = matches!(gemm.param("w"), Some(dsl::Param::Buffer { ty: Ty::F16, .. }));
    let array = |v: &[f32]| match halves {
        true => cache_array(Ty::F16, v),
        false => bf16_array(v),
    };
    for (tokens, n, k, pad) in TMA_SHAPES {
        let x_stride = k + pad;
        let (x, w) = (rng.vec(tokens * x_stride), rng.vec(n * k));
        let round = |v: &[f32]| match halves {
            true => stored_in(Ty::F16, v),
            false => v.iter().map(|&a| bf16::from_f32(a).to_f32()).collect::<Vec<_>>(),
        };
        let dense_x: Vec<f32> = x.chunks(x_stride).flat_map(|row| round(&row[..k])).collect();
        let mut want = vec![0f32; tokens * n];
        ops::matmul(&dense_x, &round(&w), k, &mut want);
        let (x, w) = (array(&x), array(&w));
        let dims = (tokens, n, k, x_stride);
        let what = format!("{tokens}×{n}×{k}\n{}", gemm.origin);
        let whole = try_run_matmul(gemm, x.clone(), None, w.clone(), dims).unwrap_or_else(|e| panic!("{what}: {e}"));
        close(&whole.to_f32().unwrap(), &want, 1e-5, &what);
        if tokens < 16 {
            continue;
        }
        let split = try_run_split_matmul((gemm, &reduce), x, None, w, dims, 3)
            .unwrap_or_else(|e| panic!("{what}, 3 splits: {e}"));
        close(&split.to_f32().unwrap(), &want, 1e-5, &format!("{what}, 3 splits"));
    }
}

/// Each target's TMA GEMM over IEEE halves (`halves::over_halves`: weights multiplied as
/// stored, activations rounded to half) against the reference on the same halves, in one piece
/// and K split: Hopper's block-driven and persistent warp-specialised tiles and its batch tile,
/// the B200's wide, warp-specialised and batch tiles, the RTX PRO 6000's. A GEMM that took the
/// halves as bf16 would read other values.
#[test]
fn tma_gemms_over_halves_match_reference() {
    use gemm_tma_tcgen05::TcgenTile;
    use gemm_tma_wgmma::TmaTile;
    let gemms = [
        gemm_tma_wgmma::gemm_tma_wgmma_bf16("gemm", "test", TmaTile::WIDE),
        gemm_tma_wgmma::gemm_tma_wgmma_bf16("gemm", "test", TmaTile::SPECIALISED.persistent(2)),
        gemm_tma_wgmma::gemm_tma_wgmma_bf16("gemm", "test", TmaTile::batch(16)),
        gemm_tma_tcgen05::gemm_tma_tcgen05_bf16("gemm", "test", TcgenTile::WIDE),
        gemm_tma_tcgen05::gemm_tma_tcgen05_bf16("gemm", "test", TcgenTile::SPECIALISED),
        gemm_tma_tcgen05::gemm_tma_tcgen05_bf16("gemm", "test", TcgenTile::batch(16)),
        gemm_tma_mma::gemm_tma_mma_bf16("gemm", "test"),
    ];
    for (seed, gemm) in gemms.into_iter().enumerate() {
        tma_gemm_matches_reference(&halves::over_halves(gemm, "gemm_halves"), 60 + seed as u64);
    }
}

/// Hopper's TMA GEMM: tiles of 128 and 256 weight rows, rings of 2 buffers (refilled every
/// other step), 3 and 4, each step's MMAs waited for in the step or overlapping the next; the
/// block's first thread refilling after a block barrier, or a producer warp as the consumer
/// warps release each buffer (warp specialisation), a block a tile or in persistent schedules
/// of 2 and 3 blocks taking up to four tiles each through one ring (which wraps inside a
/// tile and across tiles); and with the weights as wgmma's M (128 rows a tile) and 16, 32 or
/// 64 tokens its N, block-driven and persistent.
#[test]
fn hopper_tma_gemm_matches_reference_on_bf16_inputs() {
    let tiles = [
        gemm_tma_wgmma::TmaTile {
            tile_n: 128,
            tokens: 128,
            stages: 2,
            overlapped: false,
            specialised: false,
            persistent: None,
        },
        gemm_tma_wgmma::TmaTile {
            tile_n: 128,
            tokens: 128,
            stages: 3,
            overlapped: true,
            specialised: false,
            persistent: None,
        },
        gemm_tma_wgmma::TmaTile::WIDEST,
        gemm_tma_wgmma::TmaTile {
            tile_n: 128,
            tokens: 128,
            stages: 2,
            overlapped: false,
            specialised: true,
            persistent: None,
        },
        gemm_tma_wgmma::TmaTile {
            stages: 3,
            ..gemm_tma_wgmma::TmaTile::SPECIALISED
        },
        gemm_tma_wgmma::TmaTile::SPECIALISED_WIDEST,
        gemm_tma_wgmma::TmaTile {
            tile_n: 128,
            tokens: 128,
            stages: 3,
            overlapped: false,
            specialised: true,
            persistent: Some(2),
        },
        gemm_tma_wgmma::TmaTile {
            stages: 2,
            ..gemm_tma_wgmma::TmaTile::SPECIALISED
        }
        .persistent(3),
        gemm_tma_wgmma::TmaTile::SPECIALISED_WIDEST.persistent(2),
        // The weights as wgmma's M, 16 to 64 tokens its N.
        gemm_tma_wgmma::TmaTile::batch(16),
        gemm_tma_wgmma::TmaTile {
            stages: 2,
            overlapped: false,
            ..gemm_tma_wgmma::TmaTile::batch(64)
        },
        gemm_tma_wgmma::TmaTile {
            stages: 3,
            ..gemm_tma_wgmma::TmaTile::batch(32)
        }
        .persistent(2),
    ];
    for (i, tile) in tiles.into_iter().enumerate() {
        tma_gemm_matches_reference(
            &gemm_tma_wgmma::gemm_tma_wgmma_bf16("gemm", "test", tile),
            29 + i as u64,
        );
    }
}

/// Hopper's and the B200's TMA GEMMs with a GLU epilogue, on every schedule: each tile's
/// weights are half gate rows, half the same outputs' up rows (on the B200 in boxes of 16, so
/// each warp's TMEM lanes hold both of 16 outputs), so with one split it stores `act(gate)·up`
/// itself (the reduction after it launching no blocks) and with several it stores both for
/// the reduction to sum and gate. Outputs past a tile's half (`n / 2` not a multiple of it)
/// and ragged tokens and K included.
#[test]
fn tma_gemms_gate_their_own_products() {
    use gemm_tma_tcgen05::TcgenTile;
    use gemm_tma_wgmma::TmaTile;
    let mut rng = Rng(49);
    let hopper = |tile, act| {
        (
            act,
            gemm_tma_wgmma::gemm_tma_wgmma_bf16_gated("gemm", "test", tile, act),
        )
    };
    let b200 = |tile, act| {
        (
            act,
            gemm_tma_tcgen05::gemm_tma_tcgen05_bf16_gated("gemm", "test", tile, act),
        )
    };
    let gemms = [
        hopper(TmaTile::WIDE, GluAct::Silu),
        hopper(
            TmaTile {
                stages: 2,
                ..TmaTile::SPECIALISED
            },
            GluAct::GeluTanh,
        ),
        hopper(TmaTile::SPECIALISED_WIDEST.persistent(2), GluAct::Silu),
        // The weights as M: 8 gate rows then their 8 up rows, a thread's rows r and r + 8.
        hopper(TmaTile::batch(16), GluAct::Silu),
        hopper(
            TmaTile {
                specialised: true,
                ..TmaTile::batch(64)
            },
            GluAct::GeluTanh,
        ),
        b200(
            TcgenTile {
                tile_tokens: 64,
                stages: 2,
                ..TcgenTile::WIDE
            },
            GluAct::GeluTanh,
        ),
        b200(TcgenTile::SPECIALISED, GluAct::Silu),
        b200(TcgenTile::WIDE.persistent(2), GluAct::Silu),
        b200(TcgenTile::batch(16), GluAct::Silu),
        b200(
            TcgenTile {
                specialised: true,
                ..TcgenTile::batch(64)
            },
            GluAct::GeluTanh,
        ),
    ];
    for (act, gemm) in gemms {
        let reduce = split_k::reduce_after_gating("reduce", "test", 16, act);
        for (tokens, n, k, pad) in [(20, 300, 136, 8), (130, 140, 72, 0)] {
            let x_stride = k + pad;
            let (x, w) = (rng.vec(tokens * x_stride), rng.vec(n * k));
            let round = |v: &[f32]| v.iter().map(|&a| bf16::from_f32(a).to_f32()).collect::<Vec<_>>();
            let dense_x: Vec<f32> = x.chunks(x_stride).flat_map(|row| round(&row[..k])).collect();
            let mut products = vec![0f32; tokens * n];
            ops::matmul(&dense_x, &round(&w), k, &mut products);
            let want: Vec<f32> = products.chunks(n).flat_map(|row| ops::glu(row, n, act)).collect();
            for splits in [1, 3] {
                let mut bufs = HashMap::from([
                    ("x".into(), bf16_array(&x)),
                    ("w".into(), bf16_array(&w)),
                    ("out".into(), Array::poisoned(Ty::F32, tokens * n / 2)),
                    ("partial".into(), Array::poisoned(Ty::F32, splits * tokens * n)),
                ]);
                let scalars = ints(&[
                    ("tokens", tokens as i64),
                    ("n", n as i64),
                    ("k", k as i64),
                    ("x_stride", x_stride as i64),
                    ("splits", splits as i64),
                    ("out_stride", n as i64 / 2),
                    ("out_col", 0),
                ]);
                let what = format!("{tokens}×{n}×{k}, {splits} splits\n{}", gemm.origin);
                run(&gemm, &mut bufs, &scalars).unwrap_or_else(|e| panic!("{what}: {e}"));
                run(&reduce, &mut bufs, &scalars).unwrap_or_else(|e| panic!("{what}: {e}"));
                close(&bufs["out"].to_f32().unwrap(), &want, 1e-5, &what);
            }
        }
    }
}

/// Blackwell's TMA GEMM (tcgen05 into tensor memory): tiles of 16, 32, 64, 128 and 256
/// tokens, rings of 2 (refilled every other step), 3, 4 and 6 buffers; one thread driving the
/// ring, or a producer, an MMA and four epilogue warps (warp specialisation), a block a tile or
/// in persistent schedules of 2 and 3 blocks taking up to four tiles each through one ring and
/// two accumulators.
#[test]
fn blackwell_tma_gemm_matches_reference_on_bf16_inputs() {
    use gemm_tma_tcgen05::TcgenTile;
    let tiles = [
        TcgenTile {
            tile_tokens: 64,
            stages: 2,
            ..TcgenTile::WIDE
        },
        TcgenTile::WIDE,
        TcgenTile {
            tile_tokens: 256,
            stages: 3,
            ..TcgenTile::WIDE
        },
        TcgenTile::SPECIALISED,
        TcgenTile {
            tile_tokens: 64,
            stages: 2,
            ..TcgenTile::WIDE
        }
        .persistent(2),
        TcgenTile {
            stages: 3,
            ..TcgenTile::WIDE
        }
        .persistent(3),
        // Decode batches' tiles: 16 tokens (a 32-column allocation for its 16), and 32 in a
        // persistent schedule (its two accumulators side by side in 64 columns).
        TcgenTile::batch(16),
        TcgenTile {
            stages: 3,
            ..TcgenTile::batch(32)
        }
        .persistent(2),
    ];
    for (i, tile) in tiles.into_iter().enumerate() {
        tma_gemm_matches_reference(
            &gemm_tma_tcgen05::gemm_tma_tcgen05_bf16("gemm", "test", tile),
            37 + i as u64,
        );
    }
}

/// The TMA-fed `mma.sync` GEMM (the RTX PRO 6000's): fragments read from swizzled boxes, a
/// ring of 3 refilled from the fourth step.
#[test]
fn tma_mma_gemm_matches_reference_on_bf16_inputs() {
    tma_gemm_matches_reference(&gemm_tma_mma::gemm_tma_mma_bf16("gemm", "test"), 47);
}

/// Blackwell's TMA GEMM without its wait for the previous step's MMAs before refilling their
/// buffer, or without the wait for the last MMAs before reading tensor memory, fails with the
/// reason.
#[test]
fn the_blackwell_tma_gemm_fails_without_its_waits() {
    // The final wait's slot is `(steps - 1) % stages`, the refill's `(step - 1) % stages`:
    // told apart by the loop variable.
    let without_waits_on = |body: &[Stmt], slot_is_last: bool| {
        edited(body, &|s| match s {
            Stmt::Mbarrier(m) => match &**m {
                Mbarrier::Wait { barrier, .. }
                    if barrier.array == "done" && format!("{:?}", barrier.slot).contains("steps") == slot_is_last =>
                {
                    None
                }
                _ => Some(s.clone()),
            },
            _ => Some(s.clone()),
        })
    };
    let tile = gemm_tma_tcgen05::TcgenTile {
        tile_tokens: 64,
        stages: 2,
        ..gemm_tma_tcgen05::TcgenTile::WIDE
    };
    let gemm = gemm_tma_tcgen05::gemm_tma_tcgen05_bf16("gemm", "test", tile);
    let mut rng = Rng(43);
    let (tokens, n, k) = (20, 16, 256);
    let (x, w) = (bf16_array(&rng.vec(tokens * k)), bf16_array(&rng.vec(n * k)));
    for (last, expected) in [
        (false, "which completes the tcgen05.mma reading it"),
        (true, "tcgen05.ld of TMEM before waiting on the `done[1]` phase"),
    ] {
        let mut broken = gemm.clone();
        broken.body = without_waits_on(&gemm.body, last);
        assert_ne!(broken.body, gemm.body);
        let message = try_run_matmul(&broken, x.clone(), None, w.clone(), (tokens, n, k, k))
            .unwrap_err()
            .to_string();
        assert!(message.contains(expected), "{message}");
    }
}

/// The warp-specialised Blackwell GEMM needs each of its hand-overs, and the emulator says why
/// when one is missing (a persistent schedule of two blocks, each taking three tiles through
/// a ring of 2 and two accumulators): without the MMA warp's wait for the epilogue to hand an
/// accumulator back, its MMAs overwrite what an epilogue warp read, ordered by nothing;
/// without the epilogue's wait for the accumulator, it reads tensor memory before the MMAs'
/// commit is known complete; without the producer's wait for the MMAs' commit, it refills a
/// buffer ordered after nothing (neither the MMAs reading it nor the copy before).
#[test]
fn the_specialised_blackwell_gemm_fails_without_any_of_its_hand_overs() {
    let tile = gemm_tma_tcgen05::TcgenTile {
        tile_tokens: 64,
        stages: 2,
        ..gemm_tma_tcgen05::TcgenTile::WIDE
    }
    .persistent(2);
    let gemm = gemm_tma_tcgen05::gemm_tma_tcgen05_bf16("gemm", "test", tile);
    let mut rng = Rng(45);
    // Six tiles (three of tokens, two of weight rows) of three K steps.
    let (tokens, n, k) = (150, 200, 136);
    let (x, w) = (bf16_array(&rng.vec(tokens * k)), bf16_array(&rng.vec(n * k)));
    let whole = try_run_matmul(&gemm, x.clone(), None, w.clone(), (tokens, n, k, k)).unwrap();
    let mut want = vec![0f32; tokens * n];
    let round = |v: &Array| v.to_f32().unwrap();
    ops::matmul(&round(&x), &round(&w), k, &mut want);
    close(&whole.to_f32().unwrap(), &want, 1e-5, "the unbroken GEMM");
    let waits_on = |array: &'static str| {
        move |s: &Stmt| match s {
            Stmt::Mbarrier(m) if matches!(&**m, Mbarrier::Wait { barrier, .. } if barrier.array == array) => None,
            other => Some(other.clone()),
        }
    };
    let (acc_empty, acc_full, empty) = (waits_on("acc_empty"), waits_on("acc_full"), waits_on("empty"));
    for (what, edit, expected) in [
        (
            "the MMA warp's wait for the accumulator",
            &acc_empty as &dyn Fn(&Stmt) -> Option<Stmt>,
            "that warp 0 read (tcgen05.ld), with no mbarrier it arrived on after the read waited on first",
        ),
        (
            "the epilogue's wait",
            &acc_full,
            "tcgen05.ld of TMEM before waiting on the",
        ),
        (
            "the producer's wait",
            &empty,
            "TMA copy overwrites xs[0] before waiting",
        ),
    ] {
        fails_without(&gemm, (&x, &w), (tokens, n, k), (what, edit, expected));
    }
}

/// Each of the TMA GEMM's synchronisations is needed, and the emulator says why when one is
/// missing: without the barrier wait the tensor cores read a buffer before its copy is known
/// to have landed; without the `__syncthreads()` after the multiply, thread 0 refills a
/// buffer the other warpgroup may still be reading (the ring of 2 is refilled at step 2);
/// waiting for all but the last MMA group, it refills the buffer those MMAs still read.
#[test]
fn the_tma_gemm_fails_without_any_of_its_synchronisations() {
    let strip = |body: &[Stmt], drop: &dyn Fn(&Stmt) -> bool| edited(body, &|s| (!drop(s)).then(|| s.clone()));
    let tile = gemm_tma_wgmma::TmaTile {
        tile_n: 128,
        tokens: 128,
        stages: 2,
        overlapped: false,
        specialised: false,
        persistent: None,
    };
    let gemm = gemm_tma_wgmma::gemm_tma_wgmma_bf16("gemm", "test", tile);
    let mut rng = Rng(31);
    let (tokens, n, k) = (20, 16, 256);
    let (x, w) = (bf16_array(&rng.vec(tokens * k)), bf16_array(&rng.vec(n * k)));
    for (what, drop, expected) in [
        (
            "the barrier wait",
            &(|s: &Stmt| matches!(s, Stmt::Mbarrier(m) if matches!(**m, Mbarrier::Wait { .. })))
                as &dyn Fn(&Stmt) -> bool,
            "before waiting for phase 0 of mbarrier full[0]",
        ),
        (
            "the barrier before a refill",
            &|s: &Stmt| matches!(s, Stmt::SyncThreads),
            "read by warpgroup 1's tensor cores without a __syncthreads()",
        ),
    ] {
        let mut broken = gemm.clone();
        broken.body = strip(&gemm.body, drop);
        // Only the loop's barrier: the one after the barriers' initialisation stays.
        if what == "the barrier before a refill" {
            let at = gemm.body.iter().position(|s| matches!(s, Stmt::SyncThreads)).unwrap();
            broken.body.insert(at, Stmt::SyncThreads);
        }
        let message = try_run_matmul(&broken, x.clone(), None, w.clone(), (tokens, n, k, k))
            .unwrap_err()
            .to_string();
        assert!(message.contains(expected), "without {what}: {message}");
    }
    // Leaving a step's MMAs in flight while refilling the buffer they read.
    let early = |body: &[Stmt]| {
        edited(body, &|s| match s {
            Stmt::WgmmaWait(0) => Some(Stmt::WgmmaWait(1)),
            other => Some(other.clone()),
        })
    };
    let mut broken = gemm.clone();
    broken.body = early(&gemm.body);
    let message = try_run_matmul(&broken, x, None, w, (tokens, n, k, k))
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("while a tensor-core MMA reading it is in flight"),
        "{message}"
    );
}

/// The warp-specialised TMA GEMM needs each of its synchronisations, and the emulator says
/// why when one is missing: without the producer's wait on a buffer's `empty` barrier it
/// refills a buffer the consumer warpgroups' tensor cores read, ordered by nothing; with the
/// consumers releasing a buffer before their MMAs reading it retire, the refill overwrites
/// it under MMAs in flight; without the consumers' wait on `full`, the tensor cores read a
/// buffer before its copy is known to have landed.
#[test]
fn the_specialised_tma_gemm_fails_without_any_of_its_synchronisations() {
    let tile = gemm_tma_wgmma::TmaTile {
        stages: 2,
        ..gemm_tma_wgmma::TmaTile::SPECIALISED
    };
    let gemm = gemm_tma_wgmma::gemm_tma_wgmma_bf16("gemm", "test", tile);
    let mut rng = Rng(33);
    let (tokens, n, k) = (20, 16, 320);
    let (x, w) = (bf16_array(&rng.vec(tokens * k)), bf16_array(&rng.vec(n * k)));
    let waits_on = |s: &Stmt, array: &str| matches!(s, Stmt::Mbarrier(m) if matches!(&**m, Mbarrier::Wait { barrier, .. } if barrier.array == array));
    let early_release = |s: &Stmt| match s {
        Stmt::WgmmaWait(1) => Some(Stmt::WgmmaWait(2)),
        other => Some(other.clone()),
    };
    for (what, edit, expected) in [
        (
            "the producer's wait",
            &(|s: &Stmt| (!waits_on(s, "empty")).then(|| s.clone())) as &dyn Fn(&Stmt) -> Option<Stmt>,
            "read by warpgroup 0's tensor cores without a __syncthreads() between",
        ),
        (
            "the MMAs retired before the release",
            &early_release,
            "while a tensor-core MMA reading it is in flight",
        ),
        (
            "the consumers' wait",
            &|s: &Stmt| (!waits_on(s, "full")).then(|| s.clone()),
            "before waiting for phase 0 of mbarrier full[0]",
        ),
    ] {
        fails_without(&gemm, (&x, &w), (tokens, n, k), (what, edit, expected));
    }
}

/// In a persistent schedule a block's ring runs on from one tile into the next, so the
/// consumers' release of a tile's last buffer is needed, and the producer must wait for the
/// release of a buffer's previous use: without that release, or waiting on the wrong phase,
/// the producer waits for a phase nothing completes, and the emulator says which.
#[test]
fn the_persistent_tma_gemm_fails_without_its_ring_across_tiles() {
    let tile = gemm_tma_wgmma::TmaTile {
        stages: 2,
        ..gemm_tma_wgmma::TmaTile::SPECIALISED
    }
    .persistent(2);
    let gemm = gemm_tma_wgmma::gemm_tma_wgmma_bf16("gemm", "test", tile);
    let mut rng = Rng(35);
    // Three tiles of three steps: the first block takes two of them through its ring of 2.
    let (tokens, n, k) = (3, 300, 136);
    let (x, w) = (bf16_array(&rng.vec(tokens * k)), bf16_array(&rng.vec(n * k)));
    let last_release = |s: &Stmt| match s {
        Stmt::If { cond, then, .. }
            if format!("{cond:?}").contains("\"steps\"")
                && matches!(&then[..], [Stmt::Mbarrier(m)] if matches!(&**m, Mbarrier::Arrive { .. })) =>
        {
            None
        }
        other => Some(other.clone()),
    };
    let this_phase = |s: &Stmt| match s {
        Stmt::Mbarrier(m) => match &**m {
            Mbarrier::Wait { barrier, .. } if barrier.array == "empty" => {
                Some(Stmt::Mbarrier(Box::new(Mbarrier::Wait {
                    barrier: barrier.clone(),
                    parity: dsl::rem(dsl::var("it") / dsl::int(2), dsl::int(2)),
                })))
            }
            _ => Some(s.clone()),
        },
        other => Some(other.clone()),
    };
    for (what, edit) in [
        (
            "the release of a tile's last buffer",
            &last_release as &dyn Fn(&Stmt) -> Option<Stmt>,
        ),
        ("the wait for the previous use", &this_phase),
    ] {
        let expected = "of mbarrier empty[0], which never completes";
        fails_without(&gemm, (&x, &w), (tokens, n, k), (what, edit, expected));
    }
}

/// A statement-by-statement edit of a kernel's body (`None` drops the statement).
type Edit<'a> = &'a dyn Fn(&Stmt) -> Option<Stmt>;

/// The edit leaving out every statement `drop` picks.
fn dropping(drop: fn(&Stmt) -> bool) -> impl Fn(&Stmt) -> Option<Stmt> {
    move |s| (!drop(s)).then(|| s.clone())
}

/// Whether `s` waits on an mbarrier of `array`.
fn waits_on(s: &Stmt, array: &str) -> bool {
    matches!(s, Stmt::Mbarrier(m) if matches!(&**m, Mbarrier::Wait { barrier, .. } if barrier.array == array))
}

/// Whether `s` arrives on an mbarrier of `array` (a plain arrival).
fn arrives_on(s: &Stmt, array: &str) -> bool {
    matches!(s, Stmt::Mbarrier(m) if matches!(&**m, Mbarrier::Arrive { barrier } if barrier.array == array))
}

/// Whether `s` announces transaction bytes on an mbarrier.
fn announces_bytes(s: &Stmt) -> bool {
    matches!(s, Stmt::Mbarrier(m) if matches!(&**m, Mbarrier::ArriveExpectTx { .. }))
}

/// `gemm`'s body with `edit` applied (leaving out `what`) runs on `x` and `w` (`tokens × k`,
/// `n × k`) into a fault whose message contains `expected`.
fn fails_without(
    gemm: &Kernel,
    (x, w): (&Array, &Array),
    (tokens, n, k): (usize, usize, usize),
    (what, edit, expected): (&str, Edit, &str),
) {
    let mut broken = gemm.clone();
    broken.body = edited(&gemm.body, edit);
    assert_ne!(broken.body, gemm.body, "{what}");
    let message = try_run_matmul(&broken, x.clone(), None, w.clone(), (tokens, n, k, k))
        .unwrap_err()
        .to_string();
    assert!(message.contains(expected), "without {what}: {message}");
}

/// The Hopper and Blackwell GEMMs with an RMSNorm prologue (`rms_norm_matmul` at many rows):
/// each x meets its norm weight before the bf16 rounding, the row's 1/rms scales the result;
/// in one piece and with K split, over a strided x, rows past the 16 a warp owns and more
/// than one token tile.
#[test]
fn norm_gemm_matches_reference() {
    let mut rng = Rng(23);
    let (eps, offset) = (1e-5f32, 1.0f32);
    let norm = gemv::NormPrologue::new(eps, offset);
    let reduce = split_k::reduce("reduce", "test", 16, None, Some(norm));
    for gemm in prologue_gemms(Some(norm), None) {
        for (tokens, n, k, pad) in [(20, 70, 136, 3), (33, 9, 256, 0), (70, 130, 40, 0)] {
            let x_stride = k + pad;
            let (x, g, w) = (rng.vec(tokens * x_stride), rng.vec(k), rng.vec(n * k));
            let round = |v: f32| bf16::from_f32(v).to_f32();
            let mut want = vec![0f32; tokens * n];
            for t in 0..tokens {
                let row = &x[t * x_stride..t * x_stride + k];
                let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f32>() / k as f32 + eps).sqrt();
                let a: Vec<f32> = row.iter().zip(&g).map(|(v, gi)| round(v * (gi + offset))).collect();
                for r in 0..n {
                    let dot: f32 = a.iter().zip(&w[r * k..(r + 1) * k]).map(|(a, wv)| a * round(*wv)).sum();
                    want[t * n + r] = dot * inv;
                }
            }
            let w = bf16_array(&w);
            for splits in [1, 3] {
                let dims = (tokens, n, k, x_stride);
                let out =
                    try_run_split_matmul((&gemm, &reduce), Array::f32(&x), Some(&g), w.clone(), dims, splits).unwrap();
                close(
                    &out.to_f32().unwrap(),
                    &want,
                    1e-5,
                    &format!("norm gemm {tokens}×{n}×{k}, {splits} splits\n{}", gemm.origin),
                );
            }
        }
    }
}

/// The Hopper and Blackwell GEMMs with K split into pieces summed by the reduction: the same
/// result for any number of splits, splits past the end of K included (they contribute
/// zeros), and ragged K.
#[test]
fn split_k_gemm_matches_reference() {
    let mut rng = Rng(21);
    let reduce = split_k::reduce("reduce", "test", 16, None, None);
    for gemm in prologue_gemms(None, None) {
        for (tokens, n, k) in [(16, 130, 520), (20, 64, 256), (17, 8, 136)] {
            let (x, w) = (rng.vec(tokens * k), rng.vec(n * k));
            let round = |v: &[f32]| v.iter().map(|&a| bf16::from_f32(a).to_f32()).collect::<Vec<_>>();
            let mut want = vec![0f32; tokens * n];
            ops::matmul(&round(&x), &round(&w), k, &mut want);
            let w = bf16_array(&w);
            for splits in [2, 3, 5, 8] {
                let out = try_run_split_matmul(
                    (&gemm, &reduce),
                    Array::f32(&x),
                    None,
                    w.clone(),
                    (tokens, n, k, k),
                    splits,
                )
                .unwrap_or_else(|e| panic!("{tokens}×{n}×{k}, {splits} splits: {e}"));
                close(
                    &out.to_f32().unwrap(),
                    &want,
                    1e-5,
                    &format!("{tokens}×{n}×{k}, {splits} splits\n{}", gemm.origin),
                );
            }
        }
    }
}

#[test]
fn blackwell_tcgen05_gemm_matches_reference_on_bf16_inputs() {
    // K a multiple of 8: one k step, ragged tokens and rows, a ragged last k step, several
    // tiles each way (64 tokens × 128 rows a tile), and K past two pipeline stages.
    let shapes = [
        (16, 8, 16),
        (20, 13, 40),
        (3, 130, 104),
        (64, 128, 32),
        (130, 140, 200),
        (70, 260, 136),
    ];
    gemm_matches_reference(&gemm_tcgen05::gemm_tcgen05_bf16("gemm", "test"), &shapes, 0, 17);
    gemm_matches_reference(&gemm_tcgen05::gemm_tcgen05_bf16("gemm", "test"), &shapes[1..3], 5, 18);
}

/// The attention the cache-layout tests run: no window, scale 0.35.
fn cache_test_spec(heads: usize, kv_heads: usize, head_dim: usize) -> ir::AttentionSpec {
    ir::AttentionSpec {
        heads,
        kv_heads,
        head_dim,
        scale: 0.35,
        window: None,
        cache_slot: 0,
        cache_dtype: ir::DType::F32,
    }
}

/// The attention kernel's scalars for `spec` over a step of `tokens` rows after `first`
/// cached positions, in blocks of `block_size`.
fn attention_scalars(
    spec: &ir::AttentionSpec,
    tokens: usize,
    first: usize,
    block_size: usize,
) -> HashMap<String, Scalar> {
    let mut scalars = ints(&[
        ("tokens", tokens as i64),
        ("q_stride", (spec.heads * spec.head_dim) as i64),
        ("first", first as i64),
        ("heads", spec.heads as i64),
        ("kv_heads", spec.kv_heads as i64),
        ("window", spec.window.map_or(0, |w| w as i64)),
        ("block_size", block_size as i64),
    ]);
    scalars.insert("scale".into(), Scalar::F32(spec.scale as f32));
    scalars
}

/// A paged cache (blocks scattered through a pool by a block table) gives the same attention
/// as the contiguous one, and appends land in the right physical rows.
#[test]
fn paged_attention_and_append_match_the_contiguous_cache() {
    use kernels_gen::templates::cache_layout::CacheLayout;
    let mut rng = Rng(13);
    let (heads, kv_heads, head_dim, block_size) = (4, 2, 8, 4);
    let kv_dim = kv_heads * head_dim;
    let (first, tokens) = (9, 2);
    let len = first + tokens;
    // Logical blocks 0..3 live in physical blocks 5, 1, 3 of a pool of 6.
    let table = [5i64, 1, 3];
    let pool_rows = 6 * block_size;
    let (k, v) = (rng.vec(len * kv_dim), rng.vec(len * kv_dim));
    let q = rng.vec(tokens * heads * head_dim);
    let physical = |p: usize| table[p / block_size] as usize * block_size + p % block_size;
    // Place the first `first` positions in the pool by hand; the kernel appends the rest.
    let mut kpool = vec![0f32; pool_rows * kv_dim];
    let mut vpool = vec![0f32; pool_rows * kv_dim];
    for p in 0..first {
        kpool[physical(p) * kv_dim..(physical(p) + 1) * kv_dim].copy_from_slice(&k[p * kv_dim..(p + 1) * kv_dim]);
        vpool[physical(p) * kv_dim..(physical(p) + 1) * kv_dim].copy_from_slice(&v[p * kv_dim..(p + 1) * kv_dim]);
    }
    let mut bufs = HashMap::from([
        ("k_src".into(), Array::f32(&k[first * kv_dim..])),
        ("v_src".into(), Array::f32(&v[first * kv_dim..])),
        ("k_cache".into(), Array::f32(&kpool)),
        ("v_cache".into(), Array::f32(&vpool)),
        ("block_table".into(), Array::ints(Ty::I32, &table)),
    ]);
    let scalars = ints(&[
        ("tokens", tokens as i64),
        ("kv_dim", kv_dim as i64),
        ("first", first as i64),
        ("k_stride", kv_dim as i64),
        ("v_stride", kv_dim as i64),
        ("block_size", block_size as i64),
    ]);
    run(
        &kv_append::kv_append_with("append", "test", CacheLayout::Paged, Ty::F32),
        &mut bufs,
        &scalars,
    )
    .unwrap();
    let k_pool = bufs.remove("k_cache").unwrap();
    bufs.insert("k".into(), k_pool);
    let v_pool = bufs.remove("v_cache").unwrap();
    bufs.insert("v".into(), v_pool);
    bufs.insert("q".into(), Array::f32(&q));
    let spec = cache_test_spec(heads, kv_heads, head_dim);
    let outs: Vec<Vec<f32>> = split_passes(CacheLayout::Paged, head_dim, 2, Ty::F32)
        .iter()
        .map(|pass| {
            run_attention(
                pass,
                &mut bufs,
                &attention_scalars(&spec, tokens, first, block_size),
                (tokens, heads, head_dim),
                3,
            )
        })
        .collect();
    let slot = ir::reference::KvSlot {
        positions: (0..len).collect(),
        k,
        v,
    };
    let positions: Vec<usize> = (first..len).collect();
    let want = ir::reference::attention_over_slot(
        &spec,
        &ir::Tensor::new(vec![tokens, heads * head_dim], q),
        &slot,
        &positions,
    );
    assert_eq!(outs.len(), 2, "both split passes");
    for out in outs {
        close(&out, &want.data, 1e-5, "paged attention");
    }
}

/// A batched step: rows of two sequences (one decoding after 9 cached positions, one starting
/// a 3-token prompt) in one launch, their blocks interleaved in one pool, each row with its own
/// position and block table: every row attends to its own sequence only, and every appended
/// key lands in its sequence's block.
/// In an f32 cache, a bf16 one (what a bf16 model's plan keeps), a half one and an FP8 one:
/// keys and values rounded as appended, widened as read.
#[test]
fn batched_attention_and_append_keep_sequences_apart() {
    for cache in [Ty::F32, Ty::Bf16, Ty::F16, Ty::F8E4M3] {
        batched_step_matches_reference(cache);
    }
}

fn batched_step_matches_reference(cache: Ty) {
    use kernels_gen::templates::cache_layout::CacheLayout;
    let dtype = match cache {
        Ty::Bf16 => ir::DType::BF16,
        Ty::F16 => ir::DType::F16,
        Ty::F8E4M3 => ir::DType::F8E4M3,
        _ => ir::DType::F32,
    };
    let pool = |values: &[f32]| match cache {
        Ty::Bf16 => bf16_array(values),
        Ty::F16 => Array::f16(&values.iter().map(|&x| half::f16::from_f32(x)).collect::<Vec<_>>()),
        Ty::F8E4M3 => fp8_array(values),
        _ => Array::f32(values),
    };
    let mut rng = Rng(15);
    // A 16-byte load of FP8 is 16 elements: the vector pass needs a head that wide.
    let head_dim = if cache == Ty::F8E4M3 { 16 } else { 8 };
    let (heads, kv_heads, block_size) = (4, 2, 4);
    let kv_dim = kv_heads * head_dim;
    // (cached positions, new rows, physical blocks)
    let seqs = [(9usize, 1usize, vec![5i64, 0, 3]), (0, 3, vec![2])];
    let pool_rows = 6 * block_size;
    let tables: Vec<i64> = seqs.iter().flat_map(|s| s.2.clone()).collect();
    let (mut row_table, mut row_pos) = (Vec::new(), Vec::new());
    let (mut kpool, mut vpool) = (vec![0f32; pool_rows * kv_dim], vec![0f32; pool_rows * kv_dim]);
    let (mut new_k, mut new_v, mut q) = (Vec::new(), Vec::new(), Vec::new());
    let mut per_seq = Vec::new();
    let mut table_at = 0;
    for (first, rows, table) in &seqs {
        let len = first + rows;
        let (k, v) = (rng.vec(len * kv_dim), rng.vec(len * kv_dim));
        let physical = |p: usize| table[p / block_size] as usize * block_size + p % block_size;
        for p in 0..*first {
            kpool[physical(p) * kv_dim..(physical(p) + 1) * kv_dim].copy_from_slice(&k[p * kv_dim..(p + 1) * kv_dim]);
            vpool[physical(p) * kv_dim..(physical(p) + 1) * kv_dim].copy_from_slice(&v[p * kv_dim..(p + 1) * kv_dim]);
        }
        new_k.extend_from_slice(&k[first * kv_dim..]);
        new_v.extend_from_slice(&v[first * kv_dim..]);
        let qs = rng.vec(rows * heads * head_dim);
        q.extend_from_slice(&qs);
        for t in 0..*rows {
            row_table.push(table_at);
            row_pos.push((first + t) as i64);
        }
        table_at += table.len() as i64;
        per_seq.push((k, v, qs, *first, len));
    }
    let tokens = row_pos.len();
    let step = |b: &mut HashMap<String, Array>| {
        b.insert("block_tables".into(), Array::ints(Ty::I32, &tables));
        b.insert("row_table".into(), Array::ints(Ty::I32, &row_table));
        b.insert("row_pos".into(), Array::ints(Ty::I32, &row_pos));
    };
    let mut bufs = HashMap::from([
        ("k_src".into(), Array::f32(&new_k)),
        ("v_src".into(), Array::f32(&new_v)),
        ("k_cache".into(), pool(&kpool)),
        ("v_cache".into(), pool(&vpool)),
    ]);
    step(&mut bufs);
    let scalars = ints(&[
        ("tokens", tokens as i64),
        ("kv_dim", kv_dim as i64),
        ("first", 0),
        ("k_stride", kv_dim as i64),
        ("v_stride", kv_dim as i64),
        ("block_size", block_size as i64),
    ]);
    let append = kv_append::kv_append_with("append", "test", CacheLayout::Batched, cache);
    run(&append, &mut bufs, &scalars).unwrap();
    let k_pool = bufs.remove("k_cache").unwrap();
    bufs.insert("k".into(), k_pool);
    let v_pool = bufs.remove("v_cache").unwrap();
    bufs.insert("v".into(), v_pool);
    step(&mut bufs);
    bufs.insert("q".into(), Array::f32(&q));
    let spec = ir::AttentionSpec {
        cache_dtype: dtype,
        ..cache_test_spec(heads, kv_heads, head_dim)
    };
    let passes = split_passes(CacheLayout::Batched, head_dim, 2, cache);
    assert_eq!(passes.len(), 2, "both split passes");
    let outs: Vec<Vec<f32>> = passes
        .iter()
        .map(|pass| {
            run_attention(
                pass,
                &mut bufs,
                &attention_scalars(&spec, tokens, 0, block_size),
                (tokens, heads, head_dim),
                attention::splits_for(tokens),
            )
        })
        .collect();
    let mut want = Vec::new();
    let stored = |x: Vec<f32>| x.into_iter().map(|e| ops::stored_as(e, dtype)).collect();
    for (k, v, qs, first, len) in per_seq {
        let slot = ir::reference::KvSlot {
            positions: (0..len).collect(),
            k: stored(k),
            v: stored(v),
        };
        let positions: Vec<usize> = (first..len).collect();
        let q = ir::Tensor::new(vec![len - first, heads * head_dim], qs);
        want.extend(ir::reference::attention_over_slot(&spec, &q, &slot, &positions).data);
    }
    for (out, pass) in outs.iter().zip(&passes) {
        close(out, &want, 1e-5, &format!("batched attention: {}", pass.origin));
    }
}

/// The sampler picks the token whose cumulative probability interval holds `u` (computed here
/// in f64, left to right); draws near an interval's edge may fall either side within f32
/// rounding, so those are checked against the interval with a tolerance.
#[test]
fn sampling_inverts_the_cdf() {
    let mut rng = Rng(14);
    for v in [3, 300, 1000] {
        let logits = rng.vec(v).iter().map(|x| x * 4.0).collect::<Vec<f32>>();
        let us: Vec<f32> = vec![0.0, 0.13, 0.5, 0.77, 0.999_999];
        for temperature in [0.7f32, 1.5] {
            let rows = us.len();
            let all: Vec<f32> = (0..rows).flat_map(|_| logits.clone()).collect();
            let kernel = sample::sample("sample", "test");
            let mut bufs = HashMap::from([
                ("logits".into(), Array::f32(&all)),
                ("u".into(), Array::f32(&us)),
                ("out".into(), Array::poisoned(Ty::I32, rows)),
            ]);
            let mut scalars = ints(&[("rows", rows as i64), ("v", v as i64)]);
            scalars.insert("temperature".into(), Scalar::F32(temperature));
            run(&kernel, &mut bufs, &scalars).unwrap();
            let picks = bufs["out"].to_i64().unwrap();
            let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            let p: Vec<f64> = logits
                .iter()
                .map(|&x| ((x as f64 - max) / temperature as f64).exp())
                .collect();
            let total: f64 = p.iter().sum();
            for (&u, &pick) in us.iter().zip(&picks) {
                let before: f64 = p[..pick as usize].iter().sum::<f64>() / total;
                let after = before + p[pick as usize] / total;
                assert!(
                    before - 1e-5 <= u as f64 && (u as f64) < after + 1e-5,
                    "v {v}, T {temperature}: u {u} picked {pick} covering [{before}, {after})"
                );
            }
        }
    }
}
