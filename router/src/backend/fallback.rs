//! The fallback: an answer whose split failed is finished on the prefill node, after the
//! tokens the client was already sent.

use std::time::Duration;

use edgesplit_proto::pb;
use tokio::sync::mpsc;

use super::event::finished_here;
use super::stream::forward_prefill_node;
use super::Failure;
use super::RouterCode;
use super::{Backend, Event, FinishReason, PrefillCalls, Started, Transport};
use crate::api::ValidRequest;

/// What the router needs to finish an answer on the prefill node when the split fails.
pub struct Fallback {
    pub(super) prefill: std::sync::Arc<dyn PrefillCalls>,
    /// The request as a colocated one (no handoff); `resume_tokens` and `max_tokens` are
    /// filled in at the failure.
    pub(super) request: pb::PrefillRequest,
    pub(super) first_token_timeout: Duration,
}

impl Backend {
    pub(super) fn fallback(&self, req: &ValidRequest, request_id: &str) -> Option<Fallback> {
        self.config.fallback.then(|| Fallback {
            prefill: self.prefill.clone(),
            request: Self::prefill_request(req, request_id, None, 0),
            first_token_timeout: self.config.first_token_timeout,
        })
    }

    /// The decode node cannot take an answer that has not started (gone, asleep, or it
    /// refused): the prefill node answers it under the fallback policy, `fallback` naming
    /// `cause`, and the answer reports `transport` as asked (or as `auto` chose).
    pub(super) async fn answer_here_instead(
        &self,
        req: &ValidRequest,
        request_id: &str,
        cause: &Failure,
        transport: Transport,
    ) -> Result<Started, Failure> {
        tracing::warn!(
            request_id,
            cause = cause.name(),
            reason = %cause.message,
            "the decode node cannot take the answer; answering on the prefill node"
        );
        let mut started = self
            .start_local(req, request_id, Some(cause.name().to_string()), true)
            .await?;
        started.transport = transport;
        Ok(started)
    }
}

impl Fallback {
    /// Finishes the answer on the prefill node after the `sent` tokens (of `total`).
    pub(super) async fn resume(
        self,
        cause: Failure,
        sent: Vec<i32>,
        total: u32,
        tx: &mpsc::Sender<Event>,
        idle: Duration,
        param: &'static str,
    ) {
        let why = cause.name().to_string();
        tracing::warn!(
            request_id = %self.request.request_id,
            cause = %why,
            reason = %cause.message,
            tokens_sent = sent.len(),
            "the split failed; finishing the answer on the prefill node"
        );
        if tx.send(Event::Fallback { cause: why }).await.is_err() {
            return;
        }
        let remaining = total.saturating_sub(sent.len() as u32);
        if remaining == 0 {
            // Every token was sent; only the end was lost.
            let _ = tx.send(finished_here(FinishReason::Length)).await;
            return;
        }
        let mut request = self.request;
        request.resume_tokens = sent;
        request.max_tokens = remaining;
        let call =
            tokio::time::timeout(self.first_token_timeout, self.prefill.generate(request)).await;
        let stream = match call {
            Ok(Ok(s)) => s,
            Ok(Err(st)) => {
                let _ = tx
                    .send(Event::Error(Failure::from_status(&st, param)))
                    .await;
                return;
            }
            Err(_) => {
                let _ = tx
                    .send(Event::Error(Failure::upstream(
                        RouterCode::Timeout,
                        "the prefill node did not take over the answer in time",
                    )))
                    .await;
                return;
            }
        };
        let wait = idle.max(self.first_token_timeout);
        forward_prefill_node(stream, tx, true, wait, param, None).await;
    }
}
