//! `edgesplit-bench handoff`: where a handoff's time goes, on loopback with no link
//! emulation (our own CPU work is what is measured), beside the original EdgeSplit's V1
//! path in the same run: a stock llama-server pair, slot save to a file on one, an HTTP
//! upload of the file to the other's slot folder, slot restore there.
//!
//! Each round asks the same prompt of every path, in an order that rotates from round to
//! round; one warm-up round is not counted. Ours: a split request with 2 output tokens (one
//! from the prefill node, one after the handoff), `v1`, and `v2` with the `after` handoff
//! (the whole state in one frame: the path whose speed is the question); the parts come
//! from the response's `edgesplit` object. The original: the wall time of each of its
//! three steps as a client sees them. The upload is ours (reqwest streaming the file to an
//! axum handler writing it into the slot folder, no fsync), in Rust: no slower than the
//! Python service the original used, so the baseline is not flattered.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use serde_json::{json, Value};

use crate::client::chat_messages;
use crate::stack::{Stack, StackConfig};
use crate::stock::{self, StockServer};

/// Options of the handoff benchmark.
#[derive(clap::Args, Debug)]
pub struct HandoffArgs {
    #[command(flatten)]
    pub devices: crate::devices::DeviceArgs,
    /// `smollm2`, `gemma3` or a GGUF path.
    #[arg(long, default_value = "smollm2")]
    pub model: String,
    /// Approximate prompt length in tokens.
    #[arg(long, default_value_t = 2000)]
    pub prompt_tokens: usize,
    /// Counted rounds (after one warm-up round).
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// Context size of every server.
    #[arg(long, default_value_t = 4096)]
    pub n_ctx: u32,
    /// Threads per server (default: physical cores).
    #[arg(long)]
    pub threads: Option<i32>,
    /// Output folder (default: bench/results/handoff-<unix time>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Also run a second stack whose services share a secret (private links: TLS keyed by
    /// it) and measure its `v1-private` and `v2-private` paths against the plain ones.
    #[arg(long)]
    pub private: bool,
}

