//! Padded embedding rows (Qwen3: 151936 rows, 151669 tokens) have no text, so
//! no engine may sample them: a random-weights model otherwise picks one now
//! and then and the detokenizer has nothing to print.

use krasis_model::reference::{ReferenceEngine, ReferenceOptions};
use krasis_model::synth::{SynthDtype, SynthOptions, SynthSpec, synthesize};
use krasis_model::tokenizer::{Tokenizer, sampleable_vocab};
use krasis_model::{Engine, GenerateRequest, SamplingParams};
use std::ops::ControlFlow;

#[test]
fn sampleable_vocab_is_the_tokenizer_not_the_padded_embedding() {
    let dir = krasis_model::testutil::tiny_checkpoint("tiny");
    assert_eq!(sampleable_vocab(&dir, 151936).unwrap(), 151669);
    assert_eq!(sampleable_vocab(&dir, 1000).unwrap(), 1000);
    let empty = tempfile::tempdir().unwrap();
    assert_eq!(sampleable_vocab(empty.path(), 77).unwrap(), 77);
}

#[test]
fn reference_engine_never_emits_a_padding_id() {
    // Pad the embedding to ~2x the tokenizer so that, with near-uniform
    // sampling, about half of all draws would land on a padded id.
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().join("padded");
    let spec = SynthSpec::new(
        "tiny",
        1,
        SynthDtype::parse("bf16").unwrap(),
        0.0,
        &[("vocab_size".to_string(), serde_json::json!(300_000))],
    )
    .unwrap();
    synthesize(&SynthOptions::new(spec), &dir).unwrap();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let mut engine = ReferenceEngine::load(&dir, ReferenceOptions::default()).unwrap();
    let req = GenerateRequest {
        prompt: tok.encode("Write a haiku about memory.").unwrap(),
        max_new_tokens: 24,
        sampling: SamplingParams {
            temperature: 1e4,
            seed: Some(3),
            ..SamplingParams::default()
        },
        stop_token_ids: vec![],
        cancel: Default::default(),
        live: Default::default(),
        cache_prompt: false,
        constraint: None,
    };
    let mut ids = Vec::new();
    engine
        .generate(&req, &mut |t| {
            ids.push(t);
            ControlFlow::Continue(())
        })
        .unwrap();
    assert_eq!(ids.len(), 24);
    assert!(
        ids.iter().all(|&t| (t as usize) < tok.vocab_size()),
        "{ids:?}"
    );
    tok.decode(&ids, false).unwrap();
}
