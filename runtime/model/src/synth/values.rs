//! Deterministic tensor values.
//!
//! Every element of a tensor is a pure function of (seed, tensor name,
//! element index): the tensor's key is `blake3(DOMAIN || seed_le || name)`,
//! which seeds a ChaCha8 stream, and element `i` uses stream words `2i` and
//! `2i+1`. Seeking to word `2i` makes any slice of any tensor reproducible on
//! its own, so the writer can split tensors into pieces generated in parallel,
//! and `expert_weights` can regenerate one expert without touching the rest.
//!
//! The 64 random bits of an element become an approximately standard normal
//! value as the sum of their four 16-bit quarters (Irwin–Hall, bounded at
//! ±3.46σ): far cheaper than Box–Muller, and bell-shaped enough that INT4
//! group scales see realistic (non-uniform) magnitude distributions.

use super::spec::SynthDtype;
use half::bf16;
use rand::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

const DOMAIN: &[u8] = b"krasis-synth/v1/tensor\0";

/// Standard deviation of the sum of four independent uniform u16 values.
const IRWIN_HALL_STD: f32 = 37837.23;
const IRWIN_HALL_MEAN: f32 = 131070.0;

/// How a tensor's values are drawn.
#[derive(Debug, Clone, PartialEq)]
pub enum Init {
    /// `std * n`, `n` ~ approximately N(0, 1).
    Normal { std: f32 },
    /// `1 + std * n`: RMSNorm weights near one with a little noise.
    NearOne { std: f32 },
    /// Router rows: `scales[row] * std * n` (see [`router_scales`]).
    Router { std: f32, scales: Vec<f32> },
}

/// The 32-byte ChaCha key of a tensor.
pub fn tensor_key(seed: u64, name: &str) -> [u8; 32] {
    let mut h = blake3::Hasher::new();
    h.update(DOMAIN);
    h.update(&seed.to_le_bytes());
    h.update(name.as_bytes());
    *h.finalize().as_bytes()
}

/// Approximately N(0, 1) from 64 random bits.
#[inline]
fn std_normal(bits: u64) -> f32 {
    const LO16: u64 = 0x0000_ffff_0000_ffff;
    let pairs = (bits & LO16) + ((bits >> 16) & LO16);
    let sum = (pairs & 0xffff_ffff) + (pairs >> 32);
    (sum as f32 - IRWIN_HALL_MEAN) * (1.0 / IRWIN_HALL_STD)
}

/// Writes elements `start..start + out.len()` of tensor `name` as f32 values
/// already rounded through `dtype` (exactly what the checkpoint stores).
/// `row_len` (elements per row) is only used by [`Init::Router`].
pub fn fill_f32(
    seed: u64,
    name: &str,
    init: &Init,
    dtype: SynthDtype,
    row_len: usize,
    start: usize,
    out: &mut [f32],
) {
    let mut rng = ChaCha8Rng::from_seed(tensor_key(seed, name));
    rng.set_word_pos(2 * start as u128);
    match init {
        &Init::Normal { std } => {
            for o in out.iter_mut() {
                *o = std * std_normal(rng.next_u64());
            }
        }
        &Init::NearOne { std } => {
            for o in out.iter_mut() {
                *o = 1.0 + std * std_normal(rng.next_u64());
            }
        }
        Init::Router { std, scales } => {
            for (i, o) in out.iter_mut().enumerate() {
                let row = (start + i) / row_len;
                *o = scales[row] * std * std_normal(rng.next_u64());
            }
        }
    }
    if dtype == SynthDtype::Bf16 {
        for o in out.iter_mut() {
            *o = bf16::from_f32(*o).to_f32();
        }
    }
}

/// Encodes f32 values (already representable in `dtype`) as little-endian
/// bytes of `dtype`, appending to `bytes`.
pub fn encode(values: &[f32], dtype: SynthDtype, bytes: &mut Vec<u8>) {
    match dtype {
        SynthDtype::Bf16 => {
            for v in values {
                bytes.extend_from_slice(&bf16::from_f32(*v).to_bits().to_le_bytes());
            }
        }
        SynthDtype::F32 => {
            for v in values {
                bytes.extend_from_slice(&v.to_le_bytes());
            }
        }
    }
}

