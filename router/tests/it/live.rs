//! The live handoff on the real services, through a throttled link between
//! the nodes: the prefill node keeps writing while the state crosses and the decode node
//! takes over mid-answer, token for token the `local` answer (greedy, and seeded with a
//! frequency penalty: the decode node continues at the right step with the right history);
//! an answer that ends before the handoff completes leaves nothing held on the decode node;
//! a corrupted piece is refused and the answer goes on on the prefill node, identical; a
//! corrupted last piece, refused after the switch, is finished by the fallback, identical
//! and without waiting out the decode node's bound.
//! (Identity on both families for fast links: `fidelity.rs` and `gemma.rs`, `v2-live`.)

use crate::common;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Bytes per second the proxy lets through towards the decode node (0: no limit).
static RATE: AtomicU64 = AtomicU64::new(0);
/// Flip the byte at this offset of each connection's upstream (usize::MAX: none).
static CORRUPT_AT: AtomicUsize = AtomicUsize::new(usize::MAX);
/// Flip the last byte (its checksum's) of every LAST frame upstream.
static CORRUPT_LAST: AtomicBool = AtomicBool::new(false);

/// Between the nodes: the link as the statics above say when each connection opens.
fn throttling_proxy(target: String) -> String {
    common::shaped(target, || common::Shape {
        faults: common::Faults {
            corrupt_at: Some(CORRUPT_AT.load(Ordering::SeqCst)).filter(|&at| at != usize::MAX),
            corrupt_last: CORRUPT_LAST.load(Ordering::SeqCst),
            ..common::Faults::default()
        },
        ..common::Shape::rate(RATE.load(Ordering::SeqCst))
    })
}

fn stack() -> &'static common::Stack {
    static S: OnceLock<common::Stack> = OnceLock::new();
    S.get_or_init(|| {
        let mut o = common::StackOptions::new(common::SMOLLM2);
        o.handoff_proxy = Some(throttling_proxy);
        // Scenario 1b sends the prompt's state during its prefill, in batches of 128: more
        // pieces than a handoff has delta rounds after the first token (which once
        // counted them too, and gave up at once).
        o.stream_prefill = true;
        o.batch = 128;
        // Scenario 4 shows that a dropped handoff does not wait this out.
        o.handoff_wait_s = 60;
        common::start(o)
    })
}

/// A ~300-token prompt that the model answers at length (it keeps counting).
fn long_answer(extra: Value) -> Value {
    long_answer_after(20, extra)
}

