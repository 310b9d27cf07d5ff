//! What the bench shares with the integration tests (router/tests/it): the link emulator.
//! The bench itself is `main.rs`.

pub mod link;