/// One path's handoff in one round: its parts in ms, and the total on its critical path.
#[derive(Debug, Clone, serde::Serialize)]
struct Sample {
    path: &'static str,
    round: usize,
    bytes: u64,
    /// (part, ms), in the order they happen.
    parts: Vec<(&'static str, f64)>,
    total_ms: f64,
    /// Ours: the request's time to first token (the router's figure).
    ttft_ms: Option<f64>,
}

/// The paths measured, in the order of the first round (the private ones with
/// `--private`).
const PATHS: [&str; 5] = ["original", "v1", "v2", "v1-private", "v2-private"];

/// Our parts, as the `edgesplit` object names them. `handoff_ms` runs from the connect (V2)
/// or the request (V1) to the receiver's acknowledgement; the hashing and the receiver's
/// parts overlap it.
const OURS: [(&str, &str); 7] = [
    ("export", "export_ms"),
    ("send (connect to ACK)", "handoff_ms"),
    ("of which connect", "handoff_connect_ms"),
    ("of which sender hash", "handoff_hash_ms"),
    ("receive", "receive_ms"),
    ("of which verify", "verify_ms"),
    ("import", "import_ms"),
];

/// Runs the benchmark and writes `summary.md` and `samples.json`.
///
/// # Errors
/// A server that does not start, a request that fails, or files that cannot be written.
pub async fn run(args: &HandoffArgs) -> anyhow::Result<()> {
    let repo = crate::repo_root();
    let model = crate::model_path(&args.model);
    let threads = args
        .threads
        .unwrap_or_else(edgesplit_engine::default_threads);
    let out = crate::results_dir(args.out.as_deref(), "handoff")?;
    let bin = tokio::task::spawn_blocking(move || stock::build(&repo)).await??;

    let cfg = StackConfig {
        phone_speed: args.devices.phone_speed,
        direct: true,
        ..StackConfig::new(model.clone(), args.n_ctx, threads, out.join("services"))
    };
    let loopback = || crate::link::Profile::named("loopback").expect("a profile");
    let stack = Stack::start(&cfg, loopback()).await?;
    let private = if args.private {
        let secret: String = (0..32)
            .map(|_| format!("{:02x}", rand::random::<u8>()))
            .collect();
        let cfg = StackConfig {
            dir: out.join("services-private"),
            secret: Some(secret),
            ..cfg.clone()
        };
        Some(Stack::start(&cfg, loopback()).await?)
    } else {
        None
    };
    let paths: Vec<&'static str> = PATHS
        .into_iter()
        .filter(|p| private.is_some() || !p.ends_with("-private"))
        .collect();
    let (dir_a, dir_b) = (out.join("slots-a"), out.join("slots-b"));
    std::fs::create_dir_all(&dir_a)?;
    std::fs::create_dir_all(&dir_b)?;
    let fa = stack.flash_attn;
    let a =
        StockServer::start_with(&bin, &model, args.n_ctx, threads, fa, "f16", Some(&dir_a)).await?;
    let b =
        StockServer::start_with(&bin, &model, args.n_ctx, threads, fa, "f16", Some(&dir_b)).await?;
    let upload = Uploads::start(dir_b.clone()).await?;
    let http = reqwest::Client::new();
    let prompt = crate::client::prompt(args.prompt_tokens);

    let mut samples = Vec::new();
    for round in 0..=args.rounds {
        for k in 0..paths.len() {
            let path = paths[(k + round) % paths.len()];
            let s = match (path, &private) {
                ("original", _) => original(&http, &a, &b, &upload, &dir_a, &prompt, round).await,
                ("v1-private" | "v2-private", Some(p)) => {
                    edgesplit(&http, &p.router, path, &prompt, round).await
                }
                (ours, _) => edgesplit(&http, &stack.router, ours, &prompt, round).await,
            }
            .with_context(|| format!("round {round}, {path}"))?;
            eprintln!(
                "round {round} {path}: {:.1} ms, {:.1} MB",
                s.total_ms,
                s.bytes as f64 / 1e6
            );
            // Round 0 warms every path up and is not counted.
            if round > 0 {
                samples.push(s);
            }
        }
    }
    // The private links' cost on a short request's TTFT: alternating split requests of a
    // ~20-token prompt on the plain and the private stack (kept-alive connections, as a
    // client's and the router's are), after one warm-up pair.
    let mut ttft_pairs = Vec::new();
    if let Some(p) = &private {
        for k in 0..=SHORT_PAIRS {
            let order = if k % 2 == 0 {
                [&stack.router, &p.router]
            } else {
                [&p.router, &stack.router]
            };
            let mut t = [0.0; 2];
            for (i, router) in order.into_iter().enumerate() {
                t[i] = short_ttft(&http, router).await?;
            }
            if k % 2 == 1 {
                t.swap(0, 1);
            }
            if k > 0 {
                ttft_pairs.push((t[0], t[1]));
            }
        }
    }
    let header = format!(
        "`{}`\n\n{}, prompt ~{} tokens, {} counted rounds after one warm-up, {threads} threads per server, n_ctx {}, flash attention {}.\n",
        std::env::args().collect::<Vec<_>>().join(" "),
        model.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned()),
        args.prompt_tokens,
        args.rounds,
        args.n_ctx,
        if fa { "on" } else { "off" },
    );
    let mut md = summary(&header, &samples);
    short_ttft_summary(&mut md, &ttft_pairs);
    std::fs::write(out.join("summary.md"), &md)?;
    std::fs::write(
        out.join("samples.json"),
        serde_json::to_string_pretty(&samples)?,
    )?;
    println!("{md}\noutputs: {}", out.display());
    Ok(())
}

/// A non-streamed chat completion's response.
async fn chat(http: &reqwest::Client, router: &str, body: &Value) -> anyhow::Result<Value> {
    Ok(http
        .post(format!("{router}/v1/chat/completions"))
        .json(body)
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?)
}

/// Pairs of short requests (plain, private) for the TTFT cost of private links.
const SHORT_PAIRS: usize = 30;

