//! The prefix cache's file (`--prefix-cache-file`): the held blocks written
//! at a graceful shutdown and read back at the next start, so an agent's
//! long contexts survive a restart of the server.
//!
//! - **Bound to what computed the KV.** A file carries a [`KvIdentity`]: the
//!   engine, the model's content identity, the formats that change the KV's
//!   bits, the device and libraries that computed it, the executable, the
//!   block size and the engine's binding. A file whose identity differs in
//!   any field is refused with the field named (fail closed: the KV would
//!   not be exact here), never used and never silently replaced.
//! - **Whole or nothing.** The file ends with a blake3 of everything before
//!   it; a truncated or altered file is refused. It is written to a temp
//!   file, synced and renamed over the old one, so a crash or kill during
//!   a save leaves the previous file.
//! - **Most recent first.** Blocks are written in order of their chain's
//!   last use (a block's recency is the newest use of any block that
//!   hangs from it), parents before children: a cache smaller than the
//!   file loads a prefix of it, which is the most recent part and closed
//!   under parents. They load into the first tier first, the rest into the
//!   RAM tier, in the same order of recency.
//!
//! Layout: `KRSPFXC\0`, the format version (u32 LE), the header's length
//! (u64 LE), the header (JSON: version, identity, each block's parent,
//! tokens and engine tag), every block's bytes in header order, and the blake3 (32 bytes)
//! of all that precedes it.

use super::{Entry, Place, PrefixCache, Tier, key_hash};
use serde::{Deserialize, Serialize};
use std::io::{BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Instant;

pub const FORMAT_VERSION: u32 = 1;
const MAGIC: &[u8; 8] = b"KRSPFXC\0";
/// Far above any real header (tokens of every block): stops a corrupt length
/// from driving a huge allocation.
const MAX_HEADER_BYTES: u64 = 1 << 30;

/// What a file's KV was computed by. Every field must match the running
/// engine's for the file to be used.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvIdentity {
    /// The engine that computed it ("reference", "cuda").
    pub engine: String,
    /// The model: its checkpoint's content identity and, where experts come
    /// from an expert cache, that cache's identity.
    pub model: String,
    /// Formats and precisions that change the KV's bits.
    pub formats: String,
    /// The device and libraries whose arithmetic computed it.
    pub device: String,
    /// The executable (its version and the hash of its file).
    pub build: String,
    /// Tokens per block (`--prefix-block`).
    pub block_tokens: u64,
    /// Bytes per block in the engine's pools.
    pub block_bytes: u64,
    /// The engine's binding (`PrefixCache::bind`: settings and planted
    /// faults that change the KV).
    pub binding: u64,
}

impl KvIdentity {
    /// The first field that differs: (name, this file's, the engine's), the
    /// setting a user changes most likely named before what follows from it.
    fn difference(&self, engine: &KvIdentity) -> Option<(&'static str, String, String)> {
        let fields = |k: &KvIdentity| {
            [
                ("engine", k.engine.clone()),
                ("model", k.model.clone()),
                // Before the formats: an engine's reuse granule (in its
                // formats) follows from the block, so a changed
                // `--prefix-block` is named as itself.
                ("block tokens (--prefix-block)", k.block_tokens.to_string()),
                ("formats", k.formats.clone()),
                ("device", k.device.clone()),
                ("build", k.build.clone()),
                ("block bytes", k.block_bytes.to_string()),
                ("binding", k.binding.to_string()),
            ]
        };
        fields(self)
            .into_iter()
            .zip(fields(engine))
            .find(|((_, a), (_, b))| a != b)
            .map(|((name, a), (_, b))| (name, a, b))
    }
}

/// The running executable's identity: the package version and a hash of
/// the executable file (a rebuild may change any kernel's arithmetic).
pub fn build_identity() -> std::io::Result<String> {
    let exe = std::env::current_exe()?;
    let mut h = blake3::Hasher::new();
    h.update_reader(std::fs::File::open(&exe)?)?;
    Ok(format!(
        "krasis {} ({} {})",
        env!("CARGO_PKG_VERSION"),
        exe.file_name().unwrap_or_default().to_string_lossy(),
        &h.finalize().to_hex()[..16]
    ))
}

/// How the engine's pools give and take a block's bytes
/// (`block_bytes` each).
pub trait BlockBytes {
    /// Copies the block at `place` into `out`.
    fn read(&mut self, place: Place, out: &mut [u8]) -> Result<(), String>;
    /// Copies `bytes` into the block at `place`.
    fn write(&mut self, place: Place, bytes: &[u8]) -> Result<(), String>;
    /// A byte the engine keeps beside the block at `place`, saved with it
    /// (the CUDA engine's mark of a block that holds its sliding layers'
    /// KV, `prefix_window.rs`); 0 for engines that keep none.
    fn tag(&self, _place: Place) -> u8 {
        0
    }
    /// Sets the byte beside the block at `place` (loaded with it).
    fn set_tag(&mut self, _place: Place, _tag: u8) {}
}

