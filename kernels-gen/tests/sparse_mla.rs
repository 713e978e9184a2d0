//! GLM-5's sparse indexer on the emulator: `UnOp::OrderedBits` orders floats as bbc's rankings
//! do, and `index_select`'s cut keeps exactly the positions `ir::reference::ops::top_k` picks,
//! ties, signed zeros, infinities and NaN included.

mod common;

use common::{ints, Rng};
use ir::reference::ops;
use kernels_gen::dsl::Ty;
use kernels_gen::emulator::{ordered_bits, run, Array};
use kernels_gen::templates::cache_layout::CacheLayout;
use kernels_gen::templates::sparse_mla;
use proptest::prelude::*;
use std::collections::{BTreeSet, HashMap};

/// The ranking key of `ops::top_k`: NaN as −∞, then `total_cmp`.
fn reference_order(a: f32, b: f32) -> std::cmp::Ordering {
    let key = |v: f32| if v.is_nan() { f32::NEG_INFINITY } else { v };
    key(a).total_cmp(&key(b))
}

proptest! {
    #[test]
    fn ordered_bits_order_floats_as_the_rankings_do(a in any::<u32>(), b in any::<u32>()) {
        let (a, b) = (f32::from_bits(a), f32::from_bits(b));
        prop_assert_eq!(ordered_bits(a).cmp(&ordered_bits(b)), reference_order(a, b));
    }

    /// Rows of scores drawn from a few values (so ties are common at the cut) and random
    /// ones; each row sees positions `0..=first + t`.
    #[test]
    fn index_select_keeps_what_top_k_picks(
        picks in proptest::collection::vec(0usize..9, 1..40),
        tokens in 1usize..4,
        topk in 1usize..10,
        seed in any::<u64>(),
    ) {
        let context = picks.len() + tokens;
        let first = picks.len().saturating_sub(tokens);
        let mut rng = Rng(seed);
        let values = [0.0, -0.0, 1.0, 1.0, -1.0, 0.5, f32::NAN, f32::NEG_INFINITY, f32::INFINITY];
        let scores: Vec<f32> = (0..tokens * context)
            .map(|i| match picks.get(i % picks.len()).copied() {
                Some(k) if i % 3 != 0 => values[k],
                _ => rng.next(),
            })
            .collect();
        let spec = ir::SparseMlaSpec {
            heads: 1,
            nope_dim: 1,
            rope_dim: 2,
            value_dim: 1,
            latent_dim: 2,
            scale: 1.0,
            index_heads: 1,
            index_dim: 2,
            index_topk: topk,
            cache_slot: 0,
            index_slot: 0,
        };
        let kernel = sparse_mla::index_select("index_select", "test", CacheLayout::Contiguous, &spec);
        let mut bufs = HashMap::from([
            ("scores".into(), Array::f32(&scores)),
            ("cut".into(), Array::poisoned(Ty::U32, 2 * tokens)),
        ]);
        let scalars = ints(&[
            ("tokens", tokens as i64),
            ("first", first as i64),
            ("context", context as i64),
        ]);
        run(&kernel, &mut bufs, &scalars).unwrap();
        let cut = bufs["cut"].to_i64().unwrap();
        for t in 0..tokens {
            let row = &scores[t * context..t * context + first + t + 1];
            let want: BTreeSet<usize> = ops::top_k(row, topk.min(row.len())).into_iter().collect();
            let (key, last) = (cut[2 * t] as u32, cut[2 * t + 1] as usize);
            let got: BTreeSet<usize> = (0..row.len())
                .filter(|&p| {
                    let k = ordered_bits(row[p]);
                    k > key || (k == key && p <= last)
                })
                .collect();
            prop_assert_eq!(got, want, "row {} of {:?}", t, row);
        }
    }
}
