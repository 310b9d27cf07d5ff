//! Tool calls. The tools reach the model through its chat template (SmolLM2's own
//! takes none: these stacks give both nodes `templates/chatml-tools.jinja`, a ChatML
//! template in the Hermes format, as a user of such a model would), the model writes its
//! calls as `<tool_call>` JSON, and the router returns them as OpenAI's `tool_calls`.
//! `tool_choice` "required" or a named function samples the answer within a grammar of
//! calls, rebuilt on each node from the answer's tokens like `response_format`'s, so a
//! split answer is the one-device answer. Each case: `local`, then every split transport,
//! streamed or not, the same calls (ids aside: they are new in every answer).

use std::path::PathBuf;
use std::sync::OnceLock;

use crate::common::{self, Outcome, Stack, StackOptions};
use serde_json::{json, Value};

fn template() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../templates/chatml-tools.jinja"
    ))
}

/// SmolLM2 with the tool template on both nodes.
pub fn stack() -> &'static Stack {
    static S: OnceLock<Stack> = OnceLock::new();
    S.get_or_init(|| {
        common::start(StackOptions {
            chat_template_file: Some(template()),
            ..StackOptions::new(common::SMOLLM2)
        })
    })
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {
            "name": "get_weather", "description": "The current weather in a city.",
            "parameters": {"type": "object", "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]}},
              "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {
            "name": "get_time", "description": "The current time in a time zone.",
            "parameters": {"type": "object", "properties": {
                "timezone": {"type": "string", "maxLength": 32}},
              "required": ["timezone"], "additionalProperties": false}}}
    ])
}

fn body(messages: Value, extra: Value) -> Value {
    let mut b = common::chat_body(messages, json!({"tools": tools(), "max_tokens": 96}));
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

/// `local` (the reference), then each split transport, streamed or not: the same.
async fn same_on_every_transport(body: &Value) -> Outcome {
    common::same_on_every_transport(stack(), "/v1/chat/completions", body).await
}

/// Each call names one of the tools and its arguments follow the tool's parameters.
fn assert_valid_calls(o: &Outcome) {
    assert_eq!(o.finish_reason, "tool_calls", "{o:?}");
    assert!(!o.tool_calls.is_empty(), "{o:?}");
    let tools = tools();
    for (name, arguments) in &o.tool_calls {
        let tool = tools
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["function"]["name"] == name.as_str())
            .unwrap_or_else(|| panic!("a call to {name}, which is no tool"));
        let args: Value = serde_json::from_str(arguments)
            .unwrap_or_else(|e| panic!("arguments not JSON ({e}): {arguments}"));
        let schema = &tool["function"]["parameters"];
        let validator = jsonschema::validator_for(schema).unwrap();
        let errors: Vec<String> = validator
            .iter_errors(&args)
            .map(|e| e.to_string())
            .collect();
        assert!(errors.is_empty(), "{args} against {schema}: {errors:?}");
    }
}

/// `required` and a named function, each greedy and seeded. CI runs two of the four
/// (`required` seeded, a named function greedy: both choices and both samplings);
/// `EDGESPLIT_FULL_SWEEP=1` runs all four.
#[tokio::test]
async fn forced_calls_follow_the_tools_and_are_the_same_on_every_transport() {
    let ask = json!([{"role": "user", "content": "What is the weather like in Paris right now?"}]);
    let cases = [
        (json!("required"), json!({"temperature": 0.9, "seed": 3})),
        (
            json!({"type": "function", "function": {"name": "get_time"}}),
            json!({"temperature": 0}),
        ),
        (json!("required"), json!({"temperature": 0})),
        (
            json!({"type": "function", "function": {"name": "get_weather"}}),
            json!({"temperature": 0.9, "seed": 11}),
        ),
    ];
    let n = if common::full_sweep() { cases.len() } else { 2 };
    for (choice, sampling) in cases.into_iter().take(n) {
        let mut extra = sampling.clone();
        extra["tool_choice"] = choice.clone();
        extra["parallel_tool_calls"] = json!(false);
        let o = same_on_every_transport(&body(ask.clone(), extra)).await;
        assert_valid_calls(&o);
        assert_eq!(o.tool_calls.len(), 1, "parallel_tool_calls false: {o:?}");
        assert_eq!(o.text, "", "a forced call says nothing else: {o:?}");
        if let Some(name) = choice["function"]["name"].as_str() {
            assert_eq!(o.tool_calls[0].0, name, "{o:?}");
        }
    }
}

/// A full round: the call, the tool's answer sent back as a `tool` message after the
/// assistant's `tool_calls`, and the model's answer to that, identical on every transport.
#[tokio::test]
async fn a_tool_round_trip_is_answered_the_same_on_every_transport() {
    let ask = json!([{"role": "user", "content": "What time is it in Tokyo?"}]);
    let first = same_on_every_transport(&body(
        ask.clone(),
        json!({"temperature": 0, "parallel_tool_calls": false,
               "tool_choice": {"type": "function", "function": {"name": "get_time"}}}),
    ))
    .await;
    assert_valid_calls(&first);
    let (name, arguments) = &first.tool_calls[0];
    let mut messages = ask.as_array().unwrap().clone();
    messages.push(json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}]}));
    messages.push(json!({"role": "tool", "tool_call_id": "call_1",
                         "content": "{\"time\": \"14:05\", \"timezone\": \"Asia/Tokyo\"}"}));
    // `auto`: the model may answer or call again; whatever it does, it does on every
    // transport, and what it says is read for calls the same way.
    let second = same_on_every_transport(&body(
        Value::Array(messages),
        json!({"temperature": 0, "max_tokens": 48}),
    ))
    .await;
    assert!(
        second.prompt_tokens > first.prompt_tokens + 20,
        "{second:?}"
    );
    if second.finish_reason == "tool_calls" {
        assert_valid_calls(&second);
    } else {
        assert!(!second.text.is_empty(), "{second:?}");
    }
}

/// `auto` with more than one call allowed: whatever the model writes (text or calls), the
/// same on every transport, greedy and seeded.
#[tokio::test]
async fn auto_answers_are_the_same_on_every_transport() {
    let ask = json!([{"role": "system", "content": "Call a tool when one can answer."},
                     {"role": "user", "content": "What's the weather in Berlin and the time in London?"}]);
    for sampling in [
        json!({"temperature": 0}),
        json!({"temperature": 0.8, "seed": 5}),
    ] {
        let o = same_on_every_transport(&body(ask.clone(), sampling)).await;
        if o.finish_reason == "tool_calls" {
            assert_valid_calls(&o);
        }
    }
}

/// A model whose template takes no tools (SmolLM2's own) refuses a request with tools
/// before any work, naming `tools` and the way out; `tool_choice: "none"` is served.
#[tokio::test]
async fn tools_on_a_template_without_them_are_a_clear_400() {
    let s = common::smollm2();
    let url = format!("{}/v1/chat/completions", s.router);
    let ask = json!([{"role": "user", "content": "What time is it?"}]);
    let (status, _, v) = common::post(&url, &body(ask.clone(), json!({}))).await;
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "tools", "{v}");
    assert_eq!(v["error"]["code"], "tools_unsupported", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--chat-template-file"),
        "{v}"
    );
    let (status, _, v) = common::post(
        &url,
        &body(ask, json!({"tool_choice": "none", "max_tokens": 4})),
    )
    .await;
    assert_eq!(status, 200, "{v}");
    let message = &v["choices"][0]["message"];
    assert!(
        message["content"].is_string() && message["tool_calls"].is_null(),
        "{v}"
    );
}
