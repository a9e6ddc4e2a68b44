//! The `?` overlay: every key of the current screen, from the same tables
//! the key handling uses.

use crate::tui::app::App;
use crate::tui::keys;
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::{Block, Borders, Clear, Paragraph, Wrap};

pub fn render(app: &App, f: &mut Frame) {
    let sections: [(&str, &[keys::Binding]); 2] = [
        (app.screen.title(), keys::screen(app.screen)),
        ("every screen", keys::GLOBAL),
    ];
    let key_width = sections
        .iter()
        .flat_map(|(_, t)| t.iter())
        .map(|b| b.label.chars().count())
        .max()
        .unwrap_or(0)
        + 2;
    let mut lines = Vec::new();
    for (i, (title, table)) in sections.iter().enumerate() {
        if i > 0 {
            lines.push(Line::raw(""));
        }
        lines.push(Line::styled(
            title.to_string(),
            Style::default().add_modifier(Modifier::BOLD),
        ));
        for b in *table {
            lines.push(Line::from(vec![
                Span::styled(
                    format!("  {:<key_width$}", b.label),
                    Style::default().add_modifier(Modifier::BOLD),
                ),
                Span::raw(b.help),
            ]));
        }
    }
    let area = centered(f.area(), 64, lines.len() as u16 + 2);
    f.render_widget(Clear, area);
    f.render_widget(
        Paragraph::new(lines).wrap(Wrap { trim: false }).block(
            Block::default()
                .borders(Borders::ALL)
                .title(" Keys (Esc or ? closes) "),
        ),
        area,
    );
}

/// A `w`×`h` box in the middle of `r`, shrunk to fit.
fn centered(r: Rect, w: u16, h: u16) -> Rect {
    let [_, mid, _] = Layout::vertical([
        Constraint::Fill(1),
        Constraint::Length(h.min(r.height)),
        Constraint::Fill(1),
    ])
    .areas(r);
    let [_, c, _] = Layout::horizontal([
        Constraint::Fill(1),
        Constraint::Length(w.min(r.width)),
        Constraint::Fill(1),
    ])
    .areas(mid);
    c
}
