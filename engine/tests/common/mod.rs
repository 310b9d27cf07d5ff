//! What the engine's integration tests share: the default model's path.

/// SmolLM2's GGUF (`EDGESPLIT_MODEL` overrides), which `scripts/test.sh` fetches.
pub fn model_path() -> std::path::PathBuf {
    let p = std::env::var("EDGESPLIT_MODEL").map_or_else(
        |_| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../models/SmolLM2-135M-Instruct.Q4_1.gguf")
        },
        Into::into,
    );
    assert!(
        p.is_file(),
        "model {} missing: run scripts/test.sh (it fetches the model)",
        p.display()
    );
    p
}
