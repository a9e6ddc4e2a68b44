//! gpt-oss harmony output: the parser against OpenAI's own parser (the
//! `openai-harmony` package, through `tests/fixtures/harmony/completions.json`
//! written by `tools/harmony/oracle.py`), streamed in every split; then the
//! chat endpoint with a harmony template.

mod common;

use common::*;
use krasis_model::chat_template::ChatTemplate;
use krasis_server::output::tools::{
    Forced, Harmony, Scanner, Segment, ToolGrammar, ToolSet, detect_grammar,
};
use krasis_server::output::{OutputEvent, OutputParser};
use serde_json::{Value, json};
use std::path::PathBuf;
use std::sync::Arc;

fn fixture() -> Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/harmony/completions.json");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    serde_json::from_str(&text).unwrap()
}

/// The completion cut into pieces at the given byte offsets (char boundaries).
fn pieces<'a>(text: &'a str, cuts: &[usize]) -> Vec<&'a str> {
    let mut out = Vec::new();
    let mut last = 0;
    for &c in cuts {
        out.push(&text[last..c]);
        last = c;
    }
    out.push(&text[last..]);
    out
}

/// Every way the tests stream a completion: whole, split once at each char
/// boundary, and one char at a time.
fn splits(text: &str) -> Vec<Vec<&str>> {
    let bounds: Vec<usize> = text.char_indices().map(|(i, _)| i).skip(1).collect();
    let mut all = vec![vec![text]];
    all.extend(bounds.iter().map(|&b| pieces(text, &[b])));
    all.push(pieces(text, &bounds));
    all
}

/// Messages as the oracle's fixture writes them.
fn scan(chunks: &[&str]) -> Vec<Value> {
    let mut s = Scanner::default();
    let mut segs = Vec::new();
    for c in chunks {
        s.push(c, &mut segs);
    }
    s.finish(&mut segs);
    let mut msgs: Vec<Value> = Vec::new();
    for seg in segs {
        match seg {
            Segment::Begin(h) => msgs.push(json!({
                "channel": h.channel, "recipient": h.recipient,
                "content_type": h.content_type, "content": "",
            })),
            Segment::Text(t) => {
                let m = msgs.last_mut().expect("text before any header");
                let c = m["content"].as_str().unwrap().to_string() + &t;
                m["content"] = json!(c);
            }
            Segment::End => {}
        }
    }
    msgs
}

#[test]
fn scanner_reads_every_completion_as_openai_harmony_does_in_every_split() {
    let f = fixture();
    let cases = f["cases"].as_array().unwrap();
    assert!(cases.len() >= 8);
    for case in cases {
        let completion = case["completion"].as_str().unwrap();
        let expected = case["messages"].as_array().unwrap();
        for chunks in splits(completion) {
            assert_eq!(
                &scan(&chunks),
                expected,
                "case {} split as {chunks:?}",
                case["name"]
            );
        }
    }
}

fn all_tools() -> Arc<ToolSet> {
    let names = ["get_weather", "get_time", "search", "write_file"];
    let tools: Vec<Value> = names
        .iter()
        .map(|n| json!({"type": "function", "function": {"name": n}}))
        .collect();
    Arc::new(ToolSet::from_openai(&tools))
}

/// (reasoning, content, [(name, arguments)]) with text pieces joined.
type Answer = (String, String, Vec<(String, Value)>);

