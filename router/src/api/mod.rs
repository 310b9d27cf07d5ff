//! OpenAI request parsing: a JSON body becomes a [`ValidRequest`] once, or an error naming
//! the field that failed. A field we would not use is refused by name, as OpenAI itself
//! refuses unrecognized arguments: an ignored field gives an answer that looks right and
//! is not what was asked for (see [`known_fields`]).
//!
//! Rooms: `body` (the body as serde reads it: typed, every unknown field kept to be
//! refused by name), `messages` (a chat request's messages), `fields` (the fields an
//! endpoint refuses), `sampling` (the value rules both endpoints share); here the request
//! types and [`parse`], each endpoint's request read top to bottom.

mod body;
mod fields;
mod messages;
mod sampling;

use body::{Body, Prompt};
use fields::known_fields;
use messages::messages;
pub use sampling::MAX_TOP_LOGPROBS;
use sampling::{int, logprobs, num, response_format, stop};

use serde_json::Value;

use crate::error::{typed, ApiError, HttpCode};
use crate::tools::{self, Call, ToolFields, Tools};

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
    /// No handoff, on a prefill node with a layer split (`--rpc-peer`): the
    /// model's last layers computed on the peer for every token. Refused (400) when the
    /// prefill node serves no split.
    Layers,
    /// No handoff: the decode node prefills and writes the whole answer itself,
    /// only tokens cross the link (the phone-alone baseline). A decode node that cannot
    /// serve it refuses it before its first token, with the reason.
    Phone,
    /// The router chooses among `local`, `v2` (live or after) and `phone` per request from
    /// the rates it measured, the link and the load, under the request's or the router's
    /// [`Objective`] (`backend/cost.rs`). The answer reports the transport it took, the
    /// mode and the reason.
    Auto,
}

impl Transport {
    /// Parses `v2` / `v1` / `local` / `layers` / `phone` / `auto`.
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
            "auto" => Ok(Transport::Auto),
            other => Err(format!(
                "unknown transport {other:?}; expected \"v2\", \"v1\", \"local\", \"layers\", \
                 \"phone\" or \"auto\""
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
            Transport::Auto => "auto",
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

/// What the router optimizes when it chooses a request's mode (`transport: "auto"`;
/// `--objective`, `"edgesplit": {"objective"}`; `backend/cost.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Objective {
    /// The soonest expected end of the answer.
    Latency,
    /// The least prefill-node time among the modes whose answer is expected to
    /// end within `cost::OFFLOAD_BOUND` x the soonest one's.
    Offload,
    /// `latency` while the prefill node runs no other answer, `offload` while it does.
    #[default]
    Balanced,
}

impl Objective {
    /// Parses `latency` / `offload` / `balanced`.
    ///
    /// # Errors
    /// Any other name.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "latency" => Ok(Objective::Latency),
            "offload" => Ok(Objective::Offload),
            "balanced" => Ok(Objective::Balanced),
            other => Err(format!(
                "unknown objective {other:?}; expected \"latency\", \"offload\" or \"balanced\""
            )),
        }
    }

    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Objective::Latency => "latency",
            Objective::Offload => "offload",
            Objective::Balanced => "balanced",
        }
    }
}

