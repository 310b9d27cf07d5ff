//! llama.cpp's RPC backend (ggml-rpc) for the layer split: a model's last layers
//! computed by a ggml RPC server on another device.
//!
//! ggml-rpc has no authentication, sizes allocations from what its client sends, and aborts
//! the process on a malformed message (server) or a failed connect or send (client). So
//! neither end is ever exposed or trusted here: the server listens on loopback only, in a
//! process of its own ([`serve`], started by the decode node, which restarts it), and the
//! network sees only our authenticated link in front of it; the client side runs in a
//! node process of its own too, and [`probe`] checks the endpoint answers ggml's HELLO
//! before ggml connects to it, so an unreachable peer is a clear error, not an abort.
//!
//! The bindings do not include `ggml-rpc.h`: its two entry points are reached through the
//! RPC backend's `get_proc_address`, as llama.cpp's own `--rpc` does. The build turns the
//! backend on (`GGML_RPC=ON` in `.cargo/config.toml`).

use std::ffi::{c_char, c_void, CString};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use llama_cpp_sys_2 as sys;

/// The RPC protocol version ggml speaks (`ggml-rpc.h`); a server of another major version
/// is refused.
pub const PROTOCOL_MAJOR: u8 = 7;
/// ggml's HELLO command and its request (connection capabilities, zero: plain TCP).
const CMD_HELLO: u8 = 14;
const HELLO_REQUEST: usize = 24;
const HELLO_RESPONSE: u64 = 4 + 24;

/// Why the RPC backend could not be used.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct RpcError(String);

type AddServer = unsafe extern "C" fn(*const c_char) -> sys::ggml_backend_reg_t;
type StartServer =
    unsafe extern "C" fn(*const c_char, *const c_char, usize, usize, *mut sys::ggml_backend_dev_t);

/// An entry point of the RPC backend.
fn entry(name: &str) -> Result<*mut c_void, RpcError> {
    let reg = unsafe { sys::ggml_backend_reg_by_name(c"RPC".as_ptr()) };
    if reg.is_null() {
        return Err(RpcError(
            "this build has no RPC backend (llama.cpp built without GGML_RPC=ON)".into(),
        ));
    }
    let cname = CString::new(name).map_err(|e| RpcError(e.to_string()))?;
    let f = unsafe { sys::ggml_backend_reg_get_proc_address(reg, cname.as_ptr()) };
    if f.is_null() {
        return Err(RpcError(format!("the RPC backend has no {name}")));
    }
    Ok(f)
}

fn endpoint_c(endpoint: &str) -> Result<CString, RpcError> {
    CString::new(endpoint).map_err(|_| RpcError(format!("bad RPC endpoint {endpoint:?}")))
}

/// Checks that `endpoint` (host:port) answers ggml's RPC HELLO with protocol version
/// [`PROTOCOL_MAJOR`], within `timeout` per step. Done before ggml connects: ggml aborts
/// the process when it cannot.
///
/// # Errors
/// The endpoint is not reached, does not answer, or speaks another version.
pub fn probe(endpoint: &str, timeout: Duration) -> Result<(u8, u8, u8), RpcError> {
    probe_after(endpoint, &[], timeout)
}