fn answer(tools: Arc<ToolSet>, chunks: &[&str]) -> Answer {
    let mut p = OutputParser::whole(Harmony.parser(tools));
    let mut events = Vec::new();
    for c in chunks {
        events.extend(p.push(c));
    }
    events.extend(p.finish());
    let (mut r, mut c, mut calls) = (String::new(), String::new(), Vec::new());
    // The streamed call: its index, name and the fragments so far.
    let mut open: Option<(usize, String, String)> = None;
    for e in events {
        match e {
            OutputEvent::Reasoning(t) => r.push_str(&t),
            OutputEvent::Content(t) => c.push_str(&t),
            OutputEvent::ToolCall {
                index,
                name,
                arguments,
                ..
            } => {
                assert_eq!(index, calls.len());
                calls.push((name, serde_json::from_str(&arguments).unwrap()));
            }
            // A call streams from its header on; one whose arguments turn
            // out not to be an object stays unfinished (its body is content).
            OutputEvent::ToolCallStart { index, name, .. } => {
                assert_eq!(index, calls.len());
                open = Some((index, name, String::new()));
            }
            OutputEvent::ToolCallArgs { index, fragment } => {
                let (i, _, joined) = open.as_mut().expect("fragment outside a call");
                assert_eq!(index, *i);
                joined.push_str(&fragment);
            }
            OutputEvent::ToolCallEnd { index, arguments } => {
                let (i, name, joined) = open.take().expect("end outside a call");
                assert_eq!(index, i);
                let args: Value = serde_json::from_str(&arguments).unwrap();
                // What a streaming client joins is the same JSON.
                let streamed: Value = serde_json::from_str(&joined)
                    .unwrap_or_else(|e| panic!("{e}: fragments {joined:?}"));
                assert_eq!(streamed, args);
                calls.push((name, args));
            }
        }
    }
    (r, c, calls)
}

/// The documented mapping applied to the oracle's messages.
fn expected_answer(messages: &[Value]) -> Answer {
    let (mut r, mut c, mut calls) = (String::new(), String::new(), Vec::new());
    for m in messages {
        let content = m["content"].as_str().unwrap();
        match (m["channel"].as_str(), m["recipient"].as_str()) {
            (_, Some(to)) => {
                let name = to.strip_prefix("functions.").unwrap().to_string();
                calls.push((name, serde_json::from_str(content).unwrap()));
            }
            (Some("analysis"), None) => r.push_str(content),
            _ => c.push_str(content),
        }
    }
    (r, c, calls)
}

#[test]
fn channels_map_to_reasoning_content_and_tool_calls_in_every_split() {
    let f = fixture();
    for case in f["cases"].as_array().unwrap() {
        let completion = case["completion"].as_str().unwrap();
        let expected = expected_answer(case["messages"].as_array().unwrap());
        for chunks in splits(completion) {
            assert_eq!(
                answer(all_tools(), &chunks),
                expected,
                "case {} split as {chunks:?}",
                case["name"]
            );
        }
    }
}

const CALL: &str = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>";

#[test]
fn calls_that_cannot_be_handed_to_the_client_stay_text() {
    // Arguments that are not a JSON object: returned as content, no call.
    for bad in ["{\"city\": ", "[1, 2]", "not json"] {
        let text = format!("{CALL}{bad}<|call|>");
        assert_eq!(
            answer(all_tools(), &[&text]),
            (String::new(), bad.to_string(), vec![]),
            "{bad}"
        );
    }
    // Cut off by max_tokens mid-arguments: the same.
    let cut = format!("{CALL}{{\"city\": \"Os");
    assert_eq!(answer(all_tools(), &[&cut]).2, vec![]);
    // No tools declared, or an undeclared function: not a call.
    let ok = format!("{CALL}{{\"city\":\"Oslo\"}}<|call|>");
    let none = answer(Arc::new(ToolSet::default()), &[&ok]);
    assert_eq!(none, (String::new(), "{\"city\":\"Oslo\"}".into(), vec![]));
    let browse = "<|channel|>analysis to=browser.search<|message|>{\"query\":\"x\"}<|call|>";
    assert_eq!(
        answer(all_tools(), &[browse]),
        ("{\"query\":\"x\"}".into(), String::new(), vec![])
    );
}

#[test]
fn unfinished_or_markerless_output_is_handled() {
    // A header cut off before its message began carries no text.
    let cut = "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|chan";
    assert_eq!(
        answer(all_tools(), &[cut]),
        ("hm".into(), String::new(), vec![])
    );
    // Output that never speaks harmony is still the answer.
    assert_eq!(
        answer(all_tools(), &["plain words"]),
        (String::new(), "plain words".into(), vec![])
    );
    // Truncated reasoning is reasoning, including a dangling `<|`.
    assert_eq!(
        answer(all_tools(), &["<|channel|>analysis<|message|>half <|"]),
        ("half <|".into(), String::new(), vec![])
    );
}

