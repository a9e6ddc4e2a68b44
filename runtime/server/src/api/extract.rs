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

/// Bodies larger than this are parsed on the blocking pool, so a request of
/// megabytes never holds up the async workers (and `/health` with them).
const PARSE_INLINE: usize = 256 << 10;

/// Like `axum::Json`, but a bad body is a 400 in OpenAI's error format with
/// serde's description of what was wrong and where, and a body over the
/// limit is a 413 in the same format. Called by the handlers after
/// admission, so a full server does not read or parse bodies.
pub async fn read_json<T>(req: Request) -> Result<T, ApiError>
where
    T: DeserializeOwned + Send + 'static,
{
    let bytes = Bytes::from_request(req, &()).await.map_err(|e| {
        if e.status() == StatusCode::PAYLOAD_TOO_LARGE {
            let mut err = ApiError::bad_request(format!(
                "the request body is larger than this server accepts ({} MiB)",
                super::BODY_LIMIT >> 20
            ));
            err.status = StatusCode::PAYLOAD_TOO_LARGE;
            err.code = Some("request_too_large");
            err
        } else {
            ApiError::bad_request(format!("could not read the request body: {e}"))
        }
    })?;
    if bytes.is_empty() {
        return Err(ApiError::bad_request(
            "the request body is empty; send a JSON object",
        ));
    }
    let small = bytes.len() <= PARSE_INLINE;
    let parse = move || {
        serde_json::from_slice(&bytes)
            .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}")))
    };
    if small {
        return parse();
    }
    tokio::task::spawn_blocking(parse)
        .await
        .map_err(|e| ApiError::internal(format!("parsing the request body failed: {e}")))?
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
