//! Memory-mapped Hugging Face safetensors checkpoints.
//!
//! Opens `model.safetensors` or the shards listed in
//! `model.safetensors.index.json`, parses every shard header up front and
//! checks that each tensor's byte range lies inside its file, so a truncated
//! shard is reported at open time with the tensor and shard named, never as a
//! crash mid-inference. Tensor bytes stay in the page cache (mmap); readers
//! convert BF16/F16/F32 to f32 on demand.
//!
//! U8 tensors (MXFP4 `*_blocks`/`*_scales`) are packed data, not numbers:
//! [`Checkpoint::get`] (the float view, whose `to_f32` is total) refuses them
//! with [`ModelError::WrongDtype`], and [`Checkpoint::raw`] hands out their
//! bytes for a format decoder such as [`crate::formats::mxfp4`].

use crate::error::ModelError;

mod identity;
use half::{bf16, f16};
use memmap2::Mmap;
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

/// Element type of a stored tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    BF16,
    F16,
    F32,
}

impl DType {
    pub fn size(self) -> usize {
        match self {
            DType::BF16 | DType::F16 => 2,
            DType::F32 => 4,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::BF16 => "BF16",
            DType::F16 => "F16",
            DType::F32 => "F32",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "BF16" => Some(DType::BF16),
            "F16" => Some(DType::F16),
            "F32" => Some(DType::F32),
            _ => None,
        }
    }
}

/// Element type of a stored tensor as the file says, including packed
/// storage that is not a float type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StoredDType {
    Float(DType),
    /// Bytes (MXFP4 blocks and scales).
    U8,
}

impl StoredDType {
    pub fn size(self) -> usize {
        match self {
            StoredDType::Float(d) => d.size(),
            StoredDType::U8 => 1,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            StoredDType::Float(d) => d.name(),
            StoredDType::U8 => "U8",
        }
    }
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "U8" => Some(StoredDType::U8),
            _ => DType::parse(s).map(StoredDType::Float),
        }
    }
}

#[derive(Debug, Clone)]
struct Entry {
    shard: usize,
    dtype: Result<StoredDType, String>,
    shape: Vec<usize>,
    /// Absolute byte range in the shard file.
    start: usize,
    end: usize,
}

struct Shard {
    path: PathBuf,
    map: Mmap,
}

/// A borrowed view of one tensor's bytes.
#[derive(Debug, Clone, Copy)]
pub struct TensorView<'a> {
    pub name: &'a str,
    pub dtype: DType,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
    pub file: &'a Path,
}

impl TensorView<'_> {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Converts the tensor to f32 into `out` (len must equal numel).
    pub fn to_f32_into(&self, out: &mut [f32]) {
        assert_eq!(out.len(), self.numel());
        convert_to_f32(self.dtype, self.bytes, out);
    }
    pub fn to_f32(&self) -> Vec<f32> {
        let mut v = vec![0f32; self.numel()];
        self.to_f32_into(&mut v);
        v
    }
}

/// A borrowed view of one tensor's bytes in any supported storage type.
#[derive(Debug, Clone, Copy)]
pub struct RawTensorView<'a> {
    pub name: &'a str,
    pub dtype: StoredDType,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
    pub file: &'a Path,
}

impl<'a> RawTensorView<'a> {
    /// The view [`crate::formats::mxfp4`] reads (`from_safetensors`).
    pub fn as_mxfp4_raw(&self) -> crate::formats::mxfp4::RawTensor<'a, 'a> {
        crate::formats::mxfp4::RawTensor {
            dtype: self.dtype.name(),
            shape: self.shape,
            bytes: self.bytes,
        }
    }
}

/// Decodes little-endian `dtype` elements from `bytes` into `out`.
pub fn convert_to_f32(dtype: DType, bytes: &[u8], out: &mut [f32]) {
    match dtype {
        DType::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        DType::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
        DType::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
            }
        }
    }
}

/// An opened checkpoint directory.
pub struct Checkpoint {
    dir: PathBuf,
    shards: Vec<Shard>,
    entries: HashMap<String, Entry>,
}

impl std::fmt::Debug for Checkpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpoint")
            .field("dir", &self.dir)
            .field("shards", &self.shards.len())
            .field("tensors", &self.entries.len())
            .finish()
    }
}

#[derive(serde::Deserialize)]
struct IndexFile {
    weight_map: BTreeMap<String, String>,
}

