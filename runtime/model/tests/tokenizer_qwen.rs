//! Qwen tokenizer built from the real ranks: ids must equal the reference
//! `tiktoken` ids (fixture from tools/qwen_tokenizer_fixture.py), and
//! decoding, EOS discovery and streaming must behave like transformers.

use std::path::Path;
use std::sync::OnceLock;
use std::time::Instant;

use krasis_model::tokenizer::{
    QWEN3_SPECIAL_TOKENS, Tokenizer, build_qwen_tokenizer_json, find_qwen_vocab,
};

fn vocab_json() -> &'static str {
    static JSON: OnceLock<String> = OnceLock::new();
    JSON.get_or_init(|| {
        let vocab = find_qwen_vocab(None).unwrap_or_else(|e| {
            panic!("Qwen vocabulary missing ({e}); run `bash tools/vocab.sh` first")
        });
        let t = Instant::now();
        let json = build_qwen_tokenizer_json(&vocab).expect("convert qwen.tiktoken");
        eprintln!("build_qwen_tokenizer_json: {:?}", t.elapsed());
        json
    })
}

fn qwen() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| Tokenizer::from_json(vocab_json(), &[151645, 151643]).expect("load"))
}

#[derive(serde::Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
}

#[derive(serde::Deserialize)]
struct Fixture {
    cases: Vec<Case>,
}

#[test]
fn conversion_is_fast() {
    let vocab = find_qwen_vocab(None).expect("run `bash tools/vocab.sh` first");
    let t = Instant::now();
    let json = build_qwen_tokenizer_json(&vocab).unwrap();
    let convert = t.elapsed();
    let t = Instant::now();
    let tok = Tokenizer::from_json(&json, &[151645]).unwrap();
    let load = t.elapsed();
    eprintln!("convert {convert:?}, load {load:?}");
    assert_eq!(tok.vocab_size(), 151_669);
    // Same shape as the real Qwen2/Qwen3 tokenizer.json: one merge per
    // multi-byte token (151643 ranks - 256 single bytes).
    let doc: serde_json::Value = serde_json::from_str(&json).unwrap();
    let model = &doc["model"];
    assert_eq!(model["merges"].as_array().unwrap().len(), 151_387);
    assert_eq!(model["vocab"].as_object().unwrap().len(), 151_643);
    assert_eq!(model["merges"][0], "Ġ Ġ");
    assert_eq!(doc["added_tokens"].as_array().unwrap().len(), 26);
    // Generous vs the ~2 s target so a loaded CI box does not flake.
    assert!(convert.as_secs_f64() < 4.0, "conversion took {convert:?}");
}

