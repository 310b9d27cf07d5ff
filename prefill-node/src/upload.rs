//! V1 handoff, sender side: a sequence-state file sent to the decode node by HTTP PUT,
//! built in memory from the exported state: the file header, then the state's own buffer
//! in large chunks (no copy, no file on disk), then the file's digest (`v1::digest`),
//! computed chunk by chunk as the body goes out: no pass of its own before the request.

use bytes::Bytes;
use edgesplit_engine::ModelInfo;
use edgesplit_proto::auth::{self, Secret};
use edgesplit_proto::error::ErrorCode;
use edgesplit_proto::v1;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Why an upload failed.
#[derive(Debug, thiserror::Error)]
pub enum UploadError {
    #[error("upload to {url} failed: {source}")]
    Send { url: String, source: reqwest::Error },
    #[error("refused by the decode node ({status}, {code}): {message}")]
    Refused {
        status: u16,
        /// The refusal's code ([`ErrorCode::HandoffFailed`] for one this build does not
        /// know, whose name is then in `message`).
        code: ErrorCode,
        message: String,
    },
}

impl UploadError {
    /// Failures a second attempt may not meet: the link or the bytes, not a refusal of
    /// who we are or of the request.
    #[must_use]
    pub fn retryable(&self) -> bool {
        match self {
            UploadError::Send { .. } => true,
            UploadError::Refused { status, code, .. } => {
                *status >= 500 || matches!(code, ErrorCode::ChecksumMismatch | ErrorCode::Truncated)
            }
        }
    }

    /// Stable name for metrics and the router.
    #[must_use]
    pub fn code(&self) -> ErrorCode {
        match self {
            UploadError::Send { source, .. } if source.is_connect() || source.is_timeout() => {
                ErrorCode::HandoffUnreachable
            }
            UploadError::Send { .. } => ErrorCode::HandoffFailed,
            UploadError::Refused { code, .. } => *code,
        }
    }
}

/// A delivered upload: its bytes, and the time its digest took (while sending).
#[derive(Debug, Clone, Copy)]
pub struct Uploaded {
    pub bytes: u64,
    pub hash: std::time::Duration,
}

/// Body bytes per chunk handed to the HTTP client (slices of the state, not copies).
const CHUNK: usize = 1 << 20;

/// The file of a state: its header (`v1::file_head`) and the state's sections.
#[derive(Debug, Clone)]
pub struct V1File {
    pub head: Bytes,
    pub sections: Bytes,
}

/// Uploads `file` as handoff `handoff_id` to `url_base` over `link` (its secret makes the
/// credential; over TLS the digest is the AEAD's); returns the bytes sent.
///
/// # Errors
/// The HTTP request, or a refusal by the decode node.
pub async fn upload(
    client: &reqwest::Client,
    url_base: &str,
    handoff_id: &str,
    request_id: &str,
    file: &V1File,
    info: &ModelInfo,
    link: &edgesplit_proto::link::Link,
) -> Result<Uploaded, UploadError> {
    let secret = link.secret();
    let len = (file.head.len() + file.sections.len() + v1::TRAILER_LEN) as u64;
    let sections = file.sections.clone();
    let chunks = std::iter::once(file.head.clone()).chain(
        (0..sections.len())
            .step_by(CHUNK)
            .map(move |at| sections.slice(at..(at + CHUNK).min(sections.len()))),
    );
    // Each chunk is fed to the digest as it is handed to the client; the digest follows.
    let hash_ns = Arc::new(AtomicU64::new(0));
    let timed = hash_ns.clone();
    let mut chunks = chunks;
    let mut digest = Some(v1::digest(secret, handoff_id, link.is_private()));
    let body = std::iter::from_fn(move || {
        let d = digest.as_mut()?;
        match chunks.next() {
            Some(chunk) => {
                let t0 = std::time::Instant::now();
                d.update(&chunk);
                timed.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
                Some(chunk)
            }
            None => digest.take().map(|d| Bytes::copy_from_slice(&d.finalize())),
        }
    });
    let url = format!("{}/{handoff_id}", url_base.trim_end_matches('/'));
    let resp = client
        .put(&url)
        .header(reqwest::header::CONTENT_LENGTH, len)
        .header(reqwest::header::CONTENT_TYPE, "application/octet-stream")
        .header(v1::HEADER_DIGEST, v1::DIGEST_TRAILER)
        .header(v1::HEADER_MODEL, info.fingerprint_hex())
        .header(v1::HEADER_BUILD, &info.build_id)
        .header(
            v1::HEADER_KV_TYPES,
            format!("{},{}", info.type_k, info.type_v),
        )
        .header(v1::HEADER_REQUEST, request_id)
        .headers(credentials(secret, handoff_id, len))
        .body(reqwest::Body::wrap_stream(futures::stream::iter(
            body.map(Ok::<_, std::io::Error>),
        )))
        .send()
        .await
        .map_err(|source| UploadError::Send {
            url: url.clone(),
            source,
        })?;
    let status = resp.status().as_u16();
    if resp.status().is_success() {
        let hash = std::time::Duration::from_nanos(hash_ns.load(Ordering::Relaxed));
        return Ok(Uploaded { bytes: len, hash });
    }
    let body: serde_json::Value = resp.json().await.unwrap_or_default();
    let name = body["error"]["code"].as_str().unwrap_or("");
    let message = body["error"]["message"]
        .as_str()
        .unwrap_or("no reason given");
    let (code, message) = match ErrorCode::from_name(name) {
        Some(code) => (code, message.to_string()),
        None => (
            ErrorCode::HandoffFailed,
            format!("{message} (code {name:?})"),
        ),
    };
    Err(UploadError::Refused {
        status,
        code,
        message,
    })
}

/// The V1 credential header: a token bound to the handoff id and the body's length (the
/// body itself is bound to the id by its keyed digest, and a token is taken once).
fn credentials(secret: Option<&Secret>, handoff_id: &str, len: u64) -> reqwest::header::HeaderMap {
    let mut h = reqwest::header::HeaderMap::new();
    if let Some(s) = secret {
        let len = len.to_string();
        let token = auth::Token::make(s, auth::V1_UPLOAD, &[handoff_id.as_bytes(), len.as_bytes()]);
        if let Ok(v) = token.parse() {
            h.insert(auth::HEADER, v);
        }
    }
    h
}
