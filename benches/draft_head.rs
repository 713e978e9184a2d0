//! A drafter's vocabulary projection on the CPU backend, at Gemma 3's vocabulary (262 144 rows
//! of 640, bf16: the head is most of a small drafter's step): the plain head (a matmul, then
//! the argmax), the exact INT8-bound head, and the 4-bit shortlist that rescores its best 64
//! rows in bf16 (`--draft-head shortlist`). Prints ms per step for 1 and 4 rows (a drafting
//! pass has a row per sequence), and how often the shortlist's guess is the exact argmax.
//! `cargo bench --bench draft_head`.

use ir::{DType, Graph, InputKind, Op};
use runtime::kv::{BlockId, Segment, StateSnapshots};
use runtime::CpuBackend;
use std::time::Instant;

const VOCAB: usize = 262_144;
const WIDTH: usize = 640;

/// ids → embedding rows → the head's greedy token.
fn head_graph() -> Graph {
    let mut g = Graph::new("draft_head");
    let ids = g.input(InputKind::TokenIds);
    let _positions = g.input(InputKind::Positions);
    let table = g.weight("embed", &[4096, WIDTH], DType::F32);
    let x = g.add(Op::Embedding, &[table, ids]).unwrap();
    let head = g.weight("head", &[VOCAB, WIDTH], DType::BF16);
    let logits = g.add(Op::MatMul, &[x, head]).unwrap();
    let next = g.add(Op::TopK { k: 1 }, &[logits]).unwrap();
    g.set_output("next_token", next);
    g
}

/// ms per step of `backend` over `rows` rows, and the tokens of the last.
fn time(backend: &CpuBackend, rows: usize, steps: usize) -> (f64, Vec<u32>) {
    let ids: Vec<u32> = (0..rows as u32).map(|r| 17 + 389 * r).collect();
    // The graph has no attention: a block each only satisfies the step's checks.
    let tables: Vec<Vec<BlockId>> = (0..rows as u32).map(|r| vec![BlockId(r)]).collect();
    let batch: Vec<Segment> = ids
        .iter()
        .zip(&tables)
        .map(|(id, table)| Segment {
            table,
            start: 0,
            ids: std::slice::from_ref(id),
            state_slot: 0,
            sampled_rows: 1,
            drafts: 0,
            snapshots: StateSnapshots::NONE,
            hidden_states: &[],
        })
        .collect();
    let mut pages = backend.new_pages(16);
    let mut tokens = Vec::new();
    let started = Instant::now();
    for _ in 0..steps {
        let out = backend.step_batch(&mut pages, &batch).unwrap();
        tokens = out.iter().map(|o| o["next_token"].data[0] as u32).collect();
    }
    (started.elapsed().as_secs_f64() * 1e3 / steps as f64, tokens)
}

fn main() {
    let plain = head_graph();
    let weights = runtime::random_weights::host_weights(&plain, 7);
    let int8 = passes::optimized(&plain, passes::CostModel::CPU).unwrap();
    let shortlisted =
        passes::optimized(&passes::shortlisted_draft_head(&plain).unwrap(), passes::CostModel::CPU).unwrap();
    let heads = [
        ("plain bf16 head", plain),
        ("INT8-bound head", int8),
        ("4-bit shortlist", shortlisted),
    ];
    let backends: Vec<(&str, CpuBackend)> = heads
        .into_iter()
        .map(|(name, graph)| (name, CpuBackend::new(graph, &weights, 16).unwrap()))
        .collect();
    for rows in [1, 4] {
        let mut exact = Vec::new();
        for (name, backend) in &backends {
            time(backend, rows, 2);
            let (ms, tokens) = time(backend, rows, 20);
            if exact.is_empty() {
                exact = tokens.clone();
            }
            let same = tokens.iter().zip(&exact).filter(|(a, b)| a == b).count();
            println!("{rows} row(s), {name:>16}: {ms:7.2} ms a step; {same}/{rows} tokens the exact argmax");
        }
    }
}
