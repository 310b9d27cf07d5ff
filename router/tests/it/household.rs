//! A pool of decode nodes (`--decode-url` repeated), real processes on loopback: each node
//! serves splits and phone-alone answers, identical to one device's; a conversation goes
//! on where it is held; a node killed mid-answer loses nothing, is left out while it is
//! gone and taken again once it is back; a node with another model is refused and does not
//! stop the other.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common;
use crate::processes::{
    local_story, start_three_with, story, stream_and_signal_after, ThreeOptions, ONE_AT_A_TIME,
};

/// Every node on one thread: three engines on this 2-core machine, whose threads spin
/// while they wait for each other, slow each other down many times over otherwise.
const ONE_THREAD: &[&str] = &["--threads", "1"];

fn one_thread() -> Vec<String> {
    vec!["--threads".into(), "1".into()]
}

/// A chat answer's text and `edgesplit` object.
async fn ask(router: &str, body: &Value) -> (String, Value) {
    let (st, _, v) = common::post(&format!("{router}/v1/chat/completions"), body).await;
    assert_eq!(st, 200, "{v}");
    (
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string(),
        v["edgesplit"].clone(),
    )
}

/// The router's `/health`, with every decode node's state.
async fn nodes(router: &str) -> Vec<Value> {
    let h = common::get_json(&format!("{router}/health")).await;
    h["decode_nodes"].as_array().cloned().unwrap_or_default()
}

