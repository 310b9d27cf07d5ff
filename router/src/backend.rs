//! Drives one request through the nodes: gRPC to the prefill node, then (V2) to the decode
//! node, turning their streams into one stream of [`Event`]s.
//!
//! Architecture invariant: the first token is forwarded as soon as the prefill node sends
//! it; the KV handoff and the decode call happen after, concurrently with the client
//! already reading the answer.

use std::sync::Arc;
use std::time::Duration;

use edgesplit_proto::auth::GrpcCredentials;
use edgesplit_proto::error::ErrorCode;
use edgesplit_proto::link::{HandshakeFailed, Link};
use edgesplit_proto::pb;
use edgesplit_proto::pb::decode_client::DecodeClient;
use edgesplit_proto::pb::prefill_client::PrefillClient;
use tokio::sync::mpsc;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

/// A node channel that adds the shared-secret credential to every call.
type Authed = InterceptedService<Channel, GrpcCredentials>;

use crate::api::{HandoffMode, Input, Transport, ValidRequest};
use crate::error::ApiError;
use crate::placement::{Conversations, Rates};
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
    /// The link to the nodes: TLS keyed by the shared secret when one is configured, whose
    /// secret also signs every call's credential.
    pub link: Link,
}

/// Where a new turn of a conversation the decode node holds is prefilled (`--continue-on`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum ContinueOn {
    /// By the measured rule (`placement::Rates`): on the decode node while that is sooner,
    /// else on the prefill node, shipping only the new part's KV when the prefill node
    /// holds the conversation too.
    #[default]
    Measured,
    /// Always on the prefill node, shipping only the new part's KV (a tail) when it can.
    PrefillNode,
}

/// Why an answer ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
    /// The answer is tool calls (set by the response once it reads them).
    ToolCalls,
}

impl FinishReason {
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::ToolCalls => "tool_calls",
        }
    }
}

/// What a running request produces.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// Prompt prefilled (colocated runs report it before their first token).
    Prefilled {
        prompt_tokens: u32,
        cached_tokens: u32,
        prefill_ms: f64,
    },
    /// One sampled token (an end-of-generation token has empty bytes), with its
    /// log-probabilities when the request asked for them.
    Token {
        id: i32,
        bytes: Vec<u8>,
        logprobs: Option<pb::TokenLogprobs>,
        /// The node that wrote it.
        from: Node,
    },
    /// A split answer's handoff mode (sent first).
    Mode(HandoffMode),
    /// A live handoff completed: the decode node writes the answer after its
    /// `answered`-th token.
    Switched {
        answered: u32,
    },
    /// A live handoff gave up (after sending `bytes`); the answer goes on on the prefill
    /// node.
    HandoffCancelled {
        reason: String,
        bytes: u64,
    },
    /// The KV state reached the decode node.
    Handoff {
        bytes: u64,
        export_ms: f64,
        transfer_ms: f64,
        /// Of `transfer_ms`, as the sender measured it (an `after` handoff only): the
        /// connect and handshake, and the hashing.
        connect_ms: Option<f64>,
        hash_ms: Option<f64>,
    },
    /// The generation ended on the node.
    Finished {
        reason: FinishReason,
        /// Tokens generated by the decoding node (after the first, for V2).
        decode_tokens: u32,
        decode_ms: f64,
        import_ms: f64,
        /// The decode node received (and checked) the state in `receive_ms`, of which
        /// `verify_ms` went to checking it.
        receive_ms: f64,
        verify_ms: f64,
        prompt_tokens: Option<u32>,
        prefill_ms: Option<f64>,
    },
    /// The split failed and the prefill node finishes the answer (`cause`: the failure's
    /// code); the tokens that follow continue the same answer.
    Fallback {
        cause: String,
    },
    Error(ApiError),
}

/// The node a token stream comes from (which wrote a token).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Node {
    Prefill,
    Decode,
}

impl Node {
    /// The name the `edgesplit` object gives it (`first_token_from`).
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Node::Prefill => "prefill",
            Node::Decode => "decode",
        }
    }
}

/// Which node prefilled a request's prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefilledOn {
    PrefillNode,
    /// The decode node, continuing a conversation it held: nothing crossed the link.
    DecodeNode,
}

impl PrefilledOn {
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            PrefilledOn::PrefillNode => "prefill_node",
            PrefilledOn::DecodeNode => "decode_node",
        }
    }
}

/// A request whose first token is known (or whose failure was already mapped).
pub struct Started {
    pub transport: Transport,
    pub prompt_tokens: Option<u32>,
    /// Of the prompt, the tokens whose cached KV was reused.
    pub cached_tokens: Option<u32>,
    pub prefill_ms: Option<f64>,
    pub placement: PrefilledOn,
    pub events: mpsc::Receiver<Event>,
}

/// What the router learns from answers to place the next ones (`placement.rs`).
#[derive(Debug, Default)]
struct Learned {
    conversations: Conversations,
    rates: Rates,
}

/// The text of an answer the decode node may end, kept to remember its conversation.
struct Transcript {
    learned: Arc<std::sync::Mutex<Learned>>,
    input: Input,
    prompt_tokens: u32,
    text: Vec<u8>,
    tokens: Vec<i32>,
    /// Where the prefill node should replay the answer once the decode node ended it.
    replay: Option<Replay>,
    /// The prefill node wrote the whole answer (kept on the decode node after it): both
    /// nodes hold the conversation alike with no replay.
    written_on_prefill_node: bool,
}

/// The prefill node's copy of a conversation the decode node ended: the request as a
/// colocated one, whose answer the prefill node rebuilds step by step and stops
/// (`resume_tokens`, `max_tokens` 0).
struct Replay {
    prefill: PrefillClient<Authed>,
    request: pb::PrefillRequest,
    bound: Duration,
}

impl Transcript {
    fn token(&mut self, id: i32, bytes: &[u8]) {
        self.text.extend_from_slice(bytes);
        self.tokens.push(id);
    }

