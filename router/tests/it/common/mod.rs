//! Starts the real services (decode node, prefill node, router) on loopback port 0 with a
//! real model, on a runtime of their own that lives as long as the test binary.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::net::TcpListener;

pub mod stock;

/// `EDGESPLIT_FULL_SWEEP=1`: the long sweeps run in full (CI runs a reduced set, which each
/// test states).
pub fn full_sweep() -> bool {
    std::env::var("EDGESPLIT_FULL_SWEEP").is_ok_and(|v| v == "1")
}

/// The transports an identity test samples with a seed for a prompt of at least
/// `min_prompt_tokens`: every one (`plain`: the router's defaults), except in CI for a
/// prompt of 500 tokens or more, where only `v2-live` (the switch mid-answer, the step
/// index carried across): such prompts run greedy on every transport, and the seed on every
/// transport with the shorter prompts. `EDGESPLIT_FULL_SWEEP=1`: every one.
pub fn seeded_transports(min_prompt_tokens: u64) -> &'static [&'static str] {
    if full_sweep() || min_prompt_tokens < 500 {
        &["v2", "v1", "v2-live", "phone", "plain"]
    } else {
        &["v2-live"]
    }
}

/// Where the models live (`scripts/fetch-models.sh` puts them there).
pub fn model(file: &str) -> PathBuf {
    let dir = std::env::var("EDGESPLIT_MODELS_DIR").map_or_else(
        |_| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models"),
        PathBuf::from,
    );
    let p = dir.join(file);
    assert!(
        p.is_file(),
        "model {} missing: run scripts/test.sh, which fetches it",
        p.display()
    );
    p
}

pub const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const GEMMA3: &str = "gemma-3-270m-q4_k_m.gguf";

/// Options of a test stack.
#[derive(Clone)]
pub struct StackOptions {
    pub model: PathBuf,
    pub n_ctx: u32,
    /// Sequences each node serves at once (`--parallel`).
    pub parallel: u32,
    /// Put something between the nodes: the decode node advertises this address instead of
    /// its own handoff listener (given the real one, returns the address to advertise).
    pub handoff_proxy: Option<fn(String) -> String>,
    /// Point the router at this decode URL instead of the real decode node.
    pub decode_url_override: Option<String>,
    /// Put something between the router and the decode node's gRPC listener (given its
    /// address, returns the address the router uses).
    pub decode_proxy: Option<fn(String) -> String>,
    /// The same between the router and the prefill node's gRPC listener.
    pub prefill_proxy: Option<fn(String) -> String>,
    /// Put something between the nodes' V1 uploads: the decode node advertises this
    /// address (given its V1 listener's) for its upload URL.
    pub v1_proxy: Option<fn(String) -> String>,
    /// The router's `--on-split-failure fail` (default: fallback).
    pub fail_on_split_failure: bool,
    /// The decode node's `--handoff-frame-timeout-s`.
    pub handoff_handshake_timeout_s: u64,
    /// The decode node's `--upload-timeout-s`.
    pub upload_timeout_s: u64,
    /// The router's `--max-in-flight` and `--max-queue`.
    /// The router's `--max-in-flight` (None: the decode node's `parallel`).
    pub max_in_flight: Option<usize>,
    pub max_queue: usize,
    /// The router's `--queue-timeout-s`.
    pub queue_timeout_s: u64,
    /// The decode node's `--pending-ttl-s`.
    pub pending_ttl_s: u64,
    /// The decode node's `--handoff-wait-s`.
    pub handoff_wait_s: u64,
    /// The router's `--token-idle-timeout-ms`.
    pub token_idle_timeout_ms: u64,
    /// Both nodes' `--cache-type-k` and `--cache-type-v`.
    pub cache_type: edgesplit_engine::KvType,
    /// The decode node's `--kv-budget-bytes`.
    pub kv_budget_bytes: u64,
    /// The router's `--bench-db` (the dashboard's benchmark section).
    pub bench_db: Option<PathBuf>,
    /// The shared secret of all three services (written to a file each reads).
    pub secret: Option<String>,
    /// A different secret for the decode node only (a wrong-key peer).
    pub decode_secret: Option<String>,
    /// No secret on the decode node, whatever `secret` says (a device left unconfigured).
    pub decode_plain: bool,
    /// The router's API key.
    pub api_key: Option<String>,
    /// The router takes devices that join with a code (`--join-listen 127.0.0.1:0`, no
    /// discovery), its registry in this directory; needs `secret`.
    pub join_state_dir: Option<PathBuf>,
    /// The router's default handoff mode: the product's (`live`); a test that checks
    /// another mode names it in its requests (`v2` in [`run`] is `after`).
    pub handoff: edgesplit_router::api::HandoffMode,
    /// The test hook `--test-pace-live` on the prefill node: a live answer writes a token
    /// per piece its handoff cuts, so the switch comes within its first few tokens on
    /// any machine. For stacks whose live answers are short (a few tokens): without it,
    /// whether such an answer reaches the decode node depends on this machine's speed.
    /// It changes when tokens are written, never which.
    pub pace_live: bool,
    /// The prefill node's `--stream-prefill`.
    pub stream_prefill: bool,
    /// Both nodes' `--batch` (prefill batch).
    pub batch: u32,
    /// Both nodes' `--chat-template-file`.
    pub chat_template_file: Option<PathBuf>,
    /// The decode node's `--chat-template-file` instead (a device set up otherwise).
    pub decode_chat_template_file: Option<PathBuf>,
    /// The router's `--continue-on`.
    pub continue_on: edgesplit_router::backend::ContinueOn,
    /// The router's `--info-timeout-ms` (None: its default).
    pub info_timeout_ms: Option<u64>,
    /// The prefill node's and the decode node's `--threads` (None: the default, the
    /// physical cores). A real pair never runs equal counts; the answers must not care.
    pub prefill_threads: Option<i32>,
    pub decode_threads: Option<i32>,
    /// The router's probes (its calibration at start and at idle moments): off unless a
    /// test asks, so that a test's own requests are the only work on the nodes and the
    /// router measures only what they measure (the product's default is on: `auto.rs`).
    pub probes: bool,
    /// The nodes' warm-up before they report ready: off unless a test asks. It changes
    /// no answer and no state (`engine/tests/it/warmup.rs`), only the first request's
    /// speed, which matters to the tests of the router's choice; it costs ~0.5 s per
    /// engine start here.
    pub warmup: bool,
}

