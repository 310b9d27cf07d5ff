use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    edgesplit_proto::service::init_tracing("info");
    let config = edgesplit_router::Config::parse();
    let listener = tokio::net::TcpListener::bind(&config.listen).await?;
    tracing::info!(addr = %listener.local_addr()?, "router listening (HTTP)");
    edgesplit_router::run(
        listener,
        &config,
        edgesplit_proto::service::shutdown_signal(),
    )
    .await
}
