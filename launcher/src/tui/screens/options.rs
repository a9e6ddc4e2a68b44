//! Options screen: the form, limited to what the runtime implements.

use crate::tui::app::App;
use crate::tui::fields::FIELDS;
use ratatui::Frame;
use ratatui::layout::Rect;
use ratatui::style::{Modifier, Style};
use ratatui::widgets::{Block, Borders, List, ListItem, ListState};

pub fn render(app: &App, f: &mut Frame, area: Rect) {
    let items: Vec<ListItem> = FIELDS
        .iter()
        .enumerate()
        .map(|(i, field)| {
            let value = match &app.editing {
                Some(buf) if i == app.field_idx => format!("{buf}_"),
                _ => field.show(&app.opts),
            };
            let kind = if field.is_choice() { "<>" } else { "  " };
            ListItem::new(format!("{:<28}{kind} {value}", field.label()))
        })
        .collect();
    let title = format!("Options for {}", app.opts.model.display());
    let mut state = ListState::default().with_selected(Some(app.field_idx));
    f.render_stateful_widget(
        List::new(items)
            .block(Block::default().borders(Borders::ALL).title(title))
            .highlight_style(Style::default().add_modifier(Modifier::REVERSED))
            .highlight_symbol("> "),
        area,
        &mut state,
    );
}