/// Per-expert router row scales for skew `s >= 0`.
///
/// Each MoE layer ranks its experts by a seeded hash (rank 0 = hottest), and
/// row `e` of the router is multiplied by `c * (1 + rank_e)^(-s)`, with `c`
/// chosen so the scales have RMS 1 (so `s = 0` leaves every row unscaled).
/// A larger row norm widens that expert's logit distribution, so it lands in
/// the top-k more often: Zipf-like popularity with the hottest experts at
/// seeded, per-layer positions.
pub fn router_scales(seed: u64, router_name: &str, num_experts: usize, skew: f32) -> Vec<f32> {
    if skew == 0.0 || num_experts == 0 {
        return vec![1.0; num_experts];
    }
    let key = tensor_key(seed, &format!("{router_name}#expert-rank"));
    let mut order: Vec<(u64, usize)> = (0..num_experts)
        .map(|e| {
            let mut h = blake3::Hasher::new_keyed(&key);
            h.update(&(e as u64).to_le_bytes());
            let b = h.finalize();
            let tag = u64::from_le_bytes(b.as_bytes()[..8].try_into().expect("8 bytes"));
            (tag, e)
        })
        .collect();
    order.sort_unstable();
    let mut raw = vec![0f32; num_experts];
    for (rank, &(_, e)) in order.iter().enumerate() {
        raw[e] = ((1 + rank) as f64).powf(-(skew as f64)) as f32;
    }
    let mean_sq = raw.iter().map(|x| (*x as f64) * (*x as f64)).sum::<f64>() / num_experts as f64;
    let c = (1.0 / mean_sq.sqrt()) as f32;
    raw.iter().map(|x| x * c).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn std_normal_moments() {
        let mut rng = ChaCha8Rng::from_seed([7; 32]);
        let n = 200_000;
        let xs: Vec<f32> = (0..n).map(|_| std_normal(rng.next_u64())).collect();
        let mean = xs.iter().map(|x| *x as f64).sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (*x as f64 - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "var {var}");
        assert!(xs.iter().all(|x| x.abs() < 3.47));
    }

    #[test]
    fn slices_match_whole_tensor() {
        let init = Init::Normal { std: 0.5 };
        let mut whole = vec![0f32; 1000];
        fill_f32(3, "t", &init, SynthDtype::F32, 1, 0, &mut whole);
        let mut part = vec![0f32; 301];
        fill_f32(3, "t", &init, SynthDtype::F32, 1, 499, &mut part);
        assert_eq!(&whole[499..800], &part[..]);
        let mut other = vec![0f32; 1000];
        fill_f32(3, "u", &init, SynthDtype::F32, 1, 0, &mut other);
        assert_ne!(whole, other);
        fill_f32(4, "t", &init, SynthDtype::F32, 1, 0, &mut other);
        assert_ne!(whole, other);
    }

    #[test]
    fn bf16_values_are_representable() {
        let mut v = vec![0f32; 4096];
        fill_f32(
            1,
            "x",
            &Init::Normal { std: 0.03 },
            SynthDtype::Bf16,
            1,
            0,
            &mut v,
        );
        assert!(v.iter().all(|x| bf16::from_f32(*x).to_f32() == *x));
        let mut bytes = Vec::new();
        encode(&v, SynthDtype::Bf16, &mut bytes);
        assert_eq!(bytes.len(), 2 * v.len());
    }

    #[test]
    fn router_scales_are_zipf_like_with_unit_rms() {
        let s = router_scales(1, "r", 128, 1.0);
        let rms = (s.iter().map(|x| x * x).sum::<f32>() / 128.0).sqrt();
        assert!((rms - 1.0).abs() < 1e-4, "{rms}");
        let mut sorted = s.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        assert!((sorted[0] / sorted[1] - 2.0).abs() < 1e-4);
        assert!((sorted[0] / sorted[127] - 128.0).abs() < 1e-2);
        // Hottest expert is placed by hash, and differs between layers.
        let t = router_scales(1, "r2", 128, 1.0);
        assert_ne!(s, t);
        assert_eq!(router_scales(1, "r", 16, 0.0), vec![1.0; 16]);
    }
}
