//! The layer split's laptop side (issue 17): the model's last layers are computed by a
//! decode node's ggml RPC server (`--rpc-peer`, its `--rpc-listen`).
//!
//! ggml's RPC client speaks plain TCP and aborts the process when it cannot connect or
//! send. It is pointed at a forwarder on this machine's loopback, which reaches the peer
//! over the private link (TLS under the shared secret; no secret: loopback peers only);
//! before ggml connects, ggml's HELLO is sent through that forwarder
//! ([`edgesplit_engine::rpc::probe`]), so a peer that is down, refuses the secret or
//! speaks another version is a clear error at start, not an abort. A peer lost while
//! serving still ends this process (ggml aborts): run the layer split as a node of its own.

use std::time::Duration;

use edgesplit_engine::RemoteLayers;
use edgesplit_proto::link::Link;
use tokio::net::TcpListener;

/// Each step of reaching the peer (connect, handshake, HELLO) within this.
const REACH: Duration = Duration::from_secs(10);

/// Starts the forwarder to `peer` and registers the peer's RPC device with ggml: the
/// engine's `remote_layers` for `layers` layers.
///
/// # Errors
/// The peer is not a loopback address while the link is plain, or it cannot be reached,
/// refuses the link, or does not answer ggml's HELLO.
pub async fn connect(peer: &str, layers: u32, link: Link) -> anyhow::Result<RemoteLayers> {
    if !link.is_private() {
        let loopback = peer
            .parse::<std::net::SocketAddr>()
            .is_ok_and(|a| a.ip().is_loopback());
        anyhow::ensure!(
            loopback,
            "--rpc-peer {peer} is not on loopback and no shared secret is set: ggml's RPC \
             would cross the network unauthenticated (set --secret-file on both devices)"
        );
    }
    let local = TcpListener::bind("127.0.0.1:0").await?;
    let endpoint = local.local_addr()?.to_string();
    let target = peer.to_string();
    tokio::spawn(async move {
        while let Ok((mut ggml, _)) = local.accept().await {
            let (link, target) = (link.clone(), target.clone());
            tokio::spawn(async move {
                let _ = ggml.set_nodelay(true);
                match link.dial(&target, REACH).await {
                    Ok(mut remote) => {
                        let _ = tokio::io::copy_bidirectional(&mut ggml, &mut remote).await;
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
        version = %format!("{}.{}.{}", version.0, version.1, version.2),
        "layer split: the last layers on the RPC peer"
    );
    Ok(RemoteLayers { device, layers })
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
    use edgesplit_engine::layer_plan::{model_layers, LayerPlan};
    let model = model_layers(&engine.model_path).map_err(anyhow::Error::msg)?;
    let here = edgesplit_engine::mem_available_bytes()
        .ok_or_else(|| anyhow::anyhow!("MemAvailable is not readable from /proc/meminfo"))?;
    let peer = match decode_url {
        Some(url) => Some(peer_available(url, link).await?),
        None => None,
    };
    let cells = u64::from(engine.n_ctx) * u64::from(engine.n_parallel.max(1));
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
