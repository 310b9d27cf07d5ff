//! The llama.cpp side of an engine: the owner thread that loads the model and creates one
//! context per sequence slot, and the [`Worker`] that prefills, imports, exports and steps.

use std::num::NonZeroU32;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::Instant;

use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::context::session::LlamaStateSeqFlags;
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::token::LlamaToken;
use tokio::sync::{mpsc, oneshot};

use crate::cache::{self, Candidate, SlotView};
use crate::command::{Command, Gauges, GenerateJob, PrefillJob};
use crate::config::{EngineConfig, FlashAttn};
use crate::exit_guard::{park_forever, Busy};
use crate::info::{self, ModelInfo};
use crate::sampling::{self, Grammar, SamplingParams};
use crate::scheduler::{Scheduler, Slots};
use crate::template::{ChatTemplate, SpecialTokens, ToolCallFormat};
use crate::types::{
    EngineError, Export, Exported, Finish, GenEvent, GenSummary, Input, PrefillOutput, Reuse,
    Snapshot, Start, TokenLogprobs, TokenOut, TopLogprob,
};

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
    let worker = Worker {
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
    fn tokenize(&self, input: Input) -> Result<Vec<i32>, EngineError> {
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

    /// Token `id` with its text (none for end-of-generation).
    fn token_out(&self, id: LlamaToken) -> TokenOut {
        let eog = self.model.vocab().is_eog(id);
        TokenOut {
            id: id.0,
            piece: if eog { Vec::new() } else { self.piece(id) },
            eog,
            logprobs: None,
        }
    }

    fn piece(&self, id: LlamaToken) -> Vec<u8> {
        self.model.vocab().token_to_piece(id, false, None)
    }

    /// The token `id` just sampled in `slot` from the logits at batch index `idx`, with its
    /// log-probabilities when `params` ask for them.
    fn sampled(&self, id: LlamaToken, slot: usize, idx: i32, params: &SamplingParams) -> TokenOut {
        let mut out = self.token_out(id);
        if let (Some(n), false) = (params.logprobs, out.eog) {
            let logits = self.slots[slot].ctx.get_logits_ith(idx);
            let n = n.min(sampling::MAX_TOP_LOGPROBS) as usize;
            let (logprob, top) = sampling::logprobs(logits, id.0, n);
            let top = top
                .into_iter()
                .map(|(t, logprob)| TopLogprob {
                    id: t,
                    piece: self.piece(LlamaToken(t)),
                    logprob,
                })
                .collect();
            out.logprobs = Some(TokenLogprobs { logprob, top });
        }
        out
    }

    /// How many leading tokens of `tokens` may keep the KV `slot` holds for them under
    /// `reuse` (`cache::reusable`).
    fn reusable(&self, slot: usize, tokens: &[i32], reuse: Reuse) -> usize {
        cache::reusable(
            self.slots[slot].held(),
            tokens,
            reuse,
            self.n_batch,
            self.sliding_window,
        )
    }

    /// Prefills `tokens` in `slot`, keeping the KV the slot holds for the first `keep` of
    /// them (from [`Worker::reusable`]; 0: from an empty slot), and samples the first
    /// answer token (step 0).
    fn prefill(
        &mut self,
        slot: usize,
        tokens: &[i32],
        keep: usize,
        params: &SamplingParams,
    ) -> Result<TokenOut, EngineError> {
        self.prefill_in_pieces(slot, tokens, keep, params, None)
    }

    /// [`Worker::prefill`], sending the state after every batch but the last to `pieces`
    /// (a live handoff streams them while the prefill goes on). The batches, and so the
    /// KV, are the same either way.
    fn prefill_in_pieces(
        &mut self,
        slot: usize,
        tokens: &[i32],
        keep: usize,
        params: &SamplingParams,
        pieces: Option<&mpsc::UnboundedSender<Snapshot>>,
    ) -> Result<TokenOut, EngineError> {
        // First: a schema that cannot be a grammar is refused before the prompt is read.
        let mut grammar = grammar(self.model, params, &[])?;
        let keep = self.cut_back(slot, keep.min(tokens.len() - 1));
        // Reusing decoded tokens (a conversation's earlier answer): what follows is not
        // what a prefill from 0 computes.
        let conversation = keep > self.slots[slot].exact;
        let counter = if keep > 0 {
            self.gauges
                .reused_tokens
                .fetch_add(keep as u64, Ordering::Relaxed);
            &self.gauges.cache_hits
        } else {
            &self.gauges.cache_misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let rest = &tokens[keep..];
        let last_chunk = (rest.len() - 1) / self.n_batch;
        // Where the last piece sent ended; pieces stop at the first that fails (the
        // prefill does not: they are an optimisation, and the handoff sends what is left).
        let mut sent = Some(0usize);
        // A sliding window's cells during a prefill are a ring in no order an import
        // keeps: its live handoff sends the state once the prefill is laid out.
        let streamed = pieces.filter(|_| !self.sliding_window);
        // A reused prefix is there already: it is the first piece.
        if let (Some(tx), true) = (streamed, keep > 0) {
            sent = self.send_piece(slot, tokens, 0, keep, tx);
        }
        for (c, chunk) in rest.chunks(self.n_batch).enumerate() {
            let at = keep + c * self.n_batch;
            self.batch.clear();
            for (i, t) in chunk.iter().enumerate() {
                let logits = c == last_chunk && i == chunk.len() - 1;
                self.batch
                    .add(LlamaToken(*t), (at + i) as i32, &[0], logits)
                    .map_err(|e| EngineError::Decode(e.to_string()))?;
            }
            self.slots[slot]
                .ctx
                .decode(&mut self.batch)
                .map_err(|e| EngineError::Decode(e.to_string()))?;
            self.slots[slot].tokens.extend_from_slice(chunk);
            if let (Some(tx), Some(from)) = (streamed, sent) {
                if c < last_chunk {
                    sent = self.send_piece(slot, tokens, from, at + chunk.len(), tx);
                }
            }
        }
        let ctx = &self.slots[slot].ctx;
        let idx = self.batch.n_tokens() - 1;
        let id = sampling::sample(ctx, idx, self.n_vocab, params, tokens, 0, grammar.as_mut())
            .map_err(EngineError::Grammar)?;
        // Before the relayout, which leaves no logits.
        let first = self.sampled(id, slot, idx, params);
        if self.sliding_window {
            self.lay_out_as_imported(slot, pieces.is_some())?;
        }
        if !conversation {
            self.slots[slot].exact = tokens.len();
        }
        self.publish_kv();
        Ok(first)
    }

    /// Sends the state of `tokens[from..covered]` (all the slot holds) as a live piece;
    /// where the next piece starts, or `None` when this one failed or nobody reads them.
    fn send_piece(
        &mut self,
        slot: usize,
        tokens: &[i32],
        from: usize,
        covered: usize,
        tx: &mpsc::UnboundedSender<Snapshot>,
    ) -> Option<usize> {
        if tx.is_closed() {
            return None;
        }
        let t0 = Instant::now();
        let state = self.export_from(slot, from).ok()?;
        let piece = Snapshot {
            state,
            tokens: tokens[..covered].to_vec(),
            from,
            last: 0,
            answered: 0,
            export_ms: ms(t0),
            head_digest: None,
        };
        tx.send(piece).ok().map(|()| covered)
    }

    /// Keeps the first `keep` positions of `slot`'s sequence and removes the rest; returns
    /// how many it kept (0, the slot cleared, when llama.cpp cannot cut this cache).
    fn cut_back(&mut self, slot: usize, keep: usize) -> usize {
        let s = &mut self.slots[slot];
        if keep == 0 || keep > s.tokens.len() {
            self.clear(slot);
            return 0;
        }
        if keep < s.tokens.len() {
            let p0 = u32::try_from(keep).ok();
            if !matches!(s.ctx.clear_kv_cache_seq(Some(0), p0, None), Ok(true)) {
                self.clear(slot);
                return 0;
            }
            s.tokens.truncate(keep);
            s.exact = s.exact.min(keep);
            s.decoded.retain(|(start, _)| *start < keep);
            if let Some(last) = s.decoded.last_mut() {
                last.1 = last.1.min(keep);
            }
        }
        keep
    }

    /// After a prefill, a sliding-window cache holds the window's cells in a ring, at
    /// indices that depend on how the prompt was batched and the window pruned; a state
    /// imported on another node is laid out from index 0 in the order it was exported.
    /// Attention over the same cells in another arrangement rounds differently in the
    /// last bits, enough to change a sampled token (issue 14). So every path lays its
    /// cache out the way an import does - exported, cleared, imported - right after the
    /// prefill, before its first decode step: the colocated run, the prefill node before
    /// it exports (what it sends is then exactly what it holds), a resumed answer. Every
    /// node then decodes from the same arrangement. The first token is sampled before,
    /// from the prefill's own logits, on every path alike.
    ///
    /// With `keep` (a live answer) the export is kept as the slot's `laid_out`: the state
    /// the live handoff's first piece must be.
    fn lay_out_as_imported(&mut self, slot: usize, keep: bool) -> Result<(), EngineError> {
        let mut state = if keep {
            let ctx = &self.slots[slot].ctx;
            edgesplit_proto::buffers::take(
                ctx.state_seq_get_size_ext(0, LlamaStateSeqFlags::empty()),
            )
        } else {
            std::mem::take(&mut self.export_buf)
        };
        Self::export_into(&self.slots[slot].ctx, &mut state)?;
        let ctx = &mut self.slots[slot].ctx;
        let _ = ctx.clear_kv_cache_seq(Some(0), None, None);
        let res = Self::import_raw(ctx, &state).map(|_| ());
        if keep {
            self.slots[slot].laid_out = res.is_ok().then_some(state);
        } else {
            self.export_buf = state;
        }
        res
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
        let s = &mut self.slots[slot];
        let at = s.tokens.len();
        match s.decoded.last_mut() {
            Some(run) if run.1 == at => run.1 += 1,
            _ => s.decoded.push((at, at + 1)),
        }
        s.tokens.push(token);
        self.publish_kv();
        Ok(())
    }

    fn clear(&mut self, slot: usize) {
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
    fn publish_kv(&self) {
        let (mut busy, mut idle) = (0u64, 0u64);
        for s in &self.slots {
            *(if s.busy { &mut busy } else { &mut idle }) += s.tokens.len() as u64;
        }
        self.gauges.kv_tokens.store(busy, Ordering::Relaxed);
        self.gauges.cached_tokens.store(idle, Ordering::Relaxed);
    }

    fn prefill_cmd(&mut self, slot: usize, job: &PrefillJob) -> Result<PrefillOutput, EngineError> {
        let PrefillJob {
            tokens,
            params,
            max_tokens,
            export,
            reuse,
        } = job;
        self.check_fits(tokens.len(), *max_tokens)?;
        let keep = self.reusable(slot, tokens, *reuse);
        let (first, state, prefill_ms, export_ms) =
            self.prefill_export(slot, tokens, keep, params, *max_tokens, export)?;
        Ok(PrefillOutput {
            prompt_tokens: tokens.to_vec(),
            cached_tokens: keep as u32,
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
        keep: usize,
        params: &SamplingParams,
        max_tokens: u32,
        export: &Export,
    ) -> Result<(TokenOut, Option<Exported>, f64, f64), EngineError> {
        let t0 = Instant::now();
        let first = self.prefill(slot, tokens, keep, params)?;
        let prefill_ms = ms(t0);
        let t1 = Instant::now();
        let continues = !first.eog && max_tokens > 1;
        let state = match export {
            _ if !continues => None,
            Export::None => None,
            Export::Raw => Some(Exported::Raw(self.export(slot)?)),
        };
        Ok((first, state, prefill_ms, ms(t1)))
    }

    /// The slot's whole state, in a buffer from `edgesplit_proto::buffers` (kept from
    /// handoff to handoff: its pages are warm, and the copy runs at memory speed).
    fn export(&self, slot: usize) -> Result<Vec<u8>, EngineError> {
        let ctx = &self.slots[slot].ctx;
        let size = ctx.state_seq_get_size_ext(0, LlamaStateSeqFlags::empty());
        let mut buf = edgesplit_proto::buffers::take(size);
        Self::export_into(ctx, &mut buf)?;
        Ok(buf)
    }

    /// Exports the slot's state into `buf`, replacing what it held (a buffer kept between
    /// exports has its pages already, so the copy runs at memory speed).
    fn export_into(ctx: &LlamaContext<'_>, buf: &mut Vec<u8>) -> Result<(), EngineError> {
        let flags = LlamaStateSeqFlags::empty();
        let size = ctx.state_seq_get_size_ext(0, flags);
        if size == 0 {
            return Err(EngineError::Export(
                "llama.cpp reported an empty state".into(),
            ));
        }
        buf.clear();
        buf.reserve(size);
        // SAFETY: `buf` has room for the size llama.cpp reported for this sequence, and the
        // context is not modified between the size query and the copy (same thread).
        let n = unsafe { ctx.state_seq_get_data_ext(buf.as_mut_ptr(), 0, flags) };
        if n != size {
            return Err(EngineError::Export(format!(
                "llama.cpp wrote {n} bytes, expected {size}"
            )));
        }
        // SAFETY: llama.cpp wrote the first `n` bytes (it returns what it wrote), and `n`
        // is within the capacity reserved above.
        unsafe { buf.set_len(n) };
        Ok(())
    }

    /// The slot's state from position `from` on (all of it for 0): exported into the
    /// worker's kept buffer, and only the cells asked for copied out
    /// (`edgesplit_proto::splice::tail`).
    fn export_from(&mut self, slot: usize, from: usize) -> Result<Vec<u8>, EngineError> {
        if from == 0 {
            return self.export(slot);
        }
        Self::export_into(&self.slots[slot].ctx, &mut self.export_buf)?;
        edgesplit_proto::splice::tail(&self.export_buf, from)
            .map_err(|e| EngineError::Export(e.to_string()))
    }

    /// Imports `state`, the KV of `tokens`, into the emptied `slot`; the first `exact` of
    /// them are what a prefill from 0 computes.
    fn import(
        &mut self,
        slot: usize,
        state: &[u8],
        tokens: &[i32],
        exact: usize,
    ) -> Result<(), EngineError> {
        self.clear(slot);
        let held = Self::import_raw(&mut self.slots[slot].ctx, state)?;
        if held != tokens.len() {
            self.clear(slot);
            return Err(EngineError::Import(format!(
                "the state holds {held} positions for {} tokens",
                tokens.len()
            )));
        }
        let s = &mut self.slots[slot];
        s.tokens = tokens.to_vec();
        s.exact = exact.min(held);
        // The tokens after the prompt were decoded (on the node that sent the state).
        if s.exact < held {
            s.decoded = vec![(s.exact, held)];
        }
        self.publish_kv();
        Ok(())
    }

    /// Joins a tail (`state`: the positions `n..` of `tokens`) onto the prefix `slot`
    /// holds and imports the whole into it; returns `n`. The slot must hold `tokens[..n]`
    /// with a state whose SHA-256 is `digest` (what the sender held under the same
    /// tokens: the KV is then the sender's bit for bit); otherwise nothing changes. Of the
    /// joined tokens, the slot's marks are kept below `n`; the tail's prompt positions
    /// (below `prompt`) continued a conversation, the rest were decoded.
    fn import_tail(
        &mut self,
        slot: usize,
        state: &[u8],
        tokens: &[i32],
        prompt: usize,
        digest: &[u8; 32],
    ) -> Result<usize, EngineError> {
        use edgesplit_proto::splice;
        let refuse = |why: String| EngineError::Import(format!("tail handoff: {why}"));
        let missing = EngineError::TailBase;
        let n = splice::span(state)
            .map_err(|e| refuse(e.to_string()))?
            .start;
        if n == 0 || n >= tokens.len() {
            return Err(refuse(format!(
                "a tail from position {n} of {} tokens",
                tokens.len()
            )));
        }
        let s = &self.slots[slot];
        if s.tokens.len() < n || s.tokens[..n] != tokens[..n] {
            return Err(missing(format!(
                "no cached sequence here holds the {n} tokens it goes on from"
            )));
        }
        Self::export_into(&self.slots[slot].ctx, &mut self.export_buf)?;
        // The prefix is hashed where it lies, on another thread, while the joined state is
        // written (into a kept buffer, whose pages are warm): the join is at the switch,
        // where the answer waits for it.
        let exported = &self.export_buf;
        let (mine, joined) = std::thread::scope(|scope| {
            let hashing = scope.spawn(|| splice::head_digest(exported, n));
            let out = edgesplit_proto::buffers::take(exported.len() + state.len());
            let joined = splice::graft(exported, state, out);
            (hashing.join(), joined)
        });
        let mine = mine
            .map_err(|_| refuse("the prefix's hash failed".into()))?
            .map_err(|e| refuse(e.to_string()))?;
        let joined = joined.map_err(|e| refuse(e.to_string()))?;
        if &mine != digest {
            edgesplit_proto::buffers::give(joined);
            return Err(missing(format!(
                "the cached state of its first {n} tokens differs from the sender's"
            )));
        }
        let (exact, mut decoded) = {
            let s = &self.slots[slot];
            (s.exact.min(n), s.decoded.clone())
        };
        decoded.retain(|(start, _)| *start < n);
        if let Some(last) = decoded.last_mut() {
            last.1 = last.1.min(n);
        }
        let imported = self.import(slot, &joined, tokens, 0);
        edgesplit_proto::buffers::give(joined);
        imported?;
        let s = &mut self.slots[slot];
        s.exact = exact;
        if prompt < tokens.len() {
            decoded.push((prompt.max(n), tokens.len()));
        }
        s.decoded = decoded;
        Ok(n)
    }

    /// Imports `state` into `ctx`'s (empty) sequence; returns the positions it holds.
    fn import_raw(ctx: &mut LlamaContext<'_>, state: &[u8]) -> Result<usize, EngineError> {
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
        Ok(usize::try_from(held).unwrap_or(0))
    }
}

impl Slots for Worker<'_> {
    type Answer = Answer;

    fn count(&self) -> usize {
        self.slots.len()
    }

    fn pick(&mut self, free: &[usize], want: Option<(&[i32], Reuse)>) -> usize {
        let candidates: Vec<Candidate> = free
            .iter()
            .map(|&slot| {
                let s = &self.slots[slot];
                Candidate::new(
                    slot,
                    s.held(),
                    s.used,
                    want,
                    self.n_batch,
                    self.sliding_window,
                )
            })
            .collect();
        let slot = cache::choose(&candidates).unwrap_or(free[0]);
        self.ticks += 1;
        let s = &mut self.slots[slot];
        s.used = self.ticks;
        s.busy = true;
        self.publish_kv();
        slot
    }

    fn tokenize(&mut self, input: Input) -> Result<Vec<i32>, EngineError> {
        Worker::tokenize(self, input)
    }

    fn prefill(&mut self, slot: usize, job: &PrefillJob) -> Result<PrefillOutput, EngineError> {
        self.prefill_cmd(slot, job)
    }

    fn begin(
        &mut self,
        slot: usize,
        job: GenerateJob,
        events: &mpsc::UnboundedSender<GenEvent>,
        summary: &mut GenSummary,
    ) -> Result<Option<Answer>, EngineError> {
        let GenerateJob {
            start,
            params,
            max_tokens,
            live: _,
            pieces,
        } = job;
        let params = &params;
        // Step 0 sampled the first token (on whichever node prefilled); a resumed answer
        // continues at the step after its last token.
        let mut step = 1u32;
        let start = match start {
            Start::Prompt(tokens) => Start::Cached {
                tokens,
                reuse: Reuse::Exact,
                max_uncached: None,
            },
            other => other,
        };
        let (history, first, budget) = match start {
            Start::Cached {
                tokens,
                reuse,
                max_uncached,
            } => {
                let keep = self.reusable(slot, &tokens, reuse);
                let uncached = tokens.len().saturating_sub(keep);
                let count = |n: usize| u32::try_from(n).unwrap_or(u32::MAX);
                // A bound asks to continue what is cached: nothing cached is refused too.
                if let Some(max_uncached) =
                    max_uncached.filter(|&m| keep == 0 || uncached > m as usize)
                {
                    return Err(EngineError::NotCached {
                        cached: count(keep),
                        prompt: count(tokens.len()),
                        max_uncached,
                    });
                }
                self.check_fits(tokens.len(), max_tokens)?;
                summary.prompt_tokens = count(tokens.len());
                summary.cached_tokens = count(keep);
                let t0 = Instant::now();
                let first = self.prefill_in_pieces(slot, &tokens, keep, params, pieces.as_ref())?;
                drop(pieces);
                summary.prefill_ms = ms(t0);
                let prefilled = GenEvent::Prefilled {
                    prompt_tokens: summary.prompt_tokens,
                    cached_tokens: summary.cached_tokens,
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
            Start::Imported {
                state,
                tokens,
                first,
                answered,
                base_digest,
            } => {
                // The first token was emitted by the prefill node; it counts there.
                self.check_fits(tokens.len(), max_tokens + 1)?;
                summary.prompt_tokens = tokens.len() as u32;
                let t0 = Instant::now();
                step = answered.max(1);
                // The prompt's KV came from a prefill (from 0, or for a tail from the cut);
                // the answer's from decode steps.
                let prompt = tokens.len() + 1 - (step as usize).min(tokens.len() + 1);
                match base_digest {
                    None => self.import(slot, &state, &tokens, prompt)?,
                    Some(digest) => {
                        let base = self.import_tail(slot, &state, &tokens, prompt, &digest)?;
                        summary.cached_tokens = u32::try_from(base).unwrap_or(u32::MAX);
                    }
                }
                summary.import_ms = ms(t0);
                (tokens, self.token_out(LlamaToken(first)), max_tokens)
            }
            Start::Prompt(_) => unreachable!("made a Start::Cached above"),
            Start::Resume {
                prompt,
                answer,
                reuse,
            } => {
                let Some((&last, before)) = answer.split_last() else {
                    return Err(EngineError::Decode(
                        "resume needs at least the first token of the answer".into(),
                    ));
                };
                self.check_fits(prompt.len() + answer.len(), max_tokens)?;
                summary.prompt_tokens = prompt.len() as u32;
                let t0 = Instant::now();
                // The same cut and batches as the original prefill (its sampled token is
                // not used).
                let keep = self.reusable(slot, &prompt, reuse);
                summary.cached_tokens = u32::try_from(keep).unwrap_or(u32::MAX);
                // A slot that holds exactly this prompt as a prefill from that cut left it
                // (the interrupted run's own slot, cut back to its prompt when the answer
                // was handed over: past the cut, no decoded token, and either every
                // position exact or the cut the end of the last decoded run, from which
                // the one prefill that wrote the rest started) has nothing to recompute.
                let s = &self.slots[slot];
                let run_end = s.decoded.last().map_or(0, |r| r.1);
                let held = !self.sliding_window
                    && s.tokens == prompt
                    && run_end <= keep
                    && (s.exact >= prompt.len() || (run_end > 0 && keep == run_end));
                if held {
                    summary.cached_tokens = u32::try_from(prompt.len()).unwrap_or(u32::MAX);
                } else {
                    self.prefill(slot, &prompt, keep, params)?;
                }
                let mut history = prompt;
                for &t in before {
                    self.decode_one(slot, t, &mut history)?;
                }
                summary.prefill_ms = ms(t0);
                step = u32::try_from(answer.len()).unwrap_or(u32::MAX);
                (history, self.token_out(LlamaToken(last)), max_tokens)
            }
        };
        // A live answer's prompt state, laid out (sliding-window models).
        let window = self.slots[slot].laid_out.take().map(|bulk| LiveWindow {
            room: self
                .ring_cells
                .saturating_sub(edgesplit_proto::splice::narrowest(&bulk).unwrap_or(usize::MAX)),
            prompt: history.len(),
            bulk: Some(bulk),
        });
        if first.eog {
            summary.finish = Finish::Stop;
            return Ok(None);
        }
        if budget == 0 {
            return Ok(None);
        }
        // The answer so far: the last `step` tokens of the KV's and the newest.
        let mut answer = history[history.len().saturating_sub(step as usize - 1)..].to_vec();
        answer.push(first.id);
        let grammar = grammar(self.model, params, &answer)?;
        Ok(Some(Answer {
            params: params.clone(),
            history,
            last: first.id,
            step,
            budget,
            grammar,
            window,
        }))
    }

    fn step(&mut self, slot: usize, a: &mut Answer) -> Result<(TokenOut, bool), EngineError> {
        self.decode_one(slot, a.last, &mut a.history)?;
        let ctx = &self.slots[slot].ctx;
        let id = sampling::sample(
            ctx,
            0,
            self.n_vocab,
            &a.params,
            &a.history,
            a.step,
            a.grammar.as_mut(),
        )
        .map_err(EngineError::Grammar)?;
        a.step += 1;
        a.budget -= 1;
        a.last = id.0;
        Ok((self.sampled(id, slot, 0, &a.params), a.budget == 0))
    }

    fn score(
        &mut self,
        slot: usize,
        tokens: &[i32],
        from: usize,
        prefix: Option<&[u8]>,
        out: &mpsc::Sender<Result<Vec<f32>, EngineError>>,
    ) -> Result<(), EngineError> {
        self.check_fits(tokens.len(), 0)?;
        if from >= tokens.len() || (from == 0 && prefix.is_some()) {
            return Err(EngineError::Import(format!(
                "score from position {from} of {} tokens",
                tokens.len()
            )));
        }
        self.clear(slot);
        // The context: imported, or prefilled as a prompt is (so an exported prefill's
        // state, imported, holds the same numbers on the same machine).
        match prefix {
            Some(state) => {
                edgesplit_proto::layout::describe_state(state).ok_or_else(|| {
                    EngineError::Import("the prefix is not a sequence state".into())
                })?;
                self.import(slot, state, &tokens[..from], from)?;
            }
            None if from > 0 => {
                self.prefill(slot, &tokens[..from], 0, &SamplingParams::default())?;
            }
            None => {}
        }
        // Batches of at most 64 positions, each with its logits: llama.cpp keeps one row
        // of n_vocab floats per position asked for.
        let step = 64.min(self.n_batch);
        for (c, chunk) in tokens[from..].chunks(step).enumerate() {
            self.batch.clear();
            for (i, t) in chunk.iter().enumerate() {
                let pos = (from + c * step + i) as i32;
                self.batch
                    .add(LlamaToken(*t), pos, &[0], true)
                    .map_err(|e| EngineError::Decode(e.to_string()))?;
            }
            let ctx = &mut self.slots[slot].ctx;
            ctx.decode(&mut self.batch)
                .map_err(|e| EngineError::Decode(e.to_string()))?;
            for i in 0..chunk.len() {
                let logits = ctx.get_logits_ith(i as i32);
                let log_z = sampling::log_normaliser(logits);
                let logprobs = logits.iter().map(|l| l - log_z).collect();
                if out.blocking_send(Ok(logprobs)).is_err() {
                    return Ok(()); // the reader left
                }
            }
        }
        Ok(())
    }

    /// A live answer's state from position `from` on. On a sliding-window model the first
    /// piece is the state right after the prefill (answered 1), whenever it is asked for:
    /// a later export no longer holds the window's oldest cells, which the cache still
    /// does in their places. Later pieces are refused once the ring could have wrapped,
    /// and pieces of an answer that did not start live: the handoff is then cancelled.
    fn snapshot(
        &mut self,
        slot: usize,
        a: &mut Answer,
        from: usize,
        digest: bool,
    ) -> Result<Snapshot, EngineError> {
        let t0 = Instant::now();
        if self.sliding_window {
            let cut = |why: &str| EngineError::Export(format!("sliding-window state: {why}"));
            let w = a
                .window
                .as_mut()
                .ok_or_else(|| cut("only a live answer from its prompt is sent in pieces"))?;
            if from == 0 {
                let state = w
                    .bulk
                    .take()
                    .ok_or_else(|| cut("its first piece went already"))?;
                let prompt = w.prompt;
                return Ok(Snapshot {
                    state,
                    from,
                    tokens: a.history[..prompt].to_vec(),
                    last: a.history.get(prompt).copied().unwrap_or(a.last),
                    answered: 1,
                    export_ms: ms(t0),
                    head_digest: None,
                });
            }
            let written = a.history.len() - w.prompt;
            if written > w.room {
                return Err(cut(&format!(
                    "{written} positions written since the prefill, past the {} its ring \
                     holds in order",
                    w.room
                )));
            }
        }
        let state = self.export_from(slot, from)?;
        // `export_from` left the whole state in `export_buf` (from > 0).
        let head_digest = if digest && from > 0 {
            Some(
                edgesplit_proto::splice::head_digest(&self.export_buf, from)
                    .map_err(|e| EngineError::Export(e.to_string()))?,
            )
        } else {
            None
        };
        Ok(Snapshot {
            state,
            from,
            tokens: a.history.clone(),
            last: a.last,
            answered: a.step,
            export_ms: ms(t0),
            head_digest,
        })
    }

    /// The rest of the answer is written elsewhere: what this slot decoded of it would be
    /// only the start of the conversation's answer, which the next turn's prompt goes on
    /// past, so a continuation would prefill the rest in a batch where one device decoded
    /// it token by token. Only the prompt stays cached (nothing, for a ring cache): the
    /// answer's decoded run is cut away, the prompt's positions - a conversation's earlier
    /// turns and the new part prefilled after them - are kept, so that the answer can be
    /// replayed onto them as the decode node wrote it (`Start::Resume`, from the same cut).
    fn handed_over(&mut self, slot: usize) {
        if self.sliding_window {
            self.clear(slot);
        } else {
            let s = &self.slots[slot];
            let prompt = s
                .decoded
                .last()
                .filter(|(_, end)| *end == s.tokens.len())
                .map_or(s.tokens.len(), |(start, _)| *start);
            self.cut_back(slot, prompt);
        }
    }

    fn release(&mut self, slot: usize, keep: bool) {
        if !keep {
            self.clear(slot);
        }
        self.slots[slot].busy = false;
        self.publish_kv();
    }

    fn publish_active(&self, n: usize) {
        self.gauges.active.store(n as u64, Ordering::Relaxed);
    }
}
