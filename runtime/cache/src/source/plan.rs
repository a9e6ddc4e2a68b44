//! Which expert format a model's cache uses, and how its experts are
//! stored: one plan for all MoE layers, the format chosen from it (native
//! MXFP4 for MXFP4 checkpoints, INT4 with the largest fitting group for
//! float ones), and the refusals where no exact cache is possible.

use crate::error::CacheError;
use crate::layout::{ExpertFormat, ExpertLayout, ExpertPrecision};
use krasis_model::{ExpertStorage, FusedMxfp4Names, ModelConfig};
use std::path::Path;

/// How the MoE layers' experts are stored: one plan for all of them (a
/// checkpoint mixing per-expert and fused layers is refused).
#[derive(Debug, Clone)]
pub(super) enum Storage {
    PerExpert,
    /// Names per MoE layer, in `moe_layers` order.
    FusedMxfp4(Vec<FusedMxfp4Names>),
}

fn storage_plan(
    moe_layers: &[usize],
    storage: &dyn Fn(usize) -> ExpertStorage,
    dir: &Path,
) -> Result<Storage, CacheError> {
    let mut fused = Vec::new();
    for &l in moe_layers {
        match storage(l) {
            ExpertStorage::PerExpert => {}
            ExpertStorage::FusedMxfp4(n) => fused.push(n),
        }
    }
    match fused.len() {
        0 => Ok(Storage::PerExpert),
        n if n == moe_layers.len() => {
            for n in &fused {
                if n.gate_up_bias.is_some() != n.down_bias.is_some() {
                    return Err(CacheError::UnsupportedSource {
                        dir: dir.to_path_buf(),
                        reason: format!(
                            "MXFP4 experts with a bias on only one projection ({:?} / {:?}); the MXFP4 block layout has both or neither",
                            n.gate_up_bias, n.down_bias
                        ),
                    });
                }
            }
            Ok(Storage::FusedMxfp4(fused))
        }
        n => Err(CacheError::UnsupportedSource {
            dir: dir.to_path_buf(),
            reason: format!(
                "{n} of {} MoE layers store MXFP4 experts and the rest float experts; one expert cache holds one format",
                moe_layers.len()
            ),
        }),
    }
}

/// The storage plan and expert layout of the cache of `config` in
/// `precision` (`None`: the model's own).
pub(super) fn plan_layout(
    config: &ModelConfig,
    moe_layers: &[usize],
    precision: Option<ExpertPrecision>,
    storage: &dyn Fn(usize) -> ExpertStorage,
    dir: &Path,
) -> Result<(Storage, ExpertLayout), CacheError> {
    let g = config.geometry();
    let plan = storage_plan(moe_layers, storage, dir)?;
    let format = choose_format(config, &plan, precision, dir)?;
    let has_bias = match &plan {
        Storage::FusedMxfp4(n) => n[0].gate_up_bias.is_some(),
        Storage::PerExpert => false,
    };
    if let Storage::FusedMxfp4(n) = &plan
        && n.iter().any(|n| n.gate_up_bias.is_some() != has_bias)
    {
        return Err(CacheError::UnsupportedSource {
            dir: dir.to_path_buf(),
            reason: "some MoE layers have expert biases and some not; one expert layout holds one"
                .into(),
        });
    }
    let layout = ExpertLayout::new(format, g.hidden, g.expert_intermediate, has_bias)
        .expect("choose_format checked the geometry");
    Ok((plan, layout))
}

/// The expert layout of the cache `ModelSource::open` would build for the
/// model `config` in `dir` (its own precision), without opening the
/// checkpoint: for reports and estimates.
pub fn model_layout(config: &ModelConfig, dir: &Path) -> Result<ExpertLayout, CacheError> {
    let moe_layers: Vec<usize> = config.geometry().moe_layers().collect();
    let storage = |l: usize| config.expert_storage(l);
    plan_layout(config, &moe_layers, None, &storage, dir).map(|(_, l)| l)
}

/// The expert format of a model whose experts are stored as `storage`,
/// with `requested` precision (`None`: the model's own). MXFP4 checkpoints
/// are cached natively (never re-quantised to INT4); float checkpoints as
/// INT4 with the largest group dividing H and I (never "converted" to MXFP4).
fn choose_format(
    config: &ModelConfig,
    storage: &Storage,
    requested: Option<ExpertPrecision>,
    dir: &Path,
) -> Result<ExpertFormat, CacheError> {
    let g = config.geometry();
    if g.num_moe_layers() == 0 || g.num_experts == 0 {
        return Err(CacheError::UnsupportedSource {
            dir: dir.to_path_buf(),
            reason: "the model has no routed experts, so there is nothing to cache".into(),
        });
    }
    let refuse = |reason: String| CacheError::Precision {
        dir: dir.to_path_buf(),
        reason,
    };
    let (h, i) = (g.hidden, g.expert_intermediate);
    match (storage, requested) {
        (Storage::FusedMxfp4(_), Some(ExpertPrecision::Int4)) => Err(refuse(format!(
            "the checkpoint stores its {} experts in MXFP4; precision int4 would re-quantise them, which krasis does not do: use precision mxfp4 (this model's default), which keeps the checkpoint's bits",
            config.model_type()
        ))),
        (Storage::FusedMxfp4(_), _) => {
            if ExpertLayout::new(ExpertFormat::Mxfp4, h, i, false).is_none() {
                return Err(CacheError::UnsupportedSource {
                    dir: dir.to_path_buf(),
                    reason: format!(
                        "hidden_size {h} and expert intermediate size {i} must both be multiples of 32 for MXFP4 blocks"
                    ),
                });
            }
            Ok(ExpertFormat::Mxfp4)
        }
        (Storage::PerExpert, Some(ExpertPrecision::Mxfp4)) => Err(refuse(format!(
            "the checkpoint stores its {} experts as floats, not MXFP4; precision mxfp4 keeps a checkpoint's own MXFP4 bits and never quantises float weights to MXFP4: use precision int4 (this model's default)",
            config.model_type()
        ))),
        (Storage::PerExpert, _) => {
            ExpertFormat::int4_for(h, i).ok_or_else(|| CacheError::UnsupportedSource {
                dir: dir.to_path_buf(),
                reason: format!(
                    "hidden_size {h} and expert intermediate size {i} must both be multiples of 32 (INT4 groups are 128, 64 or 32)"
                ),
            })
        }
    }
}
