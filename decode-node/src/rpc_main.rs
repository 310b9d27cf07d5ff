//! `edgesplit-rpc`: llama.cpp's ggml RPC server on a loopback endpoint, the CPU its device.
//! Started (and restarted) by the decode node's `--rpc-listen`, which alone faces the
//! network (see `edgesplit_decode::rpc`); not meant to be run by hand. It exits when its
//! stdin closes (the decode node's end of a pipe).

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
    // Ends with the decode node that started it: its stdin is a pipe from that process,
    // which closes when it exits, however it exits (a SIGKILL included).
    std::thread::spawn(|| {
        let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
        std::process::exit(0);
    });
    let e = edgesplit_engine::rpc::serve(&args.endpoint, args.threads);
    eprintln!("edgesplit-rpc: {e}");
    std::process::exit(1);
}
