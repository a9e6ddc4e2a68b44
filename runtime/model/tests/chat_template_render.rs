//! Chat template rendering: our Qwen3 / Qwen3-Coder templates against literal
//! expected prompts, plus the transformers-compatible environment
//! (`tojson`, `raise_exception`, loop controls, loading rules).

use krasis_model::ModelError;
use krasis_model::chat_template::{
    ChatTemplate, QWEN3_CHAT_TEMPLATE, QWEN3_CODER_CHAT_TEMPLATE, RenderOptions,
    parse_tool_call_arguments, qwen3_tokenizer_config,
};
use serde_json::{Value, json};

fn qwen3() -> ChatTemplate {
    ChatTemplate::from_source(QWEN3_CHAT_TEMPLATE, None, Some("<|im_end|>".into())).unwrap()
}

fn with_prompt() -> RenderOptions {
    RenderOptions {
        add_generation_prompt: true,
        ..RenderOptions::default()
    }
}

fn render(t: &ChatTemplate, messages: Value, opts: &RenderOptions) -> String {
    t.render(messages.as_array().unwrap(), opts).unwrap()
}

fn weather_tool() -> Value {
    json!({"type": "function", "function": {"name": "get_weather",
        "description": "Weather for a city, e.g. \"Paris\" or 東京.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
}

const TOOLS_HEADER: &str = "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>";
const TOOLS_FOOTER: &str = "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n";

#[test]
fn plain_chat_with_generation_prompt() {
    let out = render(
        &qwen3(),
        json!([
            {"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "How are you?"},
        ]),
        &with_prompt(),
    );
    assert_eq!(
        out,
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
         <|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n\
         <|im_start|>assistant\n"
    );
}

#[test]
fn final_assistant_turn_gets_empty_think_and_old_reasoning_is_dropped() {
    let out = render(
        &qwen3(),
        json!([
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "<think>\nold plan\n</think>\n\nA1"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2"},
        ]),
        &RenderOptions::default(),
    );
    assert_eq!(
        out,
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n\
         <|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nA2<|im_end|>\n"
    );
}

#[test]
fn system_messages_first_middle_and_developer() {
    let out = render(
        &qwen3(),
        json!([
            {"role": "developer", "content": "Be terse."},
            {"role": "system", "content": "Second system."},
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "y"},
            {"role": "system", "content": "Mid rule."},
            {"role": "user", "content": "z"},
        ]),
        &with_prompt(),
    );
    assert_eq!(
        out,
        "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>system\nSecond system.<|im_end|>\n\
         <|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\ny<|im_end|>\n\
         <|im_start|>system\nMid rule.<|im_end|>\n<|im_start|>user\nz<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn content_parts_are_concatenated_and_images_refused() {
    let t = qwen3();
    let out = render(
        &t,
        json!([{"role": "user", "content": [
            {"type": "text", "text": "Hello "}, {"type": "text", "text": "world"}]}]),
        &RenderOptions::default(),
    );
    assert_eq!(out, "<|im_start|>user\nHello world<|im_end|>\n");
    let err = t
        .render(
            json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
                .as_array()
                .unwrap(),
            &RenderOptions::default(),
        )
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("Unsupported content part type 'image_url'"),
        "{err}"
    );
}

#[test]
fn tools_tool_calls_and_grouped_tool_results() {
    let opts = RenderOptions {
        add_generation_prompt: true,
        tools: Some(vec![weather_tool()]),
        ..RenderOptions::default()
    };
    let messages = json!([
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "Weather in Paris and Tokyo?"},
        {"role": "assistant", "content": null, "reasoning_content": "\nCall the tool twice.\n",
         "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}},
            {"id": "b", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "東京", "unit": "°C"}}}]},
        {"role": "tool", "tool_call_id": "a", "content": "18C"},
        {"role": "tool", "tool_call_id": "b", "content": "22C"},
    ]);
    let out = render(&qwen3(), messages, &opts);
    let tool_json = "{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \
        \"description\": \"Weather for a city, e.g. \\\"Paris\\\" or 東京.\", \"parameters\": \
        {\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}, \"required\": [\"city\"]}}}";
    let expected = format!(
        "<|im_start|>system\nYou are helpful.\n\n{TOOLS_HEADER}\n{tool_json}{TOOLS_FOOTER}\
         <|im_start|>user\nWeather in Paris and Tokyo?<|im_end|>\n\
         <|im_start|>assistant\n<think>\nCall the tool twice.\n</think>\n\n\
         <tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\":\"Paris\"}}}}\n</tool_call>\n\
         <tool_call>\n{{\"name\": \"get_weather\", \"arguments\": {{\"city\": \"東京\", \"unit\": \"°C\"}}}}\n</tool_call><|im_end|>\n\
         <|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n22C\n</tool_response><|im_end|>\n\
         <|im_start|>assistant\n"
    );
    assert_eq!(out, expected);
}

