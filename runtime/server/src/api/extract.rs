//! Request plumbing: JSON bodies whose every failure is an OpenAI error
//! object, and the Bearer-key check.

use crate::error::ApiError;
use crate::state::AppState;
use axum::body::Bytes;
use axum::extract::{FromRequest, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::Response;
use serde::de::DeserializeOwned;
use std::sync::Arc;

/// Like `axum::Json`, but a bad body is a 400 in OpenAI's error format with
/// serde's description of what was wrong and where.
pub struct JsonBody<T>(pub T);

impl<S, T> FromRequest<S> for JsonBody<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state).await.map_err(|e| {
            let mut err = ApiError::bad_request(format!("could not read the request body: {e}"));
            if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
                err.status = StatusCode::PAYLOAD_TOO_LARGE;
            }
            err
        })?;
        if bytes.is_empty() {
            return Err(ApiError::bad_request(
                "the request body is empty; send a JSON object",
            ));
        }
        serde_json::from_slice(&bytes)
            .map(JsonBody)
            .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))
    }
}

/// Checks `Authorization: Bearer <key>` when the server has a key.
pub async fn require_key(
    State(state): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    if let Some(key) = &state.config.api_key {
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                v.strip_prefix("Bearer ")
                    .or_else(|| v.strip_prefix("bearer "))
            })
            .map(str::trim);
        if !given.is_some_and(|g| constant_time_eq(g.as_bytes(), key.as_bytes())) {
            return Err(ApiError::unauthorized());
        }
    }
    Ok(next.run(req).await)
}

/// Compares without an early exit so the key cannot be guessed by timing.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}
