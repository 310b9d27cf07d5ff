//! Drives one request through the nodes, turning their streams into one stream of
//! [`Event`]s. This file is the dispatcher: [`Backend::start`] resolves the request's
//! transport to a [`Route`] (or lets `auto` choose one, `choice`) and [`Backend::run`]
//! starts that route's path.
//!
//! The routes: `colocated` (the whole answer on one node: `local` and `layers` on the
//! prefill node, `phone` and a held conversation's next turn on the decode node),
//! `handoff` (a split's start: the decode node's `Info`, the prefill with its handoff, a
//! held conversation tried on the decode node first) and `split` (a split answer after its
//! first token: the live switch, the handoff after the answer, the state kept), with
//! `fallback` (finishing on the prefill node) and `conversation` (transcripts, replays).
//!
//! Beneath them: `seam` (the calls to the nodes, behind two traits, implemented over gRPC;
//! `fake` scripts them for the unit tests in `tests`), `stream` (reading a node's
//! stream), `event` (what a request produces), `failure` (why it failed, without HTTP),
//! `nodes` (what the router knows of the nodes), `load` (the work queued on each node),
//! `probe` (the devices and the link measured at start and at idle moments), `route`
//! (where and how a request runs, one type) and `cost` (what each route is predicted to
//! take).
//!
//! Architecture invariant: the first token is forwarded as soon as the prefill node sends
//! it; the KV handoff and the decode call happen after, concurrently with the client
//! already reading the answer.

mod choice;
mod colocated;
mod conversation;
pub mod cost;
mod event;
mod failure;
#[cfg(test)]
mod fake;
mod fallback;
mod handoff;
mod load;
mod nodes;
mod pool;
#[cfg(test)]
mod pool_tests;
mod probe;
mod qualify;
#[cfg(test)]
mod replay_tests;
mod route;
mod seam;
mod split;
mod stream;
#[cfg(test)]
mod tests;

use std::sync::Arc;
use std::time::Duration;

use edgesplit_proto::auth::GrpcCredentials;
use edgesplit_proto::link::Link;
use edgesplit_proto::pb;

pub use choice::ContinueOn;
use choice::HeldFirst;
pub use event::{Event, FinishReason, Node, PrefilledOn, Started};
pub use failure::{Class, Code, Failure, RouterCode};
pub use fallback::Fallback;
use load::Load;
pub use nodes::HealthInfos;
use nodes::{Known, Learned};
pub use pool::{best, refusal, Candidate, NodeState, Pool, WATCH_EVERY};
pub use probe::{Probe, CALIBRATION_WAIT, IDLE_TICK};
pub use qualify::Qualified;
pub use route::{Route, Wire};
pub use seam::{DecodeCalls, Events, GrpcDecode, GrpcPrefill, PrefillCalls};

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

/// The two nodes, and what the router knows of them.
#[derive(Clone)]
pub struct Backend {
    prefill: Arc<dyn PrefillCalls>,
    decode: Arc<dyn DecodeCalls>,
    config: BackendConfig,
    /// The nodes' last `Info` answers: a split request starts its prefill towards the
    /// decode node's addresses while its own `Info` call is on the way
    /// ([`Backend::start_split`]); the prefill node's is kept fresh by the router's
    /// refresher (`lib.rs`) for requests to read ([`Backend::prefill_info_fresh`]).
    known: Arc<Known>,
    /// `/health`'s last answers from both nodes, and when they came (`infos_within`).
    health_infos: Arc<tokio::sync::Mutex<Option<(std::time::Instant, HealthInfos)>>>,
    learned: Arc<std::sync::Mutex<Learned>>,
    /// The answers running on each node.
    load: Arc<Load>,
    /// The calibration at start is done (`probe.rs`; at once when probes are off).
    calibrated: Arc<tokio::sync::watch::Sender<bool>>,
    /// The decode node's link key: empty for the household's secret, else the id of the
    /// device that joined with a code (`join.rs`), which each handoff names to the
    /// prefill node.
    decode_key: String,
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backend")
            .field("prefill", &self.config.prefill_url)
            .field("decode", &self.config.decode_url)
            .finish_non_exhaustive()
    }
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