/// The router's TTFT of a short greedy `v2` request (2 output tokens).
async fn short_ttft(http: &reqwest::Client, router: &str) -> anyhow::Result<f64> {
    let body = json!({
        "messages": [{"role": "user", "content": "Name three colours of the rainbow, please."}],
        "max_tokens": 2, "temperature": 0, "edgesplit": {"transport": "v2"},
    });
    let v = chat(http, router, &body).await?;
    v["edgesplit"]["ttft_ms"]
        .as_f64()
        .with_context(|| format!("no ttft_ms: {v}"))
}

fn short_ttft_summary(md: &mut String, pairs: &[(f64, f64)]) {
    use std::fmt::Write;
    if pairs.is_empty() {
        return;
    }
    let sorted = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v
    };
    let plain = sorted(pairs.iter().map(|p| p.0).collect());
    let private = sorted(pairs.iter().map(|p| p.1).collect());
    let diff = sorted(pairs.iter().map(|p| p.1 - p.0).collect());
    let med = |v: &[f64]| v[v.len() / 2];
    let _ = writeln!(
        md,
        "\nShort request (~20-token prompt, `v2`, 2 tokens), {} alternating pairs: TTFT median plain {:.1} ms, private {:.1} ms; private - plain per pair: median {:+.2} ms (quartiles {:+.2} / {:+.2})",
        pairs.len(),
        med(&plain),
        med(&private),
        med(&diff),
        diff[diff.len() / 4],
        diff[diff.len() * 3 / 4],
    );
}

/// One split request of ours; its parts from the `edgesplit` object.
async fn edgesplit(
    http: &reqwest::Client,
    router: &str,
    path: &'static str,
    prompt: &str,
    round: usize,
) -> anyhow::Result<Sample> {
    let transport = path.trim_end_matches("-private");
    let mut edgesplit = json!({"transport": transport});
    if transport == "v2" {
        edgesplit["handoff"] = json!("after");
    }
    let body = json!({
        "messages": chat_messages(prompt), "max_tokens": 2, "temperature": 0, "seed": 42,
        "edgesplit": edgesplit, "cache_prompt": false,
    });
    let v = chat(http, router, &body).await?;
    let es = &v["edgesplit"];
    let bytes = es["handoff_bytes"]
        .as_u64()
        .filter(|b| *b > 0)
        .with_context(|| format!("no handoff in the answer: {es}"))?;
    let parts: Vec<(&str, f64)> = OURS
        .iter()
        .filter_map(|(name, field)| Some((*name, es[*field].as_f64()?)))
        .collect();
    let part = |n: &str| parts.iter().find(|(p, _)| *p == n).map_or(0.0, |(_, v)| *v);
    let total_ms = part("export") + part("send (connect to ACK)") + part("import");
    Ok(Sample {
        path,
        round,
        bytes,
        parts,
        total_ms,
        ttft_ms: es["ttft_ms"].as_f64(),
    })
}

/// The original's V1: stock slot save on `a`, HTTP upload to `b`'s slot folder, stock slot
/// restore on `b`; each step's wall time.
async fn original(
    http: &reqwest::Client,
    a: &StockServer,
    b: &StockServer,
    upload: &Uploads,
    dir_a: &Path,
    prompt: &str,
    round: usize,
) -> anyhow::Result<Sample> {
    let body = json!({
        "messages": chat_messages(prompt), "max_tokens": 1, "temperature": 0, "seed": 42,
        // Keep the prompt's KV in the slot for the save (and prefill it anew each round).
        "cache_prompt": true,
    });
    http.post(format!("{}/slots/0?action=erase", a.url))
        .send()
        .await?
        .error_for_status()?;
    http.post(format!("{}/v1/chat/completions", a.url))
        .json(&body)
        .send()
        .await?
        .error_for_status()?;
    let name = format!("h{round}.bin");
    let slot = |url: &str, action: &str| {
        http.post(format!("{url}/slots/0?action={action}"))
            .json(&json!({"filename": name}))
            .send()
    };
    let t0 = Instant::now();
    let saved: Value = slot(&a.url, "save")
        .await?
        .error_for_status()?
        .json()
        .await?;
    let save = ms(t0);
    let file = dir_a.join(&name);
    let bytes = tokio::fs::metadata(&file).await?.len();
    let t0 = Instant::now();
    upload.put(http, &file, &name).await?;
    let sent = ms(t0);
    let t0 = Instant::now();
    let restored: Value = slot(&b.url, "restore")
        .await?
        .error_for_status()?
        .json()
        .await?;
    let restore = ms(t0);
    anyhow::ensure!(
        restored["n_restored"] == saved["n_saved"],
        "restored {} tokens of {}",
        restored["n_restored"],
        saved["n_saved"]
    );
    let _ = tokio::fs::remove_file(&file).await;
    let _ = tokio::fs::remove_file(upload.dir.join(&name)).await;
    Ok(Sample {
        path: "original",
        round,
        bytes,
        parts: vec![("save", save), ("upload", sent), ("restore", restore)],
        total_ms: save + sent + restore,
        ttft_ms: None,
    })
}