impl Checkpoint {
    /// Opens `dir/model.safetensors.index.json` (sharded) or `dir/model.safetensors`.
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let (shard_names, index): (Vec<String>, Option<BTreeMap<String, String>>) =
            if index_path.exists() {
                let text = std::fs::read_to_string(&index_path)
                    .map_err(|e| ModelError::io(&index_path, e))?;
                let idx: IndexFile =
                    serde_json::from_str(&text).map_err(|e| ModelError::BadSafetensors {
                        path: index_path.clone(),
                        reason: format!("invalid index JSON: {e}"),
                    })?;
                let mut names: Vec<String> = idx.weight_map.values().cloned().collect();
                names.sort();
                names.dedup();
                (names, Some(idx.weight_map))
            } else if single.exists() {
                (vec!["model.safetensors".into()], None)
            } else {
                return Err(ModelError::MissingFile {
                    path: dir.to_path_buf(),
                    what: "neither model.safetensors nor model.safetensors.index.json".into(),
                });
            };

        let mut shards = Vec::with_capacity(shard_names.len());
        let mut entries = HashMap::new();
        for (si, name) in shard_names.iter().enumerate() {
            if name.contains('/') || name.contains("..") {
                return Err(ModelError::BadSafetensors {
                    path: index_path.clone(),
                    reason: format!("shard name '{name}' points outside the model directory"),
                });
            }
            let path = dir.join(name);
            let file = File::open(&path).map_err(|e| ModelError::io(&path, e))?;
            // SAFETY: the file is opened read-only; a checkpoint modified while
            // loaded is outside what we can defend against (as for every mmap user).
            let map = unsafe { Mmap::map(&file) }.map_err(|e| ModelError::io(&path, e))?;
            parse_header(&path, &map, si, &mut entries)?;
            shards.push(Shard { path, map });
        }
        if let Some(index) = index {
            for (tensor, shard) in &index {
                match entries.get(tensor) {
                    None => {
                        return Err(ModelError::BadSafetensors {
                            path: dir.join(shard),
                            reason: format!(
                                "the index says it holds '{tensor}' but the shard header does not list it"
                            ),
                        });
                    }
                    Some(e) if shard_names[e.shard] != *shard => {
                        return Err(ModelError::BadSafetensors {
                            path: index_path.clone(),
                            reason: format!(
                                "'{tensor}' is indexed in {shard} but stored in {}",
                                shard_names[e.shard]
                            ),
                        });
                    }
                    _ => {}
                }
            }
        }
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            shards,
            entries,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn tensor_names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(|s| s.as_str())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// Paths of the shard files (for hashing and size accounting).
    pub fn shard_paths(&self) -> Vec<&Path> {
        self.shards.iter().map(|s| s.path.as_path()).collect()
    }

    /// Looks a float tensor up without checking its shape; a U8 tensor is
    /// refused with [`ModelError::WrongDtype`] (read it with [`Self::raw`]).
    pub fn get(&self, name: &str) -> Result<TensorView<'_>, ModelError> {
        let t = self.raw(name)?;
        match t.dtype {
            StoredDType::Float(dtype) => Ok(TensorView {
                name: t.name,
                dtype,
                shape: t.shape,
                bytes: t.bytes,
                file: t.file,
            }),
            StoredDType::U8 => Err(ModelError::WrongDtype {
                tensor: name.to_string(),
                file: t.file.to_path_buf(),
                found: "U8 (packed data such as MXFP4 blocks, not numbers)".into(),
            }),
        }
    }

    /// Looks a tensor of any supported storage type (floats and U8) up
    /// without checking its shape.
    pub fn raw(&self, name: &str) -> Result<RawTensorView<'_>, ModelError> {
        let (key, e) =
            self.entries
                .get_key_value(name)
                .ok_or_else(|| ModelError::MissingTensor {
                    tensor: name.to_string(),
                    dir: self.dir.clone(),
                })?;
        let shard = &self.shards[e.shard];
        let dtype = e.dtype.clone().map_err(|found| ModelError::WrongDtype {
            tensor: name.to_string(),
            file: shard.path.clone(),
            found,
        })?;
        Ok(RawTensorView {
            name: key,
            dtype,
            shape: &e.shape,
            bytes: &shard.map[e.start..e.end],
            file: &shard.path,
        })
    }

    /// [`Self::raw`] and a shape check.
    pub fn expect_raw(&self, name: &str, shape: &[usize]) -> Result<RawTensorView<'_>, ModelError> {
        let t = self.raw(name)?;
        if t.shape != shape {
            return Err(ModelError::WrongShape {
                tensor: name.to_string(),
                file: t.file.to_path_buf(),
                expected: shape.to_vec(),
                found: t.shape.to_vec(),
            });
        }
        Ok(t)
    }

    /// Looks a tensor up and checks its shape.
    pub fn expect(&self, name: &str, shape: &[usize]) -> Result<TensorView<'_>, ModelError> {
        let t = self.get(name)?;
        if t.shape != shape {
            return Err(ModelError::WrongShape {
                tensor: name.to_string(),
                file: t.file.to_path_buf(),
                expected: shape.to_vec(),
                found: t.shape.to_vec(),
            });
        }
        Ok(t)
    }

    /// Reads a tensor as f32 after checking its shape.
    pub fn read_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, ModelError> {
        Ok(self.expect(name, shape)?.to_f32())
    }

    /// Checks that exactly `expected` tensors exist, with those shapes and
    /// supported dtypes (floats, and U8 for packed formats): missing,
    /// unexpected, misshapen and mistyped tensors are all reported before
    /// anything runs.
    pub fn validate(&self, expected: &[(String, Vec<usize>)]) -> Result<(), ModelError> {
        self.validate_skipping(expected, &[])
    }

    /// [`Self::validate`], where any tensor whose name starts with one of
    /// `skipped` (a layer no engine here runs, e.g. glm4_moe's MTP layer:
    /// [`crate::ModelConfig::skipped_prefixes`]) is accepted unread.
    pub fn validate_skipping(
        &self,
        expected: &[(String, Vec<usize>)],
        skipped: &[String],
    ) -> Result<(), ModelError> {
        for (name, shape) in expected {
            self.expect_raw(name, shape)?;
        }
        let wanted: std::collections::HashSet<&str> =
            expected.iter().map(|(n, _)| n.as_str()).collect();
        let mut extra: Vec<String> = self
            .entries
            .keys()
            .filter(|k| !wanted.contains(k.as_str()))
            .filter(|k| !skipped.iter().any(|p| k.starts_with(p.as_str())))
            .cloned()
            .collect();
        if !extra.is_empty() {
            extra.sort();
            let count = extra.len();
            extra.truncate(5);
            return Err(ModelError::UnexpectedTensors {
                dir: self.dir.clone(),
                names: extra,
                count,
            });
        }
        Ok(())
    }
}