#[derive(Debug, thiserror::Error)]
pub enum PersistError {
    #[error("prefix cache file {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "prefix cache file {path} was written for a different {field} ('{file}'; this server: \
         '{here}'), so its KV would not be exact here. Remove the file to start with an empty \
         cache (this server writes its own at shutdown), or give --prefix-cache-file another path"
    )]
    Mismatch {
        path: PathBuf,
        field: &'static str,
        file: String,
        here: String,
    },
    #[error(
        "prefix cache file {path} is damaged ({reason}); remove it to start with an empty cache"
    )]
    Damaged { path: PathBuf, reason: String },
    #[error("prefix cache file {path}: {reason}")]
    Engine { path: PathBuf, reason: String },
}

/// What a save wrote.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Saved {
    pub blocks: usize,
    pub bytes: u64,
    pub ms: f64,
}

/// What a load found and took.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Loaded {
    /// Blocks in the file (0: there was none yet).
    pub in_file: usize,
    /// Blocks now held (the most recent that fit).
    pub blocks: usize,
    pub bytes: u64,
    pub ms: f64,
}

impl Loaded {
    /// What the file gave, for the startup log.
    pub fn describe(&self) -> String {
        if self.in_file == 0 {
            return "none yet (written at shutdown)".into();
        }
        format!(
            "{} of its {} blocks loaded ({:.2} GiB, {:.0} ms)",
            self.blocks,
            self.in_file,
            self.bytes as f64 / (1u64 << 30) as f64,
            self.ms
        )
    }
}

#[derive(Serialize, Deserialize)]
struct Header {
    format_version: u32,
    identity: KvIdentity,
    blocks: Vec<SavedBlock>,
}

#[derive(Serialize, Deserialize)]
struct SavedBlock {
    /// Index of the previous block of the prompt in this list (before this
    /// one), none for a prompt's first block.
    parent: Option<u32>,
    tokens: Vec<u32>,
    /// [`BlockBytes::tag`] (absent: 0).
    #[serde(default, skip_serializing_if = "is_zero")]
    tag: u8,
}

fn is_zero(t: &u8) -> bool {
    *t == 0
}

/// A writer that hashes what passes through it.
struct Hashed<W> {
    inner: W,
    hash: blake3::Hasher,
}

impl<W: Write> Write for Hashed<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

impl<R: Read> Read for Hashed<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }
}

impl PrefixCache {
    /// Held entries in file order: by the newest use in their subtree, then
    /// depth (so a parent, never newer than that and shallower, precedes
    /// its children), then index. Entries whose chain is broken (never, by
    /// the eviction rules) are left out.
    fn file_order(&self) -> Vec<usize> {
        let held = |i: usize| self.entries.get(i).and_then(Option::as_ref);
        let parent_of = |e: &Entry| {
            e.parent
                .filter(|&p| held(p).is_some_and(|pe| pe.uid == e.parent_uid))
        };
        let n = self.entries.len();
        let mut depth: Vec<Option<usize>> = vec![None; n];
        for i in 0..n {
            let mut chain = Vec::new();
            let mut cur = Some(i);
            let mut base = 0;
            while let Some(c) = cur {
                let Some(e) = held(c) else {
                    break;
                };
                if let Some(d) = depth[c] {
                    base = d + 1;
                    break;
                }
                chain.push(c);
                cur = match (e.parent_uid, parent_of(e)) {
                    (0, _) => None,
                    (_, Some(p)) => Some(p),
                    // A missing parent: the whole chain below it is unusable.
                    (_, None) => {
                        chain.clear();
                        break;
                    }
                };
            }
            for (k, c) in chain.iter().rev().enumerate() {
                depth[*c] = Some(base + k);
            }
        }
        let mut recency: Vec<u64> = (0..n).map(|i| held(i).map_or(0, |e| e.tick)).collect();
        let mut by_depth: Vec<usize> = (0..n).filter(|&i| depth[i].is_some()).collect();
        by_depth.sort_by_key(|&i| std::cmp::Reverse(depth[i]));
        for &i in &by_depth {
            if let Some(p) = held(i).and_then(parent_of) {
                recency[p] = recency[p].max(recency[i]);
            }
        }
        by_depth.sort_by_key(|&i| (std::cmp::Reverse(recency[i]), depth[i], i));
        by_depth
    }

