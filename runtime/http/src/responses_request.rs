//! OpenAI's Responses API (`POST /v1/responses`) on the chat pipeline: a request body is
//! rewritten as the chat completion it asks for (`input` and `instructions` as `messages`,
//! function tools and `tool_choice` in chat's shape, `text.format` as `response_format`,
//! `max_output_tokens` as `max_completion_tokens`) and parsed by `request`, so every check
//! and every feature of chat applies; an error is reported under the Responses name of the
//! parameter. What needs state this server does not keep (`previous_response_id`,
//! `conversation`, background runs) or tools it cannot run (web search, files, computer use)
//! is refused by name.

use super::error::ApiError;
use super::messages::joined_text;
use super::request::{self, Endpoint, GenerationRequest};
use serde_json::{json, Map, Value};

/// Parameters that would change the answer and that this server does not implement.
const REFUSED: [(&str, &str); 5] = [
    (
        "previous_response_id",
        "continuing a stored response (this server stores none)",
    ),
    ("conversation", "conversations (this server stores none)"),
    ("prompt", "stored prompt templates"),
    ("max_tool_calls", "`max_tool_calls`"),
    (
        "reasoning",
        "`reasoning` settings (a reasoning model's chat template decides; see `chat_template_kwargs`)",
    ),
];

/// Keys passed to chat as they are (the sampling settings chat shares, and vLLM's extras).
const SHARED: [&str; 15] = [
    "model",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "parallel_tool_calls",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "chat_template_kwargs",
    "structured_outputs",
    "priority",
];

/// The chat request a Responses body (`request::json_object`) asks for.
pub fn parse(obj: &Map<String, Value>) -> Result<GenerationRequest, ApiError> {
    request::parse_object(&chat_body(obj)?, Endpoint::Chat).map_err(|e| e.renamed(responses_name))
}

/// The chat body that asks for what `obj` asks for.
fn chat_body(obj: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    let given = |name: &str| obj.get(name).filter(|v| !v.is_null());
    for (name, what) in REFUSED {
        let asks = match given(name) {
            None => false,
            Some(Value::Object(o)) if name == "reasoning" => !o.values().all(Value::is_null),
            Some(_) => true,
        };
        if asks {
            return Err(ApiError::invalid(name, format!("{what} is not supported")));
        }
    }
    if given("background").and_then(Value::as_bool) == Some(true) {
        return Err(ApiError::invalid(
            "background",
            "background responses are not supported",
        ));
    }
    let output_logprobs = include(given("include"))?;
    if given("truncation").is_some_and(|t| t != "disabled") {
        return Err(ApiError::invalid(
            "truncation",
            "only `truncation: disabled` is supported",
        ));
    }
    let mut chat = Map::new();
    for name in SHARED {
        if let Some(v) = given(name) {
            chat.insert(name.into(), v.clone());
        }
    }
    // The answer's tokens' log-probabilities, as chat reports them (`top_logprobs`
    // alternatives each): where `include` asks for them, or alternatives are asked for.
    let alternatives = given("top_logprobs");
    if output_logprobs || alternatives.is_some_and(|n| n.as_u64() != Some(0)) {
        chat.insert("logprobs".into(), json!(true));
        if let Some(n) = alternatives {
            chat.insert("top_logprobs".into(), n.clone());
        }
    }
    chat.insert("messages".into(), Value::Array(messages(obj)?));
    if let Some(max) = given("max_output_tokens") {
        chat.insert("max_completion_tokens".into(), max.clone());
    }
    if let Some(tools) = given("tools") {
        chat.insert("tools".into(), function_tools(tools)?);
    }
    if let Some(choice) = given("tool_choice") {
        chat.insert("tool_choice".into(), tool_choice(choice)?);
    }
    if let Some(format) = given("text").map(|t| t.get("format")) {
        if let Some(format) = response_format(format)? {
            chat.insert("response_format".into(), format);
        }
    }
    Ok(chat)
}

