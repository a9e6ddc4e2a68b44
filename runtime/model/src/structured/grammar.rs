//! A compiled grammar ([`Grammar`], per request) and one sequence's place in
//! it ([`Constraint`], per running sequence).
//!
//! The server compiles the grammar while it checks the request (a refused
//! schema is a 400, before any engine work) and the engine starts a fresh
//! [`Constraint`] from it at admission, so a request that is cloned or
//! retried never shares parser state with another run.

use super::{TokenMask, Vocabulary, grammar as err};
use crate::error::ModelError;
use llguidance::Matcher;
use llguidance::api::TopLevelGrammar;
use serde_json::Value;
use std::sync::{Arc, Mutex};

/// A grammar compiled over one model's vocabulary (cheap to clone: clones
/// share the compiled parser, and every [`Grammar::start`] deep-copies it).
#[derive(Clone)]
pub struct Grammar(Arc<Inner>);

struct Inner {
    /// The parser before any token; never advanced itself.
    fresh: Mutex<Matcher>,
    size: usize,
    eos: u32,
    lazy: Option<Lazy>,
    /// What it constrains, for logs and errors.
    what: String,
}

/// Where a lazy grammar applies: after each `trigger` token, until the
/// grammar completes; after `max_matches` completions only EOS may follow.
#[derive(Debug, Clone, Copy)]
struct Lazy {
    trigger: u32,
    max_matches: Option<usize>,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Grammar({})", self.0.what)
    }
}

impl Grammar {
    /// Output that is one JSON value valid against `schema` (OpenAI's
    /// `response_format: {"type": "json_schema"}`), with bounded whitespace. A
    /// schema the compiler cannot enforce is refused with its message.
    pub fn json_schema(vocab: &Vocabulary, schema: &Value) -> Result<Self, ModelError> {
        let g = TopLevelGrammar::from_json_schema(bounded_whitespace(schema)?);
        Self::compile(vocab, g, None, "a JSON schema")
    }

    /// Output that is one JSON object, any object (`{"type":
    /// "json_object"}`).
    pub fn json_object(vocab: &Vocabulary) -> Result<Self, ModelError> {
        let g = TopLevelGrammar::from_json_schema(bounded_whitespace(
            &serde_json::json!({ "type": "object" }),
        )?);
        Self::compile(vocab, g, None, "a JSON object")
    }

    /// The whole output follows the Lark grammar `source` (llguidance's
    /// dialect: `%json {schema}` embeds a JSON schema, `<[id]>` is one
    /// token by id).
    pub fn lark(vocab: &Vocabulary, source: &str, what: &str) -> Result<Self, ModelError> {
        Self::compile(
            vocab,
            TopLevelGrammar::from_lark(source.to_string()),
            None,
            what,
        )
    }

    /// Free output, except that after each `trigger` token what follows
    /// must match `source` (a Lark grammar that completes, e.g. at a
    /// closing token); after `max_matches` completions only EOS may
    /// follow (`parallel_tool_calls: false`).
    pub fn lazy_lark(
        vocab: &Vocabulary,
        trigger: u32,
        source: &str,
        max_matches: Option<usize>,
        what: &str,
    ) -> Result<Self, ModelError> {
        if trigger as usize >= vocab.size() {
            return Err(err(&format!(
                "trigger token {trigger} is outside the vocabulary of {}",
                vocab.size()
            )));
        }
        let lazy = Lazy {
            trigger,
            max_matches,
        };
        Self::compile(
            vocab,
            TopLevelGrammar::from_lark(source.to_string()),
            Some(lazy),
            what,
        )
    }

    fn compile(
        vocab: &Vocabulary,
        g: TopLevelGrammar,
        lazy: Option<Lazy>,
        what: &str,
    ) -> Result<Self, ModelError> {
        let parser = vocab
            .factory
            .create_parser(g)
            .map_err(|e| err(&e.to_string()))?;
        Ok(Grammar(Arc::new(Inner {
            fresh: Mutex::new(Matcher::new(Ok(parser))),
            size: vocab.size(),
            eos: vocab.eos(),
            lazy,
            what: what.to_string(),
        })))
    }

    /// The token that ends an output this grammar accepts.
    pub fn eos(&self) -> u32 {
        self.0.eos
    }

    /// A sequence's constraint, at the start of its output.
    pub fn start(&self) -> Constraint {
        let state = match self.0.lazy {
            Some(_) => State::Free,
            None => State::Active(Box::new(self.fresh_matcher())),
        };
        Constraint {
            grammar: self.clone(),
            state,
            matches: 0,
        }
    }

    fn fresh_matcher(&self) -> Matcher {
        // A poisoned lock only means another thread panicked while copying;
        // the parser itself is never advanced, so it is still fresh.
        let m = self.0.fresh.lock().unwrap_or_else(|p| p.into_inner());
        m.deep_clone()
    }
}

