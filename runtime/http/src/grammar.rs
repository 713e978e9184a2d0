//! Structured outputs: an [`OutputSpec`] (a JSON schema, a regular expression, a list of
//! choices, a grammar) compiled by llguidance into a grammar over the model's vocabulary (each
//! token's bytes, read from the tokenizer), and a sequence sampled under it
//! ([`GrammarConstraint`], one of the runtime's logits processors): before every token the
//! tokens that cannot continue the grammar are masked, and once the grammar is complete only
//! the tokens that end the sequence remain. `bbc serve` takes the spec from a request
//! (`output_spec`), `bbc run` from its flags.

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use models::Tokenizer;
use runtime::LogitsProcessor;
use serde_json::{json, Value};
use std::sync::Arc;

/// The language an output must belong to.
#[derive(Debug, Clone, PartialEq)]
pub enum OutputSpec {
    /// Any JSON object.
    JsonObject,
    /// JSON valid under this schema.
    JsonSchema(Value),
    /// Text matching this regular expression (Rust's `regex` syntax), whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A context-free grammar in llguidance's Lark syntax (which also takes GBNF's `::=`).
    Grammar(String),
}

/// The grammar compiler for one model's vocabulary.
pub struct StructuredOutputs {
    factory: ParserFactory,
}

impl StructuredOutputs {
    /// The compiler for `tokenizer`'s vocabulary, or why its tokens' bytes cannot be known
    /// (a tokenizer that is neither byte-level nor byte-fallback BPE).
    pub fn new(tokenizer: Arc<Tokenizer>) -> Result<Self, String> {
        let words = token_bytes(&tokenizer)?;
        let eos = tokenizer.eos.first().copied().unwrap_or(0);
        let trie = TokTrie::from(&TokRxInfo::new(words.len() as u32, eos), &words);
        Self::over(Arc::new(ModelTokEnv { trie, tokenizer }))
    }

    /// The compiler over the vocabulary of `env`.
    fn over(env: TokEnv) -> Result<Self, String> {
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        // Grammar errors go back to whoever asked (a 400, an error message), not to stderr.
        factory.quiet();
        Ok(Self { factory })
    }

    /// A matcher for `spec`'s grammar, at the start of the output; why not where the grammar
    /// does not compile.
    pub fn matcher(&self, spec: &OutputSpec) -> Result<Matcher, String> {
        let grammar = match spec {
            OutputSpec::JsonObject => TopLevelGrammar::from_json_schema(json!({"type": "object"})),
            OutputSpec::JsonSchema(schema) => TopLevelGrammar::from_json_schema(schema.clone()),
            OutputSpec::Regex(regex) => TopLevelGrammar::from_regex(regex),
            OutputSpec::Choice(choices) => TopLevelGrammar::from_lark(choice_grammar(choices)),
            OutputSpec::Grammar(lark) => TopLevelGrammar::from_lark(lark.clone()),
        };
        // llguidance catches its panics while matching, not while compiling: a grammar that
        // trips one is refused like any other that does not compile.
        let compiled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.factory.create_parser(grammar)));
        let parser = match compiled {
            Ok(parser) => parser.map_err(|e| e.to_string())?,
            Err(_) => return Err("the grammar compiler failed on it".into()),
        };
        let matcher = Matcher::new(Ok(parser));
        match matcher.get_error() {
            Some(e) => Err(e),
            None => Ok(matcher),
        }
    }
}

/// The vocabulary as llguidance reads it (each token's bytes), and the model's tokenizer for
/// text ([`GrammarConstraint`]'s proposals).
struct ModelTokEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for ModelTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// The tokenizer's tokens for text; the trie's greedy ones for bytes that are not text
    /// (a character cut short) or that it fails on.
    fn tokenize_bytes(&self, bytes: &[u8]) -> Vec<TokenId> {
        std::str::from_utf8(bytes)
            .ok()
            .and_then(|text| self.tokenizer.encode(text, false).ok())
            .unwrap_or_else(|| self.trie.greedy_tokenize(bytes))
    }

    /// Not claimed: llguidance would then rewrite prompts and force tokens itself, where bbc
    /// only drafts them.
    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

