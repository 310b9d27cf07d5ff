//! V1 handoff, receiver side: `PUT /v1/handoff/{id}` takes llama.cpp's sequence-state file.
//!
//! Checks, in order, before anything is kept: a safe handoff id; the sender's model
//! fingerprint and llama.cpp build; a SHA-256 header; a `Content-Length` within the cap and
//! within the store's room (taken before the body is read, so a body is never received
//! into memory the store could not hold). The body is received into a buffer of its own
//! ([`edgesplit_proto::buffers`]) and hashed as it arrives; a body longer or shorter than
//! declared, a checksum mismatch, or a file header that is not a sequence-state file of
//! our version with fewer tokens than the context, drops it and answers 4xx with a reason.
//! Only a file that passed everything goes to the store, as the raw state the engine
//! imports (made in place, `v1::raw_in_place`): no file on disk, no copy.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::put;
use axum::{Json, Router};
use edgesplit_proto::error::ErrorCode;
use edgesplit_proto::frame::{Receipt, StateFrame};
use edgesplit_proto::handoff::StateSink;
use edgesplit_proto::{buffers, frame, v1};
use futures::StreamExt;
use serde_json::json;

use crate::store::Store;

/// What the upload handler needs.
pub struct UploadConfig {
    /// When set, an upload must carry a credential made with it (checked before the body
    /// is read).
    pub secret: Option<Arc<edgesplit_proto::auth::Secret>>,
    /// Uploads come over TLS (a private link): their digest is the AEAD's.
    pub sealed: bool,
    pub seen: Arc<edgesplit_proto::auth::ReplayGuard>,
    pub store: Arc<Store>,
    /// Largest body accepted (it is received into memory).
    pub max_bytes: u64,
    pub fingerprint_hex: String,
    pub build_id: String,
    /// Our KV cache types as the header carries them, `"{type_k},{type_v}"`.
    pub kv_types: String,
    pub n_ctx: u32,
    /// The whole body must arrive within this.
    pub timeout: std::time::Duration,
}

/// A refusal: status, machine code, human reason.
#[derive(Debug)]
struct Refusal(StatusCode, ErrorCode, String);

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.2, "type": "invalid_request_error", "param": null, "code": self.1.as_str(),
        }});
        (self.0, Json(body)).into_response()
    }
}

/// The V1 upload routes.
pub fn router(cfg: Arc<UploadConfig>) -> Router {
    Router::new()
        .route("/v1/handoff/{id}", put(put_handoff))
        .with_state(cfg)
}

/// Room taken in the store for a body being received, given back when dropped.
struct Room<'a>(&'a Store, u64);

impl Drop for Room<'_> {
    fn drop(&mut self) {
        self.0.release(self.1);
    }
}

/// A header's value for logs (empty when absent or not text).
fn header_value(h: &HeaderMap, name: &str) -> String {
    header(h, name)
        .unwrap_or_default()
        .chars()
        .take(frame::MAX_ID_LEN)
        .collect()
}

/// The header's one value; a header sent twice counts as absent (no guessing which one).
fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    let mut values = h.get_all(name).iter();
    let first = values.next()?;
    if values.next().is_some() {
        return None;
    }
    first.to_str().ok()
}

async fn put_handoff(
    State(cfg): State<Arc<UploadConfig>>,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match receive(&cfg, &id, &headers, body).await {
        Ok(bytes) => {
            tracing::info!(handoff_id = %id, bytes, "V1 state file received and verified");
            Json(json!({"handoff_id": id, "bytes": bytes})).into_response()
        }
        Err(r) => {
            tracing::warn!(handoff_id = %id, code = r.1.as_str(), reason = %r.2, "V1 upload refused");
            cfg.store
                .counters
                .handoffs_refused
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            r.into_response()
        }
    }
}

