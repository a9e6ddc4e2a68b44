//! Quantization quality: the CPU reference engine run over the checkpoint's
//! experts (BF16) and over the INT4 cache, on `tiny` and a medium synthetic
//! model. The bounds are loose enough for correct INT4 and tight enough that
//! a wrong scale (x1.1) or a wrong layout (gate/up swapped) fails them; the
//! last test proves that.

mod common;

use common::*;
use krasis_cache::{BuildOptions, CacheExperts, ModelSource, ensure_cache_at};
use krasis_model::reference::{ReferenceEngine, ReferenceOptions};
use krasis_model::synth::SynthExperts;
use krasis_model::{ExpertF32, ExpertWeights, ModelError};
use std::path::Path;
use std::sync::Arc;

/// Per-position comparison of two logit sequences.
#[derive(Debug, Clone, Copy)]
struct Agreement {
    top1: f64,
    mean_kl: f64,
}

fn log_softmax(x: &[f32]) -> Vec<f64> {
    let m = x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
    let lse = x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln() + m;
    x.iter().map(|&v| v as f64 - lse).collect()
}

fn argmax(x: &[f32]) -> usize {
    x.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |(bi, bv), (i, &v)| {
            if v > bv { (i, v) } else { (bi, bv) }
        })
        .0
}

/// Top-1 agreement and mean KL(reference || candidate) over positions.
fn agreement(reference: &[Vec<f32>], candidate: &[Vec<f32>]) -> Agreement {
    let mut same = 0usize;
    let mut kl = 0f64;
    for (p, q) in reference.iter().zip(candidate) {
        same += (argmax(p) == argmax(q)) as usize;
        let (lp, lq) = (log_softmax(p), log_softmax(q));
        kl += lp
            .iter()
            .zip(&lq)
            .map(|(a, b)| a.exp() * (a - b))
            .sum::<f64>();
    }
    let n = reference.len() as f64;
    Agreement {
        top1: same as f64 / n,
        mean_kl: kl / n,
    }
}

fn tokens(vocab: usize, n: usize, seed: u64) -> Vec<u32> {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 33) % vocab as u64) as u32
        })
        .collect()
}

fn run(dir: &Path, experts: Arc<dyn ExpertWeights>, toks: &[u32]) -> Vec<Vec<f32>> {
    let opts = ReferenceOptions {
        context_length: Some(toks.len() + 1),
    };
    let mut engine = ReferenceEngine::with_experts(dir, opts, experts).unwrap();
    engine.stepwise_logits(toks).unwrap()
}

/// Deliberately wrong dequantizations, to show the bounds can fail.
struct Broken {
    inner: CacheExperts,
    scale: f32,
    swap_gate_up: bool,
}

impl ExpertWeights for Broken {
    fn describe(&self) -> String {
        "broken INT4".into()
    }
    fn expert_f32(&self, layer: usize, expert: usize) -> Result<ExpertF32, ModelError> {
        let mut w = self.inner.expert_f32(layer, expert)?;
        for v in w.gate.iter_mut().chain(&mut w.up).chain(&mut w.down) {
            *v *= self.scale;
        }
        if self.swap_gate_up {
            std::mem::swap(&mut w.gate, &mut w.up);
        }
        Ok(w)
    }
}

struct Case {
    dir: std::path::PathBuf,
    bf16: Vec<Vec<f32>>,
    int4: CacheExperts,
    toks: Vec<u32>,
}

fn case(tmp: &Path, preset: &str, overrides: &[(String, serde_json::Value)], n: usize) -> Case {
    let spec = spec(preset, 11, overrides);
    let vocab = spec.geometry().vocab_size;
    let dir = write_synth(tmp, preset, spec.clone(), true);
    let source = ModelSource::open(&dir).unwrap();
    let opts = BuildOptions {
        progress_bar: false,
        ..BuildOptions::default()
    };
    let cache = ensure_cache_at(&source, &tmp.join(format!("{preset}.kcache")), &opts)
        .unwrap()
        .cache;
    let toks = tokens(vocab, n, 5);
    let bf16 = run(&dir, Arc::new(SynthExperts::new(spec)), &toks);
    Case {
        dir,
        bf16,
        int4: CacheExperts::new(Arc::new(cache)),
        toks,
    }
}

impl Case {
    fn measure(&self, experts: Arc<dyn ExpertWeights>) -> Agreement {
        agreement(&self.bf16, &run(&self.dir, experts, &self.toks))
    }
    fn int4(&self) -> Agreement {
        self.measure(Arc::new(self.int4.clone()))
    }
    fn broken(&self, scale: f32, swap_gate_up: bool) -> Agreement {
        self.measure(Arc::new(Broken {
            inner: self.int4.clone(),
            scale,
            swap_gate_up,
        }))
    }
}

