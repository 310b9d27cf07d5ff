//! V1 handoff, receiver side: `PUT /v1/handoff/{id}` takes llama.cpp's sequence-state file.
//!
//! Checks, in order, before anything is kept: a safe handoff id; the sender's model
//! fingerprint and llama.cpp build; a SHA-256 header; a `Content-Length` within the cap.
//! The body is streamed to `{id}.ggsq.part` in the state folder while it is hashed; a body
//! longer or shorter than declared, a checksum mismatch, or a file header that is not a
//! sequence-state file of our version with fewer tokens than the context, deletes the part
//! file and answers 4xx with a reason. Only a file that passed everything is renamed to
//! `{id}.ggsq` and handed to the store; the engine deletes it once loaded.

use std::path::PathBuf;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::put;
use axum::{Json, Router};
use edgesplit_engine::StateFile;
use edgesplit_proto::{frame, v1};
use futures::StreamExt;
use serde_json::json;
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

use crate::store::Store;

/// What the upload handler needs.
pub struct UploadConfig {
    /// When set, an upload must carry a credential made with it (checked before the body
    /// is read).
    pub secret: Option<Arc<edgesplit_proto::auth::Secret>>,
    pub seen: Arc<edgesplit_proto::auth::ReplayGuard>,
    pub store: Arc<Store>,
    pub dir: PathBuf,
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
struct Refusal(StatusCode, &'static str, String);

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.2, "type": "invalid_request_error", "param": null, "code": self.1,
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
            tracing::warn!(handoff_id = %id, code = r.1, reason = %r.2, "V1 upload refused");
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
            "invalid_handoff_id",
            "handoff id must be 1-128 of [A-Za-z0-9._-], not starting with '.'".into(),
        ));
    }
    // Authentication first: an unauthenticated peer learns nothing, not even our model.
    if let Some(secret) = &cfg.secret {
        use edgesplit_proto::auth;
        let sha = header(headers, v1::HEADER_SHA256).unwrap_or("");
        let checked = header(headers, auth::HEADER)
            .ok_or_else(|| "no credential: this node requires the shared secret".to_string())
            .and_then(|t| {
                auth::Token::check(
                    secret,
                    auth::V1_UPLOAD,
                    &[id.as_bytes(), sha.as_bytes()],
                    t,
                    &cfg.seen,
                )
            });
        if let Err(why) = checked {
            return Err(Refusal(StatusCode::UNAUTHORIZED, "auth_failed", why));
        }
    }
    // Who we are must match who sent it, before any byte of the body is read.
    for (name, ours, code, what) in [
        (
            v1::HEADER_MODEL,
            &cfg.fingerprint_hex,
            "model_mismatch",
            "model fingerprint",
        ),
        (
            v1::HEADER_BUILD,
            &cfg.build_id,
            "build_mismatch",
            "llama.cpp build",
        ),
        (
            v1::HEADER_KV_TYPES,
            &cfg.kv_types,
            "kv_type_mismatch",
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
    let sha = header(headers, v1::HEADER_SHA256)
        .filter(|s| s.len() == 64 && s.bytes().all(|c| c.is_ascii_hexdigit()))
        .ok_or_else(|| {
            bad(
                "missing_checksum",
                format!("{} must be 64 hex digits", v1::HEADER_SHA256),
            )
        })?
        .to_ascii_lowercase();
    let declared: u64 = header(headers, "content-length")
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| {
            Refusal(
                StatusCode::LENGTH_REQUIRED,
                "length_required",
                "Content-Length is required".into(),
            )
        })?;
    if declared > cfg.max_bytes {
        return Err(Refusal(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            format!("{declared} bytes exceed the cap of {} bytes", cfg.max_bytes),
        ));
    }
    if cfg.store.contains(id) {
        return Err(Refusal(
            StatusCode::CONFLICT,
            "duplicate_handoff",
            format!("handoff {id} is already held"),
        ));
    }
    if !cfg.store.admits(id) {
        return Err(Refusal(
            StatusCode::SERVICE_UNAVAILABLE,
            "draining",
            format!("draining: no call is waiting for handoff {id}"),
        ));
    }
    let part_path = cfg.dir.join(format!("{id}.ggsq.part"));
    let mut file = tokio::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&part_path)
        .await
        .map_err(|e| {
            if e.kind() == std::io::ErrorKind::AlreadyExists {
                Refusal(
                    StatusCode::CONFLICT,
                    "duplicate_handoff",
                    format!("handoff {id} is already being uploaded"),
                )
            } else {
                Refusal(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
            }
        })?;
    // Deleted on every way out but success.
    let part = StateFile::new(part_path);
    let mut hasher = Sha256::new();
    let mut head = Vec::with_capacity(12);
    let mut written: u64 = 0;
    let mut stream = body.into_data_stream();
    let deadline = tokio::time::Instant::now() + cfg.timeout;
    loop {
        let next = tokio::time::timeout_at(deadline, stream.next()).await;
        let Ok(next) = next else {
            return Err(Refusal(
                StatusCode::REQUEST_TIMEOUT,
                "upload_timeout",
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
                "truncated",
                format!("upload ended after {written} of {declared} bytes: {e}"),
            )
        })?;
        if written + chunk.len() as u64 > declared {
            return Err(bad(
                "length_mismatch",
                format!("body is longer than the declared {declared} bytes"),
            ));
        }
        if head.len() < 12 {
            let take = (12 - head.len()).min(chunk.len());
            head.extend_from_slice(&chunk[..take]);
        }
        hasher.update(&chunk);
        file.write_all(&chunk)
            .await
            .map_err(|e| Refusal(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?;
        written += chunk.len() as u64;
    }
    if written != declared {
        return Err(bad(
            "truncated",
            format!("body has {written} bytes, {declared} were declared"),
        ));
    }
    file.flush()
        .await
        .map_err(|e| Refusal(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?;
    drop(file);
    if hex::encode(hasher.finalize()) != sha {
        return Err(bad(
            "checksum_mismatch",
            "SHA-256 of the body does not match the declared checksum".into(),
        ));
    }
    // Header of a verified body: magic, version, and a token count that fits the context
    // and the file. (llama.cpp's own reader bounds-checks the rest when it loads.)
    let n_tokens = head
        .get(8..12)
        .map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    let mut probe = head.clone();
    probe.resize(12 + n_tokens.min(cfg.n_ctx) as usize * 4, 0);
    v1::parse_header(&probe, cfg.n_ctx).map_err(|e| bad("invalid_state_file", e.to_string()))?;
    if 12 + u64::from(n_tokens) * 4 > written {
        return Err(bad(
            "invalid_state_file",
            format!("file of {written} bytes is shorter than its {n_tokens} token ids"),
        ));
    }
    let final_path = cfg.dir.join(format!("{id}.ggsq"));
    tokio::fs::rename(part.path(), &final_path)
        .await
        .map_err(|e| Refusal(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string()))?;
    let _renamed = part.keep();
    // The store owns the file from here; a refused insert drops (deletes) it.
    cfg.store
        .put_file(id, StateFile::new(final_path), written)
        .map_err(|n| Refusal(StatusCode::CONFLICT, n.code.as_str(), n.reason))?;
    Ok(written)
}
