//! Request bodies as real clients send them. Every field is either
//! honoured or refused with a 400 naming it: a field this server does not
//! know is refused too (an ignored sampling or output option would silently
//! change what the client gets), except the few OpenAI fields that by their
//! definition do not change the response ([`NO_EFFECT`]).

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
    /// llama.cpp's name: `false` bypasses the engine's prefix cache (the
    /// prompt is prefilled cold and nothing of it is kept); default true.
    pub cache_prompt: Option<bool>,
    /// vLLM's and llama.cpp's benchmarking extension: `true` keeps
    /// generating past the model's end-of-sequence tokens until the token
    /// budget (or a stop string) ends it.
    pub ignore_eos: Option<bool>,
    /// vLLM's extension (end-of-sequence masked until this many tokens):
    /// not implemented, so refused unless 0.
    pub min_tokens: Option<i64>,
    /// `{"type": "text" | "json_object" | "json_schema"}`: the output
    /// constrained to JSON (`api/structured.rs`), on chat and text
    /// completions alike.
    pub response_format: Option<Value>,
}

/// OpenAI request fields that by their definition do not change the
/// response of a local server, accepted and not acted on: `user` and
/// `safety_identifier` (who the end user is, for abuse monitoring),
/// `metadata` (tags for stored completions), `prompt_cache_key` (a routing
/// hint for the provider's prompt cache; this server's cache keys on the
/// tokens). `store`, `service_tier` and `modalities` are accepted only with
/// the values that ask for nothing (`false`; `auto`/`default`; `["text"]`).
pub const NO_EFFECT: [&str; 4] = ["user", "safety_identifier", "metadata", "prompt_cache_key"];