#[test]
fn tools_without_system_message() {
    let opts = RenderOptions {
        tools: Some(vec![json!({"name": "f", "parameters": {}})]),
        ..RenderOptions::default()
    };
    let out = render(&qwen3(), json!([{"role": "user", "content": "go"}]), &opts);
    assert_eq!(
        out,
        format!(
            "<|im_start|>system\n{TOOLS_HEADER}\n{{\"name\": \"f\", \"parameters\": {{}}}}{TOOLS_FOOTER}\
             <|im_start|>user\ngo<|im_end|>\n"
        )
    );
}

#[test]
fn enable_thinking_false_closes_the_think_block() {
    let mut opts = with_prompt();
    opts.extra.insert("enable_thinking".into(), json!(false));
    let out = render(&qwen3(), json!([{"role": "user", "content": "hi"}]), &opts);
    assert_eq!(
        out,
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    );
    opts.extra.insert("enable_thinking".into(), json!(true));
    let out = render(&qwen3(), json!([{"role": "user", "content": "hi"}]), &opts);
    assert!(out.ends_with("<|im_start|>assistant\n"), "{out:?}");
}

#[test]
fn invalid_role_raises_the_template_message() {
    let err = qwen3()
        .render(
            &[json!({"role": "robot", "content": "beep"})],
            &with_prompt(),
        )
        .unwrap_err();
    match &err {
        ModelError::Template(msg) => assert!(
            msg.starts_with("Unexpected message role 'robot'; expected system, developer"),
            "{msg}"
        ),
        other => panic!("expected Template error, got {other:?}"),
    }
}

#[test]
fn extra_may_not_shadow_request_variables() {
    let mut opts = with_prompt();
    opts.extra.insert("messages".into(), json!([]));
    let err = qwen3().render(&[], &opts).unwrap_err();
    assert!(err.to_string().contains("'messages'"), "{err}");
}

fn tiny(src: &str) -> ChatTemplate {
    ChatTemplate::from_source(src, Some("<s>".into()), Some("</s>".into())).unwrap()
}

fn with_x(x: Value) -> RenderOptions {
    let mut o = RenderOptions::default();
    o.extra.insert("x".into(), x);
    o
}

#[test]
fn tojson_matches_python_json_dumps() {
    let x = json!({"z": 1, "a": [1.5, "é\"\\\n", null, true, 1e-7, 3.0], "日本": {}, "e": []});
    // Python: json.dumps(x, ensure_ascii=False)
    assert_eq!(
        tiny("{{ x | tojson }}")
            .render(&[], &with_x(x.clone()))
            .unwrap(),
        r#"{"z": 1, "a": [1.5, "é\"\\\n", null, true, 1e-07, 3.0], "日本": {}, "e": []}"#
    );
    // Python: json.dumps(x, ensure_ascii=False, indent=2)
    assert_eq!(
        tiny("{{ x | tojson(indent=2) }}")
            .render(&[], &with_x(json!({"k": [1, {"b": "ü"}], "n": {}})))
            .unwrap(),
        "{\n  \"k\": [\n    1,\n    {\n      \"b\": \"ü\"\n    }\n  ],\n  \"n\": {}\n}"
    );
    // Python: json.dumps({"b": 1, "a": 2}, sort_keys=True, ensure_ascii=True) with "é"
    assert_eq!(
        tiny("{{ x | tojson(sort_keys=true, ensure_ascii=true) }}")
            .render(&[], &with_x(json!({"b": "é", "a": 2})))
            .unwrap(),
        r#"{"a": 2, "b": "\u00e9"}"#
    );
    let err = tiny("{{ x | tojson(bogus=1) }}")
        .render(&[], &with_x(json!(1)))
        .unwrap_err();
    assert!(err.to_string().contains("bogus"), "{err}");
}

#[test]
fn loop_controls_python_methods_and_special_tokens() {
    let t = tiny(
        "{% for i in range(6) %}{% if i == 1 %}{% continue %}{% endif %}{% if i == 4 %}{% break %}{% endif %}{{ i }}{% endfor %}\
         |{{ '  a,b  '.strip().split(',') | join('+') }}|{{ 'abc'.startswith('ab') }}|{{ bos_token }}{{ eos_token }}",
    );
    assert_eq!(
        t.render(&[], &RenderOptions::default()).unwrap(),
        "023|a+b|True|<s></s>"
    );
}

#[test]
fn raise_exception_message_is_verbatim_with_line() {
    let t = tiny("line one\n{{ raise_exception('Conversation roles must alternate') }}");
    let err = t
        .render(&[], &RenderOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("Conversation roles must alternate (template 'default' line 2)"),
        "{err}"
    );
}

