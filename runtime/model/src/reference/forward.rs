//! The forward pass over a batch of consecutive positions (a prompt chunk
//! or one decode token), wired from the layer plan: per layer the shared
//! attention component (optional q/k norm, biases, sinks, sliding window,
//! the model's RoPE) and the layer's mixer (dense gated MLP, or router +
//! routed experts with the family's router kind and activation).

use super::kv::KvCache;
use super::trace::{attention_peaks, rms_rows};
use super::weights::{LayerWeights, MlpWeights};
use super::{Activations, ReferenceEngine};
use crate::engine::EngineError;
use crate::layers::attention::{AttnShape, attention};
use crate::layers::linear::{PARALLEL_MIN_MACS, add_bias_rows, matmul};
use crate::layers::mlp::{SwigluWeights, activate, swiglu};
use crate::layers::norm::rms_norm_rows;
use crate::layers::router::{decision_gap, route_selected, route_with};
use rayon::prelude::*;
use std::borrow::Cow;

impl ReferenceEngine {
    /// Runs `tokens` at positions `start..start + n` through every layer,
    /// appending their keys and values to `kv` (one sequence's cache, which
    /// holds its positions `0..start`), and returns the final normed hidden
    /// states `[n, H]`. Callers check bounds and token ids. Nothing here
    /// depends on another sequence: a row's result is the same whatever
    /// else the engine runs (batch invariance).
    pub(super) fn forward(
        &mut self,
        kv: &mut KvCache,
        tokens: &[u32],
        start: usize,
    ) -> Result<Vec<f32>, EngineError> {
        let h = self.geometry.hidden;
        let mut x = Vec::with_capacity(tokens.len() * h);
        for &t in tokens {
            x.extend_from_slice(&self.weights.embed[t as usize * h..][..h]);
        }
        for layer in 0..self.geometry.num_layers {
            if let Some(tr) = self.trace.as_mut() {
                tr.layer_input_rms[layer].extend(rms_rows(&x, h));
            }
            self.attention_block(kv, layer, &mut x, start);
            self.capture(2 * layer, &x);
            if let Some(tr) = self.trace.as_mut() {
                tr.mlp_input_rms[layer].extend(rms_rows(&x, h));
            }
            let routing = self.mlp_block(layer, &mut x, start)?;
            self.capture(2 * layer + 1, &x);
            if let (Some(tr), Some((l, ran))) = (self.trace.as_mut(), routing) {
                let g = &self.geometry;
                let selection = match &self.weights.layers[layer].mlp {
                    MlpWeights::Moe { selection_bias, .. } => selection_bias.as_deref(),
                    MlpWeights::Dense { .. } => None,
                };
                #[cfg(any(test, feature = "fault-injection"))]
                let selection =
                    selection.filter(|_| self.fault != super::Fault::IgnoreSelectionBias);
                let router = (g.router.kind, selection);
                tr.record_router(layer, &l, Some(&ran), (g.num_experts, g.top_k), router);
            }
        }
        if let Some(tr) = self.trace.as_mut() {
            tr.final_rms.extend(rms_rows(&x, h));
        }
        self.norm_rows(&mut x, &self.weights.final_norm, self.geometry.rms_norm_eps);
        self.round_if(self.rounding.final_norm, &mut x);
        self.capture(2 * self.geometry.num_layers, &x);
        Ok(x)
    }

    /// Appends `x` to capture point `at` while residuals are captured.
    fn capture(&mut self, at: usize, x: &[f32]) {
        if let Some(r) = self.residuals.as_mut() {
            r[at].extend_from_slice(x);
        }
    }

