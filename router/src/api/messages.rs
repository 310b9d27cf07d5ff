//! A chat request's `messages`: roles, text content, an assistant's tool calls, a tool's
//! answer.

use serde_json::{Map, Value};

use super::Message;
use crate::error::ApiError;
use crate::tools::Call;

const ROLES: [&str; 5] = ["system", "user", "assistant", "developer", "tool"];

/// Text of a message's `content`: a string, or an array of `{"type":"text","text":...}` parts
/// joined with newlines (as llama-server joins them).
pub(super) fn content_text(v: &Value, param: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for (j, p) in parts.iter().enumerate() {
                match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    // Joined with a newline, as llama-server joins them.
                    (Some("text"), Some(Value::String(t))) => {
                        if j > 0 {
                            out.push('\n');
                        }
                        out.push_str(t);
                    }
                    _ => return Err(ApiError::invalid(
                        Some(format!("{param}[{j}]")),
                        "only text content parts ({\"type\":\"text\",\"text\":...}) are supported",
                    )),
                }
            }
            Ok(out)
        }
        _ => Err(ApiError::invalid(
            Some(param.to_string()),
            "content must be a string or an array of text parts",
        )),
    }
}

pub(super) fn messages(obj: &Map<String, Value>) -> Result<Vec<Message>, ApiError> {
    let list = match obj.get("messages") {
        None | Some(Value::Null) => {
            return Err(ApiError::invalid(
                Some("messages".into()),
                "messages is required",
            ))
        }
        Some(Value::Array(a)) => a,
        Some(_) => {
            return Err(ApiError::invalid(
                Some("messages".into()),
                "messages must be an array",
            ))
        }
    };
    if list.is_empty() {
        return Err(ApiError::invalid(
            Some("messages".into()),
            "messages must contain at least one message",
        ));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| message(i, m))
        .collect()
}

/// `messages[i]`: `role` and `content`, plus an assistant's `tool_calls` (then `content`
/// may be null) and a tool's `tool_call_id`.
pub(super) fn message(i: usize, m: &Value) -> Result<Message, ApiError> {
    let Some(m) = m.as_object() else {
        return Err(ApiError::invalid(
            Some(format!("messages[{i}]")),
            "each message must be an object",
        ));
    };
    let role = match m.get("role") {
        Some(Value::String(r)) if ROLES.contains(&r.as_str()) => r.clone(),
        Some(Value::String(r)) => {
            return Err(ApiError::invalid(
                Some(format!("messages[{i}].role")),
                format!(
                    "invalid role {r:?}; expected one of system, user, assistant, developer, tool"
                ),
            ))
        }
        _ => {
            return Err(ApiError::invalid(
                Some(format!("messages[{i}].role")),
                "role is required and must be a string",
            ))
        }
    };
    // Fields a message may carry that we would not use (`name`, `audio`, ...) are refused
    // rather than dropped; a null one is not set.
    let own: &[&str] = match role.as_str() {
        "assistant" => &["role", "content", "tool_calls"],
        "tool" => &["role", "content", "tool_call_id"],
        _ => &["role", "content"],
    };
    if let Some((k, _)) = m
        .iter()
        .find(|(k, v)| !own.contains(&k.as_str()) && !v.is_null())
    {
        return Err(ApiError::invalid(
            Some(format!("messages[{i}].{k}")),
            format!("unsupported field {k:?} in a {role} message"),
        ));
    }
    let tool_calls = match m.get("tool_calls") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(j, c)| message_call(&format!("messages[{i}].tool_calls[{j}]"), c))
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(ApiError::invalid(
                Some(format!("messages[{i}].tool_calls")),
                "tool_calls must be an array",
            ))
        }
    };
    let tool_call_id = match m.get("tool_call_id") {
        _ if role != "tool" => None,
        Some(Value::String(id)) => Some(id.clone()),
        _ => {
            return Err(ApiError::invalid(
                Some(format!("messages[{i}].tool_call_id")),
                "a tool message needs the tool_call_id (a string) of the call it answers",
            ))
        }
    };
    let param = format!("messages[{i}].content");
    let content = match m.get("content") {
        // An assistant message that calls tools may say nothing.
        None | Some(Value::Null) if !tool_calls.is_empty() => String::new(),
        None | Some(Value::Null) => {
            return Err(ApiError::invalid(Some(param), "content is required"))
        }
        Some(c) => content_text(c, &param)?,
    };
    // Templates generally know no "developer" role: it is OpenAI's newer name for system.
    let role = if role == "developer" {
        "system".into()
    } else {
        role
    };
    Ok(Message {
        role,
        content,
        tool_calls,
        tool_call_id,
    })
}

/// An assistant message's call: `{"id", "type": "function", "function": {"name",
/// "arguments"}}`, the arguments JSON text of an object (as OpenAI returned them).
pub(super) fn message_call(param: &str, c: &Value) -> Result<Call, ApiError> {
    let bad = |p: &str, msg: &str| Err(ApiError::invalid(Some(format!("{param}{p}")), msg));
    let Some(o) = c.as_object() else {
        return bad("", "each tool call must be an object");
    };
    if let Some(k) = o
        .keys()
        .find(|k| !matches!(k.as_str(), "id" | "type" | "function"))
    {
        return bad(&format!(".{k}"), "unsupported field in a tool call");
    }
    let (Some(id), Some("function")) = (
        o.get("id").and_then(Value::as_str),
        o.get("type").and_then(Value::as_str),
    ) else {
        return bad("", "a tool call needs an id and type \"function\"");
    };
    let f = o.get("function").and_then(Value::as_object);
    let (Some(name), Some(arguments)) = (
        f.and_then(|f| f.get("name")).and_then(Value::as_str),
        f.and_then(|f| f.get("arguments")).and_then(Value::as_str),
    ) else {
        return bad(
            ".function",
            "a tool call's function needs a name and arguments (a string)",
        );
    };
    if !serde_json::from_str::<Value>(arguments).is_ok_and(|v| v.is_object()) {
        return bad(
            ".function.arguments",
            "arguments must be the JSON text of an object",
        );
    }
    Ok(Call {
        id: id.to_string(),
        name: name.to_string(),
        arguments: arguments.to_string(),
    })
}
