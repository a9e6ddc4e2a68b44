//! glm4_moe checkpoints as synth writes them and the reference engine reads
//! them: the published layout (selection biases stored F32, the MTP layer
//! present and skipped on load), the stand-in tokenizer's GLM markers at
//! their ids, and the reference forward running over the layer plan. The
//! reference's agreement with transformers is in `witness.rs` (fixture case
//! `tiny-glm4-moe`).

use krasis_model::arch::{LayerTensor, MlpKind, ModelConfig};
use krasis_model::checkpoint::StoredDType;
use krasis_model::reference::{ReferenceEngine, ReferenceOptions};
use krasis_model::testutil::tiny_glm4_moe_checkpoint;
use krasis_model::tokenizer::Tokenizer;
use krasis_model::{Checkpoint, DType, Engine};

#[test]
fn the_checkpoint_has_the_published_layout_and_the_mtp_layer_is_skipped() {
    let dir = tiny_glm4_moe_checkpoint();
    let config = ModelConfig::load(&dir).unwrap();
    let g = config.geometry();
    let ck = Checkpoint::open(&dir).unwrap();
    for l in g.moe_layers() {
        let bias = config.layer_tensor_name(l, LayerTensor::RouterSelectionBias);
        assert!(bias.ends_with("mlp.gate.e_score_correction_bias"), "{bias}");
        assert_eq!(
            ck.raw(&bias).unwrap().dtype,
            StoredDType::Float(DType::F32),
            "{bias}"
        );
        let shared = config.layer_tensor_name(l, LayerTensor::SharedDown);
        assert_eq!(
            ck.raw(&shared).unwrap().shape,
            [g.hidden, g.expert_intermediate]
        );
    }
    assert_eq!(g.mlp_kind(0), MlpKind::Dense);
    // The MTP layer (index num_hidden_layers) is there, as in a download...
    let mtp = config.skipped_tensors();
    assert!(!mtp.is_empty());
    for (name, shape) in &mtp {
        assert_eq!(&ck.raw(name).unwrap().shape, shape, "{name}");
    }
    // ...strict validation without the skip refuses it, and the engine
    // loads with it.
    assert!(ck.validate(&config.expected_tensors()).is_err());
    ck.validate_skipping(&config.expected_tensors(), &config.skipped_prefixes())
        .unwrap();
    let mut e = ReferenceEngine::load(&dir, ReferenceOptions::default()).unwrap();
    let logits = e
        .prompt_logits(&[151331, 151333, 151336, 9707, 151337])
        .unwrap();
    assert_eq!(logits.len(), 5);
    assert!(logits.iter().flatten().all(|v| v.is_finite()));
}

#[test]
fn glm_markers_tokenize_to_their_published_ids() {
    let dir = tiny_glm4_moe_checkpoint();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let ids = tok
        .encode("[gMASK]<sop><|user|>\nHi<|assistant|>\n<think></think>\n<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n</tool_call><|observation|>")
        .unwrap();
    for (marker, id) in [
        ("[gMASK]", 151331),
        ("<sop>", 151333),
        ("<|user|>", 151336),
        ("<|assistant|>", 151337),
        ("<|observation|>", 151338),
        ("<think>", 151350),
        ("</think>", 151351),
        ("<tool_call>", 151352),
        ("</tool_call>", 151353),
        ("<arg_key>", 151356),
        ("<arg_value>", 151358),
    ] {
        assert!(ids.contains(&id), "{marker} ({id}) missing from {ids:?}");
    }
    // Regular text stays in the BPE range below the added tokens.
    let plain = tok.encode("The quick brown fox").unwrap();
    assert!(plain.iter().all(|&i| i < 151_329), "{plain:?}");
}
