//! `edgesplit-bench chat`: a multi-turn conversation. A fixed script of user
//! turns - a long first message, then about `--turn-tokens` of new text each turn - is
//! played through three clients side by side, each keeping its own history (its own
//! answers as the assistant messages):
//! - `reuse`: split (`v2`) with the nodes' caches (`cache_prompt` on): from turn 2 the
//!   decode node continues the conversation it holds;
//! - `no-reuse`: split with `cache_prompt: false`: every turn prefilled whole and its
//!   whole state handed over (a router that does not continue conversations);
//! - `local`: one device continuing its own conversation (`cache_prompt` on), the
//!   reference for the answers and for TTFT.
//!
//! Per turn: TTFT, prompt tokens, tokens reused, where the prompt was prefilled, handoff
//! bytes; medians over `--rounds` (the clients' order rotates each turn). A `reuse` answer
//! that is not the `local` answer is a fidelity failure, counted. Both nodes run with
//! `--parallel 4`, so the three conversations do not push each other out of the caches.

use std::path::PathBuf;

use anyhow::Context;
use serde_json::{json, Value};

use crate::client::{self, Ask, Measure, Target};
use crate::link::Profile;
use crate::stack::{Stack, StackConfig};

/// Options of the conversation benchmark.
#[derive(clap::Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub devices: crate::devices::DeviceArgs,
    /// `smollm2` or a GGUF path of a model with a chat template.
    #[arg(long, default_value = "smollm2")]
    pub model: String,
    /// Link profiles between the laptop side and the phone side.
    #[arg(long, value_delimiter = ',', default_value = "wifi", value_parser = Profile::parse)]
    pub profiles: Vec<Profile>,
    /// Turns of the conversation.
    #[arg(long, default_value_t = 8)]
    pub turns: usize,
    /// Approximate tokens of the first user message.
    #[arg(long, default_value_t = 700)]
    pub first_turn_tokens: usize,
    /// Approximate tokens of each later user message.
    #[arg(long, default_value_t = 200)]
    pub turn_tokens: usize,
    /// Each answer's max_tokens.
    #[arg(long, default_value_t = 48)]
    pub max_tokens: u32,
    /// The split clients' handoff mode: `live` (the default's) or `after`.
    #[arg(long, default_value = "live")]
    pub handoff: String,
    /// The router's `--continue-on`: `measured` (the default's), or `prefill-node` (every
    /// new turn prefilled on the prefill node, only its new part's KV crossing, as where
    /// the prefill device is much the faster).
    #[arg(long, default_value = "measured")]
    pub continue_on: String,
    /// Conversations played per client (their medians are reported).
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    #[arg(long, default_value_t = 4096)]
    pub n_ctx: u32,
    /// Threads per server (default: physical cores).
    #[arg(long)]
    pub threads: Option<i32>,
    /// Output folder (default: bench/results/chat-<unix time>).
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// The three clients: name, whether split, `cache_prompt`.
const CLIENTS: [(&str, bool, bool); 3] = [
    ("reuse", true, true),
    ("no-reuse", true, false),
    ("local", false, true),
];

/// One turn of one client.
#[derive(Debug, Clone, serde::Serialize)]
struct TurnSample {
    profile: String,
    round: usize,
    turn: usize,
    client: &'static str,
    #[serde(flatten)]
    measure: Measure,
    /// `reuse` only: state bytes that crossed after this turn's answer, for the decode
    /// node to keep the conversation (a live answer that ended on the prefill node; the
    /// prefill node's `v2-kept` handoff bytes until the client's next turn).
    kept_bytes: Option<u64>,
}

