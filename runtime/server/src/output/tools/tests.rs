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
    // the text parses into does not (its `Call` ends it either way; the
    // `*stream*` tests below check streaming).
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

/// Pushes `text` one char at a time, then finishes; each event with how
/// many bytes of `text` had been pushed when it came.
fn trickle(grammar: &dyn ToolGrammar, tools: Arc<ToolSet>, text: &str) -> Vec<(usize, ToolEvent)> {
    let mut p = grammar.parser(tools);
    let mut timed = Vec::new();
    let mut out = Vec::new();
    for (i, c) in text.char_indices() {
        p.push(&c.to_string(), &mut out);
        timed.extend(out.drain(..).map(|e| (i + c.len_utf8(), e)));
    }
    p.finish(&mut out);
    timed.extend(out.drain(..).map(|e| (text.len(), e)));
    timed
}

/// One call as the events tell it: its arguments, and the joined fragments
/// when it was streamed.
#[derive(Debug)]
struct Told {
    arguments: Value,
    streamed: Option<String>,
}

/// The calls in `events`, each streamed one checked: its fragments join
/// into JSON equal to its `Call`'s arguments, under the same name. A start
/// that a `Malformed` ends yields no call.
fn told(events: impl IntoIterator<Item = ToolEvent>) -> Vec<Told> {
    let mut calls = Vec::new();
    let mut open: Option<(String, String)> = None;
    for e in events {
        match e {
            ToolEvent::CallStart { name } => {
                assert!(open.is_none(), "a start inside a call");
                open = Some((name, String::new()));
            }
            ToolEvent::CallArgs(f) => open.as_mut().expect("fragment outside a call").1 += &f,
            ToolEvent::Call(c) => {
                let arguments: Value = serde_json::from_str(&c.arguments).unwrap();
                let streamed = open.take().map(|(name, joined)| {
                    assert_eq!(name, c.name);
                    let v: Value = serde_json::from_str(&joined)
                        .unwrap_or_else(|e| panic!("{e}: fragments {joined:?}"));
                    assert_eq!(v, arguments, "fragments {joined:?} vs {}", c.arguments);
                    joined
                });
                calls.push(Told {
                    arguments,
                    streamed,
                });
            }
            ToolEvent::Malformed { .. } => open = None,
            ToolEvent::Text(_) | ToolEvent::Reasoning(_) => {}
        }
    }
    assert!(open.is_none(), "a call left open without Malformed");
    calls
}

const HARMONY: &str = "<|channel|>analysis<|message|>Weather, then.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|> {\"city\": \"Oslo\", \"days\": 3, \"opts\": {\"a\": [1, {}]}}\n<|call|>";

/// One call per grammar, its end tag, and its arguments.
fn one_call_each() -> Vec<(&'static dyn ToolGrammar, String, &'static str, Value)> {
    let want = json!({"city": "Oslo", "days": 3, "opts": {"a": [1, {}]}});
    vec![
        (
            &HermesJson,
            "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\", \"days\": 3, \"opts\": {\"a\": [1, {}]}}}\n</tool_call>".to_string(),
            "</tool_call>",
            want.clone(),
        ),
        (
            &QwenXml,
            "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{\"a\": [1, {}]}\n</parameter>\n</function>\n</tool_call>".to_string(),
            "</tool_call>",
            want.clone(),
        ),
        (
            &GlmXml,
            "Sure.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>opts</arg_key>\n<arg_value>{\"a\": [1, {}]}</arg_value>\n</tool_call>".to_string(),
            "</tool_call>",
            want.clone(),
        ),
        (&Harmony, HARMONY.to_string(), "<|call|>", want),
    ]
}

/// Fails if any grammar stops streaming: written one char at a time, each
/// call starts (its name) before its end tag, at least two argument
/// fragments come before that tag, and the fragments join into the call's
/// arguments.
#[test]
fn every_grammar_streams_its_calls_before_their_end() {
    for (grammar, text, end_tag, want) in one_call_each() {
        let g = grammar.name();
        let end = text.rfind(end_tag).unwrap();
        let timed = trickle(grammar, tools(), &text);
        let first = timed
            .iter()
            .find(|(_, e)| !matches!(e, ToolEvent::Text(_) | ToolEvent::Reasoning(_)))
            .unwrap_or_else(|| panic!("{g}: no call: {timed:?}"));
        assert_eq!(
            first.1,
            ToolEvent::CallStart {
                name: "get_weather".into()
            },
            "{g}"
        );
        assert!(first.0 <= end, "{g}: the name came at {} of {end}", first.0);
        let early = timed
            .iter()
            .filter(|(at, e)| *at <= end && matches!(e, ToolEvent::CallArgs(_)))
            .count();
        assert!(
            early >= 2,
            "{g}: {early} fragments before the end: {timed:?}"
        );
        let calls = told(timed.into_iter().map(|(_, e)| e));
        assert_eq!(calls.len(), 1, "{g}");
        assert!(calls[0].streamed.is_some(), "{g}");
        assert_eq!(calls[0].arguments, want, "{g}");
    }
}

