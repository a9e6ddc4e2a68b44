//! Tokenizer: Hugging Face `tokenizer.json` loading, EOS discovery from the
//! model directory's configs, a streaming decoder, and the converters that
//! build Qwen's and gpt-oss's (`o200k_harmony`) `tokenizer.json` from their
//! published BPE ranks.

pub(crate) use eos::token_string;

mod eos;
mod glm4;
mod harmony;
mod incremental;
mod sampleable;
mod segments;
mod vocab;

use std::path::{Path, PathBuf};
use std::sync::Arc;

/// `tokenizer_config.json`'s `added_tokens_decoder` for `(id, content,
/// special)` added tokens, as `save_pretrained` writes it.
pub(crate) fn added_tokens_decoder<'a>(
    tokens: impl IntoIterator<Item = (u32, &'a str, bool)>,
) -> serde_json::Map<String, serde_json::Value> {
    tokens
        .into_iter()
        .map(|(id, content, special)| {
            let entry = serde_json::json!({
                "content": content, "lstrip": false, "normalized": false,
                "rstrip": false, "single_word": false, "special": special,
            });
            (id.to_string(), entry)
        })
        .collect()
}

pub use glm4::{
    GLM4_BPE_RANKS, GLM4_CHAT_TEMPLATE, GLM4_SPECIAL_TOKENS, build_glm4_tokenizer_json,
    glm4_generation_config, glm4_tokenizer_config,
};
pub use harmony::{
    GPT_OSS_CHAT_TEMPLATE, HARMONY_EOS_IDS, HARMONY_LAST_ID, HARMONY_NAMED_TOKENS, O200K_BPE_RANKS,
    O200K_PRETOKENIZE_REGEX, build_harmony_tokenizer_json, find_o200k_vocab,
    harmony_generation_config, harmony_special_tokens, harmony_tokenizer_config,
};
pub use incremental::IncrementalDecoder;
pub use sampleable::sampleable_vocab;
pub use vocab::{
    QWEN_BPE_RANKS, QWEN_PRETOKENIZE_REGEX, QWEN3_SPECIAL_TOKENS, build_qwen_tokenizer_json,
    find_qwen_vocab,
};

use crate::error::ModelError;

/// A loaded tokenizer. `Send + Sync`, and `Clone` is cheap (the vocabulary
/// is shared), so streaming decoders can own one.
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    /// Where it came from, for error messages.
    origin: PathBuf,
    eos: Vec<u32>,
    vocab_size: usize,
    /// What bounds the input one token stands for (`None`: no bound known).
    span: Option<TokenSpan>,
    /// Long prompts by added-token segments, cached (`segments.rs`).
    segments: Arc<segments::Segmenter>,
}

/// How much input text one token can stand for, for tokenizers that keep
/// every input byte (byte-level BPE): the bound behind
/// [`Tokenizer::min_tokens`].
#[derive(Debug, Clone, Copy)]
struct TokenSpan {
    /// Bytes of the longest token (vocabulary or added token).
    max_bytes: usize,
    /// The text is NFC-normalized first; composition can shrink it, at
    /// most threefold (three Hangul jamo, 9 bytes, become one syllable).
    nfc: bool,
}

impl TokenSpan {
    /// `Some` only when encoding cannot drop input: no normalizer but NFC,
    /// a byte-level pre-tokenizer (optionally after regex splits that keep
    /// what they match) and a byte-level BPE model, whose token strings have
    /// one character per byte.
    fn of(inner: &tokenizers::Tokenizer) -> Option<TokenSpan> {
        use tokenizers::{
            DecoderWrapper, ModelWrapper, NormalizerWrapper, PreTokenizerWrapper,
            SplitDelimiterBehavior,
        };
        let nfc = match inner.get_normalizer() {
            None => false,
            Some(NormalizerWrapper::NFC(_)) => true,
            Some(_) => return None,
        };
        let keeps_bytes = |p: &PreTokenizerWrapper| match p {
            PreTokenizerWrapper::ByteLevel(_) => true,
            PreTokenizerWrapper::Split(s) => s.behavior != SplitDelimiterBehavior::Removed,
            _ => false,
        };
        let byte_level = match inner.get_pre_tokenizer() {
            Some(PreTokenizerWrapper::ByteLevel(_)) => true,
            Some(PreTokenizerWrapper::Sequence(seq)) => {
                let seq = seq.as_ref();
                seq.iter().all(keeps_bytes)
                    && seq
                        .iter()
                        .any(|p| matches!(p, PreTokenizerWrapper::ByteLevel(_)))
            }
            _ => false,
        };
        if !byte_level || !matches!(inner.get_decoder(), Some(DecoderWrapper::ByteLevel(_))) {
            return None;
        }
        let ModelWrapper::BPE(bpe) = inner.get_model() else {
            return None;
        };
        let model_max = bpe.get_vocab().keys().map(|t| t.chars().count()).max()?;
        let added_max = inner
            .get_added_tokens_decoder()
            .values()
            .map(|t| t.content.len())
            .max()
            .unwrap_or(0);
        Some(TokenSpan {
            max_bytes: model_max.max(added_max).max(1),
            nfc,
        })
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("origin", &self.origin)
            .field("vocab_size", &self.vocab_size)
            .field("eos", &self.eos)
            .finish()
    }
}

