//! From backend [`Event`]s to OpenAI responses: the whole-answer JSON, and the SSE chunk
//! sequence (role chunk, content chunks, one finish chunk, optional usage chunk, `[DONE]`;
//! an error is an in-band error event followed by `[DONE]`). Pure state, no HTTP.

use std::time::Instant;

use edgesplit_proto::pb;
use serde_json::Value;

use crate::api::{Endpoint, Transport};
use crate::backend::{Event, FinishReason, Node};
use crate::error::ApiError;
use crate::metrics::RequestObserver;
use crate::openai::{
    Body, ChatChoice, ChatDelta, Delta, Edgesplit, Logprobs, Message, PromptTokensDetails,
    TextChoice, TokenLogprob, ToolCall, Usage,
};
pub use crate::recent::Timing;
use crate::recent::{RecentAnswer, Status};
use crate::text::TextAssembler;
use crate::tools::{self, Call, Tools};

/// Fixed facts of one response.
#[derive(Debug, Clone)]
pub struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub endpoint: Endpoint,
    pub include_usage: bool,
    pub request_id: String,
    pub transport: Transport,
    pub received: Instant,
    /// When the request left the admission queue and its mode was chosen: what an `auto`
    /// answer's `predicted_ms` counts from.
    pub admitted: Instant,
    /// Report the answer's token ids in the `edgesplit` object.
    pub return_token_ids: bool,
    /// The sampling seed used (the router draws one when a sampled request has none).
    pub seed: u32,
    /// The request asked for log-probabilities.
    pub logprobs: bool,
    /// The tools the answer may call: its text is read for calls at its end.
    pub tools: Option<Tools>,
}

/// What one event means for the client.
#[derive(Debug, PartialEq)]
pub enum Step {
    /// Nothing to send yet.
    Nothing,
    /// Text to send.
    Text(String),
    /// Text to send (maybe empty), then the answer is over.
    Done(String),
    Failed(ApiError),
}

/// Accumulates one answer.
pub struct Answer {
    pub meta: Meta,
    text: TextAssembler,
    /// Where the answer is recorded once it ends (absent in unit tests).
    observer: Option<RequestObserver>,
    last_token_at: Option<Instant>,
    pub completion_tokens: u32,
    pub token_ids: Vec<i32>,
    pub prompt_tokens: u32,
    pub finish: Option<FinishReason>,
    pub timing: Timing,
    /// Each token's log-probabilities (end-of-generation tokens have none), and how many
    /// of them streamed chunks have carried so far.
    logprobs: Vec<(Vec<u8>, pb::TokenLogprobs)>,
    logprobs_sent: usize,
    /// The tool calls read from the answer's end (then `finish` is `ToolCalls`).
    calls: Vec<Call>,
    /// Called with the answer's length once it has ended well (`measuring_length`).
    length_meter: Option<Box<dyn FnOnce(u32) + Send>>,
}

impl Answer {
    #[must_use]
    pub fn new(
        meta: Meta,
        stops: Vec<String>,
        prompt_tokens: Option<u32>,
        prefill_ms: Option<f64>,
    ) -> Self {
        let mut text = TextAssembler::new(stops);
        if meta.tools.is_some() {
            text = text.holding_from(tools::MARKER);
        }
        Self {
            meta,
            text,
            observer: None,
            last_token_at: None,
            completion_tokens: 0,
            token_ids: Vec::new(),
            prompt_tokens: prompt_tokens.unwrap_or(0),
            finish: None,
            timing: Timing {
                prefill_ms,
                ..Timing::default()
            },
            logprobs: Vec::new(),
            logprobs_sent: 0,
            calls: Vec::new(),
            length_meter: None,
        }
    }

    /// Tells `meter` this answer's length (its completion tokens) once it has ended well;
    /// not when it fails.
    #[must_use]
    pub fn measuring_length(mut self, meter: Box<dyn FnOnce(u32) + Send>) -> Self {
        self.length_meter = Some(meter);
        self
    }

    /// Records this answer into `metrics` as it goes.
    #[must_use]
    pub fn observed(mut self, observer: RequestObserver) -> Self {
        self.observer = Some(observer);
        self
    }

