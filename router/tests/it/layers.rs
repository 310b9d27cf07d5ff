//! The layer split, with the real binaries on loopback: a decode node serving
//! ggml's RPC behind `--rpc-listen` (its child `edgesplit-rpc` on loopback), a prefill
//! node computing the model's last layers there (`--rpc-peer`, `--rpc-layers`), and a
//! router serving it (`layers`). Its answers are the one-device answers; the RPC port
//! admits only a holder of the secret; a peer that cannot be reached is a clear error at
//! start; a peer lost while serving leaves the prefill node serving.

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

/// A router over a prefill node at `prefill` and a decode node at `decode` (gRPC
/// addresses): the process and its base URL.
async fn router_of(
    dir: &std::path::Path,
    prefill: &str,
    decode: &str,
    secret: &std::path::Path,
) -> (Proc, String) {
    let router = spawn(
        "edgesplit-router",
        &[
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--prefill-url".into(),
            format!("http://{prefill}"),
            "--decode-url".into(),
            format!("http://{decode}"),
            "--secret-file".into(),
            secret.display().to_string(),
        ],
        &dir.join("router.log"),
    );
    let r = reported(&dir.join("router.log"), "router listening (HTTP)").await;
    (router, format!("http://{}", r["addr"].as_str().unwrap()))
}

