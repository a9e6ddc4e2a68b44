//! Comparing an engine's logits against an oracle: the transformers witness
//! fixtures (`tests/fixtures/witness/<case>/int4/`), the CPU reference
//! engine over the same INT4 cache, or another path of the same engine.
//! Pure host code, shared by `krasis-runtime bench --check` and the GPU test
//! binary.
//!
//! # The fidelity criterion of `bench --check` ([`classify`])
//!
//! The CUDA engine stores activations in BF16 by design (the residual
//! stream and every accumulation stay f32). At most positions that moves
//! the logits by well under 1% of their scale. Where a token's router has
//! its k-th and (k+1)-th experts nearly tied, though, the rounding can
//! select the other expert, and that position's logits then differ by far
//! more (benchmarks/results/2026-11-30-bf16-conditioning.md); the changed
//! expert output also reaches later positions through attention. The
//! criterion accepts exactly those, so a FAIL means a bug: the planted
//! faults of `tests/fault_injection.rs` fail it at almost every position.
//!
//! **Oracles.** The GPU's logits of a sequence are compared with
//! (a) the transformers witness fixture of the checkpoint (f32, INT4
//! experts). It holds each position's argmax and top-20 ids and values, and
//! full logits only at the last position, so a position's error is taken
//! over its 20 top ids (every id at the last position); (b) the f32 CPU
//! reference over the same INT4 experts: full logits at every position.
//! Both use the routes of (b) (the witness records none; the CPU tests hold
//! the reference to the witness at f32 precision).
//!
//! **Error and bound.** `err(p)` = max |engine − oracle| over the compared
//! logits of position p (a NaN difference counts as ∞). `bound` = 1%
//! ([`BOUND_FRACTION`]) of the largest |oracle logit| of the whole sequence
//! (for a witness: of the values the fixture holds). A position is *over
//! the bound* when `err(p) > bound`.
//!
//! **Routes**, per MoE layer l and position p ([`Route`]): the oracle's
//! selected set `O`, with its router gap `g` (k-th minus (k+1)-th router
//! logit) and k-th logit `z` (`Trace::router_margin`/`router_kth` of the f32
//! reference); the engine's set `G` (`CudaEngine::prompt_logits_with_routes`);
//! the BF16 emulation's set `B` (the CPU reference with
//! `Activations::Bf16`). The near-tie width is
//! `τ = max(0.01, 0.01·|z|, s)`, where `s` ([`gap_spread`]) is the 99th
//! percentile of how far the emulation moves router gaps on this sequence
//! (|gap(B) − gap(O)| where B = O): measured, not assumed. Layer l
//! *explains a flip* at p iff `G ≠ O` (as sets) and `g < τ`. Whether the
//! emulation makes the same change (`B = G`) is reported per flip
//! (`explained_reproduced`) but not required: the emulation has the
//! engine's rounding points, not its accumulation order, and at gaps of
//! 10⁻³–10⁻⁴ a last-bit difference decides the direction (on the H200,
//! 16 of 36 GPU flips on `tiny`'s 4096-token text were at gaps 0.0003–0.005
//! where the emulation kept the f32 experts; results/2026-12-01-check-*).
//!
//! **Classification** of each position over the bound: *explained* (a
//! router near-tie flip) iff some MoE layer explains a flip there and the
//! engine's logits at p are finite; *carried* iff it is not a flip, an
//! earlier position of the sequence is one, and `err(p) ≤ 3·bound`
//! ([`CARRY_MAX_BOUNDS`]; measured: ≤ 2.2 bounds); *unexplained*
//! otherwise (`unexplained_after_flip`: own routes agree but more than 3
//! bounds off; `unexplained_route_change`: the experts differ at a gap that
//! is no near-tie). Every unexplained position's JSON names the nearest
//! earlier flip (`after_flip_at`).
//!
//! **PASS** iff all of:
//! 1. 0 unexplained positions;
//! 2. explained flips ≤ 2% of positions (`100·explained ≤ 2·positions`);
//! 3. argmax agreement ≥ 98% of positions, where a mismatch at a position
//!    within the bound counts as agreement (with every logit within the
//!    bound, the top two were tied within rounding); the witness's own
//!    recorded argmax;
//! 4. the engine gave logits for every position of the oracle.
//!
//! Rules 2 and 3 are rates: for the witness fixtures' short sequences
//! (31–64 positions, where one flip is over 2%) they are judged over the
//! fixture's sequences pooled ([`pooled`]); rules 1 and 4 hold for each.
//!
//! **Two paths of the engine** (chunked vs whole prefill, greedy decode vs
//! prefill; [`Evidence::EnginePaths`]) use the same rule, `s` measured
//! between the two paths' gaps: the emulation follows the prefill path's
//! rounding points, so it cannot say which of two BF16 paths flips. The
//! oracle is one path's run and `g`, `z` come from its own router logits.
//!
//! Without route evidence ([`Evidence::None`], `--no-reference`) nothing
//! over the bound is explained.
//!
//! [`LogitReport`] / [`compare_full`] are the older route-unaware summary
//! (3% bound, [`MAX_FLIP_FRACTION`] of positions over it) that the GPU test
//! binary (`runtime/gpu/tests/gpu_engine.rs`) still asserts on.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// How close the engine's logits must be, and what the comparison found.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct LogitReport {
    pub label: String,
    pub positions: usize,
    /// Positions whose argmax differs from the oracle's.
    pub argmax_mismatches: usize,
    /// Of those, positions where the oracle's top-1/top-2 margin exceeds
    /// twice the stated logit bound (a real disagreement, not a near-tie).
    pub argmax_real_mismatches: usize,
    /// Fraction of the oracle's top-10 ids found in the engine's top-20.
    pub top10_containment: f64,
    /// Largest |engine - oracle| over all compared logits.
    pub max_abs_err: f32,
    /// Positions whose largest error exceeds the bound.
    pub positions_over_bound: usize,
    /// Median over positions of the per-position largest error.
    pub median_position_err: f32,
    /// `max_abs_err / max |oracle logit|`.
    pub max_rel_err: f32,
    /// The bound this comparison is held to (absolute, in logits).
    pub bound: f32,
}

/// Share of positions allowed over the bound (and with a real argmax
/// mismatch). BF16 activations move router scores by ~0.1%, so a token whose
/// k-th and (k+1)-th experts are nearly tied can take the other expert in
/// one engine; its logits then differ by far more than rounding. Such flips
/// are rare and isolated; a kernel or indexing bug breaks most positions.
pub const MAX_FLIP_FRACTION: f64 = 0.02;

impl LogitReport {
    /// Every position within the bound, argmax and top-10 identical.
    pub fn exact(&self) -> bool {
        self.argmax_real_mismatches == 0
            && self.top10_containment >= 1.0
            && self.max_abs_err <= self.bound
            && self.max_abs_err.is_finite()
    }

    /// The typical position within a third of the bound, at most
    /// [`MAX_FLIP_FRACTION`] of positions over it or with a real argmax
    /// mismatch, top-10 containment >= 99%, and nothing NaN.
    pub fn passed(&self) -> bool {
        let allowed = (MAX_FLIP_FRACTION * self.positions as f64).floor() as usize;
        self.max_abs_err.is_finite()
            && self.median_position_err <= self.bound / 3.0
            && self.positions_over_bound <= allowed
            && self.argmax_real_mismatches <= allowed
            && self.top10_containment >= 0.99
    }

    pub fn line(&self) -> String {
        format!(
            "{}: {} positions, argmax mismatches {} (real {}), top-10 containment {:.2}%, max |dlogit| {:.4e} (rel {:.3e}, bound {:.3e}), median {:.3e}, {} positions over bound -> {}",
            self.label,
            self.positions,
            self.argmax_mismatches,
            self.argmax_real_mismatches,
            100.0 * self.top10_containment,
            self.max_abs_err,
            self.max_rel_err,
            self.bound,
            self.median_position_err,
            self.positions_over_bound,
            if self.exact() {
                "PASS (exact)"
            } else if self.passed() {
                "PASS (isolated routing flips)"
            } else {
                "FAIL"
            }
        )
    }
}

