//! Conversions between the engine's types and the wire types of `edgesplit-proto`.

use edgesplit_proto::error::{self, ErrorCode};
use edgesplit_proto::frame::Identity;
use edgesplit_proto::pb;

use std::future::Future;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::Status;

use crate::{
    Chat, ChatMessage, Engine, EngineError, GenEvent, Input, ModelInfo, SamplingParams,
    TokenLogprobs, TokenOut, ToolCall,
};

impl ModelInfo {
    /// What this node presents in the V2 handshake.
    #[must_use]
    pub fn identity(&self) -> Identity {
        Identity {
            model_fingerprint: self.fingerprint,
            build_id: self.build_id.clone(),
            type_k: self.type_k,
            type_v: self.type_v,
            flash_attn: self.flash_attn,
            n_ctx: self.n_ctx,
        }
    }

    /// The node's info reply, without the per-node counters (see `Engine::node_info`).
    #[must_use]
    pub fn node_info(&self, role: &str) -> pb::NodeInfo {
        pb::NodeInfo {
            role: role.to_string(),
            model_id: self.model_id.clone(),
            model_fingerprint: self.fingerprint_hex(),
            n_ctx: self.n_ctx,
            kv_bytes_per_token: self.kv_bytes_per_token,
            mem_available_bytes: crate::mem_available_bytes().unwrap_or(0),
            build_id: self.build_id.clone(),
            arch: self.arch.clone(),
            kernels: self.kernels.clone(),
            threads: self.threads,
            has_chat_template: self.has_chat_template,
            flash_attn: self.flash_attn,
            type_k: self.type_k,
            type_v: self.type_v,
            parallel: self.parallel,
            tool_call_format: self.tool_call_format.as_str().into(),
            chat_template_fingerprint: self.chat_template_fingerprint.clone(),
            sliding_window: self.sliding_window,
            ..Default::default()
        }
    }
}

impl crate::Engine {
    /// The node's info reply with the engine's own figures (the prefix cache); the node
    /// adds its own counters.
    #[must_use]
    pub fn node_info(&self, role: &str) -> pb::NodeInfo {
        let c = self.cache_stats();
        pb::NodeInfo {
            cached_tokens: c.cached_tokens,
            cache_hits: c.hits,
            cache_misses: c.misses,
            cache_reused_tokens: c.reused_tokens,
            ..self.info().node_info(role)
        }
    }
}

impl Engine {
    /// The prefix cache's series for a node's `/metrics`, read from this engine on each
    /// scrape.
    #[must_use]
    pub fn cache_collector(&self) -> edgesplit_proto::metrics::CacheCollector {
        let e = self.clone();
        edgesplit_proto::metrics::CacheCollector(Box::new(move || {
            let c = e.cache_stats();
            edgesplit_proto::metrics::CacheFigures {
                cached_tokens: c.cached_tokens,
                cached_bytes: c.cached_tokens * e.info().kv_bytes_per_token,
                hits: c.hits,
                misses: c.misses,
                reused_tokens: c.reused_tokens,
            }
        }))
    }
}

impl From<TokenLogprobs> for pb::TokenLogprobs {
    fn from(l: TokenLogprobs) -> Self {
        pb::TokenLogprobs {
            logprob: l.logprob,
            top: l
                .top
                .into_iter()
                .map(|t| pb::Logprob {
                    id: t.id,
                    piece: t.piece,
                    logprob: t.logprob,
                })
                .collect(),
        }
    }
}

impl From<TokenOut> for pb::Token {
    fn from(t: TokenOut) -> Self {
        pb::Token {
            id: t.id,
            piece: t.piece,
            logprobs: t.logprobs.map(Into::into),
        }
    }
}

/// A request's input as the engine takes it.
///
/// # Errors
/// The request has none.
pub fn engine_input(req: &pb::PrefillRequest) -> Result<Input, Status> {
    match &req.input {
        Some(pb::prefill_request::Input::Chat(c)) => chat_of(c).map(Input::Chat),
        Some(pb::prefill_request::Input::Prompt(p)) => Ok(Input::Raw(p.clone())),
        None => Err(Status::invalid_argument("request has no input")),
    }
}