/// The acceptance bound for INT4 against BF16.
fn within_bounds(a: Agreement, min_top1: f64, max_kl: f64) -> bool {
    a.top1 >= min_top1 && a.mean_kl <= max_kl
}

#[test]
fn int4_tracks_bf16_on_tiny_and_medium_and_broken_variants_do_not() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, preset, overrides, n, min_top1, max_kl) in [
        ("tiny", "tiny", vec![], 32, 0.4, 0.4),
        ("medium", "tiny", medium_overrides(), 24, 0.8, 0.35),
    ] {
        let c = case(&tmp.path().join(name), preset, &overrides, n);
        let good = c.int4();
        let scaled = c.broken(1.1, false);
        let swapped = c.broken(1.0, true);
        eprintln!("{name}: int4 {good:?} | scale x1.1 {scaled:?} | gate/up swapped {swapped:?}");
        assert!(
            within_bounds(good, min_top1, max_kl),
            "{name}: INT4 {good:?}"
        );
        assert!(
            !within_bounds(scaled, min_top1, max_kl),
            "{name}: x1.1 scale passed: {scaled:?}"
        );
        assert!(
            !within_bounds(swapped, min_top1, max_kl),
            "{name}: swapped layout passed: {swapped:?}"
        );
    }
}

/// SwiGLU expert output `down(silu(gate x) * up x)`.
fn expert_forward(w: &ExpertF32, x: &[f32]) -> Vec<f32> {
    let h = x.len();
    let i = w.gate.len() / h;
    let dot = |row: &[f32]| row.iter().zip(x).map(|(a, b)| a * b).sum::<f32>();
    let act: Vec<f32> = (0..i)
        .map(|r| {
            let g = dot(&w.gate[r * h..(r + 1) * h]);
            let u = dot(&w.up[r * h..(r + 1) * h]);
            g / (1.0 + (-g).exp()) * u
        })
        .collect();
    (0..h)
        .map(|r| {
            w.down[r * i..(r + 1) * i]
                .iter()
                .zip(&act)
                .map(|(a, b)| a * b)
                .sum()
        })
        .collect()
}

fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum();
    (num / den).sqrt()
}

/// Without the routing chaos of a random model: each expert's output on a
/// random input, INT4 against BF16.
#[test]
fn expert_outputs_have_int4_sized_error() {
    let tmp = tempfile::tempdir().unwrap();
    let spec = spec("tiny", 2, &small_overrides());
    let dir = write_synth(tmp.path(), "m", spec.clone(), true);
    let source = ModelSource::open(&dir).unwrap();
    let opts = BuildOptions {
        progress_bar: false,
        ..BuildOptions::default()
    };
    let cache = ensure_cache_at(&source, &tmp.path().join("m.kcache"), &opts)
        .unwrap()
        .cache;
    let int4 = CacheExperts::new(Arc::new(cache));
    let broken = Broken {
        inner: int4.clone(),
        scale: 1.1,
        swap_gate_up: false,
    };
    let bf16 = SynthExperts::new(spec.clone());
    let h = spec.geometry().hidden;
    let x: Vec<f32> = tokens(1 << 20, h, 9)
        .iter()
        .map(|&t| (t as f32 / (1 << 20) as f32 - 0.5) * 3.46)
        .collect();
    let (mut worst, mut worst_broken_best) = (0f64, f64::MAX);
    for (layer, expert) in [(0, 0), (1, 3), (2, 7)] {
        let want = expert_forward(&bf16.expert_f32(layer, expert).unwrap(), &x);
        let got = expert_forward(&int4.expert_f32(layer, expert).unwrap(), &x);
        let bad = expert_forward(&broken.expert_f32(layer, expert).unwrap(), &x);
        worst = worst.max(rel_err(&want, &got));
        worst_broken_best = worst_broken_best.min(rel_err(&want, &bad));
    }
    eprintln!(
        "expert output relative error: INT4 worst {worst:.4}, x1.1 best {worst_broken_best:.4}"
    );
    // Symmetric g128 INT4 of near-Gaussian weights: per-matrix relative
    // error ~ (amax/7)/sqrt(12)/sigma ~ 0.11, three matrices in series ~ 0.2.
    assert!(worst < 0.26, "INT4 expert output error {worst}");
    // x1.1 on all three matrices scales the output by ~1.33.
    assert!(worst_broken_best > 0.3, "x1.1 error {worst_broken_best}");
}
