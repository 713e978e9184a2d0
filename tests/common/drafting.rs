//! Two drafters compared round after round, as an engine would drive them; a logits processor
//! that proposes drafts as a grammar proposes its forced text; targets whose next token is a
//! function of their last, and requests served through a drafting engine.

use models::weights::{MemoryTensor, MemoryTensors, Tensors};
use models::{Model, WeightSource};
use runtime::serving::{
    DraftRequest, Drafter, NgramConfig, PagedBackend, SchedulerConfig, SeqId, ServingEngine, StepOutput,
};
use runtime::{LogitsProcessor, SamplingParams};
use std::collections::HashMap;

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

/// Whether `name` is a projection whose output a layer adds to the residual stream.
pub fn adds_to_the_residual(name: &str) -> bool {
    ["o_proj.weight", "down_proj.weight", "out_proj.weight"]
        .iter()
        .any(|end| name.ends_with(end))
}

/// `model` with every layer's contribution to the residual stream zeroed: its logits at a
/// position are a function of that position's token alone (its attention and DeltaNet layers
/// still run, their outputs multiplied away).
pub fn bigram(mut model: Model) -> Model {
    let WeightSource::Memory(tensors) = &mut model.weights else {
        panic!("weights in memory")
    };
    for (name, t) in tensors.iter_mut() {
        if name.starts_with("model.") && adds_to_the_residual(name) {
            t.bytes.fill(0);
        }
    }
    model
}