    /// The decode node ended the answer: it keeps the prompt and every answer token but
    /// the last (sampled, never decoded) as a cached prefix. With `replay`, the prefill
    /// node then rebuilds the same (the prompt as its prefill did, each answer token as
    /// a decode step, the last one not), in the background, so that a later turn can go
    /// there and ship only its new part's KV.
    fn held_by_decode_node(self) {
        let held = (self.prompt_tokens + self.tokens.len() as u32).saturating_sub(1);
        let answer = String::from_utf8_lossy(&self.text).into_owned();
        {
            let mut l = lock(&self.learned);
            l.conversations.record(&self.input, &answer, held);
            if self.written_on_prefill_node {
                l.conversations.replayed(&self.input, &answer);
            }
        }
        let Some(Replay {
            mut prefill,
            mut request,
            bound,
        }) = self.replay
        else {
            return;
        };
        if self.tokens.is_empty() {
            return;
        }
        request.resume_tokens = self.tokens;
        request.max_tokens = 0;
        let (learned, input) = (self.learned, self.input);
        tokio::spawn(async move {
            let request_id = request.request_id.clone();
            let replayed = async { finishes(prefill.generate(request).await?.into_inner()).await };
            match tokio::time::timeout(bound, replayed).await {
                Ok(Ok(true)) => {
                    tracing::info!(%request_id, held, "the prefill node replayed the answer: it holds the conversation too");
                    lock(&learned).conversations.replayed(&input, &answer);
                }
                Ok(Ok(false)) => {
                    tracing::warn!(%request_id, "the prefill node ended the replay without finishing it")
                }
                Ok(Err(e)) => {
                    tracing::warn!(%request_id, error = %e, "the prefill node did not replay the answer")
                }
                Err(_) => {
                    tracing::warn!(%request_id, "the prefill node did not replay the answer within the idle bound")
                }
            }
        });
    }
}