impl StackOptions {
    pub fn new(model_file: &str) -> Self {
        Self {
            model: model(model_file),
            n_ctx: 2048,
            batch: 512,
            parallel: 2,
            handoff_proxy: None,
            decode_url_override: None,
            decode_proxy: None,
            prefill_proxy: None,
            v1_proxy: None,
            fail_on_split_failure: false,
            handoff_handshake_timeout_s: 10,
            upload_timeout_s: 120,
            max_in_flight: None,
            info_timeout_ms: None,
            max_queue: 64,
            queue_timeout_s: 60,
            pending_ttl_s: 120,
            handoff_wait_s: 5,
            token_idle_timeout_ms: 15_000,
            cache_type: edgesplit_engine::KvType::F16,
            kv_budget_bytes: 0,
            bench_db: None,
            secret: None,
            join_state_dir: None,
            decode_secret: None,
            decode_plain: false,
            api_key: None,
            // The router's own default, whatever it is.
            handoff: edgesplit_router::Config::new(String::new(), String::new()).handoff,
            pace_live: false,
            stream_prefill: false,
            chat_template_file: None,
            decode_chat_template_file: None,
            continue_on: edgesplit_router::backend::ContinueOn::Measured,
            prefill_threads: None,
            decode_threads: None,
            probes: false,
            warmup: false,
        }
    }
}

/// Addresses of a running stack.
#[derive(Clone, Debug)]
pub struct Stack {
    pub router: String,
    pub prefill_grpc: String,
    pub decode_grpc: String,
    /// The decode node's real V2 listener.
    pub handoff_addr: String,
    /// The decode node's V1 upload URL.
    pub v1_url: String,
    /// The prefill node's `/metrics` URL.
    pub prefill_metrics: String,
    /// The decode node's `--metrics-listen` `/metrics` URL (plain HTTP, with or without a
    /// secret; its V1 port serves them too, over TLS when private).
    pub decode_metrics: String,
    /// The stack runs until the last clone of this is dropped.
    alive: Option<Arc<tokio::sync::oneshot::Sender<()>>>,
}

/// Starts a stack on a dedicated thread and runtime that outlive the calling test's
/// runtime; it stops (services cancelled, contexts freed) when the returned `Stack` and
/// its clones are dropped.
pub fn start(opts: StackOptions) -> Stack {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let (alive, stopped) = tokio::sync::oneshot::channel();
            let mut stack = serve(opts).await;
            stack.alive = Some(Arc::new(alive));
            tx.send(stack).unwrap();
            // Resolves (with an error) once every clone of the sender is gone.
            let _ = stopped.await;
        });
        // Dropping the runtime cancels the services; the engines free their contexts
        // once their last handle is gone.
        drop(rt);
    });
    rx.recv_timeout(Duration::from_secs(120))
        .expect("stack started")
}

