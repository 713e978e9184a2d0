//! Which tokens a sampled step may choose, and their weights: `e^((l − max)/T)` for every
//! token, narrowed by `top_k`, `top_p` and `min_p` as vLLM applies them (in that order, each on
//! what the one before kept). The weights are one vector loop over the row
//! ([`activation::exp`] in f32, as attention's softmax takes it); no filter sorts the whole
//! vocabulary (a sort of Gemma 3's 262 144 ids took 15 ms a token): `top_k`'s tokens come from
//! a scan keeping the best so far ([`most_likely`]), `top_p` ranks only the tokens over a
//! weight floor lowered until they hold its share, and `min_p` keeps the tokens whose weight
//! clears its floor.

use super::SamplingParams;
use crate::cpu::{activation, simd};
use crate::logprobs::{most_likely, row_max};

/// The tokens sampling may choose, with unnormalised weights.
#[derive(Debug, PartialEq)]
pub enum Candidates {
    /// Every token, in id order (no filter asked for).
    All(Vec<f32>),
    /// The tokens kept, most likely first (ties to the lower id).
    Kept(Vec<(u32, f32)>),
}

/// Past this many, the most likely tokens are found by sorting every id: the scan's insertions
/// into its sorted list cost that list's length each.
const SCAN_LIMIT: usize = 1024;

/// `logits`' candidates under `params` (a temperature above 0).
pub fn candidates(logits: &[f32], params: &SamplingParams) -> Candidates {
    let weights = weights(logits, params.temperature);
    if weights.is_empty() {
        return Candidates::Kept(Vec::new());
    }
    if params.top_k == 0 && params.top_p >= 1.0 && params.min_p <= 0.0 {
        return Candidates::All(weights);
    }
    // Ranked by logit (the weights' order), NaN, whose weight is 0, as the least likely.
    let cleaned: Vec<f32>;
    let ranked = match logits.iter().any(|l| l.is_nan()) {
        true => {
            cleaned = logits
                .iter()
                .map(|&l| if l.is_nan() { f32::NEG_INFINITY } else { l })
                .collect();
            &cleaned
        }
        false => logits,
    };
    let mut kept = match (params.top_k, params.top_p < 1.0) {
        // `min_p` alone: the tokens over its floor (the best token's weight is 1).
        (0, false) => return Candidates::Kept(over_floor(ranked, &weights, params.min_p)),
        (0, true) => {
            let total: f64 = weights.iter().map(|&w| f64::from(w)).sum();
            top_p_of_weight_floors(ranked, &weights, params.top_p, total)
        }
        (k, top_p) => {
            let ids = most_likely_ids(ranked, k);
            let mut kept: Vec<(u32, f32)> = ids.into_iter().map(|id| (id, weights[id as usize])).collect();
            if top_p {
                let total: f64 = kept.iter().map(|&(_, w)| f64::from(w)).sum();
                let cut = top_p_cut(&kept, params.top_p, total).unwrap_or(kept.len());
                kept.truncate(cut);
            }
            kept
        }
    };
    if params.min_p > 0.0 {
        let floor = params.min_p * kept.first().map_or(0.0, |&(_, w)| w);
        kept.retain(|&(_, w)| w >= floor);
    }
    Candidates::Kept(kept)
}

/// The smallest run of the most likely tokens holding `top_p` of `total` (all tokens'
/// weight). The tokens whose weight clears a floor come before all others in that order
/// (a weight is never less for a larger logit), so they are taken, ranked and cut, with the
/// floor a sixteenth of the best weight, then 16 times lower each round until their share
/// is reached: peaked rows stop at the first, flat ones rank more tokens, a whole row only
/// where the floor reaches 0.
fn top_p_of_weight_floors(ranked: &[f32], weights: &[f32], top_p: f32, total: f64) -> Vec<(u32, f32)> {
    let mut floor = 1.0f32;
    loop {
        floor /= 16.0;
        let mut kept = over_floor(ranked, weights, floor);
        match top_p_cut(&kept, top_p, total) {
            Some(cut) => {
                kept.truncate(cut);
                return kept;
            }
            None if kept.len() == weights.len() || floor == 0.0 => return kept,
            None => {}
        }
    }
}

/// The tokens whose weight is at least `floor`, most likely first.
fn over_floor(ranked: &[f32], weights: &[f32], floor: f32) -> Vec<(u32, f32)> {
    let mut kept: Vec<(u32, f32)> = (0..weights.len() as u32)
        .map(|id| (id, weights[id as usize]))
        .filter(|&(_, w)| w >= floor)
        .collect();
    let order = by_rank(ranked);
    kept.sort_unstable_by(|(a, _), (b, _)| order(a, b));
    kept
}

/// Ids most likely first: by `ranked` (no NaN) descending, ties to the lower id.
fn by_rank(ranked: &[f32]) -> impl Fn(&u32, &u32) -> std::cmp::Ordering + '_ {
    |a, b| ranked[*b as usize].total_cmp(&ranked[*a as usize]).then(a.cmp(b))
}

/// How many of `kept` (most likely first) the first prefix holding `top_p` of `total` takes;
/// `None` where all of them fall short.
fn top_p_cut(kept: &[(u32, f32)], top_p: f32, total: f64) -> Option<usize> {
    let target = f64::from(top_p) * total;
    let mut sum = 0.0;
    kept.iter()
        .position(|&(_, w)| {
            sum += f64::from(w);
            sum >= target
        })
        .map(|i| i + 1)
}

