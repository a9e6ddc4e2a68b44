//! Grammar-constrained sampling on the CUDA engine (structured output,
//! issue 18): a JSON schema's mask, applied by the GPU sampler, makes every
//! output of a random-weight model hold the schema, alone and with several
//! constrained and free sequences batched together (each as it is alone;
//! the free one never reads a mask row); the planted
//! `Fault::IgnoreMask` (the sampler drops the mask) is a fatal engine
//! error, so the assertions above are not vacuous.
//!
//! On a machine without an NVIDIA driver each test prints `SKIPPED (no
//! CUDA device): <name> (no NVIDIA driver)`.

mod support;

use krasis_gpu::CudaEngine;
use krasis_gpu::forward::Fault;
use krasis_model::batch::{Admission, SeqEvent};
use krasis_model::structured::{Grammar, Vocabulary};
use krasis_model::tokenizer::Tokenizer;
use krasis_model::{Engine, FinishReason, GenerateRequest, SamplingParams};
use serde_json::{Value, json};
use std::collections::HashMap;
use std::ops::ControlFlow;
use support::{cuda, cuda_options, generate_all, gpu_or_skip, greedy_request};

fn setup(cache: &std::path::Path) -> (CudaEngine, Tokenizer, Vocabulary) {
    let dir = krasis_model::testutil::tiny_checkpoint_with("tiny", &[("head_dim", json!(64))]);
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let vocab = Vocabulary::new(&tok).unwrap();
    // Five sequences run together in the batched part.
    let opts = krasis_gpu::CudaEngineOptions {
        parallel: Some(8),
        kv_rows: Some(8 * 1024),
        ..cuda_options(cache, 1024, 64)
    };
    (cuda(&dir, &opts), tok, vocab)
}

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "path": {"type": "string", "maxLength": 16},
            "line": {"type": "integer", "minimum": 1, "maximum": 9999},
            "mode": {"enum": ["read", "write"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
            "opts": {
                "type": "object",
                "properties": {"force": {"type": "boolean"}},
                "required": ["force"],
                "additionalProperties": false
            }
        },
        "required": ["path", "line", "mode", "opts"],
        "additionalProperties": false
    })
}

fn request(tok: &Tokenizer, g: Option<&Grammar>, seed: u64) -> GenerateRequest {
    GenerateRequest {
        sampling: SamplingParams {
            temperature: 1.0,
            top_k: 50,
            seed: Some(seed),
            ..SamplingParams::default()
        },
        stop_token_ids: tok.eos_token_ids().to_vec(),
        constraint: g.cloned(),
        ..greedy_request(&tok.encode("Open which file?").unwrap(), 160)
    }
}

/// The JSON text of a constrained output (its last token the EOS), checked
/// against `schema()`.
fn check(tok: &Tokenizer, g: &Grammar, out: &[u32]) {
    assert_eq!(out.last(), Some(&g.eos()), "no EOS at the end: {out:?}");
    let text = tok.decode(&out[..out.len() - 1], false).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"));
    let o = v.as_object().unwrap();
    assert!(
        o.keys()
            .all(|k| ["path", "line", "mode", "tags", "opts"].contains(&k.as_str()))
    );
    assert!(o["path"].as_str().unwrap().chars().count() <= 16, "{text}");
    assert!((1..=9999).contains(&o["line"].as_i64().unwrap()), "{text}");
    assert!(
        ["read", "write"].contains(&o["mode"].as_str().unwrap()),
        "{text}"
    );
    assert!(o["opts"]["force"].is_boolean(), "{text}");
    if let Some(t) = o.get("tags") {
        assert!(t.as_array().unwrap().len() <= 3, "{text}");
    }
}

#[test]
fn constrained_outputs_hold_their_schema_alone_and_batched() {
    let name = "constrained_outputs_hold_their_schema_alone_and_batched";
    if !gpu_or_skip(name) {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (mut e, tok, vocab) = setup(tmp.path());
    let g = Grammar::json_schema(&vocab, &schema()).unwrap();
    // Alone: every output holds the schema and ends on EOS.
    let mut alone = HashMap::new();
    for seed in 0..8 {
        let (out, o) = generate_all(&mut e, &request(&tok, Some(&g), seed));
        assert_eq!(o.finish, FinishReason::Stop, "seed {seed}");
        check(&tok, &g, &out);
        alone.insert(seed, out);
    }
    // The same without the grammar is not JSON: the mask made it so.
    let (free, _) = generate_all(&mut e, &request(&tok, None, 0));
    let text = tok.decode(&free, false).unwrap();
    assert!(serde_json::from_str::<Value>(&text).is_err(), "{text}");
    // Batched: four constrained sequences and the free one together, each
    // exactly as alone.
    let b = e.batch().expect("the CUDA engine batches");
    let mut ids = HashMap::new();
    for seed in 0..4u64 {
        match b.admit(request(&tok, Some(&g), seed)).unwrap() {
            Admission::Admitted(s) => ids.insert(s, Some(seed)),
            Admission::Wait => panic!("wait"),
        };
    }
    match b.admit(request(&tok, None, 0)).unwrap() {
        Admission::Admitted(s) => ids.insert(s, None),
        Admission::Wait => panic!("wait"),
    };
    let mut got: HashMap<_, Vec<u32>> = HashMap::new();
    let mut events = Vec::new();
    while b.active() > 0 {
        events.clear();
        b.step(&mut events).unwrap();
        for ev in events.drain(..) {
            match ev {
                SeqEvent::Token { seq, token } => got.entry(seq).or_default().push(token),
                SeqEvent::Done { result, .. } => {
                    result.unwrap();
                }
            }
        }
    }
    for (s, seed) in ids {
        match seed {
            Some(seed) => assert_eq!(got[&s], alone[&seed], "seed {seed} batched"),
            None => assert_eq!(got[&s], free, "the free sequence batched"),
        }
    }
}

#[test]
fn a_sampler_that_ignores_the_mask_is_fatal() {
    let name = "a_sampler_that_ignores_the_mask_is_fatal";
    if !gpu_or_skip(name) {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (mut e, tok, vocab) = setup(tmp.path());
    let g = Grammar::json_schema(&vocab, &schema()).unwrap();
    e.set_fault(Fault::IgnoreMask).unwrap();
    let err = e
        .generate(&request(&tok, Some(&g), 1), &mut |_| {
            ControlFlow::Continue(())
        })
        .unwrap_err();
    assert!(err.is_fatal(), "{err}");
    assert!(
        err.to_string().contains("ignored the grammar's mask"),
        "{err}"
    );
}
