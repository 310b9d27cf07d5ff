//! EdgeSplit prefill node: a gRPC service that prefills a prompt, samples the first token
//! (so the router can stream it at once), and sends the sequence's KV state to a decode
//! node over the V2 handoff (or, V1, as llama.cpp's sequence-state file by HTTP upload). It
//! also serves colocated runs (the `local` transport).

pub mod metrics;
pub mod upload;

use std::future::{Future, IntoFuture};
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use edgesplit_engine::wire::{status, status_with_code, token_events};
use edgesplit_engine::{Engine, EngineConfig, Export, Exported, Input, SamplingParams, Start};
use edgesplit_proto::auth::{GrpcGuard, Secret};
use edgesplit_proto::frame::{NackCode, StateFrame};
use edgesplit_proto::handoff::{self, HandoffError, Limits};
use edgesplit_proto::service::Drain;
use edgesplit_proto::{layout, pb};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

/// Command-line and environment configuration.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "edgesplit-prefill", version, about)]
pub struct Config {
    /// GGUF model file.
    #[arg(long, env = "EDGESPLIT_MODEL")]
    pub model: PathBuf,
    /// File holding the secret shared by the router and both nodes (V2 handshake, V1
    /// uploads and gRPC calls are then authenticated). Also `EDGESPLIT_SECRET_FILE`, or the
    /// secret itself in `EDGESPLIT_SECRET`; never a flag with the secret in it.
    #[arg(long)]
    pub secret_file: Option<PathBuf>,
    /// gRPC listen address.
    #[arg(
        long,
        env = "EDGESPLIT_PREFILL_LISTEN",
        default_value = "127.0.0.1:50051"
    )]
    pub listen: String,
    /// Context size in tokens; must equal the decode node's.
    #[arg(long, default_value_t = 4096)]
    pub n_ctx: u32,
    /// Threads (default: physical cores).
    #[arg(long)]
    pub threads: Option<i32>,
    /// Prefill batch size.
    #[arg(long, default_value_t = 512)]
    pub batch: u32,
    /// Sequences served at once, each in its own context (`n_ctx` tokens of KV each).
    /// Prefills take one while they run; a local or fallback answer holds one until it
    /// ends, so with 2 a local answer does not stop the prefills of split ones.
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub parallel: u32,
    /// Flash attention: auto (on unless the model uses sliding-window attention), on, off.
    /// Both nodes must resolve to the same setting (the handoff handshake checks).
    #[arg(long, default_value = "auto")]
    pub flash_attn: edgesplit_engine::FlashAttn,
    /// Layers offloaded to the GPU (cuda builds; default all).
    #[arg(long)]
    pub gpu_layers: Option<u32>,
    /// Seconds allowed for the handoff connect.
    #[arg(long, default_value_t = 5)]
    pub handoff_connect_timeout_s: u64,
    /// Seconds allowed for the state transfer: sending the STATE frame (V2) or the whole
    /// upload (V1), and the receiver's answer.
    #[arg(long, default_value_t = 60)]
    pub handoff_frame_timeout_s: u64,
    /// Seconds allowed for each handshake frame of a V2 handoff (HELLO, AUTH and replies).
    #[arg(long, default_value_t = 10)]
    pub handoff_handshake_timeout_s: u64,
    /// On SIGTERM: seconds the prefills and answers in flight may take to finish before
    /// the node exits anyway (new calls are refused meanwhile).
    #[arg(long, default_value_t = 30)]
    pub drain_timeout_s: u64,
    /// HTTP listen address of `GET /metrics`.
    #[arg(
        long,
        env = "EDGESPLIT_PREFILL_METRICS_LISTEN",
        default_value = "127.0.0.1:50063"
    )]
    pub metrics_listen: String,
    /// Folder for V1 state files while they are uploaded (deleted after each upload).
    #[arg(long)]
    pub state_dir: Option<PathBuf>,
}

impl Config {
    /// The engine configuration this node config asks for.
    #[must_use]
    pub fn engine(&self) -> EngineConfig {
        let mut e = EngineConfig::new(&self.model);
        e.n_ctx = self.n_ctx;
        e.n_batch = self.batch;
        e.n_parallel = self.parallel;
        e.flash_attn = self.flash_attn;
        if let Some(t) = self.threads {
            e.n_threads = t;
        }
        if let Some(g) = self.gpu_layers {
            e.n_gpu_layers = g;
        }
        e
    }

