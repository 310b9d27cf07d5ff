//! Authentication on the real services: with a shared secret the V2 and V1 handoffs and
//! the gRPC calls work and give the one-device answer; a peer without the secret or with
//! another one is refused before any state is read, and the node goes on serving; the
//! router's API key answers 401 with an OpenAI error object.

use crate::common;

use std::sync::OnceLock;

use bytes::Bytes;
use edgesplit_proto::auth::{self, GrpcCredentials, Secret};
use edgesplit_proto::frame::{NackCode, StateFrame};
use edgesplit_proto::handoff::{self, HandoffError, Limits};
use edgesplit_proto::pb;
use serde_json::{json, Value};

const SECRET: &str = "correct horse battery staple";
const KEY: &str = "sk-edgesplit-test-key";

/// A stack whose three services share [`SECRET`] and whose router wants [`KEY`].
fn secured() -> &'static common::Stack {
    static S: OnceLock<common::Stack> = OnceLock::new();
    S.get_or_init(|| {
        let mut o = common::StackOptions::new(common::SMOLLM2);
        o.secret = Some(SECRET.into());
        o.api_key = Some(KEY.into());
        common::start(o)
    })
}

/// Held by the tests that move states into [`secured`]'s decode node, so that the one
/// reading its byte counters sees only its own traffic.
static COUNTERS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn secret(s: &str) -> Secret {
    Secret::new(s.as_bytes(), "test").unwrap()
}

async fn post_with_key(url: &str, body: &Value, key: Option<&str>) -> (u16, Value) {
    let mut r = common::client().post(url).json(body);
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    let r = r.send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

async fn decode_info(
    s: &common::Stack,
    with: Option<Secret>,
) -> Result<pb::NodeInfo, tonic::Status> {
    let channel = tonic::transport::Endpoint::from_shared(s.decode_grpc.clone())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut c = pb::decode_client::DecodeClient::with_interceptor(
        channel,
        GrpcCredentials(with.map(std::sync::Arc::new)),
    );
    c.info(pb::InfoRequest {})
        .await
        .map(tonic::Response::into_inner)
}

#[tokio::test]
async fn with_the_secret_every_transport_gives_the_one_device_answer() {
    let s = secured();
    let _counters = COUNTERS.lock().await;
    let url = format!("{}/v1/chat/completions", s.router);
    let ask = |t: &str| {
        common::chat_body(
            json!([{"role":"user","content":"Name two moons of Jupiter."}]),
            json!({"temperature": 0, "max_tokens": 24, "edgesplit": {"transport": t}}),
        )
    };
    let mut answers = Vec::new();
    for t in ["local", "v2", "v1"] {
        let (st, v) = post_with_key(&url, &ask(t), Some(KEY)).await;
        assert_eq!(st, 200, "{t}: {v}");
        if t != "local" {
            common::assert_split(
                &v["edgesplit"],
                v["usage"]["completion_tokens"].as_u64().unwrap(),
            );
        }
        answers.push(v["choices"][0]["message"]["content"].clone());
    }
    assert_eq!(answers[0], answers[1], "v2 under authentication");
    assert_eq!(answers[0], answers[2], "v1 under authentication");
}

#[tokio::test]
async fn a_v2_sender_without_or_with_another_secret_is_refused() {
    let s = secured();
    let _counters = COUNTERS.lock().await;
    let info = decode_info(s, Some(secret(SECRET))).await.unwrap();
    let id = common::identity(&info);
    let payload = Bytes::from_static(b"never read");
    let state = |name: &str| StateFrame {
        handoff_id: name.into(),
        request_id: "t".into(),
        tokens: vec![],
        descriptors: edgesplit_proto::layout::describe(&payload).descriptors,
        payload: payload.clone(),
    };
    let limits = Limits::default();
    let err = handoff::send_state(&s.handoff_addr, &id, state("no-key"), &limits, None)
        .await
        .unwrap_err();
    assert!(
        matches!(&err, HandoffError::Auth(w) if w.contains("requires authentication")),
        "{err:?}"
    );
    let wrong = secret("a different secret");
    let err = handoff::send_state(
        &s.handoff_addr,
        &id,
        state("wrong-key"),
        &limits,
        Some(&wrong),
    )
    .await
    .unwrap_err();
    let HandoffError::Refused(n) = err else {
        panic!("expected a NACK, got {err:?}")
    };
    assert_eq!(n.code, NackCode::AuthFailed);
    let after = decode_info(s, Some(secret(SECRET))).await.unwrap();
    assert!(after.handoffs_refused > info.handoffs_refused);
    assert_eq!(
        after.handoff_bytes_received, info.handoff_bytes_received,
        "nothing was read"
    );

    // The node still serves a real request.
    let (st, v) = post_with_key(
        &format!("{}/v1/chat/completions", s.router),
        &common::chat_body(
            json!([{"role":"user","content":"Hi"}]),
            json!({"max_tokens": 4, "temperature": 0}),
        ),
        Some(KEY),
    )
    .await;
    assert_eq!(st, 200, "{v}");
}

#[tokio::test]
async fn a_v1_upload_without_a_valid_credential_is_refused_before_its_body() {
    let s = secured();
    let _counters = COUNTERS.lock().await;
    let http = common::client();
    let sha = "0".repeat(64);
    let put = |token: Option<String>| {
        let mut r = http
            .put(format!("{}/auth-test", s.v1_url))
            .header(edgesplit_proto::v1::HEADER_SHA256, &sha)
            .body(vec![0u8; 1024]);
        if let Some(t) = token {
            r = r.header(auth::HEADER, t);
        }
        r.send()
    };
    for token in [
        None,
        Some(auth::Token::make(
            &secret("a different secret"),
            auth::V1_UPLOAD,
            &[b"auth-test", sha.as_bytes()],
        )),
        // Right secret, bound to another handoff id.
        Some(auth::Token::make(
            &secret(SECRET),
            auth::V1_UPLOAD,
            &[b"other-id", sha.as_bytes()],
        )),
    ] {
        let r = put(token).await.unwrap();
        assert_eq!(r.status().as_u16(), 401);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "auth_failed", "{v}");
    }
    // Nothing is held under the id: the right credential's upload there is taken, where a
    // held state would make it a duplicate. (Its body passes every check.)
    let mut body = edgesplit_proto::v1::file_head(&[1]);
    body.extend_from_slice(&[0u8; 8]);
    let sha = hex::encode(<sha2::Sha256 as sha2::Digest>::digest(&body));
    let info = decode_info(s, Some(secret(SECRET))).await.unwrap();
    let r = http
        .put(format!("{}/auth-test", s.v1_url))
        .header(edgesplit_proto::v1::HEADER_SHA256, &sha)
        .header(edgesplit_proto::v1::HEADER_MODEL, info.model_fingerprint)
        .header(edgesplit_proto::v1::HEADER_BUILD, info.build_id)
        .header(edgesplit_proto::v1::HEADER_KV_TYPES, "1,1")
        .header(
            auth::HEADER,
            auth::Token::make(
                &secret(SECRET),
                auth::V1_UPLOAD,
                &[b"auth-test", sha.as_bytes()],
            ),
        )
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 200, "{:?}", r.text().await);
}

