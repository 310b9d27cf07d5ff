use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    edgesplit_proto::service::init_tracing("info,llama-cpp-2=warn,llama_cpp_2=warn");
    let config = edgesplit_prefill::Config::parse();
    edgesplit_engine::mem_budget_bytes().map_err(anyhow::Error::msg)?;
    let mut engine_config = config.engine();
    if let (Some(peer), Some(layers)) = (&config.rpc_peer, config.rpc_layers) {
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
        if config.plan {
            print!("{plan}");
            return Ok(());
        }
        tracing::info!(plan = %plan, "layer split planned");
        if plan.peer_layers > 0 {
            let remote = edgesplit_prefill::rpc::connect(peer, plan.peer_layers, link).await?;
            engine_config.remote_layers = Some(remote);
        }
    }
    let engine = edgesplit_engine::Engine::start(engine_config).await?;
    let listeners = edgesplit_prefill::Listeners {
        grpc: tokio::net::TcpListener::bind(&config.listen).await?,
        metrics: tokio::net::TcpListener::bind(&config.metrics_listen).await?,
    };
    tracing::info!(
        grpc = %listeners.grpc.local_addr()?,
        metrics = %listeners.metrics.local_addr()?,
        "prefill node listening"
    );
    edgesplit_prefill::run(
        listeners,
        engine,
        &config,
        edgesplit_proto::service::shutdown_signal(),
    )
    .await
}