/// `include`: extra data in the response; whether it asks for the answer's log-probabilities
/// (`message.output_text.logprobs`). Encrypted reasoning (stateless clients ask for it to pass
/// back) is accepted and has nothing to add, since reasoning comes back in clear; every other
/// kind (hosted tools' results) is refused.
fn include(value: Option<&Value>) -> Result<bool, ApiError> {
    const LOGPROBS: &str = "message.output_text.logprobs";
    let Some(value) = value else { return Ok(false) };
    let Value::Array(kinds) = value else {
        return Err(ApiError::invalid("include", "`include` must be an array of strings"));
    };
    let known = [Some("reasoning.encrypted_content"), Some(LOGPROBS)];
    match kinds.iter().find(|k| !known.contains(&k.as_str())) {
        None => Ok(kinds.iter().any(|k| k == LOGPROBS)),
        Some(kind) => Err(ApiError::invalid(
            "include",
            format!("`include` {kind} is not supported (only reasoning.encrypted_content and {LOGPROBS})"),
        )),
    }
}

/// A chat parameter's name as the Responses body spells it.
fn responses_name(chat: &str) -> &str {
    match chat {
        "messages" => "input",
        "max_completion_tokens" | "max_tokens" => "max_output_tokens",
        "response_format" => "text.format",
        other => other,
    }
}

/// `instructions` as a system message, then `input`: a string (one user message) or a list of
/// items: messages (`content` a string or `input_text`/`output_text` parts), earlier
/// `function_call`s (consecutive ones in one assistant message) and their
/// `function_call_output`s (tool messages); reasoning items are left out, as chat templates
/// drop earlier turns' reasoning.
fn messages(obj: &Map<String, Value>) -> Result<Vec<Value>, ApiError> {
    let mut messages = Vec::new();
    match obj.get("instructions") {
        None | Some(Value::Null) => {}
        Some(Value::String(text)) => messages.push(json!({"role": "system", "content": text})),
        Some(_) => return Err(ApiError::invalid("instructions", "`instructions` must be a string")),
    }
    match obj.get("input") {
        Some(Value::String(text)) => messages.push(json!({"role": "user", "content": text})),
        Some(Value::Array(items)) => {
            for item in items {
                push_item(&mut messages, item)?;
            }
        }
        _ => {
            return Err(ApiError::invalid(
                "input",
                "`input` must be a string or an array of items",
            ))
        }
    }
    Ok(messages)
}

fn push_item(messages: &mut Vec<Value>, item: &Value) -> Result<(), ApiError> {
    let bad = |what: &str| ApiError::invalid("input", format!("each input item needs {what}"));
    let text = |name: &str| item.get(name).and_then(Value::as_str);
    match text("type").unwrap_or("message") {
        "message" => {
            let role = text("role").ok_or_else(|| bad("a `role`"))?;
            let role = if role == "developer" { "system" } else { role };
            messages.push(json!({"role": role, "content": message_text(item.get("content"))?}));
        }
        "function_call" => {
            let (Some(call_id), Some(name)) = (text("call_id"), text("name")) else {
                return Err(bad("a `call_id` and a `name` where it is a `function_call`"));
            };
            let call = json!({"id": call_id, "type": "function",
                              "function": {"name": name, "arguments": text("arguments").unwrap_or("{}")}});
            match messages.last_mut() {
                // Calls made in one turn are one assistant message.
                Some(last) if last["role"] == "assistant" && last["tool_calls"].is_array() => {
                    last["tool_calls"].as_array_mut().expect("an array").push(call)
                }
                _ => messages.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
            }
        }
        "function_call_output" => {
            let call_id = text("call_id").ok_or_else(|| bad("a `call_id` where it is a `function_call_output`"))?;
            let output = match item.get("output") {
                Some(Value::String(s)) => s.clone(),
                Some(other @ Value::Array(_)) => message_text(Some(other))?,
                _ => return Err(bad("an `output` where it is a `function_call_output`")),
            };
            messages.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
        }
        "reasoning" => {}
        other => {
            return Err(ApiError::invalid(
                "input",
                format!("input items of type `{other}` are not supported"),
            ))
        }
    }
    Ok(())
}

