//! EdgeSplit prefill node: a gRPC service that prefills a prompt, samples the first token
//! (so the router can stream it at once), and sends the sequence's KV state to a decode
//! node over the V2 handoff (or, V1, as llama.cpp's sequence-state file by HTTP upload). It
//! also serves colocated runs (the `local` transport).

mod live;
pub mod metrics;
pub mod rpc;
mod send;
pub mod supervise;
pub mod upload;

use std::collections::HashMap;
use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use edgesplit_engine::wire::{
    engine_input, prompt_of, reuse_of, sampling_of, status, token_events,
};
use edgesplit_engine::{Engine, EngineConfig, Export, GenEvent, SamplingParams, Start};
use edgesplit_proto::handoff::Limits;
use edgesplit_proto::link::Link;
use edgesplit_proto::pb;
use edgesplit_proto::service::NodeArgs;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

use send::{HandoffJob, Sender};

/// Command-line and environment configuration.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "edgesplit-prefill", version, about)]
pub struct Config {
    #[command(flatten)]
    pub engine: edgesplit_engine::EngineArgs,
    #[command(flatten)]
    pub node: NodeArgs,
    /// gRPC listen address.
    #[arg(
        long,
        env = "EDGESPLIT_PREFILL_LISTEN",
        default_value = "127.0.0.1:50051"
    )]
    pub listen: String,
    /// Sequences served at once, each in its own context (`n_ctx` tokens of KV each).
    /// Prefills take one while they run; a local or fallback answer holds one until it
    /// ends, so with 2 a local answer does not stop the prefills of split ones.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub parallel: u32,
    /// Layers offloaded to the GPU (cuda builds; default all).
    #[arg(long)]
    pub gpu_layers: Option<u32>,
    /// Seconds allowed for the handoff connect.
    #[arg(long, default_value_t = 5)]
    pub handoff_connect_timeout_s: u64,
    /// HTTP listen address of `GET /metrics`.
    #[arg(
        long,
        env = "EDGESPLIT_PREFILL_METRICS_LISTEN",
        default_value = "127.0.0.1:50063"
    )]
    pub metrics_listen: String,
    /// Live handoff: send the prompt's state in pieces while it is prefilled (one per
    /// prefill batch), so the decode node holds most of it by the first token. Each piece
    /// costs an export on the engine thread and hashing beside it: worth it where the
    /// prefill runs on a GPU; on a CPU prefill node it slowed the prefill (TTFT 1.20x on
    /// this 2-core machine, docs/BENCHMARKS.md), hence off by default. With `--batch 128`
    /// the decode node took over 0.2 s after the first token on the wifi profile (0.99 s
    /// with 512). A sliding-window model (Gemma-3) sends nothing during its prefill: its
    /// first piece is the state laid out after it (`/health` says `after_prefill`).
    #[arg(long)]
    pub stream_prefill: bool,
    /// The layer split: a decode node's `--rpc-listen` address; the model's
    /// last `--rpc-layers` layers (weights and KV) are computed there, the rest here.
    /// Checked at start (a peer down, or with another secret, is an error naming it).
    #[arg(long, requires = "rpc_layers")]
    pub rpc_peer: Option<String>,
    /// Layers on `--rpc-peer`, counted from the last (the output layer goes with them), or
    /// `auto`: the fewest with which both devices hold their part (each split layer costs
    /// a link round trip per token), from both sides' available memory (the peer's from
    /// `--decode-url`) and the GGUF's layer sizes. A count that does not fit is refused
    /// with the numbers, before the model loads.
    #[arg(long, requires = "rpc_peer")]
    pub rpc_layers: Option<rpc::RpcLayers>,
    /// The decode node's gRPC URL, for its available memory (`Info`): the layer split's
    /// plan.
    #[arg(long, env = "EDGESPLIT_DECODE_URL")]
    pub decode_url: Option<String>,
    /// A restarted engine process (its RPC peer lost) tries to reach the peer again for
    /// this long; then, if the model fits here alone, it computes every layer here
    /// (`Info.layer_split.state` "lost") until the node is restarted, and otherwise ends
    /// and is tried again.
    #[arg(long, default_value_t = 15, requires = "rpc_peer")]
    pub rpc_reconnect_s: u64,
    /// Print the layer split's plan (`--rpc-peer`, `--rpc-layers`) and exit.
    #[arg(long, requires = "rpc_peer")]
    pub plan: bool,
}

