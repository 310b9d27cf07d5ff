//! The OpenAI API shape and error cases, against the real services and model.

use crate::common;

use std::time::{Duration, Instant};

use crate::common::{chat_body, chunks, post, post_raw, smollm2, stream};
use serde_json::{json, Value};

fn hi() -> Value {
    json!([{"role": "user", "content": "Hello, who are you?"}])
}

#[tokio::test]
async fn chat_completion_shape_and_usage() {
    let s = smollm2();
    let url = format!("{}/v1/chat/completions", s.router);
    let body = chat_body(
        hi(),
        // `after`: the handoff report below is that mode's (its connect and hashing).
        json!({"temperature": 0, "max_tokens": 5,
               "edgesplit": {"return_token_ids": true, "handoff": "after"},
               "user": "tester", "logprobs": false}),
    );
    let (status, _, v) = post(&url, &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["model"], "SmolLM2-135M-Instruct.Q4_1");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 5);
    assert_eq!(v["edgesplit"]["token_ids"].as_array().unwrap().len(), 5);
    let p = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(v["usage"]["total_tokens"].as_u64().unwrap(), p + 5);
    // The timing report of the V2 path.
    let t = &v["edgesplit"];
    assert_eq!(t["transport"], "v2");
    assert_eq!(t["first_token_from"], "prefill");
    assert!(t["prefill_ms"].as_f64().unwrap() > 0.0);
    assert!(t["handoff_bytes"].as_u64().unwrap() >= p * 23_040, "{t}");
    assert!(t["handoff_ms"].as_f64().unwrap() > 0.0);
    assert!(t["decode_tokens_per_s"].as_f64().unwrap() > 0.0);
    assert_eq!(t["decode_tokens"], 4);
    assert_eq!(t["decode_node_tokens"], 4);
    // Where the handoff's time went, each part measured and inside the span it belongs to:
    // the sender's connect and hashing inside its connect-to-ACK, the receiver's receipt
    // too (it starts after the connect and ends before the ACK), its check inside that.
    let part = |k: &str| t[k].as_f64().unwrap_or_else(|| panic!("no {k}: {t}"));
    let whole = part("handoff_ms");
    for k in ["handoff_connect_ms", "handoff_hash_ms", "receive_ms"] {
        assert!(part(k) > 0.0 && part(k) <= whole, "{k}: {t}");
    }
    assert!(
        part("verify_ms") > 0.0 && part("verify_ms") <= part("receive_ms"),
        "{t}"
    );
    assert!(part("export_ms") > 0.0 && part("import_ms") > 0.0, "{t}");

    // What we would not honour is refused by name, never answered as if it were.
    for (extra, param) in [
        (
            json!({"tools": [{"type": "function"}]}),
            "tools[0].function",
        ),
        (
            json!({"some_future_field": {"x": [1, 2]}}),
            "some_future_field",
        ),
    ] {
        let (status, _, v) = post(&url, &chat_body(hi(), extra)).await;
        assert_eq!(status, 400, "{v}");
        assert_eq!(v["error"]["param"], param, "{v}");
    }
}

#[tokio::test]
async fn prompt_token_count_is_exact() {
    // Count the tokens of the rendered prompts with an engine of our own, then compare
    // with what the router reports for the same messages, on both transports.
    let mut cfg = edgesplit_engine::EngineConfig::new(common::model(common::SMOLLM2));
    cfg.n_ctx = 256;
    let engine = edgesplit_engine::Engine::start(cfg).await.unwrap();
    let s = smollm2();
    let url = format!("{}/v1/chat/completions", s.router);
    let convs = [
        vec![("user", "a")],
        vec![
            ("system", "Be brief."),
            ("user", "a"),
            ("assistant", "b"),
            ("user", "Tell me more, please."),
        ],
    ];
    for conv in convs {
        let want = engine
            .tokenize(edgesplit_engine::Input::chat(
                conv.iter().map(|(r, c)| (r.to_string(), c.to_string())),
            ))
            .await
            .unwrap()
            .len() as u64;
        let messages: Vec<Value> = conv
            .iter()
            .map(|(r, c)| json!({"role": r, "content": c}))
            .collect();
        for transport in ["v2", "local"] {
            let (_, _, v) = post(
                &url,
                &chat_body(
                    json!(messages),
                    json!({"max_tokens": 2, "edgesplit": {"transport": transport}}),
                ),
            )
            .await;
            assert_eq!(
                v["usage"]["prompt_tokens"].as_u64(),
                Some(want),
                "{transport}: {v}"
            );
            assert_eq!(v["usage"]["completion_tokens"], 2);
        }
    }
}

