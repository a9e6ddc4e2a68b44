//! Opening and reading a built cache. The file is memory-mapped; opening
//! validates the preamble, header, geometry and file size always, and the
//! per-layer blake3 checksums (in parallel over layers) unless the caller
//! explicitly asks for [`Verify::HeaderOnly`].

use crate::error::CacheError;
use crate::format::{FORMAT_VERSION, Header, SourceIdentity, decode};
use crate::layout::{ExpertFormat, ExpertLayout};
use crate::quant::QUANTIZER_VERSION;
use krasis_model::ModelConfig;
use memmap2::Mmap;
use rayon::prelude::*;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// How much of the file [`ExpertCache::open_with`] checks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Verify {
    /// Header, geometry, size and every layer's blake3 (the default).
    #[default]
    Checksums,
    /// Header, geometry and size only: for callers that verified the same
    /// file before and need a fast start. Corruption inside a layer is then
    /// not detected.
    HeaderOnly,
}

/// A validated, memory-mapped expert cache (INT4 or MXFP4 experts).
pub struct ExpertCache {
    path: PathBuf,
    map: Mmap,
    header: Header,
    layout: ExpertLayout,
    /// Decoder layer -> position among MoE layers.
    position: Vec<Option<usize>>,
    checksum_time: Option<Duration>,
}

impl std::fmt::Debug for ExpertCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertCache")
            .field("path", &self.path)
            .field("moe_layers", &self.header.moe_layers.len())
            .field("num_experts", &self.header.num_experts)
            .field("bytes", &self.map.len())
            .finish()
    }
}

impl ExpertCache {
    /// Opens the cache at `path` for the model described by `config`, in
    /// the format the model's experts are cached in
    /// ([`crate::ModelSource::format`] of its directory), verifying every
    /// layer checksum.
    pub fn open(
        path: &Path,
        config: &ModelConfig,
        format: ExpertFormat,
    ) -> Result<Self, CacheError> {
        Self::open_with(path, config, format, Verify::Checksums)
    }

    /// [`Self::open`] with a choice of how much to verify. A header whose
    /// expert format is not `format` is refused
    /// ([`CacheError::FormatMismatch`], naming both).
    pub fn open_with(
        path: &Path,
        config: &ModelConfig,
        format: ExpertFormat,
        verify: Verify,
    ) -> Result<Self, CacheError> {
        let file = File::open(path).map_err(|e| CacheError::io(path, e))?;
        // SAFETY: read-only map of a file only ever replaced by rename, never
        // rewritten in place by krasis; a user editing it underneath is out
        // of scope as for any mmap reader.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| CacheError::io(path, e))?;
        let (_, header) = decode(path, &map)?;
        let layout = check_header(path, &header, config, format)?;
        let mut position = vec![None; header.num_layers];
        for (j, &l) in header.moe_layers.iter().enumerate() {
            position[l] = Some(j);
        }
        let mut cache = ExpertCache {
            path: path.to_path_buf(),
            map,
            header,
            layout,
            position,
            checksum_time: None,
        };
        if verify == Verify::Checksums {
            cache.checksum_time = Some(cache.verify_checksums()?);
        }
        Ok(cache)
    }

    /// Recomputes every layer's blake3 (layers in parallel) and returns the
    /// time it took; the first mismatching layer is named in the error.
    pub fn verify_checksums(&self) -> Result<Duration, CacheError> {
        let start = Instant::now();
        let bad = self
            .header
            .layers
            .par_iter()
            .filter(|e| {
                let bytes = &self.map[e.offset as usize..(e.offset + e.bytes) as usize];
                blake3::hash(bytes).to_hex().as_str() != e.blake3
            })
            .min_by_key(|e| e.layer);
        if let Some(e) = bad {
            return Err(CacheError::Checksum {
                path: self.path.clone(),
                layer: e.layer,
                offset: e.offset,
                end: e.offset + e.bytes,
            });
        }
        Ok(start.elapsed())
    }

