//! The handoff is not tied to one architecture: Gemma-3-270M (a base model, so raw prompts
//! through /v1/completions) keeps most layers in a sliding-window KV cache, a different
//! state shape from SmolLM2's. Its disaggregated answers must equal the single-process ones,
//! including for prompts longer than the 512-token window.

use crate::common;

use std::sync::OnceLock;

use crate::common::{run, Stack, StackOptions};
use serde_json::{json, Value};

fn gemma() -> &'static Stack {
    static S: OnceLock<Stack> = OnceLock::new();
    S.get_or_init(|| {
        // Room for the sweep's longest prompt (2,100 tokens) and its answer.
        // Its live answers are 20 tokens: paced, so that they reach the decode node.
        // The nodes at different thread counts, the reverse of the SmolLM2 stack's.
        let mut o = StackOptions::new(common::GEMMA3).paced();
        o.n_ctx = 4096;
        o.prefill_threads = Some(1);
        o.decode_threads = Some(2);
        common::start(o)
    })
}

/// The seeded one asks for log-probabilities too: every identity check then also holds
/// them identical across transports.
fn samplings() -> [Value; 2] {
    [
        json!({"temperature": 0, "max_tokens": 20}),
        json!({"temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 1234, "max_tokens": 20,
               "logprobs": 2}),
    ]
}

/// The seeded identity checks would pass trivially if the seed, or sampling itself, were
/// ignored: the seeded sampling used there differs from greedy, and another seed differs.
#[tokio::test]
async fn seeded_sampling_is_not_greedy_and_the_seed_matters() {
    let s = gemma();
    let ask = |mut b: Value| {
        b["prompt"] = json!("The old lighthouse keeper looked out at the sea and");
        b
    };
    let [greedy, seeded] = samplings();
    let mut other_seed = seeded.clone();
    other_seed["seed"] = json!(4321);
    let g = run(s, "/v1/completions", &ask(greedy), "local", false).await;
    let a = run(s, "/v1/completions", &ask(seeded), "local", false).await;
    let b = run(s, "/v1/completions", &ask(other_seed), "local", false).await;
    assert_ne!(a.token_ids, g.token_ids, "seeded equals greedy");
    assert_ne!(a.token_ids, b.token_ids, "two seeds gave the same answer");
}

async fn assert_identical(prompt: String, min_prompt_tokens: u64) {
    assert_identical_in(prompt, min_prompt_tokens..u64::MAX, 20).await;
}

/// [`assert_identical`] for a prompt whose token count must lie in `prompt_tokens`, with
/// answers of `max_tokens`.
/// Returns the reference (`local`) answers, greedy then seeded.
async fn assert_identical_in(
    prompt: String,
    prompt_tokens: std::ops::Range<u64>,
    max_tokens: u64,
) -> Vec<common::Outcome> {
    let mut references = Vec::new();
    let min_prompt_tokens = prompt_tokens.start;
    let s = gemma();
    // Each transport under each sampling; streamed and not alternate between the two
    // (whether the router streams is independent of how the state travelled, and the four
    // combinations are all covered).
    // Reduced in CI (`common::seeded_transports`): a prompt of 500 tokens or more is
    // sampled with the seed on `v2-live` only.
    let seeded = common::seeded_transports(min_prompt_tokens);
    for (k, (sampling, streamed)) in samplings()
        .into_iter()
        .zip([[false, true], [true, false]])
        .enumerate()
    {
        let mut body: Value = sampling.clone();
        body["prompt"] = json!(prompt);
        body["max_tokens"] = json!(max_tokens);
        let reference = run(s, "/v1/completions", &body, "local", false).await;
        assert!(
            prompt_tokens.contains(&reference.prompt_tokens),
            "{} prompt tokens, wanted {prompt_tokens:?} (at least {min_prompt_tokens})",
            reference.prompt_tokens
        );
        assert!(!reference.token_ids.is_empty());
        for (transport, streamed) in [
            ("v2", streamed[0]),
            ("v1", streamed[1]),
            ("v2-live", streamed[1]),
        ] {
            if k == 1 && !seeded.contains(&transport) {
                continue;
            }
            let split = run(s, "/v1/completions", &body, transport, streamed).await;
            assert_eq!(
                split, reference,
                "{transport}, sampling {sampling}, streamed {streamed}"
            );
        }
        if k == 1 && !seeded.contains(&"plain") {
            references.push(reference);
            continue;
        }
        // As a client sends it: no `edgesplit` field, the router's defaults.
        let plain = common::run_plain(s, "/v1/completions", &body, streamed[0]).await;
        assert_eq!(
            plain,
            reference.without_ids(),
            "plain request, sampling {sampling}, streamed {}",
            streamed[0]
        );
        references.push(reference);
    }
    references
}

#[tokio::test]
async fn short_prompt() {
    assert_identical("The capital of France is".into(), 4).await;
}

