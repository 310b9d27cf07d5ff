use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,llama_cpp_2=warn".into()),
        )
        .init();
    let config = edgesplit_prefill::Config::parse();
    let engine = edgesplit_engine::Engine::start(config.engine()).await?;
    let listener = tokio::net::TcpListener::bind(&config.listen).await?;
    tracing::info!(addr = %listener.local_addr()?, "prefill node listening (gRPC)");
    edgesplit_prefill::run(listener, engine, &config, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    Ok(())
}