    /// Time the checksum pass of `open` took (`None` with [`Verify::HeaderOnly`]).
    pub fn checksum_time(&self) -> Option<Duration> {
        self.checksum_time
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
    pub fn header(&self) -> &Header {
        &self.header
    }
    pub fn source(&self) -> &SourceIdentity {
        &self.header.source
    }
    /// Per-expert byte layout (same for every expert).
    pub fn layout(&self) -> ExpertLayout {
        self.layout
    }
    /// Precision and group of the experts (from the validated header).
    pub fn format(&self) -> ExpertFormat {
        self.layout.format
    }
    /// Decoder layer indices that have experts, in file order.
    pub fn moe_layers(&self) -> &[usize] {
        &self.header.moe_layers
    }
    pub fn num_experts(&self) -> usize {
        self.header.num_experts
    }
    /// Bytes of one layer's region (`num_experts * expert_stride`).
    pub fn layer_len(&self) -> usize {
        self.header.layer_bytes as usize
    }
    /// The whole mapped file (for host registration; page-aligned start).
    pub fn file_bytes(&self) -> &[u8] {
        &self.map
    }
    /// The expert regions of all layers (from the data offset to the end).
    pub fn data(&self) -> &[u8] {
        &self.map[self.header.data_offset as usize..]
    }
    pub fn data_offset(&self) -> u64 {
        self.header.data_offset
    }

    fn position_of(&self, layer: usize) -> Option<usize> {
        self.position.get(layer).copied().flatten()
    }

    /// File offset of decoder layer `layer`'s region, `None` if it has no experts.
    pub fn try_layer_offset(&self, layer: usize) -> Option<u64> {
        self.position_of(layer)
            .map(|j| self.header.data_offset + j as u64 * self.header.layer_bytes)
    }

    /// File offset of decoder layer `layer`'s region.
    ///
    /// # Panics
    /// If `layer` is not one of [`Self::moe_layers`] (a caller bug: layer
    /// indices come from the model config, never from requests).
    pub fn layer_offset(&self, layer: usize) -> u64 {
        self.try_layer_offset(layer).unwrap_or_else(|| {
            panic!(
                "decoder layer {layer} has no routed experts in {}",
                self.path.display()
            )
        })
    }

    /// The contiguous region of decoder layer `layer`, `None` if it has no experts.
    pub fn try_layer_bytes(&self, layer: usize) -> Option<&[u8]> {
        let off = self.try_layer_offset(layer)? as usize;
        Some(&self.map[off..off + self.layer_len()])
    }

    /// The contiguous region of decoder layer `layer`.
    ///
    /// # Panics
    /// As [`Self::layer_offset`].
    pub fn layer_bytes(&self, layer: usize) -> &[u8] {
        let off = self.layer_offset(layer) as usize;
        &self.map[off..off + self.layer_len()]
    }

    /// Expert `expert` of decoder layer `layer` (one `expert_stride` block),
    /// `None` if out of range.
    pub fn try_expert_bytes(&self, layer: usize, expert: usize) -> Option<&[u8]> {
        if expert >= self.num_experts() {
            return None;
        }
        let s = self.layout.expert_stride;
        self.try_layer_bytes(layer)
            .map(|l| &l[expert * s..(expert + 1) * s])
    }

    /// Expert `expert` of decoder layer `layer`: one contiguous block of
    /// `layout().expert_stride` bytes at `layer_offset(layer) + expert * stride`.
    ///
    /// # Panics
    /// If `layer` has no experts or `expert >= num_experts()`.
    pub fn expert_bytes(&self, layer: usize, expert: usize) -> &[u8] {
        self.try_expert_bytes(layer, expert).unwrap_or_else(|| {
            panic!(
                "expert {expert} of layer {layer} is not in {} ({} experts, MoE layers {:?})",
                self.path.display(),
                self.num_experts(),
                self.moe_layers()
            )
        })
    }
}

/// Checks the header against this build and against `config`; returns the layout.
fn check_header(
    path: &Path,
    h: &Header,
    config: &ModelConfig,
    format: ExpertFormat,
) -> Result<ExpertLayout, CacheError> {
    let stale = |reason: String| CacheError::Stale {
        path: path.to_path_buf(),
        reason,
    };
    let mismatch = |reason: String| CacheError::Mismatch {
        path: path.to_path_buf(),
        reason,
    };
    let invalid = |reason: String| CacheError::invalid(path, reason);
    if h.format_version != FORMAT_VERSION {
        return Err(stale(format!(
            "format version {} (this build: {FORMAT_VERSION})",
            h.format_version
        )));
    }
    if h.quantizer_version != QUANTIZER_VERSION {
        return Err(stale(format!(
            "quantizer version {} (this build: version {QUANTIZER_VERSION})",
            h.quantizer_version
        )));
    }
    if h.expert_format != format {
        return Err(CacheError::FormatMismatch {
            path: path.to_path_buf(),
            cached: h.expert_format,
            wanted: format,
        });
    }
    let g = config.geometry();
    let want_moe: Vec<usize> = g.moe_layers().collect();
    let checks: [(&str, String, String); 6] = [
        (
            "model_type",
            h.model_type.clone(),
            config.model_type().to_string(),
        ),
        ("hidden_size", h.hidden.to_string(), g.hidden.to_string()),
        (
            "moe_intermediate_size",
            h.expert_intermediate.to_string(),
            g.expert_intermediate.to_string(),
        ),
        (
            "num_experts",
            h.num_experts.to_string(),
            g.num_experts.to_string(),
        ),
        (
            "num_hidden_layers",
            h.num_layers.to_string(),
            g.num_layers.to_string(),
        ),
        (
            "MoE layers",
            format!("{:?}", h.moe_layers),
            format!("{want_moe:?}"),
        ),
    ];
    for (what, cached, model) in checks {
        if cached != model {
            return Err(mismatch(format!(
                "{what} is {cached} in the cache but {model} in the model"
            )));
        }
    }
    let layout = ExpertLayout::new(
        h.expert_format,
        h.hidden,
        h.expert_intermediate,
        h.expert_bias,
    )
    .ok_or_else(|| {
        invalid(format!(
            "impossible geometry {}x{} for {} experts{}",
            h.hidden,
            h.expert_intermediate,
            h.expert_format,
            if h.expert_bias { " with biases" } else { "" }
        ))
    })?;
    if h.expert_stride != layout.expert_stride
        || h.layer_bytes != (layout.expert_stride * h.num_experts) as u64
    {
        return Err(invalid(format!(
            "expert stride {} / layer size {} do not match the layout ({} / {})",
            h.expert_stride,
            h.layer_bytes,
            layout.expert_stride,
            layout.expert_stride * h.num_experts
        )));
    }
    if h.layers.len() != h.moe_layers.len() {
        return Err(invalid(format!(
            "{} layer entries for {} MoE layers",
            h.layers.len(),
            h.moe_layers.len()
        )));
    }
    for (j, (e, &l)) in h.layers.iter().zip(&h.moe_layers).enumerate() {
        let offset = h.data_offset + j as u64 * h.layer_bytes;
        if e.layer != l || e.offset != offset || e.bytes != h.layer_bytes {
            return Err(invalid(format!(
                "layer entry {j} (layer {}, offset {}, {} bytes) is not where the format puts layer {l} ({offset}, {} bytes)",
                e.layer, e.offset, e.bytes, h.layer_bytes
            )));
        }
    }
    let end = h.data_offset + h.layer_bytes * h.moe_layers.len() as u64;
    if end != h.file_bytes {
        return Err(invalid(format!(
            "layers end at byte {end} but the file has {} bytes",
            h.file_bytes
        )));
    }
    Ok(layout)
}
