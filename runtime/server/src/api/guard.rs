//! Who may talk to the server from a browser. A keyless server on loopback
//! trusts every request, so web pages must not be able to drive it:
//!
//! - CORS answers only loopback origins (`http(s)://localhost`,
//!   `127.x.x.x`, `[::1]`, any port) plus the configured ones, and a request
//!   that carries any other `Origin` is refused with 403 (a browser sends
//!   "simple" cross-origin POSTs without asking first, so leaving out the
//!   CORS headers alone would still let a page start generations).
//! - DNS rebinding: a page whose domain resolves to 127.0.0.1 talks to the
//!   server as its own origin, so CORS never applies; its requests carry its
//!   domain in `Host`. A keyless loopback server refuses every `Host` that
//!   is not a loopback name.

use crate::error::ApiError;
use crate::state::AppState;
use axum::extract::{Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderName, HeaderValue, Method, header};
use axum::middleware::Next;
use axum::response::Response;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::Arc;
use tower_http::cors::{AllowOrigin, CorsLayer};

/// Which web origins may use the API.
#[derive(Debug, Clone)]
pub struct Origins {
    any: bool,
    extra: Vec<String>,
}

impl Origins {
    pub fn new(configured: &[String]) -> Self {
        Origins {
            any: configured.iter().any(|o| o.trim() == "*"),
            extra: configured
                .iter()
                .map(|o| o.trim().trim_end_matches('/').to_ascii_lowercase())
                .filter(|o| !o.is_empty() && o != "*")
                .collect(),
        }
    }

    pub fn allows(&self, origin: &str) -> bool {
        self.any || is_loopback_origin(origin) || {
            let o = origin.to_ascii_lowercase();
            self.extra.contains(&o)
        }
    }
}

/// `http(s)://` + a loopback host + an optional port, nothing else.
pub fn is_loopback_origin(origin: &str) -> bool {
    let lower = origin.to_ascii_lowercase();
    let Some(rest) = lower
        .strip_prefix("http://")
        .or_else(|| lower.strip_prefix("https://"))
    else {
        return false;
    };
    is_loopback_host(rest)
}

/// A `Host` value (`name[:port]`) naming this machine: `localhost`, an
/// address in 127.0.0.0/8, or `[::1]`.
pub fn is_loopback_host(host: &str) -> bool {
    let host = host.trim();
    let name = if let Some(v6) = host.strip_prefix('[') {
        let Some((addr, port)) = v6.split_once(']') else {
            return false;
        };
        if !(port.is_empty() || valid_port(port.strip_prefix(':'))) {
            return false;
        }
        return addr.parse::<Ipv6Addr>().is_ok_and(|a| {
            a.is_loopback() || a.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback())
        });
    } else {
        match host.rsplit_once(':') {
            Some((name, port)) if valid_port(Some(port)) => name,
            Some(_) => return false,
            None => host,
        }
    };
    let name = name.strip_suffix('.').unwrap_or(name);
    name.eq_ignore_ascii_case("localhost")
        || name.parse::<Ipv4Addr>().is_ok_and(|a| a.is_loopback())
}

fn valid_port(p: Option<&str>) -> bool {
    p.is_some_and(|p| !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit()))
}

/// The CORS layer: allowed origins get their origin echoed back.
pub fn cors(origins: Origins) -> CorsLayer {
    let origins = Arc::new(origins);
    CorsLayer::new()
        .allow_origin(AllowOrigin::predicate(
            move |origin: &HeaderValue, _: &Parts| origin.to_str().is_ok_and(|o| origins.allows(o)),
        ))
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
        .max_age(std::time::Duration::from_secs(600))
}

/// Refuses requests from origins CORS does not allow and, when the server
/// checks hosts, requests addressed to a non-loopback name.
pub async fn check_request(
    State(state): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    if state.config.check_host {
        let host = req
            .headers()
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .map(str::to_string)
            .or_else(|| req.uri().authority().map(|a| a.to_string()));
        // A request without any host (HTTP/1.0) cannot come from a browser.
        if let Some(host) = host
            && !is_loopback_host(&host)
        {
            tracing::warn!("refused a request for host '{host}' (not a loopback name)");
            return Err(ApiError::forbidden(
                "invalid_host",
                format!(
                    "this server only answers requests addressed to localhost, 127.0.0.1 or [::1], not '{host}' \
                     (a keyless server on loopback refuses other names against DNS rebinding); \
                     start it with --api-key to accept other names"
                ),
            ));
        }
    }
    if let Some(origin) = req.headers().get(header::ORIGIN) {
        let o = origin.to_str().unwrap_or("");
        if !Origins::new(&state.config.cors_origins).allows(o) {
            tracing::warn!("refused a request from origin '{o}'");
            return Err(ApiError::forbidden(
                "origin_not_allowed",
                format!(
                    "requests from the web origin '{o}' are not allowed; only loopback origins are, \
                     unless the server is started with --cors-origin {o}"
                ),
            ));
        }
    }
    Ok(next.run(req).await)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_hosts() {
        for h in [
            "localhost",
            "LOCALHOST:8080",
            "localhost.:1",
            "127.0.0.1",
            "127.0.0.1:8080",
            "127.1.2.3:9",
            "[::1]",
            "[::1]:8080",
            "[::ffff:127.0.0.1]:80",
        ] {
            assert!(is_loopback_host(h), "{h}");
        }
        for h in [
            "evil.example",
            "evil.example:8080",
            "localhost.evil.example",
            "127.0.0.1.nip.io",
            "10.0.0.1:8080",
            "0.0.0.0:8080",
            "[::]:80",
            "[::1",
            "localhost:",
            "localhost:http",
            "",
        ] {
            assert!(!is_loopback_host(h), "{h}");
        }
    }

    #[test]
    fn origins() {
        let o = Origins::new(&["https://chat.example/".into()]);
        assert!(o.allows("http://localhost:3000"));
        assert!(o.allows("https://127.0.0.1"));
        assert!(o.allows("http://[::1]:5173"));
        assert!(o.allows("https://chat.example"));
        assert!(!o.allows("https://chat.example:444"));
        assert!(!o.allows("https://evil.example"));
        assert!(!o.allows("null"));
        assert!(!o.allows("file://"));
        assert!(!o.allows("http://localhost.evil.example"));
        assert!(Origins::new(&["*".into()]).allows("https://evil.example"));
    }
}