impl Config {
    /// The engine configuration this node config asks for.
    #[must_use]
    pub fn engine(&self) -> EngineConfig {
        let mut e = self.engine.config(self.parallel);
        if let Some(g) = self.gpu_layers {
            e.n_gpu_layers = g;
        }
        e
    }

    fn limits(&self) -> Limits {
        Limits {
            connect: Duration::from_secs(self.handoff_connect_timeout_s),
            ..self.node.handoff_limits()
        }
    }
}

/// The gRPC service.
pub struct PrefillService {
    engine: Engine,
    limits: Limits,
    http: reqwest::Client,
    metrics: Arc<metrics::NodeMetrics>,
    link: Link,
    /// The links (and V1 clients) to devices that joined with a code, by device id, each
    /// under the device's own key ([`Link::device`]); made at a device's first handoff.
    devices: Arc<std::sync::Mutex<HashMap<String, (Link, reqwest::Client)>>>,
    stream_prefill: bool,
    layer_split: Option<Arc<rpc::Split>>,
}

/// Joined devices' links kept at most; more empty the cache (each is made again in
/// well under a millisecond).
const MAX_DEVICE_LINKS: usize = 64;

/// The V1 uploads' HTTP client: over `link`, within the handoff deadlines.
fn http_client(link: &Link, limits: &Limits) -> std::io::Result<reqwest::Client> {
    link.http_client(
        reqwest::Client::builder()
            .connect_timeout(limits.connect)
            .timeout(limits.frame),
    )
    .build()
    .map_err(std::io::Error::other)
}

type EventStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

impl PrefillService {
    /// A service over a started engine.
    ///
    /// # Errors
    /// The HTTP client (V1 uploads) cannot be built.
    pub fn new(engine: Engine, limits: Limits) -> std::io::Result<Self> {
        let link = Link::plain();
        let metrics = Arc::new(metrics::NodeMetrics::default());
        metrics.watch_cache(engine.cache_collector());
        Ok(Self {
            engine,
            limits,
            http: http_client(&link, &limits)?,
            metrics,
            link,
            devices: Arc::default(),
            stream_prefill: false,
            layer_split: None,
        })
    }

    /// Reports `split` (the layer split this engine serves) in `Info` and `/metrics`.
    #[must_use]
    pub fn with_layer_split(mut self, split: Option<rpc::Split>) -> Self {
        let split = split.map(Arc::new);
        if let Some(s) = &split {
            self.metrics.watch_layer_split(s.clone());
        }
        self.layer_split = split;
        self
    }

    /// Sends the prompt's state in pieces while it is prefilled (live handoff).
    #[must_use]
    pub fn with_stream_prefill(mut self, on: bool) -> Self {
        self.stream_prefill = on;
        self
    }

    /// Sends the V2 and V1 handoffs over `link` (private and authenticated with the shared
    /// secret when it has one).
    ///
    /// # Errors
    /// The HTTP client (V1 uploads) cannot be built.
    pub fn with_link(mut self, link: Link) -> std::io::Result<Self> {
        self.http = http_client(&link, &self.limits)?;
        self.link = link;
        self.devices = Arc::default();
        Ok(self)
    }

    /// What sends a handoff to the decode node `h` names: over the household's link, or
    /// the link under the joined device's own key.
    fn sender(&self, h: &pb::Handoff) -> Result<Sender, Status> {
        let (link, http) = if h.decode_key.is_empty() {
            (self.link.clone(), self.http.clone())
        } else {
            self.device_link(&h.decode_key)?
        };
        Ok(Sender {
            info: self.engine.info().clone(),
            limits: self.limits,
            http,
            metrics: self.metrics.clone(),
            link,
        })
    }

