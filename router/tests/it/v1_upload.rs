//! V1 uploads the decode node must refuse: each gets a 4xx with a machine code and a reason,
//! and leaves nothing held under its id; a state whose layout does not walk to the end with a
//! cell per token is one of them. A file that passes the upload checks but that
//! llama.cpp refuses at import is a clean error too, and is gone afterwards.

use crate::common;

use edgesplit_proto::{pb, v1};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn fingerprint(s: &common::Stack) -> (String, String) {
    let i = common::decode_info(&s.decode_grpc).await;
    (i.model_fingerprint, i.build_id)
}

/// A well-formed sequence-state file of `n` tokens (its layout walks; no real state).
fn ggsq(n: u32) -> Vec<u8> {
    common::synthetic_v1_file(n)
}

/// `file` as an upload's body: the file, then its SHA-256 (no secret on these stacks).
fn with_digest(file: &[u8]) -> Vec<u8> {
    let mut b = file.to_vec();
    b.extend_from_slice(&Sha256::digest(file));
    b
}

/// Nothing is held under `id`: an upload of a well-formed file there is taken (200), where
/// a held state would make it a duplicate (409). The probe's own state expires with the
/// store's TTL.
async fn nothing_held(s: &common::Stack, id: &str) -> bool {
    let got = put(s, id, ggsq(1), |_| {}).await;
    got.0 == 200
}

async fn put(
    s: &common::Stack,
    id: &str,
    body: Vec<u8>,
    edit: impl FnOnce(&mut reqwest::header::HeaderMap),
) -> (u16, serde_json::Value) {
    let (fp, build) = fingerprint(s).await;
    let mut h = reqwest::header::HeaderMap::new();
    h.insert(v1::HEADER_DIGEST, v1::DIGEST_TRAILER.parse().unwrap());
    h.insert(v1::HEADER_MODEL, fp.parse().unwrap());
    h.insert(v1::HEADER_BUILD, build.parse().unwrap());
    h.insert(v1::HEADER_KV_TYPES, "1,1".parse().unwrap());
    edit(&mut h);
    let r = common::client()
        .put(format!("{}/{id}", s.v1_url))
        .headers(h)
        .body(with_digest(&body))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or_default())
}

fn assert_refused(got: &(u16, serde_json::Value), status: u16, code: &str) {
    assert_eq!(got.0, status, "{}", got.1);
    assert_eq!(got.1["error"]["code"], code, "{}", got.1);
    assert!(got.1["error"]["message"]
        .as_str()
        .is_some_and(|m| !m.is_empty()));
}

