//! The llama.cpp side of an engine: the owner thread that loads the model and creates one
//! context per sequence slot, and the [`Worker`] that prefills, imports, exports and steps.
//!
//! Its rooms: `prefill`, `step` (one decode step and its sampling), `state` (export, import,
//! relayout), `slots` (the scheduler's calls: begin, step, score, the live window).

mod prefill;
mod slots;
mod state;
mod step;

use std::num::NonZeroU32;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;
use tokio::sync::{mpsc, oneshot};

use crate::cache::{self, SlotView};
use crate::command::{Command, Gauges};
use crate::config::{EngineConfig, FlashAttn};
use crate::exit_guard::{park_forever, Busy};
use crate::info::{self, ModelInfo};
use crate::sampling::{Grammar, SamplingParams};
use crate::scheduler::Scheduler;
use crate::template::{ChatTemplate, SpecialTokens, ToolCallFormat};
use crate::types::{EngineError, Input, Reuse};

/// The process's one llama.cpp backend (llama.cpp is initialised once per process; a
/// second `LlamaBackend::init` fails), with its logs sent to `tracing`.
pub fn backend() -> &'static LlamaBackend {
    static BACKEND: OnceLock<LlamaBackend> = OnceLock::new();
    BACKEND.get_or_init(|| {
        llama_cpp_2::send_logs_to_tracing(llama_cpp_2::LogOptions::default());
        LlamaBackend::init().expect("llama.cpp backend initialises once per process")
    })
}

pub(crate) fn owner_thread(
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
    let mparams = match config.remote_layers {
        // llama.cpp offloads the output layer first, then from the last layer back.
        Some(r) => match LlamaModelParams::default().with_devices(&[r.device]) {
            Ok(p) => p.with_n_gpu_layers(r.layers + 1),
            Err(e) => {
                let _ = ready.send(Err(load_err(format!("the RPC device: {e}"))));
                return;
            }
        },
        None => LlamaModelParams::default().with_n_gpu_layers(config.n_gpu_layers),
    };
    let model = match LlamaModel::load_from_file(backend, &config.model_path, &mparams) {
        Ok(m) => m,
        Err(e) => {
            let _ = ready.send(Err(load_err(e.to_string())));
            return;
        }
    };
    let flash_on = match config.flash_attn {
        FlashAttn::On | FlashAttn::Auto => true,
        FlashAttn::Off => false,
    };
    if config.cache_type_v.is_quantized() && !flash_on {
        let _ = ready.send(Err(load_err(
            "a quantized V cache (--cache-type-v) needs flash attention: --flash-attn on".into(),
        )));
        return;
    }
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
        .with_type_k(config.cache_type_k.llama())
        .with_type_v(config.cache_type_v.llama())
        .with_flash_attention_policy(flash);
    let mut slots = Vec::new();
    for _ in 0..config.n_parallel.max(1) {
        match model.new_context(backend, cparams.clone()) {
            Ok(ctx) => slots.push(Slot {
                ctx,
                tokens: Vec::new(),
                exact: 0,
                decoded: Vec::new(),
                used: 0,
                busy: false,
                laid_out: None,
            }),
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
    let mut info = ModelInfo::read(&model, &config, fingerprint, n_ctx, flash_on);
    tracing::info!(
        model = %info.model_id,
        fingerprint = %info.fingerprint_hex(),
        n_ctx = info.n_ctx,
        parallel = slots.len(),
        threads = config.n_threads,
        kv_bytes_per_token = info.kv_bytes_per_token,
        "model loaded"
    );
    let chat = chat_template(&model, config.chat_template_file.as_deref());
    // A template file asked for by name and unusable is a configuration error: refused at
    // start, as llama-server refuses it. (A GGUF's own broken template only refuses chat
    // requests: raw completions still work.)
    if let (Some(_), Err(e)) = (&config.chat_template_file, &chat) {
        let _ = ready.send(Err(load_err(e.clone())));
        return;
    }
    if let Ok(t) = &chat {
        info.tool_call_format = t.tool_call_format();
        info.chat_template_fingerprint = t.fingerprint().to_string();
    }
    let n_batch = config.n_batch as usize;
    let mut worker = Worker {
        model: &model,
        slots,
        batch: LlamaBatch::new(n_batch, 1),
        n_batch,
        n_ctx,
        n_vocab: model.n_vocab(),
        gauges,
        ticks: 0,
        export_buf: Vec::new(),
        sliding_window: info.sliding_window,
        ring_cells: crate::info::sliding_window(&model)
            .map_or(0, |w| (w + n_batch).min(n_ctx as usize)),
        chat,
    };
    if config.warmup {
        let t0 = Instant::now();
        if let Err(e) = worker.warm_up() {
            let _ = ready.send(Err(load_err(format!("the warm-up computation: {e}"))));
            return;
        }
        tracing::info!(
            ms = t0.elapsed().as_millis() as u64,
            slots = worker.slots.len(),
            "warmed up"
        );
    }
    if ready.send(Ok(info)).is_err() {
        return;
    }
    Scheduler::new(worker, rx)
        .pacing_live(config.pace_live)
        .run();
    let Some(_busy) = Busy::enter() else {
        park_forever()
    };
    drop(model);
}

/// Tokens of the warm-up's batch: enough for the prefill's matrix kernels (the
/// single-token steps after it take the decode kernels), few enough to cost tens of
/// milliseconds.
const WARMUP_TOKENS: usize = 32;

impl Worker<'_> {
    /// [`EngineConfig::warmup`]: in every slot, a batch of [`WARMUP_TOKENS`] tokens and two
    /// single-token steps after it, then the sequence cleared; nothing of it is kept or
    /// cached (the slot's `tokens` stay empty).
    fn warm_up(&mut self) -> Result<(), EngineError> {
        let batch = WARMUP_TOKENS.min(self.n_batch).min(self.n_ctx as usize / 2);
        let token = LlamaToken(0);
        for slot in 0..self.slots.len() {
            let mut steps = vec![(0..batch).collect::<Vec<_>>()];
            steps.push(vec![batch]);
            steps.push(vec![batch + 1]);
            for positions in steps {
                self.batch.clear();
                let last = positions.len() - 1;
                for (i, pos) in positions.into_iter().enumerate() {
                    self.batch
                        .add(token, pos as i32, &[0], i == last)
                        .map_err(|e| EngineError::Decode(e.to_string()))?;
                }
                self.slots[slot]
                    .ctx
                    .decode(&mut self.batch)
                    .map_err(|e| EngineError::Decode(e.to_string()))?;
            }
            let _ = self.slots[slot].ctx.clear_kv_cache_seq(Some(0), None, None);
        }
        Ok(())
    }
}

/// One context and what its sequence holds. A slot not in use keeps its sequence as a
/// cached prefix (`cache.rs`).
struct Slot<'m> {
    ctx: LlamaContext<'m>,
    /// Every token whose KV the sequence holds, in position order.
    tokens: Vec<i32>,
    /// Of `tokens`, the leading ones whose KV a prefill of them from position 0 computes
    /// (see [`SlotView::exact`]).
    exact: usize,
    /// The runs of positions decoded one token at a time (see [`SlotView::decoded`]).
    decoded: Vec<(usize, usize)>,
    /// When a job last took the slot (a tick of `Worker::ticks`).
    used: u64,
    /// A job holds it.
    busy: bool,
    /// A live answer's state right after its prefill on a sliding-window model (the
    /// relayout's export): its first piece, which no later export can give (see
    /// [`Worker::snapshot`]).
    laid_out: Option<Vec<u8>>,
}