/// Every token's bytes, by id (special tokens behind llguidance's marker byte, so no grammar
/// text produces them). llguidance reads them from `tokenizer.json`'s form and asserts on
/// forms it does not expect, so a panic there is a refusal here.
fn token_bytes(tokenizer: &Tokenizer) -> Result<Vec<Vec<u8>>, String> {
    let json = tokenizer.hf_json().map_err(|e| e.to_string())?;
    let read = std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(&json));
    let mut words = match read {
        Ok(Ok(words)) => words,
        Ok(Err(e)) => return Err(e.to_string()),
        Err(_) => return Err("the vocabulary has a token llguidance cannot read".into()),
    };
    // Ids the tokenizer leaves unnamed stay empty: no grammar allows them.
    words.resize(words.len().max(tokenizer.vocab_size()), Vec::new());
    Ok(words)
}

/// A grammar whose language is exactly `choices` (each a JSON-escaped Lark string).
fn choice_grammar(choices: &[String]) -> String {
    let alternatives: Vec<String> = choices.iter().map(|c| json!(c).to_string()).collect();
    format!("start: {}", alternatives.join(" | "))
}

/// One sequence's grammar, as the engine samples under it.
pub struct GrammarConstraint {
    matcher: Matcher,
    /// The request's stop tokens and the model's EOS: what may follow a complete output.
    ends: Vec<u32>,
    reasoning: Reasoning,
    /// The mask for the next token, computed ahead (`prepare`); None where it is not.
    prepared: Option<Option<SimpleVob>>,
}

/// Where the output stands to the model's reasoning, which the grammar does not shape: it
/// shapes the answer after it.
#[derive(Debug, Clone, PartialEq)]
pub enum Reasoning {
    /// None to come: the grammar holds from the first token.
    None,
    /// The model may open its reasoning with `start` (its tokens) first, and close it with
    /// `end`.
    MayOpen { start: Vec<u32>, end: Vec<u32> },
    /// It took the start marker's first token: the rest of it (reversed, next last) follows.
    Opening { rest: Vec<u32>, end: Vec<u32> },
    /// Inside it until `end` has been written; the tokens taken so far.
    Inside { end: Vec<u32>, taken: Vec<u32> },
}

impl Reasoning {
    /// The output opens inside the reasoning (the prompt opened it), which `end` closes.
    pub fn inside(end: Vec<u32>) -> Self {
        match end.is_empty() {
            true => Self::None,
            false => Self::Inside { end, taken: Vec::new() },
        }
    }
}

impl GrammarConstraint {
    pub fn new(matcher: Matcher, ends: Vec<u32>, reasoning: Reasoning) -> Self {
        Self {
            matcher,
            ends,
            reasoning,
            prepared: None,
        }
    }

    /// The tokens that may come next: None where the matcher failed.
    fn next_mask(&mut self) -> Option<SimpleVob> {
        self.matcher.compute_mask_or_eos().ok()
    }

