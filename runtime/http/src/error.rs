//! Errors as OpenAI-compatible servers send them: a status code and
//! `{"error": {"message", "type", "code", "param"}}`, naming the parameter at fault.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub param: Option<String>,
}

impl ApiError {
    /// 400 naming `param`.
    pub fn invalid(param: &str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param.to_string()),
        }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: None,
        }
    }

    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            param: None,
        }
    }

    /// This error as an API that names the chat parameters otherwise (the Responses and
    /// Messages bodies, rewritten as chat requests) says it: `param` and every name the
    /// message quotes in backticks, through `name`.
    pub fn renamed(mut self, name: impl Fn(&str) -> &str) -> Self {
        self.param = self.param.map(|p| name(&p).to_string());
        let parts: Vec<&str> = self.message.split('`').collect();
        // Odd parts are between backticks (an unpaired last one has no closing quote).
        let quoted = |i: usize| i % 2 == 1 && i + 1 < parts.len();
        self.message = parts
            .iter()
            .enumerate()
            .map(|(i, part)| if quoted(i) { name(part) } else { part })
            .collect::<Vec<_>>()
            .join("`");
        self
    }

    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable_error",
            s if s.is_server_error() => "internal_server_error",
            _ => "invalid_request_error",
        }
    }

    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind(),
                "code": self.status.as_u16(),
                "param": self.param,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = self.body().to_string();
        (self.status, [("content-type", "application/json")], body).into_response()
    }
}
