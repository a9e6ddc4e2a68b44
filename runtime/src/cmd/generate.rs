//! `krasis-runtime generate`: one prompt through an engine, the text
//! streamed to stdout as it decodes, then a stats line on stderr.

use super::engines::{EngineArgs, load_engine};
use anyhow::{Context, bail};
use krasis_model::chat_template::{ChatTemplate, RenderOptions};
use krasis_model::tokenizer::Tokenizer;
use krasis_model::{FinishReason, GenerateOutcome, GenerateRequest, SamplingParams};
use std::io::Write;
use std::ops::ControlFlow;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    pub engine: EngineArgs,
    /// The prompt text.
    #[arg(long)]
    pub prompt: String,
    /// Render the prompt as one user message through the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Stop after this many generated tokens.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// 0 is greedy (arg-max).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep only the K most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Nucleus sampling mass in (0, 1] (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Drop tokens less likely than this fraction of the most likely one (0: off).
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Seed for reproducible sampling.
    #[arg(long)]
    pub seed: Option<u64>,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub presence_penalty: f32,
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    pub frequency_penalty: f32,
}

impl Args {
    fn sampling(&self) -> anyhow::Result<SamplingParams> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            bail!(
                "--temperature must be a number >= 0 (0 is greedy), got {}",
                self.temperature
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("--top-p must be in (0, 1], got {}", self.top_p);
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            bail!("--min-p must be in [0, 1], got {}", self.min_p);
        }
        for (name, v) in [
            ("--presence-penalty", self.presence_penalty),
            ("--frequency-penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                bail!("{name} must be in [-2, 2] (as in the OpenAI API), got {v}");
            }
        }
        Ok(SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            seed: self.seed,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
        })
    }
}

pub fn run(a: Args) -> anyhow::Result<()> {
    let outcome = generate_into(&a, &mut std::io::stdout().lock())?;
    let s = &outcome.stats;
    let finish = match outcome.finish {
        FinishReason::Stop => "stop token",
        FinishReason::Length => "length",
        FinishReason::Cancelled => "cancelled",
    };
    eprintln!(
        "prompt: {} tokens, prefill {:.1} tok/s | generated: {} tokens, decode {:.2} tok/s | finish: {finish}",
        s.prompt_tokens,
        s.prefill_tok_s(),
        s.generated_tokens,
        s.decode_tok_s()
    );
    Ok(())
}

/// The prompt token ids `a` asks for: the raw text, or (with `--chat`) the
/// text as one user message rendered through the model's chat template.
fn prompt_ids(a: &Args, tokenizer: &Tokenizer) -> anyhow::Result<Vec<u32>> {
    let dir = &a.engine.model;
    let text = if a.chat {
        let template = ChatTemplate::from_dir(dir)
            .context("loading the chat template")?
            .with_context(|| {
                format!(
                    "{} has no chat template; drop --chat to send the raw prompt",
                    dir.display()
                )
            })?;
        let messages = [serde_json::json!({"role": "user", "content": a.prompt})];
        let opts = RenderOptions {
            add_generation_prompt: true,
            ..RenderOptions::default()
        };
        template
            .render(&messages, &opts)
            .context("rendering the chat template")?
    } else {
        a.prompt.clone()
    };
    tokenizer.encode(&text).context("tokenizing the prompt")
}

