//! A chat request's `messages`, as the chat template will read them: each message's role and
//! text, and in a conversation that uses tools an assistant's `tool_calls` and a tool result's
//! `tool_call_id` and `name`.

use super::error::ApiError;
use models::ChatMessage;
use serde_json::{json, Map, Value};

pub fn parse(body: &Map<String, Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let Some(Value::Array(items)) = body.get("messages") else {
        return Err(ApiError::invalid("messages", "`messages` must be an array of messages"));
    };
    if items.is_empty() {
        return Err(ApiError::invalid("messages", "`messages` must not be empty"));
    }
    items.iter().map(message).collect()
}

fn bad(what: &str) -> ApiError {
    ApiError::invalid("messages", format!("each message needs {what}"))
}

fn message(item: &Value) -> Result<ChatMessage, ApiError> {
    let Value::Object(m) = item else {
        return Err(bad("to be an object with `role` and `content`"));
    };
    let role = m
        .get("role")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("a string `role`"))?;
    let mut message = ChatMessage::new(role, &content(m.get("content"))?);
    let text = |name: &str| match m.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(bad(&format!("`{name}` as a string, where it has one"))),
    };
    message.tool_call_id = text("tool_call_id")?;
    message.name = text("name")?;
    message.tool_calls = match m.get("tool_calls") {
        None | Some(Value::Null) => None,
        Some(Value::Array(calls)) => Some(calls.iter().map(tool_call).collect::<Result<_, _>>()?),
        Some(_) => return Err(bad("`tool_calls` as an array")),
    };
    Ok(message)
}

fn content(value: Option<&Value>) -> Result<String, ApiError> {
    match value {
        Some(Value::String(s)) => Ok(s.clone()),
        // The array form: text parts only (this server has no image or audio input).
        Some(Value::Array(parts)) => joined_text(parts, &["text"])
            .ok_or_else(|| bad("`content` parts of type `text` (no other input is supported)")),
        // An assistant's turn that only called tools has none.
        None | Some(Value::Null) => Ok(String::new()),
        Some(_) => Err(bad("`content` as a string or an array of text parts")),
    }
}

/// The texts of `parts` (`{"type", "text"}` objects, of one of the `kinds`) joined; None
/// where a part is of another kind or has no text. The three APIs' content arrays all come
/// down to this, each naming its own kinds of text part.
pub fn joined_text(parts: &[Value], kinds: &[&str]) -> Option<String> {
    parts
        .iter()
        .map(|p| match p.get("type").and_then(Value::as_str) {
            Some(kind) if kinds.contains(&kind) => p.get("text").and_then(Value::as_str),
            _ => None,
        })
        .collect::<Option<Vec<_>>>()
        .map(|texts| texts.concat())
}

/// An earlier tool call, its `function.arguments` (OpenAI's JSON text) as the object that
/// transformers' chat templates iterate over.
fn tool_call(call: &Value) -> Result<Value, ApiError> {
    let function = call.get("function").and_then(Value::as_object);
    let name = function.and_then(|f| f.get("name")).and_then(Value::as_str);
    let (Some(function), Some(name)) = (function, name) else {
        return Err(bad("each of its `tool_calls` to have a `function` with a `name`"));
    };
    let arguments = match function.get("arguments") {
        None | Some(Value::Null) => json!({}),
        Some(Value::String(text)) if text.trim().is_empty() => json!({}),
        Some(Value::String(text)) => {
            serde_json::from_str(text).map_err(|_| bad("its tool calls' `function.arguments` as JSON text"))?
        }
        Some(object @ Value::Object(_)) => object.clone(),
        Some(_) => return Err(bad("its tool calls' `function.arguments` as JSON text")),
    };
    let mut call = call.clone();
    call["type"] = json!("function");
    call["function"] = json!({"name": name, "arguments": arguments});
    Ok(call)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages(value: Value) -> Result<Vec<ChatMessage>, ApiError> {
        let Value::Object(body) = json!({ "messages": value }) else {
            unreachable!()
        };
        parse(&body)
    }

    #[test]
    fn a_tool_conversation_reaches_the_template_in_transformers_form() {
        let parsed = messages(json!([
            {"role": "user", "content": [{"type": "text", "text": "weather "}, {"type": "text", "text": "in Oslo?"}]},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                "function": {"name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "name": "weather", "content": "-3 C"},
        ]))
        .unwrap();
        assert_eq!(parsed[0], ChatMessage::new("user", "weather in Oslo?"));
        assert_eq!(parsed[1].content, "");
        assert_eq!(
            parsed[1].tool_calls.as_deref(),
            Some(
                &[
                    json!({"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}})
                ][..]
            )
        );
        assert_eq!(
            (parsed[2].tool_call_id.as_deref(), parsed[2].name.as_deref()),
            (Some("c1"), Some("weather"))
        );
        // Fields a message lacks are absent from what the template sees.
        assert_eq!(
            serde_json::to_value(&parsed[0]).unwrap(),
            json!({"role": "user", "content": "weather in Oslo?"})
        );
    }

    #[test]
    fn malformed_messages_are_400s_naming_messages() {
        for bad in [
            json!([]),
            json!("hi"),
            json!([{"content": "x"}]),
            json!([{"role": "user", "content": 5}]),
            json!([{"role": "user", "content": [{"type": "image_url"}]}]),
            json!([{"role": "assistant", "tool_calls": {}}]),
            json!([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]),
            json!([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]),
            json!([{"role": "tool", "tool_call_id": 7, "content": "x"}]),
        ] {
            assert_eq!(
                messages(bad.clone()).unwrap_err().param.as_deref(),
                Some("messages"),
                "{bad}"
            );
        }
    }
}
