//! The three real binaries as separate processes on loopback: a chat request through the
//! disaggregated path, and its request id in each process's (JSON) log; SIGTERM drains the
//! router (answers in flight finish, new requests and health say so, then it exits) and
//! the decode node (its answer in flight finishes, within the drain deadline or by the
//! router's fallback past it; then it exits).

use crate::common;

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use edgesplit_bench::link::Profile;
use edgesplit_bench::stack::{Stack, StackConfig};
use edgesplit_proto::pb;
use serde_json::json;

pub(crate) struct Proc(pub(crate) Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub(crate) fn bin(name: &str) -> PathBuf {
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

/// The fields of the first JSON log line of `log` whose message is `message`: a child
/// binds port 0 and reports the address it got (no port is picked, freed and raced for).
pub(crate) async fn reported(log: &std::path::Path, message: &str) -> serde_json::Value {
    edgesplit_bench::stack::reported(log, message, None)
        .await
        .unwrap()
}

/// Binary `name` of target/release with `args`, logging JSON lines to `log`.
pub(crate) fn spawn(name: &str, args: &[String], log: &std::path::Path) -> Proc {
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

/// A SmolLM2 prefill node on loopback (1,024 tokens of context, one thread) keyed by
/// `secret_file`, with `extra` flags, logging to `dir/prefill.log`; returns it and its
/// gRPC URL.
pub(crate) async fn prefill_node(
    dir: &std::path::Path,
    secret_file: &std::path::Path,
    extra: &[&str],
) -> (Proc, String) {
    let model = crate::common::model(crate::common::SMOLLM2);
    let mut args: Vec<String> = [
        "--model",
        &model.display().to_string(),
        "--n-ctx",
        "1024",
        "--threads",
        "1",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--secret-file",
        &secret_file.display().to_string(),
    ]
    .iter()
    .map(|s| (*s).to_string())
    .collect();
    args.extend(extra.iter().map(|s| (*s).to_string()));
    let log = dir.join("prefill.log");
    let p = spawn("edgesplit-prefill", &args, &log);
    let at = reported(&log, "prefill node listening").await;
    (p, format!("http://{}", at["grpc"].as_str().unwrap()))
}

/// The tests here each start three processes: one at a time, so that on a 2-core
/// machine their timings (drain deadlines) are not at the mercy of each other.
pub(crate) static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// How [`start_three_with`] starts the services.
pub(crate) struct ThreeOptions<'a> {
    pub(crate) tag: &'a str,
    /// The decode node's program: `edgesplit-decode` from target/release by default.
    pub(crate) decode_program: Option<Vec<PathBuf>>,
    pub(crate) decode_extra: &'a [&'a str],
    pub(crate) prefill_extra: &'a [&'a str],
    pub(crate) router_extra: &'a [&'a str],
    /// The handoff path through a link shaped per connection (a held connection, a slow
    /// link).
    pub(crate) handoff_via: Option<fn() -> common::Shape>,
    /// The three services' shared secret (`EDGESPLIT_SECRET`): private links.
    pub(crate) secret: Option<&'a str>,
    /// More decode nodes in the router's pool, each with these extra arguments.
    pub(crate) more_decode: Vec<Vec<String>>,
}

impl<'a> ThreeOptions<'a> {
    pub(crate) fn new(tag: &'a str) -> Self {
        ThreeOptions {
            tag,
            decode_program: None,
            decode_extra: &[],
            prefill_extra: &[],
            router_extra: &[],
            handoff_via: None,
            secret: None,
            more_decode: Vec::new(),
        }
    }
}

/// Starts the three binaries; `handoff_via` shapes the handoff path.
async fn start_three(
    tag: &str,
    decode_extra: &[&str],
    router_extra: &[&str],
    handoff_via: Option<fn() -> common::Shape>,
) -> Stack {
    start_three_with(ThreeOptions {
        decode_extra,
        router_extra,
        handoff_via,
        ..ThreeOptions::new(tag)
    })
    .await
}

