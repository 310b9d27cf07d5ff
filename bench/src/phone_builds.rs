//! `edgesplit-bench phone-builds`: the phone's static file (`scripts/build-phone.sh`,
//! aarch64 musl) against the glibc aarch64 build (`scripts/build-aarch64.sh`), both under
//! qemu on this machine. Each build serves the `phone` transport (the prompt prefilled and
//! the answer written on the aarch64 node) for the agreement prompts, greedy and seeded;
//! the answers are compared token for token, and each answer's prefill and decode speeds
//! as ratios static / glibc. The builds take turns, one stack at a time, in an order that
//! alternates from round to round, so that drift of the machine hits both alike. Speed
//! under emulation is not a phone's speed: the ratio compares the two files' code (libc,
//! allocator, threads without OpenMP) under the same emulation.

use std::path::PathBuf;

use anyhow::Context;
use edgesplit_bench::link::Profile;
use edgesplit_bench::stack::{Stack, StackConfig};
use serde_json::{json, Value};

/// Options of the comparison.
#[derive(clap::Args, Debug)]
pub struct PhoneBuildsArgs {
    /// The static file.
    #[arg(long, default_value = "target-phone/edgesplit-decode")]
    pub static_build: PathBuf,
    /// The glibc build.
    #[arg(
        long,
        default_value = "target-aarch64/aarch64-unknown-linux-gnu/release/edgesplit-decode"
    )]
    pub glibc_build: PathBuf,
    /// How an aarch64 program is run here.
    #[arg(long, default_value = "qemu-aarch64")]
    pub qemu: PathBuf,
    /// Model: `smollm2`, `gemma3` or a GGUF path.
    #[arg(long, default_value = "smollm2")]
    pub model: String,
    /// Prompts (of the agreement bench's 16; the last is ~560 tokens).
    #[arg(long, default_value_t = 16)]
    pub prompts: usize,
    /// Answer length.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: u32,
    /// Rounds (each runs both builds).
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// Threads of every engine.
    #[arg(long, default_value_t = 2)]
    pub threads: i32,
    /// Output folder (the services' logs, results.json).
    #[arg(long, default_value = "bench/results/phone-builds")]
    pub out: PathBuf,
}

/// One answer: its token ids and the aarch64 node's prefill and decode speeds.
struct Answer {
    ids: Vec<i64>,
    prefill_tps: f64,
    decode_tps: f64,
}

async fn ask(
    http: &reqwest::Client,
    stack: &Stack,
    prompt: &str,
    max_tokens: u32,
    sampling: (f64, u64),
) -> anyhow::Result<Answer> {
    let v = crate::agreement::request(http, stack, prompt, max_tokens, sampling, "phone", false)
        .await?;
    let e = &v["edgesplit"];
    let prompt_tokens = v["usage"]["prompt_tokens"].as_f64().context("usage")?;
    let prefill_ms = e["prefill_ms"].as_f64().context("prefill_ms")?;
    Ok(Answer {
        ids: crate::agreement::token_ids(&v)?,
        prefill_tps: prompt_tokens * 1000.0 / prefill_ms,
        decode_tps: e["decode_tokens_per_s"].as_f64().context("decode speed")?,
    })
}