/// The prefill node's `v2-kept` handoff bytes so far.
pub(crate) async fn kept_bytes(http: &reqwest::Client, stack: &Stack) -> anyhow::Result<u64> {
    let text = http
        .get(&stack.prefill_metrics)
        .send()
        .await?
        .text()
        .await?;
    Ok(text
        .lines()
        .find_map(|l| l.strip_prefix("edgesplit:handoff_bytes_total{transport=\"v2-kept\"} "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0))
}

/// The `v2-kept` bytes once no state has crossed for 2 s (at most 60 s): what the last
/// turn left crossing in the background.
pub(crate) async fn settled_kept_bytes(
    http: &reqwest::Client,
    stack: &Stack,
) -> anyhow::Result<u64> {
    let t0 = std::time::Instant::now();
    let mut last = kept_bytes(http, stack).await?;
    loop {
        tokio::time::sleep(std::time::Duration::from_secs(2)).await;
        let now = kept_bytes(http, stack).await?;
        if now == last || t0.elapsed() > std::time::Duration::from_secs(60) {
            return Ok(now);
        }
        last = now;
    }
}

/// The user's message of turn `turn` (1-based) of conversation `round`: readings of a
/// weather log, then a question (each round's first message its own, so nothing of it is
/// cached from the round before).
pub(crate) fn user_message(
    round: usize,
    turn: usize,
    first_tokens: usize,
    tokens: usize,
) -> String {
    if turn == 1 {
        return format!("Station {round}. {}", client::prompt(first_tokens));
    }
    // About 21 tokens per line, as `client::prompt`.
    let lines = (tokens.saturating_sub(20) / 21).max(1);
    let log = client::weather_log(1000 * turn, lines);
    format!("More readings: {log}\nWhich day of these was the windiest?")
}

/// Runs the benchmark and writes `summary.md` and `turns.json`.
///
/// # Errors
/// The stack does not start, a request fails, or the files cannot be written.
pub async fn run(args: &ChatArgs) -> anyhow::Result<()> {
    let threads = args
        .threads
        .unwrap_or_else(edgesplit_engine::default_threads);
    let out = crate::results_dir(args.out.as_deref(), "chat")?;
    let first = args.profiles.first().context("no link profile")?.clone();
    let cfg = StackConfig {
        phone_speed: args.devices.phone_speed,
        parallel: Some(4),
        continue_on: args.continue_on.clone(),
        ..StackConfig::new(
            crate::model_path(&args.model),
            args.n_ctx,
            threads,
            out.join("services"),
        )
    };
    let stack = Stack::start(&cfg, first).await?;
    anyhow::ensure!(
        stack.chat,
        "the model has no chat template: a conversation needs one"
    );
    let http = reqwest::Client::new();
    let mut samples: Vec<TurnSample> = Vec::new();
    let mut differing = 0usize;
    for profile in &args.profiles {
        stack.set_profile(profile);
        for round in 0..args.rounds {
            let mut histories: Vec<Vec<Value>> = vec![Vec::new(); CLIENTS.len()];
            // The `reuse` client's latest turn (its sample) and the kept bytes before it.
            let mut reuse_turn: Option<(usize, u64)> = None;
            for turn in 1..=args.turns {
                let message = user_message(round, turn, args.first_turn_tokens, args.turn_tokens);
                let mut texts: Vec<Option<String>> = vec![None; CLIENTS.len()];
                for k in 0..CLIENTS.len() {
                    let c = (k + turn + round) % CLIENTS.len();
                    let (name, split, cache_prompt) = CLIENTS[c];
                    let transport = if split {
                        format!("v2-{}", args.handoff)
                    } else {
                        "local".into()
                    };
                    histories[c].push(json!({"role": "user", "content": message}));
                    let ask = Ask {
                        prompt: String::new(),
                        max_tokens: args.max_tokens,
                        chat: true,
                        seed: 42,
                        messages: Some(Value::Array(histories[c].clone())),
                        cache_prompt,
                    };
                    let target = Target::EdgeSplit {
                        url: stack.router.clone(),
                        transport,
                    };
                    let kept_before = if name == "reuse" {
                        let now = kept_bytes(&http, &stack).await?;
                        if let Some((i, before)) = reuse_turn.take() {
                            samples[i].kept_bytes = Some(now - before);
                        }
                        Some(now)
                    } else {
                        None
                    };
                    let m = client::run(&http, &target, &ask).await.with_context(|| {
                        format!("{} round {round} turn {turn} {name}", profile.name)
                    })?;
                    eprintln!(
                        "{} round {round} turn {turn} {name}: ttft {:.0} ms, prompt {} (cached {}), {} bytes, {}",
                        profile.name,
                        m.ttft_ms,
                        m.prompt_tokens,
                        m.cached_tokens.unwrap_or(0),
                        m.handoff_bytes.unwrap_or(0),
                        m.placement.as_deref().unwrap_or("-")
                    );
                    histories[c].push(json!({"role": "assistant", "content": m.text}));
                    texts[c] = Some(m.text.clone());
                    if let Some(before) = kept_before {
                        reuse_turn = Some((samples.len(), before));
                    }
                    samples.push(TurnSample {
                        profile: profile.name.clone(),
                        round,
                        turn,
                        client: name,
                        measure: m,
                        kept_bytes: None,
                    });
                }
                if texts[0] != texts[2] {
                    differing += 1;
                    eprintln!("turn {turn}: the reuse answer is not the local one");
                }
            }
            if let Some((i, before)) = reuse_turn.take() {
                samples[i].kept_bytes = Some(settled_kept_bytes(&http, &stack).await? - before);
            }
        }
    }
    let summary = summarise(args, &samples, differing, stack.kv_bytes_per_token);
    println!("{summary}");
    std::fs::write(out.join("summary.md"), &summary)?;
    std::fs::write(
        out.join("turns.json"),
        serde_json::to_string_pretty(&samples)?,
    )?;
    eprintln!("written to {}", out.display());
    Ok(())
}

pub(crate) fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    Some(crate::stats::percentile(&v, 0.5))
}

