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
//!   Qwen3-Coder XML, GLM-4.5 XML; harmony when forced): `required` and a named function constrain the output after the
//!   forced prefix to complete calls of declared tools with arguments valid
//!   against each tool's schema; `auto` constrains each call the model opens
//!   by itself (after the family's trigger token), text stays free.
//!
//! JSON whitespace is bounded (at most one space): a random-weight model
//! could otherwise write whitespace until its token budget runs out.

use crate::error::ApiError;
use crate::output::tools::{Forced, ToolConstraint, ToolGrammar, ToolSet};
use crate::state::LoadedModel;
use krasis_model::structured::Grammar;
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

/// The grammar of the request's tool calls (`None`: the family has no
/// constraint for this `forced` mode yet; the calls are then parsed as
/// written). Blocking.
pub fn tool_grammar(
    model: &LoadedModel,
    grammar: &dyn ToolGrammar,
    forced: &Forced,
    tools: &ToolSet,
    parallel: bool,
) -> Result<Option<Grammar>, ApiError> {
    let tok = &model.tokenizer;
    let Some(c) = grammar
        .constraint(forced, tools, parallel, tok)
        .map_err(|e| ApiError::invalid_param("tools", e))?
    else {
        return Ok(None);
    };
    let vocab = model.vocabulary()?;
    let what = format!("{} tool calls", grammar.name());
    let g = match c {
        ToolConstraint::Whole(lark) => Grammar::lark(&vocab, &lark, &what),
        ToolConstraint::Lazy { trigger, lark } => {
            Grammar::lazy_lark(&vocab, trigger, &lark, (!parallel).then_some(1), &what)
        }
    };
    g.map(Some).map_err(|e| {
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
