//! The file's rules on the index and a byte store standing in for an
//! engine's pools (the engines' exactness after a restart is tested in
//! `reference/tests/prefix.rs`, `runtime/gpu/tests/prefix_cache.rs` and
//! `tests/e2e/test_prefix_cache.py`).

use super::*;
use crate::prefix_cache::{Demotion, Hit};
use std::collections::HashMap;

const B: usize = 4;
const BB: u64 = 16;

/// Pools as a map; a block's bytes are derived from its prompt's tokens,
/// so a restored block can be checked against the prompt it serves.
/// Each block carries a tag (the engine's byte beside it): its first byte
/// with the low bit set, so a tag that strays from its block shows.
#[derive(Default)]
struct Pools(HashMap<Place, Vec<u8>>, HashMap<Place, u8>);

fn tag_of(bytes: &[u8]) -> u8 {
    bytes[0] | 1
}

impl BlockBytes for Pools {
    fn read(&mut self, place: Place, out: &mut [u8]) -> Result<(), String> {
        out.copy_from_slice(self.0.get(&place).ok_or("an empty slot")?);
        Ok(())
    }
    fn write(&mut self, place: Place, bytes: &[u8]) -> Result<(), String> {
        self.0.insert(place, bytes.to_vec());
        Ok(())
    }
    fn tag(&self, place: Place) -> u8 {
        self.1.get(&place).copied().unwrap_or(0)
    }
    fn set_tag(&mut self, place: Place, tag: u8) {
        self.1.insert(place, tag);
    }
}

fn bytes_of(prompt: &[u32], block: usize) -> Vec<u8> {
    let mut h = blake3::Hasher::new();
    for t in &prompt[..(block + 1) * B] {
        h.update(&t.to_le_bytes());
    }
    h.finalize().as_bytes()[..BB as usize].to_vec()
}

fn cache(primary: usize, secondary: usize) -> PrefixCache {
    PrefixCache::new(B, BB, ("vram", primary), ("host", secondary))
}

/// Looks `prompt` up and stores its new blocks as an engine does.
fn serve(c: &mut PrefixCache, pools: &mut Pools, prompt: &[u32]) -> Hit {
    let hit = c.lookup(prompt);
    let mut moves = Vec::new();
    let plan = c.plan_store(prompt, &hit, &mut |d: Demotion| {
        moves.push(d);
        true
    });
    for d in moves {
        let from = Place {
            tier: Tier::Primary,
            slot: d.from,
        };
        let to = Place {
            tier: Tier::Secondary,
            slot: d.to,
        };
        let b = pools.0.remove(&from).expect("a demoted block is held");
        let t = pools.1.remove(&from).expect("a demoted block is tagged");
        pools.0.insert(to, b);
        pools.1.insert(to, t);
    }
    for s in &plan.blocks {
        let b = bytes_of(prompt, s.block);
        pools.1.insert(s.place, tag_of(&b));
        pools.0.insert(s.place, b);
    }
    assert!(c.publish(plan));
    hit
}

/// Every block of `hit` holds `prompt`'s bytes and their tag.
fn check_bytes(pools: &Pools, prompt: &[u32], hit: &Hit) {
    for (i, p) in hit.blocks.iter().enumerate() {
        assert_eq!(pools.0[p], bytes_of(prompt, i), "block {i} at {p:?}");
        assert_eq!(pools.1[p], tag_of(&pools.0[p]), "block {i}'s tag at {p:?}");
    }
}

fn identity() -> KvIdentity {
    KvIdentity {
        engine: "test".into(),
        model: "m".into(),
        formats: "f".into(),
        device: "d".into(),
        build: "b".into(),
        block_tokens: B as u64,
        block_bytes: BB,
        binding: 7,
    }
}

/// Prompts of `blocks` whole blocks plus one token, distinct per `seed`,
/// sharing their first block when `shared`.
fn prompt(seed: u32, blocks: usize, shared: bool) -> Vec<u32> {
    (0..(blocks * B + 1) as u32)
        .map(|i| {
            if shared && (i as usize) < B {
                i
            } else {
                1000 * (seed + 1) + i
            }
        })
        .collect()
}

