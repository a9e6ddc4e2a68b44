//! On-disk container of the cache (format version 2).
//!
//! ```text
//! [0, 128)              preamble: magic "KRSXEXP2", format version (u32 LE),
//!                       reserved u32, header JSON length (u64), data offset
//!                       (u64), file length (u64), blake3 of the header JSON
//!                       (32 bytes), zero padding
//! [128, 128+len)        header JSON (`Header`)
//! [.., data_offset)     zero padding; data_offset is a multiple of 4096
//! [data_offset, ..)     one region per MoE layer, in decoder order; region j
//!                       starts at data_offset + j * layer_bytes and holds
//!                       num_experts blocks of `ExpertLayout::expert_stride`
//! ```
//! The builder writes the preamble last, so a file whose build was
//! interrupted has no magic and is never mistaken for a cache.
//!
//! Format 2 records the expert precision and group ([`ExpertFormat`]) in the
//! header. Its magic and file name are precision-neutral and differ from
//! format 1's ("KRSXINT4", `experts-int4-v1.kcache`): a format-1 reader finds
//! no file of its name and refuses this magic, and this reader recognises a
//! format-1 file by its magic or its name and refuses it with the rebuild
//! command ([`CacheError::OldFormat`]) instead of misreading or replacing it.

use crate::error::CacheError;
use crate::layout::ExpertFormat;
use serde::{Deserialize, Serialize};
use std::path::Path;

pub const MAGIC: [u8; 8] = *b"KRSXEXP2";
/// Bump on any change to this container, the header fields, or `layout.rs`.
pub const FORMAT_VERSION: u32 = 2;
/// Magic of format-1 caches (INT4 group 128 only), recognised to refuse them.
pub const V1_MAGIC: [u8; 8] = *b"KRSXINT4";
/// Name of a format-1 cache file, next to where format 2 puts its file.
pub const V1_FILE_NAME: &str = "experts-int4-v1.kcache";
pub const PREAMBLE_BYTES: usize = 128;
pub const DATA_ALIGN: usize = 4096;
/// Name of the cache file inside its directory.
pub const FILE_NAME: &str = "experts-v2.kcache";
/// Upper bound on the header JSON, far above any real model (a few KiB per
/// layer); it stops a corrupt length field from driving a huge parse.
const MAX_HEADER_BYTES: u64 = 64 << 20;

/// What the cache was built from. Computed from the source without reading
/// the weight data, so checking a cache against its source is cheap; the
/// content hash of the weights is recorded separately in [`Header`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SourceIdentity {
    /// Expert tensors read from safetensors.
    Checkpoint {
        /// blake3 of `config.json` as stored.
        config_blake3: String,
        /// Number of routed-expert tensors (3 per expert per MoE layer for
        /// per-expert storage; per MoE layer the fused MXFP4 blocks, scales
        /// and biases otherwise).
        expert_tensors: usize,
        /// blake3 over "name dtype shape" lines of every expert tensor, in
        /// (layer, expert, gate/up/down) order, or (layer, gate_up blocks,
        /// scales, bias, down blocks, scales, bias) for fused MXFP4.
        tensor_table_blake3: String,
        /// Distinct dtypes of the expert tensors ("BF16", "U8", ...).
        dtypes: Vec<String>,
        /// blake3 over a few KiB of expert data per layer (start of the first
        /// expert's gate, middle of the middle expert's up, end of the last
        /// expert's down; for fused MXFP4 the same three places of the
        /// gate_up blocks, down blocks and down scales): catches a different revision or seed with the
        /// same names and shapes at open time for ~3 page reads per layer.
        /// Full content is checked by `build-cache --verify`.
        expert_sample_blake3: String,
    },
    /// Experts generated from a `krasis_synth.json` recipe (a checkpoint
    /// written with `--experts-in-cache-only`).
    Synthetic {
        config_blake3: String,
        /// blake3 of `krasis_synth.json` as stored (generator version, seed,
        /// options).
        spec_blake3: String,
        /// The parsed recipe, recorded for humans and tools.
        spec: serde_json::Value,
    },
}

impl SourceIdentity {
    /// Short stable id used as the cache directory name.
    pub fn id(&self) -> String {
        let json = serde_json::to_vec(self).expect("identity serializes");
        blake3::hash(&json).to_hex()[..20].to_string()
    }
}

/// One MoE layer's region.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerEntry {
    /// Decoder layer index.
    pub layer: usize,
    /// Absolute file offset of the region.
    pub offset: u64,
    pub bytes: u64,
    /// blake3 of the region, hex.
    pub blake3: String,
}

