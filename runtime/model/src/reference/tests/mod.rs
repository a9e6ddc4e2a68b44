//! Generation semantics of the reference engine on small synthetic models.
//! (Numerical agreement with an independent implementation and with the
//! Hugging Face witness fixtures is tested in `tests/witness.rs`.)

use super::*;
use crate::engine::{CancelToken, FinishReason, SamplingParams};
use crate::synth::{self, GENERATOR_VERSION, RECORD_FILE, SynthDtype, SynthExperts, SynthSpec};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::time::Instant;

/// A synthetic checkpoint without tokenizer files, made once per content.
fn synth_dir(preset: &str, overrides: &[(&str, Value)], omit_experts: bool) -> PathBuf {
    let overrides: Vec<(String, Value)> = overrides
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect();
    let spec = SynthSpec::new(preset, 1, SynthDtype::Bf16, 0.0, &overrides).unwrap();
    // The tensor list is part of the key so a change in what the
    // architecture expects never reuses a checkpoint written before it.
    let tensors: Vec<(String, Vec<usize>)> = spec
        .tensors()
        .into_iter()
        .map(|t| (t.name, t.shape))
        .collect();
    let key = blake3::hash(
        format!("{GENERATOR_VERSION}/{preset}/{overrides:?}/{omit_experts}/{tensors:?}").as_bytes(),
    )
    .to_hex();
    let dir = crate::testutil::testdata_dir().join(format!("reference-{preset}-{}", &key[..16]));
    if !dir.join(RECORD_FILE).exists() {
        let mut opts = synth::SynthOptions::new(spec);
        opts.tokenizer = synth::TokenizerSource::None;
        opts.skip_routed_experts = omit_experts;
        match synth::synthesize(&opts, &dir) {
            Ok(_) => {}
            Err(synth::SynthError::OutputExists { .. }) if dir.join(RECORD_FILE).exists() => {}
            Err(e) => panic!("synthesizing {preset} into {}: {e}", dir.display()),
        }
    }
    dir
}

fn small_vocab() -> PathBuf {
    synth_dir("tiny", &[("vocab_size", json!(512))], false)
}

fn engine(context: usize) -> ReferenceEngine {
    let opts = ReferenceOptions {
        context_length: Some(context),
    };
    ReferenceEngine::load(&small_vocab(), opts).unwrap()
}

fn request(prompt: &[u32], max: usize) -> GenerateRequest {
    GenerateRequest {
        prompt: prompt.to_vec(),
        max_new_tokens: max,
        sampling: SamplingParams::greedy(),
        stop_token_ids: vec![],
        cancel: Default::default(),
        live: Default::default(),
        cache_prompt: false,
        constraint: None,
    }
}

fn run(e: &mut ReferenceEngine, req: &GenerateRequest) -> (Vec<u32>, GenerateOutcome) {
    let mut out = Vec::new();
    let o = e
        .generate(req, &mut |t| {
            out.push(t);
            ControlFlow::Continue(())
        })
        .unwrap();
    (out, o)
}

const PROMPT: [u32; 6] = [5, 99, 300, 7, 42, 511];

#[test]
fn greedy_generation_follows_prompt_logits_argmax() {
    let mut e = engine(64);
    let (tokens, o) = run(&mut e, &request(&PROMPT, 5));
    assert_eq!(o.finish, FinishReason::Length);
    assert_eq!(o.stats.generated_tokens, 5);
    assert_eq!(o.stats.prompt_tokens, 6);
    assert_eq!(tokens.len(), 5);
    let mut seq = PROMPT.to_vec();
    for &t in &tokens {
        let logits = e.prompt_logits(&seq).unwrap();
        assert_eq!(logits.len(), seq.len());
        assert_eq!(
            crate::sampling::argmax(logits.last().unwrap()),
            t,
            "after {seq:?}"
        );
        seq.push(t);
    }
}

