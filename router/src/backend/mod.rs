//! Drives one request through the nodes: gRPC to the prefill node, then (V2) to the decode
//! node, turning their streams into one stream of [`Event`]s.
//!
//! A request's path reads top to bottom here: [`Backend::start`] picks the path of its
//! transport; a split request ([`Backend::start_split`]) first asks `choice` whether a
//! conversation goes on on the decode node, then starts the prefill with its handoff and
//! hands the answer to `split`'s state machine. The rooms: `event` (what a request
//! produces), `failure` (why it failed, without HTTP), `nodes` (what the router knows of
//! the nodes), `load` (the work queued on each node), `probe` (the devices and the link
//! measured at start and at idle moments), `route` (where and how a request runs, one
//! type), `choice` (which route),
//! `conversation` (transcripts and replays), `split` (a split answer after its first
//! token), `fallback` (finishing on the prefill node), `stream` (reading a node's stream).
//!
//! Architecture invariant: the first token is forwarded as soon as the prefill node sends
//! it; the KV handoff and the decode call happen after, concurrently with the client
//! already reading the answer.

mod choice;
mod conversation;
pub mod cost;
mod event;
mod failure;
mod fallback;
mod load;
mod nodes;
mod probe;
mod route;
mod split;
mod stream;

use std::sync::Arc;
use std::time::Duration;

use edgesplit_proto::auth::GrpcCredentials;
use edgesplit_proto::link::Link;
use edgesplit_proto::pb;
use edgesplit_proto::pb::decode_client::DecodeClient;
use edgesplit_proto::pb::prefill_client::PrefillClient;
use tokio::sync::mpsc;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

pub use choice::ContinueOn;
use conversation::Transcript;
pub use event::{Event, FinishReason, Node, PrefilledOn, Started};
pub use failure::{Class, Failure};
pub use fallback::Fallback;
use load::{answer_tokens, Counted, Load, Work};
pub use nodes::HealthInfos;
use nodes::{lock, lock_info, Learned};
pub use probe::{Probe, CALIBRATION_WAIT, IDLE_TICK};
pub use route::{Route, Wire};
use split::SplitAnswer;
use stream::{forward_prefill_node, next_event};

/// A node channel that adds the shared-secret credential to every call.
type Authed = InterceptedService<Channel, GrpcCredentials>;

use crate::api::{HandoffMode, Input, Transport, ValidRequest};
use crate::tools::Tools;

/// How the nodes are reached.
#[derive(Debug, Clone)]
pub struct BackendConfig {
    pub prefill_url: String,
    pub decode_url: String,
    /// TCP connect bound for gRPC channels.
    pub connect_timeout: Duration,
    /// Bound on `Info` calls (health, decode reachability before a V2 request).
    pub info_timeout: Duration,
    /// Bound on the wait for the first token (prefill of a long prompt included).
    pub first_token_timeout: Duration,
    /// When the handoff or the decode node fails, finish the answer on the prefill node
    /// (else end it with the error).
    pub fallback: bool,
    /// Longest wait for the next token of a streaming answer.
    pub token_idle_timeout: Duration,
    /// When the decode node fails while the handoff's outcome is still unknown: how long
    /// to wait for that outcome, whose error explains the failure better.
    pub handoff_error_grace: Duration,
    /// When the decode node ends the answer before the prefill node reported the handoff:
    /// how long to wait for that report (its figures go into the response).
    pub handoff_report_wait: Duration,
    /// The handoff mode of split answers whose request does not name one.
    pub handoff: HandoffMode,
    /// Where a new turn of a held conversation is prefilled.
    pub continue_on: ContinueOn,
    /// What `transport: "auto"` optimizes when the request does not say.
    pub objective: crate::api::Objective,
    /// The link to the nodes: TLS keyed by the shared secret when one is configured, whose
    /// secret also signs every call's credential.
    pub link: Link,
    /// The router measures the devices and the link with probes of its own, at start and
    /// at idle moments (`probe.rs`); else only through the answers it serves.
    pub probes: bool,
}

