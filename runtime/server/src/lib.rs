//! OpenAI-compatible HTTP API over a krasis [`Engine`](krasis_model::Engine).
//!
//! [`AppState`] holds the configuration and, once loaded, the model; the
//! router ([`router`]) answers `/health` from the moment it is bound, so the
//! launcher can watch a model load. The engine runs on one thread behind a
//! bounded queue ([`worker`]). Model text is turned into OpenAI responses by
//! [`output`]: stop strings, `<think>` reasoning, and tool calls in the
//! grammar the chat template teaches. `/v1/stats` shows the running
//! request live ([`live`]), the last finished ones ([`requests`]) and the
//! engine's figures ([`stats`]).

pub mod api;
pub mod error;
pub mod live;
pub mod output;
pub mod requests;
pub mod state;
pub mod stats;
pub mod testkit;
pub mod worker;

pub use api::router;
pub use error::ApiError;
pub use state::{AppState, ServerConfig};

use std::future::{Future, IntoFuture};
use std::net::SocketAddr;
use std::time::Duration;

/// What this server enforces by grammar-constrained sampling, for the
/// capability report.
pub fn structured_output_caps() -> krasis_common::capabilities::StructuredOutputCaps {
    let names = |keep: fn(&dyn output::tools::ToolGrammar) -> bool| {
        output::tools::all_grammars()
            .into_iter()
            .filter(|g| keep(*g))
            .map(|g| g.name().to_string())
            .collect()
    };
    krasis_common::capabilities::StructuredOutputCaps {
        response_formats: api::structured::RESPONSE_FORMATS.map(String::from).to_vec(),
        constrained_tool_grammars: names(|g| g.constrains() && g.constrains_auto()),
        forced_only_tool_grammars: names(|g| g.constrains() && !g.constrains_auto()),
        parsed_tool_grammars: names(|g| !g.constrains()),
    }
}

/// How long [`serve`] lets in-flight responses finish after it was told to
/// stop (their generations are cancelled first, so they end quickly) before
/// it closes the remaining connections.
pub const DRAIN: Duration = Duration::from_millis(1500);

/// Why [`serve`] returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stopped {
    /// The shutdown future resolved.
    Shutdown,
    /// The engine faulted (the reason); the process should exit with
    /// [`krasis_common::status::EXIT_ENGINE_FAULT`].
    EngineFault(String),
}

/// Serves `router` on an already-bound listener until `shutdown` resolves or
/// the engine faults. Then every queued and running generation is cancelled
/// (their clients get their answers: an error, or the end of the stream),
/// the engine thread stops, and the connections get at most [`DRAIN`] to
/// finish before they are closed, so the caller can exit within about two
/// seconds even with long generations in flight.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: std::sync::Arc<AppState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<Stopped> {
    let (drain_tx, drain_rx) = tokio::sync::oneshot::channel::<()>();
    // With each connection's peer address, which the request log shows.
    let app = router(state.clone()).into_make_service_with_connect_info::<SocketAddr>();
    let server = axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            let _ = drain_rx.await;
        })
        .into_future();
    let mut server = tokio::spawn(server);
    let why = tokio::select! {
        _ = shutdown => Stopped::Shutdown,
        reason = state.engine_fault() => Stopped::EngineFault(reason),
        ended = &mut server => {
            // The server cannot end before it is told to, except on error.
            ended.map_err(std::io::Error::other)??;
            return Err(std::io::Error::other("the HTTP server stopped by itself"));
        }
    };
    match &why {
        Stopped::Shutdown => tracing::info!("shutting down: cancelling requests in flight"),
        Stopped::EngineFault(r) => tracing::error!("engine fault, exiting: {r}"),
    }
    let stop_started = tokio::time::Instant::now();
    state.stop();
    let _ = drain_tx.send(());
    let deadline = tokio::time::Instant::now() + DRAIN;
    match tokio::time::timeout_at(deadline, &mut server).await {
        Ok(ended) => ended.map_err(std::io::Error::other)??,
        Err(_) => {
            tracing::warn!(
                "connections still open after {} ms; closing them",
                DRAIN.as_millis()
            );
            server.abort();
        }
    }
    let engine_deadline = deadline.max(stop_started + state.config.stop_limit);
    if tokio::time::timeout_at(engine_deadline, state.engine_stopped())
        .await
        .is_err()
    {
        tracing::warn!("the engine did not stop in time; exiting without it");
    }
    Ok(why)
}
