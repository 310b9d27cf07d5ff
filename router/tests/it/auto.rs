//! `transport: "auto"`: the router chooses the mode per request from the rates it
//! measured; whatever it chooses, the answer is the one-device answer, and the answer says
//! which mode, why, and what was predicted.

use std::sync::atomic::{AtomicBool, Ordering};

use serde_json::{json, Value};

use crate::common::{self, Outcome};

const PATH: &str = "/v1/chat/completions";

fn body(edgesplit: Value) -> Value {
    common::chat_body(
        json!([
            {"role": "system", "content": "You are a geography teacher. Answer in plain sentences, \
                                          without lists, and keep to facts a textbook would state."},
            {"role": "user", "content": "Name three rivers of Europe and one fact about each."}
        ]),
        json!({"max_tokens": 24, "temperature": 0, "cache_prompt": false,
               "edgesplit": edgesplit}),
    )
}

async fn ask(s: &common::Stack, edgesplit: Value) -> (Outcome, Value) {
    let mut edgesplit = edgesplit;
    edgesplit["return_token_ids"] = json!(true);
    common::send(s, PATH, &body(edgesplit), false).await
}

#[tokio::test]
async fn auto_chooses_from_what_it_measured_and_answers_as_one_device() {
    let s = common::start(common::StackOptions::new(common::SMOLLM2));
    let (local, _) = ask(&s, json!({"transport": "local"})).await;

    // Nothing measured of the phone or the link yet (only the laptop's local answer): the
    // split modes cannot be predicted; the phone alone neither.
    let (o, e) = ask(&s, json!({"transport": "auto", "objective": "offload"})).await;
    assert_eq!(o, local, "{e}");
    assert_eq!(e["objective"], "offload", "{e}");
    assert!(
        e["reason"]
            .as_str()
            .unwrap()
            .contains("not yet measured: live, after, phone"),
        "{e}"
    );
    assert_eq!(e["mode"], "local", "{e}");
    assert_eq!(e["transport"], "local", "{e}");

    // Every rate measured: an `after` split (the link, the phone's decode), the phone alone
    // (its prefill), and the round trip of the decode node's `Info` on the way.
    for t in [("v2", "after"), ("phone", "")] {
        let mut es = json!({"transport": t.0});
        if !t.1.is_empty() {
            es["handoff"] = json!(t.1);
        }
        let (o, e) = ask(&s, es).await;
        assert_eq!(o, local, "{t:?}: {e}");
    }
    for objective in ["latency", "offload", "balanced"] {
        let (o, e) = ask(&s, json!({"transport": "auto", "objective": objective})).await;
        assert_eq!(o, local, "{objective}: {e}");
        let reason = e["reason"].as_str().unwrap();
        for mode in ["local", "live", "after", "phone"] {
            assert!(reason.contains(&format!(" {mode} ")), "{objective}: {e}");
        }
        assert!(!reason.contains("not yet measured"), "{objective}: {e}");
        assert!(e["predicted_ms"].as_f64().unwrap() > 0.0, "{e}");
        let transport = match e["mode"].as_str().unwrap() {
            "local" => "local",
            "phone" => "phone",
            "live" | "after" => "v2",
            other => panic!("mode {other}: {e}"),
        };
        assert_eq!(e["transport"], transport, "{e}");
        if transport == "v2" {
            assert_eq!(e["handoff_mode"], e["mode"], "{e}");
        }
    }

    // A handoff mode the request names still wins: split in that mode.
    let (o, e) = ask(&s, json!({"transport": "auto", "handoff": "after"})).await;
    assert_eq!(o, local, "{e}");
    assert_eq!(
        (&e["mode"], &e["transport"]),
        (&json!("after"), &json!("v2")),
        "{e}"
    );

    // The choices are counted by mode and objective.
    let metrics = common::scrape(&format!("{}/metrics", s.router)).await;
    assert!(
        metrics.contains("edgesplit:auto_choices_total{mode=\"after\",objective=\"balanced\"}"),
        "{metrics}"
    );
}

/// The product's default: before its first `auto` choice the router measures the laptop,
/// the phone and the link with probes of its own (the calibration, `backend/probe.rs`), so
/// a fresh router's first request is chosen from figures: every mode predicted, none "not
/// yet measured", and the answer is the one-device answer.
#[tokio::test]
async fn a_fresh_router_chooses_from_figures_from_its_first_request() {
    let mut opts = common::StackOptions::new(common::SMOLLM2);
    opts.probes = true;
    opts.warmup = true;
    let s = common::start(opts);
    let mut plain = body(Value::Null);
    plain.as_object_mut().unwrap().remove("edgesplit");
    let (o, e) = common::send(&s, PATH, &plain, true).await;
    let reason = e["reason"].as_str().unwrap();
    for mode in ["local", "live", "after", "phone"] {
        assert!(reason.contains(&format!(" {mode} ")), "{e}");
    }
    assert!(!reason.contains("measured yet"), "{e}");
    assert!(e["predicted_ms"].as_f64().unwrap() > 0.0, "{e}");
    let (e2e, actual) = (
        e["e2e_ms"].as_f64().unwrap(),
        e["actual_ms"].as_f64().unwrap(),
    );
    assert!(actual > 0.0 && actual <= e2e, "{e}");
    // The probes are the router's own: not counted as answers. The answer's actual end
    // over its predicted is.
    let metrics = common::scrape(&format!("{}/metrics", s.router)).await;
    assert_eq!(
        common::value(&metrics, "edgesplit:e2e_request_latency_seconds_count"),
        1.0,
        "{metrics}"
    );
    let mode = e["mode"].as_str().unwrap();
    let series = format!("edgesplit:auto_actual_over_predicted_count{{mode=\"{mode}\"}}");
    assert_eq!(common::value(&metrics, &series), 1.0, "{metrics}");
    let (local, _) = ask(&s, json!({"transport": "local"})).await;
    assert_eq!(o, local.without_ids(), "{e}");
}

