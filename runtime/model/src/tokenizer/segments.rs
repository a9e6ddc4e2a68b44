//! Long prompts encoded by added-token segments, in parallel and through a
//! cache of segments already seen.
//!
//! Why: a coding agent resends its whole conversation every turn, and the
//! rendered chat prompt of a 24K-token context is ~100 KB of text; one
//! `tokenizers` encode of it costs ~30 ms on one core, paid again every
//! turn although only the last messages are new (measured on the H200
//! through `serve`, a 384-token turn over a cached 24K prefix had ~70 ms
//! of server time outside the engine).
//!
//! Exactness: `tokenizers` first splits the input at every added token
//! (leftmost-longest), then normalizes, pre-tokenizes and encodes each
//! piece on its own; with `add_special_tokens = false` nothing is added
//! around them. So cutting the text at the start of an added token that
//! tokenizers itself would split there, encoding each part, and
//! concatenating gives the same ids. That holds when every added token is
//! matched on the raw text as written (`normalized: false`) and has no
//! `lstrip`, `rstrip` or `single_word` (which move or veto a split); a
//! tokenizer with any other added token is encoded whole. The cuts here
//! are the starts of the leftmost-longest matches of all added tokens, the
//! same matches tokenizers makes. `tests` compares both encodings on
//! rendered chats with the real Qwen vocabulary and on edge cases.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

/// Prompts shorter than this are encoded whole (one encode is cheap).
pub(super) const MIN_SEGMENTED_BYTES: usize = 16 * 1024;
/// Parts are at least this long (adjacent segments are merged), so a
/// chat's many short pieces do not each pay an encode call.
const MIN_PART_BYTES: usize = 2 * 1024;
/// Text bytes the cache keeps (least recently used parts leave first).
const CACHE_BYTES: usize = 64 << 20;

/// The added tokens cuts may be made at, or why there are none.
#[derive(Debug)]
pub(super) struct Segmenter {
    /// Every added token's text; empty when segmentation is off.
    added: Vec<String>,
    cache: Mutex<Cache>,
}

/// Parts by text; `order` holds the same keys oldest first (shared, so a
/// part's text is stored once).
#[derive(Debug, Default)]
struct Cache {
    parts: HashMap<Arc<str>, Vec<u32>>,
    order: VecDeque<Arc<str>>,
    bytes: usize,
}

impl Segmenter {
    /// From the tokenizer's added tokens: on only when all of them split
    /// the raw text exactly where they are written (module doc).
    pub(super) fn of(inner: &tokenizers::Tokenizer) -> Self {
        let decoder = inner.get_added_tokens_decoder();
        let plain = decoder
            .values()
            .all(|t| !t.normalized && !t.lstrip && !t.rstrip && !t.single_word);
        let mut added: Vec<String> = if plain {
            decoder
                .values()
                .map(|t| t.content.clone())
                .filter(|c| !c.is_empty())
                .collect()
        } else {
            Vec::new()
        };
        added.sort();
        added.dedup();
        Segmenter {
            added,
            cache: Mutex::new(Cache::default()),
        }
    }

    pub(super) fn enabled(&self) -> bool {
        !self.added.is_empty()
    }

    /// Start offsets of the leftmost-longest matches of the added tokens.
    fn cuts(&self, text: &str) -> Vec<usize> {
        let mut matches: Vec<(usize, usize)> = Vec::new();
        for t in &self.added {
            matches.extend(
                text.match_indices(t.as_str())
                    .map(|(i, m)| (i, i + m.len())),
            );
        }
        // Leftmost first, the longest of those starting together first.
        matches.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        let mut cuts = Vec::new();
        let mut end = 0;
        for (s, e) in matches {
            if s >= end {
                cuts.push(s);
                end = e;
            }
        }
        cuts
    }

