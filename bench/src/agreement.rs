//! `edgesplit-bench agreement`: how far a split answer agrees with one device's when the
//! two nodes are different CPUs (PROTOCOL.md, "Compatibility"): this machine
//! (x86_64) and the aarch64 build (`scripts/build-aarch64.sh --measure`) run under
//! `qemu-aarch64`. Not a speed figure: nothing is timed (emulation is not a phone's speed).
//!
//! Per model and KV cache type, two measurements:
//! - **Answers**, through the real services: a stack of an x86 prefill node and an
//!   aarch64 decode node answers every prompt as `x86` (the `local` transport: the x86
//!   node alone) and as `split` (V2, handoff `after`: the x86 node prefills and writes the
//!   first token, the aarch64 node every later one); a stack of two aarch64 nodes answers
//!   as `aarch64` (`local`). Greedy and seeded. Per pair of cases: the share of answers
//!   token-for-token identical and the median index of the first differing token.
//! - **Distributions**, with the engine's `score` (the `score` example, one per
//!   architecture): a fixed text's next-token distributions at `--positions` positions
//!   after `--context` tokens of context, as `x86` and `aarch64` compute them alone and as
//!   `split` (the context's KV prefilled on x86, imported on aarch64, which reads the
//!   rest). Per pair: top-1 agreement and the mean KL divergence of the second from the
//!   first.

use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::Context;
use serde_json::{json, Value};

use crate::kv_quality::{argmax, kl};
use crate::link::Profile;
use crate::stack::{Stack, StackConfig};

/// Options of the agreement measurement.
#[derive(clap::Args, Debug)]
pub struct AgreementArgs {
    /// Models: `smollm2` (chat), `gemma3` (a base model: completions) or GGUF paths.
    #[arg(long, value_delimiter = ',', default_value = "smollm2,gemma3")]
    pub models: Vec<String>,
    /// KV cache types (both nodes; K and V).
    #[arg(long, value_delimiter = ',', default_value = "f16,q8_0")]
    pub cache_types: Vec<String>,
    /// Prompts per model (of the 16 below; the last is past Gemma-3's 512-token window).
    #[arg(long, default_value_t = 16)]
    pub prompts: usize,
    /// Answer length.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: u32,
    /// Positions whose distributions are compared.
    #[arg(long, default_value_t = 256)]
    pub positions: usize,
    /// Tokens of context before them.
    #[arg(long, default_value_t = 32)]
    pub context: usize,
    /// Threads of every engine.
    #[arg(long, default_value_t = 2)]
    pub threads: i32,
    /// The aarch64 build's folder (`edgesplit-decode`, `edgesplit-prefill`,
    /// `examples/score`).
    #[arg(
        long,
        default_value = "target-aarch64/aarch64-unknown-linux-gnu/release"
    )]
    pub aarch64: PathBuf,
    /// How an aarch64 program is run here.
    #[arg(long, default_value = "qemu-aarch64")]
    pub qemu: PathBuf,
    /// Output folder (logs, results.json).
    #[arg(long, default_value = "bench/results/agreement")]
    pub out: PathBuf,
}