/// Reads a node's token stream (of an answer that writes nothing the client sees) to its
/// end: whether it reported `Finished`.
async fn finishes(mut stream: tonic::Streaming<pb::TokenEvent>) -> Result<bool, tonic::Status> {
    while let Some(ev) = stream.message().await? {
        if let Some(pb::token_event::Event::Finished(_)) = ev.event {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Both nodes' `Info` answers, prefill first.
pub type HealthInfos = (
    Result<pb::NodeInfo, ApiError>,
    Result<pb::NodeInfo, ApiError>,
);

/// Keeps a node's `Info` answer as its last known one; passes the call's result on.
fn remember(
    last: &std::sync::Mutex<Option<pb::NodeInfo>>,
    info: Result<pb::NodeInfo, ApiError>,
) -> Result<pb::NodeInfo, ApiError> {
    if let Ok(i) = &info {
        *lock_info(last) = Some(i.clone());
    }
    info
}

fn lock_info(
    l: &std::sync::Mutex<Option<pb::NodeInfo>>,
) -> std::sync::MutexGuard<'_, Option<pb::NodeInfo>> {
    l.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn lock(l: &std::sync::Mutex<Learned>) -> std::sync::MutexGuard<'_, Learned> {
    // A poisoned lock holds nothing an invariant depends on.
    l.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
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

fn input_param(input: &Input) -> &'static str {
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
            config,
            last_decode_info: Arc::default(),
            last_prefill_info: Arc::default(),
            prefill_info_at: Arc::default(),
            health_infos: Arc::default(),
            learned: Arc::default(),
        })
    }

    /// The prefill node's gRPC URL.
    #[must_use]
    pub fn prefill_url(&self) -> String {
        self.config.prefill_url.clone()
    }

    /// The decode node's gRPC URL.
    #[must_use]
    pub fn decode_url(&self) -> String {
        self.config.decode_url.clone()
    }

    /// The prefill node's info, within the info timeout.
    ///
    /// # Errors
    /// 503 when the node does not answer in time.
    pub async fn prefill_info(&self) -> Result<pb::NodeInfo, ApiError> {
        let mut c = self.prefill.clone();
        let info = self
            .info_within(
                c.info(pb::InfoRequest {}),
                "prefill_unavailable",
                "the prefill node",
            )
            .await;
        if info.is_ok() {
            *self
                .prefill_info_at
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) =
                Some(std::time::Instant::now());
        }
        remember(&self.last_prefill_info, info)
    }

    /// The prefill node's `Info` for a request: the last answer while it is younger than
    /// `max_age` (no call on the request's path), else asked now.
    pub async fn prefill_info_fresh(
        &self,
        max_age: std::time::Duration,
    ) -> Result<pb::NodeInfo, ApiError> {
        let at = *self
            .prefill_info_at
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if at.is_some_and(|at| at.elapsed() < max_age) {
            if let Some(i) = lock_info(&self.last_prefill_info).clone() {
                return Ok(i);
            }
        }
        self.prefill_info().await
    }

    /// The CPU architectures of the nodes that took part in an answer, from their last
    /// `Info` (`Timing::prefill_arch`, `decode_arch`): the prefill node's unless the
    /// decode node prefilled; the decode node's when the state crosses to it or it
    /// prefilled. Unknown (never answered `Info`) or not taking part: `None`.
    #[must_use]
    pub fn archs(
        &self,
        transport: Transport,
        placement: PrefilledOn,
    ) -> (Option<String>, Option<String>) {
        let arch = |l: &std::sync::Mutex<Option<pb::NodeInfo>>| {
            lock_info(l)
                .as_ref()
                .map(|i| i.arch.clone())
                .filter(|a| !a.is_empty())
        };
        let on_decode = placement == PrefilledOn::DecodeNode;
        let prefill = (!on_decode)
            .then(|| arch(&self.last_prefill_info))
            .flatten();
        let decode = (on_decode || matches!(transport, Transport::V1 | Transport::V2))
            .then(|| arch(&self.last_decode_info))
            .flatten();
        (prefill, decode)
    }

    /// Whether the decode node renders `input` as the prefill node does: a raw prompt
    /// always; a chat when both nodes' last `Info` name the same chat template (another
    /// template is another prompt, and the decode node renders the chats it continues).
    fn renders_alike(&self, input: &Input) -> bool {
        if matches!(input, Input::Prompt(_)) {
            return true;
        }
        let template = |l: &std::sync::Mutex<Option<pb::NodeInfo>>| {
            lock_info(l)
                .as_ref()
                .map(|i| i.chat_template_fingerprint.clone())
                .filter(|f| !f.is_empty())
        };
        let prefill = template(&self.last_prefill_info);
        prefill.is_some() && prefill == template(&self.last_decode_info)
    }

    /// A live answer that ends on the prefill node is handed over after it all the same
    /// (`Handoff.keep`) when its conversation may go on on the decode node: a request that
    /// allows its prompt cache, rendered alike by both nodes.
    fn keeps(&self, req: &ValidRequest, mode: HandoffMode) -> bool {
        mode == HandoffMode::Live && req.cache_prompt && self.renders_alike(&req.input)
    }

    /// Whether the prefill node should replay the answers the decode node ends for this
    /// request's conversation (`Transcript::held_by_decode_node`): when a later turn may
    /// go there and ship only its new part's KV - always with `--continue-on
    /// prefill-node`, else once the measured rule finds the prefill node sooner - and the
    /// model's state can be cut into tails (no sliding window). A tail goes over the live
    /// V2 handoff only (the router's default).
    fn replay(&self, req: &ValidRequest, request_id: &str) -> Option<Replay> {
        let info = lock_info(&self.last_decode_info).clone()?;
        let wanted = match self.config.continue_on {
            ContinueOn::PrefillNode => true,
            ContinueOn::Measured => lock(&self.learned)
                .rates
                .prefill_node_sooner(info.kv_bytes_per_token),
        };
        (wanted && !info.sliding_window && self.keeps(req, HandoffMode::Live)).then(|| Replay {
            prefill: self.prefill.clone(),
            request: Self::prefill_request(req, &format!("{request_id}-replay"), None, 0),
            bound: self.config.first_token_timeout,
        })
    }

    /// Both nodes' `Info` (`/health`): the last answers while they are younger than
    /// `max_age`, else asked again - by one caller, the others waiting for its answers - so
    /// that hits cost each node at most one `Info` per `max_age`.
    pub async fn infos_within(&self, max_age: std::time::Duration) -> HealthInfos {
        let mut last = self.health_infos.lock().await;
        if let Some((at, infos)) = &*last {
            if at.elapsed() < max_age {
                return infos.clone();
            }
        }
        let infos = tokio::join!(self.prefill_info(), self.decode_info());
        *last = Some((std::time::Instant::now(), infos.clone()));
        infos
    }

    /// The decode node's info, within the info timeout.
    ///
    /// # Errors
    /// 503 when the node does not answer in time.
    pub async fn decode_info(&self) -> Result<pb::NodeInfo, ApiError> {
        let mut c = self.decode.clone();
        let info = self
            .info_within(
                c.info(pb::InfoRequest {}),
                "decode_unavailable",
                "the decode node",
            )
            .await;
        remember(&self.last_decode_info, info)
    }

    async fn info_within(
        &self,
        call: impl std::future::Future<Output = Result<tonic::Response<pb::NodeInfo>, tonic::Status>>,
        code: &str,
        who: &str,
    ) -> Result<pb::NodeInfo, ApiError> {
        match tokio::time::timeout(self.config.info_timeout, call).await {
            Ok(Ok(r)) => Ok(r.into_inner()),
            // A misconfiguration, not an outage: retrying will not help.
            Ok(Err(st)) if st.code() == tonic::Code::Unauthenticated => Err(ApiError::upstream(
                "auth_failed",
                format!(
                    "{who} refused the router's credential ({}): give all three services the same secret",
                    st.message()
                ),
            )),
            Ok(Err(st)) => Err(match HandshakeFailed::find(&st) {
                // The private link's handshake failed: another secret, or none, on the node.
                Some(h) => ApiError::link_refused(who, h),
                // A plain router whose node speaks only TLS reads the node's TLS alert as
                // a broken HTTP/2 stream or a reset connection (which of them varies with
                // timing): say what may have happened.
                None if !self.config.link.is_private() => {
                    ApiError::unavailable(
                        code,
                        format!(
                            "{who} is not reachable: {} (if it has a shared secret, give the \
                             router the same one: it then speaks TLS only)",
                            st.message()
                        ),
                    )
                }
                // A connection that broke after its handshake (a status made here, with
                // a source): said as `ApiError::from_status` says it.
                None => match std::error::Error::source(&st) {
                    Some(source) => ApiError::unavailable(
                        code,
                        format!(
                            "the connection to {who} broke: {} ({source})",
                            st.message()
                        ),
                    ),
                    None => ApiError::unavailable(
                        code,
                        format!("{who} is not reachable: {}", st.message()),
                    ),
                },
            }),
            Err(_) => Err(ApiError::unavailable(
                code,
                format!("{who} did not answer within {:?}", self.config.info_timeout),
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

    /// Starts `req` on `transport`; returns once the first token (or an error) is known.
    ///
    /// # Errors
    /// The request's failure before its first token, as the client should see it.
    pub async fn start(
        &self,
        req: &ValidRequest,
        transport: Transport,
        request_id: &str,
    ) -> Result<Started, ApiError> {
        match transport {
            Transport::V2 | Transport::V1 => self.start_split(req, transport, request_id).await,
            Transport::Local => self.start_local(req, request_id, None).await,
            Transport::Phone => self.on_decode_node(req, transport, request_id, None).await,
            Transport::Layers => {
                self.layer_split_serving().await?;
                let mut started = self.start_local(req, request_id, None).await?;
                started.transport = Transport::Layers;
                Ok(started)
            }
        }
    }

    /// `Ok` when the prefill node serves a layer split (its last `Info`, else a fresh
    /// one); a 400 naming the transport otherwise.
    async fn layer_split_serving(&self) -> Result<(), ApiError> {
        let known = lock_info(&self.last_prefill_info).clone();
        let info = match known {
            Some(i) => i,
            None => self.prefill_info().await?,
        };
        match info.layer_split.as_ref().map(|l| l.state.as_str()) {
            Some("split") => Ok(()),
            Some(state) => Err(ApiError::invalid(
                Some("edgesplit.transport".to_string()),
                format!(
                    "transport \"layers\": the prefill node's layer split is {state:?} (its RPC \
                     peer was lost; every layer is computed there): use \"local\""
                ),
            )),
            None => Err(ApiError::invalid(
                Some("edgesplit.transport".to_string()),
                "transport \"layers\": the prefill node serves no layer split (start it with \
                 --rpc-peer and --rpc-layers)",
            )),
        }
    }

    async fn first_within<T>(
        &self,
        fut: impl std::future::Future<Output = Result<T, tonic::Status>>,
        param: &str,
    ) -> Result<T, ApiError> {
        match tokio::time::timeout(self.config.first_token_timeout, fut).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(st)) => Err(ApiError::from_status(&st, param)),
            Err(_) => Err(ApiError::upstream(
                "timeout",
                "the prefill node did not produce a first token in time",
            )),
        }
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
    ) -> Result<(tonic::Streaming<pb::PrefillEvent>, pb::FirstToken), ApiError> {
        let param = input_param(&req.input);
        let (addr, wire) = target(info, transport);
        if addr.is_empty() {
            return Err(ApiError::unavailable(
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
            _ => Err(ApiError::upstream(
                "protocol_error",
                "the prefill node did not send a first token",
            )),
        }
    }

    /// The colocated path. `fallback`: the split path could not start (the cause), so
    /// this answer is a fallback and reports it first.
    async fn start_local(
        &self,
        req: &ValidRequest,
        request_id: &str,
        fallback: Option<String>,
    ) -> Result<Started, ApiError> {
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
        let (tx, rx) = mpsc::channel(64);
        let idle = self.config.token_idle_timeout;
        if let Some(cause) = fallback {
            let _ = tx.send(Event::Fallback { cause }).await;
        }
        tokio::spawn(async move { forward_prefill_node(stream, &tx, false, idle, param).await });
        Ok(Started {
            transport: Transport::Local,
            prompt_tokens: Some(p.prompt_tokens),
            cached_tokens: Some(p.cached_tokens),
            prefill_ms: Some(p.prefill_ms),
            placement: PrefilledOn::PrefillNode,
            events: rx,
        })
    }

    /// A colocated stream's first message, its prefill report.
    async fn prefilled(
        &self,
        stream: &mut tonic::Streaming<pb::TokenEvent>,
        param: &str,
        who: &str,
    ) -> Result<pb::Prefilled, ApiError> {
        match self.first_within(stream.message(), param).await? {
            Some(pb::TokenEvent {
                event: Some(pb::token_event::Event::Prefilled(p)),
            }) => Ok(p),
            _ => Err(ApiError::upstream(
                "protocol_error",
                format!("{who} did not report its prefill"),
            )),
        }
    }

    /// A split request that continues a conversation the decode node holds (`held` of its
    /// tokens, as remembered): the decode node prefills the new part itself, if that is
    /// sooner than a split ([`Rates::max_uncached`]) and it still holds the conversation.
    /// `Err` with code `not_cached` when it refused (nothing changed there).
    async fn continue_on_decode_node(
        &self,
        req: &ValidRequest,
        transport: Transport,
        request_id: &str,
        held: u32,
    ) -> Result<Started, ApiError> {
        let kv_per_token = lock_info(&self.last_decode_info)
            .as_ref()
            .map_or(0, |i| i.kv_bytes_per_token);
        let max_uncached = lock(&self.learned).rates.max_uncached(held, kv_per_token);
        self.on_decode_node(req, transport, request_id, Some(max_uncached))
            .await
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
    ) -> Result<Started, ApiError> {
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
                ApiError::from_status_of(&st, param, ("decode_unavailable", "the decode node"))
            })?,
            Err(_) => {
                return Err(ApiError::unavailable(
                    "decode_unavailable",
                    format!("the decode node did not answer within {bound:?}"),
                ))
            }
        }
        .into_inner();
        let p = self
            .prefilled(&mut stream, param, "the decode node")
            .await?;
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
        tokio::spawn(async move {
            forward_decode_node(stream, tx, transcript, fallback, idle, param).await;
        });
        Ok(Started {
            transport,
            prompt_tokens: Some(p.prompt_tokens),
            cached_tokens: Some(p.cached_tokens),
            prefill_ms: Some(p.prefill_ms),
            placement: PrefilledOn::DecodeNode,
            events: rx,
        })
    }

    fn fallback(&self, req: &ValidRequest, request_id: &str) -> Option<Fallback> {
        self.config.fallback.then(|| Fallback {
            prefill: self.prefill.clone(),
            request: Self::prefill_request(req, request_id, None, 0),
            first_token_timeout: self.config.first_token_timeout,
        })
    }

    /// A split request. The decode node's `Info` (is it there, where does the state go, its
    /// KV budget) and the prefill overlap: the prefill starts at once towards the addresses
    /// of the last `Info` answered, and stands only if this request's own `Info` agrees;
    /// if that `Info` fails or names another address or budget, the early prefill is
    /// dropped (which cancels it) and the request goes on as it would without it. So a
    /// split request no longer waits one round trip of the link before its prefill, and
    /// decides exactly as before.
    ///
    /// First, when the request continues a conversation the decode node holds, the decode
    /// node may prefill the new part itself ([`Backend::continue_on_decode_node`]); when it
    /// refuses or cannot, the request is split as any other.
    async fn start_split(
        &self,
        req: &ValidRequest,
        transport: Transport,
        request_id: &str,
    ) -> Result<Started, ApiError> {
        let param = input_param(&req.input);
        let mut held = if req.cache_prompt && self.renders_alike(&req.input) {
            lock(&self.learned).conversations.find(&req.input)
        } else {
            None
        };
        // The prefill node goes first when told to, or when it holds the conversation too
        // and is measured sooner per token: only the new part's KV then crosses.
        let prefill_node_first = held.is_some()
            && match self.config.continue_on {
                ContinueOn::PrefillNode => true,
                ContinueOn::Measured => {
                    let kv = lock_info(&self.last_decode_info)
                        .as_ref()
                        .map_or(0, |i| i.kv_bytes_per_token);
                    let l = lock(&self.learned);
                    l.conversations.replayed_for(&req.input) && l.rates.prefill_node_sooner(kv)
                }
            };
        if let (Some(h), false) = (held, prefill_node_first) {
            match self
                .continue_on_decode_node(req, transport, request_id, h)
                .await
            {
                Ok(started) => return Ok(started),
                Err(e) => {
                    // Held, but the new part is long: the split ships only that part's KV
                    // when it can (`Handoff.base_max`).
                    if e.cause != Some(ErrorCode::UncachedPartTooLong) {
                        held = None;
                    }
                    if e.cause == Some(ErrorCode::NotCached) {
                        lock(&self.learned).conversations.forget(&req.input);
                    }
                    tracing::info!(request_id, reason = %e.message, "split after all");
                }
            }
        }
        let base_max = held.unwrap_or(0);
        let mode = match (transport, req.handoff) {
            (Transport::V1, Some(HandoffMode::Live)) => {
                return Err(ApiError::invalid(
                    Some("edgesplit.handoff".into()),
                    "a live handoff goes over v2 only; use \"after\" with v1",
                ))
            }
            (Transport::V1, _) => HandoffMode::After,
            (_, m) => m.unwrap_or(self.config.handoff),
        };
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
                tracing::warn!(
                    request_id,
                    reason = %e.message,
                    "no decode node; answering on the prefill node"
                );
                let mut started = self
                    .start_local(req, request_id, Some("decode_unavailable".into()))
                    .await?;
                // Reported as asked, with `fallback` saying what happened instead.
                started.transport = transport;
                return Ok(started);
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
        let (tx, rx) = mpsc::channel(64);
        let started = Started {
            transport,
            prompt_tokens: Some(first.prompt_tokens),
            cached_tokens: Some(first.cached_tokens),
            prefill_ms: Some(first.prefill_ms),
            placement: PrefilledOn::PrefillNode,
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
        };
        tokio::spawn(split.run(pstream, fallback));
        Ok(started)
    }
}

