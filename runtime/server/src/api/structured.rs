//! Structured output (issue 18): the request's `response_format` and its
//! forced or lazily triggered tool calls as a grammar the engine enforces
//! while it samples (`krasis_model::structured`).
//!
//! - `response_format: {"type": "json_object"}`: one JSON object.
//! - `{"type": "json_schema", "json_schema": {"schema": {...}}}`: one JSON
//!   value valid against the schema, always enforced (`strict` true or
//!   false alike: the server never returns output its grammar did not
//!   allow). A schema feature the compiler cannot enforce is a 400 that
//!   names it.
//! - Tool calls: the family's [`ToolGrammar::constraint`] (Hermes JSON,
//!   Qwen3-Coder XML, GLM-4.5 XML, harmony): `required` and a named
//!   function constrain the output after the forced prefix to complete
//!   calls of declared tools with arguments valid against each tool's
//!   schema; `auto` constrains each call the model opens by itself (after
//!   the family's trigger token; harmony: the turn's messages, whose text
//!   stays free).
//! - `response_format` with tools under `auto`: the answer is the JSON or
//!   the model calls tools (a forced call has no answer to format).
//! - Harmony (gpt-oss) keeps its reasoning free; the JSON is its `final`
//!   message ([`ToolGrammar::answer_constraint`]).
//!
//! JSON whitespace is bounded (at most one space): a random-weight model
//! could otherwise write whitespace until its token budget runs out.

use crate::error::ApiError;
use crate::output::tools::{Forced, ToolConstraint, ToolGrammar, ToolSet};
use crate::state::LoadedModel;
use krasis_model::structured::{Grammar, lark_json};
use serde_json::Value;

/// The `response_format` types the server accepts (the capability report
/// lists them).
pub const RESPONSE_FORMATS: [&str; 3] = ["text", "json_object", "json_schema"];

/// What `response_format` asks for (checked before any work; compiled on
/// the blocking pool by [`ResponseFormat::compile`]).
#[derive(Debug, Clone, PartialEq)]
pub enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema(Value),
}

impl ResponseFormat {
    /// Parses `response_format` (absent or null: text).
    pub fn parse(v: Option<&Value>) -> Result<Self, ApiError> {
        let Some(v) = v.filter(|v| !v.is_null()) else {
            return Ok(ResponseFormat::Text);
        };
        let bad = |msg: &str| ApiError::invalid_param("response_format", msg.to_string());
        let kind = v
            .get("type")
            .and_then(Value::as_str)
            .ok_or_else(|| bad("response_format must be an object with a string \"type\""))?;
        match kind {
            "text" => Ok(ResponseFormat::Text),
            "json_object" => Ok(ResponseFormat::JsonObject),
            "json_schema" => {
                let schema = v
                    .pointer("/json_schema/schema")
                    .ok_or_else(|| {
                        bad("response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}")
                    })?;
                if !schema.is_object() {
                    return Err(bad(
                        "response_format.json_schema.schema must be a JSON object",
                    ));
                }
                Ok(ResponseFormat::JsonSchema(schema.clone()))
            }
            other => Err(ApiError::unsupported(
                "response_format",
                format!(
                    "response_format type '{other}' is not supported; use one of {}",
                    RESPONSE_FORMATS.join(", ")
                ),
            )),
        }
    }

    pub fn is_text(&self) -> bool {
        *self == ResponseFormat::Text
    }

    /// The answer as a Lark item (`%json`), for grammars that embed it
    /// (an answer or tool calls; harmony's `final` channel); `None` for
    /// text.
    pub fn answer_lark(&self) -> Result<Option<String>, ApiError> {
        let any = serde_json::json!({ "type": "object" });
        let schema = match self {
            ResponseFormat::Text => return Ok(None),
            ResponseFormat::JsonObject => &any,
            ResponseFormat::JsonSchema(s) => s,
        };
        lark_json(schema).map(Some).map_err(|e| {
            ApiError::invalid_param(
                "response_format",
                format!("this JSON schema cannot be enforced: {e}"),
            )
        })
    }

