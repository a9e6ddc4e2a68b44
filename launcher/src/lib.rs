//! The `krasis` launcher as a library, so the TUI, the validation and the
//! supervisor can be tested without a terminal, a GPU or a real runtime.
//!
//! Layout: `probe` finds hardware and models (behind the [`probe::Probe`]
//! trait so tests use fake data); `runtime` locates `krasis-runtime` and asks
//! it what it implements; `validate` is the one check every entry point (TUI,
//! CLI, profiles) goes through; `estimate` is the pre-flight memory estimate;
//! `profiles` stores launch options as TOML; `supervisor` runs and stops the
//! runtime process; `headless` and `tui` are the two front ends.

pub mod cli;
pub mod estimate;
pub mod headless;
pub mod paths;
pub mod probe;
pub mod profiles;
pub mod runtime;
pub mod signals;
pub mod supervisor;
pub mod tui;
pub mod units;
pub mod validate;
