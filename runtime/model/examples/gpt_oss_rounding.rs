//! Why is `tiny-gpt-oss`'s BF16-vs-f32 logit error ~2.3x `tiny`'s relative
//! to the GPU check's bound (1% of the largest |oracle logit| of the
//! sequence), and which rounding point would bring it under? Runs the CPU
//! reference engine in f32 and in its emulation of the CUDA engine's BF16
//! rounding (`Activations::Bf16`) with rounding points switched off one at a
//! time, in groups, or replaced (`Rounding`, `Format`), and reports per
//! variant the worst and median error / bound over the positions whose
//! routes equal the f32 run's, on the witness sequences and on a text; then
//! the per-layer relative error of the residual stream and model properties
//! that set the sensitivity.
//!
//! ```text
//! cargo run --release -p krasis-model --example gpt_oss_rounding -- \
//!     [--tokens 512] [--presets tiny,tiny-gpt-oss,tiny-glm4-moe] [--variants all|engine,...] [--set 'k=v;k2=v2']
//!     [--ignore-sinks (with --features fault-injection)]
//!     [--faults (with --features fault-injection)]
//! ```
//!
//! `tiny` is the GPU check's `tiny-hd64` (head_dim 64) with the INT4 round
//! trip of its experts (`examples/shared`); `tiny-gpt-oss` is the test
//! checkpoint (`testutil::tiny_gpt_oss_checkpoint`) with its MXFP4 experts
//! decoded exactly (the GPU reads the same MXFP4 bytes); `tiny-glm4-moe` is
//! its test checkpoint (`testutil::tiny_glm4_moe_checkpoint`, the one its
//! witness was made from) with the INT4 round trip, on its witness
//! sequences (`sequences-glm4.json`).
//!
//! The engine variant's error is also reported as `bench --check`'s witness
//! comparison measures it: over the oracle's top-20 ids at each position
//! (every id at the last), the bound 1% of the largest |value| those hold.
//! The reference comparison takes every id of the vocabulary at every
//! position, and the bound of the whole logit matrix. `--faults` measures
//! each planted fault of the model (`Fault::applicable`, on the engine's
//! rounding) both ways too, against the plain f32 run: how far outside the
//! bound a bug lands under each measure. `--set` synthesizes
//! a counterfactual `tiny-gpt-oss` with config fields overridden (e.g.
//! `attention_bias=false`, `swiglu_limit=1000`, `num_hidden_layers=3`).
//! Needs the Qwen and o200k vocabularies.

use krasis_model::reference::{
    Activations, CheckpointExperts, Format, ReferenceEngine, ReferenceOptions, Rounding,
    RouteFollow, Trace,
};
use krasis_model::tokenizer::Tokenizer;
use krasis_model::{Checkpoint, ExpertWeights, MlpKind, ModelConfig, testutil};
use serde_json::Value;
use shared::{Int4RoundTrip, checkpoint};
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod shared;

/// The GPU check's bound: 1% of the largest |oracle logit| of the sequence.
const REL_BOUND: f32 = 0.01;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The witness sequences of the preset's family, then `long` tokens of text.
fn sequences(preset: &str, dir: &Path, long: usize) -> Vec<(String, Vec<u32>, bool)> {
    let file = if preset.contains("gpt-oss") {
        "tools/witness/sequences-gpt-oss.json"
    } else if preset.contains("glm4-moe") {
        "tools/witness/sequences-glm4.json"
    } else {
        "tools/witness/sequences.json"
    };
    let s: Value =
        serde_json::from_str(&std::fs::read_to_string(root().join(file)).unwrap()).unwrap();
    let mut out: Vec<(String, Vec<u32>, bool)> = s["sequences"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| {
            let ids = q["ids"].as_array().unwrap();
            (
                q["name"].as_str().unwrap().to_string(),
                ids.iter().map(|v| v.as_u64().unwrap() as u32).collect(),
                false,
            )
        })
        .collect();
    if long > 0 {
        let text =
            std::fs::read_to_string(root().join("assets/text/kjv-psalms-matthew.txt")).unwrap();
        let ids = Tokenizer::from_dir(dir).unwrap().encode(&text).unwrap();
        assert!(ids.len() >= long, "the text has only {} tokens", ids.len());
        out.push((format!("kjv {long}"), ids[..long].to_vec(), true));
    }
    out
}

