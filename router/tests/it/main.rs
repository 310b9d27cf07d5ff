//! The router's integration tests: the real router and nodes on loopback ports with the
//! real models. One test binary with a module per subject (one link instead of one per
//! file: the suite's build time on 2 cores was dominated by linking seventeen binaries).
//!
//! Tests of different modules run side by side (`cargo test`'s threads). A stack started
//! with `common::start` stops when its `Stack` is dropped; the shared ones
//! (`common::smollm2`, the secured and Gemma stacks) live as long as the binary.

mod common;

mod admission;
mod api;
mod auth;
mod auto;
mod backpressure;
mod cancel;
mod chat_template;
mod concurrency;
mod conversation;
mod cross_arch;
mod dashboard;
mod documented;
mod fallback;
mod fidelity;
mod gemma;
mod handoff;
mod hostile;
mod household;
mod interop_llama_server;
mod join;
mod layers;
mod live;
mod logprobs;
mod metrics;
mod openai_client;
mod private;
mod processes;
mod request_id;
mod structured;
mod tools;
mod v1_upload;
