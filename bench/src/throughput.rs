//! `edgesplit-bench throughput`: what the pair of devices serves against each device alone.
//! Closed-loop clients (each sends its next request when its last one ended) work through
//! the same fixed list of requests in every mode - a mix of prompt lengths and answer
//! lengths in a fixed shuffled order - and the run reports completed requests per minute,
//! TTFT and e2e p50/p95, how much of the answers the phone wrote and the laptop's CPU time
//! per request, per mode (`local`: the laptop alone; `v2`: the split in the router's
//! default mode; `phone`: the phone alone), number of clients and link, all in one run on
//! one stack (links switched between profiles).
//!
//! Fidelity: every answer is compared with the same request's answer written alone on
//! `local` (a reference pass first, one request at a time); a differing answer counts as
//! wrong and is reported. Requests per minute count completed requests over the wall time
//! from the first request to the last answer: the same work in every mode, so the tail
//! (fewer clients busy at the end) weighs alike.
//!
//! With `--phone-speed` (the two devices emulated, [`crate::devices`]) this is the pair's
//! throughput; without it the services share the machine's cores. Not part of CI (minutes per
//! configuration); docs/BENCHMARKS.md has the commands.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rand::seq::SliceRandom;
use rand::SeedableRng;

use crate::client::{self, Ask, Target};
use crate::link::Profile;
use crate::record::{Record, Slot};
use crate::stack::{Stack, StackConfig};
use crate::stats::percentile;

mod markdown;
use markdown::markdown;

#[derive(clap::Args, Debug, Clone)]
pub struct ThroughputArgs {
    #[command(flatten)]
    pub devices: crate::devices::DeviceArgs,
    /// `smollm2`, `gemma3` or a GGUF path.
    #[arg(long, default_value = "smollm2")]
    model: String,
    /// Link profiles between the laptop and the phone.
    #[arg(long, value_delimiter = ',', default_value = "wifi,slow-wifi", value_parser = Profile::parse)]
    profiles: Vec<Profile>,
    /// Numbers of closed-loop clients.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8")]
    clients: Vec<usize>,
    /// Modes: `local` (the laptop alone), `v2` (the split, the router's default handoff),
    /// `phone` (the phone alone), or any transport of `run`.
    #[arg(long, value_delimiter = ',', default_value = "local,v2,phone")]
    modes: Vec<String>,
    /// The mix's prompt lengths (approximate tokens).
    #[arg(long, value_delimiter = ',', default_value = "100,500,1000,2000")]
    prompt_tokens: Vec<usize>,
    /// The mix's answer lengths (`max_tokens`).
    #[arg(long, value_delimiter = ',', default_value = "32,128,512")]
    max_tokens: Vec<u32>,
    /// Requests per mode, clients and link (the mix, repeated as needed).
    #[arg(long, default_value_t = 24)]
    requests: usize,
    #[arg(long, default_value_t = 4096)]
    n_ctx: u32,
    /// Threads per node (default: physical cores; one each with --phone-speed).
    #[arg(long)]
    threads: Option<i32>,
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// A request taking longer than this fails.
    #[arg(long, default_value_t = 900)]
    request_timeout_s: u64,
    /// The SQLite record (appended to): every request, mode `throughput`.
    #[arg(long, default_value = "bench/results/bench.sqlite")]
    db: PathBuf,
    /// Output folder (default: bench/results/throughput-<unix time>).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Where the energy readers look (see `run --sysfs-root`).
    #[arg(long, default_value = "/")]
    sysfs_root: PathBuf,
    /// Each cell on a stack started for it: the router and the nodes fresh, nothing
    /// excluded (their warm-up, the router's calibration and its first choices count in
    /// the cell's time). Else one stack serves every cell, warmed by the reference pass.
    #[arg(long)]
    fresh: bool,
    /// With --phone-speed: the phone's speed changed when request I of a cell starts, as
    /// `I:SPEED` pairs (`8:0.25,20:1.0`: a phone that throttles and recovers); each cell
    /// starts at --phone-speed.
    #[arg(long, value_delimiter = ',', value_parser = parse_speed_change)]
    phone_speed_at: Vec<(usize, f64)>,
    /// With --phone-speed: more phones in the router's pool (one decode node each, on the
    /// first phone's core at these fractions of it). A mode `MODE@N` names decode node N
    /// (1: the first phone) for every request: `auto@1` is the laptop with the first phone
    /// alone, beside the pool's `auto`.
    #[arg(long, value_delimiter = ',')]
    more_phones: Vec<f64>,
    /// Turns per conversation: above 1, each client plays whole conversations (its own
    /// answers in the history, `cache_prompt` on), `--requests` counts
    /// turns, and each cell runs on a stack started for it (a node holding the reference
    /// pass's conversations would continue them), warmed by a few of the mix's requests
    /// in the cell's mode unless `--fresh`; each node then serves twice the most clients
    /// at once (`--parallel`), so that it keeps every running conversation.
    #[arg(long, default_value_t = 1)]
    turns: usize,
    /// With --turns: about how many tokens each later user message adds.
    #[arg(long, default_value_t = 200)]
    turn_tokens: usize,
}