    /// Takes `blocks` (file order: parents first, most recent first) into
    /// this empty cache: the first ones into the first tier's slots, the
    /// next into the RAM tier's, as many as fit. Returns each taken
    /// block's place (the rest are `None`); they are visible at once, so
    /// the caller writes their bytes before any lookup.
    fn take_saved(&mut self, blocks: &[SavedBlock]) -> Vec<Option<Place>> {
        debug_assert!(self.entries.is_empty() && self.pending.is_empty());
        let caps = [self.capacity(Tier::Primary), self.capacity(Tier::Secondary)];
        let n = blocks.len().min(caps[0] + caps[1]);
        let mut places = vec![None; blocks.len()];
        for (k, b) in blocks.iter().take(n).enumerate() {
            let place = if k < caps[0] {
                Place {
                    tier: Tier::Primary,
                    slot: k,
                }
            } else {
                Place {
                    tier: Tier::Secondary,
                    slot: k - caps[0],
                }
            };
            let parent = b.parent.map(|p| p as usize);
            let parent_uid = parent.map_or(0, |p| self.entry(p).uid);
            let uid = self.next_uid;
            self.next_uid += 1;
            let hash = key_hash(parent_uid, &b.tokens);
            // Entry k is index k: the cache was empty.
            self.entries.push(Some(Entry {
                uid,
                parent_uid,
                parent,
                tokens: b.tokens.clone().into(),
                hash,
                children: 0,
                tick: (n - k) as u64,
                place,
            }));
            if let Some(p) = parent {
                self.entries[p].as_mut().expect("parents precede").children += 1;
            }
            self.by_hash.entry(hash).or_default().push(k);
            let t = &mut self.tiers[place.tier.index()];
            t.slots[place.slot] = Some(k);
            t.blocks_in += 1;
            places[k] = Some(place);
        }
        for (t, &cap) in self.tiers.iter_mut().zip(&caps) {
            let used = t.slots.iter().filter(|s| s.is_some()).count();
            t.free = (used..cap).rev().collect();
        }
        for k in 0..n {
            self.list(k);
        }
        self.tick = self.tick.max(n as u64);
        places
    }
}

/// Writes every held block of `cache` (its bytes read through `bytes`) to
/// `path`, replacing it atomically. The file's binding is the one the held
/// blocks were computed under (the cache's last bound), else `identity`'s.
pub fn save(
    cache: &PrefixCache,
    bytes: &mut dyn BlockBytes,
    identity: &KvIdentity,
    path: &Path,
) -> Result<Saved, PersistError> {
    let t = Instant::now();
    let io = |source| PersistError::Io {
        path: path.to_path_buf(),
        source,
    };
    let order = cache.file_order();
    let pos: std::collections::HashMap<usize, u32> = order
        .iter()
        .enumerate()
        .map(|(k, &i)| (i, k as u32))
        .collect();
    let header = Header {
        format_version: FORMAT_VERSION,
        identity: KvIdentity {
            binding: cache.bound().unwrap_or(identity.binding),
            ..identity.clone()
        },
        blocks: order
            .iter()
            .map(|&i| {
                let e = cache.entry(i);
                SavedBlock {
                    parent: e.parent.filter(|_| e.parent_uid != 0).map(|p| pos[&p]),
                    tokens: e.tokens.to_vec(),
                    tag: bytes.tag(e.place),
                }
            })
            .collect(),
    };
    let json = serde_json::to_vec(&header).expect("the header serializes");
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let tmp = crate::atomic::TempFile::beside(path);
    let file = std::fs::File::create(&tmp.path).map_err(io)?;
    let mut w = Hashed {
        inner: BufWriter::with_capacity(8 << 20, file),
        hash: blake3::Hasher::new(),
    };
    w.write_all(MAGIC).map_err(io)?;
    w.write_all(&FORMAT_VERSION.to_le_bytes()).map_err(io)?;
    w.write_all(&(json.len() as u64).to_le_bytes())
        .map_err(io)?;
    w.write_all(&json).map_err(io)?;
    let mut block = vec![0u8; cache.block_bytes as usize];
    for &i in &order {
        bytes
            .read(cache.entry(i).place, &mut block)
            .map_err(|reason| PersistError::Engine {
                path: path.to_path_buf(),
                reason: format!("reading a block out of the cache: {reason}"),
            })?;
        w.write_all(&block).map_err(io)?;
    }
    let digest = w.hash.finalize();
    let mut file = w
        .inner
        .into_inner()
        .map_err(|e| io(std::io::Error::other(e.to_string())))?;
    file.write_all(digest.as_bytes()).map_err(io)?;
    file.sync_all().map_err(io)?;
    drop(file);
    tmp.persist(path).map_err(io)?;
    crate::atomic::TempFile::remove_dead_beside(path);
    Ok(Saved {
        blocks: order.len(),
        bytes: order.len() as u64 * cache.block_bytes,
        ms: t.elapsed().as_secs_f64() * 1e3,
    })
}