#[test]
fn forced_choice_prefixes_parse_as_the_call_they_force() {
    let named = Harmony
        .forced_prefix(&Forced::Named("get_weather".into()))
        .unwrap();
    let required = Harmony.forced_prefix(&Forced::Required).unwrap();
    assert!(Harmony.forced_prefix(&Forced::Auto).is_none());
    let want = vec![("get_weather".to_string(), json!({"city": "Oslo"}))];
    let a = answer(all_tools(), &[&named, "{\"city\":\"Oslo\"}<|call|>"]);
    assert_eq!(a.2, want);
    let b = answer(
        all_tools(),
        &[
            &required,
            "get_weather <|constrain|>json<|message|>{\"city\":\"Oslo\"}",
        ],
    );
    assert_eq!(b.2, want);
}

/// A reduced harmony template (the markers, the system message with
/// `Reasoning:` and the generation prompt as the gpt-oss template writes
/// them); enough for detection, rendering and the kwargs.
const HARMONY_TEMPLATE: &str = "\
{%- if reasoning_effort is not defined %}{%- set reasoning_effort = 'medium' %}{%- endif -%}\
<|start|>system<|message|>You are ChatGPT.\n\
Reasoning: {{ reasoning_effort }}\n\n# Valid channels: analysis, commentary, final.<|end|>\
{%- for m in messages %}<|start|>{{ m.role }}\
{%- if m.role == 'assistant' %}<|channel|>final{% endif %}<|message|>{{ m.content }}<|end|>\
{%- endfor %}\
{%- if add_generation_prompt %}<|start|>assistant{%- endif %}";

#[test]
fn harmony_templates_select_the_harmony_grammar() {
    assert_eq!(detect_grammar(HARMONY_TEMPLATE).unwrap().name(), "harmony");
    assert!(detect_grammar(HARMONY_TEMPLATE).unwrap().whole_output());
    // The Qwen markers alone do not.
    assert_ne!(detect_grammar("<tool_call>").unwrap().name(), "harmony");
}

fn harmony_harness(reply: impl Fn(&str) -> String + Send + 'static) -> Harness {
    let opts = Opts {
        template: Some(
            ChatTemplate::from_source(HARMONY_TEMPLATE, None, Some("<|return|>".into())).unwrap(),
        ),
        ..Opts::default()
    };
    harness(opts, reply)
}

fn user(text: &str) -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": text}]})
}

#[tokio::test]
async fn chat_splits_channels_and_passes_reasoning_effort_to_the_template() {
    let h = harmony_harness(|prompt| {
        let effort = prompt
            .lines()
            .find_map(|l| l.strip_prefix("Reasoning: "))
            .unwrap_or("?")
            .to_string();
        format!(
            "<|channel|>analysis<|message|>effort {effort}<|end|><|start|>assistant<|channel|>final<|message|>Hi!"
        )
    });
    let mut body = user("hi");
    let (status, v) = post_json(&app(&h), "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    let m = &v["choices"][0]["message"];
    assert_eq!(m["content"], "Hi!");
    assert_eq!(m["reasoning_content"], "effort medium");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");

    body["reasoning_effort"] = json!("high");
    let (status, v) = post_json(&app(&h), "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["reasoning"], "effort high");

    body["reasoning_effort"] = json!("extreme");
    let (status, v) = post_json(&app(&h), "/v1/chat/completions", &body).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "reasoning_effort");

    body["reasoning_effort"] = json!("low");
    body["chat_template_kwargs"] = json!({"reasoning_effort": "high"});
    let (status, _) = post_json(&app(&h), "/v1/chat/completions", &body).await;
    assert_eq!(status, 400);
}

#[tokio::test]
async fn streamed_harmony_call_follows_the_openai_shape() {
    let h = harmony_harness(|_| {
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\", \"days\": 2}<|call|>".into()
    });
    let (events, text) = stream_weather(&h).await;
    let delta = |key: &str| -> String {
        events
            .iter()
            .filter_map(|e| e["choices"][0]["delta"][key].as_str())
            .collect()
    };
    assert_eq!(delta("reasoning_content"), "Need weather.");
    assert_eq!(delta("content"), "Checking.");
    let frags = assert_streamed_weather_call(&events);
    // The start at the header, then the body as it arrives.
    assert!(frags.len() >= 3, "{text}");
    assert!(
        !text.contains("<|"),
        "no harmony marker reaches the client: {text}"
    );
}

/// The checkpoint's own template (see tests/fixtures/harmony/README.md).
fn gpt_oss_template() -> ChatTemplate {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/harmony/openai-gpt-oss-120b.jinja");
    let src = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path:?}: {e}"));
    ChatTemplate::from_source(&src, None, Some("<|return|>".into())).unwrap()
}

