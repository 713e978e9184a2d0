//! Tool calling as vLLM does it: a chat request's `tools` reach the chat template, and
//! `tool_choice` says what the answer may be. A named function or `required` makes the answer
//! a call, its shape held by a structured output (the named function's parameters; for
//! `required`, a JSON array of `{"name", "parameters"}` objects, one of the tools each).
//! `auto` (the default with tools) leaves the model free to answer or to call in its own
//! format, which `tool_parser` reads out of the answer. Either way the calls are returned as
//! OpenAI's `tool_calls`; `parallel_tool_calls: false` keeps them to one.

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
    /// One or more calls of these functions (one where `one_call`).
    Required { tools: Vec<Tool>, one_call: bool },
    /// Text, or calls of these functions in the model's own format (one where `one_call`).
    Auto { tools: Vec<Tool>, one_call: bool },
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
    let one_call = match given("parallel_tool_calls") {
        None => false,
        Some(Value::Bool(parallel)) => !parallel,
        Some(_) => {
            return Err(ApiError::invalid(
                "parallel_tool_calls",
                "`parallel_tool_calls` must be true or false",
            ))
        }
    };
    let calling = match choice {
        Some(Value::String(c)) if c == "none" => None,
        Some(Value::String(c)) if c == "required" => Some(ToolCalling::Required { tools, one_call }),
        None => Some(ToolCalling::Auto { tools, one_call }),
        Some(Value::String(c)) if c == "auto" => Some(ToolCalling::Auto { tools, one_call }),
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
    /// The structured output that holds the answer to a call; none for `auto`.
    pub fn structured(&self) -> Option<Structured> {
        let spec = match self {
            Self::Auto { .. } => return None,
            Self::Named(tool) => tool.parameters.clone(),
            Self::Required { tools, one_call } => {
                let calls: Vec<Value> = tools
                    .iter()
                    .map(|t| {
                        json!({"type": "object", "additionalProperties": false, "required": ["name", "parameters"],
                               "properties": {"name": {"type": "string", "enum": [t.name]}, "parameters": t.parameters}})
                    })
                    .collect();
                let mut array = json!({"type": "array", "minItems": 1, "items": {"anyOf": calls}});
                if *one_call {
                    array["maxItems"] = json!(1);
                }
                array
            }
        };
        Some(Structured {
            spec: OutputSpec::JsonSchema(spec),
            param: "tools".into(),
        })
    }

    /// The calls a whole answer to a named function or `required` makes; None where it is
    /// not one (cut short by `max_tokens`) and for `auto` (whose calls `tool_parser` reads).
    pub fn calls(&self, answer: &str) -> Option<Vec<ToolCall>> {
        match self {
            Self::Auto { .. } => None,
            Self::Named(tool) => {
                serde_json::from_str::<Value>(answer).ok()?;
                Some(vec![ToolCall {
                    name: tool.name.clone(),
                    arguments: answer.trim().to_string(),
                }])
            }
            Self::Required { .. } => {
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
/// `index`, counted from `streamed`'s: the calls sent before).
pub fn tool_calls_json(calls: &[ToolCall], streamed: Option<usize>) -> Value {
    calls
        .iter()
        .enumerate()
        .map(|(i, call)| {
            let mut c = json!({"id": call_id(), "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}});
            if let Some(sent) = streamed {
                c["index"] = json!(sent + i);
            }
            c
        })
        .collect()
}

/// `chatcmpl-tool-` and 16 hex digits.
fn call_id() -> String {
    fresh_id("chatcmpl-tool-")
}

/// `prefix` and 16 hex digits, distinct within a server's run and unlikely to repeat across
/// runs.
pub fn fresh_id(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut mix = runtime::sampling::SplitMix64(nanos ^ NEXT.fetch_add(1, Relaxed).rotate_left(40));
    format!("{prefix}{:016x}", mix.next_u64())
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
        assert!(
            matches!(required.calling, Some(ToolCalling::Required { ref tools, one_call: false }) if tools.len() == 2)
        );
        for auto in [json!({}), json!({"tool_choice": "auto", "parallel_tool_calls": false})] {
            let one_call = auto.get("parallel_tool_calls").is_some();
            let calling = tools(auto).unwrap().unwrap().calling;
            assert!(
                matches!(calling, Some(ToolCalling::Auto { ref tools, one_call: o }) if tools.len() == 2 && o == one_call)
            );
        }
        assert_eq!(tools(json!({"tool_choice": "none"})).unwrap().unwrap().calling, None);
        let no_tools = |body: Value| parse(body.as_object().unwrap());
        assert_eq!(no_tools(json!({"tools": [], "tool_choice": "auto"})).unwrap(), None);
        assert_eq!(no_tools(json!({})).unwrap(), None);
    }

    /// `parallel_tool_calls: false` holds `required` to an array of one call.
    #[test]
    fn one_required_call_where_parallel_calls_are_off() {
        let spec = |parallel: bool| {
            let calling = tools(json!({"tool_choice": "required", "parallel_tool_calls": parallel}))
                .unwrap()
                .unwrap()
                .calling
                .unwrap();
            match calling.structured().unwrap().spec {
                OutputSpec::JsonSchema(schema) => schema,
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(spec(false)["maxItems"], 1);
        assert!(spec(true).get("maxItems").is_none());
    }

    #[test]
    fn bad_tools_and_choices_are_named() {
        for (extra, param) in [
            (json!({"tool_choice": "sometimes"}), "tool_choice"),
            (json!({"parallel_tool_calls": "no"}), "parallel_tool_calls"),
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
        let required = ToolCalling::Required {
            tools: vec![weather],
            one_call: false,
        };
        let calls = required
            .calls(r#"[{"name": "weather", "parameters": {"city": "Oslo"}}, {"name": "weather", "parameters": {}}]"#)
            .unwrap();
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].arguments, r#"{"city":"Oslo"}"#);
        assert_eq!(required.calls("[{\"name\": \"weather\""), None);
        let json = tool_calls_json(&calls, Some(3));
        assert_eq!(json[1]["index"], 4);
        assert_ne!(json[0]["id"], json[1]["id"]);
        assert!(json[0]["id"].as_str().unwrap().starts_with("chatcmpl-tool-"));
    }
}