/// Refuses the fields of a request body that no typed field took (`extra`),
/// except the [`NO_EFFECT`] ones and the no-op values of `store`,
/// `service_tier` and `modalities`.
pub fn refuse_unknown(extra: &Map<String, Value>) -> Result<(), ApiError> {
    for (name, value) in extra {
        let harmless = NO_EFFECT.contains(&name.as_str())
            || match name.as_str() {
                "store" => matches!(value, Value::Bool(false) | Value::Null),
                "service_tier" => {
                    matches!(value.as_str(), Some("auto" | "default")) || value.is_null()
                }
                "modalities" => *value == serde_json::json!(["text"]) || value.is_null(),
                _ => false,
            };
        if !harmless {
            let what = match name.as_str() {
                "store" | "service_tier" | "modalities" => format!(
                    "{name}={value} is not supported by this server (it accepts store=false, \
                     service_tier auto/default and modalities [\"text\"])"
                ),
                _ => format!(
                    "unknown parameter {name:?}: this server does not implement it, and an \
                     ignored parameter could change the response you expect; remove it from \
                     the request (the README lists the supported parameters)"
                ),
            };
            return Err(ApiError::unsupported(name.clone(), what));
        }
    }
    Ok(())
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatRequest {
    #[serde(flatten)]
    pub common: CommonParams,
    /// Every field no typed field took; see [`refuse_unknown`].
    #[serde(flatten)]
    pub extra: Map<String, Value>,
    pub messages: Vec<Value>,
    pub max_completion_tokens: Option<i64>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// Passed to the chat template as its `reasoning_effort` variable (the
    /// gpt-oss template writes it into the system message).
    pub reasoning_effort: Option<Value>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    /// Legacy (pre-tools) function calling, mapped onto `tools`.
    pub functions: Option<Vec<Value>>,
    pub function_call: Option<Value>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    #[serde(flatten)]
    pub common: CommonParams,
    /// Every field no typed field took; see [`refuse_unknown`].
    #[serde(flatten)]
    pub extra: Map<String, Value>,
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

/// OpenAI's limits on `stop`: up to 4 sequences; empty ones are refused
/// (they would match before any output), long ones bounded so matching
/// stays cheap per token.
pub const MAX_STOPS: usize = 4;
pub const MAX_STOP_BYTES: usize = 256;

impl CommonParams {
    /// Refuses what we cannot honour and checks value ranges.
    pub fn validate(&self) -> Result<(), ApiError> {
        let stops = self.stop_strings();
        if stops.len() > MAX_STOPS {
            return Err(ApiError::invalid_param(
                "stop",
                format!(
                    "stop has {} sequences; at most {MAX_STOPS} are allowed",
                    stops.len()
                ),
            ));
        }
        if let Some(i) = stops.iter().position(String::is_empty) {
            return Err(ApiError::invalid_param(
                "stop",
                format!("stop sequence {i} is empty; stop sequences must be non-empty strings"),
            ));
        }
        if let Some(i) = stops.iter().position(|s| s.len() > MAX_STOP_BYTES) {
            return Err(ApiError::invalid_param(
                "stop",
                format!(
                    "stop sequence {i} is {} bytes long; at most {MAX_STOP_BYTES} bytes are allowed",
                    stops[i].len()
                ),
            ));
        }
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
        if let Some(n) = self.min_tokens
            && n != 0
        {
            return Err(ApiError::unsupported(
                "min_tokens",
                format!(
                    "min_tokens={n} is not supported by this server (only 0); use ignore_eos=true \
                     with max_tokens to get a fixed number of tokens"
                ),
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

    /// The token ids that end generation: the model's end-of-sequence
    /// tokens, or none with `ignore_eos`.
    pub fn stop_token_ids(&self, eos: &[u32]) -> Vec<u32> {
        if self.ignore_eos.unwrap_or(false) {
            Vec::new()
        } else {
            eos.to_vec()
        }
    }

    /// Whether the request may use the prefix cache (`cache_prompt`).
    pub fn cache_prompt(&self) -> bool {
        self.cache_prompt.unwrap_or(true)
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

/// Whose tokens a context check counts, for OpenAI's wording.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptKind {
    /// Chat: `param` is "messages".
    Messages,
    /// Text completions: `param` is "prompt".
    Prompt,
}

impl PromptKind {
    fn param(self) -> &'static str {
        match self {
            PromptKind::Messages => "messages",
            PromptKind::Prompt => "prompt",
        }
    }
}

/// The explicit output budget of a request (`max_tokens`, or chat's
/// `max_completion_tokens`), checked to be at least 1.
pub fn requested_tokens(requested: Option<i64>, param: &str) -> Result<Option<usize>, ApiError> {
    match requested {
        None => Ok(None),
        Some(n) if n < 1 => Err(ApiError::invalid_param(
            param,
            format!("{param} is {n}; it must be at least 1"),
        )),
        Some(n) => Ok(Some(usize::try_from(n).unwrap_or(usize::MAX))),
    }
}

/// The output budget of a prompt of `prompt_tokens` (or, with `at_least`,
/// of at least that many): the room left in the context when no budget was
/// asked for, else the budget asked for. A prompt that leaves no room for
/// one token, or an explicit budget that does not fit beside the prompt, is
/// refused as OpenAI (and vLLM) do, with `context_length_exceeded` and the
/// numbers, rather than silently given fewer tokens than asked for.
pub fn max_new_tokens(
    kind: PromptKind,
    requested: Option<usize>,
    prompt_tokens: usize,
    at_least: bool,
    context: usize,
) -> Result<usize, ApiError> {
    let completion = requested.unwrap_or(1);
    if prompt_tokens.saturating_add(completion) <= context {
        return Ok(requested.unwrap_or(context - prompt_tokens));
    }
    let whose = kind.param();
    let least = if at_least { "at least " } else { "" };
    let message = if requested.is_none() && prompt_tokens > context {
        format!(
            "This model's maximum context length is {context} tokens. However, your {whose} resulted in {least}{prompt_tokens} tokens. Please reduce the length of the {whose}."
        )
    } else {
        format!(
            "This model's maximum context length is {context} tokens. However, you requested {least}{} tokens ({least}{prompt_tokens} in the {whose}, {completion} in the completion). Please reduce the length of the {whose} or completion.",
            prompt_tokens.saturating_add(completion)
        )
    };
    Err(ApiError::context_length_exceeded(whose, message))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_checks_use_openai_wording() {
        let m = PromptKind::Messages;
        assert_eq!(max_new_tokens(m, None, 10, false, 64).unwrap(), 54);
        assert_eq!(max_new_tokens(m, Some(54), 10, false, 64).unwrap(), 54);
        let e = max_new_tokens(m, Some(55), 10, false, 64).unwrap_err();
        assert_eq!(e.code, Some("context_length_exceeded"));
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert_eq!(
            e.message,
            "This model's maximum context length is 64 tokens. However, you requested 65 tokens (10 in the messages, 55 in the completion). Please reduce the length of the messages or completion."
        );
        let e = max_new_tokens(m, None, 100, false, 64).unwrap_err();
        assert_eq!(
            e.message,
            "This model's maximum context length is 64 tokens. However, your messages resulted in 100 tokens. Please reduce the length of the messages."
        );
        // A prompt that fills the context leaves no room for one token.
        let e = max_new_tokens(m, None, 64, false, 64).unwrap_err();
        assert!(
            e.message
                .contains("you requested 65 tokens (64 in the messages, 1 in the completion)"),
            "{}",
            e.message
        );
        let e = max_new_tokens(PromptKind::Prompt, None, 5000, true, 64).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
        assert!(
            e.message
                .contains("your prompt resulted in at least 5000 tokens"),
            "{}",
            e.message
        );
        assert!(requested_tokens(Some(0), "max_tokens").is_err());
    }

    fn chat(body: serde_json::Value) -> ChatRequest {
        serde_json::from_value(body).expect("a chat request")
    }

    #[test]
    fn unknown_fields_are_refused_by_name_and_no_effect_ones_accepted() {
        let base = serde_json::json!({"messages": [], "max_tokens": 4, "temperature": 0.5});
        let with = |k: &str, v: serde_json::Value| {
            let mut b = base.clone();
            b[k] = v;
            chat(b)
        };
        // Typed fields never reach `extra`, also those of the flattened common part.
        let r = with("cache_prompt", serde_json::json!(false));
        assert!(r.extra.is_empty(), "{:?}", r.extra);
        assert!(refuse_unknown(&r.extra).is_ok());
        for (k, v) in [
            ("user", serde_json::json!("u-1")),
            ("metadata", serde_json::json!({"a": "b"})),
            ("store", serde_json::json!(false)),
            ("service_tier", serde_json::json!("auto")),
            ("modalities", serde_json::json!(["text"])),
            ("prompt_cache_key", serde_json::json!("k")),
        ] {
            assert!(refuse_unknown(&with(k, v.clone()).extra).is_ok(), "{k}={v}");
        }
        for (k, v) in [
            ("typical_p", serde_json::json!(0.5)),
            ("store", serde_json::json!(true)),
            ("service_tier", serde_json::json!("flex")),
            ("modalities", serde_json::json!(["text", "audio"])),
            (
                "prediction",
                serde_json::json!({"type": "content", "content": "x"}),
            ),
        ] {
            let e = refuse_unknown(&with(k, v.clone()).extra).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(k), "{k}={v}");
            assert_eq!(e.code, Some("unsupported_parameter"));
            assert!(e.message.contains(k), "{}", e.message);
        }
    }

    #[test]
    fn ignore_eos_drops_the_stop_tokens_and_min_tokens_is_refused() {
        let r = chat(serde_json::json!({"messages": [], "ignore_eos": true}));
        assert!(r.common.stop_token_ids(&[7, 9]).is_empty());
        let r = chat(serde_json::json!({"messages": []}));
        assert_eq!(r.common.stop_token_ids(&[7, 9]), vec![7, 9]);
        let r = chat(serde_json::json!({"messages": [], "min_tokens": 0}));
        assert!(r.common.validate().is_ok());
        let r = chat(serde_json::json!({"messages": [], "min_tokens": 8}));
        let e = r.common.validate().unwrap_err();
        assert_eq!(e.param.as_deref(), Some("min_tokens"));
    }
}
