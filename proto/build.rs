//! Compiles `proto/edgesplit.proto`. The `protoc` is the one `PROTOC` names when it is set
//! (a system protoc, e.g. on a host for which no vendored binary exists), else
//! the vendored one, so no system install is needed on Linux, macOS or Windows.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-env-changed=PROTOC");
    println!("cargo:rerun-if-changed=proto/edgesplit.proto");
    match std::env::var_os("PROTOC").filter(|p| !p.is_empty()) {
        Some(p) => {
            // prost-build reads PROTOC itself; say which one built this, and fail early
            // and clearly when it does not exist.
            let path = std::path::Path::new(&p);
            if !path.is_file() {
                return Err(format!("PROTOC={} is not a file", path.display()).into());
            }
            println!("cargo:warning=protoc from PROTOC: {}", path.display());
        }
        None => {
            let protoc = protoc_bin_vendored::protoc_bin_path().map_err(|e| {
                format!("{e}; set PROTOC to a protoc binary (Termux: pkg install protobuf)")
            })?;
            // SAFETY: build scripts are single-threaded; nothing else reads the environment
            // concurrently.
            unsafe { std::env::set_var("PROTOC", protoc) };
        }
    }
    tonic_prost_build::configure().compile_protos(&["proto/edgesplit.proto"], &["proto"])?;
    Ok(())
}
