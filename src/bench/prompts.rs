//! The InferenceX random dataset: each request draws its input length uniformly from
//! [ratio·ISL, ISL] and its output length from [ratio·OSL, OSL]; a prompt is random token ids
//! decoded to text, re-encoded and cut to its length, so prompts share no prefix.

use anyhow::Result;
use models::Tokenizer;
use runtime::sampling::SplitMix64;

#[derive(Debug, Clone, PartialEq)]
pub struct BenchRequest {
    pub prompt: String,
    pub max_tokens: usize,
}

/// The lengths the InferenceX client would ask for.
#[derive(Debug, Clone, Copy)]
pub struct Lengths {
    pub input: usize,
    pub output: usize,
    /// The shortest draw as a fraction of the longest.
    pub range_ratio: f64,
}

pub fn random_requests(tokenizer: &Tokenizer, count: usize, lengths: Lengths, seed: u64) -> Result<Vec<BenchRequest>> {
    let mut rng = SplitMix64(seed);
    let vocab = tokenizer.vocab_size() as u64;
    (0..count)
        .map(|_| {
            let input = between(&mut rng, lengths.input, lengths.range_ratio);
            let max_tokens = between(&mut rng, lengths.output, lengths.range_ratio);
            let ids: Vec<u32> = (0..input).map(|_| rng.below(vocab) as u32).collect();
            let mut reencoded = tokenizer.encode(&tokenizer.decode(&ids)?, false)?;
            reencoded.truncate(input);
            Ok(BenchRequest {
                prompt: tokenizer.decode(&reencoded)?,
                max_tokens,
            })
        })
        .collect()
}

/// Uniform in [⌊ratio·max⌋, max], at least 1.
fn between(rng: &mut SplitMix64, max: usize, ratio: f64) -> usize {
    let min = ((max as f64 * ratio) as usize).clamp(1, max.max(1));
    min + rng.below((max.max(1) - min + 1) as u64) as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_stay_in_range_and_cover_it() {
        let mut rng = SplitMix64(7);
        let draws: Vec<usize> = (0..2000).map(|_| between(&mut rng, 10, 0.8)).collect();
        assert!(draws.iter().all(|&d| (8..=10).contains(&d)));
        for want in 8..=10 {
            assert!(draws.contains(&want), "{want} never drawn");
        }
        assert_eq!(between(&mut SplitMix64(3), 1, 0.8), 1);
        assert_eq!(
            between(&mut SplitMix64(3), 0, 0.8),
            1,
            "a request asks for at least one token"
        );
    }
}
