//! Run screen: what the runtime is doing. While it starts: the startup
//! phase and a progress bar with rate and ETA. Once it serves: the live
//! dashboard (`run_live`) and the request log. Always: the runtime's log
//! (`run_log`).

use super::{run_live, run_log};
use crate::tui::app::{App, RunState, RunStatus};
use crate::units::fmt_ms;
use krasis_common::RequestRecord;
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::widgets::{Block, Borders, Cell, Gauge, Paragraph, Row, Table, Wrap};

/// Below this the dashboard packs its figures into fewer rows.
pub const COMPACT_BELOW: (u16, u16) = (100, 30);

pub fn render(app: &App, f: &mut Frame, area: Rect) {
    let r = &app.run;
    let status = status_lines(r);
    let compact = area.width < COMPACT_BELOW.0 || area.height < COMPACT_BELOW.1;
    let ready = matches!(r.status, RunStatus::Ready { .. });
    let show_requests = ready || !r.live.requests.is_empty();

    let mut parts = vec![Constraint::Length(status.len() as u16 + 2)];
    if r.progress.is_some() {
        parts.push(Constraint::Length(3));
    }
    if ready {
        parts.push(Constraint::Length(run_live::height(compact)));
    }
    if show_requests {
        parts.push(Constraint::Fill(1));
    }
    parts.push(Constraint::Fill(1));
    let areas = Layout::vertical(parts).split(area);
    let mut next = areas.iter().copied();
    let mut take = || next.next().unwrap_or_default();

    f.render_widget(
        Paragraph::new(status.join("\n"))
            .wrap(Wrap { trim: true })
            .block(Block::default().borders(Borders::ALL).title("Runtime")),
        take(),
    );
    if let Some(p) = &r.progress {
        f.render_widget(
            Gauge::default()
                .ratio(p.ratio())
                .label(p.label())
                .gauge_style(Style::default().fg(Color::Cyan).bg(Color::Black))
                .block(Block::default().borders(Borders::ALL).title("Progress")),
            take(),
        );
    }
    if ready {
        run_live::render(r, f, take(), compact);
    }
    if show_requests {
        requests(r, f, take());
    }
    run_log::render(r, f, take());
}

/// The headline and what belongs with it: the startup phase only while
/// starting (it goes stale the moment the server is ready), where a failed
/// start stopped, the HCS decision of the serving process, crash history.
fn status_lines(r: &RunState) -> Vec<String> {
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
        } => format!(
            "runtime FAILED: {description}; see the log below; r: restart, b: back to change options"
        ),
    }];
    let phase = r.phases.last();
    match (&r.status, phase) {
        (RunStatus::Starting, Some((phase, detail))) => {
            s.push(format!("phase: {phase}: {detail}"));
            if r.phases.len() > 1 {
                let done: Vec<&str> = r.phases[..r.phases.len() - 1]
                    .iter()
                    .map(|(p, _)| p.as_str())
                    .collect();
                s.push(format!("done: {}", done.join(" > ")));
            }
        }
        (RunStatus::Exited { success: false, .. }, Some((phase, detail)))
            if r.last_crash.is_none() =>
        {
            s.push(format!("failed during startup phase {phase}: {detail}"));
        }
        _ => {}
    }
    if let (RunStatus::Ready { .. }, Some(h)) = (&r.status, &r.hcs) {
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
    s
}

/// The request log, newest at the bottom like the runtime log. A narrow
/// table drops the prefill rate and shortens the endpoint so the client
/// address still fits.
fn requests(r: &RunState, f: &mut Frame, area: Rect) {
    let narrow = area.width < COMPACT_BELOW.0;
    let rows_fit = area.height.saturating_sub(3) as usize;
    let reqs = &r.live.requests;
    let rows = reqs
        .iter()
        .skip(reqs.len().saturating_sub(rows_fit))
        .map(|q| request_row(q, narrow));
    let mut header = vec!["time", "endpoint", "prompt", "compl", "TTFT"];
    let mut widths = vec![
        Constraint::Length(8),
        Constraint::Length(if narrow { 10 } else { 16 }),
        Constraint::Length(6),
        Constraint::Length(5),
        Constraint::Length(7),
    ];
    if !narrow {
        header.push("prefill/s");
        widths.push(Constraint::Length(9));
    }
    header.extend(["decode/s", "finish", "client"]);
    widths.extend([
        Constraint::Length(8),
        Constraint::Length(9),
        Constraint::Min(6),
    ]);
    let title = format!("Requests ({})", reqs.len());
    f.render_widget(
        Table::new(rows, widths)
            .header(Row::new(header).style(Style::default().add_modifier(Modifier::BOLD)))
            .block(Block::default().borders(Borders::ALL).title(title)),
        area,
    );
}

fn request_row(q: &RequestRecord, narrow: bool) -> Row<'static> {
    let endpoint = q.endpoint.strip_prefix("/v1/").unwrap_or(&q.endpoint);
    let finish_style = match q.finish_reason.as_str() {
        "error" => Style::default().fg(Color::Red),
        "cancelled" => Style::default().fg(Color::Yellow),
        _ => Style::default(),
    };
    let mut cells = vec![
        Cell::from(clock(q.finished_unix_ms)),
        Cell::from(endpoint.to_string()),
        Cell::from(q.prompt_tokens.to_string()),
        Cell::from(q.completion_tokens.to_string()),
        Cell::from(q.ttft_ms.map_or("-".into(), fmt_ms)),
    ];
    if !narrow {
        cells.push(Cell::from(format!("{:.1}", q.prefill_tok_s)));
    }
    cells.extend([
        Cell::from(format!("{:.1}", q.decode_tok_s)),
        Cell::from(q.finish_reason.clone()).style(finish_style),
        Cell::from(q.client.clone().unwrap_or_else(|| "-".into())),
    ]);
    Row::new(cells)
}

/// Local wall-clock time `HH:MM:SS` of a Unix time in milliseconds.
#[cfg(unix)]
fn clock(unix_ms: u64) -> String {
    let t = (unix_ms / 1000) as libc::time_t;
    // SAFETY: localtime_r only writes the `tm` we own; a zeroed `tm` is a
    // valid value of the plain C struct.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    if unsafe { libc::localtime_r(&t, &mut tm) }.is_null() {
        return "?".into();
    }
    format!("{:02}:{:02}:{:02}", tm.tm_hour, tm.tm_min, tm.tm_sec)
}

/// Elsewhere (Windows has no `localtime_r`), UTC, marked as such so the
/// column is never mistaken for local time.
#[cfg(not(unix))]
fn clock(unix_ms: u64) -> String {
    let s = unix_ms / 1000 % 86_400;
    format!("{:02}:{:02}:{:02}Z", s / 3600, s / 60 % 60, s % 60)
}
