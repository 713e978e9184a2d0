//! Anthropic's Messages API (`POST /v1/messages`, what Anthropic's SDKs and the tools built on
//! them speak) on the chat pipeline, as `responses_request` does for OpenAI's Responses: a
//! body is rewritten as the chat completion it asks for (`system` and `messages` with their
//! content blocks as chat messages, `tool_use` blocks as an assistant's `tool_calls` and
//! `tool_result` blocks as tool messages, `tools` with their `input_schema` as functions,
//! `tool_choice`, `stop_sequences`, `max_tokens`, `output_config.format` as
//! `response_format`; `temperature`, `top_p` and `top_k`, which current clients send only as
//! extra body keys) and parsed by `request`; errors name the Messages parameter. Server tools
//! (bash, text editor, web search), images and documents, MCP servers, an effort level and a
//! thinking budget it cannot keep are refused by name; settings that do not change the answer
//! (`cache_control`: prefixes are cached anyway; `service_tier`, `speed`, `metadata`) are
//! accepted.

use super::error::ApiError;
use super::messages::joined_text;
use super::request::{self, Endpoint, GenerationRequest};
use serde_json::{json, Map, Value};

/// Keys passed to chat as they are (vLLM's extras among them).
const SHARED: [&str; 7] = [
    "model",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "chat_template_kwargs",
    "structured_outputs",
];

/// The chat request a Messages body (`request::json_object`) asks for.
pub fn parse(obj: &Map<String, Value>) -> Result<GenerationRequest, ApiError> {
    request::parse_object(&chat_body(obj)?, Endpoint::Chat).map_err(|e| e.renamed(messages_api_name))
}

/// A chat parameter's name as the Messages body spells it.
fn messages_api_name(chat: &str) -> &str {
    match chat {
        "max_completion_tokens" | "max_tokens" => "max_tokens",
        "stop" => "stop_sequences",
        "parallel_tool_calls" => "tool_choice",
        other => other,
    }
}

fn chat_body(obj: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
    let given = |name: &str| obj.get(name).filter(|v| !v.is_null());
    for name in ["mcp_servers", "container"] {
        if given(name).is_some_and(|v| v.as_array().is_none_or(|a| !a.is_empty())) {
            return Err(ApiError::invalid(name, format!("`{name}` is not supported")));
        }
    }
    let max_tokens = given("max_tokens").ok_or_else(|| ApiError::invalid("max_tokens", "`max_tokens` is required"))?;
    let mut chat = Map::new();
    for name in SHARED {
        if let Some(v) = given(name) {
            chat.insert(name.into(), v.clone());
        }
    }
    chat.insert("max_completion_tokens".into(), max_tokens.clone());
    let mut messages = messages(obj)?;
    if answer_begun(&mut messages)? {
        chat.insert("continue_final_message".into(), json!(true));
    }
    chat.insert("messages".into(), Value::Array(messages));
    match given("stop_sequences") {
        None => {}
        Some(stops @ Value::Array(_)) => {
            chat.insert("stop".into(), stops.clone());
        }
        Some(_) => {
            return Err(ApiError::invalid(
                "stop_sequences",
                "`stop_sequences` must be an array of strings",
            ))
        }
    }
    if let Some(config) = given("output_config") {
        if config.get("effort").is_some_and(|e| !e.is_null()) {
            return Err(ApiError::invalid(
                "output_config.effort",
                "an effort level is not supported (a reasoning model's chat template decides)",
            ));
        }
        match config.get("format").filter(|f| !f.is_null()) {
            None => {}
            Some(format) if format.get("type").and_then(Value::as_str) == Some("json_schema") => {
                let schema = format.get("schema").cloned().unwrap_or(Value::Null);
                chat.insert(
                    "response_format".into(),
                    json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}),
                );
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    "output_config.format",
                    "`output_config.format` must be of type json_schema",
                ))
            }
        }
    }
    if let Some(thinking) = given("thinking") {
        let enable = thinks(thinking, max_tokens)?;
        let kwargs = chat.entry("chat_template_kwargs").or_insert_with(|| json!({}));
        match kwargs.as_object_mut() {
            Some(kwargs) => kwargs.insert("enable_thinking".into(), json!(enable)),
            None => {
                return Err(ApiError::invalid(
                    "chat_template_kwargs",
                    "`chat_template_kwargs` must be an object",
                ))
            }
        };
    }
    if let Some(tools) = given("tools") {
        chat.insert("tools".into(), function_tools(tools)?);
    }
    if let Some(choice) = given("tool_choice") {
        let (choice, parallel) = tool_choice(choice)?;
        chat.insert("tool_choice".into(), choice);
        if !parallel {
            chat.insert("parallel_tool_calls".into(), json!(false));
        }
    }
    Ok(chat)
}

