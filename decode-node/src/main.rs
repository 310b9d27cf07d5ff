use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    edgesplit_proto::service::init_tracing("info,llama-cpp-2=warn,llama_cpp_2=warn");
    let mut config = edgesplit_decode::Config::parse();
    edgesplit_engine::mem_budget_bytes().map_err(anyhow::Error::msg)?;
    let joined = edgesplit_decode::join::prepare(&mut config).await?;
    let has_secret =
        edgesplit_proto::auth::Secret::load(config.node.secret_file.as_deref())?.is_some();
    edgesplit_decode::rpc::check(config.rpc_listen.as_deref(), has_secret)?;
    if config.plan {
        return edgesplit_decode::print_plan(&config).await;
    }
    let engine = edgesplit_engine::Engine::start(config.engine()).await?;
    let listeners = edgesplit_decode::Listeners {
        grpc: tokio::net::TcpListener::bind(&config.listen).await?,
        handoff: tokio::net::TcpListener::bind(&config.handoff_listen).await?,
        v1: tokio::net::TcpListener::bind(&config.v1_listen).await?,
        metrics: match &config.metrics_listen {
            Some(a) => Some(tokio::net::TcpListener::bind(a).await?),
            None => None,
        },
    };
    tracing::info!(
        grpc = %listeners.grpc.local_addr()?,
        handoff = %listeners.handoff.local_addr()?,
        v1 = %listeners.v1.local_addr()?,
        "decode node listening"
    );
    if let Some(joined) = joined {
        let link = config.node.link(&[])?;
        let port = listeners.grpc.local_addr()?.port();
        tokio::spawn(config.joining.clone().announce(joined, link, port));
    }
    if let Some(addr) = &config.rpc_listen {
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let bound = listener.local_addr()?;
        let link = config.node.link(&[bound])?;
        let threads = config.engine().n_threads;
        tokio::spawn(async move {
            if let Err(e) = edgesplit_decode::rpc::serve(listener, link, threads).await {
                tracing::error!(error = %e, "the RPC server stopped");
            }
        });
    }
    edgesplit_decode::run(
        listeners,
        engine,
        &config,
        edgesplit_proto::service::shutdown_signal(),
    )
    .await
}