    /// RMSNorm of rows (`w.len()` wide). In BF16 mode as the CUDA kernels
    /// (`cuda/norm.cu`, the q/k norm of `cuda/rope.cu`) compute it: the sum
    /// of squares in f32 (the oracle sums in f64) and `1 / sqrt(ss / n + eps)`
    /// in f32 (the kernels' `rsqrtf` is within 2 ulp of it). Measured on the
    /// H200 reports, this moves the emulation's router near-tie flips onto
    /// the GPU's (`examples/emulation_vs_gpu_routes.rs`).
    fn norm_rows(&self, x: &mut [f32], w: &[f32], eps: f32) {
        if self.activations == Activations::F32 || !self.rounding.norm_f32 {
            return rms_norm_rows(x, w, eps);
        }
        for row in x.chunks_exact_mut(w.len()) {
            let ss: f32 = row.iter().map(|v| v * v).sum();
            let inv = 1.0 / (ss / w.len() as f32 + eps).sqrt();
            for (v, &wv) in row.iter_mut().zip(w) {
                *v = *v * inv * wv;
            }
        }
    }

    /// [`Self::round`] where the rounding point is `on` ([`super::Rounding`]).
    fn round_if(&self, on: bool, v: &mut [f32]) {
        if on {
            self.round(v);
        }
    }

    /// `v` stored in `format` when emulating the CUDA engine's activations
    /// ([`super::Rounding`]); nothing in f32 mode.
    fn round_as(&self, format: super::Format, v: &mut [f32]) {
        if self.activations == Activations::Bf16 {
            for x in v {
                *x = format.round(*x);
            }
        }
    }

    /// Rounds `v` to BF16 when emulating the CUDA engine's activations
    /// (see [`Activations`]); nothing in f32 mode.
    fn round(&self, v: &mut [f32]) {
        if self.activations == Activations::Bf16 {
            for x in v {
                *x = half::bf16::from_f32(*x).to_f32();
            }
        }
    }