/// A deterministic stream of values in (−scale, scale).
pub fn noise(seed: u64, len: usize, scale: f32) -> Vec<f32> {
    let mut state = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

pub fn f32_tensor(shape: &[usize], values: &[f32]) -> MemoryTensor {
    assert_eq!(shape.iter().product::<usize>(), values.len());
    MemoryTensor {
        shape: shape.to_vec(),
        dtype: models::quant::GgmlType::F32,
        bytes: values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// Four sequences at once in `kv_blocks` blocks of 8, drafting `drafts` a step, the prefix
/// cache on.
pub fn config(kv_blocks: usize, drafts: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_waiting: 32,
        max_running: 4,
        token_budget: 64,
        kv_blocks,
        block_size: 8,
        context_length: 2048,
        prefix_caching: true,
        speculation: NgramConfig {
            tokens: drafts,
            min: 1,
            max: 3,
        },
        recurrent_state: false,
        // Snapshots of the recurrent states, so that the prefix cache serves hybrid models.
        state_cache: runtime::serving::StateCacheConfig::every(8, 32),
    }
}

/// What serving `requests` gave: each one's tokens, drafts made and accepted, whether any
/// step found the cache full, and the prompt positions the prefix cache served.
pub struct Served {
    pub tokens: Vec<Vec<u32>>,
    pub drafted: usize,
    pub accepted: usize,
    pub cache_full: bool,
    pub prefix_hits: usize,
}

/// What `requests` gave served on `target`, drafted for by `head` where there is one.
pub fn serve_on<B: PagedBackend>(
    target: B,
    head: Option<Box<dyn Drafter>>,
    config: SchedulerConfig,
    requests: &[(Vec<u32>, SamplingParams)],
    max_tokens: usize,
) -> Served {
    let mut engine = ServingEngine::new(target, config);
    if let Some(head) = head {
        assert!(engine.use_drafter(head));
    }
    let kv_blocks = config.kv_blocks;
    let mut ids = Vec::new();
    let mut got: HashMap<SeqId, Vec<u32>> = HashMap::new();
    let (mut drafted, mut accepted, mut cache_full) = (0, 0, false);
    // The later half of the requests come once the first have finished, so that their shared
    // prefixes are in the prefix cache.
    let (first, later) = requests.split_at(requests.len() / 2);
    for batch in [first, later] {
        for (prompt, sampling) in batch {
            ids.push(engine.add(prompt.clone(), max_tokens, vec![], *sampling).unwrap());
        }
        while !engine.scheduler().is_idle() {
            let out: StepOutput = engine.step().unwrap();
            assert_eq!(engine.scheduler().check(), Ok(()));
            cache_full |= engine.scheduler().used_blocks() == kv_blocks;
            drafted += out.drafted;
            accepted += out.accepted;
            got.extend(out.finished.into_iter().map(|d| (d.seq, d.generated)));
        }
    }
    Served {
        tokens: ids.iter().map(|id| got[id].clone()).collect(),
        drafted,
        accepted,
        cache_full,
        prefix_hits: engine.scheduler().prefix_cache_stats().hit as usize,
    }
}

/// Prompts of a few lengths, the later half each an earlier one and a token more (so its
/// beginning is in the prefix cache); greedy, but for a seeded sampled one where `sampled`.
pub fn requests(vocab: u32, sampled: bool) -> Vec<(Vec<u32>, SamplingParams)> {
    requests_of_lengths(vocab, sampled, [19, 6, 30, 12])
}

/// [`requests`] whose first four prompts have `lengths`.
pub fn requests_of_lengths(vocab: u32, sampled: bool, lengths: [u32; 4]) -> Vec<(Vec<u32>, SamplingParams)> {
    let sampling = match sampled {
        true => SamplingParams {
            temperature: 0.8,
            seed: 3,
            top_p: 0.9,
            ..SamplingParams::default()
        },
        false => SamplingParams::default(),
    };
    let prompt = |base: u32, len: u32| -> Vec<u32> { (0..len).map(|j| (base + 29 * j) % vocab).collect() };
    let mut first = vec![
        (prompt(11, lengths[0]), SamplingParams::default()),
        (prompt(40, lengths[1]), SamplingParams::default()),
        (prompt(7, lengths[2]), sampling),
        (prompt(90, lengths[3]), SamplingParams::default()),
    ];
    let later: Vec<_> = first
        .iter()
        .map(|(p, s)| {
            let mut p = p.clone();
            p.push(5);
            (p, *s)
        })
        .collect();
    first.extend(later);
    first
}

/// `drafting` served `plain`'s tokens, drafts were made and not every one accepted, the prefix
/// cache served prompts, and the cache filled (preemption) exactly where `small_cache` says.
pub fn assert_refused_drafts_kept_the_tokens(drafting: &Served, plain: &Served, small_cache: bool, what: &str) {
    assert_eq!(drafting.tokens, plain.tokens, "{what}");
    assert!(drafting.drafted > 0, "{what}: no drafts");
    assert!(drafting.accepted < drafting.drafted, "{what}: every draft accepted");
    assert!(drafting.prefix_hits > 0, "{what}: the prefix cache served nothing");
    assert_eq!(drafting.cache_full, small_cache, "{what}");
}

/// One sequence's step of `ids` from `start` with a hidden state per id (none for a target).
pub fn segment<'a>(
    table: &'a [runtime::kv::BlockId],
    start: usize,
    ids: &'a [u32],
    hidden_states: &'a [f32],
) -> runtime::kv::Segment<'a> {
    runtime::kv::Segment {
        table,
        start,
        ids,
        state_slot: 0,
        sampled_rows: 1,
        drafts: 0,
        snapshots: runtime::kv::StateSnapshots::NONE,
        hidden_states,
    }
}

/// `model` with its weights copied into memory, to be changed there.
pub fn in_memory(mut model: Model) -> Model {
    let mut tensors = MemoryTensors::new();
    for name in model.weights.names() {
        let view = model.weights.tensor(name).unwrap();
        tensors.insert(
            name.to_string(),
            MemoryTensor {
                shape: view.shape.to_vec(),
                dtype: view.dtype,
                bytes: view.bytes.to_vec(),
            },
        );
    }
    model.weights = WeightSource::Memory(tensors);
    model
}