    /// Mask `logits` to what the grammar allows next (the end tokens once it is complete).
    fn mask(&mut self, logits: &mut [f32]) {
        let ends: Vec<(usize, f32)> = self
            .ends
            .iter()
            .filter_map(|&id| Some((id as usize, *logits.get(id as usize)?)))
            .collect();
        // A matcher that failed (its grammar's limits, say) can only end the sequence.
        let mask = self.prepared.take().unwrap_or_else(|| self.next_mask());
        let (mask, eos) = match (mask, self.matcher.tok_env()) {
            (Some(mask), Ok(env)) => (mask, env.tok_trie().eos_token()),
            _ => {
                logits.fill(f32::NEG_INFINITY);
                ends.iter().for_each(|&(id, logit)| logits[id] = logit);
                return;
            }
        };
        // The mask decides every token but the end tokens, 32 to a word.
        let words = mask.as_slice().iter().copied().chain(std::iter::repeat(0));
        for (chunk, word) in logits.chunks_mut(32).zip(words) {
            match word {
                u32::MAX => {}
                0 => chunk.fill(f32::NEG_INFINITY),
                _ => {
                    for (bit, logit) in chunk.iter_mut().enumerate() {
                        if (word >> bit) & 1 == 0 {
                            *logit = f32::NEG_INFINITY;
                        }
                    }
                }
            }
        }
        // The grammar's EOS stands for all of them: they may come once the output is complete.
        let may_end = mask.is_allowed(eos);
        for (id, logit) in ends {
            logits[id] = if may_end { logit } else { f32::NEG_INFINITY };
        }
    }
}

impl LogitsProcessor for GrammarConstraint {
    fn process(&mut self, logits: &mut [f32]) {
        match self.reasoning {
            Reasoning::None => self.mask(logits),
            Reasoning::MayOpen { ref start, .. } => {
                let opener = start
                    .first()
                    .and_then(|&id| Some((id as usize, *logits.get(id as usize)?)));
                self.mask(logits);
                if let Some((id, logit)) = opener {
                    logits[id] = logit;
                }
            }
            Reasoning::Opening { ref rest, .. } => {
                let next = rest.last().map(|&id| id as usize);
                for (id, logit) in logits.iter_mut().enumerate() {
                    if Some(id) != next {
                        *logit = f32::NEG_INFINITY;
                    }
                }
            }
            Reasoning::Inside { .. } => {}
        }
    }

    fn prepare(&mut self) {
        let grammar_next = matches!(self.reasoning, Reasoning::None | Reasoning::MayOpen { .. });
        if grammar_next && self.prepared.is_none() {
            self.prepared = Some(self.next_mask());
        }
    }

    /// The text the grammar forces next (a JSON schema's keys, a choice's rest once one alone
    /// fits), tokenized as the model's tokenizer would (the model mostly writes such text so),
    /// but for its last token, which what follows the text might join. Only where the grammar
    /// shapes the next token (not inside a reasoning).
    fn proposals(&mut self) -> Vec<u32> {
        if self.reasoning != Reasoning::None || self.matcher.is_stopped() {
            return Vec::new();
        }
        let forced = self.matcher.compute_ff_bytes();
        let Ok(env) = self.matcher.tok_env() else {
            return Vec::new();
        };
        let mut tokens = env.tokenize_bytes(&forced);
        tokens.pop();
        tokens
    }

