//! EdgeSplit router: an OpenAI-compatible HTTP API (axum) that sends each prompt to a
//! prefill node and streams the answer back from a decode node.
//!
//! Modules: [`api`] parses and validates requests, [`backend`] drives the nodes over gRPC,
//! [`text`] turns token bytes into text (UTF-8, stop strings), [`respond`] builds the
//! OpenAI JSON and SSE chunks, [`server`] holds the routes, [`error`] the error table,
//! [`dashboard`] the web page at `/dashboard`.

pub mod admin;
pub mod api;
pub mod backend;
pub mod dashboard;
pub mod error;
pub mod estimate;
pub mod join;
pub mod metrics;
mod node_json;
pub mod openai;
pub mod placement;
pub mod recent;
pub mod respond;
pub mod server;
pub mod state;
pub mod text;
pub mod tools;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;

pub use api::Transport;
pub use backend::{Backend, BackendConfig};

/// Command-line and environment configuration.
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "edgesplit-router", version, about)]
pub struct Config {
    /// HTTP listen address.
    #[arg(
        long,
        env = "EDGESPLIT_ROUTER_LISTEN",
        default_value = "127.0.0.1:8080"
    )]
    pub listen: String,
    /// Prefill node gRPC URL.
    #[arg(
        long,
        env = "EDGESPLIT_PREFILL_URL",
        default_value = "http://127.0.0.1:50051"
    )]
    pub prefill_url: String,
    /// Decode node gRPC URL; repeated (or comma-separated in the variable) for a pool of
    /// decode nodes, each request going to the one that serves it best. `none`: no decode
    /// node at start (devices that join with a code, or `/admin/decode-nodes`, add them);
    /// until one is added, every request is answered on the prefill node.
    #[arg(
        long,
        env = "EDGESPLIT_DECODE_URL",
        value_delimiter = ',',
        default_value = "http://127.0.0.1:50052"
    )]
    pub decode_url: Vec<String>,
    /// Default transport: auto (the default: the router chooses local, v2 live or after, or
    /// phone per request from measured rates, the link and the load, under `--objective`;
    /// a v2 split while nothing is measured), v2 (every request split, framed TCP), v1
    /// (disaggregated, llama.cpp state file by HTTP upload), local (both phases on the
    /// prefill node), layers (local on a prefill node with a layer split, `--rpc-peer`) or
    /// phone (both phases on the decode node).
    #[arg(long, default_value = "auto", value_parser = Transport::parse)]
    pub transport: Transport,
    /// What `--transport auto` optimizes (a request's `edgesplit.objective` overrides it):
    /// latency (the soonest expected end of the answer), offload (the least prefill-node
    /// time among the modes expected to end within 1.5x the soonest), balanced (latency
    /// while the prefill node runs no other answer, offload while it does).
    #[arg(long, value_enum, default_value_t = api::Objective::Balanced)]
    pub objective: api::Objective,
    /// Default handoff mode of split answers (a request's `edgesplit.handoff` overrides
    /// it): `live` keeps the answer flowing from the prefill node while the state crosses
    /// and hands over at a token boundary (V2; a V1 answer is always `after`); `after`
    /// sends the state once after the first token.
    #[arg(long, value_enum, default_value_t = api::HandoffMode::Live)]
    pub handoff: api::HandoffMode,
    /// Milliseconds allowed to connect to a node.
    #[arg(long, default_value_t = 2000)]
    pub connect_timeout_ms: u64,
    /// Milliseconds allowed for a node's info/health answer.
    #[arg(long, default_value_t = 3000)]
    pub info_timeout_ms: u64,
    /// Seconds allowed until the first token (long prompts prefill first).
    #[arg(long, default_value_t = 300)]
    pub first_token_timeout_s: u64,
    /// When the handoff fails (after the prefill node's one retry) or the decode node dies
    /// mid-answer: `fallback` finishes the answer on the prefill node, continuing after the
    /// tokens already sent (the client sees one uninterrupted answer); `fail` ends it with
    /// an error.
    #[arg(long, value_enum, default_value_t = OnSplitFailure::Fallback)]
    pub on_split_failure: OnSplitFailure,
    /// Where a new turn of a conversation the decode node holds is prefilled: `measured`
    /// chooses from the nodes' measured prefill speeds and the link's goodput
    /// (ARCHITECTURE.md, "Conversations"); `prefill-node` always sends it to the prefill
    /// node, which then ships only the new part's KV (a tail), as a deployment whose
    /// prefill device is much faster than its decode device would have it chosen.
    #[arg(long, value_enum, default_value_t = backend::ContinueOn::Measured)]
    pub continue_on: backend::ContinueOn,
    /// Measure the devices and the link only through the answers served: no calibration
    /// at start and no probes at idle moments (`auto`'s first choices are then made
    /// without figures).
    #[arg(long)]
    pub no_probes: bool,
    /// Longest wait, in milliseconds, for the next token of an answer before the node
    /// writing it counts as failed, on an idle node; a node running other answers gets the
    /// work they have queued there on top (as the router reckons it), at most eight times
    /// this.
    #[arg(long, default_value_t = 15_000)]
    pub token_idle_timeout_ms: u64,
    /// When the decode node fails while the handoff's outcome is not known yet:
    /// milliseconds to wait for that outcome, whose error names the cause better.
    #[arg(long, default_value_t = 1_000)]
    pub handoff_error_grace_ms: u64,
    /// When the decode node ends an answer before the prefill node reported the handoff:
    /// milliseconds to wait for that report (its figures go into the response).
    #[arg(long, default_value_t = 5_000)]
    pub handoff_report_wait_ms: u64,
    /// Largest request body, in bytes.
    #[arg(long, default_value_t = 8 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// File holding the secret shared with both nodes: the links to them are then TLS
    /// keyed by the secret, and every gRPC call carries a credential. Also
    /// `EDGESPLIT_SECRET_FILE`, or the secret in `EDGESPLIT_SECRET`.
    #[arg(long)]
    pub secret_file: Option<std::path::PathBuf>,
    /// File holding the API key clients must send as `Authorization: Bearer <key>` (also
    /// `EDGESPLIT_API_KEY_FILE`, or the key itself in `EDGESPLIT_API_KEY`). Without one,
    /// the API is open, which only a loopback `--listen` accepts unless `--insecure`.
    #[arg(long, env = "EDGESPLIT_API_KEY_FILE")]
    pub api_key_file: Option<std::path::PathBuf>,
    /// Serve the API on a non-loopback address without an API key: anyone who can reach
    /// it can use the model and read the nodes' details on `/health` (logged as a warning
    /// at start). Without this, such a router refuses to start.
    #[arg(long)]
    pub insecure: bool,
    /// On SIGTERM/SIGINT: seconds to let answers in flight finish (new requests get 503 and
    /// `/health` says `draining` meanwhile) before exiting anyway.
    #[arg(long, default_value_t = 30)]
    pub drain_timeout_s: u64,
    /// Answers the router works on at once (0 = no limit); more wait in a queue. Default:
    /// the sequences the decode node serves at once (its `--parallel`: read at start, 4 if
    /// it does not answer then, and again every 10 s), so a split answer never waits for a
    /// decode slot after its first token - the wait happens here, before the prefill,
    /// where it is bounded and visible.
    #[arg(long)]
    pub max_in_flight: Option<usize>,
    /// Requests that may wait for a slot; beyond it, 503 `queue_full` with Retry-After.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Longest wait in the queue, in seconds, before 503 `queue_timeout`.
    #[arg(long, default_value_t = 60)]
    pub queue_timeout_s: u64,
    /// Take devices that join with a code (`edgesplit-decode --join CODE`) on this TCP
    /// address, e.g. `0.0.0.0:47475` (needs the shared secret, which a joined device
    /// receives). Off when not given.
    #[arg(long, env = "EDGESPLIT_JOIN_LISTEN")]
    pub join_listen: Option<String>,
    /// With `--join-listen`: answer devices looking for the router on this UDP port
    /// (broadcast); 0 turns it off.
    #[arg(long, default_value_t = edgesplit_proto::join::DISCOVERY_PORT)]
    pub discovery_port: u16,
    /// With `--join-listen`: the model file a joined device that lacks it receives (over
    /// the private link, SHA-256 checked, resumable); the prefill node's file.
    #[arg(long, env = "EDGESPLIT_SHARE_MODEL")]
    pub share_model: Option<std::path::PathBuf>,
    /// With `--join-listen`: open a pairing at start and print its code (valid 5 minutes,
    /// once). `POST /admin/pairing` opens one while the router serves.
    #[arg(long)]
    pub pair: bool,
    /// Where the router keeps its joined devices (`devices.json`, mode 0600). Default:
    /// `$XDG_STATE_HOME/edgesplit`, else `~/.local/state/edgesplit`.
    #[arg(long, env = "EDGESPLIT_STATE_DIR")]
    pub state_dir: Option<std::path::PathBuf>,
    /// The bench's SQLite record, whose newest run the dashboard shows.
    #[arg(long, env = "EDGESPLIT_BENCH_DB")]
    pub bench_db: Option<std::path::PathBuf>,
}

