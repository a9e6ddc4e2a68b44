//! The runtime's log pane. Long lines wrap (the default) or, with wrapping
//! off, scroll horizontally; nothing is cut off for good. Scrolled up, the
//! title says how far from the newest line the view is.

use crate::tui::app::RunState;
use ratatui::Frame;
use ratatui::layout::Rect;
use ratatui::widgets::{Block, Borders, Paragraph};

pub fn render(r: &RunState, f: &mut Frame, area: Rect) {
    let v = r.log_view;
    let width = area.width.saturating_sub(2) as usize;
    let height = area.height.saturating_sub(2) as usize;
    let rows: Vec<String> = if v.wrap {
        r.log.iter().flat_map(|l| wrap(l, width)).collect()
    } else {
        r.log
            .iter()
            .map(|l| l.chars().skip(v.right).take(width).collect())
            .collect()
    };
    let up = v.up.min(rows.len().saturating_sub(height));
    let end = rows.len() - up;
    let start = end.saturating_sub(height);
    let mut title = String::from("Log");
    if !v.wrap {
        title.push_str(&format!(" (wrap off, column {})", v.right + 1));
    }
    if up > 0 {
        title.push_str(&format!(" ({up} rows below; End follows)"));
    }
    f.render_widget(
        Paragraph::new(rows[start..end].join("\n"))
            .block(Block::default().borders(Borders::ALL).title(title)),
        area,
    );
}

/// `line` cut into rows of at most `width` characters; continuation rows
/// are indented by two so a wrapped line reads as one.
fn wrap(line: &str, width: usize) -> Vec<String> {
    let chars: Vec<char> = line.chars().collect();
    if width < 4 || chars.len() <= width {
        return vec![line.to_string()];
    }
    let mut rows = vec![chars[..width].iter().collect::<String>()];
    for chunk in chars[width..].chunks(width - 2) {
        rows.push(format!("  {}", chunk.iter().collect::<String>()));
    }
    rows
}