/// `MODE@N`: the mode and the decode node it names (1-based), or the mode alone.
fn split_node(mode: &str) -> anyhow::Result<(&str, Option<usize>)> {
    match mode.split_once('@') {
        Some((t, n)) => Ok((
            t,
            Some(
                n.parse()
                    .map_err(|e| anyhow::anyhow!("{mode:?}: the decode node's number: {e}"))?,
            ),
        )),
        None => Ok((mode, None)),
    }
}

fn parse_speed_change(s: &str) -> Result<(usize, f64), String> {
    let (i, v) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?}: expected REQUEST:SPEED, e.g. 8:0.25"))?;
    let i = i
        .parse()
        .map_err(|e| format!("{s:?}: the request index: {e}"))?;
    let v: f64 = v.parse().map_err(|e| format!("{s:?}: the speed: {e}"))?;
    if !(v > 0.0 && v <= 1.0) {
        return Err(format!("{s:?}: a speed is above 0 and at most 1"));
    }
    Ok((i, v))
}

/// The first completions a cell's early rate is taken over (`Cell::first_requests_per_min`).
const FIRST: usize = 12;

/// With --turns (and without --fresh): the mix's requests a cell's own stack answers, one
/// at a time in the cell's mode, before the cell's time starts.
const WARM: usize = 4;

/// One (link, clients, mode) of the run.
#[derive(Debug, serde::Serialize)]
struct Cell {
    profile: String,
    clients: usize,
    mode: String,
    requests: usize,
    completed: usize,
    failed: usize,
    /// Answers that differ from the same request's written alone on `local`.
    wrong: usize,
    /// Each of them: the request's index in the cell, its mode and where it was prefilled.
    wrong_answers: Vec<String>,
    wall_s: f64,
    requests_per_min: f64,
    /// Over the first [`FIRST`] completions only: `FIRST` x 60 / the time the last of them
    /// ended, from the cell's start.
    first_requests_per_min: Option<f64>,
    /// `auto` answers: `actual_ms` over `predicted_ms` (both from the request's admission).
    actual_over_predicted_p50: Option<f64>,
    actual_over_predicted_p90: Option<f64>,
    ttft_p50_ms: Option<f64>,
    ttft_p95_ms: Option<f64>,
    e2e_p50_ms: Option<f64>,
    e2e_p95_ms: Option<f64>,
    /// Of all answer tokens, the share the phone (the decode node) wrote.
    phone_share: Option<f64>,
    /// The laptop's CPU time (the prefill node process's) over the cell, per completed
    /// request.
    laptop_cpu_ms_per_request: Option<f64>,
    /// Requests that the router finished on the prefill node (`edgesplit.fallback`).
    fallbacks: usize,
    /// `auto` modes: how many answers the router chose each mode for (`edgesplit.mode`).
    choices: BTreeMap<String, usize>,
    /// Answer tokens each decode node wrote (`edgesplit.decode_node`).
    node_tokens: BTreeMap<String, u64>,
    /// `auto` modes: the mode chosen for each request, in the order the requests started.
    order: Vec<String>,
    /// One client: the largest of each request's end over the same request's alone on
    /// `local` (the reference pass), from the second request on.
    e2e_over_local_max: Option<f64>,
    /// With --turns: what crossed for the turns after the first.
    turns: Option<crate::turns::TurnStats>,
    errors: Vec<String>,
}

