//! The pool of decode nodes over scripted nodes (`fake.rs`): which pair a request goes
//! to (named, held, least queued, `auto`'s best), and a node left out while its `Info`
//! fails or shows another model, taken again once it answers.

use std::sync::Arc;

use edgesplit_proto::pb;

use super::cost::{Choice, Cost};
use super::fake::msg::{finished, prefilled, token};
use super::fake::{FakeDecode, FakePrefill};
use super::route::Route;
use super::tests::{config, events, request, tokens, unavailable};
use super::{best, refusal, Backend, Candidate, Node, NodeState, Pool};
use crate::api::{Objective, Transport};

/// A prefill node and `n` decode nodes, `http://decode-1.test` and on.
struct Household {
    prefill: Arc<FakePrefill>,
    decode: Vec<Arc<FakeDecode>>,
    pool: Pool,
}

fn url(i: usize) -> String {
    format!("http://decode-{}.test", i + 1)
}

fn household(n: usize) -> Household {
    let prefill = Arc::new(FakePrefill::default());
    let decode: Vec<Arc<FakeDecode>> = (0..n).map(|_| Arc::new(FakeDecode::default())).collect();
    let first = Backend::with_nodes(
        super::BackendConfig {
            decode_url: url(0),
            ..config(true)
        },
        prefill.clone(),
        decode[0].clone(),
    );
    let mut pairs = vec![first.clone()];
    for (i, d) in decode.iter().enumerate().skip(1) {
        pairs.push(first.beside(url(i), d.clone()));
    }
    Household {
        prefill,
        decode,
        pool: Pool::of(pairs),
    }
}

/// A `phone` answer of one token on decode node `i`.
fn phone_answers(h: &Household, i: usize, id: i32) {
    h.decode[i]
        .local
        .then(Ok(vec![prefilled(5, 0), token(id), finished(1)]));
}

/// A `phone` answer to "Hi" (request `id`), started on the pool: the node it went to must be
/// decode node `i`.
async fn phone_on(pool: &Pool, id: &str, i: usize) -> super::Started {
    let (started, b) = pool
        .start(&request("Hi", ""), Transport::Phone, id)
        .await
        .unwrap();
    assert_eq!(b.decode_url(), url(i), "{id}");
    started
}

fn another_model() -> pb::NodeInfo {
    pb::NodeInfo {
        role: "decode".into(),
        model_id: "other".into(),
        model_fingerprint: "other-fingerprint".into(),
        ..pb::NodeInfo::default()
    }
}

