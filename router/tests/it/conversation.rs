//! A conversation goes on where it is held. The decode node keeps each
//! conversation it wrote; the next turn is prefilled there (only its new part) and nothing
//! crosses the link. Each answer is token for token what one device answers under the same
//! reuse of its cache: continuing its own copy of the conversation (`local`, whose prefill
//! node keeps it) when the decode node continued one, and from scratch (`cache_prompt:
//! false`) when the prompt was prefilled on the prefill node (which reuses only what makes
//! no difference). Each test has a stack of its own: other tests' requests would evict.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::common::{self, run_reporting, Outcome, Stack};

/// Its live answers are short (24 tokens): paced, so that they reach the decode node.
fn stack() -> Stack {
    common::start(common::StackOptions::new(common::SMOLLM2).paced())
}

fn greedy() -> Value {
    json!({"temperature": 0, "max_tokens": 24})
}

fn seeded() -> Value {
    json!({"temperature": 0.9, "top_p": 0.95, "seed": 17, "max_tokens": 24,
           "logprobs": true, "top_logprobs": 2})
}

/// One turn: the answer and the `edgesplit` object.
async fn turn(s: &Stack, messages: &Value, sampling: &Value, transport: &str) -> (Outcome, Value) {
    let body = common::chat_body(messages.clone(), sampling.clone());
    run_reporting(s, "/v1/chat/completions", &body, transport, false).await
}

/// The same turn on one device from scratch (no cached KV reused).
async fn uncached(s: &Stack, messages: &Value, sampling: &Value) -> Outcome {
    let mut sampling = sampling.clone();
    sampling["cache_prompt"] = json!(false);
    let (o, e) = turn(s, messages, &sampling, "local").await;
    assert_eq!(e["cached_tokens"], 0, "{e}");
    o
}

/// `messages`, the assistant's `answer`, and the user's next `question`.
fn next(messages: &Value, answer: &str, question: &str) -> Value {
    let mut m = messages.as_array().unwrap().clone();
    m.push(json!({"role": "assistant", "content": answer}));
    m.push(json!({"role": "user", "content": question}));
    Value::Array(m)
}

/// The decode node continued the conversation: nothing crossed, and it wrote every token
/// of the answer, the first one included.
fn decode_node_continued(e: &Value, completion_tokens: u64) {
    assert_eq!(e["placement"], "decode_node", "{e}");
    assert!(e["handoff_bytes"].is_null(), "no state crossed: {e}");
    common::assert_split(e, completion_tokens);
}

const QUESTIONS: [&str; 3] = [
    "Name two rivers of Europe.",
    "Which of them is longer?",
    "Say it again in one short sentence.",
];

/// Three turns, split and local side by side: from the second on, the decode node
/// continues the conversation, reusing more than the previous turn's prompt, and the
/// answer is the local one (which continued its own copy).
async fn goes_on_as_on_one_device(s: &Stack, sampling: &Value, transport: &str) {
    let mut messages = json!([{"role": "user", "content": QUESTIONS[0]}]);
    let mut previous_prompt = 0;
    for i in 1..=QUESTIONS.len() {
        let (local, le) = turn(s, &messages, sampling, "local").await;
        let (split, se) = turn(s, &messages, sampling, transport).await;
        let what = format!("turn {i} over {transport}, sampling {sampling}");
        assert_eq!(split, local, "{what}");
        if i == 1 {
            assert_eq!(se["placement"], "prefill_node", "{what}: {se}");
            common::assert_split(&se, split.completion_tokens);
        } else {
            decode_node_continued(&se, split.completion_tokens);
            let cached = se["cached_tokens"].as_u64().unwrap();
            assert!(
                cached > previous_prompt,
                "{what}: {cached} cached, {previous_prompt} in the turn before's prompt"
            );
            assert_eq!(se["cached_tokens"], le["cached_tokens"], "{what}: {le}");
        }
        previous_prompt = split.prompt_tokens;
        if let Some(question) = QUESTIONS.get(i) {
            messages = next(&messages, &local.text, question);
        }
    }
}

