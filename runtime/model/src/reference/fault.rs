//! Test-only faults planted in the reference engine's own forward pass
//! (compiled with `cfg(test)` or the `fault-injection` feature, which only
//! dev-dependencies enable). Each is a bug of the kind a new kernel or
//! refactor could introduce; the witness tests load the engine with each and
//! show that their comparison against transformers fails, so a pass means
//! something.

use crate::arch::{AttentionKind, Geometry};
use crate::layers::attention::AttnShape;
use crate::layers::rope::Rope;

/// A deliberate bug in [`ReferenceEngine`](super::ReferenceEngine)'s forward
/// pass, set with [`ReferenceEngine::set_fault`](super::ReferenceEngine::set_fault).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Fault {
    /// The correct engine.
    #[default]
    None,
    /// RoPE rotates q and k by `-angle` (a sign error in `rotate_half`).
    RopeSign,
    /// KV heads 0 and 1 trade places as they are projected, so the query
    /// heads of group 0 attend with KV head 1 and those of group 1 with KV
    /// head 0 (a wrong GQA head mapping). Needs at least two KV heads.
    SwapGqa,
    /// The lowest-ranked of each token's top-k experts is left out of the
    /// combine (its weight is not redistributed). No effect on dense models.
    DropExpert,
    /// Attention sinks are left out of the softmax. No effect on models
    /// without sinks.
    IgnoreSinks,
    /// Sliding-window layers attend to every earlier position. No effect
    /// on models without sliding layers.
    FullWindow,
    /// The router chooses without its selection bias (glm4_moe's
    /// `e_score_correction_bias`). No effect on routers without one.
    IgnoreSelectionBias,
    /// The shared expert is left out of the MoE output. No effect on
    /// models without one.
    NoSharedExpert,
    /// The sampler draws as if the request had no grammar (a sampler that
    /// ignores the constraint's mask). Not in [`Fault::ALL`]: it changes
    /// no logit, only constrained requests see it.
    IgnoreMask,
}

impl Fault {
    /// Every planted bug (not `None`).
    pub const ALL: [Fault; 7] = [
        Fault::RopeSign,
        Fault::SwapGqa,
        Fault::DropExpert,
        Fault::IgnoreSinks,
        Fault::FullWindow,
        Fault::IgnoreSelectionBias,
        Fault::NoSharedExpert,
    ];

    /// The planted bugs that change what a model of geometry `g` computes.
    pub fn applicable(g: &Geometry) -> Vec<Fault> {
        Self::ALL
            .into_iter()
            .filter(|f| match f {
                Fault::None | Fault::RopeSign => true,
                Fault::SwapGqa => g.num_kv_heads >= 2,
                Fault::DropExpert => g.num_moe_layers() > 0,
                Fault::IgnoreSinks => g.attention.sinks,
                Fault::FullWindow => g
                    .layers
                    .iter()
                    .any(|l| matches!(l.attention, AttentionKind::Sliding { .. })),
                Fault::IgnoreSelectionBias => g.num_moe_layers() > 0 && g.router.selection_bias,
                Fault::NoSharedExpert => g.num_moe_layers() > 0 && g.shared_intermediate.is_some(),
                Fault::IgnoreMask => false,
            })
            .collect()
    }
}

/// Applies [`Rope`] with the angle negated: with `D` negating the second
/// half of each head, `R(-a) = D R(a) D` in the `rotate_half` convention.
pub(super) fn rotate_backwards(rope: &Rope, x: &mut [f32], pos: usize) {
    let (d, r) = (rope.head_dim(), rope.rotary_dim());
    let flip = |x: &mut [f32]| {
        for head in x.chunks_exact_mut(d) {
            for v in &mut head[r / 2..r] {
                *v = -*v;
            }
        }
    };
    flip(x);
    rope.apply(x, pos);
    flip(x);
}

/// Swaps KV heads 0 and 1 in every row of `x` (`[n, kv_dim]`).
pub(super) fn swap_kv_heads(x: &mut [f32], shape: AttnShape) {
    let d = shape.head_dim;
    if shape.num_kv_heads < 2 {
        return;
    }
    for row in x.chunks_exact_mut(shape.kv_dim()) {
        let (a, b) = row.split_at_mut(d);
        a.swap_with_slice(&mut b[..d]);
    }
}

/// The `(expert, weight)` pairs the combine uses: all of `chosen`, or
/// without the last (lowest-ranked) one under [`Fault::DropExpert`].
pub(super) fn combined(fault: Fault, mut chosen: Vec<(usize, f32)>) -> Vec<(usize, f32)> {
    if fault == Fault::DropExpert {
        chosen.pop();
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::assert_close;

    #[test]
    fn backwards_rotation_undoes_the_forward_one() {
        let r = Rope::new(8, 10000.0, 16);
        let x: Vec<f32> = (0..16).map(|i| (i as f32 * 0.37).sin()).collect();
        let mut y = x.clone();
        r.apply(&mut y, 11);
        assert!(y.iter().zip(&x).any(|(a, b)| (a - b).abs() > 1e-3));
        rotate_backwards(&r, &mut y, 11);
        assert_close(&y, &x, 1e-5);
    }

    #[test]
    fn kv_heads_zero_and_one_trade_places_in_every_row() {
        let shape = AttnShape {
            num_heads: 6,
            num_kv_heads: 3,
            head_dim: 2,
        };
        let mut x: Vec<f32> = (0..12).map(|i| i as f32).collect();
        swap_kv_heads(&mut x, shape);
        assert_close(&x, &[2., 3., 0., 1., 4., 5., 8., 9., 6., 7., 10., 11.], 0.0);
    }

    #[test]
    fn dropped_expert_is_the_lowest_ranked() {
        let c = vec![(3, 0.6), (5, 0.4)];
        assert_eq!(combined(Fault::DropExpert, c.clone()), vec![(3, 0.6)]);
        assert_eq!(combined(Fault::None, c.clone()), c);
    }
}
