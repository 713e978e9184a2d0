//! The INT8-bound head's GPU kernels, chained on the emulator: the argmax they produce equals
//! the argmax of the plain bf16 GEMV head (ties to the lowest id), on random hidden states with
//! exact ties and near-ties; rows quantized by `quant::int8_rows` as at compile time.
//! Also over soft-capped logits, against the GEMV followed by the fused `soft_cap` kernel: at a
//! cap small enough to saturate, most rows tie at the top and the lowest of them must win.

use half::bf16;
use kernels_gen::dsl::Ty;
use kernels_gen::emulator::{run, Array};
use kernels_gen::templates::quant::WeightFormat;
use kernels_gen::templates::{elementwise, gemv, int8_head, top_k};
use quant::int8_rows::Int8Rows;
use std::collections::HashMap;

mod common;
use common::{ints, run_gemv, Rng};

fn argmax_of(bufs: &mut HashMap<String, Array>, rows: usize) -> i64 {
    let scores = bufs.remove("scores").unwrap();
    let mut b = HashMap::from([("logits".into(), scores), ("out".into(), Array::poisoned(Ty::I32, 1))]);
    run(
        &top_k::top_k("argmax", "t"),
        &mut b,
        &ints(&[("rows", 1), ("v", rows as i64), ("k", 1)]),
    )
    .unwrap();
    b["out"].to_i64().unwrap()[0]
}

/// `scores` through the fused `soft_cap` kernel.
fn soft_capped(scores: Array, rows: usize, cap: f32) -> Array {
    let expr = ir::Expr::SoftCap(Box::new(ir::Expr::Input(0)), cap);
    let mut b = HashMap::from([("in0".into(), scores), ("out".into(), Array::poisoned(Ty::F32, rows))]);
    let n = rows as i64;
    run(
        &elementwise::elementwise("cap", "t", &expr),
        &mut b,
        &ints(&[("n", n), ("width", n), ("in0_stride", n)]),
    )
    .unwrap();
    b.remove("out").unwrap()
}

#[test]
fn gpu_int8_head_gives_the_plain_heads_argmax() {
    for soft_cap in [None, Some(3.0), Some(0.05)] {
        check_int8_head(soft_cap);
    }
}

fn check_int8_head(soft_cap: Option<f32>) {
    let (rows, d) = (300, 70);
    let mut rng = Rng(77);
    let mut w: Vec<f32> = (0..rows * d).map(|_| bf16::from_f32(rng.next()).to_f32()).collect();
    // Exact ties: rows 40 and 250 copy row 7.
    for r in [40, 250] {
        w.copy_within(7 * d..8 * d, r * d);
    }
    let w_bf16: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
    let head = Int8Rows::quantize(rows, d, |r, buf| buf.copy_from_slice(&w[r * d..(r + 1) * d]));
    let blocks = head.blocks_per_row();
    for query in 0..12 {
        let h: Vec<f32> = match query % 3 {
            0 => w[7 * d..8 * d].iter().map(|v| v * 3.0).collect(),
            1 => w[9 * d..10 * d].iter().map(|v| v + 1e-3 * rng.next()).collect(),
            _ => (0..d).map(|_| rng.next()).collect(),
        };
        // The plain head: the bf16 GEMV, then argmax.
        let scores = run_gemv(
            &gemv::gemv("gemv", "t", gemv::GemvSpec::decode(WeightFormat::Dense(Ty::Bf16), d)),
            &h,
            Array::bf16(&w_bf16),
            (1, rows, d, d),
        );
        let scores = match soft_cap {
            Some(cap) => soft_capped(scores, rows, cap),
            None => scores,
        };
        let mut plain = HashMap::from([("scores".into(), scores)]);
        let want = argmax_of(&mut plain, rows);

        let mut bufs: HashMap<String, Array> = HashMap::from([
            ("h".into(), Array::f32(&h)),
            ("qh".into(), Array::poisoned(Ty::I8, d)),
            ("hs".into(), Array::poisoned(Ty::F32, blocks)),
            ("he".into(), Array::poisoned(Ty::F32, blocks)),
            ("hn".into(), Array::poisoned(Ty::F32, blocks)),
        ]);
        run(&int8_head::quantize_h("q", "t"), &mut bufs, &ints(&[("d", d as i64)])).unwrap();
        bufs.insert(
            "q".into(),
            Array::ints(Ty::I8, &head.q.iter().map(|&v| v as i64).collect::<Vec<_>>()),
        );
        for (name, v) in [
            ("scale", &head.scale),
            ("err_norm", &head.err_norm),
            ("quant_norm", &head.quant_norm),
            ("norm", &head.norm),
        ] {
            bufs.insert(name.into(), Array::f32(v));
        }
        bufs.insert("lower".into(), Array::poisoned(Ty::F32, rows));
        bufs.insert("upper".into(), Array::poisoned(Ty::F32, rows));
        run(
            &int8_head::score("s", "t"),
            &mut bufs,
            &ints(&[("rows", rows as i64), ("d", d as i64)]),
        )
        .unwrap();
        // τ: block maxima of the lower bounds, then their maximum.
        let partials = rows.div_ceil(256);
        let mut m = HashMap::from([
            ("x".into(), bufs["lower"].clone()),
            ("out".into(), Array::poisoned(Ty::F32, partials)),
        ]);
        run(&int8_head::max_reduce("m", "t"), &mut m, &ints(&[("n", rows as i64)])).unwrap();
        let mut m2 = HashMap::from([
            ("x".into(), m.remove("out").unwrap()),
            ("out".into(), Array::poisoned(Ty::F32, 1)),
        ]);
        run(
            &int8_head::max_reduce("m", "t"),
            &mut m2,
            &ints(&[("n", partials as i64)]),
        )
        .unwrap();
        let mut r = HashMap::from([
            ("h".into(), Array::f32(&h)),
            ("w".into(), Array::bf16(&w_bf16)),
            ("upper".into(), bufs["upper"].clone()),
            ("tau".into(), m2.remove("out").unwrap()),
            ("out".into(), Array::poisoned(Ty::F32, rows)),
        ]);
        run(
            &int8_head::rescore("r", "t", WeightFormat::Dense(Ty::Bf16), soft_cap),
            &mut r,
            &ints(&[("rows", rows as i64), ("k", d as i64)]),
        )
        .unwrap();
        let rescored = r["out"].to_f32().unwrap().iter().filter(|v| v.is_finite()).count();
        // A saturating cap ties most rows at the top: they are all candidates.
        assert!(
            soft_cap == Some(0.05) || rescored < rows / 2,
            "query {query}: {rescored} rows rescored, the bound is too loose"
        );
        let mut got = HashMap::from([("scores".into(), r.remove("out").unwrap())]);
        assert_eq!(argmax_of(&mut got, rows), want, "query {query}, cap {soft_cap:?}");
    }
}
