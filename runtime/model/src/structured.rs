//! Grammar-constrained decoding (issue 18): which tokens may come next so
//! that the output follows a grammar, computed over the model's own
//! vocabulary. This module is the core both engines will share: a
//! [`Vocabulary`] built once per model, a [`Constraint`] per request, and
//! the [`TokenMask`] a sampler applies before it draws.
//!
//! Why `llguidance`: it is the constraint engine llama.cpp and vLLM use,
//! written in Rust. It runs an Earley parser over a lexer and walks a trie of
//! the vocabulary's token bytes, so a mask costs microseconds where the
//! grammar is narrow. It compiles JSON schemas (with `$ref`) and Lark
//! grammars, which tool-call formats will need. Hand-writing that automaton
//! is what the issue asks us not to do.
//!
//! The trie comes from [`Tokenizer::token_bytes`]: byte-level BPE strings
//! mapped back to bytes. Added tokens (`<|im_end|>`, `<tool_call>`) are
//! marked special, so no grammar's text can spell them, and the model's EOS
//! ends a constrained output only where the grammar accepts.
//! `toktrie_hf_tokenizers` is not used: it pins another `tokenizers` version.
//!
//! JSON output is compact: no whitespace between tokens of the JSON text.
//! The grammar then leaves a model no way to wander. With whitespace
//! allowed, a random-weight model draws whitespace forever; a real one
//! rarely does, but a length cut-off would leave invalid JSON either way.

use crate::error::ModelError;
use crate::tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use std::sync::Arc;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

/// The model's vocabulary as the constraint engine sees it (built once per
/// model: ~0.1 s for the trie and ~0.3 s for the parser factory of Qwen's
/// 151,669 tokens).
pub struct Vocabulary {
    factory: Arc<ParserFactory>,
    size: usize,
}

/// llguidance's view of the tokenizer: the trie, and our own tokenizer for
/// the few places it turns text into tokens.
struct Env {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        // Bytes that are not UTF-8 have no tokenization of their own here;
        // the engine only asks for whole grammar literals, which are text.
        self.tokenizer
            .encode(&String::from_utf8_lossy(s))
            .unwrap_or_default()
    }
}

impl Vocabulary {
    /// The vocabulary of `tokenizer`, whose first EOS id ends an accepted
    /// output.
    pub fn new(tokenizer: &Tokenizer) -> Result<Self, ModelError> {
        let bytes = tokenizer.token_bytes()?;
        let size = bytes.len();
        let words: Vec<Vec<u8>> = bytes
            .into_iter()
            .map(|(b, added)| match added {
                true => [&[TokTrie::SPECIAL_TOKEN_MARKER][..], &b].concat(),
                false => b,
            })
            .collect();
        let eos = *tokenizer
            .eos_token_ids()
            .first()
            .ok_or_else(|| grammar("the tokenizer has no EOS token to end a constrained output"))?;
        let info = TokRxInfo {
            vocab_size: size as u32,
            tok_eos: eos,
            tok_bos: None,
            tok_pad: None,
            tok_unk: None,
            tok_end_of_turn: None,
        };
        let env: TokEnv = Arc::new(Env {
            trie: TokTrie::from(&info, &words),
            tokenizer: tokenizer.clone(),
        });
        let factory = ParserFactory::new_simple(&env).map_err(|e| grammar(&e.to_string()))?;
        Ok(Vocabulary {
            factory: Arc::new(factory),
            size,
        })
    }

    /// Token ids the masks cover (`0..size`).
    pub fn size(&self) -> usize {
        self.size
    }
}

/// One request's grammar and where its output is in it.
pub struct Constraint {
    matcher: Matcher,
    size: usize,
}

/// The tokens allowed next: a bitmask of `size` bits, bit `t % 32` of word
/// `t / 32` for token `t` (the layout a GPU sampler can read as is).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenMask {
    words: Vec<u32>,
    size: usize,
}

impl TokenMask {
    pub fn is_allowed(&self, token: u32) -> bool {
        (token as usize) < self.size && self.words[token as usize / 32] >> (token % 32) & 1 == 1
    }

