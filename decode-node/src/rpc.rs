//! The layer split's phone side (issue 17): a ggml RPC server that computes a model's last
//! layers for a prefill node, behind this node's authenticated link.
//!
//! ggml-rpc has no authentication, trusts the sizes its client sends and aborts its process
//! on a malformed message. So it runs in a child process of its own (`edgesplit-rpc`),
//! listening on loopback only, and is restarted when it exits; the network sees only
//! `--rpc-listen`, which admits a peer after the private link's handshake (TLS under the
//! shared secret, as every other channel between the devices) and then forwards its bytes
//! to the child. One peer at a time is served (ggml's server serves one client at a
//! time); a second waits in the child's accept queue.

use std::path::PathBuf;
use std::time::Duration;

use edgesplit_proto::link::Link;
use tokio::net::{TcpListener, TcpStream};

/// How long the child may take to answer ggml's HELLO after it starts.
const START_WAIT: Duration = Duration::from_secs(30);
/// Pause before restarting a child that exited.
const RESTART_PAUSE: Duration = Duration::from_secs(1);

/// The `edgesplit-rpc` binary next to this one.
fn server_binary() -> std::io::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let bin = exe.with_file_name("edgesplit-rpc");
    if bin.is_file() {
        Ok(bin)
    } else {
        Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("{} not found (built with the decode node)", bin.display()),
        ))
    }
}

/// A free loopback port for the child's endpoint.
fn loopback_endpoint() -> std::io::Result<String> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .to_string())
}

/// The child, its endpoint, and the write end of its stdin (held while it should run:
/// `Child::wait` would close it).
type Started = (
    tokio::process::Child,
    String,
    Option<tokio::process::ChildStdin>,
);

/// Starts the child on a loopback endpoint and waits until it answers ggml's HELLO.
async fn start_child(threads: i32) -> anyhow::Result<Started> {
    let endpoint = loopback_endpoint()?;
    // Its stdin is a pipe held by this process (in the `Child`): when this process ends,
    // however it ends, the pipe closes and the child exits.
    let mut child = tokio::process::Command::new(server_binary()?)
        .args(["--endpoint", &endpoint, "--threads", &threads.to_string()])
        .stdin(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let t0 = std::time::Instant::now();
    loop {
        let ep = endpoint.clone();
        let probe = tokio::task::spawn_blocking(move || {
            edgesplit_engine::rpc::probe(&ep, Duration::from_secs(2))
        })
        .await?;
        match probe {
            Ok(_) => {
                let stdin = child.stdin.take();
                return Ok((child, endpoint, stdin));
            }
            Err(e) if t0.elapsed() > START_WAIT => {
                anyhow::bail!("the RPC server did not start within {START_WAIT:?}: {e}")
            }
            Err(_) => {
                if let Some(status) = child.try_wait()? {
                    anyhow::bail!("the RPC server exited at start ({status})");
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// Serves the RPC listener until the process ends: the child is started (and restarted
/// when it exits), and each peer admitted by `link` is forwarded to it.
///
/// # Errors
/// The child cannot be started at all (its binary missing, or it never answers).
pub async fn serve(listener: TcpListener, link: Link, threads: i32) -> anyhow::Result<()> {
    let (mut child, endpoint, mut stdin) = start_child(threads).await?;
    tracing::info!(rpc = %listener.local_addr()?, pid = child.id(), "RPC server ready");
    let endpoint = std::sync::Arc::new(tokio::sync::RwLock::new(endpoint));
    let mut peers = link.listen(listener, Duration::from_secs(10));
    let ep = endpoint.clone();
    tokio::spawn(async move {
        loop {
            let status = child.wait().await;
            drop(stdin.take());
            tracing::warn!(?status, "the RPC server exited; restarting it");
            tokio::time::sleep(RESTART_PAUSE).await;
            match start_child(threads).await {
                Ok((c, e, i)) => {
                    tracing::info!(pid = c.id(), "RPC server restarted");
                    child = c;
                    stdin = i;
                    *ep.write().await = e;
                }
                Err(e) => {
                    tracing::error!(error = %e, "the RPC server could not be restarted");
                    return;
                }
            }
        }
    });
    while let Some((mut peer, addr)) = peers.next().await {
        let to = endpoint.read().await.clone();
        tokio::spawn(async move {
            tracing::info!(%addr, "RPC peer admitted");
            match TcpStream::connect(&to).await {
                Ok(mut server) => {
                    let _ = server.set_nodelay(true);
                    let r = tokio::io::copy_bidirectional(&mut peer, &mut server).await;
                    tracing::info!(%addr, ?r, "RPC peer gone");
                }
                Err(e) => tracing::warn!(%addr, error = %e, "the RPC server is not reachable"),
            }
        });
    }
    Ok(())
}