fn ms(t0: Instant) -> f64 {
    t0.elapsed().as_secs_f64() * 1000.0
}

/// The receiving end of the original's upload: `PUT /{name}` writes the body into `dir`.
struct Uploads {
    dir: PathBuf,
    url: String,
}

impl Uploads {
    async fn start(dir: PathBuf) -> anyhow::Result<Uploads> {
        use axum::routing::put;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        let target = Arc::new(dir.clone());
        let app = axum::Router::new()
            .route(
                "/{name}",
                put(
                    |axum::extract::State(dir): axum::extract::State<Arc<PathBuf>>,
                     axum::extract::Path(name): axum::extract::Path<String>,
                     body: axum::body::Body| async move {
                        use futures::StreamExt;
                        use tokio::io::AsyncWriteExt;
                        let write = async {
                            let mut f = tokio::fs::File::create(dir.join(name)).await?;
                            let mut s = body.into_data_stream();
                            while let Some(chunk) = s.next().await {
                                f.write_all(&chunk.map_err(std::io::Error::other)?).await?;
                            }
                            f.flush().await?;
                            Ok::<_, std::io::Error>(())
                        };
                        match write.await {
                            Ok(()) => axum::http::StatusCode::OK,
                            Err(_) => axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                        }
                    },
                ),
            )
            .with_state(target);
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Uploads { dir, url })
    }

    async fn put(&self, http: &reqwest::Client, file: &Path, name: &str) -> anyhow::Result<()> {
        let f = tokio::fs::File::open(file).await?;
        let len = f.metadata().await?.len();
        let stream = tokio_util::io::ReaderStream::with_capacity(f, 1 << 20);
        http.put(format!("{}/{name}", self.url))
            .header(reqwest::header::CONTENT_LENGTH, len)
            .body(reqwest::Body::wrap_stream(stream))
            .send()
            .await?
            .error_for_status()?;
        Ok(())
    }
}