/// What the router does when a split answer's handoff or decode node fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OnSplitFailure {
    /// Finish the answer on the prefill node, after the tokens already sent.
    Fallback,
    /// End the answer with an in-band error.
    Fail,
}

impl Config {
    /// The flags' defaults (as `--help` states them, the only place they are written),
    /// pointing at the given node URLs and listening on an ephemeral loopback port.
    #[must_use]
    pub fn new(prefill_url: String, decode_url: String) -> Self {
        use clap::Parser;
        Self::parse_from([
            "edgesplit-router",
            "--listen",
            "127.0.0.1:0",
            "--prefill-url",
            &prefill_url,
            "--decode-url",
            &decode_url,
        ])
    }
}

/// The decode node's default `--parallel`: the admission limit when the node cannot be
/// asked at start.
const DEFAULT_DECODE_PARALLEL: usize = 4;

/// How often the default admission limit re-reads the decode node's sequences.
const FOLLOW_DECODE_EVERY: Duration = Duration::from_secs(10);

/// How often the router asks the prefill node for its `Info` in the background, and how
/// old the answer a request uses may be (older: the request asks itself). A request then
/// makes no `Info` call on its path; a prefill node that changed (restarted, lost its
/// layer split's peer) is seen within a second.
const PREFILL_INFO_EVERY: Duration = Duration::from_secs(1);
pub(crate) const PREFILL_INFO_MAX_AGE: Duration = Duration::from_secs(3);

