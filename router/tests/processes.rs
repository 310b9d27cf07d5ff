//! The three real binaries as separate processes on loopback: a chat request through the
//! disaggregated path, and its request id in each process's (JSON) log.

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

#[tokio::test]
async fn three_processes_one_request_id() {
    let dir = std::env::temp_dir().join(format!("edgesplit-procs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let model = common::model(common::SMOLLM2).display().to_string();
    let [dg, dh, dv, pg, pm, r] = [(); 6].map(|()| free_port());
    let a = |s: &str| s.to_string();
    let addr = |p: u16| format!("127.0.0.1:{p}");
    let _decode = spawn(
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
    let _prefill = spawn(
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
    let _router = spawn(
        "edgesplit-router",
        &[
            a("--listen"),
            addr(r),
            a("--prefill-url"),
            format!("http://{}", addr(pg)),
            a("--decode-url"),
            format!("http://{}", addr(dg)),
        ],
        &dir.join("router.log"),
    );
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
