//! Building a tokenizer from GGUF metadata (`tokenizer.ggml.*`).
//!
//! - `gpt2`: byte-level BPE from `tokens` + `merges`. The `pre` key names the pre-tokenizer the
//!   merges were learned with, by llama.cpp's names: GPT-2's regex (`default`, `gpt2`, or no
//!   key); `smollm` splits digits one by one before it; `llama-bpe` (Llama 3; also GLM's
//!   `glm4`, `glm5`, `chatglm-bpe`), `qwen2` and `qwen35` split by their tokenizer.json's own
//!   regex (digits in threes, one by one, and letters with their combining marks). Another
//!   name is refused: merges applied to chunks split some other way give other ids.
//! - `gemma4`: Gemma 4's BPE, SentencePiece-style (spaces written `▁`, raw UTF-8 rather than a
//!   byte-level alphabet, `<0xXX>` byte fallback) from `tokens` + `merges`, as llama.cpp runs
//!   it: text split only into runs of newlines and the rest, a piece that is a whole token
//!   taken whole (llama.cpp does so for newline runs, which no merge reaches), BOS always
//!   first.
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
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior};

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
        "gemma4" => metaspace_bpe(file, &tokens)?,
        other => {
            return Err(meta_error(
                file,
                "tokenizer.ggml.model",
                &format!("is `{other}`; bbc builds `gpt2`, `llama` and `gemma4` tokenizers"),
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
    for end_of_turn in ["<|im_end|>", "<end_of_turn>", "<turn|>", "<|eot_id|>"] {
        if let Some(i) = tokens.iter().position(|t| *t == end_of_turn) {
            eos.push(i as u32);
        }
    }
    eos.sort_unstable();
    eos.dedup();
    // llama.cpp starts every Gemma 4 prompt with BOS, whatever the file says.
    let add_bos = kind == "gemma4"
        || file
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

/// The file's tokens as a BPE vocabulary, and its merges: each `left right`, split (as
/// llama.cpp splits them) at the first space after the first character.
fn vocab_and_merges(file: &GgufFile, tokens: &[&str]) -> Result<(Vocab, Vec<(String, String)>)> {
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i as u32))
        .collect();
    let merges = file
        .string_array("tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            let first = m.chars().next().map_or(0, char::len_utf8);
            m[first..]
                .find(' ')
                .map(|at| (m[..first + at].to_string(), m[first + at + 1..].to_string()))
                .ok_or_else(|| meta_error(file, "tokenizer.ggml.merges", &format!("holds `{m}`, not two tokens")))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((vocab, merges))
}

fn byte_level_bpe(file: &GgufFile, tokens: &[&str]) -> Result<tokenizers::Tokenizer> {
    let (vocab, merges) = vocab_and_merges(file, tokens)?;
    // llama.cpp takes a piece that is a whole token whole under these pre-tokenizers (as
    // Llama 3's tokenizer.json says, `ignore_merges`).
    let ignore_merges = matches!(
        file.get("tokenizer.ggml.pre").and_then(|v| v.as_str()),
        Some("llama-bpe" | "glm4" | "glm5")
    );
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(tokenizer_error)?;
    let mut tk = tokenizers::Tokenizer::new(bpe);
    tk.with_pre_tokenizer(Some(byte_level_pre_tokenizer(file)?));
    tk.with_decoder(Some(DecoderWrapper::from(ByteLevelDecoder::default())));
    Ok(tk)
}

/// The split regexes of tokenizer.json files that llama.cpp names by `tokenizer.ggml.pre` (the
/// originals, as HF's tokenizers run them; llama.cpp spells the case-insensitive group out).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN35_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizer a `gpt2` vocabulary's merges were learned with (see the module's notes).
fn byte_level_pre_tokenizer(file: &GgufFile) -> Result<PreTokenizerWrapper> {
    let gpt2 = ByteLevel::new(false, true, true);
    // After a split of its own, bytes become characters without GPT-2's regex.
    let split_then_bytes = |pattern: &str| -> Result<PreTokenizerWrapper> {
        let split = Split::new(
            SplitPattern::Regex(pattern.into()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(tokenizer_error)?;
        Ok(PreSequence::new(vec![split.into(), ByteLevel::new(false, true, false).into()]).into())
    };
    match file.get("tokenizer.ggml.pre").and_then(|v| v.as_str()) {
        None | Some("default" | "gpt2") => Ok(gpt2.into()),
        Some("smollm") => Ok(PreSequence::new(vec![Digits::new(true).into(), gpt2.into()]).into()),
        // GLM-4.5's and GLM-5's (llama.cpp's CHATGLM4 regex is Llama 3's, spelled out).
        Some("llama-bpe" | "glm4" | "glm5" | "chatglm-bpe") => split_then_bytes(LLAMA3_SPLIT),
        Some("qwen2" | "deepseek-r1-qwen") => split_then_bytes(QWEN2_SPLIT),
        Some("qwen35") => split_then_bytes(QWEN35_SPLIT),
        Some(other) => Err(meta_error(
            file,
            "tokenizer.ggml.pre",
            &format!("is `{other}`, a pre-tokenizer bbc does not know (it knows default, gpt2, smollm, llama-bpe, glm4, glm5, chatglm-bpe, qwen2 and qwen35)"),
        )),
    }
}

/// Gemma 4's tokenizer (see the module's notes). llama.cpp merges each piece by the file's
/// ranks except a run of newlines that is a token, which it takes whole; `ignore_merges` takes
/// any piece that is a token whole, the same wherever the merges reach the token a piece
/// spells (and for newline runs, which they do not reach).
fn metaspace_bpe(file: &GgufFile, tokens: &[&str]) -> Result<tokenizers::Tokenizer> {
    let (vocab, merges) = vocab_and_merges(file, tokens)?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .ignore_merges(true)
        .build()
        .map_err(tokenizer_error)?;
    let mut tk = tokenizers::Tokenizer::new(bpe);
    tk.with_normalizer(Some(Replace::new(" ", "▁").map_err(tokenizer_error)?));
    let newline_runs = Split::new(
        SplitPattern::Regex("\n+".into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(tokenizer_error)?;
    tk.with_pre_tokenizer(Some(newline_runs));
    tk.with_decoder(Some(metaspace_decoder(false)?));
    Ok(tk)
}

/// `▁` back to spaces, byte tokens back to their bytes; without the leading space a prepended
/// `▁` put there.
fn metaspace_decoder(strip_prefix: bool) -> Result<DecoderWrapper> {
    // `Replace` doubles as a decoder in the tokenizers crate.
    let mut decoders: Vec<DecoderWrapper> = vec![
        Replace::new("▁", " ").map_err(tokenizer_error)?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if strip_prefix {
        decoders.push(tokenizers::decoders::strip::Strip::new(' ', 1, 0).into());
    }
    Ok(DecoderSequence::new(decoders).into())
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
    tk.with_decoder(Some(metaspace_decoder(add_prefix)?));
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

#[cfg(test)]
mod tests {
    use crate::gguf::writer::GgufWriter;
    use crate::gguf::{GgufFile, MetaValue};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;

    /// A byte-level vocabulary (every byte's character, then a few merged tokens) under
    /// `pre`, or an error where bbc refuses it.
    fn tokenizer(pre: &str) -> crate::Result<super::Tokenizer> {
        let mut tokens: Vec<String> = ByteLevel::alphabet().into_iter().map(String::from).collect();
        tokens.sort();
        let merges = ["( a", "1 2", "12 3", "4 5", "e Ì"];
        tokens.extend(merges.iter().map(|m| m.replace(' ', "")));
        // A token no merge reaches.
        tokens.push("xy".into());
        let strings = |v: Vec<String>| MetaValue::Array(v.into_iter().map(MetaValue::String).collect());
        let bytes = GgufWriter::new()
            .meta("general.alignment", MetaValue::U32(32))
            .meta("tokenizer.ggml.model", MetaValue::String("gpt2".into()))
            .meta("tokenizer.ggml.pre", MetaValue::String(pre.into()))
            .meta("tokenizer.ggml.tokens", strings(tokens))
            .meta("tokenizer.ggml.merges", strings(merges.map(String::from).to_vec()))
            .to_bytes();
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), bytes).unwrap();
        super::build(&GgufFile::open(file.path())?)
    }

    /// The tokens `text` becomes under `pre`.
    fn pieces(pre: &str, text: &str) -> Vec<String> {
        let tk = tokenizer(pre).unwrap();
        let ids = tk.encode(text, false).unwrap();
        ids.iter().map(|&id| tk.inner.id_to_token(id).unwrap()).collect()
    }

    /// Merges apply within the chunks each model's regex splits text into: Llama 3 keeps
    /// digits in threes and a leading bracket with the word after it, Qwen splits digits one
    /// by one, and Qwen3.5 keeps a combining mark with its letter where Qwen2 does not.
    #[test]
    fn each_pre_tokenizer_splits_as_its_model_does() {
        let text = "(ab 12345 e\u{301}";
        let mark = "\u{123}"; // byte 0x81 as a byte-level character
        let want = |v: &[&str]| v.iter().map(|s| s.replace('*', mark)).collect::<Vec<_>>();
        assert_eq!(
            pieces("gpt2", text),
            want(&["(", "a", "b", "Ġ", "123", "45", "Ġ", "e", "Ì", "*"])
        );
        assert_eq!(pieces("default", text), pieces("gpt2", text));
        assert_eq!(
            pieces("smollm", text),
            want(&["(", "a", "b", "Ġ", "1", "2", "3", "4", "5", "Ġ", "e", "Ì", "*"])
        );
        assert_eq!(
            pieces("llama-bpe", text),
            want(&["(a", "b", "Ġ", "123", "45", "Ġ", "e", "Ì", "*"])
        );
        assert_eq!(pieces("glm4", text), pieces("llama-bpe", text));
        assert_eq!(pieces("glm5", text), pieces("llama-bpe", text));
        assert_eq!(
            pieces("qwen2", text),
            want(&["(a", "b", "Ġ", "1", "2", "3", "4", "5", "Ġ", "e", "Ì", "*"])
        );
        assert_eq!(
            pieces("qwen35", text),
            want(&["(a", "b", "Ġ", "1", "2", "3", "4", "5", "Ġ", "eÌ", "*"])
        );
    }

    /// Where llama.cpp ignores merges (Llama 3's and GLM's pre-tokenizers), a chunk that is a
    /// token is that token, reached by merges or not; elsewhere merges alone build tokens.
    #[test]
    fn llama3_and_glm_take_a_chunk_that_is_a_token_whole() {
        for pre in ["llama-bpe", "glm4", "glm5"] {
            assert_eq!(pieces(pre, "xy"), ["xy"], "{pre}");
        }
        assert_eq!(pieces("qwen2", "xy"), ["x", "y"]);
    }

    #[test]
    fn an_unknown_pre_tokenizer_is_refused_by_name() {
        let err = tokenizer("tekken").err().expect("refused").to_string();
        assert!(err.contains("tokenizer.ggml.pre") && err.contains("`tekken`"), "{err}");
    }
}
