//! EdgeSplit's llama.cpp engine, shared by the prefill and decode nodes.
//!
//! Architecture invariant: every llama.cpp call happens on the engine's owner thread
//! ([`Engine`] spawns it); async code talks to it through [`Command`]s with reply
//! channels and never touches a llama.cpp handle.

mod info;
pub mod sampling;
pub mod wire;

use std::num::NonZeroU32;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use llama_cpp_2::context::params::{KvCacheType, LlamaContextParams};
use llama_cpp_2::context::session::LlamaStateSeqFlags;
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::{LlamaChatMessage, LlamaModel};
use llama_cpp_2::token::LlamaToken;
use tokio::sync::{mpsc, oneshot};

pub use info::{mem_available_bytes, MemoryPlan, ModelInfo, BUILD_ID};
pub use sampling::SamplingParams;

/// ggml type id of an f16 tensor (the KV cache type we run with).
pub const GGML_TYPE_F16: u32 = 1;

/// How to load the model and size its context.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub model_path: PathBuf,
    /// Context size in tokens (prompt + answer).
    pub n_ctx: u32,
    /// Prefill batch size.
    pub n_batch: u32,
    /// Threads for decoding and prefill. Default: physical cores.
    pub n_threads: i32,
    /// Flash attention. Never llama.cpp's own "auto" (which depends on the backend): both
    /// nodes must agree, since it decides whether V is stored transposed in the state.
    pub flash_attn: FlashAttn,
    /// Layers to offload to a GPU (only with the `cuda` feature).
    pub n_gpu_layers: u32,
    /// Sequences served at once: one llama.cpp context (one KV cache of `n_ctx` tokens)
    /// each. Running answers take turns, one decode step each, so a sequence computes
    /// exactly what it would alone (same context shape, same single-token batches) and
    /// answers stay identical to a one-at-a-time run. Not done: batching the sequences'
    /// steps into one `llama_decode`, which would raise a CPU node's throughput but changes
    /// the matrix shapes each token is computed with, so its logits would no longer be
    /// bit-identical to the single-device run's. Extra requests wait for a free slot.
    pub n_parallel: u32,
}

impl EngineConfig {
    /// Defaults for `model_path`: 4,096 tokens, batch 512, physical cores, flash attention
    /// [`FlashAttn::Auto`], one sequence at a time.
    #[must_use]
    pub fn new(model_path: impl Into<PathBuf>) -> Self {
        Self {
            model_path: model_path.into(),
            n_ctx: 4096,
            n_batch: 512,
            n_threads: default_threads(),
            flash_attn: FlashAttn::Auto,
            n_gpu_layers: if cfg!(feature = "cuda") { 999 } else { 0 },
            n_parallel: 1,
        }
    }
}

/// Flash-attention policy.
///
/// With flash attention on, a sliding-window model (Gemma-3) continued after a handoff is
/// not bit-identical to the single-process run once the prompt outgrows the window: the
/// receiver holds the window's cells at other cache indices than the sender's ring buffer,
/// and the flash kernel's blockwise softmax then rounds differently (measured: tokens
/// diverged after 4 of 20). Full-attention models keep identical answers with it, and it
/// made prefill ~20% and decode ~18% faster here. So `Auto` turns it on exactly when the
/// GGUF declares no sliding window; both nodes read the same file, so they agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlashAttn {
    Auto,
    On,
    Off,
}

impl std::str::FromStr for FlashAttn {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(FlashAttn::Auto),
            "on" | "true" => Ok(FlashAttn::On),
            "off" | "false" => Ok(FlashAttn::Off),
            other => Err(format!(
                "flash attention must be auto, on or off, not {other:?}"
            )),
        }
    }
}

/// Physical cores: more threads than that made decoding ~4x slower on a 2-core machine
/// (oversubscribed OpenMP spin-waits).
#[must_use]
pub fn default_threads() -> i32 {
    i32::try_from(num_cpus::get_physical().max(1)).unwrap_or(1)
}

/// What went wrong in the engine. `PartialEq` so tests compare errors directly.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    #[error("failed to load model {path}: {reason}")]
    Load { path: String, reason: String },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("this model has no chat template; send a raw prompt to /v1/completions")]
    NoChatTemplate,
    #[error("chat template failed: {0}")]
    Template(String),
    #[error("this model's maximum context length is {n_ctx} tokens; the request needs {needed} ({prompt} prompt + {max_tokens} completion)")]
    ContextOverflow {
        n_ctx: u32,
        needed: u64,
        prompt: u32,
        max_tokens: u32,
    },
    #[error("llama.cpp decode failed: {0}")]
    Decode(String),
    #[error("state export failed: {0}")]
    Export(String),
    #[error("state import failed: {0}")]
    Import(String),
    #[error("the engine thread has stopped")]
    Closed,
    #[error("{waiting} requests are already waiting for a free sequence; try again later")]
    Busy { waiting: usize },
}

