//! The layer split's phone side: a ggml RPC server that computes a model's last
//! layers for a prefill node, behind this node's authenticated link.
//!
//! ggml-rpc has no authentication, trusts the sizes its client sends and aborts its process
//! on a malformed message. So it runs in a child process of its own (`edgesplit-rpc`),
//! listening on a loopback port it binds itself, and is restarted when it exits; the
//! network sees only `--rpc-listen` (which needs the shared secret: [`check`]), which
//! admits a peer after the private link's handshake (TLS under the shared secret, as every
//! other channel between the devices) and then forwards its bytes to the child, sending
//! the child's token first ([`TOKEN_BYTES`]): another process on this device that reaches
//! the child's port is closed unanswered. One peer at a time is served (ggml's server
//! serves one client at a time); a second waits in the child's accept queue.

use std::path::PathBuf;
use std::time::Duration;

use edgesplit_proto::link::Link;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
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

/// Bytes of the token the decode node gives its `edgesplit-rpc` child (on its stdin) and
/// sends first on each connection to it: the child hands ggml no connection without it,
/// so another process on this device reaching the child's loopback port gets nothing.
pub const TOKEN_BYTES: usize = 32;

/// What the child prints (stdout) once it listens, before the address.
const LISTENING: &str = "edgesplit-rpc listening on ";

/// The child, its endpoint, and the write end of its stdin (held while it should run:
/// `Child::wait` would close it).
type Started = (
    tokio::process::Child,
    String,
    Option<tokio::process::ChildStdin>,
);

/// Starts the child on a loopback port it binds itself (port 0: no moment in which
/// another process could take a port chosen here), gives it `token`, reads the address
/// it reports and waits until it answers ggml's HELLO.
async fn start_child(threads: i32, token: &[u8; TOKEN_BYTES]) -> anyhow::Result<Started> {
    // Its stdin is a pipe held by this process (in the `Child`): when this process ends,
    // however it ends, the pipe closes and the child exits.
    let mut child = tokio::process::Command::new(server_binary()?)
        .args([
            "--endpoint",
            "127.0.0.1:0",
            "--threads",
            &threads.to_string(),
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut stdin = child.stdin.take();
    if let Some(i) = stdin.as_mut() {
        i.write_all(format!("{}\n", hex::encode(token)).as_bytes())
            .await?;
    }
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| anyhow::anyhow!("the RPC server's stdout"))?;
    let mut lines = BufReader::new(stdout).lines();
    let endpoint = tokio::time::timeout(START_WAIT, async {
        while let Some(line) = lines.next_line().await? {
            if let Some(addr) = line.strip_prefix(LISTENING) {
                return anyhow::Ok(addr.trim().to_string());
            }
            tracing::debug!(%line, "RPC server");
        }
        anyhow::bail!("the RPC server exited at start ({:?})", child.try_wait())
    })
    .await
    .map_err(|_| anyhow::anyhow!("the RPC server did not listen within {START_WAIT:?}"))??;
    // The rest of its output (ggml's per-connection lines), so that it never blocks on
    // a full pipe.
    tokio::spawn(async move {
        while let Ok(Some(line)) = lines.next_line().await {
            tracing::debug!(%line, "RPC server");
        }
    });
    let t0 = std::time::Instant::now();
    loop {
        let (ep, first) = (endpoint.clone(), token.to_vec());
        let probe = tokio::task::spawn_blocking(move || {
            edgesplit_engine::rpc::probe_after(&ep, &first, Duration::from_secs(2))
        })
        .await?;
        match probe {
            Ok(_) => return Ok((child, endpoint, stdin)),
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

/// Refuses `--rpc-listen` without a shared secret, `--insecure` or not: ggml's RPC is
/// never reachable without it (the layer split's peers share one anyway).
///
/// # Errors
/// `rpc_listen` is set and no secret is.
pub fn check(rpc_listen: Option<&str>, has_secret: bool) -> anyhow::Result<()> {
    if let Some(addr) = rpc_listen {
        anyhow::ensure!(
            has_secret,
            "--rpc-listen {addr} needs the shared secret (--secret-file, \
             EDGESPLIT_SECRET_FILE or EDGESPLIT_SECRET; the prefill node's): ggml's RPC \
             server has no authentication of its own, so it is served only behind the \
             private link, --insecure or not"
        );
    }
    Ok(())
}

/// Serves the RPC listener until the process ends: the child is started (and restarted
/// when it exits), and each peer admitted by `link` is forwarded to it.
///
/// # Errors
/// The child cannot be started at all (its binary missing, or it never answers).
pub async fn serve(listener: TcpListener, link: Link, threads: i32) -> anyhow::Result<()> {
    let token: [u8; TOKEN_BYTES] = rand::random();
    let (mut child, endpoint, mut stdin) = start_child(threads, &token).await?;
    tracing::info!(rpc = %listener.local_addr()?, pid = child.id(), child = %endpoint, "RPC server ready");
    let endpoint = std::sync::Arc::new(tokio::sync::RwLock::new(endpoint));
    let mut peers = link.listen(listener, Duration::from_secs(10));
    let ep = endpoint.clone();
    tokio::spawn(async move {
        loop {
            let status = child.wait().await;
            drop(stdin.take());
            tracing::warn!(?status, "the RPC server exited; restarting it");
            tokio::time::sleep(RESTART_PAUSE).await;
            match start_child(threads, &token).await {
                Ok((c, e, i)) => {
                    tracing::info!(pid = c.id(), child = %e, "RPC server restarted");
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
            let server = async {
                let mut s = TcpStream::connect(&to).await?;
                s.set_nodelay(true)?;
                s.write_all(&token).await?;
                std::io::Result::Ok(s)
            };
            match server.await {
                Ok(mut server) => {
                    let r = tokio::io::copy_bidirectional(&mut peer, &mut server).await;
                    tracing::info!(%addr, ?r, "RPC peer gone");
                }
                Err(e) => tracing::warn!(%addr, error = %e, "the RPC server is not reachable"),
            }
        });
    }
    Ok(())
}
