//! The tool-call grammars' constraints (`ToolGrammar::constraint`: Hermes
//! JSON and Qwen3-Coder XML over the real Qwen vocabulary, GLM-4.5 XML over
//! the GLM stand-in's, harmony over gpt-oss's): random tokens among those
//! each mask allows (a random-weight model's worst case; markup tokens
//! drawn often so that messages and calls end) always give calls the
//! family's own parser reads, of a declared tool, with arguments valid
//! against that tool's schema; a lazy grammar leaves text free until
//! `<tool_call>`; with a `response_format` answer, the output is that JSON
//! or calls.

use super::*;
use krasis_model::structured::{Constraint, Grammar, Vocabulary};
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

/// Each grammar with the checkpoint whose vocabulary it is used with.
fn families() -> Vec<(&'static dyn ToolGrammar, std::path::PathBuf)> {
    let qwen = krasis_model::testutil::tiny_checkpoint("tiny");
    let glm = krasis_model::testutil::tiny_glm4_moe_checkpoint();
    vec![
        (&HermesJson, qwen.clone()),
        (&QwenXml, qwen),
        (&GlmXml, glm),
        (&Harmony, krasis_model::testutil::tiny_gpt_oss_checkpoint()),
    ]
}

/// The markup tokens of every family, as far as `tok` has them: a draw
/// takes one of these, when the mask allows any, a third of the time.
fn markers(tok: &Tokenizer) -> Vec<u32> {
    [
        "<tool_call>",
        "</tool_call>",
        "<|start|>",
        "<|channel|>",
        "<|message|>",
        "<|constrain|>",
        "<|call|>",
        "<|end|>",
        "<|return|>",
    ]
    .iter()
    .filter_map(|m| tok.token_id(m))
    .collect()
}

fn setup(dir: &std::path::Path) -> (Tokenizer, Vocabulary, ToolSet) {
    let tok = Tokenizer::from_dir(dir).unwrap();
    let vocab = Vocabulary::new(&tok).unwrap();
    let tools = ToolSet::from_openai(&[
        json!({"type": "function", "function": {"name": "read_file", "parameters": {
            "type": "object",
            "properties": {
                "path": {"type": "string", "maxLength": 12},
                "lines": {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 500}, "maxItems": 3}
            },
            "required": ["path"],
            "additionalProperties": false
        }}}),
        json!({"type": "function", "function": {"name": "set_mode", "parameters": {
            "type": "object",
            "properties": {"mode": {"enum": ["fast", "safe"]}, "level": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["mode", "level"],
            "additionalProperties": false
        }}}),
    ]);
    (tok, vocab, tools)
}

/// Random allowed tokens until EOS (or `max`): the text (special tokens
/// kept) and whether EOS came.
fn draw(tok: &Tokenizer, c: &mut Constraint, rng: &mut impl Rng, max: usize) -> (String, bool) {
    let eos = tok.eos_token_ids()[0];
    let markers = markers(tok);
    let mut out = Vec::new();
    for _ in 0..max {
        let t = match c.mask().unwrap() {
            Some(m) => {
                let marks: Vec<u32> = markers
                    .iter()
                    .copied()
                    .filter(|&t| m.is_allowed(t))
                    .collect();
                let a: Vec<u32> = m.allowed().collect();
                match marks.is_empty() || rng.random_range(0..3) > 0 {
                    true => a[rng.random_range(0..a.len())],
                    false => marks[rng.random_range(0..marks.len())],
                }
            }
            None => rng.random_range(0..tok.vocab_size() as u32),
        };
        if t == eos {
            return (tok.decode(&out, false).unwrap(), true);
        }
        c.commit(t).unwrap();
        out.push(t);
    }
    (tok.decode(&out, false).unwrap(), false)
}

fn check_calls(tools: &ToolSet, calls: &[ParsedCall], only: Option<&str>) {
    assert!(!calls.is_empty());
    for c in calls {
        let args: Value = serde_json::from_str(&c.arguments).unwrap();
        match c.name.as_str() {
            "read_file" => {
                assert!(
                    args["path"].as_str().unwrap().chars().count() <= 12,
                    "{args}"
                );
                for l in args
                    .get("lines")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    assert!((1..=500).contains(&l.as_i64().unwrap()), "{args}");
                }
            }
            "set_mode" => {
                assert!(
                    ["fast", "safe"].contains(&args["mode"].as_str().unwrap()),
                    "{args}"
                );
                assert!((0..=9).contains(&args["level"].as_i64().unwrap()), "{args}");
            }
            other => panic!("undeclared tool {other}"),
        }
        assert!(tools.contains(&c.name));
        if let Some(n) = only {
            assert_eq!(c.name, n);
        }
    }
}