#[tokio::test]
async fn refusals_leave_nothing_held() {
    let s = common::smollm2();
    // Mismatched model fingerprint.
    let got = put(s, "v1-model", ggsq(3), |h| {
        h.insert(v1::HEADER_MODEL, "00".repeat(32).parse().unwrap());
    })
    .await;
    assert_refused(&got, 409, "model_mismatch");
    assert!(nothing_held(s, "v1-model").await);
    // Another llama.cpp build.
    let got = put(s, "v1-build", ggsq(3), |h| {
        h.insert(v1::HEADER_BUILD, "llama-cpp-2-0.0.0".parse().unwrap());
    })
    .await;
    assert_refused(&got, 409, "build_mismatch");
    assert!(nothing_held(s, "v1-build").await);
    // Another KV cache type (q8_0 K and V, where the node runs f16), and none declared.
    let got = put(s, "v1-kv", ggsq(3), |h| {
        h.insert(v1::HEADER_KV_TYPES, "8,8".parse().unwrap());
    })
    .await;
    assert_refused(&got, 409, "kv_type_mismatch");
    assert!(got.1["error"]["message"].as_str().unwrap().contains("8,8"));
    let got = put(s, "v1-kv", ggsq(3), |h| {
        h.remove(v1::HEADER_KV_TYPES);
    })
    .await;
    assert_refused(&got, 409, "kv_type_mismatch");
    assert!(nothing_held(s, "v1-kv").await);
    // A body whose digest is not its file's (one byte of the file flipped after hashing).
    let mut body = with_digest(&ggsq(3));
    body[20] ^= 1;
    let (fp, build) = fingerprint(s).await;
    let r = common::client()
        .put(format!("{}/v1-hash", s.v1_url))
        .header(v1::HEADER_DIGEST, v1::DIGEST_TRAILER)
        .header(v1::HEADER_MODEL, fp)
        .header(v1::HEADER_BUILD, build)
        .header(v1::HEADER_KV_TYPES, "1,1")
        .body(body)
        .send()
        .await
        .unwrap();
    let got = (r.status().as_u16(), r.json().await.unwrap_or_default());
    assert_refused(&got, 400, "checksum_mismatch");
    assert!(nothing_held(s, "v1-hash").await);
    // Not a sequence-state file (valid checksum over garbage).
    let got = put(
        s,
        "v1-garbage",
        b"this is not a ggsq file at all".to_vec(),
        |_| {},
    )
    .await;
    assert_refused(&got, 400, "invalid_state_file");
    assert!(nothing_held(s, "v1-garbage").await);
    // A good header over a state that does not walk, or that walks but holds fewer cells
    // than the file has tokens: refused before it is stored (llama.cpp never sees it).
    let mut torn = ggsq(3);
    torn.truncate(torn.len() - 1);
    let mut short = v1::file_head(&[1, 2, 3]);
    short.extend_from_slice(&common::synthetic_sections(2));
    for (id, file) in [("v1-torn", torn), ("v1-short", short)] {
        let got = put(s, id, file, |_| {}).await;
        assert_refused(&got, 400, "invalid_state_file");
        assert!(
            got.1["error"]["message"]
                .as_str()
                .unwrap()
                .contains("could not be read"),
            "{}",
            got.1
        );
        assert!(nothing_held(s, id).await);
    }
    // More tokens than the context.
    let got = put(s, "v1-long", ggsq(2048), |_| {}).await;
    assert_refused(&got, 400, "invalid_state_file");
    assert!(got.1["error"]["message"].as_str().unwrap().contains("2048"));
    assert!(nothing_held(s, "v1-long").await);
    // Without the digest header (a sender of the earlier protocol, whose checksum came in
    // a header): refused, saying what is required.
    let got = put(s, "v1-nosum", ggsq(1), |h| {
        h.remove(v1::HEADER_DIGEST);
        h.insert("x-edgesplit-sha256", "00".repeat(32).parse().unwrap());
    })
    .await;
    assert_refused(&got, 400, "missing_checksum");
    assert!(got.1["error"]["message"]
        .as_str()
        .unwrap()
        .contains("digest"));
    assert!(nothing_held(s, "v1-nosum").await);
}

#[tokio::test]
async fn path_traversal_ids_are_refused() {
    let s = common::smollm2();
    // Percent-encoded slashes reach the handler decoded, and the id check refuses them.
    for id in ["..%2F..%2Fetc%2Fpasswd", ".hidden", "a%2Fb"] {
        let got = put(s, id, ggsq(1), |_| {}).await;
        assert_refused(&got, 400, "invalid_handoff_id");
    }
    // `%2E%2E` is a dot segment to the client's URL parser (WHATWG): the request goes to
    // `/v1/`, which is no route.
    let got = put(s, "%2E%2E", ggsq(1), |_| {}).await;
    assert_eq!(got.0, 404, "{}", got.1);
}

/// Raw HTTP, for requests reqwest will not send (lying Content-Length, early close).
/// The request line and headers of a V1 upload that declares `len` bytes.
fn put_head(id: &str, len: usize, fp: &str, build: &str) -> String {
    format!(
        "PUT /v1/handoff/{id} HTTP/1.1\r\nHost: x\r\nContent-Length: {len}\r\n{}: {}\r\n{}: {fp}\r\n{}: {build}\r\n{}: 1,1\r\n\r\n",
        v1::HEADER_DIGEST,
        v1::DIGEST_TRAILER,
        v1::HEADER_MODEL,
        v1::HEADER_BUILD,
        v1::HEADER_KV_TYPES
    )
}

/// The decode node's V1 listener, `host:port`.
fn v1_addr(s: &common::Stack) -> String {
    let url = s.v1_url.trim_start_matches("http://");
    url.split('/').next().unwrap().to_string()
}

