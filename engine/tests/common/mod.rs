//! What the engine's integration tests share: the models' paths (each test file uses
//! one or the other).
#![allow(dead_code)]

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

/// Gemma-3-270M's GGUF (a sliding-window model), which `scripts/test.sh` fetches.
pub fn gemma_path() -> std::path::PathBuf {
    let p =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/gemma-3-270m-q4_k_m.gguf");
    assert!(
        p.is_file(),
        "model {} missing: run scripts/test.sh (it fetches the models)",
        p.display()
    );
    p
}