/// Most prefills and generations waiting for a free slot; beyond it a request is refused
/// at once with [`EngineError::Busy`] (the router's own queue normally keeps it far lower).
pub const MAX_WAITING: usize = 256;

/// The input of a request.
#[derive(Debug, Clone)]
pub enum Input {
    /// OpenAI chat messages (role, content), rendered with the model's own template.
    Chat(Vec<(String, String)>),
    /// A raw prompt, tokenized as is (with BOS if the model wants one).
    Raw(String),
}

/// A token and its text bytes (may be part of a UTF-8 character).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenOut {
    pub id: i32,
    pub piece: Vec<u8>,
    /// End-of-generation token (not part of the answer's text).
    pub eog: bool,
}

/// Result of a prefill.
#[derive(Debug)]
pub struct PrefillOutput {
    pub prompt_tokens: Vec<i32>,
    pub first: TokenOut,
    pub prefill_ms: f64,
    /// The exported state, when an export was asked for and the answer continues.
    pub state: Option<Exported>,
    pub export_ms: f64,
}

/// How a prefill exports its state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Export {
    None,
    /// Raw sequence state bytes (V2).
    Raw,
    /// llama.cpp's sequence-state file at this path (V1).
    File(PathBuf),
}

/// An exported state.
#[derive(Debug)]
pub enum Exported {
    Raw(Vec<u8>),
    /// The file written, and its size.
    File {
        path: PathBuf,
        bytes: u64,
    },
}

/// Why a generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Finish {
    /// End-of-generation token.
    Stop,
    /// Token budget spent.
    #[default]
    Length,
    /// The consumer went away.
    Cancelled,
}

/// Streamed out of a generation.
#[derive(Debug, Clone, PartialEq)]
pub enum GenEvent {
    /// Colocated runs: the prompt was prefilled (sent before the first token).
    Prefilled {
        prompt_tokens: u32,
        prefill_ms: f64,
    },
    Token(TokenOut),
    Done(GenSummary),
    Error(EngineError),
}

/// Totals of one generation.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct GenSummary {
    pub finish: Finish,
    /// Tokens produced by decode steps (the EOG token included if there was one). The
    /// first answer token comes from the prefill's logits and is not counted here, so
    /// `generated / decode_ms` is the decode speed on either path.
    pub generated: u32,
    pub prompt_tokens: u32,
    pub prefill_ms: f64,
    pub import_ms: f64,
    pub decode_ms: f64,
}

/// Where a generation starts from.
#[derive(Debug)]
pub enum Start {
    /// Prefill these tokens here, then continue (the colocated run).
    Prompt(Vec<i32>),
    /// Load a verified sequence-state file (V1), delete it, then continue from `first`.
    ImportedFile { path: PathBuf, first: i32 },
    /// Import a verified state covering `tokens`, then continue from `first`.
    Imported {
        state: Vec<u8>,
        tokens: Vec<i32>,
        first: i32,
    },
    /// Take over an answer another node was writing (it failed): rebuild the KV of
    /// `prompt` + `answer` the way the uninterrupted run built it - the prompt in batches,
    /// then each answer token one at a time - and continue after the last answer token
    /// with the next step's sampler, so the text goes on exactly as it would have.
    Resume { prompt: Vec<i32>, answer: Vec<i32> },
}

/// What async code asks of the owner thread.
enum Command {
    Tokenize {
        input: Input,
        reply: oneshot::Sender<Result<Vec<i32>, EngineError>>,
    },
    /// Needs a free sequence slot; runs to completion once it has one.
    Prefill {
        tokens: Vec<i32>,
        params: SamplingParams,
        max_tokens: u32,
        export: Export,
        reply: oneshot::Sender<Result<PrefillOutput, EngineError>>,
        in_flight: InFlight,
    },
    /// Needs a free sequence slot, which it holds until the answer ends.
    Generate {
        start: Start,
        params: SamplingParams,
        /// Tokens to emit at most.
        max_tokens: u32,
        events: mpsc::UnboundedSender<GenEvent>,
        in_flight: InFlight,
    },
}

/// Counts a prefill or generation from the moment it is queued until the owner thread is
/// done with it (or drops it unrun).
struct InFlight(Arc<AtomicU64>);

impl InFlight {
    fn new(count: &Arc<AtomicU64>) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        InFlight(count.clone())
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Handle to an engine's owner thread. Cheap to clone.
#[derive(Clone)]
pub struct Engine {
    tx: mpsc::Sender<Command>,
    info: Arc<ModelInfo>,
    /// Owner-thread gauges: tokens held in KV, slots in use.
    gauges: Arc<Gauges>,
    in_flight: Arc<AtomicU64>,
}

/// What the owner thread publishes about its slots.
#[derive(Default)]
struct Gauges {
    /// Tokens in all slots' KV.
    kv_tokens: AtomicU64,
    /// Slots prefilling or writing an answer.
    active: AtomicU64,
}

fn backend() -> &'static LlamaBackend {
    static BACKEND: OnceLock<LlamaBackend> = OnceLock::new();
    BACKEND.get_or_init(|| {
        llama_cpp_2::send_logs_to_tracing(llama_cpp_2::LogOptions::default());
        LlamaBackend::init().expect("llama.cpp backend initialises once per process")
    })
}

