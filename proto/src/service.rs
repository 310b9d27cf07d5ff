//! What every EdgeSplit binary does the same way: logging set-up and the shutdown signal.

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
