//! Across architectures, with real binaries: an x86 router and prefill node and the phone
//! build of the decode node (aarch64, `scripts/build-aarch64.sh`, which `scripts/test.sh`
//! runs) under `qemu-aarch64`. Greedy answers over the V2 handoff, live and after, complete
//! with the decode node writing the answer after the switch; both nodes report their
//! architecture (PROTOCOL.md, "Compatibility": the architecture may differ, the build may
//! not); and a pair whose states do not match (another KV cache type) is refused in the
//! handshake with a reason naming both values. Speed under emulation is not a phone's
//! speed: nothing here is timed.

use crate::common;
use crate::processes::{start_three_with, ThreeOptions, ONE_AT_A_TIME};

use std::path::PathBuf;

use serde_json::json;

/// The aarch64 decode node under qemu-user (without `-L`: qemu finds the multiarch loader
/// and libraries the build script installs).
fn aarch64_decode() -> Vec<PathBuf> {
    let bin = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../target-aarch64/aarch64-unknown-linux-gnu/release/edgesplit-decode");
    assert!(
        bin.is_file(),
        "{} missing: scripts/test.sh builds it (scripts/build-aarch64.sh)",
        bin.display()
    );
    vec![PathBuf::from("qemu-aarch64"), bin]
}

#[tokio::test]
async fn an_aarch64_decode_node_writes_split_answers() {
    let _one = ONE_AT_A_TIME.lock().await;
    let t = start_three_with(ThreeOptions {
        decode_program: Some(aarch64_decode()),
        // A live answer writes a token per snapshot its handoff takes, so that the
        // switch comes before the answer's end however slow the emulated decode node is.
        prefill_extra: &["--test-pace-live"],
        // The router's calibration at start would prefill its probe on the emulated
        // decode node while the first answer waits for its steps there: under qemu that
        // takes longer than the router's token bound. The answers are what is tested.
        router_extra: &["--no-probes"],
        ..ThreeOptions::new("cross-arch")
    })
    .await;
    let h = common::get_json(&format!("{}/health", t.router)).await;
    assert_eq!(h["prefill"]["arch"], std::env::consts::ARCH, "{h}");
    assert_eq!(h["decode"]["arch"], "aarch64", "{h}");
    assert!(
        h["decode"]["kernels"]
            .as_str()
            .is_some_and(|k| k.starts_with("CPU: NEON") && k.contains("DOTPROD")),
        "{h}"
    );
    // Another architecture, the same build.
    assert_eq!(h["prefill"]["build_id"], h["decode"]["build_id"], "{h}");
    let url = format!("{}/v1/chat/completions", t.router);
    for mode in ["live", "after"] {
        let body = json!({
            "messages": [{"role": "user", "content": "Write a short story about a lighthouse."}],
            "max_tokens": 24, "temperature": 0,
            "edgesplit": {"transport": "v2", "handoff": mode},
        });
        let (st, _, v) = common::post(&url, &body).await;
        assert_eq!(st, 200, "{mode}: {v}");
        let e = &v["edgesplit"];
        let n = v["usage"]["completion_tokens"].as_u64().unwrap();
        assert_eq!(n, 24, "{mode}: {v}");
        assert_eq!(e["handoff_mode"], mode, "{v}");
        common::assert_split(e, n);
        assert!(e["decode_node_tokens"].as_u64().unwrap() > 0, "{v}");
        assert_eq!(e["prefill_arch"], std::env::consts::ARCH, "{v}");
        assert_eq!(e["decode_arch"], "aarch64", "{v}");
        assert_eq!(e["same_numerics"], false, "{v}");
    }
}

#[tokio::test]
async fn an_aarch64_decode_node_with_another_kv_type_is_refused() {
    let _one = ONE_AT_A_TIME.lock().await;
    let t = start_three_with(ThreeOptions {
        decode_program: Some(aarch64_decode()),
        decode_extra: &["--cache-type-k", "q8_0", "--cache-type-v", "q8_0"],
        router_extra: &["--on-split-failure", "fail"],
        ..ThreeOptions::new("cross-arch-refused")
    })
    .await;
    let body = json!({
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 8, "temperature": 0,
        "edgesplit": {"transport": "v2", "handoff": "after"},
    });
    let (st, _, v) = common::post(&format!("{}/v1/chat/completions", t.router), &body).await;
    assert_eq!(st, 502, "{v}");
    assert_eq!(v["error"]["code"], "kv_type_mismatch", "{v}");
    let why = v["error"]["message"].as_str().unwrap();
    // Both values named: the aarch64 node's q8_0 (ggml type 8), the sender's f16 (1).
    assert!(why.contains("K=8 V=8") && why.contains("K=1 V=1"), "{v}");
}
