//! `edgesplit-bench`:
//! - `run`: the harness. Starts the whole stack itself (or uses `--url`), behind an
//!   emulated link profile, and drives the router's public streaming API exactly as a
//!   client does, beside a stock llama.cpp `llama-server` baseline in the same run.
//! - `agreement`: how far answers agree across architectures (x86 here, aarch64 under qemu).
//! - `phone-builds`: the phone's static file against the glibc aarch64 build, under qemu.
//! - `engine`: our engine's pp/tg speed, to compare with a stock llama-bench
//!   (`bench/stock-llama-bench.sh`) on the same model and threads.
//! - `handoff`: where a handoff's time goes, beside the original EdgeSplit's V1 path.
//! - `chat`: a multi-turn conversation with and without the nodes' caches, beside one
//!   device.
//! - `load`: N concurrent clients for a fixed time against the whole stack; failures,
//!   wrong answers, latency percentiles and each process's peak memory.
//!
//! Method (the seed project's), per configuration: one warm-up pair excluded, then
//! `--pairs` retained pairs; within a pair the transports run in alternating order so
//! machine drift hits all of them; temperature 0, fixed seed; ratios pair by pair. A pair
//! whose EdgeSplit answers differ is a fidelity failure: its speed does not count. A failed
//! request is recorded as failed, never dropped. See docs/BENCHMARKS.md.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};

mod agreement;
mod chat_bench;
mod client;
mod engine_bench;
mod handoff_bench;
mod kv_quality;
mod layers_bench;
mod load;
mod phone_builds;
mod power;
mod record;
mod report;

mod stats;
mod stock;
mod throughput;
mod turns;

use client::{Ask, Target};
use edgesplit_bench::{devices, link, stack};
use link::Profile;
use record::{Record, Slot};
use report::Attempt;

#[derive(Parser, Debug)]
#[command(name = "edgesplit-bench", about)]
enum Cli {
    /// The benchmark harness (sweeps, link profiles, stock baseline, SQLite record).
    Run(RunArgs),
    /// Our engine's prefill (pp) and decode (tg) speed, llama-bench style.
    Engine(engine_bench::EngineArgs),
    /// A load test: N concurrent clients for a fixed time; failures, wrong answers,
    /// latency percentiles and each process's peak memory.
    Load(load::LoadArgs),
    /// What a quantized KV cache costs in quality against f16: KL divergence and top-1
    /// agreement of next-token distributions over a fixed text.
    KvQuality(kv_quality::QualityArgs),
    /// Where a handoff's time goes (loopback, no link emulation), beside the original
    /// EdgeSplit's V1 path (stock llama-server slot save, upload, restore) in one run.
    Handoff(handoff_bench::HandoffArgs),
    /// A multi-turn conversation: per-turn TTFT, handoff bytes, where each turn was
    /// prefilled, with the nodes' caches and without, beside one device.
    Chat(chat_bench::ChatArgs),
    /// The layer split (ggml RPC to the decode node) against one device, per link
    /// profile, and a run with both nodes' memory capped.
    Layers(layers_bench::LayersArgs),
    /// What the pair serves against each device alone: closed-loop clients over a fixed mix
    /// of prompt and answer lengths, per mode (local, the split, phone) and link.
    Throughput(throughput::ThroughputArgs),
    /// How far answers and next-token distributions agree across architectures: x86 here,
    /// the aarch64 build under qemu. Not a speed figure.
    Agreement(agreement::AgreementArgs),
    /// The phone's static file against the glibc aarch64 build, both under qemu: answers
    /// compared, prefill and decode speeds as ratios.
    PhoneBuilds(phone_builds::PhoneBuildsArgs),
}

