//! The criterion against the following reference: on synthetic routes, and
//! end to end on the CPU with the reference's emulation of the engine's
//! rounding (`Rounding::engine`) standing in for the engine (a correct
//! engine that passes, on text and on glm4_moe's witness sequences; the
//! same with each planted fault, or glm4_moe's old BF16 MLP block, which
//! fails).

use super::*;
use crate::check::{Route, WitnessSeq};

fn rt(experts: &[u32], gap: f32) -> Route {
    Route {
        experts: experts.to_vec(),
        gap,
        kth: 2.0,
    }
}

/// `n` positions, one MoE layer, logits of max |value| 100 (bound 1.0).
struct Case {
    engine: Vec<Vec<f32>>,
    engine_routes: Routes,
    f: Following,
}

impl Case {
    fn new(n: usize) -> Self {
        let row = |p: usize| -> Vec<f32> {
            (0..8)
                .map(|i| if i == 0 { 100.0 } else { (p + i) as f32 * 0.5 })
                .collect()
        };
        let logits: Vec<Vec<f32>> = (0..n).map(row).collect();
        Case {
            engine: logits
                .iter()
                .map(|r| r.iter().map(|v| v + 0.1).collect())
                .collect(),
            engine_routes: vec![vec![rt(&[0, 1], 1.0); n]],
            f: Following {
                logits,
                routes: vec![vec![rt(&[0, 1], 1.0); n]],
                followed: vec![vec![false; n]],
                spread: 0.0,
            },
        }
    }

    /// The following reference took the engine's {0, 2} at `p` (gap 0.005).
    fn follow(&mut self, p: usize) -> &mut Self {
        self.engine_routes[0][p] = rt(&[2, 0], 0.004);
        self.f.routes[0][p] = rt(&[2, 0], 0.005);
        self.f.followed[0][p] = true;
        self
    }

    fn full(&self) -> FidelityReport {
        classify_followed_full("t", &self.engine, &self.engine_routes, &self.f, &[1])
    }
}

#[test]
fn within_the_bound_everywhere_passes_and_counts_followed_decisions() {
    let mut c = Case::new(100);
    c.follow(10);
    let r = c.full();
    assert!(r.passed(), "{}", r.line());
    assert_eq!(
        (r.decisions, r.followed_decisions, r.flip_positions),
        (100, 1, 1)
    );
}

#[test]
fn one_position_over_the_bound_fails_even_after_a_followed_flip() {
    let mut c = Case::new(100);
    c.follow(10);
    c.engine[40][3] += 2.0;
    let r = c.full();
    assert!(!r.passed(), "{}", r.line());
    assert_eq!(
        (r.over_bound, r.unexplained, r.unexplained_after_flip),
        (1, 1, 1)
    );
}

#[test]
fn followed_decisions_over_two_percent_of_decisions_fail() {
    let mut c = Case::new(100);
    for p in [3, 30, 60] {
        c.follow(p);
    }
    let r = c.full();
    assert!(!r.passed(), "{}", r.line());
    assert!(
        r.failures[0].contains("3 followed near-tie decisions"),
        "{:?}",
        r.failures
    );
    // The same three decisions over two MoE layers' worth (200) pass.
    let mut c2 = Case::new(100);
    for p in [3, 30, 60] {
        c2.follow(p);
    }
    c2.engine_routes.push(vec![rt(&[0, 1], 1.0); 100]);
    c2.f.routes.push(vec![rt(&[0, 1], 1.0); 100]);
    c2.f.followed.push(vec![false; 100]);
    let r2 = classify_followed_full("t", &c2.engine, &c2.engine_routes, &c2.f, &[1, 3]);
    assert!(r2.passed(), "{}", r2.line());
}

#[test]
fn a_route_change_away_from_a_near_tie_over_the_bound_is_unexplained() {
    let mut c = Case::new(100);
    c.engine_routes[0][20] = rt(&[3, 0], 0.5);
    c.engine[20][5] += 3.0;
    let r = c.full();
    assert!(!r.passed(), "{}", r.line());
    assert_eq!(r.unexplained_route_change, 1);
    assert!(r.over_bound_positions[0].reason.contains("not near a tie"));
}

