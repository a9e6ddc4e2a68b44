//! The KV arena: which rows of the full-attention layers' KV buffers each
//! running sequence holds (continuous batching).
//!
//! Every full-attention layer's K and V buffers hold `rows` positions
//! (`[kv_head][rows][head_dim]`); a sequence reserves one contiguous range
//! `[base, base + len)` of them when it is admitted, the same range in
//! every layer, and its position `p` lives in row `base + p`. So the
//! prefill and decode kernels see a plain linear cache from the sequence's
//! first row (`KvBase`), need no paging, and a sequence's KV is exactly
//! what it would be alone.
//!
//! Placement is first fit over the free gaps in row order; a request whose
//! range does not fit waits (`Admission::Wait`) until a sequence ends and
//! gives its rows back. No compaction: live sequences never move (their
//! rows are written by kernels already queued), so a fragmented arena can
//! make a request wait that would fit in the total free rows; it runs once
//! enough neighbours end. With the default arena (one context of rows) and
//! requests that reserve at most a context, an idle arena always admits.

/// Reserved row ranges of one arena.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvArena {
    rows: usize,
    /// `(base, len)` of the reserved ranges, sorted by base, disjoint.
    used: Vec<(usize, usize)>,
}

impl KvArena {
    /// An empty arena of `rows` rows.
    pub fn new(rows: usize) -> Self {
        KvArena {
            rows,
            used: Vec::new(),
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Rows reserved now.
    pub fn used_rows(&self) -> usize {
        self.used.iter().map(|r| r.1).sum()
    }

    /// Whether nothing is reserved.
    pub fn is_empty(&self) -> bool {
        self.used.is_empty()
    }

    /// The first row of the lowest free gap of at least `len` rows, now
    /// reserved; `None` when no gap holds it (nothing reserved then).
    pub fn reserve(&mut self, len: usize) -> Option<usize> {
        if len == 0 || len > self.rows {
            return None;
        }
        let mut at = 0;
        for (i, &(base, used)) in self.used.iter().enumerate() {
            if base - at >= len {
                self.used.insert(i, (at, len));
                return Some(at);
            }
            at = base + used;
        }
        if self.rows - at >= len {
            self.used.push((at, len));
            return Some(at);
        }
        None
    }

    /// Gives back the range starting at `base`; false if none starts there.
    pub fn release(&mut self, base: usize) -> bool {
        match self.used.iter().position(|r| r.0 == base) {
            Some(i) => {
                self.used.remove(i);
                true
            }
            None => false,
        }
    }

    /// The reserved ranges, in row order.
    pub fn ranges(&self) -> &[(usize, usize)] {
        &self.used
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_fit_fills_gaps_in_row_order() {
        let mut a = KvArena::new(100);
        assert_eq!(a.reserve(30), Some(0));
        assert_eq!(a.reserve(30), Some(30));
        assert_eq!(a.reserve(30), Some(60));
        // 10 rows left: 11 waits, nothing reserved.
        assert_eq!(a.reserve(11), None);
        assert_eq!(a.used_rows(), 90);
        // The middle range ends; its gap is the first that fits.
        assert!(a.release(30));
        assert_eq!(a.reserve(20), Some(30));
        assert_eq!(a.reserve(10), Some(50));
        assert_eq!(a.reserve(10), Some(90));
        assert_eq!(
            a.ranges(),
            &[(0, 30), (30, 20), (50, 10), (60, 30), (90, 10)]
        );
        assert_eq!(a.reserve(1), None);
    }

    #[test]
    fn ranges_never_overlap_and_all_rows_come_back() {
        // A deterministic churn of reservations and releases: every live
        // range is disjoint from the others and inside the arena, and once
        // all end the arena is empty and holds its whole size again.
        let mut a = KvArena::new(1000);
        let mut live: Vec<(usize, usize)> = Vec::new();
        let mut x = 12345u64;
        for step in 0..2000 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            if live.len() > 3 && (x >> 33).is_multiple_of(3) {
                let i = (x >> 40) as usize % live.len();
                let (b, _) = live.swap_remove(i);
                assert!(a.release(b), "step {step}");
            } else {
                let len = 1 + (x >> 35) as usize % 300;
                if let Some(b) = a.reserve(len) {
                    assert!(b + len <= 1000);
                    for &(ob, ol) in &live {
                        assert!(b + len <= ob || ob + ol <= b, "step {step}: overlap");
                    }
                    live.push((b, len));
                }
            }
            assert_eq!(a.used_rows(), live.iter().map(|r| r.1).sum::<usize>());
        }
        for (b, _) in live {
            assert!(a.release(b));
        }
        assert!(a.is_empty());
        assert_eq!(a.reserve(1000), Some(0));
    }

    #[test]
    fn empty_or_oversized_ranges_and_unknown_releases_are_refused() {
        let mut a = KvArena::new(10);
        assert_eq!(a.reserve(0), None);
        assert_eq!(a.reserve(11), None);
        assert!(!a.release(3));
        assert_eq!(a.reserve(10), Some(0));
        assert!(!a.release(1));
        assert!(a.release(0));
        assert!(a.is_empty());
    }
}
