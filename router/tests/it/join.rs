//! A device that joins with a code, on a LAN of the test's own: the phone in a network
//! namespace of its own, joined to this one by a veth pair (as root, as CI runs). The
//! router and the prefill node run here. The phone's node is given nothing but the code
//! (and the model): it finds the router by broadcast, receives its key, and serves
//! split answers identical to the laptop's own; a wrong and an expired code are refused;
//! its address changes and it is found again; the laptop's address changes and the phone
//! finds the router again, and splits go through it within seconds; the router restarts and
//! takes it back, and it finds the router again; it comes back after a restart from what it
//! kept; it holds a key of its own, not the household's secret; removed, its announces are
//! refused and no request reaches it.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use edgesplit_proto::join::{Hello, JoinError, Refusal};

use crate::common;
use crate::processes::{bin, prefill_node, reported, spawn, Proc, ONE_AT_A_TIME};

/// `ip` with `args`; panics with its error output when it fails.
fn ip(args: &[&str]) {
    let out = Command::new("ip")
        .args(args)
        .output()
        .expect("iproute2's ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A namespace `name` joined to this one by a veth pair on 10.`net`.0.0/24 (this side .1,
/// the namespace .2); deleted, with its veth, when dropped.
struct Lan {
    ns: String,
    net: String,
}

impl Lan {
    fn new() -> Lan {
        let pid = std::process::id();
        let lan = Lan {
            ns: format!("esj{pid}"),
            net: format!("10.{}.{}", 200 + pid % 50, (pid / 50) % 250),
        };
        let (here, there) = (format!("esj{pid}h"), format!("esj{pid}p"));
        let _ = Command::new("ip").args(["netns", "del", &lan.ns]).output();
        ip(&["netns", "add", &lan.ns]);
        ip(&["link", "add", &here, "type", "veth", "peer", "name", &there]);
        ip(&["link", "set", &there, "netns", &lan.ns]);
        ip(&[
            "addr",
            "add",
            &format!("{}.1/24", lan.net),
            "brd",
            "+",
            "dev",
            &here,
        ]);
        ip(&["link", "set", &here, "up"]);
        lan.exec(&["ip", "link", "set", "lo", "up"]);
        lan.exec(&[
            "ip",
            "addr",
            "add",
            &format!("{}.2/24", lan.net),
            "brd",
            "+",
            "dev",
            &there,
        ]);
        lan.exec(&["ip", "link", "set", &there, "up"]);
        lan
    }

    fn exec(&self, args: &[&str]) {
        let mut all = vec!["netns", "exec", &self.ns];
        all.extend_from_slice(args);
        ip(&all);
    }

    /// The phone's address `ip` (a suffix on the LAN) is set: the old one goes (with it,
    /// Linux drops the other addresses of its subnet), then the new one comes, as when a
    /// DHCP lease changes.
    fn set_phone(&self, from: u8, to: u8) {
        let there = format!("esj{}p", std::process::id());
        let (old, new) = (
            format!("{}.{from}/24", self.net),
            format!("{}.{to}/24", self.net),
        );
        self.exec(&["ip", "addr", "del", &old, "dev", &there]);
        self.exec(&["ip", "addr", "add", &new, "brd", "+", "dev", &there]);
    }

    /// The laptop's address changes as the phone's does in [`Lan::set_phone`].
    fn set_laptop(&self, from: u8, to: u8) {
        let here = format!("esj{}h", std::process::id());
        let (old, new) = (
            format!("{}.{from}/24", self.net),
            format!("{}.{to}/24", self.net),
        );
        ip(&["addr", "del", &old, "dev", &here]);
        ip(&["addr", "add", &new, "brd", "+", "dev", &here]);
    }
}

impl Drop for Lan {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.ns]).output();
    }
}

/// The decode node in the phone's namespace with `args` after the model's, its memory
/// `budget` bytes (`EDGESPLIT_MEM_BUDGET_BYTES`) when given.
fn phone(lan: &Lan, model: &Path, args: &[&str], budget: Option<u64>, log: &Path) -> Proc {
    let file = std::fs::File::create(log).unwrap();
    let mut c = Command::new("ip");
    c.args(["netns", "exec", &lan.ns])
        .arg(bin("edgesplit-decode"))
        .args(["--model", &model.display().to_string(), "--threads", "1"])
        .args(args);
    if let Some(b) = budget {
        c.env("EDGESPLIT_MEM_BUDGET_BYTES", b.to_string());
    }
    Proc(
        c.env("EDGESPLIT_LOG_FORMAT", "json")
            .env("RUST_LOG", "info")
            .env_remove("EDGESPLIT_SECRET")
            .env_remove("EDGESPLIT_SECRET_FILE")
            .stdout(std::process::Stdio::null())
            .stderr(file)
            .spawn()
            .unwrap(),
    )
}

