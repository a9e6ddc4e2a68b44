//! Everything that can happen to the TUI, and what the app asks the loop to do.

use crate::supervisor::SupEvent;
use crossterm::event::{KeyEvent, MouseEvent};
use krasis_common::{EngineStats, LaunchOptions};

#[derive(Debug, Clone)]
pub enum Event {
    Key(KeyEvent),
    Mouse(MouseEvent),
    Resize(u16, u16),
    /// From the runtime process.
    Runtime(SupEvent),
    /// From polling `/v1/stats` once the server is ready.
    Stats(Result<EngineStats, String>),
    /// SIGTERM/SIGHUP arrived.
    StopSignal,
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
