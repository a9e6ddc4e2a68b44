use super::*;
use proptest::prelude::*;
use serde_json::{Value, json};

fn tools() -> Arc<ToolSet> {
    Arc::new(ToolSet::from_openai(&[json!({
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "ratio": {"type": ["number", "null"]},
                    "opts": {"type": "object"},
                    "tags": {"type": "array"}
                }
            }
        }
    })]))
}

/// Text and calls, with adjacent text pieces merged (chunking may split them).
fn run(grammar: &dyn ToolGrammar, chunks: &[&str]) -> Vec<ToolEvent> {
    let mut p = grammar.parser(tools());
    let mut out = Vec::new();
    for c in chunks {
        p.push(c, &mut out);
    }
    p.finish(&mut out);
    let mut merged: Vec<ToolEvent> = Vec::new();
    // A streamed call's start and fragments depend on the chunking; what
    // the text parses into does not (its `Call` ends it either way;
    // `hermes_calls_stream_name_then_argument_fragments` checks streaming).
    let out = out
        .into_iter()
        .filter(|e| !matches!(e, ToolEvent::CallStart { .. } | ToolEvent::CallArgs(_)));
    for e in out {
        match (merged.last_mut(), e) {
            (Some(ToolEvent::Text(a)), ToolEvent::Text(b)) => a.push_str(&b),
            (_, e) => merged.push(e),
        }
    }
    merged
}

fn call(name: &str, args: Value) -> ToolEvent {
    ToolEvent::Call(ParsedCall {
        name: name.into(),
        arguments: args.to_string(),
    })
}

const HERMES: &str = "Let me check.\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 3}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";

const XML: &str = "I'll look.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n5\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n<parameter=ratio>\n0.5\n</parameter>\n<parameter=opts>\n{\"a\": [1]}\n</parameter>\n<parameter=tags>\n[\"x\"]\n</parameter>\n</function>\n</tool_call>";

#[test]
fn hermes_calls_are_parsed_and_layout_dropped() {
    assert_eq!(
        run(&HermesJson, &[HERMES]),
        vec![
            ToolEvent::Text("Let me check.".into()),
            call("get_weather", json!({"city": "Paris", "days": 3})),
            call("get_weather", json!({"city": "Oslo"})),
        ]
    );
}

#[test]
fn xml_values_follow_the_schema_types() {
    assert_eq!(
        run(&QwenXml, &[XML]),
        vec![
            ToolEvent::Text("I'll look.".into()),
            call(
                "get_weather",
                json!({"city": "New York", "days": 5, "metric": true, "ratio": 0.5,
                       "opts": {"a": [1]}, "tags": ["x"]})
            ),
        ]
    );
}

#[test]
fn xml_value_that_does_not_fit_the_schema_stays_a_string() {
    let text = "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n<parameter=extra>\n42\n</parameter>\n</function>\n</tool_call>";
    assert_eq!(
        run(&QwenXml, &[text]),
        vec![call("get_weather", json!({"days": "three", "extra": "42"}))]
    );
}

/// As GLM-4.5's template renders calls (`v | tojson if v is not string else v`):
/// two blocks back to back, string values raw (one spans lines and looks like
/// JSON), the others JSON.
const GLM: &str = "I'll check both.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>New York</arg_value>\n<arg_key>days</arg_key>\n<arg_value>5</arg_value>\n<arg_key>metric</arg_key>\n<arg_value>true</arg_value>\n<arg_key>ratio</arg_key>\n<arg_value>null</arg_value>\n<arg_key>opts</arg_key>\n<arg_value>{\"a\": [1]}</arg_value>\n<arg_key>tags</arg_key>\n<arg_value>[\"x\", \"y\"]</arg_value>\n</tool_call><tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>{\"not\": \"json\"}\nline 2</arg_value>\n</tool_call>";

#[test]
fn glm_calls_are_parsed_with_schema_typed_arguments() {
    assert_eq!(
        run(&GlmXml, &[GLM]),
        vec![
            ToolEvent::Text("I'll check both.".into()),
            call(
                "get_weather",
                json!({"city": "New York", "days": 5, "metric": true, "ratio": null,
                       "opts": {"a": [1]}, "tags": ["x", "y"]})
            ),
            call(
                "get_weather",
                json!({"city": "{\"not\": \"json\"}\nline 2"})
            ),
        ]
    );
    // A call without arguments.
    assert_eq!(
        run(&GlmXml, &["<tool_call>get_weather\n</tool_call>"]),
        vec![call("get_weather", json!({}))]
    );
}