/// Ids of the `k` largest values, largest first (ties: lower id first).
pub fn top_ids(v: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..v.len() as u32).collect();
    let k = k.min(v.len());
    idx.select_nth_unstable_by(k.saturating_sub(1), |&a, &b| {
        v[b as usize].total_cmp(&v[a as usize]).then(a.cmp(&b))
    });
    idx.truncate(k);
    idx.sort_by(|&a, &b| v[b as usize].total_cmp(&v[a as usize]).then(a.cmp(&b)));
    idx
}

/// Accumulates per-position comparisons into a [`LogitReport`].
#[derive(Debug)]
pub struct Comparator {
    r: LogitReport,
    contained: usize,
    wanted: usize,
    max_oracle: f32,
    per_position: Vec<f32>,
}

impl Comparator {
    pub fn new(label: impl Into<String>, bound: f32) -> Self {
        Comparator {
            r: LogitReport {
                label: label.into(),
                bound,
                ..LogitReport::default()
            },
            contained: 0,
            wanted: 0,
            max_oracle: 0.0,
            per_position: Vec::new(),
        }
    }

    /// One position: the engine's full logits against the oracle's top ids
    /// and values (`oracle_top` sorted descending, at least 2 long) and, when
    /// known, the oracle's full logits.
    pub fn position(
        &mut self,
        engine: &[f32],
        oracle_top: &[(u32, f32)],
        oracle_full: Option<&[f32]>,
    ) {
        self.r.positions += 1;
        let mine = top_ids(engine, 20);
        let oracle_argmax = oracle_top[0].0;
        if mine.first() != Some(&oracle_argmax) {
            self.r.argmax_mismatches += 1;
            let margin = oracle_top[0].1 - oracle_top.get(1).map_or(f32::NEG_INFINITY, |t| t.1);
            if margin > 2.0 * self.r.bound {
                self.r.argmax_real_mismatches += 1;
            }
        }
        for (id, _) in oracle_top.iter().take(10) {
            self.wanted += 1;
            if mine.contains(id) {
                self.contained += 1;
            }
        }
        let mut pos_err = 0f32;
        let mut err = |a: f32, b: f32| {
            let d = (a - b).abs();
            // NaN never passes: make it the error.
            let d = if d.is_nan() { f32::INFINITY } else { d };
            pos_err = pos_err.max(d);
            self.max_oracle = self.max_oracle.max(b.abs());
        };
        match oracle_full {
            Some(full) => {
                for (a, b) in engine.iter().zip(full) {
                    err(*a, *b);
                }
            }
            None => {
                for (id, val) in oracle_top {
                    err(engine.get(*id as usize).copied().unwrap_or(f32::NAN), *val);
                }
            }
        }
        self.r.max_abs_err = self.r.max_abs_err.max(pos_err);
        if pos_err > self.r.bound {
            self.r.positions_over_bound += 1;
        }
        self.per_position.push(pos_err);
    }

    pub fn finish(mut self) -> LogitReport {
        self.r.top10_containment = if self.wanted == 0 {
            1.0
        } else {
            self.contained as f64 / self.wanted as f64
        };
        self.r.max_rel_err = self.r.max_abs_err / self.max_oracle.max(1e-30);
        self.per_position.sort_by(|a, b| a.total_cmp(b));
        self.r.median_position_err = self
            .per_position
            .get(self.per_position.len() / 2)
            .copied()
            .unwrap_or(0.0);
        self.r
    }
}

/// Compares engine logits with oracle logits at every position.
pub fn compare_full(
    label: &str,
    engine: &[Vec<f32>],
    oracle: &[Vec<f32>],
    bound: f32,
) -> LogitReport {
    let mut c = Comparator::new(label, bound);
    for (e, o) in engine.iter().zip(oracle) {
        let ids = top_ids(o, 20);
        let top: Vec<(u32, f32)> = ids.iter().map(|&i| (i, o[i as usize])).collect();
        c.position(e, &top, Some(o));
    }
    let mut r = c.finish();
    if engine.len() != oracle.len() {
        r.argmax_real_mismatches += engine.len().abs_diff(oracle.len());
    }
    r
}

/// `case.json` of a witness fixture.
#[derive(Debug, Clone, Deserialize)]
pub struct WitnessCase {
    pub synth: WitnessSynth,
    pub sequences: Vec<Vec<u32>>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct WitnessSynth {
    pub preset: String,
    pub seed: u64,
    pub dtype: String,
    #[serde(default)]
    pub overrides: serde_json::Value,
}

/// `seqN.json`: per position argmax, top ids and values.
#[derive(Debug, Clone, Deserialize)]
pub struct WitnessSeq {
    pub argmax: Vec<u32>,
    pub top_ids: Vec<Vec<u32>>,
    pub top_vals: Vec<Vec<f32>>,
}

/// One loaded fixture sequence.
#[derive(Debug, Clone)]
pub struct WitnessSequence {
    pub tokens: Vec<u32>,
    pub seq: WitnessSeq,
    /// Full logits of the last position.
    pub last: Vec<f32>,
}

#[derive(Debug, thiserror::Error)]
#[error("witness fixture {path}: {reason}")]
pub struct WitnessError {
    pub path: PathBuf,
    pub reason: String,
}

pub fn load_witness(dir: &Path) -> Result<(WitnessCase, Vec<WitnessSequence>), WitnessError> {
    let fail = |path: &Path, reason: String| WitnessError {
        path: path.to_path_buf(),
        reason,
    };
    let case_path = dir.join("case.json");
    let text = std::fs::read_to_string(&case_path).map_err(|e| fail(&case_path, e.to_string()))?;
    let case: WitnessCase = serde_json::from_str(&text)
        .map_err(|e| fail(&case_path, format!("not a witness case: {e}")))?;
    let mut seqs = Vec::new();
    for (i, tokens) in case.sequences.iter().enumerate() {
        let p = dir.join(format!("seq{i}.json"));
        let text = std::fs::read_to_string(&p).map_err(|e| fail(&p, e.to_string()))?;
        let seq: WitnessSeq = serde_json::from_str(&text)
            .map_err(|e| fail(&p, format!("not a witness sequence: {e}")))?;
        if seq.argmax.len() != tokens.len() || seq.top_ids.len() != tokens.len() {
            return Err(fail(
                &p,
                format!(
                    "{} positions recorded for a {}-token sequence",
                    seq.argmax.len(),
                    tokens.len()
                ),
            ));
        }
        let lp = dir.join(format!("seq{i}.last.f32"));
        let bytes = std::fs::read(&lp).map_err(|e| fail(&lp, e.to_string()))?;
        if bytes.len() % 4 != 0 {
            return Err(fail(
                &lp,
                format!("{} bytes is not a whole number of f32", bytes.len()),
            ));
        }
        let last = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        seqs.push(WitnessSequence {
            tokens: tokens.clone(),
            seq,
            last,
        });
    }
    Ok((case, seqs))
}

/// Compares engine logits of one witness sequence (every position).
pub fn compare_witness(c: &mut Comparator, engine: &[Vec<f32>], w: &WitnessSequence) {
    let n = engine.len();
    for (p, e) in engine.iter().enumerate() {
        let top: Vec<(u32, f32)> = w.seq.top_ids[p]
            .iter()
            .zip(&w.seq.top_vals[p])
            .map(|(&i, &v)| (i, v))
            .collect();
        let full = (p + 1 == n).then_some(w.last.as_slice());
        c.position(e, &top, full);
    }
}

// ---------------------------------------------------------------------------
// The fidelity criterion of `bench --check` (module docs).

/// The bound: this fraction of the sequence's largest |oracle logit|.
pub const BOUND_FRACTION: f32 = 0.01;
/// A router gap below `max(NEAR_TIE_ABS, NEAR_TIE_REL · |k-th logit|)` is a
/// near-tie.
pub const NEAR_TIE_ABS: f32 = 0.01;
pub const NEAR_TIE_REL: f32 = 0.01;
/// Explained flips allowed, in percent of the positions.
pub const MAX_FLIP_PERCENT: usize = 2;
/// Argmax agreement required, in percent of the positions.
pub const MIN_ARGMAX_PERCENT: usize = 98;
/// A position after a near-tie flip, whose own routes did not flip, may be
/// off by at most this many bounds: the flipped expert's output reached it
/// through attention (measured on the H200: at most 2.2 bounds).
pub const CARRY_MAX_BOUNDS: f32 = 3.0;
/// Percentile of the BF16 emulation's movement of the router gaps (where it
/// keeps the f32 experts) that widens the near-tie threshold.
pub const GAP_SPREAD_PERCENTILE: f64 = 0.99;

/// How far the BF16 emulation moves router gaps on this sequence: the
/// [`GAP_SPREAD_PERCENTILE`] of |gap(emulation) − gap(f32)| over every
/// (MoE layer, position) where both select the same experts. A measured
/// near-tie width, so the threshold is not an assumption.
pub fn gap_spread(oracle: &Routes, emulation: &Routes) -> f32 {
    let mut d: Vec<f32> = oracle
        .iter()
        .zip(emulation)
        .flat_map(|(o, e)| o.iter().zip(e))
        .filter(|(o, e)| o.same_set(e) && o.gap.is_finite() && e.gap.is_finite())
        .map(|(o, e)| (o.gap - e.gap).abs())
        .collect();
    if d.is_empty() {
        return 0.0;
    }
    d.sort_by(|a, b| a.total_cmp(b));
    let i = ((d.len() - 1) as f64 * GAP_SPREAD_PERCENTILE).round() as usize;
    d[i]
}

/// The router gap below which a token's k-th and (k+1)-th experts count as
/// tied, for a k-th router logit of `kth`.
pub fn near_tie_threshold(kth: f32) -> f32 {
    NEAR_TIE_ABS.max(NEAR_TIE_REL * kth.abs())
}

/// One token's routing at one MoE layer, as one engine computed it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Route {
    /// Selected experts, best first (empty: not recorded).
    pub experts: Vec<u32>,
    /// k-th best router logit minus the (k+1)-th (∞, `null` in JSON, when
    /// every expert is selected).
    pub gap: f32,
    /// The k-th best router logit.
    pub kth: f32,
}

