//! Host-side bookkeeping of the GPU expert cache: which (MoE layer, expert)
//! sits in which slot, and the two tiers.
//!
//! Slots `0..resident` form the *resident* tier: the heatmap's top experts,
//! loaded once, never evicted, and they survive prefill. Slots
//! `resident..resident + prior` hold the heatmap's next experts: the
//! *reclaimable* tier, whose memory prefill borrows as staging and which is
//! reloaded afterwards.
//!
//! Decode changes nothing here: an expert that is not in a slot is read in
//! place from page-locked host memory by the kernels (`hcs/mod.rs`), so a
//! miss costs its bytes over PCIe and no slot, copy or victim. The decode
//! placement is fixed for the life of the engine. (Until session 8 a miss was
//! copied into an LRU recency tail; white paper F08 and F10 had already
//! shown why promotion had to stay small and dumb. Reading in place made the
//! tail's slots more useful as prior slots.) [`Residency::tally`] counts
//! hits from a step's routes after the step.

/// "No slot" / "no owner".
const NONE: u32 = u32::MAX;

/// Counters of one request (or since the last reset), over the (row,
/// expert) pairs of its decode steps.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Counters {
    pub lookups: u64,
    /// Pairs whose expert was in a slot.
    pub hits: u64,
    /// Decode steps tallied.
    pub steps: u64,
}

impl Counters {
    pub fn hit_rate(&self) -> f64 {
        if self.lookups == 0 {
            1.0
        } else {
            self.hits as f64 / self.lookups as f64
        }
    }
}

#[derive(Debug, Clone)]
pub struct Residency {
    layers: usize,
    experts: usize,
    slot_of: Vec<u32>,
    owner: Vec<u32>,
    resident: usize,
    prior: usize,
    /// The reclaimable slots' owners from the heatmap (reloaded after prefill).
    prior_owners: Vec<u32>,
    /// Whether the reclaimable tier is lent to prefill right now.
    lent: bool,
    pub counters: Counters,
}

impl Residency {
    /// `ranked`: (MoE layer, expert) pairs, best first (the heatmap prior).
    /// The first `resident` become the resident tier, the next `prior` the
    /// reclaimable prior.
    pub fn new(
        layers: usize,
        experts: usize,
        ranked: &[(usize, usize)],
        resident: usize,
        prior: usize,
    ) -> Result<Self, String> {
        let total = layers * experts;
        if resident + prior > total {
            return Err(format!(
                "{resident} resident + {prior} prior slots exceed the {total} experts"
            ));
        }
        let mut r = Residency {
            layers,
            experts,
            slot_of: vec![NONE; total],
            owner: vec![NONE; resident + prior],
            resident,
            prior,
            prior_owners: Vec::with_capacity(prior),
            lent: false,
            counters: Counters::default(),
        };
        let mut seen = vec![false; total];
        let mut slot = 0;
        for &(l, e) in ranked {
            if slot == resident + prior {
                break;
            }
            if l >= layers || e >= experts {
                return Err(format!(
                    "ranked expert ({l}, {e}) is outside {layers} layers x {experts} experts"
                ));
            }
            let key = l * experts + e;
            if std::mem::replace(&mut seen[key], true) {
                continue;
            }
            r.place(slot, key);
            if slot >= resident {
                r.prior_owners.push(key as u32);
            }
            slot += 1;
        }
        // Fewer ranked pairs than slots: the rest of the prior stays empty.
        r.prior_owners.resize(prior, NONE);
        Ok(r)
    }

    pub fn slots(&self) -> usize {
        self.owner.len()
    }
    pub fn resident_slots(&self) -> usize {
        self.resident
    }
    pub fn prior_slots(&self) -> usize {
        self.prior
    }
    pub fn total_experts(&self) -> usize {
        self.layers * self.experts
    }

    /// Experts on the GPU now.
    pub fn held(&self) -> usize {
        self.owner.iter().filter(|&&o| o != NONE).count()
    }

    pub fn slot_of(&self, layer: usize, expert: usize) -> Option<usize> {
        match self.slot_of[layer * self.experts + expert] {
            NONE => None,
            s => Some(s as usize),
        }
    }

    /// (layer, expert) held by `slot`.
    pub fn owner(&self, slot: usize) -> Option<(usize, usize)> {
        match self.owner[slot] {
            NONE => None,
            k => Some((k as usize / self.experts, k as usize % self.experts)),
        }
    }

    fn place(&mut self, slot: usize, key: usize) {
        self.owner[slot] = key as u32;
        self.slot_of[key] = slot as u32;
    }

    fn drop_slot(&mut self, slot: usize) {
        let key = std::mem::replace(&mut self.owner[slot], NONE);
        if key != NONE {
            self.slot_of[key as usize] = NONE;
        }
    }

