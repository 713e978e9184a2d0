//! Tokenizers built from the real GGUF files reproduce HF transformers' ids, for every string
//! and prompt in the fixtures; Gemma 4's (no real file here) reproduces llama.cpp's on a tiny
//! vocabulary in its shape.

mod common;

use common::{ids, read_json, real_model};
use models::{ChatMessage, Model};

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
