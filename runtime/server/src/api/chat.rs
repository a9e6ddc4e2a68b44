//! `POST /v1/chat/completions`: request -> rendered prompt -> queued job.

use super::extract::JsonBody;
use super::request::{ChatRequest, max_new_tokens};
use super::response::{self, ResponseMeta, Shape};
use super::{messages, submit};
use crate::error::ApiError;
use crate::output::OutputParser;
use crate::output::tools::{Forced, ToolParser, ToolSet};
use crate::state::{AppState, LoadedModel};
use axum::extract::State;
use axum::response::Response;
use krasis_model::GenerateRequest;
use krasis_model::chat_template::RenderOptions;
use serde_json::Value;
use std::sync::Arc;

/// How tools are used for one request.
struct ToolPlan {
    /// Tools handed to the template (`None`: the template sees no tools).
    for_template: Option<Vec<Value>>,
    parser: Option<Box<dyn ToolParser>>,
    /// Prompt continuation that starts a forced call.
    forced_prefix: Option<String>,
}

pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    JsonBody(req): JsonBody<ChatRequest>,
) -> Result<Response, ApiError> {
    req.common.validate()?;
    req.common.check_model(&state.config.model_id)?;
    check_unsupported(&req)?;
    let model = state.model()?;
    let template = model.template.as_ref().ok_or_else(|| {
        ApiError::bad_request(
            "this model has no chat template, so chat completions are not available; use /v1/completions with a raw prompt",
        )
    })?;
    let msgs = messages::normalize(&req.messages)?;
    let plan = plan_tools(&req, &model)?;
    let extra = req.chat_template_kwargs.clone().unwrap_or_default();
    let opts = RenderOptions {
        add_generation_prompt: true,
        tools: plan.for_template.clone(),
        extra,
    };
    let mut prompt = template.render(&msgs, &opts).map_err(|e| {
        ApiError::bad_request(format!("the chat template rejected these messages: {e}"))
    })?;
    let mut opens_reasoning = prompt.trim_end().ends_with("<think>");
    if let Some(prefix) = &plan.forced_prefix {
        // A forced call skips (closes) any reasoning the template opened.
        if opens_reasoning {
            prompt.push_str("\n</think>\n\n");
            opens_reasoning = false;
        }
        prompt.push_str(prefix);
    }
    let prompt_ids = model
        .tokenizer
        .encode(&prompt)
        .map_err(|e| ApiError::internal(format!("tokenizing the prompt failed: {e}")))?;
    let (param, requested) = match req.max_completion_tokens {
        Some(n) => ("max_completion_tokens", Some(n)),
        None => ("max_tokens", req.common.max_tokens),
    };
    let max_new = max_new_tokens(
        requested,
        param,
        prompt_ids.len(),
        model.info.context_length,
    )?;

    let mut parser = OutputParser::new(opens_reasoning, plan.parser);
    if let Some(prefix) = &plan.forced_prefix {
        // The forced opening is part of the call the parser must see.
        let early = parser.push(prefix);
        debug_assert!(early.is_empty());
    }
    let gen_req = GenerateRequest {
        prompt: prompt_ids,
        max_new_tokens: max_new,
        sampling: req.common.sampling(&state.config.default_sampling),
        stop_token_ids: model.tokenizer.eos_token_ids().to_vec(),
        cancel: Default::default(),
    };
    let max_calls = (req.parallel_tool_calls == Some(false)).then_some(1);
    let job = submit(&model, gen_req, req.common.stop_strings())?;
    let meta = ResponseMeta::new(
        "chatcmpl",
        &state.config.model_id,
        req.common.include_usage(),
    );
    let shape = Shape::Chat { parser, max_calls };
    Ok(if req.common.stream() {
        response::stream(job, meta, shape)
    } else {
        response::collect(job, meta, shape).await?
    })
}

fn check_unsupported(req: &ChatRequest) -> Result<(), ApiError> {
    if req.logprobs == Some(true) || req.top_logprobs.is_some_and(|n| n > 0) {
        return Err(ApiError::unsupported(
            "logprobs",
            "logprobs are not supported by this server",
        ));
    }
    if let Some(rf) = &req.response_format {
        let kind = rf.get("type").and_then(Value::as_str).unwrap_or("");
        if !rf.is_null() && kind != "text" {
            return Err(ApiError::unsupported(
                "response_format",
                format!(
                    "response_format type '{kind}' is not supported (no constrained decoding); only 'text' is"
                ),
            ));
        }
    }
    Ok(())
}

fn plan_tools(req: &ChatRequest, model: &LoadedModel) -> Result<ToolPlan, ApiError> {
    let tools = req.tools.clone().unwrap_or_default();
    let choice = parse_tool_choice(req.tool_choice.as_ref())?;
    let none = ToolPlan {
        for_template: None,
        parser: None,
        forced_prefix: None,
    };
    let forced = match choice {
        Choice::None => return Ok(none),
        Choice::Auto if tools.is_empty() => return Ok(none),
        _ if tools.is_empty() => {
            return Err(ApiError::invalid_param(
                "tool_choice",
                "tool_choice requires a tool, but the request declares no tools",
            ));
        }
        Choice::Auto => Forced::Auto,
        Choice::Required => Forced::Required,
        Choice::Named(n) => Forced::Named(n),
    };
    for (i, t) in tools.iter().enumerate() {
        let ok = t.get("type").and_then(Value::as_str) == Some("function")
            && t.pointer("/function/name")
                .and_then(Value::as_str)
                .is_some();
        if !ok {
            return Err(ApiError::invalid_param(
                format!("tools[{i}]"),
                format!(
                    "tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., \"parameters\": ...}}}}"
                ),
            ));
        }
    }
    let set = ToolSet::from_openai(&tools);
    if let Forced::Named(name) = &forced
        && !set.contains(name)
    {
        return Err(ApiError::invalid_param(
            "tool_choice",
            format!(
                "tool_choice names '{name}', which is not among the declared tools ({})",
                set.names().collect::<Vec<_>>().join(", ")
            ),
        ));
    }
    let grammar = model.grammar.as_ref().ok_or_else(|| {
        ApiError::unsupported(
            "tools",
            "this model's chat template teaches no tool-call grammar this server can parse (supported: Qwen hermes JSON, Qwen3-Coder XML), so tools cannot be used with it",
        )
    })?;
    Ok(ToolPlan {
        for_template: Some(tools),
        parser: Some(grammar.parser(Arc::new(set))),
        forced_prefix: grammar.forced_prefix(&forced),
    })
}

enum Choice {
    None,
    Auto,
    Required,
    Named(String),
}

fn parse_tool_choice(v: Option<&Value>) -> Result<Choice, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(Choice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "none" => Ok(Choice::None),
            "auto" => Ok(Choice::Auto),
            "required" | "any" => Ok(Choice::Required),
            other => Err(ApiError::invalid_param(
                "tool_choice",
                format!("tool_choice '{other}' is not one of none, auto, required"),
            )),
        },
        Some(obj) => obj
            .pointer("/function/name")
            .and_then(Value::as_str)
            .map(|n| Choice::Named(n.to_string()))
            .ok_or_else(|| {
                ApiError::invalid_param(
                    "tool_choice",
                    "tool_choice object must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                )
            }),
    }
}
