//! Issue 17, the layer split, with the real binaries on loopback: a decode node serving
//! ggml's RPC behind `--rpc-listen` (its child `edgesplit-rpc` on loopback), a prefill
//! node computing the model's last layers there (`--rpc-peer`, `--rpc-layers`), and a
//! router serving it `local`. Its answers are the one-device answers; the RPC port admits
//! only a holder of the secret; a peer that cannot be reached is a clear error at start.

use std::time::Duration;

use serde_json::{json, Value};

use crate::common;
use crate::processes::{bin, reported, spawn, Proc, ONE_AT_A_TIME};

const SECRET: &str = "layer split test secret, 32 bytes or more of it";

/// A node's arguments: `model`, the reference's context, the secret, then `extra`.
fn node_args(model: &str, secret: &std::path::Path, extra: &[&str]) -> Vec<String> {
    let mut a = vec![
        "--model".to_string(),
        common::model(model).display().to_string(),
        "--n-ctx".into(),
        "1024".into(),
        "--secret-file".into(),
        secret.display().to_string(),
    ];
    a.extend(extra.iter().map(ToString::to_string));
    a
}

/// A prefill node's arguments, its ports picked, then `extra`.
fn prefill_args(model: &str, secret: &std::path::Path, extra: &[&str]) -> Vec<String> {
    let mut a = node_args(model, secret, &["--listen", "127.0.0.1:0"]);
    a.extend(node_args_tail(&["--metrics-listen", "127.0.0.1:0"], extra));
    a
}

/// A decode node's arguments, its ports picked, then `extra`.
fn decode_args(model: &str, secret: &std::path::Path, extra: &[&str]) -> Vec<String> {
    let mut a = node_args(model, secret, &["--listen", "127.0.0.1:0"]);
    let ports = [
        "--handoff-listen",
        "127.0.0.1:0",
        "--v1-listen",
        "127.0.0.1:0",
    ];
    a.extend(node_args_tail(&ports, extra));
    a
}

fn node_args_tail(ports: &[&str], extra: &[&str]) -> Vec<String> {
    ports.iter().chain(extra).map(ToString::to_string).collect()
}

/// A decode node of `model` with `--rpc-listen`: the process, its gRPC and RPC addresses.
async fn decode_with_rpc(
    model: &str,
    dir: &std::path::Path,
    secret: &std::path::Path,
) -> (Proc, String, String) {
    let args = decode_args(model, secret, &["--rpc-listen", "127.0.0.1:0"]);
    let decode = spawn("edgesplit-decode", &args, &dir.join("decode.log"));
    let d = reported(&dir.join("decode.log"), "decode node listening").await;
    let grpc = d["grpc"].as_str().unwrap().to_string();
    let rpc = reported(&dir.join("decode.log"), "RPC server ready").await;
    (decode, grpc, rpc["rpc"].as_str().unwrap().to_string())
}