    /// Counts one decode step's routes: `ids` holds, for each MoE layer in
    /// order, `pairs` expert ids (`rows * top_k` of them used, row-major).
    /// Returns the cold pairs (experts read from host memory).
    pub fn tally(&mut self, ids: &[u32], pairs: usize, used: usize) -> Result<u64, String> {
        if self.lent {
            return Err(
                "decode routes counted while the reclaimable tier is lent to prefill".into(),
            );
        }
        if used > pairs || ids.len() != self.layers * pairs {
            return Err(format!(
                "{} route ids for {} MoE layers of {pairs} pairs ({used} used)",
                ids.len(),
                self.layers
            ));
        }
        let mut cold = 0;
        for (layer, row) in ids.chunks(pairs).enumerate() {
            for &e in &row[..used] {
                let e = e as usize;
                if e >= self.experts {
                    return Err(format!(
                        "expert id {e} out of range in MoE layer {layer} (it has {})",
                        self.experts
                    ));
                }
                self.counters.lookups += 1;
                if self.slot_of[layer * self.experts + e] == NONE {
                    cold += 1;
                } else {
                    self.counters.hits += 1;
                }
            }
        }
        self.counters.steps += 1;
        Ok(cold)
    }

    /// Prefill borrows the reclaimable tier: its experts leave the table.
    pub fn lend_reclaimable(&mut self) {
        for s in self.resident..self.owner.len() {
            self.drop_slot(s);
        }
        self.lent = true;
    }

    /// After prefill: the prior slots get their heatmap experts back (the
    /// caller copies them). Returns the (slot, layer, expert) copies to make.
    pub fn restore_reclaimable(&mut self) -> Vec<(usize, usize, usize)> {
        let mut copies = Vec::new();
        for (i, &key) in self.prior_owners.clone().iter().enumerate() {
            if key != NONE {
                let slot = self.resident + i;
                self.place(slot, key as usize);
                copies.push((
                    slot,
                    key as usize / self.experts,
                    key as usize % self.experts,
                ));
            }
        }
        self.lent = false;
        copies
    }

    pub fn is_lent(&self) -> bool {
        self.lent
    }

    /// Whether (layer, expert) is in the resident tier (valid during prefill).
    pub fn resident_slot(&self, layer: usize, expert: usize) -> Option<usize> {
        self.slot_of(layer, expert).filter(|&s| s < self.resident)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranked(layers: usize, experts: usize) -> Vec<(usize, usize)> {
        // Expert e of every layer ranks above expert e+1.
        (0..experts)
            .flat_map(|e| (0..layers).map(move |l| (l, e)))
            .collect()
    }

    #[test]
    fn tiers_come_from_the_ranking() {
        let r = Residency::new(2, 8, &ranked(2, 8), 4, 2).unwrap();
        assert_eq!(r.slots(), 6);
        assert_eq!(r.slot_of(0, 0), Some(0));
        assert_eq!(r.slot_of(1, 0), Some(1));
        assert_eq!(r.slot_of(1, 1), Some(3));
        assert_eq!(r.slot_of(0, 2), Some(4));
        assert_eq!(r.slot_of(1, 2), Some(5));
        assert_eq!(r.slot_of(0, 3), None);
        assert_eq!(r.held(), 6);
        assert!(Residency::new(1, 4, &[(1, 0)], 1, 0).is_err());
    }

    #[test]
    fn a_steps_routes_are_counted_per_pair_and_change_nothing() {
        // Layer 0 holds experts 0 and 1, layer 1 holds expert 0.
        let mut r = Residency::new(2, 16, &ranked(2, 16)[..3], 3, 0).unwrap();
        // Two layers of 3 pairs each, 2 used (one row of top-2 plus room).
        let ids = [0, 5, 99, 0, 1, 99];
        assert_eq!(r.tally(&ids, 3, 2), Ok(2));
        assert_eq!(
            (r.counters.lookups, r.counters.hits, r.counters.steps),
            (4, 2, 1)
        );
        // Two rows selecting the same cold expert are two cold pairs: each
        // reads the expert over PCIe.
        assert_eq!(r.tally(&[5, 5, 0, 7], 2, 2), Ok(3));
        assert_eq!(r.held(), 3, "decode places nothing");
        assert!(r.tally(&[16, 0, 0, 0], 2, 2).is_err(), "out-of-range id");
        assert!(r.tally(&[0, 0], 2, 2).is_err(), "one layer's ids missing");
        r.lend_reclaimable();
        assert!(r.tally(&[0, 0, 0, 0], 2, 2).is_err(), "lent to prefill");
    }

    #[test]
    fn prefill_lends_and_restores_the_reclaimable_tier() {
        let mut r = Residency::new(1, 16, &ranked(1, 16), 2, 2).unwrap();
        r.lend_reclaimable();
        assert_eq!(r.resident_slot(0, 0), Some(0));
        assert_eq!(r.slot_of(0, 2), None);
        let copies = r.restore_reclaimable();
        assert_eq!(copies, vec![(2, 0, 2), (3, 0, 3)]);
        assert_eq!(r.slot_of(0, 2), Some(2));
        assert_eq!(r.slot_of(0, 9), None);
        assert_eq!(r.held(), 4);
    }
}