#[tokio::test]
async fn max_tokens_1_and_stop_strings() {
    let s = smollm2();
    let url = format!("{}/v1/chat/completions", s.router);
    let (_, _, v) = post(
        &url,
        &chat_body(hi(), json!({"temperature":0,"max_completion_tokens":1})),
    )
    .await;
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 1);
    // Find a word of the greedy answer, then stop on it.
    let (_, _, full) = post(
        &url,
        &chat_body(hi(), json!({"temperature":0,"max_tokens":20})),
    )
    .await;
    let text = full["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let word = text
        .split_whitespace()
        .nth(2)
        .expect("three words")
        .to_string();
    let cut = text.find(&word).unwrap();
    for streamed in [false, true] {
        let body = chat_body(
            hi(),
            json!({"temperature":0,"max_tokens":20,"stop":[word.clone()],"stream":streamed}),
        );
        let got = if streamed {
            let (_, datas) = stream(&url, &body).await;
            let cs = chunks(&datas);
            let mut t = String::new();
            for c in &cs {
                if let Some(x) = c["choices"][0]["delta"]["content"].as_str() {
                    t.push_str(x);
                }
            }
            assert_eq!(cs.last().unwrap()["choices"][0]["finish_reason"], "stop");
            t
        } else {
            let (_, _, v) = post(&url, &body).await;
            assert_eq!(v["choices"][0]["finish_reason"], "stop");
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        };
        assert_eq!(got, text[..cut], "streamed {streamed}");
    }
}

#[tokio::test]
async fn streaming_chunk_sequence() {
    let s = smollm2();
    let url = format!("{}/v1/chat/completions", s.router);
    let body = chat_body(
        hi(),
        json!({"temperature":0,"max_tokens":6,"stream":true,"stream_options":{"include_usage":true}}),
    );
    let (status, datas) = stream(&url, &body).await;
    assert_eq!(status, 200);
    let cs = chunks(&datas);
    assert!(cs.len() >= 4);
    assert!(cs.iter().all(|c| c["object"] == "chat.completion.chunk"));
    let id = cs[0]["id"].clone();
    assert!(cs.iter().all(|c| c["id"] == id));
    assert_eq!(cs[0]["choices"][0]["delta"]["role"], "assistant");
    assert!(cs[1..].iter().all(|c| c["choices"]
        .get(0)
        .is_none_or(|ch| ch["delta"].get("role").is_none())));
    let finishes: Vec<_> = cs
        .iter()
        .filter(|c| {
            c["choices"]
                .get(0)
                .is_some_and(|ch| !ch["finish_reason"].is_null())
        })
        .collect();
    assert_eq!(finishes.len(), 1);
    assert_eq!(finishes[0]["choices"][0]["finish_reason"], "length");
    let last = cs.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 6);
    // Without include_usage there is no usage chunk.
    let body = chat_body(hi(), json!({"temperature":0,"max_tokens":3,"stream":true}));
    let (_, datas) = stream(&url, &body).await;
    let cs = chunks(&datas);
    assert!(cs.iter().all(|c| c.get("usage").is_none()));
}

