//! Full verification of a cache against its source: every expert is
//! quantized (INT4) or copied (MXFP4) again and compared byte for byte, and (for checkpoints) the
//! source content hash is recomputed and compared with the header. Costs as
//! much CPU as a build (no writes); `build-cache --verify` runs it.

use crate::cache::ExpertCache;
use crate::error::CacheError;
use crate::source::ModelSource;
use rayon::prelude::*;
use std::time::{Duration, Instant};

#[derive(Debug, Clone)]
pub struct VerifyReport {
    pub experts: usize,
    pub source_bytes: u64,
    pub elapsed: Duration,
}

/// Checks that `cache` is exactly what `source` quantizes to.
pub fn verify_against_source(
    cache: &ExpertCache,
    source: &ModelSource,
) -> Result<VerifyReport, CacheError> {
    let start = Instant::now();
    if cache.format() != source.format() {
        return Err(CacheError::FormatMismatch {
            path: cache.path().to_path_buf(),
            cached: cache.format(),
            wanted: source.format(),
        });
    }
    if cache.source() != source.identity() {
        return Err(CacheError::Stale {
            path: cache.path().to_path_buf(),
            reason: "it was built from a different source".into(),
        });
    }
    let stride = cache.layout().expert_stride;
    let mut content = blake3::Hasher::new();
    for &layer in cache.moe_layers() {
        let region = cache.layer_bytes(layer);
        let hashes: Vec<Option<blake3::Hash>> = region
            .par_chunks(stride)
            .enumerate()
            .map_init(
                || vec![0u8; stride],
                |buf, (e, stored)| {
                    let h = source.write_expert(layer, e, buf)?;
                    if buf.as_slice() != stored {
                        let at = buf.iter().zip(stored).position(|(a, b)| a != b).unwrap_or(0);
                        return Err(CacheError::Invalid {
                            path: cache.path().to_path_buf(),
                            reason: format!(
                                "expert {e} of layer {layer} differs from a fresh build from the source at byte {at} of its block"
                            ),
                        });
                    }
                    Ok(h)
                },
            )
            .collect::<Result<_, _>>()?;
        let mut layer_content = blake3::Hasher::new();
        for h in hashes.iter().flatten() {
            layer_content.update(h.as_bytes());
        }
        content.update(layer_content.finalize().as_bytes());
    }
    if let Some(want) = &cache.header().source_content_blake3 {
        let got = content.finalize().to_hex().to_string();
        if &got != want {
            return Err(CacheError::Stale {
                path: cache.path().to_path_buf(),
                reason: format!(
                    "the expert tensors' content changed since the build (blake3 {got}, header says {want})"
                ),
            });
        }
    }
    Ok(VerifyReport {
        experts: cache.moe_layers().len() * cache.num_experts(),
        source_bytes: source.total_source_bytes(),
        elapsed: start.elapsed(),
    })
}