/// Serves the HTTP API on `listener` until `shutdown` resolves.
///
/// # Errors
/// A malformed node URL, or the server's I/O error.
pub async fn run(
    listener: TcpListener,
    config: &Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let secret = edgesplit_proto::auth::Secret::load(config.secret_file.as_deref())?.map(Arc::new);
    // The nodes' links: private (TLS keyed by the secret) when there is one.
    let link = edgesplit_proto::link::Link::new(secret)?;
    let joining = match &config.join_listen {
        Some(addr) => {
            let listener = TcpListener::bind(addr)
                .await
                .map_err(|e| anyhow::anyhow!("--join-listen {addr}: {e}"))?;
            let dir = config
                .state_dir
                .clone()
                .unwrap_or_else(join::default_state_dir);
            let joins = join::Joins::open(
                &dir,
                &link,
                listener.local_addr()?.port(),
                config.share_model.clone(),
            )?;
            Some((Arc::new(joins), listener))
        }
        None => None,
    };
    if let Some(f) = link.fingerprint() {
        tracing::info!(key = %f, "private links to the nodes: TLS 1.3 keyed by the shared secret");
    }
    let api_key = load_api_key(config.api_key_file.as_deref())?;
    exposure_allowed(listener.local_addr()?, api_key.is_some(), config.insecure)?;
    let pool = backend::Pool::new(
        BackendConfig {
            prefill_url: config.prefill_url.clone(),
            decode_url: String::new(),
            connect_timeout: Duration::from_millis(config.connect_timeout_ms),
            info_timeout: Duration::from_millis(config.info_timeout_ms),
            first_token_timeout: Duration::from_secs(config.first_token_timeout_s),
            fallback: config.on_split_failure == OnSplitFailure::Fallback,
            token_idle_timeout: Duration::from_millis(config.token_idle_timeout_ms),
            handoff_error_grace: Duration::from_millis(config.handoff_error_grace_ms),
            handoff_report_wait: Duration::from_millis(config.handoff_report_wait_ms),
            handoff: config.handoff,
            continue_on: config.continue_on,
            objective: config.objective,
            link,
            probes: !config.no_probes,
        },
        &config
            .decode_url
            .iter()
            .filter(|u| !u.is_empty() && u.as_str() != "none")
            .cloned()
            .collect::<Vec<_>>(),
    )?;
    if let Some((joins, _)) = &joining {
        // The qualified joined devices where they last were, each under its own key; each
        // announces itself again.
        for d in joins.devices().into_iter().filter(|d| d.qualified) {
            if let Some(url) = d.url.filter(|u| !pool.urls().contains(u)) {
                if let Ok(pair) = pool.pair_with(&url, &d.id) {
                    let _ = pool.adopt(pair).await;
                }
            }
        }
    }
    pool.watch().await;
    let max_in_flight = match config.max_in_flight {
        Some(n) => n,
        None => {
            let n = pool
                .decode_parallel()
                .await
                .unwrap_or(DEFAULT_DECODE_PARALLEL);
            tracing::info!(
                max_in_flight = n,
                "admission limit: the decode nodes' sequences"
            );
            n
        }
    };
    let follow_decode = config.max_in_flight.is_none();
    let state = Arc::new(state::AppState {
        pool,
        metrics: Arc::new(metrics::Metrics::new()),
        default_transport: config.transport,
        objective: config.objective,
        max_body_bytes: config.max_body_bytes,
        started: std::time::Instant::now(),
        bench_db: config.bench_db.clone(),
        api_key,
        draining: std::sync::atomic::AtomicBool::new(false),
        joins: joining.as_ref().map(|(j, _)| j.clone()),
        admission: state::Admission::new(
            max_in_flight,
            config.max_queue,
            Duration::from_secs(config.queue_timeout_s),
        ),
    });
    {
        let state = Arc::downgrade(&state);
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(PREFILL_INFO_EVERY);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                let Some(s) = state.upgrade() else {
                    return;
                };
                let _ = s.pool.first().prefill_info().await;
            }
        });
    }
    {
        // Which decode nodes are usable (`backend/pool.rs`).
        let state = Arc::downgrade(&state);
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(backend::WATCH_EVERY);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                let Some(s) = state.upgrade() else {
                    return;
                };
                // A pool of one uses its node whatever its state.
                if s.pool.len() > 1 {
                    s.pool.watch().await;
                }
            }
        });
    }
    if !config.no_probes {
        // The calibration, then the idle moments' probes (`backend/probe.rs`).
        let state = Arc::downgrade(&state);
        tokio::spawn(async move {
            if let Some(s) = state.upgrade() {
                s.pool.calibrate().await;
            }
            let mut ticks = tokio::time::interval(backend::IDLE_TICK);
            ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                ticks.tick().await;
                let Some(s) = state.upgrade() else {
                    return;
                };
                s.pool.measure_idle().await;
            }
        });
    }
    if let Some((joins, listener)) = joining {
        tracing::info!(addr = %listener.local_addr()?, "devices may join with a code");
        if config.discovery_port != 0 {
            let udp = tokio::net::UdpSocket::bind(("0.0.0.0", config.discovery_port))
                .await
                .map_err(|e| anyhow::anyhow!("--discovery-port {}: {e}", config.discovery_port))?;
            tokio::spawn(joins.clone().answer_finds(udp));
        }
        if config.pair {
            let code = joins.pair(join::PAIRING_TTL);
            // On the terminal, not in the log: the code is a password until it is used.
            println!(
                "Join code: {code} (valid {} min, once). On the device: \
                 edgesplit-decode --join {code} --model MODEL.gguf",
                join::PAIRING_TTL.as_secs() / 60
            );
        }
        tokio::spawn(joins.serve(listener, Arc::downgrade(&state)));
    }
    if follow_decode {
        // The decode node may start after the router, or restart with another --parallel.
        tokio::spawn(state::follow_decode(
            Arc::downgrade(&state),
            FOLLOW_DECODE_EVERY,
            |s| &s.admission,
            |s| Box::pin(s.pool.decode_parallel()),
        ));
    }
    let drain = Duration::from_secs(config.drain_timeout_s);
    let drained = Arc::new(tokio::sync::Notify::new());
    let stop = {
        let (state, drained) = (state.clone(), drained.clone());
        async move {
            shutdown.await;
            drain_in_flight(&state, drain).await;
            drained.notify_one();
        }
    };
    let server = axum::serve(
        edgesplit_proto::service::http_listener(listener),
        server::app(state),
    )
    .with_graceful_shutdown(stop);
    tokio::select! {
        r = server => r?,
        // After the drain, idle keep-alive connections close at once; anything still open
        // (a client that stopped reading) does not keep the process alive.
        () = async {
            drained.notified().await;
            tokio::time::sleep(Duration::from_secs(2)).await;
        } => tracing::warn!("connections still open after the drain; exiting"),
    }
    Ok(())
}