#[test]
fn strftime_now_formats_and_rejects_bad_formats() {
    let out = tiny("{{ strftime_now('%Y') }}")
        .render(&[], &RenderOptions::default())
        .unwrap();
    assert!(
        out.len() == 4 && out.chars().all(|c| c.is_ascii_digit()),
        "{out}"
    );
    let err = tiny("{{ strftime_now('%Q') }}")
        .render(&[], &RenderOptions::default())
        .unwrap_err();
    assert!(err.to_string().contains("invalid format"), "{err}");
}

#[test]
fn syntax_errors_are_reported_at_construction() {
    let err = ChatTemplate::from_source("ok\n{% if %}", None, None).unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(err, ModelError::Template(_)) && msg.contains("line 2"),
        "{msg}"
    );
}

#[test]
fn from_dir_reads_string_list_and_jinja_file() {
    let dir = tempfile::tempdir().unwrap();
    assert!(ChatTemplate::from_dir(dir.path()).unwrap().is_none());

    let cfg = qwen3_tokenizer_config(QWEN3_CHAT_TEMPLATE);
    std::fs::write(dir.path().join("tokenizer_config.json"), cfg.to_string()).unwrap();
    let t = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
    assert_eq!(t.source(), QWEN3_CHAT_TEMPLATE);
    assert_eq!((t.bos_token(), t.eos_token()), (None, Some("<|im_end|>")));

    let list = json!({
        "bos_token": {"content": "<s>", "__type": "AddedToken"},
        "chat_template": [
            {"name": "default", "template": "D{{ bos_token }}"},
            {"name": "tool_use", "template": "T{{ tools | length }}"},
            {"name": "rag", "template": "R"},
        ]
    });
    std::fs::write(dir.path().join("tokenizer_config.json"), list.to_string()).unwrap();
    let t = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
    assert!(t.has_tool_use());
    assert_eq!(t.render(&[], &RenderOptions::default()).unwrap(), "D<s>");
    let with_tools = RenderOptions {
        tools: Some(vec![json!({}), json!({})]),
        ..RenderOptions::default()
    };
    assert_eq!(t.render(&[], &with_tools).unwrap(), "T2");

    // chat_template.jinja wins over tokenizer_config.json, as in transformers.
    std::fs::write(dir.path().join("chat_template.jinja"), "J").unwrap();
    let t = ChatTemplate::from_dir(dir.path()).unwrap().unwrap();
    assert_eq!(t.render(&[], &RenderOptions::default()).unwrap(), "J");
    std::fs::remove_file(dir.path().join("chat_template.jinja")).unwrap();

    let no_default = json!({"chat_template": [{"name": "tool_use", "template": "T"}]});
    std::fs::write(
        dir.path().join("tokenizer_config.json"),
        no_default.to_string(),
    )
    .unwrap();
    let err = ChatTemplate::from_dir(dir.path()).unwrap_err();
    assert!(
        err.to_string().contains("no entry named 'default'"),
        "{err}"
    );
}

#[test]
fn coder_template_renders_xml_tools_and_calls() {
    let t = ChatTemplate::from_source(QWEN3_CODER_CHAT_TEMPLATE, None, None).unwrap();
    let tool = json!({"type": "function", "function": {"name": "read_file", "description": " Read a file. ",
        "parameters": {"type": "object", "properties": {"path": {"type": "string", "description": "File path"},
            "lines": {"type": "array", "items": {"type": "integer"}}}, "required": ["path"]}}});
    let mut messages = json!([
        {"role": "user", "content": "Show main.rs"},
        {"role": "assistant", "content": " Reading it. ", "tool_calls": [{"type": "function", "function": {
            "name": "read_file", "arguments": "{\"path\": \"src/main.rs\", \"lines\": [1, 2], \"all\": true}"}}]},
        {"role": "tool", "content": "fn main() {}"},
        {"role": "tool", "content": "EOF"},
    ]);
    let opts = RenderOptions {
        add_generation_prompt: true,
        tools: Some(vec![tool]),
        ..RenderOptions::default()
    };
    // OpenAI-style string arguments must be parsed first; the template says so.
    let err = t.render(messages.as_array().unwrap(), &opts).unwrap_err();
    assert!(
        err.to_string().contains("arguments must be an object"),
        "{err}"
    );
    parse_tool_call_arguments(messages.as_array_mut().unwrap()).unwrap();
    let out = t.render(messages.as_array().unwrap(), &opts).unwrap();

    let head = "<|im_start|>system\nYou are Qwen, a helpful AI assistant that can interact with a computer to solve tasks.\n\n\
        # Tools\n\nYou have access to the following functions:\n\n<tools>\n<function>\n<name>read_file</name>\n\
        <description>Read a file.</description>\n<parameters>\n<parameter>\n<name>path</name>\n<type>string</type>\n\
        <description>File path</description>\n</parameter>\n<parameter>\n<name>lines</name>\n<type>array</type>\n\
        <items>{\"type\": \"integer\"}</items>\n</parameter>\n<required>[\"path\"]</required>\n</parameters>\n</function>\n</tools>\n\n\
        If you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n";
    assert!(out.starts_with(head), "{out}");
    let tail = "</IMPORTANT><|im_end|>\n<|im_start|>user\nShow main.rs<|im_end|>\n<|im_start|>assistant\nReading it.\n\n\
        <tool_call>\n<function=read_file>\n<parameter=path>\nsrc/main.rs\n</parameter>\n<parameter=lines>\n[1, 2]\n</parameter>\n\
        <parameter=all>\nTrue\n</parameter>\n</function>\n</tool_call><|im_end|>\n\
        <|im_start|>user\n<tool_response>\nfn main() {}\n</tool_response>\n<tool_response>\nEOF\n</tool_response>\n<|im_end|>\n\
        <|im_start|>assistant\n";
    assert!(out.ends_with(tail), "{out}");

    let bad = &mut [
        json!({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}),
    ];
    let err = parse_tool_call_arguments(bad).unwrap_err();
    assert!(
        err.to_string()
            .contains("messages[0].tool_calls[0].function.arguments"),
        "{err}"
    );
}

