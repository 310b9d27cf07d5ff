//! Compiles `proto/edgesplit.proto` with a vendored `protoc`, so no system install is needed.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded; nothing else reads the environment concurrently.
    unsafe { std::env::set_var("PROTOC", protoc) };
    println!("cargo:rerun-if-changed=proto/edgesplit.proto");
    tonic_prost_build::configure().compile_protos(&["proto/edgesplit.proto"], &["proto"])?;
    Ok(())
}
