//! Several sequences at once on one engine (`n_parallel`): each answer is identical to the
//! one the engine writes alone, the answers really overlap in time, a request beyond the
//! slots waits and then runs, and a reader that leaves frees its slot.

use crate::common::model_path;
use std::time::{Duration, Instant};

use edgesplit_engine::{
    Engine, EngineConfig, Export, Exported, GenEvent, Input, SamplingParams, Start,
};
use tokio::sync::mpsc::UnboundedReceiver;

/// Token ids, the final event, and when the first and the last token arrived.
struct Run {
    ids: Vec<i32>,
    last: GenEvent,
    first_at: Instant,
    done_at: Instant,
}

async fn collect(mut rx: UnboundedReceiver<GenEvent>) -> Run {
    let mut ids = Vec::new();
    let mut first_at = None;
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Token(t) => {
                first_at.get_or_insert_with(Instant::now);
                ids.push(t.id);
            }
            GenEvent::Prefilled { .. } => {}
            last => {
                let now = Instant::now();
                return Run {
                    ids,
                    last,
                    first_at: first_at.unwrap_or(now),
                    done_at: now,
                };
            }
        }
    }
    panic!("generation ended without a final event");
}

fn seeded() -> SamplingParams {
    SamplingParams {
        temperature: 0.8,
        top_k: 40,
        top_p: 0.95,
        seed: 7,
        ..SamplingParams::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_answers_equal_the_answers_written_alone() {
    let mut cfg = EngineConfig::new(model_path());
    cfg.n_ctx = 512;
    let alone = Engine::start(cfg.clone()).await.unwrap();
    cfg.n_parallel = 3;
    let par = Engine::start(cfg).await.unwrap();
    assert_eq!(par.info().parallel, 3);

    let questions = ["Name three rivers.", "What is rust?", "Count to ten."];
    let mut prompts = Vec::new();
    for q in questions {
        let chat = Input::chat(vec![("user", q)]);
        prompts.push(alone.tokenize(chat).await.unwrap());
    }
    // Greedy and seeded, prompts of different lengths, and one started from an imported
    // state: the three ways a decode or prefill node starts an answer.
    let params = [
        SamplingParams::default(),
        seeded(),
        SamplingParams::default(),
    ];
    let n = 40;
    let mut reference = Vec::new();
    for (p, s) in prompts.iter().zip(&params) {
        let run = collect(
            alone
                .generate(Start::Prompt(p.clone()), s.clone(), n)
                .await
                .unwrap(),
        )
        .await;
        assert!(matches!(run.last, GenEvent::Done(_)), "{:?}", run.last);
        assert_eq!(run.ids.len(), n as usize, "answers run to the budget");
        reference.push(run.ids);
    }
    let pre = alone
        .prefill(prompts[2].clone(), params[2].clone(), n, Export::Raw)
        .await
        .unwrap();
    let Some(Exported::Raw(state)) = pre.state else {
        panic!("state exported")
    };

    let a = par
        .generate(Start::Prompt(prompts[0].clone()), params[0].clone(), n)
        .await
        .unwrap();
    let b = par
        .generate(Start::Prompt(prompts[1].clone()), params[1].clone(), n)
        .await
        .unwrap();
    let c = par
        .generate(
            Start::Imported {
                state: state.into(),
                tokens: prompts[2].clone(),
                first: pre.first.id,
                answered: 1,
                base_digest: None,
            },
            params[2].clone(),
            n - 1,
        )
        .await
        .unwrap();
    let (a, b, c) = tokio::join!(collect(a), collect(b), collect(c));
    for r in [&a, &b, &c] {
        assert!(matches!(r.last, GenEvent::Done(_)), "{:?}", r.last);
    }
    assert_eq!(a.ids, reference[0], "greedy, prompt 0");
    assert_eq!(b.ids, reference[1], "seeded, prompt 1");
    let mut split = vec![pre.first.id];
    split.extend(&c.ids);
    assert_eq!(split, reference[2], "imported state, prompt 2");
    // They ran at the same time: every answer had its first token before any ended.
    let first_end = [a.done_at, b.done_at, c.done_at].into_iter().min().unwrap();
    for r in [&a, &b, &c] {
        assert!(r.first_at < first_end, "the answers took turns");
    }
    assert_eq!(par.in_flight(), 0);
    assert_eq!(par.kv_tokens(), 0, "every slot was cleared");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beyond_the_slots_requests_wait_and_a_reader_that_leaves_frees_its_slot() {
    let mut cfg = EngineConfig::new(model_path());
    cfg.n_ctx = 512;
    cfg.n_parallel = 2;
    let e = Engine::start(cfg).await.unwrap();
    let prompt = e
        .tokenize(Input::Raw("Once upon a time".into()))
        .await
        .unwrap();
    let long = |e: &Engine| {
        let (e, p) = (e.clone(), prompt.clone());
        async move {
            e.generate(Start::Prompt(p), SamplingParams::default(), 400)
                .await
                .unwrap()
        }
    };
    // Two long answers fill both slots; the third request waits.
    let mut a = long(&e).await;
    let mut b = long(&e).await;
    let mut c = e
        .generate(Start::Prompt(prompt.clone()), SamplingParams::default(), 4)
        .await
        .unwrap();
    assert!(matches!(a.recv().await, Some(GenEvent::Prefilled { .. })));
    assert!(matches!(b.recv().await, Some(GenEvent::Prefilled { .. })));
    assert_eq!(e.in_flight(), 3);
    assert_eq!(e.active(), 2, "two slots write, the third request waits");
    assert!(
        tokio::time::timeout(Duration::from_millis(300), c.recv())
            .await
            .is_err(),
        "no slot is free: the third request has not started"
    );
    // The reader of `b` leaves: its slot frees and the third request runs to its end.
    drop(b);
    let waited = collect(c).await;
    assert!(
        matches!(waited.last, GenEvent::Done(_)),
        "{:?}",
        waited.last
    );
    assert_eq!(waited.ids.len(), 4);
    // `a` was still running all along.
    drop(a.recv().await);
    assert_eq!(e.in_flight(), 1);
    drop(a);
    let deadline = Instant::now() + Duration::from_secs(10);
    while e.in_flight() > 0 {
        assert!(Instant::now() < deadline, "cancelled answer still running");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(e.kv_tokens(), 0);
    assert_eq!(e.active(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wait_for_a_slot_is_bounded() {
    let mut cfg = EngineConfig::new(model_path());
    cfg.n_ctx = 512;
    let e = Engine::start(cfg).await.unwrap();
    let prompt = e
        .tokenize(Input::Raw("Once upon a time".into()))
        .await
        .unwrap();
    let mut long = e
        .generate(
            Start::Prompt(prompt.clone()),
            SamplingParams::default(),
            480,
        )
        .await
        .unwrap();
    assert!(matches!(
        long.recv().await,
        Some(GenEvent::Prefilled { .. })
    ));
    // The one slot is busy: these wait, up to the bound.
    let mut waiting = Vec::new();
    for _ in 0..edgesplit_engine::MAX_WAITING {
        let g = e.generate(Start::Prompt(prompt.clone()), SamplingParams::default(), 1);
        waiting.push(g.await.unwrap());
    }
    let mut refused = e
        .generate(Start::Prompt(prompt.clone()), SamplingParams::default(), 1)
        .await
        .unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), refused.recv())
        .await
        .expect("refused at once, not queued");
    assert!(
        matches!(
            got,
            Some(GenEvent::Error(edgesplit_engine::EngineError::Busy {
                waiting: 256
            }))
        ),
        "{got:?}"
    );
    assert!(e.in_flight() as usize > edgesplit_engine::MAX_WAITING);
    drop(waiting);
    drop(long);
    let deadline = Instant::now() + Duration::from_secs(20);
    while e.in_flight() > 0 {
        assert!(
            Instant::now() < deadline,
            "the waiting requests were not dropped"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A long prompt prefilled in one slot holds an answer running in another up one batch
/// at a time, not for its whole prefill (the scheduler steps running answers between a
/// prefill's batches), and neither changes: the answer is the one written alone, the
/// prefill's first token and state those of the prefill alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_prefill_holds_a_running_answer_up_one_batch_at_a_time() {
    let mut cfg = EngineConfig::new(model_path());
    cfg.n_ctx = 2048;
    // Small batches: many of them in a prompt this test can afford.
    cfg.n_batch = 64;
    let alone = Engine::start(cfg.clone()).await.unwrap();
    cfg.n_parallel = 2;
    let par = Engine::start(cfg).await.unwrap();

    let short = alone
        .tokenize(Input::chat(vec![(
            "user",
            "Tell me a long story about a dragon.",
        )]))
        .await
        .unwrap();
    let sentence = "The quick brown fox jumps over the lazy dog near the quiet river bank. ";
    let long_text = sentence.repeat(70);
    let long = alone
        .tokenize(Input::chat(vec![("user", long_text.as_str())]))
        .await
        .unwrap();
    assert!(long.len() > 900, "{} tokens", long.len());
    let n = 300;
    let greedy = SamplingParams::default;
    let reference = collect(
        alone
            .generate(Start::Prompt(short.clone()), greedy(), n)
            .await
            .unwrap(),
    )
    .await;
    let pre_alone = alone
        .prefill(long.clone(), greedy(), 8, Export::Raw)
        .await
        .unwrap();

    // The answer runs; once it has written a few tokens, the long prompt comes.
    let mut rx = par
        .generate(Start::Prompt(short.clone()), greedy(), n)
        .await
        .unwrap();
    let mut ids = Vec::new();
    let mut at = Vec::new();
    let mut last = None;
    while let Some(ev) = rx.recv().await {
        if let GenEvent::Token(t) = ev {
            ids.push(t.id);
            at.push(Instant::now());
            if ids.len() == 5 {
                break;
            }
        }
    }
    let p = par.clone();
    let l = long.clone();
    let sent = Instant::now();
    let prefill = tokio::spawn(async move {
        let out = p.prefill(l, greedy(), 8, Export::Raw).await.unwrap();
        (out, Instant::now())
    });
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Token(t) => {
                ids.push(t.id);
                at.push(Instant::now());
            }
            GenEvent::Prefilled { .. } => {}
            other => {
                last = Some(other);
                break;
            }
        }
    }
    let (pre, done) = prefill.await.unwrap();
    assert!(matches!(last, Some(GenEvent::Done(_))), "{last:?}");
    assert_eq!(ids, reference.ids, "the answer is the one written alone");
    assert_eq!(
        pre.first.id, pre_alone.first.id,
        "the prefill's first token"
    );
    let (Some(Exported::Raw(a)), Some(Exported::Raw(b))) = (&pre.state, &pre_alone.state) else {
        panic!("states exported")
    };
    assert!(a == b, "the prefill's state is the one prefilled alone");
    // The answer ran through the prefill, and its longest wait then was a batch or so.
    assert!(
        *at.last().unwrap() > done,
        "the answer ended before the prefill did"
    );
    let gaps: Vec<Duration> = at
        .windows(2)
        .filter(|w| w[1] > sent && w[0] < done)
        .map(|w| w[1] - w[0])
        .collect();
    let longest = gaps.iter().max().copied().unwrap_or_default();
    let batches = long.len().div_ceil(64);
    eprintln!(
        "prefill of {} tokens in {batches} batches: {:.0} ms; the running answer's longest gap then {longest:?} over {} tokens",
        long.len(),
        pre.prefill_ms,
        gaps.len()
    );
    assert!(
        longest.as_secs_f64() * 1000.0 < pre.prefill_ms / 4.0,
        "the running answer waited {longest:?} during a {:.0} ms prefill",
        pre.prefill_ms
    );
    assert!(
        gaps.len() >= batches / 2,
        "it stepped between the batches: {} tokens",
        gaps.len()
    );
}
