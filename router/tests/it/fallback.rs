//! Failures of the split on the real services, and what the client sees:
//! - the decode node dies mid-answer (its connection to the router is cut): with the
//!   default policy the prefill node finishes the answer, and the client's text is the
//!   uninterrupted answer, token for token; with `--on-split-failure fail` the stream ends
//!   with an in-band error and `[DONE]`, within the deadline;
//! - bytes are corrupted between the nodes: every corrupted state is refused (checksum),
//!   the prefill node retries once, and the answer is still the one-device answer, through
//!   the retry or through the fallback.

use crate::common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use edgesplit_proto::pb;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Set: the proxy in front of the decode node drops every connection and refuses new ones.
static DECODE_DEAD: AtomicBool = AtomicBool::new(false);

/// Forwards to the decode node's gRPC listener until [`DECODE_DEAD`] is set.
fn killable_proxy(target: String) -> String {
    common::cuttable_proxy(target, &DECODE_DEAD)
}

/// Set: the proxy in front of the decode node stops forwarding, both ways, and holds the
/// connections open (a frozen phone: no error, no bytes).
static DECODE_STALLED: AtomicBool = AtomicBool::new(false);

/// Forwards to the decode node's gRPC listener until [`DECODE_STALLED`] is set, then
/// forwards nothing more and keeps the sockets open.
fn stalling_proxy(target: String) -> String {
    let (addr, l) = common::proxy_listener();
    tokio::spawn(async move {
        while let Ok((inbound, _)) = l.accept().await {
            let target = target.clone();
            tokio::spawn(async move {
                let outbound = TcpStream::connect(target).await.unwrap();
                let (ri, wi) = inbound.into_split();
                let (ro, wo) = outbound.into_split();
                let pump = |mut r: tokio::net::tcp::OwnedReadHalf,
                            mut w: tokio::net::tcp::OwnedWriteHalf| async move {
                    let mut buf = vec![0u8; 16 * 1024];
                    loop {
                        let k = match r.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(k) => k,
                        };
                        if DECODE_STALLED.load(Ordering::SeqCst) {
                            // Swallow it and everything after; keep both sockets.
                            std::future::pending::<()>().await;
                        }
                        if w.write_all(&buf[..k]).await.is_err() {
                            break;
                        }
                    }
                };
                tokio::join!(pump(ri, wo), pump(ro, wi));
            });
        }
    });
    addr
}

/// Corrupt the first this-many handoff connections.
static CORRUPT_FIRST: AtomicUsize = AtomicUsize::new(0);
static HANDOFFS: AtomicUsize = AtomicUsize::new(0);

/// Between the nodes: flips one byte, far into the STATE frame, of the first
/// [`CORRUPT_FIRST`] connections.
fn corrupting_proxy(target: String) -> String {
    let (addr, l) = common::proxy_listener();
    tokio::spawn(async move {
        while let Ok((inbound, _)) = l.accept().await {
            let n = HANDOFFS.fetch_add(1, Ordering::SeqCst);
            let corrupt = n < CORRUPT_FIRST.load(Ordering::SeqCst);
            let target = target.clone();
            tokio::spawn(async move {
                let outbound = TcpStream::connect(target).await.unwrap();
                let (mut ri, mut wi) = inbound.into_split();
                let (mut ro, mut wo) = outbound.into_split();
                let up = async move {
                    let mut seen = 0usize;
                    let mut buf = vec![0u8; 64 * 1024];
                    loop {
                        let k = match ri.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(k) => k,
                        };
                        // Past the handshake, inside the KV payload.
                        const AT: usize = 200_000;
                        if corrupt && seen <= AT && AT < seen + k {
                            buf[AT - seen] ^= 0x5a;
                        }
                        seen += k;
                        if wo.write_all(&buf[..k]).await.is_err() {
                            break;
                        }
                    }
                    let _ = wo.shutdown().await;
                };
                let down = async move {
                    let _ = tokio::io::copy(&mut ro, &mut wi).await;
                };
                tokio::join!(up, down);
            });
        }
    });
    addr
}

/// Greedy, and seeded with a frequency penalty: a resumed answer must continue at the
/// right step index (the seed of each step depends on it) with the right penalty history.
fn samplings() -> [Value; 2] {
    [
        json!({"temperature": 0}),
        json!({"temperature": 0.9, "top_p": 0.95, "seed": 7, "frequency_penalty": 0.5}),
    ]
}

