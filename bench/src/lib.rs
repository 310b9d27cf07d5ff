//! What the bench shares with the integration tests (router/tests/it): the link emulator,
//! the device emulation and the one way to start a stack of real processes. The bench
//! itself is `main.rs`.

pub mod devices;
pub mod energy;
pub mod link;
mod services;
pub mod stack;