#[tokio::test]
async fn a_conversation_goes_on_on_the_decode_node_as_on_one_device() {
    let s = stack();
    goes_on_as_on_one_device(&s, &greedy(), "v2").await;
    goes_on_as_on_one_device(&s, &seeded(), "v2-live").await;
    goes_on_as_on_one_device(&s, &greedy(), "v1").await;
    // The decode node's figures: hits, reused tokens, what it keeps.
    let text = reqwest::get(&s.decode_metrics)
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let value = |name: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("{name} missing:\n{text}"))
    };
    assert!(value("edgesplit:prefix_cache_hits_total") >= 6, "{text}");
    assert!(value("edgesplit:prefix_cache_reused_tokens_total") > 0);
    assert!(value("edgesplit:prefix_cache_tokens") > 0);
    assert!(value("edgesplit:prefix_cache_bytes") > 0);
}

/// The usage object says what was reused, as OpenAI's does.
#[tokio::test]
async fn usage_reports_the_cached_tokens() {
    let s = stack();
    let messages = json!([{"role": "user", "content": QUESTIONS[0]}]);
    let (first, e) = turn(&s, &messages, &greedy(), "v2").await;
    common::assert_split(&e, first.completion_tokens);
    let body = common::chat_body(next(&messages, &first.text, QUESTIONS[1]), greedy());
    let (status, _, v) = common::post(&format!("{}/v1/chat/completions", s.router), &body).await;
    assert_eq!(status, 200, "{v}");
    decode_node_continued(
        &v["edgesplit"],
        v["usage"]["completion_tokens"].as_u64().unwrap(),
    );
    let cached = &v["usage"]["prompt_tokens_details"]["cached_tokens"];
    assert!(
        cached.as_u64().is_some_and(|c| c >= first.prompt_tokens),
        "{v}"
    );
    assert_eq!(cached, &v["edgesplit"]["cached_tokens"]);
    assert_eq!(v["edgesplit"]["placement"], "decode_node");
}

/// An edited earlier message, or a conversation the decode node no longer holds: the
/// prompt is prefilled on the prefill node, and the answer is the uncached one.
#[tokio::test]
async fn an_edited_or_evicted_conversation_is_prefilled_again() {
    let s = stack();
    let messages = json!([{"role": "user", "content": QUESTIONS[0]}]);
    let (first, e) = turn(&s, &messages, &greedy(), "v2").await;
    common::assert_split(&e, first.completion_tokens);
    let edited = next(
        &json!([{"role": "user", "content": "Name two rivers of Asia."}]),
        &first.text,
        QUESTIONS[1],
    );
    let (split, e) = turn(&s, &edited, &greedy(), "v2").await;
    assert_eq!(e["placement"], "prefill_node", "{e}");
    common::assert_split(&e, split.completion_tokens);
    assert_eq!(split, uncached(&s, &edited, &greedy()).await, "edited");
    // The test stack's decode node keeps two sequences: two other answers push the
    // conversation out (least recently used first).
    for q in ["Count to five.", "Name a colour."] {
        turn(
            &s,
            &json!([{"role": "user", "content": q}]),
            &greedy(),
            "v2",
        )
        .await;
    }
    let going_on = next(&messages, &first.text, QUESTIONS[1]);
    let (split, e) = turn(&s, &going_on, &greedy(), "v2").await;
    assert_eq!(
        e["placement"], "prefill_node",
        "the decode node no longer holds it: {e}"
    );
    common::assert_split(&e, split.completion_tokens);
    assert_eq!(split, uncached(&s, &going_on, &greedy()).await, "evicted");
    // Remembered again: the turn after goes on on the decode node.
    let (local, _) = turn(&s, &going_on, &greedy(), "local").await;
    assert_eq!(split, local);
    let third = next(&going_on, &split.text, QUESTIONS[2]);
    let (a3, e) = turn(&s, &third, &greedy(), "v2").await;
    decode_node_continued(&e, a3.completion_tokens);
}

