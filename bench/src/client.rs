//! One request, measured the way a client sees it: streamed, timed per content chunk.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// What a request asks for.
#[derive(Clone, Debug)]
pub struct Ask {
    pub prompt: String,
    pub max_tokens: u32,
    /// `/v1/chat/completions` (else `/v1/completions`, for base models).
    pub chat: bool,
    pub seed: u64,
    /// The whole conversation (chat only; else one user message of `prompt`).
    pub messages: Option<Value>,
    /// Let the servers reuse KV kept from earlier requests (`cache_prompt`). Off for every
    /// measurement but the conversation's (`edgesplit-bench chat`): a repeated prompt must
    /// be prefilled anew, on our nodes and on a stock llama-server alike.
    pub cache_prompt: bool,
}

/// The EdgeSplit transports a run may name (see [`Target::EdgeSplit`]).
pub const TRANSPORTS: [&str; 10] = [
    "local",
    "v1",
    "v2",
    "v2-live",
    "v2-after",
    "phone",
    "auto",
    "auto-latency",
    "auto-offload",
    "auto-balanced",
];

/// Who answers.
#[derive(Clone, Debug)]
pub enum Target {
    /// Our router, with a transport (`local`, `v1`, `v2`, `phone`, `auto`; `v2-live` and
    /// `v2-after` name the handoff mode, `v2` leaves it to the router: `live` by default;
    /// `auto` leaves the mode to the router's cost model, `auto-latency` / `auto-offload` /
    /// `auto-balanced` with that objective).
    EdgeSplit { url: String, transport: String },
    /// A stock llama-server.
    Stock { url: String },
}

impl Target {
    pub fn name(&self) -> &str {
        match self {
            Target::EdgeSplit { transport, .. } => transport,
            Target::Stock { .. } => "stock",
        }
    }
}

/// The measurements of one request.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Measure {
    /// To the first non-empty content chunk.
    pub ttft_ms: f64,
    pub e2e_ms: f64,
    /// Time per output token after the first: `(e2e - ttft) / (completion_tokens - 1)`.
    pub tpot_ms: Option<f64>,
    /// Gaps between successive content chunks.
    pub itl_ms: Vec<f64>,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    /// Server-reported (ours: `edgesplit.prefill_ms`; stock: `timings.prompt_ms`).
    pub prefill_ms: Option<f64>,
    pub handoff_bytes: Option<u64>,
    pub handoff_ms: Option<f64>,
    /// Server-reported decode speed (ours: decode steps on the decode node; stock:
    /// `timings.predicted_per_second`).
    pub decode_tps: Option<f64>,
    /// Ours: why the split failed and the prefill node finished the answer, if it did.
    pub fallback: Option<String>,
    /// Ours, live handoff: answer tokens the prefill node wrote (all of them when the
    /// answer ended before the switch).
    pub prefill_tokens: Option<u64>,
    /// Ours, live handoff: ms from the request to the switch (none when there was none).
    pub switch_ms: Option<f64>,
    /// Ours: the decode node's import of the state (a live handoff's: at the switch).
    pub import_ms: Option<f64>,
    /// Ours: which node prefilled the prompt, and how many of its tokens' KV was reused.
    pub placement: Option<String>,
    pub cached_tokens: Option<u64>,
    /// Ours: answer tokens the decode node (the phone) wrote.
    pub phone_tokens: Option<u64>,
    /// The decode node the answer used (`edgesplit.decode_node`).
    pub decode_node: Option<String>,
    /// Ours, `transport: auto`: the mode the router chose, its predicted end (ms) and the
    /// actual one, both from the request's admission (the router's queue left).
    pub mode: Option<String>,
    pub predicted_ms: Option<f64>,
    pub actual_ms: Option<f64>,
    /// The laptop's CPU time for the request (the prefill node process's, measured around
    /// it by the caller where requests do not overlap).
    pub laptop_cpu_ms: Option<f64>,
    pub text: String,
}

/// A prompt of about `target` tokens (SmolLM2's tokenizer, chat template included).
pub fn prompt(target: usize) -> String {
    if target < 40 {
        return "Name three colours of the rainbow, then stop.".to_string();
    }
    // About 21 tokens per line.
    let lines = (target.saturating_sub(20) / 21).max(1);
    let log = weather_log(0, lines);
    format!("{log}\nSummarise the weather log.")
}

