//! Non-negotiable 1: the disaggregated answer (V2 handoff, and V1 file upload) and the
//! decode node's own (`phone`: it prefills and writes the answer itself) are
//! token-for-token identical to the single-process run (`local`: prefill and decode in the
//! prefill node's one context), greedy and seeded, streamed and not, through the real HTTP
//! API and the default model.

use crate::common;

use crate::common::{run, smollm2, Outcome};
use serde_json::{json, Value};

/// The seeded one asks for log-probabilities too: every identity check then also holds
/// them identical across transports, streamed or not.
fn samplings() -> [Value; 2] {
    [
        json!({"temperature": 0, "max_tokens": 24}),
        json!({"temperature": 0.9, "top_p": 0.95, "top_k": 40, "seed": 42,
               "frequency_penalty": 0.2, "max_completion_tokens": 24,
               "logprobs": true, "top_logprobs": 2}),
    ]
}

async fn assert_identical(messages: Value, min_prompt_tokens: u64) {
    assert_identical_on(smollm2(), messages, min_prompt_tokens).await;
}

async fn assert_identical_on(stack: &common::Stack, messages: Value, min_prompt_tokens: u64) {
    // Each transport under each sampling; streamed and not alternate between the two
    // (whether the router streams is independent of how the state travelled, and the four
    // combinations are all covered). Reduced in CI (`common::seeded_transports`): a prompt
    // of 500 tokens or more is sampled with the seed on `v2-live` only.
    let seeded = common::seeded_transports(min_prompt_tokens);
    for (k, (s, streamed)) in samplings()
        .into_iter()
        .zip([[false, true], [true, false]])
        .enumerate()
    {
        let body = common::chat_body(messages.clone(), s.clone());
        let reference: Outcome = run(stack, "/v1/chat/completions", &body, "local", false).await;
        assert!(
            reference.prompt_tokens >= min_prompt_tokens,
            "prompt has {} tokens, wanted at least {min_prompt_tokens}",
            reference.prompt_tokens
        );
        assert!(!reference.text.is_empty());
        assert_eq!(
            reference.completion_tokens as usize,
            reference.token_ids.len()
        );
        for (transport, streamed) in [
            ("v2", streamed[0]),
            ("v1", streamed[1]),
            ("v2-live", streamed[1]),
            ("phone", streamed[0]),
        ] {
            if k == 1 && !seeded.contains(&transport) {
                continue;
            }
            let split = run(stack, "/v1/chat/completions", &body, transport, streamed).await;
            assert_eq!(
                split, reference,
                "{transport}, sampling {s}, streamed {streamed}"
            );
        }
        if !streamed[0] {
            let local_streamed = run(stack, "/v1/chat/completions", &body, "local", true).await;
            assert_eq!(local_streamed, reference, "local streamed, sampling {s}");
        }
    }
}

#[tokio::test]
async fn short_question() {
    assert_identical(json!([{"role": "user", "content": "Hi!"}]), 5).await;
}

#[tokio::test]
async fn system_and_user() {
    assert_identical(
        json!([
            {"role": "system", "content": "You are a terse assistant who answers in one sentence."},
            {"role": "user", "content": "Why is the sky blue? Explain the physics briefly."}
        ]),
        30,
    )
    .await;
}

#[tokio::test]
async fn multi_turn_conversation() {
    assert_identical(
        json!([
            {"role": "system", "content": "You are a helpful travel guide."},
            {"role": "user", "content": "I am visiting Lisbon for three days in spring. What should I see?"},
            {"role": "assistant", "content": "Start in Alfama: walk up to the castle of São Jorge, then take tram 28 through the old quarters. On day two visit Belém for the tower, the monastery and the custard tarts. On day three take the train to Sintra."},
            {"role": "user", "content": "Great. And where should I eat on the first evening, near the castle?"},
            {"role": "assistant", "content": "Look for a small tasca in Alfama with grilled sardines and a glass of vinho verde; many have fado in the evening."},
            {"role": "user", "content": "Summarise the whole plan as a list."}
        ]),
        120,
    )
    .await;
}

fn paragraph(n: usize) -> String {
    (0..n)
        .map(|i| {
            format!(
                "Day {i}: the station at harbour {} recorded {} degrees, wind {} km/h from the {}.",
                i % 7,
                10 + (i * 7) % 23,
                (i * 13) % 41,
                ["north", "east", "south", "west"][i % 4]
            )
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::test]
async fn medium_document() {
    let doc = paragraph(12);
    assert_identical(
        json!([{"role": "user", "content": format!("{doc}\n\nWhich day was the warmest?")}]),
        250,
    )
    .await;
}

#[tokio::test]
async fn long_document() {
    let doc = paragraph(24);
    assert_identical(
        json!([{"role": "user", "content": format!("Read this log.\n{doc}\n\nSummarise the wind.")}]),
        500,
    )
    .await;
}

#[tokio::test]
async fn document_over_a_thousand_tokens() {
    let doc = paragraph(50);
    assert_identical(
        json!([{"role": "user", "content": format!("Weather log:\n{doc}\n\nWhat was the coldest harbour?")}]),
        1000,
    )
    .await;
}

/// The seeded identity checks above would pass trivially if the seed, or sampling itself,
/// were ignored (every path greedy). The seeded sampling used there gives another answer
/// than greedy, and another seed another answer again.
#[tokio::test]
async fn seeded_sampling_is_not_greedy_and_the_seed_matters() {
    let stack = smollm2();
    let messages = json!([{"role": "user", "content": "Write a short poem about the sea."}]);
    let ask = |s: Value| common::chat_body(messages.clone(), s);
    let greedy = run(
        stack,
        "/v1/chat/completions",
        &ask(samplings()[0].clone()),
        "local",
        false,
    )
    .await;
    let seeded = samplings()[1].clone();
    let mut other_seed = seeded.clone();
    other_seed["seed"] = json!(43);
    let a = run(stack, "/v1/chat/completions", &ask(seeded), "local", false).await;
    let b = run(
        stack,
        "/v1/chat/completions",
        &ask(other_seed),
        "local",
        false,
    )
    .await;
    assert_ne!(a.token_ids, greedy.token_ids, "seeded equals greedy");
    assert_ne!(
        a.token_ids, b.token_ids,
        "seeds 42 and 43 gave the same answer"
    );
}

/// Both nodes on a q8_0 KV cache (K and V): the split answer is the one-device answer of
/// the same cache type, greedy and seeded, V2 and V1, and the nodes say which type they run.
#[tokio::test]
async fn a_q8_0_kv_cache_keeps_the_split_identical() {
    let mut o = common::StackOptions::new(common::SMOLLM2);
    o.cache_type = edgesplit_engine::KvType::Q8_0;
    let stack = common::start(o);
    let info = common::decode_info(&stack.decode_grpc).await;
    assert_eq!((info.type_k, info.type_v), (8, 8), "{info:?}");
    assert_identical_on(
        &stack,
        json!([
            {"role": "system", "content": "You are a helpful travel guide."},
            {"role": "user", "content": "I am visiting Lisbon for three days in spring. What should I see?"}
        ]),
        30,
    )
    .await;
}
