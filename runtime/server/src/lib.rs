//! OpenAI-compatible HTTP API over a krasis [`Engine`](krasis_model::Engine).
//!
//! [`AppState`] holds the configuration and, once loaded, the model; the
//! router ([`router`]) answers `/health` from the moment it is bound, so the
//! launcher can watch a model load. The engine runs on one thread behind a
//! bounded queue ([`worker`]). Model text is turned into OpenAI responses by
//! [`output`]: stop strings, `<think>` reasoning, and tool calls in the
//! grammar the chat template teaches.

pub mod api;
pub mod error;
pub mod output;
pub mod state;
pub mod testkit;
pub mod worker;

pub use api::router;
pub use error::ApiError;
pub use state::{AppState, ServerConfig};

/// Serves `router` on an already-bound listener until `shutdown` resolves.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: std::sync::Arc<AppState>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
}