/// `[moe layer][position]`.
pub type Routes = Vec<Vec<Route>>;

impl Route {
    /// The route of `experts` (top-k, k = its length) chosen from the
    /// router `logits` of one token.
    pub fn from_logits(logits: &[f32], experts: Vec<u32>) -> Route {
        let k = experts.len();
        let mut sorted = logits.to_vec();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let kth = match k {
            0 => f32::NAN,
            _ => sorted.get(k - 1).copied().unwrap_or(f32::NAN),
        };
        let gap = match sorted.get(k) {
            Some(next) if k > 0 => kth - next,
            _ => f32::INFINITY,
        };
        Route { experts, gap, kth }
    }

    /// Same experts, in any order.
    pub fn same_set(&self, other: &Route) -> bool {
        same_experts(&self.experts, &other.experts)
    }

    pub fn threshold(&self) -> f32 {
        near_tie_threshold(self.kth)
    }

    /// The gap is below [`near_tie_threshold`] (false for NaN).
    pub fn near_tie(&self) -> bool {
        self.gap < self.threshold()
    }
}

/// `a` and `b` hold the same experts, in any order.
pub fn same_experts(a: &[u32], b: &[u32]) -> bool {
    let (mut a, mut b) = (a.to_vec(), b.to_vec());
    a.sort_unstable();
    b.sort_unstable();
    a == b
}

/// Routes of the MoE layers `moe_layers` (decoder layer indices) recorded
/// in a reference [`Trace`](krasis_model::reference::Trace).
pub fn routes_from_trace(t: &krasis_model::reference::Trace, moe_layers: &[usize]) -> Routes {
    moe_layers
        .iter()
        .map(|&l| {
            t.experts[l]
                .iter()
                .zip(&t.router_margin[l])
                .zip(&t.router_kth[l])
                .map(|((e, &gap), &kth)| Route {
                    experts: e.iter().map(|&x| x as u32).collect(),
                    gap,
                    kth,
                })
                .collect()
        })
        .collect()
}

/// Positions `range` of every layer of `routes`.
pub fn routes_window(routes: &Routes, range: std::ops::Range<usize>) -> Routes {
    routes
        .iter()
        .map(|rows| rows.get(range.clone()).unwrap_or_default().to_vec())
        .collect()
}

/// What one position's comparison found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PositionErr {
    /// Max |engine − oracle| over the compared logits (NaN → ∞).
    pub err: f32,
    /// Every engine logit of the position is finite.
    pub finite: bool,
    pub engine_argmax: u32,
    pub oracle_argmax: u32,
}

/// Id of the largest value, the lowest id among equals.
pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if x.total_cmp(&v[best]).is_gt() {
            best = i;
        }
    }
    best as u32
}

/// Largest |v|, NaN ignored.
pub fn max_abs<'a>(values: impl IntoIterator<Item = &'a f32>) -> f32 {
    values.into_iter().fold(0f32, |m, v| m.max(v.abs()))
}

fn abs_err(a: f32, b: f32) -> f32 {
    let d = (a - b).abs();
    if d.is_nan() { f32::INFINITY } else { d }
}

/// A position with full oracle logits.
pub fn position_full(engine: &[f32], oracle: &[f32]) -> PositionErr {
    let mut err = engine
        .iter()
        .zip(oracle)
        .fold(0f32, |m, (&a, &b)| m.max(abs_err(a, b)));
    if engine.len() != oracle.len() {
        err = f32::INFINITY;
    }
    PositionErr {
        err,
        finite: engine.iter().all(|v| v.is_finite()),
        engine_argmax: argmax(engine),
        oracle_argmax: argmax(oracle),
    }
}

/// A witness position: the oracle's `ids`/`vals` (its top ids), its
/// recorded argmax, and its full logits where the fixture has them.
pub fn position_top(
    engine: &[f32],
    ids: &[u32],
    vals: &[f32],
    oracle_argmax: u32,
    full: Option<&[f32]>,
) -> PositionErr {
    let mut p = match full {
        Some(f) => position_full(engine, f),
        None => PositionErr {
            err: 0.0,
            finite: engine.iter().all(|v| v.is_finite()),
            engine_argmax: argmax(engine),
            oracle_argmax,
        },
    };
    p.oracle_argmax = oracle_argmax;
    for (&id, &v) in ids.iter().zip(vals) {
        let e = engine.get(id as usize).copied().unwrap_or(f32::NAN);
        p.err = p.err.max(abs_err(e, v));
    }
    p
}

/// The routes behind a comparison, `[moe layer][position]` over the same
/// positions as the logits.
#[derive(Debug, Clone, Copy)]
pub enum Evidence<'a> {
    /// No routes known (no reference run): nothing over the bound is
    /// explained.
    None,
    /// Engine vs an f32 oracle: the f32 reference's routes and gaps
    /// (`oracle`), the BF16 emulation's routes, the engine's, and per
    /// position the emulation's own largest logit difference from the f32
    /// reference (diagnostic only).
    F32 {
        oracle: &'a Routes,
        emulation: &'a Routes,
        engine: &'a Routes,
        emulation_err: Option<&'a [f32]>,
    },
    /// Two BF16 paths of the engine: the oracle path's routes and gaps and
    /// the other path's routes; the emulation is not asked.
    EnginePaths {
        oracle: &'a Routes,
        engine: &'a Routes,
    },
}

