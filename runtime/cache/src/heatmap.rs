//! Route heatmaps: how often each routed expert was selected while
//! prefilling real text, the prior from which the GPU expert cache (HCS)
//! picks its initial resident set.
//!
//! A heatmap is only meaningful for the exact routes it was recorded with,
//! so it carries a [`HeatmapBinding`] (model config, expert cache identity
//! and format, quantizer, attention precision, top-k) and
//! [`Heatmap::load`] refuses a file whose binding differs from the engine's
//! instead of treating it as equivalent.
//!
//! File (`heatmap-v1.json`, next to the expert cache file):
//!
//! ```text
//! {
//!   "checksum": "<blake3 hex of the canonical body>",
//!   "body": { "format_version": 1, "binding": {...}, "moe_layers": [...],
//!             "num_experts": N, "counts": [[...], ...], "tokens": T,
//!             "prompts": "...", "created_by": "..." }
//! }
//! ```
//!
//! The canonical body is its JSON with object keys sorted and no
//! whitespace, so re-indenting the file keeps it valid while any change to
//! a value is detected. Files are written to a temp file in the target
//! directory, fsync'ed, renamed into place and the directory fsync'ed.

use crate::cache::ExpertCache;
use crate::format::SourceIdentity;
use krasis_model::atomic::TempFile;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

/// Bump on any change to the file layout, the body fields or the meaning of
/// the counts.
pub const HEATMAP_VERSION: u32 = 1;
/// Name of the heatmap file inside the expert cache's directory.
pub const HEATMAP_FILE_NAME: &str = "heatmap-v1.json";
/// A heatmap of the largest models is well under 1 MiB; this bound stops a
/// wrong path from reading a huge file into memory.
const MAX_FILE_BYTES: u64 = 64 << 20;

/// What to do about any refused heatmap.
const REMEDY: &str = "record one with `krasis-runtime heatmap --model DIR` (same model, cache \
     and options as the server), or pass `--heatmap off`";

/// Errors reading or writing a heatmap. Every message names the file, what
/// was wrong and what to do.
#[derive(Debug, thiserror::Error)]
pub enum HeatmapError {
    #[error("{path}: no heatmap here; {remedy}", remedy = REMEDY)]
    Missing { path: PathBuf },
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a usable heatmap file: {reason}; {remedy}", remedy = REMEDY)]
    Invalid { path: PathBuf, reason: String },
    #[error(
        "{path}: heatmap checksum mismatch (stored {stored}, computed {computed}): the file was \
         modified or truncated after it was written; {remedy}",
        remedy = REMEDY
    )]
    Checksum {
        path: PathBuf,
        stored: String,
        computed: String,
    },
    #[error(
        "{path}: heatmap format version {found}, this build reads version {expected}; {remedy}",
        remedy = REMEDY
    )]
    Version {
        path: PathBuf,
        found: u64,
        expected: u32,
    },
    #[error(
        "{path}: the heatmap was recorded with {field} = {found}, but this engine has {field} = \
         {expected}; its routes do not apply here; {remedy}",
        remedy = REMEDY
    )]
    Binding {
        path: PathBuf,
        field: &'static str,
        found: String,
        expected: String,
    },
    #[error(
        "{path}: the heatmap has {found} but the expert cache has {expected}; {remedy}",
        remedy = REMEDY
    )]
    Shape {
        path: PathBuf,
        found: String,
        expected: String,
    },
    /// Counts of the wrong shape passed to [`Heatmap::add`] (a caller bug,
    /// reported rather than panicking).
    #[error("heatmap: {0}")]
    Counts(String),
}

impl HeatmapError {
    fn io(path: &Path, source: std::io::Error) -> Self {
        if source.kind() == std::io::ErrorKind::NotFound {
            HeatmapError::Missing {
                path: path.to_path_buf(),
            }
        } else {
            HeatmapError::Io {
                path: path.to_path_buf(),
                source,
            }
        }
    }
    fn invalid(path: &Path, reason: impl Into<String>) -> Self {
        HeatmapError::Invalid {
            path: path.to_path_buf(),
            reason: reason.into(),
        }
    }
}

/// Everything that changes which experts are routed to, or what an expert
/// index means in the cache. A heatmap is used only when all of it matches.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HeatmapBinding {
    /// blake3 of the model's `config.json` as stored (the expert cache's
    /// [`SourceIdentity`] `config_blake3`).
    pub model_config_hash: String,
    /// [`SourceIdentity::id`] of the expert cache (its directory name).
    pub cache_id: String,
    /// Expert cache container version ([`crate::FORMAT_VERSION`] of the writer).
    pub cache_format_version: u32,
    /// INT4 quantizer version of the expert cache.
    pub quantizer_version: u32,
    /// Precision of the attention path routes were recorded under ("bf16").
    pub attention_precision: String,
    /// Precision of the MLP block (its normed input feeds the router)
    /// routes were recorded under; a heatmap written before this field
    /// existed was recorded with a BF16 MLP block.
    #[serde(default = "bf16")]
    pub mlp_precision: String,
    /// Experts routed per token.
    pub top_k: usize,
}