async fn raw(s: &common::Stack, head: String, body: &[u8]) -> String {
    let mut sock = tokio::net::TcpStream::connect(v1_addr(s)).await.unwrap();
    sock.write_all(head.as_bytes()).await.unwrap();
    sock.write_all(body).await.unwrap();
    sock.shutdown().await.unwrap(); // half-close: the body ends here
    let mut out = String::new();
    let _ = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        sock.read_to_string(&mut out),
    )
    .await;
    out
}

#[tokio::test]
async fn truncated_and_oversized_uploads_are_refused() {
    let s = common::smollm2();
    let (fp, build) = fingerprint(s).await;
    let body = with_digest(&ggsq(4));
    let head = |id: &str, len: usize| put_head(id, len, &fp, &build);
    // Declares more than it sends, then closes.
    let resp = raw(s, head("v1-trunc", body.len() + 100), &body).await;
    assert!(resp.starts_with("HTTP/1.1 400"), "{resp}");
    assert!(resp.contains("truncated"), "{resp}");
    assert!(nothing_held(s, "v1-trunc").await);
    // Declares more than the cap (1 GiB in the test stack): refused before reading a byte.
    let resp = raw(s, head("v1-huge", 4 << 30), b"").await;
    assert!(resp.starts_with("HTTP/1.1 413"), "{resp}");
    assert!(resp.contains("too_large"), "{resp}");
    assert!(nothing_held(s, "v1-huge").await);
}

#[tokio::test]
async fn duplicate_and_unloadable_files() {
    let s = common::smollm2();
    // Passes every upload check (header, checksum) but is no real state.
    let got = put(s, "v1-fake", ggsq(3), |_| {}).await;
    assert_eq!(got.0, 200, "{}", got.1);
    let got = put(s, "v1-fake", ggsq(3), |_| {}).await;
    assert_refused(&got, 409, "duplicate_handoff");
    // Importing it fails cleanly in llama.cpp, and the file is gone afterwards.
    let mut c = pb::decode_client::DecodeClient::connect(s.decode_grpc.clone())
        .await
        .unwrap();
    let mut stream = c
        .generate(pb::GenerateRequest {
            answered: 1,
            request_id: "t".into(),
            handoff_id: "v1-fake".into(),
            sampling: None,
            max_new_tokens: 2,
            first_token: Some(1),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    let err = stream.message().await.expect_err("import must fail");
    assert_eq!(
        err.metadata().get(edgesplit_proto::error::KEY).unwrap(),
        "import_failed"
    );
    assert!(nothing_held(s, "v1-fake").await);
    // And the node still serves a real request.
    let (st, _, v) = common::post(
        &format!("{}/v1/chat/completions", s.router),
        &serde_json::json!({"messages":[{"role":"user","content":"hi"}],"max_tokens":3,"edgesplit":{"transport":"v1"}}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["edgesplit"]["transport"], "v1");
    assert!(v["edgesplit"]["handoff_bytes"].as_u64().unwrap() > 0);
}

#[tokio::test]
async fn a_slow_upload_is_cut_off_at_its_deadline() {
    let mut o = common::StackOptions::new(common::SMOLLM2);
    o.upload_timeout_s = 2;
    let s = common::start(o);
    let (fp, build) = fingerprint(&s).await;
    let body = with_digest(&ggsq(4));
    let head = put_head("v1-slow", body.len(), &fp, &build);
    let mut sock = tokio::net::TcpStream::connect(v1_addr(&s)).await.unwrap();
    let t0 = std::time::Instant::now();
    sock.write_all(head.as_bytes()).await.unwrap();
    // A few bytes, then nothing: the connection stays open.
    sock.write_all(&body[..10]).await.unwrap();
    let mut out = vec![0u8; 4096];
    let n = tokio::time::timeout(std::time::Duration::from_secs(10), sock.read(&mut out))
        .await
        .expect("an answer at the deadline, not a hang")
        .unwrap();
    let took = t0.elapsed();
    let resp = String::from_utf8_lossy(&out[..n]);
    assert!(resp.starts_with("HTTP/1.1 408"), "{resp}");
    assert!(resp.contains("upload_timeout"), "{resp}");
    // Not before the deadline; the 10 s timeout above bounds the other side.
    assert!(took >= std::time::Duration::from_secs(2), "{took:?}");
    assert!(nothing_held(&s, "v1-slow").await, "nothing is held");
}