/// Sampling options after range checks: the one sampling type the engine samples with.
pub use edgesplit_proto::sampling::SamplingParams as Sampling;

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
    /// `edgesplit.objective`: what `transport: "auto"` optimizes (else the router's).
    pub objective: Option<Objective>,
    /// `edgesplit.node`: the decode node (its `--decode-url`) a split or `phone` answer
    /// uses, and the only one `auto` considers (else the router chooses).
    pub node: Option<String>,
    /// `cache_prompt` (llama-server's name; default true): the nodes may reuse the KV they
    /// keep from earlier requests for this prompt (ARCHITECTURE.md, "Conversations").
    pub cache_prompt: bool,
    /// The tools the model may call (None: none, or `tool_choice: "none"`).
    pub tools: Option<Tools>,
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
        ApiError::invalid(None, format!("invalid JSON body: {e}")).with_code(HttpCode::InvalidJson)
    })?;
    if !value.is_object() {
        return Err(ApiError::invalid(
            None,
            "the request body must be a JSON object",
        ));
    }
    let body: Body = typed(value)?;
    known_fields(endpoint, &body)?;
    let input = match endpoint {
        Endpoint::Chat => Input::Chat(messages(body.messages)?),
        Endpoint::Completion => Input::Prompt(prompt(body.prompt)?),
    };
    if let Some(n) = int("n", body.n, 1, 128)? {
        if n != 1 {
            return Err(ApiError::invalid(Some("n".into()), "only n=1 is supported"));
        }
    }
    // Each of two names for one setting is checked; the newer name wins.
    let max_tokens = int(
        "max_completion_tokens",
        body.max_completion_tokens,
        1,
        u32::MAX.into(),
    )?
    .or(int("max_tokens", body.max_tokens, 1, u32::MAX.into())?);
    let repeat_penalty = num("repetition_penalty", body.repetition_penalty, 0.0, 10.0)?.or(num(
        "repeat_penalty",
        body.repeat_penalty,
        0.0,
        10.0,
    )?);
    let mut sampling = Sampling {
        temperature: num("temperature", body.temperature, 0.0, 2.0)?.unwrap_or(1.0) as f32,
        top_p: num("top_p", body.top_p, 0.0, 1.0)?.unwrap_or(1.0) as f32,
        top_k: int("top_k", body.top_k, 0, 1_000_000)?.unwrap_or(0) as i32,
        min_p: num("min_p", body.min_p, 0.0, 1.0)?.unwrap_or(0.0) as f32,
        // OpenAI seeds are any integer; llama.cpp takes 32 bits.
        seed: body.seed.map_or_else(random_seed, |v| v as u32),
        repeat_penalty: repeat_penalty.unwrap_or(1.0) as f32,
        presence_penalty: num("presence_penalty", body.presence_penalty, -2.0, 2.0)?.unwrap_or(0.0)
            as f32,
        frequency_penalty: num("frequency_penalty", body.frequency_penalty, -2.0, 2.0)?
            .unwrap_or(0.0) as f32,
        logprobs: logprobs(endpoint, body.logprobs, body.top_logprobs)?,
        penalty_last_n: Sampling::default().penalty_last_n,
        json_schema: response_format(body.response_format)?.map(Into::into),
        tool_call_schema: None,
        parallel_tool_calls: false,
    };
    let tools = tools::parse(ToolFields {
        tools: body.tools,
        tool_choice: body.tool_choice,
        parallel_tool_calls: body.parallel_tool_calls,
    })?;
    if let Some(t) = &tools {
        if sampling.json_schema.is_some() {
            // Both would hold the answer to a grammar; llama-server refuses the pair too.
            return Err(ApiError::invalid(
                Some("response_format".into()),
                "response_format cannot be combined with tools (unless tool_choice is \"none\")",
            ));
        }
        sampling.tool_call_schema = t.forced_schema().map(Into::into);
        sampling.parallel_tool_calls = t.parallel;
    }
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
    let ext = body.edgesplit;
    let node = match ext.as_ref().and_then(|e| e.node.clone()) {
        Some(n) => Some(node_name(n)?),
        None => None,
    };
    Ok(ValidRequest {
        cache_prompt: body.cache_prompt.unwrap_or(true),
        return_token_ids: ext.as_ref().and_then(|e| e.return_token_ids) == Some(true),
        endpoint,
        model: body.model,
        input,
        sampling,
        max_tokens: max_tokens.unwrap_or(0),
        stop: stop(body.stop)?,
        stream: body.stream == Some(true),
        include_usage: body.stream_options.and_then(|o| o.include_usage) == Some(true),
        transport: ext.as_ref().and_then(|e| e.transport),
        handoff: ext.as_ref().and_then(|e| e.handoff),
        objective: ext.as_ref().and_then(|e| e.objective),
        node,
        tools,
    })
}

