//! Options screen: the form, limited to what the runtime implements. Rows
//! the selected backend or this machine cannot use are dimmed, with the
//! reason below the form for the selected row.

use crate::tui::app::App;
use crate::tui::fields::FIELDS;
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Borders, List, ListItem, ListState, Paragraph, Wrap};

pub fn render(app: &App, f: &mut Frame, area: Rect) {
    let items: Vec<ListItem> = FIELDS
        .iter()
        .enumerate()
        .map(|(i, field)| {
            let kind = if field.is_choice() { "<>" } else { "  " };
            let (value, style) = match (&app.editing, app.field_unavailable(i)) {
                (Some(buf), _) if i == app.field_idx => (format!("{buf}_"), Style::default()),
                (_, Some(why)) => (format!("n/a: {why}"), Style::default().fg(Color::DarkGray)),
                _ => (field.show(&app.opts), Style::default()),
            };
            ListItem::new(Line::styled(
                format!("{:<28}{kind} {value}", field.label()),
                style,
            ))
        })
        .collect();
    let why = app.field_unavailable(app.field_idx);
    let [form, about] = Layout::vertical([
        Constraint::Min(3),
        Constraint::Length(if why.is_some() { 3 } else { 0 }),
    ])
    .areas(area);
    let title = format!("Options for {}", app.opts.model.display());
    let mut state = ListState::default().with_selected(Some(app.field_idx));
    f.render_stateful_widget(
        List::new(items)
            .block(Block::default().borders(Borders::ALL).title(title))
            .highlight_style(Style::default().add_modifier(Modifier::REVERSED))
            .highlight_symbol("> "),
        form,
        &mut state,
    );
    if let Some(why) = why {
        f.render_widget(
            Paragraph::new(format!(
                "{} is not available: {why}",
                FIELDS[app.field_idx].label()
            ))
            .wrap(Wrap { trim: true })
            .block(Block::default().borders(Borders::TOP)),
            about,
        );
    }
}