/// `ev` of a stream from node `from`.
fn token_event(ev: pb::TokenEvent, with_prompt: bool, from: Node) -> Event {
    match ev.event {
        Some(pb::token_event::Event::Token(t)) => Event::Token {
            id: t.id,
            bytes: t.piece,
            logprobs: t.logprobs,
            from,
        },
        Some(pb::token_event::Event::Prefilled(p)) => Event::Prefilled {
            prompt_tokens: p.prompt_tokens,
            cached_tokens: p.cached_tokens,
            prefill_ms: p.prefill_ms,
        },
        Some(pb::token_event::Event::Finished(f)) => Event::Finished {
            reason: if f.reason == pb::FinishReason::Stop as i32 {
                FinishReason::Stop
            } else {
                FinishReason::Length
            },
            decode_tokens: f.generated,
            decode_ms: f.decode_ms,
            import_ms: f.import_ms,
            receive_ms: f.receive_ms,
            verify_ms: f.verify_ms,
            prompt_tokens: with_prompt.then_some(f.prompt_tokens),
            prefill_ms: with_prompt.then_some(f.prefill_ms),
        },
        None => Event::Error(ApiError::upstream("protocol_error", "empty token event")),
    }
}

/// What the router needs to finish an answer on the prefill node when the split fails.
pub struct Fallback {
    prefill: PrefillClient<Authed>,
    /// The request as a colocated one (no handoff); `resume_tokens` and `max_tokens` are
    /// filled in at the failure.
    request: pb::PrefillRequest,
    first_token_timeout: Duration,
}

