//! OpenAI request parsing: a JSON body becomes a [`ValidRequest`] once, or an error naming
//! the field that failed. A field we would not use is refused by name, as OpenAI itself
//! refuses unrecognized arguments: an ignored field gives an answer that looks right and
//! is not what was asked for (see [`known_fields`]).

use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::tools::{self, Call, Tools};

/// Which endpoint a request came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completion,
}

/// How the KV state moves (or does not).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// Prefill node -> decode node over the V2 framed TCP handoff.
    V2,
    /// Prefill node -> decode node as llama.cpp's sequence-state file, by HTTP upload.
    V1,
    /// No handoff: prefill and decode both on the prefill node (the single-device baseline).
    Local,
    /// No handoff, on a prefill node with a layer split (`--rpc-peer`, issue 17): the
    /// model's last layers computed on the peer for every token. Refused (400) when the
    /// prefill node serves no split.
    Layers,
    /// No handoff: the decode node (the phone) prefills and writes the whole answer itself,
    /// only tokens cross the link (the phone-alone baseline). A decode node that cannot
    /// serve it refuses it before its first token, with the reason.
    Phone,
}

impl Transport {
    /// Parses `v2` / `v1` / `local` / `layers` / `phone`.
    ///
    /// # Errors
    /// Any other name.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "v2" => Ok(Transport::V2),
            "v1" => Ok(Transport::V1),
            "local" => Ok(Transport::Local),
            "layers" => Ok(Transport::Layers),
            "phone" => Ok(Transport::Phone),
            other => Err(format!(
                "unknown transport {other:?}; expected \"v2\", \"v1\", \"local\", \"layers\" \
                 or \"phone\""
            )),
        }
    }

    /// The name used in requests and timing reports.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::V2 => "v2",
            Transport::V1 => "v1",
            Transport::Local => "local",
            Transport::Layers => "layers",
            Transport::Phone => "phone",
        }
    }

    /// Whether the whole answer runs on one node (no state crosses).
    #[must_use]
    pub fn colocated(self) -> bool {
        matches!(
            self,
            Transport::Local | Transport::Layers | Transport::Phone
        )
    }
}

/// When a split answer's state crosses to the decode node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum HandoffMode {
    /// The prefill node goes on writing the answer while the state crosses, then hands
    /// over at a token boundary (V2 only; PROTOCOL.md, "Live handoff").
    Live,
    /// The state crosses once after the first token, and the decode node writes the rest.
    After,
}

impl HandoffMode {
    /// Parses `live` / `after`.
    ///
    /// # Errors
    /// Any other name.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "live" => Ok(HandoffMode::Live),
            "after" => Ok(HandoffMode::After),
            other => Err(format!(
                "unknown handoff mode {other:?}; expected \"live\" or \"after\""
            )),
        }
    }

    /// The name used in requests and timing reports.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            HandoffMode::Live => "live",
            HandoffMode::After => "after",
        }
    }
}

/// Sampling options after range checks.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampling {
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: i32,
    pub min_p: f32,
    pub seed: u32,
    pub repeat_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Log-probabilities per token: None = not asked; n = the token's and the n most likely.
    pub logprobs: Option<u32>,
    /// Structured output: the JSON Schema (text) the answer must follow.
    pub json_schema: Option<String>,
    /// Forced tool calls: the JSON Schema (text) each call follows ([`Tools::forced_schema`]).
    pub tool_call_schema: Option<String>,
    /// Forced tool calls may be more than one.
    pub parallel_tool_calls: bool,
}

impl From<&Sampling> for edgesplit_proto::pb::Sampling {
    fn from(s: &Sampling) -> Self {
        edgesplit_proto::pb::Sampling {
            temperature: s.temperature,
            top_p: s.top_p,
            top_k: s.top_k,
            min_p: s.min_p,
            seed: s.seed,
            repeat_penalty: s.repeat_penalty,
            presence_penalty: s.presence_penalty,
            frequency_penalty: s.frequency_penalty,
            penalty_last_n: 64,
            logprobs: s.logprobs,
            json_schema: s.json_schema.clone().unwrap_or_default(),
            tool_call_schema: s.tool_call_schema.clone().unwrap_or_default(),
            parallel_tool_calls: s.parallel_tool_calls,
        }
    }
}

/// The input of a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    Chat(Vec<Message>),
    Prompt(String),
}

/// A chat message.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Message {
    pub role: String,
    /// Empty when an assistant message only calls tools (its `content` null).
    pub content: String,
    /// An assistant message's `tool_calls`.
    pub tool_calls: Vec<Call>,
    /// A `tool` message's `tool_call_id`.
    pub tool_call_id: Option<String>,
}

