use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let config = edgesplit_router::Config::parse();
    let listener = tokio::net::TcpListener::bind(&config.listen).await?;
    tracing::info!(addr = %listener.local_addr()?, "router listening (HTTP)");
    edgesplit_router::run(listener, &config, async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await
}
