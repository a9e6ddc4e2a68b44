//! Chat templates rendered the way transformers' `apply_chat_template`
//! renders them (Jinja with trim_blocks/lstrip_blocks, Python string
//! methods, `raise_exception`, `strftime_now`, Python-compatible `tojson`),
//! so prompts are byte-identical to what the model saw in training.

mod load;
mod qwen3;
mod tojson;

use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::Value as Json;

pub use qwen3::{
    QWEN3_CHAT_TEMPLATE, QWEN3_CODER_CHAT_TEMPLATE, qwen3_generation_config, qwen3_tokenizer_config,
};
pub use tojson::{DumpOptions, dumps as python_json_dumps, python_float_repr};

use crate::error::ModelError;

/// Per-request rendering options.
#[derive(Debug, Clone, Default)]
pub struct RenderOptions {
    pub add_generation_prompt: bool,
    pub tools: Option<Vec<Json>>,
    /// `chat_template_kwargs` such as `enable_thinking`, passed as top-level
    /// template variables.
    pub extra: serde_json::Map<String, Json>,
}

const DEFAULT_NAME: &str = "default";
const TOOL_USE_NAME: &str = "tool_use";
/// Variables the renderer sets itself; `extra` may not shadow them.
const RESERVED: &[&str] = &["messages", "tools", "add_generation_prompt", "documents"];

/// A compiled chat template (plus the optional `tool_use` variant that
/// transformers picks when tools are passed).
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    has_tool_use: bool,
    bos: Option<String>,
    eos: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("has_tool_use", &self.has_tool_use)
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish()
    }
}

fn new_env() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_keep_trailing_newline(false);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_filter("tojson", tojson::tojson_filter);
    // minijinja iterates `none` as empty, Python does not: official
    // templates guard `tools | length` with `tools is iterable`.
    env.add_test("iterable", |v: Value| !v.is_none() && v.try_iter().is_ok());
    // Jinja2's Undefined has length 0 (`message.tool_calls | length` on a
    // message without the key); minijinja would error.
    let length = |v: Value| -> Result<usize, Error> {
        if v.is_undefined() {
            Ok(0)
        } else {
            minijinja::filters::length(&v)
        }
    };
    env.add_filter("length", length);
    env.add_filter("count", length);
    env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, msg))
    });
    env.add_function("strftime_now", |fmt: String| -> Result<String, Error> {
        use std::fmt::Write as _;
        let mut out = String::new();
        // chrono panics in `to_string` on a bad format; `write!` reports it.
        write!(out, "{}", chrono::Local::now().format(&fmt)).map_err(|_| {
            Error::new(
                ErrorKind::InvalidOperation,
                format!("strftime_now: invalid format string '{fmt}'"),
            )
        })?;
        Ok(out)
    });
    env
}

/// A minijinja error as `ModelError::Template`: the template's own message
/// (verbatim for `raise_exception`) and where it happened.
fn template_error(err: &Error) -> ModelError {
    let msg = match (err.kind(), err.detail()) {
        (ErrorKind::InvalidOperation, Some(d)) => d.to_string(),
        (kind, Some(d)) => format!("{kind}: {d}"),
        (kind, None) => kind.to_string(),
    };
    let mut loc = String::new();
    if let Some(line) = err.line() {
        loc = format!(" (template '{}' line {line})", err.name().unwrap_or("chat"));
    }
    ModelError::Template(format!("{msg}{loc}"))
}

impl ChatTemplate {
    /// Compile `src`. `bos`/`eos` become the `bos_token`/`eos_token`
    /// variables (left undefined when `None`, as transformers does).
    pub fn from_source(
        src: &str,
        bos: Option<String>,
        eos: Option<String>,
    ) -> Result<Self, ModelError> {
        Self::build(src.to_string(), None, bos, eos)
    }

    fn build(
        default: String,
        tool_use: Option<String>,
        bos: Option<String>,
        eos: Option<String>,
    ) -> Result<Self, ModelError> {
        let mut env = new_env();
        env.add_template_owned(DEFAULT_NAME, default.clone())
            .map_err(|e| template_error(&e))?;
        let has_tool_use = tool_use.is_some();
        if let Some(t) = tool_use {
            env.add_template_owned(TOOL_USE_NAME, t)
                .map_err(|e| template_error(&e))?;
        }
        Ok(Self {
            env,
            source: default,
            has_tool_use,
            bos,
            eos,
        })
    }

    /// Load from a Hugging Face model directory: `chat_template.jinja` if
    /// present (newer transformers save it there and it wins), else
    /// `tokenizer_config.json`'s `chat_template`. `Ok(None)` when neither
    /// has one.
    pub fn from_dir(dir: &std::path::Path) -> Result<Option<Self>, ModelError> {
        let Some(found) = load::find(dir)? else {
            return Ok(None);
        };
        Self::build(found.default, found.tool_use, found.bos, found.eos).map(Some)
    }

    /// The default template's source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether a separate `tool_use` template exists (used when tools are passed).
    pub fn has_tool_use(&self) -> bool {
        self.has_tool_use
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos.as_deref()
    }

    /// Render a conversation (OpenAI/transformers message objects).
    pub fn render(&self, messages: &[Json], opts: &RenderOptions) -> Result<String, ModelError> {
        if let Some(k) = opts.extra.keys().find(|k| RESERVED.contains(&k.as_str())) {
            return Err(ModelError::Template(format!(
                "chat_template_kwargs may not set '{k}'; it is set from the request itself"
            )));
        }
        let name = if opts.tools.is_some() && self.has_tool_use {
            TOOL_USE_NAME
        } else {
            DEFAULT_NAME
        };
        let tmpl = self
            .env
            .get_template(name)
            .map_err(|e| template_error(&e))?;
        let mut ctx: std::collections::BTreeMap<String, Value> = Default::default();
        if let Some(b) = &self.bos {
            ctx.insert("bos_token".into(), Value::from(b.as_str()));
        }
        if let Some(e) = &self.eos {
            ctx.insert("eos_token".into(), Value::from(e.as_str()));
        }
        for (k, v) in &opts.extra {
            ctx.insert(k.clone(), Value::from_serialize(v));
        }
        ctx.insert("messages".into(), Value::from_serialize(messages));
        ctx.insert(
            "tools".into(),
            opts.tools
                .as_ref()
                .map_or(Value::from(()), Value::from_serialize),
        );
        ctx.insert("documents".into(), Value::from(()));
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(opts.add_generation_prompt),
        );
        tmpl.render(ctx).map_err(|e| template_error(&e))
    }
}

/// OpenAI clients send `tool_calls[].function.arguments` as a JSON string,
/// while templates such as Qwen3-Coder iterate it as a mapping. This parses
/// string arguments into objects in place (what vLLM does before
/// rendering); arguments that are not valid JSON are refused.
pub fn parse_tool_call_arguments(messages: &mut [Json]) -> Result<(), ModelError> {
    for (mi, m) in messages.iter_mut().enumerate() {
        let Some(calls) = m.get_mut("tool_calls").and_then(Json::as_array_mut) else {
            continue;
        };
        for (ci, call) in calls.iter_mut().enumerate() {
            let Some(args) = call
                .get_mut("function")
                .and_then(|f| f.get_mut("arguments"))
            else {
                continue;
            };
            if let Json::String(s) = args {
                *args = serde_json::from_str(s).map_err(|e| {
                    ModelError::Template(format!(
                        "messages[{mi}].tool_calls[{ci}].function.arguments is not valid JSON: {e}"
                    ))
                })?;
            }
        }
    }
    Ok(())
}
