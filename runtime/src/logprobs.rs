//! A token's log-probability under a row of logits, its rank there, and the most likely
//! tokens: what `logprobs` and `prompt_logprobs` report at every row sampled or scored, on the
//! engine's thread. A row is a whole vocabulary (262 144 logits for Gemma 3), and a scored
//! prompt has a row per position, so each pass over it is a vector loop: the normaliser's
//! `e^x` is [`activation::exp`] over sixteen lanes (f64 `exp` a logit cost 6 ns: 1.5 ms a
//! Gemma 3 row), the rank a count, the alternatives a scan that skips every 64-logit block
//! none of whose logits can enter them.

use crate::cpu::{activation, simd};

/// A chosen token's log-probability under the model's distribution (the raw logits, before
/// temperature and penalties, as vLLM reports them) and the most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// 1 + how many tokens are more likely (vLLM's `rank`: 1 for the argmax).
    pub rank: u32,
    /// Most likely first (ties to the lower id).
    pub top: Vec<(u32, f32)>,
}

impl TokenLogprobs {
    simd::widest_vectors! {
        /// `token`'s log-probability and rank under `logits`, and the `top` most likely tokens.
        pub fn of(logits: &[f32], token: u32, top: usize) -> TokenLogprobs => of_body
    }
}

#[inline(always)]
fn of_body(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
    let log_z = log_normaliser(logits);
    let logprob = |id: u32| {
        logits
            .get(id as usize)
            .map_or(f32::NEG_INFINITY, |&l| (l as f64 - log_z) as f32)
    };
    TokenLogprobs {
        logprob: logprob(token),
        rank: rank(logits, token),
        top: most_likely(logits, top)
            .into_iter()
            .map(|id| (id, logprob(id)))
            .collect(),
    }
}

/// Lanes of the normaliser's sums: element `i` of a block goes to lane `i % LANES`.
const LANES: usize = 16;
/// Logits whose `e^x` a lane sums in f32 before the block's sum joins the f64 total: short
/// enough that a lane's rounding stays near f32's own (256 terms), long enough to vectorise.
const BLOCK: usize = LANES * 256;

/// `ln Σ e^l` over the row's numbers (NaN left out): its maximum plus the log of the sum of
/// `e^(l − max)`, each block's sixteen lanes summed in f32 and the blocks in f64.
#[inline(always)]
fn log_normaliser(logits: &[f32]) -> f64 {
    let max = row_max(logits);
    let mut total = 0f64;
    for block in logits.chunks(BLOCK) {
        let mut sums = [0f32; LANES];
        let mut chunks = block.chunks_exact(LANES);
        for chunk in &mut chunks {
            for (sum, &l) in sums.iter_mut().zip(chunk) {
                *sum += if l.is_nan() { 0.0 } else { activation::exp(l - max) };
            }
        }
        for (sum, &l) in sums.iter_mut().zip(chunks.remainder()) {
            *sum += if l.is_nan() { 0.0 } else { activation::exp(l - max) };
        }
        total += sums.into_iter().map(f64::from).sum::<f64>();
    }
    max as f64 + total.ln()
}

/// The largest of a row's numbers (NaN left out; −∞ where there is none), over sixteen lanes
/// so that the loop vectorises where it is inlined.
#[inline(always)]
pub(crate) fn row_max(logits: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    for (i, &l) in logits.iter().enumerate() {
        // `max` leaves NaN out.
        lanes[i % LANES] = lanes[i % LANES].max(l);
    }
    lanes.into_iter().fold(f32::NEG_INFINITY, f32::max)
}

/// 1 + the tokens strictly more likely than `token`: no NaN is more likely than a token, and
/// a NaN token (or one past the row) ranks after every number.
#[inline(always)]
fn rank(logits: &[f32], token: u32) -> u32 {
    let more_likely = match logits.get(token as usize) {
        Some(&chosen) if !chosen.is_nan() => logits.iter().map(|&l| (l > chosen) as u32).sum::<u32>(),
        _ => logits.iter().map(|&l| (!l.is_nan()) as u32).sum::<u32>(),
    };
    1 + more_likely
}

/// `x`'s place in `f32::total_cmp`'s order as an integer: larger keys for larger floats,
/// negative NaN least and positive NaN greatest, as `total_cmp` orders them.
#[inline(always)]
fn order_key(x: f32) -> i32 {
    let bits = x.to_bits() as i32;
    bits ^ (((bits >> 31) as u32) >> 1) as i32
}

