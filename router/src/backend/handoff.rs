//! A split answer's start: the decode node's `Info` and the prefill overlap, the
//! prefill starts with its handoff, and once its first token is known the answer goes to
//! `split`'s state machine.

use tokio::sync::mpsc;

use edgesplit_proto::pb;

use super::conversation::Transcript;
use super::load::{answer_tokens, Work};
use super::nodes::lock;
use super::seam::{message, Events};
use super::split::{Counted, SplitAnswer, Waits};
use super::RouterCode;
use super::{input_param, Backend, Failure, HeldFirst, PrefilledOn, Started};
use crate::api::{HandoffMode, Transport, ValidRequest};

/// Where a split request's state goes on the decode node `info` describes.
fn target(info: &pb::NodeInfo, transport: Transport) -> (&str, pb::HandoffTransport) {
    if transport == Transport::V1 {
        (&info.v1_url, pb::HandoffTransport::V1)
    } else {
        (&info.handoff_addr, pb::HandoffTransport::V2)
    }
}

/// `addr` (a handoff address or upload URL a decode node advertises) with an unspecified
/// host (`0.0.0.0`, `[::]`: a node listening on every interface, as a joined device does)
/// made the host of the node's `decode_url`, where the router reaches it.
fn reachable(addr: &str, decode_url: &str) -> String {
    let Some(authority) = decode_url
        .split_once("://")
        .map(|(_, a)| a.split('/').next().unwrap_or(a))
    else {
        return addr.to_string();
    };
    let host = if authority.starts_with('[') {
        authority.split_inclusive(']').next().unwrap_or(authority)
    } else {
        authority.rsplit_once(':').map_or(authority, |(h, _)| h)
    };
    let (scheme, rest) = match addr.split_once("://") {
        Some((scheme, rest)) => (Some(scheme), rest),
        None => (None, addr),
    };
    for unspecified in ["0.0.0.0:", "[::]:"] {
        if let Some(port_on) = rest.strip_prefix(unspecified) {
            return match scheme {
                Some(s) => format!("{s}://{host}:{port_on}"),
                None => format!("{host}:{port_on}"),
            };
        }
    }
    addr.to_string()
}

impl Backend {
    /// A split request. The decode node's `Info` (is it there, where does the state go, its
    /// KV budget) and the prefill overlap: the prefill starts at once towards the addresses
    /// of the last `Info` answered, and stands only if this request's own `Info` agrees;
    /// if that `Info` fails or names another address or budget, the early prefill is
    /// dropped (which cancels it) and the request goes on as it would without it. So a
    /// split request does not wait one round trip of the link before its prefill, and
    /// decides as it would after that round trip.
    ///
    /// First, when the request continues a conversation the decode node holds, the decode
    /// node may prefill the new part itself ([`Backend::continue_on_decode_node`]); when it
    /// refuses or cannot, the request is split as any other, in handoff `mode` over
    /// `transport` (v2 or v1; a [`Route`]'s).
    pub(super) async fn start_split(
        &self,
        req: &ValidRequest,
        (transport, mode): (Transport, HandoffMode),
        request_id: &str,
        first: HeldFirst,
    ) -> Result<Started, Failure> {
        let param = input_param(&req.input);
        let base_max = match self.held_turn(req, transport, request_id, first).await {
            Ok(started) => return Ok(started),
            Err(base_max) => base_max,
        };
        let (prefill_work, written_while_crossing) = self.split_work(req, mode);
        let prefill_busy = self.load.take_work(&self.learned, false, prefill_work);
        let last = self.known.decode();
        let tried_early = last
            .as_ref()
            .is_some_and(|l| !target(l, transport).0.is_empty());
        let (decode_info, early) = match last {
            Some(last) if tried_early => {
                let info = self.decode_info();
                let early = self.split_prefill(
                    req,
                    request_id,
                    request_id,
                    (transport, mode),
                    &last,
                    base_max,
                );
                tokio::pin!(info, early);
                let mut done = None;
                let info = loop {
                    tokio::select! {
                        i = &mut info => break i,
                        e = &mut early, if done.is_none() => done = Some(e),
                    }
                };
                match &info {
                    Ok(i)
                        if target(i, transport) == target(&last, transport)
                            && i.kv_budget_bytes == last.kv_budget_bytes =>
                    {
                        let e = match done {
                            Some(e) => e,
                            None => early.await,
                        };
                        (info, Some(e))
                    }
                    _ => (info, None),
                }
            }
            _ => (self.decode_info().await, None),
        };
        // No decode node to take the answer (asleep, gone, draining): answer here under
        // the fallback policy, else refuse before prefilling.
        let decode_info = match decode_info {
            Ok(i) => i,
            Err(e) if self.config.fallback && e.is(RouterCode::DecodeUnavailable) => {
                return self
                    .answer_here_instead(req, request_id, &e, transport)
                    .await;
            }
            Err(e) => return Err(e),
        };
        // A dropped early prefill may have reached the decode node under the request's id:
        // the new one takes another.
        let handoff_id = if tried_early && early.is_none() {
            format!("{request_id}-2")
        } else {
            request_id.to_string()
        };
        let (pstream, first) = match early {
            Some(e) => e?,
            None => {
                self.split_prefill(
                    req,
                    request_id,
                    &handoff_id,
                    (transport, mode),
                    &decode_info,
                    base_max,
                )
                .await?
            }
        };
        lock(&self.learned).rates.prefilled(
            false,
            first.prompt_tokens.saturating_sub(first.cached_tokens),
            first.prefill_ms,
        );
        prefill_busy.prefilled(&self.learned, Work::answer(written_while_crossing));
        let (tx, rx) = mpsc::channel(64);
        let started = Started {
            transport,
            prompt_tokens: Some(first.prompt_tokens),
            cached_tokens: Some(first.cached_tokens),
            prefill_ms: Some(first.prefill_ms),
            placement: PrefilledOn::PrefillNode,
            choice: None,
            events: rx,
        };
        let greq = pb::GenerateRequest {
            request_id: request_id.to_string(),
            handoff_id,
            sampling: Some((&req.sampling).into()),
            max_new_tokens: first.max_tokens.saturating_sub(1),
            first_token: Some(first.token),
            answered: 1,
            base_tokens: Vec::new(),
            base_digest: Vec::new(),
        };
        let fallback = self.fallback(req, request_id);
        let transcript = Transcript {
            learned: self.learned.clone(),
            input: req.input.clone(),
            prompt_tokens: first.prompt_tokens,
            text: Vec::new(),
            tokens: Vec::new(),
            replay: self.replay(req, request_id),
            written_on_prefill_node: false,
        };
        let split = SplitAnswer {
            transcript: Some(transcript),
            // Every token the client has been sent, the first included.
            sent: vec![first.token],
            first,
            decode: self.decode.clone(),
            generate: greq,
            tx,
            waits: Waits {
                idle: self.config.token_idle_timeout,
                handoff_error_grace: self.config.handoff_error_grace,
                handoff_report_wait: self.config.handoff_report_wait,
            },
            param,
            mode,
            keep: self.keeps(req, mode),
            counted: Counted {
                learned: self.learned.clone(),
                load: self.load.clone(),
                prefill_busy: Some(prefill_busy),
                decode_busy: None,
                answer_tokens: answer_tokens(req, &self.learned),
                first_sent: std::time::Instant::now(),
            },
        };
        tokio::spawn(split.run(pstream, fallback));
        Ok(started)
    }