/// Refuses new requests and waits, up to `deadline`, for the answers in flight.
async fn drain_in_flight(state: &state::AppState, deadline: Duration) {
    use std::sync::atomic::Ordering;
    state.draining.store(true, Ordering::SeqCst);
    let in_flight = || state.metrics.running.get() + state.metrics.waiting.get();
    tracing::info!(
        in_flight = in_flight(),
        deadline_s = deadline.as_secs(),
        "draining: new requests get 503, answers in flight may finish"
    );
    let t0 = std::time::Instant::now();
    while in_flight() > 0 && t0.elapsed() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    match in_flight() {
        0 => tracing::info!("drained"),
        n => tracing::warn!(
            in_flight = n,
            "drain deadline passed; exiting with answers unfinished"
        ),
    }
}

/// The nodes' rule for the API: a non-loopback address needs an API key, or `--insecure`
/// (then logged as a warning that names what is exposed).
///
/// # Errors
/// A non-loopback `addr` without a key or `--insecure`, naming the ways out.
fn exposure_allowed(addr: std::net::SocketAddr, keyed: bool, insecure: bool) -> anyhow::Result<()> {
    if keyed || addr.ip().is_loopback() {
        return Ok(());
    }
    anyhow::ensure!(
        insecure,
        "refusing to serve the API on {addr} without an API key: anyone who can reach it \
         could use the model and read the nodes' details on /health. Give a key \
         (--api-key-file, EDGESPLIT_API_KEY_FILE or EDGESPLIT_API_KEY; deploy/laptop.sh \
         makes one), listen on 127.0.0.1, or pass --insecure to serve it open anyway"
    );
    tracing::warn!(
        %addr,
        "--insecure: the API is open on {addr} without a key: anyone who can reach it can \
         use the model and read the nodes' addresses, memory and layer split on /health"
    );
    Ok(())
}