impl Evidence<'_> {
    fn describe(&self) -> &'static str {
        match self {
            Evidence::None => "no route evidence",
            Evidence::F32 { .. } => "f32 reference routes + BF16 emulation",
            Evidence::EnginePaths { .. } => "engine paths' routes",
        }
    }

    /// Why the routes cannot be used for `layers` MoE layers and
    /// `positions` positions, if they cannot.
    fn shape_error(&self, layers: usize, positions: usize) -> Option<String> {
        let sets: Vec<(&str, &Routes)> = match self {
            Evidence::None => return None,
            Evidence::F32 {
                oracle,
                emulation,
                engine,
                emulation_err,
            } => {
                if emulation_err.is_some_and(|e| e.len() != positions) {
                    return Some("emulation errors do not cover the positions".into());
                }
                vec![
                    ("oracle", *oracle),
                    ("emulation", *emulation),
                    ("engine", *engine),
                ]
            }
            Evidence::EnginePaths { oracle, engine } => {
                vec![("oracle", *oracle), ("engine", *engine)]
            }
        };
        for (what, r) in sets {
            if r.len() != layers {
                return Some(format!(
                    "{what} routes have {} MoE layers, not {layers}",
                    r.len()
                ));
            }
            if let Some((m, rows)) = r.iter().enumerate().find(|(_, rows)| {
                rows.len() != positions || rows.iter().any(|x| x.experts.is_empty())
            }) {
                return Some(format!(
                    "{what} routes of MoE layer {m} cover {} of {positions} positions",
                    rows.len()
                ));
            }
        }
        None
    }
}

/// The routes at one MoE layer of one position, for the JSON.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayerRoutes {
    /// Decoder layer index.
    pub layer: usize,
    /// The oracle's experts (f32 reference, or the oracle path's).
    pub oracle_experts: Vec<u32>,
    /// The BF16 emulation's experts (f32 oracles only).
    pub emulation_experts: Option<Vec<u32>>,
    pub engine_experts: Vec<u32>,
    /// The oracle's router gap and k-th logit, and the near-tie threshold.
    pub gap: f32,
    pub kth: f32,
    pub threshold: f32,
    /// This layer explains a flip at the position.
    pub explains: bool,
    /// The BF16 emulation makes the same change (f32 oracles only).
    pub reproduced: Option<bool>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Class {
    /// A router near-tie flip at the position itself.
    Explained,
    /// Within [`CARRY_MAX_BOUNDS`] after an earlier near-tie flip.
    Carried,
    Unexplained,
}

/// A position over the bound and how it was classified.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OverBound {
    pub position: usize,
    pub err: f32,
    /// The BF16 emulation's own max |logit − f32 logit| there, if known.
    pub emulation_err: Option<f32>,
    pub oracle_argmax: u32,
    pub engine_argmax: u32,
    pub class: Class,
    pub reason: String,
    /// Nearest earlier position with a layer that explains a flip
    /// (unexplained positions only; how far the error may have travelled).
    pub after_flip_at: Option<usize>,
    /// Every MoE layer where the engine's or the emulation's experts
    /// differ from the oracle's; when none does, the layer with the
    /// smallest gap relative to its threshold.
    pub layers: Vec<LayerRoutes>,
}

/// The CPU reference's evidence for one sequence: its f32 logits, the
/// routes of the f32 pass and of the BF16 emulation, and per position the
/// emulation's largest logit difference from f32. `bench --check` and the
/// GPU fault-injection test build it the same way.
pub struct Traced {
    pub logits: Vec<Vec<f32>>,
    pub f32_routes: Routes,
    pub bf16_routes: Routes,
    pub emulation_err: Vec<f32>,
}

impl Traced {
    /// Runs `r` over `tokens` in f32 and in its BF16 emulation, traced, and
    /// leaves it in f32.
    pub fn new(
        r: &mut krasis_model::reference::ReferenceEngine,
        tokens: &[u32],
        moe_layers: &[usize],
    ) -> Result<Self, krasis_model::EngineError> {
        use krasis_model::reference::Activations;
        r.set_activations(Activations::F32);
        let (logits, tf) = r.prompt_logits_traced(tokens)?;
        r.set_activations(Activations::Bf16);
        let emulated = r.prompt_logits_traced(tokens);
        r.set_activations(Activations::F32);
        let (bf16, tb) = emulated?;
        let emulation_err = bf16
            .iter()
            .zip(&logits)
            .map(|(b, f)| position_full(b, f).err)
            .collect();
        Ok(Traced {
            f32_routes: routes_from_trace(&tf, moe_layers),
            bf16_routes: routes_from_trace(&tb, moe_layers),
            logits,
            emulation_err,
        })
    }

    /// The evidence for comparing an engine whose routes are `engine`.
    pub fn evidence<'a>(&'a self, engine: &'a Routes) -> Evidence<'a> {
        Evidence::F32 {
            oracle: &self.f32_routes,
            emulation: &self.bf16_routes,
            engine,
            emulation_err: Some(&self.emulation_err),
        }
    }
}

/// One classified comparison (module docs).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FidelityReport {
    pub label: String,
    /// Which routes explained flips ([`Evidence`]).
    pub evidence: String,
    pub positions: usize,
    /// Positions one side has and the other lacks (must be 0).
    pub missing_positions: usize,
    pub max_oracle_logit: f32,
    /// `BOUND_FRACTION · max_oracle_logit`.
    pub bound: f32,
    pub over_bound: usize,
    pub explained: usize,
    /// Of the explained flips, those the BF16 emulation makes too.
    pub explained_reproduced: usize,
    /// Positions over the bound carried from an earlier flip (≤ [`CARRY_MAX_BOUNDS`]).
    pub carried: usize,
    pub unexplained: usize,
    /// Of the unexplained: own routes agree, an earlier position flipped.
    pub unexplained_after_flip: usize,
    /// Of the unexplained: the engine's experts differ from the oracle's at
    /// some layer, but no layer explains a flip.
    pub unexplained_route_change: usize,
    /// Positions with a layer that explains a flip, over the bound or not.
    pub flip_positions: usize,
    /// Positions where the engine's experts differ from the oracle's at
    /// some MoE layer.
    pub route_change_positions: usize,
    pub argmax_agree: usize,
    /// Argmax mismatches at positions within the bound (ties of the final
    /// logits within rounding).
    pub argmax_mismatch_within_bound: usize,
    pub max_err: f32,
    /// Max error over positions that are not explained flips (must be ≤ bound).
    pub max_err_non_flip: f32,
    pub median_err: f32,
    /// The near-tie threshold's measured part ([`gap_spread`] of the
    /// emulation, or of the two engine paths; 0 without routes).
    pub gap_spread: f32,
    /// The rate rules (flips ≤ 2%, argmax ≥ 98%) apply to this report; off
    /// for a sequence judged within its pooled group ([`pooled`]).
    pub rates_judged: bool,
    /// Why the route evidence could not be used, if so.
    pub evidence_error: Option<String>,
    /// Every PASS condition that does not hold (empty: PASS).
    pub failures: Vec<String>,
    pub passed: bool,
    pub over_bound_positions: Vec<OverBound>,
}

impl FidelityReport {
    pub fn passed(&self) -> bool {
        self.passed
    }

    /// Fills `failures` and `passed`: no unexplained position, nothing
    /// missing, and, when `rates` (a whole sequence, or a pooled group of
    /// short ones), flips ≤ 2% and argmax agreement ≥ 98% of positions. An
    /// argmax mismatch at a position within the bound is a tie of the
    /// final logits within rounding, and counts as agreement.
    pub fn judge(&mut self, rates: bool) {
        let n = self.positions;
        let mut f = Vec::new();
        if let Some(e) = &self.evidence_error {
            f.push(format!("route evidence unusable: {e}"));
        }
        if n == 0 {
            f.push("no positions compared".into());
        }
        if self.missing_positions > 0 {
            f.push(format!(
                "{} positions missing on one side",
                self.missing_positions
            ));
        }
        if self.unexplained > 0 {
            f.push(format!(
                "{} unexplained positions over the bound (max |dlogit| at non-flip positions {:.4e}; bound {:.3e}, carried errors up to {CARRY_MAX_BOUNDS} bounds)",
                self.unexplained, self.max_err_non_flip, self.bound
            ));
        }
        if rates && 100 * self.explained > MAX_FLIP_PERCENT * n {
            f.push(format!(
                "{} explained flips are over {MAX_FLIP_PERCENT}% of {n} positions",
                self.explained
            ));
        }
        let agree = self.argmax_agree + self.argmax_mismatch_within_bound;
        if rates && 100 * agree < MIN_ARGMAX_PERCENT * n {
            f.push(format!(
                "argmax agreement {agree}/{n} (ties within the bound included) is under {MIN_ARGMAX_PERCENT}%"
            ));
        }
        self.rates_judged = rates;
        self.passed = f.is_empty();
        self.failures = f;
    }