impl Tokenizer {
    /// Load `dir/tokenizer.json`; EOS ids come from `generation_config.json`
    /// (`eos_token_id`, int or list), else `config.json`, plus
    /// `tokenizer_config.json`'s `eos_token`.
    pub fn from_dir(dir: &Path) -> Result<Self, ModelError> {
        let path = dir.join("tokenizer.json");
        if !path.is_file() {
            return Err(ModelError::MissingFile {
                path,
                what: "tokenizer.json (Hugging Face fast tokenizer)".into(),
            });
        }
        let json = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        let mut tok = Self::parse(&json, path)?;
        let eos = eos::discover(dir, &tok)?;
        tok.set_eos(eos)?;
        Ok(tok)
    }

    /// Build from `tokenizer.json` text with explicit EOS ids (for synthetic
    /// checkpoints and tests).
    pub fn from_json(json: &str, eos_token_ids: &[u32]) -> Result<Self, ModelError> {
        let mut tok = Self::parse(json, PathBuf::from("<tokenizer.json>"))?;
        tok.set_eos(eos_token_ids.to_vec())?;
        Ok(tok)
    }

    fn parse(json: &str, origin: PathBuf) -> Result<Self, ModelError> {
        let inner: tokenizers::Tokenizer = json.parse().map_err(|e| ModelError::Tokenizer {
            path: origin.clone(),
            reason: format!("cannot parse tokenizer.json: {e}"),
        })?;
        let vocab_size = inner
            .get_vocab(true)
            .values()
            .max()
            .map_or(0, |&m| m as usize + 1);
        if vocab_size == 0 {
            return Err(ModelError::Tokenizer {
                path: origin,
                reason: "empty vocabulary".into(),
            });
        }
        let span = TokenSpan::of(&inner);
        let segments = Arc::new(segments::Segmenter::of(&inner));
        Ok(Self {
            inner: Arc::new(inner),
            origin,
            eos: Vec::new(),
            vocab_size,
            span,
            segments,
        })
    }

    fn set_eos(&mut self, eos: Vec<u32>) -> Result<(), ModelError> {
        if let Some(bad) = eos.iter().find(|&&id| self.inner.id_to_token(id).is_none()) {
            return Err(self.err(format!(
                "EOS token id {bad} is not in the vocabulary (size {})",
                self.vocab_size
            )));
        }
        let mut uniq = Vec::with_capacity(eos.len());
        for id in eos {
            if !uniq.contains(&id) {
                uniq.push(id);
            }
        }
        self.eos = uniq;
        Ok(())
    }

    fn err(&self, reason: String) -> ModelError {
        ModelError::Tokenizer {
            path: self.origin.clone(),
            reason,
        }
    }