    fn limits(&self) -> Limits {
        Limits {
            connect: Duration::from_secs(self.handoff_connect_timeout_s),
            frame: Duration::from_secs(self.handoff_frame_timeout_s),
            handshake: Duration::from_secs(self.handoff_handshake_timeout_s),
            ..Limits::default()
        }
    }
}

/// The gRPC service.
pub struct PrefillService {
    engine: Engine,
    limits: Limits,
    state_dir: PathBuf,
    http: reqwest::Client,
    metrics: Arc<metrics::NodeMetrics>,
    secret: Option<Arc<Secret>>,
}

type EventStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

fn input_of(req: &pb::PrefillRequest) -> Result<Input, Status> {
    match &req.input {
        Some(pb::prefill_request::Input::Chat(c)) => Ok(Input::Chat(
            c.messages
                .iter()
                .map(|m| (m.role.clone(), m.content.clone()))
                .collect(),
        )),
        Some(pb::prefill_request::Input::Prompt(p)) => Ok(Input::Raw(p.clone())),
        None => Err(Status::invalid_argument("request has no input")),
    }
}

impl PrefillService {
    /// A service over a started engine; V1 files go to `state_dir` (created if missing).
    ///
    /// # Errors
    /// The state folder cannot be created.
    pub fn new(engine: Engine, limits: Limits, state_dir: PathBuf) -> std::io::Result<Self> {
        std::fs::create_dir_all(&state_dir)?;
        let http = reqwest::Client::builder()
            .connect_timeout(limits.connect)
            .timeout(limits.frame)
            .build()
            .map_err(std::io::Error::other)?;
        Ok(Self {
            engine,
            limits,
            state_dir,
            http,
            metrics: Arc::default(),
            secret: None,
        })
    }

    /// Authenticates the V2 and V1 handoffs with the shared secret.
    #[must_use]
    pub fn with_secret(mut self, secret: Option<Arc<Secret>>) -> Self {
        self.secret = secret;
        self
    }

    async fn tokenize(&self, req: &pb::PrefillRequest) -> Result<(Vec<i32>, u32), Status> {
        let tokens = self
            .engine
            .tokenize(input_of(req)?)
            .await
            .map_err(|e| status(&e))?;
        let info = self.engine.info();
        let mut max = if req.max_tokens == 0 {
            info.n_ctx.saturating_sub(tokens.len() as u32).max(1)
        } else {
            req.max_tokens
        };
        if req.kv_budget_bytes > 0 {
            let per = info.kv_bytes_per_token.max(1);
            let fit = req.kv_budget_bytes / per;
            if req.max_tokens == 0 {
                // "As long as it fits": cap the answer at what the budget allows.
                max = max.min(
                    u32::try_from(fit.saturating_sub(tokens.len() as u64)).unwrap_or(u32::MAX),
                );
            }
            let need = (tokens.len() as u64 + u64::from(max)) * per;
            if need > req.kv_budget_bytes || max == 0 {
                return Err(status_with_code(
                    tonic::Code::InvalidArgument,
                    "kv_budget_exceeded",
                    format!(
                        "the decode node's KV memory budget is {} bytes ({fit} tokens at {per} bytes/token); \
                         this request needs {need} bytes ({} prompt + {max} completion tokens)",
                        req.kv_budget_bytes,
                        tokens.len()
                    ),
                ));
            }
        }
        Ok((tokens, max))
    }
}

