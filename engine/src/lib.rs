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
use std::sync::atomic::{AtomicU64, Ordering};
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
}

impl EngineConfig {
    /// Defaults for `model_path`: 4,096 tokens, batch 512, physical cores, flash attention
    /// [`FlashAttn::Auto`].
    #[must_use]
    pub fn new(model_path: impl Into<PathBuf>) -> Self {
        Self {
            model_path: model_path.into(),
            n_ctx: 4096,
            n_batch: 512,
            n_threads: default_threads(),
            flash_attn: FlashAttn::Auto,
            n_gpu_layers: if cfg!(feature = "cuda") { 999 } else { 0 },
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
}

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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// End-of-generation token.
    Stop,
    /// Token budget spent.
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
#[derive(Debug, Clone, PartialEq)]
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

/// Commands the owner thread executes one at a time.
enum Command {
    Tokenize {
        input: Input,
        reply: oneshot::Sender<Result<Vec<i32>, EngineError>>,
    },
    Prefill {
        tokens: Vec<i32>,
        params: SamplingParams,
        max_tokens: u32,
        export: Export,
        reply: oneshot::Sender<Result<PrefillOutput, EngineError>>,
        in_flight: InFlight,
    },
    Generate {
        start: Start,
        params: SamplingParams,
        /// Tokens to emit at most.
        max_tokens: u32,
        events: mpsc::Sender<GenEvent>,
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
    kv_tokens: Arc<AtomicU64>,
    in_flight: Arc<AtomicU64>,
}

fn backend() -> &'static LlamaBackend {
    static BACKEND: OnceLock<LlamaBackend> = OnceLock::new();
    BACKEND.get_or_init(|| {
        llama_cpp_2::send_logs_to_tracing(llama_cpp_2::LogOptions::default());
        LlamaBackend::init().expect("llama.cpp backend initialises once per process")
    })
}

impl Engine {
    /// Loads the model on a new owner thread and waits until it is ready.
    ///
    /// # Errors
    /// [`EngineError::Load`] if the file is missing or llama.cpp refuses it.
    pub async fn start(config: EngineConfig) -> Result<Engine, EngineError> {
        let (tx, rx) = mpsc::channel(64);
        let (ready_tx, ready_rx) = oneshot::channel();
        let kv_tokens = Arc::new(AtomicU64::new(0));
        let kv = kv_tokens.clone();
        std::thread::Builder::new()
            .name("llama-engine".into())
            .spawn(move || owner_thread(config, rx, ready_tx, kv))
            .map_err(|e| EngineError::Load {
                path: String::new(),
                reason: e.to_string(),
            })?;
        let info = ready_rx.await.map_err(|_| EngineError::Closed)??;
        Ok(Engine {
            tx,
            info: Arc::new(info),
            kv_tokens,
            in_flight: Arc::new(AtomicU64::new(0)),
        })
    }

    /// Prefills and generations queued or running now.
    #[must_use]
    pub fn in_flight(&self) -> u64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Tokens whose KV the context holds now (0 when idle).
    #[must_use]
    pub fn kv_tokens(&self) -> u64 {
        self.kv_tokens.load(Ordering::Relaxed)
    }

    /// Facts about the loaded model and context.
    #[must_use]
    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    async fn call<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, EngineError>>) -> Command,
    ) -> Result<T, EngineError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(make(reply))
            .await
            .map_err(|_| EngineError::Closed)?;
        rx.await.map_err(|_| EngineError::Closed)?
    }

    /// Renders (chat) and tokenizes the input.
    ///
    /// # Errors
    /// No chat template, template failure, empty prompt.
    pub async fn tokenize(&self, input: Input) -> Result<Vec<i32>, EngineError> {
        self.call(|reply| Command::Tokenize { input, reply }).await
    }

    /// Prefills `tokens`, samples the first token, and exports the state if asked and the
    /// answer continues past the first token.
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
        let in_flight = InFlight::new(&self.in_flight);
        self.call(|reply| Command::Prefill {
            tokens,
            params,
            max_tokens,
            export,
            reply,
            in_flight,
        })
        .await
    }

    /// Starts a generation; events arrive on the returned channel. Dropping the receiver
    /// cancels the generation.
    ///
    /// # Errors
    /// [`EngineError::Closed`] if the owner thread is gone.
    pub async fn generate(
        &self,
        start: Start,
        params: SamplingParams,
        max_tokens: u32,
    ) -> Result<mpsc::Receiver<GenEvent>, EngineError> {
        let (events, rx) = mpsc::channel(64);
        self.tx
            .send(Command::Generate {
                start,
                params,
                max_tokens,
                events,
                in_flight: InFlight::new(&self.in_flight),
            })
            .await
            .map_err(|_| EngineError::Closed)?;
        Ok(rx)
    }
}

