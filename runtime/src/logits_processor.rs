//! What a sequence's logits go through before it samples, beyond the sampler's own settings:
//! structured outputs' grammar (which masks the tokens it refuses; the server builds it),
//! OpenAI's `logit_bias`, vLLM's `min_tokens`, `allowed_token_ids` and `bad_words`. The
//! serving engine (and `generate_processed`) runs a sequence's processors in order on every
//! row it samples from, and tells each the token taken.

/// One change to a sequence's logits, which may follow the tokens it takes.
pub trait LogitsProcessor: Send {
    /// Change `logits` (a row as wide as the model's vocabulary) before the next token is
    /// chosen. One that masks tokens (sets them to −∞) leaves at least one allowed: where a
    /// grammar cannot go on (it is complete, or it failed), the tokens that end the sequence.
    fn process(&mut self, logits: &mut [f32]);
    /// The sequence took `token` (one the processed logits allowed).
    fn accept(&mut self, _token: u32) {}
    /// Get ready for the next `process` where that takes work that does not need the logits
    /// (a grammar's mask): the engine calls this while the backend computes the row, on
    /// another thread. What is prepared holds until the next `accept`.
    fn prepare(&mut self) {}
    /// Tokens this processor expects next (a grammar's forced text, tokenized): the engine
    /// offers them to the step as drafted tokens, which the model verifies like any others,
    /// so they change no output, only how many steps it takes. Empty where it knows none.
    /// Must leave the processor as it was.
    fn proposals(&mut self) -> Vec<u32> {
        Vec::new()
    }
}

/// The token `sampler` takes from `logits` as `processors` leave them, in order (in a copy,
/// `scratch`, kept by the caller so a row costs no allocation); each processor then hears it.
pub fn sample_processed(
    sampler: &mut crate::sampling::Sampler,
    processors: &mut [Box<dyn LogitsProcessor>],
    logits: &[f32],
    scratch: &mut Vec<f32>,
) -> u32 {
    scratch.clear();
    scratch.extend_from_slice(logits);
    processors.iter_mut().for_each(|p| p.process(scratch));
    let token = sampler.sample(scratch);
    processors.iter_mut().for_each(|p| p.accept(token));
    token
}

/// OpenAI's `logit_bias`: a bias added to some tokens' logits (±100 all but bans or forces
/// a token).
pub struct LogitBias(pub Vec<(u32, f32)>);

impl LogitsProcessor for LogitBias {
    fn process(&mut self, logits: &mut [f32]) {
        for &(id, bias) in &self.0 {
            if let Some(logit) = logits.get_mut(id as usize) {
                *logit += bias;
            }
        }
    }
}

/// vLLM's `min_tokens`: the tokens that would stop the sequence are masked until it has
/// taken `min` tokens.
pub struct MinTokens {
    left: usize,
    stop_tokens: Vec<u32>,
}

impl MinTokens {
    pub fn new(min: usize, stop_tokens: Vec<u32>) -> Self {
        Self { left: min, stop_tokens }
    }
}

impl LogitsProcessor for MinTokens {
    fn process(&mut self, logits: &mut [f32]) {
        if self.left > 0 {
            for &id in &self.stop_tokens {
                if let Some(logit) = logits.get_mut(id as usize) {
                    *logit = f32::NEG_INFINITY;
                }
            }
        }
    }

    fn accept(&mut self, _token: u32) {
        self.left = self.left.saturating_sub(1);
    }
}

/// vLLM's `allowed_token_ids`: every other token masked.
pub struct AllowedTokens {
    ids: Vec<u32>,
    /// The allowed tokens' logits while the row is masked (kept to avoid an allocation a row).
    kept: Vec<f32>,
}

impl AllowedTokens {
    /// Ids outside a row are never allowed (the server refuses them before).
    pub fn new(ids: Vec<u32>) -> Self {
        Self { ids, kept: Vec::new() }
    }
}

impl LogitsProcessor for AllowedTokens {
    fn process(&mut self, logits: &mut [f32]) {
        self.kept.clear();
        self.kept.extend(
            self.ids
                .iter()
                .map(|&id| logits.get(id as usize).copied().unwrap_or(f32::NEG_INFINITY)),
        );
        logits.fill(f32::NEG_INFINITY);
        for (&id, &logit) in self.ids.iter().zip(&self.kept) {
            if let Some(slot) = logits.get_mut(id as usize) {
                *slot = logit;
            }
        }
    }
}

/// vLLM's `bad_words`, as token sequences the output may not complete: where the tokens taken
/// so far end with all but the last token of one, its last token is masked (a word of one
/// token always). Only the output's own tokens count, as in vLLM.
pub struct BadWords {
    words: Vec<Vec<u32>>,
    taken: Vec<u32>,
}

impl BadWords {
    pub fn new(words: Vec<Vec<u32>>) -> Self {
        Self {
            words: words.into_iter().filter(|w| !w.is_empty()).collect(),
            taken: Vec::new(),
        }
    }
}

impl LogitsProcessor for BadWords {
    fn process(&mut self, logits: &mut [f32]) {
        for word in &self.words {
            let (last, prefix) = word.split_last().expect("words are not empty");
            if self.taken.ends_with(prefix) {
                if let Some(logit) = logits.get_mut(*last as usize) {
                    *logit = f32::NEG_INFINITY;
                }
            }
        }
    }

    fn accept(&mut self, token: u32) {
        self.taken.push(token);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bias_moves_only_its_tokens() {
        let mut logits = vec![1.0, 2.0, 3.0];
        LogitBias(vec![(0, 5.0), (2, -100.0), (9, 1.0)]).process(&mut logits);
        assert_eq!(logits, [6.0, 2.0, -97.0]);
    }

    #[test]
    fn only_allowed_tokens_keep_their_logits() {
        let mut logits = vec![1.0, 2.0, 3.0, 4.0];
        AllowedTokens::new(vec![3, 1, 9]).process(&mut logits);
        assert_eq!(logits, [f32::NEG_INFINITY, 2.0, f32::NEG_INFINITY, 4.0]);
    }

    /// A word's last token is masked only right after the rest of it; one-token words always.
    #[test]
    fn bad_words_are_never_completed() {
        let mut bad = BadWords::new(vec![vec![5, 6, 7], vec![2], vec![]]);
        let masked = |bad: &mut BadWords| {
            let mut logits = vec![0.0; 8];
            bad.process(&mut logits);
            (0..8).filter(|&i| logits[i] == f32::NEG_INFINITY).collect::<Vec<_>>()
        };
        assert_eq!(masked(&mut bad), [2]);
        bad.accept(5);
        assert_eq!(masked(&mut bad), [2]);
        bad.accept(6);
        assert_eq!(masked(&mut bad), [2, 7]);
        bad.accept(6);
        assert_eq!(masked(&mut bad), [2]);
    }

    #[test]
    fn stop_tokens_wait_for_the_minimum() {
        let mut min = MinTokens::new(2, vec![1]);
        for expect_masked in [true, true, false, false] {
            let mut logits = vec![0.0; 3];
            min.process(&mut logits);
            assert_eq!(logits[1] == f32::NEG_INFINITY, expect_masked);
            assert_eq!((logits[0], logits[2]), (0.0, 0.0));
            min.accept(0);
        }
    }
}