#[test]
fn ids_match_reference_tiktoken() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/qwen_tiktoken_ids.json");
    let fixture: Fixture = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert!(fixture.cases.len() >= 30, "fixture too small");
    let tok = qwen();
    let mut failures = Vec::new();
    for case in &fixture.cases {
        let got = tok.encode(&case.text).unwrap();
        if got != case.ids {
            failures.push(format!(
                "{:?}\n  want {:?}\n  got  {:?}",
                case.text, case.ids, got
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn known_ids_and_special_tokens() {
    let tok = qwen();
    assert_eq!(
        tok.encode("Hello, world!").unwrap(),
        vec![9707, 11, 1879, 0]
    );
    for &(id, content, _) in QWEN3_SPECIAL_TOKENS {
        assert_eq!(tok.token_id(content), Some(id), "{content}");
        assert_eq!(tok.id_to_token(id).as_deref(), Some(content));
        assert_eq!(
            tok.encode(content).unwrap(),
            vec![id],
            "{content} must be one token"
        );
    }
    assert_eq!(tok.id_to_token(151_669), None);
    assert_eq!(tok.vocab_size(), 151_669);
}

#[test]
fn decode_round_trips_and_skips_only_special() {
    let tok = qwen();
    let text = "<|im_start|>assistant\n<think>\n推理 🤔\n</think>\n\nx = 1_000; // ok<|im_end|>";
    let ids = tok.encode(text).unwrap();
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
    // <think> is special=false in Qwen3, so it survives skip_special.
    assert_eq!(
        tok.decode(&ids, true).unwrap(),
        "assistant\n<think>\n推理 🤔\n</think>\n\nx = 1_000; // ok"
    );
    let err = tok.decode(&[9707, 999_999], false).unwrap_err();
    assert!(err.to_string().contains("999999"), "{err}");
}

#[test]
fn incremental_decoder_holds_back_split_characters() {
    let tok = qwen();
    let text = "Emoji 👨‍👩‍👧 and 日本語, café!🇫🇷 end";
    let ids = tok.encode(text).unwrap();
    let mut dec = tok.incremental();
    let mut out = String::new();
    let mut saw_empty_push = false;
    for &id in &ids {
        let piece = dec.push(id).unwrap();
        assert!(
            !piece.contains('\u{FFFD}'),
            "emitted a partial character: {piece:?}"
        );
        saw_empty_push |= piece.is_empty();
        out.push_str(&piece);
    }
    out.push_str(&dec.finish().unwrap());
    assert_eq!(out, text);
    // The family emoji spans several byte-level tokens, so some push must
    // have held back an incomplete UTF-8 sequence.
    assert!(saw_empty_push, "expected at least one held-back push");
}

#[test]
fn incremental_decoder_skips_special_and_flushes_garbage() {
    let tok = qwen();
    let mut dec = tok.incremental();
    let mut out = String::new();
    for id in tok.encode("<|im_start|>hi<|im_end|>").unwrap() {
        out.push_str(&dec.push(id).unwrap());
    }
    out.push_str(&dec.finish().unwrap());
    assert_eq!(out, "hi");

    // A lone lead byte of a 4-byte sequence is held, then flushed as U+FFFD.
    let lead = tok.token_id("ð").expect("byte 0xF0 token");
    let mut dec = tok.incremental_with(false);
    assert_eq!(dec.push(lead).unwrap(), "");
    assert_eq!(dec.finish().unwrap(), "\u{FFFD}");
}

fn write(dir: &Path, name: &str, v: serde_json::Value) {
    std::fs::write(dir.join(name), serde_json::to_string(&v).unwrap()).unwrap();
}

#[test]
fn from_dir_collects_eos_from_all_configs() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tokenizer.json"), vocab_json()).unwrap();
    write(
        dir.path(),
        "generation_config.json",
        krasis_model::chat_template::qwen3_generation_config(),
    );
    write(
        dir.path(),
        "config.json",
        serde_json::json!({"eos_token_id": 151643}),
    );
    write(
        dir.path(),
        "tokenizer_config.json",
        krasis_model::chat_template::qwen3_tokenizer_config("x"),
    );
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(tok.eos_token_ids(), &[151645, 151643]);

    // Without generation_config.json, config.json's int is used.
    std::fs::remove_file(dir.path().join("generation_config.json")).unwrap();
    write(
        dir.path(),
        "tokenizer_config.json",
        serde_json::json!({"eos_token": {"content": "<|endoftext|>", "__type": "AddedToken"}}),
    );
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(tok.eos_token_ids(), &[151643]);

    // An eos_token that is not in the vocabulary is refused.
    write(
        dir.path(),
        "tokenizer_config.json",
        serde_json::json!({"eos_token": "<|eot_id|>"}),
    );
    let err = Tokenizer::from_dir(dir.path()).unwrap_err();
    assert!(err.to_string().contains("'<|eot_id|>'"), "{err}");

    // No EOS anywhere: refused, since generation could never stop.
    std::fs::remove_file(dir.path().join("tokenizer_config.json")).unwrap();
    std::fs::remove_file(dir.path().join("config.json")).unwrap();
    let err = Tokenizer::from_dir(dir.path()).unwrap_err();
    assert!(err.to_string().contains("no EOS token"), "{err}");
}

mod roundtrip {
    use super::qwen;
    use proptest::prelude::*;

    /// Pieces chosen to split across byte-level tokens and regex classes;
    /// all already NFC so decode(encode(s)) must equal s exactly.
    const PIECES: &[&str] = &[
        "a",
        "Z",
        " ",
        "  ",
        "\n",
        "\r\n",
        "\t",
        "'s",
        "'LL",
        "0",
        "42",
        "3.14",
        "é",
        "ß",
        "日",
        "本語",
        "한",
        "ж",
        "ع",
        "😀",
        "👍🏽",
        "👨‍👩‍👧",
        "🇯🇵",
        "\u{200b}",
        "\u{3000}",
        "{",
        "}",
        "()",
        "::",
        "->",
        "<|im_end|>",
        "<think>",
        "</tool_call>",
        "<|endoftext|>",
        "<",
        "|",
        ">",
    ];

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]
        #[test]
        fn encode_decode_and_stream_round_trip(idx in proptest::collection::vec(0..PIECES.len(), 0..24)) {
            let text: String = idx.iter().map(|&i| PIECES[i]).collect();
            let tok = qwen();
            let ids = tok.encode(&text).unwrap();
            prop_assert_eq!(&tok.decode(&ids, false).unwrap(), &text);
            let mut dec = tok.incremental_with(false);
            let mut streamed = String::new();
            for &id in &ids {
                let piece = dec.push(id).unwrap();
                prop_assert!(!piece.contains('\u{FFFD}'), "partial char in {:?}", piece);
                streamed.push_str(&piece);
            }
            streamed.push_str(&dec.finish().unwrap());
            prop_assert_eq!(streamed, text);
        }
    }
}