#[test]
fn nan_and_missing_positions_fail() {
    let mut c = Case::new(60);
    c.engine[7][2] = f32::NAN;
    assert!(!c.full().passed());
    let mut c = Case::new(60);
    c.engine.pop();
    let r = c.full();
    assert!(!r.passed() && r.missing_positions == 1, "{}", r.line());
}

/// A witness of `n` positions equal to the following reference's logits
/// except at positions `moved`, where the witness (the unfollowed f32
/// model) is 3 off: a flip's effect.
fn witness(f: &Following, moved: &[usize]) -> WitnessSequence {
    let n = f.logits.len();
    let top = |p: usize| -> (Vec<u32>, Vec<f32>) {
        let mut row = f.logits[p].clone();
        if moved.contains(&p) {
            row[1] += 3.0;
        }
        let ids = crate::check::top_ids(&row, 5);
        let vals = ids.iter().map(|&i| row[i as usize]).collect();
        (ids, vals)
    };
    let (ids, vals): (Vec<_>, Vec<_>) = (0..n).map(top).unzip();
    WitnessSequence {
        tokens: vec![1; n],
        seq: WitnessSeq {
            argmax: ids.iter().map(|i: &Vec<u32>| i[0]).collect(),
            top_ids: ids,
            top_vals: vals,
        },
        last: f.logits[n - 1].clone(),
    }
}

#[test]
fn witness_differences_after_a_followed_flip_are_explained_and_others_not() {
    let mut c = Case::new(100);
    c.follow(10);
    let w = witness(&c.f, &[10, 11, 50]);
    let r = classify_followed_witness("w", &c.engine, &c.engine_routes, &w, &c.f, &[1]);
    assert!(r.passed(), "{}", r.line());
    assert_eq!(
        (r.explained, r.carried, r.unexplained),
        (1, 2, 0),
        "{:?}",
        r.over_bound_positions
            .iter()
            .map(|o| o.position)
            .collect::<Vec<_>>()
    );
    // Without the followed flip the same differences are unexplained.
    let c = Case::new(100);
    let r = classify_followed_witness("w", &c.engine, &c.engine_routes, &w, &c.f, &[1]);
    assert!(!r.passed() && r.unexplained == 3, "{}", r.line());
    // After the flip, but the engine is off the following reference too.
    let mut c = Case::new(100);
    c.follow(10);
    c.engine[50][0] += 3.0;
    let r = classify_followed_witness("w", &c.engine, &c.engine_routes, &w, &c.f, &[1]);
    assert!(!r.passed() && r.unexplained == 1, "{}", r.line());
}

#[test]
fn pre_flip_spread_stops_at_the_emulations_first_flip() {
    let o = vec![vec![
        rt(&[0, 1], 1.0),
        rt(&[0, 1], 0.5),
        rt(&[0, 1], 0.2),
        rt(&[0, 1], 1.0),
    ]];
    let mut e = o.clone();
    e[0][0].gap = 0.99;
    e[0][1].gap = 0.47;
    e[0][2] = rt(&[0, 2], 0.01);
    e[0][3].gap = 0.0;
    assert!((pre_flip_spread(&o, &e) - 0.03).abs() < 1e-6);
    let same = o.clone();
    assert_eq!(pre_flip_spread(&o, &same), 0.0);
}

/// End to end on the CPU: the reference's BF16 emulation is a correct BF16
/// engine (its own rounding and near-tie flips); the criterion passes it
/// and fails it with each planted fault.
mod cpu {
    use super::*;
    use krasis_model::reference::{
        Activations, Fault, Format, ReferenceEngine, ReferenceOptions, Rounding,
    };
    use krasis_model::testutil::tiny_checkpoint;
    use krasis_model::tokenizer::Tokenizer;

