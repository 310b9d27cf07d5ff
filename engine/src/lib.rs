//! EdgeSplit's llama.cpp engine, shared by the prefill and decode nodes.
//!
//! Architecture invariant: every llama.cpp call happens on the engine's owner thread
//! ([`Engine`] spawns it); async code talks to it through commands with reply channels
//! and never touches a llama.cpp handle.
//!
//! Modules: `types` (what goes in and out), `command` (what the handle sends the owner
//! thread), `handle` ([`Engine`]), `scheduler` (slots, waiting work, turns; tested without a
//! model), `worker` (the llama.cpp calls), `exit_guard` (no llama.cpp call once the process
//! exits), `config` (the engine's and both nodes' shared settings), `platform` (the build id
//! and the device: architecture, kernels).

mod cache;
mod command;
mod config;
mod exit_guard;
mod handle;
mod info;
pub mod layer_plan;
pub mod platform;
pub mod rpc;
pub mod sampling;
mod scheduler;
mod template;
mod types;
pub mod wire;
mod worker;

pub use command::CacheStats;
pub use config::{
    default_threads, EngineArgs, EngineConfig, FlashAttn, KvType, RemoteLayers, GGML_TYPE_F16,
};
pub use handle::{Engine, Live, LiveAnswer};
pub use info::{mem_available_bytes, mem_budget_bytes, MemoryPlan, ModelInfo};
pub use sampling::SamplingParams;
pub use scheduler::MAX_WAITING;
pub use template::ToolCallFormat;
pub use types::{
    Chat, ChatMessage, EngineError, Export, Exported, Finish, GenEvent, GenSummary, Input,
    PrefillOutput, Reuse, Snapshot, Start, TokenLogprobs, TokenOut, ToolCall, TopLogprob,
};
pub use worker::backend;
