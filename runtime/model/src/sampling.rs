//! Token sampling from logits.
//!
//! The steps run in this order, each on the output of the previous one:
//!
//! 0. a grammar's mask, when the request has one: every token it does not
//!    allow gets `-inf`, so no later step can bring it back;
//! 1. penalties: OpenAI semantics over the tokens generated so far
//!    (`logit -= presence_penalty` once per distinct token,
//!    `logit -= frequency_penalty * count`); the prompt is not penalised;
//! 2. greedy when `temperature == 0`: the arg-max of the penalised logits,
//!    lowest token id on ties (the remaining steps are skipped);
//! 3. temperature: `logit / temperature`;
//! 4. top-k: keep the `k` largest logits (ties: lower ids first);
//! 5. top-p: softmax over the survivors, keep the smallest highest-probability
//!    prefix whose mass reaches `top_p` (at least one token);
//! 6. min-p: drop tokens whose probability is below `min_p` times the largest;
//! 7. sample from the renormalised remaining probabilities.
//!
//! With a `seed` the RNG is a ChaCha stream seeded from it, so a request
//! replays exactly; without one it is seeded from the OS.

use crate::engine::SamplingParams;
use crate::structured::TokenMask;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use std::collections::HashMap;

pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha20Rng,
    /// Occurrences of each generated token (for the penalties).
    counts: HashMap<u32, u32>,
}

impl Sampler {
    pub fn new(params: &SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => ChaCha20Rng::seed_from_u64(s),
            None => ChaCha20Rng::from_os_rng(),
        };
        Sampler {
            params: params.clone(),
            rng,
            counts: HashMap::new(),
        }
    }

    /// Records a generated token so later steps are penalised for it.
    pub fn observe(&mut self, token: u32) {
        *self.counts.entry(token).or_insert(0) += 1;
    }

    /// Picks the next token from `logits` (one per vocabulary entry) and
    /// records it. `logits` must not be empty.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        assert!(!logits.is_empty(), "sample: empty logits");
        let token = self.pick(logits);
        self.observe(token);
        token
    }

    /// [`Sampler::sample`] among the tokens `mask` allows (all of them
    /// when `None`); the mask must allow at least one.
    pub fn sample_masked(&mut self, logits: &[f32], mask: Option<&TokenMask>) -> u32 {
        let Some(mask) = mask else {
            return self.sample(logits);
        };
        let masked: Vec<f32> = logits
            .iter()
            .enumerate()
            .map(|(t, &l)| match mask.is_allowed(t as u32) {
                true => l,
                false => f32::NEG_INFINITY,
            })
            .collect();
        self.sample(&masked)
    }

    fn pick(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        let penalised;
        let logits = if self.counts.is_empty()
            || (p.presence_penalty == 0.0 && p.frequency_penalty == 0.0)
        {
            logits
        } else {
            let mut l = logits.to_vec();
            for (&t, &c) in &self.counts {
                if let Some(v) = l.get_mut(t as usize) {
                    *v -= p.presence_penalty + p.frequency_penalty * c as f32;
                }
            }
            penalised = l;
            &penalised
        };
        if p.is_greedy() {
            return argmax(logits);
        }
        let mut cands: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, l / p.temperature))
            .collect();
        let desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < cands.len() {
            cands.select_nth_unstable_by(p.top_k - 1, desc);
            cands.truncate(p.top_k);
        }
        let max = cands.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
        let mut probs: Vec<(u32, f64)> = cands
            .iter()
            .map(|&(t, l)| (t, f64::from(l - max).exp()))
            .collect();
        normalise(&mut probs);
        if p.top_p < 1.0 {
            probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let mut mass = 0.0;
            let mut keep = probs.len();
            for (i, &(_, q)) in probs.iter().enumerate() {
                mass += q;
                if mass >= f64::from(p.top_p) {
                    keep = i + 1;
                    break;
                }
            }
            probs.truncate(keep.max(1));
            normalise(&mut probs);
        }
        if p.min_p > 0.0 {
            let top = probs.iter().map(|c| c.1).fold(0.0, f64::max);
            let floor = f64::from(p.min_p) * top;
            probs.retain(|c| c.1 >= floor);
            normalise(&mut probs);
        }
        let r: f64 = self.rng.random::<f64>();
        let mut acc = 0.0;
        for &(t, q) in &probs {
            acc += q;
            if r < acc {
                return t;
            }
        }
        // Rounding can leave the cumulative sum a hair below r.
        probs.last().map(|c| c.0).unwrap_or_else(|| argmax(logits))
    }
}

/// Index of the largest logit, lowest index on ties. NaN never wins.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] || logits[best].is_nan() && !v.is_nan() {
            best = i;
        }
    }
    best as u32
}

