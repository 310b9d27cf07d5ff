//! Authentication on the real services: with a shared secret the V2 and V1 handoffs and
//! the gRPC calls work and give the one-device answer; a peer without the secret or with
//! another one is refused before any state is read, and the node goes on serving; the
//! router's API key answers 401 with an OpenAI error object.

use crate::common;

use std::sync::OnceLock;

use bytes::Bytes;
use edgesplit_proto::auth::{self, GrpcCredentials, Secret};
use edgesplit_proto::frame::StateFrame;
use edgesplit_proto::handoff::{self, HandoffError, Limits};
use edgesplit_proto::link::Link;
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

/// A link keyed by `s` (plain without one), as a device configured with it has.
fn link(s: Option<&str>) -> Link {
    Link::new(s.map(|s| std::sync::Arc::new(secret(s)))).unwrap()
}

/// The decode node's `Info` over `over`, with a credential made with `with`.
async fn decode_info_over(
    s: &common::Stack,
    over: &Link,
    with: Option<Secret>,
) -> Result<pb::NodeInfo, tonic::Status> {
    let channel = over
        .grpc_channel(&s.decode_grpc, std::time::Duration::from_secs(5))
        .unwrap();
    let mut c = pb::decode_client::DecodeClient::with_interceptor(
        channel,
        GrpcCredentials(with.map(std::sync::Arc::new)),
    );
    c.info(pb::InfoRequest {})
        .await
        .map(tonic::Response::into_inner)
}

/// The decode node's `Info` as a device with [`SECRET`] asks for it.
async fn decode_info(s: &common::Stack) -> pb::NodeInfo {
    decode_info_over(s, &link(Some(SECRET)), Some(secret(SECRET)))
        .await
        .unwrap()
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
    let info = decode_info(s).await;
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
    // Without a secret the sender speaks plain TCP to a TLS listener: the connection ends
    // before any frame is answered.
    let err = handoff::send_state(&s.handoff_addr, &id, state("no-key"), &limits, &link(None))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, HandoffError::Codec(_) | HandoffError::Protocol(_)),
        "{err:?}"
    );
    // With another secret the TLS handshake fails: the receiver's key is not ours.
    let err = handoff::send_state(
        &s.handoff_addr,
        &id,
        state("wrong-key"),
        &limits,
        &link(Some("a different secret")),
    )
    .await
    .unwrap_err();
    let HandoffError::Connect { source, .. } = &err else {
        panic!("expected a failed handshake, got {err:?}")
    };
    assert!(source.to_string().contains("shared secret"), "{source}");
    let after = decode_info(s).await;
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
    // A client without the secret cannot reach the handler at all.
    let plain = common::client()
        .put(format!(
            "{}/auth-test",
            s.v1_url.replace("https://", "http://")
        ))
        .body(vec![0u8; 1024])
        .send()
        .await;
    assert!(plain.is_err(), "plain HTTP to the TLS listener: {plain:?}");
    let other = link(Some("a different secret"))
        .http_client(reqwest::Client::builder())
        .build()
        .unwrap()
        .put(format!("{}/auth-test", s.v1_url))
        .body(vec![0u8; 1024])
        .send()
        .await;
    assert!(other.is_err(), "TLS keyed by another secret: {other:?}");
    // Inside the private link, the credential is still checked before the body is read.
    let http = link(Some(SECRET))
        .http_client(reqwest::Client::builder())
        .build()
        .unwrap();
    let len = "1024";
    let put = |token: Option<String>| {
        let mut r = http
            .put(format!("{}/auth-test", s.v1_url))
            .header(
                edgesplit_proto::v1::HEADER_DIGEST,
                edgesplit_proto::v1::DIGEST_TRAILER,
            )
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
            &[b"auth-test", len.as_bytes()],
        )),
        // Right secret, bound to another handoff id.
        Some(auth::Token::make(
            &secret(SECRET),
            auth::V1_UPLOAD,
            &[b"other-id", len.as_bytes()],
        )),
        // Right secret and id, bound to another length.
        Some(auth::Token::make(
            &secret(SECRET),
            auth::V1_UPLOAD,
            &[b"auth-test", b"1023"],
        )),
    ] {
        let r = put(token).await.unwrap();
        assert_eq!(r.status().as_u16(), 401);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["code"], "auth_failed", "{v}");
    }
    // Nothing is held under the id: the right credential's upload there is taken, where a
    // held state would make it a duplicate. (Its body passes every check.)
    // (Its link is TLS: the digest is 32 zero bytes, checked; a plain SHA-256 would not
    // pass.)
    let file = common::synthetic_v1_file(1);
    let mut digest = edgesplit_proto::v1::digest(Some(&secret(SECRET)), "auth-test", true);
    digest.update(&file);
    let mut plain = file.clone();
    plain.extend_from_slice(&<sha2::Sha256 as sha2::Digest>::digest(&file));
    let mut body = file;
    body.extend_from_slice(&digest.finalize());
    let len = body.len().to_string();
    let info = decode_info(s).await;
    let upload = |body: Vec<u8>| {
        http.put(format!("{}/auth-test", s.v1_url))
            .header(
                edgesplit_proto::v1::HEADER_DIGEST,
                edgesplit_proto::v1::DIGEST_TRAILER,
            )
            .header(
                edgesplit_proto::v1::HEADER_MODEL,
                info.model_fingerprint.clone(),
            )
            .header(edgesplit_proto::v1::HEADER_BUILD, info.build_id.clone())
            .header(edgesplit_proto::v1::HEADER_KV_TYPES, "1,1")
            .header(
                auth::HEADER,
                auth::Token::make(
                    &secret(SECRET),
                    auth::V1_UPLOAD,
                    &[b"auth-test", len.as_bytes()],
                ),
            )
            .body(body)
            .send()
    };
    let r = upload(plain).await.unwrap();
    assert_eq!(r.status().as_u16(), 400, "{:?}", r.text().await);
    let r = upload(body).await.unwrap();
    assert_eq!(r.status().as_u16(), 200, "{:?}", r.text().await);
}

