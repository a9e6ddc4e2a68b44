//! CPU reference of `cuda/expert_tail.cu`: the same state and the same
//! lookup/promotion policy, one step at a time. The fetch copies are
//! returned as (host address, slot address) pairs for the caller to apply.

use crate::ops::expert_tail::TAIL_NONE;

/// The tail's state (field meanings in `cuda/expert_tail.cu`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TailState {
    pub experts: usize,
    pub table: Vec<u64>,
    pub host: Vec<u64>,
    pub tail_of: Vec<u32>,
    pub owner: Vec<u32>,
    pub stamp: Vec<u32>,
    pub slot: Vec<u64>,
    pub clock: u32,
    /// Lookups, hits, promoted, read in place.
    pub counters: [u64; 4],
}

impl TailState {
    /// An empty tail over `table` (slots and host addresses as the caller
    /// placed them), `host` and the tail slots' addresses.
    pub fn new(experts: usize, table: Vec<u64>, host: Vec<u64>, slot: Vec<u64>) -> Self {
        assert_eq!(table.len(), host.len());
        let n = slot.len();
        TailState {
            experts,
            tail_of: vec![TAIL_NONE; table.len()],
            table,
            host,
            owner: vec![TAIL_NONE; n],
            stamp: vec![0; n],
            slot,
            clock: 0,
            counters: [0; 4],
        }
    }

    /// One lookup launch of MoE layer `layer` over the pairs' expert ids;
    /// returns the fetch list.
    pub fn lookup(&mut self, layer: usize, ids: &[u32]) -> Vec<(u64, u64)> {
        // u32 like the kernel's (it wraps after ~4e9 lookups, ~7 days of
        // decode without a prefill: LRU order is then wrong, never results).
        self.clock = self.clock.wrapping_add(1);
        let now = self.clock;
        let keys: Vec<usize> = ids
            .iter()
            .map(|&e| {
                assert!((e as usize) < self.experts, "expert id {e} out of range");
                layer * self.experts + e as usize
            })
            .collect();
        let hit: Vec<bool> = keys
            .iter()
            .map(|&k| self.table[k] != self.host[k])
            .collect();
        for (&k, &h) in keys.iter().zip(&hit) {
            if h && self.tail_of[k] != TAIL_NONE {
                self.stamp[self.tail_of[k] as usize] = now;
            }
        }
        // Distinct misses in pair order, with their pair counts.
        let mut misses: Vec<(usize, u64)> = Vec::new();
        for (&k, &h) in keys.iter().zip(&hit) {
            if h {
                continue;
            }
            match misses.iter_mut().find(|(m, _)| *m == k) {
                Some((_, n)) => *n += 1,
                None => misses.push((k, 1)),
            }
        }
        self.counters[0] += keys.len() as u64;
        self.counters[1] += hit.iter().filter(|&&h| h).count() as u64;
        let mut fetch = Vec::new();
        for (key, pairs) in misses {
            let victim = (0..self.slot.len())
                .filter(|&t| self.stamp[t] != now)
                .min_by_key(|&t| (self.stamp[t], t));
            let Some(v) = victim else {
                self.counters[3] += pairs;
                continue;
            };
            let old = self.owner[v];
            if old != TAIL_NONE {
                self.table[old as usize] = self.host[old as usize];
                self.tail_of[old as usize] = TAIL_NONE;
            }
            self.owner[v] = key as u32;
            self.stamp[v] = now;
            self.tail_of[key] = v as u32;
            self.table[key] = self.slot[v];
            fetch.push((self.host[key], self.slot[v]));
        }
        self.counters[2] += fetch.len() as u64;
        fetch
    }
}
