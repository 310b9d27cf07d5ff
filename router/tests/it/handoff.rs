//! The V2 handoff between the real nodes: bytes really cross it, a wrong model or a
//! corrupted payload is refused with a reason and nothing is imported, and the first token
//! does not wait for it.

use crate::common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use edgesplit_proto::frame::{self, Frame, Identity, NackCode, StateFrame, TensorDescriptor};
use edgesplit_proto::handoff::{self, HandoffError, Limits};
use edgesplit_proto::pb;
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio::net::TcpStream;
use tokio_util::codec::Framed;

/// Handed over after the first token: the whole state in one frame, so the bytes sent are
/// the bytes the decode node holds (a live handoff's pieces carry a layout each).
fn ask() -> Value {
    common::chat_body(
        json!([{"role":"user","content":"Name three rivers in Europe."}]),
        json!({"temperature": 0, "max_tokens": 12, "edgesplit": {"handoff": "after"}}),
    )
}

#[tokio::test]
async fn kv_state_really_crosses_the_v2_connection() {
    let s = common::smollm2();
    let url = format!("{}/v1/chat/completions", s.router);
    let before = common::decode_info(&s.decode_grpc).await;
    let (st, _, v) = common::post(&url, &ask()).await;
    assert_eq!(st, 200);
    let after = common::decode_info(&s.decode_grpc).await;
    let sent = v["edgesplit"]["handoff_bytes"].as_u64().unwrap();
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(sent >= prompt * 23_040);
    // Other tests share this stack: at least our bytes arrived, counted by the receiver.
    assert!(after.handoff_bytes_received - before.handoff_bytes_received >= sent);
    assert!(after.handoffs_received > before.handoffs_received);
}

/// Sends an empty state as `id` and returns the NACK it gets.
async fn refusal(addr: &str, id: &Identity, handoff_id: &str) -> frame::Nack {
    let state = StateFrame {
        handoff_id: handoff_id.into(),
        request_id: "t".into(),
        tokens: vec![1],
        descriptors: vec![],
        payload: Bytes::new(),
    };
    match handoff::send_state(
        addr,
        id,
        state,
        &Limits::default(),
        &edgesplit_proto::link::Link::plain(),
    )
    .await
    {
        Err(HandoffError::Refused(n)) => n,
        other => panic!("expected a NACK, got {other:?}"),
    }
}

/// Another llama.cpp build or another KV cache type is refused in the handshake, with
/// its own code, before any KV byte moves.
#[tokio::test]
async fn another_build_or_kv_type_is_refused_with_its_code() {
    let s = common::smollm2();
    let info = common::decode_info(&s.decode_grpc).await;
    // The same llama.cpp with ggml's weight repacking on computes other numbers: another
    // build, refused naming both.
    let mut other_build = common::identity(&info);
    assert!(info.build_id.contains(", REPACK off,"), "{}", info.build_id);
    other_build.build_id = info.build_id.replace("REPACK off", "REPACK on");
    let mut other_kv = common::identity(&info);
    other_kv.type_k = 8; // q8_0 where the node runs f16
    for (id, code) in [
        (other_build, NackCode::BuildMismatch),
        (other_kv, NackCode::KvTypeMismatch),
    ] {
        let n = refusal(&s.handoff_addr, &id, "other-build").await;
        assert_eq!(n.code, code, "{n}");
        if code == NackCode::BuildMismatch {
            assert!(
                n.reason.contains(&info.build_id) && n.reason.contains("REPACK on"),
                "{n}"
            );
        }
    }
}

#[tokio::test]
async fn wrong_model_fingerprint_is_refused_with_a_reason() {
    let s = common::smollm2();
    let info = common::decode_info(&s.decode_grpc).await;
    let mut id = common::identity(&info);
    id.model_fingerprint[0] ^= 0xff;
    let n = refusal(&s.handoff_addr, &id, "wrong-model").await;
    assert_eq!(n.code, NackCode::ModelMismatch);
    assert!(n.reason.contains(&info.model_fingerprint), "{}", n.reason);
    // A different context size is refused too, naming both sizes.
    let mut id = common::identity(&info);
    id.n_ctx = 4096;
    let n = refusal(&s.handoff_addr, &id, "wrong-ctx").await;
    assert_eq!(n.code, NackCode::ContextMismatch);
    assert!(
        n.reason.contains("4096") && n.reason.contains("2048"),
        "{}",
        n.reason
    );
}