/// How the split part of a request ended.
enum Split {
    /// Finished, or the client went away.
    Over,
    /// The handoff or the decode node failed; the client has not seen an error yet.
    Failed(ApiError),
}

/// The handoff's report: the prefill node's `Prefill` stream after its first token, read
/// in a task of its own.
type HandoffReport = tokio::task::JoinHandle<Result<Option<pb::PrefillEvent>, tonic::Status>>;

/// One split answer after its first token: it forwards that token, then the decode node's
/// tokens, while the handoff report comes in; when the handoff or the decode node fails it
/// finishes on the prefill node (`fallback`) or ends with the error.
struct SplitAnswer {
    /// Kept while the answer may end on the decode node (which then holds it).
    transcript: Option<Transcript>,
    learned: Arc<std::sync::Mutex<Learned>>,
    first: pb::FirstToken,
    decode: DecodeClient<Authed>,
    generate: pb::GenerateRequest,
    tx: mpsc::Sender<Event>,
    /// Every token the client has been sent, the first included.
    sent: Vec<i32>,
    idle: Duration,
    handoff_error_grace: Duration,
    handoff_report_wait: Duration,
    /// The request field an upstream refusal names (`messages` or `prompt`).
    param: &'static str,
    mode: HandoffMode,
    /// A live answer that ends on the prefill node is handed over after it
    /// ([`SplitAnswer::keep_on_decode_node`]).
    keep: bool,
}

/// Longest wait for a live answer's state to be kept on the decode node after the answer
/// ended (the prefill node's own handoff deadlines end a stalled one sooner).
const KEEP_WAIT: Duration = Duration::from_secs(600);

impl SplitAnswer {
    async fn run(
        mut self,
        pstream: tonic::Streaming<pb::PrefillEvent>,
        fallback: Option<Fallback>,
    ) {
        let total = self.first.max_tokens;
        let Split::Failed(e) = self.split_part(pstream).await else {
            return;
        };
        match fallback {
            Some(fb) => {
                fb.resume(e, self.sent, total, &self.tx, self.idle, self.param)
                    .await
            }
            None => {
                let _ = self.tx.send(Event::Error(e)).await;
            }
        }
    }

