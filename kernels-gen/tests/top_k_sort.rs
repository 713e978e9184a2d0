//! The one-pass top-k (`templates::top_k_sort`) on the emulator: its chain of launches picks
//! exactly `ir::reference::ops::top_k`'s indices, in its order, across chunk and merge
//! boundaries, with ties, signed zeros, infinities and NaN; and the sort's barriers are what
//! makes it right.

mod common;

use common::{edited, ints, Rng};
use ir::reference::ops;
use kernels_gen::dsl::{Kernel, Stmt, Ty};
use kernels_gen::emulator::{run, Array, EmuError, Scalar};
use kernels_gen::templates::top_k_sort::{self, Pass};
use proptest::prelude::*;
use std::collections::HashMap;

/// The passes' kernels, as a plan makes them.
fn kernels(passes: &[Pass]) -> Vec<Kernel> {
    passes
        .iter()
        .enumerate()
        .map(|(n, p)| match n {
            0 => top_k_sort::chunks("top_k_chunks", "test", p.len),
            _ => top_k_sort::merge("top_k_merge", "test", p.len),
        })
        .collect()
}

/// The row-by-row top `k` of `logits` (`rows` × `v`) through every pass, each pass's output
/// poisoned before its launch.
fn run_chain(logits: &[f32], rows: usize, v: usize, k: usize, kernels: &[Kernel]) -> Result<Vec<i64>, EmuError> {
    let passes = top_k_sort::passes(v, k);
    let mut input: Option<(Array, Array)> = None;
    for (pass, kernel) in passes.iter().zip(kernels) {
        let out = rows * pass.lists_out * k;
        let mut bufs = HashMap::from([
            ("out_keys".to_string(), Array::poisoned(Ty::U32, out)),
            ("out_ids".to_string(), Array::poisoned(Ty::I32, out)),
        ]);
        let mut scalars: HashMap<String, Scalar> = ints(&[
            ("rows", rows as i64),
            ("k", k as i64),
            ("lists_out", pass.lists_out as i64),
        ]);
        match input.take() {
            None => {
                bufs.insert("logits".into(), Array::f32(logits));
                scalars.insert("v".into(), Scalar::Int(v as i64));
            }
            Some((keys, ids)) => {
                bufs.insert("in_keys".into(), keys);
                bufs.insert("in_ids".into(), ids);
                scalars.insert("lists_in".into(), Scalar::Int(pass.lists_in as i64));
            }
        }
        run(kernel, &mut bufs, &scalars)?;
        input = Some((bufs.remove("out_keys").unwrap(), bufs.remove("out_ids").unwrap()));
    }
    Ok(input.expect("at least one pass").1.to_i64().unwrap())
}

fn reference(logits: &[f32], rows: usize, v: usize, k: usize) -> Vec<i64> {
    (0..rows)
        .flat_map(|r| ops::top_k(&logits[r * v..(r + 1) * v], k))
        .map(|i| i as i64)
        .collect()
}

fn check(logits: &[f32], rows: usize, v: usize, k: usize) {
    let passes = top_k_sort::passes(v, k);
    let got = run_chain(logits, rows, v, k, &kernels(&passes)).expect("the passes run cleanly");
    assert_eq!(
        got,
        reference(logits, rows, v, k),
        "v = {v}, k = {k}, passes {passes:?}"
    );
}

#[test]
fn sorted_chunks_and_merges_pick_the_reference_top_k() {
    let mut rng = Rng(11);
    // One chunk; several chunks and one merge (k not dividing the sort); two merges.
    for (v, k) in [(5, 5), (300, 64), (9000, 64), (9000, 300), (9000, 1000)] {
        let rows = 2;
        let mut logits = rng.vec(rows * v);
        // The second row: its maximum tied across chunks (the later chunk's first), ties
        // below it, NaN, infinities and both zeros.
        let m = logits[v..].iter().cloned().fold(f32::NEG_INFINITY, f32::max) + 1.0;
        for (at, x) in [
            (9, m),
            (3, m),
            (7, m - 0.5),
            (2, m - 0.5),
            (1, f32::NAN),
            (0, 0.0),
            (4, -0.0),
        ] {
            if at < v {
                logits[v + at] = x;
            }
        }
        if v > 4096 {
            logits[v + 4096] = m;
            logits[v + 2047] = m - 0.5;
            logits[v + v - 1] = f32::INFINITY;
            logits[v + v - 2] = f32::NEG_INFINITY;
        }
        check(&logits, rows, v, k);
    }
    // A row of NaN ranks them all as −∞: lowest indices first.
    check(&[f32::NAN; 7], 1, 7, 3);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Rows drawn from a few values (ties everywhere, at the cut too) and random ones.
    #[test]
    fn sorted_top_k_is_the_reference_order(
        picks in proptest::collection::vec(0usize..8, 1..600),
        rows in 1usize..3,
        k in 1usize..70,
        seed in any::<u64>(),
    ) {
        let v = picks.len();
        let k = k.min(v);
        let mut rng = Rng(seed);
        let values = [0.0, -0.0, 1.0, -1.0, 0.5, f32::NAN, f32::NEG_INFINITY, f32::INFINITY];
        let logits: Vec<f32> = (0..rows * v)
            .map(|i| match i % 3 {
                0 => rng.next(),
                _ => values[picks[i % v]],
            })
            .collect();
        let passes = top_k_sort::passes(v, k);
        let got = run_chain(&logits, rows, v, k, &kernels(&passes)).unwrap();
        prop_assert_eq!(got, reference(&logits, rows, v, k));
    }
}

/// Without the barrier after each stage (or after the loads), threads read places others
/// are still writing: the emulator reports the race, or the order comes out wrong.
#[test]
fn every_barrier_of_the_sort_is_needed() {
    let (v, k) = (600, 64);
    let logits = Rng(5).vec(v);
    let passes = top_k_sort::passes(v, k);
    let kernel = &kernels(&passes)[0];
    let barriers = count_barriers(&kernel.body);
    assert_eq!(barriers, 2, "one after the loads, one after each sorting stage");
    for drop in 0..barriers {
        let mut mutant = kernel.clone();
        mutant.body = without_barrier(&kernel.body, drop);
        let outcome = run_chain(&logits, 1, v, k, &[mutant]);
        assert!(
            outcome.as_ref().map_or(true, |got| *got != reference(&logits, 1, v, k)),
            "dropping barrier {drop} went unnoticed"
        );
    }
}

fn count_barriers(body: &[Stmt]) -> usize {
    body.iter()
        .map(|s| match s {
            Stmt::SyncThreads => 1,
            Stmt::For { body, .. } => count_barriers(body),
            _ => 0,
        })
        .sum()
}

/// `body` without its `drop`th barrier, in order of appearance.
fn without_barrier(body: &[Stmt], drop: usize) -> Vec<Stmt> {
    let seen = std::cell::Cell::new(0);
    edited(body, &|s| match s {
        Stmt::SyncThreads => {
            seen.set(seen.get() + 1);
            (seen.get() - 1 != drop).then(|| s.clone())
        }
        s => Some(s.clone()),
    })
}
