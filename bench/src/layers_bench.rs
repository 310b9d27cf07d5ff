//! `edgesplit-bench layers`: the layer split against one device. Two stacks of
//! the real binaries:
//! - `local`: the prefill node computes every layer (the single-device reference; no
//!   link is crossed, so it is measured once);
//! - `layers`: the prefill node computes the first layers and the decode node's ggml RPC
//!   server the last `--rpc-layers` (and the output layer), through an emulated link
//!   switched to each `--profiles` entry in turn.
//!
//! Each request is greedy, streamed, on `/v1/completions` (or chat where the model has a
//! template); `--rounds` retained requests per row after one warm-up. Per row: TTFT, time
//! per output token, ggml round trips per output token (from the prefill node's
//! `Info.layer_split`, through the router's `/health`), and how many answers differ from
//! `local`'s (any does: the split changed the answer). With `--budgets HERE,PEER` (MiB) a
//! last row serves the model with both nodes' memory capped (`EDGESPLIT_MEM_BUDGET_BYTES`)
//! and `--rpc-layers auto`: the plan the prefill node made is printed beside it.

use std::path::PathBuf;

use anyhow::Context;
use serde_json::Value;

use crate::client::{self, Ask, Measure, Target};
use crate::link::Profile;
use crate::stack::{RpcSplit, Stack, StackConfig};
use crate::stats::Stats;

/// Options of the layer split benchmark.
#[derive(clap::Args, Debug)]
pub struct LayersArgs {
    #[command(flatten)]
    pub devices: crate::devices::DeviceArgs,
    /// `smollm2`, `gemma3` or a GGUF path.
    #[arg(long, default_value = "smollm2")]
    pub model: String,
    /// Link profiles between the laptop side and the phone side.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "loopback,wifi,tailscale-wifi",
        value_parser = Profile::parse
    )]
    pub profiles: Vec<Profile>,
    /// Layers on the peer (the last ones; the output layer goes with them).
    #[arg(long, default_value_t = 12)]
    pub rpc_layers: u32,
    /// Approximate prompt tokens.
    #[arg(long, default_value_t = 128)]
    pub prompt_tokens: usize,
    /// Each answer's max_tokens.
    #[arg(long, default_value_t = 64)]
    pub max_tokens: u32,
    /// Retained requests per row (after one warm-up).
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Memory budgets in MiB, `HERE,PEER`: a last row with both nodes capped and the plan's
    /// own layer count (`--rpc-layers auto`), on the first profile.
    #[arg(long, value_delimiter = ',')]
    pub budgets: Option<Vec<u64>>,
    #[arg(long, default_value_t = 1024)]
    pub n_ctx: u32,
    /// Threads per server (default: physical cores).
    #[arg(long)]
    pub threads: Option<i32>,
    /// Output folder (default: bench/results/layers-<unix time>).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// One row's requests.
#[derive(Debug, serde::Serialize)]
struct Row {
    name: String,
    samples: Vec<Measure>,
    /// ggml round trips of each request (the split's rows).
    round_trips: Vec<u64>,
    /// Answers that are not `local`'s.
    differ: usize,
    /// The prefill node's plan (the budget row).
    plan: Option<String>,
}

impl Row {
    fn median(&self, f: impl Fn(&Measure) -> Option<f64>) -> f64 {
        let xs: Vec<f64> = self.samples.iter().filter_map(f).collect();
        Stats::of(&xs).map_or(f64::NAN, |s| s.median)
    }

    fn round_trips_per_token(&self) -> Option<f64> {
        let tokens: u64 = self.samples.iter().map(|m| m.completion_tokens).sum();
        let trips: u64 = self.round_trips.iter().sum();
        (tokens > 0 && !self.round_trips.is_empty()).then(|| trips as f64 / tokens as f64)
    }
}

/// The prefill node's ggml round trips so far (the router's `/health`).
async fn round_trips(http: &reqwest::Client, stack: &Stack) -> anyhow::Result<Option<u64>> {
    let h: Value = http
        .get(format!("{}/health", stack.router))
        .send()
        .await?
        .json()
        .await?;
    Ok(h["prefill"]["layer_split"]["rpc_round_trips"].as_u64())
}

/// `rounds` measured requests (after a warm-up) on `transport`.
async fn measure(
    http: &reqwest::Client,
    stack: &Stack,
    transport: &str,
    ask: &Ask,
    rounds: usize,
) -> anyhow::Result<(Vec<Measure>, Vec<u64>)> {
    let target = Target::EdgeSplit {
        url: stack.router.clone(),
        transport: transport.into(),
    };
    client::run(http, &target, ask).await.context("warm-up")?;
    let (mut samples, mut trips) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        let before = round_trips(http, stack).await?;
        let m = client::run(http, &target, ask).await?;
        if let (Some(b), Some(a)) = (before, round_trips(http, stack).await?) {
            trips.push(a - b);
        }
        samples.push(m);
    }
    Ok((samples, trips))
}

