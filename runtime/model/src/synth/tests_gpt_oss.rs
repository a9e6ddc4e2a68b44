//! gpt_oss synthesis: the published layout and dtypes (MXFP4 experts as U8
//! blocks/scales, float everything else), MXFP4 bytes that decode to the
//! encoder's values of the drawn weights, one expert regenerated on its
//! own, determinism, and a checkpoint the reference engine runs.

use super::values::fill_f32;
use super::*;
use crate::arch::{ExpertStorage, LayerTensor};
use crate::checkpoint::{Checkpoint, StoredDType};
use crate::formats::mxfp4::{Mxfp4Tensor, quantize_block};
use crate::reference::{ReferenceEngine, ReferenceOptions};
use serde_json::json;

fn spec(seed: u64, dtype: SynthDtype) -> SynthSpec {
    let o = vec![("vocab_size".to_string(), json!(512))];
    SynthSpec::new("tiny-gpt-oss", seed, dtype, 0.0, &o).unwrap()
}

fn write(spec: &SynthSpec, dir: &std::path::Path) -> SynthSummary {
    let mut o = SynthOptions::new(spec.clone());
    o.tokenizer = TokenizerSource::None;
    synthesize(&o, dir).unwrap()
}

#[test]
fn published_layout_dtypes_and_mxfp4_values() {
    for dtype in [SynthDtype::Bf16, SynthDtype::F32] {
        let tmp = tempfile::tempdir().unwrap();
        let spec = spec(3, dtype);
        write(&spec, tmp.path());
        let config = crate::ModelConfig::load(tmp.path()).unwrap();
        assert_eq!(&config, spec.config());
        let ck = Checkpoint::open(tmp.path()).unwrap();
        ck.validate(&config.expected_tensors()).unwrap();
        let g = spec.geometry();
        let float = StoredDType::Float(match dtype {
            SynthDtype::Bf16 => crate::DType::BF16,
            SynthDtype::F32 => crate::DType::F32,
        });
        let sinks = config.layer_tensor_name(1, LayerTensor::Sinks);
        assert_eq!(ck.raw(&sinks).unwrap().shape, [g.num_heads]);
        for t in spec.tensors() {
            let raw = ck.raw(&t.name).unwrap();
            match &t.storage {
                Storage::Float => {
                    assert_eq!(raw.dtype, float, "{}", t.name);
                    let stored = ck.read_f32(&t.name, &t.shape).unwrap();
                    assert_eq!(stored, spec.tensor_f32(&t.name).unwrap(), "{}", t.name);
                }
                Storage::Mxfp4 { .. } => assert_eq!(raw.dtype, StoredDType::U8, "{}", t.name),
                Storage::F32 => panic!("gpt_oss stores no float tensor as F32: {}", t.name),
            }
        }
        for l in g.moe_layers() {
            let ExpertStorage::FusedMxfp4(n) = config.expert_storage(l) else {
                panic!("gpt_oss experts are fused MXFP4");
            };
            assert!(n.gate_up_interleaved);
            let (h, i, e_n) = (g.hidden, g.expert_intermediate, g.num_experts);
            for (blocks, scales, rows, cols) in [
                (&n.gate_up_blocks, &n.gate_up_scales, 2 * i, h),
                (&n.down_blocks, &n.down_scales, h, i),
            ] {
                let b = ck.raw(blocks).unwrap();
                let s = ck.raw(scales).unwrap();
                assert_eq!(b.shape, [e_n, rows, cols / 32, 16]);
                let name = blocks.strip_suffix("_blocks").unwrap();
                let t = Mxfp4Tensor::from_safetensors(name, b.as_mxfp4_raw(), s.as_mxfp4_raw())
                    .unwrap();
                // Every stored block decodes to the encoder's values of the
                // drawn f32 weights (std 1/sqrt(cols), not dtype-rounded).
                let mut drawn = vec![0f32; e_n * rows * cols];
                let init = values::Init::Normal {
                    std: 1.0 / (cols as f32).sqrt(),
                };
                fill_f32(spec.seed, name, &init, SynthDtype::F32, 1, 0, &mut drawn);
                let mut row = vec![0f32; cols];
                for e in 0..e_n {
                    let m = t.expert(e).unwrap();
                    for r in 0..rows {
                        m.dequant_row(r, &mut row);
                        let src = &drawn[(e * rows + r) * cols..][..cols];
                        for (k, chunk) in src.chunks(32).enumerate() {
                            let q = quantize_block(chunk).unwrap();
                            assert_eq!(&row[k * 32..][..32], &q[..], "{name} e{e} r{r} b{k}");
                        }
                    }
                }
            }
            // One expert regenerated on its own: the checkpoint's bytes.
            for e in [0, g.num_experts - 1] {
                let x = expert_mxfp4(&spec, l, e).unwrap();
                let slice = |name: &str, per: usize| {
                    ck.raw(name).unwrap().bytes[e * per..(e + 1) * per].to_vec()
                };
                assert_eq!(x.gate_up_blocks, slice(&n.gate_up_blocks, 2 * i * h / 2));
                assert_eq!(x.gate_up_scales, slice(&n.gate_up_scales, 2 * i * h / 32));
                assert_eq!(x.down_blocks, slice(&n.down_blocks, h * i / 2));
                assert_eq!(x.down_scales, slice(&n.down_scales, h * i / 32));
                let gub = ck
                    .read_f32(n.gate_up_bias.as_ref().unwrap(), &[e_n, 2 * i])
                    .unwrap();
                assert_eq!(x.gate_up_bias.as_deref(), Some(&gub[e * 2 * i..][..2 * i]));
                let db = ck
                    .read_f32(n.down_bias.as_ref().unwrap(), &[e_n, h])
                    .unwrap();
                assert_eq!(x.down_bias.as_deref(), Some(&db[e * h..][..h]));
                // expert_weights decodes the same bytes, gate = even rows.
                let w = expert_weights(&spec, l, e);
                let (gate, up) = t_expert_gate_up(&ck, &n.gate_up_blocks, &n.gate_up_scales, e);
                assert_eq!((w.gate, w.up), (gate, up));
                let b = w.bias.unwrap();
                assert_eq!(b.gate[1], gub[e * 2 * i + 2]);
                assert_eq!(b.up[1], gub[e * 2 * i + 3]);
            }
        }
        assert!(expert_mxfp4(&spec, g.num_layers, 0).is_none());
        let rec = SynthRecord::load(tmp.path()).unwrap();
        assert_eq!(rec.mxfp4_rule.as_deref(), Some(MXFP4_RULE));
        assert_eq!(rec.sink_rule.as_deref(), Some(record::SINK_RULE));
        assert_eq!(SynthSpec::from_checkpoint_dir(tmp.path()).unwrap(), spec);
    }
}

