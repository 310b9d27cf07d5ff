use std::process::ExitCode;

use clap::Parser;
use edgesplit_prefill::supervise::{self, Role};

fn main() -> anyhow::Result<ExitCode> {
    // Before any thread starts: an engine process takes its inherited listeners (and
    // removes their variables from its environment) here.
    let role = supervise::role()?;
    tokio::runtime::Runtime::new()?.block_on(node(role))
}

async fn node(role: Role) -> anyhow::Result<ExitCode> {
    edgesplit_proto::service::init_tracing("info,llama-cpp-2=warn,llama_cpp_2=warn");
    let config = edgesplit_prefill::Config::parse();
    edgesplit_engine::mem_budget_bytes().map_err(anyhow::Error::msg)?;
    let mut engine_config = config.engine();
    if config.plan {
        let (Some(peer), Some(layers)) = (&config.rpc_peer, config.rpc_layers) else {
            anyhow::bail!("--plan needs --rpc-peer and --rpc-layers");
        };
        let peer_addr = tokio::net::lookup_host(peer)
            .await?
            .next()
            .ok_or_else(|| anyhow::anyhow!("--rpc-peer {peer}: no address"))?;
        let link = config.node.link(&[peer_addr])?;
        let plan = edgesplit_prefill::rpc::plan(
            &engine_config,
            layers,
            config.decode_url.as_deref(),
            &link,
        )
        .await?;
        print!("{plan}");
        return Ok(ExitCode::SUCCESS);
    }
    let (grpc, metrics, restarts, supervised) = match role {
        // The layer split runs its engine in a process of its own (ggml's RPC client
        // aborts when the peer is lost): this one only holds the listeners.
        Role::Supervisor if config.rpc_peer.is_some() => {
            return supervise::supervise(&config.listen, &config.metrics_listen).await;
        }
        Role::Supervisor => (
            tokio::net::TcpListener::bind(&config.listen).await?,
            tokio::net::TcpListener::bind(&config.metrics_listen).await?,
            0,
            false,
        ),
        Role::Engine {
            grpc,
            metrics,
            restarts,
        } => (
            tokio::net::TcpListener::from_std(grpc)?,
            tokio::net::TcpListener::from_std(metrics)?,
            restarts,
            true,
        ),
    };
    let split = edgesplit_prefill::rpc::start(&config, &mut engine_config, restarts).await?;
    let engine = edgesplit_engine::Engine::start(engine_config).await?;
    let listeners = edgesplit_prefill::Listeners { grpc, metrics };
    tracing::info!(
        grpc = %listeners.grpc.local_addr()?,
        metrics = %listeners.metrics.local_addr()?,
        "prefill node listening"
    );
    if let Some(split) = &split {
        let counters = split.counters.clone();
        tokio::spawn(async move {
            counters.lost().await;
            // ggml's client would abort at its next send, or wait for an answer forever:
            // this process ends now, and its supervisor starts another on its listeners.
            tracing::error!("the RPC peer is lost: this engine process ends");
            // SAFETY: _exit(2) ends the process at once, without running destructors
            // while the engine thread may be inside ggml.
            unsafe { libc::_exit(supervise::PEER_LOST) };
        });
    }
    if supervised {
        supervise::ready();
    }
    edgesplit_prefill::run(
        listeners,
        engine,
        &config,
        split,
        edgesplit_proto::service::shutdown_signal(),
    )
    .await?;
    Ok(ExitCode::SUCCESS)
}