/// Two clients continue the same conversation at once: one continues the decode node's
/// copy, the other (the copy is taken) is prefilled on the prefill node; each gets the
/// answer one device gives under the same reuse (continuing the conversation, or from
/// scratch).
#[tokio::test]
async fn two_clients_going_on_at_once_each_get_their_answer() {
    let s = stack();
    let messages = json!([{"role": "user", "content": QUESTIONS[0]}]);
    let (local1, _) = turn(&s, &messages, &greedy(), "local").await;
    let (split1, e1) = turn(&s, &messages, &greedy(), "v2").await;
    common::assert_split(&e1, split1.completion_tokens);
    assert_eq!(split1, local1);
    let going_on = next(&messages, &local1.text, QUESTIONS[1]);
    let (continued, le) = turn(&s, &going_on, &greedy(), "local").await;
    assert!(le["cached_tokens"].as_u64().unwrap() > local1.prompt_tokens);
    let scratch = uncached(&s, &going_on, &greedy()).await;
    let g = greedy();
    let (a, b) = tokio::join!(turn(&s, &going_on, &g, "v2"), turn(&s, &going_on, &g, "v2"));
    let mut placements = Vec::new();
    for (answer, e) in [a, b] {
        let reference = if e["cached_tokens"] == le["cached_tokens"] {
            &continued
        } else {
            assert_eq!(e["placement"], "prefill_node", "{e}");
            &scratch
        };
        // Each one's writer is the one its placement names (the decode node took it
        // whole, or it was split to it after its first token).
        common::assert_split(&e, answer.completion_tokens);
        assert_eq!(&answer, reference, "{e}");
        placements.push(e["placement"].as_str().unwrap().to_string());
    }
    assert!(
        placements.contains(&"decode_node".to_string()),
        "{placements:?}"
    );
}

/// A live answer that ends before its state has crossed stays on the prefill node, whose
/// slot then holds the whole conversation: the next turn's split prefill continues it
/// there, as one device continues its own.
#[tokio::test]
async fn a_conversation_the_prefill_node_ended_goes_on_there() {
    fn slow_link(target: String) -> String {
        common::shaped(target, || common::Shape::rate(200_000))
    }
    let mut o = common::StackOptions::new(common::SMOLLM2);
    o.handoff_proxy = Some(slow_link);
    let s = common::start(o);
    let sampling = json!({"temperature": 0, "max_tokens": 12});
    let messages = json!([{"role": "user", "content": QUESTIONS[0]}]);
    let (local, _) = turn(&s, &messages, &sampling, "local").await;
    let (split, e) = turn(&s, &messages, &sampling, "v2-live").await;
    assert_eq!(split, local);
    assert!(
        e["switch_ms"].is_null() && e["prefill_tokens"] == split.completion_tokens,
        "the answer ended on the prefill node: {e}"
    );
    let going_on = next(&messages, &local.text, QUESTIONS[1]);
    let (local2, le) = turn(&s, &going_on, &sampling, "local").await;
    let (split2, e) = turn(&s, &going_on, &sampling, "v2-live").await;
    assert_eq!(e["placement"], "prefill_node", "{e}");
    assert!(
        le["cached_tokens"].as_u64().unwrap() > local.prompt_tokens,
        "{le}"
    );
    assert_eq!(e["cached_tokens"], le["cached_tokens"], "{e}");
    assert_eq!(split2, local2);
}