/// `n` lines of a list the model can continue.
fn baskets(n: usize) -> String {
    (0..n)
        .map(|i| {
            format!(
                "Item {i}: a basket of {} apples and {} pears.",
                i * 3 + 1,
                i * 5 + 2
            )
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[tokio::test]
async fn prompt_inside_the_sliding_window() {
    let text = baskets(15);
    // Under the 512-token window: checked, not assumed.
    let _ = assert_identical_in(
        format!("{text}\nThe basket with the most pears is"),
        150..512,
        20,
    )
    .await;
}

/// The prompt fits the 512-token window; the answer's decode steps cross it (the decode
/// node's cache wraps while it writes).
#[tokio::test]
async fn decode_that_crosses_the_sliding_window() {
    let text = baskets(25);
    assert_identical_in(
        format!("{text}\nThe basket with the most pears is"),
        440..505,
        64,
    )
    .await;
}

/// A prompt of ~760 tokens, past the 512-token window.
fn timetable() -> String {
    timetable_then("The last train left from")
}

/// The timetable, then `end`.
fn timetable_then(end: &str) -> String {
    let text = (0..60)
        .map(|i| {
            format!(
                "Entry {i}: the train from {} left at {}:{:02}.",
                ["Oslo", "Rome", "Lyon", "Graz"][i % 4],
                6 + i % 17,
                (i * 7) % 60
            )
        })
        .collect::<Vec<_>>()
        .join(" ");
    format!("Timetable. {text}\n{end}")
}

#[tokio::test]
async fn prompt_longer_than_the_sliding_window() {
    assert_identical(timetable(), 700).await;
}

/// The live handoff on a sliding-window model: through a link of 6 MB/s between the nodes the
/// state (~10 MB) takes seconds to cross, so the prefill node writes on meanwhile and
/// the decode node takes over mid-answer from the pieces (the prompt's state laid out
/// after the prefill, then the cells written since), greedy and seeded: token for token
/// the `local` answer.
#[tokio::test]
async fn a_live_handoff_switches_mid_answer_identically() {
    static S: OnceLock<Stack> = OnceLock::new();
    let s = S.get_or_init(|| {
        let mut o = StackOptions::new(common::GEMMA3);
        o.n_ctx = 2048;
        o.handoff_proxy = Some(|target| common::shaped(target, || common::Shape::rate(6_000_000)));
        // Asked for, but a window's prefill sends no pieces: /health says so.
        o.stream_prefill = true;
        common::start(o)
    });
    let health = common::health(s).await;
    assert_eq!(
        health["prefill"]["stream_prefill"], "after_prefill",
        "{health}"
    );
    for (sampling, streamed) in [
        (json!({"temperature": 0}), true),
        (
            json!({"temperature": 0.7, "top_k": 40, "seed": 7, "frequency_penalty": 0.2}),
            false,
        ),
    ] {
        let mut body = sampling.clone();
        // An ending both samplings write on from for all 256 tokens (the answer must be
        // long enough for the state to cross before its end).
        body["prompt"] = json!(timetable_then("Timetable, continued. Entry 60:"));
        body["max_tokens"] = json!(256);
        let reference = run(s, "/v1/completions", &body, "local", false).await;
        assert_eq!(reference.completion_tokens, 256, "the answer ended early");
        let (split, es) =
            common::run_reporting(s, "/v1/completions", &body, "v2-live", streamed).await;
        assert_eq!(split, reference, "sampling {sampling}");
        common::assert_split(&es, split.completion_tokens);
        let before = es["prefill_tokens"].as_u64().unwrap();
        // The decode node got the tokens written meanwhile as a delta.
        assert!(
            before >= 8,
            "the switch came before the state crossed: {es}"
        );
    }
}

#[tokio::test]
async fn dialogue_as_a_raw_prompt() {
    // A base model has no chat template: a multi-turn exchange is written out as text.
    let turns = [
        ("Alice", "Have you fixed the bicycle yet?"),
        (
            "Bob",
            "Almost. The chain was rusty, so I cleaned it and oiled it.",
        ),
        ("Alice", "And the brakes? They squeaked all last week."),
        (
            "Bob",
            "New pads on the front, the back ones are still fine.",
        ),
        ("Alice", "Great. Can we ride to the lake on Saturday?"),
    ];
    let text = turns
        .iter()
        .map(|(who, said)| format!("{who}: {said}"))
        .collect::<Vec<_>>()
        .join("\n");
    assert_identical(format!("{text}\nBob:"), 60).await;
}

#[tokio::test]
async fn essay_prompt() {
    let text = "The history of the bicycle begins in the early nineteenth century, when inventors \
        in Europe experimented with two-wheeled machines pushed along by the rider's feet. "
        .repeat(6);
    assert_identical(format!("{text}The most important later invention was"), 150).await;
}

#[tokio::test]
async fn prompt_over_a_thousand_tokens() {
    let text = (0..95)
        .map(|i| {
            format!(
                "Record {i}: sensor {} read {} units at hour {}.",
                i % 9,
                (i * 37) % 101,
                i % 24
            )
        })
        .collect::<Vec<_>>()
        .join(" ");
    assert_identical(format!("{text}\nThe highest reading was"), 1000).await;
}

/// Our Gemma-3 GGUF has no chat template: a chat request gets llama-server's ChatML
/// fallback (its tokens checked against a stock llama-server in chat_template.rs) and is
/// split like any other, identical to `local`.
#[tokio::test]
async fn chat_on_a_model_without_a_chat_template_uses_chatml_and_splits_identically() {
    let s = gemma();
    let body = json!({
        "messages": [{"role": "user", "content": "Name two moons of Jupiter."}],
        "max_tokens": 12,
        "temperature": 0,
    });
    let reference = run(s, "/v1/chat/completions", &body, "local", false).await;
    // <|im_start|>user\n...<|im_end|>\n<|im_start|>assistant\n, BOS first.
    assert!(reference.prompt_tokens > 10, "{reference:?}");
    assert!(!reference.token_ids.is_empty());
    for (transport, streamed) in [("v2", true), ("v2-live", false)] {
        let split = run(s, "/v1/chat/completions", &body, transport, streamed).await;
        assert_eq!(split, reference, "{transport}, streamed {streamed}");
    }
}

/// Plain English prose, its first `words` words (the text repeats as often as needed).
fn prose(words: usize) -> String {
    const TEXT: &str = "The harbour was quiet in the early morning, and the fishermen were \
        already mending their nets on the stones.";
    TEXT.split_whitespace()
        .cycle()
        .take(words)
        .collect::<Vec<_>>()
        .join(" ")
}

/// Prompts across and beyond the 512-token sliding window, every 50 tokens from
/// 450 to 2,100, each under greedy decoding and three seeded samplings (seeded answers
/// part first where layouts differ), 64 tokens, `v2` and `v1` against `local`, token ids
/// compared. CI runs one length, greedy and under one seeded sampling (~1 minute here):
/// where the ring and the imported layout part early on this text in llama.cpp
/// (engine/tests/it/sliding_window.rs, 662 tokens). Past two windows, CI has
/// `prompt_over_a_thousand_tokens`; the full sweep adds 1,139 (where a seeded answer parted
/// with differing layouts) and the longest, 2,100. `EDGESPLIT_FULL_SWEEP=1` runs all 34
/// lengths under all four samplings (about 40 minutes here). Not the regression guard:
/// with the relayout turned off, four lengths of it (450, 662, 882, 2,100) still passed on
/// this stack (4 slots of 4,096 tokens); engine/tests/it/sliding_window_engine.rs fails
/// without it.
#[tokio::test]
async fn sampling_beyond_the_window_sweep() {
    let full = common::full_sweep();
    let s = gemma();
    let samplings = [
        json!({"temperature": 0}),
        json!({"temperature": 0.8, "seed": 7}),
        json!({"temperature": 1.0, "top_p": 0.95, "seed": 11}),
        json!({"temperature": 0.9, "top_p": 0.9, "seed": 1234, "frequency_penalty": 0.3}),
    ];
    let targets: Vec<usize> = if full {
        (0..34).map(|i| 450 + 50 * i).collect()
    } else {
        vec![662]
    };
    // Prompts cut to the word that brings them to each target length, counted by the
    // model's own tokenizer.
    let mut cfg = edgesplit_engine::EngineConfig::new(common::model(common::GEMMA3));
    cfg.n_ctx = 256;
    cfg.n_parallel = 1;
    let tokenizer = edgesplit_engine::Engine::start(cfg).await.unwrap();
    let count = |words: usize| {
        let t = &tokenizer;
        async move {
            t.tokenize(edgesplit_engine::Input::Raw(prose(words)))
                .await
                .unwrap()
                .len()
        }
    };
    for target in targets {
        let samplings: Vec<&Value> = if full {
            samplings.iter().collect()
        } else {
            samplings[..2].iter().collect()
        };
        // The fewest words that reach the target (tokens grow with words).
        let (mut lo, mut hi) = (1, 4 * target);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if count(mid).await < target {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        let prompt = prose(lo);
        let mut diverged = Vec::new();
        let mut tokens = 0;
        for sampling in samplings {
            let mut body = sampling.clone();
            body["prompt"] = json!(prompt);
            body["max_tokens"] = json!(64);
            // Each length handed over whole: the text cycles, so the model's answer to a
            // shorter prompt is the start of a longer one, which the decode node would
            // otherwise continue itself (conversation.rs tests that).
            body["cache_prompt"] = json!(false);
            let reference = run(s, "/v1/completions", &body, "local", false).await;
            tokens = reference.prompt_tokens;
            for transport in ["v2", "v1"] {
                let split = run(s, "/v1/completions", &body, transport, false).await;
                if split.token_ids != reference.token_ids {
                    let at = split
                        .token_ids
                        .iter()
                        .zip(&reference.token_ids)
                        .position(|(a, b)| a != b)
                        .unwrap_or(split.token_ids.len().min(reference.token_ids.len()));
                    diverged.push(format!("{transport} {sampling} differs at token {at}"));
                }
            }
        }
        // The length is the one asked for (the router counts what the engine counts).
        assert!(
            (tokens as usize).abs_diff(target) <= 3,
            "prompt of {tokens} tokens for a target of {target}"
        );
        assert!(
            diverged.is_empty(),
            "prompt of {tokens} tokens: {}",
            diverged.join("; ")
        );
    }
}