    /// The text cut into parts of at least [`MIN_PART_BYTES`] (the last
    /// may be shorter), each starting at an added token except the first.
    pub(super) fn parts<'a>(&self, text: &'a str) -> Vec<&'a str> {
        let mut parts = Vec::new();
        let mut start = 0;
        for c in self.cuts(text) {
            if c - start >= MIN_PART_BYTES {
                parts.push(&text[start..c]);
                start = c;
            }
        }
        if start < text.len() || parts.is_empty() {
            parts.push(&text[start..]);
        }
        parts
    }

    /// Encodes `text` part by part: cached parts are reused, the others
    /// are encoded in parallel by `encode` and cached.
    pub(super) fn encode<E>(
        &self,
        text: &str,
        encode: impl Fn(&str) -> Result<Vec<u32>, E> + Sync,
    ) -> Result<Vec<u32>, E>
    where
        E: Send,
    {
        self.encode_parts(&self.parts(text), encode)
    }

    /// Encodes `parts` (which concatenate to the text) as [`Self::encode`].
    fn encode_parts<E>(
        &self,
        parts: &[&str],
        encode: impl Fn(&str) -> Result<Vec<u32>, E> + Sync,
    ) -> Result<Vec<u32>, E>
    where
        E: Send,
    {
        use rayon::prelude::*;
        let mut found: Vec<Option<Vec<u32>>> = {
            let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
            parts.iter().map(|p| cache.parts.get(*p).cloned()).collect()
        };
        let missing: Vec<(usize, Result<Vec<u32>, E>)> = found
            .iter()
            .enumerate()
            .filter(|(_, f)| f.is_none())
            .map(|(i, _)| i)
            .collect::<Vec<_>>()
            .into_par_iter()
            .map(|i| (i, encode(parts[i])))
            .collect();
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        for (i, ids) in missing {
            let ids = ids?;
            cache.insert(parts[i], &ids);
            found[i] = Some(ids);
        }
        Ok(found.into_iter().flatten().flatten().collect())
    }
}

