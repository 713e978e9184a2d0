//! What reporting log-probabilities costs the engine thread per row sampled or scored
//! (`TokenLogprobs::of`: the log-softmax's normaliser, the token's rank, the most likely
//! alternatives) at SmolLM2's and Gemma 3's vocabulary sizes, for the alternatives lm-eval
//! (1) and a chat client (5, 20) ask for. A scored prompt pays it at every position: a
//! 128-token chunk of a Gemma 3 prompt 128 times. Prints µs per row.
//! `cargo bench --bench token_logprobs`.

use runtime::TokenLogprobs;
use std::time::Instant;

fn main() {
    for vocab in [49_152usize, 262_144] {
        // Logits spread as a model's are: a few large, most small (a fixed pseudo-random row).
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let row: Vec<f32> = (0..vocab)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 24.0
            })
            .collect();
        for top in [0usize, 1, 5, 20] {
            let rows = 200;
            let started = Instant::now();
            for i in 0..rows {
                std::hint::black_box(TokenLogprobs::of(&row, (i * 7919 % vocab) as u32, top));
            }
            let micros = started.elapsed().as_secs_f64() * 1e6 / rows as f64;
            println!("vocabulary {vocab:>7}, {top:>2} alternatives: {micros:>8.1} µs a row");
        }
    }
}