#[tokio::test]
async fn the_checkpoint_template_is_detected_and_renders_effort_and_tools() {
    let t = gpt_oss_template();
    assert_eq!(detect_grammar(t.source()).unwrap().name(), "harmony");
    let h = harness(
        Opts {
            template: Some(t),
            ..Opts::default()
        },
        |prompt| {
            assert!(prompt.contains("Reasoning: low\n"), "{prompt}");
            assert!(prompt.contains("namespace functions {"), "{prompt}");
            assert!(prompt.contains("type get_weather = (_: {"), "{prompt}");
            // The previous call, its reasoning and its result, as harmony
            // writes them.
            assert!(prompt.contains("<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant to="), "{prompt}");
            assert!(prompt.contains(
                "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
            ), "{prompt}");
            assert!(
                prompt.contains(
                    "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
                ),
                "{prompt}"
            );
            assert!(prompt.ends_with("<|start|>assistant"), "{prompt}");
            "<|channel|>analysis<|message|>It is sunny.<|end|><|start|>assistant<|channel|>final<|message|>Sunny, 21 °C.".into()
        },
    );
    let body = json!({
        "model": MODEL,
        "reasoning_effort": "low",
        "tools": [weather_tool()],
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": null, "reasoning_content": "Need the weather.", "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}
            }]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
        ],
    });
    let (status, v) = post_json(&app(&h), "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    let m = &v["choices"][0]["message"];
    assert_eq!(m["content"], "Sunny, 21 °C.");
    assert_eq!(m["reasoning_content"], "It is sunny.");
}

#[tokio::test]
async fn harmony_models_decode_special_tokens_for_the_parser() {
    // The test vocabulary's `<|im_start|>` stands in for gpt-oss's special
    // markers: dropped in decoding, the parser could never see `<|channel|>`.
    let h = harmony_harness(|_| "<|channel|>final<|message|>a<|im_start|>b".into());
    let (status, v) = post_json(&app(&h), "/v1/chat/completions", &user("hi")).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "a<|im_start|>b");
}

#[tokio::test]
async fn a_tool_call_message_with_content_and_reasoning_still_renders() {
    // The template refuses `thinking` beside content on a tool-call message;
    // the content is then what it renders as the analysis.
    let h = harness(
        Opts {
            template: Some(gpt_oss_template()),
            ..Opts::default()
        },
        |prompt| {
            assert!(
                prompt.contains("<|channel|>analysis<|message|>Checking.<|end|>"),
                "{prompt}"
            );
            "<|channel|>final<|message|>Done.".into()
        },
    );
    let body = json!({
        "model": MODEL,
        "tools": [weather_tool()],
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "Checking.", "reasoning_content": "Need it.", "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}
            }]},
            {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
        ],
    });
    let (status, v) = post_json(&app(&h), "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "Done.");
}

/// A harness over tiny-gpt-oss's own tokenizer (harmony's markers are its
/// special tokens, so the grammars over them apply) and the checkpoint's
/// template; the scripted model's tokens must pass the request's grammar.
fn gpt_oss_harness(reply: &'static str) -> Harness {
    let dir = krasis_model::testutil::tiny_gpt_oss_checkpoint();
    let tok = krasis_model::tokenizer::Tokenizer::from_dir(&dir).unwrap();
    let opts = Opts {
        template: Some(gpt_oss_template()),
        tokenizer: Some(Arc::new(tok)),
        ..Opts::default()
    };
    harness(opts, move |_| reply.to_string())
}