#[derive(clap::Args, Debug, Clone)]
struct RunArgs {
    #[command(flatten)]
    devices: edgesplit_bench::devices::DeviceArgs,
    /// Models: `smollm2`, `gemma3` (a base model: measured on /v1/completions) or a GGUF path.
    #[arg(long, value_delimiter = ',', default_value = "smollm2")]
    models: Vec<String>,
    /// Link profiles between the laptop side (router, prefill) and the phone side (decode):
    /// loopback, wifi, tailscale-wifi, slow-wifi.
    #[arg(long, value_delimiter = ',', default_value = "loopback,wifi", value_parser = Profile::parse)]
    profiles: Vec<Profile>,
    /// Approximate prompt lengths in tokens.
    #[arg(long, value_delimiter = ',', default_value = "16,128,512,2000")]
    prompt_tokens: Vec<usize>,
    /// Output lengths (max_tokens).
    #[arg(long, value_delimiter = ',', default_value = "64")]
    max_tokens: Vec<u32>,
    /// EdgeSplit transports; `local` is the colocated reference the others are compared to.
    #[arg(long, value_delimiter = ',', default_value = "local,v1,v2")]
    transports: Vec<String>,
    /// Retained pairs per configuration (after one warm-up pair).
    #[arg(long, default_value_t = 5)]
    pairs: usize,
    /// Also serve every request from a stock llama.cpp llama-server (built once by
    /// scripts/stock-llama.sh) in the same pairs.
    #[arg(long)]
    stock: bool,
    /// Concurrency mode: this many clients at once per transport (0 = off), on the first
    /// prompt length and output length.
    #[arg(long, default_value_t = 0)]
    concurrency: usize,
    /// Requests per transport in concurrency mode.
    #[arg(long, default_value_t = 16)]
    requests: usize,
    /// Context size of every server (EdgeSplit's nodes and the stock server).
    #[arg(long, default_value_t = 4096)]
    n_ctx: u32,
    /// Threads per server (default: physical cores).
    #[arg(long)]
    threads: Option<i32>,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Use a running router instead of starting the stack (profiles then only label rows).
    #[arg(long)]
    url: Option<String>,
    /// The SQLite record (appended to; keep it).
    #[arg(long, default_value = "bench/results/bench.sqlite")]
    db: PathBuf,
    /// Output folder (default: bench/results/run-<run id>).
    #[arg(long)]
    out: Option<PathBuf>,
    /// The smoke-test preset: prompts 16 and 128, 16 output tokens, 2 pairs, links
    /// loopback and wifi, 2 clients x 4 requests (under a minute here).
    #[arg(long)]
    quick: bool,
    /// No progress bar (logs each attempt on a line instead).
    #[arg(long)]
    no_progress: bool,
    /// Start the prefill node with `--stream-prefill` (live handoff: the prompt's state
    /// crosses while it is prefilled).
    #[arg(long)]
    stream_prefill: bool,
    /// Both nodes' `--flash-attn` (auto, on, off); the stock server follows what they
    /// resolve to.
    #[arg(long, default_value = "auto")]
    flash_attn: String,
    /// Both nodes' KV cache type, K and V (f16, q8_0, q4_0), and the stock server's.
    #[arg(long, default_value = "f16")]
    cache_type: String,
    /// Where the energy readers look for `sys/class/powercap` (RAPL) and
    /// `sys/class/power_supply` (a battery): `/`, or a copy of such a tree.
    #[arg(long, default_value = "/")]
    sysfs_root: PathBuf,
    /// Both nodes' prefill batch (`--batch`): with `--stream-prefill` a piece of the state
    /// crosses after each batch. Not with `--stock`, which runs at llama-server's default.
    #[arg(long, default_value_t = 512)]
    batch: u32,
}

impl RunArgs {
    fn apply_quick(&mut self) {
        if self.quick {
            self.prompt_tokens = vec![16, 128];
            self.max_tokens = vec![16];
            self.pairs = 2;
            self.profiles = ["loopback", "wifi"]
                .iter()
                .filter_map(|p| Profile::named(p))
                .collect();
            self.concurrency = 2;
            self.requests = 4;
        }
    }
}

/// `out`, else `bench/results/<kind>-<unix time>`, created.
fn results_dir(out: Option<&Path>, kind: &str) -> anyhow::Result<PathBuf> {
    let dir = match out {
        Some(o) => o.to_path_buf(),
        None => {
            let stamp = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)?
                .as_secs();
            repo_root().join(format!("bench/results/{kind}-{stamp}"))
        }
    };
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn model_path(name: &str) -> PathBuf {
    let dir = std::env::var("EDGESPLIT_MODELS_DIR")
        .map_or_else(|_| repo_root().join("models"), PathBuf::from);
    match name {
        "smollm2" => dir.join("SmolLM2-135M-Instruct.Q4_1.gguf"),
        "gemma3" => dir.join("gemma-3-270m-q4_k_m.gguf"),
        path => PathBuf::from(path),
    }
}