#[test]
fn stop_token_and_cancellation_end_generation() {
    let mut e = engine(64);
    let (first, _) = run(&mut e, &request(&PROMPT, 1));
    let mut req = request(&PROMPT, 10);
    req.stop_token_ids = vec![first[0]];
    let (tokens, o) = run(&mut e, &req);
    assert_eq!((tokens, o.finish), (first, FinishReason::Stop));

    let mut seen = 0;
    let o = e
        .generate(&request(&PROMPT, 10), &mut |_| {
            seen += 1;
            if seen == 2 {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        })
        .unwrap();
    assert_eq!(
        (o.finish, o.stats.generated_tokens, seen),
        (FinishReason::Cancelled, 2, 2)
    );
}

#[test]
fn context_bounds_prompt_plus_generated_tokens() {
    let mut e = engine(8);
    assert_eq!(e.info().context_length, 8);
    let (tokens, o) = run(&mut e, &request(&PROMPT, 100));
    assert_eq!((tokens.len(), o.finish), (2, FinishReason::Length));

    let full = [1u32; 8];
    match e.generate(&request(&full, 1), &mut |_| ControlFlow::Continue(())) {
        Err(EngineError::PromptTooLong {
            prompt: 8,
            context: 8,
        }) => {}
        other => panic!("expected PromptTooLong, got {other:?}"),
    }
    // Scoring needs no room for a new token, so a full context is fine.
    assert_eq!(e.prompt_logits(&full).unwrap().len(), 8);
    assert!(matches!(
        e.prompt_logits(&[1u32; 9]),
        Err(EngineError::PromptTooLong {
            prompt: 9,
            context: 8
        })
    ));
}

#[test]
fn bad_requests_are_refused_with_the_reason() {
    let mut e = engine(16);
    assert!(matches!(
        e.prompt_logits(&[]),
        Err(EngineError::EmptyPrompt)
    ));
    match e.prompt_logits(&[1, 512]) {
        Err(EngineError::BadToken {
            id: 512,
            vocab: 512,
        }) => {}
        other => panic!("expected BadToken, got {other:?}"),
    }
    let (tokens, o) = run(&mut e, &request(&PROMPT, 0));
    assert_eq!((tokens.len(), o.finish), (0, FinishReason::Length));
}

#[test]
fn default_context_is_the_model_maximum_up_to_the_cap() {
    let e = ReferenceEngine::load(&small_vocab(), ReferenceOptions::default()).unwrap();
    assert_eq!(e.info().context_length, 8192);
    let long = synth_dir(
        "tiny",
        &[
            ("vocab_size", json!(512)),
            ("max_position_embeddings", json!(65536)),
        ],
        false,
    );
    let e = ReferenceEngine::load(&long, ReferenceOptions::default()).unwrap();
    assert_eq!(e.info().context_length, DEFAULT_CONTEXT_CAP);
}

#[test]
fn bad_context_lengths_are_refused() {
    for (c, needle) in [
        (0, "context length 0"),
        (8193, "max_position_embeddings (8192)"),
    ] {
        let opts = ReferenceOptions {
            context_length: Some(c),
        };
        let err = ReferenceEngine::load(&small_vocab(), opts)
            .unwrap_err()
            .to_string();
        assert!(err.contains(needle), "{err}");
    }
}

#[test]
fn explicit_expert_source_replaces_checkpoint_experts() {
    let overrides = [("vocab_size", json!(512))];
    let omitted = synth_dir("tiny", &overrides, true);
    let err = ReferenceEngine::load(&omitted, ReferenceOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("no routed expert tensors"), "{err}");

    let spec = synth::SynthSpec::from_checkpoint_dir(&omitted).unwrap();
    let opts = ReferenceOptions {
        context_length: Some(32),
    };
    let mut from_synth =
        ReferenceEngine::with_experts(&omitted, opts.clone(), Arc::new(SynthExperts::new(spec)))
            .unwrap();
    let mut from_ckpt = ReferenceEngine::load(&small_vocab(), opts).unwrap();
    assert!(
        from_ckpt.expert_source().contains("BF16"),
        "{}",
        from_ckpt.expert_source()
    );
    let a = from_synth.prompt_logits(&PROMPT).unwrap();
    let b = from_ckpt.prompt_logits(&PROMPT).unwrap();
    for (x, y) in a.iter().flatten().zip(b.iter().flatten()) {
        assert!((x - y).abs() <= 1e-5 * (1.0 + y.abs()), "{x} vs {y}");
    }
}

struct WrongShape;

impl ExpertWeights for WrongShape {
    fn describe(&self) -> String {
        "wrong-shape test source".into()
    }
    fn expert_f32(&self, _: usize, _: usize) -> Result<crate::ExpertF32, ModelError> {
        Ok(crate::ExpertF32 {
            gate: vec![0.0; 4],
            up: vec![0.0; 4],
            down: vec![0.0; 4],
            bias: None,
        })
    }
}

#[test]
fn mismatched_expert_source_fails_closed() {
    let opts = ReferenceOptions {
        context_length: Some(16),
    };
    let mut e = ReferenceEngine::with_experts(&small_vocab(), opts, Arc::new(WrongShape)).unwrap();
    let err = e.prompt_logits(&PROMPT).unwrap_err().to_string();
    assert!(err.contains("does not match this model"), "{err}");
}

#[test]
fn seeded_sampling_replays() {
    let mut e = engine(64);
    let mut req = request(&PROMPT, 8);
    req.sampling = SamplingParams {
        temperature: 1.0,
        top_p: 0.9,
        seed: Some(3),
        ..SamplingParams::default()
    };
    let (a, _) = run(&mut e, &req);
    let (b, _) = run(&mut e, &req);
    assert_eq!(a, b);
}

/// The emulation's rounding is the CUDA engine's for the model: the
/// attention block's points in the description's attention format
/// (gpt_oss FP16, qwen3_moe and glm4_moe BF16), the MLP block's in its
/// MLP format (glm4_moe FP16, the others BF16), every other point BF16;
/// diagnostics can change it.
#[test]
fn the_emulated_rounding_follows_the_descriptions_formats() {
    use crate::arch::ActFormat;
    let mut e = engine(64);
    assert_eq!(e.geometry().attention.activations, ActFormat::Bf16);
    assert_eq!(e.geometry().mlp.activations, ActFormat::Bf16);
    assert_eq!(e.rounding(), Rounding::all_bf16());
    e.set_rounding(Rounding::none());
    assert_eq!(e.rounding(), Rounding::none());

    let dir = crate::testutil::tiny_gpt_oss_checkpoint();
    let e = ReferenceEngine::load(&dir, ReferenceOptions::default()).unwrap();
    assert_eq!(e.geometry().attention.activations, ActFormat::F16);
    assert_eq!(e.geometry().mlp.activations, ActFormat::Bf16);
    let r = e.rounding();
    assert_eq!(r, Rounding::engine(e.geometry()));
    assert_eq!([r.attn_in, r.q, r.k, r.v, r.p], [Format::F16; 5], "{r:?}");
    // The attention output and the MoE block stay BF16.
    assert_eq!(
        Rounding {
            attn_in: Format::Bf16,
            q: Format::Bf16,
            k: Format::Bf16,
            v: Format::Bf16,
            p: Format::Bf16,
            ..r
        },
        Rounding::all_bf16()
    );

    let dir = crate::testutil::tiny_glm4_moe_checkpoint();
    let e = ReferenceEngine::load(&dir, ReferenceOptions::default()).unwrap();
    assert_eq!(e.geometry().attention.activations, ActFormat::Bf16);
    assert_eq!(e.geometry().mlp.activations, ActFormat::F16);
    let r = e.rounding();
    assert_eq!(r, Rounding::engine(e.geometry()));
    assert_eq!(
        [r.mlp_in, r.mlp_weights, r.gate_up, r.act, r.expert_weights],
        [Format::F16; 5],
        "{r:?}"
    );
    // The attention block, its output and the final norm stay BF16.
    assert_eq!(
        Rounding {
            mlp_in: Format::Bf16,
            mlp_weights: Format::Bf16,
            gate_up: Format::Bf16,
            act: Format::Bf16,
            expert_weights: Format::Bf16,
            ..r
        },
        Rounding::all_bf16()
    );
}

/// The MLP block's FP16 points make the emulation closer to the f32
/// oracle than BF16 ones (glm4_moe, each compared with the oracle running
/// its expert choices), and its weights are converted as the engine
/// converts them: only values below FP16's normal range move, by at most
/// 2^-25, and nothing in f32 mode.
#[test]
fn fp16_mlp_rounding_is_closer_and_converts_only_subnormal_weights() {
    let dir = crate::testutil::tiny_glm4_moe_checkpoint();
    let mut e = ReferenceEngine::load(&dir, ReferenceOptions::default()).unwrap();
    let toks: Vec<u32> = (0..48).map(|i| (i * 37 + 5) % 500).collect();
    let engine = e.rounding();
    let err = |e: &mut ReferenceEngine, r: Rounding| {
        e.set_rounding(r);
        e.set_activations(Activations::Bf16);
        let (lb, tb) = e.prompt_logits_traced(&toks).unwrap();
        e.set_activations(Activations::F32);
        let follow = RouteFollow {
            experts: tb.experts,
            abs: f32::INFINITY,
            rel: 0.0,
            spread: 0.0,
        };
        let (lf, _) = e.prompt_logits_following(&toks, follow).unwrap();
        lb.iter()
            .flatten()
            .zip(lf.iter().flatten())
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
    };
    let e16 = err(&mut e, engine);
    let e_bf = err(
        &mut e,
        Rounding {
            mlp_in: Format::Bf16,
            mlp_weights: Format::Bf16,
            gate_up: Format::Bf16,
            act: Format::Bf16,
            expert_weights: Format::Bf16,
            ..engine
        },
    );
    assert!(e16 > 0.0 && e16 < e_bf, "FP16 MLP {e16} vs BF16 MLP {e_bf}");
    // The weight conversion: exact in the normal range, subnormal below.
    e.set_rounding(engine);
    let normal = [0.0234375f32, -1.5, 2f32.powi(-14), 65504.0];
    e.set_activations(Activations::Bf16);
    assert!(matches!(
        e.mlp_weight(&normal),
        std::borrow::Cow::Borrowed(_)
    ));
    let tiny = [0.0234375f32, 3e-6];
    let w = e.mlp_weight(&tiny);
    assert_eq!(w[0], 0.0234375);
    assert!(
        w[1] != 3e-6 && (w[1] - 3e-6).abs() <= 2f32.powi(-25),
        "{}",
        w[1]
    );
    e.set_activations(Activations::F32);
    assert!(matches!(e.mlp_weight(&tiny), std::borrow::Cow::Borrowed(_)));
}

#[test]
fn bf16_activations_move_logits_slightly_and_f32_stays_exact() {
    let mut e = engine(64);
    assert_eq!(e.activations(), Activations::F32);
    let f32_logits = e.prompt_logits(&PROMPT).unwrap();
    e.set_activations(Activations::Bf16);
    let bf16_logits = e.prompt_logits(&PROMPT).unwrap();
    e.set_activations(Activations::F32);
    let (again, trace) = e.prompt_logits_traced(&PROMPT).unwrap();
    // F32 is the oracle: switching back, tracing, and a fresh engine all
    // give the same bits.
    assert_eq!(again, f32_logits);
    assert_eq!(engine(64).prompt_logits(&PROMPT).unwrap(), f32_logits);

    let scale = f32_logits
        .iter()
        .flatten()
        .fold(0f32, |m, v| m.max(v.abs()));
    let per_pos: Vec<f32> = f32_logits
        .iter()
        .zip(&bf16_logits)
        .map(|(a, b)| a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())))
        .collect();
    let max = per_pos.iter().copied().fold(0f32, f32::max);
    assert!(
        per_pos.iter().all(|&d| d > 0.0),
        "BF16 rounding left some position unchanged: {per_pos:?}"
    );
    // ~0.4% per rounding through three layers: well under the 3% bound the
    // GPU check uses (this prompt has no router near-tie).
    assert!(max < 0.03 * scale, "{per_pos:?} vs max |logit| {scale}");

    let n = PROMPT.len();
    let g = e.geometry().clone();
    assert_eq!(trace.final_rms.len(), n);
    for l in 0..g.num_layers {
        assert_eq!(trace.layer_input_rms[l].len(), n);
        assert_eq!(trace.attn_peak[l].len(), n);
        // The first position attends only to itself.
        assert_eq!(trace.attn_peak[l][0], 1.0);
        assert!(trace.attn_peak[l].iter().all(|&p| p > 0.0 && p <= 1.0));
        assert_eq!(trace.experts[l].len(), n);
        assert!(trace.experts[l].iter().all(|x| x.len() == g.top_k));
        assert!(trace.router_margin[l].iter().all(|&m| m >= 0.0));
    }
}

