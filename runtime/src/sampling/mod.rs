//! Choosing the next token from logits: greedy (argmax, ties to the lowest id) or sampling at a
//! temperature with a seeded generator, so a seed reproduces a run. Sampling can be narrowed to
//! the `top_k` most likely tokens, the smallest set holding `top_p` of the probability, and the
//! tokens at least `min_p` times as likely as the best (applied in that order, as vLLM does).
//! Penalties adjust the logits first, greedy included, with vLLM's definitions: `repetition`
//! divides positive (multiplies negative) logits of tokens seen in the prompt or the output;
//! `frequency` subtracts per occurrence in the output, `presence` once per token in it.

mod candidates;

pub use crate::logprobs::TokenLogprobs;
use candidates::Candidates;
use std::collections::{HashMap, HashSet};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    pub seed: u64,
    /// 0 keeps every token.
    pub top_k: usize,
    /// In (0, 1]; 1 keeps every token.
    pub top_p: f32,
    /// In [0, 1]; 0 keeps every token.
    pub min_p: f32,
    /// 0 is off.
    pub presence_penalty: f32,
    /// 0 is off.
    pub frequency_penalty: f32,
    /// Above 0; 1 is off.
    pub repetition_penalty: f32,
    /// Report the chosen token's log-probability and this many most likely alternatives.
    pub logprobs: Option<usize>,
    /// Report each prompt token's log-probability given the tokens before it (from the
    /// second on) and this many most likely alternatives there (vLLM's `prompt_logprobs`).
    pub prompt_logprobs: Option<usize>,
}

impl SamplingParams {
    fn penalises(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0 || self.repetition_penalty != 1.0
    }

    /// The token is the argmax of the logits as they are, and nothing else of them is wanted:
    /// greedy, no penalties, no log-probabilities.
    pub fn is_plain_greedy(&self) -> bool {
        self.temperature <= 0.0 && !self.penalises() && self.logprobs.is_none()
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            seed: 0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logprobs: None,
            prompt_logprobs: None,
        }
    }
}

/// SplitMix64 (Steele, Lea, Flood 2014): tiny, fast and well distributed; all sampling (and
/// `bbc bench`'s seeded prompts) needs.
#[derive(Debug, Clone)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1) with 53 bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [0, n) (n ≥ 1; the modulo bias is below 2⁻³² for any n that fits a u32).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: SplitMix64,
    /// Tokens of the prompt (for the repetition penalty).
    prompt: HashSet<u32>,
    /// Occurrences of each token in the output so far.
    output: HashMap<u32, u32>,
}

crate::cpu::simd::widest_vectors! {
    /// Index of the largest value; the lowest index among equals. NaN never wins.
    ///
    /// The IR's `top_k` rule, which the GPU's top-k kernel follows too: NaN counts as −∞, ties
    /// go to the lowest index (so a row of NaNs and −∞ gives 0). Two passes that vectorise (the
    /// row's maximum over sixteen lanes, then the first sixteen holding it) where one scalar
    /// pass was 1.6% of a served SmolLM2 run's samples at 16 requests: 47 → 13 µs a row of
    /// 49 152 logits (`benches/sampling_rows.rs`).
    pub fn argmax(logits: &[f32]) -> u32 => argmax_body
}

