//! The statistics of one bench figure, used by every figure `bench` reports
//! (prefill per prompt length, decode per length and graph mode, the
//! all-resident baseline).
//!
//! Why a type of its own: the old figure was `v[len / 2]` of the sorted
//! runs, which for an even count is the *upper* middle value, so with two
//! repeats it reported the faster run (e.g. 52,725 of 28,269 and 52,725).
//! Here the median is the mean of the two middle values for even counts,
//! min and max are reported beside it so spread is visible, one warm-up run
//! of the very same measurement is made first and reported separately but
//! never counted, and fewer than [`MIN_RUNS`] timed runs are refused.

use serde::{Deserialize, Serialize};

/// Fewest timed runs `bench` accepts (`--repeats`).
pub const MIN_RUNS: usize = 3;

/// One figure: the warm-up run (not counted), every timed run, and
/// min / median / max of the timed runs, in tok/s.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunStats {
    /// The warm-up run of the same measurement, made first; never counted.
    pub warmup_tok_s: f64,
    /// Every timed run, in the order they ran.
    pub runs_tok_s: Vec<f64>,
    pub min_tok_s: f64,
    /// Middle value; the mean of the two middle values for even counts.
    pub median_tok_s: f64,
    pub max_tok_s: f64,
}

/// Refuses a `--repeats` that cannot give min, median and max.
pub fn check_repeats(repeats: usize) -> anyhow::Result<()> {
    anyhow::ensure!(
        repeats >= MIN_RUNS,
        "at least {MIN_RUNS} timed runs are needed for min/median/max; --repeats {repeats} is too few \
         (each figure also gets one warm-up run that is reported but not counted)"
    );
    Ok(())
}

/// Median of `v` (any order): the middle value, or the mean of the two
/// middle values when the count is even; NaN for no values.
pub fn median(v: &[f64]) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => s[n / 2],
        _ => (s[n / 2 - 1] + s[n / 2]) / 2.0,
    }
}

impl RunStats {
    /// Statistics of the timed `runs` (non-empty); `warmup` is kept apart.
    pub fn new(warmup_tok_s: f64, runs_tok_s: Vec<f64>) -> Self {
        assert!(!runs_tok_s.is_empty(), "a figure needs at least one run");
        let min_tok_s = runs_tok_s.iter().copied().fold(f64::INFINITY, f64::min);
        let max_tok_s = runs_tok_s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        RunStats {
            warmup_tok_s,
            median_tok_s: median(&runs_tok_s),
            min_tok_s,
            max_tok_s,
            runs_tok_s,
        }
    }

    /// One warm-up call of `run`, then `repeats` timed calls, each giving
    /// one tok/s figure.
    pub fn measure(
        repeats: usize,
        mut run: impl FnMut() -> anyhow::Result<f64>,
    ) -> anyhow::Result<Self> {
        check_repeats(repeats)?;
        let warmup = run()?;
        let runs = (0..repeats).map(|_| run()).collect::<anyhow::Result<_>>()?;
        Ok(Self::new(warmup, runs))
    }

    /// `52,725 (min 51,900, max 53,100)` with `decimals` decimals.
    pub fn display(&self, decimals: usize) -> String {
        format!(
            "{} (min {}, max {})",
            grouped(self.median_tok_s, decimals),
            grouped(self.min_tok_s, decimals),
            grouped(self.max_tok_s, decimals)
        )
    }
}

/// `x` with `decimals` decimals and thousands separated by commas.
pub fn grouped(x: f64, decimals: usize) -> String {
    if !x.is_finite() {
        return format!("{x}");
    }
    let s = format!("{:.*}", decimals, x.abs());
    let (int, frac) = s.split_once('.').map_or((s.as_str(), ""), |(i, f)| (i, f));
    let mut out = String::new();
    for (i, c) in int.chars().enumerate() {
        if i > 0 && (int.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if !frac.is_empty() {
        out.push('.');
        out.push_str(frac);
    }
    if x < 0.0 && out.chars().any(|c| c.is_ascii_digit() && c != '0') {
        out.insert(0, '-');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn even_count_median_is_the_mean_of_the_middle_two() {
        // The old `v[len / 2]` gave 52,725 here: the faster of the two runs.
        assert_eq!(median(&[28269.0, 52725.0]), 40497.0);
        assert_eq!(median(&[52725.0, 28269.0]), 40497.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
    }

    #[test]
    fn odd_count_median_is_the_middle_value() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[10.0, 50.0, 20.0, 40.0, 30.0]), 30.0);
        assert_eq!(median(&[7.0]), 7.0);
        assert!(median(&[]).is_nan());
    }

    #[test]
    fn warm_up_is_reported_but_not_counted() {
        // A slow first run (module loads, cuBLAS heuristics, HCS residency)
        // followed by the timed runs.
        let mut seq = [100.0, 510.0, 530.0, 520.0].into_iter();
        let s = RunStats::measure(3, || Ok(seq.next().unwrap())).unwrap();
        assert!(seq.next().is_none(), "one warm-up + 3 timed runs");
        assert_eq!(s.warmup_tok_s, 100.0);
        assert_eq!(s.runs_tok_s, vec![510.0, 530.0, 520.0]);
        assert_eq!(
            (s.min_tok_s, s.median_tok_s, s.max_tok_s),
            (510.0, 520.0, 530.0)
        );
        // A fast warm-up does not count either.
        let mut seq = [900.0, 10.0, 20.0, 30.0, 40.0].into_iter();
        let s = RunStats::measure(4, || Ok(seq.next().unwrap())).unwrap();
        assert_eq!((s.max_tok_s, s.median_tok_s), (40.0, 25.0));
    }

    #[test]
    fn fewer_than_three_repeats_are_refused() {
        for n in [0, 1, 2] {
            let e = RunStats::measure(n, || Ok(1.0)).unwrap_err().to_string();
            assert!(
                e.starts_with("at least 3 timed runs are needed for min/median/max;"),
                "{e}"
            );
        }
        assert!(check_repeats(3).is_ok());
    }

    #[test]
    fn json_keeps_every_run_and_the_summary() {
        let s = RunStats::new(1.0, vec![3.0, 2.0, 4.0]);
        let v = serde_json::to_value(&s).unwrap();
        assert_eq!(
            v,
            serde_json::json!({
                "warmup_tok_s": 1.0, "runs_tok_s": [3.0, 2.0, 4.0],
                "min_tok_s": 2.0, "median_tok_s": 3.0, "max_tok_s": 4.0
            })
        );
    }

    #[test]
    fn display_groups_thousands() {
        let s = RunStats::new(0.0, vec![51900.0, 52725.0, 53100.0]);
        assert_eq!(s.display(0), "52,725 (min 51,900, max 53,100)");
        let d = RunStats::new(0.0, vec![598.04, 599.4, 600.12]);
        assert_eq!(d.display(1), "599.4 (min 598.0, max 600.1)");
        assert_eq!(grouped(1234567.891, 2), "1,234,567.89");
        assert_eq!(grouped(-1234.0, 0), "-1,234");
        assert_eq!(grouped(999.0, 0), "999");
        assert_eq!(grouped(-0.01, 1), "0.0");
    }
}
