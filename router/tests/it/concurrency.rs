//! Sixteen streaming clients at once through the real router and nodes: every one gets a
//! complete answer (zero failures, no fallback), each identical to the same request run
//! alone on the single-device path, and the decode node really serves several sequences
//! at once.

use crate::common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use edgesplit_proto::pb;
use serde_json::{json, Value};

const QUESTIONS: [&str; 8] = [
    "Name three rivers.",
    "What is a prime number?",
    "Write a haiku about rain.",
    "Why is the sky blue?",
    "Give me two colours.",
    "What do cats eat?",
    "Say hello in French.",
    "What is 2 + 2?",
];

fn body(i: usize) -> Value {
    let mut b = common::chat_body(
        json!([{"role": "user", "content": QUESTIONS[i]}]),
        json!({"max_tokens": 32, "temperature": 0}),
    );
    // Half greedy, half seeded sampling.
    if i % 2 == 1 {
        b["temperature"] = json!(0.8);
        b["top_p"] = json!(0.95);
        b["seed"] = json!(100 + i);
    }
    b
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_concurrent_streaming_clients_all_get_the_single_device_answer() {
    let mut o = common::StackOptions::new(common::SMOLLM2);
    o.parallel = 4;
    let s: &'static common::Stack = Box::leak(Box::new(common::start(o)));
    let path = "/v1/chat/completions";
    // The single-device answers, one request at a time.
    let mut reference = Vec::new();
    for i in 0..QUESTIONS.len() {
        reference.push(common::run(s, path, &body(i), "local", true).await);
    }

    // Watch the decode node while the clients run: the most answers it wrote at once.
    let peak = Arc::new(AtomicU64::new(0));
    let watching = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let watcher = tokio::spawn({
        let (peak, watching) = (peak.clone(), watching.clone());
        let url = s.decode_grpc.clone();
        async move {
            let mut d = pb::decode_client::DecodeClient::connect(url).await.unwrap();
            while watching.load(Ordering::Relaxed) {
                let info = d.info(pb::InfoRequest {}).await.unwrap().into_inner();
                assert_eq!(info.parallel, 4);
                peak.fetch_max(u64::from(info.sequences_active), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });

    // 16 clients: each question twice, once over V2 and once over V1.
    let clients: Vec<_> = (0..16)
        .map(|c| {
            let i = c % QUESTIONS.len();
            let transport = if c < QUESTIONS.len() { "v2" } else { "v1" };
            tokio::spawn(async move {
                (
                    i,
                    transport,
                    common::run(s, path, &body(i), transport, true).await,
                )
            })
        })
        .collect();
    let mut failures = Vec::new();
    let mut answers = 0;
    for c in clients {
        match c.await {
            Ok((i, transport, got)) => {
                answers += 1;
                assert_eq!(
                    got, reference[i],
                    "question {i} over {transport} differs from the single-device answer"
                );
            }
            Err(e) => failures.push(e.to_string()),
        }
    }
    watching.store(false, Ordering::Relaxed);
    watcher.await.unwrap();
    assert!(failures.is_empty(), "failed clients: {failures:?}");
    assert_eq!(answers, 16);
    let peak = peak.load(Ordering::Relaxed);
    assert!(
        peak >= 2,
        "the decode node never wrote two answers at once (peak {peak})"
    );
    // Every answer came from the split path: none needed the fallback (the router admits
    // as many answers as the decode node has sequences; the rest wait at the door).
    assert_eq!(common::fallbacks(s).await, 0);
}
