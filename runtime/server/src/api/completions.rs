//! `POST /v1/completions`: a raw prompt (text or token ids), no template.

use super::extract::read_json;
use super::request::{CompletionRequest, PromptKind, max_new_tokens, requested_tokens};
use super::response::{self, ResponseMeta, Shape};
use super::structured::{ResponseFormat, check_can_end};
use super::{admit, off_thread, origin, submit};
use crate::error::ApiError;
use crate::state::AppState;
use axum::extract::{Request, State};
use axum::response::Response;
use krasis_model::GenerateRequest;
use krasis_model::tokenizer::Tokenizer;
use serde_json::Value;
use std::sync::Arc;

pub async fn completions(
    State(state): State<Arc<AppState>>,
    http: Request,
) -> Result<Response, ApiError> {
    let model = state.model()?;
    // Before the body is read: a full server does no work for the request.
    let slot = admit(&model)?;
    let origin = origin("/v1/completions", &http);
    let mut req: CompletionRequest = read_json(http).await?;
    req.common.validate()?;
    super::request::refuse_unknown(&req.extra)?;
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
    let requested = requested_tokens(req.common.max_tokens, "max_tokens")?;
    let format = ResponseFormat::parse(req.common.response_format.as_ref())?;
    let ignore_eos = req.common.ignore_eos == Some(true);
    let raw_prompt = std::mem::take(&mut req.prompt);
    let m = model.clone();
    let (slot, prompt, max_new, constraint) = off_thread(move || {
        let constraint = format.compile(&m)?;
        check_can_end(&constraint, ignore_eos)?;
        let context = m.info.context_length;
        let prompt = prompt_ids(raw_prompt, &m.tokenizer, requested, context)?;
        if prompt.is_empty() {
            return Err(ApiError::invalid_param("prompt", "the prompt is empty"));
        }
        let vocab = m.info.vocab_size;
        if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::invalid_param(
                "prompt",
                format!("token id {bad} is outside the vocabulary of {vocab}"),
            ));
        }
        let max_new = max_new_tokens(PromptKind::Prompt, requested, prompt.len(), false, context)?;
        Ok((slot, prompt, max_new, constraint))
    })
    .await?;
    let gen_req = GenerateRequest {
        prompt,
        max_new_tokens: max_new,
        sampling: req.common.sampling(&state.config.default_sampling),
        stop_token_ids: req.common.stop_token_ids(model.tokenizer.eos_token_ids()),
        cancel: Default::default(),
        live: Default::default(),
        cache_prompt: req.common.cache_prompt(),
        constraint,
    };
    let job = submit(&model, slot, gen_req, req.common.stop_strings(), origin)?;
    let meta = ResponseMeta::new("cmpl", &state.config.model_id, req.common.include_usage());
    Ok(if req.common.stream() {
        response::stream(job, meta, Shape::Text)
    } else {
        response::collect(job, meta, Shape::Text).await?
    })
}

/// A string, a one-element list of strings, a token list, or a one-element
/// list of token lists (batches of several prompts are refused). Text that
/// cannot fit the context even at the longest token per position is refused
/// before it is tokenized.
fn prompt_ids(
    p: Value,
    tok: &Tokenizer,
    requested: Option<usize>,
    context: usize,
) -> Result<Vec<u32>, ApiError> {
    let ids = |arr: &[Value]| -> Option<Vec<u32>> {
        arr.iter()
            .map(|v| v.as_u64().and_then(|n| u32::try_from(n).ok()))
            .collect()
    };
    match p {
        Value::String(s) => {
            let at_least = tok.min_tokens(&s);
            max_new_tokens(PromptKind::Prompt, requested, at_least, true, context)?;
            tok.encode(&s)
                .map_err(|e| ApiError::internal(format!("tokenizing the prompt failed: {e}")))
        }
        Value::Array(items) if items.iter().all(Value::is_number) => ids(&items).ok_or_else(|| {
            ApiError::invalid_param("prompt", "token ids must be non-negative integers")
        }),
        Value::Array(mut items) if items.len() == 1 => {
            prompt_ids(items.remove(0), tok, requested, context)
        }
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