fn quantile(v: &[f32], q: f64) -> f32 {
    if v.is_empty() {
        return f32::NAN;
    }
    let mut v = v.to_vec();
    v.sort_by(f32::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn routes(t: &Trace, moe: &[usize], pos: usize) -> Vec<Vec<usize>> {
    moe.iter()
        .map(|&l| {
            let mut e = t.experts[l][pos].clone();
            e.sort_unstable();
            e
        })
        .collect()
}

/// A rounding point on (BF16) or off (f32).
fn fmt(on: bool) -> Format {
    if on { Format::Bf16 } else { Format::F32 }
}

/// The MLP block's rounding points (input, weights, gate/up, SwiGLU
/// product, dequantized experts) in `f`.
fn mlp_block(r: &mut Rounding, f: Format) {
    (r.mlp_in, r.mlp_weights, r.gate_up, r.act, r.expert_weights) = (f, f, f, f, f);
}

/// The variants: name and rounding points. "engine" is the CUDA engine's
/// rounding for this model (`Rounding::engine`: FP16 attention for
/// gpt_oss, an FP16 MLP block for glm4_moe); "engine with a BF16 MLP block"
/// is it before the FP16 MLP block; the others start from every point in
/// BF16 (the engine before FP16 attention) or from none.
fn variants(g: &krasis_model::Geometry) -> Vec<(String, Rounding)> {
    let all = Rounding::all_bf16();
    let none = Rounding::none();
    let mut bf16_mlp = Rounding::engine(g);
    mlp_block(&mut bf16_mlp, Format::Bf16);
    let mut v = vec![
        (
            "engine (as built for this model)".to_string(),
            Rounding::engine(g),
        ),
        ("engine with a BF16 MLP block".to_string(), bf16_mlp),
        ("all points BF16".to_string(), all),
    ];
    type Set = fn(&mut Rounding, bool);
    let points: [(&str, Set); 11] = [
        ("attn_in", |r, b| r.attn_in = fmt(b)),
        ("q", |r, b| r.q = fmt(b)),
        ("k", |r, b| r.k = fmt(b)),
        ("v", |r, b| r.v = fmt(b)),
        ("p", |r, b| r.p = fmt(b)),
        ("attn_out", |r, b| r.attn_out = b),
        ("mlp_in", |r, b| r.mlp_in = fmt(b)),
        ("gate_up", |r, b| r.gate_up = fmt(b)),
        ("act", |r, b| r.act = fmt(b)),
        ("final_norm", |r, b| r.final_norm = b),
        ("expert_w+norm_f32", |r, b| {
            r.expert_weights = fmt(b);
            r.norm_f32 = b
        }),
    ];
    for (name, set) in points {
        let mut r = all;
        set(&mut r, false);
        v.push((format!("all but {name}"), r));
    }
    for (name, set) in points {
        let mut r = none;
        set(&mut r, true);
        v.push((format!("only {name}"), r));
    }
    let group = |names: &[&str], on: bool| {
        let mut r = if on { none } else { all };
        for (n, set) in points {
            if names.contains(&n) {
                set(&mut r, on);
            }
        }
        r
    };
    let attn = ["attn_in", "q", "k", "v", "p", "attn_out"];
    let moe = ["mlp_in", "gate_up", "act"];
    v.push(("only attention block".into(), group(&attn, true)));
    v.push(("only MLP/MoE block".into(), group(&moe, true)));
    v.push(("all but q,k,v".into(), group(&["q", "k", "v"], false)));
    v.push((
        "all but k,v (KV cache f32)".into(),
        group(&["k", "v"], false),
    ));
    v.push((
        "all but p,attn_out".into(),
        group(&["p", "attn_out"], false),
    ));
    v.push((
        "all but gate_up,act".into(),
        group(&["gate_up", "act"], false),
    ));
    v.push((
        "all but attn_in,mlp_in,final_norm (norm outputs f32)".into(),
        group(&["attn_in", "mlp_in", "final_norm"], false),
    ));
    v.push(("none (tiled f32 attention)".into(), none));
    // Candidate fixes.
    let fix = |name: &str, f: &dyn Fn(&mut Rounding)| {
        let mut r = all;
        f(&mut r);
        (format!("fix: {name}"), r)
    };
    use Format::{F16, F32};
    // q, k, v and P (the K/V cache and the attention tiles) in `f`.
    let qkvp = |r: &mut Rounding, f: Format| {
        (r.q, r.k, r.v, r.p) = (f, f, f, f);
    };
    // The MoE block's rounding points off (f32).
    let moe_f32 = |r: &mut Rounding| {
        (r.mlp_in, r.gate_up, r.act) = (F32, F32, F32);
    };
    v.extend([
        fix("P FP16", &|r| r.p = F16),
        fix("P FP16 + attn_out f32", &|r| {
            r.p = F16;
            r.attn_out = false
        }),
        fix("q,k FP16", &|r| (r.q, r.k) = (F16, F16)),
        fix("q,k f32", &|r| (r.q, r.k) = (F32, F32)),
        fix("q,k,P FP16", &|r| (r.q, r.k, r.p) = (F16, F16, F16)),
        fix("q,k,v,P FP16", &|r| qkvp(r, F16)),
        fix("q,k,v,P FP16 + attn_in f32", &|r| {
            qkvp(r, F16);
            r.attn_in = F32
        }),
        fix("attn_in,q,k,v,P FP16", &|r| {
            qkvp(r, F16);
            r.attn_in = F16
        }),
        fix("attn_in,q,k,v,P FP16 + attn_out f32", &|r| {
            qkvp(r, F16);
            r.attn_in = F16;
            r.attn_out = false
        }),
        fix("q,k,v,P FP16 + MoE block f32", &|r| {
            qkvp(r, F16);
            moe_f32(r)
        }),
        fix("MoE block f32 (mlp_in,gate_up,act)", &moe_f32),
        fix(
            "MLP block FP16 (mlp_in,weights,gate_up,act,expert_w)",
            &|r| mlp_block(r, F16),
        ),
        fix("q,k,v,P FP16 + MLP block FP16", &|r| {
            qkvp(r, F16);
            mlp_block(r, F16)
        }),
        fix("attention block f32", &|r| {
            qkvp(r, F32);
            r.attn_in = F32;
            r.attn_out = false
        }),
    ]);
    v
}

struct Stats {
    witness: Vec<f32>,
    long: Vec<f32>,
    flipped: usize,
}

/// Per position, the largest |a - b| over the ids of `o`'s top 20 (every
/// id at the last position), and the bound `bench --check` puts on it
/// against a witness fixture: 1% of the largest |value| those ids hold in
/// `o`. (`o`, the f32 oracle, stands in for the witness, which it equals
/// within 1e-6 of max |logit|: `krasis-cache --test witness`.)
fn top20_errors(o: &[Vec<f32>], b: &[Vec<f32>]) -> (Vec<f32>, f32) {
    let n = o.len();
    let mut scale = 0f32;
    let errs = o
        .iter()
        .zip(b)
        .enumerate()
        .map(|(t, (x, y))| {
            let ids: Vec<usize> = if t + 1 == n {
                (0..x.len()).collect()
            } else {
                let mut idx: Vec<usize> = (0..x.len()).collect();
                idx.sort_by(|&i, &j| x[j].total_cmp(&x[i]));
                idx.truncate(20);
                idx
            };
            ids.iter().fold(0f32, |m, &i| {
                scale = scale.max(x[i].abs());
                m.max((x[i] - y[i]).abs())
            })
        })
        .collect();
    (errs, REL_BOUND * scale)
}

/// Per capture point (residual after attention / MLP of each layer, final
/// normed hidden): relative error |x_b - x_f| / |x_f| per token.
fn rel_errors(rf: &[Vec<f32>], rb: &[Vec<f32>], h: usize) -> Vec<Vec<f32>> {
    rf.iter()
        .zip(rb)
        .map(|(a, b)| {
            a.chunks_exact(h)
                .zip(b.chunks_exact(h))
                .map(|(x, y)| {
                    let d: f32 = x.iter().zip(y).map(|(p, q)| (p - q) * (p - q)).sum();
                    let n: f32 = x.iter().map(|p| p * p).sum();
                    (d / n).sqrt()
                })
                .collect()
        })
        .collect()
}

fn rms_tokens(x: &[f32], h: usize) -> Vec<f32> {
    x.chunks_exact(h)
        .map(|r| (r.iter().map(|v| v * v).sum::<f32>() / h as f32).sqrt())
        .collect()
}

/// Error / bound of one run against the f32 oracle, pooled over the
/// witness sequences: (full vocabulary, top 20).
#[derive(Default)]
struct Measured {
    full: Vec<f32>,
    top: Vec<f32>,
}

impl Measured {
    fn add(&mut self, lf: &[Vec<f32>], lb: &[Vec<f32>], bound: f32) {
        self.full.extend(
            lf.iter()
                .zip(lb)
                .map(|(x, y)| x.iter().zip(y).fold(0f32, |m, (p, q)| m.max((p - q).abs())) / bound),
        );
        let (top, top_bound) = top20_errors(lf, lb);
        self.top.extend(top.iter().map(|e| e / top_bound));
    }

    fn row(&self, name: &str) -> String {
        let over = |v: &[f32]| v.iter().filter(|&&x| x > 1.0).count();
        format!(
            "| {name} | {:.3} | {:.3} | {}/{} | {:.3} | {:.3} | {}/{} |",
            quantile(&self.full, 1.0),
            quantile(&self.full, 0.5),
            over(&self.full),
            self.full.len(),
            quantile(&self.top, 1.0),
            quantile(&self.top, 0.5),
            over(&self.top),
            self.top.len()
        )
    }
}

fn run_preset(
    preset: &str,
    dir: PathBuf,
    long: usize,
    filter: &[String],
    ignore_sinks: bool,
    faults: bool,
) {
    let config = ModelConfig::load(&dir).unwrap();
    let g = config.geometry();
    let moe: Vec<usize> = (0..g.num_layers)
        .filter(|&l| g.mlp_kind(l) == MlpKind::Moe)
        .collect();
    let ckpt_experts = CheckpointExperts::new(Arc::new(Checkpoint::open(&dir).unwrap()), &config);
    let experts: Arc<dyn ExpertWeights> = if preset.contains("gpt-oss") {
        Arc::new(ckpt_experts)
    } else {
        Arc::new(Int4RoundTrip(ckpt_experts))
    };
    let opts = ReferenceOptions {
        context_length: Some(long.max(128) + 64),
    };
    let mut e = ReferenceEngine::with_experts(&dir, opts, experts).unwrap();
    if ignore_sinks {
        // The same model without its attention sinks, in both runs.
        #[cfg(feature = "fault-injection")]
        e.set_fault(krasis_model::reference::Fault::IgnoreSinks);
        #[cfg(not(feature = "fault-injection"))]
        panic!("--ignore-sinks needs --features fault-injection");
    }
    let h = g.hidden;
    println!(
        "\n## {preset}: {} layers, hidden {h}, head_dim {}, {}q/{}kv heads, top-{} of {} experts, vocab {} ({})",
        g.num_layers,
        g.head_dim,
        g.num_heads,
        g.num_kv_heads,
        g.top_k,
        g.num_experts,
        g.vocab_size,
        dir.display()
    );
    let vars: Vec<(String, Rounding)> = variants(&g)
        .into_iter()
        .filter(|(n, _)| filter.is_empty() || filter.iter().any(|f| n.contains(f.as_str())))
        .collect();
    let mut stats: Vec<Stats> = vars
        .iter()
        .map(|_| Stats {
            witness: Vec::new(),
            long: Vec::new(),
            flipped: 0,
        })
        .collect();
    // Residual relative errors of the engine variant, pooled [point][token].
    let mut res_err: Vec<Vec<f32>> = vec![Vec::new(); 2 * g.num_layers + 1];
    let mut res_rms: Vec<Vec<f32>> = vec![Vec::new(); 2 * g.num_layers + 1];
    let mut block_rms: Vec<Vec<f32>> = vec![Vec::new(); 2 * g.num_layers + 1];
    // The engine variant on the witness sequences: error / bound as the
    // reference comparison (full vocabulary) and as the witness comparison
    // (top 20) take it, pooled.
    let (mut full_pooled, mut top_pooled) = (Vec::new(), Vec::new());
    #[cfg(feature = "fault-injection")]
    let fault_list = if faults {
        krasis_model::reference::Fault::applicable(&g)
    } else {
        Vec::new()
    };
    #[cfg(not(feature = "fault-injection"))]
    let fault_list: Vec<()> = if faults {
        panic!("--faults needs --features fault-injection")
    } else {
        Vec::new()
    };
    let mut fault_measured: Vec<Measured> =
        fault_list.iter().map(|_| Measured::default()).collect();
    for (label, tokens, is_long) in sequences(preset, &dir, long) {
        e.set_activations(Activations::F32);
        e.set_capture_residuals(true);
        let (lf, tf) = e.prompt_logits_traced(&tokens).unwrap();
        let rf = e.take_residuals();
        e.set_capture_residuals(false);
        let n = tokens.len();
        let scale = lf.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
        let bound = REL_BOUND * scale;
        // Logit spread: per-position std and max |logit|.
        let stds: Vec<f32> = lf
            .iter()
            .map(|r| {
                let m = r.iter().sum::<f32>() / r.len() as f32;
                (r.iter().map(|v| (v - m) * (v - m)).sum::<f32>() / r.len() as f32).sqrt()
            })
            .collect();
        let maxes: Vec<f32> = lf
            .iter()
            .map(|r| r.iter().fold(0f32, |m, v| m.max(v.abs())))
            .collect();
        let margins: Vec<f32> = moe
            .iter()
            .flat_map(|&l| tf.router_margin[l].iter().copied())
            .collect();
        let peaks: Vec<String> = (0..g.num_layers)
            .map(|l| format!("{:.2}", quantile(&tf.attn_peak[l], 0.5)))
            .collect();
        println!(
            "\n### {label} ({n} tokens): max |logit| {scale:.2}, bound {bound:.4}; per position: median max|logit| {:.2}, median logit std {:.2} (max/std {:.2}); median router margin {:.4}; median attn peak per layer {peaks:?}",
            quantile(&maxes, 0.5),
            quantile(&stds, 0.5),
            scale / quantile(&stds, 0.5),
            quantile(&margins, 0.5),
        );
        for (i, r) in rf.iter().enumerate() {
            res_rms[i].extend(rms_tokens(r, h));
        }
        for i in 1..2 * g.num_layers {
            let d: Vec<f32> = rf[i].iter().zip(&rf[i - 1]).map(|(a, b)| a - b).collect();
            block_rms[i].extend(rms_tokens(&d, h));
        }
        for ((name, r), st) in vars.iter().zip(stats.iter_mut()) {
            e.set_activations(Activations::Bf16);
            e.set_rounding(*r);
            let engine_variant = name.starts_with("engine (");
            e.set_capture_residuals(engine_variant);
            let (lb, tb) = e.prompt_logits_traced(&tokens).unwrap();
            let rb = e.take_residuals();
            e.set_capture_residuals(false);
            // The f32 oracle running the BF16 run's expert sets wherever
            // they differ (every flip followed, however wide the gap): what
            // remains is rounding alone.
            let (lf, tf, rf) = if tb.experts == tf.experts {
                (lf.clone(), tf.clone(), rf.clone())
            } else {
                e.set_activations(Activations::F32);
                e.set_capture_residuals(engine_variant);
                let follow = RouteFollow {
                    experts: tb.experts.clone(),
                    abs: f32::INFINITY,
                    rel: 0.0,
                    spread: 0.0,
                };
                let (l, t) = e.prompt_logits_following(&tokens, follow).unwrap();
                let r = e.take_residuals();
                e.set_capture_residuals(false);
                (l, t, r)
            };
            st.flipped += tf.followed.iter().flatten().filter(|&&x| x).count();
            if engine_variant {
                for (i, v) in rel_errors(&rf, &rb, h).into_iter().enumerate() {
                    res_err[i].extend(v);
                }
            }
            let mut ratios = Vec::new();
            let mut worst = (0f32, 0usize);
            for t in 0..n {
                assert_eq!(routes(&tf, &moe, t), routes(&tb, &moe, t));
                let err = lf[t]
                    .iter()
                    .zip(&lb[t])
                    .fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                let ratio = err / bound;
                if ratio > worst.0 {
                    worst = (ratio, t);
                }
                ratios.push(ratio);
            }
            if engine_variant {
                println!(
                    "  engine: worst {:.3} bounds at pos {}, median {:.3}, over 1.0: {}",
                    worst.0,
                    worst.1,
                    quantile(&ratios, 0.5),
                    ratios.iter().filter(|&&x| x > 1.0).count()
                );
                let full_abs: Vec<f32> = ratios.iter().map(|r| r * bound).collect();
                let (top, top_bound) = top20_errors(&lf, &lb);
                let top_ratios: Vec<f32> = top.iter().map(|e| e / top_bound).collect();
                println!(
                    "  engine, as the check's comparisons measure it: full vocabulary (reference) |dlogit| median {:.4} worst {:.4}, bound {bound:.4}; top-20 (witness) median {:.4} worst {:.4}, bound {top_bound:.4} -> worst {:.3} / median {:.3} bounds, over 1.0: {}",
                    quantile(&full_abs, 0.5),
                    quantile(&full_abs, 1.0),
                    quantile(&top, 0.5),
                    quantile(&top, 1.0),
                    quantile(&top_ratios, 1.0),
                    quantile(&top_ratios, 0.5),
                    top_ratios.iter().filter(|&&x| x > 1.0).count()
                );
                if !is_long {
                    full_pooled.extend(full_abs.iter().map(|e| e / bound));
                    top_pooled.extend(top_ratios);
                }
            }
            if is_long {
                st.long.extend(ratios);
            } else {
                st.witness.extend(ratios);
            }
        }
        e.set_rounding(Rounding::engine(&g));
        if !is_long {
            for (_f, m) in fault_list.iter().zip(fault_measured.iter_mut()) {
                #[cfg(feature = "fault-injection")]
                e.set_fault(*_f);
                e.set_activations(Activations::Bf16);
                let (lb, _) = e.prompt_logits_traced(&tokens).unwrap();
                #[cfg(feature = "fault-injection")]
                e.set_fault(krasis_model::reference::Fault::None);
                m.add(&lf, &lb, bound);
            }
        }
    }
    if !full_pooled.is_empty() {
        println!(
            "\n### {preset}: engine variant on the witness sequences pooled, error / bound: full vocabulary (the reference comparison) worst {:.3} median {:.3}; top-20 (the witness comparison) worst {:.3} median {:.3}",
            quantile(&full_pooled, 1.0),
            quantile(&full_pooled, 0.5),
            quantile(&top_pooled, 1.0),
            quantile(&top_pooled, 0.5),
        );
    }
    if !fault_list.is_empty() {
        println!(
            "\n### {preset}: planted faults (engine rounding) against the plain f32 run, witness sequences pooled, error / bound\n"
        );
        println!(
            "| fault | full vocabulary worst | median | over 1 | top-20 worst | median | over 1 |"
        );
        println!("|---|---|---|---|---|---|---|");
        for (f, m) in fault_list.iter().zip(&fault_measured) {
            println!("{}", m.row(&format!("{f:?}")));
        }
    }
    println!(
        "\n### {preset}: error / bound, the f32 oracle following every BF16 route (witness sequences pooled; the text)\n"
    );
    println!(
        "| variant | witness worst | witness median | text worst | text median | flips followed |"
    );
    println!("|---|---|---|---|---|---|");
    for ((name, _), st) in vars.iter().zip(&stats) {
        println!(
            "| {name} | {:.3} | {:.3} | {:.3} | {:.3} | {} |",
            quantile(&st.witness, 1.0),
            quantile(&st.witness, 0.5),
            quantile(&st.long, 1.0),
            quantile(&st.long, 0.5),
            st.flipped
        );
    }
    if !res_err[0].is_empty() {
        println!(
            "\n### {preset}: residual stream, engine rounding vs f32 (all sequences pooled)\n"
        );
        println!(
            "| point | rms median | block output rms median | rel err median | rel err p90 | rel err max |"
        );
        println!("|---|---|---|---|---|---|");
        for i in 0..res_err.len() {
            let point = if i == 2 * g.num_layers {
                "final normed".to_string()
            } else {
                format!(
                    "L{} after {}",
                    i / 2,
                    if i % 2 == 0 { "attn" } else { "mlp" }
                )
            };
            println!(
                "| {point} | {:.3} | {:.3} | {:.5} | {:.5} | {:.5} |",
                quantile(&res_rms[i], 0.5),
                quantile(&block_rms[i], 0.5),
                quantile(&res_err[i], 0.5),
                quantile(&res_err[i], 0.9),
                quantile(&res_err[i], 1.0),
            );
        }
    }
}

fn main() {
    let mut long = 512;
    let mut presets = vec!["tiny".to_string(), "tiny-gpt-oss".to_string()];
    let mut filter: Vec<String> = Vec::new();
    let mut sets: Vec<(String, Value)> = Vec::new();
    let mut ignore_sinks = false;
    let mut faults = false;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--tokens" => long = args.next().unwrap().parse().unwrap(),
            "--presets" => presets = args.next().unwrap().split(',').map(String::from).collect(),
            "--variants" => {
                filter = args.next().unwrap().split(',').map(String::from).collect();
                if filter == ["all"] {
                    filter.clear();
                }
            }
            "--ignore-sinks" => ignore_sinks = true,
            "--faults" => faults = true,
            "--set" => {
                for kv in args.next().unwrap().split(';') {
                    let (k, v) = kv.split_once('=').expect("--set key=value");
                    let v: Value = serde_json::from_str(v).unwrap_or(Value::String(v.into()));
                    sets.push((k.to_string(), v));
                }
            }
            _ => panic!("unknown argument {a}"),
        }
    }
    for p in &presets {
        let dir = match p.as_str() {
            "tiny-gpt-oss" if sets.is_empty() => testutil::tiny_gpt_oss_checkpoint(),
            "tiny-glm4-moe" => testutil::tiny_glm4_moe_checkpoint(),
            "tiny-gpt-oss" => {
                let o: Vec<(&str, Value)> =
                    sets.iter().map(|(k, v)| (k.as_str(), v.clone())).collect();
                testutil::tiny_checkpoint_with("tiny-gpt-oss", &o)
            }
            other => checkpoint(other),
        };
        let mut label = if sets.is_empty() || !p.contains("gpt-oss") {
            p.clone()
        } else {
            format!("{p} {sets:?}")
        };
        if ignore_sinks {
            label.push_str(" without sinks");
        }
        run_preset(&label, dir, long, &filter, ignore_sinks, faults);
    }
}
