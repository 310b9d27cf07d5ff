//! What goes in and out of an engine: inputs, tokens, prefill results, generation events,
//! where an answer starts, and the errors. Plain data; no llama.cpp handle in here.

/// What went wrong in the engine. `PartialEq` so tests compare errors directly.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    #[error("failed to load model {path}: {reason}")]
    Load { path: String, reason: String },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("chat template failed: {0}")]
    Template(String),
    #[error("structured output: {0}")]
    Grammar(String),
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
    /// A tail ([`Start::Imported`] with a `base_digest`) whose prefix no cached sequence here holds (its tokens, or a
    /// state whose bytes hash to the sender's). Nothing was changed.
    #[error("tail handoff: {0}")]
    TailBase(String),
    #[error("the engine thread has stopped")]
    Closed,
    #[error("{waiting} requests are already waiting for a free sequence; try again later")]
    Busy { waiting: usize },
    /// A [`Start::Cached`] with `max_uncached`: the cache holds none, or too little, of
    /// the prompt. Nothing was changed (the cached sequences are still there).
    #[error("not cached here: {cached} of the prompt's {prompt} tokens are, more than {max_uncached} would have to be prefilled")]
    NotCached {
        cached: u32,
        prompt: u32,
        max_uncached: u32,
    },
}

/// How much of a sequence slot's cached KV a prompt may reuse (the engine keeps each
/// slot's sequence after its answer ends, least recently used first out).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reuse {
    /// Prefill the whole prompt.
    None,
    /// Reuse only what makes no difference to the answer: a cached prefix whose KV a
    /// prefill of the prompt from position 0 computes the same way (the slot prefilled it
    /// itself, from 0, in the same batches), cut at a batch boundary, so the rest is
    /// prefilled in the batches a whole prefill would use. The KV, and so the answer, is
    /// bit for bit the uncached one's. Not for a sliding-window model (its ring cache
    /// cannot be cut back).
    #[default]
    Exact,
    /// Continue a conversation: reuse the longest cached prefix, the answer tokens that
    /// earlier decode steps wrote included, as llama-server's `cache_prompt` does. The
    /// answer is then the one this engine gives from that cache: what any engine that
    /// wrote the same conversation the same way gives (the split's identity argument,
    /// ARCHITECTURE.md "Conversations"). Where the reusable prefix holds no decoded token,
    /// this is [`Reuse::Exact`].
    Conversation,
}

/// The input of a request.
#[derive(Debug, Clone)]
pub enum Input {
    /// An OpenAI chat, rendered with the model's own template.
    Chat(Chat),
    /// A raw prompt, tokenized as is (with BOS if the model wants one).
    Raw(String),
}

impl Input {
    /// A chat of plain (role, content) messages, without tools.
    pub fn chat<R: Into<String>, C: Into<String>>(
        messages: impl IntoIterator<Item = (R, C)>,
    ) -> Self {
        Input::Chat(Chat {
            messages: messages
                .into_iter()
                .map(|(role, content)| ChatMessage {
                    role: role.into(),
                    content: content.into(),
                    ..ChatMessage::default()
                })
                .collect(),
            tools: None,
        })
    }
}

/// An OpenAI chat: its messages and the tools the model may call.
#[derive(Debug, Clone, Default)]
pub struct Chat {
    pub messages: Vec<ChatMessage>,
    /// The request's `tools`, a JSON array of OpenAI tool objects (as the chat template
    /// takes them); None: the template renders no tools.
    pub tools: Option<serde_json::Value>,
}

/// One chat message.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ChatMessage {
    pub role: String,
    /// Empty for an assistant message that only calls tools.
    pub content: String,
    /// An assistant message's tool calls.
    pub tool_calls: Vec<ToolCall>,
    /// A `tool` message: the id of the call it answers.
    pub tool_call_id: Option<String>,
}

/// A function call the model made.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The arguments, a JSON object.
    pub arguments: serde_json::Value,
}

/// A token and its text bytes (may be part of a UTF-8 character).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenOut {
    pub id: i32,
    pub piece: Vec<u8>,
    /// End-of-generation token (not part of the answer's text).
    pub eog: bool,
    /// When the sampling parameters ask for them, and the token is not end-of-generation.
    pub logprobs: Option<TokenLogprobs>,
}

/// A sampled token's log-probability under the model (softmax of the raw logits, before
/// any sampler: what llama-server reports by default) and the most likely tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// Most likely first; ties in the lower token id's favour.
    pub top: Vec<TopLogprob>,
}

/// One of the most likely tokens at a step.
#[derive(Debug, Clone, PartialEq)]
pub struct TopLogprob {
    pub id: i32,
    pub piece: Vec<u8>,
    pub logprob: f32,
}

