//! Host-side bookkeeping of the GPU expert cache: which (MoE layer, expert)
//! sits in which slot, the two tiers, and the bounded recency tail.
//!
//! Slots `0..resident` form the *resident* tier: the heatmap's top experts,
//! loaded once, never evicted, and they survive prefill. Slots
//! `resident..resident + prior` hold the heatmap's next experts and slots
//! after that form the *recency tail*; together these are the
//! *reclaimable* tier, whose memory prefill borrows as staging and which is
//! reloaded (prior part) or emptied (tail) afterwards.
//!
//! A decode miss is always copied to the GPU (the expert must run there);
//! it lands in the least recently used tail slot. So promotion is bounded
//! by construction: only the tail ever changes during a request, a miss
//! costs exactly one expert copy and no victim is ever moved anywhere.
//! White paper F08 (unbounded promotion collapsed Qwen3-235B decode) and F10
//! (clever victim rules changed their own future adversely) are why the
//! policy is plain LRU over a small tail and a fixed global core.

/// "No slot" / "no owner".
const NONE: u32 = u32::MAX;

/// Counters of one request (or since the last reset).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Counters {
    pub lookups: u64,
    pub hits: u64,
    /// Misses copied into the tail (each one expert copy).
    pub promotions: u64,
    /// Tail slots whose previous expert was dropped to make room.
    pub evictions: u64,
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

/// Where a looked-up expert is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Already in this slot.
    Hit(usize),
    /// Not on the GPU: copy it into this slot (its previous owner, if any,
    /// has been dropped from the table).
    Miss(usize),
}

#[derive(Debug, Clone)]
pub struct Residency {
    layers: usize,
    experts: usize,
    slot_of: Vec<u32>,
    owner: Vec<u32>,
    resident: usize,
    prior: usize,
    tail: usize,
    /// The reclaimable slots' owners from the heatmap (reloaded after prefill).
    prior_owners: Vec<u32>,
    /// Whether the reclaimable tier is lent to prefill right now.
    lent: bool,
    // Intrusive LRU list over tail slots (indices relative to the tail).
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32, // most recent
    last: u32, // least recent
    pub counters: Counters,
}

