//! Grammar-constrained sampling in the reference engine (issue 18): under a
//! JSON schema every output of a random-weight model, sampled at
//! temperature 1, is JSON that holds the schema and ends on EOS; a sampler
//! that ignores the mask (a planted fault) is a fatal engine error, and a
//! grammar whose EOS is not a stop token is refused at admission.

use super::*;
use crate::structured::{Grammar, Vocabulary};
use crate::tokenizer::Tokenizer;

fn setup() -> (ReferenceEngine, Tokenizer, Vocabulary) {
    let dir = crate::testutil::tiny_checkpoint("tiny");
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let vocab = Vocabulary::new(&tok).unwrap();
    let opts = ReferenceOptions {
        context_length: Some(512),
    };
    (ReferenceEngine::load(&dir, opts).unwrap(), tok, vocab)
}

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 10},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "unit": {"enum": ["c", "f"]}
        },
        "required": ["city", "days", "unit"],
        "additionalProperties": false
    })
}

fn constrained(tok: &Tokenizer, g: &Grammar, seed: u64) -> GenerateRequest {
    let mut r = request(&tok.encode("Weather as JSON:").unwrap(), 200);
    r.sampling = SamplingParams {
        temperature: 1.0,
        seed: Some(seed),
        ..SamplingParams::default()
    };
    r.stop_token_ids = tok.eos_token_ids().to_vec();
    r.constraint = Some(g.clone());
    r
}

#[test]
fn sampled_outputs_hold_their_schema_and_end_on_eos() {
    let (mut e, tok, vocab) = setup();
    let g = Grammar::json_schema(&vocab, &schema()).unwrap();
    for seed in 0..6 {
        let (out, o) = run(&mut e, &constrained(&tok, &g, seed));
        assert_eq!(o.finish, FinishReason::Stop, "seed {seed}: {out:?}");
        assert_eq!(out.last(), Some(&g.eos()));
        let text = tok.decode(&out[..out.len() - 1], false).unwrap();
        let v: Value = serde_json::from_str(&text)
            .unwrap_or_else(|err| panic!("seed {seed}: not JSON ({err}): {text}"));
        assert!(v["city"].as_str().unwrap().chars().count() <= 10, "{text}");
        assert!((1..=14).contains(&v["days"].as_i64().unwrap()), "{text}");
        assert!(["c", "f"].contains(&v["unit"].as_str().unwrap()), "{text}");
        assert_eq!(v.as_object().unwrap().len(), 3, "{text}");
    }
    // Without the grammar the same request is not JSON: the mask is what
    // made it so.
    let mut free = constrained(&tok, &g, 0);
    free.constraint = None;
    free.max_new_tokens = 12;
    let (out, _) = run(&mut e, &free);
    let text = tok.decode(&out, false).unwrap();
    assert!(serde_json::from_str::<Value>(&text).is_err(), "{text}");
}

#[test]
fn a_sampler_that_ignores_the_mask_is_a_fatal_fault() {
    let (mut e, tok, vocab) = setup();
    let g = Grammar::json_object(&vocab).unwrap();
    e.set_fault(Fault::IgnoreMask);
    let err = e
        .generate(
            &constrained(&tok, &g, 1),
            &mut |_| ControlFlow::Continue(()),
        )
        .unwrap_err();
    assert!(err.is_fatal(), "{err}");
    assert!(
        err.to_string().contains("ignored the grammar's mask"),
        "{err}"
    );
}

#[test]
fn a_grammar_that_could_never_end_is_refused() {
    let (mut e, tok, vocab) = setup();
    let g = Grammar::json_object(&vocab).unwrap();
    let mut r = constrained(&tok, &g, 2);
    r.stop_token_ids.retain(|&t| t != g.eos());
    let err = e
        .generate(&r, &mut |_| ControlFlow::Continue(()))
        .unwrap_err();
    assert!(matches!(err, EngineError::InvalidRequest(_)), "{err}");
    assert!(err.to_string().contains("stop tokens"), "{err}");
}