fn parse_header(
    path: &Path,
    map: &[u8],
    shard: usize,
    entries: &mut HashMap<String, Entry>,
) -> Result<(), ModelError> {
    let bad = |reason: String| ModelError::BadSafetensors {
        path: path.to_path_buf(),
        reason,
    };
    if map.len() < 8 {
        return Err(bad(format!(
            "file is {} bytes, shorter than the 8-byte header length",
            map.len()
        )));
    }
    let n = u64::from_le_bytes(map[..8].try_into().expect("8 bytes")) as usize;
    if n > 100 << 20 || 8 + n > map.len() {
        return Err(bad(format!(
            "header length {n} does not fit in the {}-byte file (truncated or not safetensors)",
            map.len()
        )));
    }
    let header: serde_json::Map<String, serde_json::Value> = serde_json::from_slice(&map[8..8 + n])
        .map_err(|e| bad(format!("header is not valid JSON: {e}")))?;
    let base = 8 + n;
    for (name, info) in header {
        if name == "__metadata__" {
            continue;
        }
        let dtype_s = info
            .get("dtype")
            .and_then(|v| v.as_str())
            .ok_or_else(|| bad(format!("tensor '{name}' has no dtype")))?;
        let shape: Vec<usize> = info
            .get("shape")
            .and_then(|v| v.as_array())
            .and_then(|a| a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect())
            .ok_or_else(|| bad(format!("tensor '{name}' has no valid shape")))?;
        let offs: Vec<u64> = info
            .get("data_offsets")
            .and_then(|v| v.as_array())
            .and_then(|a| a.iter().map(|x| x.as_u64()).collect())
            .filter(|v: &Vec<u64>| v.len() == 2)
            .ok_or_else(|| bad(format!("tensor '{name}' has no valid data_offsets")))?;
        let dtype = StoredDType::parse(dtype_s).ok_or_else(|| dtype_s.to_string());
        let (start, end) = (base as u64 + offs[0], base as u64 + offs[1]);
        if end < start {
            return Err(bad(format!("tensor '{name}' has inverted data_offsets")));
        }
        if let Ok(dt) = dtype {
            let want = shape.iter().product::<usize>() as u64 * dt.size() as u64;
            if end - start != want {
                return Err(bad(format!(
                    "tensor '{name}' has {} bytes but shape {shape:?} of {} needs {want}",
                    end - start,
                    dt.name()
                )));
            }
        }
        if end > map.len() as u64 {
            return Err(ModelError::Truncated {
                path: path.to_path_buf(),
                tensor: name,
                needed: end,
                actual: map.len() as u64,
            });
        }
        if entries.contains_key(&name) {
            return Err(bad(format!(
                "tensor '{name}' appears in more than one shard"
            )));
        }
        entries.insert(
            name,
            Entry {
                shard,
                dtype,
                shape,
                start: start as usize,
                end: end as usize,
            },
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests;
