//! `edgesplit-bench kv-quality`: what a quantized KV cache costs against f16, measured the
//! way llama-perplexity's `--kl-divergence` does: the same fixed text read by two engines
//! of the same model, one with an f16 KV cache (the reference) and one with the type under
//! test, both with flash attention on; at every position, the KL divergence of the test
//! engine's next-token distribution from the reference's, and whether their most likely
//! next tokens agree. Not a speed figure: no baseline ratio applies.

use std::path::PathBuf;

use edgesplit_engine::{Engine, EngineConfig, FlashAttn, Input, KvType};

/// Options of the KV quality measurement.
#[derive(clap::Args, Debug)]
pub struct QualityArgs {
    /// GGUF model file.
    #[arg(long)]
    pub model: PathBuf,
    /// KV cache types measured against f16.
    #[arg(long, value_delimiter = ',', default_value = "q8_0,q4_0")]
    pub types: Vec<KvType>,
    /// Positions read (the fixed text is cut to this many tokens).
    #[arg(long, default_value_t = 2048)]
    pub tokens: usize,
    /// Threads per engine.
    #[arg(long, default_value_t = 1)]
    pub threads: i32,
}

/// The fixed text: varied English prose, long enough for any `--tokens` here.
pub(crate) fn text() -> String {
    let sentences = [
        "The harbour wakes before the town does, and the first boats leave in the dark.",
        "A ledger kept by the lighthouse keeper lists every ship that passed in 1887.",
        "Rain moved across the hills in long grey sheets while the market packed up early.",
        "She counted the steps to the top of the tower: one hundred and twelve, then a door.",
        "Engineers argued for weeks about whether the bridge should be painted red or green.",
        "In the library, a map of the old coastline showed villages that are now under water.",
        "The recipe called for three eggs, a cup of flour, and more patience than he had.",
        "By noon the wind had turned, and the sailors changed course for the northern bay.",
    ];
    (0..400)
        .map(|i| {
            let s = sentences[(i * 5 + i / 8) % sentences.len()];
            format!("{s} (Entry {i}.)")
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// What one type measured against f16.
#[derive(Debug, Default)]
struct Quality {
    positions: usize,
    kl_sum: f64,
    kl_max: f64,
    kl: Vec<f64>,
    top1_same: usize,
}

/// KL(P || Q) = sum p (log p - log q) of two log-probability vectors (floored at 0: a
/// rounding below it is no divergence).
pub(crate) fn kl(p: &[f32], q: &[f32]) -> f64 {
    let kl: f64 = p
        .iter()
        .zip(q)
        .map(|(lp, lq)| f64::from(lp.exp()) * f64::from(lp - lq))
        .sum();
    kl.max(0.0)
}

pub(crate) fn argmax(v: &[f32]) -> usize {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best
}

async fn engine(model: &PathBuf, n_ctx: u32, threads: i32, kv: KvType) -> anyhow::Result<Engine> {
    let mut cfg = EngineConfig::new(model);
    cfg.n_ctx = n_ctx;
    cfg.n_threads = threads;
    cfg.flash_attn = FlashAttn::On;
    cfg.cache_type_k = kv;
    cfg.cache_type_v = kv;
    cfg.n_parallel = 1;
    Ok(Engine::start(cfg).await?)
}

/// Measures each type and prints a Markdown table.
///
/// # Errors
/// Model load or engine failures, or a text shorter than `--tokens`.
pub async fn run(args: &QualityArgs) -> anyhow::Result<()> {
    let n_ctx = u32::try_from(args.tokens + 64)?;
    let reference = engine(&args.model, n_ctx, args.threads, KvType::F16).await?;
    let all = reference.tokenize(Input::Raw(text())).await?;
    anyhow::ensure!(
        all.len() >= args.tokens,
        "the fixed text has {} tokens, fewer than --tokens {}",
        all.len(),
        args.tokens
    );
    let tokens = all[..args.tokens].to_vec();
    let model = args
        .model
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    println!(
        "KV cache type against f16, {model}, {} positions of a fixed text, flash attention on:\n",
        tokens.len()
    );
    println!("| type | mean KL divergence | p99 KL | max KL | top-1 agreement |");
    println!("|---|---|---|---|---|");
    for kv in &args.types {
        let test = engine(&args.model, n_ctx, args.threads, *kv).await?;
        let mut a = reference.score(tokens.clone(), 0, None).await?;
        let mut b = test.score(tokens.clone(), 0, None).await?;
        let mut q = Quality::default();
        loop {
            let (p, t) = match (a.recv().await, b.recv().await) {
                (Some(p), Some(t)) => (p?, t?),
                (None, None) => break,
                _ => anyhow::bail!("the two engines scored different numbers of positions"),
            };
            // P the f16 reference.
            let kl = kl(&p, &t);
            q.positions += 1;
            q.kl_sum += kl;
            q.kl_max = q.kl_max.max(kl);
            q.kl.push(kl);
            q.top1_same += usize::from(argmax(&p) == argmax(&t));
        }
        anyhow::ensure!(
            q.positions == tokens.len(),
            "scored {} positions",
            q.positions
        );
        q.kl.sort_by(f64::total_cmp);
        let p99 = q.kl[(q.kl.len() * 99 / 100).min(q.kl.len() - 1)];
        println!(
            "| {kv:?} | {:.6} | {:.6} | {:.4} | {:.2}% |",
            q.kl_sum / q.positions as f64,
            p99,
            q.kl_max,
            100.0 * q.top1_same as f64 / q.positions as f64
        );
    }
    Ok(())
}
