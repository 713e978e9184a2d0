//! A reasoning model's output split into its reasoning and its answer, as OpenAI-compatible
//! servers return them (`reasoning_content` beside `content`; vLLM's `--reasoning-parser`).
//! Models mark their reasoning with a start and an end marker: Qwen3.5, Qwen3-Next, GLM-4.5 and
//! GLM-5 write `<think>…</think>`, Gemma 4 `<|channel>thought\n…<channel|>`. The output either
//! opens with the start marker (whitespace before it allowed), or is already inside the
//! reasoning because the chat template ended the prompt with the start marker (Qwen3.5's does
//! when thinking is on); anything else is all answer. Text that may be the start of a marker is
//! held back until it is known, so a marker never reaches the client, not even in part.

use super::text::partial_match_len;
use models::Family;

/// Which markers `bbc serve` splits output at: the model family's (`auto`), none, or a named
/// pair.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ReasoningParser {
    Auto,
    None,
    /// `<think>` … `</think>`.
    Think,
    /// `<|channel>thought\n` … `<channel|>`.
    Gemma4,
}

/// The markers around a model's reasoning.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Markers {
    pub start: &'static str,
    pub end: &'static str,
}

const THINK: Markers = Markers {
    start: "<think>",
    end: "</think>",
};

/// Every marker a parser splits at (their special tokens must reach the text).
pub const MARKER_TEXTS: [&str; 4] = [THINK.start, THINK.end, GEMMA4_THOUGHT.start, GEMMA4_THOUGHT.end];

const GEMMA4_THOUGHT: Markers = Markers {
    start: "<|channel>thought\n",
    end: "<channel|>",
};

impl ReasoningParser {
    /// The markers this choice splits at for a model of `family`, if any.
    pub fn markers(self, family: Family) -> Option<Markers> {
        match self {
            Self::Auto => match family {
                Family::Qwen35 | Family::Qwen3Next | Family::Glm4Moe | Family::GlmMoeDsa => Some(THINK),
                Family::Gemma4 => Some(GEMMA4_THOUGHT),
                Family::Llama | Family::Gemma3 => None,
            },
            Self::None => None,
            Self::Think => Some(THINK),
            Self::Gemma4 => Some(GEMMA4_THOUGHT),
        }
    }
}

impl Markers {
    /// Whether a rendered chat prompt leaves the model inside its reasoning: it ends with the
    /// start marker (trailing whitespace aside).
    pub fn opened_by(&self, prompt: &str) -> bool {
        prompt.trim_end().ends_with(self.start.trim_end())
    }

    /// Whether `text` (an answer the caller began, to be continued) leaves the reasoning
    /// open: a start marker comes after its last end marker.
    pub fn left_open_by(&self, text: &str) -> bool {
        let start = text.rfind(self.start.trim_end());
        start.is_some() && start > text.rfind(self.end)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    /// Nothing but whitespace yet: the start marker may still come.
    Opening,
    Reasoning,
    Answer,
}

/// One choice's output, split as it streams.
pub struct ReasoningSplit {
    markers: Markers,
    part: Part,
    /// Text not yet released (whitespace before a possible start marker, or a possible
    /// marker's beginning).
    held: String,
}

/// What a piece of output released: reasoning, then answer (a piece can end the reasoning).
#[derive(Debug, Default, PartialEq)]
pub struct Split {
    pub reasoning: String,
    pub answer: String,
}

impl ReasoningSplit {
    /// A choice's split; `inside` where the prompt already opened the reasoning.
    pub fn new(markers: Markers, inside: bool) -> Self {
        Self {
            markers,
            part: if inside { Part::Reasoning } else { Part::Opening },
            held: String::new(),
        }
    }

