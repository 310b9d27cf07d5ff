//! A resumed answer (`Start::Resume`, what the prefill node does when a split fails) goes
//! on exactly as the uninterrupted answer would have: the same tokens after any cut, with
//! a seed (each step's RNG depends on the step index) and a frequency penalty (which reads
//! the answer so far).

use crate::common::model_path;
use edgesplit_engine::{Engine, EngineConfig, GenEvent, Input, SamplingParams, Start};
use tokio::sync::mpsc::UnboundedReceiver;

async fn ids(mut rx: UnboundedReceiver<GenEvent>) -> Vec<i32> {
    let mut ids = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Token(t) => ids.push(t.id),
            GenEvent::Prefilled { .. } => {}
            GenEvent::Done(_) => return ids,
            GenEvent::Error(e) => panic!("{e}"),
        }
    }
    panic!("generation ended without a final event");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resumed_answer_goes_on_as_the_uninterrupted_one() {
    let mut cfg = EngineConfig::new(model_path());
    cfg.n_ctx = 512;
    let engine = Engine::start(cfg).await.unwrap();
    let prompt = engine
        .tokenize(Input::chat(vec![(
            "user",
            "Write a short story about a lighthouse keeper.",
        )]))
        .await
        .unwrap();
    let params = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: 11,
        frequency_penalty: 0.5,
        ..SamplingParams::default()
    };
    const N: u32 = 40;
    let whole = ids(engine
        .generate(Start::Prompt(prompt.clone()), params.clone(), N)
        .await
        .unwrap())
    .await;
    assert_eq!(whole.len(), N as usize, "the answer ran to its budget");
    // Greedy would make the seed and step index irrelevant: check it is not.
    let greedy = ids(engine
        .generate(Start::Prompt(prompt.clone()), SamplingParams::default(), N)
        .await
        .unwrap())
    .await;
    assert_ne!(whole, greedy, "the seeded answer is not the greedy one");
    // Cut after the first token (a failed handoff) and mid-answer (a decode node lost).
    for cut in [1usize, 9, 25] {
        let rx = engine
            .generate(
                Start::Resume {
                    prompt: prompt.clone(),
                    answer: whole[..cut].to_vec(),
                    reuse: edgesplit_engine::Reuse::Exact,
                },
                params.clone(),
                N - cut as u32,
            )
            .await
            .unwrap();
        assert_eq!(ids(rx).await, whole[cut..], "resumed after {cut} tokens");
    }
}
