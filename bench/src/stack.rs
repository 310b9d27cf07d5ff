//! Starts the whole EdgeSplit stack - the real `edgesplit-decode`, `edgesplit-prefill` and
//! `edgesplit-router` binaries (next to this one in `target/release`), as separate
//! processes on loopback ports - with an emulated link ([`crate::link`]) on every path that
//! crosses the network in a real deployment (laptop: router + prefill; phone: decode):
//! - the V2 handoff (prefill -> decode),
//! - the V1 upload (prefill -> decode),
//! - the router's gRPC channel to the decode node (the answer's tokens, decode -> router),
//! - with a layer split ([`StackConfig::rpc`]), ggml's RPC (prefill -> decode's
//!   `--rpc-listen`), a round trip per request of ggml's.
//!
//! Each path has its own proxy with the same profile; on a real Wi-Fi they would share the
//! air time, which matters only if a handoff and a token stream overlap.
//!
//! Separate processes, not the services' library functions in this process: two engines in
//! one process decoded at about a third of their speed here (40 vs 135 tok/s on SmolLM2,
//! 2 threads each; their OpenMP teams and the process's async threads oversubscribe the
//! 2 cores), which is not how the product runs.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use edgesplit_proto::pb::prefill_client::PrefillClient;
use edgesplit_proto::pb::InfoRequest;

use crate::link::{Link, Profile};

#[derive(Clone)]
pub struct StackConfig {
    pub model: PathBuf,
    pub n_ctx: u32,
    pub threads: i32,
    /// Each node's `--parallel` (None: the nodes' defaults).
    pub parallel: Option<u32>,
    /// Logs and state files go here.
    pub dir: PathBuf,
    /// The prefill node's `--stream-prefill` (live handoff: the prompt's state crosses
    /// while it is prefilled).
    pub stream_prefill: bool,
    /// No emulated links: the nodes talk straight over loopback (the handoff bench, which
    /// measures our own CPU work, not a link's).
    pub direct: bool,
    /// Both nodes' `--flash-attn` (auto, on, off).
    pub flash_attn: String,
    /// Both nodes' KV cache type, K and V (f16, q8_0, q4_0).
    pub cache_type: String,
    /// Both nodes' prefill batch (`--batch`).
    pub batch: u32,
    /// The shared secret of the three services (`EDGESPLIT_SECRET`): private links.
    pub secret: Option<String>,
    /// The layer split (issue 17): the decode node's `--rpc-listen` and the prefill node's
    /// `--rpc-peer` through an emulated link.
    pub rpc: Option<RpcSplit>,
    /// The router's `--continue-on` (where a held conversation's new turn is prefilled).
    pub continue_on: String,
    /// A node's program other than its binary next to this one: a launcher and a binary
    /// (`qemu-aarch64 target-aarch64/.../edgesplit-decode`, `edgesplit-bench agreement`).
    pub decode_program: Option<Vec<PathBuf>>,
    pub prefill_program: Option<Vec<PathBuf>>,
    /// More router flags (`edgesplit-bench agreement`: a first-token timeout for nodes
    /// under emulation).
    pub router_extra: Vec<String>,
}

/// A layer split's settings.
#[derive(Clone, Debug)]
pub struct RpcSplit {
    /// `--rpc-layers`: a count or `auto` (then the prefill node plans with the decode
    /// node's available memory, `--decode-url`).
    pub layers: String,
    /// `EDGESPLIT_MEM_BUDGET_BYTES` of the prefill node and of the decode node.
    pub budgets: Option<(u64, u64)>,
}

impl StackConfig {
    /// The defaults of every benchmark: the nodes' own `--parallel`, emulated links, no
    /// prefill streaming, flash attention `auto`, f16 KV, no secret.
    pub fn new(model: PathBuf, n_ctx: u32, threads: i32, dir: PathBuf) -> Self {
        StackConfig {
            model,
            n_ctx,
            threads,
            parallel: None,
            dir,
            stream_prefill: false,
            direct: false,
            flash_attn: "auto".into(),
            cache_type: "f16".into(),
            batch: 512,
            secret: None,
            rpc: None,
            continue_on: "measured".into(),
            decode_program: None,
            prefill_program: None,
            router_extra: Vec::new(),
        }
    }
}

/// A running stack; its processes are killed on drop.
pub struct Stack {
    pub router: String,
    /// Whether flash attention is on (both nodes agree; the handshake checks it).
    pub flash_attn: bool,
    /// Whether the model has a chat template (else the bench uses `/v1/completions`).
    pub chat: bool,
    /// The prefill node's `/metrics` (`http://host:port/metrics`).
    pub prefill_metrics: String,
    /// KV bytes per token of the model's state.
    pub kv_bytes_per_token: u64,
    links: Vec<Link>,
    /// decode, prefill, router (see [`Stack::processes`]).
    children: Vec<Child>,
}

impl Drop for Stack {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn free_port() -> anyhow::Result<String> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .to_string())
}

