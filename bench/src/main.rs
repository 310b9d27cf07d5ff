//! `edgesplit-bench`:
//! - `api`: measures TTFT and decode speed per transport through the router's public
//!   streaming API, the way a client sees them;
//! - `engine`: our engine's pp/tg speed, to compare with a stock llama-bench
//!   (`bench/stock-llama-bench.sh`) on the same model and threads.
//!
//! Method (the seed project's): one warm-up pair excluded, then `--pairs` retained pairs;
//! within a pair the transports run in alternating order so machine drift hits both;
//! temperature 0; ratios are computed pair by pair. A pair whose answers differ between
//! transports is reported as a fidelity failure: its speed does not count.
//! (The full harness - sweeps, links, baselines, SQLite - is a later issue.)

use std::time::{Duration, Instant};

use clap::Parser;
use serde_json::{json, Value};

mod engine_bench;

#[derive(Parser, Debug)]
#[command(name = "edgesplit-bench", about)]
enum Cli {
    /// TTFT and decode speed per transport, through the router's API.
    Api(Args),
    /// Our engine's prefill (pp) and decode (tg) speed, llama-bench style.
    Engine(engine_bench::EngineArgs),
}

#[derive(clap::Args, Debug)]
struct Args {
    /// Router base URL.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// Approximate prompt length in tokens.
    #[arg(long, default_value_t = 500)]
    prompt_tokens: usize,
    /// Tokens to generate per request.
    #[arg(long, default_value_t = 64)]
    max_tokens: u32,
    /// Retained pairs (after one warm-up pair).
    #[arg(long, default_value_t = 5)]
    pairs: usize,
    /// Transports to compare; the first is the one whose ratio is reported.
    #[arg(long, value_delimiter = ',', default_value = "v2,local")]
    transports: Vec<String>,
}

/// One measured request.
#[derive(Debug, Clone)]
struct Sample {
    ttft_ms: f64,
    e2e_ms: f64,
    completion_tokens: u64,
    prompt_tokens: u64,
    /// Server-reported decode speed (decode steps only).
    decode_tps: f64,
    handoff_bytes: u64,
    handoff_ms: f64,
    text: String,
}

fn prompt(target_tokens: usize) -> String {
    // About 21 tokens per line with SmolLM2's tokenizer.
    let lines = (target_tokens / 21).max(1);
    let log = (0..lines)
        .map(|i| {
            format!(
                "Day {i}: harbour {} recorded {} degrees, wind {} km/h.",
                i % 7,
                10 + (i * 7) % 23,
                (i * 13) % 41
            )
        })
        .collect::<Vec<_>>()
        .join(" ");
    format!("{log}\nSummarise the weather log.")
}

async fn one(client: &reqwest::Client, args: &Args, transport: &str) -> anyhow::Result<Sample> {
    let body = json!({
        "messages": [{"role": "user", "content": prompt(args.prompt_tokens)}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "seed": 42,
        "stream": true,
        "stream_options": {"include_usage": true},
        "edgesplit": {"transport": transport},
    });
    let t0 = Instant::now();
    let mut resp = client
        .post(format!("{}/v1/chat/completions", args.url))
        .json(&body)
        .send()
        .await?;
    anyhow::ensure!(resp.status().is_success(), "HTTP {}", resp.status());
    let mut ttft = None;
    let mut text = String::new();
    let mut usage = Value::Null;
    let mut timing = Value::Null;
    let mut buf = String::new();
    while let Some(chunk) = resp.chunk().await? {
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let Some(data) = event.lines().find_map(|l| l.strip_prefix("data: ")) else {
                continue;
            };
            if data == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(data)?;
            anyhow::ensure!(v.get("error").is_none(), "in-band error: {v}");
            if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
                if !c.is_empty() {
                    ttft.get_or_insert(t0.elapsed());
                    text.push_str(c);
                }
            }
            if !v["usage"].is_null() {
                usage = v["usage"].clone();
                timing = v["edgesplit"].clone();
            }
        }
    }
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    Ok(Sample {
        ttft_ms: ms(ttft.unwrap_or_default()),
        e2e_ms: ms(t0.elapsed()),
        completion_tokens: usage["completion_tokens"].as_u64().unwrap_or(0),
        prompt_tokens: usage["prompt_tokens"].as_u64().unwrap_or(0),
        decode_tps: timing["decode_tokens_per_s"].as_f64().unwrap_or(0.0),
        handoff_bytes: timing["handoff_bytes"].as_u64().unwrap_or(0),
        handoff_ms: timing["handoff_ms"].as_f64().unwrap_or(0.0),
        text,
    })
}

struct Stats {
    mean: f64,
    median: f64,
    stddev: f64,
    min: f64,
    max: f64,
}

