//! Which fields a request may carry: the ones we use, per endpoint, and the ones refused
//! unless inert; anything else is a 400 naming it.

use serde_json::{Map, Value};

use super::Endpoint;
use crate::error::ApiError;

/// Top-level fields both endpoints take. (`user` is OpenAI's end-user id: metadata that
/// changes no answer, accepted and not used.)
const FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "repeat_penalty",
    "edgesplit",
    "user",
    "logprobs",
    "response_format",
    "cache_prompt",
];
const CHAT_FIELDS: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
];
const COMPLETION_FIELDS: &[&str] = &["prompt"];

/// OpenAI fields we do not implement (yet) but accept at the value that asks for nothing:
/// the field, whether a value asks for nothing, and what the 400 says otherwise.
type Inert = (&'static str, fn(&Value) -> bool, &'static str);
const INERT: &[Inert] = &[
    (
        "logit_bias",
        |v| v.as_object().is_some_and(Map::is_empty),
        "logit_bias is not supported",
    ),
    (
        "echo",
        |v| matches!(v, Value::Bool(false)),
        "echo is not supported",
    ),
    (
        "best_of",
        |v| v.as_u64() == Some(1),
        "only best_of=1 is supported",
    ),
    (
        "suffix",
        |v| v.as_str().is_some_and(str::is_empty),
        "suffix is not supported",
    ),
];

/// Refuses every field the endpoint does not take, naming it, and every unimplemented
/// OpenAI field set to ask for something (null is always "not set"). A field silently
/// ignored would give an answer that looks right and is not what was asked for.
pub(super) fn known_fields(endpoint: Endpoint, obj: &Map<String, Value>) -> Result<(), ApiError> {
    let own = match endpoint {
        Endpoint::Chat => CHAT_FIELDS,
        Endpoint::Completion => COMPLETION_FIELDS,
    };
    for (key, value) in obj {
        if FIELDS.contains(&key.as_str()) || own.contains(&key.as_str()) || value.is_null() {
            continue;
        }
        match INERT.iter().find(|(name, ..)| name == key) {
            Some((_, inert, _)) if inert(value) => {}
            Some((_, _, why)) => return Err(ApiError::invalid(Some(key.clone()), *why)),
            None => {
                return Err(ApiError::invalid(
                    Some(key.clone()),
                    format!("unsupported field {key:?}"),
                ))
            }
        }
    }
    let nested: [(&str, &[&str]); 2] = [
        (
            "edgesplit",
            &[
                "transport",
                "handoff",
                "objective",
                "node",
                "return_token_ids",
            ],
        ),
        ("stream_options", &["include_usage"]),
    ];
    for (outer, allowed) in nested {
        if let Some(Value::Object(o)) = obj.get(outer) {
            if let Some(k) = o.keys().find(|k| !allowed.contains(&k.as_str())) {
                return Err(ApiError::invalid(
                    Some(format!("{outer}.{k}")),
                    format!("unsupported field {outer}.{k}"),
                ));
            }
        }
    }
    Ok(())
}
