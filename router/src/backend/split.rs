//! One split answer after its first token, as a state machine: the handoff after the
//! answer (`after`) or during it (`live`, with the switch to the decode node), the state
//! kept on the decode node when a live answer ended on the prefill node, and the fallback
//! when the handoff or the decode node fails.

use std::sync::Arc;
use std::time::Duration;

use edgesplit_proto::pb;
use tokio::sync::mpsc;

use super::conversation::{finishes, Transcript};
use super::event::finished_here;
use super::fallback::Fallback;
use super::load::{decoded, Busy, Load, Work};
use super::nodes::{lock, Learned};
use super::seam::{message, Events};
use super::stream::{next_event_within, token_event};
use super::Failure;
use super::RouterCode;
use super::{DecodeCalls, Event, FinishReason, Node};
use crate::api::HandoffMode;

/// How the split part of a request ended.
enum Split {
    /// Finished, or the client went away.
    Over,
    /// The handoff or the decode node failed; the client has not seen an error yet.
    Failed(Failure),
}

/// The handoff's report: the prefill node's `Prefill` stream after its first token, read
/// in a task of its own.
type HandoffReport = tokio::task::JoinHandle<Result<Option<pb::PrefillEvent>, tonic::Status>>;

/// The waits of a split answer (the router's flags).
#[derive(Debug, Clone, Copy)]
pub(super) struct Waits {
    /// Longest silence of a node's stream between two tokens (`--token-idle-timeout`).
    pub(super) idle: Duration,
    /// How long a failed decode node's stream waits for the handoff's own report, which
    /// names the cause better.
    pub(super) handoff_error_grace: Duration,
    /// How long the end of an answer waits for the handoff's figures.
    pub(super) handoff_report_wait: Duration,
}

/// Where a split answer counts as work while it runs (`load.rs`): on the prefill node until
/// the decode node takes over, on the decode node after, on the prefill node again after a
/// fallback; and the decode speed measured on the node that wrote its tokens.
pub(super) struct Counted {
    pub(super) learned: Arc<std::sync::Mutex<Learned>>,
    pub(super) load: Arc<Load>,
    pub(super) prefill_busy: Option<Busy>,
    pub(super) decode_busy: Option<Busy>,
    /// The answer tokens the request is expected to write (`load::answer_tokens`): what
    /// is left of them is the work counted on the node that writes the rest.
    pub(super) answer_tokens: f64,
    /// When the first token was forwarded: a live answer's tokens written on the prefill
    /// node until the switch or the end measure its decode speed.
    pub(super) first_sent: std::time::Instant,
}

impl Counted {
    /// How long the node writing this answer (the decode node or the prefill node) may send
    /// nothing before it counts as failed ([`super::load::idle_bound`]).
    pub(super) fn idle_bound(&self, idle: Duration, on_decode_node: bool) -> Duration {
        let busy = if on_decode_node {
            &self.decode_busy
        } else {
            &self.prefill_busy
        };
        let others = busy
            .as_ref()
            .map_or_else(|| self.load.backlog_ms(on_decode_node), Busy::others_ms);
        super::load::idle_bound(idle, others)
    }

    /// The answer tokens expected still, `sent` of them sent.
    fn tokens_left(&self, sent: usize) -> f64 {
        (self.answer_tokens - sent as f64).max(0.0)
    }

    /// The prefill node wrote the live answer's tokens after the first (`sent` in all)
    /// since `first_sent`.
    fn prefill_node_decoded(&self, sent: usize) {
        if let Some(busy) = &self.prefill_busy {
            let tokens = u32::try_from(sent.saturating_sub(1)).unwrap_or(u32::MAX);
            let ms = self.first_sent.elapsed().as_secs_f64() * 1000.0;
            busy.record(&self.learned, tokens, ms);
        }
    }

    /// The decode node writes the rest of the answer: it counts there, not on the prefill
    /// node.
    fn hand_to_decode_node(&mut self, sent: usize) {
        self.prefill_busy = None;
        let left = Work::answer(self.tokens_left(sent));
        self.decode_busy = Some(self.load.take_work(&self.learned, true, left));
    }

    /// The prefill node finishes the answer (the fallback): it counts there again.
    fn back_to_prefill_node(&mut self, sent: usize) {
        self.decode_busy = None;
        if self.prefill_busy.is_none() {
            let left = Work::answer(self.tokens_left(sent));
            self.prefill_busy = Some(self.load.take_work(&self.learned, false, left));
        }
    }