/// Starts the three binaries as `o` says, on loopback with the nodes' defaults but a
/// context of 1,024 (the bench's and the demo's way: `edgesplit_bench::stack`).
pub(crate) async fn start_three_with(o: ThreeOptions<'_>) -> Stack {
    let dir = std::env::temp_dir().join(format!("edgesplit-{}-{}", o.tag, std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let strings = |a: &[&str]| a.iter().map(|s| (*s).to_string()).collect::<Vec<_>>();
    let cfg = StackConfig {
        threads: None,
        direct: true,
        decode_program: o.decode_program,
        decode_extra: strings(o.decode_extra),
        prefill_extra: strings(o.prefill_extra),
        router_extra: strings(o.router_extra),
        handoff_shape: o.handoff_via,
        secret: o.secret.map(str::to_string),
        more_decode: o.more_decode,
        ..StackConfig::new(common::model(common::SMOLLM2), 1024, 0, dir)
    };
    Stack::start(&cfg, Profile::rate(0)).await.unwrap()
}

/// The router follows the nodes' rule: on a non-loopback address without an API key it
/// refuses to start, naming the address and the ways out; `--insecure` serves it open.
/// (No node is needed: the check comes first.)
#[tokio::test]
async fn a_router_on_the_network_without_an_api_key_refuses_to_start() {
    let run = |extra: &[&str]| {
        let mut c = tokio::process::Command::new(bin("edgesplit-router"));
        c.args([
            "--listen",
            "0.0.0.0:0",
            "--prefill-url",
            "http://127.0.0.1:9",
        ])
        .args(["--decode-url", "http://127.0.0.1:9"])
        .args(extra)
        .env_remove("EDGESPLIT_API_KEY")
        .env_remove("EDGESPLIT_API_KEY_FILE")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
        c
    };
    let out = tokio::time::timeout(Duration::from_secs(30), run(&[]).output())
        .await
        .expect("a refusal is immediate")
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("refusing to serve the API on 0.0.0.0:") && err.contains("--insecure"),
        "{err}"
    );
    // With --insecure it serves (until killed), and says what is exposed.
    let mut open = run(&["--insecure"]).spawn().unwrap();
    let mut stderr = tokio::io::BufReader::new(open.stderr.take().unwrap());
    let mut log = String::new();
    let warned = tokio::time::timeout(Duration::from_secs(30), async {
        use tokio::io::AsyncBufReadExt;
        loop {
            let mut line = String::new();
            if stderr.read_line(&mut line).await.unwrap() == 0 {
                return false;
            }
            log.push_str(&line);
            if line.contains("the API is open on 0.0.0.0:") {
                return true;
            }
        }
    })
    .await;
    assert_eq!(warned, Ok(true), "{log}");
    assert!(open.try_wait().unwrap().is_none(), "{log}");
}

#[tokio::test]
async fn three_processes_one_request_id() {
    let _one = ONE_AT_A_TIME.lock().await;
    let t = start_three("procs", &[], &[], None).await;
    let (base, dir) = (&t.router, &t.dir);
    for transport in ["v2", "v1"] {
        let mut body = json!({"messages":[{"role":"user","content":"Hi"}],"max_tokens":4,
                              "edgesplit":{"transport": transport}});
        if transport == "v2" {
            // A live answer of 4 tokens may end before any state crossed.
            body["edgesplit"]["handoff"] = json!("after");
        }
        let (st, _, v) = common::post(&format!("{base}/v1/chat/completions"), &body).await;
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
    let _one = ONE_AT_A_TIME.lock().await;
    // No probes: the calibration's answers on both nodes would share them with the
    // answer the drain waits for.
    let mut t = start_three(
        "drain",
        &[],
        &["--drain-timeout-s", "20", "--no-probes"],
        None,
    )
    .await;
    let url = format!("{}/v1/chat/completions", t.router);
    let body = json!({
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
        "max_tokens": 200, "temperature": 0, "stream": true,
        "edgesplit": {"transport": "v2"},
    });
    stream_and_signal(&t.router, &body, || async {
        // SIGTERM while the answer streams.
        sigterm(&t.router_process);
        // The signal is handled asynchronously: poll until health says so (bounded).
        let t0 = std::time::Instant::now();
        let health = loop {
            let health = common::client()
                .get(format!("{}/health", t.router))
                .send()
                .await
                .unwrap();
            if health.status().as_u16() == 503 {
                break health;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "health never said draining after SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        let h: serde_json::Value = health.json().await.unwrap();
        assert_eq!(h["status"], "draining");
        let (st, headers, v) =
            common::post(&url, &json!({"messages":[{"role":"user","content":"Hi"}]})).await;
        assert_eq!(st, 503, "{v}");
        assert_eq!(v["error"]["code"], "shutting_down");
        assert!(headers.contains_key("retry-after"));
    })
    .await;
    // The answer in flight finished ([DONE] and a finish chunk); then the router exits,
    // cleanly, soon.
    let status = exited(&mut t.router_process, Duration::from_secs(10)).await;
    assert!(status.success(), "{status}");
}

fn sigterm(p: &Child) {
    let pid = libc::pid_t::try_from(p.id()).unwrap();
    // SAFETY: sends a signal to our own child process; no memory is shared.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
}

/// Waits for a process to exit; returns its status.
async fn exited(p: &mut Child, within: Duration) -> std::process::ExitStatus {
    let t0 = Instant::now();
    loop {
        if let Some(s) = p.try_wait().unwrap() {
            return s;
        }
        assert!(
            t0.elapsed() < within,
            "the process did not exit within {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// When the process exits, watched while the test does other things: it is then a zombie
/// (exited, not yet reaped by `exited`) or gone from /proc.
fn watch_exit(p: &Child) -> tokio::task::JoinHandle<Instant> {
    let pid = p.id();
    tokio::spawn(async move {
        loop {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            // The state is the first field after the command name, which is in parentheses.
            let state = stat
                .rsplit(')')
                .next()
                .and_then(|r| r.split_whitespace().next());
            if matches!(state, None | Some("Z" | "X")) {
                return Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
}

/// When the decode node exited, seen by `gone` within `within` (`what` names the
/// expectation); it must have exited with status 0.
async fn decode_exit(
    t: &mut Stack,
    gone: tokio::task::JoinHandle<Instant>,
    within: Duration,
    what: &str,
) -> Instant {
    let at = tokio::time::timeout(within, gone)
        .await
        .expect(what)
        .unwrap();
    let status = exited(&mut t.decode_process, Duration::from_secs(5)).await;
    assert!(status.success(), "{status}");
    at
}

/// Waits (up to 10 s) until the decode node at `url` reports what `ready` wants.
async fn decode_info_until(url: &str, what: &str, ready: impl Fn(&pb::NodeInfo) -> bool) {
    let mut d = pb::decode_client::DecodeClient::connect(url.to_string())
        .await
        .unwrap();
    let t0 = Instant::now();
    loop {
        let info = d.info(pb::InfoRequest {}).await.unwrap().into_inner();
        if ready(&info) {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "never {what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Streams `body` from the router at `base` and runs `at_first_content` (a SIGTERM, and
/// what to check right after it) once the first content has arrived; returns the text, the
/// finish chunk's `edgesplit` object, and when the stream ended with `[DONE]`.
async fn stream_and_signal<F: std::future::Future<Output = ()>>(
    base: &str,
    body: &serde_json::Value,
    at_first_content: impl FnOnce() -> F,
) -> (String, serde_json::Value, Instant) {
    stream_and_signal_after(base, body, 1, at_first_content).await
}

/// [`stream_and_signal`], running `signal` once `pieces` non-empty content pieces arrived.
pub(crate) async fn stream_and_signal_after<F: std::future::Future<Output = ()>>(
    base: &str,
    body: &serde_json::Value,
    pieces: usize,
    signal: impl FnOnce() -> F,
) -> (String, serde_json::Value, Instant) {
    let resp = common::client()
        .post(format!("{base}/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let (mut text, mut timing, mut done, mut seen) = (String::new(), None, false, 0);
    let mut signal = Some(signal);
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
            seen += usize::from(!c.is_empty());
        }
        if v["choices"][0]["finish_reason"].is_string() {
            timing = Some(v["edgesplit"].clone());
        }
        if seen >= pieces {
            if let Some(f) = signal.take() {
                f().await;
            }
        }
    }
    assert!(signal.is_none(), "{pieces} pieces of content arrived");
    assert!(done, "the answer ended with [DONE]");
    (text, timing.expect("a finish chunk"), Instant::now())
}

/// A long greedy answer over V2, handed over after its first token: the drains and kills
/// here are those of the `after` handoff (the decode node's `Generate` waits for the
/// state); the live handoff's kill is its own test.
pub(crate) fn story(max: u32, stream: bool) -> serde_json::Value {
    json!({
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
        "max_tokens": max, "temperature": 0, "stream": stream,
        "edgesplit": {"transport": "v2", "handoff": "after"},
    })
}

/// The same answer on the single-device path.
pub(crate) async fn local_story(t: &Stack, max: u32) -> String {
    let mut body = story(max, false);
    body["edgesplit"]["transport"] = json!("local");
    let (st, _, v) = common::post(&format!("{}/v1/chat/completions", t.router), &body).await;
    assert_eq!(st, 200, "{v}");
    v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string()
}

#[tokio::test]
async fn sigterm_drains_the_decode_node() {
    let _one = ONE_AT_A_TIME.lock().await;
    // A drain long enough: the answer in flight ends on the decode node itself, a new
    // request meanwhile is served through the fallback, and then the node exits.
    // No probes: the signal waits on the decode node's Info, which would count the
    // calibration's sequence as the answer's.
    let mut t = start_three(
        "ddrain",
        &["--drain-timeout-s", "30"],
        &["--no-probes"],
        None,
    )
    .await;
    let want = local_story(&t, 60).await;
    let gone = watch_exit(&t.decode_process);
    // The first token comes from the prefill node before the decode node has the
    // sequence (the next test signals in that gap); here the signal waits until the decode
    // node writes it.
    let (text, timing, ended) = stream_and_signal(&t.router, &story(60, true), || async {
        decode_info_until(&t.decode_grpc, "writing the answer", |i| {
            i.sequences_active > 0
        })
        .await;
        sigterm(&t.decode_process);
    })
    .await;
    assert_eq!(text, want);
    assert!(
        timing["fallback"].is_null(),
        "finished by the draining node: {timing}"
    );
    let at = decode_exit(
        &mut t,
        gone,
        Duration::from_secs(15),
        "the node exits after draining",
    )
    .await;
    assert!(
        at >= ended - Duration::from_millis(500),
        "it exited only after the answer"
    );
    let (st, _, v) = common::post(
        &format!("{}/v1/chat/completions", t.router),
        &story(8, false),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    assert!(v["edgesplit"]["fallback"].is_string(), "{v}");

    // A drain deadline shorter than the answer: the node exits at the deadline and the
    // router finishes the answer on the prefill node, identical to an uninterrupted run.
    let mut t = start_three("ddeadline", &["--drain-timeout-s", "1"], &[], None).await;
    let want = local_story(&t, 400).await;
    let gone = watch_exit(&t.decode_process);
    let signalled = std::sync::OnceLock::new();
    let (text, timing, ended) = stream_and_signal(&t.router, &story(400, true), || async {
        signalled.set(Instant::now()).unwrap();
        sigterm(&t.decode_process);
    })
    .await;
    let at = decode_exit(
        &mut t,
        gone,
        Duration::from_secs(10),
        "the node exits at its drain deadline",
    )
    .await;
    let took = at - *signalled.get().unwrap();
    assert!(
        took < Duration::from_secs(5),
        "exited {took:?} after SIGTERM"
    );
    assert_eq!(text, want);
    // A precondition, not a condition: the answer must outlive the node for this case.
    assert!(
        at < ended,
        "the 400-token answer ended before the node's 1 s drain deadline"
    );
    assert!(timing["fallback"].is_string(), "{timing}");
}

#[tokio::test]
async fn a_draining_decode_node_takes_the_handoff_an_answer_awaits() {
    let _one = ONE_AT_A_TIME.lock().await;
    // A proxy holds the handoff for 1.5 s. SIGTERM comes while the decode node's
    // `Generate` call waits for it: the client already has its first token, so the answer
    // is in flight, and the draining node takes its handoff and writes it.
    // No probes: a calibration's handoff waits on the node as this answer's does, and
    // the signal must come while the answer's own `Generate` waits.
    let mut t = start_three(
        "dawait",
        &["--drain-timeout-s", "30"],
        &["--no-probes"],
        Some(common::delaying),
    )
    .await;
    let want = local_story(&t, 32).await;
    let gone = watch_exit(&t.decode_process);
    let (text, timing, ended) = stream_and_signal(&t.router, &story(32, true), || async {
        decode_info_until(&t.decode_grpc, "awaiting the handoff", |i| {
            i.handoffs_awaited > 0
        })
        .await;
        sigterm(&t.decode_process);
    })
    .await;
    assert_eq!(text, want);
    assert!(timing["fallback"].is_null(), "finished elsewhere: {timing}");
    assert!(timing["handoff_bytes"].as_u64().unwrap() > 0, "{timing}");
    let at = decode_exit(
        &mut t,
        gone,
        Duration::from_secs(15),
        "the node exits after draining",
    )
    .await;
    assert!(
        at >= ended - Duration::from_millis(500),
        "exited after the answer"
    );
}

/// The decode node's process killed outright (SIGKILL: no drain, no goodbye) while it
/// writes a seeded answer with a frequency penalty: the prefill node finishes it, token
/// for token the one-device answer, and `fallback` says the decode node was lost.
#[tokio::test]
async fn a_killed_decode_process_loses_nothing() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut t = start_three("dkill", &[], &[], None).await;
    let seeded = |transport: &str, stream: bool| {
        let mut b = story(400, stream);
        b["temperature"] = json!(0.9);
        b["seed"] = json!(5);
        b["frequency_penalty"] = json!(0.4);
        b["edgesplit"] = json!({"transport": transport, "return_token_ids": true});
        if transport == "v2" {
            b["edgesplit"]["handoff"] = json!("after");
        }
        b
    };
    let (st, _, want) = common::post(
        &format!("{}/v1/chat/completions", t.router),
        &seeded("local", false),
    )
    .await;
    assert_eq!(st, 200, "{want}");
    // Killed once the client has 10 pieces of the answer: the resume then starts deep in
    // it, where its step index and penalty history matter.
    let (text, timing, _) = stream_and_signal_after(&t.router, &seeded("v2", true), 10, || async {
        let pid = libc::pid_t::try_from(t.decode_process.id()).unwrap();
        // SAFETY: sends a signal to our own child process; no memory is shared.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    })
    .await;
    assert_eq!(
        text,
        want["choices"][0]["message"]["content"].as_str().unwrap()
    );
    assert_eq!(timing["token_ids"], want["edgesplit"]["token_ids"]);
    assert_eq!(timing["fallback"], "decode_node_lost", "{timing}");
    // The kill came mid-answer: the prefill node wrote a real part of it (not only its end).
    assert!(
        timing["decode_tokens"].as_u64().unwrap() > 10,
        "the resumed part: {timing}"
    );
    let status = exited(&mut t.decode_process, Duration::from_secs(5)).await;
    assert!(!status.success(), "killed: {status}");
}

/// A handoff link of 1 MB/s: the prompt's state of a short chat (~1 MB) takes about a
/// second, the KV of what the answer writes meanwhile about as long again.
fn slow_link() -> common::Shape {
    common::Shape::rate(1_000_000)
}

/// The live handoff when the decode node's process is killed after the prompt's
/// state crossed and before the switch (the next piece on its way): the handoff fails, is
/// cancelled, and the answer goes on on the prefill node, token for token the one-device
/// answer. Nothing falls back: the client's answer never left the prefill node.
#[tokio::test]
async fn a_decode_process_killed_during_a_live_handoff_loses_nothing() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut t = start_three("lkill", &[], &[], Some(slow_link)).await;
    let want = local_story(&t, 400).await;
    let mut body = story(400, true);
    body["edgesplit"]["handoff"] = json!("live");
    let metrics = t.decode_metrics.clone();
    let pid = libc::pid_t::try_from(t.decode_process.id()).unwrap();
    let (text, timing, _) = stream_and_signal(&t.router, &body, || async {
        // The decode node holds the prompt's piece: the bulk has crossed.
        let t0 = Instant::now();
        loop {
            let text = common::scrape(&metrics).await;
            if common::value(&text, "edgesplit:pending_handoff_bytes") > 0.0 {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(20),
                "the prompt's state never reached the decode node"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // SAFETY: sends a signal to our own child process; no memory is shared.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    })
    .await;
    assert_eq!(text, want);
    // Cancelled by the kill, not by a link too slow for the answer (which would only be
    // noticed after the delta that the kill broke).
    let why = timing["handoff_cancelled"].as_str().unwrap_or_default();
    assert!(!why.is_empty() && !why.contains("slower than"), "{timing}");
    assert!(
        timing["switch_ms"].is_null() && timing["fallback"].is_null(),
        "{timing}"
    );
    assert_eq!(timing["decode_tokens"], 0, "{timing}");
    let status = exited(&mut t.decode_process, Duration::from_secs(5)).await;
    assert!(!status.success(), "killed: {status}");
}