impl Slot<'_> {
    fn held(&self) -> SlotView<'_> {
        SlotView {
            tokens: &self.tokens,
            exact: self.exact,
            decoded: &self.decoded,
        }
    }
}

/// An answer being written in a slot, between two steps.
pub(crate) struct Answer {
    params: SamplingParams,
    /// Every token whose KV is in the slot (prompt and answer so far).
    history: Vec<i32>,
    /// The newest answer token, decoded by the next step.
    last: i32,
    /// Index of the next sampling step (the RNG seed depends on it).
    step: u32,
    /// Tokens this node may still emit.
    budget: u32,
    /// Where the answer stands in its grammar, if it has one.
    grammar: Option<Grammar>,
    /// A live answer on a sliding-window model: what its pieces may hold.
    window: Option<LiveWindow>,
}

/// A live answer's sliding-window cache since its relayout: the window's cells lie from
/// index 0 in position order and each step adds its cell after them, until the ring
/// wraps. Until then the cache is, cell for cell, the prompt's state (with the window as
/// it stood after the prefill) followed by the cells of the tokens written since: what the
/// decode node rebuilds from the pieces (`edgesplit_proto::splice`).
#[derive(Debug)]
struct LiveWindow {
    /// The prompt's state right after the prefill, until its piece is taken.
    bulk: Option<Vec<u8>>,
    /// Positions held then (the prompt).
    prompt: usize,
    /// Positions the answer may add before the ring could wrap.
    room: usize,
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
    /// Counts the jobs given a slot (the cache's recency).
    ticks: u64,
    /// Kept between the exports of a live handoff's pieces (see `export_from`), and for
    /// the relayout of a sliding-window cache (see `lay_out_as_imported`).
    export_buf: Vec<u8>,
    /// The model attends through a sliding window (its cache is a ring).
    sliding_window: bool,
    /// Cells of that ring's cache, at least: llama.cpp sizes it `n_swa + n_ubatch` (padded
    /// up to 256, or the context's size if smaller); 0 without a window.
    ring_cells: usize,
    /// The chat template, compiled (`--chat-template-file`'s, the GGUF's, or llama-server's
    /// ChatML fallback); an error: it does not compile, said to each chat request.
    chat: Result<ChatTemplate, String>,
}

