//! Everything that can happen to the TUI, and what the app asks the loop to do.

use crate::supervisor::SupEvent;
use crossterm::event::{KeyEvent, MouseEvent};
use krasis_common::{EngineStats, LaunchOptions};

// `Stats` carries a whole `EngineStats` by value: a few events a second go
// through the loop's channel, so boxing it would only cost readability.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone)]
pub enum Event {
    Key(KeyEvent),
    Mouse(MouseEvent),
    Resize(u16, u16),
    /// From the runtime process.
    Runtime(SupEvent),
    /// From polling `/v1/stats` once the server is ready.
    Stats(Result<EngineStats, String>),
    /// SIGTERM, SIGHUP or SIGINT arrived.
    StopSignal,
    /// The terminal hung up or can no longer be read (its window, tmux
    /// session or ssh connection closed). Like [`Event::StopSignal`], but
    /// nothing may be drawn any more.
    TerminalLost,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    Launch(LaunchOptions),
    Stop,
    Restart(LaunchOptions),
    SaveProfile {
        name: String,
        options: LaunchOptions,
    },
    Quit,
}
