//! What the engine's integration tests share: the models' paths (each test file uses
//! one or the other), and reading an answer's events.
#![allow(dead_code)]

use edgesplit_engine::{Engine, GenEvent, SamplingParams, Start};

/// An answer's token ids and the event that ended it.
pub async fn collect(
    mut rx: tokio::sync::mpsc::UnboundedReceiver<GenEvent>,
) -> (Vec<i32>, GenEvent) {
    let mut ids = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Token(t) => ids.push(t.id),
            GenEvent::Prefilled { .. } => {}
            other => return (ids, other),
        }
    }
    panic!("generation ended without a final event");
}

/// Reads tokens into `ids` until there are `n`, or the final event (returned).
pub async fn read_until(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<GenEvent>,
    ids: &mut Vec<i32>,
    n: usize,
) -> Option<GenEvent> {
    while ids.len() < n {
        match rx.recv().await.expect("events end with a final one") {
            GenEvent::Token(t) => ids.push(t.id),
            GenEvent::Prefilled { .. } => {}
            other => return Some(other),
        }
    }
    None
}

/// Continues a prefilled answer in `engine` from its exported `state` (the prompt's
/// `tokens` and the `first` token the prefill sampled): the tokens after the first, and the
/// event that ended them.
pub async fn continue_imported(
    engine: &Engine,
    state: Vec<u8>,
    tokens: &[i32],
    first: i32,
    params: &SamplingParams,
    max_tokens: u32,
) -> (Vec<i32>, GenEvent) {
    let start = Start::Imported {
        state: state.into(),
        tokens: tokens.to_vec(),
        first,
        answered: 1,
        base_digest: None,
    };
    collect(
        engine
            .generate(start, params.clone(), max_tokens)
            .await
            .unwrap(),
    )
    .await
}

/// Hands a live answer over at its next boundary: the last piece (the cells from `from`),
/// after checking that the answer then ends as handed over, that nothing past the boundary
/// was emitted, and that what was is the start of the uninterrupted answer `whole`.
pub async fn hand_over(
    live: &edgesplit_engine::Live,
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<GenEvent>,
    ids: &mut Vec<i32>,
    from: usize,
    whole: &[i32],
) -> edgesplit_engine::Snapshot {
    let last = live.snapshot(true, from).await.unwrap().unwrap();
    let end = read_until(rx, ids, usize::MAX).await;
    let Some(GenEvent::Done(summary)) = end else {
        panic!("{end:?}")
    };
    assert_eq!(summary.finish, edgesplit_engine::Finish::Handover);
    assert_eq!(ids.len(), last.answered as usize);
    assert_eq!(ids[..], whole[..ids.len()]);
    last
}

/// Another engine takes a live answer over at the handover snapshot `last`, from `state`
/// (the pieces joined): the tokens it writes, `max_tokens` in all counting those written
/// before the boundary.
pub async fn take_over(
    engine: &Engine,
    state: Vec<u8>,
    last: &edgesplit_engine::Snapshot,
    params: &SamplingParams,
    max_tokens: u32,
) -> Vec<i32> {
    let start = Start::Imported {
        state: state.into(),
        tokens: last.tokens.clone(),
        first: last.last,
        answered: last.answered,
        base_digest: None,
    };
    let mut rx = engine
        .generate(start, params.clone(), max_tokens - last.answered)
        .await
        .unwrap();
    let mut rest = Vec::new();
    let end = read_until(&mut rx, &mut rest, usize::MAX).await;
    assert!(matches!(end, Some(GenEvent::Done(_))), "{end:?}");
    rest
}

/// SmolLM2's GGUF (`EDGESPLIT_MODEL` overrides), which `scripts/test.sh` fetches.
pub fn model_path() -> std::path::PathBuf {
    let p = std::env::var("EDGESPLIT_MODEL").map_or_else(
        |_| {
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../models/SmolLM2-135M-Instruct.Q4_1.gguf")
        },
        Into::into,
    );
    assert!(
        p.is_file(),
        "model {} missing: run scripts/test.sh (it fetches the model)",
        p.display()
    );
    p
}

/// Gemma-3-270M's GGUF (a sliding-window model), which `scripts/test.sh` fetches.
pub fn gemma_path() -> std::path::PathBuf {
    let p =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/gemma-3-270m-q4_k_m.gguf");
    assert!(
        p.is_file(),
        "model {} missing: run scripts/test.sh (it fetches the models)",
        p.display()
    );
    p
}
