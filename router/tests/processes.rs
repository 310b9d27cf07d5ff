//! The three real binaries as separate processes on loopback: a chat request through the
//! disaggregated path, and its request id in each process's (JSON) log; SIGTERM drains the
//! router (answers in flight finish, new requests and health say so, then it exits).

mod common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn bin(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../target/release")
        .join(name);
    assert!(
        p.is_file(),
        "{} missing: scripts/test.sh builds the binaries first",
        p.display()
    );
    p
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn spawn(name: &str, args: &[String], log: &std::path::Path) -> Proc {
    let file = std::fs::File::create(log).unwrap();
    Proc(
        Command::new(bin(name))
            .args(args)
            .env("EDGESPLIT_LOG_FORMAT", "json")
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(file)
            .spawn()
            .unwrap(),
    )
}

/// The three services, started and healthy.
struct Three {
    _decode: Proc,
    _prefill: Proc,
    router: Proc,
    base: String,
    dir: PathBuf,
}

async fn start_three(tag: &str, router_extra: &[&str]) -> Three {
    let dir = std::env::temp_dir().join(format!("edgesplit-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let model = common::model(common::SMOLLM2).display().to_string();
    let [dg, dh, dv, pg, pm, r] = [(); 6].map(|()| free_port());
    let a = |s: &str| s.to_string();
    let addr = |p: u16| format!("127.0.0.1:{p}");
    let decode = spawn(
        "edgesplit-decode",
        &[
            a("--model"),
            model.clone(),
            a("--n-ctx"),
            a("1024"),
            a("--listen"),
            addr(dg),
            a("--handoff-listen"),
            addr(dh),
            a("--v1-listen"),
            addr(dv),
            a("--state-dir"),
            dir.join("d").display().to_string(),
        ],
        &dir.join("decode.log"),
    );
    let prefill = spawn(
        "edgesplit-prefill",
        &[
            a("--model"),
            model,
            a("--n-ctx"),
            a("1024"),
            a("--listen"),
            addr(pg),
            a("--metrics-listen"),
            addr(pm),
            a("--state-dir"),
            dir.join("p").display().to_string(),
        ],
        &dir.join("prefill.log"),
    );
    let mut rargs = vec![
        a("--listen"),
        addr(r),
        a("--prefill-url"),
        format!("http://{}", addr(pg)),
        a("--decode-url"),
        format!("http://{}", addr(dg)),
    ];
    rargs.extend(router_extra.iter().map(|s| s.to_string()));
    let router = spawn("edgesplit-router", &rargs, &dir.join("router.log"));
    let base = format!("http://{}", addr(r));
    let t0 = Instant::now();
    loop {
        let ok = common::client()
            .get(format!("{base}/health"))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200);
        if ok {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "services did not become healthy"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Three {
        _decode: decode,
        _prefill: prefill,
        router,
        base,
        dir,
    }
}

#[tokio::test]
async fn three_processes_one_request_id() {
    let t = start_three("procs", &[]).await;
    let (base, dir) = (&t.base, &t.dir);
    for transport in ["v2", "v1"] {
        let (st, _, v) = common::post(
            &format!("{base}/v1/chat/completions"),
            &json!({"messages":[{"role":"user","content":"Hi"}],"max_tokens":4,
                    "edgesplit":{"transport": transport}}),
        )
        .await;
        assert_eq!(st, 200, "{v}");
        assert!(v["edgesplit"]["handoff_bytes"].as_u64().unwrap() > 0);
        let id = v["edgesplit"]["request_id"].as_str().unwrap();
        for log in ["router.log", "prefill.log", "decode.log"] {
            let text = std::fs::read_to_string(dir.join(log)).unwrap();
            let hit = text
                .lines()
                .filter(|l| l.contains(id))
                .any(|l| serde_json::from_str::<serde_json::Value>(l).is_ok());
            assert!(
                hit,
                "{transport}: request id {id} not in {log} (JSON lines):\n{text}"
            );
        }
    }
}

#[tokio::test]
async fn sigterm_drains_the_router() {
    let mut t = start_three("drain", &["--drain-timeout-s", "20"]).await;
    let url = format!("{}/v1/chat/completions", t.base);
    let body = json!({
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
        "max_tokens": 200, "temperature": 0, "stream": true,
        "edgesplit": {"transport": "v2"},
    });
    let resp = common::client()
        .post(&url)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let (mut text, mut finish, mut done, mut signalled) = (String::new(), None, false, false);
    let mut sse = common::Sse::new(resp);
    while let Some(data) = sse.next().await {
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(&data).unwrap();
        assert!(v.get("error").is_none(), "{v}");
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
            text.push_str(c);
        }
        if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
            finish = Some(f.to_string());
        }
        if !signalled && !text.is_empty() {
            // SIGTERM while the answer streams.
            signalled = true;
            let pid = libc::pid_t::try_from(t.router.0.id()).unwrap();
            // SAFETY: sends a signal to our own child process; no memory is shared.
            assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
            tokio::time::sleep(Duration::from_millis(100)).await;
            let health = common::client()
                .get(format!("{}/health", t.base))
                .send()
                .await
                .unwrap();
            assert_eq!(health.status().as_u16(), 503);
            let h: serde_json::Value = health.json().await.unwrap();
            assert_eq!(h["status"], "draining");
            let (st, headers, v) =
                common::post(&url, &json!({"messages":[{"role":"user","content":"Hi"}]})).await;
            assert_eq!(st, 503, "{v}");
            assert_eq!(v["error"]["code"], "shutting_down");
            assert!(headers.contains_key("retry-after"));
        }
    }
    assert!(signalled);
    assert!(done, "the answer in flight finished with [DONE]");
    assert!(finish.is_some(), "and a finish reason");
    // Then the router exits, cleanly, soon.
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = t.router.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the router did not exit after draining"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status}");
}