/// The MLP precision of a binding that does not name one.
fn bf16() -> String {
    "bf16".into()
}

impl HeatmapBinding {
    /// The binding of an opened expert cache, for an engine routing `top_k`
    /// experts per token with attention in `attention_precision` and the
    /// MLP block in `mlp_precision`. Every cache-derived field is read from
    /// the cache's validated header, never recomputed.
    pub fn for_cache(
        cache: &ExpertCache,
        top_k: usize,
        attention_precision: &str,
        mlp_precision: &str,
    ) -> Self {
        let header = cache.header();
        HeatmapBinding {
            model_config_hash: config_hash(&header.source).to_string(),
            cache_id: header.source.id(),
            cache_format_version: header.format_version,
            quantizer_version: header.quantizer_version,
            attention_precision: attention_precision.to_string(),
            mlp_precision: mlp_precision.to_string(),
            top_k,
        }
    }

    /// Field by field: (name, file value, expected value) of the first
    /// difference, config and cache identity first.
    fn first_difference(&self, expected: &Self) -> Option<(&'static str, String, String)> {
        let fields: [(&'static str, String, String); 7] = [
            (
                "model_config_hash",
                self.model_config_hash.clone(),
                expected.model_config_hash.clone(),
            ),
            ("cache_id", self.cache_id.clone(), expected.cache_id.clone()),
            (
                "cache_format_version",
                self.cache_format_version.to_string(),
                expected.cache_format_version.to_string(),
            ),
            (
                "quantizer_version",
                self.quantizer_version.to_string(),
                expected.quantizer_version.to_string(),
            ),
            (
                "attention_precision",
                self.attention_precision.clone(),
                expected.attention_precision.clone(),
            ),
            (
                "mlp_precision",
                self.mlp_precision.clone(),
                expected.mlp_precision.clone(),
            ),
            ("top_k", self.top_k.to_string(), expected.top_k.to_string()),
        ];
        fields.into_iter().find(|(_, found, want)| found != want)
    }
}

/// The config hash recorded in a source identity (both kinds hold one).
fn config_hash(source: &SourceIdentity) -> &str {
    match source {
        SourceIdentity::Checkpoint { config_blake3, .. }
        | SourceIdentity::Synthetic { config_blake3, .. } => config_blake3,
    }
}

/// `heatmap-v1.json` in the directory of the expert cache file `cache_path`.
pub fn default_heatmap_path(cache_path: &Path) -> PathBuf {
    cache_path.with_file_name(HEATMAP_FILE_NAME)
}

/// Names a prompt text for [`Heatmap::prompts`]: `name (N bytes, blake3 HEX)`.
pub fn describe_prompt_text(name: &str, text: &[u8]) -> String {
    format!(
        "{name} ({} bytes, blake3 {})",
        text.len(),
        blake3::hash(text).to_hex()
    )
}

/// Route counts per (MoE layer, expert) over `tokens` prompt tokens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Heatmap {
    /// [`HEATMAP_VERSION`].
    pub format_version: u32,
    pub binding: HeatmapBinding,
    /// Decoder layer index of each MoE layer, ascending (as in the cache).
    pub moe_layers: Vec<usize>,
    pub num_experts: usize,
    /// `counts[j][e]`: times expert `e` of MoE layer `j` (decoder layer
    /// `moe_layers[j]`) was routed to.
    pub counts: Vec<Vec<u64>>,
    /// Prompt tokens recorded.
    pub tokens: u64,
    /// Where the prompts came from (asset name, sha256, prompt sizes).
    pub prompts: String,
    /// Writer, e.g. `krasis-runtime 0.1.0` (informational).
    pub created_by: String,
}

#[derive(Serialize)]
struct EnvelopeOut<'a> {
    checksum: String,
    body: &'a Value,
}

impl Heatmap {
    /// An empty heatmap (all counts zero) of the given shape.
    pub fn new(
        binding: HeatmapBinding,
        moe_layers: Vec<usize>,
        num_experts: usize,
        prompts: impl Into<String>,
        created_by: impl Into<String>,
    ) -> Self {
        let counts = vec![vec![0; num_experts]; moe_layers.len()];
        Heatmap {
            format_version: HEATMAP_VERSION,
            binding,
            moe_layers,
            num_experts,
            counts,
            tokens: 0,
            prompts: prompts.into(),
            created_by: created_by.into(),
        }
    }

