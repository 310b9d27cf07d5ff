//! EdgeSplit decode node: receives KV states over the V2 handoff (raw TCP), and serves
//! `Generate` over gRPC: import the state of a handoff, continue from its first token.
//!
//! Architecture invariant: a state reaches the engine only after the V2 receiver verified
//! its SHA-256, the sender's model fingerprint and build, and its tensor layout.

pub mod join;
pub mod metrics;
pub mod rpc;
pub mod store;
pub mod upload;

use std::future::{Future, IntoFuture};
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use edgesplit_engine::wire::{prompt_of, reuse_of, sampling_of, status, token_events};
use edgesplit_engine::{Engine, EngineConfig, SamplingParams, Start};
use edgesplit_proto::error::{self, ErrorCode};
use edgesplit_proto::handoff::{self, Limits};
use edgesplit_proto::pb;
use edgesplit_proto::service::NodeArgs;
use tokio::net::TcpListener;
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status};

pub use store::{Missing, Store, StoreLimits, Stored};

/// Command-line and environment configuration.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "edgesplit-decode", version, about)]
pub struct Config {
    #[command(flatten)]
    pub engine: edgesplit_engine::EngineArgs,
    #[command(flatten)]
    pub node: NodeArgs,
    #[command(flatten)]
    pub joining: join::JoinArgs,
    /// gRPC listen address.
    #[arg(
        long,
        env = "EDGESPLIT_DECODE_LISTEN",
        default_value = "127.0.0.1:50052"
    )]
    pub listen: String,
    /// V2 handoff listen address (raw TCP).
    #[arg(
        long,
        env = "EDGESPLIT_HANDOFF_LISTEN",
        default_value = "127.0.0.1:50061"
    )]
    pub handoff_listen: String,
    /// Address the prefill node should dial for the handoff (default: the bound address).
    #[arg(long)]
    pub handoff_advertise: Option<String>,
    /// V1 upload listen address (HTTP, HTTPS on a private link; also serves
    /// `GET /metrics`).
    #[arg(long, env = "EDGESPLIT_V1_LISTEN", default_value = "127.0.0.1:50062")]
    pub v1_listen: String,
    /// A plain HTTP listen address for `GET /metrics` alone. With a shared secret the V1
    /// port speaks only the private link's TLS, which a metrics scraper cannot: scrape
    /// this one instead.
    #[arg(long, env = "EDGESPLIT_DECODE_METRICS_LISTEN")]
    pub metrics_listen: Option<String>,
    /// Base URL the prefill node should upload V1 files to (default: from the bound address).
    #[arg(long)]
    pub v1_advertise: Option<String>,
    /// Answers written at once, each in its own context (`n_ctx` tokens of KV each:
    /// `--plan` counts them). They take turns token by token, so a short answer is not
    /// stuck behind a long one; more wait for a free slot.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub parallel: u32,
    /// KV memory one sequence may use, in bytes (0 = no budget). The router refuses
    /// requests whose prompt + max_tokens would need more, before they are prefilled, and
    /// the receiver refuses states that would. Size it from `--plan`.
    #[arg(long, default_value_t = 0)]
    pub kv_budget_bytes: u64,
    /// Print how many tokens of context fit in the memory available now, then exit.
    #[arg(long)]
    pub plan: bool,
    /// Seconds `Generate` waits for its handoff state to arrive.
    #[arg(long, default_value_t = 30)]
    pub handoff_wait_s: u64,
    /// Seconds an unclaimed state is kept.
    #[arg(long, default_value_t = 120)]
    pub pending_ttl_s: u64,
    /// Most bytes of unclaimed states held at once.
    #[arg(long, default_value_t = 2 * 1024 * 1024 * 1024)]
    pub max_pending_bytes: u64,
    /// Seconds allowed for a whole V1 upload body; past it, 408 `upload_timeout` and the
    /// partial file is deleted.
    #[arg(long, default_value_t = 120)]
    pub upload_timeout_s: u64,
    /// Largest handoff frame accepted, in bytes.
    #[arg(long, default_value_t = edgesplit_proto::frame::DEFAULT_MAX_FRAME)]
    pub max_frame_bytes: usize,
    /// The layer split: serve ggml's RPC here, for a prefill node's
    /// `--rpc-peer` to compute the model's last layers on this device. Behind the private
    /// link: needs the shared secret (refused without it, `--insecure` or not); ggml's own
    /// server runs in a child process (`edgesplit-rpc`) on loopback, which admits only
    /// this node's connections.
    #[arg(long, env = "EDGESPLIT_RPC_LISTEN")]
    pub rpc_listen: Option<String>,
}