#[inline(always)]
fn argmax_body(logits: &[f32]) -> u32 {
    let (chunks, tail) = logits.as_chunks::<16>();
    // `>` passes NaN over, as the one-pass rule does.
    let larger = |best: f32, v: f32| if v > best { v } else { best };
    let mut lanes = [f32::NEG_INFINITY; 16];
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane = larger(*lane, v);
        }
    }
    let max = lanes
        .into_iter()
        .chain(tail.iter().copied())
        .fold(f32::NEG_INFINITY, larger);
    if max == f32::NEG_INFINITY {
        return 0;
    }
    // `max` is one of the row's values; `==` takes 0 and −0 alike, as `>` never put one
    // before the other.
    let first_in = |values: &[f32]| values.iter().position(|&v| v == max);
    for (c, chunk) in chunks.iter().enumerate() {
        if chunk.iter().map(|&v| u32::from(v == max)).sum::<u32>() > 0 {
            return (16 * c + first_in(chunk).unwrap_or(0)) as u32;
        }
    }
    (16 * chunks.len() + first_in(tail).unwrap_or(0)) as u32
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        Self::with_prompt(params, &[])
    }

    /// A sampler whose repetition penalty also counts the prompt's tokens.
    pub fn with_prompt(params: SamplingParams, prompt: &[u32]) -> Self {
        Self {
            params,
            rng: SplitMix64(params.seed),
            prompt: if params.penalises() {
                prompt.iter().copied().collect()
            } else {
                HashSet::new()
            },
            output: HashMap::new(),
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Choose the next token; it counts as output from then on.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let token = if self.params.penalises() {
            let penalised = self.penalise(logits);
            self.choose(&penalised)
        } else {
            self.choose(logits)
        };
        if self.params.penalises() {
            *self.output.entry(token).or_default() += 1;
        }
        token
    }

    fn penalise(&self, logits: &[f32]) -> Vec<f32> {
        let mut out = logits.to_vec();
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            // Once per token seen, in the prompt or the output or both.
            let output_only = self.output.keys().filter(|id| !self.prompt.contains(id));
            for &id in self.prompt.iter().chain(output_only) {
                if let Some(l) = out.get_mut(id as usize) {
                    *l = if *l > 0.0 {
                        *l / p.repetition_penalty
                    } else {
                        *l * p.repetition_penalty
                    };
                }
            }
        }
        for (&id, &count) in &self.output {
            if let Some(l) = out.get_mut(id as usize) {
                *l -= p.frequency_penalty * count as f32 + p.presence_penalty;
            }
        }
        out
    }

    fn choose(&mut self, logits: &[f32]) -> u32 {
        if self.params.temperature <= 0.0 {
            return argmax(logits);
        }
        let u = self.rng.next_f64();
        let chosen = match candidates::candidates(logits, &self.params) {
            Candidates::All(weights) => pick(u, weights.iter().enumerate().map(|(id, &w)| (id as u32, w))),
            Candidates::Kept(kept) => pick(u, kept.into_iter()),
        };
        chosen.unwrap_or_else(|| argmax(logits))
    }
}

