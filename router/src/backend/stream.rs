//! Reading a node's token stream: each message as an [`Event`], the bounds on its wait,
//! and the forwarding of a whole stream to the client.

use std::time::Duration;

use edgesplit_proto::pb;
use tokio::sync::mpsc;

use super::load::Counted;
use super::seam::{message, Events};
use super::Failure;
use super::RouterCode;
use super::{Event, FinishReason, Node};

/// `ev` of a stream from node `from`.
pub(super) fn token_event(ev: pb::TokenEvent, with_prompt: bool, from: Node) -> Event {
    match ev.event {
        Some(pb::token_event::Event::Token(t)) => Event::Token {
            id: t.id,
            bytes: t.piece,
            logprobs: t.logprobs,
            from,
        },
        Some(pb::token_event::Event::Prefilled(p)) => Event::Prefilled {
            prompt_tokens: p.prompt_tokens,
            cached_tokens: p.cached_tokens,
            prefill_ms: p.prefill_ms,
        },
        Some(pb::token_event::Event::Finished(f)) => Event::Finished {
            reason: if f.reason == pb::FinishReason::Stop as i32 {
                FinishReason::Stop
            } else {
                FinishReason::Length
            },
            decode_tokens: f.generated,
            decode_ms: f.decode_ms,
            import_ms: f.import_ms,
            receive_ms: f.receive_ms,
            verify_ms: f.verify_ms,
            prompt_tokens: with_prompt.then_some(f.prompt_tokens),
            prefill_ms: with_prompt.then_some(f.prefill_ms),
        },
        None => Event::Error(Failure::upstream(
            RouterCode::ProtocolError,
            "empty token event",
        )),
    }
}

/// The next event of a node's token stream (`with_prompt`: a `Finished` reports the
/// prompt's figures), or the error that ends it: the stream ended before `Finished`, the
/// node's gRPC error, or no event within `idle`.
pub(super) async fn next_event(
    stream: &mut Events<pb::TokenEvent>,
    idle: Duration,
    node: Node,
    with_prompt: bool,
    param: &str,
) -> Event {
    next_event_within(stream, || idle, node, with_prompt, param).await
}

/// [`next_event`] within a bound read again whenever it would end: a node's silence bound
/// grows with the work its other answers have queued, which answers that come while this
/// one waits add to.
pub(super) async fn next_event_within(
    stream: &mut Events<pb::TokenEvent>,
    bound: impl Fn() -> Duration,
    node: Node,
    with_prompt: bool,
    param: &str,
) -> Event {
    let name = match node {
        Node::Prefill => "the prefill node",
        Node::Decode => "the decode node",
    };
    let start = tokio::time::Instant::now();
    let next = message(stream);
    tokio::pin!(next);
    let got = loop {
        match tokio::time::timeout_at(start + bound(), &mut next).await {
            Ok(r) => break Ok(r),
            Err(_) if start + bound() > tokio::time::Instant::now() => {}
            Err(_) => break Err(bound()),
        }
    };
    match got {
        Ok(Ok(Some(m))) => token_event(m, with_prompt, node),
        Ok(Ok(None)) => Event::Error(Failure::upstream(
            RouterCode::StreamEnded,
            format!("{name} ended the answer without finishing"),
        )),
        Ok(Err(st)) => Event::Error(match node {
            Node::Prefill => Failure::from_status(&st, param),
            Node::Decode => Failure::from_decode_stream(&st, param),
        }),
        Err(idle) => Event::Error(Failure::upstream(
            RouterCode::Timeout,
            format!("no token from {name} within {idle:?}"),
        )),
    }
}

/// Forwards the prefill node's `Generate` stream (a colocated or a resumed answer) to the
/// client until it finishes or fails; each message must come within `wait`.
pub(super) async fn forward_prefill_node(
    mut stream: Events<pb::TokenEvent>,
    tx: &mpsc::Sender<Event>,
    resumed: bool,
    wait: Duration,
    param: &str,
    counted: Option<Counted>,
) {
    loop {
        let ev = match next_event(&mut stream, wait, Node::Prefill, !resumed, param).await {
            // A resumed answer's prefill is not this request's prefill.
            Event::Prefilled { .. } if resumed => continue,
            ev => ev,
        };
        if let Some(c) = &counted {
            c.seen(&ev);
        }
        let end = matches!(ev, Event::Finished { .. } | Event::Error(_));
        if tx.send(ev).await.is_err() || end {
            return;
        }
    }
}