#[tokio::test]
async fn grpc_calls_need_the_secret() {
    let s = secured();
    for with in [None, Some(secret("a different secret"))] {
        let st = decode_info(s, with).await.unwrap_err();
        assert_eq!(st.code(), tonic::Code::Unauthenticated, "{st:?}");
    }
    assert!(decode_info(s, Some(secret(SECRET))).await.is_ok());
}

#[tokio::test]
async fn a_decode_node_with_another_secret_fails_the_request_clearly() {
    let mut o = common::StackOptions::new(common::SMOLLM2);
    o.secret = Some(SECRET.into());
    o.decode_secret = Some("the decode node's other secret".into());
    let s = common::start(o);
    let (st, v) = post_with_key(
        &format!("{}/v1/chat/completions", s.router),
        &common::chat_body(
            json!([{"role":"user","content":"Hi"}]),
            json!({"max_tokens": 4}),
        ),
        None,
    )
    .await;
    assert_eq!(st, 502, "{v}");
    assert_eq!(v["error"]["code"], "auth_failed", "{v}");
}

#[tokio::test]
async fn the_api_key_is_required_when_configured() {
    let s = secured();
    let url = format!("{}/v1/chat/completions", s.router);
    let body = common::chat_body(
        json!([{"role":"user","content":"Hi"}]),
        json!({"max_tokens": 2}),
    );
    for (key, message) in [
        (None, "didn't provide"),
        (Some("sk-wrong"), "Incorrect API key"),
    ] {
        let (st, v) = post_with_key(&url, &body, key).await;
        assert_eq!(st, 401, "{v}");
        assert_eq!(v["error"]["code"], "invalid_api_key");
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(message),
            "{v}"
        );
    }
    let (st, _) = post_with_key(&url, &body, Some(KEY)).await;
    assert_eq!(st, 200);
    // Models and the dashboard's data need it; health, metrics and the page do not.
    let http = common::client();
    for (path, open) in [
        ("/v1/models", false),
        ("/dashboard/api/status", false),
        ("/health", true),
        ("/metrics", true),
        ("/dashboard", true),
    ] {
        let st = http
            .get(format!("{}{path}", s.router))
            .send()
            .await
            .unwrap()
            .status()
            .as_u16();
        assert_eq!(st == 200, open, "{path}: {st}");
    }
}