fn p(xs: &mut [f64], q: f64) -> Option<f64> {
    xs.sort_by(f64::total_cmp);
    (!xs.is_empty()).then(|| percentile(xs, q))
}

/// Request `i` of the mix: a fresh copy of its prompt (`cache_prompt` off: no node reuses
/// another request's KV).
fn ask_for(mix: &[(usize, u32)], i: usize, chat: bool, seed: u64) -> Ask {
    let (pt, mt) = mix[i % mix.len()];
    Ask {
        prompt: client::prompt(pt),
        max_tokens: mt,
        chat,
        seed,
        messages: None,
        cache_prompt: false,
    }
}

/// The fixed mix: every (prompt length, answer length), shuffled with a fixed seed.
fn mix(prompts: &[usize], answers: &[u32]) -> Vec<(usize, u32)> {
    let mut m: Vec<(usize, u32)> = prompts
        .iter()
        .flat_map(|&p| answers.iter().map(move |&a| (p, a)))
        .collect();
    m.shuffle(&mut rand::rngs::StdRng::seed_from_u64(7));
    m
}

pub async fn run(args: &ThroughputArgs) -> anyhow::Result<()> {
    for m in &args.modes {
        let (t, node) = split_node(m)?;
        anyhow::ensure!(
            client::TRANSPORTS.contains(&t),
            "unknown mode {m:?} ({})",
            client::TRANSPORTS.join(", ")
        );
        anyhow::ensure!(
            node.is_none_or(|n| n >= 1 && n <= 1 + args.more_phones.len()),
            "mode {m:?} names a decode node the stack does not have (1 to {})",
            1 + args.more_phones.len()
        );
    }
    anyhow::ensure!(
        args.more_phones.is_empty() || args.devices.phone_speed.is_some(),
        "--more-phones needs --phone-speed"
    );
    anyhow::ensure!(
        !args.prompt_tokens.is_empty() && !args.max_tokens.is_empty() && args.requests > 0,
        "the mix needs a prompt length, an answer length and a request"
    );
    anyhow::ensure!(
        args.clients.iter().all(|&c| c > 0),
        "--clients must be positive"
    );
    anyhow::ensure!(args.turns > 0, "--turns must be positive");
    let out = crate::results_dir(args.out.as_deref(), "throughput")?;
    let threads = args
        .threads
        .unwrap_or_else(edgesplit_engine::default_threads);
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let rec = Record::open(&args.db, &command, threads, args.n_ctx)?;
    rec.set_out_dir(&out)?;
    let model_path = crate::model_path(&args.model);
    let model = model_path
        .file_stem()
        .map_or(args.model.clone(), |s| s.to_string_lossy().into_owned());
    let cfg = StackConfig {
        phone_speed: args.devices.phone_speed,
        more_decode: vec![Vec::new(); args.more_phones.len()],
        more_phone_speeds: args.more_phones.clone(),
        parallel: crate::turns::parallel(args.turns, &args.clients),
        ..StackConfig::new(model_path, args.n_ctx, threads, out.join("services"))
    };
    eprintln!("[throughput] starting the stack");
    let stack = Stack::start(&cfg, args.profiles[0].clone()).await?;
    let devices = stack.devices().map_or(
        "the services sharing the machine's cores".to_string(),
        |d| d.describe(),
    );
    eprintln!("[throughput] {devices}");
    let env = crate::Env {
        rec,
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(args.request_timeout_s))
            .build()?,
        bar: indicatif::ProgressBar::hidden(),
        verbose: true,
        sensors: edgesplit_bench::energy::Sensors::find(&args.sysfs_root),
        laptop_pid: std::sync::Mutex::new(Some(stack.prefill_process.id())),
    };
    let mix = mix(&args.prompt_tokens, &args.max_tokens);
    let chat = stack.chat;
    if args.turns > 1 {
        anyhow::ensure!(chat, "--turns needs a model with a chat template");
        crate::turns::check_fits(&mix, args.turns, args.turn_tokens, args.n_ctx)?;
    }
    let ask = |i: usize| ask_for(&mix, i, chat, args.seed);

    // The reference: each request of the mix alone on the laptop.
    eprintln!(
        "[throughput] the reference pass: {} requests alone on local",
        if args.turns > 1 {
            args.requests
        } else {
            mix.len()
        }
    );
    let local = Target::EdgeSplit {
        url: stack.router.clone(),
        transport: "local".into(),
    };
    let mut reference = Vec::new();
    if args.turns > 1 {
        reference = crate::turns::reference(
            &env.http,
            &local,
            &mix,
            args.requests,
            args.turns,
            args.turn_tokens,
            args.seed,
        )
        .await?;
    } else {
        for i in 0..mix.len() {
            let m = client::run(&env.http, &local, &ask(i)).await?;
            reference.push((m.text, m.e2e_ms));
        }
    }

    let mut stack = Some(stack);
    if args.fresh || args.turns > 1 {
        stack = None;
    }
    let mut cells = Vec::new();
    for profile in &args.profiles {
        if let Some(s) = &stack {
            s.set_profile(profile);
        }
        for &clients in &args.clients {
            for mode in &args.modes {
                let fresh = match stack {
                    Some(_) => None,
                    None => {
                        eprintln!(
                            "[throughput] a fresh stack for {} x{clients} {mode}",
                            profile.name
                        );
                        let cfg = StackConfig {
                            dir: out.join(format!("services-{}-{clients}-{mode}", profile.name)),
                            ..cfg.clone()
                        };
                        let s = Stack::start(&cfg, profile.clone()).await?;
                        *env.laptop_pid
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner) =
                            Some(s.prefill_process.id());
                        Some(s)
                    }
                };
                let on = fresh.as_ref().or(stack.as_ref()).expect("a stack");
                let c = cell(
                    &env, on, args, &model, profile, clients, mode, &mix, &reference,
                )
                .await?;
                drop(fresh);
                eprintln!(
                    "[throughput] {} x{} {}: {:.2} req/min, {} failed, {} wrong",
                    c.profile, c.clients, c.mode, c.requests_per_min, c.failed, c.wrong
                );
                cells.push(c);
            }
        }
    }
    env.rec.close_run()?;
    let md = markdown(&command, &devices, args, &mix, &cells);
    std::fs::write(out.join("summary.md"), &md)?;
    std::fs::write(
        out.join("cells.json"),
        serde_json::to_string_pretty(&cells)?,
    )?;
    print!("{md}");
    eprintln!(
        "record: {} (run {}); outputs: {}",
        args.db.display(),
        env.rec.run_id,
        out.display()
    );
    Ok(())
}