    pub fn push(&mut self, text: &str) -> Split {
        self.held.push_str(text);
        let mut out = Split::default();
        if self.part == Part::Opening {
            let trimmed = self.held.trim_start();
            if let Some(rest) = trimmed.strip_prefix(self.markers.start) {
                self.held = rest.to_string();
                self.part = Part::Reasoning;
            } else if self.markers.start.starts_with(trimmed) {
                return out;
            } else {
                self.part = Part::Answer;
            }
        }
        if self.part == Part::Reasoning {
            match self.held.find(self.markers.end) {
                Some(at) => {
                    out.reasoning = self.held[..at].to_string();
                    self.held.drain(..at + self.markers.end.len());
                    self.part = Part::Answer;
                }
                None => {
                    let keep = partial_match_len(&self.held, self.markers.end);
                    out.reasoning = self.held.drain(..self.held.len() - keep).collect();
                    return out;
                }
            }
        }
        out.answer = std::mem::take(&mut self.held);
        out
    }

    /// What is held at the end of the output: unterminated reasoning stays reasoning; text
    /// that never opened it is answer.
    pub fn finish(&mut self) -> Split {
        let held = std::mem::take(&mut self.held);
        match self.part {
            Part::Reasoning => Split {
                reasoning: held,
                answer: String::new(),
            },
            Part::Opening | Part::Answer => Split {
                reasoning: String::new(),
                answer: held,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole split of `pieces` pushed one by one, then finished.
    fn split(markers: Markers, inside: bool, pieces: &[&str]) -> (String, String) {
        let mut s = ReasoningSplit::new(markers, inside);
        let (mut reasoning, mut answer) = (String::new(), String::new());
        for piece in pieces.iter().copied() {
            let out = s.push(piece);
            reasoning += &out.reasoning;
            answer += &out.answer;
        }
        let out = s.finish();
        (reasoning + &out.reasoning, answer + &out.answer)
    }

    fn owned(r: &str, a: &str) -> (String, String) {
        (r.into(), a.into())
    }

    #[test]
    fn markers_split_across_pieces_never_reach_the_text() {
        let pieces = ["\n<th", "ink>let me", " see</thi", "nk>\n\nIt is 4."];
        assert_eq!(split(THINK, false, &pieces), owned("let me see", "\n\nIt is 4."));
        let pieces = ["<|channel>", "thought", "\n", "two and two<", "channel|>", "4"];
        assert_eq!(split(GEMMA4_THOUGHT, false, &pieces), owned("two and two", "4"));
    }

    #[test]
    fn a_begun_answer_leaves_the_reasoning_open_until_its_end_marker() {
        assert!(THINK.left_open_by("<think>\nFirst,"));
        assert!(THINK.left_open_by("<think>a</think>then <think>b"));
        assert!(!THINK.left_open_by("<think>a</think>The answer"));
        assert!(!THINK.left_open_by("The answer is"));
        assert!(GEMMA4_THOUGHT.left_open_by("<|channel>thought\nHmm"));
        assert!(!GEMMA4_THOUGHT.left_open_by("<|channel>thought\nHmm<channel|>So"));
    }

    #[test]
    fn a_prompt_that_opened_the_reasoning_leaves_the_output_inside_it() {
        assert_eq!(split(THINK, true, &["hm", "m</think>", "yes"]), owned("hmm", "yes"));
        assert!(THINK.opened_by("<|im_start|>assistant\n<think>\n"));
        assert!(!THINK.opened_by("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
        assert!(GEMMA4_THOUGHT.opened_by("<|turn>model\n<|channel>thought\n"));
        assert!(!GEMMA4_THOUGHT.opened_by("<|turn>model\n<|channel>thought\n<channel|>"));
    }

    #[test]
    fn output_that_does_not_open_with_the_marker_is_all_answer() {
        assert_eq!(
            split(THINK, false, &["<th", "e end> <think>x"]),
            owned("", "<the end> <think>x")
        );
        assert_eq!(split(THINK, false, &["  ", "\n"]), owned("", "  \n"));
        assert_eq!(split(THINK, false, &["Hi</think>"]), owned("", "Hi</think>"));
    }

    #[test]
    fn unterminated_reasoning_stays_reasoning_and_a_false_end_is_released() {
        assert_eq!(split(THINK, false, &["<think>a</t", "able"]), owned("a</table", ""));
        assert_eq!(split(THINK, true, &["a</thin"]), owned("a</thin", ""));
    }
}
