//! Replays and the copies they make, over scripted nodes (`fake.rs`): a replay only into
//! the prefill node's spare time and onto a whole copy, a conversation only the decode node
//! holds going on there, a chat going on from the prefill node's answer kept off the decode
//! node alone.

use std::time::Duration;

use super::fake::msg::{finished, prefilled, token};
use super::tests::{events, held_after_a_split, pair, prefill_node_much_faster, request, tokens};
use super::{Node, Transport};
use crate::api::{self, Endpoint};

const D: Node = Node::Decode;

/// The prefill node replays an answer the decode node ended only into its spare time: with
/// another answer running there at that moment, the conversation stays the decode node's
/// alone (no replay asked for, nor for its later turns); idle, it replays the answer.
#[tokio::test]
async fn a_decode_node_answer_is_replayed_only_into_the_prefill_node_spare_time() {
    use crate::placement::Copies;
    for busy in [true, false] {
        let n = pair(true);
        prefill_node_much_faster(&n.backend);
        n.prefill
            .generate
            .then(Ok(vec![prefilled(5, 5), finished(0)]));
        let other = busy.then(|| n.backend.load.take(false, 60_000.0));
        held_after_a_split(&n).await;
        drop(other);
        let turn2 = request("Hello t10 t11 t12 And then?", "");
        let copies = || {
            super::nodes::lock(&n.backend.learned)
                .conversations
                .copies(&turn2.input)
        };
        if busy {
            tokio::time::sleep(Duration::from_millis(200)).await;
            assert_eq!(copies(), Some(Copies::DecodeNode));
            assert!(n.prefill.generate.requests().is_empty(), "no replay");
            // The next turn goes on on the decode node, with the prefill node idle at its
            // end: still no replay, whose prefill would take in the answer before it (not
            // replayed) as a prefill.
            n.decode
                .local
                .then(Ok(vec![prefilled(12, 7), token(31), finished(1)]));
            let started = n.backend.start(&turn2, Transport::V2, "t2").await.unwrap();
            assert_eq!(tokens(&events(started).await), [(31, D)]);
            tokio::time::sleep(Duration::from_millis(200)).await;
            let turn3 = request("Hello t10 t11 t12 And then? t31 Go on.", "");
            let l = super::nodes::lock(&n.backend.learned);
            assert_eq!(
                l.conversations.copies(&turn3.input),
                Some(Copies::DecodeNode)
            );
            assert!(n.prefill.generate.requests().is_empty(), "no replay");
        } else {
            let t0 = std::time::Instant::now();
            while copies() != Some(Copies::Both) {
                assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", copies());
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            let replay = &n.prefill.generate.requests()[0];
            assert_eq!(replay.resume_tokens, [10, 11, 12]);
        }
    }
}

/// A held turn continued on the decode node by the rule: where only the decode node holds
/// the conversation (not replayed), it goes on there whatever its new part (the prefill
/// node could only prefill what the decode node decoded); where the prefill node holds it
/// too, the decode node takes it only within the measured limit, a tail being the same
/// answer.
#[tokio::test]
async fn a_conversation_only_the_decode_node_holds_goes_on_there_whatever_its_new_part() {
    for replayed in [false, true] {
        // Nothing measured: the decode node goes first by the rule, and no replay is asked
        // for (this test replays by hand).
        let n = pair(true);
        let turn1 = held_after_a_split(&n).await;
        if replayed {
            super::nodes::lock(&n.backend.learned)
                .conversations
                .replayed(&turn1.input, " t10 t11 t12");
        }
        n.decode
            .local
            .then(Ok(vec![prefilled(12, 7), token(31), finished(1)]));
        let turn2 = request("Hello t10 t11 t12 And then?", "");
        let started = n.backend.start(&turn2, Transport::V2, "t2").await.unwrap();
        assert_eq!(tokens(&events(started).await), [(31, D)]);
        let asked = n.decode.local.requests()[0].max_uncached;
        if replayed {
            assert!(asked < Some(u32::MAX), "{asked:?}");
        } else {
            assert_eq!(asked, Some(u32::MAX));
        }
    }
}

/// Under `auto`, a chat that goes on from an answer no decode node holds (the prefill node
/// wrote it) is never given to the decode node alone, however much sooner it is measured:
/// it would prefill the answer the prefill node decoded. A chat that starts is.
#[tokio::test]
async fn a_chat_going_on_from_the_prefill_node_answer_is_not_given_to_the_decode_node_alone() {
    let n = pair(true);
    {
        // The decode node 100x the prefill node's speeds.
        let mut l = super::nodes::lock(&n.backend.learned);
        for _ in 0..3 {
            l.rates.prefilled(true, 1000, 100.0);
            l.rates.decoded(true, 100, 100.0);
            l.rates.prefilled(false, 100, 1000.0);
            l.rates.decoded(false, 10, 1000.0);
            l.rates.round_trip(1.0);
            l.rates.handed_off(1 << 10, 1000.0);
        }
    }
    let chat = |messages: &str| {
        let body = format!(r#"{{"messages": {messages}, "max_tokens": 6, "temperature": 0}}"#);
        api::parse(Endpoint::Chat, body.as_bytes(), || 7).expect("a valid request")
    };
    let starts = chat(r#"[{"role": "user", "content": "Hello"}]"#);
    let goes_on = chat(
        r#"[{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "And then?"}]"#,
    );
    let plan = n.backend.plan_auto(&starts).await.unwrap();
    assert_eq!(
        plan.choice.mode,
        super::Route::Phone,
        "{}",
        plan.choice.reason
    );
    let plan = n.backend.plan_auto(&goes_on).await.unwrap();
    assert_ne!(
        plan.choice.mode,
        super::Route::Phone,
        "{}",
        plan.choice.reason
    );
    assert!(plan.choice.predicted.is_some(), "{}", plan.choice.reason);
}
