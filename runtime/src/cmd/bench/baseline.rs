//! The all-resident figures the constrained (HCS) bounds are measured
//! against: measured in the same run (`--baseline`), or read back from an
//! earlier run's JSON (`--baseline-from`), since they do not depend on the
//! VRAM limit and a large model's all-resident load is the slow part of a
//! sweep over limits.

use super::Args;
use super::speed::{geometry_line, greedy, measure, model_name};
use super::stats::RunStats;
use anyhow::Context;
use krasis_gpu::{CudaEngine, CudaEngineOptions};
use krasis_model::GenerateStats;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Baseline {
    /// The model and geometry they were measured on (checked on reuse).
    pub model: String,
    pub geometry: String,
    /// Prompt length of the decode figures.
    pub decode_prompt_tokens: usize,
    /// Their sampling temperature (0: greedy; absent in JSON written
    /// before `--decode-temperature`, which decoded greedily).
    #[serde(default)]
    pub decode_temperature: f32,
    /// Median tok/s per prompt length (what the bounds and
    /// `--baseline-from` use).
    pub prefill_tok_s: BTreeMap<usize, f64>,
    /// Median tok/s per decode length.
    pub decode_tok_s: BTreeMap<usize, f64>,
    /// Warm-up, every run and min/median/max per prompt length (absent in
    /// JSON written before they were recorded).
    #[serde(default)]
    pub prefill_stats: BTreeMap<usize, RunStats>,
    #[serde(default)]
    pub decode_stats: BTreeMap<usize, RunStats>,
}

/// Loads the model with every expert resident and measures the requested
/// lengths (one warm-up run, then `repeats` timed runs each; the median is
/// the figure).
pub fn measure_all_resident(
    a: &Args,
    opts: &CudaEngineOptions,
    all: &[u32],
) -> anyhow::Result<Baseline> {
    let mut e = CudaEngine::load(
        &a.model,
        &CudaEngineOptions {
            vram_limit: None,
            hcs: false,
            ..opts.clone()
        },
    )
    .with_context(|| format!("loading {} all-resident (baseline)", a.model.display()))?;
    greedy(&mut e, &all[..64.min(all.len())], 8)?;
    let mut b = Baseline {
        model: model_name(&a.model),
        geometry: geometry_line(e.geometry()),
        decode_prompt_tokens: a.decode_prompt_tokens,
        decode_temperature: a.decode_temperature,
        ..Baseline::default()
    };
    for &p in &a.prompt_tokens {
        let (stats, _) = measure(
            &mut e,
            &all[..p],
            0.0,
            1,
            a.repeats,
            GenerateStats::prefill_tok_s,
        )?;
        eprintln!("baseline prefill {p:>6} tokens: {} tok/s", stats.display(0));
        b.prefill_tok_s.insert(p, stats.median_tok_s);
        b.prefill_stats.insert(p, stats);
    }
    let prompt = &all[..a.decode_prompt_tokens];
    for &d in &a.decode_tokens {
        let (stats, _) = measure(
            &mut e,
            prompt,
            a.decode_temperature,
            d + 1,
            a.repeats,
            GenerateStats::decode_tok_s,
        )?;
        eprintln!("baseline decode {d:>4} tokens: {} tok/s", stats.display(1));
        b.decode_tok_s.insert(d, stats.median_tok_s);
        b.decode_stats.insert(d, stats);
    }
    Ok(b)
}

