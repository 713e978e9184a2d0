//! Prompt-lookup drafting (vLLM's `ngram` speculative method): a sequence's last `n` tokens are
//! looked up earlier in its own tokens (prompt and output), and the tokens that followed that
//! earlier occurrence are proposed as the next ones. No draft model, and nothing proposed where
//! nothing matches, so a step without drafts costs what it did. It pays where output repeats
//! its context: quoting, editing code, extraction, structured output.

/// How to draft: at most `tokens` a step, from the longest match of `max` down to `min` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramConfig {
    /// Drafted tokens a step at most (`num_speculative_tokens`); 0 turns drafting off.
    pub tokens: usize,
    /// Match lengths tried, longest first (`prompt_lookup_max` down to `prompt_lookup_min`).
    pub min: usize,
    pub max: usize,
}

impl NgramConfig {
    pub const OFF: Self = Self {
        tokens: 0,
        min: 1,
        max: 1,
    };

    pub fn is_on(&self) -> bool {
        self.tokens > 0
    }

    /// Up to `limit` (and `self.tokens`) tokens to try after `tokens`: what followed the most
    /// recent earlier occurrence of its last `n` tokens, for the longest `n` that has one.
    pub fn propose(&self, tokens: &[u32], limit: usize) -> Vec<u32> {
        let limit = limit.min(self.tokens);
        if limit == 0 {
            return Vec::new();
        }
        for n in (self.min.max(1)..=self.max).rev() {
            if n >= tokens.len() {
                continue;
            }
            let suffix = &tokens[tokens.len() - n..];
            // Occurrences ending before the suffix itself, most recent first.
            let found = (0..tokens.len() - n)
                .rev()
                .find(|&start| &tokens[start..start + n] == suffix);
            if let Some(start) = found {
                let from = start + n;
                return tokens[from..(from + limit).min(tokens.len())].to_vec();
            }
        }
        Vec::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONFIG: NgramConfig = NgramConfig {
        tokens: 3,
        min: 1,
        max: 3,
    };

    #[test]
    fn proposes_what_followed_the_latest_longest_match() {
        // "a b c d ... a b c" → the 3-gram "a b c" last occurred at 0, followed by "d e f".
        let t = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3];
        assert_eq!(CONFIG.propose(&t, 8), vec![4, 5, 6]);
        assert_eq!(CONFIG.propose(&t, 2), vec![4, 5], "the caller's limit");
        // The latest of two occurrences wins.
        let t = [7, 1, 8, 8, 7, 1, 9, 9, 7, 1];
        assert_eq!(CONFIG.propose(&t, 8), vec![9, 9, 7]);
    }

    #[test]
    fn falls_back_to_shorter_matches_and_proposes_nothing_without_one() {
        let t = [5, 6, 7, 1, 2, 6];
        assert_eq!(CONFIG.propose(&t, 8), vec![7, 1, 2], "only the 1-gram `6` recurs");
        assert_eq!(CONFIG.propose(&[1, 2, 3, 4], 8), Vec::<u32>::new());
        assert_eq!(NgramConfig { min: 2, ..CONFIG }.propose(&t, 8), Vec::<u32>::new());
        assert_eq!(NgramConfig::OFF.propose(&t, 8), Vec::<u32>::new());
        assert_eq!(CONFIG.propose(&[], 8), Vec::<u32>::new());
    }

    #[test]
    fn a_match_near_the_end_proposes_what_exists() {
        // The 2-gram "3 3" recurs one step back: only one token follows it.
        let t = [1, 3, 3, 3];
        assert_eq!(CONFIG.propose(&t, 8), vec![3]);
    }
}