    /// An event of the decode node's stream: its tokens measure its decode speed.
    fn decode_node_event(&self, ev: &Event) {
        if let Some(busy) = &self.decode_busy {
            decoded(&self.learned, busy, ev);
        }
    }
}

/// One split answer after its first token: it forwards that token, then the decode node's
/// tokens, while the handoff report comes in; when the handoff or the decode node fails it
/// finishes on the prefill node (`fallback`) or ends with the error.
pub(super) struct SplitAnswer {
    /// Kept while the answer may end on the decode node (which then holds it).
    pub(super) transcript: Option<Transcript>,
    pub(super) first: pb::FirstToken,
    pub(super) decode: Arc<dyn DecodeCalls>,
    pub(super) generate: pb::GenerateRequest,
    pub(super) tx: mpsc::Sender<Event>,
    /// Every token the client has been sent, the first included.
    pub(super) sent: Vec<i32>,
    pub(super) waits: Waits,
    /// The request field an upstream refusal names (`messages` or `prompt`).
    pub(super) param: &'static str,
    pub(super) mode: HandoffMode,
    /// A live answer that ends on the prefill node is handed over after it
    /// ([`SplitAnswer::keep_on_decode_node`]).
    pub(super) keep: bool,
    pub(super) counted: Counted,
}

/// Longest wait for a live answer's state to be kept on the decode node after the answer
/// ended (the prefill node's own handoff deadlines end a stalled one sooner).
const KEEP_WAIT: Duration = Duration::from_secs(600);

impl SplitAnswer {
    pub(super) async fn run(
        mut self,
        pstream: Events<pb::PrefillEvent>,
        fallback: Option<Fallback>,
    ) {
        let total = self.first.max_tokens;
        let Split::Failed(e) = self.split_part(pstream).await else {
            return;
        };
        match fallback {
            Some(fb) => {
                self.counted.back_to_prefill_node(self.sent.len());
                let idle = self.counted.idle_bound(self.waits.idle, false);
                fb.resume(e, self.sent, total, &self.tx, idle, self.param)
                    .await
            }
            None => {
                let _ = self.tx.send(Event::Error(e)).await;
            }
        }
    }

    /// Forwards the first token, the handoff report and the decode node's tokens.
    async fn split_part(&mut self, mut pstream: Events<pb::PrefillEvent>) -> Split {
        let first = Event::Token {
            id: self.first.token,
            bytes: self.first.piece.clone(),
            logprobs: self.first.logprobs.clone(),
            from: Node::Prefill,
        };
        if let Some(t) = &mut self.transcript {
            t.token(self.first.token, &self.first.piece);
        }
        if self.tx.send(Event::Mode(self.mode)).await.is_err() || self.tx.send(first).await.is_err()
        {
            return Split::Over;
        }
        if self.first.last {
            let reason = if self.first.eog {
                FinishReason::Stop
            } else {
                FinishReason::Length
            };
            let _ = self.tx.send(finished_here(reason)).await;
            return Split::Over;
        }
        if self.mode == HandoffMode::Live {
            return self.live_part(pstream).await;
        }
        let mut handoff: HandoffReport = tokio::spawn(async move { message(&mut pstream).await });
        let mut handoff_pending = true;
        let stream = match self.decode_stream(&mut handoff, &mut handoff_pending).await {
            Ok(s) => s,
            Err(split) => return split,
        };
        self.counted.hand_to_decode_node(self.sent.len());
        self.forward_decode(stream, &mut handoff, &mut handoff_pending)
            .await
    }