    pub fn line(&self) -> String {
        let n = self.positions.max(1) as f64;
        let verdict = if self.passed {
            "PASS".to_string()
        } else {
            format!("FAIL ({})", self.failures.join("; "))
        };
        let rates = if self.rates_judged {
            ""
        } else {
            " [rates judged over the pooled group]"
        };
        format!(
            "{}: {} positions, {} over the bound {:.3e} (1% of max |logit| {:.3e}): {} router near-tie flips ({:.2}%, limit {}%; the BF16 emulation makes {} of them too), {} carried from an earlier flip (<= {} bounds), {} unexplained; argmax agreement {}/{} + {} ties within the bound = {:.2}% (limit {}%); max |dlogit| {:.4e}, at non-flip positions {:.4e}; median {:.3e}; near-tie gap threshold max(0.01, 1% of the k-th logit, measured {:.3e}); route changes at {} positions [{}]{} -> {}",
            self.label,
            self.positions,
            self.over_bound,
            self.bound,
            self.max_oracle_logit,
            self.explained,
            100.0 * self.explained as f64 / n,
            MAX_FLIP_PERCENT,
            self.explained_reproduced,
            self.carried,
            CARRY_MAX_BOUNDS,
            self.unexplained,
            self.argmax_agree,
            self.positions,
            self.argmax_mismatch_within_bound,
            100.0 * (self.argmax_agree + self.argmax_mismatch_within_bound) as f64 / n,
            MIN_ARGMAX_PERCENT,
            self.max_err,
            self.max_err_non_flip,
            self.median_err,
            self.gap_spread,
            self.route_change_positions,
            self.evidence,
            rates,
            verdict
        )
    }
}

/// Short sequences (the witness fixtures' 31–64 positions) cannot carry a
/// 2% rate: one flip is 3%. Their members are judged without the rate
/// rules and the group with them, over the sum of their positions.
pub fn pooled(label: &str, members: &mut [FidelityReport]) -> FidelityReport {
    for m in members.iter_mut() {
        m.judge(false);
    }
    let sum = |f: fn(&FidelityReport) -> usize| members.iter().map(f).sum::<usize>();
    let maxf = |f: fn(&FidelityReport) -> f32| members.iter().map(f).fold(0f32, f32::max);
    let mut r = FidelityReport {
        label: label.to_string(),
        evidence: members
            .first()
            .map_or_else(String::new, |m| m.evidence.clone()),
        positions: sum(|m| m.positions),
        missing_positions: sum(|m| m.missing_positions),
        max_oracle_logit: maxf(|m| m.max_oracle_logit),
        bound: maxf(|m| m.bound),
        over_bound: sum(|m| m.over_bound),
        explained: sum(|m| m.explained),
        explained_reproduced: sum(|m| m.explained_reproduced),
        carried: sum(|m| m.carried),
        unexplained: sum(|m| m.unexplained),
        unexplained_after_flip: sum(|m| m.unexplained_after_flip),
        unexplained_route_change: sum(|m| m.unexplained_route_change),
        flip_positions: sum(|m| m.flip_positions),
        route_change_positions: sum(|m| m.route_change_positions),
        argmax_agree: sum(|m| m.argmax_agree),
        argmax_mismatch_within_bound: sum(|m| m.argmax_mismatch_within_bound),
        max_err: maxf(|m| m.max_err),
        max_err_non_flip: maxf(|m| m.max_err_non_flip),
        median_err: maxf(|m| m.median_err),
        gap_spread: maxf(|m| m.gap_spread),
        rates_judged: true,
        evidence_error: members.iter().find_map(|m| m.evidence_error.clone()),
        failures: Vec::new(),
        passed: false,
        over_bound_positions: Vec::new(),
    };
    r.judge(true);
    r
}

