//! Server state. The server answers `/health` from the moment it binds; the
//! model is installed once loading finishes, and API calls made before that
//! get a 503 saying what phase the server is in. After an engine fault the
//! state is failed for good (`/health` 503 `error`) and [`AppState::engine_fault`]
//! resolves, which is how [`crate::serve`] knows to exit.

use crate::error::ApiError;
use crate::output::tools::{ToolGrammar, detect_grammar};
use crate::stats::SharedStats;
use crate::worker::Worker;
use krasis_common::status::{EngineStats, Health, HealthStatus, Phase};
use krasis_model::chat_template::ChatTemplate;
use krasis_model::structured::Vocabulary;
use krasis_model::tokenizer::Tokenizer;
use krasis_model::{Engine, EngineInfo, SamplingParams};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use tokio::sync::watch;

/// Static server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The model id clients use (`/v1/models`, the `model` field).
    pub model_id: String,
    /// "cuda" or "reference", for `/health` before the engine exists.
    pub backend: String,
    /// Bearer token required on `/v1/*` when set.
    pub api_key: Option<String>,
    /// Requests allowed to wait while `parallel` run; more get 503.
    pub queue_depth: usize,
    /// The most requests the engine runs together (`--parallel`); `None`:
    /// the engine's batch capacity ([`crate::worker::parallel_for`]).
    pub parallel: Option<usize>,
    /// Sampling used for fields a request leaves out.
    pub default_sampling: SamplingParams,
    /// Web origins allowed besides loopback ones (`http://localhost:*`,
    /// `127.0.0.1`, `[::1]`): exact origins such as `https://chat.example`,
    /// or `*` for any. Requests from other origins are refused (403).
    pub cors_origins: Vec<String>,
    /// Refuse requests whose `Host` is not a loopback name (DNS-rebinding
    /// defence). [`ServerConfig::needs_host_check`] says when: a keyless
    /// server bound to a loopback address.
    pub check_host: bool,
    /// How long a shutdown waits for the engine thread once requests are
    /// cancelled ([`crate::DRAIN`]; longer when the engine writes the
    /// prefix cache's file on its way out).
    pub stop_limit: std::time::Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            model_id: "model".into(),
            backend: "reference".into(),
            api_key: None,
            queue_depth: 16,
            parallel: None,
            default_sampling: SamplingParams::default(),
            cors_origins: Vec::new(),
            check_host: true,
            stop_limit: crate::DRAIN,
        }
    }
}

impl ServerConfig {
    /// A keyless server on loopback trusts whoever reaches it, so it must
    /// only be reached by loopback names: a web page whose domain was
    /// rebound to 127.0.0.1 sends its own domain as `Host`. A server with a
    /// key, or bound publicly on purpose, is reached by other names.
    pub fn needs_host_check(bind: std::net::IpAddr, api_key: Option<&str>) -> bool {
        api_key.is_none() && bind.is_loopback()
    }
}

/// Everything a request needs from the loaded model.
pub struct LoadedModel {
    pub tokenizer: Arc<Tokenizer>,
    /// `None`: the checkpoint ships no chat template (completions only).
    pub template: Option<ChatTemplate>,
    /// Tool-call grammar taught by the template, if this build knows it.
    pub grammar: Option<Arc<dyn ToolGrammar>>,
    pub info: EngineInfo,
    pub worker: Worker,
    /// The vocabulary grammars are compiled over (structured output),
    /// built by the first request that needs one (~0.4 s for Qwen's
    /// 151,669 tokens), on the blocking pool.
    pub vocab: OnceLock<Result<Arc<Vocabulary>, String>>,
}

impl LoadedModel {
    /// [`LoadedModel::vocab`], built on first use. Blocking: call it from
    /// the blocking pool.
    pub fn vocabulary(&self) -> Result<Arc<Vocabulary>, ApiError> {
        self.vocab
            .get_or_init(|| {
                Vocabulary::new(&self.tokenizer)
                    .map(Arc::new)
                    .map_err(|e| e.to_string())
            })
            .clone()
            .map_err(|e| {
                ApiError::internal(format!(
                    "this model's vocabulary cannot be used for constrained output: {e}"
                ))
            })
    }
}

/// Phase and failure, shared with the engine thread (which reports faults).
struct Lifecycle {
    phase: Mutex<(Phase, Option<String>)>,
    /// The reason, once the engine faulted.
    fault: watch::Sender<Option<String>>,
    stopping: AtomicBool,
}

impl Lifecycle {
    fn set(&self, phase: Phase, reason: Option<String>) {
        let mut p = self.phase.lock().unwrap_or_else(|e| e.into_inner());
        *p = (phase, reason);
    }

    fn get(&self) -> (Phase, Option<String>) {
        self.phase
            .lock()
            .map(|p| p.clone())
            .unwrap_or((Phase::Failed, None))
    }
}

pub struct AppState {
    pub config: ServerConfig,
    life: Arc<Lifecycle>,
    model: OnceLock<Arc<LoadedModel>>,
    pub stats: Arc<SharedStats>,
}

impl AppState {
    pub fn new(config: ServerConfig) -> Arc<Self> {
        Arc::new(AppState {
            config,
            life: Arc::new(Lifecycle {
                phase: Mutex::new((Phase::Loading, None)),
                fault: watch::Sender::new(None),
                stopping: AtomicBool::new(false),
            }),
            model: OnceLock::new(),
            stats: Arc::new(SharedStats::default()),
        })
    }