    /// A live answer: forwards the prefill node's tokens until it finishes the answer or
    /// reports the switch, then the decode node's.
    async fn live_part(&mut self, mut pstream: Events<pb::PrefillEvent>) -> Split {
        use pb::prefill_event::Event as P;
        let idle = self.counted.idle_bound(self.waits.idle, false);
        loop {
            let event = match tokio::time::timeout(idle, message(&mut pstream)).await {
                Ok(Ok(Some(m))) => m.event,
                Ok(Ok(None)) => {
                    return Split::Failed(Failure::upstream(
                        RouterCode::StreamEnded,
                        "the prefill node ended the live answer without finishing it",
                    ))
                }
                Ok(Err(st)) => return Split::Failed(Failure::from_status(&st, self.param)),
                Err(_) => {
                    return Split::Failed(Failure::upstream(
                        RouterCode::Timeout,
                        format!("no token from the prefill node within {idle:?}"),
                    ))
                }
            };
            let ev = match event {
                Some(P::Token(t)) => {
                    self.sent.push(t.id);
                    if let Some(tr) = &mut self.transcript {
                        tr.token(t.id, &t.piece);
                    }
                    Event::Token {
                        id: t.id,
                        bytes: t.piece,
                        logprobs: t.logprobs,
                        from: Node::Prefill,
                    }
                }
                Some(P::Finished(f)) => {
                    self.counted.prefill_node_decoded(self.sent.len());
                    // Every token was written on the prefill node: none by a decode node.
                    let mut ev = token_event(
                        pb::TokenEvent {
                            event: Some(pb::token_event::Event::Finished(f)),
                        },
                        false,
                        Node::Prefill,
                    );
                    if let Event::Finished {
                        decode_tokens,
                        decode_ms,
                        ..
                    } = &mut ev
                    {
                        *decode_tokens = 0;
                        *decode_ms = 0.0;
                    }
                    let _ = self.tx.send(ev).await;
                    if self.keep {
                        self.keep_on_decode_node(pstream);
                    }
                    return Split::Over;
                }
                Some(P::Cancelled(c)) => {
                    // Nothing of this answer will be kept on the decode node.
                    self.keep = false;
                    Event::HandoffCancelled {
                        reason: c.reason,
                        bytes: c.bytes,
                    }
                }
                Some(P::Switched(sw)) => return self.switch(sw).await,
                Some(P::First(_) | P::Handoff(_) | P::Kept(_)) | None => {
                    return Split::Failed(Failure::upstream(
                        RouterCode::ProtocolError,
                        "unexpected event in the prefill node's live answer",
                    ))
                }
            };
            if self.tx.send(ev).await.is_err() {
                return Split::Over;
            }
        }
    }

    /// The live answer ended on the prefill node, which goes on sending its state: once
    /// the decode node holds all of it (`Kept`), a `Generate` of no tokens takes it into
    /// the decode node's cache, and the conversation is remembered there, so that its
    /// next turn goes on there with nothing crossing. In the background, after the
    /// client's answer ended; a turn that comes first is split whole.
    fn keep_on_decode_node(&mut self, mut pstream: Events<pb::PrefillEvent>) {
        let Some(mut transcript) = self.transcript.take() else {
            return;
        };
        // The answer was written on the prefill node, which holds it already.
        transcript.replay = None;
        transcript.written_on_prefill_node = true;
        let (decode, learned, idle) = (
            self.decode.clone(),
            self.counted.learned.clone(),
            self.waits.idle,
        );
        let answered = u32::try_from(self.sent.len()).unwrap_or(u32::MAX);
        let mut generate = pb::GenerateRequest {
            first_token: self.sent.last().copied(),
            answered,
            max_new_tokens: 0,
            ..self.generate.clone()
        };
        tokio::spawn(async move {
            let request_id = generate.request_id.clone();
            let kept = match tokio::time::timeout(KEEP_WAIT, message(&mut pstream)).await {
                Ok(Ok(Some(pb::PrefillEvent {
                    event: Some(pb::prefill_event::Event::Kept(sw)),
                }))) => sw,
                _ => return,
            };
            if kept.answered != answered {
                tracing::warn!(%request_id, kept = kept.answered, answered, "the kept state ends elsewhere than the answer; not kept");
                return;
            }
            generate.base_tokens = kept.base_tokens;
            generate.base_digest = kept.base_digest;
            lock(&learned)
                .rates
                .handed_off(kept.bytes, kept.transfer_ms);
            let took = async { finishes(decode.generate(generate).await?).await };
            match tokio::time::timeout(idle, took).await {
                Ok(Ok(true)) => {
                    tracing::info!(%request_id, bytes = kept.bytes, "the decode node keeps the conversation");
                    transcript.held_by_decode_node();
                }
                Ok(Ok(false)) => {
                    tracing::warn!(%request_id, "the decode node ended without keeping the conversation")
                }
                Ok(Err(e)) => {
                    tracing::warn!(%request_id, error = %e, "the decode node did not keep the conversation")
                }
                Err(_) => {
                    tracing::warn!(%request_id, "the decode node did not keep the conversation within the idle bound")
                }
            }
        });
    }

