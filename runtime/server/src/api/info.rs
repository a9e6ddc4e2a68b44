//! Small endpoints: health, models, stats, and the catch-alls.

use crate::error::ApiError;
use crate::state::AppState;
use axum::Json;
use axum::extract::{Path, State};
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use krasis_common::status::{EngineStats, Health, HealthStatus};
use serde_json::{Value, json};
use std::any::Any;
use std::sync::Arc;

/// 200 `{"status": "ok"}` while the model serves requests; 503 with
/// `loading` before that and `error` (with the reason) after loading
/// failed, after an engine fault, or while shutting down.
pub async fn health(State(state): State<Arc<AppState>>) -> (StatusCode, Json<Health>) {
    let h = state.health();
    let code = if h.status == HealthStatus::Ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(h))
}

pub async fn stats(State(state): State<Arc<AppState>>) -> Json<EngineStats> {
    Json(state.engine_stats())
}

fn model_object(state: &AppState) -> Value {
    json!({
        "id": state.config.model_id,
        "object": "model",
        "created": super::response::unix_now(),
        "owned_by": "krasis",
    })
}

pub async fn list_models(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_object(&state)]}))
}

pub async fn get_model(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    if id != state.config.model_id {
        return Err(ApiError::model_not_found(&id, &state.config.model_id));
    }
    Ok(Json(model_object(&state)))
}

pub async fn unknown_route(method: Method, uri: Uri) -> ApiError {
    ApiError::not_found(format!(
        "no endpoint {method} {}; this server offers /v1/chat/completions, /v1/completions, /v1/models, /v1/stats and /health",
        uri.path()
    ))
}

pub async fn wrong_method(method: Method, uri: Uri) -> ApiError {
    let mut e = ApiError::bad_request(format!("{} does not accept {method}", uri.path()));
    e.status = StatusCode::METHOD_NOT_ALLOWED;
    e
}

/// A panic in a handler becomes a 500; the server keeps serving.
pub fn panic_response(payload: Box<dyn Any + Send + 'static>) -> Response {
    let msg = payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into());
    tracing::error!("request handler panicked: {msg}");
    ApiError::internal(format!("internal error while handling the request: {msg}")).into_response()
}
