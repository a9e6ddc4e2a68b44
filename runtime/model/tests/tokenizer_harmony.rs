//! gpt-oss's tokenizer (o200k_harmony) built from the real o200k_base ranks:
//! ids must equal OpenAI's own encoding (the `openai-harmony` package;
//! fixture from tools/harmony/token_ids.py), special tokens included, and a
//! synthesized gpt-oss checkpoint must carry it with the published EOS ids
//! and chat template.

use std::path::Path;
use std::sync::OnceLock;

use krasis_model::tokenizer::{
    GPT_OSS_CHAT_TEMPLATE, HARMONY_EOS_IDS, HARMONY_NAMED_TOKENS, Tokenizer,
    build_harmony_tokenizer_json, find_o200k_vocab,
};

fn harmony() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let vocab = find_o200k_vocab(None).unwrap_or_else(|e| {
            panic!("o200k_base vocabulary missing ({e}); run `bash tools/harmony/vocab.sh` first")
        });
        let json = build_harmony_tokenizer_json(&vocab).expect("convert o200k_base.tiktoken");
        Tokenizer::from_json(&json, &HARMONY_EOS_IDS).expect("load")
    })
}

#[derive(serde::Deserialize)]
struct Case {
    text: String,
    ids: Vec<u32>,
    #[serde(default)]
    rendered: bool,
}

#[derive(serde::Deserialize)]
struct Fixture {
    cases: Vec<Case>,
}

fn fixture() -> Fixture {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/harmony/token_ids.json");
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

#[test]
fn ids_match_openai_harmony() {
    let fixture = fixture();
    assert!(fixture.cases.len() >= 30, "fixture too small");
    assert!(fixture.cases.iter().any(|c| c.rendered));
    let tok = harmony();
    let mut failures = Vec::new();
    for case in &fixture.cases {
        let got = tok.encode(&case.text).unwrap();
        if got != case.ids {
            failures.push(format!(
                "{:?}\n  want {:?}\n  got  {:?}",
                case.text, case.ids, got
            ));
        }
        // Decoding with special tokens kept gives the text back.
        assert_eq!(tok.decode(&case.ids, false).unwrap(), case.text);
    }
    assert!(
        failures.is_empty(),
        "{} mismatches:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn special_tokens_at_published_ids() {
    let tok = harmony();
    assert_eq!(tok.vocab_size(), 201_088);
    for &(id, content) in HARMONY_NAMED_TOKENS {
        assert_eq!(tok.token_id(content), Some(id), "{content}");
        assert_eq!(tok.encode(content).unwrap(), vec![id], "{content}");
    }
    assert_eq!(tok.token_id("<|reserved_200013|>"), Some(200_013));
    assert_eq!(tok.id_to_token(201_088), None);
    // Special tokens are dropped by skip_special, text kept.
    let ids = tok.encode("<|start|>user<|message|>hi<|end|>").unwrap();
    assert_eq!(tok.decode(&ids, true).unwrap(), "userhi");
}

#[test]
fn synthesized_checkpoint_carries_the_harmony_tokenizer() {
    let dir = krasis_model::testutil::tiny_gpt_oss_checkpoint();
    assert_eq!(krasis_model::testutil::tiny_gpt_oss_checkpoint(), dir);
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let mut eos = tok.eos_token_ids().to_vec();
    eos.sort_unstable();
    assert_eq!(eos, [199_999, 200_002, 200_012]);
    let case = fixture().cases.into_iter().find(|c| c.rendered).unwrap();
    assert_eq!(tok.encode(&case.text).unwrap(), case.ids);
    let tc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert_eq!(tc["chat_template"].as_str(), Some(GPT_OSS_CHAT_TEMPLATE));
    let gc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("generation_config.json")).unwrap())
            .unwrap();
    assert_eq!(
        gc["eos_token_id"],
        serde_json::json!([200_002, 199_999, 200_012])
    );
    let config = krasis_model::ModelConfig::load(&dir).unwrap();
    assert_eq!(config.geometry().vocab_size, 201_088);
    krasis_model::Checkpoint::open(&dir)
        .unwrap()
        .validate(&config.expected_tensors())
        .unwrap();
}
