//! A client that goes away cancels its generation: the node writing the answer stops and
//! its sequence is free for the next request (`requests_in_flight` back to 0 in `Info`).

use crate::common;

use std::time::{Duration, Instant};

use edgesplit_proto::pb;
use serde_json::json;

async fn in_flight(s: &common::Stack) -> (u64, u64) {
    let mut d = pb::decode_client::DecodeClient::connect(s.decode_grpc.clone())
        .await
        .unwrap();
    let mut p = pb::prefill_client::PrefillClient::connect(s.prefill_grpc.clone())
        .await
        .unwrap();
    let d = d.info(pb::InfoRequest {}).await.unwrap().into_inner();
    let p = p.info(pb::InfoRequest {}).await.unwrap().into_inner();
    (p.requests_in_flight, d.requests_in_flight)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_frees_the_node() {
    // Its own stack: the in-flight counts it asserts are global to the nodes, and the
    // shared stack serves other modules' tests at the same time.
    let stack = common::start(common::StackOptions::new(common::SMOLLM2));
    let s = &stack;
    let url = format!("{}/v1/completions", s.router);
    for transport in ["v2", "local"] {
        let body = json!({
            "prompt": common::counting_prompt(),
            "max_tokens": 1500, "temperature": 0, "stream": true,
            "edgesplit": {"transport": transport},
        });
        let mut resp = common::client()
            .post(&url)
            .json(&body)
            .send()
            .await
            .unwrap();
        // Read until the answer is well under way, then hang up.
        let mut seen = String::new();
        while seen.len() < 2000 {
            let c = resp.chunk().await.unwrap().expect("the stream goes on");
            seen.push_str(&String::from_utf8_lossy(&c));
        }
        let (p, d) = in_flight(s).await;
        assert_eq!(p + d, 1, "{transport}: one node is writing the answer");
        drop(resp);
        let t0 = Instant::now();
        loop {
            if in_flight(s).await == (0, 0) {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(5),
                "{transport}: the generation went on after the client left"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The node serves the next request at once.
        let (st, _, v) = common::post(
            &url,
            &json!({"prompt": "Hello", "max_tokens": 4, "edgesplit": {"transport": transport}}),
        )
        .await;
        assert_eq!(st, 200, "{v}");
    }
}