fn describe(p: &Profile) -> String {
    match p.mbit_s {
        None if p.one_way_ms == 0.0 => "no shaping".to_string(),
        m => format!(
            "{} ms ± {} one way, {}",
            p.one_way_ms,
            p.jitter_ms,
            m.map_or("unlimited".to_string(), |m| format!("{m} Mbit/s"))
        ),
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse() {
        Cli::Run(mut args) => {
            args.apply_quick();
            run(args).await
        }
        Cli::Engine(args) => engine_bench::run(&args).await,
        Cli::Load(args) => load::run(&args).await,
        Cli::KvQuality(args) => kv_quality::run(&args).await,
        Cli::Handoff(args) => handoff_bench::run(&args).await,
        Cli::Chat(args) => chat_bench::run(&args).await,
        Cli::Layers(args) => layers_bench::run(&args).await,
        Cli::Agreement(args) => agreement::run(&args).await,
        Cli::PhoneBuilds(args) => phone_builds::run(&args).await,
        Cli::Throughput(args) => throughput::run(&args).await,
    }
}

/// Runs one request with power sampling and records it. `solo`: no other request runs
/// meanwhile, so the laptop's CPU time over it is the request's.
async fn attempt(
    env: &Env,
    slot: &Slot<'_>,
    target: &Target,
    ask: &Ask,
    solo: bool,
) -> anyhow::Result<Attempt> {
    let id = env.rec.begin(slot)?;
    let sampler = power::start();
    let meter = env.sensors.start();
    let cpu = || {
        let pid = (*env.laptop_pid.lock().expect("pid lock"))?;
        devices::process_cpu_ms(pid)
    };
    let cpu_before = cpu().filter(|_| solo);
    let mut result = client::run(&env.http, target, ask)
        .await
        .map_err(|e| format!("{e:#}"));
    if let (Ok(m), Some(before)) = (&mut result, cpu_before) {
        m.laptop_cpu_ms = cpu().map(|after| after - before);
    }
    let used = meter.stop();
    let energy = match sampler {
        Some(s) => s.stop().await,
        None => Err(power::NOT_AVAILABLE.to_string()),
    };
    env.rec.finish(id, &result, &energy, &used)?;
    Ok(Attempt {
        id,
        transport: target.name().to_string(),
        result,
    })
}

struct Env {
    rec: Record,
    http: reqwest::Client,
    bar: ProgressBar,
    verbose: bool,
    /// The laptop's and the phone's energy readers (`--sysfs-root`).
    sensors: edgesplit_bench::energy::Sensors,
    /// The prefill node's process, whose CPU time is the laptop's (none with `--url`).
    laptop_pid: std::sync::Mutex<Option<u32>>,
}

impl Env {
    fn log(&self, a: &Attempt, what: &str) {
        self.bar.inc(1);
        if self.verbose {
            let r = match &a.result {
                Ok(m) => format!(
                    "TTFT {:.1} ms, e2e {:.1} ms, {} tok{}",
                    m.ttft_ms,
                    m.e2e_ms,
                    m.completion_tokens,
                    m.mode.as_ref().map_or(String::new(), |mode| format!(
                        ", chose {mode} (predicted e2e {:.0} ms)",
                        m.predicted_ms.unwrap_or(f64::NAN)
                    ))
                ),
                Err(e) => format!("FAILED: {e}"),
            };
            eprintln!("#{} {what} {}: {r}", a.id, a.transport);
        }
    }
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    for t in &args.transports {
        anyhow::ensure!(
            crate::client::TRANSPORTS.contains(&t.as_str()),
            "unknown transport {t:?} ({})",
            crate::client::TRANSPORTS.join(", ")
        );
    }
    anyhow::ensure!(!args.prompt_tokens.is_empty() && !args.max_tokens.is_empty());
    let threads = args
        .threads
        .unwrap_or_else(edgesplit_engine::default_threads);
    anyhow::ensure!(
        !(args.stock && args.batch != 512),
        "--batch sets EdgeSplit's nodes only; --stock compares at llama-server's default of 512"
    );
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let rec = Record::open(&args.db, &command, threads, args.n_ctx)?;
    let out = args.out.clone().unwrap_or_else(|| {
        args.db
            .parent()
            .unwrap_or(Path::new("."))
            .join(format!("run-{}", rec.run_id))
    });
    std::fs::create_dir_all(&out)?;
    rec.set_out_dir(&out)?;
    let stock_bin = if args.stock && args.url.is_none() {
        Some(stock::build(&repo_root())?)
    } else {
        None
    };

    let per_profile = args.prompt_tokens.len()
        * args.max_tokens.len()
        * (args.pairs + 1)
        * (args.transports.len() + usize::from(stock_bin.is_some()))
        + args.concurrency.min(1) * args.requests * args.transports.len();
    let total = args.models.len() * args.profiles.len() * per_profile;
    let verbose = args.no_progress;
    let bar = if verbose {
        ProgressBar::hidden()
    } else {
        ProgressBar::new(total as u64)
    };
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")?
            .progress_chars("=> "),
    );
    let env = Env {
        rec,
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(900))
            .build()?,
        bar,
        verbose,
        sensors: edgesplit_bench::energy::Sensors::find(&args.sysfs_root),
        laptop_pid: std::sync::Mutex::new(None),
    };

    let mut configs = Vec::new();
    let mut conc = Vec::new();
    for model in &args.models {
        let path = model_path(model);
        anyhow::ensure!(
            path.is_file(),
            "model {} missing (scripts/setup.sh fetches smollm2; --gemma adds gemma3)",
            path.display()
        );
        let model_name = path
            .file_stem()
            .map_or(model.clone(), |s| s.to_string_lossy().into_owned());
        let (router, flash_attn, chat, _stack) = match &args.url {
            Some(url) => (url.clone(), true, true, None),
            None => {
                let cfg = stack::StackConfig {
                    phone_speed: args.devices.phone_speed,
                    stream_prefill: args.stream_prefill,
                    flash_attn: args.flash_attn.clone(),
                    cache_type: args.cache_type.clone(),
                    batch: args.batch,
                    ..stack::StackConfig::new(
                        path.clone(),
                        args.n_ctx,
                        threads,
                        out.join(format!("services-{model_name}")),
                    )
                };
                let s = stack::Stack::start(&cfg, args.profiles[0].clone()).await?;
                *env.laptop_pid.lock().expect("pid lock") = Some(s.prefill_process.id());
                (s.router.clone(), s.flash_attn, s.chat, Some(s))
            }
        };
        let stock = match &stock_bin {
            Some(bin) => Some(
                stock::StockServer::start(
                    bin,
                    &path,
                    args.n_ctx,
                    threads,
                    flash_attn,
                    &args.cache_type,
                )
                .await?,
            ),
            None => None,
        };
        let mut targets: Vec<Target> = args
            .transports
            .iter()
            .map(|t| Target::EdgeSplit {
                url: router.clone(),
                transport: t.clone(),
            })
            .collect();
        if let Some(s) = &stock {
            targets.push(Target::Stock { url: s.url.clone() });
        }
        for profile in &args.profiles {
            if let Some(s) = &_stack {
                s.set_profile(profile);
            }
            for &pt in &args.prompt_tokens {
                for &mt in &args.max_tokens {
                    env.bar
                        .set_message(format!("{model_name} {} {pt} tok", profile.name));
                    let ask = Ask {
                        prompt: client::prompt(pt),
                        max_tokens: mt,
                        chat,
                        seed: args.seed,
                        messages: None,
                        cache_prompt: false,
                    };
                    let c = pairs(&env, &args, &model_name, profile, &targets, &ask, pt).await?;
                    let lines = c.summarise();
                    env.rec.summaries(&lines)?;
                    configs.push((c, lines));
                }
            }
            if args.concurrency > 0 {
                for t in targets.iter().filter(|t| t.name() != "stock") {
                    env.bar.set_message(format!(
                        "{model_name} {} x{} {}",
                        profile.name,
                        args.concurrency,
                        t.name()
                    ));
                    let ask = Ask {
                        prompt: client::prompt(args.prompt_tokens[0]),
                        max_tokens: args.max_tokens[0],
                        chat,
                        seed: args.seed,
                        messages: None,
                        cache_prompt: false,
                    };
                    let c = concurrent(&env, &args, &model_name, profile, t, &ask).await?;
                    let lines = c.summarise();
                    env.rec.summaries(&lines)?;
                    conc.push((c, lines));
                }
            }
        }
    }
    env.bar.finish_and_clear();
    env.rec.close_run()?;

    let profiles: BTreeMap<String, String> = args
        .profiles
        .iter()
        .map(|p| (p.name.clone(), describe(p)))
        .collect();
    let header = format!(
        "## EdgeSplit benchmark, run {}\n\n`{command}`\n\n{}, n_ctx {}, temperature 0, seed {}, {} retained pairs per configuration after one warm-up pair, transports in alternating order. Stock baseline: {}. GPU power: {}.",
        env.rec.run_id,
        match args.devices.phone_speed {
            Some(f) => format!(
                "Two devices emulated: the laptop side and the phone side on a CPU core each, \
                 the phone at {f} of its core, one engine thread each"
            ),
            None => format!("{threads} threads per server, the services sharing the cores"),
        },
        args.n_ctx,
        args.seed,
        args.pairs,
        if stock_bin.is_some() {
            "llama-server from llama-cpp-python 0.3.36's llama.cpp, same model, context, threads and flash attention"
        } else {
            "not run (--stock)"
        },
        if power::available() {
            "sampled with nvidia-smi every 100 ms"
        } else {
            power::NOT_AVAILABLE
        },
    );
    let md = report::markdown(&header, &configs, &conc, &profiles);
    std::fs::write(out.join("summary.md"), &md)?;
    report::write_tables(&env.rec, &out)?;
    let plots = report::plots(&configs, &out)?;
    println!("{md}");
    println!(
        "record: {} (run {}); outputs: {} (summary.md, samples.json, samples.csv, summary.json, summary.csv, {})",
        args.db.display(),
        env.rec.run_id,
        out.display(),
        plots.join(", ")
    );
    let bad: usize = configs.iter().map(|(c, _)| c.mismatched_pairs()).sum();
    anyhow::ensure!(
        bad == 0,
        "{bad} pairs gave different answers between transports"
    );
    Ok(())
}