/// gRPC clients of the two nodes.
#[derive(Clone)]
pub struct Backend {
    prefill: PrefillClient<Authed>,
    decode: DecodeClient<Authed>,
    config: BackendConfig,
    /// The decode node's `Info` as last answered: a split request starts its prefill
    /// towards these addresses while its own `Info` call is on the way ([`Backend::start`]).
    last_decode_info: Arc<std::sync::Mutex<Option<pb::NodeInfo>>>,
    /// The prefill node's `Info` as last answered, and when (kept fresh by the router's
    /// refresher, `lib.rs`; a request reads it, [`Backend::prefill_info_fresh`]).
    last_prefill_info: Arc<std::sync::Mutex<Option<pb::NodeInfo>>>,
    /// When `last_prefill_info` came.
    prefill_info_at: Arc<std::sync::Mutex<Option<std::time::Instant>>>,
    /// `/health`'s last answers from both nodes, and when they came (`infos_within`).
    health_infos: Arc<tokio::sync::Mutex<Option<(std::time::Instant, HealthInfos)>>>,
    learned: Arc<std::sync::Mutex<Learned>>,
    /// The answers running on each node.
    load: Arc<Load>,
    /// The calibration at start is done (`probe.rs`; at once when probes are off).
    calibrated: Arc<tokio::sync::watch::Sender<bool>>,
}

/// A request's input as the nodes take it (the opposite of the engine's `engine_input`).
fn wire_input(input: &Input, tools: Option<&Tools>) -> pb::prefill_request::Input {
    match input {
        Input::Chat(msgs) => pb::prefill_request::Input::Chat(pb::ChatInput {
            messages: msgs
                .iter()
                .map(|m| pb::ChatMessage {
                    role: m.role.clone(),
                    content: m.content.clone(),
                    tool_calls: m
                        .tool_calls
                        .iter()
                        .map(|c| pb::ToolCall {
                            id: c.id.clone(),
                            name: c.name.clone(),
                            arguments: c.arguments.clone(),
                        })
                        .collect(),
                    tool_call_id: m.tool_call_id.clone().unwrap_or_default(),
                })
                .collect(),
            tools: tools.map(|t| t.json.clone()).unwrap_or_default(),
        }),
        Input::Prompt(p) => pb::prefill_request::Input::Prompt(p.clone()),
    }
}

/// Where a split request's state goes on the decode node `info` describes.
fn target(info: &pb::NodeInfo, transport: Transport) -> (&str, pb::HandoffTransport) {
    if transport == Transport::V1 {
        (&info.v1_url, pb::HandoffTransport::V1)
    } else {
        (&info.handoff_addr, pb::HandoffTransport::V2)
    }
}

pub(super) fn input_param(input: &Input) -> &'static str {
    match input {
        Input::Chat(_) => "messages",
        Input::Prompt(_) => "prompt",
    }
}

impl Backend {
    /// Clients with lazily connected channels.
    ///
    /// # Errors
    /// A malformed URL.
    pub fn new(config: BackendConfig) -> anyhow::Result<Self> {
        Ok(Self {
            prefill: PrefillClient::with_interceptor(
                config
                    .link
                    .grpc_channel(&config.prefill_url, config.connect_timeout)?,
                GrpcCredentials(config.link.secret_arc()),
            ),
            decode: DecodeClient::with_interceptor(
                config
                    .link
                    .grpc_channel(&config.decode_url, config.connect_timeout)?,
                GrpcCredentials(config.link.secret_arc()),
            ),
            calibrated: Arc::new(tokio::sync::watch::channel(!config.probes).0),
            config,
            last_decode_info: Arc::default(),
            last_prefill_info: Arc::default(),
            prefill_info_at: Arc::default(),
            health_infos: Arc::default(),
            learned: Arc::default(),
            load: Arc::default(),
        })
    }

    /// Starts `req` on `transport`; returns once the first token (or an error) is known.
    ///
    /// # Errors
    /// The request's failure before its first token, as the client should see it.
    pub async fn start(
        &self,
        req: &ValidRequest,
        transport: Transport,
        request_id: &str,
    ) -> Result<Started, Failure> {
        match Route::named(transport, req.handoff, self.config.handoff)? {
            Some(route) => self.run(req, route, request_id).await,
            None => self.start_auto(req, request_id).await,
        }
    }