fn t_expert_gate_up(ck: &Checkpoint, b: &str, s: &str, e: usize) -> (Vec<f32>, Vec<f32>) {
    let (b, s) = (ck.raw(b).unwrap(), ck.raw(s).unwrap());
    let t = Mxfp4Tensor::from_safetensors("gu", b.as_mxfp4_raw(), s.as_mxfp4_raw()).unwrap();
    t.expert(e).unwrap().dequant_gate_up()
}

#[test]
fn deterministic_bytes_and_seed_sensitivity() {
    let tmp = tempfile::tempdir().unwrap();
    let read = |d: &str| std::fs::read(tmp.path().join(d).join("model.safetensors")).unwrap();
    write(&spec(5, SynthDtype::Bf16), &tmp.path().join("a"));
    write(&spec(5, SynthDtype::Bf16), &tmp.path().join("b"));
    write(&spec(6, SynthDtype::Bf16), &tmp.path().join("c"));
    assert_eq!(read("a"), read("b"));
    assert_ne!(read("a"), read("c"));
    // A qwen3_moe record does not gain the MXFP4 rule (its bytes are as
    // before this family existed).
    let q = SynthSpec::new(
        "tiny",
        1,
        SynthDtype::Bf16,
        0.0,
        &[("vocab_size".into(), json!(512))],
    )
    .unwrap();
    write(&q, &tmp.path().join("q"));
    let text = std::fs::read_to_string(tmp.path().join("q").join(RECORD_FILE)).unwrap();
    assert!(!text.contains("mxfp4") && !text.contains("sink"), "{text}");
}

#[test]
fn experts_in_cache_only_is_refused_with_the_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let mut o = SynthOptions::new(spec(1, SynthDtype::Bf16));
    o.tokenizer = TokenizerSource::None;
    o.skip_routed_experts = true;
    let e = synthesize(&o, &tmp.path().join("x"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--experts-in-cache-only") && e.contains("MXFP4"),
        "{e}"
    );
    assert!(!tmp.path().join("x").exists());
}

