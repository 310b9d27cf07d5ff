//! Private links on the real services: with a shared secret, what crosses
//! between the devices - the router's gRPC calls to both nodes, V2 handoffs, V1 uploads -
//! is TLS keyed by the secret. A recording proxy on every channel sees no prompt text, no
//! answer text and no run of the KV state, where the same exchange without a secret shows
//! all three; a flipped byte on any channel is refused and the answer still completes,
//! identical to the one-device answer, through the fallback.

use crate::common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const SECRET: &str = "correct horse battery staple";
const PROMPT: &str = "Describe the planet Neptune and its largest moon Triton.";

/// Everything each recording proxy saw, both directions, by the address it forwards to.
static CAPTURED: Mutex<Option<HashMap<String, Vec<u8>>>> = Mutex::new(None);

/// A proxy to `target` that records every byte both ways; returns its address.
fn recording(target: String) -> String {
    proxy(target, true, usize::MAX, usize::MAX)
}

/// A proxy to `target`: with `record`, every byte both ways goes into [`CAPTURED`] under
/// `target`; the byte at offset `up_at` of each connection's bytes towards `target`, and
/// at `down_at` of those coming back, is flipped (counted in [`FLIPPED`]).
fn proxy(target: String, record: bool, up_at: usize, down_at: usize) -> String {
    let (addr, l) = common::proxy_listener();
    tokio::spawn(async move {
        while let Ok((inbound, _)) = l.accept().await {
            let target = target.clone();
            tokio::spawn(async move {
                let Ok(outbound) = tokio::net::TcpStream::connect(&target).await else {
                    return;
                };
                let key = record.then_some(target.as_str());
                let (ri, wi) = inbound.into_split();
                let (ro, wo) = outbound.into_split();
                tokio::join!(pump(ri, wo, key, up_at), pump(ro, wi, key, down_at));
            });
        }
    });
    addr
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    record: Option<&str>,
    flip_at: usize,
) {
    let (mut seen, mut buf) = (0usize, vec![0u8; 64 * 1024]);
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some(key) = record {
            CAPTURED
                .lock()
                .unwrap()
                .get_or_insert_with(HashMap::new)
                .entry(key.to_string())
                .or_default()
                .extend_from_slice(&buf[..n]);
        }
        if seen <= flip_at && flip_at < seen + n {
            buf[flip_at - seen] ^= 0x5a;
            FLIPPED.fetch_add(1, Ordering::SeqCst);
        }
        seen += n;
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}

fn captured(target: &str) -> Vec<u8> {
    CAPTURED
        .lock()
        .unwrap()
        .as_ref()
        .and_then(|m| m.get(target).cloned())
        .unwrap_or_default()
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

fn host_port(url: &str) -> String {
    let rest = url.split("://").nth(1).unwrap_or(url);
    rest.split('/').next().unwrap().to_string()
}

/// A stack with a recording proxy on every channel between the devices. Paced: a live
/// answer switches by its 2nd-3rd token on any machine, so the V2 capture is nearly all
/// the prompt's state, which the V1 upload holds too (unpaced, a loaded machine switched
/// late, and the capture's sampled runs fell in answer rows the upload does not hold).
fn recorded_stack(secret: Option<&str>) -> common::Stack {
    let mut o = common::StackOptions::new(common::SMOLLM2).paced();
    o.secret = secret.map(Into::into);
    o.prefill_proxy = Some(recording);
    o.decode_proxy = Some(recording);
    o.handoff_proxy = Some(recording);
    o.v1_proxy = Some(recording);
    common::start(o)
}

/// The answer's token texts and the response, for `transport`.
/// `transport`: as the API names it (`v2` in the router's default mode), or `v2-after`.
async fn ask(s: &common::Stack, transport: &str) -> (Vec<String>, Value) {
    let edgesplit = match transport {
        "v2-after" => json!({"transport": "v2", "handoff": "after"}),
        t => json!({"transport": t}),
    };
    let (st, _, v) = common::post(
        &format!("{}/v1/chat/completions", s.router),
        &common::chat_body(
            json!([{"role":"user","content": PROMPT}]),
            json!({"temperature": 0, "max_tokens": 24, "logprobs": true,
                   "edgesplit": edgesplit}),
        ),
    )
    .await;
    assert_eq!(st, 200, "{transport}: {v}");
    let tokens = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["token"].as_str().unwrap().to_string())
        .collect();
    (tokens, v)
}