/// ggml's RPC server is restarted when it dies (a malformed message aborts it), and ends
/// with the decode node that started it, even one killed with SIGKILL (it would otherwise
/// hold its port and memory forever).
#[tokio::test]
async fn the_ggml_rpc_server_is_restarted_and_ends_with_its_decode_node() {
    let _one = ONE_AT_A_TIME.lock().await;
    let dir = std::env::temp_dir().join(format!("edgesplit-layers-end-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let secret = dir.join("secret");
    std::fs::write(&secret, SECRET).unwrap();
    let (decode, _, _) = decode_with_rpc(common::SMOLLM2, &dir, &secret).await;
    let ready = reported(&dir.join("decode.log"), "RPC server ready").await;
    let first = ready["pid"].as_u64().unwrap();
    let killed = std::process::Command::new("kill")
        .args(["-9", &first.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let again = reported(&dir.join("decode.log"), "RPC server restarted").await;
    assert_ne!(again["pid"].as_u64().unwrap(), first, "{again}");
    let child = std::path::PathBuf::from(format!("/proc/{}", again["pid"]));
    assert!(child.exists(), "{again}");
    drop(decode); // SIGKILL
    let t0 = std::time::Instant::now();
    // Gone, or a zombie nobody reaps (its parent is gone too).
    let alive = || {
        std::fs::read_to_string(child.join("stat"))
            .is_ok_and(|s| s.split_whitespace().nth(2).is_none_or(|st| st != "Z"))
    };
    while alive() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "edgesplit-rpc outlived its decode node"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn completion(sampling: &Value) -> Value {
    let mut b = json!({
        "prompt": "The lighthouse keeper climbed the stairs every evening, and on the last night of the year",
        "edgesplit": {"transport": "local"},
    });
    for (k, v) in sampling.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

/// The layer split of `model` (`layers` of its layers on the peer) against one device.
async fn a_layer_split_answer_is_the_one_device_answer(model: &'static str, layers: &str) {
    let _one = ONE_AT_A_TIME.lock().await;
    let dir =
        std::env::temp_dir().join(format!("edgesplit-layers-{layers}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let secret = dir.join("secret");
    std::fs::write(&secret, SECRET).unwrap();
    let (_decode, decode_grpc, rpc) = decode_with_rpc(model, &dir, &secret).await;

    // ggml's port is not the network's: a plain peer speaking ggml's protocol to
    // --rpc-listen gets no answer (the link wants TLS under the secret first).
    let plain = {
        let rpc = rpc.clone();
        tokio::task::spawn_blocking(move || {
            edgesplit_engine::rpc::probe(&rpc, Duration::from_secs(5))
        })
        .await
        .unwrap()
    };
    assert!(
        plain.is_err(),
        "a plain ggml client was answered: {plain:?}"
    );

    let prefill = spawn(
        "edgesplit-prefill",
        &prefill_args(
            model,
            &secret,
            &["--rpc-peer", &rpc, "--rpc-layers", layers],
        ),
        &dir.join("prefill.log"),
    );
    let p = reported(&dir.join("prefill.log"), "prefill node listening").await;
    let split_on = reported(
        &dir.join("prefill.log"),
        "layer split: the last layers on the RPC peer",
    )
    .await;
    assert_eq!(split_on["layers"].to_string(), layers, "{split_on}");
    let router = spawn(
        "edgesplit-router",
        &[
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--prefill-url".into(),
            format!("http://{}", p["grpc"].as_str().unwrap()),
            "--decode-url".into(),
            format!("http://{decode_grpc}"),
            "--secret-file".into(),
            secret.display().to_string(),
        ],
        &dir.join("router.log"),
    );
    let r = reported(&dir.join("router.log"), "router listening (HTTP)").await;
    let base = format!("http://{}", r["addr"].as_str().unwrap());

    // The reference: one device, the same model and context.
    let reference = common::start(common::StackOptions {
        n_ctx: 1024,
        ..common::StackOptions::new(model)
    });
    for sampling in [
        json!({"temperature": 0, "max_tokens": 32}),
        json!({"temperature": 0.9, "top_p": 0.95, "seed": 11, "max_tokens": 32, "logprobs": 2}),
    ] {
        let body = completion(&sampling);
        let (st, _, split) = common::post(&format!("{base}/v1/completions"), &body).await;
        assert_eq!(st, 200, "{split}");
        let (st, _, one) =
            common::post(&format!("{}/v1/completions", reference.router), &body).await;
        assert_eq!(st, 200, "{one}");
        assert_eq!(
            split["choices"][0]["text"], one["choices"][0]["text"],
            "{sampling}"
        );
        assert_eq!(
            split["choices"][0]["logprobs"], one["choices"][0]["logprobs"],
            "{sampling}"
        );
        assert_eq!(split["usage"]["completion_tokens"], 32, "{split}");
    }
    drop(router);
    drop(prefill);
}

/// SmolLM2 (30 layers: the last 12 and the output layer on the peer). Not Gemma-3: its
/// Q4_K weights are repacked for the CPU's kernels here (`CPU_REPACK`), not on the RPC
/// device, and its greedy answer parts from the one-device one within a few tokens;
/// llama-cpp-2 0.1.160 does not expose llama.cpp's `use_extra_bufts` (`--no-repack`), and
/// a CPU buffer override still picks the repacked type (seen in the load log).
#[tokio::test]
async fn a_layer_split_answer_is_the_one_device_answer_smollm2() {
    a_layer_split_answer_is_the_one_device_answer(common::SMOLLM2, "12").await;
}

/// A prefill node whose RPC peer is down, or holds another secret, exits at start with a
/// message naming `--rpc-peer` - not aborted by ggml (exit status 1, no signal).
#[tokio::test]
async fn an_unreachable_or_unauthenticated_rpc_peer_is_a_clear_error_at_start() {
    let _one = ONE_AT_A_TIME.lock().await;
    let dir = std::env::temp_dir().join(format!("edgesplit-layers-bad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let secret = dir.join("secret");
    std::fs::write(&secret, SECRET).unwrap();
    let other = dir.join("other");
    std::fs::write(&other, "another secret altogether, also long enough").unwrap();
    let (_decode, _, rpc) = decode_with_rpc(common::SMOLLM2, &dir, &secret).await;
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed_addr = closed.local_addr().unwrap().to_string();
    drop(closed);
    for (what, peer, key) in [
        ("down", closed_addr, &secret),
        ("another secret", rpc, &other),
    ] {
        let log = dir.join(format!("prefill-{}.log", what.replace(' ', "-")));
        let mut p = spawn(
            "edgesplit-prefill",
            &prefill_args(
                common::SMOLLM2,
                key,
                &["--rpc-peer", &peer, "--rpc-layers", "4"],
            ),
            &log,
        );
        let t0 = std::time::Instant::now();
        let status = loop {
            if let Some(s) = p.0.try_wait().unwrap() {
                break s;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "{what}: still running"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        let text = std::fs::read_to_string(&log).unwrap();
        assert_eq!(status.code(), Some(1), "{what}: {status}\n{text}");
        assert!(text.contains("--rpc-peer"), "{what}: {text}");
    }
}

/// ggml's RPC server is never started on an address the network reaches.
#[test]
fn the_ggml_rpc_server_refuses_a_non_loopback_endpoint() {
    let out = std::process::Command::new(bin("edgesplit-rpc"))
        .args(["--endpoint", "0.0.0.0:0", "--threads", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("loopback"));
}

/// `edgesplit-prefill --plan`: the layer split's plan from both devices' available memory
/// (here `EDGESPLIT_MEM_BUDGET_BYTES` on each; the decode node's through its `Info`) and
/// the GGUF's layer sizes. With budgets that neither device alone can serve the model
/// with, `auto` puts some but not all layers on the peer and both parts fit; a count
/// that overfills this side, and budgets too small for both together, are refused with
/// the numbers (exit 1), before anything is loaded.
#[tokio::test]
async fn the_plan_splits_a_model_neither_device_holds_and_refuses_one_that_does_not_fit() {
    let _one = ONE_AT_A_TIME.lock().await;
    let dir = std::env::temp_dir().join(format!("edgesplit-layers-plan-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let secret = dir.join("secret");
    std::fs::write(&secret, SECRET).unwrap();
    let mib = |n: u64| (n << 20).to_string();
    let decode_with_budget = |budget: String, log: &str| {
        let file = std::fs::File::create(dir.join(log)).unwrap();
        Proc(
            std::process::Command::new(bin("edgesplit-decode"))
                .args(decode_args(common::SMOLLM2, &secret, &[]))
                .env("EDGESPLIT_LOG_FORMAT", "json")
                .env("EDGESPLIT_MEM_BUDGET_BYTES", budget)
                .stderr(file)
                .spawn()
                .unwrap(),
        )
    };
    let plan = |here: String, layers: &str, decode_grpc: &str| {
        std::process::Command::new(bin("edgesplit-prefill"))
            .args(prefill_args(
                common::SMOLLM2,
                &secret,
                &[
                    "--rpc-peer",
                    "127.0.0.1:9",
                    "--rpc-layers",
                    layers,
                    "--plan",
                    "--decode-url",
                    &format!("http://{decode_grpc}"),
                ],
            ))
            .env("EDGESPLIT_MEM_BUDGET_BYTES", here)
            .output()
            .unwrap()
    };
    // SmolLM2-135M: ~100 MiB of weights; 256 MiB of each side's budget is its reserve.
    let _d = decode_with_budget(mib(380), "decode-380.log");
    let d = reported(&dir.join("decode-380.log"), "decode node listening").await;
    let grpc = d["grpc"].as_str().unwrap().to_string();
    let out = plan(mib(300), "auto", &grpc);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let peer: u32 = text
        .split("the last ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{text}"));
    assert!(peer > 0 && peer < 30, "{text}");
    assert!(!text.contains("does not fit"), "{text}");
    let alone_here = plan(mib(300), "0", &grpc);
    let err = String::from_utf8_lossy(&alone_here.stderr);
    assert_eq!(alone_here.status.code(), Some(1), "{err}");
    assert!(
        err.contains("does not fit") && err.contains("MiB available"),
        "{err}"
    );
    let too_small = plan(mib(260), "auto", &grpc);
    let err = String::from_utf8_lossy(&too_small.stderr);
    assert_eq!(too_small.status.code(), Some(1), "{err}");
    assert!(err.contains("does not fit on both devices"), "{err}");
}
