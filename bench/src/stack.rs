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
//!
//! The one way the project starts a stack of real processes: the bench's subcommands and
//! the integration tests that need processes (router/tests/it: signals, kills, the aarch64
//! decode node under qemu). Every service binds port 0 and reports the address it got in
//! its JSON log (no port is picked, freed and raced for); the links between the devices
//! are bound first and pointed at the addresses once reported ([`Link::unconnected`]).
//! With [`StackConfig::devices`] the laptop side and the phone side each run on a core of
//! their own, the phone throttled ([`crate::devices`]).
//!
//! A stack does not outlive the process that started it, even one killed by a signal (no
//! `Drop` then): every service is started through util-linux's `setpriv --pdeathsig KILL`,
//! so the kernel kills it when the thread that started it ends (the bench's runtime
//! threads live as long as the bench; a test's, as long as the test). Left: the instant
//! between the fork and `setpriv`'s `prctl`. The decode node's ggml RPC child ends on its
//! own when its stdin pipe from the node closes; a phone group left behind is removed by
//! the next run ([`Devices::new`]).

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use edgesplit_proto::pb::prefill_client::PrefillClient;
use edgesplit_proto::pb::InfoRequest;

use crate::devices::Devices;
use crate::link::{Link, Profile, Shape};
pub use crate::services::reported;
use crate::services::{binary, field, free_port, unconnected, Guard};

#[derive(Clone)]
pub struct StackConfig {
    pub model: PathBuf,
    pub n_ctx: u32,
    /// Each engine's threads (`None`: the nodes' default; one under device emulation,
    /// whatever this says).
    pub threads: Option<i32>,
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
    /// The layer split: the decode node's `--rpc-listen` and the prefill node's
    /// `--rpc-peer` through an emulated link.
    pub rpc: Option<RpcSplit>,
    /// The router's `--continue-on` (where a held conversation's new turn is prefilled).
    pub continue_on: String,
    /// A node's program other than its binary next to this one: a launcher and a binary
    /// (`qemu-aarch64 target-aarch64/.../edgesplit-decode`, `edgesplit-bench agreement`).
    pub decode_program: Option<Vec<PathBuf>>,
    pub prefill_program: Option<Vec<PathBuf>>,
    /// More flags of each service (`edgesplit-bench agreement`: a first-token timeout for
    /// nodes under emulation; the tests: drain deadlines, another KV type, pacing). An
    /// engine flag named here replaces the stack's (`--cache-type-k` on one node only).
    pub router_extra: Vec<String>,
    pub decode_extra: Vec<String>,
    pub prefill_extra: Vec<String>,
    /// The handoff path (prefill -> decode's V2 port) through a link shaped per connection
    /// (the tests' faults: a held connection, a slow link) instead of the stack's profile.
    pub handoff_shape: Option<fn() -> Shape>,
    /// More decode nodes for the router's pool (`--decode-url` repeated), each with these
    /// extra arguments; their links emulated as the first's (unless `direct`), unshaped.
    pub more_decode: Vec<Vec<String>>,
    /// With `phone_speed` (the devices emulated): each of `more_decode`'s nodes is a phone
    /// of its own at this speed, on the first phone's core.
    pub more_phone_speeds: Vec<f64>,
    /// Two devices on this machine: the phone side at this fraction of a core of its own,
    /// the laptop side on another ([`crate::devices`]); `None`: the services share the
    /// machine's cores.
    pub phone_speed: Option<f64>,
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
            threads: Some(threads),
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
            decode_extra: Vec::new(),
            prefill_extra: Vec::new(),
            handoff_shape: None,
            more_decode: Vec::new(),
            more_phone_speeds: Vec::new(),
            phone_speed: None,
        }
    }
}

