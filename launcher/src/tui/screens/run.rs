//! Run screen: startup phases, progress, the ready URL, live stats and the
//! runtime's log tail.

use crate::tui::app::{App, RunStatus};
use crate::units::fmt_bytes;
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::widgets::{Block, Borders, Gauge, Paragraph, Wrap};

pub fn render(app: &App, f: &mut Frame, area: Rect) {
    let r = &app.run;
    let [status_area, gauge_area, stats_area, log_area] = Layout::vertical([
        Constraint::Length(6),
        Constraint::Length(1),
        Constraint::Length(4),
        Constraint::Min(3),
    ])
    .areas(area);

    let mut s = vec![match &r.status {
        RunStatus::Idle => "not started".to_string(),
        RunStatus::Starting => "starting ...".into(),
        RunStatus::Ready { url } => {
            format!("READY at {url}  (OpenAI API: {url}/v1/chat/completions)")
        }
        RunStatus::Restarting { message } => format!("{message}; s: stop"),
        RunStatus::Stopping => "stopping ...".into(),
        RunStatus::Exited {
            success: true,
            description,
        } => format!("runtime {description}"),
        RunStatus::Exited {
            success: false,
            description,
        } => {
            format!(
                "runtime FAILED: {description}; see the log below; r: restart, b: back to change options"
            )
        }
    }];
    if let Some((phase, detail)) = r.phases.last() {
        s.push(format!("phase: {phase}: {detail}"));
    }
    if r.phases.len() > 1 {
        s.push(format!(
            "done: {}",
            r.phases[..r.phases.len() - 1]
                .iter()
                .map(|(p, _)| p.as_str())
                .collect::<Vec<_>>()
                .join(" > ")
        ));
    }
    if let Some(h) = &r.hcs {
        s.push(format!("HCS: {h}"));
    }
    if let Some(m) = &r.fatal {
        s.push(format!("FATAL: {m}"));
    }
    if let (Some(last), false) = (
        &r.last_crash,
        matches!(r.status, RunStatus::Restarting { .. }),
    ) {
        s.push(format!(
            "restarted after a crash {} time{}; last: {last}",
            r.crashes,
            if r.crashes == 1 { "" } else { "s" }
        ));
    }
    f.render_widget(
        Paragraph::new(s.join("\n"))
            .wrap(Wrap { trim: true })
            .block(Block::default().borders(Borders::ALL).title("Runtime")),
        status_area,
    );

    if let Some((task, done, total, unit)) = &r.progress {
        let ratio = if *total == 0 {
            0.0
        } else {
            (*done as f64 / *total as f64).clamp(0.0, 1.0)
        };
        f.render_widget(
            Gauge::default()
                .ratio(ratio)
                .label(format!("{task}: {done}/{total} {unit}")),
            gauge_area,
        );
    }

    let stats = match (&r.stats, &r.stats_error) {
        (Some(st), _) => {
            let mut l = vec![format!(
                "prefill {:.1} tok/s  decode {:.1} tok/s  requests {} (rejected {}, queued {})",
                st.last_prefill_tok_s,
                st.last_decode_tok_s,
                st.requests_completed,
                st.requests_rejected,
                st.queue_len
            )];
            let mut second = Vec::new();
            if let Some(h) = &st.hcs {
                second.push(format!(
                    "HCS hit rate {:.1}% ({}/{} resident)",
                    h.hit_rate * 100.0,
                    h.resident_experts,
                    h.total_experts
                ));
            }
            if let Some(v) = &st.vram {
                second.push(format!(
                    "free VRAM {} of {}",
                    fmt_bytes(v.free_bytes),
                    fmt_bytes(v.total_bytes)
                ));
            }
            if !second.is_empty() {
                l.push(second.join("  "));
            }
            l.join("\n")
        }
        (None, Some(e)) => format!("stats unavailable: {e}"),
        (None, None) => "stats appear once the server is ready".into(),
    };
    f.render_widget(
        Paragraph::new(stats).block(Block::default().borders(Borders::ALL).title("Live stats")),
        stats_area,
    );

    let rows = log_area.height.saturating_sub(2) as usize;
    let tail: Vec<&str> = r
        .log
        .iter()
        .skip(r.log.len().saturating_sub(rows))
        .map(String::as_str)
        .collect();
    f.render_widget(
        Paragraph::new(tail.join("\n")).block(Block::default().borders(Borders::ALL).title("Log")),
        log_area,
    );
}