    /// Folds one backend event in; when observed, times the token and records the
    /// answer's outcome once it ends.
    pub fn on_event(&mut self, ev: Event) -> Step {
        let is_token = matches!(ev, Event::Token { .. });
        let step = match self.fold(ev) {
            Step::Done(rest) => {
                if let Some(meter) = self.length_meter.take() {
                    meter(self.completion_tokens);
                }
                Step::Done(self.read_calls(rest))
            }
            step => step,
        };
        let Some(obs) = &self.observer else {
            return step;
        };
        if is_token {
            let now = Instant::now();
            if let Some(prev) = self.last_token_at.replace(now) {
                obs.metrics.itl.observe((now - prev).as_secs_f64());
            }
        }
        let outcome = match &step {
            Step::Done(_) => Some(self.record(None)),
            Step::Failed(e) => Some(self.record(Some(e))),
            Step::Nothing | Step::Text(_) => None,
        };
        if let Some(a) = outcome {
            obs.metrics.record(a);
        }
        step
    }

    /// The end of an answer that may call tools: the calls in `rest` (all the text held
    /// since the first call's start) are taken out of it, and the answer's finish becomes
    /// `tool_calls`; what came before them is returned. An answer cut by `max_tokens`, or
    /// whose text after the start is not only calls, stays text.
    fn read_calls(&mut self, rest: String) -> String {
        let Some(tools) = &self.meta.tools else {
            return rest;
        };
        if self.finish == Some(FinishReason::Length) {
            return rest;
        }
        match tools.calls_in(&rest) {
            Some((before, calls)) => {
                self.calls = calls;
                self.finish = Some(FinishReason::ToolCalls);
                before.to_string()
            }
            None => rest,
        }
    }

    /// This answer as recorded: ended well, or failed with `error`.
    fn record(&self, error: Option<&ApiError>) -> RecentAnswer {
        let t = &self.timing;
        RecentAnswer {
            at: self.meta.created,
            status: if error.is_some() {
                Status::Error
            } else {
                Status::Ok
            },
            request_id: Some(self.meta.request_id.clone()),
            transport: Some(self.meta.transport.as_str()),
            finish_reason: error.is_none().then(|| self.finish_str()),
            code: error.map(|e| e.code.as_deref().unwrap_or(e.kind.as_str()).to_string()),
            message: error.map(|e| e.message.clone()),
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
            e2e_ms: Some(self.meta.received.elapsed().as_secs_f64() * 1000.0),
            decode_tokens_per_s: self.decode_tps(),
            timing: Timing {
                actual_ms: self.actual_ms(),
                ..t.clone()
            },
        }
    }

    /// An `auto` answer: from its admission to now (its end), as `predicted_ms` predicts.
    fn actual_ms(&self) -> Option<f64> {
        self.timing
            .mode
            .map(|_| self.meta.admitted.elapsed().as_secs_f64() * 1000.0)
    }

    fn decode_tps(&self) -> Option<f64> {
        let t = &self.timing;
        match t.decode_ms {
            Some(ms) if ms > 0.0 && t.decode_tokens > 0 => {
                Some(f64::from(t.decode_tokens) / (ms / 1000.0))
            }
            _ => None,
        }
    }

