//! A tail handoff on the real model (`Start::Imported` with a `base_digest`, PROTOCOL.md "Tails"): the prefill
//! engine replays an answer the decode engine wrote (`Start::Resume` with no token to
//! write), prefills the next turn from the same cut and sends only the state after it;
//! the decode engine joins that onto its own copy once the copy's bytes hash to the
//! sender's, and the answer is token for token the one an engine continuing its own copy
//! gives. A wrong digest, or a prefix no slot holds, is refused with nothing changed.

use crate::common::{collect, model_path, read_until};
use edgesplit_engine::{
    Engine, EngineConfig, EngineError, GenEvent, Input, Reuse, SamplingParams, Start,
};
use edgesplit_proto::splice;

fn config() -> EngineConfig {
    let mut cfg = EngineConfig::new(model_path());
    cfg.n_ctx = 1024;
    // Batches of 16: the new part is prefilled in several, from the cut.
    cfg.n_batch = 16;
    cfg
}

fn conversation(tokens: Vec<i32>) -> Start {
    Start::Cached {
        tokens,
        reuse: Reuse::Conversation,
        max_uncached: None,
    }
}

/// The ids of an answer that ended by itself.
async fn answer(e: &Engine, start: Start, params: &SamplingParams, n: u32) -> Vec<i32> {
    let (ids, end) = collect(e.generate(start, params.clone(), n).await.unwrap()).await;
    assert!(matches!(end, GenEvent::Done(_)), "{end:?}");
    ids
}

/// An answer's ids and text.
async fn answer_text(
    e: &Engine,
    start: Start,
    params: &SamplingParams,
    n: u32,
) -> (Vec<i32>, String) {
    let mut rx = e.generate(start, params.clone(), n).await.unwrap();
    let (mut ids, mut text) = (Vec::new(), Vec::new());
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Token(t) => {
                ids.push(t.id);
                if !t.eog {
                    text.extend_from_slice(&t.piece);
                }
            }
            GenEvent::Done(_) => return (ids, String::from_utf8(text).unwrap()),
            GenEvent::Prefilled { .. } => {}
            GenEvent::Error(e) => panic!("{e}"),
        }
    }
    panic!("no final event")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tail_joined_onto_the_decode_engines_copy_goes_on_as_one_device() {
    let (prefill, decode, reference) = (
        Engine::start(config()).await.unwrap(),
        Engine::start(config()).await.unwrap(),
        Engine::start(config()).await.unwrap(),
    );
    let params = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: 5,
        ..SamplingParams::default()
    };
    let chat = |turns: &[(&str, &str)]| Input::chat(turns.iter().copied());
    let q1 = "Name three birds that live near the sea.";
    let turn1 = prefill.tokenize(chat(&[("user", q1)])).await.unwrap();
    // Turn 1, written by the decode engine (as after a handoff) and by the reference.
    let (a1, text1) = answer_text(&decode, conversation(turn1.clone()), &params, 20).await;
    assert_eq!(
        a1,
        answer(&reference, conversation(turn1.clone()), &params, 20).await
    );
    // The prefill engine replays it: the prompt prefilled, each answer token but the last
    // decoded, nothing written.
    let replayed = answer(
        &prefill,
        Start::Resume {
            prompt: turn1.clone(),
            answer: a1.clone(),
            reuse: Reuse::Conversation,
        },
        &params,
        0,
    )
    .await;
    assert!(replayed.is_empty(), "{replayed:?}");
    let q2 = "Which of them flies farthest, and how far does it go each year?";
    let turn2 = prefill
        .tokenize(chat(&[
            ("user", q1),
            ("assistant", text1.trim()),
            ("user", q2),
        ]))
        .await
        .unwrap();
    let expected = answer(&reference, conversation(turn2.clone()), &params, 24).await;

    // Turn 2 on the prefill engine: its first tokens, then the tail from the cut.
    let mut live = prefill
        .generate_live(conversation(turn2.clone()), params.clone(), 24)
        .await
        .unwrap();
    let cut = match live.events.recv().await {
        Some(GenEvent::Prefilled { cached_tokens, .. }) => cached_tokens as usize,
        other => panic!("{other:?}"),
    };
    assert!(
        cut > turn1.len() && cut < turn2.len(),
        "the cut lies after turn 1's answer: {cut} of {}",
        turn2.len()
    );
    let mut ids = Vec::new();
    assert!(read_until(&mut live.events, &mut ids, 3).await.is_none());
    let first = live.live.first_tail(cut).await.unwrap().unwrap();
    let digest = first.head_digest.expect("a digest of the prefix");
    assert_eq!(splice::span(&first.state).unwrap().start, cut);
    let held = first.tokens.len();
    // At least one step after the first piece, so that the last one holds a cell.
    assert!(
        read_until(&mut live.events, &mut ids, first.answered as usize + 1)
            .await
            .is_none()
    );
    let last = live.live.snapshot(true, held).await.unwrap().unwrap();
    // The tokens written before the stop (the stop ends the answer at that boundary).
    while let Some(ev) = live.events.recv().await {
        if let GenEvent::Token(t) = ev {
            ids.push(t.id);
        }
    }
    assert_eq!(ids.len() as u32, last.answered);
    let tail = splice::join_from(&[&first.state, &last.state], cut, Vec::new()).unwrap();
    let tail = bytes::Bytes::from(tail);
    let start = |digest: [u8; 32], tokens: Vec<i32>| Start::Imported {
        state: tail.clone(),
        tokens,
        first: last.last,
        answered: last.answered,
        base_digest: Some(digest),
    };
    let refused = |r: Result<Vec<i32>, EngineError>, why: &str| match r {
        Err(EngineError::TailBase(m)) => assert!(m.contains(why), "{m}"),
        other => panic!("expected a refusal ({why}), got {other:?}"),
    };
    let try_tail = |start: Start| async {
        // What is left of the answer's 24 tokens.
        let left = 24 - last.answered;
        let mut rx = decode.generate(start, params.clone(), left).await.unwrap();
        let mut out = Vec::new();
        while let Some(ev) = rx.recv().await {
            match ev {
                GenEvent::Token(t) => out.push(t.id),
                GenEvent::Error(e) => return Err(e),
                GenEvent::Done(_) => return Ok(out),
                GenEvent::Prefilled { .. } => {}
            }
        }
        panic!("no final event")
    };
    // Another prefix's bytes, or tokens the decode engine does not hold: refused.
    let mut wrong = digest;
    wrong[0] ^= 1;
    refused(try_tail(start(wrong, last.tokens.clone())).await, "differs");
    let mut other = last.tokens.clone();
    other[1] += 1;
    refused(try_tail(start(digest, other)).await, "no cached sequence");
    // Nothing changed: the right prefix still joins, and the answer is the reference's.
    let rest = try_tail(start(digest, last.tokens.clone())).await.unwrap();
    ids.extend(rest);
    assert_eq!(ids, expected);
}