/// A prompt of `n` ids below 512 (the small-vocabulary test model).
fn long_prompt(n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| (i * 131 + 7) % 512).collect()
}

#[test]
fn chunked_prefill_is_bit_identical_to_one_batch() {
    let prompt = long_prompt(45);
    let mut e = engine(128);
    e.set_prefill_chunk(usize::MAX);
    let whole = e.prompt_logits(&prompt).unwrap();
    let (whole_tokens, _) = run(&mut e, &request(&prompt, 6));
    assert_eq!(whole.len(), prompt.len());
    // 1 (every chunk a single token), uneven chunks, and the default.
    for chunk in [1, 7, 16, DEFAULT_PREFILL_CHUNK] {
        e.set_prefill_chunk(chunk);
        assert_eq!(e.prefill_chunk(), chunk);
        assert_eq!(
            e.prompt_logits(&prompt).unwrap(),
            whole,
            "prompt logits with prefill chunks of {chunk}"
        );
        let (tokens, _) = run(&mut e, &request(&prompt, 6));
        assert_eq!(tokens, whole_tokens, "greedy tokens with chunks of {chunk}");
    }
    // The trace covers every position whatever the chunking.
    e.set_prefill_chunk(7);
    let (_, trace) = e.prompt_logits_traced(&prompt).unwrap();
    assert_eq!(trace.final_rms.len(), prompt.len());
    for l in 0..e.geometry().num_layers {
        assert_eq!(trace.layer_input_rms[l].len(), prompt.len());
        assert_eq!(trace.mlp_input_rms[l].len(), prompt.len());
        assert_eq!(trace.attn_peak[l].len(), prompt.len());
        assert_eq!(trace.experts[l].len(), prompt.len());
    }
    e.set_prefill_chunk(0);
    assert_eq!(e.prefill_chunk(), 1, "a chunk of 0 tokens is taken as 1");
}