fn ask_with(transport: &str, stream: bool, sampling: &Value) -> Value {
    let mut extra = json!({
        "max_tokens": 96, "stream": stream,
        "stream_options": {"include_usage": true},
        "edgesplit": {"transport": transport, "return_token_ids": true},
    });
    if transport == "v2" {
        // The failures here are those of the handoff after the first token (the decode
        // node's `Generate` waits for the state); the live handoff's are in live.rs.
        extra["edgesplit"]["handoff"] = json!("after");
    }
    for (k, v) in sampling.as_object().unwrap() {
        extra[k] = v.clone();
    }
    common::chat_body(
        json!([{"role":"user","content":"Write a short story about a lighthouse keeper and a storm."}]),
        extra,
    )
}

fn ask(transport: &str, stream: bool) -> Value {
    ask_with(transport, stream, &samplings()[0])
}

/// Streams `body`; after `kill_after` content chunks sets [`DECODE_DEAD`]. Returns the
/// text, the final `edgesplit` object, any in-band error, and whether `[DONE]` came.
async fn stream_and_kill(
    url: &str,
    body: &Value,
    kill_after: usize,
) -> (String, Value, Option<Value>, bool) {
    let resp = common::client().post(url).json(body).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let (mut text, mut timing, mut error, mut done) = (String::new(), Value::Null, None, false);
    let mut pieces = 0;
    let mut sse = common::Sse::new(resp);
    while let Some(data) = sse.next().await {
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(&data).unwrap();
        if v.get("error").is_some() {
            error = Some(v);
            continue;
        }
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
            if !c.is_empty() {
                text.push_str(c);
                pieces += 1;
                if pieces == kill_after {
                    DECODE_DEAD.store(true, Ordering::SeqCst);
                }
            }
        }
        if !v["edgesplit"].is_null() {
            timing = v["edgesplit"].clone();
        }
    }
    (text, timing, error, done)
}