    /// Forwards the first token, the handoff report and the decode node's tokens.
    async fn split_part(&mut self, mut pstream: tonic::Streaming<pb::PrefillEvent>) -> Split {
        let first = Event::Token {
            id: self.first.token,
            bytes: self.first.piece.clone(),
            logprobs: self.first.logprobs.clone(),
            from: Node::Prefill,
        };
        if let Some(t) = &mut self.transcript {
            t.token(self.first.token, &self.first.piece);
        }
        if self.tx.send(Event::Mode(self.mode)).await.is_err() || self.tx.send(first).await.is_err()
        {
            return Split::Over;
        }
        if self.first.last {
            let reason = if self.first.eog {
                FinishReason::Stop
            } else {
                FinishReason::Length
            };
            let _ = self.tx.send(finished_here(reason)).await;
            return Split::Over;
        }
        if self.mode == HandoffMode::Live {
            return self.live_part(pstream).await;
        }
        let mut handoff: HandoffReport = tokio::spawn(async move { pstream.message().await });
        let mut handoff_pending = true;
        let stream = match self.decode_stream(&mut handoff, &mut handoff_pending).await {
            Ok(s) => s,
            Err(split) => return split,
        };
        self.forward_decode(stream, &mut handoff, &mut handoff_pending)
            .await
    }

    /// A live answer: forwards the prefill node's tokens until it finishes the answer or
    /// reports the switch, then the decode node's.
    async fn live_part(&mut self, mut pstream: tonic::Streaming<pb::PrefillEvent>) -> Split {
        use pb::prefill_event::Event as P;
        let idle = self.idle;
        loop {
            let event = match tokio::time::timeout(idle, pstream.message()).await {
                Ok(Ok(Some(m))) => m.event,
                Ok(Ok(None)) => {
                    return Split::Failed(ApiError::upstream(
                        "stream_ended",
                        "the prefill node ended the live answer without finishing it",
                    ))
                }
                Ok(Err(st)) => return Split::Failed(ApiError::from_status(&st, self.param)),
                Err(_) => {
                    return Split::Failed(ApiError::upstream(
                        "timeout",
                        format!("no token from the prefill node within {idle:?}"),
                    ))
                }
            };
            let ev = match event {
                Some(P::Token(t)) => {
                    self.sent.push(t.id);
                    if let Some(tr) = &mut self.transcript {
                        tr.token(t.id, &t.piece);
                    }
                    Event::Token {
                        id: t.id,
                        bytes: t.piece,
                        logprobs: t.logprobs,
                        from: Node::Prefill,
                    }
                }
                Some(P::Finished(f)) => {
                    // Every token was written on the prefill node: none by a decode node.
                    let mut ev = token_event(
                        pb::TokenEvent {
                            event: Some(pb::token_event::Event::Finished(f)),
                        },
                        false,
                        Node::Prefill,
                    );
                    if let Event::Finished {
                        decode_tokens,
                        decode_ms,
                        ..
                    } = &mut ev
                    {
                        *decode_tokens = 0;
                        *decode_ms = 0.0;
                    }
                    let _ = self.tx.send(ev).await;
                    if self.keep {
                        self.keep_on_decode_node(pstream);
                    }
                    return Split::Over;
                }
                Some(P::Cancelled(c)) => {
                    // Nothing of this answer will be kept on the decode node.
                    self.keep = false;
                    Event::HandoffCancelled {
                        reason: c.reason,
                        bytes: c.bytes,
                    }
                }
                Some(P::Switched(sw)) => return self.switch(sw).await,
                Some(P::First(_) | P::Handoff(_) | P::Kept(_)) | None => {
                    return Split::Failed(ApiError::upstream(
                        "protocol_error",
                        "unexpected event in the prefill node's live answer",
                    ))
                }
            };
            if self.tx.send(ev).await.is_err() {
                return Split::Over;
            }
        }
    }

    /// The live answer ended on the prefill node, which goes on sending its state: once
    /// the decode node holds all of it (`Kept`), a `Generate` of no tokens takes it into
    /// the decode node's cache, and the conversation is remembered there, so that its
    /// next turn goes on there with nothing crossing. In the background, after the
    /// client's answer ended; a turn that comes first is split as before.
    fn keep_on_decode_node(&mut self, mut pstream: tonic::Streaming<pb::PrefillEvent>) {
        let Some(mut transcript) = self.transcript.take() else {
            return;
        };
        // The answer was written on the prefill node, which holds it already.
        transcript.replay = None;
        transcript.written_on_prefill_node = true;
        let (mut decode, learned, idle) = (self.decode.clone(), self.learned.clone(), self.idle);
        let answered = u32::try_from(self.sent.len()).unwrap_or(u32::MAX);
        let mut generate = pb::GenerateRequest {
            first_token: self.sent.last().copied(),
            answered,
            max_new_tokens: 0,
            ..self.generate.clone()
        };
        tokio::spawn(async move {
            let request_id = generate.request_id.clone();
            let kept = match tokio::time::timeout(KEEP_WAIT, pstream.message()).await {
                Ok(Ok(Some(pb::PrefillEvent {
                    event: Some(pb::prefill_event::Event::Kept(sw)),
                }))) => sw,
                _ => return,
            };
            if kept.answered != answered {
                tracing::warn!(%request_id, kept = kept.answered, answered, "the kept state ends elsewhere than the answer; not kept");
                return;
            }
            generate.base_tokens = kept.base_tokens;
            generate.base_digest = kept.base_digest;
            lock(&learned)
                .rates
                .handed_off(kept.bytes, kept.transfer_ms);
            let took = async { finishes(decode.generate(generate).await?.into_inner()).await };
            match tokio::time::timeout(idle, took).await {
                Ok(Ok(true)) => {
                    tracing::info!(%request_id, bytes = kept.bytes, "the decode node keeps the conversation");
                    transcript.held_by_decode_node();
                }
                Ok(Ok(false)) => {
                    tracing::warn!(%request_id, "the decode node ended without keeping the conversation")
                }
                Ok(Err(e)) => {
                    tracing::warn!(%request_id, error = %e, "the decode node did not keep the conversation")
                }
                Err(_) => {
                    tracing::warn!(%request_id, "the decode node did not keep the conversation within the idle bound")
                }
            }
        });
    }