    /// Reports a startup phase (loading, building_cache, calibrating).
    pub fn set_phase(&self, phase: Phase) {
        let (p, reason) = self.life.get();
        if p != Phase::Failed {
            self.life.set(phase, reason);
        }
    }

    pub fn phase(&self) -> Phase {
        self.life.get().0
    }

    /// Loading failed: `/health` answers 503 `error` with the reason.
    pub fn set_failed(&self, reason: String) {
        self.life.set(Phase::Failed, Some(reason));
    }

    /// Starts the engine thread and begins serving requests. A `parallel`
    /// the engine cannot run is refused (`InvalidInput`, with the reason).
    pub fn install(
        &self,
        mut engine: Box<dyn Engine>,
        tokenizer: Arc<Tokenizer>,
        template: Option<ChatTemplate>,
    ) -> std::io::Result<()> {
        let parallel = crate::worker::parallel_for(engine.as_mut(), self.config.parallel)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let info = engine.info();
        let grammar = template.as_ref().and_then(|t| detect_grammar(t.source()));
        let life = self.life.clone();
        let worker = Worker::spawn(
            engine,
            tokenizer.clone(),
            self.config.queue_depth,
            parallel,
            self.stats.clone(),
            Box::new(move |reason: String| {
                life.set(Phase::Failed, Some(format!("engine fault: {reason}")));
                life.fault.send_replace(Some(reason));
            }),
        )?;
        let model = Arc::new(LoadedModel {
            tokenizer,
            template,
            grammar,
            info,
            worker,
            vocab: Default::default(),
        });
        if self.model.set(model).is_err() {
            return Err(std::io::Error::other("a model is already installed"));
        }
        self.set_phase(Phase::Ready);
        Ok(())
    }

    /// The loaded, working model, or the 503 that says why there is none.
    pub fn model(&self) -> Result<Arc<LoadedModel>, ApiError> {
        if self.life.stopping.load(Ordering::Relaxed) {
            return Err(ApiError::overloaded("the server is shutting down", 5));
        }
        let (phase, reason) = self.life.get();
        match (phase, self.model.get()) {
            (Phase::Failed, Some(_)) => Err(ApiError::overloaded(
                format!(
                    "the engine failed ({}) and serves no more requests; the server is exiting so it can be restarted",
                    reason.unwrap_or_else(|| "see the server log".into())
                ),
                10,
            )),
            (_, Some(m)) => Ok(m.clone()),
            (Phase::Failed, None) => Err(ApiError::overloaded(
                format!(
                    "the model failed to load: {}",
                    reason.unwrap_or_else(|| "see the server log".into())
                ),
                60,
            )),
            (other, None) => Err(ApiError::overloaded(
                format!(
                    "the model is not ready yet (phase: {}); retry shortly",
                    phase_name(other)
                ),
                5,
            )),
        }
    }

    /// Readiness: `ok` only while the model serves requests.
    pub fn health(&self) -> Health {
        let loaded = self.model.get();
        let (phase, reason) = self.life.get();
        let stopping = self.life.stopping.load(Ordering::Relaxed);
        let (status, error) = match phase {
            Phase::Failed => (
                HealthStatus::Error,
                Some(reason.unwrap_or_else(|| "failed; see the server log".into())),
            ),
            Phase::Ready if stopping => (
                HealthStatus::Error,
                Some("the server is shutting down".into()),
            ),
            Phase::Ready if loaded.is_some() => (HealthStatus::Ok, None),
            _ => (HealthStatus::Loading, None),
        };
        Health {
            status,
            error,
            phase,
            model_loaded: loaded.is_some(),
            model: Some(self.config.model_id.clone()),
            backend: loaded
                .map(|m| m.info.backend.clone())
                .unwrap_or_else(|| self.config.backend.clone()),
        }
    }

    pub fn engine_stats(&self) -> EngineStats {
        self.stats.snapshot()
    }

    /// Resolves with the reason once the engine faults (never otherwise).
    pub async fn engine_fault(&self) -> String {
        let mut rx = self.life.fault.subscribe();
        let reason = rx
            .wait_for(Option::is_some)
            .await
            .map(|r| r.clone().unwrap_or_default());
        match reason {
            Ok(r) => r,
            // The sender lives as long as `self`.
            Err(_) => std::future::pending().await,
        }
    }

    /// Begins shutdown: new requests get 503, the running generation is
    /// cancelled and queued ones fail at once.
    pub fn stop(&self) {
        self.life.stopping.store(true, Ordering::Relaxed);
        if let Some(m) = self.model.get() {
            m.worker.stop();
        }
    }

    /// Resolves once the engine thread has stopped (at once without a model).
    pub async fn engine_stopped(&self) {
        if let Some(m) = self.model.get() {
            m.worker.stopped().await;
        }
    }
}

pub fn phase_name(p: Phase) -> &'static str {
    match p {
        Phase::Loading => "loading",
        Phase::BuildingCache => "building_cache",
        Phase::Calibrating => "calibrating",
        Phase::Ready => "ready",
        Phase::Failed => "failed",
    }
}
