use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    edgesplit_proto::service::init_tracing("info,llama-cpp-2=warn,llama_cpp_2=warn");
    let config = edgesplit_prefill::Config::parse();
    let engine = edgesplit_engine::Engine::start(config.engine()).await?;
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