    /// Encode text. Added/special tokens written in the text (as rendered
    /// chat templates contain) become their ids; no BOS is added. A long
    /// text is encoded by added-token segments, in parallel and through a
    /// cache of the segments of earlier prompts (the same ids:
    /// `segments.rs`).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        if text.len() >= segments::MIN_SEGMENTED_BYTES && self.segments.enabled() {
            return self.segments.encode(text, |part| self.encode_whole(part));
        }
        self.encode_whole(text)
    }

    /// One `tokenizers` encode of the whole text.
    fn encode_whole(&self, text: &str) -> Result<Vec<u32>, ModelError> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| self.err(format!("encode failed: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Decode ids to text. Ids outside the vocabulary are refused rather
    /// than dropped, since they mean the caller mixed up tokenizers.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, ModelError> {
        if let Some(bad) = ids.iter().find(|&&id| self.inner.id_to_token(id).is_none()) {
            return Err(self.err(format!(
                "token id {bad} is not in the vocabulary (size {})",
                self.vocab_size
            )));
        }
        self.inner
            .decode(ids, skip_special)
            .map_err(|e| self.err(format!("decode failed: {e}")))
    }

    /// A lower bound on `encode(text)?.len()` found in one pass over the
    /// bytes, without tokenizing: the text's length over the longest
    /// token's (Qwen's vocabulary: 128 bytes). Lets a server refuse a prompt
    /// of megabytes that cannot fit the context before paying for
    /// tokenizing it. 0 for tokenizers that may drop input text (other
    /// normalizers, whitespace-splitting pre-tokenizers), where no such bound
    /// holds.
    pub fn min_tokens(&self, text: &str) -> usize {
        let Some(span) = self.span else {
            return 0;
        };
        let bytes = if !span.nfc || text.is_ascii() {
            text.len()
        } else {
            // ASCII is unchanged by NFC; the rest shrinks at most threefold.
            let ascii = text.bytes().filter(u8::is_ascii).count();
            ascii + (text.len() - ascii) / 3
        };
        bytes.div_ceil(span.max_bytes)
    }

    /// Bytes of the longest token when [`Tokenizer::min_tokens`] has a
    /// bound, for logs and tests.
    pub fn max_token_bytes(&self) -> Option<usize> {
        self.span.map(|s| s.max_bytes)
    }

    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos
    }

    pub fn is_eos(&self, id: u32) -> bool {
        self.eos.contains(&id)
    }

    /// Highest id + 1 (the embedding rows the model must have at least).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn token_id(&self, s: &str) -> Option<u32> {
        self.inner.token_to_id(s)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Whether `id` is an added token (`<|im_end|>`, `<tool_call>`): one the
    /// grammar engine treats as special, reachable only by its id.
    pub fn is_added(&self, id: u32) -> bool {
        self.inner.get_added_tokens_decoder().contains_key(&id)
    }

    /// Every token id's bytes, `0..vocab_size`, and whether it is an added
    /// token (`<|im_end|>`, `<think>`, ...: text the model emits as one
    /// token, never spelled by ordinary tokens). Byte-level BPE vocabularies
    /// only (Qwen3, GLM-4.5, gpt-oss's o200k): a token string's characters
    /// map back to bytes through the GPT-2 byte table; anything else is
    /// refused. Ids with no token are empty, not added.
    pub fn token_bytes(&self) -> Result<Vec<(Vec<u8>, bool)>, ModelError> {
        let table = vocab::bytes_to_unicode();
        let byte_of: std::collections::HashMap<char, u8> = table
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        let added = self.inner.get_added_tokens_decoder();
        (0..self.vocab_size as u32)
            .map(|id| {
                if let Some(t) = added.get(&id) {
                    return Ok((t.content.as_bytes().to_vec(), true));
                }
                let Some(s) = self.inner.id_to_token(id) else {
                    return Ok((Vec::new(), false));
                };
                s.chars()
                    .map(|c| byte_of.get(&c).copied())
                    .collect::<Option<Vec<u8>>>()
                    .map(|b| (b, false))
                    .ok_or_else(|| ModelError::Tokenizer {
                        path: self.origin.clone(),
                        reason: format!(
                            "token {id} ({s:?}) is not byte-level BPE: grammar-constrained \
                             decoding needs every token's bytes"
                        ),
                    })
            })
            .collect()
    }

    /// Streaming decoder that skips special tokens (`<|im_end|>` etc.) but
    /// keeps non-special added tokens such as `<think>`.
    pub fn incremental(&self) -> IncrementalDecoder {
        IncrementalDecoder::new(self.clone(), true)
    }

    /// Streaming decoder with explicit special-token handling.
    pub fn incremental_with(&self, skip_special: bool) -> IncrementalDecoder {
        IncrementalDecoder::new(self.clone(), skip_special)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn tokenizer_is_send_sync() {
        assert_send_sync::<Tokenizer>();
        assert_send_sync::<IncrementalDecoder>();
    }

    #[test]
    fn missing_tokenizer_json_is_missing_file() {
        let dir = tempfile::tempdir().unwrap();
        match Tokenizer::from_dir(dir.path()) {
            Err(ModelError::MissingFile { path, .. }) => {
                assert!(path.ends_with("tokenizer.json"))
            }
            other => panic!("expected MissingFile, got {other:?}"),
        }
    }

    #[test]
    fn garbage_tokenizer_json_is_refused() {
        let err = Tokenizer::from_json("{not json", &[]).unwrap_err();
        assert!(
            err.to_string().contains("cannot parse tokenizer.json"),
            "{err}"
        );
    }
}