/// [`probe`], sending `first` before the HELLO (the decode node's token for its own
/// `edgesplit-rpc` child, which admits no connection without it).
///
/// # Errors
/// As [`probe`].
pub fn probe_after(
    endpoint: &str,
    first: &[u8],
    timeout: Duration,
) -> Result<(u8, u8, u8), RpcError> {
    let fail = |what: &str, e: &dyn std::fmt::Display| {
        RpcError(format!("the RPC server at {endpoint}: {what}: {e}"))
    };
    let addr: std::net::SocketAddr = endpoint.parse().map_err(|e| fail("not an address", &e))?;
    let mut s = TcpStream::connect_timeout(&addr, timeout).map_err(|e| fail("connect", &e))?;
    s.set_read_timeout(Some(timeout))
        .and_then(|()| s.set_write_timeout(Some(timeout)))
        .map_err(|e| fail("socket", &e))?;
    let mut hello = first.to_vec();
    hello.push(CMD_HELLO);
    hello.extend_from_slice(&(HELLO_REQUEST as u64).to_le_bytes());
    hello.extend_from_slice(&[0u8; HELLO_REQUEST]);
    s.write_all(&hello).map_err(|e| fail("HELLO", &e))?;
    let mut size = [0u8; 8];
    s.read_exact(&mut size)
        .map_err(|e| fail("no answer to HELLO", &e))?;
    let size = u64::from_le_bytes(size);
    if size != HELLO_RESPONSE {
        return Err(RpcError(format!(
            "the RPC server at {endpoint} answered HELLO with {size} bytes, not {HELLO_RESPONSE}: \
             not ggml-rpc {PROTOCOL_MAJOR}.x"
        )));
    }
    let mut rsp = [0u8; HELLO_RESPONSE as usize];
    s.read_exact(&mut rsp)
        .map_err(|e| fail("HELLO answer", &e))?;
    let version = (rsp[0], rsp[1], rsp[2]);
    if version.0 != PROTOCOL_MAJOR {
        return Err(RpcError(format!(
            "the RPC server at {endpoint} speaks ggml-rpc {}.{}.{}, this build {PROTOCOL_MAJOR}.x",
            version.0, version.1, version.2
        )));
    }
    Ok(version)
}

/// Registers the ggml RPC server at `endpoint` as a backend device and returns its index
/// among ggml's devices (what `EngineConfig::remote_layers` takes). Connects to it: call
/// [`probe`] first.
///
/// # Errors
/// No RPC backend in this build, or the server reports no device.
pub fn add_server(endpoint: &str) -> Result<usize, RpcError> {
    let add: AddServer = unsafe { std::mem::transmute(entry("ggml_backend_rpc_add_server")?) };
    let c = endpoint_c(endpoint)?;
    let reg = unsafe { add(c.as_ptr()) };
    if reg.is_null() || unsafe { sys::ggml_backend_reg_dev_count(reg) } == 0 {
        return Err(RpcError(format!(
            "the RPC server at {endpoint} reports no device"
        )));
    }
    let dev = unsafe { sys::ggml_backend_reg_dev_get(reg, 0) };
    // Registered once per endpoint (ggml returns the same registry for a known endpoint).
    let count = unsafe { sys::ggml_backend_dev_count() };
    if let Some(i) = (0..count).find(|&i| unsafe { sys::ggml_backend_dev_get(i) } == dev) {
        return Ok(i);
    }
    unsafe { sys::ggml_backend_register(reg) };
    (0..unsafe { sys::ggml_backend_dev_count() })
        .find(|&i| unsafe { sys::ggml_backend_dev_get(i) } == dev)
        .ok_or_else(|| RpcError(format!("the RPC device of {endpoint} was not registered")))
}

/// Serves ggml's RPC protocol on `endpoint` (keep it on loopback) with this machine's CPU
/// and `threads` threads, one client at a time. Returns only when ggml refuses to start
/// (with why); otherwise it serves until the process ends.
pub fn serve(endpoint: &str, threads: usize) -> RpcError {
    let start: StartServer = match entry("ggml_backend_rpc_start_server") {
        Ok(f) => unsafe { std::mem::transmute::<*mut c_void, StartServer>(f) },
        Err(e) => return e,
    };
    let c = match endpoint_c(endpoint) {
        Ok(c) => c,
        Err(e) => return e,
    };
    let mut cpu = unsafe { sys::ggml_backend_dev_by_type(sys::GGML_BACKEND_DEVICE_TYPE_CPU) };
    if cpu.is_null() {
        return RpcError("no CPU device".into());
    }
    unsafe { start(c.as_ptr(), std::ptr::null(), threads, 1, &raw mut cpu) };
    RpcError(format!("the RPC server on {endpoint} did not start"))
}