impl Residency {
    /// `ranked`: (MoE layer, expert) pairs, best first (the heatmap prior).
    /// The first `resident` become the resident tier, the next `prior` the
    /// reclaimable prior; `tail` slots start empty.
    pub fn new(
        layers: usize,
        experts: usize,
        ranked: &[(usize, usize)],
        resident: usize,
        prior: usize,
        tail: usize,
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
            owner: vec![NONE; resident + prior + tail],
            resident,
            prior,
            tail,
            prior_owners: Vec::with_capacity(prior),
            lent: false,
            prev: vec![NONE; tail],
            next: vec![NONE; tail],
            head: NONE,
            last: NONE,
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
        for i in 0..tail {
            r.push_front(i);
        }
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
    pub fn tail_slots(&self) -> usize {
        self.tail
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

    fn drop_slot(&mut self, slot: usize) -> bool {
        let key = std::mem::replace(&mut self.owner[slot], NONE);
        if key == NONE {
            return false;
        }
        self.slot_of[key as usize] = NONE;
        true
    }

    /// Looks up the experts one token selected in MoE layer `layer` and
    /// decides each one's slot. Hits are marked recent before any victim is
    /// chosen, so a victim is never one of `experts` (needs a tail of at
    /// least `experts.len()` slots, checked).
    pub fn route(
        &mut self,
        layer: usize,
        experts: &[u32],
        out: &mut Vec<Placement>,
    ) -> Result<(), String> {
        out.clear();
        if self.lent {
            return Err("decode lookup while the reclaimable tier is lent to prefill".into());
        }
        if self.tail < experts.len() {
            return Err(format!(
                "the recency tail has {} slots but a token selects {} experts",
                self.tail,
                experts.len()
            ));
        }
        for &e in experts {
            let e = e as usize;
            if e >= self.experts {
                return Err(format!(
                    "expert id {e} out of range (layer has {})",
                    self.experts
                ));
            }
            if let Some(s) = self.slot_of(layer, e) {
                self.touch(s);
            }
        }
        for &e in experts {
            let key = layer * self.experts + e as usize;
            self.counters.lookups += 1;
            match self.slot_of[key] {
                NONE => {
                    let t = self.last as usize;
                    let slot = self.resident + self.prior + t;
                    if self.drop_slot(slot) {
                        self.counters.evictions += 1;
                    }
                    self.place(slot, key);
                    self.touch(slot);
                    self.counters.promotions += 1;
                    out.push(Placement::Miss(slot));
                }
                s => {
                    self.counters.hits += 1;
                    out.push(Placement::Hit(s as usize));
                }
            }
        }
        Ok(())
    }

    /// Prefill borrows the reclaimable tier: its experts leave the table.
    pub fn lend_reclaimable(&mut self) {
        for s in self.resident..self.owner.len() {
            self.drop_slot(s);
        }
        self.lent = true;
    }

    /// After prefill: the prior slots get their heatmap experts back (the
    /// caller copies them) and the tail starts empty. Returns the (slot,
    /// layer, expert) copies to make.
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

    fn touch(&mut self, slot: usize) {
        let base = self.resident + self.prior;
        if slot < base {
            return;
        }
        let t = slot - base;
        self.unlink(t);
        self.push_front(t);
    }

    fn unlink(&mut self, t: usize) {
        let (p, n) = (self.prev[t], self.next[t]);
        if p != NONE {
            self.next[p as usize] = n;
        } else if self.head == t as u32 {
            self.head = n;
        }
        if n != NONE {
            self.prev[n as usize] = p;
        } else if self.last == t as u32 {
            self.last = p;
        }
        self.prev[t] = NONE;
        self.next[t] = NONE;
    }

    fn push_front(&mut self, t: usize) {
        self.next[t] = self.head;
        self.prev[t] = NONE;
        if self.head != NONE {
            self.prev[self.head as usize] = t as u32;
        }
        self.head = t as u32;
        if self.last == NONE {
            self.last = t as u32;
        }
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
        let r = Residency::new(2, 8, &ranked(2, 8), 4, 2, 3).unwrap();
        assert_eq!(r.slots(), 9);
        assert_eq!(r.slot_of(0, 0), Some(0));
        assert_eq!(r.slot_of(1, 0), Some(1));
        assert_eq!(r.slot_of(1, 1), Some(3));
        assert_eq!(r.slot_of(0, 2), Some(4));
        assert_eq!(r.slot_of(1, 2), Some(5));
        assert_eq!(r.slot_of(0, 3), None);
        assert_eq!(r.held(), 6);
        assert!(Residency::new(1, 4, &[(1, 0)], 1, 0, 2).is_err());
    }

    #[test]
    fn misses_fill_the_tail_lru_and_never_evict_the_current_token() {
        let mut r = Residency::new(1, 16, &ranked(1, 16), 2, 0, 3).unwrap();
        let mut out = Vec::new();
        r.route(0, &[0, 5, 6], &mut out).unwrap();
        assert!(matches!(out[0], Placement::Hit(0)));
        assert!(matches!(out[1], Placement::Miss(_)));
        assert!(matches!(out[2], Placement::Miss(_)));
        assert_eq!(r.counters.evictions, 0);
        r.route(0, &[5, 7, 8], &mut out).unwrap();
        // 5 hits in the tail; 7 and 8 take the two other tail slots, and
        // one of them evicts 6 (the least recent), never 5.
        assert!(matches!(out[0], Placement::Hit(_)));
        assert!(r.slot_of(0, 5).is_some());
        assert!(r.slot_of(0, 6).is_none());
        assert_eq!(r.counters.evictions, 1);
        assert_eq!(r.counters.promotions, 4);
        assert_eq!(r.counters.lookups, 6);
        assert_eq!(r.counters.hits, 2);
        // Resident slots never change.
        assert_eq!(r.slot_of(0, 0), Some(0));
        assert_eq!(r.slot_of(0, 1), Some(1));
        // A token selecting more experts than the tail holds is refused.
        assert!(r.route(0, &[9, 10, 11, 12], &mut out).is_err());
    }

    #[test]
    fn lru_order_follows_use() {
        let mut r = Residency::new(1, 16, &[], 0, 0, 3).unwrap();
        let mut out = Vec::new();
        for e in [1u32, 2, 3] {
            r.route(0, &[e], &mut out).unwrap();
        }
        r.route(0, &[1], &mut out).unwrap(); // 1 becomes most recent
        r.route(0, &[4], &mut out).unwrap(); // evicts 2
        assert!(r.slot_of(0, 2).is_none());
        assert!(r.slot_of(0, 1).is_some() && r.slot_of(0, 3).is_some());
    }

    #[test]
    fn prefill_lends_and_restores_the_reclaimable_tier() {
        let mut r = Residency::new(1, 16, &ranked(1, 16), 2, 2, 2).unwrap();
        let mut out = Vec::new();
        r.route(0, &[9], &mut out).unwrap();
        r.lend_reclaimable();
        assert!(r.route(0, &[0], &mut out).is_err());
        assert_eq!(r.resident_slot(0, 0), Some(0));
        assert_eq!(r.slot_of(0, 2), None);
        assert_eq!(r.slot_of(0, 9), None);
        let copies = r.restore_reclaimable();
        assert_eq!(copies, vec![(2, 0, 2), (3, 0, 3)]);
        assert_eq!(r.slot_of(0, 2), Some(2));
        assert_eq!(r.slot_of(0, 9), None);
        assert_eq!(r.held(), 4);
    }
}