/// Set when the process exits: owner threads make no more llama.cpp calls.
static STOPPING: AtomicBool = AtomicBool::new(false);
/// Owner threads inside llama.cpp calls now.
static BUSY: AtomicUsize = AtomicUsize::new(0);

/// Registers [`quiesce_at_exit`] once, after an engine's first round of work: exit
/// handlers run in reverse order of registration, and ggml creates some of its static
/// objects lazily (function-local statics, registered for destruction at first use, e.g.
/// the CPU backend's extra buffer types during the first compute). Registered at start,
/// the handler would run after their destructors and be useless.
fn register_exit_guard() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    // SAFETY: registers a plain `extern "C" fn` with no captured state.
    ONCE.call_once(|| unsafe {
        libc::atexit(quiesce_at_exit);
    });
}

/// At process exit, before ggml's static objects are destroyed (see
/// [`register_exit_guard`]), stop the owner threads at their next step and wait for the
/// ones mid-step. Without it, an engine still decoding when `main` returns (a drain
/// deadline passed, a test ended) read ggml's destroyed globals: measured as a SIGSEGV in
/// `ggml_cpu_extra_compute_forward` in about one exit in ten.
extern "C" fn quiesce_at_exit() {
    STOPPING.store(true, Ordering::SeqCst);
    let t0 = Instant::now();
    while BUSY.load(Ordering::SeqCst) > 0 && t0.elapsed() < std::time::Duration::from_secs(5) {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// Proof that this owner thread may call llama.cpp until it is dropped.
struct Busy;

impl Busy {
    /// `None` once the process is exiting: the caller must not touch llama.cpp again.
    fn enter() -> Option<Busy> {
        // Dekker-style with `quiesce_at_exit`: count first, then look at the flag (both
        // SeqCst), so the handler either sees us counted or we see the flag.
        BUSY.fetch_add(1, Ordering::SeqCst);
        if STOPPING.load(Ordering::SeqCst) {
            BUSY.fetch_sub(1, Ordering::SeqCst);
            return None;
        }
        Some(Busy)
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        BUSY.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Parks an owner thread for the rest of the process (it is exiting), keeping its
/// llama.cpp objects alive and untouched.
fn park_forever() -> ! {
    loop {
        std::thread::park();
    }
}

impl Engine {
    /// Loads the model and creates its contexts on a new owner thread, and waits until it
    /// is ready.
    ///
    /// # Errors
    /// [`EngineError::Load`] if the file is missing, llama.cpp refuses it, or a context
    /// cannot be allocated.
    pub async fn start(config: EngineConfig) -> Result<Engine, EngineError> {
        let (tx, rx) = mpsc::channel(64);
        let (ready_tx, ready_rx) = oneshot::channel();
        let gauges = Arc::new(Gauges::default());
        let g = gauges.clone();
        std::thread::Builder::new()
            .name("llama-engine".into())
            .spawn(move || owner_thread(config, rx, ready_tx, g))
            .map_err(|e| EngineError::Load {
                path: String::new(),
                reason: e.to_string(),
            })?;
        let info = ready_rx.await.map_err(|_| EngineError::Closed)??;
        Ok(Engine {
            tx,
            info: Arc::new(info),
            gauges,
            in_flight: Arc::new(AtomicU64::new(0)),
        })
    }

    /// Prefills and generations queued or running now.
    #[must_use]
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Tokens whose KV the contexts hold now, all sequences together (0 when idle).
    #[must_use]
    pub fn kv_tokens(&self) -> u64 {
        self.gauges.kv_tokens.load(Ordering::Relaxed)
    }

    /// Slots in use now: prefilling, or writing an answer (at most `info().parallel`).
    #[must_use]
    pub fn active(&self) -> u64 {
        self.gauges.active.load(Ordering::Relaxed)
    }

    /// Facts about the loaded model and context.
    #[must_use]
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// Renders (chat) and tokenizes the input.
    ///
    /// # Errors
    /// No chat template, template failure, empty prompt.
    pub async fn tokenize(&self, input: Input) -> Result<Vec<i32>, EngineError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Tokenize { input, reply }).await?;
        rx.await.map_err(|_| EngineError::Closed)?
    }

    /// Prefills `tokens`, samples the first token, and exports the state if asked and the
    /// answer continues past the first token. Waits for a free sequence slot.
    ///
    /// # Errors
    /// Context overflow, llama.cpp decode or export failure.
    pub async fn prefill(
        &self,
        tokens: Vec<i32>,
        params: SamplingParams,
        max_tokens: u32,
        export: Export,
    ) -> Result<PrefillOutput, EngineError> {
        let (reply, rx) = oneshot::channel();
        self.send(Command::Prefill {
            tokens,
            params,
            max_tokens,
            export,
            reply,
            in_flight: InFlight::new(&self.in_flight),
        })
        .await?;
        rx.await.map_err(|_| EngineError::Closed)?
    }

    /// Starts a generation; events arrive on the returned channel (unbounded, so a slow
    /// reader never holds up the other sequences; at most `max_tokens` + 2 events). It
    /// waits for a free sequence slot. Dropping the receiver cancels the generation and
    /// frees its slot.
    ///
    /// # Errors
    /// [`EngineError::Closed`] if the owner thread is gone.
    pub async fn generate(
        &self,
        start: Start,
        params: SamplingParams,
        max_tokens: u32,
    ) -> Result<mpsc::UnboundedReceiver<GenEvent>, EngineError> {
        let (events, rx) = mpsc::unbounded_channel();
        self.send(Command::Generate {
            start,
            params,
            max_tokens,
            events,
            in_flight: InFlight::new(&self.in_flight),
        })
        .await?;
        Ok(rx)
    }

    async fn send(&self, cmd: Command) -> Result<(), EngineError> {
        self.tx.send(cmd).await.map_err(|_| EngineError::Closed)
    }
}

fn owner_thread(
    config: EngineConfig,
    rx: mpsc::Receiver<Command>,
    ready: oneshot::Sender<Result<ModelInfo, EngineError>>,
    gauges: Arc<Gauges>,
) {
    let load_err = |reason: String| EngineError::Load {
        path: config.model_path.display().to_string(),
        reason,
    };
    if !config.model_path.is_file() {
        let _ = ready.send(Err(load_err("no such file".into())));
        return;
    }
    let fingerprint = match info::fingerprint(&config.model_path) {
        Ok(f) => f,
        Err(e) => {
            let _ = ready.send(Err(load_err(e.to_string())));
            return;
        }
    };
    let backend = backend();
    let mparams = LlamaModelParams::default().with_n_gpu_layers(config.n_gpu_layers);
    let model = match LlamaModel::load_from_file(backend, &config.model_path, &mparams) {
        Ok(m) => m,
        Err(e) => {
            let _ = ready.send(Err(load_err(e.to_string())));
            return;
        }
    };
    let flash_on = match config.flash_attn {
        FlashAttn::On => true,
        FlashAttn::Off => false,
        FlashAttn::Auto => !info::has_sliding_window(&model),
    };
    let flash = if flash_on {
        llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_ENABLED
    } else {
        llama_cpp_sys_2::LLAMA_FLASH_ATTN_TYPE_DISABLED
    };
    // One context per slot, each with one sequence: a sequence computes exactly what it
    // computes alone (see `EngineConfig::n_parallel`).
    let cparams = LlamaContextParams::default()
        .with_n_ctx(NonZeroU32::new(config.n_ctx))
        .with_n_batch(config.n_batch)
        .with_n_ubatch(config.n_batch)
        .with_n_seq_max(1)
        .with_n_threads(config.n_threads)
        .with_n_threads_batch(config.n_threads)
        .with_type_k(KvCacheType::F16)
        .with_type_v(KvCacheType::F16)
        .with_flash_attention_policy(flash);
    let mut slots = Vec::new();
    for _ in 0..config.n_parallel.max(1) {
        match model.new_context(backend, cparams.clone()) {
            Ok(ctx) => slots.push(Slot { ctx, kv: 0 }),
            Err(e) => {
                let _ = ready.send(Err(load_err(format!(
                    "context {} of {}: {e}",
                    slots.len() + 1,
                    config.n_parallel
                ))));
                return;
            }
        }
    }
    let n_ctx = slots[0].ctx.n_ctx();
    let info = ModelInfo::read(&model, &config, fingerprint, n_ctx, flash_on);
    tracing::info!(
        model = %info.model_id,
        fingerprint = %info.fingerprint_hex(),
        n_ctx = info.n_ctx,
        parallel = slots.len(),
        threads = config.n_threads,
        kv_bytes_per_token = info.kv_bytes_per_token,
        "model loaded"
    );
    let n_batch = config.n_batch as usize;
    let worker = Worker {
        model: &model,
        slots,
        batch: LlamaBatch::new(n_batch, 1),
        n_batch,
        n_ctx,
        n_vocab: model.n_vocab(),
        gauges,
    };
    if ready.send(Ok(info)).is_err() {
        return;
    }
    Scheduler::new(worker, rx).run();
    let Some(_busy) = Busy::enter() else {
        park_forever()
    };
    drop(model);
}

/// One context and what its sequence holds.
struct Slot<'m> {
    ctx: LlamaContext<'m>,
    /// Tokens in the sequence's KV.
    kv: usize,
}

/// Where an answer stands after its start, before its first decode step.
struct Begun {
    /// Every token whose KV is in the slot.
    history: Vec<i32>,
    /// The token the first step decodes.
    last: i32,
    /// The first step's index.
    step: u32,
    /// Tokens left to emit.
    budget: u32,
}

/// An answer being written in a slot.
struct Running {
    slot: usize,
    params: SamplingParams,
    /// Every token whose KV is in the slot (prompt and answer so far).
    history: Vec<i32>,
    /// The newest answer token, decoded by the next step.
    last: i32,
    /// Index of the next sampling step (the RNG seed depends on it).
    step: u32,
    /// Tokens this node may still emit.
    budget: u32,
    events: mpsc::UnboundedSender<GenEvent>,
    summary: GenSummary,
    decoding_since: Instant,
    /// Dropped before the final event is sent, so a reader that saw it sees the count
    /// without this answer.
    in_flight: InFlight,
}

/// The owner thread's loop: commands in, one decode step per running answer per round.
///
/// Answers in different slots take turns, one token each, so a long answer does not hold
/// up a short one; on a CPU node the turns share the cores rather than adding throughput
/// (see `EngineConfig::n_parallel`). Prefills and answer starts run whole between rounds.
struct Scheduler<'m> {
    worker: Worker<'m>,
    rx: mpsc::Receiver<Command>,
    /// Prefills and generations waiting for a free slot, oldest first.
    waiting: std::collections::VecDeque<Command>,
    running: Vec<Running>,
    /// Every `Engine` handle is gone: finish what was accepted, then stop.
    closed: bool,
}