#[test]
fn a_restart_finds_every_block_with_its_bytes_in_both_tiers() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sub/prefix.krspc");
    let (mut c, mut pools) = (cache(3, 8), Pools::default());
    let prompts: Vec<Vec<u32>> = (0..4)
        .map(|s| prompt(s, 2 + s as usize % 2, true))
        .collect();
    for p in &prompts {
        serve(&mut c, &mut pools, p);
    }
    assert!(c.held_in(Tier::Secondary) > 0, "some blocks were demoted");
    let held = c.held();
    let saved = save(&c, &mut pools, &identity(), &path).unwrap();
    assert_eq!((saved.blocks, saved.bytes), (held, held as u64 * BB));

    let (mut d, mut restored) = (cache(3, 8), Pools::default());
    let loaded = load(&mut d, &mut restored, &identity(), &path).unwrap();
    assert_eq!((loaded.in_file, loaded.blocks), (held, held));
    assert_eq!(d.held(), held);
    for p in &prompts {
        let hit = d.lookup(p);
        assert_eq!(hit.tokens, p.len() - 1, "every whole block is found");
        check_bytes(&restored, p, &hit);
    }
    // The most recent chain went to the first tier.
    let last = prompts.last().unwrap();
    let hit = cache_lookup_fresh(&path, last);
    assert_eq!(hit.blocks[0].tier, Tier::Primary);
    // A loaded cache stores and evicts like any other.
    let more = prompt(9, 6, false);
    serve(&mut d, &mut restored, &more);
    let hit = d.lookup(&more);
    check_bytes(&restored, &more, &hit);
}

fn cache_lookup_fresh(path: &Path, p: &[u32]) -> Hit {
    let (mut c, mut pools) = (cache(3, 8), Pools::default());
    load(&mut c, &mut pools, &identity(), path).unwrap();
    c.lookup(p)
}

#[test]
fn a_smaller_cache_takes_the_most_recent_chains_whole() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p");
    let (mut c, mut pools) = (cache(4, 12), Pools::default());
    let prompts: Vec<Vec<u32>> = (0..5).map(|s| prompt(s, 3, false)).collect();
    for p in &prompts {
        serve(&mut c, &mut pools, p);
    }
    // The oldest prompt is used again: it is now the most recent.
    serve(&mut c, &mut pools, &prompts[0]);
    save(&c, &mut pools, &identity(), &path).unwrap();

    // Room for two chains of three blocks and one more block.
    let (mut d, mut restored) = (cache(2, 5), Pools::default());
    let loaded = load(&mut d, &mut restored, &identity(), &path).unwrap();
    assert_eq!((loaded.in_file, loaded.blocks), (15, 7));
    let found: Vec<usize> = prompts.iter().map(|p| d.lookup(p).tokens / B).collect();
    // prompts[0] (used last), prompts[4], then the first block of prompts[3].
    assert_eq!(found, vec![3, 0, 0, 1, 3]);
    for p in &prompts {
        let hit = d.lookup(p);
        check_bytes(&restored, p, &hit);
    }
}

#[test]
fn a_file_of_another_identity_is_refused_naming_the_field() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p");
    let (mut c, mut pools) = (cache(2, 2), Pools::default());
    serve(&mut c, &mut pools, &prompt(0, 2, false));
    save(&c, &mut pools, &identity(), &path).unwrap();
    type Change = fn(&mut KvIdentity);
    let changes: [(&str, Change); 7] = [
        ("model", |k| k.model = "other".into()),
        ("formats", |k| k.formats = "other".into()),
        ("device", |k| k.device = "other".into()),
        ("build", |k| k.build = "other".into()),
        ("block tokens (--prefix-block)", |k| k.block_tokens = 8),
        // The CUDA engine's formats name its reuse granule, which follows
        // from the block: the user's setting is the one named.
        ("block tokens (--prefix-block)", |k| {
            k.block_tokens = 8;
            k.formats = "reuse granule 8".into();
        }),
        ("binding", |k| k.binding = 8),
    ];
    for (field, change) in changes {
        let mut other = identity();
        change(&mut other);
        let (mut d, mut p) = (cache(2, 2), Pools::default());
        let err = load(&mut d, &mut p, &other, &path).unwrap_err();
        assert!(
            matches!(&err, PersistError::Mismatch { field: f, .. } if *f == field),
            "{err}"
        );
        assert!(err.to_string().contains("Remove the file"), "{err}");
        assert_eq!(d.held(), 0);
        assert!(p.0.is_empty());
    }
}

