//! The layer split's laptop side: the model's last layers are computed by a
//! decode node's ggml RPC server (`--rpc-peer`, its `--rpc-listen`).
//!
//! ggml's RPC client speaks plain TCP and aborts the process when it cannot connect or
//! send. It is pointed at a forwarder on this machine's loopback, which reaches the peer
//! over the private link (TLS under the shared secret; no secret: loopback peers only);
//! before ggml connects, ggml's HELLO is sent through that forwarder
//! ([`edgesplit_engine::rpc::probe`]), so a peer that is down, refuses the secret or
//! speaks another version is a clear error at start, not an abort. A peer lost while
//! serving still ends the engine process (ggml aborts); its supervisor
//! ([`crate::supervise`]) starts another on the same listeners, which reaches for the peer
//! again ([`start`]).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use edgesplit_engine::RemoteLayers;
use edgesplit_proto::link::Link;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpListener;

/// Each step of reaching the peer (connect, handshake, HELLO) within this.
const REACH: Duration = Duration::from_secs(10);
/// A peer that vanishes without closing its connection (a phone that left the Wi-Fi sends
/// no FIN) is noticed by TCP itself: data left unacknowledged this long, or a silent
/// connection unanswered to keepalive probes after 5 s + 3 x 2 s, breaks it (Linux's
/// `TCP_USER_TIMEOUT` and keepalive). ggml's own client waits forever.
const USER_TIMEOUT: Duration = Duration::from_secs(15);

/// Keepalive and the user timeout on the connection to the peer.
fn watch_link(tcp: &tokio::net::TcpStream) -> std::io::Result<()> {
    let s = socket2::SockRef::from(tcp);
    s.set_tcp_keepalive(
        &socket2::TcpKeepalive::new()
            .with_time(Duration::from_secs(5))
            .with_interval(Duration::from_secs(2))
            .with_retries(3),
    )?;
    s.set_tcp_user_timeout(Some(USER_TIMEOUT))
}

/// What crossed the forwarder since this process started.
#[derive(Debug, Default)]
pub struct RpcCounters {
    sent: AtomicU64,
    received: AtomicU64,
    round_trips: AtomicU64,
    /// ggml has sent since the peer last answered.
    awaiting: AtomicBool,
    /// A connection's peer side ended while ggml's was open.
    lost: tokio::sync::Notify,
}

impl RpcCounters {
    fn sent(&self, n: usize) {
        self.sent.fetch_add(n as u64, Ordering::Relaxed);
        self.awaiting.store(true, Ordering::Relaxed);
    }

