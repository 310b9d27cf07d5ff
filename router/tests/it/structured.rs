//! Structured output. `response_format` `json_schema` (and `json_object`) becomes
//! a grammar (llama.cpp's own JSON Schema converter, as llama-server uses) that the answer
//! is sampled within; the grammar's state is not exported with the KV state but rebuilt on
//! each node from the answer's tokens, so a split answer is the one-device answer. Each
//! schema below: the answer parses, validates against its schema (the `jsonschema` crate),
//! and is identical on every transport (in CI, one split transport per case in turn:
//! [`same_on_every_transport`]); a few also under seeded sampling.

use crate::common::{self, Outcome};
use serde_json::{json, Value};

/// (prompt, schema) pairs: objects, enums, arrays, nesting, numbers, optional properties,
/// a top-level array. Strings are bounded so that a 135M model's answer ends in the budget.
fn cases() -> Vec<(&'static str, Value)> {
    let s = |n: u64| json!({"type": "string", "maxLength": n});
    vec![
        (
            "Invent a person: a name and an age.",
            json!({"type": "object", "properties": {"name": s(20), "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                   "required": ["name", "age"], "additionalProperties": false}),
        ),
        (
            "What colour is the sky on a clear day?",
            json!({"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
                   "required": ["colour"], "additionalProperties": false}),
        ),
        (
            "Name three fruits.",
            json!({"type": "object", "properties": {"fruits": {"type": "array", "items": s(15), "minItems": 3, "maxItems": 3}},
                   "required": ["fruits"], "additionalProperties": false}),
        ),
        (
            "Is a whale a mammal?",
            json!({"type": "object", "properties": {"mammal": {"type": "boolean"}},
                   "required": ["mammal"], "additionalProperties": false}),
        ),
        (
            "At what temperature in Celsius does water boil?",
            json!({"type": "object", "properties": {"celsius": {"type": "number"}},
                   "required": ["celsius"], "additionalProperties": false}),
        ),
        (
            "Which city is the capital of France, and in which country is it?",
            json!({"type": "object", "properties": {"city": {"type": "object",
                     "properties": {"name": s(20), "country": s(20)},
                     "required": ["name", "country"], "additionalProperties": false}},
                   "required": ["city"], "additionalProperties": false}),
        ),
        (
            "Name the first two planets from the Sun and their order.",
            json!({"type": "object", "properties": {"planets": {"type": "array", "minItems": 2, "maxItems": 2,
                     "items": {"type": "object", "properties": {"name": s(12), "order": {"type": "integer", "minimum": 1, "maximum": 9}},
                               "required": ["name", "order"], "additionalProperties": false}}},
                   "required": ["planets"], "additionalProperties": false}),
        ),
        (
            "What is 2 + 2?",
            json!({"type": "object", "properties": {"answer": {"type": "integer", "minimum": 0, "maximum": 10}},
                   "required": ["answer"], "additionalProperties": false}),
        ),
        (
            "Give three odd numbers.",
            json!({"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 3, "maxItems": 3}),
        ),
        (
            "Suggest a book title.",
            json!({"type": "object", "properties": {"title": s(30), "year": {"type": "integer", "minimum": 1000, "maximum": 2100}},
                   "required": ["title"], "additionalProperties": false}),
        ),
    ]
}

fn body(prompt: &str, format: Value, sampling: &Value) -> Value {
    let mut b = common::chat_body(
        json!([{"role": "user", "content": prompt}]),
        json!({"max_tokens": 96, "response_format": format}),
    );
    for (k, v) in sampling.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

/// `local`, then each split transport (streamed or not): the same answer. CI compares
/// one of the three, the `k`-th in turn, so that the cases of a test cover all three;
/// `EDGESPLIT_FULL_SWEEP=1`: all three for every case.
async fn same_on_every_transport(body: &Value, k: usize) -> Outcome {
    let s = common::smollm2();
    let reference = common::run(s, "/v1/chat/completions", body, "local", false).await;
    let transports = [("v2", true), ("v1", false), ("v2-live", true)];
    for (j, (transport, streamed)) in transports.into_iter().enumerate() {
        if !common::full_sweep() && j != k % transports.len() {
            continue;
        }
        let o = common::run(s, "/v1/chat/completions", body, transport, streamed).await;
        assert_eq!(o, reference, "{transport}, streamed {streamed}: {body}");
    }
    reference
}

fn assert_valid(o: &Outcome, schema: &Value) {
    assert_eq!(o.finish_reason, "stop", "did not finish: {o:?}");
    let doc: Value =
        serde_json::from_str(&o.text).unwrap_or_else(|e| panic!("not JSON ({e}): {:?}", o.text));
    let validator = jsonschema::validator_for(schema).unwrap();
    let errors: Vec<String> = validator.iter_errors(&doc).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{doc} against {schema}: {errors:?}");
}

#[tokio::test]
async fn ten_schemas_give_valid_json_identical_on_every_transport() {
    let cases = cases();
    assert!(cases.len() >= 10);
    let mut k = 0;
    for (i, (prompt, schema)) in cases.into_iter().enumerate() {
        let format = json!({"type": "json_schema",
                            "json_schema": {"name": "answer", "schema": schema, "strict": true}});
        let mut samplings = vec![json!({"temperature": 0})];
        if i % 3 == 0 {
            samplings.push(json!({"temperature": 0.8, "seed": 11 + i}));
        }
        for sampling in samplings {
            k += 1;
            let o = same_on_every_transport(&body(prompt, format.clone(), &sampling), k).await;
            assert_valid(&o, &schema);
        }
    }
}

#[tokio::test]
async fn json_object_gives_an_object() {
    let format = json!({"type": "json_object"});
    let o = same_on_every_transport(
        &body(
            "Describe a cat in JSON.",
            format,
            &json!({"temperature": 0, "max_tokens": 160}),
        ),
        1,
    )
    .await;
    // json_object asks for any JSON object; the model may run out of tokens inside it.
    let text = o.text.trim_start();
    assert!(text.starts_with('{'), "{o:?}");
    if o.finish_reason == "stop" {
        let v: Value = serde_json::from_str(text).unwrap();
        assert!(v.is_object());
    }
}

#[tokio::test]
async fn a_schema_the_converter_refuses_is_a_400() {
    let s = common::smollm2();
    let (status, _, v) = common::post(
        &format!("{}/v1/chat/completions", s.router),
        &body(
            "x",
            json!({"type": "json_schema", "json_schema": {"name": "a",
                   "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}),
            &json!({}),
        ),
    )
    .await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "response_format", "{v}");
    assert_eq!(v["error"]["code"], "grammar_error", "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(message.contains("cannot be turned into a grammar"), "{v}");
}
