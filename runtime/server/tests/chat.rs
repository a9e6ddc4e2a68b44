//! Chat completions through the router (no socket): the real tokenizer,
//! template and parsers with a scripted engine.

mod common;

use common::*;
use krasis_model::chat_template::{ChatTemplate, QWEN3_CODER_CHAT_TEMPLATE};
use serde_json::{Value, json};

fn user(text: &str) -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": text}]})
}

#[tokio::test]
async fn non_streaming_chat_splits_reasoning_and_reports_usage() {
    let h = harness(Opts::default(), |_| {
        "<think>\nThe user greets.\n</think>\n\nHello there!".into()
    });
    let (status, v) = post_json(&app(&h), "/v1/chat/completions", &user("hi")).await;
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"], "Hello there!");
    assert_eq!(choice["message"]["reasoning_content"], "The user greets.\n");
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], MODEL);
    let u = &v["usage"];
    assert!(u["prompt_tokens"].as_u64().unwrap() > 3);
    assert!(u["completion_tokens"].as_u64().unwrap() > 3);
    assert_eq!(
        u["total_tokens"].as_u64(),
        Some(u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap())
    );
}

#[tokio::test]
async fn streaming_chat_sends_role_reasoning_content_finish_usage_and_done() {
    let h = harness(Opts::default(), |_| {
        "<think>\nHmm.\n</think>\n\nHi, café!".into()
    });
    let mut body = user("hi");
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (status, headers, text) = send(&app(&h), post("/v1/chat/completions", &body)).await;
    assert_eq!(status, 200);
    // With the charset: without it `requests` decodes the stream as
    // ISO-8859-1 (where 0x85, inside many UTF-8 characters, is a newline).
    assert_eq!(headers["content-type"], "text/event-stream; charset=utf-8");
    let (events, done) = sse_events(&text);
    assert!(done, "stream must end with [DONE]: {text}");
    assert_eq!(events[0]["choices"][0]["delta"]["role"], "assistant");
    let (mut reasoning, mut content) = (String::new(), String::new());
    for e in &events {
        assert_eq!(e["object"], "chat.completion.chunk");
        if let Some(c) = e["choices"].get(0) {
            let d = &c["delta"];
            reasoning.push_str(d["reasoning_content"].as_str().unwrap_or(""));
            content.push_str(d["content"].as_str().unwrap_or(""));
            assert_eq!(d["reasoning"], d["reasoning_content"]);
        }
    }
    assert_eq!(reasoning, "Hmm.\n");
    assert_eq!(content, "Hi, café!");
    let last = events.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert!(last["usage"]["completion_tokens"].as_u64().unwrap() > 0);
    let finish = &events[events.len() - 2]["choices"][0];
    assert_eq!(finish["finish_reason"], "stop");
}

const HERMES_CALL: &str = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}}\n</tool_call>";

fn tool_round_trip_reply(prompt: &str) -> String {
    if prompt.contains("<tool_response>") {
        "It is sunny in Paris.".into()
    } else {
        format!("Let me check.\n{HERMES_CALL}")
    }
}