async fn receive(
    cfg: &UploadConfig,
    id: &str,
    headers: &HeaderMap,
    body: Body,
) -> Result<u64, Refusal> {
    let bad = |code, msg: String| Refusal(StatusCode::BAD_REQUEST, code, msg);
    if !frame::valid_id(id) {
        return Err(bad(
            ErrorCode::InvalidHandoffId,
            "handoff id must be 1-128 of [A-Za-z0-9._-], not starting with '.'".into(),
        ));
    }
    // Authentication first: an unauthenticated peer learns nothing, not even our model.
    if let Some(secret) = &cfg.secret {
        use edgesplit_proto::auth;
        let len = header(headers, "content-length").unwrap_or("");
        let checked = header(headers, auth::HEADER)
            .ok_or_else(|| "no credential: this node requires the shared secret".to_string())
            .and_then(|t| {
                auth::Token::check(
                    secret,
                    auth::V1_UPLOAD,
                    &[id.as_bytes(), len.as_bytes()],
                    t,
                    &cfg.seen,
                )
            });
        if let Err(why) = checked {
            return Err(Refusal(
                StatusCode::UNAUTHORIZED,
                ErrorCode::AuthFailed,
                why,
            ));
        }
    }
    // Who we are must match who sent it, before any byte of the body is read.
    for (name, ours, code, what) in [
        (
            v1::HEADER_MODEL,
            &cfg.fingerprint_hex,
            ErrorCode::ModelMismatch,
            "model fingerprint",
        ),
        (
            v1::HEADER_BUILD,
            &cfg.build_id,
            ErrorCode::BuildMismatch,
            "llama.cpp build",
        ),
        (
            v1::HEADER_KV_TYPES,
            &cfg.kv_types,
            ErrorCode::KvTypeMismatch,
            "KV cache types (K,V)",
        ),
    ] {
        match header(headers, name) {
            Some(v) if v == ours.as_str() => {}
            other => {
                return Err(Refusal(
                    StatusCode::CONFLICT,
                    code,
                    format!(
                        "{what} mismatch: receiver has {ours:?}, sender has {:?}",
                        other.unwrap_or("none")
                    ),
                ))
            }
        }
    }
    if header(headers, v1::HEADER_DIGEST) != Some(v1::DIGEST_TRAILER) {
        return Err(bad(
            ErrorCode::MissingChecksum,
            format!(
                "{}: {} is required: the body ends with the file's {}-byte digest",
                v1::HEADER_DIGEST,
                v1::DIGEST_TRAILER,
                v1::TRAILER_LEN
            ),
        ));
    }
    let declared: u64 = header(headers, "content-length")
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| {
            Refusal(
                StatusCode::LENGTH_REQUIRED,
                ErrorCode::LengthRequired,
                "Content-Length is required".into(),
            )
        })?;
    if declared <= v1::TRAILER_LEN as u64 {
        return Err(bad(
            ErrorCode::Truncated,
            format!(
                "a body of {declared} bytes cannot hold a file and its {}-byte digest",
                v1::TRAILER_LEN
            ),
        ));
    }
    if declared > cfg.max_bytes {
        return Err(Refusal(
            StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::TooLarge,
            format!("{declared} bytes exceed the cap of {} bytes", cfg.max_bytes),
        ));
    }
    if cfg.store.contains(id) {
        return Err(Refusal(
            StatusCode::CONFLICT,
            ErrorCode::DuplicateHandoff,
            format!("handoff {id} is already held"),
        ));
    }
    if !cfg.store.admits(id) {
        return Err(Refusal(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::Draining,
            format!("draining: no call is waiting for handoff {id}"),
        ));
    }
    // Room in the store before a byte of the body is read; given back when this returns
    // (the state, if it passed, is then stored against the same cap).
    cfg.store.room(id, declared).map_err(|n| {
        Refusal(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::from(n.code),
            n.reason,
        )
    })?;
    let room = Room(&cfg.store, declared);
    // `declared` is within the cap and the store's room. The file is what comes before
    // the digest: it is hashed as it arrives, the digest kept aside.
    let file_len = declared - v1::TRAILER_LEN as u64;
    let mut file = buffers::take(usize::try_from(file_len).unwrap_or(usize::MAX));
    let mut trailer = Vec::with_capacity(v1::TRAILER_LEN);
    let mut hasher = v1::digest(cfg.secret.as_deref(), id, cfg.sealed);
    let mut written: u64 = 0;
    let started = Instant::now();
    let mut hashing = std::time::Duration::ZERO;
    let mut stream = body.into_data_stream();
    let deadline = tokio::time::Instant::now() + cfg.timeout;
    loop {
        let next = tokio::time::timeout_at(deadline, stream.next()).await;
        let Ok(next) = next else {
            return Err(Refusal(
                StatusCode::REQUEST_TIMEOUT,
                ErrorCode::UploadTimeout,
                format!(
                    "upload took longer than {:?} ({written} of {declared} bytes arrived)",
                    cfg.timeout
                ),
            ));
        };
        let Some(chunk) = next else {
            break;
        };
        let chunk = chunk.map_err(|e| {
            bad(
                ErrorCode::Truncated,
                format!("upload ended after {written} of {declared} bytes: {e}"),
            )
        })?;
        if written + chunk.len() as u64 > declared {
            return Err(bad(
                ErrorCode::LengthMismatch,
                format!("body is longer than the declared {declared} bytes"),
            ));
        }
        // Of this chunk, the part before the digest is the file's.
        let in_file = usize::try_from(file_len.saturating_sub(written))
            .unwrap_or(usize::MAX)
            .min(chunk.len());
        let t0 = Instant::now();
        hasher.update(&chunk[..in_file]);
        hashing += t0.elapsed();
        file.extend_from_slice(&chunk[..in_file]);
        trailer.extend_from_slice(&chunk[in_file..]);
        written += chunk.len() as u64;
    }
    if written != declared {
        return Err(bad(
            ErrorCode::Truncated,
            format!("body has {written} bytes, {declared} were declared"),
        ));
    }
    let t0 = Instant::now();
    let matches = hasher.verify(&trailer);
    let receipt = Receipt {
        receive: started.elapsed(),
        verify: hashing + t0.elapsed(),
    };
    if !matches {
        return Err(bad(
            ErrorCode::ChecksumMismatch,
            "the digest at the end of the body does not match the file".into(),
        ));
    }
    // A verified body's header (magic, version, a token count that fits the context and
    // the file) and its state's layout, walked to the end with a cell per token, as a V2
    // state's is: no byte llama.cpp reads is unchecked (it bounds-checks again at import).
    let header = v1::validate(&file, cfg.n_ctx)
        .map_err(|e| bad(ErrorCode::InvalidStateFile, e.to_string()))?;
    let (start, tokens) = v1::raw_in_place(&mut file, &header);
    let state = StateFrame {
        handoff_id: id.to_string(),
        request_id: header_value(headers, v1::HEADER_REQUEST),
        tokens,
        descriptors: Vec::new(),
        payload: buffers::share(file).slice(start..),
    };
    // The room goes back first: the stored state counts against the same cap.
    drop(room);
    cfg.store
        .put_v1(id, state, receipt)
        .map_err(|n| Refusal(StatusCode::CONFLICT, ErrorCode::from(n.code), n.reason))?;
    Ok(written)
}