async fn pairs(
    env: &Env,
    args: &RunArgs,
    model: &str,
    profile: &Profile,
    targets: &[Target],
    ask: &Ask,
    pt: usize,
) -> anyhow::Result<report::Config> {
    let mut c = report::Config {
        model: model.to_string(),
        profile: profile.name.clone(),
        target_prompt_tokens: pt,
        max_tokens: ask.max_tokens,
        transports: targets.iter().map(|t| t.name().to_string()).collect(),
        pairs: Vec::new(),
    };
    for pair in 0..=args.pairs {
        // Alternate: forward in even pairs, reversed in odd ones.
        let mut order: Vec<usize> = (0..targets.len()).collect();
        if pair % 2 == 1 {
            order.reverse();
        }
        let mut got: Vec<Option<Attempt>> = vec![None; targets.len()];
        for (position, &i) in order.iter().enumerate() {
            let slot = Slot {
                mode: "pair",
                model,
                profile: &profile.name,
                transport: targets[i].name(),
                target_prompt_tokens: pt,
                max_tokens: ask.max_tokens,
                pair,
                position,
                excluded: pair == 0,
            };
            let a = attempt(env, &slot, &targets[i], ask, true).await?;
            env.log(
                &a,
                &format!("{model} {} {pt} tok pair {pair}", profile.name),
            );
            got[i] = Some(a);
        }
        let got: Vec<Attempt> = got.into_iter().flatten().collect();
        for (a, same) in got.iter().zip(report::fidelity(&got)) {
            if let Some(same) = same {
                env.rec.mark_same(a.id, same)?;
            }
        }
        c.pairs.push(got);
    }
    Ok(c)
}