    /// Starts `req` on `route` (named by the request, or chosen by `auto`).
    async fn run(
        &self,
        req: &ValidRequest,
        route: Route,
        request_id: &str,
    ) -> Result<Started, Failure> {
        match route {
            Route::Local => self.start_local(req, request_id, None, true).await,
            Route::Phone => {
                self.on_decode_node(req, Transport::Phone, request_id, None)
                    .await
            }
            Route::Layers => {
                self.layer_split_serving().await?;
                let mut started = self.start_local(req, request_id, None, false).await?;
                started.transport = Transport::Layers;
                Ok(started)
            }
            Route::Live => {
                self.start_split(req, Transport::V2, HandoffMode::Live, request_id)
                    .await
            }
            Route::After(wire) => {
                self.start_split(req, wire.transport(), HandoffMode::After, request_id)
                    .await
            }
        }
    }

    /// The colocated path. `fallback`: the split path could not start (the cause), so
    /// this answer is a fallback and reports it first. `measure`: the answer's decode speed
    /// is the prefill node's own (not a layer split's).
    async fn start_local(
        &self,
        req: &ValidRequest,
        request_id: &str,
        fallback: Option<String>,
        measure: bool,
    ) -> Result<Started, Failure> {
        let busy = self
            .load
            .take_work(&self.learned, false, Work::of(req, &self.learned));
        let param = input_param(&req.input);
        let mut client = self.prefill.clone();
        let preq = Self::prefill_request(req, request_id, None, 0);
        let mut stream = self
            .first_within(async { client.generate(preq).await }, param)
            .await?
            .into_inner();
        let p = self
            .prefilled(&mut stream, param, "the prefill node")
            .await?;
        busy.prefilled(&self.learned, Work::answer_of(req, &self.learned));
        let (tx, rx) = mpsc::channel(64);
        let idle = self.config.token_idle_timeout;
        if let Some(cause) = fallback {
            let _ = tx.send(Event::Fallback { cause }).await;
        }
        if measure {
            lock(&self.learned).rates.prefilled(
                false,
                p.prompt_tokens.saturating_sub(p.cached_tokens),
                p.prefill_ms,
            );
        }
        let counted = measure.then(|| Counted {
            learned: self.learned.clone(),
            busy,
        });
        tokio::spawn(async move {
            forward_prefill_node(stream, &tx, false, idle, param, counted).await;
        });
        Ok(Started {
            transport: Transport::Local,
            choice: None,
            prompt_tokens: Some(p.prompt_tokens),
            cached_tokens: Some(p.cached_tokens),
            prefill_ms: Some(p.prefill_ms),
            placement: PrefilledOn::PrefillNode,
            events: rx,
        })
    }

