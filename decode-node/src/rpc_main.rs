//! `edgesplit-rpc`: llama.cpp's ggml RPC server on a loopback endpoint, the CPU its device.
//! Started (and restarted) by the decode node's `--rpc-listen`, which alone faces the
//! network (see `edgesplit_decode::rpc`); not meant to be run by hand.

use clap::Parser;

#[derive(Debug, Parser)]
#[command(name = "edgesplit-rpc", version, about)]
struct Args {
    /// host:port to serve on: loopback only.
    #[arg(long)]
    endpoint: String,
    /// Threads (the prefill node's own count keeps results identical).
    #[arg(long)]
    threads: usize,
}

fn main() {
    let args = Args::parse();
    let loopback = args
        .endpoint
        .parse::<std::net::SocketAddr>()
        .is_ok_and(|a| a.ip().is_loopback());
    if !loopback {
        eprintln!(
            "edgesplit-rpc: {} is not a loopback address: ggml's RPC server has no \
             authentication, so only the decode node's --rpc-listen may face the network",
            args.endpoint
        );
        std::process::exit(2);
    }
    let e = edgesplit_engine::rpc::serve(&args.endpoint, args.threads);
    eprintln!("edgesplit-rpc: {e}");
    std::process::exit(1);
}
