//! Summary screen: the chosen options, the pre-flight estimate and whether
//! the combination is valid.

use crate::tui::app::App;
use crate::tui::fields::FIELDS;
use crate::units::fmt_count;
use krasis_common::Backend;
use ratatui::Frame;
use ratatui::layout::Rect;
use ratatui::widgets::{Block, Borders, Paragraph, Wrap};

/// The model facts the runtime reported, for the chosen backend: the
/// expert precision its engine really uses, parameters with a unit, and
/// the expert cache as it is on disk now.
pub fn model_lines(app: &App) -> Vec<String> {
    let mut lines = vec![format!("model: {}", app.opts.model.display())];
    if let Some((_, s)) = app.selected_model() {
        lines.push(format!(
            "  {}: {} parameters, {} active per token ({} of {} experts per token)",
            s.model_type,
            fmt_count(s.total_params),
            fmt_count(s.active_params),
            s.top_k,
            s.num_experts
        ));
        lines.push(format!(
            "  experts as the {} engine runs them: {}",
            app.opts.backend.as_str(),
            s.experts_for(app.opts.backend)
        ));
        if app.opts.backend == Backend::Cuda {
            lines.push(format!("  expert cache: {}", s.cache.describe()));
        }
    }
    lines
}

pub fn render(app: &App, f: &mut Frame, area: Rect) {
    let mut lines = model_lines(app);
    let fields: Vec<String> = FIELDS
        .iter()
        .enumerate()
        .map(|(i, field)| {
            // The same rule as the options form: a setting the backend or
            // this machine cannot use is not shown as if it applied.
            let value = match app.field_unavailable(i) {
                Some(why) => format!("n/a: {why}"),
                None => field.show(&app.opts),
            };
            format!("  {:<28}{value}", field.label())
        })
        .collect();
    let at = lines.len();
    lines.extend(fields);
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
    // On a short terminal the estimate and the verdict matter more than the
    // list of options (which the Options tab shows): it gives way first.
    let inner = (
        area.width.saturating_sub(2) as usize,
        area.height.saturating_sub(2) as usize,
    );
    if rows(&lines, inner.0) > inner.1 {
        lines.splice(
            at..at + FIELDS.len(),
            [format!(
                "  ({} options: the Options tab lists them; a taller terminal shows them here)",
                FIELDS.len()
            )],
        );
    }
    f.render_widget(
        Paragraph::new(lines.join("\n"))
            .wrap(Wrap { trim: false })
            .block(Block::default().borders(Borders::ALL).title("Summary")),
        area,
    );
}

/// Rows `lines` take when wrapped at `width` columns.
fn rows(lines: &[String], width: usize) -> usize {
    let width = width.max(1);
    lines
        .iter()
        .map(|l| l.chars().count().div_ceil(width).max(1))
        .sum()
}
