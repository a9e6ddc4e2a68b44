//! The run screen fed a real `/v1/stats` snapshot, taken on the H200 while
//! the CUDA engine decoded a 3,861-token prompt of a3b-24l at a 6 GiB VRAM
//! limit (`benchmarks/serve_live.sh`, results in
//! `benchmarks/results/2026-12-01-issue12-serve-live.txt`). It checks that
//! the launcher reads the runtime's real output (not only hand-made structs)
//! and shows every figure the issue asks for. (Protocol 5 turned its
//! `current` request into the one-entry `running` list and added
//! `parallel`; nothing else changed.) `docs/run-screen-h200.txt` is
//! this render: `cargo test -p krasis --lib tui::tests::h200 -- --nocapture`.

use super::*;

const SNAPSHOT: &str = include_str!("fixtures/h200-a3b-24l-6GiB-decoding.json");

#[test]
fn a_real_h200_snapshot_shows_every_figure() {
    let stats: EngineStats = serde_json::from_str(SNAPSHOT).expect("the runtime's JSON parses");
    let mut a = launched(true);
    ready(&mut a);
    a.update(Event::Stats(Ok(stats)));
    let s = screen_text(&a, 120, 40);
    println!("{s}");
    for want in [
        "decoding 120 tokens (max 400)",
        "127.0.0.1:60280",
        "TTFT",
        "169 ms",
        "898/3072",
        "98.8%",
        "pinned host RAM 7.5 GiB",
    ] {
        assert!(s.contains(want), "missing {want:?} in\n{s}");
    }
    // The VRAM gauge is the engine's use against its 6 GiB limit (free is
    // reported within the limit), with the margin; not the card's 139 GiB.
    assert!(s.contains("5.3 GiB / 6.0 GiB limit"), "VRAM gauge in\n{s}");
    assert!(s.contains("margin 600.0 MiB"), "no margin in\n{s}");
}