    /// An empty heatmap shaped like `cache`.
    pub fn for_cache(
        cache: &ExpertCache,
        binding: HeatmapBinding,
        prompts: impl Into<String>,
        created_by: impl Into<String>,
    ) -> Self {
        Self::new(
            binding,
            cache.moe_layers().to_vec(),
            cache.num_experts(),
            prompts,
            created_by,
        )
    }

    /// Adds the route counts of `tokens` more prompt tokens
    /// (`counts[moe layer index][expert]`, the shape of this heatmap).
    pub fn add(&mut self, counts: &[Vec<u64>], tokens: u64) -> Result<(), HeatmapError> {
        if counts.len() != self.counts.len() {
            return Err(HeatmapError::Counts(format!(
                "got counts for {} MoE layers, the heatmap has {}",
                counts.len(),
                self.counts.len()
            )));
        }
        if let Some((j, row)) = counts
            .iter()
            .enumerate()
            .find(|(_, r)| r.len() != self.num_experts)
        {
            return Err(HeatmapError::Counts(format!(
                "MoE layer {j} has counts for {} experts, the heatmap has {}",
                row.len(),
                self.num_experts
            )));
        }
        for (acc, row) in self.counts.iter_mut().zip(counts) {
            for (a, &c) in acc.iter_mut().zip(row) {
                *a = a.saturating_add(c);
            }
        }
        self.tokens = self.tokens.saturating_add(tokens);
        Ok(())
    }

    /// Total routes recorded (sum of all counts).
    pub fn routes(&self) -> u64 {
        self.counts
            .iter()
            .flatten()
            .fold(0u64, |s, &c| s.saturating_add(c))
    }

    /// Every (MoE layer index, expert) pair, most routed first; equal counts
    /// in ascending layer, then ascending expert order (deterministic).
    pub fn ranked(&self) -> Vec<(usize, usize)> {
        let mut pairs: Vec<(u64, usize, usize)> = self
            .counts
            .iter()
            .enumerate()
            .flat_map(|(j, row)| row.iter().enumerate().map(move |(e, &c)| (c, j, e)))
            .collect();
        pairs.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
        pairs.into_iter().map(|(_, j, e)| (j, e)).collect()
    }

    /// Fraction of all recorded routes that went to the first `n` pairs of
    /// [`Self::ranked`] (0 when nothing was recorded).
    pub fn coverage_of(&self, n: usize) -> f64 {
        let total = self.routes();
        if total == 0 {
            return 0.0;
        }
        let mut counts: Vec<u64> = self.counts.iter().flatten().copied().collect();
        counts.sort_unstable_by(|a, b| b.cmp(a));
        let covered = counts
            .iter()
            .take(n)
            .fold(0u64, |s, &c| s.saturating_add(c));
        covered as f64 / total as f64
    }

    /// Checks that `moe_layers` and `num_experts` are those of the cache.
    pub fn check_shape(
        &self,
        path: &Path,
        moe_layers: &[usize],
        num_experts: usize,
    ) -> Result<(), HeatmapError> {
        if self.moe_layers != moe_layers {
            return Err(HeatmapError::Shape {
                path: path.to_path_buf(),
                found: format!("MoE layers {:?}", self.moe_layers),
                expected: format!("MoE layers {moe_layers:?}"),
            });
        }
        if self.num_experts != num_experts {
            return Err(HeatmapError::Shape {
                path: path.to_path_buf(),
                found: format!("{} experts per layer", self.num_experts),
                expected: format!("{num_experts} experts per layer"),
            });
        }
        Ok(())
    }

    /// Internal consistency (a checksum only proves the file is as written).
    fn validate(&self, path: &Path) -> Result<(), HeatmapError> {
        let bad = |r: String| Err(HeatmapError::invalid(path, r));
        if self.moe_layers.is_empty() {
            return bad("it lists no MoE layers".into());
        }
        if self.moe_layers.windows(2).any(|w| w[0] >= w[1]) {
            return bad(format!(
                "MoE layers {:?} are not strictly ascending",
                self.moe_layers
            ));
        }
        if self.num_experts == 0 {
            return bad("it has 0 experts per layer".into());
        }
        if self.binding.top_k == 0 || self.binding.top_k > self.num_experts {
            return bad(format!(
                "top_k {} is not in 1..={}",
                self.binding.top_k, self.num_experts
            ));
        }
        if self.counts.len() != self.moe_layers.len() {
            return bad(format!(
                "counts for {} layers, {} MoE layers listed",
                self.counts.len(),
                self.moe_layers.len()
            ));
        }
        if let Some((j, row)) = self
            .counts
            .iter()
            .enumerate()
            .find(|(_, r)| r.len() != self.num_experts)
        {
            return bad(format!(
                "MoE layer {j} has counts for {} experts, {} expected",
                row.len(),
                self.num_experts
            ));
        }
        Ok(())
    }

