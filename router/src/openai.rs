//! The OpenAI response shapes the router writes (chat completions and completions, whole
//! and streamed), one struct each: a field's name and whether it is present or `null` are
//! fixed by its type, not by the code that fills it in (`respond.rs`).

use serde::Serialize;
use serde_json::Value;

use crate::recent::Timing;
use crate::tools::Call;

/// A response body (`choices` of [`ChatChoice`] or [`TextChoice`]) or a streamed chunk
/// (`choices` of [`ChatDelta`] or [`TextChoice`]).
#[derive(Debug, Serialize)]
pub struct Body<'a, C> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    pub choices: Vec<C>,
    /// The whole response's, or the last chunk's when the client asked for it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// The `edgesplit` extension: the whole response's, or the finish chunk's and the
    /// usage chunk's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub edgesplit: Option<Edgesplit<'a>>,
}

/// A whole chat answer.
#[derive(Debug, Serialize)]
pub struct ChatChoice<'a> {
    pub index: u32,
    pub message: Message<'a>,
    pub logprobs: Option<Logprobs>,
    pub finish_reason: &'static str,
}

/// The assistant's message: its text (`null` when it only calls tools), and its calls.
#[derive(Debug, Serialize)]
pub struct Message<'a> {
    pub role: &'static str,
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall<'a>>>,
}

/// A tool call of the answer (`index`: its place among the calls, in a streamed delta).
#[derive(Debug, Serialize)]
pub struct ToolCall<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<usize>,
    pub id: &'a str,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: Function<'a>,
}

/// The function a tool call calls, with its arguments as the model wrote them (JSON text).
#[derive(Debug, Serialize)]
pub struct Function<'a> {
    pub name: &'a str,
    pub arguments: &'a str,
}

impl<'a> ToolCall<'a> {
    /// `call` as the response says it; `index` in a streamed delta.
    #[must_use]
    pub fn of(call: &'a Call, index: Option<usize>) -> Self {
        ToolCall {
            index,
            id: &call.id,
            kind: "function",
            function: Function {
                name: &call.name,
                arguments: &call.arguments,
            },
        }
    }
}

/// A completion's choice, whole or streamed (`finish_reason` `null` until the last).
#[derive(Debug, Serialize)]
pub struct TextChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<Logprobs>,
    pub finish_reason: Option<&'static str>,
}

/// A streamed chat choice.
#[derive(Debug, Serialize)]
pub struct ChatDelta<'a> {
    pub index: u32,
    pub delta: Delta<'a>,
    pub logprobs: Option<Logprobs>,
    pub finish_reason: Option<&'static str>,
}

/// What a chat chunk adds: the role (first chunk), text, or tool calls; nothing in the
/// finish chunk.
#[derive(Debug, Default, Serialize)]
pub struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall<'a>>>,
}

/// A choice's log-probabilities in its endpoint's shape.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum Logprobs {
    /// Chat: `{"content": [{token, logprob, bytes, top_logprobs}], "refusal": null}`.
    Chat {
        content: Vec<TokenLogprob>,
        refusal: Option<String>,
    },
    /// Completions: parallel lists, the alternatives as `{text: logprob}`.
    Completion {
        tokens: Vec<String>,
        token_logprobs: Vec<f32>,
        top_logprobs: Vec<serde_json::Map<String, Value>>,
    },
}

/// A chat token's log-probability, and (for the sampled token) the most likely
/// alternatives.
#[derive(Debug, Serialize)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<Vec<TokenLogprob>>,
}

/// The `usage` object.
#[derive(Debug, Clone, Serialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptTokensDetails,
}

#[derive(Debug, Clone, Serialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: u32,
}

/// The `edgesplit` extension object: the answer's [`Timing`] (the names the recent-answers
/// entry uses), and what only the response carries.
#[derive(Debug, Serialize)]
pub struct Edgesplit<'a> {
    #[serde(flatten)]
    pub timing: Timing,
    pub request_id: &'a str,
    pub transport: &'static str,
    pub seed: u32,
    pub decode_tokens_per_s: Option<f64>,
    /// From the request's arrival to the end of the answer.
    pub e2e_ms: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<&'a [i32]>,
}
