//! Every key of every screen, defined once. The key handling looks commands
//! up in these tables, the footer prints their short hints and the `?`
//! overlay lists them in full, so a key cannot work without being shown, or
//! be shown without working.

use super::app::Screen;
use crossterm::event::{KeyCode, KeyEvent, KeyModifiers};

/// What a key asks for; [`super::app::App`] carries it out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmd {
    /// Switch to a tab (checked: a tab that cannot be reached says why).
    GoTo(Screen),
    Help,
    CloseHelp,
    Quit,
    /// Previous / next item of a list (models, fields).
    Prev,
    Next,
    /// Previous / next value of a choice field.
    ChoicePrev,
    ChoiceNext,
    /// Start typing into a field.
    Edit,
    /// The next step of the flow (model -> hardware -> options -> summary).
    Forward,
    /// The previous step.
    Back,
    Launch,
    SaveProfile,
    Stop,
    Restart,
    LogUp,
    LogDown,
    LogPageUp,
    LogPageDown,
    LogLeft,
    LogRight,
    /// Back to the newest log line and keep following.
    LogFollow,
    LogWrap,
    /// Text entry (shown only; typed characters are not commands).
    Accept,
    Cancel,
    Type,
}

pub struct Binding {
    pub keys: &'static [KeyCode],
    /// The keys as written in the help overlay.
    pub label: &'static str,
    /// What they do, in the help overlay.
    pub help: &'static str,
    /// The footer's short hint; `None` keeps the key out of the footer (the
    /// overlay still lists it).
    pub footer: Option<&'static str>,
    pub cmd: Cmd,
}

const fn b(
    keys: &'static [KeyCode],
    label: &'static str,
    help: &'static str,
    footer: Option<&'static str>,
    cmd: Cmd,
) -> Binding {
    Binding {
        keys,
        label,
        help,
        footer,
        cmd,
    }
}

use Cmd as C;
use KeyCode as K;

/// Keys that work on every screen (outside text entry and the overlay).
#[rustfmt::skip]
pub const GLOBAL: &[Binding] = &[
    b(&[K::Char('1')], "1", "Model tab", Some("1-5 tabs"), C::GoTo(Screen::Model)),
    b(&[K::Char('2')], "2", "Hardware tab", None, C::GoTo(Screen::Hardware)),
    b(&[K::Char('3')], "3", "Options tab (after a model is chosen)", None, C::GoTo(Screen::Options)),
    b(&[K::Char('4')], "4", "Summary tab (once the options are valid)", None, C::GoTo(Screen::Summary)),
    b(&[K::Char('5')], "5", "Run tab (after a launch)", None, C::GoTo(Screen::Run)),
    b(&[K::Char('?')], "?", "this help", Some("? help"), C::Help),
    b(&[K::Char('q')], "q / Ctrl-C", "quit (stops a running runtime first)", Some("q quit"), C::Quit),
];

#[rustfmt::skip]
pub const MODEL: &[Binding] = &[
    b(&[K::Up, K::Char('k')], "Up/k", "previous model", None, C::Prev),
    b(&[K::Down, K::Char('j')], "Down/j", "next model", Some("↑↓ select"), C::Next),
    b(&[K::Enter, K::Tab, K::Right], "Enter/Tab/Right", "use this model, then hardware", Some("Enter choose"), C::Forward),
];

#[rustfmt::skip]
pub const HARDWARE: &[Binding] = &[
    b(&[K::Enter, K::Tab, K::Right], "Enter/Tab/Right", "go on to the options", Some("Enter options"), C::Forward),
    b(&[K::Esc, K::BackTab, K::Left], "Esc/Shift-Tab/Left", "back to the models", Some("Esc back"), C::Back),
];

#[rustfmt::skip]
pub const OPTIONS: &[Binding] = &[
    b(&[K::Up, K::Char('k')], "Up/k", "previous field", None, C::Prev),
    b(&[K::Down, K::Char('j')], "Down/j", "next field", Some("↑↓ field"), C::Next),
    b(&[K::Left], "Left", "previous choice (fields marked <>)", None, C::ChoicePrev),
    b(&[K::Right, K::Char(' ')], "Right/Space", "next choice (fields marked <>)", Some("←→ choose"), C::ChoiceNext),
    b(&[K::Enter], "Enter", "type a value (other fields)", Some("Enter edit"), C::Edit),
    b(&[K::Tab], "Tab", "summary (once the options are valid)", Some("Tab summary"), C::Forward),
    b(&[K::Esc, K::BackTab], "Esc/Shift-Tab", "back to the hardware", Some("Esc back"), C::Back),
];