fn stats(xs: &[f64]) -> Stats {
    let n = xs.len().max(1) as f64;
    let mean = xs.iter().sum::<f64>() / n;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    let mut s = xs.to_vec();
    s.sort_by(f64::total_cmp);
    let median = if s.is_empty() {
        0.0
    } else if s.len() % 2 == 1 {
        s[s.len() / 2]
    } else {
        (s[s.len() / 2 - 1] + s[s.len() / 2]) / 2.0
    };
    Stats {
        mean,
        median,
        stddev: var.sqrt(),
        min: s.first().copied().unwrap_or(0.0),
        max: s.last().copied().unwrap_or(0.0),
    }
}

fn row(name: &str, xs: &[f64]) -> String {
    let s = stats(xs);
    format!(
        "| {name} | {:.1} | {:.1} | {:.1} | {:.1} | {:.1} |",
        s.mean, s.median, s.stddev, s.min, s.max
    )
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    match Cli::parse() {
        Cli::Api(args) => api(args).await,
        Cli::Engine(args) => engine_bench::run(&args).await,
    }
}

async fn api(args: Args) -> anyhow::Result<()> {
    anyhow::ensure!(args.transports.len() >= 2, "need two transports to compare");
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(600))
        .build()?;
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); args.transports.len()];
    let mut mismatches = 0;
    for pair in 0..=args.pairs {
        let mut order: Vec<usize> = (0..args.transports.len()).collect();
        if pair % 2 == 1 {
            order.reverse();
        }
        let mut got: Vec<Option<Sample>> = vec![None; args.transports.len()];
        for &i in &order {
            got[i] = Some(one(&client, &args, &args.transports[i]).await?);
        }
        let got: Vec<Sample> = got.into_iter().flatten().collect();
        let same = got.iter().all(|s| s.text == got[0].text);
        eprintln!(
            "pair {pair}{}: {}{}",
            if pair == 0 {
                " (warm-up, excluded)"
            } else {
                ""
            },
            got.iter()
                .zip(&args.transports)
                .map(|(s, t)| format!("{t} TTFT {:.1} ms, {:.1} tok/s", s.ttft_ms, s.decode_tps))
                .collect::<Vec<_>>()
                .join("; "),
            if same { "" } else { "  ANSWERS DIFFER" }
        );
        if pair == 0 {
            continue;
        }
        if !same {
            mismatches += 1;
            continue;
        }
        for (i, s) in got.into_iter().enumerate() {
            samples[i].push(s);
        }
    }
    let first = &samples[0];
    let p = first.first().map_or(0, |s| s.prompt_tokens);
    let c = first.first().map_or(0, |s| s.completion_tokens);
    println!(
        "prompt {p} tokens, {c} completion tokens, {} retained pairs, {mismatches} pairs with differing answers\n",
        first.len()
    );
    println!("| metric | mean | median | stddev | min | max |\n|---|---|---|---|---|---|");
    for (i, t) in args.transports.iter().enumerate() {
        let s = &samples[i];
        println!(
            "{}",
            row(
                &format!("{t} TTFT ms"),
                &s.iter().map(|x| x.ttft_ms).collect::<Vec<_>>()
            )
        );
        println!(
            "{}",
            row(
                &format!("{t} decode tok/s (server)"),
                &s.iter().map(|x| x.decode_tps).collect::<Vec<_>>()
            )
        );
        println!(
            "{}",
            row(
                &format!("{t} end-to-end ms"),
                &s.iter().map(|x| x.e2e_ms).collect::<Vec<_>>()
            )
        );
        if s.iter().any(|x| x.handoff_bytes > 0) {
            println!(
                "{}",
                row(
                    &format!("{t} handoff ms"),
                    &s.iter().map(|x| x.handoff_ms).collect::<Vec<_>>()
                )
            );
            println!(
                "{}",
                row(
                    &format!("{t} handoff MB"),
                    &s.iter()
                        .map(|x| x.handoff_bytes as f64 / 1e6)
                        .collect::<Vec<_>>()
                )
            );
        }
    }
    for (i, t) in args.transports.iter().enumerate().skip(1) {
        let base = &args.transports[0];
        let ttft: Vec<f64> = samples[0]
            .iter()
            .zip(&samples[i])
            .map(|(a, b)| a.ttft_ms / b.ttft_ms)
            .collect();
        let tps: Vec<f64> = samples[0]
            .iter()
            .zip(&samples[i])
            .map(|(a, b)| a.decode_tps / b.decode_tps)
            .collect();
        let st = stats(&ttft);
        let sd = stats(&tps);
        println!(
            "| ratio {base}/{t} TTFT (pairwise) | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} |",
            st.mean, st.median, st.stddev, st.min, st.max
        );
        println!(
            "| ratio {base}/{t} decode tok/s (pairwise) | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} |",
            sd.mean, sd.median, sd.stddev, sd.min, sd.max
        );
    }
    anyhow::ensure!(mismatches == 0, "{mismatches} pairs gave different answers");
    Ok(())
}
