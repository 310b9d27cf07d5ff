//! The backend's routes over scripted nodes (`fake.rs`): the live switch and its cancel,
//! the fallback when the decode node dies before and after the switch, a decode node asked for
//! but gone, a conversation continued and then evicted, `auto` weighing a held
//! conversation and waiting for its replay, an `Info` that fails. What each
//! node was asked is read back from its script; what the client gets is the events.

use std::sync::Arc;
use std::time::Duration;

use edgesplit_proto::error::{status, ErrorCode};
use edgesplit_proto::link::Link;
use tonic::{Code, Status};

use super::fake::msg::{
    cancelled, finished, first, handed_off, kept, live_finished, live_token, prefilled, switched,
    token,
};
use super::fake::{FakeDecode, FakePrefill, Step};
use super::{Backend, BackendConfig, ContinueOn, Event, Node, PrefilledOn, RouterCode, Started};
use crate::api::{self, Endpoint, HandoffMode, Objective, Transport, ValidRequest};

pub(super) fn config(fallback: bool) -> BackendConfig {
    BackendConfig {
        prefill_url: "http://prefill.test".into(),
        decode_url: "http://decode.test".into(),
        connect_timeout: Duration::from_secs(1),
        info_timeout: Duration::from_secs(1),
        first_token_timeout: Duration::from_secs(5),
        fallback,
        token_idle_timeout: Duration::from_secs(5),
        handoff_error_grace: Duration::from_millis(200),
        handoff_report_wait: Duration::from_millis(200),
        handoff: HandoffMode::Live,
        continue_on: ContinueOn::Measured,
        objective: Objective::default(),
        link: Link::plain(),
        probes: false,
    }
}

/// Scripted nodes and the backend over them.
pub(super) struct Pair {
    pub(super) prefill: Arc<FakePrefill>,
    pub(super) decode: Arc<FakeDecode>,
    pub(super) backend: Backend,
}

pub(super) fn pair(fallback: bool) -> Pair {
    let prefill = Arc::new(FakePrefill::default());
    let decode = Arc::new(FakeDecode::default());
    let backend = Backend::with_nodes(config(fallback), prefill.clone(), decode.clone());
    Pair {
        prefill,
        decode,
        backend,
    }
}

/// A completion request for `prompt`, with `extra` fields (JSON object members).
pub(super) fn request(prompt: &str, extra: &str) -> ValidRequest {
    let body = format!(r#"{{"prompt": {prompt:?}, "max_tokens": 6, "temperature": 0{extra}}}"#);
    api::parse(Endpoint::Completion, body.as_bytes(), || 7).expect("a valid request")
}

/// Every event of the answer, to its end (the sender dropped).
pub(super) async fn events(started: Started) -> Vec<Event> {
    let mut rx = started.events;
    let mut all = Vec::new();
    while let Some(ev) = tokio::time::timeout(Duration::from_secs(10), rx.recv())
        .await
        .expect("the answer ended")
    {
        all.push(ev);
    }
    all
}

/// The answer's tokens, with the node that wrote each.
pub(super) fn tokens(events: &[Event]) -> Vec<(i32, Node)> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Token { id, from, .. } => Some((*id, *from)),
            _ => None,
        })
        .collect()
}

fn finished_last(events: &[Event]) {
    assert!(
        matches!(events.last(), Some(Event::Finished { .. })),
        "the answer ends with Finished: {events:?}"
    );
}

pub(super) fn unavailable() -> Status {
    Status::unavailable("transport error: connection reset")
}

use Node::{Decode as D, Prefill as P};