/// The `baseline` section of an earlier bench JSON, refused unless it was
/// measured on the same model, geometry and decode prompt length and covers
/// every requested length.
pub fn read(path: &std::path::Path, geometry: &str, a: &Args) -> anyhow::Result<Baseline> {
    #[derive(Deserialize)]
    struct Earlier {
        baseline: Option<Baseline>,
    }
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading --baseline-from {}", path.display()))?;
    let earlier: Earlier = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a bench JSON report", path.display()))?;
    let b = earlier.baseline.with_context(|| {
        format!(
            "{} has no all-resident baseline; make one with `bench --vram-limit SIZE --baseline --json FILE`",
            path.display()
        )
    })?;
    let model = model_name(&a.model);
    anyhow::ensure!(
        b.model == model && b.geometry == geometry,
        "the baseline in {} was measured on {} ({}), not on {model} ({geometry})",
        path.display(),
        b.model,
        b.geometry
    );
    anyhow::ensure!(
        b.decode_prompt_tokens == a.decode_prompt_tokens,
        "the baseline in {} decoded after {} prompt tokens, this run after {}",
        path.display(),
        b.decode_prompt_tokens,
        a.decode_prompt_tokens
    );
    anyhow::ensure!(
        b.decode_temperature == a.decode_temperature,
        "the baseline in {} decoded at temperature {}, this run at {}",
        path.display(),
        b.decode_temperature,
        a.decode_temperature
    );
    let missing = |have: &BTreeMap<usize, f64>, want: &[usize]| {
        want.iter()
            .filter(|n| !have.contains_key(n))
            .map(|n| n.to_string())
            .collect::<Vec<_>>()
    };
    let (mp, md) = (
        missing(&b.prefill_tok_s, &a.prompt_tokens),
        missing(&b.decode_tok_s, &a.decode_tokens),
    );
    anyhow::ensure!(
        mp.is_empty() && md.is_empty(),
        "the baseline in {} lacks prompt lengths [{}] / decode lengths [{}]; measure them with --baseline",
        path.display(),
        mp.join(","),
        md.join(",")
    );
    Ok(b)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(extra: &[&str]) -> Args {
        crate::cmd::bench::tests::parse(extra).expect("bench arguments")
    }

    fn write(b: &Baseline) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        let report = serde_json::json!({ "identity": {}, "baseline": b });
        std::fs::write(f.path(), report.to_string()).unwrap();
        f
    }

    fn sample() -> Baseline {
        Baseline {
            model: "qcn".into(),
            geometry: "48 layers".into(),
            decode_prompt_tokens: 32,
            prefill_tok_s: BTreeMap::from([(1000, 1.0), (8000, 2.0), (32000, 3.0)]),
            decode_tok_s: BTreeMap::from([(50, 4.0), (100, 5.0), (250, 6.0)]),
            ..Baseline::default()
        }
    }

    #[test]
    fn a_matching_baseline_is_reused() {
        let f = write(&sample());
        let b = read(f.path(), "48 layers", &args(&["--prompt-tokens", "8000"])).unwrap();
        assert_eq!(b.prefill_tok_s[&8000], 2.0);
    }

    #[test]
    fn a_baseline_written_before_run_statistics_is_still_read() {
        let f = tempfile::NamedTempFile::new().unwrap();
        let old = r#"{"identity": {}, "baseline": {"model": "qcn", "geometry": "48 layers",
            "decode_prompt_tokens": 32, "prefill_tok_s": {"1000": 1.0, "8000": 2.0, "32000": 3.0},
            "decode_tok_s": {"50": 4.0, "100": 5.0, "250": 6.0}}}"#;
        std::fs::write(f.path(), old).unwrap();
        let b = read(f.path(), "48 layers", &args(&[])).unwrap();
        assert_eq!(b.decode_tok_s[&100], 5.0);
        assert!(b.prefill_stats.is_empty());
        // And the statistics round-trip when present.
        let mut s = sample();
        s.prefill_stats
            .insert(1000, RunStats::new(0.5, vec![1.0, 0.9, 1.1]));
        let f = write(&s);
        let b = read(f.path(), "48 layers", &args(&[])).unwrap();
        assert_eq!(b.prefill_stats[&1000].median_tok_s, 1.0);
        assert_eq!(b.prefill_stats[&1000].warmup_tok_s, 0.5);
    }

    #[test]
    fn another_model_geometry_prompt_or_missing_lengths_are_refused() {
        let f = write(&sample());
        let e = read(f.path(), "24 layers", &args(&[])).unwrap_err();
        assert!(e.to_string().contains("not on qcn (24 layers)"), "{e}");
        let e = read(
            f.path(),
            "48 layers",
            &args(&["--decode-prompt-tokens", "64"]),
        )
        .unwrap_err();
        assert!(e.to_string().contains("after 32 prompt tokens"), "{e}");
        let e = read(f.path(), "48 layers", &args(&["--decode-tokens", "50,500"])).unwrap_err();
        assert!(e.to_string().contains("decode lengths [500]"), "{e}");
        let empty = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(empty.path(), r#"{"identity": {}}"#).unwrap();
        let e = read(empty.path(), "48 layers", &args(&[])).unwrap_err();
        assert!(
            e.to_string().contains("has no all-resident baseline"),
            "{e}"
        );
    }
}