impl<'m> Scheduler<'m> {
    fn new(worker: Worker<'m>, rx: mpsc::Receiver<Command>) -> Self {
        Scheduler {
            worker,
            rx,
            waiting: std::collections::VecDeque::new(),
            running: Vec::new(),
            closed: false,
        }
    }

    fn run(mut self) {
        loop {
            let mut next = None;
            if self.running.is_empty() && self.waiting.is_empty() {
                if !self.closed {
                    next = self.rx.blocking_recv();
                }
                if next.is_none() {
                    // Every handle is gone and nothing is left: free the contexts.
                    let Some(_busy) = Busy::enter() else {
                        park_forever()
                    };
                    drop(self);
                    return;
                }
            }
            let Some(_busy) = Busy::enter() else {
                park_forever()
            };
            if let Some(cmd) = next {
                self.accept(cmd);
            }
            loop {
                match self.rx.try_recv() {
                    Ok(cmd) => self.accept(cmd),
                    Err(mpsc::error::TryRecvError::Empty) => break,
                    Err(mpsc::error::TryRecvError::Disconnected) => {
                        self.closed = true;
                        break;
                    }
                }
            }
            self.start_waiting();
            self.step_all();
            register_exit_guard();
        }
    }

    fn publish_active(&self, extra: usize) {
        let n = (self.running.len() + extra) as u64;
        self.worker.gauges.active.store(n, Ordering::Relaxed);
    }