/// `lines` lines of a weather log from day `from` on (about 21 tokens each).
pub fn weather_log(from: usize, lines: usize) -> String {
    (from..from + lines)
        .map(|i| {
            format!(
                "Day {i}: harbour {} recorded {} degrees, wind {} km/h.",
                i % 7,
                10 + (i * 7) % 23,
                (i * 13) % 41
            )
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A chat of one user message, as users send it: no system message (both servers render
/// the model's own template, which may add a default one).
pub fn chat_messages(prompt: &str) -> Value {
    json!([{"role": "user", "content": prompt}])
}

pub async fn run(client: &reqwest::Client, target: &Target, ask: &Ask) -> anyhow::Result<Measure> {
    let mut body = if ask.chat {
        let messages = ask
            .messages
            .clone()
            .unwrap_or_else(|| chat_messages(&ask.prompt));
        json!({ "messages": messages })
    } else {
        json!({"prompt": ask.prompt})
    };
    body["max_tokens"] = json!(ask.max_tokens);
    body["temperature"] = json!(0);
    body["seed"] = json!(ask.seed);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    body["cache_prompt"] = json!(ask.cache_prompt);
    let path = if ask.chat {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    };
    let url = match target {
        Target::EdgeSplit { url, transport } => {
            // `TRANSPORT@NODE`: the decode node the request names (`edgesplit.node`).
            let (transport, node) = match transport.split_once('@') {
                Some((t, node)) => (t, Some(node)),
                None => (transport.as_str(), None),
            };
            body["edgesplit"] = match transport.split_once('-') {
                Some(("auto", objective)) => json!({"transport": "auto", "objective": objective}),
                Some((t, mode)) => json!({"transport": t, "handoff": mode}),
                None => json!({"transport": transport}),
            };
            if let Some(node) = node {
                body["edgesplit"]["node"] = json!(node);
            }
            format!("{url}{path}")
        }
        Target::Stock { url } => format!("{url}{path}"),
    };
    let t0 = Instant::now();
    let mut resp = client.post(url).json(&body).send().await?;
    if !resp.status().is_success() {
        let status = resp.status();
        let text = resp.text().await.unwrap_or_default();
        anyhow::bail!(
            "HTTP {status}: {}",
            text.chars().take(300).collect::<String>()
        );
    }
    let mut m = Measure::default();
    let mut last: Option<Instant> = None;
    let mut buf = String::new();
    let mut done = false;
    while let Some(chunk) = resp.chunk().await? {
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buf.find("\n\n") {
            let event: String = buf.drain(..end + 2).collect();
            let Some(data) = event.lines().find_map(|l| l.strip_prefix("data: ")) else {
                continue;
            };
            if data == "[DONE]" {
                done = true;
                continue;
            }
            let v: Value = serde_json::from_str(data)?;
            anyhow::ensure!(v.get("error").is_none(), "in-band error: {}", v["error"]);
            let c = &v["choices"][0];
            let content = c["delta"]["content"].as_str().or(c["text"].as_str());
            if let Some(c) = content.filter(|c| !c.is_empty()) {
                let now = Instant::now();
                match last {
                    None => m.ttft_ms = ms(now - t0),
                    Some(prev) => m.itl_ms.push(ms(now - prev)),
                }
                last = Some(now);
                m.text.push_str(c);
            }
            if !v["usage"].is_null() {
                m.prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
                m.completion_tokens = v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
            }
            let es = &v["edgesplit"];
            if !es.is_null() {
                m.prefill_ms = es["prefill_ms"].as_f64();
                m.handoff_bytes = es["handoff_bytes"].as_u64().filter(|&b| b > 0);
                m.handoff_ms = m.handoff_bytes.and(es["handoff_ms"].as_f64());
                m.decode_tps = es["decode_tokens_per_s"].as_f64();
                m.prefill_tokens = es["prefill_tokens"].as_u64();
                m.switch_ms = es["switch_ms"].as_f64();
                m.import_ms = es["import_ms"].as_f64();
                m.placement = es["placement"].as_str().map(str::to_string);
                m.cached_tokens = es["cached_tokens"].as_u64();
                m.phone_tokens = es["decode_node_tokens"].as_u64();
                m.decode_node = es["decode_node"].as_str().map(str::to_string);
                m.mode = es["mode"].as_str().map(str::to_string);
                m.predicted_ms = es["predicted_ms"].as_f64();
                m.actual_ms = es["actual_ms"].as_f64();
                if let Some(f) = es["fallback"].as_str() {
                    m.fallback = Some(f.to_string());
                }
            }
            let t = &v["timings"];
            if !t.is_null() {
                m.prefill_ms = t["prompt_ms"].as_f64();
                m.decode_tps = t["predicted_per_second"].as_f64();
            }
        }
    }
    anyhow::ensure!(done, "stream ended without [DONE]");
    anyhow::ensure!(last.is_some(), "no content");
    m.e2e_ms = ms(t0.elapsed());
    if m.completion_tokens > 1 {
        m.tpot_ms = Some((m.e2e_ms - m.ttft_ms) / (m.completion_tokens - 1) as f64);
    }
    Ok(m)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}