const ANALYSIS: &str = "<|channel|>analysis<|message|>Plan.<|end|><|start|>assistant";

#[tokio::test]
async fn response_format_is_the_final_message_and_auto_constrains_the_turn() {
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}},
                        "required": ["n"], "additionalProperties": false});
    let format = json!({"type": "json_schema", "json_schema": {"name": "n", "schema": schema}});
    let ask = |extra: Value| {
        let mut b = user("n?");
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    // The reasoning is free, the final message is the JSON.
    let json_answer: &'static str =
        Box::leak(format!("{ANALYSIS}<|channel|>final<|message|>{{\"n\": 3}}").into_boxed_str());
    let h = gpt_oss_harness(json_answer);
    let (status, v) = post_json(
        &app(&h),
        "/v1/chat/completions",
        &ask(json!({"response_format": format})),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let m = &v["choices"][0]["message"];
    assert_eq!(
        (m["reasoning_content"].as_str(), m["content"].as_str()),
        (Some("Plan."), Some("{\"n\": 3}"))
    );
    // With tools under auto: the JSON, or a call.
    let with_tools = json!({"response_format": format, "tools": [weather_tool()]});
    let (status, v) = post_json(&app(&h), "/v1/chat/completions", &ask(with_tools.clone())).await;
    assert_eq!(
        (status, v["choices"][0]["message"]["content"].as_str()),
        (200, Some("{\"n\": 3}")),
        "{v}"
    );
    let call = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}<|call|>";
    let h = gpt_oss_harness(call);
    let (status, v) = post_json(&app(&h), "/v1/chat/completions", &ask(with_tools)).await;
    assert_eq!(
        (status, v["choices"][0]["finish_reason"].as_str()),
        (200, Some("tool_calls")),
        "{v}"
    );

    // What the grammars refuse: the script is the model, so a refused
    // token fails the request (a sampler could not have drawn it).
    for (reply, extra) in [
        // A final answer that is not the format's JSON.
        (
            "<|channel|>final<|message|>three",
            json!({"response_format": format}),
        ),
        // A preamble when the content must be the JSON alone.
        (
            "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>{\"n\": 1}",
            json!({"response_format": format}),
        ),
        // Under auto, a call to an undeclared function, and arguments
        // its schema refuses.
        (
            "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}<|call|>",
            json!({"tools": [weather_tool()]}),
        ),
        (
            "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"days\": 2}<|call|>",
            json!({"tools": [weather_tool()]}),
        ),
    ] {
        let h = gpt_oss_harness(reply);
        let (status, v) = post_json(&app(&h), "/v1/chat/completions", &ask(extra)).await;
        assert_ne!(status, 200, "{reply}: {v}");
        assert!(
            v.to_string().contains("breaks the request's grammar"),
            "{reply}: {v}"
        );
    }
    // Under auto, free reasoning, a preamble and a call with the recipient
    // before the channel pass.
    let h = gpt_oss_harness(
        "<|channel|>analysis<|message|>Need it.<|end|><|start|>assistant<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Oslo\"}<|call|>",
    );
    let (status, v) = post_json(
        &app(&h),
        "/v1/chat/completions",
        &ask(json!({"tools": [weather_tool()]})),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let m = &v["choices"][0]["message"];
    assert_eq!(m["content"], "Checking.");
    assert_eq!(m["tool_calls"][0]["function"]["name"], "get_weather");
}

/// A named `tool_choice`: the server's opening is the call's header, so
/// the streamed call starts there; the call reaches the client whole or
/// streamed.
#[tokio::test]
async fn a_named_harmony_call_reaches_the_client_whole_or_streamed() {
    let h = gpt_oss_harness("{\"city\": \"Paris\", \"days\": 2}<|call|>");
    assert_named_weather_call(&h).await;
}