/// Waits (up to `within`) until `/health` shows decode node `i` in `state`; how long it took.
async fn wait_state(router: &str, i: usize, state: &str, within: Duration) -> Duration {
    let t0 = Instant::now();
    loop {
        let n = nodes(router).await;
        if n.get(i).is_some_and(|n| n["state"] == state) {
            return t0.elapsed();
        }
        assert!(t0.elapsed() < within, "node {i} not {state}: {n:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn with_node(mut body: Value, node: &str) -> Value {
    body["edgesplit"]["node"] = json!(node);
    body
}

#[tokio::test]
async fn each_decode_node_of_a_pool_serves_splits_and_phone_answers_as_one_device() {
    let _one = ONE_AT_A_TIME.lock().await;
    let t = start_three_with(ThreeOptions {
        more_decode: vec![one_thread()],
        decode_extra: ONE_THREAD,
        prefill_extra: ONE_THREAD,
        ..ThreeOptions::new("pool-two")
    })
    .await;
    let urls = [t.decode_grpc.clone(), t.more_decode[0].0.clone()];
    let listed = nodes(&t.router).await;
    assert_eq!(listed.len(), 2, "{listed:?}");
    for (n, url) in listed.iter().zip(&urls) {
        assert_eq!(
            (n["url"].as_str(), n["state"].as_str()),
            (Some(url.as_str()), Some("ready"))
        );
    }
    let want = local_story(&t, 24).await;
    for url in &urls {
        for (transport, handoff) in [("v2", "after"), ("v2", "live"), ("phone", "after")] {
            let mut body = with_node(story(24, false), url);
            body["edgesplit"]["transport"] = json!(transport);
            if transport == "phone" {
                body["edgesplit"].as_object_mut().unwrap().remove("handoff");
            } else {
                body["edgesplit"]["handoff"] = json!(handoff);
            }
            let (text, e) = ask(&t.router, &body).await;
            let what = format!("{transport} {handoff} on {url}: {e}");
            assert_eq!(text, want, "{what}");
            assert_eq!(e["decode_node"], json!(url), "{what}");
            assert!(e["fallback"].is_null(), "{what}");
            assert!(e["decode_node_tokens"].as_u64().unwrap() > 0, "{what}");
        }
    }
    // Each node received the handoffs made to it, and wrote its share of the tokens.
    for n in nodes(&t.router).await {
        assert!(n["handoffs_received"].as_u64().unwrap() >= 1, "{n}");
    }
    let metrics = common::scrape(&format!("{}/metrics", t.router)).await;
    for url in &urls {
        let series = format!("edgesplit:node_tokens_total{{node=\"{url}\"}}");
        assert!(
            common::value(&metrics, &series) > 0.0,
            "{series}:\n{metrics}"
        );
    }
    // A node the router does not have is a 400 naming the field.
    let body = with_node(story(4, false), "http://127.0.0.1:9");
    let (st, _, v) = common::post(&format!("{}/v1/chat/completions", t.router), &body).await;
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["error"]["param"], "edgesplit.node", "{v}");
}

/// A conversation whose first turn the second node wrote goes on there without naming it
/// (the KV is there), as on one device.
#[tokio::test]
async fn a_conversation_goes_on_on_the_node_that_holds_it() {
    let _one = ONE_AT_A_TIME.lock().await;
    let t = start_three_with(ThreeOptions {
        more_decode: vec![one_thread()],
        decode_extra: ONE_THREAD,
        prefill_extra: ONE_THREAD,
        router_extra: &["--no-probes"],
        ..ThreeOptions::new("pool-held")
    })
    .await;
    let second = t.more_decode[0].0.clone();
    let questions = ["Name two rivers of Europe.", "Which of them is longer?"];
    let mut messages = json!([{"role": "user", "content": questions[0]}]);
    for i in 0..questions.len() {
        let body = |transport: &str| {
            json!({
                "messages": messages, "max_tokens": 24, "temperature": 0,
                "edgesplit": {"transport": transport, "handoff": "after"},
            })
        };
        let mut local = body("local");
        local["edgesplit"]
            .as_object_mut()
            .unwrap()
            .remove("handoff");
        let (want, _) = ask(&t.router, &local).await;
        let split = if i == 0 {
            with_node(body("v2"), &second)
        } else {
            body("v2")
        };
        let (text, e) = ask(&t.router, &split).await;
        assert_eq!(text, want, "turn {}: {e}", i + 1);
        assert_eq!(e["decode_node"], json!(second), "turn {}: {e}", i + 1);
        if i > 0 {
            assert_eq!(e["placement"], "decode_node", "continued where held: {e}");
        }
        if let Some(next) = questions.get(i + 1) {
            let m = messages.as_array_mut().unwrap();
            m.push(json!({"role": "assistant", "content": want}));
            m.push(json!({"role": "user", "content": next}));
        }
    }
}

/// The second node killed while it writes an answer: the answer completes, identical, the
/// fallback named; the node is left out (requests go to the first) until it answers again,
/// on the same address, within about a second of its return. Then it is removed and added
/// again while the router serves (`/admin/decode-nodes`).
#[tokio::test]
async fn a_decode_node_killed_mid_answer_loses_nothing_and_is_taken_again_once_back() {
    let _one = ONE_AT_A_TIME.lock().await;
    let mut t = start_three_with(ThreeOptions {
        more_decode: vec![one_thread()],
        decode_extra: ONE_THREAD,
        prefill_extra: ONE_THREAD,
        ..ThreeOptions::new("pool-kill")
    })
    .await;
    let (first, second) = (t.decode_grpc.clone(), t.more_decode[0].0.clone());
    let want = local_story(&t, 120).await;
    let body = with_node(story(120, true), &second);
    let pid = libc::pid_t::try_from(t.more_decode[0].1.id()).unwrap();
    let router = t.router.clone();
    let (text, timing, _) = stream_and_signal_after(&router, &body, 12, || async {
        // SAFETY: sends a signal to our own child process; no memory is shared.
        assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    })
    .await;
    assert_eq!(text, want, "{timing}");
    assert!(timing["fallback"].is_string(), "{timing}");
    let _ = t.more_decode[0].1.wait();
    wait_state(&t.router, 1, "down", Duration::from_secs(5)).await;
    // Left out: a phone answer that names no node goes to the first.
    let mut phone = story(8, false);
    phone["edgesplit"] = json!({"transport": "phone"});
    let (_, e) = ask(&t.router, &phone).await;
    assert_eq!(e["decode_node"], json!(first), "{e}");
    assert!(e["fallback"].is_null(), "{e}");
    // Back on the same address: taken again within about a second.
    let listen = second.trim_start_matches("http://").to_string();
    let dir = t.dir.clone();
    let model = common::model(common::SMOLLM2).display().to_string();
    let args: Vec<String> = [
        "--model",
        &model,
        "--n-ctx",
        "1024",
        "--listen",
        &listen,
        "--handoff-listen",
        "127.0.0.1:0",
        "--v1-listen",
        "127.0.0.1:0",
        "--flash-attn",
        "auto",
        "--cache-type-k",
        "f16",
        "--cache-type-v",
        "f16",
    ]
    .iter()
    .map(|s| (*s).to_string())
    .collect();
    let log = dir.join("decode-2-again.log");
    let _back = crate::processes::spawn("edgesplit-decode", &args, &log);
    crate::processes::reported(&log, "decode node listening").await;
    let took = wait_state(&t.router, 1, "ready", Duration::from_secs(10)).await;
    assert!(took < Duration::from_millis(1500), "{took:?}");
    let (text, e) = ask(&t.router, &with_node(story(24, false), &second)).await;
    assert_eq!(e["decode_node"], json!(second), "{e}");
    assert!(e["fallback"].is_null(), "{e}");
    assert_eq!(text, local_story(&t, 24).await);

    // Removed while the router serves: a request naming it is a 400; added again: ready
    // at once, and it serves.
    let admin = format!("{}/admin/decode-nodes", t.router);
    let node = json!({"url": second});
    let r = common::client()
        .delete(&admin)
        .json(&node)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(nodes(&t.router).await.len(), 1);
    let body = with_node(story(4, false), &second);
    let (st, _, v) = common::post(&format!("{}/v1/chat/completions", t.router), &body).await;
    assert_eq!(
        (st, &v["error"]["param"]),
        (400, &json!("edgesplit.node")),
        "{v}"
    );
    let (st, _, v) = common::post(&admin, &node).await;
    assert_eq!((st, &v["state"]), (200, &json!("ready")), "{v}");
    let (st, _, v) = common::post(&admin, &node).await;
    assert_eq!(
        (st, &v["error"]["param"]),
        (400, &json!("url")),
        "added twice: {v}"
    );
    let listed = common::get_json(&admin).await;
    assert_eq!(
        listed["decode_nodes"].as_array().map(Vec::len),
        Some(2),
        "{listed}"
    );
    let (_, e) = ask(&t.router, &with_node(story(8, false), &second)).await;
    assert_eq!(e["decode_node"], json!(second), "{e}");
    assert!(e["fallback"].is_null(), "{e}");
}

/// A second node holding another model: the router lists it as refused, with why, and
/// every request goes to the first.
#[tokio::test]
async fn a_decode_node_with_another_model_is_refused_and_the_other_serves() {
    let _one = ONE_AT_A_TIME.lock().await;
    let gemma = common::model(common::GEMMA3).display().to_string();
    let t = start_three_with(ThreeOptions {
        more_decode: vec![vec![
            "--model".into(),
            gemma,
            "--threads".into(),
            "1".into(),
        ]],
        decode_extra: ONE_THREAD,
        prefill_extra: ONE_THREAD,
        ..ThreeOptions::new("pool-refused")
    })
    .await;
    wait_state(&t.router, 1, "refused", Duration::from_secs(5)).await;
    let listed = nodes(&t.router).await;
    let why = listed[1]["why"].as_str().unwrap_or_default();
    assert!(why.contains("another model"), "{listed:?}");
    let want = local_story(&t, 16).await;
    for transport in ["v2", "phone", "auto"] {
        let mut body = story(16, false);
        body["edgesplit"] = json!({"transport": transport});
        let (text, e) = ask(&t.router, &body).await;
        assert_eq!(text, want, "{transport}: {e}");
        assert!(e["fallback"].is_null(), "{transport}: {e}");
        if transport != "auto" || e["mode"] != "local" {
            assert_eq!(e["decode_node"], json!(t.decode_grpc), "{transport}: {e}");
        }
    }
}