#[rustfmt::skip]
pub const SUMMARY: &[Binding] = &[
    b(&[K::Enter], "Enter", "launch the runtime with these options", Some("Enter launch"), C::Launch),
    b(&[K::Char('p')], "p", "save these options as a profile", Some("p save profile"), C::SaveProfile),
    b(&[K::Esc, K::BackTab, K::Left], "Esc/Shift-Tab/Left", "back to the options", Some("Esc back"), C::Back),
];

#[rustfmt::skip]
pub const RUN: &[Binding] = &[
    b(&[K::Char('s')], "s", "stop the runtime", Some("s stop"), C::Stop),
    b(&[K::Char('r')], "r", "restart the runtime (or start it again)", Some("r restart"), C::Restart),
    b(&[K::Esc, K::Char('b')], "Esc/b", "back to the summary (when stopped)", Some("b back"), C::Back),
    b(&[K::Up, K::Char('k')], "Up/k", "scroll the log up", None, C::LogUp),
    b(&[K::Down, K::Char('j')], "Down/j", "scroll the log down", Some("↑↓ PgUp/PgDn scroll"), C::LogDown),
    b(&[K::PageUp], "PgUp", "scroll the log up a page", None, C::LogPageUp),
    b(&[K::PageDown], "PgDn", "scroll the log down a page", None, C::LogPageDown),
    b(&[K::Left, K::Char('h')], "Left/h", "scroll the log left (wrap off)", None, C::LogLeft),
    b(&[K::Right, K::Char('l')], "Right/l", "scroll the log right (wrap off)", Some("←→ pan"), C::LogRight),
    b(&[K::End, K::Char('G')], "End/G", "follow the newest log line", Some("End follow"), C::LogFollow),
    b(&[K::Char('w')], "w", "wrap long log lines on/off", Some("w wrap"), C::LogWrap),
];

/// While typing into a field or a profile name.
#[rustfmt::skip]
pub const EDITING: &[Binding] = &[
    b(&[], "text", "type the value", Some("type"), C::Type),
    b(&[K::Enter], "Enter", "accept", Some("Enter accept"), C::Accept),
    b(&[K::Esc], "Esc", "cancel", Some("Esc cancel"), C::Cancel),
];

/// While the help overlay is open.
#[rustfmt::skip]
pub const HELP: &[Binding] = &[b(
    &[K::Esc, K::Char('?'), K::Char('q')],
    "Esc/?/q",
    "close this help",
    Some("Esc close help"),
    C::CloseHelp,
)];

pub fn screen(s: Screen) -> &'static [Binding] {
    match s {
        Screen::Model => MODEL,
        Screen::Hardware => HARDWARE,
        Screen::Options => OPTIONS,
        Screen::Summary => SUMMARY,
        Screen::Run => RUN,
    }
}

/// The command `k` means in `table`.
pub fn lookup(table: &[Binding], k: &KeyEvent) -> Option<Cmd> {
    // Shift is part of the character ('?', 'G') or of the key (BackTab);
    // other modifiers make a different key that nothing here is bound to.
    if k.modifiers
        .intersects(KeyModifiers::CONTROL | KeyModifiers::ALT | KeyModifiers::SUPER)
    {
        return None;
    }
    table
        .iter()
        .find(|b| b.keys.contains(&k.code))
        .map(|b| b.cmd)
}

/// The command `k` means on screen `s`: the screen's own keys first, then
/// the global ones.
pub fn command(s: Screen, k: &KeyEvent) -> Option<Cmd> {
    lookup(screen(s), k).or_else(|| lookup(GLOBAL, k))
}

/// The footer's hints for a set of tables, in order.
pub fn footer(tables: &[&[Binding]]) -> String {
    tables
        .iter()
        .flat_map(|t| t.iter())
        .filter_map(|b| b.footer)
        .collect::<Vec<_>>()
        .join("  ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One key, one meaning: no key is bound twice on a screen, including
    /// the global keys (a screen key would silently shadow a global one).
    #[test]
    fn no_key_is_bound_twice_on_a_screen() {
        for s in Screen::ALL {
            let mut seen: Vec<KeyCode> = Vec::new();
            for b in screen(s).iter().chain(GLOBAL) {
                for k in b.keys {
                    assert!(!seen.contains(k), "{k:?} bound twice on {s:?}");
                    seen.push(*k);
                }
            }
        }
    }

    #[test]
    fn every_screen_has_footer_hints_for_help_and_quit() {
        for s in Screen::ALL {
            let f = footer(&[screen(s), GLOBAL]);
            assert!(f.contains("? help") && f.contains("q quit"), "{f}");
        }
    }
}