impl Config {
    /// The engine configuration this node config asks for (CPU only).
    #[must_use]
    pub fn engine(&self) -> EngineConfig {
        let mut e = self.engine.config(self.parallel);
        e.n_gpu_layers = 0;
        e
    }
}

/// The gRPC service.
pub struct DecodeService {
    engine: Engine,
    store: Arc<Store>,
    handoff_addr: String,
    v1_url: String,
    kv_budget_bytes: u64,
    wait: Duration,
}

type EventStream<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

/// Where a `Generate` starts from: the stored state, or, for a tail (PROTOCOL.md,
/// "Tails"), the stored positions `n..` joined onto the cached prefix the request names
/// (its `n` tokens and the SHA-256 of its state). A tail without its prefix, or a prefix
/// that is not where the tail starts, is refused before the engine sees it.
fn start_of(
    f: edgesplit_proto::frame::StateFrame,
    first: i32,
    answered: u32,
    base_tokens: Vec<i32>,
    base_digest: &[u8],
) -> Result<Start, Status> {
    let invalid =
        |why: String| error::status(tonic::Code::InvalidArgument, ErrorCode::InvalidTail, why);
    let from = edgesplit_proto::splice::span(&f.payload).map_or(0, |s| s.start);
    if base_tokens.len() != from {
        return Err(invalid(format!(
            "handoff {} holds positions from {from}, and the request names a prefix of {} tokens",
            f.handoff_id,
            base_tokens.len()
        )));
    }
    if from == 0 {
        return Ok(Start::Imported {
            state: f.payload,
            tokens: f.tokens,
            first,
            answered,
            base_digest: None,
        });
    }
    let base_digest: [u8; 32] = base_digest.try_into().map_err(|_| {
        invalid(format!(
            "base_digest has {} bytes, not 32",
            base_digest.len()
        ))
    })?;
    let mut tokens = base_tokens;
    tokens.extend_from_slice(&f.tokens);
    Ok(Start::Imported {
        state: f.payload,
        tokens,
        first,
        answered,
        base_digest: Some(base_digest),
    })
}

#[tonic::async_trait]
impl pb::decode_server::Decode for DecodeService {
    type GenerateStream = EventStream<pb::TokenEvent>;
    type LocalStream = EventStream<pb::TokenEvent>;

    /// A conversation this node holds goes on here: its cached KV (the earlier answer this
    /// node wrote included) is reused, the rest of the prompt prefilled here, nothing
    /// crosses the link. Refused with `not_cached` (the cache untouched) when more than
    /// `max_uncached` tokens would have to be prefilled.
    async fn local(
        &self,
        request: Request<pb::PrefillRequest>,
    ) -> Result<Response<Self::LocalStream>, Status> {
        let req = request.into_inner();
        let (tokens, max_tokens) = prompt_of(&self.engine, &req, self.kv_budget_bytes).await?;
        let params = sampling_of(&req);
        let start = Start::Cached {
            tokens,
            reuse: reuse_of(&req),
            max_uncached: req.max_uncached,
        };
        tracing::info!(request_id = %req.request_id, "continuing a conversation held here");
        let rx = self
            .engine
            .generate(start, params, max_tokens)
            .await
            .map_err(|e| status(&e))?;
        Ok(Response::new(Box::pin(token_events(rx))))
    }

    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let req = request.into_inner();
        let state = match self.store.take(&req.handoff_id, self.wait).await {
            Ok(s) => s,
            Err(Missing::TimedOut) => {
                return Err(error::status(
                    tonic::Code::DeadlineExceeded,
                    ErrorCode::HandoffMissing,
                    format!(
                        "handoff {} did not arrive within {:?}",
                        req.handoff_id, self.wait
                    ),
                ))
            }
            Err(Missing::Dropped(why)) => {
                return Err(error::status(
                    tonic::Code::Unavailable,
                    ErrorCode::HandoffFailed,
                    format!("handoff {} will not arrive: {why}", req.handoff_id),
                ))
            }
        };
        let params = req
            .sampling
            .as_ref()
            .map(SamplingParams::from)
            .unwrap_or_default();
        let Some(&first) = req.first_token.as_ref() else {
            return Err(Status::invalid_argument("first_token is required"));
        };
        tracing::info!(
            request_id = %req.request_id,
            handoff_id = %req.handoff_id,
            "generating from handoff"
        );
        let Stored { state: f, receipt } = state;
        let start = start_of(f, first, req.answered, req.base_tokens, &req.base_digest)?;
        let rx = self
            .engine
            .generate(start, params, req.max_new_tokens)
            .await
            .map_err(|e| status(&e))?;
        // The answer's last event reports what receiving its state took.
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        let events = token_events(rx).map(move |ev| {
            ev.map(|mut ev| {
                if let Some(pb::token_event::Event::Finished(f)) = &mut ev.event {
                    f.receive_ms = ms(receipt.receive);
                    f.verify_ms = ms(receipt.verify);
                }
                ev
            })
        });
        Ok(Response::new(Box::pin(events)))
    }

    async fn info(&self, _: Request<pb::InfoRequest>) -> Result<Response<pb::NodeInfo>, Status> {
        let mut info = self.engine.node_info("decode");
        info.requests_in_flight = self.engine.in_flight();
        info.sequences_active = u32::try_from(self.engine.active()).unwrap_or(u32::MAX);
        info.handoffs_awaited = u32::try_from(self.store.awaited_count()).unwrap_or(u32::MAX);
        info.handoff_addr.clone_from(&self.handoff_addr);
        info.v1_url.clone_from(&self.v1_url);
        info.kv_budget_bytes = self.kv_budget_bytes;
        let c = &self.store.counters;
        info.handoff_bytes_received = c.bytes_received.load(Ordering::Relaxed);
        info.handoffs_received = c.handoffs_received.load(Ordering::Relaxed);
        info.handoffs_refused = c.handoffs_refused.load(Ordering::Relaxed);
        Ok(Response::new(info))
    }
}