/// Runs the comparison and prints a Markdown table; writes results.json to `--out`.
///
/// # Errors
/// A missing build, a service that fails, an answer the phone did not write.
pub async fn run(args: &PhoneBuildsArgs) -> anyhow::Result<()> {
    let builds = [("glibc", &args.glibc_build), ("static", &args.static_build)];
    for (name, bin) in builds {
        anyhow::ensure!(
            bin.is_file(),
            "the {name} build {} is missing (scripts/build-phone.sh, scripts/build-aarch64.sh)",
            bin.display()
        );
    }
    let model = crate::model_path(&args.model);
    let prompts: Vec<String> = crate::agreement::prompts()
        .into_iter()
        .rev()
        .take(args.prompts)
        .rev()
        .collect();
    let samplings = [(0.0, 1), (0.8, 7)];
    let http = reqwest::Client::new();
    // Per build: every round's answers, in prompt x sampling order.
    let mut answers: [Vec<Vec<Answer>>; 2] = Default::default();
    for round in 0..args.rounds {
        let order: [usize; 2] = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for b in order {
            let (name, bin) = builds[b];
            let dir = args.out.join(format!("round{round}-{name}"));
            let mut cfg = StackConfig::new(model.clone(), 2048, args.threads, dir);
            cfg.direct = true;
            cfg.decode_program = Some(vec![args.qemu.clone(), bin.clone()]);
            // An emulated node prefills a long prompt in tens of seconds.
            cfg.router_extra = ["--first-token-timeout-s", "3600"]
                .into_iter()
                .chain(["--token-idle-timeout-ms", "3600000", "--no-probes"])
                .map(String::from)
                .collect();
            let stack = Stack::start(&cfg, Profile::named("loopback").expect("a profile")).await?;
            let mut these = Vec::new();
            for p in &prompts {
                for &s in &samplings {
                    these.push(ask(&http, &stack, p, args.max_tokens, s).await?);
                }
            }
            eprintln!("round {round}, {name}: {} answers", these.len());
            answers[b].push(these);
        }
    }
    let (glibc, statik) = (&answers[0], &answers[1]);
    let reference = &glibc[0];
    let identical = |runs: &[Vec<Answer>]| {
        runs.iter()
            .flat_map(|r| r.iter().zip(reference))
            .filter(|(a, r)| a.ids == r.ids)
            .count()
    };
    let total = reference.len() * args.rounds;
    let ratio = |f: fn(&Answer) -> f64| -> Vec<f64> {
        statik
            .iter()
            .flatten()
            .zip(glibc.iter().flatten())
            .map(|(s, g)| f(s) / f(g))
            .collect()
    };
    let speeds = |runs: &[Vec<Answer>], f: fn(&Answer) -> f64| -> Vec<f64> {
        runs.iter().flatten().map(f).collect()
    };
    let m = |v: Vec<f64>| crate::chat_bench::median(v).unwrap_or(f64::NAN);
    let prefill = |a: &Answer| a.prefill_tps;
    let decode = |a: &Answer| a.decode_tps;
    println!(
        "\nThe phone's static file against the glibc build, both under qemu-aarch64 ({} prompts x \
         greedy and seeded, {} tokens, {} rounds; medians over answers):\n",
        prompts.len(),
        args.max_tokens,
        args.rounds
    );
    println!("| build | answers identical to the glibc build's first round | prefill tok/s | decode tok/s |");
    println!("|---|---|---|---|");
    for (name, runs) in [("glibc", glibc), ("static", statik)] {
        println!(
            "| {name} | {}/{total} | {:.1} | {:.2} |",
            identical(runs),
            m(speeds(runs, prefill)),
            m(speeds(runs, decode)),
        );
    }
    let (rp, rd) = (m(ratio(prefill)), m(ratio(decode)));
    println!("| static / glibc, answer by answer | | {rp:.3} | {rd:.3} |");
    std::fs::create_dir_all(&args.out)?;
    let per = |runs: &[Vec<Answer>]| -> Vec<Value> {
        runs.iter()
            .flatten()
            .map(
                |a| json!({"ids": a.ids, "prefill_tps": a.prefill_tps, "decode_tps": a.decode_tps}),
            )
            .collect()
    };
    std::fs::write(
        args.out.join("results.json"),
        serde_json::to_string_pretty(&json!({
            "glibc": per(glibc), "static": per(statik),
            "identical": {"glibc": identical(glibc), "static": identical(statik), "of": total},
            "ratio_static_over_glibc": {"prefill": rp, "decode": rd},
        }))?,
    )?;
    Ok(())
}
