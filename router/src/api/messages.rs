//! A chat request's `messages`: roles, text content, an assistant's tool calls, a tool's
//! answer.

use serde_json::{Map, Value};

use super::body::{CallBody, Content, MessageBody, Role};
use super::Message;
use crate::error::{refuse_other, ApiError};
use crate::tools::{Call, FunctionKind};

/// Text of a message's `content`: a string, or `{"type":"text","text":...}` parts joined
/// with newlines (as llama-server joins them).
fn content_text(content: Content, param: &str) -> Result<String, ApiError> {
    match content {
        Content::Text(s) => Ok(s),
        Content::Parts(parts) => {
            let mut out = String::new();
            for (j, p) in parts.iter().enumerate() {
                match text_part(p) {
                    Some(t) => {
                        if j > 0 {
                            out.push('\n');
                        }
                        out.push_str(t);
                    }
                    None => return Err(ApiError::invalid(
                        Some(format!("{param}[{j}]")),
                        "only text content parts ({\"type\":\"text\",\"text\":...}) are supported",
                    )),
                }
            }
            Ok(out)
        }
    }
}

/// A part's text when it is a text part and nothing else.
fn text_part(p: &Map<String, Value>) -> Option<&str> {
    match (p.get("type"), p.get("text")) {
        (Some(Value::String(kind)), Some(Value::String(t))) if kind == "text" && p.len() == 2 => {
            Some(t)
        }
        _ => None,
    }
}

/// `messages`: at least one.
pub(super) fn messages(list: Option<Vec<MessageBody>>) -> Result<Vec<Message>, ApiError> {
    let Some(list) = list else {
        return Err(ApiError::invalid(
            Some("messages".into()),
            "messages is required",
        ));
    };
    if list.is_empty() {
        return Err(ApiError::invalid(
            Some("messages".into()),
            "messages must contain at least one message",
        ));
    }
    list.into_iter()
        .enumerate()
        .map(|(i, m)| message(i, m))
        .collect()
}

/// `messages[i]`: `role` and `content`, plus an assistant's `tool_calls` (then `content`
/// may be null) and a tool's `tool_call_id`. A field the role does not take (`name`,
/// `audio`, a user's `tool_calls`...) is refused rather than dropped.
fn message(i: usize, m: MessageBody) -> Result<Message, ApiError> {
    let at = format!("messages[{i}]");
    let Some(role) = m.role else {
        return Err(ApiError::invalid(
            Some(format!("{at}.role")),
            "role is required",
        ));
    };
    refuse_other(&m.other, &at)?;
    let unsupported = |field: &str| {
        Err(ApiError::invalid(
            Some(format!("{at}.{field}")),
            format!("unsupported field {field:?} in a {} message", role.as_str()),
        ))
    };
    if m.tool_calls.is_some() && role != Role::Assistant {
        return unsupported("tool_calls");
    }
    if m.tool_call_id.is_some() && role != Role::Tool {
        return unsupported("tool_call_id");
    }
    let tool_calls = m
        .tool_calls
        .unwrap_or_default()
        .into_iter()
        .enumerate()
        .map(|(j, c)| message_call(&format!("{at}.tool_calls[{j}]"), c))
        .collect::<Result<Vec<_>, _>>()?;
    let tool_call_id = match (role, m.tool_call_id) {
        (Role::Tool, None) => {
            return Err(ApiError::invalid(
                Some(format!("{at}.tool_call_id")),
                "a tool message needs the tool_call_id (a string) of the call it answers",
            ))
        }
        (_, id) => id,
    };
    let param = format!("{at}.content");
    let content = match m.content {
        Some(c) => content_text(c, &param)?,
        // An assistant message that calls tools may say nothing.
        None if !tool_calls.is_empty() => String::new(),
        None => return Err(ApiError::invalid(Some(param), "content is required")),
    };
    // Templates generally know no "developer": it is OpenAI's newer name for system.
    let role = match role {
        Role::Developer => Role::System,
        r => r,
    };
    Ok(Message {
        role: role.as_str().into(),
        content,
        tool_calls,
        tool_call_id,
    })
}

/// An assistant message's call, its arguments the JSON text of an object.
fn message_call(param: &str, c: CallBody) -> Result<Call, ApiError> {
    refuse_other(&c.other, param)?;
    let FunctionKind::Function = c.kind;
    let Some(f) = c.function else {
        return Err(ApiError::invalid(
            Some(format!("{param}.function")),
            "a tool call's function needs a name and arguments (a string)",
        ));
    };
    refuse_other(&f.other, &format!("{param}.function"))?;
    if !serde_json::from_str::<Value>(&f.arguments).is_ok_and(|v| v.is_object()) {
        return Err(ApiError::invalid(
            Some(format!("{param}.function.arguments")),
            "arguments must be the JSON text of an object",
        ));
    }
    Ok(Call {
        id: c.id,
        name: f.name,
        arguments: f.arguments,
    })
}