/// A running stack; its processes are killed on drop.
pub struct Stack {
    /// The router's base URL (`http://host:port`).
    pub router: String,
    /// Whether flash attention is on (both nodes agree; the handshake checks it).
    pub flash_attn: bool,
    /// Whether the model has a chat template (else the bench uses `/v1/completions`).
    pub chat: bool,
    /// The prefill node's `/metrics` (`http://host:port/metrics`).
    pub prefill_metrics: String,
    /// The decode node's gRPC URL and `/metrics`, straight (not through a link).
    pub decode_grpc: String,
    pub decode_metrics: String,
    /// KV bytes per token of the model's state.
    pub kv_bytes_per_token: u64,
    /// Logs (JSON lines: `decode.log`, `prefill.log`, `router.log`) and state files.
    pub dir: PathBuf,
    pub decode_process: Child,
    pub prefill_process: Child,
    pub router_process: Child,
    /// The pool's other decode nodes ([`StackConfig::more_decode`]): gRPC URL (through its
    /// emulated link unless `direct`) and process.
    pub more_decode: Vec<(String, Child)>,
    /// Every decode node as the router names it (its `--decode-url`s, in order: through
    /// the emulated link for the first unless `direct`), for `edgesplit.node`.
    pub decode_urls: Vec<String>,
    links: Vec<Link>,
    /// Dropped after the processes (its cgroup is removed once they are gone).
    devices: Option<Devices>,
}