/// The API key: from `file`, else `EDGESPLIT_API_KEY`; `None` when neither is set.
///
/// # Errors
/// An unreadable or empty key file.
fn load_api_key(file: Option<&std::path::Path>) -> anyhow::Result<Option<String>> {
    let key = match file {
        Some(p) => std::fs::read_to_string(p)
            .map_err(|e| anyhow::anyhow!("cannot read the API key file {}: {e}", p.display()))?,
        None => std::env::var("EDGESPLIT_API_KEY").unwrap_or_default(),
    };
    let key = key.trim().to_string();
    if key.is_empty() {
        anyhow::ensure!(file.is_none(), "the API key file is empty");
        return Ok(None);
    }
    Ok(Some(key))
}

#[cfg(test)]
mod tests {
    use super::exposure_allowed;

    /// Loopback is served open; any other address needs a key or `--insecure`, and the
    /// refusal names the address and the ways out.
    #[test]
    fn the_api_is_open_only_on_loopback_unless_insecure() {
        let lo = "127.0.0.1:8080".parse().unwrap();
        let any = "0.0.0.0:8080".parse().unwrap();
        let lan = "192.168.1.20:8080".parse().unwrap();
        assert!(exposure_allowed(lo, false, false).is_ok());
        assert!(exposure_allowed("[::1]:8080".parse().unwrap(), false, false).is_ok());
        for addr in [any, lan] {
            let msg = exposure_allowed(addr, false, false)
                .unwrap_err()
                .to_string();
            assert!(
                msg.contains(&addr.to_string()) && msg.contains("--insecure"),
                "{msg}"
            );
            assert!(msg.contains("--api-key-file"), "{msg}");
            assert!(exposure_allowed(addr, true, false).is_ok());
            assert!(exposure_allowed(addr, false, true).is_ok());
        }
    }
}
