//! Published BPE vocabularies: locate a tiktoken rank file (`qwen.tiktoken`,
//! the ranks Qwen publishes; `o200k_base.tiktoken` for gpt-oss, see
//! `harmony.rs`) and convert it to a Hugging Face `tokenizer.json`
//! equivalent to the one shipped with the real checkpoints, so synthetic
//! checkpoints tokenize exactly like real ones.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use base64::Engine as _;
use serde_json::json;

use crate::error::ModelError;

/// Qwen3 added tokens: (id, content, special). The tool/think markers are
/// `special: false` in real Qwen3 so `skip_special_tokens` keeps them.
pub const QWEN3_SPECIAL_TOKENS: &[(u32, &str, bool)] = &[
    (151643, "<|endoftext|>", true),
    (151644, "<|im_start|>", true),
    (151645, "<|im_end|>", true),
    (151646, "<|object_ref_start|>", true),
    (151647, "<|object_ref_end|>", true),
    (151648, "<|box_start|>", true),
    (151649, "<|box_end|>", true),
    (151650, "<|quad_start|>", true),
    (151651, "<|quad_end|>", true),
    (151652, "<|vision_start|>", true),
    (151653, "<|vision_end|>", true),
    (151654, "<|vision_pad|>", true),
    (151655, "<|image_pad|>", true),
    (151656, "<|video_pad|>", true),
    (151657, "<tool_call>", false),
    (151658, "</tool_call>", false),
    (151659, "<|fim_prefix|>", true),
    (151660, "<|fim_middle|>", true),
    (151661, "<|fim_suffix|>", true),
    (151662, "<|fim_pad|>", true),
    (151663, "<|repo_name|>", true),
    (151664, "<|file_sep|>", true),
    (151665, "<tool_response>", false),
    (151666, "</tool_response>", false),
    (151667, "<think>", false),
    (151668, "</think>", false),
];

/// The Qwen2/Qwen3 pre-tokenizer split pattern.
pub const QWEN_PRETOKENIZE_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Number of ranks in `qwen.tiktoken`; the added tokens start right after.
pub const QWEN_BPE_RANKS: usize = 151_643;

/// One published BPE vocabulary: its rank file and how it is split and
/// normalized before merging.
#[derive(Debug, Clone, Copy)]
pub(crate) struct BpeVocab {
    /// Shown in messages ("Qwen", "o200k_base").
    pub name: &'static str,
    /// The rank file's name under `.cache/vocab/`.
    pub file: &'static str,
    /// The script that fetches it.
    pub fetch: &'static str,
    /// Number of ranks in the rank file.
    pub ranks: usize,
    /// The leading ranks the tokenizer keeps (`ranks`, unless the file
    /// stands in for a smaller vocabulary); the added tokens start at or
    /// after it.
    pub use_ranks: usize,
    /// The pre-tokenizer split pattern.
    pub regex: &'static str,
    /// Whether the text is NFC-normalized first.
    pub nfc: bool,
}

pub(crate) const QWEN: BpeVocab = BpeVocab {
    name: "Qwen",
    file: "qwen.tiktoken",
    fetch: "tools/vocab.sh",
    ranks: QWEN_BPE_RANKS,
    use_ranks: QWEN_BPE_RANKS,
    regex: QWEN_PRETOKENIZE_REGEX,
    nfc: true,
};

/// Locate `qwen.tiktoken`: `explicit` if given (must exist), else
/// `.cache/vocab/qwen.tiktoken` under the current directory or any ancestor,
/// else under this crate's workspace root.
pub fn find_qwen_vocab(explicit: Option<&Path>) -> Result<PathBuf, ModelError> {
    find_vocab(&QWEN, explicit)
}

/// Locate `vocab`'s rank file as [`find_qwen_vocab`] does.
pub(crate) fn find_vocab(vocab: &BpeVocab, explicit: Option<&Path>) -> Result<PathBuf, ModelError> {
    let (name, file, fetch) = (vocab.name, vocab.file, vocab.fetch);
    if let Some(p) = explicit {
        return if p.is_file() {
            Ok(p.to_path_buf())
        } else {
            Err(ModelError::MissingFile {
                path: p.to_path_buf(),
                what: format!("{name} vocabulary ({file}); run {fetch} to fetch it"),
            })
        };
    }
    let relative = Path::new(".cache/vocab").join(file);
    let mut candidates = Vec::new();
    if let Ok(cwd) = std::env::current_dir() {
        candidates.extend(cwd.ancestors().map(|a| a.join(&relative)));
    }
    // The workspace root is two levels above this crate's manifest; this
    // covers test binaries run from the crate directory.
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    candidates.extend(manifest.ancestors().map(|a| a.join(&relative)));
    if let Some(found) = candidates.iter().find(|c| c.is_file()) {
        return Ok(found.clone());
    }
    Err(ModelError::MissingFile {
        path: relative,
        what: format!(
            "{name} vocabulary not found in the current directory, its ancestors or the \
             workspace; run {fetch} (it puts {file} into .cache/vocab/)"
        ),
    })
}

