//! Grammar-constrained decoding (issue 18): which tokens may come next so
//! that the output follows a grammar, computed over the model's own
//! vocabulary. Both engines share it: a [`Vocabulary`] built once per
//! model, a compiled [`Grammar`] per request (the server compiles it, so a
//! grammar the compiler refuses is a 400 before any work), a
//! [`Constraint`] per running sequence (the engine starts it at admission),
//! and the [`TokenMask`] the sampler applies before it draws.
//!
//! A grammar constrains either the whole output (`response_format`, a
//! forced tool call) or, lazily, only what follows a trigger token (a tool
//! call the model opens by itself under `tool_choice: auto`): free text
//! until the trigger, the grammar until it completes, free text again.
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
//! JSON whitespace is bounded: at most one space wherever JSON allows
//! whitespace, so `{"a": 1, "b": 2}` (Python's and most templates' style)
//! and the compact form are both allowed, and newlines are not. With
//! unbounded whitespace a random-weight model draws whitespace forever; a
//! real one rarely does, but a length cut-off would leave invalid JSON
//! either way.

use crate::error::ModelError;
use crate::tokenizer::Tokenizer;
use llguidance::ParserFactory;
use std::sync::Arc;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenizerEnv};

/// The model's vocabulary as the constraint engine sees it (built once per
/// model: ~0.1 s for the trie and ~0.3 s for the parser factory of Qwen's
/// 151,669 tokens).
pub struct Vocabulary {
    factory: Arc<ParserFactory>,
    size: usize,
    eos: u32,
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
            eos,
        })
    }

    /// Token ids the masks cover (`0..size`).
    pub fn size(&self) -> usize {
        self.size
    }

    /// The token that ends a constrained output where the grammar accepts
    /// (the tokenizer's first EOS id). A request whose stop tokens do not
    /// include it cannot end there, so the server refuses that pairing.
    pub fn eos(&self) -> u32 {
        self.eos
    }
}

/// The tokens allowed next: a bitmask of `size` bits, bit `t % 32` of word
/// `t / 32` for token `t` (the layout a GPU sampler can read as is).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenMask {
    words: Vec<u32>,
    size: usize,
}

impl TokenMask {
    /// A mask of `size` tokens allowing only `token`.
    pub fn only(size: usize, token: u32) -> Self {
        let mut words = vec![0u32; size.div_ceil(32)];
        if (token as usize) < size {
            words[token as usize / 32] |= 1 << (token % 32);
        }
        TokenMask { words, size }
    }

    /// The tokens either mask allows (the larger size).
    pub fn union(a: &TokenMask, b: &TokenMask) -> Self {
        let (long, short) = if a.words.len() >= b.words.len() {
            (a, b)
        } else {
            (b, a)
        };
        let mut words = long.words.clone();
        for (w, s) in words.iter_mut().zip(&short.words) {
            *w |= s;
        }
        TokenMask {
            words,
            size: long.size,
        }
    }

    /// Token ids the mask covers (`0..size`; every id past it is refused).
    pub fn size(&self) -> usize {
        self.size
    }

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

mod grammar;
pub use grammar::{Constraint, Grammar, lark_json};

fn grammar(msg: &str) -> ModelError {
    ModelError::Other(format!("constrained output: {msg}"))
}

#[cfg(test)]
mod tests;