/// The prompts: short questions and text beginnings, then one past Gemma-3's window.
pub(crate) fn prompts() -> Vec<String> {
    let mut p: Vec<String> = [
        "Name three colours of the rainbow, then stop.",
        "Write a haiku about the sea.",
        "Explain in two sentences what a lighthouse does.",
        "List the first five prime numbers.",
        "What is the capital of France, and what is it known for?",
        "Describe a cup of coffee to someone who has never had one.",
        "Give three tips for learning to play the guitar.",
        "Once upon a time, in a village by the mountains,",
        "The recipe for a simple bread starts with",
        "Write a short letter thanking a friend for a gift.",
        "Why is the sky blue? Answer briefly.",
        "The old map showed a coastline that",
        "Translate 'good morning' into Spanish, French and German.",
        "Summarise the plot of a detective story in three sentences.",
        "In 1887, the harbour master wrote in his ledger that",
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    p.push(crate::client::prompt(560));
    p
}

fn loopback() -> Profile {
    Profile::named("loopback").expect("a named profile")
}

/// One answer through the router: `transport` (`v2` with the `after` handoff), its token
/// ids asked for; the whole response, checked to be an answer that did not fall back.
/// `cache_prompt: false` where a repeated prompt must be prefilled again.
pub(crate) async fn request(
    http: &reqwest::Client,
    stack: &Stack,
    prompt: &str,
    max_tokens: u32,
    sampling: (f64, u64),
    transport: &str,
    cache_prompt: bool,
) -> anyhow::Result<Value> {
    let mut body = json!({
        "max_tokens": max_tokens,
        "temperature": sampling.0,
        "seed": sampling.1,
        "cache_prompt": cache_prompt,
        "edgesplit": {"transport": transport, "return_token_ids": true},
    });
    if transport == "v2" {
        body["edgesplit"]["handoff"] = json!("after");
    }
    let path = if stack.chat {
        body["messages"] = crate::client::chat_messages(prompt);
        "chat/completions"
    } else {
        body["prompt"] = json!(prompt);
        "completions"
    };
    let v: Value = http
        .post(format!("{}/v1/{path}", stack.router))
        .json(&body)
        .send()
        .await?
        .json()
        .await?;
    let e = &v["edgesplit"];
    anyhow::ensure!(e.is_object(), "no answer: {v}");
    anyhow::ensure!(e["fallback"].is_null(), "the answer fell back: {v}");
    Ok(v)
}

/// An answer's token ids.
pub(crate) fn token_ids(v: &Value) -> anyhow::Result<Vec<i64>> {
    Ok(v["edgesplit"]["token_ids"]
        .as_array()
        .context("no token_ids")?
        .iter()
        .filter_map(Value::as_i64)
        .collect())
}

/// One answer's token ids and its prompt's length.
async fn answer(
    http: &reqwest::Client,
    stack: &Stack,
    prompt: &str,
    max_tokens: u32,
    sampling: (f64, u64),
    transport: &str,
) -> anyhow::Result<(Vec<i64>, u64)> {
    let v = request(http, stack, prompt, max_tokens, sampling, transport, true).await?;
    Ok((
        token_ids(&v)?,
        v["usage"]["prompt_tokens"].as_u64().unwrap_or(0),
    ))
}

/// Share identical and the first differing indices of answer pairs.
#[derive(Debug, Default, serde::Serialize)]
struct Answers {
    pairs: usize,
    identical: usize,
    first_diff: Vec<usize>,
}

impl Answers {
    fn add(&mut self, a: &[i64], b: &[i64]) {
        self.pairs += 1;
        match a.iter().zip(b).position(|(x, y)| x != y) {
            None if a.len() == b.len() => self.identical += 1,
            None => self.first_diff.push(a.len().min(b.len())),
            Some(i) => self.first_diff.push(i),
        }
    }

    fn median_first_diff(&self) -> Option<f64> {
        let mut d = self.first_diff.clone();
        d.sort_unstable();
        let n = d.len();
        (n > 0).then(|| {
            if n % 2 == 1 {
                d[n / 2] as f64
            } else {
                (d[n / 2 - 1] + d[n / 2]) as f64 / 2.0
            }
        })
    }
}

/// Top-1 agreement and mean KL over the compared positions.
#[derive(Debug, Default, serde::Serialize)]
struct Dists {
    positions: usize,
    top1_same: usize,
    kl_sum: f64,
}

/// A `score` example's output: its tokens, then one distribution per position.
struct ScoreStream {
    r: BufReader<std::fs::File>,
}

impl ScoreStream {
    fn open(path: &Path) -> anyhow::Result<(Vec<i32>, Self)> {
        let mut r = BufReader::with_capacity(1 << 20, std::fs::File::open(path)?);
        let n = read_u32(&mut r)? as usize;
        anyhow::ensure!(n <= 1 << 20, "{n} tokens");
        let mut tokens = Vec::with_capacity(n);
        for _ in 0..n {
            tokens.push(read_u32(&mut r)? as i32);
        }
        Ok((tokens, ScoreStream { r }))
    }

    /// The next position's log-probabilities; `None` at the end.
    fn next(&mut self) -> anyhow::Result<Option<Vec<f32>>> {
        let mut b = [0u8; 4];
        match self.r.read_exact(&mut b) {
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            r => r?,
        }
        let n = u32::from_le_bytes(b) as usize;
        anyhow::ensure!(n <= 1 << 22, "a vocabulary of {n}");
        let mut raw = vec![0u8; n * 4];
        self.r.read_exact(&mut raw)?;
        Ok(Some(
            raw.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ))
    }
}

fn read_u32(r: &mut impl Read) -> anyhow::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

/// Compares two score outputs: KL(first || second), top-1 agreement.
fn compare(a: &Path, b: &Path) -> anyhow::Result<Dists> {
    let (ta, mut sa) = ScoreStream::open(a)?;
    let (tb, mut sb) = ScoreStream::open(b)?;
    anyhow::ensure!(ta == tb, "the two scored different tokens");
    let mut d = Dists::default();
    loop {
        match (sa.next()?, sb.next()?) {
            (Some(p), Some(q)) => {
                anyhow::ensure!(p.len() == q.len(), "vocabularies differ");
                d.positions += 1;
                d.kl_sum += kl(&p, &q);
                d.top1_same += usize::from(argmax(&p) == argmax(&q));
            }
            (None, None) => return Ok(d),
            _ => anyhow::bail!("the two scored different numbers of positions"),
        }
    }
}

/// Runs the `score` example (`program`: this machine's, or qemu and the aarch64 one) with
/// `extra`, its output into `out`.
fn score(
    program: &[PathBuf],
    model: &Path,
    kv: &str,
    args: &AgreementArgs,
    text: &Path,
    extra: &[String],
    out: &Path,
) -> anyhow::Result<()> {
    let log = std::fs::File::create(out.with_extension("log"))?;
    let status = Command::new(&program[0])
        .args(&program[1..])
        .arg("--model")
        .arg(model)
        .args(["--cache-type", kv, "--threads", &args.threads.to_string()])
        .arg("--text-file")
        .arg(text)
        .args([
            "--tokens",
            &(args.context + args.positions).to_string(),
            "--from",
            &args.context.to_string(),
        ])
        .args(extra)
        .stdout(std::fs::File::create(out)?)
        .stderr(log)
        .status()?;
    anyhow::ensure!(
        status.success(),
        "score failed ({status}); see {}",
        out.with_extension("log").display()
    );
    Ok(())
}

/// Runs the measurement and prints Markdown tables; writes results.json to `--out`.
///
/// # Errors
/// A missing build, a service or score run that fails, an answer that fell back.
pub async fn run(args: &AgreementArgs) -> anyhow::Result<()> {
    let arm = |name: &str| -> anyhow::Result<Vec<PathBuf>> {
        let bin = args.aarch64.join(name);
        anyhow::ensure!(
            bin.is_file(),
            "{} missing: run scripts/build-aarch64.sh --measure",
            bin.display()
        );
        Ok(vec![args.qemu.clone(), bin])
    };
    let native_score = std::env::current_exe()?
        .parent()
        .map(|d| d.join("examples/score"))
        .filter(|p| p.is_file())
        .context("target/release/examples/score missing: cargo build --release --examples")?;
    let (arm_decode, arm_prefill, arm_score) = (
        arm("edgesplit-decode")?,
        arm("edgesplit-prefill")?,
        arm("examples/score")?,
    );
    std::fs::create_dir_all(&args.out)?;
    let text = args.out.join("text.txt");
    std::fs::write(&text, crate::kv_quality::text())?;
    let prompts: Vec<String> = prompts()
        .into_iter()
        .rev()
        .take(args.prompts)
        .rev()
        .collect();
    let http = reqwest::Client::new();
    let mut results = Vec::new();
    println!(
        "Agreement across architectures (x86_64 here, aarch64 under qemu); {} prompts, greedy \
         and seeded, {} answer tokens; {} scored positions after {} of context.\n",
        prompts.len(),
        args.max_tokens,
        args.positions,
        args.context
    );
    println!(
        "| model | KV | compared | answers identical | median first difference | top-1 agreement | mean KL |"
    );
    println!("|---|---|---|---|---|---|---|");
    for name in &args.models {
        let model = crate::model_path(name);
        let model_name = model
            .file_stem()
            .map_or_else(String::new, |s| s.to_string_lossy().into_owned());
        for kv in &args.cache_types {
            let dir = args.out.join(format!("{model_name}-{kv}"));
            let cfg = |decode: &[PathBuf], prefill: Option<&[PathBuf]>, tag: &str| {
                let mut c = StackConfig::new(model.clone(), 2048, args.threads, dir.join(tag));
                c.direct = true;
                c.flash_attn = "on".into();
                c.cache_type = kv.clone();
                c.decode_program = Some(decode.to_vec());
                c.prefill_program = prefill.map(<[PathBuf]>::to_vec);
                // An emulated node prefills a long prompt in minutes, not seconds, and may
                // write a token a minute while other work holds the machine's cores.
                c.router_extra = ["--first-token-timeout-s", "3600"]
                    .into_iter()
                    .chain(["--token-idle-timeout-ms", "3600000"])
                    .map(String::from)
                    .collect();
                c
            };
            // Answers: x86 alone and split on one stack, aarch64 alone on another.
            let mut ids: [Vec<Vec<i64>>; 3] = Default::default();
            let mut longest_prompt = 0;
            let sampling: Vec<(f64, u64)> = vec![(0.0, 1), (0.8, 7)];
            {
                let s = Stack::start(&cfg(&arm_decode, None, "x86-prefill"), loopback()).await?;
                for p in &prompts {
                    for &sm in &sampling {
                        let (a, n) = answer(&http, &s, p, args.max_tokens, sm, "local").await?;
                        longest_prompt = longest_prompt.max(n);
                        ids[0].push(a);
                        ids[1].push(answer(&http, &s, p, args.max_tokens, sm, "v2").await?.0);
                    }
                }
            }
            {
                let s = Stack::start(
                    &cfg(&arm_decode, Some(&arm_prefill), "aarch64-prefill"),
                    loopback(),
                )
                .await?;
                for p in &prompts {
                    for &sm in &sampling {
                        ids[2].push(answer(&http, &s, p, args.max_tokens, sm, "local").await?.0);
                    }
                }
            }
            // Distributions: x86 alone, aarch64 alone, x86's context imported on aarch64.
            let native = vec![native_score.clone()];
            let f = |n: &str| dir.join(format!("score-{n}.bin"));
            let state = dir.join("context.state");
            score(&native, &model, kv, args, &text, &[], &f("x86"))?;
            score(&arm_score, &model, kv, args, &text, &[], &f("aarch64"))?;
            let export = vec!["--export".to_string(), state.display().to_string()];
            score(&native, &model, kv, args, &text, &export, &f("export"))?;
            let import = vec!["--import".to_string(), state.display().to_string()];
            score(&arm_score, &model, kv, args, &text, &import, &f("split"))?;
            for (label, (a, b)) in [
                ("x86 vs aarch64", (0, 2)),
                ("split vs x86", (0, 1)),
                ("split vs aarch64", (2, 1)),
            ] {
                let mut ans = Answers::default();
                for (x, y) in ids[a].iter().zip(&ids[b]) {
                    ans.add(x, y);
                }
                let names = ["x86", "split", "aarch64"];
                let d = compare(&f(names[a]), &f(names[b]))?;
                println!(
                    "| {model_name} | {kv} | {label} | {}/{} | {} | {:.2}% | {:.6} |",
                    ans.identical,
                    ans.pairs,
                    ans.median_first_diff()
                        .map_or("-".to_string(), |m| format!("{m}")),
                    100.0 * d.top1_same as f64 / d.positions.max(1) as f64,
                    d.kl_sum / d.positions.max(1) as f64,
                );
                results.push(json!({
                    "model": model_name, "kv": kv, "compared": label,
                    "answers": ans, "median_first_diff": ans.median_first_diff(),
                    "distributions": d, "longest_prompt_tokens": longest_prompt,
                }));
            }
            for n in ["x86", "aarch64", "split", "export"] {
                let _ = std::fs::remove_file(f(n));
            }
        }
    }
    std::fs::write(
        args.out.join("results.json"),
        serde_json::to_string_pretty(&results)?,
    )?;
    Ok(())
}
