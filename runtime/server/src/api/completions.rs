//! `POST /v1/completions`: a raw prompt (text or token ids), no template.

use super::extract::JsonBody;
use super::request::{CompletionRequest, max_new_tokens};
use super::response::{self, ResponseMeta, Shape};
use super::submit;
use crate::error::ApiError;
use crate::state::AppState;
use axum::extract::State;
use axum::response::Response;
use krasis_model::GenerateRequest;
use krasis_model::tokenizer::Tokenizer;
use serde_json::Value;
use std::sync::Arc;

pub async fn completions(
    State(state): State<Arc<AppState>>,
    JsonBody(req): JsonBody<CompletionRequest>,
) -> Result<Response, ApiError> {
    req.common.validate()?;
    req.common.check_model(&state.config.model_id)?;
    if req.echo == Some(true) {
        return Err(ApiError::unsupported(
            "echo",
            "echo is not supported by this server",
        ));
    }
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::unsupported(
            "suffix",
            "suffix (fill-in-the-middle) is not supported by this server",
        ));
    }
    if req.best_of.is_some_and(|b| b != 1) {
        return Err(ApiError::unsupported(
            "best_of",
            "best_of other than 1 is not supported",
        ));
    }
    if req.logprobs.is_some_and(|l| l > 0) {
        return Err(ApiError::unsupported(
            "logprobs",
            "logprobs are not supported by this server",
        ));
    }
    let model = state.model()?;
    let prompt = prompt_ids(&req.prompt, &model.tokenizer)?;
    if prompt.is_empty() {
        return Err(ApiError::invalid_param("prompt", "the prompt is empty"));
    }
    let vocab = model.info.vocab_size;
    if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid_param(
            "prompt",
            format!("token id {bad} is outside the vocabulary of {vocab}"),
        ));
    }
    let max_new = max_new_tokens(
        req.common.max_tokens,
        "max_tokens",
        prompt.len(),
        model.info.context_length,
    )
    .map_err(|mut e| {
        if e.param.as_deref() == Some("messages") {
            e.param = Some("prompt".into());
        }
        e
    })?;
    let gen_req = GenerateRequest {
        prompt,
        max_new_tokens: max_new,
        sampling: req.common.sampling(&state.config.default_sampling),
        stop_token_ids: model.tokenizer.eos_token_ids().to_vec(),
        cancel: Default::default(),
    };
    let job = submit(&model, gen_req, req.common.stop_strings())?;
    let meta = ResponseMeta::new("cmpl", &state.config.model_id, req.common.include_usage());
    Ok(if req.common.stream() {
        response::stream(job, meta, Shape::Text)
    } else {
        response::collect(job, meta, Shape::Text).await?
    })
}

/// A string, a one-element list of strings, a token list, or a one-element
/// list of token lists (batches of several prompts are refused).
fn prompt_ids(p: &Value, tok: &Tokenizer) -> Result<Vec<u32>, ApiError> {
    let encode = |s: &str| {
        tok.encode(s)
            .map_err(|e| ApiError::internal(format!("tokenizing the prompt failed: {e}")))
    };
    let ids = |arr: &[Value]| -> Option<Vec<u32>> {
        arr.iter()
            .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect()
    };
    match p {
        Value::String(s) => encode(s),
        Value::Array(items) if items.iter().all(Value::is_number) => ids(items).ok_or_else(|| {
            ApiError::invalid_param("prompt", "token ids must be non-negative integers")
        }),
        Value::Array(items) if items.len() == 1 => prompt_ids(&items[0], tok),
        Value::Array(items) if items.len() > 1 => Err(ApiError::unsupported(
            "prompt",
            format!(
                "a batch of {} prompts is not supported; send one prompt per request",
                items.len()
            ),
        )),
        _ => Err(ApiError::invalid_param(
            "prompt",
            "prompt must be a string, a list of token ids, or a list with one of those",
        )),
    }
}
