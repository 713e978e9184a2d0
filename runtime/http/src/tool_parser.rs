//! `tool_choice: auto`: the model answers in text or calls tools in its own format, and the
//! calls are parsed out of its answer (vLLM's `--tool-call-parser`). Each family writes calls
//! between a begin and an end marker, the call itself differently:
//! - `hermes` (Qwen2.5/Qwen3, Hermes, SmolLM3): `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`;
//! - `qwen3-coder` (Qwen3-Coder, Qwen3.5, Qwen3-Next): `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n</parameter>\n</function>\n</tool_call>`;
//! - `glm45` (GLM-4.5 to GLM-5): `<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>`;
//! - `gemma4`: `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:3}<tool_call|>`.
//!
//! The XML-like formats write values as bare text: a parameter whose schema says `string`
//! keeps its text, any other value is read as JSON where it parses (a number, `true`, an
//! object) and kept as text where it does not. Text that may be the start of a begin marker
//! is held back until it is known, so a marker never reaches the client's content, not even
//! in part; a call that does not parse (or never ends) is returned as the text it was.

use super::text::partial_match_len;
use super::tools::{Tool, ToolCall};
use serde_json::{Map, Value};

/// Which call format `bbc serve` parses: the one the chat template writes (`auto`), none
/// (`tool_choice` auto refused), or a named one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ToolCallParser {
    Auto,
    None,
    Hermes,
    Qwen3Coder,
    Glm45,
    Gemma4,
}

/// A model family's way of writing tool calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallFormat {
    Hermes,
    Qwen3Coder,
    Glm45,
    Gemma4,
}

impl ToolCallParser {
    /// The format to parse for a model whose chat template is `template`.
    pub fn format(self, template: Option<&str>) -> Option<CallFormat> {
        match self {
            Self::Auto => template.and_then(CallFormat::written_by),
            Self::None => None,
            Self::Hermes => Some(CallFormat::Hermes),
            Self::Qwen3Coder => Some(CallFormat::Qwen3Coder),
            Self::Glm45 => Some(CallFormat::Glm45),
            Self::Gemma4 => Some(CallFormat::Gemma4),
        }
    }
}

/// Gemma 4's string quote.
const GEMMA_QUOTE: &str = "<|\"|>";

/// Every marker a call format is read by (their special tokens must reach the text).
pub const MARKER_TEXTS: [&str; 13] = [
    "<tool_call>",
    "</tool_call>",
    "<|tool_call>",
    "<tool_call|>",
    "<function=",
    "</function>",
    "<parameter=",
    "</parameter>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    GEMMA_QUOTE,
];

impl CallFormat {
    /// The format a chat template writes the assistant's earlier calls in (and so teaches
    /// the model), if it writes any bbc knows.
    pub fn written_by(template: &str) -> Option<Self> {
        if template.contains("<|tool_call>") {
            Some(Self::Gemma4)
        } else if template.contains("<arg_key>") {
            Some(Self::Glm45)
        } else if template.contains("<function=") && template.contains("<parameter=") {
            Some(Self::Qwen3Coder)
        } else if template.contains("<tool_call>") {
            Some(Self::Hermes)
        } else {
            None
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Hermes => "hermes",
            Self::Qwen3Coder => "qwen3-coder",
            Self::Glm45 => "glm45",
            Self::Gemma4 => "gemma4",
        }
    }

    fn begin(self) -> &'static str {
        match self {
            Self::Gemma4 => "<|tool_call>",
            Self::Hermes | Self::Qwen3Coder | Self::Glm45 => "<tool_call>",
        }
    }

    fn end(self) -> &'static str {
        match self {
            Self::Gemma4 => "<tool_call|>",
            Self::Hermes | Self::Qwen3Coder | Self::Glm45 => "</tool_call>",
        }
    }

    /// The calls written between a begin and an end marker; None where it is not a call.
    fn parse(self, body: &str, tools: &[Tool]) -> Option<Vec<ToolCall>> {
        match self {
            Self::Hermes => hermes_call(body).map(|c| vec![c]),
            Self::Qwen3Coder => qwen3_coder_calls(body, tools),
            Self::Glm45 => glm45_call(body, tools).map(|c| vec![c]),
            Self::Gemma4 => gemma4_call(body).map(|c| vec![c]),
        }
    }
}

