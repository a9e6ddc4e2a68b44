//! `POST /v1/chat/completions`: admission -> request -> rendered and
//! tokenized prompt (on the blocking pool) -> queued job.

use super::extract::read_json;
use super::request::{ChatRequest, PromptKind, max_new_tokens, requested_tokens};
use super::response::{self, ResponseMeta, Shape};
use super::structured::{self, ResponseFormat};
use super::{admit, messages, off_thread, origin, submit};
use crate::error::ApiError;
use crate::output::OutputParser;
use crate::output::tools::{Forced, ToolParser, ToolSet};
use crate::state::{AppState, LoadedModel};
use axum::extract::{Request, State};
use axum::response::Response;
use krasis_model::GenerateRequest;
use krasis_model::chat_template::RenderOptions;
use serde_json::{Value, json};
use std::sync::Arc;

/// How tools are used for one request.
struct ToolPlan {
    /// Tools handed to the template (`None`: the template sees no tools).
    for_template: Option<Vec<Value>>,
    parser: Option<Box<dyn ToolParser>>,
    /// Prompt continuation that starts a forced call.
    forced_prefix: Option<String>,
    /// What the calls' grammar is built from (`structured::request_grammar`).
    constrain: Option<(Forced, Arc<ToolSet>)>,
}

pub async fn chat_completions(
    State(state): State<Arc<AppState>>,
    http: Request,
) -> Result<Response, ApiError> {
    let model = state.model()?;
    // Before the body is read: a full server does no work for the request.
    let slot = admit(&model)?;
    let origin = origin("/v1/chat/completions", &http);
    let mut req: ChatRequest = read_json(http).await?;
    req.common.validate()?;
    super::request::refuse_unknown(&req.extra)?;
    req.common.check_model(&state.config.model_id)?;
    check_unsupported(&req)?;
    let legacy = map_legacy_functions(&mut req)?;
    if model.template.is_none() {
        return Err(ApiError::bad_request(
            "this model has no chat template, so chat completions are not available; use /v1/completions with a raw prompt",
        ));
    }
    let (param, requested) = match req.max_completion_tokens {
        Some(n) => ("max_completion_tokens", Some(n)),
        None => ("max_tokens", req.common.max_tokens),
    };
    let requested = requested_tokens(requested, param)?;
    let plan = plan_tools(&req, &model)?;
    let format = ResponseFormat::parse(req.common.response_format.as_ref())?;
    let parallel = !legacy && req.parallel_tool_calls != Some(false);
    let ignore_eos = req.common.ignore_eos == Some(true);
    let opts = RenderOptions {
        add_generation_prompt: true,
        tools: plan.for_template.clone(),
        extra: template_kwargs(&mut req)?,
    };
    let raw_messages = std::mem::take(&mut req.messages);
    let forced_prefix = plan.forced_prefix.clone();
    let constrain = plan.constrain.clone();
    let m = model.clone();
    let (slot, prompt_ids, max_new, opens_reasoning, constraint) = off_thread(move || {
        // The grammar first: a schema it refuses costs no rendering.
        let tools = constrain
            .as_ref()
            .map(|(forced, set)| (forced, set.as_ref()));
        let family = m.grammar.as_deref();
        let constraint = structured::request_grammar(&m, &format, family, tools, parallel)?;
        structured::check_can_end(&constraint, ignore_eos)?;
        let msgs = messages::normalize(&raw_messages)?;
        drop(raw_messages);
        let template = m
            .template
            .as_ref()
            .ok_or_else(|| ApiError::internal("the chat template disappeared while rendering"))?;
        let mut prompt = template.render(&msgs, &opts).map_err(|e| {
            ApiError::bad_request(format!("the chat template rejected these messages: {e}"))
        })?;
        drop(msgs);
        let mut opens_reasoning = prompt.trim_end().ends_with("<think>");
        // A forced call, or JSON output, skips (closes) any reasoning the
        // template opened: the grammar starts at the first token.
        let json = !format.is_text();
        if (forced_prefix.is_some() || json) && opens_reasoning {
            prompt.push_str("\n</think>\n\n");
            opens_reasoning = false;
        }
        if let Some(prefix) = &forced_prefix {
            prompt.push_str(prefix);
        }
        let context = m.info.context_length;
        // Refuse what cannot fit before paying for tokenizing megabytes.
        let at_least = m.tokenizer.min_tokens(&prompt);
        max_new_tokens(PromptKind::Messages, requested, at_least, true, context)?;
        let ids = m
            .tokenizer
            .encode(&prompt)
            .map_err(|e| ApiError::internal(format!("tokenizing the prompt failed: {e}")))?;
        let max_new = max_new_tokens(PromptKind::Messages, requested, ids.len(), false, context)?;
        Ok((slot, ids, max_new, opens_reasoning, constraint))
    })
    .await?;

    let mut parser = match model.grammar.as_ref().filter(|g| g.whole_output()) {
        // Harmony: channels carry the reasoning, so its parser reads every
        // response, with no functions to call when none were declared.
        Some(g) => OutputParser::whole(
            plan.parser
                .unwrap_or_else(|| g.parser(Arc::new(ToolSet::default()))),
        ),
        None => OutputParser::new(opens_reasoning, plan.parser),
    };
    if let Some(prefix) = &plan.forced_prefix {
        // The forced opening is part of the call the parser must see; a
        // streamed call may start in it (the XML and harmony openings
        // name the tool).
        parser.prime(prefix);
    }
    let gen_req = GenerateRequest {
        prompt: prompt_ids,
        max_new_tokens: max_new,
        sampling: req.common.sampling(&state.config.default_sampling),
        stop_token_ids: req.common.stop_token_ids(model.tokenizer.eos_token_ids()),
        cancel: Default::default(),
        live: Default::default(),
        cache_prompt: req.common.cache_prompt(),
        constraint,
    };
    // Legacy function calling has one call per message.
    let max_calls = (legacy || req.parallel_tool_calls == Some(false)).then_some(1);
    let job = submit(&model, slot, gen_req, req.common.stop_strings(), origin)?;
    let meta = ResponseMeta::new(
        "chatcmpl",
        &state.config.model_id,
        req.common.include_usage(),
    );
    let shape = Shape::Chat {
        parser,
        max_calls,
        legacy,
    };
    Ok(if req.common.stream() {
        response::stream(job, meta, shape)
    } else {
        response::collect(job, meta, shape).await?
    })
}

