//! The layer split's process boundary on the laptop side.
//!
//! ggml's RPC client aborts its process when a send or receive to the peer fails ("Remote
//! RPC server crashed or returned malformed response"): a phone that leaves the Wi-Fi
//! mid-answer would take the prefill node down with it. So a prefill node with
//! `--rpc-peer` is two processes: this supervisor, which binds the node's listeners and
//! holds them for its whole life, and an engine process (the same binary, the same
//! arguments), which inherits the listeners and serves on them. When the engine process
//! ends after it was ready, whatever the cause, the supervisor starts another on the same
//! sockets: connections made meanwhile wait in the listeners' backlog instead of being
//! refused, the answer that was running ends with an error at the router (its stream
//! breaks), and the node goes on serving. A restarted engine process reaches for the peer
//! again (for `--rpc-reconnect-s`); if the peer stays gone and the model fits here alone, it serves
//! every layer here (and says so in `Info.layer_split`), otherwise it exits and is tried
//! again after a pause.
//!
//! The first engine process's failure at start (a peer down, a plan that does not fit) is
//! the node's: the supervisor exits with its status, as an unsupervised node would.
//! The engine process ends with its supervisor: its stdin is a pipe from it, which closes
//! however the supervisor ends (a SIGKILL included). SIGTERM and SIGINT are passed on, so
//! a drain works as it does without the split.

use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::process::ExitCode;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};

/// The inherited listeners' descriptors, `GRPC,METRICS`: set only in an engine process.
const FDS_ENV: &str = "EDGESPLIT_PREFILL_LISTEN_FDS";
/// How many engine processes ran before this one (0 for the first).
const RESTARTS_ENV: &str = "EDGESPLIT_PREFILL_RESTARTS";
/// An engine process's exit status when its RPC peer is lost (`EX_TEMPFAIL`).
pub const PEER_LOST: i32 = 75;
/// The line an engine process prints on its stdout once it serves.
const READY: &str = "edgesplit-prefill: engine ready";
/// Pauses before restarting an engine process: the first, and the longest after repeated
/// failures.
const PAUSE: Duration = Duration::from_millis(500);
const MAX_PAUSE: Duration = Duration::from_secs(10);

/// This process's place: the supervisor of an engine process, or the engine process.
pub enum Role {
    /// No `FDS_ENV`: bind the listeners and supervise.
    Supervisor,
    /// An engine process: its inherited listeners and how many ran before it.
    Engine {
        grpc: std::net::TcpListener,
        metrics: std::net::TcpListener,
        restarts: u32,
    },
}

/// This process's role, from its environment.
///
/// # Errors
/// `FDS_ENV` is set but does not name two listening sockets.
pub fn role() -> anyhow::Result<Role> {
    let Ok(fds) = std::env::var(FDS_ENV) else {
        return Ok(Role::Supervisor);
    };
    let parsed: Vec<RawFd> = fds
        .split(',')
        .map(str::parse)
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow::anyhow!("{FDS_ENV}={fds:?}: {e}"))?;
    let [g, m] = parsed[..] else {
        anyhow::bail!("{FDS_ENV}={fds:?}: two descriptors expected");
    };
    anyhow::ensure!(
        g > 2 && m > 2 && g != m,
        "{FDS_ENV}={fds:?}: not inherited listeners"
    );
    // SAFETY: the supervisor cleared close-on-exec on exactly these two descriptors, its
    // listeners, before starting this process; nothing else here owns them, and this runs
    // once (the variable is removed below, before any thread could read it again).
    let (grpc, metrics) = unsafe {
        (
            std::net::TcpListener::from_raw_fd(g),
            std::net::TcpListener::from_raw_fd(m),
        )
    };
    // Not sockets, or not listening: refused here rather than at the first accept.
    grpc.local_addr()?;
    metrics.local_addr()?;
    grpc.set_nonblocking(true)?;
    metrics.set_nonblocking(true)?;
    let restarts = std::env::var(RESTARTS_ENV)
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(0);
    // Before the runtime's threads are started (main's first lines): nothing reads the
    // environment meanwhile.
    std::env::remove_var(FDS_ENV);
    std::env::remove_var(RESTARTS_ENV);
    // Ends with the supervisor: its end of this pipe closes however it ends.
    std::thread::spawn(|| {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        std::process::exit(0);
    });
    Ok(Role::Engine {
        grpc,
        metrics,
        restarts,
    })
}

