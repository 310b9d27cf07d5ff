//! Conversations: the transcript of an answer the decode node may end, what it then holds,
//! and the prefill node's replay of it.

use std::sync::Arc;
use std::time::Duration;

use edgesplit_proto::pb;

use super::load::{Load, Work};
use super::nodes::{lock, Learned};
use super::seam::{message, Events};
use super::{Backend, ContinueOn, PrefillCalls};
use crate::api::{HandoffMode, Input, ValidRequest};
use crate::placement::Copies;

/// The text of an answer the decode node may end, kept to remember its conversation.
pub(super) struct Transcript {
    pub(super) learned: Arc<std::sync::Mutex<Learned>>,
    pub(super) input: Input,
    pub(super) prompt_tokens: u32,
    pub(super) text: Vec<u8>,
    pub(super) tokens: Vec<i32>,
    /// Where the prefill node should replay the answer once the decode node ended it.
    pub(super) replay: Option<Replay>,
    /// The prefill node wrote the whole answer (kept on the decode node after it): both
    /// nodes hold the conversation alike with no replay.
    pub(super) written_on_prefill_node: bool,
}

/// The prefill node's copy of a conversation the decode node ended: the request as a
/// colocated one, whose answer the prefill node rebuilds step by step and stops
/// (`resume_tokens`, `max_tokens` 0).
pub(super) struct Replay {
    prefill: std::sync::Arc<dyn PrefillCalls>,
    request: pb::PrefillRequest,
    bound: Duration,
    /// Where its work is counted (the prefill node's queue).
    load: Arc<Load>,
    /// Only when the prefill node runs no other answer (`--continue-on measured`).
    spare_time_only: bool,
}

impl Transcript {
    pub(super) fn token(&mut self, id: i32, bytes: &[u8]) {
        self.text.extend_from_slice(bytes);
        self.tokens.push(id);
    }

    /// The decode node ended the answer: it keeps the prompt and every answer token but
    /// the last (sampled, never decoded) as a cached prefix. With `replay`, the prefill
    /// node then rebuilds the same (the prompt as its prefill did, each answer token as
    /// a decode step, the last one not), in the background, so that a later turn can go
    /// there and ship only its new part's KV. Under the measured rule only into the
    /// prefill node's spare time: a replay is as many decode steps there as the answer
    /// had, so one beside other answers would take them that time for a copy a later turn
    /// may never use (measured: with every answer replayed, 4 and 8 clients cost the
    /// laptop as much time per turn as the laptop alone, and the decode nodes added no
    /// capacity).
    pub(super) fn held_by_decode_node(self) {
        let held = (self.prompt_tokens + self.tokens.len() as u32).saturating_sub(1);
        let answer = String::from_utf8_lossy(&self.text).into_owned();
        let replay;
        {
            let mut l = lock(&self.learned);
            // The replay reuses the prefill node's copy of the turns before; a turn the
            // decode node alone holds (not replayed, or still replaying) would be prefilled
            // there instead, which is not the conversation continued.
            let before = l.conversations.copies(&self.input);
            let whole_before = !matches!(before, Some(Copies::DecodeNode | Copies::Replaying));
            replay = self.replay.filter(|r| {
                whole_before
                    && !self.tokens.is_empty()
                    && (!r.spare_time_only || r.load.idle(false))
            });
            l.conversations.record(&self.input, &answer, held);
            if self.written_on_prefill_node {
                l.conversations.replayed(&self.input, &answer);
            } else if replay.is_some() {
                l.conversations.replaying(&self.input, &answer);
            }
        }
        let Some(Replay {
            prefill,
            mut request,
            bound,
            load,
            ..
        }) = replay
        else {
            return;
        };
        // The replay's decode steps are the prefill node's work meanwhile.
        let busy = load.take_work(&self.learned, false, Work::answer(self.tokens.len() as f64));
        request.resume_tokens = self.tokens;
        request.max_tokens = 0;
        let (learned, input) = (self.learned, self.input);
        tokio::spawn(async move {
            let request_id = request.request_id.clone();
            let replayed = async { finishes(prefill.generate(request).await?).await };
            let done = tokio::time::timeout(bound, replayed).await;
            drop(busy);
            let mut l = lock(&learned);
            match done {
                Ok(Ok(true)) => {
                    tracing::info!(%request_id, held, "the prefill node replayed the answer: it holds the conversation too");
                    l.conversations.replayed(&input, &answer);
                }
                Ok(Ok(false)) => {
                    tracing::warn!(%request_id, "the prefill node ended the replay without finishing it");
                    l.conversations.not_replayed(&input, &answer);
                }
                Ok(Err(e)) => {
                    tracing::warn!(%request_id, error = %e, "the prefill node did not replay the answer");
                    l.conversations.not_replayed(&input, &answer);
                }
                Err(_) => {
                    tracing::warn!(%request_id, "the prefill node did not replay the answer within the idle bound");
                    l.conversations.not_replayed(&input, &answer);
                }
            }
            l.replays.notify_waiters();
        });
    }
}

/// Reads a node's token stream (of an answer that writes nothing the client sees) to its
/// end: whether it reported `Finished`.
pub(super) async fn finishes(mut stream: Events<pb::TokenEvent>) -> Result<bool, tonic::Status> {
    while let Some(ev) = message(&mut stream).await? {
        if let Some(pb::token_event::Event::Finished(_)) = ev.event {
            return Ok(true);
        }
    }
    Ok(false)
}

impl Backend {
    /// Whether the prefill node should replay the answers the decode node ends for this
    /// request's conversation (`Transcript::held_by_decode_node`): when a later turn may
    /// go there and ship only its new part's KV - always with `--continue-on
    /// prefill-node`, else once the measured rule finds the prefill node sooner - and the
    /// model's state can be cut into tails (no sliding window). A tail goes over the live
    /// V2 handoff only (the router's default).
    pub(super) fn replay(&self, req: &ValidRequest, request_id: &str) -> Option<Replay> {
        let info = self.known.decode()?;
        let wanted = match self.config.continue_on {
            ContinueOn::PrefillNode => true,
            ContinueOn::Measured => lock(&self.learned)
                .rates
                .prefill_node_sooner(info.kv_bytes_per_token),
        };
        (wanted && !info.sliding_window && self.keeps(req, HandoffMode::Live)).then(|| Replay {
            prefill: self.prefill.clone(),
            request: Self::prefill_request(req, &format!("{request_id}-replay"), None, 0),
            bound: self.config.first_token_timeout,
            load: self.load.clone(),
            spare_time_only: self.config.continue_on == ContinueOn::Measured,
        })
    }
}
