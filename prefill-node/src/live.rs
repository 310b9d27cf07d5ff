//! The live handoff (PROTOCOL.md, "Live handoff"): this node goes on writing the answer
//! while its state crosses to the decode node, then sends the KV of what it wrote
//! meanwhile, in rounds that shrink, and stops at a token boundary once the last round is
//! small enough to cross in about one token's time. The router streams this node's tokens
//! until `Switched`, then the decode node's.
//!
//! Where the link carries KV slower than this node writes tokens, the rounds do not shrink:
//! the handoff gives up (`HandoffCancelled`) and the answer ends here, never later than a
//! `local` one. When the answer ends before the handoff completes, the connection closes
//! and the decode node drops what it received.

use std::time::{Duration, Instant};

use edgesplit_engine::wire::{finished, status};
use edgesplit_engine::{Finish, GenEvent, Live, Snapshot};
use edgesplit_proto::frame::{Frame, StateFrame};
use edgesplit_proto::{handoff, layout, pb, splice};
use tokio::sync::{mpsc, watch};
use tonic::Status;

use crate::Sender;

/// Most pieces one handoff sends (the prompt's state and the deltas).
const MAX_ROUNDS: u32 = 8;
/// The last delta is sent when it crosses the link in about this long.
const LAST_ROUND: Duration = Duration::from_millis(25);
/// ... or when it holds at most this many tokens.
const LAST_ROUND_TOKENS: usize = 2;

type Events = mpsc::Sender<Result<pb::PrefillEvent, Status>>;

fn event(e: pb::prefill_event::Event) -> Result<pb::PrefillEvent, Status> {
    Ok(pb::PrefillEvent { event: Some(e) })
}

/// One live answer after its first token.
pub(crate) struct LiveAnswer {
    pub sender: Sender,
    pub handoff: pb::Handoff,
    pub request_id: String,
    pub prompt_tokens: usize,
}

/// Why a live handoff did not complete: the reason for the router, the bytes sent.
struct Cancelled(String, u64);

impl LiveAnswer {
    /// Forwards the answer's tokens to the router while the handoff runs; ends with
    /// `Switched`, `Finished` or an error.
    pub(crate) async fn run(
        self,
        mut events: mpsc::UnboundedReceiver<GenEvent>,
        live: Live,
        tx: Events,
    ) {
        let (written_tx, written) = watch::channel(1usize);
        let handoff = self.rounds(&live, written);
        tokio::pin!(handoff);
        let mut outcome: Option<Result<pb::Switched, Cancelled>> = None;
        loop {
            tokio::select! {
                ev = events.recv() => {
                    let msg = match ev {
                        Some(GenEvent::Token(t)) => {
                            written_tx.send_modify(|n| *n += 1);
                            event(pb::prefill_event::Event::Token(pb::Token { id: t.id, piece: t.piece }))
                        }
                        Some(GenEvent::Done(s)) if s.finish == Finish::Handover => {
                            // Every token before the switch has been forwarded; the last
                            // piece is on its way or delivered.
                            let done = match outcome.take() {
                                Some(o) => o,
                                None => (&mut handoff).await,
                            };
                            let msg = match done {
                                Ok(sw) => event(pb::prefill_event::Event::Switched(sw)),
                                // The answer stopped here for a switch that failed: the
                                // router finishes it (its fallback) from the tokens it has.
                                Err(Cancelled(reason, _)) => Err(edgesplit_engine::wire::status_with_code(
                                    tonic::Code::Unavailable,
                                    "handoff_failed",
                                    format!("live handoff failed at the switch: {reason}"),
                                )),
                            };
                            let _ = tx.send(msg).await;
                            return;
                        }
                        Some(GenEvent::Done(s)) => {
                            let _ = tx.send(event(pb::prefill_event::Event::Finished(finished(&s)))).await;
                            return;
                        }
                        Some(GenEvent::Error(e)) => {
                            let _ = tx.send(Err(status(&e))).await;
                            return;
                        }
                        Some(GenEvent::Prefilled { .. }) => continue,
                        None => return,
                    };
                    if tx.send(msg).await.is_err() {
                        return; // the router went away: dropping `events` cancels the answer
                    }
                }
                r = &mut handoff, if outcome.is_none() => {
                    if let Err(Cancelled(reason, bytes)) = &r {
                        tracing::info!(request_id = %self.request_id, %reason, "live handoff cancelled; the answer goes on here");
                        let ev = pb::HandoffCancelled { reason: reason.clone(), bytes: *bytes };
                        if tx.send(event(pb::prefill_event::Event::Cancelled(ev))).await.is_err() {
                            return;
                        }
                    }
                    outcome = Some(r);
                }
            }
        }
    }

    async fn snapshot(live: &Live, stop: bool) -> Result<Snapshot, String> {
        match live.snapshot(stop).await {
            Some(Ok(s)) => Ok(s),
            Some(Err(e)) => Err(e.to_string()),
            None => Err("the answer ended".into()),
        }
    }