    /// The first bytes of an answer after ggml sent are one round trip: ggml's client
    /// waits for each answer before its next request.
    fn received(&self, n: usize) {
        self.received.fetch_add(n as u64, Ordering::Relaxed);
        if self.awaiting.swap(false, Ordering::Relaxed) {
            self.round_trips.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Resolves once the peer is lost: a connection's peer side ended (closed, reset, or
    /// timed out by TCP) while ggml still used it. ggml's client would abort at its next
    /// send, or wait forever for an answer.
    pub async fn lost(&self) {
        self.lost.notified().await;
    }

    /// Round trips, bytes sent, bytes received.
    #[must_use]
    pub fn figures(&self) -> (u64, u64, u64) {
        (
            self.round_trips.load(Ordering::Relaxed),
            self.sent.load(Ordering::Relaxed),
            self.received.load(Ordering::Relaxed),
        )
    }
}

/// The layer split this engine process serves, for `Info` and `/metrics`.
#[derive(Debug)]
pub struct Split {
    /// `"split"`, or `"lost"` (the peer could not be reached again after a restart; the
    /// model is computed here alone).
    pub state: &'static str,
    pub n_layer: u32,
    pub peer_layers: u32,
    pub peer: String,
    pub restarts: u32,
    pub counters: Arc<RpcCounters>,
}

impl Split {
    /// The `Info` message.
    #[must_use]
    pub fn info(&self) -> edgesplit_proto::pb::LayerSplit {
        let (round_trips, bytes_sent, bytes_received) = self.counters.figures();
        edgesplit_proto::pb::LayerSplit {
            state: self.state.into(),
            layers_here: self.n_layer - self.peer_layers,
            peer_layers: self.peer_layers,
            peer: self.peer.clone(),
            round_trips,
            bytes_sent,
            bytes_received,
            restarts: self.restarts,
        }
    }
}

/// Copies `from` to `to` until `from` ends, telling `count` each chunk's size.
async fn relay(
    mut from: impl AsyncRead + Unpin,
    mut to: impl AsyncWrite + Unpin,
    count: impl Fn(usize),
) -> std::io::Result<()> {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let n = from.read(&mut buf).await?;
        if n == 0 {
            return to.shutdown().await;
        }
        count(n);
        to.write_all(&buf[..n]).await?;
        to.flush().await?;
    }
}

/// Whether the TCP connection from `from` to `to` (both on loopback) was made by this
/// process: the forwarder serves ggml's client, which runs here, and no other process
/// (ggml's protocol has no credential of its own). Linux: the connecting socket's inode
/// from `/proc/net/tcp`, looked for among this process's descriptors.
///
/// # Errors
/// `/proc` cannot be read (then nothing is admitted).
fn made_here(from: std::net::SocketAddr, to: std::net::SocketAddr) -> std::io::Result<bool> {
    let table = std::fs::read_to_string("/proc/net/tcp")?;
    let Some(inode) = socket_inode(&table, from, to) else {
        return Ok(false);
    };
    let wanted = format!("socket:[{inode}]");
    for fd in std::fs::read_dir("/proc/self/fd")? {
        if std::fs::read_link(fd?.path()).is_ok_and(|l| l.as_os_str() == wanted.as_str()) {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The inode of the IPv4 socket in `table` (`/proc/net/tcp`'s text) whose local address
/// is `local` and remote `remote`.
fn socket_inode(
    table: &str,
    local: std::net::SocketAddr,
    remote: std::net::SocketAddr,
) -> Option<u64> {
    // "0100007F:1F90": the address as the kernel's u32 in this machine's byte order, then
    // the port.
    let parse = |field: &str| -> Option<std::net::SocketAddr> {
        let (ip, port) = field.split_once(':')?;
        let ip = u32::from_str_radix(ip, 16).ok()?.to_ne_bytes();
        Some(
            (
                std::net::Ipv4Addr::from(ip),
                u16::from_str_radix(port, 16).ok()?,
            )
                .into(),
        )
    };
    table.lines().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        let matches = f.len() > 9 && parse(f[1]) == Some(local) && parse(f[2]) == Some(remote);
        matches.then(|| f[9].parse().ok()).flatten()
    })
}

/// Starts the forwarder to `peer` and registers the peer's RPC device with ggml: the
/// engine's `remote_layers` for `layers` layers.
///
/// # Errors
/// No shared secret is set, or the peer cannot be reached,
/// refuses the link, or does not answer ggml's HELLO.
pub async fn connect(
    peer: &str,
    layers: u32,
    link: Link,
    counters: Arc<RpcCounters>,
) -> anyhow::Result<RemoteLayers> {
    anyhow::ensure!(
        link.is_private(),
        "--rpc-peer {peer} needs the shared secret (--secret-file, EDGESPLIT_SECRET_FILE or \
         EDGESPLIT_SECRET; the decode node's): its --rpc-listen serves only behind the \
         private link"
    );
    let local = TcpListener::bind("127.0.0.1:0").await?;
    let at = local.local_addr()?;
    let endpoint = at.to_string();
    let target = peer.to_string();
    tokio::spawn(async move {
        // The first connection is the probe's (below), the others ggml's own.
        let mut probe = true;
        while let Ok((ggml, from)) = local.accept().await {
            match made_here(from, at) {
                Ok(true) => {}
                Ok(false) => {
                    tracing::warn!(%from, "refused a connection to the RPC forwarder from another process");
                    continue;
                }
                Err(e) => {
                    tracing::error!(%from, error = %e, "refused a connection to the RPC forwarder: its process cannot be told (/proc/net/tcp)");
                    continue;
                }
            }
            let (link, target, counters) = (link.clone(), target.clone(), counters.clone());
            let ggmls = !std::mem::replace(&mut probe, false);
            tokio::spawn(async move {
                let _ = ggml.set_nodelay(true);
                match link.dial(&target, REACH).await {
                    Ok(remote) => {
                        if let Err(e) = watch_link(remote.tcp()) {
                            tracing::warn!(error = %e, "no keepalive on the RPC link");
                        }
                        let (from_ggml, to_ggml) = tokio::io::split(ggml);
                        let (from_peer, to_peer) = tokio::io::split(remote);
                        let c = counters.clone();
                        let up = relay(from_ggml, to_peer, |n| c.sent(n));
                        let down = relay(from_peer, to_ggml, |n| counters.received(n));
                        tokio::pin!(up, down);
                        // ggml closes its connection only with its process: the peer's
                        // side ending first is the peer lost. (A probe that fails is an
                        // error of its own, at start.)
                        tokio::select! {
                            _ = &mut up => {
                                let _ = down.await;
                            }
                            r = &mut down => if ggmls {
                                tracing::error!(peer = %target, result = ?r, "the RPC peer is lost");
                                counters.lost.notify_one();
                            }
                        }
                    }
                    Err(e) => tracing::warn!(peer = %target, error = %e, "RPC peer not reached"),
                }
            });
        }
    });
    let ep = endpoint.clone();
    let version = tokio::task::spawn_blocking(move || edgesplit_engine::rpc::probe(&ep, REACH))
        .await?
        .map_err(|e| anyhow::anyhow!("--rpc-peer {peer}: {e}"))?;
    let device =
        tokio::task::spawn_blocking(move || edgesplit_engine::rpc::add_server(&endpoint)).await??;
    tracing::info!(
        %peer,
        layers,
        device,
        forwarder = %at,
        version = %format!("{}.{}.{}", version.0, version.1, version.2),
        "layer split: the last layers on the RPC peer"
    );
    Ok(RemoteLayers { device, layers })
}

/// The layer split of `engine` as `config` asks for it (`--rpc-peer`, `--rpc-layers`):
/// planned, the peer reached and set as the engine's `remote_layers`. `restarts` engine
/// processes ran before this one: a restarted one tries the peer for
/// `--rpc-reconnect-s`, and if it stays gone and the model fits here alone, serves every
/// layer here (state `"lost"`).
///
/// # Errors
/// As [`plan`] and [`connect`]; after a restart, only when the model does not fit here.
pub async fn start(
    config: &crate::Config,
    engine: &mut edgesplit_engine::EngineConfig,
    restarts: u32,
) -> anyhow::Result<Option<Split>> {
    let (Some(peer), Some(layers)) = (&config.rpc_peer, config.rpc_layers) else {
        return Ok(None);
    };
    let peer_addr = tokio::net::lookup_host(peer)
        .await?
        .next()
        .ok_or_else(|| anyhow::anyhow!("--rpc-peer {peer}: no address"))?;
    let link = config.node.link(&[peer_addr])?;
    let counters = Arc::new(RpcCounters::default());
    let until = Instant::now() + Duration::from_secs(config.rpc_reconnect_s);
    loop {
        let attempt = async {
            let plan = plan(engine, layers, config.decode_url.as_deref(), &link).await?;
            tracing::info!(plan = %plan, "layer split planned");
            let remote = if plan.peer_layers > 0 {
                Some(connect(peer, plan.peer_layers, link.clone(), counters.clone()).await?)
            } else {
                None
            };
            anyhow::Ok((plan, remote))
        };
        let e = match attempt.await {
            Ok((plan, remote)) => {
                engine.remote_layers = remote;
                return Ok(Some(Split {
                    state: "split",
                    n_layer: plan.n_layer,
                    peer_layers: plan.peer_layers,
                    peer: peer.clone(),
                    restarts,
                    counters,
                }));
            }
            Err(e) => e,
        };
        if restarts == 0 {
            return Err(e);
        }
        if Instant::now() < until {
            tracing::warn!(error = %e, "the RPC peer is not back yet");
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        let alone = fits_alone(engine)?;
        anyhow::ensure!(
            alone.here.fits(),
            "the RPC peer is lost ({e:#}) and the model does not fit here alone:\n{alone}"
        );
        tracing::warn!(
            error = %e,
            "the RPC peer is lost: every layer is computed here (the model fits); restart \
             the node to split it again"
        );
        return Ok(Some(Split {
            state: "lost",
            n_layer: alone.n_layer,
            peer_layers: 0,
            peer: peer.clone(),
            restarts,
            counters,
        }));
    }
}

/// The plan with every layer here, checked against this machine's memory only.
fn fits_alone(
    engine: &edgesplit_engine::EngineConfig,
) -> anyhow::Result<edgesplit_engine::layer_plan::LayerPlan> {
    let (model, here, cells) = this_side(engine)?;
    let kv = (engine.cache_type_k, engine.cache_type_v);
    Ok(edgesplit_engine::layer_plan::LayerPlan::with(
        &model,
        0,
        cells,
        kv,
        here,
        u64::MAX,
    ))
}

/// A plan's figures from this side: the GGUF's layers, this machine's available memory,
/// and the KV cells each layer holds.
fn this_side(
    engine: &edgesplit_engine::EngineConfig,
) -> anyhow::Result<(edgesplit_engine::layer_plan::ModelLayers, u64, u64)> {
    let model = edgesplit_engine::layer_plan::model_layers(&engine.model_path)
        .map_err(anyhow::Error::msg)?;
    let here = edgesplit_engine::mem_available_bytes()
        .ok_or_else(|| anyhow::anyhow!("MemAvailable is not readable from /proc/meminfo"))?;
    let cells = u64::from(engine.n_ctx) * u64::from(engine.n_parallel.max(1));
    Ok((model, here, cells))
}

/// `--rpc-layers`: a count, or `auto` (the plan's fewest).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RpcLayers {
    Auto,
    Count(u32),
}

impl std::str::FromStr for RpcLayers {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s == "auto" {
            return Ok(RpcLayers::Auto);
        }
        s.parse()
            .map(RpcLayers::Count)
            .map_err(|_| format!("--rpc-layers takes a layer count or auto, not {s:?}"))
    }
}

/// The decode node's `MemAvailable`, from its `Info` (not from ggml, whose CPU device
/// reports total RAM).
async fn peer_available(decode_url: &str, link: &Link) -> anyhow::Result<u64> {
    let channel = link.grpc_channel(decode_url, REACH)?;
    let mut client = edgesplit_proto::pb::decode_client::DecodeClient::with_interceptor(
        channel,
        edgesplit_proto::auth::GrpcCredentials(link.secret_arc()),
    );
    let info = tokio::time::timeout(REACH, client.info(edgesplit_proto::pb::InfoRequest {}))
        .await
        .map_err(|_| anyhow::anyhow!("--decode-url {decode_url}: no Info within {REACH:?}"))?
        .map_err(|e| anyhow::anyhow!("--decode-url {decode_url}: {}", e.message()))?
        .into_inner();
    anyhow::ensure!(
        info.mem_available_bytes > 0,
        "--decode-url {decode_url}: the decode node reports no available memory"
    );
    Ok(info.mem_available_bytes)
}

/// The layer split's plan: `layers` (a count, checked, or the fewest that fit) from this
/// machine's and the peer's available memory and the GGUF's layer sizes, for
/// `kv_cells` cells of KV per layer. Without `decode_url` only this side is checked (a
/// count) or nothing can be planned (`auto`).
///
/// # Errors
/// The GGUF cannot be read, a memory figure is missing, or the plan does not fit (its
/// numbers).
pub async fn plan(
    engine: &edgesplit_engine::EngineConfig,
    layers: RpcLayers,
    decode_url: Option<&str>,
    link: &Link,
) -> anyhow::Result<edgesplit_engine::layer_plan::LayerPlan> {
    use edgesplit_engine::layer_plan::LayerPlan;
    let (model, here, cells) = this_side(engine)?;
    let peer = match decode_url {
        Some(url) => Some(peer_available(url, link).await?),
        None => None,
    };
    let kv = (engine.cache_type_k, engine.cache_type_v);
    match (layers, peer) {
        (RpcLayers::Auto, None) => anyhow::bail!(
            "--rpc-layers auto needs --decode-url (the decode node's available memory)"
        ),
        (RpcLayers::Auto, Some(peer)) => {
            LayerPlan::fewest(&model, cells, kv, here, peer).map_err(anyhow::Error::msg)
        }
        (RpcLayers::Count(n), peer) => {
            let p = LayerPlan::with(&model, n, cells, kv, here, peer.unwrap_or(u64::MAX));
            anyhow::ensure!(
                p.here.fits() && (peer.is_none() || p.peer.fits()),
                "--rpc-layers {n} does not fit:\n{p}"
            );
            Ok(p)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Another process connecting to the forwarder's loopback port is told apart from
    /// this one (ggml's client runs here).
    #[test]
    fn the_forwarder_tells_this_process_connections_from_another_s() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let at = l.local_addr().unwrap();
        let _mine = std::net::TcpStream::connect(at).unwrap();
        let (_a, from) = l.accept().unwrap();
        assert!(made_here(from, at).unwrap());
        let script = format!("exec 3<>/dev/tcp/127.0.0.1/{}; sleep 30", at.port());
        let mut other = std::process::Command::new("bash")
            .args(["-c", &script])
            .spawn()
            .unwrap();
        let (_b, from) = l.accept().unwrap();
        let theirs = made_here(from, at);
        let _ = other.kill();
        let _ = other.wait();
        assert!(!theirs.unwrap());
    }

    #[test]
    fn a_socket_is_found_in_proc_net_tcp_by_both_addresses() {
        let table = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:9C40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 1111 1 0 100 0 0 10 0
   1: 0100007F:D431 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 2222 1 0 20 4 30 10 -1
   2: 0100007F:9C40 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 3333 1 0 20 4 30 10 -1
";
        let a = |p: u16| std::net::SocketAddr::from(([127, 0, 0, 1], p));
        if cfg!(target_endian = "little") {
            assert_eq!(socket_inode(table, a(0xD431), a(0x9C40)), Some(2222));
            assert_eq!(socket_inode(table, a(0x9C40), a(0xD431)), Some(3333));
        }
        assert_eq!(socket_inode(table, a(1), a(0x9C40)), None);
    }
}