    /// The decode node holds the state up to the last token sent: it writes the rest.
    async fn switch(&mut self, sw: pb::Switched) -> Split {
        let answered = u32::try_from(self.sent.len()).unwrap_or(u32::MAX);
        if sw.answered != answered {
            return Split::Failed(ApiError::upstream(
                "protocol_error",
                format!(
                    "the prefill node switched after token {} but sent {answered}",
                    sw.answered
                ),
            ));
        }
        tracing::info!(
            request_id = %self.generate.request_id,
            answered,
            rounds = sw.rounds,
            bytes = sw.bytes,
            "live handoff: the decode node takes over"
        );
        lock(&self.learned)
            .rates
            .handed_off(sw.bytes, sw.transfer_ms);
        let handoff = Event::Handoff {
            bytes: sw.bytes,
            export_ms: sw.export_ms,
            transfer_ms: sw.transfer_ms,
            connect_ms: None,
            hash_ms: None,
        };
        if self.tx.send(handoff).await.is_err()
            || self.tx.send(Event::Switched { answered }).await.is_err()
        {
            return Split::Over;
        }
        self.generate.first_token = self.sent.last().copied();
        self.generate.answered = answered;
        // A tail: the decode node joins it onto the prefix it holds.
        self.generate.base_tokens = sw.base_tokens;
        self.generate.base_digest = sw.base_digest;
        self.generate.max_new_tokens = self.first.max_tokens.saturating_sub(answered);
        let mut decode = self.decode.clone();
        let idle = self.idle;
        let stream = match tokio::time::timeout(idle, decode.generate(self.generate.clone())).await
        {
            Ok(Ok(s)) => s.into_inner(),
            Ok(Err(st)) => return Split::Failed(ApiError::from_status(&st, self.param)),
            Err(_) => {
                return Split::Failed(ApiError::upstream(
                    "timeout",
                    format!("the decode node did not take the answer within {idle:?}"),
                ))
            }
        };
        // The handoff is reported; nothing is pending.
        let mut done: HandoffReport = tokio::spawn(async { Ok(None) });
        self.forward_decode(stream, &mut done, &mut false).await
    }

    /// The handoff's outcome: its figures, or why it failed.
    fn on_handoff(
        &self,
        r: Result<Result<Option<pb::PrefillEvent>, tonic::Status>, tokio::task::JoinError>,
    ) -> Result<Event, ApiError> {
        match r {
            Ok(Ok(Some(pb::PrefillEvent {
                event: Some(pb::prefill_event::Event::Handoff(h)),
            }))) => Ok({
                lock(&self.learned).rates.handed_off(h.bytes, h.transfer_ms);
                Event::Handoff {
                    bytes: h.bytes,
                    export_ms: h.export_ms,
                    transfer_ms: h.transfer_ms,
                    connect_ms: Some(h.connect_ms),
                    hash_ms: Some(h.hash_ms),
                }
            }),
            Ok(Err(st)) => Err(ApiError::from_status(&st, self.param)),
            _ => Err(ApiError::upstream(
                "protocol_error",
                "the prefill node ended without reporting the handoff",
            )),
        }
    }