    fn fold(&mut self, ev: Event) -> Step {
        match ev {
            Event::Prefilled {
                prompt_tokens,
                cached_tokens,
                prefill_ms,
            } => {
                self.prompt_tokens = prompt_tokens;
                self.timing.cached_tokens = Some(cached_tokens);
                self.timing.prefill_ms = Some(prefill_ms);
                Step::Nothing
            }
            Event::Token {
                id,
                bytes,
                logprobs,
                from,
            } => {
                if self.completion_tokens == 0 {
                    self.timing.first_token_from = Some(from.as_str());
                }
                if from == Node::Decode {
                    self.timing.decode_node_tokens += 1;
                }
                self.completion_tokens += 1;
                self.token_ids.push(id);
                if let (Some(lp), true) = (logprobs, self.meta.logprobs) {
                    self.logprobs.push((bytes.clone(), lp));
                }
                let d = self.text.push(&bytes);
                if self.timing.ttft_ms.is_none() && !d.text.is_empty() {
                    self.timing.ttft_ms = Some(self.meta.received.elapsed().as_secs_f64() * 1000.0);
                }
                if d.stopped {
                    self.finish = Some(FinishReason::Stop);
                    Step::Done(d.text)
                } else if d.text.is_empty() {
                    Step::Nothing
                } else {
                    Step::Text(d.text)
                }
            }
            Event::Handoff {
                bytes,
                export_ms,
                transfer_ms,
                connect_ms,
                hash_ms,
            } => {
                self.timing.handoff_bytes = Some(bytes);
                self.timing.export_ms = Some(export_ms);
                self.timing.handoff_ms = Some(transfer_ms);
                self.timing.handoff_connect_ms = connect_ms;
                self.timing.handoff_hash_ms = hash_ms;
                Step::Nothing
            }
            Event::Finished {
                reason,
                decode_tokens,
                decode_ms,
                import_ms,
                receive_ms,
                verify_ms,
                prompt_tokens,
                prefill_ms,
            } => {
                self.finish = Some(reason);
                if self.timing.handoff_mode == Some("live") && self.timing.prefill_tokens.is_none()
                {
                    self.timing.prefill_tokens = Some(self.completion_tokens);
                }
                self.timing.decode_tokens = decode_tokens;
                self.timing.decode_ms = Some(decode_ms);
                if !self.meta.transport.colocated() {
                    self.timing.import_ms = Some(import_ms);
                    self.timing.receive_ms = Some(receive_ms);
                    self.timing.verify_ms = Some(verify_ms);
                }
                if let Some(p) = prompt_tokens {
                    self.prompt_tokens = p;
                }
                if let Some(p) = prefill_ms {
                    self.timing.prefill_ms = Some(p);
                }
                Step::Done(self.text.finish())
            }
            Event::Fallback { cause } => {
                self.timing.fallback = Some(cause);
                Step::Nothing
            }
            Event::Mode(m) => {
                self.timing.handoff_mode = Some(m.as_str());
                Step::Nothing
            }
            Event::Switched { answered } => {
                self.timing.prefill_tokens = Some(answered);
                self.timing.switch_ms = Some(self.meta.received.elapsed().as_secs_f64() * 1000.0);
                Step::Nothing
            }
            Event::HandoffCancelled { reason, bytes } => {
                self.timing.handoff_cancelled = Some(reason);
                // What crossed before it gave up (no handoff time: it did not complete).
                self.timing.handoff_bytes = (bytes > 0).then_some(bytes);
                Step::Nothing
            }
            Event::Error(e) => Step::Failed(e.into()),
        }
    }

