//! Host-side bookkeeping of the GPU expert cache: which (MoE layer, expert)
//! sits in which slot, and the two tiers.
//!
//! Slots `0..resident` form the *resident* tier: the heatmap's top experts,
//! loaded once, never evicted, and they survive prefill. Slots
//! `resident..resident + prior` hold the heatmap's next experts: the
//! *reclaimable* tier, whose memory prefill borrows as staging and which is
//! reloaded afterwards.
//!
//! The decode recency tail (the reclaimable tier's last slots) is not
//! kept here: the device owns its placement during decode (`tail.rs`), and
//! these counters are filled from its counters after each step.

/// "No slot" / "no owner".
const NONE: u32 = u32::MAX;

/// Counters of one request (or since the last reset), over the (row,
/// expert) pairs of its decode steps (filled from the device tail's).
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