/// `thinking`: `{"type": "enabled", "budget_tokens": N}`, `adaptive`, `between_tools` or
/// `disabled`, handed to the chat template as `enable_thinking` (Qwen3.5's and GLM's read it).
/// The model's reasoning cannot be cut at a budget short of the whole answer's, so a budget
/// below `max_tokens` is refused rather than ignored, and so is thinking asked to be omitted
/// from the answer.
fn thinks(thinking: &Value, max_tokens: &Value) -> Result<bool, ApiError> {
    if thinking.get("display").and_then(Value::as_str) == Some("omitted") {
        return Err(ApiError::invalid(
            "thinking.display",
            "omitted thinking is not supported",
        ));
    }
    match thinking.get("type").and_then(Value::as_str) {
        Some("disabled") => Ok(false),
        Some("adaptive" | "between_tools") => Ok(true),
        Some("enabled") => {
            let budget = thinking.get("budget_tokens").and_then(Value::as_u64);
            match (budget, max_tokens.as_u64()) {
                (Some(budget), Some(max)) if budget < max => Err(ApiError::invalid(
                    "thinking.budget_tokens",
                    format!("a thinking budget ({budget}) short of `max_tokens` ({max}) is not supported: the reasoning cannot be cut apart from the answer"),
                )),
                _ => Ok(true),
            }
        }
        _ => Err(ApiError::invalid(
            "thinking",
            "`thinking` must be of type enabled (with `budget_tokens`), adaptive, between_tools or disabled",
        )),
    }
}

/// `system` (a string or text blocks) as a system message, then each message's content
/// blocks: text joined; an assistant's `tool_use` blocks as its `tool_calls`; a user's
/// `tool_result` blocks as tool messages before its text; earlier thinking left out, as chat
/// templates drop earlier turns' reasoning.
fn messages(obj: &Map<String, Value>) -> Result<Vec<Value>, ApiError> {
    let mut out = Vec::new();
    match obj.get("system") {
        None | Some(Value::Null) => {}
        Some(system) => out.push(json!({"role": "system", "content": block_text(system, "system")?})),
    }
    let Some(Value::Array(messages)) = obj.get("messages") else {
        return Err(ApiError::invalid("messages", "`messages` must be an array of messages"));
    };
    for message in messages {
        let role = message.get("role").and_then(Value::as_str);
        let Some(role @ ("user" | "assistant")) = role else {
            return Err(ApiError::invalid(
                "messages",
                "each message needs a `role` of user or assistant",
            ));
        };
        let blocks = match message.get("content") {
            Some(Value::String(text)) => vec![json!({"type": "text", "text": text})],
            Some(Value::Array(blocks)) => blocks.clone(),
            _ => {
                return Err(ApiError::invalid(
                    "messages",
                    "each message needs `content`: a string or blocks",
                ))
            }
        };
        let (mut text, mut calls) = (String::new(), Vec::new());
        for block in &blocks {
            let field = |name: &str| block.get(name).and_then(Value::as_str);
            match field("type") {
                Some("text") => text += field("text").unwrap_or_default(),
                Some("tool_use") if role == "assistant" => {
                    let (Some(id), Some(name)) = (field("id"), field("name")) else {
                        return Err(ApiError::invalid("messages", "a `tool_use` block needs an `id` and a `name`"));
                    };
                    let input = block.get("input").cloned().unwrap_or_else(|| json!({}));
                    calls.push(json!({"id": id, "type": "function",
                                      "function": {"name": name, "arguments": input.to_string()}}));
                }
                Some("tool_result") if role == "user" => {
                    let id = field("tool_use_id")
                        .ok_or_else(|| ApiError::invalid("messages", "a `tool_result` block needs a `tool_use_id`"))?;
                    let result = match block.get("content") {
                        None | Some(Value::Null) => String::new(),
                        Some(content) => block_text(content, "messages")?,
                    };
                    out.push(json!({"role": "tool", "tool_call_id": id, "content": result}));
                }
                Some("thinking" | "redacted_thinking") => {}
                other => {
                    return Err(ApiError::invalid(
                        "messages",
                        format!("content blocks of type {} are not supported here (text only, tool_use from the assistant, tool_result from the user)", other.unwrap_or("(none)")),
                    ))
                }
            }
        }
        match (role, calls.is_empty()) {
            ("assistant", false) => out.push(json!({"role": "assistant", "content": text, "tool_calls": calls})),
            // A user turn of tool results alone adds no message of its own.
            ("user", _) if text.is_empty() && blocks.iter().any(|b| b["type"] == "tool_result") => {}
            _ => out.push(json!({"role": role, "content": text})),
        }
    }
    Ok(out)
}