    fn device_link(&self, id: &str) -> Result<(Link, reqwest::Client), Status> {
        let refused = |m: String| {
            edgesplit_proto::error::status(
                tonic::Code::FailedPrecondition,
                edgesplit_proto::error::ErrorCode::AuthFailed,
                m,
            )
        };
        if !self.link.is_private() {
            return Err(refused(format!(
                "the handoff is to joined device {id}, whose key comes from the shared secret, \
                 and this node has none: give it the router's --secret-file"
            )));
        }
        let mut devices = self
            .devices
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(d) = devices.get(id) {
            return Ok(d.clone());
        }
        let link = self.link.device(id).map_err(|e| refused(e.to_string()))?;
        let http = http_client(&link, &self.limits).map_err(|e| refused(e.to_string()))?;
        if devices.len() >= MAX_DEVICE_LINKS {
            devices.clear();
        }
        devices.insert(id.to_string(), (link.clone(), http.clone()));
        Ok((link, http))
    }
}

#[tonic::async_trait]
impl pb::prefill_server::Prefill for PrefillService {
    type PrefillStream = EventStream<pb::PrefillEvent>;
    type GenerateStream = EventStream<pb::TokenEvent>;

    async fn prefill(
        &self,
        request: Request<pb::PrefillRequest>,
    ) -> Result<Response<Self::PrefillStream>, Status> {
        let req = request.into_inner();
        let (tokens, max_tokens) = prompt_of(&self.engine, &req, req.kv_budget_bytes).await?;
        let params = sampling_of(&req);
        let handoff = req.handoff.clone();
        let mut sender = None;
        if let Some(h) = &handoff {
            if !edgesplit_proto::frame::valid_id(&h.handoff_id) {
                return Err(Status::invalid_argument("invalid handoff id"));
            }
            if !h.decode_key.is_empty() && !edgesplit_proto::frame::valid_id(&h.decode_key) {
                return Err(Status::invalid_argument("invalid decode_key (a device id)"));
            }
            sender = Some(self.sender(h)?);
        }
        let v1 = handoff
            .as_ref()
            .is_some_and(|h| h.transport == pb::HandoffTransport::V1 as i32);
        if let Some(h) = handoff.as_ref().filter(|h| h.live) {
            if v1 {
                return Err(Status::invalid_argument("a live handoff goes over V2 only"));
            }
            let sender = sender.take().expect("made for every handoff");
            return self
                .prefill_live(&req, tokens, params, max_tokens, h.clone(), sender)
                .await;
        }
        let export = match &handoff {
            None => Export::None,
            Some(_) => Export::Raw,
        };
        let reuse = reuse_of(&req);
        let mut out = self
            .engine
            .prefill_with(tokens, params, max_tokens, export, reuse)
            .await
            .map_err(|e| status(&e))?;
        tracing::info!(
            request_id = %req.request_id,
            prompt_tokens = out.prompt_tokens.len(),
            cached_tokens = out.cached_tokens,
            prefill_ms = out.prefill_ms,
            "prefilled"
        );
        self.metrics.prefill.observe(out.prefill_ms / 1000.0);
        self.metrics
            .prompt_tokens
            .inc_by(out.prompt_tokens.len() as u64);
        let (tx, rx) = mpsc::channel(2);
        let first = pb::PrefillEvent {
            event: Some(pb::prefill_event::Event::First(pb::FirstToken {
                token: out.first.id,
                piece: out.first.piece.clone(),
                prompt_tokens: out.prompt_tokens.len() as u32,
                prefill_ms: out.prefill_ms,
                last: out.first.eog || max_tokens <= 1,
                eog: out.first.eog,
                max_tokens,
                logprobs: out.first.logprobs.clone().map(Into::into),
                cached_tokens: out.cached_tokens,
            })),
        };
        // The first token goes out before the handoff starts: TTFT does not wait for it.
        let _ = tx.send(Ok(first)).await;
        if let (Some(state), Some(h), Some(sender)) = (out.state.take(), handoff, sender) {
            let job = HandoffJob {
                handoff: h,
                request_id: req.request_id.clone(),
                prompt_tokens: out.prompt_tokens,
                export_ms: out.export_ms,
            };
            tokio::spawn(async move {
                let _ = tx.send(sender.send(job, state).await).await;
            });
        }
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn generate(
        &self,
        request: Request<pb::PrefillRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let req = request.into_inner();
        if !req.resume_tokens.is_empty() {
            // Taking over an answer: max_tokens is what is left to generate.
            let tokens = self
                .engine
                .tokenize(engine_input(&req)?)
                .await
                .map_err(|e| status(&e))?;
            tracing::info!(
                request_id = %req.request_id,
                answered = req.resume_tokens.len(),
                "resuming an answer another node was writing"
            );
            let start = Start::Resume {
                prompt: tokens,
                answer: req.resume_tokens.clone(),
                reuse: reuse_of(&req),
            };
            let rx = self
                .engine
                .generate(start, sampling_of(&req), req.max_tokens)
                .await
                .map_err(|e| status(&e))?;
            return Ok(Response::new(Box::pin(token_events(rx))));
        }
        let (tokens, max_tokens) = prompt_of(&self.engine, &req, req.kv_budget_bytes).await?;
        let start = Start::Cached {
            tokens,
            reuse: reuse_of(&req),
            max_uncached: None,
        };
        let rx = self
            .engine
            .generate(start, sampling_of(&req), max_tokens)
            .await
            .map_err(|e| status(&e))?;
        Ok(Response::new(Box::pin(token_events(rx))))
    }

    async fn info(&self, _: Request<pb::InfoRequest>) -> Result<Response<pb::NodeInfo>, Status> {
        let mut info = self.engine.node_info("prefill");
        info.stream_prefill = match (self.stream_prefill, self.engine.info().sliding_window) {
            (false, _) => "off",
            (true, false) => "per_batch",
            (true, true) => "after_prefill",
        }
        .into();
        info.requests_in_flight = self.engine.in_flight();
        info.sequences_active = u32::try_from(self.engine.active()).unwrap_or(u32::MAX);
        info.layer_split = self.layer_split.as_ref().map(|s| s.info());
        Ok(Response::new(info))
    }
}

impl PrefillService {
    /// A prefill whose answer goes on here while the state crosses ([`live`]): the
    /// prefill and first token are those of a colocated run, the stream then carries the
    /// tokens written here until the switch.
    async fn prefill_live(
        &self,
        req: &pb::PrefillRequest,
        tokens: Vec<i32>,
        params: SamplingParams,
        max_tokens: u32,
        handoff: pb::Handoff,
        sender: Sender,
    ) -> Result<Response<EventStream<pb::PrefillEvent>>, Status> {
        let n_prompt = tokens.len();
        let start = Start::Cached {
            tokens,
            reuse: reuse_of(req),
            max_uncached: None,
        };
        let edgesplit_engine::LiveAnswer {
            mut events,
            live,
            pieces,
        } = self
            .engine
            .generate_live(start, params, max_tokens)
            .await
            .map_err(|e| status(&e))?;
        // A tail may go (the decode node holds a prefix of this prompt's conversation):
        // where it starts is known after the prefill, so nothing goes during it.
        let tail = handoff.base_max > 0 && !self.engine.info().sliding_window;
        let base_max = handoff.base_max as usize;
        let handoff = Arc::new(live::LiveHandoff {
            sender,
            handoff,
            request_id: req.request_id.clone(),
            prompt_tokens: n_prompt,
        });
        // The prompt's state starts crossing while it is prefilled; aborted (its
        // connection closed, the decode node dropping what it got) if the answer does not
        // go past its first token.
        // Without `--stream-prefill` the pieces channel closes now, and the engine exports
        // nothing during the prefill.
        let pieces = if self.stream_prefill && !tail {
            pieces
        } else {
            drop(pieces);
            mpsc::unbounded_channel().1
        };
        let early = {
            let h = handoff.clone();
            live::AbortOnDrop(tokio::spawn(async move { h.during_prefill(pieces).await }))
        };
        let protocol = || Status::internal("the engine did not prefill the live answer");
        let (prefill_ms, cached_tokens) = match events.recv().await {
            Some(GenEvent::Prefilled {
                prefill_ms,
                cached_tokens,
                ..
            }) => (prefill_ms, cached_tokens),
            Some(GenEvent::Error(e)) => return Err(status(&e)),
            _ => return Err(protocol()),
        };
        // Only what follows the reused prefix crosses, when the decode node holds it.
        let base = if tail && cached_tokens as usize <= base_max {
            cached_tokens as usize
        } else {
            0
        };
        let first = match events.recv().await {
            Some(GenEvent::Token(t)) => t,
            Some(GenEvent::Error(e)) => return Err(status(&e)),
            _ => return Err(protocol()),
        };
        tracing::info!(
            request_id = %req.request_id,
            prompt_tokens = n_prompt,
            prefill_ms,
            "prefilled (live handoff)"
        );
        self.metrics.prefill.observe(prefill_ms / 1000.0);
        self.metrics.prompt_tokens.inc_by(n_prompt as u64);
        let last = first.eog || max_tokens <= 1;
        let (tx, rx) = mpsc::channel(64);
        let _ = tx
            .send(Ok(pb::PrefillEvent {
                event: Some(pb::prefill_event::Event::First(pb::FirstToken {
                    token: first.id,
                    piece: first.piece,
                    prompt_tokens: n_prompt as u32,
                    prefill_ms,
                    last,
                    eog: first.eog,
                    max_tokens,
                    logprobs: first.logprobs.map(Into::into),
                    cached_tokens,
                })),
            }))
            .await;
        if !last {
            tokio::spawn(handoff.run(events, live, early, tx, base));
        }
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }
}

/// The prefill node's listeners.
pub struct Listeners {
    /// gRPC control plane.
    pub grpc: TcpListener,
    /// `GET /metrics` (HTTP).
    pub metrics: TcpListener,
}

/// Serves the prefill gRPC API and its metrics until `shutdown` resolves; `layer_split`
/// is the engine's (reported, not set up, here: see [`rpc::start`]).
///
/// # Errors
/// The gRPC server's transport error, or the state folder.
pub async fn run(
    listeners: Listeners,
    engine: Engine,
    config: &Config,
    layer_split: Option<rpc::Split>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    // Metrics are not a link between the devices: only the gRPC listener is checked.
    let link = config.node.link(&[listeners.grpc.local_addr()?])?;
    let secret = link.secret_arc();
    let svc = PrefillService::new(engine, config.limits())
        .and_then(|s| s.with_link(link.clone()))
        .map_err(|e| anyhow::anyhow!("HTTP client: {e}"))?
        .with_stream_prefill(config.stream_prefill)
        .with_layer_split(layer_split);
    let drain = config.node.drain(shutdown);
    let app = metrics::router(svc.metrics.clone());
    let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
    // Metrics stay up while the node drains.
    let http = tokio::spawn(
        axum::serve(listeners.metrics, app)
            .with_graceful_shutdown(async move {
                let _ = stop_rx.wait_for(|s| *s).await;
            })
            .into_future(),
    );
    let grpc = tonic::transport::Server::builder()
        .add_service(pb::prefill_server::PrefillServer::with_interceptor(
            svc,
            NodeArgs::guard(secret),
        ))
        .serve_with_incoming_shutdown(
            link.listen(listeners.grpc, config.node.handoff_limits().handshake),
            drain.started(),
        );
    let result = tokio::select! {
        result = grpc => result,
        () = drain.expired() => Ok(()),
    };
    let _ = stop_tx.send(true);
    let _ = http.await;
    Ok(result?)
}
