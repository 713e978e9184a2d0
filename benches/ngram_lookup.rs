//! What prompt lookup costs on the engine thread (the scheduler looks up every decoding
//! sequence every step), at sequence lengths up to 32768 tokens: where the last tokens recur
//! near the end (a scan finds them at once) and where they never recur (a scan searches the
//! whole sequence at every match length). Prints µs per proposal for the scan
//! (`NgramConfig::propose`) and for the index (`propose_indexed`, a token appended before each
//! lookup, as in decode). `cargo bench --bench ngram_lookup`.

use runtime::serving::{NgramConfig, NgramIndex};
use std::time::Instant;

/// µs per call of `f` over `calls` calls.
fn time(calls: usize, mut f: impl FnMut() -> usize) -> f64 {
    let started = Instant::now();
    let mut proposed = 0;
    for _ in 0..calls {
        proposed += f();
    }
    std::hint::black_box(proposed);
    started.elapsed().as_secs_f64() * 1e6 / calls as f64
}

fn main() {
    let config = NgramConfig {
        tokens: 4,
        min: 1,
        max: 3,
    };
    println!(
        "{:>8} {:>16} {:>16} {:>16} {:>16}",
        "tokens", "recurring scan", "never scan", "recurring index", "never index"
    );
    for len in [1024, 4096, 16384, 32768] {
        // A text whose tokens repeat with a long period, ending in its own first tokens.
        let recurring: Vec<u32> = (0..len as u32 + 200).map(|i| i % 997).collect();
        // Distinct tokens: the suffix has no earlier occurrence at any length.
        let never: Vec<u32> = (0..len as u32 + 200).collect();
        let hit = time(200, || config.propose(&recurring[..len], 4).len());
        let miss = time(200, || config.propose(&never[..len], 4).len());
        let indexed = |tokens: &[u32]| {
            let mut index = NgramIndex::default();
            config.propose_indexed(&tokens[..len], &mut index, 4);
            let mut at = len;
            time(200, || {
                at += 1;
                config.propose_indexed(&tokens[..at], &mut index, 4).len()
            })
        };
        let (hit_indexed, miss_indexed) = (indexed(&recurring), indexed(&never));
        println!("{len:>8} {hit:>16.2} {miss:>16.2} {hit_indexed:>16.2} {miss_indexed:>16.2}");
    }
}