fn parse(g: &dyn ToolGrammar, prefix: &str, text: &str, tools: ToolSet) -> Vec<ParsedCall> {
    let mut p = g.parser(Arc::new(tools));
    let mut ev = Vec::new();
    p.push(prefix, &mut ev);
    p.push(text, &mut ev);
    p.finish(&mut ev);
    ev.into_iter()
        .filter_map(|e| match e {
            ToolEvent::Call(c) => Some(c),
            // A call the prefix opens streams; its `Call` still ends it.
            ToolEvent::CallStart { .. } | ToolEvent::CallArgs(_) => None,
            ToolEvent::Text(t) if t.trim().is_empty() || t == "Let me look." => None,
            other => panic!("not a call: {other:?} in {prefix}{text:?}"),
        })
        .collect()
}

#[test]
fn forced_calls_under_the_grammar_are_valid_calls() {
    for (g, dir) in families() {
        forced_calls(g, &dir);
    }
}

fn forced_calls(family: &dyn ToolGrammar, dir: &std::path::Path) {
    let (tok, vocab, tools) = setup(dir);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    for (forced, parallel) in [
        (Forced::Required, false),
        (Forced::Named("set_mode".into()), false),
        (Forced::Required, true),
    ] {
        let Some(ToolConstraint::Whole(lark)) = family
            .constraint(&forced, &tools, parallel, None, &tok)
            .unwrap()
        else {
            panic!("{}: a whole-output grammar for {forced:?}", family.name())
        };
        let g = Grammar::lark(&vocab, &lark, "calls")
            .unwrap_or_else(|e| panic!("{}: {e}\n{lark}", family.name()));
        let prefix = family.forced_prefix(&forced).unwrap();
        let mut ended = 0;
        for _ in 0..12 {
            let (text, eos) = draw(&tok, &mut g.start(), &mut rng, 300);
            if !eos {
                // Parallel calls may go on past the budget; the others end.
                assert!(
                    parallel,
                    "{}: {forced:?} did not end: {text:?}",
                    family.name()
                );
                continue;
            }
            ended += 1;
            let calls = parse(family, &prefix, &text, tools.clone());
            if !parallel {
                assert_eq!(calls.len(), 1, "{text:?}");
            }
            let only = match &forced {
                Forced::Named(n) => Some(n.as_str()),
                _ => None,
            };
            check_calls(&tools, &calls, only);
        }
        assert!(ended > 0, "{}: {forced:?}: no output ended", family.name());
    }
}

#[test]
fn auto_constrains_each_call_the_model_opens() {
    for (g, dir) in families() {
        auto_calls(g, &dir);
    }
}

fn auto_calls(family: &dyn ToolGrammar, dir: &std::path::Path) {
    let (tok, vocab, tools) = setup(dir);
    let c = family
        .constraint(&Forced::Auto, &tools, false, None, &tok)
        .unwrap();
    let Some(ToolConstraint::Lazy { trigger, lark }) = c else {
        // Harmony's auto covers the whole turn.
        let Some(ToolConstraint::Whole(lark)) = c else {
            panic!("{}: no grammar for auto", family.name())
        };
        return whole_auto(family, &tok, &vocab, &tools, &lark, None);
    };
    assert_eq!(Some(trigger), tok.token_id("<tool_call>"));
    let g = Grammar::lazy_lark(&vocab, trigger, &lark, Some(1), "calls")
        .unwrap_or_else(|e| panic!("{}: {e}\n{lark}", family.name()));
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(6);
    for _ in 0..8 {
        let mut c = g.start();
        // Free text first, then the model opens a call.
        for t in tok.encode("Let me look.").unwrap() {
            assert!(c.mask().unwrap().is_none());
            c.commit(t).unwrap();
        }
        c.commit(trigger).unwrap();
        let (text, eos) = draw(&tok, &mut c, &mut rng, 300);
        assert!(eos, "{text:?}");
        let calls = parse(family, "Let me look.<tool_call>", &text, tools.clone());
        assert_eq!(calls.len(), 1);
        check_calls(&tools, &calls, None);
    }
}