/// What crossed each channel of `s` while it answered over v2 and v1.
struct Exchange {
    answers: Vec<Value>,
    /// Token texts of five bytes or more (shorter ones could turn up by chance).
    words: Vec<String>,
    prefill_grpc: Vec<u8>,
    decode_grpc: Vec<u8>,
    v2: Vec<u8>,
    v1: Vec<u8>,
}

async fn exchange(s: &common::Stack) -> Exchange {
    let mut answers = Vec::new();
    let mut words = Vec::new();
    for t in ["local", "v2", "v1"] {
        let (tokens, v) = ask(s, t).await;
        if t != "local" {
            common::assert_split(
                &v["edgesplit"],
                v["usage"]["completion_tokens"].as_u64().unwrap(),
            );
        }
        words.extend(tokens.into_iter().filter(|w| w.len() >= 5));
        answers.push(v["choices"][0]["message"]["content"].clone());
    }
    words.sort();
    words.dedup();
    Exchange {
        answers,
        words,
        prefill_grpc: captured(&host_port(&s.prefill_grpc)),
        decode_grpc: captured(&host_port(&s.decode_grpc)),
        v2: captured(&s.handoff_addr),
        v1: captured(&host_port(&s.v1_url)),
    }
}

/// Runs of the KV state as the plain V2 capture carries them: 32-byte windows from its
/// second half (the payload is nearly all of it) that are not a run of one value.
fn kv_runs(v2: &[u8]) -> Vec<Vec<u8>> {
    (1..=8)
        .map(|k| {
            let at = v2.len() / 2 + k * (v2.len() / 20);
            v2[at..at + 32].to_vec()
        })
        .filter(|w| {
            let mut d = w.clone();
            d.sort_unstable();
            d.dedup();
            d.len() >= 8
        })
        .collect()
}

#[tokio::test]
async fn a_recording_proxy_sees_no_prompt_answer_or_state_on_a_private_link() {
    // The same exchange in the clear first: what the checks below look for is there. Its
    // stack stays up until the end: the captures are keyed by the listeners' addresses,
    // and a port it freed could be handed to the private stack, whose capture would then
    // hold these plain bytes too (it did once: an answer token "in the clear" on the V2
    // handoff, which carries no text).
    let plain_stack = recorded_stack(None);
    let plain = exchange(&plain_stack).await;
    assert!(
        contains(&plain.prefill_grpc, PROMPT.as_bytes()),
        "control: prompt"
    );
    assert!(!plain.words.is_empty(), "control: no word of five bytes");
    let all_plain = [&plain.prefill_grpc, &plain.decode_grpc];
    for w in &plain.words {
        assert!(
            all_plain.iter().any(|c| contains(c, w.as_bytes())),
            "control: answer token {w:?} not seen in the clear"
        );
    }
    let runs = kv_runs(&plain.v2);
    assert!(
        runs.len() >= 4,
        "control: the V2 capture has too few distinct runs"
    );
    for r in &runs {
        assert!(
            contains(&plain.v1, r),
            "control: a V2 state run is not in the V1 upload"
        );
    }

    let stack = recorded_stack(Some(SECRET));
    let private = exchange(&stack).await;
    // The decode node's metrics stay scrapable in plain HTTP on `--metrics-listen`, and
    // count the handoffs that crossed encrypted.
    let metrics = common::scrape(&stack.decode_metrics).await;
    assert!(
        metrics.contains("edgesplit:handoff_bytes_received_total"),
        "{metrics}"
    );
    assert_eq!(
        private.answers, plain.answers,
        "same answers with the secret"
    );
    assert_eq!(private.answers[0], private.answers[1], "v2 = local");
    assert_eq!(private.answers[0], private.answers[2], "v1 = local");
    for (name, c) in [
        ("router -> prefill gRPC", &private.prefill_grpc),
        ("router -> decode gRPC", &private.decode_grpc),
        ("V2 handoff", &private.v2),
        ("V1 upload", &private.v1),
    ] {
        assert!(c.len() > 1000, "{name}: only {} bytes recorded", c.len());
        assert!(
            !contains(c, PROMPT.as_bytes()),
            "{name}: the prompt crossed in the clear"
        );
        assert!(
            !contains(c, b"Neptune"),
            "{name}: a prompt word crossed in the clear"
        );
        for w in &private.words {
            assert!(
                !contains(c, w.as_bytes()),
                "{name}: answer token {w:?} in the clear"
            );
        }
        for r in &runs {
            assert!(
                !contains(c, r),
                "{name}: a run of the KV state in the clear"
            );
        }
    }
    drop(plain_stack);
}

