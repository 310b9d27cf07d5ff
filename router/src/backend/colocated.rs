//! The colocated routes: the whole answer on the prefill node (`local`, and `layers`
//! through its peer) or on the decode node (`phone`, and a conversation's next turn that
//! the decode node holds); only tokens cross.

use std::time::Duration;

use tokio::sync::mpsc;

use edgesplit_proto::pb;

use super::conversation::Transcript;
use super::fallback::Fallback;
use super::load::{idle_bound, Counted, Work};
use super::nodes::lock;
use super::seam::{message, Events};
use super::stream::{forward_prefill_node, next_event_within};
use super::RouterCode;
use super::{input_param, Backend, Event, Failure, Node, PrefilledOn, Started};
use crate::api::{Transport, ValidRequest};

impl Backend {
    /// The colocated path. `fallback`: the split path could not start (the cause), so
    /// this answer is a fallback and reports it first. `measure`: the answer's decode speed
    /// is the prefill node's own (not a layer split's).
    pub(super) async fn start_local(
        &self,
        req: &ValidRequest,
        request_id: &str,
        fallback: Option<String>,
        measure: bool,
    ) -> Result<Started, Failure> {
        let busy = self
            .load
            .take_work(&self.learned, false, Work::of(req, &self.learned));
        let param = input_param(&req.input);
        let preq = Self::prefill_request(req, request_id, None, 0);
        let mut stream = self
            .first_within(self.prefill.generate(preq), param)
            .await?;
        let p = self
            .prefilled(&mut stream, param, "the prefill node")
            .await?;
        busy.prefilled(&self.learned, Work::answer_of(req, &self.learned));
        let (tx, rx) = mpsc::channel(64);
        let idle = idle_bound(self.config.token_idle_timeout, busy.others_ms());
        if let Some(cause) = fallback {
            let _ = tx.send(Event::Fallback { cause }).await;
        }
        if measure {
            lock(&self.learned).rates.prefilled(
                false,
                p.prompt_tokens.saturating_sub(p.cached_tokens),
                p.prefill_ms,
            );
        }
        let counted = measure.then(|| Counted {
            learned: self.learned.clone(),
            busy,
        });
        tokio::spawn(async move {
            forward_prefill_node(stream, &tx, false, idle, param, counted).await;
        });
        Ok(Started {
            transport: Transport::Local,
            choice: None,
            prompt_tokens: Some(p.prompt_tokens),
            cached_tokens: Some(p.cached_tokens),
            prefill_ms: Some(p.prefill_ms),
            placement: PrefilledOn::PrefillNode,
            events: rx,
        })
    }