async fn local_answer(router: &str, sampling: &Value) -> Value {
    let (st, _, v) = common::post(
        &format!("{router}/v1/chat/completions"),
        &ask_with("local", false, sampling),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    v
}

/// Both decode-death scenarios share the proxy's switch, so they run in one test, in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_decode_node_dies_mid_answer() {
    // Fallback (the default): the answer goes on from the prefill node.
    let mut o = common::StackOptions::new(common::SMOLLM2);
    o.decode_proxy = Some(killable_proxy);
    let s = common::start(o);
    let url = format!("{}/v1/chat/completions", s.router);
    for sampling in samplings() {
        let expected = local_answer(&s.router, &sampling).await;
        let expected_text = expected["choices"][0]["message"]["content"]
            .as_str()
            .unwrap();
        assert!(
            expected["usage"]["completion_tokens"].as_u64().unwrap() > 20,
            "{expected}"
        );
        DECODE_DEAD.store(false, Ordering::SeqCst);
        let (text, timing, error, done) =
            stream_and_kill(&url, &ask_with("v2", true, &sampling), 8).await;
        assert!(
            DECODE_DEAD.load(Ordering::SeqCst),
            "the decode node was cut mid-answer"
        );
        assert!(error.is_none(), "{error:?}");
        assert!(done);
        assert_eq!(
            text, expected_text,
            "the client's text is the uninterrupted answer ({sampling})"
        );
        assert_eq!(
            timing["token_ids"], expected["edgesplit"]["token_ids"],
            "{sampling}"
        );
        assert_eq!(timing["fallback"], "decode_node_lost", "{timing}");
    }
    let expected = local_answer(&s.router, &samplings()[0]).await;
    let expected_text = expected["choices"][0]["message"]["content"]
        .as_str()
        .unwrap();
    assert_eq!(
        common::fallbacks_for(&s, "decode_node_lost").await,
        2,
        "each fallback counted under its cause"
    );
    // With the decode node gone, a new request is answered on the prefill node from the
    // start (the fallback policy), never a hang.
    let t0 = Instant::now();
    let (st, _, v) = common::post(&url, &ask("v2", false)).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["edgesplit"]["fallback"], "decode_unavailable", "{v}");
    assert_eq!(
        v["edgesplit"]["token_ids"],
        expected["edgesplit"]["token_ids"]
    );
    assert!(t0.elapsed() < Duration::from_secs(30));

    // Fail mode: an in-band error, then [DONE], within the deadline.
    DECODE_DEAD.store(false, Ordering::SeqCst);
    let mut o = common::StackOptions::new(common::SMOLLM2);
    o.decode_proxy = Some(killable_proxy);
    o.fail_on_split_failure = true;
    let s = common::start(o);
    let url = format!("{}/v1/chat/completions", s.router);
    let t0 = Instant::now();
    let (text, _, error, done) = stream_and_kill(&url, &ask("v2", true), 8).await;
    assert!(t0.elapsed() < Duration::from_secs(20), "{:?}", t0.elapsed());
    assert!(
        expected_text.starts_with(&text),
        "what was sent is the answer's start"
    );
    let error = error.expect("an in-band error event");
    assert!(error["error"]["code"].is_string(), "{error}");
    assert!(done, "[DONE] after the error");
    DECODE_DEAD.store(false, Ordering::SeqCst);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupted_handoffs_are_all_detected_and_the_answer_is_still_right() {
    let mut o = common::StackOptions::new(common::SMOLLM2);
    o.handoff_proxy = Some(corrupting_proxy);
    let s = common::start(o);
    let url = format!("{}/v1/chat/completions", s.router);
    let expected = local_answer(&s.router, &samplings()[0]).await;
    let expected_greedy = expected.clone();
    let decode_refused = || async { common::decode_info(&s.decode_grpc).await.handoffs_refused };

    // One corrupted connection: refused, retried once, delivered; no fallback.
    HANDOFFS.store(0, Ordering::SeqCst);
    CORRUPT_FIRST.store(1, Ordering::SeqCst);
    let before = decode_refused().await;
    let (st, _, v) = common::post(&url, &ask("v2", false)).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        v["choices"][0]["message"],
        expected["choices"][0]["message"]
    );
    assert!(v["edgesplit"]["fallback"].is_null(), "{v}");
    assert_eq!(HANDOFFS.load(Ordering::SeqCst), 2, "one retry");
    assert_eq!(
        decode_refused().await - before,
        1,
        "the corrupted state was refused"
    );

    // Every connection corrupted: both attempts refused, the prefill node finishes.
    HANDOFFS.store(0, Ordering::SeqCst);
    CORRUPT_FIRST.store(usize::MAX, Ordering::SeqCst);
    let before = decode_refused().await;
    let (st, _, v) = common::post(&url, &ask("v2", false)).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        v["choices"][0]["message"],
        expected["choices"][0]["message"]
    );
    assert_eq!(
        v["edgesplit"]["token_ids"],
        expected["edgesplit"]["token_ids"]
    );
    assert_eq!(v["edgesplit"]["fallback"], "checksum_mismatch", "{v}");
    assert_eq!(common::fallbacks_for(&s, "checksum_mismatch").await, 1);
    assert_eq!(HANDOFFS.load(Ordering::SeqCst), 2);
    assert_eq!(
        decode_refused().await - before,
        2,
        "100% of corrupted states detected"
    );

    // The same, seeded with a frequency penalty: the resume continues at the right step
    // with the right penalty history.
    let seeded = &samplings()[1];
    let expected = local_answer(&s.router, seeded).await;
    HANDOFFS.store(0, Ordering::SeqCst);
    let (st, _, v) = common::post(&url, &ask_with("v2", false, seeded)).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["edgesplit"]["fallback"], "checksum_mismatch", "{v}");
    assert_eq!(
        v["edgesplit"]["token_ids"],
        expected["edgesplit"]["token_ids"]
    );

    // `--on-split-failure fail` when the handoff itself fails (both attempts corrupted):
    // the first token, then an in-band error naming the cause, then [DONE].
    let mut o = common::StackOptions::new(common::SMOLLM2);
    o.handoff_proxy = Some(corrupting_proxy);
    o.fail_on_split_failure = true;
    let f = common::start(o);
    HANDOFFS.store(0, Ordering::SeqCst);
    let url = format!("{}/v1/chat/completions", f.router);
    let (text, _, error, done) = stream_and_kill(&url, &ask("v2", true), usize::MAX).await;
    let error = error.expect("an in-band error event");
    assert_eq!(error["error"]["code"], "checksum_mismatch", "{error}");
    assert!(done, "[DONE] after the error");
    let expected_text = expected_greedy["choices"][0]["message"]["content"]
        .as_str()
        .unwrap();
    assert!(
        !text.is_empty() && expected_text.starts_with(&text),
        "the first token, then nothing: {text:?}"
    );
    assert_eq!(
        HANDOFFS.load(Ordering::SeqCst),
        2,
        "retried once, then failed"
    );
    CORRUPT_FIRST.store(0, Ordering::SeqCst);
}