    fn accept(&mut self, cmd: Command) {
        match cmd {
            Command::Tokenize { input, reply } => {
                let _ = reply.send(self.worker.tokenize(input));
            }
            other if self.waiting.len() >= MAX_WAITING => {
                let busy = EngineError::Busy {
                    waiting: self.waiting.len(),
                };
                match other {
                    Command::Prefill { reply, .. } => {
                        let _ = reply.send(Err(busy));
                    }
                    Command::Generate { events, start, .. } => {
                        if let Start::ImportedFile { path, .. } = start {
                            let _ = std::fs::remove_file(path);
                        }
                        let _ = events.send(GenEvent::Error(busy));
                    }
                    Command::Tokenize { .. } => {}
                }
            }
            other => self.waiting.push_back(other),
        }
    }

    fn free_slot(&self) -> Option<usize> {
        (0..self.worker.slots.len()).find(|s| self.running.iter().all(|r| r.slot != *s))
    }

    fn start_waiting(&mut self) {
        while let Some(slot) = self.free_slot() {
            let Some(cmd) = self.waiting.pop_front() else {
                return;
            };
            match cmd {
                Command::Prefill {
                    tokens,
                    params,
                    max_tokens,
                    export,
                    reply,
                    in_flight,
                } => {
                    let out = if reply.is_closed() {
                        Err(EngineError::Closed)
                    } else {
                        self.publish_active(1);
                        let out = self
                            .worker
                            .prefill_cmd(slot, &tokens, &params, max_tokens, &export);
                        self.publish_active(0);
                        out
                    };
                    drop(in_flight);
                    let _ = reply.send(out);
                }
                Command::Generate {
                    start,
                    params,
                    max_tokens,
                    events,
                    in_flight,
                } => {
                    if events.is_closed() {
                        // Its reader left while it waited: drop it unrun.
                        if let Start::ImportedFile { path, .. } = start {
                            let _ = std::fs::remove_file(path);
                        }
                        continue;
                    }
                    let mut summary = GenSummary::default();
                    self.publish_active(1);
                    let begun =
                        self.worker
                            .begin(slot, start, &params, max_tokens, &events, &mut summary);
                    match begun {
                        Ok(Some(b)) => self.running.push(Running {
                            slot,
                            params,
                            history: b.history,
                            last: b.last,
                            step: b.step,
                            budget: b.budget,
                            events,
                            summary,
                            decoding_since: Instant::now(),
                            in_flight,
                        }),
                        Ok(None) => {
                            self.worker.clear(slot);
                            drop(in_flight);
                            let _ = events.send(GenEvent::Done(summary));
                        }
                        Err(e) => {
                            self.worker.clear(slot);
                            drop(in_flight);
                            let _ = events.send(GenEvent::Error(e));
                        }
                    }
                    self.publish_active(0);
                }
                Command::Tokenize { .. } => unreachable!("tokenize never waits for a slot"),
            }
        }
    }