    /// Sends the prompt's state, then deltas until one is small, then the last one (the
    /// answer stops here at that boundary). `written`: answer tokens sent so far.
    async fn rounds(
        &self,
        live: &Live,
        mut written: watch::Receiver<usize>,
    ) -> Result<pb::Switched, Cancelled> {
        let metrics = &self.sender.metrics;
        let t0 = Instant::now();
        let mut bytes = 0u64;
        let result = self.rounds_inner(live, &mut written, &mut bytes).await;
        metrics.handoff("v2-live", result.is_ok(), bytes, t0.elapsed().as_secs_f64());
        result.map_err(|reason| Cancelled(reason, bytes))
    }

    async fn rounds_inner(
        &self,
        live: &Live,
        written: &mut watch::Receiver<usize>,
        bytes: &mut u64,
    ) -> Result<pb::Switched, String> {
        let h = &self.handoff;
        let per_token = self.sender.info.kv_bytes_per_token.max(1);
        let mut sw = pb::Switched::default();
        let snap = Self::snapshot(live, false).await?;
        sw.export_ms += snap.export_ms;
        let whole = !splice::is_linear(&snap.state);
        let t_send = Instant::now();
        let mut framed = handoff::connect(
            &h.decode_addr,
            &self.sender.info.identity(),
            &self.sender.limits,
            self.sender.secret.as_deref(),
        )
        .await
        .map_err(|e| e.to_string())?;
        // KV positions the decode node holds once a piece is acknowledged.
        let mut held = snap.tokens.len();
        let piece = |tokens: Vec<i32>, payload: Vec<u8>| StateFrame {
            handoff_id: h.handoff_id.clone(),
            request_id: self.request_id.clone(),
            tokens,
            descriptors: layout::describe(&payload).descriptors,
            payload: payload.into(),
        };
        if whole {
            // A sliding-window cache cannot be joined from pieces: the answer stops at the
            // next boundary and its state goes whole, as in the `after` handoff.
            let snap = Self::snapshot(live, true).await?;
            sw.export_ms += snap.export_ms;
            let size = snap.state.len() as u64;
            let frame = Frame::State(piece(snap.tokens, snap.state));
            handoff::send_piece(&mut framed, frame, &self.sender.limits)
                .await
                .map_err(|e| e.to_string())?;
            *bytes += size;
            sw.transfer_ms = t_send.elapsed().as_secs_f64() * 1000.0;
            sw.rounds = 1;
            sw.whole = true;
            sw.answered = snap.answered;
            sw.bytes = *bytes;
            return Ok(sw);
        }
        let bulk = snap.state.len() as u64;
        handoff::send_piece(
            &mut framed,
            Frame::Part(piece(snap.tokens, snap.state)),
            &self.sender.limits,
        )
        .await
        .map_err(|e| e.to_string())?;
        let bulk_time = t_send.elapsed();
        *bytes += bulk;
        sw.rounds = 1;
        sw.transfer_ms += bulk_time.as_secs_f64() * 1000.0;
        // The link's bandwidth as the big piece measured it.
        let bandwidth = bulk as f64 / bulk_time.as_secs_f64().max(1e-6);
        let mut before: Option<usize> = None;
        loop {
            // KV positions a snapshot would hold now: the prompt and the answer but its
            // newest token.
            let pending = (self.prompt_tokens + *written.borrow() - 1).saturating_sub(held);
            let crossing = Duration::from_secs_f64(pending as f64 * per_token as f64 / bandwidth);
            let last = crossing <= LAST_ROUND || pending <= LAST_ROUND_TOKENS;
            if !last {
                if sw.rounds >= MAX_ROUNDS || before.is_some_and(|b| pending >= b) {
                    return Err(format!(
                        "the link carries the KV of {pending} tokens in {crossing:?}, \
                         slower than the answer is written"
                    ));
                }
                before = Some(pending);
            }
            if pending == 0 {
                // Nothing new yet: the last piece needs at least one token.
                let next = held + 2 - self.prompt_tokens;
                written
                    .wait_for(|n| *n >= next)
                    .await
                    .map_err(|_| "the answer ended".to_string())?;
            }
            let snap = Self::snapshot(live, last).await?;
            sw.export_ms += snap.export_ms;
            let delta = splice::tail(&snap.state, held).map_err(|e| e.to_string())?;
            let tokens = snap.tokens[held..].to_vec();
            let size = delta.len() as u64;
            let t = Instant::now();
            let frame = if last {
                Frame::Last(piece(tokens, delta))
            } else {
                Frame::Part(piece(tokens, delta))
            };
            handoff::send_piece(&mut framed, frame, &self.sender.limits)
                .await
                .map_err(|e| e.to_string())?;
            sw.transfer_ms += t.elapsed().as_secs_f64() * 1000.0;
            *bytes += size;
            sw.rounds += 1;
            held = snap.tokens.len();
            tracing::debug!(request_id = %self.request_id, round = sw.rounds, pending, size, last, "live handoff piece sent");
            if last {
                sw.answered = snap.answered;
                sw.bytes = *bytes;
                return Ok(sw);
            }
        }
    }
}