fn owner_thread(
    config: EngineConfig,
    mut rx: mpsc::Receiver<Command>,
    ready: oneshot::Sender<Result<ModelInfo, EngineError>>,
    kv_tokens: Arc<AtomicU64>,
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
    let ctx = match model.new_context(backend, cparams) {
        Ok(c) => c,
        Err(e) => {
            let _ = ready.send(Err(load_err(e.to_string())));
            return;
        }
    };
    let info = ModelInfo::read(&model, &config, fingerprint, ctx.n_ctx(), flash_on);
    tracing::info!(
        model = %info.model_id,
        fingerprint = %info.fingerprint_hex(),
        n_ctx = info.n_ctx,
        threads = config.n_threads,
        kv_bytes_per_token = info.kv_bytes_per_token,
        "model loaded"
    );
    let n_batch = config.n_batch as usize;
    let mut worker = Worker {
        model: &model,
        ctx,
        batch: LlamaBatch::new(n_batch, 1),
        n_batch,
        n_vocab: model.n_vocab(),
        kv_tokens,
    };
    if ready.send(Ok(info)).is_err() {
        return;
    }
    while let Some(cmd) = rx.blocking_recv() {
        match cmd {
            Command::Tokenize { input, reply } => {
                let _ = reply.send(worker.tokenize(input));
            }
            Command::Prefill {
                tokens,
                params,
                max_tokens,
                export,
                reply,
                in_flight,
            } => {
                let out = worker.prefill_cmd(&tokens, &params, max_tokens, &export);
                drop(in_flight);
                let _ = reply.send(out);
            }
            Command::Generate {
                start,
                params,
                max_tokens,
                events,
                in_flight: _in_flight,
            } => worker.generate(start, &params, max_tokens, &events),
        }
    }
}