/// A real state from the prefill node's engine would need another model load; a
/// well-formed synthetic state (one cell, one layer, K and V) is enough to reach the checksum check.
fn synthetic_state() -> Vec<u8> {
    let mut v = Vec::new();
    v.extend_from_slice(&edgesplit_proto::layout::STATE_MAGIC.to_le_bytes());
    v.extend_from_slice(&0u32.to_le_bytes());
    v.extend_from_slice(&common::synthetic_sections(1));
    v
}

async fn raw_session(
    addr: &str,
    id: &Identity,
) -> Framed<TcpStream, edgesplit_proto::codec::V2Codec> {
    let stream = TcpStream::connect(addr).await.unwrap();
    let mut f = Framed::new(stream, edgesplit_proto::codec::V2Codec::default());
    f.send(Frame::Hello(id.clone())).await.unwrap();
    assert!(matches!(f.next().await, Some(Ok(Frame::HelloOk(_)))));
    f
}

#[tokio::test]
async fn corrupted_payload_is_refused_and_nothing_is_imported() {
    let s = common::smollm2();
    let info = common::decode_info(&s.decode_grpc).await;
    let id = common::identity(&info);
    let payload = synthetic_state();
    assert!(edgesplit_proto::layout::describe(&payload)
        .max_cells
        .is_some());
    let state = StateFrame {
        handoff_id: "corrupt-1".into(),
        request_id: "t".into(),
        tokens: vec![7],
        descriptors: edgesplit_proto::layout::describe(&payload).descriptors,
        payload: Bytes::from(payload),
    };
    let mut buf = BytesMut::new();
    frame::encode(&Frame::State(state), &mut buf, frame::DEFAULT_MAX_FRAME).unwrap();
    let n = buf.len();
    buf[n - 40] ^= 0x01; // a payload byte, as a flaky link would flip it

    let before = common::decode_info(&s.decode_grpc).await;
    let mut f = raw_session(&s.handoff_addr, &id).await;
    use tokio::io::AsyncWriteExt;
    f.get_mut().write_all(&buf).await.unwrap();
    match f.next().await {
        Some(Ok(Frame::Nack(n))) => {
            assert_eq!(n.code, NackCode::ChecksumMismatch);
            assert!(n.reason.contains("SHA-256"), "{}", n.reason);
        }
        other => panic!("expected NACK, got {other:?}"),
    }
    let after = common::decode_info(&s.decode_grpc).await;
    assert!(after.handoffs_refused > before.handoffs_refused);
    // Nothing was stored: generating from that handoff finds no state.
    let err = generate_from(&s.decode_grpc, "corrupt-1")
        .await
        .expect_err("no state to generate from");
    assert_eq!(err.code(), tonic::Code::DeadlineExceeded);
    assert_eq!(
        err.metadata().get(edgesplit_proto::error::KEY).unwrap(),
        "handoff_missing"
    );
}

#[tokio::test]
async fn declared_descriptors_must_match_the_payload() {
    let s = common::smollm2();
    let id = common::identity(&common::decode_info(&s.decode_grpc).await);
    let mut f = raw_session(&s.handoff_addr, &id).await;
    // A descriptor that claims f32 where the payload says f16; fewer descriptors than the
    // payload derives (refused once the walk passes their count).
    type Edit = fn(&mut Vec<TensorDescriptor>);
    let edits: [(&str, Edit, &str); 2] = [
        ("desc-1", |d| d[0].dtype = 0, "do not match"),
        (
            "desc-3",
            |d| d.truncate(1),
            "more tensor descriptors than the 1 declared",
        ),
    ];
    for (handoff_id, edit, why) in edits {
        let payload = synthetic_state();
        let mut descriptors = edgesplit_proto::layout::describe(&payload).descriptors;
        edit(&mut descriptors);
        f.send(Frame::State(StateFrame {
            handoff_id: handoff_id.into(),
            request_id: "t".into(),
            tokens: vec![7],
            descriptors,
            payload: Bytes::from(payload),
        }))
        .await
        .unwrap();
        match f.next().await {
            Some(Ok(Frame::Nack(n))) => {
                assert_eq!(n.code, NackCode::DescriptorMismatch);
                assert!(n.reason.contains(why), "{n}");
            }
            other => panic!("expected NACK, got {other:?}"),
        }
    }
    // The connection stays usable: a good state on it is ACKed.
    send_good_state(&mut f, "desc-2").await;
}