    /// A router, dense-MLP or shared-expert weight as the engine stores it
    /// ([`super::Rounding::mlp_weights`]): converted to FP16 where the
    /// model's MLP block is FP16 (a copy only where that changes a value:
    /// those below FP16's normal range), else as loaded.
    pub(super) fn mlp_weight<'w>(&self, w: &'w [f32]) -> Cow<'w, [f32]> {
        let f = self.rounding.mlp_weights;
        if self.activations == Activations::F32
            || f != super::Format::F16
            || w.iter().all(|&x| f.round(x) == x)
        {
            return Cow::Borrowed(w);
        }
        Cow::Owned(w.iter().map(|&x| f.round(x)).collect())
    }

    /// SwiGLU of a dense MLP or routed expert. In BF16 mode the gate/up
    /// GEMM outputs and the activation product are rounded to the MLP
    /// block's format, as the CUDA prefill path stores them; biases (gpt_oss experts) are added in f32
    /// after that rounding and before the activation, and the down bias to
    /// the f32 down output (`bias_act_rows_bf16`, `ExpertFfn::down_bias`).
    fn swiglu(&self, w: SwigluWeights<'_>, x: &[f32]) -> Vec<f32> {
        if self.activations == Activations::F32 {
            return swiglu(w, x);
        }
        let (h, i) = (w.hidden, w.intermediate);
        let n = x.len() / h;
        let (mut g, mut u) = (vec![0f32; n * i], vec![0f32; n * i]);
        matmul(w.gate, i, h, x, &mut g);
        matmul(w.up, i, h, x, &mut u);
        self.round_as(self.rounding.gate_up, &mut g);
        self.round_as(self.rounding.gate_up, &mut u);
        if let Some(b) = w.bias {
            add_bias_rows(&mut g, &b.gate);
            add_bias_rows(&mut u, &b.up);
        }
        for (gv, uv) in g.iter_mut().zip(&u) {
            *gv = activate(w.activation, *gv, *uv);
        }
        self.round_as(self.rounding.act, &mut g);
        let mut out = vec![0f32; n * h];
        matmul(w.down, h, i, &g, &mut out);
        if let Some(b) = w.bias {
            add_bias_rows(&mut out, &b.down);
        }
        out
    }

    /// LM head over normed hidden rows `[m, H]`: logits `[m, vocab]`.
    pub(super) fn logits(&self, hidden: &[f32]) -> Vec<f32> {
        let (h, v) = (self.geometry.hidden, self.geometry.vocab_size);
        let mut out = vec![0f32; hidden.len() / h * v];
        matmul(self.weights.lm_head(), v, h, hidden, &mut out);
        out
    }

    /// RoPE of the heads in `x` at `pos`.
    fn rotate(&self, x: &mut [f32], pos: usize) {
        #[cfg(any(test, feature = "fault-injection"))]
        if self.fault == super::Fault::RopeSign {
            return super::fault::rotate_backwards(&self.rope, x, pos);
        }
        self.rope.apply(x, pos);
    }

    /// `x += o_proj(attention(rope(norm(q)), rope(norm(k)), v))` of `norm(x)`.
    fn attention_block(&mut self, kv: &mut KvCache, layer: usize, x: &mut [f32], start: usize) {
        let g = &self.geometry;
        let shape = AttnShape {
            num_heads: g.num_heads,
            num_kv_heads: g.num_kv_heads,
            head_dim: g.head_dim,
        };
        let (h, qd, kvd, eps) = (g.hidden, shape.q_dim(), shape.kv_dim(), g.rms_norm_eps);
        let n = x.len() / h;
        let lw: &LayerWeights = &self.weights.layers[layer];
        let a = &lw.attn;
        let kind = g.layers[layer].attention;
        #[cfg(any(test, feature = "fault-injection"))]
        let kind = match self.fault {
            super::Fault::FullWindow => crate::arch::AttentionKind::Full,
            _ => kind,
        };
        let mut xn = x.to_vec();
        self.norm_rows(&mut xn, &lw.input_norm, eps);
        self.round_as(self.rounding.attn_in, &mut xn);
        let (mut q, mut k, mut v) = (vec![0f32; n * qd], vec![0f32; n * kvd], vec![0f32; n * kvd]);
        matmul(&a.q, qd, h, &xn, &mut q);
        matmul(&a.k, kvd, h, &xn, &mut k);
        matmul(&a.v, kvd, h, &xn, &mut v);
        if let Some([qb, kb, vb]) = &a.qkv_bias {
            add_bias_rows(&mut q, qb);
            add_bias_rows(&mut k, kb);
            add_bias_rows(&mut v, vb);
        }
        let r = self.rounding;
        for (f, y) in [(r.q, &mut q), (r.k, &mut k), (r.v, &mut v)] {
            self.round_as(f, y);
        }
        #[cfg(any(test, feature = "fault-injection"))]
        if self.fault == super::Fault::SwapGqa {
            super::fault::swap_kv_heads(&mut k, shape);
            super::fault::swap_kv_heads(&mut v, shape);
        }
        if let Some([qn, kn]) = &a.qk_norm {
            self.norm_rows(&mut q, qn, eps);
            self.norm_rows(&mut k, kn, eps);
        }
        for t in 0..n {
            self.rotate(&mut q[t * qd..(t + 1) * qd], start + t);
            self.rotate(&mut k[t * kvd..(t + 1) * kvd], start + t);
        }
        self.round_as(r.q, &mut q);
        self.round_as(r.k, &mut k);
        kv.write(layer, start, &k, &v);
        let (keys, values) = kv.layer(layer, start + n);
        let mut attn = vec![0f32; n * qd];
        let sinks = a.sinks.as_deref();
        #[cfg(any(test, feature = "fault-injection"))]
        let sinks = sinks.filter(|_| self.fault != super::Fault::IgnoreSinks);
        if self.activations == Activations::Bf16 {
            super::flash::causal_attention_tiled(
                &q,
                keys,
                values,
                start,
                shape,
                kind,
                sinks,
                self.rounding.p,
                &mut attn,
            );
        } else {
            attention(&q, keys, values, start, shape, kind, sinks, &mut attn);
        }
        if let Some(tr) = self.trace.as_mut() {
            tr.attn_peak[layer].extend(attention_peaks(&q, keys, start, shape));
        }
        self.round_if(r.attn_out, &mut attn);
        let mut o = vec![0f32; n * h];
        matmul(&a.o, h, qd, &attn, &mut o);
        if let Some(ob) = &a.o_bias {
            add_bias_rows(&mut o, ob);
        }
        for (xv, ov) in x.iter_mut().zip(&o) {
            *xv += ov;
        }
    }

    /// `x += mlp(norm(x))`, dense SwiGLU or routed experts, for positions
    /// `start..`; returns a MoE layer's router logits `[n, num_experts]`
    /// and each token's experts run (and whether they were followed).
    #[allow(clippy::type_complexity)]
    fn mlp_block(
        &self,
        layer: usize,
        x: &mut [f32],
        start: usize,
    ) -> Result<Option<(Vec<f32>, Vec<(Vec<usize>, bool)>)>, EngineError> {
        let g = &self.geometry;
        let h = g.hidden;
        let n = x.len() / h;
        let lw = &self.weights.layers[layer];
        let mut xn = x.to_vec();
        self.norm_rows(&mut xn, &lw.post_attention_norm, g.rms_norm_eps);
        self.round_as(self.rounding.mlp_in, &mut xn);
        let mut router_logits = None;
        let y = match &lw.mlp {
            MlpWeights::Dense { gate, up, down } => self.swiglu(
                SwigluWeights {
                    gate: &self.mlp_weight(gate),
                    up: &self.mlp_weight(up),
                    down: &self.mlp_weight(down),
                    hidden: h,
                    intermediate: g.intermediate,
                    activation: crate::arch::Activation::Swiglu,
                    bias: None,
                },
                &xn,
            ),
            MlpWeights::Moe {
                router,
                router_bias,
                selection_bias,
                shared,
            } => {
                let mut logits = vec![0f32; n * g.num_experts];
                matmul(&self.mlp_weight(router), g.num_experts, h, &xn, &mut logits);
                if let Some(b) = router_bias {
                    add_bias_rows(&mut logits, b);
                }
                let selection_bias = selection_bias.as_deref();
                #[cfg(any(test, feature = "fault-injection"))]
                let selection_bias =
                    selection_bias.filter(|_| self.fault != super::Fault::IgnoreSelectionBias);
                let (mut y, ran) = self.moe(layer, &logits, selection_bias, &xn, start)?;
                let shared = shared.as_ref();
                #[cfg(any(test, feature = "fault-injection"))]
                let shared = shared.filter(|_| self.fault != super::Fault::NoSharedExpert);
                // transformers: routed output + shared_experts(x), unscaled.
                if let (Some([gate, up, down]), Some(s)) = (shared, g.shared_intermediate) {
                    let sh = self.swiglu(
                        SwigluWeights {
                            gate: &self.mlp_weight(gate),
                            up: &self.mlp_weight(up),
                            down: &self.mlp_weight(down),
                            hidden: h,
                            intermediate: s,
                            activation: crate::arch::Activation::Swiglu,
                            bias: None,
                        },
                        &xn,
                    );
                    for (a, b) in y.iter_mut().zip(&sh) {
                        *a += b;
                    }
                }
                router_logits = Some((logits, ran));
                y
            }
        };
        for (xv, yv) in x.iter_mut().zip(&y) {
            *xv += yv;
        }
        Ok(router_logits)
    }

    /// `Σ_e w_e · expert_e(x)` over each token's top-k experts (positions
    /// `start..`), and each token's experts run and whether they were
    /// followed ([`super::RouteFollow`]). Tokens are grouped by expert so
    /// each selected expert is fetched once per call, and contributions are
    /// summed in ascending expert order, as the transformers loop over
    /// `expert_hit` does.
    #[allow(clippy::type_complexity)]
    fn moe(
        &self,
        layer: usize,
        router_logits: &[f32],
        selection_bias: Option<&[f32]>,
        xn: &[f32],
        start: usize,
    ) -> Result<(Vec<f32>, Vec<(Vec<usize>, bool)>), EngineError> {
        let g = &self.geometry;
        let (h, ne) = (g.hidden, g.num_experts);
        let n = router_logits.len() / ne;
        // users[e] = [(token, weight)] of the tokens that chose expert e.
        let mut users: Vec<Vec<(usize, f32)>> = vec![Vec::new(); ne];
        let mut ran = Vec::with_capacity(n);
        for (t, l) in router_logits.chunks_exact(ne).enumerate() {
            let mut chosen = route_with(g.router.kind, l, selection_bias, g.top_k);
            let mut followed = false;
            if let Some(f) = &self.follow {
                let own: Vec<usize> = chosen.iter().map(|c| c.0).collect();
                let (kth, gap) = decision_gap(g.router.kind, l, selection_bias, g.top_k);
                if let Some(theirs) = f.take(layer, start + t, &own, gap, kth) {
                    chosen = route_selected(g.router.kind, l, theirs);
                    followed = true;
                }
            }
            ran.push((chosen.iter().map(|c| c.0).collect(), followed));
            #[cfg(any(test, feature = "fault-injection"))]
            let chosen = super::fault::combined(self.fault, chosen);
            for (e, w) in chosen {
                users[e].push((t, w));
            }
        }
        let run_expert = |(e, u): (usize, &Vec<(usize, f32)>)| {
            let w = self.experts.get(layer, e).map_err(|err| {
                EngineError::Backend(format!(
                    "routed expert weights ({}): {err}",
                    self.experts.describe()
                ))
            })?;
            let mut xs = Vec::with_capacity(u.len() * h);
            for &(t, _) in u {
                xs.extend_from_slice(&xn[t * h..(t + 1) * h]);
            }
            // The CUDA prefill path dequantizes INT4 experts to the MLP
            // block's format (`int4_dequant_{bf16,f16}`: (q - 8) * s
            // rounded once) before its GEMMs; BF16 source experts are
            // unchanged by a BF16 rounding (and exact in FP16's normal
            // range).
            let rounded;
            let ew = self.rounding.expert_weights;
            let w: &crate::ExpertF32 =
                if self.activations == Activations::Bf16 && ew != super::Format::F32 {
                    let mut r = (*w).clone();
                    for m in [&mut r.gate, &mut r.up, &mut r.down] {
                        self.round_as(ew, m);
                    }
                    rounded = r;
                    &rounded
                } else {
                    &w
                };
            let weights = SwigluWeights {
                gate: &w.gate,
                up: &w.up,
                down: &w.down,
                hidden: h,
                intermediate: g.expert_intermediate,
                activation: g.experts.activation,
                bias: w.bias.as_ref(),
            };
            Ok((e, self.swiglu(weights, &xs)))
        };
        let used: Vec<(usize, &Vec<(usize, f32)>)> = users
            .iter()
            .enumerate()
            .filter(|(_, u)| !u.is_empty())
            .collect();
        // `collect` keeps the input (ascending expert) order either way.
        let outputs: Vec<(usize, Vec<f32>)> = if n * g.top_k * g.expert_params() < PARALLEL_MIN_MACS
        {
            used.into_iter()
                .map(run_expert)
                .collect::<Result<_, EngineError>>()?
        } else {
            used.into_par_iter()
                .map(run_expert)
                .collect::<Result<_, EngineError>>()?
        };
        let mut out = vec![0f32; n * h];
        for (e, y) in outputs {
            for (&(t, w), yt) in users[e].iter().zip(y.chunks_exact(h)) {
                for (o, v) in out[t * h..(t + 1) * h].iter_mut().zip(yt) {
                    *o += w * v;
                }
            }
        }
        Ok((out, ran))
    }
}