    /// Writes the heatmap to `path` atomically (temp file in the same
    /// directory, fsync, rename, directory fsync); the directory is created
    /// if needed. A reader sees the old file or the new one, never a part.
    pub fn save(&self, path: &Path) -> Result<(), HeatmapError> {
        self.validate(path)?;
        let body = serde_json::to_value(self).expect("heatmap serializes");
        let checksum = body_checksum(&body);
        let mut bytes = serde_json::to_vec_pretty(&EnvelopeOut {
            checksum,
            body: &body,
        })
        .expect("heatmap serializes");
        bytes.push(b'\n');
        write_atomic(path, &bytes)
    }

    /// Reads the heatmap at `path` and checks it against `expected`: refuses
    /// an unreadable or malformed file, a checksum mismatch, another format
    /// version, any binding difference and an inconsistent shape.
    pub fn load(path: &Path, expected: &HeatmapBinding) -> Result<Heatmap, HeatmapError> {
        let file = File::open(path).map_err(|e| HeatmapError::io(path, e))?;
        let len = file
            .metadata()
            .map_err(|e| HeatmapError::io(path, e))?
            .len();
        if len > MAX_FILE_BYTES {
            return Err(HeatmapError::invalid(
                path,
                format!("it is {len} bytes, far larger than any heatmap"),
            ));
        }
        let mut raw = Vec::with_capacity(len as usize);
        std::io::Read::read_to_end(&mut &file, &mut raw).map_err(|e| HeatmapError::io(path, e))?;
        let mut envelope: Value = serde_json::from_slice(&raw).map_err(|e| {
            HeatmapError::invalid(
                path,
                format!("it is not JSON ({e}); the file may be truncated or not a heatmap"),
            )
        })?;
        let Some(obj) = envelope.as_object_mut() else {
            return Err(HeatmapError::invalid(path, "it is not a JSON object"));
        };
        let stored = match obj.get("checksum") {
            Some(Value::String(s)) => s.clone(),
            _ => {
                return Err(HeatmapError::invalid(
                    path,
                    "it has no \"checksum\" string (not a Krasis heatmap)",
                ));
            }
        };
        let body = match obj.remove("body") {
            Some(b @ Value::Object(_)) => b,
            _ => {
                return Err(HeatmapError::invalid(
                    path,
                    "it has no \"body\" object (not a Krasis heatmap)",
                ));
            }
        };
        if obj.len() != 1 {
            let extra: Vec<&String> = obj.keys().filter(|k| *k != "checksum").collect();
            return Err(HeatmapError::invalid(
                path,
                format!("unexpected top-level fields {extra:?}"),
            ));
        }
        // The version decides how the rest is read (checksum rule included),
        // so it is checked first.
        match body.get("format_version").and_then(Value::as_u64) {
            Some(v) if v == u64::from(HEATMAP_VERSION) => {}
            Some(v) => {
                return Err(HeatmapError::Version {
                    path: path.to_path_buf(),
                    found: v,
                    expected: HEATMAP_VERSION,
                });
            }
            None => {
                return Err(HeatmapError::invalid(
                    path,
                    "its body has no integer \"format_version\"",
                ));
            }
        }
        let computed = body_checksum(&body);
        if computed != stored {
            return Err(HeatmapError::Checksum {
                path: path.to_path_buf(),
                stored,
                computed,
            });
        }
        let heatmap: Heatmap = serde_json::from_value(body)
            .map_err(|e| HeatmapError::invalid(path, format!("its body does not parse: {e}")))?;
        heatmap.validate(path)?;
        if let Some((field, found, want)) = heatmap.binding.first_difference(expected) {
            return Err(HeatmapError::Binding {
                path: path.to_path_buf(),
                field,
                found,
                expected: want,
            });
        }
        Ok(heatmap)
    }

    /// [`Self::load`] against the binding of `cache`, and checks that the
    /// heatmap's MoE layers and expert count are the cache's.
    pub fn load_for_cache(
        path: &Path,
        cache: &ExpertCache,
        top_k: usize,
        attention_precision: &str,
        mlp_precision: &str,
    ) -> Result<Heatmap, HeatmapError> {
        let expected = HeatmapBinding::for_cache(cache, top_k, attention_precision, mlp_precision);
        let heatmap = Self::load(path, &expected)?;
        heatmap.check_shape(path, cache.moe_layers(), cache.num_experts())?;
        Ok(heatmap)
    }
}