/// A completion's prompt: one non-empty string.
fn prompt(value: Option<Prompt>) -> Result<String, ApiError> {
    let bad = |why: &str| Err(ApiError::invalid(Some("prompt".into()), why));
    match value {
        None => bad("prompt is required"),
        Some(Prompt::One(s)) if !s.is_empty() => Ok(s),
        Some(Prompt::Many(mut v)) if v.len() == 1 && !v[0].is_empty() => Ok(v.remove(0)),
        Some(_) => bad("prompt must be a non-empty string (or an array of one string)"),
    }
}

/// Longest `edgesplit.node` accepted (a node's URL).
const MAX_NODE_NAME: usize = 512;

/// `edgesplit.node`: a decode node's URL, checked against the router's nodes when the
/// request runs (`backend/pool.rs`).
fn node_name(s: String) -> Result<String, ApiError> {
    if s.is_empty() || s.len() > MAX_NODE_NAME {
        return Err(ApiError::invalid(
            Some("edgesplit.node".into()),
            format!(
                "edgesplit.node must name a decode node by its URL (1 to {MAX_NODE_NAME} bytes)"
            ),
        ));
    }
    Ok(s)
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
            assert_eq!(e.kind, crate::error::ErrorType::InvalidRequest);
        }
    }

    #[test]
    fn a_value_of_the_wrong_type_is_named_where_it_stands() {
        let msgs = r#""messages":[{"role":"user","content":"x"}]"#;
        for (extra, param) in [
            (r#""stream":"yes""#, "stream"),
            (r#""seed":1.5"#, "seed"),
            (r#""max_tokens":-1"#, "max_tokens"),
            (r#""max_tokens":4294967296"#, "max_tokens"),
            (r#""temperature":"hot""#, "temperature"),
            (r#""stop":[1]"#, "stop"),
            (r#""user":7"#, "user"),
            (
                r#""edgesplit":{"return_token_ids":"x"}"#,
                "edgesplit.return_token_ids",
            ),
            (r#""edgesplit":{"node":""}"#, "edgesplit.node"),
            (
                r#""stream_options":{"include_usage":1}"#,
                "stream_options.include_usage",
            ),
            (
                r#""response_format":{"type":"text","json_schema":{}}"#,
                "response_format.json_schema",
            ),
            (
                r#""repetition_penalty":1.1,"repeat_penalty":11"#,
                "repeat_penalty",
            ),
            (r#""max_completion_tokens":5,"max_tokens":0"#, "max_tokens"),
            (
                r#""tools":[{"type":"function","function":{"name":5}}]"#,
                "tools[0].function.name",
            ),
            (
                r#""tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":{"type":"function","function":{"name":"f"},"x":1}"#,
                "tool_choice.x",
            ),
        ] {
            let body = format!("{{{msgs},{extra}}}");
            let e = chat(&body).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
        for (body, param) in [
            (r#"{"messages":[{"content":"x"}]}"#, "messages[0].role"),
            (
                r#"{"messages":[{"role":"user","content":5}]}"#,
                "messages[0].content",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x"}, 3]}"#,
                "messages[1]",
            ),
            (
                r#"{"messages":[{"role":"user","content":"x","tool_calls":[]}]}"#,
                "messages[0].tool_calls",
            ),
            (
                r#"{"messages":[{"role":"user","content":[{"type":"text","text":"a","cache":1}]}]}"#,
                "messages[0].content[0]",
            ),
        ] {
            let e = chat(body).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
        // The message names what was expected.
        let e = chat(&format!(r#"{{{msgs},"stream":"yes"}}"#)).unwrap_err();
        assert!(e.message.contains("expected a boolean"), "{}", e.message);
        let e = chat(&format!(r#"{{{msgs},"seed":1.5}}"#)).unwrap_err();
        assert_eq!(
            e.message,
            "seed: invalid type: floating point `1.5`, expected an integer"
        );
        let e = chat(r#"{"messages":[3]}"#).unwrap_err();
        assert_eq!(
            e.message,
            "messages[0]: invalid type: integer `3`, expected an object"
        );
        let e = chat(&format!(r#"{{{msgs},"edgesplit":{{"handoff":"soon"}}}}"#)).unwrap_err();
        assert!(e.message.contains("\"live\" or \"after\""), "{}", e.message);
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
                "response_format.type",
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