/// Calls the decode node's `Generate` for `handoff_id` (one token after token 1).
async fn generate_from(
    decode_grpc: &str,
    handoff_id: &str,
) -> Result<tonic::Response<tonic::Streaming<pb::TokenEvent>>, tonic::Status> {
    let mut c = pb::decode_client::DecodeClient::connect(decode_grpc.to_string())
        .await
        .unwrap();
    c.generate(pb::GenerateRequest {
        answered: 1,
        request_id: "t".into(),
        handoff_id: handoff_id.into(),
        sampling: None,
        max_new_tokens: 1,
        first_token: Some(1),
        ..Default::default()
    })
    .await
}

/// Sends a well-formed synthetic state as `handoff_id` on an open session; it is ACKed.
async fn send_good_state(
    f: &mut Framed<TcpStream, edgesplit_proto::codec::V2Codec>,
    handoff_id: &str,
) {
    let payload = synthetic_state();
    f.send(Frame::State(StateFrame {
        handoff_id: handoff_id.into(),
        request_id: "t".into(),
        tokens: vec![7],
        descriptors: edgesplit_proto::layout::describe(&payload).descriptors,
        payload: Bytes::from(payload),
    }))
    .await
    .unwrap();
    assert!(matches!(f.next().await, Some(Ok(Frame::Ack { .. }))));
}

/// Set once the client has its first token: [`gated_proxy`] lets handoffs through only then.
static FIRST_TOKEN_SEEN: AtomicBool = AtomicBool::new(false);

/// Between the nodes: holds every handoff connection until [`FIRST_TOKEN_SEEN`].
fn gated_proxy(target: String) -> String {
    let (addr, l) = common::proxy_listener();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = l.accept().await {
            let target = target.clone();
            tokio::spawn(async move {
                while !FIRST_TOKEN_SEEN.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                if let Ok(mut outbound) = TcpStream::connect(target).await {
                    let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                }
            });
        }
    });
    addr
}

