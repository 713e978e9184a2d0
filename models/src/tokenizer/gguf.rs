//! Building a tokenizer from GGUF metadata (`tokenizer.ggml.*`).
//!
//! - `gpt2`: byte-level BPE from `tokens` + `merges`. The `pre` key names the pre-tokenizer the
//!   merges were learned with; `smollm` splits digits one by one before GPT-2's regex.
//! - `llama`: SentencePiece BPE from `tokens` + `scores`. GGUF keeps no merges, so they are
//!   derived: every split of a token into two vocabulary pieces is a merge, ranked by the
//!   merged token's score (for Gemma the vocabulary order: its scores are ranks). Spaces are
//!   written `▁`, unknown bytes fall back to `<0xXX>` tokens.
//!
//! Token types (`token_type`): 3 control → special added tokens; 4 user-defined → added tokens
//! matched before the model; 6 byte → reached through byte fallback.

use super::{ChatTemplate, Tokenizer};
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::models::bpe::Vocab;
use tokenizers::models::bpe::BPE;
use tokenizers::normalizers::replace::Replace;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::{AddedToken, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper};

const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;

pub(super) fn build(file: &GgufFile) -> Result<Tokenizer> {
    let kind = file.require_str("tokenizer.ggml.model")?;
    let tokens = file.string_array("tokenizer.ggml.tokens")?;
    let types: Vec<i64> = match file.get("tokenizer.ggml.token_type") {
        Some(_) => file
            .number_array("tokenizer.ggml.token_type")?
            .into_iter()
            .map(|t| t as i64)
            .collect(),
        None => vec![1; tokens.len()],
    };
    if types.len() != tokens.len() {
        return Err(meta_error(
            file,
            "tokenizer.ggml.token_type",
            "has a different length than tokenizer.ggml.tokens",
        ));
    }
    let mut inner = match kind {
        "gpt2" => byte_level_bpe(file, &tokens)?,
        "llama" => sentencepiece_bpe(file, &tokens)?,
        other => {
            return Err(meta_error(
                file,
                "tokenizer.ggml.model",
                &format!("is `{other}`; bbc builds `gpt2` and `llama` tokenizers"),
            ))
        }
    };
    let spelled = |t: &str| {
        if kind == "llama" {
            respell_spaces(t)
        } else {
            t.to_string()
        }
    };
    let special: Vec<AddedToken> = tokens
        .iter()
        .zip(&types)
        .filter(|(_, &ty)| ty == CONTROL)
        .map(|(t, _)| AddedToken::from(spelled(t), true).normalized(false))
        .collect();
    let user: Vec<AddedToken> = tokens
        .iter()
        .zip(&types)
        .filter(|(_, &ty)| ty == USER_DEFINED)
        .map(|(t, _)| AddedToken::from(spelled(t), false).normalized(false))
        .collect();
    inner.add_special_tokens(&special);
    inner.add_tokens(&user);

    let id = |key: &str| -> Result<Option<u32>> {
        Ok(file
            .optional_u64(key)?
            .map(|v| v as u32)
            .filter(|&v| (v as usize) < tokens.len()))
    };
    let bos = id("tokenizer.ggml.bos_token_id")?;
    let eos_id = id("tokenizer.ggml.eos_token_id")?;
    let mut eos: Vec<u32> = eos_id.into_iter().collect();
    // Chat models end a turn with their end-of-turn token, which GGUF does not always name.
    for end_of_turn in ["<|im_end|>", "<end_of_turn>", "<|eot_id|>"] {
        if let Some(i) = tokens.iter().position(|t| *t == end_of_turn) {
            eos.push(i as u32);
        }
    }
    eos.sort_unstable();
    eos.dedup();
    let add_bos = file
        .get("tokenizer.ggml.add_bos_token")
        .and_then(|v| v.as_bool())
        .unwrap_or(kind == "llama");
    let chat_template = file
        .get("tokenizer.chat_template")
        .and_then(|v| v.as_str())
        .map(|t| ChatTemplate::new(t, &inner, bos, eos_id));
    Ok(Tokenizer {
        inner,
        bos,
        eos,
        add_bos,
        chat_template,
    })
}

fn meta_error(file: &GgufFile, key: &str, problem: &str) -> ModelError {
    ModelError::Metadata {
        path: file.path.clone(),
        key: key.into(),
        problem: problem.into(),
    }
}

fn tokenizer_error(e: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}

