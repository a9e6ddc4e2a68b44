//! Server state. The server answers `/health` from the moment it binds; the
//! model is installed once loading finishes, and API calls made before that
//! get a 503 saying what phase the server is in.

use crate::error::ApiError;
use crate::output::tools::{ToolGrammar, detect_grammar};
use crate::worker::{SharedStats, Worker};
use krasis_common::status::{EngineStats, Health, Phase};
use krasis_model::chat_template::ChatTemplate;
use krasis_model::tokenizer::Tokenizer;
use krasis_model::{Engine, EngineInfo, SamplingParams};
use std::sync::{Arc, Mutex, OnceLock};

/// Static server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The model id clients use (`/v1/models`, the `model` field).
    pub model_id: String,
    /// "cuda" or "reference", for `/health` before the engine exists.
    pub backend: String,
    /// Bearer token required on `/v1/*` when set.
    pub api_key: Option<String>,
    /// Requests allowed to wait while one runs; more get 503.
    pub queue_depth: usize,
    /// Sampling used for fields a request leaves out.
    pub default_sampling: SamplingParams,
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
}

pub struct AppState {
    pub config: ServerConfig,
    phase: Mutex<(Phase, Option<String>)>,
    model: OnceLock<Arc<LoadedModel>>,
    pub stats: Arc<SharedStats>,
}

impl AppState {
    pub fn new(config: ServerConfig) -> Arc<Self> {
        Arc::new(AppState {
            config,
            phase: Mutex::new((Phase::Loading, None)),
            model: OnceLock::new(),
            stats: Arc::new(SharedStats::default()),
        })
    }

    /// Reports a startup phase (loading, building_cache, calibrating).
    pub fn set_phase(&self, phase: Phase) {
        if let Ok(mut p) = self.phase.lock() {
            p.0 = phase;
        }
    }

    pub fn phase(&self) -> Phase {
        self.phase.lock().map(|p| p.0).unwrap_or(Phase::Failed)
    }

    /// Loading failed: the server keeps answering `/health` with the reason.
    pub fn set_failed(&self, reason: String) {
        if let Ok(mut p) = self.phase.lock() {
            *p = (Phase::Failed, Some(reason));
        }
    }

    /// Starts the engine thread and begins serving requests.
    pub fn install(
        &self,
        engine: Box<dyn Engine>,
        tokenizer: Arc<Tokenizer>,
        template: Option<ChatTemplate>,
    ) -> std::io::Result<()> {
        let info = engine.info();
        let grammar = template.as_ref().and_then(|t| detect_grammar(t.source()));
        let worker = Worker::spawn(
            engine,
            tokenizer.clone(),
            self.config.queue_depth,
            self.stats.clone(),
        )?;
        let model = Arc::new(LoadedModel {
            tokenizer,
            template,
            grammar,
            info,
            worker,
        });
        if self.model.set(model).is_err() {
            return Err(std::io::Error::other("a model is already installed"));
        }
        self.set_phase(Phase::Ready);
        Ok(())
    }

    /// The loaded model, or the 503 that says why there is none yet.
    pub fn model(&self) -> Result<Arc<LoadedModel>, ApiError> {
        if let Some(m) = self.model.get() {
            return Ok(m.clone());
        }
        let (phase, reason) = self
            .phase
            .lock()
            .map(|p| p.clone())
            .unwrap_or((Phase::Failed, None));
        Err(match phase {
            Phase::Failed => ApiError::overloaded(
                format!(
                    "the model failed to load: {}",
                    reason.unwrap_or_else(|| "see the server log".into())
                ),
                60,
            ),
            other => ApiError::overloaded(
                format!(
                    "the model is not ready yet (phase: {}); retry shortly",
                    phase_name(other)
                ),
                5,
            ),
        })
    }

    pub fn health(&self) -> Health {
        let loaded = self.model.get();
        Health {
            // Placeholder until readiness is reported truthfully (issue 11).
            status: krasis_common::status::HealthStatus::Ok,
            error: None,
            phase: self.phase(),
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
