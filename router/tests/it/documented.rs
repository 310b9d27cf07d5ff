//! Documented behaviour that had no test of its own: the `X-EdgeSplit-Transport` header,
//! reproducing a sampled answer from the seed the router drew, `--max-body-bytes`, and
//! `queue_timeout`.

use crate::common;

use std::time::{Duration, Instant};

use serde_json::{json, Value};

async fn post_with_header(url: &str, body: &Value, transport: &str) -> (u16, Value) {
    let r = common::client()
        .post(url)
        .header("X-EdgeSplit-Transport", transport)
        .json(body)
        .send()
        .await
        .unwrap();
    let st = r.status().as_u16();
    (st, r.json().await.unwrap_or_default())
}

#[tokio::test]
async fn the_transport_header_picks_the_transport_and_the_body_wins() {
    let s = common::smollm2();
    let url = format!("{}/v1/chat/completions", s.router);
    let body = common::chat_body(
        json!([{"role": "user", "content": "Hi!"}]),
        json!({"max_tokens": 6, "temperature": 0}),
    );
    for t in ["local", "v1", "v2"] {
        let (st, v) = post_with_header(&url, &body, t).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["edgesplit"]["transport"], t, "{v}");
        assert!(v["edgesplit"]["fallback"].is_null(), "{v}");
        // Only a split moves a state.
        assert_eq!(
            v["edgesplit"]["handoff_bytes"].is_null(),
            t == "local",
            "{v}"
        );
        if t != "local" {
            // ... and the decode node wrote the answer after the prefill node's part.
            common::assert_split(
                &v["edgesplit"],
                v["usage"]["completion_tokens"].as_u64().unwrap(),
            );
        }
    }
    // The request body's own choice wins over the header.
    let mut local = body.clone();
    local["edgesplit"] = json!({"transport": "local"});
    let (st, v) = post_with_header(&url, &local, "v2").await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["edgesplit"]["transport"], "local", "{v}");
    // A bad header is a 400 that names it.
    let (st, v) = post_with_header(&url, &body, "carrier-pigeon").await;
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["error"]["param"], "X-EdgeSplit-Transport", "{v}");
}

#[tokio::test]
async fn a_sampled_answer_is_reproduced_from_the_seed_the_router_drew() {
    let s = common::smollm2();
    let url = format!("{}/v1/chat/completions", s.router);
    let ask = |extra: Value| {
        let mut b = common::chat_body(
            json!([{"role": "user", "content": "Invent a name for a cat."}]),
            json!({"max_tokens": 16, "temperature": 1.0,
                   "edgesplit": {"transport": "v2", "return_token_ids": true}}),
        );
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let (st, _, first) = common::post(&url, &ask(json!({}))).await;
    assert_eq!(st, 200, "{first}");
    let seed = first["edgesplit"]["seed"].as_u64().expect("the drawn seed");
    let (st, _, again) = common::post(&url, &ask(json!({ "seed": seed }))).await;
    assert_eq!(st, 200, "{again}");
    assert_eq!(
        again["edgesplit"]["token_ids"], first["edgesplit"]["token_ids"],
        "seed {seed} did not reproduce the answer"
    );
    assert_eq!(again["edgesplit"]["seed"], seed);
}

#[tokio::test]
async fn a_body_over_max_body_bytes_is_a_413_error_object() {
    let s = common::smollm2();
    let url = format!("{}/v1/chat/completions", s.router);
    // The default --max-body-bytes is 8 MiB.
    let content = "a".repeat(8 * 1024 * 1024);
    let body = common::chat_body(json!([{"role": "user", "content": content}]), json!({}));
    let (st, _, v) = common::post(&url, &body).await;
    assert_eq!(st, 413, "{v}");
    assert_eq!(v["error"]["code"], "invalid_body", "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_queued_past_queue_timeout_gets_503_queue_timeout() {
    let mut o = common::StackOptions::new(common::SMOLLM2);
    o.max_in_flight = Some(1);
    o.max_queue = 4;
    o.queue_timeout_s = 1;
    let s = common::start(o);
    let url = format!("{}/v1/completions", s.router);
    let long = json!({"prompt": common::counting_prompt(), "max_tokens": 200, "temperature": 0});
    let first = tokio::spawn({
        let url = url.clone();
        async move { common::post(&url, &long).await }
    });
    common::wait_for_gauge(&s, "edgesplit:num_requests_running", 1).await;
    let t0 = Instant::now();
    let (st, headers, v) = common::post(&url, &json!({"prompt": "Hi", "max_tokens": 4})).await;
    let waited = t0.elapsed();
    assert_eq!(st, 503, "{v}");
    assert_eq!(v["error"]["code"], "queue_timeout", "{v}");
    assert!(headers.contains_key("retry-after"));
    assert!(waited >= Duration::from_secs(1), "{waited:?}");
    let (st, _, v) = first.await.unwrap();
    assert_eq!(st, 200, "{v}");
}