/// Legacy function calling (`functions`, `function_call`) becomes `tools`
/// and `tool_choice`; the answer then uses the legacy shape too
/// (`message.function_call`, `finish_reason: "function_call"`). True when
/// the request used it.
fn map_legacy_functions(req: &mut ChatRequest) -> Result<bool, ApiError> {
    if req.functions.is_none() && req.function_call.is_none() {
        return Ok(false);
    }
    if req.tools.is_some() || req.tool_choice.is_some() {
        return Err(ApiError::invalid_param(
            "functions",
            "send either tools and tool_choice or the legacy functions and function_call, not both",
        ));
    }
    let functions = req.functions.take().unwrap_or_default();
    let mut tools = Vec::with_capacity(functions.len());
    for (i, f) in functions.into_iter().enumerate() {
        if f.get("name").and_then(Value::as_str).is_none() {
            return Err(ApiError::invalid_param(
                format!("functions[{i}]"),
                format!(
                    "functions[{i}] must be {{\"name\": ..., \"parameters\": ...}} (or use tools)"
                ),
            ));
        }
        tools.push(json!({"type": "function", "function": f}));
    }
    let choice = match req.function_call.take() {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s == "none" || s == "auto" => Some(Value::String(s)),
        Some(Value::Object(o)) if o.get("name").is_some_and(Value::is_string) => Some(json!({
            "type": "function",
            "function": {"name": o["name"]},
        })),
        Some(other) => {
            return Err(ApiError::invalid_param(
                "function_call",
                format!(
                    "function_call must be \"none\", \"auto\" or {{\"name\": ...}}, not {other}"
                ),
            ));
        }
    };
    if tools.is_empty() && choice.as_ref().is_some_and(|c| c != "none") {
        return Err(ApiError::invalid_param(
            "function_call",
            "function_call requires functions, but the request declares none",
        ));
    }
    req.tools = (!tools.is_empty()).then_some(tools);
    req.tool_choice = choice;
    Ok(true)
}

/// Reasoning efforts the gpt-oss template knows (it writes `Reasoning: X`).
const REASONING_EFFORTS: [&str; 3] = ["low", "medium", "high"];

/// `chat_template_kwargs` plus `reasoning_effort`, which the template reads
/// as a variable of that name.
fn template_kwargs(req: &mut ChatRequest) -> Result<serde_json::Map<String, Value>, ApiError> {
    let mut kwargs = req.chat_template_kwargs.take().unwrap_or_default();
    let Some(effort) = req.reasoning_effort.take().filter(|v| !v.is_null()) else {
        return Ok(kwargs);
    };
    if !effort
        .as_str()
        .is_some_and(|e| REASONING_EFFORTS.contains(&e))
    {
        return Err(ApiError::invalid_param(
            "reasoning_effort",
            format!(
                "reasoning_effort is {effort}; it must be one of {}",
                REASONING_EFFORTS.join(", ")
            ),
        ));
    }
    match kwargs.get("reasoning_effort") {
        Some(k) if *k != effort => Err(ApiError::invalid_param(
            "reasoning_effort",
            format!(
                "reasoning_effort is {effort} but chat_template_kwargs.reasoning_effort is {k}; send one"
            ),
        )),
        _ => {
            kwargs.insert("reasoning_effort".into(), effort);
            Ok(kwargs)
        }
    }
}

fn check_unsupported(req: &ChatRequest) -> Result<(), ApiError> {
    if req.logprobs == Some(true) || req.top_logprobs.is_some_and(|n| n > 0) {
        return Err(ApiError::unsupported(
            "logprobs",
            "logprobs are not supported by this server",
        ));
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
        constrain: None,
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
    let set = Arc::new(ToolSet::from_openai(&tools));
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
            "this model's chat template teaches no tool-call grammar this server can parse (supported: Qwen hermes JSON, Qwen3-Coder XML, gpt-oss harmony, GLM-4.5 XML), so tools cannot be used with it",
        )
    })?;
    Ok(ToolPlan {
        for_template: Some(tools),
        parser: Some(grammar.parser(set.clone())),
        forced_prefix: grammar.forced_prefix(&forced),
        constrain: Some((forced, set)),
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
