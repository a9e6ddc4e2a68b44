//! CPU reference of `cuda/expert_tail.cu`: the same state and the same
//! lookup/promotion policy (demand and prefetch launches), one launch at a
//! time. The fetch copies are returned as (host address, slot address)
//! pairs for the caller to apply.

use crate::ops::expert_tail::{TABLE_FRESH, TAIL_COUNTERS, TAIL_NONE, TailMode};

/// The tail's state (field meanings in `cuda/expert_tail.cu`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TailState {
    pub experts: usize,
    pub top_k: usize,
    pub table: Vec<u64>,
    pub host: Vec<u64>,
    pub home: Vec<u64>,
    pub tail_of: Vec<u32>,
    pub owner: Vec<u32>,
    pub stamp: Vec<u32>,
    pub pending: Vec<u32>,
    pub slot: Vec<u64>,
    pub clock: u32,
    /// Lookups, hits, promoted, read in place; predicted, prefetched,
    /// prefetches used, prefetches wasted.
    pub counters: [u64; TAIL_COUNTERS],
}

impl TailState {
    /// An empty tail over `table` (slots and host addresses as the caller
    /// placed them, which is also every key's home), `host` and the tail
    /// slots' addresses, for launches of `[rows, top_k]` ids.
    pub fn new(
        experts: usize,
        top_k: usize,
        table: Vec<u64>,
        host: Vec<u64>,
        slot: Vec<u64>,
    ) -> Self {
        assert_eq!(table.len(), host.len());
        let n = slot.len();
        TailState {
            experts,
            top_k,
            tail_of: vec![TAIL_NONE; table.len()],
            home: table.clone(),
            table,
            host,
            owner: vec![TAIL_NONE; n],
            stamp: vec![0; n],
            pending: vec![0; n],
            slot,
            clock: 0,
            counters: [0; TAIL_COUNTERS],
        }
    }

    /// `tail_home` of one (key, address) pair: the key's home and table
    /// entry become `addr` (a slot that now holds it).
    pub fn set_home(&mut self, key: usize, addr: u64) {
        self.home[key] = addr;
        self.table[key] = addr;
    }

    /// One demand lookup launch of MoE layer `layer`; returns the fetch
    /// list.
    pub fn lookup(&mut self, layer: usize, ids: &[u32]) -> Vec<(u64, u64)> {
        self.launch(layer, ids, TailMode::Demand)
    }

    /// One lookup launch of MoE layer `layer` over the pairs' expert ids
    /// (`[rows, top_k]`) in `mode`; returns the fetch list.
    pub fn launch(&mut self, layer: usize, ids: &[u32], mode: TailMode) -> Vec<(u64, u64)> {
        assert!(ids.len().is_multiple_of(self.top_k), "whole rows");
        let (prefetch, max) = match mode {
            TailMode::Demand | TailMode::DemandUnmarked => (false, usize::MAX),
            TailMode::Prefetch { max } => (true, max),
        };
        let mark = mode == TailMode::Demand;
        // u32 like the kernel's (it wraps after ~4e9 lookups, ~7 days of
        // decode without a prefill: LRU order is then wrong, never results).
        self.clock = self.clock.wrapping_add(1);
        let now = self.clock;
        // A prefetch spares the previous launch's slots too.
        let spared = if prefetch && now > 1 { now - 1 } else { now };
        let keys: Vec<usize> = ids
            .iter()
            .map(|&e| {
                assert!((e as usize) < self.experts, "expert id {e} out of range");
                layer * self.experts + e as usize
            })
            .collect();
        // An earlier step's fresh mark (its copy has landed) is cleared.
        for &k in &keys {
            self.table[k] &= !TABLE_FRESH;
        }
        let hit: Vec<bool> = keys
            .iter()
            .map(|&k| self.table[k] != self.host[k])
            .collect();
        let mut useful = 0;
        for (&k, &h) in keys.iter().zip(&hit) {
            let t = self.tail_of[k];
            if h && t != TAIL_NONE && self.table[k] != self.slot[t as usize] {
                // Landed in its prior slot meanwhile: the tail slot is free.
                let t = t as usize;
                self.owner[t] = TAIL_NONE;
                self.tail_of[k] = TAIL_NONE;
                self.stamp[t] = 0;
                self.counters[7] += std::mem::take(&mut self.pending[t]) as u64;
            } else if h && t != TAIL_NONE {
                self.stamp[t as usize] = now;
                if !prefetch && self.pending[t as usize] != 0 {
                    self.pending[t as usize] = 0;
                    useful += 1;
                }
            }
        }
        // Distinct misses rank-major, with their pair counts.
        let rows = keys.len() / self.top_k;
        let mut misses: Vec<(usize, u64)> = Vec::new();
        for q in 0..keys.len() {
            let p = (q % rows) * self.top_k + q / rows;
            if hit[p] {
                continue;
            }
            match misses.iter_mut().find(|(m, _)| *m == keys[p]) {
                Some((_, n)) => *n += 1,
                None => misses.push((keys[p], 1)),
            }
        }
        if prefetch {
            self.counters[4] += keys.len() as u64;
            misses.truncate(max);
        } else {
            self.counters[0] += keys.len() as u64;
            self.counters[1] += hit.iter().filter(|&&h| h).count() as u64;
            self.counters[6] += useful;
        }
        let mut fetch = Vec::new();
        let mut promoted = Vec::new();
        for (key, pairs) in misses {
            let victim = (0..self.slot.len())
                .filter(|&t| self.stamp[t] != now && self.stamp[t] != spared)
                .min_by_key(|&t| (self.stamp[t], t));
            let Some(v) = victim else {
                if !prefetch {
                    self.counters[3] += pairs;
                }
                continue;
            };
            let old = self.owner[v];
            if old != TAIL_NONE {
                self.table[old as usize] = self.home[old as usize];
                self.tail_of[old as usize] = TAIL_NONE;
            }
            self.counters[7] += self.pending[v] as u64;
            self.pending[v] = prefetch as u32;
            self.owner[v] = key as u32;
            self.stamp[v] = now;
            self.tail_of[key] = v as u32;
            // A demand promotion is marked fresh until the next lookup
            // of its key (the GEMVs wait for its copy).
            self.table[key] = self.slot[v] | if mark { TABLE_FRESH } else { 0 };
            fetch.push((self.host[key], self.slot[v]));
            promoted.push(v);
        }
        if prefetch {
            // A guess enters the LRU order at its old end (stamped `now`
            // until here so the launch never evicts its own).
            for v in promoted {
                self.stamp[v] = 1;
            }
        }
        self.counters[if prefetch { 5 } else { 2 }] += fetch.len() as u64;
        fetch
    }
}
