//! What shape a request asks its output to take (structured outputs), as the three spellings
//! clients use give it: OpenAI's `response_format`, vLLM's `structured_outputs`, and vLLM's
//! older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. At most one may
//! constrain a request; `crate::grammar` compiles what it asks for.

use super::error::ApiError;
pub use crate::grammar::OutputSpec;
use serde_json::{Map, Value};

/// A request's output spec and the parameter that gave it (named in errors about it).
#[derive(Debug, Clone, PartialEq)]
pub struct Structured {
    pub spec: OutputSpec,
    pub param: String,
}

const GUIDED: [&str; 4] = ["guided_json", "guided_regex", "guided_choice", "guided_grammar"];

/// The body's output spec, if it constrains its output.
pub fn parse(body: &Map<String, Value>) -> Result<Option<Structured>, ApiError> {
    let given = |name: &str| body.get(name).filter(|v| !v.is_null());
    let mut found: Vec<Structured> = Vec::new();
    if let Some(format) = given("response_format") {
        found.extend(response_format(format)?);
    }
    if let Some(outputs) = given("structured_outputs") {
        found.push(structured_outputs(outputs)?);
    }
    for name in GUIDED {
        if let Some(value) = given(name) {
            let key = name.trim_start_matches("guided_");
            found.push(Structured {
                spec: spec_of(key, value, name)?,
                param: name.to_string(),
            });
        }
    }
    match found.len() {
        0 | 1 => Ok(found.pop()),
        _ => Err(ApiError::invalid(
            &found[1].param,
            format!(
                "only one structured output may be asked for; this request gives `{}` and `{}`",
                found[0].param, found[1].param
            ),
        )),
    }
}

/// OpenAI's `response_format`: `{"type": "text" | "json_object" | "json_schema"}`, the last
/// with `json_schema: {"name", "schema", "strict"}`.
fn response_format(value: &Value) -> Result<Option<Structured>, ApiError> {
    let param = "response_format";
    let bad = |what: &str| ApiError::invalid(param, format!("`response_format` {what}"));
    let Value::Object(format) = value else {
        return Err(bad("must be an object"));
    };
    let structured = |spec| {
        Some(Structured {
            spec,
            param: param.to_string(),
        })
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(structured(OutputSpec::JsonObject)),
        Some("json_schema") => {
            let schema = format
                .get("json_schema")
                .and_then(|s| s.get("schema"))
                .filter(|s| s.is_object() || s.is_boolean())
                .ok_or_else(|| bad("of type `json_schema` needs `json_schema.schema`, a JSON schema"))?;
            Ok(structured(OutputSpec::JsonSchema(schema.clone())))
        }
        Some(other) => Err(bad(&format!(
            "type `{other}` is not supported (text, json_object and json_schema are)"
        ))),
        None => Err(bad("needs a `type`")),
    }
}

/// vLLM's `structured_outputs`: an object giving one of `json`, `regex`, `choice`, `grammar`
/// or `json_object: true`.
fn structured_outputs(value: &Value) -> Result<Structured, ApiError> {
    let param = "structured_outputs";
    let Value::Object(fields) = value else {
        return Err(ApiError::invalid(param, "`structured_outputs` must be an object"));
    };
    let given: Vec<(&String, &Value)> = fields.iter().filter(|(_, v)| !v.is_null()).collect();
    if let Some((key, _)) = given
        .iter()
        .find(|(k, _)| !["json", "regex", "choice", "grammar", "json_object"].contains(&k.as_str()))
    {
        return Err(ApiError::invalid(
            param,
            format!("`structured_outputs.{key}` is not supported (json, regex, choice, grammar and json_object are)"),
        ));
    }
    match given.as_slice() {
        [(key, value)] => Ok(Structured {
            spec: spec_of(key, value, &format!("structured_outputs.{key}"))?,
            param: format!("structured_outputs.{key}"),
        }),
        [] => Err(ApiError::invalid(
            param,
            "`structured_outputs` must give one of json, regex, choice, grammar or json_object",
        )),
        _ => Err(ApiError::invalid(
            param,
            "`structured_outputs` must give only one of json, regex, choice, grammar or json_object",
        )),
    }
}