#[test]
fn malformed_glm_calls_stay_visible() {
    for bad in [
        "A <tool_call>get_weather\n<arg_key>city</arg_key>\nParis\n</tool_call> B",
        "A <tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris\n</tool_call>",
        "A <tool_call>\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
        "A <tool_call>get_weather\n<arg_key>city</arg_key><arg_value>a</arg_value><arg_key>city</arg_key><arg_value>b</arg_value></tool_call>",
        "A <tool_call>{\"name\": \"get_weather\"}</tool_call>",
    ] {
        assert_eq!(visible(run(&GlmXml, &[bad])), (bad.into(), 1), "{bad}");
    }
    let cut = "A\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par";
    assert_eq!(visible(run(&GlmXml, &[cut])), (cut.into(), 1));
}

/// All the text (malformed blocks' included) and how many blocks were
/// malformed: a broken call loses no text and is never plain text.
fn visible(events: Vec<ToolEvent>) -> (String, usize) {
    let mut text = String::new();
    let mut errors = 0;
    for e in events {
        match e {
            ToolEvent::Text(t) => text.push_str(&t),
            ToolEvent::Malformed { text: t, error } => {
                assert!(error.contains("tool call"), "{error}");
                text.push_str(&t);
                errors += 1;
            }
            other => panic!("{other:?}"),
        }
    }
    (text, errors)
}

#[test]
fn glm_forced_prefixes_then_model_output_parse() {
    let prefix = GlmXml
        .forced_prefix(&Forced::Named("get_weather".into()))
        .unwrap();
    assert_eq!(
        run(
            &GlmXml,
            &[
                &prefix,
                "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
            ]
        ),
        vec![call("get_weather", json!({"days": 2}))]
    );
    let prefix = GlmXml.forced_prefix(&Forced::Required).unwrap();
    assert_eq!(
        run(&GlmXml, &[&prefix, "get_weather\n</tool_call>"]),
        vec![call("get_weather", json!({}))]
    );
    assert!(GlmXml.forced_prefix(&Forced::Auto).is_none());
}

#[test]
fn malformed_and_truncated_calls_stay_visible() {
    let bad = "A <tool_call>{\"name\": oops}</tool_call> B";
    assert_eq!(visible(run(&HermesJson, &[bad])), (bad.into(), 1));
    let cut = "A\n<tool_call>\n<function=get_weather>\n<parameter=city>\nPar";
    assert_eq!(visible(run(&QwenXml, &[cut])), (cut.into(), 1));
}

#[test]
fn text_that_only_looks_like_a_tag_is_released() {
    assert_eq!(
        run(&HermesJson, &["a <tool", "_cal", "x> b"]),
        vec![ToolEvent::Text("a <tool_calx> b".into())]
    );
}

#[test]
fn forced_prefix_then_model_output_parses() {
    let prefix = HermesJson
        .forced_prefix(&Forced::Named("get_weather".into()))
        .unwrap();
    let out = run(
        &HermesJson,
        &[&prefix, "{\"city\": \"Rome\"}}\n</tool_call>"],
    );
    assert_eq!(out, vec![call("get_weather", json!({"city": "Rome"}))]);
    let prefix = QwenXml.forced_prefix(&Forced::Required).unwrap();
    let out = run(
        &QwenXml,
        &[
            &prefix,
            "get_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
        ],
    );
    assert_eq!(out, vec![call("get_weather", json!({"days": 2}))]);
}

#[test]
fn grammar_is_detected_from_the_template() {
    assert_eq!(
        detect_grammar("{{ '<tool_call>\\n<function=' }}<parameter=")
            .unwrap()
            .name(),
        "qwen3-coder-xml"
    );
    assert_eq!(
        detect_grammar("x <tool_call> y").unwrap().name(),
        "hermes-json"
    );
    assert!(detect_grammar("{{ messages }}").is_none());
    // GLM-4.5's template also writes `<tool_call>`; its argument pairs win.
    let glm = krasis_model::tokenizer::GLM4_CHAT_TEMPLATE;
    assert!(glm.contains("<tool_call>"));
    assert_eq!(detect_grammar(glm).unwrap().name(), "glm4-xml");
}

