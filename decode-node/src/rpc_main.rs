//! `edgesplit-rpc`: llama.cpp's ggml RPC server on a loopback endpoint, the CPU its device.
//! Started (and restarted) by the decode node's `--rpc-listen`, which alone faces the
//! network (see `edgesplit_decode::rpc`); not meant to be run by hand. It exits when its
//! stdin closes (the decode node's end of a pipe).
//!
//! Only the decode node that started it gets through: the first line on its stdin is a
//! token (64 hex digits) that every connection must send before ggml sees it. ggml's
//! server takes connections with `accept`, which this binary defines (ggml's static
//! objects link to it; the system's is not used): it accepts, reads the token (within
//! [`TOKEN_WAIT`]), and hands ggml only a connection that sent it; others are closed
//! unanswered. The first call also prints the port the system chose for `--endpoint`'s
//! port 0 (`edgesplit-rpc listening on ADDR`, on stdout), so there is no moment between
//! choosing a port and binding it in which another process could take it.

use std::io::{Read, Write};
use std::mem::ManuallyDrop;
use std::os::fd::{FromRawFd, IntoRawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use clap::Parser;

#[derive(Debug, Parser)]
#[command(name = "edgesplit-rpc", version, about)]
struct Args {
    /// host:port to serve on: loopback only; port 0 lets the system choose (reported).
    #[arg(long)]
    endpoint: String,
    /// Threads (the prefill node's own count keeps results identical).
    #[arg(long)]
    threads: usize,
}

/// A connection has this long to send the token.
const TOKEN_WAIT: Duration = Duration::from_secs(2);

/// The token read from stdin before ggml's server starts.
static TOKEN: OnceLock<[u8; edgesplit_decode::rpc::TOKEN_BYTES]> = OnceLock::new();
/// Whether the bound address was printed.
static REPORTED: AtomicBool = AtomicBool::new(false);

/// Whether `stream` sends the token first.
fn admitted(stream: &mut std::net::TcpStream) -> bool {
    let Some(token) = TOKEN.get() else {
        return false;
    };
    let mut got = [0u8; edgesplit_decode::rpc::TOKEN_BYTES];
    let read = stream
        .set_read_timeout(Some(TOKEN_WAIT))
        .and_then(|()| stream.read_exact(&mut got))
        .and_then(|()| stream.set_read_timeout(None));
    // Compared in full whatever the first difference (no timing hint to a guesser).
    read.is_ok() && got.iter().zip(token).fold(0u8, |d, (a, b)| d | (a ^ b)) == 0
}

/// ggml's server's `accept` (see the module doc): the next connection that sent the token.
///
/// # Safety
/// Called by ggml with its listening socket, and null or valid `addr`/`len` (as the
/// system's `accept`).
#[no_mangle]
pub unsafe extern "C" fn accept(
    fd: libc::c_int,
    addr: *mut libc::sockaddr,
    len: *mut libc::socklen_t,
) -> libc::c_int {
    // SAFETY: `fd` is ggml's listening socket, borrowed (never closed here: ManuallyDrop).
    let listener = ManuallyDrop::new(unsafe { std::net::TcpListener::from_raw_fd(fd) });
    if !REPORTED.swap(true, Ordering::SeqCst) {
        match listener.local_addr() {
            Ok(a) => {
                let mut out = std::io::stdout();
                let _ = writeln!(out, "edgesplit-rpc listening on {a}");
                let _ = out.flush();
            }
            Err(e) => eprintln!("edgesplit-rpc: the bound address: {e}"),
        }
    }
    loop {
        let mut stream = match listener.accept() {
            Ok((s, _)) => s,
            // errno is the failed accept's.
            Err(_) => return -1,
        };
        if admitted(&mut stream) {
            let c = stream.into_raw_fd();
            if !addr.is_null() && !len.is_null() {
                // SAFETY: the caller's buffer, as for the system's accept.
                unsafe { libc::getpeername(c, addr, len) };
            }
            return c;
        }
        eprintln!("edgesplit-rpc: a connection without the token was closed");
    }
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
    let mut line = String::new();
    let token = std::io::stdin()
        .read_line(&mut line)
        .ok()
        .and_then(|_| hex::decode(line.trim()).ok())
        .and_then(|t| <[u8; edgesplit_decode::rpc::TOKEN_BYTES]>::try_from(t).ok());
    let Some(token) = token else {
        eprintln!(
            "edgesplit-rpc: no token on stdin (its first line, {} hex digits): started by \
             the decode node's --rpc-listen only",
            2 * edgesplit_decode::rpc::TOKEN_BYTES
        );
        std::process::exit(2);
    };
    let _ = TOKEN.set(token);
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
