//! The live dashboard of a serving runtime: what the engine is doing, its
//! rates with their recent history, and memory (VRAM against the limit and
//! the margin, the GPU expert cache, pinned host RAM). Two columns on a
//! roomy terminal, packed into one on a small one.

use crate::tui::app::RunState;
use crate::units::{fmt_bytes, fmt_duration, fmt_ms};
use krasis_common::{Activity, EngineStats, LiveRequest};
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Paragraph, Sparkline};
use std::collections::VecDeque;
use std::time::Duration;

/// Rows the dashboard takes, borders included.
pub fn height(compact: bool) -> u16 {
    if compact { 8 } else { 7 }
}

/// One row of the dashboard.
enum Item {
    Text(Line<'static>),
    /// A rate and the sparkline of its history.
    Spark(String, Vec<u64>),
    /// Two of them side by side.
    Sparks([(String, Vec<u64>); 2]),
    /// `label [bar] suffix`, the bar as [`bar`] draws it.
    Bar {
        label: &'static str,
        used: f64,
        margin: f64,
        suffix: String,
    },
}

pub fn render(r: &RunState, f: &mut Frame, area: Rect, compact: bool) {
    let st = r.stats.as_ref();
    let state = state_line(st, r.stats_error.as_deref());
    let (prefill, decode) = sparks(r, area.width as usize);
    if compact {
        let items = vec![
            Item::Text(state),
            Item::Sparks([prefill, decode]),
            Item::Text(Line::raw(timing(st, true))),
            vram_bar(st, true),
            Item::Text(Line::raw(hcs_text(st, true))),
            Item::Text(Line::raw(format!("{}  {}", pinned(st), counts(st, false)))),
        ];
        column(f, area, "Engine", items);
        return;
    }
    let [left, right] =
        Layout::horizontal([Constraint::Percentage(50), Constraint::Percentage(50)]).areas(area);
    let engine = vec![
        Item::Text(state),
        Item::Spark(prefill.0, prefill.1),
        Item::Spark(decode.0, decode.1),
        Item::Text(Line::raw(timing(st, false))),
        Item::Text(Line::raw(counts(st, true))),
    ];
    let memory = vec![
        vram_bar(st, false),
        Item::Text(Line::raw(vram_text(st))),
        hcs_bar(st),
        Item::Text(Line::raw(hcs_text(st, false))),
        Item::Text(Line::raw(pinned(st))),
    ];
    column(f, left, "Engine", engine);
    column(f, right, "Memory", memory);
}

fn column(f: &mut Frame, area: Rect, title: &str, items: Vec<Item>) {
    let block = Block::default()
        .borders(Borders::ALL)
        .title(title.to_string());
    let inner = block.inner(area);
    f.render_widget(block, area);
    let rows = Layout::vertical(items.iter().map(|_| Constraint::Length(1))).split(inner);
    for (item, row) in items.into_iter().zip(rows.iter().copied()) {
        match item {
            Item::Text(l) => f.render_widget(Paragraph::new(l), row),
            Item::Spark(label, data) => spark(f, row, label, &data),
            Item::Sparks([a, b]) => {
                let [l, r] = Layout::horizontal([Constraint::Fill(1), Constraint::Fill(1)])
                    .spacing(1)
                    .areas(row);
                spark(f, l, a.0, &a.1);
                spark(f, r, b.0, &b.1);
            }
            Item::Bar {
                label,
                used,
                margin,
                suffix,
            } => {
                let w = (row.width as usize)
                    .saturating_sub(label.chars().count() + suffix.chars().count() + 2);
                let mut spans = vec![Span::raw(label), Span::raw(" ")];
                spans.extend(bar(w, used, margin));
                spans.push(Span::raw(format!(" {suffix}")));
                f.render_widget(Paragraph::new(Line::from(spans)), row);
            }
        }
    }
}

/// Width of a sparkline's rate label (`decode  21.2 tok/s `).
const SPARK_LABEL: u16 = 22;

fn spark(f: &mut Frame, area: Rect, label: String, data: &[u64]) {
    let [l, s] =
        Layout::horizontal([Constraint::Length(SPARK_LABEL), Constraint::Min(0)]).areas(area);
    f.render_widget(Paragraph::new(label), l);
    // The newest samples that fit, scaled to the largest of them.
    let data = &data[data.len().saturating_sub(s.width as usize)..];
    f.render_widget(
        Sparkline::default()
            .data(data)
            .style(Style::default().fg(Color::Green)),
        s,
    );
}

/// The rate labels and histories (tenths of tok/s, so a slow CPU engine's
/// 2.5 tok/s still has a shape).
fn sparks(r: &RunState, width: usize) -> ((String, Vec<u64>), (String, Vec<u64>)) {
    let st = r.stats.as_ref();
    // The running requests' rate once there is one, else the last
    // request's: the newest running request's prefill (in progress or
    // done), and all decoding requests together.
    let rate = |now: Option<f64>, last: Option<f64>| match now {
        Some(v) if v > 0.0 => v,
        _ => last.unwrap_or(0.0),
    };
    let newest_prefill = st.and_then(|s| {
        (s.running.iter().rev())
            .map(|c| c.prefill_tok_s)
            .find(|&v| v > 0.0)
    });
    let p = rate(newest_prefill, st.map(|s| s.last_prefill_tok_s));
    let d = rate(
        st.map(crate::tui::app::decoding_tok_s),
        st.map(|s| s.last_decode_tok_s),
    );
    let hist = |h: &VecDeque<f64>| -> Vec<u64> {
        h.iter()
            .skip(h.len().saturating_sub(width))
            .map(|v| (v * 10.0).round().max(0.0) as u64)
            .collect()
    };
    (
        (
            format!("prefill {p:>7.1} tok/s"),
            hist(&r.live.prefill_tok_s),
        ),
        (
            format!("decode  {d:>7.1} tok/s"),
            hist(&r.live.decode_tok_s),
        ),
    )
}

fn state_line(st: Option<&EngineStats>, err: Option<&str>) -> Line<'static> {
    let Some(s) = st else {
        return Line::raw(match err {
            Some(e) => format!("stats unavailable: {e}"),
            None => "waiting for the first stats ...".into(),
        });
    };
    let word = |w: &str, c: Color| {
        Span::styled(
            w.to_string(),
            Style::default().fg(c).add_modifier(Modifier::BOLD),
        )
    };
    let head = match (s.activity, s.running.is_empty()) {
        (Activity::Prefilling, false) => word("prefilling", Color::Yellow),
        (Activity::Decoding, false) => word("decoding", Color::Green),
        _ => return Line::from(word("idle", Color::Gray)),
    };
    let prefilled = |c: &LiveRequest| {
        format!(
            "{} of {} prompt tokens ({:.0}%)",
            c.prefilled_tokens,
            c.prompt_tokens,
            if c.prompt_tokens == 0 {
                0.0
            } else {
                c.prefilled_tokens as f64 * 100.0 / c.prompt_tokens as f64
            }
        )
    };
    let decoded = |c: &LiveRequest| format!("{} tokens (max {})", c.generated_tokens, c.max_tokens);
    let dim = Style::default().fg(Color::DarkGray);
    let [c] = &s.running[..] else {
        // Several: each request's id and progress, oldest first.
        let mut spans = vec![head, Span::raw(format!(" {} requests", s.running.len()))];
        for c in &s.running {
            let what = match c.activity {
                Activity::Prefilling => {
                    format!("prefill {}/{}", c.prefilled_tokens, c.prompt_tokens)
                }
                _ => format!("{}/{} tok", c.generated_tokens, c.max_tokens),
            };
            spans.push(Span::styled(format!("  #{} ", c.id), dim));
            spans.push(Span::raw(what));
        }
        return Line::from(spans);
    };
    let detail = match c.activity {
        Activity::Prefilling => prefilled(c),
        _ => decoded(c),
    };
    Line::from(vec![
        head,
        Span::raw(format!(" {detail}")),
        Span::styled(
            format!(
                "  #{} {}",
                c.id,
                c.client.as_deref().unwrap_or("unknown client")
            ),
            dim,
        ),
    ])
}

