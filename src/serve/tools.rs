//! Tool calling as vLLM does it for any model: a chat request's `tools` reach the chat
//! template, and a `tool_choice` that names a function or is `required` makes the answer a
//! call, its shape held by a structured output (the named function's parameters; for
//! `required`, a JSON array of `{"name", "parameters"}` objects, one of the tools each), then
//! returned as OpenAI's `tool_calls`. `auto` would need a parser for each model family's own
//! call format, which is not built: it is refused by name.

use super::error::ApiError;
use super::output_spec::{OutputSpec, Structured};
use serde_json::{json, Map, Value};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// A function the model may call.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    /// JSON schema of its arguments.
    pub parameters: Value,
}

/// What `tool_choice` asks of the answer.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolCalling {
    /// A call of this function: the answer is its arguments.
    Named(Tool),
    /// One or more calls of these functions.
    Required(Vec<Tool>),
}

/// A request's tools: as given, for the chat template, and what the answer must be.
#[derive(Debug, Clone, PartialEq)]
pub struct Tools {
    pub definitions: Vec<Value>,
    /// None where `tool_choice` is `none`.
    pub calling: Option<ToolCalling>,
}

/// A call the model made.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as JSON text.
    pub arguments: String,
}

/// The body's `tools` and `tool_choice`, if it gives tools.
pub fn parse(body: &Map<String, Value>) -> Result<Option<Tools>, ApiError> {
    let given = |name: &str| body.get(name).filter(|v| !v.is_null());
    let definitions = match given("tools") {
        None => Vec::new(),
        Some(Value::Array(items)) => items.clone(),
        Some(_) => return Err(ApiError::invalid("tools", "`tools` must be an array of tools")),
    };
    let tools: Vec<Tool> = definitions.iter().map(tool).collect::<Result<_, _>>()?;
    let choice = given("tool_choice");
    if tools.is_empty() {
        return match choice.map(Value::as_str) {
            None | Some(Some("none" | "auto")) => Ok(None),
            _ => Err(ApiError::invalid("tool_choice", "`tool_choice` needs `tools`")),
        };
    }
    let calling = match choice {
        Some(Value::String(c)) if c == "none" => None,
        Some(Value::String(c)) if c == "required" => Some(ToolCalling::Required(tools)),
        None => return Err(auto_refused()),
        Some(Value::String(c)) if c == "auto" => return Err(auto_refused()),
        Some(Value::Object(named)) => {
            let name = named
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str);
            let name = name.ok_or_else(|| {
                ApiError::invalid(
                    "tool_choice",
                    "a named `tool_choice` is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                )
            })?;
            let tool = tools.into_iter().find(|t| t.name == name).ok_or_else(|| {
                ApiError::invalid(
                    "tool_choice",
                    format!("`tool_choice` names `{name}`, which is not in `tools`"),
                )
            })?;
            Some(ToolCalling::Named(tool))
        }
        Some(other) => {
            return Err(ApiError::invalid(
                "tool_choice",
                format!("`tool_choice` must be none, auto, required or a named function, got {other}"),
            ))
        }
    };
    Ok(Some(Tools { definitions, calling }))
}

fn auto_refused() -> ApiError {
    ApiError::invalid(
        "tool_choice",
        "`tool_choice` auto (the default where `tools` are given) needs a parser for the model's own tool-call format, which bbc does not have; ask for `required` or a named function",
    )
}

/// One of `tools`: `{"type": "function", "function": {"name", "description", "parameters"}}`.
fn tool(value: &Value) -> Result<Tool, ApiError> {
    let bad = |what: &str| ApiError::invalid("tools", format!("each tool needs {what}"));
    if value.get("type").and_then(Value::as_str) != Some("function") {
        return Err(bad("`type` function"));
    }
    let function = value
        .get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("a `function` object"))?;
    let name = match function.get("name").and_then(Value::as_str) {
        Some(name) if !name.is_empty() => name.to_string(),
        _ => return Err(bad("a `function.name`")),
    };
    let parameters = match function.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(schema @ Value::Object(_)) => schema.clone(),
        Some(_) => return Err(bad("`function.parameters` as a JSON schema")),
    };
    Ok(Tool { name, parameters })
}

impl ToolCalling {
    /// The structured output that holds the answer to a call.
    pub fn structured(&self) -> Structured {
        let spec = match self {
            Self::Named(tool) => tool.parameters.clone(),
            Self::Required(tools) => {
                let calls: Vec<Value> = tools
                    .iter()
                    .map(|t| {
                        json!({"type": "object", "additionalProperties": false, "required": ["name", "parameters"],
                               "properties": {"name": {"type": "string", "enum": [t.name]}, "parameters": t.parameters}})
                    })
                    .collect();
                json!({"type": "array", "minItems": 1, "items": {"anyOf": calls}})
            }
        };
        Structured {
            spec: OutputSpec::JsonSchema(spec),
            param: "tools".into(),
        }
    }