/// A decode node that stalls mid-answer (no error, no token, the connection open) is
/// given up after `--token-idle-timeout-ms`, and the prefill node finishes the answer,
/// identical, with the cause `timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_decode_node_is_given_up_after_the_idle_bound() {
    let mut o = common::StackOptions::new(common::SMOLLM2);
    o.decode_proxy = Some(stalling_proxy);
    o.token_idle_timeout_ms = 1_000;
    let s = common::start(o);
    let url = format!("{}/v1/chat/completions", s.router);
    let expected = local_answer(&s.router, &samplings()[0]).await;
    DECODE_STALLED.store(false, Ordering::SeqCst);
    let resp = common::client()
        .post(&url)
        .json(&ask("v2", true))
        .send()
        .await
        .unwrap();
    let (mut text, mut timing, mut pieces) = (String::new(), Value::Null, 0);
    let mut sse = common::Sse::new(resp);
    while let Some(data) = sse.next().await {
        if data == "[DONE]" {
            continue;
        }
        let v: Value = serde_json::from_str(&data).unwrap();
        assert!(v.get("error").is_none(), "{v}");
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
            if !c.is_empty() {
                text.push_str(c);
                pieces += 1;
                if pieces == 8 {
                    DECODE_STALLED.store(true, Ordering::SeqCst);
                }
            }
        }
        if !v["edgesplit"].is_null() {
            timing = v["edgesplit"].clone();
        }
    }
    DECODE_STALLED.store(false, Ordering::SeqCst);
    assert!(pieces > 8, "the stall came mid-answer");
    assert_eq!(
        text,
        expected["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
    );
    assert_eq!(timing["token_ids"], expected["edgesplit"]["token_ids"]);
    assert_eq!(timing["fallback"], "timeout", "{timing}");
}

/// A decode node that takes the answer and then ends its stream without finishing it
/// (no token, no `Finished`, no error). The product's decode node cannot be made to do
/// this; a faulty or hostile one can, so it stands in front of the real node: `Info` is
/// the real node's, `Generate` ends at once.
struct EndsEarly {
    real: String,
}

#[tonic::async_trait]
impl pb::decode_server::Decode for EndsEarly {
    type GenerateStream = std::pin::Pin<
        Box<dyn futures::Stream<Item = Result<pb::TokenEvent, tonic::Status>> + Send>,
    >;
    type LocalStream = Self::GenerateStream;

    async fn generate(
        &self,
        _: tonic::Request<pb::GenerateRequest>,
    ) -> Result<tonic::Response<Self::GenerateStream>, tonic::Status> {
        Ok(tonic::Response::new(Box::pin(futures::stream::empty())))
    }

    async fn local(
        &self,
        _: tonic::Request<pb::PrefillRequest>,
    ) -> Result<tonic::Response<Self::LocalStream>, tonic::Status> {
        Ok(tonic::Response::new(Box::pin(futures::stream::empty())))
    }

    async fn info(
        &self,
        r: tonic::Request<pb::InfoRequest>,
    ) -> Result<tonic::Response<pb::NodeInfo>, tonic::Status> {
        let mut c = pb::decode_client::DecodeClient::connect(self.real.clone())
            .await
            .map_err(|e| tonic::Status::unavailable(e.to_string()))?;
        c.info(r.into_inner()).await
    }
}

fn ends_early(target: String) -> String {
    let (addr, l) = common::proxy_listener();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(pb::decode_server::DecodeServer::new(EndsEarly {
                real: format!("http://{target}"),
            }))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l)),
    );
    addr
}

/// A decode node that ends its stream early: the prefill node finishes the answer,
/// identical, with the cause `stream_ended`.
#[tokio::test]
async fn a_decode_node_that_ends_early_is_finished_by_the_prefill_node() {
    let mut o = common::StackOptions::new(common::SMOLLM2);
    o.decode_proxy = Some(ends_early);
    let s = common::start(o);
    let expected = local_answer(&s.router, &samplings()[1]).await;
    let (st, _, v) = common::post(
        &format!("{}/v1/chat/completions", s.router),
        &ask_with("v2", false, &samplings()[1]),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["edgesplit"]["fallback"], "stream_ended", "{v}");
    assert_eq!(
        v["edgesplit"]["token_ids"],
        expected["edgesplit"]["token_ids"]
    );
}
