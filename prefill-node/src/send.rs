//! Sending a prompt's state after the prefill (`after` handoffs): a sender task per
//! request, V2 over the link or V1 by HTTP upload, its failures told apart (retryable or
//! not) and reported as the gRPC status the router reads.

use std::sync::Arc;
use std::time::{Duration, Instant};

use edgesplit_engine::Exported;
use edgesplit_proto::error::{self, ErrorCode};
use edgesplit_proto::frame::{NackCode, StateFrame};
use edgesplit_proto::handoff::{self, HandoffError, Limits};
use edgesplit_proto::link::Link;
use edgesplit_proto::{layout, pb};
use tonic::Status;

use crate::{metrics, upload};

/// What one delivered handoff measured, sender side.
#[derive(Debug, Clone, Copy, Default)]
struct Delivered {
    bytes: u64,
    connect: Duration,
    hash: Duration,
}

fn handoff_done(d: Delivered, export_ms: f64, transfer_ms: f64) -> pb::PrefillEvent {
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    pb::PrefillEvent {
        event: Some(pb::prefill_event::Event::Handoff(pb::HandoffDone {
            bytes: d.bytes,
            export_ms,
            transfer_ms,
            connect_ms: ms(d.connect),
            hash_ms: ms(d.hash),
        })),
    }
}

/// A handoff that failed, on either transport.
#[derive(Debug, thiserror::Error)]
enum HandoffFailure {
    #[error("{0}")]
    V2(#[from] HandoffError),
    #[error("{0}")]
    V1(#[from] upload::UploadError),
}

impl HandoffFailure {
    /// Failures a second attempt may not meet: the bytes or the link, not the peer's
    /// refusal of who we are (model, build, context, secret) or of the request (too long,
    /// no room).
    fn retryable(&self) -> bool {
        match self {
            HandoffFailure::V1(e) => e.retryable(),
            HandoffFailure::V2(HandoffError::Refused(n)) => matches!(
                n.code,
                NackCode::ChecksumMismatch
                    | NackCode::Malformed
                    | NackCode::Timeout
                    | NackCode::Internal
                    | NackCode::BadMagic
            ),
            HandoffFailure::V2(HandoffError::Mismatch(_) | HandoffError::Auth(_)) => false,
            HandoffFailure::V2(
                HandoffError::Connect { .. }
                | HandoffError::Timeout(_)
                | HandoffError::Protocol(_)
                | HandoffError::Codec(_),
            ) => true,
        }
    }

    /// What the router sees: `Unavailable` with a stable cause name.
    fn status(&self) -> Status {
        let (code, what) = match self {
            HandoffFailure::V1(e) => (e.code(), "KV handoff (V1 upload) failed"),
            HandoffFailure::V2(HandoffError::Refused(n) | HandoffError::Mismatch(n)) => {
                (ErrorCode::from(n.code), "KV handoff failed")
            }
            HandoffFailure::V2(HandoffError::Timeout(_)) => {
                (ErrorCode::HandoffTimeout, "KV handoff failed")
            }
            HandoffFailure::V2(HandoffError::Connect { .. }) => {
                (ErrorCode::HandoffUnreachable, "KV handoff failed")
            }
            HandoffFailure::V2(_) => (ErrorCode::HandoffFailed, "KV handoff failed"),
        };
        error::status(tonic::Code::Unavailable, code, format!("{what}: {self}"))
    }
}

/// One state to hand over once the first token went out.
pub(crate) struct HandoffJob {
    pub(crate) handoff: pb::Handoff,
    pub(crate) request_id: String,
    pub(crate) prompt_tokens: Vec<i32>,
    pub(crate) export_ms: f64,
}

/// A state on its way: a V2 frame, or a V1 file (built in memory).
enum Outgoing {
    Frame(StateFrame),
    File(upload::V1File),
}

/// What a handoff needs of the service, owned so that it runs in its own task.
pub(crate) struct Sender {
    pub(crate) info: edgesplit_engine::ModelInfo,
    pub(crate) limits: Limits,
    pub(crate) http: reqwest::Client,
    pub(crate) metrics: Arc<metrics::NodeMetrics>,
    pub(crate) link: Link,
}

impl Sender {
    /// Sends `state` (V2 frame or V1 file) and retries once when the failure was the bytes
    /// or the link; every attempt is counted. Returns the event for the router.
    pub(crate) async fn send(
        &self,
        job: HandoffJob,
        state: Exported,
    ) -> Result<pb::PrefillEvent, Status> {
        let HandoffJob {
            handoff: h,
            request_id,
            prompt_tokens,
            export_ms,
        } = job;
        // The payload moves into the frame or the file (no copy); retries share it.
        let Exported::Raw(bytes) = state;
        let outgoing = if h.transport == pb::HandoffTransport::V1 as i32 {
            let Some(at) = edgesplit_proto::v1::raw_sections(&bytes) else {
                return Err(error::status(
                    tonic::Code::Internal,
                    ErrorCode::ExportFailed,
                    "the exported state does not start with llama.cpp's state header",
                ));
            };
            Outgoing::File(upload::V1File {
                head: edgesplit_proto::v1::file_head(&prompt_tokens).into(),
                sections: edgesplit_proto::buffers::share(bytes).slice(at..),
            })
        } else {
            let layout = layout::describe(&bytes);
            Outgoing::Frame(StateFrame {
                handoff_id: h.handoff_id.clone(),
                request_id: request_id.clone(),
                tokens: prompt_tokens,
                descriptors: layout.descriptors,
                payload: edgesplit_proto::buffers::share(bytes),
            })
        };
        let transport = match outgoing {
            Outgoing::Frame(_) => "v2",
            Outgoing::File(_) => "v1",
        };
        let attempt = || async {
            match &outgoing {
                Outgoing::File(file) => {
                    let u = upload::upload(
                        &self.http,
                        &self.link.upload_url(&h.decode_addr),
                        &h.handoff_id,
                        &request_id,
                        file,
                        &self.info,
                        &self.link,
                    )
                    .await?;
                    Ok(Delivered {
                        bytes: u.bytes,
                        connect: Duration::ZERO,
                        hash: u.hash,
                    })
                }
                Outgoing::Frame(frame) => {
                    let r = handoff::send_state(
                        &h.decode_addr,
                        &self.info.identity(),
                        frame.clone(),
                        &self.limits,
                        &self.link,
                    )
                    .await?;
                    Ok(Delivered {
                        bytes: r.payload_bytes,
                        connect: r.connect,
                        hash: r.hash,
                    })
                }
            }
        };
        let t0 = Instant::now();
        let mut result: Result<Delivered, HandoffFailure> = attempt().await;
        if let Err(e) = &result {
            if e.retryable() {
                tracing::warn!(%request_id, transport, error = %e, "handoff failed; retrying once");
                self.metrics
                    .handoff(transport, false, 0, t0.elapsed().as_secs_f64());
                result = attempt().await;
            }
        }
        // The state's buffer goes back to the pool.
        drop(outgoing);
        let secs = t0.elapsed().as_secs_f64();
        let bytes = result.as_ref().map_or(0, |d| d.bytes);
        self.metrics.handoff(transport, result.is_ok(), bytes, secs);
        match result {
            Ok(delivered) => {
                let transfer_ms = secs * 1000.0;
                tracing::info!(%request_id, handoff_id = %h.handoff_id, transport, bytes, transfer_ms, "handoff sent");
                Ok(handoff_done(delivered, export_ms, transfer_ms))
            }
            Err(e) => {
                tracing::warn!(%request_id, transport, error = %e, "handoff failed");
                Err(e.status())
            }
        }
    }
}
