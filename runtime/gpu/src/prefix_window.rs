//! Which prefix-cache blocks keep their sliding layers' KV (gpt-oss on the
//! CUDA engine): the host-side rules of `prefix.rs`'s ring part, apart from
//! the copies so the CPU tests can walk them.
//!
//! Why blocks differ. A sliding layer keeps each running sequence's keys in
//! a ring of `ring` rows (`scratch::KvCache`, a whole number of blocks), so
//! when a prompt's prefill ends its ring holds only its last `ring`
//! positions: its earlier blocks' sliding KV is gone. The full layers' KV
//! of every block is in the arena rows and is stored as for any model.
//!
//! The rules:
//! - **Store.** A block stored by a prompt of `n` tokens keeps its sliding
//!   KV when it lies wholly in the prompt's last `ring` positions. So does
//!   a block the prompt passed that was held already without it (the bytes
//!   are the same for every prompt that starts with the block's tokens:
//!   attention is causal). The ring holds a block and a window more than a
//!   prompt's partial last block (`KvShape::new`), so a prompt's last whole
//!   block always keeps it.
//! - **Lookup.** A resumed prefill's sliding layers read the `back`
//!   positions before the hit's end (the largest window less one), nothing
//!   older; a hit is cut back to the longest chain whose blocks covering
//!   those positions keep their sliding KV ([`WindowKeep::resumable`]).
//! - **Restore.** Only those blocks go into the sequence's ring
//!   ([`WindowKeep::window`]); the full layers get the whole chain.
//! - **Demotion** moves a slot's bytes, its sliding KV with them.
//!
//! So a conversation that goes on (each turn's prompt extends the last
//! one's) hits the whole previous prompt; a prompt that shares only the
//! start of another (a common system prompt) resumes no further than where
//! some earlier prompt ended.

use krasis_model::prefix_cache::{Demotion, Hit, Place, StorePlan, Tier};

/// The sliding-KV marks of both tiers' slots.
#[derive(Debug, Clone)]
pub(crate) struct WindowKeep {
    block_tokens: usize,
    /// Positions before a hit's end a resumed prefill's sliding layers read.
    back: usize,
    /// Rows of one sequence's ring.
    ring: usize,
    /// Per tier (primary, secondary) and slot: the slot's block holds its
    /// sliding layers' KV.
    kept: [Vec<bool>; 2],
}

impl WindowKeep {
    /// Marks for pools of `slots` (primary, secondary) blocks of
    /// `block_tokens`, sliding windows reading `back` positions before a
    /// query, rings of `ring` rows.
    pub fn new(block_tokens: usize, back: usize, ring: usize, slots: (usize, usize)) -> Self {
        WindowKeep {
            block_tokens: block_tokens.max(1),
            back,
            ring,
            kept: [vec![false; slots.0], vec![false; slots.1]],
        }
    }

    /// The first block of the window before a chain of `blocks` blocks.
    pub fn first(&self, blocks: usize) -> usize {
        (blocks * self.block_tokens).saturating_sub(self.back) / self.block_tokens
    }

    /// Whether the block at `p` holds its sliding layers' KV.
    pub fn is_kept(&self, p: &Place) -> bool {
        self.kept[p.tier.index()][p.slot]
    }

    /// Marks the block at `p` (loaded from the prefix cache's file).
    pub fn set_kept(&mut self, p: &Place, kept: bool) {
        self.kept[p.tier.index()][p.slot] = kept;
    }

    /// Whether a prompt can resume after `chain` (the places of its first
    /// blocks): every block of the window before its end keeps its
    /// sliding KV.
    pub fn resumable(&self, chain: &[Place]) -> bool {
        chain[self.first(chain.len())..]
            .iter()
            .all(|p| self.is_kept(p))
    }