fn byte_level_bpe(file: &GgufFile, tokens: &[&str]) -> Result<tokenizers::Tokenizer> {
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i as u32))
        .collect();
    let merges = file
        .string_array("tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| meta_error(file, "tokenizer.ggml.merges", &format!("holds `{m}`, not two tokens")))
        })
        .collect::<Result<Vec<_>>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(tokenizer_error)?;
    let mut tk = tokenizers::Tokenizer::new(bpe);
    let byte_level = ByteLevel::new(false, true, true);
    let pre: PreTokenizerWrapper = match file.get("tokenizer.ggml.pre").and_then(|v| v.as_str()) {
        Some("smollm") => PreSequence::new(vec![Digits::new(true).into(), byte_level.into()]).into(),
        _ => byte_level.into(),
    };
    tk.with_pre_tokenizer(Some(pre));
    tk.with_decoder(Some(DecoderWrapper::from(ByteLevelDecoder::default())));
    Ok(tk)
}

/// A token that is a run of spaces is written as `▁`s: the normalizer turns every space into
/// `▁`, so that is the only spelling text can reach.
fn respell_spaces(token: &str) -> String {
    if !token.is_empty() && token.chars().all(|c| c == ' ') {
        "▁".repeat(token.chars().count())
    } else {
        token.to_string()
    }
}

fn sentencepiece_bpe(file: &GgufFile, tokens: &[&str]) -> Result<tokenizers::Tokenizer> {
    let scores = file.number_array("tokenizer.ggml.scores")?;
    if scores.len() != tokens.len() {
        return Err(meta_error(
            file,
            "tokenizer.ggml.scores",
            "has a different length than tokenizer.ggml.tokens",
        ));
    }
    let pieces: Vec<String> = tokens.iter().map(|t| respell_spaces(t)).collect();
    let vocab: Vocab = pieces.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
    let merges = derive_merges(&pieces, &vocab, &scores);
    let unk = file
        .optional_u64("tokenizer.ggml.unknown_token_id")?
        .and_then(|i| pieces.get(i as usize).cloned());
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = unk {
        builder = builder.unk_token(unk);
    }
    let mut tk = tokenizers::Tokenizer::new(builder.build().map_err(tokenizer_error)?);
    let add_prefix = file
        .get("tokenizer.ggml.add_space_prefix")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    let mut normalizers: Vec<NormalizerWrapper> = Vec::new();
    if add_prefix {
        normalizers.push(tokenizers::normalizers::prepend::Prepend::new("▁".into()).into());
    }
    normalizers.push(Replace::new(" ", "▁").map_err(tokenizer_error)?.into());
    tk.with_normalizer(Some(tokenizers::normalizers::Sequence::new(normalizers)));
    // `Replace` doubles as a decoder in the tokenizers crate.
    let mut decoders: Vec<DecoderWrapper> = vec![
        Replace::new("▁", " ").map_err(tokenizer_error)?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if add_prefix {
        decoders.push(tokenizers::decoders::strip::Strip::new(' ', 1, 0).into());
    }
    tk.with_decoder(Some(DecoderWrapper::from(DecoderSequence::new(decoders))));
    Ok(tk)
}

/// SentencePiece BPE merges from the vocabulary: for every piece, each split into two pieces of
/// the vocabulary is a merge producing it. Merges apply in vocabulary order of the produced
/// piece: a SentencePiece BPE vocabulary is stored merge-ordered, while its scores can have
/// placeholders punched through them (every whitespace run in a Gemma file scores −1000, yet
/// `▁▁` must merge before `▁leading`). Splits of one piece go by their parts' scores.
fn derive_merges(pieces: &[String], vocab: &Vocab, scores: &[f64]) -> Vec<(String, String)> {
    let mut ranked: Vec<(u32, u32, u32)> = Vec::new();
    for (id, piece) in pieces.iter().enumerate() {
        for cut in piece.char_indices().map(|(i, _)| i).skip(1) {
            let (l, r) = piece.split_at(cut);
            if let (Some(&li), Some(&ri)) = (vocab.get(l), vocab.get(r)) {
                ranked.push((id as u32, li, ri));
            }
        }
    }
    let score = |i: u32| scores[i as usize];
    ranked.sort_by(|a, b| {
        a.0.cmp(&b.0)
            .then(score(b.1).total_cmp(&score(a.1)))
            .then(score(b.2).total_cmp(&score(a.2)))
            .then((a.1, a.2).cmp(&(b.1, b.2)))
    });
    ranked
        .into_iter()
        .map(|(_, l, r)| (pieces[l as usize].clone(), pieces[r as usize].clone()))
        .collect()
}
