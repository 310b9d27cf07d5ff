//! Log-probabilities in OpenAI's shapes. Each token's log-probability is the log
//! of its softmax probability over the raw logits (before any sampler, as llama-server
//! reports by default), with the most likely alternatives; the node that sampled the token
//! computes it, so a split answer's values are the one-device answer's, bit for bit. The
//! identity tests (fidelity.rs, gemma.rs) ask for them in their seeded samplings; here,
//! what they mean.

use crate::common::{self, Outcome};
use serde_json::{json, Value};

/// `local` once (the reference), then every split transport, streamed or not: the same.
async fn same_on_every_transport(path: &str, body: &Value) -> Outcome {
    common::same_on_every_transport(common::smollm2(), path, body).await
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

#[tokio::test]
async fn chat_logprobs_describe_the_answer_and_do_not_depend_on_the_transport() {
    for (sampling, greedy) in [
        (json!({"temperature": 0}), true),
        (json!({"temperature": 1.0, "seed": 7}), false),
    ] {
        let mut body = common::chat_body(
            json!([{"role": "user", "content": "Write one sentence about the sea."}]),
            sampling,
        );
        body["max_tokens"] = json!(24);
        body["logprobs"] = json!(true);
        body["top_logprobs"] = json!(3);
        let o = same_on_every_transport("/v1/chat/completions", &body).await;
        let content = o.logprobs["content"].as_array().unwrap();
        // One entry per token but an end-of-generation one, whose text is empty.
        let eog = u64::from(o.finish_reason == "stop");
        assert_eq!(content.len() as u64, o.completion_tokens - eog, "{o:?}");
        let bytes: Vec<u8> = content
            .iter()
            .flat_map(|e| e["bytes"].as_array().unwrap().iter())
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        assert_eq!(String::from_utf8(bytes).unwrap(), o.text);
        let mut below_top = 0;
        for e in content {
            let lp = f(&e["logprob"]);
            assert!(lp <= 0.0, "{e}");
            let top = e["top_logprobs"].as_array().unwrap();
            assert_eq!(top.len(), 3, "{e}");
            assert!(top
                .windows(2)
                .all(|w| f(&w[0]["logprob"]) >= f(&w[1]["logprob"])));
            let mass: f64 = top.iter().map(|t| f(&t["logprob"]).exp()).sum();
            assert!(mass <= 1.0 + 1e-5, "{e}");
            assert!(lp <= f(&top[0]["logprob"]), "{e}");
            if greedy {
                // Greedy takes the most likely token: the first alternative is itself.
                assert_eq!(top[0]["token"], e["token"], "{e}");
                assert_eq!(top[0]["logprob"], e["logprob"], "{e}");
            } else if lp < f(&top[0]["logprob"]) {
                below_top += 1;
            }
        }
        // At temperature 1 some tokens are not the most likely one (else the sampler, or
        // the check, would be greedy in disguise).
        assert!(greedy || below_top > 0, "{content:?}");
    }
}

#[tokio::test]
async fn completion_logprobs_in_the_legacy_shape() {
    let body = json!({
        "prompt": "The capital of France is",
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": 2,
    });
    let o = same_on_every_transport("/v1/completions", &body).await;
    let lp = &o.logprobs;
    let tokens = lp["tokens"].as_array().unwrap();
    let values = lp["token_logprobs"].as_array().unwrap();
    let top = lp["top_logprobs"].as_array().unwrap();
    assert!(!tokens.is_empty());
    assert_eq!((tokens.len(), top.len()), (values.len(), values.len()));
    let text: String = tokens.iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(text, o.text);
    for ((t, v), alternatives) in tokens.iter().zip(values).zip(top) {
        let alternatives = alternatives.as_object().unwrap();
        assert!((1..=2).contains(&alternatives.len()), "{alternatives:?}");
        // Greedy: the token is the most likely one, with its own value.
        let best = alternatives
            .values()
            .map(f)
            .fold(f64::NEG_INFINITY, f64::max);
        assert_eq!(alternatives[t.as_str().unwrap()], *v);
        assert_eq!(f(v), best);
    }
}

#[tokio::test]
async fn without_logprobs_there_are_none() {
    let s = common::smollm2();
    let body = common::chat_body(
        json!([{"role": "user", "content": "Hi"}]),
        json!({"max_tokens": 4, "temperature": 0}),
    );
    for streamed in [false, true] {
        let o = common::run(s, "/v1/chat/completions", &body, "v2", streamed).await;
        assert!(o.logprobs.is_null(), "{o:?}");
    }
}
