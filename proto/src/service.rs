//! What every EdgeSplit binary does the same way: logging set-up, the shutdown signal and the
//! drain, and the service flags and set-up both nodes share ([`NodeArgs`]).

/// Installs the tracing subscriber on stderr (stdout stays for output such as `--plan`):
/// `RUST_LOG` if set, else `default_filter`; one JSON object per line when
/// `EDGESPLIT_LOG_FORMAT=json` (for log shippers), text otherwise.
pub fn init_tracing(default_filter: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| default_filter.into());
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if std::env::var("EDGESPLIT_LOG_FORMAT").is_ok_and(|v| v == "json") {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// The connections of a gRPC listener, each with `TCP_NODELAY` set, for tonic's
/// `serve_with_incoming*` (which leaves the socket as it comes). A node streams one small
/// message per token; with Nagle's algorithm on, a token written while the previous one
/// is unacknowledged waits for that ACK (up to a round trip, or the peer's delayed-ACK
/// timer), so tokens would reach the router in bursts.
pub fn grpc_incoming(
    listener: tokio::net::TcpListener,
) -> impl futures::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    futures::stream::unfold(listener, |l| async move {
        let conn = l.accept().await.map(|(s, _)| {
            let _ = s.set_nodelay(true);
            s
        });
        Some((conn, l))
    })
}

/// An HTTP listener for `axum::serve` whose connections have `TCP_NODELAY` set (axum leaves
/// it off): on a kept-alive connection a streamed answer's first chunks otherwise wait for
/// the client's delayed ACK and reach it together (measured: the role chunk and the first
/// three tokens in one burst, ~40 ms late).
pub fn http_listener(
    listener: tokio::net::TcpListener,
) -> impl axum::serve::Listener<Io = tokio::net::TcpStream, Addr = std::net::SocketAddr> {
    use axum::serve::ListenerExt;
    listener.tap_io(|s| {
        let _ = s.set_nodelay(true);
    })
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM (systemd, `kill`, container stop).
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
    tracing::info!("shutdown signal received");
}

/// A node's shutdown in two steps: the signal starts the drain (stop accepting, let what
/// is in flight finish), and the deadline ends it whatever is left.
#[derive(Clone)]
pub struct Drain {
    started: tokio::sync::watch::Receiver<bool>,
    deadline: std::time::Duration,
}

impl Drain {
    /// Starts watching `shutdown`; the drain begins when it resolves.
    pub fn new(
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
        deadline: std::time::Duration,
    ) -> Self {
        let (tx, started) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            shutdown.await;
            tracing::info!(
                ?deadline,
                "draining: no new work; what is in flight may finish"
            );
            let _ = tx.send(true);
        });
        Drain { started, deadline }
    }

    /// Resolves when the drain begins.
    pub fn started(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.started.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    }

    /// Resolves when the drain deadline has passed.
    pub fn expired(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let (started, deadline) = (self.started(), self.deadline);
        async move {
            started.await;
            tokio::time::sleep(deadline).await;
            tracing::warn!("drain deadline passed; exiting with work unfinished");
        }
    }
}

/// The flags both nodes take for their service, and the set-up they do the same way:
/// the shared secret (and the warning without one), the gRPC guard, the drain.
#[derive(Debug, Clone, clap::Args)]
pub struct NodeArgs {
    /// File holding the secret shared by the router and both nodes (V2 handshake, V1
    /// uploads and gRPC calls are then authenticated). Also `EDGESPLIT_SECRET_FILE`, or the
    /// secret itself in `EDGESPLIT_SECRET`; never a flag with the secret in it.
    #[arg(long)]
    pub secret_file: Option<std::path::PathBuf>,
    /// Seconds allowed for the state transfer: the STATE frame (V2) from its first byte to
    /// its last, or the whole upload (V1), and the receiver's answer.
    #[arg(long, default_value_t = 60)]
    pub handoff_frame_timeout_s: u64,
    /// Seconds allowed for each handshake frame of a V2 handoff (HELLO, AUTH and replies).
    #[arg(long, default_value_t = 10)]
    pub handoff_handshake_timeout_s: u64,
    /// On SIGTERM: seconds the work in flight may take to finish before the node exits
    /// anyway (new calls and handoffs are refused meanwhile).
    #[arg(long, default_value_t = 30)]
    pub drain_timeout_s: u64,
}

impl NodeArgs {
    /// The shared secret, if one is configured; warns when none is.
    ///
    /// # Errors
    /// The secret file or variable is unreadable or too short.
    pub fn secret(
        &self,
    ) -> Result<Option<std::sync::Arc<crate::auth::Secret>>, crate::auth::SecretError> {
        let secret = crate::auth::Secret::load(self.secret_file.as_deref())?;
        if secret.is_none() {
            tracing::warn!("no shared secret: the handoffs and the gRPC API are unauthenticated");
        }
        Ok(secret.map(std::sync::Arc::new))
    }

    /// The interceptor that checks every gRPC call's credential (none without a secret).
    #[must_use]
    pub fn guard(secret: Option<std::sync::Arc<crate::auth::Secret>>) -> crate::auth::GrpcGuard {
        crate::auth::GrpcGuard {
            secret,
            seen: std::sync::Arc::default(),
        }
    }

    /// The node's drain, started by `shutdown`, bounded by `--drain-timeout-s`.
    pub fn drain(&self, shutdown: impl std::future::Future<Output = ()> + Send + 'static) -> Drain {
        Drain::new(
            shutdown,
            std::time::Duration::from_secs(self.drain_timeout_s),
        )
    }

    /// Handoff limits with this node's timeouts (the rest at their defaults).
    #[must_use]
    pub fn handoff_limits(&self) -> crate::handoff::Limits {
        crate::handoff::Limits {
            frame: std::time::Duration::from_secs(self.handoff_frame_timeout_s),
            handshake: std::time::Duration::from_secs(self.handoff_handshake_timeout_s),
            ..crate::handoff::Limits::default()
        }
    }
}

#[cfg(test)]
mod nodelay_tests {
    use axum::serve::Listener;
    use futures::StreamExt;

    async fn bound() -> (tokio::net::TcpListener, std::net::SocketAddr) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = l.local_addr().unwrap();
        (l, a)
    }

    /// Both listeners hand out connections with Nagle's algorithm off.
    #[tokio::test]
    async fn accepted_connections_have_nodelay() {
        let (l, a) = bound().await;
        let mut incoming = Box::pin(super::grpc_incoming(l));
        let _c = tokio::net::TcpStream::connect(a).await.unwrap();
        let s = incoming.next().await.unwrap().unwrap();
        assert!(s.nodelay().unwrap());

        let (l, a) = bound().await;
        let mut http = super::http_listener(l);
        let _c = tokio::net::TcpStream::connect(a).await.unwrap();
        let (s, _) = http.accept().await;
        assert!(s.nodelay().unwrap());
        // Without the helpers the sockets keep the default (Nagle on).
        let (l, a) = bound().await;
        let _c = tokio::net::TcpStream::connect(a).await.unwrap();
        let (s, _) = l.accept().await.unwrap();
        assert!(!s.nodelay().unwrap());
    }
}