/// Classifies a comparison (module docs). `positions[p]` is position p's
/// comparison, `missing` how many positions one side lacks,
/// `max_oracle_logit` the sequence's largest |oracle logit|, `moe_layers`
/// the decoder index of each MoE layer of the routes in `evidence`.
pub fn classify(
    label: &str,
    positions: &[PositionErr],
    missing: usize,
    max_oracle_logit: f32,
    moe_layers: &[usize],
    evidence: Evidence<'_>,
) -> FidelityReport {
    let n = positions.len();
    let bound = BOUND_FRACTION * max_oracle_logit;
    let evidence_error = evidence.shape_error(moe_layers.len(), n);
    let evidence = if evidence_error.is_some() {
        Evidence::None
    } else {
        evidence
    };
    let (oracle, emulation, engine, emulation_err) = match evidence {
        Evidence::None => (None, None, None, None),
        Evidence::F32 {
            oracle,
            emulation,
            engine,
            emulation_err,
        } => (Some(oracle), Some(emulation), Some(engine), emulation_err),
        Evidence::EnginePaths { oracle, engine } => (Some(oracle), None, Some(engine), None),
    };
    // How far rounding moves router gaps on this sequence: the BF16
    // emulation against f32, or the two engine paths against each other.
    let spread = match (oracle, emulation, engine) {
        (Some(o), Some(b), _) => gap_spread(o, b),
        (Some(o), None, Some(g)) => gap_spread(o, g),
        _ => 0.0,
    };
    let layer_routes = |p: usize, m: usize| -> Option<LayerRoutes> {
        let (o, g) = (&oracle?[m][p], &engine?[m][p]);
        let b = emulation.map(|e| &e[m][p]);
        let threshold = o.threshold().max(spread);
        let explains = !g.same_set(o) && o.gap < threshold;
        Some(LayerRoutes {
            layer: moe_layers[m],
            oracle_experts: o.experts.clone(),
            emulation_experts: b.map(|b| b.experts.clone()),
            engine_experts: g.experts.clone(),
            gap: o.gap,
            kth: o.kth,
            threshold,
            explains,
            reproduced: b.map(|b| b.same_set(g)),
        })
    };
    let per_pos: Vec<Vec<LayerRoutes>> = (0..n)
        .map(|p| {
            (0..moe_layers.len())
                .filter_map(|m| layer_routes(p, m))
                .collect()
        })
        .collect();
    let flip: Vec<bool> = per_pos
        .iter()
        .map(|ls| ls.iter().any(|l| l.explains))
        .collect();
    let changed = |l: &LayerRoutes| !same_experts(&l.engine_experts, &l.oracle_experts);
    let emu_changed = |l: &LayerRoutes| {
        l.emulation_experts
            .as_ref()
            .is_some_and(|e| !same_experts(e, &l.oracle_experts))
    };
    let mut r = FidelityReport {
        label: label.to_string(),
        evidence: evidence.describe().to_string(),
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
        flip_positions: flip.iter().filter(|&&f| f).count(),
        route_change_positions: per_pos.iter().filter(|ls| ls.iter().any(changed)).count(),
        argmax_agree: 0,
        argmax_mismatch_within_bound: 0,
        max_err: 0.0,
        max_err_non_flip: 0.0,
        median_err: 0.0,
        gap_spread: spread,
        rates_judged: true,
        evidence_error,
        failures: Vec::new(),
        passed: false,
        over_bound_positions: Vec::new(),
    };
    let mut last_flip: Option<usize> = None;
    for (p, pe) in positions.iter().enumerate() {
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
        let explained = over && pe.finite && flip[p];
        let carried = over
            && !explained
            && pe.finite
            && last_flip.is_some()
            && err <= CARRY_MAX_BOUNDS * bound;
        if !explained {
            r.max_err_non_flip = r.max_err_non_flip.max(err);
        }
        if over {
            r.over_bound += 1;
            let ls = &per_pos[p];
            let mut shown: Vec<LayerRoutes> = ls
                .iter()
                .filter(|l| changed(l) || emu_changed(l))
                .cloned()
                .collect();
            if shown.is_empty()
                && let Some(l) = ls
                    .iter()
                    .min_by(|a, b| (a.gap / a.threshold).total_cmp(&(b.gap / b.threshold)))
            {
                shown.push(l.clone());
            }
            let (class, reason) = if explained {
                let l = ls.iter().find(|l| l.explains);
                let reproduced = l.and_then(|l| l.reproduced);
                if reproduced == Some(true) {
                    r.explained_reproduced += 1;
                }
                (
                    Class::Explained,
                    format!(
                        "router near-tie flip at layer {}{}",
                        l.map_or(0, |l| l.layer),
                        match reproduced {
                            Some(true) => " (the BF16 emulation makes it too)",
                            Some(false) => " (the BF16 emulation keeps the f32 experts)",
                            None => "",
                        }
                    ),
                )
            } else if carried {
                let q = last_flip.unwrap_or_default();
                (
                    Class::Carried,
                    format!(
                        "follows the near-tie flip at position {q} (through attention), {:.2} bounds",
                        err / bound
                    ),
                )
            } else if !pe.finite {
                (Class::Unexplained, "non-finite engine logits".into())
            } else if oracle.is_none() {
                (Class::Unexplained, "no route evidence".into())
            } else if ls.iter().any(changed) {
                r.unexplained_route_change += 1;
                let why: Vec<String> = ls
                    .iter()
                    .filter(|l| changed(l))
                    .map(|l| {
                        if l.emulation_experts
                            .as_ref()
                            .is_some_and(|e| !same_experts(e, &l.engine_experts))
                        {
                            format!(
                                "layer {}: the BF16 emulation does not make this change",
                                l.layer
                            )
                        } else {
                            format!(
                                "layer {}: gap {:.3e} is not below {:.3e}",
                                l.layer, l.gap, l.threshold
                            )
                        }
                    })
                    .collect();
                (
                    Class::Unexplained,
                    format!(
                        "routes differ but not as an explained flip ({})",
                        why.join("; ")
                    ),
                )
            } else if let Some(q) = last_flip {
                r.unexplained_after_flip += 1;
                (
                    Class::Unexplained,
                    format!(
                        "routes agree at every MoE layer; follows the flip at position {q} but is {:.2} bounds off (more than {CARRY_MAX_BOUNDS})",
                        err / bound
                    ),
                )
            } else {
                (Class::Unexplained, "routes agree at every MoE layer".into())
            };
            match class {
                Class::Explained => r.explained += 1,
                Class::Carried => r.carried += 1,
                Class::Unexplained => r.unexplained += 1,
            }
            r.over_bound_positions.push(OverBound {
                position: p,
                err,
                emulation_err: emulation_err.and_then(|e| e.get(p).copied()),
                oracle_argmax: pe.oracle_argmax,
                engine_argmax: pe.engine_argmax,
                class,
                reason,
                after_flip_at: match class {
                    Class::Explained => None,
                    Class::Carried | Class::Unexplained => last_flip,
                },
                layers: shown,
            });
        }
        if flip[p] {
            last_flip = Some(p);
        }
    }
    let mut errs: Vec<f32> = positions.iter().map(|p| p.err).collect();
    errs.sort_by(|a, b| a.total_cmp(b));
    r.median_err = errs.get(n / 2).copied().unwrap_or(0.0);
    r.judge(true);
    r
}

/// [`classify`] over full logits on both sides (rows paired by position).
pub fn classify_full(
    label: &str,
    engine: &[Vec<f32>],
    oracle: &[Vec<f32>],
    moe_layers: &[usize],
    evidence: Evidence<'_>,
) -> FidelityReport {
    let positions: Vec<PositionErr> = engine
        .iter()
        .zip(oracle)
        .map(|(e, o)| position_full(e, o))
        .collect();
    classify(
        label,
        &positions,
        engine.len().abs_diff(oracle.len()),
        max_abs(oracle.iter().flatten()),
        moe_layers,
        evidence,
    )
}

