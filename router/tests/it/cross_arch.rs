//! Across architectures, with real binaries: an x86 router and prefill node and the phone's
//! decode node, the one static aarch64 file `scripts/build-phone.sh` builds (which
//! `scripts/test.sh` runs), under `qemu-aarch64` in an empty root: a directory holding only
//! qemu, that file and the model, as a phone's would hold nothing of this machine's (no
//! `/etc`, no `/lib`, no `/proc`, no `/tmp`). Over a private link: greedy answers over the
//! V2 handoff, live and after, and V1, with the decode node writing the answer after the
//! switch; a conversation continued on it; the phone alone; both nodes report their
//! architecture (PROTOCOL.md, "Compatibility": the architecture may differ, the build may
//! not); a pair whose states do not match (another KV cache type) is refused in the
//! handshake with a reason naming both values; and the file's memory plan reads
//! `/proc/meminfo` where there is one and says so where there is none. And the phone's
//! own path: the file joins an x86 router with a code, takes the prefill node's settings,
//! qualifies with its agreement reported (another architecture cannot be held to identical
//! answers) and serves. Speed under emulation is not a phone's speed: nothing here is
//! timed.

use crate::common;
use crate::processes::{
    prefill_node, reported, spawn, start_three_with, Proc, ThreeOptions, ONE_AT_A_TIME,
};

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

/// The empty root's files: the static decode node, the static qemu-user that runs it, the
/// model. Hard links where the file systems allow, else copies.
struct EmptyRoot {
    dir: PathBuf,
}

/// The static file and the static qemu-user that runs it (an x86 program that needs no
/// library either).
fn phone_files() -> (PathBuf, PathBuf) {
    let repo = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    (
        repo.join("target-phone/edgesplit-decode"),
        repo.join(".build/qemu-static/usr/bin/qemu-aarch64-static"),
    )
}

impl EmptyRoot {
    fn new(tag: &str) -> Self {
        let (decode, qemu) = phone_files();
        for (file, by) in [
            (&decode, "scripts/build-phone.sh"),
            (&qemu, "scripts/test.sh (qemu-user-static)"),
        ] {
            assert!(file.is_file(), "{} missing: {by} makes it", file.display());
        }
        let dir = std::env::temp_dir().join(format!("edgesplit-root-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        for (from, name) in [
            (decode.as_path(), "edgesplit-decode"),
            (qemu.as_path(), "qemu-aarch64"),
            (common::model(common::SMOLLM2).as_path(), common::SMOLLM2),
        ] {
            place(from, &dir.join(name));
        }
        let entries = std::fs::read_dir(&dir).unwrap().count();
        assert_eq!(entries, 3, "the root holds the three files only");
        EmptyRoot { dir }
    }

    /// The decode node's program: qemu in the root, entered with `unshare --root` (as
    /// root; otherwise in a user namespace of its own, which may enter a root).
    fn program(&self) -> Vec<PathBuf> {
        let mut p: Vec<PathBuf> = vec!["unshare".into()];
        // SAFETY: geteuid reads the process's effective user id; it cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            p.extend(["--user".into(), "--map-root-user".into()]);
        }
        let mut root = std::ffi::OsString::from("--root=");
        root.push(&self.dir);
        p.extend([
            root.into(),
            "/qemu-aarch64".into(),
            "/edgesplit-decode".into(),
        ]);
        p
    }
}