/// A chat as the engine takes it: tools and each call's arguments parsed from their JSON
/// text (the router checked them; a malformed one is refused here too).
fn chat_of(c: &pb::ChatInput) -> Result<Chat, Status> {
    let json = |text: &str, what: &str| {
        serde_json::from_str::<serde_json::Value>(text)
            .map_err(|e| Status::invalid_argument(format!("{what} is not JSON: {e}")))
    };
    let tools = if c.tools.is_empty() {
        None
    } else {
        Some(json(&c.tools, "tools")?).filter(|t| t.as_array().is_some_and(|a| !a.is_empty()))
    };
    let messages = c
        .messages
        .iter()
        .map(|m| {
            Ok(ChatMessage {
                role: m.role.clone(),
                content: m.content.clone(),
                tool_calls: m
                    .tool_calls
                    .iter()
                    .map(|t| {
                        Ok(ToolCall {
                            id: t.id.clone(),
                            name: t.name.clone(),
                            arguments: json(&t.arguments, "a tool call's arguments")?,
                        })
                    })
                    .collect::<Result<_, Status>>()?,
                tool_call_id: (!m.tool_call_id.is_empty()).then(|| m.tool_call_id.clone()),
            })
        })
        .collect::<Result<_, Status>>()?;
    Ok(Chat { messages, tools })
}

/// A request's prompt tokens and the answer's token budget (`max_tokens` 0: up to the
/// context, or to what `kv_budget_bytes` leaves, when not 0), refused when prompt and
/// answer would need more KV than `kv_budget_bytes` (the decode node's budget).
///
/// # Errors
/// No input, the template or tokenizer failed, or the budget is exceeded.
pub async fn prompt_of(
    engine: &Engine,
    req: &pb::PrefillRequest,
    kv_budget_bytes: u64,
) -> Result<(Vec<i32>, u32), Status> {
    let tokens = engine
        .tokenize(engine_input(req)?)
        .await
        .map_err(|e| status(&e))?;
    let info = engine.info();
    let mut max = if req.max_tokens == 0 {
        info.n_ctx.saturating_sub(tokens.len() as u32).max(1)
    } else {
        req.max_tokens
    };
    if kv_budget_bytes > 0 {
        let per = info.kv_bytes_per_token.max(1);
        let fit = kv_budget_bytes / per;
        if req.max_tokens == 0 {
            // "As long as it fits": cap the answer at what the budget allows.
            max =
                max.min(u32::try_from(fit.saturating_sub(tokens.len() as u64)).unwrap_or(u32::MAX));
        }
        let need = (tokens.len() as u64 + u64::from(max)) * per;
        if need > kv_budget_bytes || max == 0 {
            return Err(error::status(
                tonic::Code::InvalidArgument,
                ErrorCode::KvBudgetExceeded,
                format!(
                    "the decode node's KV memory budget is {kv_budget_bytes} bytes ({fit} tokens at {per} bytes/token); \
                     this request needs {need} bytes ({} prompt + {max} completion tokens)",
                    tokens.len()
                ),
            ));
        }
    }
    Ok((tokens, max))
}

/// A request's sampling parameters (the defaults when it has none).
#[must_use]
pub fn sampling_of(req: &pb::PrefillRequest) -> SamplingParams {
    req.sampling
        .as_ref()
        .map(SamplingParams::from)
        .unwrap_or_default()
}

/// How a request's prompt may reuse a node's cache: it continues a conversation the node
/// holds, as llama-server's `cache_prompt` does (a slot keeps decoded tokens only of an
/// answer that ended on that node, so this computes what one device continuing the same
/// conversation computes: ARCHITECTURE.md, "The prefix cache changes no answer it should
/// not"), unless it asked for none.
#[must_use]
pub fn reuse_of(req: &pb::PrefillRequest) -> crate::Reuse {
    if req.no_cache {
        crate::Reuse::None
    } else {
        crate::Reuse::Conversation
    }
}