/// Deterministic, not timed: the handoff is held until the client has seen token 0. If
/// the first token waited for the handoff, neither would ever come (a deadlock, caught by
/// the timeout), whatever the machine's load.
#[tokio::test]
async fn first_token_does_not_wait_for_the_handoff() {
    let mut opts = common::StackOptions::new(common::SMOLLM2);
    opts.handoff_proxy = Some(gated_proxy);
    let s = common::start(opts);
    let url = format!("{}/v1/chat/completions", s.router);
    let mut body = ask();
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let resp = common::client()
        .post(&url)
        .json(&body)
        .send()
        .await
        .unwrap();
    let mut text = String::new();
    let mut report = None;
    let mut sse = common::Sse::new(resp);
    let read = async {
        while let Some(data) = sse.next().await {
            if data == "[DONE]" {
                continue;
            }
            let v: Value = serde_json::from_str(&data).unwrap();
            assert!(v.get("error").is_none(), "{v}");
            if v["usage"].is_object() {
                report = Some((
                    v["edgesplit"].clone(),
                    v["usage"]["completion_tokens"].as_u64(),
                ));
            }
            if let Some(c) = v["choices"][0]["delta"]["content"]
                .as_str()
                .filter(|c| !c.is_empty())
            {
                assert!(
                    !text.is_empty() || !FIRST_TOKEN_SEEN.load(Ordering::SeqCst),
                    "the gate opened before the first token"
                );
                FIRST_TOKEN_SEEN.store(true, Ordering::SeqCst);
                text.push_str(c);
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(120), read)
        .await
        .expect("no answer: the first token waited for the held handoff");
    assert!(
        FIRST_TOKEN_SEEN.load(Ordering::SeqCst),
        "a first token came"
    );
    // And the delayed split answer is still the single-device answer, written by the
    // decode node.
    let reference = common::run(&s, "/v1/chat/completions", &ask(), "local", false).await;
    assert_eq!(text, reference.text);
    let (edgesplit, completion_tokens) = report.expect("usage chunk");
    common::assert_split(&edgesplit, completion_tokens.unwrap());
}

/// A verified state nobody claims is dropped after `--pending-ttl-s`: a `Generate` for it
/// afterwards finds nothing (it never imports a stale state).
#[tokio::test]
async fn an_unclaimed_state_expires_after_its_ttl() {
    let mut o = common::StackOptions::new(common::SMOLLM2);
    o.pending_ttl_s = 1;
    let s = common::start(o);
    let id = common::identity(&common::decode_info(&s.decode_grpc).await);
    let mut f = raw_session(&s.handoff_addr, &id).await;
    send_good_state(&mut f, "ttl-1").await;
    // Waiting out the TTL is the behaviour under test, not a synchronisation.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let err = generate_from(&s.decode_grpc, "ttl-1")
        .await
        .expect_err("the expired state is gone");
    assert_eq!(
        err.metadata().get(edgesplit_proto::error::KEY).unwrap(),
        "handoff_missing",
        "{err:?}"
    );
}

/// While set, nothing more crosses [`held_control_link`] towards the decode node.
static CONTROL_HELD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// A router -> decode control link that [`CONTROL_HELD`] stops.
fn held_control_link(target: String) -> String {
    common::shaped(target, || common::Shape {
        faults: common::Faults {
            hold: Some(|| CONTROL_HELD.load(std::sync::atomic::Ordering::SeqCst)),
            ..common::Faults::default()
        },
        ..common::Shape::rate(0)
    })
}

/// A split request does not wait for the decode node's `Info` before its prefill: the
/// prefill starts towards the addresses of the last `Info` while this request's own one
/// crosses. Shown by order, not by timing: while the control link to the decode node lets
/// nothing through (so no `Info` can be answered), the prefill node prefills the request;
/// once the link goes again, the answer is the one-device answer, split.
#[tokio::test]
async fn the_prefill_does_not_wait_for_the_decode_nodes_info() {
    use std::sync::atomic::Ordering;
    let mut o = common::StackOptions::new(common::SMOLLM2);
    o.decode_proxy = Some(held_control_link);
    let s = common::start(o);
    let url = format!("{}/v1/chat/completions", s.router);
    let body = |t: &str| {
        common::chat_body(
            json!([{"role":"user","content": "Name three rivers in Europe."}]),
            json!({"temperature": 0, "max_tokens": 12,
                   "edgesplit": {"transport": t, "handoff": "after"}}),
        )
    };
    // Warm-up: the router's channel to the decode node is connected and has an `Info`.
    let (st, _, _) = common::post(&url, &body("v2")).await;
    assert_eq!(st, 200);
    let (_, _, local) = common::post(&url, &body("local")).await;
    let prompt_tokens = || async {
        common::value(
            &common::scrape(&s.prefill_metrics).await,
            "edgesplit:prompt_tokens_total",
        )
    };
    let before = prompt_tokens().await;
    CONTROL_HELD.store(true, Ordering::SeqCst);
    let split = tokio::spawn({
        let (url, body) = (url.clone(), body("v2"));
        async move { common::post(&url, &body).await }
    });
    // The prefill happens while no `Info` can be answered. (The bound only ends a test
    // that failed: a router that waited would wait here for good.)
    let t0 = std::time::Instant::now();
    while prompt_tokens().await <= before {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no prefill while the decode node's Info could not be answered: the prefill \
             waited for the Info"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    CONTROL_HELD.store(false, Ordering::SeqCst);
    let (st, _, split) = split.await.unwrap();
    assert_eq!(st, 200, "{split}");
    common::assert_split(
        &split["edgesplit"],
        split["usage"]["completion_tokens"].as_u64().unwrap(),
    );
    assert_eq!(
        split["choices"][0]["message"]["content"],
        local["choices"][0]["message"]["content"]
    );
}
