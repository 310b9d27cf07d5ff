//! The live handoff (PROTOCOL.md, "Live handoff"): this node goes on writing the answer
//! while its state crosses to the decode node, then sends the KV of what it wrote
//! meanwhile, in rounds that shrink, and stops at a token boundary once the last round is
//! small enough to cross in about one token's time. The router streams this node's tokens
//! until `Switched`, then the decode node's. `Switched` goes as soon as the last piece is
//! written, not when it is acknowledged: the router's `Generate` crosses the link beside
//! the piece and waits for it on the decode node (a refused piece fails that call at once).
//!
//! Where the link carries KV slower than this node writes tokens, the rounds do not shrink:
//! the handoff gives up (`HandoffCancelled`) and the answer ends here, waiting for nothing
//! (the state's export and hashing still share this machine's cores with it). When the
//! answer ends before the handoff completes, the connection closes and the decode node
//! drops what it received - unless the router asked to keep it (`Handoff.keep`, a chat it
//! may continue): then the piece on its way is finished, the state written since goes
//! as the last piece (asked of the engine for the answer's end, [`Live::at_end`]), and
//! `Kept` follows `Finished` once the decode node acknowledged it, so that the next turn
//! can go on there with nothing crossing. A sliding-window model's state goes the same way, its first
//! piece the state laid out right after the prefill (the engine's `LiveWindow`), none
//! during the prefill; once its ring could wrap, no further piece is cut and the handoff is
//! cancelled.

use std::time::{Duration, Instant};

use edgesplit_engine::wire::{finished, status};
use edgesplit_engine::{Finish, GenEvent, Live, Snapshot};
use edgesplit_proto::frame::{Frame, StateFrame};
use edgesplit_proto::{handoff, layout, pb, splice};
use tokio::sync::{mpsc, watch};
use tonic::Status;

use crate::send::Sender;

/// Most pieces one handoff sends after the first token (what the prefill did not send,
/// then the deltas).
const MAX_ROUNDS: u32 = 8;
/// The last delta is sent when it crosses the link in about this long.
const LAST_ROUND: Duration = Duration::from_millis(25);
/// ... or when it holds at most this many tokens.
const LAST_ROUND_TOKENS: usize = 2;

type Events = mpsc::Sender<Result<pb::PrefillEvent, Status>>;

fn event(e: pb::prefill_event::Event) -> Result<pb::PrefillEvent, Status> {
    Ok(pb::PrefillEvent { event: Some(e) })
}

/// The live handoff of one answer.
pub(crate) struct LiveHandoff {
    pub sender: Sender,
    pub handoff: pb::Handoff,
    pub request_id: String,
    pub prompt_tokens: usize,
}

/// Why a live handoff did not complete: the reason for the router, the bytes sent.
struct Cancelled(String, u64);

/// How a live handoff completed.
enum Done {
    /// At a token boundary inside the answer: the decode node writes the rest.
    Switched(pb::Switched),
    /// After the answer ended here (`Handoff.keep`): the decode node holds its whole
    /// state, acknowledged.
    Kept(pb::Switched),
}

/// The state asked for at the answer's end ([`Live::at_end`]).
type AtEnd = std::pin::Pin<
    Box<
        dyn std::future::Future<Output = Option<Result<Snapshot, edgesplit_engine::EngineError>>>
            + Send,
    >,
>;