/// How many tokens of KV fit in the memory available now, for this model and these KV
/// types, with the model's figures.
///
/// # Errors
/// The model cannot be read or loaded, or MemAvailable is not readable.
pub async fn memory_plan(
    config: &Config,
) -> anyhow::Result<(edgesplit_engine::MemoryPlan, edgesplit_engine::ModelInfo)> {
    let model_bytes = std::fs::metadata(&config.engine.model)?.len();
    let avail = edgesplit_engine::mem_available_bytes()
        .ok_or_else(|| anyhow::anyhow!("MemAvailable is not readable from /proc/meminfo"))?;
    // A small context and no warm-up: only the model's metadata matters here.
    let mut ecfg = config.engine();
    ecfg.n_ctx = 256;
    ecfg.n_parallel = 1;
    ecfg.warmup = false;
    let engine = Engine::start(ecfg).await?;
    let info = engine.info().clone();
    let p = edgesplit_engine::MemoryPlan::new(avail, model_bytes, info.kv_bytes_per_token);
    Ok((p, info))
}

/// `--plan`: how many tokens of context fit in the memory available now.
///
/// # Errors
/// The model cannot be read or loaded.
pub async fn print_plan(config: &Config) -> anyhow::Result<()> {
    let (p, info) = memory_plan(config).await?;
    let mib = |b: u64| b as f64 / (1024.0 * 1024.0);
    println!(
        "model            {} ({:.1} MiB, mapped)",
        config.engine.model.display(),
        mib(p.model_bytes)
    );
    println!(
        "KV per token     {} bytes (K {:?} + V {:?}, {} layers, from the GGUF metadata)",
        p.kv_bytes_per_token, config.engine.cache_type_k, config.engine.cache_type_v, info.n_layer
    );
    println!(
        "available now    {:.1} MiB (MemAvailable, not total RAM)",
        mib(p.mem_available)
    );
    println!(
        "safety margin    {:.1} MiB (max of 10% and 256 MiB)",
        mib(p.margin)
    );
    println!(
        "context that fits {} tokens ({:.1} MiB of KV), all sequences together",
        p.tokens,
        mib(p.kv_budget_bytes())
    );
    // Each of the --parallel contexts holds n_ctx tokens of KV. No more context than the
    // model was trained for, in steps of 256.
    let parallel = u64::from(config.parallel.max(1));
    let n_ctx = (p.tokens / parallel).min(u64::from(info.n_ctx_train)) / 256 * 256;
    println!(
        "suggested        --parallel {parallel} --n-ctx {n_ctx} --kv-budget-bytes {}  (model trained for {} tokens)",
        n_ctx * p.kv_bytes_per_token,
        info.n_ctx_train
    );
    Ok(())
}

/// The decode node's three listeners.
pub struct Listeners {
    /// gRPC control plane.
    pub grpc: TcpListener,
    /// V2 handoff (raw TCP).
    pub handoff: TcpListener,
    /// V1 uploads (HTTP), and `GET /metrics`.
    pub v1: TcpListener,
    /// `GET /metrics` alone, plain HTTP (`--metrics-listen`).
    pub metrics: Option<TcpListener>,
}

