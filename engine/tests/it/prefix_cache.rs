//! The prefix cache on the real models: exact reuse leaves the state bit for bit an
//! uncached prefill's; a conversation continued from the cache goes on exactly as the same
//! conversation continued on an engine that imported its first turn (the decode node's
//! path), on both model families; a bound on the uncached part refuses without touching
//! the cache.

use crate::common::{collect, gemma_path, model_path};
use edgesplit_engine::{
    Engine, EngineConfig, EngineError, Export, Exported, GenEvent, GenSummary, Input, Reuse,
    SamplingParams, Start,
};

fn config(path: std::path::PathBuf, n_batch: u32) -> EngineConfig {
    let mut cfg = EngineConfig::new(path);
    cfg.n_ctx = 1024;
    cfg.n_batch = n_batch;
    cfg
}

fn state(out: &edgesplit_engine::PrefillOutput) -> Vec<u8> {
    match &out.state {
        Some(Exported::Raw(s)) => s.clone(),
        None => panic!("no state exported"),
    }
}

async fn tokens(e: &Engine, text: &str) -> Vec<i32> {
    e.tokenize(Input::chat(vec![("user", text)])).await.unwrap()
}

/// An answer's ids (the first included) and its summary.
async fn answer(
    e: &Engine,
    start: Start,
    params: &SamplingParams,
    n: u32,
) -> (Vec<i32>, GenSummary) {
    let (ids, end) = collect(e.generate(start, params.clone(), n).await.unwrap()).await;
    match end {
        GenEvent::Done(s) => (ids, s),
        other => panic!("{other:?}"),
    }
}