fn binary(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let p = exe
        .parent()
        .map(|d| d.join(name))
        .filter(|p| p.is_file())
        .with_context(|| {
            format!(
                "{name} is not next to {}: run `cargo build --release --bins` first",
                exe.display()
            )
        })?;
    Ok(p)
}

/// Starts service `name` (or `program`, a launcher and its binary) with `args`, its log in
/// `log`, the stack's `secret` and a memory `budget` (`EDGESPLIT_MEM_BUDGET_BYTES`).
fn spawn(
    name: &str,
    program: Option<&Vec<PathBuf>>,
    args: &[String],
    log: &Path,
    secret: Option<&str>,
    budget: Option<u64>,
) -> anyhow::Result<Child> {
    let log = std::fs::File::create(log)?;
    let mut cmd = match program {
        Some(p) => {
            let mut c = Command::new(&p[0]);
            c.args(&p[1..]);
            c
        }
        None => Command::new(binary(name)?),
    };
    match secret {
        Some(s) => cmd.env("EDGESPLIT_SECRET", s),
        None => cmd.env_remove("EDGESPLIT_SECRET"),
    };
    match budget {
        Some(b) => cmd.env("EDGESPLIT_MEM_BUDGET_BYTES", b.to_string()),
        None => cmd.env_remove("EDGESPLIT_MEM_BUDGET_BYTES"),
    };
    cmd.env_remove("EDGESPLIT_SECRET_FILE")
        .args(args)
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .with_context(|| format!("starting {name}"))
}

