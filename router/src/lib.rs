//! EdgeSplit router: an OpenAI-compatible HTTP API (axum) that sends each prompt to a
//! prefill node and streams the answer back from a decode node.
//!
//! Modules: [`api`] parses and validates requests, [`backend`] drives the nodes over gRPC,
//! [`text`] turns token bytes into text (UTF-8, stop strings), [`respond`] builds the
//! OpenAI JSON and SSE chunks, [`server`] holds the routes, [`error`] the error table,
//! [`dashboard`] the web page at `/dashboard`.

pub mod api;
pub mod backend;
pub mod dashboard;
pub mod error;
pub mod metrics;
pub mod respond;
pub mod server;
pub mod text;

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
    /// Decode node gRPC URL.
    #[arg(
        long,
        env = "EDGESPLIT_DECODE_URL",
        default_value = "http://127.0.0.1:50052"
    )]
    pub decode_url: String,
    /// Default transport: v2 (disaggregated, framed TCP), v1 (disaggregated, llama.cpp state
    /// file by HTTP upload) or local (both phases on the prefill node).
    #[arg(long, default_value = "v2", value_parser = Transport::parse)]
    pub transport: Transport,
    /// Milliseconds allowed to connect to a node.
    #[arg(long, default_value_t = 2000)]
    pub connect_timeout_ms: u64,
    /// Milliseconds allowed for a node's info/health answer.
    #[arg(long, default_value_t = 3000)]
    pub info_timeout_ms: u64,
    /// Seconds allowed until the first token (long prompts prefill first).
    #[arg(long, default_value_t = 300)]
    pub first_token_timeout_s: u64,
    /// Largest request body, in bytes.
    #[arg(long, default_value_t = 8 * 1024 * 1024)]
    pub max_body_bytes: usize,
    /// The bench's SQLite record, whose newest run the dashboard shows.
    #[arg(long, env = "EDGESPLIT_BENCH_DB")]
    pub bench_db: Option<std::path::PathBuf>,
}

impl Config {
    /// Defaults pointing at the given node URLs.
    #[must_use]
    pub fn new(prefill_url: String, decode_url: String) -> Self {
        Self {
            listen: "127.0.0.1:0".into(),
            prefill_url,
            decode_url,
            transport: Transport::V2,
            connect_timeout_ms: 2000,
            info_timeout_ms: 3000,
            first_token_timeout_s: 300,
            max_body_bytes: 8 * 1024 * 1024,
            bench_db: None,
        }
    }
}

/// Serves the HTTP API on `listener` until `shutdown` resolves.
///
/// # Errors
/// A malformed node URL, or the server's I/O error.
pub async fn run(
    listener: TcpListener,
    config: &Config,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let backend = Backend::new(BackendConfig {
        prefill_url: config.prefill_url.clone(),
        decode_url: config.decode_url.clone(),
        connect_timeout: Duration::from_millis(config.connect_timeout_ms),
        info_timeout: Duration::from_millis(config.info_timeout_ms),
        first_token_timeout: Duration::from_secs(config.first_token_timeout_s),
    })?;
    let state = Arc::new(server::AppState {
        backend,
        metrics: Arc::new(metrics::Metrics::new()),
        default_transport: config.transport,
        max_body_bytes: config.max_body_bytes,
        started: std::time::Instant::now(),
        bench_db: config.bench_db.clone(),
    });
    axum::serve(listener, server::app(state))
        .with_graceful_shutdown(shutdown)
        .await?;
    Ok(())
}