/// Reads `path` into the empty `cache` (the bytes of the blocks it takes
/// written through `bytes`). No file: an empty cache, `in_file` 0. A file
/// of another identity, or damaged, is refused; after a refusal the cache
/// is empty again.
pub fn load(
    cache: &mut PrefixCache,
    bytes: &mut dyn BlockBytes,
    identity: &KvIdentity,
    path: &Path,
) -> Result<Loaded, PersistError> {
    let t = Instant::now();
    let result = read_into(cache, bytes, identity, path);
    if result.is_err() {
        cache.clear();
    }
    result.map(|(in_file, blocks)| Loaded {
        in_file,
        blocks,
        bytes: blocks as u64 * cache.block_bytes,
        ms: t.elapsed().as_secs_f64() * 1e3,
    })
}

fn read_into(
    cache: &mut PrefixCache,
    bytes: &mut dyn BlockBytes,
    identity: &KvIdentity,
    path: &Path,
) -> Result<(usize, usize), PersistError> {
    let damaged = |reason: String| PersistError::Damaged {
        path: path.to_path_buf(),
        reason,
    };
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((0, 0)),
        Err(source) => {
            return Err(PersistError::Io {
                path: path.to_path_buf(),
                source,
            });
        }
    };
    let len = file
        .metadata()
        .map_err(|source| PersistError::Io {
            path: path.to_path_buf(),
            source,
        })?
        .len();
    let mut r = Hashed {
        inner: BufReader::with_capacity(8 << 20, file),
        hash: blake3::Hasher::new(),
    };
    let short = |e: std::io::Error| damaged(format!("it ends early: {e}"));
    let mut head = [0u8; 20];
    let not_ours = || damaged("it is not a krasis prefix cache file".into());
    r.read_exact(&mut head[..8]).map_err(|_| not_ours())?;
    if &head[..8] != MAGIC {
        return Err(not_ours());
    }
    r.read_exact(&mut head[8..]).map_err(short)?;
    let version = u32::from_le_bytes(head[8..12].try_into().expect("4 bytes"));
    if version != FORMAT_VERSION {
        return Err(PersistError::Mismatch {
            path: path.to_path_buf(),
            field: "file format version",
            file: version.to_string(),
            here: FORMAT_VERSION.to_string(),
        });
    }
    let header_len = u64::from_le_bytes(head[12..20].try_into().expect("8 bytes"));
    if header_len > MAX_HEADER_BYTES.min(len) {
        return Err(damaged(format!("a header length of {header_len} bytes")));
    }
    let mut json = vec![0u8; header_len as usize];
    r.read_exact(&mut json).map_err(short)?;
    let header: Header = serde_json::from_slice(&json)
        .map_err(|e| damaged(format!("its header does not parse: {e}")))?;
    if let Some((field, file, here)) = header.identity.difference(identity) {
        return Err(PersistError::Mismatch {
            path: path.to_path_buf(),
            field,
            file,
            here,
        });
    }
    let bb = identity.block_bytes;
    let expected = 20 + header_len + header.blocks.len() as u64 * bb + 32;
    if len != expected {
        return Err(damaged(format!(
            "{len} bytes where its header says {expected}"
        )));
    }
    for (k, b) in header.blocks.iter().enumerate() {
        if b.parent.is_some_and(|p| p as usize >= k) {
            return Err(damaged(format!("block {k}'s parent does not precede it")));
        }
        if b.tokens.len() as u64 != identity.block_tokens {
            return Err(damaged(format!(
                "block {k} holds {} tokens",
                b.tokens.len()
            )));
        }
    }
    if !cache.entries.is_empty() || !cache.pending.is_empty() {
        return Err(PersistError::Engine {
            path: path.to_path_buf(),
            reason: "a file is loaded only into an empty cache (at startup)".into(),
        });
    }
    let places = cache.take_saved(&header.blocks);
    let mut block = vec![0u8; bb as usize];
    for (place, saved) in places.iter().zip(&header.blocks) {
        r.read_exact(&mut block).map_err(short)?;
        if let Some(place) = place {
            bytes
                .write(*place, &block)
                .map_err(|reason| PersistError::Engine {
                    path: path.to_path_buf(),
                    reason: format!("writing a block into the cache: {reason}"),
                })?;
            bytes.set_tag(*place, saved.tag);
        }
    }
    let digest = r.hash.finalize();
    let mut stored = [0u8; 32];
    r.inner.read_exact(&mut stored).map_err(short)?;
    if digest.as_bytes() != &stored {
        return Err(damaged("its checksum does not match its contents".into()));
    }
    Ok((header.blocks.len(), places.iter().flatten().count()))
}

#[cfg(test)]
#[path = "persist_tests.rs"]
mod tests;