/// [`long_answer`] after `n` sentences (20: ~300 tokens, 150: over two prefill batches).
fn long_answer_after(n: usize, extra: Value) -> Value {
    let mut body = json!({
        "prompt": format!("{} {}", "The numbers below go on and on.".repeat(n), common::counting_prompt()),
        "max_tokens": 96,
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

/// The decode node's gauge of states (and live pieces) it holds.
async fn pending_bytes(s: &common::Stack) -> f64 {
    let text = common::scrape(&s.v1_url.replace("/v1/handoff", "/metrics")).await;
    common::value(&text, "edgesplit:pending_handoff_bytes")
}

#[tokio::test]
async fn live_handoff_on_a_slow_link() {
    let s = stack();
    let health = common::health(s).await;
    assert_eq!(health["prefill"]["stream_prefill"], "per_batch", "{health}");
    // 1. The state takes about a second to cross: the prefill node writes meanwhile, then
    //    the decode node takes over mid-answer, identical to local, greedy and seeded.
    for (sampling, streamed) in [
        (json!({"temperature": 0}), true),
        (
            json!({"temperature": 0.7, "top_k": 40, "seed": 11, "frequency_penalty": 0.3}),
            false,
        ),
    ] {
        let body = long_answer(sampling.clone());
        RATE.store(0, Ordering::SeqCst);
        let reference = common::run(s, "/v1/completions", &body, "local", false).await;
        RATE.store(8_000_000, Ordering::SeqCst);
        let (split, es) =
            common::run_reporting(s, "/v1/completions", &body, "v2-live", streamed).await;
        assert_eq!(split, reference, "sampling {sampling}");
        common::assert_split(&es, split.completion_tokens);
        let before = es["prefill_tokens"].as_u64().unwrap();
        assert!(
            before >= 2,
            "the prefill node did not go on writing while the state crossed: {es}"
        );
        assert!(es["handoff_bytes"].as_u64().unwrap() > 6_000_000, "{es}");
    }

    // 1b. A prompt of several prefill batches: its state crosses while it is prefilled,
    //     in pieces, then the rest after the first token; identical. (Prefilled anew, not
    //     from the prefix the local run left in the prefill node's cache.)
    let body = long_answer_after(155, json!({"temperature": 0, "cache_prompt": false}));
    RATE.store(0, Ordering::SeqCst);
    let reference = common::run(s, "/v1/completions", &body, "local", false).await;
    assert!(
        reference.prompt_tokens > 1024,
        "{}",
        reference.prompt_tokens
    );
    RATE.store(8_000_000, Ordering::SeqCst);
    let (split, es) = common::run_reporting(s, "/v1/completions", &body, "v2-live", true).await;
    assert_eq!(split, reference);
    common::assert_split(&es, split.completion_tokens);

    // 2. The answer ends before the state has crossed: all of it from the prefill node,
    //    and the decode node drops what it received.
    RATE.store(1_000_000, Ordering::SeqCst);
    let body = long_answer(json!({"temperature": 0, "max_tokens": 6}));
    let reference = common::run(s, "/v1/completions", &body, "local", false).await;
    let (split, es) = common::run_reporting(s, "/v1/completions", &body, "v2-live", false).await;
    assert_eq!(split, reference);
    assert_eq!(
        es["prefill_tokens"].as_u64(),
        Some(split.completion_tokens),
        "{es}"
    );
    assert_eq!(es["decode_tokens"], 0, "{es}");
    assert!(
        es["switch_ms"].is_null() && es["fallback"].is_null(),
        "{es}"
    );
    let t0 = Instant::now();
    while pending_bytes(s).await != 0.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the decode node still holds the cancelled handoff's pieces"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // 3. A corrupted piece is refused (checksum): the handoff gives up and the answer goes
    //    on on the prefill node, identical, with no fallback.
    RATE.store(0, Ordering::SeqCst);
    CORRUPT_AT.store(200_000, Ordering::SeqCst);
    let body = long_answer(json!({"temperature": 0, "max_tokens": 24}));
    let (split, es) = common::run_reporting(s, "/v1/completions", &body, "v2-live", true).await;
    CORRUPT_AT.store(usize::MAX, Ordering::SeqCst);
    let reference = common::run(s, "/v1/completions", &body, "local", false).await;
    assert_eq!(split, reference);
    let why = es["handoff_cancelled"].as_str().unwrap_or_default();
    assert!(why.contains("checksum"), "{es}");
    assert_eq!(
        es["prefill_tokens"].as_u64(),
        Some(split.completion_tokens),
        "{es}"
    );
    assert!(es["fallback"].is_null(), "{es}");
    assert_eq!(pending_bytes(s).await, 0.0);

    // 4. The last piece is refused (checksum) after the prefill node stopped and the
    //    router already called the decode node, which does not wait for the state the
    //    receiver dropped: it fails at once, and the router finishes the answer on the
    //    prefill node (its fallback), identical.
    RATE.store(8_000_000, Ordering::SeqCst);
    CORRUPT_LAST.store(true, Ordering::SeqCst);
    let body = long_answer(json!({"temperature": 0}));
    let t0 = Instant::now();
    let (split, es) = common::run_reporting(s, "/v1/completions", &body, "v2-live", true).await;
    let took = t0.elapsed();
    CORRUPT_LAST.store(false, Ordering::SeqCst);
    RATE.store(0, Ordering::SeqCst);
    let reference = common::run(s, "/v1/completions", &body, "local", false).await;
    assert_eq!(split, reference);
    assert_eq!(es["fallback"], "handoff_failed", "{es}");
    assert!(es["switch_ms"].is_number(), "{es}");
    // The decode node would wait 60 s (--handoff-wait-s) for a state that does not come.
    assert!(took < Duration::from_secs(40), "{took:?}: {es}");
    assert_eq!(pending_bytes(s).await, 0.0);
}