/// The chat template (`--chat-template-file`'s, else the GGUF's, else llama-server's ChatML
/// fallback) with the model's BOS/EOS text, as llama-server reads them: the tokens as text
/// with special tokens rendered, and whether tokenizing adds them.
fn chat_template(model: &LlamaModel, file: Option<&Path>) -> Result<ChatTemplate, String> {
    let source = match file {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|e| format!("chat template file {}: {e}", path.display()))?,
        None => match model.chat_template(None) {
            Ok(t) => t
                .to_str()
                .map(str::to_owned)
                .map_err(|e| format!("the chat template is not UTF-8: {e}"))?,
            Err(_) => {
                tracing::warn!("the model has no chat template: chat requests use ChatML, as llama-server does (--chat-template-file gives it its own)");
                crate::template::CHATML_FALLBACK.to_owned()
            }
        },
    };
    let vocab = model.vocab();
    let text = |t: LlamaToken| {
        if t.0 < 0 {
            String::new()
        } else {
            String::from_utf8_lossy(&vocab.token_to_piece(t, true, None)).into_owned()
        }
    };
    let special = SpecialTokens {
        bos: text(vocab.bos()),
        eos: text(vocab.eos()),
        add_bos: vocab.should_add_bos(),
        add_eos: vocab.should_add_eos(),
    };
    let compiled = ChatTemplate::new(&source, special);
    if let Err(e) = &compiled {
        tracing::warn!(error = %e, "the model's chat template does not compile; chat requests will be refused");
    }
    compiled
}

/// What a chat with tools is told when the template renders none.
pub const NO_TOOLS: &str = "this model's chat template does not take tools \
     (--chat-template-file can give it one that does, such as templates/chatml-tools.jinja)";

/// The answer's grammar, if its parameters have one, after the tokens `answer`.
fn grammar(
    model: &LlamaModel,
    params: &SamplingParams,
    answer: &[i32],
) -> Result<Option<Grammar>, EngineError> {
    Grammar::of(model, params, answer).map_err(EngineError::Grammar)
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1000.0
}

impl Worker<'_> {
    pub(super) fn tokenize(&self, input: Input) -> Result<Vec<i32>, EngineError> {
        let text = match input {
            Input::Raw(p) => {
                if p.is_empty() {
                    return Err(EngineError::EmptyPrompt);
                }
                return self.tokenize_text(&p);
            }
            Input::Chat(chat) => match &self.chat {
                Err(e) => return Err(EngineError::Template(e.clone())),
                // A template without tools would drop them without a word.
                Ok(t) if chat.tools.is_some() && t.tool_call_format() == ToolCallFormat::None => {
                    return Err(EngineError::Template(NO_TOOLS.into()))
                }
                Ok(t) => t.render(&chat).map_err(EngineError::Template)?,
            },
        };
        self.tokenize_text(&text)
    }

    /// As llama-server does: special tokens added where the model wants them (BOS) and
    /// special-token text parsed (the chat template writes `<|im_start|>` as text).
    pub(super) fn tokenize_text(&self, text: &str) -> Result<Vec<i32>, EngineError> {
        let toks = self.model.vocab().tokenize(text.as_bytes(), true, true);
        if toks.is_empty() {
            return Err(EngineError::EmptyPrompt);
        }
        Ok(toks.into_iter().map(|t| t.0).collect())
    }

    pub(super) fn check_fits(&self, prompt: usize, max_tokens: u32) -> Result<(), EngineError> {
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

    /// How many leading tokens of `tokens` may keep the KV `slot` holds for them under
    /// `reuse` (`cache::reusable`).
    pub(super) fn reusable(&self, slot: usize, tokens: &[i32], reuse: Reuse) -> usize {
        cache::reusable(
            self.slots[slot].held(),
            tokens,
            reuse,
            self.n_batch,
            self.sliding_window,
        )
    }

    pub(super) fn clear(&mut self, slot: usize) {
        let s = &mut self.slots[slot];
        s.laid_out = None;
        // Seq id 0 always fits in an i32; this cannot fail.
        let _ = s.ctx.clear_kv_cache_seq(Some(0), None, None);
        s.tokens.clear();
        s.exact = 0;
        s.decoded.clear();
        self.publish_kv();
    }

    /// Publishes the tokens held by the slots in use and by the cache.
    pub(super) fn publish_kv(&self) {
        let (mut busy, mut idle) = (0u64, 0u64);
        for s in &self.slots {
            *(if s.busy { &mut busy } else { &mut idle }) += s.tokens.len() as u64;
        }
        self.gauges.kv_tokens.store(busy, Ordering::Relaxed);
        self.gauges.cached_tokens.store(idle, Ordering::Relaxed);
    }
}
