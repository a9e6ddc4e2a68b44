//! `bench --grammar`: decode speed with a grammar active against the same
//! decode without one (structured output's cost, issue 18).
//!
//! The grammar is a JSON string of exactly `32 x (D + 1)` characters: no
//! token can finish it within the run (a token is rarely 32 characters),
//! so every run decodes all D tokens under the constraint, and length-
//! bounded strings are the case whose masks cost the most host time
//! (llguidance walks the token trie against a counted repetition). Both
//! sides run greedy from the same prompt with graphs on; the constrained
//! side also pays for the mask upload and the masked sampler.

use super::speed::greedy_request;
use super::stats::RunStats;
use anyhow::Context;
use krasis_gpu::CudaEngine;
use krasis_model::structured::{Grammar, Vocabulary};
use krasis_model::tokenizer::Tokenizer;
use krasis_model::{Engine, GenerateStats};
use serde::Serialize;
use std::ops::ControlFlow;
use std::path::Path;

#[derive(Debug, Serialize)]
pub struct GrammarResult {
    pub decode_tokens: usize,
    pub prompt_tokens: usize,
    /// What the grammar was.
    pub grammar: String,
    pub free: RunStats,
    pub constrained: RunStats,
    /// `1 - constrained / free` of the medians.
    pub overhead: f64,
}

/// Runs the comparison for each of `decode` token counts.
pub fn measure(
    e: &mut CudaEngine,
    model: &Path,
    prompt: &[u32],
    decode: &[usize],
    repeats: usize,
) -> anyhow::Result<Vec<GrammarResult>> {
    let tok = Tokenizer::from_dir(model).context("loading the tokenizer for --grammar")?;
    let vocab = Vocabulary::new(&tok).context("building the grammar vocabulary")?;
    let mut out = Vec::new();
    for &d in decode {
        let chars = 32 * (d + 1);
        let schema = serde_json::json!({"type": "string", "minLength": chars, "maxLength": chars});
        let g = Grammar::json_schema(&vocab, &schema).context("compiling the bench grammar")?;
        let mut run = |grammar: Option<&Grammar>| -> anyhow::Result<f64> {
            let mut req = greedy_request(prompt, d + 1);
            req.stop_token_ids = tok.eos_token_ids().to_vec();
            req.constraint = grammar.cloned();
            let o = e
                .generate(&req, &mut |_| ControlFlow::Continue(()))
                .context("generating")?;
            anyhow::ensure!(
                o.stats.generated_tokens == d + 1,
                "asked for {} tokens, got {}",
                d + 1,
                o.stats.generated_tokens
            );
            Ok(GenerateStats::decode_tok_s(&o.stats))
        };
        let free = RunStats::measure(repeats, || run(None))?;
        let constrained = RunStats::measure(repeats, || run(Some(&g)))?;
        let overhead = 1.0 - constrained.median_tok_s / free.median_tok_s;
        eprintln!(
            "decode {d:>4} tokens with a grammar (a JSON string of {chars} characters): {} tok/s; without: {} tok/s; overhead {:.1}%",
            constrained.display(1),
            free.display(1),
            100.0 * overhead
        );
        out.push(GrammarResult {
            decode_tokens: d,
            prompt_tokens: prompt.len(),
            grammar: format!("json string of {chars} characters"),
            free,
            constrained,
            overhead,
        });
    }
    Ok(out)
}