    /// The whole request on the decode node: what it holds of the prompt is reused, the
    /// rest prefilled there (refused with `not_cached` when that is over `max_uncached`),
    /// and the answer written there; only tokens cross. Lost mid-answer, it is finished on
    /// the prefill node as any answer the decode node writes.
    async fn on_decode_node(
        &self,
        req: &ValidRequest,
        transport: Transport,
        request_id: &str,
        max_uncached: Option<u32>,
    ) -> Result<Started, Failure> {
        let busy = self
            .load
            .take_work(&self.learned, true, Work::of(req, &self.learned));
        let param = input_param(&req.input);
        let mut preq = Self::prefill_request(req, request_id, None, 0);
        preq.max_uncached = max_uncached;
        let mut client = self.decode.clone();
        // A conversation's new turn: the call is answered once the node has tokenized the
        // prompt and taken a slot, which on an idle node is at once; a node that does not
        // answer is bounded like an `Info`, and the request is split instead. The phone
        // alone (no bound on what it prefills) is committed to this node: it waits as a
        // first token does (a busy phone answers the call only when a slot is free).
        let bound = if max_uncached.is_some() {
            self.config.info_timeout
        } else {
            self.config.first_token_timeout
        };
        let call = tokio::time::timeout(bound, client.local(preq)).await;
        let mut stream = match call {
            Ok(r) => r.map_err(|st| {
                Failure::from_status_of(&st, param, ("decode_unavailable", "the decode node"))
            })?,
            Err(_) => {
                return Err(Failure::unavailable(
                    "decode_unavailable",
                    format!("the decode node did not answer within {bound:?}"),
                ))
            }
        }
        .into_inner();
        let p = self
            .prefilled(&mut stream, param, "the decode node")
            .await?;
        busy.prefilled(&self.learned, Work::answer_of(req, &self.learned));
        lock(&self.learned).rates.prefilled(
            true,
            p.prompt_tokens.saturating_sub(p.cached_tokens),
            p.prefill_ms,
        );
        tracing::info!(
            request_id,
            prompt_tokens = p.prompt_tokens,
            cached_tokens = p.cached_tokens,
            max_uncached,
            "the decode node prefills and writes this answer"
        );
        let (tx, rx) = mpsc::channel(64);
        let transcript = Transcript {
            learned: self.learned.clone(),
            input: req.input.clone(),
            prompt_tokens: p.prompt_tokens,
            text: Vec::new(),
            tokens: Vec::new(),
            replay: self.replay(req, request_id),
            written_on_prefill_node: false,
        };
        let fallback = self.fallback(req, request_id);
        let idle = self.config.token_idle_timeout;
        let counted = Counted {
            learned: self.learned.clone(),
            busy,
        };
        tokio::spawn(async move {
            forward_decode_node(stream, tx, transcript, fallback, idle, param, counted).await;
        });
        Ok(Started {
            transport,
            choice: None,
            prompt_tokens: Some(p.prompt_tokens),
            cached_tokens: Some(p.cached_tokens),
            prefill_ms: Some(p.prefill_ms),
            placement: PrefilledOn::DecodeNode,
            events: rx,
        })
    }