/// Result of a prefill.
#[derive(Debug)]
pub struct PrefillOutput {
    pub prompt_tokens: Vec<i32>,
    /// Of the prompt, the leading tokens whose cached KV was reused (not prefilled).
    pub cached_tokens: u32,
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
    /// Raw sequence state bytes (both transports: V1 frames them as llama.cpp's
    /// sequence-state file, `edgesplit_proto::v1`).
    Raw,
}

/// An exported state.
#[derive(Debug)]
pub enum Exported {
    /// In a buffer from `edgesplit_proto::buffers`.
    Raw(Vec<u8>),
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
    /// A live answer was handed over at a token boundary ([`Snapshot`] with `stop`): it
    /// goes on on another node.
    Handover,
}

/// A live answer's sequence state at a token boundary, between two steps (see
/// `Engine::generate_live`).
#[derive(Debug)]
pub struct Snapshot {
    /// llama.cpp's raw sequence state of the positions `from..` of `tokens` (all of them
    /// when `from` is 0; else cut by `edgesplit_proto::splice::tail`).
    pub state: Vec<u8>,
    /// The first position `state` holds.
    pub from: usize,
    /// Every token whose KV the state holds: the prompt and the answer but its newest token.
    pub tokens: Vec<i32>,
    /// The newest answer token: sampled and sent, not yet decoded.
    pub last: i32,
    /// Answer tokens written so far, the first and `last` included: the index of the next
    /// sampling step. 0 for a piece of a prefill (no answer token yet; `last` is 0).
    pub answered: u32,
    pub export_ms: f64,
    /// When asked for ([`crate::Live::first_tail`]): SHA-256 of the state of the
    /// positions before `from` (`edgesplit_proto::splice::head_digest`), which names the
    /// prefix a tail handoff goes on from.
    pub head_digest: Option<[u8; 32]>,
}

/// Streamed out of a generation.
#[derive(Debug, Clone, PartialEq)]
pub enum GenEvent {
    /// Colocated runs: the prompt was prefilled (sent before the first token).
    Prefilled {
        prompt_tokens: u32,
        /// Of them, the tokens whose cached KV was reused.
        cached_tokens: u32,
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
    /// Of them, the tokens whose cached KV was reused (not prefilled).
    pub cached_tokens: u32,
    pub prefill_ms: f64,
    pub import_ms: f64,
    pub decode_ms: f64,
}

/// Where a generation starts from.
#[derive(Debug)]
pub enum Start {
    /// Prefill these tokens here, then continue (the colocated run), reusing a cached
    /// prefix only as [`Reuse::Exact`] does.
    Prompt(Vec<i32>),
    /// [`Start::Prompt`] under another reuse rule; with `max_uncached`, refused with
    /// [`EngineError::NotCached`] (and nothing changed) when nothing of the prompt is
    /// cached or more tokens than that would have to be prefilled.
    Cached {
        tokens: Vec<i32>,
        reuse: Reuse,
        max_uncached: Option<u32>,
    },
    /// Import a verified state covering `tokens`, then continue from `first`, the
    /// `answered`-th token of the answer (1 when the state is the prompt's; more when a
    /// live answer was handed over after the prefill node wrote some of it).
    Imported {
        /// Shared, not copied: a received frame's payload is imported where it lies.
        state: bytes::Bytes,
        tokens: Vec<i32>,
        first: i32,
        answered: u32,
        /// A tail (PROTOCOL.md, "Tails"): `state` holds the positions `n..` of `tokens`,
        /// and a cached slot here holds `tokens[..n]` with a state whose SHA-256
        /// (`edgesplit_proto::splice::head_digest`) is this. The slot's prefix and the
        /// tail are joined and imported into it; refused with [`EngineError::TailBase`]
        /// (the cached prefix left as it was) when no slot holds that prefix or its state
        /// hashes otherwise.
        base_digest: Option<[u8; 32]>,
    },
    /// Take over an answer another node was writing (it failed): rebuild the KV of
    /// `prompt` + `answer` the way the uninterrupted run built it - the prompt in batches,
    /// then each answer token one at a time - and continue after the last answer token
    /// with the next step's sampler, so the text goes on exactly as it would have.
    /// The prompt's cached prefix is reused under `reuse`, the rule the interrupted run's
    /// prefill used (so that the rebuilt KV is the one it computed). With `max_tokens` 0
    /// nothing is generated: the slot then holds the prompt and the answer but its last
    /// token, as the node that wrote it does (a conversation replayed for a later tail
    /// handoff).
    Resume {
        prompt: Vec<i32>,
        answer: Vec<i32>,
        reuse: Reuse,
    },
}
