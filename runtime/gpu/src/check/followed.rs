//! The criterion against the reference that follows the engine's near-tie
//! choices (`krasis_model::reference::RouteFollow`): [`Following`],
//! [`classify_followed`].
//!
//! [`fidelity`](super::fidelity)'s classification compares the engine with
//! the plain f32 reference and has to guess how far a router flip's effect
//! may travel (`CARRY_MAX_BOUNDS`). On models whose flips move the residual
//! stream a lot (tiny-gpt-oss: 4 layers, top-2 of 8 experts, biased
//! experts), a flip's effect reaches every later position through the full
//! attention layers at several bounds, and that guess cannot separate it
//! from a bug. Following removes the guess: the f32 reference runs the
//! engine's expert set at every decision where its own router has the two
//! sets within the near-tie width, and only there. The two engines then
//! run the same discrete computation and differ by rounding alone.
//!
//! **Against the following reference** (full logits): PASS iff
//! 1. no position over the bound (1% of the largest |logit|), and every
//!    engine logit finite;
//! 2. followed decisions ≤ 2% of the routing decisions (MoE layers ×
//!    positions): a rate per decision, so a deeper model is not held to a
//!    tighter rule per layer;
//! 3. argmax agreement ≥ 98% (a mismatch within the bound is a tie);
//! 4. logits for every position.
//!
//! A route change at a gap wider than the near-tie width is never followed,
//! so its effect stays and fails rule 1.
//!
//! **Against the transformers witness** (its top ids per position): a
//! position over the bound is *explained* iff a decision at it or before it
//! was followed and the engine is within the bound of the following
//! reference there: the following reference is the f32 oracle, which the
//! CPU tests hold to the witness at 1e-3, with the engine's near-tie
//! choices, so the whole difference is those choices. Rules 2-4 as above
//! (rates pooled over the fixture's short sequences).
//!
//! **The near-tie width** is `max(0.01, 1% of |k-th logit|, s)` where `s`
//! ([`pre_flip_spread`]) is the largest movement of a router gap that the
//! CPU reference's BF16 emulation makes before its first flip: how far
//! rounding alone moves gaps on this model, measured where no flip has
//! changed the hidden state yet.

use super::{
    BOUND_FRACTION, Class, Compared, FidelityReport, LayerRoutes, NEAR_TIE_ABS, NEAR_TIE_REL,
    OverBound, Routes, Traced, WitnessSequence, routes_from_trace, same_experts,
};
use krasis_model::reference::{ReferenceEngine, RouteFollow};

/// The largest |gap(emulation) − gap(f32)| over the MoE decisions of the
/// positions before the emulation's first flip (all positions if it makes
/// none).
pub fn pre_flip_spread(oracle: &Routes, emulation: &Routes) -> f32 {
    let n = oracle.first().map_or(0, Vec::len);
    let first_flip = (0..n)
        .find(|&p| {
            oracle
                .iter()
                .zip(emulation)
                .any(|(o, e)| !o[p].same_set(&e[p]))
        })
        .unwrap_or(n);
    oracle
        .iter()
        .zip(emulation)
        .flat_map(|(o, e)| o[..first_flip].iter().zip(&e[..first_flip]))
        .map(|(o, e)| (o.gap - e.gap).abs())
        .filter(|d| d.is_finite())
        .fold(0f32, f32::max)
}

/// The following reference's run of one sequence.
pub struct Following {
    pub logits: Vec<Vec<f32>>,
    /// The experts it ran (the engine's where followed), with its own f32
    /// router gap and k-th logit.
    pub routes: Routes,
    /// `[moe layer][position]`: the decision took the engine's set.
    pub followed: Vec<Vec<bool>>,
    /// The measured part of the near-tie width it ran with.
    pub spread: f32,
}

impl Following {
    /// Runs `r` (left in f32) over `tokens` following the engine's
    /// `engine` routes (`[moe layer][position]`, decoder layers
    /// `moe_layers`) with the near-tie width's measured part `spread`.
    pub fn new(
        r: &mut ReferenceEngine,
        tokens: &[u32],
        moe_layers: &[usize],
        engine: &Routes,
        spread: f32,
    ) -> Result<Self, krasis_model::EngineError> {
        let layers = r.geometry().num_layers;
        let mut experts = vec![Vec::new(); layers];
        for (m, &l) in moe_layers.iter().enumerate() {
            if let Some(rows) = engine.get(m) {
                experts[l] = rows
                    .iter()
                    .map(|x| x.experts.iter().map(|&e| e as usize).collect())
                    .collect();
            }
        }
        r.set_activations(krasis_model::reference::Activations::F32);
        let follow = RouteFollow {
            experts,
            abs: NEAR_TIE_ABS,
            rel: NEAR_TIE_REL,
            spread,
        };
        let (logits, trace) = r.prompt_logits_following(tokens, follow)?;
        Ok(Following {
            routes: routes_from_trace(&trace, moe_layers),
            followed: moe_layers
                .iter()
                .map(|&l| trace.followed[l].clone())
                .collect(),
            logits,
            spread,
        })
    }