/// [`classify`] of engine logits against one witness sequence; the scale is
/// the largest |value| the fixture holds (top values and the last row).
pub fn classify_witness(
    label: &str,
    engine: &[Vec<f32>],
    w: &WitnessSequence,
    moe_layers: &[usize],
    evidence: Evidence<'_>,
) -> FidelityReport {
    let n = w.tokens.len();
    let positions: Vec<PositionErr> = engine
        .iter()
        .take(n)
        .enumerate()
        .map(|(p, e)| {
            let full = (p + 1 == n).then_some(w.last.as_slice());
            position_top(
                e,
                &w.seq.top_ids[p],
                &w.seq.top_vals[p],
                w.seq.argmax[p],
                full,
            )
        })
        .collect();
    let scale = max_abs(w.seq.top_vals.iter().flatten()).max(max_abs(&w.last));
    classify(
        label,
        &positions,
        engine.len().abs_diff(n),
        scale,
        moe_layers,
        evidence,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_ids_orders_and_breaks_ties_by_id() {
        let v = [1.0, 3.0, 3.0, -1.0, 2.0];
        assert_eq!(top_ids(&v, 3), vec![1, 2, 4]);
        assert_eq!(top_ids(&v, 10).len(), 5);
    }

    #[test]
    fn identical_logits_pass_and_perturbed_fail() {
        let mut rng_state = 12345u64;
        let mut next = || {
            rng_state = rng_state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((rng_state >> 33) as f32 / (1u64 << 31) as f32) * 8.0 - 4.0
        };
        let oracle: Vec<Vec<f32>> = (0..5).map(|_| (0..300).map(|_| next()).collect()).collect();
        let r = compare_full("same", &oracle, &oracle, 0.01);
        assert!(r.exact() && r.passed(), "{}", r.line());
        assert_eq!(r.max_abs_err, 0.0);
        // Lift the runner-up well above the winner at one position.
        let mut bad = oracle.clone();
        let top = top_ids(&bad[2], 2);
        bad[2][top[1] as usize] = bad[2][top[0] as usize] + 1.0;
        let r = compare_full("bad", &bad, &oracle, 0.01);
        assert!(!r.exact(), "{}", r.line());
        assert_eq!(r.argmax_mismatches, 1);
        assert_eq!(r.positions_over_bound, 1);
        // One isolated position of five is far over the 2% allowance.
        assert!(!r.passed(), "{}", r.line());
        // Every position off by more than the bound fails outright.
        let shifted: Vec<Vec<f32>> = oracle
            .iter()
            .map(|r| r.iter().map(|v| v + 0.05).collect())
            .collect();
        assert!(!compare_full("shift", &shifted, &oracle, 0.01).passed());
        // A NaN never passes.
        let mut nan = oracle.clone();
        nan[0][7] = f32::NAN;
        assert!(!compare_full("nan", &nan, &oracle, 0.01).passed());
    }

    // --- the classifier of `bench --check` (module docs) ---

    fn rt(experts: &[u32], gap: f32, kth: f32) -> Route {
        Route {
            experts: experts.to_vec(),
            gap,
            kth,
        }
    }

    /// `n` positions, one MoE layer (decoder layer 1), max |oracle logit|
    /// 100 (bound 1.0): every position within the bound (err 0.1), argmax
    /// agreeing, every route [0, 1] with a wide gap in all three engines.
    struct Case {
        pos: Vec<PositionErr>,
        oracle: Routes,
        emu: Routes,
        engine: Routes,
    }

    impl Case {
        fn new(n: usize) -> Self {
            let wide = vec![vec![rt(&[0, 1], 1.0, 2.0); n]];
            Case {
                pos: vec![
                    PositionErr {
                        err: 0.1,
                        finite: true,
                        engine_argmax: 7,
                        oracle_argmax: 7,
                    };
                    n
                ],
                oracle: wide.clone(),
                emu: wide.clone(),
                engine: wide,
            }
        }

        /// The engine takes expert 2 instead of 1 at `p`, where the f32
        /// gap is `gap` at k-th logit `kth`; the emulation does the same
        /// when `emulated`. The position's error becomes `err`.
        fn flip(&mut self, p: usize, gap: f32, kth: f32, emulated: bool, err: f32) -> &mut Self {
            self.oracle[0][p] = rt(&[0, 1], gap, kth);
            self.engine[0][p] = rt(&[2, 0], 0.001, kth);
            if emulated {
                self.emu[0][p] = rt(&[0, 2], 0.001, kth);
            }
            self.pos[p].err = err;
            self
        }

        fn run(&self) -> FidelityReport {
            classify(
                "t",
                &self.pos,
                0,
                100.0,
                &[1],
                Evidence::F32 {
                    oracle: &self.oracle,
                    emulation: &self.emu,
                    engine: &self.engine,
                    emulation_err: None,
                },
            )
        }
    }

    #[test]
    fn route_gap_and_kth_from_router_logits() {
        let r = Route::from_logits(&[0.5, 2.0, 1.0, 1.9], vec![1, 3]);
        assert_eq!(r.kth, 1.9);
        assert!((r.gap - 0.9).abs() < 1e-6);
        // Every expert selected: no (k+1)-th, never a near-tie.
        let all = Route::from_logits(&[0.5, 2.0], vec![1, 0]);
        assert_eq!(all.gap, f32::INFINITY);
        assert!(!all.near_tie());
        assert!(r.same_set(&rt(&[3, 1], 0.0, 0.0)));
        assert!(!r.same_set(&rt(&[3, 2], 0.0, 0.0)));
    }

    #[test]
    fn clean_sequence_passes() {
        let r = Case::new(100).run();
        assert!(r.passed(), "{}", r.line());
        assert_eq!((r.over_bound, r.explained, r.unexplained), (0, 0, 0));
        assert_eq!(r.bound, 1.0);
        assert_eq!(r.argmax_agree, 100);
    }

    #[test]
    fn emulated_near_tie_flip_is_explained() {
        let mut c = Case::new(100);
        c.flip(10, 0.005, 0.3, true, 5.0);
        let r = c.run();
        assert!(r.passed(), "{}", r.line());
        assert_eq!((r.over_bound, r.explained, r.unexplained), (1, 1, 0));
        assert_eq!(r.max_err, 5.0);
        assert_eq!(r.max_err_non_flip, 0.1);
        let o = &r.over_bound_positions[0];
        assert_eq!((o.position, o.class), (10, Class::Explained));
        assert_eq!(o.layers.len(), 1);
        let l = &o.layers[0];
        assert_eq!(l.layer, 1);
        assert!(l.explains);
        assert_eq!(l.oracle_experts, vec![0, 1]);
        assert_eq!(l.emulation_experts, Some(vec![0, 2]));
        assert_eq!(l.engine_experts, vec![2, 0]);
        assert_eq!(l.gap, 0.005);
        assert!((l.threshold - 0.01).abs() < 1e-9);
    }

    #[test]
    fn a_near_tie_flip_the_emulation_does_not_make_is_explained_and_marked() {
        // The emulation shares the engine's rounding points but not its
        // accumulation order, so at the smallest gaps it may keep the f32
        // experts where the engine flips (seen on the H200).
        let mut c = Case::new(100);
        c.flip(10, 0.005, 0.3, false, 5.0);
        let r = c.run();
        assert!(r.passed(), "{}", r.line());
        assert_eq!(
            (r.explained, r.explained_reproduced, r.unexplained),
            (1, 0, 0)
        );
        assert!(r.over_bound_positions[0].reason.contains("keeps the f32"));
        c.flip(10, 0.005, 0.3, true, 5.0);
        assert_eq!(c.run().explained_reproduced, 1);
        // Not a near-tie: unexplained whatever the emulation does.
        let mut c = Case::new(100);
        c.flip(10, 0.05, 0.3, false, 5.0);
        let r = c.run();
        assert_eq!((r.explained, r.unexplained), (0, 1), "{}", r.line());
        assert_eq!(r.unexplained_route_change, 1);
    }

    #[test]
    fn large_error_with_agreeing_routes_is_unexplained() {
        let mut c = Case::new(100);
        c.pos[10].err = 5.0;
        let r = c.run();
        assert!(!r.passed(), "{}", r.line());
        assert_eq!((r.over_bound, r.explained, r.unexplained), (1, 0, 1));
        assert_eq!(
            (r.unexplained_after_flip, r.unexplained_route_change),
            (0, 0)
        );
        assert_eq!(r.over_bound_positions[0].class, Class::Unexplained);
        assert_eq!(r.over_bound_positions[0].after_flip_at, None);
        // Just over the bound fails; at it passes.
        c.pos[10].err = 1.01;
        assert!(!c.run().passed());
        c.pos[10].err = 1.0;
        assert!(c.run().passed());
    }

    #[test]
    fn gap_too_large_does_not_explain() {
        // Threshold max(0.01, 1% of 0.3) = 0.01.
        let mut c = Case::new(100);
        c.flip(10, 0.02, 0.3, true, 5.0);
        let r = c.run();
        assert!(!r.passed(), "{}", r.line());
        assert_eq!((r.explained, r.unexplained), (0, 1));
        assert!(r.over_bound_positions[0].reason.contains("gap"));
        // At the threshold is not below it.
        let mut c = Case::new(100);
        c.flip(10, 0.01, 0.3, true, 5.0);
        assert_eq!(c.run().unexplained, 1);
        // The relative part: k-th logit 5 gives a threshold of 0.05.
        let mut c = Case::new(100);
        c.flip(10, 0.02, -5.0, true, 5.0);
        let r = c.run();
        assert!(r.passed(), "{}", r.line());
        assert!((r.over_bound_positions[0].layers[0].threshold - 0.05).abs() < 1e-6);
        c.flip(10, 0.06, -5.0, true, 5.0);
        assert_eq!(c.run().unexplained, 1);
    }

    #[test]
    fn explained_flips_over_two_percent_fail() {
        let mut c = Case::new(100);
        for p in [10, 40, 70] {
            c.flip(p, 0.005, 0.3, true, 5.0);
        }
        let r = c.run();
        assert_eq!((r.explained, r.unexplained), (3, 0));
        assert!(!r.passed(), "{}", r.line());
        assert!(r.failures.iter().any(|f| f.contains("explained flips")));
        // Two of 100 is the limit.
        c.oracle[0][70] = c.engine[0][70].clone();
        c.pos[70].err = 0.1;
        let r = c.run();
        assert_eq!(r.explained, 2);
        assert!(r.passed(), "{}", r.line());
        // One of 50 is 2%, two of 50 are not.
        let mut c = Case::new(50);
        c.flip(10, 0.005, 0.3, true, 5.0);
        assert!(c.run().passed());
        c.flip(30, 0.005, 0.3, true, 5.0);
        assert!(!c.run().passed());
    }

    #[test]
    fn argmax_agreement_under_98_percent_fails() {
        // Mismatches within the bound are ties of the final logits.
        let mut c = Case::new(100);
        for p in [5, 50, 95] {
            c.pos[p].engine_argmax = 8;
        }
        let r = c.run();
        assert_eq!((r.argmax_agree, r.argmax_mismatch_within_bound), (97, 3));
        assert!(r.passed(), "{}", r.line());
        // Mismatches at positions over the bound are real: a flip and two
        // positions carrying it.
        let mut c = Case::new(100);
        c.flip(10, 0.005, 0.3, true, 5.0);
        for p in [10, 11, 12] {
            c.pos[p].engine_argmax = 8;
        }
        c.pos[11].err = 2.0;
        c.pos[12].err = 2.0;
        let r = c.run();
        assert_eq!((r.explained, r.carried, r.unexplained), (1, 2, 0));
        assert!(!r.passed(), "{}", r.line());
        assert_eq!(r.failures.len(), 1, "{:?}", r.failures);
        assert!(r.failures[0].contains("argmax"));
        c.pos[12].engine_argmax = 7;
        assert!(c.run().passed());
    }

    #[test]
    fn error_carried_past_a_flip_is_bounded() {
        let mut c = Case::new(100);
        c.flip(10, 0.005, 0.3, true, 5.0);
        c.pos[11].err = 1.5;
        c.pos[20].err = 3.0;
        let r = c.run();
        assert!(r.passed(), "{}", r.line());
        assert_eq!((r.over_bound, r.explained, r.carried), (3, 1, 2));
        let o = &r.over_bound_positions[1];
        assert_eq!(
            (o.position, o.class, o.after_flip_at),
            (11, Class::Carried, Some(10))
        );
        // More than CARRY_MAX_BOUNDS after the flip is a failure.
        c.pos[20].err = 3.01;
        let r = c.run();
        assert_eq!((r.carried, r.unexplained), (1, 1), "{}", r.line());
        assert_eq!(r.unexplained_after_flip, 1);
        assert!(!r.passed());
        // Before any flip nothing is carried.
        c.pos[20].err = 0.1;
        c.pos[5].err = 1.5;
        let r = c.run();
        assert_eq!(r.unexplained, 1, "{}", r.line());
        assert_eq!(r.over_bound_positions[0].after_flip_at, None);
    }

    #[test]
    fn the_measured_gap_spread_widens_the_near_tie_threshold() {
        // A flip at gap 0.015: not a near-tie by the fixed 0.01 ...
        let mut c = Case::new(100);
        c.flip(10, 0.015, 0.3, false, 5.0);
        assert_eq!(c.run().unexplained, 1);
        // ... but it is where the BF16 emulation moves gaps by 0.02 (p99).
        for p in 0..100 {
            if p != 10 {
                c.emu[0][p].gap = 1.02;
            }
        }
        let r = c.run();
        assert!((r.gap_spread - 0.02).abs() < 1e-6, "{}", r.gap_spread);
        assert!(r.passed(), "{}", r.line());
        assert_eq!(r.explained, 1);
    }

    #[test]
    fn short_sequences_are_judged_as_a_pooled_group() {
        let one = |n: usize| {
            let mut c = Case::new(n);
            c.flip(10, 0.005, 0.3, true, 5.0);
            c.run()
        };
        // One flip in 31 positions is 3.2%: alone it fails.
        assert!(!one(31).passed());
        // Two sequences (2 of 62) fail as a group, each passes alone.
        let mut two = vec![one(31), one(31)];
        let g = pooled("pair", &mut two);
        assert!(two.iter().all(|m| m.passed() && !m.rates_judged));
        assert!(!g.passed(), "{}", g.line());
        assert_eq!((g.positions, g.explained), (62, 2));
        // Four (2 of 124 after clearing two): within 2%.
        let mut four = vec![one(31), one(31), one(31), Case::new(31).run()];
        let g = pooled("four", &mut four);
        assert_eq!((g.positions, g.explained), (124, 3));
        assert!(!g.passed(), "{}", g.line());
        let mut four = vec![one(31), one(31), Case::new(31).run(), Case::new(31).run()];
        assert!(pooled("four", &mut four).passed());
        // An unexplained position fails its member and the group.
        let mut bad = vec![one(31), Case::new(31).run()];
        bad[1].unexplained = 1;
        let g = pooled("bad", &mut bad);
        assert!(!bad[1].passed() && !g.passed());
    }

    #[test]
    fn non_finite_logits_are_never_explained() {
        let mut c = Case::new(100);
        c.flip(10, 0.005, 0.3, true, f32::NAN);
        c.pos[10].finite = false;
        let r = c.run();
        assert_eq!((r.explained, r.unexplained), (0, 1));
        assert_eq!(r.max_err, f32::INFINITY);
        assert!(!r.passed());
    }

    #[test]
    fn engine_paths_explain_without_the_emulation() {
        let mut c = Case::new(100);
        c.flip(10, 0.005, 0.3, false, 5.0);
        let ev = |c: &Case| {
            classify(
                "paths",
                &c.pos,
                0,
                100.0,
                &[1],
                Evidence::EnginePaths {
                    oracle: &c.oracle,
                    engine: &c.engine,
                },
            )
        };
        let r = ev(&c);
        assert!(r.passed(), "{}", r.line());
        assert_eq!(r.explained, 1);
        assert_eq!(r.over_bound_positions[0].layers[0].emulation_experts, None);
        c.flip(10, 0.5, 0.3, false, 5.0);
        assert_eq!(ev(&c).unexplained, 1);
    }

    #[test]
    fn without_route_evidence_nothing_is_explained() {
        let mut c = Case::new(100);
        c.flip(10, 0.005, 0.3, true, 5.0);
        let r = classify("none", &c.pos, 0, 100.0, &[1], Evidence::None);
        assert_eq!((r.explained, r.unexplained), (0, 1));
        assert!(!r.passed());
        // Routes that do not cover the positions are not used either.
        c.engine[0].pop();
        let r = c.run();
        assert!(r.evidence_error.is_some());
        assert_eq!(r.unexplained, 1);
        assert!(!r.passed());
        // Nor are missing positions accepted.
        let c = Case::new(100);
        let r = classify("short", &c.pos, 1, 100.0, &[1], Evidence::None);
        assert!(!r.passed());
    }

    #[test]
    fn full_logits_bound_is_one_percent_of_the_largest_magnitude() {
        let oracle = vec![vec![1.0, -200.0, 3.0], vec![2.0, 0.0, 1.0]];
        let mut engine = oracle.clone();
        engine[1][1] -= 1.9;
        let r = classify_full("full", &engine, &oracle, &[], Evidence::None);
        assert!((r.bound - 2.0).abs() < 1e-6, "{}", r.bound);
        assert!(r.passed(), "{}", r.line());
        engine[1][1] -= 0.2;
        let r = classify_full("full", &engine, &oracle, &[], Evidence::None);
        assert_eq!((r.over_bound, r.unexplained), (1, 1));
        assert!(!r.passed());
        let r = classify_full("short", &engine[..1], &oracle, &[], Evidence::None);
        assert_eq!(r.missing_positions, 1);
        assert!(!r.passed());
    }

    #[test]
    fn witness_positions_use_top_ids_and_the_last_full_row() {
        let w = WitnessSequence {
            tokens: vec![1, 2],
            seq: WitnessSeq {
                argmax: vec![0, 1],
                top_ids: vec![vec![0, 1], vec![1, 0]],
                top_vals: vec![vec![10.0, 5.0], vec![20.0, 3.0]],
            },
            last: vec![3.0, 20.0, -50.0],
        };
        // Position 0's id 2 is not in the fixture, so it is not compared.
        let engine = vec![vec![10.0, 5.0, 99.0], vec![3.0, 20.0, -50.0]];
        let r = classify_witness("w", &engine, &w, &[], Evidence::None);
        assert!((r.bound - 0.5).abs() < 1e-6, "{}", r.bound);
        assert_eq!(r.max_err, 0.0);
        // ... but it is the engine's argmax there.
        assert_eq!(r.argmax_agree, 1);
        // At the last position every id is compared.
        let mut engine = engine;
        engine[0][2] = 0.0;
        engine[1][2] = -49.0;
        let r = classify_witness("w", &engine, &w, &[], Evidence::None);
        assert_eq!((r.argmax_agree, r.over_bound), (2, 1));
        assert_eq!(r.over_bound_positions[0].position, 1);
    }
}