/// A live answer that ends before its state has crossed is handed over after it all the
/// same (`Handoff.keep`): the piece on its way is finished, the state written since goes
/// last, and the decode node takes it into its cache. Once it holds it, the next turn goes
/// on there with nothing crossing, as one device continues its own copy: seeded, with
/// log-probabilities, on both model families (Gemma-3's sliding-window state too).
/// `cache_prompt: false` keeps nothing there.
async fn a_live_answer_that_ended_first_is_kept(model: &'static str) {
    // 200 kB/s: a state of ~650 kB takes ~3 s to cross, and 8 tokens end first even on a
    // loaded 2-core machine that writes 8 a second (at 1 MB/s, one such CI run switched).
    fn slow_link(target: String) -> String {
        common::shaped(target, || common::Shape::rate(200_000))
    }
    let mut o = common::StackOptions::new(model);
    o.handoff_proxy = Some(slow_link);
    let s = common::start(o);
    let decode_cached = || async {
        let status = common::get_json(&format!("{}/dashboard/api/status", s.router)).await;
        status["decode"]["cached_tokens"].as_u64().unwrap()
    };
    let sampling = json!({"temperature": 0.9, "top_p": 0.95, "seed": 23, "max_tokens": 8,
                          "logprobs": true, "top_logprobs": 2});
    let ended_first = |e: &Value, n: u64| {
        assert!(
            e["switch_ms"].is_null() && e["prefill_tokens"] == n,
            "the answer ended on the prefill node: {e}"
        );
    };
    // Not kept when the request does not allow its prompt cache.
    let mut uncached = sampling.clone();
    uncached["cache_prompt"] = json!(false);
    let first = json!([{"role": "user", "content": "Name a large city of Asia."}]);
    let (split, e) = turn(&s, &first, &uncached, "v2-live").await;
    ended_first(&e, split.completion_tokens);
    let uncached_held = split.prompt_tokens + split.completion_tokens - 1;

    let messages = json!([{"role": "user", "content": QUESTIONS[0]}]);
    let (local, _) = turn(&s, &messages, &sampling, "local").await;
    let (split, e) = turn(&s, &messages, &sampling, "v2-live").await;
    assert_eq!(split, local);
    ended_first(&e, split.completion_tokens);
    let held = split.prompt_tokens + split.completion_tokens - 1;
    let t0 = Instant::now();
    while decode_cached().await < held {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the decode node never held the conversation ({} of {held} tokens)",
            decode_cached().await
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Only this conversation is held: the uncached answer's state was not kept. (Had the
    // router asked to keep it, its rest would have crossed first: it ended two answers
    // earlier, over the same link, and is about as large; both would fit the decode
    // node's two slots, and its cached tokens count every slot.)
    let cached = decode_cached().await;
    assert_eq!(
        cached, held,
        "kept without the prompt cache ({uncached_held} tokens)?"
    );
    let going_on = next(&messages, &local.text, QUESTIONS[1]);
    let (local2, le) = turn(&s, &going_on, &sampling, "local").await;
    let (split2, e) = turn(&s, &going_on, &sampling, "v2-live").await;
    decode_node_continued(&e, split2.completion_tokens);
    assert_eq!(e["cached_tokens"], le["cached_tokens"], "{e}");
    assert_eq!(split2, local2);
}

#[tokio::test]
async fn a_live_answer_that_ended_first_is_kept_on_the_decode_node() {
    a_live_answer_that_ended_first_is_kept(common::SMOLLM2).await;
}

#[tokio::test]
async fn a_sliding_window_live_answer_that_ended_first_is_kept_on_the_decode_node() {
    a_live_answer_that_ended_first_is_kept(common::GEMMA3).await;
}

/// A decode node whose chat template is not the prefill node's (another
/// `--chat-template-file`) would render the next turn as another prompt: here the two
/// templates render the first turn and its answer alike and a later user message
/// differently, so the decode node's cache would serve the prefix and its prompt would
/// not be the prefill node's. The router does not let it continue the chat: the turn is
/// split, and the answer is the one-device answer.
#[tokio::test]
async fn a_decode_node_with_another_template_does_not_continue_a_chat() {
    const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'user' and not loop.first %}{{ MARK }}{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    let dir = common::stock::tempdir("two-templates");
    let file = |name: &str, mark: &str| {
        let p = dir.join(name);
        std::fs::write(&p, CHATML.replace("{{ MARK }}", mark)).unwrap();
        p
    };
    let s = common::start(common::StackOptions {
        chat_template_file: Some(file("plain.jinja", "")),
        decode_chat_template_file: Some(file("marked.jinja", "Question: ")),
        ..common::StackOptions::new(common::SMOLLM2)
    });
    let fingerprint = |i: edgesplit_proto::pb::NodeInfo| i.chat_template_fingerprint;
    let decode = fingerprint(common::decode_info(&s.decode_grpc).await);
    let mut prefill =
        edgesplit_proto::pb::prefill_client::PrefillClient::connect(s.prefill_grpc.clone())
            .await
            .unwrap();
    let prefill = fingerprint(
        prefill
            .info(edgesplit_proto::pb::InfoRequest {})
            .await
            .unwrap()
            .into_inner(),
    );
    assert!(!decode.is_empty() && !prefill.is_empty() && decode != prefill);
    let sampling = greedy();
    let messages = json!([{"role": "user", "content": QUESTIONS[0]}]);
    let (first, e) = turn(&s, &messages, &sampling, "v2").await;
    common::assert_split(&e, first.completion_tokens);
    let going_on = next(&messages, &first.text, QUESTIONS[1]);
    let (second, e) = turn(&s, &going_on, &sampling, "v2").await;
    assert_eq!(e["placement"], "prefill_node", "{e}");
    common::assert_split(&e, second.completion_tokens);
    assert_eq!(second, uncached(&s, &going_on, &sampling).await);
}

/// `cache_prompt: false` reuses nothing, on the decode node neither: the turn is split.
#[tokio::test]
async fn cache_prompt_false_reuses_nothing() {
    let s = stack();
    let messages = json!([{"role": "user", "content": QUESTIONS[0]}]);
    let (first, e) = turn(&s, &messages, &greedy(), "v2").await;
    common::assert_split(&e, first.completion_tokens);
    let mut sampling = greedy();
    sampling["cache_prompt"] = json!(false);
    let going_on = next(&messages, &first.text, QUESTIONS[1]);
    let (split, e) = turn(&s, &going_on, &sampling, "v2").await;
    assert_eq!(e["placement"], "prefill_node", "{e}");
    assert_eq!(e["cached_tokens"], 0, "{e}");
    common::assert_split(&e, split.completion_tokens);
    assert_eq!(split, uncached(&s, &going_on, &greedy()).await);
    let body = common::chat_body(messages, json!({"cache_prompt": "yes"}));
    let (status, _, v) = common::post(&format!("{}/v1/chat/completions", s.router), &body).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "cache_prompt");
}