#[test]
fn every_fault_changes_the_logits_and_none_restores_them() {
    let mut e = engine(64);
    let prompt = long_prompt(12);
    let clean = e.prompt_logits(&prompt).unwrap();
    let faults = Fault::applicable(e.geometry());
    assert_eq!(faults.len(), 3, "tiny has no sinks or windows: {faults:?}");
    for fault in faults {
        e.set_fault(fault);
        let bad = e.prompt_logits(&prompt).unwrap();
        let worst = clean
            .iter()
            .flatten()
            .zip(bad.iter().flatten())
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            worst > 1e-3,
            "{fault:?} left the logits unchanged ({worst})"
        );
        if fault == Fault::RopeSign {
            // Position 0 rotates by angle 0 either way.
            assert_eq!(bad[0], clean[0]);
        }
    }
    e.set_fault(Fault::None);
    assert_eq!(e.prompt_logits(&prompt).unwrap(), clean);
}

mod batch;
mod cancel;
mod constrained;
mod mxfp4_experts;
mod prefix;

/// The byte progress of loading counts exactly the total it announces.
#[test]
fn weight_load_progress_counts_every_byte_it_reads() {
    use krasis_common::events::{ByteProgress, ProgressEvent, task};
    let dir = small_vocab();
    let config = ModelConfig::load(&dir).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let sink = |_: ProgressEvent| {};
    let total = dense_tensor_bytes(&config, &ckpt);
    let p = ByteProgress::start(&sink, task::LOAD_WEIGHTS, total);
    Weights::load(&ckpt, &config, Some(&p)).unwrap();
    assert!(total > 0);
    assert_eq!(p.done(), total);
}