#[tokio::test]
async fn a_request_that_names_a_node_goes_to_it_and_an_unknown_name_is_a_400() {
    let h = household(2);
    phone_answers(&h, 1, 21);
    let req = request(
        "Hello",
        &format!(r#", "edgesplit": {{"node": "{}"}}"#, url(1)),
    );
    let (started, b) = h.pool.start(&req, Transport::Phone, "r1").await.unwrap();
    assert_eq!(b.decode_url(), url(1));
    assert_eq!(tokens(&events(started).await), [(21, Node::Decode)]);
    assert!(h.decode[0].local.requests().is_empty());

    let req = request("Hello", r#", "edgesplit": {"node": "http://nowhere.test"}"#);
    let e = h
        .pool
        .start(&req, Transport::Phone, "r2")
        .await
        .unwrap_err();
    assert_eq!(e.param.as_deref(), Some("edgesplit.node"), "{e:?}");
    assert!(
        e.message.contains(&url(0)) && e.message.contains(&url(1)),
        "{e:?}"
    );

    // The prefill node alone uses no decode node: naming one is a mistake.
    let req = request(
        "Hello",
        &format!(r#", "edgesplit": {{"node": "{}"}}"#, url(0)),
    );
    let e = h
        .pool
        .start(&req, Transport::Local, "r3")
        .await
        .unwrap_err();
    assert_eq!(e.param.as_deref(), Some("edgesplit.node"), "{e:?}");
    assert!(h.prefill.generate.requests().is_empty());
}

#[tokio::test]
async fn a_node_whose_info_fails_or_shows_another_model_is_left_out_until_it_answers() {
    let h = household(2);
    // Both answer: the first of the equally idle nodes serves.
    h.pool.watch().await;
    phone_answers(&h, 0, 10);
    let _ = phone_on(&h.pool, "r1", 0).await;

    // The first is gone: the second serves.
    h.decode[0].info.set(Err(unavailable()));
    h.pool.watch().await;
    assert!(matches!(h.pool.states()[0].1, NodeState::Down(_)));
    phone_answers(&h, 1, 11);
    let started = phone_on(&h.pool, "r2", 1).await;
    assert_eq!(tokens(&events(started).await), [(11, Node::Decode)]);
    assert_eq!(
        h.decode[0].local.requests().len(),
        1,
        "only r1 went to the first"
    );

    // It is back, and the second now holds another model: the first serves.
    let first_info = FakeDecode::default().info_answer();
    h.decode[0].info.set(Ok(first_info));
    h.decode[1].info.set(Ok(another_model()));
    h.pool.watch().await;
    let states = h.pool.states();
    assert_eq!(states[0].1, NodeState::Ready);
    assert!(
        matches!(&states[1].1, NodeState::Refused(why) if why.contains("another model")),
        "{states:?}"
    );
    phone_answers(&h, 0, 12);
    let _ = phone_on(&h.pool, "r3", 0).await;
    assert_eq!(
        h.decode[1].local.requests().len(),
        1,
        "only r2 went to the second"
    );
}

/// A node that still answers `Info` but goes silent mid-answer (a wedged engine) is found
/// by the answer's idle bound, left out for its hold (`/health`'s `silent`, with why), and
/// taken again when the hold ends.
#[tokio::test(start_paused = true)]
async fn a_node_silent_mid_answer_is_left_out_for_its_hold_though_it_answers_info() {
    let h = household(2);
    h.pool.watch().await;
    h.decode[0].local.then(Ok(vec![
        prefilled(5, 0),
        token(10),
        super::fake::Step::Hang,
    ]));
    h.prefill
        .generate
        .then(Ok(vec![prefilled(7, 7), token(11), finished(1)]));
    let evs = events(phone_on(&h.pool, "r1", 0).await).await;
    assert_eq!(tokens(&evs), [(10, Node::Decode), (11, Node::Prefill)]);
    assert!(
        evs.iter().any(|e| matches!(
            e,
            super::Event::Fallback { cause } if cause == "timeout"
        )),
        "{evs:?}"
    );

    // Its Info still answers, but it is left out: the other node serves.
    h.pool.watch().await;
    let states = h.pool.states();
    assert!(
        matches!(&states[0].1, NodeState::Silent(why) if why.contains("left out for 15s")),
        "{states:?}"
    );
    assert_eq!(states[0].1.as_str(), "silent");
    assert!(h.pool.silent(&url(0)).is_some());
    phone_answers(&h, 1, 12);
    let _ = phone_on(&h.pool, "r2", 1).await;

    // The hold over, it is ready and served first again (the equally idle nodes' first).
    tokio::time::advance(std::time::Duration::from_secs(16)).await;
    h.pool.watch().await;
    assert_eq!(h.pool.states()[0].1, NodeState::Ready);
    phone_answers(&h, 0, 13);
    let evs = events(phone_on(&h.pool, "r3", 0).await).await;
    assert_eq!(tokens(&evs), [(13, Node::Decode)]);
}

/// The pairs of a pool share the prefill node's figures: a pair calibrated after another
/// has measured the prefill node does not probe it again (a probe beside the answers
/// already served would add figures they slowed), and one that finds them unknown does.
#[tokio::test(start_paused = true)]
async fn a_pair_calibrated_beside_a_measured_prefill_node_does_not_probe_it_again() {
    let prefill = Arc::new(FakePrefill::default());
    let first = Backend::with_nodes(
        super::BackendConfig {
            decode_url: url(0),
            ..config(true)
        },
        prefill.clone(),
        Arc::new(FakeDecode::default()),
    );
    let second = first.beside(url(1), Arc::new(FakeDecode::default()));
    // Unknown: the calibration asks the prefill node (its probe is a colocated answer).
    second.calibrate().await;
    assert_eq!(prefill.generate.requests().len(), 1);
    // The first pair measures it; the second sees those figures and leaves it alone.
    {
        let mut l = super::nodes::lock(&first.learned);
        l.rates.prefilled(false, 100, 50.0);
        l.rates.decoded(false, 10, 100.0);
    }
    let m = super::nodes::lock(&second.learned).rates.measured();
    assert_eq!(m.prefill_node_prefill, Some(2.0));
    second.calibrate().await;
    assert_eq!(prefill.generate.requests().len(), 1, "probed again");
}

#[test]
fn another_model_build_cache_type_or_attention_is_refused_and_the_same_is_not() {
    let prefill = pb::NodeInfo {
        model_fingerprint: "m".into(),
        model_id: "m".into(),
        build_id: "b".into(),
        type_k: 1,
        type_v: 1,
        flash_attn: true,
        ..pb::NodeInfo::default()
    };
    let same = pb::NodeInfo {
        role: "decode".into(),
        threads: 8,
        ..prefill.clone()
    };
    assert_eq!(refusal(&prefill, &same), None);
    let cases: [(pb::NodeInfo, &str); 4] = [
        (
            pb::NodeInfo {
                model_fingerprint: "x".into(),
                ..same.clone()
            },
            "another model",
        ),
        (
            pb::NodeInfo {
                build_id: "c".into(),
                ..same.clone()
            },
            "another build",
        ),
        (
            pb::NodeInfo {
                type_v: 8,
                ..same.clone()
            },
            "KV cache type",
        ),
        (
            pb::NodeInfo {
                flash_attn: false,
                ..same.clone()
            },
            "flash attention off",
        ),
    ];
    for (decode, said) in cases {
        let why = refusal(&prefill, &decode).expect("refused");
        assert!(why.contains(said), "{why}");
    }
}

fn choice(mode: Route, predicted: Option<(f64, f64)>) -> Choice {
    Choice {
        mode,
        reason: String::new(),
        predicted: predicted.map(|(e2e_ms, prefill_node_ms)| Cost {
            mode,
            e2e_ms,
            prefill_node_ms,
        }),
        answer_tokens: None,
    }
}

fn candidates<'a>(choices: &'a [Choice], backlogs: &[f64]) -> Vec<Candidate<'a>> {
    choices
        .iter()
        .zip(backlogs)
        .map(|(choice, &decode_node_backlog_ms)| Candidate {
            choice,
            decode_node_backlog_ms,
        })
        .collect()
}

#[test]
fn the_pairs_choices_are_ranked_as_the_objective_ranks_modes() {
    use Objective::{Balanced, Latency, Offload};
    // Nothing predicted anywhere: the least queued decode node.
    let c = [choice(Route::Live, None), choice(Route::Live, None)];
    assert_eq!(best(&candidates(&c, &[300.0, 100.0]), Latency, 0), 1);
    // A node not yet measured, idle, is tried.
    let c = [
        choice(Route::Phone, Some((900.0, 0.0))),
        choice(Route::Live, None),
    ];
    assert_eq!(best(&candidates(&c, &[0.0, 0.0]), Latency, 0), 1);
    // ... but not while it has work queued: the measured one is ranked.
    assert_eq!(best(&candidates(&c, &[0.0, 50.0]), Latency, 0), 0);
    // Latency: the soonest end. Offload: the least prefill-node time within the bound.
    let c = [
        choice(Route::Live, Some((1000.0, 300.0))),
        choice(Route::Phone, Some((1400.0, 0.0))),
        choice(Route::Phone, Some((1600.0, 0.0))),
    ];
    let k = candidates(&c, &[0.0, 0.0, 0.0]);
    assert_eq!(best(&k, Latency, 0), 0);
    assert_eq!(best(&k, Offload, 0), 1);
    // Balanced: latency on an idle prefill node, offload on a busy one.
    assert_eq!(best(&k, Balanced, 0), 0);
    assert_eq!(best(&k, Balanced, 2), 1);
    // Nothing within the bound but the soonest: offload keeps it.
    let c = [
        choice(Route::Live, Some((1000.0, 300.0))),
        choice(Route::Phone, Some((1600.0, 0.0))),
    ];
    assert_eq!(best(&candidates(&c, &[0.0, 0.0]), Offload, 0), 0);
}

#[tokio::test]
async fn a_node_added_while_serving_is_used_and_one_removed_is_not() {
    let h = household(1);
    h.pool.watch().await;
    // Added beside the first (its calibration is off here): asked at once, ready.
    let added = Arc::new(FakeDecode::default());
    let b = h.pool.first().beside(url(1), added.clone());
    assert_eq!(h.pool.adopt(b).await.unwrap(), NodeState::Ready);
    assert_eq!(h.pool.urls(), [url(0), url(1)]);
    // Twice is refused, naming the field.
    let again = h.pool.first().beside(url(1), added.clone());
    let e = h.pool.adopt(again).await.unwrap_err();
    assert_eq!(e.param.as_deref(), Some("url"), "{e:?}");
    // The first is busy with a `phone` answer: the next `phone` answer goes to the added node.
    h.decode[0].local.then(Ok(vec![
        prefilled(5, 0),
        token(10),
        super::fake::Step::Wait(std::time::Duration::from_millis(300)),
        finished(1),
    ]));
    let busy = phone_on(&h.pool, "r1", 0).await;
    added
        .local
        .then(Ok(vec![prefilled(5, 0), token(11), finished(1)]));
    let started = phone_on(&h.pool, "r2", 1).await;
    assert_eq!(tokens(&events(started).await), [(11, Node::Decode)]);
    assert_eq!(tokens(&events(busy).await), [(10, Node::Decode)]);
    // Removed: not used again.
    h.pool.remove(&url(1)).unwrap();
    assert_eq!(h.pool.urls(), [url(0)]);
    let e = h.pool.remove(&url(1)).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("url"), "{e:?}");
    phone_answers(&h, 0, 12);
    let _ = phone_on(&h.pool, "r3", 0).await;
    assert_eq!(added.local.requests().len(), 1);
    // The last one too: the pool is empty, a request that needs a decode node is told so,
    // and one that names a node is a 400 naming the field.
    h.pool.remove(&url(0)).unwrap();
    assert!(h.pool.is_empty());
    let e = h
        .pool
        .start(&request("Hi", ""), Transport::Phone, "r4")
        .await
        .err()
        .unwrap();
    assert!(e.message.contains("no decode node"), "{e:?}");
    let named = request("Hi", &format!(r#", "edgesplit": {{"node": "{}"}}"#, url(0)));
    let e = h
        .pool
        .start(&named, Transport::Auto, "r5")
        .await
        .err()
        .unwrap();
    assert_eq!(e.param.as_deref(), Some("edgesplit.node"), "{e:?}");
}
