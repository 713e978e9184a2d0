//! Prompt-lookup drafting (vLLM's `ngram` speculative method): a sequence's last `n` tokens are
//! looked up earlier in its own tokens (prompt and output), and the tokens that followed that
//! earlier occurrence are proposed as the next ones. No draft model, and nothing proposed where
//! nothing matches, so a step without drafts costs what it did. It pays where output repeats
//! its context: quoting, editing code, extraction, structured output.

use std::collections::HashMap;
use std::hash::Hasher;

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
        self.propose_by(tokens, limit, |n| scan_latest_earlier(tokens, n))
    }

    /// [`propose`](Self::propose)'s tokens, looked up in `index` (brought up to date with
    /// `tokens` first) rather than by a scan.
    pub fn propose_indexed(&self, tokens: &[u32], index: &mut NgramIndex, limit: usize) -> Vec<u32> {
        if limit.min(self.tokens) > 0 {
            index.extend(tokens, self.min, self.max);
        }
        self.propose_by(tokens, limit, |n| index.latest_earlier(tokens, n))
    }

    /// Up to `limit` (and `self.tokens`) tokens after where `latest_earlier(n)` says the latest
    /// earlier occurrence of `tokens`' last `n` tokens ends, for the longest `n` that has one.
    fn propose_by(&self, tokens: &[u32], limit: usize, latest_earlier: impl Fn(usize) -> Option<usize>) -> Vec<u32> {
        let limit = limit.min(self.tokens);
        if limit == 0 {
            return Vec::new();
        }
        let longest_first = (self.min.max(1)..=self.max).rev().filter(|&n| n < tokens.len());
        match longest_first.into_iter().find_map(latest_earlier) {
            Some(from) => tokens[from..(from + limit).min(tokens.len())].to_vec(),
            None => Vec::new(),
        }
    }
}

/// Where the latest occurrence of `tokens`' last `n` tokens that ends before the sequence does
/// ends (overlapping the suffix or not), searched from the end.
fn scan_latest_earlier(tokens: &[u32], n: usize) -> Option<usize> {
    let suffix = &tokens[tokens.len() - n..];
    (n..tokens.len()).rev().find(|&end| &tokens[end - n..end] == suffix)
}

/// A sequence's n-grams (of the lengths a config looks up), indexed as its tokens grow, so that
/// a lookup costs the same at any length: [`NgramConfig::propose`] searches the whole sequence
/// (about 0.15 ms at 32768 tokens where nothing recurs, `benches/ngram_lookup.rs`, for each
/// decoding sequence each step). A sequence's tokens only grow, so the index only grows with them:
/// about 24 bytes a token and match length.
#[derive(Debug, Clone, Default)]
pub struct NgramIndex {
    /// Tokens indexed: every n-gram ending at or before this position is in `ends`.
    indexed: usize,
    /// By a hash of an n-gram (its length included): where its two latest occurrences end,
    /// latest first (0: none).
    ends: HashMap<u64, [u32; 2], std::hash::BuildHasherDefault<NgramHasher>>,
}

/// The index's hasher: its keys are already hashes ([`NgramIndex::key`]), so it passes them
/// through (FNV-1a for anything else).
#[derive(Default)]
struct NgramHasher(u64);

impl Hasher for NgramHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ b as u64).wrapping_mul(0x100_0000_01b3);
        }
    }

    fn write_u64(&mut self, key: u64) {
        self.0 = key;
    }
}

impl NgramIndex {
    /// The key of `ngram`: its length and tokens, hashed.
    fn key(ngram: &[u32]) -> u64 {
        let mut hash = 0xcbf2_9ce4_8422_2325u64 ^ ngram.len() as u64;
        for &token in ngram {
            hash = (hash ^ token as u64).wrapping_mul(0x100_0000_01b3);
        }
        hash
    }

    /// Index the n-grams (`min..=max` long) ending at each position of `tokens` not yet indexed.
    fn extend(&mut self, tokens: &[u32], min: usize, max: usize) {
        for end in self.indexed + 1..=tokens.len() {
            for n in min.max(1)..=max.min(end) {
                let ends = self.ends.entry(Self::key(&tokens[end - n..end])).or_default();
                *ends = [end as u32, ends[0]];
            }
        }
        self.indexed = tokens.len();
    }

    /// [`scan_latest_earlier`]'s answer, found by the index (by the scan itself where two
    /// n-grams' hashes collide, so the answer is always the scan's).
    fn latest_earlier(&self, tokens: &[u32], n: usize) -> Option<usize> {
        let suffix = &tokens[tokens.len() - n..];
        let matches = |end: usize| end >= n && &tokens[end - n..end] == suffix;
        let [latest, before] = self.ends.get(&Self::key(suffix)).copied().unwrap_or_default();
        let (latest, before) = (latest as usize, before as usize);
        match (latest == tokens.len(), before) {
            // The suffix itself, then an earlier occurrence or none.
            (true, 0) => None,
            (true, end) if matches(end) => Some(end),
            // A collision: the index cannot tell.
            _ => scan_latest_earlier(tokens, n),
        }
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

    proptest::proptest! {
        /// The index proposes what the scan does, at every length of a growing sequence (a
        /// small alphabet, so n-grams recur at every distance), under every config.
        #[test]
        fn the_index_proposes_what_the_scan_does(
            tokens in proptest::collection::vec(0u32..4, 0..200),
            min in 1usize..4,
            extra in 0usize..3,
            limit in 0usize..6,
        ) {
            let config = NgramConfig { tokens: 4, min, max: min + extra };
            let mut index = NgramIndex::default();
            for len in 0..=tokens.len() {
                let (scanned, indexed) = (config.propose(&tokens[..len], limit), config.propose_indexed(&tokens[..len], &mut index, limit));
                proptest::prop_assert_eq!(indexed, scanned, "{} tokens", len);
            }
        }
    }

    /// Where two n-grams' hashes collide, the index's answer is still the scan's.
    #[test]
    fn colliding_keys_fall_back_to_the_scan() {
        let t = [5, 1, 2, 9, 7, 1, 2];
        let mut index = NgramIndex::default();
        assert_eq!(CONFIG.propose_indexed(&t, &mut index, 8), vec![9, 7, 1]);
        // Point the 2-gram "1 2"'s entry at a wrong earlier end, as a collision would.
        let key = NgramIndex::key(&[1, 2]);
        index.ends.insert(key, [7, 4]);
        assert_eq!(CONFIG.propose_indexed(&t, &mut index, 8), CONFIG.propose(&t, 8));
        index.ends.insert(key, [6, 3]);
        assert_eq!(CONFIG.propose_indexed(&t, &mut index, 8), CONFIG.propose(&t, 8));
    }

    #[test]
    fn a_match_near_the_end_proposes_what_exists() {
        // The 2-gram "3 3" recurs one step back: only one token follows it.
        let t = [1, 3, 3, 3];
        assert_eq!(CONFIG.propose(&t, 8), vec![3]);
    }
}