async fn serve(opts: StackOptions) -> Stack {
    let decode_grpc = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let handoff = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let v1 = TcpListener::bind("127.0.0.1:0").await.unwrap();
    // The decode node's V1 port speaks TLS when it has a secret.
    let scheme = if !opts.decode_plain && (opts.decode_secret.is_some() || opts.secret.is_some()) {
        "https"
    } else {
        "http"
    };
    let v1_addr = v1.local_addr().unwrap().to_string();
    let v1_url = format!("{scheme}://{v1_addr}/v1/handoff");
    static STACKS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = STACKS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let base = std::env::temp_dir().join(format!("edgesplit-test-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&base);
    let prefill_grpc = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let prefill_metrics = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let prefill_metrics_url = format!("http://{}/metrics", prefill_metrics.local_addr().unwrap());
    let decode_metrics = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let decode_metrics_url = format!("http://{}/metrics", decode_metrics.local_addr().unwrap());
    let router = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let handoff_addr = handoff.local_addr().unwrap().to_string();
    let decode_url = format!("http://{}", decode_grpc.local_addr().unwrap());
    let prefill_url = format!("http://{}", prefill_grpc.local_addr().unwrap());
    let stack = Stack {
        router: format!("http://{}", router.local_addr().unwrap()),
        prefill_grpc: prefill_url.clone(),
        decode_grpc: decode_url.clone(),
        handoff_addr: handoff_addr.clone(),
        v1_url,
        prefill_metrics: prefill_metrics_url,
        decode_metrics: decode_metrics_url,
        alive: None,
    };

    std::fs::create_dir_all(&base).unwrap();
    let write = |name: &str, v: &Option<String>| {
        v.as_ref().map(|v| {
            let p = base.join(name);
            std::fs::write(&p, v).unwrap();
            p
        })
    };
    let secret_file = write("secret", &opts.secret);
    let decode_secret_file = write(
        "decode-secret",
        &(if opts.decode_plain {
            None
        } else {
            opts.decode_secret.clone().or(opts.secret.clone())
        }),
    );
    let api_key_file = write("api-key", &opts.api_key);
    let engine_args = edgesplit_engine::EngineArgs {
        n_ctx: opts.n_ctx,
        batch: opts.batch,
        cache_type_k: opts.cache_type,
        cache_type_v: opts.cache_type,
        chat_template_file: opts.chat_template_file.clone(),
        no_warmup: !opts.warmup,
        ..edgesplit_engine::EngineArgs::new(opts.model.clone())
    };
    let dcfg = edgesplit_decode::Config {
        engine: edgesplit_engine::EngineArgs {
            chat_template_file: opts
                .decode_chat_template_file
                .clone()
                .or(opts.chat_template_file.clone()),
            threads: opts.decode_threads,
            ..engine_args.clone()
        },
        node: edgesplit_proto::service::NodeArgs {
            secret_file: decode_secret_file,
            handoff_frame_timeout_s: 30,
            handoff_handshake_timeout_s: opts.handoff_handshake_timeout_s,
            drain_timeout_s: 30,
            insecure: false,
        },
        joining: edgesplit_decode::join::JoinArgs::default(),
        listen: String::new(),
        handoff_listen: String::new(),
        handoff_advertise: opts.handoff_proxy.map(|f| f(handoff_addr.clone())),
        v1_listen: String::new(),
        v1_advertise: opts
            .v1_proxy
            .map(|f| format!("http://{}/v1/handoff", f(v1_addr.clone()))),
        metrics_listen: None,
        parallel: opts.parallel,
        handoff_wait_s: opts.handoff_wait_s,
        kv_budget_bytes: opts.kv_budget_bytes,
        plan: false,
        pending_ttl_s: opts.pending_ttl_s,
        max_pending_bytes: 1 << 30,
        upload_timeout_s: opts.upload_timeout_s,
        max_frame_bytes: edgesplit_proto::frame::DEFAULT_MAX_FRAME,
        rpc_listen: None,
    };
    let pcfg = edgesplit_prefill::Config {
        engine: edgesplit_engine::EngineArgs {
            test_pace_live: opts.pace_live,
            threads: opts.prefill_threads,
            ..engine_args
        },
        node: edgesplit_proto::service::NodeArgs {
            secret_file: secret_file.clone(),
            handoff_frame_timeout_s: 30,
            handoff_handshake_timeout_s: 10,
            drain_timeout_s: 30,
            insecure: false,
        },
        listen: String::new(),
        parallel: opts.parallel,
        gpu_layers: None,
        handoff_connect_timeout_s: 5,
        metrics_listen: String::new(),
        stream_prefill: opts.stream_prefill,
        rpc_peer: None,
        rpc_layers: None,
        rpc_reconnect_s: 15,
        decode_url: None,
        plan: false,
    };
    let dengine = edgesplit_engine::Engine::start(dcfg.engine())
        .await
        .unwrap();
    let pengine = edgesplit_engine::Engine::start(pcfg.engine())
        .await
        .unwrap();
    tokio::spawn(async move {
        let listeners = edgesplit_decode::Listeners {
            grpc: decode_grpc,
            handoff,
            v1,
            metrics: Some(decode_metrics),
        };
        edgesplit_decode::run(listeners, dengine, &dcfg, std::future::pending())
            .await
            .unwrap();
    });
    tokio::spawn(async move {
        let listeners = edgesplit_prefill::Listeners {
            grpc: prefill_grpc,
            metrics: prefill_metrics,
        };
        edgesplit_prefill::run(listeners, pengine, &pcfg, None, std::future::pending())
            .await
            .unwrap();
    });
    let router_decode = match (opts.decode_url_override, opts.decode_proxy) {
        (Some(u), _) => u,
        (None, Some(proxy)) => format!(
            "http://{}",
            proxy(decode_url["http://".len()..].to_string())
        ),
        (None, None) => decode_url,
    };
    let router_prefill = match opts.prefill_proxy {
        Some(proxy) => format!(
            "http://{}",
            proxy(prefill_url["http://".len()..].to_string())
        ),
        None => prefill_url,
    };
    let mut rcfg = edgesplit_router::Config::new(router_prefill, router_decode);
    rcfg.max_in_flight = opts.max_in_flight;
    rcfg.handoff = opts.handoff;
    rcfg.continue_on = opts.continue_on;
    rcfg.no_probes = !opts.probes;
    rcfg.max_queue = opts.max_queue;
    rcfg.queue_timeout_s = opts.queue_timeout_s;
    rcfg.token_idle_timeout_ms = opts.token_idle_timeout_ms;
    if let Some(ms) = opts.info_timeout_ms {
        rcfg.info_timeout_ms = ms;
    }
    if opts.fail_on_split_failure {
        rcfg.on_split_failure = edgesplit_router::OnSplitFailure::Fail;
    }
    rcfg.bench_db = opts.bench_db;
    if let Some(dir) = opts.join_state_dir {
        rcfg.join_listen = Some("127.0.0.1:0".into());
        rcfg.discovery_port = 0;
        rcfg.state_dir = Some(dir);
    }
    rcfg.secret_file = secret_file;
    rcfg.api_key_file = api_key_file;
    tokio::spawn(async move {
        edgesplit_router::run(router, &rcfg, std::future::pending())
            .await
            .unwrap();
    });
    stack
}

/// How long `delaying_proxy` holds a handoff connection.
pub const HANDOFF_DELAY: Duration = Duration::from_millis(1500);

/// Between the nodes: holds every handoff connection to `target` for `HANDOFF_DELAY`
/// before forwarding it; returns the proxy's address. Call it inside a runtime.
pub fn delaying_proxy(target: String) -> String {
    shaped(target, delaying)
}

/// A connection held for `HANDOFF_DELAY` before it is forwarded.
pub fn delaying() -> Shape {
    Shape {
        faults: Faults {
            connect_delay: HANDOFF_DELAY,
            ..Faults::default()
        },
        ..Shape::rate(0)
    }
}

pub use edgesplit_bench::link::{Faults, Shape};

/// A link to `target` (the bench's emulator, `bench/src/link.rs`) whose connections are
/// shaped as `shape()` says when each opens; returns its address. Call it inside a runtime.
pub fn shaped(target: String, shape: fn() -> Shape) -> String {
    edgesplit_bench::link::Link::shaped(target, shape).to_string()
}

/// The default-model stack shared by a test binary: the product's defaults, with live
/// answers paced ([`StackOptions::pace_live`]: its tests' answers are short), and the
/// nodes at different thread counts (prefill 2, decode 1), as a real pair runs: every
/// identity test on it holds across thread counts (the Gemma stack runs the reverse).
pub fn smollm2() -> &'static Stack {
    static S: OnceLock<Stack> = OnceLock::new();
    S.get_or_init(|| {
        let mut o = StackOptions::new(SMOLLM2).paced();
        o.prefill_threads = Some(2);
        o.decode_threads = Some(1);
        start(o)
    })
}

impl StackOptions {
    /// With [`StackOptions::pace_live`].
    #[must_use]
    pub fn paced(self) -> Self {
        Self {
            pace_live: true,
            ..self
        }
    }
}

/// The text a GET of `url` returns (a `/metrics` page).
pub async fn scrape(url: &str) -> String {
    client()
        .get(url)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The value of one series (name with labels, exactly as rendered), 0 if absent.
pub fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.strip_prefix(' '))
        })
        .map_or(0.0, |v| v.trim().parse().unwrap())
}

