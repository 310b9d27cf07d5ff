//! `edgesplit-bench load`: holds N concurrent streaming clients against the whole stack
//! (real binaries, separate processes, an emulated link) for a fixed time, and reports
//! failures, wrong answers, latency percentiles, throughput and the peak memory of each
//! process. Not part of CI (it runs for minutes); docs/BENCHMARKS.md has the command.
//!
//! Every client sends its next request as soon as the last one ended, until the time is
//! up; requests under way then finish and count. An answer the router finished on the
//! prefill node (`edgesplit.fallback`) is a success for the client, and is counted apart
//! by cause. Prompts and transports rotate. Before the
//! clients start, each prompt is answered once, alone, on the `local` path: every answer
//! under load must equal it (temperature 0), else it counts as wrong.
//! Peak memory is the kernel's high-water mark of resident memory (`VmHWM` in
//! `/proc/PID/status`) of each service over its whole life; the model file is mapped, so
//! its pages count in both nodes' figures.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::client::{self, Ask, Target};
use crate::link::Profile;
use crate::stack::{Stack, StackConfig};
use crate::stats::percentile;

#[derive(clap::Args, Debug, Clone)]
pub struct LoadArgs {
    #[command(flatten)]
    pub devices: crate::devices::DeviceArgs,
    /// `smollm2`, `gemma3` or a GGUF path.
    #[arg(long, default_value = "smollm2")]
    model: String,
    /// Concurrent clients.
    #[arg(long, default_value_t = 32)]
    clients: usize,
    /// Seconds the clients keep sending.
    #[arg(long, default_value_t = 60)]
    duration_s: u64,
    /// Transports, rotated per request.
    #[arg(long, value_delimiter = ',', default_value = "v2,v1")]
    transports: Vec<String>,
    /// Link profile between the laptop and the phone side.
    #[arg(long, default_value = "loopback", value_parser = Profile::parse)]
    profile: Profile,
    /// Approximate prompt lengths in tokens, rotated per request.
    #[arg(long, value_delimiter = ',', default_value = "16,128")]
    prompt_tokens: Vec<usize>,
    /// Output tokens per request.
    #[arg(long, default_value_t = 32)]
    max_tokens: u32,
    /// Each node's `--parallel`.
    #[arg(long, default_value_t = 4)]
    parallel: u32,
    #[arg(long, default_value_t = 4096)]
    n_ctx: u32,
    /// Threads per node (default: physical cores).
    #[arg(long)]
    threads: Option<i32>,
    /// A request taking longer than this fails.
    #[arg(long, default_value_t = 300)]
    request_timeout_s: u64,
    /// Where the JSON report and the services' logs go (default:
    /// bench/results/load-<unix time>).
    #[arg(long)]
    out: Option<PathBuf>,
}

/// One request under load.
#[derive(Debug, serde::Serialize)]
struct Sample {
    client: usize,
    transport: String,
    prompt_tokens_target: usize,
    /// Seconds from the start of the load.
    started_s: f64,
    ok: bool,
    /// Same text as the answer written alone.
    same: Option<bool>,
    error: Option<String>,
    ttft_ms: Option<f64>,
    e2e_ms: Option<f64>,
    tpot_ms: Option<f64>,
    completion_tokens: u64,
    /// Answered, but finished on the prefill node after the split failed (the cause).
    fallback: Option<String>,
}

#[derive(Debug, serde::Serialize)]
struct Percentiles {
    p50: f64,
    p90: f64,
    p99: f64,
    max: f64,
}

fn percentiles(mut xs: Vec<f64>) -> Option<Percentiles> {
    if xs.is_empty() {
        return None;
    }
    xs.sort_by(f64::total_cmp);
    Some(Percentiles {
        p50: percentile(&xs, 0.50),
        p90: percentile(&xs, 0.90),
        p99: percentile(&xs, 0.99),
        max: xs[xs.len() - 1],
    })
}

/// `VmHWM` and `VmRSS` of a process, in bytes.
fn memory(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = status.lines().find(|l| l.starts_with(name))?;
        let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    };
    Some((field("VmHWM:")?, field("VmRSS:")?))
}