    /// [`Following::new`] with the spread measured by `traced` (the same
    /// reference's f32 and BF16-emulation runs of a sequence).
    pub fn after(
        r: &mut ReferenceEngine,
        traced: &Traced,
        tokens: &[u32],
        moe_layers: &[usize],
        engine: &Routes,
    ) -> Result<Self, krasis_model::EngineError> {
        let s = pre_flip_spread(&traced.f32_routes, &traced.bf16_routes);
        Self::new(r, tokens, moe_layers, engine, s)
    }

    /// Positions `range` only (e.g. the decoded tokens of a run whose
    /// prompt came first).
    pub fn window(self, range: std::ops::Range<usize>) -> Self {
        Following {
            logits: self.logits.get(range.clone()).unwrap_or_default().to_vec(),
            routes: super::routes_window(&self.routes, range.clone()),
            followed: self
                .followed
                .iter()
                .map(|rows| rows.get(range.clone()).unwrap_or_default().to_vec())
                .collect(),
            spread: self.spread,
        }
    }

    fn threshold(&self, kth: f32) -> f32 {
        super::near_tie_threshold(kth).max(self.spread)
    }
}

/// The engine's logits against the following reference's (every position).
pub fn classify_followed_full(
    label: &str,
    engine: &[Vec<f32>],
    engine_routes: &Routes,
    f: &Following,
    moe_layers: &[usize],
) -> FidelityReport {
    let c = Compared::full(engine, &f.logits);
    classify_followed(label, &c, engine_routes, f, moe_layers, None)
}

/// The engine's logits against a witness sequence, explained by the
/// following reference `f` of the same tokens.
pub fn classify_followed_witness(
    label: &str,
    engine: &[Vec<f32>],
    engine_routes: &Routes,
    w: &WitnessSequence,
    f: &Following,
    moe_layers: &[usize],
) -> FidelityReport {
    let vs_following: Vec<f32> = Compared::full(engine, &f.logits)
        .positions
        .iter()
        .map(|p| p.err)
        .collect();
    let c = Compared::witness(engine, w);
    classify_followed(label, &c, engine_routes, f, moe_layers, Some(&vs_following))
}