#[tokio::test]
async fn hermes_tool_call_round_trip() {
    let h = harness(Opts::default(), tool_round_trip_reply);
    let app = app(&h);
    let mut body = user("Weather in Paris?");
    body["tools"] = json!([weather_tool()]);
    let (status, v) = post_json(&app, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!(choice["message"]["content"], "Let me check.");
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert!(call["id"].as_str().unwrap().starts_with("call_"));
    assert_eq!(call["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris", "days": 2}));

    // The client sends the call back (content null, arguments a string) with the result.
    body["messages"] = json!([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
        {"role": "assistant", "content": null, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call["id"], "content": "{\"sky\": \"clear\"}"},
    ]);
    let (status, v) = post_json(&app, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v["choices"][0]["message"]["content"],
        "It is sunny in Paris."
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn streamed_tool_call_fragments_follow_the_openai_shape() {
    let h = harness(Opts::default(), tool_round_trip_reply);
    let (events, text) = stream_weather(&h).await;
    let frags = assert_streamed_weather_call(&events);
    assert!(frags.len() >= 2, "{text}");
    assert!(frags.iter().all(|f| f["index"] == 0));
    assert_eq!(frags[0]["type"], "function");
}

#[tokio::test]
async fn coder_xml_grammar_converts_values_by_schema() {
    let h = template_harness(
        QWEN3_CODER_CHAT_TEMPLATE,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
    );
    let mut body = user("weather?");
    body["tools"] = json!([weather_tool()]);
    let (status, v) = post_json(&app(&h), "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    let m = &v["choices"][0]["message"];
    assert_eq!(m["content"], Value::Null);
    let args: Value = serde_json::from_str(
        m["tool_calls"][0]["function"]["arguments"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(args, json!({"city": "San Francisco", "days": 3}));
}

/// Streams `reply` under `template` with the weather tool: the call must
/// stream as the OpenAI shape says (name first, then argument fragments).
async fn assert_xml_call_streams(template: &str, reply: &'static str) {
    let h = template_harness(template, reply);
    let (events, text) = stream_weather(&h).await;
    let frags = assert_streamed_weather_call(&events);
    // The start (name, no arguments), then each argument and the close.
    assert_eq!(frags[0]["function"]["arguments"], "", "{text}");
    assert!(frags.len() >= 4, "{text}");
    assert!(frags.iter().all(|f| f["index"] == 0));
    assert!(!text.contains("<tool_call>"), "{text}");
}

#[tokio::test]
async fn coder_xml_calls_stream_in_the_openai_shape() {
    assert_xml_call_streams(
        QWEN3_CODER_CHAT_TEMPLATE,
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
    )
    .await;
}

#[tokio::test]
async fn glm_xml_calls_stream_in_the_openai_shape() {
    assert_xml_call_streams(
        krasis_model::tokenizer::GLM4_CHAT_TEMPLATE,
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
    )
    .await;
}

/// A named `tool_choice` in the XML grammars: the server's opening names
/// the tool, so the streamed call starts in it, before the model wrote a
/// token; the call reaches the client whole or streamed (the opening's
/// events go out with the first token).
#[tokio::test]
async fn named_xml_calls_reach_the_client_whole_or_streamed() {
    for (template, reply) in [
        (
            QWEN3_CODER_CHAT_TEMPLATE,
            "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
        ),
        (
            krasis_model::tokenizer::GLM4_CHAT_TEMPLATE,
            "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
        ),
    ] {
        assert_named_weather_call(&template_harness(template, reply)).await;
    }
}

/// A harness whose model answers `reply` under `template`.
fn template_harness(template: &str, reply: &'static str) -> Harness {
    let opts = Opts {
        template: Some(
            ChatTemplate::from_source(template, None, Some("<|im_end|>".into())).unwrap(),
        ),
        ..Opts::default()
    };
    harness(opts, move |_| reply.into())
}

#[tokio::test]
async fn named_tool_choice_forces_the_call_through_the_prompt() {
    let h = harness(Opts::default(), |prompt| {
        // The server opened the call; the model only continues it.
        assert!(
            prompt.ends_with("<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "),
            "{prompt}"
        );
        "{\"city\": \"Oslo\"}}\n</tool_call>".into()
    });
    let mut body = user("anything");
    body["tools"] = json!([weather_tool()]);
    body["tool_choice"] = json!({"type": "function", "function": {"name": "get_weather"}});
    let (status, v) = post_json(&app(&h), "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    let call = &v["choices"][0]["message"]["tool_calls"][0]["function"];
    assert_eq!(call["name"], "get_weather");
    assert_eq!(call["arguments"], "{\"city\":\"Oslo\"}");
}

#[tokio::test]
async fn tool_choice_none_hides_tools_and_parses_nothing() {
    let h = harness(Opts::default(), |prompt| {
        assert!(
            !prompt.contains("get_weather"),
            "tools must not reach the template"
        );
        HERMES_CALL.into()
    });
    let mut body = user("x");
    body["tools"] = json!([weather_tool()]);
    body["tool_choice"] = json!("none");
    let (_, v) = post_json(&app(&h), "/v1/chat/completions", &body).await;
    assert_eq!(v["choices"][0]["message"]["content"], HERMES_CALL);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
}

#[tokio::test]
async fn parallel_tool_calls_false_keeps_only_the_first_call() {
    let h = harness(Opts::default(), |_| format!("{HERMES_CALL}\n{HERMES_CALL}"));
    let mut body = user("x");
    body["tools"] = json!([weather_tool()]);
    body["parallel_tool_calls"] = json!(false);
    let (_, v) = post_json(&app(&h), "/v1/chat/completions", &body).await;
    assert_eq!(
        v["choices"][0]["message"]["tool_calls"]
            .as_array()
            .unwrap()
            .len(),
        1
    );
    body["parallel_tool_calls"] = json!(true);
    let (_, v) = post_json(&app(&h), "/v1/chat/completions", &body).await;
    assert_eq!(
        v["choices"][0]["message"]["tool_calls"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
}

/// A call cut off by `max_tokens` (the only way a constrained call can
/// break) keeps its text as content and is reported: finish reason
/// `tool_call_error`, an `error` object, and the `/v1/stats` counter.
#[tokio::test]
async fn a_cut_off_tool_call_is_reported_not_returned_as_text() {
    let h = harness(Opts::default(), |_| HERMES_CALL.into());
    let mut body = user("x");
    body["tools"] = json!([weather_tool()]);
    body["max_tokens"] = json!(8);
    let (status, v) = post_json(&app(&h), "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_call_error", "{v}");
    assert_eq!(choice["error"]["type"], "tool_call_error");
    assert!(
        choice["error"]["message"]
            .as_str()
            .unwrap()
            .contains("cut off"),
        "{v}"
    );
    let content = choice["message"]["content"].as_str().unwrap();
    assert!(
        HERMES_CALL.starts_with(content) && content.starts_with("<tool_call>"),
        "{v}"
    );
    assert!(choice["message"].get("tool_calls").is_none(), "{v}");
    let (_, _, stats) = send(&app(&h), get("/v1/stats")).await;
    let stats: Value = serde_json::from_str(&stats).unwrap();
    assert_eq!(stats["tool_call_errors"], 1, "{stats}");
    // Streamed: the last chunk carries the same finish reason and error.
    body["stream"] = json!(true);
    let (_, _, text) = send(&app(&h), post("/v1/chat/completions", &body)).await;
    let (events, done) = sse_events(&text);
    assert!(done);
    let last = events
        .iter()
        .rev()
        .find(|e| !e["choices"][0]["finish_reason"].is_null())
        .unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "tool_call_error");
    assert_eq!(last["choices"][0]["error"]["type"], "tool_call_error");
}

#[tokio::test]
async fn enable_thinking_false_reaches_the_template() {
    let h = harness(Opts::default(), |prompt| {
        assert!(prompt.ends_with("<think>\n\n</think>\n\n"), "{prompt:?}");
        "Direct answer.".into()
    });
    let mut body = user("x");
    body["chat_template_kwargs"] = json!({"enable_thinking": false});
    let (status, v) = post_json(&app(&h), "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], "Direct answer.");
    assert!(
        v["choices"][0]["message"]
            .get("reasoning_content")
            .is_none()
    );
}

#[tokio::test]
async fn stop_strings_cut_across_tokens_and_max_tokens_reports_length() {
    let h = harness(Opts::default(), |_| "one two three four five six".into());
    let app = app(&h);
    let mut body = user("x");
    body["stop"] = json!(["thr", "zzz"]);
    let (_, v) = post_json(&app, "/v1/chat/completions", &body).await;
    assert_eq!(v["choices"][0]["message"]["content"], "one two ");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    body["stop"] = json!("four");
    body["stream"] = json!(true);
    let (_, _, text) = send(&app, post("/v1/chat/completions", &body)).await;
    let (events, _) = sse_events(&text);
    let streamed: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, "one two three ");
    let mut body = user("x");
    body["max_completion_tokens"] = json!(2);
    let (_, v) = post_json(&app, "/v1/chat/completions", &body).await;
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 2);
}

#[tokio::test]
async fn text_completions_accept_strings_and_token_ids() {
    let h = harness(Opts::default(), |prompt| {
        assert!(
            !prompt.contains("<|im_start|>"),
            "completions use no template"
        );
        " world".into()
    });
    let app = app(&h);
    let (status, v) = post_json(
        &app,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "hello"}),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["text"], " world");
    let ids = tokenizer().encode("hello").unwrap();
    let body = json!({"prompt": [ids], "stream": true, "stream_options": {"include_usage": true}});
    let (_, _, text) = send(&app, post("/v1/completions", &body)).await;
    let (events, done) = sse_events(&text);
    assert!(done);
    let streamed: String = events
        .iter()
        .filter_map(|e| e["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(streamed, " world");
    assert!(
        events.last().unwrap()["usage"]["total_tokens"]
            .as_u64()
            .is_some()
    );
}

fn legacy_function() -> Value {
    weather_tool()["function"].clone()
}

#[tokio::test]
async fn legacy_functions_are_mapped_and_answered_in_the_legacy_shape() {
    let h = harness(Opts::default(), |prompt| {
        if prompt.ends_with("\"arguments\": ") {
            // A forced call: the server opened it, the model continues.
            "{\"city\": \"Oslo\"}}\n</tool_call>".into()
        } else {
            tool_round_trip_reply(prompt)
        }
    });
    let app = app(&h);
    let mut body = user("Weather in Paris?");
    body["functions"] = json!([legacy_function()]);
    let (status, v) = post_json(&app, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "function_call", "{v}");
    let call = &choice["message"]["function_call"];
    assert_eq!(call["name"], "get_weather", "{v}");
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris", "days": 2}));
    assert!(choice["message"].get("tool_calls").is_none(), "{v}");

    // Streamed: `delta.function_call` fragments, then finish_reason function_call.
    body["stream"] = json!(true);
    let (_, _, text) = send(&app, post("/v1/chat/completions", &body)).await;
    let (events, done) = sse_events(&text);
    assert!(done);
    let frags: Vec<&Value> = events
        .iter()
        .filter_map(|e| e["choices"][0]["delta"].get("function_call"))
        .collect();
    assert_eq!(frags[0]["name"], "get_weather", "{text}");
    let streamed: String = frags
        .iter()
        .filter_map(|f| f["arguments"].as_str())
        .collect();
    assert_eq!(serde_json::from_str::<Value>(&streamed).unwrap(), args);
    assert!(!text.contains("tool_calls"), "{text}");
    let finish: Vec<&Value> = events
        .iter()
        .filter_map(|e| e["choices"][0].get("finish_reason"))
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(finish, vec!["function_call"]);

    // The legacy history (assistant function_call, role function) renders
    // as a tool call and its result.
    body["stream"] = json!(false);
    body["messages"] = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "function_call": call},
        {"role": "function", "name": "get_weather", "content": "{\"sky\": \"clear\"}"},
    ]);
    let (status, v) = post_json(&app, "/v1/chat/completions", &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v["choices"][0]["message"]["content"],
        "It is sunny in Paris."
    );

    // function_call "none" hides the functions; a named one forces the call.
    body["messages"] = json!([{"role": "user", "content": "Weather in Paris?"}]);
    body["function_call"] = json!("none");
    let (_, v) = post_json(&app, "/v1/chat/completions", &body).await;
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    body["function_call"] = json!({"name": "get_weather"});
    let (_, v) = post_json(&app, "/v1/chat/completions", &body).await;
    assert_eq!(v["choices"][0]["finish_reason"], "function_call", "{v}");
    assert_eq!(
        v["choices"][0]["message"]["function_call"],
        json!({"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"})
    );
}

#[tokio::test]
async fn legacy_function_fields_are_never_silently_dropped() {
    let h = harness(Opts::default(), |_| "ok".into());
    let app = app(&h);
    let cases = [
        (
            json!({"functions": [legacy_function()], "tools": [weather_tool()]}),
            "functions",
        ),
        (
            json!({"functions": [{"description": "no name"}]}),
            "functions[0]",
        ),
        (
            json!({"function_call": {"name": "get_weather"}}),
            "function_call",
        ),
        (
            json!({"functions": [legacy_function()], "function_call": "required"}),
            "function_call",
        ),
        (
            json!({"functions": [legacy_function()], "function_call": {"name": "nope"}}),
            "tool_choice",
        ),
    ];
    for (extra, param) in cases {
        let mut body = user("x");
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, v) = post_json(&app, "/v1/chat/completions", &body).await;
        assert_eq!(status, 400, "{body} -> {v}");
        assert_eq!(v["error"]["param"], param, "{v}");
    }
}

/// `usage.prompt_tokens_details.cached_tokens` carries the engine's prefix
/// cache hit (chat, streaming usage chunk, the request log), and
/// `cache_prompt: false` reaches the engine (the scripted engine then
/// reports 0, as a real one does).
#[tokio::test]
async fn usage_reports_cached_tokens_and_cache_prompt_false_bypasses() {
    let h = harness(Opts::default(), |_| "Hello.".into());
    let app = app(&h);
    let (status, v) = post_json(&app, "/v1/chat/completions", &user("a long question")).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    // The same conversation again: all but the last prompt token.
    let mut body = user("a long question");
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (_, _, text) = send(&app, post("/v1/chat/completions", &body)).await;
    let (events, _) = sse_events(&text);
    let usage = &events.last().unwrap()["usage"];
    assert_eq!(
        usage["prompt_tokens_details"]["cached_tokens"].as_u64(),
        Some(prompt - 1)
    );
    body["cache_prompt"] = json!(false);
    body["stream"] = json!(false);
    let (_, v) = post_json(&app, "/v1/chat/completions", &body).await;
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let stats = h.state.engine_stats();
    let cached: Vec<u64> = (stats.recent_requests.iter())
        .map(|r| r.cached_tokens)
        .collect();
    assert_eq!(cached, vec![0, prompt - 1, 0]);
}
