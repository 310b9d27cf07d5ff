//! `edgesplit-bench engine`: our engine's prefill and decode speed measured the way
//! llama-bench measures them (pp: one prefill of N prompt tokens; tg: N tokens generated
//! one at a time), so the two can be compared on the same model and thread count.

use std::path::PathBuf;
use std::time::Instant;

use edgesplit_engine::{Engine, EngineConfig, GenEvent, Input, SamplingParams, Start};

/// Options of the engine benchmark.
#[derive(clap::Args, Debug)]
pub struct EngineArgs {
    /// GGUF model file.
    #[arg(long)]
    pub model: PathBuf,
    /// Threads (default: physical cores, as the nodes use).
    #[arg(long)]
    pub threads: Option<i32>,
    /// Prompt tokens for the prefill test (llama-bench `-p`).
    #[arg(long, default_value_t = 512)]
    pub pp: usize,
    /// Generated tokens for the decode test (llama-bench `-n`).
    #[arg(long, default_value_t = 128)]
    pub tg: u32,
    /// Prompt tokens already in the cache when the decode test starts (llama-bench `-d`).
    #[arg(long, default_value_t = 0)]
    pub depth: usize,
    /// Repetitions (llama-bench `-r`).
    #[arg(long, default_value_t = 5)]
    pub reps: usize,
}

fn mean_sd(xs: &[f64]) -> (f64, f64) {
    let n = xs.len().max(1) as f64;
    let m = xs.iter().sum::<f64>() / n;
    let v = xs.iter().map(|x| (x - m).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (m, v.sqrt())
}

/// Runs the benchmark and prints a llama-bench-like table.
///
/// # Errors
/// Model load or engine failures.
pub async fn run(args: &EngineArgs) -> anyhow::Result<()> {
    let mut cfg = EngineConfig::new(&args.model);
    cfg.n_ctx = u32::try_from(args.pp.max(args.depth) + args.tg as usize + 64)?.max(1024);
    if let Some(t) = args.threads {
        cfg.n_threads = t;
    }
    let threads = cfg.n_threads;
    let engine = Engine::start(cfg).await?;
    // A prompt of exactly `pp` tokens: tokenize a long text and cut it.
    let n = args.pp.max(args.depth).max(1);
    let text = "The quick brown fox jumps over the lazy dog. ".repeat(n / 5 + 10);
    let all = engine.tokenize(Input::Raw(text)).await?;
    let tokens = all[..args.pp.min(all.len())].to_vec();
    let depth = all[..args.depth.clamp(1, all.len())].to_vec();
    let mut pp = Vec::new();
    let mut tg = Vec::new();
    for rep in 0..=args.reps {
        let out = engine
            .prefill(
                tokens.clone(),
                SamplingParams::default(),
                1,
                edgesplit_engine::Export::None,
            )
            .await?;
        let pp_tps = args.pp as f64 / (out.prefill_ms / 1000.0);
        // Decode from a one-token prompt, `tg` tokens, EOG never stopping it early: a
        // token budget run that ends on EOG is reported and excluded.
        let t0 = Instant::now();
        let mut rx = engine
            .generate(
                Start::Prompt(depth.clone()),
                SamplingParams::default(),
                args.tg + 1,
            )
            .await?;
        let mut summary = None;
        while let Some(ev) = rx.recv().await {
            match ev {
                GenEvent::Done(s) => summary = Some(s),
                GenEvent::Error(e) => anyhow::bail!("generation failed: {e}"),
                _ => {}
            }
        }
        let s = summary.ok_or_else(|| anyhow::anyhow!("no summary"))?;
        let tg_tps = f64::from(s.generated) / (s.decode_ms / 1000.0);
        eprintln!(
            "rep {rep}{}: pp{} {:.1} tok/s, tg{} {:.1} tok/s ({:.0} ms wall)",
            if rep == 0 { " (warm-up, excluded)" } else { "" },
            args.pp,
            pp_tps,
            s.generated,
            tg_tps,
            t0.elapsed().as_secs_f64() * 1000.0
        );
        if rep > 0 {
            pp.push(pp_tps);
            if s.generated == args.tg {
                tg.push(tg_tps);
            }
        }
    }
    let (ppm, pps) = mean_sd(&pp);
    let (tgm, tgs) = mean_sd(&tg);
    println!("| engine | threads | test | t/s |\n|---|---|---|---|");
    println!(
        "| edgesplit | {threads} | pp{} | {ppm:.2} ± {pps:.2} |",
        args.pp
    );
    let at = if args.depth > 0 {
        format!(" @ d{}", args.depth)
    } else {
        String::new()
    };
    println!(
        "| edgesplit | {threads} | tg{}{at} | {tgm:.2} ± {tgs:.2} |",
        args.tg
    );
    Ok(())
}