struct Worker<'m> {
    model: &'m LlamaModel,
    ctx: LlamaContext<'m>,
    batch: LlamaBatch<'static>,
    n_batch: usize,
    n_vocab: i32,
    /// Tokens in sequence 0's KV, for memory reporting.
    kv_tokens: Arc<AtomicU64>,
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
        let n_ctx = self.ctx.n_ctx();
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

    /// Clears the sequence, prefills `tokens` and samples the first answer token (step 0).
    fn prefill(
        &mut self,
        tokens: &[i32],
        params: &SamplingParams,
    ) -> Result<TokenOut, EngineError> {
        self.clear();
        let last_chunk = (tokens.len() - 1) / self.n_batch;
        for (c, chunk) in tokens.chunks(self.n_batch).enumerate() {
            self.batch.clear();
            for (i, t) in chunk.iter().enumerate() {
                let pos = (c * self.n_batch + i) as i32;
                let logits = c == last_chunk && i == chunk.len() - 1;
                self.batch
                    .add(LlamaToken(*t), pos, &[0], logits)
                    .map_err(|e| EngineError::Decode(e.to_string()))?;
            }
            self.ctx
                .decode(&mut self.batch)
                .map_err(|e| EngineError::Decode(e.to_string()))?;
        }
        self.set_kv_tokens(tokens.len());
        let idx = self.batch.n_tokens() - 1;
        let id = sampling::sample(&self.ctx, idx, self.n_vocab, params, tokens, 0);
        Ok(self.token_out(id))
    }

    /// Appends `token` to the sequence at the next position: one single-token decode, as
    /// every generated token is decoded.
    fn decode_one(&mut self, token: i32, history: &mut Vec<i32>) -> Result<(), EngineError> {
        let pos = history.len() as i32;
        history.push(token);
        self.batch.clear();
        self.batch
            .add(LlamaToken(token), pos, &[0], true)
            .map_err(|e| EngineError::Decode(e.to_string()))?;
        self.ctx
            .decode(&mut self.batch)
            .map_err(|e| EngineError::Decode(e.to_string()))
    }

    fn clear(&mut self) {
        // Seq id 0 always fits in an i32; this cannot fail.
        let _ = self.ctx.clear_kv_cache_seq(Some(0), None, None);
        self.set_kv_tokens(0);
    }

    fn set_kv_tokens(&self, n: usize) {
        self.kv_tokens.store(n as u64, Ordering::Relaxed);
    }

    fn prefill_cmd(
        &mut self,
        tokens: &[i32],
        params: &SamplingParams,
        max_tokens: u32,
        export: &Export,
    ) -> Result<PrefillOutput, EngineError> {
        self.check_fits(tokens.len(), max_tokens)?;
        let t0 = Instant::now();
        let first = match self.prefill(tokens, params) {
            Ok(f) => f,
            Err(e) => {
                self.clear();
                return Err(e);
            }
        };
        let prefill_ms = ms(t0);
        let continues = !first.eog && max_tokens > 1;
        let mut state = None;
        let t1 = Instant::now();
        if continues {
            state = match export {
                Export::None => None,
                Export::Raw => Some(Exported::Raw(self.export().inspect_err(|_| self.clear())?)),
                Export::File(path) => Some(
                    self.export_file(path, tokens)
                        .inspect_err(|_| self.clear())?,
                ),
            };
        }
        let export_ms = ms(t1);
        self.clear();
        Ok(PrefillOutput {
            prompt_tokens: tokens.to_vec(),
            first,
            prefill_ms,
            state,
            export_ms,
        })
    }

    fn export(&self) -> Result<Vec<u8>, EngineError> {
        let flags = LlamaStateSeqFlags::empty();
        let size = self.ctx.state_seq_get_size_ext(0, flags);
        if size == 0 {
            return Err(EngineError::Export(
                "llama.cpp reported an empty state".into(),
            ));
        }
        let mut buf = vec![0u8; size];
        // SAFETY: `buf` holds exactly the size llama.cpp reported for this sequence, and the
        // context is not modified between the size query and the copy (same thread).
        let n = unsafe { self.ctx.state_seq_get_data_ext(buf.as_mut_ptr(), 0, flags) };
        if n != size {
            return Err(EngineError::Export(format!(
                "llama.cpp wrote {n} bytes, expected {size}"
            )));
        }
        Ok(buf)
    }

    fn export_file(&self, path: &std::path::Path, tokens: &[i32]) -> Result<Exported, EngineError> {
        let toks: Vec<LlamaToken> = tokens.iter().map(|t| LlamaToken(*t)).collect();
        let bytes = self
            .ctx
            .state_seq_save_file(path, 0, &toks)
            .map_err(|e| EngineError::Export(e.to_string()))?;
        Ok(Exported::File {
            path: path.to_path_buf(),
            bytes: bytes as u64,
        })
    }

    /// Loads a sequence-state file into sequence 0; returns the tokens it covers. The file
    /// is deleted whatever happens.
    fn import_file(&mut self, path: &std::path::Path) -> Result<Vec<i32>, EngineError> {
        self.clear();
        let n_ctx = self.ctx.n_ctx() as usize;
        let res = self.ctx.state_seq_load_file(path, 0, n_ctx);
        let _ = std::fs::remove_file(path);
        match res {
            Ok((toks, _)) => {
                self.set_kv_tokens(toks.len());
                Ok(toks.into_iter().map(|t| t.0).collect())
            }
            Err(e) => {
                self.clear();
                Err(EngineError::Import(format!(
                    "llama.cpp refused the state file: {e}"
                )))
            }
        }
    }

    fn import(&mut self, state: &[u8]) -> Result<(), EngineError> {
        self.clear();
        // SAFETY: the bytes were produced by `state_seq_get_data_ext` of the same llama.cpp
        // build and model (the V2 handshake compared build id and model fingerprint), their
        // SHA-256 passed and their tensor layout was re-derived and compared before we got
        // here. llama.cpp's reader is bounds-checked against `state.len()` and rejects
        // shape mismatches.
        let ok = unsafe {
            self.ctx
                .state_seq_set_data_ext(state, 0, LlamaStateSeqFlags::empty())
        };
        if !ok {
            self.clear();
            return Err(EngineError::Import(
                "llama.cpp refused the state (shape or type mismatch)".into(),
            ));
        }
        let held = self.ctx.kv_cache_seq_pos_max(0) + 1;
        self.set_kv_tokens(usize::try_from(held).unwrap_or(0));
        Ok(())
    }

    fn generate(
        &mut self,
        start: Start,
        params: &SamplingParams,
        max_tokens: u32,
        events: &mpsc::Sender<GenEvent>,
    ) {
        let mut summary = GenSummary {
            finish: Finish::Length,
            generated: 0,
            prompt_tokens: 0,
            prefill_ms: 0.0,
            import_ms: 0.0,
            decode_ms: 0.0,
        };
        let result = self.generate_inner(start, params, max_tokens, events, &mut summary);
        self.clear();
        let last = match result {
            Ok(()) => GenEvent::Done(summary),
            Err(e) => GenEvent::Error(e),
        };
        let _ = events.blocking_send(last);
    }

    fn generate_inner(
        &mut self,
        start: Start,
        params: &SamplingParams,
        max_tokens: u32,
        events: &mpsc::Sender<GenEvent>,
        summary: &mut GenSummary,
    ) -> Result<(), EngineError> {
        let emit = |t: TokenOut| events.blocking_send(GenEvent::Token(t)).is_ok();
        // `history` = every token whose KV is (or is about to be) in the cache.
        // Step 0 sampled the first token (on whichever node prefilled); a resumed answer
        // continues at the step after its last token.
        let mut step = 1u32;
        let (mut history, first, budget) = match start {
            Start::Prompt(tokens) => {
                self.check_fits(tokens.len(), max_tokens)?;
                summary.prompt_tokens = tokens.len() as u32;
                let t0 = Instant::now();
                let first = self.prefill(&tokens, params)?;
                summary.prefill_ms = ms(t0);
                let prefilled = GenEvent::Prefilled {
                    prompt_tokens: summary.prompt_tokens,
                    prefill_ms: summary.prefill_ms,
                };
                if events.blocking_send(prefilled).is_err() || !emit(first.clone()) {
                    summary.finish = Finish::Cancelled;
                    return Ok(());
                }
                (tokens, first, max_tokens.saturating_sub(1))
            }
            Start::ImportedFile { path, first } => {
                let t0 = Instant::now();
                let tokens = self.import_file(&path)?;
                summary.import_ms = ms(t0);
                self.check_fits(tokens.len(), max_tokens + 1)?;
                summary.prompt_tokens = tokens.len() as u32;
                let first = self.token_out(LlamaToken(first));
                (tokens, first, max_tokens)
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
                self.import(&state)?;
                summary.import_ms = ms(t0);
                let first = self.token_out(LlamaToken(first));
                (tokens, first, max_tokens)
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
                self.prefill(&prompt, params)?;
                let mut history = prompt;
                for &t in before {
                    self.decode_one(t, &mut history)?;
                }
                self.set_kv_tokens(history.len());
                summary.prefill_ms = ms(t0);
                step = u32::try_from(answer.len()).unwrap_or(u32::MAX);
                (history, self.token_out(LlamaToken(last)), max_tokens)
            }
        };
        if first.eog {
            summary.finish = Finish::Stop;
            return Ok(());
        }
        let t0 = Instant::now();
        let mut last = first.id;
        let mut emitted = 0u32;
        while emitted < budget {
            self.decode_one(last, &mut history)?;
            self.set_kv_tokens(history.len());
            let id = sampling::sample(&self.ctx, 0, self.n_vocab, params, &history, step);
            step += 1;
            emitted += 1;
            summary.generated += 1;
            let out = self.token_out(id);
            let eog = out.eog;
            if !emit(out) {
                summary.finish = Finish::Cancelled;
                break;
            }
            if eog {
                summary.finish = Finish::Stop;
                break;
            }
            last = id.0;
        }
        summary.decode_ms = ms(t0);
        Ok(())
    }
}