/// Bytes flipped by the [`proxy`]s.
static FLIPPED: AtomicUsize = AtomicUsize::new(0);

/// A link that flips one byte of each connection towards `target`, well past the TLS
/// handshake: where the state goes (V2, V1).
fn flipping(target: String) -> String {
    proxy(target, false, 6000, usize::MAX)
}

/// A link that flips one byte of each connection coming back from `target` (the node's
/// side of a gRPC connection: its answers), past the server's handshake flight.
fn flipping_answers(target: String) -> String {
    proxy(target, false, usize::MAX, 1500)
}

/// A request over `transport` on a private stack whose channel `configure` corrupts: the
/// answer is the one-device answer, and the corruption was refused, as `refusal` names:
/// `fallback` (the split failed and the prefill node finished the answer) or
/// `handoff_cancelled` (a live handoff gave up; the answer never left the prefill node).
/// Paced, so that a live answer reaches its handoff's refusal on any machine.
async fn flipped_channel_is_refused(
    configure: fn(&mut common::StackOptions),
    transport: &str,
    refusal: &str,
) {
    let mut o = common::StackOptions::new(common::SMOLLM2).paced();
    o.secret = Some(SECRET.into());
    configure(&mut o);
    let s = common::start(o);
    let (_, local) = ask(&s, "local").await;
    let flipped = FLIPPED.load(Ordering::SeqCst);
    let (_, split) = ask(&s, transport).await;
    assert!(
        FLIPPED.load(Ordering::SeqCst) > flipped,
        "{transport}: no byte was flipped"
    );
    assert_eq!(
        split["choices"][0]["message"]["content"], local["choices"][0]["message"]["content"],
        "{transport}: {split}"
    );
    assert!(
        split["edgesplit"][refusal].is_string(),
        "{transport}: the corrupted channel was not refused ({refusal}): {split}"
    );
}

#[tokio::test]
async fn a_flipped_byte_on_any_private_channel_is_refused_and_the_answer_completes() {
    // The default live handoff: its connection breaks, it gives up.
    flipped_channel_is_refused(
        |o| o.handoff_proxy = Some(flipping),
        "v2",
        "handoff_cancelled",
    )
    .await;
    flipped_channel_is_refused(|o| o.handoff_proxy = Some(flipping), "v2-after", "fallback").await;
    flipped_channel_is_refused(|o| o.v1_proxy = Some(flipping), "v1", "fallback").await;
    flipped_channel_is_refused(
        |o| o.decode_proxy = Some(flipping_answers),
        "v2",
        "fallback",
    )
    .await;
}

/// The prefill node has no stand-in: a flipped byte on its channel (every connection's,
/// here) fails the request with an OpenAI error object that says the connection broke -
/// whichever call met the flipped byte: the request's prefill (`node_unavailable`) or the
/// `Info` it asks for when the router's background one failed (`prefill_unavailable`).
#[tokio::test]
async fn a_flipped_byte_on_the_prefill_channel_fails_the_request_clearly() {
    let mut o = common::StackOptions::new(common::SMOLLM2);
    o.secret = Some(SECRET.into());
    o.prefill_proxy = Some(flipping_answers);
    let s = common::start(o);
    let (st, _, v) = common::post(
        &format!("{}/v1/chat/completions", s.router),
        &common::chat_body(
            json!([{"role":"user","content": PROMPT}]),
            json!({"temperature": 0, "max_tokens": 24, "edgesplit": {"transport": "local"}}),
        ),
    )
    .await;
    assert_eq!(st, 503, "{v}");
    let code = v["error"]["code"].as_str().unwrap();
    assert!(
        ["node_unavailable", "prefill_unavailable"].contains(&code),
        "{v}"
    );
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("connection to a node broke")
            || message.contains("connection to the prefill node broke"),
        "{v}"
    );
}