/// GPT-2 byte-to-unicode table: printable Latin-1 bytes map to themselves,
/// the rest to U+0100.. in byte order, so every byte string is a valid,
/// whitespace-free token string.
pub(crate) fn bytes_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || b >= 0xAE;
        table[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(next).unwrap_or('\u{FFFD}');
            next += 1;
            c
        };
    }
    table
}

/// Parse `base64(token) rank` lines; ranks must be exactly 0..n in order so
/// ids agree with the real checkpoints.
fn parse_tiktoken(path: &Path, text: &str, vocab: &BpeVocab) -> Result<Vec<Vec<u8>>, ModelError> {
    let fetch = vocab.fetch;
    let bad = |line: usize, reason: String| ModelError::Tokenizer {
        path: path.to_path_buf(),
        reason: format!("line {line}: {reason}; re-fetch it with {fetch}"),
    };
    let b64 = base64::engine::general_purpose::STANDARD;
    let mut tokens = Vec::with_capacity(vocab.ranks);
    for (i, line) in text.lines().enumerate() {
        if line.is_empty() {
            continue;
        }
        let (tok, rank) = line
            .split_once(' ')
            .ok_or_else(|| bad(i + 1, "expected 'base64 rank'".into()))?;
        let bytes = b64
            .decode(tok)
            .map_err(|e| bad(i + 1, format!("bad base64 '{tok}': {e}")))?;
        let rank: usize = rank
            .trim()
            .parse()
            .map_err(|_| bad(i + 1, format!("bad rank '{rank}'")))?;
        if rank != tokens.len() {
            return Err(bad(
                i + 1,
                format!("rank {rank} out of order (expected {})", tokens.len()),
            ));
        }
        tokens.push(bytes);
    }
    if tokens.len() != vocab.ranks {
        return Err(ModelError::Tokenizer {
            path: path.to_path_buf(),
            reason: format!(
                "{} ranks, expected {} ({}); re-fetch it with {fetch}",
                tokens.len(),
                vocab.ranks,
                vocab.file
            ),
        });
    }
    Ok(tokens)
}

/// Run byte-pair merging over `token` using only ranks below `max_rank`;
/// when it stops at exactly two parts, those are the merge that creates the
/// token (how tiktoken's ranks encode the merge order).
fn last_merge<'a>(
    token: &'a [u8],
    max_rank: u32,
    ranks: &HashMap<&[u8], u32, impl std::hash::BuildHasher>,
) -> Option<(&'a [u8], &'a [u8])> {
    // Part boundaries: parts[i]..parts[i+1].
    let mut bounds: Vec<usize> = (0..=token.len()).collect();
    while bounds.len() > 3 {
        let mut best: Option<(u32, usize)> = None;
        for i in 0..bounds.len() - 2 {
            if let Some(&r) = ranks.get(&token[bounds[i]..bounds[i + 2]])
                && r < max_rank
                && best.is_none_or(|(br, _)| r < br)
            {
                best = Some((r, i));
            }
        }
        let (_, i) = best?;
        bounds.remove(i + 1);
    }
    (bounds.len() == 3).then(|| (&token[bounds[0]..bounds[1]], &token[bounds[1]..bounds[2]]))
}

/// FNV-1a: the rank table is hashed ~4M times during conversion and the
/// keys are short trusted byte strings, so SipHash's DoS resistance only
/// costs time here.
#[derive(Default, Clone, Copy)]
struct Fnv(u64);

impl std::hash::Hasher for Fnv {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        let mut h = if self.0 == 0 {
            0xcbf2_9ce4_8422_2325
        } else {
            self.0
        };
        for &b in bytes {
            h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
        self.0 = h;
    }
}

type FnvMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<Fnv>>;

/// Append `s` as a JSON string literal.
fn push_json_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Convert `qwen.tiktoken` into a Hugging Face `tokenizer.json` string
/// equivalent to the real Qwen2/Qwen3 one (same ids, merges, pre-tokenizer
/// and added tokens).
pub fn build_qwen_tokenizer_json(tiktoken: &Path) -> Result<String, ModelError> {
    build_tokenizer_json(tiktoken, &QWEN, QWEN3_SPECIAL_TOKENS)
}

