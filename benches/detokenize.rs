//! What the server spends turning each generated token into text (`StreamDecoder::push`, run
//! once a token per request on the HTTP side), at several output lengths, for SmolLM2's
//! byte-level BPE and Gemma 3's SentencePiece tokenizer. Prints µs per token: the mean over a
//! whole answer of that length, and the mean over its last 64 tokens (where a decoder that
//! re-reads the whole answer pays most). `cargo bench --bench detokenize`.

use models::{gguf::GgufFile, StreamDecoder, Tokenizer};
use std::time::Instant;

/// Ordinary text, tokenized and repeated to `len` tokens: what an answer's ids look like.
fn answer(tokenizer: &Tokenizer, len: usize) -> Vec<u32> {
    let text = "The quick brown fox jumps over the lazy dog. Voilà: naïve café, 東京 and 🚀 too.\n\
                1. Red: the colour of fire.\n2. Blue: the colour of the sea.\n";
    let ids = tokenizer.encode(text, false).expect("encoding the sample text");
    ids.iter().copied().cycle().take(len).collect()
}

/// µs per token over the whole answer, and over its last 64 tokens.
fn time(tokenizer: &Tokenizer, ids: &[u32]) -> (f64, f64) {
    let mut decoder = StreamDecoder::new();
    let tail = ids.len().saturating_sub(64);
    let started = Instant::now();
    let mut tail_started = started;
    let mut bytes = 0;
    for (i, &id) in ids.iter().enumerate() {
        if i == tail {
            tail_started = Instant::now();
        }
        bytes += decoder.push(tokenizer, id).expect("decoding").len();
    }
    let done = Instant::now();
    bytes += decoder.finish(tokenizer).expect("decoding").len();
    assert_eq!(
        bytes,
        tokenizer.decode(ids).unwrap().len(),
        "the pieces add up to the whole text"
    );
    let per = |d: std::time::Duration, n: usize| d.as_secs_f64() * 1e6 / n as f64;
    (
        per(done - started, ids.len()),
        per(done - tail_started, ids.len() - tail),
    )
}

fn main() {
    println!(
        "{:>14} {:>8} {:>14} {:>16}",
        "model", "tokens", "µs/token", "µs/token (last 64)"
    );
    for name in ["smollm2", "gemma3-270m"] {
        let known = bbc::fetch::known(name).unwrap_or_else(|| panic!("`{name}` is not a model bbc fetches"));
        let path = bbc::fetch::ensure(known, true).expect("fetching the model");
        let tokenizer = Tokenizer::from_gguf(&GgufFile::open(&path).expect("opening the GGUF file"))
            .expect("reading the tokenizer");
        for len in [256, 1024, 4096, 16384] {
            let (mean, last) = time(&tokenizer, &answer(&tokenizer, len));
            println!("{name:>14} {len:>8} {mean:>14.2} {last:>16.2}");
        }
    }
}