/// Whether the conversation ends with an answer the caller began (Anthropic's prefill: a
/// final assistant message, which the model continues). An empty one asks for a plain answer
/// and is dropped; as Anthropic does, one ending in whitespace is refused (a prefix cut
/// between a word and its space tokenizes as no answer would), and so is one that called
/// tools, whose results must come first.
fn answer_begun(messages: &mut Vec<Value>) -> Result<bool, ApiError> {
    let Some(last) = messages.last().filter(|m| m["role"] == "assistant") else {
        return Ok(false);
    };
    if last.get("tool_calls").is_some() {
        return Err(ApiError::invalid(
            "messages",
            "a final assistant message with `tool_use` blocks needs a user message with their `tool_result` blocks after it",
        ));
    }
    let text = last["content"].as_str().unwrap_or_default();
    if text.is_empty() {
        messages.pop();
        return Ok(false);
    }
    if text.ends_with(char::is_whitespace) {
        return Err(ApiError::invalid(
            "messages",
            "final assistant content cannot end with trailing whitespace",
        ));
    }
    Ok(true)
}

/// A string, or text blocks joined.
fn block_text(value: &Value, param: &str) -> Result<String, ApiError> {
    match value {
        Value::String(text) => Ok(text.clone()),
        Value::Array(blocks) => joined_text(blocks, &["text"])
            .ok_or_else(|| ApiError::invalid(param, "only text blocks are supported here")),
        _ => Err(ApiError::invalid(
            param,
            format!("`{param}` must be a string or text blocks"),
        )),
    }
}

/// Client tools (`{name, description, input_schema}`) as chat functions; Anthropic's server
/// tools (typed `bash_…`, `web_search_…`) are not run here.
fn function_tools(tools: &Value) -> Result<Value, ApiError> {
    let Value::Array(tools) = tools else {
        return Err(ApiError::invalid("tools", "`tools` must be an array of tools"));
    };
    tools
        .iter()
        .map(|tool| {
            match tool.get("type").and_then(Value::as_str) {
                None | Some("custom") => {}
                Some(other) => {
                    return Err(ApiError::invalid(
                        "tools",
                        format!("server tools (`{other}`) are not supported: only client tools, which the client runs"),
                    ))
                }
            }
            let mut function = Map::new();
            for (from, to) in [
                ("name", "name"),
                ("description", "description"),
                ("input_schema", "parameters"),
            ] {
                if let Some(v) = tool.get(from) {
                    function.insert(to.into(), v.clone());
                }
            }
            Ok(json!({"type": "function", "function": function}))
        })
        .collect::<Result<Vec<_>, _>>()
        .map(Value::Array)
}