/// A completion request on `transport` with `sampling`'s fields.
fn completion_on(transport: &str, sampling: &Value) -> Value {
    let mut b = json!({
        "prompt": "The lighthouse keeper climbed the stairs every evening, and on the last night of the year",
        "edgesplit": {"transport": transport},
    });
    for (k, v) in sampling.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

/// The router's `/health` (its status code aside: a lost decode node makes it 503).
async fn health_of(base: &str) -> Value {
    common::get_json(&format!("{base}/health")).await
}

/// Polls `/health` until the prefill node's layer split satisfies `want`, within 90 s.
async fn wait_for_split(base: &str, what: &str, want: impl Fn(&Value) -> bool) -> Value {
    let t0 = std::time::Instant::now();
    loop {
        let h = health_of(base).await;
        if want(&h["prefill"]["layer_split"]) {
            return h["prefill"]["layer_split"].clone();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(90),
            "the layer split never became {what}: {h}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
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
    // Nor does another process on this device that finds ggml's own loopback port: the
    // child admits only its decode node's connections (they send its token first).
    let ready = reported(&dir.join("decode.log"), "RPC server ready").await;
    refused_unanswered(ready["child"].as_str().unwrap()).await;

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
    // The laptop's forwarder to the peer serves ggml's client in the prefill node's own
    // process, no other (this test's process here).
    refused_unanswered(split_on["forwarder"].as_str().unwrap()).await;
    let (router, base) = router_of(&dir, p["grpc"].as_str().unwrap(), &decode_grpc, &secret).await;

    // The reference: one device, the same model and context.
    let reference = common::start(common::StackOptions {
        n_ctx: 1024,
        ..common::StackOptions::new(model)
    });
    for sampling in [
        json!({"temperature": 0, "max_tokens": 32}),
        json!({"temperature": 0.9, "top_p": 0.95, "seed": 11, "max_tokens": 32, "logprobs": 2}),
    ] {
        let body = completion_on("layers", &sampling);
        let (st, _, split) = common::post(&format!("{base}/v1/completions"), &body).await;
        assert_eq!(st, 200, "{split}");
        assert_eq!(split["edgesplit"]["transport"], "layers", "{split}");
        // The prefill node writes the whole answer (some of its layers on the peer).
        assert_eq!(split["edgesplit"]["first_token_from"], "prefill", "{split}");
        assert_eq!(split["edgesplit"]["decode_node_tokens"], 0, "{split}");
        let (st, _, one) = common::post(
            &format!("{}/v1/completions", reference.router),
            &completion_on("local", &sampling),
        )
        .await;
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
    // /health shows the split and what crossed for it: at least one round trip per token.
    let l = health_of(&base).await["prefill"]["layer_split"].clone();
    assert_eq!(l["state"], "split", "{l}");
    assert_eq!(l["peer_layers"].to_string(), layers, "{l}");
    assert_eq!(l["peer"], rpc.as_str(), "{l}");
    assert!(l["rpc_round_trips"].as_u64().unwrap() >= 64, "{l}");
    assert!(l["rpc_bytes_received"].as_u64().unwrap() > 0, "{l}");
    // The dashboard's status card reads the same split.
    let d = common::get_json(&format!("{base}/dashboard/api/status")).await["prefill"]
        ["layer_split"]
        .clone();
    assert_eq!(
        (&d["state"], &d["peer_layers"], &d["peer"]),
        (&l["state"], &l["peer_layers"], &l["peer"]),
        "{d}"
    );
    let metrics = common::scrape(&format!(
        "http://{}/metrics",
        p["metrics"].as_str().unwrap()
    ))
    .await;
    assert_eq!(
        common::value(&metrics, "edgesplit:layer_split_peer_layers"),
        layers.parse::<f64>().unwrap(),
        "{metrics}"
    );
    assert!(common::value(&metrics, "edgesplit:rpc_round_trips_total") >= 64.0);
    drop(router);
    drop(prefill);
}

/// A plain ggml client at `endpoint` (loopback) gets no answer.
async fn refused_unanswered(endpoint: &str) {
    let at = endpoint.to_string();
    let answer = tokio::task::spawn_blocking(move || {
        edgesplit_engine::rpc::probe(&at, Duration::from_secs(10))
    })
    .await
    .unwrap();
    assert!(answer.is_err(), "{endpoint} answered: {answer:?}");
}

/// SmolLM2 (30 layers: the last 12 and the output layer on the peer).
#[tokio::test]
async fn a_layer_split_answer_is_the_one_device_answer_smollm2() {
    a_layer_split_answer_is_the_one_device_answer(common::SMOLLM2, "12").await;
}

/// Gemma-3 (18 layers: the last 8 and the output layer on the peer). Identical because
/// the build repacks no weights (`GGML_CPU_REPACK=OFF`, `.cargo/config.toml`): with
/// repacking, its Q4_K weights ran repacked kernels here and plain ones on the RPC device,
/// and its greedy answer parted from the one-device one within 3 tokens.
#[tokio::test]
async fn a_layer_split_answer_is_the_one_device_answer_gemma3() {
    a_layer_split_answer_is_the_one_device_answer(common::GEMMA3, "8").await;
}

/// `transport: "layers"` on a prefill node without a layer split is refused, naming it.
#[tokio::test]
async fn the_layers_transport_without_a_layer_split_is_refused() {
    let stack = common::smollm2();
    let body = completion_on("layers", &json!({"max_tokens": 4}));
    let (st, _, err) = common::post(&format!("{}/v1/completions", stack.router), &body).await;
    assert_eq!(st, 400, "{err}");
    assert_eq!(err["error"]["param"], "edgesplit.transport", "{err}");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no layer split"),
        "{err}"
    );
}

/// Whether process `pid` runs (not gone, not a zombie).
fn running(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .is_ok_and(|s| s.split_whitespace().nth(2).is_some_and(|st| st != "Z"))
}

/// The RPC peer lost mid-answer, then for good: ggml's client would abort the prefill
/// node (it aborts on a failed send). The node keeps serving: its process (the
/// supervisor) stays, the running answer ends with an error instead of hanging, the
/// next answer is the one-device answer through the split again once the decode node has
/// restarted its ggml server, and, with the decode node gone, every layer is computed on
/// the prefill node (SmolLM2 fits it alone), `layers` is then refused, and `local`
/// answers as one device does.
#[tokio::test]
async fn a_lost_rpc_peer_leaves_the_prefill_node_serving() {
    let _one = ONE_AT_A_TIME.lock().await;
    let dir = std::env::temp_dir().join(format!("edgesplit-layers-lost-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let secret = dir.join("secret");
    std::fs::write(&secret, SECRET).unwrap();
    let (decode, decode_grpc, rpc) = decode_with_rpc(common::SMOLLM2, &dir, &secret).await;
    let ggml_server = reported(&dir.join("decode.log"), "RPC server ready").await["pid"]
        .as_u64()
        .unwrap();
    let prefill = spawn(
        "edgesplit-prefill",
        &prefill_args(
            common::SMOLLM2,
            &secret,
            &[
                "--rpc-peer",
                &rpc,
                "--rpc-layers",
                "12",
                "--rpc-reconnect-s",
                "3",
            ],
        ),
        &dir.join("prefill.log"),
    );
    let node = prefill.0.id();
    let p = reported(&dir.join("prefill.log"), "prefill node listening").await;
    let (_router, base) = router_of(&dir, p["grpc"].as_str().unwrap(), &decode_grpc, &secret).await;
    let reference = common::start(common::StackOptions {
        n_ctx: 1024,
        ..common::StackOptions::new(common::SMOLLM2)
    });
    let greedy = json!({"temperature": 0, "max_tokens": 24});
    let one = common::post(
        &format!("{}/v1/completions", reference.router),
        &completion_on("local", &greedy),
    )
    .await
    .2;

    // A long answer, streaming, when ggml's server is killed.
    let mut long = completion_on("layers", &json!({"temperature": 0, "max_tokens": 600}));
    long["stream"] = json!(true);
    let resp = common::client()
        .post(format!("{base}/v1/completions"))
        .json(&long)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let mut sse = common::Sse::new(resp);
    for _ in 0..3 {
        assert!(sse.next().await.is_some());
    }
    let killed = std::process::Command::new("kill")
        .args(["-9", &ggml_server.to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let rest = tokio::time::timeout(Duration::from_secs(60), async {
        let mut rest = Vec::new();
        while let Some(d) = sse.next().await {
            rest.push(d);
        }
        rest
    })
    .await
    .expect("the answer hung after its RPC peer was lost");
    let errors: Vec<&String> = rest.iter().filter(|d| d.contains("\"error\"")).collect();
    assert!(!errors.is_empty(), "no error: {rest:?}");
    assert!(running(node), "the prefill node is gone");

    // The decode node restarted its ggml server: split again, the one-device answer.
    let l = wait_for_split(&base, "split again", |l| {
        l["state"] == "split" && l["restarts"].as_u64() >= Some(1)
    })
    .await;
    assert_eq!(l["peer_layers"], 12, "{l}");
    let (st, _, again) = common::post(
        &format!("{base}/v1/completions"),
        &completion_on("layers", &greedy),
    )
    .await;
    assert_eq!(st, 200, "{again}");
    assert_eq!(again["choices"][0]["text"], one["choices"][0]["text"]);
    // One restart: the engine process that lost its peer, and no other.
    let l = health_of(&base).await["prefill"]["layer_split"].clone();
    assert_eq!(
        (l["state"].as_str(), l["restarts"].as_u64()),
        (Some("split"), Some(1)),
        "{l}"
    );

    // The decode node gone for good: every layer here, once the reconnect window passed.
    drop(decode);
    let l = wait_for_split(&base, "lost", |l| l["state"] == "lost").await;
    assert_eq!(l["peer_layers"], 0, "{l}");
    assert_eq!(l["layers_here"], 30, "{l}");
    let (st, _, refused) = common::post(
        &format!("{base}/v1/completions"),
        &completion_on("layers", &greedy),
    )
    .await;
    assert_eq!(st, 400, "{refused}");
    let (st, _, alone) = common::post(
        &format!("{base}/v1/completions"),
        &completion_on("local", &greedy),
    )
    .await;
    assert_eq!(st, 200, "{alone}");
    assert_eq!(alone["choices"][0]["text"], one["choices"][0]["text"]);
    assert!(running(node), "the prefill node is gone");
    let log = std::fs::read_to_string(dir.join("prefill.log")).unwrap();
    assert!(log.contains("the RPC peer is lost"), "{log}");
    drop(prefill);
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
        ("down", closed_addr, Some(&secret)),
        ("another secret", rpc.clone(), Some(&other)),
        ("no secret", rpc, None),
    ] {
        let log = dir.join(format!("prefill-{}.log", what.replace(' ', "-")));
        let mut args = prefill_args(
            common::SMOLLM2,
            key.unwrap_or(&secret),
            &["--rpc-peer", &peer, "--rpc-layers", "4"],
        );
        if key.is_none() {
            let at = args.iter().position(|a| a == "--secret-file").unwrap();
            args.drain(at..at + 2);
        }
        let mut p = spawn("edgesplit-prefill", &args, &log);
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

/// ggml's RPC is never served without the shared secret, `--insecure` or not (nothing is
/// loaded first).
#[test]
fn the_rpc_listen_needs_the_shared_secret() {
    let out = std::process::Command::new(bin("edgesplit-decode"))
        .args(["--model", "/nonexistent.gguf", "--listen", "127.0.0.1:0"])
        .args([
            "--handoff-listen",
            "127.0.0.1:0",
            "--v1-listen",
            "127.0.0.1:0",
        ])
        .args(["--rpc-listen", "127.0.0.1:0", "--insecure"])
        .env_remove("EDGESPLIT_SECRET")
        .env_remove("EDGESPLIT_SECRET_FILE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("--rpc-listen 127.0.0.1:0 needs the shared secret"),
        "{err}"
    );
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
