use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,llama_cpp_2=warn".into()),
        )
        .init();
    let config = edgesplit_decode::Config::parse();
    let engine = edgesplit_engine::Engine::start(config.engine()).await?;
    let listeners = edgesplit_decode::Listeners {
        grpc: tokio::net::TcpListener::bind(&config.listen).await?,
        handoff: tokio::net::TcpListener::bind(&config.handoff_listen).await?,
        v1: tokio::net::TcpListener::bind(&config.v1_listen).await?,
    };
    tracing::info!(
        grpc = %listeners.grpc.local_addr()?,
        handoff = %listeners.handoff.local_addr()?,
        v1 = %listeners.v1.local_addr()?,
        "decode node listening"
    );
    edgesplit_decode::run(listeners, engine, &config, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await
}