/// The ids of the `top` largest logits in `total_cmp`'s order, largest first, ties to the
/// lower id. One pass in id order keeping the best so far: a block whose largest key does
/// not beat the last kept is skipped whole (an equal key later has the larger id, and loses).
#[inline(always)]
pub(crate) fn most_likely(logits: &[f32], top: usize) -> Vec<u32> {
    const SCAN: usize = 64;
    let top = top.min(logits.len());
    if top == 0 {
        return Vec::new();
    }
    // Best first: (key, id).
    let mut best: Vec<(i32, u32)> = Vec::with_capacity(top + 1);
    for (b, block) in logits.chunks(SCAN).enumerate() {
        if best.len() == top {
            let largest = block.iter().map(|&l| order_key(l)).fold(i32::MIN, i32::max);
            if largest <= best[top - 1].0 {
                continue;
            }
        }
        for (j, &l) in block.iter().enumerate() {
            let key = order_key(l);
            if best.len() < top || key > best[top - 1].0 {
                let at = best.partition_point(|&(kept, _)| kept >= key);
                best.insert(at, (key, (b * SCAN + j) as u32));
                best.truncate(top);
            }
        }
    }
    best.into_iter().map(|(_, id)| id).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_log_softmax_with_the_top_alternatives() {
        let logits = [0.2f32.ln(), 0.1f32.ln(), 0.3f32.ln(), 0.4f32.ln()];
        let lp = TokenLogprobs::of(&logits, 1, 2);
        assert!((lp.logprob - 0.1f32.ln()).abs() < 1e-6);
        assert_eq!(lp.top.iter().map(|&(id, _)| id).collect::<Vec<_>>(), [3, 2]);
        assert!((lp.top[0].1 - 0.4f32.ln()).abs() < 1e-6);
        assert!(TokenLogprobs::of(&logits, 0, 0).top.is_empty());
        assert_eq!(TokenLogprobs::of(&logits, 0, 9).top.len(), 4);
    }

    /// A token's rank is 1 + the tokens strictly more likely: ties share a rank, and NaN is
    /// never more likely (a NaN token ranks after every number).
    #[test]
    fn ranks_count_the_more_likely_tokens() {
        let logits = [0.5f32, 2.0, 0.5, f32::NAN, -1.0];
        let rank = |token| TokenLogprobs::of(&logits, token, 0).rank;
        assert_eq!([rank(1), rank(0), rank(2), rank(4), rank(3)], [1, 2, 2, 4, 5]);
    }

    /// What the vector loops replaced, in f64 and by sorting every id: the reference.
    fn reference(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
        let max = logits
            .iter()
            .copied()
            .filter(|l| !l.is_nan())
            .fold(f32::NEG_INFINITY, f32::max) as f64;
        let sum: f64 = logits
            .iter()
            .filter(|l| !l.is_nan())
            .map(|&l| (l as f64 - max).exp())
            .sum();
        let log_z = max + sum.ln();
        let logprob = |id: u32| (logits[id as usize] as f64 - log_z) as f32;
        let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
        ids.sort_by(|a, b| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b)));
        let chosen = logits[token as usize];
        let rank = match chosen.is_nan() {
            false => 1 + logits.iter().filter(|&&l| l > chosen).count() as u32,
            true => 1 + logits.iter().filter(|l| !l.is_nan()).count() as u32,
        };
        TokenLogprobs {
            logprob: logprob(token),
            rank,
            top: ids[..top.min(ids.len())].iter().map(|&id| (id, logprob(id))).collect(),
        }
    }

    /// Rows of a vocabulary's size, with repeated values (ties across blocks), infinities and
    /// NaN of both signs: the same rank and alternatives (ids) as the reference, and
    /// log-probabilities within 2e-6 of its f64 ones.
    #[test]
    fn the_vector_loops_give_the_references_answers() {
        let mut rng = crate::sampling::SplitMix64(7);
        for (len, top) in [(49_152, 20), (1000, 5), (37, 40), (262_144, 1), (64, 64)] {
            let row: Vec<f32> = (0..len)
                .map(|_| match rng.below(1000) {
                    0 => f32::NAN,
                    1 => -f32::NAN,
                    2 => f32::NEG_INFINITY,
                    3..=40 => 7.25,
                    r => (r as f32 - 500.0) / 60.0,
                })
                .collect();
            for token in [0, len as u32 / 3, len as u32 - 1] {
                let (got, want) = (TokenLogprobs::of(&row, token, top), reference(&row, token, top));
                assert_eq!(got.rank, want.rank, "{len}");
                let ids = |t: &TokenLogprobs| t.top.iter().map(|&(id, _)| id).collect::<Vec<_>>();
                assert_eq!(ids(&got), ids(&want), "{len}");
                let pairs = std::iter::once((got.logprob, want.logprob))
                    .chain(got.top.iter().zip(&want.top).map(|(g, w)| (g.1, w.1)));
                for (g, w) in pairs {
                    assert!(
                        g == w || (g.is_nan() && w.is_nan()) || (g - w).abs() <= 2e-6,
                        "{len}: {g} vs {w}"
                    );
                }
            }
        }
    }
}
