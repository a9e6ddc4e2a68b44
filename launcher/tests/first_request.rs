//! The first request a newcomer is shown (README's first example, and the
//! line `krasis demo`/`serve` prints when ready) sets `max_tokens`: without
//! it the random-weights demo model answers with thousands of tokens of noise.

use std::path::Path;

/// The JSON body of a `curl ... -d '{...}'` command.
fn body(cmd: &str) -> serde_json::Value {
    let start = cmd.find("-d '").expect("a -d '...' body") + 4;
    let end = start + cmd[start..].find('\'').expect("closing quote");
    serde_json::from_str(&cmd[start..end]).unwrap_or_else(|e| panic!("body of {cmd}: {e}"))
}

fn assert_short(what: &str, cmd: &str) {
    let b = body(cmd);
    assert!(
        b["max_tokens"].as_u64().is_some_and(|n| n > 0 && n <= 256),
        "{what} must set a small max_tokens: {cmd}"
    );
    assert!(b["messages"].is_array() || b["prompt"].is_string(), "{cmd}");
}

#[test]
fn the_printed_first_request_sets_max_tokens() {
    let cmd = krasis::headless::first_request("http://127.0.0.1:8080", "krasis-demo-tiny");
    assert!(cmd.starts_with("curl http://127.0.0.1:8080/v1/chat/completions"));
    assert_eq!(body(&cmd)["model"], "krasis-demo-tiny");
    assert_short("the request printed at READY", &cmd);
}

#[test]
fn readmes_first_request_sets_max_tokens() {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../README.md"))
            .expect("README.md");
    // The first fenced block that sends a request, with its line
    // continuations joined.
    let block = readme
        .split("```")
        .skip(1)
        .step_by(2)
        .find(|b| b.contains("/v1/chat/completions") || b.contains("/v1/completions"))
        .expect("README shows a first request");
    let cmd = block.replace("\\\n", " ");
    assert_short("README's first request", &cmd);
}