/// TTFT of the last request (and of the newest running one that has one),
/// elapsed time of the oldest running one; the compact form adds the queue.
fn timing(st: Option<&EngineStats>, compact: bool) -> String {
    let Some(s) = st else {
        return String::new();
    };
    let mut v = vec![format!(
        "TTFT last {}",
        s.last_ttft_ms.map_or("-".into(), fmt_ms)
    )];
    if let Some(t) = s.running.iter().rev().find_map(|c| c.ttft_ms) {
        v.push(format!("now {}", fmt_ms(t)));
    }
    if let Some(c) = s.running.first() {
        v.push(format!(
            "elapsed {}",
            fmt_duration(Duration::from_secs_f64(c.elapsed_ms.max(0.0) / 1000.0))
        ));
    }
    if compact {
        v.push(load(s));
    }
    v.join("  ")
}

/// The queue, the running requests (of `parallel`, when the engine says)
/// and the KV they hold.
fn load(s: &EngineStats) -> String {
    let mut v = format!("queue {}  active {}", s.queue_len, s.active_sequences);
    if s.parallel > 0 {
        v += &format!("/{}", s.parallel);
    }
    if let Some(kv) = s.kv {
        v += &format!("  KV {}/{} tok", kv.used_tokens, kv.total_tokens);
    }
    v
}

/// Requests finished, cancelled and refused, after the queue when asked.
fn counts(st: Option<&EngineStats>, queue: bool) -> String {
    let Some(s) = st else {
        return String::new();
    };
    let mut v = String::new();
    if queue {
        v = load(s) + "  ";
    }
    v + &format!(
        "done {}  cancelled {}  rejected {}",
        s.requests_completed, s.requests_cancelled, s.requests_rejected
    )
}