pub async fn run(args: &LoadArgs) -> anyhow::Result<()> {
    for t in &args.transports {
        anyhow::ensure!(
            crate::client::TRANSPORTS.contains(&t.as_str()),
            "unknown transport {t:?} ({})",
            crate::client::TRANSPORTS.join(", ")
        );
    }
    anyhow::ensure!(args.clients > 0 && !args.prompt_tokens.is_empty());
    let threads = args
        .threads
        .unwrap_or_else(edgesplit_engine::default_threads);
    let out = args.out.clone().unwrap_or_else(|| {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        crate::repo_root().join(format!("bench/results/load-{t}"))
    });
    std::fs::create_dir_all(&out)?;
    let cfg = StackConfig {
        phone_speed: args.devices.phone_speed,
        parallel: Some(args.parallel),
        ..StackConfig::new(
            crate::model_path(&args.model),
            args.n_ctx,
            threads,
            out.join("services"),
        )
    };
    eprintln!("[load] starting the stack ({})", args.profile.name);
    let stack = Stack::start(&cfg, args.profile.clone()).await?;
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(args.request_timeout_s))
        .pool_max_idle_per_host(args.clients)
        .build()?;
    let ask = |tokens: usize| Ask {
        prompt: client::prompt(tokens),
        max_tokens: args.max_tokens,
        chat: stack.chat,
        seed: 42,
        messages: None,
        cache_prompt: false,
    };

    // The answers written alone, one request at a time, on the single-device path.
    let local = Target::EdgeSplit {
        url: stack.router.clone(),
        transport: "local".into(),
    };
    let mut reference = BTreeMap::new();
    for &n in &args.prompt_tokens {
        let m = client::run(&http, &local, &ask(n)).await?;
        reference.insert(n, m.text);
    }
    let reference = Arc::new(reference);

    eprintln!(
        "[load] {} clients for {} s, transports {:?}, prompts {:?} tokens, {} output tokens",
        args.clients, args.duration_s, args.transports, args.prompt_tokens, args.max_tokens
    );
    let t0 = Instant::now();
    let deadline = t0 + Duration::from_secs(args.duration_s);
    let mut tasks = Vec::new();
    for c in 0..args.clients {
        let (http, reference, stack_url) = (http.clone(), reference.clone(), stack.router.clone());
        let transports = args.transports.clone();
        let prompts = args.prompt_tokens.clone();
        let asks: Vec<Ask> = prompts.iter().map(|&n| ask(n)).collect();
        tasks.push(tokio::spawn(async move {
            let mut samples = Vec::new();
            let mut i = c;
            while Instant::now() < deadline {
                let transport = transports[i % transports.len()].clone();
                let p = (i / transports.len()) % prompts.len();
                i += 1;
                let target = Target::EdgeSplit {
                    url: stack_url.clone(),
                    transport: transport.clone(),
                };
                let started_s = t0.elapsed().as_secs_f64();
                let r = client::run(&http, &target, &asks[p]).await;
                samples.push(match r {
                    Ok(m) => Sample {
                        client: c,
                        transport,
                        prompt_tokens_target: prompts[p],
                        started_s,
                        ok: true,
                        same: Some(reference.get(&prompts[p]) == Some(&m.text)),
                        error: None,
                        ttft_ms: Some(m.ttft_ms),
                        e2e_ms: Some(m.e2e_ms),
                        tpot_ms: m.tpot_ms,
                        completion_tokens: m.completion_tokens,
                        fallback: m.fallback,
                    },
                    Err(e) => Sample {
                        client: c,
                        transport,
                        prompt_tokens_target: prompts[p],
                        started_s,
                        ok: false,
                        same: None,
                        error: Some(format!("{e:#}")),
                        ttft_ms: None,
                        e2e_ms: None,
                        tpot_ms: None,
                        completion_tokens: 0,
                        fallback: None,
                    },
                });
            }
            samples
        }));
    }
    // Sample resident memory meanwhile too (VmHWM is the authority; this shows the curve).
    let procs = stack.processes();
    let mut rss_peak: BTreeMap<&str, u64> = BTreeMap::new();
    while tasks.iter().any(|t| !t.is_finished()) {
        for (name, pid) in &procs {
            if let Some((_, rss)) = memory(*pid) {
                let e = rss_peak.entry(name).or_default();
                *e = (*e).max(rss);
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let mut samples = Vec::new();
    for t in tasks {
        samples.extend(t.await?);
    }
    let wall_s = t0.elapsed().as_secs_f64();
    let mem: Vec<_> = procs
        .iter()
        .map(|(name, pid)| {
            let (hwm, rss) = memory(*pid).unwrap_or((0, 0));
            serde_json::json!({
                "process": name, "pid": pid, "vm_hwm_bytes": hwm, "vm_rss_bytes": rss,
                "sampled_rss_peak_bytes": rss_peak.get(name).copied().unwrap_or(0),
            })
        })
        .collect();
    drop(stack);

    let ok: Vec<&Sample> = samples.iter().filter(|s| s.ok).collect();
    let failed = samples.len() - ok.len();
    let wrong = ok.iter().filter(|s| s.same == Some(false)).count();
    let mut errors: BTreeMap<String, usize> = BTreeMap::new();
    for s in samples.iter().filter(|s| !s.ok) {
        let e = s.error.clone().unwrap_or_default();
        *errors.entry(e.chars().take(120).collect()).or_default() += 1;
    }
    let mut fallbacks: BTreeMap<String, usize> = BTreeMap::new();
    for f in ok.iter().filter_map(|s| s.fallback.clone()) {
        *fallbacks.entry(f).or_default() += 1;
    }
    let tokens: u64 = ok.iter().map(|s| s.completion_tokens).sum();
    let pick =
        |f: fn(&Sample) -> Option<f64>| percentiles(ok.iter().filter_map(|s| f(s)).collect());
    let report = serde_json::json!({
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "clients": args.clients,
        "duration_s": args.duration_s,
        "wall_s": wall_s,
        "profile": args.profile.name,
        "transports": args.transports,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "parallel": args.parallel,
        "threads": threads,
        "requests": samples.len(),
        "ok": ok.len(),
        "failed": failed,
        "wrong_answers": wrong,
        "errors": errors,
        "fallbacks": fallbacks,
        "requests_per_s": ok.len() as f64 / wall_s,
        "output_tokens_per_s": tokens as f64 / wall_s,
        "ttft_ms": pick(|s| s.ttft_ms),
        "e2e_ms": pick(|s| s.e2e_ms),
        "tpot_ms": pick(|s| s.tpot_ms),
        "memory": mem,
        "samples": samples,
    });
    let path = out.join("load.json");
    std::fs::write(&path, serde_json::to_string_pretty(&report)?)?;
    print_summary(&report);
    println!("\nreport: {}", path.display());
    anyhow::ensure!(
        failed == 0 && wrong == 0,
        "{failed} failed and {wrong} wrong answers"
    );
    Ok(())
}

fn print_summary(r: &serde_json::Value) {
    let f = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::NAN);
    println!(
        "{} clients, {:.1} s, {}: {} requests, {} ok, {} failed, {} wrong answers",
        r["clients"],
        f(&r["wall_s"]),
        r["profile"],
        r["requests"],
        r["ok"],
        r["failed"],
        r["wrong_answers"]
    );
    println!(
        "throughput: {:.2} req/s, {:.1} output tok/s",
        f(&r["requests_per_s"]),
        f(&r["output_tokens_per_s"])
    );
    println!("\n| metric | p50 | p90 | p99 | max |\n|---|---:|---:|---:|---:|");
    for m in ["ttft_ms", "tpot_ms", "e2e_ms"] {
        let p = &r[m];
        println!(
            "| {m} | {:.1} | {:.1} | {:.1} | {:.1} |",
            f(&p["p50"]),
            f(&p["p90"]),
            f(&p["p99"]),
            f(&p["max"])
        );
    }
    println!("\n| process | peak RSS (VmHWM) MiB | RSS at end MiB |\n|---|---:|---:|");
    for m in r["memory"].as_array().into_iter().flatten() {
        let mib = |v: &serde_json::Value| v.as_u64().unwrap_or(0) as f64 / 1048576.0;
        println!(
            "| {} | {:.1} | {:.1} |",
            m["process"].as_str().unwrap_or("?"),
            mib(&m["vm_hwm_bytes"]),
            mib(&m["vm_rss_bytes"])
        );
    }
    match r["fallbacks"].as_object().filter(|f| !f.is_empty()) {
        Some(f) => println!("\nanswered through the fallback (by cause): {f:?}"),
        None => println!("\nno answer needed the fallback"),
    }
    if let Some(e) = r["errors"].as_object().filter(|e| !e.is_empty()) {
        println!("\nerrors: {e:?}");
    }
}