    /// Starts the prefill of a split request with its state going to the decode node
    /// `info` describes; returns the stream once its first token is known.
    pub(super) async fn split_prefill(
        &self,
        req: &ValidRequest,
        request_id: &str,
        handoff_id: &str,
        (transport, mode): (Transport, HandoffMode),
        info: &pb::NodeInfo,
        base_max: u32,
    ) -> Result<(Events<pb::PrefillEvent>, pb::FirstToken), Failure> {
        let param = input_param(&req.input);
        let (addr, wire) = target(info, transport);
        let addr = &reachable(addr, &self.decode_url());
        if addr.is_empty() {
            return Err(Failure::unavailable(
                RouterCode::DecodeUnavailable,
                format!(
                    "the decode node advertises no {} handoff address",
                    transport.as_str()
                ),
            ));
        }
        let preq = Self::prefill_request(
            req,
            request_id,
            Some(pb::Handoff {
                handoff_id: handoff_id.to_string(),
                decode_addr: addr.to_string(),
                transport: wire as i32,
                live: mode == HandoffMode::Live,
                keep: self.keeps(req, mode),
                // The decode node's cached prefix this prompt goes on from, as remembered
                // (it checks the prefix's bytes before it joins the tail on).
                base_max: if self.keeps(req, mode) && wire == pb::HandoffTransport::V2 {
                    base_max
                } else {
                    0
                },
                decode_key: self.decode_key.clone(),
            }),
            info.kv_budget_bytes,
        );
        let mut pstream = self.first_within(self.prefill.prefill(preq), param).await?;
        match self.first_within(message(&mut pstream), param).await? {
            Some(pb::PrefillEvent {
                event: Some(pb::prefill_event::Event::First(f)),
            }) => Ok((pstream, f)),
            _ => Err(Failure::upstream(
                RouterCode::ProtocolError,
                "the prefill node did not send a first token",
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::reachable;

    #[test]
    fn an_unspecified_advertised_host_is_the_nodes_url_host() {
        let url = "http://10.0.0.2:50052";
        assert_eq!(reachable("0.0.0.0:50061", url), "10.0.0.2:50061");
        assert_eq!(reachable("[::]:50061", url), "10.0.0.2:50061");
        assert_eq!(
            reachable("https://0.0.0.0:50062/v1/handoff", url),
            "https://10.0.0.2:50062/v1/handoff"
        );
        assert_eq!(
            reachable("0.0.0.0:1", "http://[fd00::2]:50052"),
            "[fd00::2]:1"
        );
        assert_eq!(reachable("192.168.1.5:50061", url), "192.168.1.5:50061");
        assert_eq!(reachable("", url), "");
    }
}
