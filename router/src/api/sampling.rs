//! The rules shared by both endpoints: numbers in range, `stop`, `logprobs`,
//! `response_format`.

use serde_json::{Map, Value};

use super::Endpoint;
use crate::error::ApiError;

pub(super) fn num(
    obj: &Map<String, Value>,
    key: &str,
    lo: f64,
    hi: f64,
) -> Result<Option<f64>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => {
            let v = n.as_f64().unwrap_or(f64::NAN);
            if v.is_finite() && v >= lo && v <= hi {
                Ok(Some(v))
            } else {
                Err(ApiError::invalid(
                    Some(key.to_string()),
                    format!("{key} must be between {lo} and {hi}, got {n}"),
                ))
            }
        }
        Some(_) => Err(ApiError::invalid(
            Some(key.to_string()),
            format!("{key} must be a number"),
        )),
    }
}

pub(super) fn int(
    obj: &Map<String, Value>,
    key: &str,
    lo: i64,
    hi: i64,
) -> Result<Option<i64>, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match n.as_i64() {
            Some(v) if v >= lo && v <= hi => Ok(Some(v)),
            _ => Err(ApiError::invalid(
                Some(key.to_string()),
                format!("{key} must be an integer between {lo} and {hi}, got {n}"),
            )),
        },
        Some(_) => Err(ApiError::invalid(
            Some(key.to_string()),
            format!("{key} must be an integer"),
        )),
    }
}

pub(super) fn boolean(obj: &Map<String, Value>, key: &str) -> Result<bool, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::invalid(
            Some(key.to_string()),
            format!("{key} must be a boolean"),
        )),
    }
}

pub(super) fn stop(obj: &Map<String, Value>) -> Result<Vec<String>, ApiError> {
    let bad = || {
        ApiError::invalid(
            Some("stop".into()),
            "stop must be a non-empty string or an array of up to 4 non-empty strings",
        )
    };
    match obj.get("stop") {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::String(s)) if !s.is_empty() => Ok(vec![s.clone()]),
        Some(Value::Array(a)) if a.len() <= 4 => a
            .iter()
            .map(|v| match v {
                Value::String(s) if !s.is_empty() => Ok(s.clone()),
                _ => Err(bad()),
            })
            .collect(),
        _ => Err(bad()),
    }
}

/// Most alternatives per token (`top_logprobs`; the engine's limit, OpenAI's for chat).
pub const MAX_TOP_LOGPROBS: i64 = 20;

/// The log-probabilities asked for: chat `logprobs: true` with `top_logprobs` 0-20 (which
/// needs `logprobs`), completions `logprobs` 0-20 (OpenAI allows 5; llama-server more).
pub(super) fn logprobs(
    endpoint: Endpoint,
    obj: &Map<String, Value>,
) -> Result<Option<u32>, ApiError> {
    match endpoint {
        Endpoint::Chat => {
            let on = boolean(obj, "logprobs")?;
            let top = int(obj, "top_logprobs", 0, MAX_TOP_LOGPROBS)?;
            if top.is_some() && !on {
                return Err(ApiError::invalid(
                    Some("top_logprobs".into()),
                    "top_logprobs needs logprobs: true",
                ));
            }
            Ok(on.then(|| top.unwrap_or(0) as u32))
        }
        Endpoint::Completion => Ok(int(obj, "logprobs", 0, MAX_TOP_LOGPROBS)?.map(|n| n as u32)),
    }
}

/// `response_format`: `{"type": "text"}` (none), `{"type": "json_object"}` (any JSON
/// object) or `{"type": "json_schema", "json_schema": {"name", "schema", "strict",
/// "description"}}`: the JSON Schema the answer must follow (turned into a grammar on the
/// nodes by llama.cpp's own converter, llama-server's). Answers are always held to the
/// schema, strict or not.
pub(super) fn response_format(obj: &Map<String, Value>) -> Result<Option<String>, ApiError> {
    let bad = |param: &str, msg: String| Err(ApiError::invalid(Some(param.into()), msg));
    let rf = match obj.get("response_format") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(_) => {
            return bad(
                "response_format",
                "response_format must be an object".into(),
            )
        }
    };
    if let Some(k) = rf
        .keys()
        .find(|k| !matches!(k.as_str(), "type" | "json_schema"))
    {
        return bad(
            &format!("response_format.{k}"),
            format!("unsupported field response_format.{k}"),
        );
    }
    let schema = match rf.get("type").and_then(Value::as_str) {
        Some("text") if rf.len() == 1 => return Ok(None),
        Some("json_object") if rf.len() == 1 => serde_json::json!({"type": "object"}),
        Some("json_schema") => {
            let Some(Value::Object(js)) = rf.get("json_schema") else {
                return bad(
                    "response_format.json_schema",
                    "response_format.json_schema must be an object with a schema".into(),
                );
            };
            if let Some(k) = js
                .keys()
                .find(|k| !matches!(k.as_str(), "name" | "schema" | "strict" | "description"))
            {
                return bad(
                    &format!("response_format.json_schema.{k}"),
                    format!("unsupported field response_format.json_schema.{k}"),
                );
            }
            match js.get("schema") {
                Some(s @ Value::Object(_)) => s.clone(),
                _ => {
                    return bad(
                        "response_format.json_schema.schema",
                        "response_format.json_schema.schema must be a JSON Schema object".into(),
                    )
                }
            }
        }
        _ => {
            return bad(
                "response_format",
                "response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} \
                 or {\"type\": \"json_schema\", \"json_schema\": {...}}"
                    .into(),
            )
        }
    };
    // The nodes turn it into a grammar (llama.cpp's converter); one it refuses is a 400
    // `grammar_error` from the prefill node, before the prompt is prefilled.
    Ok(Some(schema.to_string()))
}