    /// The decode node holds the state up to the last token sent: it writes the rest.
    async fn switch(&mut self, sw: pb::Switched) -> Split {
        self.counted.prefill_node_decoded(self.sent.len());
        let answered = u32::try_from(self.sent.len()).unwrap_or(u32::MAX);
        if sw.answered != answered {
            return Split::Failed(Failure::upstream(
                RouterCode::ProtocolError,
                format!(
                    "the prefill node switched after token {} but sent {answered}",
                    sw.answered
                ),
            ));
        }
        tracing::info!(
            request_id = %self.generate.request_id,
            answered,
            rounds = sw.rounds,
            bytes = sw.bytes,
            "live handoff: the decode node takes over"
        );
        lock(&self.counted.learned)
            .rates
            .handed_off(sw.bytes, sw.transfer_ms);
        let handoff = Event::Handoff {
            bytes: sw.bytes,
            export_ms: sw.export_ms,
            transfer_ms: sw.transfer_ms,
            connect_ms: None,
            hash_ms: None,
        };
        if self.tx.send(handoff).await.is_err()
            || self.tx.send(Event::Switched { answered }).await.is_err()
        {
            return Split::Over;
        }
        self.generate.first_token = self.sent.last().copied();
        self.generate.answered = answered;
        // A tail: the decode node joins it onto the prefix it holds.
        self.generate.base_tokens = sw.base_tokens;
        self.generate.base_digest = sw.base_digest;
        self.generate.max_new_tokens = self.first.max_tokens.saturating_sub(answered);
        let idle = self.counted.idle_bound(self.waits.idle, true);
        let stream =
            match tokio::time::timeout(idle, self.decode.generate(self.generate.clone())).await {
                Ok(Ok(s)) => s,
                Ok(Err(st)) => return Split::Failed(Failure::from_status(&st, self.param)),
                Err(_) => {
                    return self.decode_node_silent(Failure::upstream(
                        RouterCode::Timeout,
                        format!("the decode node did not take the answer within {idle:?}"),
                    ))
                }
            };
        self.counted.hand_to_decode_node(self.sent.len());
        // The handoff is reported; nothing is pending.
        let mut done: HandoffReport = tokio::spawn(async { Ok(None) });
        self.forward_decode(stream, &mut done, &mut false).await
    }

    /// The decode node went silent (`e`, a timeout): the pool leaves it out for a while
    /// (`nodes::Silence`); the answer fails over as any failure does.
    fn decode_node_silent(&self, e: Failure) -> Split {
        lock(&self.counted.learned).decode_node_silent(&e.message);
        Split::Failed(e)
    }

    /// The handoff's outcome: its figures, or why it failed.
    fn on_handoff(
        &self,
        r: Result<Result<Option<pb::PrefillEvent>, tonic::Status>, tokio::task::JoinError>,
    ) -> Result<Event, Failure> {
        match r {
            Ok(Ok(Some(pb::PrefillEvent {
                event: Some(pb::prefill_event::Event::Handoff(h)),
            }))) => Ok({
                lock(&self.counted.learned)
                    .rates
                    .handed_off(h.bytes, h.transfer_ms);
                Event::Handoff {
                    bytes: h.bytes,
                    export_ms: h.export_ms,
                    transfer_ms: h.transfer_ms,
                    connect_ms: Some(h.connect_ms),
                    hash_ms: Some(h.hash_ms),
                }
            }),
            Ok(Err(st)) => Err(Failure::from_status(&st, self.param)),
            _ => Err(Failure::upstream(
                RouterCode::ProtocolError,
                "the prefill node ended without reporting the handoff",
            )),
        }
    }