/// Runs the benchmark and prints its table.
///
/// # Errors
/// A stack does not start, a request fails, or the files cannot be written.
pub async fn run(args: &LayersArgs) -> anyhow::Result<()> {
    let threads = args
        .threads
        .unwrap_or_else(edgesplit_engine::default_threads);
    let out = crate::results_dir(args.out.as_deref(), "layers")?;
    let model = crate::model_path(&args.model);
    let first = args.profiles.first().context("no link profile")?.clone();
    let http = reqwest::Client::new();
    // The layer split is served only behind the private link (a shared secret); the
    // `local` baseline gets the same, so both pay for the same gRPC credential.
    let base = |dir: &str| StackConfig {
        phone_speed: args.devices.phone_speed,
        secret: Some("the layer split bench's shared secret, 32 bytes or more".into()),
        ..StackConfig::new(model.clone(), args.n_ctx, threads, out.join(dir))
    };

    let local_stack = Stack::start(&base("local"), Profile::named("loopback").unwrap()).await?;
    let ask = Ask {
        prompt: client::prompt(args.prompt_tokens),
        max_tokens: args.max_tokens,
        chat: local_stack.chat,
        seed: 42,
        messages: None,
        cache_prompt: false,
    };
    let (samples, _) = measure(&http, &local_stack, "local", &ask, args.rounds).await?;
    drop(local_stack);
    let reference = samples[0].text.clone();
    let differ = |s: &[Measure]| s.iter().filter(|m| m.text != reference).count();
    let mut rows = vec![Row {
        name: "local".into(),
        differ: differ(&samples),
        samples,
        round_trips: Vec::new(),
        plan: None,
    }];

    let split = StackConfig {
        rpc: Some(RpcSplit {
            layers: args.rpc_layers.to_string(),
            budgets: None,
        }),
        ..base("layers")
    };
    let stack = Stack::start(&split, first.clone()).await?;
    for profile in &args.profiles {
        stack.set_profile(profile);
        let (samples, round_trips) = measure(&http, &stack, "layers", &ask, args.rounds)
            .await
            .with_context(|| format!("layers on {}", profile.name))?;
        eprintln!("layers on {}: done", profile.name);
        rows.push(Row {
            name: format!("layers {} ({})", args.rpc_layers, profile.name),
            differ: differ(&samples),
            samples,
            round_trips,
            plan: None,
        });
    }
    drop(stack);

    if let Some(b) = &args.budgets {
        anyhow::ensure!(b.len() == 2, "--budgets takes HERE,PEER (MiB), not {b:?}");
        let mib = |n: u64| n << 20;
        let capped = StackConfig {
            rpc: Some(RpcSplit {
                layers: "auto".into(),
                budgets: Some((mib(b[0]), mib(b[1]))),
            }),
            ..base("budgets")
        };
        let stack = Stack::start(&capped, first.clone()).await?;
        let (samples, round_trips) = measure(&http, &stack, "layers", &ask, args.rounds).await?;
        let log = std::fs::read_to_string(out.join("budgets/prefill.log")).unwrap_or_default();
        let plan = log
            .lines()
            .find(|l| l.contains("layer split planned"))
            .map(|l| l.trim().to_string());
        rows.push(Row {
            name: format!(
                "layers auto, budgets {} / {} MiB ({})",
                b[0], b[1], first.name
            ),
            differ: differ(&samples),
            samples,
            round_trips,
            plan,
        });
    }

    let local_ttft = rows[0].median(|m| Some(m.ttft_ms));
    let local_tpot = rows[0].median(|m| m.tpot_ms);
    let mut table = format!(
        "model {}, prompt ~{} tokens, {} output tokens, {} requests a row\n\n\
         | row | TTFT ms | x local | ms/token | x local | tok/s | round trips/token | answers differing |\n\
         |---|---|---|---|---|---|---|---|\n",
        args.model, args.prompt_tokens, args.max_tokens, args.rounds
    );
    for r in &rows {
        let (ttft, tpot) = (r.median(|m| Some(m.ttft_ms)), r.median(|m| m.tpot_ms));
        table.push_str(&format!(
            "| {} | {ttft:.0} | {:.2} | {tpot:.1} | {:.2} | {:.1} | {} | {} of {} |\n",
            r.name,
            ttft / local_ttft,
            tpot / local_tpot,
            1000.0 / tpot,
            r.round_trips_per_token()
                .map_or("-".to_string(), |t| format!("{t:.1}")),
            r.differ,
            r.samples.len()
        ));
    }
    for r in rows.iter().filter_map(|r| r.plan.as_ref()) {
        table.push_str(&format!("\nplan: {r}\n"));
    }
    print!("{table}");
    std::fs::write(out.join("layers.md"), &table)?;
    std::fs::write(
        out.join("layers.json"),
        serde_json::to_string_pretty(&rows)?,
    )?;
    eprintln!("results in {}", out.display());
    let differing: usize = rows.iter().map(|r| r.differ).sum();
    anyhow::ensure!(
        differing == 0,
        "{differing} answers differ from one device's"
    );
    Ok(())
}