/// Gemma-3 (a sliding-window model; raw completions): a text that goes on from the decode
/// node's answer is continued there, as `local` continues its own copy. Its cache is a ring
/// that cannot be cut back, so only a text that extends everything held is continued.
#[tokio::test]
async fn a_sliding_window_models_text_goes_on_on_the_decode_node() {
    let s = common::start(common::StackOptions::new(common::GEMMA3));
    let body = |prompt: &str| json!({"prompt": prompt, "max_tokens": 24, "temperature": 0});
    let first = "The harbour was quiet in the early morning, and the fishermen were already \
                 mending their nets on the stones. "
        .repeat(12);
    let path = "/v1/completions";
    let (local, _) = run_reporting(&s, path, &body(&first), "local", false).await;
    let (split, e) = run_reporting(&s, path, &body(&first), "v2", false).await;
    assert_eq!(split, local);
    assert_eq!(e["placement"], "prefill_node", "{e}");
    let second = format!("{first}{} Then the boats went out.", local.text);
    let (local2, le) = run_reporting(&s, path, &body(&second), "local", false).await;
    let (split2, e) = run_reporting(&s, path, &body(&second), "v2", false).await;
    decode_node_continued(&e, split2.completion_tokens);
    assert!(
        e["cached_tokens"].as_u64().unwrap() > local.prompt_tokens,
        "{e}"
    );
    assert_eq!(e["cached_tokens"], le["cached_tokens"], "{le}");
    assert_eq!(split2, local2);
}

/// While set, the router's calls to the decode node of [`passed_over`]'s stack get no
/// answer: nothing more crosses the control link towards the decode node.
static HOLD: AtomicBool = AtomicBool::new(false);

fn holding(target: String) -> String {
    common::shaped(target, || common::Shape {
        faults: common::Faults {
            hold: Some(|| HOLD.load(Ordering::SeqCst)),
            ..common::Faults::default()
        },
        ..common::Shape::rate(0)
    })
}

/// A decode node that holds the conversation but does not answer the `Local` call: the
/// router gives up on it within its `Info` bound (3 s) instead of waiting, and the turn
/// is answered without it (the request's own `Info` goes unanswered too: the prefill node
/// answers, `decode_unavailable`), equal to the one-device answer from scratch.
#[tokio::test]
async fn a_decode_node_that_does_not_answer_is_passed_over() {
    let mut o = common::StackOptions::new(common::SMOLLM2);
    o.decode_proxy = Some(holding);
    let s = common::start(o);
    let first = json!([{"role": "user", "content": QUESTIONS[0]}]);
    let (a1, e1) = turn(&s, &first, &greedy(), "v2").await;
    common::assert_split(&e1, a1.completion_tokens);
    let second = next(&first, &a1.text, QUESTIONS[1]);
    HOLD.store(true, Ordering::SeqCst);
    let t0 = Instant::now();
    let (a2, e2) = turn(&s, &second, &greedy(), "v2").await;
    let took = t0.elapsed();
    HOLD.store(false, Ordering::SeqCst);
    assert_eq!(e2["placement"], "prefill_node", "{e2}");
    assert_eq!(e2["fallback"], "decode_unavailable", "{e2}");
    assert_eq!(e2["first_token_from"], "prefill", "{e2}");
    assert_eq!(e2["decode_node_tokens"], 0, "{e2}");
    // The `Local` call's bound, then the split's `Info` (overlapped with its prefill).
    assert!(took < Duration::from_secs(9), "{took:?}: {e2}");
    assert_eq!(a2, uncached(&s, &second, &greedy()).await);
}

