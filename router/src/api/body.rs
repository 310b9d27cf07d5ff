//! A request body as it arrives: typed structs that serde fills from the JSON, before any
//! rule about values. Every struct keeps the fields it does not know in `other`, so that
//! the first one that is set is refused by its full name (`error::refuse_other`; null is
//! "not set" everywhere, as OpenAI treats it). A value of the wrong type is refused by
//! serde with the path of the field (`error::typed`).

use serde::{Deserialize, Deserializer};
use serde_json::{Map, Value};

use super::{HandoffMode, Objective, Transport};
use crate::tools::{FunctionKind, ToolBody, ToolChoiceBody};

/// Both endpoints' fields; each endpoint refuses the other's (`fields.rs`).
#[derive(Debug, Deserialize)]
pub(super) struct Body {
    pub model: Option<String>,
    /// Chat.
    pub messages: Option<Vec<MessageBody>>,
    /// Completions.
    pub prompt: Option<Prompt>,
    pub max_tokens: Option<u32>,
    /// Chat: OpenAI's newer name for `max_tokens`, which it wins over.
    pub max_completion_tokens: Option<u32>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    /// OpenAI seeds are any integer; llama.cpp takes 32 bits.
    pub seed: Option<i64>,
    pub stop: Option<Stop>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub n: Option<i64>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    /// llama-server's two names for one penalty; `repetition_penalty` wins.
    pub repetition_penalty: Option<f64>,
    pub repeat_penalty: Option<f64>,
    pub edgesplit: Option<Extensions>,
    /// OpenAI's end-user id: metadata that changes no answer, accepted (a string) and
    /// not used.
    #[allow(dead_code)]
    pub user: Option<String>,
    /// Chat: `true`/`false`; completions: how many alternatives per token.
    pub logprobs: Option<Logprobs>,
    /// Chat.
    pub top_logprobs: Option<i64>,
    pub response_format: Option<ResponseFormat>,
    /// llama-server's name; default true.
    pub cache_prompt: Option<bool>,
    /// Chat.
    pub tools: Option<Vec<ToolBody>>,
    /// Chat.
    pub tool_choice: Option<ToolChoiceBody>,
    /// Chat.
    pub parallel_tool_calls: Option<bool>,
    /// OpenAI fields we do not implement, accepted at the value that asks for nothing.
    pub logit_bias: Option<Map<String, Value>>,
    pub echo: Option<bool>,
    pub best_of: Option<u64>,
    pub suffix: Option<String>,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// `messages[i]`. Which of the fields a role may carry is checked in `messages.rs`.
#[derive(Debug, Deserialize)]
pub(super) struct MessageBody {
    pub role: Option<Role>,
    pub content: Option<Content>,
    /// An assistant's calls.
    pub tool_calls: Option<Vec<CallBody>>,
    /// A tool's answer names the call it answers.
    pub tool_call_id: Option<String>,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(super) enum Role {
    System,
    User,
    Assistant,
    /// OpenAI's newer name for system (templates generally know no other).
    Developer,
    Tool,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Developer => "developer",
            Role::Tool => "tool",
        }
    }
}

/// A message's content: text, or parts (only text parts are taken; `messages.rs`).
#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "content must be a string or an array of text parts"
)]
pub(super) enum Content {
    Text(String),
    Parts(Vec<Map<String, Value>>),
}

/// An assistant message's call: `{"id", "type": "function", "function": {"name",
/// "arguments"}}`.
#[derive(Debug, Deserialize)]
pub(super) struct CallBody {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: FunctionKind,
    pub function: Option<CallFunction>,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

#[derive(Debug, Deserialize)]
pub(super) struct CallFunction {
    pub name: String,
    /// The JSON text of an object, as OpenAI returned it.
    pub arguments: String,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// A completion's `prompt`: a string, or an array of one string.
#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "prompt must be a non-empty string (or an array of one string)"
)]
pub(super) enum Prompt {
    One(String),
    Many(Vec<String>),
}

/// `stop`: one string or several.
#[derive(Debug, Deserialize)]
#[serde(
    untagged,
    expecting = "stop must be a non-empty string or an array of up to 4 non-empty strings"
)]
pub(super) enum Stop {
    One(String),
    Many(Vec<String>),
}

/// `logprobs`: chat's switch or completions' count.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(
    untagged,
    expecting = "logprobs must be a boolean (chat) or an integer (completions)"
)]
pub(super) enum Logprobs {
    Flag(bool),
    Count(i64),
}

#[derive(Debug, Deserialize)]
pub(super) struct StreamOptions {
    pub include_usage: Option<bool>,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// `edgesplit`: the request's choices about the split.
#[derive(Debug, Deserialize)]
pub(super) struct Extensions {
    #[serde(default, deserialize_with = "named")]
    pub transport: Option<Transport>,
    #[serde(default, deserialize_with = "named")]
    pub handoff: Option<HandoffMode>,
    #[serde(default, deserialize_with = "named")]
    pub objective: Option<Objective>,
    /// A decode node's URL, checked against the router's nodes when the request runs.
    pub node: Option<String>,
    pub return_token_ids: Option<bool>,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// `response_format`: `{"type": "text" | "json_object" | "json_schema", "json_schema"}`.
#[derive(Debug, Deserialize)]
pub(super) struct ResponseFormat {
    #[serde(rename = "type")]
    pub kind: FormatKind,
    pub json_schema: Option<JsonSchema>,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum FormatKind {
    Text,
    JsonObject,
    JsonSchema,
}

/// `response_format.json_schema`: the schema the answer must follow, and what OpenAI sends
/// beside it (answers are always held to the schema, strict or not).
#[derive(Debug, Deserialize)]
pub(super) struct JsonSchema {
    pub schema: Option<Map<String, Value>>,
    /// Accepted, each of its type, and not used.
    #[allow(dead_code)]
    pub name: Option<String>,
    #[allow(dead_code)]
    pub strict: Option<bool>,
    #[allow(dead_code)]
    pub description: Option<String>,
    #[serde(flatten)]
    pub other: Map<String, Value>,
}

/// A name that the type's own `parse` reads, so that the error lists the names it takes.
fn named<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Named,
{
    match Option::<String>::deserialize(d)? {
        None => Ok(None),
        Some(s) => T::parse(&s).map(Some).map_err(serde::de::Error::custom),
    }
}

/// The request's names with a `parse` of their own.
pub(super) trait Named: Sized {
    fn parse(s: &str) -> Result<Self, String>;
}

impl Named for Transport {
    fn parse(s: &str) -> Result<Self, String> {
        Transport::parse(s)
    }
}

impl Named for HandoffMode {
    fn parse(s: &str) -> Result<Self, String> {
        HandoffMode::parse(s)
    }
}

impl Named for Objective {
    fn parse(s: &str) -> Result<Self, String> {
        Objective::parse(s)
    }
}
