//! The rules on values that both endpoints share: numbers in range, `stop`, `logprobs`,
//! `response_format`.

use super::body::{FormatKind, Logprobs, ResponseFormat, Stop};
use super::Endpoint;
use crate::error::{refuse_other, ApiError};

/// `value` when it lies in `lo..=hi`.
pub(super) fn num(
    key: &str,
    value: Option<f64>,
    lo: f64,
    hi: f64,
) -> Result<Option<f64>, ApiError> {
    match value {
        Some(v) if !(v.is_finite() && v >= lo && v <= hi) => Err(ApiError::invalid(
            Some(key.to_string()),
            format!("{key} must be between {lo} and {hi}, got {v}"),
        )),
        v => Ok(v),
    }
}

/// `value` when it lies in `lo..=hi`.
pub(super) fn int<T>(key: &str, value: Option<T>, lo: i64, hi: i64) -> Result<Option<T>, ApiError>
where
    T: Copy + Into<i128> + std::fmt::Display,
{
    match value {
        Some(v) if !(i128::from(lo)..=i128::from(hi)).contains(&v.into()) => {
            Err(ApiError::invalid(
                Some(key.to_string()),
                format!("{key} must be an integer between {lo} and {hi}, got {v}"),
            ))
        }
        v => Ok(v),
    }
}

/// `stop`: up to 4 non-empty strings.
pub(super) fn stop(value: Option<Stop>) -> Result<Vec<String>, ApiError> {
    let list = match value {
        None => return Ok(Vec::new()),
        Some(Stop::One(s)) => vec![s],
        Some(Stop::Many(v)) => v,
    };
    if list.len() > 4 || list.iter().any(String::is_empty) {
        return Err(ApiError::invalid(
            Some("stop".into()),
            "stop must be a non-empty string or an array of up to 4 non-empty strings",
        ));
    }
    Ok(list)
}

/// Most alternatives per token (`top_logprobs`; the engine's limit, OpenAI's for chat).
pub const MAX_TOP_LOGPROBS: i64 = 20;

/// The log-probabilities asked for: chat `logprobs: true` with `top_logprobs` 0-20 (which
/// needs `logprobs`), completions `logprobs` 0-20 (OpenAI allows 5; llama-server more).
pub(super) fn logprobs(
    endpoint: Endpoint,
    logprobs: Option<Logprobs>,
    top: Option<i64>,
) -> Result<Option<u32>, ApiError> {
    let refused = |why: &str| Err(ApiError::invalid(Some("logprobs".into()), why));
    match (endpoint, logprobs) {
        (Endpoint::Chat, Some(Logprobs::Count(_))) => refused("logprobs must be a boolean"),
        (Endpoint::Completion, Some(Logprobs::Flag(_))) => {
            refused("logprobs must be an integer: the alternatives per token")
        }
        (Endpoint::Chat, flag) => {
            let on = matches!(flag, Some(Logprobs::Flag(true)));
            let top = int("top_logprobs", top, 0, MAX_TOP_LOGPROBS)?;
            if top.is_some() && !on {
                return Err(ApiError::invalid(
                    Some("top_logprobs".into()),
                    "top_logprobs needs logprobs: true",
                ));
            }
            Ok(on.then(|| top.unwrap_or(0) as u32))
        }
        (Endpoint::Completion, Some(Logprobs::Count(n))) => {
            Ok(int("logprobs", Some(n), 0, MAX_TOP_LOGPROBS)?.map(|n| n as u32))
        }
        (Endpoint::Completion, None) => Ok(None),
    }
}

/// `response_format`: `{"type": "text"}` (none), `{"type": "json_object"}` (any JSON
/// object) or `{"type": "json_schema", "json_schema": {"name", "schema", "strict",
/// "description"}}`: the JSON Schema the answer must follow (turned into a grammar on the
/// nodes by llama.cpp's own converter, llama-server's). Answers are always held to the
/// schema, strict or not.
pub(super) fn response_format(value: Option<ResponseFormat>) -> Result<Option<String>, ApiError> {
    let Some(rf) = value else { return Ok(None) };
    refuse_other(&rf.other, "response_format")?;
    let schema = match (rf.kind, rf.json_schema) {
        (FormatKind::Text, None) => return Ok(None),
        (FormatKind::JsonObject, None) => serde_json::json!({"type": "object"}),
        (FormatKind::JsonSchema, Some(js)) => {
            refuse_other(&js.other, "response_format.json_schema")?;
            match js.schema {
                Some(s) => serde_json::Value::Object(s),
                None => {
                    return Err(ApiError::invalid(
                        Some("response_format.json_schema.schema".into()),
                        "response_format.json_schema.schema must be a JSON Schema object",
                    ))
                }
            }
        }
        (FormatKind::JsonSchema, None) => {
            return Err(ApiError::invalid(
                Some("response_format.json_schema".into()),
                "response_format.json_schema must be an object with a schema",
            ))
        }
        (_, Some(_)) => {
            return Err(ApiError::invalid(
                Some("response_format.json_schema".into()),
                "response_format.json_schema goes only with the type \"json_schema\"",
            ))
        }
    };
    // The nodes turn it into a grammar (llama.cpp's converter); one it refuses is a 400
    // `grammar_error` from the prefill node, before the prompt is prefilled.
    Ok(Some(schema.to_string()))
}