/// `{"name": NAME, "arguments": {…}}` (`parameters` also taken for `arguments`).
fn hermes_call(body: &str) -> Option<ToolCall> {
    let Value::Object(call) = serde_json::from_str(body.trim()).ok()? else {
        return None;
    };
    let name = call.get("name")?.as_str()?.to_string();
    let arguments = match call.get("arguments").or_else(|| call.get("parameters")) {
        None | Some(Value::Null) => "{}".to_string(),
        Some(Value::String(text)) if serde_json::from_str::<Value>(text).is_ok() => text.clone(),
        Some(value @ Value::Object(_)) => value.to_string(),
        Some(_) => return None,
    };
    Some(ToolCall { name, arguments })
}

/// `<function=NAME>` and its `<parameter=KEY>\nVALUE\n</parameter>`s, for each function in
/// the body (a parameter's end may be left out before the next or the function's end).
fn qwen3_coder_calls(body: &str, tools: &[Tool]) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    for function in body.split("<function=").skip(1) {
        let function = function.split("</function>").next().unwrap_or(function);
        let (name, mut rest) = function.split_once('>')?;
        let name = name.trim();
        let mut arguments = Map::new();
        while let Some(at) = rest.find("<parameter=") {
            let (key, after) = rest[at + "<parameter=".len()..].split_once('>')?;
            let end = ["</parameter>", "<parameter="]
                .iter()
                .filter_map(|m| after.find(m))
                .min()
                .unwrap_or(after.len());
            let raw = after[..end].strip_prefix('\n').unwrap_or(&after[..end]);
            let raw = raw.strip_suffix('\n').unwrap_or(raw);
            arguments.insert(
                key.trim().to_string(),
                typed_argument(raw, property(tools, name, key.trim())),
            );
            rest = after[end..].strip_prefix("</parameter>").unwrap_or(&after[end..]);
        }
        calls.push(ToolCall {
            name: name.to_string(),
            arguments: Value::Object(arguments).to_string(),
        });
    }
    (!calls.is_empty()).then_some(calls)
}

/// `NAME` then `<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>` pairs (GLM-4.7 and later
/// write the first key right after the name, GLM-4.5 after a newline).
fn glm45_call(body: &str, tools: &[Tool]) -> Option<ToolCall> {
    let name_end = body
        .find('\n')
        .into_iter()
        .chain(body.find("<arg_key>"))
        .min()
        .unwrap_or(body.len());
    let name = body[..name_end].trim();
    if name.is_empty() {
        return None;
    }
    let mut arguments = Map::new();
    let mut rest = &body[name_end..];
    while let Some(at) = rest.find("<arg_key>") {
        let (key, after) = rest[at + "<arg_key>".len()..].split_once("</arg_key>")?;
        let after = after.trim_start().strip_prefix("<arg_value>")?;
        let (raw, after) = after.split_once("</arg_value>")?;
        let key = key.trim();
        arguments.insert(key.to_string(), typed_argument(raw.trim(), property(tools, name, key)));
        rest = after;
    }
    if !rest.trim().is_empty() {
        return None;
    }
    Some(ToolCall {
        name: name.to_string(),
        arguments: Value::Object(arguments).to_string(),
    })
}

/// `call:NAME{…}` in Gemma 4's value syntax.
fn gemma4_call(body: &str) -> Option<ToolCall> {
    let rest = body.trim().strip_prefix("call:")?;
    let open = rest.find('{')?;
    let name = rest[..open].trim();
    let mut reader = GemmaValues { text: &rest[open..] };
    let arguments @ Value::Object(_) = reader.value()? else {
        return None;
    };
    if !name.is_empty() && reader.text.trim().is_empty() {
        Some(ToolCall {
            name: name.to_string(),
            arguments: arguments.to_string(),
        })
    } else {
        None
    }
}

/// A reader of Gemma 4's values: strings between `<|"|>` quotes (or JSON strings), objects
/// with bare or quoted keys, arrays, and bare numbers, booleans and null.
struct GemmaValues<'a> {
    text: &'a str,
}