    fn text_tokens(dir: &std::path::Path, n: usize) -> Vec<u32> {
        let text = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../../assets/text/kjv-genesis-exodus.txt"),
        )
        .expect("the KJV text");
        let ids = Tokenizer::from_dir(dir).unwrap().encode(&text).unwrap();
        ids[..n].to_vec()
    }

    fn judge(preset: &str, n: usize, fault: Fault) -> FidelityReport {
        let dir = tiny_checkpoint(preset);
        let toks = text_tokens(&dir, n);
        let mut r = ReferenceEngine::load(
            &dir,
            ReferenceOptions {
                context_length: Some(n + 8),
            },
        )
        .unwrap();
        judge_tokens(&mut r, &format!("{preset} {fault:?}"), &toks, fault)
    }

    /// The criterion on `toks`: `r`'s emulation (its rounding, `fault`
    /// planted) as the engine, against `r` in f32 following its near-tie
    /// choices, the near-tie width measured on the same tokens.
    fn judge_tokens(
        r: &mut ReferenceEngine,
        label: &str,
        toks: &[u32],
        fault: Fault,
    ) -> FidelityReport {
        let moe: Vec<usize> = r.geometry().moe_layers().collect();
        let traced = Traced::new(r, toks, &moe).unwrap();
        // The "engine": the BF16 emulation, with the fault planted.
        r.set_fault(fault);
        r.set_activations(Activations::Bf16);
        let (logits, t) = r.prompt_logits_traced(toks).unwrap();
        r.set_fault(Fault::None);
        let engine_routes = routes_from_trace(&t, &moe);
        let f = Following::after(r, &traced, toks, &moe, &engine_routes).unwrap();
        classify_followed_full(label, &logits, &engine_routes, &f, &moe)
    }

    /// The criterion on every sequence of `preset`'s witness fixture (its
    /// `int4` case: the sequences `bench --check` judges on the H200),
    /// each and pooled (last), the emulation running `rounding` (`None`:
    /// the engine's, `Rounding::engine` of the description).
    fn judge_witness(preset: &str, rounding: Option<Rounding>) -> Vec<FidelityReport> {
        let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/witness")
            .join(preset)
            .join("int4");
        let (_, seqs) = crate::check::load_witness(&fixture).unwrap();
        let longest = seqs.iter().map(|s| s.tokens.len()).max().unwrap();
        let mut r = ReferenceEngine::load(
            &tiny_checkpoint(preset),
            ReferenceOptions {
                context_length: Some(longest + 8),
            },
        )
        .unwrap();
        if let Some(rounding) = rounding {
            r.set_rounding(rounding);
        }
        let mut reports: Vec<FidelityReport> = seqs
            .iter()
            .enumerate()
            .map(|(i, s)| judge_tokens(&mut r, &format!("{preset} seq{i}"), &s.tokens, Fault::None))
            .collect();
        let all = crate::check::pooled(&format!("{preset} witness sequences pooled"), &mut reports);
        reports.push(all);
        reports
    }

    const TOKENS: usize = 128;

    fn faults(preset: &str) -> Vec<Fault> {
        let r = ReferenceEngine::load(&tiny_checkpoint(preset), ReferenceOptions::default());
        Fault::applicable(r.unwrap().geometry())
    }

    /// qwen3_moe (`tiny`): the correct BF16 engine passes; every planted
    /// fault fails.
    #[test]
    fn the_bf16_emulation_passes_and_every_planted_fault_fails() {
        let ok = judge("tiny", TOKENS, Fault::None);
        eprintln!("{}", ok.line());
        assert!(ok.passed(), "{}", ok.line());
        for fault in faults("tiny") {
            let bad = judge("tiny", TOKENS, fault);
            eprintln!("{}", bad.line());
            assert!(!bad.passed(), "{}", bad.line());
        }
    }

    /// glm4_moe (`tiny-glm4-moe`: the sigmoid grouped router, whose
    /// near-ties are measured on its choice scores, the shared expert,
    /// partial rotary, the MLP block in FP16): the correct engine's
    /// emulation passes on text and on every witness sequence `bench
    /// --check` judges (each and pooled); every planted fault (an ignored
    /// selection bias and a skipped shared expert among them) fails, as
    /// `tests/glm4_moe.rs` requires of the CUDA engine.
    #[test]
    fn on_tiny_glm4_moe_the_bf16_emulation_passes_and_every_planted_fault_fails() {
        let ok = judge("tiny-glm4-moe", TOKENS, Fault::None);
        eprintln!("{}", ok.line());
        assert!(ok.passed(), "{}", ok.line());
        for w in judge_witness("tiny-glm4-moe", None) {
            eprintln!("{}", w.line());
            assert!(w.passed(), "{}", w.line());
        }
        let faults = faults("tiny-glm4-moe");
        assert!(
            faults.contains(&Fault::IgnoreSelectionBias) && faults.contains(&Fault::NoSharedExpert)
        );
        for fault in faults {
            let bad = judge("tiny-glm4-moe", TOKENS, fault);
            eprintln!("{}", bad.line());
            assert!(!bad.passed(), "{}", bad.line());
        }
    }

    /// The same criterion fails glm4_moe's emulation with its MLP block in
    /// BF16 (the engine before FP16 MLP) on the witness sequences, as the
    /// H200 check failed that engine there (1.13 bounds at 3 positions;
    /// benchmarks/results/2026-12-02-issue14-glm-gpu.md), while it passes
    /// on the 128 tokens of text the test judged alone before: the witness
    /// sequences are what makes this test predict the device.
    #[test]
    fn on_tiny_glm4_moe_a_bf16_mlp_block_fails_the_witness_sequences() {
        let dir = tiny_checkpoint("tiny-glm4-moe");
        let r = ReferenceEngine::load(&dir, ReferenceOptions::default()).unwrap();
        let bf16_mlp = Rounding {
            mlp_in: Format::Bf16,
            mlp_weights: Format::Bf16,
            gate_up: Format::Bf16,
            act: Format::Bf16,
            expert_weights: Format::Bf16,
            ..Rounding::engine(r.geometry())
        };
        assert_ne!(
            bf16_mlp,
            r.rounding(),
            "glm4_moe's engine runs an FP16 MLP block"
        );
        let reports = judge_witness("tiny-glm4-moe", Some(bf16_mlp));
        for w in &reports {
            eprintln!("{}", w.line());
        }
        let all = reports.last().unwrap();
        assert!(!all.passed() && all.unexplained > 0, "{}", all.line());
    }

    /// gpt_oss (`tiny-gpt-oss`): the correct BF16 engine's rounding reaches
    /// 1.1 bounds at a few positions on this synthetic model (its expert
    /// intermediates are rounded to BF16 as the CUDA prefill path stores
    /// them; measured on the H200 too: 1.06-1.21 bounds), so the criterion
    /// FAILS it there, by design of the 1% bound, with every route equal and
    /// the flip rate low. What this test holds: that picture, and every
    /// planted fault far outside it (tens of bounds at most positions).
    #[test]
    fn on_tiny_gpt_oss_rounding_stays_near_the_bound_and_faults_far_outside() {
        let ok = judge("tiny-gpt-oss", TOKENS, Fault::None);
        eprintln!("{}", ok.line());
        assert_eq!(ok.route_change_positions, 0, "{}", ok.line());
        assert!(
            100 * ok.followed_decisions <= 2 * ok.decisions,
            "{}",
            ok.line()
        );
        assert!(
            ok.max_err < 1.5 * ok.bound && ok.over_bound * 20 < ok.positions,
            "{}",
            ok.line()
        );
        for fault in faults("tiny-gpt-oss") {
            let bad = judge("tiny-gpt-oss", TOKENS, fault);
            eprintln!("{}", bad.line());
            assert!(
                !bad.passed() && bad.max_err > 10.0 * bad.bound,
                "{}",
                bad.line()
            );
            assert!(bad.over_bound * 2 > bad.positions, "{}", bad.line());
        }
    }
}