/// Serves gRPC, the V2 handoff and V1 uploads until `shutdown` resolves.
///
/// # Errors
/// The gRPC server's transport error, a listener's address, or the state folder.
pub async fn run(
    listeners: Listeners,
    engine: Engine,
    config: &Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let budget_tokens = match config.kv_budget_bytes {
        0 => u64::MAX,
        b => b / engine.info().kv_bytes_per_token.max(1),
    };
    let store = Arc::new(Store::new(StoreLimits {
        ttl: Duration::from_secs(config.pending_ttl_s),
        max_bytes: config.max_pending_bytes,
        // The receiver refuses states past the context or the KV budget.
        max_tokens: u32::try_from(budget_tokens.min(u64::from(engine.info().n_ctx)))
            .unwrap_or(u32::MAX),
    }));
    let Listeners {
        grpc,
        handoff: handoff_listener,
        v1: v1_listener,
        metrics: metrics_listener,
    } = listeners;
    let handoff_addr = match &config.handoff_advertise {
        Some(a) => a.clone(),
        None => handoff_listener.local_addr()?.to_string(),
    };
    let link = config.node.link(&[
        grpc.local_addr()?,
        handoff_listener.local_addr()?,
        v1_listener.local_addr()?,
    ])?;
    let secret = link.secret_arc();
    // The scheme follows the link: `https` when private, whatever was advertised.
    let v1_url = link.upload_url(&match &config.v1_advertise {
        Some(u) => u.clone(),
        None => format!("http://{}/v1/handoff", v1_listener.local_addr()?),
    });
    let upload_cfg = Arc::new(upload::UploadConfig {
        secret: secret.clone(),
        sealed: link.is_private(),
        seen: Arc::default(),
        store: store.clone(),
        // A V1 body is received into memory: no larger than a V2 frame may be.
        max_bytes: config
            .max_pending_bytes
            .min(u64::try_from(config.max_frame_bytes).unwrap_or(u64::MAX)),
        fingerprint_hex: engine.info().fingerprint_hex(),
        build_id: engine.info().build_id.clone(),
        kv_types: format!("{},{}", engine.info().type_k, engine.info().type_v),
        n_ctx: engine.info().n_ctx,
        timeout: Duration::from_secs(config.upload_timeout_s),
    });
    let limits = Limits {
        max_frame: config.max_frame_bytes,
        ..config.node.handoff_limits()
    };
    // The drain: gRPC takes no new calls and lets the answers it has finish. The handoff
    // and upload listeners stay open until then, but the store takes only the states a
    // `Generate` call is already waiting for (their clients have a first token); any other
    // could only be claimed by a call the draining node refuses.
    let drain = config.node.drain(shutdown);
    tokio::spawn({
        let (store, started) = (store.clone(), drain.started());
        async move {
            started.await;
            store.start_draining();
        }
    });
    let (served_tx, served) = tokio::sync::watch::channel(false);
    let grpc_done = move || {
        let mut served = served.clone();
        async move {
            let _ = served.wait_for(|done| *done).await;
        }
    };
    let receiver = tokio::spawn(handoff::serve(
        handoff_listener,
        engine.info().identity(),
        limits,
        store.clone(),
        link.clone(),
        grpc_done(),
    ));
    let sources = Arc::new(metrics::Sources {
        store: store.clone(),
        engine: engine.clone(),
    });
    let http = upload::router(upload_cfg).merge(metrics::router(sources.clone()));
    let metrics_server = metrics_listener.map(|l| {
        tokio::spawn(
            axum::serve(
                edgesplit_proto::service::http_listener(l),
                metrics::router(sources),
            )
            .with_graceful_shutdown(grpc_done())
            .into_future(),
        )
    });
    let v1_server = tokio::spawn(
        axum::serve(link.listen(v1_listener, limits.handshake), http)
            .with_graceful_shutdown(grpc_done())
            .into_future(),
    );
    let svc = DecodeService {
        engine,
        store,
        handoff_addr,
        v1_url,
        kv_budget_bytes: config.kv_budget_bytes,
        wait: Duration::from_secs(config.handoff_wait_s),
    };
    let grpc = tonic::transport::Server::builder()
        .add_service(pb::decode_server::DecodeServer::with_interceptor(
            svc,
            NodeArgs::guard(secret),
        ))
        .serve_with_incoming_shutdown(link.listen(grpc, limits.handshake), drain.started());
    let all = async {
        let result = grpc.await;
        let _ = served_tx.send(true);
        let _ = receiver.await;
        let _ = v1_server.await;
        if let Some(m) = metrics_server {
            let _ = m.await;
        }
        result
    };
    tokio::select! {
        result = all => Ok(result?),
        () = drain.expired() => Ok(()),
    }
}