impl GemmaValues<'_> {
    fn value(&mut self) -> Option<Value> {
        self.text = self.text.trim_start();
        if let Some(rest) = self.text.strip_prefix(GEMMA_QUOTE) {
            let (string, after) = rest.split_once(GEMMA_QUOTE)?;
            self.text = after;
            return Some(Value::String(string.to_string()));
        }
        match self.text.as_bytes().first()? {
            b'{' => self.object(),
            b'[' => self.array(),
            b'"' => {
                let mut values = serde_json::Deserializer::from_str(self.text).into_iter::<Value>();
                let string = values.next()?.ok()?;
                self.text = &self.text[values.byte_offset()..];
                Some(string)
            }
            _ => {
                let end = self.text.find([',', '}', ']']).unwrap_or(self.text.len());
                let bare = self.text[..end].trim();
                self.text = &self.text[end..];
                Some(serde_json::from_str(bare).unwrap_or_else(|_| Value::String(bare.to_string())))
            }
        }
    }

    fn object(&mut self) -> Option<Value> {
        self.text = &self.text[1..];
        let mut object = Map::new();
        loop {
            if self.eat('}') {
                return Some(Value::Object(object));
            }
            let key = match self.text.trim_start().strip_prefix(GEMMA_QUOTE) {
                Some(rest) => {
                    let (key, after) = rest.split_once(GEMMA_QUOTE)?;
                    self.text = after;
                    if !self.eat(':') {
                        return None;
                    }
                    key.to_string()
                }
                None => {
                    let (key, after) = self.text.split_once(':')?;
                    self.text = after;
                    key.trim().to_string()
                }
            };
            if key.is_empty() || key.contains([',', '{', '}', '[', ']', '"']) {
                return None;
            }
            let value = self.value()?;
            object.insert(key, value);
            if !self.eat(',') && !self.text.trim_start().starts_with('}') {
                return None;
            }
        }
    }

    fn array(&mut self) -> Option<Value> {
        self.text = &self.text[1..];
        let mut items = Vec::new();
        loop {
            if self.eat(']') {
                return Some(Value::Array(items));
            }
            items.push(self.value()?);
            if !self.eat(',') && !self.text.trim_start().starts_with(']') {
                return None;
            }
        }
    }

    /// Skips whitespace and `c` if it comes next.
    fn eat(&mut self, c: char) -> bool {
        self.text = self.text.trim_start();
        match self.text.strip_prefix(c) {
            Some(rest) => {
                self.text = rest;
                true
            }
            None => false,
        }
    }
}

/// The JSON schema of `tool`'s parameter `key`, if the request gave one.
fn property<'a>(tools: &'a [Tool], tool: &str, key: &str) -> Option<&'a Value> {
    tools
        .iter()
        .find(|t| t.name == tool)
        .and_then(|t| t.parameters.get("properties"))
        .and_then(|p| p.get(key))
}

/// A value written as bare text: kept as text where its schema says `string`, else read as
/// JSON where it parses (with Python's `True`/`False`, which models trained on Python
/// tools write) and kept as text where it does not.
fn typed_argument(raw: &str, schema: Option<&Value>) -> Value {
    let types = schema.and_then(|s| s.get("type"));
    let is_string = match types {
        Some(Value::String(t)) => t == "string",
        Some(Value::Array(ts)) => ts.iter().any(|t| t == "string") && !ts.iter().any(|t| t == "null" && raw == "null"),
        _ => false,
    };
    if is_string {
        return Value::String(raw.to_string());
    }
    match raw {
        "True" => Value::Bool(true),
        "False" => Value::Bool(false),
        _ => serde_json::from_str(raw).unwrap_or_else(|_| Value::String(raw.to_string())),
    }
}

/// What a piece of answer released: text for `content`, then the calls completed in it.
#[derive(Debug, Default, PartialEq)]
pub struct Parsed {
    pub content: String,
    pub calls: Vec<ToolCall>,
}

/// One choice's answer, its calls parsed out as it streams.
pub struct CallSplit {
    format: CallFormat,
    tools: Vec<Tool>,
    /// Whether the answer is inside a call's markers.
    inside: bool,
    /// Text not yet released: a possible begin marker's start, a call not yet ended, or
    /// whitespace that may turn out to be only what separates calls from the text.
    held: String,
    /// The whitespace before the call being read: dropped if it is a call, text if not.
    gap: String,
    /// Calls released so far.
    calls: usize,
    /// With `parallel_tool_calls` false: calls past the first are dropped.
    one_call: bool,
}