/// The XML grammars stream each parameter, once complete, as a member of
/// the arguments object, typed as the complete call types it.
#[test]
fn xml_calls_stream_typed_members() {
    let qwen = "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
    let frags = |grammar: &dyn ToolGrammar, text: &str| -> Vec<String> {
        trickle(grammar, tools(), text)
            .into_iter()
            .filter_map(|(_, e)| match e {
                ToolEvent::CallArgs(f) => Some(f),
                _ => None,
            })
            .collect()
    };
    assert_eq!(
        frags(&QwenXml, qwen),
        ["{\"city\": \"San Francisco\"", ", \"days\": 3", "}"]
    );
    let glm = "<tool_call>get_weather\n<arg_key>metric</arg_key>\n<arg_value>true</arg_value>\n<arg_key>tags</arg_key>\n<arg_value>[\"x\"]</arg_value>\n</tool_call>";
    assert_eq!(
        frags(&GlmXml, glm),
        ["{\"metric\": true", ", \"tags\": [\"x\"]", "}"]
    );
    // A call without arguments streams an empty object.
    let empty = "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>";
    assert_eq!(frags(&QwenXml, empty), ["{}"]);
    assert_eq!(
        frags(&GlmXml, "<tool_call>get_weather\n</tool_call>"),
        ["{}"]
    );
}

/// Several calls, each streamed, of every value type, in both XML grammars
/// (and the texts the other tests use): the fragments join into the
/// arguments each `Call` carries.
#[test]
fn streamed_xml_fragments_join_into_the_calls_arguments() {
    let qwen = format!(
        "{XML}\n<tool_call>\n<function=get_weather>\n<parameter=tags>\n[1, \"a\", {{\"b\": null}}]\n</parameter>\n<parameter=metric>\nfalse\n</parameter>\n<parameter=ratio>\nNone\n</parameter>\n<parameter=days>\nmany\n</parameter>\n<parameter=note>\n  two\nlines \"quoted\" \\ </parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n</function>\n</tool_call>"
    );
    let calls = told(
        trickle(&QwenXml, tools(), &qwen)
            .into_iter()
            .map(|(_, e)| e),
    );
    assert_eq!(calls.len(), 3);
    assert!(calls.iter().all(|c| c.streamed.is_some()), "{calls:?}");
    assert_eq!(
        calls[1].arguments,
        json!({"tags": [1, "a", {"b": null}], "metric": false, "ratio": null,
               "days": "many", "note": "  two\nlines \"quoted\" \\ "})
    );
    assert_eq!(calls[2].arguments, json!({}));
    let calls = told(trickle(&GlmXml, tools(), GLM).into_iter().map(|(_, e)| e));
    assert_eq!(calls.len(), 2);
    assert!(calls.iter().all(|c| c.streamed.is_some()), "{calls:?}");
    assert_eq!(
        calls[0].arguments,
        json!({"city": "New York", "days": 5, "metric": true, "ratio": null,
               "opts": {"a": [1]}, "tags": ["x", "y"]})
    );
}

/// A Qwen3-Coder block may hold several functions: the first streams, the
/// others come whole when the block ends.
#[test]
fn a_block_of_several_functions_streams_the_first() {
    let text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>";
    let calls = told(trickle(&QwenXml, tools(), text).into_iter().map(|(_, e)| e));
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0].streamed.as_deref(), Some("{\"city\": \"Oslo\"}"));
    assert_eq!(calls[1].streamed, None);
    assert_eq!(calls[1].arguments, json!({"days": 2}));
}

/// A streamed call whose block then fails to parse ends as `Malformed`
/// (its whole text visible), never as a call.
#[test]
fn a_streamed_call_that_breaks_ends_malformed() {
    let cases: [(&dyn ToolGrammar, &str); 6] = [
        (
            &QwenXml,
            "<tool_call>\n<function=get_weather>\n<parameter=city>\na\n</parameter>\n<parameter=city>\nb\n</parameter>\n</function>\n</tool_call>",
        ),
        (
            &QwenXml,
            "<tool_call>\n<function=get_weather>\n<parameter=city>\na\n</parameter>\noops\n</function>\n</tool_call>",
        ),
        (
            &QwenXml,
            "<tool_call>\n<function=get_weather>\n<parameter=city>\na\n</parameter>\n</tool_call>",
        ),
        (
            &GlmXml,
            "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>a</arg_value>\nParis\n</tool_call>",
        ),
        (
            &GlmXml,
            "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>a</arg_value>\n<arg_key>city</arg_key>\n<arg_value>b</arg_value>\n</tool_call>",
        ),
        (
            &Harmony,
            "<|channel|>commentary to=functions.get_weather json<|message|>{\"city\": [1, 2]<|call|>",
        ),
    ];
    for (grammar, text) in cases {
        let events: Vec<ToolEvent> = trickle(grammar, tools(), text)
            .into_iter()
            .map(|(_, e)| e)
            .collect();
        assert!(
            matches!(events.first(), Some(ToolEvent::CallStart { .. })),
            "{text}: {events:?}"
        );
        assert!(
            matches!(events.last(), Some(ToolEvent::Malformed { .. })),
            "{text}: {events:?}"
        );
        assert!(told(events).is_empty(), "{text}");
    }
}

proptest! {
    /// However the text is split, a streamed call's fragments join into its
    /// arguments, and the calls are those of the unsplit text.
    #[test]
    fn streamed_fragments_join_into_the_call_in_any_split(
        cuts in proptest::collection::vec(0usize..400, 0..30),
    ) {
        for (grammar, text, _, want) in one_call_each() {
            let mut p = grammar.parser(tools());
            let mut out = Vec::new();
            for c in chunked(&text, &cuts) {
                p.push(c, &mut out);
            }
            p.finish(&mut out);
            let calls = told(out);
            prop_assert_eq!(calls.len(), 1);
            prop_assert_eq!(&calls[0].arguments, &want);
        }
    }
}
