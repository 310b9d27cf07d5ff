//! The phone's prefill speed, probed when nothing else measures it.
//!
//! The router measures the decode node's prefill only when that node prefills a request
//! (the phone alone, or a held conversation's new turn), and `transport: "auto"` weighs the
//! phone alone only once that speed is measured: so a router whose clients never name
//! `phone` would never consider it (the throughput runs at 8 clients on slow-wifi: every
//! `auto` choice said "not yet measured: phone", where the phone alone is the one mode that
//! puts the phone to work). The issue asked for a probe at start; it is made at the first
//! `auto` request that finds the speed unmeasured instead, so a router that never chooses
//! does not load the phone: one prompt of [`PROBE_SENTENCES`] sentences (~330 tokens),
//! prefilled on the decode node with nothing cached and [`PROBE_ANSWER_TOKENS`] answer
//! tokens, in the background (the request that started it is not delayed), counted on the
//! phone's load while it runs. Its prefill report and its answer's decode speed are
//! recorded as any other's (the answer itself is dropped); a probe that measured nothing is
//! tried again after [`PROBE_AGAIN`].

use std::time::{Duration, Instant};

use edgesplit_proto::pb;

use super::load::{decoded, Work};
use super::nodes::lock;
use super::stream::next_event;
use super::{Backend, Event, Node};
use crate::api::ValidRequest;

/// The probe's prompt: this sentence, repeated.
const PROBE_SENTENCE: &str = "A phone reads this sentence once so that the router \
                              learns how fast it reads a prompt. ";

/// How many times (about 17 tokens each).
const PROBE_SENTENCES: usize = 20;

/// The probe's answer tokens: enough to measure the decode speed too
/// (`placement::Rates::decoded` needs 8).
const PROBE_ANSWER_TOKENS: u32 = 16;

/// How long after a probe that measured nothing the next may start.
const PROBE_AGAIN: Duration = Duration::from_secs(60);

impl Backend {
    /// Starts the probe of the decode node's prefill speed in the background, unless it is
    /// measured or a probe started within [`PROBE_AGAIN`]. `req` lends its sampling options
    /// (its answer is dropped).
    pub(super) fn probe_phone_prefill(&self, req: &ValidRequest) {
        {
            let mut l = lock(&self.learned);
            let recent = l.probed.is_some_and(|t| t.elapsed() < PROBE_AGAIN);
            if l.rates.measured().phone_prefill.is_some() || recent {
                return;
            }
            l.probed = Some(Instant::now());
        }
        let prompt = PROBE_SENTENCE.repeat(PROBE_SENTENCES);
        let mut sampling: pb::Sampling = (&req.sampling).into();
        sampling.logprobs = None;
        sampling.json_schema.clear();
        sampling.tool_call_schema.clear();
        let preq = pb::PrefillRequest {
            request_id: "probe-phone-prefill".into(),
            input: Some(pb::prefill_request::Input::Prompt(prompt)),
            sampling: Some(sampling),
            max_tokens: PROBE_ANSWER_TOKENS,
            no_cache: true,
            ..pb::PrefillRequest::default()
        };
        let mut client = self.decode.clone();
        let (learned, load) = (self.learned.clone(), self.load.clone());
        let (bound, idle) = (
            self.config.first_token_timeout,
            self.config.token_idle_timeout,
        );
        let chars = PROBE_SENTENCE.len() * PROBE_SENTENCES;
        tokio::spawn(async move {
            let work = Work {
                prefill: lock(&learned).rates.tokens_of(chars),
                decode: f64::from(PROBE_ANSWER_TOKENS),
                extra_ms: 0.0,
            };
            let busy = load.take_work(&learned, true, work);
            let start = async {
                let mut stream = client.local(preq).await?.into_inner();
                let first = stream.message().await?;
                Ok::<_, tonic::Status>((stream, first))
            };
            let mut stream = match tokio::time::timeout(bound, start).await {
                Ok(Ok((
                    stream,
                    Some(pb::TokenEvent {
                        event: Some(pb::token_event::Event::Prefilled(p)),
                    }),
                ))) => {
                    let tokens = p.prompt_tokens.saturating_sub(p.cached_tokens);
                    lock(&learned).rates.prefilled(true, tokens, p.prefill_ms);
                    tracing::info!(
                        tokens,
                        prefill_ms = p.prefill_ms,
                        "the decode node's prefill speed probed"
                    );
                    stream
                }
                other => {
                    let why = match other {
                        Ok(Err(st)) => st.message().to_string(),
                        Err(_) => format!("no answer within {bound:?}"),
                        Ok(Ok(_)) => "no prefill report".to_string(),
                    };
                    tracing::warn!(reason = %why, "the decode node's prefill probe measured nothing");
                    return;
                }
            };
            // The answer's tokens measure the decode speed too, when it writes enough.
            loop {
                let ev = next_event(&mut stream, idle, Node::Decode, false, "prompt").await;
                decoded(&learned, &busy, &ev);
                if matches!(ev, Event::Finished { .. } | Event::Error(_)) {
                    return;
                }
            }
        });
    }
}