#[test]
fn coder_template_plain_chat_and_system() {
    // tools = none and tool_calls = null must not trip `| length`.
    let t = ChatTemplate::from_source(QWEN3_CODER_CHAT_TEMPLATE, None, None).unwrap();
    let out = render(
        &t,
        json!([{"role": "developer", "content": "Sys"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo", "tool_calls": null}, {"role": "user", "content": "bye"}]),
        &with_prompt(),
    );
    assert_eq!(
        out,
        "<|im_start|>system\nSys<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n<|im_start|>user\nbye<|im_end|>\n<|im_start|>assistant\n"
    );
}

#[test]
fn rendered_prompt_tokenizes_specials_as_single_ids() {
    // Ties the two halves together: what the template emits, the tokenizer
    // must read back with <|im_start|>/<|im_end|> as single special ids.
    let vocab = krasis_model::tokenizer::find_qwen_vocab(None)
        .unwrap_or_else(|e| panic!("{e}; run `bash tools/vocab.sh` first"));
    let json = krasis_model::tokenizer::build_qwen_tokenizer_json(&vocab).unwrap();
    let tok = krasis_model::tokenizer::Tokenizer::from_json(&json, &[151645]).unwrap();
    let prompt = render(
        &qwen3(),
        json!([{"role": "user", "content": "hi"}]),
        &with_prompt(),
    );
    let ids = tok.encode(&prompt).unwrap();
    assert_eq!(ids.first(), Some(&151644));
    assert_eq!(ids.iter().filter(|&&i| i == 151645).count(), 1);
    assert_eq!(tok.decode(&ids, false).unwrap(), prompt);
}

#[derive(serde::Deserialize)]
struct Jinja2Case {
    template: String,
    messages: Vec<Value>,
    tools: Option<Vec<Value>>,
    add_generation_prompt: bool,
    extra: serde_json::Map<String, Value>,
    expected: String,
}

#[derive(serde::Deserialize)]
struct Jinja2Fixture {
    cases: Vec<Jinja2Case>,
}

#[test]
fn templates_match_transformers_jinja2_rendering() {
    // Fixture: tools/chat_template_fixture.py renders our templates with
    // Jinja2 configured as transformers configures it.
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/chat_template_jinja2.json");
    let fixture: Jinja2Fixture =
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert!(fixture.cases.len() >= 10);
    let qwen3 = qwen3();
    let coder =
        ChatTemplate::from_source(QWEN3_CODER_CHAT_TEMPLATE, None, Some("<|im_end|>".into()))
            .unwrap();
    for (i, case) in fixture.cases.iter().enumerate() {
        let t = match case.template.as_str() {
            "qwen3" => &qwen3,
            "qwen3_coder" => &coder,
            other => panic!("unknown template {other}"),
        };
        let opts = RenderOptions {
            add_generation_prompt: case.add_generation_prompt,
            tools: case.tools.clone(),
            extra: case.extra.clone(),
        };
        let got = t.render(&case.messages, &opts).unwrap();
        assert_eq!(got, case.expected, "case {i} ({})", case.template);
    }
}

#[test]
fn chat_template_is_send_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<ChatTemplate>();
}