pub(super) fn input_param(input: &Input) -> &'static str {
    match input {
        Input::Chat(_) => "messages",
        Input::Prompt(_) => "prompt",
    }
}

impl Backend {
    /// gRPC clients of the nodes `config` names, with lazily connected channels.
    ///
    /// # Errors
    /// A malformed URL.
    pub fn new(config: BackendConfig) -> anyhow::Result<Self> {
        let prefill = GrpcPrefill::new(
            config
                .link
                .grpc_channel(&config.prefill_url, config.connect_timeout)?,
            GrpcCredentials(config.link.secret_arc()),
        );
        let decode = GrpcDecode::new(
            config
                .link
                .grpc_channel(&config.decode_url, config.connect_timeout)?,
            GrpcCredentials(config.link.secret_arc()),
        );
        Ok(Self::with_nodes(
            config,
            Arc::new(prefill),
            Arc::new(decode),
        ))
    }

    /// The router's backend over the nodes `prefill` and `decode` answer for (gRPC
    /// clients, or scripted nodes in unit tests); `config`'s URLs only name them.
    pub fn with_nodes(
        config: BackendConfig,
        prefill: Arc<dyn PrefillCalls>,
        decode: Arc<dyn DecodeCalls>,
    ) -> Self {
        Self {
            prefill,
            decode,
            calibrated: Arc::new(tokio::sync::watch::channel(!config.probes).0),
            config,
            known: Arc::default(),
            health_infos: Arc::default(),
            learned: Arc::default(),
            load: Arc::default(),
            decode_key: String::new(),
        }
    }

    /// The pair of the same prefill node with another decode node, `decode`, reached at
    /// `decode_url` (a pool's next member, `pool.rs`): the prefill node's client and its
    /// queue of work are this pair's; the decode node's `Info`, figures, load and held
    /// conversations its own.
    #[must_use]
    pub fn beside(&self, decode_url: String, decode: Arc<dyn DecodeCalls>) -> Self {
        let config = BackendConfig {
            decode_url,
            ..self.config.clone()
        };
        Self {
            prefill: self.prefill.clone(),
            decode,
            calibrated: Arc::new(tokio::sync::watch::channel(!config.probes).0),
            config,
            known: Arc::new(Known::beside(&self.known)),
            health_infos: Arc::default(),
            learned: Arc::new(std::sync::Mutex::new(nodes::lock(&self.learned).beside())),
            load: Arc::new(Load::beside(&self.load)),
            decode_key: String::new(),
        }
    }

    /// This pair with its decode node reached under the link key of the joined device
    /// `device` ([`Link::device`]).
    #[must_use]
    pub fn keyed(mut self, device: &str) -> Self {
        self.decode_key = device.to_string();
        self
    }

    /// A gRPC client of the decode node at `url`, over this backend's link, or the joined
    /// device `device`'s link when it is not empty.
    ///
    /// # Errors
    /// A malformed URL.
    pub fn grpc_decode(&self, url: &str, device: &str) -> anyhow::Result<Arc<dyn DecodeCalls>> {
        let link = self.config.link.device(device)?;
        Ok(Arc::new(GrpcDecode::new(
            link.grpc_channel(url, self.config.connect_timeout)?,
            GrpcCredentials(link.secret_arc()),
        )))
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
        self.run_held(req, route, request_id, HeldFirst::ByRule)
            .await
    }

    /// [`Backend::run`], a split continuing a conversation the decode node holds going
    /// first where `first` says ([`Backend::held_turn`]).
    async fn run_held(
        &self,
        req: &ValidRequest,
        route: Route,
        request_id: &str,
        first: HeldFirst,
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
                self.start_split(req, (Transport::V2, HandoffMode::Live), request_id, first)
                    .await
            }
            Route::After(wire) => {
                self.start_split(
                    req,
                    (wire.transport(), HandoffMode::After),
                    request_id,
                    first,
                )
                .await
            }
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
                RouterCode::Timeout,
                "the prefill node did not produce a first token in time",
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