impl Drop for EmptyRoot {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn place(from: &Path, to: &Path) {
    if std::fs::hard_link(from, to).is_err() {
        std::fs::copy(from, to).unwrap();
    }
}

/// The model's path inside the root.
const MODEL: &str = "/SmolLM2-135M-Instruct.Q4_1.gguf";

const SECRET: &str = "the cross-architecture test's shared secret, 32 bytes or more";

async fn ask(router: &str, body: &Value) -> Value {
    let (st, _, v) = common::post(&format!("{router}/v1/chat/completions"), body).await;
    assert_eq!(st, 200, "{body}: {v}");
    v
}

#[tokio::test]
async fn the_static_aarch64_decode_node_serves_from_an_empty_root() {
    assert_eq!(MODEL, format!("/{}", common::SMOLLM2));
    let _one = ONE_AT_A_TIME.lock().await;
    let root = EmptyRoot::new("serves");
    let t = start_three_with(ThreeOptions {
        decode_program: Some(root.program()),
        decode_extra: &["--model", MODEL],
        // A live answer writes a token per snapshot its handoff takes, so that the
        // switch comes before the answer's end however slow the emulated decode node is.
        prefill_extra: &["--test-pace-live"],
        // The router's calibration at start would prefill its probe on the emulated
        // decode node while the first answer waits for its steps there: under qemu that
        // takes longer than the router's token bound. The answers are what is tested.
        router_extra: &["--no-probes"],
        secret: Some(SECRET),
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
    // The private link: every service logs the same key fingerprint.
    let key = |log: &str| {
        let text = std::fs::read_to_string(t.dir.join(log)).unwrap();
        let line = text
            .lines()
            .find(|l| l.contains("private links"))
            .unwrap_or_else(|| panic!("{log}: no private link:\n{text}"))
            .to_string();
        let v: Value = serde_json::from_str(&line).unwrap();
        v["fields"]["key"].as_str().unwrap().to_string()
    };
    assert_eq!(key("decode.log"), key("prefill.log"));
    assert_eq!(key("decode.log"), key("router.log"));

    let story = json!([{"role": "user", "content": "Write a short story about a lighthouse."}]);
    for (transport, mode) in [("v2", "live"), ("v2", "after"), ("v1", "after")] {
        let what = format!("{transport} {mode}");
        let body = json!({
            "messages": story, "max_tokens": 24, "temperature": 0,
            "edgesplit": {"transport": transport, "handoff": mode},
        });
        let v = ask(&t.router, &body).await;
        let e = &v["edgesplit"];
        let n = v["usage"]["completion_tokens"].as_u64().unwrap();
        assert_eq!(n, 24, "{what}: {v}");
        assert_eq!(e["transport"], transport, "{what}: {v}");
        assert_eq!(e["handoff_mode"], mode, "{what}: {v}");
        common::assert_split(e, n);
        assert!(e["decode_node_tokens"].as_u64().unwrap() > 0, "{what}: {v}");
        assert_eq!(e["prefill_arch"], std::env::consts::ARCH, "{what}: {v}");
        assert_eq!(e["decode_arch"], "aarch64", "{what}: {v}");
        assert_eq!(e["same_numerics"], false, "{what}: {v}");
    }

    // A conversation goes on on the decode node that wrote its answer: only the new turn
    // is prefilled, there, and nothing crosses.
    let first = json!([{"role": "user", "content": "Name a large city of Asia."}]);
    let body = |messages: &Value| {
        json!({"messages": messages, "max_tokens": 12, "temperature": 0,
               "edgesplit": {"transport": "v2", "handoff": "after"}})
    };
    let v = ask(&t.router, &body(&first)).await;
    let answer = v["choices"][0]["message"]["content"].as_str().unwrap();
    let going_on = json!([
        first[0],
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And one of Europe?"},
    ]);
    let v = ask(&t.router, &body(&going_on)).await;
    let e = &v["edgesplit"];
    assert_eq!(e["placement"], "decode_node", "{v}");
    assert!(e["cached_tokens"].as_u64().unwrap() > 0, "{v}");
    assert!(e["handoff_bytes"].is_null(), "no state crossed: {v}");
    common::assert_split(e, v["usage"]["completion_tokens"].as_u64().unwrap());

    // The phone alone: it prefills the prompt itself and only tokens cross.
    let v = ask(
        &t.router,
        &json!({"messages": story, "max_tokens": 8, "temperature": 0,
                "edgesplit": {"transport": "phone"}}),
    )
    .await;
    let e = &v["edgesplit"];
    assert_eq!(e["transport"], "phone", "{v}");
    assert_eq!(e["decode_arch"], "aarch64", "{v}");
    assert_eq!(e["decode_node_tokens"], 8, "{v}");
    assert!(e["fallback"].is_null(), "{v}");
}

#[tokio::test]
async fn a_static_aarch64_decode_node_with_another_kv_type_is_refused() {
    let _one = ONE_AT_A_TIME.lock().await;
    let root = EmptyRoot::new("refused");
    let t = start_three_with(ThreeOptions {
        decode_program: Some(root.program()),
        decode_extra: &[
            "--model",
            MODEL,
            "--cache-type-k",
            "q8_0",
            "--cache-type-v",
            "q8_0",
        ],
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

/// The static file's memory plan (`--plan`, what `deploy/termux.sh` runs before it serves):
/// it reads `/proc/meminfo` as on a phone (Android's root has `/proc`; the empty root above
/// has not, and the plan then says so) and suggests the flags that fit. Run under qemu with
/// this machine's root.
#[tokio::test]
async fn the_static_aarch64_decode_node_plans_its_memory() {
    let _one = ONE_AT_A_TIME.lock().await;
    // Checks that the file and qemu are there, with what makes them.
    let root = EmptyRoot::new("plan");
    let (decode, qemu) = phone_files();
    let run = |root: Option<&EmptyRoot>| {
        let mut c = match root {
            Some(r) => {
                let p = r.program();
                let mut c = tokio::process::Command::new(&p[0]);
                c.args(&p[1..]).args(["--model", MODEL]);
                c
            }
            None => {
                let mut c = tokio::process::Command::new(&qemu);
                c.arg(&decode)
                    .arg("--model")
                    .arg(common::model(common::SMOLLM2));
                c
            }
        };
        c.args(["--parallel", "2", "--plan"])
            .env_remove("RUST_BACKTRACE")
            .kill_on_drop(true);
        c
    };
    let bound = std::time::Duration::from_secs(300);
    let out = tokio::time::timeout(bound, run(None).output())
        .await
        .expect("the plan is printed within the bound")
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("(MemAvailable, not total RAM)"), "{text}");
    assert!(
        text.lines()
            .any(|l| l.starts_with("suggested        --parallel 2 --n-ctx ")
                && l.contains("--kv-budget-bytes")),
        "{text}"
    );
    let out = tokio::time::timeout(bound, run(Some(&root)).output())
        .await
        .expect("the plan's refusal comes within the bound")
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("MemAvailable is not readable from /proc/meminfo"),
        "{err}"
    );
}

/// The phone's path: the static file in its empty root joins an x86 router with a code (its
/// address given: the broadcast is `join.rs`'s, on a LAN of its own), takes the prefill
/// node's settings, qualifies with its agreement reported, and serves a split answer.
#[tokio::test]
async fn the_static_aarch64_decode_node_joins_with_a_code_and_qualifies() {
    use std::time::{Duration, Instant};
    let _one = ONE_AT_A_TIME.lock().await;
    let root = EmptyRoot::new("join");
    let dir = std::env::temp_dir().join(format!("edgesplit-xjoin-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let secret_file = dir.join("secret");
    std::fs::write(&secret_file, SECRET).unwrap();
    let sf = secret_file.display().to_string();
    let strs = |a: &[&str]| a.iter().map(|x| (*x).to_string()).collect::<Vec<_>>();
    let (_prefill, prefill_url) = prefill_node(&dir, &secret_file, &[]).await;
    let state = dir.join("state").display().to_string();
    let _router = spawn(
        "edgesplit-router",
        &strs(&[
            "--listen",
            "127.0.0.1:0",
            "--prefill-url",
            &prefill_url,
            "--join-listen",
            "127.0.0.1:0",
            "--discovery-port",
            "0",
            "--state-dir",
            &state,
            "--no-probes",
            "--decode-url",
            "none",
            "--secret-file",
            &sf,
        ]),
        &dir.join("router.log"),
    );
    let r = reported(&dir.join("router.log"), "router listening (HTTP)").await;
    let router = format!("http://{}", r["addr"].as_str().unwrap());
    let joins = reported(&dir.join("router.log"), "devices may join with a code").await;
    let (st, _, v) = common::post(&format!("{router}/admin/pairing"), &json!({})).await;
    assert_eq!(st, 200, "{v}");
    let code = v["code"].as_str().unwrap().to_string();
    let program = root.program();
    let log = std::fs::File::create(dir.join("phone.log")).unwrap();
    let _phone = Proc(
        std::process::Command::new(&program[0])
            .args(&program[1..])
            .args([
                "--model",
                MODEL,
                "--join",
                &code,
                "--router",
                joins["addr"].as_str().unwrap(),
                "--join-dir",
                "/joined",
                "--name",
                "phone",
                "--threads",
                "1",
                "--listen",
                "127.0.0.1:0",
                "--handoff-listen",
                "127.0.0.1:0",
                "--v1-listen",
                "127.0.0.1:0",
                "--announce-every-s",
                "1",
            ])
            .env("EDGESPLIT_LOG_FORMAT", "json")
            .env("RUST_LOG", "info")
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    let t0 = Instant::now();
    let d = loop {
        let d = common::get_json(&format!("{router}/admin/devices")).await;
        if d["devices"][0]["state"] == "ready" {
            break d;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "not ready: {d}\n{}",
            std::fs::read_to_string(dir.join("phone.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    // Another architecture: qualified on its measured agreement, not on identity.
    let agreement = d["devices"][0]["agreement"].as_str().unwrap_or_default();
    eprintln!("the aarch64 file qualified: {agreement}");
    assert!(
        agreement.ends_with(" of 24 tokens as the laptop's (another architecture or kernels)"),
        "{d}"
    );
    // The prefill node's settings: its context size, flash attention resolved on.
    let h = common::get_json(&format!("{router}/health")).await;
    let node = &h["decode_nodes"][0];
    assert_eq!(node["arch"], "aarch64", "{h}");
    assert_eq!(
        (&node["n_ctx"], &node["flash_attn"]),
        (&json!(1024), &json!(true)),
        "{h}"
    );
    let url = d["devices"][0]["url"].as_str().unwrap();
    let v = ask(
        &router,
        &json!({
            "messages": [{"role": "user", "content": "Name two moons of Jupiter."}],
            "max_tokens": 12, "temperature": 0,
            "edgesplit": {"transport": "v2", "handoff": "after", "node": url},
        }),
    )
    .await;
    let e = &v["edgesplit"];
    assert!(e["fallback"].is_null(), "{v}");
    assert!(e["decode_node_tokens"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(e["same_numerics"], json!(false), "{v}");
    let _ = std::fs::remove_dir_all(&dir);
}