/// A live answer: the prefill node writes until the switch, the decode node from the
/// token after the last one sent, asked for exactly the rest of the budget.
#[tokio::test]
async fn a_live_answer_switches_to_the_decode_node_after_the_tokens_sent() {
    let n = pair(true);
    n.prefill.prefill.then(Ok(vec![
        first(10, 5, 6),
        live_token(11),
        Step::Wait(Duration::from_millis(20)),
        live_token(12),
        switched(3),
    ]));
    n.decode
        .generate
        .then(Ok(vec![token(13), token(14), token(15), finished(3)]));
    let req = request("Hello", "");
    let started = n.backend.start(&req, Transport::V2, "r1").await.unwrap();
    assert_eq!(started.transport, Transport::V2);
    let evs = events(started).await;
    assert_eq!(
        tokens(&evs),
        [(10, P), (11, P), (12, P), (13, D), (14, D), (15, D)]
    );
    assert!(evs.contains(&Event::Switched { answered: 3 }), "{evs:?}");
    finished_last(&evs);
    let handoff = n.prefill.prefill.requests()[0].handoff.clone().unwrap();
    assert!(handoff.live);
    assert_eq!(handoff.decode_addr, "127.0.0.1:7001");
    let g = &n.decode.generate.requests()[0];
    assert_eq!(
        (g.first_token, g.answered, g.max_new_tokens),
        (Some(12), 3, 3)
    );
    assert!(n.prefill.generate.requests().is_empty(), "no fallback");
}

/// A live handoff that gives up leaves the answer on the prefill node, and nothing of it
/// is kept on the decode node, even when the state arrives after all (`kept`); without the
/// cancel, the same answer is taken into the decode node's cache.
#[tokio::test]
async fn a_cancelled_live_handoff_ends_on_the_prefill_node_and_keeps_nothing() {
    for cancel in [false, true] {
        let n = pair(true);
        let mut script = vec![first(10, 5, 3), live_token(11)];
        if cancel {
            script.push(cancelled("the link is too slow for the answer"));
        }
        script.extend([live_token(12), live_finished(2), kept(3)]);
        n.prefill.prefill.then(Ok(script));
        n.decode.generate.then(Ok(vec![finished(0)]));
        let req = request("Hello", "");
        let started = n.backend.start(&req, Transport::V2, "r1").await.unwrap();
        let evs = events(started).await;
        assert_eq!(tokens(&evs), [(10, P), (11, P), (12, P)]);
        assert_eq!(
            evs.iter()
                .any(|e| matches!(e, Event::HandoffCancelled { .. })),
            cancel
        );
        finished_last(&evs);
        // The keep runs after the answer, in the background.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let kept_calls = n.decode.generate.requests();
        if cancel {
            assert!(kept_calls.is_empty(), "{kept_calls:?}");
        } else {
            assert_eq!(kept_calls.len(), 1);
            assert_eq!(kept_calls[0].max_new_tokens, 0);
            assert_eq!(kept_calls[0].answered, 3);
        }
    }
}

