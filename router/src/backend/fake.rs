//! Scripted nodes for the backend's unit tests: each call is answered from the script the
//! test gave it (a refusal, or a stream of messages, pauses, an error or a hang), and
//! every request is recorded for the test to read back. A call past its script is refused
//! `unimplemented`, so an unexpected call shows as an error in the answer.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use edgesplit_proto::pb;
use tonic::Status;

use super::seam::{Call, DecodeCalls, Events, PrefillCalls};

/// One step of a scripted stream.
pub(crate) enum Step<T> {
    /// A message.
    Send(T),
    /// A pause before the next step.
    Wait(Duration),
    /// The stream ends with this error.
    Fail(Status),
    /// The stream stays open and sends nothing more (a frozen node).
    Hang,
}

/// How one call is answered: refused, or a stream of steps that ends after the last.
pub(crate) type Answer<T> = Result<Vec<Step<T>>, Status>;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// One streaming method of a scripted node: the answers to its calls, in order, and the
/// requests it got.
pub(crate) struct Method<Req, T> {
    answers: Mutex<VecDeque<Answer<T>>>,
    requests: Mutex<Vec<Req>>,
}

impl<Req, T> Default for Method<Req, T> {
    fn default() -> Self {
        Self {
            answers: Mutex::default(),
            requests: Mutex::default(),
        }
    }
}

impl<Req: Clone, T: Send + 'static> Method<Req, T> {
    /// The next call is answered with `answer`.
    pub(crate) fn then(&self, answer: Answer<T>) -> &Self {
        lock(&self.answers).push_back(answer);
        self
    }

    /// The requests of every call so far.
    pub(crate) fn requests(&self) -> Vec<Req> {
        lock(&self.requests).clone()
    }

    fn call(&self, req: Req) -> Call<'_, Events<T>> {
        lock(&self.requests).push(req);
        let answer = lock(&self.answers).pop_front().unwrap_or_else(|| {
            Err(Status::unimplemented(
                "the script has no answer for this call",
            ))
        });
        Box::pin(async move { answer.map(stream) })
    }
}

/// The stream `steps` script.
fn stream<T: Send + 'static>(steps: Vec<Step<T>>) -> Events<T> {
    Box::pin(futures::stream::unfold(
        steps.into_iter(),
        |mut steps| async move {
            loop {
                match steps.next()? {
                    Step::Send(m) => return Some((Ok(m), steps)),
                    Step::Wait(d) => tokio::time::sleep(d).await,
                    Step::Fail(st) => return Some((Err(st), Vec::new().into_iter())),
                    Step::Hang => std::future::pending::<()>().await,
                }
            }
        },
    ))
}

/// A node's `Info`: the same answer to every call until the test changes it.
pub(crate) struct Info {
    answer: Mutex<Result<pb::NodeInfo, Status>>,
    calls: AtomicUsize,
}

impl Info {
    fn new(info: pb::NodeInfo) -> Self {
        Self {
            answer: Mutex::new(Ok(info)),
            calls: AtomicUsize::new(0),
        }
    }

    /// Every later call is answered with `answer`.
    pub(crate) fn set(&self, answer: Result<pb::NodeInfo, Status>) {
        *lock(&self.answer) = answer;
    }

    fn call(&self) -> Call<'_, pb::NodeInfo> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let answer = lock(&self.answer).clone();
        Box::pin(async move { answer })
    }
}

/// A scripted prefill node.
pub(crate) struct FakePrefill {
    pub(crate) prefill: Method<pb::PrefillRequest, pb::PrefillEvent>,
    pub(crate) generate: Method<pb::PrefillRequest, pb::TokenEvent>,
    pub(crate) info: Info,
}

/// A scripted decode node.
pub(crate) struct FakeDecode {
    pub(crate) generate: Method<pb::GenerateRequest, pb::TokenEvent>,
    pub(crate) local: Method<pb::PrefillRequest, pb::TokenEvent>,
    pub(crate) info: Info,
}

/// Both nodes render chats with this template.
const TEMPLATE: &str = "template-1";

impl Default for FakePrefill {
    fn default() -> Self {
        Self {
            prefill: Method::default(),
            generate: Method::default(),
            info: Info::new(pb::NodeInfo {
                role: "prefill".into(),
                chat_template_fingerprint: TEMPLATE.into(),
                kv_bytes_per_token: 1000,
                ..pb::NodeInfo::default()
            }),
        }
    }
}

impl Default for FakeDecode {
    fn default() -> Self {
        Self {
            generate: Method::default(),
            local: Method::default(),
            info: Info::new(pb::NodeInfo {
                role: "decode".into(),
                chat_template_fingerprint: TEMPLATE.into(),
                kv_bytes_per_token: 1000,
                handoff_addr: "127.0.0.1:7001".into(),
                v1_url: "http://127.0.0.1:7002/v1/kv".into(),
                ..pb::NodeInfo::default()
            }),
        }
    }
}