impl Cache {
    fn insert(&mut self, part: &str, ids: &[u32]) {
        if part.len() > CACHE_BYTES || self.parts.contains_key(part) {
            return;
        }
        while self.bytes + part.len() > CACHE_BYTES {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            self.bytes -= old.len();
            self.parts.remove(&old);
        }
        let key: Arc<str> = part.into();
        self.bytes += part.len();
        self.order.push_back(key.clone());
        self.parts.insert(key, ids.to_vec());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::Tokenizer;

    fn qwen() -> Tokenizer {
        let vocab = crate::tokenizer::vocab::find_qwen_vocab(None)
            .expect("the Qwen vocabulary (run tools/vocab.sh)");
        let json = crate::tokenizer::vocab::build_qwen_tokenizer_json(&vocab).expect("json");
        Tokenizer::from_json(&json, &[]).expect("tokenizer")
    }

    /// A long chat as the Qwen templates render it, with text that stresses
    /// pre-tokenization at the cuts (spaces, digits, newlines, unicode).
    fn chat(turns: usize) -> String {
        let mut s = String::from("<|im_start|>system\nYou are a coding agent.<|im_end|>\n");
        for i in 0..turns {
            s.push_str("<|im_start|>user\n");
            for j in 0..40 {
                s.push_str(&format!(
                    "  fn f{i}_{j}(x: u32) -> u32 {{ x * {j} }} // «ünïcode» {}\n",
                    i * j
                ));
            }
            s.push_str("<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nOK  \n\n");
            s.push_str("<tool_call>\n{\"name\": \"read\"}\n</tool_call><|im_end|>\n");
        }
        s.push_str("<|im_start|>assistant\n");
        s
    }

    #[test]
    fn segmented_encoding_is_the_whole_encoding() {
        let t = qwen();
        assert!(
            t.segments.enabled(),
            "the Qwen tokenizer's added tokens are all plain"
        );
        for text in [
            chat(30),
            format!("{}<|im_end|><|im_end|>{}", chat(12), chat(12)),
            format!("  leading spaces {}", chat(20)),
            format!("{}<|im_start|>", "x ".repeat(20_000)),
            "<|im_start|>".repeat(3000),
        ] {
            assert!(text.len() >= MIN_SEGMENTED_BYTES, "{}", text.len());
            let whole = t.encode_whole(&text).unwrap();
            assert!(t.segments.parts(&text).len() > 1 || !text.contains("<|im_start|>"));
            // Twice: encoded, then from the cache.
            for round in 0..2 {
                let seg = t.encode(&text).unwrap();
                assert_eq!(seg, whole, "round {round}: {} bytes", text.len());
            }
        }
        // A turn appended to a cached conversation reuses its parts.
        let a = chat(30);
        let b = format!("{a}OK<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n");
        assert_eq!(t.encode(&b).unwrap(), t.encode_whole(&b).unwrap());
    }

    #[test]
    fn parts_start_at_added_tokens_and_cover_the_text() {
        let t = qwen();
        let text = chat(20);
        let parts = t.segments.parts(&text);
        assert_eq!(parts.concat(), text);
        for p in &parts[1..] {
            assert!(
                p.starts_with("<|im_start|>") || p.starts_with("<|im_end|>") || p.starts_with('<')
            );
        }
        assert!(
            parts[..parts.len() - 1]
                .iter()
                .all(|p| p.len() >= MIN_PART_BYTES)
        );
    }

    /// gpt-oss's harmony format and the GLM-4 stand-in (the qwen vocabulary
    /// with GLM's specials), as their templates render long chats.
    #[test]
    fn harmony_and_glm4_segmented_encodings_are_whole() {
        let o200k = crate::tokenizer::find_o200k_vocab(None)
            .expect("the o200k vocabulary (run tools/harmony/vocab.sh)");
        let harmony = crate::tokenizer::build_harmony_tokenizer_json(&o200k).unwrap();
        let qwen = crate::tokenizer::vocab::find_qwen_vocab(None).unwrap();
        let glm = crate::tokenizer::build_glm4_tokenizer_json(&qwen).unwrap();
        let body = chat(25)
            .replace("<|im_start|>", "")
            .replace("<|im_end|>", "")
            .replace("<think>", "")
            .replace("</think>", "");
        for (name, json, open, close) in [
            ("harmony", harmony, "<|start|>user<|message|>", "<|end|>"),
            ("glm4", glm, "<|user|>\n", "<|assistant|>\n"),
        ] {
            let t = Tokenizer::from_json(&json, &[]).unwrap();
            let text: String = body
                .lines()
                .collect::<Vec<_>>()
                .chunks(40)
                .map(|c| format!("{open}{}{close}", c.join("\n")))
                .collect();
            assert!(text.len() >= MIN_SEGMENTED_BYTES);
            eprintln!("{name}: segmented {}", t.segments.enabled());
            assert_eq!(
                t.encode(&text).unwrap(),
                t.encode_whole(&text).unwrap(),
                "{name}"
            );
            assert_eq!(
                t.encode(&text).unwrap(),
                t.encode_whole(&text).unwrap(),
                "{name} cached"
            );
        }
    }

    /// The planted bug the comparison must catch: parts cut inside plain
    /// text (where tokenizers does not split) through the same encoder.
    #[test]
    fn parts_cut_inside_plain_text_change_the_ids() {
        let t = qwen();
        let text = chat(30);
        let whole = t.encode_whole(&text).unwrap();
        // Cut inside every "codepoint" word, which is one pre-token.
        let cuts: Vec<usize> = text.match_indices("ïcode").map(|(i, _)| i + 3).collect();
        let mut parts = Vec::new();
        let mut start = 0;
        for c in cuts {
            parts.push(&text[start..c]);
            start = c;
        }
        parts.push(&text[start..]);
        let fresh = Segmenter::of(&t.inner);
        let bad = fresh.encode_parts(&parts, |p| t.encode_whole(p)).unwrap();
        assert!(
            bad != whole,
            "wrong cuts kept the ids: the comparison cannot fail"
        );
    }
}