    /// The `usage` object.
    #[must_use]
    pub fn usage(&self) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: self.completion_tokens,
            total_tokens: self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: self.timing.cached_tokens.unwrap_or(0),
            },
        }
    }

    /// The `edgesplit` extension object, built when the answer ends: its end from the
    /// request's arrival, and for an `auto` answer from its admission (what
    /// `predicted_ms` predicts).
    #[must_use]
    pub fn edgesplit(&self) -> Edgesplit<'_> {
        Edgesplit {
            timing: Timing {
                actual_ms: self.actual_ms(),
                ..self.timing.clone()
            },
            request_id: &self.meta.request_id,
            transport: self.meta.transport.as_str(),
            seed: self.meta.seed,
            decode_tokens_per_s: self.decode_tps(),
            e2e_ms: self.meta.received.elapsed().as_secs_f64() * 1000.0,
            token_ids: self.meta.return_token_ids.then_some(&self.token_ids[..]),
        }
    }

    /// [`Answer::edgesplit`] as JSON.
    #[must_use]
    pub fn timing_json(&self) -> Value {
        to_json(&self.edgesplit())
    }

    fn finish_str(&self) -> &'static str {
        self.finish.unwrap_or(FinishReason::Length).as_str()
    }

    /// The non-streaming response body for the full `text`.
    #[must_use]
    pub fn full_response(&self, text: &str) -> Value {
        let logprobs = self.logprobs_of(&self.logprobs);
        let finish_reason = self.finish_str();
        match self.meta.endpoint {
            Endpoint::Chat => {
                let message = if self.calls.is_empty() {
                    Message {
                        role: "assistant",
                        content: Some(text.to_string()),
                        tool_calls: None,
                    }
                } else {
                    // As OpenAI: the calls, and content only where the model said
                    // something first.
                    let said = text.trim();
                    Message {
                        role: "assistant",
                        content: (!said.is_empty()).then(|| said.to_string()),
                        tool_calls: Some(
                            self.calls.iter().map(|c| ToolCall::of(c, None)).collect(),
                        ),
                    }
                };
                let choice = ChatChoice {
                    index: 0,
                    message,
                    logprobs,
                    finish_reason,
                };
                to_json(&self.whole("chat.completion", choice))
            }
            Endpoint::Completion => {
                let choice = TextChoice {
                    index: 0,
                    text: text.to_string(),
                    logprobs,
                    finish_reason: Some(finish_reason),
                };
                to_json(&self.whole("text_completion", choice))
            }
        }
    }

    /// A whole response of one `choice`, with its usage and `edgesplit` object.
    fn whole<C>(&self, object: &'static str, choice: C) -> Body<'_, C> {
        Body {
            usage: Some(self.usage()),
            edgesplit: Some(self.edgesplit()),
            ..self.chunk_of(vec![choice], object)
        }
    }

    /// A chunk of `choices`.
    fn chunk_of<C>(&self, choices: Vec<C>, object: &'static str) -> Body<'_, C> {
        Body {
            id: &self.meta.id,
            object,
            created: self.meta.created,
            model: &self.meta.model,
            choices,
            usage: None,
            edgesplit: None,
        }
    }

    /// A chat chunk of one choice.
    fn chat_chunk<'a>(&'a self, choice: ChatDelta<'a>) -> Body<'a, ChatDelta<'a>> {
        self.chunk_of(vec![choice], "chat.completion.chunk")
    }

    /// A completions chunk of one choice.
    fn text_chunk_of(&self, choice: TextChoice) -> Body<'_, TextChoice> {
        self.chunk_of(vec![choice], "text_completion")
    }

    /// The first SSE chunk (chat: the role).
    #[must_use]
    pub fn role_chunk(&self) -> Option<Value> {
        match self.meta.endpoint {
            Endpoint::Chat => Some(to_json(&self.chat_chunk(ChatDelta {
                index: 0,
                delta: Delta {
                    role: Some("assistant"),
                    content: Some(String::new()),
                    tool_calls: None,
                },
                logprobs: None,
                finish_reason: None,
            }))),
            Endpoint::Completion => None,
        }
    }

    /// The `logprobs` of a choice for `entries` in the endpoint's shape; `None` (null)
    /// when the request did not ask.
    fn logprobs_of(&self, entries: &[(Vec<u8>, pb::TokenLogprobs)]) -> Option<Logprobs> {
        if !self.meta.logprobs {
            return None;
        }
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        Some(match self.meta.endpoint {
            Endpoint::Chat => {
                let one = |bytes: &[u8], logprob: f32| TokenLogprob {
                    token: text(bytes),
                    logprob,
                    bytes: bytes.to_vec(),
                    top_logprobs: None,
                };
                Logprobs::Chat {
                    content: entries
                        .iter()
                        .map(|(bytes, lp)| TokenLogprob {
                            top_logprobs: Some(
                                lp.top.iter().map(|t| one(&t.piece, t.logprob)).collect(),
                            ),
                            ..one(bytes, lp.logprob)
                        })
                        .collect(),
                    refusal: None,
                }
            }
            Endpoint::Completion => Logprobs::Completion {
                tokens: entries.iter().map(|(b, _)| text(b)).collect(),
                token_logprobs: entries.iter().map(|(_, lp)| lp.logprob).collect(),
                top_logprobs: entries
                    .iter()
                    .map(|(_, lp)| {
                        lp.top
                            .iter()
                            .map(|t| (text(&t.piece), Value::from(t.logprob)))
                            .collect()
                    })
                    .collect(),
            },
        })
    }

    /// The log-probabilities no chunk has carried yet, in the endpoint's shape.
    fn unsent_logprobs(&mut self) -> Option<Logprobs> {
        let v = self.logprobs_of(&self.logprobs[self.logprobs_sent..]);
        self.logprobs_sent = self.logprobs.len();
        v
    }

    /// A content chunk, with the log-probabilities of the tokens since the previous chunk
    /// (a token whose text is held back, as a possible stop string's start, goes with the
    /// chunk that sends it).
    pub fn text_chunk(&mut self, text: &str) -> Value {
        let logprobs = self.unsent_logprobs();
        match self.meta.endpoint {
            Endpoint::Chat => to_json(&self.chat_chunk(ChatDelta {
                index: 0,
                delta: Delta {
                    content: Some(text.to_string()),
                    ..Delta::default()
                },
                logprobs,
                finish_reason: None,
            })),
            Endpoint::Completion => to_json(&self.text_chunk_of(TextChoice {
                index: 0,
                text: text.to_string(),
                logprobs,
                finish_reason: None,
            })),
        }
    }

    /// The finish chunk(s): finish reason (with the timing report and the log-probabilities
    /// of tokens no chunk carried), then usage if asked.
    pub fn final_chunks(&mut self) -> Vec<Value> {
        let mut out = Vec::new();
        if !self.calls.is_empty() {
            // Each call whole in one delta (OpenAI streams the arguments in pieces; a
            // client joins the pieces, so one piece is the same call).
            let logprobs = self.unsent_logprobs();
            let calls: Vec<ToolCall> = self
                .calls
                .iter()
                .enumerate()
                .map(|(i, c)| ToolCall::of(c, Some(i)))
                .collect();
            out.push(to_json(&self.chat_chunk(ChatDelta {
                index: 0,
                delta: Delta {
                    tool_calls: Some(calls),
                    ..Delta::default()
                },
                logprobs,
                finish_reason: None,
            })));
        }
        let logprobs = self.unsent_logprobs();
        let finish_reason = Some(self.finish_str());
        let (finish, usage) = match self.meta.endpoint {
            Endpoint::Chat => self.finish_and_usage(
                ChatDelta {
                    index: 0,
                    delta: Delta::default(),
                    logprobs,
                    finish_reason,
                },
                "chat.completion.chunk",
            ),
            Endpoint::Completion => self.finish_and_usage(
                TextChoice {
                    index: 0,
                    text: String::new(),
                    logprobs,
                    finish_reason,
                },
                "text_completion",
            ),
        };
        out.push(finish);
        if self.meta.include_usage {
            out.push(usage);
        }
        out
    }

    /// The finish chunk (the last `choice`, with the `edgesplit` object) and the usage
    /// chunk (no choice, the usage and the `edgesplit` object).
    fn finish_and_usage<C: serde::Serialize>(
        &self,
        choice: C,
        object: &'static str,
    ) -> (Value, Value) {
        let finish = Body {
            edgesplit: Some(self.edgesplit()),
            ..self.chunk_of(vec![choice], object)
        };
        let usage: Body<'_, C> = Body {
            usage: Some(self.usage()),
            edgesplit: Some(self.edgesplit()),
            ..self.chunk_of(Vec::new(), object)
        };
        (to_json(&finish), to_json(&usage))
    }
}

