//! Back-pressure at the router: with one slot and a queue of one, a first answer runs, a
//! second waits and is then served, a third is refused at once with 503 `queue_full` and
//! Retry-After - never a hang.

use crate::common;

use std::time::{Duration, Instant};

use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_the_queue_requests_get_503_with_retry_after() {
    let mut o = common::StackOptions::new(common::SMOLLM2);
    o.max_in_flight = Some(1);
    o.max_queue = 1;
    let s = common::start(o);
    let url = format!("{}/v1/completions", s.router);
    // A raw prompt the model keeps continuing, long enough to hold the slot.
    let long = json!({"prompt": common::counting_prompt(), "max_tokens": 120, "temperature": 0});
    let first = tokio::spawn({
        let (url, long) = (url.clone(), long.clone());
        async move { common::post(&url, &long).await }
    });
    // The order is made by polling the router's gauges, not by sleeping: the first holds
    // the slot (it is streaming), then the second is in the queue.
    common::wait_for_gauge(&s, "edgesplit:num_requests_running", 1).await;
    let second = tokio::spawn({
        let url = url.clone();
        async move { common::post(&url, &json!({"prompt": "Hello", "max_tokens": 4})).await }
    });
    common::wait_for_gauge(&s, "edgesplit:num_requests_queued", 1).await;
    let t0 = Instant::now();
    let (st, headers, v) = common::post(&url, &json!({"prompt": "Hi", "max_tokens": 4})).await;
    assert_eq!(st, 503, "{v}");
    assert_eq!(v["error"]["code"], "queue_full", "{v}");
    assert!(headers.contains_key("retry-after"));
    assert!(t0.elapsed() < Duration::from_secs(1), "refused at once");
    let (st1, _, v1) = first.await.unwrap();
    assert_eq!(st1, 200, "{v1}");
    assert_eq!(
        v1["usage"]["completion_tokens"], 120,
        "the first held its slot to the end"
    );
    let (st2, _, v2) = second.await.unwrap();
    assert_eq!(st2, 200, "the queued request was served: {v2}");
}