impl FakeDecode {
    /// The `Info` a scripted decode node answers until a test changes it.
    pub(crate) fn info_answer(&self) -> pb::NodeInfo {
        lock(&self.info.answer).clone().unwrap_or_default()
    }
}

impl PrefillCalls for FakePrefill {
    fn prefill(&self, req: pb::PrefillRequest) -> Call<'_, Events<pb::PrefillEvent>> {
        self.prefill.call(req)
    }

    fn generate(&self, req: pb::PrefillRequest) -> Call<'_, Events<pb::TokenEvent>> {
        self.generate.call(req)
    }

    fn info(&self) -> Call<'_, pb::NodeInfo> {
        self.info.call()
    }
}

impl DecodeCalls for FakeDecode {
    fn generate(&self, req: pb::GenerateRequest) -> Call<'_, Events<pb::TokenEvent>> {
        self.generate.call(req)
    }

    fn local(&self, req: pb::PrefillRequest) -> Call<'_, Events<pb::TokenEvent>> {
        self.local.call(req)
    }

    fn info(&self) -> Call<'_, pb::NodeInfo> {
        self.info.call()
    }
}

/// The nodes' messages, as a script writes them.
pub(crate) mod msg {
    use edgesplit_proto::pb;
    use pb::prefill_event::Event as P;
    use pb::token_event::Event as T;

    use super::Step;

    fn p(e: P) -> Step<pb::PrefillEvent> {
        Step::Send(pb::PrefillEvent { event: Some(e) })
    }

    fn t(e: T) -> Step<pb::TokenEvent> {
        Step::Send(pb::TokenEvent { event: Some(e) })
    }

    fn piece(id: i32) -> Vec<u8> {
        format!(" t{id}").into_bytes()
    }

    /// A split's first token `id` of an answer of at most `max_tokens`, after a prompt of
    /// `prompt_tokens`.
    pub(crate) fn first(id: i32, prompt_tokens: u32, max_tokens: u32) -> Step<pb::PrefillEvent> {
        p(P::First(pb::FirstToken {
            token: id,
            piece: piece(id),
            prompt_tokens,
            prefill_ms: 10.0,
            max_tokens,
            ..pb::FirstToken::default()
        }))
    }

    /// A live answer's token written on the prefill node.
    pub(crate) fn live_token(id: i32) -> Step<pb::PrefillEvent> {
        p(P::Token(pb::Token {
            id,
            piece: piece(id),
            logprobs: None,
        }))
    }

    /// The handoff after the answer is done.
    pub(crate) fn handed_off() -> Step<pb::PrefillEvent> {
        p(P::Handoff(pb::HandoffDone {
            bytes: 4096,
            export_ms: 1.0,
            transfer_ms: 2.0,
            ..pb::HandoffDone::default()
        }))
    }

    /// The live switch after the answer's `answered`-th token.
    pub(crate) fn switched(answered: u32) -> Step<pb::PrefillEvent> {
        p(P::Switched(pb::Switched {
            answered,
            bytes: 4096,
            rounds: 2,
            ..pb::Switched::default()
        }))
    }

    /// The decode node holds a live answer that ended on the prefill node.
    pub(crate) fn kept(answered: u32) -> Step<pb::PrefillEvent> {
        p(P::Kept(pb::Switched {
            answered,
            bytes: 4096,
            rounds: 1,
            ..pb::Switched::default()
        }))
    }

    /// The live handoff gave up.
    pub(crate) fn cancelled(reason: &str) -> Step<pb::PrefillEvent> {
        p(P::Cancelled(pb::HandoffCancelled {
            reason: reason.into(),
            bytes: 1024,
        }))
    }

    /// A live answer ended on the prefill node after `generated` tokens.
    pub(crate) fn live_finished(generated: u32) -> Step<pb::PrefillEvent> {
        p(P::Finished(finished_msg(generated)))
    }

    fn finished_msg(generated: u32) -> pb::Finished {
        pb::Finished {
            reason: pb::FinishReason::Length as i32,
            generated,
            decode_ms: 5.0,
            ..pb::Finished::default()
        }
    }

    /// A colocated answer's prefill report.
    pub(crate) fn prefilled(prompt_tokens: u32, cached_tokens: u32) -> Step<pb::TokenEvent> {
        t(T::Prefilled(pb::Prefilled {
            prompt_tokens,
            prefill_ms: 10.0,
            cached_tokens,
        }))
    }

    /// A token of a token stream.
    pub(crate) fn token(id: i32) -> Step<pb::TokenEvent> {
        t(T::Token(pb::Token {
            id,
            piece: piece(id),
            logprobs: None,
        }))
    }

    /// The end of a token stream after `generated` tokens.
    pub(crate) fn finished(generated: u32) -> Step<pb::TokenEvent> {
        t(T::Finished(finished_msg(generated)))
    }
}
