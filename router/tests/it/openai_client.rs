//! The official `openai` Python client (pinned by scripts/test.sh, which installs it into
//! `.build/openai-py`) with strict response validation against the router: every response
//! and chunk parses into the client's own types, log-probabilities and structured output
//! included, and a tool call round trip through the tool template's stack
//! (`router/tests/openai_strict.py` says what it checks).

use crate::common;

use std::path::Path;

#[tokio::test]
async fn the_official_client_in_strict_mode_takes_every_response() {
    let s = common::smollm2();
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let site = root.join(".build/openai-py");
    assert!(
        site.join("openai").is_dir(),
        "the openai client is not installed in {}: run scripts/test.sh (it installs it)",
        site.display()
    );
    let script = root.join("router/tests/openai_strict.py");
    let router = s.router.clone();
    let tools_router = crate::tools::stack().router.clone();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("python3")
            .arg(script)
            .arg(router)
            .arg(tools_router)
            .env("PYTHONPATH", site)
            .output()
    })
    .await
    .unwrap()
    .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.starts_with("ok:"), "{stdout}");
}