impl Message {
    /// A message of text only.
    pub fn text(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
            ..Message::default()
        }
    }
}

/// A request that passed validation; the only type the backends see.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidRequest {
    pub endpoint: Endpoint,
    pub model: Option<String>,
    pub input: Input,
    pub sampling: Sampling,
    /// 0 = up to the context size.
    pub max_tokens: u32,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Set by the request (`edgesplit.transport` or the `X-EdgeSplit-Transport` header).
    pub transport: Option<Transport>,
    /// `edgesplit.return_token_ids`: report the answer's token ids.
    pub return_token_ids: bool,
    /// `edgesplit.handoff`: the handoff mode of a split answer (else the router's default).
    pub handoff: Option<HandoffMode>,
    /// `cache_prompt` (llama-server's name; default true): the nodes may reuse the KV they
    /// keep from earlier requests for this prompt (ARCHITECTURE.md, "Conversations").
    pub cache_prompt: bool,
    /// The tools the model may call (None: none, or `tool_choice: "none"`).
    pub tools: Option<Tools>,
}

const ROLES: [&str; 5] = ["system", "user", "assistant", "developer", "tool"];

fn num(obj: &Map<String, Value>, key: &str, lo: f64, hi: f64) -> Result<Option<f64>, ApiError> {
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

fn int(obj: &Map<String, Value>, key: &str, lo: i64, hi: i64) -> Result<Option<i64>, ApiError> {
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

fn boolean(obj: &Map<String, Value>, key: &str) -> Result<bool, ApiError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::invalid(
            Some(key.to_string()),
            format!("{key} must be a boolean"),
        )),
    }
}