/// The router's `/metrics` text.
pub async fn metrics_text(stack: &Stack) -> String {
    scrape(&format!("{}/metrics", stack.router)).await
}

/// A raw prompt the model keeps continuing (counting), for answers that hold a slot.
pub fn counting_prompt() -> String {
    let count = (1..=40)
        .map(|i| i.to_string())
        .collect::<Vec<_>>()
        .join(", ");
    format!("{count},")
}

/// A listener on a free loopback port, for a test's proxy, and its address.
pub fn proxy_listener() -> (String, TcpListener) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.set_nonblocking(true).unwrap();
    let addr = l.local_addr().unwrap().to_string();
    (addr, TcpListener::from_std(l).unwrap())
}

/// A proxy to `target` that forwards until `cut` is set, then drops every connection and
/// refuses new ones (a node gone, as its peers see it). Returns its address.
pub fn cuttable_proxy(target: String, cut: &'static AtomicBool) -> String {
    let (addr, l) = proxy_listener();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = l.accept().await {
            if cut.load(Ordering::SeqCst) {
                continue; // dropped: connection refused, in effect
            }
            let target = target.clone();
            tokio::spawn(async move {
                let mut outbound = tokio::net::TcpStream::connect(target).await.unwrap();
                tokio::select! {
                    _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                    () = async {
                        while !cut.load(Ordering::SeqCst) {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                        }
                    } => {}
                }
                // Both sockets dropped here: the peer sees the node vanish mid-stream.
            });
        }
    });
    addr
}

