//! Streaming detokenization. Byte-level BPE splits multi-byte characters
//! across tokens, and some decoders (Metaspace) change a token's text
//! depending on its neighbours, so text is produced by decoding a short
//! window of ids and emitting only what became stable: output that does not
//! end in U+FFFD (an incomplete UTF-8 sequence) is released.

use super::Tokenizer;
use crate::error::ModelError;

/// Owns a (cheap) clone of the tokenizer so it can live in a streaming task.
pub struct IncrementalDecoder {
    tok: Tokenizer,
    skip_special: bool,
    /// Ids from `prefix` on; earlier ones are already emitted and dropped.
    ids: Vec<u32>,
    /// `ids[..read]` are emitted; `ids[..read]` decoded is the context that
    /// the next decode's output is compared against.
    read: usize,
}

impl IncrementalDecoder {
    pub(super) fn new(tok: Tokenizer, skip_special: bool) -> Self {
        Self {
            tok,
            skip_special,
            ids: Vec::new(),
            read: 0,
        }
    }

    /// Add one generated id; returns the text it completed (possibly empty
    /// while a character is still incomplete).
    pub fn push(&mut self, id: u32) -> Result<String, ModelError> {
        self.ids.push(id);
        let prefix = self.tok.decode(&self.ids[..self.read], self.skip_special)?;
        let full = self.tok.decode(&self.ids, self.skip_special)?;
        if full.ends_with('\u{FFFD}') || full.len() <= prefix.len() {
            return Ok(String::new());
        }
        let new = new_suffix(&prefix, &full);
        // Keep the last emitted id as context for the next window.
        let keep_from = self.ids.len() - 1;
        self.ids.drain(..keep_from);
        self.read = self.ids.len();
        Ok(new)
    }

    /// Flush whatever is held back (an incomplete character becomes U+FFFD).
    pub fn finish(self) -> Result<String, ModelError> {
        let prefix = self.tok.decode(&self.ids[..self.read], self.skip_special)?;
        let full = self.tok.decode(&self.ids, self.skip_special)?;
        Ok(new_suffix(&prefix, &full))
    }
}

fn new_suffix(prefix: &str, full: &str) -> String {
    match full.strip_prefix(prefix) {
        Some(rest) => rest.to_string(),
        // A decoder rewrote the context (e.g. dropped a leading space);
        // emit from the first differing character.
        None => {
            let common = prefix
                .char_indices()
                .zip(full.chars())
                .find(|((_, a), b)| a != b)
                .map_or(prefix.len().min(full.len()), |((i, _), _)| i);
            full.get(common..).unwrap_or_default().to_string()
        }
    }
}