/// Tells the supervisor that this engine process serves.
pub fn ready() {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{READY}");
    let _ = out.flush();
}

/// Binds `grpc` and `metrics` and runs engine processes on them until a signal ends the
/// node or the first one fails at start. The exit code is the last engine process's.
///
/// # Errors
/// A listener cannot be bound, or the binary cannot be started at all.
pub async fn supervise(grpc: &str, metrics: &str) -> anyhow::Result<ExitCode> {
    let grpc = std::net::TcpListener::bind(grpc)?;
    let metrics = std::net::TcpListener::bind(metrics)?;
    tracing::info!(
        grpc = %grpc.local_addr()?,
        metrics = %metrics.local_addr()?,
        pid = std::process::id(),
        "prefill node supervising its engine process (layer split)"
    );
    let fds = [grpc.as_raw_fd(), metrics.as_raw_fd()];
    let exe = std::env::current_exe()?;
    let args: Vec<_> = std::env::args_os().skip(1).collect();
    let mut shutdown = std::pin::pin!(edgesplit_proto::service::shutdown_signal());
    let mut pause = PAUSE;
    let mut restarts = 0u32;
    loop {
        let mut cmd = tokio::process::Command::new(&exe);
        cmd.args(&args)
            .env(FDS_ENV, format!("{},{}", fds[0], fds[1]))
            .env(RESTARTS_ENV, restarts.to_string())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true);
        // SAFETY: the closure only calls fcntl, which is async-signal-safe, on the two
        // listeners' descriptors, which stay open in this process for its whole life.
        unsafe {
            cmd.pre_exec(move || {
                for fd in fds {
                    let flags = libc::fcntl(fd, libc::F_GETFD);
                    if flags < 0 || libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                Ok(())
            });
        }
        let mut child = cmd.spawn()?;
        let pid = child.id();
        // Held while the engine process should run: dropping it ends the process.
        let stdin = child.stdin.take();
        let (ready_tx, mut ready_rx) = tokio::sync::watch::channel(false);
        if let Some(out) = child.stdout.take() {
            tokio::spawn(async move {
                let mut lines = BufReader::new(out).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    if line == READY {
                        let _ = ready_tx.send(true);
                    } else {
                        println!("{line}");
                    }
                }
            });
        }
        tracing::info!(pid, restarts, "engine process started");
        let status = tokio::select! {
            status = child.wait() => status?,
            () = &mut shutdown => {
                if let Some(pid) = pid.and_then(|p| i32::try_from(p).ok()) {
                    // SAFETY: a plain kill(2) of our own child, still unreaped (its
                    // `Child` is held), so the pid is not another process's.
                    unsafe { libc::kill(pid, libc::SIGTERM) };
                }
                let status = child.wait().await?;
                drop(stdin);
                return Ok(exit_code(status));
            }
        };
        drop(stdin);
        let was_ready = *ready_rx.borrow_and_update();
        if restarts == 0 && !was_ready {
            // The node's own start failed (its message is on stderr, which it shares).
            return Ok(exit_code(status));
        }
        if status.success() {
            return Ok(ExitCode::SUCCESS);
        }
        pause = if was_ready {
            PAUSE
        } else {
            (pause * 2).min(MAX_PAUSE)
        };
        tracing::warn!(
            %status,
            pid,
            was_ready,
            next_in_ms = u64::try_from(pause.as_millis()).unwrap_or(u64::MAX),
            "the engine process ended (the RPC peer lost?); restarting it on the same listeners"
        );
        tokio::time::sleep(pause).await;
        restarts = restarts.saturating_add(1);
    }
}

/// A child's status as this process's exit code (a signal: 128 + its number, as shells do).
fn exit_code(status: std::process::ExitStatus) -> ExitCode {
    use std::os::unix::process::ExitStatusExt;
    let code = status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(1);
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}
