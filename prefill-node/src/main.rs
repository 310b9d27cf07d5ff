use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    edgesplit_proto::service::init_tracing("info,llama_cpp_2=warn");
    let config = edgesplit_prefill::Config::parse();
    let engine = edgesplit_engine::Engine::start(config.engine()).await?;
    let listener = tokio::net::TcpListener::bind(&config.listen).await?;
    tracing::info!(addr = %listener.local_addr()?, "prefill node listening (gRPC)");
    edgesplit_prefill::run(
        listener,
        engine,
        &config,
        edgesplit_proto::service::shutdown_signal(),
    )
    .await?;
    Ok(())
}
