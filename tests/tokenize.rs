//! Tokenizers built from the real GGUF files reproduce HF transformers' ids, for every string
//! and prompt in the fixtures; Gemma 4's (no real file here) reproduces llama.cpp's on a tiny
//! vocabulary in its shape.

mod common;

use common::{ids, read_json, real_model};
use models::gguf::GgufFile;
use models::{ChatMessage, Model, StreamDecoder, Tokenizer};
use proptest::prelude::*;
use std::sync::OnceLock;

fn check_model(name: &str, fixture: &str) {
    let model = Model::open_path(&real_model(name)).unwrap();
    let tok = model.tokenizer.as_ref().expect("the GGUF carries a tokenizer");
    let reference = read_json(fixture);
    let mut failures = Vec::new();
    for case in reference["tokenize"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let got = tok.encode(text, false).unwrap();
        if got != ids(&case["ids"]) {
            failures.push(format!("tokenize {text:?}: got {got:?}, want {:?}", ids(&case["ids"])));
        }
    }
    for case in reference["raw"].as_array().unwrap() {
        let text = case["prompt"].as_str().unwrap();
        let got = tok.encode(text, true).unwrap();
        if got != ids(&case["prompt_ids"]) {
            failures.push(format!(
                "prompt {text:?}: got {got:?}, want {:?}",
                ids(&case["prompt_ids"])
            ));
        }
    }
    for case in reference["chat"].as_array().into_iter().flatten() {
        let messages: Vec<ChatMessage> = serde_json::from_value(case["messages"].clone()).unwrap();
        let template = tok.chat_template.as_ref().expect("a chat template");
        let text = template.render(&messages, true).unwrap();
        assert_eq!(text, case["prompt_text"].as_str().unwrap());
        let got = tok.encode(&text, true).unwrap();
        if got != ids(&case["prompt_ids"]) {
            failures.push(format!(
                "chat {messages:?}: got {got:?}, want {:?}",
                ids(&case["prompt_ids"])
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn smollm2_tokenization_matches_reference() {
    check_model("smollm2", "real/smollm2.json");
}

#[test]
fn gemma3_tokenization_matches_reference() {
    check_model("gemma3-270m", "real/gemma3.json");
}

#[test]
fn decoding_round_trips_text() {
    let model = Model::open_path(&real_model("smollm2")).unwrap();
    let tok = model.tokenizer.as_ref().unwrap();
    let text = "Unicode: café, naïve, 東京, 😀";
    assert_eq!(tok.decode(&tok.encode(text, false).unwrap()).unwrap(), text);
}

/// Gemma 4's tokenizer (`tokenizer.ggml.model = "gemma4"`) on the tiny vocabulary of
/// `gguf-tiny/tiny_gemma4_vocab.py`: llama.cpp's ids for each text (BOS first, special-token
/// text parsed; spaces as `▁`, runs of newlines taken whole only where the vocabulary has them,
/// unknown characters as `<0xXX>` bytes), and the text back from them.
#[test]
fn gemma4_tokenization_matches_llama_cpp() {
    let model = Model::open_path(&common::fixture("gguf-tiny/gemma4_kv_shared.gguf")).unwrap();
    let tok = model.tokenizer.as_ref().expect("the file carries the tiny vocabulary");
    assert_eq!((tok.bos, tok.add_bos), (Some(2), true));
    // `<eos>`, and `<turn|>` ending a chat turn.
    assert_eq!(tok.eos, vec![1, 5]);
    for case in read_json("gguf-tiny/gemma4-tokenize-llamacpp.json")["cases"]
        .as_array()
        .unwrap()
    {
        let text = case["text"].as_str().unwrap();
        let got = tok.encode(text, true).unwrap();
        assert_eq!(got, ids(&case["ids"]), "{text:?}");
        assert_eq!(tok.decode(&got[1..]).unwrap(), text);
    }
}

/// The tokenizer of a real model's GGUF file, read once per test binary.
fn real_tokenizer(name: &'static str) -> &'static Tokenizer {
    static SMOLLM2: OnceLock<Tokenizer> = OnceLock::new();
    static GEMMA3: OnceLock<Tokenizer> = OnceLock::new();
    let cell = match name {
        "smollm2" => &SMOLLM2,
        _ => &GEMMA3,
    };
    cell.get_or_init(|| Tokenizer::from_gguf(&GgufFile::open(&real_model(name)).unwrap()).unwrap())
}

/// A piece of an answer: text the tokenizer encodes (multi-byte characters, spaces and
/// newlines at token edges), or any token of the vocabulary.
#[derive(Clone, Debug)]
enum AnswerPart {
    Text(String),
    Token(u32),
}

fn answer_part() -> impl Strategy<Value = AnswerPart> {
    prop_oneof![
        3 => "[a-z .,\\n]{0,6}|[éï東京😀🚀 ]{1,4}|  [A-Z]{1,3}".prop_map(AnswerPart::Text),
        1 => any::<u32>().prop_map(AnswerPart::Token),
    ]
}

/// The answer's ids; random tokens are taken modulo the vocabulary.
fn answer_ids(tokenizer: &Tokenizer, parts: &[AnswerPart]) -> Vec<u32> {
    let vocab = tokenizer.vocab_size() as u32;
    parts
        .iter()
        .flat_map(|part| match part {
            AnswerPart::Text(text) => tokenizer.encode(text, false).unwrap(),
            AnswerPart::Token(id) => vec![id % vocab],
        })
        .collect()
}

/// Streams `ids` as a server does; the pieces pushed, and the one `finish` gave.
fn stream(tokenizer: &Tokenizer, ids: &[u32]) -> (Vec<String>, String) {
    let mut decoder = StreamDecoder::new();
    let pieces = ids.iter().map(|&id| decoder.push(tokenizer, id).unwrap()).collect();
    (pieces, decoder.finish(tokenizer).unwrap())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Streaming (each token decoding a short window) gives the text of the whole answer
    /// decoded at once, and never releases a piece ending in a partial character.
    #[test]
    fn streamed_pieces_add_up_to_the_decoded_answer(
        parts in proptest::collection::vec(answer_part(), 1..24),
        gemma in any::<bool>(),
    ) {
        let tokenizer = real_tokenizer(if gemma { "gemma3-270m" } else { "smollm2" });
        let ids = answer_ids(tokenizer, &parts);
        let (pieces, rest) = stream(tokenizer, &ids);
        for piece in &pieces {
            prop_assert!(!piece.ends_with('\u{FFFD}'), "a partial character released: {piece:?}");
        }
        prop_assert_eq!(pieces.concat() + &rest, tokenizer.decode(&ids).unwrap());
    }
}

/// A character whose bytes come in several tokens is released whole, with the token that
/// completes it (Gemma 3 spells characters outside its vocabulary as `<0xXX>` byte tokens).
#[test]
fn a_character_split_across_tokens_is_released_when_complete() {
    let tokenizer = real_tokenizer("gemma3-270m");
    let bytes: Vec<u32> = "€"
        .bytes()
        .map(|b| tokenizer.token_to_id(&format!("<0x{b:02X}>")).unwrap())
        .collect();
    let ids = [tokenizer.encode("Price", false).unwrap(), bytes].concat();
    let (pieces, rest) = stream(tokenizer, &ids);
    assert_eq!(pieces.concat(), "Price€");
    assert_eq!(pieces[pieces.len() - 3..], ["", "", "€"]);
    assert_eq!(rest, "");
    // Cut after the second byte, the partial character waits for `finish`.
    let (pieces, rest) = stream(tokenizer, &ids[..ids.len() - 1]);
    assert_eq!((pieces.concat().as_str(), rest.as_str()), ("Price", "\u{FFFD}\u{FFFD}"));
}