impl Drop for Stack {
    fn drop(&mut self) {
        for c in [
            &mut self.router_process,
            &mut self.prefill_process,
            &mut self.decode_process,
        ]
        .into_iter()
        .chain(self.more_decode.iter_mut().map(|d| &mut d.1))
        {
            let _ = c.kill();
            let _ = c.wait();
        }
        // The decode node's ggml RPC server (a layer split) is its child: it ends when
        // its parent does; wait for it before the group goes.
        if let Some(d) = self.devices.take() {
            let t0 = Instant::now();
            while d.busy() && t0.elapsed() < Duration::from_secs(5) {
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

impl Stack {
    /// Starts the three services, each on a port it binds itself, and waits until the
    /// router says healthy.
    pub async fn start(cfg: &StackConfig, profile: Profile) -> anyhow::Result<Stack> {
        std::fs::create_dir_all(&cfg.dir)?;
        let devices = match cfg.phone_speed {
            Some(f) => {
                let mut d = Devices::new(f, Path::new("/sys/fs/cgroup"))?;
                anyhow::ensure!(
                    cfg.more_phone_speeds.len() == cfg.more_decode.len(),
                    "each of the pool's other decode nodes needs a phone speed"
                );
                for &speed in &cfg.more_phone_speeds {
                    d.add_phone(speed)?;
                }
                Some(d)
            }
            None => None,
        };
        let threads = if devices.is_some() {
            Some(1)
        } else {
            cfg.threads
        };
        let phone = |p: Vec<PathBuf>| match &devices {
            Some(d) => d.phone(&p),
            None => p,
        };
        let laptop = |p: Vec<PathBuf>| match &devices {
            Some(d) => d.laptop(&p),
            None => p,
        };
        // The links are bound first: the decode node advertises them.
        let mut links = Vec::new();
        let handoff_link = unconnected(cfg.direct || cfg.handoff_shape.is_some(), &profile).await?;
        let shaped = cfg.handoff_shape.map(Link::shaped_unconnected);
        let v1_link = unconnected(cfg.direct, &profile).await?;
        let rpc_port = free_port()?;
        let budget = |i: usize| {
            cfg.rpc
                .as_ref()
                .and_then(|r| r.budgets)
                .map(|b| if i == 0 { b.0 } else { b.1 })
        };
        let model = cfg.model.display().to_string();
        let any = || "127.0.0.1:0".to_string();
        let common = |extra: &[String]| -> Vec<String> {
            let mut flags: Vec<(&str, String)> = vec![
                ("--model", model.clone()),
                ("--n-ctx", cfg.n_ctx.to_string()),
                ("--listen", any()),
                ("--flash-attn", cfg.flash_attn.clone()),
                ("--cache-type-k", cfg.cache_type.clone()),
                ("--cache-type-v", cfg.cache_type.clone()),
                ("--batch", cfg.batch.to_string()),
            ];
            if let Some(t) = threads {
                flags.push(("--threads", t.to_string()));
            }
            if let Some(n) = cfg.parallel {
                flags.push(("--parallel", n.to_string()));
            }
            flags
                .into_iter()
                .filter(|(flag, _)| !extra.iter().any(|e| e == flag))
                .flat_map(|(flag, value)| [flag.to_string(), value])
                .collect()
        };
        let mut dargs = common(&cfg.decode_extra);
        dargs.extend([
            "--handoff-listen".into(),
            any(),
            "--v1-listen".into(),
            any(),
            "--handoff-wait-s".into(),
            "60".into(),
        ]);
        let handoff_at = match (&shaped, &handoff_link) {
            (Some((addr, _)), _) => Some(addr.to_string()),
            (None, Some(l)) => Some(l.addr.to_string()),
            (None, None) => None,
        };
        if let Some(at) = handoff_at {
            dargs.extend(["--handoff-advertise".into(), at]);
        }
        if let Some(l) = &v1_link {
            dargs.extend([
                "--v1-advertise".into(),
                format!("http://{}/v1/handoff", l.addr),
            ]);
        }
        if cfg.rpc.is_some() {
            dargs.extend(["--rpc-listen".into(), rpc_port.clone()]);
        }
        dargs.extend(cfg.decode_extra.iter().cloned());
        let decode_program = match &cfg.decode_program {
            Some(p) => p.clone(),
            None => vec![binary("edgesplit-decode")?],
        };
        // Killed if anything below fails.
        let mut guard = Guard(vec![]);
        let d = guard
            .start(
                &phone(decode_program),
                &dargs,
                &cfg.dir.join("decode.log"),
                "decode node listening",
                (cfg.secret.as_deref(), budget(1)),
            )
            .await?;
        let decode_grpc = field(&d, "grpc")?;
        let v1 = field(&d, "v1")?;
        if let Some((_, late)) = &shaped {
            let _ = late.set(field(&d, "handoff")?);
        }
        if let Some(l) = &handoff_link {
            l.connect(field(&d, "handoff")?);
        }
        if let Some(l) = &v1_link {
            l.connect(v1.clone());
        }
        links.extend(handoff_link);
        links.extend(v1_link);
        let mut more_decode = Vec::new();
        for (i, extra) in cfg.more_decode.iter().enumerate() {
            let mut args = common(extra);
            args.extend(
                [
                    "--handoff-listen",
                    "127.0.0.1:0",
                    "--v1-listen",
                    "127.0.0.1:0",
                    "--handoff-wait-s",
                    "60",
                ]
                .map(String::from),
            );
            // Its links emulated as the first's (not shaped).
            let handoff_link = unconnected(cfg.direct, &profile).await?;
            let v1_link = unconnected(cfg.direct, &profile).await?;
            if let Some(l) = &handoff_link {
                args.extend(["--handoff-advertise".into(), l.addr.to_string()]);
            }
            if let Some(l) = &v1_link {
                args.extend([
                    "--v1-advertise".into(),
                    format!("http://{}/v1/handoff", l.addr),
                ]);
            }
            args.extend(extra.iter().cloned());
            let program = vec![binary("edgesplit-decode")?];
            let program = match &devices {
                Some(d) => d.phone_n(i + 1, &program),
                None => program,
            };
            let d = guard
                .start(
                    &program,
                    &args,
                    &cfg.dir.join(format!("decode-{}.log", i + 2)),
                    "decode node listening",
                    (cfg.secret.as_deref(), None),
                )
                .await?;
            if let Some(l) = &handoff_link {
                l.connect(field(&d, "handoff")?);
            }
            if let Some(l) = &v1_link {
                l.connect(field(&d, "v1")?);
            }
            links.extend(handoff_link);
            links.extend(v1_link);
            let grpc = field(&d, "grpc")?;
            let at = if cfg.direct {
                grpc
            } else {
                let l = Link::start(grpc, profile.clone()).await?;
                let at = l.addr.to_string();
                links.push(l);
                at
            };
            more_decode.push(format!("http://{at}"));
        }
        let grpc_at = if cfg.direct {
            decode_grpc.clone()
        } else {
            let l = Link::start(decode_grpc.clone(), profile.clone()).await?;
            let at = l.addr.to_string();
            links.push(l);
            at
        };

        let mut pargs = common(&cfg.prefill_extra);
        pargs.extend(["--metrics-listen".into(), any()]);
        if cfg.stream_prefill {
            pargs.push("--stream-prefill".into());
        }
        if let Some(rpc) = &cfg.rpc {
            let at = if cfg.direct {
                rpc_port.clone()
            } else {
                let l = Link::start(rpc_port.clone(), profile.clone()).await?;
                let at = l.addr.to_string();
                links.push(l);
                at
            };
            pargs.extend([
                "--rpc-peer".into(),
                at,
                "--rpc-layers".into(),
                rpc.layers.clone(),
            ]);
            // The plan reads the decode node's available memory.
            pargs.extend(["--decode-url".into(), format!("http://{decode_grpc}")]);
        }
        pargs.extend(cfg.prefill_extra.iter().cloned());
        let prefill_program = match &cfg.prefill_program {
            Some(p) => p.clone(),
            None => vec![binary("edgesplit-prefill")?],
        };
        let p = guard
            .start(
                &laptop(prefill_program),
                &pargs,
                &cfg.dir.join("prefill.log"),
                "prefill node listening",
                (cfg.secret.as_deref(), budget(0)),
            )
            .await?;
        let prefill_grpc = field(&p, "grpc")?;
        let prefill_metrics = field(&p, "metrics")?;

        let mut rargs: Vec<String> = vec![
            "--listen".into(),
            any(),
            "--prefill-url".into(),
            format!("http://{prefill_grpc}"),
            "--decode-url".into(),
            format!("http://{grpc_at}"),
        ];
        for url in &more_decode {
            rargs.extend(["--decode-url".into(), url.clone()]);
        }
        if let Some(n) = cfg.parallel {
            rargs.extend(["--max-in-flight".into(), n.to_string()]);
        }
        rargs.extend(["--continue-on".into(), cfg.continue_on.clone()]);
        rargs.extend(cfg.router_extra.iter().cloned());
        let r = guard
            .start(
                &laptop(vec![binary("edgesplit-router")?]),
                &rargs,
                &cfg.dir.join("router.log"),
                "router listening (HTTP)",
                (cfg.secret.as_deref(), None),
            )
            .await?;
        let router = format!("http://{}", field(&r, "addr")?);

        // Started in this order: the decode node, the pool's others, the prefill node,
        // the router.
        let mut processes = std::mem::take(&mut guard.0);
        let (Some(router_process), Some(prefill_process)) = (processes.pop(), processes.pop())
        else {
            unreachable!("the router and the prefill node were started");
        };
        let mut processes = processes.into_iter();
        let Some(decode_process) = processes.next() else {
            unreachable!("the decode node was started");
        };
        let decode_urls = std::iter::once(format!("http://{grpc_at}"))
            .chain(more_decode.iter().cloned())
            .collect();
        let more_decode = more_decode.into_iter().zip(processes).collect();
        let mut stack = Stack {
            router,
            flash_attn: false,
            chat: false,
            prefill_metrics: format!("http://{prefill_metrics}/metrics"),
            decode_grpc: format!("http://{decode_grpc}"),
            decode_metrics: format!("http://{v1}/metrics"),
            kv_bytes_per_token: 0,
            dir: cfg.dir.clone(),
            decode_process,
            prefill_process,
            router_process,
            more_decode,
            decode_urls,
            links,
            devices,
        };
        stack.healthy().await?;
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

    /// Waits (up to 120 s) until the router says healthy (it checks both nodes).
    async fn healthy(&mut self) -> anyhow::Result<()> {
        let http = reqwest::Client::new();
        let t0 = Instant::now();
        loop {
            for c in [
                &mut self.decode_process,
                &mut self.prefill_process,
                &mut self.router_process,
            ]
            .into_iter()
            .chain(self.more_decode.iter_mut().map(|d| &mut d.1))
            {
                if let Some(status) = c.try_wait()? {
                    anyhow::bail!(
                        "a service exited ({status}) while starting; see the logs in {}",
                        self.dir.display()
                    );
                }
            }
            let ok = http
                .get(format!("{}/health", self.router))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ok {
                return Ok(());
            }
            anyhow::ensure!(
                t0.elapsed() < Duration::from_secs(120),
                "the stack was not healthy after 120 s; see the logs in {}",
                self.dir.display()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The services' names and process ids.
    #[must_use]
    pub fn processes(&self) -> Vec<(&'static str, u32)> {
        vec![
            ("decode", self.decode_process.id()),
            ("prefill", self.prefill_process.id()),
            ("router", self.router_process.id()),
        ]
    }

    /// The laptop's CPU time so far, in ms: the prefill node's process (its engine).
    #[must_use]
    pub fn laptop_cpu_ms(&self) -> Option<f64> {
        crate::devices::process_cpu_ms(self.prefill_process.id())
    }

    /// The device emulation, when on.
    #[must_use]
    pub fn devices(&self) -> Option<&Devices> {
        self.devices.as_ref()
    }

    /// Switches every emulated link to `profile`.
    pub fn set_profile(&self, profile: &Profile) {
        for l in &self.links {
            l.set(profile.clone());
        }
    }
}