    pub fn allowed_count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The allowed ids in increasing order.
    pub fn allowed(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.size as u32).filter(|&t| self.is_allowed(t))
    }

    pub fn words(&self) -> &[u32] {
        &self.words
    }
}

impl Constraint {
    /// Output that is one JSON value valid against `schema` (OpenAI's
    /// `response_format: {"type": "json_schema"}`), written compactly. A
    /// schema the compiler cannot enforce is refused with its message.
    pub fn json_schema(vocab: &Vocabulary, schema: &Value) -> Result<Self, ModelError> {
        let Value::Object(obj) = schema else {
            return Err(grammar("a JSON schema must be an object"));
        };
        let mut schema = obj.clone();
        if schema.contains_key("x-guidance") {
            return Err(grammar(
                "the schema's `x-guidance` key is the engine's own; remove it",
            ));
        }
        schema.insert(
            "x-guidance".into(),
            serde_json::json!({ "whitespace_flexible": false }),
        );
        Self::new(
            vocab,
            TopLevelGrammar::from_json_schema(Value::Object(schema)),
        )
    }

    /// Output that is one JSON object, any object (`{"type":
    /// "json_object"}`).
    pub fn json_object(vocab: &Vocabulary) -> Result<Self, ModelError> {
        Self::json_schema(vocab, &serde_json::json!({ "type": "object" }))
    }

    fn new(vocab: &Vocabulary, g: TopLevelGrammar) -> Result<Self, ModelError> {
        let parser = vocab
            .factory
            .create_parser(g)
            .map_err(|e| grammar(&e.to_string()))?;
        Ok(Constraint {
            matcher: Matcher::new(Ok(parser)),
            size: vocab.size,
        })
    }

    /// The tokens that may come next (EOS only where the grammar accepts).
    pub fn mask(&mut self) -> Result<TokenMask, ModelError> {
        let v = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| grammar(&e.to_string()))?;
        // llguidance's vector has the same layout (bit t & 31 of word
        // t >> 5), possibly longer: copied, cut to the vocabulary.
        let n = self.size.div_ceil(32);
        let mut words: Vec<u32> = v.as_slice().iter().copied().take(n).collect();
        words.resize(n, 0);
        if !self.size.is_multiple_of(32) {
            words[n - 1] &= (1u32 << (self.size % 32)) - 1;
        }
        Ok(TokenMask {
            words,
            size: self.size,
        })
    }

    /// Moves past `token`, which the last mask allowed; a token it did not
    /// allow is an error (the sampler did not apply the mask).
    pub fn commit(&mut self, token: u32) -> Result<(), ModelError> {
        self.matcher
            .consume_token(token)
            .map_err(|e| grammar(&format!("token {token} breaks the grammar: {e}")))
    }

    /// Whether the output so far is complete (the grammar accepts here).
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    /// Whether the grammar allows nothing more (EOS is the only way on).
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