impl CallSplit {
    pub fn new(format: CallFormat, tools: Vec<Tool>, one_call: bool) -> Self {
        Self {
            format,
            tools,
            inside: false,
            held: String::new(),
            gap: String::new(),
            calls: 0,
            one_call,
        }
    }

    pub fn push(&mut self, text: &str) -> Parsed {
        self.held.push_str(text);
        let mut out = Parsed::default();
        while self.settle(&mut out) {}
        out
    }

    /// Releases what the held text settles; false once it takes more text to go on.
    fn settle(&mut self, out: &mut Parsed) -> bool {
        let (begin, end) = (self.format.begin(), self.format.end());
        if self.inside {
            let Some(at) = self.held.find(end) else {
                return false;
            };
            let body: String = self.held.drain(..at + end.len()).collect();
            self.inside = false;
            self.end_call(&body[..at], end, out);
            return true;
        }
        let (settled, opens) = match self.held.find(begin) {
            Some(at) => (at, true),
            None => (self.held.len() - partial_match_len(&self.held, begin), false),
        };
        // Trailing whitespace waits: a call may follow it.
        let content_end = self.held[..settled].trim_end().len();
        out.content.extend(self.held.drain(..content_end));
        if opens {
            self.gap = self.held.drain(..settled - content_end).collect();
            self.held.drain(..begin.len());
            self.inside = true;
        }
        opens
    }

    /// A call's body read (`end`: its end marker, empty where the answer ended first).
    fn end_call(&mut self, body: &str, end: &str, out: &mut Parsed) {
        let gap = std::mem::take(&mut self.gap);
        match self.format.parse(body, &self.tools) {
            Some(calls) => {
                for call in calls {
                    if !(self.one_call && self.calls > 0) {
                        out.calls.push(call);
                        self.calls += 1;
                    }
                }
            }
            None => out.content += &format!("{gap}{}{body}{end}", self.format.begin()),
        }
    }

    /// What is held at the end of the answer: a call that never ended is parsed as far as it
    /// goes (one cut short by `max_tokens` stays text); whitespace after calls goes.
    pub fn finish(&mut self) -> Parsed {
        let held = std::mem::take(&mut self.held);
        let mut out = Parsed::default();
        if self.inside {
            self.inside = false;
            self.end_call(&held, "", &mut out);
        } else if self.calls == 0 || !held.trim().is_empty() {
            out.content = held;
        }
        out
    }

