//! The canonical INT4 routed-expert cache.

pub mod layout;

pub use layout::{ExpertLayout, GROUP_SIZE};
