//! Model screen: every model directory found, with its size facts.

use crate::tui::app::App;
use crate::units::{fmt_bytes, fmt_count};
use krasis_common::Backend;
use ratatui::Frame;
use ratatui::layout::{Constraint, Layout, Rect};
use ratatui::style::{Modifier, Style};
use ratatui::widgets::{Block, Borders, List, ListItem, ListState, Paragraph, Wrap};

pub fn render(app: &App, f: &mut Frame, area: Rect) {
    let [list_area, detail] =
        Layout::vertical([Constraint::Min(3), Constraint::Length(8)]).areas(area);
    if app.models.is_empty() {
        f.render_widget(
            Paragraph::new("No models found in ./models, the Hugging Face cache or the Krasis data directory.\nDownload one (e.g. huggingface-cli download Qwen/Qwen3-30B-A3B), add --model-root DIR, or quit and run `krasis demo`.")
                .wrap(Wrap { trim: true })
                .block(Block::default().borders(Borders::ALL).title("Models")),
            area,
        );
        return;
    }
    let items: Vec<ListItem> = app
        .models
        .iter()
        .map(|m| {
            let tail = match &m.summary {
                Ok(s) => format!("{}  {} params", s.model_type, fmt_count(s.total_params)),
                Err(_) => "unusable".into(),
            };
            ListItem::new(format!("{}  [{}]", m.name, tail))
        })
        .collect();
    let mut state = ListState::default().with_selected(Some(app.model_idx));
    f.render_stateful_widget(
        List::new(items)
            .block(Block::default().borders(Borders::ALL).title("Models"))
            .highlight_style(Style::default().add_modifier(Modifier::REVERSED))
            .highlight_symbol("> "),
        list_area,
        &mut state,
    );
    let text = match app.models.get(app.model_idx) {
        None => String::new(),
        Some(m) => match &m.summary {
            Ok(s) => format!(
                "{}\n{} parameters ({} active per token); {} layers ({} MoE), {} experts, top-{}, max context {}\nexperts: cuda {} {}, reference {} {}\nexpert cache: {}\nheatmap: {}",
                m.path.display(),
                fmt_count(s.total_params),
                fmt_count(s.active_params),
                s.num_layers,
                s.moe_layers,
                s.num_experts,
                s.top_k,
                s.max_position_embeddings,
                s.experts_for(Backend::Cuda),
                fmt_bytes(s.int4_expert_bytes),
                s.experts_for(Backend::Reference),
                fmt_bytes(s.source_expert_bytes),
                s.cache.describe(),
                s.heatmap.describe()
            ),
            Err(e) => format!("{}\ncannot be served: {e}", m.path.display()),
        },
    };
    f.render_widget(
        Paragraph::new(text)
            .wrap(Wrap { trim: true })
            .block(Block::default().borders(Borders::ALL).title("Details")),
        detail,
    );
}
