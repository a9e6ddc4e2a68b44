use super::*;
use rand::{Rng, SeedableRng};
use serde_json::Value;

fn vocab() -> (Tokenizer, Vocabulary) {
    let dir = crate::testutil::tiny_checkpoint("tiny");
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let v = Vocabulary::new(&tok).unwrap();
    (tok, v)
}

/// Draws uniformly among the allowed tokens until EOS (a random-weight
/// model's worst case: any allowed token is as likely as any other).
fn draw(tok: &Tokenizer, c: &mut Constraint, rng: &mut impl Rng, max: usize) -> String {
    let eos = tok.eos_token_ids()[0];
    let mut out = Vec::new();
    for _ in 0..max {
        let m = c.mask().unwrap().unwrap();
        let allowed: Vec<u32> = m.allowed().collect();
        assert!(!allowed.is_empty(), "a mask allowed nothing after {out:?}");
        let t = allowed[rng.random_range(0..allowed.len())];
        if t == eos {
            assert!(c.is_accepting(), "EOS allowed before the grammar accepts");
            return tok.decode(&out, false).unwrap();
        }
        c.commit(t).unwrap();
        out.push(t);
    }
    panic!("no EOS after {max} tokens: {:?}", tok.decode(&out, false));
}

/// Random tokens under a schema's constraint give JSON that holds the
/// schema: required keys, an enum, bounded integers and strings, an
/// array, a nested object, no other keys.
#[test]
fn random_tokens_under_a_json_schema_give_valid_json() {
    let (tok, v) = vocab();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "count": {"type": "integer", "minimum": 1, "maximum": 99},
            "kind": {"enum": ["read", "write", "exec"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
            "nested": {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}},
                "required": ["ok"],
                "additionalProperties": false
            }
        },
        "required": ["name", "count", "kind", "nested"],
        "additionalProperties": false
    });
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(18);
    for i in 0..12 {
        let mut c = Grammar::json_schema(&v, &schema).unwrap().start();
        let text = draw(&tok, &mut c, &mut rng, 400);
        let j: Value = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("output {i} is not JSON ({e}): {text}"));
        let o = j
            .as_object()
            .unwrap_or_else(|| panic!("not an object: {text}"));
        for k in o.keys() {
            assert!(
                ["name", "count", "kind", "tags", "nested"].contains(&k.as_str()),
                "key {k} is not in the schema: {text}"
            );
        }
        assert!(o["name"].as_str().unwrap().chars().count() <= 12, "{text}");
        let n = o["count"].as_i64().unwrap();
        assert!((1..=99).contains(&n), "{text}");
        assert!(["read", "write", "exec"].contains(&o["kind"].as_str().unwrap()));
        assert!(o["nested"]["ok"].is_boolean(), "{text}");
        if let Some(t) = o.get("tags") {
            let t = t.as_array().unwrap();
            assert!(t.len() <= 3 && t.iter().all(|s| s.as_str().unwrap().chars().count() <= 6));
        }
        assert!(
            !text.contains(['\n', '\t']) && !text.contains("  "),
            "whitespace not bounded: {text}"
        );
    }
}

/// `json_object`: any object, never another JSON value.
#[test]
fn json_object_allows_objects_only() {
    let (tok, v) = vocab();
    let mut c = Grammar::json_object(&v).unwrap().start();
    let m = c.mask().unwrap().unwrap();
    let brace = tok.encode("{").unwrap();
    assert_eq!(brace.len(), 1);
    assert!(m.is_allowed(brace[0]));
    for other in ["[", "\"", "1", "true", " "] {
        let t = tok.encode(other).unwrap();
        assert!(!m.is_allowed(t[0]), "{other:?} allowed first");
    }
    assert!(
        !m.is_allowed(tok.eos_token_ids()[0]),
        "EOS before any output"
    );
}

