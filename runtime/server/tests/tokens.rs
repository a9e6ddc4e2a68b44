//! The cheap lower bound on a prompt's token count that lets the server
//! refuse megabytes without tokenizing them must really be a lower bound.

mod common;

use common::tokenizer;
use proptest::prelude::*;

fn check(text: &str) {
    let tok = tokenizer();
    let bound = tok.min_tokens(text);
    let real = tok.encode(text).unwrap().len();
    assert!(bound <= real, "bound {bound} > {real} tokens for {text:?}");
}

#[test]
fn the_bound_holds_on_texts_made_to_be_few_tokens() {
    let tok = tokenizer();
    // Qwen's longest token is 128 spaces.
    assert_eq!(tok.max_token_bytes(), Some(128));
    for text in [
        String::new(),
        " ".repeat(100_000),
        "\n".repeat(10_000),
        "-".repeat(50_000),
        "=".repeat(4096) + &" ".repeat(4096),
        // Hangul jamo: NFC composes three (9 bytes) into one syllable.
        "\u{1100}\u{1161}\u{11A8}".repeat(5000),
        // Combining marks NFC folds into the letter before them.
        "e\u{301}a\u{300}s\u{323}\u{307}".repeat(5000),
        "<|im_start|>user\n".repeat(2000),
        "fn main() { println!(\"hello\"); }\n".repeat(3000),
    ] {
        check(&text);
    }
    // And it is not vacuous: a megabyte of spaces is at least 8192 tokens.
    assert_eq!(tok.min_tokens(&" ".repeat(1 << 20)), (1 << 20) / 128);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn the_bound_holds_on_any_text(
        parts in proptest::collection::vec(
            prop_oneof![
                "[ \\t\\n]{1,300}",
                "[a-z]{1,40}",
                "\\PC{1,20}",
                "[\u{1100}-\u{1112}][\u{1161}-\u{1175}][\u{11A8}-\u{11C2}]",
                "[a-z][\u{300}-\u{36F}]{1,3}",
            ],
            0..40,
        )
    ) {
        check(&parts.concat());
    }
}