    /// Whether any call was released.
    pub fn called(&self) -> bool {
        self.calls > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn weather() -> Vec<Tool> {
        vec![Tool {
            name: "weather".into(),
            parameters: json!({"type": "object", "properties": {
                "city": {"type": "string"}, "days": {"type": "integer"},
                "metric": {"type": "boolean"}, "zip": {"type": "string"}, "at": {"type": "object"},
                "unit": {"type": ["string", "null"]},
            }}),
        }]
    }

    /// Content and calls of `pieces` pushed one by one, then finished.
    fn split(format: CallFormat, pieces: &[&str]) -> (String, Vec<(String, Value)>) {
        let mut s = CallSplit::new(format, weather(), false);
        let mut all = Parsed::default();
        let mut parsed: Vec<Parsed> = pieces.iter().map(|p| s.push(p)).collect();
        parsed.push(s.finish());
        for piece in parsed {
            all.content += &piece.content;
            all.calls.extend(piece.calls);
        }
        let calls = all
            .calls
            .into_iter()
            .map(|c| (c.name, serde_json::from_str(&c.arguments).unwrap()))
            .collect();
        (all.content, calls)
    }

    /// Every way of cutting `text` in two gives what it gives whole.
    fn same_however_cut(format: CallFormat, text: &str) -> (String, Vec<(String, Value)>) {
        let whole = split(format, &[text]);
        for (cut, _) in text.char_indices().skip(1) {
            assert_eq!(split(format, &[&text[..cut], &text[cut..]]), whole, "cut at {cut}");
        }
        let chars: Vec<String> = text.chars().map(String::from).collect();
        let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
        assert_eq!(split(format, &pieces), whole, "a character at a time");
        whole
    }

    fn call(name: &str, arguments: Value) -> (String, Value) {
        (name.to_string(), arguments)
    }

    #[test]
    fn hermes_calls_are_json_between_tags() {
        let text = "Let me look.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Oslo\", \"days\": 3}}\n</tool_call>\n<tool_call>\n{\"name\": \"weather\", \"arguments\": \"{\\\"city\\\": \\\"Rome\\\"}\"}\n</tool_call>\n";
        assert_eq!(
            same_however_cut(CallFormat::Hermes, text),
            (
                "Let me look.".into(),
                vec![
                    call("weather", json!({"city": "Oslo", "days": 3})),
                    call("weather", json!({"city": "Rome"}))
                ]
            )
        );
    }

    #[test]
    fn qwen3_coder_values_take_their_schemas_types() {
        let text = "<tool_call>\n<function=weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=metric>\nFalse\n</parameter>\n<parameter=unit>\nnull\n</parameter>\n<parameter=zip>\n01234\n</parameter>\n<parameter=at>\n{\"lat\": 1.5}\n</parameter>\n<parameter=note>\n2 lines\nof text\n</parameter>\n</function>\n</tool_call>";
        assert_eq!(
            same_however_cut(CallFormat::Qwen3Coder, text),
            (
                String::new(),
                vec![call(
                    "weather",
                    json!({"city": "New York", "days": 3, "metric": false, "unit": null, "zip": "01234",
                           "at": {"lat": 1.5}, "note": "2 lines\nof text"})
                )]
            )
        );
    }

    #[test]
    fn glm_calls_are_key_value_pairs() {
        let glm45 = "I will check.<tool_call>weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>";
        let glm47 = "<tool_call>weather<arg_key>city</arg_key><arg_value>Oslo</arg_value><arg_key>days</arg_key><arg_value>2</arg_value></tool_call>";
        let expected = vec![call("weather", json!({"city": "Oslo", "days": 2}))];
        assert_eq!(
            same_however_cut(CallFormat::Glm45, glm45),
            ("I will check.".into(), expected.clone())
        );
        assert_eq!(same_however_cut(CallFormat::Glm45, glm47), (String::new(), expected));
        let no_args = "<tool_call>time\n</tool_call>";
        assert_eq!(split(CallFormat::Glm45, &[no_args]).1, vec![call("time", json!({}))]);
    }

    #[test]
    fn gemma4_values_have_their_own_quotes() {
        let text = "<|tool_call>call:weather{city:<|\"|>Oslo, Norway<|\"|>,days:3,metric:true,at:{lat:1.5,tags:[<|\"|>a<|\"|>,\"b\"]},none:null,<|\"|>odd key<|\"|>:1}<tool_call|>";
        assert_eq!(
            same_however_cut(CallFormat::Gemma4, text),
            (
                String::new(),
                vec![call(
                    "weather",
                    json!({"city": "Oslo, Norway", "days": 3, "metric": true,
                           "at": {"lat": 1.5, "tags": ["a", "b"]}, "none": null, "odd key": 1})
                )]
            )
        );
        assert_eq!(
            split(CallFormat::Gemma4, &["<|tool_call>call:time{}<tool_call|>"]).1,
            vec![call("time", json!({}))]
        );
    }

    #[test]
    fn text_without_calls_is_all_content() {
        for text in ["It is sunny.", "  \n", "a <tool_cal", "x < y and <tool> tags", ""] {
            assert_eq!(same_however_cut(CallFormat::Hermes, text), (text.to_string(), vec![]));
        }
    }

    /// A call that does not parse is returned as it was written; one cut short (no end
    /// marker) too, unless what it holds already parses.
    #[test]
    fn what_is_not_a_call_stays_text() {
        let broken = "Try: <tool_call>{\"name\": oops}</tool_call> then";
        assert_eq!(
            same_however_cut(CallFormat::Hermes, broken),
            (broken.to_string(), vec![])
        );
        let cut = "<tool_call>\n{\"name\": \"weather\", \"argu";
        assert_eq!(split(CallFormat::Hermes, &[cut]), (cut.to_string(), vec![]));
        let unended = "<tool_call>\n{\"name\": \"weather\", \"arguments\": {}}\n";
        assert_eq!(
            split(CallFormat::Hermes, &[unended]).1,
            vec![call("weather", json!({}))]
        );
        for bad_glm in [
            "<tool_call>\n<arg_key>a</arg_key></tool_call>",
            "<tool_call>f<arg_key>a</arg_key></tool_call>",
        ] {
            assert_eq!(split(CallFormat::Glm45, &[bad_glm]).0, bad_glm);
        }
        let bad_gemma = "<|tool_call>call:f{a:<|\"|>open}<tool_call|>";
        assert_eq!(split(CallFormat::Gemma4, &[bad_gemma]).0, bad_gemma);
    }

    #[test]
    fn whitespace_around_calls_is_not_content_but_text_after_them_is() {
        let text = "\n\n<tool_call>{\"name\": \"weather\"}</tool_call>\n\n";
        assert_eq!(same_however_cut(CallFormat::Hermes, text).0, "");
        let text = "<tool_call>{\"name\": \"weather\"}</tool_call>\nDone.";
        assert_eq!(same_however_cut(CallFormat::Hermes, text).0, "\nDone.");
    }

    #[test]
    fn one_call_where_parallel_calls_are_off() {
        let mut s = CallSplit::new(CallFormat::Hermes, weather(), true);
        let out = s.push("<tool_call>{\"name\": \"a\"}</tool_call><tool_call>{\"name\": \"b\"}</tool_call>");
        assert_eq!(out.calls.len(), 1);
        assert_eq!(out.calls[0].name, "a");
        assert!(s.called());
    }

    /// Any answer built of calls, broken calls, markers' beginnings, text and whitespace gives
    /// the same content and calls however it is cut into pieces; one without a call that parses
    /// comes back whole as its content.
    #[test]
    fn any_answer_splits_the_same_however_it_streams() {
        use proptest::prelude::*;
        let fragment = prop_oneof![
            Just("<tool_call>{\"name\": \"weather\", \"arguments\": {\"city\": \"Oslo\"}}</tool_call>".to_string()),
            Just("<tool_call>{\"name\": broken}</tool_call>".to_string()),
            Just("<tool_call>{\"name\": \"time\"}".to_string()),
            Just("<tool_".to_string()),
            Just("</tool_call>".to_string()),
            Just(" \n".to_string()),
            "[a-z<>{}\" ]{0,6}",
        ];
        let case = (
            proptest::collection::vec(fragment, 0..6),
            proptest::collection::vec(0usize..64, 0..8),
        );
        let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig::with_cases(400));
        runner
            .run(&case, |(fragments, cuts)| {
                let text: String = fragments.concat();
                let whole = split(CallFormat::Hermes, &[&text]);
                let mut at: Vec<usize> = cuts
                    .iter()
                    .map(|c| c % (text.len() + 1))
                    .filter(|&c| text.is_char_boundary(c))
                    .collect();
                at.sort_unstable();
                at.dedup();
                let bounds: Vec<usize> = [0].into_iter().chain(at).chain([text.len()]).collect();
                let pieces: Vec<&str> = bounds.windows(2).map(|w| &text[w[0]..w[1]]).collect();
                prop_assert_eq!(split(CallFormat::Hermes, &pieces), whole.clone());
                if whole.1.is_empty() {
                    prop_assert_eq!(&whole.0, &text, "no call: the answer is all content, as written");
                }
                for (name, _) in &whole.1 {
                    prop_assert!(name == "weather" || name == "time", "{}", name);
                }
                Ok(())
            })
            .unwrap();
    }

    #[test]
    fn the_template_tells_the_format() {
        let qwen35 = "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{{- '<parameter=' + k + '>' }}";
        let glm = "<tool_call>{{ tc.name }}{% for k, v in args %}<arg_key>{{ k }}</arg_key>";
        let qwen3 = "<tool_call>\\n{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ args }}}\\n</tool_call>";
        let gemma4 = "<|tool_call>call:{{ name }}{{ args }}<tool_call|>";
        assert_eq!(CallFormat::written_by(qwen35), Some(CallFormat::Qwen3Coder));
        assert_eq!(CallFormat::written_by(glm), Some(CallFormat::Glm45));
        assert_eq!(CallFormat::written_by(qwen3), Some(CallFormat::Hermes));
        assert_eq!(CallFormat::written_by(gemma4), Some(CallFormat::Gemma4));
        assert_eq!(CallFormat::written_by("{{ messages }}"), None);
        assert_eq!(ToolCallParser::Auto.format(None), None);
        assert_eq!(ToolCallParser::Glm45.format(None), Some(CallFormat::Glm45));
        assert_eq!(ToolCallParser::None.format(Some(qwen3)), None);
    }
}