fn sampling_of(req: &pb::PrefillRequest) -> SamplingParams {
    req.sampling
        .as_ref()
        .map(SamplingParams::from)
        .unwrap_or_default()
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
        let (tokens, max_tokens) = self.tokenize(&req).await?;
        let params = sampling_of(&req);
        let handoff = req.handoff.clone();
        if let Some(h) = &handoff {
            if !edgesplit_proto::frame::valid_id(&h.handoff_id) {
                return Err(Status::invalid_argument("invalid handoff id"));
            }
        }
        let v1 = handoff
            .as_ref()
            .is_some_and(|h| h.transport == pb::HandoffTransport::V1 as i32);
        let export = match &handoff {
            None => Export::None,
            Some(h) if v1 => Export::File(self.state_dir.join(format!("{}.ggsq", h.handoff_id))),
            Some(_) => Export::Raw,
        };
        let out = match self
            .engine
            .prefill(tokens, params, max_tokens, export.clone())
            .await
        {
            Ok(out) => out,
            Err(e) => {
                // A failed file export may leave a partial file behind.
                if let Export::File(path) = export {
                    let _ = std::fs::remove_file(path);
                }
                return Err(status(&e));
            }
        };
        tracing::info!(
            request_id = %req.request_id,
            prompt_tokens = out.prompt_tokens.len(),
            prefill_ms = out.prefill_ms,
            "prefilled"
        );
        self.metrics.prefill.observe(out.prefill_ms / 1000.0);
        self.metrics
            .prompt_tokens
            .inc_by(out.prompt_tokens.len() as u64);
        let (tx, rx) = mpsc::channel(2);
        let last = out.state.is_none();
        let first = pb::PrefillEvent {
            event: Some(pb::prefill_event::Event::First(pb::FirstToken {
                token: out.first.id,
                piece: out.first.piece.clone(),
                prompt_tokens: out.prompt_tokens.len() as u32,
                prefill_ms: out.prefill_ms,
                last: out.first.eog || max_tokens <= 1,
                eog: out.first.eog,
                max_tokens,
            })),
        };
        // The first token goes out before the handoff starts: TTFT does not wait for it.
        let _ = tx.send(Ok(first)).await;
        if let (Some(Exported::File { path, .. }), Some(h)) = (&out.state, &handoff) {
            let (path, h) = (path.clone(), h.clone());
            let info = self.engine.info().clone();
            let http = self.http.clone();
            let export_ms = out.export_ms;
            let request_id = req.request_id.clone();
            let metrics = self.metrics.clone();
            let secret = self.secret.clone();
            tokio::spawn(async move {
                let t0 = Instant::now();
                let send = || {
                    upload::upload(
                        &http,
                        &h.decode_addr,
                        &h.handoff_id,
                        &request_id,
                        &path,
                        &info,
                        secret.as_deref(),
                    )
                };
                let mut result = send().await;
                if let Err(e) = &result {
                    if e.retryable() {
                        tracing::warn!(%request_id, error = %e, "V1 upload failed; retrying once");
                        result = send().await;
                    }
                }
                let _ = tokio::fs::remove_file(&path).await;
                let secs = t0.elapsed().as_secs_f64();
                metrics.handoff("v1", result.is_ok(), *result.as_ref().unwrap_or(&0), secs);
                let ev = match result {
                    Ok(bytes) => {
                        let transfer_ms = t0.elapsed().as_secs_f64() * 1000.0;
                        tracing::info!(%request_id, handoff_id = %h.handoff_id, bytes, transfer_ms, "V1 upload done");
                        Ok(handoff_done(bytes, export_ms, transfer_ms))
                    }
                    Err(e) => {
                        tracing::warn!(%request_id, error = %e, "V1 upload failed");
                        Err(status_with_code(
                            tonic::Code::Unavailable,
                            e.code(),
                            format!("KV handoff (V1 upload) failed: {e}"),
                        ))
                    }
                };
                let _ = tx.send(ev).await;
            });
        } else if let (Some(Exported::Raw(state)), Some(h), false) = (out.state, handoff, last) {
            let ours = self.engine.info().identity();
            let limits = self.limits;
            let secret = self.secret.clone();
            let export_ms = out.export_ms;
            let request_id = req.request_id.clone();
            let metrics = self.metrics.clone();
            tokio::spawn(async move {
                let layout = layout::describe(&state);
                let frame = StateFrame {
                    handoff_id: h.handoff_id.clone(),
                    request_id: request_id.clone(),
                    tokens: out.prompt_tokens,
                    descriptors: layout.descriptors,
                    payload: Bytes::from(state),
                };
                let t0 = Instant::now();
                let send = |frame: StateFrame| {
                    handoff::send_state(&h.decode_addr, &ours, frame, &limits, secret.as_deref())
                };
                let mut result = send(frame.clone()).await;
                if let Err(e) = &result {
                    if retryable(e) {
                        tracing::warn!(%request_id, error = %e, "handoff failed; retrying once");
                        metrics.handoff("v2", false, 0, t0.elapsed().as_secs_f64());
                        result = send(frame).await;
                    }
                }
                let bytes = result.as_ref().map_or(0, |r| r.payload_bytes);
                metrics.handoff("v2", result.is_ok(), bytes, t0.elapsed().as_secs_f64());
                let ev = match result {
                    Ok(report) => {
                        let transfer_ms = t0.elapsed().as_secs_f64() * 1000.0;
                        tracing::info!(
                            %request_id,
                            handoff_id = %h.handoff_id,
                            bytes = report.payload_bytes,
                            transfer_ms,
                            "handoff sent"
                        );
                        Ok(handoff_done(report.payload_bytes, export_ms, transfer_ms))
                    }
                    Err(e) => {
                        tracing::warn!(%request_id, error = %e, "handoff failed");
                        Err(handoff_status(&e))
                    }
                };
                let _ = tx.send(ev).await;
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
                .tokenize(input_of(&req)?)
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
            };
            let rx = self
                .engine
                .generate(start, sampling_of(&req), req.max_tokens)
                .await
                .map_err(|e| status(&e))?;
            return Ok(Response::new(Box::pin(token_events(rx))));
        }
        let (tokens, max_tokens) = self.tokenize(&req).await?;
        let rx = self
            .engine
            .generate(Start::Prompt(tokens), sampling_of(&req), max_tokens)
            .await
            .map_err(|e| status(&e))?;
        Ok(Response::new(Box::pin(token_events(rx))))
    }

    async fn info(&self, _: Request<pb::InfoRequest>) -> Result<Response<pb::NodeInfo>, Status> {
        let mut info = self.engine.info().node_info("prefill");
        info.requests_in_flight = self.engine.in_flight();
        info.sequences_active = u32::try_from(self.engine.active()).unwrap_or(u32::MAX);
        Ok(Response::new(info))
    }
}