#[test]
fn family_tokenizer_and_template_are_enforced() {
    let s = spec(1, SynthDtype::Bf16);
    let o = SynthOptions::new(s.clone());
    assert_eq!(o.tokenizer, TokenizerSource::Harmony { vocab: None });
    assert_eq!(o.chat_template, ChatTemplateKind::GptOss);
    let tmp = tempfile::tempdir().unwrap();
    // vocab 512 cannot hold the harmony ids.
    let e = synthesize(&o, &tmp.path().join("a"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("201088"), "{e}");
    let mut o = SynthOptions::new(s);
    o.chat_template = ChatTemplateKind::Qwen3;
    let e = synthesize(&o, &tmp.path().join("b"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("'gpt-oss' chat template"), "{e}");
}

#[test]
fn reference_engine_loads_and_generates() {
    let tmp = tempfile::tempdir().unwrap();
    write(&spec(1, SynthDtype::Bf16), tmp.path());
    let mut e = ReferenceEngine::load(
        tmp.path(),
        ReferenceOptions {
            context_length: Some(64),
        },
    )
    .unwrap();
    // 20 tokens cross the 16-token sliding window of the even layers.
    let prompt: Vec<u32> = (0..20).map(|i| (i * 37 + 5) % 512).collect();
    let logits = e.stepwise_logits(&prompt).unwrap();
    for l in &logits {
        assert!(l.iter().all(|x| x.is_finite()));
        // Peaky like the qwen presets (LM_HEAD_GAIN): logits std of a few.
        let n = l.len() as f32;
        let mean = l.iter().sum::<f32>() / n;
        let std = (l.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / n).sqrt();
        assert!((1.0..30.0).contains(&std), "logit std {std}");
    }
    let mut e = ReferenceEngine::load(
        tmp.path(),
        ReferenceOptions {
            context_length: Some(64),
        },
    )
    .unwrap();
    let req = crate::engine::GenerateRequest {
        prompt: prompt.clone(),
        max_new_tokens: 4,
        sampling: crate::engine::SamplingParams::greedy(),
        stop_token_ids: vec![],
        cancel: Default::default(),
        live: Default::default(),
        cache_prompt: false,
        constraint: None,
    };
    let mut out = Vec::new();
    crate::engine::Engine::generate(&mut e, &req, &mut |t| {
        out.push(t);
        std::ops::ControlFlow::Continue(())
    })
    .unwrap();
    assert_eq!(out.len(), 4);
    // The first greedy token is the argmax of the last prompt position.
    let last = logits.last().unwrap();
    let argmax = (0..last.len())
        .max_by(|&a, &b| last[a].total_cmp(&last[b]))
        .unwrap() as u32;
    assert_eq!(out[0], argmax);
}

#[test]
fn routing_is_spread_and_the_20b_layout_has_the_published_size() {
    // Layer-0 routing of 400 token embeddings (RMS-normalized, attention
    // aside): top-k of router logits plus bias. Every expert gets a share,
    // none takes most of it.
    let spec = spec(1, SynthDtype::Bf16);
    let g = spec.geometry();
    let c = spec.config();
    let router = spec
        .tensor_f32(&c.layer_tensor_name(0, LayerTensor::Router))
        .unwrap();
    let bias = spec
        .tensor_f32(&c.layer_tensor_name(0, LayerTensor::RouterBias))
        .unwrap();
    let embed = c.tensor_name(crate::arch::ModelTensor::Embed);
    let mut counts = vec![0usize; g.num_experts];
    for tok in 0..400 {
        let x = spec.tensor_row_f32(&embed, tok % 512).unwrap();
        let rms = (x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32).sqrt();
        let mut logits: Vec<(f32, usize)> = (0..g.num_experts)
            .map(|e| {
                let row = &router[e * g.hidden..][..g.hidden];
                let dot: f32 = row.iter().zip(&x).map(|(w, v)| w * v / rms).sum();
                (dot + bias[e], e)
            })
            .collect();
        logits.sort_by(|a, b| b.0.total_cmp(&a.0));
        for &(_, e) in &logits[..g.top_k] {
            counts[e] += 1;
        }
    }
    let total = (400 * g.top_k) as f64;
    for (e, &n) in counts.iter().enumerate() {
        let share = n as f64 / total;
        assert!((0.03..0.4).contains(&share), "expert {e}: {counts:?}");
    }
    // openai/gpt-oss-20b's safetensors hold 13.76 GB: BF16 non-experts,
    // 4.25-bit experts, BF16 expert biases.
    let big = SynthSpec::new("gpt-oss-20b", 0, SynthDtype::Bf16, 0.0, &[]).unwrap();
    let bytes: u64 = big
        .tensors()
        .iter()
        .map(|t| t.bytes(SynthDtype::Bf16))
        .sum();
    assert!((13.6e9..13.9e9).contains(&(bytes as f64)), "{bytes}");
}