/// Module docs. `vs_following[p]`: the engine's error against the
/// following reference, when the oracle of `c` is a witness.
fn classify_followed(
    label: &str,
    c: &Compared,
    engine_routes: &Routes,
    f: &Following,
    moe_layers: &[usize],
    vs_following: Option<&[f32]>,
) -> FidelityReport {
    let (positions, missing, max_oracle_logit) = (&c.positions, c.missing, c.scale);
    let n = positions.len();
    let bound = BOUND_FRACTION * max_oracle_logit;
    let evidence_error = shape_error(engine_routes, f, moe_layers.len(), n);
    let ok = evidence_error.is_none();
    let followed_at = |p: usize| ok && f.followed.iter().any(|rows| rows[p]);
    let layer_routes = |p: usize| -> Vec<LayerRoutes> {
        if !ok {
            return Vec::new();
        }
        (0..moe_layers.len())
            .filter_map(|m| {
                let (o, g) = (&f.routes[m][p], &engine_routes[m][p]);
                let followed = f.followed[m][p];
                (followed || !o.same_set(g)).then(|| LayerRoutes {
                    layer: moe_layers[m],
                    oracle_experts: o.experts.clone(),
                    emulation_experts: None,
                    engine_experts: g.experts.clone(),
                    gap: o.gap,
                    kth: o.kth,
                    threshold: f.threshold(o.kth),
                    explains: followed,
                    reproduced: None,
                })
            })
            .collect()
    };
    let decisions = if ok { moe_layers.len() * n } else { 0 };
    let followed_decisions = if ok {
        f.followed.iter().flatten().filter(|&&x| x).count()
    } else {
        0
    };
    let mut r = FidelityReport {
        label: label.to_string(),
        evidence: "f32 reference following the engine's near-tie choices".into(),
        positions: n,
        missing_positions: missing,
        max_oracle_logit,
        bound,
        over_bound: 0,
        explained: 0,
        explained_reproduced: 0,
        carried: 0,
        unexplained: 0,
        unexplained_after_flip: 0,
        unexplained_route_change: 0,
        flip_positions: (0..n).filter(|&p| followed_at(p)).count(),
        route_change_positions: 0,
        argmax_agree: 0,
        argmax_mismatch_within_bound: 0,
        max_err: 0.0,
        max_err_non_flip: 0.0,
        median_err: 0.0,
        errors: Vec::new(),
        gap_spread: f.spread,
        rates_judged: true,
        evidence_error,
        failures: Vec::new(),
        passed: false,
        over_bound_positions: Vec::new(),
        decisions,
        followed_decisions,
    };
    let mut last_followed: Option<usize> = None;
    for (p, pe) in positions.iter().enumerate() {
        if followed_at(p) {
            last_followed = Some(p);
        }
        let err = if pe.err.is_nan() {
            f32::INFINITY
        } else {
            pe.err
        };
        r.max_err = r.max_err.max(err);
        let over = err > bound;
        if pe.engine_argmax == pe.oracle_argmax {
            r.argmax_agree += 1;
        } else if !over {
            r.argmax_mismatch_within_bound += 1;
        }
        let ls = layer_routes(p);
        let changed: Vec<&LayerRoutes> = ls
            .iter()
            .filter(|l| !same_experts(&l.engine_experts, &l.oracle_experts))
            .collect();
        if !changed.is_empty() {
            r.route_change_positions += 1;
        }
        // A witness position is explained when the following reference,
        // which ran the engine's near-tie choices, agrees with the engine.
        let agrees_with_following =
            vs_following.is_some_and(|v| v.get(p).is_some_and(|&e| e <= bound));
        let explained = over
            && pe.finite
            && changed.is_empty()
            && last_followed.is_some()
            && agrees_with_following;
        if !explained {
            r.max_err_non_flip = r.max_err_non_flip.max(err);
        }
        if !over {
            continue;
        }
        r.over_bound += 1;
        let (class, reason) = if explained {
            let q = last_followed.unwrap_or(p);
            let class = if q == p {
                Class::Explained
            } else {
                Class::Carried
            };
            (
                class,
                format!(
                    "the reference running the engine's near-tie choice (last at position {q}) is within the bound of the engine here"
                ),
            )
        } else if !pe.finite {
            (Class::Unexplained, "non-finite engine logits".to_string())
        } else if !changed.is_empty() {
            r.unexplained_route_change += 1;
            let why: Vec<String> = changed
                .iter()
                .map(|l| {
                    format!(
                        "layer {}: gap {:.3e} is not below {:.3e}",
                        l.layer, l.gap, l.threshold
                    )
                })
                .collect();
            (
                Class::Unexplained,
                format!(
                    "the engine's experts differ where the router is not near a tie ({})",
                    why.join("; ")
                ),
            )
        } else {
            if last_followed.is_some() {
                r.unexplained_after_flip += 1;
            }
            (
                Class::Unexplained,
                match vs_following {
                    Some(_) => "over the bound, and the following reference does not agree with the engine here either".to_string(),
                    None => "over the bound against the reference that ran the same experts".to_string(),
                },
            )
        };
        match class {
            Class::Explained => r.explained += 1,
            Class::Carried => r.carried += 1,
            Class::Unexplained => r.unexplained += 1,
        }
        r.over_bound_positions.push(OverBound {
            position: p,
            err,
            emulation_err: vs_following.and_then(|v| v.get(p).copied()),
            oracle_argmax: pe.oracle_argmax,
            engine_argmax: pe.engine_argmax,
            class,
            reason,
            after_flip_at: last_followed,
            layers: ls,
        });
    }
    r.set_errors(positions.iter().map(|p| p.err).collect());
    r.judge(true);
    r
}

fn shape_error(engine: &Routes, f: &Following, layers: usize, n: usize) -> Option<String> {
    for (what, r) in [("engine", engine), ("following reference", &f.routes)] {
        if r.len() != layers {
            return Some(format!(
                "{what} routes have {} MoE layers, not {layers}",
                r.len()
            ));
        }
        if let Some(m) = r
            .iter()
            .position(|rows| rows.len() < n || rows.iter().any(|x| x.experts.is_empty()))
        {
            return Some(format!(
                "{what} routes of MoE layer {m} cover {} of {n} positions",
                r[m].len()
            ));
        }
    }
    if f.followed.len() != layers || f.followed.iter().any(|rows| rows.len() < n) {
        return Some(
            "the following reference's followed decisions do not cover the positions".into(),
        );
    }
    None
}

#[cfg(test)]
#[path = "followed_tests.rs"]
mod tests;
