//! A real request moves the right Prometheus series on the router and the decode node.

use crate::common;

use serde_json::json;

use common::{scrape, value};

#[tokio::test]
async fn a_request_moves_the_series() {
    let s = common::start(common::StackOptions::new(common::SMOLLM2));
    let router_metrics = format!("{}/metrics", s.router);
    let decode_metrics = s.v1_url.replace("/v1/handoff", "/metrics");
    let r0 = scrape(&router_metrics).await;
    let d0 = scrape(&decode_metrics).await;
    let p0 = scrape(&s.prefill_metrics).await;
    assert!(
        r0.contains("# TYPE edgesplit:time_to_first_token_seconds histogram"),
        "{r0}"
    );

    let url = format!("{}/v1/chat/completions", s.router);
    let (st, _, v) = common::post(
        &url,
        // `after`: the series below are that handoff's (the live one's are `v2-live`).
        &json!({"messages":[{"role":"user","content":"Count to five."}],"max_tokens":6,"temperature":0,
                "edgesplit": {"handoff": "after"}}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let (st, _, _) = common::post(
        &url,
        &json!({"messages":[{"role":"user","content":"x"}],"model":"nope"}),
    )
    .await;
    assert_eq!(st, 404);

    let r1 = scrape(&router_metrics).await;
    let d1 = scrape(&decode_metrics).await;
    let p1 = scrape(&s.prefill_metrics).await;
    let delta = |t0: &str, t1: &str, series: &str| value(t1, series) - value(t0, series);
    let prompt = v["usage"]["prompt_tokens"].as_f64().unwrap();
    let bytes = v["edgesplit"]["handoff_bytes"].as_f64().unwrap();
    assert_eq!(delta(&r0, &r1, "edgesplit:prompt_tokens_total"), prompt);
    assert_eq!(delta(&r0, &r1, "edgesplit:generation_tokens_total"), 6.0);
    assert_eq!(
        delta(&r0, &r1, "edgesplit:time_to_first_token_seconds_count"),
        1.0
    );
    assert_eq!(
        delta(&r0, &r1, "edgesplit:e2e_request_latency_seconds_count"),
        1.0
    );
    assert_eq!(
        delta(&r0, &r1, "edgesplit:inter_token_latency_seconds_count"),
        5.0
    );
    assert_eq!(
        delta(
            &r0,
            &r1,
            "edgesplit:request_success_total{finished_reason=\"length\"}"
        ),
        1.0
    );
    assert_eq!(
        delta(
            &r0,
            &r1,
            "edgesplit:request_failure_total{code=\"model_not_found\"}"
        ),
        1.0
    );
    assert_eq!(
        delta(&r0, &r1, "edgesplit:handoff_bytes_total{transport=\"v2\"}"),
        bytes
    );
    assert_eq!(
        delta(
            &r0,
            &r1,
            "edgesplit:handoff_seconds_count{transport=\"v2\",outcome=\"ok\"}"
        ),
        1.0,
        "{}",
        r1.lines()
            .filter(|l| l.contains("handoff_seconds"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert_eq!(value(&r1, "edgesplit:num_requests_running"), 0.0);
    assert_eq!(value(&r1, "edgesplit:num_requests_waiting"), 0.0);
    // The decode node counted the same bytes, and holds no KV once the answer is done.
    assert_eq!(delta(&d0, &d1, "edgesplit:handoffs_received_total"), 1.0);
    assert_eq!(
        delta(&d0, &d1, "edgesplit:handoff_bytes_received_total"),
        bytes
    );
    assert_eq!(value(&d1, "edgesplit:kv_bytes_in_use"), 0.0);
    assert_eq!(value(&d1, "edgesplit:pending_handoff_bytes"), 0.0);
    assert!(value(&d1, "edgesplit:mem_available_bytes") > 0.0);
    // The prefill node saw the same prompt and sent the same bytes.
    assert_eq!(delta(&p0, &p1, "edgesplit:prompt_tokens_total"), prompt);
    assert_eq!(
        delta(&p0, &p1, "edgesplit:request_prefill_time_seconds_count"),
        1.0
    );
    assert_eq!(
        delta(&p0, &p1, "edgesplit:handoff_bytes_total{transport=\"v2\"}"),
        bytes
    );
    assert_eq!(
        delta(
            &p0,
            &p1,
            "edgesplit:handoff_seconds_count{transport=\"v2\",outcome=\"ok\"}"
        ),
        1.0
    );
}
