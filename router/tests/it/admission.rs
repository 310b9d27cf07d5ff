//! Memory-aware admission: a decode node with a KV budget makes the router refuse, before
//! any prefill, a request whose KV would not fit, with a clear error; the node stays healthy.

use crate::common;

use serde_json::json;

#[tokio::test]
async fn requests_over_the_kv_budget_are_refused_before_prefill() {
    let mut opts = common::StackOptions::new(common::SMOLLM2);
    opts.kv_budget_bytes = 100 * 23_040; // 100 tokens of SmolLM2 KV
    let s = common::start(opts);
    let url = format!("{}/v1/chat/completions", s.router);
    let msg = json!([{"role": "user", "content": "Hi"}]);

    let (st, _, v) = common::post(&url, &json!({"messages": msg, "max_tokens": 200})).await;
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["error"]["code"], "kv_budget_exceeded");
    let m = v["error"]["message"].as_str().unwrap();
    assert!(
        m.contains("2304000 bytes") && m.contains("100 tokens"),
        "{m}"
    );

    // Within the budget: served, on both disaggregated transports.
    for transport in ["v2", "v1"] {
        let (st, _, v) = common::post(
            &url,
            &json!({"messages": msg, "max_tokens": 20, "temperature": 0,
                    "edgesplit": {"transport": transport}}),
        )
        .await;
        assert_eq!(st, 200, "{transport}: {v}");
    }
    // No max_tokens: the answer is capped at what the budget allows.
    let (st, _, v) = common::post(
        &url,
        &json!({"messages": [{"role":"user","content":"Write a very long story about ships."}],
                "temperature": 0, "edgesplit": {"return_token_ids": true}}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let total = v["usage"]["total_tokens"].as_u64().unwrap();
    assert!(total <= 100, "{total} tokens exceed the budget");

    let health = common::client()
        .get(format!("{}/health", s.router))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
}