#[test]
fn a_damaged_file_is_refused_and_leaves_the_cache_empty() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p");
    let (mut c, mut pools) = (cache(4, 0), Pools::default());
    serve(&mut c, &mut pools, &prompt(0, 3, false));
    save(&c, &mut pools, &identity(), &path).unwrap();
    let good = std::fs::read(&path).unwrap();
    let try_load = |bytes: &[u8]| {
        std::fs::write(&path, bytes).unwrap();
        let mut d = cache(4, 0);
        let r = load(&mut d, &mut Pools::default(), &identity(), &path);
        if r.is_err() {
            assert_eq!(d.held(), 0, "nothing is left of a refused file");
        }
        r
    };
    // One bit of a block's bytes.
    let mut flipped = good.clone();
    let at = good.len() - 32 - 5;
    flipped[at] ^= 1;
    let err = try_load(&flipped).unwrap_err();
    assert!(err.to_string().contains("checksum"), "{err}");
    // Cut short, and lengthened.
    let err = try_load(&good[..good.len() - 1]).unwrap_err();
    assert!(matches!(err, PersistError::Damaged { .. }), "{err}");
    let err = try_load(&[&good[..], &[0]].concat()).unwrap_err();
    assert!(matches!(err, PersistError::Damaged { .. }), "{err}");
    // Not a prefix cache file at all.
    let err = try_load(b"{\"hello\": 1}").unwrap_err();
    assert!(
        err.to_string().contains("not a krasis prefix cache"),
        "{err}"
    );
    // The good file still loads.
    assert_eq!(try_load(&good).unwrap().blocks, 3);
}

#[test]
fn no_file_is_an_empty_cache_and_a_held_cache_takes_no_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("none");
    let (mut c, mut pools) = (cache(2, 2), Pools::default());
    let loaded = load(&mut c, &mut pools, &identity(), &path).unwrap();
    assert_eq!((loaded.in_file, loaded.blocks), (0, 0));
    serve(&mut c, &mut pools, &prompt(0, 2, false));
    save(&c, &mut pools, &identity(), &path).unwrap();
    let err = load(&mut c, &mut pools, &identity(), &path).unwrap_err();
    assert!(err.to_string().contains("empty cache"), "{err}");
}

#[test]
fn a_failed_save_keeps_the_previous_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p");
    let (mut c, mut pools) = (cache(2, 2), Pools::default());
    serve(&mut c, &mut pools, &prompt(0, 2, false));
    save(&c, &mut pools, &identity(), &path).unwrap();
    let before = std::fs::read(&path).unwrap();
    serve(&mut c, &mut pools, &prompt(1, 2, false));
    // The engine cannot give a block's bytes.
    let err = save(&c, &mut Pools::default(), &identity(), &path).unwrap_err();
    assert!(matches!(err, PersistError::Engine { .. }), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), before);
    let names: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(names.len(), 1, "the temp file is gone");
}

/// A save cut short by a kill leaves `<name>.tmp.<pid>`; the next save
/// removes those of dead processes, not a live one's, nor other files.
#[cfg(target_os = "linux")]
#[test]
fn a_save_removes_the_temp_files_of_killed_saves() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p");
    // A pid far above pid_max is no running process.
    let dead = dir.path().join("p.tmp.999999999");
    let live = dir
        .path()
        .join(format!("p.tmp.{}", std::os::unix::process::parent_id()));
    let other = dir.path().join("q.tmp.999999999");
    for f in [&dead, &live, &other] {
        std::fs::write(f, b"partial").unwrap();
    }
    let (mut c, mut pools) = (cache(2, 2), Pools::default());
    serve(&mut c, &mut pools, &prompt(0, 2, false));
    save(&c, &mut pools, &identity(), &path).unwrap();
    assert!(!dead.exists(), "a dead process's temp file is removed");
    assert!(live.exists() && other.exists());
}
