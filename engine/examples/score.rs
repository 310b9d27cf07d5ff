//! `score`: one engine's next-token distributions over a fixed text, for
//! `edgesplit-bench agreement` (how far two devices agree; docs/BENCHMARKS.md). Built for
//! this machine (`cargo build --release --examples`) and for aarch64
//! (`scripts/build-aarch64.sh --measure`), so that each architecture computes its own.
//!
//! Reads `--text-file`, tokenizes it as a raw prompt and keeps its first `--tokens`, then:
//! - `--export STATE`: prefills the first `--from` tokens and writes their KV state
//!   (`Export::Raw`) to STATE; nothing else.
//! - otherwise (with `--import STATE`: that state stands for the first `--from` tokens,
//!   which are then not read): scores the text.
//!
//! Writes to stdout, little-endian: `u32 n`, the `n` token ids (`i32`); then, unless
//! exporting, for each position `i` in `from..n`, `u32 n_vocab` and the `n_vocab`
//! log-probabilities (`f32`) of the token after `i`.

use std::io::Write;
use std::path::PathBuf;

use clap::Parser;
use edgesplit_engine::{
    Engine, EngineConfig, Export, Exported, FlashAttn, Input, KvType, SamplingParams,
};

#[derive(Parser, Debug)]
struct Args {
    #[arg(long)]
    model: PathBuf,
    /// K and V cache type.
    #[arg(long, default_value = "f16")]
    cache_type: KvType,
    #[arg(long, default_value_t = 1)]
    threads: i32,
    #[arg(long)]
    text_file: PathBuf,
    /// Tokens of the text kept.
    #[arg(long)]
    tokens: usize,
    /// Positions before this one are context, not scored.
    #[arg(long)]
    from: usize,
    #[arg(long, conflicts_with = "import")]
    export: Option<PathBuf>,
    #[arg(long)]
    import: Option<PathBuf>,
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    let mut cfg = EngineConfig::new(&a.model);
    cfg.n_ctx = u32::try_from(a.tokens + 64)?;
    cfg.n_threads = a.threads;
    cfg.flash_attn = FlashAttn::On;
    cfg.cache_type_k = a.cache_type;
    cfg.cache_type_v = a.cache_type;
    cfg.n_parallel = 1;
    let engine = Engine::start(cfg).await?;
    let text = std::fs::read_to_string(&a.text_file)?;
    let all = engine.tokenize(Input::Raw(text)).await?;
    anyhow::ensure!(
        all.len() >= a.tokens && a.from > 0 && a.from < a.tokens,
        "the text has {} tokens; want --tokens {} and 0 < --from {} < --tokens",
        all.len(),
        a.tokens,
        a.from
    );
    let tokens = all[..a.tokens].to_vec();
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    out.write_all(&u32::try_from(tokens.len())?.to_le_bytes())?;
    for t in &tokens {
        out.write_all(&t.to_le_bytes())?;
    }
    if let Some(path) = &a.export {
        let p = engine
            .prefill(
                tokens[..a.from].to_vec(),
                SamplingParams::default(),
                2,
                Export::Raw,
            )
            .await?;
        let Some(Exported::Raw(state)) = p.state else {
            anyhow::bail!("the prefill exported no state");
        };
        std::fs::write(path, state)?;
        out.flush()?;
        return Ok(());
    }
    let prefix = a.import.as_ref().map(std::fs::read).transpose()?;
    let mut rx = engine.score(tokens, a.from, prefix).await?;
    while let Some(lp) = rx.recv().await {
        let lp = lp?;
        out.write_all(&u32::try_from(lp.len())?.to_le_bytes())?;
        for x in &lp {
            out.write_all(&x.to_le_bytes())?;
        }
    }
    out.flush()?;
    Ok(())
}
