//! One module per screen; this one draws the frame around them: the screen
//! tabs on top and the key hints and messages at the bottom.

pub mod hardware;
pub mod model;
pub mod options;
pub mod run;
pub mod summary;

use super::app::{App, Screen};
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Paragraph, Tabs, Wrap};

pub fn draw(app: &App, f: &mut Frame) {
    let [top, body, bottom] = Layout::vertical([
        Constraint::Length(1),
        Constraint::Min(3),
        Constraint::Length(2),
    ])
    .areas(f.area());
    let idx = Screen::ALL
        .iter()
        .position(|s| *s == app.screen)
        .unwrap_or(0);
    f.render_widget(
        Tabs::new(Screen::ALL.iter().map(|s| s.title()))
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
    let hints = match (app.screen, app.editing.is_some()) {
        (_, true) => "type, Enter: accept  Esc: cancel",
        (Screen::Model, _) => "Up/Down: select  Enter: choose  q: quit",
        (Screen::Hardware, _) => "Enter: options  Esc: back  q: quit",
        (Screen::Options, _) => {
            "Up/Down: field  Left/Right: choose  Enter: edit  Tab: summary  Esc: back  q: quit"
        }
        (Screen::Summary, _) => "Enter: launch  p: save as profile  Esc: back  q: quit",
        (Screen::Run, _) => "s: stop  r: restart  b: back (when stopped)  q: quit",
    };
    let mut lines = vec![Line::styled(hints, Style::default().fg(Color::DarkGray))];
    if let Some(m) = &app.message {
        lines.insert(
            0,
            Line::styled(m.clone(), Style::default().fg(Color::Yellow)),
        );
    }
    f.render_widget(Paragraph::new(lines).wrap(Wrap { trim: true }), bottom);
}
