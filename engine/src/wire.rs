//! Conversions between the engine's types and the wire types of `edgesplit-proto`.

use edgesplit_proto::frame::Identity;
use edgesplit_proto::pb;

use std::future::Future;

use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::Status;

use crate::{EngineError, GenEvent, ModelInfo, SamplingParams, TokenLogprobs, TokenOut};

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

    /// The node's info reply, without the per-node counters.
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
            has_chat_template: self.has_chat_template,
            flash_attn: self.flash_attn,
            type_k: self.type_k,
            type_v: self.type_v,
            parallel: self.parallel,
            ..Default::default()
        }
    }
}

impl From<&pb::Sampling> for SamplingParams {
    fn from(s: &pb::Sampling) -> Self {
        SamplingParams {
            temperature: s.temperature,
            top_p: s.top_p,
            top_k: s.top_k,
            min_p: s.min_p,
            seed: s.seed,
            repeat_penalty: s.repeat_penalty,
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            penalty_last_n: s.penalty_last_n,
            logprobs: s.logprobs,
            json_schema: (!s.json_schema.is_empty()).then(|| s.json_schema.as_str().into()),
        }
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

/// gRPC metadata key carrying a stable, machine-readable error code.
pub const ERROR_CODE_KEY: &str = "x-edgesplit-error";

/// Maps an engine error to a gRPC status whose metadata names the error for the router.
#[must_use]
pub fn status(e: &EngineError) -> tonic::Status {
    let (code, name) = match e {
        EngineError::ContextOverflow { .. } => {
            (tonic::Code::InvalidArgument, "context_length_exceeded")
        }
        EngineError::EmptyPrompt => (tonic::Code::InvalidArgument, "empty_prompt"),
        EngineError::Template(_) => (tonic::Code::InvalidArgument, "template_error"),
        EngineError::Grammar(_) => (tonic::Code::InvalidArgument, "grammar_error"),
        EngineError::Import(_) => (tonic::Code::Internal, "import_failed"),
        EngineError::Export(_) => (tonic::Code::Internal, "export_failed"),
        EngineError::Busy { .. } => (tonic::Code::Unavailable, "engine_busy"),
        EngineError::Closed | EngineError::Load { .. } | EngineError::Decode(_) => {
            (tonic::Code::Internal, "engine_error")
        }
    };
    status_with_code(code, name, e.to_string())
}

/// A status with the EdgeSplit error name in its metadata.
#[must_use]
pub fn status_with_code(code: tonic::Code, name: &str, message: String) -> tonic::Status {
    let mut st = tonic::Status::new(code, message);
    if let Ok(v) = name.parse() {
        st.metadata_mut().insert(ERROR_CODE_KEY, v);
    }
    st
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
                        prefill_ms,
                    } => Ok(pb::TokenEvent {
                        event: Some(pb::token_event::Event::Prefilled(pb::Prefilled {
                            prompt_tokens,
                            prefill_ms,
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