    /// The calls an answer makes; None where it is not one (cut short by `max_tokens`).
    pub fn calls(&self, answer: &str) -> Option<Vec<ToolCall>> {
        match self {
            Self::Named(tool) => {
                serde_json::from_str::<Value>(answer).ok()?;
                Some(vec![ToolCall {
                    name: tool.name.clone(),
                    arguments: answer.trim().to_string(),
                }])
            }
            Self::Required(_) => {
                let Value::Array(calls) = serde_json::from_str(answer).ok()? else {
                    return None;
                };
                calls
                    .iter()
                    .map(|c| {
                        Some(ToolCall {
                            name: c.get("name")?.as_str()?.to_string(),
                            arguments: c.get("parameters")?.to_string(),
                        })
                    })
                    .collect()
            }
        }
    }
}

/// A streamed delta's `tool_calls` carrying `arguments`, the next piece of a named function's
/// call (the first piece opens the call: its id, type and name).
pub fn named_call_delta(name: &str, arguments: &str, first: bool) -> Value {
    match first {
        true => json!([{"index": 0, "id": call_id(), "type": "function",
                        "function": {"name": name, "arguments": arguments}}]),
        false => json!([{"index": 0, "function": {"arguments": arguments}}]),
    }
}

/// OpenAI's `tool_calls` for `calls`, each with an id of its own (streamed, each with its
/// `index`).
pub fn tool_calls_json(calls: &[ToolCall], streamed: bool) -> Value {
    calls
        .iter()
        .enumerate()
        .map(|(i, call)| {
            let mut c = json!({"id": call_id(), "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}});
            if streamed {
                c["index"] = json!(i);
            }
            c
        })
        .collect()
}

/// `chatcmpl-tool-` and 16 hex digits, distinct within a server's run and unlikely to repeat
/// across runs.
fn call_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut mix = runtime::sampling::SplitMix64(nanos ^ NEXT.fetch_add(1, Relaxed).rotate_left(40));
    format!("chatcmpl-tool-{:016x}", mix.next_u64())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools(extra: Value) -> Result<Option<Tools>, ApiError> {
        let mut body = json!({"tools": [
            {"type": "function", "function": {"name": "weather", "parameters": {"type": "object",
                "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "time"}},
        ]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        parse(body.as_object().unwrap())
    }

    #[test]
    fn tool_choice_picks_the_calling() {
        let named = tools(json!({"tool_choice": {"type": "function", "function": {"name": "time"}}}))
            .unwrap()
            .unwrap();
        assert_eq!(
            named.calling,
            Some(ToolCalling::Named(Tool {
                name: "time".into(),
                parameters: json!({"type": "object", "properties": {}})
            }))
        );
        assert_eq!(named.definitions.len(), 2);
        let required = tools(json!({"tool_choice": "required"})).unwrap().unwrap();
        assert!(matches!(required.calling, Some(ToolCalling::Required(ref t)) if t.len() == 2));
        assert_eq!(tools(json!({"tool_choice": "none"})).unwrap().unwrap().calling, None);
        let no_tools = |body: Value| parse(body.as_object().unwrap());
        assert_eq!(no_tools(json!({"tools": [], "tool_choice": "auto"})).unwrap(), None);
        assert_eq!(no_tools(json!({})).unwrap(), None);
    }

    #[test]
    fn bad_tools_and_choices_are_named() {
        for (extra, param) in [
            (json!({}), "tool_choice"),
            (json!({"tool_choice": "auto"}), "tool_choice"),
            (json!({"tool_choice": "sometimes"}), "tool_choice"),
            (
                json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}}),
                "tool_choice",
            ),
            (json!({"tool_choice": {"type": "function"}}), "tool_choice"),
            (
                json!({"tool_choice": "required", "tools": [{"type": "retrieval"}]}),
                "tools",
            ),
            (
                json!({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": ""}}]}),
                "tools",
            ),
            (
                json!({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}),
                "tools",
            ),
            (json!({"tool_choice": "required", "tools": {}}), "tools"),
        ] {
            assert_eq!(
                tools(extra.clone()).unwrap_err().param.as_deref(),
                Some(param),
                "{extra}"
            );
        }
        let only_choice = json!({"tool_choice": "required"});
        assert_eq!(
            parse(only_choice.as_object().unwrap()).unwrap_err().param.as_deref(),
            Some("tool_choice")
        );
    }

    #[test]
    fn answers_become_calls() {
        let weather = Tool {
            name: "weather".into(),
            parameters: json!({}),
        };
        let named = ToolCalling::Named(weather.clone());
        assert_eq!(
            named.calls(" {\"city\": \"Oslo\"}"),
            Some(vec![ToolCall {
                name: "weather".into(),
                arguments: "{\"city\": \"Oslo\"}".into()
            }])
        );
        assert_eq!(named.calls("{\"city\": \"Os"), None, "cut short");
        let required = ToolCalling::Required(vec![weather]);
        let calls = required
            .calls(r#"[{"name": "weather", "parameters": {"city": "Oslo"}}, {"name": "weather", "parameters": {}}]"#)
            .unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].arguments, r#"{"city":"Oslo"}"#);
        assert_eq!(required.calls("[{\"name\": \"weather\""), None);
        let json = tool_calls_json(&calls, true);
        assert_eq!(json[1]["index"], 1);
        assert_ne!(json[0]["id"], json[1]["id"]);
        assert!(json[0]["id"].as_str().unwrap().starts_with("chatcmpl-tool-"));
    }
}