/// The decode node dies before it wrote a token (the handoff after the answer's first):
/// the prefill node finishes the answer after the first token, and the client is told.
#[tokio::test]
async fn the_decode_node_dying_before_its_first_token_is_finished_on_the_prefill_node() {
    let n = pair(true);
    n.prefill
        .prefill
        .then(Ok(vec![first(10, 5, 5), handed_off()]));
    n.decode.generate.then(Ok(vec![Step::Fail(unavailable())]));
    n.prefill.generate.then(Ok(vec![
        prefilled(6, 6),
        token(11),
        token(12),
        token(13),
        token(14),
        finished(4),
    ]));
    let req = request("Hello", r#", "edgesplit": {"handoff": "after"}"#);
    let started = n.backend.start(&req, Transport::V2, "r1").await.unwrap();
    let evs = events(started).await;
    assert_eq!(tokens(&evs), [(10, P), (11, P), (12, P), (13, P), (14, P)]);
    assert!(
        evs.iter().any(|e| matches!(e, Event::Fallback { .. })),
        "{evs:?}"
    );
    finished_last(&evs);
    let resumed = &n.prefill.generate.requests()[0];
    assert_eq!(resumed.resume_tokens, [10]);
    assert_eq!(resumed.max_tokens, 4);
    assert!(resumed.handoff.is_none());
}

/// The decode node dies after the live switch, mid-answer: the prefill node goes on after
/// every token the client was sent, none twice, none lost.
#[tokio::test]
async fn the_decode_node_dying_after_the_switch_is_finished_on_the_prefill_node() {
    let n = pair(true);
    n.prefill
        .prefill
        .then(Ok(vec![first(10, 5, 6), live_token(11), switched(2)]));
    n.decode
        .generate
        .then(Ok(vec![token(12), Step::Fail(unavailable())]));
    n.prefill.generate.then(Ok(vec![
        prefilled(8, 8),
        token(13),
        token(14),
        token(15),
        finished(3),
    ]));
    let req = request("Hello", "");
    let started = n.backend.start(&req, Transport::V2, "r1").await.unwrap();
    let evs = events(started).await;
    assert_eq!(
        tokens(&evs),
        [(10, P), (11, P), (12, D), (13, P), (14, P), (15, P)]
    );
    finished_last(&evs);
    let resumed = &n.prefill.generate.requests()[0];
    assert_eq!(resumed.resume_tokens, [10, 11, 12]);
    assert_eq!(resumed.max_tokens, 3);
}

/// Without the fallback, the same death ends the answer with the error after the tokens
/// sent.
#[tokio::test]
async fn without_the_fallback_a_dead_decode_node_ends_the_answer_with_its_error() {
    let n = pair(false);
    n.prefill
        .prefill
        .then(Ok(vec![first(10, 5, 6), live_token(11), switched(2)]));
    n.decode
        .generate
        .then(Ok(vec![token(12), Step::Fail(unavailable())]));
    let req = request("Hello", "");
    let started = n.backend.start(&req, Transport::V2, "r1").await.unwrap();
    let evs = events(started).await;
    assert_eq!(tokens(&evs), [(10, P), (11, P), (12, D)]);
    assert!(matches!(evs.last(), Some(Event::Error(_))), "{evs:?}");
    assert!(n.prefill.generate.requests().is_empty());
}

/// A frozen decode node (its stream open, silent) is found by the idle bound and the
/// answer finished on the prefill node.
#[tokio::test(start_paused = true)]
async fn a_frozen_decode_node_is_found_by_the_idle_bound() {
    let n = pair(true);
    n.prefill
        .prefill
        .then(Ok(vec![first(10, 5, 3), live_token(11), switched(2)]));
    n.decode.generate.then(Ok(vec![Step::Hang]));
    n.prefill
        .generate
        .then(Ok(vec![prefilled(7, 7), token(12), finished(1)]));
    let req = request("Hello", "");
    let started = n.backend.start(&req, Transport::V2, "r1").await.unwrap();
    let evs = events(started).await;
    assert_eq!(tokens(&evs), [(10, P), (11, P), (12, P)]);
    let cause = evs.iter().find_map(|e| match e {
        Event::Fallback { cause } => Some(cause.clone()),
        _ => None,
    });
    assert_eq!(cause.as_deref(), Some("timeout"));
}

/// A decode node silent for longer than the idle bound while answers that came after the
/// wait began queue work there is slow, not wedged: the bound is read again when it would
/// end, and the answer goes on there.
#[tokio::test(start_paused = true)]
async fn a_decode_node_that_others_answers_load_while_it_is_awaited_is_waited_for() {
    let n = pair(true);
    n.prefill
        .prefill
        .then(Ok(vec![first(10, 5, 3), live_token(11), switched(2)]));
    let silent = Step::Wait(Duration::from_secs(8));
    n.decode
        .generate
        .then(Ok(vec![token(12), silent, token(13), finished(2)]));
    let req = request("Hello", "");
    let started = n.backend.start(&req, Transport::V2, "r1").await.unwrap();
    // Another answer comes to the decode node a second into the wait: 20 s of its work.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let other = n.backend.load.take(true, 20_000.0);
    let evs = events(started).await;
    drop(other);
    assert_eq!(tokens(&evs), [(10, P), (11, P), (12, D), (13, D)]);
    assert!(!evs.iter().any(|e| matches!(e, Event::Fallback { .. })));
}

/// The decode node asked for by name but gone: a named transport is not moved, the client gets
/// the decode node's unavailability; under `auto`'s choice of the decode node, the prefill node
/// answers instead and says so.
#[tokio::test]
async fn a_phone_asked_for_but_gone_is_refused_and_auto_answers_on_the_prefill_node() {
    let n = pair(true);
    n.decode.local.then(Err(unavailable()));
    let req = request("Hello", "");
    let e = n
        .backend
        .start(&req, Transport::Phone, "r1")
        .await
        .unwrap_err();
    assert!(e.is(RouterCode::DecodeUnavailable), "{e:?}");
    assert!(n.prefill.generate.requests().is_empty());

    // `auto` chose the decode node (the route it runs), which is gone.
    n.decode.local.then(Err(unavailable()));
    n.prefill
        .generate
        .then(Ok(vec![prefilled(5, 0), token(20), finished(1)]));
    let started = n
        .backend
        .run_chosen(&req, super::Route::Phone, "r2")
        .await
        .unwrap();
    assert_eq!(started.transport, Transport::Phone);
    let evs = events(started).await;
    assert_eq!(
        evs.first(),
        Some(&Event::Fallback {
            cause: "decode_unavailable".into()
        })
    );
    assert_eq!(tokens(&evs), [(20, P)]);
}

/// A conversation the decode node ended goes on there (only the new part prefilled on the
/// decode node); once the decode node has evicted it, the next turn is split whole and the router
/// forgets it, so the turn after does not ask the decode node first.
#[tokio::test]
async fn a_conversation_continued_on_the_decode_node_then_evicted_is_split_whole() {
    let n = pair(true);
    let after = r#", "edgesplit": {"handoff": "after"}"#;
    // Turn 1: split; the decode node writes the answer and holds it.
    let turn1 = held_after_a_split(&n).await;
    assert_eq!(
        n.backend.held(&turn1),
        None,
        "a new prompt continues nothing"
    );

    // Turn 2 continues it: the decode node prefills the new part itself.
    let turn2_prompt = "Hello t10 t11 t12 And then?";
    let turn2 = request(turn2_prompt, after);
    assert_eq!(n.backend.held(&turn2), Some(7), "5 prompt + 3 answer - 1");
    n.decode.local.then(Ok(vec![
        prefilled(12, 7),
        token(30),
        token(31),
        finished(2),
    ]));
    let started = n.backend.start(&turn2, Transport::V2, "t2").await.unwrap();
    assert_eq!(started.placement, PrefilledOn::DecodeNode);
    let evs = events(started).await;
    assert_eq!(tokens(&evs), [(30, D), (31, D)]);
    let asked = &n.decode.local.requests()[0];
    assert!(asked.max_uncached.is_some(), "bounded by what pays");
    assert_eq!(n.prefill.prefill.requests().len(), 1, "nothing split");

    // Turn 3 (live, which would ship only a tail after a prefix the decode node holds): the
    // decode node evicted it meanwhile; split whole, the conversation forgotten.
    let turn3 = request(&format!("{turn2_prompt} t30 t31 Again?"), "");
    assert_eq!(n.backend.held(&turn3), Some(13), "turn 2's 12 + 2 - 1");
    n.decode.local.then(Err(status(
        Code::FailedPrecondition,
        ErrorCode::NotCached,
        "the conversation is not cached here",
    )));
    n.prefill
        .prefill
        .then(Ok(vec![first(40, 20, 2), switched(1)]));
    n.decode.generate.then(Ok(vec![token(41), finished(1)]));
    let started = n.backend.start(&turn3, Transport::V2, "t3").await.unwrap();
    assert_eq!(started.placement, PrefilledOn::PrefillNode);
    let evs = events(started).await;
    assert_eq!(tokens(&evs), [(40, P), (41, D)]);
    let split = n.prefill.prefill.requests();
    assert_eq!(split.len(), 2);
    assert_eq!(split[1].handoff.as_ref().unwrap().base_max, 0, "whole");
    // Turn 3's own answer is now held; what turn 2 held is not.
    let turn2_again = request(&format!("{turn2_prompt} t30 t31 Other?"), after);
    assert_eq!(n.backend.held(&turn2_again), None);
}

/// Under `auto`, a held conversation that the prefill node holds too (replayed) goes
/// where the cost model finds it ends soonest: with the decode node measured slow, the
/// prefill node answers the new turn alone (only its new part prefilled there, nothing
/// asked of the decode node); the turn after, the decode node's copy lags a turn behind
/// (the prefill node wrote the last answer), so even a forced split ships only a tail
/// onto that copy rather than the decode node prefilling the prefill node's answer.
#[tokio::test]
async fn auto_weighs_a_held_conversation_and_answers_it_on_the_prefill_node_when_sooner() {
    let n = pair(true);
    held_by_both(&n).await;
    let turn2_prompt = "Hello t10 t11 t12 And then?";
    let turn2 = request(turn2_prompt, "");
    assert_eq!(n.backend.held(&turn2), Some(7));
    n.prefill.generate.then(Ok(vec![
        prefilled(12, 7),
        token(30),
        token(31),
        finished(2),
    ]));
    let started = n
        .backend
        .start(&turn2, Transport::Auto, "t2")
        .await
        .unwrap();
    let choice = started.choice.clone().expect("auto's choice");
    assert_eq!(choice.mode, super::Route::Local, "{}", choice.reason);
    assert!(choice.predicted.is_some(), "{}", choice.reason);
    assert_eq!(tokens(&events(started).await), [(30, P), (31, P)]);
    assert!(
        n.decode.local.requests().is_empty(),
        "the decode node not asked"
    );
    assert_eq!(n.prefill.prefill.requests().len(), 1, "nothing split");

    // Turn 3, a live split: the decode node holds turn 1 only, so the prefill node
    // prefills the new part and ships its KV after what the decode node holds, though
    // the decode node now measures the sooner prefill (which alone would continue it there).
    {
        let mut l = super::nodes::lock(&n.backend.learned);
        for _ in 0..3 {
            l.rates.prefilled(false, 100, 1000.0);
            l.rates.prefilled(true, 1000, 100.0);
        }
        assert!(!l.rates.prefill_node_sooner(1));
    }
    let turn3 = request(&format!("{turn2_prompt} t30 t31 Again?"), "");
    assert_eq!(n.backend.held(&turn3), Some(7), "the decode node's copy");
    n.prefill
        .prefill
        .then(Ok(vec![first(40, 20, 2), switched(1)]));
    n.decode.generate.then(Ok(vec![token(41), finished(1)]));
    let started = n.backend.start(&turn3, Transport::V2, "t3").await.unwrap();
    assert_eq!(tokens(&events(started).await), [(40, P), (41, D)]);
    assert!(n.decode.local.requests().is_empty(), "not continued there");
    let split = n.prefill.prefill.requests();
    assert_eq!(split[1].handoff.as_ref().unwrap().base_max, 7, "a tail");
}

/// A held turn `auto` sends to the prefill node alone, which finds its copy of the
/// conversation gone (it reused less than the conversation): that answer is dropped before
/// any token reaches the client, and the decode node continues the conversation.
#[tokio::test]
async fn a_held_turn_whose_prefill_node_copy_is_gone_goes_on_on_the_decode_node() {
    let n = pair(true);
    held_by_both(&n).await;
    let started = auto_turn2(&n, 4).await;
    let choice = started.choice.clone().expect("auto's choice");
    assert_eq!(choice.mode, super::Route::Phone, "{}", choice.reason);
    assert!(choice.reason.contains("copy was gone"), "{}", choice.reason);
    assert_eq!(tokens(&events(started).await), [(31, D)]);
    let asked = n.prefill.generate.requests();
    assert_eq!(asked[0].max_tokens, 6, "tried there first");
    assert!(
        asked[1..].iter().all(|r| r.max_tokens == 0),
        "then replays only"
    );
}

/// Turn 1 of a conversation, "Hello", split `after`: the prefill node writes token 10, the
/// decode node 11 and 12 and holds the conversation (7 tokens). Returns the turn's request.
pub(super) async fn held_after_a_split(n: &Pair) -> ValidRequest {
    n.prefill
        .prefill
        .then(Ok(vec![first(10, 5, 3), handed_off()]));
    n.decode
        .generate
        .then(Ok(vec![token(11), token(12), finished(2)]));
    let turn1 = request("Hello", r#", "edgesplit": {"handoff": "after"}"#);
    let evs = events(n.backend.start(&turn1, Transport::V2, "t1").await.unwrap()).await;
    assert_eq!(tokens(&evs), [(10, P), (11, D), (12, D)]);
    turn1
}

/// [`held_after_a_split`], replayed on the prefill node, which is measured much faster.
async fn held_by_both(n: &Pair) {
    let turn1 = held_after_a_split(n).await;
    super::nodes::lock(&n.backend.learned)
        .conversations
        .replayed(&turn1.input, " t10 t11 t12");
    prefill_node_much_faster(&n.backend);
}

/// Turn 2 of [`held_after_a_split`]'s conversation under `auto`, each node scripted to
/// answer it once: the prefill node reusing `prefill_cached` of its 12 prompt tokens and
/// writing token 30, the decode node reusing its 7 and writing 31.
async fn auto_turn2(n: &Pair, prefill_cached: u32) -> Started {
    let turn2 = request("Hello t10 t11 t12 And then?", "");
    n.prefill.generate.then(Ok(vec![
        prefilled(12, prefill_cached),
        token(30),
        finished(1),
    ]));
    n.decode
        .local
        .then(Ok(vec![prefilled(12, 7), token(31), finished(1)]));
    n.backend
        .start(&turn2, Transport::Auto, "t2")
        .await
        .unwrap()
}

/// The prefill node 100x the decode node's speeds, a fast link: the prefill node is
/// sooner per token, so the decode node's answers are replayed there.
pub(super) fn prefill_node_much_faster(b: &Backend) {
    let mut l = super::nodes::lock(&b.learned);
    for _ in 0..3 {
        l.rates.prefilled(false, 1000, 100.0);
        l.rates.decoded(false, 100, 100.0);
        l.rates.prefilled(true, 100, 1000.0);
        l.rates.decoded(true, 10, 1000.0);
        l.rates.round_trip(1.0);
        l.rates.handed_off(1 << 20, 1.0);
    }
}

/// A held turn that `auto` sends to the prefill node while the prefill node still replays
/// the answer before it waits for that replay's end (its copy is whole only then); a
/// replay that fails leaves the turn to the decode node, the one copy that continues it.
#[tokio::test]
async fn a_held_turn_waits_for_the_replay_in_flight_or_goes_on_on_the_decode_node() {
    for replay_ok in [true, false] {
        let n = pair(true);
        prefill_node_much_faster(&n.backend);
        let pause = Step::Wait(Duration::from_millis(300));
        n.prefill.generate.then(Ok(if replay_ok {
            vec![pause, prefilled(5, 5), finished(0)]
        } else {
            vec![pause, Step::Fail(Status::internal("gone"))]
        }));
        held_after_a_split(&n).await;
        let t0 = std::time::Instant::now();
        let started = auto_turn2(&n, 7).await;
        let choice = started.choice.clone().expect("auto's choice");
        assert!(choice.reason.contains("replay ends"), "{}", choice.reason);
        let evs = events(started).await;
        let replay = &n.prefill.generate.requests()[0];
        assert_eq!(replay.resume_tokens, [10, 11, 12], "the replay first");
        if replay_ok {
            assert!(t0.elapsed() >= Duration::from_millis(250), "waited for it");
            assert_eq!(choice.mode, super::Route::Local, "{}", choice.reason);
            assert_eq!(tokens(&evs), [(30, P)]);
            assert!(n.decode.local.requests().is_empty());
        } else {
            assert_eq!(choice.mode, super::Route::Phone, "{}", choice.reason);
            assert!(choice.reason.contains("not replayed"), "{}", choice.reason);
            assert_eq!(tokens(&evs), [(31, D)]);
            let replays_only = n
                .prefill
                .generate
                .requests()
                .iter()
                .all(|r| r.max_tokens == 0);
            assert!(replays_only, "nothing answered on the prefill node");
        }
    }
}

/// An `Info` that fails: a split request is answered on the prefill node under the
/// fallback policy (the cause named, nothing prefilled for a handoff), else refused with
/// the decode node's unavailability before any prefill.
#[tokio::test]
async fn a_failing_info_answers_on_the_prefill_node_or_refuses() {
    for fallback in [true, false] {
        let n = pair(fallback);
        n.decode.info.set(Err(unavailable()));
        n.prefill
            .generate
            .then(Ok(vec![prefilled(5, 0), token(20), finished(1)]));
        let req = request("Hello", "");
        let started = n.backend.start(&req, Transport::V2, "r1").await;
        assert!(n.prefill.prefill.requests().is_empty(), "no split prefill");
        if fallback {
            let evs = events(started.unwrap()).await;
            assert_eq!(
                evs.first(),
                Some(&Event::Fallback {
                    cause: "decode_unavailable".into()
                })
            );
            assert_eq!(tokens(&evs), [(20, P)]);
        } else {
            let e = started.unwrap_err();
            assert!(e.is(RouterCode::DecodeUnavailable), "{e:?}");
            assert!(n.prefill.generate.requests().is_empty());
        }
    }
}
