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

    // Meanwhile the node serves a real request through the same listener.
    let (st, _, v) = common::post(
        &format!("{}/v1/chat/completions", s.router),
        &json!({"messages":[{"role":"user","content":"Hi"}],"max_tokens":8,"temperature":0}),
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