/// The header JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Header {
    pub format_version: u32,
    /// INT4 quantizer rule version (recorded for MXFP4 too, where the
    /// bits are copied and the rule is unused).
    pub quantizer_version: u32,
    /// Precision and group of the experts; the layout derives from it.
    pub expert_format: ExpertFormat,
    /// Whether expert blocks carry bias arrays (see `layout.rs`).
    pub expert_bias: bool,
    pub model_type: String,
    pub hidden: usize,
    pub expert_intermediate: usize,
    pub num_experts: usize,
    pub num_layers: usize,
    pub moe_layers: Vec<usize>,
    pub expert_stride: usize,
    pub layer_bytes: u64,
    pub data_offset: u64,
    pub file_bytes: u64,
    pub source: SourceIdentity,
    /// Checkpoints: blake3 over the per-layer hashes of the per-expert
    /// hashes of the raw tensor bytes (gate ‖ up ‖ down; for fused MXFP4
    /// the expert's gate_up blocks ‖ scales ‖ bias ‖ down blocks ‖ scales ‖
    /// bias as stored), hex. `None` for
    /// synthetic sources, whose recipe already determines every value.
    pub source_content_blake3: Option<String>,
    /// `krasis-cache <version>` of the writer, informational.
    pub writer: String,
    pub layers: Vec<LayerEntry>,
}

/// Decoded preamble.
#[derive(Debug, Clone, Copy)]
pub struct Preamble {
    pub version: u32,
    pub header_len: u64,
    pub data_offset: u64,
    pub file_len: u64,
    pub header_hash: [u8; 32],
}

pub fn encode_preamble(
    header_json: &[u8],
    data_offset: u64,
    file_len: u64,
) -> [u8; PREAMBLE_BYTES] {
    let mut p = [0u8; PREAMBLE_BYTES];
    p[0..8].copy_from_slice(&MAGIC);
    p[8..12].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    p[16..24].copy_from_slice(&(header_json.len() as u64).to_le_bytes());
    p[24..32].copy_from_slice(&data_offset.to_le_bytes());
    p[32..40].copy_from_slice(&file_len.to_le_bytes());
    p[40..72].copy_from_slice(blake3::hash(header_json).as_bytes());
    p
}

/// Checks magic, version and the self-consistency of the preamble against
/// the real file length; returns the parsed header.
pub fn decode(path: &Path, file: &[u8]) -> Result<(Preamble, Header), CacheError> {
    let bad = |r: String| CacheError::invalid(path, r);
    if file.len() < PREAMBLE_BYTES {
        return Err(bad(format!(
            "file is {} bytes, shorter than the {PREAMBLE_BYTES}-byte preamble (truncated or an interrupted build)",
            file.len()
        )));
    }
    let version = u32::from_le_bytes(file[8..12].try_into().expect("4 bytes"));
    if file[0..8] == V1_MAGIC {
        return Err(CacheError::old_format(path, version));
    }
    if file[0..8] != MAGIC {
        return Err(bad(
            "wrong magic bytes (not an expert cache, or an interrupted build)".into(),
        ));
    }
    let u64_at = |o: usize| u64::from_le_bytes(file[o..o + 8].try_into().expect("8 bytes"));
    if version != FORMAT_VERSION {
        return Err(CacheError::Stale {
            path: path.to_path_buf(),
            reason: format!("format version {version}, this build reads version {FORMAT_VERSION}"),
        });
    }
    let pre = Preamble {
        version,
        header_len: u64_at(16),
        data_offset: u64_at(24),
        file_len: u64_at(32),
        header_hash: file[40..72].try_into().expect("32 bytes"),
    };
    if pre.file_len != file.len() as u64 {
        return Err(bad(format!(
            "file is {} bytes but its header says {} (truncated or appended to)",
            file.len(),
            pre.file_len
        )));
    }
    let header_end = PREAMBLE_BYTES as u64 + pre.header_len;
    if pre.header_len > MAX_HEADER_BYTES
        || header_end > pre.data_offset
        || pre.data_offset > pre.file_len
    {
        return Err(bad(format!(
            "inconsistent preamble (header {} bytes, data at {}, file {} bytes)",
            pre.header_len, pre.data_offset, pre.file_len
        )));
    }
    let json = &file[PREAMBLE_BYTES..header_end as usize];
    if blake3::hash(json).as_bytes() != &pre.header_hash {
        return Err(bad("header checksum mismatch (corrupt header)".into()));
    }
    let header: Header = serde_json::from_slice(json)
        .map_err(|e| bad(format!("header JSON does not parse: {e}")))?;
    if header.data_offset != pre.data_offset || header.file_bytes != pre.file_len {
        return Err(bad(
            "header and preamble disagree on data offset or size".into()
        ));
    }
    Ok((pre, header))
}

/// Hex placeholder with the length of a blake3 hex digest, so the header can
/// be sized before the checksums are known.
pub const HASH_PLACEHOLDER: &str =
    "0000000000000000000000000000000000000000000000000000000000000000";

pub fn align_up(x: u64, a: u64) -> u64 {
    x.div_ceil(a) * a
}