fn chunked<'a>(text: &'a str, cuts: &[usize]) -> Vec<&'a str> {
    let mut idx: Vec<usize> = cuts
        .iter()
        .copied()
        .filter(|c| *c <= text.len() && text.is_char_boundary(*c))
        .collect();
    idx.sort();
    let mut chunks = Vec::new();
    let mut last = 0;
    for i in idx {
        chunks.push(&text[last..i]);
        last = i;
    }
    chunks.push(&text[last..]);
    chunks
}

fn pieces() -> impl Strategy<Value = String> {
    let parts = prop_oneof![
        Just(HERMES.to_string()),
        Just(XML.to_string()),
        Just("<tool_call>".to_string()),
        Just("</tool_call>".to_string()),
        Just("\n".to_string()),
        Just(" ".to_string()),
        Just("text".to_string()),
        Just("<tool".to_string()),
    ];
    proptest::collection::vec(parts, 0..5).prop_map(|v| v.concat())
}

proptest! {
    #[test]
    fn hermes_chunking_does_not_change_the_result(
        text in pieces(),
        cuts in proptest::collection::vec(0usize..700, 0..12),
    ) {
        prop_assert_eq!(run(&HermesJson, &chunked(&text, &cuts)), run(&HermesJson, &[&text]));
    }

    #[test]
    fn xml_chunking_does_not_change_the_result(
        text in pieces(),
        cuts in proptest::collection::vec(0usize..700, 0..12),
    ) {
        prop_assert_eq!(run(&QwenXml, &chunked(&text, &cuts)), run(&QwenXml, &[&text]));
    }

    #[test]
    fn glm_calls_survive_any_split(cuts in proptest::collection::vec(0usize..600, 0..20)) {
        prop_assert_eq!(run(&GlmXml, &chunked(GLM, &cuts)), run(&GlmXml, &[GLM]));
    }

    #[test]
    fn single_call_survives_any_split(cuts in proptest::collection::vec(0usize..400, 0..20)) {
        let out = run(&QwenXml, &chunked(XML, &cuts));
        prop_assert_eq!(out.len(), 2);
        prop_assert!(matches!(&out[1], ToolEvent::Call(c) if c.name == "get_weather"));
    }
}

/// Hermes calls stream: the name as soon as it is written, then the
/// arguments in fragments that join into the call's JSON (never the call's
/// own closing brace or a piece of the end tag), then the complete call.
#[test]
fn hermes_calls_stream_name_then_argument_fragments() {
    let text = "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome }\", \"days\": 2, \"opts\": {\"a\": {}}}}\n</tool_call>";
    let mut p = HermesJson.parser(tools());
    let mut out = Vec::new();
    for c in text.chars() {
        p.push(&c.to_string(), &mut out);
    }
    p.finish(&mut out);
    let start = out
        .iter()
        .position(|e| matches!(e, ToolEvent::CallStart { .. }))
        .expect("a call start");
    assert_eq!(
        out[start],
        ToolEvent::CallStart {
            name: "get_weather".into()
        }
    );
    let frags: Vec<&str> = out
        .iter()
        .filter_map(|e| match e {
            ToolEvent::CallArgs(f) => Some(f.as_str()),
            _ => None,
        })
        .collect();
    assert!(frags.len() > 5, "{out:?}");
    let args = frags.concat();
    let want = json!({"city": "Rome }", "days": 2, "opts": {"a": {}}});
    assert_eq!(
        serde_json::from_str::<Value>(&args).unwrap(),
        want,
        "{args}"
    );
    let Some(ToolEvent::Call(c)) = out.last() else {
        panic!("{out:?}")
    };
    assert_eq!(serde_json::from_str::<Value>(&c.arguments).unwrap(), want);
    // All at once: nothing to stream, the call comes whole.
    assert_eq!(
        run(&HermesJson, &[text]),
        vec![ToolEvent::Text("Sure.".into()), call("get_weather", want)]
    );
}