/// Runs the generation, writing text to `out` as it is decoded (stop tokens
/// are not printed).
fn generate_into(a: &Args, out: &mut dyn Write) -> anyhow::Result<GenerateOutcome> {
    let sampling = a.sampling()?;
    let tokenizer = Tokenizer::from_dir(&a.engine.model).context("loading the tokenizer")?;
    let prompt = prompt_ids(a, &tokenizer)?;
    let mut engine = load_engine(&a.engine)?;
    let vocab = engine.info().vocab_size;
    if tokenizer.vocab_size() > vocab {
        bail!(
            "the tokenizer has {} token ids but the model's vocabulary is {vocab}; \
             tokenizer and checkpoint do not belong together",
            tokenizer.vocab_size()
        );
    }
    let req = GenerateRequest {
        prompt,
        max_new_tokens: a.max_tokens,
        sampling,
        stop_token_ids: tokenizer.eos_token_ids().to_vec(),
        cancel: Default::default(),
        live: Default::default(),
        cache_prompt: true,
        constraint: None,
    };
    let mut decoder = tokenizer.incremental();
    let mut failure: Option<anyhow::Error> = None;
    let mut on_token = |id: u32| {
        if req.stop_token_ids.contains(&id) {
            return ControlFlow::Continue(());
        }
        let written = decoder
            .push(id)
            .map_err(anyhow::Error::from)
            .and_then(|s| Ok(out.write_all(s.as_bytes()).and_then(|_| out.flush())?));
        match written {
            Ok(()) => ControlFlow::Continue(()),
            Err(e) => {
                failure = Some(e.context(format!("writing token {id}")));
                ControlFlow::Break(())
            }
        }
    };
    let outcome = engine.generate(&req, &mut on_token)?;
    if let Some(e) = failure {
        return Err(e);
    }
    let tail = decoder.finish().context("decoding the last tokens")?;
    writeln!(out, "{tail}")?;
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use krasis_model::Engine;
    use krasis_model::reference::{ReferenceEngine, ReferenceOptions};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: Args,
    }

    fn args(extra: &[&str]) -> Args {
        let dir = krasis_model::testutil::tiny_checkpoint("tiny");
        let mut argv = vec![
            "x",
            "--model",
            dir.to_str().unwrap(),
            "--backend",
            "reference",
        ];
        argv.extend(["--context-length", "256", "--max-tokens", "6"]);
        argv.extend(extra);
        Cli::try_parse_from(argv).unwrap().args
    }

    /// What the engine generates greedily for `a`, decoded in one go.
    fn expected_text(a: &Args) -> String {
        let tok = Tokenizer::from_dir(&a.engine.model).unwrap();
        let opts = ReferenceOptions {
            context_length: Some(256),
        };
        let mut e = ReferenceEngine::load(&a.engine.model, opts).unwrap();
        let req = GenerateRequest {
            prompt: prompt_ids(a, &tok).unwrap(),
            max_new_tokens: 6,
            sampling: SamplingParams::greedy(),
            stop_token_ids: tok.eos_token_ids().to_vec(),
            cancel: Default::default(),
            live: Default::default(),
            cache_prompt: true,
            constraint: None,
        };
        let mut ids = Vec::new();
        e.generate(&req, &mut |t| {
            ids.push(t);
            ControlFlow::Continue(())
        })
        .unwrap();
        ids.retain(|t| !tok.is_eos(*t));
        tok.decode(&ids, true).unwrap() + "\n"
    }

    #[test]
    fn streams_the_greedy_continuation() {
        for extra in [
            &["--prompt", "Hello, world"][..],
            &["--prompt", "Hi", "--chat"],
        ] {
            let a = args(extra);
            let mut out = Vec::new();
            let o = generate_into(&a, &mut out).unwrap();
            assert!(o.stats.generated_tokens >= 1 && o.stats.generated_tokens <= 6);
            assert_eq!(
                String::from_utf8(out).unwrap(),
                expected_text(&a),
                "{extra:?}"
            );
        }
    }

    #[test]
    fn chat_prompt_uses_the_template() {
        let a = args(&["--prompt", "Hi", "--chat"]);
        let tok = Tokenizer::from_dir(&a.engine.model).unwrap();
        let text = tok.decode(&prompt_ids(&a, &tok).unwrap(), false).unwrap();
        assert!(text.contains("<|im_start|>user\nHi<|im_end|>"), "{text}");
        assert!(text.ends_with("<|im_start|>assistant\n"), "{text}");
    }

    #[test]
    fn bad_sampling_flags_are_refused() {
        for (flag, arg) in [
            ("--temperature", "--temperature=-1"),
            ("--top-p", "--top-p=0"),
            ("--min-p", "--min-p=2"),
        ] {
            let a = args(&["--prompt", "x", arg]);
            let err = a.sampling().unwrap_err().to_string();
            assert!(err.contains(flag), "{err}");
        }
    }
}