/// Draws under a whole-output `auto` grammar: every output that ended is
/// well formed, its calls valid; with an `answer` schema the answer is
/// JSON valid against it. Both endings must occur.
fn whole_auto(
    family: &dyn ToolGrammar,
    tok: &Tokenizer,
    vocab: &Vocabulary,
    tools: &ToolSet,
    lark: &str,
    answer: Option<&Value>,
) {
    let g = Grammar::lark(vocab, lark, "auto")
        .unwrap_or_else(|e| panic!("{}: {e}\n{lark}", family.name()));
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let (mut answers, mut with_calls) = (0, 0);
    for _ in 0..16 {
        let (text, eos) = draw(tok, &mut g.start(), &mut rng, 300);
        let mut p = family.parser(Arc::new(tools.clone()));
        let mut ev = Vec::new();
        p.push(&text, &mut ev);
        p.finish(&mut ev);
        let (mut content, mut calls) = (String::new(), Vec::new());
        for e in ev {
            match e {
                ToolEvent::Call(c) => calls.push(c),
                ToolEvent::Text(t) => content.push_str(&t),
                ToolEvent::Reasoning(_) | ToolEvent::CallStart { .. } | ToolEvent::CallArgs(_) => {}
                ToolEvent::Malformed { error, .. } if eos => {
                    panic!("{}: {error} in {text:?}", family.name())
                }
                ToolEvent::Malformed { .. } => {}
            }
        }
        if !eos {
            continue;
        }
        if calls.is_empty() {
            answers += 1;
            if let Some(schema) = answer {
                let v: Value = serde_json::from_str(content.trim())
                    .unwrap_or_else(|e| panic!("{}: {e}: {text:?}", family.name()));
                check_answer(schema, &v);
            }
        } else {
            with_calls += 1;
            // With an answer format: the answer or calls, no other
            // content (harmony's preambles are content: not allowed then).
            assert!(content.trim().is_empty() || answer.is_none(), "{text:?}");
            check_calls(tools, &calls, None);
        }
    }
    assert!(
        answers > 0 && with_calls > 0,
        "{}: {answers} answers, {with_calls} with calls",
        family.name()
    );
}

/// The answer schema of [`answers_are_the_format_or_calls`]: `{"n": 0..=9}`.
fn answer_schema() -> Value {
    json!({"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
           "required": ["n"], "additionalProperties": false})
}

fn check_answer(schema: &Value, v: &Value) {
    assert_eq!(schema, &answer_schema());
    let o = v
        .as_object()
        .unwrap_or_else(|| panic!("not an object: {v}"));
    assert_eq!(o.len(), 1, "{v}");
    assert!((0..=9).contains(&o["n"].as_i64().unwrap()), "{v}");
}

/// `response_format` with tools under `auto`: the answer is the format's
/// JSON or the model calls tools; harmony without tools: its `final`
/// message is the JSON, its reasoning free.
#[test]
fn answers_are_the_format_or_calls() {
    let schema = answer_schema();
    let answer = krasis_model::structured::lark_json(&schema).unwrap();
    for (family, dir) in families() {
        let (tok, vocab, tools) = setup(&dir);
        let Some(ToolConstraint::Whole(lark)) = family
            .constraint(&Forced::Auto, &tools, true, Some(&answer), &tok)
            .unwrap()
        else {
            panic!("{}: a whole-output grammar for an answer", family.name())
        };
        whole_auto(family, &tok, &vocab, &tools, &lark, Some(&schema));
    }
    let dir = krasis_model::testutil::tiny_gpt_oss_checkpoint();
    let (tok, vocab, _) = setup(&dir);
    let Some(ToolConstraint::Whole(lark)) = Harmony.answer_constraint(&answer, &tok) else {
        panic!("harmony wraps the answer in its final channel")
    };
    let g = Grammar::lark(&vocab, &lark, "answer").unwrap();
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(8);
    let mut ended = 0;
    for _ in 0..12 {
        let (text, eos) = draw(&tok, &mut g.start(), &mut rng, 300);
        if !eos {
            continue;
        }
        ended += 1;
        let mut p = Harmony.parser(Arc::new(ToolSet::default()));
        let mut ev = Vec::new();
        p.push(&text, &mut ev);
        p.finish(&mut ev);
        let content: String = ev
            .into_iter()
            .filter_map(|e| match e {
                ToolEvent::Text(t) => Some(t),
                ToolEvent::Reasoning(_) => None,
                other => panic!("{other:?} in {text:?}"),
            })
            .collect();
        check_answer(&schema, &serde_json::from_str(&content).unwrap());
    }
    assert!(ended > 0);
    // The other families' answer is the whole output: no wrapper.
    assert!(HermesJson.answer_constraint(&answer, &tok).is_none());
}

/// The capability report's split (`ToolGrammar::constrains`) is what each
/// grammar's `constraint` does with its own family's vocabulary.
#[test]
fn constrains_says_what_constraint_does() {
    let qwen = krasis_model::testutil::tiny_checkpoint("tiny");
    let glm = krasis_model::testutil::tiny_glm4_moe_checkpoint();
    let oss = krasis_model::testutil::tiny_gpt_oss_checkpoint();
    for g in all_grammars() {
        let dir = match g.name() {
            "glm4-xml" => &glm,
            "harmony" => &oss,
            _ => &qwen,
        };
        let (tok, _, tools) = setup(dir);
        let c = g
            .constraint(&Forced::Required, &tools, true, None, &tok)
            .unwrap();
        assert_eq!(c.is_some(), g.constrains(), "{} required", g.name());
        let c = g
            .constraint(&Forced::Auto, &tools, true, None, &tok)
            .unwrap();
        assert_eq!(c.is_some(), g.constrains_auto(), "{} auto", g.name());
    }
}