/// A gauge (no labels) of the router's `/metrics`.
pub async fn gauge(stack: &Stack, name: &str) -> Option<i64> {
    let text = metrics_text(stack).await;
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// Polls the router's gauge `name` until it reads `value` (at most 60 s).
pub async fn wait_for_gauge(stack: &Stack, name: &str, value: i64) {
    let t0 = std::time::Instant::now();
    while gauge(stack, name).await != Some(value) {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{name} never reached {value}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The router's `edgesplit:fallbacks_total{cause}` for one cause.
pub async fn fallbacks_for(stack: &Stack, cause: &str) -> u64 {
    let text = metrics_text(stack).await;
    let prefix = format!("edgesplit:fallbacks_total{{cause=\"{cause}\"}} ");
    text.lines()
        .find_map(|l| l.strip_prefix(&prefix)?.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// The router's `edgesplit:fallbacks_total`, all causes together.
pub async fn fallbacks(stack: &Stack) -> u64 {
    let text = metrics_text(stack).await;
    text.lines()
        .filter(|l| l.starts_with("edgesplit:fallbacks_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// The router's `/health` body.
pub async fn health(stack: &Stack) -> Value {
    get_json(&format!("{}/health", stack.router)).await
}

/// A GET's JSON body.
pub async fn get_json(url: &str) -> Value {
    client()
        .get(url)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .unwrap()
}

/// POSTs JSON; returns status, headers and the parsed body.
pub async fn post(url: &str, body: &Value) -> (u16, reqwest::header::HeaderMap, Value) {
    let r = client().post(url).json(body).send().await.unwrap();
    let status = r.status().as_u16();
    let headers = r.headers().clone();
    let v = r.json().await.unwrap_or(Value::Null);
    (status, headers, v)
}

/// POSTs raw bytes.
pub async fn post_raw(url: &str, body: &'static str) -> (u16, Value) {
    let r = client()
        .post(url)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

/// A streamed response: every `data:` payload in order (the final `[DONE]` included).
pub async fn stream(url: &str, body: &Value) -> (u16, Vec<String>) {
    let r = client().post(url).json(body).send().await.unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    let datas = text
        .split("\n\n")
        .filter_map(|ev| {
            ev.lines()
                .find_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
                .map(str::to_string)
        })
        .collect();
    (status, datas)
}

/// Parses the JSON chunks of a stream (everything before `[DONE]`).
pub fn chunks(datas: &[String]) -> Vec<Value> {
    assert_eq!(
        datas.last().map(String::as_str),
        Some("[DONE]"),
        "{datas:?}"
    );
    datas[..datas.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

/// A chat body with the given messages and options merged in.
pub fn chat_body(messages: Value, extra: Value) -> Value {
    let mut b = json!({"messages": messages});
    if let (Some(b), Some(e)) = (b.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    b
}

/// What an answer came to, streamed or not, so the two can be compared.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub text: String,
    pub token_ids: Vec<i64>,
    pub finish_reason: String,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// The choice's `logprobs` (streamed: every chunk's, joined into the same shape).
    pub logprobs: Value,
    /// The message's tool calls, (name, arguments), in order (streamed: the deltas
    /// joined by index, as a client joins them). Their ids are new in every answer.
    pub tool_calls: Vec<(String, String)>,
}

/// Joins a streamed chunk's `logprobs` into `acc`: each list of the object extended.
fn join_logprobs(acc: &mut Value, part: &Value) {
    let Some(part) = part.as_object() else {
        return;
    };
    if acc.is_null() {
        *acc = Value::Object(part.clone());
        return;
    }
    for (k, v) in part {
        if let (Some(list), Some(more)) = (acc[k].as_array_mut(), v.as_array()) {
            list.extend(more.iter().cloned());
        }
    }
}

fn ids(v: &Value) -> Vec<i64> {
    v["edgesplit"]["token_ids"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_i64).collect())
        .unwrap_or_default()
}

/// The tests' transport names: `v2` is the V2 handoff after the first token (`after`),
/// `v2-live` the live one; `v1` and `local` as the API names them.
pub fn transport_mode(transport: &str) -> (&str, Option<&'static str>) {
    match transport {
        "v2" => ("v2", Some("after")),
        "v2-live" => ("v2", Some("live")),
        other => (other, None),
    }
}

/// Runs `body` (chat or completion, per `path`) on `transport`, streamed or not. On `v1`
/// and `v2` it also asserts that the split really happened ([`assert_split`]): without
/// it, a broken import finished by the fallback would look like a correct split answer.
pub async fn run(
    stack: &Stack,
    path: &str,
    body: &Value,
    transport: &str,
    streamed: bool,
) -> Outcome {
    let (outcome, edgesplit) = run_reporting(stack, path, body, transport, streamed).await;
    assert_written_as(transport, &edgesplit, outcome.completion_tokens);
    outcome
}

/// Who wrote an answer over `transport` (`local`, `phone`, else a split), as its
/// `edgesplit` object reports it.
fn assert_written_as(transport: &str, edgesplit: &Value, completion_tokens: u64) {
    if transport == "local" {
        assert_eq!(edgesplit["first_token_from"], "prefill", "{edgesplit}");
        assert_eq!(edgesplit["decode_node_tokens"], 0, "{edgesplit}");
    } else if transport == "phone" {
        // The decode node alone: it prefilled and wrote everything, no state crossed.
        assert_eq!(edgesplit["placement"], "decode_node", "{edgesplit}");
        assert!(edgesplit["handoff_bytes"].is_null(), "{edgesplit}");
        assert_split(edgesplit, completion_tokens);
    } else {
        assert_split(edgesplit, completion_tokens);
    }
}

/// `body` on `stack` through `path`: `local` (the reference, returned), then `local`
/// streamed, every split transport (`v2` streamed, `v1`, `v2-live`), the decode node alone
/// (`phone`) and the plain request
/// (no `edgesplit` field: the defaults), streamed and not: the same answer.
/// CI runs five of the eight: the reference, `v2` streamed, `v2-live`, `phone` and the
/// plain request streamed; `local` streamed, `v1` and the plain request not streamed are
/// compared on every answer of other tests (`fidelity::`, `structured::`, `concurrency::`).
/// `EDGESPLIT_FULL_SWEEP=1`: all eight.
pub async fn same_on_every_transport(stack: &Stack, path: &str, body: &Value) -> Outcome {
    let full = full_sweep();
    let reference = run(stack, path, body, "local", false).await;
    for (transport, streamed) in [
        ("local", true),
        ("v2", true),
        ("v1", false),
        ("v2-live", false),
        ("phone", true),
    ] {
        if !full && (transport == "v1" || transport == "local") {
            continue;
        }
        let o = run(stack, path, body, transport, streamed).await;
        assert_eq!(o, reference, "{transport}, streamed {streamed}: {body}");
    }
    // As a client sends it: the router's defaults split it live.
    for streamed in [false, true] {
        if !full && !streamed {
            continue;
        }
        let o = run_plain(stack, path, body, streamed).await;
        assert_eq!(
            o,
            reference.without_ids(),
            "plain request, streamed {streamed}: {body}"
        );
    }
    reference
}

impl Outcome {
    /// This outcome as a request that did not ask for token ids sees it.
    #[must_use]
    pub fn without_ids(&self) -> Outcome {
        Outcome {
            token_ids: Vec::new(),
            ..self.clone()
        }
    }
}

/// The decode node wrote the answer, whatever ended it (its length, an end of generation,
/// a stop string): no fallback; the first token written where it should be (the prefill
/// node, or the decode node when it continued a conversation it held); and every token
/// after the first (`after`, V1) or after the switch (`live`) written by the decode node,
/// as the router received them. A live answer of two tokens or more must have switched
/// before its end.
pub fn assert_split(edgesplit: &Value, completion_tokens: u64) {
    let e = edgesplit;
    assert!(e["fallback"].is_null(), "the split fell back: {e}");
    let by_decode = e["decode_node_tokens"]
        .as_u64()
        .expect("decode_node_tokens");
    // The architecture of each node that took part is reported (the cross-architecture
    // test checks the values).
    assert!(
        e["decode_arch"].as_str().is_some_and(|a| !a.is_empty()),
        "{e}"
    );
    if e["placement"] == "decode_node" {
        // The decode node continued the conversation: it wrote every token.
        assert!(e["prefill_arch"].is_null(), "{e}");
        assert_eq!(e["first_token_from"], "decode", "{e}");
        assert_eq!(by_decode, completion_tokens, "{e}");
        return;
    }
    assert!(
        e["prefill_arch"].as_str().is_some_and(|a| !a.is_empty()),
        "{e}"
    );
    // Whether the two nodes compute alike: on one machine, yes (whatever their thread
    // counts); across architectures, no.
    assert_eq!(
        e["same_numerics"],
        serde_json::json!(e["prefill_arch"] == e["decode_arch"]),
        "{e}"
    );
    assert_eq!(e["first_token_from"], "prefill", "{e}");
    if completion_tokens < 2 {
        assert_eq!(by_decode, 0, "{e}");
        return;
    }
    let mut written_before = 1;
    if e["handoff_mode"] == "live" {
        assert!(
            e["handoff_cancelled"].is_null(),
            "the live handoff gave up: {e}"
        );
        written_before = e["prefill_tokens"].as_u64().expect("prefill_tokens");
        assert!(
            written_before < completion_tokens && e["switch_ms"].as_f64().is_some(),
            "the answer ended before the live switch: {e}"
        );
    }
    assert!(
        e["handoff_bytes"].as_u64().is_some_and(|b| b > 0),
        "no handoff bytes: {e}"
    );
    assert_eq!(
        by_decode,
        completion_tokens - written_before,
        "the decode node did not write every token after the first {written_before}: {e}"
    );
    // The decode node's own count, when it reported one (a stop string ends the answer at
    // the router before the decode node reports).
    if !e["decode_ms"].is_null() {
        assert_eq!(e["decode_tokens"].as_u64(), Some(by_decode), "{e}");
    }
}

/// `body` as a client sends it: no `edgesplit` field, streamed or not; the router's
/// defaults choose: `transport: "auto"` under the `balanced` objective. Returns the outcome
/// (no token ids) after checking that the answer says which mode was chosen and why, and
/// that the mode really ran (a split's decode node wrote the answer after the switch,
/// [`assert_split`]; the phone alone wrote all of it).
pub async fn run_plain(stack: &Stack, path: &str, body: &Value, streamed: bool) -> Outcome {
    assert!(body.get("edgesplit").is_none(), "{body}");
    let (outcome, e) = send(stack, path, body, streamed).await;
    assert_eq!(e["objective"], "balanced", "{e}");
    assert!(e["reason"].as_str().is_some_and(|r| !r.is_empty()), "{e}");
    assert!(e.get("token_ids").is_none(), "{e}");
    let (transport, handoff) = match e["mode"].as_str() {
        Some("local") => ("local", None),
        Some("phone") => ("phone", None),
        Some(m @ ("live" | "after")) => ("v2", Some(m)),
        _ => panic!("the default is not the router's choice: {e}"),
    };
    assert_eq!(e["transport"], transport, "{e}");
    if let Some(m) = handoff {
        assert_eq!(e["handoff_mode"], m, "{e}");
    }
    assert_written_as(transport, &e, outcome.completion_tokens);
    outcome
}

/// Sends `body` to `path`, streamed (with the usage chunk) or not; the answer must be a
/// 200. Returns its outcome and its `edgesplit` object.
pub async fn send(stack: &Stack, path: &str, body: &Value, streamed: bool) -> (Outcome, Value) {
    let mut body = body.clone();
    body["stream"] = json!(streamed);
    if streamed {
        body["stream_options"] = json!({"include_usage": true});
    }
    let url = format!("{}{}", stack.router, path);
    if streamed {
        let (status, datas) = stream(&url, &body).await;
        assert_eq!(status, 200, "{datas:?}");
        outcome_of_chunks(&chunks(&datas))
    } else {
        let (status, _, v) = post(&url, &body).await;
        assert_eq!(status, 200, "{v}");
        (outcome_of_body(&v), v["edgesplit"].clone())
    }
}

/// A conversation the decode node continued, or a request answered without a reachable
/// decode node, had no handoff (and so no handoff mode).
fn no_handoff(edgesplit: &Value) -> bool {
    edgesplit["placement"] == "decode_node" || edgesplit["fallback"] == "decode_unavailable"
}

/// [`run`] without the split assertion (for answers that are meant to fall back), with the
/// answer's `edgesplit` object.
pub async fn run_reporting(
    stack: &Stack,
    path: &str,
    body: &Value,
    transport: &str,
    streamed: bool,
) -> (Outcome, Value) {
    let mut body = body.clone();
    let (wire, mode) = transport_mode(transport);
    body["edgesplit"] = json!({"transport": wire, "return_token_ids": true});
    if let Some(m) = mode {
        body["edgesplit"]["handoff"] = json!(m);
    }
    let (outcome, edgesplit) = send(stack, path, &body, streamed).await;
    // Streamed or not, the transport and the handoff mode used are the ones asked for.
    assert_eq!(edgesplit["transport"], wire, "{edgesplit}");
    if let (Some(m), false) = (mode, no_handoff(&edgesplit)) {
        assert_eq!(edgesplit["handoff_mode"], m, "{edgesplit}");
    }
    (outcome, edgesplit)
}

/// The outcome of a whole (not streamed) response.
fn outcome_of_body(v: &Value) -> Outcome {
    let choice = &v["choices"][0];
    let message = &choice["message"];
    // (Null when an answer is only tool calls.)
    let text = match (&message["content"], &choice["text"]) {
        (Value::String(t), _) | (_, Value::String(t)) => t.clone(),
        _ if message["tool_calls"].is_array() => String::new(),
        _ => panic!("no text in {v}"),
    };
    let tool_calls = message["tool_calls"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            assert!(
                c["id"].as_str().is_some_and(|id| id.starts_with("call_")),
                "{c}"
            );
            assert_eq!(c["type"], "function", "{c}");
            (
                c["function"]["name"].as_str().unwrap().to_string(),
                c["function"]["arguments"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    Outcome {
        text,
        token_ids: ids(v),
        finish_reason: choice["finish_reason"].as_str().unwrap().to_string(),
        prompt_tokens: v["usage"]["prompt_tokens"].as_u64().unwrap(),
        completion_tokens: v["usage"]["completion_tokens"].as_u64().unwrap(),
        logprobs: choice["logprobs"].clone(),
        tool_calls,
    }
}

/// The outcome of a streamed response's chunks, and its `edgesplit` object.
fn outcome_of_chunks(cs: &[Value]) -> (Outcome, Value) {
    let mut text = String::new();
    let mut finish = None;
    let mut usage = None;
    let mut token_ids = Vec::new();
    let mut edgesplit = Value::Null;
    let mut logprobs = Value::Null;
    let mut tool_calls: Vec<(String, String)> = Vec::new();
    for c in cs {
        assert!(c.get("error").is_none(), "in-band error: {c}");
        if let Some(u) = c.get("usage").filter(|u| !u.is_null()) {
            usage = Some(u.clone());
            token_ids = ids(c);
            edgesplit = c["edgesplit"].clone();
            continue;
        }
        let ch = &c["choices"][0];
        if let Some(t) = ch["delta"]["content"].as_str().or(ch["text"].as_str()) {
            text.push_str(t);
        }
        join_logprobs(&mut logprobs, &ch["logprobs"]);
        for call in ch["delta"]["tool_calls"].as_array().into_iter().flatten() {
            let i = call["index"].as_u64().expect("a streamed call's index") as usize;
            if i == tool_calls.len() {
                assert!(
                    call["id"]
                        .as_str()
                        .is_some_and(|id| id.starts_with("call_")),
                    "{call}"
                );
                tool_calls.push(Default::default());
            }
            let f = &call["function"];
            tool_calls[i].0.push_str(f["name"].as_str().unwrap_or(""));
            tool_calls[i]
                .1
                .push_str(f["arguments"].as_str().unwrap_or(""));
        }
        if let Some(f) = ch["finish_reason"].as_str() {
            assert!(finish.is_none(), "two finish chunks");
            finish = Some(f.to_string());
        }
    }
    let usage = usage.expect("usage chunk");
    let outcome = Outcome {
        text,
        token_ids,
        finish_reason: finish.expect("finish chunk"),
        prompt_tokens: usage["prompt_tokens"].as_u64().unwrap(),
        completion_tokens: usage["completion_tokens"].as_u64().unwrap(),
        logprobs,
        tool_calls,
    };
    (outcome, edgesplit)
}

/// The V2 identity a node reports in `Info`.
/// The decode node's `Info`, from its gRPC address.
pub async fn decode_info(url: &str) -> edgesplit_proto::pb::NodeInfo {
    let mut c = edgesplit_proto::pb::decode_client::DecodeClient::connect(url.to_string())
        .await
        .unwrap();
    c.info(edgesplit_proto::pb::InfoRequest {})
        .await
        .unwrap()
        .into_inner()
}

/// The prefill node's `Info`, over gRPC.
pub async fn prefill_info(url: &str) -> edgesplit_proto::pb::NodeInfo {
    let mut c = edgesplit_proto::pb::prefill_client::PrefillClient::connect(url.to_string())
        .await
        .unwrap();
    c.info(edgesplit_proto::pb::InfoRequest {})
        .await
        .unwrap()
        .into_inner()
}

/// Polls the prefill node until nothing runs there (a replay the router started in the
/// background after an answer is done); at most 60 s.
pub async fn wait_prefill_idle(stack: &Stack) {
    let t0 = std::time::Instant::now();
    while prefill_info(&stack.prefill_grpc).await.requests_in_flight > 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the prefill node stays busy"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn identity(info: &edgesplit_proto::pb::NodeInfo) -> edgesplit_proto::frame::Identity {
    let mut fp = [0u8; 32];
    hex::decode_to_slice(&info.model_fingerprint, &mut fp).unwrap();
    edgesplit_proto::frame::Identity {
        model_fingerprint: fp,
        build_id: info.build_id.clone(),
        type_k: info.type_k,
        type_v: info.type_v,
        flash_attn: info.flash_attn,
        n_ctx: info.n_ctx,
    }
}

/// Reads a streamed (SSE) response one `data:` payload at a time, as they arrive.
pub struct Sse {
    resp: reqwest::Response,
    buf: String,
}

impl Sse {
    pub fn new(resp: reqwest::Response) -> Self {
        Self {
            resp,
            buf: String::new(),
        }
    }

    /// The next payload (`[DONE]` included), or `None` at the end of the stream.
    pub async fn next(&mut self) -> Option<String> {
        loop {
            while let Some(end) = self.buf.find("\n\n") {
                let event: String = self.buf.drain(..end + 2).collect();
                if let Some(d) = event.lines().find_map(|l| l.strip_prefix("data: ")) {
                    return Some(d.to_string());
                }
            }
            let chunk = self.resp.chunk().await.unwrap()?;
            self.buf.push_str(&String::from_utf8_lossy(&chunk));
        }
    }
}

/// The memory sections of a well-formed synthetic sequence state: one stream of `cells`
/// cells (positions 0.., sequence 0), one layer, K and V rows of 4 bytes. Its layout walks
/// (`edgesplit_proto::layout`) to the end, but no real model has one layer: llama.cpp
/// refuses it at import.
pub fn synthetic_sections(cells: u32) -> Vec<u8> {
    let mut v = Vec::new();
    let mut put = |x: u32| v.extend_from_slice(&x.to_le_bytes());
    put(1); // streams
    put(cells);
    for pos in 0..cells {
        put(pos);
        put(1); // sequences of the cell
        put(0); // sequence 0
    }
    for x in [0, 1, 0, 0] {
        put(x); // V not transposed, one layer, n_rot_k, n_rot_v
    }
    for _kv in 0..2 {
        v.extend_from_slice(&1u32.to_le_bytes()); // f16
        v.extend_from_slice(&4u64.to_le_bytes()); // row bytes
        v.extend(std::iter::repeat_n(7u8, 4 * cells as usize));
    }
    v
}

/// A V1 sequence-state file of `n` tokens whose state walks ([`synthetic_sections`]).
pub fn synthetic_v1_file(n: u32) -> Vec<u8> {
    let tokens: Vec<i32> = (0..n as i32).collect();
    let mut f = edgesplit_proto::v1::file_head(&tokens);
    f.extend_from_slice(&synthetic_sections(n));
    f
}