fn grammar(msg: &str) -> ModelError {
    ModelError::Other(format!("constrained output: {msg}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn vocab() -> (Tokenizer, Vocabulary) {
        let dir = crate::testutil::tiny_checkpoint("tiny");
        let tok = Tokenizer::from_dir(&dir).unwrap();
        let v = Vocabulary::new(&tok).unwrap();
        (tok, v)
    }

    /// Draws uniformly among the allowed tokens until EOS (a random-weight
    /// model's worst case: any allowed token is as likely as any other).
    fn draw(tok: &Tokenizer, c: &mut Constraint, rng: &mut impl Rng, max: usize) -> String {
        let eos = tok.eos_token_ids()[0];
        let mut out = Vec::new();
        for _ in 0..max {
            let m = c.mask().unwrap();
            let allowed: Vec<u32> = m.allowed().collect();
            assert!(!allowed.is_empty(), "a mask allowed nothing after {out:?}");
            let t = allowed[rng.random_range(0..allowed.len())];
            if t == eos {
                assert!(c.is_accepting(), "EOS allowed before the grammar accepts");
                return tok.decode(&out, false).unwrap();
            }
            c.commit(t).unwrap();
            out.push(t);
        }
        panic!("no EOS after {max} tokens: {:?}", tok.decode(&out, false));
    }

    /// Random tokens under a schema's constraint give JSON that holds the
    /// schema: required keys, an enum, bounded integers and strings, an
    /// array, a nested object, no other keys.
    #[test]
    fn random_tokens_under_a_json_schema_give_valid_json() {
        let (tok, v) = vocab();
        let schema = serde_json::json!({
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "count": {"type": "integer", "minimum": 1, "maximum": 99},
                "kind": {"enum": ["read", "write", "exec"]},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
                "nested": {
                    "type": "object",
                    "properties": {"ok": {"type": "boolean"}},
                    "required": ["ok"],
                    "additionalProperties": false
                }
            },
            "required": ["name", "count", "kind", "nested"],
            "additionalProperties": false
        });
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(18);
        for i in 0..12 {
            let mut c = Constraint::json_schema(&v, &schema).unwrap();
            let text = draw(&tok, &mut c, &mut rng, 400);
            let j: Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("output {i} is not JSON ({e}): {text}"));
            let o = j
                .as_object()
                .unwrap_or_else(|| panic!("not an object: {text}"));
            for k in o.keys() {
                assert!(
                    ["name", "count", "kind", "tags", "nested"].contains(&k.as_str()),
                    "key {k} is not in the schema: {text}"
                );
            }
            assert!(o["name"].as_str().unwrap().chars().count() <= 12, "{text}");
            let n = o["count"].as_i64().unwrap();
            assert!((1..=99).contains(&n), "{text}");
            assert!(["read", "write", "exec"].contains(&o["kind"].as_str().unwrap()));
            assert!(o["nested"]["ok"].is_boolean(), "{text}");
            if let Some(t) = o.get("tags") {
                let t = t.as_array().unwrap();
                assert!(t.len() <= 3 && t.iter().all(|s| s.as_str().unwrap().chars().count() <= 6));
            }
            assert!(!text.contains(['\n', '\t']), "not compact: {text}");
        }
    }

    /// `json_object`: any object, never another JSON value.
    #[test]
    fn json_object_allows_objects_only() {
        let (tok, v) = vocab();
        let mut c = Constraint::json_object(&v).unwrap();
        let m = c.mask().unwrap();
        let brace = tok.encode("{").unwrap();
        assert_eq!(brace.len(), 1);
        assert!(m.is_allowed(brace[0]));
        for other in ["[", "\"", "1", "true", " "] {
            let t = tok.encode(other).unwrap();
            assert!(!m.is_allowed(t[0]), "{other:?} allowed first");
        }
        assert!(
            !m.is_allowed(tok.eos_token_ids()[0]),
            "EOS before any output"
        );
    }

    /// A token the mask did not allow is refused, and a schema that is not
    /// an object, or that sets the engine's own key, is refused up front.
    #[test]
    fn bad_tokens_and_bad_schemas_are_refused() {
        let (tok, v) = vocab();
        let mut c = Constraint::json_object(&v).unwrap();
        let bad = tok.encode("[").unwrap()[0];
        assert!(!c.mask().unwrap().is_allowed(bad));
        assert!(c.commit(bad).is_err());
        assert!(Constraint::json_schema(&v, &serde_json::json!(true)).is_err());
        let e = Constraint::json_schema(&v, &serde_json::json!({"x-guidance": {}}))
            .err()
            .unwrap();
        assert!(e.to_string().contains("x-guidance"), "{e}");
    }

    /// Added tokens are bytes of their own text, flagged; every other token
    /// of the Qwen vocabulary maps back to bytes.
    #[test]
    fn token_bytes_flag_added_tokens() {
        let (tok, v) = vocab();
        let bytes = tok.token_bytes().unwrap();
        assert_eq!(bytes.len(), v.size());
        let end = tok.token_id("<|im_end|>").unwrap();
        assert_eq!(bytes[end as usize], (b"<|im_end|>".to_vec(), true));
        let hello = tok.encode(" hello").unwrap();
        assert_eq!(hello.len(), 1);
        assert_eq!(bytes[hello[0] as usize], (b" hello".to_vec(), false));
    }
}