/// Waits until `addr` accepts connections (a node binds once its model is loaded), at
/// most 120 s.
async fn wait_listening(addr: &str, dir: &Path) -> anyhow::Result<()> {
    let t0 = Instant::now();
    while tokio::net::TcpStream::connect(addr).await.is_err() {
        anyhow::ensure!(
            t0.elapsed() < Duration::from_secs(120),
            "{addr} did not listen within 120 s; see the logs in {}",
            dir.display()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// Whether a service's log says its port was taken.
fn port_taken(dir: &std::path::Path) -> bool {
    ["decode.log", "prefill.log", "router.log"].iter().any(|f| {
        std::fs::read_to_string(dir.join(f)).is_ok_and(|t| t.contains("Address already in use"))
    })
}

impl Stack {
    /// Starts the three services on free ports. The ports are picked before the services
    /// bind them (a node binds after loading its model), so another process may take one
    /// in between: a service that exits for that is retried on new ports, twice.
    pub async fn start(cfg: &StackConfig, profile: Profile) -> anyhow::Result<Stack> {
        let mut tries = 0;
        loop {
            match Self::start_once(cfg, profile.clone()).await {
                Err(e) if tries < 2 && port_taken(&cfg.dir) => {
                    tries += 1;
                    eprintln!("a port was taken while the stack started ({e}); again on new ports");
                }
                done => return done,
            }
        }
    }

    async fn start_once(cfg: &StackConfig, profile: Profile) -> anyhow::Result<Stack> {
        std::fs::create_dir_all(&cfg.dir)?;
        let (decode_grpc, handoff, v1) = (free_port()?, free_port()?, free_port()?);
        let (prefill_grpc, prefill_metrics, router) = (free_port()?, free_port()?, free_port()?);
        // Where each path is reached: through its emulated link, or straight.
        let mut links = Vec::new();
        let mut via = Vec::new();
        for target in [&handoff, &v1, &decode_grpc] {
            if cfg.direct {
                via.push(target.clone());
            } else {
                let link = Link::start(target.clone(), profile.clone()).await?;
                via.push(link.addr.to_string());
                links.push(link);
            }
        }
        let [handoff_at, v1_at, grpc_at]: [String; 3] =
            via.try_into().expect("three paths, three addresses");
        let rpc_port = free_port()?;
        let rpc_at = match (&cfg.rpc, cfg.direct) {
            (None, _) => None,
            (Some(_), true) => Some(rpc_port.clone()),
            (Some(_), false) => {
                let link = Link::start(rpc_port.clone(), profile.clone()).await?;
                let at = link.addr.to_string();
                links.push(link);
                Some(at)
            }
        };
        let budget = |i: usize| {
            cfg.rpc
                .as_ref()
                .and_then(|r| r.budgets)
                .map(|b| if i == 0 { b.0 } else { b.1 })
        };
        let model = cfg.model.display().to_string();
        let common = |listen: &str| -> Vec<String> {
            let mut a: Vec<String> = vec![
                "--model".into(),
                model.clone(),
                "--n-ctx".into(),
                cfg.n_ctx.to_string(),
                "--threads".into(),
                cfg.threads.to_string(),
                "--listen".into(),
                listen.to_string(),
            ];
            if let Some(n) = cfg.parallel {
                a.extend(["--parallel".into(), n.to_string()]);
            }
            a.extend(["--flash-attn".into(), cfg.flash_attn.clone()]);
            a.extend(["--cache-type-k".into(), cfg.cache_type.clone()]);
            a.extend(["--cache-type-v".into(), cfg.cache_type.clone()]);
            a.extend(["--batch".into(), cfg.batch.to_string()]);
            a
        };
        let mut stack = Stack {
            router: format!("http://{router}"),
            flash_attn: false,
            chat: false,
            prefill_metrics: format!("http://{prefill_metrics}/metrics"),
            kv_bytes_per_token: 0,
            links,
            children: Vec::new(),
        };
        let mut dargs = common(&decode_grpc);
        dargs.extend([
            "--handoff-listen".into(),
            handoff,
            "--handoff-advertise".into(),
            handoff_at,
            "--v1-listen".into(),
            v1,
            "--v1-advertise".into(),
            format!("http://{v1_at}/v1/handoff"),
            "--handoff-wait-s".into(),
            "60".into(),
        ]);
        if cfg.rpc.is_some() {
            dargs.extend(["--rpc-listen".into(), rpc_port]);
        }
        stack.children.push(spawn(
            "edgesplit-decode",
            cfg.decode_program.as_ref(),
            &dargs,
            &cfg.dir.join("decode.log"),
            cfg.secret.as_deref(),
            budget(1),
        )?);
        let mut pargs = common(&prefill_grpc);
        pargs.extend(["--metrics-listen".into(), prefill_metrics.clone()]);
        if cfg.stream_prefill {
            pargs.push("--stream-prefill".into());
        }
        if let (Some(rpc), Some(at)) = (&cfg.rpc, rpc_at) {
            pargs.extend([
                "--rpc-peer".into(),
                at,
                "--rpc-layers".into(),
                rpc.layers.clone(),
            ]);
            // The plan reads the decode node's available memory; it must listen first.
            pargs.extend(["--decode-url".into(), format!("http://{decode_grpc}")]);
            wait_listening(&decode_grpc, &cfg.dir).await?;
        }
        stack.children.push(spawn(
            "edgesplit-prefill",
            cfg.prefill_program.as_ref(),
            &pargs,
            &cfg.dir.join("prefill.log"),
            cfg.secret.as_deref(),
            budget(0),
        )?);
        let mut rargs: Vec<String> = vec![
            "--listen".into(),
            router,
            "--prefill-url".into(),
            format!("http://{prefill_grpc}"),
            "--decode-url".into(),
            format!("http://{grpc_at}"),
        ];
        // The router reads the decode node's sequences at start, which may be before the
        // node listens: say it.
        if let Some(n) = cfg.parallel {
            rargs.extend(["--max-in-flight".into(), n.to_string()]);
        }
        rargs.extend(["--continue-on".into(), cfg.continue_on.clone()]);
        rargs.extend(cfg.router_extra.iter().cloned());
        stack.children.push(spawn(
            "edgesplit-router",
            None,
            &rargs,
            &cfg.dir.join("router.log"),
            cfg.secret.as_deref(),
            None,
        )?);

        // Ready when the router says healthy (it checks both nodes).
        let http = reqwest::Client::new();
        let t0 = Instant::now();
        loop {
            for c in &mut stack.children {
                if let Some(status) = c.try_wait()? {
                    anyhow::bail!(
                        "a service exited ({status}) while starting; see the logs in {}",
                        cfg.dir.display()
                    );
                }
            }
            let ok = http
                .get(format!("{}/health", stack.router))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ok {
                break;
            }
            anyhow::ensure!(
                t0.elapsed() < Duration::from_secs(120),
                "the stack was not healthy after 120 s; see the logs in {}",
                cfg.dir.display()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        // Over the link the services use, with the credential their secret asks for.
        let secret = cfg
            .secret
            .as_deref()
            .map(|s| edgesplit_proto::auth::Secret::new(s.as_bytes(), "the bench's secret"))
            .transpose()?
            .map(std::sync::Arc::new);
        let link = edgesplit_proto::link::Link::new(secret.clone())?;
        let info = PrefillClient::with_interceptor(
            link.grpc_channel(&format!("http://{prefill_grpc}"), Duration::from_secs(5))?,
            edgesplit_proto::auth::GrpcCredentials(secret),
        )
        .info(InfoRequest {})
        .await?
        .into_inner();
        stack.flash_attn = info.flash_attn;
        stack.chat = info.has_chat_template;
        stack.kv_bytes_per_token = info.kv_bytes_per_token;
        Ok(stack)
    }

    /// The services' names and process ids.
    pub fn processes(&self) -> Vec<(&'static str, u32)> {
        ["decode", "prefill", "router"]
            .into_iter()
            .zip(self.children.iter().map(Child::id))
            .collect()
    }

    /// Switches every emulated link to `profile`.
    pub fn set_profile(&self, profile: &Profile) {
        for l in &self.links {
            l.set(profile.clone());
        }
    }
}