/// A message's text: a string, or its text parts joined.
fn message_text(content: Option<&Value>) -> Result<String, ApiError> {
    match content {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => joined_text(parts, &["input_text", "output_text", "text"]).ok_or_else(|| {
            ApiError::invalid(
                "input",
                "content parts must be text (`input_text`, `output_text`); no other input is supported",
            )
        }),
        _ => Err(ApiError::invalid(
            "input",
            "a message's `content` must be a string or a list of text parts",
        )),
    }
}

/// Responses' flat function tools (`{type, name, description, parameters}`) in chat's shape.
fn function_tools(tools: &Value) -> Result<Value, ApiError> {
    let Value::Array(tools) = tools else {
        return Err(ApiError::invalid("tools", "`tools` must be an array of tools"));
    };
    tools
        .iter()
        .map(|tool| match tool.get("type").and_then(Value::as_str) {
            Some("function") => {
                let mut function = Map::new();
                for key in ["name", "description", "parameters"] {
                    if let Some(v) = tool.get(key) {
                        function.insert(key.into(), v.clone());
                    }
                }
                Ok(json!({"type": "function", "function": function}))
            }
            Some(other) => Err(ApiError::invalid(
                "tools",
                format!("tools of type `{other}` are not supported: only functions, which the client runs"),
            )),
            None => Err(ApiError::invalid("tools", "each tool needs a `type`")),
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}

/// `auto`, `none`, `required`, or `{"type": "function", "name": …}` in chat's shape.
fn tool_choice(choice: &Value) -> Result<Value, ApiError> {
    match choice {
        Value::String(_) => Ok(choice.clone()),
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => match o.get("name") {
            Some(name) => Ok(json!({"type": "function", "function": {"name": name}})),
            None => Err(ApiError::invalid(
                "tool_choice",
                "a function `tool_choice` needs a `name`",
            )),
        },
        _ => Err(ApiError::invalid(
            "tool_choice",
            "`tool_choice` must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
        )),
    }
}

/// `text.format`: plain text (none), a JSON schema, or any JSON object.
fn response_format(format: Option<&Value>) -> Result<Option<Value>, ApiError> {
    let Some(format) = format.filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let mut schema = Map::new();
            for key in ["name", "schema", "strict"] {
                if let Some(v) = format.get(key) {
                    schema.insert(key.into(), v.clone());
                }
            }
            Ok(Some(json!({"type": "json_schema", "json_schema": schema})))
        }
        _ => Err(ApiError::invalid(
            "text.format",
            "`text.format` must be of type text, json_object or json_schema",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use models::ChatMessage;

    fn parse_json(body: Value) -> Result<GenerationRequest, ApiError> {
        parse(body.as_object().expect("a body object"))
    }

    fn chat(body: Value) -> Vec<ChatMessage> {
        parse_json(body).unwrap().chat_messages()
    }

    #[test]
    fn input_and_instructions_become_messages() {
        let messages = chat(json!({"input": "Hi", "instructions": "Be brief."}));
        assert_eq!(
            messages,
            [ChatMessage::new("system", "Be brief."), ChatMessage::new("user", "Hi")]
        );
        let items = json!({"input": [
            {"role": "developer", "content": "Rules."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "in Oslo?"}]},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{\"city\": \"Oslo\"}"},
            {"type": "function_call", "call_id": "c2", "name": "time", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ]});
        let messages = chat(items);
        assert_eq!(messages.len(), 4);
        assert_eq!(
            (messages[0].role.as_str(), messages[0].content.as_str()),
            ("system", "Rules.")
        );
        assert_eq!(messages[1].content, "Weather in Oslo?");
        let calls = messages[2].tool_calls.as_ref().unwrap();
        assert_eq!((messages[2].role.as_str(), calls.len()), ("assistant", 2));
        assert_eq!(calls[0]["function"]["arguments"], json!({"city": "Oslo"}));
        assert_eq!(
            (messages[3].role.as_str(), messages[3].tool_call_id.as_deref()),
            ("tool", Some("c1"))
        );
    }

    #[test]
    fn settings_map_to_their_chat_forms() {
        let request = parse_json(json!({
            "input": "x", "max_output_tokens": 7, "temperature": 0.5, "stream": true,
            "tools": [{"type": "function", "name": "weather", "parameters": {"type": "object"}}],
            "tool_choice": {"type": "function", "name": "weather"},
            "store": false, "metadata": {"k": "v"},
        }))
        .unwrap();
        assert_eq!(request.max_tokens, Some(7));
        assert!(request.stream);
        assert_eq!(request.sampling.temperature, 0.5);
        let calling = request.tools.and_then(|t| t.calling);
        assert!(matches!(calling, Some(crate::tools::ToolCalling::Named(ref t)) if t.name == "weather"));
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let format = parse_json(
            json!({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": schema}}}),
        );
        assert_eq!(
            format.unwrap().structured.map(|s| s.param).as_deref(),
            Some("response_format")
        );
        let plain = parse_json(json!({"input": "x", "text": {"format": {"type": "text"}}}));
        assert_eq!(plain.unwrap().structured, None);
    }

    /// Errors name the Responses parameter; what needs stored state, hosted tools or other
    /// input than text is refused by name.
    #[test]
    fn errors_name_the_responses_parameter() {
        for (body, param) in [
            (json!({}), "input"),
            (json!({"input": 3}), "input"),
            (json!({"input": [{"type": "input_image", "image_url": "x"}]}), "input"),
            (
                json!({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}),
                "input",
            ),
            (json!({"input": "x", "max_output_tokens": -1}), "max_output_tokens"),
            (json!({"input": []}), "input"),
            (
                json!({"input": "x", "text": {"format": {"type": "json_schema"}}}),
                "text.format",
            ),
            (
                json!({"input": "x", "previous_response_id": "resp_1"}),
                "previous_response_id",
            ),
            (json!({"input": "x", "reasoning": {"effort": "high"}}), "reasoning"),
            (json!({"input": "x", "top_logprobs": 21}), "top_logprobs"),
            (json!({"input": "x", "background": true}), "background"),
            (json!({"input": "x", "truncation": "auto"}), "truncation"),
            (
                json!({"input": "x", "include": ["file_search_call.results"]}),
                "include",
            ),
            (json!({"input": "x", "include": "all"}), "include"),
            (json!({"input": "x", "tools": [{"type": "web_search"}]}), "tools"),
            (
                json!({"input": "x", "tool_choice": {"type": "file_search"}}),
                "tool_choice",
            ),
            (
                json!({"input": "x", "text": {"format": {"type": "xml"}}}),
                "text.format",
            ),
            (json!({"input": "x", "instructions": 1}), "instructions"),
        ] {
            let error = parse_json(body.clone()).unwrap_err();
            assert_eq!(error.param.as_deref(), Some(param), "{body}: {}", error.message);
            for chat_name in ["`messages`", "`max_completion_tokens`", "`response_format`"] {
                assert!(!error.message.contains(chat_name), "{body}: {}", error.message);
            }
        }
        for (body, want) in [
            (json!({"input": "x"}), None),
            (json!({"input": "x", "top_logprobs": 0}), None),
            (
                json!({"input": "x", "include": ["message.output_text.logprobs"]}),
                Some(0),
            ),
            (json!({"input": "x", "top_logprobs": 3}), Some(3)),
        ] {
            assert_eq!(parse_json(body.clone()).unwrap().sampling.logprobs, want, "{body}");
        }
        for fine in [
            json!({"input": "x", "reasoning": null}),
            json!({"input": "x", "reasoning": {"effort": null}}),
            json!({"input": "x", "top_logprobs": 0, "truncation": "disabled", "background": false}),
            json!({"input": "x", "include": ["reasoning.encrypted_content"], "store": false}),
        ] {
            assert!(parse_json(fine.clone()).is_ok(), "{fine}");
        }
    }
}
