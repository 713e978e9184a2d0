//! Two drafters compared round after round, as an engine would drive them.

use runtime::serving::{DraftRequest, Drafter, SeqId};

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