/// A response shape as JSON (its types serialize infallibly: strings, numbers, maps with
/// string keys).
fn to_json<T: serde::Serialize>(v: &T) -> Value {
    serde_json::to_value(v).unwrap_or(Value::Null)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn answer(endpoint: Endpoint, include_usage: bool, stops: Vec<String>) -> Answer {
        Answer::new(
            Meta {
                id: "chatcmpl-1".into(),
                created: 1,
                model: "m".into(),
                endpoint,
                include_usage,
                request_id: "r".into(),
                transport: Transport::V2,
                received: Instant::now(),
                admitted: Instant::now(),
                return_token_ids: false,
                seed: 0,
                logprobs: false,
                tools: None,
            },
            stops,
            Some(5),
            Some(10.0),
        )
    }

    fn finished(reason: FinishReason) -> Event {
        Event::Finished {
            reason,
            decode_tokens: 2,
            decode_ms: 20.0,
            import_ms: 1.0,
            receive_ms: 3.0,
            verify_ms: 1.0,
            prompt_tokens: None,
            prefill_ms: None,
        }
    }

    #[test]
    fn tokens_then_finish() {
        let mut a = answer(Endpoint::Chat, true, vec![]);
        assert_eq!(
            a.on_event(Event::Token {
                id: 0,
                bytes: b"Hi".to_vec(),
                logprobs: None,
                from: Node::Prefill,
            }),
            Step::Text("Hi".into())
        );
        assert_eq!(
            a.on_event(Event::Handoff {
                bytes: 100,
                export_ms: 1.0,
                transfer_ms: 2.0,
                connect_ms: Some(0.5),
                hash_ms: Some(0.5),
            }),
            Step::Nothing
        );
        assert_eq!(
            a.on_event(Event::Token {
                id: 0,
                bytes: b" there".to_vec(),
                logprobs: None,
                from: Node::Prefill,
            }),
            Step::Text(" there".into())
        );
        assert_eq!(
            a.on_event(Event::Token {
                id: 0,
                bytes: vec![],
                logprobs: None,
                from: Node::Prefill,
            }),
            Step::Nothing
        );
        assert_eq!(
            a.on_event(finished(FinishReason::Stop)),
            Step::Done(String::new())
        );
        assert_eq!(
            to_json(&a.usage()),
            json!({"prompt_tokens":5,"completion_tokens":3,"total_tokens":8,
                   "prompt_tokens_details":{"cached_tokens":0}})
        );
        let t = a.timing_json();
        assert_eq!(t["handoff_bytes"], 100);
        assert_eq!(t["decode_tokens_per_s"], 100.0);
        let chunks = a.final_chunks();
        assert_eq!(chunks.len(), 2);
        assert_eq!(chunks[0]["choices"][0]["finish_reason"], "stop");
        assert_eq!(chunks[1]["choices"], json!([]));
        assert_eq!(chunks[1]["usage"]["total_tokens"], 8);
        assert_eq!(
            a.role_chunk().unwrap()["choices"][0]["delta"]["role"],
            "assistant"
        );
    }

    /// Who wrote what: the first token's node, and the decode node's tokens counted as
    /// they arrive, up to a stop string the router saw (no `Finished` from the node).
    #[test]
    fn the_answer_says_which_node_wrote_its_tokens() {
        let tok = |bytes: &[u8], from| Event::Token {
            id: 0,
            bytes: bytes.to_vec(),
            logprobs: None,
            from,
        };
        let mut a = answer(Endpoint::Completion, false, vec!["STOP".into()]);
        a.on_event(tok(b"a", Node::Prefill));
        a.on_event(tok(b"b", Node::Decode));
        assert!(matches!(
            a.on_event(tok(b"STOP", Node::Decode)),
            Step::Done(_)
        ));
        let t = a.timing_json();
        assert_eq!(t["first_token_from"], "prefill");
        assert_eq!(t["decode_node_tokens"], 2);
        let mut b = answer(Endpoint::Completion, false, vec![]);
        b.on_event(tok(b"a", Node::Decode));
        b.on_event(tok(b"b", Node::Decode));
        let t = b.timing_json();
        assert_eq!(t["first_token_from"], "decode");
        assert_eq!(t["decode_node_tokens"], 2);
    }

    #[test]
    fn stop_string_ends_the_answer_with_stop() {
        let mut a = answer(Endpoint::Completion, false, vec!["\n\n".into()]);
        assert_eq!(
            a.on_event(Event::Token {
                id: 0,
                bytes: b"a\n".to_vec(),
                logprobs: None,
                from: Node::Prefill,
            }),
            Step::Text("a".into())
        );
        assert_eq!(
            a.on_event(Event::Token {
                id: 0,
                bytes: b"\nb".to_vec(),
                logprobs: None,
                from: Node::Prefill,
            }),
            Step::Done(String::new())
        );
        assert_eq!(a.finish, Some(FinishReason::Stop));
        assert_eq!(a.completion_tokens, 2);
        assert!(a.role_chunk().is_none());
        assert_eq!(a.final_chunks().len(), 1);
        assert_eq!(a.full_response("a")["choices"][0]["text"], "a");
    }

    fn lp(logprob: f32, top: &[(&str, f32)]) -> Option<pb::TokenLogprobs> {
        Some(pb::TokenLogprobs {
            logprob,
            top: top
                .iter()
                .enumerate()
                .map(|(i, (t, l))| pb::Logprob {
                    id: i as i32,
                    piece: t.as_bytes().to_vec(),
                    logprob: *l,
                })
                .collect(),
        })
    }

    #[test]
    fn logprobs_go_with_the_chunk_that_sends_their_text() {
        let mut a = answer(Endpoint::Chat, false, vec!["\n\n".into()]);
        a.meta.logprobs = true;
        let tok = |bytes: &[u8], l| Event::Token {
            id: 1,
            bytes: bytes.to_vec(),
            logprobs: lp(l, &[("A", -0.1), ("B", -2.5)]),
            from: Node::Prefill,
        };
        assert_eq!(a.on_event(tok(b"A", -0.1)), Step::Text("A".into()));
        let c = a.text_chunk("A");
        let content = &c["choices"][0]["logprobs"]["content"];
        assert_eq!(content.as_array().unwrap().len(), 1);
        assert_eq!(content[0]["token"], "A");
        assert_eq!(content[0]["bytes"], json!([65]));
        assert_eq!(content[0]["top_logprobs"][1]["token"], "B");
        assert_eq!(content[0]["top_logprobs"][1]["logprob"], -2.5);
        // "\n" may start the stop string: held back, its logprob waits with it.
        assert_eq!(a.on_event(tok(b"\n", -1.0)), Step::Nothing);
        assert_eq!(a.on_event(tok(b"x", -0.5)), Step::Text("\nx".into()));
        let c = a.text_chunk("\nx");
        assert_eq!(
            c["choices"][0]["logprobs"]["content"]
                .as_array()
                .unwrap()
                .len(),
            2
        );
        // End of generation: no entry.
        let eog = Event::Token {
            id: 2,
            bytes: vec![],
            logprobs: None,
            from: Node::Prefill,
        };
        assert_eq!(a.on_event(eog), Step::Nothing);
        assert_eq!(
            a.on_event(finished(FinishReason::Stop)),
            Step::Done(String::new())
        );
        let last = a.final_chunks();
        assert_eq!(last[0]["choices"][0]["logprobs"]["content"], json!([]));
        let full = a.full_response("A\nx");
        assert_eq!(
            full["choices"][0]["logprobs"]["content"]
                .as_array()
                .unwrap()
                .len(),
            3
        );
        assert_eq!(a.completion_tokens, 4);
    }

    #[test]
    fn completion_logprobs_in_the_legacy_shape_and_none_unless_asked() {
        let mut a = answer(Endpoint::Completion, false, vec![]);
        a.meta.logprobs = true;
        a.on_event(Event::Token {
            id: 1,
            bytes: b" Paris".to_vec(),
            logprobs: lp(-0.25, &[(" Paris", -0.25), (" Lyon", -3.0)]),
            from: Node::Prefill,
        });
        let v = a.full_response(" Paris")["choices"][0]["logprobs"].clone();
        assert_eq!(v["tokens"], json!([" Paris"]));
        assert_eq!(v["token_logprobs"], json!([-0.25]));
        assert_eq!(v["top_logprobs"], json!([{" Paris": -0.25, " Lyon": -3.0}]));
        let mut b = answer(Endpoint::Completion, false, vec![]);
        b.on_event(Event::Token {
            id: 1,
            bytes: b"x".to_vec(),
            logprobs: lp(-0.25, &[]),
            from: Node::Prefill,
        });
        assert!(b.full_response("x")["choices"][0]["logprobs"].is_null());
        assert!(b.text_chunk("x")["choices"][0]["logprobs"].is_null());
    }

    fn token(text: &str) -> Event {
        Event::Token {
            id: 0,
            bytes: text.as_bytes().to_vec(),
            logprobs: None,
            from: Node::Prefill,
        }
    }

    /// The meter hears the length of an answer that ended well, once; not of one that
    /// failed.
    #[test]
    fn the_length_meter_hears_an_answer_that_ended() {
        use std::sync::atomic::{AtomicU32, Ordering};
        use std::sync::Arc;
        let heard = Arc::new(AtomicU32::new(u32::MAX));
        let meter = |h: &Arc<AtomicU32>| -> Box<dyn FnOnce(u32) + Send> {
            let h = h.clone();
            Box::new(move |n| h.store(n, Ordering::SeqCst))
        };
        let mut a = answer(Endpoint::Chat, false, vec![]).measuring_length(meter(&heard));
        a.on_event(token("a"));
        a.on_event(token("b"));
        assert_eq!(heard.load(Ordering::SeqCst), u32::MAX);
        a.on_event(token("c"));
        assert!(matches!(
            a.on_event(finished(FinishReason::Stop)),
            Step::Done(_)
        ));
        assert_eq!(heard.load(Ordering::SeqCst), 3);

        let failed = Arc::new(AtomicU32::new(u32::MAX));
        let mut b = answer(Endpoint::Chat, false, vec![]).measuring_length(meter(&failed));
        b.on_event(token("a"));
        let e = crate::backend::Failure::upstream(crate::backend::RouterCode::Timeout, "gone");
        assert!(matches!(b.on_event(Event::Error(e)), Step::Failed(_)));
        assert_eq!(failed.load(Ordering::SeqCst), u32::MAX);
    }

    fn with_tools() -> Answer {
        let mut a = answer(Endpoint::Chat, false, vec![]);
        let body = json!({"tools": [{"type": "function", "function": {"name": "get_time"}}]});
        a.meta.tools = crate::tools::parse(crate::error::typed(body).unwrap()).unwrap();
        a.text = TextAssembler::new(vec![]).holding_from(crate::tools::MARKER);
        a
    }

    #[test]
    fn a_call_at_the_end_becomes_tool_calls_streamed_and_whole() {
        let mut a = with_tools();
        assert_eq!(
            a.on_event(token("One moment.\n<tool")),
            Step::Text("One moment.\n".into())
        );
        assert_eq!(
            a.on_event(token("_call>\n{\"name\": \"get_time\"")),
            Step::Nothing
        );
        assert_eq!(
            a.on_event(token(", \"arguments\": {}}\n</tool_call>")),
            Step::Nothing
        );
        assert_eq!(
            a.on_event(finished(FinishReason::Stop)),
            Step::Done(String::new())
        );
        assert_eq!(a.finish, Some(FinishReason::ToolCalls));
        let whole = a.full_response("One moment.\n");
        let message = &whole["choices"][0]["message"];
        assert_eq!(message["content"], "One moment.");
        assert_eq!(message["tool_calls"][0]["function"]["name"], "get_time");
        assert_eq!(message["tool_calls"][0]["function"]["arguments"], "{}");
        assert_eq!(message["tool_calls"][0]["type"], "function");
        assert_eq!(whole["choices"][0]["finish_reason"], "tool_calls");
        let chunks = a.final_chunks();
        assert_eq!(chunks.len(), 2);
        let delta = &chunks[0]["choices"][0]["delta"]["tool_calls"][0];
        assert_eq!(delta["index"], 0);
        assert_eq!(delta["id"], message["tool_calls"][0]["id"]);
        assert_eq!(chunks[1]["choices"][0]["finish_reason"], "tool_calls");
    }

    #[test]
    fn a_broken_or_cut_call_stays_text() {
        let mut a = with_tools();
        assert_eq!(
            a.on_event(token("<tool_call>\n{\"name\": \"nope\"}\n</tool_call>")),
            Step::Nothing
        );
        let Step::Done(text) = a.on_event(finished(FinishReason::Stop)) else {
            panic!()
        };
        assert_eq!(text, "<tool_call>\n{\"name\": \"nope\"}\n</tool_call>");
        assert_eq!(
            a.full_response(&text)["choices"][0]["finish_reason"],
            "stop"
        );
        let mut a = with_tools();
        a.on_event(token("<tool_call>\n{\"name\": \"get_time\"}\n</tool_call>"));
        let Step::Done(text) = a.on_event(finished(FinishReason::Length)) else {
            panic!()
        };
        assert!(text.starts_with("<tool_call>"), "{text}");
        assert_eq!(a.final_chunks()[0]["choices"][0]["finish_reason"], "length");
    }
}
