//! The engine's integration tests on the real models: one test binary with a module per
//! subject (each test binary links llama.cpp; one link instead of eight).
//!
//! Tests of different modules run side by side (`cargo test`'s threads), each with its own
//! engines.

mod common;

mod handoff_fidelity;
mod live;
mod parallel;
mod prefix_cache;
mod resume;
mod sliding_window;
mod sliding_window_engine;
mod tail;
mod warmup;