/// `{type: auto | any | tool | none}` as chat's `tool_choice`, and whether calls may come in
/// parallel (`disable_parallel_tool_use`).
fn tool_choice(choice: &Value) -> Result<(Value, bool), ApiError> {
    let parallel = choice.get("disable_parallel_tool_use").and_then(Value::as_bool) != Some(true);
    let chat = match choice.get("type").and_then(Value::as_str) {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => match choice.get("name") {
            Some(name) => json!({"type": "function", "function": {"name": name}}),
            None => return Err(ApiError::invalid("tool_choice", "a `tool` choice needs a `name`")),
        },
        _ => {
            return Err(ApiError::invalid(
                "tool_choice",
                "`tool_choice` must be of type auto, any, tool or none",
            ))
        }
    };
    Ok((chat, parallel))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::request::ChatEnding;
    use crate::tools::ToolCalling;
    use models::ChatMessage;

    fn parse_json(body: Value) -> Result<GenerationRequest, ApiError> {
        parse(body.as_object().expect("a body object"))
    }

    fn chat(body: Value) -> Vec<ChatMessage> {
        parse_json(body).unwrap().chat_messages()
    }

    #[test]
    fn content_blocks_become_chat_messages() {
        let messages = chat(
            json!({"max_tokens": 8, "system": [{"type": "text", "text": "Be brief."}], "messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "use the tool", "signature": ""},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]}]},
                {"role": "user", "content": [{"type": "text", "text": "Thanks"}]},
            ]}),
        );
        let roles: Vec<&str> = messages.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "tool", "user"]);
        assert_eq!(messages[0].content, "Be brief.");
        assert_eq!(messages[2].content, "Checking.");
        let calls = messages[2].tool_calls.as_ref().unwrap();
        assert_eq!(calls[0]["function"]["arguments"], json!({"city": "Oslo"}));
        assert_eq!(
            (messages[3].tool_call_id.as_deref(), messages[3].content.as_str()),
            (Some("toolu_1"), "sunny")
        );
    }

    #[test]
    fn settings_map_to_their_chat_forms() {
        let request = parse_json(json!({
            "max_tokens": 9, "messages": [{"role": "user", "content": "x"}], "stop_sequences": ["END"],
            "temperature": 0.2, "top_k": 5, "stream": true,
            "tools": [{"name": "weather", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
            "thinking": {"type": "enabled", "budget_tokens": 9}, "metadata": {"user_id": "u"},
        }))
        .unwrap();
        assert_eq!(
            (request.max_tokens, request.stop.clone()),
            (Some(9), vec!["END".to_string()])
        );
        assert_eq!((request.sampling.temperature, request.sampling.top_k), (0.2, 5));
        assert!(request.stream);
        assert_eq!(request.chat_template_kwargs.get("enable_thinking"), Some(&json!(true)));
        let calling = request.tools.and_then(|t| t.calling);
        assert!(
            matches!(calling, Some(ToolCalling::Required { one_call: true, .. })),
            "{calling:?}"
        );
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let formatted = parse_json(json!({"max_tokens": 9, "messages": [{"role": "user", "content": "x"}],
            "output_config": {"format": {"type": "json_schema", "schema": schema}, "effort": null},
            "thinking": {"type": "adaptive"}, "cache_control": {"type": "ephemeral"}, "speed": "standard"}))
        .unwrap();
        assert!(formatted.structured.is_some());
        assert_eq!(
            formatted.chat_template_kwargs.get("enable_thinking"),
            Some(&json!(true))
        );
        let named = parse_json(json!({"max_tokens": 9, "messages": [{"role": "user", "content": "x"}],
            "tools": [{"name": "weather", "input_schema": {"type": "object"}}], "tool_choice": {"type": "tool", "name": "weather"}}));
        assert!(matches!(
            named.unwrap().tools.and_then(|t| t.calling),
            Some(ToolCalling::Named(_))
        ));
    }

    /// A final assistant message is an answer to continue (Anthropic's prefill); an empty one
    /// is a plain turn; trailing whitespace and unanswered tool calls are refused.
    #[test]
    fn a_final_assistant_message_is_continued() {
        let body =
            |last: Value| json!({"max_tokens": 8, "messages": [{"role": "user", "content": "Name a colour."}, last]});
        let begun = parse_json(body(
            json!({"role": "assistant", "content": [{"type": "text", "text": "The colour is"}]}),
        ))
        .unwrap();
        assert_eq!(begun.chat_ending, ChatEnding::ContinueFinalMessage);
        assert_eq!(begun.chat_messages().last().unwrap().content, "The colour is");
        let empty = parse_json(body(json!({"role": "assistant", "content": ""}))).unwrap();
        assert_eq!(empty.chat_ending, ChatEnding::NewTurn);
        assert_eq!(empty.chat_messages().len(), 1);
        let plain = parse_json(json!({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}]})).unwrap();
        assert_eq!(plain.chat_ending, ChatEnding::NewTurn);
        for last in [
            json!({"role": "assistant", "content": "The colour is "}),
            json!({"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}),
        ] {
            assert_eq!(parse_json(body(last)).unwrap_err().param.as_deref(), Some("messages"));
        }
    }

    /// Errors name the Messages parameter; what this server cannot do is refused by name.
    #[test]
    fn errors_name_the_messages_parameter() {
        let user = json!([{"role": "user", "content": "x"}]);
        for (body, param) in [
            (json!({"messages": user}), "max_tokens"),
            (json!({"max_tokens": -2, "messages": user}), "max_tokens"),
            (json!({"max_tokens": 8}), "messages"),
            (
                json!({"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}),
                "messages",
            ),
            (
                json!({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}),
                "messages",
            ),
            (
                json!({"max_tokens": 8, "messages": user, "stop_sequences": "x"}),
                "stop_sequences",
            ),
            (json!({"max_tokens": 8, "messages": user, "system": 3}), "system"),
            (
                json!({"max_tokens": 8, "messages": user, "tools": [{"type": "bash_20250124", "name": "bash"}]}),
                "tools",
            ),
            (
                json!({"max_tokens": 8, "messages": user, "tool_choice": {"type": "sometimes"}}),
                "tool_choice",
            ),
            (
                json!({"max_tokens": 8, "messages": user, "thinking": {"type": "enabled", "budget_tokens": 4}}),
                "thinking.budget_tokens",
            ),
            (
                json!({"max_tokens": 8, "messages": user, "thinking": {"type": "maybe"}}),
                "thinking",
            ),
            (
                json!({"max_tokens": 8, "messages": user, "mcp_servers": [{"url": "x"}]}),
                "mcp_servers",
            ),
            (
                json!({"max_tokens": 8, "messages": user, "output_config": {"effort": "high"}}),
                "output_config.effort",
            ),
            (
                json!({"max_tokens": 8, "messages": user, "output_config": {"format": {"type": "xml"}}}),
                "output_config.format",
            ),
            (
                json!({"max_tokens": 8, "messages": user, "thinking": {"type": "adaptive", "display": "omitted"}}),
                "thinking.display",
            ),
            (
                json!({"max_tokens": 8, "messages": user, "stop_sequences": [""]}),
                "stop_sequences",
            ),
        ] {
            let error = parse_json(body.clone()).unwrap_err();
            assert_eq!(error.param.as_deref(), Some(param), "{body}: {}", error.message);
            for chat_name in ["`max_completion_tokens`", "`stop`"] {
                assert!(!error.message.contains(chat_name), "{body}: {}", error.message);
            }
        }
    }
}