    /// The grammar over `model`'s vocabulary (`None` for text). Blocking.
    pub fn compile(&self, model: &LoadedModel) -> Result<Option<Grammar>, ApiError> {
        let schema = match self {
            ResponseFormat::Text => return Ok(None),
            ResponseFormat::JsonObject => None,
            ResponseFormat::JsonSchema(s) => Some(s),
        };
        let vocab = model.vocabulary()?;
        let g = match schema {
            None => Grammar::json_object(&vocab),
            Some(s) => Grammar::json_schema(&vocab, s),
        };
        g.map(Some).map_err(|e| {
            ApiError::invalid_param(
                "response_format",
                format!("this JSON schema cannot be enforced: {e}"),
            )
        })
    }
}

/// The request's grammar, from its `response_format` and its tool calls
/// (`tools`: the family, how calls are forced, the declared tools; `None`
/// with `tool_choice: "none"` or no tools). `family`: the model's tool-call
/// grammar, which wraps a JSON answer in its own markup where it has one
/// (harmony's `final` channel). `None`: nothing constrains the output.
/// Blocking (compiles over the vocabulary).
///
/// A `response_format` schema is compiled alone only where the output's
/// grammar does not embed it (a forced call: the schema is still checked)
/// or where that grammar fails, so a feature the compiler refuses is named
/// as the response format's fault, not the tools'.
pub fn request_grammar(
    model: &LoadedModel,
    format: &ResponseFormat,
    family: Option<&dyn ToolGrammar>,
    tools: Option<(&Forced, &ToolSet)>,
    parallel: bool,
) -> Result<Option<Grammar>, ApiError> {
    let answer = format.answer_lark()?;
    let tok = &model.tokenizer;
    let (family, c) = match (family, tools) {
        (Some(f), Some((forced, set))) => {
            let c = f
                .constraint(forced, set, parallel, answer.as_deref(), tok)
                .map_err(|e| ApiError::invalid_param("tools", e))?;
            if c.is_none() && answer.is_some() {
                return Err(ApiError::unsupported(
                    "response_format",
                    format!(
                        "response_format with tools needs the {} tool calls constrained, which \
                         this model's vocabulary does not allow; send tool_choice \"none\" with it",
                        f.name()
                    ),
                ));
            }
            if !matches!(forced, Forced::Auto) {
                // Only `auto` embeds the answer; a forced call has none,
                // but a schema the compiler refuses is still a 400.
                format.compile(model)?;
            }
            (f, c)
        }
        (Some(f), None) => match answer.as_deref().map(|a| f.answer_constraint(a, tok)) {
            Some(Some(c)) => (f, Some(c)),
            // A family that wraps its answer but cannot here: the plain
            // JSON grammar would forbid its own markup.
            Some(None) if f.whole_output() => {
                return Err(ApiError::unsupported(
                    "response_format",
                    format!(
                        "response_format needs the {} markers as tokens of this model's \
                         vocabulary, which lacks them",
                        f.name()
                    ),
                ));
            }
            _ => return format.compile(model),
        },
        (None, _) => return format.compile(model),
    };
    let Some(c) = c else { return Ok(None) };
    let vocab = model.vocabulary()?;
    let what = format!("{} output", family.name());
    let g = match c {
        ToolConstraint::Whole(lark) => Grammar::lark(&vocab, &lark, &what),
        ToolConstraint::Lazy { trigger, lark } => {
            Grammar::lazy_lark(&vocab, trigger, &lark, (!parallel).then_some(1), &what)
        }
    };
    g.map(Some).map_err(|e| {
        if answer.is_some()
            && let Err(format_fault) = format.compile(model)
        {
            return format_fault;
        }
        ApiError::invalid_param(
            "tools",
            format!("the tools' parameter schemas cannot be enforced: {e}"),
        )
    })
}

/// A grammar's output must be able to end: refused with `ignore_eos`
/// (which drops the EOS the grammar ends on).
pub fn check_can_end(grammar: &Option<Grammar>, ignore_eos: bool) -> Result<(), ApiError> {
    if grammar.is_some() && ignore_eos {
        return Err(ApiError::invalid_param(
            "ignore_eos",
            "ignore_eos cannot be combined with response_format or a constrained tool call: \
             the constrained output ends on the model's end-of-sequence token",
        ));
    }
    Ok(())
}