fn normalise(p: &mut [(u32, f64)]) {
    let sum: f64 = p.iter().map(|c| c.1).sum();
    if sum > 0.0 {
        for c in p.iter_mut() {
            c.1 /= sum;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            seed: Some(seed),
            ..SamplingParams::default()
        }
    }

    fn logits() -> Vec<f32> {
        vec![0.1, 2.0, -1.0, 1.9, 0.5, 2.0, -3.0]
    }

    #[test]
    fn greedy_takes_argmax_lowest_id_on_ties() {
        let mut s = Sampler::new(&SamplingParams::greedy());
        assert_eq!(s.sample(&logits()), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0, 1.0]), 1);
    }

    #[test]
    fn seeded_sampling_is_deterministic() {
        let run = |seed| {
            let mut s = Sampler::new(&params(1.0, seed));
            (0..50).map(|_| s.sample(&logits())).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(
            run(7),
            run(8),
            "different seeds should give different streams"
        );
    }

    #[test]
    fn top_k_one_equals_greedy() {
        let mut p = params(1.5, 3);
        p.top_k = 1;
        let mut s = Sampler::new(&p);
        for _ in 0..20 {
            assert_eq!(s.sample(&logits()), 1);
        }
    }

    #[test]
    fn tiny_top_p_keeps_only_the_max() {
        let mut p = params(1.0, 4);
        p.top_p = 1e-6;
        let mut s = Sampler::new(&p);
        let l = vec![0.0, 3.0, 2.9, 1.0];
        for _ in 0..20 {
            assert_eq!(s.sample(&l), 1);
        }
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        // Probabilities [0.5, 0.3, 0.15, 0.05]; min_p 0.2 keeps p >= 0.1.
        let l: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|v| v.ln()).collect();
        let mut p = params(1.0, 5);
        p.min_p = 0.2;
        let mut s = Sampler::new(&p);
        let mut seen = [0usize; 4];
        for _ in 0..3000 {
            seen[s.sample(&l) as usize] += 1;
        }
        assert_eq!(seen[3], 0, "token below min-p was sampled: {seen:?}");
        assert!(seen[0] > 0 && seen[1] > 0 && seen[2] > 0, "{seen:?}");
    }

    #[test]
    fn frequencies_follow_the_distribution() {
        let l: Vec<f32> = [0.5f32, 0.3, 0.2].iter().map(|v| v.ln()).collect();
        let mut s = Sampler::new(&params(1.0, 11));
        let n = 20_000;
        let mut seen = [0usize; 3];
        for _ in 0..n {
            // Penalties are off, so observing tokens must not matter.
            seen[s.sample(&l) as usize] += 1;
        }
        for (i, want) in [0.5, 0.3, 0.2].iter().enumerate() {
            let got = seen[i] as f64 / n as f64;
            assert!((got - want).abs() < 0.015, "token {i}: {got} vs {want}");
        }
    }

    #[test]
    fn temperature_sharpens() {
        let l: Vec<f32> = [0.6f32, 0.4].iter().map(|v| v.ln()).collect();
        let mut s = Sampler::new(&params(0.1, 12));
        let zeros = (0..2000).filter(|_| s.sample(&l) == 0).count();
        // (0.6/0.4)^10 = 57.7, so p(0) = 0.983.
        assert!(zeros > 1900, "{zeros}");
    }

    #[test]
    fn a_mask_leaves_only_its_tokens() {
        // Token 1 is the arg-max; the mask allows 2 and 4 only.
        let mut words = TokenMask::only(7, 2);
        words = TokenMask::union(&words, &TokenMask::only(7, 4));
        let mut g = Sampler::new(&SamplingParams::greedy());
        assert_eq!(g.sample_masked(&logits(), Some(&words)), 4);
        let mut p = params(5.0, 9);
        p.frequency_penalty = 10.0;
        let mut s = Sampler::new(&p);
        for _ in 0..200 {
            let t = s.sample_masked(&logits(), Some(&words));
            assert!(t == 2 || t == 4, "{t}");
        }
        assert_eq!(g.sample_masked(&logits(), None), 1);
    }

    #[test]
    fn penalties_apply_to_generated_tokens() {
        let mut p = SamplingParams::greedy();
        p.presence_penalty = 0.5;
        p.frequency_penalty = 0.2;
        let mut s = Sampler::new(&p);
        let l = vec![1.0, 0.9, 0.0];
        // First pick: 0. Then 0 has 1.0 - 0.7 = 0.3 < 0.9 -> 1. Then 1 has
        // 0.2; 0 still 0.3 -> 0; then 0 has 1.0 - 0.5 - 0.4 = 0.1 < 0.2 -> 1.
        let picks: Vec<u32> = (0..4).map(|_| s.sample(&l)).collect();
        assert_eq!(picks, [0, 1, 0, 1]);
    }
}
