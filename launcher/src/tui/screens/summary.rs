//! Summary screen: the chosen options, the pre-flight estimate and whether
//! the combination is valid.

use crate::tui::app::App;
use crate::tui::fields::FIELDS;
use ratatui::Frame;
use ratatui::layout::Rect;
use ratatui::widgets::{Block, Borders, Paragraph, Wrap};

pub fn render(app: &App, f: &mut Frame, area: Rect) {
    let mut lines = vec![format!("model: {}", app.opts.model.display())];
    for field in FIELDS {
        lines.push(format!("  {:<28}{}", field.label(), field.show(&app.opts)));
    }
    lines.push(String::new());
    lines.push("Estimate:".into());
    match app.estimate() {
        Some(e) => lines.extend(e.lines().into_iter().map(|l| format!("  {l}"))),
        None => lines.push("  no model selected".into()),
    }
    lines.push(String::new());
    match app.validation() {
        Ok(()) => lines.push("Valid. Press Enter to launch.".into()),
        Err(e) => lines.push(format!("Cannot launch: {e}")),
    }
    if let Some(buf) = &app.editing {
        lines.push(format!("save as profile: {buf}_"));
    }
    f.render_widget(
        Paragraph::new(lines.join("\n"))
            .wrap(Wrap { trim: false })
            .block(Block::default().borders(Borders::ALL).title("Summary")),
        area,
    );
}