/// The per-turn table of each profile: medians over the rounds, and the targets.
fn summarise(
    args: &ChatArgs,
    samples: &[TurnSample],
    differing: usize,
    kv_bytes_per_token: u64,
) -> String {
    let mut s = format!(
        "# Conversation: {} turns ({} then ~{} tokens a turn, {} answer tokens), {} rounds, \
         `{}` handoff, `--continue-on {}`\n\n\
         Answers of `reuse` that are not `local`'s: {differing}\n",
        args.turns,
        args.first_turn_tokens,
        args.turn_tokens,
        args.max_tokens,
        args.rounds,
        args.handoff,
        args.continue_on
    );
    for profile in &args.profiles {
        s.push_str(&format!(
            "\n## {}\n\n| turn | prompt tokens | reused | placement | bytes reuse | of which kept after | bytes no-reuse | state bytes | bytes ratio | TTFT reuse ms | TTFT no-reuse ms | TTFT local ms | TTFT reuse / local |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
            profile.name
        ));
        for turn in 1..=args.turns {
            let of = |client: &str, f: &dyn Fn(&Measure) -> Option<f64>| {
                median(
                    samples
                        .iter()
                        .filter(|x| {
                            x.profile == profile.name && x.turn == turn && x.client == client
                        })
                        .filter_map(|x| f(&x.measure))
                        .collect(),
                )
            };
            let bytes = |m: &Measure| Some(m.handoff_bytes.unwrap_or(0) as f64);
            let ttft = |m: &Measure| Some(m.ttft_ms);
            // What crossed for the turn: its handoff, and the state kept after its answer.
            let moved = median(
                samples
                    .iter()
                    .filter(|x| x.profile == profile.name && x.turn == turn && x.client == "reuse")
                    .map(|x| {
                        (x.measure.handoff_bytes.unwrap_or(0) + x.kept_bytes.unwrap_or(0)) as f64
                    })
                    .collect(),
            );
            let kept = median(
                samples
                    .iter()
                    .filter(|x| x.profile == profile.name && x.turn == turn && x.client == "reuse")
                    .filter_map(|x| x.kept_bytes.map(|b| b as f64))
                    .collect(),
            );
            // A full handoff of the turn's prompt (a live one overtaken by its answer
            // reports no bytes, so this is counted, not measured).
            let state = of("reuse", &|m| {
                Some((m.prompt_tokens * kv_bytes_per_token) as f64)
            });
            let (t_reuse, t_local) = (of("reuse", &ttft), of("local", &ttft));
            let placement = samples
                .iter()
                .find(|x| x.profile == profile.name && x.turn == turn && x.client == "reuse")
                .and_then(|x| x.measure.placement.clone())
                .unwrap_or_default();
            let f =
                |v: Option<f64>, digits: usize| v.map_or("-".into(), |v| format!("{v:.digits$}"));
            let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
                (Some(a), Some(b)) if b > 0.0 => format!("{:.3}", a / b),
                _ => "-".into(),
            };
            s.push_str(&format!(
                "| {turn} | {} | {} | {placement} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
                f(of("reuse", &|m| Some(m.prompt_tokens as f64)), 0),
                f(of("reuse", &|m| m.cached_tokens.map(|c| c as f64)), 0),
                f(moved, 0),
                f(kept, 0),
                f(of("no-reuse", &bytes), 0),
                f(state, 0),
                ratio(moved, state),
                f(t_reuse, 0),
                f(of("no-reuse", &ttft), 0),
                f(t_local, 0),
                ratio(t_reuse, t_local),
            ));
        }
    }
    s.push_str(
        "\n`bytes reuse`: the turn's handoff and the state kept on the decode node after its \
         answer; `state bytes`: a full handoff of the turn's prompt (prompt tokens x KV bytes \
         per token); `bytes ratio`: their ratio.\n\
         Targets: from turn 2, bytes ratio <= 0.10; TTFT reuse / local <= 1.2 \
         on wifi; no `reuse` answer that is not `local`'s.\n",
    );
    s
}