/// A stack whose router sends every new turn of a held conversation to the prefill node
/// (`--continue-on prefill-node`: what the measured rule picks where the prefill device is
/// much faster than the decode device; on this machine's two nodes it never is).
fn prefill_node_stack() -> Stack {
    let mut o = common::StackOptions::new(common::SMOLLM2);
    o.continue_on = edgesplit_router::backend::ContinueOn::PrefillNode;
    common::start(o)
}

/// A new turn prefilled on the prefill node ships only its new part's KV (a tail): the
/// prefill node replayed the decode node's answer after it (so it holds the
/// conversation as the decode node does), prefills the new part from the same cut as
/// `local` continuing its own copy, and the decode node joins the tail onto its copy
/// after checking that copy's bytes (SHA-256). Each turn is `local`'s, greedy and seeded
/// with log-probabilities; the references come from a stack of their own, so that
/// nothing but the replay gives the split's prefill node the answers' KV.
#[tokio::test]
async fn a_new_turn_on_the_prefill_node_ships_only_its_new_part() {
    let s = prefill_node_stack();
    let reference = stack();
    let per_token = common::decode_info(&s.decode_grpc).await.kv_bytes_per_token;
    for sampling in [greedy(), seeded()] {
        let mut messages = json!([{"role": "user", "content": QUESTIONS[0]}]);
        for i in 1..=QUESTIONS.len() {
            let (local, le) = turn(&reference, &messages, &sampling, "local").await;
            let (split, se) = turn(&s, &messages, &sampling, "v2-live").await;
            let what = format!("turn {i}, sampling {sampling}: {se}");
            assert_eq!(split, local, "{what}");
            assert_eq!(se["placement"], "prefill_node", "{what}");
            common::assert_split(&se, split.completion_tokens);
            let bytes = se["handoff_bytes"].as_u64().unwrap();
            let whole = split.prompt_tokens * per_token;
            if i == 1 {
                assert!(bytes >= whole, "{what}");
            } else {
                // The same cut as one device continuing its own copy: the answers before
                // were replayed, not prefilled.
                assert_eq!(se["cached_tokens"], le["cached_tokens"], "{what}");
                let cached = se["cached_tokens"].as_u64().unwrap();
                assert!(cached > 0, "{what}");
                // Only the cells from the cut on crossed: the new part and the tokens
                // the prefill node wrote before the switch (plus the state's headers).
                let crossed = split.prompt_tokens - cached + se["prefill_tokens"].as_u64().unwrap();
                assert!(
                    bytes <= crossed * per_token + 4096 && bytes < whole / 2,
                    "{what}: {bytes} bytes for {crossed} tokens of {per_token} bytes"
                );
            }
            // The answer is replayed on the prefill node before the next turn.
            common::wait_prefill_idle(&s).await;
            if let Some(question) = QUESTIONS.get(i) {
                messages = next(&messages, &local.text, question);
            }
        }
    }
}