/// Convert `vocab`'s rank file into a `tokenizer.json` string with `added`
/// tokens (id, content, special).
pub(crate) fn build_tokenizer_json(
    tiktoken: &Path,
    vocab: &BpeVocab,
    added: &[(u32, &str, bool)],
) -> Result<String, ModelError> {
    use rayon::prelude::*;

    let fetch = vocab.fetch;
    let text = std::fs::read_to_string(tiktoken).map_err(|e| ModelError::io(tiktoken, e))?;
    let mut tokens = parse_tiktoken(tiktoken, &text, vocab)?;
    // A BPE rank is built from lower ranks, so a prefix of the ranks is a
    // vocabulary of its own.
    tokens.truncate(vocab.use_ranks);
    let mut ranks: FnvMap<&[u8], u32> = FnvMap::default();
    ranks.reserve(tokens.len());
    ranks.extend(
        tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.as_slice(), i as u32)),
    );
    if ranks.len() != tokens.len() {
        return Err(ModelError::Tokenizer {
            path: tiktoken.to_path_buf(),
            reason: format!("duplicate tokens; re-fetch it with {fetch}"),
        });
    }
    let table = bytes_to_unicode();
    let to_str = |b: &[u8]| b.iter().map(|&x| table[x as usize]).collect::<String>();

    // Each token's merge depends only on the (immutable) rank table.
    let merges: Vec<Option<String>> = tokens
        .par_iter()
        .enumerate()
        .map(|(rank, tok)| {
            if tok.len() < 2 {
                return Ok(None);
            }
            let (a, b) =
                last_merge(tok, rank as u32, &ranks).ok_or_else(|| ModelError::Tokenizer {
                    path: tiktoken.to_path_buf(),
                    reason: format!(
                        "rank {rank} cannot be built from lower ranks; not a BPE vocabulary? \
                         re-fetch it with {fetch}"
                    ),
                })?;
            Ok(Some(format!("{} {}", to_str(a), to_str(b))))
        })
        .collect::<Result<_, ModelError>>()?;

    let added: Vec<_> = added
        .iter()
        .map(|&(id, content, special)| {
            json!({
                "id": id, "content": content, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": special,
            })
        })
        .collect();
    let byte_level = json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false,
    });
    let head = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": if vocab.nfc { json!({ "type": "NFC" }) } else { serde_json::Value::Null },
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": { "Regex": vocab.regex },
                    "behavior": "Isolated",
                    "invert": false,
                },
                byte_level,
            ],
        },
        "post_processor": byte_level,
        "decoder": byte_level,
    });
    let model_head = json!({
        "type": "BPE",
        "dropout": null,
        "unk_token": null,
        "continuing_subword_prefix": "",
        "end_of_word_suffix": "",
        "fuse_unk": false,
        "byte_fallback": false,
        "ignore_merges": false,
    });

    // The 300k-entry vocab/merges are written directly: building them as
    // serde_json::Value costs most of the conversion time.
    let mut out = String::with_capacity(8 << 20);
    let head = head.to_string();
    out.push_str(&head[..head.len() - 1]);
    out.push_str(",\"model\":");
    let model_head = model_head.to_string();
    out.push_str(&model_head[..model_head.len() - 1]);
    out.push_str(",\"vocab\":{");
    for (rank, tok) in tokens.iter().enumerate() {
        if rank > 0 {
            out.push(',');
        }
        push_json_str(&mut out, &to_str(tok));
        out.push(':');
        out.push_str(&rank.to_string());
    }
    out.push_str("},\"merges\":[");
    for (i, m) in merges.iter().flatten().enumerate() {
        if i > 0 {
            out.push(',');
        }
        push_json_str(&mut out, m);
    }
    out.push_str("]}}");
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_is_a_bijection_without_whitespace() {
        let t = bytes_to_unicode();
        let set: std::collections::HashSet<char> = t.iter().copied().collect();
        assert_eq!(set.len(), 256);
        assert_eq!(t[b' ' as usize], 'Ġ');
        assert_eq!(t[b'\n' as usize], 'Ċ');
        assert_eq!(t[b'a' as usize], 'a');
        assert!(t.iter().all(|c| !c.is_whitespace()));
    }

    #[test]
    fn last_merge_uses_only_lower_ranks() {
        let toks: Vec<&[u8]> = vec![b"a", b"b", b"c", b"ab", b"bc", b"abc"];
        let ranks: HashMap<&[u8], u32> = toks
            .iter()
            .enumerate()
            .map(|(i, t)| (*t, i as u32))
            .collect();
        assert_eq!(last_merge(b"ab", 3, &ranks), Some((&b"a"[..], &b"b"[..])));
        // "ab" (3) beats "bc" (4), so "abc" = "ab" + "c".
        assert_eq!(last_merge(b"abc", 5, &ranks), Some((&b"ab"[..], &b"c"[..])));
        // Without access to "ab"/"bc" the token cannot be reduced to two parts.
        assert_eq!(last_merge(b"abc", 3, &ranks), None);
    }

    #[test]
    fn explicit_missing_vocab_path_says_what_to_do() {
        let err = find_qwen_vocab(Some(Path::new("/nonexistent/qwen.tiktoken"))).unwrap_err();
        assert!(err.to_string().contains("tools/vocab.sh"), "{err}");
    }
}
