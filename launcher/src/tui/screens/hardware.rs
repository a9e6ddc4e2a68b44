//! Hardware screen: GPUs, host memory and CPU, and the runtime's backends.

use crate::probe::{GpuReport, Hardware};
use crate::tui::app::App;
use crate::units::{fmt_bytes, fmt_count};
use krasis_common::Backend;
use ratatui::Frame;
use ratatui::layout::Rect;
use ratatui::widgets::{Block, Borders, Paragraph, Wrap};

/// Lines shared with `krasis probe`.
pub fn describe(hw: &Hardware) -> Vec<String> {
    let mut v = Vec::new();
    match &hw.gpus {
        GpuReport::Found {
            driver_version,
            gpus,
        } => {
            v.push(format!("NVIDIA driver {driver_version}"));
            for g in gpus {
                v.push(format!(
                    "GPU {}: {}  {} total, {} free  compute {}  PCIe {}",
                    g.index,
                    g.name,
                    fmt_bytes(g.total_bytes),
                    fmt_bytes(g.free_bytes),
                    g.compute_capability
                        .map_or("?".into(), |(a, b)| format!("{a}.{b}")),
                    match (g.pcie_gen, g.pcie_width) {
                        (Some(gen_), Some(w)) => format!("gen{gen_} x{w}"),
                        _ => "?".into(),
                    }
                ));
            }
        }
        GpuReport::Unavailable { reason } => v.push(format!("GPU: none usable: {reason}")),
    }
    let h = &hw.host;
    v.push(format!(
        "host RAM: {} total, {} available",
        fmt_bytes(h.total_ram_bytes),
        fmt_bytes(h.available_ram_bytes)
    ));
    v.push(format!(
        "CPU: {} ({} threads{})  OS: {}",
        h.cpu_brand,
        h.logical_cpus,
        h.physical_cores
            .map_or(String::new(), |c| format!(", {c} cores")),
        h.os
    ));
    v
}

/// What the chosen model asks of this machine per backend, from the
/// runtime's facts: the CUDA engine holds the expert cache (INT4 or MXFP4) in host
/// RAM; the reference engine reads the checkpoint's own experts.
pub fn model_needs(app: &App) -> Vec<String> {
    let Some((m, s)) = app.selected_model() else {
        return Vec::new();
    };
    if s.num_experts == 0 {
        return Vec::new();
    }
    vec![
        String::new(),
        format!("{} ({} parameters):", m.name, fmt_count(s.total_params)),
        format!(
            "  cuda backend: experts {}, {} in host RAM",
            s.experts_for(Backend::Cuda),
            fmt_bytes(s.int4_expert_bytes)
        ),
        format!(
            "  reference backend: experts {}, {} mapped from disk",
            s.experts_for(Backend::Reference),
            fmt_bytes(s.source_expert_bytes)
        ),
    ]
}

pub fn render(app: &App, f: &mut Frame, area: Rect) {
    let mut lines = describe(&app.hardware);
    lines.push(String::new());
    match &app.caps {
        Ok(c) => {
            lines.push(format!("krasis-runtime {}", c.runtime_version));
            for b in &c.backends {
                lines.push(match &b.reason {
                    None => format!("  backend {}: available", b.name),
                    Some(r) => format!("  backend {}: unavailable: {r}", b.name),
                });
            }
        }
        Err(e) => lines.push(format!("runtime: {e}")),
    }
    lines.extend(model_needs(app));
    f.render_widget(
        Paragraph::new(lines.join("\n"))
            .wrap(Wrap { trim: true })
            .block(Block::default().borders(Borders::ALL).title("Hardware")),
        area,
    );
}
