//! Request bodies as real clients send them. Unknown fields are ignored;
//! fields we cannot honour are refused with a 400 naming them.

use crate::error::ApiError;
use krasis_model::SamplingParams;
use serde::Deserialize;
use serde_json::{Map, Value};

#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// Fields shared by chat and text completions.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CommonParams {
    pub model: Option<String>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub max_tokens: Option<i64>,
    pub stop: Option<StopField>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub seed: Option<i64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub n: Option<i64>,
    pub logit_bias: Option<Map<String, Value>>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    #[serde(flatten)]
    pub common: CommonParams,
    pub messages: Vec<Value>,
    pub max_completion_tokens: Option<i64>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    pub response_format: Option<Value>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    #[serde(flatten)]
    pub common: CommonParams,
    pub prompt: Value,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<i64>,
    pub logprobs: Option<i64>,
}

fn in_range(param: &str, v: Option<f64>, lo: f64, hi: f64) -> Result<(), ApiError> {
    match v {
        Some(x) if !(lo..=hi).contains(&x) || x.is_nan() => Err(ApiError::invalid_param(
            param,
            format!("{param} is {x}; it must be between {lo} and {hi}"),
        )),
        _ => Ok(()),
    }
}

impl CommonParams {
    /// Refuses what we cannot honour and checks value ranges.
    pub fn validate(&self) -> Result<(), ApiError> {
        if let Some(n) = self.n
            && n != 1
        {
            return Err(ApiError::unsupported(
                "n",
                format!("n={n} is not supported: this server returns exactly one choice"),
            ));
        }
        if self.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
            return Err(ApiError::unsupported(
                "logit_bias",
                "logit_bias is not supported by this server",
            ));
        }
        if let Some(r) = self.repetition_penalty
            && r != 1.0
        {
            return Err(ApiError::unsupported(
                "repetition_penalty",
                "repetition_penalty is not supported; use presence_penalty or frequency_penalty",
            ));
        }
        in_range("temperature", self.temperature, 0.0, 2.0)?;
        in_range("top_p", self.top_p, 0.0, 1.0)?;
        if self.top_p == Some(0.0) {
            return Err(ApiError::invalid_param(
                "top_p",
                "top_p must be greater than 0",
            ));
        }
        in_range("min_p", self.min_p, 0.0, 1.0)?;
        in_range("presence_penalty", self.presence_penalty, -2.0, 2.0)?;
        in_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)?;
        if let Some(k) = self.top_k
            && k < -1
        {
            return Err(ApiError::invalid_param(
                "top_k",
                format!("top_k is {k}; use a positive value, or 0 / -1 to disable it"),
            ));
        }
        Ok(())
    }

    pub fn sampling(&self, defaults: &SamplingParams) -> SamplingParams {
        SamplingParams {
            temperature: self
                .temperature
                .map(|t| t as f32)
                .unwrap_or(defaults.temperature),
            top_k: match self.top_k {
                Some(k) if k > 0 => k as usize,
                Some(_) => 0,
                None => defaults.top_k,
            },
            top_p: self.top_p.map(|p| p as f32).unwrap_or(defaults.top_p),
            min_p: self.min_p.map(|p| p as f32).unwrap_or(defaults.min_p),
            // Negative seeds are valid in the API; their bits are the seed.
            seed: self.seed.map(|s| s as u64).or(defaults.seed),
            presence_penalty: self.presence_penalty.unwrap_or(0.0) as f32,
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0) as f32,
        }
    }

    pub fn stop_strings(&self) -> Vec<String> {
        match &self.stop {
            None => Vec::new(),
            Some(StopField::One(s)) => vec![s.clone()],
            Some(StopField::Many(v)) => v.clone(),
        }
    }

    pub fn stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false)
    }

    /// Checks the requested model against the one served.
    pub fn check_model(&self, served: &str) -> Result<(), ApiError> {
        match self.model.as_deref() {
            None | Some("") => Ok(()),
            Some(m) if m == served => Ok(()),
            Some(m) => Err(ApiError::model_not_found(m, served)),
        }
    }
}

/// `max_tokens` (or chat's `max_completion_tokens`) checked against the room
/// the context leaves after the prompt.
pub fn max_new_tokens(
    requested: Option<i64>,
    param: &str,
    prompt_tokens: usize,
    context: usize,
) -> Result<usize, ApiError> {
    if prompt_tokens >= context {
        return Err(ApiError::invalid_param(
            "messages",
            format!(
                "the prompt has {prompt_tokens} tokens but the model's context holds {context} tokens (prompt plus output); shorten the prompt"
            ),
        ));
    }
    let room = context - prompt_tokens;
    match requested {
        None => Ok(room),
        Some(n) if n < 1 => Err(ApiError::invalid_param(
            param,
            format!("{param} is {n}; it must be at least 1"),
        )),
        Some(n) => Ok((n as usize).min(room)),
    }
}