/// Maps an engine error to a gRPC status whose metadata names the error for the router.
#[must_use]
pub fn status(e: &EngineError) -> tonic::Status {
    use tonic::Code as G;
    use ErrorCode as C;
    let (grpc, code) = match e {
        EngineError::ContextOverflow { .. } => (G::InvalidArgument, C::ContextLengthExceeded),
        EngineError::EmptyPrompt => (G::InvalidArgument, C::EmptyPrompt),
        EngineError::Template(_) => (G::InvalidArgument, C::TemplateError),
        EngineError::Grammar(_) => (G::InvalidArgument, C::GrammarError),
        EngineError::Import(_) => (G::Internal, C::ImportFailed),
        EngineError::TailBase(_) => (G::FailedPrecondition, C::TailBaseMissing),
        EngineError::Export(_) => (G::Internal, C::ExportFailed),
        EngineError::Busy { .. } => (G::Unavailable, C::EngineBusy),
        // Held, but the new part is longer than the caller's bound: the caller may send
        // only that part's KV from elsewhere (a tail handoff).
        EngineError::NotCached { cached, .. } if *cached > 0 => {
            (G::FailedPrecondition, C::UncachedPartTooLong)
        }
        EngineError::NotCached { .. } => (G::FailedPrecondition, C::NotCached),
        EngineError::Closed | EngineError::Load { .. } | EngineError::Decode(_) => {
            (G::Internal, C::EngineError)
        }
    };
    error::status(grpc, code, e.to_string())
}

/// Turns engine events into the gRPC token stream. Dropping the stream drops the engine's
/// receiver, which cancels the generation.
pub fn token_events(
    mut rx: mpsc::UnboundedReceiver<GenEvent>,
) -> impl Stream<Item = Result<pb::TokenEvent, Status>> + Send {
    spawn_stream(
        move |tx: mpsc::Sender<Result<pb::TokenEvent, Status>>| async move {
            while let Some(ev) = rx.recv().await {
                let msg = match ev {
                    GenEvent::Token(t) => Ok(pb::TokenEvent {
                        event: Some(pb::token_event::Event::Token(t.into())),
                    }),
                    GenEvent::Prefilled {
                        prompt_tokens,
                        cached_tokens,
                        prefill_ms,
                    } => Ok(pb::TokenEvent {
                        event: Some(pb::token_event::Event::Prefilled(pb::Prefilled {
                            prompt_tokens,
                            prefill_ms,
                            cached_tokens,
                        })),
                    }),
                    GenEvent::Done(s) => Ok(pb::TokenEvent {
                        event: Some(pb::token_event::Event::Finished(finished(&s))),
                    }),
                    GenEvent::Error(e) => Err(status(&e)),
                };
                if tx.send(msg).await.is_err() {
                    return; // client went away: dropping `rx` cancels the generation
                }
            }
        },
    )
}

/// The `Finished` message for a generation summary.
#[must_use]
pub fn finished(s: &crate::GenSummary) -> pb::Finished {
    let reason = match s.finish {
        crate::Finish::Stop => pb::FinishReason::Stop,
        _ => pb::FinishReason::Length,
    };
    pb::Finished {
        reason: reason as i32,
        generated: s.generated,
        decode_ms: s.decode_ms,
        import_ms: s.import_ms,
        prompt_tokens: s.prompt_tokens,
        prefill_ms: s.prefill_ms,
        // Filled in by the decode node, which received the state.
        receive_ms: 0.0,
        verify_ms: 0.0,
    }
}

/// Runs `f` with a channel's sender in a task and returns the receiving stream.
fn spawn_stream<T, F, Fut>(f: F) -> ReceiverStream<T>
where
    T: Send + 'static,
    F: FnOnce(mpsc::Sender<T>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(f(tx));
    ReceiverStream::new(rx)
}