#[tokio::test]
async fn grpc_calls_need_the_secret() {
    let s = secured();
    // A link without the secret, or with another one, never reaches the service (whose
    // interceptor would answer Unauthenticated): the connection itself fails, however
    // the client's HTTP/2 reads the TLS alert it gets.
    for over in [link(None), link(Some("a different secret"))] {
        let st = decode_info_over(s, &over, Some(secret(SECRET)))
            .await
            .unwrap_err();
        assert!(
            matches!(
                st.code(),
                tonic::Code::Unavailable | tonic::Code::Unknown | tonic::Code::Internal
            ),
            "{over:?}: {st:?}"
        );
    }
    // Inside the private link, each call still needs its credential.
    for with in [None, Some(secret("a different secret"))] {
        let st = decode_info_over(s, &link(Some(SECRET)), with)
            .await
            .unwrap_err();
        assert_eq!(st.code(), tonic::Code::Unauthenticated, "{st:?}");
    }
    assert!(
        decode_info_over(s, &link(Some(SECRET)), Some(secret(SECRET)))
            .await
            .is_ok()
    );
}

/// A request on a stack whose services are configured as `configure` says: its status,
/// error code and message.
async fn misconfigured(configure: fn(&mut common::StackOptions)) -> (u16, Value) {
    let mut o = common::StackOptions::new(common::SMOLLM2);
    configure(&mut o);
    let s = common::start(o);
    post_with_key(
        &format!("{}/v1/chat/completions", s.router),
        &common::chat_body(
            json!([{"role":"user","content":"Hi"}]),
            json!({"max_tokens": 4}),
        ),
        None,
    )
    .await
}

fn assert_error(st: u16, v: &Value, status: u16, code: &str, says: &[&str]) {
    assert_eq!(st, status, "{v}");
    assert_eq!(v["error"]["code"], code, "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    for w in says {
        assert!(message.contains(w), "{w:?}: {v}");
    }
}

#[tokio::test]
async fn a_decode_node_with_another_secret_fails_the_request_clearly() {
    let (st, v) = misconfigured(|o| {
        o.secret = Some(SECRET.into());
        o.decode_secret = Some("the decode node's other secret".into());
    })
    .await;
    assert_error(st, &v, 502, "auth_failed", &["handshake", "same secret"]);
}

/// The router and the prefill node have the secret, the decode node none (left
/// unconfigured): the router's TLS meets a plaintext server, which it names, and answers
/// 502 `auth_failed` rather than answering elsewhere as if the node were down.
#[tokio::test]
async fn a_decode_node_without_the_secret_fails_the_request_clearly() {
    let (st, v) = misconfigured(|o| {
        o.secret = Some(SECRET.into());
        o.decode_plain = true;
    })
    .await;
    assert_error(st, &v, 502, "auth_failed", &["does not speak TLS"]);
}

/// The other way round: the decode node has a secret, the router none. The router's
/// plain HTTP/2 meets a TLS-only listener; under `--on-split-failure fail` the client is
/// told the node is unreachable and what to check.
#[tokio::test]
async fn a_router_without_the_decode_nodes_secret_says_what_to_check() {
    let (st, v) = misconfigured(|o| {
        o.decode_secret = Some(SECRET.into());
        o.fail_on_split_failure = true;
    })
    .await;
    assert_error(
        st,
        &v,
        503,
        "decode_unavailable",
        &["give the router the same one"],
    );
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

/// `/health` says to anyone whether the service is up, and its details (the nodes'
/// addresses, memory, peers) only to a request with the API key.
#[tokio::test]
async fn health_details_need_the_api_key() {
    let s = secured();
    let url = format!("{}/health", s.router);
    let http = common::client();
    for key in [None, Some("sk-wrong")] {
        let mut r = http.get(&url);
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        let r = r.send().await.unwrap();
        assert_eq!(r.status(), 200, "{key:?}");
        let v: Value = r.json().await.unwrap();
        assert_eq!(v, json!({"status": "ok"}), "{key:?}");
    }
    let v: Value = http
        .get(&url)
        .bearer_auth(KEY)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["status"], "ok", "{v}");
    assert!(
        v["decode"]["handoff_addr"]
            .as_str()
            .is_some_and(|a| a.contains("127.0.0.1")),
        "{v}"
    );
    assert!(
        v["prefill"]["mem_available_bytes"].as_u64().is_some(),
        "{v}"
    );
}