    /// `(tier, slot, block)` of the hit's blocks a restore writes into the
    /// sequence's ring: the window before its end.
    pub fn window<'a>(&self, hit: &'a Hit) -> impl Iterator<Item = (Tier, usize, usize)> + 'a {
        let first = self.first(hit.blocks.len());
        hit.blocks
            .iter()
            .enumerate()
            .skip(first)
            .map(|(b, p)| (p.tier, p.slot, b))
    }

    /// A demotion moved a primary slot's bytes to a secondary slot.
    pub fn demoted(&mut self, d: Demotion) {
        self.kept[1][d.to] = self.kept[0][d.from];
    }

    /// Marks the slots of `plan` (a store after a prompt of `n` tokens)
    /// and returns `(tier, slot, block)` of those whose sliding KV the
    /// store copies from the sequence's ring: its new blocks in the
    /// prompt's last `ring` positions, and the held ones there that lacked
    /// it.
    pub fn stored(&mut self, plan: &StorePlan, n: usize) -> Vec<(Tier, usize, usize)> {
        let lo = n.saturating_sub(self.ring);
        let inside = |b: usize| b * self.block_tokens >= lo;
        let mut copy = Vec::new();
        for s in &plan.blocks {
            let t = s.place.tier.index();
            self.kept[t][s.place.slot] = inside(s.block);
            if inside(s.block) {
                copy.push((s.place.tier, s.place.slot, s.block));
            }
        }
        for s in &plan.held {
            let t = s.place.tier.index();
            if inside(s.block) && !self.kept[t][s.place.slot] {
                self.kept[t][s.place.slot] = true;
                copy.push((s.place.tier, s.place.slot, s.block));
            }
        }
        copy
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use krasis_model::prefix_cache::PrefixCache;

    /// `n` token ids from `seed` (distinct streams for distinct seeds).
    fn toks(n: usize, seed: u32) -> Vec<u32> {
        (0..n as u32).map(|i| seed * 100_000 + i).collect()
    }

    /// Serves `prompt` as the engine does: a lookup cut back by the
    /// marks, then a store that marks what the ring holds. Returns the
    /// cached tokens and the ring blocks the restore writes.
    fn serve(c: &mut PrefixCache, k: &mut WindowKeep, prompt: &[u32]) -> (usize, Vec<usize>) {
        let hit = c.lookup_where(prompt, &mut |chain| k.resumable(chain));
        let window: Vec<usize> = k.window(&hit).map(|w| w.2).collect();
        let plan = c.plan_store(prompt, &hit, &mut |d| {
            k.demoted(d);
            true
        });
        k.stored(&plan, prompt.len());
        assert!(c.publish(plan));
        (hit.tokens, window)
    }

    /// tiny-gpt-oss in `runtime/gpu/tests/prefix_cache.rs`
    /// (`gpt_oss_hits_are_exact`): window 16 (15 back), 64-token blocks,
    /// rings of 128 rows, the tiers that test uses (64 VRAM blocks; 2 VRAM
    /// and 32 host blocks, which demotes). The cached tokens of each step
    /// are what the GPU test expects, and each restore writes the last
    /// block only.
    #[test]
    fn the_gpu_tests_steps_resume_where_the_window_is_kept() {
        for (vram, host) in [(64, 0), (2, 32)] {
            steps_of_the_gpu_test(vram, host);
        }
    }

    fn steps_of_the_gpu_test(vram: usize, host: usize) {
        let mut c = PrefixCache::new(64, 10, ("vram", vram), ("host", host));
        let mut k = WindowKeep::new(64, 15, 128, (vram, host));
        let steps = krasis_model::testutil::gpt_oss_window_steps(toks);
        for (i, (p, want)) in steps.into_iter().enumerate() {
            let (got, window) = serve(&mut c, &mut k, &p);
            assert_eq!(got, want, "tiers {vram}+{host}, step {i}");
            let last: Vec<usize> = (want / 64).checked_sub(1).into_iter().collect();
            assert_eq!(
                window, last,
                "tiers {vram}+{host}, step {i}: the ring blocks restored"
            );
        }
        if host > 0 {
            assert!(c.stats().demotions > 0, "nothing was demoted");
            assert_eq!(c.stats().evictions, 0);
        }
    }

    /// Blocks shorter than the window: the window before a hit spans two
    /// blocks, and a hit needs both kept; a prompt completes held blocks
    /// its ring holds; a demotion carries the mark to the secondary tier.
    #[test]
    fn a_window_over_two_blocks_and_demotions() {
        // Window 128 (127 back), 64-token blocks, rings of 256 rows; a
        // primary tier of 9 slots and a secondary of 16.
        let mut c = PrefixCache::new(64, 10, ("vram", 9), ("host", 16));
        let mut k = WindowKeep::new(64, 127, 256, (9, 16));
        assert_eq!((k.first(10), k.first(1)), (8, 0));
        let p = toks(600, 7); // 9 whole blocks; the ring holds 344..600
        assert_eq!(serve(&mut c, &mut k, &p), (0, vec![]));
        // Blocks 6, 7, 8 kept (384, 448, 512 >= 344); 5 (320) not. The
        // hit ends after block 8: window 7..9.
        assert_eq!(serve(&mut c, &mut k, &p), (576, vec![7, 8]));
        // A prompt ending in block 8 resumes after 8 blocks: window 6..8.
        assert_eq!(serve(&mut c, &mut k, &p[..520]), (512, vec![6, 7]));
        // After 7 blocks the window needs block 5, not kept, and no
        // shorter chain ends on kept blocks: nothing. Its prefill from 0
        // leaves 194..450 in its ring: held blocks 4 and 5 are completed
        // (and 0..6 touched, so 7 and 8 are now the oldest).
        assert_eq!(serve(&mut c, &mut k, &p[..450]).0, 0);
        assert_eq!(serve(&mut c, &mut k, &p[..390]), (384, vec![4, 5]));
        // Another prompt's 4 blocks take primary slots: the oldest held
        // blocks, 7 and 8 among them, move to the secondary tier with
        // their marks, so the whole prompt still resumes after block 8.
        let before = c.stats().demotions;
        assert_eq!(serve(&mut c, &mut k, &toks(300, 8)).0, 0);
        assert_eq!(c.stats().demotions, before + 4);
        let hit = c.lookup(&p);
        assert!(
            hit.blocks[7..].iter().all(|pl| pl.tier == Tier::Secondary),
            "blocks 7 and 8 were not demoted: {:?}",
            hit.blocks
        );
        assert_eq!(serve(&mut c, &mut k, &p), (576, vec![7, 8]));
    }
}
