//! The reference that follows another engine's near-tie routing choices
//! ([`ReferenceEngine::prompt_logits_following`]).
//!
//! An engine with BF16 activations moves router logits by rounding, so
//! where a token's k-th and (k+1)-th experts are nearly tied it can select
//! the other expert. That changes the token's logits far more than rounding
//! does, and the changed expert output reaches every later position through
//! attention, so a flip's effect spreads through the rest of the sequence.
//! To tell such flips from bugs, the f32 reference can take the engine's
//! expert set at exactly those (layer, position) decisions where its own
//! f32 router has the two sets within the near-tie width of each other, and
//! nowhere else. Both engines then run the same discrete computation, and
//! what remains between them is rounding alone: an engine that is right
//! agrees with the following reference at every position, whatever its
//! flips did downstream, and a route change at a gap wider than the
//! near-tie width is never followed, so it still shows.
//!
//! Causality makes one pass enough: the routing of layer l at position p
//! depends only on layers < l (all positions) and layer l at positions
//! < p, so deciding each layer's following as its router runs gives the
//! same result as iterating to a fixed point.

/// What to follow, and where.
#[derive(Debug, Clone, PartialEq)]
pub struct RouteFollow {
    /// `[decoder layer][position]`: the experts the other engine selected
    /// (any order; empty for dense layers or positions it did not record).
    pub experts: Vec<Vec<Vec<usize>>>,
    /// The near-tie width: the own router gap (k-th minus (k+1)-th logit)
    /// below `max(abs, rel · |k-th logit|, spread)` is a near-tie.
    pub abs: f32,
    pub rel: f32,
    pub spread: f32,
}

impl RouteFollow {
    pub fn threshold(&self, kth: f32) -> f32 {
        self.abs.max(self.rel * kth.abs()).max(self.spread)
    }

    /// The other engine's experts at (`layer`, `position`), when the own
    /// router's choice differs from them at a near-tie (`gap` < threshold):
    /// the set to run instead of `own`.
    pub fn take(
        &self,
        layer: usize,
        position: usize,
        own: &[usize],
        gap: f32,
        kth: f32,
    ) -> Option<&[usize]> {
        let theirs = self.experts.get(layer)?.get(position)?;
        // A NaN gap is no near-tie.
        let near_tie = gap < self.threshold(kth);
        if theirs.is_empty() || theirs.len() != own.len() || !near_tie {
            return None;
        }
        let (mut a, mut b) = (own.to_vec(), theirs.clone());
        a.sort_unstable();
        b.sort_unstable();
        (a != b).then_some(theirs.as_slice())
    }
}

/// The k-th best router logit and its gap to the (k+1)-th (∞ when every
/// expert is selected).
pub use crate::layers::router::kth_and_gap;

#[cfg(test)]
mod tests {
    use super::*;

    fn follow(experts: Vec<Vec<usize>>) -> RouteFollow {
        RouteFollow {
            experts: vec![Vec::new(), experts],
            abs: 0.01,
            rel: 0.01,
            spread: 0.0,
        }
    }

    #[test]
    fn takes_a_different_set_only_at_a_near_tie() {
        let f = follow(vec![vec![2, 0], vec![1, 3]]);
        // Layer 1, position 0: own {0, 1}, theirs {0, 2}.
        assert_eq!(f.take(1, 0, &[0, 1], 0.005, 0.2), Some(&[2, 0][..]));
        // The same difference at a gap wider than max(0.01, 1% of |k-th|).
        assert_eq!(f.take(1, 0, &[0, 1], 0.02, 0.2), None);
        assert_eq!(f.take(1, 0, &[0, 1], 0.02, 3.0), Some(&[2, 0][..]));
        // Same set in another order: nothing to follow.
        assert_eq!(f.take(1, 1, &[3, 1], 0.0, 1.0), None);
        // Dense layer, unrecorded position, NaN gap: nothing.
        assert_eq!(f.take(0, 0, &[0, 1], 0.0, 1.0), None);
        assert_eq!(f.take(1, 5, &[0, 1], 0.0, 1.0), None);
        assert_eq!(f.take(1, 0, &[0, 1], f32::NAN, 1.0), None);
        // The measured spread widens the near-tie.
        let wide = RouteFollow { spread: 0.05, ..f };
        assert_eq!(wide.take(1, 0, &[0, 1], 0.04, 0.2), Some(&[2, 0][..]));
    }

    #[test]
    fn kth_and_gap_of_sorted_logits() {
        assert_eq!(kth_and_gap(&[0.5, 2.0, 1.0, -1.0], 2), (1.0, 0.5));
        assert_eq!(kth_and_gap(&[0.5, 2.0], 2), (0.5, f32::INFINITY));
    }
}