#[tokio::test]
async fn completions_endpoint_streamed_and_not() {
    let s = smollm2();
    let url = format!("{}/v1/completions", s.router);
    let body =
        json!({"prompt": "The three primary colours are", "max_tokens": 8, "temperature": 0});
    let (status, _, v) = post(&url, &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["object"], "text_completion");
    let text = v["choices"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(v["usage"]["completion_tokens"], 8);
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let (_, datas) = stream(&url, &sbody).await;
    let cs = chunks(&datas);
    let streamed: String = cs
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(streamed, text);
    assert_eq!(cs.last().unwrap()["choices"][0]["finish_reason"], "length");
}

#[tokio::test]
async fn models_and_health() {
    let s = smollm2();
    let v: Value = common::client()
        .get(format!("{}/v1/models", s.router))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], "SmolLM2-135M-Instruct.Q4_1");
    let r = common::client()
        .get(format!("{}/health", s.router))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let h: Value = r.json().await.unwrap();
    assert_eq!(h["status"], "ok");
    assert_eq!(
        h["decode"]["model_fingerprint"],
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    );
    assert_eq!(h["prefill"]["kv_bytes_per_token"], 23040);
    assert!(h["decode"]["mem_available_bytes"].as_u64().unwrap() > 0);
    // Each node's build (the llama.cpp version and the options that change numerics) and
    // its device: this machine's architecture and the CPU kernels it computes with.
    for node in ["prefill", "decode"] {
        let n = &h[node];
        let build = n["build_id"].as_str().unwrap();
        assert!(
            build.starts_with("llama-cpp-sys-2 0.1.161, ggml ")
                && build.ends_with("REPACK off, FA_SPLIT_KV off, MATH det"),
            "{n}"
        );
        assert_eq!(n["arch"], std::env::consts::ARCH, "{n}");
        assert!(n["kernels"].as_str().unwrap().starts_with("CPU: "), "{n}");
    }
    // Each node's thread count (the shared stack runs them unequal: prefill 2, decode 1).
    assert_eq!(h["prefill"]["threads"], 2, "{h}");
    assert_eq!(h["decode"]["threads"], 1, "{h}");
    // How a live handoff sends the prompt's state (`live.rs` and `gemma.rs` check the
    // other two values); a decode node says nothing of it.
    assert_eq!(h["prefill"]["stream_prefill"], "off");
    assert!(h["decode"].get("stream_prefill").is_none(), "{h}");
}

async fn assert_error(status: u16, v: &Value, want_status: u16, param: Option<&str>) {
    assert_eq!(status, want_status, "{v}");
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("code").is_some() && e.get("param").is_some(), "{v}");
    if let Some(p) = param {
        assert_eq!(e["param"], p, "{v}");
    }
}

#[tokio::test]
async fn bad_requests_get_openai_errors() {
    let s = smollm2();
    let url = format!("{}/v1/chat/completions", s.router);
    let (st, v) = post_raw(&url, "{not json").await;
    assert_error(st, &v, 400, None).await;
    assert_eq!(v["error"]["code"], "invalid_json");
    for (body, param) in [
        (json!({}), "messages"),
        (json!({"messages": []}), "messages"),
        (
            json!({"messages": [{"role": "robot", "content": "x"}]}),
            "messages[0].role",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "temperature": -1}),
            "temperature",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "top_p": 1.5}),
            "top_p",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}),
            "max_tokens",
        ),
    ] {
        let (st, _, v) = post(&url, &body).await;
        assert_error(st, &v, 400, Some(param)).await;
    }
    let (st, _, v) = post(&url, &chat_body(hi(), json!({"model": "gpt-17"}))).await;
    assert_error(st, &v, 404, Some("model")).await;
    assert_eq!(v["error"]["code"], "model_not_found");
    // The served model id is accepted.
    let (st, _, _) = post(
        &url,
        &chat_body(
            hi(),
            json!({"model": "SmolLM2-135M-Instruct.Q4_1", "max_tokens": 1}),
        ),
    )
    .await;
    assert_eq!(st, 200);
}

#[tokio::test]
async fn prompt_longer_than_the_context_is_400_naming_the_limit() {
    let s = smollm2();
    let url = format!("{}/v1/chat/completions", s.router);
    let long = "lorem ipsum dolor sit amet ".repeat(800);
    for streamed in [false, true] {
        let (st, _, v) = post(
            &url,
            &chat_body(
                json!([{"role":"user","content": long}]),
                json!({"stream": streamed}),
            ),
        )
        .await;
        assert_error(st, &v, 400, Some("messages")).await;
        assert_eq!(v["error"]["code"], "context_length_exceeded");
        assert!(
            v["error"]["message"].as_str().unwrap().contains("2048"),
            "{v}"
        );
    }
    // max_tokens that pushes a short prompt past the context is refused the same way.
    let (st, _, v) = post(&url, &chat_body(hi(), json!({"max_tokens": 5000}))).await;
    assert_error(st, &v, 400, Some("messages")).await;
}

/// A URL whose port is bound but not listening: connections to it are refused, and no
/// other test can take the port while the returned socket lives (binding port 0 and
/// dropping the listener left the port free for anyone).
fn dead_url() -> (String, tokio::net::TcpSocket) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let url = format!("http://{}", socket.local_addr().unwrap());
    (url, socket)
}