fn handoff_done(bytes: u64, export_ms: f64, transfer_ms: f64) -> pb::PrefillEvent {
    pb::PrefillEvent {
        event: Some(pb::prefill_event::Event::Handoff(pb::HandoffDone {
            bytes,
            export_ms,
            transfer_ms,
        })),
    }
}

/// Failures a second attempt may not meet: the bytes or the link, not the peer's refusal
/// of who we are (model, build, context, secret) or of the request (too long, no room).
fn retryable(e: &HandoffError) -> bool {
    match e {
        HandoffError::Refused(n) => matches!(
            n.code,
            NackCode::ChecksumMismatch
                | NackCode::Malformed
                | NackCode::Timeout
                | NackCode::Internal
                | NackCode::BadMagic
        ),
        HandoffError::Mismatch(_) | HandoffError::Auth(_) => false,
        HandoffError::Connect { .. }
        | HandoffError::Timeout(_)
        | HandoffError::Protocol(_)
        | HandoffError::Codec(_) => true,
    }
}

fn handoff_status(e: &HandoffError) -> Status {
    let name = match e {
        HandoffError::Refused(n) | HandoffError::Mismatch(n) => n.code.as_str(),
        HandoffError::Timeout(_) => "handoff_timeout",
        HandoffError::Connect { .. } => "handoff_unreachable",
        _ => "handoff_failed",
    };
    status_with_code(
        tonic::Code::Unavailable,
        name,
        format!("KV handoff failed: {e}"),
    )
}

/// The prefill node's listeners.
pub struct Listeners {
    /// gRPC control plane.
    pub grpc: TcpListener,
    /// `GET /metrics` (HTTP).
    pub metrics: TcpListener,
}

/// Serves the prefill gRPC API and its metrics until `shutdown` resolves.
///
/// # Errors
/// The gRPC server's transport error, or the state folder.
pub async fn run(
    listeners: Listeners,
    engine: Engine,
    config: &Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let state_dir = config
        .state_dir
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join("edgesplit-prefill"));
    let secret = Secret::load(config.secret_file.as_deref())?.map(Arc::new);
    if secret.is_none() {
        tracing::warn!("no shared secret: the handoffs and the gRPC API are unauthenticated");
    }
    let svc = PrefillService::new(engine, config.limits(), state_dir)
        .map_err(|e| anyhow::anyhow!("state folder: {e}"))?
        .with_secret(secret.clone());
    let drain = Drain::new(shutdown, Duration::from_secs(config.drain_timeout_s));
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
            GrpcGuard {
                secret,
                seen: Arc::default(),
            },
        ))
        .serve_with_incoming_shutdown(TcpListenerStream::new(listeners.grpc), drain.started());
    let result = tokio::select! {
        result = grpc => result,
        () = drain.expired() => Ok(()),
    };
    let _ = stop_tx.send(true);
    let _ = http.await;
    Ok(result?)
}
