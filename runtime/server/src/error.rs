//! OpenAI-style error responses: `{"error":{"message","type","param","code"}}`.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header (queue full, still loading).
    pub retry_after: Option<u32>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code: None,
            retry_after: None,
        }
    }

    /// 400 for a request we cannot or will not honour.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400 naming the offending field.
    pub fn invalid_param(param: impl Into<String>, message: impl Into<String>) -> Self {
        let mut e = Self::bad_request(message);
        e.param = Some(param.into());
        e
    }

    pub fn unsupported(param: impl Into<String>, message: impl Into<String>) -> Self {
        let mut e = Self::invalid_param(param, message);
        e.code = Some("unsupported_parameter");
        e
    }

    pub fn model_not_found(requested: &str, served: &str) -> Self {
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            format!("model '{requested}' does not exist; this server serves '{served}'"),
        );
        e.param = Some("model".into());
        e.code = Some("model_not_found");
        e
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message);
        e.code = Some("not_found");
        e
    }

    pub fn unauthorized() -> Self {
        let mut e = Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "missing or wrong API key; send 'Authorization: Bearer <key>' with the key the server was started with",
        );
        e.code = Some("invalid_api_key");
        e
    }

    pub fn overloaded(message: impl Into<String>, retry_after: u32) -> Self {
        let mut e = Self::new(StatusCode::SERVICE_UNAVAILABLE, "server_error", message);
        e.code = Some("overloaded");
        e.retry_after = Some(retry_after);
        e
    }

    /// 403: the request may not be made from where it came.
    pub fn forbidden(code: &'static str, message: impl Into<String>) -> Self {
        let mut e = Self::new(StatusCode::FORBIDDEN, "invalid_request_error", message);
        e.code = Some(code);
        e
    }

    /// OpenAI's context overflow, which clients (OpenCode, LiteLLM) key on:
    /// 400, `context_length_exceeded`, the prompt's field as `param`.
    pub fn context_length_exceeded(param: &str, message: impl Into<String>) -> Self {
        let mut e = Self::invalid_param(param, message);
        e.code = Some("context_length_exceeded");
        e
    }

    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    pub fn body(&self) -> serde_json::Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        }})
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.status)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}
