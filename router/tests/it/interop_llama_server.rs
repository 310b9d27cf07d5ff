//! Interop: a V1 file written by our prefill node is restored by a stock llama.cpp
//! `llama-server` (`POST /slots/0?action=restore`), which then continues with the same
//! greedy tokens as our decode node.
//!
//! The stock server is built from the llama.cpp sources in the llama-cpp-python 0.3.36
//! sdist (`scripts/stock-llama.sh`, cached under `.build/`). That llama.cpp reads
//! sequence-state file version 3; ours writes version 4, which adds `u32 n_rot_k, u32
//! n_rot_v` per stream. `edgesplit_proto::v1::to_version_3` drops them: that is the
//! compatible pairing, and this test is its proof.

use crate::common;
use crate::common::stock::{tempdir, StockServer};

use std::sync::{Arc, Mutex};

use edgesplit_proto::{pb, v1};
use serde_json::{json, Value};

#[tokio::test]
async fn stock_llama_server_restores_our_v1_file_and_continues_identically() {
    let s = common::smollm2();
    // The prefill node uploads through a proxy that keeps a copy of the file it sends.
    let (upload_url, captured) = capturing_proxy(s.v1_url.clone()).await;

    // 1. Our prefill node writes and uploads the V1 file for a chat prompt (greedy).
    let mut prefill = pb::prefill_client::PrefillClient::connect(s.prefill_grpc.clone())
        .await
        .unwrap();
    const N: u32 = 16;
    let mut events = prefill
        .prefill(pb::PrefillRequest {
            request_id: "interop".into(),
            input: Some(pb::prefill_request::Input::Chat(pb::ChatInput {
                messages: vec![pb::ChatMessage {
                    role: "user".into(),
                    content: "List four colours of the rainbow.".into(),
                    ..Default::default()
                }],
                ..Default::default()
            })),
            sampling: Some(greedy()),
            max_tokens: N,
            no_cache: false,
            max_uncached: None,
            handoff: Some(pb::Handoff {
                live: false,
                keep: false,
                base_max: 0,
                decode_key: String::new(),
                handoff_id: "interop-1".into(),
                decode_addr: upload_url,
                transport: pb::HandoffTransport::V1 as i32,
            }),
            kv_budget_bytes: 0,
            resume_tokens: vec![],
        })
        .await
        .unwrap()
        .into_inner();
    let Some(pb::PrefillEvent {
        event: Some(pb::prefill_event::Event::First(first)),
    }) = events.message().await.unwrap()
    else {
        panic!("first token expected")
    };
    assert!(!first.last);
    let Some(pb::PrefillEvent {
        event: Some(pb::prefill_event::Event::Handoff(done)),
    }) = events.message().await.unwrap()
    else {
        panic!("handoff report expected")
    };

    // 2. The file as our prefill node sent it (and our decode node took it): the body
    // without its digest, converted for the stock server.
    let body = captured.lock().unwrap().clone();
    assert_eq!(body.len() as u64, done.bytes);
    let (ours_v4, digest) = body.split_at(body.len() - v1::TRAILER_LEN);
    assert_eq!(
        digest,
        &<sha2::Sha256 as sha2::Digest>::digest(ours_v4)[..],
        "the body ends with the file's SHA-256"
    );
    let ours_v4 = ours_v4.to_vec();
    let header = v1::validate(&ours_v4, 2048).unwrap();
    let prompt: Vec<i32> = ours_v4[12..header.state_offset]
        .chunks(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    assert_eq!(prompt.len() as u32, first.prompt_tokens);
    let slots = tempdir("interop-slots");
    std::fs::write(
        slots.join("interop.bin"),
        v1::to_version_3(&ours_v4).unwrap(),
    )
    .unwrap();

    // 3. Our decode node continues from the state it holds.
    let mut decode = pb::decode_client::DecodeClient::connect(s.decode_grpc.clone())
        .await
        .unwrap();
    let mut stream = decode
        .generate(pb::GenerateRequest {
            answered: 1,
            request_id: "interop".into(),
            handoff_id: "interop-1".into(),
            sampling: Some(greedy()),
            max_new_tokens: N - 1,
            first_token: Some(first.token),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let mut ours = Vec::new();
    while let Some(ev) = stream.message().await.unwrap() {
        if let Some(pb::token_event::Event::Token(t)) = ev.event {
            ours.push(i64::from(t.id));
        }
    }
    assert_eq!(ours.len(), (N - 1) as usize);

    // 4. Stock llama-server: restore the slot, then continue after the first token.
    let mut slot_path = slots.display().to_string();
    slot_path.push('/');
    let stock = StockServer::start(
        "interop",
        &common::model(common::SMOLLM2),
        &["--slot-save-path", &slot_path],
    )
    .await;
    let base = &stock.base;
    let http = common::client();
    let restored: Value = http
        .post(format!("{base}/slots/0?action=restore"))
        .json(&json!({"filename": "interop.bin"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(restored["n_restored"], prompt.len(), "{restored}");

    let mut with_first = prompt.clone();
    with_first.push(first.token);
    let done: Value = http
        .post(format!("{base}/completion"))
        .json(&json!({
            "prompt": with_first,
            "n_predict": N - 1,
            "temperature": 0,
            "cache_prompt": true,
            "id_slot": 0,
            "return_tokens": true,
            "ignore_eos": false,
        }))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    // Only the first token was evaluated: the rest came from the restored state.
    assert_eq!(done["timings"]["prompt_n"], 1, "{done}");
    let theirs: Vec<i64> = done["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(Value::as_i64)
        .collect();
    assert_eq!(
        theirs, ours,
        "stock llama-server continued differently: {done}"
    );
}

fn greedy() -> pb::Sampling {
    pb::Sampling {
        top_p: 1.0,
        repeat_penalty: 1.0,
        ..Default::default()
    }
}

/// A V1 upload endpoint that forwards each upload to `target` (the decode node's) with its
/// headers, answers with the decode node's answer, and keeps a copy of the last body.
async fn capturing_proxy(target: String) -> (String, Arc<Mutex<Vec<u8>>>) {
    use axum::extract::{Path, State};
    use axum::http::{HeaderMap, StatusCode};
    let captured = Arc::new(Mutex::new(Vec::new()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = axum::Router::new()
        .route(
            "/{id}",
            axum::routing::put(
                |State((target, captured)): State<(String, Arc<Mutex<Vec<u8>>>)>,
                 Path(id): Path<String>,
                 headers: HeaderMap,
                 body: axum::body::Bytes| async move {
                    captured.lock().unwrap().clone_from(&body.to_vec());
                    let mut fwd = reqwest::header::HeaderMap::new();
                    for (k, v) in &headers {
                        if k.as_str().starts_with("x-edgesplit") {
                            fwd.insert(k.clone(), v.clone());
                        }
                    }
                    let r = reqwest::Client::new()
                        .put(format!("{target}/{id}"))
                        .headers(fwd)
                        .body(body)
                        .send()
                        .await
                        .unwrap();
                    let status = StatusCode::from_u16(r.status().as_u16()).unwrap();
                    (status, r.bytes().await.unwrap())
                },
            ),
        )
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state((target, captured.clone()));
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, captured)
}