    /// The whole request on the decode node: what it holds of the prompt is reused, the
    /// rest prefilled there (refused with `not_cached` when that is over `max_uncached`),
    /// and the answer written there; only tokens cross. Lost mid-answer, it is finished on
    /// the prefill node as any answer the decode node writes.
    pub(super) async fn on_decode_node(
        &self,
        req: &ValidRequest,
        transport: Transport,
        request_id: &str,
        max_uncached: Option<u32>,
    ) -> Result<Started, Failure> {
        let busy = self
            .load
            .take_work(&self.learned, true, Work::of(req, &self.learned));
        let param = input_param(&req.input);
        let mut preq = Self::prefill_request(req, request_id, None, 0);
        preq.max_uncached = max_uncached;
        // A conversation's new turn: the call is answered once the node has tokenized the
        // prompt and taken a slot, which on an idle node is at once and on a busy one after
        // the step it runs; a node that does not answer is bounded like an `Info` plus the
        // work queued there, and the request is split instead. The decode node alone (no
        // bound on what it prefills) is committed to this node: it waits as a first token
        // does (a busy decode node answers the call only when a slot is free).
        let bound = if max_uncached.is_some() {
            super::load::idle_bound(self.config.info_timeout, busy.others_ms())
        } else {
            self.config.first_token_timeout
        };
        let call = tokio::time::timeout(bound, self.decode.local(preq)).await;
        let mut stream = match call {
            Ok(r) => r.map_err(|st| {
                Failure::from_status_of(
                    &st,
                    param,
                    (RouterCode::DecodeUnavailable, "the decode node"),
                )
            })?,
            Err(_) => {
                return Err(Failure::unavailable(
                    RouterCode::DecodeUnavailable,
                    format!("the decode node did not answer within {bound:?}"),
                ))
            }
        };
        let p = self
            .prefilled(&mut stream, param, "the decode node")
            .await?;
        busy.prefilled(&self.learned, Work::answer_of(req, &self.learned));
        lock(&self.learned).rates.prefilled(
            true,
            p.prompt_tokens.saturating_sub(p.cached_tokens),
            p.prefill_ms,
        );
        tracing::info!(
            request_id,
            prompt_tokens = p.prompt_tokens,
            cached_tokens = p.cached_tokens,
            max_uncached,
            "the decode node prefills and writes this answer"
        );
        let (tx, rx) = mpsc::channel(64);
        let transcript = Transcript {
            learned: self.learned.clone(),
            input: req.input.clone(),
            prompt_tokens: p.prompt_tokens,
            text: Vec::new(),
            tokens: Vec::new(),
            replay: self.replay(req, request_id),
            written_on_prefill_node: false,
        };
        let fallback = self.fallback(req, request_id);
        let idle = self.config.token_idle_timeout;
        let counted = Counted {
            learned: self.learned.clone(),
            busy,
        };
        tokio::spawn(async move {
            forward_decode_node(stream, tx, transcript, fallback, idle, param, counted).await;
        });
        Ok(Started {
            transport,
            choice: None,
            prompt_tokens: Some(p.prompt_tokens),
            cached_tokens: Some(p.cached_tokens),
            prefill_ms: Some(p.prefill_ms),
            placement: PrefilledOn::DecodeNode,
            events: rx,
        })
    }

    /// A colocated stream's first message, its prefill report.
    pub(super) async fn prefilled(
        &self,
        stream: &mut Events<pb::TokenEvent>,
        param: &str,
        who: &str,
    ) -> Result<pb::Prefilled, Failure> {
        match self.first_within(message(stream), param).await? {
            Some(pb::TokenEvent {
                event: Some(pb::token_event::Event::Prefilled(p)),
            }) => Ok(p),
            _ => Err(Failure::upstream(
                RouterCode::ProtocolError,
                format!("{who} did not report its prefill"),
            )),
        }
    }
}

/// Forwards the decode node's `Local` stream (a conversation it continues) to the client;
/// remembers the conversation when the decode node ends the answer, and finishes it on the
/// prefill node (`fallback`) when the decode node fails after its first token. Each token
/// is awaited for `idle` plus the work the node's other answers have queued
/// ([`super::load::idle_bound`]), read again while it waits.
async fn forward_decode_node(
    mut stream: Events<pb::TokenEvent>,
    tx: mpsc::Sender<Event>,
    mut transcript: Transcript,
    fallback: Option<Fallback>,
    idle: Duration,
    param: &'static str,
    counted: Counted,
) {
    let mut sent = Vec::new();
    let failure = loop {
        let bound = || idle_bound(idle, counted.busy.others_ms());
        let ev = next_event_within(&mut stream, bound, Node::Decode, true, param).await;
        match ev {
            Event::Error(e) => {
                if e.is(RouterCode::Timeout) {
                    lock(&counted.learned).decode_node_silent(&e.message);
                }
                break e;
            }
            Event::Token { id, ref bytes, .. } => {
                sent.push(id);
                transcript.token(id, bytes);
            }
            Event::Finished { .. } => {
                counted.seen(&ev);
                lock(&counted.learned).silence.spoke();
                transcript.held_by_decode_node();
                let _ = tx.send(ev).await;
                return;
            }
            _ => {}
        }
        if tx.send(ev).await.is_err() {
            return;
        }
    };
    match fallback {
        // The prefill node rebuilds the prompt's and the answer's KV and goes on.
        // (An answer "up to the context" has no budget the router knows: it ends with the
        // error.)
        Some(fb) if !sent.is_empty() && fb.request.max_tokens > 0 => {
            let total = fb.request.max_tokens;
            fb.resume(failure, sent, total, &tx, idle, param).await;
        }
        _ => {
            let _ = tx.send(Event::Error(failure)).await;
        }
    }
}