/// The router's default is its own choice: a request that names nothing is `auto` under
/// `balanced`. On a router that has measured nothing (its probes off), that is a live v2
/// split, and the answer says so and why.
#[tokio::test]
async fn a_request_that_names_nothing_is_the_routers_choice() {
    let s = common::start(common::StackOptions::new(common::SMOLLM2));
    let mut plain = body(Value::Null);
    plain.as_object_mut().unwrap().remove("edgesplit");
    let (o, e) = common::send(&s, PATH, &plain, true).await;
    assert_eq!(
        (&e["mode"], &e["objective"]),
        (&json!("live"), &json!("balanced")),
        "{e}"
    );
    assert!(
        e["reason"]
            .as_str()
            .unwrap()
            .contains("no rate measured yet"),
        "{e}"
    );
    assert_eq!(e["transport"], "v2", "{e}");
    common::assert_split(&e, o.completion_tokens);
    let (local, _) = ask(&s, json!({"transport": "local"})).await;
    assert_eq!(o, local.without_ids(), "{e}");
    // And `common::run_plain`'s checks hold for what it chooses once it has measured.
    let o = common::run_plain(&s, PATH, &plain, false).await;
    assert_eq!(o, local.without_ids());
}

/// Set: the proxy in front of the decode node's gRPC listener refuses everything.
static PHONE_GONE: AtomicBool = AtomicBool::new(false);

fn phone_proxy(target: String) -> String {
    common::cuttable_proxy(target, &PHONE_GONE)
}

/// `auto` chose the phone alone, and the phone cannot take the answer (here: gone since it
/// was measured): the laptop answers, as a split that finds no decode node does, and the
/// answer says so. (A client that names `phone` gets the 503 instead: `phone` is never
/// answered elsewhere.)
#[tokio::test]
async fn a_phone_chosen_but_gone_is_answered_on_the_laptop() {
    // Its choice rests on the phone measured about as fast as the laptop: not beside the
    // tests that run several nodes of their own, which would slow the phone's figures.
    let _one = crate::processes::ONE_AT_A_TIME.lock().await;
    let mut o = common::StackOptions::new(common::SMOLLM2);
    o.decode_proxy = Some(phone_proxy);
    let s = common::start(o);
    let (local, _) = ask(&s, json!({"transport": "local"})).await;
    for es in [
        json!({"transport": "v2", "handoff": "after"}),
        json!({"transport": "phone"}),
    ] {
        let (o, e) = ask(&s, es).await;
        assert_eq!(o, local, "{e}");
    }
    PHONE_GONE.store(true, Ordering::SeqCst);
    // `offload`: the least laptop time among the modes that end in time; the phone alone
    // takes none, and on this loopback pair it ends about when the laptop alone does.
    let (o, e) = ask(&s, json!({"transport": "auto", "objective": "offload"})).await;
    assert_eq!(e["mode"], "phone", "{e}");
    // Refused at connect, or the kept connection cut as it was used: either says so.
    let unavailable = [json!("decode_unavailable"), json!("node_unavailable")];
    assert!(unavailable.contains(&e["fallback"]), "{e}");
    assert_eq!(e["decode_node_tokens"], 0, "{e}");
    assert_eq!(o, local, "{e}");
    let (status, _, v) = common::post(
        &format!("{}{PATH}", s.router),
        &body(json!({"transport": "phone"})),
    )
    .await;
    assert_eq!(status, 503, "{v}");
    assert!(unavailable.contains(&v["error"]["code"]), "{v}");
}

#[tokio::test]
async fn an_unknown_objective_is_a_400_naming_it() {
    let s = common::start(common::StackOptions::new(common::SMOLLM2));
    let (status, _, v) = common::post(
        &format!("{}{PATH}", s.router),
        &body(json!({"transport": "auto", "objective": "fastest"})),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "edgesplit.objective", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("\"fastest\""),
        "{v}"
    );
}

/// A request that sets no `max_tokens` is expected to write as many tokens as the recent
/// answers that set none (256 before one has ended), not the default at every request: the
/// choice weighed `predicted_tokens`. A `max_tokens` is what its request is expected to
/// write, and an answer cut by one says nothing of the others' length.
#[tokio::test]
async fn an_answer_without_max_tokens_is_expected_as_long_as_recent_ones() {
    let s = common::start(common::StackOptions::new(common::SMOLLM2));
    let question = json!([{"role": "user", "content": "What is the capital of France? Answer in one short sentence."}]);
    let open = common::chat_body(
        question.clone(),
        json!({"temperature": 0, "edgesplit": {"transport": "auto"}}),
    );
    let capped = common::chat_body(
        question,
        json!({"temperature": 0, "max_tokens": 5, "edgesplit": {"transport": "auto"}}),
    );
    let (first, e) = common::send(&s, PATH, &open, false).await;
    assert_eq!(first.finish_reason, "stop", "{e}");
    assert!(first.completion_tokens < 256, "{e}");
    assert_eq!(e["predicted_tokens"], 256, "{e}");
    let (o, e) = common::send(&s, PATH, &capped, false).await;
    assert_eq!(o.completion_tokens, 5, "{e}");
    assert_eq!(e["predicted_tokens"], 5, "{e}");
    let (o, e) = common::send(&s, PATH, &open, false).await;
    assert_eq!(o, first, "{e}");
    assert_eq!(e["predicted_tokens"], first.completion_tokens, "{e}");
}