/// The Markdown summary: each path's parts (median over rounds), and the ratios of our
/// totals to the original's, round by round.
fn summary(header: &str, samples: &[Sample]) -> String {
    use std::fmt::Write;
    let mut md = String::from(header);
    let median = |mut v: Vec<f64>| -> Option<f64> {
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        Some(v[v.len() / 2])
    };
    let _ = writeln!(md, "\n| path | MB | part | median ms |\n|---|---|---|---|");
    for path in PATHS {
        let mine: Vec<&Sample> = samples.iter().filter(|s| s.path == path).collect();
        let Some(first) = mine.first() else { continue };
        let mb = first.bytes as f64 / 1e6;
        for (part, _) in &first.parts {
            let v = mine
                .iter()
                .filter_map(|s| s.parts.iter().find(|(p, _)| p == part).map(|(_, v)| *v))
                .collect();
            let _ = writeln!(
                md,
                "| {path} | {mb:.1} | {part} | {:.1} |",
                median(v).unwrap_or(0.0)
            );
        }
        let total = median(mine.iter().map(|s| s.total_ms).collect()).unwrap_or(0.0);
        let _ = writeln!(md, "| {path} | {mb:.1} | **total** | **{total:.1}** |");
    }
    let _ = writeln!(
        md,
        "\nTotals: ours = export + send (connect to ACK) + import; the original = save + upload + restore.\n\n| ratio | rounds | median | min | max |\n|---|---|---|---|---|"
    );
    let rounds: Vec<usize> = {
        let mut r: Vec<usize> = samples.iter().map(|s| s.round).collect();
        r.dedup();
        r
    };
    let total = |path: &str, round: usize| {
        samples
            .iter()
            .find(|s| s.path == path && s.round == round)
            .map(|s| s.total_ms)
    };
    for ours in ["v1", "v2"] {
        let mut r: Vec<f64> = rounds
            .iter()
            .filter_map(|&k| Some(total(ours, k)? / total("original", k)?))
            .collect();
        r.sort_by(f64::total_cmp);
        if let (Some(lo), Some(hi)) = (r.first().copied(), r.last().copied()) {
            let _ = writeln!(
                md,
                "| {ours} / original | {} | {:.3} | {lo:.3} | {hi:.3} |",
                r.len(),
                median(r.clone()).unwrap_or(0.0)
            );
        }
    }
    // The V2 payload's throughput from connect to ACK.
    let gbps: Vec<f64> = samples
        .iter()
        .filter(|s| s.path == "v2")
        .filter_map(|s| {
            let send = s
                .parts
                .iter()
                .find(|(p, _)| *p == "send (connect to ACK)")?
                .1;
            Some(s.bytes as f64 / (send / 1000.0) / 1e9)
        })
        .collect();
    if let Some(m) = median(gbps) {
        let _ = writeln!(
            md,
            "\nV2 payload throughput, connect to ACK (median): {m:.2} GB/s"
        );
    }
    private_cost(&mut md, samples, &rounds);
    md
}

/// With `--private`: what the private links cost, per round against the plain path of the
/// same round. The send ratio is the handoff's time from connect to ACK (its inverse is the
/// throughput kept); the TTFT difference is the request's whole time to first token.
fn private_cost(md: &mut String, samples: &[Sample], rounds: &[usize]) {
    use std::fmt::Write;
    let find =
        |path: &str, round: usize| samples.iter().find(|s| s.path == path && s.round == round);
    let send = |s: &Sample| {
        s.parts
            .iter()
            .find(|(p, _)| *p == "send (connect to ACK)")
            .map(|(_, v)| *v)
    };
    let mut lines = Vec::new();
    for ours in ["v1", "v2"] {
        let private = format!("{ours}-private");
        let pairs: Vec<(&Sample, &Sample)> = rounds
            .iter()
            .filter_map(|&k| Some((find(ours, k)?, find(&private, k)?)))
            .collect();
        if pairs.is_empty() {
            continue;
        }
        let mut ratio: Vec<f64> = pairs
            .iter()
            .filter_map(|(p, q)| Some(send(q)? / send(p)?))
            .collect();
        let mut ttft: Vec<f64> = pairs
            .iter()
            .filter_map(|(p, q)| Some(q.ttft_ms? - p.ttft_ms?))
            .collect();
        ratio.sort_by(f64::total_cmp);
        ttft.sort_by(f64::total_cmp);
        let med = |v: &[f64]| v.get(v.len() / 2).copied().unwrap_or(f64::NAN);
        lines.push(format!(
            "| {ours} | {} | {:.3} ({:.3}-{:.3}) | {:.1}% | {:+.2} ({:+.2} to {:+.2}) |",
            pairs.len(),
            med(&ratio),
            ratio.first().copied().unwrap_or(f64::NAN),
            ratio.last().copied().unwrap_or(f64::NAN),
            100.0 / med(&ratio),
            med(&ttft),
            ttft.first().copied().unwrap_or(f64::NAN),
            ttft.last().copied().unwrap_or(f64::NAN),
        ));
    }
    if lines.is_empty() {
        return;
    }
    let _ = writeln!(
        md,
        "\nPrivate links (TLS keyed by the secret) against plain, same rounds:\n\n| path | rounds | send time private / plain, median (min-max) | throughput kept | TTFT private - plain, ms, median (min to max) |\n|---|---|---|---|---|"
    );
    for l in lines {
        let _ = writeln!(md, "{l}");
    }
}