/// A join that must fail: the node's exit and its error line.
fn join_refused(lan: &Lan, model: &Path, code: &str, port: &str, dir: &Path, log: &Path) -> String {
    let mut p = phone(
        lan,
        model,
        &[
            "--join",
            code,
            "--discovery-port",
            port,
            "--join-dir",
            &dir.display().to_string(),
        ],
        None,
        log,
    );
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = p.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(40),
            "the join did not end"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(!status.success());
    assert!(
        !dir.join("secret").exists(),
        "a refused join wrote a secret"
    );
    std::fs::read_to_string(log).unwrap()
}

async fn devices(router: &str) -> Value {
    common::get_json(&format!("{router}/admin/devices")).await
}

/// Waits until the first joined device is `ready` at a URL on `host`; returns the URL.
async fn ready_at(router: &str, host: &str) -> String {
    let t0 = Instant::now();
    loop {
        let d = devices(router).await;
        if let Some(url) = d["devices"][0]["url"].as_str() {
            if url.starts_with(&format!("http://{host}:")) && d["devices"][0]["state"] == "ready" {
                return url.to_string();
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "not ready at {host}: {d}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn answer(router: &str, transport: &str, node: Option<&str>) -> (u16, Value) {
    let mut body = json!({
        "messages": [{"role": "user", "content": "Write a short poem about a harbour at night."}],
        "max_tokens": 24, "temperature": 0, "edgesplit": {"transport": transport, "handoff": "after"}
    });
    if let Some(n) = node {
        body["edgesplit"]["node"] = json!(n);
    }
    let (st, _, v) = common::post(&format!("{router}/v1/chat/completions"), &body).await;
    (st, v)
}

/// A split answer through the joined phone at `url`, identical to the laptop's `want`.
async fn split_through(router: &str, url: &str, want: &str) {
    let (st, v) = answer(router, "v2", Some(url)).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["edgesplit"]["decode_node"], json!(url), "{v}");
    assert!(v["edgesplit"]["fallback"].is_null(), "{v}");
    assert!(
        v["edgesplit"]["decode_node_tokens"].as_u64().unwrap() > 0,
        "{v}"
    );
    assert_eq!(v["choices"][0]["message"]["content"], json!(want));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_phone_joins_with_a_code_alone_and_serves_split_answers() {
    let _one = ONE_AT_A_TIME.lock().await;
    assert!(
        unsafe { libc::geteuid() } == 0,
        "this test makes network namespaces: run it as root (CI does)"
    );
    let lan = Lan::new();
    let dir = std::env::temp_dir().join(format!("edgesplit-join-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let model = common::model(common::SMOLLM2);
    let m = model.display().to_string();
    // Ports in this namespace: any free UDP port for the discovery.
    let udp = std::net::UdpSocket::bind("0.0.0.0:0").unwrap();
    let port = udp.local_addr().unwrap().port().to_string();
    drop(udp);
    let secret = "a-household-secret-of-32-bytes-or-more-0123456789";
    let secret_file = dir.join("secret");
    std::fs::write(&secret_file, secret).unwrap();
    let sf = secret_file.display().to_string();
    let strs = |a: &[&str]| a.iter().map(|s| (*s).to_string()).collect::<Vec<String>>();
    // The prefill node's KV cache is q8_0 with flash attention on: the phone, started
    // without those flags, takes them from the router (the handshake would refuse it
    // otherwise), and its context size.
    let (_prefill, prefill_url) = prefill_node(
        &dir,
        &secret_file,
        &[
            "--cache-type-k",
            "q8_0",
            "--cache-type-v",
            "q8_0",
            "--flash-attn",
            "on",
        ],
    )
    .await;
    // Every interface: the laptop's own address changes below.
    let join_at = "0.0.0.0:0".to_string();
    let state = dir.join("state").display().to_string();
    let router_args = strs(&[
        "--listen",
        "127.0.0.1:0",
        "--prefill-url",
        &prefill_url,
        "--join-listen",
        &join_at,
        "--discovery-port",
        &port,
        "--state-dir",
        &state,
        "--no-probes",
        "--decode-url",
        "none",
        "--share-model",
        &m,
        "--secret-file",
        &sf,
    ]);
    let router_proc = spawn("edgesplit-router", &router_args, &dir.join("router.log"));
    let r = reported(&dir.join("router.log"), "router listening (HTTP)").await;
    let router = format!("http://{}", r["addr"].as_str().unwrap());
    reported(&dir.join("router.log"), "devices may join with a code").await;
    let pair = |ttl: u64| {
        let url = format!("{router}/admin/pairing");
        async move {
            let (st, _, v) = common::post(&url, &json!({"ttl_s": ttl})).await;
            assert_eq!(st, 200, "{v}");
            v["code"].as_str().unwrap().to_string()
        }
    };
    // No decode node yet: healthy, answered on the laptop, and a split is refused, named.
    let h = common::get_json(&format!("{router}/health")).await;
    assert_eq!(h["status"], "ok", "{h}");
    assert_eq!(h["decode_nodes"], json!([]), "{h}");
    let d = common::get_json(&format!("{router}/dashboard/api/status")).await;
    assert_eq!(d["decode_nodes"], json!([]), "{d}");
    let (st, v) = answer(&router, "auto", None).await;
    assert_eq!(st, 200, "{v}");
    let (st, v) = answer(&router, "v2", None).await;
    assert_eq!(st, 503, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no decode node"),
        "{v}"
    );
    let phone_dir = dir.join("phone");
    let pd = phone_dir.display().to_string();

    // An expired code: refused, named.
    let code = pair(1).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let log = join_refused(
        &lan,
        &model,
        &code,
        &port,
        &phone_dir,
        &dir.join("expired.log"),
    );
    assert!(log.contains("expired"), "{log}");

    // A wrong code: refused, named, the tries left counted; the right one then joins.
    let code = pair(300).await;
    let wrong = format!("{}0000-0000", &code[..4]);
    let log = join_refused(
        &lan,
        &model,
        &wrong,
        &port,
        &phone_dir,
        &dir.join("wrong.log"),
    );
    assert!(
        log.contains("wrong_code") && log.contains("2 tries left"),
        "{log}"
    );
    assert!(!log.contains(&code), "the code in a log");
    // The phone lacks the model: it receives the laptop's. A transfer broken off left
    // its first MiB, one byte of it wrong: the rest is received after it, the whole does
    // not match the SHA-256, and it is received again from the start.
    let received = dir.join("phone-models").join("model.gguf");
    std::fs::create_dir_all(received.parent().unwrap()).unwrap();
    let mut head = std::fs::read(&model).unwrap()[..1 << 20].to_vec();
    head[1000] ^= 0x55;
    std::fs::write(received.with_extension("gguf.part"), &head).unwrap();
    // What the phone's node is given besides the code (and the model).
    let joined = [
        "--discovery-port",
        &port,
        "--join-dir",
        &pd,
        "--announce-every-s",
        "1",
    ];
    let args = [&["--join", code.as_str()][..], &joined].concat();
    // Memory for the model, the plan's margin (256 MiB) and one and a half contexts of
    // the prefill node's 1,024 tokens: the phone plans one sequence, whatever its
    // --parallel, and a KV budget of one context.
    let kvpt = common::get_json(&format!("{router}/health")).await["prefill"]["kv_bytes_per_token"]
        .as_u64()
        .unwrap();
    let model_bytes = std::fs::metadata(&model).unwrap().len();
    let budget = Some(model_bytes + (256 << 20) + 1536 * kvpt);
    let mut node = phone(&lan, &received, &args, budget, &dir.join("phone.log"));
    let url = ready_at(&router, &format!("{}.2", lan.net)).await;
    // Qualified with answers identical to the laptop's (the same architecture and build).
    assert_eq!(
        devices(&router).await["devices"][0]["agreement"],
        json!("identical to the laptop's (it computes alike)")
    );
    // It took the prefill node's settings, and planned its memory.
    let h = common::get_json(&format!("{router}/health")).await;
    let d = &h["decode_nodes"][0];
    assert_eq!(
        (&d["cache_type_k"], &d["cache_type_v"], &d["flash_attn"]),
        (&json!("q8_0"), &json!("q8_0"), &json!(true)),
        "{h}"
    );
    assert_eq!(
        (&d["n_ctx"], &d["parallel"], &d["kv_budget_bytes"]),
        (&json!(1024), &json!(1), &json!(1024 * kvpt)),
        "{h}"
    );
    for log in ["router.log", "phone.log"] {
        let text = std::fs::read_to_string(dir.join(log)).unwrap();
        assert!(!text.contains(&code[4..]), "the code in {log}");
    }
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(phone_dir.join("secret"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    assert_eq!(
        std::fs::read(&received).unwrap(),
        std::fs::read(&model).unwrap()
    );
    let sent: Vec<String> = std::fs::read_to_string(dir.join("router.log"))
        .unwrap()
        .lines()
        .filter(|l| l.contains("sending the model file"))
        .map(|l| serde_json::from_str::<Value>(l).unwrap()["fields"]["from"].to_string())
        .collect();
    assert_eq!(sent, ["1048576", "0"]);
    // Used once: the pairing is closed.
    assert!(devices(&router).await["pairing"].is_null());

    let (st, local) = answer(&router, "local", None).await;
    assert_eq!(st, 200, "{local}");
    let want = local["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    split_through(&router, &url, &want).await;

    // The phone's address changes: its next announce moves it, and it serves there.
    lan.set_phone(2, 3);
    let moved = ready_at(&router, &format!("{}.3", lan.net)).await;
    assert_ne!(moved, url);
    split_through(&router, &moved, &want).await;
    // Every private handoff so far (the qualification's and these) ended as a handoff,
    // none as a refusal (a sender closes without TLS's close_notify); `/health` reads
    // `Info` at most a second old.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let h = common::get_json(&format!("{router}/health")).await;
    assert_eq!(h["decode_nodes"][0]["handoffs_refused"], 0, "{h}");
    let (st, v) = answer(&router, "v2", Some(&url)).await;
    assert_eq!(st, 400, "the old address is not a node any more: {v}");

    // The laptop's address changes: the phone finds the router again by its id, and
    // split answers are written on the phone again within seconds.
    lan.set_laptop(1, 4);
    reported(&dir.join("phone.log"), "the router moved").await;
    let t0 = Instant::now();
    loop {
        let (st, v) = answer(&router, "v2", Some(&moved)).await;
        let e = &v["edgesplit"];
        if st == 200 && e["fallback"].is_null() && e["decode_node_tokens"].as_u64() > Some(0) {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(40),
            "no split through the phone since the laptop moved: {v}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    eprintln!(
        "splits through the phone again {:?} after the router was found",
        t0.elapsed()
    );
    split_through(&router, &moved, &want).await;

    // The router restarts (other HTTP and join ports): it takes the qualified phone back
    // from its registry, and the phone, its announces unanswered, finds it again by id.
    drop(router_proc);
    let _router = spawn(
        "edgesplit-router",
        &router_args,
        &dir.join("router-again.log"),
    );
    let r = reported(&dir.join("router-again.log"), "router listening (HTTP)").await;
    let router = format!("http://{}", r["addr"].as_str().unwrap());
    assert_eq!(ready_at(&router, &format!("{}.3", lan.net)).await, moved);
    let t0 = Instant::now();
    let moves = || {
        std::fs::read_to_string(dir.join("phone.log"))
            .unwrap()
            .matches("the router moved")
            .count()
    };
    while moves() < 2 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the phone did not find the restarted router"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    split_through(&router, &moved, &want).await;

    // Restarted with nothing but the model: it is the joined device it was.
    drop(node);
    node = phone(
        &lan,
        &received,
        &joined,
        budget,
        &dir.join("phone-again.log"),
    );
    reported(&dir.join("phone-again.log"), "announced to the router").await;
    split_through(&router, &moved, &want).await;

    // Removed: out of the pool, and its announces refused.
    let id = devices(&router).await["devices"][0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    // The device holds its own key, not the household's secret: the router's link to it
    // is under that key, and nothing else is.
    let key = std::fs::read(phone_dir.join("secret")).unwrap();
    assert_eq!(key.len(), 64);
    assert_ne!(key, secret.as_bytes());
    let r = common::client()
        .delete(format!("{router}/admin/devices/{id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(devices(&router).await["devices"], json!([]));
    let (st, v) = answer(&router, "v2", Some(&moved)).await;
    assert_eq!(st, 400, "{v}");
    let refused = reported(
        &dir.join("phone-again.log"),
        "the router refused this device: join it again with a new code",
    )
    .await;
    assert_eq!(refused["reason"], "revoked", "{refused}");
    drop(node);
    // Its id is refused before any key is used; an id the router never gave is unknown.
    let at = reported(
        &dir.join("router-again.log"),
        "devices may join with a code",
    )
    .await;
    let at: std::net::SocketAddr = at["addr"].as_str().unwrap().parse().unwrap();
    for (device, want) in [
        (id.as_str(), Refusal::Revoked),
        ("0123456789abcdef", Refusal::UnknownDevice),
    ] {
        let mut tcp = tokio::net::TcpStream::connect(at).await.unwrap();
        let hello = Hello::Announce {
            v: edgesplit_proto::join::VERSION,
            device: device.to_string(),
        };
        match edgesplit_proto::join::knock(&mut tcp, &hello).await {
            Err(JoinError::Refused { reason, .. }) => assert_eq!(reason, want, "{device}"),
            other => panic!("{device}: {other:?}"),
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