    /// A split request. The decode node's `Info` (is it there, where does the state go, its
    /// KV budget) and the prefill overlap: the prefill starts at once towards the addresses
    /// of the last `Info` answered, and stands only if this request's own `Info` agrees;
    /// if that `Info` fails or names another address or budget, the early prefill is
    /// dropped (which cancels it) and the request goes on as it would without it. So a
    /// split request does not wait one round trip of the link before its prefill, and
    /// decides as it would after that round trip.
    ///
    /// First, when the request continues a conversation the decode node holds, the decode
    /// node may prefill the new part itself ([`Backend::continue_on_decode_node`]); when it
    /// refuses or cannot, the request is split as any other, in handoff `mode` over
    /// `transport` (v2 or v1; a [`Route`]'s).
    async fn start_split(
        &self,
        req: &ValidRequest,
        transport: Transport,
        mode: HandoffMode,
        request_id: &str,
    ) -> Result<Started, Failure> {
        let param = input_param(&req.input);
        let base_max = match self.held_turn(req, transport, request_id).await {
            Ok(started) => return Ok(started),
            Err(base_max) => base_max,
        };
        let (laptop_work, written_while_crossing) = self.split_work(req, mode);
        let laptop = self.load.take_work(&self.learned, false, laptop_work);
        let last = lock_info(&self.last_decode_info).clone();
        let tried_early = last
            .as_ref()
            .is_some_and(|l| !target(l, transport).0.is_empty());
        let (decode_info, early) = match last {
            Some(last) if tried_early => {
                let info = self.decode_info();
                let early = self.split_prefill(
                    req,
                    request_id,
                    request_id,
                    (transport, mode),
                    &last,
                    base_max,
                );
                tokio::pin!(info, early);
                let mut done = None;
                let info = loop {
                    tokio::select! {
                        i = &mut info => break i,
                        e = &mut early, if done.is_none() => done = Some(e),
                    }
                };
                match &info {
                    Ok(i)
                        if target(i, transport) == target(&last, transport)
                            && i.kv_budget_bytes == last.kv_budget_bytes =>
                    {
                        let e = match done {
                            Some(e) => e,
                            None => early.await,
                        };
                        (info, Some(e))
                    }
                    _ => (info, None),
                }
            }
            _ => (self.decode_info().await, None),
        };
        // No decode node to take the answer (asleep, gone, draining): answer here under
        // the fallback policy, else refuse before prefilling.
        let decode_info = match decode_info {
            Ok(i) => i,
            Err(e) if self.config.fallback && e.code.as_deref() == Some("decode_unavailable") => {
                return self
                    .answer_here_instead(req, request_id, &e, transport)
                    .await;
            }
            Err(e) => return Err(e),
        };
        // A dropped early prefill may have reached the decode node under the request's id:
        // the new one takes another.
        let handoff_id = if tried_early && early.is_none() {
            format!("{request_id}-2")
        } else {
            request_id.to_string()
        };
        let (pstream, first) = match early {
            Some(e) => e?,
            None => {
                self.split_prefill(
                    req,
                    request_id,
                    &handoff_id,
                    (transport, mode),
                    &decode_info,
                    base_max,
                )
                .await?
            }
        };
        lock(&self.learned).rates.prefilled(
            false,
            first.prompt_tokens.saturating_sub(first.cached_tokens),
            first.prefill_ms,
        );
        laptop.prefilled(&self.learned, Work::answer(written_while_crossing));
        let (tx, rx) = mpsc::channel(64);
        let started = Started {
            transport,
            prompt_tokens: Some(first.prompt_tokens),
            cached_tokens: Some(first.cached_tokens),
            prefill_ms: Some(first.prefill_ms),
            placement: PrefilledOn::PrefillNode,
            choice: None,
            events: rx,
        };
        let greq = pb::GenerateRequest {
            request_id: request_id.to_string(),
            handoff_id,
            sampling: Some((&req.sampling).into()),
            max_new_tokens: first.max_tokens.saturating_sub(1),
            first_token: Some(first.token),
            answered: 1,
            base_tokens: Vec::new(),
            base_digest: Vec::new(),
        };
        let fallback = self.fallback(req, request_id);
        let transcript = Transcript {
            learned: self.learned.clone(),
            input: req.input.clone(),
            prompt_tokens: first.prompt_tokens,
            text: Vec::new(),
            tokens: Vec::new(),
            replay: self.replay(req, request_id),
            written_on_prefill_node: false,
        };
        let split = SplitAnswer {
            transcript: Some(transcript),
            learned: self.learned.clone(),
            // Every token the client has been sent, the first included.
            sent: vec![first.token],
            first,
            decode: self.decode.clone(),
            generate: greq,
            tx,
            idle: self.config.token_idle_timeout,
            handoff_error_grace: self.config.handoff_error_grace,
            handoff_report_wait: self.config.handoff_report_wait,
            param,
            mode,
            keep: self.keeps(req, mode),
            load: self.load.clone(),
            laptop: Some(laptop),
            phone: None,
            answer_tokens: answer_tokens(req, &self.learned),
            first_sent: std::time::Instant::now(),
        };
        tokio::spawn(split.run(pstream, fallback));
        Ok(started)
    }

    /// Starts the prefill of a split request with its state going to the decode node
    /// `info` describes; returns the stream once its first token is known.
    async fn split_prefill(
        &self,
        req: &ValidRequest,
        request_id: &str,
        handoff_id: &str,
        (transport, mode): (Transport, HandoffMode),
        info: &pb::NodeInfo,
        base_max: u32,
    ) -> Result<(tonic::Streaming<pb::PrefillEvent>, pb::FirstToken), Failure> {
        let param = input_param(&req.input);
        let (addr, wire) = target(info, transport);
        if addr.is_empty() {
            return Err(Failure::unavailable(
                "decode_unavailable",
                format!(
                    "the decode node advertises no {} handoff address",
                    transport.as_str()
                ),
            ));
        }
        let preq = Self::prefill_request(
            req,
            request_id,
            Some(pb::Handoff {
                handoff_id: handoff_id.to_string(),
                decode_addr: addr.to_string(),
                transport: wire as i32,
                live: mode == HandoffMode::Live,
                keep: self.keeps(req, mode),
                // The decode node's cached prefix this prompt goes on from, as remembered
                // (it checks the prefix's bytes before it joins the tail on).
                base_max: if self.keeps(req, mode) && wire == pb::HandoffTransport::V2 {
                    base_max
                } else {
                    0
                },
            }),
            info.kv_budget_bytes,
        );
        let mut client = self.prefill.clone();
        let mut pstream = self
            .first_within(async { client.prefill(preq).await }, param)
            .await?
            .into_inner();
        match self.first_within(pstream.message(), param).await? {
            Some(pb::PrefillEvent {
                event: Some(pb::prefill_event::Event::First(f)),
            }) => Ok((pstream, f)),
            _ => Err(Failure::upstream(
                "protocol_error",
                "the prefill node did not send a first token",
            )),
        }
    }