impl LiveHandoff {
    /// Forwards the answer's tokens to the router while the handoff runs; ends with
    /// `Switched`, `Finished` or an error. With `base` > 0, a tail (PROTOCOL.md, "Tails"):
    /// the decode node holds the conversation's first `base` positions (the prefix the
    /// prefill reused), so the pieces start there.
    pub(crate) async fn run(
        self: std::sync::Arc<Self>,
        mut events: mpsc::UnboundedReceiver<GenEvent>,
        live: Live,
        mut early: AbortOnDrop<Result<Early, String>>,
        tx: Events,
        base: usize,
    ) {
        let (written_tx, written) = watch::channel(1usize);
        let handoff = async {
            // What went during the prefill; a failure there only means starting over. If
            // the answer ends first, dropping this future aborts that task, which closes
            // its connection: the decode node drops the pieces.
            let early = match (&mut early.0).await {
                Ok(Ok(Early::Sent(sent))) => Some(*sent),
                Ok(Ok(Early::Nothing)) | Err(_) => None,
                Ok(Err(e)) => {
                    tracing::debug!(request_id = %self.request_id, error = %e, "live handoff: the pieces sent during prefill failed");
                    None
                }
            };
            // `live` goes with the rounds: once they are over (switched, kept or given up),
            // the engine's answer is no longer asked for snapshots.
            self.rounds(live, early, written, base).await
        };
        tokio::pin!(handoff);
        let mut outcome: Option<Result<Done, Cancelled>> = None;
        loop {
            tokio::select! {
                ev = events.recv() => {
                    let msg = match ev {
                        Some(GenEvent::Token(t)) => {
                            written_tx.send_modify(|n| *n += 1);
                            event(pb::prefill_event::Event::Token(t.into()))
                        }
                        Some(GenEvent::Done(s)) if s.finish == Finish::Handover => {
                            // Every token before the switch has been forwarded; the last
                            // piece is on its way or delivered.
                            let done = match outcome.take() {
                                Some(o) => o,
                                None => (&mut handoff).await,
                            };
                            let failed = |reason: &str| Err(edgesplit_proto::error::status(
                                tonic::Code::Unavailable,
                                edgesplit_proto::error::ErrorCode::HandoffFailed,
                                format!("live handoff failed at the switch: {reason}"),
                            ));
                            let msg = match done {
                                Ok(Done::Switched(sw)) => event(pb::prefill_event::Event::Switched(sw)),
                                // The answer stopped here for a switch that failed: the
                                // router finishes it (its fallback) from the tokens it has.
                                Err(Cancelled(reason, _)) => failed(&reason),
                                Ok(Done::Kept(_)) => failed("the answer ended first"),
                            };
                            let _ = tx.send(msg).await;
                            return;
                        }
                        Some(GenEvent::Done(s)) => {
                            if tx.send(event(pb::prefill_event::Event::Finished(finished(&s)))).await.is_err()
                                || !self.handoff.keep
                                || outcome.is_some()
                            {
                                return;
                            }
                            // The answer ended before the switch: the rest of its state
                            // follows it, for the decode node to keep the conversation.
                            drop(written_tx);
                            if let Ok(Done::Kept(sw)) = (&mut handoff).await {
                                let _ = tx.send(event(pb::prefill_event::Event::Kept(sw))).await;
                            }
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

    /// The answer's state from position `from` on, cut on the engine thread; `None` when
    /// the answer has ended.
    async fn snapshot(live: &Live, stop: bool, from: usize) -> Result<Option<Snapshot>, String> {
        match live.snapshot(stop, from).await {
            Some(Ok(s)) => Ok(Some(s)),
            Some(Err(e)) => Err(e.to_string()),
            None => Ok(None),
        }
    }

    fn piece(&self, tokens: Vec<i32>, payload: Vec<u8>) -> StateFrame {
        StateFrame {
            handoff_id: self.handoff.handoff_id.clone(),
            request_id: self.request_id.clone(),
            tokens,
            descriptors: layout::describe(&payload).descriptors,
            payload: edgesplit_proto::buffers::share(payload),
        }
    }

    async fn connect(&self) -> Result<Conn, String> {
        handoff::connect(
            &self.handoff.decode_addr,
            &self.sender.info.identity(),
            &self.sender.limits,
            &self.sender.link,
        )
        .await
        .map_err(|e| e.to_string())
    }

    /// Sends `piece` and accounts for it: a `Frame::Part`, whose ACK is awaited, or with
    /// `last` a `Frame::Last`, written without waiting for its ACK
    /// ([`LiveHandoff::acked_later`]).
    async fn send(&self, out: &mut Sent, piece: StateFrame, last: bool) -> Result<(), String> {
        let size = piece.payload.len() as u64;
        let held = out.held + piece.tokens.len();
        let limits = &self.sender.limits;
        let t = Instant::now();
        let sent = if last {
            handoff::write_piece(&mut out.link, &Frame::Last(piece), limits)
                .await
                .map(|_| ())
        } else {
            handoff::send_piece(&mut out.link, Frame::Part(piece), limits)
                .await
                .map(|_| ())
        };
        sent.map_err(|e| e.to_string())?;
        let took = t.elapsed().as_secs_f64();
        out.sw.transfer_ms += took * 1000.0;
        out.sw.bytes += size;
        out.sw.rounds += 1;
        out.held = held;
        // The link's bandwidth as the biggest acknowledged piece so far measured it.
        if !last && size >= out.biggest {
            out.biggest = size;
            out.bandwidth = size as f64 / took.max(1e-6);
        }
        Ok(())
    }

    /// The last piece is written: the router may send the answer's `Generate` to the
    /// decode node now, where it waits for the piece to be checked and stored (or fails
    /// at once if the piece is refused: the receiver drops the handoff, and the router
    /// finishes the answer through its fallback). Its ACK is awaited in the background,
    /// off the switch's path; the handoff's metrics are recorded then.
    fn acked_later(&self, mut out: Sent, t0: Instant) -> pb::Switched {
        let sw = out.sw.clone();
        let (metrics, limits) = (self.sender.metrics.clone(), self.sender.limits);
        let (id, request_id) = (self.handoff.handoff_id.clone(), self.request_id.clone());
        tokio::spawn(async move {
            let acked = handoff::await_ack(&mut out.link, &id, &limits).await;
            if let Err(e) = &acked {
                tracing::warn!(%request_id, error = %e, "live handoff: the last piece was refused after the switch; the router's fallback finishes the answer");
            }
            metrics.handoff(
                "v2-live",
                acked.is_ok(),
                out.sw.bytes,
                t0.elapsed().as_secs_f64(),
            );
        });
        sw
    }

    /// While the prompt is prefilled: sends its state after each prefill batch (each
    /// piece the cells since the previous one, cut on the engine thread), so that the
    /// decode node holds most of it by the first token. `Nothing` when no piece came (a
    /// prompt of one batch).
    pub(crate) async fn during_prefill(
        &self,
        mut pieces: mpsc::UnboundedReceiver<Snapshot>,
    ) -> Result<Early, String> {
        let mut out: Option<Sent> = None;
        while let Some(p) = pieces.recv().await {
            let mut sent = match out.take() {
                Some(s) => s,
                None => Sent::new(self.connect().await?),
            };
            if p.from != sent.held {
                return Err(format!(
                    "a prefill piece starts at {}, the decode node holds {}",
                    p.from, sent.held
                ));
            }
            sent.sw.export_ms += p.export_ms;
            let piece = self.piece(p.tokens[p.from..].to_vec(), p.state);
            self.send(&mut sent, piece, false).await?;
            out = Some(sent);
        }
        Ok(out.map_or(Early::Nothing, |s| Early::Sent(Box::new(s))))
    }

    /// Sends what the decode node lacks of the prompt's state (all of it when nothing
    /// went during the prefill), then deltas until one is small, then the last one (the
    /// answer stops here at that boundary). `written`: answer tokens sent so far.
    async fn rounds(
        &self,
        live: Live,
        early: Option<Sent>,
        mut written: watch::Receiver<usize>,
        base: usize,
    ) -> Result<Done, Cancelled> {
        let t0 = Instant::now();
        let mut bytes = early.as_ref().map_or(0, |s| s.sw.bytes);
        match self
            .rounds_inner(&live, early, &mut written, &mut bytes, base)
            .await
        {
            Ok((out, false)) => Ok(Done::Switched(self.acked_later(out, t0))),
            Ok((out, true)) => {
                let secs = t0.elapsed().as_secs_f64();
                // Its own series: these bytes crossed after the answer, for the next turn.
                self.sender
                    .metrics
                    .handoff("v2-kept", true, out.sw.bytes, secs);
                Ok(Done::Kept(out.sw))
            }
            Err(reason) => {
                let secs = t0.elapsed().as_secs_f64();
                self.sender.metrics.handoff("v2-live", false, bytes, secs);
                Err(Cancelled(reason, bytes))
            }
        }
    }

    /// `Ok((sent, kept))`: `kept` when the answer ended first and its end went as the
    /// last piece (`Handoff.keep`).
    async fn rounds_inner(
        &self,
        live: &Live,
        early: Option<Sent>,
        written: &mut watch::Receiver<usize>,
        bytes: &mut u64,
        base: usize,
    ) -> Result<(Sent, bool), String> {
        let per_token = self.sender.info.kv_bytes_per_token.max(1);
        // With `keep`, the state at the answer's end from where the decode node will hold
        // it once the piece on its way is delivered, asked for before that piece is sent.
        let at_end = |from: usize| -> Option<AtEnd> {
            self.handoff
                .keep
                .then(|| Box::pin(live.at_end(from)) as AtEnd)
        };
        let mut end = early.as_ref().and_then(|s| at_end(s.held));
        let mut out = match early {
            Some(s) => s,
            None => {
                let snap = if base > 0 {
                    live.first_tail(base).await.transpose()
                } else {
                    live.snapshot(false, 0).await.transpose()
                };
                let Some(snap) = snap.map_err(|e| e.to_string())? else {
                    return Err("the answer ended".into());
                };
                if !splice::is_linear(&snap.state) {
                    return Err("the state cannot be cut into pieces".into());
                }
                end = at_end(snap.tokens.len());
                let mut out = Sent::new(self.connect().await?);
                out.sw.export_ms += snap.export_ms;
                if let Some(digest) = snap.head_digest {
                    // The decode node joins the pieces onto the prefix it holds.
                    out.held = base;
                    out.sw.base_tokens = snap.tokens[..base].to_vec();
                    out.sw.base_digest = digest.to_vec();
                }
                let tokens = snap.tokens[out.held..].to_vec();
                self.send(&mut out, self.piece(tokens, snap.state), false)
                    .await?;
                *bytes = out.sw.bytes;
                out
            }
        };
        let mut before: Option<usize> = None;
        // The rounds after the first token: the prefill's pieces do not count.
        let first_round = out.sw.rounds;
        loop {
            // KV positions a snapshot would hold now: the prompt and the answer but its
            // newest token.
            let pending = (self.prompt_tokens + *written.borrow() - 1).saturating_sub(out.held);
            let crossing =
                Duration::from_secs_f64(pending as f64 * per_token as f64 / out.bandwidth);
            let last = crossing <= LAST_ROUND || pending <= LAST_ROUND_TOKENS;
            if !last {
                if out.sw.rounds - first_round >= MAX_ROUNDS || before.is_some_and(|b| pending >= b)
                {
                    return Err(format!(
                        "the link carries the KV of {pending} tokens in {crossing:?}, \
                         slower than the answer is written"
                    ));
                }
                before = Some(pending);
            }
            if pending == 0 {
                // Nothing new yet: the last piece needs at least one token.
                let next = out.held + 2 - self.prompt_tokens;
                if written.wait_for(|n| *n >= next).await.is_err() {
                    return self.keep(out, end, bytes).await.map(|o| (o, true));
                }
            }
            let Some(snap) = Self::snapshot(live, last, out.held).await? else {
                return self.keep(out, end, bytes).await.map(|o| (o, true));
            };
            if !last {
                end = at_end(snap.tokens.len());
            }
            out.sw.export_ms += snap.export_ms;
            let piece = self.piece(snap.tokens[out.held..].to_vec(), snap.state);
            self.send(&mut out, piece, last).await?;
            *bytes = out.sw.bytes;
            tracing::debug!(request_id = %self.request_id, round = out.sw.rounds, pending, last, "live handoff piece sent");
            if last {
                out.sw.answered = snap.answered;
                return Ok((out, false));
            }
        }
    }

    /// The answer ended here before the switch: with `Handoff.keep`, its state from
    /// where the decode node holds it to the end goes as the last piece, acknowledged
    /// before this returns, so that the decode node can keep the whole conversation.
    async fn keep(
        &self,
        mut out: Sent,
        end: Option<AtEnd>,
        bytes: &mut u64,
    ) -> Result<Sent, String> {
        let ended = || "the answer ended".to_string();
        let tail = end.ok_or_else(ended)?.await.ok_or_else(ended)?;
        let tail = tail.map_err(|e| format!("the answer's end: {e}"))?;
        if tail.from != out.held {
            return Err(format!(
                "the answer's end starts at {}, the decode node holds {}",
                tail.from, out.held
            ));
        }
        out.sw.export_ms += tail.export_ms;
        let piece = self.piece(tail.tokens[out.held..].to_vec(), tail.state);
        self.send(&mut out, piece, true).await?;
        *bytes = out.sw.bytes;
        handoff::await_ack(&mut out.link, &self.handoff.handoff_id, &self.sender.limits)
            .await
            .map_err(|e| e.to_string())?;
        out.sw.answered = tail.answered;
        tracing::info!(request_id = %self.request_id, bytes = out.sw.bytes, answered = tail.answered, "live handoff completed after the answer: the decode node keeps it");
        Ok(out)
    }
}

/// What the live handoff did before the first token.
pub(crate) enum Early {
    /// Nothing yet (a prompt of one batch).
    Nothing,
    /// Pieces of the prompt's state.
    Sent(Box<Sent>),
}

/// A task aborted when this is dropped (its connection closed with it).
pub(crate) struct AbortOnDrop<T>(pub tokio::task::JoinHandle<T>);

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A handoff connection after its handshake.
type Conn =
    tokio_util::codec::Framed<edgesplit_proto::link::LinkStream, edgesplit_proto::codec::V2Codec>;

/// Where a live handoff stands: its connection, the positions the decode node holds, the
/// figures so far.
pub(crate) struct Sent {
    link: Conn,
    held: usize,
    sw: pb::Switched,
    biggest: u64,
    /// Bytes per second.
    bandwidth: f64,
}

impl Sent {
    fn new(link: Conn) -> Self {
        Sent {
            link,
            held: 0,
            sw: pb::Switched::default(),
            biggest: 0,
            bandwidth: f64::INFINITY,
        }
    }
}