    /// Calls the decode node's `Generate` and waits for its stream. Until the handoff is
    /// done, its own deadlines bound this wait (the prefill node reports a failed one);
    /// once the state is there, the decode node must start the answer within the idle
    /// bound (a frozen decode node answers nothing, not even an error).
    async fn decode_stream(
        &mut self,
        handoff: &mut HandoffReport,
        handoff_pending: &mut bool,
    ) -> Result<Events<pb::TokenEvent>, Split> {
        let decode = self.decode.clone();
        let call = decode.generate(self.generate.clone());
        tokio::pin!(call);
        let idle = self.counted.idle_bound(self.waits.idle, true);
        let mut answer_by: Option<tokio::time::Instant> = None;
        loop {
            let not_taken_in_time = async {
                match answer_by {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = not_taken_in_time => {
                    return Err(self.decode_node_silent(Failure::upstream(
                        RouterCode::Timeout,
                        format!("the decode node did not take the answer within {idle:?} of the handoff"),
                    )));
                }
                r = &mut call => match r {
                    Ok(s) => return Ok(s),
                    Err(st) => {
                        if *handoff_pending {
                            // A handoff error explains a decode failure better than the decode does.
                            let report = tokio::time::timeout(self.waits.handoff_error_grace, &mut *handoff).await;
                            if let Ok(Err(e)) = report.map(|r| self.on_handoff(r)) {
                                return Err(Split::Failed(e));
                            }
                        }
                        return Err(Split::Failed(Failure::from_status(&st, self.param)));
                    }
                },
                h = &mut *handoff, if *handoff_pending => {
                    *handoff_pending = false;
                    answer_by = Some(tokio::time::Instant::now() + idle);
                    match self.on_handoff(h) {
                        Ok(ev) => if self.tx.send(ev).await.is_err() { return Err(Split::Over) },
                        Err(e) => return Err(Split::Failed(e)),
                    }
                }
            }
        }
    }

    /// Forwards the decode node's tokens until the answer ends or the node fails.
    async fn forward_decode(
        &mut self,
        mut stream: Events<pb::TokenEvent>,
        handoff: &mut HandoffReport,
        handoff_pending: &mut bool,
    ) -> Split {
        let idle = self.waits.idle;
        loop {
            // Read again while a token is awaited: answers that come to the decode node
            // meanwhile add their work to the bound.
            let bound = || self.counted.idle_bound(idle, true);
            tokio::select! {
                ev = next_event_within(&mut stream, bound, Node::Decode, false, self.param) => {
                    if let Event::Error(e) = ev {
                        if e.is(RouterCode::Timeout) {
                            return self.decode_node_silent(e);
                        }
                        return Split::Failed(e);
                    }
                    let end = matches!(ev, Event::Finished { .. });
                    if end {
                        lock(&self.counted.learned).silence.spoke();
                    }
                    self.counted.decode_node_event(&ev);
                    if end && *handoff_pending {
                        // Report the handoff figures before the end of the answer.
                        let report = tokio::time::timeout(self.waits.handoff_report_wait, &mut *handoff).await;
                        if let Ok(Ok(hev)) = report.map(|r| self.on_handoff(r)) {
                            let _ = self.tx.send(hev).await;
                        }
                    }
                    if let Event::Token { id, bytes, .. } = &ev {
                        self.sent.push(*id);
                        if let Some(t) = &mut self.transcript {
                            t.token(*id, bytes);
                        }
                    }
                    if end {
                        if let Some(t) = self.transcript.take() {
                            t.held_by_decode_node();
                        }
                    }
                    if self.tx.send(ev).await.is_err() || end {
                        return Split::Over;
                    }
                }
                h = &mut *handoff, if *handoff_pending => {
                    *handoff_pending = false;
                    match self.on_handoff(h) {
                        Ok(ev) => if self.tx.send(ev).await.is_err() { return Split::Over },
                        Err(e) => return Split::Failed(e),
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::Input;
    use crate::backend::input_param;
    use edgesplit_proto::error::ErrorCode;

    fn split(param: &'static str) -> SplitAnswer {
        let (tx, _) = mpsc::channel(1);
        SplitAnswer {
            transcript: None,
            first: pb::FirstToken::default(),
            decode: Arc::new(crate::backend::fake::FakeDecode::default()),
            generate: pb::GenerateRequest::default(),
            tx,
            sent: Vec::new(),
            waits: Waits {
                idle: Duration::from_secs(1),
                handoff_error_grace: Duration::from_secs(1),
                handoff_report_wait: Duration::from_secs(1),
            },
            param,
            mode: HandoffMode::After,
            keep: false,
            counted: Counted {
                learned: Arc::default(),
                load: Arc::default(),
                prefill_busy: None,
                decode_busy: None,
                answer_tokens: 0.0,
                first_sent: std::time::Instant::now(),
            },
        }
    }

    /// An upstream refusal after the first token names the request's own input field:
    /// `prompt` on /v1/completions, `messages` on chat (it said `messages` for both).
    #[tokio::test]
    async fn an_error_after_the_first_token_names_the_requests_field() {
        let refusal = || {
            edgesplit_proto::error::status(
                tonic::Code::InvalidArgument,
                ErrorCode::ContextLengthExceeded,
                "too long",
            )
        };
        for (input, param) in [
            (Input::Prompt("p".into()), "prompt"),
            (
                Input::Chat(vec![crate::api::Message::text("user", "m")]),
                "messages",
            ),
        ] {
            let e = split(input_param(&input))
                .on_handoff(Ok(Err(refusal())))
                .unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param));
            assert_eq!(e.name(), "context_length_exceeded");
        }
    }
}