#[tokio::test]
async fn no_decode_node_is_503_with_retry_after_quickly_under_the_fail_policy() {
    let mut opts = common::StackOptions::new(common::SMOLLM2);
    let (dead, _held) = dead_url();
    opts.decode_url_override = Some(dead);
    opts.fail_on_split_failure = true;
    let s = common::start(opts);
    let url = format!("{}/v1/chat/completions", s.router);
    let t0 = Instant::now();
    let (st, headers, v) = post(&url, &chat_body(hi(), json!({"max_tokens": 4}))).await;
    assert_error(st, &v, 503, None).await;
    assert_eq!(v["error"]["code"], "decode_unavailable");
    assert!(headers.get("retry-after").is_some());
    assert!(t0.elapsed() < Duration::from_secs(10));
    // The local transport still works without a decode node; health says degraded.
    let (st, _, _) = post(
        &url,
        &chat_body(
            hi(),
            json!({"max_tokens": 2, "edgesplit": {"transport": "local"}}),
        ),
    )
    .await;
    assert_eq!(st, 200);
    let r = common::client()
        .get(format!("{}/health", s.router))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
}

#[tokio::test]
async fn no_decode_node_is_answered_on_the_prefill_node_under_the_fallback_policy() {
    let mut opts = common::StackOptions::new(common::SMOLLM2);
    let (dead, _held) = dead_url();
    opts.decode_url_override = Some(dead);
    let s = common::start(opts);
    let url = format!("{}/v1/chat/completions", s.router);
    let body = |transport: &str| {
        chat_body(
            hi(),
            json!({"max_tokens": 12, "temperature": 0, "edgesplit": {"transport": transport}}),
        )
    };
    let (st, _, want) = post(&url, &body("local")).await;
    assert_eq!(st, 200, "{want}");
    assert!(want["edgesplit"]["fallback"].is_null(), "{want}");
    let (st, _, v) = post(&url, &body("v2")).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["edgesplit"]["fallback"], "decode_unavailable", "{v}");
    assert_eq!(v["edgesplit"]["transport"], "v2", "{v}");
    assert_eq!(
        v["choices"][0]["message"]["content"],
        want["choices"][0]["message"]["content"]
    );
    // Streamed too: the same chunks as the local answer (text, ids, finish, usage).
    let body = chat_body(hi(), json!({"max_tokens": 12, "temperature": 0}));
    let local = common::run(&s, "/v1/chat/completions", &body, "local", true).await;
    let (split, edgesplit) =
        common::run_reporting(&s, "/v1/chat/completions", &body, "v2", true).await;
    assert_eq!(edgesplit["fallback"], "decode_unavailable", "{edgesplit}");
    assert_eq!(split, local);
    assert_eq!(
        common::fallbacks(&s).await,
        2,
        "both v2 answers counted as fallbacks"
    );
    // The decode node alone (`phone`) is not a split: asked for, it is refused with the
    // reason rather than answered elsewhere.
    let (st, headers, v) = post(&url, &body_phone()).await;
    assert_error(st, &v, 503, None).await;
    assert_eq!(v["error"]["code"], "decode_unavailable", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("decode node")),
        "{v}"
    );
    assert!(headers.get("retry-after").is_some());
}

/// The phone alone on a busy decode node: the node answers a `Local` call once it has
/// tokenized the prompt, which waits behind another request's prefill on its engine. A
/// request committed to the phone waits for that as for a first token, not as for an
/// `Info` (here bounded at 50 ms, far under a prefill: under load with a 3 s bound, 4 of
/// 16 phone requests of the bench's throughput run failed so).
#[tokio::test]
async fn a_busy_decode_node_still_serves_the_phone_alone() {
    let mut opts = common::StackOptions::new(common::SMOLLM2);
    opts.info_timeout_ms = Some(50);
    let s = common::start(opts);
    let url = format!("{}/v1/chat/completions", s.router);
    let doc = "The harbour log records wind, tide and the boats that came in. ".repeat(50);
    let asks = (0..2u64).map(|i| {
        let (url, doc) = (url.clone(), doc.clone());
        async move {
            tokio::time::sleep(Duration::from_millis(40 * i)).await;
            let body = chat_body(
                json!([{"role": "user", "content": format!("Log {i}. {doc} Summarise it.")}]),
                json!({"max_tokens": 4, "temperature": 0, "edgesplit": {"transport": "phone"}}),
            );
            post(&url, &body).await
        }
    });
    for (st, _, v) in futures::future::join_all(asks).await {
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["edgesplit"]["placement"], "decode_node", "{v}");
        assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 400, "{v}");
    }
}

fn body_phone() -> Value {
    chat_body(
        hi(),
        json!({"max_tokens": 4, "edgesplit": {"transport": "phone"}}),
    )
}