/// The ids of the `count` largest of `ranked` (no NaN), largest first, ties to the lower id.
fn most_likely_ids(ranked: &[f32], count: usize) -> Vec<u32> {
    if count <= SCAN_LIMIT {
        return most_likely(ranked, count);
    }
    let mut ids: Vec<u32> = (0..ranked.len() as u32).collect();
    let order = by_rank(ranked);
    let count = count.min(ids.len());
    if count < ids.len() {
        ids.select_nth_unstable_by(count, &order);
        ids.truncate(count);
    }
    ids.sort_unstable_by(&order);
    ids
}

simd::widest_vectors! {
    /// Each token's `e^((l − max)/T)` (0 for NaN); empty where no logit is a number above −∞.
    fn weights(logits: &[f32], temperature: f32) -> Vec<f32> => weights_body
}

#[inline(always)]
fn weights_body(logits: &[f32], temperature: f32) -> Vec<f32> {
    let max = row_max(logits);
    match max {
        f32::NEG_INFINITY => Vec::new(),
        // Only the infinite logits can be chosen, alike.
        f32::INFINITY => logits.iter().map(|&l| f32::from(l == f32::INFINITY)).collect(),
        _ => {
            // A loop into a vector made first (not `collect`, whose own function would not be
            // compiled for the vector instructions this one is).
            let mut weights = vec![0f32; logits.len()];
            for (w, &l) in weights.iter_mut().zip(logits) {
                *w = if l.is_nan() {
                    0.0
                } else {
                    activation::exp((l - max) / temperature)
                };
            }
            weights
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The filters as they were written first: every id sorted (by logit, NaN last: tokens
    /// of equal weight keep their logits' order), then cut.
    fn reference(logits: &[f32], weights: &[f32], params: &SamplingParams) -> Vec<u32> {
        let key = |id: u32| match logits[id as usize] {
            l if l.is_nan() => f32::NEG_INFINITY,
            l => l,
        };
        let mut ids: Vec<u32> = (0..weights.len() as u32).collect();
        ids.sort_by(|&a, &b| key(b).total_cmp(&key(a)).then(a.cmp(&b)));
        if params.top_k > 0 {
            ids.truncate(params.top_k);
        }
        if params.top_p < 1.0 {
            let total: f64 = ids.iter().map(|&id| f64::from(weights[id as usize])).sum();
            let mut sum = 0.0;
            let keep = ids
                .iter()
                .position(|&id| {
                    sum += f64::from(weights[id as usize]);
                    sum >= f64::from(params.top_p) * total
                })
                .map_or(ids.len(), |i| i + 1);
            ids.truncate(keep);
        }
        if params.min_p > 0.0 {
            let floor = params.min_p * weights[ids[0] as usize];
            ids.retain(|&id| weights[id as usize] >= floor);
        }
        ids
    }

    /// Rows of a vocabulary's size, peaked and flat, with repeated logits and NaN: each
    /// filter, alone and together, keeps the tokens the whole sort kept, in its order. The
    /// weights are `e^((l − max)/T)`, 1 for the best and 0 for NaN.
    #[test]
    fn the_filters_keep_what_sorting_every_token_kept() {
        let mut rng = super::super::SplitMix64(7);
        let mut next = move || rng.next_f64() as f32;
        let base = SamplingParams {
            temperature: 0.8,
            ..SamplingParams::default()
        };
        let settings = [
            SamplingParams { top_k: 50, ..base },
            SamplingParams { top_k: 3000, ..base },
            SamplingParams { top_p: 0.9, ..base },
            SamplingParams { top_p: 0.999, ..base },
            SamplingParams { min_p: 0.05, ..base },
            SamplingParams {
                top_k: 40,
                top_p: 0.5,
                min_p: 0.2,
                ..base
            },
        ];
        for (len, spread) in [(49_152, 30.0f32), (49_152, 2.0), (5000, 0.5), (100, 8.0)] {
            let row: Vec<f32> = (0..len)
                .map(|_| match next() {
                    u if u < 0.001 => f32::NAN,
                    u if u < 0.01 => 1.5,
                    u => spread * u.powi(8),
                })
                .collect();
            let weights = weights(&row, base.temperature);
            let best = weights.iter().position(|&w| w == 1.0).unwrap();
            assert_eq!(
                row[best],
                row.iter().copied().filter(|l| !l.is_nan()).fold(f32::MIN, f32::max)
            );
            assert!(row.iter().zip(&weights).all(|(l, &w)| !l.is_nan() || w == 0.0));
            for params in settings {
                let Candidates::Kept(kept) = candidates(&row, &params) else {
                    panic!("filters keep some")
                };
                let ids: Vec<u32> = kept.iter().map(|&(id, _)| id).collect();
                let want = reference(&row, &weights, &params);
                assert!(
                    ids == want,
                    "{len} {spread} {params:?}: {} kept, {} wanted",
                    ids.len(),
                    want.len()
                );
                assert!(kept.iter().all(|&(id, w)| w == weights[id as usize]));
            }
            assert_eq!(candidates(&row, &base), Candidates::All(weights));
        }
        assert_eq!(
            candidates(&[f32::NAN, f32::NEG_INFINITY], &base),
            Candidates::Kept(Vec::new())
        );
        let infinite = candidates(&[1.0, f32::INFINITY, f32::INFINITY], &base);
        assert_eq!(infinite, Candidates::All(vec![0.0, 1.0, 1.0]));
    }
}
