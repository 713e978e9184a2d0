//! What the engine thread spends per row of logits it samples from or reports on, at
//! SmolLM2's and Gemma 3's vocabulary sizes: `TokenLogprobs::of` (log-probabilities, for the
//! alternatives lm-eval (1) and chat clients (5, 20) ask for; a scored prompt pays it at every
//! position) and `Sampler::sample` under the settings chat clients send (a temperature alone,
//! with `top_p`, `top_k`, `min_p`), and greedily (the argmax alone). Prints µs per row.
//! `cargo bench --bench sampling_rows`.

use runtime::{Sampler, SamplingParams, TokenLogprobs};
use std::time::Instant;

/// A row spread as a model's logits are: a few large, most small (fixed pseudo-random values).
fn row(vocab: usize) -> Vec<f32> {
    let mut rng = runtime::sampling::SplitMix64(7);
    (0..vocab)
        .map(|_| {
            let u = rng.next_f64() as f32;
            // Mostly around 0, a tail up to 30.
            30.0 * u.powi(12) + 4.0 * (u - 0.5)
        })
        .collect()
}

/// µs per call of `f` over `rows` calls.
fn time(rows: usize, mut f: impl FnMut(usize)) -> f64 {
    let started = Instant::now();
    for i in 0..rows {
        f(i);
    }
    started.elapsed().as_secs_f64() * 1e6 / rows as f64
}

fn main() {
    let sampled = SamplingParams {
        temperature: 0.7,
        seed: 7,
        ..SamplingParams::default()
    };
    let settings = [
        ("temperature 0.7", sampled),
        ("top_p 0.9", SamplingParams { top_p: 0.9, ..sampled }),
        ("top_k 50", SamplingParams { top_k: 50, ..sampled }),
        ("min_p 0.05", SamplingParams { min_p: 0.05, ..sampled }),
        (
            "top_k 50, top_p 0.95",
            SamplingParams {
                top_k: 50,
                top_p: 0.95,
                ..sampled
            },
        ),
        (
            "greedy",
            SamplingParams {
                temperature: 0.0,
                ..sampled
            },
        ),
    ];
    for vocab in [49_152usize, 262_144] {
        let logits = row(vocab);
        for top in [0usize, 1, 5, 20] {
            let micros = time(100, |i| {
                std::hint::black_box(TokenLogprobs::of(&logits, (i * 7919 % vocab) as u32, top));
            });
            println!("vocabulary {vocab:>7}: logprobs, {top:>2} alternatives: {micros:>8.1} µs a row");
        }
        for (name, params) in settings {
            let mut sampler = Sampler::new(params);
            let micros = time(50, |_| {
                std::hint::black_box(sampler.sample(&logits));
            });
            println!("vocabulary {vocab:>7}: sampling, {name:<21}: {micros:>8.1} µs a row");
        }
    }
}
