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
    /// Serve on a non-loopback address without a shared secret: every link in the clear
    /// and unauthenticated. Without this flag such a node refuses to start.
    #[arg(long)]
    pub insecure: bool,
}

/// Why a node will not serve as configured.
#[derive(Debug, thiserror::Error)]
pub enum LinkConfigError {
    #[error(transparent)]
    Secret(#[from] crate::auth::SecretError),
    #[error(transparent)]
    Link(#[from] crate::link::LinkError),
    #[error(
        "refusing to listen on {addr} without a shared secret: prompts, answers and KV states \
         would cross the network in the clear and anyone could call the node. Configure the \
         secret (--secret-file, EDGESPLIT_SECRET_FILE or EDGESPLIT_SECRET; \
         `scripts/secret.sh` makes one), or pass --insecure to serve in the clear anyway"
    )]
    Insecure { addr: std::net::SocketAddr },
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
            tracing::warn!(
                "no shared secret: the links are in the clear and the handoffs and the gRPC \
                 API are unauthenticated"
            );
        }
        Ok(secret.map(std::sync::Arc::new))
    }

    /// The node's link, from its shared secret: private (TLS keyed by the secret) when one
    /// is configured; plain otherwise, which only loopback listeners accept unless
    /// `--insecure` is given.
    ///
    /// # Errors
    /// The secret is unreadable or too short, or a listener in `listening` is not on
    /// loopback while no secret is configured and `--insecure` was not given.
    pub fn link(
        &self,
        listening: &[std::net::SocketAddr],
    ) -> Result<crate::link::Link, LinkConfigError> {
        let secret = self.secret()?;
        if secret.is_none() && !self.insecure {
            if let Some(addr) = listening.iter().find(|a| !a.ip().is_loopback()) {
                return Err(LinkConfigError::Insecure { addr: *addr });
            }
        }
        let link = crate::link::Link::new(secret)?;
        if let Some(f) = link.fingerprint() {
            tracing::info!(key = %f, "private links: TLS 1.3 keyed by the shared secret");
        }
        Ok(link)
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

    fn private() -> crate::link::Link {
        let secret = crate::auth::Secret::new(b"sixteen bytes at least", "test").unwrap();
        crate::link::Link::new(Some(std::sync::Arc::new(secret))).unwrap()
    }

    async fn bound() -> (tokio::net::TcpListener, std::net::SocketAddr) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let a = l.local_addr().unwrap();
        (l, a)
    }

    /// Both listeners, plain or private, hand out connections with Nagle's algorithm off,
    /// and a private link's client side has it off too.
    #[tokio::test]
    async fn accepted_connections_have_nodelay() {
        for link in [crate::link::Link::plain(), private()] {
            let (l, a) = bound().await;
            let mut incoming = link.listen(l, std::time::Duration::from_secs(5));
            let c = tokio::net::TcpStream::connect(a).await.unwrap();
            let dialed = tokio::spawn({
                let link = link.clone();
                async move { link.connect(c).await.unwrap() }
            });
            let (s, _) = incoming.next().await.unwrap();
            assert!(s.tcp().nodelay().unwrap());
            assert!(dialed.await.unwrap().tcp().nodelay().unwrap());
        }

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

#[cfg(test)]
mod link_tests {
    use super::{LinkConfigError, NodeArgs};

    fn args(secret_file: Option<std::path::PathBuf>, insecure: bool) -> NodeArgs {
        NodeArgs {
            secret_file,
            handoff_frame_timeout_s: 60,
            handoff_handshake_timeout_s: 10,
            drain_timeout_s: 30,
            insecure,
        }
    }

    /// No secret: loopback listeners are served in the clear; any other address is
    /// refused with a message naming it and the ways out, unless `--insecure`. A secret
    /// makes every address fine, over a private link.
    #[test]
    fn a_node_without_a_secret_serves_only_loopback_unless_insecure() {
        // The variables would stand in for the missing file.
        assert!(std::env::var_os("EDGESPLIT_SECRET").is_none());
        assert!(std::env::var_os("EDGESPLIT_SECRET_FILE").is_none());
        let lo: std::net::SocketAddr = "127.0.0.1:50052".parse().unwrap();
        let lo6: std::net::SocketAddr = "[::1]:50052".parse().unwrap();
        let any: std::net::SocketAddr = "0.0.0.0:50061".parse().unwrap();
        let link = args(None, false).link(&[lo, lo6]).unwrap();
        assert!(!link.is_private());
        let err = args(None, false).link(&[lo, any]).unwrap_err();
        assert!(matches!(err, LinkConfigError::Insecure { addr } if addr == any));
        let msg = err.to_string();
        assert!(
            msg.contains("0.0.0.0:50061") && msg.contains("--insecure"),
            "{msg}"
        );
        assert!(!args(None, true).link(&[any]).unwrap().is_private());

        let dir = std::env::temp_dir().join(format!("edgesplit-link-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("secret");
        std::fs::write(&file, "0123456789abcdef0123456789abcdef\n").unwrap();
        assert!(args(Some(file.clone()), false)
            .link(&[any])
            .unwrap()
            .is_private());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