/// The candidate whose share of the weights' running sum holds `u` (in [0, 1)) of their
/// total, in order: each is chosen with probability weight / total. Where rounding leaves
/// `u` past the end, the last with any weight; `None` where none has any.
fn pick(u: f64, candidates: impl Iterator<Item = (u32, f32)> + Clone) -> Option<u32> {
    let total: f64 = candidates.clone().map(|(_, w)| f64::from(w)).sum();
    let mut target = u * total;
    let mut last = None;
    for (id, w) in candidates.filter(|&(_, w)| w > 0.0) {
        target -= f64::from(w);
        if target < 0.0 {
            return Some(id);
        }
        last = Some(id);
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_breaks_ties_to_the_lowest_index() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, 0.5]), 1);
        assert_eq!(argmax(&[f32::NAN, f32::NEG_INFINITY]), 0);
        assert_eq!(argmax(&[]), 0);
    }

    /// The one-pass rule: keep the first value nothing before it exceeds.
    fn argmax_one_pass(logits: &[f32]) -> u32 {
        let mut best = (0, f32::NEG_INFINITY);
        for (i, &v) in logits.iter().enumerate() {
            if v > best.1 {
                best = (i, v);
            }
        }
        best.0 as u32
    }

    proptest::proptest! {
        /// Rows of few distinct values (so ties are common), NaNs, infinities and both zeros,
        /// of every length around the sixteen-lane chunks.
        #[test]
        fn argmax_is_the_one_pass_rule(codes in proptest::collection::vec(0u8..12, 0..70)) {
            let values = [f32::NAN, f32::NEG_INFINITY, f32::INFINITY, 0.0, -0.0, 1.0, -1.0, 2.5, 2.5, -3.0, 7.0, f32::NAN];
            let row: Vec<f32> = codes.iter().map(|&c| values[c as usize]).collect();
            proptest::prop_assert_eq!(argmax(&row), argmax_one_pass(&row));
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_samples() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let params = SamplingParams {
            temperature: 1.0,
            seed: 42,
            ..SamplingParams::default()
        };
        let run = |p| {
            let mut s = Sampler::new(p);
            (0..20).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(params), run(params));
        assert_ne!(run(params), run(SamplingParams { seed: 43, ..params }));
    }

    #[test]
    fn sampling_follows_the_distribution() {
        // Two tokens with logits differing by ln 3 at T = 1: picked 3:1.
        let logits = [0.0f32, 3f32.ln()];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: 7,
            ..SamplingParams::default()
        });
        let ones = (0..20_000).filter(|_| s.sample(&logits) == 1).count();
        assert!((14_500..15_500).contains(&ones), "{ones}");
    }

    fn chosen(params: SamplingParams, logits: &[f32]) -> std::collections::BTreeSet<u32> {
        let mut s = Sampler::new(params);
        (0..4_000).map(|_| s.sample(logits)).collect()
    }

    #[test]
    fn top_k_top_p_and_min_p_narrow_the_choice() {
        // Probabilities at T = 1: 0.4, 0.3, 0.2, 0.1 (token 3 is the likeliest).
        let logits = [0.2f32.ln(), 0.1f32.ln(), 0.3f32.ln(), 0.4f32.ln()];
        let base = SamplingParams {
            temperature: 1.0,
            seed: 3,
            ..SamplingParams::default()
        };
        assert_eq!(chosen(base, &logits), [0, 1, 2, 3].into());
        assert_eq!(chosen(SamplingParams { top_k: 2, ..base }, &logits), [2, 3].into());
        assert_eq!(chosen(SamplingParams { top_k: 1, ..base }, &logits), [3].into());
        // 0.4 + 0.3 reaches 0.65; 0.4 alone does not.
        assert_eq!(chosen(SamplingParams { top_p: 0.65, ..base }, &logits), [2, 3].into());
        // min_p 0.45: tokens at least 0.18 likely.
        assert_eq!(
            chosen(SamplingParams { min_p: 0.45, ..base }, &logits),
            [0, 2, 3].into()
        );
    }

    #[test]
    fn penalties_follow_vllm() {
        let logits = [2.0f32, 1.9, -1.0, 0.5];
        let greedy = |params: SamplingParams, prompt: &[u32], steps: usize| {
            let mut s = Sampler::with_prompt(params, prompt);
            (0..steps).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        let off = SamplingParams::default();
        assert_eq!(greedy(off, &[], 3), [0, 0, 0]);
        // Presence: 0 once output costs 0.2 → 1.8 < 1.9; then 1 costs the same → 0 again.
        let presence = SamplingParams {
            presence_penalty: 0.2,
            ..off
        };
        assert_eq!(greedy(presence, &[], 3), [0, 1, 0]);
        // Frequency: each occurrence costs 0.06: 0 wins twice (2.0, 1.94), then 1.88 < 1.9.
        let frequency = SamplingParams {
            frequency_penalty: 0.06,
            ..off
        };
        assert_eq!(greedy(frequency, &[], 3), [0, 0, 1]);
        // Repetition 1.1 on a prompt holding 0: 2.0 / 1.1 < 1.9; a negative logit is multiplied.
        let repetition = SamplingParams {
            repetition_penalty: 1.1,
            ..off
        };
        assert_eq!(greedy(repetition, &[0], 1), [1]);
        assert_eq!(greedy(repetition, &[2], 1), [0]);
        let s = Sampler::with_prompt(repetition, &[2]);
        assert_eq!(s.penalise(&logits)[2], -1.1);
        // A token in both the prompt and the output is penalised once.
        let mut s = Sampler::with_prompt(repetition, &[0]);
        assert_eq!(s.sample(&[3.0, 1.0]), 0);
        assert_eq!(s.penalise(&[3.0, 1.0])[0], 3.0 / 1.1);
    }
}