/// A token the mask did not allow is refused, and a schema that is not
/// an object, or that sets the engine's own key, is refused up front.
#[test]
fn bad_tokens_and_bad_schemas_are_refused() {
    let (tok, v) = vocab();
    let mut c = Grammar::json_object(&v).unwrap().start();
    let bad = tok.encode("[").unwrap()[0];
    assert!(!c.mask().unwrap().unwrap().is_allowed(bad));
    assert!(c.commit(bad).is_err());
    assert!(Grammar::json_schema(&v, &serde_json::json!(true)).is_err());
    let e = Grammar::json_schema(&v, &serde_json::json!({"x-guidance": {}}))
        .err()
        .unwrap();
    assert!(e.to_string().contains("x-guidance"), "{e}");
}

/// Added tokens are bytes of their own text, flagged; every other token
/// of the Qwen vocabulary maps back to bytes.
#[test]
fn token_bytes_flag_added_tokens() {
    let (tok, v) = vocab();
    let bytes = tok.token_bytes().unwrap();
    assert_eq!(bytes.len(), v.size());
    let end = tok.token_id("<|im_end|>").unwrap();
    assert_eq!(bytes[end as usize], (b"<|im_end|>".to_vec(), true));
    let hello = tok.encode(" hello").unwrap();
    assert_eq!(hello.len(), 1);
    assert_eq!(bytes[hello[0] as usize], (b" hello".to_vec(), false));
}

/// A lazy grammar leaves the output free until its trigger token, then
/// holds what follows to the grammar until it completes, then frees it
/// again (or, after its last allowed match, allows only EOS).
#[test]
fn lazy_grammar_applies_between_trigger_and_completion() {
    let (tok, v) = vocab();
    let open = tok.token_id("<tool_call>").unwrap();
    let close = tok.token_id("</tool_call>").unwrap();
    let args = lark_json(&serde_json::json!({
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": false
    }))
    .unwrap();
    let source = format!(r#"start: "\n" {args} "\n" <[{close}]>"#);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    for max in [Some(1), None] {
        let g = Grammar::lazy_lark(&v, open, &source, max, "a test call").unwrap();
        let mut c = g.start();
        let hello = tok.encode("hello").unwrap();
        for &t in &hello {
            assert!(
                c.mask().unwrap().is_none(),
                "constrained before the trigger"
            );
            c.commit(t).unwrap();
        }
        c.commit(open).unwrap();
        let mut body = Vec::new();
        loop {
            let m = c.mask().unwrap().expect("constrained after the trigger");
            let allowed: Vec<u32> = m.allowed().collect();
            assert!(!allowed.contains(&v.eos()), "EOS inside a call");
            let t = allowed[rng.random_range(0..allowed.len())];
            c.commit(t).unwrap();
            body.push(t);
            if t == close {
                break;
            }
            assert!(body.len() < 40, "{:?}", tok.decode(&body, false));
        }
        let text = tok.decode(&body[..body.len() - 1], false).unwrap();
        let j: Value = serde_json::from_str(text.trim()).unwrap();
        assert!((0..=9).contains(&j["n"].as_i64().unwrap()), "{text}");
        assert_eq!(c.matches(), 1);
        match max {
            Some(_) => {
                let m = c.mask().unwrap().unwrap();
                assert_eq!(m.allowed().collect::<Vec<_>>(), [v.eos()]);
                assert!(c.commit(hello[0]).is_err(), "text after the last call");
            }
            None => assert!(c.mask().unwrap().is_none(), "not free after the call"),
        }
    }
}

/// A Lark grammar over the whole output: token literals by id, then EOS
/// only once it completes.
#[test]
fn lark_grammar_constrains_the_whole_output() {
    let (tok, v) = vocab();
    let g = Grammar::lark(&v, r#"start: "yes" | "no""#, "a choice").unwrap();
    let mut c = g.start();
    let m = c.mask().unwrap().unwrap();
    assert!(!m.is_allowed(v.eos()));
    let yes = tok.encode("yes").unwrap();
    for &t in &yes {
        assert!(c.mask().unwrap().unwrap().is_allowed(t));
        c.commit(t).unwrap();
    }
    assert!(c.is_accepting());
    assert_eq!(
        c.mask().unwrap().unwrap().allowed().collect::<Vec<_>>(),
        [v.eos()]
    );
    c.commit(v.eos()).unwrap();
}