    async fn first_within<T>(
        &self,
        fut: impl std::future::Future<Output = Result<T, tonic::Status>>,
        param: &str,
    ) -> Result<T, Failure> {
        match tokio::time::timeout(self.config.first_token_timeout, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(st)) => Err(Failure::from_status(&st, param)),
            Err(_) => Err(Failure::upstream(
                "timeout",
                "the prefill node did not produce a first token in time",
            )),
        }
    }

    /// A colocated stream's first message, its prefill report.
    async fn prefilled(
        &self,
        stream: &mut tonic::Streaming<pb::TokenEvent>,
        param: &str,
        who: &str,
    ) -> Result<pb::Prefilled, Failure> {
        match self.first_within(stream.message(), param).await? {
            Some(pb::TokenEvent {
                event: Some(pb::token_event::Event::Prefilled(p)),
            }) => Ok(p),
            _ => Err(Failure::upstream(
                "protocol_error",
                format!("{who} did not report its prefill"),
            )),
        }
    }

    fn prefill_request(
        req: &ValidRequest,
        request_id: &str,
        handoff: Option<pb::Handoff>,
        kv_budget_bytes: u64,
    ) -> pb::PrefillRequest {
        pb::PrefillRequest {
            request_id: request_id.to_string(),
            input: Some(wire_input(&req.input, req.tools.as_ref())),
            sampling: Some((&req.sampling).into()),
            max_tokens: req.max_tokens,
            handoff,
            kv_budget_bytes,
            resume_tokens: Vec::new(),
            no_cache: !req.cache_prompt,
            max_uncached: None,
        }
    }
}

/// Forwards the decode node's `Local` stream (a conversation it continues) to the client;
/// remembers the conversation when the decode node ends the answer, and finishes it on the
/// prefill node (`fallback`) when the decode node fails after its first token.
async fn forward_decode_node(
    mut stream: tonic::Streaming<pb::TokenEvent>,
    tx: mpsc::Sender<Event>,
    mut transcript: Transcript,
    fallback: Option<Fallback>,
    idle: Duration,
    param: &'static str,
    counted: Counted,
) {
    let mut sent = Vec::new();
    let failure = loop {
        let ev = next_event(&mut stream, idle, Node::Decode, true, param).await;
        match ev {
            Event::Error(e) => break e,
            Event::Token { id, ref bytes, .. } => {
                sent.push(id);
                transcript.token(id, bytes);
            }
            Event::Finished { .. } => {
                counted.seen(&ev);
                transcript.held_by_decode_node();
                let _ = tx.send(ev).await;
                return;
            }
            _ => {}
        }
        if tx.send(ev).await.is_err() {
            return;
        }
    };
    match fallback {
        // The prefill node rebuilds the prompt's and the answer's KV and goes on.
        // (An answer "up to the context" has no budget the router knows: it ends with the
        // error.)
        Some(fb) if !sent.is_empty() && fb.request.max_tokens > 0 => {
            let total = fb.request.max_tokens;
            fb.resume(failure, sent, total, &tx, idle, param).await;
        }
        _ => {
            let _ = tx.send(Event::Error(failure)).await;
        }
    }
}