    fn step_all(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            match self.worker.step(&mut self.running[i]) {
                Ok(false) => i += 1,
                done => {
                    let Running {
                        slot,
                        events,
                        mut summary,
                        decoding_since,
                        in_flight,
                        ..
                    } = self.running.swap_remove(i);
                    self.worker.clear(slot);
                    self.publish_active(0);
                    summary.decode_ms = ms(decoding_since);
                    drop(in_flight);
                    let _ = events.send(match done {
                        Err(e) => GenEvent::Error(e),
                        Ok(_) => GenEvent::Done(summary),
                    });
                }
            }
        }
    }
}

struct Worker<'m> {
    model: &'m LlamaModel,
    slots: Vec<Slot<'m>>,
    /// Shared by the slots: only one decodes at a time.
    batch: LlamaBatch<'static>,
    n_batch: usize,
    n_ctx: u32,
    n_vocab: i32,
    gauges: Arc<Gauges>,
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1000.0
}

impl Worker<'_> {
    fn tokenize(&self, input: Input) -> Result<Vec<i32>, EngineError> {
        let text = match input {
            Input::Raw(p) => {
                if p.is_empty() {
                    return Err(EngineError::EmptyPrompt);
                }
                return self.tokenize_text(&p);
            }
            Input::Chat(messages) => {
                let tmpl = self
                    .model
                    .chat_template(None)
                    .map_err(|_| EngineError::NoChatTemplate)?;
                let msgs = messages
                    .into_iter()
                    .map(|(r, c)| LlamaChatMessage::new(r, c))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| EngineError::Template(e.to_string()))?;
                self.model
                    .apply_chat_template(&tmpl, &msgs, true)
                    .map_err(|e| EngineError::Template(e.to_string()))?
            }
        };
        self.tokenize_text(&text)
    }

    /// As llama-server does: special tokens added where the model wants them (BOS) and
    /// special-token text parsed (the chat template writes `<|im_start|>` as text).
    fn tokenize_text(&self, text: &str) -> Result<Vec<i32>, EngineError> {
        let toks = self.model.vocab().tokenize(text.as_bytes(), true, true);
        if toks.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        Ok(toks.into_iter().map(|t| t.0).collect())
    }

    fn check_fits(&self, prompt: usize, max_tokens: u32) -> Result<(), EngineError> {
        let n_ctx = self.n_ctx;
        let needed = prompt as u64 + u64::from(max_tokens);
        if prompt == 0 {
            return Err(EngineError::EmptyPrompt);
        }
        if needed > u64::from(n_ctx) {
            return Err(EngineError::ContextOverflow {
                n_ctx,
                needed,
                prompt: u32::try_from(prompt).unwrap_or(u32::MAX),
                max_tokens,
            });
        }
        Ok(())
    }

    fn token_out(&self, id: LlamaToken) -> TokenOut {
        let eog = self.model.vocab().is_eog(id);
        let piece = if eog {
            Vec::new()
        } else {
            self.model.vocab().token_to_piece(id, false, None)
        };
        TokenOut {
            id: id.0,
            piece,
            eog,
        }
    }

    /// Clears the slot, prefills `tokens` and samples the first answer token (step 0).
    fn prefill(
        &mut self,
        slot: usize,
        tokens: &[i32],
        params: &SamplingParams,
    ) -> Result<TokenOut, EngineError> {
        self.clear(slot);
        let last_chunk = (tokens.len() - 1) / self.n_batch;
        let ctx = &mut self.slots[slot].ctx;
        for (c, chunk) in tokens.chunks(self.n_batch).enumerate() {
            self.batch.clear();
            for (i, t) in chunk.iter().enumerate() {
                let pos = (c * self.n_batch + i) as i32;
                let logits = c == last_chunk && i == chunk.len() - 1;
                self.batch
                    .add(LlamaToken(*t), pos, &[0], logits)
                    .map_err(|e| EngineError::Decode(e.to_string()))?;
            }
            ctx.decode(&mut self.batch)
                .map_err(|e| EngineError::Decode(e.to_string()))?;
        }
        let idx = self.batch.n_tokens() - 1;
        let id = sampling::sample(ctx, idx, self.n_vocab, params, tokens, 0);
        self.set_kv(slot, tokens.len());
        Ok(self.token_out(id))
    }

    /// Appends `token` to the slot's sequence at the next position: one single-token
    /// decode, as every generated token is decoded.
    fn decode_one(
        &mut self,
        slot: usize,
        token: i32,
        history: &mut Vec<i32>,
    ) -> Result<(), EngineError> {
        let pos = history.len() as i32;
        history.push(token);
        self.batch.clear();
        self.batch
            .add(LlamaToken(token), pos, &[0], true)
            .map_err(|e| EngineError::Decode(e.to_string()))?;
        self.slots[slot]
            .ctx
            .decode(&mut self.batch)
            .map_err(|e| EngineError::Decode(e.to_string()))?;
        self.set_kv(slot, history.len());
        Ok(())
    }

    fn clear(&mut self, slot: usize) {
        // Seq id 0 always fits in an i32; this cannot fail.
        let _ = self.slots[slot].ctx.clear_kv_cache_seq(Some(0), None, None);
        self.set_kv(slot, 0);
    }

    fn set_kv(&mut self, slot: usize, n: usize) {
        self.slots[slot].kv = n;
        let total: usize = self.slots.iter().map(|s| s.kv).sum();
        self.gauges.kv_tokens.store(total as u64, Ordering::Relaxed);
    }

    fn prefill_cmd(
        &mut self,
        slot: usize,
        tokens: &[i32],
        params: &SamplingParams,
        max_tokens: u32,
        export: &Export,
    ) -> Result<PrefillOutput, EngineError> {
        self.check_fits(tokens.len(), max_tokens)?;
        let out = self.prefill_export(slot, tokens, params, max_tokens, export);
        self.clear(slot);
        let (first, state, prefill_ms, export_ms) = out?;
        Ok(PrefillOutput {
            prompt_tokens: tokens.to_vec(),
            first,
            prefill_ms,
            state,
            export_ms,
        })
    }

    fn prefill_export(
        &mut self,
        slot: usize,
        tokens: &[i32],
        params: &SamplingParams,
        max_tokens: u32,
        export: &Export,
    ) -> Result<(TokenOut, Option<Exported>, f64, f64), EngineError> {
        let t0 = Instant::now();
        let first = self.prefill(slot, tokens, params)?;
        let prefill_ms = ms(t0);
        let t1 = Instant::now();
        let continues = !first.eog && max_tokens > 1;
        let state = match export {
            _ if !continues => None,
            Export::None => None,
            Export::Raw => Some(Exported::Raw(self.export(slot)?)),
            Export::File(path) => Some(self.export_file(slot, path, tokens)?),
        };
        Ok((first, state, prefill_ms, ms(t1)))
    }

    fn export(&self, slot: usize) -> Result<Vec<u8>, EngineError> {
        let ctx = &self.slots[slot].ctx;
        let flags = LlamaStateSeqFlags::empty();
        let size = ctx.state_seq_get_size_ext(0, flags);
        if size == 0 {
            return Err(EngineError::Export(
                "llama.cpp reported an empty state".into(),
            ));
        }
        let mut buf = vec![0u8; size];
        // SAFETY: `buf` holds exactly the size llama.cpp reported for this sequence, and the
        // context is not modified between the size query and the copy (same thread).
        let n = unsafe { ctx.state_seq_get_data_ext(buf.as_mut_ptr(), 0, flags) };
        if n != size {
            return Err(EngineError::Export(format!(
                "llama.cpp wrote {n} bytes, expected {size}"
            )));
        }
        Ok(buf)
    }

    fn export_file(
        &self,
        slot: usize,
        path: &std::path::Path,
        tokens: &[i32],
    ) -> Result<Exported, EngineError> {
        let toks: Vec<LlamaToken> = tokens.iter().map(|t| LlamaToken(*t)).collect();
        let bytes = self.slots[slot]
            .ctx
            .state_seq_save_file(path, 0, &toks)
            .map_err(|e| EngineError::Export(e.to_string()))?;
        Ok(Exported::File {
            path: path.to_path_buf(),
            bytes: bytes as u64,
        })
    }

    /// Loads a sequence-state file into the slot; returns the tokens it covers. The file
    /// is deleted whatever happens.
    fn import_file(
        &mut self,
        slot: usize,
        path: &std::path::Path,
    ) -> Result<Vec<i32>, EngineError> {
        self.clear(slot);
        let n_ctx = self.n_ctx as usize;
        let res = self.slots[slot].ctx.state_seq_load_file(path, 0, n_ctx);
        let _ = std::fs::remove_file(path);
        match res {
            Ok((toks, _)) => {
                self.set_kv(slot, toks.len());
                Ok(toks.into_iter().map(|t| t.0).collect())
            }
            Err(e) => Err(EngineError::Import(format!(
                "llama.cpp refused the state file: {e}"
            ))),
        }
    }

    fn import(&mut self, slot: usize, state: &[u8]) -> Result<(), EngineError> {
        self.clear(slot);
        let ctx = &mut self.slots[slot].ctx;
        // SAFETY: the bytes were produced by `state_seq_get_data_ext` of the same llama.cpp
        // build and model (the V2 handshake compared build id and model fingerprint), their
        // SHA-256 passed and their tensor layout was re-derived and compared before we got
        // here. llama.cpp's reader is bounds-checked against `state.len()` and rejects
        // shape mismatches.
        let ok = unsafe { ctx.state_seq_set_data_ext(state, 0, LlamaStateSeqFlags::empty()) };
        if !ok {
            return Err(EngineError::Import(
                "llama.cpp refused the state (shape or type mismatch)".into(),
            ));
        }
        let held = ctx.kv_cache_seq_pos_max(0) + 1;
        self.set_kv(slot, usize::try_from(held).unwrap_or(0));
        Ok(())
    }

    /// Sets an answer up in `slot`: prefill, import or rebuild, and emit what comes before
    /// the first decode step. `None` when the answer already ended
    /// (end-of-generation first token, or the reader left). The caller clears the slot
    /// when this fails or ends.
    fn begin(
        &mut self,
        slot: usize,
        start: Start,
        params: &SamplingParams,
        max_tokens: u32,
        events: &mpsc::UnboundedSender<GenEvent>,
        summary: &mut GenSummary,
    ) -> Result<Option<Begun>, EngineError> {
        // Step 0 sampled the first token (on whichever node prefilled); a resumed answer
        // continues at the step after its last token.
        let mut step = 1u32;
        let (history, first, budget) = match start {
            Start::Prompt(tokens) => {
                self.check_fits(tokens.len(), max_tokens)?;
                summary.prompt_tokens = tokens.len() as u32;
                let t0 = Instant::now();
                let first = self.prefill(slot, &tokens, params)?;
                summary.prefill_ms = ms(t0);
                let prefilled = GenEvent::Prefilled {
                    prompt_tokens: summary.prompt_tokens,
                    prefill_ms: summary.prefill_ms,
                };
                if events.send(prefilled).is_err()
                    || events.send(GenEvent::Token(first.clone())).is_err()
                {
                    summary.finish = Finish::Cancelled;
                    return Ok(None);
                }
                (tokens, first, max_tokens.saturating_sub(1))
            }
            Start::ImportedFile { path, first } => {
                let t0 = Instant::now();
                let tokens = self.import_file(slot, &path)?;
                summary.import_ms = ms(t0);
                self.check_fits(tokens.len(), max_tokens + 1)?;
                summary.prompt_tokens = tokens.len() as u32;
                (tokens, self.token_out(LlamaToken(first)), max_tokens)
            }
            Start::Imported {
                state,
                tokens,
                first,
            } => {
                // The first token was emitted by the prefill node; it counts there.
                self.check_fits(tokens.len(), max_tokens + 1)?;
                summary.prompt_tokens = tokens.len() as u32;
                let t0 = Instant::now();
                self.import(slot, &state)?;
                summary.import_ms = ms(t0);
                (tokens, self.token_out(LlamaToken(first)), max_tokens)
            }
            Start::Resume { prompt, answer } => {
                let Some((&last, before)) = answer.split_last() else {
                    return Err(EngineError::Decode(
                        "resume needs at least the first token of the answer".into(),
                    ));
                };
                self.check_fits(prompt.len() + answer.len(), max_tokens)?;
                summary.prompt_tokens = prompt.len() as u32;
                let t0 = Instant::now();
                // The same batches as the original prefill (its sampled token is not used).
                self.prefill(slot, &prompt, params)?;
                let mut history = prompt;
                for &t in before {
                    self.decode_one(slot, t, &mut history)?;
                }
                summary.prefill_ms = ms(t0);
                step = u32::try_from(answer.len()).unwrap_or(u32::MAX);
                (history, self.token_out(LlamaToken(last)), max_tokens)
            }
        };
        if first.eog {
            summary.finish = Finish::Stop;
            return Ok(None);
        }
        if budget == 0 {
            return Ok(None);
        }
        Ok(Some(Begun {
            history,
            last: first.id,
            step,
            budget,
        }))
    }

    /// One decode step of a running answer: decode its newest token, sample and emit the
    /// next. `Ok(true)` when the answer has ended (its `summary.finish` says why).
    fn step(&mut self, r: &mut Running) -> Result<bool, EngineError> {
        if r.events.is_closed() {
            r.summary.finish = Finish::Cancelled;
            return Ok(true);
        }
        self.decode_one(r.slot, r.last, &mut r.history)?;
        let ctx = &self.slots[r.slot].ctx;
        let id = sampling::sample(ctx, 0, self.n_vocab, &r.params, &r.history, r.step);
        r.step += 1;
        r.budget -= 1;
        r.summary.generated += 1;
        let out = self.token_out(id);
        let eog = out.eog;
        if r.events.send(GenEvent::Token(out)).is_err() {
            r.summary.finish = Finish::Cancelled;
            return Ok(true);
        }
        if eog {
            r.summary.finish = Finish::Stop;
            return Ok(true);
        }
        r.last = id.0;
        Ok(r.budget == 0)
    }
}