    fn accept(&mut self, token: u32) {
        self.prepared = None;
        match &mut self.reasoning {
            Reasoning::None => {}
            Reasoning::MayOpen { start, end } => {
                let opened = start.first() == Some(&token);
                let (mut rest, end) = (std::mem::take(start), std::mem::take(end));
                rest.remove(0);
                rest.reverse();
                self.reasoning = match (opened, rest.is_empty()) {
                    (false, _) => Reasoning::None,
                    (true, true) => Reasoning::inside(end),
                    (true, false) => Reasoning::Opening { rest, end },
                };
                if opened {
                    return;
                }
            }
            Reasoning::Opening { rest, end } => {
                rest.pop();
                if rest.is_empty() {
                    self.reasoning = Reasoning::inside(std::mem::take(end));
                }
                return;
            }
            Reasoning::Inside { end, taken } => {
                taken.push(token);
                if taken.ends_with(end) {
                    self.reasoning = Reasoning::None;
                }
                return;
            }
        }
        // An end token finishes the sequence; the grammar need not see it. A token the grammar
        // refuses puts the matcher in its error state, which `process` reads as "end only".
        if !self.ends.contains(&token) {
            let _ = self.matcher.consume_token(token);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llguidance's test vocabulary: token `b` is byte `b`, then six special tokens, the last
    /// (261) its EOS.
    const EOS: u32 = 261;

    fn matcher(spec: OutputSpec) -> Matcher {
        let compiler = StructuredOutputs::over(llguidance::toktrie::ApproximateTokEnv::single_byte_env()).unwrap();
        compiler.matcher(&spec).unwrap()
    }

    /// The tokens `constraint` allows next.
    fn allowed(constraint: &mut GrammarConstraint) -> Vec<u32> {
        let mut logits = vec![0.0; 262];
        constraint.process(&mut logits);
        (0..262).filter(|&id| logits[id as usize] == 0.0).collect()
    }

    #[test]
    fn the_mask_follows_the_grammar_and_lets_the_ends_in_once_it_is_complete() {
        let mut c = GrammarConstraint::new(matcher(OutputSpec::Regex("ab+".into())), vec![EOS, 7], Reasoning::None);
        assert_eq!(allowed(&mut c), [b'a' as u32]);
        c.accept(b'a' as u32);
        assert_eq!(allowed(&mut c), [b'b' as u32]);
        c.accept(b'b' as u32);
        assert_eq!(allowed(&mut c), [7, b'b' as u32, EOS]);
        // A token the grammar refuses leaves only the ends.
        c.accept(b'z' as u32);
        assert_eq!(allowed(&mut c), [7, EOS]);
    }

    /// A mask computed ahead is the one `process` would compute, and a token taken after it
    /// makes it stale.
    #[test]
    fn a_prepared_mask_is_the_next_one_and_no_later() {
        let regex = || matcher(OutputSpec::Regex("ab+".into()));
        let (mut ahead, mut plain) = (
            GrammarConstraint::new(regex(), vec![EOS], Reasoning::None),
            GrammarConstraint::new(regex(), vec![EOS], Reasoning::None),
        );
        ahead.prepare();
        assert_eq!(allowed(&mut ahead), allowed(&mut plain));
        ahead.prepare();
        ahead.accept(b'a' as u32);
        plain.accept(b'a' as u32);
        assert_eq!(allowed(&mut ahead), [b'b' as u32]);
        assert_eq!(allowed(&mut plain), [b'b' as u32]);
    }

    #[test]
    fn choices_are_matched_exactly_with_their_quotes_and_backslashes() {
        let choices = vec!["a\\b".to_string(), "\"q\"".to_string()];
        let mut c = GrammarConstraint::new(matcher(OutputSpec::Choice(choices.clone())), vec![EOS], Reasoning::None);
        assert_eq!(allowed(&mut c), [b'"' as u32, b'a' as u32]);
        for choice in &choices {
            let mut c =
                GrammarConstraint::new(matcher(OutputSpec::Choice(choices.clone())), vec![EOS], Reasoning::None);
            for &b in choice.as_bytes() {
                assert!(allowed(&mut c).contains(&(b as u32)), "{choice}");
                c.accept(b as u32);
            }
            assert_eq!(allowed(&mut c), [EOS], "{choice}");
        }
    }

    /// The grammar's forced text is proposed, but for its last token, and without changing
    /// what the grammar allows; nothing where the next byte is a choice, inside a reasoning,
    /// or once the output is complete.
    #[test]
    fn forced_text_is_proposed_but_its_last_token() {
        let bytes = |text: &str| text.bytes().map(u32::from).collect::<Vec<_>>();
        let choices = vec!["yes please".to_string(), "no thanks".to_string()];
        let mut c = GrammarConstraint::new(matcher(OutputSpec::Choice(choices)), vec![EOS], Reasoning::None);
        assert_eq!(c.proposals(), Vec::<u32>::new(), "y or n");
        c.accept(b'y' as u32);
        assert_eq!(c.proposals(), bytes("es pleas"));
        assert_eq!(allowed(&mut c), bytes("e"), "proposing consumed nothing");
        for &b in b"es please" {
            c.accept(b as u32);
        }
        assert_eq!(c.proposals(), Vec::<u32>::new(), "complete");
        let regex = || matcher(OutputSpec::Regex("ab[0-9]".into()));
        assert_eq!(
            GrammarConstraint::new(regex(), vec![EOS], Reasoning::None).proposals(),
            bytes("a")
        );
        let mut thinking = GrammarConstraint::new(regex(), vec![EOS], Reasoning::inside(vec![b'/' as u32]));
        assert_eq!(thinking.proposals(), Vec::<u32>::new());
        thinking.accept(b'/' as u32);
        assert_eq!(thinking.proposals(), bytes("a"), "after the reasoning");
    }

    #[test]
    fn inside_reasoning_the_grammar_waits_for_the_end_marker() {
        let marker = vec![b'<' as u32, b'/' as u32, b'>' as u32];
        let mut c = GrammarConstraint::new(
            matcher(OutputSpec::Regex("[0-9]".into())),
            vec![EOS],
            Reasoning::inside(marker),
        );
        for &b in b"think </ still </>" {
            assert_eq!(allowed(&mut c).len(), 262, "reasoning is free");
            c.accept(b as u32);
        }
        let digits: Vec<u32> = (b'0'..=b'9').map(u32::from).collect();
        assert_eq!(allowed(&mut c), digits);
        c.accept(b'4' as u32);
        assert_eq!(allowed(&mut c), [EOS]);
    }

    /// Where the prompt did not open the reasoning, the model may open it with its start
    /// marker first (then the grammar waits for the end marker), or answer at once under the
    /// grammar; a start marker of several tokens, once begun, is written out whole.
    #[test]
    fn a_model_may_open_its_reasoning_before_the_grammar() {
        const OPEN: u32 = 256;
        let digits: Vec<u32> = (b'0'..=b'9').map(u32::from).collect();
        let may_open = |start: Vec<u32>| Reasoning::MayOpen {
            start,
            end: vec![b'/' as u32],
        };
        let regex = || matcher(OutputSpec::Regex("[0-9]".into()));
        let mut c = GrammarConstraint::new(regex(), vec![EOS], may_open(vec![OPEN]));
        assert_eq!(allowed(&mut c), [&digits[..], &[OPEN]].concat());
        c.accept(OPEN);
        assert_eq!(allowed(&mut c).len(), 262, "reasoning is free");
        c.accept(b'/' as u32);
        assert_eq!(allowed(&mut c), digits);
        let mut answered = GrammarConstraint::new(regex(), vec![EOS], may_open(vec![OPEN]));
        answered.accept(b'7' as u32);
        assert_eq!(allowed(&mut answered), [EOS], "no reasoning after the answer began");

        let mut long = GrammarConstraint::new(regex(), vec![EOS], may_open(vec![OPEN, b't' as u32, b'\n' as u32]));
        assert_eq!(allowed(&mut long), [&digits[..], &[OPEN]].concat());
        long.accept(OPEN);
        assert_eq!(allowed(&mut long), [b't' as u32]);
        long.accept(b't' as u32);
        assert_eq!(allowed(&mut long), [b'\n' as u32]);
        long.accept(b'\n' as u32);
        assert_eq!(allowed(&mut long).len(), 262, "reasoning is free");
    }

    #[test]
    fn json_object_allows_any_object_and_nothing_else() {
        let mut c = GrammarConstraint::new(matcher(OutputSpec::JsonObject), vec![EOS], Reasoning::None);
        assert!(!allowed(&mut c).contains(&(b'[' as u32)));
        for &b in br#"{"k": [1, {"x": null}]}"# {
            assert!(allowed(&mut c).contains(&(b as u32)), "{}", b as char);
            c.accept(b as u32);
        }
        assert!(allowed(&mut c).contains(&EOS));
    }
}
