//! One module per screen; this one draws the frame around them: the screen
//! tabs on top, the key hints and messages at the bottom, and the `?`
//! overlay over everything.

pub mod hardware;
pub mod help;
pub mod model;
pub mod options;
pub mod run;
mod run_live;
mod run_log;
pub mod summary;

use super::app::{App, Screen};
use super::keys;
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Paragraph, Tabs, Wrap};

pub fn draw(app: &App, f: &mut Frame) {
    let hints = keys::footer(&app.key_tables());
    let width = f.area().width.max(1) as usize;
    // The hints wrap rather than vanish on a narrow terminal.
    let hint_rows = hints.chars().count().div_ceil(width).clamp(1, 3) as u16;
    let message_rows = u16::from(app.message.is_some());
    let [top, body, bottom] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Min(3),
        Constraint::Length(hint_rows + message_rows),
    ])
    .areas(f.area());
    let idx = Screen::ALL
        .iter()
        .position(|s| *s == app.screen)
        .unwrap_or(0);
    f.render_widget(
        Tabs::new(Screen::ALL.iter().map(|s| {
            // Tabs that cannot be reached yet are dimmed (the number key
            // says why).
            let style = match app.reachable(*s) {
                Ok(()) => Style::default(),
                Err(_) => Style::default().fg(Color::DarkGray),
            };
            Line::styled(s.title(), style)
        }))
        .select(idx)
        .highlight_style(Style::default().add_modifier(Modifier::REVERSED))
        .divider("|"),
        top,
    );
    match app.screen {
        Screen::Model => model::render(app, f, body),
        Screen::Hardware => hardware::render(app, f, body),
        Screen::Options => options::render(app, f, body),
        Screen::Summary => summary::render(app, f, body),
        Screen::Run => run::render(app, f, body),
    }
    let mut lines = vec![Line::styled(hints, Style::default().fg(Color::DarkGray))];
    if let Some(m) = &app.message {
        lines.insert(
            0,
            Line::styled(m.clone(), Style::default().fg(Color::Yellow)),
        );
    }
    f.render_widget(Paragraph::new(lines).wrap(Wrap { trim: true }), bottom);
    if app.help {
        help::render(app, f);
    }
}