fn conversation(tokens: Vec<i32>) -> Start {
    Start::Cached {
        tokens,
        reuse: Reuse::Conversation,
        max_uncached: None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exact_reuse_leaves_the_state_bit_for_bit_an_uncached_prefills() {
    // Batches of 16: a shared prefix of 50 tokens reuses 48.
    let cached = Engine::start(config(model_path(), 16)).await.unwrap();
    let fresh = Engine::start(config(model_path(), 16)).await.unwrap();
    let first = tokens(&cached, &"The tide came in over the flats. ".repeat(8)).await;
    let mut second = first[..50].to_vec();
    second.extend(
        tokens(&cached, "Then the wind turned.")
            .await
            .into_iter()
            .skip(1),
    );
    let params = SamplingParams {
        temperature: 0.8,
        seed: 5,
        ..SamplingParams::default()
    };
    answer(&cached, Start::Prompt(first.clone()), &params, 8).await;
    let reused = cached
        .prefill(second.clone(), params.clone(), 8, Export::Raw)
        .await
        .unwrap();
    assert_eq!(reused.cached_tokens, 48);
    let whole = fresh
        .prefill_with(second, params, 8, Export::Raw, Reuse::None)
        .await
        .unwrap();
    assert_eq!(whole.cached_tokens, 0);
    assert_eq!(reused.first, whole.first);
    assert!(state(&reused) == state(&whole), "the states differ");
    let stats = cached.cache_stats();
    assert_eq!((stats.hits, stats.reused_tokens), (1, 48));
    assert!(stats.cached_tokens > 0, "the slot keeps its sequence");
    assert_eq!(cached.kv_tokens(), 0, "no slot in use");
}

/// Turn 1 written in one engine (`local`), and prefilled in another and imported into a
/// third (the split); turn 2 continues each from its cache: the same tokens, the same
/// cached count.
async fn a_conversation_goes_on_identically(path: fn() -> std::path::PathBuf) {
    let local = Engine::start(config(path(), 512)).await.unwrap();
    let prefill = Engine::start(config(path(), 512)).await.unwrap();
    let decode = Engine::start(config(path(), 512)).await.unwrap();
    let params = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        seed: 3,
        ..SamplingParams::default()
    };
    let q1 = "Name three rivers of Europe and say one thing about each.";
    let turn1 = tokens(&local, q1).await;
    let (a1, _) = answer(&local, Start::Prompt(turn1.clone()), &params, 24).await;
    let out = prefill
        .prefill(turn1.clone(), params.clone(), 24, Export::Raw)
        .await
        .unwrap();
    assert_eq!(out.first.id, a1[0]);
    let (rest, _) =
        crate::common::continue_imported(&decode, state(&out), &turn1, a1[0], &params, 23).await;
    assert_eq!(rest, a1[1..], "turn 1 split as local");

    // Turn 2: turn 1, its answer, and a new question (as token ids, so that the held
    // sequence is extended as it is, whatever the chat template does with the answer's
    // text; the router's tests go through the template).
    let mut turn2 = turn1.clone();
    turn2.extend(&a1);
    turn2.extend(
        tokens(&local, "Which of them is the longest?")
            .await
            .into_iter()
            .skip(1),
    );
    let (l2, ls) = answer(&local, conversation(turn2.clone()), &params, 16).await;
    let (d2, ds) = answer(&decode, conversation(turn2.clone()), &params, 16).await;
    assert!(
        ls.cached_tokens as usize > turn1.len(),
        "the answer's tokens were reused: {} of {} ({} in turn 1's prompt)",
        ls.cached_tokens,
        turn2.len(),
        turn1.len()
    );
    assert_eq!(ds.cached_tokens, ls.cached_tokens);
    assert_eq!(d2, l2, "turn 2 continued on the decode node as locally");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_goes_on_identically_smollm2() {
    a_conversation_goes_on_identically(model_path).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_goes_on_identically_gemma() {
    a_conversation_goes_on_identically(gemma_path).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bound_on_the_uncached_part_refuses_and_keeps_the_cache() {
    let e = Engine::start(config(model_path(), 512)).await.unwrap();
    let params = SamplingParams::default();
    let p = tokens(&e, "Say hello.").await;
    let (a, _) = answer(&e, Start::Prompt(p.clone()), &params, 4).await;
    let mut longer = p.clone();
    longer.extend(&a[..a.len() - 1]);
    longer.extend(tokens(&e, "And again.").await.into_iter().skip(1));
    let uncached = longer.len() - (p.len() + a.len() - 1);
    let bounded = |max| Start::Cached {
        tokens: longer.clone(),
        reuse: Reuse::Conversation,
        max_uncached: Some(max),
    };
    let (_, end) = collect(
        e.generate(bounded(uncached as u32 - 1), params.clone(), 4)
            .await
            .unwrap(),
    )
    .await;
    assert!(
        matches!(end, GenEvent::Error(EngineError::NotCached { cached, .. }) if cached as usize == p.len() + a.len() - 1),
        "{end:?}"
    );
    let (_, s) = answer(&e, bounded(uncached as u32), &params, 4).await;
    assert_eq!(
        s.cached_tokens as usize,
        p.len() + a.len() - 1,
        "the cache was kept"
    );
}

/// A live answer's prefill sends a reused prefix as its first piece (it is there before
/// the prefill starts), then a piece after each batch but the last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_prefix_is_the_first_piece_of_a_live_prefill() {
    let e = Engine::start(config(model_path(), 16)).await.unwrap();
    let params = SamplingParams::default();
    let first = tokens(&e, &"The tide came in over the flats. ".repeat(8)).await;
    answer(&e, Start::Prompt(first.clone()), &params, 2).await;
    let mut second = first[..50].to_vec();
    second.extend(
        tokens(&e, &"Then the wind turned. ".repeat(4))
            .await
            .into_iter()
            .skip(1),
    );
    let mut live = e
        .generate_live(Start::Prompt(second.clone()), params, 2)
        .await
        .unwrap();
    let mut covered = Vec::new();
    while let Some(p) = live.pieces.recv().await {
        assert_eq!(p.from, covered.last().copied().unwrap_or(0));
        covered.push(p.tokens.len());
    }
    let batches_after = (second.len() - 48 - 1) / 16;
    let expected: Vec<usize> = std::iter::once(48)
        .chain((1..=batches_after).map(|b| 48 + 16 * b))
        .collect();
    assert_eq!(covered, expected, "prompt of {}", second.len());
}

/// The same turn of a conversation asked twice (the second time cut back to where the
/// answer before it ended) is answered the same; over several turns of long prompts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_turn_twice_gets_the_same_answer() {
    let mut cfg = config(model_path(), 512);
    cfg.n_ctx = 4096;
    cfg.n_parallel = 1;
    let e = Engine::start(cfg).await.unwrap();
    let params = SamplingParams::default();
    let log = |from: usize, n: usize| {
        (from..from + n)
            .map(|i| format!("Reading {i} of the gauge: {} units.", (i * 7) % 23))
            .collect::<Vec<_>>()
            .join(" ")
    };
    let mut prompt = tokens(&e, &format!("{}\nSummarise the weather log.", log(0, 24))).await;
    for turn in 2..=3 {
        let (a, _) = answer(&e, conversation(prompt.clone()), &params, 32).await;
        let (b, sb) = answer(&e, conversation(prompt.clone()), &params, 32).await;
        assert_eq!(
            a, b,
            "turn {turn}: asked again (cut back to {})",
            sb.cached_tokens
        );
        prompt.extend(&a);
        prompt.extend(
            tokens(
                &e,
                &format!(
                    "More readings: {}\nWhich day was the windiest?",
                    log(1000 * turn, 9)
                ),
            )
            .await
            .into_iter()
            .skip(1),
        );
    }
}

/// A conversation is continued from its own copy, not from the same tokens held as one
/// prompt prefilled whole (another client sent the conversation so far as a prompt and
/// got the same answer): bit for bit (log-probabilities) what an engine that holds only
/// the conversation gives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_goes_on_from_its_own_copy() {
    let mut two = config(model_path(), 512);
    two.n_parallel = 2;
    let e1 = Engine::start(two).await.unwrap();
    let e2 = Engine::start(config(model_path(), 512)).await.unwrap();
    let params = SamplingParams {
        logprobs: Some(2),
        ..SamplingParams::default()
    };
    let p1 = tokens(&e2, "List the planets of the solar system in order.").await;
    let (a1, _) = answer(&e2, conversation(p1.clone()), &params, 16).await;
    // The same tokens held as one prompt prefilled whole with one token decoded after
    // it, as far as the conversation holds them: slot 0 of e1.
    let whole = Start::Cached {
        tokens: p1.iter().chain(&a1[..a1.len() - 2]).copied().collect(),
        reuse: Reuse::None,
        max_uncached: None,
    };
    let (w, _) = answer(&e1, whole, &params, 2).await;
    assert_eq!(
        w[0],
        a1[a1.len() - 2],
        "greedy goes on as the conversation did"
    );
    // The conversation's turn 1 on e1: an empty slot, not a cut of the other.
    let (b1, s1) = answer(&e1, conversation(p1.clone()), &params, 16).await;
    assert_eq!((b1.clone(), s1.cached_tokens), (a1.clone(), 0));
    let mut p2 = p1.clone();
    p2.extend(&a1);
    p2.extend(
        tokens(&e2, "Which is the largest?")
            .await
            .into_iter()
            .skip(1),
    );
    let with_logprobs = |e: &Engine| {
        let (e, p2, params) = (e.clone(), p2.clone(), params.clone());
        async move {
            let mut rx = e.generate(conversation(p2), params, 12).await.unwrap();
            let mut out = Vec::new();
            let mut cached = None;
            while let Some(ev) = rx.recv().await {
                match ev {
                    GenEvent::Token(t) => out.push(t),
                    GenEvent::Prefilled { cached_tokens, .. } => cached = Some(cached_tokens),
                    GenEvent::Done(_) => return (out, cached),
                    GenEvent::Error(err) => panic!("{err}"),
                }
            }
            panic!("no end")
        }
    };
    let (t1, c1) = with_logprobs(&e1).await;
    let (t2, c2) = with_logprobs(&e2).await;
    assert_eq!(c1, c2, "the same cut");
    assert_eq!(t1, t2, "tokens and log-probabilities");
}
