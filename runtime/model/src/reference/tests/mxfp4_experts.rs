//! The reference engine's MXFP4 expert source against the checkpoint bytes
//! read independently here: gpt-oss interleaves gate/up rows (and their
//! biases), so row `j` of gate must be stored row `2j` and of up `2j + 1`.

use super::*;
use crate::arch::ExpertStorage;
use crate::formats::mxfp4::decode;

#[test]
fn mxfp4_experts_deinterleave_gate_up_rows_and_biases() {
    let dir = crate::testutil::tiny_gpt_oss_checkpoint();
    let config = ModelConfig::load(&dir).unwrap();
    let g = config.geometry();
    let ckpt = Arc::new(Checkpoint::open(&dir).unwrap());
    let src = CheckpointExperts::new(ckpt.clone(), &config);
    let (layer, e) = (1, 5);
    let ExpertStorage::FusedMxfp4(n) = config.expert_storage(layer) else {
        panic!("gpt_oss stores fused MXFP4 experts");
    };
    let w = src.expert_f32(layer, e).unwrap();
    let (h, i) = (g.hidden, g.expert_intermediate);
    let blocks = ckpt.raw(&n.gate_up_blocks).unwrap().bytes;
    let scales = ckpt.raw(&n.gate_up_scales).unwrap().bytes;
    // Element k of stored row r of expert e: byte k/2 of the row, low
    // nibble for even k; one scale per 32 values.
    let stored = |r: usize, k: usize| {
        let row = (e * 2 * i + r) * h;
        let byte = blocks[(row + k) / 2];
        let code = if k.is_multiple_of(2) {
            byte & 0xF
        } else {
            byte >> 4
        };
        decode(code, scales[(row + k) / 32])
    };
    for j in [0, 1, i / 2, i - 1] {
        for k in [0, 1, 31, 32, h - 1] {
            assert_eq!(
                w.gate[j * h + k].to_bits(),
                stored(2 * j, k).to_bits(),
                "gate {j},{k}"
            );
            assert_eq!(
                w.up[j * h + k].to_bits(),
                stored(2 * j + 1, k).to_bits(),
                "up {j},{k}"
            );
        }
    }
    let bias = w.bias.expect("gpt_oss experts have biases");
    let stored_bias = ckpt
        .read_f32(n.gate_up_bias.as_ref().unwrap(), &[g.num_experts, 2 * i])
        .unwrap();
    for j in [0, i - 1] {
        assert_eq!(bias.gate[j], stored_bias[e * 2 * i + 2 * j]);
        assert_eq!(bias.up[j], stored_bias[e * 2 * i + 2 * j + 1]);
    }
    assert_eq!(bias.down.len(), h);
    assert_eq!(w.down.len(), h * i);
}
