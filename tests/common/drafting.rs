//! Two drafters compared round after round, as an engine would drive them; a logits processor
//! that proposes drafts as a grammar proposes its forced text.

use runtime::serving::{DraftRequest, Drafter, SeqId};
use runtime::LogitsProcessor;

/// Ask `want` and `got` for drafts for `sequences` (ids 0, 1, …) in `rounds` rounds, and
/// check they propose the same; after each round every sequence keeps some of the drafts
/// (a different number each time, none to all) and a token of its own after them, so the
/// drafters see drafts accepted, refused and diverged from.
pub fn propose_alike(
    want: &mut dyn Drafter,
    got: &mut dyn Drafter,
    mut sequences: Vec<Vec<u32>>,
    rounds: usize,
    what: &str,
) {
    for round in 0..rounds {
        let requests: Vec<DraftRequest> = sequences
            .iter()
            .enumerate()
            .map(|(i, tokens)| DraftRequest {
                seq: SeqId(i as u64),
                tokens,
                limit: 1 + (i + round) % 3,
            })
            .collect();
        let wanted = want.propose(&requests).unwrap();
        assert_eq!(got.propose(&requests).unwrap(), wanted, "{what}: round {round}");
        for (i, tokens) in sequences.iter_mut().enumerate() {
            let drafts = &wanted[&SeqId(i as u64)];
            tokens.extend(&drafts[..(i + round) % (drafts.len() + 1)]);
            tokens.push((17 * round as u32 + i as u32) % 300);
        }
    }
}

/// A logits processor that proposes the next six tokens of `script` (each plus `shift`: 0 the
/// tokens the sequence will take, else wrong ones) and changes no logit.
pub struct Foreseeing {
    script: Vec<u32>,
    shift: u32,
    taken: usize,
}

impl Foreseeing {
    pub fn new(script: Vec<u32>, shift: u32) -> Self {
        Self {
            script,
            shift,
            taken: 0,
        }
    }
}

impl LogitsProcessor for Foreseeing {
    fn process(&mut self, _logits: &mut [f32]) {}

    fn accept(&mut self, _token: u32) {
        self.taken += 1;
    }

    fn proposals(&mut self) -> Vec<u32> {
        self.script
            .iter()
            .skip(self.taken)
            .take(6)
            .map(|t| t + self.shift)
            .collect()
    }
}