/// `v` with every object's keys in sorted order (independent of whether
/// serde_json preserves insertion order in this build).
fn sorted(v: &Value) -> Value {
    match v {
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            let mut out = serde_json::Map::new();
            for k in keys {
                out.insert(k.clone(), sorted(&m[k]));
            }
            Value::Object(out)
        }
        Value::Array(a) => Value::Array(a.iter().map(sorted).collect()),
        other => other.clone(),
    }
}

/// blake3 hex of the canonical (sorted keys, compact) JSON of `body`.
fn body_checksum(body: &Value) -> String {
    let canonical = serde_json::to_vec(&sorted(body)).expect("JSON value serializes");
    blake3::hash(&canonical).to_hex().to_string()
}

fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), HeatmapError> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|e| HeatmapError::io(dir, e))?;
    }
    let tmp = TempFile::beside(path);
    let mut file = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .open(&tmp.path)
        .map_err(|e| HeatmapError::io(&tmp.path, e))?;
    file.write_all(bytes)
        .and_then(|_| file.sync_all())
        .map_err(|e| HeatmapError::io(&tmp.path, e))?;
    drop(file);
    tmp.persist(path).map_err(|e| HeatmapError::io(path, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn binding() -> HeatmapBinding {
        HeatmapBinding {
            model_config_hash: "c0ffee".into(),
            cache_id: "0123456789abcdef0123".into(),
            cache_format_version: 1,
            quantizer_version: 1,
            attention_precision: "bf16".into(),
            mlp_precision: "bf16".into(),
            top_k: 2,
        }
    }

    fn sample() -> Heatmap {
        let mut h = Heatmap::new(binding(), vec![1, 2, 4], 4, "test text", "test");
        h.add(&[vec![5, 0, 3, 3], vec![1, 9, 0, 0], vec![3, 3, 0, 3]], 10)
            .unwrap();
        h
    }

    fn saved(dir: &Path) -> PathBuf {
        let path = dir.join(HEATMAP_FILE_NAME);
        sample().save(&path).unwrap();
        path
    }

    /// Rewrites the file's body with `edit` and a correct checksum.
    fn rewrite_signed(path: &Path, edit: impl FnOnce(&mut Value)) {
        let mut env: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        edit(&mut env["body"]);
        env["checksum"] = Value::String(body_checksum(&env["body"]));
        std::fs::write(path, serde_json::to_vec(&env).unwrap()).unwrap();
    }

    fn load_err(path: &Path) -> HeatmapError {
        Heatmap::load(path, &binding()).unwrap_err()
    }

    #[test]
    fn round_trip_and_default_path() {
        let tmp = tempfile::tempdir().unwrap();
        let path = saved(tmp.path());
        let back = Heatmap::load(&path, &binding()).unwrap();
        assert_eq!(back, sample());
        assert_eq!(back.tokens, 10);
        assert_eq!(back.routes(), 5 + 3 + 3 + 1 + 9 + 3 + 3 + 3);
        assert_eq!(
            default_heatmap_path(Path::new("/c/experts/abc/experts-int4-v1.kcache")),
            Path::new("/c/experts/abc/heatmap-v1.json")
        );
        assert_eq!(
            describe_prompt_text("t.txt", b"abc"),
            format!("t.txt (3 bytes, blake3 {})", blake3::hash(b"abc").to_hex())
        );
    }

    /// A heatmap written before the binding named the MLP precision was
    /// recorded with a BF16 MLP block: it loads for one, and is refused,
    /// naming the field, for a model whose MLP block is FP16 (glm4_moe).
    #[test]
    fn a_binding_without_mlp_precision_is_a_bf16_mlp_block() {
        let tmp = tempfile::tempdir().unwrap();
        let path = saved(tmp.path());
        rewrite_signed(&path, |body| {
            let b = body["binding"].as_object_mut().unwrap();
            assert!(b.remove("mlp_precision").is_some());
        });
        assert_eq!(Heatmap::load(&path, &binding()).unwrap(), sample());
        let fp16 = HeatmapBinding {
            mlp_precision: "fp16".into(),
            ..binding()
        };
        let e = Heatmap::load(&path, &fp16).unwrap_err().to_string();
        assert!(e.contains("mlp_precision = bf16"), "{e}");
    }

    #[test]
    fn reformatted_file_still_loads() {
        // Key order and whitespace are not part of the checksum.
        let tmp = tempfile::tempdir().unwrap();
        let path = saved(tmp.path());
        let env: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let compact = serde_json::to_vec(&sorted(&env)).unwrap();
        std::fs::write(&path, compact).unwrap();
        assert_eq!(Heatmap::load(&path, &binding()).unwrap(), sample());
    }

    #[test]
    fn ranking_is_by_count_then_layer_then_expert() {
        let h = sample();
        let r = h.ranked();
        assert_eq!(r.len(), 12);
        assert_eq!(
            r,
            vec![
                (1, 1), // 9
                (0, 0), // 5
                (0, 2), // 3: layer 0 first, expert ascending
                (0, 3),
                (2, 0),
                (2, 1),
                (2, 3),
                (1, 0), // 1
                (0, 1), // 0
                (1, 2),
                (1, 3),
                (2, 2),
            ]
        );
        // Deterministic regardless of how often it is computed.
        assert_eq!(h.ranked(), r);
        let total = h.routes() as f64;
        assert_eq!(h.coverage_of(0), 0.0);
        assert!((h.coverage_of(1) - 9.0 / total).abs() < 1e-12);
        assert!((h.coverage_of(2) - 14.0 / total).abs() < 1e-12);
        assert_eq!(h.coverage_of(12), 1.0);
        assert_eq!(h.coverage_of(1000), 1.0);
        let empty = Heatmap::new(binding(), vec![0], 3, "", "");
        assert_eq!(empty.coverage_of(3), 0.0);
        assert_eq!(empty.ranked(), vec![(0, 0), (0, 1), (0, 2)]);
    }

    #[test]
    fn add_refuses_wrong_shape_and_accumulates() {
        let mut h = sample();
        assert!(matches!(
            h.add(&[vec![0; 4], vec![0; 4]], 1),
            Err(HeatmapError::Counts(_))
        ));
        assert!(matches!(
            h.add(&[vec![0; 4], vec![0; 3], vec![0; 4]], 1),
            Err(HeatmapError::Counts(_))
        ));
        assert_eq!(h, sample(), "a refused add changes nothing");
        h.add(&[vec![1, 0, 0, 0], vec![0; 4], vec![0; 4]], 1)
            .unwrap();
        assert_eq!(h.counts[0][0], 6);
        assert_eq!(h.tokens, 11);
    }

    #[test]
    fn missing_and_garbage_files_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join(HEATMAP_FILE_NAME);
        let e = load_err(&path);
        assert!(matches!(e, HeatmapError::Missing { .. }), "{e}");
        assert!(e.to_string().contains("krasis-runtime heatmap --model DIR"));
        assert!(e.to_string().contains("--heatmap off"));

        for (bytes, what) in [
            (&b""[..], "not JSON"),
            (&b"\x00\xff garbage"[..], "not JSON"),
            (&b"[1, 2]"[..], "not a JSON object"),
            (&b"{\"body\": {}}"[..], "\"checksum\""),
            (&b"{\"checksum\": \"x\"}"[..], "\"body\""),
            (
                &b"{\"checksum\": \"x\", \"body\": {}}"[..],
                "format_version",
            ),
        ] {
            std::fs::write(&path, bytes).unwrap();
            let e = load_err(&path);
            assert!(matches!(e, HeatmapError::Invalid { .. }), "{e}");
            assert!(e.to_string().contains(what), "{what}: {e}");
            assert!(e.to_string().contains("--heatmap off"), "{e}");
        }
        // A directory is unreadable as a file: an error, not a panic.
        std::fs::remove_file(&path).unwrap();
        std::fs::create_dir(&path).unwrap();
        assert!(Heatmap::load(&path, &binding()).is_err());
    }

    #[test]
    fn truncated_file_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let path = saved(tmp.path());
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
        let e = load_err(&path);
        assert!(e.to_string().contains("truncated"), "{e}");
    }

    #[test]
    fn modified_value_is_a_checksum_mismatch() {
        let tmp = tempfile::tempdir().unwrap();
        let path = saved(tmp.path());
        let mut env: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        env["body"]["counts"][0][1] = Value::from(1000);
        std::fs::write(&path, serde_json::to_vec_pretty(&env).unwrap()).unwrap();
        let e = load_err(&path);
        assert!(matches!(e, HeatmapError::Checksum { .. }), "{e}");
        assert!(e.to_string().contains("modified or truncated"), "{e}");
        // A dropped field is a mismatch too.
        let path = saved(tmp.path());
        let mut env: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        env["body"].as_object_mut().unwrap().remove("prompts");
        std::fs::write(&path, serde_json::to_vec_pretty(&env).unwrap()).unwrap();
        assert!(matches!(load_err(&path), HeatmapError::Checksum { .. }));
    }

    #[test]
    fn other_format_version_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let path = saved(tmp.path());
        rewrite_signed(&path, |b| b["format_version"] = Value::from(2));
        let e = load_err(&path);
        assert!(
            matches!(
                e,
                HeatmapError::Version {
                    found: 2,
                    expected: HEATMAP_VERSION,
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("format version 2"), "{e}");
        // Also when the checksum no longer matches (the version decides the rule).
        let path = saved(tmp.path());
        let mut env: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        env["body"]["format_version"] = Value::from(7);
        std::fs::write(&path, serde_json::to_vec(&env).unwrap()).unwrap();
        assert!(matches!(
            load_err(&path),
            HeatmapError::Version { found: 7, .. }
        ));
    }

    #[test]
    fn every_binding_field_is_checked_and_named() {
        let tmp = tempfile::tempdir().unwrap();
        let path = saved(tmp.path());
        let variants: Vec<(&str, HeatmapBinding, &str, &str)> = vec![
            (
                "model_config_hash",
                HeatmapBinding {
                    model_config_hash: "beef".into(),
                    ..binding()
                },
                "c0ffee",
                "beef",
            ),
            (
                "cache_id",
                HeatmapBinding {
                    cache_id: "ffffffffffffffffffff".into(),
                    ..binding()
                },
                "0123456789abcdef0123",
                "ffffffffffffffffffff",
            ),
            (
                "cache_format_version",
                HeatmapBinding {
                    cache_format_version: 2,
                    ..binding()
                },
                "1",
                "2",
            ),
            (
                "quantizer_version",
                HeatmapBinding {
                    quantizer_version: 3,
                    ..binding()
                },
                "1",
                "3",
            ),
            (
                "attention_precision",
                HeatmapBinding {
                    attention_precision: "fp8".into(),
                    ..binding()
                },
                "bf16",
                "fp8",
            ),
            (
                "mlp_precision",
                HeatmapBinding {
                    mlp_precision: "fp16".into(),
                    ..binding()
                },
                "bf16",
                "fp16",
            ),
            (
                "top_k",
                HeatmapBinding {
                    top_k: 4,
                    ..binding()
                },
                "2",
                "4",
            ),
        ];
        for (name, expected, file_value, want) in variants {
            let e = Heatmap::load(&path, &expected).unwrap_err();
            match &e {
                HeatmapError::Binding {
                    field,
                    found,
                    expected,
                    ..
                } => {
                    assert_eq!(*field, name);
                    assert_eq!(found, file_value);
                    assert_eq!(expected, want);
                }
                other => panic!("{name}: expected a binding error, got {other}"),
            }
            let msg = e.to_string();
            assert!(msg.contains(&format!("{name} = {file_value}")), "{msg}");
            assert!(msg.contains(&format!("{name} = {want}")), "{msg}");
            assert!(msg.contains("krasis-runtime heatmap --model DIR"), "{msg}");
            assert!(msg.contains("--heatmap off"), "{msg}");
        }
    }

    #[test]
    fn shape_is_checked_against_the_cache_and_itself() {
        let tmp = tempfile::tempdir().unwrap();
        let path = saved(tmp.path());
        let h = Heatmap::load(&path, &binding()).unwrap();
        h.check_shape(&path, &[1, 2, 4], 4).unwrap();
        let e = h.check_shape(&path, &[1, 2, 3], 4).unwrap_err();
        assert!(matches!(e, HeatmapError::Shape { .. }), "{e}");
        assert!(e.to_string().contains("[1, 2, 4]") && e.to_string().contains("[1, 2, 3]"));
        let e = h.check_shape(&path, &[1, 2, 4], 8).unwrap_err();
        assert!(e.to_string().contains("8 experts"), "{e}");

        // Internally inconsistent bodies with a valid checksum are refused.
        type Edit = fn(&mut Value);
        let edits: Vec<(Edit, &str)> = vec![
            (
                |b: &mut Value| b["counts"].as_array_mut().unwrap().truncate(2),
                "counts for 2 layers",
            ),
            (
                |b: &mut Value| b["counts"][1].as_array_mut().unwrap().push(0.into()),
                "MoE layer 1 has counts for 5",
            ),
            (
                |b: &mut Value| b["moe_layers"] = serde_json::json!([2, 1, 4]),
                "strictly ascending",
            ),
            (
                |b: &mut Value| b["moe_layers"] = serde_json::json!([]),
                "no MoE layers",
            ),
            (|b: &mut Value| b["binding"]["top_k"] = 9.into(), "top_k 9"),
            (
                |b: &mut Value| b["counts"][0][0] = (-1).into(),
                "does not parse",
            ),
            (|b: &mut Value| b["extra"] = 1.into(), "does not parse"),
        ];
        for (edit, what) in edits {
            let path = saved(tmp.path());
            rewrite_signed(&path, edit);
            let e = load_err(&path);
            assert!(matches!(e, HeatmapError::Invalid { .. }), "{what}: {e}");
            assert!(e.to_string().contains(what), "{what}: {e}");
        }
        // save refuses to write an inconsistent heatmap.
        let mut bad = sample();
        bad.counts.pop();
        assert!(matches!(
            bad.save(&tmp.path().join("bad.json")),
            Err(HeatmapError::Invalid { .. })
        ));
        assert!(!tmp.path().join("bad.json").exists());
    }

    #[test]
    fn writes_are_atomic_and_leave_no_temp_files() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("new").join("dir");
        let path = dir.join(HEATMAP_FILE_NAME);
        sample().save(&path).unwrap();
        // Overwrite with a smaller heatmap: the file is replaced whole.
        let small = Heatmap::new(binding(), vec![0], 2, "p", "t");
        small.save(&path).unwrap();
        assert_eq!(Heatmap::load(&path, &binding()).unwrap(), small);
        let names = |d: &Path| -> Vec<String> {
            let mut v: Vec<String> = std::fs::read_dir(d)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            v.sort();
            v
        };
        assert_eq!(names(&dir), vec![HEATMAP_FILE_NAME.to_string()]);

        // A failing rename (target is a non-empty directory) leaves the
        // target untouched and no temp file behind.
        let blocked = dir.join("blocked.json");
        std::fs::create_dir(&blocked).unwrap();
        std::fs::write(blocked.join("keep"), b"x").unwrap();
        assert!(matches!(
            sample().save(&blocked),
            Err(HeatmapError::Io { .. })
        ));
        assert_eq!(
            names(&dir),
            vec!["blocked.json".to_string(), HEATMAP_FILE_NAME.to_string()]
        );
        assert_eq!(names(&blocked), vec!["keep".to_string()]);
    }

    #[test]
    fn binding_comes_from_the_cache_header() {
        use krasis_model::synth::{
            SynthDtype, SynthOptions, SynthSpec, TokenizerSource, synthesize,
        };
        let tmp = tempfile::tempdir().unwrap();
        let model = tmp.path().join("model");
        let spec = SynthSpec::new(
            "tiny",
            7,
            SynthDtype::Bf16,
            0.0,
            &[("vocab_size".into(), serde_json::json!(512))],
        )
        .unwrap();
        let mut opts = SynthOptions::new(spec);
        opts.tokenizer = TokenizerSource::None;
        synthesize(&opts, &model).unwrap();
        let source = crate::ModelSource::open(&model).unwrap();
        let path = tmp.path().join("cache").join(crate::FILE_NAME);
        let build = crate::BuildOptions {
            progress_bar: false,
            ..crate::BuildOptions::default()
        };
        let cache = crate::ensure_cache_at(&source, &path, &build)
            .unwrap()
            .cache;
        let top_k = source.config().geometry().top_k;
        let b = HeatmapBinding::for_cache(&cache, top_k, "bf16", "bf16");
        let config = std::fs::read(model.join("config.json")).unwrap();
        assert_eq!(
            b.model_config_hash,
            blake3::hash(&config).to_hex().to_string()
        );
        assert_eq!(b.cache_id, source.identity().id());
        assert_eq!(b.cache_format_version, crate::FORMAT_VERSION);
        assert_eq!(b.quantizer_version, crate::QUANTIZER_VERSION);
        assert_eq!(b.attention_precision, "bf16");
        assert_eq!(b.mlp_precision, "bf16");
        assert_eq!(b.top_k, top_k);

        let mut h = Heatmap::for_cache(&cache, b.clone(), "p", "t");
        let counts = vec![vec![1; cache.num_experts()]; cache.moe_layers().len()];
        h.add(&counts, 1).unwrap();
        let hp = default_heatmap_path(cache.path());
        assert_eq!(hp, tmp.path().join("cache").join(HEATMAP_FILE_NAME));
        h.save(&hp).unwrap();
        assert_eq!(
            Heatmap::load_for_cache(&hp, &cache, top_k, "bf16", "bf16").unwrap(),
            h
        );
        let e = Heatmap::load_for_cache(&hp, &cache, top_k, "fp8", "bf16").unwrap_err();
        assert!(e.to_string().contains("attention_precision = bf16"), "{e}");
        // The MLP precision binds too (glm4_moe's FP16 MLP block).
        let e = Heatmap::load_for_cache(&hp, &cache, top_k, "bf16", "fp16").unwrap_err();
        assert!(e.to_string().contains("mlp_precision = bf16"), "{e}");
    }
}