/// A Lark `%json` item for `schema`, whitespace bounded like [`Grammar::json_schema`]
/// (tool-call grammars embed each tool's argument schema with it).
pub fn lark_json(schema: &Value) -> Result<String, ModelError> {
    Ok(format!("%json {}", bounded_whitespace(schema)?))
}

/// JSON whitespace is at most one space where JSON allows whitespace (the
/// module docs say why); the engine's own `x-guidance` key is refused in a
/// client's schema.
fn bounded_whitespace(schema: &Value) -> Result<Value, ModelError> {
    let Value::Object(obj) = schema else {
        return Err(err("a JSON schema must be an object"));
    };
    if obj.contains_key("x-guidance") {
        return Err(err(
            "the schema's `x-guidance` key is the engine's own; remove it",
        ));
    }
    let mut schema = obj.clone();
    schema.insert(
        "x-guidance".into(),
        serde_json::json!({ "whitespace_flexible": true, "whitespace_pattern": "[ ]?" }),
    );
    Ok(Value::Object(schema))
}

/// One sequence's place in its grammar.
pub struct Constraint {
    grammar: Grammar,
    state: State,
    /// Completed matches of a lazy grammar.
    matches: usize,
}

enum State {
    /// Lazy, outside a match: any token.
    Free,
    /// Inside the grammar (the whole output, or a lazy match).
    Active(Box<Matcher>),
    /// Lazy, after its last allowed match: only EOS.
    Ended,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let state = match self.state {
            State::Free => "free",
            State::Active(_) => "active",
            State::Ended => "ended",
        };
        write!(f, "Constraint({:?}, {state})", self.grammar)
    }
}

impl Constraint {
    /// The tokens that may come next, or `None` when any token may (a
    /// lazy grammar outside its matches). EOS is allowed only where the
    /// grammar accepts.
    pub fn mask(&mut self) -> Result<Option<TokenMask>, ModelError> {
        let (size, eos) = (self.grammar.0.size, self.grammar.0.eos);
        match &mut self.state {
            State::Free => Ok(None),
            State::Ended => Ok(Some(TokenMask::only(size, eos))),
            State::Active(m) => {
                let v = m.compute_mask_or_eos().map_err(|e| err(&e.to_string()))?;
                // llguidance's vector has the same layout (bit t & 31 of
                // word t >> 5), possibly longer: copied, cut to the
                // vocabulary.
                let n = size.div_ceil(32);
                let mut words: Vec<u32> = v.as_slice().iter().copied().take(n).collect();
                words.resize(n, 0);
                if !size.is_multiple_of(32) {
                    words[n - 1] &= (1u32 << (size % 32)) - 1;
                }
                let mask = TokenMask { words, size };
                if mask.allowed_count() == 0 {
                    return Err(err(&format!(
                        "{} allows no token here (the grammar cannot continue)",
                        self.grammar.0.what
                    )));
                }
                Ok(Some(mask))
            }
        }
    }

    /// Moves past `token`, which the last mask allowed. A token it did not
    /// allow is an error: the sampler did not apply the mask. EOS where the
    /// grammar accepts ends the output and changes nothing.
    pub fn commit(&mut self, token: u32) -> Result<(), ModelError> {
        let Grammar(g) = &self.grammar;
        match &mut self.state {
            State::Free => {
                if g.lazy.is_some_and(|l| l.trigger == token) {
                    self.state = State::Active(Box::new(self.grammar.fresh_matcher()));
                }
                Ok(())
            }
            State::Ended if token == g.eos => Ok(()),
            State::Ended => Err(err(&format!(
                "token {token} after the last allowed match of {}; only EOS may follow",
                g.what
            ))),
            State::Active(m) => {
                if token == g.eos && g.lazy.is_none() && m.is_accepting().unwrap_or(false) {
                    return Ok(());
                }
                m.consume_token(token)
                    .map_err(|e| err(&format!("token {token} breaks {}: {e}", g.what)))?;
                if let Some(lazy) = g.lazy
                    && m.is_stopped()
                {
                    self.matches += 1;
                    self.state = match lazy.max_matches {
                        Some(n) if self.matches >= n => State::Ended,
                        _ => State::Free,
                    };
                }
                Ok(())
            }
        }
    }

    /// Whether the output so far is complete: a whole-output grammar
    /// accepts here, or a lazy one is outside a match.
    pub fn is_accepting(&mut self) -> bool {
        match &mut self.state {
            State::Free | State::Ended => true,
            State::Active(m) => self.grammar.0.lazy.is_none() && m.is_accepting().unwrap_or(false),
        }
    }

    /// Completed matches of a lazy grammar (0 for a whole-output one).
    pub fn matches(&self) -> usize {
        self.matches
    }
}
