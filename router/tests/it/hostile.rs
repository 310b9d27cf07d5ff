//! A slow-loris V2 sender - a valid HELLO trickled a byte at a time - is cut off at the
//! handshake deadline with a `timeout` NACK, and the node serves real requests meanwhile.

use crate::common;

use std::time::{Duration, Instant};

use bytes::BytesMut;
use edgesplit_proto::codec::V2Codec;
use edgesplit_proto::frame::{self, Frame, NackCode};
use futures::StreamExt;
use serde_json::json;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio_util::codec::FramedRead;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_loris_sender_is_cut_off_and_others_are_served() {
    // Paced: the request below is a short live answer that must reach the decode node.
    let mut o = common::StackOptions::new(common::SMOLLM2).paced();
    o.handoff_handshake_timeout_s = 2;
    let s = common::start(o);
    let info = common::decode_info(&s.decode_grpc).await;
    let mut hello = BytesMut::new();
    frame::encode(
        &Frame::Hello(common::identity(&info)),
        &mut hello,
        frame::DEFAULT_MAX_FRAME,
    )
    .unwrap();

    let (r, mut w) = TcpStream::connect(&s.handoff_addr)
        .await
        .unwrap()
        .into_split();
    let t0 = Instant::now();
    let trickle = tokio::spawn(async move {
        for b in hello.iter() {
            if w.write_all(&[*b]).await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    });

    // Meanwhile the node serves a real request through the same listener (a split, named:
    // the router's own choice might answer on the laptop alone).
    let (st, _, v) = common::post(
        &format!("{}/v1/chat/completions", s.router),
        &json!({"messages":[{"role":"user","content":"Hi"}],"max_tokens":8,"temperature":0,
                "edgesplit": {"transport": "v2"}}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    common::assert_split(
        &v["edgesplit"],
        v["usage"]["completion_tokens"].as_u64().unwrap(),
    );

    // The trickled frame gets a timeout NACK at the deadline, not after 25 s of bytes.
    let mut frames = FramedRead::new(r, V2Codec::default());
    let reply = tokio::time::timeout(Duration::from_secs(10), frames.next())
        .await
        .expect("an answer before the trickle ends");
    let took = t0.elapsed();
    let Some(Ok(Frame::Nack(n))) = reply else {
        panic!("expected a NACK, got {reply:?}")
    };
    assert_eq!(n.code, NackCode::Timeout, "{n}");
    // Not before the deadline; and well before the trickle's 25 s (the 10 s timeout above
    // bounds it, with room for a loaded machine).
    assert!(took >= Duration::from_secs(2), "{took:?}");
    trickle.abort();
}

/// The peak resident memory (`VmHWM`) of process `pid`, in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}

/// 64 connections at once (the receiver's limit), each announcing a 16 MiB state to a
/// real decode node that may hold 64 MiB of states (`--max-pending-bytes`) and sending
/// 4 MiB of its body: the frames past the free room are refused from their header
/// (`capacity` NACK naming the room; the node reads their bodies away, keeping none), and
/// the node's peak RSS grows by less than the room. Before the header was checked against
/// the room, every connection's body was held (64 x 4 MiB here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_announcing_more_than_the_free_room_are_refused_before_their_bodies() {
    use crate::processes::{reported, spawn};
    use futures::SinkExt;
    const ROOM: u64 = 64 << 20;
    let dir = std::env::temp_dir().join(format!("edgesplit-room-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("decode.log");
    let args: Vec<String> = [
        "--model",
        &common::model(common::SMOLLM2).display().to_string(),
        "--n-ctx",
        "1024",
        "--listen",
        "127.0.0.1:0",
        "--handoff-listen",
        "127.0.0.1:0",
        "--v1-listen",
        "127.0.0.1:0",
        "--max-pending-bytes",
        &ROOM.to_string(),
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    let decode = spawn("edgesplit-decode", &args, &log);
    let d = reported(&log, "decode node listening").await;
    let info = common::decode_info(&format!("http://{}", d["grpc"].as_str().unwrap())).await;
    let hello = Frame::Hello(common::identity(&info));
    let handoff = d["handoff"].as_str().unwrap().to_string();
    let payload = bytes::Bytes::from(vec![0u8; 16 << 20]);
    let state = Frame::State(frame::StateFrame {
        handoff_id: "big".into(),
        request_id: "r".into(),
        tokens: vec![],
        descriptors: vec![],
        payload: payload.clone(),
    });
    let mut head = BytesMut::new();
    frame::encode_state_head(&state, &mut head, frame::DEFAULT_MAX_FRAME).unwrap();
    let before = peak_rss(decode.0.id());

    let tasks: Vec<_> = (0..64)
        .map(|_| {
            let (handoff, hello, head, body) = (
                handoff.clone(),
                hello.clone(),
                head.clone(),
                payload.slice(..4 << 20),
            );
            tokio::spawn(async move {
                let stream = TcpStream::connect(&handoff).await.unwrap();
                let mut framed = tokio_util::codec::Framed::new(stream, V2Codec::default());
                framed.send(hello).await.unwrap();
                let ok = framed.next().await;
                assert!(matches!(ok, Some(Ok(Frame::HelloOk(_)))), "{ok:?}");
                let io = framed.get_mut();
                io.write_all(&head).await.unwrap();
                io.write_all(&body).await.unwrap();
                // A refused frame's NACK comes at once; an admitted one waits for the rest
                // of its body (held open until the end of the test).
                let reply = tokio::time::timeout(Duration::from_secs(5), framed.next()).await;
                (reply.ok().flatten().map(Result::unwrap), framed)
            })
        })
        .collect();
    let mut refused = 0;
    let mut open = Vec::new();
    for t in tasks {
        match t.await.unwrap() {
            (Some(Frame::Nack(n)), _) => {
                assert_eq!(n.code, NackCode::Capacity, "{n}");
                assert!(n.reason.contains("no room for a state frame of"), "{n}");
                assert!(n.reason.contains("would exceed the cap of 67108864"), "{n}");
                refused += 1;
            }
            (None, framed) => open.push(framed),
            (other, _) => panic!("expected a NACK or nothing, got {other:?}"),
        }
    }
    let grew = peak_rss(decode.0.id()).saturating_sub(before);
    // 64 MiB of room holds 3 frames of 16 MiB and their metadata.
    assert!(refused >= 60, "{refused} refused");
    assert!(grew < ROOM, "peak RSS grew by {} MiB", grew >> 20);
    eprintln!(
        "64 connections: {refused} refused from their header, {} admitted; peak RSS +{} MiB",
        open.len(),
        grew >> 20
    );
}