#[allow(clippy::too_many_arguments)]
async fn cell(
    env: &crate::Env,
    stack: &Stack,
    args: &ThroughputArgs,
    model: &str,
    profile: &Profile,
    clients: usize,
    mode: &str,
    mix: &[(usize, u32)],
    reference: &[(String, f64)],
) -> anyhow::Result<Cell> {
    let transport = match split_node(mode)? {
        (t, Some(n)) => format!("{t}@{}", stack.decode_urls[n - 1]),
        (t, None) => t.to_string(),
    };
    let target = Target::EdgeSplit {
        url: stack.router.clone(),
        transport,
    };
    let next = Arc::new(AtomicUsize::new(0));
    let speed = |s: f64| match stack.devices() {
        Some(d) => d.set_speed(s),
        None => anyhow::bail!("--phone-speed-at needs --phone-speed"),
    };
    if !args.phone_speed_at.is_empty() {
        speed(args.devices.phone_speed.unwrap_or(1.0))?;
    }
    if args.turns > 1 && !args.fresh {
        // The stack is the cell's own: warm its nodes and the router's figures first.
        for i in 0..mix.len().min(WARM) {
            client::run(&env.http, &target, &ask_for(mix, i, stack.chat, args.seed)).await?;
        }
    }
    // The prefill node's `v2-kept` bytes at the start, for a conversation cell's count.
    let kept0 = match args.turns {
        1 => 0,
        _ => crate::chat_bench::kept_bytes(&env.http, stack).await?,
    };
    let cpu0 = stack.laptop_cpu_ms();
    let t0 = Instant::now();
    let turns = args.turns;
    let workers = (0..clients).map(|client| {
        let (next, target) = (next.clone(), target.clone());
        async move {
            let mut mine = Vec::new();
            // A client takes the next conversation (one request each without --turns).
            'conversations: loop {
                let first = next.fetch_add(1, Ordering::Relaxed) * turns;
                if first >= args.requests {
                    break;
                }
                let mut history = Vec::new();
                for i in first..(first + turns).min(args.requests) {
                    for &(at, s) in &args.phone_speed_at {
                        if at == i {
                            speed(s)?;
                            eprintln!("[throughput] request {i}: the phone at {s} of its core");
                        }
                    }
                    let a = if turns > 1 {
                        crate::turns::ask(&mut history, mix, i, turns, args.turn_tokens, args.seed)
                    } else {
                        ask_for(mix, i, stack.chat, args.seed)
                    };
                    let slot = Slot {
                        mode: "throughput",
                        model,
                        profile: &profile.name,
                        transport: mode,
                        target_prompt_tokens: mix[(i / turns) % mix.len()].0,
                        max_tokens: a.max_tokens,
                        pair: i,
                        position: client,
                        excluded: false,
                    };
                    let at = crate::attempt(env, &slot, &target, &a, clients == 1).await?;
                    let answer = at.result.as_ref().ok().map(|m| m.text.clone());
                    mine.push((i, at, t0.elapsed().as_secs_f64()));
                    match answer {
                        Some(text) => {
                            crate::turns::answered(&mut history, &text);
                        }
                        // A conversation does not go on past a failed turn.
                        None => continue 'conversations,
                    }
                }
            }
            anyhow::Ok(mine)
        }
    });
    let mut done = Vec::new();
    for r in futures::future::join_all(workers).await {
        done.extend(r?);
    }
    done.sort_by_key(|d| d.0);
    let wall_s = t0.elapsed().as_secs_f64();
    let cpu = match (cpu0, stack.laptop_cpu_ms()) {
        (Some(a), Some(b)) => Some(b - a),
        _ => None,
    };
    let (mut ttft, mut e2e) = (Vec::new(), Vec::new());
    let (mut phone, mut tokens, mut wrong, mut fallbacks) = (0u64, 0u64, 0, 0);
    let (mut errors, mut wrong_answers) = (Vec::new(), Vec::new());
    let mut choices = BTreeMap::new();
    let mut node_tokens = BTreeMap::new();
    let (mut ended, mut ratios) = (Vec::new(), Vec::new());
    let (mut order, mut over_local) = (Vec::new(), Vec::new());
    let mut answered = Vec::new();
    for (i, a, end_s) in &done {
        match &a.result {
            Ok(m) => {
                if let Some(mode) = &m.mode {
                    *choices.entry(mode.clone()).or_insert(0) += 1;
                    order.push(mode.clone());
                }
                if clients == 1 && *i > 0 {
                    over_local.push(m.e2e_ms / reference[i % reference.len()].1);
                }
                answered.push((*i, m));
                if let (Some(p), Some(a)) = (m.predicted_ms.filter(|&p| p > 0.0), m.actual_ms) {
                    ratios.push(a / p);
                }
                ended.push(*end_s);
                ttft.push(m.ttft_ms);
                e2e.push(m.e2e_ms);
                phone += m.phone_tokens.unwrap_or(0);
                if let (Some(node), Some(t)) = (&m.decode_node, m.phone_tokens) {
                    *node_tokens.entry(node.clone()).or_insert(0) += t;
                }
                tokens += m.completion_tokens;
                fallbacks += usize::from(m.fallback.is_some());
                let same = m.text == reference[i % reference.len()].0;
                wrong += usize::from(!same);
                if !same {
                    wrong_answers.push(format!(
                        "request {i} ({}, prefilled on {}, {} tokens reused)",
                        m.mode.as_deref().unwrap_or("-"),
                        m.placement.as_deref().unwrap_or("-"),
                        m.cached_tokens.unwrap_or(0)
                    ));
                }
                env.rec.mark_same(a.id, same)?;
            }
            Err(e) => errors.push(e.clone()),
        }
    }
    let completed = ttft.len();
    ended.sort_by(f64::total_cmp);
    let first_requests_per_min = ended
        .get(FIRST - 1)
        .filter(|&&s| s > 0.0)
        .map(|s| FIRST as f64 * 60.0 / s);
    let turns = crate::turns::cell_stats(&env.http, stack, kept0, &answered, turns).await?;
    Ok(Cell {
        turns,
        order,
        e2e_over_local_max: over_local.into_iter().reduce(f64::max),
        first_requests_per_min,
        actual_over_predicted_p50: p(&mut ratios, 0.5),
        actual_over_predicted_p90: p(&mut ratios, 0.9),
        profile: profile.name.clone(),
        clients,
        mode: mode.to_string(),
        requests: args.requests,
        completed,
        failed: errors.len(),
        wrong,
        wrong_answers,
        wall_s,
        requests_per_min: completed as f64 * 60.0 / wall_s,
        ttft_p50_ms: p(&mut ttft, 0.5),
        ttft_p95_ms: p(&mut ttft, 0.95),
        e2e_p50_ms: p(&mut e2e, 0.5),
        e2e_p95_ms: p(&mut e2e, 0.95),
        phone_share: (tokens > 0).then(|| phone as f64 / tokens as f64),
        laptop_cpu_ms_per_request: cpu.filter(|_| completed > 0).map(|c| c / completed as f64),
        fallbacks,
        choices,
        node_tokens,
        errors,
    })
}

#[cfg(test)]
mod tests {
    use super::markdown::choices_text;
    use super::*;

    #[test]
    fn autos_choices_are_listed_most_chosen_first() {
        let mut c = BTreeMap::new();
        assert_eq!(choices_text(&c), "-");
        c.insert("after".to_string(), 4);
        c.insert("local".to_string(), 19);
        c.insert("phone".to_string(), 4);
        assert_eq!(choices_text(&c), "local 19, after 4, phone 4");
    }

    #[test]
    fn the_mix_is_every_pair_in_a_fixed_order() {
        let a = mix(&[100, 2000], &[32, 512]);
        assert_eq!(a.len(), 4);
        assert_eq!(a, mix(&[100, 2000], &[32, 512]));
        for pair in [(100, 32), (100, 512), (2000, 32), (2000, 512)] {
            assert!(a.contains(&pair), "{pair:?}");
        }
    }
}
