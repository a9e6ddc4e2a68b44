//! The HTTP surface: routes, middleware and the job hand-off shared by the
//! chat and text completion handlers.

mod chat;
mod completions;
mod extract;
mod info;
mod messages;
mod request;
mod response;

use crate::error::ApiError;
use crate::state::{AppState, LoadedModel};
use crate::worker::{Job, StreamMsg, SubmitError};
use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::http::{HeaderName, Method, header};
use axum::middleware;
use axum::routing::{get, post};
use krasis_model::GenerateRequest;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::cors::{AllowOrigin, CorsLayer};

/// Coding agents send whole repositories of context; 64 MiB is far above
/// any context window's worth of text while still bounding memory.
const BODY_LIMIT: usize = 64 << 20;

/// The full router. `/health` is open; `/v1/*` needs the API key when set.
pub fn router(state: Arc<AppState>) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(completions::completions))
        .route("/v1/models", get(info::list_models))
        .route("/v1/models/{*id}", get(info::get_model))
        .route("/v1/stats", get(info::stats))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            extract::require_key,
        ));
    let cors = CorsLayer::new()
        .allow_origin(AllowOrigin::mirror_request())
        .allow_methods([Method::GET, Method::POST, Method::OPTIONS])
        .allow_headers([
            header::AUTHORIZATION,
            header::CONTENT_TYPE,
            HeaderName::from_static("x-stainless-os"),
            HeaderName::from_static("x-stainless-lang"),
            HeaderName::from_static("x-stainless-arch"),
            HeaderName::from_static("x-stainless-runtime"),
            HeaderName::from_static("x-stainless-runtime-version"),
            HeaderName::from_static("x-stainless-package-version"),
            HeaderName::from_static("x-stainless-retry-count"),
            HeaderName::from_static("x-stainless-timeout"),
        ])
        .max_age(std::time::Duration::from_secs(600));
    Router::new()
        .route("/health", get(info::health))
        .merge(api)
        .fallback(info::unknown_route)
        .method_not_allowed_fallback(info::wrong_method)
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(CatchPanicLayer::custom(info::panic_response))
        .layer(cors)
        .with_state(state)
}

/// Sets the job's cancel flag when the response side goes away, so a
/// generation whose client disconnected stops at its next token (or never
/// starts, if it was still queued).
pub struct CancelGuard(Arc<AtomicBool>);

impl CancelGuard {
    pub fn cancel(&self) {
        self.0.store(true, Ordering::Relaxed);
    }
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        self.cancel();
    }
}

pub struct Submitted {
    pub rx: UnboundedReceiver<StreamMsg>,
    pub guard: CancelGuard,
}

/// Queues a generation or answers 503 with `Retry-After` when the queue is full.
pub fn submit(
    model: &LoadedModel,
    request: GenerateRequest,
    stop_strings: Vec<String>,
) -> Result<Submitted, ApiError> {
    let (tx, rx) = unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let job = Job {
        request,
        stop_strings,
        events: tx,
        cancel: cancel.clone(),
    };
    model.worker.submit(job).map_err(|e| {
        tracing::warn!("rejecting a request: {e}");
        match e {
            SubmitError::QueueFull { .. } => {
                ApiError::overloaded(format!("the server is busy: {e}; retry later"), 1)
            }
            SubmitError::EngineGone => ApiError::internal(e.to_string()),
        }
    })?;
    Ok(Submitted {
        rx,
        guard: CancelGuard(cancel),
    })
}