    /// Calls the decode node's `Generate` and waits for its stream. Until the handoff is
    /// done, its own deadlines bound this wait (the prefill node reports a failed one);
    /// once the state is there, the decode node must start the answer within the idle
    /// bound (a frozen phone answers nothing, not even an error).
    async fn decode_stream(
        &mut self,
        handoff: &mut HandoffReport,
        handoff_pending: &mut bool,
    ) -> Result<tonic::Streaming<pb::TokenEvent>, Split> {
        let mut decode = self.decode.clone();
        let call = decode.generate(self.generate.clone());
        tokio::pin!(call);
        let idle = self.idle;
        let mut answer_by: Option<tokio::time::Instant> = None;
        loop {
            let started = async {
                match answer_by {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = started => {
                    return Err(Split::Failed(ApiError::upstream(
                        "timeout",
                        format!("the decode node did not take the answer within {idle:?} of the handoff"),
                    )));
                }
                r = &mut call => match r {
                    Ok(s) => return Ok(s.into_inner()),
                    Err(st) => {
                        if *handoff_pending {
                            // A handoff error explains a decode failure better than the decode does.
                            let report = tokio::time::timeout(self.handoff_error_grace, &mut *handoff).await;
                            if let Ok(Err(e)) = report.map(|r| self.on_handoff(r)) {
                                return Err(Split::Failed(e));
                            }
                        }
                        return Err(Split::Failed(ApiError::from_status(&st, self.param)));
                    }
                },
                h = &mut *handoff, if *handoff_pending => {
                    *handoff_pending = false;
                    answer_by = Some(tokio::time::Instant::now() + idle);
                    match self.on_handoff(h) {
                        Ok(ev) => if self.tx.send(ev).await.is_err() { return Err(Split::Over) },
                        Err(e) => return Err(Split::Failed(e)),
                    }
                }
            }
        }
    }

    /// Forwards the decode node's tokens until the answer ends or the node fails.
    async fn forward_decode(
        &mut self,
        mut stream: tonic::Streaming<pb::TokenEvent>,
        handoff: &mut HandoffReport,
        handoff_pending: &mut bool,
    ) -> Split {
        let idle = self.idle;
        loop {
            tokio::select! {
                ev = next_event(&mut stream, idle, Node::Decode, false, self.param) => {
                    if let Event::Error(e) = ev {
                        return Split::Failed(e);
                    }
                    let end = matches!(ev, Event::Finished { .. });
                    if end && *handoff_pending {
                        // Report the handoff figures before the end of the answer.
                        let report = tokio::time::timeout(self.handoff_report_wait, &mut *handoff).await;
                        if let Ok(Ok(hev)) = report.map(|r| self.on_handoff(r)) {
                            let _ = self.tx.send(hev).await;
                        }
                    }
                    if let Event::Token { id, bytes, .. } = &ev {
                        self.sent.push(*id);
                        if let Some(t) = &mut self.transcript {
                            t.token(*id, bytes);
                        }
                    }
                    if end {
                        if let Some(t) = self.transcript.take() {
                            t.held_by_decode_node();
                        }
                    }
                    if self.tx.send(ev).await.is_err() || end {
                        return Split::Over;
                    }
                }
                h = &mut *handoff, if *handoff_pending => {
                    *handoff_pending = false;
                    match self.on_handoff(h) {
                        Ok(ev) => if self.tx.send(ev).await.is_err() { return Split::Over },
                        Err(e) => return Split::Failed(e),
                    }
                }
            }
        }
    }
}

impl Fallback {
    /// Finishes the answer on the prefill node after the `sent` tokens (of `total`).
    async fn resume(
        self,
        cause: ApiError,
        sent: Vec<i32>,
        total: u32,
        tx: &mpsc::Sender<Event>,
        idle: Duration,
        param: &'static str,
    ) {
        let why = cause.code.clone().unwrap_or_else(|| cause.kind.to_string());
        tracing::warn!(
            request_id = %self.request.request_id,
            cause = %why,
            reason = %cause.message,
            tokens_sent = sent.len(),
            "the split failed; finishing the answer on the prefill node"
        );
        if tx.send(Event::Fallback { cause: why }).await.is_err() {
            return;
        }
        let remaining = total.saturating_sub(sent.len() as u32);
        if remaining == 0 {
            // Every token was sent; only the end was lost.
            let _ = tx.send(finished_here(FinishReason::Length)).await;
            return;
        }
        let mut request = self.request;
        request.resume_tokens = sent;
        request.max_tokens = remaining;
        let mut prefill = self.prefill;
        let call = tokio::time::timeout(self.first_token_timeout, prefill.generate(request)).await;
        let stream = match call {
            Ok(Ok(s)) => s.into_inner(),
            Ok(Err(st)) => {
                let _ = tx
                    .send(Event::Error(ApiError::from_status(&st, param)))
                    .await;
                return;
            }
            Err(_) => {
                let _ = tx
                    .send(Event::Error(ApiError::upstream(
                        "timeout",
                        "the prefill node did not take over the answer in time",
                    )))
                    .await;
                return;
            }
        };
        let wait = idle.max(self.first_token_timeout);
        forward_prefill_node(stream, tx, true, wait, param).await;
    }
}

/// The next event of a node's token stream (`with_prompt`: a `Finished` reports the
/// prompt's figures), or the error that ends it: the stream ended before `Finished`, the
/// node's gRPC error, or no event within `idle`.
async fn next_event(
    stream: &mut tonic::Streaming<pb::TokenEvent>,
    idle: Duration,
    node: Node,
    with_prompt: bool,
    param: &str,
) -> Event {
    let name = match node {
        Node::Prefill => "the prefill node",
        Node::Decode => "the decode node",
    };
    match tokio::time::timeout(idle, stream.message()).await {
        Ok(Ok(Some(m))) => token_event(m, with_prompt, node),
        Ok(Ok(None)) => Event::Error(ApiError::upstream(
            "stream_ended",
            format!("{name} ended the answer without finishing"),
        )),
        Ok(Err(st)) => Event::Error(match node {
            Node::Prefill => ApiError::from_status(&st, param),
            Node::Decode => ApiError::from_decode_stream(&st, param),
        }),
        Err(_) => Event::Error(ApiError::upstream(
            "timeout",
            format!("no token from {name} within {idle:?}"),
        )),
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

/// Forwards the prefill node's `Generate` stream (a colocated or a resumed answer) to the
/// client until it finishes or fails; each message must come within `wait`.
async fn forward_prefill_node(
    mut stream: tonic::Streaming<pb::TokenEvent>,
    tx: &mpsc::Sender<Event>,
    resumed: bool,
    wait: Duration,
    param: &str,
) {
    loop {
        let ev = match next_event(&mut stream, wait, Node::Prefill, !resumed, param).await {
            // A resumed answer's prefill is not this request's prefill.
            Event::Prefilled { .. } if resumed => continue,
            ev => ev,
        };
        let end = matches!(ev, Event::Finished { .. } | Event::Error(_));
        if tx.send(ev).await.is_err() || end {
            return;
        }
    }
}

/// The end of an answer no decode step produced (it ended with the tokens already sent).
fn finished_here(reason: FinishReason) -> Event {
    Event::Finished {
        reason,
        decode_tokens: 0,
        decode_ms: 0.0,
        import_ms: 0.0,
        receive_ms: 0.0,
        verify_ms: 0.0,
        prompt_tokens: None,
        prefill_ms: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(param: &'static str) -> SplitAnswer {
        let channel = tonic::transport::Endpoint::from_static("http://127.0.0.1:9").connect_lazy();
        let (tx, _) = mpsc::channel(1);
        SplitAnswer {
            transcript: None,
            learned: Arc::default(),
            first: pb::FirstToken::default(),
            decode: DecodeClient::with_interceptor(channel, GrpcCredentials(None)),
            generate: pb::GenerateRequest::default(),
            tx,
            sent: Vec::new(),
            idle: Duration::from_secs(1),
            handoff_error_grace: Duration::from_secs(1),
            handoff_report_wait: Duration::from_secs(1),
            param,
            mode: HandoffMode::After,
            keep: false,
        }
    }

    /// An upstream refusal after the first token names the request's own input field:
    /// `prompt` on /v1/completions, `messages` on chat (it said `messages` for both).
    #[tokio::test]
    async fn an_error_after_the_first_token_names_the_requests_field() {
        let refusal = || {
            edgesplit_proto::error::status(
                tonic::Code::InvalidArgument,
                ErrorCode::ContextLengthExceeded,
                "too long",
            )
        };
        for (input, param) in [
            (Input::Prompt("p".into()), "prompt"),
            (
                Input::Chat(vec![crate::api::Message::text("user", "m")]),
                "messages",
            ),
        ] {
            let e = split(input_param(&input))
                .on_handoff(Ok(Err(refusal())))
                .unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param));
            assert_eq!(e.code.as_deref(), Some("context_length_exceeded"));
        }
    }
}