/// Text of a message's `content`: a string, or an array of `{"type":"text","text":...}` parts
/// joined with newlines (as llama-server joins them).
fn content_text(v: &Value, param: &str) -> Result<String, ApiError> {
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

fn messages(obj: &Map<String, Value>) -> Result<Vec<Message>, ApiError> {
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
fn message(i: usize, m: &Value) -> Result<Message, ApiError> {
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
fn message_call(param: &str, c: &Value) -> Result<Call, ApiError> {
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

fn stop(obj: &Map<String, Value>) -> Result<Vec<String>, ApiError> {
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
fn known_fields(endpoint: Endpoint, obj: &Map<String, Value>) -> Result<(), ApiError> {
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
        ("edgesplit", &["transport", "handoff", "return_token_ids"]),
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

/// Most alternatives per token (`top_logprobs`; the engine's limit, OpenAI's for chat).
pub const MAX_TOP_LOGPROBS: i64 = 20;

/// The log-probabilities asked for: chat `logprobs: true` with `top_logprobs` 0-20 (which
/// needs `logprobs`), completions `logprobs` 0-20 (OpenAI allows 5; llama-server more).
fn logprobs(endpoint: Endpoint, obj: &Map<String, Value>) -> Result<Option<u32>, ApiError> {
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
fn response_format(obj: &Map<String, Value>) -> Result<Option<String>, ApiError> {
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

/// Parses and validates a request body for `endpoint`.
///
/// `random_seed` supplies the seed when the request samples (temperature > 0) without one,
/// so that every transport of that request draws the same tokens.
///
/// # Errors
/// A 400 [`ApiError`] naming the field.
pub fn parse(
    endpoint: Endpoint,
    body: &[u8],
    random_seed: impl FnOnce() -> u32,
) -> Result<ValidRequest, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        ApiError::invalid(None, format!("invalid JSON body: {e}")).with_code("invalid_json")
    })?;
    let Value::Object(obj) = value else {
        return Err(ApiError::invalid(
            None,
            "the request body must be a JSON object",
        ));
    };
    known_fields(endpoint, &obj)?;
    let model = match obj.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => {
            return Err(ApiError::invalid(
                Some("model".into()),
                "model must be a string",
            ))
        }
    };
    let input = match endpoint {
        Endpoint::Chat => Input::Chat(messages(&obj)?),
        Endpoint::Completion => match obj.get("prompt") {
            Some(Value::String(s)) if !s.is_empty() => Input::Prompt(s.clone()),
            Some(Value::Array(a))
                if a.len() == 1 && a[0].as_str().is_some_and(|s| !s.is_empty()) =>
            {
                Input::Prompt(a[0].as_str().unwrap_or_default().to_string())
            }
            None | Some(Value::Null) => {
                return Err(ApiError::invalid(
                    Some("prompt".into()),
                    "prompt is required",
                ))
            }
            Some(_) => {
                return Err(ApiError::invalid(
                    Some("prompt".into()),
                    "prompt must be a non-empty string (or an array of one string)",
                ))
            }
        },
    };
    if let Some(n) = int(&obj, "n", 1, 128)? {
        if n != 1 {
            return Err(ApiError::invalid(Some("n".into()), "only n=1 is supported"));
        }
    }
    let max_tokens = match int(&obj, "max_completion_tokens", 1, i64::from(u32::MAX))? {
        Some(v) => Some(v),
        None => int(&obj, "max_tokens", 1, i64::from(u32::MAX))?,
    };
    let temperature = num(&obj, "temperature", 0.0, 2.0)?.unwrap_or(1.0) as f32;
    let seed = match obj.get("seed") {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) => match n.as_i64() {
            // OpenAI seeds are any integer; llama.cpp takes 32 bits.
            Some(v) => Some(v as u32),
            None => {
                return Err(ApiError::invalid(
                    Some("seed".into()),
                    "seed must be an integer",
                ))
            }
        },
        Some(_) => {
            return Err(ApiError::invalid(
                Some("seed".into()),
                "seed must be an integer",
            ))
        }
    };
    let mut sampling = Sampling {
        temperature,
        top_p: num(&obj, "top_p", 0.0, 1.0)?.unwrap_or(1.0) as f32,
        top_k: int(&obj, "top_k", 0, 1_000_000)?.unwrap_or(0) as i32,
        min_p: num(&obj, "min_p", 0.0, 1.0)?.unwrap_or(0.0) as f32,
        seed: seed.unwrap_or_else(random_seed),
        repeat_penalty: num(&obj, "repetition_penalty", 0.0, 10.0)?
            .or(num(&obj, "repeat_penalty", 0.0, 10.0)?)
            .unwrap_or(1.0) as f32,
        presence_penalty: num(&obj, "presence_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
        frequency_penalty: num(&obj, "frequency_penalty", -2.0, 2.0)?.unwrap_or(0.0) as f32,
        logprobs: None,
        json_schema: response_format(&obj)?,
        tool_call_schema: None,
        parallel_tool_calls: false,
    };
    let tools = match endpoint {
        Endpoint::Chat => tools::parse(&obj)?,
        Endpoint::Completion => None,
    };
    if let Some(t) = &tools {
        if sampling.json_schema.is_some() {
            // Both would hold the answer to a grammar; llama-server refuses the pair too.
            return Err(ApiError::invalid(
                Some("response_format".into()),
                "response_format cannot be combined with tools (unless tool_choice is \"none\")",
            ));
        }
        sampling.tool_call_schema = t.forced_schema();
        sampling.parallel_tool_calls = t.parallel;
    }
    sampling.logprobs = logprobs(endpoint, &obj)?;
    if sampling.top_p <= 0.0 {
        return Err(ApiError::invalid(
            Some("top_p".into()),
            "top_p must be greater than 0",
        ));
    }
    if sampling.repeat_penalty <= 0.0 {
        return Err(ApiError::invalid(
            Some("repetition_penalty".into()),
            "repetition_penalty must be greater than 0",
        ));
    }
    let stream = boolean(&obj, "stream")?;
    let include_usage = match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => boolean(o, "include_usage")?,
        Some(_) => {
            return Err(ApiError::invalid(
                Some("stream_options".into()),
                "stream_options must be an object",
            ))
        }
    };
    let transport = match obj.get("edgesplit").and_then(|e| e.get("transport")) {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(
            Transport::parse(s)
                .map_err(|m| ApiError::invalid(Some("edgesplit.transport".into()), m))?,
        ),
        Some(_) => {
            return Err(ApiError::invalid(
                Some("edgesplit.transport".into()),
                "edgesplit.transport must be a string",
            ))
        }
    };
    let handoff = match obj.get("edgesplit").and_then(|e| e.get("handoff")) {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(
            HandoffMode::parse(s)
                .map_err(|m| ApiError::invalid(Some("edgesplit.handoff".into()), m))?,
        ),
        Some(_) => {
            return Err(ApiError::invalid(
                Some("edgesplit.handoff".into()),
                "edgesplit.handoff must be a string",
            ))
        }
    };
    let return_token_ids = match obj.get("edgesplit") {
        Some(Value::Object(o)) => boolean(o, "return_token_ids")?,
        None | Some(Value::Null) => false,
        Some(_) => {
            return Err(ApiError::invalid(
                Some("edgesplit".into()),
                "edgesplit must be an object",
            ))
        }
    };
    let cache_prompt = match obj.get("cache_prompt") {
        None | Some(Value::Null) => true,
        Some(_) => boolean(&obj, "cache_prompt")?,
    };
    Ok(ValidRequest {
        cache_prompt,
        return_token_ids,
        endpoint,
        model,
        input,
        sampling,
        max_tokens: max_tokens.map_or(0, |v| v as u32),
        stop: stop(&obj)?,
        stream,
        include_usage,
        transport,
        handoff,
        tools,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(body: &str) -> Result<ValidRequest, ApiError> {
        parse(Endpoint::Chat, body.as_bytes(), || 7)
    }

    #[test]
    fn accepts_a_minimal_chat_and_null_fields() {
        let r =
            chat(r#"{"messages":[{"role":"user","content":"hi"}],"foo":null,"logit_bias":null}"#)
                .unwrap();
        assert_eq!(r.input, Input::Chat(vec![Message::text("user", "hi")]));
        assert_eq!(r.max_tokens, 0);
        assert_eq!(r.sampling.seed, 7);
        assert!(!r.stream);
    }

    #[test]
    fn max_completion_tokens_wins_over_max_tokens() {
        let r = chat(r#"{"messages":[{"role":"user","content":"hi"}],"max_tokens":5,"max_completion_tokens":9}"#)
            .unwrap();
        assert_eq!(r.max_tokens, 9);
    }

    #[test]
    fn errors_name_the_field() {
        let cases = [
            ("{", None),
            ("[]", None),
            (r#"{"model":"x"}"#, Some("messages")),
            (r#"{"messages":[]}"#, Some("messages")),
            (
                r#"{"messages":[{"role":"wizard","content":"x"}]}"#,
                Some("messages[0].role"),
            ),
            (
                r#"{"messages":[{"role":"user"}]}"#,
                Some("messages[0].content"),
            ),
            (
                r#"{"messages":[{"role":"user","content":[{"type":"image_url"}]}]}"#,
                Some("messages[0].content[0]"),
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"temperature":3}"#,
                Some("temperature"),
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"top_p":0}"#,
                Some("top_p"),
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":0}"#,
                Some("max_tokens"),
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":"5"}"#,
                Some("max_tokens"),
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"n":2}"#,
                Some("n"),
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"stop":["a","b","c","d","e"]}"#,
                Some("stop"),
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"presence_penalty":-3}"#,
                Some("presence_penalty"),
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"edgesplit":{"transport":"carrier-pigeon"}}"#,
                Some("edgesplit.transport"),
            ),
        ];
        for (body, param) in cases {
            let e = chat(body).unwrap_err();
            assert_eq!(e.status, 400, "{body}");
            assert_eq!(e.param.as_deref(), param, "{body}: {}", e.message);
            assert_eq!(e.kind, "invalid_request_error");
        }
    }

    #[test]
    fn completions_need_a_prompt() {
        let r = parse(Endpoint::Completion, br#"{"prompt":"Once"}"#, || 1).unwrap();
        assert_eq!(r.input, Input::Prompt("Once".into()));
        let e = parse(Endpoint::Completion, br#"{"prompt":""}"#, || 1).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
    }

    #[test]
    fn fields_we_would_ignore_are_refused_by_name() {
        for (body, param) in [
            (
                r#"{"messages":[{"role":"user","content":"x"}],"top_logprobs":2}"#,
                "top_logprobs",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"logprobs":true,"top_logprobs":21}"#,
                "top_logprobs",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"logprobs":2}"#,
                "logprobs",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"response_format":{"type":"xml"}}"#,
                "response_format",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema","json_schema":{"name":"a"}}}"#,
                "response_format.json_schema.schema",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"response_format":{"type":"json_schema","json_schema":{"schema":{},"nmae":"a"}}}"#,
                "response_format.json_schema.nmae",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function"}]}"#,
                "tools[0].function",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f"}}],"response_format":{"type":"json_object"}}"#,
                "response_format",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x","tool_call_id":"a"}]}"#,
                "messages[0].tool_call_id",
            ),
            (
                r#"{"messages":[{"role":"tool","content":"x"}]}"#,
                "messages[0].tool_call_id",
            ),
            (
                r#"{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{oops"}}]}]}"#,
                "messages[0].tool_calls[0].function.arguments",
            ),
            (
                r#"{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"c","type":"function"}]}]}"#,
                "messages[0].tool_calls[0].function",
            ),
            (
                r#"{"messages":[{"role":"user","content":null}]}"#,
                "messages[0].content",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"tool_choice":"auto"}"#,
                "tool_choice",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"frobnicate":1}"#,
                "frobnicate",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"prompt":"y"}"#,
                "prompt",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x","name":"bob"}]}"#,
                "messages[0].name",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"edgesplit":{"transprot":"v2"}}"#,
                "edgesplit.transprot",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}],"stream_options":{"include_usage":true,"x":1}}"#,
                "stream_options.x",
            ),
        ] {
            let e = chat(body).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
        }
        for (body, param) in [
            (r#"{"prompt":"x","echo":true}"#, "echo"),
            (r#"{"prompt":"x","logprobs":true}"#, "logprobs"),
            (r#"{"prompt":"x","logprobs":21}"#, "logprobs"),
            (r#"{"prompt":"x","top_logprobs":2}"#, "top_logprobs"),
            (r#"{"prompt":"x","tools":[]}"#, "tools"),
        ] {
            let e = parse(Endpoint::Completion, body.as_bytes(), || 1).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}");
        }
        let e = parse(
            Endpoint::Completion,
            br#"{"prompt":"x","messages":[]}"#,
            || 1,
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
    }

    #[test]
    fn a_tool_round_trip_is_read() {
        let r = chat(
            r#"{"messages":[{"role":"user","content":"Time?"},
               {"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_time","arguments":"{\"tz\": \"UTC\"}"}}]},
               {"role":"tool","tool_call_id":"call_1","content":"12:00"}],
               "tools":[{"type":"function","function":{"name":"get_time"}}],"tool_choice":"required","parallel_tool_calls":false}"#,
        )
        .unwrap();
        let Input::Chat(m) = &r.input else { panic!() };
        assert_eq!(m[1].content, "");
        assert_eq!(m[1].tool_calls[0].name, "get_time");
        assert_eq!(m[1].tool_calls[0].arguments, r#"{"tz": "UTC"}"#);
        assert_eq!(m[2].tool_call_id.as_deref(), Some("call_1"));
        assert!(r.tools.is_some());
        assert!(r.sampling.tool_call_schema.is_some());
        assert!(!r.sampling.parallel_tool_calls);
        let auto = chat(
            r#"{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":{"name":"f"}}]}"#,
        )
        .unwrap();
        assert!(auto.tools.is_some() && auto.sampling.tool_call_schema.is_none());
    }

    #[test]
    fn unimplemented_fields_that_ask_for_nothing_are_accepted() {
        chat(
            r#"{"messages":[{"role":"user","content":"x","name":null}],"logprobs":false,"top_logprobs":null,
               "response_format":{"type":"text"},"tools":[],"tool_choice":"none","user":"u1",
               "parallel_tool_calls":true,"logit_bias":{}}"#,
        )
        .unwrap();
        parse(
            Endpoint::Completion,
            br#"{"prompt":"x","echo":false,"best_of":1,"suffix":null}"#,
            || 1,
        )
        .unwrap();
    }

    #[test]
    fn logprobs_as_each_endpoint_asks_for_them() {
        let lp = |e, body: &str| parse(e, body.as_bytes(), || 1).unwrap().sampling.logprobs;
        let msgs = r#""messages":[{"role":"user","content":"x"}]"#;
        assert_eq!(lp(Endpoint::Chat, &format!("{{{msgs}}}")), None);
        assert_eq!(
            lp(Endpoint::Chat, &format!(r#"{{{msgs},"logprobs":false}}"#)),
            None
        );
        assert_eq!(
            lp(Endpoint::Chat, &format!(r#"{{{msgs},"logprobs":true}}"#)),
            Some(0)
        );
        assert_eq!(
            lp(
                Endpoint::Chat,
                &format!(r#"{{{msgs},"logprobs":true,"top_logprobs":20}}"#)
            ),
            Some(20)
        );
        assert_eq!(
            lp(Endpoint::Completion, r#"{"prompt":"x","logprobs":3}"#),
            Some(3)
        );
        assert_eq!(
            lp(Endpoint::Completion, r#"{"prompt":"x","logprobs":0}"#),
            Some(0)
        );
        assert_eq!(lp(Endpoint::Completion, r#"{"prompt":"x"}"#), None);
    }

    #[test]
    fn text_parts_are_joined_and_developer_is_system() {
        let r = chat(r#"{"messages":[{"role":"developer","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]}"#)
            .unwrap();
        assert_eq!(r.input, Input::Chat(vec![Message::text("system", "a\nb")]));
    }
}