/// VRAM in use against the limit krasis was given (or the whole card), with
/// the safety margin marked at the limit's end.
fn vram_bar(st: Option<&EngineStats>, compact: bool) -> Item {
    let Some(v) = st.and_then(|s| s.vram.as_ref()) else {
        return Item::Text(Line::raw(no_vram(st)));
    };
    let limit = v.limit_bytes.unwrap_or(v.total_bytes).max(1);
    // `free_bytes` is what is left within the limit when one is set (the
    // engine's budget), else on the whole card: used is the rest of the same.
    let used = limit.saturating_sub(v.free_bytes);
    // What the bar's right end is: the limit krasis was given, or the card.
    let end = if v.limit_bytes.is_some() {
        "limit"
    } else {
        "GPU"
    };
    let mut suffix = format!("{} / {} {end}", fmt_bytes(used), fmt_bytes(limit));
    if compact {
        suffix.push_str(&format!(", margin {}", fmt_bytes(v.margin_bytes)));
    }
    Item::Bar {
        label: "VRAM",
        used: used as f64 / limit as f64,
        margin: v.margin_bytes as f64 / limit as f64,
        suffix,
    }
}

fn no_vram(st: Option<&EngineStats>) -> String {
    match st {
        Some(_) => "VRAM: none in use (the engine runs on the CPU)".into(),
        None => String::new(),
    }
}

fn vram_text(st: Option<&EngineStats>) -> String {
    let Some(v) = st.and_then(|s| s.vram.as_ref()) else {
        return String::new();
    };
    format!(
        "margin {}  free {}  min free {}",
        fmt_bytes(v.margin_bytes),
        fmt_bytes(v.free_bytes),
        fmt_bytes(v.min_free_bytes)
    )
}

fn hcs_bar(st: Option<&EngineStats>) -> Item {
    let Some(h) = st.and_then(|s| s.hcs.as_ref()) else {
        return Item::Text(Line::raw(hcs_off(st)));
    };
    let cov = h.resident_experts as f64 / h.total_experts.max(1) as f64;
    Item::Bar {
        label: "HCS ",
        used: cov,
        margin: 0.0,
        suffix: format!(
            "{:.1}% of experts resident ({}/{})",
            cov * 100.0,
            h.resident_experts,
            h.total_experts
        ),
    }
}

fn hcs_off(st: Option<&EngineStats>) -> String {
    match st {
        Some(_) => "HCS: off".into(),
        None => String::new(),
    }
}

fn hcs_text(st: Option<&EngineStats>, compact: bool) -> String {
    let Some(h) = st.and_then(|s| s.hcs.as_ref()) else {
        // The wide form has said so on the bar's row already.
        return if compact { hcs_off(st) } else { String::new() };
    };
    // Cold experts cross PCIe (copied into the tail, or read in place):
    // their count and bytes per decode step are the traffic.
    let traffic = format!(
        "hit {:.1}%  cold {:.1} experts ({})/step",
        h.hit_rate * 100.0,
        h.cold_experts_per_token.max(0.0),
        fmt_bytes(h.cold_bytes_per_token.max(0.0) as u64),
    );
    if compact {
        let cov = h.resident_experts as f64 / h.total_experts.max(1) as f64;
        format!("HCS {:.1}% resident  {traffic}", cov * 100.0)
    } else {
        traffic
    }
}

fn pinned(st: Option<&EngineStats>) -> String {
    match st {
        Some(s) => format!(
            "pinned host RAM {}",
            s.pinned_host_bytes.map_or("none".into(), fmt_bytes)
        ),
        None => String::new(),
    }
}

/// A `w`-cell bar: `█` in use, `░` free, `▒` the margin kept free at the
/// end; cells in use inside the margin turn red.
fn bar(w: usize, used: f64, margin: f64) -> Vec<Span<'static>> {
    let cells = |x: f64| ((x.clamp(0.0, 1.0) * w as f64).round() as usize).min(w);
    let u = cells(used);
    let m = if margin > 0.0 {
        cells(margin).max(1)
    } else {
        0
    };
    let free_end = w.saturating_sub(m);
    let mut spans = Vec::new();
    let ok = u.min(free_end);
    spans.push(Span::styled(
        "█".repeat(ok),
        Style::default().fg(Color::Green),
    ));
    if u > free_end {
        spans.push(Span::styled(
            "█".repeat(u - free_end),
            Style::default().fg(Color::Red),
        ));
    }
    spans.push(Span::styled(
        "░".repeat(free_end.saturating_sub(u)),
        Style::default().fg(Color::DarkGray),
    ));
    spans.push(Span::styled(
        "▒".repeat(w - u.max(free_end)),
        Style::default().fg(Color::Yellow),
    ));
    spans
}