/// The spec of one of vLLM's keys (`json`, `regex`, `choice`, `grammar`, `json_object`).
fn spec_of(key: &str, value: &Value, param: &str) -> Result<OutputSpec, ApiError> {
    let wrong = |want: &str| ApiError::invalid(param, format!("`{param}` must be {want}"));
    match key {
        // A schema as an object, or as the JSON text of one.
        "json" => match value {
            Value::Object(_) | Value::Bool(_) => Ok(OutputSpec::JsonSchema(value.clone())),
            Value::String(text) => match serde_json::from_str::<Value>(text) {
                Ok(schema @ (Value::Object(_) | Value::Bool(_))) => Ok(OutputSpec::JsonSchema(schema)),
                _ => Err(wrong("a JSON schema (an object, or its JSON text)")),
            },
            _ => Err(wrong("a JSON schema (an object, or its JSON text)")),
        },
        "regex" => match value.as_str() {
            Some(regex) if !regex.is_empty() => Ok(OutputSpec::Regex(regex.to_string())),
            _ => Err(wrong("a non-empty string")),
        },
        "grammar" => match value.as_str() {
            Some(grammar) if !grammar.trim().is_empty() => Ok(OutputSpec::Grammar(grammar.to_string())),
            _ => Err(wrong("a non-empty string")),
        },
        "choice" => {
            let choices: Option<Vec<String>> = value
                .as_array()
                .and_then(|items| items.iter().map(|c| c.as_str().map(str::to_string)).collect());
            match choices {
                Some(choices) if !choices.is_empty() && choices.iter().all(|c| !c.is_empty()) => {
                    Ok(OutputSpec::Choice(choices))
                }
                _ => Err(wrong("a non-empty array of non-empty strings")),
            }
        }
        "json_object" => match value.as_bool() {
            Some(true) => Ok(OutputSpec::JsonObject),
            _ => Err(wrong("true")),
        },
        _ => unreachable!("callers pass one of the keys above"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(body: &str) -> Result<Option<OutputSpec>, ApiError> {
        let Value::Object(body) = serde_json::from_str(body).unwrap() else {
            panic!()
        };
        parse(&body).map(|s| s.map(|s| s.spec))
    }

    fn param(body: &str) -> Option<String> {
        spec(body).unwrap_err().param
    }

    #[test]
    fn each_spelling_gives_its_spec() {
        assert_eq!(spec(r#"{}"#).unwrap(), None);
        assert_eq!(spec(r#"{"response_format":{"type":"text"}}"#).unwrap(), None);
        assert_eq!(spec(r#"{"response_format":null}"#).unwrap(), None);
        assert_eq!(
            spec(r#"{"response_format":{"type":"json_object"}}"#).unwrap(),
            Some(OutputSpec::JsonObject)
        );
        let schema = serde_json::json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let body =
            format!(r#"{{"response_format":{{"type":"json_schema","json_schema":{{"name":"x","schema":{schema}}}}}}}"#);
        assert_eq!(spec(&body).unwrap(), Some(OutputSpec::JsonSchema(schema.clone())));
        let body = format!(r#"{{"structured_outputs":{{"json":{schema}}}}}"#);
        assert_eq!(spec(&body).unwrap(), Some(OutputSpec::JsonSchema(schema.clone())));
        let text = serde_json::to_string(&schema.to_string()).unwrap();
        let body = format!(r#"{{"guided_json":{text}}}"#);
        assert_eq!(spec(&body).unwrap(), Some(OutputSpec::JsonSchema(schema)));
        assert_eq!(
            spec(r#"{"structured_outputs":{"regex":"[0-9]+","choice":null}}"#).unwrap(),
            Some(OutputSpec::Regex("[0-9]+".into()))
        );
        assert_eq!(
            spec(r#"{"guided_choice":["yes","no"]}"#).unwrap(),
            Some(OutputSpec::Choice(vec!["yes".into(), "no".into()]))
        );
        assert_eq!(
            spec(r#"{"structured_outputs":{"grammar":"start: \"a\"+"}}"#).unwrap(),
            Some(OutputSpec::Grammar("start: \"a\"+".into()))
        );
        assert_eq!(
            spec(r#"{"structured_outputs":{"json_object":true}}"#).unwrap(),
            Some(OutputSpec::JsonObject)
        );
    }

    #[test]
    fn bad_specs_name_their_parameter() {
        for (body, name) in [
            (r#"{"response_format":"json"}"#, "response_format"),
            (r#"{"response_format":{"type":"xml"}}"#, "response_format"),
            (r#"{"response_format":{}}"#, "response_format"),
            (
                r#"{"response_format":{"type":"json_schema","json_schema":{"name":"x"}}}"#,
                "response_format",
            ),
            (r#"{"structured_outputs":[1]}"#, "structured_outputs"),
            (r#"{"structured_outputs":{}}"#, "structured_outputs"),
            (
                r#"{"structured_outputs":{"regex":"a","choice":["b"]}}"#,
                "structured_outputs",
            ),
            (r#"{"structured_outputs":{"structural_tag":"x"}}"#, "structured_outputs"),
            (r#"{"structured_outputs":{"regex":""}}"#, "structured_outputs.regex"),
            (r#"{"structured_outputs":{"choice":[]}}"#, "structured_outputs.choice"),
            (
                r#"{"structured_outputs":{"json":"{not json"}}"#,
                "structured_outputs.json",
            ),
            (
                r#"{"structured_outputs":{"json_object":false}}"#,
                "structured_outputs.json_object",
            ),
            (r#"{"guided_choice":["a",1]}"#, "guided_choice"),
            (
                r#"{"guided_regex":"a","response_format":{"type":"json_object"}}"#,
                "guided_regex",
            ),
        ] {
            assert_eq!(param(body).as_deref(), Some(name), "{body}");
        }
    }
}