/// Under `auto`, a conversation both nodes hold (the prefill node replayed the decode
/// node's answer) goes where the cost model finds it ends soonest: with the decode node
/// busy writing a long answer, the prefill node answers the next turn alone, only its new
/// part prefilled there (`local` on its replayed copy); the turn after, the decode node's
/// copy lacks that turn's answer, so it is not continued there (which would prefill an
/// answer one device decoded) but on the prefill node, alone or as a tail. Every turn is
/// `local`'s on a stack of its own.
#[tokio::test]
async fn auto_answers_a_held_turn_on_the_prefill_node_while_its_decode_node_is_busy() {
    let s = prefill_node_stack();
    let reference = stack();
    // Every rate measured, on a prompt of its own.
    let other =
        json!([{"role": "user", "content": "Write a long story about a lighthouse keeper."}]);
    let mut uncached = greedy();
    uncached["cache_prompt"] = json!(false);
    for t in ["local", "v2", "phone"] {
        turn(&s, &other, &uncached, t).await;
    }
    let mut messages = json!([{"role": "user", "content": QUESTIONS[0]}]);
    let (a1, e1) = turn(&s, &messages, &greedy(), "v2-live").await;
    common::assert_split(&e1, a1.completion_tokens);
    let (l1, _) = turn(&reference, &messages, &greedy(), "local").await;
    assert_eq!(a1, l1, "{e1}");
    common::wait_prefill_idle(&s).await;

    // The decode node writes 400 tokens meanwhile.
    let mut long = uncached.clone();
    long["max_tokens"] = json!(400);
    let busy = {
        let (router, body) = (s.router.clone(), common::chat_body(other.clone(), long));
        tokio::spawn(async move {
            let mut body = body;
            body["edgesplit"] = json!({"transport": "phone"});
            common::post(&format!("{router}/v1/chat/completions"), &body).await
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    messages = next(&messages, &l1.text, QUESTIONS[1]);
    let latency = |mut b: Value| {
        b["edgesplit"] =
            json!({"transport": "auto", "objective": "latency", "return_token_ids": true});
        b
    };
    let body = latency(common::chat_body(messages.clone(), greedy()));
    let (a2, e2) = common::send(&s, "/v1/chat/completions", &body, false).await;
    let (l2, _) = turn(&reference, &messages, &greedy(), "local").await;
    assert_eq!(a2, l2, "{e2}");
    assert_eq!(e2["mode"], "local", "{e2}");
    assert!(
        e2["reason"].as_str().unwrap().contains("both nodes hold"),
        "{e2}"
    );
    assert!(e2["cached_tokens"].as_u64().unwrap() > 0, "{e2}");
    let (st, _, v) = busy.await.unwrap();
    assert_eq!(st, 200, "{v}");

    messages = next(&messages, &l2.text, QUESTIONS[2]);
    let body = latency(common::chat_body(messages.clone(), greedy()));
    let (a3, e3) = common::send(&s, "/v1/chat/completions", &body, false).await;
    let (l3, _) = turn(&reference, &messages, &greedy(), "local").await;
    assert_eq!(a3, l3, "{e3}");
    assert_eq!(e3["placement"], "prefill_node", "{e3}");
    assert_ne!(e3["mode"], "phone", "{e3}");
}

/// The decode node no longer holds the conversation a tail goes on from: it refuses to
/// join it (nothing imported), and the prefill node finishes the answer from its own
/// copy - `local`'s answer all the same, reported as a fallback.
#[tokio::test]
async fn a_tail_whose_prefix_the_decode_node_lost_is_finished_on_the_prefill_node() {
    let s = prefill_node_stack();
    let reference = stack();
    let sampling = greedy();
    let messages = json!([{"role": "user", "content": QUESTIONS[0]}]);
    let (first, _) = turn(&s, &messages, &sampling, "v2-live").await;
    common::wait_prefill_idle(&s).await;
    // The test stack's decode node keeps two sequences: two other answers push the
    // conversation out (least recently used first); their own replays are waited for.
    for q in ["Count to five.", "Name a colour."] {
        let m = json!([{"role": "user", "content": q}]);
        turn(
            &s,
            &m,
            &json!({"temperature": 0, "max_tokens": 24, "cache_prompt": false}),
            "v2-live",
        )
        .await;
    }
    common::wait_prefill_idle(&s).await;
    turn(&reference, &messages, &sampling, "local").await;
    let going_on = next(&messages, &first.text, QUESTIONS[1]);
    let (local, _) = turn(&reference, &going_on, &sampling, "local").await;
    let (split, e) = turn(&s, &going_on, &sampling, "v2-live").await;
    assert_eq!(split, local, "{e}");
    assert_eq!(e["placement"], "prefill_node", "{e}");
    assert_eq!(
        e["fallback"], "tail_base_missing",
        "the decode node cannot join the tail: {e}"
    );
}

/// A short answer on a slow link ends on the prefill node before its tail has crossed: the
/// tail is kept on the decode node after the answer (joined onto its copy, whose bytes it
/// checks), so the decode node then holds the whole conversation, and the turn after goes
/// on from that copy; every turn is `local`'s, and from turn 2 only the cells from the cut
/// cross.
#[tokio::test]
async fn a_tail_whose_answer_ended_first_is_kept_on_the_decode_node() {
    fn slow_link(target: String) -> String {
        common::shaped(target, || common::Shape::rate(300_000))
    }
    let mut o = common::StackOptions::new(common::SMOLLM2);
    o.continue_on = edgesplit_router::backend::ContinueOn::PrefillNode;
    o.handoff_proxy = Some(slow_link);
    let s = common::start(o);
    let reference = stack();
    let per_token = common::decode_info(&s.decode_grpc).await.kv_bytes_per_token;
    let decode_cached = || async {
        let status = common::get_json(&format!("{}/dashboard/api/status", s.router)).await;
        status["decode"]["cached_tokens"].as_u64().unwrap()
    };
    let kept_bytes = || async {
        let text = common::scrape(&s.prefill_metrics).await;
        common::value(
            &text,
            "edgesplit:handoff_bytes_total{transport=\"v2-kept\"}",
        ) as u64
    };
    let sampling = json!({"temperature": 0, "max_tokens": 8});
    let mut messages = json!([{"role": "user", "content": QUESTIONS[0]}]);
    for i in 1..=QUESTIONS.len() {
        let before = kept_bytes().await;
        let (local, le) = turn(&reference, &messages, &sampling, "local").await;
        let (split, e) = turn(&s, &messages, &sampling, "v2-live").await;
        let what = format!("turn {i}: {e}");
        assert_eq!(split, local, "{what}");
        assert!(e["fallback"].is_null(), "{what}");
        assert!(
            e["switch_ms"].is_null() && e["prefill_tokens"] == split.completion_tokens,
            "the answer ended on the prefill node: {what}"
        );
        // Kept after the answer: the decode node holds the prompt and the answer.
        let held = split.prompt_tokens + split.completion_tokens - 1;
        let t0 = Instant::now();
        while decode_cached().await < held {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "{what}: the decode node never held the turn ({} of {held} tokens)",
                decode_cached().await
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        if i > 1 {
            assert_eq!(e["cached_tokens"], le["cached_tokens"], "{what}");
            let cut = e["cached_tokens"].as_u64().unwrap();
            let kept = kept_bytes().await - before;
            assert!(
                kept > 0 && kept <= (held - cut) * per_token + 4096,
                "{what}: {kept} bytes kept for {} tokens from the cut",
                held - cut
            );
        }
        if let Some(question) = QUESTIONS.get(i) {
            messages = next(&messages, &local.text, question);
        }
    }
}

/// A sliding-window model's state is not cut into tails: with every new turn sent to the
/// prefill node, Gemma-3's turn is split whole (its whole state crosses), the prefill node
/// having kept nothing of the handed-over ring and replayed nothing, so the answer is the
/// uncached one.
#[tokio::test]
async fn a_sliding_window_models_new_turn_on_the_prefill_node_is_split_whole() {
    let mut o = common::StackOptions::new(common::GEMMA3);
    o.continue_on = edgesplit_router::backend::ContinueOn::PrefillNode;
    let s = common::start(o);
    let per_token = common::decode_info(&s.decode_grpc).await.kv_bytes_per_token;
    let sampling = json!({"temperature": 0, "max_tokens": 24});
    let messages = json!([{"role": "user", "content": QUESTIONS[0]}]);
    let (first, e) = turn(&s, &messages, &sampling, "v2-live").await;
    common::assert_split(&e, first.completion_tokens);
    common::wait_prefill_idle(&s).await;
    let going_on = next(&messages, &first.text, QUESTIONS[1]);
    let (split, e) = turn(&s, &going_on, &sampling, "v2-live").await;
    assert_eq!(e["placement"], "prefill_node", "{e}");
    common::assert_split(&e, split.completion_tokens);
    assert_eq!(e["cached_tokens"], 0, "{e}");
    // The whole prompt's state crossed (a sliding window exports only its window, so
    // less than prompt x KV bytes per token, but more than any tail of the new part).
    let new_part = split.prompt_tokens - first.prompt_tokens - first.completion_tokens;
    assert!(
        e["handoff_bytes"].as_u64().unwrap() > (new_part + 24) * per_token,
        "{e}"
    );
    assert_eq!(split, uncached(&s, &going_on, &sampling).await);
}
