//! `krasis probe` as text: short sections of sentences and aligned columns,
//! rendered from the same [`ProbeReport`] as `--json`.

use super::report::{CacheState, GpuStatus, ModelStatus, ProbeReport, RuntimeStatus};
use crate::units::fmt_bytes;
use std::fmt::Write;

/// A count with a unit people read: 950, 40.2M, 30.5B.
pub fn fmt_count(n: u64) -> String {
    let f = n as f64;
    match n {
        0..1_000 => n.to_string(),
        1_000..1_000_000 => format!("{:.1}K", f / 1e3),
        1_000_000..1_000_000_000 => format!("{:.1}M", f / 1e6),
        _ => format!("{:.1}B", f / 1e9),
    }
}

/// Rows of cells as left-aligned columns two spaces apart, each line
/// starting with `indent`. Shared with `krasis profiles list`.
pub fn table(out: &mut String, indent: &str, rows: &[Vec<String>]) {
    let cols = rows.iter().map(Vec::len).max().unwrap_or(0);
    let width: Vec<usize> = (0..cols)
        .map(|c| {
            // A row's last cell runs on, so it does not widen its column.
            rows.iter()
                .filter(|r| r.len() > c + 1)
                .map(|r| r[c].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for r in rows {
        let mut line = String::from(indent);
        for (c, cell) in r.iter().enumerate() {
            if c + 1 == r.len() {
                line.push_str(cell);
            } else {
                let _ = write!(line, "{cell:<w$}  ", w = width[c]);
            }
        }
        let _ = writeln!(out, "{}", line.trim_end());
    }
}

pub fn render(r: &ProbeReport) -> String {
    let mut o = String::new();
    let w = &mut o;

    // GPUs.
    match r.gpus.status {
        GpuStatus::Found => {
            let _ = writeln!(
                w,
                "GPUs: {} found (NVIDIA driver {})",
                r.gpus.devices.len(),
                r.gpus.driver_version.as_deref().unwrap_or("unknown")
            );
            let rows: Vec<Vec<String>> = r
                .gpus
                .devices
                .iter()
                .map(|g| {
                    vec![
                        format!("{}:", g.index),
                        g.name.clone(),
                        format!(
                            "{} free of {}",
                            fmt_bytes(g.free_bytes),
                            fmt_bytes(g.total_bytes)
                        ),
                        g.compute_capability
                            .as_ref()
                            .map_or("compute capability unknown".into(), |c| {
                                format!("compute {c}")
                            }),
                        match (g.pcie_generation, g.pcie_width) {
                            (Some(gen_), Some(wd)) => format!("PCIe gen {gen_} x{wd}"),
                            _ => "PCIe link unknown".into(),
                        },
                    ]
                })
                .collect();
            table(w, "  ", &rows);
        }
        GpuStatus::Unavailable => {
            let _ = writeln!(
                w,
                "GPUs: none usable: {}",
                r.gpus.reason.as_deref().unwrap_or("no reason given")
            );
        }
    }

    // Host.
    let h = &r.host;
    let cores = h
        .physical_cores
        .map_or(String::new(), |c| format!(" on {c} cores"));
    let _ = writeln!(w, "\nHost:");
    table(
        w,
        "  ",
        &[
            vec![
                "RAM".into(),
                format!(
                    "{} available of {}",
                    fmt_bytes(h.available_ram_bytes),
                    fmt_bytes(h.total_ram_bytes)
                ),
            ],
            vec![
                "CPU".into(),
                format!("{}, {} threads{cores}", h.cpu, h.logical_cpus),
            ],
            vec!["OS".into(), h.os.clone()],
        ],
    );

    // Models.
    let usable = r
        .models
        .iter()
        .filter(|m| m.status == ModelStatus::Ok)
        .count();
    let _ = match (r.models.len(), usable) {
        (0, _) => writeln!(w, "\nModels: none found."),
        (n, u) if n == u => writeln!(w, "\nModels: {n} found."),
        (n, u) => writeln!(w, "\nModels: {n} found, {u} usable."),
    };
    if !r.models.is_empty() {
        let mut rows = vec![vec![
            "NAME".to_string(),
            "TYPE".into(),
            "PARAMS".into(),
            "EXPERTS".into(),
            "CACHED EXPERTS".into(),
            "EXPERT CACHE".into(),
        ]];
        for m in &r.models {
            match (&m.facts, &m.cache) {
                (Some(f), Some(c)) => rows.push(vec![
                    m.name.clone(),
                    f.model_type.clone(),
                    fmt_count(f.total_params),
                    format!(
                        "{} x {}, top {}",
                        f.moe_layers, f.num_experts, f.experts_per_token
                    ),
                    fmt_bytes(f.int4_expert_bytes),
                    match c.status {
                        CacheState::Valid => {
                            format!("built, {}", fmt_bytes(c.bytes.unwrap_or(0)))
                        }
                        CacheState::Missing => "not built yet".into(),
                        CacheState::Invalid => "stale or damaged; rebuilt on launch".into(),
                        CacheState::OldFormat => "older format: rebuild it (see --json)".into(),
                        CacheState::Unknown => "cannot tell".into(),
                    },
                ]),
                _ => rows.push(vec![
                    m.name.clone(),
                    format!("unusable: {}", m.reason.as_deref().unwrap_or("unknown")),
                ]),
            }
        }
        table(w, "  ", &rows);
        let _ = writeln!(w, "  Paths:");
        let rows: Vec<Vec<String>> = r
            .models
            .iter()
            .map(|m| vec![m.name.clone(), m.path.clone()])
            .collect();
        table(w, "    ", &rows);
    }
    let _ = writeln!(w, "  Searched, in this order:");
    let rows: Vec<Vec<String>> = r
        .model_roots
        .iter()
        .map(|root| {
            vec![
                root.path.clone(),
                format!(
                    "({}{})",
                    root.kind.describe(),
                    if root.exists { "" } else { "; does not exist" }
                ),
            ]
        })
        .collect();
    table(w, "    ", &rows);

    // Runtime.
    let rt = &r.runtime;
    match rt.status {
        RuntimeStatus::Ok => {
            let _ = writeln!(
                w,
                "\nRuntime: krasis-runtime {} at {}",
                rt.version.as_deref().unwrap_or("?"),
                rt.path.as_deref().unwrap_or("?")
            );
            let rows: Vec<Vec<String>> = rt
                .backends
                .iter()
                .map(|b| {
                    vec![
                        format!("backend {}:", b.name),
                        match &b.reason {
                            _ if b.available => "available".into(),
                            Some(reason) => format!("unavailable: {reason}"),
                            None => "unavailable".into(),
                        },
                    ]
                })
                .collect();
            table(w, "  ", &rows);
            for a in &rt.architectures {
                let _ = writeln!(
                    w,
                    "  serves {}: experts {}, attention {}, KV cache {}, MLP {}, pruning {}, GPU expert cache (HCS) {}",
                    a.model_type,
                    a.expert_precisions.join("/"),
                    a.attention_precisions.join("/"),
                    a.kv_formats.join("/"),
                    a.mlp_precisions.join("/"),
                    a.pruning_modes.join("/"),
                    if a.hcs { "yes" } else { "no" }
                );
            }
        }
        RuntimeStatus::Error => {
            let _ = writeln!(
                w,
                "\nRuntime: not usable: {}",
                rt.reason.as_deref().unwrap_or("no reason given")
            );
        }
    }
    o
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::probe::Probe;
    use crate::probe::fake::FakeProbe;

    #[test]
    fn counts_have_units() {
        assert_eq!(fmt_count(950), "950");
        assert_eq!(fmt_count(40_226_880), "40.2M");
        assert_eq!(fmt_count(30_532_122_624), "30.5B");
    }

    #[test]
    fn reads_as_sentences_and_columns() {
        let p = FakeProbe { gpu: true };
        let caps = crate::runtime::tests::fake_caps(true);
        let r = super::super::report::build(
            &p.hardware(),
            &crate::probe::models::default_roots("/data/models".into(), &[]),
            &p.models(),
            &Ok(("/opt/krasis-runtime".into(), caps)),
        );
        let t = render(&r);
        assert!(
            t.starts_with("GPUs: 1 found (NVIDIA driver 580.00)\n"),
            "{t}"
        );
        assert!(
            t.contains(
                "  0:  Fake RTX 4090  23.0 GiB free of 24.0 GiB  compute 8.9  PCIe gen 4 x16\n"
            ),
            "{t}"
        );
        assert!(t.contains("Models: 2 found, 1 usable."), "{t}");
        assert!(
            t.contains("unusable: model_type 'llama' is not supported"),
            "{t}"
        );
        // No Debug output (`Some(..)`, `Found {`, `HfHub`) anywhere.
        for bad in ["Some(", "None", "{", "HfHub", "KrasisData", "Ok("] {
            assert!(!t.contains(bad), "{bad:?} in\n{t}");
        }
    }
}
