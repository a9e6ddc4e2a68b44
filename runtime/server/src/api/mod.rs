//! The HTTP surface: routes, middleware and the job hand-off shared by the
//! chat and text completion handlers.

mod chat;
mod completions;
mod extract;
pub mod guard;
mod info;
mod messages;
mod request;
mod response;
pub mod structured;

use crate::error::ApiError;
use crate::live::Origin;
use crate::state::{AppState, LoadedModel};
use crate::worker::{Job, Slot, StreamMsg, SubmitError};
use axum::Router;
use axum::extract::{ConnectInfo, DefaultBodyLimit, Request};
use axum::middleware;
use axum::routing::{get, post};
use krasis_model::GenerateRequest;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};
use tower_http::catch_panic::CatchPanicLayer;

/// Bodies above this get 413. A million-token context is about 4 MiB of
/// text, twice that as escaped JSON, so 16 MiB leaves room while bounding
/// what the admitted requests (`queue_depth + 1` of them) can hold in memory.
pub const BODY_LIMIT: usize = 16 << 20;

/// The full router. `/health` is open; `/v1/*` needs the API key when set;
/// everything is behind the origin and host checks of [`guard`].
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
    let cors = guard::cors(guard::Origins::new(&state.config.cors_origins));
    Router::new()
        .route("/health", get(info::health))
        .merge(api)
        .fallback(info::unknown_route)
        .method_not_allowed_fallback(info::wrong_method)
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(CatchPanicLayer::custom(info::panic_response))
        .layer(middleware::from_fn_with_state(
            state.clone(),
            guard::check_request,
        ))
        .layer(cors)
        .with_state(state)
}

/// Sets the job's cancel flag when the response side goes away, so a
/// generation whose client disconnected stops at its next token or prefill
/// chunk (or never starts, if it was still queued).
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

pub fn submit_error(e: SubmitError) -> ApiError {
    tracing::warn!("rejecting a request: {e}");
    match e {
        SubmitError::QueueFull { .. } => {
            ApiError::overloaded(format!("the server is busy: {e}; retry later"), 1)
        }
        SubmitError::Halted(_) => ApiError::overloaded(e.to_string(), 10),
        SubmitError::EngineGone => ApiError::internal(e.to_string()),
    }
}

/// Admits a request before any work is done for it (reading, rendering and
/// tokenizing its prompt): 503 with `Retry-After` when the queue is full.
pub fn admit(model: &LoadedModel) -> Result<Slot, ApiError> {
    model.worker.reserve().map_err(submit_error)
}

/// The request's route and client, for the stats and the request log. The
/// client's address is there when the server runs with connect info, as
/// [`crate::serve`] does.
pub fn origin(endpoint: &'static str, http: &Request) -> Origin {
    let client = http
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0);
    Origin { endpoint, client }
}

/// Queues an admitted generation.
pub fn submit(
    model: &LoadedModel,
    slot: Slot,
    request: GenerateRequest,
    stop_strings: Vec<String>,
    origin: Origin,
) -> Result<Submitted, ApiError> {
    let (tx, rx) = unbounded_channel();
    let cancel = Arc::new(AtomicBool::new(false));
    let job = Job {
        request,
        stop_strings,
        events: tx,
        cancel: cancel.clone(),
        slot,
        origin,
        // A whole-output grammar (harmony) reads the special-token markers.
        keep_special_tokens: model.grammar.as_ref().is_some_and(|g| g.whole_output()),
    };
    model.worker.submit(job).map_err(submit_error)?;
    Ok(Submitted {
        rx,
        guard: CancelGuard(cancel),
    })
}

/// Runs prompt preparation (rendering, tokenizing: CPU work proportional to
/// the prompt) on the blocking pool, off the async workers.
pub async fn off_thread<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ApiError::internal(format!("preparing the prompt failed: {e}")))?
}