async fn concurrent(
    env: &Env,
    args: &RunArgs,
    model: &str,
    profile: &Profile,
    target: &Target,
    ask: &Ask,
) -> anyhow::Result<report::Concurrency> {
    let next = Arc::new(AtomicUsize::new(0));
    let t0 = Instant::now();
    let mut clients = Vec::new();
    for client in 0..args.concurrency {
        let next = next.clone();
        clients.push(async move {
            let mut mine = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= args.requests {
                    break;
                }
                let slot = Slot {
                    mode: "concurrency",
                    model,
                    profile: &profile.name,
                    transport: target.name(),
                    target_prompt_tokens: args.prompt_tokens[0],
                    max_tokens: ask.max_tokens,
                    pair: i,
                    position: client,
                    excluded: false,
                };
                let a = attempt(env, &slot, target, ask, args.concurrency == 1).await?;
                env.log(
                    &a,
                    &format!("{model} {} x{} #{i}", profile.name, args.concurrency),
                );
                mine.push(a);
            }
            anyhow::Ok(mine)
        });
    }
    let mut attempts = Vec::new();
    for r in futures::future::join_all(clients).await {
        attempts.extend(r?);
    }
    attempts.sort_by_key(|a| a.id);
    Ok(report::Concurrency {
        model: model.to_string(),
        profile: profile.name.clone(),
        transport: target.name().to_string(),
        clients: args.concurrency,
        target_prompt_tokens: args.prompt_tokens[0],
        max_tokens: ask.max_tokens,
        wall_s: t0.elapsed().as_secs_f64(),
        attempts,
    })
}
