//! Between async code and an engine's owner thread: the commands sent to it, the in-flight
//! counter each prefill or generation carries, and the gauges the thread publishes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use crate::sampling::SamplingParams;
use crate::types::{EngineError, Export, GenEvent, Input, PrefillOutput, Reuse, Snapshot, Start};

/// What async code asks of the owner thread.
pub(crate) enum Command {
    Tokenize {
        input: Input,
        reply: oneshot::Sender<Result<Vec<i32>, EngineError>>,
    },
    /// Needs a free sequence slot; runs to completion once it has one.
    Prefill {
        job: PrefillJob,
        reply: oneshot::Sender<Result<PrefillOutput, EngineError>>,
        in_flight: InFlight,
    },
    /// Needs a free sequence slot; runs to completion once it has one, sending each
    /// position's next-token log-probabilities (blocking while `out` is full).
    Score {
        tokens: Vec<i32>,
        /// Positions before this one are context, not scored: prefilled as a prompt, or,
        /// with `prefix`, imported from that state (`Export::Raw` of the same prefill,
        /// maybe on another machine).
        from: usize,
        prefix: Option<Vec<u8>>,
        out: mpsc::Sender<Result<Vec<f32>, EngineError>>,
        in_flight: InFlight,
    },
    /// Needs a free sequence slot, which it holds until the answer ends.
    Generate {
        job: GenerateJob,
        events: mpsc::UnboundedSender<GenEvent>,
        in_flight: InFlight,
    },
}

/// A prefill: the prompt, how its first token is sampled, and how its state is exported.
#[derive(Debug)]
pub(crate) struct PrefillJob {
    pub tokens: Vec<i32>,
    pub params: SamplingParams,
    pub max_tokens: u32,
    pub export: Export,
    pub reuse: Reuse,
}

/// A generation: where it starts, how it samples, and how many tokens it may emit.
#[derive(Debug)]
pub(crate) struct GenerateJob {
    pub start: Start,
    pub params: SamplingParams,
    /// Tokens to emit at most.
    pub max_tokens: u32,
    /// A live answer: snapshots asked for between steps.
    pub live: Option<mpsc::UnboundedReceiver<SnapshotAsk>>,
    /// A live answer from a prompt: the state after each prefill batch but the last
    /// (`answered` 0), sent while the prefill goes on; closed when the prefill ends.
    pub pieces: Option<mpsc::UnboundedSender<Snapshot>>,
}

/// A snapshot of a live answer, taken before its next step; with `stop` the answer ends
/// there ([`crate::Finish::Handover`]).
#[derive(Debug)]
pub(crate) struct SnapshotAsk {
    pub stop: bool,
    /// Answered only when the answer ends by itself (end of generation or its length),
    /// with its state then; the newest such ask replaces the one before.
    pub at_end: bool,
    /// The first position wanted (the receiver holds the ones before).
    pub from: usize,
    /// Also the SHA-256 of the state of the positions before `from`
    /// ([`Snapshot::head_digest`]).
    pub digest: bool,
    pub reply: oneshot::Sender<Result<Snapshot, EngineError>>,
}

/// Counts a prefill or generation from the moment it is queued until the owner thread is
/// done with it (or drops it unrun).
pub(crate) struct InFlight(Arc<AtomicU64>);

impl InFlight {
    pub(crate) fn new(count: &Arc<AtomicU64>) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        InFlight(count.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What the owner thread publishes about its slots.
#[derive(Default)]
pub(crate) struct Gauges {
    /// Tokens in the KV of the slots in use.
    pub(crate) kv_tokens: AtomicU64,
    /// Slots prefilling or writing an answer.
    pub(crate) active: AtomicU64,
    /// Tokens kept in the KV of the slots not in use (the prefix cache).
    pub(crate) cached_tokens: AtomicU64,
    /// Prompts that reused a cached prefix, and prompts that found none (counters).
    pub(crate) cache_hits: AtomicU64,
    pub(crate) cache_misses: AtomicU64,
    /// Prompt tokens whose cached KV was reused, all prompts together (counter).
    pub(crate) reused_tokens: AtomicU64,
}

/// The prefix cache's figures ([`crate::Engine::cache_stats`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CacheStats {
    /// Tokens kept in the KV of the slots not in use.
    pub cached_tokens: u64,
    /// Prompts that reused a cached prefix, and those that found none to reuse.
    pub hits: u64,
    pub misses: u64,
    /// Prompt tokens not prefilled because their cached KV was reused.
    pub reused_tokens: u64,
}
